//! One connecting socket carrying one [`Connection`]: the control channel's DEALER to a peer
//! (`control/outbound.rs`) and every connecting socket of the KV event stream (a SUB, the
//! replay DEALER: `events/`) are this type; what each does when the connection fails (report
//! the loss, or try again after a backoff) is its owner's.
//!
//! * [`Dialer::connect`] starts a non-blocking connect and registers the socket in the owner's
//!   [`Poller`] under the owner's token; it never blocks. Messages may be queued before (the
//!   [`Connection`] holds them until the peer's READY).
//! * The owner hands each readiness to [`Dialer::on_ready`] and calls [`Dialer::progress`] when
//!   the poll said so or its [`Dialer::deadline`] passed: the connect's result, reads (within a
//!   budget; what is left is read next time, without a new event), the connection's deadlines
//!   (heartbeats, the handshake), writes. The first failure is returned, with the cause the
//!   user will read ([`LinkLoss`]); the dialer is then idle.
//! * A connect may have a deadline of its own (the event stream's, which reconnects); the
//!   control channel's has none beyond the system's, as libzmq's.
//!
//! Owned by the thread that owns the poller; nothing here blocks.

use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use kvpeer_core::{Cause, DialFailure, LinkLoss};
use tracing::debug;

use crate::io::poller::{Poller, Ready, Token};
use crate::io::sockio::{self, ReadEnd};
use crate::zmtp::connection::{ConnError, Connection, QueueFull, QueueWithError};
use crate::zmtp::{self, ZmtpError};

/// How far a connecting socket got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DialStage {
    /// Resolving the name or waiting for TCP's connect.
    Connecting,
    /// TCP is up; the ZMTP greeting and READY are not done.
    Handshaking,
    /// ZMTP is up: messages flow.
    Ready,
}

enum State {
    /// No socket.
    Idle,
    /// TCP connect in progress since `since`.
    Connecting {
        stream: TcpStream,
        addr: SocketAddr,
        since: Instant,
        /// The poll reported the socket (the connect finished, one way or the other).
        reported: bool,
    },
    /// Connected: ZMTP flows.
    Open {
        stream: TcpStream,
        /// Input may wait (the poll said so and no read drained it since).
        readable: bool,
        /// The socket takes bytes.
        writable: bool,
    },
}

/// How a dialer speaks TLS to its peer ([`Dialer::set_tls`]).
#[derive(Clone)]
pub(crate) struct DialTls {
    /// The client configuration (our certificate, the CA the peer's must chain to).
    pub(crate) config: std::sync::Arc<rustls::ClientConfig>,
    /// A peer that greets without offering TLS is talked to in clear (policy `preferred`),
    /// instead of failing (`required`).
    pub(crate) fall_back: bool,
}

impl std::fmt::Debug for DialTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DialTls")
            .field("fall_back", &self.fall_back)
            .finish()
    }
}

/// A connecting socket and its connection.
pub(crate) struct Dialer {
    conn: Connection,
    state: State,
    /// TLS for the next connects (`None`: plaintext ZMTP).
    tls: Option<DialTls>,
    /// The open connection's TLS session.
    session: Option<rustls::Connection>,
    /// The open connection wants TLS and waits for the listener's signature, which says
    /// whether it offers TLS ([`zmtp::TLS_OFFER`]): nothing is written or read until it came.
    awaiting_offer: bool,
    /// The address the open connection dialed: the listener's certificate must name it.
    dialed_ip: Option<std::net::IpAddr>,
    /// The peer greeted without offering TLS and the connection went on in clear
    /// (`preferred`): its owner learns it once ([`Dialer::take_fell_back`]).
    fell_back: bool,
    /// What `connect` may take (`None`: the system's own connect timeout).
    connect_timeout: Option<Duration>,
    /// Bytes read per progress.
    read_budget: usize,
    /// Bytes written per progress or flush (the owner's turn; `usize::MAX`: all the socket
    /// takes).
    write_limit: usize,
    /// Bytes written by progress and flush since [`Dialer::take_written`] last asked.
    last_written: usize,
    /// Whether the peer's host answered (any segment) after our last PING when the
    /// connection last failed: a heartbeat then unanswered is its process's silence.
    host_answered_at_failure: bool,
    /// Segments the peer's host had sent when our unanswered PING (the heartbeat's or a
    /// probe's) left (`None`: no PING waits, or the kernel does not say).
    ping_segments_in: Option<u32>,
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialer")
            .field("role", &self.conn.role().socket_type)
            .field("stage", &self.stage())
            .finish()
    }
}

