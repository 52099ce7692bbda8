"""A vLLM 0.33 "engine" without a GPU: vLLM's real scheduler-side offloading code, driven the way
vLLM's offloading connector drives it, for testing secondary tiers (vLLM's stock `p2p` tier,
kvpeer's out-of-tree tier) inside it.

Needs the modules `setup.sh` extracts from the released wheel (plus its stubs) on PYTHONPATH.
What runs is vLLM's own code, unchanged: `TieringOffloadingManager` over a
`CPUPrimaryTierOffloadingManager` (LRU policy), with the secondary tier built by
`SecondaryTierFactory.create_secondary_tier` from a tier config dict (`type`, optional
`module_path`, the tier's keyword arguments), exactly as vLLM's `TieringOffloadingSpec` does.
The primary tier's memory is what vLLM's own tier tests give it: a region object whose
`create_kv_memoryview()` is a memoryview over a zeroed int8 array of shape
(num_chunks, block_len) (vLLM maps a /dev/shm file there; nothing scheduler-side depends on it).

`Engine` plays vLLM's `OffloadingConnectorScheduler` (and the worker's copies between GPU and the
CPU tier, as plain byte copies into/out of the primary array):

* `new_request` = `on_new_request` (a hook outside `schedule()`: takes the manager lock briefly);
* `lookup` = `get_num_new_matched_tokens`'s prefix lookup: `manager.lookup` per key, HIT and
  HIT_PENDING count as hits, RETRY keeps scanning, MISS stops; answers None while deferred;
* `load` = `update_state_after_alloc`'s `prepare_load`, the worker's CPU->GPU copy, then
  `complete_load` when the worker reports it;
* `put` = `build_connector_meta`'s `prepare_store`, the worker's GPU->CPU copy, then
  `complete_store` (which cascades to the secondary tiers);
* `finish` = `on_request_finished` (issued in `build_connector_meta`);
* `step` = the end of `build_connector_meta`: `on_schedule_end` (poll tier jobs ->
  `serve_external_requests` -> submit batched promotions -> cascades -> each tier's
  `on_schedule_end`), then `take_events`.

Locking follows the connector: the first of `lookup`/`load`/`put`/`finish` in a step opens the
step region (holds `manager.lock`) and `step()` closes it, so vLLM's tier-poll thread (when
`tier_poll_interval_s > 0`) only runs between steps; other calls take the lock for their own
duration. With `tier_poll_interval_s=0` (the default here) there is no thread: tiers are served
only from `step()` (and the polls inside `lookup`/`put`), which makes runs deterministic.

Several engines can live in one process. vLLM keeps the NONE_HASH seed (which the p2p tier
advertises and checks in its handshake) process-wide; the stub of `vllm.v1.core.kv_cache_utils`
answers each engine's own seed on the threads that run that engine's code (the test thread while
it is inside an `Engine` call, and the engine's tier-poll thread).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm.v1.core import kv_cache_utils
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    OffloadPolicy,
    ReqContext,
    ScheduleEndContext,
    TierFilter,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.manager import (
    CPUPrimaryTierOffloadingManager,
    TieringOffloadingManager,
)

__all__ = [
    "Engine",
    "HarnessOffloadingSpec",
    "LookupResult",
    "MemoryRegion",
    "ReqContext",
    "drive",
    "free_port",
    "make_engine",
    "make_key",
    "make_offload_key",
    "make_offloading_config",
]

DEFAULT_MODEL = "kvpeer/harness-model"
DEFAULT_DTYPE = "bfloat16"
DEFAULT_TOKENS_PER_BLOCK = 16


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind to port 0, read it, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def make_key(i: int | bytes | str, group_idx: int = 0) -> OffloadKey:
    """An offload key: a 32-byte block hash (sha256 of `i`) + the 4-byte big-endian group."""
    import hashlib

    raw = i if isinstance(i, bytes) else str(i).encode()
    return make_offload_key(hashlib.sha256(raw).digest(), group_idx)


class MemoryRegion:
    """Stands in for vLLM's SharedOffloadRegion as vLLM's tier tests mock it: the primary tier
    calls `create_kv_memoryview()` once and `cleanup()` at shutdown. The memory is a zeroed int8
    array of shape (num_chunks, block_len) (vLLM: torch int8 over the /dev/shm mapping)."""

    def __init__(self, num_chunks: int, block_len: int):
        self.array = np.zeros((num_chunks, block_len), dtype=np.int8)
        self.cleaned_up = False

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.array)

    def cleanup(self) -> None:
        self.cleaned_up = True


class ShmMemoryRegion(MemoryRegion):
    """A region laid out as vLLM's SharedOffloadRegion lays out a single segment: the file
    `/dev/shm/vllm_offload_{engine_id}.mmap` (created exclusively, 0600), mapped shared, the
    int8 array over the mapping. For tests of tiers that use the file itself (kvpeer's shm
    plane); unlinked at cleanup, as vLLM does."""

    def __init__(self, num_chunks: int, block_len: int, engine_id: str):
        import mmap
        import os

        self.path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
        fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_chunks * block_len)
            self._map = mmap.mmap(fd, num_chunks * block_len, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.int8).reshape(num_chunks, block_len)
        self.cleaned_up = False

    def cleanup(self) -> None:
        import os

        self.cleaned_up = True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


class HarnessOffloadingSpec(OffloadingSpec):
    """An `OffloadingSpec` (vLLM's abstract base, unchanged) over a real `OffloadingConfig`, as the
    secondary tiers receive it. The p2p tier reads the config for its fingerprint fields
    (`FileMapper.from_offloading_spec`: model, dtype, tokens_per_hash, groups, parallel sizes)
    and the data-parallel port offset. `hash_seed` is the engine's NONE_HASH seed (vLLM:
    process-wide, `vllm.v1.core.kv_cache_utils`); None = vLLM's default seed."""

    def __init__(self, config: OffloadingConfig, hash_seed: str | None = None):
        super().__init__(config)
        self.hash_seed = hash_seed

    def get_manager(self) -> OffloadingManager:
        raise NotImplementedError("the harness builds the manager: make_engine()")

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        raise NotImplementedError("the harness has no GPU worker")


