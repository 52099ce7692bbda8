//! The control channel's outbound side (kvpeer's own ZMTP DEALER) against scripted ROUTERs
//! speaking raw bytes over loopback TCP, as h2's tests script a mock peer: greetings of the
//! versions libzmq sends (and older ones, refused), heartbeats both ways, connects refused and
//! retried, a full send queue, a hostile 1 TiB frame header, lingering closes.
//!
//! The scripted ROUTER parses what kvpeer sends with its own few lines (below), not with
//! kvpeer's codec, so the two cannot agree on a mistake.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpeer_core::{LinkLoss, SendFailure};
use kvpeer_net::control::{ChannelEvent, ControlChannel, ControlConfig, SendError};
use kvpeer_net::zmtp::connection::ConnError;
use kvpeer_proto::PeerId;

mod fd_support;

fn free_id() -> PeerId {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    PeerId::new(format!("127.0.0.1:{}", l.local_addr().unwrap().port()))
}

fn channel_with(config: ControlConfig) -> ControlChannel {
    ControlChannel::bind(free_id(), config).unwrap()
}

fn channel() -> ControlChannel {
    channel_with(ControlConfig::default())
}

/// A listener for a scripted ROUTER, and the identity to dial it by.
fn router_listener() -> (TcpListener, PeerId) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let id = PeerId::new(l.local_addr().unwrap().to_string());
    (l, id)
}

/// One accepted connection, spoken to byte by byte.
struct Router {
    s: TcpStream,
}

const COMMAND: u8 = 0x04;
const LONG: u8 = 0x02;

impl Router {
    fn accept(l: &TcpListener) -> Router {
        let (s, _) = l.accept().unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        Router { s }
    }

    /// A ZMTP greeting with this version, NULL, as-server.
    fn greeting(major: u8, minor: u8) -> Vec<u8> {
        let mut g = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, major, minor];
        g.extend_from_slice(b"NULL");
        g.resize(32, 0);
        g.push(1);
        g.resize(64, 0);
        g
    }

    fn command(name: &str, data: &[u8]) -> Vec<u8> {
        let mut body = vec![name.len() as u8];
        body.extend_from_slice(name.as_bytes());
        body.extend_from_slice(data);
        let mut frame = vec![COMMAND, body.len() as u8];
        frame.extend(body);
        frame
    }

    fn ready(socket_type: &str) -> Vec<u8> {
        let mut data = vec![11];
        data.extend_from_slice(b"Socket-Type");
        data.extend_from_slice(&(socket_type.len() as u32).to_be_bytes());
        data.extend_from_slice(socket_type.as_bytes());
        Router::command("READY", &data)
    }

    fn write(&mut self, bytes: &[u8]) {
        self.s.write_all(bytes).unwrap();
    }

    /// Reads the DEALER's greeting; returns its version bytes.
    fn read_greeting(&mut self) -> (u8, u8) {
        let mut g = [0u8; 64];
        self.s.read_exact(&mut g).unwrap();
        assert_eq!((g[0], g[9]), (0xff, 0x7f), "signature");
        assert_eq!(&g[12..17], b"NULL\0", "mechanism");
        assert_eq!(g[32], 0, "a DEALER is not as-server");
        (g[10], g[11])
    }

    /// One frame: (flags, body).
    fn read_frame(&mut self) -> (u8, Vec<u8>) {
        let mut flags = [0u8; 1];
        self.s.read_exact(&mut flags).unwrap();
        let size = if flags[0] & LONG != 0 {
            let mut n = [0u8; 8];
            self.s.read_exact(&mut n).unwrap();
            u64::from_be_bytes(n) as usize
        } else {
            let mut n = [0u8; 1];
            self.s.read_exact(&mut n).unwrap();
            n[0] as usize
        };
        let mut body = vec![0u8; size];
        self.s.read_exact(&mut body).unwrap();
        (flags[0], body)
    }

    /// The DEALER's READY properties, in order.
    fn read_ready(&mut self) -> Vec<(String, Vec<u8>)> {
        let (flags, body) = self.read_frame();
        assert_eq!(flags, COMMAND);
        assert_eq!(&body[..6], b"\x05READY");
        let mut props = Vec::new();
        let mut p = &body[6..];
        while let Some((&n, rest)) = p.split_first() {
            let name = String::from_utf8(rest[..n as usize].to_vec()).unwrap();
            let rest = &rest[n as usize..];
            let len = u32::from_be_bytes(rest[..4].try_into().unwrap()) as usize;
            props.push((name, rest[4..4 + len].to_vec()));
            p = &rest[4 + len..];
        }
        props
    }

    /// Greeting and READY both ways (the ROUTER's version as given); returns the DEALER's
    /// READY properties.
    fn handshake(&mut self, major: u8, minor: u8) -> Vec<(String, Vec<u8>)> {
        self.write(&Router::greeting(major, minor));
        self.write(&Router::ready("ROUTER"));
        assert_eq!(self.read_greeting(), (3, 1), "kvpeer speaks ZMTP 3.1");
        self.read_ready()
    }

    /// The next message (one frame), skipping commands (PINGs).
    fn read_message(&mut self) -> Vec<u8> {
        loop {
            let (flags, body) = self.read_frame();
            if flags & COMMAND == 0 {
                assert_eq!(flags & 0x01, 0, "one frame per message");
                return body;
            }
        }
    }

    /// Whether the connection was closed by the other side (reading whatever comes first).
    fn closed(&mut self) -> bool {
        let mut b = [0u8; 4096];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => {
                    return matches!(
                        e.kind(),
                        std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
                    )
                }
            }
        }
    }
}

