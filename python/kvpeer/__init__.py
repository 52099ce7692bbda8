"""kvpeer: peer-to-peer KV-cache sharing for LLM inference, in Rust.

* :class:`Node`: a standalone kvpeer node (its own pool and thread) that stores blocks for
  peers, and looks up and fetches blocks from peers (kvpeer nodes or vLLM engines).
* :mod:`kvpeer.vllm`: ``KvpeerTier``, a vLLM 0.33 secondary tier (loaded by vLLM through
  ``"module_path": "kvpeer.vllm"``) that replaces the stock ``p2p`` tier.

The node itself is Rust (``kvpeer._native``); every call releases the GIL while it works.
"""

from kvpeer._native import (
    NIXL_BUILT,
    ConfigError,
    KvpeerError,
    Node,
    PeerUnavailable,
    PlaneUnavailable,
    __version__,
)

__all__ = [
    "NIXL_BUILT",
    "ConfigError",
    "KvpeerError",
    "Node",
    "PeerUnavailable",
    "PlaneUnavailable",
    "__version__",
]
