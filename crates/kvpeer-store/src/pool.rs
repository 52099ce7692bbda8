//! The pool's memory and its one owner: every `unsafe` that touches a pool's memory (the
//! node's own, and a proven peer's that the shm plane writes, [`Pool::map_peer`], under the
//! SIGBUS guard of [`crate::guard`]: a peer may shrink its own object at any time) lives in
//! this file and in `guard.rs`.
//!
//! The memory is either a POSIX shared-memory object the pool creates ([`Pool::shm`]:
//! `num_blocks × block_len` bytes of blocks, then the trailer holding the pool's secret, see
//! [`crate::trailer`], so that the `shm` plane can prove to a peer that this node owns the
//! object it names), or private anonymous memory the pool maps for planes no peer maps
//! ([`Pool::anonymous`]: tcp and nixl; 2 MiB-aligned and advised for transparent huge pages,
//! which `/dev/shm` objects do not get unless the kernel's `shmem_enabled` says so, and no
//! trailer: no peer opens it, so there is no ownership to prove), or memory an embedding
//! engine registered itself ([`Pool::external`]: a
//! base address and a row stride, block `i` at `base + i × stride`), or an engine's own mapping
//! of a shared-memory object the engine made ([`Pool::adopt_shm`]: vLLM's primary tier; the
//! trailer goes past the engine's blocks). The shm object is mapped once, here; the data planes never map it themselves. They get:
//!
//! * a [`PoolView`]: a cheap clone (a reference count) reading block `i` as `&[u8]`, and the
//!   addresses NIXL registers;
//! * a [`PoolWriter`], from the owner only: the permit table of writes peers may make into the
//!   pool. A writer obtains `&mut` bytes of a block only through a [`WriteClaim`], which proves
//!   the permits for exactly its blocks were granted to that peer and taken by this claim
//!   alone, so no two claims ever write the same block and nothing outside this file needs
//!   `unsafe` to write the pool.
//!
//! Shared memory so that a peer on the same host (the `shm` data plane, or a Python process
//! with `multiprocessing.shared_memory`) can map the same bytes by name and write blocks in
//! place. The object is created exclusively and unlinked when the [`Pool`] (the owner) is
//! dropped; the mapping itself lives until the last view or writer is gone, so a plane thread
//! still holding a view never reads unmapped memory.

use std::any::Any;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::ops::Deref;
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};

use kvpeer_core::BlockIndex;
use kvpeer_proto::PeerId;
use memmap2::MmapMut;
use nix::fcntl::{Flock, FlockArg, OFlag};
use nix::sys::mman::{mlock, shm_open, shm_unlink};
use nix::sys::stat::Mode;
use nix::unistd::ftruncate;
use tracing::{debug, info};

use crate::fence::OwnFence;
use crate::guard::GuardedRegion;
use crate::trailer::{self, SECRET_LEN};

/// Bytes of a transparent huge page on x86-64 and most arm64 kernels: where an anonymous pool
/// starts, and the unit its mapping is rounded to.
pub const HUGE_PAGE: usize = 2 << 20;

/// Why a pool could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolError {
    /// `num_blocks` or `block_len` is 0, or the pool's bytes overflow the address space.
    #[error("a pool of {num_blocks} blocks of {block_len} bytes is impossible")]
    BadSize {
        /// Blocks asked for.
        num_blocks: u64,
        /// Bytes per block asked for.
        block_len: u64,
    },
    /// External memory whose row stride is shorter than a block (blocks would overlap).
    #[error("a row stride of {stride} bytes is shorter than a block of {block_len}")]
    BadStride {
        /// Bytes per block.
        block_len: u64,
        /// Bytes from one block's start to the next.
        stride: u64,
    },
    /// The shared-memory object could not be created or sized.
    #[error("cannot create shared-memory object /{name}: {source}")]
    Create {
        /// Its name.
        name: String,
        /// The system's error.
        source: nix::Error,
    },
    /// Another live node's pool has the object's name (it holds the object's lock).
    #[error("cannot create shared-memory object /{name}: a live node holds it (its pool has that name); give this node another name (shm_name, --shm-name)")]
    InUse {
        /// Its name.
        name: String,
    },
    /// The object could not be mapped (or examined).
    #[error("cannot map shared-memory object /{name}: {source}")]
    Map {
        /// Its name.
        name: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// No randomness for the pool's secret.
    #[error("no randomness for the pool's secret: {0}")]
    Random(getrandom::Error),
    /// The pool's fence words could not be made ([`crate::fence`]).
    #[error("cannot make the pool's fence words: {0}")]
    Fence(Box<crate::fence::FenceError>),
    /// A peer's mapping could not be put under the SIGBUS guard.
    #[error("cannot guard the mapping of a peer's pool: {0}")]
    Guard(crate::guard::GuardError),
    /// An engine's shared-memory object that [`Pool::adopt_shm`] cannot serve.
    #[error("cannot serve shared-memory object /{name} with the shm plane: {why}")]
    NotAdoptable {
        /// Its name.
        name: String,
        /// Why not.
        why: String,
    },
    /// `mlock` failed (raise `ulimit -l`, or run without locking).
    #[error("cannot lock {bytes} bytes in memory: {source}")]
    Lock {
        /// Bytes to lock.
        bytes: usize,
        /// The system's error.
        source: nix::Error,
    },
}

/// Why a [`PoolWriter::claim`] was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ClaimError {
    /// A block index outside the pool.
    #[error("block {0} outside the pool")]
    Outside(BlockIndex),
    /// A block the holder has no outstanding permit for, or a block named twice.
    #[error("write into blocks {0:?} without a permit")]
    NotPermitted(Vec<BlockIndex>),
}

/// Why the owner may not write a block now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BlockBusy {
    /// Outside the pool.
    #[error("outside the pool")]
    Outside,
    /// Granted to a peer's write, or a peer's write is landing in it.
    #[error("a peer's write may land in it")]
    PeerWrite,
    /// A write to a peer may be reading it (the owner pinned it for a peer).
    #[error("a write to a peer may be reading it")]
    PeerRead,
    /// The caller's buffer is not one block long.
    #[error("{got} bytes for a block of {want}")]
    WrongLength {
        /// Bytes given.
        got: usize,
        /// The block's length.
        want: usize,
    },
}

/// The shared-memory object behind a [`Pool::shm`] pool: what the `shm` plane proves and
/// compares against, and the pool's fence words ([`crate::fence`]).
#[derive(Debug, Clone)]
pub struct ShmObject {
    name: String,
    secret: [u8; SECRET_LEN],
    file_id: (u64, u64),
    fence: std::sync::Arc<OwnFence>,
}

