//! The control channel's listening side: ZMTP spoken by kvpeer itself on the node's thread.
//!
//! libzmq's ROUTER routes by the identity a peer claims and hides everything else: a silent
//! connection that claims identity X first locks the real X out, and the application can
//! neither see that connection nor close it (docs/security.md). Here every inbound connection
//! is kvpeer's own: accepted from a non-blocking `TcpListener`, its greeting and READY read by
//! [`zmtp::Decoder`](crate::zmtp::Decoder), so each message comes with the connection it
//! arrived on (a [`ConnId`]), the identity that connection claimed and its source address, and
//! the node decides which connection holds a session (several may claim one identity; none
//! blocks another) and closes the others.
//!
//! Speaks to libzmq 4.3 DEALERs (vLLM's `ZmqTransport`, pyzmq) and kvpeer's own (`dealer.rs`)
//! as a libzmq ROUTER does: ZMTP 3.1, NULL mechanism, READY with `Socket-Type: ROUTER`, PONG
//! for every PING, our own PINGs every `heartbeat_interval` with `heartbeat_ttl`, and a
//! connection that sends nothing for `heartbeat_timeout` (or does not finish its handshake in
//! that time) is closed. Frames over `max_message_bytes` are refused from their header.
//! Connections are capped in all and per source address; when a cap is reached a newcomer
//! evicts the idlest connection of its own (or the heaviest) source that carries no session
//! (`admission.rs`), so no process can lock the others of its host out. Each connection is
//! given a fresh random challenge in our READY ([`zmtp::CHALLENGE_PROPERTY`]): a kvpeer peer's
//! proofs are made for that connection ([`Inbound::challenge`]).
//!
//! Owned by the node's runtime thread with the rest of the channel; every socket is
//! non-blocking and polled with the channel's other sockets, so nothing here blocks.

use std::collections::BTreeMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, TcpListener, TcpStream};
use std::os::fd::{AsFd, BorrowedFd};
use std::time::{Duration, Instant};

use kvpeer_proto::PeerId;
use tracing::{debug, warn};

use crate::admission::{self, Caps, Holder};
use crate::zmtp::{self, Decoder, Input};

/// One inbound connection's number, unique for the channel's life.
pub type ConnId = u64;

/// Bounds of the listening side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboundLimits {
    /// Largest message accepted.
    pub max_message_bytes: u64,
    /// How often an idle connection is pinged.
    pub heartbeat_interval: Duration,
    /// Silence (or an unfinished handshake) after which a connection is closed.
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

struct Conn {
    stream: TcpStream,
    source: IpAddr,
    decoder: Decoder,
    /// Bytes to send (ZMTP commands only: this side never sends messages).
    out: Vec<u8>,
    identity: Option<PeerId>,
    /// The challenge our READY gives it (see [`zmtp::CHALLENGE_PROPERTY`]).
    challenge: [u8; zmtp::CHALLENGE_LEN],
    opened: Instant,
    last_recv: Instant,
    last_sent: Instant,
    /// When it last delivered a message (accepted, if it never did): how idle it is when a
    /// newcomer needs its slot (`admission`).
    last_active: Instant,
    /// Whether the node bound a live session to it ([`Inbound::set_holds_session`]).
    holds_session: bool,
    /// Its decoder holds input past this round's [`MESSAGES_PER_ROUND`]: read it next round
    /// whether or not the socket is readable.
    backlog: bool,
}

/// Bytes of unsent commands a connection may hold before it counts as not reading.
const MAX_UNSENT: usize = 64 * 1024;
/// Bytes read from one connection per round, so one busy peer cannot starve the others: each
/// round reads every ready connection once more, so a peer flooding at full speed delays the
/// others by what this many bytes of its messages cost (measured: 8 MiB let a junk flood push
/// an honest peer's lookup p99 far past the rest; scripts/bench-fairness.sh).
const READ_BUDGET: usize = 256 << 10;
/// Messages taken from one connection per round: what its decoder holds beyond them waits for
/// the next round (which comes at once), so a peer sending tiny messages at full speed delays
/// each other connection by at most this many messages' work per round.
const MESSAGES_PER_ROUND: usize = 128;
/// Connections accepted per round: a burst of new connections (a flooder's) is taken a few at a
/// time, the connections already open read in between (the listener stays readable, so the next
/// round comes at once).
const ACCEPTS_PER_ROUND: usize = 16;

/// The listener and its connections.
pub struct Inbound {
    listener: TcpListener,
    conns: BTreeMap<ConnId, Conn>,
    next: ConnId,
    limits: InboundLimits,
    /// After `accept` failed (out of descriptors, most likely) the listener is not polled
    /// until then: a listener that stays readable would otherwise spin the loop.
    accept_paused_until: Option<Instant>,
}

