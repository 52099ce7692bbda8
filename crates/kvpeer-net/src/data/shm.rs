//! The `shm` data plane: peers on one host write blocks straight into each other's pools.
//!
//! Registration opens the peer's POSIX shared-memory object by the name its `agent_metadata`
//! gives and proves it is the peer's pool before anything is written: the object is a regular
//! file owned by this node's user, not this node's own pool (same device and inode), exactly
//! `num_blocks × block_len + TRAILER_LEN` bytes, its trailer starts with the magic, and the
//! peer's `shm_token` is the HMAC of the trailer's secret for this node's id and the challenge
//! this node gave the connection the `connect` came on ([`kvpeer_store::trailer`]). A peer that
//! cannot read the object cannot make the token, a token made for another node (or for an
//! earlier instance or connection of this one) is worthless here, so a peer cannot direct this
//! node's writes into its own pool or into another object of the same user.
//!
//! **A peer's pool cannot fault the node.** The object is the peer's: it may shrink, grow or
//! punch holes in it whenever it likes, and a store through a mapping of a shrunk object faults
//! (SIGBUS), which would end the process. The blocks are mapped by kvpeer-store under its
//! SIGBUS guard ([`kvpeer_store::guard`]): such a fault makes the rest of the mapping private
//! memory and flags it, the copy completes into nothing, and the plane fails that transfer (and
//! every later one to that peer). Before each transfer the object's size is checked again (one
//! `fstat`), so a peer that shrank it fails fast without a fault. Writing through the file
//! (`pwrite`) would need no guard but measured 0.2–0.6× of a memcpy (docs/benchmarks.md).
//! Nothing of a peer's object is pre-faulted or allocated by the node beyond the pages its
//! fetches write. On the runtime thread, registration is `open`, `fstat`, a 40-byte `pread`,
//! one HMAC and `mmap`. This node's own `connect` carries its token
//! for each destination ([`DataPlane::connect_metadata`]), made from the secret in its own pool's
//! trailer and the challenge the destination gave. Local blocks are read through the store's
//! [`PoolView`]: the plane never maps its own pool. A pool over an engine's own memory
//! ([`kvpeer_store::Pool::external`]) has no object a peer could open, so the plane refuses it
//! ([`ShmError::NotShm`]). The plane holds no `unsafe`.
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
    TransferId, WriteEnd,
};
use kvpeer_proto::PeerId;
use kvpeer_store::fence::{self, PeerFence};
use kvpeer_store::trailer::{self, MAGIC, SECRET_LEN};
use kvpeer_store::{Pool, PoolView, ShmObject};
use tracing::warn;

use super::shm_object;
pub use super::shm_refusal::ShmRefusal;
use crate::data::metadata::AgentMetadata;
use crate::lock;

/// Called after a transfer completes, from the copy worker.
pub type Wake = Arc<dyn Fn() + Send + Sync>;

/// Transfers up to this many bytes are copied on the caller's thread (measured: below this
/// the two thread hand-offs cost as much as the copy; docs/benchmarks.md).
pub const INLINE_COPY_BYTES: u64 = 8 << 20;

/// A proven peer's pool object: its guarded mapping, and the descriptor its size is checked on.
#[derive(Debug)]
struct PeerObject {
    map: Mutex<Pool>,
    file: File,
    /// The object's length when it was proven (blocks and trailer).
    len: u64,
    /// Its fence words and this session's epoch, when the peer announced them: each block's
    /// word is taken before the copy into it ([`kvpeer_store::fence`]).
    fence: Option<(PeerFence, u32)>,
}

