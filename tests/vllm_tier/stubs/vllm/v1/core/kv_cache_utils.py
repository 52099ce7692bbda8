"""`get_none_hash_seed` as the p2p tier imports it (kvpeer's vLLM tier harness, not vLLM's file;
vLLM's holds the whole prefix-cache hashing, with torch-dependent imports).

As in vLLM 0.33, the seed NONE_HASH is derived from is process-wide state, `_NONE_HASH_SEED`,
which `init_none_hash` sets (None before it runs: the deterministic default seed). The harness
runs several engines in one process, each with its own seed, so it adds `_thread_seeds`
(thread id -> seed): tests/vllm_tier/harness.py sets an engine's seed on the thread running
that engine's code (the test thread inside an Engine call, the engine's tier-poll thread). The
p2p tier reads the seed once, when it opens its first session.
"""

import threading

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

_NONE_HASH_SEED: str | None = None

# Harness only (not in vLLM): per-thread seeds of the engine that thread is running.
_thread_seeds: dict[int, str | None] = {}


def get_none_hash_seed() -> str:
    seed = _thread_seeds.get(threading.get_ident())
    if seed is None:
        seed = _NONE_HASH_SEED
    if seed is None:
        return DEFAULT_NONE_HASH_SEED
    return seed
