//! The block store: which key each block holds, which blocks are pinned, which are being
//! written, and which may be evicted.
//!
//! Owned by the node's runtime thread (the core's [`Parent`] and the engine API use it there);
//! nothing blocks. Every operation is O(1) per block: a hash index `key → block`, a per-block
//! slot, a free list, and an O(1) LRU of the blocks that may be evicted (readable and unpinned).
//!
//! A block's life: **free** → reserved for a fetch (**writing**: a peer's write is landing, peers
//! asking for its key get HIT_PENDING) → **ready** (readable; in the LRU unless pinned) →
//! evicted back to free. Blocks the engine stores go straight to ready. A **pin** (a store job)
//! keeps a ready block from eviction until the job completes, successfully or not.
//!
//! **Tenants.** Every block belongs to one [`Tenant`], and each tenant has an index of its own:
//! a key is found only in the index of the tenant that asks, so a key another tenant holds is
//! an ordinary miss, on the same path as a key nobody holds (nothing to time). The methods
//! without a tenant work in [`Tenant::DEFAULT`]; a node that keeps tenants apart calls the
//! `_in` forms, and its peers' lookups are scoped by the [`TenantOf`] it installs
//! ([`BlockStore::scope_peers`]).
//!
//! **Disk tier** ([`BlockStore::attach_disk`], `disk/`). Every block that becomes readable is
//! also written to the tier's file (its memory block pinned until the write ends: the
//! **flush**); a block evicted from memory stays held on disk; a lookup of a key held only on
//! disk reserves a memory block, starts reading it back (the **promotion**) and is answered
//! `Retry` until the read lands and passes its checks, then `Hit`. The core re-asks a `Retry`
//! by itself; the node calls [`Parent::progress`] each step to take in finished disk work. A
//! key is held while memory or disk holds it: lookups, `holds_*` and the change log say so.

use kvpeer_core::{BlockIndex, JobId, LookupResult, Parent, ServeCtx, StoreJob};
use kvpeer_proto::{OffloadKey, PeerId};

use crate::disk::{self, DiskConfig, DiskError, DiskStats, DiskTier, DiskWake, Finished, Promote};
use crate::lru::Lru;
use crate::pool::{BlockBusy, Pool, PoolError, PoolWriter};

type Map<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;

/// How to make a store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Name of the shared-memory object (for `shm_open`, without the leading `/`).
    pub shm_name: String,
    /// Blocks in the pool.
    pub num_blocks: u64,
    /// Bytes per block.
    pub block_len: u64,
    /// Lock the pool in memory (`mlock`).
    pub lock_memory: bool,
}

/// Why a store operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The pool could not be made.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// More blocks are needed than are free or evictable (the rest are pinned or being written).
    #[error("no room: {wanted} blocks wanted, {available} free or evictable")]
    Full {
        /// Blocks asked for.
        wanted: usize,
        /// Blocks that could be had.
        available: usize,
    },
    /// The pool has more blocks than the store can index (2^32 - 1).
    #[error("{0} blocks is more than the store can index")]
    TooManyBlocks(u64),
    /// A block index outside the pool, or not in the state the call needs.
    #[error("block {block}: {reason}")]
    BadBlock {
        /// The block.
        block: BlockIndex,
        /// What is wrong.
        reason: &'static str,
    },
    /// Blocks for [`Tenant::NOBODY`] (a peer two tenants' rules name): they would be nobody's.
    #[error("no tenant to hold the blocks: their peer is named by two tenants' rules")]
    NoTenant,
    /// Bytes of the wrong size for a block.
    #[error("{len} bytes given for a block of {block_len}")]
    WrongSize {
        /// Bytes given.
        len: usize,
        /// Bytes per block.
        block_len: u64,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Free,
    Writing,
    Ready,
}

#[derive(Debug)]
struct Slot {
    key: Option<OffloadKey>,
    /// Whose index holds `key`.
    tenant: Tenant,
    state: State,
    pins: u32,
    /// Being written from the disk tier (a promotion), not by a peer: lookups wait (`Retry`)
    /// rather than tell the peer it is pending.
    promoting: bool,
    /// One of `pins` is the disk tier's write of this block.
    flushing: bool,
    /// Read back from disk under [`Promote::Cold`]: the first to go when unpinned, until a
    /// second lookup (after the one that waited for it) makes it hot.
    cold: bool,
    /// Kept out of the LRU for its pin, [`HOLD`] at most (with a disk tier only): a block
    /// read back from disk until the lookup that waited for it sees it, and a block a lookup
    /// answered `Hit` until the core pins it, so that a promotion later in the same lookup
    /// (which takes a block, evicting the least recently used) cannot take it first.
    held: bool,
    /// Read back from disk and not yet looked up: the lookup that waited for it does not
    /// make a cold block hot.
    landed: bool,
}

/// How long a block is held for its pin (`Slot::held`).
const HOLD: std::time::Duration = std::time::Duration::from_secs(2);

/// Whose a block is: the namespace of its key. Numbered by the node that keeps tenants apart;
/// [`Tenant::DEFAULT`] is every block of a node that does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Tenant(pub u16);

