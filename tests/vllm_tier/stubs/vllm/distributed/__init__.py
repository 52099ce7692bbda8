"""Package marker for kvpeer's vLLM tier harness (not vLLM's file; vLLM's imports its
collective-communication code, torch.distributed). Used submodules: `nixl_utils` (vLLM's own,
extracted) and the offloading connector's `metrics` (vLLM's own)."""
