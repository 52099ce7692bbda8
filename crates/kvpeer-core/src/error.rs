//! Why things fail, as types: why a session ended ([`CloseReason`], [`SessionEnd`]; a lost
//! control connection's cause, [`LinkLoss`]), why an
//! inbound connection was refused ([`Refusal`]), how a peer broke the protocol
//! ([`ProtocolViolation`]), why its `connect` was rejected ([`ConnectRejection`]), what went
//! wrong on our side ([`InternalError`]), and what the data plane reports ([`PlaneError`]).
//!
//! Contract: each `Display` gives the text the logs have always shown (operators grep for it),
//! and every decision about an end (orderly or not, who caused it, whether to back the peer
//! off) is made on the variants, never on that text.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvpeer_proto::{
    DecodeError, EncodeError, KvRequestId, MessageType, PeerId, PeerIdError, ProtocolError,
    RoundSeq,
};

use crate::ids::ServeCtx;

/// Who ended a session (as h2's `Initiator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Initiator {
    /// This node's owner: a local close, shutdown, or the node refusing the peer.
    User,
    /// The core itself: a deadline, a protocol violation, a data-plane fault, eviction.
    Library,
    /// The peer, or the connection to it.
    Remote,
}

/// Why a session ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CloseReason {
    /// Closed on this side (shutdown, or the session was reaped without another reason).
    #[error("closed locally")]
    Closed,
    /// The peer said `disconnect`.
    #[error("peer disconnected")]
    PeerDisconnected,
    /// The peer refused our `connect` and said why (a kvpeer peer's `kvpeer_reason`, with
    /// both sides' values; cleaned and bounded, see [`PeerSaid`]).
    #[error("the peer refused our connect: {0}")]
    RefusedByPeer(PeerSaid),
    /// The control connection is gone, and how (refused, closed, not ZMTP, silent, ...).
    #[error("control connection lost: {0}")]
    ConnectionLost(LinkLoss),
    /// This node will not talk to the peer (its own policy, e.g. the allowlist).
    #[error("{0}")]
    Refused(LocalRefusal),
    /// The peer did not ack our `connect` within the handshake timeout.
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// A lookup got no progress within the lookup timeout.
    #[error("lookup response timed out")]
    LookupTimeout,
    /// An `abort_fetch` got no `abort_ack` within the abort-ack timeout: the peer may still be
    /// writing the aborted load's blocks, so the session ends and its access is fenced before
    /// the blocks are handed back (vLLM 0.34's escalation).
    #[error("abort_ack timed out")]
    AbortAckTimeout,
    /// Evicted to make room: no work and no traffic for the idle timeout.
    #[error("idle")]
    Idle,
    /// Its slot was given to a newcomer: the sessions were full (or its host's share was), and
    /// of its host's (or the heaviest host's) sessions it was the idlest.
    #[error("evicted for a newcomer: sessions full")]
    Evicted,
    /// The peer broke the protocol.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolViolation),
    /// Handling the peer's messages failed on our side too many times in a row (a peer may
    /// be wedging us into a bad state); counted as a protocol error.
    #[error("protocol error: too many consecutive dispatch errors ({count})")]
    TooManyInternalErrors {
        /// Errors in a row.
        count: u32,
        /// The last of them.
        #[source]
        last: InternalError,
    },
    /// The peer's `connect` was rejected.
    #[error("rejected peer connect: {0}")]
    ConnectRejected(#[source] ConnectRejection),
    /// The data plane could not register the peer's memory.
    #[error("peer registration failed: {0}")]
    RegistrationFailed(#[source] PlaneError),
    /// The data plane reported the peer unusable.
    #[error("data plane: {0}")]
    DataPlaneFault(#[source] PlaneError),
}

impl CloseReason {
    /// Who ended the session.
    pub fn initiator(&self) -> Initiator {
        match self {
            CloseReason::Closed | CloseReason::Refused(_) => Initiator::User,
            CloseReason::PeerDisconnected
            | CloseReason::RefusedByPeer(_)
            | CloseReason::ConnectionLost(_) => Initiator::Remote,
            _ => Initiator::Library,
        }
    }

    /// An end that is routine: either side said `disconnect`, or this side closed it.
    pub fn is_orderly(&self) -> bool {
        matches!(
            self,
            CloseReason::Closed | CloseReason::PeerDisconnected | CloseReason::RefusedByPeer(_)
        )
    }

    /// The peer's side ended it: it said `disconnect`, or its host closed or reset its
    /// connection (its process exited, or closed the socket). A stalled process (SIGSTOP, a GC
    /// pause, a paused VM) does neither; its session ends by our timeouts instead.
    pub fn ended_by_peer(&self) -> bool {
        use std::io::ErrorKind::{BrokenPipe, ConnectionAborted, ConnectionReset};
        matches!(
            self,
            CloseReason::PeerDisconnected
                | CloseReason::RefusedByPeer(_)
                | CloseReason::ConnectionLost(
                    LinkLoss::ClosedByPeer
                        | LinkLoss::Socket(ConnectionReset | ConnectionAborted | BrokenPipe)
                )
        )
    }
}

/// What a peer said when it refused us: its text, cut to [`PeerSaid::MAX_BYTES`] at a character
/// boundary, every control character (newlines, escapes) shown as `?`, and shown quoted with
/// Rust's escapes (`"` and `\` escaped, format and bidi characters as `\u{..}`), so a peer can
/// neither forge log lines or fields nor fill them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerSaid(String);

impl PeerSaid {
    /// Most bytes kept of what a peer said.
    pub const MAX_BYTES: usize = 512;

    /// Cleans and bounds `text`, as received.
    pub fn new(text: &str) -> Self {
        let mut kept = String::with_capacity(text.len().min(Self::MAX_BYTES));
        for c in text.chars() {
            let c = if c.is_control() { '?' } else { c };
            if kept.len() + c.len_utf8() > Self::MAX_BYTES {
                break;
            }
            kept.push(c);
        }
        PeerSaid(kept)
    }

    /// The cleaned text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for PeerSaid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

/// Why this node will not talk to a peer: its own policy, not anything the peer did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LocalRefusal {
    /// The peer's address is outside this node's allowlist, or (for a node with a tenant)
    /// of another tenant.
    #[error("not in the allowlist, or of another tenant (tenants)")]
    NotAllowed,
}

/// How a control connection to a peer went away, as this side saw it: the cause that
/// [`CloseReason::ConnectionLost`] carries up to the user (`kvpeer fetch`'s last line, the
/// node's errors), so "lost" always says what was lost and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LinkLoss {
    /// The peer's host name did not resolve.
    #[error("cannot resolve {host}: {detail}")]
    Unresolved {
        /// The name.
        host: Arc<str>,
        /// The resolver's words.
        detail: Arc<str>,
    },
    /// The node will not dial the peer's address: it is one no peer can have (`0.0.0.0`, `::`,
    /// multicast: `connect(2)` reads the first two as this host), or its host name resolved
    /// only to such addresses or to addresses this node's policy refuses.
    #[error("will not dial {peer}: {why}")]
    NotDialable {
        /// The peer as named.
        peer: Arc<str>,
        /// Why (what it reads or resolves as).
        why: Arc<str>,
    },
    /// The peer refused the connection and said why (a ZMTP ERROR: a kvpeer node whose
    /// identity check refused the identity this node claims names it and the address it came
    /// from).
    #[error("refused by the peer: {0}")]
    RefusedByPeer(Arc<str>),
    /// The node we dialed answers as another identity (its READY said so): no session can
    /// follow, since a node answers only as its own identity. Name it as it calls itself.
    #[error("the node at {dialed} calls itself {calls_itself}: name it {calls_itself} (a node answers only as its own identity)")]
    IdentityMismatch {
        /// The peer as this node named it.
        dialed: Arc<str>,
        /// The identity its READY told.
        calls_itself: Arc<str>,
    },
    /// Nothing listens at the address: the connect was refused.
    #[error("nothing listens at {0} (connection refused)")]
    NothingListens(SocketAddr),
    /// The address could not be reached (no route, the connect timed out, ...).
    #[error("cannot reach {addr}: {kind}")]
    Unreachable {
        /// Where we dialed.
        addr: SocketAddr,
        /// The system's error.
        kind: io::ErrorKind,
    },
    /// The peer closed the connection (end of stream).
    #[error("closed by the peer")]
    ClosedByPeer,
    /// The socket failed once connected (reset, broken pipe, ...).
    #[error("socket error: {0}")]
    Socket(io::ErrorKind),
    /// The peer's bytes are not ZMTP from a ROUTER socket: the port is not a kvpeer or vLLM
    /// control port.
    #[error("not a kvpeer or vLLM control port: {0}")]
    NotZmtp(Cause),
    /// The peer broke ZMTP after its greeting (a frame over the limit, a malformed command).
    #[error("ZMTP protocol error: {0}")]
    Zmtp(Cause),
    /// The ZMTP handshake (greeting and READY) did not finish in time.
    #[error("no ZMTP handshake within {0:?}: the port accepts connections but does not answer as a kvpeer or vLLM control port")]
    HandshakeTimeout(Duration),
    /// Our heartbeat got no answer, or the peer fell silent past the TTL it announced.
    #[error("the peer fell silent: no heartbeat answer within {0:?}")]
    Silent(Duration),
    /// Another connection to the peer's host was lost, and this one answered no liveness
    /// probe in time: the host is taken for down.
    #[error("its host lost another connection, and it answered no liveness probe within {0:?}")]
    ProbeUnanswered(Duration),
    /// The peer's host was taken for down a moment ago (a connection to it was lost and no
    /// connection to it answered since): not dialed again until the hold ends.
    #[error("its host {host} is taken for down (a connection to it was lost and none answered since); not dialed for {hold:?}")]
    HostDown {
        /// The host.
        host: std::net::IpAddr,
        /// How long after the loss dials to it are refused.
        hold: Duration,
    },
    /// Our queue to the peer overflowed or a send failed: the connection was closed.
    #[error("cannot send to the peer: {0}")]
    SendFailed(SendFailure),
    /// The node could not open a connection (a bad identity, no poll for its socket).
    #[error("cannot dial the peer: {0}")]
    DialFailed(DialFailure),
    /// The peer connected to us again: its new session replaces this one.
    #[error("the peer connected again (its new session replaces this one)")]
    Replaced,
    /// The peer's messages waited for our connection's handshake, which never came in time
    /// (or they grew past what is held for it).
    #[error("our connection to the peer finished no handshake in time; its messages dropped")]
    NoHandshake,
    /// The TCP connect did not finish in time.
    #[error("connect not done within {0:?}")]
    ConnectTimeout(Duration),
    /// The peer took none of our bytes for this long while some waited.
    #[error("the peer took none of our bytes for {0:?}")]
    Stalled(Duration),
    /// Our listener was full and this connection was worth least: it made room for a newcomer.
    #[error("evicted for a newcomer (connections full)")]
    Evicted,
    /// All connections together held more than the node's buffer cap, this one the most.
    #[error("the node's buffers are over their cap and this connection held the most")]
    OverBuffers,
    /// Our side closed it (the node will not hear this connection).
    #[error("closed by this node")]
    ClosedHere,
    /// The identity its READY claimed is not `host:port`.
    #[error("its READY claimed an identity that is not host:port")]
    BadIdentity,
    /// The TLS layer of a control connection failed: a certificate the other side did not
    /// trust (or that does not name the address it speaks for), a record that did not
    /// authenticate, TLS where none is configured, plaintext where TLS is required.
    #[error("TLS: {0}")]
    Tls(Arc<str>),
    /// It held more subscriptions than a subscriber may.
    #[error("over {0} subscriptions")]
    TooManySubscriptions(usize),
    /// A driver that does not say (a test, an in-process transport).
    #[error("no cause given")]
    Unspecified,
}

/// Another layer's error kept whole, for a cause the core cannot name (a ZMTP error is
/// kvpeer-net's): its type for [`Cause::downcast_ref`], its words for the user. Two are equal
/// when their words are.
#[derive(Clone)]
pub struct Cause(Arc<dyn std::error::Error + Send + Sync>);

impl Cause {
    /// Keeps `error`.
    pub fn new(error: impl std::error::Error + Send + Sync + 'static) -> Self {
        Cause(Arc::new(error))
    }

    /// The error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.0.downcast_ref::<E>()
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

impl fmt::Debug for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl PartialEq for Cause {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

impl Eq for Cause {}

/// Why this node could not open a control connection to a peer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DialFailure {
    /// The peer's identity is not `host:port`.
    #[error(transparent)]
    NotHostPort(#[from] PeerIdError),
    /// The connection's socket could not be registered in the poll.
    #[error("cannot poll the socket: {0}")]
    Poll(io::ErrorKind),
}

/// Why a message to a peer could not be sent (its connection is closed for it).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendFailure {
    /// Our queue to the peer is full: it reads slower than we send.
    #[error("its send queue is full (it reads slower than this node sends)")]
    QueueFull,
    /// A write took no bytes.
    #[error("the socket took no bytes")]
    NoBytesTaken,
    /// The message could not be encoded.
    #[error(transparent)]
    Encode(#[from] EncodeError),
}

/// What a lost connection says about the peer's host, as the control channel's host
/// liveness reads it (`kvpeer-net`'s `control/hosts.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostSign {
    /// Nothing on its host answered: the heartbeat or a probe went unanswered, the connect
    /// timed out or found no route to the host. The host may be gone: every other connection
    /// to it is probed, and with none left that answers it is taken for down. (The control
    /// channel makes a silent heartbeat [`HostSign::ProcessGone`] when the host's kernel still
    /// acknowledged our bytes: its process is silent, the host is up.)
    Unanswered,
    /// The peer's end closed or reset the connection: its host's kernel answered, so the host
    /// was up then, but a host going down (a pod torn down) may close one process's
    /// connections before the others fall silent: the others are probed, nothing more.
    ProcessGone,
    /// Nothing about the host (a ZMTP refusal, a protocol error, our own close, a name that
    /// does not resolve, a connect refused by the host itself, a local error).
    None,
}

impl LinkLoss {
    /// What this loss says about the peer's host ([`HostSign`]).
    pub fn host_sign(&self) -> HostSign {
        use io::ErrorKind::{
            BrokenPipe, ConnectionAborted, ConnectionReset, HostUnreachable, NetworkUnreachable,
            TimedOut,
        };
        match self {
            LinkLoss::Silent(_)
            | LinkLoss::ProbeUnanswered(_)
            | LinkLoss::ConnectTimeout(_)
            | LinkLoss::Stalled(_)
            | LinkLoss::Unreachable {
                kind: TimedOut | HostUnreachable | NetworkUnreachable,
                ..
            }
            | LinkLoss::Socket(TimedOut | HostUnreachable | NetworkUnreachable) => {
                HostSign::Unanswered
            }
            LinkLoss::ClosedByPeer
            | LinkLoss::Socket(ConnectionReset | ConnectionAborted | BrokenPipe) => {
                HostSign::ProcessGone
            }
            _ => HostSign::None,
        }
    }

    /// The cause of a failed connect to `addr`.
    pub fn of_connect(addr: SocketAddr, error: &io::Error) -> LinkLoss {
        match error.kind() {
            io::ErrorKind::ConnectionRefused => LinkLoss::NothingListens(addr),
            kind => LinkLoss::Unreachable { addr, kind },
        }
    }
}

/// A session's end as reported in [`Event::Close`](crate::Event::Close): the reason and what
/// it costs the peer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionEnd {
    /// Why it ended (the first reason wins).
    pub reason: CloseReason,
    /// It ended before the peer acked our `connect`: the peer is neither dialed nor answered
    /// again for this long.
    pub dial_backoff: Option<Duration>,
    /// It ended after a data-plane fault.
    pub fault: Option<FaultRecord>,
}

/// The data-plane faults of one peer so far, and the wait before it may reconnect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FaultRecord {
    /// Faults of this peer (this one included).
    pub count: u32,
    /// Wait before the peer may reconnect (zero for the first fault).
    pub reconnect_backoff: Duration,
}

