//! The control channel's connecting side: one ZMTP DEALER connection per peer, driven by the
//! node's own thread (no libzmq, no I/O thread).
//!
//! Each connection is a [`Dialer`] (the crate's one connecting socket) whose [`Connection`]
//! speaks the control DEALER's role. The observable behaviour is libzmq's DEALER with the socket monitor the channel used to
//! keep, because the core and every test rely on it:
//!
//! * [`Outbound::dial`] never blocks: an address (in any spelling: the identity is read as a
//!   [`PeerAddr`]) is connected to at once (non-blocking `connect`), a host name is resolved
//!   on a short-lived helper thread whose pipe wakes the poll, and what it resolves to is
//!   judged as an address (never one no peer can have).
//!   `0.0.0.0` and `::` (which `connect(2)` reads as this host) are never dialed. Messages
//!   queue from the start and leave once the handshake is done.
//! * A connect that fails (refused, unreachable, reset) is a lost connection: libzmq's monitor
//!   reported it as `CLOSED`, which the channel took as lost, and the core answers its
//!   lookups MISS at once instead of waiting for a deadline. When no socket can be made at all
//!   (out of descriptors), the connect is retried every `reconnect_interval` (100 ms) without
//!   a report, as libzmq's reconnect timer does.
//! * Once connected, end of stream, a socket error, a handshake or protocol failure, or a
//!   heartbeat timeout is a lost connection; so is a name that does not resolve. A lost
//!   connection is reported once (by [`Outbound::take_losses`]) and dropped; the next send
//!   dials afresh.
//! * [`Outbound::close`] lets the queued messages linger up to `linger` (500 ms) without
//!   blocking: the connection stays in the poll set, reports nothing, and is dropped once its
//!   messages are written, when it fails, or at the deadline. Dropping `Outbound` (the
//!   channel) waits up to `linger` for them, as `zmq_ctx_term` did.
//!
//! Every socket (and a resolver's pipe) is registered in the channel's [`Poller`]; readiness
//! comes through [`Outbound::on_ready`], deadlines (heartbeats, handshakes, retries, lingers)
//! are kept in one [`Timers`], and [`Outbound::progress`] visits only the connections the poll
//! or a deadline named, and those with bytes left from their last turn, so a wake costs what
//! is ready, not what is open. Losses waiting to be reported are kept in a set, so asking for
//! them costs nothing when there are none.
//!
//! **Writes in turns.** A message of up to [`WRITE_PER_TURN`] is written as it is sent when
//! nothing waits before it (an answer to an honest lookup leaves at once); a larger one (the
//! answer to a lookup of thousands of keys) is written in turns of at most that much, and all
//! connections together write at most [`WRITE_PER_ROUND`] per call of [`Outbound::progress`],
//! taking turns from a rotating cursor: the answers a flood makes cost each step of the
//! node's loop a bounded part of its thread.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs::File;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::AsFd;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvpeer_core::{HostSign, LinkLoss};
use kvpeer_proto::{is_peer_ip, Host, PeerAddr, PeerId};
use tracing::{debug, info, warn};

use crate::control::hosts::HostWatch;

use crate::io::poller::{Poller, Ready, Token};
use crate::io::timers::{coarse, Timers};
use crate::zmtp::connection::{ConnLimits, Connection, QueueFull, QueueWithError, Role};
pub use crate::zmtp::dialer::DialStage;
use crate::zmtp::dialer::{DialTls, Dialer};

/// One outbound connection's number, unique for the channel's life.
pub(crate) type OutId = u64;

/// Settings of the connecting side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutboundConfig {
    /// Each connection's protocol limits (the control DEALER keeps nothing it reads).
    pub(crate) conn: ConnLimits,
    /// How long a closed connection may go on writing its queued messages.
    pub(crate) linger: Duration,
    /// How soon a connect that could not even start is tried again.
    pub(crate) reconnect_interval: Duration,
    /// How long the other connections to a host that lost one may take to answer a probe
    /// (zero: host liveness off; `control/hosts.rs`).
    pub(crate) host_probe_timeout: Duration,
    /// How long a host taken for down is not dialed.
    pub(crate) host_down_hold: Duration,
}

