//! Addresses a peer writes, read as an attacker writes them (issue 36, class 2), against a
//! real `kvpeer serve`: an address is one value whatever its spelling, so a spelling the
//! literal checks did not know cannot aim the node's dial-back or its tcp writer elsewhere.
//!
//! The attacker (`tests/hostile/attacker.py`) runs the listener at the target it spells: its
//! own ROUTER for the dial-back (where the node's `connect`, with its shm name, token and tcp
//! key, would arrive), a plain TCP listener for the data address (where the node's writer
//! would send HELLO and WRITE with the node's blocks). Each test asserts what reached that
//! listener (nothing), runs the same attack with the honest spelling as a control (served:
//! the attack is right otherwise), and an honest `kvpeer fetch` right after (byte-exact).
//!
//! On loopback, "off-host" is `0` in its spellings: no host's address, but `connect(2)` reads
//! it as this host, so the node reached the attacker's loopback listeners; a real other host
//! is the namespace suite's.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use hostile::*;
use serde_json::Value;

/// `kvpeer serve` on `plane`, 64 blocks of 4 KiB, 32 filled.
fn serve(plane: &str) -> (common::Proc, String) {
    serve_at(
        &[
            "--plane",
            plane,
            "--blocks",
            "64",
            "--block-len",
            "4096",
            "--fill",
            "32",
        ],
        "info",
        None,
    )
}

/// The attacker's session claiming `identity` (`{port}`: its ROUTER's port), advertising a
/// tcp listener spelled `tcp_host`, looking up keys 0..4 and fetching them.
fn session(id: &str, identity: &str, tcp_host: &str) -> Value {
    attack(&[
        "session",
        "--node",
        id,
        "--identity",
        identity,
        "--tcp-host",
        tcp_host,
        "--keys",
        "0-3",
        "--indexes",
        "0-3",
        "--wait",
        "3",
        "--linger",
        "0.5",
    ])
}

