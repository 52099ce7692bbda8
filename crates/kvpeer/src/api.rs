//! The public Rust API: start a node, use it as a consumer and a producer, read its stats,
//! shut it down.
//!
//! A [`Node`] is a handle to one runtime thread (`api::runtime`), which owns everything else.
//! Every call is a message to that thread and a wait for its answer; the calls that wait on a
//! peer (`lookup`, `fetch`) take a timeout. A consumer request is a [`NodeRequest`] handle
//! (opened by [`Node::request`], finished by [`NodeRequest::finish`] or when dropped). Both
//! handles are `Send + Sync`: call them from any thread.
//!
//! ```
//! use std::time::Duration;
//! use kvpeer::{synthetic, Node, NodeConfig};
//!
//! # fn main() -> Result<(), kvpeer::NodeError> {
//! let producer = Node::start(NodeConfig::local("doc-producer"))?;
//! let consumer = Node::start(NodeConfig::local("doc-consumer"))?;
//! let block_len = producer.config().block_len as usize;
//! let keys: Vec<_> = (0..4).map(synthetic::key).collect();
//! producer.store(keys.iter().map(|k| (k.clone(), synthetic::content(k, block_len))).collect())?;
//!
//! let wait = Duration::from_secs(10);
//! let req = consumer.request(producer.id(), "req-1")?;
//! let found = req.lookup(&keys, wait)?;
//! assert!(found.iter().all(|r| *r == kvpeer::LookupResult::Hit));
//! req.fetch(&keys, wait)?;
//! req.finish(); // or drop it: a request is finished when its handle goes
//! assert_eq!(consumer.read(&keys[0]), Some(synthetic::content(&keys[0], block_len)));
//!
//! consumer.shutdown(Duration::from_secs(3));
//! producer.shutdown(Duration::from_secs(3));
//! # Ok(())
//! # }
//! ```

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub use kvpeer_core::{CoreConfig, CoreStats, Counters, LookupResult};
pub use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};
pub use kvpeer_store::{StoreError, StoreStats};

pub use crate::config::NodeConfig;
use crate::node::build::{build, NodeSpec};
pub use crate::node::peer_end::PeerEnd;
pub use crate::node::plane::PlaneKind;
use runtime::Command;

mod request;
pub(crate) mod runtime;
mod sources;

pub use request::NodeRequest;
pub use sources::{Pull, Pulled, Sources};

/// Latency samples in fixed buckets (upper bounds in microseconds), Prometheus-style.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Histogram {
    /// Samples at or under each bound of [`Histogram::BOUNDS_US`], not cumulative.
    pub counts: [u64; 14],
    /// Samples over the last bound.
    pub over: u64,
    /// Sum of all samples, in seconds.
    pub sum_seconds: f64,
}

impl Histogram {
    /// Bucket upper bounds, microseconds.
    pub const BOUNDS_US: [u64; 14] = [
        100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 1_000_000,
        2_500_000, 10_000_000,
    ];

    /// Adds one sample.
    pub fn record(&mut self, d: Duration) {
        let us = u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        match Self::BOUNDS_US.iter().position(|b| us <= *b) {
            Some(i) => self.counts[i] += 1,
            None => self.over += 1,
        }
        self.sum_seconds += d.as_secs_f64();
    }

    /// All samples.
    pub fn total(&self) -> u64 {
        self.counts.iter().sum::<u64>() + self.over
    }
}

