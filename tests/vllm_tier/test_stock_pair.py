"""vLLM 0.33's stock p2p tier (P2PSecondaryTierManager, ZmqTransport + NixlTransport) between two
engines in one process, each a real TieringOffloadingManager driven by the harness: proves the
harness moves blocks byte-exact before kvpeer's tier is put in it.

Every wait is a bounded `drive` loop (a few seconds at most); ports are picked free.
"""

import errno

import numpy as np
import pytest
import zmq

from harness import Engine, drive, free_port, make_key, open_stock_session

NUM_CHUNKS = 16
BLOCK_LEN = 4096
TIMEOUT_S = 8.0


def p2p(port: int) -> dict:
    return {"type": "p2p", "host": "127.0.0.1", "port": port}


def random_blocks(n: int, seed: int, block_len: int = BLOCK_LEN) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(block_len) for _ in range(n)]


def p2p_engine(engines, block_len: int = BLOCK_LEN, **kwargs) -> Engine:
    """An engine with the stock p2p tier on a free port (another pick if it was taken since)."""
    for attempt in range(3):
        try:
            return engines(p2p(free_port()), NUM_CHUNKS, block_len, **kwargs)
        except zmq.ZMQError as exc:
            if exc.errno != errno.EADDRINUSE or attempt == 2:
                raise
    raise AssertionError("unreachable")


def pair(engines, *, poll_s: float = 0, b_kwargs: dict | None = None) -> tuple[Engine, Engine]:
    a = p2p_engine(engines, engine_id="A", tier_poll_interval_s=poll_s)
    b = p2p_engine(engines, **{"engine_id": "B", "tier_poll_interval_s": poll_s, **(b_kwargs or {})})
    return a, b


def produce(a: Engine, keys, blocks, kv_transfer_params=None) -> None:
    """A computes the blocks: offloads them to its CPU tier (and cascades to its p2p tier)."""
    req = a.new_request("a-req", kv_transfer_params)
    assert a.put(keys, blocks, req) == keys
    a.finish(req)
    a.step()
    assert [a.read(k) for k in keys] == blocks


def source(a: Engine, kv_request_id: str = "kv-1") -> dict:
    return {
        "remote_kv_source": {
            "kv_request_id": kv_request_id,
            "remote_host": "127.0.0.1",
            "remote_port": a.port,
        }
    }


def wait_lookup(a: Engine, b: Engine, keys, req) -> tuple[int, list[tuple[str, ...]]]:
    """B's scheduler asks every step until the lookup resolves (not None); A and B step in
    turn meanwhile. Returns the hit count and B's per-step lookup answers (for messages)."""
    answers: list[tuple[str, ...]] = []
    hits: list[int] = []

    open_stock_session([a, b], b, a.port)

    def resolved() -> bool:
        n = b.lookup(keys, req)
        answers.append(tuple(r.name for r in b.last_lookup))
        if n is not None:
            hits.append(n)
        return n is not None

    drive([a, b], resolved, timeout_s=TIMEOUT_S)
    return hits[0], answers


def settle(a: Engine, b: Engine) -> None:
    """Step both until neither manager waits on a tier job (serve and promotion jobs reported)."""
    drive([a, b], lambda: a.jobs_in_flight() == 0 and b.jobs_in_flight() == 0, timeout_s=TIMEOUT_S)


@pytest.mark.parametrize("poll_s", [0, 0.001], ids=["stepped", "tier-poll-thread"])
def test_symmetric_pull_is_byte_exact(engines, poll_s):
    a, b = pair(engines, poll_s=poll_s)
    keys = [make_key(f"sym-{i}") for i in range(8)]
    blocks = random_blocks(len(keys), seed=1)
    produce(a, keys, blocks)

    req = b.new_request("b-req", source(a))
    hits, answers = wait_lookup(a, b, keys, req)
    assert hits == len(keys), answers
    # The first lookups wait for A (RETRY), then the promotion runs (HIT_PENDING), then HIT.
    assert answers[0] == ("RETRY",) * len(keys), answers
    assert answers[-1] == ("HIT",) * len(keys), answers

    assert [b.read(k) for k in keys] == blocks
    assert b.load(keys, req) == blocks
    b.finish(req)
    settle(a, b)
    # Nothing stays pinned on either side: A's serve jobs and B's loads all completed.
    assert [a.pins(k) for k in keys] == [0] * len(keys)
    assert [b.pins(k) for k in keys] == [0] * len(keys)
    assert [a.read(k) for k in keys] == blocks


