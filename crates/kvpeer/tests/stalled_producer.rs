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
use common::Proc;

const BLOCK: u64 = 64 * 1024;
/// The consumer's pool: exactly one load's worth, so the honest load takes the failed one's
/// blocks.
const CONSUMER_BLOCKS: u64 = 8;

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

fn stalled_producer_never_writes_a_reused_block(plane: &str, kind: PlaneKind) {
    let (stalling, stalling_id) = Cli::serve()
        .plane(plane)
        .pool(32, BLOCK)
        .arg("--fill", 16)
        .start_serving();
    let (honest, honest_id) = Cli::serve()
        .plane(plane)
        .pool(32, BLOCK)
        .arg("--fill", 32)
        .start_serving();
    let config = NodeConfig::builder("stall-consumer")
        .num_blocks(CONSUMER_BLOCKS)
        .block_len(BLOCK)
        .plane(kind)
        .set("load_timeout_s", 1)
        .set("abort_ack_timeout_s", 1)
        .build()
        .unwrap();
    let consumer = Node::start(config).unwrap();
    let wait = Duration::from_secs(20);

    // The stalling producer holds keys 0..8; the consumer looks them up, then the producer stops.
    let stalled_keys = keys(0..8);
    let req = consumer.request(&stalling_id, "stall-1").unwrap();
    let found = req.lookup(&stalled_keys, wait).unwrap();
    assert!(found.iter().all(|r| *r == LookupResult::Hit), "{found:?}");
    signal(&stalling, "-STOP");
    let mut resume = Resume(&stalling, false);

    // Its load fails (load timeout, then the unanswered abort ends the session).
    let started = Instant::now();
    let failed = req.fetch(&stalled_keys, wait);
    assert!(failed.is_err(), "a stopped producer cannot complete a load");
    let failed_after = started.elapsed();
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
    // until its log shows it got that far (shm: its copy found the blocks revoked; tcp: the
    // session it resumed into is gone), so the check below is not made before the write.
    signal(&stalling, "-CONT");
    resume.1 = true;
    let markers: &[&str] = match kind {
        PlaneKind::Shm => &["revoked by the peer"],
        _ => &["session closed", "peer down"],
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let changed = || {
        honest_keys
            .iter()
            .any(|k| consumer.read(k) != Some(synthetic::content(k, BLOCK as usize)))
    };
    while !changed()
        && !markers
            .iter()
            .any(|m| stalling.stderr.lock().unwrap().contains(m))
    {
        if Instant::now() >= deadline {
            // The log is copied first: a panic holding its lock would poison it for the reader.
            let log = stalling.stderr.lock().unwrap().clone();
            panic!("{plane}: the resumed producer never tried its write; its log:\n{log}");
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
            Some(&synthetic::content(k, BLOCK as usize)[..])
        );
    }
    consumer.shutdown(Duration::from_secs(2));
    drop(honest);
}

#[test]
fn a_stalled_shm_producer_never_writes_a_block_given_to_another_key() {
    stalled_producer_never_writes_a_reused_block("shm", PlaneKind::Shm);
}

#[test]
fn a_stalled_tcp_producer_never_writes_a_block_given_to_another_key() {
    stalled_producer_never_writes_a_reused_block("tcp", PlaneKind::Tcp);
}