/// What a node reports: open state, running totals, latencies.
#[derive(Debug, Clone, Default)]
pub struct NodeStats {
    /// Open state of the protocol (sessions, requests, pins held for peers, transfers).
    pub core: CoreStats,
    /// The pool (capacity, ready, writing, pinned blocks).
    pub store: StoreStats,
    /// Running totals of the protocol (lookups, hits, fetches, transfers, errors).
    pub counters: Counters,
    /// Peers refused by the allowlist so far.
    pub refused_peers: u64,
    /// Rounds an inbound connection's reading was held back for its host's time share while
    /// another host under its share waited (`inbound_ms_per_s`).
    pub inbound_held_back: u64,
    /// Host liveness (`host_probe_timeout_ms`): connections ended by an unanswered probe, dials
    /// refused to a host taken for down, hosts taken for down now, datagrams of the liveness
    /// group dropped.
    pub host_liveness: kvpeer_net::control::HostLiveness,
    /// Bytes of blocks fetched into this node by successful `fetch` calls.
    pub bytes_fetched: u64,
    /// Latency of `lookup` calls (until every key was answered).
    pub lookup_latency: Histogram,
    /// Latency of `fetch` calls (until the blocks landed or the load failed).
    pub fetch_latency: Histogram,
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// The node could not be built (store, planes, control channel).
    #[error("cannot start the node: {0}")]
    Build(#[from] crate::node::build::BuildError),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    /// The runtime thread or its wake pipe could not be set up.
    #[error("cannot start the node's runtime thread: {0}")]
    Runtime(std::io::Error),
    /// The store refused (full of pinned blocks, a wrong block length).
    #[error("block store: {0}")]
    Store(#[from] kvpeer_store::StoreError),
    /// A `store_with` fill function panicked (the blocks it was writing were released).
    #[error("the fill function panicked")]
    FillPanicked,
    /// `fetch` on a request that has looked nothing up yet (it fetches a lookup's hits).
    #[error("request {0}: fetch before any lookup (lookup finds what the peer holds)")]
    FetchBeforeLookup(KvRequestId),
    /// [`Node::request`] named a request that is open already (finish that one first).
    #[error("request {0} is open already")]
    RequestOpen(KvRequestId),
    /// The peer did not answer in time.
    #[error("{0}: no answer before the timeout")]
    Timeout(&'static str),
    /// [`Node::connect`] ran out of time; how far the connection got says where to look.
    #[error("{peer}: {}", connect_timeout_text(*after, *stage))]
    ConnectTimeout {
        /// The peer.
        peer: PeerId,
        /// How long it waited.
        after: Duration,
        /// How far our connection to it got (`None`: no connection is open).
        stage: Option<kvpeer_net::control::DialStage>,
    },
    /// The load ended without every block landing (the peer failed, aborted or went away).
    #[error("the fetch failed: not every block landed")]
    LoadFailed,
    /// The peer could not be reached or would not have us (refused, gone, session limit).
    #[error("no session with {peer}{}", end.as_ref().map(|e| format!(": {e}")).unwrap_or_default())]
    Refused {
        /// The peer.
        peer: PeerId,
        /// Why its session ended or it was refused, when the node knows (boxed: a session's
        /// end is large, and every call's `Result` carries this error).
        end: Option<Box<PeerEnd>>,
    },
    /// The node is shut down.
    #[error("the node is shut down")]
    ShutDown,
}

fn connect_timeout_text(after: Duration, stage: Option<kvpeer_net::control::DialStage>) -> String {
    use kvpeer_net::control::DialStage;
    // The wait as the caller gave it (the deadline is a tick past the call's start).
    let after = format!("{:.1} s", after.as_secs_f64());
    match stage {
        Some(DialStage::Connecting) => format!(
            "not connected within {after}: the name did not resolve in time, or the host does \
             not answer on that port (a firewall drops it, no such host, or no socket could be \
             made)"
        ),
        Some(DialStage::Handshaking) => format!(
            "no ZMTP handshake within {after}: the port takes connections but does not \
             answer as a kvpeer or vLLM control port"
        ),
        Some(DialStage::Ready) | None => format!(
            "no answer to our connect within {after} (the peer is overloaded, or ignores \
             this node)"
        ),
    }
}

/// What a node advertises to peers in `connect`: its data planes' addresses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Advertised {
    /// The node's name in its plane map (informational).
    pub agent: String,
    /// Its pool's shared-memory object (without the leading `/`), with the shm plane.
    pub shm: Option<String>,
    /// Its tcp data listener, `host:port`, with the tcp plane.
    pub tcp: Option<String>,
}

impl Advertised {
    /// Read from the `agent_metadata` a node sends; the nixl plane sends NIXL's own blob,
    /// which names no kvpeer plane, so it reads as nothing advertised.
    fn from_agent_metadata(bytes: &[u8]) -> Self {
        let meta = kvpeer_net::data::metadata::AgentMetadata::decode(bytes).unwrap_or_default();
        Advertised {
            agent: meta.agent,
            shm: meta.shm,
            tcp: meta.tcp,
        }
    }
}

/// The way to a runtime thread: its call channel and the wake pipe it polls. Shared by the
/// [`Node`] and its [`NodeRequest`]s, so a request can finish itself when dropped.
pub(crate) struct Calls {
    tx: Sender<Command>,
    wake: std::fs::File,
    /// Names each request handle (see `NodeRequest`).
    next_token: AtomicU64,
}

impl Calls {
    /// Sends a call without waiting for anything.
    fn tell(&self, call: Command) {
        // Once the runtime is gone nobody reads the pipe: wake it only for a call it will see.
        if self.tx.send(call).is_ok() {
            // A full pipe already means "wake up" (it is non-blocking: this never waits).
            let _ = (&self.wake).write(&[1]);
        }
    }

    /// Sends a call and waits for its answer, until `deadline` (plus a second) or 30 s.
    fn ask<T>(
        &self,
        call: impl FnOnce(Sender<T>) -> Command,
        deadline: Option<Instant>,
    ) -> Result<T, NodeError> {
        let (tx, rx): (Sender<T>, Receiver<T>) = channel();
        self.tell(call(tx));
        // The runtime answers timed calls at their deadline itself; the extra second only
        // covers a runtime that has stopped.
        let limit = deadline.map_or(Duration::from_secs(30), |d| {
            d.saturating_duration_since(Instant::now()) + Duration::from_secs(1)
        });
        rx.recv_timeout(limit).map_err(|_| NodeError::ShutDown)
    }
}

/// A running node (a handle to its runtime thread).
pub struct Node {
    id: PeerId,
    advertised: Advertised,
    config: NodeSpec,
    calls: Arc<Calls>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("id", &self.id).finish()
    }
}

impl Node {
    /// Builds the node and starts its runtime thread.
    pub fn start(config: NodeConfig) -> Result<Node, NodeError> {
        let spec = config.spec;
        crate::node::descriptors::check(&spec);
        let io = build(&spec)?;
        let id = io.core().local().peer_id.clone();
        // The tenant rules as the node holds them, their names resolved (the pool's pulls read
        // them from the config).
        let tenants = io
            .tenants()
            .map_or_else(|| spec.tenants.clone(), |t| (*t).clone());
        let advertised = Advertised::from_agent_metadata(&io.core().local().agent_metadata);
        let wake = match io.wake_writer() {
            Some(w) => w.map_err(NodeError::Runtime)?,
            None => {
                return Err(NodeError::Runtime(std::io::Error::other(
                    "the node has no wake pipe",
                )))
            }
        };
        let (tx, rx) = channel();
        let thread = std::thread::Builder::new()
            .name(format!("kvpeer-node-{id}"))
            .spawn(move || runtime::run(io, rx))
            .map_err(NodeError::Runtime)?;
        Ok(Node {
            config: NodeSpec {
                id: id.clone(),
                tenants,
                ..spec
            },
            id,
            advertised,
            calls: Arc::new(Calls {
                tx,
                wake,
                next_token: AtomicU64::new(0),
            }),
            thread: Mutex::new(Some(thread)),
        })
    }

