"""A vLLM 0.33 P2P peer, for kvpeer's interop tests and side-by-side benchmark.

vLLM's own `ZmqTransport` and `P2PSession` (extracted unchanged by setup.sh) are driven the way
vLLM's `P2PSecondaryTierManager` drives them: every round (vLLM's tier-poll thread, 1 ms apart)
polls the control transport, accepts inbound connections as sessions, polls every session,
collects load and store results, reaps dead sessions, and lets every session serve inbound
lookups through the parent tier (`serve_external_requests`); the consumer's lookups go out at a
step's end (`flush_pending_lookups`). The data plane is kvpeer's `shm` plane
(`shm_transport.py`). Written for kvpeer; nothing here is vLLM's code.

    vllm_peer.py serve --fill 256              producer: serves synthetic blocks until SIGTERM
    vllm_peer.py fetch --peer HOST:PORT        consumer: the `kvpeer fetch` workload
    vllm_peer.py serve --fill 8 --kv-events tcp://*:5557 --kv-events-replay tcp://*:5558
                                               producer announcing its blocks (vLLM's KV events)

Both print JSON lines on stdout: `{"event": "ready", ...}` once listening, and
`{"event": "summary", ...}` at the end, with the workload's figures, the messages seen on the
wire, the sessions that died (and why), and what was left open (sessions, pins, requests).
Exit status: 0 when every load succeeded and every byte matched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from shm_transport import ShmPool, ShmTransport  # noqa: E402

from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.control import ZmqTransport  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.session import P2PSession  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.session import client as vllm_client  # noqa: E402
from vllm.v1.kv_offload.tiering.p2p.session.protocol import TYPE_KEY  # noqa: E402

# vLLM's default pause between tier-poll rounds (DEFAULT_TIER_POLL_INTERVAL_S).
TICK_S = 0.001
# First synthetic index of the keys no one holds (as `kvpeer fetch`).
MISS_BASE = 1 << 48


def key(i: int) -> bytes:
    """Synthetic key `i` (docs/synthetic-workload.md)."""
    return hashlib.sha256(f"kvpeer-synthetic:{i}".encode()).digest() + (0).to_bytes(4, "big")


class ArrayPool:
    """A pool in a numpy array (anonymous memory: transparent huge pages where the kernel
    gives them), as vLLM's CPU tier holds its blocks; for the nixl transport only (no object a
    shm peer could open)."""

    def __init__(self, num_blocks: int, block_len: int) -> None:
        import numpy as np

        self.array = np.zeros((num_blocks, block_len), dtype=np.uint8)
        self.block_len = block_len
        self.view = memoryview(self.array)
        self.name = None

    def block(self, i: int) -> memoryview:
        return memoryview(self.array[i])

    def close(self) -> None:
        pass  # the transport keeps a pointer into it; the array goes at exit


def timed_nixl_registration(register_us: list[int]) -> None:
    """Times every `register_memory` of vLLM's NIXL agent class (the pool's registration) into
    `register_us`."""
    from vllm.distributed import nixl_utils

    cls = nixl_utils.NixlWrapper
    real = cls.register_memory

    def register_memory(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real(self, *args, **kwargs)
        finally:
            register_us.append(int((time.perf_counter() - t0) * 1e6))

    cls.register_memory = register_memory


def content(k: bytes, n: int) -> bytes:
    """The bytes of the block holding synthetic key `k`."""
    p = hashlib.sha256(k).digest()
    return (p * (n // 32 + 1))[:n]


class Wire:
    """What crossed the control channel: message counts each way, abort_ack rounds."""

    def __init__(self) -> None:
        self.received: Counter[str] = Counter()
        self.sent: Counter[str] = Counter()
        self.abort_ack_rounds: list[int] = []
        self.abort_rounds: list[int] = []


class RecordedConnection:
    """A vLLM control connection that counts what it carries (delegates everything), and gives
    each `connect` the data plane's metadata for its destination.

    vLLM's session asks its transport for one `agent_metadata` for every peer
    (`get_agent_metadata()` in `_send_connect`), but kvpeer's shm plane proves pool ownership
    with a token made for one destination; as kvpeer's node does, the `connect` gets it here,
    just before it leaves, from the transport's `connect_metadata(peer_id)` (NIXL: unchanged)."""

    def __init__(self, conn, wire: Wire, transport=None) -> None:
        self._conn = conn
        self._wire = wire
        self.peer_id = conn.peer_id
        self._connect_metadata = getattr(transport, "connect_metadata", None)

    @property
    def alive(self) -> bool:
        return self._conn.alive

    def send(self, msg: dict) -> None:
        if msg.get(TYPE_KEY) == "connect" and self._connect_metadata is not None:
            msg = {**msg, "agent_metadata": self._connect_metadata(self.peer_id)}
        self._wire.sent[msg.get(TYPE_KEY, "?")] += 1
        if msg.get(TYPE_KEY) == "abort_fetch":
            self._wire.abort_rounds.append(msg.get("round_seq"))
        self._conn.send(msg)

    def recv(self):
        msgs = self._conn.recv()
        for m in msgs:
            kind = m.get(TYPE_KEY, "?") if isinstance(m, dict) else "?"
            self._wire.received[kind] += 1
            if kind == "abort_ack":
                self._wire.abort_ack_rounds.append(m.get("round_seq"))
        return msgs

    def mark_dead(self) -> None:
        self._conn.mark_dead()

    def close(self) -> None:
        self._conn.close()


