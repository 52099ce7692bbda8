//! A fake block store (`Parent`) and a fake data plane whose behaviour tests script.

use std::collections::{BTreeMap, HashMap, HashSet};

use kvpeer_core::{
    BlockIndex, CancelMode, DataPlane, JobId, LookupResult, Parent, PlaneError, PlaneErrorKind,
    PlanePoll, Registration, RemoteMemory, ServeCtx, StoreJob, TransferId, WriteEnd,
};
use kvpeer_proto::{OffloadKey, PeerId};

/// A block store of keys → blocks, with scriptable answers and full bookkeeping.
#[derive(Debug, Default)]
pub struct FakeParent {
    /// Readable keys and their blocks.
    pub blocks: HashMap<OffloadKey, BlockIndex>,
    /// Keys answered HIT_PENDING.
    pub pending: HashSet<OffloadKey>,
    /// Keys answered RETRY.
    pub retry: HashSet<OffloadKey>,
    /// Refuse to pin (an internal error for the core).
    pub refuse_pins: bool,
    /// Say that this parent calls `Core::serve` itself (`Parent::wakes_core`).
    pub wakes_core: bool,
    /// Bytes (as the key they hold) written into this node's blocks by peers.
    pub landed: HashMap<BlockIndex, OffloadKey>,
    next_job: JobId,
    next_block: BlockIndex,
    /// Open store jobs: job → keys.
    pub pins: HashMap<JobId, Vec<OffloadKey>>,
    /// Every completion, in order.
    pub completed: Vec<(JobId, bool)>,
    /// Contexts opened and not finished.
    pub open_ctxs: HashSet<String>,
    /// Contexts finished, in order.
    pub finished_ctxs: Vec<String>,
    /// Store jobs created by lookups.
    pub lookup_jobs: usize,
    /// `lookup` calls.
    pub lookups: usize,
    /// Faults in the order the core made them (double completion, unknown ctx...).
    pub violations: Vec<String>,
}

impl FakeParent {
    /// Stores `key` in a fresh block.
    pub fn insert(&mut self, key: &OffloadKey) -> BlockIndex {
        self.next_block = BlockIndex::new(self.next_block.get() + 1);
        self.blocks.insert(key.clone(), self.next_block);
        self.next_block
    }

    /// Pins `keys` as the engine does for a PD store; the job then belongs to the core.
    pub fn pin_for_store(&mut self, keys: &[OffloadKey]) -> (JobId, Vec<BlockIndex>) {
        let blocks = keys.iter().map(|k| self.insert(k)).collect();
        self.next_job = JobId::new(self.next_job.get() + 1);
        self.pins.insert(self.next_job, keys.to_vec());
        (self.next_job, blocks)
    }

    /// What block `block` holds (a key), for the writer's side of a transfer.
    pub fn key_in(&self, block: BlockIndex) -> Option<OffloadKey> {
        self.blocks
            .iter()
            .find(|(_, b)| **b == block)
            .map(|(k, _)| k.clone())
    }

    pub fn completions_of(&self, job: JobId) -> Vec<bool> {
        self.completed
            .iter()
            .filter(|(j, _)| *j == job)
            .map(|(_, s)| *s)
            .collect()
    }
}