impl PartialEq for ShmObject {
    fn eq(&self, other: &Self) -> bool {
        (&self.name, &self.secret, self.file_id) == (&other.name, &other.secret, other.file_id)
    }
}

impl Eq for ShmObject {}

impl ShmObject {
    /// The object's name, as for `shm_open` without the leading `/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The pool's secret, as in its trailer: the key of the `shm` plane's ownership tokens.
    pub fn secret(&self) -> &[u8; SECRET_LEN] {
        &self.secret
    }

    /// `(st_dev, st_ino)` of the object: a peer naming this file names this node's own pool.
    pub fn file_id(&self) -> (u64, u64) {
        self.file_id
    }

    /// The pool's fence words: what the shm plane arms for a fetch and revokes at its end.
    pub fn fence(&self) -> &OwnFence {
        &self.fence
    }
}

/// Where the bytes come from; dropped (unmapped, or the keep-alive released) only with the
/// last view of the memory.
enum Backing {
    Shm {
        /// Never read through: `Memory::base` points into it. Kept to unmap on drop.
        _map: MmapMut,
        object: ShmObject,
        /// The object's exclusive lock, held while the pool lives: a later node tells a dead
        /// node's object (nobody holds its lock) from a live one's (`stale.rs`).
        _lock: Flock<File>,
    },
    /// Private anonymous memory ([`Pool::anonymous`]): the blocks start at the first 2 MiB
    /// boundary inside the mapping.
    Anon {
        /// Never read through: `Memory::base` points into it. Kept to unmap on drop.
        map: MmapMut,
        /// Bytes from the mapping's start to the first block.
        offset: usize,
    },
    External {
        /// Whatever the embedder wants released once the pool no longer uses the memory.
        _keep_alive: Option<Box<dyn Any + Send + Sync>>,
    },
    /// An engine's memory that is a shared-memory object the engine made and mapped
    /// ([`Pool::adopt_shm`]): the blocks are the engine's mapping, the trailer ours.
    Adopted {
        /// The trailer page, mapped apart from the blocks (never read through).
        _trailer: MmapMut,
        object: ShmObject,
        _keep_alive: Option<Box<dyn Any + Send + Sync>>,
    },
    /// A peer's pool object, mapped by the shm plane to write the blocks the peer names, under
    /// the SIGBUS guard (`guard`, dropped first: unregistered before the unmap).
    Peer { guard: GuardedRegion, _map: MmapMut },
}

/// Blocks handed to peers' writes: permits granted per peer, and blocks a claim is writing.
#[derive(Debug, Default)]
struct Permits {
    granted: HashMap<PeerId, HashSet<BlockIndex>>,
    claimed: HashSet<BlockIndex>,
}

/// The pool's bytes, shared by the owner, its views and writers.
struct Memory {
    base: NonNull<u8>,
    num_blocks: u64,
    block_len: usize,
    stride: usize,
    /// Bytes from the first block's start to the last block's end.
    span: usize,
    backing: Backing,
    permits: Mutex<Permits>,
}

// SAFETY: `Memory` is a pointer to bytes plus bookkeeping behind a mutex. The bytes are valid
// from any thread (a mapping of this process, shared or anonymous, or external memory whose
// creator promised so), and every
// access goes through the rules of this file: reads of whole blocks, and writes only by the
// owner (`&mut Pool`, refusing blocks peers may write) or by the one claim holding a block.
unsafe impl Send for Memory {}
// SAFETY: as for `Send`: `&Memory` only reads the pointer and locks the mutex; writes through
// the pointer are made exclusive by `WriteClaim` and `Pool::block_mut`.
unsafe impl Sync for Memory {}

impl Memory {
    /// Offset of `block`'s first byte from `base`, if it is in the pool. `offset + block_len`
    /// is then at most `span`: `(num_blocks - 1) × stride + block_len`.
    fn offset(&self, block: BlockIndex) -> Option<usize> {
        if block.get() >= self.num_blocks {
            return None;
        }
        usize::try_from(block.get()).ok()?.checked_mul(self.stride)
    }

    fn permits(&self) -> MutexGuard<'_, Permits> {
        // A poisoned lock only means a thread panicked while holding it; the sets stay valid.
        self.permits.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn block(&self, block: BlockIndex) -> Option<&[u8]> {
        let offset = self.offset(block)?;
        // SAFETY: `offset..offset + block_len` lies inside the `span` bytes at `base`
        // (`offset`), which stay valid as long as `self` (the shm mapping lives in `backing`;
        // external memory by its creator's promise), and `span <= isize::MAX` (checked when
        // the pool was made). Bytes have no invalid values. In this process the bytes of a
        // block change only through a claim or the owner's `block_mut`, and the node reads
        // only blocks a store job pins, which it never grants to a write; another process
        // (a peer on the shm plane, NIXL) writes only blocks this node reserved for it.
        Some(unsafe { std::slice::from_raw_parts(self.base.as_ptr().add(offset), self.block_len) })
    }

    /// `&mut` bytes of `block`. Callers make sure nothing else in this process reads or
    /// writes the block while the slice lives (a claim, or the owner's checks).
    #[allow(clippy::mut_from_ref)]
    fn block_mut(&self, block: BlockIndex) -> Option<&mut [u8]> {
        let offset = self.offset(block)?;
        // SAFETY: in bounds and valid as in `block`; exclusive by the caller's duty above
        // (blocks are disjoint: `stride >= block_len`).
        Some(unsafe {
            std::slice::from_raw_parts_mut(self.base.as_ptr().add(offset), self.block_len)
        })
    }
}

impl std::fmt::Debug for Memory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shm = match &self.backing {
            Backing::Shm { object, .. } | Backing::Adopted { object, .. } => {
                Some(object.name.as_str())
            }
            Backing::Anon { .. } | Backing::External { .. } | Backing::Peer { .. } => None,
        };
        f.debug_struct("Memory")
            .field("base", &self.base)
            .field("num_blocks", &self.num_blocks)
            .field("block_len", &self.block_len)
            .field("stride", &self.stride)
            .field("shm", &shm)
            .finish()
    }
}

/// A read view of the pool: cheap to clone, keeps the memory alive.
#[derive(Debug, Clone)]
pub struct PoolView {
    mem: Arc<Memory>,
}