def test_symmetric_partial_prefix(engines):
    """A holds the first 3 of 5 keys: B's prefix lookup stops at A's first MISS."""
    a, b = pair(engines)
    keys = [make_key(f"part-{i}") for i in range(5)]
    blocks = random_blocks(3, seed=2)
    produce(a, keys[:3], blocks)

    req = b.new_request("b-req", source(a))
    hits, answers = wait_lookup(a, b, keys, req)
    assert hits == 3, answers
    assert [b.read(k) for k in keys[:3]] == blocks
    assert [b.read(k) for k in keys[3:]] == [None, None]
    # The lookup stopped at A's first MISS; the key after it was never asked.
    assert answers[-1] == ("HIT", "HIT", "HIT", "MISS"), answers
    b.finish(req)
    settle(a, b)


def test_pd_pull_is_byte_exact(engines):
    """Prefill/decode: A (prefiller, `remote_decoder`) stores a request's blocks, parked for the
    decoder; B (decoder, `remote_prefiller`) fetches them without a lookup round trip."""
    a, b = pair(engines)
    keys = [make_key(f"pd-{i}") for i in range(6)]
    blocks = random_blocks(len(keys), seed=3)
    producer = a.new_request("a-req", {"remote_decoder": {"kv_request_id": "kv-pd"}})
    assert a.policy(producer).name == "REQUEST_LEVEL"
    assert a.put(keys, blocks, producer) == keys
    a.finish(producer)
    a.step()

    req = b.new_request(
        "b-req",
        {
            "remote_prefiller": {
                "kv_request_id": "kv-pd",
                "remote_host": "127.0.0.1",
                "remote_port": a.port,
            }
        },
    )
    hits, answers = wait_lookup(a, b, keys, req)
    assert hits == len(keys), answers
    # The decoder trusts the prefiller: HIT at once, so the promotion starts on the first lookup.
    assert answers[0] == ("HIT_PENDING",) * len(keys), answers
    assert [b.read(k) for k in keys] == blocks
    assert b.load(keys, req) == blocks
    b.finish(req)
    settle(a, b)
    assert [a.pins(k) for k in keys] == [0] * len(keys)


@pytest.mark.parametrize(
    ("b_kwargs", "reason"),
    [
        ({"hash_seed": "another-seed"}, "hash seed mismatch"),
        ({"block_len": 2 * BLOCK_LEN}, "block_len mismatch"),
        ({"model": "another/model"}, "config fingerprint mismatch"),
    ],
    ids=["hash-seed", "block-len", "config-fingerprint"],
)
def test_mismatched_peer_is_a_miss(engines, caplog, b_kwargs, reason):
    """The p2p handshake rejects a peer whose NONE_HASH seed, block length or config fingerprint
    differs: the session dies, B's lookup answers MISS and nothing reaches B's primary tier."""
    a, b = pair(engines, b_kwargs=b_kwargs)
    keys = [make_key(f"mm-{i}") for i in range(4)]
    produce(a, keys, random_blocks(len(keys), seed=4))

    req = b.new_request("b-req", source(a))
    hits, answers = wait_lookup(a, b, keys, req)
    assert hits == 0, answers
    assert [b.read(k) for k in keys] == [None] * len(keys)
    b.finish(req)
    assert b.jobs_in_flight() == 0
    # Both sides rejected the other's connect, for that reason (vLLM's log).
    rejections = [r.getMessage() for r in caplog.records if "rejecting peer connect" in r.getMessage()]
    assert len(rejections) >= 2 and all(reason in m for m in rejections), rejections
