//! kvpeer's transports, the I/O half of a node: the control channel that carries the core's
//! messages, vLLM's KV event stream, and the data planes that implement the core's
//! [`DataPlane`](kvpeer_core::DataPlane). They make no protocol decisions. Cut as vLLM's own
//! `tiering/p2p` is (control, data), with what they share below:
//!
//! * [`control`]: the P2P control channel, wire-compatible with vLLM's `ZmqTransport`: the
//!   listening ROUTER ([`control::inbound`]) and one DEALER per peer (`control/outbound.rs`).
//! * [`events`]: vLLM's KV event stream, natively: following an engine's PUB and replay ROUTER
//!   ([`events::EventSubscriber`]) and serving the pool's own ([`events::EventPublisher`]).
//! * [`data`]: the data planes (`shm`, `tcp`, both, `nixl`) and the metadata that advertises
//!   them.
//! * [`zmtp`]: ZMTP 3.1 without libzmq: the codec, one connection of any socket type as a
//!   state machine, and the listening and connecting sockets every ZMTP socket of ours is.
//! * `io`: how a socket is driven: the non-blocking steps every driver takes.

pub mod control;
pub mod data;
pub mod events;
mod io;
pub mod tls;
pub mod zmtp;

/// Locks `m`; a poisoned lock only means a plane thread panicked, and the bookkeeping it guards
/// stays usable.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether a warning a peer can cause at will (a refused registration, data connection or
/// write) is logged now: at most one per kind per second for the whole process, from any
/// thread; `Some(n)` carries how many of its kind were suppressed since the last one logged.
pub(crate) fn admit_warning(kind: &'static str) -> Option<u64> {
    static THROTTLE: std::sync::LazyLock<std::sync::Mutex<kvpeer_core::throttle::WarnThrottle>> =
        std::sync::LazyLock::new(Default::default);
    lock(&THROTTLE).admit(kind, std::time::Instant::now())
}

/// A write of local blocks `local[i]` into a peer's blocks `remote[i]` names as many of each,
/// all inside their pools (`local_blocks`, `remote_blocks` blocks).
pub(crate) fn write_in_range(
    local: &[kvpeer_core::BlockIndex],
    remote: &[kvpeer_core::BlockIndex],
    local_blocks: u64,
    remote_blocks: u64,
) -> bool {
    local.len() == remote.len()
        && local.iter().all(|l| l.get() < local_blocks)
        && remote.iter().all(|r| r.get() < remote_blocks)
}
