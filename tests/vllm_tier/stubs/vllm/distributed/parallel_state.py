"""The rank checks `vllm.logger` makes for its `*_once` methods (kvpeer's vLLM tier harness, not
vLLM's file; vLLM's builds the torch.distributed groups). The harness is one engine process
without torch.distributed, for which vLLM's own functions answer True."""


def is_global_first_rank() -> bool:
    return True


def is_local_first_rank() -> bool:
    return True
