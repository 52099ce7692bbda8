//! The control channel: ZMTP 3.1 spoken by kvpeer itself, wire-compatible with vLLM's
//! `ZmqTransport` (libzmq ROUTER and DEALER sockets), with no libzmq and no I/O thread.
//!
//! * The listening side is kvpeer's own ZMTP ([`Inbound`]) at `host:port`, which is the node's
//!   identity; it behaves as libzmq's ROUTER on the wire, but every message comes with the
//!   connection it arrived on, the identity that connection claimed and its source address, and
//!   the node can close one connection. Several connections may claim one identity; none locks
//!   another out (libzmq's ROUTER ignores all but the first: docs/security.md). Messages of any
//!   shape but one frame are dropped.
//! * One DEALER connection per peer (`outbound.rs`: a `Dialer` (`zmtp/dialer.rs`) whose connection speaks the control DEALER's role),
//!   connected to the peer's ROUTER with `Identity` = our identity; each message is one frame
//!   (a msgpack payload). Sends never block and are written at once when the connection is
//!   idle; a full queue (`send_queue`, 1000 messages, libzmq's `SNDHWM`) marks the connection
//!   lost, as vLLM does.
//! * Heartbeats 2 s / 10 s / 10 s on both sides; closed connections linger 500 ms; frames over
//!   `max_message_bytes` (default 64 MiB) are refused from their header: the connection that
//!   announced one is closed (a 1 TiB header included) and everyone else is served.
//! * An outbound connection that fails to connect, or fails once connected (end of stream,
//!   error, handshake or protocol failure, heartbeat timeout), is lost
//!   ([`ChannelEvent::Lost`], as libzmq's socket monitor reported CLOSED or DISCONNECTED) and
//!   dropped; a connect that cannot even start (no descriptor) is retried every 100 ms.
//! * Dial-back is lazy: sending to a peer without a connection opens one (to the peer's
//!   identity, `host:port`). The core opens a session only on a `connect`, so junk never makes
//!   us dial.
//!
//! Owned by the node's runtime thread. [`ControlChannel::wait`] sleeps in the channel's one
//! epoll set (every socket of both sides, registered once, and the caller's extra descriptor)
//! until something is ready or the nearest deadline (heartbeats, handshakes, retries, lingers)
//! or the timeout passes; [`ControlChannel::recv`] then drives only the connections the poll
//! or a deadline named, so a wake's cost does not grow with the number of peers. Nothing else
//! blocks, except dropping the channel, which gives queued messages up to `linger` to leave,
//! as libzmq's `zmq_ctx_term` did.

mod hosts;
pub mod inbound;
mod outbound;
mod siblings;

use std::net::IpAddr;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::time::{Duration, Instant};

use kvpeer_core::{DialFailure, LinkLoss, SendFailure};
use kvpeer_proto::{Message, PeerId};
use tracing::{debug, warn};

use crate::control::inbound::{Inbound, InboundEvent, InboundLimits};
pub use crate::control::outbound::DialStage;
use crate::control::outbound::{Outbound, OutboundConfig};
use crate::io::poller::{Poller, Ready, Token};
use crate::zmtp::connection::{ConnLimits, QueueFull, QueueWithError};
pub use inbound::ConnId;
pub use siblings::{SiblingGroup, MAX_MEMBERS as MAX_SIBLINGS};