class _Ids(list):
    """The block ids of a store job (vLLM hands a numpy array; the session calls tolist())."""

    def tolist(self) -> list[int]:
        return list(self)


class StoreJob:
    def __init__(self, job_id: int, keys: list[bytes], blocks: list[int]) -> None:
        self.job_id = job_id
        self.keys = keys
        self.chunk_ids = _Ids(blocks)


class Parent:
    """The tiering manager a session serves from (vLLM's `ParentManager`): an index of the
    blocks held, keys answered HIT_PENDING, pins per store job, and open synthetic requests."""

    def __init__(self) -> None:
        self.index: dict[bytes, int] = {}
        self.pending: set[bytes] = set()
        self.pins: dict[int, list[int]] = {}
        self.open_ctxs: set[str] = set()
        self._next_job = 1 << 40

    def on_new_request(self, ctx) -> None:
        self.open_ctxs.add(ctx.req_id)

    def on_request_finished(self, ctx) -> None:
        self.open_ctxs.discard(ctx.req_id)

    def lookup(self, k: bytes, ctx) -> LookupResult:
        if k in self.index:
            return LookupResult.HIT
        if k in self.pending:
            return LookupResult.HIT_PENDING
        return LookupResult.MISS

    def create_store_job(self, keys, ctx) -> StoreJob:
        self._next_job += 1
        blocks = [self.index[k] for k in keys]
        self.pins[self._next_job] = blocks
        return StoreJob(self._next_job, list(keys), blocks)

    def end_store_job(self, job_id: int) -> None:
        self.pins.pop(job_id, None)


