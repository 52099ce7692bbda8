"""Stub package (kvpeer interop tests): only `kv_events` (the publisher's config) is used."""
