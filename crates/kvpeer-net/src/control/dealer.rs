//! The connecting side of one control connection: a ZMTP 3.1 DEALER as a state machine, without
//! I/O (quinn-proto style: bytes and time in, bytes and deadlines out). It is a
//! [`Connection`] in the control DEALER's [`Role`], with the control channel's settings and
//! errors.
//!
//! What it speaks, as libzmq 4.3's DEALER with vLLM's settings does:
//!
//! * On [`Dealer::connected`] our greeting (ZMTP 3.1, NULL, not as-server) and our READY
//!   (`Socket-Type: DEALER`, `Identity: <our identity>`) are queued at once, in one write.
//! * The peer's greeting may be any major version from 3 on (3.0 and 3.1 frame alike); an older
//!   version, a foreign signature or another mechanism is refused ([`ZmtpError`]) as soon as the
//!   bytes show it. Its READY must say `Socket-Type: ROUTER` ([`DealerError::SocketType`]).
//! * Messages (one frame each, short up to 255 bytes, long beyond) are queued from the start but
//!   leave only after the peer's READY was checked, in order. At most `send_queue` messages wait
//!   unwritten (held before the handshake, or not yet taken by the socket); one more is
//!   [`QueueFull`], as libzmq's `SNDHWM` refuses it.
//! * Heartbeats, libzmq's rules: once READY, a PING (carrying our `heartbeat_ttl`) every
//!   `heartbeat_interval`; a PING unanswered by any byte within `heartbeat_timeout` ends the
//!   connection, and so does silence past the TTL the peer's own PING announced. A PING of the
//!   peer gets a PONG with its context, one PONG unwritten at a time (as libzmq: a peer that
//!   PINGs and never reads cannot grow our buffer). The handshake must finish within
//!   `handshake_timeout` of the TCP connection (libzmq's `ZMQ_HANDSHAKE_IVL`, 30 s).
//! * Messages the peer sends are decoded under `max_message_bytes` (checked from the frame
//!   header, before anything is kept) and dropped without being buffered: libzmq's DEALERs
//!   were never read either. Memory per connection is one command (64 KiB) plus what one read
//!   brings.
//!
//! The caller (`outbound.rs`) writes [`Dealer::transmit`] to the socket and reports how much
//! went with [`Dealer::advance`], feeds what it reads to [`Dealer::handle_bytes`], and calls
//! [`Dealer::handle_timeout`] at [`Dealer::poll_timeout`]. Any error ends the connection.

use std::time::{Duration, Instant};

pub use crate::zmtp::connection::QueueFull;
use crate::zmtp::connection::{ConnError, ConnLimits, Connection, Role};
use crate::zmtp::ZmtpError;
#[cfg(test)]
use crate::zmtp::{self, Decoder, Input};

/// Settings of one DEALER connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DealerLimits {
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
    /// Bytes that may wait unwritten (one message over it is still taken when nothing waits):
    /// a peer that answers heartbeats but never reads what we send costs at most this much.
    pub send_queue_bytes: usize,
}

impl From<DealerLimits> for ConnLimits {
    fn from(l: DealerLimits) -> Self {
        ConnLimits {
            max_message_bytes: l.max_message_bytes,
            heartbeat_interval: l.heartbeat_interval,
            heartbeat_timeout: l.heartbeat_timeout,
            heartbeat_ttl: l.heartbeat_ttl,
            handshake_timeout: l.handshake_timeout,
            send_queue: l.send_queue,
            send_queue_bytes: l.send_queue_bytes,
            // A DEALER of the control channel keeps nothing it reads.
            max_incoming: usize::MAX,
        }
    }
}

/// Why a DEALER connection ended.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DealerError {
    /// The peer's bytes are not ZMTP this side speaks.
    #[error(transparent)]
    Zmtp(#[from] ZmtpError),
    /// The peer's READY names another socket type than ROUTER.
    #[error("the peer is a {0:?} socket, not a ROUTER")]
    SocketType(String),
    /// No READY within the handshake timeout.
    #[error("handshake not done within {0:?}")]
    HandshakeTimeout(Duration),
    /// Our PING got no answer.
    #[error("no answer to our heartbeat within {0:?}")]
    HeartbeatTimeout(Duration),
    /// The peer fell silent past the TTL its own PING announced.
    #[error("the peer fell silent past its heartbeat TTL of {0:?}")]
    TtlExpired(Duration),
}

