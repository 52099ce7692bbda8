"""KV offloading for vLLM engines on the CPU platform: the copy between the engine's KV cache
and the offload region that vLLM's primary tier and every secondary tier share.

vLLM's tiering spec refuses the CPU platform (``CPUOffloadingSpec.get_worker``: its worker
copies with CUDA streams), though on CPU the engine's KV cache is already host memory. This
spec is vLLM's ``TieringOffloadingSpec`` (the primary tier, its secondary tiers, the shared
``/dev/shm`` region) with a worker that copies with the CPU. vLLM loads it by module path::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {
        "spec_name": "CPUTieringOffloadingSpec", "spec_module_path": "kvpeer.vllm.cpu",
        "cpu_bytes_to_use": 1073741824,
        "secondary_tiers": [{"type": "KvpeerTier", "module_path": "kvpeer.vllm", ...}]}

(or any other secondary tier, e.g. the stock ``p2p``).

Layout: the same as vLLM's own worker uses with the direct layout, so engines with this spec
and GPU engines with vLLM's share blocks with each other. The region holds one row per offload
chunk; each row holds, tensor after tensor, ``blocks_per_chunk`` engine pages of that tensor.
Engine block ``i`` of a transfer group maps to sub-slot ``(skip + i) % blocks_per_chunk`` of
chunk ``(skip + i) // blocks_per_chunk`` of the group's chunks, where ``skip`` is the group's
first logical block modulo ``blocks_per_chunk`` (a partial first chunk).

Threads: vLLM calls the worker from its model-runner thread, before the step's forward pass
(``start_kv_transfers``): a load must land before the forward reads it, a store reads what an
earlier forward wrote. On CPU the forward runs synchronously on that thread, so each copy is
made in the call itself and reported done by the next ``get_finished``. The canonical layout is
not supported (it is refused with a clear error).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CPUTieringOffloadingSpec", "CPUOffloadingWorker", "OffloadLayoutError"]


class OffloadLayoutError(ValueError):
    """A transfer or a KV cache this worker cannot map onto the offload region; says which."""


class CPUTieringOffloadingSpec(TieringOffloadingSpec):
    """vLLM's tiering spec with a worker that copies on the CPU platform."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        # The parent refuses any platform but CUDA-alike and XPU before it builds its worker.
        if self._worker is None:
            self._worker = self.create_worker(kv_caches)
        return self._worker

    def create_worker(self, kv_caches: CanonicalKVCaches) -> CPUOffloadingWorker:
        if getattr(self.config, "canonical_layout", False):
            raise OffloadLayoutError(
                "kvpeer.vllm.cpu copies vLLM's direct layout only: remove canonical_layout "
                "from kv_connector_extra_config"
            )
        if self.num_chunks <= 0:
            raise OffloadLayoutError(
                f"cpu_bytes_to_use holds no offload chunk of {self.kv_bytes_per_chunk} bytes"
            )
        rank = 0 if self.replicated_layout else self.config.parallel.rank
        engine_id = getattr(self, "_engine_id", None) or self.config.engine_id
        region = SharedOffloadRegion(
            engine_id=engine_id,
            num_chunks=self.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
            cpu_page_size=self.cpu_page_size_per_worker,
        )
        try:
            return CPUOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
        except Exception:
            region.cleanup()
            raise


class _Tensor:
    """One engine KV tensor and its cells in the offload region."""

    def __init__(self, engine: torch.Tensor, offload: torch.Tensor, page: int) -> None:
        # (num_blocks, page): engine block b is row b.
        self.engine = engine
        # (num_chunks, blocks_per_chunk, page): chunk c, sub-slot s.
        self.offload = offload
        self.page = page


