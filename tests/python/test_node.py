"""`kvpeer.Node` from Python: two nodes on this machine share blocks byte-exact (shm and tcp),
lookups answer per key, a bad setting names its key, a dead peer is a bounded error."""

import os
import socket

import pytest

import kvpeer

BLOCK_LEN = 4096


def node(plane: str, **settings) -> kvpeer.Node:
    return kvpeer.Node(
        {"num_blocks": "32", "block_len": str(BLOCK_LEN), "plane": plane, **settings},
        tag="pytest",
    )


@pytest.mark.parametrize("plane", ["shm", "tcp", "both"])
def test_a_node_fetches_another_nodes_blocks_byte_exact(plane):
    producer, consumer = node(plane), node(plane)
    try:
        blocks = {os.urandom(36): os.urandom(BLOCK_LEN) for _ in range(6)}
        producer.store(blocks)
        keys = list(blocks)
        absent = os.urandom(36)
        assert consumer.lookup(producer.id, keys + [absent], kv_request_id="probe") == [True] * 6 + [False]
        fetched = consumer.fetch(producer.id, keys + [absent], kv_request_id="pull")
        assert sorted(fetched) == sorted(keys)
        assert all(consumer.read(k) == blocks[k] for k in keys)
        assert consumer.read(absent) is None
        served = producer.stats()
        assert served["fetch_blocks_served"] == 6 and served["lookups_served"] >= 2
        assert consumer.stats()["bytes_fetched"] == 6 * BLOCK_LEN
    finally:
        consumer.shutdown(0.5)
        producer.shutdown(0.5)


def test_a_bad_setting_names_its_key():
    with pytest.raises(kvpeer.ConfigError) as e:
        kvpeer.Node({"block_len": "0"})
    assert e.value.args[1] == "block_len"
    with pytest.raises(kvpeer.ConfigError) as e:
        kvpeer.Node({"no_such_key": "1"})
    assert e.value.args[1] == "no_such_key"


def test_a_silent_peer_is_a_bounded_error():
    # A socket that accepts and never answers: the lookup gives up at its timeout.
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    consumer = node("tcp")
    try:
        with pytest.raises((TimeoutError, kvpeer.KvpeerError)):
            consumer.lookup(f"127.0.0.1:{silent.getsockname()[1]}", [os.urandom(36)], timeout_s=0.5)
    finally:
        consumer.shutdown(0.1)
        silent.close()
