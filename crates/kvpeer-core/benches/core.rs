//! Per-request cost of the protocol core as concurrency grows.
//!
//! Run: `cargo bench -p kvpeer-core --bench core`
//!
//! Two cores, a symmetric consumer and a producer, wired together in memory (typed messages,
//! no codec: the codec has its own benchmark). One request runs the whole protocol: 4 probes,
//! `lookup` → `lookup_resp`, `fetch` of the hits (1 key in 8 misses), a data-plane write,
//! `transfer_done`, finish. Two measurements, both printed with time and heap allocations per
//! request:
//!
//! * **open**: N requests are held open mid-protocol (loads in flight, pins held, deadlines
//!   armed) while windows of 1,000 new requests run the whole protocol. This is the cost of one
//!   request's operations as the number of concurrent requests grows. Target (issue 3): at
//!   N = 100,000 at most 1.5× the cost at N = 1,000, in the same run.
//! * **lockstep**: N requests run every step together (all probe, then all fetch...), so the
//!   state of all N is touched at every step: this adds the memory hierarchy's cost once N
//!   requests' state no longer fits in cache.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs, unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use kvpeer_core::{
    BlockIndex, CancelMode, Core, CoreConfig, DataPlane, Event, JobId, LocalNode, LookupResult,
    Parent, PlanePoll, Registration, RemoteMemory, Request, RequestRoles, ServeCtx, StoreJob,
    TransferId,
};
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

/// Counts heap allocations. divan's allocation profiler reports only inside divan's runner;
/// this bench prints its own per-request figures, so it counts for itself. It allocates with
/// mimalloc, the `kvpeer` binary's allocator, or with the system allocator when built with
/// `--features bench-system-alloc` (a compile-time choice: one allocator for the whole run).
struct Counting;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
/// Bytes currently allocated (to measure the memory each open request holds).
static LIVE_BYTES: AtomicU64 = AtomicU64::new(0);

const SYSTEM_ALLOCATOR: bool = cfg!(feature = "bench-system-alloc");

fn system_allocator() -> bool {
    SYSTEM_ALLOCATOR
}

