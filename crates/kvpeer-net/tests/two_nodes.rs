//! Two nodes in one process, each a real core over a real block store and a real data plane
//! (every scenario runs on shm and on tcp): handshake, lookup with hits and misses, fetch,
//! byte-exact verification, terminal fetch, abort, and no pins left anywhere.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::{
    Core, CoreConfig, DataPlane, Event, JobId, LocalNode, LookupResult, Request, RequestRoles,
};
use kvpeer_net::data::dual::{DualPlane, Route};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::shm::{ShmPlane, Wake};
use kvpeer_net::data::tcp::TcpPlane;
use kvpeer_proto::{KvRequestId, Message, OffloadKey, PeerId};
use kvpeer_store::{BlockStore, Pool, StoreConfig};

const BLOCKS: u64 = 64;
const LEN: u64 = 16 * 1024;

/// A data plane these tests can wait on.
trait Plane: DataPlane + Sized {
    /// Makes the plane for node `id` over `pool`; returns it and what it advertises.
    fn make(id: &PeerId, pool: &Pool, wake: Wake) -> (Self, AgentMetadata);
    fn inflight(&self) -> usize;
    /// The plane that carries writes to `peer`.
    fn route(&self, peer: &PeerId) -> &'static str;
}

impl Plane for ShmPlane {
    fn make(id: &PeerId, pool: &Pool, wake: Wake) -> (Self, AgentMetadata) {
        let plane = ShmPlane::new(id.clone(), pool.view().clone(), wake).unwrap();
        let meta = AgentMetadata {
            agent: id.to_string(),
            shm: pool.shm_name().map(str::to_owned),
            tcp: None,
            ..Default::default()
        };
        (plane, meta)
    }
    fn inflight(&self) -> usize {
        ShmPlane::inflight(self)
    }
    fn route(&self, _: &PeerId) -> &'static str {
        "shm"
    }
}

impl Plane for TcpPlane {
    fn make(id: &PeerId, pool: &Pool, wake: Wake) -> (Self, AgentMetadata) {
        let plane = TcpPlane::new(id.clone(), pool.writer(), "127.0.0.1:0", wake).unwrap();
        let tcp = Some(plane.addr().to_string());
        (
            plane,
            AgentMetadata {
                agent: id.to_string(),
                shm: None,
                tcp,
                ..Default::default()
            },
        )
    }
    fn inflight(&self) -> usize {
        TcpPlane::inflight(self)
    }
    fn route(&self, _: &PeerId) -> &'static str {
        "tcp"
    }
}

impl Plane for DualPlane {
    fn make(id: &PeerId, pool: &Pool, wake: Wake) -> (Self, AgentMetadata) {
        let (shm, _) = ShmPlane::make(id, pool, wake.clone());
        let (tcp, meta) = TcpPlane::make(id, pool, wake);
        let meta = AgentMetadata {
            shm: pool.shm_name().map(str::to_owned),
            ..meta
        };
        (DualPlane::new(shm, tcp), meta)
    }
    fn inflight(&self) -> usize {
        DualPlane::inflight(self)
    }
    fn route(&self, peer: &PeerId) -> &'static str {
        match DualPlane::route(self, peer) {
            Some(Route::Shm) => "shm",
            Some(Route::Tcp) => "tcp",
            None => "none",
        }
    }
}

struct Node<P: Plane> {
    core: Core<BlockStore, P>,
    id: PeerId,
    wakes: Arc<AtomicUsize>,
    events: Vec<Event>,
}

fn node<P: Plane>(i: u16) -> Node<P> {
    node_with::<P>(i, true)
}