class StallingTransport(ShmTransport):
    """A data plane whose writes never land (for load-timeout and abort tests): a write is
    accepted and stays in flight until cancelled."""

    def write_blocks(self, peer_id, local_idxs, remote_idxs):
        self._next_id += 1
        return self._next_id


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VllmPeer:
    """vLLM's P2P tier manager, reduced to what the interop workloads use."""

    def __init__(self, args, tag: str) -> None:
        host, _, port = args.listen.rpartition(":")
        port = int(port) or free_port(host)
        self.local_id = f"{host}:{port}"
        self.block_len = args.block_len
        self.hash_seed = args.hash_seed
        if args.pool == "numpy":
            if args.transport != "nixl":
                sys.exit("--pool numpy needs --transport nixl (a shm peer opens the pool by name)")
            self.pool = ArrayPool(args.blocks, args.block_len)
        else:
            self.pool = ShmPool(f"kvpeer-vllm-{tag}-{os.getpid()}", args.blocks, args.block_len)
        fields = {"model": args.model} if args.model else None
        self.register_us: list[int] = []
        if args.transport == "nixl":
            # vLLM's own NIXL transport, as its manager makes it (a uuid agent name, UCX).
            from vllm.v1.kv_offload.tiering.p2p.data.nixl import NixlTransport

            timed_nixl_registration(self.register_us)
            self.data = NixlTransport(str(uuid.uuid4()), self.pool.view, config_fields=fields)
            if not self.data.available:
                sys.exit("NIXL is not available (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1)")
        else:
            transport = StallingTransport if getattr(args, "stall_writes", False) else ShmTransport
            self.data = transport(self.pool, self.local_id, config_fields=fields)
        self.control = ZmqTransport(self.local_id, host, port)
        self.sessions: dict[str, P2PSession] = {}
        self.parent = Parent()
        self.wire = Wire()
        self.load_results: dict[int, bool] = {}
        self.failed_req_ids: set[str] = set()
        self.deaths: list[dict] = []
        self.started = time.monotonic()

    # -- the manager's round -------------------------------------------------------------

    def _new_session(self, peer_id: str, conn) -> P2PSession:
        return P2PSession(
            peer_id=peer_id,
            local_id=self.local_id,
            transport=self.data,
            local_block_len=self.block_len,
            local_hash_seed=self.hash_seed,
            conn=RecordedConnection(conn, self.wire, self.data),
        )

    def connect(self, peer_id: str) -> P2PSession:
        session = self.sessions.get(peer_id)
        if session is None:
            session = self._new_session(peer_id, self.control.connect(peer_id))
            self.sessions[peer_id] = session
        return session

    def tick(self) -> None:
        for conn in self.control.poll():
            if conn.peer_id in self.sessions:
                conn.close()  # vLLM rejects a duplicate connection the same way
                continue
            self.sessions[conn.peer_id] = self._new_session(conn.peer_id, conn)
        for session in self.sessions.values():
            result = session.poll()
            for lr in result.loads:
                self.load_results[lr.job_id] = lr.success
                if not lr.success:
                    self.failed_req_ids.add(lr.kv_request_id)
            for sr in result.stores:
                self.parent.end_store_job(sr.job_id)
        self._reap_dead()
        for session in self.sessions.values():
            session.serve_external_requests(self.parent)

    def flush_lookups(self) -> None:
        """A scheduler step's end: send the lookups registered during the step."""
        for session in self.sessions.values():
            session.flush_pending_lookups()

    def _reap_dead(self) -> None:
        dead = [p for p, s in self.sessions.items() if s.connected and not s.alive]
        for peer_id in dead:
            session = self.sessions.pop(peer_id)
            closed = session.close()
            for job_id in closed.failed_jobs:
                self.load_results[job_id] = False
            for job_id in closed.failed_stores:
                self.parent.end_store_job(job_id)
            self.failed_req_ids.update(closed.failed_req_ids)
            for ctx in closed.failed_serves:
                self.parent.on_request_finished(ctx)
            self.data.remove_remote_peer(peer_id)
            self.deaths.append(
                {
                    "peer": peer_id,
                    "reason": session.death_reason,
                    "after_s": round(time.monotonic() - self.started, 3),
                }
            )

    def wait(self, done, timeout_s: float) -> bool:
        """Runs rounds until `done()` (True) or the timeout (False)."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() >= deadline:
                return False
            self.tick()
            time.sleep(TICK_S)
        return True

    def leftover(self) -> dict:
        return {
            "sessions": len(self.sessions),
            "pins": sum(len(b) for b in self.parent.pins.values()),
            "open_lookups": len(self.parent.open_ctxs),
            "pending_work": any(s.has_pending_work for s in self.sessions.values()),
            "client_requests": sum(len(s._client._requests) for s in self.sessions.values()),
            "server_requests": sum(len(s._server._requests) for s in self.sessions.values()),
        }

    def close(self) -> None:
        for session in self.sessions.values():
            session.close()
        self.sessions.clear()
        self.control.close()
        self.data.close()
        self.pool.close()

    def summary(self, **extra) -> dict:
        return {
            "event": "summary",
            "id": self.local_id,
            "received": dict(self.wire.received),
            "sent": dict(self.wire.sent),
            "abort_rounds": self.wire.abort_rounds,
            "abort_ack_rounds": self.wire.abort_ack_rounds,
            "deaths": self.deaths,
            "leftover": self.leftover(),
            "nixl_register_us": self.register_us,
            **extra,
        }


def emit(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def pool_name(pool) -> str | None:
    """The pool's shared-memory object, if it has one."""
    return pool.shm.name if isinstance(pool, ShmPool) else None


