//! The data planes: how blocks move between two nodes' pools once the control channel has
//! agreed what to move. Each implements the core's [`DataPlane`](kvpeer_core::DataPlane) over
//! the store's `PoolView`/`PoolWriter`; none maps its own pool or makes a protocol decision.
//!
//! * [`metadata`]: the `agent_metadata` map a node advertises (`agent`, `shm`, `shm_token`,
//!   `tcp`, `tcp_key`).
//! * [`shm`]: same-host writes straight into the peer's shared-memory pool, once the peer has
//!   proven it owns it (the pool trailer's secret, [`kvpeer_store::trailer`]).
//! * [`tcp`]: any-host writes over TCP, acknowledged, checked against write permits.
//! * [`dual`]: both advertised; `shm` to peers whose object opens, else `tcp`.
//! * `nixl` (cargo feature `nixl`): NIXL WRITEs over UCX, what stock vLLM engines use.

pub mod dual;
pub mod metadata;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod shm;
mod shm_object;
pub mod shm_refusal;
pub mod tcp;
