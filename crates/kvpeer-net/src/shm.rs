//! The `shm` data plane: peers on one host write blocks straight into each other's pools.
//!
//! Registration opens the peer's POSIX shared-memory object by the name its `agent_metadata`
//! gives, checks it holds at least `num_blocks × block_len` bytes, and maps it read-write; the
//! registration is `Pending` until a helper thread has pre-faulted that mapping (`prefault`),
//! so no copy pays page faults and the runtime never waits for the pre-fault. A write copies local block `l` into the peer's region at `r × block_len`. Local blocks are read
//! through this plane's own read-only mapping of the local object, so the plane and the store
//! never share ownership.
//!
//! Called by the core on the runtime thread. A transfer of at most [`INLINE_COPY_BYTES`] is
//! copied right there (a few tens of microseconds, less than handing it to another thread and
//! back); larger ones run on one worker thread, in submission order, so the runtime never waits
//! on a long copy. Completions are collected by `poll`; the `wake` hook runs after each one, so
//! the runtime can sleep until then.
//! `cancel(Wait)` stops copies that have not started and reports a running one as still
//! running; a copy is never reported stopped while it may still write.

use std::collections::{HashMap, HashSet};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvpeer_core::{
    BlockIndex, CancelMode, DataPlane, PlanePoll, Registration, RemoteMemory, TransferId,
};
use kvpeer_proto::PeerId;
use memmap2::{Mmap, MmapMut};
use tracing::warn;

use crate::metadata::AgentMetadata;
use crate::{lock, shm_object};

/// Called after a transfer completes, from the copy worker.
pub type Wake = Arc<dyn Fn() + Send + Sync>;

/// Transfers up to this many bytes are copied on the caller's thread (measured: below this
/// the two thread hand-offs cost as much as the copy; docs/benchmarks.md).
pub const INLINE_COPY_BYTES: u64 = 8 << 20;

/// Copies blocks `local[i]` of `src` into blocks `remote[i]` of `dst`.
fn copy_blocks(
    src: &[u8],
    dst: &mut [u8],
    local: &[BlockIndex],
    remote: &[BlockIndex],
    len: usize,
) {
    for (&l, &r) in local.iter().zip(remote) {
        let (l, r) = (l as usize * len, r as usize * len);
        dst[r..r + len].copy_from_slice(&src[l..l + len]);
    }
}

/// Why the plane could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// The local object could not be opened or mapped.
    #[error("cannot map the local shared-memory object /{name}: {reason}")]
    Local {
        /// Its name.
        name: String,
        /// Why.
        reason: String,
    },
    /// The copy worker could not be started.
    #[error("cannot start the shm copy worker: {0}")]
    Worker(std::io::Error),
}

struct Job {
    tid: TransferId,
    peer: PeerId,
    dst: Arc<Mutex<MmapMut>>,
    local: Vec<BlockIndex>,
    remote: Vec<BlockIndex>,
}

#[derive(Default)]
struct Shared {
    queued: HashSet<TransferId>,
    running: Option<TransferId>,
    /// Ended transfers not yet polled, per peer.
    ended: HashMap<PeerId, PlanePoll>,
    /// Released by `cancel(Immediate)` while running: never reported.
    abandoned: HashSet<TransferId>,
}

struct PeerMap {
    region: Arc<Mutex<MmapMut>>,
    num_blocks: u64,
}

/// Peer mappings whose pre-faulting finished: (peer, registration number, mapping).
type Prefaulted = Arc<Mutex<Vec<(PeerId, u64, PeerMap)>>>;