/// Why a write into a peer's pool failed (the transfer fails; the node goes on).
#[derive(Debug, thiserror::Error)]
enum PeerWriteError {
    /// The peer changed its object's size since it proved it.
    #[error("the peer's pool object is now {now} bytes, not the {proven} it proved")]
    Resized { proven: u64, now: u64 },
    /// The object could not be examined.
    #[error("cannot fstat the peer's pool object: {0}")]
    Stat(std::io::Error),
    /// A store into the mapping faulted: the peer shrank (or punched) its object mid-copy.
    #[error("the peer's pool object shrank under the copy (guarded fault)")]
    Faulted,
    /// The peer revoked blocks before they were copied (its load ended: timed out, aborted).
    #[error("{0} blocks were revoked by the peer before the copy (its load ended)")]
    Revoked(usize),
}

/// Copies blocks `local[i]` of `src` into blocks `remote[i]` of the peer's pool `dst`
/// (indexes checked by `write_in_range` before the copy was accepted): after checking that the
/// object still has its proven size, a memcpy per block through the guarded mapping; a peer
/// that shrinks its object meanwhile makes this fail ([`PeerWriteError::Faulted`]), never the
/// node.
fn copy_blocks(
    src: &PoolView,
    dst: &PeerObject,
    local: &[BlockIndex],
    remote: &[BlockIndex],
) -> Result<(), PeerWriteError> {
    let now = dst.file.metadata().map_err(PeerWriteError::Stat)?.len();
    if now != dst.len {
        return Err(PeerWriteError::Resized {
            proven: dst.len,
            now,
        });
    }
    let mut map = dst.map.lock().unwrap_or_else(|p| p.into_inner());
    if map.peer_faulted() {
        return Err(PeerWriteError::Faulted);
    }
    let mut revoked = 0;
    for (&l, &r) in local.iter().zip(remote) {
        // Take the block's fence word first: a block the peer revoked (its load ended while
        // this node stalled) is not written, and one being written cannot be handed to another
        // key until the word is given back below.
        if let Some((fence, epoch)) = &dst.fence {
            if !fence.begin(r.get(), *epoch) {
                revoked += 1;
                continue;
            }
        }
        if let (Some(from), Ok(to)) = (src.block(l), map.block_mut(r)) {
            to.copy_from_slice(from);
        }
        if let Some((fence, epoch)) = &dst.fence {
            fence.end(r.get(), *epoch);
        }
    }
    if map.peer_faulted() {
        return Err(PeerWriteError::Faulted);
    }
    if revoked > 0 {
        return Err(PeerWriteError::Revoked(revoked));
    }
    Ok(())
}

