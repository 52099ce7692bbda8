"""Package marker for kvpeer's vLLM tier harness (not vLLM's file; vLLM's imports the KV transfer
state and connector base, which pull in the engine)."""
