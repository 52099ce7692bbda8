"""The vLLM environment variables the P2P modules read, with vLLM 0.33's and 0.34's defaults.

Written for kvpeer's interop tests (not vLLM's file): each name is read from the environment
when accessed, as vLLM's envs module does.
"""

import os

_DEFAULTS = {
    "VLLM_P2P_SIDE_CHANNEL_HOST": ("localhost", str),
    "VLLM_P2P_SIDE_CHANNEL_PORT": ("5710", int),
    "VLLM_P2P_MAX_PEERS": ("128", int),
    "VLLM_P2P_HANDSHAKE_TIMEOUT_S": ("30", int),
    "VLLM_P2P_IDLE_TIMEOUT_S": ("300", int),
    # 0.34 (0.33 does not read it).
    "VLLM_P2P_TRANSFER_STALL_TIMEOUT_S": ("20", float),
}


def __getattr__(name):
    if name in _DEFAULTS:
        default, kind = _DEFAULTS[name]
        return kind(os.getenv(name, default))
    raise AttributeError(name)
