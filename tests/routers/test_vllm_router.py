"""vllm-router 0.1.17 (PyPI, ``--policy kv_aware``) indexes a kvpeer pool node's KV events as it
indexes an engine's: the pool is credited with a prompt's prefix exactly as the control (the
same chunks announced through vLLM 0.33's own publisher, as an engine's CPU tier announces
them), and the request goes to it; a chunk the pool could not describe (its engine published
no GPU blocks for it: vLLM's placeholder) is credited nothing, as vLLM's own placeholders are.

The router credits by hashes it computes from each event's ``token_ids`` and ``block_size``,
linked by ``parent_block_hash`` (its debug log line ``KV prefix decision ...
credited_prefix_tokens=N`` says what it credited and to whom). It must be subscribed before a
batch is published (it asks no replay on start), so each stream publishes only once the
router's subscription is seen: the pool's through its ``kvpeer_events_subscribers`` gauge, the
control's by publishing until the router logs a batch taken from it."""

from __future__ import annotations

import re

from fleet import (
    MODEL,
    PoolNode,
    StubWorker,
    VllmStream,
    described_chunks,
    engine_events,
    free_port,
    http_json,
    start_engine,
    tokens,
    wait_until,
)

DECISION = re.compile(
    r'KV prefix decision outcome="\w+" worker="(?P<worker>[^"]+)" input_tokens=(?P<input>\d+) '
    r"new_prefill_tokens=\d+ credited_prefix_tokens=(?P<credited>\d+)"
)


def batches_taken(log: str, source: str) -> int:
    return len(re.findall(rf"live sequence advanced source={re.escape(source)} ", log))


def route(procs, router_url: str, prompt: int) -> tuple[str, int]:
    """Sends one completion of ``prompt`` through the router: the worker it chose and the
    prefix tokens it credited that worker with."""
    before = len(DECISION.findall(procs.log("router")))
    status, body = http_json(
        "POST",
        f"{router_url}/v1/completions",
        {"model": MODEL, "prompt": " ".join(map(str, tokens(prompt))), "max_tokens": 1},
        timeout=20,
    )
    assert status == 200, body
    decisions = wait_until(
        lambda: DECISION.findall(procs.log("router"))[before:], "the router's decision line"
    )
    worker, input_tokens, credited = decisions[-1]
    assert int(input_tokens) == len(tokens(prompt))
    return worker, int(credited)


def test_vllm_router_credits_the_pool_exactly_as_an_engines_cpu_tier(procs, vllm_router):
    control_stream, engine_stream = VllmStream(replay=False), VllmStream()
    engine, _ = start_engine([2, 3])
    control, pool_worker = StubWorker("control"), StubWorker("pool")
    try:
        pool = PoolNode(procs, engine_stream, engine.id)
        port = free_port()
        procs.start(
            "router",
            [
                vllm_router,
                "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--worker-urls", control.url, pool_worker.url,
                "--policy", "kv_aware",
                "--kv-event-model", MODEL,
                "--kv-event-block-size", "16",
                "--kv-event-source", f"{control.url}={control_stream.endpoint}",
                "--kv-event-source", f"{pool_worker.url}={pool.endpoint}",
                "--log-level", "debug",
                "--worker-startup-check-interval", "1",
                "--health-check-interval-secs", "60",
            ],
            env={"NO_COLOR": "1"},
        )
        router_url = f"http://127.0.0.1:{port}"
        wait_until(lambda: "Starting server on" in procs.log("router"), "the router", 60)
        wait_until(
            lambda: pool.metric("kvpeer_events_subscribers") >= 1, "the router subscribed to the pool"
        )
        wait_until(
            lambda: pool.metric("kvpeer_follow_connected_engines") >= 1, "the pool following"
        )

        # The control: prompt 1's chunks as an engine's CPU tier announces them, published
        # until the router has taken a batch of them.
        def control_taken() -> bool:
            control_stream.publish(described_chunks(1, int_hashes=False))
            try:
                return bool(
                    wait_until(
                        lambda: batches_taken(procs.log("router"), control.url) > 0,
                        "a control batch",
                        timeout=1,
                    )
                )
            except AssertionError:
                return False

        wait_until(control_taken, "the router taking the control's events", 30)

        # The engine computes prompt 3 without GPU events (the pool cannot describe it), then
        # prompt 2 with them; the pool pulls both and publishes what it took in.
        engine_stream.publish(engine_events(3, gpu=False))
        wait_until(
            lambda: pool.metric('kvpeer_events_published_undescribed_total{reason="unknown"}') >= 4,
            "prompt 3 published as placeholders",
        )
        engine_stream.publish(engine_events(2))
        wait_until(
            lambda: pool.metric("kvpeer_events_published_described_total") >= 4,
            "prompt 2 published described",
        )
        published = pool.metric("kvpeer_events_published_total")
        wait_until(
            lambda: batches_taken(procs.log("router"), pool_worker.url) >= published,
            "the router taking every pool batch",
        )
        assert pool.metric("kvpeer_follow_pulled_blocks_total") == 8

        worker, control_credit = route(procs, router_url, 1)
        assert (worker, len(control.completions)) == (control.url, 1)
        assert control_credit > 0
        worker, pool_credit = route(procs, router_url, 2)
        assert (worker, len(pool_worker.completions)) == (pool_worker.url, 1)
        print(f"vllm-router credited: control {control_credit}, pool {pool_credit} tokens")
        assert pool_credit == control_credit, "the pool is credited as the engine's CPU tier"
        # Placeholders (prompt 3) and a prompt nobody holds (4): nothing credited.
        assert route(procs, router_url, 3)[1] == 0
        assert route(procs, router_url, 4)[1] == 0
    finally:
        control.shutdown()
        pool_worker.shutdown()
        control_stream.shutdown()
        engine_stream.shutdown()
        engine.shutdown(0.5)
