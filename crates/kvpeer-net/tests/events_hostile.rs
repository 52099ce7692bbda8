//! The KV event stream's native sockets against hostile peers, each spoken byte by byte over
//! loopback TCP: whatever one does costs only its own connection (or its own messages), and an
//! honest peer is still served, byte-exact.
//!
//! * a subscriber that never reads: its messages are dropped past its bounded queue (counted),
//!   the publisher never blocks, an honest subscriber gets every message;
//! * a 1 TiB frame header, a garbage or ZMTP 2 greeting, a socket type that cannot talk to
//!   ours, too many subscriptions: that connection is closed;
//! * replay requests of the wrong shape are dropped and counted (the connection stays and is
//!   answered when it asks properly); requests past the per-connection bound are dropped;
//! * connections over the per-source cap are refused; silent ones time out, then an honest
//!   subscriber gets in;
//! * a SUB that binds: a PUB announcing a 1 TiB frame is lost, garbage is closed, and an
//!   honest PUB (hand-spoken) gets our greeting, READY and subscription, and its message comes
//!   through.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod events_support;

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsRawFd;
use std::time::Duration;

use events_support::{any_port, lives, take, until};
use kvpeer_net::events::{
    wait_all, EventIo, EventPublisher, EventSubscriber, PublisherConfig, SubEndpoint, SubEvent,
    SubscriberConfig,
};
use kvpeer_net::zmtp::{self, Decoder, Input};

const TICK: Duration = Duration::from_millis(10);

/// A connected socket (blocking while connecting, then non-blocking).
fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_nonblocking(true).unwrap();
    s
}

/// A connected socket whose receive buffer is as small as the system allows (so a peer that
/// never reads fills up quickly).
fn small_receiver(addr: SocketAddr) -> TcpStream {
    use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrIn};
    let fd = socket::socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::empty(),
        None,
    )
    .unwrap();
    socket::setsockopt(&fd, sockopt::RcvBuf, &4096).unwrap();
    let SocketAddr::V4(v4) = addr else {
        panic!("IPv4 expected")
    };
    socket::connect(fd.as_raw_fd(), &SockaddrIn::from(v4)).unwrap();
    TcpStream::from(fd)
}

/// Greeting and READY of a `socket_type`.
fn hello(socket_type: &str) -> Vec<u8> {
    [zmtp::greeting().to_vec(), zmtp::ready(socket_type)].concat()
}

/// A message frame header announcing 1 TiB.
fn tebibyte_header() -> Vec<u8> {
    let mut h = vec![0x02];
    h.extend_from_slice(&(1u64 << 40).to_be_bytes());
    h
}

fn message(parts: &[&[u8]]) -> Vec<u8> {
    let mut out = Vec::new();
    zmtp::write_message(&mut out, parts);
    out
}

/// Whether the other side closed `s` (reads and discards what is there; never blocks).
fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 64 * 1024];
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return false,
            Err(e) => {
                return matches!(e.kind(), ErrorKind::ConnectionReset | ErrorKind::BrokenPipe)
            }
        }
    }
}

/// Everything a peer decodes from `s` so far into `into` (never blocks).
fn decode_from(s: &mut TcpStream, d: &mut Decoder, into: &mut Vec<Input>) {
    let mut b = [0u8; 64 * 1024];
    loop {
        match s.read(&mut b) {
            Ok(0) => panic!("closed"),
            Ok(n) => d.push(&b[..n]),
            Err(e) if e.kind() == ErrorKind::WouldBlock => break,
            Err(e) => panic!("{e}"),
        }
    }
    while let Some(i) = d.next_input().unwrap() {
        into.push(i);
    }
}

fn messages(inputs: &[Input]) -> Vec<Vec<Vec<u8>>> {
    inputs
        .iter()
        .filter_map(|i| match i {
            Input::Message(m) => Some(m.clone()),
            _ => None,
        })
        .collect()
}

fn step(drivers: &mut [&mut dyn EventIo]) {
    wait_all(drivers, TICK, None).unwrap();
}

