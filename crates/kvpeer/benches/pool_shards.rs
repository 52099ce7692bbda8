//! Issue 21's benchmark: one pool node against 2 and 4 pool nodes that split the prefixes by
//! rendezvous hashing of each prefix's root chunk (`--shard`), for 8 engines behind a
//! round-robin router, then behind a KV-aware one.
//!
//! Run: `scripts/bench-pool.sh` (which runs this after issue 15's `pool` bench: `cargo bench
//! -p kvpeer --bench pool_shards -- --svg docs/pool-shards.svg`). Options: `--requests N`
//! (10,000), `--rate R` requests per second (1,000), `--seed S` (21), `--svg PATH`.
//!
//! **The workload** (one process, 127.0.0.1, tcp plane). Eight engines are kvpeer nodes whose
//! store is their CPU tier (`ENGINE_BLOCKS` chunks each). Each publishes its store's changes
//! as vLLM KV events in the self-describing form (each chunk's hash, its parent, its tokens:
//! what an engine with vLLM's `self_describing_kv_events` says, so a pool knows each chunk's
//! root). A request is a prefix of `CHUNKS` chunks drawn from a Zipf distribution over
//! `PREFIXES` prefixes and goes to an engine: in turn (round-robin, a router that knows no
//! cache), or to the engine that holds the longest leading run of it (KV-aware: what a router
//! indexing the engines' events knows, without its lag), in turn on a tie. The engine serves
//! the leading chunks it holds, then pulls the rest through its tier's `sources`
//! ([`Node::pull`]: the pool node that owns the prefix's root chunk, one lookup, one round
//! trip) and fetches the leading hits (one in 16 byte-checked), then "recomputes" the rest,
//! which its stream announces. Every pool node
//! follows all 8 engines and pulls only its share. The same request sequence runs with no
//! pool, one pool of `POOL_BLOCKS` chunks, and 2 and 4 sharded pools of `POOL_BLOCKS / n`
//! chunks each (the same memory in all).
//!
//! Reported per run: local and pool hit rates, recompute saved, the lookup's round trip (p50,
//! p99: what asking a pool adds to a request), pulled bytes and bandwidth, each pool's memory;
//! then the sharded runs' hit rate as a share of the single pool's (the goal: ≥ 90% with 4
//! pools) and the plot of the hit rate per window.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvpeer::pool_node::{FollowSpec, PoolConfig, PoolNode};
use kvpeer::{synthetic, Node, NodeConfig, OffloadKey, PeerId, PlaneKind, Sources};
use kvpeer_net::events::{EventPublisher, PublisherConfig, SubEndpoint};
use kvpeer_pool::{Catalog, CatalogLimits, Publisher};
use kvpeer_proto::events::{BlockHash, BlockStored};

use common::{Plot, Rng, Zipf};

/// Bytes of one chunk (one CPU-tier block).
const LEN: u64 = 16 * 1024;
const ENGINES: usize = 8;
/// Each engine's CPU tier, in chunks.
const ENGINE_BLOCKS: u64 = 256;
/// The single pool's store, in chunks; n sharded pools get a 1/n share each.
const POOL_BLOCKS: u64 = 4096;
const PREFIXES: u64 = 1000;
/// Chunks per prefix.
const CHUNKS: u64 = 8;
const ZIPF_S: f64 = 1.1;
/// Tokens per chunk in the published descriptions (one block of 16).
const BLOCK_TOKENS: u32 = 16;
/// Requests per point of the hit-rate curve.
const WINDOW: usize = 500;

/// How requests reach the engines.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Router {
    /// In turn: a router that knows no cache.
    RoundRobin,
    /// To the engine holding the longest leading run of the prefix (what a router indexing
    /// the engines' KV events knows, here without its event lag), in turn on a tie.
    KvAware,
}

impl Router {
    fn name(self) -> &'static str {
        match self {
            Router::RoundRobin => "round-robin",
            Router::KvAware => "KV-aware",
        }
    }

    fn pick(self, engines: &[Arc<Node>], keys: &[OffloadKey], i: usize) -> usize {
        if self == Router::RoundRobin {
            return i % engines.len();
        }
        let mut best = (0, i % engines.len());
        for k in 0..engines.len() {
            let e = (i + k) % engines.len();
            let held = engines[e]
                .contains(keys)
                .unwrap()
                .into_iter()
                .take_while(|h| *h)
                .count();
            if held > best.0 {
                best = (held, e);
            }
        }
        best.1
    }
}

