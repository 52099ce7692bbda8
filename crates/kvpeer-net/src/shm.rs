//! The `shm` data plane: peers on one host write blocks straight into each other's pools.
//!
//! Registration opens the peer's POSIX shared-memory object by the name its `agent_metadata`
//! gives and proves it is the peer's pool before anything is mapped writable: the object is a
//! regular file, not this node's own pool (same device and inode), exactly
//! `num_blocks × block_len + TRAILER_LEN` bytes, its trailer starts with the magic, and the
//! peer's `shm_token` is the HMAC of the trailer's secret for this node's id
//! ([`kvpeer_store::trailer`]). A peer that cannot read the object cannot make the token, and a
//! token made for another node is worthless here, so a peer can no longer direct this node's
//! writes into its own pool or into another object of the same user. Only then are the blocks
//! (not the trailer) mapped read-write; the registration is `Pending` until a helper thread has
//! pre-faulted that mapping (`prefault`), so no copy pays page faults and the runtime never
//! waits for the pre-fault: on the runtime thread, registration is `open`, `fstat`, a 40-byte
//! `pread`, one HMAC and `mmap`. This node's own `connect` carries its token for each
//! destination ([`DataPlane::connect_metadata`]), made from the secret in its own pool's
//! trailer. A write copies local block `l` into the peer's region at `r × block_len`. Local
//! blocks are read through the store's [`PoolView`]: the plane never maps its own pool. A pool
//! over an engine's own memory ([`kvpeer_store::Pool::external`]) has no object a peer could
//! map, so the plane refuses it ([`ShmError::NotShm`]). A peer's pool, once proven here, is
//! mapped by kvpeer-store ([`Pool::map_peer`]) and written with [`Pool::block_mut`], so this
//! plane holds no `unsafe`.
//!
//! Called by the core on the runtime thread. A transfer of at most [`INLINE_COPY_BYTES`] is
//! copied right there (a few tens of microseconds, less than handing it to another thread and
//! back); larger ones run on one worker thread, in submission order, so the runtime never waits
//! on a long copy. Completions are collected by `poll`; the `wake` hook runs after each one, so
//! the runtime can sleep until then.
//! `cancel(Wait)` stops copies that have not started and reports a running one as still
//! running; a copy is never reported stopped while it may still write.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvpeer_core::{
    BlockIndex, CancelMode, DataPlane, PlaneError, PlanePoll, Registration, RemoteMemory,
    TransferId,
};
use kvpeer_proto::PeerId;
use kvpeer_store::trailer::{self, MAGIC, SECRET_LEN};
use kvpeer_store::{Pool, PoolView};
use tracing::warn;

use crate::metadata::AgentMetadata;
use crate::{lock, shm_object};

/// Called after a transfer completes, from the copy worker.
pub type Wake = Arc<dyn Fn() + Send + Sync>;

/// Transfers up to this many bytes are copied on the caller's thread (measured: below this
/// the two thread hand-offs cost as much as the copy; docs/benchmarks.md).
pub const INLINE_COPY_BYTES: u64 = 8 << 20;

/// Copies blocks `local[i]` of `src` into blocks `remote[i]` of the peer's pool `dst`
/// (indexes checked by `write_in_range` before the copy was accepted).
fn copy_blocks(src: &PoolView, dst: &mut Pool, local: &[BlockIndex], remote: &[BlockIndex]) {
    for (&l, &r) in local.iter().zip(remote) {
        if let (Some(from), Ok(to)) = (src.block(l), dst.block_mut(r)) {
            to.copy_from_slice(from);
        }
    }
}

/// Why the plane could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ShmError {
    /// The pool is not a shared-memory object (an engine's own memory): peers could not map
    /// it, and this node could not prove it owns it.
    #[error(
        "the shm plane needs a pool in a named shared-memory object; this pool is external \
         memory (use the tcp or nixl plane)"
    )]
    NotShm,
    /// The copy worker could not be started.
    #[error("cannot start the shm copy worker: {0}")]
    Worker(std::io::Error),
}

struct Job {
    tid: TransferId,
    peer: PeerId,
    dst: Arc<Mutex<Pool>>,
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
    /// Our mapping of the peer's pool (kvpeer-store maps it, after `prove`).
    region: Arc<Mutex<Pool>>,
    num_blocks: u64,
}

/// Peer mappings whose pre-faulting finished: (peer, registration number, mapping).
type Prefaulted = Arc<Mutex<Vec<(PeerId, u64, PeerMap)>>>;

/// The shm data plane of one node.
pub struct ShmPlane {
    /// This node's id: the destination a peer's token must be made for.
    local_id: PeerId,
    /// The secret in the local pool's trailer: the key of this node's tokens.
    secret: [u8; SECRET_LEN],
    /// `(st_dev, st_ino)` of the local pool: a peer naming it is refused.
    local_object: (u64, u64),
    local: PoolView,
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
            .field("local_id", &self.local_id)
            .field("local_blocks", &self.local_blocks)
            .field("block_len", &self.block_len)
            .field("peers", &self.peers.len())
            .finish()
    }
}

