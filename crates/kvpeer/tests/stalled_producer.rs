//! A producer that stalls past every timeout of a load, then resumes, must not land a byte in a
//! block the consumer has given to another key meanwhile (docs/security.md, "Wrong KV after a
//! failed load").
//!
//! The stalling producer is a real `kvpeer serve` process, stopped with SIGSTOP after the
//! consumer's lookup and before its fetch arrives (so its write is still to come), and resumed
//! with SIGCONT once the consumer's load failed and its blocks were filled by an honest
//! producer (another real process) with other keys. Every block of those keys is then read
//! from the consumer's pool, byte for byte. Before the fence (6d26cca), on shm, the resumed
//! producer copied its keys over them: the consumer's pool held key A's bytes for key B.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use kvpeer::synthetic;
use kvpeer::{Node, NodeConfig, PlaneKind};
use kvpeer_core::LookupResult;
use kvpeer_proto::OffloadKey;

mod common;
use common::cli::Cli;
use common::{http_get, metrics_addr, samples, Proc};

const BLOCK: u64 = 64 * 1024;
/// The consumer's pool on shm and tcp: exactly one load's worth, so the honest load takes the
/// failed one's blocks once they are fenced.
const CONSUMER_BLOCKS: u64 = 8;
/// On nixl: more. A stalled producer's blocks stay held there until it confirms or its agent
/// is replaced (nothing on our side can revoke a NIXL writer), so the honest loads take the
/// others; before that fence, the first took the failed load's blocks (they are free first).
const CONSUMER_BLOCKS_NIXL: u64 = 20;

fn signal(p: &Proc, sig: &str) {
    let pid = p.child.id().to_string();
    let ok = Command::new("kill").args([sig, &pid]).status().unwrap();
    assert!(ok.success(), "kill {sig} {pid}");
}

/// Resumes the stopped producer even when an assertion fails first (a stopped child would be
/// killed by its own guard anyway; this keeps its logs readable).
struct Resume<'a>(&'a Proc, bool);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        if !self.1 {
            signal(self.0, "-CONT");
        }
    }
}

fn keys(range: std::ops::Range<u64>) -> Vec<OffloadKey> {
    range.map(synthetic::key).collect()
}

/// A `kvpeer serve` on `plane` (with NIXL's library where the plane is nixl).
fn serve(plane: &str, fill: u64) -> Cli {
    let cli = Cli::serve()
        .plane(plane)
        .pool(32, BLOCK)
        .arg("--fill", fill)
        .arg("--metrics", "127.0.0.1:0");
    match plane {
        "nixl" => cli.arg("--nixl-lib-dir", common::vllm::nixl_lib_dir()),
        _ => cli,
    }
}