    /// The node's identity (`host:port`), which peers dial.
    pub fn id(&self) -> &PeerId {
        &self.id
    }

    /// What the node was started with (the identity, and the tenant rules' names, resolved).
    pub fn config(&self) -> &NodeSpec {
        &self.config
    }

    /// Producer: stores blocks (each exactly `block_len` bytes) to serve to peers.
    pub fn store(&self, blocks: Vec<(OffloadKey, Vec<u8>)>) -> Result<(), NodeError> {
        self.calls
            .ask(|reply| Command::Store { blocks, reply }, None)?
    }

    /// Producer: allocates a block for each of `keys` not held yet and calls `fill(i, block)`
    /// to write key `i`'s bytes straight into the pool (no copy through the call); the blocks
    /// become readable when it returns. Returns how many blocks were written. `fill` runs on
    /// the node's runtime thread: keep it to copying bytes.
    pub fn store_with(
        &self,
        keys: &[OffloadKey],
        fill: impl FnMut(usize, &mut [u8]) + Send + 'static,
    ) -> Result<usize, NodeError> {
        self.calls.ask(
            |reply| Command::StoreWith {
                keys: keys.to_vec(),
                fill: Box::new(fill),
                reply,
            },
            None,
        )?
    }

    /// Opens the session to `peer` ahead of any request and waits until its handshake is done
    /// (a request does this on its own; this lets a caller connect before timing its work).
    pub fn connect(&self, peer: &PeerId, timeout: Duration) -> Result<(), NodeError> {
        let deadline = Instant::now() + timeout;
        self.calls.ask(
            |reply| Command::Connect {
                peer: peer.clone(),
                deadline,
                reply,
            },
            Some(deadline),
        )?
    }