impl ShmPlane {
    /// A plane for the node `local_id` over its pool (`local`, the store's view), which must be
    /// a shared-memory object with its trailer ([`kvpeer_store::Pool::shm`]): its name is what
    /// peers map, its secret what this node's tokens are made from.
    pub fn new(local_id: PeerId, local: PoolView, wake: Wake) -> Result<Self, ShmError> {
        let object = local.shm().ok_or(ShmError::NotShm)?;
        let (secret, local_object) = (*object.secret(), object.file_id());
        let (num_blocks, block_len) = (local.num_blocks(), local.block_len());
        let shared = Arc::new(Mutex::new(Shared::default()));
        let (tx, rx) = channel::<Job>();
        let worker = {
            let shared = shared.clone();
            let local = local.clone();
            let wake = wake.clone();
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
                            copy_blocks(&local, &mut dst, &job.local, &job.remote);
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
            local_id,
            secret,
            local_object,
            local,
            wake,
            local_blocks: num_blocks,
            block_len,
            peers: HashMap::new(),
            registrations: HashMap::new(),
            prefaulting: HashMap::new(),
            prefaulted: Arc::default(),
            registration_seq: 0,
            next_tid: TransferId::new(0),
            shared,
            jobs: Some(tx),
            worker: Some(worker),
        })
    }

    /// Opens, proves and maps the pool a peer names; nothing is mapped writable unless every
    /// check passes. Runtime thread: `open`, `fstat`, a 40-byte `pread`, one HMAC, `mmap`.
    fn map_peer(&self, memory: &RemoteMemory) -> Result<PeerMap, String> {
        let meta = AgentMetadata::decode(&memory.agent_metadata).map_err(|e| e.to_string())?;
        let name = meta.shm.ok_or("the peer offers no shm plane")?;
        if memory.block_len != self.block_len {
            return Err(format!(
                "block_len {} is not ours ({})",
                memory.block_len, self.block_len
            ));
        }
        let token = meta
            .shm_token
            .ok_or_else(|| format!("the peer sent no shm_token proving it owns {name:?}"))?;
        let file = shm_object::open(&name).map_err(|e| format!("cannot open {name:?}: {e}"))?;
        self.prove(&name, &file, memory.num_blocks, &token)?;
        let map = Pool::map_peer(&file, memory.num_blocks, self.block_len)
            .map_err(|e| format!("cannot map {name:?}: {e}"))?;
        Ok(PeerMap {
            region: Arc::new(Mutex::new(map)),
            num_blocks: memory.num_blocks,
        })
    }

    /// Checks that `file` (the object `/name` a peer named) is that peer's pool of `num_blocks`
    /// blocks: a regular file, not our own pool, exactly blocks plus trailer long, with the
    /// trailer's magic, and `token` made from its secret for this node. Returns the blocks'
    /// byte length.
    fn prove(&self, name: &str, file: &File, num_blocks: u64, token: &[u8]) -> Result<u64, String> {
        let stat = file
            .metadata()
            .map_err(|e| format!("cannot fstat {name:?}: {e}"))?;
        if !stat.file_type().is_file() {
            return Err(format!("{name:?} is not a shared-memory object"));
        }
        if (stat.dev(), stat.ino()) == self.local_object {
            return Err(format!("{name:?} is this node's own pool"));
        }
        let blocks_len = num_blocks
            .checked_mul(self.block_len)
            .filter(|b| *b > 0)
            .ok_or_else(|| format!("the peer claims an impossible pool of {num_blocks} blocks"))?;
        let expected = trailer::object_len(num_blocks, self.block_len)
            .ok_or_else(|| format!("the peer claims an impossible pool of {num_blocks} blocks"))?;
        if stat.len() != expected {
            return Err(format!(
                "{name:?} holds {} bytes, the peer claims {num_blocks} blocks and a trailer \
                 ({expected} bytes)",
                stat.len()
            ));
        }
        let mut head = [0u8; MAGIC.len() + SECRET_LEN];
        file.read_exact_at(&mut head, blocks_len)
            .map_err(|e| format!("cannot read the trailer of {name:?}: {e}"))?;
        let secret = trailer::parse_trailer(&head).map_err(|e| format!("{name:?}: {e}"))?;
        if !trailer::verify(&secret, self.local_id.as_str(), token) {
            return Err(format!(
                "the peer's shm_token does not prove it owns {name:?} (wrong or for another node)"
            ));
        }
        Ok(blocks_len)
    }

    /// Transfers queued or running (for tests and stats).
    pub fn inflight(&self) -> usize {
        let s = lock(&self.shared);
        s.queued.len() + usize::from(s.running.is_some())
    }
}

impl DataPlane for ShmPlane {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), PlaneError> {
        self.remove_remote_peer(peer);
        let map = match self.map_peer(memory) {
            Ok(map) => map,
            Err(e) => {
                if let Some(suppressed) = crate::admit_warning("shm registration failed") {
                    warn!(%peer, error = %e, suppressed, "shm registration failed");
                }
                self.registrations
                    .insert(peer.clone(), Registration::Failed(PlaneError::rejected(e)));
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
                if let Some(suppressed) = crate::admit_warning("cannot start a pre-fault thread") {
                    warn!(%peer, error = %e, suppressed, "cannot start a pre-fault thread");
                }
                self.registrations.insert(
                    peer.clone(),
                    Registration::Failed(PlaneError::resources(format!(
                        "cannot start a pre-fault thread: {e}"
                    ))),
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
            .unwrap_or_else(|| Registration::Failed(PlaneError::not_registered()))
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
            if let Some(suppressed) = crate::admit_warning("shm write refused") {
                warn!(%peer, suppressed, "shm write refused: block index out of range");
            }
            return None;
        }
        self.next_tid = TransferId::new(self.next_tid.get() + 1);
        let tid = self.next_tid;
        if local.len() as u64 * self.block_len <= INLINE_COPY_BYTES {
            {
                let mut dst = map.region.lock().unwrap_or_else(|p| p.into_inner());
                copy_blocks(&self.local, &mut dst, local, remote);
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

    fn connect_metadata(&mut self, peer: &PeerId, advertised: &[u8]) -> Vec<u8> {
        match AgentMetadata::decode(advertised) {
            Ok(mut meta) if meta.shm.is_some() => {
                meta.shm_token = Some(trailer::token(&self.secret, peer.as_str()).to_vec());
                meta.encode()
            }
            _ => advertised.to_vec(),
        }
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
