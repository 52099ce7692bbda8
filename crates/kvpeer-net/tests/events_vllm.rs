//! kvpeer's native SUB and replay DEALER against vLLM 0.33's own `ZmqEventPublisher`
//! (`vllm/distributed/kv_events.py`, extracted unchanged from the released wheel by
//! tests/interop/setup.sh; pyzmq's libzmq 4.3 underneath), in a Python child process:
//!
//! * live batches arrive byte-exact, in order, and decode to the events vLLM published (a
//!   90 KiB batch among them: long frames, several reads);
//! * a subscriber that joins after the batches were published recovers them all by replay
//!   (seq 0..n, then the end marker), then follows live;
//! * the connect form: vLLM's PUB with `endpoint = "tcp://127.0.0.1:P"` connects to a SUB that
//!   kvpeer binds.
//!
//! A PUB drops what it publishes before a subscription reaches it (no `seq` gap shows it), so
//! a live test first has vLLM publish probes until one arrives, then says "go"; the batches
//! after that are the ones checked.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod events_support;

use std::net::{SocketAddr, TcpListener};
use std::time::Duration;

use events_support::{any_port, lives, replayed, take, unhex, until, Py};
use kvpeer_net::events::{EventSubscriber, SubEndpoint, SubEvent, SubscriberConfig};
use kvpeer_proto::events::{decode_batch, BlockHash, EventLimits, KvEvent};

/// vLLM's publisher, driven from stdin. `argv`: mode (`live` or `late`), PUB endpoint, replay
/// endpoint (or ""). Prints `ready`, then `batch <seq> <payload hex>` for every batch it
/// publishes (the payload as vLLM's thread encodes it: msgspec, after `publish` set the rank).
/// `live`: probes every 50 ms until stdin says `go`, then 4 batches and `done`. `late`: 4
/// batches, waits until its thread sent them, `published`. Both then take `more` (one batch
/// more, then `done`) and `quit`.
const PUBLISHER: &str = r#"
import sys, select, time, msgspec
from vllm.distributed.kv_events import ZmqEventPublisher, KVEventBatch, BlockStored, BlockRemoved
mode, endpoint, replay = sys.argv[1], sys.argv[2], sys.argv[3] or None
pub = ZmqEventPublisher(data_parallel_rank=0, endpoint=endpoint, replay_endpoint=replay,
                        topic="kv@test")
enc = msgspec.msgpack.Encoder()
seq = 0
def publish(big=False):
    global seq
    tokens = list(range(30000)) if big else []
    evs = [BlockStored(block_hashes=[bytes([seq % 256]) * 32], parent_block_hash=None,
                       token_ids=tokens, block_size=16 if big else 0, lora_id=None,
                       medium="CPU", lora_name=None, group_idx=seq % 3)]
    if seq % 2:
        evs.append(BlockRemoved(block_hashes=[b"\xee" * 32], medium="CPU", group_idx=1))
    b = KVEventBatch(ts=1000.0 + seq, events=evs)
    pub.publish(b)
    print("batch", seq, enc.encode(b).hex(), flush=True)
    seq += 1
def said():
    r, _, _ = select.select([sys.stdin], [], [], 0.05)
    return sys.stdin.readline().strip() if r else None
print("ready", flush=True)
if mode == "live":
    while said() != "go":
        publish()
    print("probes", seq, flush=True)
    for i in range(4):
        publish(big=(i == 2))
    print("done", flush=True)
else:
    for i in range(4):
        publish(big=(i == 2))
    pub._event_queue.join()
    print("published", flush=True)
while True:
    line = sys.stdin.readline().strip()
    if line == "more":
        publish()
        print("done", flush=True)
    elif line in ("quit", ""):
        break
pub.shutdown()
"#;

fn free_port() -> u16 {
    TcpListener::bind(any_port())
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn local(port: u16) -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], port))
}

/// A `batch <seq> <hex>` line: (seq, payload).
fn parse_batch(line: &str) -> Option<(u64, Vec<u8>)> {
    let mut words = line.split(' ');
    (words.next()? == "batch").then_some(())?;
    Some((words.next()?.parse().ok()?, unhex(words.next()?)))
}

