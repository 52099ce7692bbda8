//! A consumer that reads its tcp data connection a trickle at a time, against a real
//! `kvpeer serve --plane tcp` (`tests/hostile/attacker.py trickle`, run with `KVPEER_PYTHON`).
//!
//! The producer must fail the transfer at its deadline (`tcp_transfer_timeout_s` plus its bytes
//! at `tcp_min_rate`), reset the data connection (seen from the attacker's side, with what it
//! got: the HELLO and the start of its own blocks, nothing else) and release the pins, while an
//! honest `kvpeer fetch` of the same blocks is served byte-exact during the attack and after it.
//! Control: the same attacker reading at full speed is served.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use common::vllm::metric;
use hostile::*;

/// 1024 blocks of 4 KiB, all filled: one fetch of every key is a 4 MiB WRITE, far more than
/// the sockets buffer. Its deadline: 1 s + 4 MiB at 2 MB/s, about 3.1 s. The attacker may pin
/// the whole pool (`max_pins_per_peer`): this test is about how long a transfer holds pins,
/// not how many (hostile_fair_lookups.rs).
fn serve_tcp(dir: &std::path::Path) -> (common::Proc, String) {
    serve_plane(dir, "tcp")
}

/// As [`serve_tcp`], on `plane` (`both`, the default, routes a peer that offers no shm object
/// to its tcp side).
fn serve_plane(dir: &std::path::Path, plane: &str) -> (common::Proc, String) {
    let config = dir.join("kvpeer.toml");
    std::fs::write(
        &config,
        "tcp_min_rate = 2000000\ntcp_transfer_timeout_s = 1\nmax_pins_per_peer = 1024\n",
    )
    .unwrap();
    let config = config.display().to_string();
    serve_at(
        &[
            "--plane",
            plane,
            "--blocks",
            "1024",
            "--block-len",
            "4096",
            "--fill",
            "1024",
            "--metrics",
            "127.0.0.1:0",
            "--config",
            &config,
        ],
        "info",
        None,
    )
}

fn trickle(id: &str, reading: &str) -> common::Proc {
    trickle_for(id, reading, "15")
}

/// [`trickle`], reading at most `hold` seconds.
fn trickle_for(id: &str, reading: &str, hold: &str) -> common::Proc {
    attacker(&[
        "trickle",
        "--node",
        id,
        "--keys",
        "0-1023",
        "--num-blocks",
        "1024",
        "--block-len",
        "4096",
        "--reading",
        reading,
        "--hold",
        hold,
    ])
}

fn summary(mut p: common::Proc) -> Value {
    let s = p.event("summary");
    p.wait_while(Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(5))
    });
    s
}

