//! Nodes in separate processes on 127.0.0.1: the real `kvpeer` binary (`serve`, `fetch`) against
//! each other and against a node in this test process, on every data plane; and the faults that
//! only real processes show: a peer killed with SIGKILL in the middle of a transfer.
//!
//! After a kill the survivor must fail its loads within the configured timeouts, release every
//! pin and permit, and serve (or fetch from) a new peer. Children are killed by their PID and
//! the shared-memory object a killed child leaves behind is removed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;
use std::time::{Duration, Instant};

use kvpeer::node::build::{build, NodeSpec};
use kvpeer::node::io::NodeIo;
use kvpeer::synthetic;
use kvpeer::{NodeConfig, PlaneKind};
use kvpeer_core::{BlockIndex, CoreConfig, CoreStats, JobId, LookupResult, RequestRoles};
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

mod common;
use common::cli::Cli;
use common::node_io::{assert_clean, step_until};
use common::{field, free_port, http_get, init_logs, metrics_addr, num, samples, Proc, BIN};

/// An in-process node on 127.0.0.1 with a port the system picks. Its logs go to the test's
/// output at the level `KVPEER_LOG` names (default warn).
fn node(plane: PlaneKind, tag: &str, blocks: u64, block_len: u64) -> NodeIo {
    node_with_rate(plane, tag, blocks, block_len, None)
}

/// [`node`] with its tcp writes capped at `rate` bytes per second.
fn node_with_rate(
    plane: PlaneKind,
    tag: &str,
    blocks: u64,
    block_len: u64,
    rate: Option<u64>,
) -> NodeIo {
    init_logs();
    build(&NodeSpec {
        plane,
        num_blocks: blocks,
        block_len,
        tcp_max_write_rate: rate,
        core: CoreConfig {
            load_timeout: LOAD_TIMEOUT,
            store_timeout: LOAD_TIMEOUT,
            ..CoreConfig::default()
        },
        ..NodeConfig::local(&format!("tp-{tag}")).spec
    })
    .unwrap()
}

const LOAD_TIMEOUT: Duration = Duration::from_secs(5);

/// `kvpeer serve` with 16 blocks of 4 KiB, 8 of them filled.
fn small_server() -> (Proc, PeerId) {
    Cli::serve().pool(16, 4096).arg("--fill", 8).start_serving()
}

// ---------------------------------------------------------------------------------------------
// serve + fetch, both real processes

fn serve_and_fetch(plane: &str) {
    let (mut server, id) = Cli::serve()
        .plane(plane)
        .pool(64, 16384)
        .arg("--fill", 40)
        .start_serving();
    let mut fetch = Cli::fetch_shared(id.as_str())
        .plane(plane)
        .pool(64, 16384)
        .workload(6, 8)
        .arg("--timeout-secs", 20)
        .spawn();
    let summary = fetch.line();
    assert_eq!(
        fetch.wait_while(Duration::from_secs(30), || {}),
        0,
        "{summary}"
    );
    // Keys 0..40 are held, 40..48 are not: the sixth request misses entirely (terminal fetch).
    assert_eq!(num(&summary, "hits"), 40, "{summary}");
    assert_eq!(num(&summary, "misses"), 8, "{summary}");
    assert_eq!(num(&summary, "bytes"), 40 * 16384, "{summary}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
    assert_eq!(num(&summary, "failed_loads"), 0, "{summary}");

    // `fetch` said goodbye: the server closed the session in order, with nothing to warn about.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !server.stderr.lock().unwrap().contains("session closed") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    let log = server.stderr.lock().unwrap().clone();
    assert!(log.contains("session closed"), "{log}");
    assert!(!log.contains("WARN"), "{log}");

    // SIGTERM stops the server cleanly and removes its pool.
    let pid = server.child.id().to_string();
    assert_eq!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .code(),
        Some(0)
    );
    assert_eq!(server.wait_while(Duration::from_secs(10), || {}), 0);
    assert!(
        !std::path::Path::new(&format!("/dev/shm/{}", server.shm)).exists(),
        "the pool's shm object is unlinked on a clean stop"
    );
}

#[test]
fn serve_and_fetch_processes_over_tcp() {
    serve_and_fetch("tcp");
}