impl Tenant {
    /// The tenant of a node that keeps none apart, and of peers that no tenant's rule names.
    pub const DEFAULT: Tenant = Tenant(0);
    /// A peer that two tenants' rules name: it sees no tenant's blocks (an empty index).
    pub const NOBODY: Tenant = Tenant(u16::MAX);
}

/// Which tenant a peer asks as: installed with [`BlockStore::scope_peers`], asked on the node's
/// thread once per peer (the answer is kept), so it must be pure and quick.
pub trait TenantOf: Send + std::fmt::Debug {
    /// The tenant `peer` belongs to.
    fn tenant_of(&self, peer: &PeerId) -> Tenant;
    /// Whether `peer` is a shared node (serving every tenant its own blocks).
    fn is_shared(&self, _peer: &PeerId) -> bool {
        false
    }
}

/// Rules shared between their users (the node's origin check and its store hold one copy).
impl<T: TenantOf + Sync + ?Sized> TenantOf for std::sync::Arc<T> {
    fn tenant_of(&self, peer: &PeerId) -> Tenant {
        (**self).tenant_of(peer)
    }

    fn is_shared(&self, peer: &PeerId) -> bool {
        (**self).is_shared(peer)
    }
}

/// Peers whose tenant is remembered before the memory is cleared (a peer is asked about again
/// after that: correct, just one more rule walk).
const SCOPE_CACHE_MAX: usize = 4096;

/// Occupancy, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Blocks in the pool.
    pub capacity: u64,
    /// Bytes per block.
    pub block_len: u64,
    /// Readable blocks.
    pub ready: u64,
    /// Blocks a write is landing in.
    pub writing: u64,
    /// Unused blocks.
    pub free: u64,
    /// Blocks held by at least one pin.
    pub pinned: u64,
    /// Store jobs (pins) open.
    pub jobs: u64,
    /// Serve contexts open (inbound lookups in progress).
    pub open_contexts: u64,
    /// The disk tier's figures, if the store has one.
    pub disk: Option<DiskStats>,
}

/// What the store did to a key: the change log a pool node publishes as KV events
/// ([`BlockStore::record_changes`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyChange {
    /// The key's block became readable.
    Stored(OffloadKey),
    /// The key is no longer held (evicted, or being fetched again).
    Removed(OffloadKey),
}

/// The change log: bounded, oldest changes dropped (and counted) past its length.
#[derive(Debug)]
struct ChangeLog {
    changes: std::collections::VecDeque<KeyChange>,
    max: usize,
    dropped: u64,
    /// Taken once: the blocks found on disk are announced from the next take on (a caller
    /// discards the first, which only starts the log: the pool node does).
    taken: bool,
}

/// The node's pool of KV blocks.
#[derive(Debug)]
pub struct BlockStore {
    pool: Pool,
    slots: Vec<Slot>,
    /// One index per tenant, by its number (grown when a tenant first stores).
    indexes: Vec<Map<OffloadKey, u32>>,
    /// An empty index: the answer for a tenant that holds nothing.
    no_index: Map<OffloadKey, u32>,
    /// How peers' lookups are scoped (`None`: every peer asks as [`Tenant::DEFAULT`]).
    scopes: Option<Box<dyn TenantOf>>,
    scope_cache: Map<PeerId, Tenant>,
    lru: Lru,
    free: Vec<u32>,
    jobs: Map<JobId, Vec<u32>>,
    next_job: JobId,
    pinned: u64,
    writing: u64,
    open_contexts: u64,
    changes: Option<ChangeLog>,
    disk: Option<DiskSide>,
}

/// The store's side of its disk tier.
#[derive(Debug)]
struct DiskSide {
    tier: DiskTier,
    /// Grants the tier's reads their blocks.
    writer: PoolWriter,
    /// Blocks found on disk at start, still to be announced in the change log.
    republish: std::collections::VecDeque<(Tenant, OffloadKey)>,
    /// Writes started and not yet ended.
    flushing: usize,
    /// Writes started at most at once (the tier's queue depth, a few per I/O thread).
    max_flushing: usize,
    /// Blocks waiting for their write to start (pinned meanwhile: memory full of them refuses
    /// new blocks, which holds writers back to the disk's speed).
    dirty: std::collections::VecDeque<u32>,
    /// Blocks held for their pin, with when (`Slot::held`).
    held: std::collections::VecDeque<(u32, std::time::Instant)>,
    finished: Vec<Finished>,
}

impl BlockStore {
    /// Bookkeeping bytes per block, beyond the block itself (docs/data-planes.md, "The pool"):
    /// its slot, its LRU link and flag, its free-list entry, and its index entry with the hash
    /// table's control byte, at the table's worst load (half full, right after growing).
    pub fn overhead_per_block() -> usize {
        // Every index together holds one entry per block at most (a block is in one).
        let index_entry = std::mem::size_of::<(OffloadKey, u32)>() + 1;
        std::mem::size_of::<Slot>()
            + Lru::BYTES_PER_BLOCK
            + std::mem::size_of::<u32>()
            + 2 * index_entry
    }