fn received(s: &Value) -> Vec<String> {
    s["received"]
        .as_array()
        .map(|r| {
            r.iter()
                .filter_map(|m| m.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// An identity whose host is `0` in a spelling the literal check did not know: the node
/// dialed it back (`connect(2)` to 0.0.0.0 is this host), so the attacker's own ROUTER got
/// the node's `connect` (its shm name, token and tcp key) and ack. Now refused before any
/// dial: the attacker's ROUTER hears nothing, and its connection is told why (a ZMTP ERROR:
/// its identity is no peer's address).
#[test]
fn an_identity_spelled_as_this_host_gets_no_dial_back() {
    let (server, id) = serve("both");
    // Control: the honest spelling of the attacker's address gets the dial-back.
    let honest = session(&id, "127.0.0.1:{port}", "127.0.0.1");
    assert!(
        received(&honest).contains(&"connect".to_owned()),
        "control: an honest identity is dialed back: {honest}"
    );
    for spelled in ["0", "0x0", "0.0", "00", "0.0.0"] {
        let identity = format!("{spelled}:{{port}}");
        let s = session(&id, &identity, "127.0.0.1");
        println!("{identity}: {s}");
        assert!(
            received(&s).is_empty(),
            "{identity}: the node's dial-back reached the spelled target: {s}"
        );
        assert_eq!(s["connect_ack"], false, "{identity}: {s}");
        assert_eq!(
            s["tcp_accepted"], 0,
            "{identity}: the writer connected: {s}"
        );
        let why = s["refused_with"].as_str().unwrap_or_default();
        assert!(
            why.contains("no peer's address"),
            "{identity}: the refusal names its cause: {s}"
        );
    }
    assert_fetch_ok(
        &honest_fetch(&id, "both", 4, 8, &[]),
        32,
        "after the attacks",
    );
    drop(server);
}

/// A data address whose host is `0` in any spelling: the node's tcp writer connected there
/// (this host) and sent HELLO and WRITE with the node's blocks to the attacker's listener.
/// Now the `connect` is refused: the listener accepts nothing and reads not a byte.
#[test]
fn a_data_address_spelled_as_this_host_gets_no_tcp_writer() {
    let (server, id) = serve("tcp");
    // Control: the same attack with its listener's real address is written to.
    let honest = session(&id, "127.0.0.1:{port}", "127.0.0.1");
    assert_eq!(honest["connect_ack"], true, "control: {honest}");
    assert!(
        honest["tcp_bytes"].as_u64().unwrap_or(0) > 0,
        "control: the writer reached an honest data address: {honest}"
    );
    for spelled in ["0", "0x0", "0.0", "0.0.0.0", "[::ffff:0.0.0.0]"] {
        let s = session(&id, "127.0.0.1:{port}", spelled);
        println!("data at {spelled}: {s}");
        assert_eq!(s["connect_ack"], false, "{spelled}: {s}");
        assert_eq!(s["tcp_accepted"], 0, "{spelled}: the writer connected: {s}");
        assert_eq!(s["tcp_bytes"], 0, "{spelled}: bytes reached it: {s}");
        let done = s["transfer_done"].as_array().cloned().unwrap_or_default();
        assert!(!done.contains(&Value::Bool(true)), "{spelled}: {s}");
    }
    assert_fetch_ok(
        &honest_fetch(&id, "tcp", 4, 8, &[]),
        32,
        "after the attacks",
    );
    drop(server);
}

/// A TOML file in the system's temporary directory, removed on drop.
struct TempConfig(std::path::PathBuf);

impl TempConfig {
    fn new(text: &str) -> Self {
        let path = std::env::temp_dir().join(format!(
            "kvpeer-hostile-addresses-{}-{:?}.toml",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::write(&path, text).unwrap();
        TempConfig(path)
    }
}

impl Drop for TempConfig {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// 127.0.0.1 written as IPv4-mapped IPv6, 16 ways (zeros and case): one host.
fn loopback_spellings() -> String {
    let mut out = Vec::new();
    for prefix in ["::", "0::", "0:0::", "0:0:0:0:0:"] {
        for ffff in ["ffff", "FFFF"] {
            for low in ["1", "0001"] {
                out.push(format!("[{prefix}{ffff}:7f00:{low}]"));
            }
        }
    }
    out.join(",")
}

/// One host (127.0.0.1) opening sessions under 16 spellings of its address, each re-opened
/// at once when the node ends it, against a node of 8 slots and 3 per host, while an honest
/// host (127.0.0.2) runs two fetches at a time. The node counts the attacker as the one host it
/// is: the attacker never holds more than its host's 3 (judged from its side: the sessions
/// the node acked and has not ended), its newcomers evict its own, and every honest fetch is
/// served byte-exact. Before, each spelling was a host of one session: the attacker held 6 of
/// the 8 slots (the core's `tier.rs` shows an idle honest host, then the heaviest, giving its
/// sessions up to each newcomer).
#[test]
fn one_host_spelled_many_ways_holds_one_share() {
    let config = TempConfig::new("max_peers_per_host = 3\n");
    let config_path = config.0.to_string_lossy().into_owned();
    let (server, id) = serve_at(
        &[
            "--plane",
            "shm",
            "--blocks",
            "64",
            "--block-len",
            "4096",
            "--fill",
            "32",
            "--max-peers",
            "8",
            "--config",
            &config_path,
        ],
        "warn",
        None,
    );
    let honest = ["--listen", "127.0.0.2:0"];
    assert_fetch_ok(&honest_fetch(&id, "shm", 4, 8, &honest), 32, "alone");

    let spellings = loopback_spellings();
    let flood = attacker(&[
        "sessions",
        "--node",
        &id,
        "--count",
        "16",
        "--duration",
        "10",
        "--spellings",
        &spellings,
    ]);
    flood.event("ready");
    std::thread::sleep(std::time::Duration::from_secs(2));
    for round in 0..3 {
        let runs: Vec<FetchRun> = std::thread::scope(|s| {
            let both: Vec<_> = (0..2)
                .map(|_| s.spawn(|| honest_fetch(&id, "shm", 300, 4, &honest)))
                .collect();
            both.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, run) in runs.iter().enumerate() {
            // Each request's keys are a window of the 32 filled ones and beyond: what matters is
            // that every load landed, byte-exact, with the session never lost.
            let what = format!("during the flood, round {round}, fetch {i}");
            assert_eq!(run.status, 0, "{what}: {} {}", run.summary, run.stderr);
            assert!(
                run.summary["hits"].as_u64().unwrap_or(0) > 0,
                "{what}: {}",
                run.summary
            );
            assert_eq!(run.summary["corrupt_blocks"], 0, "{what}: {}", run.summary);
            assert_eq!(run.summary["failed_loads"], 0, "{what}: {}", run.summary);
        }
    }
    let s = flood.event("summary");
    println!("flood: {s}");
    let alive = s["alive"].as_u64().unwrap();
    assert!(
        alive <= 3,
        "the attacker's one host held {alive} sessions: {s}"
    );
    assert!(
        s["ended_by_node"].as_u64().unwrap() > 0,
        "the node made room by ending the attacker's own sessions: {s}"
    );
    drop(server);
}