/// How long a connection closed before its handshake finished may go on trying to deliver
/// what it holds.
const UNREADY_LINGER: Duration = Duration::from_secs(5);

/// Bytes read from one connection per round (a DEALER receives little: heartbeats).
const READ_BUDGET: usize = 1 << 20;

/// A resolver pipe's token is its connection's plus this (sockets stay below it).
const RESOLVER: Token = 1 << 46;

/// Bytes one connection writes per turn: a message larger than this (a lookup's answer of
/// some 1,800 keys and more) is written in turns, and one small enough is written at once when
/// nothing waits before it.
const WRITE_PER_TURN: usize = 64 << 10;

/// Bytes all connections write together per turn of the node's loop beyond what is written at
/// once: the answers a flood of large lookups makes cost each step at most this much of the
/// node's thread (on loopback the kernel's receive path runs in the writer's call too), so an
/// honest peer's answer, written at once, never waits behind them.
const WRITE_PER_ROUND: usize = 256 << 10;

/// Where a connection's transport is.
enum Link {
    /// A host name resolving on a helper thread; `done` (a pipe's read end, registered in the
    /// poll) turns readable when the thread ends.
    Resolving {
        result: mpsc::Receiver<Result<Vec<SocketAddr>, LinkLoss>>,
        done: File,
    },
    /// No socket could be made: try again at `until`.
    Waiting { until: Instant },
    /// The dialer has a socket: connecting or connected.
    Dialing,
    /// Failed; the cause waits to be reported.
    Failed(LinkLoss),
}

struct Conn {
    peer: PeerId,
    addr: Option<SocketAddr>,
    dialer: Dialer,
    link: Link,
    /// Closed by the node: lingers until drained, failed, or this deadline; never reported.
    linger_until: Option<Instant>,
}

/// The outbound connections of one channel.
pub(crate) struct Outbound {
    identity: Vec<u8>,
    config: OutboundConfig,
    /// Socket `id`'s token is `base + id`, its resolver pipe's `base + RESOLVER + id`.
    base: Token,
    conns: BTreeMap<OutId, Conn>,
    by_peer: HashMap<PeerId, OutId>,
    next: OutId,
    /// Connections the poll reported since they were last driven.
    active: BTreeSet<OutId>,
    timers: Timers<OutId>,
    /// Failed connections whose loss is not reported yet (not lingering ones).
    failed: BTreeSet<OutId>,
    /// Where the last turn's writes stopped: the next turn starts after it, so connections
    /// with large messages queued take turns.
    write_cursor: OutId,
    /// Host liveness: probe rounds and hosts taken for down.
    hosts: HostWatch,
    /// Losses the engine's other ranks are to be told of (`control/siblings.rs`).
    announcements: Vec<(IpAddr, HostSign)>,
    /// Connections ended because their probe went unanswered, and dials refused to a host
    /// taken for down, so far.
    probe_losses: u64,
    refused_dials: u64,
    /// TLS toward peers (`None`: plaintext ZMTP).
    tls: Option<crate::control::ControlTls>,
}

impl std::fmt::Debug for Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbound")
            .field("peers", &self.by_peer.len())
            .field("lingering", &(self.conns.len() - self.by_peer.len()))
            .finish()
    }
}

/// Resolves `host` on a helper thread (libzmq's resolution blocked the caller of
/// `zmq_connect`); every address comes back, and [`pick`] chooses among them.
fn resolve(host: &str, port: u16) -> std::io::Result<Link> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (tx, result) = mpsc::channel();
    let host = host.to_owned();
    std::thread::Builder::new()
        .name("kvpeer-resolve".into())
        .spawn(move || {
            let found = (host.as_str(), port)
                .to_socket_addrs()
                .map(Iterator::collect)
                .map_err(|e| LinkLoss::Unresolved {
                    host: host.as_str().into(),
                    detail: e.to_string().into(),
                });
            let _ = tx.send(found);
            // The read end turns readable (end of file) and wakes the poll.
            drop(write);
        })?;
    Ok(Link::Resolving {
        result,
        done: File::from(read),
    })
}

