//! One connecting socket of the KV event stream (a SUB to an engine's bound PUB, or the replay
//! DEALER to its ROUTER): the crate's [`Dialer`], made again after every failure with backoff,
//! as libzmq reconnects (`ZMQ_RECONNECT_IVL` 100 ms, here doubling up to a maximum, back to
//! the start once a handshake succeeds), each attempt with a fresh connection and a connect
//! bounded by the handshake timeout.
//!
//! Owned by the thread that drives its [`EventSubscriber`](super::EventSubscriber), whose poll
//! the socket is registered in; nothing blocks.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tracing::debug;

use crate::io::poller::{Poller, Ready, Token};
use crate::io::timers::coarse;
use crate::zmtp::connection::{ConnLimits, Connection, QueueFull, Role};
use crate::zmtp::dialer::Dialer;

/// Bytes read from one connection per round, so one busy stream cannot starve the others.
pub(crate) const READ_BUDGET: usize = 4 << 20;

pub(crate) use crate::zmtp::listener::LinkEvent;

/// A connecting socket that reconnects.
pub(crate) struct Client {
    addr: SocketAddr,
    token: Token,
    role: Role,
    limits: ConnLimits,
    dialer: Dialer,
    /// The first and the longest wait between attempts.
    backoff: (Duration, Duration),
    /// The wait after the next failure.
    next_backoff: Duration,
    /// No socket: the next attempt at this time.
    retry_at: Option<Instant>,
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
    /// A client of `addr` speaking as `role`, polled as `token`; the first attempt is made at
    /// the first progress.
    pub(crate) fn new(
        addr: SocketAddr,
        token: Token,
        role: Role,
        limits: ConnLimits,
        backoff: (Duration, Duration),
        now: Instant,
    ) -> Self {
        let conn = Connection::new(role.clone(), limits.clone());
        Client {
            addr,
            token,
            dialer: Dialer::new(conn, Some(limits.handshake_timeout), READ_BUDGET),
            role,
            limits,
            backoff,
            next_backoff: backoff.0,
            retry_at: Some(now),
        }
    }

    /// Whether the handshake is done.
    pub(crate) fn is_ready(&self) -> bool {
        self.dialer.is_ready()
    }

    /// What the poll said of its socket.
    pub(crate) fn on_ready(&mut self, ready: Ready) {
        self.dialer.on_ready(ready);
    }

    /// When [`Client::progress`] has something to do: now with news not yet handled, else the
    /// next attempt, the connect's deadline or the connection's heartbeats.
    pub(crate) fn deadline(&self, now: Instant, reading: bool) -> Option<Instant> {
        if self.dialer.has_work(reading) {
            return Some(now);
        }
        self.retry_at
            .into_iter()
            .chain(self.dialer.deadline().map(coarse))
            .min()
    }

    /// Queues a message; written at once when the connection is idle. Refused
    /// ([`QueueFull`]) when no connection is ready or its queue is full.
    pub(crate) fn send(&mut self, parts: &[&[u8]]) -> Result<(), QueueFull> {
        if !self.dialer.is_ready() {
            return Err(QueueFull);
        }
        self.dialer.send(parts)
    }

    /// Handles what the poll reported and the deadlines due at `now`; reads only when
    /// `reading`. What happened goes to `out`.
    pub(crate) fn progress(
        &mut self,
        poller: &Poller,
        now: Instant,
        reading: bool,
        out: &mut Vec<LinkEvent>,
    ) {
        if let Some(at) = self.retry_at.filter(|at| now >= *at) {
            let _ = at;
            self.retry_at = None;
            self.dialer
                .replace_connection(Connection::new(self.role.clone(), self.limits.clone()));
            match self.dialer.connect(poller, self.token, self.addr, now) {
                Ok(()) => {}
                Err(Some(reason)) => return self.failed(now, reason, false, out),
                // No socket could be made: try again after the first backoff, quietly.
                Err(None) => {
                    self.retry_at = Some(now + self.backoff.0);
                    return;
                }
            }
        }
        if !self.dialer.is_active() {
            return;
        }
        let was_ready = self.dialer.is_ready();
        match self.dialer.progress(now, reading) {
            Ok(ready) => {
                if ready {
                    self.next_backoff = self.backoff.0;
                    out.push(LinkEvent::Ready {
                        identity: self
                            .dialer
                            .connection()
                            .peer_identity()
                            .unwrap_or_default()
                            .to_vec(),
                        source: None,
                        tls: crate::zmtp::listener::TlsState::Plaintext,
                    });
                }
                while let Some(incoming) = self.dialer.poll_incoming() {
                    out.push(LinkEvent::Incoming(incoming));
                }
            }
            Err(reason) => {
                // What it received before the end comes first.
                while let Some(incoming) = self.dialer.poll_incoming() {
                    out.push(LinkEvent::Incoming(incoming));
                }
                self.failed(now, reason, was_ready, out);
            }
        }
    }

    fn failed(
        &mut self,
        now: Instant,
        reason: kvpeer_core::LinkLoss,
        was_ready: bool,
        out: &mut Vec<LinkEvent>,
    ) {
        debug!(addr = %self.addr, role = self.role.socket_type, %reason,
            "event stream connection lost");
        self.dialer.disconnect();
        let wait = self.next_backoff;
        self.next_backoff = (wait * 2).min(self.backoff.1);
        self.retry_at = Some(now + wait);
        out.push(LinkEvent::Lost { reason, was_ready });
    }
}
