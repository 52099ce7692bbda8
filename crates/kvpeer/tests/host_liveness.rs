//! Host liveness (docs/behaviour.md, "A host that dies"): when one connection to a host is
//! lost, every session to that host, in this node and in the engine's other ranks on this
//! host, fails its loads at once instead of each waiting out its own heartbeat (vLLM's issue
//! 56828: a sibling rank's load ran its whole timeout, 36–43 s).
//!
//! The producers are real `kvpeer serve` processes on this host. A host that dies is played
//! by two of them: one killed (its kernel closes its connections, as when a host's processes
//! go first), the other stopped with SIGSTOP (it answers nothing, as a host that vanished from
//! the network: its kernel still takes TCP, so only the heartbeat, or a probe, finds it out).
//! The consumers are `Node`s in this process; their heartbeat finds a silent peer after 12 s
//! (PING after 2 s of silence, 10 s to answer), their loads time out after 60 s here.

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

/// Well below the 12 s a heartbeat takes and the 60 s load timeout: the probe (1 s) and the
/// scheduling of a loaded 2-core machine.
const AT_ONCE: Duration = Duration::from_secs(6);

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
fn a_host_that_dies_fails_the_load_to_its_other_process_at_once_and_is_not_dialed_meanwhile() {
    let mut first = producer();
    let second = producer();
    let node = consumer("liveness-one", 1000, None);
    warm(&node, &first.1, &keys(0..4), "warm-first");
    let pending = load_in_flight_to_a_stopped_peer(&node, &second, keys(8..16), "in-flight");

    // The host dies: its first process's connections close.
    let died = Instant::now();
    kill(&mut first.0);
    let (result, at) = pending
        .recv_timeout(Duration::from_secs(40))
        .expect("the load to the silent process never ended");
    let after = at - died;
    let error = result.expect_err("a stopped producer cannot complete a load");
    assert!(
        after < AT_ONCE,
        "the load to the host's other process failed {after:?} after the host died (its own \
         heartbeat takes 12 s): {error}"
    );
    let stats = node.stats().unwrap();
    assert_eq!(
        stats.host_liveness.probe_losses, 1,
        "the load failed because its connection answered no probe: {:?}",
        stats.host_liveness
    );

    // Nothing on the host answered and nothing is left that does: a new session to it fails
    // at once, saying why, instead of waiting for a handshake the stopped process never gives.
    let asked = Instant::now();
    let refused = node
        .connect(&second.1, Duration::from_secs(30))
        .expect_err("no session with a host taken for down");
    let took = asked.elapsed();
    assert!(
        took < Duration::from_secs(3),
        "refused after {took:?}: {refused}"
    );
    assert!(refused.to_string().contains("taken for down"), "{refused}");
    let stats = node.stats().unwrap();
    assert_eq!(
        stats.host_liveness.refused_dials, 1,
        "{:?}",
        stats.host_liveness
    );
    assert_eq!(
        stats.host_liveness.hosts_down, 1,
        "{:?}",
        stats.host_liveness
    );
}

#[test]
fn without_host_liveness_the_load_waits_for_its_own_heartbeat() {
    let mut first = producer();
    let second = producer();
    let node = consumer("liveness-off", 0, None);
    warm(&node, &first.1, &keys(0..4), "warm-first");
    let pending = load_in_flight_to_a_stopped_peer(&node, &second, keys(8..16), "in-flight");
    let died = Instant::now();
    kill(&mut first.0);
    assert!(
        pending.recv_timeout(AT_ONCE).is_err(),
        "with host_probe_timeout_ms 0 the load must wait for its own connection's heartbeat"
    );
    let (result, at) = pending.recv_timeout(Duration::from_secs(40)).unwrap();
    result.expect_err("a stopped producer cannot complete a load");
    assert!(at - died >= AT_ONCE);
    let stats = node.stats().unwrap();
    assert_eq!(stats.host_liveness.probe_losses, 0);
    assert_eq!(stats.host_liveness.hosts_down, 0);
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
    assert_eq!(stats.host_liveness.probe_losses, 0);
    assert_eq!(stats.host_liveness.refused_dials, 0);
    assert_eq!(
        stats.counters.sessions_closed, 1,
        "only the dead process's session ended"
    );
}

#[test]
fn a_rank_that_loses_a_host_tells_the_engines_other_ranks_which_fail_their_loads_at_once() {
    let group = format!("test-{}", std::process::id());
    let mut first = producer();
    let second = producer();
    // Rank 0 talks to the host's first process only, rank 1 to its second only: rank 1 has
    // nothing of its own that would notice the first one's end.
    let rank0 = consumer("liveness-rank0", 1000, Some((&group, "0/2")));
    let rank1 = consumer("liveness-rank1", 1000, Some((&group, "1/2")));
    warm(&rank0, &first.1, &keys(0..4), "warm-first");
    let pending = load_in_flight_to_a_stopped_peer(&rank1, &second, keys(8..16), "in-flight");
    let died = Instant::now();
    kill(&mut first.0);
    let (result, at) = pending
        .recv_timeout(Duration::from_secs(40))
        .expect("rank 1's load never ended");
    let after = at - died;
    let error = result.expect_err("a stopped producer cannot complete a load");
    assert!(
        after < AT_ONCE,
        "rank 1's load failed {after:?} after rank 0 lost the host: {error}"
    );
    assert_eq!(
        rank1.stats().unwrap().host_liveness.probe_losses,
        1,
        "rank 1's connection ended for its unanswered probe"
    );
}
