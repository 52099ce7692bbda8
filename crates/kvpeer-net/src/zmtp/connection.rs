//! One ZMTP 3.1 connection of any socket type, as a state machine without I/O (quinn-proto
//! style: bytes and time in, bytes and deadlines out). The control channel's DEALER
//! (`control/outbound.rs`) and every socket of the KV event stream
//! ([`crate::events`]: SUB, PUB, the replay DEALER and ROUTER) are this machine in a [`Role`].
//!
//! What it speaks, as libzmq 4.3 does for that socket type:
//!
//! * From the start our greeting (ZMTP 3.1, NULL, not as-server) and our READY
//!   (`Socket-Type`, and `Identity` when the role has one, as libzmq sends it only for DEALER,
//!   REQ and ROUTER) are queued, in one write. Which side opened the TCP connection does not
//!   matter: a SUB that accepted a PUB's connection speaks exactly as one that connected.
//! * The peer's greeting may be any major version from 3 on; an older version, a foreign
//!   signature or another mechanism is refused ([`ZmtpError`]) as soon as the bytes show it.
//!   Its READY must name a socket type the role talks to ([`ConnError::PeerType`]).
//! * Messages (multipart: MORE on all frames but the last; short frames up to 255 bytes, long
//!   beyond) are queued from the start but leave only after the peer's READY was checked, in
//!   order. At most `send_queue` messages and `send_queue_bytes` bytes wait unwritten (one
//!   message of any size when nothing waits); one more is [`QueueFull`], as libzmq's `SNDHWM`
//!   refuses it (a DEALER's send fails, a PUB drops the message for that peer).
//! * Heartbeats, libzmq's rules, but only when the peer is silent: once READY, a PING
//!   (carrying our `heartbeat_ttl`) after `heartbeat_interval` in which the peer sent nothing;
//!   a PING unanswered by any byte within `heartbeat_timeout` ends the connection, and so does
//!   silence past the TTL the peer's own PING announced. A peer that pings us (vLLM's libzmq
//!   sockets do, every 2 s) or talks proves itself alive, so we send no PING of our own to it:
//!   a connection costs one PING and one PONG per interval, not two of each (a thousand idle
//!   sessions are four thousand fewer system calls every 2 s). libzmq needs nothing more: its
//!   heartbeat timeout is met by any byte, our PONGs included. A PING of the peer gets a PONG
//!   with its context, one PONG unwritten at a time (a peer that PINGs and never reads cannot
//!   grow our buffer). The handshake must finish within `handshake_timeout` of
//!   [`Connection::connected`].
//! * What the peer sends is decoded under `max_message_bytes` (checked from each frame's
//!   header, before anything is kept). A role that keeps messages ([`Role::keep`]) yields them
//!   and the peer's SUBSCRIBE and CANCEL commands as [`Incoming`] from
//!   [`Connection::poll_incoming`]; one that does not skips message bodies unbuffered and
//!   counts them ([`Connection::dropped`]): memory is then one command (64 KiB) plus one read.
//!
//! The caller (an I/O driver on its own thread: `outbound.rs`, `events/`) writes
//! [`Connection::transmit`] to the socket and reports how much went with
//! [`Connection::advance`], feeds what it reads to [`Connection::handle_bytes`] and drains
//! [`Connection::poll_incoming`] after each call (so what is held is what one read brought),
//! and calls [`Connection::handle_timeout`] at [`Connection::poll_timeout`]. Nothing here
//! blocks or reads a clock; any error ends the connection.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use crate::zmtp::{self, Decoder, Input, ZmtpError};

/// Which socket this side is, and what it talks to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Role {
    /// Our `Socket-Type`.
    pub socket_type: &'static str,
    /// Our `Identity` property, if the role sends one.
    pub identity: Option<Vec<u8>>,
    /// The peer socket types accepted (ZMTP's valid combinations).
    pub peers: &'static [&'static str],
    /// Whether the peer's messages and subscriptions are kept and yielded, or skipped.
    pub keep: bool,
    /// A challenge our READY gives the peer ([`zmtp::CHALLENGE_PROPERTY`]): the control
    /// ROUTER's, fresh per connection (the listener draws it), so a kvpeer peer's proofs are
    /// made for this connection.
    pub challenge: Option<[u8; zmtp::CHALLENGE_LEN]>,
    /// The identity our READY tells ([`zmtp::IDENTITY_PROPERTY`]): the control ROUTER's own
    /// `host:port`, so a dialer that named it otherwise learns why.
    pub announce: Option<Vec<u8>>,
}

impl Role {
    /// Whether this side publishes (its peers' subscriptions are what it serves).
    pub fn publishes(&self) -> bool {
        matches!(self.socket_type, "PUB" | "XPUB")
    }

    /// The control channel's DEALER: introduces itself as `identity`, talks to a ROUTER, never
    /// reads what the ROUTER sends (libzmq's DEALERs in vLLM were never read either).
    pub fn control_dealer(identity: &[u8]) -> Self {
        Role {
            socket_type: "DEALER",
            identity: Some(identity.to_vec()),
            peers: &["ROUTER"],
            keep: false,
            challenge: None,
            announce: None,
        }
    }

    /// A DEALER whose answers are read (the KV event stream's replay client). libzmq sends an
    /// empty `Identity` for a DEALER without one.
    pub fn dealer() -> Self {
        Role {
            socket_type: "DEALER",
            identity: Some(Vec::new()),
            peers: &["ROUTER"],
            keep: true,
            challenge: None,
            announce: None,
        }
    }

    /// A SUB: talks to a PUB or XPUB, keeps what it sends.
    pub fn sub() -> Self {
        Role {
            socket_type: "SUB",
            identity: None,
            peers: &["PUB", "XPUB"],
            keep: true,
            challenge: None,
            announce: None,
        }
    }

    /// A PUB: talks to a SUB or XSUB, keeps their subscriptions.
    pub fn publisher() -> Self {
        Role {
            socket_type: "PUB",
            identity: None,
            peers: &["SUB", "XSUB"],
            keep: true,
            challenge: None,
            announce: None,
        }
    }

    /// The control channel's ROUTER (the node's listening side): talks to a DEALER, REQ or
    /// ROUTER, keeps their messages, sends no `Identity` (as before: vLLM's DEALERs route by
    /// their own). The listener sets [`Role::challenge`] per connection.
    pub fn control_router() -> Self {
        Role {
            socket_type: "ROUTER",
            identity: None,
            peers: &["DEALER", "REQ", "ROUTER"],
            keep: true,
            challenge: None,
            announce: None,
        }
    }

    /// A ROUTER (the KV event stream's replay server): talks to a DEALER, REQ or ROUTER,
    /// keeps their requests.
    pub fn router() -> Self {
        Role {
            socket_type: "ROUTER",
            identity: Some(Vec::new()),
            peers: &["DEALER", "REQ", "ROUTER"],
            keep: true,
            challenge: None,
            announce: None,
        }
    }
}

/// Settings of one connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnLimits {
    /// Largest message accepted from the peer (and frame, from its header).
    pub max_message_bytes: u64,
    /// How often we PING once the handshake is done (zero: never).
    pub heartbeat_interval: Duration,
    /// How long a PING may go unanswered (zero: the interval).
    pub heartbeat_timeout: Duration,
    /// The TTL our PINGs tell the peer.
    pub heartbeat_ttl: Duration,
    /// How long the handshake may take once TCP is connected.
    pub handshake_timeout: Duration,
    /// Messages that may wait unwritten.
    pub send_queue: usize,
    /// Bytes that may wait unwritten (one message of any size when nothing waits).
    pub send_queue_bytes: usize,
    /// Things received ([`Incoming`]) held for [`Connection::poll_incoming`] before decoding
    /// pauses: what else the peer sent stays undecoded until [`Connection::decode_held`]. A
    /// listener takes this many per connection per round, so a peer sending tiny messages at
    /// full speed delays each other connection by at most this much work. At least one.
    pub max_incoming: usize,
}

