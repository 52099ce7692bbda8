"""The data-transport package (kvpeer interop tests): vLLM's own data/base.py and data/nixl.py,
extracted unchanged next to this file. NixlTransport is imported from `data.nixl` by those who
use it, so the shm-only tests need no NIXL installed."""

from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport, PollResult

__all__ = ["DataTransport", "PollResult"]