/// The address a resolved name is dialed at: the first IPv4 one, else the first (as libzmq
/// did), among those a peer can have ([`is_peer_ip`]: never `0.0.0.0`, which `connect(2)`
/// reads as this host); else why none. (Which names may be dialed at all is the node's
/// allowlist's, judged before the dial.)
fn pick(peer: &PeerId, found: &[SocketAddr]) -> Result<SocketAddr, LinkLoss> {
    if found.is_empty() {
        return Err(LinkLoss::Unresolved {
            host: peer.as_str().into(),
            detail: "no address".into(),
        });
    }
    let mut refused = Vec::new();
    let ok: Vec<SocketAddr> = found
        .iter()
        .map(|a| SocketAddr::new(a.ip().to_canonical(), a.port()))
        .filter(|a| {
            let ok = is_peer_ip(a.ip());
            if !ok {
                refused.push(format!("{} (no peer's address)", a.ip()));
            }
            ok
        })
        .collect();
    ok.iter()
        .find(|a| a.is_ipv4())
        .or(ok.first())
        .copied()
        .ok_or_else(|| LinkLoss::NotDialable {
            peer: peer.as_str().into(),
            why: format!("it resolves to {}", refused.join(", ")).into(),
        })
}

/// Why `ip`, the address `peer` names, is not dialed.
fn not_dialable(peer: &PeerId, ip: IpAddr) -> LinkLoss {
    LinkLoss::NotDialable {
        peer: peer.as_str().into(),
        why: format!("{ip} is no peer's address").into(),
    }
}

impl Conn {
    /// Starts (or restarts) reaching the peer at `now`, unless its host is taken for down
    /// (`hosts`): then it fails at once.
    fn start(
        &mut self,
        poller: &Poller,
        token: Token,
        now: Instant,
        retry: Duration,
        hosts: &HostWatch,
    ) {
        let Some(addr) = self.addr else {
            // `dial` set `addr` for an address; what is left is a host name (or no address).
            let (host, port) = match PeerAddr::of(&self.peer) {
                Ok(addr) => match addr.host() {
                    Host::Name(name) => (name.to_string(), addr.port()),
                    Host::Ip(ip) => {
                        self.link = Link::Failed(not_dialable(&self.peer, *ip));
                        return;
                    }
                },
                Err(e) => {
                    self.link = Link::Failed(LinkLoss::NotDialable {
                        peer: self.peer.as_str().into(),
                        why: e.to_string().into(),
                    });
                    return;
                }
            };
            self.link = match resolve(&host, port) {
                Ok(link @ Link::Resolving { .. }) => {
                    if let Link::Resolving { done, .. } = &link {
                        if let Err(e) = poller.add_input(done.as_fd(), token + RESOLVER) {
                            warn!(peer = %self.peer, error = %e, "cannot poll a resolver; retrying");
                        }
                    }
                    link
                }
                Ok(other) => other,
                Err(e) => {
                    if let Some(suppressed) =
                        crate::admit_warning("cannot start resolving; retrying")
                    {
                        warn!(peer = %self.peer, error = %e, suppressed, "cannot start resolving; retrying");
                    }
                    Link::Waiting { until: now + retry }
                }
            };
            return;
        };
        let host = addr.ip().to_canonical();
        if hosts.is_down(host, now) {
            // Its host lost a connection a moment ago and nothing on it answered since: a
            // connect would wait out its timeout. Reported lost with the next progress, so the
            // session's requests fall back at once.
            self.link = Link::Failed(LinkLoss::HostDown {
                host,
                hold: hosts.hold(),
            });
            return;
        }
        self.link = match self.dialer.connect(poller, token, addr, now) {
            Ok(()) => Link::Dialing,
            Err(Some(reason)) => Link::Failed(reason),
            Err(None) => Link::Waiting { until: now + retry },
        };
    }

