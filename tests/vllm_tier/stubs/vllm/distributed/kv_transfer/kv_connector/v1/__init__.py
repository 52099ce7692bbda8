"""Package marker for kvpeer's vLLM tier harness (not vLLM's file; vLLM's imports every KV
connector). Only `offloading/metrics.py` (vLLM's own) and `metrics` (stub) are used."""
