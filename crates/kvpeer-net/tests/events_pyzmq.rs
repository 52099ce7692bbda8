//! kvpeer's native PUB and replay ROUTER ([`EventPublisher`]) against pyzmq (libzmq 4.3)
//! sockets, as the routers that index vLLM engines subscribe to them:
//!
//! * pyzmq SUBs get exactly the messages whose topic their subscriptions prefix, byte-exact
//!   (a subscriber to `kv@a` gets `kv@a:1`, not `kv@b`; a CANCEL sent after a SUBSCRIBE
//!   withdraws it), short and long frames;
//! * a pyzmq DEALER asking the replay ROUTER `["", start_seq]` gets every batch
//!   `kvpeer_pool::Publisher` keeps from there, as `["", topic, seq, payload]`, then
//!   `["", "", -1, ""]`, byte-exact, twice on one connection.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod events_support;

use std::time::Duration;

use events_support::{any_port, hex, until, Py};
use kvpeer_net::events::{wait_all, EventPublisher, PublisherConfig};
use kvpeer_pool::{Publisher, StoreChange};
use kvpeer_proto::OffloadKey;

/// Two SUBs: `a` subscribed to `kv@a`; `b` to `kv@x` before connecting, then (connected)
/// cancels it and subscribes to `kv@b` and `kv@c`. Each prints every message it gets as
/// `<name> <hex frames>` until one whose topic ends in `:end`.
const SUBSCRIBERS: &str = r#"
import sys, zmq
port = sys.argv[1]
ctx = zmq.Context()
a = ctx.socket(zmq.SUB)
a.setsockopt(zmq.SUBSCRIBE, b"kv@a")
a.connect(f"tcp://127.0.0.1:{port}")
b = ctx.socket(zmq.SUB)
b.setsockopt(zmq.SUBSCRIBE, b"kv@x")
b.connect(f"tcp://127.0.0.1:{port}")
b.setsockopt(zmq.UNSUBSCRIBE, b"kv@x")
b.setsockopt(zmq.SUBSCRIBE, b"kv@b")
b.setsockopt(zmq.SUBSCRIBE, b"kv@c")
for name, s in (("a", a), ("b", b)):
    while True:
        if s.poll(20000) == 0:
            sys.exit(f"{name}: no end message")
        frames = s.recv_multipart()
        print(name, " ".join(f.hex() for f in frames), flush=True)
        if frames[0].endswith(b":end"):
            break
"#;

#[test]
fn pyzmq_subscribers_get_exactly_what_their_prefixes_match() {
    let mut publisher = EventPublisher::bind(PublisherConfig::new(any_port())).unwrap();
    let port = publisher.local_addr().unwrap().port();
    let mut py = Py::start(SUBSCRIBERS, &[port.to_string()], false);
    // a: kv@a; b: kv@b and kv@c. Commands on one connection arrive in order, so three
    // prefixes held means b's CANCEL of kv@x came before.
    until("the subscriptions", || {
        wait_all(&mut [&mut publisher], Duration::from_millis(10), None).unwrap();
        publisher.subscribed() == 2 && publisher.subscriptions() == 3
    });
    let long: Vec<u8> = (0..70_000u32).map(|i| (i % 251) as u8).collect();
    let messages: Vec<(&[u8], Vec<u8>)> = vec![
        (b"kv@b", b"p0".to_vec()),
        (b"kv@a:1", vec![7; 300]),
        (b"kv@x:1", b"cancelled".to_vec()),
        (b"kv@", b"no one".to_vec()),
        (b"kv@a:1", long),
        (b"kv@c", Vec::new()),
        (b"kv@a:end", b"e".to_vec()),
        (b"kv@b:end", b"e".to_vec()),
    ];
    let mut expected = Vec::new();
    for (seq, (topic, payload)) in messages.iter().enumerate() {
        let seq = (seq as u64).to_be_bytes();
        publisher.publish(&[topic, &seq, payload]);
        let line = format!("{} {} {}", hex(topic), hex(&seq), hex(payload));
        match topic.get(..4) {
            Some(b"kv@a") => expected.push(format!("a {line}")),
            Some(b"kv@b" | b"kv@c") => expected.push(format!("b {line}")),
            _ => {}
        }
    }
    let mut got = Vec::new();
    until("the subscribers to finish", || {
        wait_all(&mut [&mut publisher], Duration::from_millis(10), None).unwrap();
        while let Some(line) = py.try_line() {
            got.push(line);
        }
        py.exited()
    });
    while let Some(line) = py.try_line() {
        got.push(line);
    }
    // Python prints a's messages, then b's.
    let (a, b): (Vec<_>, Vec<_>) = expected.into_iter().partition(|l| l.starts_with('a'));
    assert_eq!(got, [a, b].concat());
    let stats = publisher.stats();
    assert_eq!((stats.published, stats.delivered, stats.dropped), (8, 6, 0));
}