impl Parent for FakeParent {
    fn on_new_request(&mut self, ctx: &ServeCtx) {
        if !self.open_ctxs.insert(ctx.to_string()) {
            self.violations.push(format!("ctx opened twice: {ctx}"));
        }
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ServeCtx) -> LookupResult {
        self.lookups += 1;
        if !self.open_ctxs.contains(&ctx.to_string()) {
            self.violations.push(format!("lookup on closed ctx {ctx}"));
        }
        if self.pending.contains(key) {
            LookupResult::HitPending
        } else if self.retry.contains(key) {
            LookupResult::Retry
        } else if self.blocks.contains_key(key) {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }

    fn wakes_core(&self) -> bool {
        self.wakes_core
    }

    fn create_store_job(&mut self, keys: &[OffloadKey], _ctx: &ServeCtx) -> Option<StoreJob> {
        if self.refuse_pins {
            return None;
        }
        let mut blocks = Vec::with_capacity(keys.len());
        for key in keys {
            blocks.push(*self.blocks.get(key)?);
        }
        self.next_job = JobId::new(self.next_job.get() + 1);
        self.lookup_jobs += 1;
        self.pins.insert(self.next_job, keys.to_vec());
        Some(StoreJob {
            job_id: self.next_job,
            blocks,
        })
    }

    fn complete_store_job(&mut self, job_id: JobId, success: bool) {
        if self.pins.remove(&job_id).is_none() {
            self.violations
                .push(format!("job {job_id} completed but not pinned"));
        }
        self.completed.push((job_id, success));
    }

    fn on_request_finished(&mut self, ctx: &ServeCtx) {
        if !self.open_ctxs.remove(&ctx.to_string()) {
            self.violations
                .push(format!("ctx finished but not open: {ctx}"));
        }
        self.finished_ctxs.push(ctx.to_string());
    }
}

/// How a fake registration behaves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RegistrationMode {
    /// Done at once.
    Immediate,
    /// Pending until the test calls `finish_registration`.
    Deferred,
    /// Fails with this reason.
    Fail(String),
}

/// How a fake transfer ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum XferState {
    Running,
    Done,
    Failed,
}

#[derive(Debug, Clone)]
pub struct FakeXfer {
    pub peer: PeerId,
    pub local: Vec<BlockIndex>,
    pub remote: Vec<BlockIndex>,
    pub state: XferState,
    /// A wait-mode cancel cannot stop it (a write that may still land).
    pub stuck: bool,
}

/// A data plane whose registrations and transfers the test drives.
#[derive(Debug)]
pub struct FakePlane {
    pub mode: RegistrationMode,
    pub registrations: HashMap<PeerId, Registration>,
    pub removed: Vec<PeerId>,
    pub fail_writes: bool,
    /// New transfers cannot be stopped by a wait-mode cancel.
    pub writes_stuck: bool,
    next_tid: TransferId,
    pub transfers: BTreeMap<TransferId, FakeXfer>,
    /// Ended transfers not yet reported by `poll`.
    unreported: HashMap<PeerId, PlanePoll>,
    pub faults: HashMap<PeerId, String>,
    /// Every cancel call: (ids, mode).
    pub cancels: Vec<(Vec<TransferId>, CancelMode)>,
    /// Transfers released by a cancel (they will never be reported).
    pub released: Vec<TransferId>,
    /// Blocks each peer may write into (granted by `expect_writes`).
    pub permits: HashMap<PeerId, HashSet<BlockIndex>>,
    /// Blocks a peer is in the middle of writing (a stalled producer): not fenced, even once
    /// the load ended, until the test takes them out (the write finished) or, unless
    /// `fence_needs_write_end`, the peer was removed.
    pub writing: HashMap<PeerId, HashSet<BlockIndex>>,
    /// Removing the peer does not fence a write in progress (shm: only its end does).
    pub fence_needs_write_end: bool,
    /// Removing a peer leaves its running writes running (a NIXL WRITE already in the NIC);
    /// by default removal stops them and reports them failed (tcp: the link's connection
    /// closes).
    pub removal_keeps_writes: bool,
}

impl Default for FakePlane {
    fn default() -> Self {
        FakePlane {
            mode: RegistrationMode::Immediate,
            registrations: HashMap::new(),
            removed: Vec::new(),
            fail_writes: false,
            writes_stuck: false,
            next_tid: TransferId::new(0),
            transfers: BTreeMap::new(),
            unreported: HashMap::new(),
            faults: HashMap::new(),
            writing: HashMap::new(),
            fence_needs_write_end: false,
            removal_keeps_writes: false,
            cancels: Vec::new(),
            released: Vec::new(),
            permits: HashMap::new(),
        }
    }
}

impl FakePlane {
    pub fn finish_registration(&mut self, peer: &PeerId, result: Registration) {
        self.registrations.insert(peer.clone(), result);
    }

    pub fn running(&self) -> Vec<TransferId> {
        self.transfers
            .iter()
            .filter(|(_, x)| x.state == XferState::Running)
            .map(|(t, _)| *t)
            .collect()
    }