def make_offloading_config(
    block_len: int,
    *,
    engine_id: str,
    extra_config: dict[str, Any] | None = None,
    model: str = DEFAULT_MODEL,
    dtype: str = DEFAULT_DTYPE,
    tokens_per_block: int = DEFAULT_TOKENS_PER_BLOCK,
    tokens_per_hash: int | None = None,
    layer_names: Sequence[str] = ("model.layers.0.self_attn.attn",),
    data_parallel_index: int = 0,
) -> OffloadingConfig:
    """vLLM's normalized offloading config for a one-group, one-worker engine (TP=PP=DP=1, one
    GPU block per chunk), with `worker_kv_bytes_per_block = block_len`."""
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=tokens_per_block,
                layer_names=tuple(layer_names),
                group_id=0,
            ),
        ),
        worker_kv_bytes_per_block=block_len,
        enable_kv_cache_events=False,
        extra_config=dict(extra_config or {}),
        engine_id=engine_id,
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(
            tokens_per_hash=tokens_per_hash or tokens_per_block, blocks_per_chunk=1
        ),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=data_parallel_index,
            data_parallel_size=data_parallel_index + 1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


@dataclass
class _Request:
    ctx: ReqContext
    policy: OffloadPolicy
    num_positioned: int = 0
    scheduled: bool = False  # its lookup resolved (the scheduler can schedule it)
    announced: bool = False  # passed to on_schedule_end in new_req_ids


