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

/// A subscriber and vLLM's publisher process, with what each has said so far.
struct Session {
    sub: EventSubscriber,
    py: Py,
    events: Vec<SubEvent>,
    /// The batches vLLM published: (seq, payload).
    batches: Vec<(u64, Vec<u8>)>,
    /// vLLM's other lines.
    lines: Vec<String>,
}

impl Session {
    fn new(sub: EventSubscriber, py: Py) -> Self {
        Session {
            sub,
            py,
            events: Vec::new(),
            batches: Vec::new(),
            lines: Vec::new(),
        }
    }

    /// Drives the subscriber and reads vLLM's lines until `done(events, lines)`.
    fn pump(&mut self, what: &str, mut done: impl FnMut(&[SubEvent], &[String]) -> bool) {
        until(what, || {
            self.sub.wait(Duration::from_millis(10)).unwrap();
            take(&mut self.sub, &mut self.events);
            while let Some(line) = self.py.try_line() {
                match parse_batch(&line) {
                    Some(b) => self.batches.push(b),
                    None => self.lines.push(line),
                }
            }
            done(&self.events, &self.lines)
        });
    }

    /// The number vLLM printed after `word `.
    fn said(&self, word: &str) -> Option<u64> {
        self.lines
            .iter()
            .find_map(|l| l.strip_prefix(word)?.strip_prefix(' ')?.parse().ok())
    }

    /// The live part of a test: probes until one arrives, then 4 batches, which must arrive
    /// as published, in order, byte-exact.
    fn follow_live(&mut self) {
        self.pump("a probe", |e, _| !lives(e).is_empty());
        self.py.say("go");
        self.pump("the batches", |e, l| {
            let Some(probes) = l.iter().find_map(|l| l.strip_prefix("probes ")) else {
                return false;
            };
            let last = probes.parse::<u64>().unwrap() + 3;
            l.iter().any(|l| l == "done") && lives(e).iter().any(|(seq, _)| *seq == last)
        });
        let probes = self.said("probes").unwrap();
        let live = lives(&self.events);
        // Every live batch is one vLLM published, in order (probes may have been dropped
        // before the subscription reached the PUB; none after).
        for w in live.windows(2) {
            assert_eq!(w[1].0, w[0].0 + 1, "in order, no gap once subscribed");
        }
        let checked: Vec<&(u64, Vec<u8>)> = live.iter().filter(|(s, _)| *s >= probes).collect();
        assert_eq!(checked.len(), 4);
        for (seq, payload) in checked {
            let (_, published) = self.batches.iter().find(|(s, _)| s == seq).unwrap();
            assert_eq!(payload, published, "batch {seq} byte-exact");
            check_decodes(*seq, payload);
        }
        assert!(
            live.iter().any(|(_, p)| p.len() > 64 * 1024),
            "the large batch came"
        );
    }

    /// Stops the publisher (driving the subscriber meanwhile).
    fn quit(&mut self) {
        self.py.say("quit");
        until("vLLM's publisher to exit", || {
            self.sub.wait(Duration::from_millis(10)).unwrap();
            take(&mut self.sub, &mut self.events);
            self.py.exited()
        });
    }
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
    let mut s = Session::new(EventSubscriber::new(config).unwrap(), py);
    s.follow_live();
    assert_eq!(s.events[0], SubEvent::Connected);
    assert_eq!(s.sub.stats().malformed, 0);
    assert_eq!(s.sub.stats().connects, 1);
    s.quit();
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
    let mut s = Session::new(EventSubscriber::new(config).unwrap(), py);
    s.pump("connected", |e, _| e.contains(&SubEvent::Connected));
    // What the follower asks on every connect: everything from the next batch it needs.
    s.sub.request_replay(0);
    s.pump("the replay", |e, _| e.contains(&SubEvent::ReplayEnd));
    let replayed_batches = replayed(&s.events);
    assert_eq!(
        replayed_batches, published,
        "seqs 0..4, byte-exact, in order"
    );
    for (seq, payload) in &replayed_batches {
        check_decodes(*seq, payload);
    }
    assert_eq!(s.events.last(), Some(&SubEvent::ReplayEnd));
    assert!(lives(&s.events).is_empty());
    // A replay from the middle: only what is kept from there on.
    s.events.clear();
    s.sub.request_replay(2);
    s.pump("a partial replay", |e, _| e.contains(&SubEvent::ReplayEnd));
    let seqs: Vec<u64> = replayed(&s.events).into_iter().map(|(q, _)| q).collect();
    assert_eq!(seqs, vec![2, 3]);
    // Live from here: the subscription has long reached the PUB.
    s.py.say("more");
    // vLLM prints the batch after publishing it: it may arrive first.
    s.pump("a live batch", |e, l| {
        !lives(e).is_empty() && l.iter().any(|l| l == "done")
    });
    let live = lives(&s.events).into_iter().next().unwrap();
    assert_eq!(live.0, 4);
    assert_eq!(Some(&live), s.batches.iter().find(|(q, _)| *q == 4));
    let stats = s.sub.stats();
    assert_eq!(
        (stats.replayed, stats.replay_ends, stats.malformed),
        (6, 2, 0)
    );
    s.quit();
}

#[test]
fn vllms_connecting_publisher_reaches_a_bound_subscriber() {
    let sub = EventSubscriber::new(SubscriberConfig::new(SubEndpoint::Bind(any_port()))).unwrap();
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
    let mut s = Session::new(sub, py);
    s.follow_live();
    assert_eq!(s.events[0], SubEvent::Connected);
    assert!(s.sub.is_connected());
    s.quit();
    // vLLM closed its PUB: the bound SUB sees the connection go.
    s.pump("the loss", |e, _| {
        e.iter().any(|e| matches!(e, SubEvent::Lost { .. }))
    });
    assert!(!s.sub.is_connected());
}