/// Settings of the control channel; `Default` is vLLM's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlConfig {
    /// Heartbeat interval (`ZMQ_HEARTBEAT_IVL`).
    pub heartbeat_interval: Duration,
    /// Heartbeat timeout (`ZMQ_HEARTBEAT_TIMEOUT`).
    pub heartbeat_timeout: Duration,
    /// Heartbeat TTL told to the peer (`ZMQ_HEARTBEAT_TTL`).
    pub heartbeat_ttl: Duration,
    /// How long an outbound connection's handshake may take once TCP is connected
    /// (`ZMQ_HANDSHAKE_IVL`).
    pub handshake_timeout: Duration,
    /// How soon an outbound connect that could not start (no descriptor) is tried again
    /// (`ZMQ_RECONNECT_IVL`).
    pub reconnect_interval: Duration,
    /// Messages queued per peer before a send fails (`ZMQ_SNDHWM`; 0 or less: no limit, as
    /// libzmq).
    pub send_queue: i32,
    /// Bytes queued unwritten per peer before a send fails and the connection closes (libzmq
    /// bounds messages only; kvpeer bounds both, so a peer that never reads costs a bounded
    /// amount of memory).
    pub send_queue_bytes: usize,
    /// How long unsent messages linger after an outbound connection closes (`ZMQ_LINGER`).
    pub linger: Duration,
    /// Largest frame accepted (`ZMQ_MAXMSGSIZE`).
    pub max_message_bytes: i64,
    /// Inbound connections at once.
    pub max_inbound: usize,
    /// Inbound connections at once from one source address.
    pub max_inbound_per_source: usize,
    /// Bytes read from one inbound connection per round, so one busy peer cannot starve the
    /// others: each round reads every ready connection once more, so a peer flooding at full
    /// speed delays the others by what this many bytes of its messages cost (measured: 8 MiB
    /// let a junk flood push an honest peer's lookup p99 far past the rest;
    /// scripts/bench-fairness.sh).
    pub inbound_read_budget: usize,
    /// Messages taken from one inbound connection per round: what else it sent waits for the
    /// next round (which comes at once), so a peer sending tiny messages at full speed delays
    /// each other connection by at most this many messages' work per round.
    pub inbound_messages_per_round: usize,
    /// Inbound connections accepted per round: a burst of new connections (a flooder's) is
    /// taken a few at a time, the connections already open read in between.
    pub inbound_accepts_per_round: usize,
    /// The node's time one inbound connection's messages are given per round (deficit round
    /// robin on what [`ControlChannel::charge_inbound`] reports): a peer whose messages are
    /// expensive or many delays each other connection by about this much per round.
    pub inbound_round_quantum: Duration,
    /// The node's time one inbound connection's messages may take per second: past it the
    /// connection is not read until its share refills, so one peer cannot keep the node's thread
    /// (and the core it shares with the engine and other peers' processes) busy.
    pub inbound_time_per_second: Duration,
    /// Host liveness (`control/hosts.rs`): how long the other connections to a host that lost
    /// one may take to answer a probe before they are lost too (zero: off, each connection
    /// lives and dies by its own heartbeat).
    pub host_probe_timeout: Duration,
    /// How long a host that lost a connection, with nothing on it answering since, is not
    /// dialed (new connections to it fail at once).
    pub host_down_hold: Duration,
    /// The engine's other ranks on this host, told of and telling about lost hosts
    /// (`control/siblings.rs`; `None`: this node alone).
    pub siblings: Option<SiblingGroup>,
    /// TLS on the control channel (`None`: plaintext ZMTP, as vLLM speaks): the node's
    /// certificate and the policy toward peers ([`ControlTls`]).
    pub tls: Option<ControlTls>,
}

/// TLS 1.3 with mutual authentication on the control channel, under a policy:
/// * the listener offers TLS at accept, in its greeting's signature ([`crate::zmtp::TLS_OFFER`]),
///   takes a connection that then opens with a TLS handshake over TLS (the client's
///   certificate must chain to the CA and name the IP of the identity its READY claims), and a
///   plaintext one (a vLLM engine, a kvpeer with TLS off) only where the policy is not `required`;
/// * the dialer sends nothing until the listener's signature came: an offer, and it opens TLS
///   (the listener's certificate must name the IP dialed); a peer that greets without one is
///   talked to in clear on that connection where the policy is `preferred` (logged,
///   rate-limited; each new connection looks again), and lost where it is `required`. A
///   libzmq peer never sees a TLS byte.
///
/// So a `connect`'s tokens, keys and proofs and every lookup's keys travel inside TLS between
/// kvpeer nodes. With `off` there is no `ControlTls` at all.
#[derive(Debug, Clone)]
pub struct ControlTls {
    /// The node's certificate, key and CA (shared with the tcp data plane).
    pub tls: crate::tls::Tls,
    /// `preferred` or `required` (`off` is no `ControlTls`).
    pub policy: crate::tls::TlsPolicy,
}

