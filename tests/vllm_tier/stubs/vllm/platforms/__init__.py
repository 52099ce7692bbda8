"""`current_platform` as the extracted modules use it (kvpeer's vLLM tier harness, not vLLM's
file; vLLM's probes CUDA/ROCm through torch). A CUDA-type platform, so NIXL's package is `nixl`,
not `nixl_rocm` (vllm.distributed.nixl_utils); `log_warnings` is what vllm.logger calls after an
explicit logging config."""


class _Platform:
    def is_rocm(self) -> bool:
        return False

    def log_warnings(self) -> None:
        return None


current_platform = _Platform()
