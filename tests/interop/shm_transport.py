"""kvpeer's `shm` data plane (docs/data-planes.md) as a vLLM `DataTransport`, so that vLLM's own
session code can exchange blocks with kvpeer nodes on one host.

The local pool is a POSIX shared-memory object that peers open by the name advertised in
`agent_metadata` ({"agent", "shm"}, msgpack); a write copies local blocks into the peer's object
at `remote_idx * block_len`. Copies are plain memory copies done in `write_blocks` (a few
milliseconds at most for the interop workloads), so every transfer is done by the next `poll`.
Written for kvpeer's interop tests; vLLM's `DataTransport` base class is used unchanged.
"""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import msgpack

from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport, PollResult


def _untracked(shm: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    # Python's resource tracker would unlink objects this process merely opened (a peer's
    # pool) when it exits; the owner decides when its pool goes.
    try:
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
    except Exception:  # noqa: BLE001 - the tracker is best effort either way
        pass
    return shm


class ShmPool:
    """A pool of `num_blocks` blocks of `block_len` bytes in a new shared-memory object."""

    def __init__(self, name: str, num_blocks: int, block_len: int) -> None:
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=num_blocks * block_len)
        self.block_len = block_len
        # The 2-D view vLLM's DataTransport takes (shape = blocks x bytes); bytes are accessed
        # through flat slices, which 2-D memoryviews do not offer.
        self.view = memoryview(self.shm.buf).cast("B", (num_blocks, block_len))

    def block(self, i: int) -> memoryview:
        return self.shm.buf[i * self.block_len : (i + 1) * self.block_len]

    def close(self) -> None:
        self.shm.unlink()
        try:
            self.view.release()
            self.shm.close()
        except BufferError:
            pass  # DataTransport keeps a ctypes pointer into it; the mapping goes at exit


class ShmTransport(DataTransport):
    """vLLM's data-transport interface over kvpeer's shm plane."""

    def __init__(self, pool: ShmPool, agent: str, config_fields: dict | None = None) -> None:
        super().__init__(pool.view, config_fields)
        self._pool = pool
        self._agent = agent
        self._peers: dict[str, tuple[shared_memory.SharedMemory, int]] = {}
        self._next_id = 0
        self._ended: dict[str, tuple[list[int], list[int]]] = {}

    def get_agent_metadata(self) -> bytes:
        return msgpack.packb({"agent": self._agent, "shm": self._pool.shm.name})

    def add_remote_peer(self, peer_id, agent_metadata, base_addr, num_blocks, block_len) -> None:
        meta = msgpack.unpackb(agent_metadata)
        name = meta.get("shm") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"{peer_id} offers no shm plane")
        if block_len != self.block_len:
            raise ValueError(f"{peer_id}: block_len {block_len} is not ours ({self.block_len})")
        shm = _untracked(shared_memory.SharedMemory(name=name, create=False))
        if shm.size < num_blocks * block_len:
            shm.close()
            raise ValueError(f"{peer_id}: /{name} is smaller than {num_blocks} blocks")
        self.remove_remote_peer(peer_id)
        self._peers[peer_id] = (shm, num_blocks)

    def remove_remote_peer(self, peer_id: str) -> None:
        entry = self._peers.pop(peer_id, None)
        if entry is not None:
            entry[0].close()

    def write_blocks(self, peer_id, local_idxs, remote_idxs) -> int | None:
        entry = self._peers.get(peer_id)
        if entry is None or len(local_idxs) != len(remote_idxs):
            return None
        shm, remote_blocks = entry
        n = self.block_len
        if any(not 0 <= i < self.num_blocks for i in local_idxs) or any(
            not 0 <= r < remote_blocks for r in remote_idxs
        ):
            return None
        for l, r in zip(local_idxs, remote_idxs):
            shm.buf[r * n : (r + 1) * n] = self._pool.block(l)
        self._next_id += 1
        self._ended.setdefault(peer_id, ([], []))[0].append(self._next_id)
        return self._next_id

    def poll(self, peer_id: str | None = None) -> PollResult:
        peers = list(self._ended) if peer_id is None else [peer_id]
        done: list[int] = []
        failed: list[int] = []
        for p in peers:
            d, f = self._ended.pop(p, ([], []))
            done += d
            failed += f
        return PollResult(done=done, failed=failed)

    def cancel(self, transfer_ids, mode="immediate") -> list[int]:
        # Copies finish inside write_blocks: nothing is ever still running.
        return []

    def close(self) -> None:
        for peer in list(self._peers):
            self.remove_remote_peer(peer)