impl PartialEq for ControlTls {
    fn eq(&self, other: &Self) -> bool {
        self.tls.files() == other.tls.files() && self.policy == other.policy
    }
}

impl Eq for ControlTls {}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            heartbeat_interval: Duration::from_secs(2),
            heartbeat_timeout: Duration::from_secs(10),
            heartbeat_ttl: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(30),
            reconnect_interval: Duration::from_millis(100),
            send_queue: 1000,
            send_queue_bytes: 16 << 20,
            linger: Duration::from_millis(500),
            max_message_bytes: 16 << 20,
            max_inbound: 1024,
            max_inbound_per_source: 64,
            inbound_read_budget: 256 << 10,
            inbound_messages_per_round: 128,
            inbound_accepts_per_round: 16,
            inbound_round_quantum: Duration::from_micros(100),
            inbound_time_per_second: Duration::from_millis(150),
            host_probe_timeout: Duration::from_secs(1),
            host_down_hold: Duration::from_secs(5),
            siblings: None,
            tls: None,
        }
    }
}

/// Why the channel failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// The identity is not `host:port`.
    #[error("identity {0:?} is not host:port")]
    BadIdentity(String),
    /// The listening socket could not be bound.
    #[error("cannot listen at {addr}: {source}")]
    Bind {
        /// Where.
        addr: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// Waiting on the sockets failed.
    #[error("cannot wait on the control sockets: {0}")]
    Wait(#[source] std::io::Error),
}

/// Something that happened on the channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChannelEvent {
    /// A payload from a peer (its identity, as the peer set it).
    Payload {
        /// Who sent it: the identity its connection claims (nothing proves it; see `source`).
        peer: PeerId,
        /// The inbound connection it came on.
        conn: ConnId,
        /// The TCP source address of that connection: where the message really came from.
        source: IpAddr,
        /// The msgpack bytes.
        payload: Vec<u8>,
    },
    /// An inbound connection is gone (closed by the peer, heartbeat or handshake timeout,
    /// bad bytes). The session it carried, if any, learns it from its outbound side.
    InboundClosed {
        /// The connection.
        conn: ConnId,
        /// The identity it claimed, if it got that far.
        peer: Option<PeerId>,
    },
    /// The outbound connection to a peer is gone (it could not connect, or failed once
    /// connected); it is closed, and the next send dials afresh.
    Lost {
        /// The peer.
        peer: PeerId,
        /// How it went away.
        cause: LinkLoss,
    },
}

/// Host liveness's counts ([`ControlChannel::host_liveness`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HostLiveness {
    /// Probe rounds started (a connection to a host lost, or another rank said so).
    pub probe_rounds: u64,
    /// Connections ended because they answered no probe after another to their host was lost.
    pub probe_losses: u64,
    /// Dials refused at once because their host was taken for down.
    pub refused_dials: u64,
    /// Hosts taken for down now.
    pub hosts_down: usize,
    /// Datagrams from the liveness group dropped (malformed, or from another user).
    pub sibling_datagrams_refused: u64,
}

/// Why a send failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The peer's queue is full or its socket failed: the connection is lost.
    #[error("send to {peer} failed: {cause}")]
    Lost {
        /// The peer.
        peer: PeerId,
        /// What happened: the connection is closed.
        cause: LinkLoss,
    },
}

impl SendError {
    /// How the connection was lost.
    pub fn into_cause(self) -> LinkLoss {
        match self {
            SendError::Lost { cause, .. } => cause,
        }
    }
}

/// The channel's tokens: the caller's extra descriptor, the siblings' socket, then a span for
/// each side.
const EXTRA: Token = 0;
const SIBLINGS: Token = 1;
const INBOUND: Token = 1 << 48;
const OUTBOUND: Token = 2 << 48;
const SPAN: u64 = (1 << 48) - 1;

/// The control channel of one node.
pub struct ControlChannel {
    poller: Poller,
    inbound: Inbound,
    outbound: Outbound,
    identity: PeerId,
    /// The caller's extra descriptor registered in the poll, if any.
    extra: Option<RawFd>,
    /// What the last wait reported (reused).
    ready: Vec<Ready>,
    /// A wait took the poll's news since the last `recv` (else `recv` takes it itself).
    waited: bool,
    /// The extra descriptor was reported readable since [`ControlChannel::take_extra_ready`].
    extra_ready: bool,
    /// The engine's other ranks on this host, if configured.
    siblings: Option<siblings::Siblings>,
    /// Their socket was reported readable.
    siblings_ready: bool,
}

