//! What both of `kvpeer fetch`'s workloads share (the public-API one in [`crate::fetch_cmd`],
//! the engine-driven one in [`crate::fetch_driven`]): the command's options, the keys of
//! request `r`, the tally and its progress bar, and the pool's removal on a signal.

use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use kvpeer::{synthetic, OffloadKey};

use crate::fetch_error::FetchError;
use crate::node_args::NodeArgs;

/// `kvpeer fetch` options.
#[derive(Debug, clap::Args)]
pub(crate) struct FetchArgs {
    /// The serving peer's control address (its identity).
    #[arg(long)]
    pub(crate) peer: String,
    #[command(flatten)]
    pub(crate) node: NodeArgs,
    /// Requests to run, one after another.
    #[arg(long, default_value_t = 16)]
    pub(crate) requests: u64,
    /// Keys looked up per request.
    #[arg(long, default_value_t = 8)]
    pub(crate) keys: u64,
    /// Share of each request's keys that are new (looked up, never held by anyone); they come
    /// after the shared prefix, as a prompt's new text follows its shared start.
    #[arg(long, default_value_t = 0.25, value_parser = parse_share)]
    pub(crate) miss_share: f64,
    /// Cycle the requests over this many shared prefixes (request `r` uses prefix `r % N`), so
    /// a long run needs only N prefixes filled at the peer; 0: every request its own prefix.
    #[arg(long, default_value_t = 0)]
    pub(crate) prefixes: u64,
    /// Synthetic index of the first key.
    #[arg(long, default_value_t = 0)]
    pub(crate) first: u64,
    /// Print the summary as one JSON object instead of `key=value` pairs.
    #[arg(long)]
    pub(crate) json: bool,
    /// Skip the byte check of fetched blocks (benchmarks: measure the transfer, not the
    /// check); blocks are still counted. Warm-up requests are always checked.
    #[arg(long)]
    pub(crate) no_verify: bool,
    /// Requests in flight at once (callers of the node, each running its share in turn). With
    /// more than one, the pool needs keys × (concurrency + 1) blocks, so that blocks a caller
    /// just fetched are not evicted by the others' reservations before it reads them.
    #[arg(long, default_value_t = 1)]
    pub(crate) concurrency: u64,
    /// Requests run first and left out of the figures (their bytes are checked; a failure or
    /// a mismatch still fails the run).
    #[arg(long, default_value_t = 0)]
    pub(crate) warmup: u64,
    /// Bound on every wait (handshake, one lookup, one fetch), in seconds.
    #[arg(long, default_value_t = 30)]
    pub(crate) timeout_secs: u64,
    /// Exit 1 when fewer than this share of the keys looked up hit (0 to 1; a smoke test of a
    /// fleet: `--min-hit-rate 0.5`)
    #[arg(long, default_value_t = 0.0, value_parser = parse_share)]
    pub(crate) min_hit_rate: f64,
    /// Drive the node on this command's thread, as an engine embedding kvpeer does (no
    /// runtime thread, no hop per call; `--concurrency` requests in flight on the one thread).
    #[arg(long)]
    pub(crate) driven: bool,
}

/// What a run measured.
#[derive(Debug, Default)]
pub(crate) struct Tally {
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) bytes: u64,
    pub(crate) failed_loads: u64,
    pub(crate) corrupt_blocks: u64,
    /// Sessions with the peer that ended during the run (its process died, its host went
    /// away, it refused us): every request after that is a miss, which is no success.
    pub(crate) sessions_lost: u64,
    pub(crate) lookup_us: Vec<u64>,
    pub(crate) fetch_us: Vec<u64>,
    /// From the first request to the last finish (the node's start-up and handshake excluded).
    pub(crate) workload: Duration,
    /// CPU time (user + system, every thread of this process) over `workload`.
    pub(crate) cpu: Duration,
}

impl Tally {
    /// Adds another caller's counts and samples (not its times: the workload's are measured
    /// around all callers).
    pub(crate) fn merge(&mut self, other: Tally) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.bytes += other.bytes;
        self.failed_loads += other.failed_loads;
        self.corrupt_blocks += other.corrupt_blocks;
        self.sessions_lost += other.sessions_lost;
        self.lookup_us.extend(other.lookup_us);
        self.fetch_us.extend(other.fetch_us);
    }
}

/// CPU time this process has used so far (every thread, user + system); zero if unknown.
pub(crate) fn process_cpu() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_SELF).map_or(Duration::ZERO, |u| {
        let tv = |t: nix::sys::time::TimeVal| {
            Duration::from_secs(t.tv_sec().max(0) as u64)
                + Duration::from_micros(t.tv_usec().max(0) as u64)
        };
        tv(u.user_time()) + tv(u.system_time())
    })
}

/// Synthetic indexes from here on are never filled by `serve`: the "new text" of requests.
const MISS_BASE: u64 = 1 << 48;

/// A block length as the memory's index type.
pub(crate) fn block_len(len: u64) -> Result<usize, FetchError> {
    usize::try_from(len).map_err(|_| FetchError::BlockLen(len))
}

