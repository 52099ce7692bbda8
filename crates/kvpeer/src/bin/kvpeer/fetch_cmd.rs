//! `kvpeer fetch --peer HOST:PORT`: a consumer workload against a node serving synthetic blocks
//! (`kvpeer serve --fill N`). Request `r` looks up a shared prefix of synthetic keys (from
//! `--first`, consecutive across requests) followed by `--miss-share` new keys at the peer,
//! fetches the hits into local blocks, checks every byte against the synthetic content, and
//! finishes the request (a request with no hits sends the terminal empty fetch).
//!
//! Prints one summary line (requests, hits, misses, bytes, lookup and fetch latency p50/p99,
//! the workload's seconds, and GB/s over the loads' own time: fetch sent to blocks landed).
//! Exit status 0 when every load succeeded, every byte matched, the session with the peer
//! lasted the whole run and the hit rate reached `--min-hit-rate`; 1 otherwise (the last line
//! on stderr says which); 2 for bad arguments. Every wait is bounded by `--timeout-secs`. Runs on the public API
//! ([`kvpeer::Node`]), as an engine would; with `--driven`, on an engine-driven node instead
//! ([`crate::fetch_driven`]); what both share is in [`crate::fetch_workload`].

use std::time::{Duration, Instant};

use kvpeer::node::identity_probe;
use kvpeer::node::resolve::{on_dialed_host, resolve_peer};
use kvpeer::node::routable;
use kvpeer::{synthetic, Host, LookupResult, Node, NodeConfig, NodeError, PeerAddr, PeerId};

use crate::fetch_error::FetchError;
use crate::fetch_workload::{
    block_len, interrupted, micros, percentile, process_cpu, remove_pool_on_signal, request_keys,
    FetchArgs, Progress, Tally,
};

/// Runs the command; returns the exit status.
pub(crate) fn run(mut args: FetchArgs) -> u8 {
    // The peer's address, resolved here once (a name, `localhost`, any spelling), to find the
    // route to it. The session is with the identity the node there answers as: a kvpeer node
    // tells it in its READY (`localhost:5600` is the node that calls itself `127.0.0.1:5600`);
    // a stock vLLM engine tells none, and is named as written (its identity may well be the
    // text `localhost:5710`).
    let mut peer = match resolve_peer(&args.peer) {
        Ok(p) => p,
        Err(e) => {
            crate::report::fatal!("fetch", "--peer must be HOST:PORT: {e}");
            return 2;
        }
    };
    let mut config = match args.node.resolve("fetch", None) {
        Ok(c) => c,
        Err(e) => {
            crate::report::fatal!("fetch", "{e}");
            return 2;
        }
    };
    // Asked only when `--peer` is not already the canonical address a node would call itself
    // by (a name, `localhost`, another spelling), and only of a peer the allowlist admits:
    // nothing is ever sent to a peer outside it, and a plain `IP:PORT` costs no extra
    // connection. The session then dials the identity told, so our own address is the one on
    // the route to it (`localhost` named the node's host, whose address it calls itself by).
    let spelled_otherwise = peer.to_peer_id().as_str() != args.peer;
    if spelled_otherwise && config.spec.allowlist.check_addr(&peer).is_ok() {
        if let Some(told) = told_at(&peer) {
            tracing::info!(peer = %args.peer, identity = %told, "the node there calls itself so");
            args.peer = told.to_string();
            peer = told;
        }
    }
    match args.node.listen_given() {
        // No listen address: this node calls itself by its address on the route to the peer
        // (127.0.0.1 toward a peer on this host, its LAN address toward another host), which
        // the peer's identity check (docs/security.md, G3) accepts from where it connects.
        Ok(false) => {
            if let Some(here) = peer.ip().and_then(routable::route_to) {
                let port =
                    PeerAddr::parse_any_port(config.spec.id.as_str()).map_or(0, |a| a.port());
                config.spec.id = PeerAddr::new(Host::Ip(here), port).to_peer_id();
                config.spec.listen = None;
                // On that address, at the tcp_port given (0: a free one), as a firewall expects.
                let tcp_port = config
                    .spec
                    .tcp_listen
                    .parse::<std::net::SocketAddr>()
                    .map_or(0, |a| a.port());
                config.spec.tcp_listen = std::net::SocketAddr::new(here, tcp_port).to_string();
            }
        }
        Ok(true) => {}
        Err(e) => {
            crate::report::fatal!("fetch", "{e}");
            return 2;
        }
    }
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
                "sessions_lost": t.sessions_lost,
                "lookup_p50_us": percentile(&t.lookup_us, 50),
                "lookup_p99_us": percentile(&t.lookup_us, 99),
                "fetch_p50_us": percentile(&t.fetch_us, 50),
                "fetch_p99_us": percentile(&t.fetch_us, 99),
                "seconds": (secs * 1e3).round() / 1e3,
                "cpu_seconds": (t.cpu.as_secs_f64() * 1e4).round() / 1e4,
                "fetch_gb_per_s": (gbps * 1e3).round() / 1e3,
                "interrupted": interrupted().is_some(),
            });
            if args.json {
                println!("{summary}");
            } else if let Some(fields) = summary.as_object() {
                let line: Vec<String> = fields.iter().map(|(k, v)| format!("{k}={v}")).collect();
                println!("kvpeer fetch: {}", line.join(" "));
            }
            if let Some(signal) = interrupted() {
                // The summary of what ran is out; the exit says it was cut short.
                crate::report::fatal!(
                    "fetch",
                    "stopped by signal {signal}: the summary is of the requests that ran"
                );
                return u8::try_from(128 + signal).unwrap_or(u8::MAX);
            }
            let mut failures = Vec::new();
            if t.failed_loads > 0 {
                failures.push(format!("{} loads failed", t.failed_loads));
            }
            if t.corrupt_blocks > 0 {
                failures.push(format!("{} blocks did not match", t.corrupt_blocks));
            }
            if t.sessions_lost > 0 {
                failures.push(format!(
                    "the session with {} ended during the run ({} times): later requests missed",
                    args.peer, t.sessions_lost
                ));
            }
            if hit_rate < args.min_hit_rate {
                failures.push(format!(
                    "hit rate {hit_rate:.3} below --min-hit-rate {}",
                    args.min_hit_rate
                ));
            }
            if failures.is_empty() {
                return 0;
            }
            crate::report::fatal!("fetch", "{}", failures.join("; "));
            1
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