impl std::fmt::Debug for ControlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlChannel")
            .field("identity", &self.identity)
            .field("inbound", &self.inbound)
            .field("outbound", &self.outbound)
            .finish()
    }
}

fn limits(config: &ControlConfig) -> InboundLimits {
    InboundLimits {
        max_message_bytes: u64::try_from(config.max_message_bytes).unwrap_or(0),
        heartbeat_interval: config.heartbeat_interval,
        heartbeat_timeout: config.heartbeat_timeout,
        heartbeat_ttl: config.heartbeat_ttl,
        max_connections: config.max_inbound,
        max_per_source: config.max_inbound_per_source,
        // Eight messages of the largest size buffered at once, across every peer (a buffer may
        // hold up to twice its message while it grows).
        max_buffered_bytes: usize::try_from(config.max_message_bytes)
            .unwrap_or(usize::MAX)
            .saturating_mul(8),
        read_budget: config.inbound_read_budget,
        messages_per_round: config.inbound_messages_per_round,
        accepts_per_round: config.inbound_accepts_per_round,
        round_quantum: config.inbound_round_quantum,
        time_per_second: config.inbound_time_per_second,
    }
}

fn outbound_config(config: &ControlConfig) -> OutboundConfig {
    OutboundConfig {
        conn: ConnLimits {
            max_message_bytes: u64::try_from(config.max_message_bytes).unwrap_or(0),
            heartbeat_interval: config.heartbeat_interval,
            heartbeat_timeout: config.heartbeat_timeout,
            heartbeat_ttl: config.heartbeat_ttl,
            handshake_timeout: config.handshake_timeout,
            send_queue: match usize::try_from(config.send_queue) {
                Ok(n) if n > 0 => n,
                _ => usize::MAX,
            },
            send_queue_bytes: config.send_queue_bytes.max(1),
            // A DEALER of the control channel keeps nothing it reads.
            max_incoming: usize::MAX,
        },
        linger: config.linger,
        reconnect_interval: config.reconnect_interval,
        host_probe_timeout: config.host_probe_timeout,
        host_down_hold: config.host_down_hold,
    }
}

fn listen(addr: &str, config: &ControlConfig) -> Result<(Poller, Inbound), ControlError> {
    let bind = |source| ControlError::Bind {
        addr: addr.to_owned(),
        source,
    };
    let poller = Poller::new().map_err(bind)?;
    let mut inbound = Inbound::bind(addr, limits(config), &poller, INBOUND).map_err(bind)?;
    inbound.set_tls(config.tls.clone());
    Ok((poller, inbound))
}

impl ControlChannel {
    /// Listens at `identity` (`host:port`, used verbatim: peers dial it back).
    pub fn bind(identity: PeerId, config: ControlConfig) -> Result<Self, ControlError> {
        identity
            .host_port()
            .map_err(|_| ControlError::BadIdentity(identity.to_string()))?;
        let (poller, inbound) = listen(identity.as_str(), &config)?;
        Self::new(poller, inbound, identity, config)
    }

    /// Listens at `host` on a port the system picks; the identity is `host:port`.
    pub fn bind_any_port(host: &str, config: ControlConfig) -> Result<Self, ControlError> {
        let (poller, inbound) = listen(PeerId::from_host_port(host, 0).as_str(), &config)?;
        let port = inbound.port().map_err(|source| ControlError::Bind {
            addr: host.to_owned(),
            source,
        })?;
        let identity = PeerId::from_host_port(host, port);
        identity
            .host_port()
            .map_err(|_| ControlError::BadIdentity(identity.to_string()))?;
        Self::new(poller, inbound, identity, config)
    }

