//! One connecting socket of the KV event stream (a SUB to an engine's bound PUB, or the replay
//! DEALER to its ROUTER): a non-blocking TCP connection carrying one [`Connection`], made again
//! after every failure with backoff, as libzmq reconnects (`ZMQ_RECONNECT_IVL` 100 ms, here
//! doubling up to a maximum, back to the start once a handshake succeeds).
//!
//! Owned by the thread that drives its [`EventSubscriber`](super::EventSubscriber); nothing
//! blocks: the connect is non-blocking, reads stop when the socket would block or after a
//! budget, writes when it would block. Readiness comes from the caller's poll
//! ([`Client::poll_fd`]), deadlines (backoff, connect and handshake, heartbeats) from
//! [`Client::deadline`].

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use tracing::debug;

use kvpeer_core::LinkLoss;

use crate::io::sockio;
use crate::zmtp::connection::{ConnLimits, Connection, QueueFull, Role};

/// Bytes read from one connection per round, so one busy stream cannot starve the others.
pub(crate) const READ_BUDGET: usize = 4 << 20;

pub(crate) use crate::zmtp::listener::LinkEvent;

enum State {
    /// No connection: the next attempt at `until`.
    Waiting { until: Instant },
    /// TCP connect in progress since `since`.
    Connecting { stream: TcpStream, since: Instant },
    /// Connected: ZMTP flows.
    Open {
        stream: TcpStream,
        conn: Box<Connection>,
    },
}

/// A connecting socket that reconnects.
pub(crate) struct Client {
    addr: SocketAddr,
    role: Role,
    limits: ConnLimits,
    /// The first and the longest wait between attempts.
    backoff: (Duration, Duration),
    /// The wait after the next failure.
    next_backoff: Duration,
    state: State,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("addr", &self.addr)
            .field("role", &self.role.socket_type)
            .field("ready", &self.is_ready())
            .finish()
    }
}

impl Client {
    /// A client of `addr` speaking as `role`; the first attempt is made at the first progress.
    pub(crate) fn new(
        addr: SocketAddr,
        role: Role,
        limits: ConnLimits,
        backoff: (Duration, Duration),
        now: Instant,
    ) -> Self {
        Client {
            addr,
            role,
            limits,
            backoff,
            next_backoff: backoff.0,
            state: State::Waiting { until: now },
        }
    }

    /// Whether the handshake is done.
    pub(crate) fn is_ready(&self) -> bool {
        matches!(&self.state, State::Open { conn, .. } if conn.is_ready())
    }

    /// Descriptors to poll (none or one), appended to `fds`; `read` is whether to ask for
    /// input (a caller holding too much asks for none).
    pub(crate) fn poll_fds<'a>(&'a self, read: bool, fds: &mut Vec<PollFd<'a>>) {
        let input = if read {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        match &self.state {
            State::Waiting { .. } => {}
            State::Connecting { stream, .. } => {
                fds.push(PollFd::new(stream.as_fd(), PollFlags::POLLOUT))
            }
            State::Open { stream, conn } => {
                let output = if conn.transmit().is_empty() {
                    PollFlags::empty()
                } else {
                    PollFlags::POLLOUT
                };
                fds.push(PollFd::new(stream.as_fd(), input | output));
            }
        }
    }

    /// How many descriptors [`Client::poll_fds`] appends.
    pub(crate) fn fd_count(&self) -> usize {
        usize::from(!matches!(self.state, State::Waiting { .. }))
    }

