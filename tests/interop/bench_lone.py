"""A lone consumer against one `kvpeer serve` (issue 37: the shares are work-conserving): the
16 KiB kvpeer<->kvpeer pairing of docs/benchmarks.md, one node at a time, in turn (order
alternating per run), with the node's default config, with `inbound_ms_per_s = 1000` (the
shares off in effect), and optionally another binary's default (`--before BIN`). With
`--idle-sessions N`: the default config (room for N more sessions) alone, and with N idle
sessions from N/4 other source addresses open (tests/hostile/attacker.py spread --window 0,
in `--python`, pyzmq needed; the node on `--plane both` in both, the idle peers being tcp
ones): what the node's cost per session, rather than per request, does.

Prints each run and a summary: req/s, lookup p99, and the producer's CPU per 1,000 requests
(from /proc/PID/stat over the fetch). Only the standard library.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile


def run_one(binary: str, toml: str, idle: int = 0, python: str = "python3",
            plane: str = "shm") -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(toml)
    env = dict(os.environ, KVPEER_LOG="warn")
    serve = subprocess.Popen(
        [binary, "serve", "--config", f.name, "--blocks", "928", "--block-len", "16384",
         "--fill", "896", "--plane", plane],
        stdout=subprocess.PIPE, text=True, env=env)
    sessions = None
    try:
        ready = serve.stdout.readline()
        ident = next(w.split("=", 1)[1] for w in ready.split() if w.startswith("id="))
        if idle:
            attacker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "hostile",
                                    "attacker.py")
            sessions = subprocess.Popen(
                [python, attacker, "spread", "--node", ident, "--hosts", str(idle // 4),
                 "--sessions", "4", "--window", "0", "--duration", "600",
                 "--block-len", "16384", "--num-blocks", "928"],
                stdout=subprocess.PIPE, text=True)
            for line in sessions.stdout:
                if '"flooding"' in line:
                    break
            else:
                raise RuntimeError("the idle sessions never all opened")
        before = cpu_seconds(serve.pid)
        out = subprocess.run(
            [binary, "fetch", "--peer", ident, "--requests", "2000", "--keys", "64",
             "--miss-share", "0.125", "--prefixes", "16", "--blocks", "64", "--block-len", "16384",
             "--warmup", "8", "--no-verify", "--plane", "shm", "--json", "--driven"],
            capture_output=True, text=True, env=env, timeout=300, check=True)
        spent = cpu_seconds(serve.pid) - before
    finally:
        if sessions is not None:
            sessions.kill()
            sessions.wait(10)
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
    ap.add_argument("--idle-sessions", type=int, default=0)
    ap.add_argument("--python", default="python3", help="a Python with pyzmq (--idle-sessions)")
    args = ap.parse_args()
    nodes = [("default", args.kvpeer, "", 0),
             ("inbound_ms_per_s = 1000", args.kvpeer, "inbound_ms_per_s = 1000\n", 0)]
    if args.idle_sessions:
        room = f"max_peers = {args.idle_sessions + 64}\n"
        nodes = [("default", args.kvpeer, room, 0),
                 (f"{args.idle_sessions} idle sessions", args.kvpeer, room, args.idle_sessions)]
    if args.before:
        nodes.insert(0, ("before, default", args.before, "", 0))
    results: dict[str, list[dict]] = {name: [] for name, _, _, _ in nodes}
    for run in range(args.runs):
        for name, binary, toml, idle in nodes if run % 2 == 0 else nodes[::-1]:
            # The idle sessions advertise a tcp plane only: the node offers both in both runs.
            s = run_one(binary, toml, idle, args.python,
                        "both" if args.idle_sessions else "shm")
            results[name].append(s)
            print(f"{name}: {s['req_per_s']:.0f} req/s, lookup p50/p99 {s['lookup_p50_us']}/"
                  f"{s['lookup_p99_us']} us, producer {s['producer_ms_per_1k']:.0f} ms/1k req",
                  flush=True)
    for name, runs in results.items():
        rps = sorted(round(s["req_per_s"]) for s in runs)
        p99 = sorted(s["lookup_p99_us"] for s in runs)
        cpu = sorted(round(s["producer_ms_per_1k"]) for s in runs)
        print(f"SUMMARY {name}: req/s {rps}, lookup p99 us {p99}, producer ms/1k req {cpu}")
    median = lambda xs: xs[len(xs) // 2]  # noqa: E731
    default = sorted(s["req_per_s"] for s in results["default"])
    if args.idle_sessions:
        idle = sorted(s["req_per_s"] for s in results[f"{args.idle_sessions} idle sessions"])
        print(f"lone consumer, with {args.idle_sessions} idle sessions vs alone: "
              f"{median(idle) / median(default):.2f}x (goal >= 0.9x)")
        return
    off = sorted(s["req_per_s"] for s in results["inbound_ms_per_s = 1000"])
    print(f"lone consumer, default vs shares off: {median(default) / median(off):.2f}x (goal >= 0.9x)")


if __name__ == "__main__":
    main()
