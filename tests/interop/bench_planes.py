"""Data planes side by side, one run: kvpeer's shm, tcp and nixl planes and vLLM 0.33's own
NixlTransport, with UCX's default transports and with UCX_TLS=tcp.

Two processes per case (a producer serving synthetic blocks, a consumer fetching them), same
workload for all: requests of 64 keys, all held, so each fetch moves 64 blocks; 64 KiB and
2 MiB blocks. A fetch's time runs from the `fetch` sent to the blocks landed (`transfer_done`
in), so it includes one control round trip; the figure is the fetch size over the median fetch
time. Consumers first run checked warm-up requests (every byte compared).

    scripts/bench-planes.sh                         # builds with --features nixl, runs this
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

CASES = [
    # (label, kind, plane, extra environment)
    ("kvpeer shm", "kvpeer", "shm", {}),
    ("kvpeer tcp", "kvpeer", "tcp", {}),
    ("kvpeer nixl (UCX default)", "kvpeer", "nixl", {}),
    ("kvpeer nixl (UCX_TLS=tcp)", "kvpeer", "nixl", {"UCX_TLS": "tcp"}),
    ("vLLM NixlTransport (UCX default)", "vllm", "nixl", {}),
    ("vLLM NixlTransport (UCX_TLS=tcp)", "vllm", "nixl", {"UCX_TLS": "tcp"}),
]


def run(kind, kvpeer, plane, env, block_len, requests):
    p = bench.Producer(kind, kvpeer, block_len, 2, plane=plane, env=env, hits=bench.KEYS)
    try:
        r = bench.consume(kind, kvpeer, p, block_len, requests, 2, plane=plane, env=env,
                          miss_share=0.0)
    finally:
        p.stop()
    if r["failed"] or r["corrupt"]:
        sys.exit(f"{kind} {plane} {env}: {r}")
    fetch = bench.KEYS * block_len
    return {
        "fetch_p50_us": r["fetch_us"][0],
        "fetch_p99_us": r["fetch_us"][1],
        "gb_per_s": round(fetch / (r["fetch_us"][0] / 1e6) / 1e9, 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvpeer", default="target/release/kvpeer")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_MODULES", "^ib*")
    rows = []
    for block_len in (64 * 1024, 2 << 20):
        for label, kind, plane, env in CASES:
            r = run(kind, args.kvpeer, plane, env, block_len, args.requests)
            rows.append({"case": label, "block_len": block_len, **r})
            print(f"  {label}, {block_len} B: {r}", file=sys.stderr, flush=True)
    print("| case | 64 × 64 KiB: GB/s (fetch p50 / p99 µs) | 64 × 2 MiB: GB/s (fetch p50 / p99 µs) |")
    print("|---|---|---|")
    for label, *_ in CASES:
        cells = []
        for block_len in (64 * 1024, 2 << 20):
            r = next(x for x in rows if x["case"] == label and x["block_len"] == block_len)
            cells.append(f"{r['gb_per_s']} ({r['fetch_p50_us']} / {r['fetch_p99_us']})")
        print(f"| {label} | {cells[0]} | {cells[1]} |")
    pick = {(r["case"], r["block_len"]): r["gb_per_s"] for r in rows}
    print()
    for block_len in (64 * 1024, 2 << 20):
        shm = pick[("kvpeer shm", block_len)]
        tcp = pick[("kvpeer tcp", block_len)]
        for who in ("kvpeer nixl", "vLLM NixlTransport"):
            d = pick[(f"{who} (UCX default)", block_len)]
            t = pick[(f"{who} (UCX_TLS=tcp)", block_len)]
            print(f"{block_len // 1024} KiB blocks vs {who}: shm / NIXL-default {shm / d:.2f}x "
                  f"(goal >= 1), tcp / NIXL-tcp {tcp / t:.2f}x (goal >= 1.2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