/// Drives the channels (the first one's events collected) until `done` says so or `limit`
/// passes; returns the events.
fn drive(
    chs: &mut [&mut ControlChannel],
    limit: Duration,
    mut done: impl FnMut(&[ChannelEvent]) -> bool,
) -> Vec<ChannelEvent> {
    let deadline = Instant::now() + limit;
    let mut events = Vec::new();
    while Instant::now() < deadline {
        chs[0].wait(Duration::from_millis(5)).unwrap();
        events.extend(chs[0].recv());
        for other in chs[1..].iter_mut() {
            other.recv();
        }
        if done(&events) {
            break;
        }
    }
    events
}

/// Drives `ch` until the scripted peer's thread ends; returns its result and the events.
fn drive_until<T>(ch: &mut ControlChannel, peer: JoinHandle<T>) -> (T, Vec<ChannelEvent>) {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut events = Vec::new();
    while !peer.is_finished() {
        assert!(
            Instant::now() < deadline,
            "the scripted peer did not finish"
        );
        ch.wait(Duration::from_millis(5)).unwrap();
        events.extend(ch.recv());
    }
    (peer.join().unwrap(), events)
}

/// How the connection to `peer` was lost, as its cause's text.
fn lost_reason(events: &[ChannelEvent], peer: &PeerId) -> Option<String> {
    lost_cause(events, peer).map(|c| c.to_string())
}

fn lost_cause(events: &[ChannelEvent], peer: &PeerId) -> Option<LinkLoss> {
    events.iter().find_map(|e| match e {
        ChannelEvent::Lost { peer: p, cause } if p == peer => Some(cause.clone()),
        _ => None,
    })
}

#[test]
fn routers_greeting_with_zmtp_3_0_or_3_1_get_the_identity_and_exact_messages() {
    for minor in [0u8, 1] {
        let mut a = channel();
        let ida = a.identity().clone();
        let (listener, router) = router_listener();
        let long: Vec<u8> = (0..300u32).map(|i| (i * 13) as u8).collect();
        // Queued before the ROUTER accepts: they leave once its READY was checked.
        a.send(&router, b"short").unwrap();
        a.send(&router, &long).unwrap();
        let peer = std::thread::spawn(move || {
            let mut r = Router::accept(&listener);
            let props = r.handshake(3, minor);
            // The connection is handed back, still open.
            (props, r.read_message(), r.read_message(), r)
        });
        let ((props, first, second, _open), events) = drive_until(&mut a, peer);
        assert_eq!(
            props,
            vec![
                ("Socket-Type".to_string(), b"DEALER".to_vec()),
                ("Identity".to_string(), ida.as_str().as_bytes().to_vec())
            ],
            "3.{minor}"
        );
        assert_eq!(first, b"short");
        assert_eq!(second, long, "a long frame (over 255 bytes), byte-exact");
        assert!(events.is_empty(), "3.{minor}: {events:?}");
    }
}