impl PoolView {
    /// Address of the first block's first byte (what `connect` advertises as `base_addr`).
    pub fn base_addr(&self) -> u64 {
        self.mem.base.as_ptr() as u64
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> u64 {
        self.mem.num_blocks
    }

    /// Bytes per block.
    pub fn block_len(&self) -> u64 {
        self.mem.block_len as u64
    }

    /// Bytes from one block's start to the next (`block_len` for a shm pool).
    pub fn stride(&self) -> u64 {
        self.mem.stride as u64
    }

    /// Bytes from the first block's start to the last block's end: what NIXL registers.
    pub fn span_len(&self) -> u64 {
        self.mem.span as u64
    }

    /// The shared-memory object, for a [`Pool::shm`] pool (or an adopted one); `None` for
    /// anonymous or external memory.
    pub fn shm(&self) -> Option<&ShmObject> {
        match &self.mem.backing {
            Backing::Shm { object, .. } | Backing::Adopted { object, .. } => Some(object),
            Backing::Anon { .. } | Backing::External { .. } | Backing::Peer { .. } => None,
        }
    }

    /// The shm object's name, if the pool is one.
    pub fn shm_name(&self) -> Option<&str> {
        self.shm().map(ShmObject::name)
    }

    /// The bytes of one block; `None` outside the pool. Read only blocks nothing writes: the
    /// node reads blocks a store job pins (and never grants a pinned block to a write).
    pub fn block(&self, block: BlockIndex) -> Option<&[u8]> {
        self.mem.block(block)
    }
}

/// The permits of peers' writes into the pool, and the only way to write it outside the
/// owner: cheap to clone, shares one permit table per pool.
#[derive(Debug, Clone)]
pub struct PoolWriter {
    mem: Arc<Memory>,
}

impl PoolWriter {
    /// A read view of the same pool.
    pub fn view(&self) -> PoolView {
        PoolView {
            mem: self.mem.clone(),
        }
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> u64 {
        self.mem.num_blocks
    }

    /// Permits `holder` to write `blocks` (once each), e.g. the destinations of a fetch sent
    /// to it.
    pub fn grant(&self, holder: &PeerId, blocks: &[BlockIndex]) {
        if blocks.is_empty() {
            return;
        }
        self.mem
            .permits()
            .granted
            .entry(holder.clone())
            .or_default()
            .extend(blocks.iter().copied());
    }

    /// Withdraws `holder`'s unused permits for `blocks` (a claim already taken stays valid).
    pub fn revoke(&self, holder: &PeerId, blocks: &[BlockIndex]) {
        let mut p = self.mem.permits();
        if let Some(set) = p.granted.get_mut(holder) {
            for b in blocks {
                set.remove(b);
            }
            if set.is_empty() {
                p.granted.remove(holder);
            }
        }
    }

    /// Whether no claim is writing any of `blocks` now: a revoked permit can no longer be
    /// taken, so once this is true after [`PoolWriter::revoke`] no byte of a peer's write can
    /// land in them (the fence a failed load waits for before its blocks are reused).
    pub fn unclaimed(&self, blocks: &[BlockIndex]) -> bool {
        let p = self.mem.permits();
        !blocks.iter().any(|b| p.claimed.contains(b))
    }

    /// Withdraws all of `holder`'s unused permits.
    pub fn revoke_all(&self, holder: &PeerId) {
        self.mem.permits().granted.remove(holder);
    }

    /// Takes `holder`'s permits for exactly `blocks` (all or nothing): each must be inside the
    /// pool, named once, permitted to `holder` and not being written by another claim. The
    /// permits are used up; the claim writes the blocks until it is dropped.
    pub fn claim(&self, holder: &PeerId, blocks: &[BlockIndex]) -> Result<WriteClaim, ClaimError> {
        if let Some(&b) = blocks.iter().find(|b| b.get() >= self.mem.num_blocks) {
            return Err(ClaimError::Outside(b));
        }
        let mut p = self.mem.permits();
        let Permits { granted, claimed } = &mut *p;
        let mut seen = HashSet::with_capacity(blocks.len());
        let ok = match granted.get_mut(holder) {
            Some(set) => blocks
                .iter()
                .all(|b| set.contains(b) && !claimed.contains(b) && seen.insert(*b)),
            None => false,
        };
        let Some(set) = granted.get_mut(holder).filter(|_| ok) else {
            return Err(ClaimError::NotPermitted(blocks.to_vec()));
        };
        for b in blocks {
            set.remove(b);
            claimed.insert(*b);
        }
        if set.is_empty() {
            granted.remove(holder);
        }
        Ok(WriteClaim {
            mem: self.mem.clone(),
            blocks: blocks.to_vec(),
        })
    }
}

/// Proof that permits for exactly [`WriteClaim::blocks`] were granted and taken by this claim
/// alone: the one way to write those blocks outside the owner. Dropping it ends the write.
#[derive(Debug)]
pub struct WriteClaim {
    mem: Arc<Memory>,
    /// Distinct, inside the pool, and in `Permits::claimed` while the claim lives.
    blocks: Vec<BlockIndex>,
}

impl WriteClaim {
    /// The claimed blocks, in the order claimed.
    pub fn blocks(&self) -> &[BlockIndex] {
        &self.blocks
    }