/// The shm data plane of one node.
pub struct ShmPlane {
    local: Arc<Mmap>,
    wake: Wake,
    local_blocks: u64,
    block_len: u64,
    peers: HashMap<PeerId, PeerMap>,
    registrations: HashMap<PeerId, Registration>,
    /// Registrations waiting for their mapping's pre-fault: peer → registration number.
    prefaulting: HashMap<PeerId, u64>,
    prefaulted: Prefaulted,
    registration_seq: u64,
    next_tid: TransferId,
    shared: Arc<Mutex<Shared>>,
    jobs: Option<Sender<Job>>,
    worker: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for ShmPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmPlane")
            .field("local_blocks", &self.local_blocks)
            .field("block_len", &self.block_len)
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl ShmPlane {
    /// A plane for the node whose pool is the shared-memory object `local_name`.
    pub fn new(
        local_name: &str,
        num_blocks: u64,
        block_len: u64,
        wake: Wake,
    ) -> Result<Self, ShmError> {
        let local_err = |reason: String| ShmError::Local {
            name: local_name.to_owned(),
            reason,
        };
        let file = shm_object::open(local_name, false).map_err(local_err)?;
        // SAFETY: a read-only view of our own pool; blocks are only read while a store job pins
        // them, so their bytes do not change under a copy.
        let local = unsafe { Mmap::map(&file) }.map_err(|e| local_err(e.to_string()))?;
        crate::prefault::for_read(&local, "the shm plane's view of the local pool");
        let needed = num_blocks.saturating_mul(block_len);
        if (local.len() as u64) < needed {
            return Err(local_err(format!("{} bytes, {needed} needed", local.len())));
        }
        let shared = Arc::new(Mutex::new(Shared::default()));
        let local = Arc::new(local);
        let (tx, rx) = channel::<Job>();
        let worker = {
            let shared = shared.clone();
            let local = local.clone();
            let wake = wake.clone();
            let len = block_len as usize;
            std::thread::Builder::new()
                .name("kvpeer-shm-copy".into())
                .spawn(move || {
                    for job in rx {
                        {
                            let mut s = lock(&shared);
                            if !s.queued.remove(&job.tid) {
                                continue; // cancelled before it started
                            }
                            s.running = Some(job.tid);
                        }
                        {
                            let mut dst = job.dst.lock().unwrap_or_else(|p| p.into_inner());
                            copy_blocks(&local, &mut dst, &job.local, &job.remote, len);
                        }
                        let mut s = lock(&shared);
                        s.running = None;
                        if !s.abandoned.remove(&job.tid) {
                            s.ended.entry(job.peer).or_default().done.push(job.tid);
                        }
                        drop(s);
                        wake();
                    }
                })
                .map_err(ShmError::Worker)?
        };
        Ok(ShmPlane {
            local,
            wake,
            local_blocks: num_blocks,
            block_len,
            peers: HashMap::new(),
            registrations: HashMap::new(),
            prefaulting: HashMap::new(),
            prefaulted: Arc::default(),
            registration_seq: 0,
            next_tid: 0,
            shared,
            jobs: Some(tx),
            worker: Some(worker),
        })
    }

    fn map_peer(&self, memory: &RemoteMemory) -> Result<PeerMap, String> {
        let meta = AgentMetadata::decode(&memory.agent_metadata).map_err(|e| e.to_string())?;
        let name = meta.shm.ok_or("the peer offers no shm plane")?;
        if memory.block_len != self.block_len {
            return Err(format!(
                "block_len {} is not ours ({})",
                memory.block_len, self.block_len
            ));
        }
        let file =
            shm_object::open(&name, true).map_err(|e| format!("cannot open /{name}: {e}"))?;
        // SAFETY: the peer's pool, shared with it by design: we write only blocks the peer named
        // in a fetch (which it reserved for this write) and never read from the mapping.
        let map =
            unsafe { MmapMut::map_mut(&file) }.map_err(|e| format!("cannot map /{name}: {e}"))?;
        let needed = memory.num_blocks.saturating_mul(memory.block_len);
        if (map.len() as u64) < needed {
            return Err(format!(
                "/{name} holds {} bytes, the peer claims {needed}",
                map.len()
            ));
        }
        crate::prefault::for_write(&map, "a peer's pool");
        Ok(PeerMap {
            region: Arc::new(Mutex::new(map)),
            num_blocks: memory.num_blocks,
        })
    }

    /// Transfers queued or running (for tests and stats).
    pub fn inflight(&self) -> usize {
        let s = lock(&self.shared);
        s.queued.len() + usize::from(s.running.is_some())
    }
}

impl DataPlane for ShmPlane {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), String> {
        self.remove_remote_peer(peer);
        let map = match self.map_peer(memory) {
            Ok(map) => map,
            Err(e) => {
                warn!(%peer, error = %e, "shm registration failed");
                self.registrations
                    .insert(peer.clone(), Registration::Failed(e));
                return Ok(());
            }
        };
        // Pre-faulting a large pool takes a while (0.2 s per GiB): do it off the runtime
        // thread; the registration is done when it is.
        self.registration_seq += 1;
        let seq = self.registration_seq;
        let (done, wake, who) = (self.prefaulted.clone(), self.wake.clone(), peer.clone());
        let spawned = std::thread::Builder::new()
            .name("kvpeer-shm-prefault".into())
            .spawn(move || {
                crate::prefault::for_write(&lock(&map.region), "a peer's pool");
                lock(&done).push((who, seq, map));
                wake();
            });
        match spawned {
            Ok(_) => {
                self.prefaulting.insert(peer.clone(), seq);
                self.registrations
                    .insert(peer.clone(), Registration::Pending);
            }
            Err(e) => {
                warn!(%peer, error = %e, "cannot start a pre-fault thread");
                self.registrations.insert(
                    peer.clone(),
                    Registration::Failed(format!("cannot start a pre-fault thread: {e}")),
                );
            }
        }
        Ok(())
    }

