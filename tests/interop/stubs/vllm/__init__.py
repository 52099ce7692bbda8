"""Stub package for kvpeer's interop tests (not vLLM: only what the P2P modules import)."""
