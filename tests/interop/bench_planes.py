"""Data planes side by side, one run: kvpeer's shm, tcp and nixl planes and vLLM 0.33's own
NixlTransport (its pool a shared-memory object, or a numpy array as vLLM's CPU tier holds
one), with UCX's default transports and with UCX_TLS=tcp.

Two processes per case (a producer serving synthetic blocks, a consumer fetching them), same
workload for all: requests of 64 keys, all held, so each fetch moves 64 blocks; 64 KiB and
2 MiB blocks. A fetch's time runs from the `fetch` sent to the blocks landed (`transfer_done`
in), so it includes one control round trip; the figure is the fetch size over the median fetch
time. Consumers first run checked warm-up requests (every byte compared). Per NIXL case also:
how long the producer's NIXL took to register its pool (`register_memory`); per case, how much
of the producer's pool (found by its size in /proc/PID/smaps) the kernel holds in huge pages
(`AnonHugePages` + `ShmemPmdMapped` in /proc/PID/smaps) while it served, and the CPU time per
fetch of both processes (all their threads: NIXL's progress thread too, where it runs).

    scripts/bench-planes.sh                         # builds with --features nixl, runs this
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

CASES = [
    # (label, kind, plane, extra environment)
    ("kvpeer shm", "kvpeer", "shm", {}),
    ("kvpeer tcp", "kvpeer", "tcp", {}),
    ("kvpeer nixl (UCX default)", "kvpeer", "nixl", {}),
    ("kvpeer nixl (UCX_TLS=tcp)", "kvpeer", "nixl", {"UCX_TLS": "tcp"}),
    ("vLLM NixlTransport, shm pool (UCX default)", "vllm", "nixl", {}),
    ("vLLM NixlTransport, shm pool (UCX_TLS=tcp)", "vllm", "nixl", {"UCX_TLS": "tcp"}),
    ("vLLM NixlTransport, numpy pool (UCX default)", "vllm", "nixl-numpy", {}),
    ("vLLM NixlTransport, numpy pool (UCX_TLS=tcp)", "vllm", "nixl-numpy", {"UCX_TLS": "tcp"}),
]
SIZES = (64 * 1024, 2 << 20)


def pool_huge_mb(pid: int, pool_bytes: int) -> float | None:
    """MB in transparent huge pages (anonymous or shmem) of the producer's pool: its most
    resident mapping just large enough for `pool_bytes` (a kvpeer shm pool has a trailer page
    more, an anonymous one up to 4 MiB of rounding to huge pages). None: no such mapping."""
    maps, cur = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(None, 1)[0]
            if "-" in head and not head.endswith(":"):
                cur = {"size": 0, "rss": 0, "huge": 0}
                maps.append(cur)
            elif cur is not None and head == "Size:":
                cur["size"] = int(line.split()[1]) * 1024
            elif cur is not None and head == "Rss:":
                cur["rss"] = int(line.split()[1])
            elif cur is not None and head in ("AnonHugePages:", "ShmemPmdMapped:"):
                cur["huge"] += int(line.split()[1])
    fits = [m for m in maps if pool_bytes <= m["size"] <= pool_bytes + (4 << 20) + 4096]
    if not fits:
        return None
    return round(max(fits, key=lambda m: m["rss"])["huge"] / 1024, 1)


def register_ms(kind: str, producer: bench.Producer) -> float | None:
    """How long the producer's NIXL took to register its pool, ms (None: not NIXL)."""
    if kind == "vllm":
        us = producer.ready.get("nixl_register_us") or []
        return round(us[0] / 1000, 2) if us else None
    m = re.search(r"nixl: pool registered.*?register_us=(\d+)", producer.log_text())
    return round(int(m.group(1)) / 1000, 2) if m else None