/// How long the listener rests after `accept` fails before it is polled again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

impl std::fmt::Debug for Inbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbound")
            .field("addr", &self.listener.local_addr().ok())
            .field("connections", &self.conns.len())
            .finish()
    }
}

impl Inbound {
    /// Listens on `addr` (`host:port`; port 0 picks one).
    pub fn bind(addr: &str, limits: InboundLimits) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok(Inbound {
            listener,
            conns: BTreeMap::new(),
            next: 0,
            limits,
            accept_paused_until: None,
        })
    }

    /// The port bound.
    pub fn port(&self) -> std::io::Result<u16> {
        Ok(self.listener.local_addr()?.port())
    }

    /// Connections open now.
    pub fn connections(&self) -> usize {
        self.conns.len()
    }

    /// Whether the listener should be polled for new connections at `now` (not while it rests
    /// after a failed `accept`; [`Inbound::next_deadline`] wakes the caller when that ends).
    pub fn listening(&self, now: Instant) -> bool {
        self.accept_paused_until.is_none_or(|until| now >= until)
    }

    /// Descriptors to poll: the listener, then each connection (with whether it has bytes to
    /// send), in [`Inbound::conn_ids`] order. Whether to ask the listener for readability is
    /// [`Inbound::listening`].
    pub fn poll_fds(&self) -> impl Iterator<Item = (BorrowedFd<'_>, bool)> + '_ {
        std::iter::once((self.listener.as_fd(), false)).chain(
            self.conns
                .values()
                .map(|c| (c.stream.as_fd(), !c.out.is_empty())),
        )
    }

    /// The connections, in [`Inbound::poll_fds`] order (after the listener).
    pub fn conn_ids(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.conns.keys().copied()
    }

    /// When the next heartbeat or deadline falls due.
    pub fn next_deadline(&self) -> Option<Instant> {
        let l = &self.limits;
        let conns = self
            .conns
            .values()
            .map(|c| {
                let silence = c.last_recv + l.heartbeat_timeout;
                if !c.out.is_empty() {
                    // Waiting for the socket to take our bytes (POLLOUT wakes us): the only
                    // deadline is the write stall's, never a past heartbeat (that would spin).
                    silence.min(c.last_sent + l.heartbeat_timeout)
                } else if c.identity.is_some() {
                    silence.min(c.last_sent + l.heartbeat_interval)
                } else {
                    silence.min(c.opened + l.heartbeat_timeout)
                }
            })
            .min();
        match (conns, self.accept_paused_until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Closes connection `conn` (no event: the caller asked).
    pub fn close(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
            debug!(conn, peer = ?c.identity, "inbound control connection closed");
        }
    }

    /// Accepts what is waiting (when `listener_ready`), reads the connections in `readable`,
    /// sends what is pending, and runs heartbeats and deadlines at `now`.
    pub fn progress(
        &mut self,
        now: Instant,
        listener_ready: bool,
        readable: &[ConnId],
        events: &mut Vec<InboundEvent>,
    ) {
        if listener_ready {
            self.accept(now, events);
        }
        let backlogged: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(id, c)| c.backlog && !readable.contains(id))
            .map(|(id, _)| *id)
            .collect();
        for &conn in readable.iter().chain(&backlogged) {
            if let Err(why) = self.read(now, conn, events) {
                self.drop_conn(conn, &why, events);
            }
        }
        self.heartbeats(now, events);
        if !readable.is_empty() {
            // Buffers grow only by reading.
            self.shed_buffers(events);
        }
        let ids: Vec<ConnId> = self
            .conns
            .iter()
            .filter(|(_, c)| !c.out.is_empty())
            .map(|(id, _)| *id)
            .collect();
        for conn in ids {
            if let Err(why) = self.flush(now, conn) {
                self.drop_conn(conn, &why, events);
            }
        }
    }

    /// The challenge our READY gave connection `conn`.
    pub fn challenge(&self, conn: ConnId) -> Option<&[u8]> {
        self.conns.get(&conn).map(|c| &c.challenge[..])
    }

    /// Marks whether a live session is bound to `conn`: such a connection gives its slot up to
    /// a newcomer only after every connection of its source that carries none.
    pub fn set_holds_session(&mut self, conn: ConnId, holds: bool) {
        if let Some(c) = self.conns.get_mut(&conn) {
            c.holds_session = holds;
        }
    }

    fn accept(&mut self, now: Instant, events: &mut Vec<InboundEvent>) {
        if !self.listening(now) {
            return;
        }
        self.accept_paused_until = None;
        for _ in 0..ACCEPTS_PER_ROUND {
            let (stream, addr) = match self.listener.accept() {
                Ok(accepted) => accepted,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    // Out of descriptors, most likely: the listener rests a while, or the
                    // connection still waiting would keep it readable and spin the loop.
                    if let Some(suppressed) = crate::admit_warning("cannot accept") {
                        warn!(error = %e, suppressed, "cannot accept a control connection");
                    }
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    return;
                }
            };
            let source = addr.ip().to_canonical();
            if !self.make_room(source, events) {
                continue; // no slot can be had (caps of zero): dropped, closed
            }
            let mut challenge = [0u8; zmtp::CHALLENGE_LEN];
            if let Err(e) = getrandom::fill(&mut challenge) {
                if let Some(suppressed) = crate::admit_warning("no randomness") {
                    warn!(error = %e, suppressed, "no randomness for a connection's challenge");
                }
                continue;
            }
            if let Err(e) = stream.set_nonblocking(true) {
                if let Some(suppressed) =
                    crate::admit_warning("cannot make a control connection non-blocking")
                {
                    warn!(error = %e, suppressed, "cannot make a control connection non-blocking");
                }
                continue;
            }
            let _ = stream.set_nodelay(true);
            self.next += 1;
            let conn = self.next;
            let mut c = Conn {
                stream,
                source,
                decoder: Decoder::new(self.limits.max_message_bytes),
                out: Vec::new(),
                identity: None,
                challenge,
                opened: now,
                last_recv: now,
                last_sent: now,
                last_active: now,
                holds_session: false,
                backlog: false,
            };
            // Our whole greeting at once: libzmq reads it in its own steps.
            c.out.extend_from_slice(&zmtp::greeting());
            self.conns.insert(conn, c);
            debug!(conn, %source, "inbound control connection");
        }
    }

    /// Reads connection `conn` for one round: first what its decoder still holds from the last
    /// round, then the socket under [`READ_BUDGET`]; at most [`MESSAGES_PER_ROUND`] messages
    /// leave per round, the rest wait in the decoder (the connection is then `backlog`, and the
    /// next round comes without waiting for the socket).
    fn read(
        &mut self,
        now: Instant,
        conn: ConnId,
        events: &mut Vec<InboundEvent>,
    ) -> Result<(), String> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Ok(());
        };
        let mut delivered = 0usize;
        c.backlog = false;
        if !decode(c, conn, now, &mut delivered, events)? {
            return Ok(());
        }
        let mut chunk = [0u8; 64 * 1024];
        let mut budget = READ_BUDGET;
        loop {
            let n = match c.stream.read(&mut chunk) {
                Ok(0) => return Err("closed by the peer".into()),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            };
            c.last_recv = now;
            c.decoder.push(&chunk[..n]);
            if !decode(c, conn, now, &mut delivered, events)? {
                return Ok(());
            }
            budget = budget.saturating_sub(n);
            if budget == 0 || n < chunk.len() {
                // A short read drained the socket for now (saving the read that would say
                // so); the level-triggered poll reports anything that came since.
                break;
            }
        }
        Ok(())
    }

    /// Whether a connection holds decoded input it could not deliver last round.
    pub fn has_backlog(&self) -> bool {
        self.conns.values().any(|c| c.backlog)
    }

    fn flush(&mut self, now: Instant, conn: ConnId) -> Result<(), String> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Ok(());
        };
        while !c.out.is_empty() {
            match c.stream.write(&c.out) {
                Ok(0) => return Err("cannot send".into()),
                Ok(n) => {
                    c.out.drain(..n);
                    c.last_sent = now;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.to_string()),
            }
        }
        if c.out.len() > MAX_UNSENT {
            return Err("the peer does not read".into());
        }
        Ok(())
    }

    fn heartbeats(&mut self, now: Instant, events: &mut Vec<InboundEvent>) {
        let l = self.limits.clone();
        let ttl = u16::try_from(l.heartbeat_ttl.as_millis() / 100).unwrap_or(u16::MAX);
        let mut dead = Vec::new();
        for (&id, c) in self.conns.iter_mut() {
            if c.identity.is_none() && now.saturating_duration_since(c.opened) > l.heartbeat_timeout
            {
                dead.push((id, "handshake timed out"));
            } else if now.saturating_duration_since(c.last_recv) > l.heartbeat_timeout {
                dead.push((id, "heartbeat timed out"));
            } else if !c.out.is_empty()
                && now.saturating_duration_since(c.last_sent) > l.heartbeat_timeout
            {
                dead.push((id, "the peer does not read"));
            } else if c.identity.is_some()
                && c.out.is_empty()
                && now.saturating_duration_since(c.last_sent) >= l.heartbeat_interval
            {
                c.out.extend(zmtp::ping(ttl));
            }
        }
        for (id, why) in dead {
            self.drop_conn(id, why, events);
        }
    }

    /// Each connection may buffer up to one message of `max_message_bytes`; all together at
    /// most `max_buffered_bytes`, so many connections holding large partial frames cannot
    /// exhaust memory: the largest holder goes first.
    fn shed_buffers(&mut self, events: &mut Vec<InboundEvent>) {
        loop {
            let total: usize = self.conns.values().map(|c| c.decoder.buffered()).sum();
            if total <= self.limits.max_buffered_bytes {
                return;
            }
            let Some((&hog, _)) = self.conns.iter().max_by_key(|(_, c)| c.decoder.buffered())
            else {
                return;
            };
            if let Some(suppressed) = crate::admit_warning("control buffers over the cap") {
                warn!(
                    total,
                    cap = self.limits.max_buffered_bytes,
                    suppressed,
                    "closing the control connection holding the most buffered bytes"
                );
            }
            self.drop_conn(hog, "buffers over the node's cap", events);
        }
    }

    /// Makes a slot for a newcomer from `source` if the caps are reached, by closing the
    /// holder the admission policy names (`admission`: its own source's, or the heaviest
    /// source's, idlest connection without a session). `false` when no slot can be had.
    fn make_room(&mut self, source: IpAddr, events: &mut Vec<InboundEvent>) -> bool {
        let caps = Caps {
            max_connections: self.limits.max_connections,
            max_per_source: self.limits.max_per_source,
        };
        let holders: Vec<Holder<ConnId>> = self
            .conns
            .iter()
            .map(|(&id, c)| Holder {
                id,
                source: c.source,
                last_active: c.last_active,
                holds_session: c.holds_session,
            })
            .collect();
        if let Some(victim) = admission::evict_for(&holders, source, caps) {
            if let Some(suppressed) = crate::admit_warning("control connection evicted") {
                warn!(%source, open = self.conns.len(), suppressed,
                    "control connections full: closing the idlest one of the heaviest source");
            }
            self.drop_conn(victim, "evicted for a newcomer (connections full)", events);
        }
        let from_source = self.conns.values().filter(|c| c.source == source).count();
        self.conns.len() < caps.max_connections && from_source < caps.max_per_source
    }

    fn drop_conn(&mut self, conn: ConnId, why: &str, events: &mut Vec<InboundEvent>) {
        let Some(c) = self.conns.remove(&conn) else {
            return;
        };
        let _ = c.stream.shutdown(std::net::Shutdown::Both);
        debug!(conn, peer = ?c.identity, source = %c.source, why, "inbound control connection ended");
        events.push(InboundEvent::Closed {
            conn,
            peer: c.identity,
        });
    }
}