    /// A store over a fresh shared-memory pool.
    pub fn new(config: &StoreConfig) -> Result<Self, StoreError> {
        // Checked before the object is made, as before there was `with_pool`.
        Self::index_len(config.num_blocks)?;
        let pool = Pool::shm(
            &config.shm_name,
            config.num_blocks,
            config.block_len,
            config.lock_memory,
        )?;
        Self::with_pool(pool)
    }

    fn index_len(num_blocks: u64) -> Result<u32, StoreError> {
        u32::try_from(num_blocks)
            .ok()
            .filter(|n| *n < u32::MAX)
            .ok_or(StoreError::TooManyBlocks(num_blocks))
    }

    /// A store over `pool` (a shm object from [`Pool::shm`], or an engine's memory from
    /// [`Pool::external`]); every block starts free, whatever its bytes.
    pub fn with_pool(pool: Pool) -> Result<Self, StoreError> {
        let blocks = Self::index_len(pool.num_blocks())?;
        let n = blocks as usize;
        Ok(BlockStore {
            pool,
            slots: (0..n)
                .map(|_| Slot {
                    key: None,
                    tenant: Tenant::DEFAULT,
                    state: State::Free,
                    pins: 0,
                    promoting: false,
                    flushing: false,
                    cold: false,
                    held: false,
                    landed: false,
                })
                .collect(),
            indexes: vec![Map::default()],
            no_index: Map::default(),
            scopes: None,
            scope_cache: Map::default(),
            lru: Lru::new(n),
            // Pop from the end: lowest blocks first.
            free: (0..blocks).rev().collect(),
            jobs: Map::default(),
            next_job: JobId::new(0),
            pinned: 0,
            writing: 0,
            open_contexts: 0,
            changes: None,
            disk: None,
        })
    }

    /// Puts a disk tier under the pool ([`DiskConfig`]): opens (or makes) its file, takes in
    /// what the file holds (announced through the change log, `max` per
    /// [`BlockStore::take_changes`]) and starts its I/O threads, which call `wake` when they
    /// finish something. Blocks become readable on disk as well from now on.
    pub fn attach_disk(&mut self, config: &DiskConfig, wake: DiskWake) -> Result<(), DiskError> {
        let writer = self.pool.writer();
        let (tier, found) = DiskTier::open(config, self.pool.block_len(), writer.clone(), wake)?;
        self.disk = Some(DiskSide {
            tier,
            writer,
            republish: found.into(),
            flushing: 0,
            max_flushing: config.threads.max(1) * 4,
            dirty: std::collections::VecDeque::new(),
            held: std::collections::VecDeque::new(),
            finished: Vec::new(),
        });
        Ok(())
    }

    /// The disk tier's figures, if the store has one.
    pub fn disk_stats(&self) -> Option<DiskStats> {
        self.disk.as_ref().map(|d| d.tier.stats())
    }

    /// Whether `tenant`'s `key` is held: readable in memory, or on disk.
    pub fn holds_in(&self, tenant: Tenant, key: &OffloadKey) -> bool {
        self.block_of_in(tenant, key).is_some()
            || self
                .disk
                .as_ref()
                .is_some_and(|d| d.tier.holds(tenant, key))
    }

    /// Whether any tenant holds `key`, in memory or on disk (the node's own view).
    pub fn holds_any(&self, key: &OffloadKey) -> bool {
        self.block_of_any(key).is_some()
            || (0..=u16::MAX).take(self.tenant_count()).any(|t| {
                self.disk
                    .as_ref()
                    .is_some_and(|d| d.tier.holds(Tenant(t), key))
            })
    }

    /// Tenants with an index in memory or on disk.
    fn tenant_count(&self) -> usize {
        self.indexes
            .len()
            .max(self.disk.as_ref().map_or(0, |d| d.tier.tenants()))
    }

    /// Takes in the disk tier's finished work: flushed blocks unpinned, promoted blocks made
    /// readable (or freed when their bytes failed their check). Never waits. `true` if a
    /// promotion ended (lookups waiting on it can be answered now).
    pub fn poll_disk(&mut self) -> bool {
        let Some(d) = &mut self.disk else {
            return false;
        };
        let mut finished = std::mem::take(&mut d.finished);
        d.tier.poll(&mut finished);
        let any = finished.iter().any(|f| matches!(f, Finished::Read { .. }));
        for f in finished.drain(..) {
            match f {
                Finished::Written { block, lost } => {
                    self.flushed(block);
                    if let Some((tenant, key)) = lost {
                        self.disk_lost(tenant, key);
                    }
                }
                Finished::Read { block, ok, lost } => {
                    if let Some(d) = &self.disk {
                        d.writer.revoke(disk::disk_holder(), &[block]);
                    }
                    self.promoted(block, ok);
                    if let Some((tenant, key)) = lost {
                        self.disk_lost(tenant, key);
                    }
                }
            }
        }
        if let Some(d) = &mut self.disk {
            d.finished = finished;
        }
        self.start_flushes();
        self.expire_holds();
        any
    }