/// Why a connection ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnError {
    /// The peer's bytes are not ZMTP this side speaks.
    #[error(transparent)]
    Zmtp(#[from] ZmtpError),
    /// The peer's READY names a socket type this one does not talk to.
    #[error("the peer is a {got:?} socket, not a {}", peers.join(" or "))]
    PeerType {
        /// The peer's `Socket-Type`.
        got: String,
        /// Ours.
        ours: &'static str,
        /// The ones ours talks to.
        peers: &'static [&'static str],
    },
    /// No READY within the handshake timeout.
    #[error("handshake not done within {0:?}")]
    HandshakeTimeout(Duration),
    /// Our PING got no answer.
    #[error("no answer to our heartbeat within {0:?}")]
    HeartbeatTimeout(Duration),
    /// The peer fell silent past the TTL its own PING announced.
    #[error("the peer fell silent past its heartbeat TTL of {0:?}")]
    TtlExpired(Duration),
    /// A liveness probe ([`Connection::probe`]: another connection to the peer's host was
    /// lost) got no answer in time.
    #[error("no answer to a liveness probe within {0:?}")]
    ProbeUnanswered(Duration),
    /// The peer refused the connection with a ZMTP ERROR, saying why.
    #[error("the peer refused this connection: {0}")]
    Refused(String),
    /// The peer sent a socket that reads nothing more than heartbeats.
    #[error(
        "the peer sent more than {burst} messages or commands (one per started 64 KiB) at \
         once, or {per_second} a second, to a socket that reads none"
    )]
    Unread {
        /// Its burst.
        burst: u32,
        /// Its rate.
        per_second: u32,
    },
}

impl crate::io::sockio::Outgoing for Connection {
    fn transmit(&self) -> &[u8] {
        Connection::transmit(self)
    }
    fn advance(&mut self, n: usize) {
        Connection::advance(self, n);
    }
}

/// The send queue is full: the message was not queued.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("send queue full")]
pub struct QueueFull;

/// Why [`Connection::queue_with`] queued nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum QueueWithError<E> {
    /// The send queue is full ([`QueueFull`]).
    Full,
    /// The body's writer failed (what it wrote was taken back).
    Body(E),
}

/// What a role that keeps messages got from the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Incoming {
    /// A whole message: its frames in order.
    Message(Vec<Vec<u8>>),
    /// A SUBSCRIBE command for this prefix.
    Subscribe(Vec<u8>),
    /// A CANCEL command for this prefix.
    Cancel(Vec<u8>),
}

/// What a skipping role (the control DEALER: a ROUTER sends it nothing but heartbeats) may be
/// sent besides heartbeats, in cells: a message or command costs one cell per started
/// [`SKIPPED_CELL_BYTES`] (so a few large messages cost what many small ones do): a burst of
/// this many cells, then [`SKIPPED_PER_SECOND`]; past it the connection ends, so the peer we
/// answer cannot make this side read and decode a flood it never uses (at most 64 MiB at once,
/// then 4 MiB/s).
const SKIPPED_BURST: u32 = 1024;
const SKIPPED_PER_SECOND: u32 = 64;
/// The bytes of skipped input one cell of the allowance pays for.
const SKIPPED_CELL_BYTES: u64 = 64 * 1024;

/// Buffer capacity kept once everything queued was written; a larger one is given back.
const KEEP_CAPACITY: usize = 256 * 1024;

/// One connection's protocol state.
#[derive(Debug)]
pub struct Connection {
    role: Role,
    limits: ConnLimits,
    decoder: Decoder,
    /// Bytes to write, in stream order, from `at` on.
    out: Vec<u8>,
    at: usize,
    /// Until the peer's READY only `out[..gate]` (greeting and READY) may leave.
    gate: Option<usize>,
    /// Stream offsets: bytes handed to the socket so far, and where each queued message ends.
    written: u64,
    ends: VecDeque<u64>,
    /// Set by [`Connection::connected`]: the handshake's deadline.
    handshake_deadline: Option<Instant>,
    ready: bool,
    /// The challenge the peer's READY gave (a kvpeer ROUTER's; see [`zmtp::CHALLENGE_PROPERTY`]).
    peer_challenge: Option<Vec<u8>>,
    next_ping: Option<Instant>,
    ping_deadline: Option<Instant>,
    /// Set while `ping_deadline` is a probe's ([`Connection::probe`]).
    probing: Option<Probing>,
    /// When the peer last sent a byte.
    heard: Option<Instant>,
    ttl_deadline: Option<(Instant, Duration)>,
    /// Where our last PONG ends in the stream: while it is unwritten, further PINGs get no
    /// PONG of their own (libzmq keeps one PONG pending too).
    pong_end: u64,
    dropped: u64,
    /// A skipping role's allowance of things it skips ([`SKIPPED_BURST`]): the time at which
    /// everything skipped so far would have been allowed at [`SKIPPED_PER_SECOND`] (a
    /// generic cell rate).
    skipped_until: Option<Instant>,
    incoming: VecDeque<Incoming>,
    /// Decoding paused at `max_incoming`: the decoder may hold more.
    paused: bool,
    /// The `Identity` the peer's READY gave.
    peer_identity: Option<Vec<u8>>,
    /// The identity a kvpeer ROUTER's READY told ([`zmtp::IDENTITY_PROPERTY`]).
    peer_announced: Option<Vec<u8>>,
}

/// A liveness probe under way ([`Connection::probe`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probing {
    /// When it was asked.
    pub started: Instant,
    /// How long it may go unanswered.
    pub timeout: Duration,
    /// The heartbeat's own deadline it brought forward, if a PING of the heartbeat was
    /// unanswered then.
    heartbeat_deadline: Option<Instant>,
}

impl Connection {
    /// A connection speaking as `role`. Messages may be queued at once.
    pub fn new(role: Role, limits: ConnLimits) -> Self {
        let mut out = zmtp::greeting().to_vec();
        let socket_type = role.socket_type.as_bytes();
        let mut properties: Vec<(&str, &[u8])> = vec![("Socket-Type", socket_type)];
        if let Some(id) = &role.identity {
            properties.push(("Identity", id));
        }
        if let Some(challenge) = &role.challenge {
            properties.push((zmtp::CHALLENGE_PROPERTY, challenge));
        }
        if let Some(identity) = &role.announce {
            properties.push((zmtp::IDENTITY_PROPERTY, identity));
        }
        out.extend(zmtp::ready_with(&properties));
        let decoder = if role.keep {
            Decoder::new(limits.max_message_bytes)
        } else {
            Decoder::discarding(limits.max_message_bytes)
        };
        Connection {
            role,
            decoder,
            limits,
            gate: Some(out.len()),
            out,
            at: 0,
            written: 0,
            ends: VecDeque::new(),
            handshake_deadline: None,
            ready: false,
            peer_challenge: None,
            peer_announced: None,
            next_ping: None,
            ping_deadline: None,
            probing: None,
            heard: None,
            ttl_deadline: None,
            pong_end: 0,
            dropped: 0,
            skipped_until: None,
            incoming: VecDeque::new(),
            paused: false,
            peer_identity: None,
        }
    }

    /// The role it speaks as.
    pub fn role(&self) -> &Role {
        &self.role
    }

    /// TCP is connected (or accepted) at `now`: the handshake's clock starts.
    pub fn connected(&mut self, now: Instant) {
        self.handshake_deadline
            .get_or_insert(now + self.limits.handshake_timeout);
    }

    /// Whether the peer's READY arrived and was accepted.
    pub fn is_ready(&self) -> bool {
        self.ready
    }

    /// The identity a kvpeer ROUTER's READY told (`None` before it, or from another ROUTER).
    pub fn peer_announced(&self) -> Option<&[u8]> {
        self.peer_announced.as_deref()
    }

