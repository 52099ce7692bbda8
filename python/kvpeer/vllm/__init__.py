"""kvpeer as a vLLM secondary tier (the releases README.md names): the engine's P2P tier, in Rust.

vLLM loads it by module path (``vllm/v1/kv_offload/tiering/factory.py``) from the engine's
``--kv-transfer-config``::

    "secondary_tiers": [{"type": "KvpeerTier", "module_path": "kvpeer.vllm",
                         "host": "10.0.0.5", "port": 5710, "plane": "auto",
                         "allow": ["10.0.0.0/8"]}]

It speaks the stock ``p2p`` tier's protocol byte for byte, so engines running either tier
share blocks both ways. The tier is a thin adapter: the node (sessions, lookups, fetches,
deadlines, the data plane) is kvpeer's Rust ``EngineTier`` over vLLM's primary tier memory;
this module translates vLLM's calls and keeps only the per-request bookkeeping vLLM's
contract needs (which keys a request asked, which pins a peer holds).

Threads: vLLM calls every method from the scheduler thread and, where it has one (0.33 with
``tier_poll_interval_s`` > 0), its ``vllm_offload_tier_poll`` thread
(``tolerates_off_thread_polling``), under its manager lock where it has one; ``shutdown``
without the lock. Where no thread polls tiers (vLLM 0.32; 0.33 with the interval at 0), an idle
engine steps only while a tier has pending work, so ``has_pending_work`` is then always true (as
the stock tier's), else an idle producer would never answer a peer. No method waits on the
network (``drain_jobs`` and ``shutdown`` wait for transfers to end, as the contract asks). Rust
never calls Python: results come back as return values.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

try:
    from vllm.v1.kv_offload.base import (
        LookupResult,
        OffloadPolicy,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
    )
    from vllm.v1.kv_offload.tiering.base import (
        JobResult,
        ParentManager,
        SecondaryTierManager,
        TransferJob,
    )
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as e:  # no vLLM, or one without the tier contract (before 0.32's)
    from kvpeer._native import VLLM_TIER

    raise ImportError(
        "kvpeer.vllm is a vLLM secondary tier: it needs vLLM with the out-of-tree tier contract "
        f"(vllm/v1/kv_offload/tiering: vLLM {VLLM_TIER}) in this Python "
        f"({sys.executable}); {e}. kvpeer.Node works without vLLM.",
        name=e.name,
        path=e.path,
    ) from e

from kvpeer import _native

# vLLM 0.34's JobResult carries `deferred_release`: a failed load may be reported at once, its
# chunks freed only when the tier sets the event. Told by the contract, not by the version.
_DEFERRED_RELEASE = "deferred_release" in getattr(JobResult, "__dataclass_fields__", {})

logger = logging.getLogger("kvpeer.vllm")

# The stock tier's defaults (vLLM's envs), read the same way.
_DEFAULT_HOST = "localhost"
_DEFAULT_PORT = 5710
# Seconds drain_jobs waits before it warns that a transfer is stuck (it keeps waiting: a
# transfer may not be aborted mid-copy; kvpeer's own deadlines end it).
_DRAIN_WARN_S = 5.0
# How long shutdown lets running writes finish before it closes the sessions.
_SHUTDOWN_DRAIN_S = 3.0
# How long one wait of drain_jobs lasts.
_DRAIN_WAIT_S = 0.001

# Keys of the tier's config entry: the stock tier's, then kvpeer's. The value is the
# kvpeer setting it becomes (None: handled here).
_STOCK_KEYS = ("host", "port", "backends", "num_threads", "unbound_store_timeout_s")
# Fair shares of what peers consume (docs/security.md, G7 and G10), as in a config file.
_FAIR_SHARE_KEYS = (

    "max_peers_per_host",
    "send_queue_bytes",
    "max_inbound_connections",
    "max_inbound_per_source",
    "inbound_read_budget",
    "inbound_messages_per_round",
    "inbound_accepts_per_round",
    "inbound_round_quantum_us",
    "inbound_ms_per_s",
    "max_lookup_keys",
    "lookup_slice_keys",
    "lookup_keys_per_s",
    "max_pins_per_peer",
    "max_pinned_blocks",
    "pin_eviction_min_age_ms",
    "max_held_keys_per_peer",
    "max_held_bytes_per_peer",
    "max_held_bytes",
    "max_requests_per_peer",
    "max_peer_blocks",
    "tcp_min_rate",
    "tcp_transfer_timeout_s",
)
_KVPEER_KEYS = (
    "plane",
    "allow",
    "tenant",
    "tenants",
    "auth_secret_file",
    "max_peers",
    "tcp_max_rate",
    "tcp_block_digests",
    "tls",
    "tls_cert",
    "tls_key",
    "tls_ca",
    "tcp_port",
    "metrics",
    "io_thread",
    "lookup_timeout_s",
    "load_timeout_s",
    "pd_load_timeout_s",
    "abort_ack_timeout_s",
    "transfer_stall_timeout_s",
    "retained_hold_cap_s",
    "handshake_timeout_s",
    "idle_timeout_s",
    "host_probe_timeout_ms",
    "host_down_hold_ms",
) + _FAIR_SHARE_KEYS
# The fleet: pool nodes (and peers) asked when no router names a producer, or after it
# (handled here, not by the node).
_FLEET_KEYS = ("sources",)
# vLLM passes these itself (factory.py): not user settings.
_FRAMEWORK_KEYS = ("locality", "backpressure_detector")
# The stock tier's environment variables, and the kvpeer settings they set.
_ENV_SETTINGS = {
    "VLLM_P2P_MAX_PEERS": "max_peers",
    "VLLM_P2P_HANDSHAKE_TIMEOUT_S": "handshake_timeout_s",
    "VLLM_P2P_IDLE_TIMEOUT_S": "idle_timeout_s",
    "VLLM_P2P_TRANSFER_STALL_TIMEOUT_S": "transfer_stall_timeout_s",
}
# A kvpeer setting, back to the key the user wrote (for error messages).
_USER_KEY = {
    "listen_host": "host",
    "listen_port": "port",
    "allowlist": "allow",
    "unbound_store_timeout_s": "unbound_store_timeout_s",
}

# Native load ids of the second and later parts of a load split over several sources (vLLM's
# own job ids, used for the first part, stay far below).
_PART_IDS = 1 << 61
_BUSY_METRIC = "vllm:kv_offload_kvpeer_busy_us"

# Metric names (vLLM's Prometheus registry, through build_metric_definitions/get_stats).
_METRICS = {
    "vllm:kv_offload_kvpeer_lookup_keys": "Keys this engine asked peers about.",
    "vllm:kv_offload_kvpeer_lookup_hits": "Keys peers said they hold.",
    "vllm:kv_offload_kvpeer_loaded_blocks": "Blocks loaded from peers.",
    "vllm:kv_offload_kvpeer_failed_loads": "Loads from peers that failed.",
    "vllm:kv_offload_kvpeer_served_lookups": "Keys peers asked this engine about.",
    "vllm:kv_offload_kvpeer_served_blocks": "Blocks written to peers.",
    "vllm:kv_offload_kvpeer_unknown_roots": "Requests that asked every source in 'sources' "
    "because their prefix's root chunk was not known.",
    _BUSY_METRIC: "Microseconds vLLM's threads spent inside this tier's methods "
    "(drain_jobs' waits excluded).",
}
# The methods vLLM calls whose time _BUSY_METRIC counts (drain_jobs waits by contract).
_TIMED_CALLS = (
    "on_new_request",
    "lookup",
    "on_schedule_end",
    "submit_load",
    "submit_store",
    "on_request_finished",
    "get_finished_jobs",
    "has_pending_work",
    "serve_external_requests",
)


class _Leg:
    """One source a consumer request asks: a native request at one peer."""

    __slots__ = ("native", "peer", "consumer", "unsent", "batches")

    def __init__(self, native: Any, peer: str, consumer: _Consumer) -> None:
        self.native = native
        self.peer = peer
        self.consumer = consumer
        # Keys to ask at the step's end.
        self.unsent: list[bytes] = []
        # Lookups sent, oldest first: their keys, in the order asked.
        self.batches: deque[list[bytes]] = deque()


class _Consumer:
    """This engine fetches the request's blocks: from the router's hint (``remote_kv_source``,
    or a PD ``remote_prefiller``), then from the tier's ``sources`` for the keys the hint does
    not hold. Each key asks one stage of sources at a time: the hint, then the pool that owns
    the prefix's root chunk (every pool when the root is not known); a key all of a stage's
    sources miss goes to the next stage, and misses after the last."""

    __slots__ = ("probe", "hint", "pools", "roots", "holders", "pending", "failed")

    def __init__(self, probe: bool) -> None:
        self.probe = probe
        self.hint: _Leg | None = None
        # Legs to the tier's sources, by index in ``sources``, opened when first asked.
        self.pools: dict[int, _Leg] = {}
        # Group index -> the key of the prefix's root chunk (None: not known).
        self.roots: dict[int, bytes | None] = {}
        # key -> the leg that holds it, or None when no source does (answered keys only).
        self.holders: dict[bytes, _Leg | None] = {}
        # key -> the stage asking it (keys not answered yet)
        self.pending: dict[bytes, _Asking] = {}
        # A load or the session failed: lookups answer MISS (local prefill).
        self.failed = False

    def legs(self) -> list[_Leg]:
        legs = list(self.pools.values())
        return legs if self.hint is None else [self.hint, *legs]


class _Asking:
    """A key being asked: the stage of sources asking it, and how many of them have not
    answered."""

    __slots__ = ("stage", "unanswered")

    def __init__(self, stage: int, unanswered: int) -> None:
        self.stage = stage
        self.unanswered = unanswered


class _PinnedJob:
    """A store job vLLM made for a peer's hits: its pins not given back yet, and whether every
    block reached the peer so far."""

    __slots__ = ("blocks", "unreleased", "all_sent")

    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.unreleased = blocks
        self.all_sent = True


class _Load:
    """A vLLM load job, split into one native load per source that holds its keys."""

    __slots__ = ("job_id", "consumer", "parts", "ok", "nbytes", "submitted", "unfenced", "release")

    def __init__(self, job_id: int, consumer: _Consumer, parts: int, nbytes: int, t: float):
        self.job_id = job_id
        self.consumer = consumer
        self.parts = parts
        self.ok = True
        self.nbytes = nbytes
        self.submitted = t
        # Parts that failed while their producer may still write their blocks (vLLM 0.34):
        # the job's `deferred_release` is set once none is left.
        self.unfenced = 0
        self.release: threading.Event | None = None


class _Producer:
    """This engine produces the request's blocks for a peer (PD ``remote_decoder``)."""

    __slots__ = ("native",)

    def __init__(self, native: Any) -> None:
        self.native = native