impl SessionEnd {
    /// Routine (either side said `disconnect`, or we closed it, with no data-plane fault):
    /// logged as info; anything else is worth a warning.
    pub fn is_orderly(&self) -> bool {
        self.reason.is_orderly() && self.fault.is_none()
    }
}

impl fmt::Display for SessionEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.reason)?;
        if let Some(wait) = self.dial_backoff {
            write!(f, "; not dialed again for {} ms", wait.as_millis())?;
        }
        if let Some(fault) = self.fault {
            write!(f, "; data-plane fault #{}", fault.count)?;
            if fault.reconnect_backoff > Duration::ZERO {
                write!(
                    f,
                    "; reconnect backoff {}s",
                    fault.reconnect_backoff.as_secs()
                )?;
            }
        }
        Ok(())
    }
}

/// Why an inbound connection was refused before any session existed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Refusal {
    /// A session with this peer exists already.
    #[error("duplicate connection from {0}")]
    Duplicate(PeerId),
    /// Every session slot is taken.
    #[error("session limit reached ({open}/{max})")]
    SessionLimit {
        /// Sessions open.
        open: usize,
        /// The limit.
        max: usize,
    },
    /// Dials to the peer kept failing; it gets no answer until this passes.
    #[error("backoff after failed dials to it ({} ms left)", .left.as_millis())]
    DialBackoff {
        /// Time left.
        left: Duration,
    },
    /// The peer's data plane faulted lately; it may reconnect after this.
    #[error("reconnect backoff after a data-plane fault ({:.1}s left)", .left.as_secs_f64())]
    ReconnectBackoff {
        /// Time left.
        left: Duration,
    },
    /// Writes of the peer's ended session may still be running (retained, their source blocks
    /// pinned); it gets no new session until they stop.
    #[error("writes of its ended session are still running (retained until they stop)")]
    WritesRetained,
    /// The first payload of a peer without a session did not decode.
    #[error("no session, and the first payload is no connect: {0}")]
    BadFirstPayload(#[source] DecodeError),
    /// The first message of a peer without a session is not a `connect`.
    #[error("no session, and {0} does not open one")]
    NotAConnect(MessageType),
}

