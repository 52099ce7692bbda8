"""kvpeer's `shm` data plane (docs/data-planes.md) as a vLLM `DataTransport`, so that vLLM's own
session code can exchange blocks with kvpeer nodes on one host.

The local pool is a POSIX shared-memory object of `num_blocks * block_len` bytes followed by a
4096-byte trailer (magic `KVPSHM01`: a pool without fence words; a 32-byte random secret,
zeros); peers open it by the name
advertised in `agent_metadata` ({"agent", "shm", "shm_token"}, msgpack). `shm_token` is made for
one destination: HMAC-SHA256(secret, u32be(19) "kvpeer-shm-token-v1" u32be(len(dest)) dest), so
the metadata differs per peer: `connect_metadata(peer_id)` makes it (vllm_peer.py puts it into
each `connect` as it leaves, as kvpeer's node does). Before writing into a peer's object this
transport proves it is that peer's pool: not our own object, exactly blocks plus trailer long,
the trailer's magic, and the peer's token made for our own id; nothing is mapped until then.
A write copies local blocks into the peer's object at `remote_idx * block_len`. Copies are plain
memory copies done in `write_blocks` (a few milliseconds at most for the interop workloads), so
every transfer is done by the next `poll`. Into a peer that sends `shm_epoch` (a kvpeer node: its
pool's magic is `KVPSHM02`), each block's fence word in `/<name>.fence` is taken before the copy
and given back after (kvpeer_store::fence; here with plain loads and stores, not atomics: this is
a test peer, and the consumer side's arming and revoking are what the tests exercise); a block
the consumer revoked is not written and fails the transfer. Written for kvpeer's interop tests;
vLLM's `DataTransport` base class is used unchanged.
"""

from __future__ import annotations

import hashlib
import hmac
import mmap
import os
import secrets
import struct
from multiprocessing import shared_memory

import _posixshmem
import msgpack

from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport, PollResult

TRAILER_LEN = 4096
MAGIC = b"KVPSHM01"
# A kvpeer pool: version 2, with fence words beside it.
MAGIC_V2 = b"KVPSHM02"
SECRET_LEN = 32
TOKEN_LABEL = b"kvpeer-shm-token-v1"


def object_len(num_blocks: int, block_len: int) -> int:
    """Bytes of a pool object: the blocks, then the trailer."""
    return num_blocks * block_len + TRAILER_LEN


def token(secret: bytes, destination: str) -> bytes:
    """The proof, for peer `destination`, that we own the pool whose trailer holds `secret`."""
    msg = bytearray()
    for field in (TOKEN_LABEL, destination.encode()):
        msg += struct.pack(">I", len(field)) + field
    return hmac.new(secret, bytes(msg), hashlib.sha256).digest()


def parse_trailer(head: bytes) -> bytes:
    """The secret of a trailer (`head`: its first bytes, at least magic and secret)."""
    if len(head) < len(MAGIC) + SECRET_LEN:
        raise ValueError(f"trailer of {len(head)} bytes is too short")
    if head[: len(MAGIC)] not in (MAGIC, MAGIC_V2):
        raise ValueError('trailer magic is neither "KVPSHM01" nor "KVPSHM02"')
    return bytes(head[len(MAGIC) : len(MAGIC) + SECRET_LEN])


class ShmPool:
    """A pool of `num_blocks` blocks of `block_len` bytes, then the trailer, in a new
    shared-memory object."""

    def __init__(self, name: str, num_blocks: int, block_len: int) -> None:
        size = object_len(num_blocks, block_len)
        self.shm = shared_memory.SharedMemory(name=name, create=True, size=size)
        self.block_len = block_len
        self.secret = secrets.token_bytes(SECRET_LEN)
        at = num_blocks * block_len
        self.shm.buf[at : at + len(MAGIC) + SECRET_LEN] = MAGIC + self.secret
        st = os.fstat(self.shm._fd)  # noqa: SLF001 - the object's identity, to refuse it as a peer's
        self.identity = (st.st_dev, st.st_ino)
        # The 2-D view vLLM's DataTransport takes (shape = blocks x bytes, the trailer left
        # out); bytes are accessed through flat slices, which 2-D memoryviews do not offer.
        self._blocks = self.shm.buf[:at]
        self.view = self._blocks.cast("B", (num_blocks, block_len))

    def block(self, i: int) -> memoryview:
        return self.shm.buf[i * self.block_len : (i + 1) * self.block_len]

    def close(self) -> None:
        self.shm.unlink()
        try:
            self.view.release()
            self._blocks.release()
            self.shm.close()
        except BufferError:
            pass  # DataTransport keeps a ctypes pointer into it; the mapping goes at exit


def _armed(epoch: int) -> int:
    return epoch << 32 | 1


def _writing(epoch: int) -> int:
    return epoch << 32 | (os.getpid() & ((1 << 30) - 1)) << 2 | 2