    /// Ends a transfer; returns it (for the driver to move the bytes on success).
    pub fn end(&mut self, tid: TransferId, success: bool) -> Option<FakeXfer> {
        let xfer = self.transfers.get_mut(&tid)?;
        if xfer.state != XferState::Running {
            return None;
        }
        xfer.state = if success {
            XferState::Done
        } else {
            XferState::Failed
        };
        let report = self.unreported.entry(xfer.peer.clone()).or_default();
        if success {
            report.done.push(tid);
        } else {
            report.failed.push(tid);
        }
        Some(xfer.clone())
    }

    pub fn fault(&mut self, peer: &PeerId, reason: &str) {
        self.faults.insert(peer.clone(), reason.into());
    }
}

impl DataPlane for FakePlane {
    fn add_remote_peer(&mut self, peer: &PeerId, _memory: &RemoteMemory) -> Result<(), PlaneError> {
        let state = match &self.mode {
            RegistrationMode::Immediate => Registration::Done,
            RegistrationMode::Deferred => Registration::Pending,
            RegistrationMode::Fail(e) => {
                Registration::Failed(PlaneError::words(PlaneErrorKind::Rejected, e))
            }
        };
        self.registrations.insert(peer.clone(), state);
        Ok(())
    }

    fn registration(&mut self, peer: &PeerId) -> Registration {
        self.registrations.get(peer).cloned().unwrap_or_else(|| {
            Registration::Failed(PlaneError::words(PlaneErrorKind::Rejected, "unknown peer"))
        })
    }

    fn remove_remote_peer(&mut self, peer: &PeerId) {
        self.registrations.remove(peer);
        self.permits.remove(peer);
        self.removed.push(peer.clone());
        if !self.removal_keeps_writes {
            let running: Vec<TransferId> = self
                .transfers
                .iter()
                .filter(|(_, x)| x.peer == *peer && x.state == XferState::Running)
                .map(|(t, _)| *t)
                .collect();
            for tid in running {
                self.end(tid, false);
            }
        }
    }

    fn expect_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        self.permits.entry(peer.clone()).or_default().extend(blocks);
    }

    fn end_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        if let Some(p) = self.permits.get_mut(peer) {
            for b in blocks {
                p.remove(b);
            }
        }
    }

    fn writes_fenced(&mut self, peer: &PeerId, blocks: &[BlockIndex], _end: WriteEnd) -> bool {
        let removed = self.removed.contains(peer) && !self.registrations.contains_key(peer);
        match self.writing.get(peer) {
            Some(w) if blocks.iter().any(|b| w.contains(b)) => {
                removed && !self.fence_needs_write_end
            }
            _ => true,
        }
    }

    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId> {
        if self.fail_writes || self.registrations.get(peer) != Some(&Registration::Done) {
            return None;
        }
        self.next_tid = TransferId::new(self.next_tid.get() + 1);
        self.transfers.insert(
            self.next_tid,
            FakeXfer {
                peer: peer.clone(),
                local: local.to_vec(),
                remote: remote.to_vec(),
                state: XferState::Running,
                stuck: self.writes_stuck,
            },
        );
        Some(self.next_tid)
    }

    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        let mut poll = self.unreported.remove(peer).unwrap_or_default();
        poll.peer_fault = self
            .faults
            .get(peer)
            .map(|f| PlaneError::words(PlaneErrorKind::Transport, f));
        poll
    }

    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
        self.cancels.push((ids.to_vec(), mode));
        let mut still = Vec::new();
        for &tid in ids {
            let Some(xfer) = self.transfers.get_mut(&tid) else {
                continue;
            };
            if mode == CancelMode::Wait && xfer.state == XferState::Running && xfer.stuck {
                still.push(tid);
                continue;
            }
            // Released: stopped (or already ended) and never reported by poll.
            let peer = xfer.peer.clone();
            xfer.state = XferState::Failed;
            if let Some(report) = self.unreported.get_mut(&peer) {
                report.done.retain(|t| *t != tid);
                report.failed.retain(|t| *t != tid);
            }
            self.released.push(tid);
        }
        still
    }
}
