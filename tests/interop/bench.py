"""Side-by-side benchmark: vLLM 0.33's P2P code and kvpeer, in the four pairings.

Same machine, same run, same workload for every pairing: N requests one after another, each
looking up 64 keys (1 in 8 missing at the producer) and fetching the 56 hits, over loopback
ZeroMQ and the shm data plane, with 16 KiB and with 2 MiB blocks. The vLLM side is
`vllm_peer.py` (vLLM's own ZmqTransport + P2PSession, driven as its tier manager does); the
kvpeer side is the release `kvpeer` binary (`serve`, and `fetch --driven`: the node on the
consumer's own thread, as an engine embeds it; `--node-consumer` for the runtime-thread Node).

Each consumer first runs 8 warm-up requests that check every byte, then the timed requests
(bytes not checked, so the figures are the transfer's, not the check's). Reported per pairing: lookup round
trip p50/p99, fetch → transfer_done p50/p99, requests/s, GB/s over the loads' own time, and CPU
seconds per 1,000 requests for each side (consumer: its own count over the timed requests;
producer: /proc/PID/stat over the consumer's whole run, divided by all its requests).

    scripts/bench-interop.sh            # builds, sets up, runs this; or directly:
    PYTHONPATH=target/interop/pysrc target/kvpeer-venv/bin/python tests/interop/bench.py \
        --kvpeer target/release/kvpeer [--requests-16k 2000] [--requests-2m 200] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
KEYS, MISS_SHARE = 64, 0.125
HITS = KEYS - round(KEYS * MISS_SHARE)
WARMUP = 8  # requests first, every byte checked, not in the figures
TICKS = os.sysconf("SC_CLK_TCK")
# How a kvpeer consumer runs its node: `--driven` on the command's own thread, as an engine
# embeds kvpeer (issue 14); `--node-consumer` empties this for the runtime-thread `Node`.
KVPEER_FETCH_MODE = ["--driven"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a running process (every thread, the exited ones too)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


# kvpeer's Python shm transport in a stock vLLM session cannot read the challenge in a kvpeer
# node's READY, so its shm_token is the version-1 kind (bound to the destination's address, not
# to the connection): a kvpeer node facing it must accept those (docs/security.md, "Fresh
# proofs"), as crates/kvpeer/tests/common/vllm.rs does for the interop tests.
VLLM_SHM_TOKENS = ["--shm-allow-replayable-tokens", "true"]


def plane_args(kind: str, plane: str, other: str = "") -> list[str]:
    """The flags that put a peer of `kind` on `plane` (shm, tcp, nixl), facing a peer of kind
    `other`."""
    if kind == "vllm":
        if plane == "nixl-numpy":
            return ["--transport", "nixl", "--pool", "numpy"]
        return ["--transport", "nixl" if plane == "nixl" else "shm"]
    args = ["--plane", plane]
    if other == "vllm" and plane == "shm":
        args += VLLM_SHM_TOKENS
    if plane == "nixl":
        args += ["--nixl-lib-dir", os.environ["KVPEER_NIXL_LIB_DIR"]]
    return args


class Producer:
    def __init__(self, kind: str, kvpeer: str, block_len: int, prefixes: int,
                 plane: str = "shm", env: dict | None = None, hits: int = HITS,
                 consumer: str = "") -> None:
        fill = hits * prefixes
        blocks = fill + 32
        common = ["--blocks", str(blocks), "--block-len", str(block_len), "--fill", str(fill)]
        common += plane_args(kind, plane, consumer)
        self.kind = kind
        if kind == "kvpeer":
            cmd = [kvpeer, "serve", *common]
        else:
            cmd = [sys.executable, os.path.join(HERE, "vllm_peer.py"), "serve", *common]
        env = {**os.environ, "KVPEER_LOG": "warn", **(env or {})}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env=env)
        # The ready line (NIXL's Python package logs to stdout too).
        for line in self.proc.stdout:
            if kind == "kvpeer" and " ready " in line:
                self.id = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)["id"]
                break
            if kind == "vllm" and line.startswith("{"):
                self.ready = json.loads(line)
                self.id = self.ready["id"]
                break
        else:
            sys.exit(f"the {kind} producer never got ready:\n{self.log_tail()}")

    def log_text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def log_tail(self) -> str:
        self.log.seek(0)
        return "".join(self.log.readlines()[-20:])

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def consume(kind: str, kvpeer: str, peer: Producer, block_len: int, requests: int,
            prefixes: int, plane: str = "shm", env: dict | None = None,
            miss_share: float = MISS_SHARE, concurrency: int = 1,
            wrap: list[str] | None = None) -> dict:
    """Runs a consumer to its end (the checked warm-up, then the timed requests); returns its
    figures in one shape for both kinds. `wrap` goes before the command (a counter such as
    `perf stat ... --`)."""
    common = ["--peer", peer.id, "--requests", str(requests), "--keys", str(KEYS),
              "--miss-share", str(miss_share), "--prefixes", str(prefixes),
              "--blocks", str(KEYS * (concurrency + (concurrency > 1))),
              "--block-len", str(block_len),
              "--warmup", str(WARMUP), "--no-verify", "--concurrency", str(concurrency),
              *plane_args(kind, plane, peer.kind)]
    if kind == "kvpeer":
        cmd = [kvpeer, "fetch", "--json", *KVPEER_FETCH_MODE, *common]
    else:
        cmd = [sys.executable, os.path.join(HERE, "vllm_peer.py"), "fetch", *common]
    cmd = [*(wrap or []), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "KVPEER_LOG": "warn", **(env or {})})
    lines = [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]
    if out.returncode != 0 or not lines:
        sys.exit(f"{kind} consumer failed ({out.returncode}):\n{out.stdout}\n{out.stderr}\n"
                 f"the producer's log:\n{peer.log_tail()}")
    s = lines[-1]
    if kind == "kvpeer":
        return {
            "hits": s["hits"], "bytes": s["bytes"], "corrupt": s["corrupt_blocks"],
            "failed": s["failed_loads"], "seconds": s["seconds"], "cpu": s["cpu_seconds"],
            "lookup_us": [s["lookup_p50_us"], s["lookup_p99_us"]],
            "fetch_us": [s["fetch_p50_us"], s["fetch_p99_us"]],
            "gb_per_s": s["fetch_gb_per_s"],
        }
    return {
        "hits": s["hits"], "bytes": s["bytes"], "corrupt": s["corrupt_blocks"],
        "failed": s["failed_loads"], "seconds": s["workload_s"], "cpu": s["cpu_s"],
        "lookup_us": s["lookup_us"], "fetch_us": s["fetch_us"],
        "gb_per_s": round(s["bytes"] / s["fetch_s"] / 1e9, 3) if s["fetch_s"] else 0.0,
    }


def run_pairing(consumer: str, producer: str, kvpeer: str, block_len: int, requests: int,
                prefixes: int, concurrency: int = 1) -> dict:
    # One consumer process per pairing, so each side sees one session: vLLM's control
    # transport can go deaf after closing a session (docs/behaviour.md #11). Requests in
    # flight together use distinct prefixes (a multiple of the concurrency).
    prefixes = -(-prefixes // concurrency) * concurrency
    p = Producer(producer, kvpeer, block_len, prefixes, consumer=consumer)
    try:
        cpu0 = cpu_seconds(p.proc.pid)
        r = consume(consumer, kvpeer, p, block_len, requests, prefixes,
                    concurrency=concurrency)
        producer_cpu = cpu_seconds(p.proc.pid) - cpu0
    finally:
        p.stop()
    if r["failed"] or r["corrupt"] or r["hits"] != HITS * requests:
        sys.exit(f"{consumer}->{producer}: {r}")
    return {
        "consumer": consumer,
        "producer": producer,
        "block_len": block_len,
        "requests": requests,
        "lookup_p50_us": r["lookup_us"][0],
        "lookup_p99_us": r["lookup_us"][1],
        "fetch_p50_us": r["fetch_us"][0],
        "fetch_p99_us": r["fetch_us"][1],
        "requests_per_s": round(requests / r["seconds"], 1),
        # One at a time: over the loads' own time; several: over the whole run.
        "gb_per_s": r["gb_per_s"] if concurrency == 1 else
        round(r["bytes"] / r["seconds"] / 1e9, 3),
        "concurrency": concurrency,
        "consumer_cpu_s_per_1k": round(r["cpu"] / requests * 1000, 3),
        # The producer serves the warm-up requests the same way as the timed ones.
        "producer_cpu_s_per_1k": round(producer_cpu / (requests + WARMUP) * 1000, 3),
    }


def table(rows: list[dict]) -> str:
    head = ("| blocks | consumer → producer | lookup p50 / p99 µs | fetch p50 / p99 µs | req/s "
            "| GB/s | CPU s / 1k req (consumer, producer) |\n|---|---|---|---|---|---|---|")
    out = [head]
    for r in rows:
        size = f"{r['block_len'] // 1024} KiB" if r["block_len"] < 1 << 20 else \
            f"{r['block_len'] >> 20} MiB"
        out.append(
            f"| {size} | {r['consumer']} → {r['producer']} | {r['lookup_p50_us']} / "
            f"{r['lookup_p99_us']} | {r['fetch_p50_us']} / {r['fetch_p99_us']} | "
            f"{r['requests_per_s']} | {r['gb_per_s']} | {r['consumer_cpu_s_per_1k']}, "
            f"{r['producer_cpu_s_per_1k']} |"
        )
    return "\n".join(out)


def ratios(rows: list[dict]) -> str:
    out = []
    for block_len in sorted({r["block_len"] for r in rows}):
        pick = {(r["consumer"], r["producer"]): r for r in rows if r["block_len"] == block_len}
        v, k = pick[("vllm", "vllm")], pick[("kvpeer", "kvpeer")]

        def ratio(a: float, b: float) -> str:
            return f"{a / b:.1f}x" if b else "n/a"

        out.append(
            f"{block_len // 1024} KiB, kvpeer↔kvpeer vs vLLM↔vLLM: "
            f"req/s {ratio(k['requests_per_s'], v['requests_per_s'])}, "
            f"lookup p99 {ratio(v['lookup_p99_us'], k['lookup_p99_us'])} lower, "
            f"fetch p99 {ratio(v['fetch_p99_us'], k['fetch_p99_us'])} lower, "
            f"CPU per request: consumer {ratio(v['consumer_cpu_s_per_1k'], k['consumer_cpu_s_per_1k'])} "
            f"less, producer {ratio(v['producer_cpu_s_per_1k'], k['producer_cpu_s_per_1k'])} less"
        )
    return "\n".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kvpeer", default="target/release/kvpeer")
    p.add_argument("--requests-16k", type=int, default=2000)
    p.add_argument("--requests-2m", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=1,
                   help="requests in flight together on every consumer (default 1)")
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--node-consumer", action="store_true",
                   help="kvpeer consumers on the runtime-thread Node (default: engine-driven)")
    args = p.parse_args()
    if args.node_consumer:
        KVPEER_FETCH_MODE.clear()
    rows = []
    pairings = [("vllm", "vllm"), ("vllm", "kvpeer"), ("kvpeer", "vllm"), ("kvpeer", "kvpeer")]
    for block_len, requests, prefixes in [
        (16 * 1024, args.requests_16k, 16),
        (2 << 20, args.requests_2m, 4),
    ]:
        for consumer, producer in pairings:
            t0 = time.monotonic()
            rows.append(run_pairing(consumer, producer, args.kvpeer, block_len, requests, prefixes,
                                    args.concurrency))
            print(f"  {consumer} → {producer}, {block_len} B blocks: "
                  f"{time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {KEYS} keys/request, {HITS} hits, shm plane, "
          f"{args.concurrency} request(s) in flight, kvpeer consumer "
          f"{'driven' if KVPEER_FETCH_MODE else 'Node'}\n")
    print(table(rows))
    print()
    print(ratios(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
