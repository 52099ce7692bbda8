"""A minimal out-of-tree secondary tier (kvpeer's, for the harness's own tests): blocks kept in a
dict, copied from/to the primary tier's chunks when a job is submitted, reported done at the
next `get_finished_jobs()`. Loaded by the harness through `SecondaryTierFactory` as
`{"type": "MemoryTier", "module_path": "memory_tier"}`, the way kvpeer's tier will be.

The primary view is 2-D (chunks x block_len); CPython's memoryview does not index one row of a
2-D view (`view[c]` raises NotImplementedError), so rows go through numpy.
"""

import numpy as np

from vllm.v1.kv_offload.base import LookupResult, RequestOffloadingContext
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager


class MemoryTier(SecondaryTierManager):
    def __init__(self, offloading_spec, primary_kv_view, tier_type, backpressure_detector=None,
                 capacity: int = 1 << 20):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.capacity = capacity
        self.blocks: dict[bytes, bytes] = {}
        self.loads: list = []  # TransferJobs submitted by the manager, in order
        self.stores: list = []
        self._done: list[JobResult] = []

    def _rows(self) -> np.ndarray:
        return np.asarray(self._primary_kv_view)

    def lookup(self, key, req_context):
        return LookupResult.HIT if key in self.blocks else LookupResult.MISS

    def submit_store(self, job):
        self.stores.append(job)
        rows = self._rows()
        for key, chunk in zip(job.keys, job.chunk_ids):
            if len(self.blocks) < self.capacity or key in self.blocks:
                self.blocks[key] = rows[int(chunk)].tobytes()
        self._done.append(JobResult(job_id=job.job_id, success=True))

    def submit_load(self, job):
        self.loads.append(job)
        rows = self._rows()
        ok = [k for k in job.keys if k in self.blocks]
        for key, chunk in zip(job.keys, job.chunk_ids):
            if key in self.blocks:
                rows[int(chunk)] = np.frombuffer(self.blocks[key], dtype=np.int8)
        self._done.append(
            JobResult(job_id=job.job_id, success=len(ok) == len(job.keys), successful_keys=ok)
        )

    def get_finished_jobs(self):
        done, self._done = self._done, []
        return done

    def drain_jobs(self):
        return None

    def on_new_request(self, req_context):
        return RequestOffloadingContext()
