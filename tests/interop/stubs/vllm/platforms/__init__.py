"""`current_platform` as vllm.distributed.nixl_utils uses it (kvpeer interop tests): a CUDA-type
platform, so NIXL's package is `nixl`, not `nixl_rocm`."""


class _Platform:
    def is_rocm(self) -> bool:
        return False


current_platform = _Platform()
