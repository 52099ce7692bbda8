"""The names the P2P modules import from vllm.v1.kv_offload.base (kvpeer interop tests).

Same names and shapes as vLLM 0.33: an offload key is its bytes (32-byte block hash followed by
the 4-byte big-endian group index), lookups answer one of four results, and a request context
carries the request id and the engine's kv_transfer_params.
"""

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NewType

OffloadKey = NewType("OffloadKey", bytes)


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    return OffloadKey(block_hash + group_idx.to_bytes(4, "big"))


class LookupResult(Enum):
    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()
    RETRY = auto()


@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    kv_hints: Any = None
    load_tier_filter: Any = None
    _state: dict = field(default_factory=dict, repr=False, init=False)

    def set_state(self, val: Any) -> None:
        self._state[type(val)] = val

    def get_state(self, cls):
        return self._state.get(cls)
