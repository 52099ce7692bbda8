//! The control channel: ZeroMQ, wire-compatible with vLLM's `ZmqTransport`.
//!
//! * The listening side is kvpeer's own ZMTP ([`Inbound`]) at `host:port`, which is the node's
//!   identity; it behaves as libzmq's ROUTER on the wire, but every message comes with the
//!   connection it arrived on, the identity that connection claimed and its source address, and
//!   the node can close one connection. Several connections may claim one identity; none locks
//!   another out (libzmq's ROUTER ignores all but the first: docs/security.md). Messages of any
//!   shape but one frame are dropped.
//! * One DEALER per peer, connected to the peer's ROUTER, with `ZMQ_IDENTITY` = our identity;
//!   each message is one frame (a msgpack payload). Sends never block: a full queue
//!   (`SNDHWM` 1000) marks the connection lost, as vLLM does.
//! * Heartbeats 2 s / 10 s / 10 s on both sides; `LINGER` 500 ms on DEALERs; frames over
//!   `max_message_bytes` (default 64 MiB) are refused from their header: the connection that
//!   announced one is closed (a 1 TiB header included) and everyone else is served.
//! * A socket monitor on each DEALER: DISCONNECTED, CLOSED or a failed handshake mean the
//!   connection is lost ([`ChannelEvent::Lost`]). Closing a DEALER stops its monitor first:
//!   libzmq's I/O thread sends monitor events with blocking sends, so an event for a DEALER
//!   whose monitor reader is already gone would block that thread, and with it every socket of
//!   the channel, for good (seen when a peer was killed mid-transfer).
//! * Dial-back is lazy: sending to a peer without a DEALER opens one (to the peer's identity,
//!   `host:port`). The core opens a session only on a `connect`, so junk never makes us dial.
//!
//! Owned by the node's runtime thread. [`ControlChannel::wait`] sleeps until a socket is
//! readable or the timeout passes; nothing else blocks.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Duration;

use kvpeer_proto::PeerId;
use tracing::{debug, warn};

use crate::inbound::{ConnId, Inbound, InboundEvent, InboundLimits};

/// Settings of the control channel; `Default` is vLLM's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlConfig {
    /// Heartbeat interval (`ZMQ_HEARTBEAT_IVL`).
    pub heartbeat_interval: Duration,
    /// Heartbeat timeout (`ZMQ_HEARTBEAT_TIMEOUT`).
    pub heartbeat_timeout: Duration,
    /// Heartbeat TTL told to the peer (`ZMQ_HEARTBEAT_TTL`).
    pub heartbeat_ttl: Duration,
    /// Messages queued per peer before a send fails (`ZMQ_SNDHWM`).
    pub send_queue: i32,
    /// How long unsent messages linger after a DEALER closes (`ZMQ_LINGER`).
    pub linger: Duration,
    /// Largest frame accepted (`ZMQ_MAXMSGSIZE`).
    pub max_message_bytes: i64,
    /// Inbound connections at once.
    pub max_inbound: usize,
    /// Inbound connections at once from one source address.
    pub max_inbound_per_source: usize,
}