    fn deadline(&self) -> Option<Instant> {
        let link = match &self.link {
            Link::Waiting { until } => Some(*until),
            Link::Dialing => self.dialer.deadline().map(coarse),
            _ => None,
        };
        [link, self.linger_until].into_iter().flatten().min()
    }

    fn failed(&self) -> bool {
        matches!(self.link, Link::Failed(_))
    }

    /// Lost and not yet reported (a lingering connection's end is no loss).
    fn unreported_loss(&self) -> bool {
        self.failed() && self.linger_until.is_none()
    }

    fn fail(&mut self, reason: LinkLoss) {
        debug!(peer = %self.peer, %reason, "control connection failed");
        self.dialer.disconnect();
        self.link = Link::Failed(reason);
    }

    /// Drives it at `now`: a resolver's answer, a retry due, the dialer's socket; whether its
    /// handshake finished (with the peer we named) in this call.
    fn progress(
        &mut self,
        poller: &Poller,
        token: Token,
        now: Instant,
        retry: Duration,
        hosts: &HostWatch,
    ) -> bool {
        match &mut self.link {
            Link::Resolving { result, .. } => match result.try_recv() {
                Ok(Ok(found)) => match pick(&self.peer, &found) {
                    Ok(addr) => {
                        debug!(peer = %self.peer, %addr, "host name resolved");
                        self.addr = Some(addr);
                        self.start(poller, token, now, retry, hosts);
                    }
                    Err(reason) => {
                        self.fail(reason);
                        return false;
                    }
                },
                Ok(Err(reason)) => {
                    self.fail(reason);
                    return false;
                }
                Err(mpsc::TryRecvError::Empty) => return false,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.fail(LinkLoss::Unresolved {
                        host: self.peer.as_str().into(),
                        detail: "the resolver thread ended without an answer".into(),
                    });
                    return false;
                }
            },
            Link::Waiting { until } if now >= *until => {
                self.start(poller, token, now, retry, hosts)
            }
            Link::Waiting { .. } | Link::Failed(_) | Link::Dialing => {}
        }
        if matches!(self.link, Link::Dialing) {
            match self.dialer.progress(now, true) {
                Ok(ready) => {
                    if self.dialer.take_fell_back() {
                        // It greeted without offering TLS: a kvpeer with TLS off or from before it,
                        // or a vLLM engine. `preferred` talks to it in clear.
                        if let Some(suppressed) = crate::admit_warning("control peer speaks no TLS")
                        {
                            warn!(peer = %self.peer, suppressed,
                                "the peer's control port offers no TLS; talking to it in plaintext (tls = preferred)");
                        }
                    }
                    if ready {
                        debug!(peer = %self.peer, "control connection ready");
                        // A kvpeer node tells its identity: answering as another than the one
                        // we named, it can give us no session (its messages come as that one).
                        let announced = self.dialer.connection().peer_announced();
                        if let Some(theirs) =
                            announced.filter(|a| *a != self.peer.as_str().as_bytes())
                        {
                            let calls_itself = String::from_utf8_lossy(theirs);
                            self.fail(LinkLoss::IdentityMismatch {
                                dialed: self.peer.as_str().into(),
                                calls_itself: calls_itself.as_ref().into(),
                            });
                            return false;
                        }
                        return true;
                    }
                }
                Err(reason) => self.fail(reason),
            }
        }
        false
    }

    /// The host it dials, as one value whatever the spelling (IPv4-mapped IPv6 as IPv4).
    fn host(&self) -> Option<IpAddr> {
        self.addr.map(|a| a.ip().to_canonical())
    }

    /// Ready, not closing, not failed: a connection that speaks for its host.
    fn ready(&self) -> bool {
        self.linger_until.is_none() && !self.failed() && self.dialer.is_ready()
    }
}

