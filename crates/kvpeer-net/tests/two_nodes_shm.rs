//! Two nodes in one process, each a real core over a real block store and the shm plane:
//! handshake, lookup with hits and misses, fetch, byte-exact verification, terminal fetch,
//! abort, and no pins left anywhere.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::{Core, CoreConfig, Event, LocalNode, LookupResult, Request, RequestRoles};
use kvpeer_net::metadata::AgentMetadata;
use kvpeer_net::shm::ShmPlane;
use kvpeer_proto::{KvRequestId, Message, OffloadKey, PeerId};
use kvpeer_store::{BlockStore, StoreConfig};

const BLOCKS: u64 = 64;
const LEN: u64 = 16 * 1024;

type NodeCore = Core<BlockStore, ShmPlane>;

struct Node {
    core: NodeCore,
    id: PeerId,
    wakes: Arc<AtomicUsize>,
    events: Vec<Event>,
}

fn node(i: u16) -> Node {
    let name = format!("kvpeer-it-{i}-{}", std::process::id());
    let store = BlockStore::new(&StoreConfig {
        shm_name: name.clone(),
        num_blocks: BLOCKS,
        block_len: LEN,
        lock_memory: false,
    })
    .unwrap();
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    let plane = ShmPlane::new(
        &name,
        BLOCKS,
        LEN,
        Arc::new(move || {
            w.fetch_add(1, Ordering::SeqCst);
        }),
    )
    .unwrap();
    let id = PeerId::new(format!("127.0.0.1:{}", 5800 + i));
    let local = LocalNode {
        peer_id: id.clone(),
        agent_metadata: AgentMetadata {
            agent: format!("node-{i}"),
            shm: Some(name),
            tcp: None,
        }
        .encode(),
        base_addr: store.region().base_addr(),
        num_blocks: BLOCKS,
        block_len: LEN,
        config_fingerprint: String::new(),
        hash_seed: "42".into(),
    };
    Node {
        core: Core::new(CoreConfig::default(), local, store, plane, Instant::now()),
        id,
        wakes,
        events: Vec::new(),
    }
}

fn key(n: u64) -> OffloadKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&n.to_be_bytes());
    OffloadKey::from_parts(&h, 0)
}

fn content(n: u64) -> Vec<u8> {
    (0..LEN)
        .map(|i| (n as u8) ^ (i as u8).wrapping_mul(31))
        .collect()
}

/// Moves `from`'s messages to `to` (through the codec) and collects `from`'s events.
fn deliver(from: &mut Node, to: &mut Node) -> bool {
    let mut moved = false;
    while let Some(t) = from.core.poll_transmit() {
        moved = true;
        let payload = t.message.encode().unwrap();
        to.core.handle_payload(Instant::now(), &from.id, &payload);
    }
    while let Some(e) = from.core.poll_event() {
        from.events.push(e);
    }
    moved
}

/// Moves messages both ways until nothing moves.
fn pump(a: &mut Node, b: &mut Node) {
    for _ in 0..100 {
        let ab = deliver(a, b);
        let ba = deliver(b, a);
        if !ab && !ba {
            return;
        }
    }
    panic!("no quiescence");
}

