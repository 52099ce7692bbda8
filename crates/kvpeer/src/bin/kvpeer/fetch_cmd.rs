//! `kvpeer fetch --peer HOST:PORT`: a consumer workload against a node serving synthetic blocks
//! (`kvpeer serve --fill N`). Request `r` looks up a shared prefix of synthetic keys (from
//! `--first`, consecutive across requests) followed by `--miss-share` new keys at the peer,
//! fetches the hits into local blocks, checks every byte against the synthetic content, and
//! finishes the request (a request with no hits sends the terminal empty fetch).
//!
//! Prints one summary line (requests, hits, misses, bytes, lookup and fetch latency p50/p99,
//! the workload's seconds, and GB/s over the loads' own time: fetch sent to blocks landed).
//! Exit status 0 when every load succeeded and every byte matched, 1 otherwise, 2 for bad
//! arguments. Every wait is bounded by `--timeout-secs`. Runs on the public API
//! ([`kvpeer::Node`]), as an engine would; with `--driven`, on an engine-driven node instead
//! ([`crate::fetch_driven`]).

use std::time::{Duration, Instant};

use kvpeer::{synthetic, LookupResult, Node, NodeConfig, NodeError, OffloadKey, PeerId};

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
    fn merge(&mut self, other: Tally) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.bytes += other.bytes;
        self.failed_loads += other.failed_loads;
        self.corrupt_blocks += other.corrupt_blocks;
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

/// Runs the command; returns the exit status.
pub(crate) fn run(args: FetchArgs) -> u8 {
    if PeerId::new(args.peer.clone()).host_port().is_err() {
        crate::report::fatal!("fetch", "--peer must be HOST:PORT, got {:?}", args.peer);
        return 2;
    }
    let config = match args.node.resolve("fetch", None) {
        Ok(c) => c,
        Err(e) => {
            crate::report::fatal!("fetch", "{e}");
            return 2;
        }
    };
    if config.pool.enabled() {
        // A config file shared with `kvpeer serve` may set them; a consumer follows nothing.
        tracing::warn!("the pool node's keys (follow, publish_events, ...) are ignored by fetch");
    }
    if args.keys == 0 || args.keys > config.spec.num_blocks {
        crate::report::fatal!(
            "fetch",
            "--keys must be between 1 and the pool's {} blocks",
            config.spec.num_blocks
        );
        return 2;
    }
    // Callers in flight reserve blocks while another reads the blocks it just fetched (ready,
    // so evictable): one request's worth of slack keeps those from being evicted before read.
    let needed = match args.concurrency {
        0 | 1 => args.keys,
        c => args.keys.saturating_mul(c + 1),
    };
    if args.concurrency == 0 || needed > config.spec.num_blocks {
        crate::report::fatal!(
            "fetch",
            "--concurrency must be at least 1, and the pool's {} blocks must hold \
             keys × (concurrency + 1) = {needed} for several requests in flight",
            config.spec.num_blocks
        );
        return 2;
    }
    let outcome = if args.driven {
        crate::fetch_driven::fetch(&args, config)
    } else {
        fetch(&args, config)
    };
    match outcome {
        Ok(t) => {
            let secs = t.workload.as_secs_f64();
            // Throughput of the loads themselves (fetch sent to blocks landed).
            let fetch_secs = t.fetch_us.iter().sum::<u64>() as f64 / 1e6;
            let gbps = if fetch_secs > 0.0 {
                t.bytes as f64 / fetch_secs / 1e9
            } else {
                0.0
            };
            let looked_up = t.hits + t.misses;
            let hit_rate = if looked_up > 0 {
                t.hits as f64 / looked_up as f64
            } else {
                0.0
            };
            let summary = serde_json::json!({
                "requests": args.requests,
                "hits": t.hits,
                "misses": t.misses,
                "hit_rate": (hit_rate * 1e3).round() / 1e3,
                "bytes": t.bytes,
                "failed_loads": t.failed_loads,
                "corrupt_blocks": t.corrupt_blocks,
                "lookup_p50_us": percentile(&t.lookup_us, 50),
                "lookup_p99_us": percentile(&t.lookup_us, 99),
                "fetch_p50_us": percentile(&t.fetch_us, 50),
                "fetch_p99_us": percentile(&t.fetch_us, 99),
                "seconds": (secs * 1e3).round() / 1e3,
                "cpu_seconds": (t.cpu.as_secs_f64() * 1e4).round() / 1e4,
                "fetch_gb_per_s": (gbps * 1e3).round() / 1e3,
            });
            if args.json {
                println!("{summary}");
            } else if let Some(fields) = summary.as_object() {
                let line: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!("kvpeer fetch: {}", line.join(" "));
            }
            u8::from(t.failed_loads > 0 || t.corrupt_blocks > 0)
        }
        Err(e) => {
            if args.json {
                // A script reading the summary from stdout gets an object either way.
                println!("{}", serde_json::json!({ "error": e.to_string() }));
            }
            crate::report::fatal!("fetch", "{e}");
            1
        }
    }
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
fn percentile(samples: &[u64], p: usize) -> u64 {
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    match sorted.len() {
        0 => 0,
        n => sorted[((n * p).div_ceil(100)).clamp(1, n) - 1],
    }
}

/// On SIGINT or SIGTERM the node never gets to drop its pool (the process ends with the
/// signal's default action otherwise), so a watcher removes the pool's shared-memory object (on
/// the planes that make one: shm, both) and exits with 128 + the signal. Set up before the node starts, so no moment leaves the object
/// behind (`kill -9` still does: nothing can run then).
pub(crate) fn remove_pool_on_signal(shm_name: &str) -> Result<(), FetchError> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).map_err(FetchError::Signals)?;
    let path = format!("/{shm_name}");
    std::thread::Builder::new()
        .name("kvpeer-fetch-signals".into())
        .spawn(move || {
            if let Some(signal) = signals.forever().next() {
                // The object may not exist yet (or any more), or at all (a tcp or nixl pool is
                // anonymous memory): nothing to remove then.
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
            }
        })
        .map(|_| ())
        .map_err(FetchError::SignalWatcher)
}

