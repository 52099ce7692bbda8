"""kvpeer.vllm.cpu's worker moves exactly the cells vLLM's layout names: every store and load
of random jobs (groups with partial first chunks, runs and scattered blocks, 1, 2 and 4 engine
blocks per chunk, a reference shorter than its tensor's page) leaves the engine cache and the
offload region as a gather/scatter by index tensors (vLLM's own way of writing it) does, and a
block outside the cache or a chunk outside the region is refused with an error, moving
nothing. No engine: the worker over small tensors, in the engine venv's torch."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from kvpeer.vllm.cpu import CPUOffloadingWorker, OffloadLayoutError, _Tensor
from vllm.v1.kv_offload.base import BlockIDsLoadStoreSpec, GPULoadStoreSpec

PAGE, ENGINE_BLOCKS, CHUNKS = 16, 40, 30
GROUPS = [[(0, PAGE), (1, PAGE - 4)], [(2, PAGE)]]


def worker(blocks_per_chunk: int, seed: int) -> CPUOffloadingWorker:
    """A worker over three random tensors, each chunk row padded as the region's rows are."""
    gen = torch.Generator().manual_seed(seed)
    w = CPUOffloadingWorker.__new__(CPUOffloadingWorker)
    w._blocks_per_chunk = blocks_per_chunk
    w._finished = []
    w._groups = GROUPS
    w._tensors = []
    for _ in range(3):
        engine = torch.randint(-100, 100, (ENGINE_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
        cells = torch.randint(
            -100, 100, (CHUNKS, PAGE * blocks_per_chunk + 8), dtype=torch.int8, generator=gen
        )
        offload = cells.as_strided(
            (CHUNKS, blocks_per_chunk, PAGE), (cells.stride(0), PAGE, 1), cells.storage_offset()
        )
        w._tensors.append(_Tensor(engine, offload, PAGE))
    return w


def random_job(rng: random.Random, per_chunk: int) -> tuple[list[int], list[int], list, list]:
    sizes = [rng.randint(0, 12), rng.randint(1, 12)]
    firsts = [rng.randint(0, 5), rng.randint(0, 5)]
    blocks: list[int] = []
    chunks: list[int] = []
    for size, first in zip(sizes, firsts):
        group_chunks = -(-(size + first % per_chunk) // per_chunk) if size else 0
        if rng.random() < 0.5:
            start = rng.randint(0, ENGINE_BLOCKS - size)
            blocks += range(start, start + size)
        else:
            blocks += rng.sample(range(ENGINE_BLOCKS), size)
        if rng.random() < 0.5:
            start = rng.randint(0, CHUNKS - group_chunks)
            chunks += range(start, start + group_chunks)
        else:
            chunks += rng.sample(range(CHUNKS), group_chunks)
    return blocks, chunks, sizes, firsts


def by_index_tensors(w, blocks, chunks, sizes, firsts, store):
    """The expected cache and region, written as a gather/scatter by index tensors."""
    per_chunk = w._blocks_per_chunk
    out = [(t.engine.clone(), t.offload.clone()) for t in w._tensors]
    block_at = chunk_at = 0
    for refs, size, first in zip(GROUPS, sizes, firsts):
        if size == 0:
            continue
        skip = first % per_chunk
        group_chunks = -(-(size + skip) // per_chunk)
        logical = np.arange(skip, skip + size)
        rows = torch.tensor(blocks[block_at : block_at + size])
        group = np.array(chunks[chunk_at : chunk_at + group_chunks])
        chunk_rows = torch.from_numpy(group[logical // per_chunk])
        slots = torch.from_numpy(logical % per_chunk)
        for tensor, nbytes in refs:
            engine, offload = out[tensor]
            if store:
                offload[chunk_rows, slots, :nbytes] = engine[rows, :nbytes]
            else:
                engine[rows, :nbytes] = offload[chunk_rows, slots, :nbytes]
        block_at += size
        chunk_at += group_chunks
    return out


@pytest.mark.parametrize("per_chunk", [1, 2, 4])
def test_every_copy_moves_exactly_the_cells_vllms_layout_names(per_chunk):
    for seed in range(200):
        rng = random.Random(seed)
        w = worker(per_chunk, seed)
        blocks, chunks, sizes, firsts = random_job(rng, per_chunk)
        for store in (True, False):
            expected = by_index_tensors(w, blocks, chunks, sizes, firsts, store)
            engine_spec = GPULoadStoreSpec(blocks, group_sizes=sizes, block_indices=firsts)
            region_spec = BlockIDsLoadStoreSpec(chunks)
            if store:
                assert w.submit_store(seed, engine_spec, region_spec)
            else:
                assert w.submit_load(seed, region_spec, engine_spec)
            for t, (engine, offload) in zip(w._tensors, expected):
                assert torch.equal(t.engine, engine), (per_chunk, seed, store)
                assert torch.equal(t.offload, offload), (per_chunk, seed, store)
            (result,) = w.get_finished()
            moved = sum(s * sum(n for _, n in refs) for refs, s in zip(GROUPS, sizes))
            assert result.success and result.transfer_size == moved


@pytest.mark.parametrize("bad", ["block", "chunk"])
def test_a_block_or_chunk_outside_the_cache_is_refused_and_nothing_moves(bad):
    w = worker(1, 7)
    blocks, chunks = [3, 4, ENGINE_BLOCKS], [5, 6, 7]
    if bad == "chunk":
        blocks, chunks = [3, 4, 5], [5, 6, CHUNKS]
    before = [(t.engine.clone(), t.offload.clone()) for t in w._tensors]
    engine_spec = GPULoadStoreSpec(blocks, group_sizes=[3, 0], block_indices=[0, 0])
    with pytest.raises(OffloadLayoutError, match="outside"):
        w.submit_store(1, engine_spec, BlockIDsLoadStoreSpec(chunks))
    for t, (engine, offload) in zip(w._tensors, before):
        assert torch.equal(t.engine, engine) and torch.equal(t.offload, offload)
    assert w.get_finished() == []