/// How a peer broke the protocol (the session ends at once).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtocolViolation {
    /// A known message whose fields fail validation.
    #[error("malformed message: {0}")]
    Malformed(#[source] ProtocolError),
    /// A second `connect` on a session.
    #[error("duplicate connect after handshake")]
    DuplicateConnect,
    /// A second non-empty `fetch` for one round.
    #[error("duplicate fetch for kv_request_id={id} round={round}")]
    DuplicateFetch {
        /// The request.
        id: KvRequestId,
        /// The round.
        round: RoundSeq,
    },
    /// A `fetch` naming a block outside the peer's own region.
    #[error("fetch: block_indexes[{position}] = {index} is outside the peer's {limit} blocks")]
    FetchOutOfRange {
        /// Position in `block_indexes`.
        position: usize,
        /// The index named.
        index: u64,
        /// Blocks in the peer's region.
        limit: u64,
    },
}

/// Why a peer's `connect` was rejected (the peer gets a `disconnect`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectRejection {
    /// The `connect` names another peer than the connection's identity.
    #[error("connect names peer {named} but came from {from}")]
    PeerIdMismatch {
        /// The `peer_id` in the message.
        named: PeerId,
        /// The identity of the connection.
        from: PeerId,
    },
    /// The block sizes differ.
    #[error("block_len mismatch: remote={remote}, local={local}")]
    BlockLen {
        /// The peer's.
        remote: u64,
        /// Ours.
        local: u64,
    },
    /// The configuration fingerprints differ.
    #[error("config fingerprint mismatch: remote={remote:?}, local={local:?}")]
    Fingerprint {
        /// The peer's.
        remote: String,
        /// Ours.
        local: String,
    },
    /// The hash seeds differ.
    #[error("hash seed mismatch: remote={remote:?}, local={local:?}; PYTHONHASHSEED must match on all peers")]
    HashSeed {
        /// The peer's.
        remote: String,
        /// Ours.
        local: String,
    },
    /// The peer's pool has more blocks than this node takes (`max_peer_blocks`).
    #[error(
        "the peer's pool has {blocks} blocks, over the {most} this node takes (max_peer_blocks)"
    )]
    PoolTooLarge {
        /// The peer's `num_blocks`.
        blocks: u64,
        /// Ours.
        most: u64,
    },
    /// The data plane would not start registering the peer.
    #[error("data plane refused the peer: {0}")]
    PlaneRefused(#[source] PlaneError),
}

