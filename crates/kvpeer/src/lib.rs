//! kvpeer: peer-to-peer KV-cache sharing for LLM inference, wire-compatible with vLLM's P2P
//! tier. This crate is the node (and the `kvpeer` binary); the protocol lives in
//! `kvpeer-core`, the wire format in `kvpeer-proto`, blocks in `kvpeer-store`, transports in
//! `kvpeer-net`.

pub mod api;
pub mod config;
pub mod engine;
pub mod metrics;
pub mod node;
pub mod pool;

pub use api::{
    Advertised, KvRequestId, LookupResult, Node, NodeConfig, NodeError, NodeRequest, OffloadKey,
    PeerId, PlaneKind,
};
pub mod synthetic;