#[test]
fn older_zmtp_foreign_bytes_and_other_socket_types_are_refused_with_a_precise_reason() {
    let zmtp_2 = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 1, 5];
    let mut pub_socket = Router::greeting(3, 1);
    pub_socket.extend(Router::ready("PUB"));
    let cases: [(&str, Vec<u8>, &str); 3] = [
        (
            "ZMTP 2.0",
            zmtp_2,
            "the peer speaks an older ZMTP (version byte 1",
        ),
        (
            "HTTP",
            b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec(),
            "not a ZMTP greeting",
        ),
        ("a PUB socket", pub_socket, "not a ROUTER"),
    ];
    for (what, bytes, reason) in cases {
        let mut a = channel();
        let (listener, router) = router_listener();
        a.send(&router, b"never delivered").unwrap();
        let peer = std::thread::spawn(move || {
            let mut r = Router::accept(&listener);
            r.write(&bytes);
            r.closed()
        });
        let (closed, events) = drive_until(&mut a, peer);
        assert!(closed, "{what}: the connection is dropped");
        let cause = lost_cause(&events, &router).unwrap_or_else(|| panic!("{what}: {events:?}"));
        let got = cause.to_string();
        assert!(got.contains(reason), "{what}: {got}");
        // The cause is typed down to the connection's own error, not only its words.
        let LinkLoss::NotZmtp(inner) = &cause else {
            panic!("{what}: {cause:?}")
        };
        assert!(
            inner.downcast_ref::<ConnError>().is_some(),
            "{what}: {inner:?}"
        );
        assert!(!a.connected(&router));
    }
}

#[test]
fn a_router_that_falls_silent_is_lost_after_the_heartbeat_timeout_and_got_our_pings() {
    let config = ControlConfig {
        heartbeat_interval: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_millis(400),
        heartbeat_ttl: Duration::from_secs(1),
        ..ControlConfig::default()
    };
    let mut a = channel_with(config);
    let (listener, router) = router_listener();
    a.send(&router, b"hello").unwrap();
    let (tx, handshaken) = std::sync::mpsc::channel();
    let peer = std::thread::spawn(move || {
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"hello");
        tx.send(Instant::now()).unwrap();
        // Silent from now on: it reads (the PINGs) and never answers.
        let mut pings = Vec::new();
        loop {
            let mut flags = [0u8; 1];
            if r.s.read_exact(&mut flags).is_err() {
                return pings;
            }
            let mut n = [0u8; 1];
            r.s.read_exact(&mut n).unwrap();
            let mut body = vec![0u8; n[0] as usize];
            r.s.read_exact(&mut body).unwrap();
            assert_eq!(flags[0], COMMAND);
            pings.push(body);
        }
    });
    let events = drive(&mut [&mut a], Duration::from_secs(5), |e| {
        lost_reason(e, &router).is_some()
    });
    let lost_at = Instant::now();
    let reason = lost_reason(&events, &router).expect("lost");
    assert!(
        matches!(lost_cause(&events, &router), Some(LinkLoss::Silent(_))),
        "{reason}"
    );
    assert!(reason.contains("no heartbeat answer"), "{reason}");
    let silent_since = handshaken.recv().unwrap();
    let after = lost_at - silent_since;
    assert!(
        after >= Duration::from_millis(400) && after < Duration::from_millis(1500),
        "lost {after:?} after the peer fell silent (interval 100 ms + timeout 400 ms)"
    );
    let pings = peer.join().unwrap();
    assert!(!pings.is_empty(), "the silent peer was pinged");
    // PING: name, then the TTL in deciseconds (1 s = 10), no context.
    assert!(pings.iter().all(|p| p == b"\x04PING\x00\x0a"), "{pings:?}");
}

#[test]
fn a_routers_ping_gets_a_pong_with_its_context() {
    let mut a = channel();
    let (listener, router) = router_listener();
    a.send(&router, b"hello").unwrap();
    let peer = std::thread::spawn(move || {
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"hello");
        // TTL 10 s, context "ctx-42", as libzmq's ROUTER sends it.
        let mut ping = vec![0, 100];
        ping.extend_from_slice(b"ctx-42");
        r.write(&Router::command("PING", &ping));
        loop {
            let (flags, body) = r.read_frame();
            if flags == COMMAND && body.starts_with(b"\x04PONG") {
                return (body, r);
            }
        }
    });
    let ((pong, _open), events) = drive_until(&mut a, peer);
    assert_eq!(pong, b"\x04PONGctx-42");
    assert!(events.is_empty(), "{events:?}");
    assert!(a.connected(&router));
}