#[test]
fn serve_and_fetch_processes_over_shm() {
    serve_and_fetch("shm");
}

#[test]
fn serve_and_fetch_processes_with_both_planes() {
    serve_and_fetch("both");
}

// ---------------------------------------------------------------------------------------------
// An in-process consumer against a `kvpeer serve` process

/// Handshake with `peer`, look up `keys`, return the request and the leading hits.
fn lookup(
    c: &mut NodeIo,
    peer: &PeerId,
    rid: &str,
    roles: RequestRoles,
    keys: &[OffloadKey],
) -> (kvpeer_core::Request, Vec<OffloadKey>) {
    let req = c
        .core_mut()
        .on_new_request(Instant::now(), KvRequestId::from(rid), roles);
    c.flush(Instant::now());
    step_until(c, Duration::from_secs(10), |c| {
        c.core().session_state(peer).is_some_and(|s| s.ready)
    });
    for k in keys {
        c.core_mut().lookup(Instant::now(), &req, k);
    }
    c.core_mut().flush_lookups(Instant::now());
    c.flush(Instant::now());
    step_until(c, Duration::from_secs(10), |c| {
        keys.iter()
            .all(|k| c.core_mut().lookup(Instant::now(), &req, k) != LookupResult::Retry)
    });
    let hits = keys
        .iter()
        .take_while(|k| c.core_mut().lookup(Instant::now(), &req, k) == LookupResult::Hit)
        .cloned()
        .collect();
    (req, hits)
}

/// Loads `keys` (into fresh blocks) as job `job`; returns the blocks once the load ended and
/// whether it succeeded, and how long it took.
fn load(
    c: &mut NodeIo,
    req: &kvpeer_core::Request,
    job: u64,
    keys: &[OffloadKey],
    before_wait: impl FnOnce(),
) -> (Vec<BlockIndex>, bool, Duration) {
    let job = JobId::new(job);
    let blocks = c.core_mut().parent_mut().reserve(keys).unwrap();
    let started = Instant::now();
    c.core_mut()
        .submit_load(Instant::now(), job, req, keys.to_vec(), blocks.clone());
    c.flush(Instant::now());
    before_wait();
    let mut success = None;
    step_until(c, LOAD_TIMEOUT * 3, |c| {
        success = c.take_load_result(job);
        success.is_some()
    });
    let elapsed = started.elapsed();
    let success = success == Some(true);
    c.core_mut().parent_mut().finish_write(&blocks, success);
    (blocks, success, elapsed)
}

fn verify(c: &NodeIo, keys: &[OffloadKey], blocks: &[BlockIndex], len: usize) {
    for (k, b) in keys.iter().zip(blocks) {
        assert_eq!(
            c.core().parent().read(*b).unwrap(),
            &synthetic::content(k, len)[..],
            "block of {k:?}"
        );
    }
}

fn consumer_against_serve_process(kind: PlaneKind) {
    const LEN: u64 = 32 * 1024;
    let plane = kind.name();
    let (_server, id) = Cli::serve()
        .plane(plane)
        .pool(32, LEN)
        .arg("--fill", 10)
        .start_serving();
    let mut c = node(kind, &format!("cons-{plane}"), 32, LEN);
    let keys: Vec<OffloadKey> = (0..12).map(synthetic::key).collect();
    let (req, hits) = lookup(
        &mut c,
        &id,
        "req-1",
        RequestRoles::kv_source(id.clone()),
        &keys,
    );
    assert_eq!(hits, keys[..10].to_vec(), "10 held, 2 missing");
    let (blocks, ok, _) = load(&mut c, &req, 1, &hits, || {});
    assert!(ok);
    verify(&c, &hits, &blocks, LEN as usize);

    // A request that misses everything: finishing it sends the terminal fetch.
    let miss_keys = [synthetic::key(500)];
    let (miss, none) = lookup(
        &mut c,
        &id,
        "req-2",
        RequestRoles::kv_source(id.clone()),
        &miss_keys,
    );
    assert!(none.is_empty());
    // A PD load the server never stores: finishing the request aborts it; the abort_ack ends it.
    let pd = c.core_mut().on_new_request(
        Instant::now(),
        KvRequestId::from("req-3"),
        RequestRoles::prefiller(id.clone()),
    );
    let pd_blocks = c
        .core_mut()
        .parent_mut()
        .reserve(&[synthetic::key(600)])
        .unwrap();
    c.core_mut().submit_load(
        Instant::now(),
        JobId::new(2),
        &pd,
        vec![synthetic::key(600)],
        pd_blocks.clone(),
    );
    for r in [&req, &miss, &pd] {
        c.core_mut().finish(Instant::now(), r);
    }
    c.flush(Instant::now());
    let mut aborted = None;
    step_until(&mut c, Duration::from_secs(10), |c| {
        aborted = aborted.or(c.take_load_result(JobId::new(2)));
        aborted.is_some() && c.core().stats().client_requests == 0
    });
    assert_eq!(aborted, Some(false));
    c.core_mut().parent_mut().finish_write(&pd_blocks, false);
    assert_clean(&c);
}

