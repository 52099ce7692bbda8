//! kvpeer's host-memory pool of KV blocks: a POSIX shared-memory region of
//! `num_blocks × block_len` bytes (then a one-page trailer holding the pool's secret, see
//! [`trailer`]) for the shm plane, private anonymous memory in transparent huge pages for the
//! planes no peer maps (tcp, nixl), or an embedding engine's own registered memory, owned by [`Pool`] (the one
//! mapping of the pool in the process; the data planes get a [`PoolView`] to read and a
//! [`PoolWriter`] to write peers' permitted blocks), the index of which key each block holds,
//! pins held by store jobs, blocks being written by a peer, and O(1) LRU eviction of the rest.
//! It implements the core's [`Parent`](kvpeer_core::Parent), the store as the producer role sees it.
//!
//! Memory overhead: about 130 bytes per block (a 64-byte slot, 8 bytes of LRU links, and an
//! index entry holding the 48-byte key), under 1% of a 16 KiB block.

pub mod disk;
pub mod fence;
pub mod guard;
mod lru;
mod pool;
pub mod proc_maps;
pub mod room;
pub mod stale;
mod store;
pub mod trailer;

pub use pool::{
    BlockBusy, ClaimError, Pool, PoolError, PoolView, PoolWriter, ShmObject, WriteClaim, HUGE_PAGE,
};
pub use store::{BlockStore, KeyChange, StoreConfig, StoreError, StoreStats, Tenant, TenantOf};
