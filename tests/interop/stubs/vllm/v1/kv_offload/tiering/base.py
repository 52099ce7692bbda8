"""The names the P2P modules import from vllm.v1.kv_offload.tiering.base (kvpeer interop
tests). Only used in type annotations there; the driver implements the parent's methods."""

JobId = int


class ParentManager:
    """What a session calls on its parent tier (implemented by the interop driver)."""
