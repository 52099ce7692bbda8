//! The control channel's listening side: a `Listener` (`zmtp/listener.rs`) of ZMTP connections in the control
//! ROUTER's [`Role`], on the node's thread.
//!
//! libzmq's ROUTER routes by the identity a peer claims and hides everything else: a silent
//! connection that claims identity X first locks the real X out, and the application can
//! neither see that connection nor close it (docs/security.md). Here every inbound connection
//! is kvpeer's own, so each message comes with the connection it arrived on (a [`ConnId`]),
//! the identity that connection claimed and its source address, and the node decides which
//! connection holds a session (several may claim one identity; none blocks another) and
//! closes the others.
//!
//! Speaks to libzmq 4.3 DEALERs (vLLM's `ZmqTransport`, pyzmq) and kvpeer's own (`dealer.rs`)
//! as a libzmq ROUTER does: ZMTP 3.1, NULL mechanism, READY with `Socket-Type: ROUTER`, PONG
//! for every PING, our own PINGs every `heartbeat_interval` with `heartbeat_ttl`
//! ([`Connection`](crate::zmtp::connection::Connection) is the protocol, as for every other socket).
//! What this file adds to the listener: the identity a READY claims must be `host:port`, a
//! message must be one frame (others are dropped), each connection gets a fresh challenge
//! ([`zmtp::CHALLENGE_PROPERTY`](crate::zmtp::CHALLENGE_PROPERTY)) a kvpeer peer's proofs are
//! made for ([`Inbound::challenge`]), and a connection bound to a session is evicted after
//! every other of its source ([`Inbound::set_holds_session`]). Every bound (connections in all
//! and per source, work per round, buffers, deadlines) is the listener's; the node reports what
//! each message cost it ([`Inbound::charge`]), so each connection's round is about
//! `round_quantum` of the node's time, whatever its messages cost.
//!
//! Owned by the node's runtime thread with the rest of the channel; every socket is
//! non-blocking and registered in the channel's one poll, so nothing here blocks.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant};

use kvpeer_core::LinkLoss;
use kvpeer_proto::PeerId;
use tracing::warn;

use crate::io::poller::{Poller, Ready, Token};
use crate::zmtp::connection::{ConnLimits, Incoming, Role};
use crate::zmtp::listener::{LinkEvent, Listener, ListenerLimits, TlsState};

pub use crate::zmtp::listener::ConnId;

/// Bounds of the listening side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundLimits {
    /// Largest message accepted.
    pub max_message_bytes: u64,
    /// How often an idle connection is pinged.
    pub heartbeat_interval: Duration,
    /// How long a PING may go unanswered, and the handshake and a write stall may take.
    pub heartbeat_timeout: Duration,
    /// The TTL our PINGs tell the peer.
    pub heartbeat_ttl: Duration,
    /// Inbound connections at once.
    pub max_connections: usize,
    /// Inbound connections at once from one source address.
    pub max_per_source: usize,
    /// Bytes all connections may hold buffered together (partial messages); over it, the
    /// connection holding the most is closed.
    pub max_buffered_bytes: usize,
    /// Bytes read from one connection per round.
    pub read_budget: usize,
    /// Messages taken from one connection per round.
    pub messages_per_round: usize,
    /// Connections accepted per round.
    pub accepts_per_round: usize,
    /// The node's time one connection's messages are given per round ([`Inbound::charge`]).
    pub round_quantum: Duration,
    /// The node's time one connection's messages may take per second.
    pub time_per_second: Duration,
}

/// What happened on the listening side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InboundEvent {
    /// A one-frame message from connection `conn`, which claimed identity `peer`.
    Payload {
        /// The connection.
        conn: ConnId,
        /// The identity its READY claimed.
        peer: PeerId,
        /// Its TCP source address.
        source: IpAddr,
        /// The frame.
        payload: Vec<u8>,
    },
    /// Connection `conn` (which claimed `peer`, if it got that far) is gone.
    Closed {
        /// The connection.
        conn: ConnId,
        /// Its identity, once READY.
        peer: Option<PeerId>,
    },
}

/// The listener and its connections.
#[derive(Debug)]
pub struct Inbound {
    listener: Listener,
    /// The identity each READY connection claimed, and its source address (kept until its
    /// `Lost`, so messages of a round that also ended it are still delivered).
    identities: HashMap<ConnId, (PeerId, IpAddr)>,
    /// Plaintext connections are refused (TLS `required`).
    tls_required: bool,
}

