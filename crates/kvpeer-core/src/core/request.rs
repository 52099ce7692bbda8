//! A request as the engine holds it (its id and roles on this node), and the offload policy
//! that follows from them.
//!
//! Contract: the core keeps no table of requests; every call about one takes this handle, made
//! only by [`Core::on_new_request`](crate::Core::on_new_request).

use kvpeer_proto::{KvRequestId, PeerId};

/// Where a consumer request gets its blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The producer.
    pub peer: PeerId,
    /// Probe with `lookup` first (`remote_kv_source`, symmetric); without probing every key is
    /// assumed held (`remote_prefiller`, PD).
    pub probe: bool,
}

/// The roles one request plays on this node (vLLM's `kv_transfer_params`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestRoles {
    /// This node fetches the request's blocks from a peer.
    pub source: Option<Source>,
    /// This node produces the request's blocks for a peer that fetches them
    /// (`remote_decoder`): its stores wait for the peer's fetch.
    pub decoder: bool,
}

impl RequestRoles {
    /// A symmetric consumer (`remote_kv_source`): probes `peer`, then fetches the hits.
    pub fn kv_source(peer: PeerId) -> Self {
        RequestRoles {
            source: Some(Source { peer, probe: true }),
            decoder: false,
        }
    }

    /// A PD consumer (`remote_prefiller`): fetches from `peer` without probing.
    pub fn prefiller(peer: PeerId) -> Self {
        RequestRoles {
            source: Some(Source { peer, probe: false }),
            decoder: false,
        }
    }

    /// A PD producer (`remote_decoder`): stores wait for the peer's fetch.
    pub fn decoder() -> Self {
        RequestRoles {
            source: None,
            decoder: true,
        }
    }
}

/// A request as the engine holds it, like vLLM's `ReqContext`: its id and roles. Made by
/// [`Core::on_new_request`](crate::Core::on_new_request) and passed back to every later call about the request, so the core
/// keeps no table of requests (one fewer lookup per operation) and cannot be asked about a
/// request it never saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    pub(super) id: KvRequestId,
    pub(super) roles: RequestRoles,
}

impl Request {
    /// The request's `kv_request_id`.
    pub fn id(&self) -> &KvRequestId {
        &self.id
    }

    /// Its roles on this node.
    pub fn roles(&self) -> &RequestRoles {
        &self.roles
    }

    /// How much of it the engine should offload: all of it for a PD producer.
    pub fn offload_policy(&self) -> OffloadPolicy {
        if self.roles.decoder {
            OffloadPolicy::RequestLevel
        } else {
            OffloadPolicy::Default
        }
    }
}

/// How much of a request the engine should offload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadPolicy {
    /// The engine's usual policy.
    Default,
    /// Every block of the request, prefix hits included (a PD producer: the peer needs all).
    RequestLevel,
}