impl Outbound {
    /// No connections yet; `identity` is what our READY says; sockets are polled as
    /// `base + id`.
    pub(crate) fn new(identity: &PeerId, config: OutboundConfig, base: Token) -> Self {
        Outbound {
            identity: identity.as_str().as_bytes().to_vec(),
            base,
            conns: BTreeMap::new(),
            by_peer: HashMap::new(),
            next: 0,
            active: BTreeSet::new(),
            timers: Timers::default(),
            failed: BTreeSet::new(),
            write_cursor: 0,
            hosts: HostWatch::new(config.host_probe_timeout, config.host_down_hold),
            announcements: Vec::new(),
            probe_losses: 0,
            refused_dials: 0,
            tls: None,
            config,
        }
    }

    /// Whether the ready connection to `peer` runs over TLS (`None`: none is ready).
    pub(crate) fn tls_of(&self, peer: &PeerId) -> Option<bool> {
        let conn = self.conns.get(self.by_peer.get(peer)?)?;
        conn.ready().then(|| conn.dialer.is_tls())
    }

    /// Opens connections over TLS from now on (`None`: plaintext), under `tls`'s policy: a
    /// peer that greets without offering TLS is talked to in clear on that connection
    /// (`preferred`, logged) or lost (`required`).
    pub(crate) fn set_tls(&mut self, tls: Option<crate::control::ControlTls>) {
        self.tls = tls;
    }

    /// How a new connection to a peer starts: over TLS (the configuration current now: a
    /// rotated certificate is used by the next dial), or in clear.
    fn dial_tls(&self) -> Option<DialTls> {
        let tls = self.tls.as_ref()?;
        Some(DialTls {
            config: tls.tls.client(),
            fall_back: tls.policy == crate::tls::TlsPolicy::Preferred,
        })
    }

    /// Whether `token` is one of this side's (`span`: the owner's token space per side).
    pub(crate) fn owns(&self, token: Token, span: u64) -> bool {
        token >= self.base && token - self.base <= span
    }

    /// What the poll said of one of this side's tokens.
    pub(crate) fn on_ready(&mut self, ready: Ready) {
        let offset = ready.token - self.base;
        let id = offset & (RESOLVER - 1);
        if let Some(c) = self.conns.get_mut(&id) {
            if offset < RESOLVER {
                c.dialer.on_ready(ready);
            }
            self.active.insert(id);
        }
    }

    /// Whether a connection to `peer` is open (connecting, connected, or failed and not yet
    /// reported).
    pub(crate) fn connected(&self, peer: &PeerId) -> bool {
        self.by_peer.contains_key(peer)
    }

    /// How far the connection to `peer` got (`None`: there is none).
    pub(crate) fn stage(&self, peer: &PeerId) -> Option<DialStage> {
        let conn = self.conns.get(self.by_peer.get(peer)?)?;
        match &conn.link {
            Link::Resolving { .. } | Link::Waiting { .. } => Some(DialStage::Connecting),
            Link::Dialing => conn.dialer.stage(),
            Link::Failed(_) => None,
        }
    }

    /// Whether the connection to `peer` finished its handshake, and the challenge the peer's
    /// READY gave: `None` while there is no ready connection.
    pub(crate) fn ready_challenge(&self, peer: &PeerId) -> Option<Option<&[u8]>> {
        let conn = self.conns.get(self.by_peer.get(peer)?)?;
        conn.dialer
            .is_ready()
            .then(|| conn.dialer.connection().peer_challenge())
    }

    /// Whether the connection to `peer` is ready and its socket has not ended: a peek at it
    /// (a peer's end of stream waits unread until the next round reads it).
    pub(crate) fn ready_and_open(&self, peer: &PeerId) -> bool {
        self.by_peer
            .get(peer)
            .and_then(|id| self.conns.get(id))
            .is_some_and(|c| c.dialer.ready_and_open())
    }