    /// The bytes of the `nth` claimed block, to write.
    pub fn block_mut(&mut self, nth: usize) -> Option<&mut [u8]> {
        let block = *self.blocks.get(nth)?;
        // Exclusive: the block is in `claimed` for this claim only (`claim` refuses a block
        // another claim holds, and the owner's `block_mut` refuses claimed blocks), and the
        // slice borrows `self` mutably, so one claim hands out one slice at a time.
        self.mem.block_mut(block)
    }
}

impl Drop for WriteClaim {
    fn drop(&mut self) {
        let mut p = self.mem.permits();
        for b in &self.blocks {
            p.claimed.remove(b);
        }
    }
}

/// The owner of the pool's memory (the block store holds it). Derefs to its [`PoolView`];
/// hands out [`PoolWriter`]s. Dropping it unlinks the shm object's name (peers that mapped it
/// keep their mapping until they unmap); the memory itself goes with the last view.
#[derive(Debug)]
pub struct Pool {
    view: PoolView,
}

impl Pool {
    /// Creates `/name` with room for `num_blocks × block_len` bytes, zeroed, and the trailer
    /// (a fresh secret), and maps it, pre-faulted and, with `lock`, locked in memory.
    pub fn shm(name: &str, num_blocks: u64, block_len: u64, lock: bool) -> Result<Self, PoolError> {
        let bad = || PoolError::BadSize {
            num_blocks,
            block_len,
        };
        let (span, block_bytes) = contiguous(num_blocks, block_len)?;
        let bytes = trailer::object_len(num_blocks, block_len).ok_or_else(bad)?;
        let size = i64::try_from(bytes).map_err(|_| bad())?;
        let len = usize::try_from(bytes).map_err(|_| bad())?;
        let secret = trailer::new_secret().map_err(PoolError::Random)?;
        let path = format!("/{name}");
        let create = |source| PoolError::Create {
            name: name.to_owned(),
            source,
        };
        let map_err = |source| PoolError::Map {
            name: name.to_owned(),
            source,
        };
        let open = || {
            shm_open(
                path.as_str(),
                OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
                Mode::S_IRUSR | Mode::S_IWUSR,
            )
        };
        let fd = match open() {
            Ok(fd) => fd,
            // A dead node's object under this name (a restart after SIGKILL, PID 1 again in a
            // container): removed, and the name taken.
            Err(nix::errno::Errno::EEXIST) if crate::stale::remove_if_stale(name) => {
                debug!(name, "removed a dead node's object of the same name");
                open().map_err(create)?
            }
            Err(nix::errno::Errno::EEXIST) => {
                return Err(PoolError::InUse {
                    name: name.to_owned(),
                })
            }
            Err(e) => return Err(create(e)),
        };
        // From here on the object exists: unlink it on any failure.
        let cleanup = |e: PoolError| {
            let _ = shm_unlink(path.as_str());
            e
        };
        // Taken at once, before the object has a size: a node scanning for dead nodes'
        // objects never sees this one unlocked while its process lives.
        let file = Flock::lock(File::from(fd), FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| cleanup(create(e)))?;
        ftruncate(&*file, size).map_err(|e| cleanup(create(e)))?;
        let stat = file.metadata().map_err(|e| cleanup(map_err(e)))?;
        // SAFETY: the object was just created exclusively (O_EXCL) with mode 0600 and sized to
        // `len`; only this process and peers the data planes deliberately let write blocks map
        // it. The map is only ever accessed through this file's rules (see `Memory`).
        let mut map = unsafe { MmapMut::map_mut(&*file) }.map_err(|e| cleanup(map_err(e)))?;
        let head = trailer::encode(&secret);
        match map.get_mut(span..span + head.len()) {
            Some(dst) => dst.copy_from_slice(&head),
            // The object was sized to hold the trailer just above.
            None => return Err(cleanup(bad())),
        }
        // Allocate every page now, not on a transfer's first touch: a fresh page costs a fault
        // and a zeroing, which made a first 128 MiB fetch several times slower than the copy
        // itself. This is the only mapping of the pool in the process, so the planes share
        // these page-table entries. Best effort: kernels before 5.14 refuse the advice.
        if let Err(e) = map.advise(memmap2::Advice::PopulateWrite) {
            debug!(name, error = %e, "could not pre-fault the pool; pages fault in on first use");
        }
        let Some(base) = NonNull::new(map.as_mut_ptr()) else {
            return Err(cleanup(bad()));
        };
        if lock {
            // SAFETY: `base`/`len` describe exactly our live mapping.
            unsafe { mlock(base.cast(), len) }
                .map_err(|source| cleanup(PoolError::Lock { bytes: len, source }))?;
        }
        let fence = OwnFence::create(name, num_blocks)
            .map_err(|e| cleanup(PoolError::Fence(Box::new(e))))?;
        let object = ShmObject {
            name: name.to_owned(),
            secret,
            file_id: (stat.dev(), stat.ino()),
            fence: std::sync::Arc::new(fence),
        };
        let backing = Backing::Shm {
            _map: map,
            object,
            _lock: file,
        };
        Ok(Pool::from_parts(
            base,
            num_blocks,
            (block_bytes, block_bytes),
            span,
            backing,
        ))
    }

    /// Private anonymous memory for `num_blocks × block_len` bytes, zeroed, for a node whose
    /// planes never let a peer map the pool (tcp, nixl): no shared-memory object and no trailer
    /// (the trailer's secret proves ownership of an object a peer opens; here there is none,
    /// and [`PoolView::shm`] is `None`, so the shm plane refuses the pool). The blocks start on
    /// a 2 MiB boundary and the mapping is advised for transparent huge pages
    /// (`MADV_HUGEPAGE`: the kernel backs it with 2 MiB pages when
    /// `/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` or `always`), then
    /// pre-faulted and, with `lock`, locked in memory. Fewer, larger pages make NIXL/UCX
    /// transfers and the tcp plane's copies cheaper than over a `/dev/shm` object, which gets
    /// huge pages only if `shmem_enabled` allows. Huge pages are best effort: without them the
    /// pool works on 4 KiB pages.
    pub fn anonymous(num_blocks: u64, block_len: u64, lock: bool) -> Result<Self, PoolError> {
        Self::anonymous_with(num_blocks, block_len, lock, true)
    }

    /// [`Pool::anonymous`] without the pre-fault: no page is touched until a block is written
    /// (a node whose disk tier holds what it serves starts at once, whatever its size).
    pub fn anonymous_lazy(num_blocks: u64, block_len: u64) -> Result<Self, PoolError> {
        Self::anonymous_with(num_blocks, block_len, false, false)
    }