/// Checks that `payload` decodes to what the script published as batch `seq`.
fn check_decodes(seq: u64, payload: &[u8]) {
    let batch = decode_batch(payload, &EventLimits::default()).unwrap();
    assert_eq!(batch.ts, 1000.0 + seq as f64);
    assert_eq!(batch.data_parallel_rank, Some(0));
    let KvEvent::Stored(stored) = batch.events[0].clone().unwrap() else {
        panic!("not a store: {:?}", batch.events[0]);
    };
    assert_eq!(
        stored.block_hashes,
        vec![BlockHash::Bytes(vec![(seq % 256) as u8; 32])]
    );
    assert_eq!(stored.group_idx, Some((seq % 3) as u32));
    assert_eq!(stored.medium.as_deref(), Some("CPU"));
    assert_eq!(batch.events.len(), if seq % 2 == 1 { 2 } else { 1 });
}

/// Drives `sub` (events into `events`) and reads `py`'s lines (batches into `batches`) until
/// `done`.
fn pump(
    sub: &mut EventSubscriber,
    py: &mut Py,
    events: &mut Vec<SubEvent>,
    batches: &mut Vec<(u64, Vec<u8>)>,
    lines: &mut Vec<String>,
    what: &str,
    mut done: impl FnMut(&[SubEvent], &[String]) -> bool,
) {
    until(what, || {
        sub.wait(Duration::from_millis(10)).unwrap();
        take(sub, events);
        while let Some(line) = py.try_line() {
            if let Some(b) = parse_batch(&line) {
                batches.push(b);
            } else {
                lines.push(line);
            }
        }
        done(events, lines)
    });
}

/// The live part of a test: probes until one arrives, then 4 batches, which must arrive as
/// published, in order, byte-exact.
fn follow_live(sub: &mut EventSubscriber, py: &mut Py) -> Vec<SubEvent> {
    let (mut events, mut batches, mut lines) = (Vec::new(), Vec::new(), Vec::new());
    pump(
        sub,
        py,
        &mut events,
        &mut batches,
        &mut lines,
        "a probe",
        |e, _| e.iter().any(|e| matches!(e, SubEvent::Live { .. })),
    );
    py.say("go");
    pump(
        sub,
        py,
        &mut events,
        &mut batches,
        &mut lines,
        "the batches",
        |e, l| {
            let Some(probes) = l.iter().find_map(|l| l.strip_prefix("probes ")) else {
                return false;
            };
            let last = probes.parse::<u64>().unwrap() + 3;
            l.iter().any(|l| l == "done")
                && e.iter()
                    .any(|e| matches!(e, SubEvent::Live { seq, .. } if *seq == last))
        },
    );
    let probes: u64 = lines
        .iter()
        .find_map(|l| l.strip_prefix("probes "))
        .unwrap()
        .parse()
        .unwrap();
    let live = lives(&events);
    // Every live batch is one vLLM published, in order (probes may have been dropped before
    // the subscription reached the PUB; none after).
    for w in live.windows(2) {
        assert_eq!(w[1].0, w[0].0 + 1, "in order, no gap once subscribed");
    }
    let checked: Vec<&(u64, Vec<u8>)> = live.iter().filter(|(s, _)| *s >= probes).collect();
    assert_eq!(checked.len(), 4);
    for (seq, payload) in checked {
        let (_, published) = batches.iter().find(|(s, _)| s == seq).unwrap();
        assert_eq!(payload, published, "batch {seq} byte-exact");
        check_decodes(*seq, payload);
    }
    assert!(
        live.iter().any(|(_, p)| p.len() > 64 * 1024),
        "the large batch came"
    );
    events
}

/// Stops the publisher (driving `sub` meanwhile); the events that came.
fn quit(mut py: Py, sub: &mut EventSubscriber) -> Vec<SubEvent> {
    py.say("quit");
    let mut events = Vec::new();
    until("vLLM's publisher to exit", || {
        sub.wait(Duration::from_millis(10)).unwrap();
        take(sub, &mut events);
        py.exited()
    });
    events
}

#[test]
fn live_batches_from_vllms_publisher_arrive_byte_exact() {
    let port = free_port();
    let mut py = Py::start(
        PUBLISHER,
        &["live".into(), format!("tcp://*:{port}"), String::new()],
        true,
    );
    assert_eq!(py.line(), "ready");
    let mut config = SubscriberConfig::new(SubEndpoint::Connect(local(port)));
    config.topic = b"kv@".to_vec();
    let mut sub = EventSubscriber::new(config).unwrap();
    let events = follow_live(&mut sub, &mut py);
    assert_eq!(events[0], SubEvent::Connected);
    assert_eq!(sub.stats().malformed, 0);
    assert_eq!(sub.stats().connects, 1);
    quit(py, &mut sub);
}

