//! The control channel's connecting side: one ZMTP DEALER connection per peer, driven by the
//! node's own thread (no libzmq, no I/O thread).
//!
//! Each connection is a non-blocking `TcpStream` and a [`Dealer`] (the protocol, sans-IO).
//! The observable behaviour is libzmq's DEALER with the socket monitor the channel used to
//! keep, because the core and every test rely on it:
//!
//! * [`Outbound::dial`] never blocks: an IP address is connected to at once (non-blocking
//!   `connect`), a host name is resolved on a short-lived helper thread whose pipe wakes the
//!   poll. Messages queue from the start and leave once the handshake is done.
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
//! Readiness comes from the channel's single `ppoll(2)` ([`Outbound::poll_fds`]); deadlines
//! (heartbeats, handshakes, retries, lingers) from [`Outbound::next_deadline`].

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvpeer_core::LinkLoss;
use kvpeer_proto::PeerId;
use nix::poll::PollFlags;
use tracing::{debug, warn};

use crate::control::dealer::{Dealer, DealerError, DealerLimits, QueueFull};
use crate::io::sockio;
use crate::zmtp::ZmtpError;

/// How far an outbound connection got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialStage {
    /// Resolving the name or waiting for TCP's connect.
    Connecting,
    /// TCP is up; the ZMTP greeting and READY are not done.
    Handshaking,
    /// ZMTP is up: messages flow.
    Ready,
}

/// One outbound connection's number, unique for the channel's life.
pub(crate) type OutId = u64;

/// Settings of the connecting side.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OutboundConfig {
    /// Each connection's protocol limits.
    pub(crate) dealer: DealerLimits,
    /// How long a closed connection may go on writing its queued messages.
    pub(crate) linger: Duration,
    /// How soon a connect that could not even start is tried again.
    pub(crate) reconnect_interval: Duration,
}

/// How long a connection closed before its handshake finished may go on trying to deliver
/// what it holds.
const UNREADY_LINGER: Duration = Duration::from_secs(5);

/// Bytes read from one connection per round (a DEALER receives little: heartbeats).
const READ_BUDGET: usize = 1 << 20;

/// Where a connection's transport is.
enum Link {
    /// A host name resolving on a helper thread; `done` (a pipe's read end) turns readable when
    /// the thread ends.
    Resolving {
        result: mpsc::Receiver<Result<SocketAddr, LinkLoss>>,
        done: File,
    },
    /// No socket could be made: try again at `until`.
    Waiting { until: Instant },
    /// TCP connect in progress.
    Connecting(TcpStream),
    /// Connected: ZMTP flows.
    Open(TcpStream),
    /// Failed; the cause waits to be reported.
    Failed(LinkLoss),
}

struct Conn {
    peer: PeerId,
    addr: Option<SocketAddr>,
    dealer: Dealer,
    link: Link,
    /// Closed by the node: lingers until drained, failed, or this deadline; never reported.
    linger_until: Option<Instant>,
}

/// The outbound connections of one channel.
pub(crate) struct Outbound {
    identity: Vec<u8>,
    config: OutboundConfig,
    conns: BTreeMap<OutId, Conn>,
    by_peer: HashMap<PeerId, OutId>,
    next: OutId,
}

impl std::fmt::Debug for Outbound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Outbound")
            .field("peers", &self.by_peer.len())
            .field("lingering", &(self.conns.len() - self.by_peer.len()))
            .finish()
    }
}

/// `host` as an IP address, IPv6 brackets removed; `None` for a host name.
fn ip_literal(host: &str) -> Option<IpAddr> {
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
        .parse()
        .ok()
}