fn fetch(args: &FetchArgs, config: NodeConfig) -> Result<Tally, FetchError> {
    remove_pool_on_signal(&config.spec.shm_name)?;
    let node = Node::start(config)?;
    tracing::info!(id = %node.id(), peer = %args.peer, "consumer node up");
    let result = workload(args, &node);
    // `disconnect` to the peer, so it closes the session in order instead of noticing a lost
    // connection.
    node.shutdown(Duration::from_secs(3));
    result
}

fn workload(args: &FetchArgs, node: &Node) -> Result<Tally, FetchError> {
    let peer = PeerId::new(args.peer.clone());
    let run = Run {
        node,
        peer: &peer,
        args,
        block_len: block_len(node.config().block_len)?,
        timeout: Duration::from_secs(args.timeout_secs),
        pid: std::process::id(),
    };
    let mut tally = Tally::default();
    // The handshake is not part of any request's lookup time, nor of the workload's.
    node.connect(&peer, run.timeout)?;
    let (mut started, mut cpu_before) = (Instant::now(), process_cpu());

    let mut progress = Progress::new(args.warmup + args.requests, !args.json);
    for r in 0..args.warmup {
        progress.show(r, &tally);
        run.request(r, true, &mut tally)?;
    }
    if args.warmup > 0 {
        // The figures start here; failures and mismatches of the warm-up still count.
        tally = Tally {
            failed_loads: tally.failed_loads,
            corrupt_blocks: tally.corrupt_blocks,
            ..Tally::default()
        };
        (started, cpu_before) = (Instant::now(), process_cpu());
    }
    let timed = args.warmup..args.warmup + args.requests;
    let verify = !args.no_verify;
    if args.concurrency <= 1 {
        for r in timed {
            progress.show(r, &tally);
            run.request(r, verify, &mut tally)?;
        }
    } else {
        // `concurrency` callers at once, as an engine with requests in flight: caller `i` runs
        // requests i, i + C, ... (so with `--prefixes` a multiple of C no two share a block).
        let c = args.concurrency;
        let parts: Vec<Result<Tally, FetchError>> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..c)
                .map(|i| {
                    let timed = timed.clone();
                    scope.spawn(move || {
                        let mut t = Tally::default();
                        for r in timed.skip(i as usize).step_by(c as usize) {
                            run.request(r, verify, &mut t)?;
                        }
                        Ok(t)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap_or(Err(FetchError::CallerPanicked)))
                .collect()
        });
        for part in parts {
            tally.merge(part?);
        }
    }
    progress.done();
    tally.workload = started.elapsed();
    tally.cpu = process_cpu().saturating_sub(cpu_before);
    Ok(tally)
}

/// What every request of the workload shares.
#[derive(Clone, Copy)]
struct Run<'a> {
    node: &'a Node,
    peer: &'a PeerId,
    args: &'a FetchArgs,
    block_len: usize,
    timeout: Duration,
    /// This process's id, in the request ids (read once: `getpid` is a system call).
    pid: u32,
}

impl Run<'_> {
    /// Request `r`: lookup, fetch of the leading hits, the byte check (`verify`), finish.
    fn request(&self, r: u64, verify: bool, tally: &mut Tally) -> Result<(), FetchError> {
        let Run {
            node,
            peer,
            args,
            block_len,
            timeout,
            pid: _,
        } = *self;
        let request = format!("kvpeer-fetch-{}-{r}", self.pid);
        let keys = request_keys(args, r);
        // Opening the request (and the session, the first time) counts as part of the lookup.
        let lookup_started = Instant::now();
        let req = node.request(peer, &request)?;
        let found = req.lookup(&keys, timeout)?;
        tally.lookup_us.push(micros(lookup_started.elapsed()));
        // A prefix cache uses the leading run of hits.
        let hits = found
            .iter()
            .take_while(|f| **f == LookupResult::Hit)
            .count();
        tally.hits += hits as u64;
        tally.misses += (keys.len() - hits) as u64;

        if hits > 0 {
            let fetch_started = Instant::now();
            match req.fetch(&keys[..hits], timeout) {
                Ok(()) => {
                    tally.fetch_us.push(micros(fetch_started.elapsed()));
                    if !verify {
                        tally.bytes += hits as u64 * block_len as u64;
                    }
                    for key in keys[..hits].iter().filter(|_| verify) {
                        match node.read(key) {
                            Some(bytes) => {
                                tally.bytes += bytes.len() as u64;
                                if bytes != synthetic::content(key, block_len) {
                                    tally.corrupt_blocks += 1;
                                }
                            }
                            None => tally.corrupt_blocks += 1,
                        }
                    }
                }
                Err(NodeError::LoadFailed) => tally.failed_loads += 1,
                Err(e) => return Err(e.into()),
            }
        }
        req.finish();
        Ok(())
    }
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
