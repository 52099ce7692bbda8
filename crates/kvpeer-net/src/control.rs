//! The control channel: ZeroMQ, wire-compatible with vLLM's `ZmqTransport`.
//!
//! * A ROUTER bound at `tcp://host:port`; that address is the node's identity. Inbound frames
//!   arrive as `[identity, payload]`; any other shape is dropped.
//! * One DEALER per peer, connected to the peer's ROUTER, with `ZMQ_IDENTITY` = our identity;
//!   each message is one frame (a msgpack payload). Sends never block: a full queue
//!   (`SNDHWM` 1000) marks the connection lost, as vLLM does.
//! * Heartbeats 2 s / 10 s / 10 s; `LINGER` 500 ms on DEALERs, 0 on the ROUTER; every socket
//!   refuses frames over `max_message_bytes` (default 64 MiB): libzmq drops a peer that announces
//!   a larger one (a 1 TiB header included) and keeps serving everyone else.
//! * A socket monitor on each DEALER: DISCONNECTED, CLOSED or a failed handshake mean the
//!   connection is lost ([`ChannelEvent::Lost`]). Closing a DEALER stops its monitor first:
//!   libzmq's I/O thread sends monitor events with blocking sends, so an event for a DEALER
//!   whose monitor reader is already gone would block that thread, and with it every socket of
//!   the channel, for good (seen when a peer was killed mid-transfer).
//! * Each inbound payload carries the source address of the TCP connection it came on
//!   (libzmq's `Peer-Address` message property), so the node can judge where a message came
//!   from, not only the identity the sending socket claims.
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
        /// Who sent it: the identity its socket claims (nothing proves it; see `source`).
        peer: PeerId,
        /// The address of the TCP connection it came on, as libzmq saw it (`None` if libzmq
        /// gave none, or it did not parse).
        source: Option<IpAddr>,
        /// The msgpack bytes.
        payload: Vec<u8>,
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
    router: zmq::Socket,
    identity: PeerId,
    config: ControlConfig,
    dealers: HashMap<PeerId, Dealer>,
    next_monitor: u64,
    /// Events found while sending (lost connections), returned by the next `recv`.
    pending: Vec<ChannelEvent>,
    /// What the last `wait` saw readable: the next `recv` reads only those sockets (each read
    /// attempt of an empty ZeroMQ socket costs a syscall); any later `recv` reads them all. A
    /// socket skipped is seen by the next `wait` at once (`zmq_poll` is level-triggered for
    /// queued messages).
    router_ready: std::cell::Cell<bool>,
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

/// A ROUTER bound at `endpoint`, in a fresh context.
fn router(
    endpoint: &str,
    config: &ControlConfig,
) -> Result<(zmq::Context, zmq::Socket), ControlError> {
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).map_err(zerr("create the ROUTER"))?;
    heartbeats(&router, config).map_err(zerr("configure the ROUTER"))?;
    router.set_linger(0).map_err(zerr("configure the ROUTER"))?;
    router
        .bind(endpoint)
        .map_err(zerr(format!("bind {endpoint}")))?;
    Ok((ctx, router))
}

fn heartbeats(s: &zmq::Socket, c: &ControlConfig) -> Result<(), zmq::Error> {
    s.set_heartbeat_ivl(ms(c.heartbeat_interval))?;
    s.set_heartbeat_timeout(ms(c.heartbeat_timeout))?;
    s.set_heartbeat_ttl(ms(c.heartbeat_ttl))?;
    s.set_maxmsgsize(c.max_message_bytes)
}

impl ControlChannel {
    /// Binds the ROUTER at `identity` (`host:port`, used verbatim: peers dial it back).
    pub fn bind(identity: PeerId, config: ControlConfig) -> Result<Self, ControlError> {
        identity
            .host_port()
            .map_err(|_| ControlError::BadIdentity(identity.to_string()))?;
        let (ctx, router) = router(&format!("tcp://{identity}"), &config)?;
        Ok(Self::new(ctx, router, identity, config))
    }

    /// Binds the ROUTER at `host` on a port the system picks; the identity is `host:port`.
    pub fn bind_any_port(host: &str, config: ControlConfig) -> Result<Self, ControlError> {
        let (ctx, router) = router(&format!("tcp://{host}:*"), &config)?;
        let endpoint = router
            .get_last_endpoint()
            .map_err(zerr("read the bound endpoint"))?
            .unwrap_or_default();
        let port = endpoint
            .rsplit_once(':')
            .map(|(_, p)| p.to_owned())
            .unwrap_or_default();
        let identity = PeerId::new(format!("{host}:{port}"));
        identity
            .host_port()
            .map_err(|_| ControlError::BadIdentity(identity.to_string()))?;
        Ok(Self::new(ctx, router, identity, config))
    }