    /// Connections, lingering ones included.
    pub(crate) fn connections(&self) -> usize {
        self.conns.len()
    }

    /// How long closed connections may linger.
    pub(crate) fn linger(&self) -> Duration {
        self.config.linger
    }

    /// Opens a connection to `peer` (`host:port`) at `now`, unless one is open; its id.
    pub(crate) fn dial(&mut self, poller: &Poller, peer: &PeerId, now: Instant) -> OutId {
        if let Some(id) = self.by_peer.get(peer) {
            return *id;
        }
        // Read once as an address, whatever its spelling: `0:P` or `2130706433:P` is
        // connected to as the address it is (or refused), never handed to a resolver.
        let addr = PeerAddr::of(peer)
            .ok()
            .and_then(|a| a.socket_addr())
            .filter(|a| is_peer_ip(a.ip()));
        let conn = Connection::new(
            Role::control_dealer(&self.identity),
            self.config.conn.clone(),
        );
        let mut conn = Conn {
            peer: peer.clone(),
            addr,
            dialer: {
                let mut dialer = Dialer::new(conn, None, READ_BUDGET);
                dialer.set_write_limit(WRITE_PER_TURN);
                dialer.set_tls(self.dial_tls());
                dialer
            },
            link: Link::Waiting { until: now },
            linger_until: None,
        };
        self.next += 1;
        let id = self.next;
        conn.start(
            poller,
            self.base + id,
            now,
            self.config.reconnect_interval,
            &self.hosts,
        );
        debug!(%peer, "control connection opened");
        self.conns.insert(id, conn);
        self.by_peer.insert(peer.clone(), id);
        // Its first step (a connect that finished at once, a failure) comes with the next
        // progress.
        self.active.insert(id);
        self.settle(id);
        id
    }

    /// Queues one message to `peer`, dialling first if needed, and writes it at once when the
    /// connection is idle.
    pub(crate) fn send(
        &mut self,
        poller: &Poller,
        peer: &PeerId,
        payload: &[u8],
        now: Instant,
    ) -> Result<(), QueueFull> {
        let id = self.dial(poller, peer, now);
        let Some(conn) = self.conns.get_mut(&id) else {
            // `dial` just gave this id: never the case.
            return Ok(());
        };
        conn.dialer.send(&[payload])?;
        if conn.dialer.wants_write() {
            // Too large to write at once, or behind what waits: written in turns.
            self.active.insert(id);
        }
        Ok(())
    }

    /// As [`Outbound::send`], for one frame whose body `write_body` appends straight into the
    /// connection's queue.
    pub(crate) fn send_with<E>(
        &mut self,
        poller: &Poller,
        peer: &PeerId,
        body_hint: usize,
        write_body: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
        now: Instant,
    ) -> Result<(), QueueWithError<E>> {
        let id = self.dial(poller, peer, now);
        let Some(conn) = self.conns.get_mut(&id) else {
            // `dial` just gave this id: never the case.
            return Ok(());
        };
        conn.dialer.send_with(body_hint, write_body)?;
        if conn.dialer.wants_write() {
            // Too large to write at once, or behind what waits: written in turns.
            self.active.insert(id);
        }
        Ok(())
    }

    /// Closes the connection to `peer` at `now`; its queued messages linger (no report).
    pub(crate) fn close(&mut self, peer: &PeerId, now: Instant) {
        let Some(id) = self.by_peer.remove(peer) else {
            return;
        };
        let Some(conn) = self.conns.get_mut(&id) else {
            return;
        };
        debug!(%peer, "control connection closed");
        if conn.failed() || conn.dialer.is_drained() || self.config.linger.is_zero() {
            self.drop_conn(id);
        } else {
            // A connection still connecting or in its handshake has written nothing yet: what
            // it holds (a refusal's `disconnect`, sent on a connection just dialed) gets the
            // time a handshake takes, not only the linger a written queue needs.
            let linger = if conn.dialer.is_ready() {
                self.config.linger
            } else {
                self.config.linger.max(UNREADY_LINGER)
            };
            conn.linger_until = Some(now + linger);
            self.settle(id);
        }
    }