def run(kind, kvpeer, plane, env, block_len, requests):
    env = dict(env)
    if kind == "kvpeer" and plane == "nixl":
        env["KVPEER_LOG"] = "warn,kvpeer_net::nixl=info"
    p = bench.Producer(kind, kvpeer, block_len, 2, plane=plane, env=env, hits=bench.KEYS)
    try:
        cpu0 = bench.cpu_seconds(p.proc.pid)
        r = bench.consume(kind, kvpeer, p, block_len, requests, 2, plane=plane, env=env,
                          miss_share=0.0)
        producer_cpu = bench.cpu_seconds(p.proc.pid) - cpu0
        # The producer's pool: the blocks it serves and 32 more (bench.Producer).
        huge = pool_huge_mb(p.proc.pid, (2 * bench.KEYS + 32) * block_len)
    finally:
        p.stop()
    if r["failed"] or r["corrupt"]:
        sys.exit(f"{kind} {plane} {env}: {r}")
    fetch = bench.KEYS * block_len
    return {
        "fetch_p50_us": r["fetch_us"][0],
        "fetch_p99_us": r["fetch_us"][1],
        "gb_per_s": round(fetch / (r["fetch_us"][0] / 1e6) / 1e9, 2),
        "register_ms": register_ms(kind, p) if "nixl" in plane else None,
        # CPU per fetch: the consumer's over the timed fetches, the producer's over all it
        # served (the warm-up too), every thread.
        "consumer_cpu_ms": round(r["cpu"] / requests * 1000, 1),
        "producer_cpu_ms": round(producer_cpu / (requests + bench.WARMUP) * 1000, 1),
        "pool_huge_mb": huge,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvpeer", default="target/release/kvpeer")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--only", help="run only the cases whose label contains this")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    os.environ.setdefault("UCX_MODULES", "^ib*")
    cases = [c for c in CASES if not args.only or args.only in c[0]]
    rows = []
    for block_len in SIZES:
        for label, kind, plane, env in cases:
            r = run(kind, args.kvpeer, plane, env, block_len, args.requests)
            rows.append({"case": label, "block_len": block_len, **r})
            print(f"  {label}, {block_len} B: {r}", file=sys.stderr, flush=True)
    print("| case | 64 × 64 KiB: GB/s (fetch p50 / p99 µs) | 64 × 2 MiB: GB/s (fetch p50 / p99 µs) "
          "| CPU ms per fetch, consumer + producer (64 KiB; 2 MiB) "
          "| pool registration ms (64 KiB, 2 MiB pool) | producer pool in huge pages MB (64 KiB, 2 MiB) |")
    print("|---|---|---|---|---|---|")
    for label, *_ in cases:
        got = [next(x for x in rows if x["case"] == label and x["block_len"] == b) for b in SIZES]
        cells = [f"{r['gb_per_s']} ({r['fetch_p50_us']} / {r['fetch_p99_us']})" for r in got]
        reg = ", ".join("–" if r["register_ms"] is None else str(r["register_ms"]) for r in got)
        huge = ", ".join(str(r["pool_huge_mb"]) for r in got)
        cpu = "; ".join(f"{r['consumer_cpu_ms']} + {r['producer_cpu_ms']}" for r in got)
        print(f"| {label} | {cells[0]} | {cells[1]} | {cpu} | {reg} | {huge} |")
    pick = {(r["case"], r["block_len"]): r["gb_per_s"] for r in rows}
    print()
    for block_len in SIZES:
        kib = block_len // 1024
        for tls in ("UCX default", "UCX_TLS=tcp"):
            k = pick.get((f"kvpeer nixl ({tls})", block_len))
            for pool in ("numpy", "shm"):
                v = pick.get((f"vLLM NixlTransport, {pool} pool ({tls})", block_len))
                if k and v:
                    print(f"{kib} KiB blocks, {tls}: kvpeer nixl / vLLM NixlTransport ({pool} "
                          f"pool) {k / v:.2f}x (goal >= 1)")
        shm = pick.get(("kvpeer shm", block_len))
        tcp = pick.get(("kvpeer tcp", block_len))
        for who in ("kvpeer nixl", "vLLM NixlTransport, shm pool"):
            d = pick.get((f"{who} (UCX default)", block_len))
            t = pick.get((f"{who} (UCX_TLS=tcp)", block_len))
            if shm and tcp and d and t:
                print(f"{kib} KiB blocks vs {who}: shm / NIXL-default {shm / d:.2f}x "
                      f"(goal >= 1), tcp / NIXL-tcp {tcp / t:.2f}x (goal >= 1.2)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
