"""Stand-in for torch in kvpeer's vLLM tier harness: only the names vLLM's scheduler-side modules
use at import time, as types. Not PyTorch, and never touched by data: no tensor is made here.

`vllm.v1.kv_offload.base` imports torch for one annotation (`CanonicalKVCacheTensor.tensor:
torch.Tensor`, evaluated when the dataclass is built). Everything that would use torch at run
time (the GPU worker, SharedOffloadRegion's tensors) is stubbed or never called by the harness.
See tests/vllm_tier/README.md for why the real wheel is not used.
"""


class Tensor:
    """Type name only (annotations); constructing one is an error."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("kvpeer's vLLM tier harness has no torch: Tensor is a type name only")
