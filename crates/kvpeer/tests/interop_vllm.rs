//! kvpeer against vLLM 0.33's own P2P code, both directions, over loopback ZeroMQ.
//!
//! The vLLM side is `tests/interop/vllm_peer.py`: vLLM's released `ZmqTransport` and
//! `P2PSession` (extracted unchanged from the wheel by `tests/interop/setup.sh`) driven the way
//! vLLM's tier manager drives them, with kvpeer's `shm` data plane as its `DataTransport`. The
//! kvpeer side is the `kvpeer` binary (`serve`, `fetch`) or an in-process [`kvpeer::Node`].
//! Every fetched block is checked byte for byte against the synthetic workload, and after each
//! scenario both sides must hold no pins, no request state and no transfers.
//!
//! Python comes from `KVPEER_PYTHON` (scripts/test.sh's venv); vLLM's modules from
//! `KVPEER_INTEROP_PYTHONPATH`, or this test runs setup.sh once (it downloads the wheel into
//! a cache the first time).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::node::{assert_bytes, assert_node_clean, keys, store};
use common::vllm::{
    assert_serve_clean, assert_vllm_clean, kvpeer_fetch, kvpeer_serve, metric, vllm, vllm_fetch,
    vllm_fetch_three_rounds, vllm_pd_fetch_aborted, vllm_serve, vllm_stop,
    vllm_stop_after_disconnect, VLLM_SHM_TOKENS,
};
use common::{free_port, BIN};
use kvpeer::{LookupResult, Node, NodeConfig, NodeError, PeerId, PlaneKind};

/// A kvpeer node in this process on the shm plane (taking the address-bound tokens vLLM's
/// session sends over kvpeer's Python shm transport: it cannot read our challenge).
fn node(tag: &str, load_timeout: Duration) -> Node {
    let config = NodeConfig::builder(&format!("interop-{tag}"))
        .plane(PlaneKind::Shm)
        .shm_allow_replayable_tokens(true);
    common::node::start(config, load_timeout)
}

// ---------------------------------------------------------------------------------------------
// vLLM consumer ↔ kvpeer producer

/// Handshake, lookups with hits and misses, three lookup rounds per request (two closed by a
/// fetch, the last all misses and closed by the terminal empty fetch), every byte checked; the
/// vLLM peer's `disconnect` closes kvpeer's session in order.
#[test]
fn a_vllm_consumer_fetches_from_kvpeer_serve() {
    let (serve, id) = kvpeer_serve(&["--fill", "64"]);
    let s = vllm_fetch_three_rounds(&[], &id, 8, &serve);
    // 3 lookups per request; 2 fetches with blocks + the terminal empty one.
    assert_eq!(s["sent"]["lookup"], 24, "{s}");
    assert_eq!(s["sent"]["fetch"], 24, "{s}");
    assert_eq!(s["received"]["lookup_resp"], 24, "{s}");

    assert_eq!(metric(&serve, "kvpeer_transfers_ok_total"), 16.0);
    assert_eq!(metric(&serve, "kvpeer_fetch_blocks_served_total"), 64.0);
    assert_eq!(metric(&serve, "kvpeer_lookups_served_total"), 24.0);
    assert_serve_clean(&serve);
    assert_eq!(metric(&serve, "kvpeer_protocol_errors_total"), 0.0);
    let log = serve.log();
    assert!(log.contains("disconnect"), "{log}");
    assert!(!log.contains("WARN") && !log.contains("ERROR"), "{log}");
}

/// A PD decoder's fetch of blocks kvpeer never stores: vLLM's load times out, it aborts each
/// round, and kvpeer acknowledges each abort with the round it names.
#[test]
fn a_vllm_consumers_load_timeout_is_aborted_and_acked_with_its_round() {
    let (serve, id) = kvpeer_serve(&["--fill", "8"]);
    let s = vllm_pd_fetch_aborted(&id, &[]);
    assert_eq!(s["abort_rounds"], serde_json::json!([0, 1]), "{s}");
    assert_eq!(s["received"].get("transfer_done"), None, "{s}");
    assert_serve_clean(&serve);
}