    /// Starts the writes of dirty blocks, oldest first, up to the queue's depth.
    fn start_flushes(&mut self) {
        loop {
            let Some(d) = &mut self.disk else { return };
            if d.flushing >= d.max_flushing {
                return;
            }
            let Some(b) = d.dirty.pop_front() else { return };
            let slot = &self.slots[b as usize];
            let started = match (&slot.key, slot.state) {
                (Some(key), State::Ready) if !d.tier.holds(slot.tenant, key) => d
                    .tier
                    .demote(slot.tenant, key, BlockIndex::new(u64::from(b)))
                    .ok(),
                // The key moved to another block meanwhile: that block writes it.
                _ => None,
            };
            match started {
                Some(evicted) => {
                    d.flushing += 1;
                    if let Some((t, k)) = evicted {
                        self.disk_lost(t, k);
                    }
                }
                None => self.unpin_flush(b),
            }
        }
    }

    /// A flush ended: the block's pin for it goes.
    fn flushed(&mut self, block: BlockIndex) {
        if let Some(d) = &mut self.disk {
            d.flushing = d.flushing.saturating_sub(1);
        }
        self.unpin_flush(block.get() as u32);
    }

    fn unpin_flush(&mut self, b: u32) {
        let block = BlockIndex::new(u64::from(b));
        let Some(slot) = self.slots.get_mut(block.get() as usize) else {
            return;
        };
        if !slot.flushing {
            return;
        }
        slot.flushing = false;
        slot.pins = slot.pins.saturating_sub(1);
        if slot.pins == 0 {
            self.pinned -= 1;
            self.release_to_lru(b);
        }
    }

    /// A promotion ended: the block is readable, or freed.
    fn promoted(&mut self, block: BlockIndex, ok: bool) {
        let b = block.get() as u32;
        let Some(slot) = self.slots.get_mut(b as usize) else {
            return;
        };
        if !(slot.promoting && slot.state == State::Writing) {
            return;
        }
        slot.promoting = false;
        self.writing -= 1;
        if ok {
            slot.state = State::Ready;
            slot.landed = true;
            slot.cold = self.disk.as_ref().map(|d| d.tier.promote_policy()) == Some(Promote::Cold);
            self.hold(b);
        } else {
            self.evict(b);
            self.free.push(b);
        }
    }

    /// `tenant`'s `key` is gone from disk (its slot reused, or torn): logged as removed unless
    /// memory still holds it.
    fn disk_lost(&mut self, tenant: Tenant, key: OffloadKey) {
        let in_memory = self
            .index(tenant)
            .get(&key)
            .is_some_and(|b| self.slots[*b as usize].state == State::Ready);
        if !in_memory {
            self.log_for(tenant, KeyChange::Removed(key));
        }
    }

    /// Starts reading `tenant`'s `key` from disk into a memory block: `Retry` if it started
    /// (or memory has no block to spare now), `Miss` if disk does not hold it readable.
    fn promote(&mut self, tenant: Tenant, key: &OffloadKey) -> LookupResult {
        if !self
            .disk
            .as_ref()
            .is_some_and(|d| d.tier.readable(tenant, key))
        {
            return LookupResult::Miss;
        }
        let Ok(taken) = self.take_blocks(1) else {
            // Every memory block is pinned or being written: asked again soon.
            return LookupResult::Retry;
        };
        let b = taken[0];
        let block = BlockIndex::new(u64::from(b));
        self.index_mut(tenant).insert(key.clone(), b);
        let slot = &mut self.slots[b as usize];
        slot.key = Some(key.clone());
        slot.tenant = tenant;
        slot.state = State::Writing;
        slot.promoting = true;
        self.writing += 1;
        let Some(d) = &mut self.disk else {
            return LookupResult::Miss;
        };
        d.writer.grant(disk::disk_holder(), &[block]);
        if !d.tier.promote(tenant, key, block) {
            d.writer.revoke(disk::disk_holder(), &[block]);
            self.promoted(block, false);
            return LookupResult::Miss;
        }
        LookupResult::Retry
    }

    /// Queues a block that just became readable for its write to disk, unless disk holds its
    /// key already; pinned until the write ends.
    fn flush(&mut self, tenant: Tenant, key: &OffloadKey, b: u32) {
        let Some(d) = &mut self.disk else { return };
        if d.tier.holds(tenant, key) {
            return;
        }
        d.dirty.push_back(b);
        let slot = &mut self.slots[b as usize];
        slot.flushing = true;
        if slot.pins == 0 {
            self.lru.remove(b);
            self.pinned += 1;
        }
        slot.pins += 1;
        self.start_flushes();
    }

    /// Keeps a log of the keys that become readable and stop being held, at most `max`
    /// changes between two [`BlockStore::take_changes`] (older ones are dropped, and counted).
    pub fn record_changes(&mut self, max: usize) {
        self.changes = Some(ChangeLog {
            changes: std::collections::VecDeque::new(),
            max: max.max(1),
            dropped: 0,
            taken: false,
        });
    }

    /// Whether the change log is kept ([`BlockStore::record_changes`]).
    pub fn recording_changes(&self) -> bool {
        self.changes.is_some()
    }

