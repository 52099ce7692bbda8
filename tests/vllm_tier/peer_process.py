"""A producer engine in its own process (kvpeer's vLLM tier harness), for tests that kill a peer
with SIGKILL: `python peer_process.py PORT BLOCK_LEN N_KEYS SEED TCP_MAX_RATE [PLANE]` builds an engine
with KvpeerTier (PLANE, default tcp; shm and both over a /dev/shm region) on 127.0.0.1:PORT, computes N_KEYS blocks (`random_blocks(N, SEED)`, keys
`make_key("gone-i")`), prints "ready", then steps until killed (or 60 s pass)."""

import sys
import time

import numpy as np

from harness import make_engine, make_key


def main() -> None:
    port, block_len, n, seed, rate = (int(a) for a in sys.argv[1:6])
    plane = sys.argv[6] if len(sys.argv) > 6 else "tcp"
    config = {
        "type": "KvpeerTier",
        "module_path": "kvpeer.vllm",
        "host": "127.0.0.1",
        "port": port,
        "plane": plane,
        "tcp_max_rate": rate,
    }
    engine = make_engine(
        config, 16, block_len, engine_id=f"child-{port}", shm_region=plane != "tcp"
    )
    keys = [make_key(f"gone-{i}") for i in range(n)]
    rng = np.random.default_rng(seed)
    blocks = [rng.bytes(block_len) for _ in range(n)]
    req = engine.new_request("child-req")
    assert engine.put(keys, blocks, req) == keys
    engine.finish(req)
    engine.step()
    print("ready", flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        engine.step()
        time.sleep(0.0005)


if __name__ == "__main__":
    main()