#[test]
fn consumer_against_a_serve_process_over_tcp() {
    consumer_against_serve_process(PlaneKind::Tcp);
}

#[test]
fn consumer_against_a_serve_process_over_shm() {
    consumer_against_serve_process(PlaneKind::Shm);
}

#[test]
fn consumer_against_a_serve_process_with_both_planes() {
    consumer_against_serve_process(PlaneKind::Both);
}

// ---------------------------------------------------------------------------------------------
// kill -9 mid-transfer

const BIG_LEN: u64 = 1 << 20;
const BIG_BLOCKS: u64 = 64;

/// The producer (a `kvpeer serve` process) dies while writing 64 MiB into this node.
///
/// On tcp the producer is capped at 64 MB/s, so the 64 MiB write takes about a second and the
/// kill, 100 ms after the fetch left, lands in its middle: the load must fail. An shm copy
/// cannot be slowed from outside (it is a memcpy in the producer), so on shm the kill may come
/// before, during or after the copy: the load must end either way within the timeouts, with
/// every byte right if it succeeded and nothing readable if it failed.
fn producer_killed_mid_transfer(kind: PlaneKind, must_fail: bool) {
    let plane = kind.name();
    let serve = Cli::serve()
        .plane(plane)
        .pool(BIG_BLOCKS, BIG_LEN)
        .arg("--fill", BIG_BLOCKS)
        .arg("--tcp-max-rate", "64M");
    let (mut server, id) = serve.start_serving();
    let mut c = node(kind, &format!("victim-{plane}"), BIG_BLOCKS * 2, BIG_LEN);
    let keys: Vec<OffloadKey> = (0..BIG_BLOCKS).map(synthetic::key).collect();
    let (req, hits) = lookup(
        &mut c,
        &id,
        "req-k",
        RequestRoles::kv_source(id.clone()),
        &keys,
    );
    assert_eq!(hits.len(), keys.len());
    let (blocks, ok, took) = load(&mut c, &req, 1, &hits, || {
        std::thread::sleep(Duration::from_millis(100));
        server.kill9();
    });
    assert!(
        !(must_fail && ok),
        "a load from a producer killed mid-write fails"
    );
    assert!(
        took <= LOAD_TIMEOUT + Duration::from_secs(2),
        "ended after {took:?}, the load timeout is {LOAD_TIMEOUT:?}"
    );
    c.core_mut().finish(Instant::now(), &req);
    step_until(&mut c, Duration::from_secs(10), |c| {
        c.core().stats().client_requests == 0 && c.core().stats().inflight == 0
    });
    assert_clean(&c);
    if ok {
        verify(&c, &hits, &blocks, BIG_LEN as usize);
    } else {
        for k in &hits {
            assert_eq!(
                c.core_mut().parent_mut().lookup(k),
                LookupResult::Miss,
                "a failed load leaves nothing readable"
            );
        }
    }

    // The survivor fetches from a new producer.
    let (_fresh, id2) = serve.start_serving();
    let some = &keys[..8];
    let (req, hits) = lookup(
        &mut c,
        &id2,
        "req-n",
        RequestRoles::kv_source(id2.clone()),
        some,
    );
    assert_eq!(hits, some.to_vec());
    let (blocks, ok, _) = load(&mut c, &req, 2, &hits, || {});
    assert!(ok);
    verify(&c, &hits, &blocks, BIG_LEN as usize);
    c.core_mut().finish(Instant::now(), &req);
    c.flush(Instant::now());
    assert_clean(&c);
}