/// libzmq's monitor reported a refused connect as CLOSED, which the channel always took as a
/// lost connection (the core then answers the peer's lookups MISS at once): kept. The next
/// send dials afresh and reaches the peer once it listens.
#[test]
fn a_refused_connect_is_lost_and_the_next_send_reaches_the_peer_once_it_listens() {
    let mut a = channel();
    let ida = a.identity().clone();
    let gone = free_id();
    a.send(&gone, b"first").unwrap();
    assert!(a.connected(&gone), "dial never blocks nor fails at once");
    let events = drive(&mut [&mut a], Duration::from_secs(5), |e| {
        lost_reason(e, &gone).is_some()
    });
    let reason = lost_reason(&events, &gone).expect("a refused connect is lost");
    assert!(
        matches!(
            lost_cause(&events, &gone),
            Some(LinkLoss::NothingListens(_))
        ),
        "{reason}"
    );
    assert!(reason.contains("nothing listens at 127.0.0.1:"), "{reason}");
    assert!(!a.connected(&gone));
    // The peer comes up at that address.
    let mut b = ControlChannel::bind(gone.clone(), ControlConfig::default()).unwrap();
    a.send(&gone, b"second").unwrap();
    let got = drive(&mut [&mut b, &mut a], Duration::from_secs(10), |e| {
        e.iter().any(|e| matches!(e, ChannelEvent::Payload { .. }))
    });
    let payloads: Vec<_> = got
        .iter()
        .filter_map(|e| match e {
            ChannelEvent::Payload { peer, payload, .. } => Some((peer.clone(), payload.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(payloads, vec![(ida, b"second".to_vec())]);
}

/// Out of descriptors no socket can be made: libzmq retried on its reconnect timer without a
/// monitor event, and so does the channel (every 100 ms); the queued message leaves once
/// descriptors are back.
#[test]
fn out_of_descriptors_a_dial_retries_quietly_and_delivers_when_they_are_back() {
    if !fd_support::run_alone(
        "out_of_descriptors_a_dial_retries_quietly_and_delivers_when_they_are_back",
    ) {
        return;
    }
    let (mut a, mut b) = (channel(), channel());
    let (ida, idb) = (a.identity().clone(), b.identity().clone());
    let exhausted = fd_support::Exhaustion::leaving(0);
    a.send(&idb, b"queued").unwrap();
    let (start, mut wakes) = (Instant::now(), 0u32);
    while start.elapsed() < Duration::from_millis(400) {
        if a.wait(Duration::from_millis(500)).unwrap() {
            wakes += 1;
        }
        assert!(a.recv().is_empty(), "no loss reported while retrying");
    }
    assert!(a.connected(&idb));
    drop(exhausted);
    assert!(
        wakes <= 20,
        "woke {wakes} times in 0.4 s: retries every 100 ms, no spin"
    );
    let got = drive(&mut [&mut b, &mut a], Duration::from_secs(10), |e| {
        e.iter().any(|e| matches!(e, ChannelEvent::Payload { .. }))
    });
    assert!(
        got.iter().any(|e| matches!(e, ChannelEvent::Payload { peer, payload, .. } if *peer == ida && payload == b"queued")),
        "{got:?}"
    );
}

/// A peer that accepts TCP but never finishes its handshake holds every message: the 1001st
/// send finds the queue full (libzmq's SNDHWM), is lost, and the connection closes; never
/// ready, its messages linger up to 5 s (not the 500 ms of a ready connection) and then it is
/// gone, without blocking.
#[test]
fn a_full_send_queue_is_lost_and_the_connection_closes_after_its_linger() {
    let mut a = channel();
    // Listening, never accepting: the kernel completes TCP, nobody speaks ZMTP.
    let (_listener, mute) = router_listener();
    for i in 0..1000u32 {
        a.send(&mute, &i.to_be_bytes()).unwrap();
    }
    let t = Instant::now();
    let e = a.send(&mute, b"one too many").unwrap_err();
    assert!(
        t.elapsed() < Duration::from_millis(50),
        "a send never blocks"
    );
    let SendError::Lost { peer, cause } = e else {
        unreachable!()
    };
    assert_eq!(
        (peer, cause),
        (mute.clone(), LinkLoss::SendFailed(SendFailure::QueueFull))
    );
    assert!(!a.connected(&mute));
    assert_eq!(a.outbound_connections(), 1, "it lingers");
    let events = drive(&mut [&mut a], Duration::from_secs(3), |_| false);
    assert!(events.is_empty(), "a closed connection reports nothing");
    assert_eq!(
        a.outbound_connections(),
        1,
        "still in its handshake's linger"
    );
    let events = drive(&mut [&mut a], Duration::from_secs(3), |_| false);
    assert!(events.is_empty(), "a closed connection reports nothing");
    assert_eq!(
        a.outbound_connections(),
        0,
        "dropped at the linger deadline"
    );
}

/// A message sent on a connection just dialed and closed at once (a refusal's `disconnect`
/// to a peer this node will not have) still arrives when the peer's ROUTER takes longer than
/// the 500 ms linger to answer: a connection never ready lingers for its handshake.
#[test]
fn a_message_closed_behind_a_slow_handshake_still_arrives() {
    let mut a = channel();
    let (listener, router) = router_listener();
    a.send(&router, b"disconnect").unwrap();
    a.close(&router);
    let peer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(1500));
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        r.read_message()
    });
    let (got, events) = drive_until(&mut a, peer);
    assert_eq!(got, b"disconnect");
    assert!(
        events.is_empty(),
        "a closed connection reports nothing: {events:?}"
    );
}

/// A peer that finished its handshake but never reads what we send (it answers nothing, and
/// TCP's window closes) makes us buffer at most `send_queue_bytes`: the send past it fails,
/// the connection closes, and a peer that reads is served byte-exact meanwhile.
#[test]
fn a_peer_that_never_reads_costs_at_most_the_queues_bytes() {
    let cap = 4 << 20;
    let mut a = channel_with(ControlConfig {
        send_queue_bytes: cap,
        ..ControlConfig::default()
    });
    let (listener, mute) = router_listener();
    let (honest_listener, honest) = router_listener();
    let reader = std::thread::spawn(move || {
        let mut r = Router::accept(&honest_listener);
        r.handshake(3, 1);
        (0..3).map(|_| r.read_message()).collect::<Vec<_>>()
    });
    let payload = vec![0x5au8; 256 * 1024];
    a.send(&mute, &payload).unwrap();
    // The mute peer completes its handshake and then reads nothing.
    let mute_peer = std::thread::spawn(move || {
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        r
    });
    let (r, _) = drive_until(&mut a, mute_peer);
    let mut sent = 1usize;
    let failed = loop {
        drive(&mut [&mut a], Duration::from_millis(5), |_| false);
        match a.send(&mute, &payload) {
            Ok(()) => sent += 1,
            Err(e) => break e,
        }
        assert!(sent < 10_000, "the queue never filled ({sent} sent)");
    };
    let SendError::Lost { cause, .. } = failed else {
        unreachable!()
    };
    assert_eq!(cause, LinkLoss::SendFailed(SendFailure::QueueFull));
    // What the kernel took plus our queue: a few MiB, nowhere near what was offered.
    let offered = sent * payload.len();
    assert!(
        offered < cap + (32 << 20),
        "{offered} bytes taken before the queue filled (cap {cap})"
    );
    assert!(!a.connected(&mute));
    for i in 0..3u8 {
        a.send(&honest, &[i; 3]).unwrap();
    }
    let (got, _) = drive_until(&mut a, reader);
    assert_eq!(got, vec![vec![0u8; 3], vec![1u8; 3], vec![2u8; 3]]);
    drop(r);
}

#[test]
fn a_router_announcing_a_1_tib_frame_is_dropped_and_other_peers_are_served_byte_exact() {
    let mut a = channel();
    let mut b = channel();
    let (ida, idb) = (a.identity().clone(), b.identity().clone());
    let (listener, hostile) = router_listener();
    a.send(&hostile, b"hello").unwrap();
    let peer = std::thread::spawn(move || {
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"hello");
        let mut frame = vec![LONG];
        frame.extend_from_slice(&(1u64 << 40).to_be_bytes());
        frame.extend_from_slice(&[0u8; 1024]);
        let _ = r.s.write_all(&frame);
        r.closed()
    });
    let big: Vec<u8> = (0..(1u32 << 20)).map(|i| (i % 253) as u8).collect();
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !peer.is_finished() || lost_reason(&events, &hostile).is_none() {
        assert!(Instant::now() < deadline, "{events:?}");
        a.wait(Duration::from_millis(5)).unwrap();
        events.extend(a.recv());
        b.recv();
    }
    assert!(peer.join().unwrap(), "the hostile connection was dropped");
    let reason = lost_reason(&events, &hostile).expect("lost");
    assert!(
        reason.contains("frame of 1099511627776 bytes is over the 16777216-byte limit"),
        "{reason}"
    );
    // Everyone else is served, byte-exact.
    a.send(&idb, &big).unwrap();
    a.send(&idb, b"after").unwrap();
    events.clear();
    let got = drive(&mut [&mut b, &mut a], Duration::from_secs(10), |e| {
        e.iter()
            .any(|e| matches!(e, ChannelEvent::Payload { payload, .. } if payload == b"after"))
    });
    let payloads: Vec<&Vec<u8>> = got
        .iter()
        .filter_map(|e| match e {
            ChannelEvent::Payload { peer, payload, .. } if *peer == ida => Some(payload),
            _ => None,
        })
        .collect();
    assert_eq!(payloads, vec![&big, &b"after".to_vec()]);
}

