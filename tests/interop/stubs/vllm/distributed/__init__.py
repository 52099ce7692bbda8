"""Stands in for vllm.distributed (kvpeer interop tests): only its `nixl_utils` module, which is
vLLM's own, is used."""
