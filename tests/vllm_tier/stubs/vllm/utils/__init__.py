"""Package marker for kvpeer's vLLM tier harness (not vLLM's file): vLLM's `vllm.utils` imports
torch at module level; only its submodule `math_utils`, extracted unchanged, is used."""
