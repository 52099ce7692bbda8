//! kvpeer inside an inference engine: the engine keeps its blocks, its block index and its
//! pins, and drives the node from its own thread.
//!
//! * [`EngineNode`]: a node without a runtime thread, driven poll-style by the engine.
//! * [`EngineLink`]: how the engine answers peers' lookups of its blocks, later and from any
//!   thread (vLLM may touch its block manager only inside its own step).
//! * [`SharedEngine`]: an `EngineNode` shared between the engine's threads, its I/O done by a
//!   thread of its own (kvpeer-py's `EngineTier`: nothing on vLLM's scheduler thread but
//!   handing work over and taking events).
//!
//! The runtime-thread [`Node`](crate::Node) remains for callers that want calls, not polling.

mod node;
mod parent;
mod shared;

pub use kvpeer_core::{
    BlockIndex, CoreStats, Counters, JobId, LookupResult, Request, RequestRoles,
};
pub use kvpeer_proto::KvRequestId;
pub use kvpeer_store::{BlockBusy, Pool, PoolError, PoolView};
pub use node::{EngineError, EngineEvent, EngineNode};
pub use parent::{Answer, EngineLink, EngineParent, EnginePin, Query, QueryId, Release};
pub use shared::SharedEngine;