/// A node; with `shm_reachable` false it advertises an shm object no one can open (as a peer on
/// another host would).
fn node_with<P: Plane>(i: u16, shm_reachable: bool) -> Node<P> {
    let name = format!("kvpeer-it-{i}-{}", std::process::id());
    let config = StoreConfig {
        shm_name: name.clone(),
        num_blocks: BLOCKS,
        block_len: LEN,
        lock_memory: false,
    };
    let store = BlockStore::new(&config).unwrap();
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    let id = PeerId::new(format!("127.0.0.1:{}", 5800 + i));
    let wake: Wake = Arc::new(move || {
        w.fetch_add(1, Ordering::SeqCst);
    });
    let (plane, mut meta) = P::make(&id, store.pool(), wake);
    if !shm_reachable {
        meta.shm = Some(format!("kvpeer-not-on-this-host-{i}"));
    }
    let local = LocalNode {
        peer_id: id.clone(),
        agent_metadata: meta.encode(),
        base_addr: store.pool().base_addr(),
        num_blocks: BLOCKS,
        block_len: LEN,
        config_fingerprint: String::new(),
        hash_seed: "42".into(),
    };
    let core = Core::new(CoreConfig::default(), local, store, plane, Instant::now());
    Node {
        core,
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
fn deliver<P: Plane>(from: &mut Node<P>, to: &mut Node<P>) -> bool {
    let mut moved = false;
    while let Some(mut t) = from.core.poll_transmit() {
        moved = true;
        // As the node does before a `connect` leaves: the planes' per-destination fields.
        if let Message::Connect(c) = &mut t.message {
            c.agent_metadata =
                from.core
                    .plane_mut()
                    .connect_metadata(&t.peer, None, &c.agent_metadata);
        }
        let payload = t.message.encode().unwrap();
        to.core.handle_payload(Instant::now(), &from.id, &payload);
    }
    while let Some(e) = from.core.poll_event() {
        from.events.push(e);
    }
    moved
}

/// Moves messages both ways until nothing moves.
fn pump<P: Plane>(a: &mut Node<P>, b: &mut Node<P>) {
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
fn settle_writes<P: Plane>(p: &mut Node<P>, c: &mut Node<P>) {
    for _ in 0..400 {
        if p.core.plane().inflight() == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(p.core.plane().inflight(), 0, "writes finished");
    p.core.handle_data_plane(Instant::now());
    pump(p, c);
}

/// Lets asynchronous registrations land (tcp dials off the core's thread).
fn handshake<P: Plane>(c: &mut Node<P>, p: &mut Node<P>) {
    for _ in 0..400 {
        pump(c, p);
        c.core.handle_data_plane(Instant::now());
        p.core.handle_data_plane(Instant::now());
        pump(c, p);
        if c.core.session_state(&p.id).is_some_and(|s| s.ready)
            && p.core.session_state(&c.id).is_some_and(|s| s.ready)
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("no handshake");
}

fn open<P: Plane>(c: &mut Node<P>, p: &Node<P>, rid: &str) -> Request {
    let roles = RequestRoles::kv_source(p.id.clone());
    c.core
        .on_new_request(Instant::now(), KvRequestId::from(rid), roles)
}

#[test]
fn two_nodes_share_blocks_over_shm_byte_for_byte() {
    share_blocks::<ShmPlane>(1, true, "shm");
}

#[test]
fn two_nodes_share_blocks_over_tcp_byte_for_byte() {
    share_blocks::<TcpPlane>(11, true, "tcp");
}

#[test]
fn both_planes_advertised_the_writer_uses_shm_on_one_host() {
    share_blocks::<DualPlane>(21, true, "shm");
}

#[test]
fn both_planes_advertised_the_writer_falls_back_to_tcp_when_shm_cannot_open() {
    share_blocks::<DualPlane>(23, false, "tcp");
}

fn share_blocks<P: Plane>(first: u16, shm_reachable: bool, route: &str) {
    let (mut c, mut p) = (node_with::<P>(first, shm_reachable), node::<P>(first + 1));
    for n in 0..6 {
        p.core.parent_mut().put(&key(n), &content(n)).unwrap();
    }
    let req = open(&mut c, &p, "req-1");
    handshake(&mut c, &mut p);

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

    assert_eq!(p.core.plane().route(&c.id), route, "the producer's plane");
    let blocks = c.core.parent_mut().reserve(&hits).unwrap();
    c.core.submit_load(
        Instant::now(),
        JobId::new(1),
        &req,
        hits.clone(),
        blocks.clone(),
    );
    pump(&mut c, &mut p);
    settle_writes(&mut p, &mut c);
    assert!(
        p.wakes.load(Ordering::SeqCst) >= 1,
        "the worker woke the runtime"
    );
    let done = c.events.iter().find_map(|e| match e {
        Event::LoadDone { job, success, .. } if *job == JobId::new(1) => Some(*success),
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
fn terminal_fetch_and_abort_over_shm() {
    miss_and_abort::<ShmPlane>(3);
}

#[test]
fn terminal_fetch_and_abort_over_tcp() {
    miss_and_abort::<TcpPlane>(13);
}

fn miss_and_abort<P: Plane>(first: u16) {
    let (mut c, mut p) = (node::<P>(first), node::<P>(first + 1));
    p.core.parent_mut().put(&key(1), &content(1)).unwrap();
    let req = open(&mut c, &p, "req-2");
    handshake(&mut c, &mut p);
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
    c.core.submit_load(
        Instant::now(),
        JobId::new(7),
        &pd,
        vec![key(5)],
        blocks.clone(),
    );
    pump(&mut c, &mut p);
    c.core.finish(Instant::now(), &pd);
    pump(&mut c, &mut p);
    let failed = c.events.iter().any(|e| {
        matches!(
            e,
            Event::LoadDone {
                job,
                success: false,
                ..
            } if *job == JobId::new(7)
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

#[test]
fn a_transfer_done_right_after_the_producers_disconnect_settles_the_load_over_shm() {
    done_after_goodbye::<ShmPlane>(31);
}

#[test]
fn a_transfer_done_right_after_the_producers_disconnect_settles_the_load_over_tcp() {
    done_after_goodbye::<TcpPlane>(33);
}

/// The producer's `transfer_done` reaches the consumer right after its `disconnect` (vLLM 0.34
/// settles such a buffered terminal): the load counts and its blocks are byte-exact. A
/// `transfer_done` that comes only after the consumer's next turn (a deadline) is not taken:
/// by then the session is reaped and the load failed.
fn done_after_goodbye<P: Plane>(first: u16) {
    for next_turn_between in [false, true] {
        let (mut c, mut p) = (node::<P>(first), node::<P>(first + 1));
        for n in 0..2 {
            p.core.parent_mut().put(&key(n), &content(n)).unwrap();
        }
        let req = open(&mut c, &p, "req-4");
        handshake(&mut c, &mut p);
        let wanted = vec![key(0), key(1)];
        for k in &wanted {
            c.core.lookup(Instant::now(), &req, k);
        }
        c.core.flush_lookups(Instant::now());
        pump(&mut c, &mut p);
        let blocks = c.core.parent_mut().reserve(&wanted).unwrap();
        c.core.submit_load(
            Instant::now(),
            JobId::new(1),
            &req,
            wanted.clone(),
            blocks.clone(),
        );
        pump(&mut c, &mut p);
        for _ in 0..400 {
            if p.core.plane().inflight() == 0 {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        p.core.handle_data_plane(Instant::now());
        let held: Vec<Message> = std::iter::from_fn(|| p.core.poll_transmit())
            .map(|t| t.message)
            .collect();
        assert!(
            matches!(&held[..], [Message::TransferDone(t)] if t.success),
            "{held:?}"
        );
        c.core
            .handle_message(Instant::now(), &p.id, Message::DISCONNECT);
        if next_turn_between {
            c.core.handle_timeout(Instant::now());
        }
        for message in held {
            let payload = message.encode().unwrap();
            c.core.handle_payload(Instant::now(), &p.id, &payload);
        }
        c.core.handle_timeout(Instant::now());
        while let Some(e) = c.core.poll_event() {
            c.events.push(e);
        }
        let done = c.events.iter().find_map(|e| match e {
            Event::LoadDone { job, success, .. } if *job == JobId::new(1) => Some(*success),
            _ => None,
        });
        assert_eq!(done, Some(!next_turn_between), "{next_turn_between}");
        assert!(c.core.session_state(&p.id).is_none(), "the session ended");
        c.core
            .parent_mut()
            .finish_write(&blocks, !next_turn_between);
        if !next_turn_between {
            for (n, block) in blocks.iter().enumerate() {
                assert_eq!(
                    c.core.parent().read(*block).unwrap(),
                    &content(n as u64)[..],
                    "block for key {n}"
                );
            }
        }
        c.core.finish(Instant::now(), &req);
        assert_eq!(c.core.parent().stats().pinned, 0);
    }
}
