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
/// dial: the attacker's ROUTER hears nothing.
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