    /// Consumer: opens request `id`, whose blocks come from `peer` (and the session to `peer`,
    /// if needed). Look its keys up, fetch the hits and finish it through the handle; it is
    /// finished when the handle is dropped, if not before. One request per id at a time: the
    /// calls of a second handle for an id still open fail with [`NodeError::RequestOpen`].
    /// Returns at once (the open reaches the runtime before the handle's first call).
    pub fn request(&self, peer: &PeerId, id: &str) -> Result<NodeRequest, NodeError> {
        if self.thread.lock().map_or(true, |t| t.is_none()) {
            return Err(NodeError::ShutDown);
        }
        let id = KvRequestId::from(id);
        let token = self.calls.next_token.fetch_add(1, Ordering::Relaxed);
        self.calls.tell(Command::Open {
            peer: peer.clone(),
            id: id.clone(),
            token,
        });
        Ok(NodeRequest::new(
            id,
            token,
            peer.clone(),
            self.calls.clone(),
        ))
    }

    /// The bytes of a readable local block.
    pub fn read(&self, key: &OffloadKey) -> Option<Vec<u8>> {
        self.calls
            .ask(
                |reply| Command::Read {
                    keys: vec![key.clone()],
                    reply,
                },
                None,
            )
            .ok()
            .and_then(|mut v: Vec<Option<Vec<u8>>>| v.pop().flatten())
    }

    /// Open state, running totals and latencies.
    pub fn stats(&self) -> Result<NodeStats, NodeError> {
        self.calls.ask(|reply| Command::Stats { reply }, None)
    }

    /// Which of `keys` the store holds readable (a cheap check: no bytes copied).
    pub fn contains(&self, keys: &[OffloadKey]) -> Result<Vec<bool>, NodeError> {
        self.calls.ask(
            |reply| Command::Contains {
                keys: keys.to_vec(),
                tenant_of: None,
                reply,
            },
            None,
        )
    }

    /// Which of `keys` the store holds readable in `peer`'s tenant (where a block fetched from
    /// `peer` goes: a node without a tenant of its own keeps tenants apart, docs/security.md,
    /// "Tenants"); as [`contains`](Node::contains) on a node that keeps none.
    pub fn contains_for(&self, peer: &PeerId, keys: &[OffloadKey]) -> Result<Vec<bool>, NodeError> {
        self.calls.ask(
            |reply| Command::Contains {
                keys: keys.to_vec(),
                tenant_of: Some(peer.clone()),
                reply,
            },
            None,
        )
    }

    /// Which of `keys` the store holds readable, each held one becoming the most recently used
    /// (an engine's own prefix hit, as vLLM's CPU tier marks one; [`contains`](Node::contains)
    /// leaves the eviction order alone).
    pub fn touch(&self, keys: &[OffloadKey]) -> Result<Vec<bool>, NodeError> {
        self.calls.ask(
            |reply| Command::Touch {
                keys: keys.to_vec(),
                reply,
            },
            None,
        )
    }

    /// What the store took in and let go since the last call, in order, and how many changes
    /// were dropped for room. The first call starts the store's change log (at most `max`
    /// changes kept between two calls); before it nothing is recorded. The pool node
    /// publishes these as its KV events (`kvpeer::pool_node`).
    pub fn take_store_changes(
        &self,
        max: usize,
    ) -> Result<(Vec<kvpeer_store::KeyChange>, u64), NodeError> {
        self.calls
            .ask(|reply| Command::TakeChanges { max, reply }, None)
    }

    /// The data planes this node advertises to peers.
    pub fn advertised(&self) -> &Advertised {
        &self.advertised
    }

    /// Drains inflight transfers for at most `drain`, sends `disconnect` to every peer, and
    /// stops the runtime thread. The pool is released when the last handle goes.
    pub fn shutdown(&self, drain: Duration) {
        let (tx, rx) = channel();
        self.calls.tell(Command::Shutdown { drain, reply: tx });
        let _ = rx.recv_timeout(drain + Duration::from_secs(5));
        if let Some(thread) = self.thread.lock().ok().and_then(|mut t| t.take()) {
            let _ = thread.join();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let running = self.thread.lock().ok().is_some_and(|t| t.is_some());
        if running {
            self.shutdown(Duration::from_secs(3));
        }
    }
}