    /// Listens at `at` (a wildcard address, or another than the identity's) as `identity`,
    /// the address peers dial; an identity with port 0 (`host:0`) takes the port bound.
    pub fn bind_at(
        at: std::net::SocketAddr,
        identity: &PeerId,
        config: ControlConfig,
    ) -> Result<Self, ControlError> {
        let (poller, inbound) = listen(&at.to_string(), &config)?;
        let identity = match identity.as_str().strip_suffix(":0") {
            Some(host) => {
                let port = inbound.port().map_err(|source| ControlError::Bind {
                    addr: at.to_string(),
                    source,
                })?;
                PeerId::from_host_port(host, port)
            }
            None => identity.clone(),
        };
        identity
            .host_port()
            .map_err(|_| ControlError::BadIdentity(identity.to_string()))?;
        Self::new(poller, inbound, identity, config)
    }

    fn new(
        poller: Poller,
        mut inbound: Inbound,
        identity: PeerId,
        config: ControlConfig,
    ) -> Result<Self, ControlError> {
        inbound.announce(&identity);
        // The group is a help, never a condition of running: a rank that cannot join it
        // (another process holds its name: a rank of the engine's previous run not gone yet,
        // or anyone who took the name first) runs alone, saying so.
        let siblings = config.siblings.as_ref().and_then(|group| {
            let joined = siblings::Siblings::bind(group.clone())
                .and_then(|joined| poller.add_input(joined.fd(), SIBLINGS).map(|()| joined));
            match joined {
                Ok(joined) => Some(joined),
                Err(e) => {
                    warn!(group = %group.name, rank = group.index, error = %e,
                        "cannot join the engine's liveness group; this rank hears of lost hosts only from its own connections");
                    None
                }
            }
        });
        Ok(ControlChannel {
            poller,
            inbound,
            outbound: {
                let mut outbound = Outbound::new(&identity, outbound_config(&config), OUTBOUND);
                outbound.set_tls(config.tls.clone());
                outbound
            },
            identity,
            extra: None,
            ready: Vec::new(),
            waited: false,
            extra_ready: true,
            // Anything sent before the socket was polled is read at the first `recv`.
            siblings_ready: siblings.is_some(),
            siblings,
        })
    }

    /// Host liveness so far: connections ended by an unanswered probe, dials refused to a
    /// host taken for down, hosts taken for down now, and datagrams from the engine's other
    /// ranks dropped (malformed, or from another user).
    pub fn host_liveness(&self) -> HostLiveness {
        let (probe_rounds, probe_losses, refused_dials) = self.outbound.host_liveness_counts();
        HostLiveness {
            probe_rounds,
            probe_losses,
            refused_dials,
            hosts_down: self.outbound.hosts_down(Instant::now()),
            sibling_datagrams_refused: self.siblings.as_ref().map_or(0, |s| s.refused()),
        }
    }

    /// This node's identity.
    pub fn identity(&self) -> &PeerId {
        &self.identity
    }

    /// Whether our ready connection to `peer` runs over TLS (`None`: none is ready).
    pub fn outbound_tls(&self, peer: &PeerId) -> Option<bool> {
        self.outbound.tls_of(peer)
    }

    /// Whether inbound connection `conn` runs over TLS (`None`: no such connection).
    pub fn inbound_tls(&self, conn: ConnId) -> Option<bool> {
        self.inbound.is_tls(conn)
    }

    /// Closes inbound connection `conn` (a connection the node will not hear).
    pub fn close_inbound(&mut self, conn: ConnId) {
        self.inbound.close(conn);
    }

    /// Closes inbound connection `conn` after telling the peer why (a ZMTP ERROR carrying
    /// `reason`, which a kvpeer dialer reports as [`LinkLoss::RefusedByPeer`]).
    pub fn refuse_inbound(&mut self, conn: ConnId, reason: &str) {
        self.inbound.refuse(conn, reason);
    }

    /// How long unsent bytes may linger after a connection is closed (`ControlConfig::linger`).
    pub fn linger(&self) -> Duration {
        self.outbound.linger()
    }

    /// Inbound connections open now.
    pub fn inbound_connections(&self) -> usize {
        self.inbound.connections()
    }

    /// Rounds an inbound connection was held back for its host's time share
    /// (`inbound_time_per_second`) while another host under its share waited: zero while no
    /// host competes, however busy one is.
    pub fn inbound_held_back(&self) -> u64 {
        self.inbound.held_back()
    }