/// Resolves `host` on a helper thread (libzmq's resolution blocked the caller of
/// `zmq_connect`); the first IPv4 address is taken, else the first, as libzmq does.
fn resolve(host: &str, port: u16) -> std::io::Result<Link> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let (tx, result) = mpsc::channel();
    let host = host.to_owned();
    let unresolved = |host: &str, detail: String| LinkLoss::Unresolved {
        host: host.into(),
        detail: detail.into(),
    };
    std::thread::Builder::new()
        .name("kvpeer-resolve".into())
        .spawn(move || {
            let found = (host.as_str(), port)
                .to_socket_addrs()
                .map_err(|e| unresolved(&host, e.to_string()))
                .and_then(|addrs| {
                    let addrs: Vec<SocketAddr> = addrs.collect();
                    addrs
                        .iter()
                        .find(|a| a.is_ipv4())
                        .or(addrs.first())
                        .copied()
                        .ok_or_else(|| unresolved(&host, "no address".into()))
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

/// Starts a non-blocking connect to `addr`: `Ok(link)` (connecting, or connected already),
/// `Err(Some(cause))` when the connect failed (a lost connection), `Err(None)` when no socket
/// could be made (try again later).
fn connect(addr: SocketAddr) -> Result<Link, Option<LinkLoss>> {
    sockio::start_connect(addr).map(Link::Connecting)
}

impl Conn {
    /// Starts (or restarts) reaching the peer at `now`.
    fn start(&mut self, now: Instant, retry: Duration) {
        let Some(addr) = self.addr else {
            let (host, port) = match self.peer.host_port() {
                Ok(hp) => hp,
                Err(e) => {
                    self.link = Link::Failed(LinkLoss::DialFailed(e.to_string().into()));
                    return;
                }
            };
            self.link = resolve(host, port).unwrap_or_else(|e| {
                if let Some(suppressed) = crate::admit_warning("cannot start resolving; retrying") {
                    warn!(peer = %self.peer, error = %e, suppressed, "cannot start resolving; retrying");
                }
                Link::Waiting { until: now + retry }
            });
            return;
        };
        self.link = match connect(addr) {
            Ok(link) => link,
            Err(Some(reason)) => Link::Failed(reason),
            Err(None) => Link::Waiting { until: now + retry },
        };
    }

    /// What to poll this connection for.
    fn poll_fd(&self) -> Option<(BorrowedFd<'_>, PollFlags)> {
        match &self.link {
            Link::Resolving { done, .. } => Some((done.as_fd(), PollFlags::POLLIN)),
            Link::Connecting(s) => Some((s.as_fd(), PollFlags::POLLOUT)),
            Link::Open(s) if self.dealer.transmit().is_empty() => {
                Some((s.as_fd(), PollFlags::POLLIN))
            }
            Link::Open(s) => Some((s.as_fd(), PollFlags::POLLIN | PollFlags::POLLOUT)),
            Link::Waiting { .. } | Link::Failed(_) => None,
        }
    }

    fn deadline(&self) -> Option<Instant> {
        let link = match &self.link {
            Link::Waiting { until } => Some(*until),
            Link::Open(_) => self.dealer.poll_timeout(),
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
        self.link = Link::Failed(reason);
    }

    /// Handles readiness (or a look without any) at `now`.
    fn progress(&mut self, now: Instant, retry: Duration) {
        match &mut self.link {
            Link::Resolving { result, .. } => match result.try_recv() {
                Ok(Ok(addr)) => {
                    self.addr = Some(addr);
                    self.start(now, retry);
                }
                Ok(Err(reason)) => self.fail(reason),
                Err(mpsc::TryRecvError::Empty) => return,
                Err(mpsc::TryRecvError::Disconnected) => self.fail(LinkLoss::Unresolved {
                    host: self.peer.as_str().into(),
                    detail: "the resolver thread ended without an answer".into(),
                }),
            },
            Link::Connecting(stream) => {
                let Some(addr) = self.addr else {
                    return self.fail(LinkLoss::DialFailed("no address".into()));
                };
                match sockio::connect_done(stream, addr) {
                    Err(reason) => return self.fail(reason),
                    Ok(false) => return,
                    Ok(true) => {
                        let Link::Connecting(stream) =
                            std::mem::replace(&mut self.link, Link::Waiting { until: now })
                        else {
                            return;
                        };
                        self.link = Link::Open(stream);
                        self.dealer.connected(now);
                        debug!(peer = %self.peer, "control connection connected");
                    }
                }
            }
            Link::Open(_) => {
                if let Err(reason) = self.read(now) {
                    return self.fail(reason);
                }
            }
            Link::Waiting { .. } | Link::Failed(_) => return,
        }
        self.flush();
    }

    fn read(&mut self, now: Instant) -> Result<(), LinkLoss> {
        let Link::Open(stream) = &mut self.link else {
            return Ok(());
        };
        let dealer = &mut self.dealer;
        sockio::read_available(stream, READ_BUDGET, |bytes| {
            dealer.handle_bytes(bytes, now).map_err(LinkLoss::from)
        })
    }

    /// Writes what the dealer has for the socket, until the socket would block.
    fn flush(&mut self) {
        let Link::Open(stream) = &mut self.link else {
            return;
        };
        if let Err(reason) = sockio::write_available(stream, &mut self.dealer) {
            self.fail(reason);
        }
    }

    /// Runs the deadlines due at `now`.
    fn timeouts(&mut self, now: Instant, retry: Duration) {
        match &self.link {
            Link::Waiting { until } if now >= *until => {
                self.start(now, retry);
                self.progress(now, retry);
            }
            Link::Open(_) => {
                let before = self.dealer.transmit().len();
                if let Err(e) = self.dealer.handle_timeout(now) {
                    return self.fail(LinkLoss::from(e));
                }
                if before == 0 && !self.dealer.transmit().is_empty() {
                    // A PING to send; bytes already waiting are written when POLLOUT says so.
                    self.flush();
                }
            }
            _ => {}
        }
    }
}

impl From<DealerError> for LinkLoss {
    fn from(e: DealerError) -> Self {
        match e {
            DealerError::HandshakeTimeout(d) => LinkLoss::HandshakeTimeout(d),
            DealerError::HeartbeatTimeout(d) | DealerError::TtlExpired(d) => LinkLoss::Silent(d),
            // What the greeting or READY says: not a control port.
            e @ (DealerError::Zmtp(
                ZmtpError::Signature(_) | ZmtpError::Version(_) | ZmtpError::Mechanism(_),
            )
            | DealerError::SocketType(_)) => LinkLoss::NotZmtp(e.to_string().into()),
            DealerError::Zmtp(e) => LinkLoss::Zmtp(e.to_string().into()),
        }
    }
}

impl Outbound {
    /// No connections yet; `identity` is what our READY says.
    pub(crate) fn new(identity: &PeerId, config: OutboundConfig) -> Self {
        Outbound {
            identity: identity.as_str().as_bytes().to_vec(),
            config,
            conns: BTreeMap::new(),
            by_peer: HashMap::new(),
            next: 0,
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
        Some(match &conn.link {
            Link::Resolving { .. } | Link::Waiting { .. } | Link::Connecting(_) => {
                DialStage::Connecting
            }
            Link::Open(_) if conn.dealer.is_ready() => DialStage::Ready,
            Link::Open(_) => DialStage::Handshaking,
            Link::Failed(_) => return None,
        })
    }

    /// Whether the connection to `peer` finished its handshake, and the challenge the peer's
    /// READY gave: `None` while there is no ready connection.
    pub(crate) fn ready_challenge(&self, peer: &PeerId) -> Option<Option<&[u8]>> {
        let conn = self.conns.get(self.by_peer.get(peer)?)?;
        conn.dealer.is_ready().then(|| conn.dealer.peer_challenge())
    }

    /// Whether the connection to `peer` is ready and its socket has not ended: a peek at it
    /// (a peer's end of stream waits unread until the next round reads it).
    pub(crate) fn ready_and_open(&self, peer: &PeerId) -> bool {
        let Some(conn) = self.by_peer.get(peer).and_then(|id| self.conns.get(id)) else {
            return false;
        };
        let Link::Open(stream) = &conn.link else {
            return false;
        };
        if !conn.dealer.is_ready() {
            return false;
        }
        // Non-blocking: bytes waiting or none yet means open; 0 is the peer's end of stream.
        match stream.peek(&mut [0u8; 1]) {
            Ok(n) => n > 0,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        }
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
    pub(crate) fn dial(&mut self, peer: &PeerId, now: Instant) -> OutId {
        if let Some(id) = self.by_peer.get(peer) {
            return *id;
        }
        let addr = peer
            .host_port()
            .ok()
            .and_then(|(host, port)| Some(SocketAddr::new(ip_literal(host)?, port)));
        let mut conn = Conn {
            peer: peer.clone(),
            addr,
            dealer: Dealer::new(&self.identity, self.config.dealer.clone()),
            link: Link::Waiting { until: now },
            linger_until: None,
        };
        conn.start(now, self.config.reconnect_interval);
        debug!(%peer, "control connection opened");
        self.next += 1;
        self.conns.insert(self.next, conn);
        self.by_peer.insert(peer.clone(), self.next);
        self.next
    }

    /// Queues one message to `peer`, dialling first if needed, and writes it at once when the
    /// connection is idle.
    pub(crate) fn send(
        &mut self,
        peer: &PeerId,
        payload: &[u8],
        now: Instant,
    ) -> Result<(), QueueFull> {
        let id = self.dial(peer, now);
        let Some(conn) = self.conns.get_mut(&id) else {
            // `dial` just gave this id: never the case.
            return Ok(());
        };
        let idle = conn.dealer.transmit().is_empty();
        conn.dealer.queue(payload)?;
        if idle {
            conn.flush();
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
        if conn.failed() || conn.dealer.is_drained() || self.config.linger.is_zero() {
            self.conns.remove(&id);
        } else {
            // A connection still connecting or in its handshake has written nothing yet: what
            // it holds (a refusal's `disconnect`, sent on a connection just dialed) gets the
            // time a handshake takes, not only the linger a written queue needs.
            let linger = if conn.dealer.is_ready() {
                self.config.linger
            } else {
                self.config.linger.max(UNREADY_LINGER)
            };
            conn.linger_until = Some(now + linger);
        }
    }

    /// What to poll: each connection's descriptor and events, with its id.
    pub(crate) fn poll_fds(&self) -> impl Iterator<Item = (OutId, BorrowedFd<'_>, PollFlags)> + '_ {
        self.conns
            .iter()
            .filter_map(|(id, c)| c.poll_fd().map(|(fd, flags)| (*id, fd, flags)))
    }

    /// When the next deadline falls due (heartbeats, handshakes, retries, lingers).
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.conns.values().filter_map(Conn::deadline).min()
    }

    /// Whether a lost connection waits to be reported (the caller must not sleep).
    pub(crate) fn has_losses(&self) -> bool {
        self.conns.values().any(Conn::unreported_loss)
    }

    /// The peers whose lost connections wait to be reported.
    pub(crate) fn lost_peers(&self) -> Vec<PeerId> {
        self.conns
            .values()
            .filter(|c| c.unreported_loss())
            .map(|c| c.peer.clone())
            .collect()
    }

    /// Handles the connections `ready` names (every one for `None`), then every deadline due
    /// at `now`; lingering connections that are done are dropped.
    pub(crate) fn progress(&mut self, now: Instant, ready: Option<&[OutId]>) {
        let retry = self.config.reconnect_interval;
        match ready {
            Some(ids) => {
                for id in ids {
                    if let Some(c) = self.conns.get_mut(id) {
                        c.progress(now, retry);
                    }
                }
            }
            None => self.conns.values_mut().for_each(|c| c.progress(now, retry)),
        }
        for c in self.conns.values_mut() {
            c.timeouts(now, retry);
        }
        self.conns.retain(|_, c| match c.linger_until {
            None => true,
            Some(until) => !(c.failed() || c.dealer.is_drained() || now >= until),
        });
    }

    /// The lost connections not yet reported, each once, dropped (peer, cause).
    pub(crate) fn take_losses(&mut self) -> Vec<(PeerId, LinkLoss)> {
        let ids: Vec<OutId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.unreported_loss())
            .map(|(id, _)| *id)
            .collect();
        let mut lost = Vec::with_capacity(ids.len());
        for id in ids {
            let Some(c) = self.conns.remove(&id) else {
                continue;
            };
            if self.by_peer.get(&c.peer) == Some(&id) {
                self.by_peer.remove(&c.peer);
            }
            if let Link::Failed(reason) = c.link {
                lost.push((c.peer, reason));
            }
        }
        lost
    }

    /// Closes every connection and gives their queued messages up to `linger` to leave,
    /// blocking (the channel is going away).
    fn linger_all(&mut self) {
        let start = Instant::now();
        let peers: Vec<PeerId> = self.by_peer.keys().cloned().collect();
        for peer in &peers {
            self.close(peer, start);
        }
        let deadline = start + self.config.linger;
        while !self.conns.is_empty() {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            let wait = self
                .next_deadline()
                .unwrap_or(deadline)
                .min(deadline)
                .saturating_duration_since(now);
            let mut fds: Vec<nix::poll::PollFd<'_>> = self
                .poll_fds()
                .map(|(_, fd, flags)| nix::poll::PollFd::new(fd, flags))
                .collect();
            let _ = crate::control::sleep_on(&mut fds, wait);
            drop(fds);
            self.progress(Instant::now(), None);
        }
        if !self.conns.is_empty() {
            debug!(
                connections = self.conns.len(),
                "control messages still unsent when the channel closed"
            );
        }
    }
}

impl Drop for Outbound {
    fn drop(&mut self) {
        self.linger_all();
    }
}
