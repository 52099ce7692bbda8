"""`vllm.config` for kvpeer's vLLM tier harness (not vLLM's file; vLLM's imports every engine
config, model and torch). Only `VllmConfig` is imported, by the offloading metrics module, for
the Prometheus exporter (`OffloadPromMetrics`), which the harness never builds. The harness's
engine configuration is `vllm.v1.kv_offload.config.OffloadingConfig`, vLLM's own."""


class VllmConfig:
    """Type name only: the harness builds no engine config."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("kvpeer's vLLM tier harness has no VllmConfig")
