//! The pool node end to end (issue 15's acceptance), on the `nixl` plane (cargo feature
//! `nixl`) against stock vLLM peers: a vLLM producer (`vllm_peer.py serve --transport nixl`)
//! announces the blocks it holds with vLLM's own `ZmqEventPublisher` (CPU-tier placeholder
//! `BlockStored` events, bytes hashes); `kvpeer serve --follow` indexes them and pulls the
//! blocks over NIXL as a stock consumer of that engine; the producer exits; a second stock
//! vLLM peer fetches the same prefix from the pool node, every byte checked.
//!
//! Needs NIXL's wheel and the interop set-up of `interop_vllm.rs` (as `interop_nixl.rs`).

#![cfg(feature = "nixl")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::free_port;
use common::vllm::{kvpeer_serve_on, metric, nixl_lib_dir, ucx_env, vllm_fetch, vllm_serve};

/// Waits (bounded) until metric `name` of `p` reaches `want`; its last value.
fn wait_metric(p: &common::Proc, name: &str, want: f64, within: Duration) -> f64 {
    let deadline = Instant::now() + within;
    loop {
        let v = metric(p, name);
        if v >= want || Instant::now() >= deadline {
            return v;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

const BLOCKS: u64 = 32;
const BLOCK_LEN: &str = "65536";

#[test]
fn a_pool_node_pulls_what_a_vllm_engine_announces_and_serves_it_after_the_engine_is_gone() {
    ucx_env();
    let (events, replay) = (free_port(), free_port());
    // vLLM binds its PUB only for a `*` host (else it connects).
    let (events_bind, events) = (
        format!("tcp://*:{events}"),
        format!("tcp://127.0.0.1:{events}"),
    );
    let replay = format!("tcp://127.0.0.1:{replay}");
    let fill = BLOCKS.to_string();
    let (mut producer, engine) = vllm_serve(&[
        "--transport",
        "nixl",
        "--fill",
        &fill,
        "--blocks",
        &fill,
        "--block-len",
        BLOCK_LEN,
        "--kv-events",
        &events_bind,
        "--kv-events-replay",
        &replay,
    ]);

    let dir = nixl_lib_dir();
    let follow = format!("{events},{replay}={engine}");
    let (mut pool, pool_id) = kvpeer_serve_on(
        &["--plane", "nixl", "--nixl-lib-dir", &dir],
        &[
            "--blocks",
            "64",
            "--block-len",
            BLOCK_LEN,
            "--follow",
            &follow,
        ],
    );
    let want = BLOCKS as f64;
    let pulled = wait_metric(
        &pool,
        "kvpeer_follow_pulled_blocks_total",
        want,
        Duration::from_secs(60),
    );
    assert_eq!(
        pulled,
        want,
        "pool log:\n{}\nproducer log:\n{}",
        pool.log(),
        producer.log()
    );
    assert_eq!(metric(&pool, "kvpeer_follow_pull_failures_total"), 0.0);
    assert_eq!(metric(&pool, "kvpeer_follow_event_batches_total"), 1.0);
    assert_eq!(metric(&pool, "kvpeer_follow_malformed_total"), 0.0);
    assert_eq!(
        metric(&pool, "kvpeer_follow_pulled_bytes_total"),
        want * 65536.0
    );

    // The engine goes away: the pool node alone holds its blocks now.
    assert_eq!(
        producer.terminate(Duration::from_secs(20)),
        0,
        "{}",
        producer.log()
    );

    let (status, s) = vllm_fetch(&[
        "--transport",
        "nixl",
        "--peer",
        &pool_id,
        "--block-len",
        BLOCK_LEN,
        "--blocks",
        "64",
        "--requests",
        "4",
        "--keys",
        "8",
        "--miss-share",
        "0",
    ]);
    assert_eq!(status, 0, "{s}\n{}", pool.log());
    assert_eq!(s["hits"], 32, "{s}");
    assert_eq!(s["corrupt_blocks"], 0, "{s}");
    assert_eq!(s["failed_loads"], 0, "{s}");
    assert_eq!(pool.terminate(Duration::from_secs(20)), 0, "{}", pool.log());
}