/// kvpeer answers a key it is still receiving (HIT_PENDING inside) MISS at the 5 s deadline; the
/// vLLM consumer fetches the keys answered held. The pending key is the first of two blocks
/// kvpeer is loading from a third node whose tcp writes are capped at one block per 8 s, so the
/// load (and the key's pending state) lasts ~8 s.
#[test]
fn kvpeer_answers_a_key_still_landing_miss_at_the_5_s_deadline() {
    let mut slow = NodeConfig::local("interop-slow");
    slow.spec.plane = PlaneKind::Tcp;
    slow.spec.tcp_max_write_rate = Some(8 * 1024);
    let slow = Node::start(slow).unwrap();
    let mut middle = NodeConfig::local("interop-middle");
    middle.spec.plane = PlaneKind::Both;
    middle.spec.shm_allow_replayable_tokens = true;
    let middle = Arc::new(Node::start(middle).unwrap());
    let held = keys(0..4);
    let landing = keys(4..6);
    store(&middle, &held);
    store(&slow, &landing);
    let t = Duration::from_secs(30);
    let warm = Arc::new(middle.request(slow.id(), "warm").unwrap());
    let found = warm.lookup(&landing, t).unwrap();
    assert_eq!(found, [LookupResult::Hit; 2]);
    let loading = {
        let (warm, landing) = (warm.clone(), landing.clone());
        std::thread::spawn(move || warm.fetch(&landing, Duration::from_secs(60)))
    };
    // The load has reserved its block once the pool shows a block being written.
    let deadline = Instant::now() + Duration::from_secs(10);
    while middle.stats().unwrap().store.writing == 0 {
        assert!(!loading.is_finished(), "{:?}", loading.join());
        assert!(Instant::now() < deadline, "the load never started");
        std::thread::sleep(Duration::from_millis(5));
    }

    let (status, s) = vllm_fetch(&[
        "--peer",
        middle.id().as_str(),
        "--requests",
        "1",
        "--keys",
        "5",
        "--miss-share",
        "0",
    ]);
    assert_eq!(status, 0, "{s}");
    assert_eq!(
        (s["hits"].as_u64(), s["misses"].as_u64()),
        (Some(4), Some(1)),
        "{s}"
    );
    let lookup_us = s["lookup_us"][0].as_u64().unwrap();
    assert!(
        lookup_us >= 4_900_000,
        "answered before the 5 s deadline: {s}"
    );
    assert_eq!(s["corrupt_blocks"], 0);
    assert_vllm_clean(&s);
    assert_eq!(middle.stats().unwrap().counters.pending_expired, 1);

    loading.join().unwrap().unwrap();
    // The loading thread's clone is gone with it: this is the last handle.
    Arc::into_inner(warm).expect("no other handle").finish();
    assert_bytes(&middle, &landing);
    assert_node_clean(&middle);
    assert_node_clean(&slow);
}

// ---------------------------------------------------------------------------------------------
// kvpeer consumer ↔ vLLM producer

/// `kvpeer fetch` against vLLM: hits and misses, every byte checked, and kvpeer's `disconnect`
/// at the end closes vLLM's session in order.
#[test]
fn kvpeer_fetch_fetches_from_a_vllm_producer() {
    let (mut producer, id) = vllm_serve(&["--fill", "64"]);
    let f = kvpeer_fetch(
        &id,
        &[
            "--plane",
            "shm",
            "--requests",
            "8",
            "--keys",
            "8",
            "--miss-share",
            "0.25",
        ],
        &producer,
    );
    assert_eq!(
        (f["hits"].as_u64(), f["misses"].as_u64()),
        (Some(48), Some(16)),
        "{f}"
    );
    assert_eq!(f["bytes"], 48 * 65536);

    // kvpeer's disconnect ends the session on vLLM's side as the peer's own decision.
    let s = vllm_stop_after_disconnect(&mut producer);
    assert_eq!(s["received"]["lookup"], 8, "{s}");
    assert_eq!(s["received"]["fetch"], 8, "{s}");
    assert_eq!(s["sent"]["transfer_done"], 8, "{s}");
}

