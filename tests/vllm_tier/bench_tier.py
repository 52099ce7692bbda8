"""What vLLM pays on its scheduler thread for a P2P tier: kvpeer's `KvpeerTier` against vLLM
0.33's stock `p2p` tier (`P2PSecondaryTierManager`), inside vLLM's real
TieringOffloadingManager (the harness of this directory), same workload, same run.

Cases: kvpeer on the nixl plane (the like-for-like with the stock tier, which moves bytes with
NIXL), kvpeer on the tcp plane, the stock tier; each at 16 KiB and 2 MiB blocks. Per case, one
producer engine and one consumer engine of that kind in this process (tier_poll_interval_s=0:
tiers run only inside the engines' calls, as the tests drive them). Per request:

1. unmeasured: the producer computes K fresh blocks (`put`, a step, its cascade settled);
2. the consumer opens a request whose `remote_kv_source` names the producer, then, each round,
   looks the K keys up (RETRY -> HIT_PENDING -> HIT), steps itself, steps the producer, and
   sleeps `--pause-ms` (the model's forward pass) until the lookup resolves with K hits;
3. it loads the K blocks (every byte checked), finishes the request and steps; both engines
   step until neither waits on a tier job (the producer's pins come back).

Measured, after the warm-up requests, in `--repeat` interleaved runs of every case: the time
inside every method of each engine's tier object (the instance's methods wrapped with a
perf_counter_ns accumulator, or the scheduler thread's CPU with `--clock cpu`; a call nested in
another wrapped call is counted once), i.e. the time the tier holds vLLM's manager lock on the
scheduler thread, per request for the consumer (a consumer request) and for the producer (a
served request); the same for the manager's own methods (the whole scheduler-side offloading
work, tier included), for context; the lookup -> HIT latency (first lookup call to the return
of the lookup that reads K HITs, i.e. the promotion finished) and its rounds; the CPU of the
process's threads by name; and, after the requests, the cost of an idle step per engine.
Per-request times are the median over the repeats; latencies and rounds are pooled.

A busy producer (`--producer-step-ms 200`): the producer engine steps only every 200 ms (a long
forward pass, outside vLLM's lock), not every round; with `--tier-poll-ms 1`, vLLM's tier-poll
thread (0.33 on) serves the tiers meanwhile. The lookup -> answer latency (first lookup call to
the first that reads no RETRY: the peer's answer is in) then says how long a busy engine's
peers wait for its answers. `-inline` cases (`kvpeer-tcp-inline`, ...) run the tier with its
node's I/O on vLLM's thread (`io_thread` false), for comparison.

    python bench_tier.py [--requests 200] [--requests-large 30] [--keys 16] [--repeat 3]
                         [--cases kvpeer-nixl,kvpeer-tcp,kvpeer-shm,stock] [--blocks 16384,2097152]
                         [--pause-ms 0.5] [--clock wall|cpu] [--json PATH]
                         [--producer-step-ms 0] [--tier-poll-ms 0]
                         [--native]    # kvpeer's Rust calls timed apart (a proxy adds a little)
                         [--profile]   # cProfile of the tier methods (figures then inflated)

Needs the harness's PYTHONPATH (setup.sh's directory, and kvpeer); scripts/bench-vllm-tier.sh
sets everything up.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import math
import os
import platform
import pstats
import statistics
import sys
import threading
import time
from collections import defaultdict

os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("UCX_MODULES", "^ib*")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

import kvpeer  # noqa: E402
from harness import (  # noqa: E402
    Engine,
    LookupResult,
    free_port,
    make_engine,
    make_key,
    open_stock_session,
)

# Every method of SecondaryTierManager the manager may call on the scheduler thread.
TIER_METHODS = (
    "on_new_request",
    "lookup",
    "submit_load",
    "submit_store",
    "get_finished_jobs",
    "serve_external_requests",
    "on_schedule_end",
    "on_request_finished",
    "has_pending_work",
    "touch",
    "take_events",
    "drain_jobs",
    "get_stats",
)
# The manager's methods the connector (harness.Engine) calls.
MANAGER_METHODS = (
    "on_new_request",
    "lookup",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
    "on_schedule_end",
    "take_events",
    "has_pending_work",
)
# What a serving tier calls back on vLLM's manager (ParentManager), inside serve_external_requests.
PARENT_METHODS = ("on_new_request", "lookup", "create_store_job", "on_request_finished")
CASES = ("kvpeer-nixl", "kvpeer-tcp", "kvpeer-shm", "stock")
# Cases run on request only (--cases): the tier with its node's I/O on vLLM's thread.
EXTRA_CASES = ("kvpeer-nixl-inline", "kvpeer-tcp-inline", "kvpeer-shm-inline")
KIB = 1024
ROUND_LIMIT = 20_000  # rounds per wait: a bound, never reached in a healthy run
WAIT_LIMIT_S = 10.0  # seconds per wait, likewise
IDLE_STEPS = 200
# The meters' clock (a list so that --clock can set it before any wrapping).
CLOCK = [time.perf_counter_ns]


class Meter:
    """Time spent inside wrapped methods, by method; counts only while `on`. The clock is
    `CLOCK` (perf_counter_ns: wall time; `--clock cpu`: thread_time_ns, the calling thread's CPU).
    A wrapped call made from inside another wrapped call of the same meter is not counted
    again. With `profile` set, a cProfile.Profile records the counted calls."""

    def __init__(self) -> None:
        self.ns: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False
        self.depth = 0
        self.profile: cProfile.Profile | None = None

    def reset(self) -> None:
        self.ns.clear()
        self.calls.clear()

    def total_ns(self) -> int:
        return sum(self.ns.values())

    def wrap(self, obj, names) -> None:
        for name in names:
            fn = getattr(obj, name, None)
            if fn is not None and callable(fn):
                setattr(obj, name, self._wrapped(name, fn))

    def _wrapped(self, name, fn):
        ns, calls, clock = self.ns, self.calls, CLOCK[0]

        def timed(*args, **kwargs):
            if self.depth or not self.on:
                return fn(*args, **kwargs)
            self.depth = 1
            profile = self.profile
            if profile is not None:
                profile.enable()
            start = clock()
            try:
                return fn(*args, **kwargs)
            finally:
                ns[name] += clock() - start
                if profile is not None:
                    profile.disable()
                calls[name] += 1
                self.depth = 0

        timed.__wrapped__ = fn
        return timed


class ThreadCpu:
    """CPU time of this process's threads (utime + stime from /proc, clock ticks) by thread
    name, between start() and stop(); the calling (scheduler) thread is "scheduler"."""

    def __init__(self) -> None:
        self.tick_us = 1e6 / os.sysconf("SC_CLK_TCK")
        self.main = threading.get_native_id()
        self.before: dict[int, tuple[str, int]] = {}

    def sample(self) -> dict[int, tuple[str, int]]:
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(tid)] = (name, int(fields[11]) + int(fields[12]))
        return out

    def start(self) -> None:
        self.before = self.sample()

    def stop(self) -> dict[str, float]:
        """µs of CPU per thread name over the window (threads born in it count from 0)."""
        after = self.sample()
        by_name: dict[str, float] = defaultdict(float)
        for tid, (name, ticks) in after.items():
            spent = ticks - self.before.get(tid, (name, 0))[1]
            label = "scheduler" if tid == self.main else name
            by_name[label] += spent * self.tick_us
        return dict(by_name)


def timer_floor_ns() -> float:
    """What the meter records for a call that does nothing (its own clock and call cost)."""

    class Nop:
        def f(self):
            return None

    meter, nop = Meter(), Nop()
    meter.wrap(nop, ["f"])
    meter.on = True
    for _ in range(20_000):
        nop.f()
    meter.reset()
    for _ in range(100_000):
        nop.f()
    return meter.ns["f"] / meter.calls["f"]


def tier_config(case: str) -> dict:
    if case == "stock":
        return {"type": "p2p", "host": "127.0.0.1", "port": free_port()}
    # kvpeer-<plane>, or kvpeer-<plane>-inline: the node's I/O on vLLM's thread (`io_thread`
    # false), the tier as it was before its I/O thread, for comparison in the same run.
    plane, _, inline = case.split("-", 1)[1].partition("-")
    return {
        "type": "KvpeerTier",
        "module_path": "kvpeer.vllm",
        "host": "127.0.0.1",
        "port": free_port(),
        "plane": plane,
        "io_thread": inline != "inline",
    }


def new_engine(
    case: str, num_chunks: int, block_len: int, engine_id: str, tier_poll_s: float = 0
) -> Engine:
    """An engine of `case` on a free port (another pick if it was taken in the meantime)."""
    for attempt in range(3):
        try:
            # kvpeer's shm plane serves vLLM's /dev/shm file: give the engine one, as vLLM maps
            # its primary tier (a name unique to this process).
            shm = case.startswith("kvpeer-shm")
            return make_engine(
                tier_config(case),
                num_chunks,
                block_len,
                engine_id=f"{engine_id}-{os.getpid()}" if shm else engine_id,
                shm_region=shm,
                tier_poll_interval_s=tier_poll_s,
            )
        except Exception as exc:  # noqa: BLE001 - a port taken since free_port(): try another
            if "in use" not in str(exc).lower() or attempt == 2:
                raise
    raise AssertionError("unreachable")


def bounded(label: str, engines, until) -> int:
    """Steps `engines` in turn until `until()`; returns the rounds. Bounded in rounds and time."""
    deadline = time.monotonic() + WAIT_LIMIT_S
    for rounds in range(ROUND_LIMIT):
        if until():
            return rounds
        if time.monotonic() > deadline:
            break
        for engine in engines:
            engine.step()
    raise TimeoutError(f"{label}: not done after {WAIT_LIMIT_S}s")


def percentile(values, q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def make_blocks(base: list[bytes], request: int) -> list[bytes]:
    """K blocks for one request: the random base blocks with the request and block number in
    their first 16 bytes (every request's bytes differ)."""
    out = []
    for j, block in enumerate(base):
        b = bytearray(block)
        b[:16] = request.to_bytes(8, "little") + j.to_bytes(8, "little")
        out.append(bytes(b))
    return out


class NativeProxy:
    """Stands for KvpeerTier's Rust object (`tier._tier`) and times its method calls on a meter
    of their own (`--native`): how much of the tier's time is Rust, how much the adapter."""

    def __init__(self, obj, meter: Meter) -> None:
        self._obj = obj
        self._meter = meter
        self._methods: dict[str, object] = {}

    def __getattr__(self, name):
        fn = self._methods.get(name)
        if fn is not None:
            return fn
        attr = getattr(self._obj, name)
        if not callable(attr):
            return attr
        holder = type("Holder", (), {})()
        setattr(holder, name, attr)
        self._meter.wrap(holder, [name])
        fn = self._methods[name] = getattr(holder, name)
        return fn


def run_case(
    case: str,
    block_len: int,
    n: int,
    warmup: int,
    k: int,
    pause_s: float,
    profile: bool,
    native: bool,
    producer_step_s: float = 0,
    tier_poll_s: float = 0,
) -> tuple[dict, dict]:
    """One producer/consumer pair of `case`, `warmup` + `n` requests. Returns the raw figures of
    the timed requests (meter totals, latencies, rounds) and the cProfile profiles, if any."""
    tag = f"{case}-{block_len // KIB}k"
    producer = new_engine(case, 2 * k, block_len, f"P-{tag}", tier_poll_s)
    consumer = None
    try:
        consumer = new_engine(case, 2 * k, block_len, f"C-{tag}", tier_poll_s)
        # vLLM 0.34's stock consumer answers MISS until its session is up: open it first (the
        # warm-up requests open kvpeer's; nothing on 0.33).
        open_stock_session([consumer, producer], consumer, producer.port)
        meters = {
            "consumer_tier": Meter(),
            "producer_tier": Meter(),
            "consumer_manager": Meter(),
            "producer_manager": Meter(),
        }
        meters["consumer_tier"].wrap(consumer.tier, TIER_METHODS)
        meters["producer_tier"].wrap(producer.tier, TIER_METHODS)
        meters["consumer_manager"].wrap(consumer.manager, MANAGER_METHODS)
        meters["producer_manager"].wrap(producer.manager, MANAGER_METHODS)
        # vLLM's own code a serving tier runs through its ParentManager (part of its tier time).
        meters["producer_parent"] = Meter()
        meters["producer_parent"].wrap(
            producer.manager._tier_parents[producer.tier], PARENT_METHODS
        )
        if native and case != "stock":
            for side, engine in (("consumer", consumer), ("producer", producer)):
                meters[f"{side}_native"] = Meter()
                engine.tier._tier = NativeProxy(engine.tier._tier, meters[f"{side}_native"])
        profiles = {}
        if profile:
            for name in ("consumer_tier", "producer_tier"):
                profiles[name] = meters[name].profile = cProfile.Profile()

        def measuring(on: bool) -> None:
            for m in meters.values():
                m.on = on

        threads = ThreadCpu()
        rng = np.random.default_rng(block_len)
        base = [rng.bytes(block_len) for _ in range(k)]
        source = {"remote_host": "127.0.0.1", "remote_port": producer.port}
        latencies_us: list[float] = []
        lookup_us: list[float] = []
        rounds_per_request: list[int] = []
        lookup_rounds: list[int] = []
        settle_rounds: list[int] = []
        answers_seen: set[tuple[str, ...]] = set()
        started = time.perf_counter()
        for i in range(warmup + n):
            timed = i >= warmup
            if i == warmup:
                for m in meters.values():
                    m.reset()
                for p in profiles.values():
                    p.clear()
                started = time.perf_counter()
                threads.start()
            # 1. The producer computes the request's blocks (not measured).
            measuring(False)
            keys = [make_key(f"{tag}-{i}-{j}") for j in range(k)]
            blocks = make_blocks(base, i)
            own = producer.new_request(f"p-{i}")
            assert producer.put(keys, blocks, own) == keys, "producer could not store"
            producer.finish(own)
            producer.step()
            bounded(f"{tag} produce {i}", [producer], lambda: producer.jobs_in_flight() == 0)
            measuring(timed)
            # 2. The consumer's request: lookups until resolved.
            req = consumer.new_request(
                f"c-{i}", {"remote_kv_source": {"kv_request_id": f"kv-{tag}-{i}", **source}}
            )
            deadline = time.monotonic() + WAIT_LIMIT_S
            rounds = 0
            answered_at, answered_round = None, None
            t0 = time.perf_counter_ns()
            # A busy producer (--producer-step-ms) is inside a forward pass between its steps:
            # it steps only every producer_step_s, not every round.
            producer_stepped = time.perf_counter()
            while True:
                hits = consumer.lookup(keys, req)
                if answered_at is None and LookupResult.RETRY not in consumer.last_lookup:
                    # The peer's answer is in and the promotion started (HIT_PENDING).
                    answered_at, answered_round = time.perf_counter_ns(), rounds
                if hits is not None:
                    break
                answers_seen.add(tuple(sorted({r.name for r in consumer.last_lookup})))
                rounds += 1
                if rounds >= ROUND_LIMIT or time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{tag} request {i}: lookup unresolved after {rounds} rounds"
                    )
                consumer.step()
                if time.perf_counter() - producer_stepped >= producer_step_s:
                    producer.step()
                    producer_stepped = time.perf_counter()
                if pause_s:
                    time.sleep(pause_s)
            t1 = time.perf_counter_ns()
            assert hits == k and all(r is LookupResult.HIT for r in consumer.last_lookup), (
                tag,
                i,
                hits,
                [r.name for r in consumer.last_lookup],
            )
            # 3. Load (every byte checked), finish, settle.
            loaded = consumer.load(keys, req)
            assert loaded == blocks, f"{tag} request {i}: bytes differ"
            consumer.finish(req)
            consumer.step()
            settle = bounded(
                f"{tag} settle {i}",
                [producer, consumer],
                lambda: producer.jobs_in_flight() == 0 and consumer.jobs_in_flight() == 0,
            )
            if timed:
                latencies_us.append((t1 - t0) / 1e3)
                lookup_us.append((answered_at - t0) / 1e3)
                rounds_per_request.append(rounds)
                lookup_rounds.append(answered_round)
                settle_rounds.append(settle)
        elapsed = time.perf_counter() - started
        thread_cpu = threads.stop()
        measuring(False)
        for m in meters.values():
            m.profile = None
        raw = {
            "case": case,
            "tier": type(producer.tier).__name__,
            "plane": getattr(producer.tier, "plane", "nixl"),
            "block_len": block_len,
            "requests": n,
            "elapsed_s": elapsed,
            "ns": {name: dict(m.ns) for name, m in meters.items()},
            "calls": {name: dict(m.calls) for name, m in meters.items()},
            "latencies_us": latencies_us,
            "lookup_us": lookup_us,
            "rounds": rounds_per_request,
            "lookup_rounds": lookup_rounds,
            "settle_rounds": settle_rounds,
            "answers_seen": sorted(answers_seen),
            "thread_cpu_us": {name: v / n for name, v in thread_cpu.items()},
        }
        # Idle steps: what an engine pays per step with the tier loaded and nothing to do.
        for m in meters.values():
            m.reset()
        measuring(True)
        for _ in range(IDLE_STEPS):
            consumer.step()
            producer.step()
        measuring(False)
        raw["idle_step_us"] = {name: m.total_ns() / IDLE_STEPS / 1e3 for name, m in meters.items()}
        return raw, profiles
    finally:
        if consumer is not None:
            consumer.shutdown()
        producer.shutdown()


def aggregate(runs: list[dict], k: int, warmup: int, pause_s: float) -> dict:
    """The repeats of one case and block size: per-request times as the median over the
    repeats (each repeat's total / its requests; min and max kept), latencies and rounds pooled
    over all timed requests, the per-method breakdown over all of them."""
    first = runs[0]
    n_total = sum(r["requests"] for r in runs)
    sides = list(first["ns"])

    def per_req(r, side):
        return sum(r["ns"][side].values()) / r["requests"] / 1e3

    us = {side: statistics.median(per_req(r, side) for r in runs) for side in sides}
    spread = {
        side: [min(per_req(r, side) for r in runs), max(per_req(r, side) for r in runs)]
        for side in sides
    }
    methods = {}
    for side in sides:
        ns, calls = defaultdict(int), defaultdict(int)
        for r in runs:
            for m, v in r["ns"][side].items():
                ns[m] += v
            for m, v in r["calls"][side].items():
                calls[m] += v
        methods[side] = {
            m: {"us": ns[m] / n_total / 1e3, "calls": calls[m] / n_total}
            for m in sorted(ns, key=lambda m: -ns[m])
        }
    lat = [x for r in runs for x in r["latencies_us"]]
    look = [x for r in runs for x in r["lookup_us"]]
    rounds = [x for r in runs for x in r["rounds"]]
    lrounds = [x for r in runs for x in r["lookup_rounds"]]
    return {
        "case": first["case"],
        "tier": first["tier"],
        "plane": first["plane"],
        "block_len": first["block_len"],
        "keys_per_request": k,
        "requests_per_repeat": first["requests"],
        "repeats": len(runs),
        "warmup_per_repeat": warmup,
        "pause_ms": pause_s * 1e3,
        "requests_per_s": statistics.median(r["requests"] / r["elapsed_s"] for r in runs),
        "us_per_request": us,
        "us_per_request_min_max": spread,
        "methods_per_request": methods,
        "lookup_to_hit_us": {
            "p50": statistics.median(lat),
            "p99": percentile(lat, 99),
            "mean": statistics.fmean(lat),
            "min": min(lat),
            "max": max(lat),
        },
        "lookup_to_answer_us_p50": statistics.median(look),
        "lookup_to_answer_us_p99": percentile(look, 99),
        "rounds": {
            "p50": statistics.median(rounds),
            "p99": percentile(rounds, 99),
            "max": max(rounds),
        },
        "lookup_rounds_p50": statistics.median(lrounds),
        "settle_rounds_p50": statistics.median(x for r in runs for x in r["settle_rounds"]),
        "answers_seen": sorted({tuple(a) for r in runs for a in r["answers_seen"]}),
        "idle_step_us": {
            side: statistics.median(r["idle_step_us"][side] for r in runs) for side in sides
        },
        # CPU per timed request by thread name (both engines and the harness share the process;
        # "scheduler" is the thread that runs both engines' calls and the harness).
        "thread_cpu_us_per_request": {
            name: statistics.median(r["thread_cpu_us"].get(name, 0.0) for r in runs)
            for name in sorted({name for r in runs for name in r["thread_cpu_us"]})
        },
        "calls_per_request": {
            side: sum(v["calls"] for v in methods[side].values()) for side in sides
        },
    }


def fmt(x: float) -> str:
    if x >= 100:
        return f"{x:,.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=200, help="timed requests at 16 KiB")
    ap.add_argument("--requests-large", type=int, default=30, help="timed requests at 2 MiB")
    ap.add_argument("--warmup", type=int, default=10, help="warm-up requests at 16 KiB")
    ap.add_argument("--warmup-large", type=int, default=3, help="warm-up requests at 2 MiB")
    ap.add_argument("--keys", type=int, default=16, help="blocks per request")
    ap.add_argument(
        "--pause-ms", type=float, default=0.5, help="pause between rounds (forward pass)"
    )
    ap.add_argument(
        "--producer-step-ms",
        type=float,
        default=0,
        help="a busy producer: it steps only this often (its forward pass), not every round",
    )
    ap.add_argument(
        "--tier-poll-ms",
        type=float,
        default=0,
        help="vLLM's tier-poll thread (tier_poll_interval_s; 0: off, the issue's setting)",
    )
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--blocks", default="16384,2097152", help="block sizes in bytes")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every case, interleaved")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: perf_counter_ns (default); cpu: the scheduler thread's CPU (thread_time_ns)",
    )
    ap.add_argument(
        "--native", action="store_true", help="time kvpeer's Rust calls apart (adds a proxy)"
    )
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--profile", action="store_true", help="cProfile the tier methods (figures inflated)"
    )
    ap.add_argument("--profile-top", type=int, default=25)
    args = ap.parse_args()

    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES + EXTRA_CASES:
            ap.error(f"unknown case {c!r} (known: {', '.join(CASES + EXTRA_CASES)})")
    if any(c == "kvpeer-nixl" for c in cases) and not kvpeer.NIXL_BUILT:
        ap.error("kvpeer was built without nixl (cargo build --features nixl)")
    block_sizes = [int(b) for b in args.blocks.split(",") if b]
    if args.clock == "cpu":
        CLOCK[0] = time.thread_time_ns
    floor = timer_floor_ns()
    print(
        f"kvpeer {kvpeer.__version__} from {os.path.dirname(kvpeer.__file__)}; "
        f"Python {platform.python_version()}; {os.cpu_count()} CPUs; "
        f"{args.keys} blocks per request, pause {args.pause_ms} ms per round; "
        f"producer steps every {args.producer_step_ms or 'round'} ms, tier-poll thread "
        f"{args.tier_poll_ms or 'off'} ms; "
        f"{args.clock} clock, timer floor {floor:.0f} ns per wrapped call",
        flush=True,
    )
    raw: dict[tuple[int, str], list[dict]] = defaultdict(list)
    t_all = time.perf_counter()
    for rep in range(args.repeat):
        for block_len in block_sizes:
            large = block_len >= 1024 * KIB
            n = args.requests_large if large else args.requests
            warmup = args.warmup_large if large else args.warmup
            for case in cases:
                t = time.perf_counter()
                run, profiles = run_case(
                    case,
                    block_len,
                    n,
                    warmup,
                    args.keys,
                    args.pause_ms / 1e3,
                    args.profile,
                    args.native,
                    args.producer_step_ms / 1e3,
                    args.tier_poll_ms / 1e3,
                )
                raw[(block_len, case)].append(run)
                consumer_us = sum(run["ns"]["consumer_tier"].values()) / n / 1e3
                served_us = sum(run["ns"]["producer_tier"].values()) / n / 1e3
                print(
                    f"  [{rep + 1}/{args.repeat}] {case:12} {block_len // KIB:>5} KiB: "
                    f"{n} requests in {time.perf_counter() - t:.1f}s (consumer tier "
                    f"{consumer_us:,.0f} µs/req, served {served_us:,.0f} µs/req, "
                    f"lookup->HIT p50 {statistics.median(run['latencies_us']):,.0f} µs)",
                    flush=True,
                )
                for name, p in profiles.items():
                    out = io.StringIO()
                    pstats.Stats(p, stream=out).sort_stats("tottime").print_stats(args.profile_top)
                    print(f"\n--- cProfile, {case} {block_len // KIB} KiB, {name} methods ---")
                    print(out.getvalue())
    print(f"  all cases in {time.perf_counter() - t_all:.0f}s", flush=True)
    results = []
    for block_len in block_sizes:
        large = block_len >= 1024 * KIB
        warmup = args.warmup_large if large else args.warmup
        for case in cases:
            results.append(
                aggregate(raw[(block_len, case)], args.keys, warmup, args.pause_ms / 1e3)
            )
    return report(results, args, floor)