    /// The challenge the peer gave in its READY (`None` before it, or when it gave none).
    pub fn peer_challenge(&self) -> Option<&[u8]> {
        self.peer_challenge.as_deref()
    }

    /// The `Identity` the peer's READY gave (`None` before it).
    pub fn peer_identity(&self) -> Option<&[u8]> {
        self.peer_identity.as_deref()
    }

    /// The challenge our READY gave the peer.
    pub fn challenge(&self) -> Option<&[u8]> {
        self.role.challenge.as_ref().map(|c| &c[..])
    }

    /// Whether the connection holds input not taken yet: things waiting in
    /// [`Connection::poll_incoming`], or bytes left undecoded when decoding paused at
    /// `max_incoming` (then [`Connection::decode_held`] goes on). A listener reads no more from
    /// the socket meanwhile.
    pub fn holds_input(&self) -> bool {
        self.paused || !self.incoming.is_empty()
    }

    /// Whether decoding paused at `max_incoming` (bytes may wait undecoded): a reader stops.
    pub fn decoding_paused(&self) -> bool {
        self.paused
    }

    /// Messages queued and not yet wholly written.
    pub fn queued(&self) -> usize {
        self.ends.len()
    }

    /// Whether every queued message was written (commands may still wait).
    pub fn is_drained(&self) -> bool {
        self.ends.is_empty()
    }

    /// Messages the peer sent, skipped (a role that does not keep them).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// Bytes received and not yet decoded.
    pub fn pending(&self) -> usize {
        self.decoder.pending()
    }

    /// Bytes this connection holds (to write, received not yet decoded, decoded not yet taken).
    pub fn buffered(&self) -> usize {
        let incoming: usize = self
            .incoming
            .iter()
            .map(|i| match i {
                Incoming::Message(frames) => frames.iter().map(Vec::capacity).sum(),
                Incoming::Subscribe(p) | Incoming::Cancel(p) => p.capacity(),
            })
            .sum();
        self.out.capacity() + self.decoder.buffered() + incoming
    }

    /// Queues one message of `parts` (no parts: one empty frame).
    pub fn queue(&mut self, parts: &[&[u8]]) -> Result<(), QueueFull> {
        if self.refuses(self.out.len() - self.at, zmtp::message_len(parts)) {
            return Err(QueueFull);
        }
        zmtp::write_message(&mut self.out, parts);
        self.ends.push_back(self.stream_end());
        Ok(())
    }

    /// Queues one single-frame message whose body `write_body` appends straight into the
    /// queue (about `body_hint` bytes, reserved at once): a large answer is encoded where it is
    /// written from, not copied there. `write_body` only appends (what it appended is taken
    /// back if it fails). The same limits as [`Connection::queue`]; the bytes already queued
    /// are checked before the body is written, the whole message after.
    pub(crate) fn queue_with<E>(
        &mut self,
        body_hint: usize,
        write_body: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
    ) -> Result<usize, QueueWithError<E>> {
        // Before the body is written, the bytes already queued (a full queue is not written
        // past); after, the whole message.
        if self.refuses(self.out.len() - self.at, 1) {
            return Err(QueueWithError::Full);
        }
        let start = zmtp::begin_frame(&mut self.out, body_hint);
        if let Err(e) = write_body(&mut self.out) {
            self.out.truncate(start);
            return Err(QueueWithError::Body(e));
        }
        zmtp::end_frame(&mut self.out, start);
        let size = self.out.len() - start;
        if self.refuses(start - self.at, size) {
            self.out.truncate(start);
            return Err(QueueWithError::Full);
        }
        self.ends.push_back(self.stream_end());
        Ok(size)
    }

    /// Whether a message of `len` bytes is refused behind `unwritten` bytes queued: the
    /// queue holds its most messages, or its most bytes behind at least one message (one
    /// message of any size goes when nothing waits).
    fn refuses(&self, unwritten: usize, len: usize) -> bool {
        self.ends.len() >= self.limits.send_queue
            || (!self.ends.is_empty()
                && unwritten.saturating_add(len) > self.limits.send_queue_bytes)
    }

    /// Bytes to write now.
    pub fn transmit(&self) -> &[u8] {
        let end = self.gate.unwrap_or(self.out.len());
        &self.out[self.at.min(end)..end]
    }

    /// Queues a ZMTP ERROR saying `reason`, after what is queued: the last thing a connection
    /// refused by its owner sends ([`zmtp::error`]).
    pub fn queue_error(&mut self, reason: &str) {
        self.out.extend(zmtp::error(reason));
    }

    /// `n` bytes of [`Connection::transmit`] were written.
    pub fn advance(&mut self, n: usize) {
        let n = n.min(self.transmit().len());
        self.at += n;
        self.written += n as u64;
        while self.ends.front().is_some_and(|end| *end <= self.written) {
            self.ends.pop_front();
        }
        if self.at == self.out.len() {
            self.out.clear();
            self.at = 0;
            if let Some(gate) = &mut self.gate {
                *gate = 0;
            }
            if self.out.capacity() > KEEP_CAPACITY {
                self.out = Vec::new();
            }
        } else if self.at > 64 * 1024 && self.at * 2 > self.out.len() {
            self.out.drain(..self.at);
            if let Some(gate) = &mut self.gate {
                *gate -= self.at;
            }
            self.at = 0;
        }
    }

    /// Bytes read from the connection at `now`. What a keeping role got waits in
    /// [`Connection::poll_incoming`].
    pub fn handle_bytes(&mut self, bytes: &[u8], now: Instant) -> Result<(), ConnError> {
        if bytes.is_empty() {
            return Ok(());
        }
        // Any byte proves the peer alive (libzmq cancels both timers on every read).
        self.ping_deadline = None;
        self.probing = None;
        self.ttl_deadline = None;
        self.heard = Some(now);
        self.decoder.push(bytes);
        self.decode_held(now)
    }

    /// Decodes what the decoder holds (after [`Connection::holds_input`]), up to
    /// `max_incoming` things held.
    pub fn decode_held(&mut self, now: Instant) -> Result<(), ConnError> {
        self.paused = false;
        loop {
            if self.incoming.len() >= self.limits.max_incoming.max(1) {
                self.paused = true;
                return Ok(());
            }
            let Some(input) = self.decoder.next_input()? else {
                return Ok(());
            };
            match input {
                Input::Greeting => {}
                // Unknown to us (ours went out with our READY).
                // At most 64 KiB (the codec's bound on a command): one cell.
                Input::Command => self.skipped(now, 0)?,
                Input::Ready {
                    socket_type,
                    identity,
                    challenge,
                    announced,
                } => {
                    if !self.role.peers.iter().any(|p| p.as_bytes() == socket_type) {
                        return Err(ConnError::PeerType {
                            got: String::from_utf8_lossy(&socket_type).into_owned(),
                            ours: self.role.socket_type,
                            peers: self.role.peers,
                        });
                    }
                    self.ready = true;
                    self.peer_challenge = challenge;
                    self.peer_announced = announced;
                    self.peer_identity = Some(identity);
                    self.gate = None;
                    if !self.limits.heartbeat_interval.is_zero() {
                        self.next_ping = Some(now + self.limits.heartbeat_interval);
                    }
                }
                Input::Ping {
                    ttl_deciseconds,
                    context,
                } => {
                    if self.pong_end <= self.written {
                        self.out.extend(zmtp::pong(&context));
                        self.pong_end = self.stream_end();
                    }
                    if ttl_deciseconds > 0 && self.ttl_deadline.is_none() {
                        let ttl = Duration::from_millis(u64::from(ttl_deciseconds) * 100);
                        self.ttl_deadline = Some((now + ttl, ttl));
                    }
                }
                Input::Discarded { bytes, .. } => {
                    self.dropped += 1;
                    self.skipped(now, bytes)?;
                }
                Input::Message(frames) => self.incoming.push_back(Incoming::Message(frames)),
                Input::Error(reason) => return Err(ConnError::Refused(reason)),
                // Subscriptions mean something only to a publisher; elsewhere (a ROUTER) they
                // are skipped like unknown commands, and cannot pass for a peer at work.
                Input::Subscribe(prefix) if self.role.keep && self.role.publishes() => {
                    self.incoming.push_back(Incoming::Subscribe(prefix))
                }
                Input::Cancel(prefix) if self.role.keep && self.role.publishes() => {
                    self.incoming.push_back(Incoming::Cancel(prefix))
                }
                Input::Subscribe(prefix) | Input::Cancel(prefix) => {
                    self.skipped(now, prefix.len() as u64)?
                }
            }
        }
    }