#[test]
fn producer_killed_mid_transfer_over_tcp() {
    producer_killed_mid_transfer(PlaneKind::Tcp, true);
}

#[test]
fn producer_killed_during_a_fetch_over_shm() {
    producer_killed_mid_transfer(PlaneKind::Shm, false);
}

/// The consumer (a `kvpeer fetch` process) dies while this node writes 64 MiB into it.
///
/// On tcp this node's writes are capped at 64 MB/s, so the 64 MiB write is in flight for about a
/// second and the kill lands in it. An shm copy takes milliseconds and cannot be slowed from
/// outside, so on shm the consumer is killed as soon as it holds pins here (after its lookup:
/// before, during or just after the copy).
fn consumer_killed_mid_transfer(kind: PlaneKind, kill_when: fn(&CoreStats) -> bool) {
    let plane = kind.name();
    let mut p = node_with_rate(
        kind,
        &format!("survivor-{plane}"),
        BIG_BLOCKS,
        BIG_LEN,
        Some(64_000_000),
    );
    for i in 0..BIG_BLOCKS {
        let k = synthetic::key(i);
        p.core_mut()
            .parent_mut()
            .put(&k, &synthetic::content(&k, BIG_LEN as usize))
            .unwrap();
    }
    let id = p.core().local().peer_id.to_string();
    let fetch = Cli::fetch_shared(&id)
        .plane(plane)
        .pool(BIG_BLOCKS, BIG_LEN)
        .workload(1000, BIG_BLOCKS)
        .arg("--first", 0);
    let mut consumer = fetch.spawn();
    step_until(&mut p, Duration::from_secs(60), |p| {
        kill_when(&p.core().stats())
    });
    consumer.kill9();
    step_until(&mut p, LOAD_TIMEOUT + Duration::from_secs(5), |p| {
        let k = p.core().stats();
        k.sessions == 0 && k.server_requests == 0 && k.store_jobs == 0 && k.inflight == 0
    });
    assert_clean(&p);

    // The survivor serves a new peer: one request of 8 keys, every byte checked by the child.
    let mut next = fetch.with("--requests", 1).with("--keys", 8).spawn();
    let status = next.wait_while(Duration::from_secs(60), || {
        let now = Instant::now();
        p.step(now);
        p.wait(now, Duration::from_millis(5));
    });
    let summary = next.line();
    assert_eq!(status, 0, "{summary}");
    assert_eq!(num(&summary, "hits"), 8, "{summary}");
    assert_eq!(num(&summary, "corrupt_blocks"), 0, "{summary}");
    step_until(&mut p, Duration::from_secs(15), |p| {
        p.core().stats().server_requests == 0 && p.core().stats().store_jobs == 0
    });
    assert_clean(&p);
}

#[test]
fn consumer_killed_mid_transfer_over_tcp() {
    consumer_killed_mid_transfer(PlaneKind::Tcp, |s| s.inflight > 0);
}

#[test]
fn consumer_killed_mid_transfer_over_shm() {
    consumer_killed_mid_transfer(PlaneKind::Shm, |s| s.store_jobs > 0 || s.inflight > 0);
}

// ---------------------------------------------------------------------------------------------
// kvpeer demo

#[test]
fn the_demo_runs_shares_blocks_and_exits_cleanly() {
    let mut demo = Proc::spawn(&["demo"], "demo");
    let status = demo.wait_while(Duration::from_secs(60), || {
        std::thread::sleep(Duration::from_millis(10))
    });
    let out: Vec<String> = demo.stdout.try_iter().collect();
    let text = out.join("\n");
    assert_eq!(status, 0, "{text}\n{}", demo.stderr.lock().unwrap());
    // 24 requests of 20 blocks over 8 prefixes of 16: the first use of each prefix comes from
    // the producer, later ones are local, the 4 new blocks of each request are computed.
    assert!(
        text.contains(
            "Summary: 24 requests, 480 blocks: 128 fetched from the peer, 256 already local, \
             96 computed (80% not recomputed)"
        ),
        "{text}"
    );
    assert!(text.contains("every byte verified"), "{text}");
    assert!(text.contains("2048 prompt tokens"), "{text}");
    assert_eq!(
        out.iter().filter(|l| l.starts_with("  req-")).count(),
        24,
        "{text}"
    );
    assert!(
        !demo.stderr.lock().unwrap().contains("WARN"),
        "a clean run warns about nothing: {}",
        demo.stderr.lock().unwrap()
    );
}