class KvpeerTier(SecondaryTierManager):
    """vLLM's P2P secondary tier on kvpeer's Rust node (see the module documentation).

    Configuration (the entry's keys; every other key is refused at start-up):

    * the stock ``p2p`` tier's: ``host`` (default ``$VLLM_P2P_SIDE_CHANNEL_HOST`` or
      ``localhost``), ``port`` (default ``$VLLM_P2P_SIDE_CHANNEL_PORT`` or 5710, plus the
      data-parallel rank), ``backends`` (NIXL backends; kvpeer's nixl plane runs UCX only),
      ``num_threads`` (accepted; kvpeer's nixl plane makes progress on the engine's calls),
      ``unbound_store_timeout_s``; and ``VLLM_P2P_MAX_PEERS``,
      ``VLLM_P2P_HANDSHAKE_TIMEOUT_S``, ``VLLM_P2P_IDLE_TIMEOUT_S``,
      ``VLLM_P2P_TRANSFER_STALL_TIMEOUT_S``;
    * the fleet's: ``sources``, pool nodes' ``host:port`` as the pools' ``--shard`` list
      names them (docs/scaling.md): a request without a router's ``remote_kv_source`` asks
      the pool that owns its prefix (rendezvous hashing of its root chunk; every source when
      the root is not known), one with it asks the hint first and the owner pool for the rest,
      and each chunk loads from whichever source holds it;
    * kvpeer's: ``plane`` (``auto``: nixl when NIXL is installed, for stock peers, else
      ``both`` when vLLM's memory is its /dev/shm file, else tcp; or ``nixl``, ``tcp``,
      ``shm``, ``both``), ``allow`` (CIDR / host / host:port rules), ``tenant`` (this
      engine's tenant: it then talks only to peers of it and to shared nodes) with
      ``tenants`` (``NAME=RULE`` strings in the allowlist's syntax, ``*`` naming shared pool
      nodes; docs/security.md, "Tenants"), ``auth_secret_file``,
      ``max_peers``, ``tcp_max_rate`` (bytes/s per peer), ``tcp_port`` (the tcp plane's data
      port, each DP rank at its offset; 0 or unset: a free one), ``metrics`` (bool),
      ``tls`` (``off``, ``preferred`` or ``required``) with ``tls_cert``, ``tls_key`` and
      ``tls_ca`` (PEM files: TLS 1.3 with mutual authentication on the control channel and
      the tcp plane, docs/security.md), ``tcp_block_digests`` (bool: a CRC-32C per block on
      the tcp plane, checked as it lands), and the
      timeouts, as strict as vLLM 0.34's by default: ``lookup_timeout_s`` (8 s without
      progress), ``load_timeout_s`` (10 s, a load of a request that looked up),
      ``pd_load_timeout_s`` (30 s, a PD load), ``abort_ack_timeout_s`` (5 s, then the session
      ends: a failed load's slots go back to vLLM only once the peer's writes are fenced),
      ``transfer_stall_timeout_s`` (20 s: a NIXL write to a peer still in flight then faults the
      peer), ``retained_hold_cap_s`` (30 s: a write still running when its session ended keeps
      its source blocks pinned until it stops, at most this long), ``handshake_timeout_s``,
      ``idle_timeout_s``; host liveness:
      ``host_probe_timeout_ms`` (1000: when a connection to a host is lost, the others to it
      must answer a PING within it or end too, failing their loads at once; 0 = off) and
      ``host_down_hold_ms`` (5000: a host nothing answers on is not dialed meanwhile). With
      data parallelism the engine's ranks on this host tell each other of a lost host.
    """

    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.P2P
    tolerates_off_thread_polling: ClassVar[bool] = True

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str = "KvpeerTier",
        backpressure_detector: Any = None,
        **config: Any,
    ) -> None:
        if backpressure_detector is not None:
            raise ValueError(
                "KvpeerTier: 'backpressure' is not supported (as for the stock p2p tier: "
                "a dropped store leaves a PD decoder waiting instead of failing fast)"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type)
        self.locality = config.pop("locality", None)
        settings, self._metrics = _settings(offloading_spec, primary_kv_view, config)
        # The node's I/O on a thread of its own (default): vLLM's scheduler thread then only
        # hands work over and takes results, with no system call but a wake of that thread.
        io_thread = config.get("io_thread", True)
        if not isinstance(io_thread, bool):
            raise ValueError(f"KvpeerTier: 'io_thread' must be true or false, not {io_thread!r}")
        self._fingerprint = settings.get("config_fingerprint", "")
        # The hash seed the node was last given.
        self._seed = settings.get("hash_seed")
        self._tier = _start(primary_kv_view, settings, offloading_spec, io_thread)
        self._io_thread = io_thread
        if _DEFERRED_RELEASE:
            # A failed load is reported at once; its chunks wait for its fence (the event).
            self._tier.report_held_loads(True)
        self._apply_engine_seed()
        self._block_len = self._tier.block_len
        # Whether vLLM services this tier off the engine's thread (0.33's tier-poll thread).
        self._polled = _polled_off_thread(offloading_spec)
        # The fleet's pool nodes, as their --shard list names them (see _sources).
        self._sources = _sources(config.get("sources"))
        # Group index -> end-token position of a request's first chunk (its root).
        self._root_positions = _root_positions(offloading_spec)
        self._next_leg = 0
        self._next_part = _PART_IDS
        # Legs with lookups sent and not answered, by their kv_request_id.
        self._waiting: dict[str, _Leg] = {}
        # Legs with keys to ask at the step's end.
        self._to_flush: list[_Leg] = []
        # Native load id -> the vLLM load it is a part of, for loads running.
        self._loads: dict[int, _Load] = {}
        # Native load id -> the vLLM load, for parts that failed while their producer may still
        # write their blocks (vLLM 0.34's deferred release): until their fence.
        self._fencing: dict[int, _Load] = {}
        # PD stores running: job -> submit time.
        self._stores: dict[int, float] = {}
        # Store jobs vLLM made for peers' hits, until every pin is back.
        self._pins: dict[int, _PinnedJob] = {}
        self._finished: list[JobResult] = []
        self._counts = dict.fromkeys(_METRICS, 0)
        # Nanoseconds spent in _TIMED_CALLS, not yet reported as _BUSY_METRIC.
        self._busy_ns = 0
        self._closed = False
        logger.info(
            "kvpeer tier %s: plane %s, %d blocks of %d bytes",
            self._tier.id,
            self._tier.plane,
            self._tier.num_blocks,
            self._block_len,
        )

    # ------------------------------------------------------------------ identity

    @property
    def peer_id(self) -> str:
        """This engine's P2P identity, ``host:port`` (what peers put in ``remote_host``/
        ``remote_port``)."""
        return self._tier.id

    @property
    def plane(self) -> str:
        """The data plane in use (``nixl`` or ``tcp``)."""
        return self._tier.plane

    # ------------------------------------------------------------------ consumer side

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        params = req_context.kv_transfer_params or {}
        source, probe = params.get("remote_prefiller"), False
        if source is None:
            source, probe = params.get("remote_kv_source"), True
        consumer = _Consumer(probe)
        if source:
            peer = _peer_of(source)
            kv_request_id = source.get("kv_request_id")
            if peer is not None and kv_request_id:
                self._apply_engine_seed()
                native = self._tier.open(str(kv_request_id), source=peer, probe=probe)
                consumer.hint = _Leg(native, peer, consumer)
        if consumer.hint is not None or (probe and self._sources):
            req_context.set_state(consumer)
        dest = params.get("remote_decoder")
        if dest is not None:
            kv_request_id = dest.get("kv_request_id") if isinstance(dest, dict) else None
            native = (
                self._tier.open(str(kv_request_id), decoder=True)
                if kv_request_id
                else None
            )
            req_context.set_state(_Producer(native))
            if native is not None:
                return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def lookup(self, key: bytes, req_context: ReqContext) -> LookupResult:
        consumer = req_context.get_state(_Consumer)
        if consumer is None or consumer.failed:
            return LookupResult.MISS
        if not consumer.probe:
            # PD decoder: the prefiller has every block of the request.
            return LookupResult.HIT
        if key in consumer.holders:
            return LookupResult.HIT if consumer.holders[key] is not None else LookupResult.MISS
        if key not in consumer.pending:
            if self._sources:
                self._note_root(consumer, key, req_context)
            self._ask(consumer, key, 0 if consumer.hint is not None else 1)
            if key in consumer.holders:  # no source to ask
                return LookupResult.MISS
        return LookupResult.RETRY

    def _ask(self, consumer: _Consumer, key: bytes, stage: int) -> None:
        """Asks `key` of the sources of `stage` (0: the hint; 1: the pools), or answers it
        missed when no stage from there has a source."""
        if stage == 0 and consumer.hint is None:
            stage = 1
        if stage == 0:
            legs = [consumer.hint]
        elif stage == 1:
            legs = self._pool_legs(consumer, key)
        else:
            legs = []
        if not legs:
            consumer.pending.pop(key, None)
            consumer.holders[key] = None
            return
        consumer.pending[key] = _Asking(stage, len(legs))
        for leg in legs:
            if not leg.unsent:
                self._to_flush.append(leg)
            leg.unsent.append(key)

    def _pool_legs(self, consumer: _Consumer, key: bytes) -> list[_Leg]:
        """The legs asked about `key` after the hint: to the pool that owns its prefix's root,
        or to every source when the root is not known; never the hint's peer again."""
        if not self._sources:
            return []
        root = consumer.roots.get(_group_of(key))
        if root is not None:
            chosen = [_native.shard_owner(self._sources, root)]
        else:
            chosen = range(len(self._sources))
        hint_peer = consumer.hint.peer if consumer.hint is not None else None
        legs = []
        for index in chosen:
            if index is None or self._sources[index] == hint_peer:
                continue
            leg = consumer.pools.get(index)
            if leg is None:
                self._next_leg += 1
                kv_request_id = f"kvpeer:{self._tier.id}:{self._next_leg}"
                self._apply_engine_seed()
                native = self._tier.open(kv_request_id, source=self._sources[index])
                leg = consumer.pools[index] = _Leg(native, self._sources[index], consumer)
            legs.append(leg)
        return legs

    def _note_root(self, consumer: _Consumer, key: bytes, req_context: ReqContext) -> None:
        """Learns the root chunk of the request's prefix (per KV-cache group) when it asks its
        first key of that group: vLLM records every key's end-token position in the ReqContext
        before any lookup (the scheduler's ``update_offload_keys``), and the root's is one
        chunk's tokens. See _root_of."""
        group = _group_of(key)
        if group in consumer.roots:
            return
        root = _root_of(req_context, key, group, self._root_positions.get(group))
        consumer.roots[group] = root
        if root is None and len(self._sources) > 1:
            self._counts["vllm:kv_offload_kvpeer_unknown_roots"] += 1

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        # One lookup message per source per request per step, as the stock tier batches them.
        if not self._to_flush:
            return
        tier = self._tier
        for leg in self._to_flush:
            keys, leg.unsent = leg.unsent, []
            leg.batches.append(keys)
            self._waiting[leg.native.kv_request_id] = leg
            tier.lookup(leg.native, keys)
            self._counts["vllm:kv_offload_kvpeer_lookup_keys"] += len(keys)
        self._to_flush = []

    def submit_load(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        consumer = job_metadata.req_context.get_state(_Consumer)
        keys = list(job_metadata.keys)
        if consumer is None or consumer.failed:
            self._finished.append(JobResult(job_id=job_id, success=False))
            return
        if not keys:
            self._finished.append(JobResult(job_id=job_id, success=True))
            return
        blocks = job_metadata.chunk_ids.tolist()
        # Each key from the source that said it holds it (a PD prefiller holds them all).
        parts: dict[int, tuple[_Leg, list[bytes], list[int]]] = {}
        for key, block in zip(keys, blocks):
            leg = consumer.hint if not consumer.probe else consumer.holders.get(key)
            if leg is None:
                logger.warning("kvpeer: load %d of a key no source holds", job_id)
                self._finished.append(JobResult(job_id=job_id, success=False))
                return
            part = parts.setdefault(id(leg), (leg, [], []))
            part[1].append(key)
            part[2].append(block)
        load = _Load(
            job_id, consumer, len(parts), len(keys) * self._block_len, job_metadata.submit_time
        )
        for n, (leg, part_keys, part_blocks) in enumerate(parts.values()):
            native_id = job_id
            if n:
                native_id = self._next_part
                self._next_part += 1
            try:
                self._tier.load(native_id, leg.native, part_keys, part_blocks)
            except (ValueError, _native.KvpeerError) as e:
                logger.warning("kvpeer: load %d refused: %s", job_id, e)
                consumer.failed = True
                load.parts -= len(parts) - n
                load.ok = False
                if load.parts == 0:
                    self._finished.append(JobResult(job_id=job_id, success=False))
                return
            self._loads[native_id] = load

    def submit_store(self, job_metadata: TransferJob) -> None:
        job_id = job_metadata.job_id
        producer = job_metadata.req_context.get_state(_Producer)
        if producer is None:
            # Not a remote-decode request: nothing to hand to a peer.
            self._finished.append(JobResult(job_id=job_id, success=True))
            return
        if producer.native is None:
            logger.warning("kvpeer: store %d for a remote_decoder without an id", job_id)
            self._finished.append(JobResult(job_id=job_id, success=False))
            return
        try:
            self._tier.store(
                job_id,
                producer.native,
                list(job_metadata.keys),
                job_metadata.chunk_ids.tolist(),
            )
        except (ValueError, _native.KvpeerError) as e:
            logger.warning("kvpeer: store %d refused: %s", job_id, e)
            self._finished.append(JobResult(job_id=job_id, success=False))
            return
        self._stores[job_id] = job_metadata.submit_time

    def on_request_finished(self, req_context: ReqContext) -> None:
        consumer = req_context.get_state(_Consumer)
        if consumer is not None:
            legs = consumer.legs()
            if any(leg.unsent for leg in legs):
                for leg in legs:
                    leg.unsent = []
                self._to_flush = [leg for leg in self._to_flush if leg.consumer is not consumer]
            for leg in legs:
                self._tier.finish(leg.native)
            self._collect()
        producer = req_context.get_state(_Producer)
        if producer is not None and producer.native is not None:
            # As the stock tier: a peer that already fetched this request is done with it;
            # stores no peer asked for yet stay parked until the unbound-store timeout (or a
            # drain before a reset fails them).
            self._tier.finish(producer.native)

    # ------------------------------------------------------------------ polling

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._collect()
        finished, self._finished = self._finished, []
        return finished

    def has_pending_work(self) -> bool:
        # Keep the engine stepping while anything of ours moves or a peer's question waits
        # for vLLM's answer. Where vLLM services tiers from its tier-poll thread
        # (tolerates_off_thread_polling; every tier_poll_interval_s, 1 ms by default) an idle
        # engine hears new peers through it and need not spin. Where it does not (vLLM 0.32 has
        # no such thread; 0.33 with tier_poll_interval_s <= 0), an idle engine steps only while
        # a tier says it has work: then always, as the stock tier does, or an idle producer
        # would never answer a peer.
        return not self._polled or self._busy()

    def _busy(self) -> bool:
        """Whether anything of this tier's moves: loads, stores, pins, lookups waiting or to
        send, results vLLM has not taken yet (vLLM 0.34's own tier counts them), or a peer's
        question waiting for vLLM's answer."""
        if (
            self._loads
            or self._stores
            or self._pins
            or self._waiting
            or self._to_flush
            or self._finished
        ):
            return True
        return self._tier.outstanding().questions > 0

    def drain_jobs(self) -> None:
        """Waits until no load runs, no write to a peer reads the primary tier, and every
        failed load's blocks are fenced (vLLM 0.34: every `deferred_release` set, as its contract
        asks; not bounded: a stalled NIXL producer's writes stay unfenced until it confirms or its
        agent is replaced, and chunks given back before could take its bytes). Never cancels a
        write. Loads are aborted up front (as vLLM 0.34's own tier does): a producer that never
        writes holds the reset for its `abort_ack`, or the abort-ack timeout (5 s), not for the
        load timeout; each load ends failed. Every store no write reads fails at once (as vLLM 0.34's own tier does): those
        parked for a decoder that has not fetched them, and those a session holds for a round
        still waiting for keys; vLLM asserts after the drain that no job is left, and the reset
        frees the chunks they name; a late fetch of their request is refused."""
        start = time.monotonic()
        warned = False
        # Every store job's end is collected before returning: vLLM asserts right after the
        # drain that no job is left. Only stores that writes in flight read are waited for.
        self._tier.fail_unwritten_stores()
        self._tier.abort_loads()
        # Lookup pins are vLLM store jobs too: those held now end failed (or with the write
        # that reads them); pins a peer's lookup takes during the drain are not waited for.
        pinned = set(self._pins)
        while (
            self._loads
            or self._fencing
            or self._stores
            or pinned.intersection(self._pins)
            or self._tier.stats()["inflight_transfers"]
        ):
            self._collect(wait_s=_DRAIN_WAIT_S)
            if not warned and time.monotonic() - start > _DRAIN_WARN_S:
                logger.warning(
                    "kvpeer: drain_jobs still waits for %d loads and writes to peers",
                    len(self._loads),
                )
                warned = True

    def pending_releases(self) -> int:
        """Failed loads reported to vLLM whose chunks still wait for their fence (vLLM 0.34's
        `deferred_release` not set yet: their producer may still write them)."""
        return len({load.job_id for load in self._fencing.values() if load.release is not None})

    def _collect(self, wait_s: float = 0.0) -> None:
        """Drives the node once and turns what ended into results."""
        polled = self._tier.poll(wait_s)
        for looked_up in polled.lookups:
            kv_request_id, hits = looked_up.kv_request_id, looked_up.hits
            leg = self._waiting.get(kv_request_id)
            if leg is None or not leg.batches:
                continue
            keys = leg.batches.popleft()
            if not leg.batches:
                del self._waiting[kv_request_id]
            self._answered(leg, keys, hits)
            self._counts["vllm:kv_offload_kvpeer_lookup_hits"] += sum(hits)
        self._ended(polled.loads, polled.stores)
        if self._pins:
            for release in self._tier.take_releases():
                self._release(release.pin, release.sent)

    def _ended(self, loads: list, stores: list) -> None:
        """Loads and stores of the node that ended (`_native.JobEnd` each)."""
        if loads:
            now = time.monotonic()
            for load in loads:
                if load.held:
                    self._part_held(load.job, now)
                elif load.job in self._fencing:
                    self._part_fenced(load.job)
                else:
                    self._part_ended(load.job, load.success, now)
        for store in stores:
            if self._stores.pop(store.job, None) is not None:
                self._finished.append(JobResult(job_id=store.job, success=store.success))

    def _answered(self, leg: _Leg, keys: list[bytes], hits: list[bool]) -> None:
        """A source's answers: a hit makes it the key's holder (the first hit, when several
        sources were asked); a key every source of its stage missed goes to the next."""
        consumer = leg.consumer
        for key, hit in zip(keys, hits):
            pending = consumer.pending.get(key)
            if pending is None:
                continue
            if hit:
                del consumer.pending[key]
                consumer.holders[key] = leg
                continue
            pending.unanswered -= 1
            if pending.unanswered == 0:
                self._ask(consumer, key, pending.stage + 1)

    def _part_held(self, native_id: int, now: float) -> None:
        """A part failed while its producer may still write its blocks: it ends (failed) now,
        and its job's chunks wait for its fence (`_part_fenced`)."""
        load = self._loads.get(native_id)
        if load is None:
            return
        load.unfenced += 1
        self._fencing[native_id] = load
        self._part_ended(native_id, False, now)

    def _part_fenced(self, native_id: int) -> None:
        """A held part's blocks take no more writes: its job's chunks may go back to vLLM once
        every held part of it is fenced."""
        load = self._fencing.pop(native_id)
        load.unfenced -= 1
        if load.unfenced == 0 and load.release is not None:
            load.release.set()

    def _part_ended(self, native_id: int, ok: bool, now: float) -> None:
        load = self._loads.pop(native_id, None)
        if load is None:
            return
        load.parts -= 1
        load.ok = load.ok and ok
        if load.parts:
            return
        if load.ok:
            self._counts["vllm:kv_offload_kvpeer_loaded_blocks"] += load.nbytes // self._block_len
        else:
            load.consumer.failed = True
            self._counts["vllm:kv_offload_kvpeer_failed_loads"] += 1
        deferred = {}
        if load.unfenced:
            # Reported failed now; vLLM frees its chunks once the event is set.
            load.release = threading.Event()
            deferred["deferred_release"] = load.release
        self._finished.append(
            JobResult(
                job_id=load.job_id,
                success=load.ok,
                transfer_time=now - load.submitted,
                transfer_bytes=load.nbytes if load.ok else 0,
                **deferred,
            )
        )

    def _release(self, job_id: int, sent: bool) -> None:
        job = self._pins.get(job_id)
        if job is None:
            return
        job.unreleased -= 1
        job.all_sent = job.all_sent and sent
        if job.unreleased == 0:
            del self._pins[job_id]
            self._finished.append(JobResult(job_id=job_id, success=job.all_sent))
            if job.all_sent:
                self._counts["vllm:kv_offload_kvpeer_served_blocks"] += job.blocks

    # ------------------------------------------------------------------ producer side

    def serve_external_requests(self, parent: ParentManager) -> None:
        queries = self._tier.take_queries()
        if not queries:
            return
        # One vLLM request per peer request, as the stock tier makes per lookup: the
        # required order (on_new_request, lookups, create_store_job, on_request_finished).
        groups: dict[tuple[str, str], list[_native.Query]] = {}
        for q in queries:
            groups.setdefault((q.peer, q.kv_request_id), []).append(q)
        answers: list[_native.Answer] = []
        # Per answer, the store job whose pin a hit hands over (None: not a hit).
        pinned_by: list[int | None] = []
        hit = LookupResult.HIT
        miss = LookupResult.MISS
        for (peer, kv_request_id), group in groups.items():
            ctx = ReqContext(req_id=f"kvpeer:{peer}:{kv_request_id}:q{group[0].id}")
            parent.on_new_request(ctx)
            try:
                hits = []
                for q in group:
                    result = parent.lookup(q.key, ctx)
                    if result is hit:
                        hits.append(q)
                    elif result is miss:
                        answers.append(_native.Answer.miss(q.id))
                        pinned_by.append(None)
                    else:  # HIT_PENDING, RETRY: the question comes back
                        answers.append(_native.Answer.pending(q.id))
                        pinned_by.append(None)
                if hits:
                    job = parent.create_store_job([q.key for q in hits], ctx)
                    blocks = job.chunk_ids.tolist()
                    self._pins[job.job_id] = _PinnedJob(len(hits))
                    for q, block in zip(hits, blocks):
                        answers.append(_native.Answer.hit(q.id, block, job.job_id))
                        pinned_by.append(job.job_id)
            finally:
                parent.on_request_finished(ctx)
        self._counts["vllm:kv_offload_kvpeer_served_lookups"] += len(queries)
        taken = self._tier.answer(answers)
        for job_id, ok in zip(pinned_by, taken):
            if job_id is not None and not ok:
                # Nobody asks any more: the pin goes back unused.
                self._release(job_id, False)
        if not self._io_thread:
            # The answers leave now, in this call, as the stock tier's do (not at the next
            # poll); the node's I/O thread sends them as soon as the answers wake it.
            self._collect()

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ended = self._tier.shutdown(_SHUTDOWN_DRAIN_S)
        self._ended(ended.loads, ended.stores)
        # The node is gone, and its memory registration, connections and fence words with it:
        # no write of a peer can land any more.
        for native_id in list(self._fencing):
            self._part_fenced(native_id)
        for release in self._tier.take_releases():
            self._release(release.pin, release.sent)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        if not extra_config.get("metrics", True):
            return {}
        from vllm.v1.kv_offload.base import OffloadingCounterMetadata

        return {
            name: OffloadingCounterMetadata(documentation=doc)
            for name, doc in _METRICS.items()
        }

    def get_stats(self) -> Any:
        if not self._metrics:
            return None
        # Reported by whole milliseconds, so that an idle engine's polls (vLLM 0.32 steps
        # without pause) do not make a stats object every step.
        if self._busy_ns >= 1_000_000:
            busy_us = self._busy_ns // 1000
            self._busy_ns -= busy_us * 1000
            self._counts[_BUSY_METRIC] += busy_us
        if not any(self._counts.values()):
            return None
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        stats = OffloadingConnectorStats()
        for name, value in self._counts.items():
            if value:
                stats.increase_counter(name, value)
        self._counts = dict.fromkeys(_METRICS, 0)
        return stats

    def node_stats(self) -> dict[str, int]:
        """The Rust node's running totals and open state (sessions, transfers, loads)."""
        return self._tier.stats()

    # ------------------------------------------------------------------ helpers

    def _apply_engine_seed(self) -> None:
        """Follows vLLM's hash seed: vLLM draws it after it builds the tiers, so it is read
        again (vLLM's public getter, a function call) before each session may open, and the
        node gets it when it changed."""
        seed = _engine_seed()
        if seed is not None and seed != self._seed:
            self._tier.set_hash_seed(seed)
            self._seed = seed


def _timed(method: Any) -> Any:
    """`method`, adding the time it takes to its tier's busy time (_BUSY_METRIC)."""

    @functools.wraps(method)
    def timed(self: KvpeerTier, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter_ns()
        try:
            return method(self, *args, **kwargs)
        finally:
            self._busy_ns += time.perf_counter_ns() - started

    return timed


for _name in _TIMED_CALLS:
    setattr(KvpeerTier, _name, _timed(getattr(KvpeerTier, _name)))
del _name


def _peer_of(role: Any) -> str | None:
    if not isinstance(role, dict):
        return None
    host, port = role.get("remote_host"), role.get("remote_port")
    if host and port:
        return f"{host}:{port}"
    return None


def _group_of(key: bytes) -> int:
    """The KV-cache group index of an offload key (its last 4 bytes, big-endian)."""
    return int.from_bytes(key[-4:], "big")


def _sources(value: Any) -> list[str]:
    """The ``sources`` entry: pool nodes' ``host:port``, as in the pools' ``--shard`` list (the
    owner of a prefix is a rendezvous hash over their canonical forms: an address in any
    spelling is one pool)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"KvpeerTier: 'sources' must be a list of host:port, not {value!r}")
    sources = []
    for entry in value:
        host, sep, port = entry.rpartition(":") if isinstance(entry, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"KvpeerTier: 'sources' entry {entry!r} is not host:port")
        if entry in sources:
            raise ValueError(f"KvpeerTier: 'sources' lists {entry!r} twice")
        sources.append(entry)
    return sources


def _root_of(req_context: Any, key: bytes, group: int, position: int | None) -> bytes | None:
    """The key of the root chunk of the request's prefix in `group`, given `key`, the first
    key of that group it asks, and `position`, the end-token position of a first chunk.

    * `key` itself, when vLLM's public ``get_offload_key_position`` says it is at `position`
      (the common case: nothing of the prefix is cached here);
    * else, where the prefix's first chunks are cached here (a later turn of a conversation),
      the key at `position` among the positions vLLM recorded for the request. vLLM 0.33 keeps
      them in ``ReqContext._offload_key_positions`` and offers no public way to list them:
      this is the one private name the tier reads, read only, and guarded (a vLLM without it
      leaves the root unknown, and the request asks every source);
    * else None.
    """
    if position is None:
        return None
    get_position = getattr(req_context, "get_offload_key_position", None)
    if get_position is not None and get_position(key) == position:
        return key
    positions = getattr(req_context, "_offload_key_positions", None)
    if isinstance(positions, dict):
        for candidate, end in positions.items():
            if end == position and _group_of(bytes(candidate)) == group:
                return bytes(candidate)
    return None


def _root_positions(offloading_spec: Any) -> dict[int, int]:
    """Per KV-cache group, the end-token position vLLM gives a request's first chunk: one
    chunk's tokens (``tokens_per_block`` x ``blocks_per_chunk``). Empty where the spec does
    not say (then no root is learned from positions)."""
    try:
        per_block = tuple(offloading_spec.tokens_per_block)
        per_chunk = int(offloading_spec.blocks_per_chunk)
    except (AttributeError, TypeError, ValueError):
        return {}
    return {group: int(tokens) * per_chunk for group, tokens in enumerate(per_block)}


def _engine_seed() -> str | None:
    """vLLM's NONE_HASH seed (its default until vLLM draws it); None without vLLM."""
    try:
        from vllm.v1.core import kv_cache_utils
    except ImportError:
        return None
    return kv_cache_utils.get_none_hash_seed()


def _fingerprint(offloading_spec: Any) -> str:
    """vLLM's config fingerprint for this engine, as the stock tier computes it."""
    try:
        from vllm.v1.kv_offload.file_mapper import FileMapper

        fields = FileMapper.from_offloading_spec(
            root_dir="",
            offloading_spec=offloading_spec,
            blocks_per_file=offloading_spec.blocks_per_chunk,
            parallel_agnostic=True,
        ).get_run_config()
    except Exception as e:  # an engine without the run config: no fingerprint
        logger.debug("kvpeer: no config fingerprint: %s", e)
        return ""
    if not fields:
        return ""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _text(key: str, value: Any) -> str:
    if key == "tls" and value is False:
        # YAML's `tls: off` arrives as False.
        return "off"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (int, float, str)):
        return str(value)
    raise ValueError(f"KvpeerTier: {key!r} must be a number or a string, not {value!r}")


def _settings(
    offloading_spec: Any, primary_kv_view: memoryview, config: dict[str, Any]
) -> tuple[dict[str, str], bool]:
    """kvpeer's settings from the tier's config entry, the environment and the engine."""
    unknown = [
        k for k in config if k not in _STOCK_KEYS + _KVPEER_KEYS + _FLEET_KEYS + _FRAMEWORK_KEYS
    ]
    if unknown:
        raise ValueError(
            f"KvpeerTier: unknown config key {unknown[0]!r} (known: "
            f"{', '.join(_STOCK_KEYS + _KVPEER_KEYS + _FLEET_KEYS)})"
        )
    settings: dict[str, str] = {}
    for env, key in _ENV_SETTINGS.items():
        if os.environ.get(env):
            settings[key] = os.environ[env]
    host = config.get("host") or os.environ.get("VLLM_P2P_SIDE_CHANNEL_HOST") or _DEFAULT_HOST
    port = config.get("port")
    if port is None:
        port = os.environ.get("VLLM_P2P_SIDE_CHANNEL_PORT", _DEFAULT_PORT)
    try:
        port = int(port)
    except (TypeError, ValueError):
        raise ValueError(f"KvpeerTier: 'port' must be a port number, not {port!r}") from None
    dp_index = _dp_index(offloading_spec)
    settings["listen_host"] = _text("host", host)
    settings["listen_port"] = str(port + dp_index if port else 0)
    dp_size = _dp_size(offloading_spec)
    if port and dp_size > 1:
        # The engine's ranks on this host tell each other of lost hosts, so a dead host fails
        # every rank's loads at once, not one rank's timeout after another (docs/behaviour.md).
        group = f"{host}:{port}"
        plain = all(c.isascii() and c.isprintable() and c not in " /" for c in group)
        if len(group) > 64 or not plain:
            group = hashlib.sha256(group.encode()).hexdigest()[:40]
        settings["liveness_group"] = group
        settings["liveness_rank"] = f"{dp_index}/{dp_size}"
    backends = config.get("backends")
    if backends is not None and (
        not isinstance(backends, (list, tuple)) or [str(b).upper() for b in backends] != ["UCX"]
    ):
        raise ValueError(
            f"KvpeerTier: 'backends' {backends!r} is not supported: kvpeer's nixl plane "
            "runs NIXL's UCX backend (use [\"UCX\"] or leave it out)"
        )
    if "num_threads" in config:
        try:
            if int(config["num_threads"]) < 1:
                raise ValueError
        except (TypeError, ValueError):
            raise ValueError(
                f"KvpeerTier: 'num_threads' must be a positive integer, "
                f"not {config['num_threads']!r}"
            ) from None
    for key in (
        "unbound_store_timeout_s",
        "max_peers",
        "tcp_max_rate",
        "tcp_block_digests",
        "tls",
        "tls_cert",
        "tls_key",
        "tls_ca",
        "lookup_timeout_s",
        "load_timeout_s",
        "pd_load_timeout_s",
        "abort_ack_timeout_s",
        "transfer_stall_timeout_s",
        "retained_hold_cap_s",
        "handshake_timeout_s",
        "idle_timeout_s",
        "host_probe_timeout_ms",
        "host_down_hold_ms",
    ) + _FAIR_SHARE_KEYS:
        if key in config:
            settings[key] = _text(key, config[key])
    if "auth_secret_file" in config:
        settings["auth_secret_file"] = _text("auth_secret_file", config["auth_secret_file"])
    if "tcp_port" in config:
        # One data port per rank, as the control port: the rank's offset from the one given.
        tcp_port = config["tcp_port"]
        if isinstance(tcp_port, bool) or not isinstance(tcp_port, (int, str)):
            raise ValueError(f"KvpeerTier: 'tcp_port' must be a port number, not {tcp_port!r}")
        try:
            tcp_port = int(tcp_port)
        except ValueError:
            raise ValueError(
                f"KvpeerTier: 'tcp_port' must be a port number, not {config['tcp_port']!r}"
            ) from None
        # The ranks' control ports are port..port+dp_size, their data ports tcp_port..: apart.
        if tcp_port and port and tcp_port < port + dp_size and port < tcp_port + dp_size:
            raise ValueError(
                f"KvpeerTier: 'tcp_port' {tcp_port} overlaps the control ports {port}.."
                f"{port + dp_size - 1} of this engine's {dp_size} data-parallel ranks: put the "
                f"data ports apart (e.g. {port + 100})"
            )
        settings["tcp_port"] = str(tcp_port + dp_index if tcp_port else 0)
    allow = config.get("allow")
    if allow is not None:
        if isinstance(allow, str):
            allow = [allow]
        if not isinstance(allow, (list, tuple)) or not all(isinstance(r, str) for r in allow):
            raise ValueError(f"KvpeerTier: 'allow' must be a list of rules, not {allow!r}")
        if allow:
            settings["allowlist"] = ",".join(allow)
    if "tenant" in config:
        settings["tenant"] = _text("tenant", config["tenant"])
    tenants = config.get("tenants")
    if tenants is not None:
        if isinstance(tenants, str):
            tenants = [tenants]
        if not isinstance(tenants, (list, tuple)) or not all(isinstance(r, str) for r in tenants):
            raise ValueError(
                f"KvpeerTier: 'tenants' must be a list of NAME=RULE strings, not {tenants!r}"
            )
        if tenants:
            settings["tenants"] = ",".join(tenants)
    metrics = config.get("metrics", True)
    if not isinstance(metrics, bool):
        raise ValueError(f"KvpeerTier: 'metrics' must be true or false, not {metrics!r}")
    settings["plane"], lib_dir = _plane(config.get("plane", "auto"), primary_kv_view)
    if lib_dir is not None:
        settings["nixl_lib_dir"] = lib_dir
    seed = _engine_seed()
    if seed is not None:
        settings["hash_seed"] = seed
    settings["config_fingerprint"] = _fingerprint(offloading_spec)
    return settings, metrics


def _dp_index(offloading_spec: Any) -> int:
    try:
        return int(offloading_spec.config.parallel.data_parallel_index)
    except AttributeError:
        return 0


def _dp_size(offloading_spec: Any) -> int:
    try:
        return int(offloading_spec.config.parallel.data_parallel_size)
    except (AttributeError, TypeError, ValueError):
        return 1


def _nixl_lib_dir() -> str | None:
    """The directory of NIXL's C library inside the installed ``nixl`` wheel, if any."""
    for path in sys.path:
        for found in glob.glob(os.path.join(path or ".", ".nixl*.mesonpy.libs", "libnixl_capi.so")):
            return os.path.dirname(os.path.abspath(found))
    return None


def _plane(plane: Any, memory: memoryview) -> tuple[str, str | None]:
    """kvpeer's plane setting for the tier's ``plane``, and NIXL's library directory.

    * ``tcp``: kvpeer's tcp plane, into vLLM's memory under write permits;
    * ``shm`` / ``both``: same-host kvpeer peers write vLLM's memory through its /dev/shm file
      (vLLM's ``SharedOffloadRegion``, one segment), proven by a trailer page kvpeer adds past
      the blocks; ``both`` adds tcp for peers on other hosts;
    * ``nixl``: NIXL, what stock engines speak;
    * ``auto``: nixl when NIXL is there (stock peers speak nothing else), else both when the
      memory is a /dev/shm file, else tcp.
    """
    if plane not in ("auto", "nixl", "tcp", "shm", "both"):
        raise ValueError(
            f"KvpeerTier: 'plane' must be auto, nixl, tcp, shm or both, not {plane!r}"
        )
    if plane == "tcp":
        return "tcp", None
    shm_object = _native.shm_object_of(memory)
    if plane in ("shm", "both"):
        if shm_object is None:
            raise ValueError(
                f"KvpeerTier: 'plane' {plane!r} needs vLLM's primary memory to be a /dev/shm "
                "file mapped in one segment (vLLM's SharedOffloadRegion); it is not here "
                "(use auto, nixl or tcp)"
            )
        return plane, None
    lib_dir = _nixl_lib_dir() if _native.NIXL_BUILT else None
    if plane == "nixl":
        if not _native.NIXL_BUILT:
            raise ValueError(
                "KvpeerTier: 'plane' nixl needs kvpeer built with NIXL "
                "(MATURIN_PEP517_ARGS='--features nixl' pip install ...)"
            )
        if lib_dir is None:
            raise ValueError("KvpeerTier: 'plane' nixl needs NIXL installed (pip install nixl)")
        return "nixl", lib_dir
    if lib_dir is not None:
        return "nixl", lib_dir
    fallback = "both" if shm_object is not None else "tcp"
    # Said once at start-up: otherwise the first sign is a stock peer's refused connect.
    if not _native.NIXL_BUILT:
        why = "this kvpeer was built without NIXL"
        fix = "reinstall it with MATURIN_PEP517_ARGS='--features nixl' pip install ."
    else:
        why = "NIXL is not installed"
        fix = "pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1"
    logger.warning(
        "KvpeerTier: plane auto is %s (%s): kvpeer peers only; stock vLLM engines move blocks "
        "with NIXL and cannot share with this one: %s",
        fallback,
        why,
        fix,
    )
    return fallback, None


def _polled_off_thread(offloading_spec: Any) -> bool:
    """Whether vLLM calls tiers that tolerate it from a tier-poll thread: its base class knows
    the flag (vLLM 0.33 on) and the spec's poll interval is positive (zero or less turns the
    thread off). Read from what vLLM provides, not from its version."""
    if not hasattr(SecondaryTierManager, "tolerates_off_thread_polling"):
        return False
    interval = getattr(offloading_spec, "tier_poll_interval_s", None)
    try:
        return interval is not None and float(interval) > 0
    except (TypeError, ValueError):
        return False


def _start(
    memory: memoryview, settings: dict[str, str], offloading_spec: Any, io_thread: bool = True
) -> Any:
    # vLLM's OffloadingConfig carries the engine's id (distinct per data-parallel rank); it only
    # names the node's thread and log lines.
    config = getattr(offloading_spec, "config", None)
    engine_id = str(getattr(config, "engine_id", None) or "engine")
    try:
        return _native.EngineTier(
            memory, settings, f"vllm-{engine_id}"[:40], io_thread=io_thread
        )
    except _native.ConfigError as e:
        message, key = e.args[0], e.args[1] if len(e.args) > 1 else "?"
        user_key = _USER_KEY.get(key, key)
        raise ValueError(f"KvpeerTier: bad value for {user_key!r}: {message}") from None
