"""KvpeerTier's ``sources`` inside vLLM 0.33's real TieringOffloadingManager: a request that no
router names a producer for asks the source that owns its prefix (rendezvous hashing of its
root chunk, the function pool nodes admit by), a request with a router's hint asks the hint
first and the owner for the rest and loads from both, a request whose root is not known asks
every source once, and a source that is gone costs one lookup timeout. Every case checks from
the sources' side who was asked and who wrote (their node counters) and from the consumer's
side which bytes landed.

The sources here are KvpeerTier engines (a source is any kvpeer or vLLM P2P producer: a pool
node or a peer); the Rust pull over real pool nodes is crates/kvpeer/tests/sources.rs.
"""

import socket

from harness import Engine, free_port, make_key
from kvpeer import _native
from test_kvpeer_tier import (
    BLOCK_LEN,
    NUM_CHUNKS,
    kvpeer_tier,
    produce,
    random_blocks,
    settle,
    source,
    wait_lookup,
)

CHUNKS = 6


def prefix(name: str) -> list:
    return [make_key(f"{name}-{i}") for i in range(CHUNKS)]


def owned_by(sources: list[str], owner: str, name: str) -> list:
    """A prefix whose root chunk `sources` gives to `owner`."""
    for n in range(1000):
        keys = prefix(f"{name}{n}")
        if sources[_native.shard_owner(sources, bytes(keys[0]))] == owner:
            return keys
    raise AssertionError("no prefix for that owner")


def served(e: Engine) -> tuple[int, int]:
    """(lookups served, blocks written to peers), from the source's own node."""
    stats = e.tier.node_stats()
    return stats["lookups_served"], stats["fetch_blocks_served"]


def producers(engines, n: int) -> list[Engine]:
    return [engines(kvpeer_tier(), NUM_CHUNKS, BLOCK_LEN) for _ in range(n)]


def consumer(engines, sources: list[str], **extra) -> Engine:
    return engines(kvpeer_tier(sources=sources, **extra), NUM_CHUNKS, BLOCK_LEN)


def load_all(srcs: list[Engine], b: Engine, keys, blocks, params=None, req_id="b-req") -> None:
    req = b.new_request(req_id, params)
    hits, answers = wait_lookup([*srcs, b], b, keys, req)
    assert hits == len(keys), answers
    assert b.load(keys, req) == blocks
    b.finish(req)
    settle(*srcs, b)


def test_a_request_with_no_hint_asks_only_the_source_that_owns_its_prefix(engines):
    a, c = producers(engines, 2)
    sources = [a.tier.peer_id, c.tier.peer_id]
    b = consumer(engines, sources)
    for owner, other, name in ((a, c, "a"), (c, a, "c")):
        keys = owned_by(sources, owner.tier.peer_id, name)
        blocks = random_blocks(CHUNKS, hash(name) % 1000)
        produce(owner, keys, blocks, req_id=f"{name}-own")
        before_owner, before_other = served(owner), served(other)
        load_all([a, c], b, keys, blocks, req_id=f"b-{name}")
        # One lookup to the owner, which wrote every block; the other was not asked.
        assert served(owner)[0] == before_owner[0] + 1
        assert served(owner)[1] == before_owner[1] + CHUNKS
        assert served(other) == before_other
        assert [b.read(k) for k in keys] == blocks
        assert [owner.pins(k) for k in keys] == [0] * CHUNKS