class CPUOffloadingWorker(OffloadingWorker):
    """Copies between the engine's KV cache and the offload region, on the calling thread."""

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        region: SharedOffloadRegion,
    ) -> None:
        if blocks_per_chunk <= 0:
            raise OffloadLayoutError(f"blocks_per_chunk is {blocks_per_chunk}")
        self._blocks_per_chunk = blocks_per_chunk
        self._region: SharedOffloadRegion | None = region
        self._tensors: list[_Tensor] = []
        for index, cache in enumerate(kv_caches.tensors):
            page = int(cache.page_size_bytes)
            engine = cache.tensor
            if engine.device.type != "cpu":
                raise OffloadLayoutError(
                    f"KV tensor {index} is on {engine.device}, not the CPU: use vLLM's own "
                    "spec on GPU platforms"
                )
            engine = engine.view(torch.int8)
            if engine.ndim != 2 or engine.shape[1] != page:
                engine = engine.reshape(-1, page)
            cells = region.create_next_worker_view(page * blocks_per_chunk)
            rows, row_stride = cells.shape[0], cells.stride(0)
            offload = cells.as_strided(
                (rows, blocks_per_chunk, page),
                (row_stride, page, 1),
                cells.storage_offset(),
            )
            self._tensors.append(_Tensor(engine, offload, page))
        self._groups = [
            [(int(ref.tensor_idx), int(ref.page_size_bytes)) for ref in refs]
            for refs in kv_caches.group_data_refs
        ]
        for refs in self._groups:
            for tensor, size in refs:
                if not 0 <= tensor < len(self._tensors) or size > self._tensors[tensor].page:
                    raise OffloadLayoutError(
                        f"a KV reference to tensor {tensor} of {size} bytes matches no tensor"
                    )
        self._finished: list[TransferResult] = []

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        """Engine blocks -> offload chunks, now."""
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,  # vLLM 0.33; every copy here is made at once anyway
    ) -> bool:
        """Offload chunks -> engine blocks, now."""
        del expedited
        return self._transfer(job_id, dst_spec, src_spec, store=False)

    def _transfer(
        self, job_id: int, engine_spec: Any, region_spec: Any, store: bool
    ) -> bool:
        started = time.perf_counter()
        if not isinstance(engine_spec, GPULoadStoreSpec) or not isinstance(
            region_spec, BlockIDsLoadStoreSpec
        ):
            raise OffloadLayoutError(
                f"job {job_id}: expected engine blocks and offload chunks, got "
                f"{type(engine_spec).__name__} and {type(region_spec).__name__}"
            )
        blocks = np.asarray(engine_spec.block_ids, dtype=np.int64)
        chunks = np.asarray(region_spec.block_ids, dtype=np.int64)
        sizes = engine_spec.group_sizes
        firsts = engine_spec.block_indices
        if sizes is None:
            sizes = [len(blocks)]
        if firsts is None:
            firsts = [0] * len(sizes)
        if len(sizes) != len(self._groups) or len(firsts) != len(sizes):
            raise OffloadLayoutError(
                f"job {job_id}: {len(sizes)} KV groups, the cache has {len(self._groups)}"
            )
        self._check_bounds(job_id, blocks, chunks)
        per_chunk = self._blocks_per_chunk
        moved = 0
        block_at = chunk_at = 0
        for refs, size, first in zip(self._groups, sizes, firsts):
            size = int(size)
            if size == 0:
                continue
            skip = int(first) % per_chunk
            group_chunks = -(-(size + skip) // per_chunk)
            if block_at + size > len(blocks) or chunk_at + group_chunks > len(chunks):
                raise OffloadLayoutError(
                    f"job {job_id}: a group of {size} blocks (first {first}) runs past the "
                    f"{len(blocks)} engine blocks or {len(chunks)} chunks given"
                )
            logical = np.arange(skip, skip + size, dtype=np.int64)
            runs = self._runs(
                blocks[block_at : block_at + size],
                chunks[chunk_at : chunk_at + group_chunks][logical // per_chunk],
                logical % per_chunk,
            )
            for tensor_index, nbytes in refs:
                t = self._tensors[tensor_index]
                for engine_row, chunk, sub_slot, count in runs:
                    ours = t.engine[engine_row : engine_row + count, :nbytes]
                    if per_chunk == 1:
                        theirs = t.offload[chunk : chunk + count, 0, :nbytes]
                    else:
                        theirs = t.offload[chunk, sub_slot : sub_slot + count, :nbytes]
                    if store:
                        theirs.copy_(ours)
                    else:
                        ours.copy_(theirs)
                moved += size * nbytes
            block_at += size
            chunk_at += group_chunks
        if block_at != len(blocks) or chunk_at != len(chunks):
            raise OffloadLayoutError(
                f"job {job_id}: {len(blocks) - block_at} engine blocks and "
                f"{len(chunks) - chunk_at} chunks left over by its groups"
            )
        self._finished.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=moved,
                transfer_time=time.perf_counter() - started,
            )
        )
        return True

    def _check_bounds(self, job_id: int, blocks: np.ndarray, chunks: np.ndarray) -> None:
        """Every block in the cache and every chunk in the region, before anything moves
        (slices, unlike index tensors, would silently stop at the end)."""
        engine_blocks = min((t.engine.shape[0] for t in self._tensors), default=0)
        region_chunks = min((t.offload.shape[0] for t in self._tensors), default=0)
        if len(blocks) and (blocks.min() < 0 or blocks.max() >= engine_blocks):
            raise OffloadLayoutError(
                f"job {job_id}: engine blocks {blocks.min()}..{blocks.max()} outside the "
                f"cache's {engine_blocks}"
            )
        if len(chunks) and (chunks.min() < 0 or chunks.max() >= region_chunks):
            raise OffloadLayoutError(
                f"job {job_id}: chunks {chunks.min()}..{chunks.max()} outside the region's "
                f"{region_chunks}"
            )

    def _runs(
        self, engine_rows: np.ndarray, chunk_rows: np.ndarray, sub_slots: np.ndarray
    ) -> list[tuple[int, int, int, int]]:
        """(engine row, chunk, sub-slot, count) of each run of blocks that lie one after the
        other on both sides: one slice copy each. Torch's gather-scatter by index tensors
        (``engine[rows] = offload[chunks, slots]``) copied 128 MiB in ~100 ms here, slice
        copies in ~26 ms, the machine's memcpy ~22 ms."""
        if self._blocks_per_chunk == 1:
            # Sub-slot 0 of chunk c + 1 follows chunk c (as a strided slice of rows).
            follows = (np.diff(engine_rows) == 1) & (np.diff(chunk_rows) == 1)
        else:
            follows = (
                (np.diff(engine_rows) == 1)
                & (np.diff(chunk_rows) == 0)
                & (np.diff(sub_slots) == 1)
            )
        starts = np.concatenate(([0], np.flatnonzero(~follows) + 1))
        ends = np.concatenate((starts[1:], [len(engine_rows)]))
        return [
            (int(engine_rows[a]), int(chunk_rows[a]), int(sub_slots[a]), int(b - a))
            for a, b in zip(starts, ends)
        ]

    def get_finished(self) -> list[TransferResult]:
        finished, self._finished = self._finished, []
        return finished

    def wait(self, job_ids: set[int]) -> None:
        # Every copy ended in its submit call.
        del job_ids

    def shutdown(self) -> None:
        self._tensors.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None
