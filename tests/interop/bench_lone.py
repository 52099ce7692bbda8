"""A lone consumer against one `kvpeer serve` (issue 37: the shares are work-conserving): the
16 KiB kvpeer<->kvpeer pairing of docs/benchmarks.md, one node at a time, in turn (order
alternating per run), with the node's default config, with `inbound_ms_per_s = 1000` (the
shares off in effect), and optionally another binary's default (`--before BIN`).

Prints each run and a summary: req/s, lookup p99, and the producer's CPU per 1,000 requests
(from /proc/PID/stat over the fetch). Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile


def run_one(binary: str, toml: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml)
    env = dict(os.environ, KVPEER_LOG="warn")
    serve = subprocess.Popen(
        [binary, "serve", "--config", f.name, "--blocks", "928", "--block-len", "16384",
         "--fill", "896", "--plane", "shm"],
        stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready = serve.stdout.readline()
        ident = next(w.split("=", 1)[1] for w in ready.split() if w.startswith("id="))
        before = cpu_seconds(serve.pid)
        out = subprocess.run(
            [binary, "fetch", "--peer", ident, "--requests", "2000", "--keys", "64",
             "--miss-share", "0.125", "--prefixes", "16", "--blocks", "64", "--block-len", "16384",
             "--warmup", "8", "--no-verify", "--plane", "shm", "--json", "--driven"],
            capture_output=True, text=True, env=env, timeout=300, check=True)
        spent = cpu_seconds(serve.pid) - before
    finally:
        serve.terminate()
        serve.wait(10)
        os.unlink(f.name)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    summary["req_per_s"] = summary["requests"] / summary["seconds"]
    summary["producer_ms_per_1k"] = spent / summary["requests"] * 1e6
    return summary


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvpeer", required=True)
    ap.add_argument("--before", help="another kvpeer binary, run with its default config")
    ap.add_argument("--runs", type=int, default=4)
    args = ap.parse_args()
    nodes = [("default", args.kvpeer, ""),
             ("inbound_ms_per_s = 1000", args.kvpeer, "inbound_ms_per_s = 1000\n")]
    if args.before:
        nodes.insert(0, ("before, default", args.before, ""))
    results: dict[str, list[dict]] = {name: [] for name, _, _ in nodes}
    for run in range(args.runs):
        for name, binary, toml in nodes if run % 2 == 0 else nodes[::-1]:
            s = run_one(binary, toml)
            results[name].append(s)
            print(f"{name}: {s['req_per_s']:.0f} req/s, lookup p50/p99 {s['lookup_p50_us']}/"
                  f"{s['lookup_p99_us']} us, producer {s['producer_ms_per_1k']:.0f} ms/1k req",
                  flush=True)
    for name, runs in results.items():
        rps = sorted(round(s["req_per_s"]) for s in runs)
        p99 = sorted(s["lookup_p99_us"] for s in runs)
        cpu = sorted(round(s["producer_ms_per_1k"]) for s in runs)
        print(f"SUMMARY {name}: req/s {rps}, lookup p99 us {p99}, producer ms/1k req {cpu}")
    default = sorted(s["req_per_s"] for s in results["default"])
    off = sorted(s["req_per_s"] for s in results["inbound_ms_per_s = 1000"])
    median = lambda xs: xs[len(xs) // 2]  # noqa: E731
    print(f"lone consumer, default vs shares off: {median(default) / median(off):.2f}x (goal >= 0.9x)")


if __name__ == "__main__":
    main()