    /// Outbound connections held now, lingering ones included.
    pub fn outbound_connections(&self) -> usize {
        self.outbound.connections()
    }

    /// Whether the outbound connection to `peer` finished its handshake and, if so, the
    /// challenge the peer's READY gave (a kvpeer node gives one per connection; other ROUTERs
    /// none): `None` while no connection to `peer` is ready.
    pub fn outbound_challenge(&self, peer: &PeerId) -> Option<Option<&[u8]>> {
        self.outbound.ready_challenge(peer)
    }

    /// Handling one message that came on inbound connection `conn` cost the caller `cost`
    /// (see [`ControlConfig::inbound_round_quantum`]).
    pub fn charge_inbound(&mut self, conn: ConnId, cost: Duration) {
        self.inbound.charge(conn, cost);
    }

    /// The challenge this node's READY gave inbound connection `conn` (`None` once it closed).
    pub fn inbound_challenge(&self, conn: ConnId) -> Option<&[u8]> {
        self.inbound.challenge(conn)
    }

    /// Marks whether a live session is bound to inbound connection `conn`: when the listener
    /// is full, a newcomer evicts connections without a session first.
    pub fn set_holds_session(&mut self, conn: ConnId, holds: bool) {
        self.inbound.set_holds_session(conn, holds);
    }

    /// Pauses inbound connection `conn` or resumes it: while paused it is not read and none of
    /// its messages are delivered (its heartbeats and deadlines still run; a lost peer's
    /// connections are still read to their end). For a node still working off a message of it
    /// (a large one decoded a slice at a time): what the peer sends meanwhile waits in its
    /// socket, its own backpressure, instead of queueing in the node.
    pub fn pause_inbound(&mut self, conn: ConnId, paused: bool) {
        self.inbound.set_paused(conn, paused);
    }

    /// How far the outbound connection to `peer` got (`None`: there is none).
    pub fn outbound_stage(&self, peer: &PeerId) -> Option<DialStage> {
        self.outbound.stage(peer)
    }

    /// Whether an outbound connection to `peer` is open.
    pub fn connected(&self, peer: &PeerId) -> bool {
        self.outbound.connected(peer)
    }

    /// Whether the outbound connection to `peer` is ready and its socket has not seen the
    /// peer's end of stream (checked now, not at the last round).
    pub fn outbound_open(&self, peer: &PeerId) -> bool {
        self.outbound.ready_and_open(peer)
    }

    /// Opens an outbound connection to `peer` (no-op if open). Never blocks: messages queue
    /// until TCP connects and the handshake is done.
    pub fn dial(&mut self, peer: &PeerId) -> Result<(), DialFailure> {
        if self.outbound.connected(peer) {
            return Ok(());
        }
        peer.host_port()?;
        self.outbound.dial(&self.poller, peer, Instant::now());
        Ok(())
    }

    /// Closes the outbound connection to `peer` (queued messages linger up to `linger`).
    pub fn close(&mut self, peer: &PeerId) {
        self.outbound.close(peer, Instant::now());
    }

    /// Sends one payload to `peer`, opening a connection to it first if needed. Never blocks.
    pub fn send(&mut self, peer: &PeerId, payload: &[u8]) -> Result<(), SendError> {
        self.dial_if_unconnected(peer)?;
        match self
            .outbound
            .send(&self.poller, peer, payload, Instant::now())
        {
            Ok(()) => Ok(()),
            Err(QueueFull) => Err(self.lost_to_a_full_queue(peer)),
        }
    }

    /// Encodes `message` straight into `peer`'s queue and sends it as [`ControlChannel::send`]
    /// does: a large answer is not encoded into a buffer of its own and copied from there.
    /// A message that does not encode fails the send (nothing of it is queued).
    pub fn send_message(&mut self, peer: &PeerId, message: &Message) -> Result<(), SendError> {
        self.dial_if_unconnected(peer)?;
        let sent = self.outbound.send_with(
            &self.poller,
            peer,
            message.encoded_len_hint(),
            |out| message.encode_into(out),
            Instant::now(),
        );
        match sent {
            Ok(()) => Ok(()),
            Err(QueueWithError::Body(e)) => Err(SendError::Lost {
                peer: peer.clone(),
                cause: LinkLoss::SendFailed(SendFailure::Encode(e)),
            }),
            Err(QueueWithError::Full) => Err(self.lost_to_a_full_queue(peer)),
        }
    }

