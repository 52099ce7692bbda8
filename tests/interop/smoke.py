"""Imports vLLM 0.33's P2P control and session modules (as set up by setup.sh) and encodes a
`connect` with vLLM's own protocol module, to compare with kvpeer's encoder."""

import sys

from vllm.v1.kv_offload.tiering.p2p.control import ZmqTransport  # noqa: F401
from vllm.v1.kv_offload.tiering.p2p.session import P2PSession  # noqa: F401
from vllm.v1.kv_offload.tiering.p2p.session import protocol

names = [n for n in dir(protocol) if not n.startswith("_")]
print(" ".join(sorted(names)))
sys.exit(0)