impl ConnectRejection {
    /// The refusal as the refused peer reads it (sent as `disconnect`'s `kvpeer_reason`): the
    /// cause with its value and ours. Only peers past the allowlist and the secret get this far
    /// (the node refuses others before the core sees their `connect`). The hash seed decides
    /// every key, and a digest of ours could be searched back to it (a `PYTHONHASHSEED` is a
    /// 32-bit number), so ours is never told in any form: the peer is told the first 12 hex
    /// digits of the SHA-256 of the seed it sent (so it can tell which seed arrived) and that
    /// ours differs.
    pub fn told_to_peer(&self) -> String {
        match self {
            ConnectRejection::PeerIdMismatch { named, from } => format!(
                "your connect names peer {named}, but it came from {from}: a node must call itself \
                 by the address it connects from"
            ),
            ConnectRejection::BlockLen { remote, local } => {
                format!("block_len differs: yours {remote}, mine {local}")
            }
            ConnectRejection::Fingerprint { remote, local } => {
                format!("config fingerprint differs: yours {remote:?}, mine {local:?}")
            }
            ConnectRejection::HashSeed { remote, .. } => format!(
                "hash seed differs: yours (SHA-256 {}...) is not mine, which is not told \
                 (PYTHONHASHSEED must match on all peers)",
                seed_digest(remote)
            ),
            ConnectRejection::PoolTooLarge { blocks, most } => {
                format!("your pool has {blocks} blocks, over the {most} I take (max_peer_blocks)")
            }
            ConnectRejection::PlaneRefused(e) => {
                format!("my data plane will not take your memory: {e}")
            }
        }
    }
}