struct Opts {
    requests: usize,
    rate: f64,
    seed: u64,
    svg: Option<String>,
    /// `--disk-tier DIR`: issue 41's runs instead (one pool: all memory, an eighth of the
    /// memory, an eighth plus a disk tier in DIR holding the rest).
    disk_tier: Option<std::path::PathBuf>,
}

/// One pool's memory, and its disk tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tier {
    /// `POOL_BLOCKS / pools` chunks of memory each.
    Memory,
    /// An eighth of the single pool's memory.
    EighthMemory,
    /// An eighth of the memory over a disk tier of `POOL_BLOCKS` chunks.
    EighthPlusDisk,
}

impl Tier {
    fn name(self) -> &'static str {
        match self {
            Tier::Memory => "memory",
            Tier::EighthMemory => "1/8 memory",
            Tier::EighthPlusDisk => "1/8 memory + disk",
        }
    }
}

fn opts() -> Opts {
    let mut o = Opts {
        requests: 10_000,
        rate: 1000.0,
        seed: 21,
        svg: None,
        disk_tier: None,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().expect("a value after the option");
        match a.as_str() {
            "--requests" => o.requests = val().parse().expect("--requests N"),
            "--rate" => o.rate = val().parse().expect("--rate R"),
            "--seed" => o.seed = val().parse().expect("--seed S"),
            "--svg" => o.svg = Some(val()),
            "--disk-tier" => o.disk_tier = Some(val().into()),
            _ => {} // `--bench` and the like, from cargo
        }
    }
    o
}

/// The prefixes of the requests, Zipf over `0..PREFIXES`.
fn workload(o: &Opts) -> Vec<u64> {
    let zipf = Zipf::new(PREFIXES, ZIPF_S);
    let mut rng = Rng(o.seed);
    (0..o.requests).map(|_| zipf.sample(&mut rng)).collect()
}

fn prefix_keys(p: u64) -> Vec<OffloadKey> {
    (0..CHUNKS)
        .map(|c| synthetic::key(p * CHUNKS + c))
        .collect()
}

fn hash_of(key: &OffloadKey) -> Vec<u8> {
    key.as_bytes()[..32].to_vec()
}

/// What an engine knows of every prefix's chunks (their descriptions), as a catalog.
fn engine_catalog() -> Catalog {
    let mut catalog = Catalog::new(CatalogLimits::default());
    for p in 0..PREFIXES {
        let keys = prefix_keys(p);
        for (c, key) in keys.iter().enumerate() {
            let first = (p * CHUNKS + c as u64) as u32 * BLOCK_TOKENS;
            catalog.learn(&BlockStored {
                block_hashes: vec![BlockHash::Bytes(hash_of(key))],
                parent_block_hash: c
                    .checked_sub(1)
                    .map(|b| BlockHash::Bytes(hash_of(&keys[b]))),
                token_ids: (first..first + BLOCK_TOKENS).collect(),
                block_size: u64::from(BLOCK_TOKENS),
                medium: Some("CPU".into()),
                group_idx: Some(0),
                ..BlockStored::default()
            });
        }
    }
    catalog
}