def percentiles(samples: list[int]) -> list[int]:
    if not samples:
        return [0, 0]
    s = sorted(samples)
    return [s[min(len(s) - 1, len(s) * p // 100)] for p in (50, 99)]


# -- serve --------------------------------------------------------------------------------


def serve(args) -> int:
    peer = VllmPeer(args, "serve")
    if args.fill > peer.pool.view.shape[0]:
        sys.exit(f"--fill {args.fill} exceeds --blocks {args.blocks}")
    for b in range(args.fill):
        k = key(args.first + b)
        peer.pool.block(b)[:] = content(k, args.block_len)
        peer.parent.index[k] = b
    for i in range(args.pending_count):
        peer.parent.pending.add(key(args.pending_first + i))

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    events = publish_kv_events(args) if args.kv_events else None
    emit({"event": "ready", "id": peer.local_id, "shm": pool_name(peer.pool),
          "nixl_register_us": peer.register_us})
    cpu0 = time.process_time()
    while not stop:
        peer.tick()
        time.sleep(TICK_S)
    emit(peer.summary(cpu_s=round(time.process_time() - cpu0, 3)))
    if events is not None:
        events.shutdown()
    peer.close()
    return 0


def publish_kv_events(args):
    """vLLM's own `ZmqEventPublisher` announcing the filled blocks, as vLLM's CPU tier does
    with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: one batch of placeholder `BlockStored`
    events, `medium="CPU"`, each chunk's hash the offload key's bytes without its 4-byte group
    suffix and `group_idx` that suffix. Batch 0, kept in the publisher's replay buffer for a
    subscriber that joins later."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher

    pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=args.kv_events,
                            replay_endpoint=args.kv_events_replay or None)
    evs = []
    for b in range(args.fill):
        k = key(args.first + b)
        evs.append(BlockStored(block_hashes=[k[:-4]], parent_block_hash=None, token_ids=[],
                               block_size=0, lora_id=None, medium="CPU", lora_name=None,
                               group_idx=int.from_bytes(k[-4:], "big")))
    pub.publish(KVEventBatch(ts=time.time(), events=evs))
    pub._event_queue.join()  # sent (and in the replay buffer) before `ready`
    return pub


# -- fetch --------------------------------------------------------------------------------


def fetch(args) -> int:
    _set_load_timeout(args.load_timeout)
    peer = VllmPeer(args, "fetch")
    free_blocks = list(range(peer.pool.view.shape[0]))
    session = peer.connect(args.peer)
    emit({"event": "ready", "id": peer.local_id, "shm": pool_name(peer.pool),
          "nixl_register_us": peer.register_us})
    # A refused session is reaped (and closed) by the round that sees it dead.
    if not peer.wait(lambda: session.ready or args.peer not in peer.sessions, args.timeout):
        sys.exit("handshake timed out")
    if not session.ready:
        peer.tick()  # reap it, recording why
        emit(peer.summary(handshake="refused"))
        peer.close()
        return 1

    t = Counter()
    lookup_us: list[int] = []
    fetch_us: list[int] = []
    job = 0

    def session_alive() -> bool:
        return peer.sessions.get(args.peer) is session and session.alive

    def settle(load, verify: bool) -> None:
        """Waits for a load's result, then checks every block it brought."""
        job_id, hits, blocks, t0 = load
        if not peer.wait(lambda: job_id in peer.load_results, args.timeout + 15):
            emit(peer.summary(error="load never ended", **dict(t)))
            sys.exit(1)
        if peer.load_results.pop(job_id):
            fetch_us.append(int((time.monotonic() - t0) * 1e6))
            t["bytes"] += args.block_len * len(hits)
            for k, b in zip(hits, blocks) if verify else ():
                if bytes(peer.pool.block(b)) != content(k, args.block_len):
                    t["corrupt_blocks"] += 1
        else:
            t["failed_loads"] += 1
        free_blocks.extend(blocks)

    def request_keys(r: int) -> tuple[str, list[bytes]]:
        """Request `r`'s id and keys: a shared prefix, then keys no one holds."""
        misses = min(args.keys, round(args.keys * args.miss_share))
        shared = args.keys - misses
        prefix = r % args.prefixes if args.prefixes else r
        first = args.first + prefix * shared
        keys = [key(i) for i in range(first, first + shared)]
        keys += [key(MISS_BASE + r * misses + i) for i in range(misses)]
        return f"vllm-fetch-{os.getpid()}-{r}", keys

    def lookup(wanted: list[tuple[str, list[bytes]]]) -> list[int]:
        """Looks up every (id, keys) at once, as one scheduler step; returns the leading hits."""
        t0 = time.monotonic()
        for kv_id, ks in wanted:
            for k in ks:
                session.register_lookup(kv_id, k)
        peer.flush_lookups()
        answered = peer.wait(
            lambda: all(session.register_lookup(i, k) is not None for i, ks in wanted for k in ks)
            or not session_alive(),
            args.timeout,
        )
        if not answered or not session_alive():
            emit(peer.summary(error="lookup unanswered", **dict(t)))
            sys.exit(1)
        took = int((time.monotonic() - t0) * 1e6)
        leading = []
        for kv_id, ks in wanted:
            lookup_us.append(took)
            found = [session.register_lookup(kv_id, k) for k in ks]
            n = next((i for i, f in enumerate(found) if not f), len(found))
            t["hits"] += n
            t["misses"] += len(ks) - n
            leading.append(n)
        return leading

    def load(kv_id: str, hits: list[bytes]):
        nonlocal job
        blocks = [free_blocks.pop() for _ in hits]
        job += 1
        session.request_blocks(job, kv_id, hits, blocks)
        if args.die_after_fetch:
            peer.tick()  # the fetch goes out; the producer starts writing into us
            os.kill(os.getpid(), signal.SIGKILL)
        return (job, hits, blocks, time.monotonic())

    def run_one(r: int, verify: bool) -> None:
        kv_id, keys = request_keys(r)
        # The request's keys in `rounds` consecutive chunks. Symmetric P2P: each chunk is
        # looked up, then its leading hits fetched (a lookup round closed by a fetch); a round
        # with no hit ends the request, whose finish then owes the peer the terminal empty
        # fetch. PD (`--pd`): a decoder fetches every chunk without asking, all in flight at
        # once, as the scheduler submits loads while the prefix resolves.
        per_round = -(-len(keys) // args.rounds)
        chunks = [keys[i : i + per_round] for i in range(0, len(keys), per_round)]
        in_flight = []
        for chunk in chunks:
            hits = chunk if args.pd else chunk[: lookup([(kv_id, chunk)])[0]]
            if not hits:
                break
            in_flight.append(load(kv_id, hits))
            if not args.pd:
                settle(in_flight.pop(), verify)
                if len(hits) < len(chunk):
                    break
        for l in in_flight:
            settle(l, verify)
        session.finish_request(kv_id)
        peer.tick()

    def run_batch(rs: range, verify: bool) -> None:
        """Requests in flight together, as an engine step with several: their lookups go out
        in one step, their fetches together, then they finish."""
        wanted = [request_keys(r) for r in rs]
        in_flight = [
            load(kv_id, ks[:n]) for (kv_id, ks), n in zip(wanted, lookup(wanted)) if n
        ]
        for l in in_flight:
            settle(l, verify)
        for kv_id, _ in wanted:
            session.finish_request(kv_id)
        peer.tick()

    def phase(rs: range, verify: bool) -> None:
        if args.concurrency > 1:
            for i in range(rs.start, rs.stop, args.concurrency):
                run_batch(range(i, min(i + args.concurrency, rs.stop)), verify)
        else:
            for r in rs:
                run_one(r, verify)

    if args.concurrency > 1 and (args.rounds > 1 or args.pd):
        sys.exit("--concurrency runs one symmetric round per request (no --rounds, no --pd)")
    phase(range(args.warmup), True)
    if args.warmup:
        # The figures start here; failures and mismatches of the warm-up still count.
        t = Counter(failed_loads=t["failed_loads"], corrupt_blocks=t["corrupt_blocks"])
        lookup_us.clear()
        fetch_us.clear()
    cpu0, started = time.process_time(), time.monotonic()
    phase(range(args.warmup, args.warmup + args.requests), args.verify)
    workload_s = time.monotonic() - started
    cpu_s = time.process_time() - cpu0
    # Let the last finishes (terminal fetches, abort acks) settle before reporting.
    peer.wait(lambda: not any(s.has_pending_work for s in peer.sessions.values()), 15)
    ok = t["failed_loads"] == 0 and t["corrupt_blocks"] == 0
    emit(
        peer.summary(
            requests=args.requests,
            hits=t["hits"],
            misses=t["misses"],
            bytes=t["bytes"],
            corrupt_blocks=t["corrupt_blocks"],
            failed_loads=t["failed_loads"],
            lookup_us=percentiles(lookup_us),
            fetch_us=percentiles(fetch_us),
            workload_s=round(workload_s, 4),
            cpu_s=round(cpu_s, 4),
            fetch_s=round(sum(fetch_us) / 1e6, 4),
        )
    )
    peer.close()
    return 0 if ok or args.expect_failures else 1



# The consumer's load timeout, by contract rather than version: 0.33 has one
# (`_LOAD_TIMEOUT_S`, 30 s); 0.34 tells a symmetric-P2P load (`_P2P_LOAD_TIMEOUT_S`, 10 s, the
# request ran its lookups) from a PD one (`_PD_LOAD_TIMEOUT_S`, 30 s).
_LOAD_TIMEOUT_NAMES = tuple(
    n
    for n in ("_LOAD_TIMEOUT_S", "_P2P_LOAD_TIMEOUT_S", "_PD_LOAD_TIMEOUT_S")
    if hasattr(vllm_client, n)
)


def _load_timeout() -> float:
    """The load timeout of this vLLM's consumer (the shortest, where it has two)."""
    return min(getattr(vllm_client, n) for n in _LOAD_TIMEOUT_NAMES)


def _set_load_timeout(seconds: float) -> None:
    """Sets every load timeout of this vLLM's consumer (the engine's setting, not vLLM's code)."""
    for n in _LOAD_TIMEOUT_NAMES:
        setattr(vllm_client, n, seconds)


def main() -> int:
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 PID` prints every thread's stack
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("serve", "fetch"):
        s = sub.add_parser(name)
        s.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT; port 0 picks one")
        s.add_argument("--blocks", type=int, default=1024)
        s.add_argument("--block-len", type=int, default=65536)
        # vLLM's own resolution (kv_cache_utils.resolve_none_hash_seed, sha256 hashing).
        s.add_argument("--hash-seed", default=os.getenv("PYTHONHASHSEED", "vllm-none-hash"))
        s.add_argument("--model", default="", help="config fingerprint field (none: no fingerprint)")
        s.add_argument("--first", type=int, default=0, help="synthetic index of the first key")
        s.add_argument(
            "--transport", choices=["shm", "nixl"], default="shm",
            help="data plane: kvpeer's shm plane, or vLLM's own NixlTransport",
        )
        s.add_argument(
            "--pool", choices=["shm", "numpy"], default="shm",
            help="the blocks' memory: a shared-memory object, or a numpy array (nixl only)",
        )
    serve_p, fetch_p = sub.choices["serve"], sub.choices["fetch"]
    serve_p.add_argument("--fill", type=int, default=0, help="hold synthetic blocks first..+N")
    serve_p.add_argument("--pending-first", type=int, default=0)
    serve_p.add_argument("--pending-count", type=int, default=0, help="keys answered HIT_PENDING")
    serve_p.add_argument("--stall-writes", action="store_true", help="writes never land")
    serve_p.add_argument(
        "--kv-events", default="", help="publish KV events for the filled blocks (PUB endpoint)"
    )
    serve_p.add_argument("--kv-events-replay", default="", help="the events' replay endpoint")
    fetch_p.add_argument("--peer", required=True)
    fetch_p.add_argument("--requests", type=int, default=16)
    fetch_p.add_argument("--keys", type=int, default=8)
    fetch_p.add_argument("--miss-share", type=float, default=0.25)
    fetch_p.add_argument("--prefixes", type=int, default=0, help="cycle over N prefixes (0: all new)")
    fetch_p.add_argument("--rounds", type=int, default=1, help="lookup+fetch rounds per request")
    fetch_p.add_argument("--pd", action="store_true", help="fetch without lookup (PD decoder)")
    fetch_p.add_argument(
        "--concurrency", type=int, default=1, help="requests in flight together (one step)"
    )
    fetch_p.add_argument("--timeout", type=float, default=30.0)
    fetch_p.add_argument("--load-timeout", type=float, default=_load_timeout())
    fetch_p.add_argument(
        "--no-verify", dest="verify", action="store_false", help="skip the byte check"
    )
    fetch_p.add_argument(
        "--warmup", type=int, default=0, help="requests first, checked, not in the figures"
    )
    fetch_p.add_argument(
        "--die-after-fetch", action="store_true", help="SIGKILL itself right after its first fetch"
    )
    fetch_p.add_argument("--expect-failures", action="store_true", help="exit 0 on failed loads")
    args = p.parse_args()
    return serve(args) if args.cmd == "serve" else fetch(args)


if __name__ == "__main__":
    sys.exit(main())