/// A ROUTER sends our DEALER nothing but heartbeats (vLLM's DEALERs were never read): the
/// peer we answer, flooding it with commands and messages at full speed, is cut off once past a
/// burst of 1024 (it cannot make our thread decode what nobody reads); the cause names it, and
/// other peers are served byte-exact.
#[test]
fn a_router_flooding_our_dealer_is_cut_off_and_other_peers_are_served_byte_exact() {
    let mut a = channel();
    let mut b = channel();
    let (ida, idb) = (a.identity().clone(), b.identity().clone());
    let (listener, hostile) = router_listener();
    a.send(&hostile, b"hello").unwrap();
    let peer = std::thread::spawn(move || {
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"hello");
        // Unknown commands and one-frame messages, alternating, until the DEALER closes.
        let burst: Vec<u8> = (0..10_000)
            .flat_map(|_| [0x04u8, 1, 0x00, 0x00, 1, b'x'])
            .collect();
        r.s.set_write_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let _ = r.s.write_all(&burst);
        r.closed()
    });
    let mut events = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !peer.is_finished() || lost_reason(&events, &hostile).is_none() {
        assert!(Instant::now() < deadline, "{events:?}");
        a.wait(Duration::from_millis(5)).unwrap();
        events.extend(a.recv());
        b.recv();
    }
    assert!(peer.join().unwrap(), "the flooding connection was closed");
    let reason = lost_reason(&events, &hostile).expect("lost");
    assert!(
        reason.contains("more than 1024 messages or commands (one per started 64 KiB) at once"),
        "{reason}"
    );
    a.send(&idb, b"after").unwrap();
    let got = drive(&mut [&mut b, &mut a], Duration::from_secs(10), |e| {
        e.iter()
            .any(|e| matches!(e, ChannelEvent::Payload { payload, .. } if payload == b"after"))
    });
    assert!(got.iter().any(
        |e| matches!(e, ChannelEvent::Payload { peer, payload, .. } if *peer == ida && payload == b"after")
    ));
}

