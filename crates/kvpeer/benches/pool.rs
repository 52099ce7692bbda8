//! Issue 15's benchmark: what a shared pool node saves a multi-engine workload, and what
//! following engines costs it.
//!
//! Run: `scripts/bench-pool.sh` (= `cargo bench -p kvpeer --bench pool -- --svg
//! docs/pool-hit-rate.svg`). Options: `--requests N` (10,000), `--rate R` requests per second
//! (1,000), `--seed S` (15), `--svg PATH` (no plot without it), `--events N` (2,000,000
//! events for the ingest micro-benchmark).
//!
//! **The workload** (in one process, on 127.0.0.1, tcp plane). Four "engines" are kvpeer
//! nodes whose store is their CPU tier (`ENGINE_BLOCKS` blocks each); each publishes its
//! store's changes as vLLM KV events (the pool module's publish side, vLLM's form, every 50 ms).
//! A request is a prefix of `CHUNKS` chunks drawn from a Zipf distribution (`ZIPF_S`) over
//! `PREFIXES` prefixes, sent to an engine drawn uniformly (a router that knows no cache). The
//! engine serves the prefix's leading chunks it holds itself (local hits; they become its
//! most recently used), then, with a pool, looks the rest up at the pool node and fetches the
//! leading hits (pool hits; one fetched block in 16 is byte-checked), then "recomputes" the
//! rest: writes synthetic blocks into its tier, which announces them; the pool node follows all
//! four streams and pulls what they announce. The same request sequence (same seed, same
//! pace) runs without a pool node, then with one.
//!
//! **Ingest**: the sans-IO `Follower` + `Holdings` fed pre-encoded batches of 16 `BlockStored`
//! (vLLM's CPU-tier form: 4 block hashes of 32 bytes, a parent hash, 64 token ids), timed in
//! the thread's CPU time (`getrusage(RUSAGE_THREAD)`); then the same batches through kvpeer's
//! native PUB → SUB on loopback, the subscribing thread's CPU time.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

/// The allocator of the `kvpeer` binary (src/bin/kvpeer/main.rs), so the figures are the node's.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer::pool_node::{FollowSpec, PoolConfig, PoolNode};
use kvpeer::{synthetic, Node, NodeConfig, OffloadKey, PlaneKind, Sources};
use kvpeer_net::events::{
    EventPublisher, EventSubscriber, PublisherConfig, SubEndpoint, SubEvent, SubscriberConfig,
};
use kvpeer_pool::{Admission, EngineSlot, Follower, FollowerLimits, Holdings};
use kvpeer_proto::events::{encode_batch, BlockHash, BlockStored, KvEvent};

use common::{Plot, Rng, Zipf};

/// Bytes of one chunk (one CPU-tier block).
const LEN: u64 = 16 * 1024;
const ENGINES: usize = 4;
/// Each engine's CPU tier, in chunks.
const ENGINE_BLOCKS: u64 = 512;
/// The pool node's store, in chunks.
const POOL_BLOCKS: u64 = 8192;
const PREFIXES: u64 = 500;
/// Chunks per prefix.
const CHUNKS: u64 = 8;
const ZIPF_S: f64 = 1.1;
/// Requests per point of the hit-rate curve.
const WINDOW: usize = 500;

struct Opts {
    requests: usize,
    rate: f64,
    seed: u64,
    svg: Option<String>,
    events: u64,
    ingest_only: bool,
}

fn opts() -> Opts {
    let mut o = Opts {
        requests: 10_000,
        rate: 1000.0,
        seed: 15,
        svg: None,
        events: 2_000_000,
        ingest_only: false,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().expect("a value after the option");
        match a.as_str() {
            "--requests" => o.requests = val().parse().expect("--requests N"),
            "--rate" => o.rate = val().parse().expect("--rate R"),
            "--seed" => o.seed = val().parse().expect("--seed S"),
            "--svg" => o.svg = Some(val()),
            "--events" => o.events = val().parse().expect("--events N"),
            "--ingest-only" => o.ingest_only = true,
            _ => {} // `--bench` and the like, from cargo
        }
    }
    o
}

/// The request sequence: (prefix, engine) each.
fn workload(o: &Opts) -> Vec<(u64, usize)> {
    let zipf = Zipf::new(PREFIXES, ZIPF_S);
    let mut rng = Rng(o.seed);
    (0..o.requests)
        .map(|_| {
            let p = zipf.sample(&mut rng);
            let e = (rng.next() % ENGINES as u64) as usize;
            (p, e)
        })
        .collect()
}