/// The first 12 hex digits of the SHA-256 of a hash seed (see [`ConnectRejection::told_to_peer`]).
pub fn seed_digest(seed: &str) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(seed.as_bytes());
    digest.iter().take(6).map(|b| format!("{b:02x}")).collect()
}

/// Something that went wrong on our side while handling a peer's message: counted, and
/// enough in a row end the session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum InternalError {
    /// The store would not pin keys it had just answered HIT (those keys are answered MISS).
    #[error("store refused to pin keys it reported held ({0})")]
    PinRefused(ServeCtx),
}

/// What kind of data-plane failure a [`PlaneError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PlaneErrorKind {
    /// What the peer advertised is unusable or not allowed (metadata, address, key).
    Rejected,
    /// The peer is not registered (never, or no longer).
    NotRegistered,
    /// A local resource ran out (a thread, a descriptor, memory).
    Resources,
    /// The path to the peer failed (connection, I/O, the transfer agent).
    Transport,
}

/// A data-plane failure: its kind and the plane's own typed error (its `source`), so the chain
/// from a socket's error to what the user reads stays typed: `PlaneError` → the plane's error
/// (`TcpFault`, `ShmRefusal`, ...) → the system's.
#[derive(Debug, Clone)]
pub struct PlaneError {
    kind: PlaneErrorKind,
    cause: Arc<dyn std::error::Error + Send + Sync>,
}