/// The cause a user reads for a connection's protocol failure.
pub(crate) fn loss_of(e: ConnError) -> LinkLoss {
    match e {
        ConnError::HandshakeTimeout(d) => LinkLoss::HandshakeTimeout(d),
        ConnError::HeartbeatTimeout(d) | ConnError::TtlExpired(d) => LinkLoss::Silent(d),
        ConnError::ProbeUnanswered(d) => LinkLoss::ProbeUnanswered(d),
        // What the greeting or READY says: not the kind of port we dialed.
        e @ (ConnError::Zmtp(
            ZmtpError::Signature(_) | ZmtpError::Version(_) | ZmtpError::Mechanism(_),
        )
        | ConnError::PeerType { .. }) => LinkLoss::NotZmtp(Cause::new(e)),
        ConnError::Zmtp(e) => LinkLoss::Zmtp(Cause::new(e)),
        e @ ConnError::Unread { .. } => LinkLoss::Zmtp(Cause::new(e)),
        ConnError::Refused(reason) => LinkLoss::RefusedByPeer(reason.into()),
    }
}

/// Whether the peer's host sent us anything since our unanswered PING left (`baseline`: its
/// segment count then), or, while it holds its receive window shut (our bytes cannot leave, so
/// it has nothing to acknowledge but our kernel's spaced-out window probes), within the
/// heartbeat timeout.
fn host_answered(conn: &Connection, baseline: Option<u32>, stream: &TcpStream) -> bool {
    let moved = baseline
        .zip(sockio::segments_in(stream))
        .is_some_and(|(then, now)| now != then);
    moved
        || sockio::window_shut_since(stream).is_some_and(|silent| silent < conn.heartbeat_timeout())
}

/// After the connection's deadlines ran: a PING that left just now (none waited before)
/// starts the count of what the host sends after it; none waiting, no count.
fn note_ping(conn: &Connection, baseline: &mut Option<u32>, stream: &TcpStream, waited: bool) {
    if !waited && conn.ping_unanswered() {
        *baseline = sockio::segments_in(stream);
    } else if !conn.ping_unanswered() {
        *baseline = None;
    }
}

impl Dialer {
    /// An idle dialer whose connection speaks `conn`'s role (messages may be queued at once).
    pub(crate) fn new(
        conn: Connection,
        connect_timeout: Option<Duration>,
        read_budget: usize,
    ) -> Self {
        Dialer {
            conn,
            state: State::Idle,
            tls: None,
            session: None,
            awaiting_offer: false,
            dialed_ip: None,
            fell_back: false,
            connect_timeout,
            read_budget,
            write_limit: usize::MAX,
            last_written: 0,
            host_answered_at_failure: false,
            ping_segments_in: None,
        }
    }

    /// Speaks TLS from the next connect on (`None`: plaintext). The peer's certificate must
    /// chain to the configuration's CA and name the address dialed.
    pub(crate) fn set_tls(&mut self, tls: Option<DialTls>) {
        self.tls = tls;
    }

    /// Whether the open connection runs over TLS.
    pub(crate) fn is_tls(&self) -> bool {
        self.session.is_some()
    }

    /// Whether a peer greeted without offering TLS and its connection went on in clear since
    /// this was last asked (and false from now).
    pub(crate) fn take_fell_back(&mut self) -> bool {
        std::mem::take(&mut self.fell_back)
    }

    /// Bytes the next progress or flush may write (the owner's share of its turn).
    pub(crate) fn set_write_limit(&mut self, limit: usize) {
        self.write_limit = limit;
    }

    /// Bytes written since this was last asked (by progress or flush), and zero from now.
    pub(crate) fn take_written(&mut self) -> usize {
        std::mem::take(&mut self.last_written)
    }

    /// Whether bytes wait that the socket would take now (a turn with a write limit left
    /// them).
    pub(crate) fn wants_write(&self) -> bool {
        matches!(self.state, State::Open { writable: true, .. })
            && !self.conn.transmit().is_empty()
            && !self.tls_handshaking()
    }