/// Opens the session with `peer`; a node there that calls itself by another of its addresses
/// (its READY told it: `127.0.0.2:P` reaching a node that is `127.0.0.1:P`) is asked again by
/// that identity, once. Returns the identity the session is with.
fn connect(node: &Node, peer: PeerId, timeout: Duration) -> Result<PeerId, FetchError> {
    match node.connect(&peer, timeout) {
        Ok(()) => Ok(peer),
        Err(e) => match told_identity(&e) {
            Some(told) => {
                tracing::info!(%peer, identity = %told, "the node there calls itself so");
                node.connect(&told, timeout)?;
                Ok(told)
            }
            None => Err(e.into()),
        },
    }
}

/// The identity the node at `peer` tells in its READY, when it is another address of the
/// host we reached (never a redirect to another machine: a node there could otherwise aim our
/// `connect`, with its proofs, wherever it liked).
fn told_at(peer: &PeerAddr) -> Option<PeerAddr> {
    let told = identity_probe::identity_at(peer.socket_addr()?, Duration::from_secs(2))?;
    let told = PeerAddr::of(&told).ok()?;
    on_dialed_host(peer, &told).then_some(told)
}

/// The identity a node told in its READY when it is not the one we dialed it by, and is on
/// the host we dialed ([`on_dialed_host`]); else `None` (the refusal stands, naming both).
fn told_identity(e: &NodeError) -> Option<PeerId> {
    use kvpeer::node::peer_end::PeerEnd;
    use kvpeer_core::{CloseReason, LinkLoss};
    let NodeError::Refused { end: Some(end), .. } = e else {
        return None;
    };
    let PeerEnd::Session(session) = &**end else {
        return None;
    };
    let CloseReason::ConnectionLost(LinkLoss::IdentityMismatch {
        dialed,
        calls_itself,
    }) = &session.reason
    else {
        return None;
    };
    let (dialed, told) = (
        PeerAddr::parse(dialed).ok()?,
        PeerAddr::parse(calls_itself).ok()?,
    );
    on_dialed_host(&dialed, &told).then(|| told.to_peer_id())
}

fn workload(args: &FetchArgs, node: &Node) -> Result<Tally, FetchError> {
    let timeout = Duration::from_secs(args.timeout_secs);
    // The handshake is not part of any request's lookup time, nor of the workload's.
    let peer = connect(node, PeerId::new(args.peer.clone()), timeout)?;
    // A first session refused for naming the node by another of its addresses ended before
    // the workload: only what ends from here on is lost.
    let closed_before = node.stats()?.counters.sessions_closed;
    let run = Run {
        node,
        peer: &peer,
        args,
        block_len: block_len(node.config().block_len)?,
        timeout,
        pid: std::process::id(),
    };
    let mut tally = Tally::default();
    let (mut started, mut cpu_before) = (Instant::now(), process_cpu());

    let mut progress = Progress::new(args.warmup + args.requests, !args.json);
    for r in 0..args.warmup {
        if interrupted().is_some() {
            break;
        }
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
            if interrupted().is_some() {
                break;
            }
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
                            if interrupted().is_some() {
                                break;
                            }
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
    // Our own shutdown comes after this: any session that ended so far ended under us.
    tally.sessions_lost = node
        .stats()?
        .counters
        .sessions_closed
        .saturating_sub(closed_before);
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