    /// Dials `peer` unless a connection to it is open (a send's first step).
    fn dial_if_unconnected(&mut self, peer: &PeerId) -> Result<(), SendError> {
        if self.outbound.connected(peer) {
            return Ok(());
        }
        self.dial(peer).map_err(|e| SendError::Lost {
            peer: peer.clone(),
            cause: LinkLoss::DialFailed(e),
        })
    }

    /// A send found `peer`'s queue full: the connection is closed, and why is told once.
    fn lost_to_a_full_queue(&mut self, peer: &PeerId) -> SendError {
        if let Some(suppressed) = crate::admit_warning("control send failed; connection lost") {
            warn!(%peer, suppressed, "control send queue full; connection lost");
        }
        self.close(peer);
        SendError::Lost {
            peer: peer.clone(),
            cause: LinkLoss::SendFailed(SendFailure::QueueFull),
        }
    }

    /// Sleeps until a payload or a lost connection may be ready, or `timeout` passes.
    pub fn wait(&mut self, timeout: Duration) -> Result<bool, ControlError> {
        self.wait_with(timeout, None)
    }

    /// As [`ControlChannel::wait`], also waking when `extra` (a file descriptor, e.g. the read
    /// end of the data plane's wake pipe, open as long as the channel) becomes readable. The
    /// descriptor is registered in the channel's poll the first time it is given (edge-
    /// triggered: the caller reads it until empty after each wake).
    pub fn wait_with(
        &mut self,
        timeout: Duration,
        extra: Option<RawFd>,
    ) -> Result<bool, ControlError> {
        if let Some(fd) = extra.filter(|fd| self.extra != Some(*fd)) {
            // SAFETY: the caller keeps `extra` open as long as the channel (the documented
            // contract); epoll only records the number, and a closed descriptor leaves the set
            // by itself.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            self.poller
                .add_input(borrowed, EXTRA)
                .map_err(ControlError::Wait)?;
            self.extra = Some(fd);
        }
        let now = Instant::now();
        let timeout = self
            .next_deadline(now)
            .map_or(timeout, |at| at.saturating_duration_since(now).min(timeout));
        let (woke, result) = self.take_news(timeout);
        result.map_err(ControlError::Wait)?;
        Ok(woke || timeout.is_zero())
    }

    /// What a thread that waits for this channel outside its owner's lock needs (an engine's
    /// I/O thread, `kvpeer-py`'s `EngineTier`): the epoll set's descriptor, readable while a
    /// registered socket (or the extra descriptor) has news, and when the channel's own
    /// deadlines (heartbeats, handshakes, retries, lingers, news left from the last round) next
    /// want a call to [`ControlChannel::recv`]. The descriptor stays valid while the channel
    /// lives.
    pub fn wait_plan(&mut self, now: Instant) -> (RawFd, Option<Instant>) {
        (self.poller.fd().as_raw_fd(), self.next_deadline(now))
    }