    fn anonymous_with(
        num_blocks: u64,
        block_len: u64,
        lock: bool,
        populate: bool,
    ) -> Result<Self, PoolError> {
        let bad = || PoolError::BadSize {
            num_blocks,
            block_len,
        };
        let (span, block_bytes) = contiguous(num_blocks, block_len)?;
        // Room to start the blocks on a huge-page boundary and to end the last huge page
        // inside the mapping (a huge page needs its whole 2 MiB inside one mapping).
        let len = span
            .checked_next_multiple_of(HUGE_PAGE)
            .and_then(|l| l.checked_add(HUGE_PAGE))
            .filter(|l| isize::try_from(*l).is_ok())
            .ok_or_else(bad)?;
        let map_err = |source| PoolError::Map {
            name: "(anonymous)".into(),
            source,
        };
        let mut map = memmap2::MmapOptions::new()
            .len(len)
            .map_anon()
            .map_err(map_err)?;
        let start = map.as_ptr() as usize;
        let offset = start.next_multiple_of(HUGE_PAGE) - start;
        // `offset < HUGE_PAGE` and `len >= span + HUGE_PAGE`: the blocks are inside the map.
        let huge = map.advise_range(memmap2::Advice::HugePage, offset, len - offset);
        if let Err(e) = huge {
            debug!(error = %e, "no transparent huge pages for the pool; 4 KiB pages");
        }
        // As for a shm pool: every page now, not on a transfer's first touch.
        if populate {
            if let Err(e) = map.advise_range(memmap2::Advice::PopulateWrite, offset, span) {
                debug!(error = %e, "could not pre-fault the pool; pages fault in on first use");
            }
        }
        let Some(base) = map
            .get_mut(offset..)
            .and_then(|b| NonNull::new(b.as_mut_ptr()))
        else {
            return Err(bad());
        };
        if lock {
            // SAFETY: `base`/`span` lie inside our live mapping.
            unsafe { mlock(base.cast(), span) }.map_err(|source| PoolError::Lock {
                bytes: span,
                source,
            })?;
        }
        if let Some(usage) = crate::proc_maps::usage_at(base.as_ptr() as u64) {
            match usage.check_huge_pages(crate::proc_maps::thp_mode().as_deref()) {
                Ok(()) => debug!(huge_kb = usage.anon_huge_kb, "pool in huge pages"),
                Err(why) => info!(%why, "the pool is not in huge pages; transfers run slower"),
            }
        }
        Ok(Pool::from_parts(
            base,
            num_blocks,
            (block_bytes, block_bytes),
            span,
            Backing::Anon { map, offset },
        ))
    }