fn prefix_keys(p: u64) -> Vec<OffloadKey> {
    (0..CHUNKS)
        .map(|c| synthetic::key(p * CHUNKS + c))
        .collect()
}

fn node(tag: &str, blocks: u64) -> Arc<Node> {
    let config = NodeConfig::builder(tag)
        .plane(PlaneKind::Tcp)
        .num_blocks(blocks)
        .block_len(LEN)
        .build()
        .unwrap();
    Arc::new(Node::start(config).unwrap())
}

fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

#[derive(Debug, Default, Clone)]
struct RunResult {
    local: u64,
    pool: u64,
    miss: u64,
    checked: u64,
    secs: f64,
    pulled_bytes: u64,
    pulled_blocks: u64,
    pull_requests: u64,
    /// Per window: (local, pool) hit chunks over the window's chunks.
    curve: Vec<(f64, f64)>,
}

fn run(o: &Opts, reqs: &[(u64, usize)], with_pool: bool) -> RunResult {
    let tag = if with_pool { "with" } else { "without" };
    let mut engines = Vec::new();
    let mut publishers = Vec::new();
    let mut follow = Vec::new();
    for i in 0..ENGINES {
        let e = node(&format!("bench-{tag}-e{i}"), ENGINE_BLOCKS);
        let (events, replay) = (free_addr(), free_addr());
        let config = PoolConfig {
            publish: Some(events),
            publish_replay: Some(replay),
            ..PoolConfig::default()
        };
        publishers.push(PoolNode::start(e.clone(), &config).unwrap());
        follow.push(FollowSpec {
            events: SubEndpoint::Connect(events),
            replay: Some(replay),
            peer: e.id().clone(),
        });
        engines.push(e);
    }
    let pool = with_pool.then(|| {
        let n = node(&format!("bench-{tag}-pool"), POOL_BLOCKS);
        let config = PoolConfig {
            follow,
            max_lookups: 1000,
            ..PoolConfig::default()
        };
        let p = PoolNode::start(n.clone(), &config).unwrap();
        // Every stream connected, every engine's session open, before the clock starts.
        let deadline = Instant::now() + Duration::from_secs(20);
        while p.stats().connected < ENGINES as u64 {
            assert!(Instant::now() < deadline, "streams: {:?}", p.stats());
            std::thread::sleep(Duration::from_millis(20));
        }
        for e in &engines {
            e.connect(n.id(), Duration::from_secs(10)).unwrap();
        }
        (n, p)
    });
    let sources = Sources::new(pool.iter().map(|(n, _)| n.id().clone()));
    let mut r = RunResult::default();
    let (mut wl, mut wp) = (0u64, 0u64);
    let start = Instant::now();
    for (i, &(p, e)) in reqs.iter().enumerate() {
        // The router's pace: request i at i / rate seconds (later if the engines lag).
        let due = start + Duration::from_secs_f64(i as f64 / o.rate);
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let served = common::serve(
            &engines[e],
            &sources,
            &prefix_keys(p),
            &format!("bench-{tag}-{i}"),
            LEN as usize,
            i % 16 == 0,
        );
        let (local, from_pool) = (served.local, served.pool);
        r.checked += u64::from(served.checked);
        r.local += local as u64;
        r.pool += from_pool as u64;
        r.miss += served.miss as u64;
        wl += local as u64;
        wp += from_pool as u64;
        if (i + 1) % WINDOW == 0 {
            let chunks = (WINDOW as u64 * CHUNKS) as f64;
            r.curve.push((wl as f64 / chunks, wp as f64 / chunks));
            (wl, wp) = (0, 0);
        }
    }
    r.secs = start.elapsed().as_secs_f64();
    if let Some((n, p)) = pool {
        let s = p.stats();
        (r.pulled_bytes, r.pulled_blocks, r.pull_requests) =
            (s.pulled_bytes, s.pulled_blocks, s.pull_requests);
        eprintln!("[{tag}] pool: {s:?}");
        p.shutdown();
        n.shutdown(Duration::from_secs(1));
    }
    for p in publishers {
        p.shutdown();
    }
    for e in &engines {
        e.shutdown(Duration::from_secs(1));
    }
    r
}

/// The CPU time (user + system) of the calling thread.
fn thread_cpu() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_THREAD).unwrap();
    let tv = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    tv(u.user_time()) + tv(u.system_time())
}

