"""One real vLLM engine serving a model, driven by a test over a pipe (JSON lines).

Run by tests/real_engine/engines.py, never by hand: ``python engine_server.py CONFIG_JSON``,
commands on stdin, one answer per command on the file descriptor ``result_fd`` of the config
(vLLM's logs go to stdout/stderr, which the test sends to a log file). The engine is vLLM's
offline ``LLM`` with the offloading connector (``kv_connector_extra_config`` from the config),
prompts as token ids (no tokenizer), greedy sampling with logprobs.

Commands: ``{"cmd": "generate", "prompt": [ids], "max_tokens": n, "kv_transfer_params": {}}``
-> ``{"tokens", "logprobs", "num_cached_tokens", "seconds"}``; ``{"cmd": "metrics"}`` -> the
engine's counters and gauges whose names hold one of ``prefixes`` (Prometheus names, labels
joined into the key); ``{"cmd": "reset_prefix_cache"}``; ``{"cmd": "quit"}``.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> None:
    config = json.loads(sys.argv[1])
    results = os.fdopen(int(config["result_fd"]), "w", buffering=1)
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    kv = None
    if config.get("extra_config") is not None:
        kv = KVTransferConfig(
            kv_connector="OffloadingConnector",
            kv_role="kv_both",
            engine_id=config["engine_id"],
            kv_connector_extra_config=config["extra_config"],
        )
    llm = LLM(
        model=config["model"],
        skip_tokenizer_init=True,
        block_size=config.get("block_size", 32),
        max_model_len=config.get("max_model_len", 4096),
        max_num_batched_tokens=config.get("max_num_batched_tokens", 4096),
        dtype="float32",
        enforce_eager=True,
        kv_cache_memory_bytes=config.get("kv_cache_memory_bytes", 128 << 20),
        kv_transfer_config=kv,
        seed=0,
        disable_log_stats=False,
    )
    answer(results, {"ready": True, "seconds": time.perf_counter() - started})
    prefixes = tuple(config.get("metric_prefixes", ["kv_offload", "prefix_cache", "p2p"]))
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            command = json.loads(line)
            what = command["cmd"]
            if what == "quit":
                answer(results, {"ok": True})
                break
            if what == "generate":
                params = SamplingParams(
                    temperature=0.0,
                    max_tokens=int(command.get("max_tokens", 8)),
                    logprobs=1,
                    extra_args={"kv_transfer_params": command["kv_transfer_params"]}
                    if command.get("kv_transfer_params")
                    else None,
                )
                t0 = time.perf_counter()
                out = llm.generate(
                    [TokensPrompt(prompt_token_ids=command["prompt"])],
                    params,
                    use_tqdm=False,
                )[0]
                seconds = time.perf_counter() - t0
                completion = out.outputs[0]
                logprobs = [
                    step[token].logprob
                    for step, token in zip(completion.logprobs or [], completion.token_ids)
                ]
                answer(
                    results,
                    {
                        "tokens": list(completion.token_ids),
                        "logprobs": logprobs,
                        "num_cached_tokens": out.num_cached_tokens,
                        "seconds": seconds,
                    },
                )
            elif what == "metrics":
                values = {}
                for metric in llm.get_metrics():
                    if not any(p in metric.name for p in prefixes):
                        continue
                    labels = ",".join(
                        f"{k}={v}" for k, v in sorted(getattr(metric, "labels", {}).items())
                    )
                    value = getattr(metric, "value", None)
                    if value is None:
                        value = getattr(metric, "count", None)
                    key = f"{metric.name}{{{labels}}}" if labels else metric.name
                    values[key] = value
                answer(results, {"metrics": values})
            elif what == "reset_prefix_cache":
                answer(results, {"ok": bool(llm.reset_prefix_cache())})
            else:
                answer(results, {"error": f"unknown command {what!r}"})
        except Exception as exc:  # answered, so the test sees the cause
            answer(results, {"error": f"{exc!r}", "traceback": traceback.format_exc()})


def answer(results, value) -> None:
    results.write(json.dumps(value) + "\n")
    results.flush()


if __name__ == "__main__":
    main()
