//! kvpeer's pool node, the parts without I/O (issue 15): a node that learns what engines hold
//! from the KV events they already publish, and pulls over P2P the blocks worth keeping.
//!
//! * [`keys`]: the P2P offload key an event names (a CPU-tier chunk: its last hash and its KV
//!   group), or why it names none (int hashes, another medium).
//! * [`Holdings`]: which followed engine holds which key, bounded, with the admission rule that
//!   turns a key into a pull candidate.
//! * [`Follower`]: one engine's event stream: sequence numbers, gaps, publisher restarts, and
//!   the replays that recover what a late join or a gap lost.
//! * [`Catalog`]: what each chunk is beyond its key (its blocks' hashes, parent, tokens,
//!   block size), learned from the engines' GPU and self-describing events, so the pool's
//!   events describe it as an engine's do.
//! * [`shard`]: which of several pool nodes owns a prefix (rendezvous hashing of its root
//!   chunk), for `--shard` admission and for whoever picks a pool for a request.
//! * [`Publisher`]: the pool's own stream in vLLM's form (what its store took in and let go),
//!   with vLLM's replay buffer, for the routers that already index vLLM engines.
//!
//! Pure (quinn-proto's sans-IO style): no sockets, no clock reads, no threads; the caller (the
//! pool node's follower thread) feeds bytes and instants and carries out what comes back.

#![forbid(unsafe_code)]

mod catalog;
mod follower;
mod holdings;
pub mod keys;
mod publisher;
pub mod shard;

pub use catalog::{
    Catalog, CatalogLimits, CatalogStats, ChunkDescription, Undescribed, CONFIRMATIONS,
    MAX_ANCESTORS,
};
pub use follower::{FollowAction, Follower, FollowerLimits, FollowerStats};
pub use holdings::{Admission, EngineSlot, Holdings, PullCandidate};
pub use publisher::{
    low_64_bits, Frames, HashForm, Publisher, PublisherStats, StoreChange, MAX_FANOUT,
    MAX_FANOUT_HASHES, OWNERSHIP,
};
