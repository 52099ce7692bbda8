//! Host liveness on one host (docs/behaviour.md, "A host that dies"): when a connection to a
//! host is lost, every other connection to it, in this node and in the engine's other ranks
//! here, is probed at once; the host's answer (its process's bytes, or its kernel's ACK of
//! ours) keeps the session. On loopback every host is up, so what these tests show is the
//! probing and what it spares: a live neighbour, a stopped process (its host's kernel still
//! acknowledges: its own heartbeat judges it), a rank told by another. A host that really dies
//! (nothing acknowledges) is `fleet.rs`'s `a_dead_host_fails_every_ranks_load_at_once...`.
//!
//! The producers are real `kvpeer serve` processes; the consumers `Node`s in this process.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::mpsc;
use std::time::{Duration, Instant};

use kvpeer::synthetic;
use kvpeer::{Node, NodeConfig, NodeError, PlaneKind};
use kvpeer_core::LookupResult;
use kvpeer_proto::{OffloadKey, PeerId};

mod common;
use common::cli::Cli;
use common::Proc;

const BLOCK: u64 = 16 * 1024;

fn keys(range: std::ops::Range<u64>) -> Vec<OffloadKey> {
    range.map(synthetic::key).collect()
}

fn producer() -> (Proc, PeerId) {
    Cli::serve()
        .plane("tcp")
        .pool(64, BLOCK)
        .arg("--fill", 64)
        .start_serving()
}

fn consumer(name: &str, probe_ms: u64, group: Option<(&str, &str)>) -> Node {
    let mut config = NodeConfig::builder(name)
        .num_blocks(64)
        .block_len(BLOCK)
        .plane(PlaneKind::Tcp)
        .set("load_timeout_s", 60)
        .set("lookup_timeout_s", 60)
        .set("host_probe_timeout_ms", probe_ms);
    if let Some((group, rank)) = group {
        config = config
            .set("liveness_group", group)
            .set("liveness_rank", rank);
    }
    Node::start(config.build().unwrap()).unwrap()
}

/// A session to `peer` with `keys` looked up (every one a hit) and one fetch done
/// byte-exact, so the session is up and proven.
fn warm(node: &Node, peer: &PeerId, keys: &[OffloadKey], id: &str) {
    let req = node.request(peer, id).unwrap();
    let found = req.lookup(keys, Duration::from_secs(20)).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    req.fetch(keys, Duration::from_secs(20)).unwrap();
    req.finish();
    for k in keys {
        assert_eq!(
            node.read(k).as_deref(),
            Some(&synthetic::content(k, BLOCK as usize)[..]),
            "{k:?} from {peer}"
        );
    }
}

/// Looks `keys` up at `peer` (hits), stops `peer`'s process, then fetches them on a thread:
/// the load is in flight to a host that answers nothing. The fetch's outcome comes on the
/// receiver with when it came.
fn load_in_flight_to_a_stopped_peer(
    node: &Node,
    peer: &(Proc, PeerId),
    keys: Vec<OffloadKey>,
    id: &str,
) -> mpsc::Receiver<(Result<(), NodeError>, Instant)> {
    let req = node.request(&peer.1, id).unwrap();
    let found = req.lookup(&keys, Duration::from_secs(20)).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    common::stop_process(peer.0.child.id());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let result = req.fetch(&keys, Duration::from_secs(90));
        let _ = tx.send((result, Instant::now()));
        req.finish();
    });
    // The fetch is sent (the load waits for the stopped producer's write).
    std::thread::sleep(Duration::from_millis(300));
    rx
}

fn kill(p: &mut Proc) {
    p.child.kill().unwrap();
    p.child.wait().unwrap();
}