#[test]
fn a_subscriber_that_never_reads_loses_messages_while_an_honest_one_gets_all() {
    let mut config = PublisherConfig::new(any_port());
    config.subscriber.send_queue = 16;
    config.subscriber.send_queue_bytes = 1 << 20;
    // Long enough that the stuck subscriber outlives the test: what it costs is its messages.
    config.subscriber.heartbeat_timeout = Duration::from_secs(120);
    config.stall_timeout = Duration::from_secs(120);
    let mut publisher = EventPublisher::bind(config).unwrap();
    let addr = publisher.local_addr().unwrap();
    let mut stuck = small_receiver(addr);
    stuck
        .write_all(
            &[
                hello("SUB"),
                zmtp::message_frame(&zmtp::subscription(b"", true)),
            ]
            .concat(),
        )
        .unwrap();
    let mut honest =
        EventSubscriber::new(SubscriberConfig::new(SubEndpoint::Connect(addr))).unwrap();
    let mut events = Vec::new();
    until("both subscribed", || {
        step(&mut [&mut publisher, &mut honest]);
        take(&mut honest, &mut events);
        publisher.subscribed() == 2
    });
    let payload = |i: u64| -> Vec<u8> {
        (0..64 * 1024u64)
            .map(|j| (i.wrapping_mul(31) ^ j) as u8)
            .collect()
    };
    const N: u64 = 300;
    for i in 0..N {
        // Returns at once, whatever the stuck subscriber does.
        publisher.publish(&[b"kv@pool", &i.to_be_bytes(), &payload(i)]);
        until("the honest subscriber to get it", || {
            step(&mut [&mut publisher, &mut honest]);
            take(&mut honest, &mut events);
            lives(&events).last().is_some_and(|(seq, _)| *seq == i)
        });
    }
    let got = lives(&events);
    assert_eq!(got.len() as u64, N);
    for (i, (seq, p)) in got.iter().enumerate() {
        assert_eq!(*seq, i as u64);
        assert!(*p == payload(i as u64), "message {i} byte-exact");
    }
    let stats = publisher.stats();
    assert!(stats.dropped > 0, "{stats:?}");
    assert_eq!(stats.delivered + stats.dropped, 2 * N, "{stats:?}");
    assert_eq!(
        stats.subscribers, 2,
        "the stuck subscriber is still connected"
    );
    drop(stuck);
}

#[test]
fn hostile_bytes_cost_only_their_own_connection() {
    let mut config = PublisherConfig::new(any_port());
    config.replay_bind = Some(any_port());
    config.max_subscriptions = 8;
    let mut publisher = EventPublisher::bind(config).unwrap();
    let (addr, raddr) = (
        publisher.local_addr().unwrap(),
        publisher.replay_addr().unwrap(),
    );
    let zmtp2 = [0xFF, 0, 0, 0, 0, 0, 0, 0, 1, 0x7F, 1, 5];
    let too_many: Vec<u8> = (0..9u8)
        .flat_map(|i| zmtp::subscription_command(&[b'k', i], true))
        .collect();
    let mut hostile: Vec<(&str, TcpStream, Vec<u8>)> = vec![
        (
            "HTTP to the PUB",
            raw(addr),
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n".to_vec(),
        ),
        (
            "1 TiB to the PUB",
            raw(addr),
            [hello("SUB"), tebibyte_header()].concat(),
        ),
        ("a ROUTER at the PUB", raw(addr), hello("ROUTER")),
        ("ZMTP 2 at the PUB", raw(addr), zmtp2.to_vec()),
        (
            "9 subscriptions",
            raw(addr),
            [hello("SUB"), too_many].concat(),
        ),
        (
            "1 TiB to the ROUTER",
            raw(raddr),
            [hello("DEALER"), tebibyte_header()].concat(),
        ),
        (
            "HTTP to the ROUTER",
            raw(raddr),
            b"\x16\x03\x01 TLS hello".to_vec(),
        ),
        ("a SUB at the ROUTER", raw(raddr), hello("SUB")),
    ];
    for (_, s, bytes) in &mut hostile {
        s.write_all(bytes).unwrap();
    }
    let mut config = SubscriberConfig::new(SubEndpoint::Connect(addr));
    config.replay = Some(raddr);
    let mut honest = EventSubscriber::new(config).unwrap();
    let mut events = Vec::new();
    let mut open: Vec<&str> = hostile.iter().map(|(what, _, _)| *what).collect();
    until("every hostile connection closed", || {
        step(&mut [&mut publisher, &mut honest]);
        take(&mut honest, &mut events);
        for (what, s, _) in &mut hostile {
            if closed(s) {
                open.retain(|w| w != what);
            }
        }
        open.is_empty()
    });
    until("the honest subscriber in", || {
        step(&mut [&mut publisher, &mut honest]);
        take(&mut honest, &mut events);
        publisher.subscribed() == 1 && honest.replay_connected()
    });
    let batch = b"\x93\xcb\x40\x59\x00\x00\x00\x00\x00\x00\x90\x00".to_vec();
    publisher.publish(&[b"kv@pool", &0u64.to_be_bytes(), &batch]);
    honest.request_replay(0);
    until("live and replayed", || {
        wait_all(&mut [&mut publisher, &mut honest], TICK, None).unwrap();
        publisher.serve_replays(|start| {
            assert_eq!(start, 0);
            vec![
                vec![
                    b"kv@pool".to_vec(),
                    0u64.to_be_bytes().to_vec(),
                    batch.clone(),
                ],
                vec![
                    Vec::new(),
                    kvpeer_net::events::wire::END_SEQ.to_vec(),
                    Vec::new(),
                ],
            ]
        });
        take(&mut honest, &mut events);
        events.contains(&SubEvent::ReplayEnd)
    });
    assert_eq!(lives(&events), vec![(0, batch.clone())]);
    assert!(events.contains(&SubEvent::Replayed {
        seq: 0,
        payload: batch
    }));
    let stats = publisher.stats();
    assert_eq!(
        (stats.subscribers, stats.replay_clients),
        (1, 1),
        "{stats:?}"
    );
    assert_eq!(stats.too_many_subscriptions, 1, "{stats:?}");
}