def open_fence(name: str, num_blocks: int) -> mmap.mmap:
    """Maps `/<name>.fence`, the fence words of the pool `name` (one u64 per block)."""
    fd = _posixshmem.shm_open("/" + name + ".fence", os.O_RDWR, 0o600)
    try:
        if os.fstat(fd).st_size != 8 * num_blocks:
            raise ValueError(f"/{name}.fence is not one word per block")
        return mmap.mmap(fd, 8 * num_blocks, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def open_peer_pool(name: str, num_blocks: int, block_len: int, shm_token: bytes,
                   local_id: str, own: tuple[int, int]) -> mmap.mmap:
    """Opens `/name`, proves it is the pool of the peer that sent `shm_token` to `local_id`,
    and maps its blocks (only then) read-write. Raises ValueError naming what failed."""
    fd = _posixshmem.shm_open("/" + name, os.O_RDWR, 0o600)
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == own:
            raise ValueError(f"/{name} is this node's own pool")
        expected = object_len(num_blocks, block_len)
        if st.st_size != expected:
            raise ValueError(f"/{name} holds {st.st_size} bytes, the peer claims {num_blocks} "
                             f"blocks and a trailer ({expected} bytes)")
        blocks_len = num_blocks * block_len
        secret = parse_trailer(os.pread(fd, len(MAGIC) + SECRET_LEN, blocks_len))
        if not hmac.compare_digest(token(secret, local_id), shm_token):
            raise ValueError(f"the peer's shm_token does not prove it owns /{name}")
        return mmap.mmap(fd, blocks_len, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class ShmTransport(DataTransport):
    """vLLM's data-transport interface over kvpeer's shm plane."""

    def __init__(self, pool: ShmPool, agent: str, config_fields: dict | None = None) -> None:
        # `agent` is this peer's id: the destination a peer's token must be made for.
        super().__init__(pool.view, config_fields)
        self._pool = pool
        self._agent = agent
        self._peers: dict[str, tuple[mmap.mmap, int]] = {}
        # A peer's fence words and its session's epoch, when its `connect` announced them.
        self._fences: dict[str, tuple[mmap.mmap, int]] = {}
        self._next_id = 0
        self._ended: dict[str, tuple[list[int], list[int]]] = {}

    def get_agent_metadata(self) -> bytes:
        # What vLLM's session puts in every `connect`: no token, since it names no destination;
        # the driver replaces it with `connect_metadata(peer)` as the connect leaves.
        return msgpack.packb({"agent": self._agent, "shm": self._pool.shm.name})

    def connect_metadata(self, peer_id: str) -> bytes:
        """The `agent_metadata` of our `connect` to `peer_id`: with our token for it."""
        return msgpack.packb({"agent": self._agent, "shm": self._pool.shm.name,
                              "shm_token": token(self._pool.secret, peer_id)})

    def add_remote_peer(self, peer_id, agent_metadata, base_addr, num_blocks, block_len) -> None:
        meta = msgpack.unpackb(agent_metadata)
        name = meta.get("shm") if isinstance(meta, dict) else None
        if not isinstance(name, str):
            raise ValueError(f"{peer_id} offers no shm plane")
        if block_len != self.block_len:
            raise ValueError(f"{peer_id}: block_len {block_len} is not ours ({self.block_len})")
        shm_token = meta.get("shm_token")
        if not isinstance(shm_token, bytes):
            raise ValueError(f"{peer_id} sent no shm_token proving it owns /{name}")
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"{peer_id}: bad num_blocks {num_blocks!r}")
        region = open_peer_pool(name, num_blocks, block_len, shm_token, self._agent,
                                self._pool.identity)
        epoch = meta.get("shm_epoch")
        fence = open_fence(name, num_blocks) if isinstance(epoch, int) else None
        self.remove_remote_peer(peer_id)
        self._peers[peer_id] = (region, num_blocks)
        if fence is not None:
            self._fences[peer_id] = (fence, epoch)

    def remove_remote_peer(self, peer_id: str) -> None:
        entry = self._peers.pop(peer_id, None)
        if entry is not None:
            entry[0].close()
        fence = self._fences.pop(peer_id, None)
        if fence is not None:
            fence[0].close()

    def write_blocks(self, peer_id, local_idxs, remote_idxs) -> int | None:
        entry = self._peers.get(peer_id)
        if entry is None or len(local_idxs) != len(remote_idxs):
            return None
        region, remote_blocks = entry
        n = self.block_len
        if any(not 0 <= i < self.num_blocks for i in local_idxs) or any(
            not 0 <= r < remote_blocks for r in remote_idxs
        ):
            return None
        fence, epoch = self._fences.get(peer_id, (None, 0))
        revoked = 0
        for l, r in zip(local_idxs, remote_idxs):
            if fence is not None:
                if struct.unpack_from("<Q", fence, 8 * r)[0] != _armed(epoch):
                    revoked += 1  # the consumer's load ended: nothing of it is written
                    continue
                struct.pack_into("<Q", fence, 8 * r, _writing(epoch))
            region[r * n : (r + 1) * n] = self._pool.block(l)
            if fence is not None and struct.unpack_from("<Q", fence, 8 * r)[0] == _writing(epoch):
                struct.pack_into("<Q", fence, 8 * r, _armed(epoch))
        self._next_id += 1
        self._ended.setdefault(peer_id, ([], []))[0].append(self._next_id)
        if revoked:
            self._ended[peer_id][1].append(self._ended[peer_id][0].pop())
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