def test_a_hint_is_asked_first_and_the_owner_gives_the_rest_in_one_load(engines):
    hinted, o, x = producers(engines, 3)
    sources = [o.tier.peer_id, x.tier.peer_id]
    b = consumer(engines, sources)
    keys = owned_by(sources, o.tier.peer_id, "h")
    blocks = random_blocks(CHUNKS, 7)
    # The router's engine holds the first half; the owner the whole prefix.
    produce(hinted, keys[:3], blocks[:3], req_id="hint-own")
    produce(o, keys, blocks, req_id="o-own")
    load_all([hinted, o, x], b, keys, blocks, params=source(hinted, "router-kv-1"))
    assert served(hinted) == (1, 3), "the hint was asked everything and wrote its half"
    assert served(o) == (1, 3), "the owner was asked the rest and wrote it"
    assert served(x) == (0, 0)
    with b._scope():
        counted = b.tier.get_stats().reduce()
    assert counted["vllm:kv_offload_kvpeer_loaded_blocks"] == CHUNKS, counted
    assert counted["vllm:kv_offload_kvpeer_lookup_keys"] == CHUNKS + 3, counted


def test_a_request_whose_root_is_not_known_asks_every_source_once(engines):
    a, c = producers(engines, 2)
    sources = [a.tier.peer_id, c.tier.peer_id]
    b = consumer(engines, sources)
    keys = owned_by(sources, c.tier.peer_id, "r")
    blocks = random_blocks(CHUNKS, 9)
    produce(c, keys, blocks, req_id="c-own")
    # The request's first key asked is its third chunk (vLLM's end-token positions say so),
    # and the request records no position for its root: the root is not known.
    req = b.new_request("b-mid")
    for i, key in enumerate(keys[2:]):
        req.set_offload_key_position(key, (i + 3) * b.tokens_per_chunk)
    hits, answers = wait_lookup([a, c, b], b, keys[2:], req)
    assert hits == CHUNKS - 2, answers
    assert b.load(keys[2:], req) == blocks[2:]
    b.finish(req)
    settle(a, c, b)
    assert served(a) == (1, 0), "asked once, held nothing, wrote nothing"
    assert served(c) == (1, CHUNKS - 2)
    with b._scope():
        counted = b.tier.get_stats().reduce()
    assert counted["vllm:kv_offload_kvpeer_unknown_roots"] == 1, counted
    # A later turn: the prefix's first chunks are cached here, so its first key asked is the
    # fourth, but vLLM recorded the position of every key of the request, the root's too: the
    # owner alone is asked.
    keys2 = owned_by(sources, a.tier.peer_id, "s")
    blocks2 = random_blocks(CHUNKS, 10)
    produce(a, keys2, blocks2, req_id="a-own")
    before_a, before_c = served(a), served(c)
    req = b.new_request("b-later")
    for i, key in enumerate(keys2):
        req.set_offload_key_position(key, (i + 1) * b.tokens_per_chunk)
    assert wait_lookup([a, c, b], b, keys2[3:], req)[0] == CHUNKS - 3
    assert b.load(keys2[3:], req) == blocks2[3:]
    b.finish(req)
    settle(a, c, b)
    assert served(a) == (before_a[0] + 1, before_a[1] + CHUNKS - 3)
    assert served(c) == before_c, "the owner alone was asked"


def test_a_source_that_is_gone_costs_one_lookup_timeout_and_the_live_one_serves(engines):
    (a,) = producers(engines, 1)
    # A port nothing listens on, and one that accepts and never answers.
    gone = f"127.0.0.1:{free_port()}"
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        silent_id = f"127.0.0.1:{silent.getsockname()[1]}"
        sources = [a.tier.peer_id, gone, silent_id]
        b = consumer(engines, sources, lookup_timeout_s=1, handshake_timeout_s=1)
        for dead in (gone, silent_id):
            keys = owned_by(sources, dead, f"d{dead[-5:]}")
            req = b.new_request(f"b-dead-{dead}")
            hits, answers = wait_lookup([a, b], b, keys, req)
            assert hits == 0, answers
            b.finish(req)
            assert all(b.read(k) is None for k in keys)
        keys = owned_by(sources, a.tier.peer_id, "live")
        blocks = random_blocks(CHUNKS, 11)
        produce(a, keys, blocks, req_id="a-live")
        load_all([a], b, keys, blocks, req_id="b-live")
    finally:
        silent.close()
