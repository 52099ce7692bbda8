//! Hostile peers against real `kvpeer` processes (issue 11).
//!
//! Each test starts `kvpeer serve` (or `kvpeer fetch`) processes, attacks them from a peer that
//! speaks the protocol correctly and lies where an attacker would (`tests/hostile/attacker.py`,
//! run with `KVPEER_PYTHON`: pyzmq + msgpack), and asserts both that the attack failed, judged
//! from the attacker's side (what its sockets received, which bytes of which pool changed), and
//! that an honest `kvpeer fetch` against the same node right after gets every block byte-exact
//! (the child checks every byte and exits non-zero otherwise).
//!
//! Every attacker that is refused is shown to be right otherwise: the same script, changed only
//! in the one lie, is served (a control run), so a refusal is the defence working and not a
//! broken attacker.
//!
//! Everything is on 127.0.0.1 (and 127.0.0.2, also loopback); ports come from the system (port
//! 0, read back from ready lines); pool names carry process ids; every wait is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use common::vllm::metric;
use common::{free_port, Proc};
use hostile::*;

const BLOCKS: &str = "64";
const LEN: &str = "4096";

/// `kvpeer serve` on `plane` with 64 blocks of 4 KiB, `fill` of them filled, metrics on, at
/// info level (as the other process tests), plus `extra`.
fn serve(plane: &str, fill: u64, extra: &[&str]) -> (Proc, String) {
    let fill = fill.to_string();
    let mut args = vec![
        "--plane",
        plane,
        "--blocks",
        BLOCKS,
        "--block-len",
        LEN,
        "--fill",
        &fill,
        "--metrics",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    serve_at(&args, "info", None)
}

fn flag(v: &Value, k: &str) -> bool {
    v[k].as_bool().unwrap_or(false)
}

/// The attacker never got a session: no `connect_ack`, no block transferred with success.
fn assert_refused(s: &Value, what: &str) {
    assert!(!flag(s, "connect_ack"), "{what}: the node acked: {s}");
    let done = s["transfer_done"].as_array().cloned().unwrap_or_default();
    assert!(
        !done.iter().any(|d| d == &Value::Bool(true)),
        "{what}: a transfer succeeded: {s}"
    );
    assert!(
        s["hits"].is_null(),
        "{what}: the node answered a lookup: {s}"
    );
}

// ---------------------------------------------------------------------------------------------
// shm: a peer names an object that is not its own pool

/// The attacker names the node's own pool object as "its" pool (no token, a random one, a
/// token made from the node's own trailer secret, a block count that makes the size match
/// without a trailer), looks up filled keys 0..8 and fetches them into blocks 16..24 of "its"
/// pool: had the node accepted, it would have copied blocks over other keys' blocks in its own
/// pool (cache poisoning). The pool object must be byte-identical afterwards.
#[test]
fn shm_cache_poisoning_through_the_nodes_own_pool_is_refused() {
    let (server, id) = serve("shm", 32, &[]);
    let pool = ready(&server, "shm");
    let before = shm_bytes(&pool);
    for (token, claimed) in [
        ("none", BLOCKS),
        ("random", BLOCKS),
        // The attacker is the same user: it can read the trailer and make a valid token. The
        // node must still refuse its own pool.
        ("from-object", BLOCKS),
        // 65 blocks of 4 KiB: exactly the object's size, trailer included.
        ("random", "65"),
    ] {
        let what = format!("own pool named, token {token}, {claimed} blocks claimed");
        let s = attack(&[
            "session",
            "--node",
            &id,
            "--shm",
            &pool,
            "--shm-token",
            token,
            "--secret-blocks",
            BLOCKS,
            "--num-blocks",
            claimed,
            "--block-len",
            LEN,
            "--keys",
            "0-7",
            "--indexes",
            "16-23",
            "--wait",
            "4",
        ]);
        println!("{what}: {s}");
        assert_refused(&s, &what);
        assert_eq!(
            diff(&before, &shm_bytes(&pool)),
            None,
            "{what}: the node's pool changed (first byte, bytes changed)"
        );
    }

    // Control: the same attacker with a pool of its own and a valid token is served, and the
    // blocks land in its object, byte-exact.
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
    ]);
    println!("control: {s}");
    assert!(flag(&s, "connect_ack"), "control run refused: {s}");
    assert_eq!(s["transfer_done"], serde_json::json!([true]), "{s}");
    assert_eq!(s["own_pool_bytes_ok"], true, "{s}");
    assert_eq!(
        diff(&before, &shm_bytes(&pool)),
        None,
        "after the control run"
    );

    let run = honest_fetch(&id, "shm", 4, 8, &[]);
    assert_fetch_ok(&run, 32, "after the poisoning attempts");
}

