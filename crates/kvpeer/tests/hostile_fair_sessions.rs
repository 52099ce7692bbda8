//! One host cannot take every session slot (issue 19, class 3): against a real `kvpeer serve`,
//! an attacker on the node's own host (127.0.0.1, as every process of a host shares its
//! address) opens more sessions than the node has slots, each from its own identity, and opens
//! again every one the node ends, at full speed. An honest `kvpeer fetch` of the same host,
//! during the flood, must be served byte-exact: it gets a slot by evicting the idlest session
//! of the host holding the most (docs/security.md), not by waiting for one to free up. Judged
//! from the attacker's side too: the node ended its sessions (it got `disconnect`s) and never
//! let it hold more than the node's slots.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use hostile::*;

#[test]
fn a_host_flooding_sessions_does_not_lock_out_an_honest_peer_of_the_same_host() {
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
            "16",
        ],
        "warn",
        None,
    );
    // Control: the honest peer alone.
    let run = honest_fetch(&id, "shm", 4, 8, &[]);
    assert_fetch_ok(&run, 32, "alone");

    let flood = attacker(&[
        "sessions",
        "--node",
        &id,
        "--count",
        "40",
        "--duration",
        "12",
    ]);
    flood.event("ready");
    // Let the flood fill every slot first.
    std::thread::sleep(std::time::Duration::from_secs(2));
    for round in 0..3 {
        let run = honest_fetch(&id, "shm", 4, 8, &[]);
        assert_fetch_ok(&run, 32, &format!("during the flood, round {round}"));
    }
    let s = flood.event("summary");
    println!("flood: {s}");
    let alive = s["alive"].as_u64().unwrap();
    assert!(alive <= 16, "the attacker held {alive} sessions of 16: {s}");
    assert!(
        s["ended_by_node"].as_u64().unwrap() >= 24,
        "the node made room by ending the attacker's sessions: {s}"
    );
    drop(server);
}
