//! The `nixl` plane (cargo feature `nixl`): kvpeer nodes and vLLM 0.33's own `NixlTransport`
//! (with its `ZmqTransport` and `P2PSession`, extracted unchanged from the wheel) exchange
//! blocks over NIXL — UCX on DRAM over loopback — both directions, every byte checked: the
//! test that a stock vLLM engine and kvpeer share blocks.
//!
//! Needs NIXL's wheel (`scripts/test.sh` installs it into its venv; `KVPEER_NIXL_LIB_DIR`
//! names another copy) and the interop set-up of `interop_vllm.rs`.

#![cfg(feature = "nixl")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::node::{assert_bytes, assert_node_clean, keys, store};
use common::pool_memory::assert_pool_memory;
use common::vllm::{
    assert_serve_clean, kvpeer_fetch, kvpeer_serve_on, metric, nixl_lib_dir, ucx_env, vllm_fetch,
    vllm_fetch_three_rounds, vllm_pd_fetch_aborted, vllm_serve, vllm_stop,
    vllm_stop_after_disconnect,
};
use common::{free_port, BIN};
use kvpeer::node::build::build;
use kvpeer::{LookupResult, Node, NodeConfig, NodeError, PeerId, PlaneKind};

/// A vLLM NixlTransport producer holding 64 blocks of 2 MiB.
const PRODUCER_2MIB: [&str; 8] = [
    "--transport",
    "nixl",
    "--fill",
    "64",
    "--blocks",
    "64",
    "--block-len",
    "2097152",
];

fn nixl_plane(dir: &str) -> [&str; 4] {
    ["--plane", "nixl", "--nixl-lib-dir", dir]
}

/// An in-process node on the nixl plane.
fn node(tag: &str, block_len: u64, load_timeout: Duration) -> Node {
    ucx_env();
    let config = NodeConfig::builder(&format!("nixl-{tag}"))
        .plane(PlaneKind::Nixl)
        .block_len(block_len)
        .num_blocks(128)
        .set("nixl_lib_dir", nixl_lib_dir());
    common::node::start(config, load_timeout)
}

/// A node on the nixl plane registers a pool of private anonymous memory in huge pages (no
/// peer maps it, so no `/dev/shm` object, which gets no huge pages): checked in smaps.
#[test]
fn a_nixl_nodes_pool_is_anonymous_memory_in_huge_pages() {
    ucx_env();
    let config = NodeConfig::builder("nixl-pool")
        .plane(PlaneKind::Nixl)
        .block_len(2 << 20)
        .num_blocks(4)
        .set("nixl_lib_dir", nixl_lib_dir())
        .build()
        .unwrap();
    let io = build(&config.spec).unwrap();
    let pool = io.core().parent().pool();
    assert_pool_memory(pool, false);
    assert_eq!(
        io.core().local().base_addr,
        pool.base_addr(),
        "what NIXL registered and peers address"
    );
}

/// Two kvpeer nodes on the nixl plane: NIXL metadata in `connect`, lookups, a fetch written by
/// NIXL, byte-exact; nothing left open.
#[test]
fn two_kvpeer_nodes_share_blocks_over_nixl() {
    let producer = node("p", 64 * 1024, Duration::from_secs(30));
    let consumer = node("c", 64 * 1024, Duration::from_secs(30));
    store(&producer, &keys(0..16));
    let ks = keys(0..20);
    let t = Duration::from_secs(30);
    let req = consumer.request(producer.id(), "r").unwrap();
    let found = req.lookup(&ks, t).unwrap();
    assert_eq!(found[..16], [LookupResult::Hit; 16]);
    assert_eq!(found[16..], [LookupResult::Miss; 4]);
    req.fetch(&ks[..16], t).unwrap();
    assert_bytes(&consumer, &ks[..16]);
    req.finish();
    assert_node_clean(&consumer);
    assert_node_clean(&producer);
    consumer.shutdown(Duration::from_secs(3));
    producer.shutdown(Duration::from_secs(3));
}

/// vLLM's own NixlTransport consumer against `kvpeer serve --plane nixl`: handshake with real
/// NIXL metadata both ways, three lookup rounds per request (two fetches written by kvpeer's
/// NIXL agent into vLLM's registered memory, then the terminal empty fetch), every byte checked.
#[test]
fn a_vllm_nixl_consumer_fetches_from_kvpeer() {
    ucx_env();
    let dir = nixl_lib_dir();
    let (serve, id) = kvpeer_serve_on(&nixl_plane(&dir), &["--fill", "64"]);
    vllm_fetch_three_rounds(&["--transport", "nixl"], &id, 4, &serve);
    assert_eq!(metric(&serve, "kvpeer_transfers_ok_total"), 8.0);
    assert_serve_clean(&serve);
    let log = serve.log();
    assert!(!log.contains("WARN") && !log.contains("ERROR"), "{log}");
}