/// The attacker names another object of the same user (not its pool, not a kvpeer pool): one
/// of exactly blocks + trailer size with no trailer magic, one of exactly the blocks' size.
/// Neither may be written.
#[test]
fn shm_writes_into_another_object_of_the_same_user_are_refused() {
    let (_server, id) = serve("shm", 32, &[]);
    let blocks: usize = BLOCKS.parse().unwrap();
    let len: usize = LEN.parse().unwrap();
    let pattern = |n: usize| -> Vec<u8> { (0..n).map(|i| (i % 251) as u8).collect() };
    let me = std::process::id();
    let victims = [
        ShmFile::create(
            format!("kvpeer-hostile-victim-{me}-a"),
            &pattern(blocks * len + 4096),
        ),
        ShmFile::create(
            format!("kvpeer-hostile-victim-{me}-b"),
            &pattern(blocks * len),
        ),
    ];
    for victim in &victims {
        let before = shm_bytes(&victim.0);
        for token in ["none", "random"] {
            let what = format!("{} ({} bytes), token {token}", victim.0, before.len());
            let s = attack(&[
                "session",
                "--node",
                &id,
                "--shm",
                &victim.0,
                "--shm-token",
                token,
                "--keys",
                "0-7",
                "--indexes",
                "0-7",
                "--wait",
                "4",
            ]);
            println!("{what}: {s}");
            assert_refused(&s, &what);
            assert_eq!(
                diff(&before, &shm_bytes(&victim.0)),
                None,
                "{what}: changed"
            );
        }
    }
    let run = honest_fetch(&id, "shm", 4, 8, &[]);
    assert_fetch_ok(&run, 32, "after the attempts on other objects");
}

// ---------------------------------------------------------------------------------------------
// identity

/// A DEALER claiming an identity it does not come from gets no session.
///
/// 1. `--allow 127.0.0.1`: the attacker claims `127.0.0.1:P` (where its ROUTER listens, so it
///    would hear the node) but connects from 127.0.0.2: the source is outside the list. The
///    control run, identical but from 127.0.0.1, is served.
/// 2. No allowlist: from a non-loopback address of this host (traffic still never leaves the
///    host), claiming `127.0.0.1:P`: a remote host must not make the node dial its loopback.
#[test]
fn spoofed_identity_from_another_source_address_gets_no_session() {
    let (listed, listed_id) = serve("shm", 16, &["--allow", "127.0.0.1"]);
    let session = |node: &str, source: Option<&str>| {
        let mut args = vec![
            "session",
            "--node",
            node,
            "--own-pool",
            "--shm-token",
            "from-object",
            "--keys",
            "0-3",
            "--indexes",
            "0-3",
            "--wait",
            "4",
        ];
        if let Some(s) = source {
            args.extend_from_slice(&["--source", s]);
        }
        attack(&args)
    };
    let s = session(&listed_id, Some("127.0.0.2"));
    println!("allowlist, from 127.0.0.2 claiming 127.0.0.1: {s}");
    assert_refused(&s, "source outside the allowlist");
    assert_eq!(
        s["received"],
        serde_json::json!([]),
        "the node dialed the claimed identity back: {s}"
    );
    let control = session(&listed_id, None);
    println!("control, from 127.0.0.1: {control}");
    assert!(flag(&control, "connect_ack"), "control refused: {control}");
    assert_eq!(
        control["transfer_done"],
        serde_json::json!([true]),
        "{control}"
    );
    assert_eq!(metric(&listed, "kvpeer_sessions"), 0.0, "{}", listed.log());
    assert_fetch_ok(
        &honest_fetch(&listed_id, "shm", 2, 8, &[]),
        16,
        "allowlisted node",
    );

    let (open, open_id) = serve("shm", 16, &[]);
    match local_non_loopback_v4().first() {
        Some(lan) => {
            let lan = lan.to_string();
            let s = session(&open_id, Some(&lan));
            println!("no allowlist, from {lan} claiming 127.0.0.1: {s}");
            assert_refused(&s, "loopback identity claimed from a LAN address");
            assert_eq!(s["received"], serde_json::json!([]), "dialed back: {s}");
            let opened = metric(&open, "kvpeer_sessions_opened_total");
            assert_eq!(opened, 0.0, "a session was opened: {}", open.log());
        }
        None => println!("this host has no non-loopback IPv4 address: part 2 not possible here"),
    }
    assert_fetch_ok(&honest_fetch(&open_id, "shm", 2, 8, &[]), 16, "open node");
}