def ratios(results) -> list[dict]:
    """Per block size, each kvpeer case against the stock tier of the same run."""
    out = []
    for stock in (r for r in results if r["case"] == "stock"):
        for ours in results:
            if ours["case"] == "stock" or ours["block_len"] != stock["block_len"]:
                continue
            s, o = stock["us_per_request"], ours["us_per_request"]
            out.append(
                {
                    "block_len": stock["block_len"],
                    "case": ours["case"],
                    # stock / kvpeer: how many times less time under the lock (goal >= 10).
                    "consumer_tier_x": s["consumer_tier"] / o["consumer_tier"],
                    "served_tier_x": s["producer_tier"] / o["producer_tier"],
                    "consumer_manager_x": s["consumer_manager"] / o["consumer_manager"],
                    "served_manager_x": s["producer_manager"] / o["producer_manager"],
                    # kvpeer / stock: the fraction of the stock latency (goal <= 1/5 at 16 KiB).
                    "latency_p50_fraction": ours["lookup_to_hit_us"]["p50"]
                    / stock["lookup_to_hit_us"]["p50"],
                    "latency_p99_fraction": ours["lookup_to_hit_us"]["p99"]
                    / stock["lookup_to_hit_us"]["p99"],
                    "idle_step_tier_x": (
                        (
                            stock["idle_step_us"]["consumer_tier"]
                            + stock["idle_step_us"]["producer_tier"]
                        )
                        / max(
                            1e-9,
                            ours["idle_step_us"]["consumer_tier"]
                            + ours["idle_step_us"]["producer_tier"],
                        )
                    ),
                }
            )
    return out