impl Default for ControlConfig {
    fn default() -> Self {
        ControlConfig {
            heartbeat_interval: Duration::from_secs(2),
            heartbeat_timeout: Duration::from_secs(10),
            heartbeat_ttl: Duration::from_secs(10),
            send_queue: 1000,
            linger: Duration::from_millis(500),
            max_message_bytes: 64 << 20,
            max_inbound: 1024,
            max_inbound_per_source: 64,
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
    /// A ZeroMQ call failed.
    #[error("{what}: {source}")]
    Zmq {
        /// What was being done.
        what: String,
        /// libzmq's error.
        source: zmq::Error,
    },
}

fn zerr(what: impl Into<String>) -> impl FnOnce(zmq::Error) -> ControlError {
    let what = what.into();
    move |source| ControlError::Zmq { what, source }
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
    /// bad bytes). The session it carried, if any, learns it from its DEALER's side.
    InboundClosed {
        /// The connection.
        conn: ConnId,
        /// The identity it claimed, if it got that far.
        peer: Option<PeerId>,
    },
    /// The connection to a peer is gone (monitor event or failed send); its DEALER is closed.
    Lost {
        /// The peer.
        peer: PeerId,
        /// What happened.
        reason: String,
    },
}

/// Why a send failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SendError {
    /// The peer's queue is full or its socket failed: the connection is lost.
    #[error("send to {peer} failed: {reason}")]
    Lost {
        /// The peer.
        peer: PeerId,
        /// What happened.
        reason: String,
    },
}

struct Dealer {
    socket: zmq::Socket,
    monitor: zmq::Socket,
}

impl Drop for Dealer {
    fn drop(&mut self) {
        // Stop the monitor before the DEALER and the monitor reader close (the fields drop
        // after this). Under libzmq's monitor lock this closes the monitor's sending end, so
        // the I/O thread, tearing the DEALER down later, has nowhere to block.
        // SAFETY: `self.socket` is a live DEALER owned by this struct, used only by this
        // thread; a NULL endpoint is zmq_socket_monitor's documented way to stop monitoring.
        let rc =
            unsafe { zmq_sys::zmq_socket_monitor(self.socket.as_mut_ptr(), std::ptr::null(), 0) };
        if rc != 0 {
            warn!("could not stop a DEALER's monitor before closing it");
        }
    }
}

/// The ZeroMQ control channel of one node.
pub struct ControlChannel {
    ctx: zmq::Context,
    inbound: Inbound,
    identity: PeerId,
    config: ControlConfig,
    dealers: HashMap<PeerId, Dealer>,
    next_monitor: u64,
    /// Events found while sending (lost connections), returned by the next `recv`.
    pending: Vec<ChannelEvent>,
    /// What the last `wait` saw readable: the next `recv` reads only those (each read attempt
    /// costs a syscall). A socket skipped is seen by the next `wait` at once (`zmq_poll` is
    /// level-triggered).
    listener_ready: std::cell::Cell<bool>,
    readable_conns: std::cell::RefCell<Vec<ConnId>>,
    monitors_ready: std::cell::Cell<bool>,
}

impl std::fmt::Debug for ControlChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlChannel")
            .field("identity", &self.identity)
            .field("peers", &self.dealers.len())
            .finish()
    }
}

fn ms(d: Duration) -> i32 {
    i32::try_from(d.as_millis()).unwrap_or(i32::MAX)
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
    }
}

fn listen(addr: &str, config: &ControlConfig) -> Result<Inbound, ControlError> {
    Inbound::bind(addr, limits(config)).map_err(|source| ControlError::Bind {
        addr: addr.to_owned(),
        source,
    })
}

fn heartbeats(s: &zmq::Socket, c: &ControlConfig) -> Result<(), zmq::Error> {
    s.set_heartbeat_ivl(ms(c.heartbeat_interval))?;
    s.set_heartbeat_timeout(ms(c.heartbeat_timeout))?;
    s.set_heartbeat_ttl(ms(c.heartbeat_ttl))?;
    s.set_maxmsgsize(c.max_message_bytes)
}

impl ControlChannel {
    /// Listens at `identity` (`host:port`, used verbatim: peers dial it back).
    pub fn bind(identity: PeerId, config: ControlConfig) -> Result<Self, ControlError> {
        identity
            .host_port()
            .map_err(|_| ControlError::BadIdentity(identity.to_string()))?;
        let inbound = listen(identity.as_str(), &config)?;
        Ok(Self::new(inbound, identity, config))
    }

    /// Listens at `host` on a port the system picks; the identity is `host:port`.
    pub fn bind_any_port(host: &str, config: ControlConfig) -> Result<Self, ControlError> {
        let inbound = listen(PeerId::from_host_port(host, 0).as_str(), &config)?;
        let port = inbound.port().map_err(|source| ControlError::Bind {
            addr: host.to_owned(),
            source,
        })?;
        let identity = PeerId::from_host_port(host, port);
        identity
            .host_port()
            .map_err(|_| ControlError::BadIdentity(identity.to_string()))?;
        Ok(Self::new(inbound, identity, config))
    }

    fn new(inbound: Inbound, identity: PeerId, config: ControlConfig) -> Self {
        ControlChannel {
            ctx: zmq::Context::new(),
            inbound,
            identity,
            config,
            dealers: HashMap::new(),
            next_monitor: 0,
            pending: Vec::new(),
            listener_ready: std::cell::Cell::new(true),
            readable_conns: std::cell::RefCell::new(Vec::new()),
            monitors_ready: std::cell::Cell::new(true),
        }
    }