/// Pre-encoded batches of 16 `BlockStored` in vLLM's CPU-tier form, `n` events in all.
fn batches(n: u64) -> Vec<Vec<u8>> {
    let hash = |i: u64, j: u64| {
        use sha2::{Digest, Sha256};
        BlockHash::Bytes(Sha256::digest(format!("{i}/{j}")).to_vec())
    };
    (0..n.div_ceil(16))
        .map(|b| {
            let events: Vec<KvEvent> = (0..16)
                .map(|j| {
                    let i = b * 16 + j;
                    KvEvent::Stored(BlockStored {
                        block_hashes: (0..4).map(|h| hash(i, h)).collect(),
                        parent_block_hash: Some(hash(i, 99)),
                        token_ids: (0..64).collect(),
                        block_size: 16,
                        medium: Some("CPU".into()),
                        group_idx: Some(0),
                        ..BlockStored::default()
                    })
                })
                .collect();
            encode_batch(b as f64, &events, Some(0)).unwrap()
        })
        .collect()
}

struct Ingest {
    events: u64,
    cpu: Duration,
    candidates: u64,
}

/// The sans-IO follower and index, fed in this thread.
fn ingest_sans_io(batches: &[Vec<u8>]) -> Ingest {
    let mut holdings = Holdings::new(1 << 20, Admission::default());
    let mut follower = Follower::new(
        EngineSlot::new(0).unwrap(),
        FollowerLimits::default(),
        false,
    );
    let now = Instant::now();
    let mut candidates = 0u64;
    let cpu0 = thread_cpu();
    for (seq, b) in batches.iter().enumerate() {
        candidates += follower
            .live(now, seq as u64, b.clone(), &mut holdings)
            .len() as u64;
    }
    let cpu = thread_cpu() - cpu0;
    Ingest {
        events: follower.stats().events,
        cpu,
        candidates,
    }
}

/// The same through kvpeer's native PUB → SUB on loopback: the subscribing thread's CPU.
fn ingest_sockets(batches: Arc<Vec<Vec<u8>>>) -> Ingest {
    let mut config = PublisherConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)));
    config.replay_bind = None;
    let mut publisher = EventPublisher::bind(config).unwrap();
    let addr = publisher.local_addr().unwrap();
    let mut sub = EventSubscriber::new(SubscriberConfig::new(SubEndpoint::Connect(addr))).unwrap();
    let total = batches.len() as u64;
    let subscriber = std::thread::spawn(move || {
        let mut holdings = Holdings::new(1 << 20, Admission::default());
        let mut follower = Follower::new(
            EngineSlot::new(0).unwrap(),
            FollowerLimits::default(),
            false,
        );
        let mut candidates = 0u64;
        let mut cpu0 = None;
        let mut last = 0u64;
        // Until the last batch, or 2 s without one (what was lost is then counted out).
        let mut heard = Instant::now() + Duration::from_secs(10);
        while last + 1 < total && heard.elapsed() < Duration::from_secs(2) {
            sub.wait(Duration::from_millis(50)).unwrap();
            while let Some(e) = sub.poll_event() {
                if let SubEvent::Live { seq, payload } = e {
                    cpu0.get_or_insert_with(thread_cpu);
                    heard = Instant::now();
                    last = seq;
                    let now = Instant::now();
                    candidates += follower.live(now, seq, payload, &mut holdings).len() as u64;
                }
            }
        }
        let cpu = thread_cpu() - cpu0.unwrap_or_default();
        Ingest {
            events: follower.stats().events,
            cpu,
            candidates,
        }
    });
    // Wait for the subscription, then publish at the pace the subscriber takes them (a PUB
    // drops what a slow subscriber cannot take: a dropped batch is published again).
    while publisher.subscribed() == 0 {
        publisher
            .serve(Duration::from_millis(5), |_| Vec::<Vec<Vec<u8>>>::new())
            .unwrap();
    }
    let mut dropped = 0;
    for (seq, b) in batches.iter().enumerate() {
        loop {
            publisher.publish(&[b"", &(seq as u64).to_be_bytes(), b]);
            let d = publisher.stats().dropped;
            if d == dropped {
                break;
            }
            dropped = d;
            publisher
                .serve(Duration::from_micros(200), |_| Vec::<Vec<Vec<u8>>>::new())
                .unwrap();
        }
    }
    // What is still queued is written only while the publisher is driven.
    while !subscriber.is_finished() {
        publisher
            .serve(Duration::from_millis(5), |_| Vec::<Vec<Vec<u8>>>::new())
            .unwrap();
    }
    let r = subscriber.join().unwrap();
    eprintln!("[ingest] publisher: {:?}", publisher.stats());
    drop(publisher);
    r
}

fn per_core(i: &Ingest) -> f64 {
    i.events as f64 / i.cpu.as_secs_f64()
}