    /// A pool over memory this node does not own: `num_blocks` blocks of `block_len` bytes,
    /// block `i` at `base + i × stride` (an engine's registered KV region; the bytes between
    /// blocks are never touched). `keep_alive` is dropped once nothing uses the memory any
    /// more (the owner, every view and writer; plane threads may hold views a little after
    /// their plane is dropped), so it can own the memory itself. The shm plane cannot serve
    /// such a pool (it has no named object); the tcp and nixl planes can.
    ///
    /// # Safety
    ///
    /// The caller guarantees that the `(num_blocks - 1) × stride + block_len` bytes at `base`
    ///
    /// * are valid for reads and writes from any thread until `keep_alive` is dropped (or,
    ///   without one, for the rest of the process): not freed, unmapped or remapped;
    /// * are not accessed through Rust references elsewhere while the pool uses them (raw
    ///   pointer access, DMA and other processes writing blocks the node reserved for them,
    ///   as peers do in a shm pool, are fine).
    pub unsafe fn external(
        base: NonNull<u8>,
        num_blocks: u64,
        block_len: u64,
        stride: u64,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<Self, PoolError> {
        let bad = || PoolError::BadSize {
            num_blocks,
            block_len,
        };
        if num_blocks == 0 || block_len == 0 {
            return Err(bad());
        }
        if stride < block_len {
            return Err(PoolError::BadStride { block_len, stride });
        }
        let span = (num_blocks - 1)
            .checked_mul(stride)
            .and_then(|s| s.checked_add(block_len))
            .and_then(|s| usize::try_from(s).ok())
            .filter(|s| isize::try_from(*s).is_ok())
            .filter(|s| (base.as_ptr() as usize).checked_add(*s).is_some())
            .ok_or_else(bad)?;
        let (block_len, stride) = match (usize::try_from(block_len), usize::try_from(stride)) {
            (Ok(b), Ok(s)) => (b, s),
            _ => return Err(bad()),
        };
        let backing = Backing::External {
            _keep_alive: keep_alive,
        };
        Ok(Pool::from_parts(
            base,
            num_blocks,
            (block_len, stride),
            span,
            backing,
        ))
    }

    /// A pool over an engine's memory that is the engine's own mapping of the shared-memory
    /// object `/dev/shm/<name>` (vLLM's primary tier), so the `shm` plane can serve it: block
    /// `i` at `base + i × block_len`, as the object's bytes from offset 0. The object must hold
    /// exactly the blocks (or the blocks and a trailer a kvpeer pool left); it is grown by one
    /// page, the trailer, where a fresh secret goes (mapped apart: the engine's mapping is not
    /// touched beyond the blocks). `base` must be a shared, writable mapping of that very
    /// object over all the blocks (checked in `/proc/self/maps`); otherwise, or for a block
    /// length that is not a whole number of pages, it is refused. Dropping the pool leaves the
    /// object (the engine's) and its trailer.
    ///
    /// # Safety
    ///
    /// As [`Pool::external`]: the engine's mapping at `base` stays mapped until `keep_alive`
    /// is dropped, and is not accessed through Rust references elsewhere meanwhile.
    pub unsafe fn adopt_shm(
        name: &str,
        base: NonNull<u8>,
        num_blocks: u64,
        block_len: u64,
        keep_alive: Option<Box<dyn Any + Send + Sync>>,
    ) -> Result<Self, PoolError> {
        let (span, block_bytes) = contiguous(num_blocks, block_len)?;
        let refuse = |why: String| PoolError::NotAdoptable {
            name: name.to_owned(),
            why,
        };
        let page = 4096u64;
        if !block_len.is_multiple_of(page) {
            return Err(refuse(format!(
                "a block of {block_len} bytes is not whole pages"
            )));
        }
        let path = format!("/{name}");
        let fd = shm_open(path.as_str(), OFlag::O_RDWR, Mode::empty())
            .map_err(|e| refuse(format!("cannot open it: {e}")))?;
        let file = File::from(fd);
        let stat = file
            .metadata()
            .map_err(|e| refuse(format!("cannot examine it: {e}")))?;
        let blocks_len = span as u64;
        let with_trailer =
            trailer::object_len(num_blocks, block_len).ok_or_else(|| refuse("too large".into()))?;
        if stat.len() != blocks_len && stat.len() != with_trailer {
            return Err(refuse(format!(
                "it holds {} bytes, not {num_blocks} blocks of {block_len}",
                stat.len()
            )));
        }
        match crate::proc_maps::shared_file_at(base.as_ptr() as u64, blocks_len) {
            Some(m) if m.inode == stat.ino() && m.offset == 0 => {}
            _ => {
                return Err(refuse(
                    "the engine's memory is not a shared mapping of it from its start".into(),
                ))
            }
        }
        if stat.len() == blocks_len {
            let size = i64::try_from(with_trailer).map_err(|_| refuse("too large".into()))?;
            ftruncate(&file, size).map_err(|e| refuse(format!("cannot add the trailer: {e}")))?;
        }
        let secret = trailer::new_secret().map_err(PoolError::Random)?;
        // SAFETY: the trailer page past the engine's blocks, which this pool just added (or
        // which a kvpeer pool added before): the engine maps only the blocks, so nothing else
        // in this process reaches these bytes; a peer only ever reads them (the `shm` plane's
        // ownership check). The map is only written here, once.
        let mut trailer_map = unsafe {
            memmap2::MmapOptions::new()
                .offset(blocks_len)
                .len(trailer::TRAILER_LEN as usize)
                .map_mut(&file)
        }
        .map_err(|e| refuse(format!("cannot map its trailer: {e}")))?;
        let head = trailer::encode(&secret);
        trailer_map[..head.len()].copy_from_slice(&head);
        trailer_map[head.len()..].fill(0);
        // The words are ours (the engine's object is not): made fresh, gone with the pool.
        let fence = OwnFence::create(name, num_blocks)
            .map_err(|e| refuse(format!("cannot create its fence words: {e}")))?;
        let object = ShmObject {
            name: name.to_owned(),
            secret,
            file_id: (stat.dev(), stat.ino()),
            fence: std::sync::Arc::new(fence),
        };
        Ok(Pool::from_parts(
            base,
            num_blocks,
            (block_bytes, block_bytes),
            span,
            Backing::Adopted {
                _trailer: trailer_map,
                object,
                _keep_alive: keep_alive,
            },
        ))
    }

    /// Maps the blocks (not the trailer) of a peer's pool object `file`, `num_blocks` of
    /// `block_len` bytes, to write the blocks the peer names in its fetches, under the SIGBUS
    /// guard ([`crate::guard`]): a peer that shrinks its object later makes our next store into
    /// it land in private memory and [`Pool::peer_faulted`] say so, instead of killing the
    /// node. Only for an object already proven to be that peer's pool of exactly that size
    /// (the shm plane checks owner, size, trailer and token first). Nothing is pre-faulted: a
    /// page is touched only when a fetch writes it (a sparse object costs nothing until then).
    /// Dropping it unmaps; the object is the peer's and stays.
    pub fn map_peer(file: &File, num_blocks: u64, block_len: u64) -> Result<Self, PoolError> {
        let (span, block_bytes) = contiguous(num_blocks, block_len)?;
        // SAFETY: the peer's pool, shared with it by design and proven to be its own by the
        // caller; only its blocks are mapped, at a length the object held when proven. This
        // node writes only blocks the peer named in a fetch (reserved by the peer for this
        // write) and never reads the mapping. A peer that shrinks its own object afterwards
        // makes a store fault: the guard registered below turns that fault into a flag.
        let mut map =
            unsafe { memmap2::MmapOptions::new().len(span).map_mut(file) }.map_err(|source| {
                PoolError::Map {
                    name: "(a peer's pool)".into(),
                    source,
                }
            })?;
        let base = NonNull::new(map.as_mut_ptr()).ok_or(PoolError::BadSize {
            num_blocks,
            block_len,
        })?;
        let guard = GuardedRegion::register(base.as_ptr(), span).map_err(PoolError::Guard)?;
        Ok(Pool::from_parts(
            base,
            num_blocks,
            (block_bytes, block_bytes),
            span,
            Backing::Peer { guard, _map: map },
        ))
    }

    /// For a peer's pool ([`Pool::map_peer`]): whether a store into it faulted since it was
    /// mapped (the peer shrank its object); `false` for every other pool.
    pub fn peer_faulted(&self) -> bool {
        matches!(&self.view.mem.backing, Backing::Peer { guard, .. } if guard.faulted())
    }

    /// Fills the page-table entries of a mapped pool for writing (`MADV_POPULATE_WRITE`), so
    /// no copy pays page faults; without touching the bytes, so it is safe while others write
    /// them. External memory is the embedder's: nothing is done.
    pub fn populate_write(&self) -> std::io::Result<()> {
        match &self.view.mem.backing {
            Backing::Shm { _map: map, .. } => map.advise(memmap2::Advice::PopulateWrite),
            Backing::Anon { map, offset } => {
                map.advise_range(memmap2::Advice::PopulateWrite, *offset, self.view.mem.span)
            }
            // A peer's object is the peer's: never pre-faulted (a sparse one would be
            // allocated whole, charged to this node).
            Backing::External { .. } | Backing::Adopted { .. } | Backing::Peer { .. } => Ok(()),
        }
    }

    /// A pool of `num_blocks` blocks at `base`, `(block_len, stride)` bytes, `span` bytes in
    /// all (`(num_blocks - 1) × stride + block_len`, at most `isize::MAX`).
    fn from_parts(
        base: NonNull<u8>,
        num_blocks: u64,
        (block_len, stride): (usize, usize),
        span: usize,
        backing: Backing,
    ) -> Self {
        let mem = Memory {
            base,
            num_blocks,
            block_len,
            stride,
            span,
            backing,
            permits: Mutex::default(),
        };
        Pool {
            view: PoolView { mem: Arc::new(mem) },
        }
    }

    /// A read view (clone it to keep one).
    pub fn view(&self) -> &PoolView {
        &self.view
    }

    /// A writer of peers' permitted writes into this pool (all writers share one permit table).
    pub fn writer(&self) -> PoolWriter {
        PoolWriter {
            mem: self.view.mem.clone(),
        }
    }

    /// The bytes of one block, for the owner to read: refused while a peer holds a permit for
    /// the block or is writing it. (The owner grants permits; while it borrows the block none
    /// can be granted by it, so the answer holds for the borrow.)
    pub fn quiet_block(&self, block: BlockIndex) -> Result<&[u8], BlockBusy> {
        self.no_peer_writes(block)?;
        self.view.block(block).ok_or(BlockBusy::Outside)
    }

    /// `Ok` if `block` is in the pool and no peer holds a permit for it or is writing it.
    fn no_peer_writes(&self, block: BlockIndex) -> Result<(), BlockBusy> {
        let mem = &self.view.mem;
        if mem.offset(block).is_none() {
            return Err(BlockBusy::Outside);
        }
        let p = mem.permits();
        if p.claimed.contains(&block) || p.granted.values().any(|s| s.contains(&block)) {
            return Err(BlockBusy::PeerWrite);
        }
        Ok(())
    }

    /// The bytes of one block, for the owner to write: refused while a peer holds a permit for
    /// the block or is writing it.
    pub fn block_mut(&mut self, block: BlockIndex) -> Result<&mut [u8], BlockBusy> {
        self.no_peer_writes(block)?;
        let mem = &self.view.mem;
        // Exclusive in this process: the owner is borrowed mutably for the slice's life, no
        // claim holds the block and no permit for it is outstanding (a claim needs one; the
        // node grants permits only for blocks of its own fetches, from the thread that holds
        // the store, so none can be granted while the store is borrowed here).
        mem.block_mut(block).ok_or(BlockBusy::Outside)
    }
}

/// Bytes of `num_blocks` blocks of `block_len` laid end to end (at most `isize::MAX`, as a
/// slice needs), and of one block; `BadSize` when there are none or they do not fit.
fn contiguous(num_blocks: u64, block_len: u64) -> Result<(usize, usize), PoolError> {
    let bad = || PoolError::BadSize {
        num_blocks,
        block_len,
    };
    let span = num_blocks
        .checked_mul(block_len)
        .filter(|b| *b > 0)
        .and_then(|b| usize::try_from(b).ok())
        .filter(|b| isize::try_from(*b).is_ok())
        .ok_or_else(bad)?;
    let block = usize::try_from(block_len).map_err(|_| bad())?;
    Ok((span, block))
}

impl Deref for Pool {
    type Target = PoolView;