impl From<ConnError> for DealerError {
    fn from(e: ConnError) -> Self {
        match e {
            ConnError::Zmtp(e) => DealerError::Zmtp(e),
            ConnError::PeerType { got, .. } => DealerError::SocketType(got),
            ConnError::HandshakeTimeout(d) => DealerError::HandshakeTimeout(d),
            ConnError::HeartbeatTimeout(d) => DealerError::HeartbeatTimeout(d),
            ConnError::TtlExpired(d) => DealerError::TtlExpired(d),
        }
    }
}

/// One DEALER connection's protocol state.
#[derive(Debug)]
pub struct Dealer(Connection);

impl Dealer {
    /// A DEALER that will introduce itself as `identity`. Messages may be queued at once.
    pub fn new(identity: &[u8], limits: DealerLimits) -> Self {
        Dealer(Connection::new(
            Role::control_dealer(identity),
            limits.into(),
        ))
    }

    /// TCP is connected at `now`: the handshake's clock starts.
    pub fn connected(&mut self, now: Instant) {
        self.0.connected(now);
    }

    /// Whether the peer's READY arrived and was accepted.
    pub fn is_ready(&self) -> bool {
        self.0.is_ready()
    }

    /// The challenge the peer's READY gave (a kvpeer ROUTER's), once READY.
    pub fn peer_challenge(&self) -> Option<&[u8]> {
        self.0.peer_challenge()
    }

    /// Messages queued and not yet wholly written.
    pub fn queued(&self) -> usize {
        self.0.queued()
    }

    /// Whether every queued message was written (commands may still wait).
    pub fn is_drained(&self) -> bool {
        self.0.is_drained()
    }

    /// Messages the peer sent, dropped.
    pub fn dropped(&self) -> u64 {
        self.0.dropped()
    }

    /// Bytes received and not yet decoded (at most a frame header and one command).
    pub fn pending(&self) -> usize {
        self.0.pending()
    }

    /// Bytes this connection holds (to write, and received not yet decoded).
    pub fn buffered(&self) -> usize {
        self.0.buffered()
    }

    /// Queues one message (one frame).
    pub fn queue(&mut self, payload: &[u8]) -> Result<(), QueueFull> {
        self.0.queue(&[payload])
    }

    /// Bytes to write now.
    pub fn transmit(&self) -> &[u8] {
        self.0.transmit()
    }

    /// `n` bytes of [`Dealer::transmit`] were written.
    pub fn advance(&mut self, n: usize) {
        self.0.advance(n);
    }

    /// Bytes read from the connection at `now`.
    pub fn handle_bytes(&mut self, bytes: &[u8], now: Instant) -> Result<(), DealerError> {
        Ok(self.0.handle_bytes(bytes, now)?)
    }

