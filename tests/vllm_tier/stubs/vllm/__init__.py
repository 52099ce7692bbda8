"""Package marker for kvpeer's vLLM tier harness (not vLLM's file). vLLM's own `__init__` imports
its engine lazily and `vllm.env_override`, which needs torch; the harness needs none of it."""
