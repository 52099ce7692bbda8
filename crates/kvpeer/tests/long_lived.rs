//! One producer node under a long run (issue 11): 100,000 served rounds (lookup, fetch, write,
//! `transfer_done`), then 100,000 lookups that are never fetched. Its open state must return to
//! nothing: per-request server state of an unfetched lookup is dropped at the store timeout
//! (shortened to 2 s here), every pin is released, and nothing piles up in its queues. The
//! process's resident memory is printed before and after.
//!
//! In-process (the public `Node` as the producer, a `NodeIo` driven by this thread as the
//! consumer, both on the shm plane over a real ZeroMQ control channel), so that 200,000
//! requests fit in about a minute of a debug build: the consumer batches its requests as an
//! engine with many requests in flight would. `KVPEER_LONG_ROUNDS` changes the count.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

mod common;
use common::init_logs;
use common::node_io::{step_for, step_until};

use kvpeer::node::build::{build, NodeSpec};
use kvpeer::node::io::NodeIo;
use kvpeer::{synthetic, Node, NodeConfig, PlaneKind};
use kvpeer_core::{CoreConfig, JobId, LookupResult, Request, RequestRoles};
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

const LEN: u64 = 4096;
const HELD: u64 = 64;
const BATCH: u64 = 500;
const STORE_TIMEOUT: Duration = Duration::from_secs(2);

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// Opens `n` requests (ids `tag-first..`), each looking up one held key; returns them once
/// every lookup is answered (all must hit).
fn lookups(
    c: &mut NodeIo,
    producer: &PeerId,
    tag: &str,
    first: u64,
    n: u64,
) -> Vec<(Request, OffloadKey)> {
    let now = Instant::now();
    let reqs: Vec<(Request, OffloadKey)> = (first..first + n)
        .map(|i| {
            let req = c.core_mut().on_new_request(
                now,
                KvRequestId::from(format!("{tag}-{i}").as_str()),
                RequestRoles::kv_source(producer.clone()),
            );
            let key = synthetic::key(i % HELD);
            c.core_mut().lookup(now, &req, &key);
            (req, key)
        })
        .collect();
    c.core_mut().flush_lookups(now);
    c.flush(now);
    step_until(c, Duration::from_secs(30), |c| {
        let now = Instant::now();
        let done = reqs
            .iter()
            .all(|(r, k)| c.core_mut().lookup(now, r, k) != LookupResult::Retry);
        // Keys asked again (as an engine polls) go out with the next flush.
        c.core_mut().flush_lookups(now);
        c.flush(now);
        done
    });
    let now = Instant::now();
    for (r, k) in &reqs {
        assert_eq!(
            c.core_mut().lookup(now, r, k),
            LookupResult::Hit,
            "{:?}",
            r.id()
        );
    }
    reqs
}

/// Keeps the consumer's channel serviced until the producer holds nothing open or `timeout`
/// passes (the caller asserts which).
fn settle(c: &mut NodeIo, producer: &Node, timeout: Duration, pause: Duration) {
    step_for(c, timeout, pause, |_| {
        producer_open(producer) == (0, 0, 0, 0)
    });
}

/// Waits (bounded by `timeout`) until the consumer holds no request, then until the producer
/// holds nothing open (bounded: 10 s; the caller asserts it).
fn drain(c: &mut NodeIo, producer: &Node, timeout: Duration) {
    step_until(c, timeout, |c| c.core().stats().client_requests == 0);
    settle(
        c,
        producer,
        Duration::from_secs(10),
        Duration::from_millis(10),
    );
}

fn producer_open(p: &Node) -> (usize, usize, usize, u64) {
    let s = p.stats().unwrap();
    (
        s.core.server_requests,
        s.core.store_jobs,
        s.core.inflight,
        s.store.pinned,
    )
}

