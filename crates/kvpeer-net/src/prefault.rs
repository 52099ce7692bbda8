//! Pre-faulting a peer's pool mapped by the shm plane, so a transfer never pays page faults on
//! its first touch.
//!
//! A fresh mapping of a shared-memory object has no page-table entries: the first copy into or
//! out of each 4 KiB page takes a fault (measured: a first 128 MiB fetch ran at a third of the
//! copy speed). `MADV_POPULATE_READ`/`WRITE` fill the entries up front without touching the
//! bytes, so it is safe while other processes write the same pages. Best effort: kernels
//! before 5.14 refuse the advice, and the pages then fault in lazily as before.
//!
//! Called when the shm plane maps a peer's pool (registration; on a thread of its own, since it
//! takes about 0.2 s per GiB even though the pages already exist). The node's own pool is
//! mapped and pre-faulted once, by its owner in kvpeer-store.

use std::time::Instant;

use kvpeer_store::Pool;
use tracing::debug;

/// Pre-faults a writable mapping.
pub(crate) fn for_write(map: &Pool, what: &str) {
    let started = Instant::now();
    match map.populate_write() {
        Ok(()) => debug!(what, bytes = map.span_len(), elapsed = ?started.elapsed(), "pre-faulted"),
        Err(e) => debug!(what, error = %e, "not pre-faulted; pages fault in on first use"),
    }
}