    /// The changes since the last call, in order, and how many were dropped for room.
    ///
    /// With a disk tier, the blocks found on disk at start follow, from the second call on
    /// (the first only starts the log), up to the log's length per call, until every one was
    /// announced (those still held then).
    pub fn take_changes(&mut self) -> (Vec<KeyChange>, u64) {
        let (mut out, dropped, max) = match &mut self.changes {
            Some(log) => (
                log.changes.drain(..).collect::<Vec<_>>(),
                std::mem::take(&mut log.dropped),
                if std::mem::replace(&mut log.taken, true) {
                    log.max
                } else {
                    0
                },
            ),
            None => return (Vec::new(), 0),
        };
        let mut found = Vec::new();
        if let Some(d) = &mut self.disk {
            while out.len() + found.len() < max {
                let Some(f) = d.republish.pop_front() else {
                    break;
                };
                found.push(f);
            }
        }
        for (tenant, key) in found {
            if self.holds_in(tenant, &key) {
                out.push(KeyChange::Stored(key));
            }
        }
        (out, dropped)
    }

    /// Logs `tenant`'s change unless another tenant holds the key readable: the log says what
    /// the store holds, whoever's it is (a key stays held while any tenant holds it).
    fn log_for(&mut self, tenant: Tenant, change: KeyChange) {
        if self.changes.is_none() {
            return;
        }
        let (KeyChange::Stored(key) | KeyChange::Removed(key)) = &change;
        let held_elsewhere = self.indexes.iter().enumerate().any(|(t, index)| {
            t != usize::from(tenant.0)
                && index
                    .get(key)
                    .is_some_and(|b| self.slots[*b as usize].state == State::Ready)
        }) || self.disk.as_ref().is_some_and(|d| {
            (0..d.tier.tenants()).any(|t| {
                t != usize::from(tenant.0)
                    && u16::try_from(t).is_ok_and(|t| d.tier.holds(Tenant(t), key))
            })
        });
        if !held_elsewhere {
            self.log(change);
        }
    }

    fn log(&mut self, change: KeyChange) {
        if let Some(log) = &mut self.changes {
            if log.changes.len() >= log.max {
                log.changes.pop_front();
                log.dropped += 1;
            }
            log.changes.push_back(change);
        }
    }

    /// The pool (its memory, shm object, base address, size): a [`crate::PoolView`] to the
    /// planes that read it, a [`crate::PoolWriter`] to the one that writes peers' blocks.
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Occupancy.
    pub fn stats(&self) -> StoreStats {
        let capacity = self.slots.len() as u64;
        let free = self.free.len() as u64;
        StoreStats {
            capacity,
            block_len: self.pool.block_len(),
            ready: capacity - free - self.writing,
            writing: self.writing,
            free,
            pinned: self.pinned,
            jobs: self.jobs.len() as u64,
            open_contexts: self.open_contexts,
            disk: self.disk_stats(),
        }
    }

    /// Whether `key` is held: readable (HIT, and it becomes the most recently used), being
    /// written (HIT_PENDING), or not (MISS).
    pub fn lookup(&mut self, key: &OffloadKey) -> LookupResult {
        self.lookup_in(Tenant::DEFAULT, key)
    }

    /// [`BlockStore::lookup`] as `tenant` sees the store.
    ///
    /// With a disk tier, a key held only on disk starts its promotion and is `Retry` until
    /// it is readable in memory.
    pub fn lookup_in(&mut self, tenant: Tenant, key: &OffloadKey) -> LookupResult {
        let Some(&b) = self.index(tenant).get(key) else {
            return self.promote(tenant, key);
        };
        let slot = &mut self.slots[b as usize];
        match slot.state {
            State::Ready => {
                if slot.landed {
                    // The lookup that waited for it: a cold block stays cold.
                    slot.landed = false;
                } else {
                    slot.cold = false;
                }
                if self.disk.is_some() {
                    // Out of the LRU until the core pins it (or the hold ends): a promotion
                    // later in this lookup cannot evict it; it is touched when released.
                    self.hold(b);
                } else if self.lru.contains(b) {
                    self.lru.touch(b);
                }
                LookupResult::Hit
            }
            State::Writing if slot.promoting => LookupResult::Retry,
            State::Writing => LookupResult::HitPending,
            State::Free => LookupResult::Miss,
        }
    }

    /// The block holding `key`, if readable.
    pub fn block_of(&self, key: &OffloadKey) -> Option<BlockIndex> {
        self.block_of_in(Tenant::DEFAULT, key)
    }

    /// [`BlockStore::block_of`] as `tenant` sees the store.
    pub fn block_of_in(&self, tenant: Tenant, key: &OffloadKey) -> Option<BlockIndex> {
        let &b = self.index(tenant).get(key)?;
        (self.slots[b as usize].state == State::Ready).then_some(BlockIndex::new(u64::from(b)))
    }

    /// The bytes of a readable block.
    pub fn read(&self, block: BlockIndex) -> Result<&[u8], StoreError> {
        let b = self.slot_index(block, State::Ready, "not readable")?;
        self.pool
            .block(BlockIndex::from(u64::from(b)))
            .ok_or(StoreError::BadBlock {
                block,
                reason: "outside the pool",
            })
    }

