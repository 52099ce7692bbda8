"""`canonical_format_id` as `vllm.v1.kv_offload.file_mapper` imports it (kvpeer's vLLM tier
harness, not vLLM's file; vLLM's maps worker KV tensors and imports torch and the attention
backends). FileMapper calls it only when the engine's `OffloadingConfig.canonical_layout` is set,
which the harness never sets (vLLM's default, the direct layout)."""


def canonical_format_id(kv_cache_layout: str) -> str:
    raise NotImplementedError(
        "kvpeer's vLLM tier harness supports the direct layout only (canonical_layout=False)"
    )
