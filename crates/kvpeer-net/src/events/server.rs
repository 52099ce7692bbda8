//! One listening socket of the KV event stream (the pool's PUB, its replay ROUTER, or a SUB
//! that binds for an engine whose PUB connects) and its accepted connections, each a
//! [`Connection`] in the listener's [`Role`].
//!
//! Bounds against hostile peers: connections are capped in all and per source address; one
//! over evicts the holder that is worth least (`admission.rs`: of its own source, or of the
//! heaviest source when the listener is full, a connection that never subscribed or asked
//! before one that did, then the idlest), so one process cannot lock the others of its host
//! out; each
//! connection's input is decoded under its `max_message_bytes` (a 1 TiB frame header ends that
//! connection before a byte is kept) and its output queue is bounded by its [`ConnLimits`]; a
//! connection that does not finish its handshake, answers no heartbeat, or takes none of our
//! bytes for `stall_timeout` while some wait is closed. After a failed `accept` (out of
//! descriptors) the listener rests [`ACCEPT_BACKOFF`] instead of spinning the loop.
//!
//! Owned by the thread that drives its publisher or subscriber; every socket is non-blocking
//! and polled with the caller's others ([`Server::poll_fds`]), so nothing here blocks.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use tracing::{debug, warn};

use super::client::{LinkEvent, READ_BUDGET};
use crate::admission::{self, Caps, Holder};
use crate::connection::{ConnLimits, Connection, Incoming, QueueFull, Role};
use crate::sockio::{self, Accepted};

/// How long the listener rests after `accept` fails before it is polled again.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// One accepted connection's number, unique for the listener's life.
pub(crate) type PeerId = u64;

/// Bounds of one listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServerLimits {
    /// Each connection's protocol limits.
    pub(crate) conn: ConnLimits,
    /// Connections at once.
    pub(crate) max_connections: usize,
    /// Connections at once from one source address.
    pub(crate) max_per_source: usize,
    /// How long bytes may wait unwritten with none taken before the connection is closed.
    pub(crate) stall_timeout: Duration,
}

struct Peer {
    stream: TcpStream,
    source: IpAddr,
    conn: Connection,
    /// When the socket last took bytes, or had none to take.
    last_written: Instant,
    /// When the peer last subscribed, asked, or took bytes of ours (accepted, if never).
    last_active: Instant,
    /// Whether it ever subscribed or sent a request: a client at work, evicted after idle ones.
    engaged: bool,
}

/// A listener and its connections.
pub(crate) struct Server {
    listener: TcpListener,
    role: Role,
    limits: ServerLimits,
    peers: BTreeMap<PeerId, Peer>,
    next: PeerId,
    accept_paused_until: Option<Instant>,
    refused: u64,
    evicted: u64,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.listener.local_addr().ok())
            .field("role", &self.role.socket_type)
            .field("connections", &self.peers.len())
            .finish()
    }
}

impl Server {
    /// Listens at `addr` (port 0 picks one).
    pub(crate) fn bind(
        addr: SocketAddr,
        role: Role,
        limits: ServerLimits,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        Ok(Server {
            listener,
            role,
            limits,
            peers: BTreeMap::new(),
            next: 0,
            accept_paused_until: None,
            refused: 0,
            evicted: 0,
        })
    }

    /// The address bound.
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Connections open now.
    pub(crate) fn connections(&self) -> usize {
        self.peers.len()
    }

    /// Connections refused over the caps (only when no slot can be had: caps of zero).
    pub(crate) fn refused(&self) -> u64 {
        self.refused
    }

