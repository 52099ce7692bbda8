"""Types of kvpeer's Rust extension module (crates/kvpeer-py)."""

from collections.abc import Buffer, Mapping, Sequence

__version__: str
NIXL_BUILT: bool
VLLM_PEERS: str
VLLM_TIER: str

class KvpeerError(RuntimeError):
    """kvpeer could not do what was asked."""

class ConfigError(ValueError):
    """A setting is unknown or has a bad value; ``args[1]`` names the key."""

class PlaneUnavailable(KvpeerError):
    """The data plane asked for is not in this build."""

class PeerUnavailable(KvpeerError):
    """No session with the peer (unreachable, refused, or silent); the message says which."""

class NativeRequest:
    """A request as the engine holds it (made by ``EngineTier.open``)."""

    @property
    def kv_request_id(self) -> str: ...

class Query:
    """A peer's question: does the engine hold ``key``? Answered by an ``Answer`` naming ``id``."""

    @property
    def id(self) -> int: ...
    @property
    def peer(self) -> str: ...
    @property
    def kv_request_id(self) -> str: ...
    @property
    def key(self) -> bytes: ...

class Answer:
    """The engine's answer to one ``Query``."""

    @staticmethod
    def hit(query: int, block: int, pin: int) -> Answer:
        """Held in ``block``, pinned by the engine as ``pin`` until it comes back as a Release."""
    @staticmethod
    def miss(query: int) -> Answer:
        """Not held."""
    @staticmethod
    def pending(query: int) -> Answer:
        """Being written: the question comes back later."""

class LookedUp:
    """An answered lookup: per key asked, in order, whether the producer holds it."""

    @property
    def kv_request_id(self) -> str: ...
    @property
    def hits(self) -> list[bool]: ...

class JobEnd:
    """A load or store that ended."""

    @property
    def job(self) -> int: ...
    @property
    def success(self) -> bool: ...
    @property
    def held(self) -> bool: ...

class Polled:
    """What one ``poll`` (or ``shutdown``) returns."""

    @property
    def lookups(self) -> list[LookedUp]: ...
    @property
    def loads(self) -> list[JobEnd]: ...
    @property
    def stores(self) -> list[JobEnd]: ...

class Release:
    """A pin the node no longer needs; ``sent`` when the block reached the peer."""

    @property
    def pin(self) -> int: ...
    @property
    def sent(self) -> bool: ...

class Outstanding:
    """What of the engine's the node still holds for peers."""

    @property
    def questions(self) -> int: ...
    @property
    def pins(self) -> int: ...

class EngineTier:
    """A kvpeer node over an engine's block memory; its I/O on a thread of its own
    (`io_thread`), else driven by the engine's `poll`."""

    def __init__(
        self, memory: Buffer, settings: Mapping[str, str], tag: str, *, io_thread: bool = True
    ) -> None: ...
    @property
    def io_thread(self) -> bool: ...
    @property
    def id(self) -> str: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_len(self) -> int: ...
    @property
    def plane(self) -> str: ...
    def open(
        self,
        kv_request_id: str,
        *,
        source: str | None = None,
        probe: bool = True,
        decoder: bool = False,
    ) -> NativeRequest: ...
    def set_hash_seed(self, seed: str) -> None: ...
    def lookup(self, request: NativeRequest, keys: Sequence[bytes]) -> None: ...
    def load(
        self, job: int, request: NativeRequest, keys: Sequence[bytes], blocks: Sequence[int]
    ) -> None: ...
    def store(
        self, job: int, request: NativeRequest, keys: Sequence[bytes], blocks: Sequence[int]
    ) -> None: ...
    def finish(self, request: NativeRequest) -> None: ...
    def fail_unwritten_stores(self) -> list[int]: ...
    def abort_loads(self) -> int: ...
    def report_held_loads(self, on: bool) -> None: ...
    def poll(self, wait_s: float = 0.0) -> Polled: ...
    def take_queries(self) -> list[Query]: ...
    def answer(self, answers: Sequence[Answer]) -> list[bool]: ...
    def take_releases(self) -> list[Release]: ...
    def outstanding(self) -> Outstanding: ...
    def stats(self) -> dict[str, int]: ...
    def shutdown(self, drain_s: float = 3.0) -> Polled: ...

class Node:
    """A standalone kvpeer node with its own pool and runtime thread."""

    def __init__(self, settings: Mapping[str, str] = ..., tag: str = "python") -> None: ...
    @property
    def id(self) -> str: ...
    def store(self, blocks: Mapping[bytes, bytes]) -> None: ...
    def lookup(
        self, peer: str, keys: Sequence[bytes], kv_request_id: str = ..., timeout_s: float = 10.0
    ) -> list[bool]: ...
    def fetch(
        self, peer: str, keys: Sequence[bytes], kv_request_id: str = ..., timeout_s: float = 10.0
    ) -> list[bytes]: ...
    def read(self, key: bytes) -> bytes | None: ...
    def stats(self) -> dict[str, int]: ...
    def shutdown(self, drain_s: float = 3.0) -> None: ...
    def __enter__(self) -> Node: ...
    def __exit__(self, *exc: object) -> bool: ...

def shm_object_of(memory: Buffer) -> str | None:
    """The /dev/shm object ``memory`` is a shared mapping of, from its start, or None."""

def shard_owner(members: Sequence[str], root: bytes) -> int | None:
    """The index in ``members`` of the pool node that owns the prefix whose root chunk's key
    is ``root`` (rendezvous hashing, as the pools admit by); None without members."""
