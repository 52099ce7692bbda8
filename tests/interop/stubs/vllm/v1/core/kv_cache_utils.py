"""The one name vLLM's `kv_events.py` imports from `vllm.v1.core.kv_cache_utils` (kvpeer interop
tests; vLLM's module imports torch): `ExternalBlockHash`, as vLLM 0.33 defines it."""

from typing import TypeAlias

ExternalBlockHash: TypeAlias = bytes | int