    fn registration(&mut self, peer: &PeerId) -> Registration {
        let finished = std::mem::take(&mut *lock(&self.prefaulted));
        for (who, seq, map) in finished {
            // A result for a registration since removed or replaced is dropped.
            if self.prefaulting.get(&who) == Some(&seq) {
                self.prefaulting.remove(&who);
                self.peers.insert(who.clone(), map);
                self.registrations.insert(who, Registration::Done);
            }
        }
        self.registrations
            .get(peer)
            .cloned()
            .unwrap_or_else(|| Registration::Failed("not registered".into()))
    }

    fn remove_remote_peer(&mut self, peer: &PeerId) {
        self.peers.remove(peer);
        self.registrations.remove(peer);
        self.prefaulting.remove(peer);
    }

    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId> {
        let map = self.peers.get(peer)?;
        if !crate::write_in_range(local, remote, self.local_blocks, map.num_blocks) {
            warn!(%peer, "shm write refused: block index out of range");
            return None;
        }
        self.next_tid += 1;
        let tid = self.next_tid;
        if local.len() as u64 * self.block_len <= INLINE_COPY_BYTES {
            {
                let mut dst = map.region.lock().unwrap_or_else(|p| p.into_inner());
                copy_blocks(
                    &self.local,
                    &mut dst,
                    local,
                    remote,
                    self.block_len as usize,
                );
            }
            lock(&self.shared)
                .ended
                .entry(peer.clone())
                .or_default()
                .done
                .push(tid);
            (self.wake)();
            return Some(tid);
        }
        lock(&self.shared).queued.insert(tid);
        let job = Job {
            tid,
            peer: peer.clone(),
            dst: map.region.clone(),
            local: local.to_vec(),
            remote: remote.to_vec(),
        };
        if self.jobs.as_ref()?.send(job).is_err() {
            lock(&self.shared).queued.remove(&tid);
            return None;
        }
        Some(tid)
    }

    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        lock(&self.shared).ended.remove(peer).unwrap_or_default()
    }

    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
        let mut s = lock(&self.shared);
        let mut still = Vec::new();
        for &tid in ids {
            if s.queued.remove(&tid) {
                continue; // never started: released
            }
            if s.running == Some(tid) {
                match mode {
                    CancelMode::Wait => still.push(tid),
                    CancelMode::Immediate => {
                        s.abandoned.insert(tid);
                    }
                }
                continue;
            }
            // Ended but not polled: released, and not reported later.
            for poll in s.ended.values_mut() {
                poll.done.retain(|t| *t != tid);
                poll.failed.retain(|t| *t != tid);
            }
        }
        still
    }
}

impl Drop for ShmPlane {
    fn drop(&mut self) {
        self.jobs = None;
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}
