"""The harness with an out-of-tree tier loaded by `type` + `module_path` (memory_tier.py), on one
engine and without network: a cascade on store, eviction from the small primary tier, and a
promotion back (lookup HIT_PENDING, then HIT at the next step) with the bytes intact."""

import numpy as np

from harness import LookupResult, drive, make_key

TIER = {"type": "MemoryTier", "module_path": "memory_tier", "capacity": 64}


def test_out_of_tree_tier_cascades_and_promotes(engines):
    e = engines(TIER, 4, 256, engine_id="solo")
    assert type(e.tier).__name__ == "MemoryTier" and e.tier.capacity == 64
    rng = np.random.default_rng(5)
    keys = [make_key(f"oot-{i}") for i in range(8)]
    blocks = [rng.bytes(200) for _ in keys]  # shorter than block_len: zero-padded
    req = e.new_request("w")
    for key, block in zip(keys, blocks):
        assert e.put([key], [block], req) == [key]
        e.step()  # the cascade's result unpins the chunk, so the next put can evict it
    e.finish(req)
    e.step()
    padded = [b + bytes(56) for b in blocks]
    assert [e.tier.blocks[k] for k in keys] == padded  # every block cascaded
    evicted = [i for i, k in enumerate(keys) if e.read(k) is None]
    assert len(evicted) == 4  # 8 blocks, 4 primary chunks

    want = [keys[i] for i in evicted[:2]]
    req = e.new_request("r")
    assert e.lookup(want, req) is None
    assert e.last_lookup == [LookupResult.HIT_PENDING] * 2
    rounds = drive([e], lambda: e.lookup(want, req) == 2, timeout_s=2)
    assert rounds == 1  # submitted at the step's end, reported at the next poll
    assert [job.is_promotion for job in e.tier.loads] == [True]
    assert e.load(want, req) == [padded[i] for i in evicted[:2]]
    e.finish(req)
    e.step()
    assert e.jobs_in_flight() == 0
