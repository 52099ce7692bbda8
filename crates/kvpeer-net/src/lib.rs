//! kvpeer's transports, the I/O half of a node: the control channel that carries the core's
//! messages, and data planes that implement the core's [`DataPlane`](kvpeer_core::DataPlane).
//! They make no protocol decisions.
//!
//! * [`control`]: the control channel, wire-compatible with vLLM's `ZmqTransport`, ZMTP spoken
//!   by kvpeer on the node's thread (no libzmq): inbound connections through the [`inbound`]
//!   ROUTER, outbound ones through `outbound.rs` ([`dealer`]). [`connection`] is one ZMTP
//!   connection of any socket type, without I/O, which the control ROUTER and DEALER and every
//!   event-stream socket are; `listener.rs` is one listening socket and its connections, with
//!   every bound against a hostile peer, which the control ROUTER and every event-stream
//!   listener are; [`zmtp`] is the codec.
//! * [`events`]: vLLM's KV event stream, natively: following an engine's PUB and replay ROUTER
//!   ([`events::EventSubscriber`]) and serving the pool's own ([`events::EventPublisher`]).
//! * [`metadata`]: the `agent_metadata` map a node advertises (`agent`, `shm`, `shm_token`,
//!   `tcp`, `tcp_key`).
//! * [`shm`]: same-host writes straight into the peer's shared-memory pool, once the peer has
//!   proven it owns it (the pool trailer's secret, [`kvpeer_store::trailer`]).
//! * [`tcp`]: any-host writes over TCP, acknowledged, checked against write permits.
//! * [`dual`]: both advertised; `shm` to peers whose object opens, else `tcp`.
//! * `nixl` (cargo feature `nixl`): NIXL WRITEs over UCX, what stock vLLM engines use.

mod admission;
pub mod connection;
pub mod control;
pub mod dealer;
pub mod dual;
pub mod events;
pub mod inbound;
mod listener;
pub mod metadata;
#[cfg(feature = "nixl")]
pub mod nixl;
mod outbound;
pub mod shm;
mod shm_object;
mod sockio;
pub mod tcp;
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