    /// One thing the peer sent (of `bytes`) was skipped at `now`: within a skipping role's
    /// allowance, or the end of the connection. A keeping role skips only what its owner's
    /// time share pays.
    fn skipped(&mut self, now: Instant, bytes: u64) -> Result<(), ConnError> {
        if self.role.keep {
            return Ok(());
        }
        let cells = 1 + bytes / SKIPPED_CELL_BYTES;
        let each = Duration::from_secs(1) / SKIPPED_PER_SECOND;
        // Past the burst in any case: capped so the product cannot overflow.
        let cost =
            each * u32::try_from(cells.min(u64::from(SKIPPED_BURST) + 1)).unwrap_or(u32::MAX);
        let until = self.skipped_until.map_or(now, |t| t.max(now)) + cost;
        if until.saturating_duration_since(now) > each * SKIPPED_BURST {
            return Err(ConnError::Unread {
                burst: SKIPPED_BURST,
                per_second: SKIPPED_PER_SECOND,
            });
        }
        self.skipped_until = Some(until);
        Ok(())
    }

    /// The next thing the peer sent (a keeping role), in order.
    pub fn poll_incoming(&mut self) -> Option<Incoming> {
        self.incoming.pop_front()
    }

    /// Runs the deadlines due at `now` (a PING may be queued).
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), ConnError> {
        if !self.ready && self.handshake_deadline.is_some_and(|d| now >= d) {
            return Err(ConnError::HandshakeTimeout(self.limits.handshake_timeout));
        }
        if self.ping_deadline.is_some_and(|d| now >= d) {
            return Err(match self.probing {
                Some(probe) => ConnError::ProbeUnanswered(probe.timeout),
                None => ConnError::HeartbeatTimeout(self.heartbeat_timeout()),
            });
        }
        if let Some((at, ttl)) = self.ttl_deadline {
            if now >= at {
                return Err(ConnError::TtlExpired(ttl));
            }
        }
        if let Some(at) = self.next_ping.filter(|at| now >= *at) {
            let interval = self.limits.heartbeat_interval;
            if let Some(heard) = self
                .heard
                .filter(|h| now.saturating_duration_since(*h) < interval)
            {
                // The peer spoke within the interval: it is alive; no PING until it falls
                // silent for a whole interval.
                self.next_ping = Some(heard + interval);
                return Ok(());
            }
            let ttl =
                u16::try_from(self.limits.heartbeat_ttl.as_millis() / 100).unwrap_or(u16::MAX);
            self.out.extend(zmtp::ping(ttl));
            // A late wake-up does not bunch PINGs up.
            self.next_ping = Some(at.max(now) + self.limits.heartbeat_interval);
            self.ping_deadline
                .get_or_insert(now + self.heartbeat_timeout());
        }
        Ok(())
    }

    /// Asks the peer at `now` to prove itself alive within `timeout`: a PING now (unless one
    /// is unanswered already) and a deadline no later than `now + timeout`, met by any byte
    /// the peer sends (a PONG: libzmq and kvpeer answer every PING), else the connection ends
    /// with [`ConnError::ProbeUnanswered`]. Called when another connection to the peer's host
    /// was lost (`control/hosts.rs`). `false` before the handshake is done (nothing to probe:
    /// the handshake's own deadline runs).
    pub fn probe(&mut self, now: Instant, timeout: Duration) -> bool {
        if !self.ready {
            return false;
        }
        let deadline = now + timeout;
        if self.ping_deadline.is_some_and(|d| d <= deadline) {
            // A deadline as near runs already (an earlier probe's, or the heartbeat's).
            return true;
        }
        let heartbeat_deadline = match self.probing {
            Some(p) => p.heartbeat_deadline,
            None => self.ping_deadline,
        };
        // A PING of its own even when the heartbeat's is unanswered: the host acknowledged that
        // one already, and this probe asks for something new from it.
        let ttl = u16::try_from(self.limits.heartbeat_ttl.as_millis() / 100).unwrap_or(u16::MAX);
        self.out.extend(zmtp::ping(ttl));
        self.ping_deadline = Some(deadline);
        self.probing = Some(Probing {
            started: now,
            timeout,
            heartbeat_deadline,
        });
        true
    }

    /// The probe under way, if any.
    pub fn probing(&self) -> Option<Probing> {
        self.probing
    }

    /// The peer's host answered the probe under way though the peer sent nothing (its kernel
    /// sent us a segment: the host is up, whatever its process does): the probe ends, and the
    /// heartbeat's own deadline stands again if its PING was unanswered, else none (the
    /// heartbeat PINGs again when the peer has been silent for its interval).
    pub fn probe_answered_by_host(&mut self) {
        if let Some(p) = self.probing.take() {
            self.ping_deadline = p.heartbeat_deadline;
        }
    }

    /// Whether a PING of ours (the heartbeat's or a probe's) waits for an answer.
    pub fn ping_unanswered(&self) -> bool {
        self.ping_deadline.is_some()
    }

    /// When [`Connection::handle_timeout`] has something to do next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let handshake = self.handshake_deadline.filter(|_| !self.ready);
        [
            handshake,
            self.next_ping,
            self.ping_deadline,
            self.ttl_deadline.map(|(at, _)| at),
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// How long a heartbeat PING may go unanswered.
    pub(crate) fn heartbeat_timeout(&self) -> Duration {
        if self.limits.heartbeat_timeout.is_zero() {
            self.limits.heartbeat_interval
        } else {
            self.limits.heartbeat_timeout
        }
    }

    /// The stream offset just past everything queued.
    fn stream_end(&self) -> u64 {
        self.written + (self.out.len() - self.at) as u64
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn limits() -> ConnLimits {
        ConnLimits {
            max_message_bytes: 1 << 20,
            heartbeat_interval: Duration::from_secs(2),
            heartbeat_timeout: Duration::from_secs(10),
            heartbeat_ttl: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(30),
            send_queue: 4,
            send_queue_bytes: 1000,
            max_incoming: usize::MAX,
        }
    }

    /// A peer's side of the handshake: greeting and READY as `socket_type`.
    fn hello(socket_type: &str) -> Vec<u8> {
        let mut g = zmtp::greeting().to_vec();
        g.extend(zmtp::ready(socket_type));
        g
    }

    /// Everything `c` would write now, written.
    fn drain(c: &mut Connection) -> Vec<u8> {
        let bytes = c.transmit().to_vec();
        c.advance(bytes.len());
        bytes
    }

    /// What a peer decodes of `bytes`.
    fn decode(bytes: &[u8]) -> Vec<Input> {
        let mut dec = Decoder::new(1 << 20);
        dec.push(bytes);
        let mut out = Vec::new();
        while let Some(i) = dec.next_input().unwrap() {
            out.push(i);
        }
        out
    }

    fn incoming(c: &mut Connection) -> Vec<Incoming> {
        std::iter::from_fn(|| c.poll_incoming()).collect()
    }

    #[test]
    fn a_sub_introduces_itself_without_identity_and_takes_only_a_pub() {
        let t = Instant::now();
        let mut c = Connection::new(Role::sub(), limits());
        c.queue(&[&zmtp::subscription(b"kv@", true)]).unwrap();
        let bytes = drain(&mut c);
        assert_eq!(
            decode(&bytes),
            vec![
                Input::Greeting,
                Input::Ready {
                    socket_type: b"SUB".to_vec(),
                    identity: Vec::new(),
                    challenge: None,
                    announced: None,
                }
            ],
            "the subscription waits for the PUB's READY"
        );
        assert!(!bytes.windows(8).any(|w| w == b"Identity"), "no Identity");
        c.handle_bytes(&hello("PUB"), t).unwrap();
        assert_eq!(
            decode(&[bytes, drain(&mut c)].concat())[2..],
            [Input::Message(vec![b"\x01kv@".to_vec()])]
        );
        let mut x = Connection::new(Role::sub(), limits());
        x.handle_bytes(&hello("XPUB"), t).unwrap();
        assert!(x.is_ready());
        let mut wrong = Connection::new(Role::sub(), limits());
        let e = wrong.handle_bytes(&hello("ROUTER"), t).unwrap_err();
        assert_eq!(
            e.to_string(),
            "the peer is a \"ROUTER\" socket, not a PUB or XPUB"
        );
    }

    #[test]
    fn a_keeping_role_yields_multipart_messages_and_subscriptions_in_order() {
        let t = Instant::now();
        let mut c = Connection::new(Role::publisher(), limits());
        let mut peer = hello("SUB");
        peer.extend(zmtp::subscription_command(b"kv@a", true));
        peer.extend(zmtp::message_frame(&zmtp::subscription(b"kv@b", true)));
        peer.extend(zmtp::subscription_command(b"kv@a", false));
        for b in &peer {
            c.handle_bytes(std::slice::from_ref(b), t).unwrap();
        }
        assert_eq!(
            incoming(&mut c),
            vec![
                Incoming::Subscribe(b"kv@a".to_vec()),
                Incoming::Message(vec![b"\x01kv@b".to_vec()]),
                Incoming::Cancel(b"kv@a".to_vec()),
            ]
        );
        assert_eq!(c.dropped(), 0);
        // A skipping role ignores subscriptions and counts messages.
        let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
        let mut peer = hello("ROUTER");
        peer.extend(zmtp::subscription_command(b"x", true));
        peer.extend(zmtp::message_frame(b"m"));
        d.handle_bytes(&peer, t).unwrap();
        assert_eq!((d.poll_incoming(), d.dropped()), (None, 1));
        // What it skips has an allowance: a burst, then a rate; past it, the end.
        let unknown = [0x04u8, 1, 0x00];
        for _ in 2..SKIPPED_BURST {
            d.handle_bytes(&unknown, t).unwrap();
        }
        assert!(matches!(
            d.handle_bytes(&unknown, t),
            Err(ConnError::Unread { .. })
        ));
        let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
        d.handle_bytes(&hello("ROUTER"), t).unwrap();
        for second in 0..20u64 {
            // Over the rate by 40 a second: within the burst for 20 s.
            for _ in 0..SKIPPED_BURST / 25 + SKIPPED_PER_SECOND {
                d.handle_bytes(&zmtp::message_frame(b"m"), t + Duration::from_secs(second))
                    .unwrap_or_else(|e| panic!("second {second}: {e}"));
            }
        }
        // Large messages pay by size: 64 of just under 1 MiB (16 cells each) fill the burst,
        // the 65th is past it.
        let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
        d.handle_bytes(&hello("ROUTER"), t).unwrap();
        let large = zmtp::message_frame(&vec![0u8; (1 << 20) - 128]);
        for n in 0..64 {
            d.handle_bytes(&large, t)
                .unwrap_or_else(|e| panic!("message {n}: {e}"));
        }
        assert!(matches!(
            d.handle_bytes(&large, t),
            Err(ConnError::Unread { .. })
        ));
        let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
        d.handle_bytes(&hello("ROUTER"), t).unwrap();
        // The peer's PINGs are never counted (its PONGs are: they answer only our own PINGs,
        // one per silent interval).
        for i in 0..10 * SKIPPED_BURST {
            d.handle_bytes(
                &zmtp::ping(0),
                t + Duration::from_secs(19) + Duration::from_micros(u64::from(i)),
            )
            .unwrap();
            drain(&mut d);
        }
        // A keeping ROUTER yields messages only: a subscription is nothing to it (it cannot
        // make a connection look at work).
        let mut r = Connection::new(Role::control_router(), limits());
        let mut peer = hello("DEALER");
        peer.extend(zmtp::subscription_command(b"x", true));
        peer.extend(zmtp::subscription_command(b"x", false));
        peer.extend(zmtp::message_frame(b"m"));
        r.handle_bytes(&peer, t).unwrap();
        assert_eq!(
            incoming(&mut r),
            vec![Incoming::Message(vec![b"m".to_vec()])]
        );
    }

    #[test]
    fn a_replay_dealer_sends_multipart_requests_and_reads_the_routers_answers() {
        let t = Instant::now();
        let mut c = Connection::new(Role::dealer(), limits());
        c.connected(t);
        c.queue(&[b"", &7u64.to_be_bytes()]).unwrap();
        let mut sent = drain(&mut c);
        c.handle_bytes(&hello("ROUTER"), t).unwrap();
        sent.extend(drain(&mut c));
        let got = decode(&sent);
        assert_eq!(
            got[1],
            Input::Ready {
                socket_type: b"DEALER".to_vec(),
                identity: Vec::new(),
                challenge: None,
                announced: None,
            }
        );
        assert_eq!(
            got[2],
            Input::Message(vec![Vec::new(), 7u64.to_be_bytes().to_vec()])
        );
        let mut answer = Vec::new();
        zmtp::write_message(&mut answer, &[b"", b"t", &7u64.to_be_bytes(), b"payload"]);
        zmtp::write_message(&mut answer, &[b"", b"", &(-1i64).to_be_bytes(), b""]);
        c.handle_bytes(&answer, t).unwrap();
        assert_eq!(
            incoming(&mut c),
            vec![
                Incoming::Message(vec![
                    Vec::new(),
                    b"t".to_vec(),
                    7u64.to_be_bytes().to_vec(),
                    b"payload".to_vec()
                ]),
                Incoming::Message(vec![
                    Vec::new(),
                    Vec::new(),
                    (-1i64).to_be_bytes().to_vec(),
                    Vec::new()
                ]),
            ]
        );
    }

    #[test]
    fn decoding_pauses_at_max_incoming_and_resumes_in_order_commands_included() {
        let t = Instant::now();
        let mut c = Connection::new(
            Role::control_router(),
            ConnLimits {
                max_incoming: 2,
                ..limits()
            },
        );
        let mut peer = greeting_and_ready("DEALER", b"10.0.0.1:5600");
        for i in 0..5u8 {
            peer.extend(zmtp::message_frame(&[i]));
        }
        peer.extend(zmtp::ping(100));
        c.handle_bytes(&peer, t).unwrap();
        let before_pong = drain(&mut c);
        assert_eq!(c.peer_identity(), Some(&b"10.0.0.1:5600"[..]));
        let mut seen = Vec::new();
        let mut rounds = 0;
        loop {
            let round = incoming(&mut c);
            assert!(
                round.len() <= 2,
                "a round yields at most max_incoming: {round:?}"
            );
            seen.extend(round);
            rounds += 1;
            if !c.holds_input() {
                break;
            }
            // The PING behind the held messages is not answered before they are taken.
            assert!(c.transmit().is_empty());
            c.decode_held(t).unwrap();
        }
        let expected: Vec<Incoming> = (0..5u8).map(|i| Incoming::Message(vec![vec![i]])).collect();
        assert_eq!((seen, rounds), (expected, 3));
        // Greeting and READY went at once; the PONG only once the messages before it were
        // decoded.
        assert_eq!(decode(&before_pong).len(), 2);
        let pong = drain(&mut c);
        assert_eq!(pong, zmtp::pong(&[]));
    }

    /// A peer's greeting and READY with an identity.
    fn greeting_and_ready(socket_type: &str, identity: &[u8]) -> Vec<u8> {
        let mut g = zmtp::greeting().to_vec();
        g.extend(zmtp::ready_with(&[
            ("Socket-Type", socket_type.as_bytes()),
            ("Identity", identity),
        ]));
        g
    }

    #[test]
    fn the_send_queue_is_bounded_in_messages_and_bytes_never_splitting_one() {
        let t = Instant::now();
        let mut c = Connection::new(Role::publisher(), limits());
        c.handle_bytes(&hello("SUB"), t).unwrap();
        // One message larger than the byte cap goes when nothing waits...
        c.queue(&[b"t", &[0; 8], &[1; 2000]]).unwrap();
        // ...and nothing more fits behind it.
        assert_eq!(c.queue(&[b"t"]), Err(QueueFull));
        drain(&mut c);
        for i in 0..4u8 {
            c.queue(&[b"t", &[i]]).unwrap();
        }
        assert_eq!(c.queue(&[b"t"]), Err(QueueFull), "four messages wait");
        // Part of the first written: still queued; once whole, room for one.
        c.advance(3);
        assert_eq!(c.queued(), 4);
        c.advance(4);
        assert_eq!(c.queued(), 3);
        c.queue(&[b"t", b"u"]).unwrap();
        // Over the bytes: 300-byte payloads, three fit under 1000.
        let mut c = Connection::new(Role::publisher(), limits());
        c.handle_bytes(&hello("SUB"), t).unwrap();
        drain(&mut c);
        let big = [9u8; 300];
        for _ in 0..3 {
            c.queue(&[&big]).unwrap();
        }
        assert_eq!(c.queue(&[&big]), Err(QueueFull));
        let written = drain(&mut c);
        assert_eq!(decode(&[hello("PUB"), written].concat()).len(), 5);
    }

    /// A message encoded straight into the queue is the bytes `queue` writes for the same
    /// body, short and long frames alike, under the same limits; a writer that fails leaves
    /// nothing queued.
    #[test]
    fn a_body_written_into_the_queue_is_framed_as_a_queued_one_under_the_same_limits() {
        let t = Instant::now();
        let ready = |c: &mut Connection| {
            c.handle_bytes(&hello("SUB"), t).unwrap();
            drain(c);
        };
        let roomy = ConnLimits {
            send_queue: 16,
            send_queue_bytes: 1 << 20,
            ..limits()
        };
        let (mut by_copy, mut in_place) = (
            Connection::new(Role::publisher(), roomy.clone()),
            Connection::new(Role::publisher(), roomy),
        );
        ready(&mut by_copy);
        ready(&mut in_place);
        for size in [0usize, 1, 255, 256, 70_000] {
            let body: Vec<u8> = (0..size).map(|i| (i % 251) as u8).collect();
            by_copy.queue(&[&body]).unwrap();
            // A hint too small or too large changes nothing.
            for hint in [0, size * 2] {
                let size = in_place
                    .queue_with(hint, |out| {
                        out.extend_from_slice(&body);
                        Ok::<(), ()>(())
                    })
                    .unwrap();
                assert_eq!(size, zmtp::message_len(&[&body]));
            }
            by_copy.queue(&[&body]).unwrap();
        }
        assert_eq!(drain(&mut in_place), drain(&mut by_copy));
        // A failed writer: nothing of it queued, what was queued before intact.
        let mut c = Connection::new(Role::publisher(), limits());
        ready(&mut c);
        c.queue(&[b"first"]).unwrap();
        let failed = c.queue_with(10, |out| {
            out.extend_from_slice(b"half of it");
            Err("no")
        });
        assert_eq!(failed, Err(QueueWithError::Body("no")));
        assert_eq!(c.queued(), 1);
        assert_eq!(drain(&mut c), [0x00, 5, b'f', b'i', b'r', b's', b't']);
        // The limits: four messages, or 1000 bytes behind what waits (one larger message
        // goes when nothing waits).
        let write = |n: usize| {
            move |out: &mut Vec<u8>| -> Result<(), ()> {
                out.resize(out.len() + n, 7);
                Ok(())
            }
        };
        c.queue_with(0, write(2000)).unwrap();
        assert_eq!(c.queue_with(0, write(1)), Err(QueueWithError::Full));
        drain(&mut c);
        for _ in 0..3 {
            c.queue_with(0, write(300)).unwrap();
        }
        assert_eq!(c.queue_with(0, write(300)), Err(QueueWithError::Full));
        c.queue_with(0, write(60)).unwrap();
        assert_eq!(
            c.queue_with(0, write(1)),
            Err(QueueWithError::Full),
            "four wait"
        );
        let written = drain(&mut c);
        assert_eq!(decode(&[hello("PUB"), written].concat()).len(), 2 + 4);
    }

    #[test]
    fn a_huge_frame_from_a_keeping_role_is_refused_from_its_header() {
        let mut c = Connection::new(Role::sub(), limits());
        c.handle_bytes(&hello("PUB"), Instant::now()).unwrap();
        let mut header = vec![0x02];
        header.extend_from_slice(&(1u64 << 40).to_be_bytes());
        let e = c.handle_bytes(&header, Instant::now()).unwrap_err();
        assert_eq!(
            e,
            ConnError::Zmtp(ZmtpError::TooLarge {
                size: 1 << 40,
                limit: 1 << 20
            })
        );
        assert!(c.buffered() < 64 * 1024, "{}", c.buffered());
    }

    /// Moves what `from` would write into `to` at `now`, as a socket taking everything.
    fn pipe(from: &mut Connection, to: &mut Connection, now: Instant) {
        let bytes = drain(from);
        to.handle_bytes(&bytes, now).unwrap();
    }

    #[test]
    fn a_sub_and_a_pub_talk_over_a_deterministic_pipe_heartbeats_included() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let (mut sub, mut publ) = (
            Connection::new(Role::sub(), limits()),
            Connection::new(Role::publisher(), limits()),
        );
        sub.connected(t);
        publ.connected(t);
        sub.queue(&[&zmtp::subscription(b"kv@", true)]).unwrap();
        for _ in 0..2 {
            pipe(&mut sub, &mut publ, t);
            pipe(&mut publ, &mut sub, t);
        }
        assert!(sub.is_ready() && publ.is_ready());
        assert_eq!(
            incoming(&mut publ),
            vec![Incoming::Message(vec![b"\x01kv@".to_vec()])]
        );
        publ.queue(&[b"kv@a", &1u64.to_be_bytes(), b"batch"])
            .unwrap();
        pipe(&mut publ, &mut sub, t);
        assert_eq!(
            incoming(&mut sub),
            vec![Incoming::Message(vec![
                b"kv@a".to_vec(),
                1u64.to_be_bytes().to_vec(),
                b"batch".to_vec()
            ])]
        );
        // Both PING at 2 s; each answers the other's, so neither times out at 12 s.
        assert_eq!(
            (sub.poll_timeout(), publ.poll_timeout()),
            (Some(t + s(2)), Some(t + s(2)))
        );
        for c in [&mut sub, &mut publ] {
            c.handle_timeout(t + s(2)).unwrap();
        }
        pipe(&mut sub, &mut publ, t + s(2));
        pipe(&mut publ, &mut sub, t + s(2));
        pipe(&mut sub, &mut publ, t + s(2));
        assert!(incoming(&mut sub).is_empty() && incoming(&mut publ).is_empty());
        // The SUB stops reading: the PUB's PING at 4 s goes unanswered, 10 s later it is over.
        publ.handle_timeout(t + s(4)).unwrap();
        publ.handle_timeout(t + s(13)).unwrap();
        assert_eq!(
            publ.handle_timeout(t + s(14)),
            Err(ConnError::HeartbeatTimeout(s(10)))
        );
        // The SUB hears nothing either: the PUB's PING at 2 s announced a TTL of 10 s, which
        // ends it at 12 s, before its own PING of 4 s would time out at 14 s.
        sub.handle_timeout(t + s(4)).unwrap();
        sub.handle_timeout(t + s(11)).unwrap();
        assert_eq!(
            sub.handle_timeout(t + s(12)),
            Err(ConnError::TtlExpired(s(10)))
        );
    }

    /// The control channel's DEALER (`Role::control_dealer`): what libzmq 4.3's DEALER with
    /// vLLM's settings does, as `control/outbound.rs` drives it.
    mod control_dealer {
        #![allow(clippy::unwrap_used)]

        use super::super::*;
        use crate::zmtp::{Decoder, Input};

        fn limits() -> ConnLimits {
            ConnLimits {
                max_message_bytes: 1 << 20,
                heartbeat_interval: Duration::from_secs(2),
                heartbeat_timeout: Duration::from_secs(10),
                heartbeat_ttl: Duration::from_secs(10),
                handshake_timeout: Duration::from_secs(30),
                send_queue: 4,
                send_queue_bytes: usize::MAX,
                max_incoming: usize::MAX,
            }
        }

        /// A ROUTER's side of the handshake, as libzmq 4.3 sends it (`minor` 0 or 1).
        fn router_hello(minor: u8) -> Vec<u8> {
            let mut g = zmtp::greeting().to_vec();
            g[11] = minor;
            g.extend(zmtp::ready("ROUTER"));
            g
        }

        /// Everything `d` would write now, written.
        fn drain(d: &mut Connection) -> Vec<u8> {
            let bytes = d.transmit().to_vec();
            d.advance(bytes.len());
            bytes
        }

        /// What a ROUTER would decode of `bytes`.
        fn as_router(bytes: &[u8]) -> Vec<Input> {
            let mut dec = Decoder::new(1 << 20);
            dec.push(bytes);
            let mut out = Vec::new();
            while let Some(i) = dec.next_input().unwrap() {
                out.push(i);
            }
            out
        }

        #[test]
        fn greeting_and_ready_leave_at_once_and_messages_wait_for_the_peers_ready() {
            let t = Instant::now();
            let mut d = Connection::new(Role::control_dealer(b"127.0.0.1:5600"), limits());
            d.queue(&[b"early"]).unwrap();
            d.connected(t);
            let hello = drain(&mut d);
            assert_eq!(&hello[..64], &zmtp::greeting());
            assert_eq!(
                as_router(&hello),
                vec![
                    Input::Greeting,
                    Input::Ready {
                        socket_type: b"DEALER".to_vec(),
                        identity: b"127.0.0.1:5600".to_vec(),
                        challenge: None,
                        announced: None,
                    }
                ]
            );
            assert!(d.transmit().is_empty(), "the message waits for the READY");
            assert_eq!(d.queued(), 1);
            // The peer's greeting alone does not open the gate; its READY does.
            let peer = router_hello(1);
            d.handle_bytes(&peer[..64], t).unwrap();
            assert!(d.transmit().is_empty() && !d.is_ready());
            d.handle_bytes(&peer[64..], t).unwrap();
            assert!(d.is_ready());
            let long = vec![9u8; 300];
            d.queue(&[&long]).unwrap();
            let mut stream = hello;
            stream.extend(drain(&mut d));
            assert!(d.is_drained());
            let got = as_router(&stream);
            assert_eq!(
                got[2..],
                [
                    Input::Message(vec![b"early".to_vec()]),
                    Input::Message(vec![long])
                ]
            );
        }

        #[test]
        fn zmtp_3_0_and_later_minors_are_accepted_older_versions_refused_precisely() {
            for minor in [0, 1, 2] {
                let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
                d.handle_bytes(&router_hello(minor), Instant::now())
                    .unwrap();
                assert!(d.is_ready(), "3.{minor}");
            }
            // ZMTP 2.0 (revision 1): refused from its 11th byte, without waiting for 64.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            let v2 = [0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 1, 5];
            let e = d.handle_bytes(&v2, Instant::now()).unwrap_err();
            assert_eq!(e, ConnError::Zmtp(ZmtpError::Version(1)));
            assert_eq!(
                e.to_string(),
                "the peer speaks an older ZMTP (version byte 1; ZMTP 2.0 sends 1): ZMTP 3.0 or later \
                 is required"
            );
            // Not ZMTP at all.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            let e = d.handle_bytes(b"HTTP/1.1 200 OK\r\n", Instant::now());
            assert!(
                matches!(e, Err(ConnError::Zmtp(ZmtpError::Signature(_)))),
                "{e:?}"
            );
        }

        #[test]
        fn a_peer_that_is_not_a_router_is_refused() {
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            let mut peer = zmtp::greeting().to_vec();
            peer.extend(zmtp::ready("PUB"));
            let e = d.handle_bytes(&peer, Instant::now()).unwrap_err();
            assert_eq!(
                e,
                ConnError::PeerType {
                    got: "PUB".into(),
                    ours: "DEALER",
                    peers: &["ROUTER"]
                }
            );
            assert_eq!(e.to_string(), "the peer is a \"PUB\" socket, not a ROUTER");
            assert!(!d.is_ready());
        }

        #[test]
        fn the_send_queue_counts_messages_not_yet_written() {
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            for i in 0..4u8 {
                d.queue(&[&[i]]).unwrap();
            }
            assert_eq!(d.queue(&[b"five"]), Err(QueueFull));
            d.connected(Instant::now());
            d.handle_bytes(&router_hello(1), Instant::now()).unwrap();
            // Half of everything written: the greeting, READY and the first messages went.
            let n = d.transmit().len();
            let whole = n - 2 * 3; // the last two frames (3 bytes each) stay unwritten
            d.advance(whole);
            assert_eq!(d.queued(), 2);
            d.queue(&[b"again"]).unwrap();
            d.queue(&[b"more"]).unwrap();
            assert_eq!(d.queue(&[b"over"]), Err(QueueFull));
            d.advance(1); // part of a frame: still queued
            assert_eq!(d.queued(), 4);
            drain(&mut d);
            assert!(d.is_drained());
        }

        #[test]
        fn heartbeats_follow_libzmqs_rules() {
            let t = Instant::now();
            let s = Duration::from_secs;
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            assert_eq!(d.poll_timeout(), Some(t + s(30)), "the handshake deadline");
            drain(&mut d);
            d.handle_bytes(&router_hello(1), t).unwrap();
            assert_eq!(d.poll_timeout(), Some(t + s(2)), "the first PING");
            d.handle_timeout(t + s(2)).unwrap();
            let ping = drain(&mut d);
            assert_eq!(ping, zmtp::ping(100), "our PING carries our TTL (10 s)");
            // Unanswered: the timeout runs from the PING, and PINGs go on meanwhile.
            d.handle_timeout(t + s(4)).unwrap();
            assert_eq!(drain(&mut d), zmtp::ping(100));
            assert_eq!(
                d.handle_timeout(t + s(12)),
                Err(ConnError::HeartbeatTimeout(s(10)))
            );
            // Answered (any byte does): the timeout is off until the next PING.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            d.handle_timeout(t + s(2)).unwrap();
            d.handle_bytes(&zmtp::pong(b""), t + s(3)).unwrap();
            d.handle_timeout(t + s(12)).unwrap();
            // The peer's PING: a PONG with its context, and its TTL watched.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            drain(&mut d);
            let mut ping = zmtp::ping(30).to_vec();
            // PING with a context: the command's size byte grows by its length.
            ping[1] += 3;
            ping.extend_from_slice(b"ctx");
            d.handle_bytes(&ping, t + s(1)).unwrap();
            assert_eq!(drain(&mut d), zmtp::pong(b"ctx"));
            assert_eq!(d.handle_timeout(t + s(4)), Err(ConnError::TtlExpired(s(3))));
        }

        #[test]
        fn a_peer_that_pings_us_gets_no_ping_of_ours_until_it_falls_silent() {
            let t = Instant::now();
            let s = Duration::from_secs;
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            drain(&mut d);
            // The peer pings every second (as libzmq does every 2 s): each PING gets its PONG,
            // and ours never goes.
            for i in 1..=10u64 {
                let at = t + Duration::from_millis(1000 * i);
                d.handle_bytes(&zmtp::ping(100), at).unwrap();
                d.handle_timeout(at).unwrap();
                assert_eq!(drain(&mut d), zmtp::pong(b""), "second {i}");
                assert!(d.poll_timeout().is_some_and(|p| p > at));
            }
            // Silent for an interval: our PING goes, then its timeout runs.
            let quiet = t + s(10) + s(2);
            d.handle_timeout(quiet).unwrap();
            assert_eq!(drain(&mut d), zmtp::ping(100));
            assert_eq!(
                d.handle_timeout(quiet + s(10)),
                Err(ConnError::HeartbeatTimeout(s(10))),
                "a dead peer is still found"
            );
        }

        #[test]
        fn a_probe_pings_at_once_and_ends_an_unanswering_connection_at_its_own_deadline() {
            let t = Instant::now();
            let s = Duration::from_secs;
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            assert!(!d.probe(t, s(1)), "nothing to probe before the handshake");
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            drain(&mut d);
            // The peer spoke just now: the probe pings anyway (a dead host's last bytes may be
            // recent), and its deadline is the probe's, not the heartbeat's 10 s.
            d.handle_bytes(&zmtp::pong(b""), t + s(1)).unwrap();
            assert!(d.probe(t + s(1), s(1)));
            assert_eq!(drain(&mut d), zmtp::ping(100));
            assert_eq!(d.poll_timeout(), Some(t + s(2)));
            d.handle_timeout(t + Duration::from_millis(1999)).unwrap();
            assert_eq!(
                d.handle_timeout(t + s(2)),
                Err(ConnError::ProbeUnanswered(s(1)))
            );
            assert_eq!(
                ConnError::ProbeUnanswered(s(1)).to_string(),
                "no answer to a liveness probe within 1s"
            );

            // Any byte answers it: the connection goes on, its heartbeat as before.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            drain(&mut d);
            assert!(d.probe(t, s(1)));
            drain(&mut d);
            d.handle_bytes(&zmtp::pong(b""), t + Duration::from_millis(300))
                .unwrap();
            d.handle_timeout(t + s(5)).unwrap();
            assert_eq!(drain(&mut d), zmtp::ping(100), "the next heartbeat");
            assert_eq!(
                d.handle_timeout(t + s(15)),
                Err(ConnError::HeartbeatTimeout(s(10))),
                "an ordinary heartbeat timeout again"
            );

            // A heartbeat PING already unanswered: a PING of the probe's own (the host
            // acknowledged the first one already), the deadline brought forward; a later probe
            // never pushes an earlier deadline back, nor sends another PING.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            d.handle_timeout(t + s(2)).unwrap();
            drain(&mut d);
            assert!(d.probe(t + s(3), s(1)));
            assert_eq!(drain(&mut d), zmtp::ping(100), "the probe's own PING");
            assert!(d.probe(t + s(3) + Duration::from_millis(500), s(5)));
            assert!(d.transmit().is_empty());
            assert_eq!(d.poll_timeout(), Some(t + s(4)));
            assert_eq!(
                d.handle_timeout(t + s(4)),
                Err(ConnError::ProbeUnanswered(s(1)))
            );
        }

        #[test]
        fn a_probe_the_host_answered_gives_the_deadline_back_to_the_heartbeat() {
            let t = Instant::now();
            let s = Duration::from_secs;
            // No heartbeat PING was unanswered: no deadline until the heartbeat's next PING.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            drain(&mut d);
            assert!(d.probe(t + s(1), s(1)));
            assert_eq!(drain(&mut d), zmtp::ping(100), "the probe's PING");
            assert_eq!(d.probing().map(|p| p.started), Some(t + s(1)));
            d.probe_answered_by_host();
            assert_eq!(d.probing(), None);
            assert!(!d.ping_unanswered());
            d.handle_timeout(t + s(2)).unwrap();
            assert_eq!(drain(&mut d), zmtp::ping(100), "the heartbeat's PING");
            d.handle_timeout(t + s(11)).unwrap();
            assert_eq!(
                d.handle_timeout(t + s(12)),
                Err(ConnError::HeartbeatTimeout(s(10))),
                "the process still answers nothing: its heartbeat ends it"
            );
            // A heartbeat PING unanswered before the probe: its own deadline comes back.
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            d.handle_timeout(t + s(2)).unwrap();
            drain(&mut d);
            assert!(d.probe(t + s(5), s(1)));
            d.probe_answered_by_host();
            assert_eq!(d.poll_timeout(), Some(t + s(4)), "the next PING");
            d.handle_timeout(t + s(11)).unwrap();
            assert_eq!(
                d.handle_timeout(t + s(12)),
                Err(ConnError::HeartbeatTimeout(s(10)))
            );
        }

        #[test]
        fn a_peer_that_pings_and_never_reads_gets_one_pong_pending_at_a_time() {
            let t = Instant::now();
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.connected(t);
            d.handle_bytes(&router_hello(1), t).unwrap();
            drain(&mut d);
            let pings = zmtp::ping(0).repeat(10_000);
            d.handle_bytes(&pings, t).unwrap();
            assert_eq!(d.transmit(), zmtp::pong(b""), "one PONG, not ten thousand");
            drain(&mut d);
            d.handle_bytes(&zmtp::ping(0), t).unwrap();
            assert_eq!(
                drain(&mut d),
                zmtp::pong(b""),
                "written: the next PING is answered"
            );
        }

        #[test]
        fn a_handshake_that_never_finishes_times_out_from_the_connection() {
            let t = Instant::now();
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.handle_timeout(t + Duration::from_secs(3600)).unwrap();
            assert_eq!(d.poll_timeout(), None, "no clock before TCP connects");
            d.connected(t);
            d.handle_bytes(&zmtp::greeting(), t).unwrap();
            d.handle_timeout(t + Duration::from_secs(29)).unwrap();
            assert_eq!(
                d.handle_timeout(t + Duration::from_secs(30)),
                Err(ConnError::HandshakeTimeout(Duration::from_secs(30)))
            );
        }

        #[test]
        fn messages_from_the_router_are_dropped_unbuffered_and_a_huge_frame_refused() {
            let t = Instant::now();
            let mut d = Connection::new(Role::control_dealer(b"a:1"), limits());
            d.handle_bytes(&router_hello(1), t).unwrap();
            let big = vec![1u8; 512 * 1024];
            let frame = zmtp::message_frame(&big);
            for chunk in frame.chunks(64 * 1024) {
                d.handle_bytes(chunk, t).unwrap();
                assert!(d.buffered() < 200 * 1024, "{}", d.buffered());
            }
            assert_eq!(d.dropped(), 1);
            // A 1 TiB frame: refused from its header.
            let mut header = vec![0x02];
            header.extend_from_slice(&(1u64 << 40).to_be_bytes());
            let e = d.handle_bytes(&header, t).unwrap_err();
            assert_eq!(
                e,
                ConnError::Zmtp(ZmtpError::TooLarge {
                    size: 1 << 40,
                    limit: 1 << 20
                })
            );
        }
    }
}
