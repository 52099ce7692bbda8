//! A large inbound payload is decoded a slice at a time (docs/security.md, "Sliced work"):
//! while a peer's lookup of 131,072 keys (5 MB) is still being decoded, an honest consumer's
//! lookups are answered and its blocks loaded byte-exact; the large lookup's decoding then
//! ends, and the node takes its connection up again. What large payloads in decoding hold
//! together is bounded: past it the connection holding the most is refused, and the flood's
//! own sockets are told so. Two whole nodes (core, block store, tcp plane, control channel)
//! and control channels speaking for the flood, all driven by hand on the test's thread on
//! 127.0.0.1.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kvpeer::node::build::{build, NodeSpec};
use kvpeer::node::io::NodeIo;
use kvpeer::{NodeConfig, PlaneKind};
use kvpeer_core::LinkLoss;
use kvpeer_core::{JobId, LookupResult, RequestRoles};
use kvpeer_net::control::ChannelEvent;
use kvpeer_net::control::{ControlChannel, ControlConfig};
use kvpeer_proto::{DecodeLimits, KvRequestId, Lookup, Message, OffloadKey, PeerId, RoundSeq};

mod common;
use common::node_io::assert_clean;

const BLOCKS: u64 = 32;
const LEN: u64 = 16 * 1024;

fn free_id() -> PeerId {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    PeerId::new(format!("127.0.0.1:{port}"))
}

fn spec(tag: &str) -> NodeSpec {
    NodeSpec {
        id: free_id(),
        num_blocks: BLOCKS,
        block_len: LEN,
        hash_seed: "42".into(),
        plane: PlaneKind::Tcp,
        ..NodeConfig::local(&format!("sd-{tag}")).spec
    }
}

fn key(n: u64) -> OffloadKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&n.to_be_bytes());
    OffloadKey::from_parts(&h, 0)
}

fn content(n: u64) -> Vec<u8> {
    (0..LEN)
        .map(|i| (n as u8).wrapping_mul(13) ^ (i as u8))
        .collect()
}

/// Steps the consumer, the producer and the flood's channel until `done` holds (10 s at most).
fn run_until(
    c: &mut NodeIo,
    p: &mut NodeIo,
    flood: &mut ControlChannel,
    mut done: impl FnMut(&mut NodeIo, &mut NodeIo) -> bool,
) {
    run_floods_until(c, p, std::slice::from_mut(flood), |c, p, _| done(c, p));
}

/// Steps the consumer, the producer and the flood's channels (their events to `done`, with the
/// index of the channel each came from) until `done` holds (10 s at most).
fn run_floods_until(
    c: &mut NodeIo,
    p: &mut NodeIo,
    floods: &mut [ControlChannel],
    mut done: impl FnMut(&mut NodeIo, &mut NodeIo, Vec<(usize, ChannelEvent)>) -> bool,
) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        let now = Instant::now();
        c.step(now);
        p.step(now);
        let events = floods
            .iter_mut()
            .enumerate()
            .flat_map(|(i, f)| f.recv().into_iter().map(move |e| (i, e)))
            .collect();
        if done(c, p, events) {
            return;
        }
        p.wait(now, Duration::from_millis(1));
    }
    panic!(
        "condition not reached within 10 s: producer decoding {}",
        p.decoding_connections()
    );
}

/// A consumer and a producer holding keys 0..5, with a session between them and a request
/// of the consumer's open; the producer's decoding bounds are `limits`.
fn pair(tag: &str, limits: DecodeLimits) -> (NodeIo, NodeIo, kvpeer_core::Request) {
    let (mut c, mut p) = (
        build(&spec(&format!("{tag}c"))).unwrap(),
        build(&NodeSpec {
            limits,
            ..spec(&format!("{tag}p"))
        })
        .unwrap(),
    );
    let pid = p.core().local().peer_id.clone();
    for n in 0..5 {
        p.core_mut().parent_mut().put(&key(n), &content(n)).unwrap();
    }
    let req = c.core_mut().on_new_request(
        Instant::now(),
        KvRequestId::from("req-1"),
        RequestRoles::kv_source(pid.clone()),
    );
    c.flush(Instant::now());
    run_floods_until(&mut c, &mut p, &mut [], |c, _, _| {
        c.core().session_state(&pid).is_some_and(|s| s.ready)
    });
    (c, p, req)
}

/// Asks the producer for keys 0..7 (`during` checked at the step the answers came) and loads
/// the hits: keys 0..5, byte-exact.
fn lookup_and_load(
    c: &mut NodeIo,
    p: &mut NodeIo,
    floods: &mut [ControlChannel],
    req: &kvpeer_core::Request,
    mut during: impl FnMut(&NodeIo),
) {
    let wanted: Vec<OffloadKey> = (0..7).map(key).collect();
    for k in &wanted {
        c.core_mut().lookup(Instant::now(), req, k);
    }
    c.core_mut().flush_lookups(Instant::now());
    c.flush(Instant::now());
    run_floods_until(c, p, floods, |c, p, _| {
        let answered = wanted
            .iter()
            .all(|k| c.core_mut().lookup(Instant::now(), req, k) != LookupResult::Retry);
        if answered {
            during(p);
        }
        answered
    });
    let hits: Vec<OffloadKey> = wanted
        .iter()
        .filter(|k| c.core_mut().lookup(Instant::now(), req, k) == LookupResult::Hit)
        .cloned()
        .collect();
    assert_eq!(hits, wanted[..5].to_vec());
    let blocks = c.core_mut().parent_mut().reserve(&hits).unwrap();
    c.core_mut().submit_load(
        Instant::now(),
        JobId::new(1),
        req,
        hits.clone(),
        blocks.clone(),
    );
    c.flush(Instant::now());
    run_floods_until(c, p, floods, |c, _, _| c.load_done(JobId::new(1)).is_some());
    assert_eq!(c.take_load_result(JobId::new(1)), Some(true));
    c.core_mut().parent_mut().finish_write(&blocks, true);
    for (n, b) in blocks.iter().enumerate() {
        assert_eq!(
            c.core().parent().read(*b).unwrap(),
            &content(n as u64)[..],
            "key {n}"
        );
    }
}