    /// This node's identity.
    pub fn identity(&self) -> &PeerId {
        &self.identity
    }

    /// Closes inbound connection `conn` (a connection the node will not hear).
    pub fn close_inbound(&mut self, conn: ConnId) {
        self.inbound.close(conn);
    }

    /// Inbound connections open now.
    pub fn inbound_connections(&self) -> usize {
        self.inbound.connections()
    }

    /// Whether a DEALER to `peer` is open.
    pub fn connected(&self, peer: &PeerId) -> bool {
        self.dealers.contains_key(peer)
    }

    /// Opens a DEALER to `peer` (no-op if open). Messages queue until TCP connects.
    pub fn dial(&mut self, peer: &PeerId) -> Result<(), ControlError> {
        if self.dealers.contains_key(peer) {
            return Ok(());
        }
        peer.host_port()
            .map_err(|_| ControlError::BadIdentity(peer.to_string()))?;
        let socket = self
            .ctx
            .socket(zmq::DEALER)
            .map_err(zerr("create a DEALER"))?;
        let setup = |s: &zmq::Socket| -> Result<(), zmq::Error> {
            s.set_identity(self.identity.as_str().as_bytes())?;
            heartbeats(s, &self.config)?;
            s.set_sndhwm(self.config.send_queue)?;
            s.set_linger(ms(self.config.linger))?;
            s.set_immediate(false)
        };
        setup(&socket).map_err(zerr(format!("configure the DEALER to {peer}")))?;
        self.next_monitor += 1;
        let endpoint = format!("inproc://kvpeer-monitor-{}", self.next_monitor);
        let events = zmq::SocketEvent::DISCONNECTED as i32
            | zmq::SocketEvent::CLOSED as i32
            | zmq::SocketEvent::HANDSHAKE_FAILED_NO_DETAIL as i32
            | zmq::SocketEvent::HANDSHAKE_FAILED_PROTOCOL as i32
            | zmq::SocketEvent::HANDSHAKE_FAILED_AUTH as i32;
        socket
            .monitor(&endpoint, events)
            .map_err(zerr(format!("monitor the DEALER to {peer}")))?;
        let monitor = self
            .ctx
            .socket(zmq::PAIR)
            .map_err(zerr("create a monitor socket"))?;
        monitor
            .connect(&endpoint)
            .map_err(zerr(format!("connect the monitor of {peer}")))?;
        socket
            .connect(&format!("tcp://{peer}"))
            .map_err(zerr(format!("connect tcp://{peer}")))?;
        debug!(%peer, "control connection opened");
        self.dealers
            .insert(peer.clone(), Dealer { socket, monitor });
        Ok(())
    }

    /// Closes the DEALER to `peer` (queued messages linger up to `linger`).
    pub fn close(&mut self, peer: &PeerId) {
        if self.dealers.remove(peer).is_some() {
            debug!(%peer, "control connection closed");
        }
    }

    /// Sends one payload to `peer`, opening a DEALER to it first if needed. Never blocks.
    pub fn send(&mut self, peer: &PeerId, payload: &[u8]) -> Result<(), SendError> {
        let lost = |reason: String| SendError::Lost {
            peer: peer.clone(),
            reason,
        };
        if !self.dealers.contains_key(peer) {
            self.dial(peer).map_err(|e| lost(e.to_string()))?;
        }
        let Some(dealer) = self.dealers.get(peer) else {
            return Err(lost("no connection".into()));
        };
        match dealer.socket.send(payload, zmq::DONTWAIT) {
            Ok(()) => Ok(()),
            Err(e) => {
                let reason = if e == zmq::Error::EAGAIN {
                    "send queue full".to_string()
                } else {
                    e.to_string()
                };
                warn!(%peer, %reason, "control send failed; connection lost");
                self.close(peer);
                Err(lost(reason))
            }
        }
    }

    /// Sleeps until a payload or a monitor event may be ready, or `timeout` passes.
    pub fn wait(&self, timeout: Duration) -> Result<bool, ControlError> {
        self.wait_with(timeout, None)
    }