    /// The bytes of a block being written, for the node to write in place; refused while a
    /// peer may write it (a permit granted for it, or its write landing).
    pub fn write_target(&mut self, block: BlockIndex) -> Result<&mut [u8], StoreError> {
        let b = self.slot_index(block, State::Writing, "not reserved for a write")?;
        self.pool
            .block_mut(BlockIndex::from(u64::from(b)))
            .map_err(|busy| StoreError::BadBlock {
                block,
                reason: match busy {
                    BlockBusy::Outside => "outside the pool",
                    _ => "a peer may be writing it",
                },
            })
    }

    /// `tenant`'s index (an empty one for a tenant that never stored).
    fn index(&self, tenant: Tenant) -> &Map<OffloadKey, u32> {
        self.indexes
            .get(usize::from(tenant.0))
            .unwrap_or(&self.no_index)
    }

    /// `tenant`'s index, made if it is the first block of the tenant.
    fn index_mut(&mut self, tenant: Tenant) -> &mut Map<OffloadKey, u32> {
        let t = usize::from(tenant.0);
        if self.indexes.len() <= t {
            self.indexes.resize_with(t + 1, Map::default);
        }
        &mut self.indexes[t]
    }

    /// The room `tenant`'s index holds (entries it can take before it grows), for tests and
    /// memory accounting.
    pub fn index_capacity(&self, tenant: Tenant) -> usize {
        self.index(tenant).capacity()
    }

    /// Scopes peers' lookups and pins: each peer sees only the index of the tenant `scopes`
    /// names for it.
    pub fn scope_peers(&mut self, scopes: Box<dyn TenantOf>) {
        self.scopes = Some(scopes);
        self.scope_cache.clear();
    }

    /// The tenant `peer` asks as.
    pub fn tenant_of(&mut self, peer: &PeerId) -> Tenant {
        let Some(scopes) = &self.scopes else {
            return Tenant::DEFAULT;
        };
        if let Some(t) = self.scope_cache.get(peer) {
            return *t;
        }
        let t = scopes.tenant_of(peer);
        if self.scope_cache.len() >= SCOPE_CACHE_MAX {
            self.scope_cache.clear();
        }
        self.scope_cache.insert(peer.clone(), t);
        t
    }

    /// The tenant of blocks this node (`me`) fetches from `source`: `source`'s, or, from a
    /// shared node (which served them to us as our tenant's), `me`'s.
    pub fn tenant_of_fetch(&mut self, source: &PeerId, me: &PeerId) -> Tenant {
        let from_shared = self.scopes.as_ref().is_some_and(|s| s.is_shared(source));
        self.tenant_of(if from_shared { me } else { source })
    }

    /// [`BlockStore::lookup`] in every tenant's index, the default tenant's first: the first
    /// answer that is not a miss (the node's own view of its store).
    pub fn lookup_any(&mut self, key: &OffloadKey) -> LookupResult {
        for t in 0..self.tenant_count() {
            let Ok(t) = u16::try_from(t) else { break };
            let found = self.lookup_in(Tenant(t), key);
            if found != LookupResult::Miss {
                return found;
            }
        }
        LookupResult::Miss
    }

    /// The block holding `key` readable in any tenant's index, the default tenant's first:
    /// the node's own view of its store (its API's reads), which sees every tenant's blocks.
    pub fn block_of_any(&self, key: &OffloadKey) -> Option<BlockIndex> {
        self.indexes.iter().find_map(|index| {
            let &b = index.get(key)?;
            (self.slots[b as usize].state == State::Ready).then_some(BlockIndex::new(u64::from(b)))
        })
    }

    fn slot_index(
        &self,
        block: BlockIndex,
        state: State,
        reason: &'static str,
    ) -> Result<u32, StoreError> {
        let b = u32::try_from(block.get())
            .ok()
            .filter(|b| (*b as usize) < self.slots.len())
            .ok_or(StoreError::BadBlock {
                block,
                reason: "outside the pool",
            })?;
        if self.slots[b as usize].state != state {
            return Err(StoreError::BadBlock { block, reason });
        }
        Ok(b)
    }

    /// Takes `n` blocks: free ones first, then the least recently used ready ones (evicted).
    /// All or nothing.
    fn take_blocks(&mut self, n: usize) -> Result<Vec<u32>, StoreError> {
        let available = self.free.len() + self.lru.len();
        if n > available {
            return Err(StoreError::Full {
                wanted: n,
                available,
            });
        }
        let mut taken = Vec::with_capacity(n);
        for _ in 0..n {
            let b = match self.free.pop() {
                Some(b) => b,
                None => {
                    let Some(b) = self.lru.pop_oldest() else {
                        break;
                    };
                    self.evict(b);
                    b
                }
            };
            taken.push(b);
        }
        Ok(taken)
    }

