//! [`NodeRequest`]: one consumer request of a [`Node`](crate::Node), as a handle.
//!
//! Contract: [`Node::request`](crate::Node::request) tells the runtime thread to open the
//! request (the core's `on_new_request`, which also opens the session to the producer) without
//! waiting for it, and returns the handle: its id, its producer and a token naming this handle.
//! The runtime keeps each open request with the token of the handle that holds it; every call
//! on the handle names both, so a second handle for an id already open gets `RequestOpen` and
//! can neither use nor finish the first one's request. Opening costs no round trip: the
//! channel delivers the open before the handle's first call. The handle finishes the request
//! exactly once: by [`NodeRequest::finish`] or, if the caller forgot, when it is dropped, so a
//! forgotten request never leaves lookup state or pins behind at the producer. Dropping never
//! blocks (an unbounded channel and a non-blocking wake pipe) and never panics, even after the
//! node is shut down.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::LookupResult;
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

use super::runtime::Command;
use super::{Calls, NodeError};

/// A consumer request open on a [`Node`](crate::Node): look keys up at its producer, fetch the
/// hits, finish it. `Send + Sync`: a `fetch` may run on another thread while this one waits.
///
/// Finishing tells the producer the request is done (with the terminal empty `fetch` when
/// nothing was fetched), so it lets go of what it held; it happens on drop if not before.
pub struct NodeRequest {
    id: KvRequestId,
    /// Names this handle to the runtime (unique per node).
    token: u64,
    /// The producer (also in the request's roles, as an `Option` for the core's other roles).
    peer: PeerId,
    calls: Arc<Calls>,
    /// Whether a lookup has been sent: a fetch needs one first (it fetches the hits of a
    /// lookup), and refusing it here keeps a misuse off the wire.
    looked_up: AtomicBool,
}

impl std::fmt::Debug for NodeRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeRequest")
            .field("id", &self.id)
            .field("peer", &self.peer())
            .finish()
    }
}

impl NodeRequest {
    pub(super) fn new(id: KvRequestId, token: u64, peer: PeerId, calls: Arc<Calls>) -> Self {
        NodeRequest {
            id,
            token,
            peer,
            calls,
            looked_up: AtomicBool::new(false),
        }
    }

    /// The request's `kv_request_id`.
    pub fn id(&self) -> &KvRequestId {
        &self.id
    }

    /// The producer it looks keys up at and fetches from.
    pub fn peer(&self) -> &PeerId {
        &self.peer
    }

    /// Looks `keys` up at the producer. Answers once every key is `Hit`, `Miss` or
    /// `HitPending`, or fails at `timeout`.
    ///
    /// A producer this node has no session with (nothing listens, it refused this node, it
    /// went away) answers every key `Miss` at once, as vLLM's tier does so the engine falls
    /// back to computing them: call [`Node::connect`](crate::Node::connect) first to learn
    /// why ([`NodeError::Refused`] and [`NodeError::ConnectTimeout`] say it).
    pub fn lookup(
        &self,
        keys: &[OffloadKey],
        timeout: Duration,
    ) -> Result<Vec<LookupResult>, NodeError> {
        let deadline = Instant::now() + timeout;
        self.looked_up.store(true, Ordering::Relaxed);
        self.calls.ask(
            |reply| Command::Lookup {
                id: self.id.clone(),
                token: self.token,
                keys: keys.to_vec(),
                deadline,
                reply,
            },
            Some(deadline),
        )?
    }

    /// Fetches `keys` (hits of an earlier [`lookup`](NodeRequest::lookup)) into local blocks.
    /// On success they are readable with [`Node::read`](crate::Node::read); on failure nothing
    /// of them is kept.
    pub fn fetch(&self, keys: &[OffloadKey], timeout: Duration) -> Result<(), NodeError> {
        if !self.looked_up.load(Ordering::Relaxed) {
            return Err(NodeError::FetchBeforeLookup(self.id.clone()));
        }
        let deadline = Instant::now() + timeout;
        self.calls.ask(
            |reply| Command::Fetch {
                id: self.id.clone(),
                token: self.token,
                keys: keys.to_vec(),
                deadline,
                reply,
            },
            Some(deadline),
        )?
    }

    /// The request is done (a request with no fetch tells the producer with an empty one).
    /// Returns at once: the runtime finishes it in order after the calls sent before.
    pub fn finish(self) {
        // `Drop` sends it: one path, so a request is finished exactly once.
        drop(self);
    }
}

impl Drop for NodeRequest {
    fn drop(&mut self) {
        // Without waiting: a handle dropped on any thread, even after the node stopped, must
        // neither block nor panic (the send fails quietly once the runtime is gone).
        self.calls.tell(Command::Finish {
            id: self.id.clone(),
            token: self.token,
        });
    }
}
