"""Stub package (kvpeer interop tests): only `network_utils` is used."""