// ---------------------------------------------------------------------------------------------
// configuration of a real process

#[test]
fn serve_takes_vllms_environment_variables_and_flags_beat_them() {
    let port = free_port().to_string();
    let env = [("VLLM_P2P_SIDE_CHANNEL_PORT", port.as_str())];
    let p = Proc::spawn_env(&["serve", "--blocks", "8"], "serve", &env);
    let ready = p.line();
    assert_eq!(
        field(&ready, "id"),
        Some(format!("127.0.0.1:{port}")),
        "{ready}"
    );
    drop(p);

    let p = Proc::spawn_env(
        &["serve", "--blocks", "8", "--listen", "127.0.0.1:0"],
        "serve",
        &env,
    );
    let ready = p.line();
    let id = field(&ready, "id").unwrap();
    assert_ne!(id, format!("127.0.0.1:{port}"), "the flag wins: {ready}");
}

#[test]
fn a_bad_config_is_refused_before_anything_starts_naming_the_key() {
    let dir = std::env::temp_dir().join(format!("kvpeer-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("bad.toml");
    std::fs::write(&file, "num_blokcs = 8\n").unwrap();
    let path = file.display().to_string();
    let mut p = Proc::spawn(&["serve", "--config", &path], "serve");
    assert_eq!(p.wait_while(Duration::from_secs(20), || {}), 2);
    std::thread::sleep(Duration::from_millis(100));
    let err = p.stderr.lock().unwrap().clone();
    assert!(
        err.contains("num_blokcs: unknown key; did you mean num_blocks?"),
        "{err}"
    );
    assert!(err.contains(&path), "{err}");

    std::fs::write(&file, "listen_port = 1\nnum_blocks = \n").unwrap();
    let mut p = Proc::spawn(&["serve", "--config", &path], "serve");
    assert_eq!(p.wait_while(Duration::from_secs(20), || {}), 2);
    std::thread::sleep(Duration::from_millis(100));
    let err = p.log();
    assert!(err.contains("num_blocks: "), "{err}");
    assert!(err.contains("(line 2, column 14)"), "{err}");

    let env = [("VLLM_P2P_MAX_PEERS", "many")];
    let mut p = Proc::spawn_env(&["serve"], "serve", &env);
    assert_eq!(p.wait_while(Duration::from_secs(20), || {}), 2);
    std::thread::sleep(Duration::from_millis(100));
    let err = p.stderr.lock().unwrap().clone();
    assert!(
        err.contains("env VLLM_P2P_MAX_PEERS: max_peers: \"many\" is not a whole number"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Logs written to a pipe (a file, a collector) carry no terminal colour codes.
#[test]
fn logs_to_a_pipe_have_no_colour_codes() {
    let (mut server, _) = Proc::serve(&["--blocks", "8"]);
    assert_eq!(server.terminate(Duration::from_secs(10)), 0);
    std::thread::sleep(Duration::from_millis(100));
    let log = server.log();
    // Not vacuous: the tests run children at info, and serve logs its start and its stop.
    assert!(log.contains("INFO") && log.contains("serving"), "{log:?}");
    assert!(
        !log.contains("\x1b["),
        "colour codes in piped logs: {log:?}"
    );
}

#[test]
fn fetch_prints_json_for_machines_and_json_logs_on_request() {
    let (_server, id) = small_server();
    let (summary, fetch) = Cli::fetch_shared(id.as_str())
        .pool(16, 4096)
        .workload(2, 8)
        .flag("--json")
        .global("--log-format", "json")
        .run_json();
    assert_eq!(summary["hits"], 8, "{summary}");
    assert_eq!(summary["misses"], 8, "{summary}");
    assert_eq!(summary["corrupt_blocks"], 0, "{summary}");
    std::thread::sleep(Duration::from_millis(100));
    // Its logs (info level in these tests) are JSON objects, one per line.
    let logs = fetch.stderr.lock().unwrap().clone();
    assert!(!logs.trim().is_empty());
    for l in logs.lines() {
        let v: serde_json::Value =
            serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}"));
        assert!(v.get("level").is_some(), "{l}");
    }
}

// ---------------------------------------------------------------------------------------------
// metrics

#[test]
fn serve_exposes_prometheus_metrics_that_count_what_peers_did() {
    let (_server, id) = Cli::serve()
        .pool(16, 4096)
        .arg("--fill", 8)
        .arg("--metrics", "127.0.0.1:0")
        .start_serving();
    let (head, body) = http_get(&metrics_addr(&_server), "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert_eq!(samples(&body)["kvpeer_pool_ready_blocks"], 8.0);

    let mut fetch = Cli::fetch_shared(id.as_str())
        .pool(16, 4096)
        .workload(2, 8)
        .spawn();
    assert_eq!(fetch.wait_while(Duration::from_secs(30), || {}), 0);
    let (_, body) = http_get(&metrics_addr(&_server), "/metrics");
    let m = samples(&body);
    // Request 0 asks keys 0..8 (all held), request 1 keys 8..16 (none).
    assert_eq!(m["kvpeer_lookup_hits_served_total"], 8.0, "{body}");
    assert_eq!(m["kvpeer_lookup_misses_served_total"], 8.0, "{body}");
    assert_eq!(m["kvpeer_fetch_blocks_served_total"], 8.0, "{body}");
    assert_eq!(m["kvpeer_bytes_served_total"], 8.0 * 4096.0, "{body}");
    assert_eq!(m["kvpeer_transfers_ok_total"], 1.0, "{body}");
    assert!(m["kvpeer_sessions_opened_total"] >= 1.0, "{body}");
    assert_eq!(m["kvpeer_protocol_errors_total"], 0.0, "{body}");
    assert_eq!(
        m["kvpeer_fetch_seconds_bucket{le=\"+Inf\"}"], 0.0,
        "a server makes no fetch calls"
    );
    // Every sample has its HELP and TYPE.
    for name in m.keys() {
        let base = name.split('{').next().unwrap();
        let family = base
            .strip_suffix("_bucket")
            .or_else(|| base.strip_suffix("_sum"))
            .or_else(|| base.strip_suffix("_count"))
            .unwrap_or(base);
        assert!(
            body.contains(&format!("# TYPE {family} ")),
            "no TYPE for {name}"
        );
        assert!(
            body.contains(&format!("# HELP {family} ")),
            "no HELP for {name}"
        );
    }
    let (head, _) = http_get(&metrics_addr(&_server), "/nothing");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
}

#[test]
fn fetch_draws_a_progress_bar_only_on_a_terminal() {
    let (_server, id) = small_server();
    let fetch = format!(
        "{BIN} {}",
        Cli::fetch(id.as_str())
            .pool(16, 4096)
            .workload(4, 4)
            .args()
            .join(" ")
    );
    // `script` (util-linux, on every Debian) runs it on a pseudo-terminal.
    let out = Command::new("script")
        .args(["-qec", &fetch, "/dev/null"])
        .output()
        .expect("script runs");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("] 0/4 requests"),
        "a bar on the terminal: {text:?}"
    );
    assert!(text.contains("kvpeer fetch: requests=4"), "{text:?}");

    // Piped, as in every other test here: no bar in stderr.
    let mut piped = Cli::fetch_shared(id.as_str())
        .pool(16, 4096)
        .workload(4, 4)
        .spawn();
    assert_eq!(piped.wait_while(Duration::from_secs(30), || {}), 0);
    std::thread::sleep(Duration::from_millis(100));
    assert!(!piped.stderr.lock().unwrap().contains("requests,"));
}

#[test]
fn fetch_mixes_in_new_keys_by_default_and_reports_the_hit_rate() {
    let (_server, id) = Cli::serve()
        .pool(32, 4096)
        .arg("--fill", 32)
        .start_serving();
    let (s, _) = Cli::fetch(id.as_str())
        .pool(32, 4096)
        .workload(2, 8)
        .flag("--json")
        .run_json();
    // A quarter of each request's 8 keys is new text: 2 misses, 6 shared keys held.
    assert_eq!(
        (s["hits"].as_u64(), s["misses"].as_u64()),
        (Some(12), Some(4)),
        "{s}"
    );
    assert_eq!(s["hit_rate"].as_f64(), Some(0.75), "{s}");
}

/// `fetch --concurrency 4`: four callers share the node, every byte still checked; the pool
/// must hold every request in flight and one more (slack for blocks landed, not yet read).
#[test]
fn fetch_runs_requests_in_flight_together() {
    let (_server, id) = Cli::serve()
        .plane("shm")
        .pool(64, 4096)
        .arg("--fill", 32)
        .start_serving();
    let fetch = Cli::fetch_shared(id.as_str())
        .plane("shm")
        .arg("--block-len", 4096)
        .arg("--keys", 8)
        .arg("--prefixes", 4)
        .flag("--json")
        .arg("--concurrency", 4);
    let out = fetch
        .clone()
        .arg("--requests", 40)
        .arg("--blocks", 40)
        .output();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (s["hits"].as_u64(), s["corrupt_blocks"].as_u64()),
        (Some(320), Some(0)),
        "{s}"
    );
    assert_eq!(s["failed_loads"], 0, "{s}");

    let out = fetch.arg("--requests", 4).arg("--blocks", 32).output();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--concurrency"), "{stderr}");
}

/// `fetch --driven`: the node runs on the command's own thread (an engine-driven node, no
/// runtime thread), one request at a time and four in flight on that one thread, every byte
/// checked; on tcp and on shm.
#[test]
fn fetch_drives_the_node_on_its_own_thread() {
    for plane in ["tcp", "shm"] {
        let (_server, id) = Cli::serve()
            .plane(plane)
            .pool(64, 4096)
            .arg("--fill", 32)
            .start_serving();
        for concurrency in [1, 4] {
            let out = Cli::fetch_shared(id.as_str())
                .plane(plane)
                .arg("--block-len", 4096)
                .arg("--blocks", 40)
                .arg("--keys", 8)
                .arg("--prefixes", 4)
                .arg("--requests", 24)
                .arg("--warmup", 2)
                .arg("--concurrency", concurrency)
                .flag("--driven")
                .flag("--json")
                .output();
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{plane} ×{concurrency}: {stderr}");
            let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
            // 24 timed requests of 8 keys of the 4 shared prefixes, all held (32 filled).
            assert_eq!(
                (s["hits"].as_u64(), s["misses"].as_u64()),
                (Some(192), Some(0)),
                "{plane} ×{concurrency}: {s}"
            );
            assert_eq!(s["bytes"].as_u64(), Some(192 * 4096), "{s}");
            assert_eq!(s["corrupt_blocks"], 0, "{s}");
            assert_eq!(s["failed_loads"], 0, "{s}");
        }
        // Keys the peer never held: every request ends with the terminal empty fetch, and the
        // peer still serves the next run.
        let (s, _) = Cli::fetch_shared(id.as_str())
            .plane(plane)
            .pool(40, 4096)
            .workload(6, 8)
            .arg("--first", 1000)
            .arg("--concurrency", 2)
            .flag("--driven")
            .flag("--json")
            .run_json();
        assert_eq!(
            (s["hits"].as_u64(), s["misses"].as_u64()),
            (Some(0), Some(48)),
            "{s}"
        );
    }
}

/// A driven fetch from a peer that never answers ends within `--timeout-secs` with an error
/// naming the phase, not a hang.
#[test]
fn a_driven_fetch_from_a_silent_peer_is_a_bounded_error() {
    // A listener that accepts and never speaks ZMTP.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = format!("127.0.0.1:{}", silent.local_addr().unwrap().port());
    let mut fetch = Cli::fetch(&peer)
        .pool(32, 4096)
        .workload(1, 4)
        .arg("--timeout-secs", 1)
        .flag("--driven")
        .spawn();
    // `wait_while` fails the test if the command is still running after 30 s.
    let status = fetch.wait_while(Duration::from_secs(30), || {
        std::thread::sleep(Duration::from_millis(10))
    });
    assert_eq!(status, 1);
    let stderr = fetch.stderr.lock().unwrap().clone();
    assert!(stderr.contains("lookup took longer than 1 s"), "{stderr}");
    drop(silent);
}
