//! Hash maps and sets with a fast, randomly seeded hasher.
//!
//! Keys here (request ids, block keys) come from peers, so the hasher must not let a peer
//! precompute collisions: foldhash's `RandomState` is seeded per process. It is several times
//! faster than the standard SipHash on these short keys, which the core hashes on every message.

pub(crate) type Map<K, V> = std::collections::HashMap<K, V, foldhash::fast::RandomState>;
pub(crate) type Set<K> = std::collections::HashSet<K, foldhash::fast::RandomState>;