/// An engine's event stream: its store's changes every 50 ms, described, with replays.
struct EngineStream {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EngineStream {
    fn start(node: Arc<Node>, events: SocketAddr, replay: SocketAddr) -> EngineStream {
        let stop = Arc::new(AtomicBool::new(false));
        let mut config = PublisherConfig::new(events);
        config.replay_bind = Some(replay);
        let mut socket = EventPublisher::bind(config).unwrap();
        let mut catalog = engine_catalog();
        let _ = node.take_store_changes(1 << 16);
        let done = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut publisher = Publisher::new("", 10_000);
            while !done.load(Ordering::Relaxed) {
                socket
                    .serve(Duration::from_millis(50), |start| {
                        publisher
                            .replay(start)
                            .into_iter()
                            .map(|f| vec![f.topic, f.seq.to_vec(), f.payload])
                    })
                    .unwrap();
                let Ok((changes, _)) = kvpeer::pool_node::store_changes(&node, 1 << 16) else {
                    return;
                };
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                if let Some(f) = publisher.publish(ts, &changes, &mut catalog).unwrap() {
                    socket.publish(&[&f.topic, &f.seq, &f.payload]);
                }
            }
        });
        EngineStream {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
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

#[derive(Debug, Clone)]
struct RunResult {
    router: Router,
    pools: usize,
    tier: Tier,
    local: u64,
    pool: u64,
    miss: u64,
    checked: u64,
    secs: f64,
    pulled_bytes: u64,
    /// Each lookup's round trip.
    lookups: Vec<Duration>,
    /// Per window: hit chunks (local + pool) over the window's chunks.
    curve: Vec<f64>,
}

fn run(o: &Opts, prefixes: &[u64], router: Router, pools: usize) -> RunResult {
    run_on(o, prefixes, router, pools, Tier::Memory)
}

/// A pool node of an eighth of `POOL_BLOCKS` in memory over a disk tier of `POOL_BLOCKS` in `dir`.
fn node_on_disk(tag: &str, dir: &std::path::Path) -> Arc<Node> {
    let mut config = NodeConfig::builder(tag)
        .plane(PlaneKind::Tcp)
        .num_blocks(POOL_BLOCKS / 8)
        .block_len(LEN)
        .build()
        .unwrap();
    let _ = std::fs::remove_dir_all(dir);
    config.spec.disk = Some(kvpeer_store::disk::DiskConfig {
        dir: dir.to_path_buf(),
        capacity: 4096 + POOL_BLOCKS * (LEN + 4096),
        threads: 8,
        promote: kvpeer_store::disk::Promote::Hot,
        engine: kvpeer_store::disk::DiskEngine::Auto,
        tenant_names: Vec::new(),
        default_tenant: String::new(),
    });
    Arc::new(Node::start(config).unwrap())
}

fn run_on(o: &Opts, prefixes: &[u64], router: Router, pools: usize, tier: Tier) -> RunResult {
    let tag = format!(
        "{}{pools}{}",
        if router == Router::KvAware {
            "kv"
        } else {
            "rr"
        },
        match tier {
            Tier::Memory => "",
            Tier::EighthMemory => "-m8",
            Tier::EighthPlusDisk => "-d8",
        }
    );
    let mut engines = Vec::new();
    let mut streams = Vec::new();
    let mut follow = Vec::new();
    for i in 0..ENGINES {
        let e = node(&format!("shards-{tag}-e{i}"), ENGINE_BLOCKS);
        let (events, replay) = (free_addr(), free_addr());
        streams.push(EngineStream::start(e.clone(), events, replay));
        follow.push(FollowSpec {
            events: SubEndpoint::Connect(events),
            replay: Some(replay),
            peer: e.id().clone(),
        });
        engines.push(e);
    }
    let pool_nodes: Vec<Arc<Node>> = (0..pools)
        .map(|i| {
            let name = format!("shards-{tag}-pool{i}");
            match (tier, &o.disk_tier) {
                (Tier::EighthPlusDisk, Some(dir)) => node_on_disk(&name, dir),
                (Tier::EighthMemory, _) => node(&name, POOL_BLOCKS / 8),
                _ => node(&name, POOL_BLOCKS / pools as u64),
            }
        })
        .collect();
    let members: Vec<PeerId> = pool_nodes.iter().map(|n| n.id().clone()).collect();
    // What every engine's tier lists as its `sources`: the pools, as their --shard names them.
    let sources = Sources::new(members.clone());
    let running: Vec<PoolNode> = pool_nodes
        .iter()
        .map(|n| {
            let config = PoolConfig {
                follow: follow.clone(),
                max_lookups: 1000,
                shard: if pools > 1 {
                    members.clone()
                } else {
                    Vec::new()
                },
                ..PoolConfig::default()
            };
            PoolNode::start(n.clone(), &config).unwrap()
        })
        .collect();
    // Every stream connected and every engine's session open before the clock starts.
    let deadline = Instant::now() + Duration::from_secs(30);
    for p in &running {
        while p.stats().connected < ENGINES as u64 {
            assert!(Instant::now() < deadline, "streams: {:?}", p.stats());
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    for e in &engines {
        for m in &members {
            e.connect(m, Duration::from_secs(10)).unwrap();
        }
    }
    let mut r = RunResult {
        router,
        pools,
        tier,
        local: 0,
        pool: 0,
        miss: 0,
        checked: 0,
        secs: 0.0,
        pulled_bytes: 0,
        lookups: Vec::new(),
        curve: Vec::new(),
    };
    let mut window_hits = 0u64;
    let start = Instant::now();
    for (i, &p) in prefixes.iter().enumerate() {
        let due = start + Duration::from_secs_f64(i as f64 / o.rate);
        if let Some(d) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(d);
        }
        let keys = prefix_keys(p);
        let served = common::serve(
            &engines[router.pick(&engines, &keys, i)],
            &sources,
            &keys,
            &format!("shards-{tag}-{i}"),
            LEN as usize,
            i % 16 == 0,
        );
        let (local, from_pool) = (served.local, served.pool);
        r.lookups.extend(served.lookup);
        r.checked += u64::from(served.checked);
        r.local += local as u64;
        r.pool += from_pool as u64;
        r.miss += served.miss as u64;
        window_hits += (local + from_pool) as u64;
        if (i + 1) % WINDOW == 0 {
            r.curve
                .push(window_hits as f64 / (WINDOW as u64 * CHUNKS) as f64);
            window_hits = 0;
        }
    }
    r.secs = start.elapsed().as_secs_f64();
    for (i, p) in running.into_iter().enumerate() {
        let s = p.stats();
        r.pulled_bytes += s.pulled_bytes;
        eprintln!(
            "[{tag}] pool {i}: pulled {} blocks, shard_others {}, shard_unknown_root {}, failures {}",
            s.pulled_blocks, s.shard_others, s.shard_unknown_root, s.pull_failures
        );
        p.shutdown();
    }
    for n in &pool_nodes {
        n.shutdown(Duration::from_secs(1));
    }
    drop(streams);
    for e in &engines {
        e.shutdown(Duration::from_secs(1));
    }
    r
}

fn percentile(sorted: &[Duration], q: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

const COLOURS: [&str; 4] = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"];

fn svg(runs: &[RunResult]) -> String {
    let plot = Plot::new(runs.first().map_or(1, |r| r.curve.len()));
    let mut s = plot.frame(
        &format!(
            "Chunk hit rate per {WINDOW} requests: {ENGINES} engines, round-robin (solid) and KV-aware (dashed), Zipf s={ZIPF_S} over {PREFIXES} prefixes × {CHUNKS} chunks"
        ),
        WINDOW,
    );
    let rr = runs
        .iter()
        .filter(|r| r.router == Router::RoundRobin)
        .count();
    for (k, r) in runs.iter().enumerate() {
        let colour = COLOURS[k % rr.max(1) % COLOURS.len()];
        let dash = if r.router == Router::KvAware {
            "stroke-dasharray=\"6,4\""
        } else {
            ""
        };
        s += &plot.line(&r.curve, colour, dash);
        if r.router == Router::KvAware {
            continue;
        }
        let label = match r.pools {
            0 => "no pool: local hits".to_owned(),
            1 => format!("1 pool of {POOL_BLOCKS} chunks"),
            n => format!(
                "{n} sharded pools of {} chunks each",
                POOL_BLOCKS / n as u64
            ),
        };
        s += &plot.legend(k, rr, colour, "", &label);
    }
    s += "</svg>\n";
    s
}

fn main() {
    let o = opts();
    let prefixes = workload(&o);
    let chunks = (prefixes.len() as u64 * CHUNKS) as f64;
    println!(
        "workload: {} requests at {}/s, round-robin then KV-aware over {ENGINES} engines × {ENGINE_BLOCKS} chunks, Zipf s={ZIPF_S} over {PREFIXES} prefixes × {CHUNKS} chunks of {} KiB, seed {}; pool memory {POOL_BLOCKS} chunks in all",
        prefixes.len(),
        o.rate,
        LEN / 1024,
        o.seed
    );
    if o.disk_tier.is_some() {
        disk_tier_runs(&o, &prefixes, chunks);
        return;
    }
    let mut runs = Vec::new();
    for router in [Router::RoundRobin, Router::KvAware] {
        for pools in [0, 1, 2, 4] {
            runs.push(run(&o, &prefixes, router, pools));
        }
    }
    let pct = |v: u64| 100.0 * v as f64 / chunks;
    println!();
    println!("| router | pools | memory each | local hits | pool hits | recomputed | lookup p50 | lookup p99 | pulled | pull bandwidth |");
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for r in &runs {
        let mut sorted = r.lookups.clone();
        sorted.sort();
        let memory = if r.pools == 0 {
            "-".to_owned()
        } else {
            format!("{} MiB", (POOL_BLOCKS / r.pools as u64 * LEN) >> 20)
        };
        println!(
            "| {} | {} | {memory} | {:.1}% | {:.1}% | {:.1}% | {:.0} µs | {:.0} µs | {:.1} MiB | {:.2} MiB/s |",
            r.router.name(),
            r.pools,
            pct(r.local),
            pct(r.pool),
            pct(r.miss),
            percentile(&sorted, 0.5).as_secs_f64() * 1e6,
            percentile(&sorted, 0.99).as_secs_f64() * 1e6,
            r.pulled_bytes as f64 / (1 << 20) as f64,
            r.pulled_bytes as f64 / (1 << 20) as f64 / r.secs
        );
    }
    let hit = |r: &RunResult| (r.local + r.pool) as f64 / chunks;
    println!();
    for router in [Router::RoundRobin, Router::KvAware] {
        let of: Vec<&RunResult> = runs.iter().filter(|r| r.router == router).collect();
        let single = hit(of[1]);
        for r in &of[2..] {
            let mut sorted = r.lookups.clone();
            sorted.sort();
            println!(
                "{}: {} sharded pools: hit rate {:.1}% = {:.3}× the single pool's {:.1}% (goal ≥ 0.90), at 1/{} of its memory each; lookup p99 {:.0} µs (goal ≤ 1000); pool hits byte-checked: {}",
                router.name(),
                r.pools,
                100.0 * hit(r),
                hit(r) / single,
                100.0 * single,
                r.pools,
                percentile(&sorted, 0.99).as_secs_f64() * 1e6,
                r.checked
            );
        }
        println!(
            "{}: recompute saved by the single pool: {:.1}% of all chunks (misses {:.1}% → {:.1}%)",
            router.name(),
            pct(of[0].miss.saturating_sub(of[1].miss)),
            pct(of[0].miss),
            pct(of[1].miss)
        );
    }
    if let Some(path) = &o.svg {
        match std::fs::write(path, svg(&runs)) {
            Ok(()) => println!("plot: {path}"),
            Err(e) => {
                eprintln!("cannot write the plot to {path}: {e}");
                std::process::exit(1);
            }
        }
    }
}

/// Issue 41: one pool with all of `POOL_BLOCKS` in memory, with an eighth of it, and with an
/// eighth over a disk tier holding `POOL_BLOCKS`, behind the round-robin router (the pool
/// serves most of the hits there); the disk run's hit rate against the all-memory one's.
fn disk_tier_runs(o: &Opts, prefixes: &[u64], chunks: f64) {
    let runs: Vec<RunResult> = [Tier::Memory, Tier::EighthMemory, Tier::EighthPlusDisk]
        .into_iter()
        .map(|tier| run_on(o, prefixes, Router::RoundRobin, 1, tier))
        .collect();
    let pct = |v: u64| 100.0 * v as f64 / chunks;
    let hit = |r: &RunResult| (r.local + r.pool) as f64 / chunks;
    println!();
    println!("| pool | memory | local hits | pool hits | recomputed | lookup p50 | lookup p99 |");
    println!("|---|---|---|---|---|---|---|");
    for r in &runs {
        let mut sorted = r.lookups.clone();
        sorted.sort();
        let memory = match r.tier {
            Tier::Memory => POOL_BLOCKS * LEN,
            _ => POOL_BLOCKS / 8 * LEN,
        };
        println!(
            "| {} | {} MiB | {:.1}% | {:.1}% | {:.1}% | {:.0} µs | {:.0} µs |",
            r.tier.name(),
            memory >> 20,
            pct(r.local),
            pct(r.pool),
            pct(r.miss),
            percentile(&sorted, 0.5).as_secs_f64() * 1e6,
            percentile(&sorted, 0.99).as_secs_f64() * 1e6,
        );
    }
    println!();
    println!(
        "hit rate with 1/8 of the memory plus disk: {:.1}% = {:.3}× the all-memory pool's {:.1}% (goal ≥ 0.95); 1/8 of the memory alone: {:.3}×; pool hits byte-checked: {}",
        100.0 * hit(&runs[2]),
        hit(&runs[2]) / hit(&runs[0]),
        100.0 * hit(&runs[0]),
        hit(&runs[1]) / hit(&runs[0]),
        runs[2].checked
    );
    if let Some(dir) = &o.disk_tier {
        let _ = std::fs::remove_dir_all(dir);
    }
}
