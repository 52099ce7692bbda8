//! The protocol core of kvpeer: vLLM 0.33's peer-to-peer KV tier as a pure state machine.
//!
//! No sockets, no threads, no clock reads: every entry point takes `now`, and the caller
//! carries out what the core asks (messages to send, connections to open or close) and feeds
//! back what happened (payloads, connection loss, data-plane progress, timeouts), like
//! quinn-proto. Block bytes never pass through here: the [`DataPlane`] moves them and the
//! [`Parent`] (the local store) pins them.
//!
//! * [`Core`]: the tier (all sessions, request roles, reaping, backoff, limits) and the API.
//! * `session`: per peer, the handshake, send gating and dispatch, with the consumer
//!   (client) and producer (server) roles.
//! * Every wait has a deadline, kept on O(1) timer lanes, so per-operation cost stays flat
//!   however many requests are open.

#![forbid(unsafe_code)]

mod config;
mod core;
mod counters;
mod error;
mod ids;
mod maps;
mod output;
mod session;
pub mod throttle;
mod timer;
mod traits;

pub use crate::config::{CoreConfig, LocalNode};
pub use crate::core::{
    Core, CoreStats, OffloadPolicy, PeerShare, Request, RequestRoles, SessionState, Source,
    FENCE_RECHECK,
};
pub use crate::counters::Counters;
pub use crate::error::seed_digest;
pub use crate::error::{
    Cause, CloseReason, ConnectRejection, DialFailure, FaultRecord, HostSign, Initiator,
    InternalError, LinkLoss, LocalRefusal, NotRegistered, PeerSaid, PlaneError, PlaneErrorKind,
    PlaneWords, ProtocolViolation, Refusal, SendFailure, SessionEnd, TransferStalled,
};
pub use crate::output::{Event, Transmit};
pub use crate::traits::{
    BlockIndex, CancelMode, DataPlane, JobId, LookupResult, Parent, PlanePoll, Registration,
    RemoteMemory, ServeCtx, StoreJob, TransferId, WriteEnd,
};