/// vLLM answers a key it holds HIT_PENDING for MISS at its 5 s deadline; kvpeer's lookup waits
/// for it and fetches the keys answered held.
#[test]
fn vllm_answers_a_pending_key_miss_at_the_5_s_deadline() {
    let (mut producer, id) = vllm_serve(&[
        "--fill",
        "4",
        "--pending-first",
        "4",
        "--pending-count",
        "1",
    ]);
    let consumer = node("pending", Duration::from_secs(30));
    let peer = PeerId::new(id);
    let ks = keys(0..5);
    let t = Duration::from_secs(30);
    consumer.connect(&peer, t).unwrap();
    let req = consumer.request(&peer, "r").unwrap();
    let started = Instant::now();
    let found = req.lookup(&ks, t).unwrap();
    let waited = started.elapsed();
    assert_eq!(
        found,
        [[LookupResult::Hit; 4].as_slice(), &[LookupResult::Miss]].concat()
    );
    assert!(
        waited >= Duration::from_millis(4_900),
        "answered after {waited:?}"
    );
    req.fetch(&ks[..4], t).unwrap();
    assert_bytes(&consumer, &ks[..4]);
    req.finish();
    consumer.shutdown(Duration::from_secs(3));
    vllm_stop(&mut producer);
}

/// vLLM's writes never land: kvpeer's load times out, kvpeer aborts, and vLLM's abort_ack
/// (with the round) settles the load; nothing stays pinned on either side.
#[test]
fn kvpeers_load_timeout_is_aborted_and_acked_by_vllm() {
    let (mut producer, id) = vllm_serve(&["--fill", "8", "--stall-writes"]);
    let consumer = node("stall", Duration::from_secs(1));
    let peer = PeerId::new(id);
    let ks = keys(0..4);
    let t = Duration::from_secs(30);
    let req = consumer.request(&peer, "r").unwrap();
    assert_eq!(req.lookup(&ks, t).unwrap(), [LookupResult::Hit; 4]);
    let failed = req.fetch(&ks, t);
    assert!(matches!(failed, Err(NodeError::LoadFailed)), "{failed:?}");
    let c = consumer.stats().unwrap().counters;
    assert_eq!(
        (c.aborts_sent, c.abort_acks, c.loads_failed),
        (1, 1, 1),
        "{c:?}"
    );
    assert!(ks.iter().all(|k| consumer.read(k).is_none()));
    req.finish();
    assert_node_clean(&consumer);
    consumer.shutdown(Duration::from_secs(3));
    let s = vllm_stop(&mut producer);
    assert_eq!(s["received"]["abort_fetch"], 1, "{s}");
    assert_eq!(s["sent"]["abort_ack"], 1, "{s}");
}

// ---------------------------------------------------------------------------------------------
// refusals