    /// Closes every connection at `now` (their messages linger).
    pub(crate) fn close_all(&mut self, now: Instant) {
        let peers: Vec<PeerId> = self.by_peer.keys().cloned().collect();
        for peer in &peers {
            self.close(peer, now);
        }
    }

    fn drop_conn(&mut self, id: OutId) {
        if let Some(mut c) = self.conns.remove(&id) {
            c.dialer.disconnect();
        }
        self.active.remove(&id);
        self.failed.remove(&id);
        self.timers.set(id, None);
    }

    /// After connection `id` was driven: its deadline, whether its loss waits to be reported,
    /// whether a lingering one is done.
    fn settle(&mut self, id: OutId) {
        let Some(c) = self.conns.get(&id) else {
            return;
        };
        if c.unreported_loss() {
            self.failed.insert(id);
        }
        self.timers.set(id, c.deadline());
    }

    /// When the next deadline falls due (heartbeats, handshakes, retries, lingers); now while
    /// a connection has news not yet handled or a loss waits to be reported.
    pub(crate) fn next_deadline(&mut self, now: Instant) -> Option<Instant> {
        if !self.failed.is_empty() || !self.active.is_empty() {
            return Some(now);
        }
        self.timers.next()
    }

    /// The peers whose lost connections wait to be reported.
    pub(crate) fn lost_peers(&self) -> Vec<PeerId> {
        self.failed
            .iter()
            .filter_map(|id| self.conns.get(id))
            .map(|c| c.peer.clone())
            .collect()
    }

    /// Drives the connections the poll reported and those whose deadline is due at `now`;
    /// lingering connections that are done are dropped.
    pub(crate) fn progress(&mut self, poller: &Poller, now: Instant) {
        let retry = self.config.reconnect_interval;
        let mut visit = std::mem::take(&mut self.active);
        let mut due = Vec::new();
        self.timers.take_due(now, &mut due);
        visit.extend(due);
        // Connections after the last turn's cursor first, so the round's write budget goes
        // to each connection with bytes waiting in turn.
        let cursor = self.write_cursor;
        let order: Vec<OutId> = visit
            .range(cursor + 1..)
            .chain(visit.range(..=cursor))
            .copied()
            .collect();
        let mut budget = WRITE_PER_ROUND;
        for id in order {
            let token = self.base + id;
            let Some(c) = self.conns.get_mut(&id) else {
                continue;
            };
            // What `send` wrote at once is not this turn's.
            c.dialer.take_written();
            c.dialer.set_write_limit(WRITE_PER_TURN.min(budget));
            if c.progress(poller, token, now, retry, &self.hosts) {
                if let Some(host) = c.host() {
                    // A handshake just finished: the host is up.
                    self.hosts.on_ready(host);
                }
            }
            let wrote = c.dialer.take_written();
            c.dialer.set_write_limit(WRITE_PER_TURN);
            if wrote > 0 {
                budget = budget.saturating_sub(wrote);
                self.write_cursor = id;
            }
            if c.dialer.wants_write() {
                // Bytes left for its next turn, which comes at once.
                self.active.insert(id);
            }
            let done = c
                .linger_until
                .is_some_and(|until| c.failed() || c.dialer.is_drained() || now >= until);
            if done {
                self.drop_conn(id);
            } else {
                self.settle(id);
            }
        }
    }

