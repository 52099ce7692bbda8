"""Imports vLLM 0.33's P2P control and session modules (as set up by setup.sh) and encodes a
`connect` with vLLM's own protocol module, to compare with kvpeer's encoder."""

import sys

from vllm.v1.kv_offload.tiering.p2p.control import ZmqTransport  # noqa: F401
from vllm.v1.kv_offload.tiering.p2p.session import P2PSession  # noqa: F401
from vllm.v1.kv_offload.tiering.p2p.session import protocol

names = [n for n in dir(protocol) if not n.startswith("_")]
assert "ConnectMsg" in names and "FetchMsg" in names, names

# Two Python shm transports write into each other's pools through vLLM's interface.
import os

sys.path.insert(0, os.path.dirname(__file__))
from shm_transport import ShmPool, ShmTransport  # noqa: E402

tag = os.getpid()
a_pool, b_pool = ShmPool(f"kvpeer-smoke-a-{tag}", 4, 64), ShmPool(f"kvpeer-smoke-b-{tag}", 4, 64)
a, b = ShmTransport(a_pool, "a"), ShmTransport(b_pool, "b")
a_pool.block(2)[:] = bytes(range(64))
# b's connect to a carries b's token for a; a proves b's pool with it before writing.
a.add_remote_peer("b", b.connect_metadata("a"), b.base_addr, b.num_blocks, b.block_len)
tid = a.write_blocks("b", [2], [3])
assert tid is not None and a.poll("b").done == [tid]
assert bytes(b_pool.block(3)) == bytes(range(64))
assert a.write_blocks("b", [0], [9]) is None, "out of range"
# Refused: no token, a token for another destination, a's own pool, a size lie.
for meta, blocks in [(b.get_agent_metadata(), 4), (b.connect_metadata("c"), 4),
                     (a.connect_metadata("a"), 4), (b.connect_metadata("a"), 3)]:
    try:
        a.add_remote_peer("x", meta, 0, blocks, 64)
    except ValueError:
        pass
    else:
        raise AssertionError(f"registered {meta!r} with {blocks} blocks")
assert a.write_blocks("x", [2], [0]) is None
a.close(); b.close()
a_pool.close(); b_pool.close()
print("interop smoke: vLLM modules import; the shm transport moves blocks")