    /// Runs the deadlines due at `now` (a PING may be queued).
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), DealerError> {
        Ok(self.0.handle_timeout(now)?)
    }

    /// When [`Dealer::handle_timeout`] has something to do next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.0.poll_timeout()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn limits() -> DealerLimits {
        DealerLimits {
            max_message_bytes: 1 << 20,
            heartbeat_interval: Duration::from_secs(2),
            heartbeat_timeout: Duration::from_secs(10),
            heartbeat_ttl: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(30),
            send_queue: 4,
            send_queue_bytes: usize::MAX,
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
    fn drain(d: &mut Dealer) -> Vec<u8> {
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
        let mut d = Dealer::new(b"127.0.0.1:5600", limits());
        d.queue(b"early").unwrap();
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
        d.queue(&long).unwrap();
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
            let mut d = Dealer::new(b"a:1", limits());
            d.handle_bytes(&router_hello(minor), Instant::now())
                .unwrap();
            assert!(d.is_ready(), "3.{minor}");
        }
        // ZMTP 2.0 (revision 1): refused from its 11th byte, without waiting for 64.
        let mut d = Dealer::new(b"a:1", limits());
        let v2 = [0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 1, 5];
        let e = d.handle_bytes(&v2, Instant::now()).unwrap_err();
        assert_eq!(e, DealerError::Zmtp(ZmtpError::Version(1)));
        assert_eq!(
            e.to_string(),
            "the peer speaks an older ZMTP (version byte 1; ZMTP 2.0 sends 1): ZMTP 3.0 or later \
             is required"
        );
        // Not ZMTP at all.
        let mut d = Dealer::new(b"a:1", limits());
        let e = d.handle_bytes(b"HTTP/1.1 200 OK\r\n", Instant::now());
        assert!(
            matches!(e, Err(DealerError::Zmtp(ZmtpError::Signature(_)))),
            "{e:?}"
        );
    }

    #[test]
    fn a_peer_that_is_not_a_router_is_refused() {
        let mut d = Dealer::new(b"a:1", limits());
        let mut peer = zmtp::greeting().to_vec();
        peer.extend(zmtp::ready("PUB"));
        let e = d.handle_bytes(&peer, Instant::now()).unwrap_err();
        assert_eq!(e, DealerError::SocketType("PUB".into()));
        assert_eq!(e.to_string(), "the peer is a \"PUB\" socket, not a ROUTER");
        assert!(!d.is_ready());
    }

    #[test]
    fn the_send_queue_counts_messages_not_yet_written() {
        let mut d = Dealer::new(b"a:1", limits());
        for i in 0..4u8 {
            d.queue(&[i]).unwrap();
        }
        assert_eq!(d.queue(b"five"), Err(QueueFull));
        d.connected(Instant::now());
        d.handle_bytes(&router_hello(1), Instant::now()).unwrap();
        // Half of everything written: the greeting, READY and the first messages went.
        let n = d.transmit().len();
        let whole = n - 2 * 3; // the last two frames (3 bytes each) stay unwritten
        d.advance(whole);
        assert_eq!(d.queued(), 2);
        d.queue(b"again").unwrap();
        d.queue(b"more").unwrap();
        assert_eq!(d.queue(b"over"), Err(QueueFull));
        d.advance(1); // part of a frame: still queued
        assert_eq!(d.queued(), 4);
        drain(&mut d);
        assert!(d.is_drained());
    }

    #[test]
    fn heartbeats_follow_libzmqs_rules() {
        let t = Instant::now();
        let s = Duration::from_secs;
        let mut d = Dealer::new(b"a:1", limits());
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
            Err(DealerError::HeartbeatTimeout(s(10)))
        );
        // Answered (any byte does): the timeout is off until the next PING.
        let mut d = Dealer::new(b"a:1", limits());
        d.connected(t);
        d.handle_bytes(&router_hello(1), t).unwrap();
        d.handle_timeout(t + s(2)).unwrap();
        d.handle_bytes(&zmtp::pong(b""), t + s(3)).unwrap();
        d.handle_timeout(t + s(12)).unwrap();
        // The peer's PING: a PONG with its context, and its TTL watched.
        let mut d = Dealer::new(b"a:1", limits());
        d.connected(t);
        d.handle_bytes(&router_hello(1), t).unwrap();
        drain(&mut d);
        let mut ping = zmtp::ping(30).to_vec();
        // PING with a context: the command's size byte grows by its length.
        ping[1] += 3;
        ping.extend_from_slice(b"ctx");
        d.handle_bytes(&ping, t + s(1)).unwrap();
        assert_eq!(drain(&mut d), zmtp::pong(b"ctx"));
        assert_eq!(
            d.handle_timeout(t + s(4)),
            Err(DealerError::TtlExpired(s(3)))
        );
    }

    #[test]
    fn a_peer_that_pings_and_never_reads_gets_one_pong_pending_at_a_time() {
        let t = Instant::now();
        let mut d = Dealer::new(b"a:1", limits());
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
        let mut d = Dealer::new(b"a:1", limits());
        d.handle_timeout(t + Duration::from_secs(3600)).unwrap();
        assert_eq!(d.poll_timeout(), None, "no clock before TCP connects");
        d.connected(t);
        d.handle_bytes(&zmtp::greeting(), t).unwrap();
        d.handle_timeout(t + Duration::from_secs(29)).unwrap();
        assert_eq!(
            d.handle_timeout(t + Duration::from_secs(30)),
            Err(DealerError::HandshakeTimeout(Duration::from_secs(30)))
        );
    }

    #[test]
    fn messages_from_the_router_are_dropped_unbuffered_and_a_huge_frame_refused() {
        let t = Instant::now();
        let mut d = Dealer::new(b"a:1", limits());
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
            DealerError::Zmtp(ZmtpError::TooLarge {
                size: 1 << 40,
                limit: 1 << 20
            })
        );
    }
}