    /// Connections closed to make room for a newcomer.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// The connections' numbers, in [`Server::poll_fds`] order.
    pub(crate) fn ids(&self) -> impl Iterator<Item = PeerId> + '_ {
        self.peers.keys().copied()
    }

    /// Connection `id`'s protocol state.
    pub(crate) fn connection(&self, id: PeerId) -> Option<&Connection> {
        self.peers.get(&id).map(|p| &p.conn)
    }

    /// Descriptors to poll, appended to `fds`: the listener (asked for nothing while it rests),
    /// then each connection (input only when `read`), [`Server::fd_count`] in all.
    pub(crate) fn poll_fds<'a>(&'a self, now: Instant, read: bool, fds: &mut Vec<PollFd<'a>>) {
        let listening = self.accept_paused_until.is_none_or(|until| now >= until);
        let flags = if listening {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        fds.push(PollFd::new(self.listener.as_fd(), flags));
        for p in self.peers.values() {
            let mut flags = if read {
                PollFlags::POLLIN
            } else {
                PollFlags::empty()
            };
            if !p.conn.transmit().is_empty() {
                flags |= PollFlags::POLLOUT;
            }
            fds.push(PollFd::new(p.stream.as_fd(), flags));
        }
    }

    /// How many descriptors [`Server::poll_fds`] appends.
    pub(crate) fn fd_count(&self) -> usize {
        1 + self.peers.len()
    }

    /// When [`Server::progress`] has something to do without readiness.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        let stall = self.limits.stall_timeout;
        self.peers
            .values()
            .filter_map(|p| {
                let stalled = (!p.conn.transmit().is_empty()).then_some(p.last_written + stall);
                [p.conn.poll_timeout(), stalled].into_iter().flatten().min()
            })
            .chain(self.accept_paused_until)
            .min()
    }

    /// Queues a message to connection `id` at `now` (not written yet: [`Server::flush`]).
    pub(crate) fn queue(
        &mut self,
        now: Instant,
        id: PeerId,
        parts: &[&[u8]],
    ) -> Result<(), QueueFull> {
        match self.peers.get_mut(&id) {
            Some(p) if p.conn.is_ready() => {
                if p.conn.transmit().is_empty() {
                    // The stall clock starts when bytes start waiting.
                    p.last_written = now;
                }
                p.conn.queue(parts)
            }
            _ => Err(QueueFull),
        }
    }

    /// Writes what connection `id` has queued until its socket would block; a connection
    /// that fails is closed and reported in `out`.
    pub(crate) fn flush(&mut self, now: Instant, id: PeerId, out: &mut Vec<(PeerId, LinkEvent)>) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        match sockio::write_available(&mut p.stream, &mut p.conn) {
            Ok(wrote) => {
                if wrote {
                    p.last_active = now;
                }
                if wrote || p.conn.transmit().is_empty() {
                    p.last_written = now;
                }
            }
            Err(reason) => self.close(id, reason, out),
        }
    }

    /// Closes connection `id`, reporting it in `out`.
    pub(crate) fn close(&mut self, id: PeerId, reason: String, out: &mut Vec<(PeerId, LinkEvent)>) {
        let Some(p) = self.peers.remove(&id) else {
            return;
        };
        let _ = p.stream.shutdown(std::net::Shutdown::Both);
        debug!(id, source = %p.source, role = self.role.socket_type, %reason,
            "event stream connection ended");
        out.push((
            id,
            LinkEvent::Lost {
                reason,
                was_ready: p.conn.is_ready(),
            },
        ));
    }

    /// Accepts what waits, reads the connections the poll reported (`revents`, in
    /// [`Server::poll_fds`] order; empty: none) when `read`, runs every deadline due at `now`
    /// and writes what is queued. What happened goes to `out`.
    pub(crate) fn progress(
        &mut self,
        now: Instant,
        revents: &[PollFlags],
        read: bool,
        out: &mut Vec<(PeerId, LinkEvent)>,
    ) {
        let ids: Vec<PeerId> = self.peers.keys().copied().collect();
        if self.accept_paused_until.is_some_and(|until| now >= until) {
            // Rested: the listener is polled again from the next wait (its deadline is gone).
            self.accept_paused_until = None;
        }
        if revents.first().is_some_and(|r| !r.is_empty()) {
            // New connections send their greeting and READY at once.
            for id in self.accept(now, out) {
                self.flush(now, id, out);
            }
        }
        let ready = |i: usize| revents.get(i + 1).is_some_and(|r| !r.is_empty());
        for (i, id) in ids.into_iter().enumerate() {
            let Some(p) = self.peers.get_mut(&id) else {
                continue;
            };
            let was_ready = p.conn.is_ready();
            let mut step = || -> Result<(), String> {
                if read && ready(i) {
                    let conn = &mut p.conn;
                    sockio::read_available(&mut p.stream, READ_BUDGET, |bytes| {
                        conn.handle_bytes(bytes, now).map_err(|e| e.to_string())
                    })?;
                }
                p.conn.handle_timeout(now).map_err(|e| e.to_string())?;
                if !p.conn.transmit().is_empty()
                    && now.saturating_duration_since(p.last_written) >= self.limits.stall_timeout
                {
                    return Err(format!(
                        "the peer took none of our bytes for {:?}",
                        self.limits.stall_timeout
                    ));
                }
                Ok(())
            };
            let result = step();
            if !was_ready && p.conn.is_ready() {
                out.push((id, LinkEvent::Ready));
            }
            while let Some(incoming) = p.conn.poll_incoming() {
                if matches!(incoming, Incoming::Message(_) | Incoming::Subscribe(_)) {
                    (p.last_active, p.engaged) = (now, true);
                }
                out.push((id, LinkEvent::Incoming(incoming)));
            }
            match result {
                Ok(()) => self.flush(now, id, out),
                Err(reason) => self.close(id, reason, out),
            }
        }
    }

    /// Makes a slot for a newcomer from `source` when a cap is reached, closing the holder the
    /// admission policy names (reported in `out`); `false` when no slot can be had.
    fn make_room(&mut self, source: IpAddr, out: &mut Vec<(PeerId, LinkEvent)>) -> bool {
        let caps = Caps {
            max_connections: self.limits.max_connections,
            max_per_source: self.limits.max_per_source,
        };
        let holders: Vec<Holder<PeerId>> = self
            .peers
            .iter()
            .map(|(&id, p)| Holder {
                id,
                source: p.source,
                last_active: p.last_active,
                holds_session: p.engaged,
            })
            .collect();
        if let Some(victim) = admission::evict_for(&holders, source, caps) {
            self.evicted += 1;
            if let Some(suppressed) = crate::admit_warning("event connection evicted") {
                warn!(%source, open = self.peers.len(), suppressed, role = self.role.socket_type,
                    "KV event stream connections full: closing the idlest of the heaviest source");
            }
            self.close(
                victim,
                "evicted for a newcomer (connections full)".into(),
                out,
            );
        }
        let from_source = self.peers.values().filter(|p| p.source == source).count();
        self.peers.len() < caps.max_connections && from_source < caps.max_per_source
    }

    /// Accepts the connections waiting; their numbers.
    fn accept(&mut self, now: Instant, out: &mut Vec<(PeerId, LinkEvent)>) -> Vec<PeerId> {
        let mut accepted = Vec::new();
        if self.accept_paused_until.is_some_and(|until| now < until) {
            return accepted;
        }
        self.accept_paused_until = None;
        loop {
            let (stream, source) = match sockio::accept(&self.listener) {
                Accepted::Stream(stream, source) => (stream, source),
                Accepted::None => return accepted,
                Accepted::Failed(e) => {
                    if let Some(suppressed) = crate::admit_warning("cannot accept an event socket")
                    {
                        warn!(error = %e, suppressed, role = self.role.socket_type,
                            "cannot accept a KV event stream connection");
                    }
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    return accepted;
                }
            };
            if !self.make_room(source, out) {
                self.refused += 1;
                continue; // no slot can be had (caps of zero): dropped, closed
            }
            let mut conn = Connection::new(self.role.clone(), self.limits.conn.clone());
            conn.connected(now);
            self.next += 1;
            debug!(id = self.next, %source, role = self.role.socket_type,
                "event stream connection accepted");
            self.peers.insert(
                self.next,
                Peer {
                    stream,
                    source,
                    conn,
                    last_written: now,
                    last_active: now,
                    engaged: false,
                },
            );
            accepted.push(self.next);
        }
    }
}