    /// Whether its TLS handshake is under way, or waits for the listener's offer: the
    /// connection's bytes wait for it, and only a read (the peer's next bytes) moves it on.
    fn tls_handshaking(&self) -> bool {
        self.awaiting_offer || self.session.as_ref().is_some_and(|s| s.is_handshaking())
    }

    /// Whether everything queued left: the connection's bytes, and the records TLS made of
    /// them.
    pub(crate) fn is_drained(&self) -> bool {
        self.conn.is_drained() && !self.session.as_ref().is_some_and(|s| s.wants_write())
    }

    /// The connection (its handshake, what it holds).
    pub(crate) fn connection(&self) -> &Connection {
        &self.conn
    }

    /// A fresh connection for the next attempt (what the old one held is dropped).
    pub(crate) fn replace_connection(&mut self, conn: Connection) {
        self.conn = conn;
    }

    /// How far it got (`None`: no socket).
    pub(crate) fn stage(&self) -> Option<DialStage> {
        match &self.state {
            State::Idle => None,
            State::Connecting { .. } => Some(DialStage::Connecting),
            State::Open { .. } if self.conn.is_ready() => Some(DialStage::Ready),
            State::Open { .. } => Some(DialStage::Handshaking),
        }
    }

    /// Whether the handshake is done.
    pub(crate) fn is_ready(&self) -> bool {
        matches!(self.state, State::Open { .. }) && self.conn.is_ready()
    }

    /// Whether a socket is open or opening.
    pub(crate) fn is_active(&self) -> bool {
        !matches!(self.state, State::Idle)
    }

    /// Whether the connection is ready and its socket has not seen the peer's end of stream
    /// (a peek, checked now).
    pub(crate) fn ready_and_open(&self) -> bool {
        let State::Open { stream, .. } = &self.state else {
            return false;
        };
        if !self.conn.is_ready() {
            return false;
        }
        // Non-blocking: bytes waiting or none yet means open; 0 is the peer's end of stream.
        match stream.peek(&mut [0u8; 1]) {
            Ok(n) => n > 0,
            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
        }
    }

    /// Starts a non-blocking connect to `addr` at `now`, registered in `poller` as `token`.
    /// `Err(Some(cause))`: the connect failed at once; `Err(None)`: no socket could be made
    /// (out of descriptors: the owner tries again later).
    pub(crate) fn connect(
        &mut self,
        poller: &Poller,
        token: Token,
        addr: SocketAddr,
        now: Instant,
    ) -> Result<(), Option<LinkLoss>> {
        let stream = sockio::start_connect(addr)?;
        if let Err(e) = poller.add(stream.as_fd(), token) {
            return Err(Some(LinkLoss::DialFailed(DialFailure::Poll(e.kind()))));
        }
        self.state = State::Connecting {
            stream,
            addr,
            since: now,
            reported: true,
        };
        Ok(())
    }

    /// Closes the socket (the connection's state stays, for an owner that reports it).
    pub(crate) fn disconnect(&mut self) {
        if let State::Open { stream, .. } | State::Connecting { stream, .. } = &self.state {
            let _ = stream.shutdown(std::net::Shutdown::Both);
        }
        self.state = State::Idle;
        self.session = None;
    }

    /// What the owner's poll said of this socket.
    pub(crate) fn on_ready(&mut self, ready: Ready) {
        match &mut self.state {
            State::Connecting { reported, .. } => *reported = true,
            State::Open {
                readable, writable, ..
            } => {
                *readable |= ready.readable || ready.closed;
                *writable |= ready.writable;
            }
            State::Idle => {}
        }
    }

    /// Whether a progress would have work now (the poll's news not yet handled, or input left
    /// from the last one).
    pub(crate) fn has_work(&self, reading: bool) -> bool {
        match &self.state {
            State::Connecting { reported, .. } => *reported,
            State::Open {
                readable, writable, ..
            } => {
                (reading && *readable)
                    || self.conn.holds_input()
                    || (*writable && !self.conn.transmit().is_empty() && !self.tls_handshaking())
            }
            State::Idle => false,
        }
    }

    /// When [`Dialer::progress`] has something to do without the poll's news: the connect's
    /// deadline, the connection's heartbeats and handshake.
    pub(crate) fn deadline(&self) -> Option<Instant> {
        match &self.state {
            State::Idle => None,
            State::Connecting { since, .. } => self.connect_timeout.map(|t| *since + t),
            State::Open { .. } => self.conn.poll_timeout(),
        }
    }