    fn evict(&mut self, b: u32) {
        let slot = &mut self.slots[b as usize];
        let was_ready = slot.state == State::Ready;
        let mut gone = None;
        let tenant = slot.tenant;
        if let Some(key) = slot.key.take() {
            if self.index(tenant).get(&key) == Some(&b) {
                let several = self.indexes.len() > 1;
                let index = self.index_mut(tenant);
                index.remove(&key);
                // With tenants, each index may once have held most of the pool: one that has
                // shrunk to a quarter gives the room back, so all of them together stay within
                // a few times the pool's entries (the one index of a node without tenants is
                // left as it was: it refills as the pool does).
                if several && index.capacity() > 1024 && index.len() * 4 < index.capacity() {
                    index.shrink_to(index.len() * 2);
                }
                gone = Some(key);
            }
        }
        self.slots[b as usize].state = State::Free;
        self.slots[b as usize].promoting = false;
        self.slots[b as usize].cold = false;
        self.slots[b as usize].held = false;
        self.slots[b as usize].landed = false;
        // A block that never became readable was never announced; one still on disk is still
        // held (and, as it just left memory, kept on disk longest).
        if let (Some(key), true) = (gone, was_ready) {
            match &mut self.disk {
                Some(d) if d.tier.holds(tenant, &key) => d.tier.touch(tenant, &key),
                _ => self.log_for(tenant, KeyChange::Removed(key)),
            }
        }
    }

    /// Reserves destination blocks for a fetch of `keys` (the consumer side). Until
    /// [`BlockStore::finish_write`], peers asking for these keys get HIT_PENDING. A key already
    /// held moves to its new block; the old block loses the key (and is freed once unpinned).
    pub fn reserve(&mut self, keys: &[OffloadKey]) -> Result<Vec<BlockIndex>, StoreError> {
        self.reserve_in(Tenant::DEFAULT, keys)
    }

    /// [`BlockStore::reserve`] for blocks of `tenant`.
    pub fn reserve_in(
        &mut self,
        tenant: Tenant,
        keys: &[OffloadKey],
    ) -> Result<Vec<BlockIndex>, StoreError> {
        if tenant == Tenant::NOBODY {
            return Err(StoreError::NoTenant);
        }
        let taken = self.take_blocks(keys.len())?;
        let mut out = Vec::with_capacity(keys.len());
        for (key, b) in keys.iter().zip(taken) {
            if let Some(old) = self.index_mut(tenant).insert(key.clone(), b) {
                // The key was held elsewhere: its old block loses it (still held if on disk).
                let on_disk = self
                    .disk
                    .as_ref()
                    .is_some_and(|d| d.tier.holds(tenant, key));
                if self.slots[old as usize].state == State::Ready && !on_disk {
                    self.log_for(tenant, KeyChange::Removed(key.clone()));
                }
                let slot = &mut self.slots[old as usize];
                if slot.state == State::Ready && slot.pins == 0 {
                    self.lru.remove(old);
                    slot.key = None;
                    slot.state = State::Free;
                    slot.cold = false;
                    slot.held = false;
                    slot.landed = false;
                    self.free.push(old);
                } else {
                    slot.key = None;
                }
            }
            let slot = &mut self.slots[b as usize];
            slot.key = Some(key.clone());
            slot.tenant = tenant;
            slot.state = State::Writing;
            self.writing += 1;
            out.push(BlockIndex::new(u64::from(b)));
        }
        Ok(out)
    }

    /// Ends writes into reserved blocks: readable on success, freed (and forgotten) on failure.
    pub fn finish_write(&mut self, blocks: &[BlockIndex], success: bool) {
        for &block in blocks {
            let Ok(b) = self.slot_index(block, State::Writing, "") else {
                continue;
            };
            if self.slots[b as usize].promoting {
                // The disk tier's read, not the caller's write: it ends it itself.
                continue;
            }
            self.writing -= 1;
            if success {
                self.slots[b as usize].state = State::Ready;
                if self.slots[b as usize].pins == 0 {
                    self.lru.touch(b);
                }
                let tenant = self.slots[b as usize].tenant;
                if let Some(key) = self.slots[b as usize].key.clone() {
                    if self.index(tenant).get(&key) == Some(&b) {
                        let on_disk = self
                            .disk
                            .as_ref()
                            .is_some_and(|d| d.tier.holds(tenant, &key));
                        if !on_disk {
                            self.log_for(tenant, KeyChange::Stored(key.clone()));
                            self.flush(tenant, &key, b);
                        }
                    }
                }
            } else {
                self.evict(b);
                self.free.push(b);
            }
        }
    }

    /// Stores a block the engine produced; returns its block. A key already readable keeps its
    /// block (same key, same content in a prefix cache).
    pub fn put(&mut self, key: &OffloadKey, bytes: &[u8]) -> Result<BlockIndex, StoreError> {
        self.put_in(Tenant::DEFAULT, key, bytes)
    }

    /// [`BlockStore::put`] for a block of `tenant`.
    pub fn put_in(
        &mut self,
        tenant: Tenant,
        key: &OffloadKey,
        bytes: &[u8],
    ) -> Result<BlockIndex, StoreError> {
        let block_len = self.pool.block_len();
        if bytes.len() as u64 != block_len {
            return Err(StoreError::WrongSize {
                len: bytes.len(),
                block_len,
            });
        }
        if let Some(block) = self.block_of_in(tenant, key) {
            return Ok(block);
        }
        let block = self.reserve_in(tenant, std::slice::from_ref(key))?[0];
        self.write_target(block)?.copy_from_slice(bytes);
        self.finish_write(&[block], true);
        Ok(block)
    }