/// Turns what `c`'s decoder holds into answers and events, until it holds no whole input or
/// `delivered` reaches [`MESSAGES_PER_ROUND`] (then `c.backlog` is set and `false` returned:
/// stop reading this connection this round).
fn decode(
    c: &mut Conn,
    conn: ConnId,
    now: Instant,
    delivered: &mut usize,
    events: &mut Vec<InboundEvent>,
) -> Result<bool, String> {
    loop {
        if *delivered >= MESSAGES_PER_ROUND {
            c.backlog = true;
            return Ok(false);
        }
        let Some(input) = c.decoder.next_input().map_err(|e| e.to_string())? else {
            return Ok(true);
        };
        match input {
            Input::Greeting => {
                c.out.extend(zmtp::ready_with(&[
                    ("Socket-Type", b"ROUTER"),
                    (zmtp::CHALLENGE_PROPERTY, &c.challenge),
                ]));
            }
            Input::Ready {
                socket_type,
                identity,
                ..
            } => {
                if !matches!(&socket_type[..], b"DEALER" | b"REQ" | b"ROUTER") {
                    return Err(format!(
                        "socket type {:?} cannot talk to a ROUTER",
                        String::from_utf8_lossy(&socket_type)
                    ));
                }
                let id = std::str::from_utf8(&identity)
                    .ok()
                    .filter(|id| PeerId::parse(id).is_ok())
                    .ok_or("an identity that is not host:port")?;
                c.identity = Some(PeerId::new(id));
            }
            Input::Ping { context, .. } => c.out.extend(zmtp::pong(&context)),
            // This decoder keeps messages; commands only prove the peer alive.
            Input::Command | Input::Subscribe(_) | Input::Cancel(_) | Input::Discarded { .. } => {}
            Input::Message(mut frames) => {
                let Some(peer) = c.identity.clone() else {
                    return Err("a message before READY".into());
                };
                *delivered += 1;
                if frames.len() != 1 {
                    if let Some(suppressed) = crate::admit_warning("dropping a control message") {
                        warn!(frames = frames.len(), %peer, suppressed,
                            "dropping a message that is not one frame");
                    }
                    continue;
                }
                c.last_active = now;
                events.push(InboundEvent::Payload {
                    conn,
                    peer,
                    source: c.source,
                    payload: frames.pop().unwrap_or_default(),
                });
            }
        }
    }
}