    /// As [`ControlChannel::wait`], also waking when `extra` (a file descriptor, e.g. the read
    /// end of the data plane's wake pipe) becomes readable.
    pub fn wait_with(
        &self,
        timeout: Duration,
        extra: Option<std::os::fd::RawFd>,
    ) -> Result<bool, ControlError> {
        let conns = self.inbound.connections();
        let mut items = Vec::with_capacity(2 + conns + self.dealers.len());
        if let Some(fd) = extra {
            items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
        }
        let first_fd = items.len();
        let listening = self.inbound.listening(std::time::Instant::now());
        for (i, (fd, sending)) in self.inbound.poll_fds().enumerate() {
            let events = if i == 0 && !listening {
                // The listener rests after a failed accept (its deadline wakes us).
                zmq::PollEvents::empty()
            } else if sending {
                zmq::POLLIN | zmq::POLLOUT
            } else {
                zmq::POLLIN
            };
            items.push(zmq::PollItem::from_fd(fd, events));
        }
        let first_monitor = items.len();
        for d in self.dealers.values() {
            items.push(d.monitor.as_poll_item(zmq::POLLIN));
        }
        // Heartbeats and handshake deadlines of inbound connections wake us too.
        let timeout = match self.inbound.next_deadline() {
            Some(at) => timeout.min(at.saturating_duration_since(std::time::Instant::now())),
            None => timeout,
        };
        match zmq::poll(&mut items, i64::from(ms(timeout))) {
            Ok(n) => {
                let ready = |i: &zmq::PollItem| i.is_readable() || i.is_writable() || i.is_error();
                self.listener_ready.set(ready(&items[first_fd]));
                let mut readable = self.readable_conns.borrow_mut();
                readable.clear();
                readable.extend(
                    self.inbound
                        .conn_ids()
                        .zip(&items[first_fd + 1..first_monitor])
                        .filter(|(_, item)| ready(item))
                        .map(|(id, _)| id),
                );
                self.monitors_ready
                    .set(items[first_monitor..].iter().any(|i| i.is_readable()));
                Ok(n > 0)
            }
            // A signal woke us: the caller looks at what changed, as after any wake-up.
            Err(zmq::Error::EINTR) => {
                self.listener_ready.set(true);
                let mut readable = self.readable_conns.borrow_mut();
                readable.clear();
                readable.extend(self.inbound.conn_ids());
                self.monitors_ready.set(true);
                Ok(true)
            }
            Err(e) => Err(zerr("poll")(e)),
        }
    }

    /// Reads the inbound connections the last wait saw ready (all of them after a `recv`
    /// without a wait in between), runs their heartbeats, and turns what came into events.
    fn read_inbound(&mut self, events: &mut Vec<ChannelEvent>) {
        let listener_ready = self.listener_ready.replace(true);
        let readable = {
            let mut r = self.readable_conns.borrow_mut();
            let taken = std::mem::take(&mut *r);
            r.extend(self.inbound.conn_ids());
            taken
        };
        let mut happened = Vec::new();
        self.inbound.progress(
            std::time::Instant::now(),
            listener_ready,
            &readable,
            &mut happened,
        );
        events.extend(happened.into_iter().map(|e| match e {
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
        }));
    }

    /// Everything that arrived, without blocking: payloads and closes of inbound connections,
    /// lost outbound connections.
    pub fn recv(&mut self) -> Vec<ChannelEvent> {
        let mut events = std::mem::take(&mut self.pending);
        // Inbound connections are read first, and all of them when a DEALER's monitor has news
        // (a peer's connection closed), whatever the last wait saw: a peer's last messages (its
        // `disconnect`) were sent before its connection closed and must be handled first.
        let monitors_ready = self.monitors_ready.replace(true);
        if monitors_ready {
            let all: Vec<ConnId> = self.inbound.conn_ids().collect();
            *self.readable_conns.borrow_mut() = all;
        }
        self.read_inbound(&mut events);
        let mut lost = Vec::new();
        let monitors = if monitors_ready {
            &self.dealers
        } else {
            &HashMap::new()
        };
        for (peer, dealer) in monitors {
            while let Ok(frames) = dealer.monitor.recv_multipart(zmq::DONTWAIT) {
                let event = frames
                    .first()
                    .and_then(|f| f.get(..2))
                    .map(|b| u16::from_le_bytes([b[0], b[1]]));
                lost.push((
                    peer.clone(),
                    format!("control connection lost (monitor event {event:?})"),
                ));
            }
        }
        for (peer, reason) in lost {
            if self.dealers.contains_key(&peer) {
                self.close(&peer);
                events.push(ChannelEvent::Lost { peer, reason });
            }
        }
        events
    }
}