def report(results, args, floor) -> int:
    print()
    print(
        "| blocks | tier | tier µs / consumer request "
        "| tier µs / served request (of which vLLM's parent calls) "
        "| lookup→answer p50 / p99 µs | lookup→HIT p50 / p99 µs | rounds p50 (answered, HIT) "
        "| manager µs / request (consumer, producer) | idle step: tier µs (consumer, producer) "
        "| req/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        u, lat, idle = r["us_per_request"], r["lookup_to_hit_us"], r["idle_step_us"]
        size = (
            f"{r['block_len'] // KIB} KiB"
            if r["block_len"] < 1024 * KIB
            else f"{r['block_len'] // (1024 * KIB)} MiB"
        )
        name = "stock p2p (NIXL)" if r["case"] == "stock" else f"KvpeerTier {r['plane']}"
        if r["case"].endswith("-inline"):
            name += " (I/O inline)"
        cells = [
            size,
            name,
            fmt(u["consumer_tier"]),
            f"{fmt(u['producer_tier'])} ({fmt(u['producer_parent'])})",
            f"{fmt(r['lookup_to_answer_us_p50'])} / {fmt(r['lookup_to_answer_us_p99'])}",
            f"{fmt(lat['p50'])} / {fmt(lat['p99'])}",
            f"{r['lookup_rounds_p50']:g}, {r['rounds']['p50']:g}",
            f"{fmt(u['consumer_manager'])}, {fmt(u['producer_manager'])}",
            f"{fmt(idle['consumer_tier'])}, {fmt(idle['producer_tier'])}",
            f"{r['requests_per_s']:.0f}",
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    rs = ratios(results)
    for x in rs:
        size = x["block_len"] // KIB
        p50, p99 = x["latency_p50_fraction"], x["latency_p99_fraction"]
        print(
            f"{size} KiB, stock / {x['case']}: time under the lock per consumer request "
            f"{x['consumer_tier_x']:.1f}x, per served request {x['served_tier_x']:.1f}x "
            f"(goal >= 10x); lookup->HIT p50 {p50:.2f} of stock (1/{1 / p50:.1f}), "
            f"p99 {p99:.2f} (1/{1 / p99:.1f}) (goal <= 1/5 at 16 KiB); "
            f"manager {x['consumer_manager_x']:.1f}x / {x['served_manager_x']:.1f}x; "
            f"idle step {x['idle_step_tier_x']:.1f}x"
        )
    print()
    print("Spread over the repeats (tier µs per request, min-max: consumer; served):")
    for r in results:
        (c0, c1), (s0, s1) = (
            r["us_per_request_min_max"]["consumer_tier"],
            r["us_per_request_min_max"]["producer_tier"],
        )
        print(
            f"  {r['block_len'] // KIB} KiB {r['case']}: {fmt(c0)}-{fmt(c1)}; {fmt(s0)}-{fmt(s1)}"
        )
    print()
    print(
        f"Wrapped calls per request (tier: consumer, served); each adds ~{floor / 1e3:.2f} µs of "
        "timer floor to the figures:"
    )
    for r in results:
        c = r["calls_per_request"]
        size = r["block_len"] // KIB
        print(f"  {size} KiB {r['case']}: {c['consumer_tier']:.1f}, {c['producer_tier']:.1f}")
    print()
    print("CPU per request by thread (µs; both engines share this process; 'scheduler' = the")
    print("thread running both engines' calls and the harness):")
    for r in results:
        parts = ", ".join(
            f"{name} {fmt(v)}"
            for name, v in sorted(r["thread_cpu_us_per_request"].items(), key=lambda kv: -kv[1])
            if v > 0
        )
        print(f"  {r['block_len'] // KIB} KiB {r['case']}: {parts}")
    print()
    print("Where the tier time goes (µs per request, calls per request):")
    for r in results:
        size = r["block_len"] // KIB
        for side in (
            "consumer_tier",
            "producer_tier",
            "producer_parent",
            "consumer_native",
            "producer_native",
        ):
            if side not in r["methods_per_request"]:
                continue
            parts = ", ".join(
                f"{m} {fmt(v['us'])} ({v['calls']:.1f})"
                for m, v in r["methods_per_request"][side].items()
            )
            label = (
                side.replace("_tier", "")
                .replace("_native", " (Rust calls)")
                .replace("_parent", " (vLLM parent calls)")
            )
            print(f"  {size} KiB {r['case']} {label}: {parts}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "config": {k: v for k, v in vars(args).items() if k != "json"},
                    "python": platform.python_version(),
                    "cpus": os.cpu_count(),
                    "timer_floor_ns_per_call": floor,
                    "results": results,
                    "ratios": rs,
                },
                f,
                indent=1,
            )
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