    /// The lost connections not yet reported, each once, dropped (peer, cause); each loss
    /// that says something of its host probes the host's other connections at `now`
    /// (`control/hosts.rs`).
    pub(crate) fn take_losses(&mut self, now: Instant) -> Vec<(PeerId, LinkLoss)> {
        let ids = std::mem::take(&mut self.failed);
        let mut lost = Vec::with_capacity(ids.len());
        for id in ids {
            let Some(c) = self.conns.remove(&id) else {
                continue;
            };
            self.active.remove(&id);
            self.timers.set(id, None);
            if self.by_peer.get(&c.peer) == Some(&id) {
                self.by_peer.remove(&c.peer);
            }
            let host = c.host().filter(|_| self.hosts.enabled());
            let host_answered = c.dialer.host_answered_at_failure();
            if let Link::Failed(reason) = c.link {
                if matches!(reason, LinkLoss::HostDown { .. }) {
                    self.refused_dials += 1;
                }
                if let Some(host) = host {
                    let probed = matches!(reason, LinkLoss::ProbeUnanswered(_));
                    if probed {
                        self.probe_losses += 1;
                    }
                    let mut sign = reason.host_sign();
                    // A heartbeat unanswered while the host's kernel still sent us segments
                    // after its PING left: the process is silent, the host is up.
                    if matches!(reason, LinkLoss::Silent(_)) && host_answered {
                        sign = HostSign::ProcessGone;
                    }
                    self.doubt_host(host, sign, now, Some((probed, &c.peer)));
                }
                lost.push((c.peer, reason));
            }
        }
        lost
    }

    /// Another rank of this engine lost a connection to `host` with `sign`, at `now`.
    pub(crate) fn on_announcement(&mut self, host: IpAddr, sign: HostSign, now: Instant) {
        if self.hosts.enabled() {
            self.doubt_host(host, sign, now, None);
        }
    }

    /// The losses to tell the engine's other ranks of, since the last call.
    pub(crate) fn take_announcements(&mut self) -> Vec<(IpAddr, HostSign)> {
        std::mem::take(&mut self.announcements)
    }

    /// Probe rounds started, connections ended by an unanswered probe, and dials refused to a
    /// host taken for down.
    pub(crate) fn host_liveness_counts(&self) -> (u64, u64, u64) {
        (
            self.hosts.rounds_started(),
            self.probe_losses,
            self.refused_dials,
        )
    }

    /// Hosts taken for down at `now`.
    pub(crate) fn hosts_down(&self, now: Instant) -> usize {
        self.hosts.hosts_down(now)
    }

    /// Applies the host rules to a loss of `host`: seen here (`Some((probed, peer))`: the
    /// connection to `peer` lost to a round's probe, or not), or announced by another rank
    /// (`None`).
    fn doubt_host(
        &mut self,
        host: IpAddr,
        sign: HostSign,
        now: Instant,
        here: Option<(bool, &PeerId)>,
    ) {
        let ready: Vec<OutId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.host() == Some(host) && c.ready())
            .map(|(id, _)| *id)
            .collect();
        let ours = here.is_some();
        let lost = here.map(|(_, peer)| peer);
        let doubt = match here {
            Some((probed, _)) => self.hosts.on_loss(host, sign, now, ready.len(), probed),
            None => self.hosts.on_announcement(host, sign, now, ready.len()),
        };
        if doubt.probe {
            let timeout = self.hosts.probe_timeout();
            for id in &ready {
                if let Some(c) = self.conns.get_mut(id) {
                    c.dialer.probe(now, timeout);
                    if c.dialer.wants_write() {
                        self.active.insert(*id);
                    }
                }
                self.settle(*id);
            }
            // A peer's process can end its connections at will: throttled as any line a peer
            // can cause (docs/security.md, G8).
            if let Some(suppressed) = crate::admit_warning("host probe round") {
                info!(%host, lost = ?lost, probed = ready.len(), timeout_ms = timeout.as_millis() as u64,
                    announced = !ours, suppressed, "a connection to this host was lost; probing its others");
            }
        }
        if doubt.down {
            if let Some(suppressed) = crate::admit_warning("host taken for down") {
                warn!(%host, lost = ?lost, hold_ms = self.hosts.hold().as_millis() as u64,
                    announced = !ours, suppressed,
                    "host taken for down: nothing on it answered; new connections to it fail at once until the hold ends");
            }
        }
        if doubt.announce {
            self.announcements.push((host, sign));
        }
    }
}