#[test]
fn a_stopped_process_beside_one_that_died_is_probed_but_judged_by_its_own_heartbeat() {
    let mut first = producer();
    let second = producer();
    let node = consumer("liveness-stopped", 1000, None);
    warm(&node, &first.1, &keys(0..4), "warm-first");
    let pending = load_in_flight_to_a_stopped_peer(&node, &second, keys(8..16), "in-flight");
    // Its heartbeat's PING leaves after 2 s of silence and waits, acknowledged by the host
    // long before the probe: the probe must ask the host something new.
    std::thread::sleep(Duration::from_millis(2700));
    let died = Instant::now();
    kill(&mut first.0);
    // The round comes at once; the stopped process's host (this one) acknowledges the probe's
    // PING, so its session stays past the probe's second.
    assert!(
        pending.recv_timeout(Duration::from_secs(3)).is_err(),
        "a session whose host answers is not ended by a probe"
    );
    let stats = node.stats().unwrap();
    assert_eq!(
        stats.host_liveness.probe_rounds, 1,
        "{:?}",
        stats.host_liveness
    );
    assert_eq!(
        stats.host_liveness.probe_losses, 0,
        "{:?}",
        stats.host_liveness
    );
    // Its own heartbeat ends it (PING after 2 s of silence, 10 s to answer), and the host,
    // whose kernel kept acknowledging, is not taken for down.
    let (result, at) = pending.recv_timeout(Duration::from_secs(40)).unwrap();
    result.expect_err("a stopped producer cannot complete a load");
    assert!(at - died >= Duration::from_secs(3), "{:?}", at - died);
    let stats = node.stats().unwrap();
    assert_eq!(
        stats.host_liveness.hosts_down, 0,
        "{:?}",
        stats.host_liveness
    );
    assert_eq!(stats.host_liveness.refused_dials, 0);
}

#[test]
fn a_process_that_dies_leaves_its_live_neighbours_serving_byte_exact() {
    let mut first = producer();
    let second = producer();
    let node = consumer("liveness-neighbours", 1000, None);
    warm(&node, &first.1, &keys(0..4), "warm-first");
    warm(&node, &second.1, &keys(4..8), "warm-second");
    kill(&mut first.0);
    // The probe round comes and goes: the live process answers it.
    std::thread::sleep(Duration::from_millis(1500));
    warm(&node, &second.1, &keys(8..16), "after");
    let stats = node.stats().unwrap();
    assert_eq!(
        stats.host_liveness.probe_rounds, 1,
        "the neighbour was probed"
    );
    assert_eq!(stats.host_liveness.probe_losses, 0);
    assert_eq!(stats.host_liveness.refused_dials, 0);
    assert_eq!(
        stats.counters.sessions_closed, 1,
        "only the dead process's session ended"
    );
}

#[test]
fn a_rank_that_loses_a_host_connection_has_the_engines_other_ranks_probe_theirs() {
    let group = format!("test-{}", std::process::id());
    let mut first = producer();
    let second = producer();
    // Rank 0 talks to the host's first process only, rank 1 to its second only: rank 1 has
    // nothing of its own that would notice the first one's end.
    let rank0 = consumer("liveness-rank0", 1000, Some((&group, "0/2")));
    let rank1 = consumer("liveness-rank1", 1000, Some((&group, "1/2")));
    let alone = consumer("liveness-alone", 1000, None);
    warm(&rank0, &first.1, &keys(0..4), "warm-first");
    warm(&rank1, &second.1, &keys(4..8), "warm-second");
    warm(&alone, &second.1, &keys(4..8), "warm-alone");
    kill(&mut first.0);
    // Rank 0 tells rank 1, which probes its connection to the host at once; the node outside
    // the group hears nothing.
    let deadline = Instant::now() + Duration::from_secs(10);
    while rank1.stats().unwrap().host_liveness.probe_rounds == 0 {
        assert!(Instant::now() < deadline, "rank 1 was never told");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(rank0.stats().unwrap().host_liveness.probe_rounds, 1);
    assert_eq!(alone.stats().unwrap().host_liveness.probe_rounds, 0);
    // The host answered rank 1's probe: its session serves on, byte-exact.
    std::thread::sleep(Duration::from_millis(1500));
    warm(&rank1, &second.1, &keys(8..16), "after");
    let stats = rank1.stats().unwrap();
    assert_eq!(stats.host_liveness.probe_losses, 0);
    assert_eq!(stats.counters.sessions_closed, 0);
}
