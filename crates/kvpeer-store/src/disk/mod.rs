//! The disk tier under a store's memory: blocks in a file on a local disk as well as in the
//! pool, so a node holds more than its memory and keeps what it held across a restart.
//!
//! * [`mod@format`]: the file's bytes (a header page per slot: key, tenant, generation, CRC-32C of
//!   the block), pure;
//! * `uring.rs`: the I/O as an io_uring (one thread, a ring of `disk_threads × 8` entries),
//!   where the kernel has it;
//! * `io.rs`: the I/O threads (direct I/O, a queue as deep as the threads), elsewhere;
//! * `tier.rs`: which slot holds which key, on the node's thread.
//!
//! The store (`store.rs`) drives it: every block that becomes readable in memory is written
//! through to disk (its memory copy pinned until the write ends); a block evicted from memory
//! stays on disk; a lookup of a key only on disk reads it back into a memory block the store
//! reserved (answered `Retry` meanwhile, a hit once it landed and passed its checks). A key
//! is held, for lookups and the change log, while memory or disk holds it.

pub mod format;
mod io;
mod tier;
mod uring;

pub use io::{disk_holder, DiskFault, DiskWake};
pub(crate) use tier::Finished;
pub use tier::{DiskConfig, DiskEngine, DiskError, DiskStats, DiskTier, Promote, FILE_NAME};