/// `kvpeer fetch --plane nixl` against vLLM's own NixlTransport producer: vLLM's NIXL agent
/// writes into kvpeer's registered pool; every byte checked; kvpeer's disconnect ends vLLM's
/// session in order.
#[test]
fn kvpeer_fetches_over_nixl_from_a_vllm_producer() {
    ucx_env();
    let dir = nixl_lib_dir();
    let (mut producer, id) = vllm_serve(&["--transport", "nixl", "--fill", "64"]);
    let args = [&["--requests", "8", "--keys", "8"][..], &nixl_plane(&dir)].concat();
    let f = kvpeer_fetch(&id, &args, &producer);
    assert_eq!(
        (f["hits"].as_u64(), f["misses"].as_u64()),
        (Some(48), Some(16)),
        "{f}"
    );
    let s = vllm_stop_after_disconnect(&mut producer);
    assert_eq!(s["sent"]["transfer_done"], 8, "{s}");
}

/// A vLLM PD consumer's fetches that kvpeer has nothing for time out; vLLM aborts each round
/// and kvpeer's abort_ack names it.
#[test]
fn a_vllm_nixl_consumers_aborts_are_acked() {
    ucx_env();
    let dir = nixl_lib_dir();
    let (serve, id) = kvpeer_serve_on(&nixl_plane(&dir), &["--fill", "8"]);
    vllm_pd_fetch_aborted(&id, &["--transport", "nixl"]);
    assert_serve_clean(&serve);
}

/// A vLLM consumer killed (SIGKILL) right after its fetch, while kvpeer's NIXL WRITE of
/// 64 × 2 MiB may be landing in it: kvpeer releases every pin, transfer and request, and then
/// serves a new vLLM consumer byte-exact.
#[test]
fn a_vllm_consumer_killed_mid_transfer_leaves_kvpeer_clean() {
    ucx_env();
    let dir = nixl_lib_dir();
    let mb2 = (2 << 20).to_string();
    let (serve, id) = kvpeer_serve_on(
        &nixl_plane(&dir),
        &["--fill", "64", "--blocks", "96", "--block-len", &mb2],
    );
    let common = [
        "--transport",
        "nixl",
        "--peer",
        &id,
        "--block-len",
        &mb2,
        "--blocks",
        "80",
    ];
    let mut args = common.to_vec();
    args.extend_from_slice(&[
        "--requests",
        "1",
        "--keys",
        "64",
        "--miss-share",
        "0",
        "--die-after-fetch",
    ]);
    let mut killed = common::vllm::vllm(&[&["fetch"][..], &args].concat());
    let status = killed.wait_while(Duration::from_secs(60), || {
        std::thread::sleep(Duration::from_millis(5))
    });
    assert_ne!(status, 0, "the consumer was to die: {}", killed.log());
    assert_serve_clean(&serve);

    let mut args = common.to_vec();
    args.extend_from_slice(&["--requests", "2", "--keys", "16", "--miss-share", "0"]);
    let (status, s) = vllm_fetch(&args);
    assert_eq!(status, 0, "{s}\n{}", serve.log());
    assert_eq!(s["hits"], 32, "{s}");
    assert_eq!(s["corrupt_blocks"], 0);
    assert_serve_clean(&serve);
}

/// A vLLM NIXL producer killed (SIGKILL) while a kvpeer consumer fetches 64 × 2 MiB from it
/// again and again: each load either lands whole or fails, nothing stays pinned, written or
/// readable from a failed load, and a restarted producer at the same address serves byte-exact.
#[test]
fn a_vllm_producer_killed_mid_transfer_leaves_kvpeer_clean() {
    let mb2 = 2u64 << 20;
    let consumer = Arc::new(node("killp", mb2, Duration::from_secs(5)));
    let listen = format!("127.0.0.1:{}", free_port());
    let serve_args = [&PRODUCER_2MIB[..], &["--listen", listen.as_str()]].concat();
    let (mut first, id) = vllm_serve(&serve_args);
    let peer = PeerId::new(id);
    let ks = keys(0..64);
    let run = |consumer: &Node, r: u64| -> Result<(), NodeError> {
        let name = format!("r{r}");
        let req = consumer.request(&peer, &name)?;
        let mut fetched = false;
        let result = req.lookup(&ks, Duration::from_secs(5)).and_then(|found| {
            if found.iter().all(|f| *f == LookupResult::Hit) {
                fetched = true;
                req.fetch(&ks, Duration::from_secs(20))
            } else {
                Err(NodeError::LoadFailed)
            }
        });
        req.finish();
        // A failed load leaves nothing readable. (A lookup that failed fetched nothing: the
        // blocks of an earlier load that landed stay, as they should.)
        if result.is_err() && fetched {
            assert!(
                ks.iter().all(|k| consumer.read(k).is_none()),
                "a failed load left blocks"
            );
        }
        result
    };
    run(&consumer, 0).unwrap();
    assert_bytes(&consumer, &ks);
    // Kill the producer while the next loads run.
    let killer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        first.kill9();
    });
    for r in 1..6 {
        let _ = run(&consumer, r);
    }
    killer.join().unwrap();
    assert_node_clean(&consumer);

    let (mut second, _) = vllm_serve(&serve_args);
    let deadline = Instant::now() + Duration::from_secs(40);
    let mut r = 10;
    while run(&consumer, r).is_err() {
        assert!(
            Instant::now() < deadline,
            "never served again: {}",
            second.log()
        );
        r += 1;
    }
    assert_bytes(&consumer, &ks);
    assert_node_clean(&consumer);
    consumer.shutdown(Duration::from_secs(3));
    vllm_stop(&mut second);
}