#[test]
fn one_node_serves_100k_rounds_and_forgets_100k_unfetched_lookups() {
    let rounds: u64 = std::env::var("KVPEER_LONG_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100_000);
    init_logs();
    let base = NodeConfig::local("long-producer");
    let producer = Node::start(NodeConfig {
        spec: NodeSpec {
            plane: PlaneKind::Shm,
            num_blocks: 256,
            block_len: LEN,
            core: CoreConfig {
                store_timeout: STORE_TIMEOUT,
                ..CoreConfig::default()
            },
            ..base.spec
        },
        pool: base.pool,
    })
    .unwrap();
    let held: Vec<(OffloadKey, Vec<u8>)> = (0..HELD)
        .map(|i| {
            let k = synthetic::key(i);
            let v = synthetic::content(&k, LEN as usize);
            (k, v)
        })
        .collect();
    producer.store(held).unwrap();
    let pid = producer.id().clone();

    let mut c: NodeIo = build(&NodeSpec {
        plane: PlaneKind::Shm,
        num_blocks: 4 * BATCH,
        block_len: LEN,
        ..NodeConfig::local("long-consumer").spec
    })
    .unwrap();

    // The session first, as an engine's first request would open it.
    let warm = c.core_mut().on_new_request(
        Instant::now(),
        KvRequestId::from("warm-up"),
        RequestRoles::kv_source(pid.clone()),
    );
    c.core_mut()
        .lookup(Instant::now(), &warm, &synthetic::key(0));
    c.flush(Instant::now());
    step_until(&mut c, Duration::from_secs(10), |c| {
        c.core().session_state(&pid).is_some_and(|s| s.ready)
    });
    c.core_mut().finish(Instant::now(), &warm);
    c.flush(Instant::now());

    let rss0 = rss_kib();
    let started = Instant::now();
    println!(
        "start: RSS {rss0} KiB, producer open {:?}",
        producer_open(&producer)
    );

    // 1. Served rounds, BATCH requests in flight at a time.
    let mut job = 0u64;
    let mut first = 0;
    let mut peak = (0usize, 0usize);
    while first < rounds {
        let n = BATCH.min(rounds - first);
        let reqs = lookups(&mut c, &pid, "served", first, n);
        let now = Instant::now();
        let mut jobs = Vec::with_capacity(reqs.len());
        for (r, k) in &reqs {
            job += 1;
            let blocks = c
                .core_mut()
                .parent_mut()
                .reserve(std::slice::from_ref(k))
                .unwrap();
            c.core_mut()
                .submit_load(now, JobId::new(job), r, vec![k.clone()], blocks.clone());
            jobs.push((job, blocks, k.clone()));
        }
        c.flush(now);
        let mut results = std::collections::HashMap::new();
        step_until(&mut c, Duration::from_secs(30), |c| {
            for (j, _, _) in &jobs {
                if !results.contains_key(j) {
                    if let Some(ok) = c.take_load_result(JobId::new(*j)) {
                        results.insert(*j, ok);
                    }
                }
            }
            results.len() == jobs.len()
        });
        for (j, blocks, k) in &jobs {
            assert!(results[j], "load {j} failed");
            c.core_mut().parent_mut().finish_write(blocks, true);
            if *j % 997 == 0 {
                assert_eq!(
                    c.core().parent().read(blocks[0]).unwrap(),
                    &synthetic::content(k, LEN as usize)[..]
                );
            }
        }
        let now = Instant::now();
        for (r, _) in &reqs {
            c.core_mut().finish(now, r);
        }
        c.flush(now);
        first += n;
        if first % 20_000 == 0 {
            let open = producer_open(&producer);
            peak = (peak.0.max(open.0), peak.1.max(open.1));
            println!(
                "{first} rounds in {:?}: RSS {} KiB, producer open {open:?}, consumer {:?}",
                started.elapsed(),
                rss_kib(),
                c.core().stats()
            );
        }
    }
    drain(&mut c, &producer, Duration::from_secs(10));
    let rss1 = rss_kib();
    let served = producer.stats().unwrap();
    println!(
        "{rounds} rounds served in {:?}: RSS {rss1} KiB, producer open {:?}, counters {:?}",
        started.elapsed(),
        producer_open(&producer),
        served.counters
    );
    assert_eq!(
        producer_open(&producer),
        (0, 0, 0, 0),
        "after the served rounds"
    );
    assert!(
        c.waiting_load_results() == 0,
        "consumer load results left: {}",
        c.waiting_load_results()
    );

    // 2. Lookups never fetched and never finished: the producer must drop each at its store
    //    timeout.
    let phase2 = Instant::now();
    let mut open_reqs = Vec::new();
    let mut first = 0;
    let mut peak2 = 0usize;
    while first < rounds {
        let n = BATCH.min(rounds - first);
        open_reqs.extend(lookups(&mut c, &pid, "unfetched", first, n));
        first += n;
        if first % 20_000 == 0 {
            let open = producer_open(&producer);
            peak2 = peak2.max(open.0);
            println!(
                "{first} unfetched lookups in {:?}: RSS {} KiB, producer open {open:?}",
                phase2.elapsed(),
                rss_kib()
            );
        }
    }
    let issued = phase2.elapsed();
    // Keep the consumer's channel serviced while waiting for the producer's timeouts.
    settle(
        &mut c,
        &producer,
        STORE_TIMEOUT * 3 + Duration::from_secs(5),
        Duration::from_millis(20),
    );
    let after_timeout = producer_open(&producer);
    let rss2 = rss_kib();
    println!(
        "{rounds} unfetched lookups issued in {issued:?} (peak producer server requests {peak2}); \
         {:?} later the producer holds {after_timeout:?}; RSS {rss2} KiB",
        phase2.elapsed() - issued
    );
    // Now the consumer lets its requests go (terminal fetches for state the producer dropped).
    // In chunks, as an engine finishes requests: one burst of 100,000 terminal fetches would
    // overflow the control channel's send queue (SNDHWM 1000) and cost the session.
    for chunk in open_reqs.chunks(BATCH as usize) {
        let now = Instant::now();
        for (r, _) in chunk {
            c.core_mut().finish(now, r);
        }
        c.flush(now);
        for _ in 0..3 {
            let now = Instant::now();
            c.step(now);
            c.wait(now, Duration::from_millis(5));
        }
    }
    drain(&mut c, &producer, Duration::from_secs(30));
    let rss3 = rss_kib();
    println!(
        "end after {:?}: RSS {rss0} -> {rss1} -> {rss2} -> {rss3} KiB (start, after rounds, after \
         unfetched lookups, end); producer {:?}; peaks during rounds {peak:?}",
        started.elapsed(),
        producer.stats().unwrap().core
    );
    assert_eq!(
        after_timeout,
        (0, 0, 0, 0),
        "unfetched lookups' server state and pins outlived the store timeout \
         (server_requests, store_jobs, inflight, pinned)"
    );
    assert_eq!(producer_open(&producer), (0, 0, 0, 0), "at the end");
    let sessions = producer.stats().unwrap().core.sessions;
    assert_eq!(sessions, 1, "the consumer's session survived the run");
    producer.shutdown(Duration::from_secs(3));
}