impl fmt::Display for PlaneError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.cause, f)
    }
}

impl std::error::Error for PlaneError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.cause.source()
    }
}

/// Two failures are the same when of the same kind and saying the same.
impl PartialEq for PlaneError {
    fn eq(&self, other: &Self) -> bool {
        self.kind == other.kind && self.cause.to_string() == other.cause.to_string()
    }
}

impl Eq for PlaneError {}

/// A plane that has no error type of its own for a failure (a test's fake) says it in words.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{0}")]
pub struct PlaneWords(pub Arc<str>);

impl PlaneError {
    /// A failure of `kind`, as the plane's error `cause` says it.
    pub fn new(
        kind: PlaneErrorKind,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> Self {
        PlaneError {
            kind,
            cause: Arc::new(cause),
        }
    }

    /// What the peer advertised is unusable.
    pub fn rejected(cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::new(PlaneErrorKind::Rejected, cause)
    }

    /// The peer is not registered.
    pub fn not_registered() -> Self {
        Self::new(PlaneErrorKind::NotRegistered, NotRegistered)
    }

    /// A local resource ran out.
    pub fn resources(cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::new(PlaneErrorKind::Resources, cause)
    }

    /// The path to the peer failed.
    pub fn transport(cause: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self::new(PlaneErrorKind::Transport, cause)
    }

    /// A failure of `kind` in words (a test's fake plane).
    pub fn words(kind: PlaneErrorKind, words: &str) -> Self {
        Self::new(kind, PlaneWords(words.into()))
    }

    /// Its kind.
    pub fn kind(&self) -> PlaneErrorKind {
        self.kind
    }

    /// The plane's own error.
    pub fn cause(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        &*self.cause
    }

    /// The plane's own error, if it is an `E`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.cause.downcast_ref::<E>()
    }
}

/// A write to the peer still in flight past `transfer_stall_timeout`: the path to it is wedged
/// (vLLM 0.34's `VLLM_P2P_TRANSFER_STALL_TIMEOUT_S`); the peer is faulted.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error(
    "a write to the peer was still in flight {0:?} after it was posted (transfer_stall_timeout_s)"
)]
pub struct TransferStalled(pub std::time::Duration);

/// The peer is not (or no longer) registered with the plane.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("not registered")]
pub struct NotRegistered;