    /// When the channel next wants a call to [`ControlChannel::recv`]: heartbeats, handshakes,
    /// retries and lingers, and `now` for news not yet handled (a connection with input left
    /// from its last round, a loss to report).
    fn next_deadline(&mut self, now: Instant) -> Option<Instant> {
        if self.siblings_ready && self.siblings.is_some() {
            // Announcements left unread by the last round (the poll reports only new ones).
            return Some(now);
        }
        [
            self.inbound.next_deadline(now),
            self.outbound.next_deadline(now),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Waits up to `timeout` for the poll's news and hands it to the sides; whether there was
    /// any.
    fn take_news(&mut self, timeout: Duration) -> (bool, std::io::Result<()>) {
        let mut ready = std::mem::take(&mut self.ready);
        ready.clear();
        let result = self.poller.wait(timeout, &mut ready);
        for r in &ready {
            self.dispatch(*r);
        }
        let woke = !ready.is_empty();
        self.ready = ready;
        self.waited = true;
        (woke, result)
    }

    /// Hands one readiness to the side whose token it is.
    fn dispatch(&mut self, ready: Ready) {
        if ready.token == EXTRA {
            self.extra_ready = true;
            return;
        }
        if ready.token == SIBLINGS {
            self.siblings_ready = true;
            return;
        }
        if self.inbound.owns(ready.token, SPAN) {
            self.inbound.on_ready(ready);
        } else if self.outbound.owns(ready.token, SPAN) {
            self.outbound.on_ready(ready);
        }
    }

    /// Whether the extra descriptor was reported readable since the last call (the poll is
    /// consulted by every `recv`): the caller reads it until empty only then, which saves a
    /// system call on every other wake.
    pub fn take_extra_ready(&mut self) -> bool {
        std::mem::take(&mut self.extra_ready)
    }

    /// Everything that arrived, without blocking: payloads and closes of inbound connections,
    /// lost outbound connections (after the inbound ones: see below). Only the connections the
    /// poll reported (at the last wait, or now if there was none since the last call), or
    /// whose deadline is due, are driven.
    pub fn recv(&mut self) -> Vec<ChannelEvent> {
        if !self.waited {
            // No wait since the last call: take what the poll has now.
            let (_, result) = self.take_news(Duration::ZERO);
            if let Err(e) = result {
                warn!(error = %e, "cannot take the control sockets' news");
            }
        }
        self.waited = false;
        let now = Instant::now();
        self.outbound.progress(&self.poller, now);
        // Inbound connections are read first, and a lost peer's to the end, whatever their
        // shares: a peer's last messages (its `disconnect`) were sent before its connection
        // closed and must be handled first.
        let lost = self.outbound.lost_peers();
        let mut happened = Vec::new();
        self.inbound
            .progress(&self.poller, now, &lost, &mut happened);
        let mut events: Vec<ChannelEvent> = happened
            .into_iter()
            .map(|e| match e {
                InboundEvent::Payload {
                    conn,
                    peer,
                    source,
                    payload,
                } => ChannelEvent::Payload {
                    peer,
                    conn,
                    source,
                    payload,
                },
                InboundEvent::Closed { conn, peer } => ChannelEvent::InboundClosed { conn, peer },
            })
            .collect();
        events.extend(
            self.outbound
                .take_losses(now)
                .into_iter()
                .map(|(peer, cause)| ChannelEvent::Lost { peer, cause }),
        );
        self.exchange_with_siblings(now);
        events
    }

    /// Tells the engine's other ranks of this round's lost hosts, and takes what they told
    /// (their probes' losses come with a later round).
    fn exchange_with_siblings(&mut self, now: Instant) {
        let told = self.outbound.take_announcements();
        let Some(siblings) = &mut self.siblings else {
            return;
        };
        for (host, sign) in told {
            siblings.announce(host, sign);
        }
        if std::mem::take(&mut self.siblings_ready) {
            let mut heard = Vec::new();
            // More may wait (the poll is edge-triggered): look again next round, at once.
            self.siblings_ready = siblings.take(&mut heard);
            for (host, sign) in heard {
                self.outbound.on_announcement(host, sign, now);
            }
        }
    }
}

impl Drop for ControlChannel {
    /// Closes every outbound connection and gives their queued messages up to `linger` to
    /// leave, blocking (the channel is going away), as `zmq_ctx_term` did.
    fn drop(&mut self) {
        let start = Instant::now();
        self.outbound.close_all(start);
        let deadline = start + self.outbound.linger();
        let mut ready = Vec::new();
        while self.outbound.connections() > 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let wait = self
                .outbound
                .next_deadline(now)
                .unwrap_or(deadline)
                .min(deadline)
                .saturating_duration_since(now);
            ready.clear();
            if self.poller.wait(wait, &mut ready).is_err() {
                break;
            }
            for r in &ready {
                if self.outbound.owns(r.token, SPAN) {
                    self.outbound.on_ready(*r);
                }
            }
            self.outbound.progress(&self.poller, Instant::now());
        }
        if self.outbound.connections() > 0 {
            debug!(
                connections = self.outbound.connections(),
                "control messages still unsent when the channel closed"
            );
        }
    }
}