    /// Drives the socket at `now`: the connect's end, reads (when `reading`), deadlines,
    /// writes; what the peer sent is taken with [`Dialer::poll_incoming`]. `Ok(true)` when the
    /// handshake finished in this call. A failure closes the socket.
    pub(crate) fn progress(&mut self, now: Instant, reading: bool) -> Result<bool, LinkLoss> {
        let was_ready = self.is_ready();
        let result = self.step(now, reading);
        if result.is_err() {
            // Whether the peer's host answered our last PING: a host whose kernel still sent us
            // segments is up, whatever its process did.
            self.host_answered_at_failure = match &self.state {
                State::Open { stream, .. } => {
                    host_answered(&self.conn, self.ping_segments_in, stream)
                }
                _ => false,
            };
            self.disconnect();
        }
        result.map(|()| !was_ready && self.is_ready())
    }

    /// Whether the peer's host answered (any segment from its kernel) after our last PING,
    /// when the connection last failed.
    pub(crate) fn host_answered_at_failure(&self) -> bool {
        self.host_answered_at_failure
    }

    fn step(&mut self, now: Instant, reading: bool) -> Result<(), LinkLoss> {
        if let State::Connecting {
            stream,
            addr,
            since,
            reported,
        } = &mut self.state
        {
            if !*reported {
                return match self.connect_timeout {
                    Some(t) if now >= *since + t => Err(LinkLoss::ConnectTimeout(t)),
                    _ => Ok(()),
                };
            }
            *reported = false;
            match sockio::connect_done(stream, *addr) {
                Err(reason) => return Err(reason),
                Ok(false) => {
                    return match self.connect_timeout {
                        Some(t) if now >= *since + t => Err(LinkLoss::ConnectTimeout(t)),
                        _ => Ok(()),
                    }
                }
                Ok(true) => {
                    let State::Connecting { stream, addr, .. } =
                        std::mem::replace(&mut self.state, State::Idle)
                    else {
                        return Ok(());
                    };
                    self.session = None;
                    self.dialed_ip = Some(addr.ip().to_canonical());
                    self.awaiting_offer = self.tls.is_some();
                    self.conn.connected(now);
                    debug!(
                        role = self.conn.role().socket_type,
                        wants_tls = self.awaiting_offer,
                        "connected"
                    );
                    self.state = State::Open {
                        stream,
                        readable: true,
                        writable: true,
                    };
                }
            }
        }
        let State::Open {
            stream,
            readable,
            writable,
        } = &mut self.state
        else {
            return Ok(());
        };
        if self.awaiting_offer {
            if !(reading && *readable) {
                return self.conn.handle_timeout(now).map_err(loss_of);
            }
            let mut signature = [0u8; zmtp::SIGNATURE_LEN];
            if sockio::peek_up_to(stream, &mut signature)? < signature.len() {
                // The rest comes with a later readiness (or the handshake timeout ends it).
                *readable = false;
                return self.conn.handle_timeout(now).map_err(loss_of);
            }
            self.awaiting_offer = false;
            let Some(tls) = &self.tls else {
                return Ok(());
            };
            if signature == zmtp::TLS_OFFER {
                sockio::discard_peeked(stream, signature.len())?;
                let Some(dialed) = self.dialed_ip else {
                    return Ok(());
                };
                // The peer's certificate must name the address dialed.
                let name = rustls_pki_types::ServerName::IpAddress(dialed.into());
                let session = rustls::ClientConnection::new(tls.config.clone(), name)
                    .map_err(|e| LinkLoss::Tls(e.to_string().into()))?;
                self.session = Some(rustls::Connection::Client(session));
            } else if !tls.fall_back {
                return Err(LinkLoss::Tls(
                    "the peer speaks no TLS (its first bytes were no kvpeer TLS offer: a ZMTP peer without TLS, such as vLLM), and TLS is required here".into(),
                ));
            } else {
                // A plaintext greeting (or bytes that are none: the connection's decoder
                // refuses them as from any peer) is read as it is.
                self.fell_back = true;
            }
        }
        if reading && *readable && !self.conn.holds_input() {
            let conn = &mut self.conn;
            let end =
                sockio::read_while(stream, self.session.as_mut(), self.read_budget, |bytes| {
                    conn.handle_bytes(bytes, now).map_err(loss_of)?;
                    Ok(!conn.decoding_paused())
                })?;
            *readable = end == ReadEnd::More;
        } else if self.conn.holds_input() {
            self.conn.decode_held(now).map_err(loss_of)?;
        }
        let waited = self.conn.ping_unanswered();
        match self.conn.handle_timeout(now) {
            Err(ConnError::ProbeUnanswered(timeout)) => {
                // The process sent nothing in time; the host may still be up: its kernel sent
                // us a segment (an ACK of the probe's PING, or of what was in flight) since the
                // probe began. Then the host is alive and the heartbeat judges the process.
                if !host_answered(&self.conn, self.ping_segments_in, stream) {
                    return Err(LinkLoss::ProbeUnanswered(timeout));
                }
                self.conn.probe_answered_by_host();
                let waited = self.conn.ping_unanswered();
                self.conn.handle_timeout(now).map_err(loss_of)?;
                note_ping(&self.conn, &mut self.ping_segments_in, stream, waited);
            }
            other => {
                other.map_err(loss_of)?;
                note_ping(&self.conn, &mut self.ping_segments_in, stream, waited);
            }
        }
        if *writable && !self.awaiting_offer {
            let wrote = sockio::write_up_to(
                stream,
                self.session.as_mut(),
                &mut self.conn,
                self.write_limit,
            )?;
            *writable = !wrote.blocked;
            self.last_written = self.last_written.saturating_add(wrote.bytes);
        }
        Ok(())
    }