@dataclass
class Engine:
    """One engine: vLLM's TieringOffloadingManager plus the scheduler's side of the calls.

    Attributes: `manager` (TieringOffloadingManager), `primary` (CPUPrimaryTierOffloadingManager),
    `tiers` (the secondary tiers; `tier` is the first), `spec`, `view` (the primary memoryview the
    tiers were given, shape (num_chunks, block_len)), `region` (its MemoryRegion; `.array` is the
    int8 array behind the view), `events` (OffloadingEvents taken at each step), `steps`,
    `last_lookup` (the per-key answers of the last `lookup`).
    """

    manager: TieringOffloadingManager
    primary: CPUPrimaryTierOffloadingManager
    tiers: list[SecondaryTierManager]
    spec: HarnessOffloadingSpec
    region: MemoryRegion
    view: memoryview
    engine_id: str
    tier_configs: list[dict]
    events: list[OffloadingEvent] = field(default_factory=list)
    steps: int = 0
    last_lookup: list[LookupResult] = field(default_factory=list)
    _requests: dict[str, _Request] = field(default_factory=dict)
    _in_step: bool = False
    _lock_depth: int = 0
    _closed: bool = False
    _poll_thread: threading.Thread | None = None

    # ------------------------------------------------------------------ properties

    @property
    def tier(self) -> SecondaryTierManager:
        return self.tiers[0]

    @property
    def num_chunks(self) -> int:
        return self.region.array.shape[0]

    @property
    def block_len(self) -> int:
        return self.region.array.shape[1]

    @property
    def hash_seed(self) -> str | None:
        return self.spec.hash_seed

    @property
    def host(self) -> str | None:
        return self.tier_configs[0].get("host") if self.tier_configs else None

    @property
    def port(self) -> int | None:
        """The first tier's configured control port (the p2p tier binds port + DP index)."""
        port = self.tier_configs[0].get("port") if self.tier_configs else None
        return None if port is None else int(port)

    @property
    def tokens_per_chunk(self) -> int:
        group = self.spec.config.groups[0]
        return group.tokens_per_block * self.spec.config.cache.blocks_per_chunk

    # ------------------------------------------------------------------ locking

    @contextlib.contextmanager
    def _scope(self, step: bool = False):
        """Run manager calls as this engine: its NONE_HASH seed on this thread, and the manager
        lock held (as the step region when `step`, which `step()` releases, else just for the
        call). Never re-enters the lock."""
        if self._closed:
            raise RuntimeError(f"engine {self.engine_id} is shut down")
        ident = threading.get_ident()
        prev_seed = kv_cache_utils._thread_seeds.get(ident, _UNSET)
        kv_cache_utils._thread_seeds[ident] = self.spec.hash_seed
        acquired = False
        if not self._in_step and self._lock_depth == 0:
            self.manager.lock.acquire()
            acquired = True
            if step:
                self._in_step = True
        self._lock_depth += 1
        try:
            yield
        finally:
            self._lock_depth -= 1
            if acquired and not self._in_step:
                self.manager.lock.release()
            if prev_seed is _UNSET:
                kv_cache_utils._thread_seeds.pop(ident, None)
            else:
                kv_cache_utils._thread_seeds[ident] = prev_seed

    def _end_step(self) -> None:
        if self._in_step:
            self._in_step = False
            self.manager.lock.release()

    # ------------------------------------------------------------------ requests

    def new_request(
        self,
        req_id: str,
        kv_transfer_params: dict[str, Any] | None = None,
        *,
        load_tier_filter: TierFilter = TierFilter.ALL,
    ) -> ReqContext:
        """A request the scheduler sees for the first time: a ReqContext as the connector builds
        it, then `manager.on_new_request` (each tier parses kv_transfer_params; the p2p consumer
        opens its session here). The policy the manager answered is `policy(req)`."""
        if req_id in self._requests:
            raise ValueError(f"request {req_id} already open on {self.engine_id}")
        ctx = ReqContext(
            req_id=req_id,
            kv_transfer_params=kv_transfer_params,
            load_tier_filter=load_tier_filter,
        )
        with self._scope():
            offloading_context = self.manager.on_new_request(ctx)
        self._requests[req_id] = _Request(ctx=ctx, policy=offloading_context.policy)
        return ctx

    def policy(self, req: ReqContext) -> OffloadPolicy:
        return self._request(req).policy

    def _request(self, req: ReqContext) -> _Request:
        state = self._requests.get(req.req_id)
        if state is None or state.ctx is not req:
            raise ValueError(f"request {req.req_id} is not open on {self.engine_id}")
        return state

    def _position(self, state: _Request, keys: Iterable[OffloadKey]) -> None:
        # The connector records each key's end-token position as the request's chunk keys grow
        # (RequestOffloadState.update_offload_keys); keys are taken in prefix order.
        for key in keys:
            if state.ctx.get_offload_key_position(key) is None:
                state.num_positioned += 1
                state.ctx.set_offload_key_position(
                    key, state.num_positioned * self.tokens_per_chunk
                )

    def finish(self, req: ReqContext) -> None:
        """`manager.on_request_finished`, as `build_connector_meta` issues it for a finished
        request (in the step region, before `on_schedule_end`)."""
        self._request(req)
        with self._scope(step=True):
            self.manager.on_request_finished(req)
        del self._requests[req.req_id]

    # ------------------------------------------------------------------ scheduler calls

    def lookup_results(self, keys: Sequence[OffloadKey], req: ReqContext) -> list[LookupResult]:
        """`manager.lookup` for every key (no early stop), in the step region."""
        state = self._request(req)
        self._position(state, keys)
        with self._scope(step=True):
            return [self.manager.lookup(key, req) for key in keys]

    def lookup(self, keys: Sequence[OffloadKey], req: ReqContext) -> int | None:
        """The connector's maximal-prefix lookup: how many leading keys hit, or None if a lookup
        was deferred (a RETRY, or a HIT_PENDING: in primary but not readable yet, e.g. being
        promoted from a secondary tier). HIT and HIT_PENDING count, RETRY keeps scanning (so the
        manager starts every async lookup), MISS stops. A HIT in a secondary tier starts a
        promotion and answers HIT_PENDING; the promotion is submitted at `step()`. The answers
        (up to the MISS) are left in `last_lookup`."""
        state = self._request(req)
        self._position(state, keys)
        hits = 0
        deferred = False
        self.last_lookup = []
        with self._scope(step=True):
            for key in keys:
                result = self.manager.lookup(key, req)
                self.last_lookup.append(result)
                if result is LookupResult.HIT or result is LookupResult.HIT_PENDING:
                    hits += 1
                    deferred |= result is LookupResult.HIT_PENDING
                elif result is LookupResult.RETRY:
                    deferred = True
                else:
                    break
        if deferred:
            return None
        state.scheduled = True
        return hits

    def load(self, keys: Sequence[OffloadKey], req: ReqContext) -> list[bytes]:
        """Load hit keys into "GPU": `prepare_load` (pins the primary chunks), copy each chunk's
        bytes out, `complete_load`. The keys must have answered HIT this step."""
        self._request(req)
        with self._scope(step=True):
            spec = self.manager.prepare_load(keys, req)
            assert isinstance(spec, CPULoadStoreSpec)
            out = [self.region.array[int(c)].tobytes() for c in spec.chunk_ids]
            self.manager.complete_load(keys, req)
        return out

    def put(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[bytes],
        req: ReqContext,
    ) -> list[OffloadKey] | None:
        """Store blocks computed on "GPU": `prepare_store(keys)` (allocates primary chunks,
        may evict), copy each block the manager asked for into its chunk (zero-padded to
        block_len), then `complete_store` of those keys, as the worker's report would (it
        cascades them to the secondary tiers; a REQUEST_LEVEL tier also gets keys already in
        primary, from prepare_store). Returns the keys written, or None if the primary tier
        could not make room."""
        if len(keys) != len(blocks):
            raise ValueError("one block per key")
        for block in blocks:
            if len(block) > self.block_len:
                raise ValueError(f"block of {len(block)} bytes > block_len {self.block_len}")
        state = self._request(req)
        self._position(state, keys)
        data = dict(zip(keys, blocks))
        with self._scope(step=True):
            out = self.manager.prepare_store(keys, req)
            if out is None:
                return None
            assert isinstance(out.store_spec, CPULoadStoreSpec)
            for key, chunk in zip(out.keys_to_store, out.store_spec.chunk_ids):
                row = self.region.array[int(chunk)].view(np.uint8)
                block = np.frombuffer(data[key], dtype=np.uint8)
                row[: len(block)] = block
                row[len(block) :] = 0
            if out.keys_to_store:
                # The connector completes a store job with the set of its keys.
                self.manager.complete_store(set(out.keys_to_store), req)
        return list(out.keys_to_store)

    def step(
        self,
        new_req_ids: Collection[str] | None = None,
        preempted_req_ids: Collection[str] = (),
    ) -> None:
        """End the scheduler step: `manager.on_schedule_end` (poll tier jobs, serve peers,
        submit promotions and cascades, each tier's on_schedule_end), then take the events;
        releases the step region. `new_req_ids` defaults to the requests whose lookup resolved
        since they were opened (scheduled for the first time)."""
        if new_req_ids is None:
            new_req_ids = []
            for r in self._requests.values():
                if r.scheduled and not r.announced:
                    r.announced = True
                    new_req_ids.append(r.ctx.req_id)
        context = ScheduleEndContext(
            new_req_ids=list(new_req_ids), preempted_req_ids=tuple(preempted_req_ids)
        )
        try:
            with self._scope(step=True):
                self.manager.on_schedule_end(context)
                self.events.extend(self.manager.take_events())
        finally:
            self._end_step()
        self.steps += 1

    def has_pending_work(self) -> bool:
        with self._scope():
            return self.manager.has_pending_work()

    # ------------------------------------------------------------------ inspection

    def slot(self, key: OffloadKey) -> int | None:
        """The primary chunk holding `key` once readable, else None. Peeks at the primary tier's
        cache policy (read-only; no recency or pin change)."""
        with self._scope():
            chunk = self.primary._policy.get(key)
            if chunk is None or not chunk.is_ready:
                return None
            return int(chunk.chunk_id)

    def read(self, key: OffloadKey) -> bytes | None:
        """The bytes of `key`'s primary chunk (block_len bytes), or None if not readable."""
        slot = self.slot(key)
        return None if slot is None else self.region.array[slot].tobytes()

    def pins(self, key: OffloadKey) -> int | None:
        """`key`'s primary ref count (transfers reading it; -1 while being written), or None if
        absent. A peek at the primary tier's cache policy."""
        with self._scope():
            chunk = self.primary._policy.get(key)
            return None if chunk is None else int(chunk.ref_cnt)

    def jobs_in_flight(self) -> int:
        """Promotion and cascade/serve jobs the manager still waits on a tier's result for
        (a peek at TieringOffloadingManager._jobs)."""
        with self._scope():
            return len(self.manager._jobs)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """`manager.shutdown()`, without the lock (as vLLM calls it): tiers first, then the
        primary tier. Idempotent."""
        if self._closed:
            return
        self._end_step()
        ident = threading.get_ident()
        prev_seed = kv_cache_utils._thread_seeds.get(ident, _UNSET)
        kv_cache_utils._thread_seeds[ident] = self.spec.hash_seed
        try:
            self.manager.shutdown()
        finally:
            self._closed = True
            if prev_seed is _UNSET:
                kv_cache_utils._thread_seeds.pop(ident, None)
            else:
                kv_cache_utils._thread_seeds[ident] = prev_seed
            if self._poll_thread is not None:
                kv_cache_utils._thread_seeds.pop(self._poll_thread.ident, None)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