#[test]
fn replay_requests_of_the_wrong_shape_are_dropped_and_the_connection_still_answered() {
    let mut config = PublisherConfig::new(any_port());
    config.replay_bind = Some(any_port());
    let mut publisher = EventPublisher::bind(config).unwrap();
    let raddr = publisher.replay_addr().unwrap();
    let seq0 = 0u64.to_be_bytes();
    let mut s = raw(raddr);
    let wrong = [
        message(&[b"x", &seq0]),
        message(&[&seq0]),
        message(&[b"", &[0; 4]]),
        message(&[b"", &seq0, b"extra"]),
    ]
    .concat();
    s.write_all(&[hello("DEALER"), wrong, message(&[b"", &seq0])].concat())
        .unwrap();
    let answer = |start: u64| -> Vec<Vec<Vec<u8>>> {
        vec![
            vec![
                b"t".to_vec(),
                start.to_be_bytes().to_vec(),
                b"batch".to_vec(),
            ],
            vec![
                Vec::new(),
                kvpeer_net::events::wire::END_SEQ.to_vec(),
                Vec::new(),
            ],
        ]
    };
    let (mut d, mut inputs) = (Decoder::new(1 << 20), Vec::new());
    until("the answer", || {
        publisher.serve(TICK, answer).unwrap();
        decode_from(&mut s, &mut d, &mut inputs);
        messages(&inputs).len() == 2
    });
    let with_delimiter = |m: Vec<Vec<u8>>| [vec![Vec::new()], m].concat();
    assert_eq!(
        messages(&inputs),
        answer(0)
            .into_iter()
            .map(with_delimiter)
            .collect::<Vec<_>>()
    );
    let stats = publisher.stats();
    assert_eq!((stats.bad_requests, stats.replays), (4, 1), "{stats:?}");
    // Ten requests at once: four wait their turn, six are dropped.
    let ten: Vec<u8> = (0..10u64)
        .flat_map(|i| message(&[b"", &i.to_be_bytes()]))
        .collect();
    s.write_all(&ten).unwrap();
    until("four answers", || {
        publisher.serve(TICK, answer).unwrap();
        decode_from(&mut s, &mut d, &mut inputs);
        messages(&inputs).len() == 2 + 4 * 2
    });
    let stats = publisher.stats();
    assert_eq!((stats.requests_dropped, stats.replays), (6, 5), "{stats:?}");
    assert_eq!(stats.replay_clients, 1);
}

