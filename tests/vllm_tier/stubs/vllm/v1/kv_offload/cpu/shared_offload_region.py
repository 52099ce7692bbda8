"""`SharedOffloadRegion` as `vllm.v1.kv_offload.tiering.manager` imports it (kvpeer's vLLM tier
harness, not vLLM's file). vLLM's maps the CPU tier's /dev/shm file and views it through torch
tensors (`torch.frombuffer`), and imports the GPU host-registration code; its only scheduler-side
use is `create_kv_memoryview()` and `cleanup()`, called by `CPUPrimaryTierOffloadingManager`.

The harness does what vLLM's own tier tests do: it passes the primary tier a stand-in region
whose `create_kv_memoryview()` is a memoryview over a zeroed numpy array (harness.MemoryRegion).
This class is the type name the manager module imports; it is never constructed.
"""


class SharedOffloadRegion:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "kvpeer's vLLM tier harness maps no /dev/shm region: use harness.MemoryRegion"
        )

    def create_kv_memoryview(self) -> memoryview:
        raise NotImplementedError

    def cleanup(self) -> None:
        raise NotImplementedError