#[test]
fn a_late_subscriber_recovers_earlier_batches_by_replay_then_follows_live() {
    let (port, replay) = (free_port(), free_port());
    let mut py = Py::start(
        PUBLISHER,
        &[
            "late".into(),
            format!("tcp://*:{port}"),
            format!("tcp://*:{replay}"),
        ],
        true,
    );
    assert_eq!(py.line(), "ready");
    let mut published = Vec::new();
    loop {
        let line = py.line();
        if line == "published" {
            break;
        }
        published.push(parse_batch(&line).unwrap());
    }
    assert_eq!(published.len(), 4);
    let mut config = SubscriberConfig::new(SubEndpoint::Connect(local(port)));
    config.replay = Some(local(replay));
    let mut sub = EventSubscriber::new(config).unwrap();
    let (mut events, mut batches, mut lines) = (Vec::new(), Vec::new(), Vec::new());
    pump(
        &mut sub,
        &mut py,
        &mut events,
        &mut batches,
        &mut lines,
        "connected",
        |e, _| e.contains(&SubEvent::Connected),
    );
    // What the follower asks on every connect: everything from the next batch it needs.
    sub.request_replay(0);
    pump(
        &mut sub,
        &mut py,
        &mut events,
        &mut batches,
        &mut lines,
        "the replay",
        |e, _| e.contains(&SubEvent::ReplayEnd),
    );
    let replayed_batches = replayed(&events);
    assert_eq!(
        replayed_batches, published,
        "seqs 0..4, byte-exact, in order"
    );
    for (seq, payload) in &replayed_batches {
        check_decodes(*seq, payload);
    }
    assert_eq!(events.last(), Some(&SubEvent::ReplayEnd));
    assert!(!events.iter().any(|e| matches!(e, SubEvent::Live { .. })));
    // A replay from the middle: only what is kept from there on.
    events.clear();
    sub.request_replay(2);
    pump(
        &mut sub,
        &mut py,
        &mut events,
        &mut batches,
        &mut lines,
        "a partial replay",
        |e, _| e.contains(&SubEvent::ReplayEnd),
    );
    let seqs: Vec<u64> = replayed(&events).into_iter().map(|(s, _)| s).collect();
    assert_eq!(seqs, vec![2, 3]);
    // Live from here: the subscription has long reached the PUB.
    py.say("more");
    pump(
        &mut sub,
        &mut py,
        &mut events,
        &mut batches,
        &mut lines,
        "a live batch",
        // vLLM prints the batch after publishing it: it may arrive first.
        |e, l| {
            e.iter().any(|e| matches!(e, SubEvent::Live { .. })) && l.iter().any(|l| l == "done")
        },
    );
    let live = lives(&events).into_iter().next().unwrap();
    assert_eq!(live.0, 4);
    assert_eq!(Some(&live), batches.iter().find(|(s, _)| *s == 4));
    let stats = sub.stats();
    assert_eq!(
        (stats.replayed, stats.replay_ends, stats.malformed),
        (6, 2, 0)
    );
    quit(py, &mut sub);
}

#[test]
fn vllms_connecting_publisher_reaches_a_bound_subscriber() {
    let mut sub =
        EventSubscriber::new(SubscriberConfig::new(SubEndpoint::Bind(any_port()))).unwrap();
    let port = sub.local_addr().unwrap().port();
    // Not "*" nor "::": vLLM's PUB connects.
    let mut py = Py::start(
        PUBLISHER,
        &[
            "live".into(),
            format!("tcp://127.0.0.1:{port}"),
            String::new(),
        ],
        true,
    );
    assert_eq!(py.line(), "ready");
    let events = follow_live(&mut sub, &mut py);
    assert_eq!(events[0], SubEvent::Connected);
    assert!(sub.is_connected());
    let mut events = quit(py, &mut sub);
    // vLLM closed its PUB: the bound SUB sees the connection go.
    until("the loss", || {
        sub.wait(Duration::from_millis(10)).unwrap();
        take(&mut sub, &mut events);
        events.iter().any(|e| matches!(e, SubEvent::Lost { .. }))
    });
    assert!(!sub.is_connected());
}