    /// The next thing the peer sent (a role that keeps messages), in order.
    pub(crate) fn poll_incoming(&mut self) -> Option<crate::zmtp::connection::Incoming> {
        self.conn.poll_incoming()
    }

    /// Queues one message and writes it at once when nothing waited before it and it is
    /// within the write limit (a larger one is written in the owner's turns: see
    /// [`Dialer::wants_write`]). A socket error is left for the next progress to report (the
    /// poll reports the socket again).
    pub(crate) fn send(&mut self, parts: &[&[u8]]) -> Result<(), QueueFull> {
        let idle = self.conn.transmit().is_empty();
        self.conn.queue(parts)?;
        let size: usize = parts.iter().map(|p| p.len()).sum();
        if idle && size <= self.write_limit {
            self.flush();
        }
        Ok(())
    }

    /// As [`Dialer::send`], for one frame whose body `write_body` appends straight into the
    /// queue ([`Connection::queue_with`]).
    pub(crate) fn send_with<E>(
        &mut self,
        body_hint: usize,
        write_body: impl FnOnce(&mut Vec<u8>) -> Result<(), E>,
    ) -> Result<(), QueueWithError<E>> {
        let idle = self.conn.transmit().is_empty();
        let size = self.conn.queue_with(body_hint, write_body)?;
        if idle && size <= self.write_limit {
            self.flush();
        }
        Ok(())
    }

    /// Asks a ready connection's peer to prove itself alive within `timeout`
    /// ([`Connection::probe`]), its PING written at once when nothing waits before it;
    /// `false` when the connection is not ready (nothing was asked).
    pub(crate) fn probe(&mut self, now: Instant, timeout: Duration) -> bool {
        if !self.is_ready() {
            return false;
        }
        let idle = self.conn.transmit().is_empty();
        let probed = self.conn.probe(now, timeout);
        if self.conn.probing().is_some_and(|p| p.started == now) {
            // A new probe (with a PING of its own): what the host sends from here answers it.
            self.ping_segments_in = match &self.state {
                State::Open { stream, .. } => sockio::segments_in(stream),
                _ => None,
            };
        }
        if idle {
            self.flush();
        }
        probed
    }

    /// Writes what waits, if the socket takes it.
    pub(crate) fn flush(&mut self) {
        if let State::Open {
            stream, writable, ..
        } = &mut self.state
        {
            if *writable && !self.awaiting_offer {
                match sockio::write_up_to(
                    stream,
                    self.session.as_mut(),
                    &mut self.conn,
                    self.write_limit,
                ) {
                    Ok(wrote) => {
                        *writable = !wrote.blocked;
                        self.last_written = self.last_written.saturating_add(wrote.bytes);
                    }
                    // Reported by the next progress: a failed socket is readable at once.
                    Err(_) => *writable = false,
                }
            }
        }
    }
}