    /// Pins readable `keys` as one store job; `None` (nothing pinned) if any is not readable.
    pub fn pin(&mut self, keys: &[OffloadKey]) -> Option<StoreJob> {
        self.pin_in(Tenant::DEFAULT, keys)
    }

    /// [`BlockStore::pin`] of `tenant`'s blocks.
    pub fn pin_in(&mut self, tenant: Tenant, keys: &[OffloadKey]) -> Option<StoreJob> {
        let index = self.index(tenant);
        let blocks: Vec<u32> = keys
            .iter()
            .map(|k| {
                index
                    .get(k)
                    .copied()
                    .filter(|b| self.slots[*b as usize].state == State::Ready)
            })
            .collect::<Option<_>>()?;
        for &b in &blocks {
            let slot = &mut self.slots[b as usize];
            if slot.pins == 0 {
                self.lru.remove(b);
                self.pinned += 1;
            }
            slot.pins += 1;
            // Pinned: the hold's work is done (unpinning releases it to the LRU).
            slot.held = false;
        }
        self.next_job = JobId::new(self.next_job.get() + 1);
        let job_id = self.next_job;
        let out = blocks
            .iter()
            .map(|b| BlockIndex::new(u64::from(*b)))
            .collect();
        self.jobs.insert(job_id, blocks);
        Some(StoreJob {
            job_id,
            blocks: out,
        })
    }

    /// Releases a store job's pins (success or not). Unknown jobs are ignored.
    pub fn unpin(&mut self, job: JobId) {
        let Some(blocks) = self.jobs.remove(&job) else {
            return;
        };
        for b in blocks {
            let slot = &mut self.slots[b as usize];
            slot.pins = slot.pins.saturating_sub(1);
            if slot.pins == 0 {
                self.pinned -= 1;
                self.release_to_lru(b);
            }
        }
    }

    /// Puts an unpinned readable block in the LRU: the most recently used, or the first to
    /// go if it is cold; a held one stays out until its pin or its hold's end.
    fn release_to_lru(&mut self, b: u32) {
        let slot = &self.slots[b as usize];
        if slot.pins > 0 || slot.state != State::Ready || slot.held {
            return;
        }
        if slot.cold {
            self.lru.push_oldest(b);
        } else {
            self.lru.touch(b);
        }
    }

    /// Holds readable, unpinned block `b` out of the LRU for its pin (`Slot::held`).
    fn hold(&mut self, b: u32) {
        let slot = &mut self.slots[b as usize];
        if slot.held || slot.pins > 0 {
            return;
        }
        slot.held = true;
        self.lru.remove(b);
        if let Some(d) = &mut self.disk {
            d.held.push_back((b, std::time::Instant::now()));
        }
    }

    /// Held blocks whose pin never came (their lookup ended first, or missed elsewhere) go
    /// back to the LRU.
    fn expire_holds(&mut self) {
        let now = std::time::Instant::now();
        loop {
            let Some(d) = &mut self.disk else { return };
            match d.held.front() {
                Some((b, at)) if now.duration_since(*at) >= HOLD => {
                    let b = *b;
                    d.held.pop_front();
                    if self.slots[b as usize].held {
                        self.slots[b as usize].held = false;
                        self.release_to_lru(b);
                    }
                }
                _ => return,
            }
        }
    }
}

impl Drop for BlockStore {
    /// Blocks still waiting for their write go to disk before the tier's threads stop: a node
    /// that stops cleanly (SIGTERM, an upgrade) keeps everything it held. Bounded: a disk that
    /// takes longer than 30 s loses the rest (a miss after the restart, never wrong bytes).
    fn drop(&mut self) {
        if self.disk.is_none() {
            return;
        }
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            self.poll_disk();
            let Some(d) = &self.disk else { return };
            if d.dirty.is_empty() && d.flushing == 0 {
                return;
            }
            if std::time::Instant::now() > deadline {
                tracing::warn!(
                    waiting = d.dirty.len() + d.flushing,
                    "the disk tier did not finish its writes in 30 s; those blocks are lost"
                );
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

/// The store as the producer role sees it.
impl Parent for BlockStore {
    fn on_new_request(&mut self, _ctx: &ServeCtx) {
        self.open_contexts += 1;
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ServeCtx) -> LookupResult {
        let tenant = self.tenant_of(&ctx.peer);
        self.lookup_in(tenant, key)
    }

    fn create_store_job(&mut self, keys: &[OffloadKey], ctx: &ServeCtx) -> Option<StoreJob> {
        let tenant = self.tenant_of(&ctx.peer);
        self.pin_in(tenant, keys)
    }

    fn complete_store_job(&mut self, job_id: JobId, _success: bool) {
        self.unpin(job_id);
    }

    fn on_request_finished(&mut self, _ctx: &ServeCtx) {
        self.open_contexts = self.open_contexts.saturating_sub(1);
    }

    fn progress(&mut self) -> bool {
        self.poll_disk()
    }
}