#[test]
fn connections_over_the_cap_evict_the_idlest_and_never_a_working_subscriber() {
    // Two silent connections fill the source's share (2) and would wait out a long handshake
    // deadline: refusing newcomers would lock the honest subscriber of the same host out.
    let mut config = PublisherConfig::new(any_port());
    config.max_per_source = 2;
    config.subscriber.handshake_timeout = Duration::from_secs(120);
    let mut publisher = EventPublisher::bind(config).unwrap();
    let addr = publisher.local_addr().unwrap();
    let mut silent = [raw(addr), raw(addr)];
    until("two connections", || {
        step(&mut [&mut publisher]);
        publisher.stats().subscribers == 2
    });
    let mut honest =
        EventSubscriber::new(SubscriberConfig::new(SubEndpoint::Connect(addr))).unwrap();
    let mut events = Vec::new();
    until("the honest one in, subscribed", || {
        step(&mut [&mut publisher, &mut honest]);
        take(&mut honest, &mut events);
        publisher.subscribed() == 1
    });
    // From the attacker's side: the idlest silent connection was closed for the newcomer.
    until("one silent connection evicted", || {
        step(&mut [&mut publisher, &mut honest]);
        silent.iter_mut().map(closed).filter(|c| *c).count() == 1
    });
    // A third silent one evicts the remaining silent one, not the subscriber at work.
    let mut third = raw(addr);
    until("the other silent connection evicted", || {
        step(&mut [&mut publisher, &mut honest]);
        take(&mut honest, &mut events);
        silent.iter_mut().all(closed)
    });
    assert_eq!(publisher.stats().evicted, 2, "{:?}", publisher.stats());
    assert_eq!(publisher.stats().refused, 0);
    publisher.publish(&[b"", &7u64.to_be_bytes(), b"x"]);
    until("the message", || {
        step(&mut [&mut publisher, &mut honest]);
        take(&mut honest, &mut events);
        !lives(&events).is_empty()
    });
    assert_eq!(lives(&events), vec![(7, b"x".to_vec())]);
    assert!(!closed(&mut third), "the newest connection keeps its slot");
}

#[test]
fn a_bound_sub_survives_hostile_publishers_and_hears_an_honest_one() {
    let mut config = SubscriberConfig::new(SubEndpoint::Bind(any_port()));
    config.topic = b"kv@".to_vec();
    let mut sub = EventSubscriber::new(config).unwrap();
    let addr = sub.local_addr().unwrap();
    let mut garbage = raw(addr);
    garbage.write_all(b"\x00\x01\x02 not zmtp").unwrap();
    let mut huge = raw(addr);
    huge.write_all(&[hello("PUB"), tebibyte_header()].concat())
        .unwrap();
    let mut events = Vec::new();
    until("both closed", || {
        step(&mut [&mut sub]);
        take(&mut sub, &mut events);
        closed(&mut garbage) && closed(&mut huge)
    });
    // The PUB that announced 1 TiB had finished its handshake: connected, then lost.
    assert!(
        matches!(&events[..], [SubEvent::Connected, SubEvent::Lost { .. }]),
        "{events:?}"
    );
    let mut honest = raw(addr);
    honest.write_all(&hello("PUB")).unwrap();
    let (mut d, mut inputs) = (Decoder::new(1 << 20), Vec::new());
    until("our greeting, READY and subscription", || {
        step(&mut [&mut sub]);
        take(&mut sub, &mut events);
        decode_from(&mut honest, &mut d, &mut inputs);
        inputs.len() == 3
    });
    assert_eq!(
        inputs,
        vec![
            Input::Greeting,
            Input::Ready {
                socket_type: b"SUB".to_vec(),
                identity: Vec::new(),
                challenge: None,
                announced: None,
            },
            Input::Message(vec![b"\x01kv@".to_vec()]),
        ]
    );
    honest
        .write_all(
            &[
                message(&[b"kv@e", &3u64.to_be_bytes(), b"batch"]),
                message(&[b"other", &4u64.to_be_bytes(), b"filtered"]),
                message(&[b"kv@e", b"short"]),
                message(&[b"kv@e", &5u64.to_be_bytes(), b"next"]),
            ]
            .concat(),
        )
        .unwrap();
    until("the honest messages", || {
        step(&mut [&mut sub]);
        take(&mut sub, &mut events);
        lives(&events).len() == 2
    });
    assert_eq!(
        lives(&events),
        vec![(3, b"batch".to_vec()), (5, b"next".to_vec())]
    );
    let stats = sub.stats();
    assert_eq!((stats.filtered, stats.malformed, stats.connects), (1, 1, 2));
}
