"""System calls and context switches per request, kvpeer↔kvpeer and vLLM↔vLLM, one run.

The workload of bench.py (requests of 64 keys, 56 held, fetched over the shm plane) between a
producer and a consumer of the same kind, counted twice per pairing: once under `perf stat -e
context-switches,task-clock` (producer attached by pid for the consumer's run, consumer from
its start), once under `strace -f -c` (system calls by name; strace slows everything, so its
run is separate). Counts are divided by the consumer's requests (warm-up included); the
consumer's include its start-up and handshake, which many requests amortize.

    scripts/bench-syscalls.sh [--requests 1000] [--block-len 16384] [--kinds kvpeer,vllm]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402

PERF_EVENTS = "context-switches,task-clock"


def perf_counts(path: str) -> dict:
    """`perf stat -x,` output: event name → value."""
    counts = {}
    with open(path) as f:
        for line in f:
            fields = line.strip().split(",")
            if len(fields) > 2 and fields[0] and not line.startswith("#"):
                try:
                    counts[fields[2]] = float(fields[0])
                except ValueError:
                    pass  # "<not supported>" and the like
    return counts


def strace_counts(path: str) -> tuple[int, list[tuple[str, int]]]:
    """`strace -c` output: total calls, and the busiest calls by name."""
    total, by_name = 0, []
    with open(path) as f:
        for line in f:
            fields = line.split()
            if not fields or not fields[0][0].isdigit():
                continue
            # % time, seconds, usecs/call, calls, [errors], syscall
            name = fields[-1]
            calls = int(fields[3])
            if name == "total":
                total = calls
            else:
                by_name.append((name, calls))
    by_name.sort(key=lambda x: -x[1])
    return total, by_name


def attach(cmd: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
    return p


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGINT)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def pairing(kind: str, kvpeer: str, block_len: int, requests: int, counter: str) -> dict:
    """One producer/consumer pair of `kind` under `counter` (perf or strace)."""
    tmp = tempfile.mkdtemp(prefix="kvpeer-syscalls-")
    out_p, out_c = os.path.join(tmp, "producer"), os.path.join(tmp, "consumer")
    prefixes = 16
    producer = bench.Producer(kind, kvpeer, block_len, prefixes)
    try:
        if counter == "perf":
            on_producer = ["perf", "stat", "-e", PERF_EVENTS, "-x,", "-o", out_p,
                           "-p", str(producer.proc.pid)]
            wrap = ["perf", "stat", "-e", PERF_EVENTS, "-x,", "-o", out_c, "--"]
        else:
            on_producer = ["strace", "-f", "-c", "-o", out_p, "-p", str(producer.proc.pid)]
            wrap = ["strace", "-f", "-c", "-o", out_c]
        watcher = attach(on_producer)
        try:
            r = bench.consume(kind, kvpeer, producer, block_len, requests, prefixes, wrap=wrap)
        finally:
            stop(watcher)
    finally:
        producer.stop()
    if r["failed"] or r["corrupt"]:
        sys.exit(f"{kind}: {r}")
    n = requests + bench.WARMUP
    if counter == "perf":
        p, c = perf_counts(out_p), perf_counts(out_c)
        return {
            "producer_cs": p.get("context-switches", 0) / n,
            "consumer_cs": c.get("context-switches", 0) / n,
            "producer_cpu_us": p.get("task-clock", 0) * 1e3 / n,  # task-clock is in ms
            "consumer_cpu_us": c.get("task-clock", 0) * 1e3 / n,
        }
    (pt, pn), (ct, cn) = strace_counts(out_p), strace_counts(out_c)
    top = lambda names: ", ".join(f"{k} {v / n:.1f}" for k, v in names[:5])  # noqa: E731
    return {
        "producer_syscalls": pt / n,
        "consumer_syscalls": ct / n,
        "producer_top": top(pn),
        "consumer_top": top(cn),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvpeer", default="target/release/kvpeer")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--block-len", type=int, default=16 * 1024)
    ap.add_argument("--kinds", default="kvpeer,vllm")
    ap.add_argument("--node-consumer", action="store_true",
                    help="kvpeer consumers on the runtime-thread Node (default: engine-driven)")
    args = ap.parse_args()
    if args.node_consumer:
        bench.KVPEER_FETCH_MODE.clear()
    print(f"{args.requests} requests of {bench.KEYS} keys ({bench.HITS} held), "
          f"{args.block_len} B blocks, shm plane; per request (warm-up included):\n")
    print("| pair | side | system calls | context switches | CPU µs (task-clock) | busiest calls |")
    print("|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        perf = pairing(kind, args.kvpeer, args.block_len, args.requests, "perf")
        trace = pairing(kind, args.kvpeer, args.block_len, args.requests, "strace")
        for side in ("consumer", "producer"):
            print(f"| {kind}↔{kind} | {side} | {trace[side + '_syscalls']:.1f} | "
                  f"{perf[side + '_cs']:.1f} | {perf[side + '_cpu_us']:.0f} | "
                  f"{trace[side + '_top']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