fn parse_share(text: &str) -> Result<f64, String> {
    text.parse::<f64>()
        .ok()
        .filter(|s| (0.0..=1.0).contains(s))
        .ok_or_else(|| format!("{text:?} is not a share between 0 and 1"))
}

/// The `p`th percentile (nearest rank) of `samples`; 0 when there are none.
pub(crate) fn percentile(samples: &[u64], p: usize) -> u64 {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    match sorted.len() {
        0 => 0,
        n => sorted[((n * p).div_ceil(100)).clamp(1, n) - 1],
    }
}

/// The signal that asked the run to stop (0: none).
static STOPPED_BY: AtomicI32 = AtomicI32::new(0);

/// How long a stopped run may take to end its requests in flight and print its summary.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// The signal (SIGINT, SIGTERM) that asked the run to stop, if one did: it starts no more
/// requests, and its summary says so.
pub(crate) fn interrupted() -> Option<i32> {
    match STOPPED_BY.load(Ordering::Relaxed) {
        0 => None,
        signal => Some(signal),
    }
}

/// On SIGINT or SIGTERM the run is asked to stop ([`interrupted`]): it starts no more
/// requests, lets those in flight end (each bounded by its timeouts), prints the summary of
/// what ran and exits with 128 + the signal, the node dropping its pool on the way. If it has
/// not exited within [`STOP_GRACE`], or at a second signal, this watcher removes the pool's
/// shared-memory object (on the planes that make one: shm, both) and exits itself. Set up
/// before the node starts, so no moment leaves the object behind (`kill -9` still does:
/// nothing can run then).
pub(crate) fn remove_pool_on_signal(shm_name: &str) -> Result<(), FetchError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).map_err(FetchError::Signals)?;
    let path = format!("/{shm_name}");
    std::thread::Builder::new()
        .name("kvpeer-fetch-signals".into())
        .spawn(move || {
            let Some(signal) = signals.forever().next() else {
                return;
            };
            STOPPED_BY.store(signal, Ordering::Relaxed);
            let deadline = Instant::now() + STOP_GRACE;
            while Instant::now() < deadline && signals.pending().next().is_none() {
                std::thread::sleep(Duration::from_millis(20));
            }
            // The object may not exist yet (or any more), or at all (a tcp or nixl pool is
            // anonymous memory): nothing to remove then.
            // Its fence words too (kvpeer_store::fence), whatever became of the pool.
            let _ = nix::sys::mman::shm_unlink(
                kvpeer_store::fence::object_name(path.as_str()).as_str(),
            );
            match nix::sys::mman::shm_unlink(path.as_str()) {
                Ok(()) => {
                    crate::report::fatal!(
                        "fetch",
                        "stopped by signal {signal}; pool {path} removed"
                    )
                }
                Err(_) => crate::report::fatal!("fetch", "stopped by signal {signal}"),
            }
            std::process::exit(128 + signal);
        })
        .map(|_| ())
        .map_err(FetchError::SignalWatcher)
}

/// The keys request `r` looks up: first the shared prefix (the peer may hold it), then the
/// `--miss-share` of new text no one has computed (synthetic indexes never filled).
pub(crate) fn request_keys(args: &FetchArgs, r: u64) -> Vec<OffloadKey> {
    let misses = ((args.keys as f64 * args.miss_share).round() as u64).min(args.keys);
    let shared = args.keys - misses;
    let prefix = if args.prefixes > 0 {
        r % args.prefixes
    } else {
        r
    };
    let first = args.first + prefix * shared;
    let new = MISS_BASE + r * misses;
    (first..first + shared)
        .chain(new..new + misses)
        .map(synthetic::key)
        .collect()
}

pub(crate) fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A one-line progress bar on stderr, drawn only when stderr is a terminal (never into logs or
/// pipes), at most ten times a second.
pub(crate) struct Progress {
    total: u64,
    on: bool,
    last: Option<Instant>,
}

impl Progress {
    pub(crate) fn new(total: u64, wanted: bool) -> Self {
        use std::io::IsTerminal;
        Progress {
            total,
            on: wanted && std::io::stderr().is_terminal(),
            last: None,
        }
    }

    pub(crate) fn show(&mut self, done: u64, t: &Tally) {
        if !self.on
            || self
                .last
                .is_some_and(|l| l.elapsed() < Duration::from_millis(100))
        {
            return;
        }
        self.last = Some(Instant::now());
        let width = 30;
        let filled = (done * width / self.total.max(1)) as usize;
        eprint!(
            "\r[{}{}] {done}/{} requests, {} hits, {:.1} MiB",
            "#".repeat(filled),
            " ".repeat(width as usize - filled),
            self.total,
            t.hits,
            t.bytes as f64 / (1u64 << 20) as f64
        );
    }

    pub(crate) fn done(&mut self) {
        if self.on {
            // Clear the bar so the summary starts on a clean line.
            eprint!("\r{}\r", " ".repeat(80));
        }
    }
}