/// `connect.peer_id` names a bystander (another ROUTER the attacker holds) while the socket
/// claims the attacker: no session, nothing sent to the bystander, nothing served.
#[test]
fn connect_naming_another_peer_than_its_socket_is_refused() {
    let (_server, id) = serve("shm", 16, &[]);
    let s = attack(&[
        "session",
        "--node",
        &id,
        "--also-bind",
        "127.0.0.1:0",
        "--peer-id-extra",
        "--own-pool",
        "--shm-token",
        "from-object",
        "--keys",
        "0-3",
        "--indexes",
        "0-3",
        "--wait",
        "4",
    ]);
    println!("{s}");
    assert_refused(&s, "connect naming a bystander");
    assert_eq!(
        s["extra_received"],
        serde_json::json!([]),
        "the bystander was dialed: {s}"
    );
    assert_fetch_ok(
        &honest_fetch(&id, "shm", 2, 8, &[]),
        16,
        "after the mismatch",
    );
}

// ---------------------------------------------------------------------------------------------
// authenticated handshake

/// Nodes A and B share an auth secret. A `connect` signed for A (kvpeer_auth v2, made by the
/// attacker's port of the signing) is refused by B, accepted by A (so the port is right), and
/// refused by A when replayed on a new connection (nonce seen).
#[test]
fn auth_connect_signed_for_one_node_is_refused_by_another_and_on_replay() {
    let dir = std::env::temp_dir().join(format!("kvpeer-hostile-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("secret");
    std::fs::write(&secret, "a shared secret of 32 bytes, ok.\n").unwrap();
    // Only its owner may read a secret (the node refuses one every user can).
    std::fs::set_permissions(&secret, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let secret = secret.display().to_string();
    let auth = ["--auth-secret-file", secret.as_str()];
    let (_a, a_id) = serve("shm", 8, &auth);
    let (_b, b_id) = serve("shm", 8, &auth);
    let s = attack(&[
        "auth",
        "--node-a",
        &a_id,
        "--node-b",
        &b_id,
        "--secret-file",
        &secret,
        "--wait",
        "4",
    ]);
    println!("{s}");
    assert!(
        !flag(&s["to_b"], "connect_ack"),
        "B accepted a connect signed for A: {s}"
    );
    assert!(
        flag(&s["to_a"], "connect_ack"),
        "A refused a connect signed for it (the test's signing is wrong?): {s}"
    );
    assert_eq!(s["lookup_at_a"], true, "{s}");
    assert!(
        !flag(&s["replay_to_a"], "connect_ack"),
        "A accepted a replayed connect: {s}"
    );
    for node in [&a_id, &b_id] {
        assert_fetch_ok(&honest_fetch(node, "shm", 2, 4, &auth), 8, node);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------------------------------------------------------------------------------------------
// tcp data plane

/// The victim is a `kvpeer fetch` consumer on the tcp plane; its producer is the attacker
/// script, which holds the victim's fetch open (write permits outstanding for the producer's
/// id) while a third party opens data connections to the victim's data port: HELLO v1 naming
/// the producer, HELLO v2 naming it with a guessed key, with the issued key cut short, and
/// naming an unknown writer. Each sends a WRITE of junk into the permitted blocks. Each must be
/// closed (or refused) without ACK 0, and the victim's pool must not change. Then the producer
/// writes honestly (HELLO v2 with the key the victim issued to it): ACK 0, and the victim
/// checks every byte and exits 0.
///
/// Why this shape: a real producer cannot be held mid-fetch from outside, and a rate-capped
/// one makes the window a matter of timing. A scripted producer holds the permits open for as
/// long as the spoofs take, deterministically, and the victim is the real binary.
#[test]
fn tcp_hello_spoofs_during_a_live_fetch_are_closed_and_write_nothing() {
    tcp_victim(0);
}

/// As above, and before its honest write the producer fills the victim's data port with 300
/// idle connections (more than its 256 slots), held open: junk still in its HELLO must not
/// lock the session's own writer out.
#[test]
fn tcp_data_port_flood_cannot_lock_out_the_sessions_writer() {
    tcp_victim(300);
}

fn tcp_victim(flood: usize) {
    let flood = flood.to_string();
    let mut producer = attacker_with(
        &[
            "producer",
            "--victim-pid-from-stdin",
            "--block-len",
            LEN,
            "--timeout",
            "60",
            "--wait",
            "8",
            "--flood",
            &flood,
        ],
        true,
    );
    let producer_id = producer.event("ready")["id"].as_str().unwrap().to_owned();
    let mut victim = Proc::spawn(
        &[
            "fetch",
            "--miss-share",
            "0",
            "--peer",
            &producer_id,
            "--plane",
            "tcp",
            "--blocks",
            BLOCKS,
            "--block-len",
            LEN,
            "--requests",
            "1",
            "--keys",
            "8",
            "--json",
            "--timeout-secs",
            "50",
        ],
        "fetch",
    );
    let mut stdin = producer.child.stdin.take().unwrap();
    // The attacker reads the victim's pool in its memory (a tcp node's pool is private).
    writeln!(stdin, "{}", victim.child.id()).unwrap();
    drop(stdin);
    let status = victim.wait_while(Duration::from_secs(70), || {
        std::thread::sleep(Duration::from_millis(10))
    });
    let summary = producer.event("summary");
    println!("producer: {summary}");
    std::thread::sleep(Duration::from_millis(100));
    let line: Vec<String> = victim.stdout.try_iter().collect();
    println!("victim: {line:?}");
    assert_eq!(summary["served_fetches"], 1, "{summary}\n{}", victim.log());
    for (name, r) in summary["spoofs"].as_object().unwrap() {
        let outcome = r["outcome"].as_str().unwrap();
        assert!(
            outcome == "closed" || outcome == "ack1",
            "spoof {name}: {outcome} ({summary})"
        );
        assert!(
            r["seconds"].as_f64().unwrap() < 6.5,
            "spoof {name} held open past the HELLO deadline: {summary}"
        );
    }
    assert_eq!(summary["victim_pool_unchanged"], true, "{summary}");
    assert_eq!(summary["victim_pool_has_junk"], false, "{summary}");
    assert_eq!(
        summary["honest"]["outcome"],
        "ack0",
        "the producer's own write was refused: {summary}\n{}",
        victim.log()
    );
    assert_eq!(status, 0, "victim failed: {line:?}\n{}", victim.log());
    let s: Value = serde_json::from_str(line.last().unwrap()).unwrap();
    assert_eq!(
        (s["hits"].as_u64(), s["corrupt_blocks"].as_u64()),
        (Some(8), Some(0)),
        "{s}"
    );
}

/// 1200 connections to a `serve` node's tcp data port, with the node held to 1024 open files:
/// idle ones, half HELLOs, HELLO v1, HELLO v2 with a guessed key and half a WRITE. The node
/// must cap them (staying under its file limit), close every one of them within the HELLO
/// deadline (seen from the attacker: EOF or reset), not spin, and serve an honest tcp fetch
/// while a second wave of 300 is open.
#[test]
fn tcp_data_port_exhaustion_does_not_stop_the_node() {
    let (server, id) = serve_at(
        &[
            "--plane",
            "tcp",
            "--blocks",
            BLOCKS,
            "--block-len",
            LEN,
            "--fill",
            "32",
        ],
        "warn",
        Some("--nofile=1024:1024"),
    );
    let pid = server.child.id();
    let data = ready(&server, "tcp");
    let addr: std::net::SocketAddr = data.parse().unwrap();
    let peak_fds = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (peak, stop) = (peak_fds.clone(), stop.clone());
        std::thread::spawn(move || {
            let end = Instant::now() + Duration::from_secs(90);
            while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                peak.fetch_max(open_fds(pid), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    let fds_before = open_fds(pid);

    let wave = |n: usize| -> (Vec<TcpStream>, usize) {
        let mut open = Vec::new();
        let mut failed = 0;
        for i in 0..n {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(mut s) => {
                    let bytes: Vec<u8> = match i % 4 {
                        0 => vec![],
                        1 => b"KVPH\x02\x00".to_vec(),
                        2 => [&b"KVPH\x01\x00\x0e"[..], b"127.0.0.1:5600"].concat(),
                        _ => [
                            &b"KVPH\x02\x00\x0e"[..],
                            b"127.0.0.1:5600",
                            &[0x5a; 32],
                            b"KVPW\x00\x00",
                        ]
                        .concat(),
                    };
                    let _ = s.write_all(&bytes);
                    open.push(s);
                }
                Err(_) => failed += 1,
            }
        }
        (open, failed)
    };

    let started = Instant::now();
    let (first, failed) = wave(1200);
    let opened_in = started.elapsed();
    println!(
        "wave 1: {} open, {failed} failed to connect, in {opened_in:?}",
        first.len()
    );
    // Every one of them ends within the HELLO deadline (5 s) of its accept, however it ends.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut closed = 0;
    let mut still_open = 0;
    let mut latest = Duration::ZERO;
    for mut s in first {
        let left = deadline.saturating_duration_since(Instant::now());
        s.set_read_timeout(Some(left.max(Duration::from_millis(1))))
            .unwrap();
        let mut buf = [0u8; 64];
        match s.read(&mut buf) {
            Ok(0) => closed += 1,
            Ok(_) => closed += 1, // an ACK 1 before the close: refused, and
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) =>
            {
                still_open += 1
            }
            Err(_) => closed += 1, // reset
        }
        latest = started.elapsed();
    }
    println!(
        "wave 1: {closed} closed by the node, {still_open} still open 10 s after the last \
         connect (checked until {latest:?}); node fds before {fds_before}, peak {}",
        peak_fds.load(Ordering::Relaxed)
    );

    // The node is not spinning: CPU over 2 quiet seconds.
    let cpu0 = cpu_time(pid);
    std::thread::sleep(Duration::from_secs(2));
    let busy = cpu_time(pid).saturating_sub(cpu0);
    println!("node CPU over 2 s after the wave: {busy:?}");

    // Second wave, held open while an honest fetch runs.
    let (second, failed2) = wave(300);
    println!("wave 2: {} open, {failed2} failed", second.len());
    let run = honest_fetch(&id, "tcp", 4, 8, &[]);
    drop(second);
    stop.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak_fds.load(Ordering::Relaxed);
    println!(
        "honest fetch: {} (status {}); node fds peak {peak}",
        run.summary, run.status
    );
    assert_fetch_ok(&run, 32, "during the second wave");
    assert_eq!(
        still_open, 0,
        "idle or half-open connections outlived the HELLO deadline"
    );
    assert!(
        peak < 1000,
        "the node's open files reached {peak} of its 1024"
    );
    assert!(
        busy < Duration::from_millis(1000),
        "the node used {busy:?} of CPU in 2 quiet seconds"
    );
    let log = server.log();
    println!(
        "node log: {} lines\n{}",
        log.lines().count(),
        log.lines().take(20).collect::<Vec<_>>().join("\n")
    );
    assert!(
        log.lines().count() < 200,
        "log flood: {} lines",
        log.lines().count()
    );
}

// ---------------------------------------------------------------------------------------------
// dialing

/// `kvpeer fetch --allow 127.0.0.1:A --peer 127.0.0.1:B`: B (a socket this test owns) never
/// sees a connection, not even for `connect`, and fetch's error names the allowlist.
#[test]
fn outbound_allowlist_keeps_fetch_from_dialing_an_unlisted_peer() {
    let b = TcpListener::bind("127.0.0.1:0").unwrap();
    b.set_nonblocking(true).unwrap();
    let b_addr = b.local_addr().unwrap().to_string();
    let allowed = format!("127.0.0.1:{}", free_port());
    let mut fetch = Proc::spawn(
        &[
            "fetch",
            "--allow",
            &allowed,
            "--peer",
            &b_addr,
            "--blocks",
            "16",
            "--block-len",
            LEN,
            "--requests",
            "2",
            "--keys",
            "4",
            "--timeout-secs",
            "5",
        ],
        "fetch",
    );
    let mut accepted = 0;
    let status = fetch.wait_while(Duration::from_secs(30), || {
        while b.accept().is_ok() {
            accepted += 1;
        }
        std::thread::sleep(Duration::from_millis(5));
    });
    // A connection just before the exit.
    std::thread::sleep(Duration::from_millis(200));
    while b.accept().is_ok() {
        accepted += 1;
    }
    let err = fetch.log();
    println!("status {status}, {accepted} connections, stderr:\n{err}");
    assert_eq!(accepted, 0, "fetch dialed a peer outside its allowlist");
    assert_ne!(status, 0);
    let error = err
        .lines()
        .find(|l| l.starts_with("kvpeer fetch:"))
        .unwrap_or_else(|| panic!("no error line: {err}"));
    assert!(
        error.contains("allowlist"),
        "fetch's error does not name the allowlist: {error:?}"
    );
}

/// A listening socket that accepts and drops every connection, counting them (bounded: 60 s).
struct Dropper {
    addr: String,
    accepts: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Dropper {
    fn start() -> Self {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        l.set_nonblocking(true).unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let accepts = Arc::new(AtomicUsize::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (accepts, stop) = (accepts.clone(), stop.clone());
            std::thread::spawn(move || {
                let end = Instant::now() + Duration::from_secs(60);
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    match l.accept() {
                        Ok((s, _)) => {
                            accepts.fetch_add(1, Ordering::Relaxed);
                            drop(s);
                        }
                        Err(_) => std::thread::sleep(Duration::from_millis(2)),
                    }
                }
            })
        };
        Dropper {
            addr,
            accepts,
            stop,
            thread: Some(thread),
        }
    }

    fn count(&self) -> usize {
        self.accepts.load(Ordering::Relaxed)
    }
}

impl Drop for Dropper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `kvpeer fetch` (50 requests) against a producer port that accepts and drops every
/// connection: a bounded number of connection attempts and log lines, a non-zero exit within
/// its timeout, and an error saying why.
#[test]
fn fetch_against_a_dropping_producer_gives_up_without_redialing_in_a_loop() {
    let dead = Dropper::start();
    let started = Instant::now();
    let mut fetch = Proc::spawn(
        &[
            "fetch",
            "--peer",
            &dead.addr,
            "--blocks",
            "16",
            "--block-len",
            LEN,
            "--requests",
            "50",
            "--keys",
            "4",
            "--timeout-secs",
            "4",
        ],
        "fetch",
    );
    let status = fetch.wait_while(Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(5))
    });
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    let total = dead.count();
    let log = fetch.log();
    println!(
        "status {status} after {took:?}: {total} connections; {} log lines:\n{log}",
        log.lines().count(),
    );
    assert_ne!(status, 0, "nothing was fetched, yet fetch succeeded");
    assert!(took < Duration::from_secs(15), "fetch took {took:?}");
    assert!(total <= 20, "{total} connection attempts");
    assert!(
        log.lines().count() <= 50,
        "{} log lines",
        log.lines().count()
    );
}

/// A hostile peer sends 100 `connect`s in 3 s claiming an identity whose port accepts and
/// drops every connection: each asks the `serve` node to dial it. The node backs off (250 ms
/// doubling to 5 s) instead of redialing each time: counted at the dropping socket. Its log
/// stays short, and it serves an honest fetch afterwards.
#[test]
fn redial_to_a_dropping_peer_backs_off() {
    let (server, id) = serve_at(
        &[
            "--plane",
            "shm",
            "--blocks",
            BLOCKS,
            "--block-len",
            LEN,
            "--fill",
            "16",
        ],
        "warn",
        None,
    );
    let dead = Dropper::start();
    let lines0 = log_lines(&server);
    let started = Instant::now();
    let s = attack(&[
        "connects",
        "--node",
        &id,
        "--identity",
        &dead.addr,
        "--count",
        "100",
        "--interval",
        "0.03",
    ]);
    let took = started.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    let dials = dead.count();
    let lines = log_lines(&server) - lines0;
    println!(
        "{s} over {took:?}: the node dialed {} {dials} times; {lines} log lines:\n{}",
        dead.addr,
        server.log()
    );
    let run = honest_fetch(&id, "shm", 2, 8, &[]);
    println!("honest fetch after: status {}, {}", run.status, run.summary);
    assert!(
        dials <= 20,
        "{dials} dials in {took:?} for 100 connects: no backoff"
    );
    assert!(lines < 50, "{lines} log lines");
    assert_fetch_ok(&run, 16, "after the redial storm");
}

// ---------------------------------------------------------------------------------------------
// logs

/// 10,000 junk payloads (undecodable, unknown types, messages without a session, bad fields,
/// connects that must be rejected, and 1,000 from as many spoofed identities): the node's log
/// grows by a bounded number of lines, at the level it runs with by default (warn), and it
/// still serves an honest fetch.
#[test]
fn log_flood_of_junk_payloads_stays_bounded() {
    let (server, id) = serve_at(
        &[
            "--plane",
            "shm",
            "--blocks",
            BLOCKS,
            "--block-len",
            LEN,
            "--fill",
            "16",
        ],
        "warn",
        None,
    );
    let pid = server.child.id();
    let (lines0, rss0) = (log_lines(&server), rss_kib(pid));
    let started = Instant::now();
    let s = attack(&[
        "flood",
        "--node",
        &id,
        "--count",
        "10000",
        "--spoofed",
        "1000",
    ]);
    std::thread::sleep(Duration::from_secs(2));
    let lines = log_lines(&server) - lines0;
    let log = server.log();
    let mut kinds: std::collections::BTreeMap<String, usize> = Default::default();
    for l in log.lines().skip(lines0) {
        // The message text, without colours, the time stamp and fields.
        let mut plain = String::new();
        let mut in_escape = false;
        for ch in l.chars() {
            match (in_escape, ch) {
                (false, '\u{1b}') => in_escape = true,
                (true, 'm') => in_escape = false,
                (false, c) => plain.push(c),
                _ => {}
            }
        }
        let msg = plain
            .split('=')
            .next()
            .unwrap_or("")
            .split_whitespace()
            .skip(1)
            .take(8)
            .collect::<Vec<_>>()
            .join(" ");
        *kinds.entry(msg).or_default() += 1;
    }
    println!(
        "flood {s} in {:?}: {lines} new log lines; RSS {rss0} KiB -> {} KiB; by message:",
        started.elapsed(),
        rss_kib(pid)
    );
    for (k, n) in &kinds {
        println!("  {n:6}  {k}");
    }
    assert_eq!(s["total"], 10000, "{s}");
    let run = honest_fetch(&id, "shm", 2, 8, &[]);
    println!(
        "honest fetch after the flood: status {}, {}",
        run.status, run.summary
    );
    assert!(
        lines < 200,
        "the flood made {lines} log lines: {:?}",
        kinds.iter().take(10).collect::<Vec<_>>()
    );
    assert_fetch_ok(&run, 16, "after the flood");
}

// ---------------------------------------------------------------------------------------------
// signals

/// `kvpeer fetch` stopped by SIGINT, then another by SIGTERM, in the middle of a long run:
/// neither leaves its pool object in /dev/shm.
#[test]
fn fetch_stopped_by_a_signal_removes_its_pool() {
    let (server, id) = serve("shm", 32, &[]);
    for signal in ["INT", "TERM"] {
        let served0 = metric(&server, "kvpeer_fetches_served_total");
        let mut fetch = Proc::spawn(
            &[
                "fetch",
                "--miss-share",
                "0",
                "--peer",
                &id,
                "--plane",
                "shm",
                "--blocks",
                BLOCKS,
                "--block-len",
                LEN,
                "--requests",
                "1000000",
                "--prefixes",
                "4",
                "--keys",
                "8",
            ],
            "fetch",
        );
        let pool = format!("/dev/shm/{}", fetch.shm);
        assert!(
            eventually(Duration::from_secs(30), || {
                metric(&server, "kvpeer_fetches_served_total") > served0 + 2.0
            }),
            "the fetch never got going: {}",
            fetch.log()
        );
        assert!(std::path::Path::new(&pool).exists(), "{pool} while running");
        let pid = fetch.child.id().to_string();
        let sent = std::process::Command::new("kill")
            .args([&format!("-{signal}"), &pid])
            .status()
            .unwrap();
        assert!(sent.success());
        let status = fetch.wait_while(Duration::from_secs(15), || {
            std::thread::sleep(Duration::from_millis(5))
        });
        let left = std::path::Path::new(&pool).exists();
        println!("SIG{signal}: exit status {status}, pool left behind: {left}");
        assert!(!left, "SIG{signal} left {pool} behind");
    }
}

// ---------------------------------------------------------------------------------------------
// control port: a squatter holds someone else's identity

/// A DEALER claims the identity an honest consumer will have (`127.0.0.1:P`, from the right
/// address: this host) before that consumer starts, and stays silent (libzmq answers the
/// node's heartbeats for it). With libzmq's ROUTER the real consumer's connection was ignored
/// and its handshake timed out. Now each connection is the node's own: the honest consumer's
/// fetch is served byte-exact while the squatter holds its connection, and the `fetch` the
/// squatter then injects as if from the consumer's session is dropped (the session belongs to
/// the connection its `connect` came on): the honest run still sees no failed load.
#[test]
fn a_squatter_holding_a_peers_identity_cannot_lock_it_out_or_speak_for_it() {
    let (node, node_id) = serve("shm", 16, &[]);
    let victim = format!("127.0.0.1:{}", free_port());
    let mut squatter = attacker(&[
        "squat",
        "--node",
        &node_id,
        "--identity",
        &victim,
        "--hold",
        "1",
        "--after",
        "3",
    ]);
    squatter.event("ready");
    std::thread::sleep(Duration::from_millis(300));
    // The honest consumer, with the squatted identity, while the squatter holds it (and
    // injects its fetch into the consumer's session about 0.7 s into its run).
    let started = Instant::now();
    let run = honest_fetch(
        &node_id,
        "shm",
        2000,
        8,
        &["--listen", &victim, "--prefixes", "2"],
    );
    println!("the squatted consumer ran {:?}", started.elapsed());
    assert_fetch_ok(&run, 16_000, "consumer whose identity was squatted");
    let status = squatter.wait_while(Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(5))
    });
    assert_eq!(status, 0, "squatter: {}", squatter.log());
    // The node is clean and still serves.
    assert!(
        eventually(Duration::from_secs(5), || metric(
            &node,
            "kvpeer_server_requests"
        ) == 0.0),
        "{}",
        node.log()
    );
    assert_fetch_ok(
        &honest_fetch(&node_id, "shm", 2, 8, &[]),
        16,
        "after the squat",
    );
}

/// A peer whose own connection to the node closes while the node's connection to it lives on
/// (vLLM's tier closes its DEALER when its heartbeat expires, e.g. after the engine was paused,
/// and keeps its ROUTER), and that dials again with a new `connect`: that is a new incarnation,
/// not a duplicate `connect`. Before, the node answered it as a protocol error with a
/// `disconnect`, which ended the peer's new session at once, and the peer computed locally
/// (found by the real-engine chain test). Judged from the peer's side: each of its three
/// sessions is acked, never told `disconnect`, and fetches its 8 blocks byte-exact into its
/// own pool; an honest `kvpeer fetch` is served byte-exact after.
#[test]
fn a_peer_that_dials_again_after_its_connection_closed_gets_a_new_session() {
    let (node, node_id) = serve("shm", 16, &[]);
    let s = attack(&[
        "redial",
        "--node",
        &node_id,
        "--keys",
        "0-7",
        "--sessions",
        "3",
        "--gap",
        "0.5",
    ]);
    let sessions = s["sessions"].as_array().expect("sessions");
    assert_eq!(sessions.len(), 3, "{s}");
    for (i, session) in sessions.iter().enumerate() {
        assert!(
            flag(session, "connect_ack"),
            "session {i}: {s}\n{}",
            node.log()
        );
        assert!(
            !flag(session, "disconnect"),
            "session {i} was told disconnect: {s}"
        );
        assert_eq!(
            session["hits"],
            serde_json::json!(vec![true; 8]),
            "session {i}: {s}"
        );
        assert_eq!(session["transfer_done"], true, "session {i}: {s}");
        assert_eq!(session["bytes_exact"], true, "session {i}: {s}");
    }
    assert_fetch_ok(
        &honest_fetch(&node_id, "shm", 2, 8, &[]),
        16,
        "after the peer dialed again",
    );
}

// ---------------------------------------------------------------------------------------------
// Idle means idle: a node whose peers died

/// A node whose peers died or stopped answering stays idle: three consumers fetching from a
/// tcp `kvpeer serve` are SIGKILLed (two) and SIGSTOPped (one, its connections still open)
/// in the middle of their runs. Past every timeout of theirs (1 s here), with its writer's
/// connections to them broken and its dial-backs failing with backoff, the node's threads
/// together spend under 2% of a core over 3 s (6 ticks of 1/100 s), and an honest fetch right
/// after is served byte-exact.
#[test]
fn a_node_whose_peers_died_stays_idle() {
    let config = std::env::temp_dir().join(format!("kvpeer-idle-{}.toml", std::process::id()));
    std::fs::write(
        &config,
        "lookup_timeout_s = 1\nload_timeout_s = 1\nhandshake_timeout_s = 1\nstore_timeout_s = 1\n",
    )
    .unwrap();
    let config_arg = config.to_str().unwrap().to_owned();
    let (node, id) = serve("tcp", 64, &["--config", &config_arg]);
    let fetch_args = |plane: &'static str| {
        vec![
            "fetch",
            "--miss-share",
            "0",
            "--peer",
            &id,
            "--plane",
            plane,
            "--blocks",
            "64",
            "--block-len",
            "4096",
            "--requests",
            "100000000",
            "--keys",
            "8",
        ]
        .into_iter()
        .map(str::to_owned)
        .collect::<Vec<_>>()
    };
    let mut consumers: Vec<Proc> = ["tcp", "tcp", "tcp"]
        .into_iter()
        .map(|plane| {
            let args = fetch_args(plane);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Proc::spawn(&args, "fetch")
        })
        .collect();
    // All three are being served (lookups, hits fetched, misses asked again and again).
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(&node, "kvpeer_sessions") < 3.0
        || metric(&node, "kvpeer_fetch_blocks_served_total") < 100.0
        || metric(&node, "kvpeer_lookups_served_total") < 300.0
    {
        assert!(Instant::now() < deadline, "{}", node.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let stopped = consumers.pop().unwrap();
    common::stop_process(stopped.child.id());
    for c in &mut consumers {
        c.kill9();
    }

    // Past every timeout, then measured.
    std::thread::sleep(Duration::from_secs(3));
    let pid = node.child.id();
    let spent = common::ticks_over(pid, Duration::from_secs(3));
    let total: u64 = spent.iter().map(|(_, t)| t).sum();
    eprintln!("node with dead peers, CPU ticks (1/100 s) per thread over 3 s: {spent:?}");
    assert!(
        total < 6,
        "the node with dead peers spent {total} ticks in 3 s: {spent:?}\n{}",
        node.log()
    );

    // Still serving.
    let honest = honest_fetch(&id, "tcp", 20, 4, &[]);
    assert_eq!(honest.status, 0, "{}", honest.stderr);
    drop(stopped);
    let _ = std::fs::remove_file(&config);
}
