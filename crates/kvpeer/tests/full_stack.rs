//! Two whole nodes in one process on 127.0.0.1: each a core over a real block store, a real data
//! plane (shm, then tcp) and the real ZeroMQ control channel, driven by the node's I/O step.
//! Handshake, lookups with hits and misses, fetch with byte-exact verification, terminal fetch,
//! abort; afterwards nothing pinned, written or open on either side. Each node's pool is the
//! memory its plane needs: a `/dev/shm` object for shm and both, anonymous huge pages for tcp.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kvpeer::node::build::{build, NodeSpec};
use kvpeer::node::io::NodeIo;
use kvpeer::{NodeConfig, PlaneKind};
use kvpeer_core::{JobId, LookupResult, RequestRoles};
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

mod common;
use common::node_io::{assert_clean, step_both_until};
use common::pool_memory::assert_pool_memory;

const BLOCKS: u64 = 32;
const LEN: u64 = 16 * 1024;

fn spec(tag: &str) -> NodeSpec {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    NodeSpec {
        id: PeerId::new(format!("127.0.0.1:{port}")),
        num_blocks: BLOCKS,
        block_len: LEN,
        hash_seed: "42".into(),
        ..NodeConfig::local(&format!("fs-{tag}")).spec
    }
}

fn key(n: u64) -> OffloadKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&n.to_be_bytes());
    OffloadKey::from_parts(&h, 0)
}

fn content(n: u64) -> Vec<u8> {
    (0..LEN)
        .map(|i| (n as u8).wrapping_mul(7) ^ (i as u8))
        .collect()
}

/// Steps both nodes until `done` holds (bounded: 10 s).
fn run_until(a: &mut NodeIo, b: &mut NodeIo, done: impl FnMut(&mut NodeIo, &mut NodeIo) -> bool) {
    step_both_until(a, b, Duration::from_secs(10), done);
}

/// Shares blocks between two nodes on `plane`, whose pools must be shared `/dev/shm` objects
/// (`shared_pool`: a peer maps them) or private anonymous memory in huge pages.
fn share(plane: PlaneKind, tag: &str, shared_pool: bool) {
    let spec = |tag: &str| NodeSpec { plane, ..spec(tag) };
    let (mut c, mut p) = (
        build(&spec(&format!("{tag}c"))).unwrap(),
        build(&spec(&format!("{tag}p"))).unwrap(),
    );
    assert_pool_memory(c.core().parent().pool(), shared_pool);
    assert_pool_memory(p.core().parent().pool(), shared_pool);
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
    run_until(&mut c, &mut p, |c, _| {
        c.core().session_state(&pid).is_some_and(|s| s.ready)
    });

    let wanted: Vec<OffloadKey> = (0..7).map(key).collect();
    for k in &wanted {
        c.core_mut().lookup(Instant::now(), &req, k);
    }
    c.core_mut().flush_lookups(Instant::now());
    c.flush(Instant::now());
    run_until(&mut c, &mut p, |c, _| {
        wanted
            .iter()
            .all(|k| c.core_mut().lookup(Instant::now(), &req, k) != LookupResult::Retry)
    });
    let hits: Vec<OffloadKey> = wanted
        .iter()
        .filter(|k| c.core_mut().lookup(Instant::now(), &req, k) == LookupResult::Hit)
        .cloned()
        .collect();
    assert_eq!(hits, wanted[..5].to_vec());

    let blocks = c.core_mut().parent_mut().reserve(&hits).unwrap();
    c.core_mut().submit_load(
        Instant::now(),
        JobId::new(1),
        &req,
        hits.clone(),
        blocks.clone(),
    );
    c.flush(Instant::now());
    run_until(&mut c, &mut p, |c, _| c.load_done(JobId::new(1)).is_some());
    assert_eq!(c.take_load_result(JobId::new(1)), Some(true));
    c.core_mut().parent_mut().finish_write(&blocks, true);
    for (n, b) in blocks.iter().enumerate() {
        assert_eq!(
            c.core().parent().read(*b).unwrap(),
            &content(n as u64)[..],
            "key {n}"
        );
    }

    // A second request that misses everything: its finish sends the terminal fetch.
    let miss = c.core_mut().on_new_request(
        Instant::now(),
        KvRequestId::from("req-2"),
        RequestRoles::kv_source(pid.clone()),
    );
    c.core_mut().lookup(Instant::now(), &miss, &key(99));
    c.core_mut().flush_lookups(Instant::now());
    c.flush(Instant::now());
    run_until(&mut c, &mut p, |c, _| {
        c.core_mut().lookup(Instant::now(), &miss, &key(99)) == LookupResult::Miss
    });
    // A PD load the producer never serves: finishing aborts it, the producer acks.
    let pd = c.core_mut().on_new_request(
        Instant::now(),
        KvRequestId::from("req-3"),
        RequestRoles::prefiller(pid.clone()),
    );
    let pd_blocks = c.core_mut().parent_mut().reserve(&[key(50)]).unwrap();
    c.core_mut().submit_load(
        Instant::now(),
        JobId::new(2),
        &pd,
        vec![key(50)],
        pd_blocks.clone(),
    );
    for r in [&req, &miss, &pd] {
        c.core_mut().finish(Instant::now(), r);
    }
    c.flush(Instant::now());
    run_until(&mut c, &mut p, |c, p| {
        c.load_done(JobId::new(2)) == Some(false) && p.core().stats().server_requests == 0
    });
    assert_eq!(c.take_load_result(JobId::new(2)), Some(false));
    // Every result was taken once; store results are never kept.
    assert!(c.waiting_load_results() == 0 && p.waiting_load_results() == 0);
    c.core_mut().parent_mut().finish_write(&pd_blocks, false);
    for n in [&c, &p] {
        assert_clean(n);
        let s = n.core().parent().stats();
        assert_eq!(s.open_contexts, 0, "{s:?}");
    }
}

#[test]
fn two_nodes_over_zeromq_and_shm() {
    share(PlaneKind::Shm, "shm", true);
}

#[test]
fn two_nodes_over_zeromq_and_tcp() {
    share(PlaneKind::Tcp, "tcp", false);
}

#[test]
fn two_nodes_over_zeromq_with_both_planes_advertised() {
    share(PlaneKind::Both, "dual", true);
}