/// hash seed, block_len and fingerprint mismatches are refused both ways; kvpeer's refusal
/// reaches the vLLM peer as `disconnect` at once (not at its 30 s handshake timeout).
#[test]
fn mismatched_peers_are_refused_both_ways() {
    let dir = std::env::temp_dir().join(format!("kvpeer-interop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("fingerprint.toml");
    std::fs::write(&config, "config_fingerprint = \"00000000000000aa\"\n").unwrap();
    let config = config.to_str().unwrap();

    // vLLM consumers refused by kvpeer.
    let (serve, id) = kvpeer_serve(&["--fill", "8", "--config", config]);
    for bad in [
        &["--hash-seed", "1"][..],
        &["--block-len", "4096"],
        &["--model", "another-model"],
    ] {
        let mut args = vec!["--peer", id.as_str(), "--requests", "1"];
        args.extend_from_slice(bad);
        let (status, s) = vllm_fetch(&args);
        assert_eq!(status, 1, "{bad:?}: {s}");
        assert_eq!(s["handshake"], "refused", "{bad:?}: {s}");
        // kvpeer answers a refused `connect` with `disconnect` alone (not its own `connect`,
        // which vLLM would check and refuse first): the session ends at once, not at the
        // 30 s handshake timeout, for kvpeer's reason.
        assert_eq!(s["received"]["disconnect"], 1, "{bad:?}: {s}");
        assert!(s["received"]["connect"].is_null(), "{bad:?}: {s}");
        assert_eq!(
            s["deaths"][0]["reason"], "peer disconnected",
            "{bad:?}: {s}"
        );
        assert!(
            s["deaths"][0]["after_s"].as_f64() < Some(5.0),
            "{bad:?}: {s}"
        );
    }
    let log = serve.log();
    for what in ["hash seed", "block_len", "fingerprint"] {
        assert!(
            log.contains(what),
            "kvpeer did not refuse for {what}:\n{log}"
        );
    }

    assert_serve_clean(&serve);
    assert_eq!(metric(&serve, "kvpeer_transfers_ok_total"), 0.0);

    // kvpeer consumers refused by vLLM (and refusing it: each side checks the other). A vLLM
    // producer per case: vLLM's control transport can go deaf once it has closed a session
    // (docs/behaviour.md #11).
    for (bad, what) in [
        (&["--hash-seed", "1"][..], "hash seed"),
        (&["--block-len", "4096"], "block_len"),
        (&["--config", config], "config fingerprint"),
    ] {
        let (mut producer, id) = vllm_serve(&["--fill", "8", "--model", "m"]);
        let out = Command::new(BIN)
            .args(["fetch", "--peer", &id, "--plane", "shm", "--requests", "1"])
            .args(VLLM_SHM_TOKENS)
            .args(["--timeout-secs", "20"])
            .args(bad)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{bad:?}: {stderr}");
        let error = format!("{what} mismatch");
        assert!(stderr.contains(&error), "{bad:?}: {stderr}");
        // vLLM's own refusal: its session's death.
        let deadline = Instant::now() + Duration::from_secs(10);
        while !producer.log().contains(&error) {
            assert!(
                Instant::now() < deadline,
                "vLLM never refused: {}",
                producer.log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let s = vllm_stop(&mut producer);
        let refused = format!("rejected peer connect: {what} mismatch");
        let reasons = &s["deaths"];
        assert!(
            reasons
                .as_array()
                .unwrap()
                .iter()
                .any(|d| d["reason"].as_str().unwrap().starts_with(&refused)),
            "{reasons}"
        );
        assert_eq!(s["sent"].get("transfer_done"), None, "{s}");
        assert_eq!(s["leftover"]["sessions"], 0, "{s}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

// ---------------------------------------------------------------------------------------------
// restarts

/// A vLLM producer killed (SIGKILL) mid-workload and started again at the same address: the
/// kvpeer consumer reconnects and fetches byte-exact from the new one.
#[test]
fn kvpeer_reconnects_to_a_restarted_vllm_producer() {
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--fill", "64", "--listen", listen.as_str()];
    let (mut first, id) = vllm_serve(&args);
    let consumer = node("restart", Duration::from_secs(5));
    let peer = PeerId::new(id);
    let t = Duration::from_secs(10);
    let request = |r: u64| -> Result<(), NodeError> {
        let ks = keys(r * 4..r * 4 + 4);
        let name = format!("r{r}");
        let req = consumer.request(&peer, &name)?;
        let found = req.lookup(&ks, Duration::from_secs(3));
        let result = match found {
            Ok(f) if f == [LookupResult::Hit; 4] => req.fetch(&ks, t),
            Ok(f) => panic!("{f:?}"),
            Err(e) => Err(e),
        };
        req.finish();
        if result.is_ok() {
            assert_bytes(&consumer, &ks);
        }
        result
    };
    for r in 0..4 {
        request(r).unwrap();
    }
    first.kill9();
    let (mut second, _) = vllm_serve(&args);
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut r = 4;
    let mut served_after_restart = 0;
    while served_after_restart < 4 {
        assert!(
            Instant::now() < deadline,
            "never reconnected: {}",
            second.log()
        );
        if request(r).is_ok() {
            served_after_restart += 1;
        }
        r += 1;
    }
    assert!(consumer.stats().unwrap().counters.sessions_opened >= 2);
    assert_node_clean(&consumer);
    consumer.shutdown(Duration::from_secs(3));
    vllm_stop(&mut second);
}

/// A vLLM consumer killed (SIGKILL) mid-workload and started again with the same identity:
/// kvpeer serves the new one byte-exact and holds nothing for the dead one.
#[test]
fn kvpeer_serves_a_restarted_vllm_consumer() {
    let (serve, id) = kvpeer_serve(&["--fill", "64"]);
    let listen = format!("127.0.0.1:{}", free_port());
    let mut first = vllm(&[
        "fetch",
        "--peer",
        &id,
        "--listen",
        &listen,
        "--requests",
        "1000000",
        "--keys",
        "8",
        "--prefixes",
        "8",
    ]);
    first.event("ready");
    // Killed once it is well into its workload.
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(&serve, "kvpeer_transfers_ok_total") < 20.0 {
        assert!(Instant::now() < deadline, "{}", first.log());
        std::thread::sleep(Duration::from_millis(10));
    }
    first.kill9();
    let (status, s) = vllm_fetch(&[
        "--peer",
        &id,
        "--listen",
        &listen,
        "--requests",
        "8",
        "--keys",
        "8",
    ]);
    assert_eq!(status, 0, "{s}\n{}", serve.log());
    assert_eq!(s["hits"], 48, "{s}");
    assert_eq!(s["corrupt_blocks"], 0);
    assert_vllm_clean(&s);
    assert_serve_clean(&serve);
}

/// kvpeer serves vLLM consumers one after another without going deaf: vLLM's own control
/// transport can stop hearing new peers after closing a few sessions (libzmq monitor closed
/// before its socket; docs/behaviour.md #11), kvpeer's closes in the safe order.
#[test]
fn kvpeer_serve_hears_many_vllm_consumers_in_turn() {
    let (serve, id) = kvpeer_serve(&["--fill", "16"]);
    for i in 0..10 {
        let (status, s) = vllm_fetch(&[
            "--peer",
            &id,
            "--requests",
            "2",
            "--keys",
            "4",
            "--prefixes",
            "4",
            "--timeout",
            "10",
        ]);
        assert_eq!(status, 0, "consumer {i}: {s}\n{}", serve.log());
        assert_eq!(s["hits"], 6, "consumer {i}: {s}");
    }
    assert_eq!(metric(&serve, "kvpeer_sessions_opened_total"), 10.0);
    assert_serve_clean(&serve);
}

/// A vLLM consumer with 4 requests in flight per step (their lookups in one step, their fetches
/// together): kvpeer serves them all, every byte checked, nothing left open.
#[test]
fn kvpeer_serves_a_vllm_consumer_with_requests_in_flight() {
    let (serve, id) = kvpeer_serve(&["--fill", "64"]);
    let (status, s) = vllm_fetch(&[
        "--peer",
        &id,
        "--requests",
        "32",
        "--keys",
        "16",
        "--miss-share",
        "0.25",
        "--prefixes",
        "4",
        "--concurrency",
        "4",
        "--blocks",
        "64",
    ]);
    assert_eq!(status, 0, "{s}\n{}", serve.log());
    assert_eq!(
        (s["hits"].as_u64(), s["misses"].as_u64()),
        (Some(384), Some(128)),
        "{s}"
    );
    assert_eq!(s["corrupt_blocks"], 0);
    assert_vllm_clean(&s);
    assert_serve_clean(&serve);
}
