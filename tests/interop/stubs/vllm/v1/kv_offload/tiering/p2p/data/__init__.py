"""The data-transport package without NIXL (kvpeer interop tests): vLLM's own data/base.py,
extracted unchanged next to this file, and no NixlTransport (the tests speak kvpeer's shm plane)."""

from vllm.v1.kv_offload.tiering.p2p.data.base import DataTransport, PollResult

__all__ = ["DataTransport", "PollResult"]