/// Ends the consumer's request; then nothing is left pinned or open on either side.
fn finish(c: &mut NodeIo, p: &mut NodeIo, req: &kvpeer_core::Request) {
    c.core_mut().finish(Instant::now(), req);
    c.flush(Instant::now());
    run_floods_until(c, p, &mut [], |c, p, _| {
        c.core().stats().client_requests == 0 && p.core().stats().server_requests == 0
    });
    assert_clean(c);
    assert_clean(p);
}

#[test]
fn an_honest_peer_is_served_while_a_huge_lookup_is_still_being_decoded() {
    let (mut c, mut p, req) = pair("h", DecodeLimits::default());
    let pid = p.core().local().peer_id.clone();
    let mut flood = ControlChannel::bind(free_id(), ControlConfig::default()).unwrap();

    // The flood: one lookup of the most keys a message may carry, from a peer without a
    // session (its decoding costs the producer the same either way).
    let huge = Message::Lookup(Lookup {
        kv_request_id: KvRequestId::from("flood"),
        keys: (0..1u64 << 17).map(|n| key(1_000_000 + n)).collect(),
        round_seq: RoundSeq(1),
    });
    flood.send_message(&pid, &huge).unwrap();
    run_until(&mut c, &mut p, &mut flood, |_, p| {
        p.decoding_connections() == 1
    });

    // The honest consumer's lookups are answered, and its blocks loaded, while the flood's
    // is still being decoded.
    lookup_and_load(
        &mut c,
        &mut p,
        std::slice::from_mut(&mut flood),
        &req,
        |p| {
            assert_eq!(
                p.decoding_connections(),
                1,
                "the honest lookups were answered only after the flood's was decoded"
            )
        },
    );

    // The flood's lookup is decoded to its end, and its connection read again: it stays open.
    run_until(&mut c, &mut p, &mut flood, |_, p| {
        p.decoding_connections() == 0
    });
    assert_eq!(p.inbound_connections(), 2, "the consumer's and the flood's");
    finish(&mut c, &mut p, &req);
}

#[test]
fn large_payloads_in_decoding_hold_bounded_memory_and_the_heaviest_is_refused() {
    // Payloads up to 1 MiB: all payloads in decoding may hold 8 MiB together. Each flood
    // lookup is 65,536 empty keys: 131 KB on the wire (262 KB counted, eight of them 2 MB, far
    // within the bound), which decode to 3 MiB of keys; so it is what decoding them holds, not
    // their payloads, that outgrows the bound.
    let limits = DecodeLimits {
        max_payload_bytes: 1 << 20,
        ..DecodeLimits::default()
    };
    let cap = 8 << 20;
    let (mut c, mut p, req) = pair("m", limits);
    let pid = p.core().local().peer_id.clone();
    let lookup = Message::Lookup(Lookup {
        kv_request_id: KvRequestId::from("flood"),
        keys: vec![OffloadKey::from_bytes(&[]); 1 << 16],
        round_seq: RoundSeq(1),
    });
    let payload = lookup.encode().unwrap().len();
    assert!(
        payload >= 64 << 10 && 8 * 2 * payload < cap / 2,
        "{payload}"
    );
    let mut floods: Vec<ControlChannel> = (0..8)
        .map(|_| ControlChannel::bind(free_id(), ControlConfig::default()).unwrap())
        .collect();
    for f in &mut floods {
        f.send_message(&pid, &lookup).unwrap();
    }
    // The producer refuses connections of the flood, the heaviest first, until what it holds
    // is within the bound again; what the flood's sockets hear is the reason.
    let (mut refused, mut most) = (Vec::new(), 0usize);
    run_floods_until(&mut c, &mut p, &mut floods, |_, p, events| {
        most = most.max(p.decoding_held_bytes());
        for (i, e) in events {
            if let ChannelEvent::Lost {
                cause: LinkLoss::RefusedByPeer(reason),
                ..
            } = e
            {
                assert_eq!(&*reason, "too much undecoded input held");
                refused.push(i);
            }
        }
        !refused.is_empty() && p.decoding_connections() == 0
    });
    assert!(
        refused.len() < floods.len(),
        "some of the flood's lookups fit: {refused:?}"
    );
    // Bounded, after every step.
    assert!(most <= cap, "held {most} bytes at most, cap {cap}");
    // The honest consumer is served all along, byte-exact.
    lookup_and_load(&mut c, &mut p, &mut floods, &req, |_| {});
    finish(&mut c, &mut p, &req);
}