_UNSET = object()


def make_engine(
    tier_config: dict | Sequence[dict] | None,
    num_chunks: int,
    block_len: int,
    *,
    engine_id: str | None = None,
    hash_seed: str | None = None,
    tier_poll_interval_s: float = 0,
    offloading_config: OffloadingConfig | None = None,
    cache_policy: str = "lru",
    enable_events: bool = False,
    shm_region: bool = False,
    **config_kwargs: Any,
) -> Engine:
    """Build an engine the way vLLM's TieringOffloadingSpec.get_manager does, on a MemoryRegion:
    CPUPrimaryTierOffloadingManager(num_chunks, region, cache_policy, enable_events), then each
    secondary tier with `SecondaryTierFactory.create_secondary_tier(tier_config,
    primary.get_kv_memoryview(), spec)` (so a tier is loaded by `type`, or `type` +
    `module_path` out of tree), then TieringOffloadingManager(primary, tiers,
    tier_poll_interval_s).

    `tier_config` is one tier's dict, a list of them, or None (primary only). `hash_seed` is the
    engine's NONE_HASH seed (None: vLLM's default). The spec's OffloadingConfig is
    `offloading_config`, or `make_offloading_config(block_len, **config_kwargs)` (model, dtype,
    tokens_per_block, tokens_per_hash, layer_names, data_parallel_index): engines that differ
    there have different p2p config fingerprints. `shm_region`: the primary memory is a
    /dev/shm file as vLLM maps it (ShmMemoryRegion), not an anonymous array."""
    engine_id = engine_id or f"harness-{uuid.uuid4().hex[:8]}"
    if tier_config is None:
        tier_configs: list[dict] = []
    elif isinstance(tier_config, dict):
        tier_configs = [dict(tier_config)]
    else:
        tier_configs = [dict(c) for c in tier_config]
    extra_config = {
        "spec_name": "TieringOffloadingSpec",
        "secondary_tiers": tier_configs,
        "tier_poll_interval_s": tier_poll_interval_s,
    }
    if offloading_config is None:
        offloading_config = make_offloading_config(
            block_len, engine_id=engine_id, extra_config=extra_config, **config_kwargs
        )
    elif config_kwargs:
        raise TypeError("config keywords and offloading_config are exclusive")
    spec = HarnessOffloadingSpec(offloading_config, hash_seed=hash_seed)
    # As vLLM's TieringOffloadingSpec, which reads it from the extra config and hands itself to
    # the tiers it builds.
    spec.tier_poll_interval_s = tier_poll_interval_s

    ident = threading.get_ident()
    prev_seed = kv_cache_utils._thread_seeds.get(ident, _UNSET)
    kv_cache_utils._thread_seeds[ident] = hash_seed
    region = (
        ShmMemoryRegion(num_chunks, block_len, engine_id)
        if shm_region
        else MemoryRegion(num_chunks, block_len)
    )
    primary = CPUPrimaryTierOffloadingManager(
        num_chunks=num_chunks,
        mmap_region=region,
        cache_policy=cache_policy,
        enable_events=enable_events,
    )
    tiers: list[SecondaryTierManager] = []
    try:
        view = primary.get_kv_memoryview()
        for config in tier_configs:
            tiers.append(SecondaryTierFactory.create_secondary_tier(config, view, spec))
        manager = TieringOffloadingManager(
            primary_tier=primary,
            secondary_tiers=tiers,
            tier_poll_interval_s=tier_poll_interval_s,
        )
    except BaseException:
        for tier in reversed(tiers):
            with contextlib.suppress(Exception):
                tier.shutdown()
        with contextlib.suppress(Exception):
            primary.shutdown()
        raise
    finally:
        if prev_seed is _UNSET:
            kv_cache_utils._thread_seeds.pop(ident, None)
        else:
            kv_cache_utils._thread_seeds[ident] = prev_seed
    engine = Engine(
        manager=manager,
        primary=primary,
        tiers=tiers,
        spec=spec,
        region=region,
        view=view,
        engine_id=engine_id,
        tier_configs=tier_configs,
    )
    # vLLM's tier-poll thread (tier_poll_interval_s > 0) runs this engine's tiers between steps:
    # give it the engine's seed too.
    thread = manager._tier_poll_thread
    if thread is not None:
        engine._poll_thread = thread
        kv_cache_utils._thread_seeds[thread.ident] = hash_seed
    return engine