    fn new(
        ctx: zmq::Context,
        router: zmq::Socket,
        identity: PeerId,
        config: ControlConfig,
    ) -> Self {
        ControlChannel {
            ctx,
            router,
            identity,
            config,
            dealers: HashMap::new(),
            next_monitor: 0,
            pending: Vec::new(),
            router_ready: std::cell::Cell::new(true),
            monitors_ready: std::cell::Cell::new(true),
        }
    }

    /// This node's identity.
    pub fn identity(&self) -> &PeerId {
        &self.identity
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
        let mut items = Vec::with_capacity(2 + self.dealers.len());
        if let Some(fd) = extra {
            items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
        }
        items.push(self.router.as_poll_item(zmq::POLLIN));
        for d in self.dealers.values() {
            items.push(d.monitor.as_poll_item(zmq::POLLIN));
        }
        let first_socket = usize::from(extra.is_some());
        match zmq::poll(&mut items, i64::from(ms(timeout))) {
            Ok(n) => {
                let readable = |i: &zmq::PollItem| i.is_readable();
                self.router_ready.set(readable(&items[first_socket]));
                self.monitors_ready
                    .set(items[first_socket + 1..].iter().any(readable));
                Ok(n > 0)
            }
            // A signal woke us: the caller looks at what changed, as after any wake-up.
            Err(zmq::Error::EINTR) => {
                self.router_ready.set(true);
                self.monitors_ready.set(true);
                Ok(true)
            }
            Err(e) => Err(zerr("poll")(e)),
        }
    }

    /// Reads the ROUTER until it has nothing more.
    fn drain_router(&mut self, events: &mut Vec<ChannelEvent>) {
        loop {
            match self.read_routed() {
                Ok(Some(event)) => events.push(event),
                Ok(None) => {}
                Err(zmq::Error::EAGAIN) => break,
                Err(e) => {
                    warn!(error = %e, "control channel receive failed");
                    break;
                }
            }
        }
    }

    /// Reads one routed message `[identity, payload]` with its source address; `Ok(None)` for a
    /// message of another shape or identity (dropped).
    fn read_routed(&mut self) -> Result<Option<ChannelEvent>, zmq::Error> {
        let identity = self.router.recv_msg(zmq::DONTWAIT)?;
        let mut frames = 1usize;
        let mut last = None;
        let mut more = identity.get_more();
        while more {
            // The rest of a multipart message is already queued (ZeroMQ delivers it whole).
            let frame = self.router.recv_msg(zmq::DONTWAIT)?;
            frames += 1;
            more = frame.get_more();
            last = Some(frame);
        }
        let Some(mut payload) = last.filter(|_| frames == 2) else {
            if let Some(suppressed) = crate::admit_warning("dropping a control message") {
                warn!(frames, suppressed, "dropping a message that is not [identity, payload]");
            }
            return Ok(None);
        };
        let id = match std::str::from_utf8(&identity) {
            Ok(id) if PeerId::parse(id).is_ok() => PeerId::new(id),
            _ => {
                if let Some(suppressed) = crate::admit_warning("dropping a control identity") {
                    warn!(suppressed, "dropping a frame from an identity that is not host:port");
                }
                return Ok(None);
            }
        };
        // libzmq records the TCP peer's address on every message it reads from a connection.
        let source = payload
            .gets("Peer-Address")
            .and_then(|a| a.parse::<IpAddr>().ok());
        Ok(Some(ChannelEvent::Payload {
            peer: id,
            source,
            payload: payload.to_vec(),
        }))
    }

    /// Everything that arrived, without blocking: payloads from the ROUTER, lost connections.
    pub fn recv(&mut self) -> Vec<ChannelEvent> {
        let mut events = std::mem::take(&mut self.pending);
        // Once readable, read until EAGAIN. When a connection's monitor has news (it closed),
        // the ROUTER is read first whatever the last wait saw: a peer's last messages (its
        // `disconnect`) were sent before its connection closed and must be handled first.
        let monitors_ready = self.monitors_ready.replace(true);
        if self.router_ready.replace(true) || monitors_ready {
            self.drain_router(&mut events);
        }
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