    /// When [`Client::progress`] has something to do without readiness.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Waiting { until } => Some(*until),
            State::Connecting { since, .. } => Some(*since + self.limits.handshake_timeout),
            State::Open { conn, .. } => conn.poll_timeout(),
        }
    }

    /// Queues a message; written at once when the connection is idle. Refused
    /// ([`QueueFull`]) when no connection is ready or its queue is full.
    pub(crate) fn send(&mut self, parts: &[&[u8]]) -> Result<(), QueueFull> {
        let State::Open { stream, conn } = &mut self.state else {
            return Err(QueueFull);
        };
        if !conn.is_ready() {
            return Err(QueueFull);
        }
        let idle = conn.transmit().is_empty();
        conn.queue(parts)?;
        if idle {
            if let Err(reason) = sockio::write_available(stream, &mut **conn) {
                debug!(addr = %self.addr, %reason, "event stream connection failed");
                // Reported at the next progress (the socket errs again or reads end of stream).
            }
        }
        Ok(())
    }

    /// Handles readiness (`revents`, empty when the poll did not report this link) and the
    /// deadlines due at `now`; reads only when `read`. What happened goes to `out`.
    pub(crate) fn progress(
        &mut self,
        now: Instant,
        revents: PollFlags,
        read: bool,
        out: &mut Vec<LinkEvent>,
    ) {
        if let Err((reason, was_ready)) = self.step(now, revents, read, out) {
            debug!(addr = %self.addr, role = self.role.socket_type, %reason,
                "event stream connection lost");
            let wait = self.next_backoff;
            self.next_backoff = (wait * 2).min(self.backoff.1);
            self.state = State::Waiting { until: now + wait };
            out.push(LinkEvent::Lost { reason, was_ready });
        }
    }

    fn step(
        &mut self,
        now: Instant,
        revents: PollFlags,
        read: bool,
        out: &mut Vec<LinkEvent>,
    ) -> Result<(), (String, bool)> {
        if let State::Waiting { until } = self.state {
            if now < until {
                return Ok(());
            }
            match sockio::start_connect(self.addr) {
                Ok(stream) => self.state = State::Connecting { stream, since: now },
                Err(Some(reason)) => return Err((reason.to_string(), false)),
                // No socket could be made: try again after the backoff, quietly.
                Err(None) => {
                    self.state = State::Waiting {
                        until: now + self.backoff.0,
                    };
                    return Ok(());
                }
            }
        }
        if let State::Connecting { stream, since } = &self.state {
            match sockio::connect_done(stream, self.addr) {
                Err(reason) => return Err((reason.to_string(), false)),
                Ok(false) if now >= *since + self.limits.handshake_timeout => {
                    return Err((
                        format!(
                            "connect not done within {:?}",
                            self.limits.handshake_timeout
                        ),
                        false,
                    ))
                }
                Ok(false) => return Ok(()),
                Ok(true) => {
                    let State::Connecting { stream, .. } =
                        std::mem::replace(&mut self.state, State::Waiting { until: now })
                    else {
                        return Ok(());
                    };
                    let mut conn =
                        Box::new(Connection::new(self.role.clone(), self.limits.clone()));
                    conn.connected(now);
                    debug!(addr = %self.addr, role = self.role.socket_type,
                        "event stream connection connected");
                    self.state = State::Open { stream, conn };
                }
            }
        }
        let State::Open { stream, conn } = &mut self.state else {
            return Ok(());
        };
        let was_ready = conn.is_ready();
        let fail = |reason: String| (reason, was_ready);
        if read && !revents.is_empty() {
            sockio::read_available(stream, READ_BUDGET, |bytes| {
                conn.handle_bytes(bytes, now)
                    .map_err(|e| LinkLoss::Zmtp(e.to_string().into()))
            })
            .map_err(|e| fail(e.to_string()))?;
        }
        conn.handle_timeout(now).map_err(|e| fail(e.to_string()))?;
        if !was_ready && conn.is_ready() {
            self.next_backoff = self.backoff.0;
            out.push(LinkEvent::Ready {
                identity: conn.peer_identity().unwrap_or_default().to_vec(),
                source: None,
            });
        }
        while let Some(incoming) = conn.poll_incoming() {
            out.push(LinkEvent::Incoming(incoming));
        }
        sockio::write_available(stream, &mut **conn).map_err(|e| fail(e.to_string()))?;
        Ok(())
    }
}
