//! kvpeer: peer-to-peer KV-cache sharing for LLM inference, wire-compatible with vLLM's P2P
//! tier. This crate is the node (and the `kvpeer` binary); the protocol lives in
//! `kvpeer-core`, the wire format in `kvpeer-proto`, blocks in `kvpeer-store`, transports in
//! `kvpeer-net`.

pub mod api;

/// The vLLM releases whose P2P peers kvpeer speaks with, byte for byte (stated once: the
/// README, `kvpeer --help`, the Python package and the metrics say this; a test holds them to
/// it).
pub const VLLM_PEERS: &str = "0.27 to 0.34";

/// The vLLM releases `kvpeer.vllm.KvpeerTier` runs inside (told apart by their tier contract,
/// not their version string).
pub const VLLM_TIER: &str = "0.32, 0.33 and 0.34";

/// Both, as one line.
pub const SUPPORTED_VLLM: &str = "peers of vLLM 0.27 to 0.34; the tier in vLLM 0.32, 0.33 and 0.34";
pub mod config;
pub mod engine;
pub mod metrics;
pub mod node;
pub mod pool_node;

pub use api::{
    Advertised, KvRequestId, LookupResult, Node, NodeConfig, NodeError, NodeRequest, OffloadKey,
    PeerEnd, PeerId, PlaneKind, Pull, Pulled, Sources,
};
pub mod synthetic;

/// A peer's address, one canonical value whatever its spelling (identities, `--peer`,
/// `sources`, the allowlist: docs/security.md).
pub use kvpeer_proto::{AddrError, Host, PeerAddr};

/// Whether a warning of `kind` is logged now, through one process-wide
/// [`WarnThrottle`](kvpeer_core::throttle::WarnThrottle), for the threads that own none (the
/// pool's, its pullers, the node's wait): `Some(suppressed)`, or `None` (counted, not logged).
pub(crate) fn admit_warning(kind: &'static str) -> Option<u64> {
    use std::sync::{LazyLock, Mutex, PoisonError};
    static THROTTLE: LazyLock<Mutex<kvpeer_core::throttle::WarnThrottle>> =
        LazyLock::new(Default::default);
    THROTTLE
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .admit(kind, std::time::Instant::now())
}