fn svg(without: &RunResult, with: &RunResult) -> String {
    let plot = Plot::new(without.curve.len());
    let total = |r: &RunResult| r.curve.iter().map(|(l, p)| l + p).collect::<Vec<_>>();
    let local = |r: &RunResult| r.curve.iter().map(|(l, _)| *l).collect::<Vec<_>>();
    let mut s = plot.frame(
        &format!(
            "Chunk hit rate per {WINDOW} requests: 4 engines, Zipf s={ZIPF_S} over {PREFIXES} prefixes × {CHUNKS} chunks"
        ),
        WINDOW,
    );
    let dashed = "stroke-dasharray=\"5,4\"";
    s += &plot.line(&total(with), "#1f77b4", "");
    s += &plot.line(&local(with), "#1f77b4", dashed);
    s += &plot.line(&total(without), "#d62728", "");
    let legend = [
        ("#1f77b4", "", "with the pool node: local + pool hits"),
        ("#1f77b4", dashed, "with the pool node: local hits only"),
        ("#d62728", "", "without: local hits"),
    ];
    for (k, (c, dash, label)) in legend.iter().enumerate() {
        s += &plot.legend(k, 3, c, dash, label);
    }
    s += "</svg>\n";
    s
}

fn main() {
    let o = opts();
    if !o.ingest_only {
        workload_runs(&o);
    }
    ingest(&o);
}

fn workload_runs(o: &Opts) {
    let reqs = workload(o);
    let chunks = (reqs.len() as u64 * CHUNKS) as f64;
    println!(
        "workload: {} requests at {}/s, Zipf s={ZIPF_S} over {PREFIXES} prefixes × {CHUNKS} chunks of {} KiB ({} chunks), seed {}; {ENGINES} engines × {ENGINE_BLOCKS} chunks, pool {POOL_BLOCKS} chunks",
        reqs.len(),
        o.rate,
        LEN / 1024,
        PREFIXES * CHUNKS,
        o.seed
    );
    let without = run(o, &reqs, false);
    let with = run(o, &reqs, true);
    let pct = |v: u64| 100.0 * v as f64 / chunks;
    println!();
    println!("| run | local hits | pool hits | misses (recomputed) | wall time | pulled by the pool | pull bandwidth |");
    println!("|---|---|---|---|---|---|---|");
    for (name, r) in [
        ("without a pool node", &without),
        ("with a pool node", &with),
    ] {
        println!(
            "| {name} | {:.1}% | {:.1}% | {:.1}% | {:.1} s | {} blocks, {:.1} MiB in {} pulls | {:.2} MiB/s |",
            pct(r.local),
            pct(r.pool),
            pct(r.miss),
            r.secs,
            r.pulled_blocks,
            r.pulled_bytes as f64 / (1 << 20) as f64,
            r.pull_requests,
            r.pulled_bytes as f64 / (1 << 20) as f64 / r.secs
        );
    }
    println!();
    println!(
        "recompute saved: {:.1}% of all chunks (misses {:.1}% → {:.1}%; {:.2}× fewer chunks recomputed); pool hits byte-checked: {}",
        pct(without.miss.saturating_sub(with.miss)),
        pct(without.miss),
        pct(with.miss),
        without.miss as f64 / with.miss.max(1) as f64,
        with.checked
    );
    let last = |r: &RunResult| r.curve.last().map_or(0.0, |(l, p)| 100.0 * (l + p));
    println!(
        "hit rate over the last {WINDOW} requests: without {:.1}%, with {:.1}%",
        last(&without),
        last(&with)
    );
    if let Some(path) = &o.svg {
        match std::fs::write(path, svg(&without, &with)) {
            Ok(()) => println!("plot: {path}"),
            Err(e) => {
                eprintln!("cannot write the plot to {path}: {e}");
                std::process::exit(1);
            }
        }
    }
}

fn ingest(o: &Opts) {
    let b = batches(o.events);
    let sans = ingest_sans_io(&b);
    println!();
    println!(
        "ingest, sans-IO Follower + Holdings: {} events ({} batches of 16) in {:.3} s CPU = {:.2} M events/s/core ({} pull candidates)",
        sans.events,
        b.len(),
        sans.cpu.as_secs_f64(),
        per_core(&sans) / 1e6,
        sans.candidates
    );
    let n = b.len();
    let sock = ingest_sockets(Arc::new(b));
    println!(
        "ingest, native PUB → SUB + Follower + Holdings (subscriber thread): {} events ({} of {n} batches received) in {:.3} s CPU = {:.2} M events/s/core ({} pull candidates)",
        sock.events,
        sock.events / 16,
        sock.cpu.as_secs_f64(),
        per_core(&sock) / 1e6,
        sock.candidates
    );
}