/// Waits (bounded) for the producer's copies, then feeds the completions.
fn settle_writes(p: &mut Node, c: &mut Node) {
    for _ in 0..200 {
        if p.core.plane().inflight() == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(p.core.plane().inflight(), 0, "copies finished");
    p.core.handle_data_plane(Instant::now());
    pump(p, c);
}

fn open(c: &mut Node, p: &Node, rid: &str) -> Request {
    let roles = RequestRoles::kv_source(p.id.clone());
    c.core
        .on_new_request(Instant::now(), KvRequestId::from(rid), roles)
}

#[test]
fn two_nodes_share_blocks_over_shm_byte_for_byte() {
    let (mut c, mut p) = (node(1), node(2));
    for n in 0..6 {
        p.core.parent_mut().put(&key(n), &content(n)).unwrap();
    }
    let req = open(&mut c, &p, "req-1");
    pump(&mut c, &mut p);
    assert!(c.core.session_state(&p.id).unwrap().ready, "handshake done");

    let wanted: Vec<OffloadKey> = (0..8).map(key).collect();
    for k in &wanted {
        assert_eq!(c.core.lookup(Instant::now(), &req, k), LookupResult::Retry);
    }
    c.core.flush_lookups(Instant::now());
    pump(&mut c, &mut p);
    let hits: Vec<OffloadKey> = wanted
        .iter()
        .filter(|k| c.core.lookup(Instant::now(), &req, k) == LookupResult::Hit)
        .cloned()
        .collect();
    assert_eq!(hits, wanted[..6].to_vec(), "keys 6 and 7 miss");

    let blocks = c.core.parent_mut().reserve(&hits).unwrap();
    c.core
        .submit_load(Instant::now(), 1, &req, hits.clone(), blocks.clone());
    pump(&mut c, &mut p);
    settle_writes(&mut p, &mut c);
    assert!(
        p.wakes.load(Ordering::SeqCst) >= 1,
        "the worker woke the runtime"
    );
    let done = c.events.iter().find_map(|e| match e {
        Event::LoadDone {
            job: 1, success, ..
        } => Some(*success),
        _ => None,
    });
    assert_eq!(done, Some(true));
    c.core.parent_mut().finish_write(&blocks, true);
    for (n, block) in blocks.iter().enumerate() {
        assert_eq!(
            c.core.parent().read(*block).unwrap(),
            &content(n as u64)[..],
            "block for key {n}"
        );
    }
    assert_eq!(
        c.core.parent_mut().lookup(&key(3)),
        LookupResult::Hit,
        "the consumer now holds the prefix"
    );

    c.core.finish(Instant::now(), &req);
    pump(&mut c, &mut p);
    for n in [&c, &p] {
        let s = n.core.parent().stats();
        assert_eq!(
            (s.pinned, s.jobs, s.writing, s.open_contexts),
            (0, 0, 0, 0),
            "{s:?}"
        );
    }
}

#[test]
fn an_all_miss_request_sends_the_terminal_fetch_and_an_abort_is_acked() {
    let (mut c, mut p) = (node(3), node(4));
    p.core.parent_mut().put(&key(1), &content(1)).unwrap();
    let req = open(&mut c, &p, "req-2");
    pump(&mut c, &mut p);
    c.core.lookup(Instant::now(), &req, &key(9));
    c.core.flush_lookups(Instant::now());
    pump(&mut c, &mut p);
    assert_eq!(
        c.core.lookup(Instant::now(), &req, &key(9)),
        LookupResult::Miss
    );
    c.core.finish(Instant::now(), &req);
    let sent: Vec<Message> = std::iter::from_fn(|| c.core.poll_transmit())
        .map(|t| t.message)
        .collect();
    assert!(
        matches!(&sent[..], [Message::Fetch(f)] if f.is_terminal()),
        "{sent:?}"
    );

    // A PD load whose blocks the producer never has: the consumer aborts, the producer acks.
    let pd = c.core.on_new_request(
        Instant::now(),
        KvRequestId::from("req-3"),
        RequestRoles::prefiller(p.id.clone()),
    );
    let blocks = c.core.parent_mut().reserve(&[key(5)]).unwrap();
    c.core
        .submit_load(Instant::now(), 7, &pd, vec![key(5)], blocks.clone());
    pump(&mut c, &mut p);
    c.core.finish(Instant::now(), &pd);
    pump(&mut c, &mut p);
    let failed = c.events.iter().any(|e| {
        matches!(
            e,
            Event::LoadDone {
                job: 7,
                success: false,
                ..
            }
        )
    });
    assert!(failed, "the abort_ack ends the load");
    c.core.parent_mut().finish_write(&blocks, false);
    assert_eq!(c.core.parent_mut().lookup(&key(5)), LookupResult::Miss);
    for n in [&c, &p] {
        let s = n.core.parent().stats();
        assert_eq!((s.pinned, s.jobs, s.writing), (0, 0, 0), "{s:?}");
    }
}