#[test]
fn a_trickle_reading_consumer_is_cut_off_at_its_deadline_and_its_pins_released() {
    let dir = std::env::temp_dir().join(format!("kvpeer-trickle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (server, id) = serve_tcp(&dir);

    let start = Instant::now();
    let slow = trickle(&id, "trickle");
    // Once the attacker's fetch is being written, its blocks are pinned.
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &server,
            "kvpeer_pool_pinned_blocks"
        ) > 0.0),
        "the attacker's fetch never started: {}",
        server.log()
    );
    // During the attack an honest consumer fetches the same blocks, byte-exact.
    let run = honest_fetch(&id, "tcp", 4, 16, &[]);
    assert_fetch_ok(&run, 64, "during the attack");
    let during = start.elapsed();

    let s = summary(slow);
    println!("attacker: {s}");
    assert!(s["connect_ack"].as_bool().unwrap(), "{s}");
    let closed = s["closed_after_s"].as_f64().unwrap_or_else(|| {
        panic!(
            "the attacker's data socket was never closed: {s}\nnode: {}",
            server.log()
        )
    });
    assert!(
        (2.5..8.0).contains(&closed),
        "closed {closed} s after the fetch; the deadline is about 3.1 s: {s}"
    );
    assert!(s["frames_ok"].as_bool().unwrap(), "{s}");
    let (got, frame) = (
        s["bytes"].as_u64().unwrap(),
        s["frame_bytes"].as_u64().unwrap(),
    );
    assert!(
        got > 0 && got < frame / 4,
        "got {got} of {frame} bytes: {s}"
    );
    assert_eq!(
        s["transfer_done"],
        serde_json::json!([false]),
        "the consumer is told the transfer failed: {s}"
    );
    assert!(
        during < Duration::from_secs(8),
        "the honest fetch took until {during:?}"
    );

    // The pins are released and nothing of the transfer is left open.
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &server,
            "kvpeer_pool_pinned_blocks"
        ) == 0.0
            && metric(&server, "kvpeer_store_jobs") == 0.0
            && metric(&server, "kvpeer_inflight_transfers") == 0.0),
        "pins or jobs still held: {}",
        server.log()
    );
    assert!(metric(&server, "kvpeer_transfers_failed_total") >= 1.0);
    // And the same blocks are served again.
    let run = honest_fetch(&id, "tcp", 4, 16, &[]);
    assert_fetch_ok(&run, 64, "after the attack");

    // Control: the same attacker reading at full speed gets every block and a success.
    let s = summary(trickle(&id, "full"));
    println!("control: {s}");
    assert_eq!(s["transfer_done"], serde_json::json!([true]), "{s}");
    assert_eq!(s["blocks_received"], 1024, "{s}");
    assert!(s["frames_ok"].as_bool().unwrap(), "{s}");
    assert!(s["closed_after_s"].is_null(), "{s}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A consumer that ends its session (`disconnect`) while the producer's WRITE to it is running,
/// and keeps reading its data connection. The producer retains the write (vLLM 0.34): its
/// source blocks stay pinned until the tcp sender has taken the link down and reported the
/// write ended, never unpinned while the sender may still copy them into the socket (by then
/// they could hold another request's bytes). Seen from the node's metrics while the consumer
/// still reads: one write retained, released because it stopped (not at the 30 s hold cap),
/// nothing left pinned. Seen from the consumer: every byte it got is of its own blocks (what
/// the kernel had buffered before the link went down still arrives). An honest fetch is served.
#[test]
fn a_consumer_that_leaves_mid_write_gets_only_its_own_bytes_and_the_pins_wait_for_the_write() {
    // On the tcp plane, and on `both` (the default), whose route to the peer goes with its
    // session: the end of the write must still come out of it.
    for plane in ["tcp", "both"] {
        leave_mid_write(plane);
    }
}

fn leave_mid_write(plane: &str) {
    let dir = std::env::temp_dir().join(format!("kvpeer-leave-{plane}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (server, id) = serve_plane(&dir, plane);
    let start = Instant::now();
    let leaver = trickle_for(&id, "leave", "5");
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &server,
            "kvpeer_transfers_retained_total"
        ) == 1.0),
        "{plane}: no write was retained: {}",
        server.log()
    );
    assert!(
        eventually(Duration::from_secs(10), || metric(
            &server,
            "kvpeer_pool_pinned_blocks"
        ) == 0.0
            && metric(&server, "kvpeer_store_jobs") == 0.0),
        "pins or jobs still held: {}",
        server.log()
    );
    let released = start.elapsed();
    assert!(
        released < Duration::from_secs(12),
        "{plane}: released after {released:?}: the hold cap, not the write's end"
    );
    assert_eq!(metric(&server, "kvpeer_retained_force_released_total"), 0.0);
    let s = summary(leaver);
    println!("{plane} leaver: {s}");
    assert!(s["connect_ack"].as_bool().unwrap(), "{s}");
    assert!(s["left_after_s"].as_f64().is_some(), "it left: {s}");
    assert!(
        s["frames_ok"].as_bool().unwrap(),
        "only its own blocks: {s}"
    );
    assert!(s["bytes"].as_u64().unwrap() > 0, "{s}");
    let run = honest_fetch(&id, "tcp", 4, 16, &[]);
    assert_fetch_ok(&run, 64, "after the consumer left");
    let _ = std::fs::remove_dir_all(&dir);
}
