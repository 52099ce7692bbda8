"""kvpeer: peer-to-peer KV-cache sharing for LLM inference, in Rust.

* :class:`Node`: a standalone kvpeer node (its own pool and thread) that stores blocks for
  peers, and looks up and fetches blocks from peers (kvpeer nodes or vLLM engines).
* :mod:`kvpeer.vllm`: ``KvpeerTier``, a vLLM secondary tier (loaded by vLLM through
  ``"module_path": "kvpeer.vllm"``) that replaces the stock ``p2p`` tier.

Supported: peers of vLLM ``VLLM_PEERS`` (0.27 to 0.34), the tier in vLLM ``VLLM_TIER``
(0.32, 0.33 and 0.34).

The node itself is Rust (``kvpeer._native``); every call releases the GIL while it works.
Its log records go to Python's ``logging`` as the logger ``kvpeer`` and its children, WARNING
and above unless that logger is set lower (:mod:`kvpeer._logs`).
"""

from kvpeer._native import (
    NIXL_BUILT,
    VLLM_PEERS,
    VLLM_TIER,
    ConfigError,
    KvpeerError,
    Node,
    PeerUnavailable,
    PlaneUnavailable,
    __version__,
)
from kvpeer import _logs

_logs.start()

__all__ = [
    "NIXL_BUILT",
    "ConfigError",
    "KvpeerError",
    "Node",
    "PeerUnavailable",
    "PlaneUnavailable",
    "VLLM_PEERS",
    "VLLM_TIER",
    "__version__",
]