/// `close` returns at once; what was queued still leaves within the linger, and nothing is
/// reported. Dropping the channel does the same (blocking up to the linger, as
/// `zmq_ctx_term` did).
#[test]
fn closing_or_dropping_lingers_queued_messages_without_losing_them() {
    let mut a = channel();
    let (listener, router) = router_listener();
    a.send(&router, b"before close").unwrap();
    let t = Instant::now();
    a.close(&router);
    assert!(
        t.elapsed() < Duration::from_millis(20),
        "close never blocks"
    );
    assert!(!a.connected(&router));
    let peer = std::thread::spawn(move || {
        // A slow peer: it accepts 100 ms late.
        std::thread::sleep(Duration::from_millis(100));
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        let got = r.read_message();
        (got, r.closed(), listener)
    });
    let ((got, closed, listener), events) = drive_until(&mut a, peer);
    assert_eq!(got, b"before close");
    assert!(closed, "closed once its messages left");
    assert!(events.is_empty(), "{events:?}");
    assert_eq!(a.outbound_connections(), 0);
    // Dropped right after a send: the message still leaves.
    a.send(&router, b"before drop").unwrap();
    let peer = std::thread::spawn(move || {
        let mut r = Router::accept(&listener);
        r.handshake(3, 1);
        r.read_message()
    });
    let t = Instant::now();
    drop(a);
    assert!(
        t.elapsed() < Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(peer.join().unwrap(), b"before drop");
}

/// A peer's last message (its `disconnect`) is handed over before the loss of the connection
/// to it, though both may be seen in the same wake-up.
#[test]
fn a_peers_last_message_comes_before_its_loss() {
    let (mut a, mut b) = (channel(), channel());
    let (ida, idb) = (a.identity().clone(), b.identity().clone());
    a.send(&idb, b"hi").unwrap();
    b.send(&ida, b"hi back").unwrap();
    // Both connections up: each side has heard the other.
    let (mut heard_a, mut heard_b) = (false, false);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !(heard_a && heard_b) {
        assert!(Instant::now() < deadline, "no greetings both ways");
        a.wait(Duration::from_millis(5)).unwrap();
        heard_a |= !a.recv().is_empty();
        heard_b |= !b.recv().is_empty();
    }
    b.send(&ida, b"disconnect").unwrap();
    drop(b);
    let events = drive(&mut [&mut a], Duration::from_secs(10), |e| {
        lost_reason(e, &idb).is_some()
    });
    let at = |want: &dyn Fn(&ChannelEvent) -> bool| events.iter().position(want);
    let bye =
        at(&|e| matches!(e, ChannelEvent::Payload { payload, .. } if payload == b"disconnect"));
    let lost = at(&|e| matches!(e, ChannelEvent::Lost { .. }));
    assert!(
        matches!((bye, lost), (Some(m), Some(l)) if m < l),
        "{events:?}"
    );
}

/// A host name is resolved on a helper thread (the send returns at once) and then reached.
#[test]
fn a_host_name_is_resolved_off_the_node_thread_and_reached() {
    let mut a = channel();
    let ida = a.identity().clone();
    let (listener, router) = router_listener();
    let port = router.host_port().unwrap().1;
    let named = PeerId::new(format!("localhost:{port}"));
    let t = Instant::now();
    a.send(&named, b"by name").unwrap();
    assert!(
        t.elapsed() < Duration::from_millis(50),
        "a send never blocks"
    );
    let peer = std::thread::spawn(move || {
        let mut r = Router::accept(&listener);
        let props = r.handshake(3, 1);
        (props, r.read_message(), r)
    });
    let ((props, got, _open), events) = drive_until(&mut a, peer);
    assert_eq!(props[1].1, ida.as_str().as_bytes());
    assert_eq!(got, b"by name");
    assert!(events.is_empty(), "{events:?}");
    assert!(a.connected(&named));
}

/// Host liveness (`control/hosts.rs`) on loopback, where every host is up: a connection to
/// 127.0.0.1 closed by its peer starts a probe round, the other connection to 127.0.0.1 gets
/// its PING at once (long before its heartbeat's), and though its process never answers, the
/// host's kernel acknowledges the PING: the connection stays, its heartbeat judges the
/// process later. Without the acknowledgement rule it would be lost at the probe's 1 s.
#[test]
fn a_probe_round_spares_a_silent_process_whose_host_acknowledges() {
    // The default probe timeout (1 s): above the 200 ms a host's kernel may delay its ACK.
    let config = ControlConfig::default();
    let mut a = channel_with(config);
    let (closing_listener, closing) = router_listener();
    let (silent_listener, silent) = router_listener();
    a.send(&closing, b"one").unwrap();
    a.send(&silent, b"two").unwrap();
    let (closed_tx, closed_rx) = std::sync::mpsc::channel();
    let closer = std::thread::spawn(move || {
        let mut r = Router::accept(&closing_listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"one");
        // Give the silent one time to finish its handshake, then close: the process is gone.
        std::thread::sleep(Duration::from_millis(300));
        closed_tx.send(Instant::now()).unwrap();
    });
    let (ping_tx, ping_rx) = std::sync::mpsc::channel();
    let quiet = std::thread::spawn(move || {
        let mut r = Router::accept(&silent_listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"two");
        // Reads (so its kernel acknowledges) and never answers.
        loop {
            let mut flags = [0u8; 1];
            if r.s.read_exact(&mut flags).is_err() {
                return;
            }
            let mut n = [0u8; 1];
            r.s.read_exact(&mut n).unwrap();
            let mut body = vec![0u8; n[0] as usize];
            r.s.read_exact(&mut body).unwrap();
            if flags[0] == COMMAND && body.starts_with(b"\x04PING") {
                let _ = ping_tx.send(Instant::now());
            }
        }
    });
    let events = drive(&mut [&mut a], Duration::from_secs(5), |e| {
        lost_reason(e, &closing).is_some()
    });
    assert!(
        matches!(lost_cause(&events, &closing), Some(LinkLoss::ClosedByPeer)),
        "{events:?}"
    );
    closer.join().unwrap();
    let closed_at = closed_rx.recv().unwrap();
    let pinged_at = ping_rx
        .recv_timeout(Duration::from_secs(1))
        .expect("the other connection to the host was probed");
    assert!(
        pinged_at - closed_at < Duration::from_millis(900),
        "probed {:?} after the close, not by its 2 s heartbeat",
        pinged_at - closed_at
    );
    // Past the probe's deadline, twice over: still there.
    let events = drive(&mut [&mut a], Duration::from_millis(2000), |_| false);
    assert!(lost_cause(&events, &silent).is_none(), "{events:?}");
    assert!(a.connected(&silent));
    let counts = a.host_liveness();
    assert_eq!(counts.probe_rounds, 1, "{counts:?}");
    assert_eq!(counts.probe_losses, 0, "{counts:?}");
    assert_eq!(counts.hosts_down, 0, "{counts:?}");
    drop(a);
    quiet.join().unwrap();
}

/// The same with the window shut: a peer that stopped reading once its receive buffer filled
/// leaves our PING no room to leave, and its host answers only our kernel's window probes,
/// seconds apart by then; the probe round must not take that for a dead host (the host's last
/// segment is younger than the heartbeat timeout).
#[test]
fn a_probe_round_spares_a_peer_whose_window_is_shut() {
    let mut a = channel_with(ControlConfig::default());
    let (closing_listener, closing) = router_listener();
    let (stuck_listener, stuck) = router_listener();
    a.send(&closing, b"one").unwrap();
    a.send(&stuck, b"two").unwrap();
    let (close_tx, close_rx) = std::sync::mpsc::channel::<()>();
    let closer = std::thread::spawn(move || {
        let mut r = Router::accept(&closing_listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"one");
        close_rx.recv().unwrap();
    });
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let holder = std::thread::spawn(move || {
        let mut r = Router::accept(&stuck_listener);
        r.handshake(3, 1);
        assert_eq!(r.read_message(), b"two");
        // Reads nothing more until told: its receive window fills and shuts.
        done_rx.recv().unwrap();
        drop(r);
    });
    // Fill the stuck peer's window and our send buffer: 12 MiB in 1 MiB messages (within
    // `send_queue_bytes`).
    drive(&mut [&mut a], Duration::from_millis(300), |_| false);
    let big = vec![7u8; 1 << 20];
    for _ in 0..12 {
        a.send(&stuck, &big).unwrap();
        drive(&mut [&mut a], Duration::from_millis(50), |_| false);
    }
    // Long enough for our kernel's window probes to back off past the probe's second (200 ms
    // doubling: 3.2 s apart by now), so the host sends nothing inside it unless asked.
    drive(&mut [&mut a], Duration::from_secs(5), |_| false);
    close_tx.send(()).unwrap();
    closer.join().unwrap();
    let events = drive(&mut [&mut a], Duration::from_secs(5), |e| {
        lost_reason(e, &closing).is_some()
    });
    assert!(lost_reason(&events, &closing).is_some(), "{events:?}");
    // Past the probe's deadline, twice over: still there.
    let events = drive(&mut [&mut a], Duration::from_millis(2500), |_| false);
    assert!(lost_cause(&events, &stuck).is_none(), "{events:?}");
    assert!(a.connected(&stuck));
    let counts = a.host_liveness();
    assert_eq!(counts.probe_rounds, 1, "{counts:?}");
    assert_eq!(counts.probe_losses, 0, "{counts:?}");
    done_tx.send(()).unwrap();
    drop(a);
    holder.join().unwrap();
}