    fn deref(&self) -> &PoolView {
        &self.view
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // Only an object this pool created goes; an adopted one is the engine's.
        if let Backing::Shm { object, .. } = &self.view.mem.backing {
            let _ = shm_unlink(format!("/{}", object.name).as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::proc_maps as maps;

    fn blk(i: u64) -> BlockIndex {
        BlockIndex::new(i)
    }

    fn bs(indexes: &[u64]) -> Vec<BlockIndex> {
        indexes.iter().map(|&i| blk(i)).collect()
    }

    fn unique(tag: &str) -> String {
        format!("kvpeer-test-{tag}-{}", std::process::id())
    }

    #[test]
    fn blocks_are_separate_and_the_object_is_unlinked_on_drop() {
        let name = unique("region");
        let mut r = Pool::shm(&name, 4, 4096, false).unwrap();
        assert_eq!(r.base_addr() % 4096, 0, "page-aligned");
        r.block_mut(blk(2)).unwrap().fill(7);
        assert!(r.block(blk(1)).unwrap().iter().all(|b| *b == 0));
        assert!(r.block(blk(2)).unwrap().iter().all(|b| *b == 7));
        assert!(r.block(blk(4)).is_none());
        assert_eq!(r.block_mut(blk(4)), Err(BlockBusy::Outside));
        // The trailer follows the blocks: magic and the secret, then zeros.
        let len = std::fs::metadata(format!("/dev/shm/{name}")).unwrap().len();
        assert_eq!(len, 4 * 4096 + trailer::TRAILER_LEN);
        let raw = std::fs::read(format!("/dev/shm/{name}")).unwrap();
        let secret = *r.shm().unwrap().secret();
        assert_eq!(trailer::parse_trailer(&raw[4 * 4096..]), Ok(secret));
        assert!(raw[4 * 4096 + 40..].iter().all(|b| *b == 0));
        assert_ne!(secret, [0; 32]);
        assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
        // A view outlives the owner: the name goes with the owner, the bytes with the view.
        let view = r.view().clone();
        drop(r);
        assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
        assert!(view.block(blk(2)).unwrap().iter().all(|b| *b == 7));
    }

    #[test]
    fn an_engines_shm_object_is_adopted_with_a_trailer_and_left_on_drop() {
        // The engine makes and maps its object (as vLLM does its primary tier).
        let name = unique("adopt");
        let path = format!("/dev/shm/{name}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        file.set_len(4 * 4096).unwrap();
        // SAFETY: this test's own object, mapped for the test's length.
        let mut engine_map = unsafe { MmapMut::map_mut(&file) }.unwrap();
        engine_map[4096..8192].fill(9);
        let base = NonNull::new(engine_map.as_mut_ptr()).unwrap();
        // SAFETY: `engine_map` outlives the pool (dropped at the end of the test).
        let pool = unsafe { Pool::adopt_shm(&name, base, 4, 4096, None) }.unwrap();
        assert_eq!(pool.shm_name(), Some(name.as_str()));
        assert!(
            pool.block(blk(1)).unwrap().iter().all(|b| *b == 9),
            "the engine's bytes"
        );
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(raw.len() as u64, 4 * 4096 + trailer::TRAILER_LEN);
        assert_eq!(
            trailer::parse_trailer(&raw[4 * 4096..]),
            Ok(*pool.shm().unwrap().secret())
        );
        drop(pool);
        assert!(
            std::path::Path::new(&path).exists(),
            "the engine's object stays"
        );
        // Adopted again (the trailer is there now): a new secret.
        // SAFETY: as above.
        let again = unsafe { Pool::adopt_shm(&name, base, 4, 4096, None) }.unwrap();
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(
            trailer::parse_trailer(&raw[4 * 4096..]),
            Ok(*again.shm().unwrap().secret())
        );
        drop(again);
        // Memory that is not a mapping of the object, or the wrong size, is refused.
        let mut other = vec![0u8; 4 * 4096];
        let elsewhere = NonNull::new(other.as_mut_ptr()).unwrap();
        // SAFETY: `other` outlives the attempt.
        let refused = unsafe { Pool::adopt_shm(&name, elsewhere, 4, 4096, None) };
        assert!(
            matches!(refused, Err(PoolError::NotAdoptable { .. })),
            "{refused:?}"
        );
        // SAFETY: as above.
        let refused = unsafe { Pool::adopt_shm(&name, base, 3, 4096, None) };
        assert!(
            matches!(refused, Err(PoolError::NotAdoptable { .. })),
            "{refused:?}"
        );
        drop(engine_map);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn an_anonymous_pool_is_private_huge_page_aligned_and_advised_for_huge_pages() {
        // 3 blocks of 1 MiB: the last huge page is half used and must still be in the mapping.
        let mut pool = Pool::anonymous(3, 1 << 20, false).unwrap();
        assert_eq!(pool.base_addr() % HUGE_PAGE as u64, 0, "2 MiB-aligned");
        assert!(pool.shm().is_none(), "no object: the shm plane refuses it");
        assert_eq!((pool.span_len(), pool.stride()), (3 << 20, 1 << 20));
        assert!(
            pool.block(blk(2)).unwrap().iter().all(|b| *b == 0),
            "zeroed"
        );
        pool.block_mut(blk(1)).unwrap().fill(5);
        assert!(pool.block(blk(1)).unwrap().iter().all(|b| *b == 5));
        pool.populate_write().unwrap();
        let usage = maps::usage_at(pool.base_addr()).unwrap();
        assert!(
            usage.path.is_empty() && usage.inode == 0 && !usage.shared,
            "private anonymous memory: {usage:?}"
        );
        // What the kernel is configured to do decides what must be seen, never a skip: with
        // THP compiled in, the advice is always recorded (`hg`); with THP on for advised
        // memory, the pre-faulted blocks are in huge pages.
        let mode = maps::thp_mode();
        if let Err(why) = usage.check_huge_pages(mode.as_deref()) {
            panic!("THP {mode:?}: {why}: {usage:?}");
        }
        // The memory outlives the owner with its last view, as a shm pool's.
        let view = pool.view().clone();
        drop(pool);
        assert!(view.block(blk(1)).unwrap().iter().all(|b| *b == 5));
    }

    #[test]
    fn a_shm_pool_stays_a_shared_object() {
        let pool = Pool::shm(&unique("shared"), 2, 1 << 20, false).unwrap();
        let usage = maps::usage_at(pool.base_addr()).unwrap();
        assert!(
            usage.shared && usage.path.starts_with("/dev/shm/"),
            "{usage:?}"
        );
    }

    #[test]
    fn a_name_in_use_or_a_zero_size_is_refused() {
        let name = unique("dup");
        let _r = Pool::shm(&name, 1, 4096, false).unwrap();
        assert!(matches!(
            Pool::shm(&name, 1, 4096, false),
            Err(PoolError::InUse { .. })
        ));
        assert!(matches!(
            Pool::shm(&unique("zero"), 0, 4096, false),
            Err(PoolError::BadSize { .. })
        ));
        assert!(matches!(
            Pool::shm(&unique("big"), u64::MAX, 2, false),
            Err(PoolError::BadSize { .. })
        ));
        assert!(matches!(
            Pool::anonymous(0, 4096, false),
            Err(PoolError::BadSize { .. })
        ));
        assert!(matches!(
            Pool::anonymous(u64::MAX / 2, 2, false),
            Err(PoolError::BadSize { .. })
        ));
    }

    /// An external region of 3 blocks of 8 bytes, 12 bytes apart, in a buffer the pool owns
    /// (as keep-alive); gaps hold 0xEE.
    fn external() -> (Pool, NonNull<u8>) {
        let mut buf = vec![0xEEu8; 2 * 12 + 8];
        let base = NonNull::new(buf.as_mut_ptr()).unwrap();
        // SAFETY: the buffer is owned by the pool's keep-alive and touched only through it.
        let pool = unsafe { Pool::external(base, 3, 8, 12, Some(Box::new(buf))) }.unwrap();
        (pool, base)
    }

    #[test]
    fn external_memory_puts_block_i_at_base_plus_i_strides_and_leaves_the_gaps() {
        let (mut pool, base) = external();
        assert_eq!(pool.base_addr(), base.as_ptr() as u64);
        assert_eq!(
            (pool.num_blocks(), pool.block_len(), pool.stride()),
            (3, 8, 12)
        );
        assert_eq!(pool.span_len(), 32);
        assert!(pool.shm().is_none());
        for i in 0..3 {
            pool.block_mut(blk(i)).unwrap().fill(i as u8 + 1);
        }
        // SAFETY: the pool owns the buffer (keep-alive) and nothing writes it now.
        let raw = unsafe { std::slice::from_raw_parts(base.as_ptr(), 32) }.to_vec();
        let mut want = vec![0xEEu8; 32];
        for i in 0..3 {
            want[i * 12..i * 12 + 8].fill(i as u8 + 1);
        }
        assert_eq!(raw, want);
        assert_eq!(pool.block(blk(2)).unwrap(), &[3; 8]);
    }

    #[test]
    fn external_memory_with_overlapping_or_impossible_blocks_is_refused() {
        let base = NonNull::<u8>::dangling();
        // SAFETY: each call is refused before the memory is ever touched.
        unsafe {
            assert!(matches!(
                Pool::external(base, 2, 16, 8, None),
                Err(PoolError::BadStride { .. })
            ));
            assert!(matches!(
                Pool::external(base, 0, 16, 16, None),
                Err(PoolError::BadSize { .. })
            ));
            assert!(matches!(
                Pool::external(base, u64::MAX, 16, u64::MAX, None),
                Err(PoolError::BadSize { .. })
            ));
        }
    }

    #[test]
    fn claims_take_granted_permits_once_and_exclude_each_other_and_the_owner() {
        let (mut pool, _) = external();
        let w = pool.writer();
        let (a, b) = (PeerId::new("a"), PeerId::new("b"));
        assert!(matches!(
            w.claim(&a, &bs(&[0])),
            Err(ClaimError::NotPermitted(_))
        ));
        w.grant(&a, &bs(&[0, 1]));
        w.grant(&b, &bs(&[1]));
        assert_eq!(pool.block_mut(blk(0)), Err(BlockBusy::PeerWrite), "granted");
        assert_eq!(
            w.claim(&a, &bs(&[3])).unwrap_err(),
            ClaimError::Outside(blk(3))
        );
        assert!(w.claim(&a, &bs(&[0, 0])).is_err(), "a block named twice");
        let mut claim = w.claim(&a, &bs(&[1, 0])).unwrap();
        assert_eq!(claim.blocks(), &bs(&[1, 0])[..]);
        assert!(
            w.claim(&b, &bs(&[1])).is_err(),
            "another claim holds block 1"
        );
        claim.block_mut(0).unwrap().fill(9);
        assert!(claim.block_mut(2).is_none());
        drop(claim);
        assert_eq!(pool.block(blk(1)).unwrap(), &[9; 8]);
        assert!(w.claim(&a, &bs(&[0])).is_err(), "a permit is used once");
        assert!(
            pool.block_mut(blk(0)).is_ok(),
            "neither granted nor claimed"
        );
        assert_eq!(
            pool.block_mut(blk(1)),
            Err(BlockBusy::PeerWrite),
            "b's permit"
        );
        w.revoke(&b, &bs(&[1]));
        assert!(pool.block_mut(blk(1)).is_ok());
        w.grant(&b, &bs(&[2]));
        w.revoke_all(&b);
        assert!(w.claim(&b, &bs(&[2])).is_err());
        assert!(pool.block_mut(blk(2)).is_ok());
    }
}
