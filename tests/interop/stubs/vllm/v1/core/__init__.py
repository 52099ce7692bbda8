"""Stub package (kvpeer interop tests)."""