/// A DEALER that asks the replay ROUTER at `argv[1]` for everything from `argv[2]`, then
/// from `argv[3]`, printing each answer's frames as hex (`---` between the answers).
const REPLAYER: &str = r#"
import sys, zmq
port = sys.argv[1]
ctx = zmq.Context()
d = ctx.socket(zmq.DEALER)
d.connect(f"tcp://127.0.0.1:{port}")
for start in (int(sys.argv[2]), int(sys.argv[3])):
    d.send_multipart([b"", start.to_bytes(8, "big")])
    while True:
        if d.poll(20000) == 0:
            sys.exit("no end marker")
        frames = d.recv_multipart()
        print(" ".join(f.hex() for f in frames), flush=True)
        if frames[2] == (-1).to_bytes(8, "big", signed=True):
            break
    print("---", flush=True)
"#;

#[test]
fn a_pyzmq_dealer_replays_what_the_pool_keeps_from_the_native_router() {
    let mut config = PublisherConfig::new(any_port());
    config.replay_bind = Some(any_port());
    let mut publisher = EventPublisher::bind(config).unwrap();
    let replay_port = publisher.replay_addr().unwrap().port();
    // The pool's stream keeps its last 3 batches of 5.
    let mut pool = Publisher::new("kv@pool", 3);
    for i in 0..5u8 {
        let key = OffloadKey::from_parts(&[i; 32], u32::from(i));
        let f = pool
            .publish(
                f64::from(i),
                &[StoreChange::Stored(key)],
                &mut kvpeer_pool::Catalog::new(kvpeer_pool::CatalogLimits::default()),
            )
            .unwrap()
            .unwrap();
        // Nobody subscribes: the PUB drops it, the pool's buffer keeps it.
        publisher.publish(&[&f.topic, &f.seq, &f.payload]);
    }
    let mut py = Py::start(
        REPLAYER,
        &[replay_port.to_string(), "3".into(), "0".into()],
        false,
    );
    let mut got = Vec::new();
    until("the replays", || {
        publisher
            .serve(Duration::from_millis(10), |start| {
                pool.replay(start)
                    .into_iter()
                    .map(|f| [f.topic, f.seq.to_vec(), f.payload])
            })
            .unwrap();
        while let Some(line) = py.try_line() {
            got.push(line);
        }
        py.exited()
    });
    while let Some(line) = py.try_line() {
        got.push(line);
    }
    let answer = |start: u64| -> Vec<String> {
        pool.replay(start)
            .into_iter()
            .map(|f| format!(" {} {} {}", hex(&f.topic), hex(&f.seq), hex(&f.payload)))
            .chain(["---".to_owned()])
            .collect()
    };
    let expected = [answer(3), answer(0)].concat();
    assert_eq!(got, expected);
    // 3 and 4, then 2, 3, 4 (0 and 1 are gone): each then the end marker, "" · "" · -1 · "".
    assert_eq!(expected.len(), 2 + 1 + 1 + 3 + 1 + 1);
    assert_eq!(expected[2], "  ffffffffffffffff ");
    let stats = publisher.stats();
    assert_eq!((stats.replays, stats.bad_requests), (2, 0));
}