fn stalled_producer_never_writes_a_reused_block(plane: &str, kind: PlaneKind) {
    if kind == PlaneKind::Nixl {
        common::vllm::ucx_env();
    }
    let (stalling, stalling_id) = serve(plane, 16).start_serving();
    let (honest, honest_id) = serve(plane, 32).start_serving();
    let blocks = match kind {
        PlaneKind::Nixl => CONSUMER_BLOCKS_NIXL,
        _ => CONSUMER_BLOCKS,
    };
    let mut config = NodeConfig::builder("stall-consumer")
        .num_blocks(blocks)
        // Both producers are on this host (loopback): its share of held blocks is the pool.
        .set("max_pins_per_peer", blocks)
        .block_len(BLOCK)
        .plane(kind)
        .set("load_timeout_s", 1)
        .set("abort_ack_timeout_s", 1);
    if kind == PlaneKind::Nixl {
        config = config.set("nixl_lib_dir", common::vllm::nixl_lib_dir());
    }
    let config = config.build().unwrap();
    let consumer = Node::start(config).unwrap();
    let wait = Duration::from_secs(20);

    // The stalling producer holds keys 0..8; the consumer looks them up, then the producer stops.
    let stalled_keys = keys(0..8);
    let req = consumer.request(&stalling_id, "stall-1").unwrap();
    let found = req.lookup(&stalled_keys, wait).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    common::stop_process(stalling.child.id());
    let mut resume = Resume(&stalling, false);

    // Its load fails (load timeout, then the unanswered abort ends the session).
    let started = Instant::now();
    let failed = req.fetch(&stalled_keys, wait);
    assert!(failed.is_err(), "a stopped producer cannot complete a load");
    let failed_after = started.elapsed();
    // Reported when the abort went unanswered (1 s + 1 s), not when (if ever) it is fenced.
    assert!(
        failed_after < Duration::from_secs(8),
        "{plane}: the failed load was reported after {failed_after:?}"
    );
    req.finish();

    // An honest producer's keys 16..24 take the consumer's blocks (it holds only 8).
    let honest_keys = keys(16..24);
    let req = consumer.request(&honest_id, "honest-1").unwrap();
    let found = req.lookup(&honest_keys, wait).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    req.fetch(&honest_keys, wait).unwrap();
    req.finish();
    for k in &honest_keys {
        assert_eq!(
            consumer.read(k).as_deref(),
            Some(&synthetic::content(k, BLOCK as usize)[..]),
            "honest key {k:?} before the stalled producer resumes"
        );
    }

    // The stalled producer resumes: its queued fetch is read and its write attempted. Wait
    // until it got that far (shm: its copy found the blocks revoked, in its log; tcp: the
    // session it resumed into is gone; nixl: its WRITE ended, in its metrics), so the check
    // below is not made before the write.
    signal(&stalling, "-CONT");
    resume.1 = true;
    let markers: &[&str] = match kind {
        PlaneKind::Shm => &["revoked by the peer"],
        _ => &["session closed", "peer down"],
    };
    // On nixl the resumed producer posts its WRITE (it served the fetch); it lands once UCX
    // moves on our side too, which the next honest load makes it do.
    let metrics = metrics_addr(&stalling);
    let producer = |names: &[&str]| {
        let (_, body) = http_get(&metrics, "/metrics");
        let m = samples(&body);
        names
            .iter()
            .map(|n| m.get(*n).copied().unwrap_or(0.0))
            .sum::<f64>()
    };
    let wrote = || producer(&["kvpeer_fetches_served_total"]) >= 1.0;
    let deadline = Instant::now() + Duration::from_secs(20);
    let changed = || {
        honest_keys
            .iter()
            .any(|k| consumer.read(k) != Some(synthetic::content(k, BLOCK as usize)))
    };
    let got_there = || {
        let logged = markers
            .iter()
            .any(|m| stalling.stderr.lock().unwrap().contains(m));
        logged || (kind == PlaneKind::Nixl && wrote())
    };
    while !changed() && !got_there() {
        if Instant::now() >= deadline {
            // The log is copied first: a panic holding its lock would poison it for the reader.
            let log = stalling.stderr.lock().unwrap().clone();
            let (_, m) = http_get(&metrics, "/metrics");
            panic!("{plane}: the resumed producer never tried its write; its log:\n{log}\n{m}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(200));

    // Every honest block still holds its own key's bytes, and an honest fetch still works.
    for k in &honest_keys {
        let held = consumer.read(k).expect("the honest key is still held");
        let expected = synthetic::content(k, BLOCK as usize);
        if held != expected {
            let wrong_by = stalled_keys
                .iter()
                .find(|s| held == synthetic::content(s, BLOCK as usize));
            let log = stalling.stderr.lock().unwrap().clone();
            panic!(
                "{plane}: the block of honest key {k:?} changed after the stalled producer \
                 resumed (now holds {wrong_by:?}'s bytes); load failed after {failed_after:?}; \
                 the stalled producer's log:\n{log}"
            );
        }
    }
    let more = keys(24..28);
    let req = consumer.request(&honest_id, "honest-2").unwrap();
    req.lookup(&more, wait).unwrap();
    req.fetch(&more, wait).unwrap();
    req.finish();
    for k in &more {
        assert_eq!(
            consumer.read(k).as_deref(),
            Some(&synthetic::content(k, BLOCK as usize)[..]),
            "{plane}: honest key {k:?} at the end"
        );
    }
    // The first honest keys, where still held (a pool of one load's worth evicted some for
    // the last load), still hold their own bytes: on nixl the stalled WRITE may only have
    // landed during that load.
    for k in &honest_keys {
        if let Some(held) = consumer.read(k) {
            assert!(
                held == synthetic::content(k, BLOCK as usize),
                "{plane}: honest key {k:?} changed by the end"
            );
        }
    }
    drop(resume);
    if kind == PlaneKind::Nixl {
        nixl_held_blocks_come_back_once_the_agent_is_replaced(&consumer, stalling, &stalling_id);
    }
    consumer.shutdown(Duration::from_secs(2));
    drop(honest);
}

/// The stalled nixl producer's blocks are still held (it never confirmed), until its agent is
/// proven gone: it is killed, another process serves its identity (its port), and the next
/// session registers that process's agent. Then they come back, and its loads work again.
fn nixl_held_blocks_come_back_once_the_agent_is_replaced(
    consumer: &Node,
    stalling: Proc,
    stalling_id: &kvpeer::PeerId,
) {
    let held = |c: &Node| c.stats().unwrap().core.fencing_blocks;
    assert_eq!(held(consumer), 8, "the stalled producer's blocks are held");
    signal(&stalling, "-KILL");
    drop(stalling);
    let (_successor, successor_id) = serve("nixl", 16)
        .arg("--listen", stalling_id.as_str())
        .start_serving();
    assert_eq!(&successor_id, stalling_id);
    let again = keys(0..4);
    let req = consumer.request(&successor_id, "successor").unwrap();
    let found = req.lookup(&again, Duration::from_secs(20)).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    req.fetch(&again, Duration::from_secs(20)).unwrap();
    req.finish();
    for k in &again {
        assert_eq!(
            consumer.read(k).as_deref(),
            Some(&synthetic::content(k, BLOCK as usize)[..])
        );
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while held(consumer) > 0 {
        assert!(
            Instant::now() < deadline,
            "the held blocks never came back after the agent was replaced"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_stalled_shm_producer_never_writes_a_block_given_to_another_key() {
    stalled_producer_never_writes_a_reused_block("shm", PlaneKind::Shm);
}

#[test]
fn a_stalled_tcp_producer_never_writes_a_block_given_to_another_key() {
    stalled_producer_never_writes_a_reused_block("tcp", PlaneKind::Tcp);
}

#[cfg(feature = "nixl")]
#[test]
fn a_stalled_nixl_producer_never_writes_a_block_given_to_another_key() {
    stalled_producer_never_writes_a_reused_block("nixl", PlaneKind::Nixl);
}

/// A nixl producer that dies in the middle of a load (SIGKILL: its host resets the
/// connection) is no stalled one: its blocks come back at once, before the load timeout, and
/// an honest load takes them (the consumer holds exactly one load's worth).
#[cfg(feature = "nixl")]
#[test]
fn a_killed_nixl_producers_blocks_come_back_at_once() {
    common::vllm::ucx_env();
    let (dying, dying_id) = serve("nixl", 16).start_serving();
    let (honest, honest_id) = serve("nixl", 32).start_serving();
    let config = NodeConfig::builder("killed-consumer")
        .num_blocks(CONSUMER_BLOCKS)
        .block_len(BLOCK)
        .plane(PlaneKind::Nixl)
        .set("nixl_lib_dir", common::vllm::nixl_lib_dir())
        .set("max_pins_per_peer", CONSUMER_BLOCKS)
        .set("load_timeout_s", 30)
        .build()
        .unwrap();
    let consumer = Node::start(config).unwrap();
    let wait = Duration::from_secs(20);
    let doomed = keys(0..8);
    let req = consumer.request(&dying_id, "doomed").unwrap();
    req.lookup(&doomed, wait).unwrap();
    // Stopped so its write cannot finish first, then killed while the fetch waits.
    common::stop_process(dying.child.id());
    let pid = dying.child.id().to_string();
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(500));
        Command::new("kill").args(["-KILL", &pid]).status().unwrap()
    });
    let started = Instant::now();
    assert!(req.fetch(&doomed, wait).is_err());
    let failed_after = started.elapsed();
    assert!(killer.join().unwrap().success());
    req.finish();
    assert!(
        failed_after < Duration::from_secs(10),
        "failed after {failed_after:?}: the producer's death, not the 30 s load timeout"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while consumer.stats().unwrap().core.fencing_blocks > 0 {
        assert!(
            Instant::now() < deadline,
            "the dead producer's blocks stay held"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let honest_keys = keys(16..24);
    let req = consumer.request(&honest_id, "after-the-death").unwrap();
    req.lookup(&honest_keys, wait).unwrap();
    req.fetch(&honest_keys, wait).unwrap();
    req.finish();
    for k in &honest_keys {
        assert_eq!(
            consumer.read(k).as_deref(),
            Some(&synthetic::content(k, BLOCK as usize)[..])
        );
    }
    consumer.shutdown(Duration::from_secs(2));
    drop((dying, honest));
}