impl Inbound {
    /// Listens on `addr` (`host:port`; port 0 picks one), registered in `poller` as `base`
    /// (its connections as `base + id`).
    pub(crate) fn bind(
        addr: &str,
        limits: InboundLimits,
        poller: &Poller,
        base: Token,
    ) -> std::io::Result<Self> {
        let addr: SocketAddr = addr.to_socket_addrs()?.next().ok_or_else(|| {
            std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                format!("{addr} resolves to no address"),
            )
        })?;
        let conn = ConnLimits {
            max_message_bytes: limits.max_message_bytes,
            heartbeat_interval: limits.heartbeat_interval,
            heartbeat_timeout: limits.heartbeat_timeout,
            heartbeat_ttl: limits.heartbeat_ttl,
            handshake_timeout: limits.heartbeat_timeout,
            // The ROUTER side sends no messages, only commands (one PONG pending at a time).
            send_queue: 1,
            send_queue_bytes: 1,
            max_incoming: limits.messages_per_round,
        };
        let listener = Listener::bind(
            addr,
            Role::control_router(),
            ListenerLimits {
                conn,
                max_connections: limits.max_connections,
                max_per_source: limits.max_per_source,
                stall_timeout: limits.heartbeat_timeout,
                read_budget: limits.read_budget,
                accepts_per_round: limits.accepts_per_round,
                max_buffered_bytes: limits.max_buffered_bytes,
                challenge: true,
                engage_on_request: false,
                round_quantum: Some(limits.round_quantum),
                time_per_second: Some(limits.time_per_second),
                // Sources are checked per message, against the identity each claims (the
                // node's `origin`), not at the accept.
                allowed_sources: None,
            },
            poller,
            base,
        )?;
        Ok(Inbound {
            listener,
            identities: HashMap::new(),
            tls_required: false,
        })
    }

    /// The port bound.
    pub fn port(&self) -> std::io::Result<u16> {
        Ok(self.listener.local_addr()?.port())
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.listener.connections()
    }

    /// Rounds a connection was held back for its host's time share while another host under
    /// its share waited.
    pub fn held_back(&self) -> u64 {
        self.listener.held_back()
    }

    /// Whether `token` is the listener's or one of its connections' (`span`: the channel's
    /// token space per side).
    pub(crate) fn owns(&self, token: Token, span: u64) -> bool {
        self.listener.owns(token, span)
    }

    /// What the channel's poll said of one of this side's tokens.
    pub(crate) fn on_ready(&mut self, ready: Ready) {
        self.listener.on_ready(ready);
    }

    /// When the next heartbeat or deadline falls due (`now` with news or a backlog).
    pub(crate) fn next_deadline(&mut self, now: Instant) -> Option<Instant> {
        self.listener.deadline(now, true)
    }

    /// Closes connection `conn` (no event: the caller asked).
    pub fn close(&mut self, conn: ConnId) {
        self.identities.remove(&conn);
        let mut ignored = Vec::new();
        self.listener
            .close(conn, LinkLoss::ClosedHere, &mut ignored);
    }

    /// Tells `identity` (the node's) in the READY of every connection accepted from now on, so
    /// a kvpeer dialer that named this node otherwise learns why no session follows.
    pub(crate) fn announce(&mut self, identity: &PeerId) {
        self.listener.announce(identity.as_str().as_bytes());
    }

    /// Takes TLS connections (the listener tells them by their first byte) under `tls`'s
    /// policy: a READY over TLS must come with a certificate that names the IP of the identity
    /// it claims; a plaintext one is refused where TLS is `required`.
    pub(crate) fn set_tls(&mut self, tls: Option<crate::control::ControlTls>) {
        self.tls_required = tls
            .as_ref()
            .is_some_and(|t| t.policy == crate::tls::TlsPolicy::Required);
        self.listener.set_tls(tls.map(|t| t.tls));
    }

    /// Whether connection `conn` runs over TLS (`None`: no such connection).
    pub(crate) fn is_tls(&self, conn: ConnId) -> Option<bool> {
        self.listener.is_tls(conn)
    }

    /// Why a connection whose READY claimed `peer` over `tls` may not speak for it (`None`:
    /// it may). Judged by what the connection was when its READY came, whether or not it is
    /// still open.
    fn tls_refusal(&self, tls: &TlsState, peer: &PeerId) -> Option<String> {
        match tls {
            TlsState::Plaintext if self.tls_required => {
                Some("this node takes TLS control connections only (tls = required)".to_owned())
            }
            TlsState::Plaintext => None,
            TlsState::Tls(_) => {
                let ip = kvpeer_proto::PeerAddr::of(peer)
                    .ok()
                    .and_then(|a| a.socket_addr())
                    .map(|a| a.ip().to_canonical());
                match ip {
                    Some(ip) if tls.names(ip) => None,
                    Some(_) => Some(format!(
                        "your TLS certificate does not name the IP address of {peer}, the identity your READY claims"
                    )),
                    None => Some(format!(
                        "{peer} is no IP address: over TLS an identity must be one its certificate names"
                    )),
                }
            }
        }
    }

    /// Closes connection `conn` after telling the peer `reason` (a ZMTP ERROR; no event).
    pub fn refuse(&mut self, conn: ConnId, reason: &str) {
        self.identities.remove(&conn);
        let mut ignored = Vec::new();
        self.listener.refuse(conn, reason, &mut ignored);
    }

    /// Handling one message of connection `conn` cost the node `cost`: each connection is given
    /// about `round_quantum` of the node's time per round, so a peer whose messages are
    /// expensive or many delays the others by about that much per round.
    pub fn charge(&mut self, conn: ConnId, cost: Duration) {
        self.listener.charge(conn, cost);
    }

    /// The challenge our READY gave connection `conn`.
    pub fn challenge(&self, conn: ConnId) -> Option<&[u8]> {
        self.listener.connection(conn).and_then(|c| c.challenge())
    }

    /// Pauses connection `conn` (not read, none of its messages delivered; its heartbeats run)
    /// or resumes it: the node is still working off a message of it (a large one decoded a
    /// slice at a time), and what the peer sends meanwhile waits in its socket.
    pub fn set_paused(&mut self, conn: ConnId, paused: bool) {
        self.listener.set_paused(conn, paused);
    }

    /// Marks whether a live session is bound to `conn`: such a connection gives its slot up to
    /// a newcomer only after every connection of its source that carries none.
    pub fn set_holds_session(&mut self, conn: ConnId, holds: bool) {
        self.listener.set_engaged(conn, holds);
    }

    /// Accepts what is waiting, reads the connections the poll reported within their shares
    /// and those of the peers in `lost` to the end, sends what is pending, and runs the
    /// heartbeats and deadlines due at `now`.
    pub(crate) fn progress(
        &mut self,
        poller: &Poller,
        now: Instant,
        lost: &[PeerId],
        events: &mut Vec<InboundEvent>,
    ) {
        let mut drain: Vec<ConnId> = Vec::new();
        if !lost.is_empty() {
            drain = self
                .identities
                .iter()
                .filter(|(_, (peer, _))| lost.contains(peer))
                .map(|(conn, _)| *conn)
                .collect();
            drain.sort_unstable();
        }
        let mut happened = Vec::new();
        self.listener
            .progress(poller, now, true, &drain, &mut happened);
        let mut refused = Vec::new();
        let mut told = Vec::new();
        for (conn, event) in happened {
            match event {
                LinkEvent::Ready {
                    identity,
                    source,
                    tls,
                } => match (claimed(&identity), source) {
                    (Some(peer), Some(source)) => match self.tls_refusal(&tls, &peer) {
                        None => {
                            self.identities.insert(conn, (peer, source));
                        }
                        Some(why) => {
                            if let Some(suppressed) =
                                crate::admit_warning("refusing a control connection's TLS")
                            {
                                warn!(%peer, %source, reason = %why, suppressed,
                                    "refusing a control connection");
                            }
                            told.push((conn, why));
                        }
                    },
                    _ => refused.push(conn),
                },
                LinkEvent::Incoming(Incoming::Message(mut frames)) => {
                    let Some((peer, source)) = self.identities.get(&conn) else {
                        continue; // refused below
                    };
                    if frames.len() != 1 {
                        if let Some(suppressed) = crate::admit_warning("dropping a control message")
                        {
                            warn!(frames = frames.len(), %peer, suppressed,
                                "dropping a message that is not one frame");
                        }
                        continue;
                    }
                    events.push(InboundEvent::Payload {
                        conn,
                        peer: peer.clone(),
                        source: *source,
                        payload: frames.pop().unwrap_or_default(),
                    });
                }
                // Subscriptions mean nothing to a ROUTER.
                LinkEvent::Incoming(Incoming::Subscribe(_) | Incoming::Cancel(_)) => {}
                LinkEvent::Lost { .. } => events.push(InboundEvent::Closed {
                    conn,
                    peer: self.identities.remove(&conn).map(|(peer, _)| peer),
                }),
            }
        }
        for conn in refused {
            let mut lost = Vec::new();
            self.listener.close(conn, LinkLoss::BadIdentity, &mut lost);
            events.extend(
                lost.into_iter()
                    .map(|(conn, _)| InboundEvent::Closed { conn, peer: None }),
            );
        }
        for (conn, why) in told {
            let mut lost = Vec::new();
            self.listener.refuse(conn, &why, &mut lost);
            events.extend(
                lost.into_iter()
                    .map(|(conn, _)| InboundEvent::Closed { conn, peer: None }),
            );
        }
    }
}

/// The identity a READY claimed, if it is `host:port`.
fn claimed(identity: &[u8]) -> Option<PeerId> {
    std::str::from_utf8(identity)
        .ok()
        .filter(|id| PeerId::parse(id).is_ok())
        .map(PeerId::new)
}