/// Without NIXL's library, the plane fails at start-up with an error naming what to install;
/// the process exits with a message, never an abort.
#[test]
fn a_missing_nixl_library_is_a_clear_error() {
    let out = Command::new(BIN)
        .args(["serve", "--plane", "nixl", "--nixl-lib-dir", "/nonexistent"])
        .env_remove("LD_LIBRARY_PATH")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("cannot load NIXL"), "{stderr}");
    assert!(
        stderr.contains("pip install --no-deps nixl==1.5.1"),
        "{stderr}"
    );
}

/// kvpeer gives up on a load of 64 × 2 MiB from vLLM over NIXL at once (a 200 µs load
/// timeout): it aborts, and keeps the blocks reserved until vLLM's abort_ack says no WRITE can
/// land; the load fails, nothing of it is readable, and the next load from the same producer
/// lands byte-exact.
///
/// vLLM cancels the round only when the abort reaches it before it starts the WRITE (in the
/// same 1 ms tick of its loop as the fetch); an abort that comes once the WRITE runs is drained
/// (`transfer_done`, then `abort_ack`) and the load lands. A 1 ms timeout made that a race
/// against vLLM's tick: the abort trailed the fetch by about 0.8 ms through libzmq and usually
/// won; through kvpeer's own DEALER, which writes the fetch at once, by about 1 ms, and it lost
/// all ten tries in about one run of three.
#[test]
fn kvpeers_abort_of_a_landing_nixl_write_waits_for_vllms_ack() {
    let mb2 = 2u64 << 20;
    let consumer = node("abort", mb2, Duration::from_micros(200));
    let (mut producer, id) = vllm_serve(&PRODUCER_2MIB);
    let peer = PeerId::new(id);
    let ks = keys(0..64);
    let t = Duration::from_secs(30);
    // The deadline fires right after the fetch left, unless this runtime is not scheduled in
    // time (a loaded machine): then the WRITE starts, lands, and the load succeeds; try again.
    let mut aborted = false;
    for attempt in 0..10 {
        let name = format!("a{attempt}");
        let req = consumer.request(&peer, &name).unwrap();
        assert_eq!(req.lookup(&ks, t).unwrap(), [LookupResult::Hit; 64]);
        let result = req.fetch(&ks, t);
        req.finish();
        match result {
            Ok(()) => assert_bytes(&consumer, &ks),
            Err(NodeError::LoadFailed) => {
                assert!(ks.iter().all(|k| consumer.read(k).is_none()));
                aborted = true;
                break;
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert!(aborted, "no load was cut short in 10 tries");
    // An abort that crossed its `transfer_done` on the wire is moot (the load landed); the one
    // that cut a load short was settled by vLLM's abort_ack.
    let c = consumer.stats().unwrap().counters;
    assert!(c.aborts_sent >= 1 && c.abort_acks == 1, "{c:?}");
    assert_node_clean(&consumer);

    // A consumer with a sane load timeout is then served byte-exact by the same producer (the
    // first stays connected: vLLM's transport may go deaf once it closes a session,
    // docs/behaviour.md #11).
    let next = node("after-abort", mb2, Duration::from_secs(30));
    let req = next.request(&peer, "b").unwrap();
    assert_eq!(req.lookup(&ks, t).unwrap(), [LookupResult::Hit; 64]);
    req.fetch(&ks, t).unwrap();
    assert_bytes(&next, &ks);
    req.finish();
    assert_node_clean(&next);
    next.shutdown(Duration::from_secs(3));
    consumer.shutdown(Duration::from_secs(3));
    let s = vllm_stop(&mut producer);
    assert_eq!(s["received"]["abort_fetch"], c.aborts_sent, "{s}");
    assert!(s["sent"]["abort_ack"].as_u64() >= Some(1), "{s}");
}