/// Logs a failed write into a peer's pool (rate-limited: a peer causes it at will).
fn warn_write_failed(peer: &PeerId, e: &PeerWriteError) {
    if let Some(suppressed) = crate::admit_warning("shm write into a peer's pool failed") {
        warn!(%peer, error = %e, suppressed, "shm write into a peer's pool failed");
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
    dst: Arc<PeerObject>,
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
    /// The peer's pool object, proven by `prove`, mapped under the SIGBUS guard.
    region: Arc<PeerObject>,
    num_blocks: u64,
}

/// The shm data plane of one node.
pub struct ShmPlane {
    /// This node's id: the destination a peer's token must be made for.
    local_id: PeerId,
    /// The secret in the local pool's trailer: the key of this node's tokens.
    secret: [u8; SECRET_LEN],
    /// `(st_dev, st_ino)` of the local pool: a peer naming it is refused.
    local_object: (u64, u64),
    /// The local pool's object, whose fence words this plane arms for the fetches it sends.
    own: ShmObject,
    /// The epoch of the fence words each peer's session was given in our `connect`.
    epochs: HashMap<PeerId, u32>,
    /// The next epoch handed out (starts random: a restarted node's epochs are not its last).
    next_epoch: u32,
    local: PoolView,
    wake: Wake,
    local_blocks: u64,
    block_len: u64,
    peers: HashMap<PeerId, PeerMap>,
    registrations: HashMap<PeerId, Registration>,
    /// The challenge this node gave the connection the latest `connect` came on, and whose it
    /// is ([`DataPlane::bind_challenge`]): the core registers a peer while it handles that
    /// `connect`, so one slot is enough, and a peer claiming a million identities leaves no
    /// more than one behind.
    challenge: Option<(PeerId, Vec<u8>)>,
    /// Whether a version-1 token (made for this node's address, not for a challenge: what a
    /// peer sends that cannot read our READY) is accepted too. Off by default: such a token
    /// is good at any later instance at this address (docs/security.md, "Fresh proofs").
    allow_replayable_tokens: bool,
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
        let object = local.shm().ok_or(ShmError::NotShm)?.clone();
        let (secret, local_object) = (*object.secret(), object.file_id());
        let mut seed = [0u8; 4];
        // Any start will do (epochs only need to differ between a node's sessions); random
        // keeps a restarted node from reusing its last run's first epochs.
        let _ = getrandom::fill(&mut seed);
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
                        let copied = copy_blocks(&local, &job.dst, &job.local, &job.remote);
                        if let Err(e) = &copied {
                            warn_write_failed(&job.peer, e);
                        }
                        let mut s = lock(&shared);
                        s.running = None;
                        if !s.abandoned.remove(&job.tid) {
                            let ended = s.ended.entry(job.peer).or_default();
                            match copied {
                                Ok(()) => ended.done.push(job.tid),
                                Err(_) => ended.failed.push(job.tid),
                            }
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
            own: object,
            epochs: HashMap::new(),
            next_epoch: u32::from_ne_bytes(seed),
            local,
            wake,
            local_blocks: num_blocks,
            block_len,
            peers: HashMap::new(),
            registrations: HashMap::new(),
            challenge: None,
            allow_replayable_tokens: false,
            next_tid: TransferId::new(0),
            shared,
            jobs: Some(tx),
            worker: Some(worker),
        })
    }

    /// Opens and proves the pool a peer names; nothing is written unless every check passes.
    /// Runtime thread: `open`, `fstat`, a 40-byte `pread`, one HMAC.
    fn open_peer(&self, peer: &PeerId, memory: &RemoteMemory) -> Result<PeerMap, ShmRefusal> {
        let meta = AgentMetadata::decode(&memory.agent_metadata)?;
        let name = meta.shm.ok_or(ShmRefusal::NoShm)?;
        if memory.block_len != self.block_len {
            return Err(ShmRefusal::BlockLen {
                theirs: memory.block_len,
                ours: self.block_len,
            });
        }
        let token = meta
            .shm_token
            .ok_or_else(|| ShmRefusal::NoToken(name.clone()))?;
        let challenge = self
            .challenge
            .as_ref()
            .filter(|(whose, _)| whose == peer)
            .map(|(_, c)| c.as_slice());
        let file = shm_object::open(&name).map_err(|e| ShmRefusal::Open(name.clone(), e))?;
        let len = self.prove(&name, &file, memory.num_blocks, &token, challenge)?;
        let fence = match meta.shm_epoch {
            Some(epoch) => Some((self.open_fence(&name, memory.num_blocks)?, epoch)),
            None => None,
        };
        let map = Pool::map_peer(&file, memory.num_blocks, self.block_len)
            .map_err(|e| ShmRefusal::Map(name.clone(), Arc::new(e)))?;
        Ok(PeerMap {
            region: Arc::new(PeerObject {
                map: Mutex::new(map),
                file,
                len,
                fence,
            }),
            num_blocks: memory.num_blocks,
        })
    }

    /// Checks that `file` (the object `/name` a peer named) is that peer's pool of `num_blocks`
    /// blocks: a regular file of this node's user, not our own pool, exactly blocks plus
    /// trailer long, with the trailer's magic, and `token` made from its secret for this node
    /// and `challenge`. Returns the object's byte length.
    fn prove(
        &self,
        name: &str,
        file: &File,
        num_blocks: u64,
        token: &[u8],
        challenge: Option<&[u8]>,
    ) -> Result<u64, ShmRefusal> {
        let named = || name.to_owned();
        let stat = file
            .metadata()
            .map_err(|e| ShmRefusal::Stat(named(), e.kind()))?;
        if !stat.file_type().is_file() {
            return Err(ShmRefusal::NotShm(named()));
        }
        let uid = nix::unistd::geteuid().as_raw();
        if stat.uid() != uid {
            return Err(ShmRefusal::OtherUser {
                name: named(),
                owner: stat.uid(),
                ours: uid,
            });
        }
        if (stat.dev(), stat.ino()) == self.local_object {
            return Err(ShmRefusal::OwnPool(named()));
        }
        let blocks_len = num_blocks
            .checked_mul(self.block_len)
            .filter(|b| *b > 0)
            .ok_or(ShmRefusal::ImpossiblePool(num_blocks))?;
        let expected = trailer::object_len(num_blocks, self.block_len)
            .ok_or(ShmRefusal::ImpossiblePool(num_blocks))?;
        if stat.len() != expected {
            return Err(ShmRefusal::WrongSize {
                name: named(),
                holds: stat.len(),
                blocks: num_blocks,
                expected,
            });
        }
        let mut head = [0u8; MAGIC.len() + SECRET_LEN];
        file.read_exact_at(&mut head, blocks_len)
            .map_err(|e| ShmRefusal::Trailer(named(), e.kind()))?;
        let secret =
            trailer::parse_trailer(&head).map_err(|e| ShmRefusal::BadTrailer(named(), e))?;
        let us = self.local_id.as_str();
        let proven = trailer::verify(&secret, us, challenge, token)
            || (self.allow_replayable_tokens && trailer::verify(&secret, us, None, token));
        if !proven {
            return Err(ShmRefusal::Unproven(named()));
        }
        Ok(expected)
    }

    /// Opens and maps the fence words of the proven pool `name` of `num_blocks` blocks: a
    /// regular file of this user, not our own words, exactly one word per block.
    fn open_fence(&self, name: &str, num_blocks: u64) -> Result<PeerFence, ShmRefusal> {
        let fence_name = fence::object_name(name);
        let refuse = |why: String| ShmRefusal::Fence {
            name: fence_name.clone(),
            why,
        };
        let file = shm_object::open(&fence_name).map_err(|e| refuse(e.to_string()))?;
        let stat = file.metadata().map_err(|e| refuse(e.to_string()))?;
        let uid = nix::unistd::geteuid().as_raw();
        if !stat.file_type().is_file() || stat.uid() != uid {
            return Err(refuse("not a shared-memory object of this user".into()));
        }
        if (stat.dev(), stat.ino()) == self.own.fence().file_id() {
            return Err(refuse("this node's own fence words".into()));
        }
        if Some(stat.len()) != fence::object_len(num_blocks) {
            return Err(refuse(format!(
                "{} bytes for {num_blocks} blocks",
                stat.len()
            )));
        }
        PeerFence::map(&file, num_blocks).map_err(|e| refuse(e.to_string()))
    }

    /// Accepts version-1 tokens too (bound to this node's address, not to a connection): for
    /// peers whose control channel cannot read the challenge (kvpeer's Python shm transport
    /// inside a stock vLLM session). Such a token can be replayed by whoever held it, at any
    /// later instance of this node at the same address.
    pub fn set_allow_replayable_tokens(&mut self, allow: bool) {
        self.allow_replayable_tokens = allow;
    }

    /// Forgets the peer's pool mapping and registration (its `connect` is being replaced), but
    /// not the epoch our own `connect` gave its session: the fetches we send it still arm
    /// blocks for that epoch.
    pub fn forget_mapping(&mut self, peer: &PeerId) {
        self.peers.remove(peer);
        self.registrations.remove(peer);
    }

    /// Transfers queued or running (for tests and stats).
    pub fn inflight(&self) -> usize {
        let s = lock(&self.shared);
        s.queued.len() + usize::from(s.running.is_some())
    }
}

