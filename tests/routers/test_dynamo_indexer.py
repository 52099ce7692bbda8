"""Dynamo's standalone KV indexer (``python -m dynamo.indexer``, ai-dynamo-runtime 1.6.1 from
PyPI, HTTP-only mode) indexes a kvpeer pool node's events as it indexes an engine's, with the
pool publishing int hashes (``--publish-hashes int``; Dynamo drops every batch with a 32-byte
hash) and no ``ownership`` (the default; Dynamo ignores every event that has one): the pool's
CPU tier is credited with a prompt's prefix exactly as the control (the same chunks announced
by vLLM 0.33's own publisher with int hashes, as an engine's CPU tier announces them), and a
chunk the pool could not describe (vLLM's placeholder) with nothing.

Dynamo indexes a store by hashes it computes from ``token_ids`` per registered block size,
linked by ``parent_block_hash``; ``POST /query`` answers per worker how many prefix tokens
each tier holds (``instances[id].cpu`` for ``medium: "CPU"``). Note: the indexer listens on
0.0.0.0 (it has no option to bind loopback only)."""

from __future__ import annotations

from fleet import (
    MODEL,
    PoolNode,
    VllmStream,
    described_chunks,
    engine_events,
    free_port,
    http_json,
    start_engine,
    tokens,
    wait_until,
)

CONTROL, POOL = 1, 2


def cpu_tokens(base: str, prompt: int, worker: int) -> int:
    status, body = http_json("POST", f"{base}/query", {"token_ids": tokens(prompt), "model_name": MODEL})
    assert status == 200, body
    return int(((body.get("instances") or {}).get(str(worker)) or {}).get("cpu", 0))


def register(base: str, worker: int, endpoint: str) -> None:
    status, body = http_json(
        "POST",
        f"{base}/register",
        {"instance_id": worker, "endpoint": endpoint, "model_name": MODEL, "block_size": 16},
    )
    assert status in (200, 201), body


def test_dynamos_indexer_credits_the_pool_exactly_as_an_engines_cpu_tier(procs, dynamo_python):
    control_stream, engine_stream = VllmStream(replay=False), VllmStream()
    engine, _ = start_engine([2, 3])
    try:
        pool = PoolNode(procs, engine_stream, engine.id, "--publish-hashes", "int")
        port = free_port()
        procs.start("dynamo", [dynamo_python, "-m", "dynamo.indexer", "--port", str(port), "--threads", "1"])
        base = f"http://127.0.0.1:{port}"
        wait_until(lambda: http_json("GET", f"{base}/health")[0] == 200, "the indexer", 60)
        register(base, CONTROL, control_stream.endpoint)
        register(base, POOL, pool.endpoint)
        wait_until(
            lambda: pool.metric("kvpeer_events_subscribers") >= 1, "the indexer subscribed to the pool"
        )
        wait_until(lambda: pool.metric("kvpeer_follow_connected_engines") >= 1, "the pool following")

        # The control: published until the indexer holds it (its SUB may join after the first).
        def control_indexed() -> int:
            control_stream.publish(described_chunks(1, int_hashes=True))
            try:
                return wait_until(lambda: cpu_tokens(base, 1, CONTROL), "the control", timeout=1)
            except AssertionError:
                return 0

        control_credit = wait_until(control_indexed, "the indexer holding the control's chunks", 30)
        assert control_credit == 128, "4 chunks of 32 tokens"

        # Prompt 3 first (no GPU events: placeholders), then prompt 2 (described). Per worker the
        # CPU tier applies batches in order, so once prompt 2 shows, prompt 3 was applied.
        engine_stream.publish(engine_events(3, gpu=False))
        wait_until(
            lambda: pool.metric('kvpeer_events_published_undescribed_total{reason="unknown"}') >= 4,
            "prompt 3 published as placeholders",
        )
        engine_stream.publish(engine_events(2))
        pool_credit = wait_until(lambda: cpu_tokens(base, 2, POOL), "the pool's chunks indexed")
        print(f"Dynamo's indexer credited (cpu tier): control {control_credit}, pool {pool_credit} tokens")
        assert pool_credit == control_credit, "the pool is credited as the engine's CPU tier"
        assert cpu_tokens(base, 3, POOL) == 0
        assert cpu_tokens(base, 2, CONTROL) == 0 and cpu_tokens(base, 1, POOL) == 0
        assert pool.metric("kvpeer_follow_pulled_blocks_total") == 8
    finally:
        control_stream.shutdown()
        engine_stream.shutdown()
        engine.shutdown(0.5)
