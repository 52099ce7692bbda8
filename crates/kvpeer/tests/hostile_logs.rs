//! A peer that opens sessions properly and ends them at once, in a loop, against a real
//! `kvpeer serve` at info level (issue 19: "error paths are logged line for line"): every kind of
//! line it makes the node log (sessions accepted and closed, peers disconnecting, protocol
//! errors) stays within the throttle's burst per second, however many sessions it cycles, and
//! the node still serves an honest fetch. The attacker is `tests/hostile/attacker.py cycles`
//! (`KVPEER_PYTHON`, as `hostile_peers.rs`); everything is on 127.0.0.1; every wait is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::time::Instant;

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use hostile::*;

/// `kvpeer_core::throttle::BURST`: lines of one kind per second at most.
const BURST: usize = 5;

/// The node under attack: shm, 64 blocks of 4 KiB, 16 of them filled (an honest fetch's keys).
const NODE: &[&str] = &[
    "--plane",
    "shm",
    "--blocks",
    "64",
    "--block-len",
    "4096",
    "--fill",
    "16",
];

/// The message of a log line (colours, time stamp and fields stripped; its level and target
/// kept), as `hostile_peers.rs`'s flood test reads it.
fn message(line: &str) -> String {
    let mut plain = String::new();
    let mut in_escape = false;
    for ch in line.chars() {
        match (in_escape, ch) {
            (false, '\u{1b}') => in_escape = true,
            (true, 'm') => in_escape = false,
            (false, c) => plain.push(c),
            _ => {}
        }
    }
    plain
        .split('=')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .skip(1)
        .take(10)
        .collect::<Vec<_>>()
        .join(" ")
}

/// 300 sessions opened and ended at once (every other one by a protocol error): each kind of
/// log line at most a burst per second of the attack, and the sessions were real (the node
/// acked most: a control that the attack is not refused wholesale).
#[test]
fn sessions_cycled_at_will_log_a_bounded_number_of_lines() {
    let (server, id) = serve_at(NODE, "info", None);
    let lines0 = log_lines(&server);
    let started = Instant::now();
    let s = attack(&[
        "cycles",
        "--node",
        &id,
        "--count",
        "300",
        "--protocol-errors",
        "--wait",
        "1",
    ]);
    std::thread::sleep(std::time::Duration::from_secs(1));
    let took = started.elapsed();
    let log = server.log();
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for l in log.lines().skip(lines0) {
        *kinds.entry(message(l)).or_default() += 1;
    }
    let lines: usize = kinds.values().sum();
    println!("{s} in {took:?}: {lines} new log lines; by message:");
    for (k, n) in &kinds {
        println!("  {n:6}  {k}");
    }
    // A `connect` may race the end of the session before it (then it is refused, and the
    // attacker waits out the node's dial backoff): most are acked.
    assert!(
        s["acked"].as_u64().unwrap_or(0) >= 200,
        "the node did not open the sessions: {s}"
    );
    assert!(s["protocol_errors"].as_u64().unwrap_or(0) >= 100, "{s}");
    // A burst per kind per second, the second the attack started in included.
    let bound = BURST * (took.as_secs() as usize + 2);
    let over: Vec<_> = kinds.iter().filter(|(_, n)| **n > bound).collect();
    assert!(
        over.is_empty(),
        "kinds logged more than {bound} times in {took:?}: {over:?}"
    );
    let run = honest_fetch(&id, "shm", 2, 8, &[]);
    assert_fetch_ok(&run, 16, "after the session cycling");
}

/// A peer whose request ids are a megabyte long (vLLM bounds none): 20 `abort_fetch`es of
/// unknown requests (each one a warning naming its id), then a lookup and a fetch under such an
/// id. Every message is answered as for a short id, and the node's log grows by lines of
/// bounded length: an id is logged as its head and length, so a peer cannot write megabytes of
/// log per message (before: the whole id, line after line, 20 MB here).
#[test]
fn megabyte_request_ids_are_served_and_logged_short() {
    let (server, id) = serve_at(NODE, "info", None);
    let before = server.log().len();
    let s = attack(&[
        "session",
        "--node",
        &id,
        "--own-pool",
        "--shm-token",
        "from-object",
        "--keys",
        "0-7",
        "--indexes",
        "16-23",
        "--id-bytes",
        "1048576",
        "--unknown-aborts",
        "20",
    ]);
    std::thread::sleep(std::time::Duration::from_millis(300));
    let log = server.log();
    let grown = &log[before.min(log.len())..];
    let longest = grown.lines().map(str::len).max().unwrap_or(0);
    println!(
        "{s}\nlog grew {} bytes in {} lines, the longest {longest} bytes",
        grown.len(),
        grown.lines().count()
    );
    // From the attacker's side: every message was taken and answered.
    assert_eq!(s["abort_acks"], 20, "{s}");
    assert_eq!(s["hits"], serde_json::json!(vec![true; 8]), "{s}");
    assert_eq!(s["transfer_done"], serde_json::json!([true]), "{s}");
    assert_eq!(s["own_pool_bytes_ok"], true, "{s}");
    assert!(longest < 1024, "a log line of {longest} bytes");
    assert!(
        grown.len() < 64 * 1024,
        "the log grew {} bytes",
        grown.len()
    );
    let run = honest_fetch(&id, "shm", 2, 8, &[]);
    assert_fetch_ok(&run, 16, "after the megabyte ids");
}