impl DataPlane for ShmPlane {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), PlaneError> {
        self.forget_mapping(peer);
        match self.open_peer(peer, memory) {
            Ok(map) => {
                self.peers.insert(peer.clone(), map);
                self.registrations.insert(peer.clone(), Registration::Done);
            }
            Err(e) => {
                if let Some(suppressed) = crate::admit_warning("shm registration failed") {
                    warn!(%peer, error = %e, suppressed, "shm registration failed");
                }
                self.registrations
                    .insert(peer.clone(), Registration::Failed(PlaneError::rejected(e)));
            }
        }
        Ok(())
    }

    fn registration(&mut self, peer: &PeerId) -> Registration {
        self.registrations
            .get(peer)
            .cloned()
            .unwrap_or_else(|| Registration::Failed(PlaneError::not_registered()))
    }

    fn bind_challenge(&mut self, peer: &PeerId, challenge: Option<&[u8]>) {
        self.challenge = challenge.map(|c| (peer.clone(), c.to_vec()));
    }

    fn remove_remote_peer(&mut self, peer: &PeerId) {
        self.peers.remove(peer);
        self.registrations.remove(peer);
        self.epochs.remove(peer);
    }

    fn expect_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        // A peer we gave no epoch (no `connect` of ours reached it) gets 0, which no writer
        // holds unless it was told: its writes fail rather than land unfenced.
        let epoch = self.epochs.get(peer).copied().unwrap_or(0);
        let words = self.own.fence();
        for b in blocks {
            words.arm(b.get(), epoch);
        }
    }

    fn end_writes(&mut self, _peer: &PeerId, blocks: &[BlockIndex]) {
        let words = self.own.fence();
        for b in blocks {
            words.revoke(b.get());
        }
    }

    fn bounds_write_time(&self, _peer: &PeerId) -> bool {
        // A copy in this process: it ends when the memcpy does.
        true
    }

    fn writes_fenced(&mut self, _peer: &PeerId, blocks: &[BlockIndex], _end: WriteEnd) -> bool {
        // Even a peer's word is not taken for it: a copy in progress holds its block's word.
        // Every block is revoked now (no short cut at the first still being written), so none
        // of them can take a write that has not started yet.
        let words = self.own.fence();
        let mut fenced = true;
        for b in blocks {
            fenced &= words.revoke(b.get());
        }
        fenced
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
        // Inline unless the worker is copying into this peer's pool right now (the runtime
        // never waits for a long copy: a busy pool's copy joins the worker's queue instead).
        let pool_busy = map.region.map.try_lock().is_err();
        if local.len() as u64 * self.block_len <= INLINE_COPY_BYTES && !pool_busy {
            let copied = copy_blocks(&self.local, &map.region, local, remote);
            let mut s = lock(&self.shared);
            let ended = s.ended.entry(peer.clone()).or_default();
            match copied {
                Ok(()) => ended.done.push(tid),
                Err(e) => {
                    warn_write_failed(peer, &e);
                    ended.failed.push(tid);
                }
            }
            drop(s);
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

    fn take_news(&mut self, out: &mut Vec<PeerId>) -> bool {
        out.extend(lock(&self.shared).ended.keys().cloned());
        true
    }

    fn connect_metadata(
        &mut self,
        peer: &PeerId,
        challenge: Option<&[u8]>,
        advertised: &[u8],
    ) -> Vec<u8> {
        match AgentMetadata::decode(advertised) {
            Ok(mut meta) if meta.shm.is_some() => {
                meta.shm_token =
                    Some(trailer::token(&self.secret, peer.as_str(), challenge).to_vec());
                // A fresh epoch per `connect`: arms of this session are not an earlier one's.
                self.next_epoch = self.next_epoch.wrapping_add(1).max(1);
                self.epochs.insert(peer.clone(), self.next_epoch);
                meta.shm_epoch = Some(self.next_epoch);
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
