//! kvpeer's transports, the I/O half of a node: data planes that implement the core's
//! [`DataPlane`](kvpeer_core::DataPlane). They make no protocol decisions.
//!
//! * [`metadata`]: the `agent_metadata` map a node advertises (`agent`, `shm`, `tcp`).
//! * [`shm`]: same-host writes straight into the peer's shared-memory pool.
//! * [`tcp`]: any-host writes over TCP, acknowledged, checked against write permits.

pub mod metadata;
pub mod shm;
pub mod tcp;