def _stock_lookup_misses_until_ready() -> bool:
    """Whether this vLLM's stock p2p tier answers MISS to a lookup while its session is not up
    (0.34), which came with its consumer's two load timeouts (`_P2P_LOAD_TIMEOUT_S`)."""
    try:
        from vllm.v1.kv_offload.tiering.p2p.session import client
    except ImportError:
        return False
    return hasattr(client, "_P2P_LOAD_TIMEOUT_S")


_STOCK_LOOKUP_MISSES_UNTIL_READY = _stock_lookup_misses_until_ready()


def stop_process(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP to `pid`, returning once every thread of it is stopped. The signal is asynchronous:
    one thread is woken to start the group's stop and, under load, may run milliseconds later
    while the others go on (a "stopped" producer served a fetch sent after the signal)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while True:
        states = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    # "TID (COMMAND) STATE ...": the command may hold spaces and parentheses.
                    states.append(f.read().rsplit(") ", 1)[1][:1])
            except (FileNotFoundError, IndexError):
                pass
        if states and all(s == "T" for s in states):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pid} not stopped {timeout_s} s after SIGSTOP: {states}")
        time.sleep(0.001)


def open_stock_session(engines: Sequence[Engine], b: Engine, port: int) -> None:
    """Opens B's stock p2p session to the peer on `port` before B's first lookup there, where
    B's first tier is the stock one. vLLM 0.34's stock tier answers MISS, for good, to a lookup
    while its session to the peer is not up (the request recomputes; 0.33 answered RETRY until
    it was): a request naming the peer opens the session, the engines step until it is ready
    (or refused), and the request finishes. Told by contract (the tier keeps `_sessions` whose sessions have
    `ready`) of the release whose stock lookup misses until then (0.34: it came with the two
    load timeouts, `_P2P_LOAD_TIMEOUT_S`), not by the version string; nothing on 0.33 (whose
    RETRY-until-ready path the tests keep exercising) or for kvpeer's tier, whose lookups wait
    for its session."""
    if not _STOCK_LOOKUP_MISSES_UNTIL_READY:
        return
    sessions = getattr(b.tier, "_sessions", None)
    if not isinstance(sessions, dict):
        return

    def session():
        return next((s for p, s in sessions.items() if p.endswith(f":{port}")), None)

    if session() is not None and session().ready:
        return
    params = {"remote_kv_source": {"kv_request_id": f"open-{port}", "remote_host": "127.0.0.1",
                                   "remote_port": port}}
    req = b.new_request(f"open-{port}-{len(sessions)}", params)
    # Until it is up, or refused (a mismatched peer: the session ends, never ready).
    drive(engines, lambda: session() is None or session().ready or not session().alive,
          timeout_s=30)
    b.finish(req)


def drive(
    engines: Sequence[Engine],
    until: Callable[[], Any] = lambda: False,
    *,
    timeout_s: float = 5.0,
    max_rounds: int = 100_000,
    pause_s: float = 0.0005,
) -> int:
    """Step `engines` in turn, round after round, until `until()` is truthy (checked before each
    round, so it can make the scheduler calls of the round, e.g. a lookup). Returns the number
    of rounds; raises TimeoutError after `timeout_s` or `max_rounds`. `pause_s` between rounds
    stands for the model's forward pass (NIXL and ZMQ progress meanwhile)."""
    deadline = time.monotonic() + timeout_s
    for rounds in range(max_rounds):
        if until():
            return rounds
        if time.monotonic() > deadline:
            break
        for engine in engines:
            engine.step()
        if pause_s:
            time.sleep(pause_s)
    raise TimeoutError(
        f"not done after {rounds + 1} rounds / {timeout_s:.1f}s "
        f"(engines: {[e.engine_id for e in engines]})"
    )