// SAFETY: every method forwards to one allocator (mimalloc or `System`, fixed at compile
// time) with the caller's arguments unchanged, so the `GlobalAlloc` contract holds as it does
// for that allocator; the counter is an atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        LIVE_BYTES.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: same layout contract as our caller's.
        unsafe {
            if system_allocator() {
                System.alloc(layout)
            } else {
                mimalloc::MiMalloc.alloc(layout)
            }
        }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE_BYTES.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: `ptr` was allocated with this layout by the same allocator (fixed at compile
        // time, see `alloc`).
        unsafe {
            if system_allocator() {
                System.dealloc(ptr, layout)
            } else {
                mimalloc::MiMalloc.dealloc(ptr, layout)
            }
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        LIVE_BYTES.fetch_add(new_size as u64, Ordering::Relaxed);
        LIVE_BYTES.fetch_sub(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: as for `dealloc`; the caller upholds the rest of the contract.
        unsafe {
            if system_allocator() {
                System.realloc(ptr, layout, new_size)
            } else {
                mimalloc::MiMalloc.realloc(ptr, layout, new_size)
            }
        }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// A store that holds every key but one in eight, answering in O(1).
#[derive(Default)]
struct BenchParent {
    next_job: JobId,
    pinned: u64,
}

fn held(key: &OffloadKey) -> bool {
    !key.as_bytes()[0].is_multiple_of(8)
}

impl Parent for BenchParent {
    fn on_new_request(&mut self, _: &ServeCtx) {}
    fn lookup(&mut self, key: &OffloadKey, _: &ServeCtx) -> LookupResult {
        if held(key) {
            LookupResult::Hit
        } else {
            LookupResult::Miss
        }
    }
    fn create_store_job(&mut self, keys: &[OffloadKey], _: &ServeCtx) -> Option<StoreJob> {
        self.next_job = JobId::new(self.next_job.get() + 1);
        self.pinned += 1;
        Some(StoreJob {
            job_id: self.next_job,
            blocks: (0..keys.len() as u64).map(BlockIndex::new).collect(),
        })
    }
    fn complete_store_job(&mut self, _: JobId, _: bool) {
        self.pinned -= 1;
    }
    fn on_request_finished(&mut self, _: &ServeCtx) {}
}

/// A data plane whose writes land at the next poll, except while `hold` is set.
#[derive(Default)]
struct BenchPlane {
    next: TransferId,
    landed: HashMap<PeerId, Vec<TransferId>>,
    hold: bool,
    held: Vec<(PeerId, TransferId)>,
}

impl DataPlane for BenchPlane {
    fn add_remote_peer(
        &mut self,
        _: &PeerId,
        _: &RemoteMemory,
    ) -> Result<(), kvpeer_core::PlaneError> {
        Ok(())
    }
    fn registration(&mut self, _: &PeerId) -> Registration {
        Registration::Done
    }
    fn remove_remote_peer(&mut self, _: &PeerId) {}
    fn write_blocks(
        &mut self,
        peer: &PeerId,
        _: &[BlockIndex],
        _: &[BlockIndex],
    ) -> Option<TransferId> {
        self.next = TransferId::new(self.next.get() + 1);
        if self.hold {
            self.held.push((peer.clone(), self.next));
        } else {
            self.landed.entry(peer.clone()).or_default().push(self.next);
        }
        Some(self.next)
    }
    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        PlanePoll {
            done: self.landed.remove(peer).unwrap_or_default(),
            ..PlanePoll::default()
        }
    }
    fn cancel(&mut self, _: &[TransferId], _: CancelMode) -> Vec<TransferId> {
        Vec::new()
    }
}

type BenchCore = Core<BenchParent, BenchPlane>;

fn node(i: u8, now: Instant) -> BenchCore {
    let local = LocalNode {
        peer_id: PeerId::new(format!("10.0.0.{i}:5710")),
        agent_metadata: vec![i],
        base_addr: 0,
        num_blocks: 1 << 40,
        block_len: 16_384,
        config_fingerprint: String::new(),
        hash_seed: "42".into(),
    };
    Core::new(
        CoreConfig::default(),
        local,
        BenchParent::default(),
        BenchPlane::default(),
        now,
    )
}

/// Moves every message `from` has for `to`; returns how many.
fn deliver(from: &mut BenchCore, to: &mut BenchCore, now: Instant) -> usize {
    let sender = from.local().peer_id.clone();
    let mut n = 0;
    while let Some(t) = from.poll_transmit() {
        to.handle_message(now, &sender, t.message);
        n += 1;
    }
    n
}

const KEYS_PER_REQUEST: u64 = 4;

fn key(n: u64) -> OffloadKey {
    let mut hash = [0u8; 32];
    hash[..8].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    OffloadKey::from_parts(&hash, 0)
}

/// Runs one batch of `n` concurrent requests; returns (elapsed, allocations, loads done).
fn batch(
    c: &mut BenchCore,
    p: &mut BenchCore,
    now: Instant,
    n: u64,
    base: u64,
) -> (Duration, u64, u64) {
    let producer = p.local().peer_id.clone();
    let ids: Vec<KvRequestId> = (0..n)
        .map(|i| KvRequestId::new(format!("req-{}", base + i)))
        .collect();
    let keys: Vec<Vec<OffloadKey>> = (0..n)
        .map(|i| {
            (0..KEYS_PER_REQUEST)
                .map(|k| key((base + i) * KEYS_PER_REQUEST + k))
                .collect()
        })
        .collect();
    let allocs_before = ALLOCATIONS.load(Ordering::Relaxed);
    let start = Instant::now();

    let mut reqs = Vec::with_capacity(ids.len());
    for (id, ks) in ids.iter().zip(&keys) {
        let req = c.on_new_request(now, id.clone(), RequestRoles::kv_source(producer.clone()));
        for k in ks {
            c.lookup(now, &req, k);
        }
        reqs.push(req);
    }
    c.flush_lookups(now);
    deliver(c, p, now);
    deliver(p, c, now);
    for (i, (req, ks)) in reqs.iter().zip(&keys).enumerate() {
        let hits: Vec<OffloadKey> = ks
            .iter()
            .filter(|k| c.lookup(now, req, k) == LookupResult::Hit)
            .cloned()
            .collect();
        let blocks = (0..hits.len() as u64).map(BlockIndex::new).collect();
        c.submit_load(now, JobId::new(base + i as u64), req, hits, blocks);
    }
    deliver(c, p, now);
    p.handle_data_plane(now);
    deliver(p, c, now);
    let mut done = 0;
    while let Some(e) = c.poll_event() {
        if matches!(e, Event::LoadDone { success: true, .. }) {
            done += 1;
        }
    }
    for req in &reqs {
        c.finish(now, req);
    }
    deliver(c, p, now);
    while p.poll_event().is_some() {}

    let elapsed = start.elapsed();
    let allocs = ALLOCATIONS.load(Ordering::Relaxed) - allocs_before;
    (elapsed, allocs, done)
}

/// Opens `n` requests and leaves each with its load in flight (the producer's writes held).
fn open_population(
    c: &mut BenchCore,
    p: &mut BenchCore,
    now: Instant,
    n: u64,
    base: u64,
) -> Vec<Request> {
    let producer = p.local().peer_id.clone();
    p.plane_mut().hold = true;
    let open_key = |i: u64, k: u64| key(u64::MAX / 2 + (base + i) * KEYS_PER_REQUEST + k);
    let reqs: Vec<Request> = (0..n)
        .map(|i| {
            let id = KvRequestId::new(format!("open-{}", base + i));
            c.on_new_request(now, id, RequestRoles::kv_source(producer.clone()))
        })
        .collect();
    for (i, req) in reqs.iter().enumerate() {
        for k in 0..KEYS_PER_REQUEST {
            c.lookup(now, req, &open_key(i as u64, k));
        }
    }
    c.flush_lookups(now);
    deliver(c, p, now);
    deliver(p, c, now);
    for (i, req) in reqs.iter().enumerate() {
        let keys: Vec<OffloadKey> = (0..KEYS_PER_REQUEST)
            .map(|k| open_key(i as u64, k))
            .filter(|k| c.lookup(now, req, k) == LookupResult::Hit)
            .collect();
        let blocks = (0..keys.len() as u64).map(BlockIndex::new).collect();
        c.submit_load(
            now,
            JobId::new(1 << 40 | (base + i as u64)),
            req,
            keys,
            blocks,
        );
    }
    deliver(c, p, now);
    p.plane_mut().hold = false;
    reqs
}

/// Lets the held writes land and finishes the population.
fn close_population(c: &mut BenchCore, p: &mut BenchCore, now: Instant, ids: &[Request]) {
    let held = std::mem::take(&mut p.plane_mut().held);
    for (peer, tid) in held {
        p.plane_mut().landed.entry(peer).or_default().push(tid);
    }
    p.handle_data_plane(now);
    deliver(p, c, now);
    for id in ids {
        c.finish(now, id);
    }
    deliver(c, p, now);
    while c.poll_event().is_some() {}
    while p.poll_event().is_some() {}
}

fn print_row(mode: &str, n: u64, runs: u64, ns: f64, allocs: f64) {
    println!(
        "{mode:>9} {n:>10} {runs:>6} {ns:>12.0} {:>13.0} {allocs:>15.1}",
        1e9 / ns
    );
}

fn main() {
    let system = SYSTEM_ALLOCATOR;
    let t0 = Instant::now();
    let mut now = t0;
    let mut c = node(1, now);
    let mut p = node(2, now);
    let warmup = c.on_new_request(
        now,
        KvRequestId::from("warmup"),
        RequestRoles::kv_source(p.local().peer_id.clone()),
    );
    for _ in 0..3 {
        deliver(&mut c, &mut p, now);
        deliver(&mut p, &mut c, now);
    }
    c.finish(now, &warmup);

    println!(
        "kvpeer-core: lookup -> fetch -> transfer_done -> finish, {KEYS_PER_REQUEST} probes per request, 2 cores in memory, {} allocator",
        if system { "system (glibc)" } else { "mimalloc" }
    );
    println!(
        "{:>9} {:>10} {:>6} {:>12} {:>13} {:>15}",
        "mode", "concurrent", "runs", "ns/request", "requests/s", "allocs/request"
    );
    let mut base = 0;
    let sizes: Vec<u64> = match std::env::var("KVPEER_BENCH_SIZES") {
        Ok(s) => s.split(',').filter_map(|x| x.trim().parse().ok()).collect(),
        Err(_) => vec![10, 1_000, 100_000],
    };

    const WINDOW: u64 = 1_000;
    let mut open = HashMap::new();
    for &n in &sizes {
        let before = LIVE_BYTES.load(Ordering::Relaxed);
        let size = n.saturating_sub(WINDOW.min(n));
        let population = open_population(&mut c, &mut p, now, size, 1 << 50 | base);
        if size >= 10_000 {
            let held = LIVE_BYTES.load(Ordering::Relaxed).saturating_sub(before);
            println!(
                "          ({size} requests held open with a load in flight: {:.0} heap bytes per request, both cores)",
                held as f64 / size as f64
            );
        }
        base += n;
        let window = WINDOW.min(n);
        let runs = 40;
        let mut best = (Duration::MAX, 0);
        for _ in 0..runs {
            let (elapsed, allocs, done) = batch(&mut c, &mut p, now, window, base);
            assert_eq!(done, window, "every request loads its hits");
            base += window;
            if elapsed < best.0 {
                best = (elapsed, allocs);
            }
        }
        let ns = best.0.as_nanos() as f64 / window as f64;
        open.insert(n, ns);
        print_row("open", n, runs, ns, best.1 as f64 / window as f64);
        close_population(&mut c, &mut p, now, &population);
        now += Duration::from_secs(61);
        c.handle_timeout(now);
        p.handle_timeout(now);
    }

    let mut per_request = HashMap::new();
    for &n in &sizes {
        let runs = (200_000 / n).clamp(3, 200);
        let mut best = Duration::MAX;
        let mut allocs = 0;
        for _ in 0..runs {
            let (elapsed, a, done) = batch(&mut c, &mut p, now, n, base);
            assert_eq!(done, n, "every request loads its hits");
            base += n;
            if elapsed < best {
                best = elapsed;
                allocs = a;
            }
            // Let the stale deadlines of the finished requests fire, outside the timing.
            now += Duration::from_secs(61);
            c.handle_timeout(now);
            p.handle_timeout(now);
        }
        let ns = best.as_nanos() as f64 / n as f64;
        per_request.insert(n, ns);
        print_row("lockstep", n, runs, ns, allocs as f64 / n as f64);
        let (cs, ps) = (c.stats(), p.stats());
        assert_eq!(
            (
                cs.client_requests,
                ps.server_requests,
                ps.store_jobs,
                p.parent().pinned
            ),
            (0, 0, 0, 0),
            "nothing left open"
        );
    }
    for (mode, table) in [("open", &open), ("lockstep", &per_request)] {
        if let (Some(big), Some(small)) = (table.get(&100_000), table.get(&1_000)) {
            println!(
                "{mode}: cost per request at 100,000 vs 1,000 concurrent: {:.2}x (target <= 1.5x)",
                big / small
            );
        }
    }
    let _ = t0;
}
