//! `kvpeer serve`: runs a node with a block pool until SIGINT or SIGTERM, serving its blocks to
//! every peer that asks. `--fill N` first stores synthetic blocks 0..N (docs/synthetic-workload.md);
//! `--metrics HOST:PORT` serves Prometheus metrics. With `--follow` or `--publish-events` it is
//! a pool node ([`kvpeer::pool_node`], docs/pool.md).
//!
//! Once listening it prints one line to stdout, `kvpeer serve: ready id=HOST:PORT ...`, so scripts
//! and tests know where to connect. The node runs on its own runtime thread ([`kvpeer::Node`]);
//! the main thread only waits for a signal, then shuts the node down gracefully (inflight writes
//! drained for up to 3 s, `disconnect` to every peer, the pool unlinked).

use std::io::Write;
use std::sync::Arc;
use std::time::Duration;

use kvpeer::config::KEY;
use kvpeer::pool_node::PoolNode;
use kvpeer::{synthetic, Node};
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;
use tracing::{info, warn};

use crate::node_args::{NodeArgs, PoolArgs};

/// A pool this large is announced before it is allocated (at 1–4 s per GiB here).
const LARGE_POOL: u64 = 1 << 30;

/// `kvpeer serve` options.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    node: NodeArgs,
    #[command(flatten)]
    pool: PoolArgs,
    /// Store synthetic blocks 0..N before serving.
    #[arg(long, default_value_t = 0)]
    fill: u64,
    /// Serve Prometheus metrics at `HOST:PORT` (`/metrics`; port 0 picks one).
    #[arg(long, value_name = "HOST:PORT", value_parser = metrics_address)]
    metrics: Option<String>,
}

/// `--metrics`: a `HOST:PORT`, checked before anything is allocated; a bare port gets a hint.
fn metrics_address(text: &str) -> Result<String, String> {
    match text.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok() => Ok(text.into()),
        _ if text.parse::<u16>().is_ok() => Err(format!(
            "expected HOST:PORT, as 127.0.0.1:{text} (this host only) or 0.0.0.0:{text} (every \
             interface)"
        )),
        _ => Err("expected HOST:PORT, as 127.0.0.1:9100".into()),
    }
}

/// Runs the command; returns the exit status.
pub(crate) fn run(args: ServeArgs) -> u8 {
    let config = match args.node.resolve("serve", Some(&args.pool)) {
        Ok(c) => c,
        Err(e) => {
            crate::report::fatal!("serve", "{e}");
            return 2;
        }
    };
    // The metrics address: the flag, else the configuration's `metrics_listen`, checked as
    // the flag is (before anything is allocated).
    let metrics_at = match (&args.metrics, args.node.setting(&KEY.metrics_listen)) {
        (Some(flag), _) => Some(flag.clone()),
        (None, Ok(None)) => None,
        (None, Ok(Some((text, source)))) => match metrics_address(&text) {
            Ok(addr) => Some(addr),
            Err(why) => {
                crate::report::fatal!("serve", "{source}: metrics_listen: {why}");
                return 2;
            }
        },
        (None, Err(e)) => {
            crate::report::fatal!("serve", "{e}");
            return 2;
        }
    };
    // With a disk tier the pool holds what fits on disk: blocks beyond memory wait there.
    let room = match &config.spec.disk {
        Some(d) => {
            kvpeer_store::disk::format::Layout::for_capacity(config.spec.block_len, d.capacity)
                .map_or(0, |l| l.slots)
        }
        None => config.spec.num_blocks,
    };
    if args.fill > room {
        crate::report::fatal!(
            "serve",
            "--fill {} is more than the pool's {room} blocks{}",
            args.fill,
            if config.spec.disk.is_some() {
                " on disk"
            } else {
                ""
            }
        );
        return 2;
    }
    // Registered before anything starts, so an early signal still stops us cleanly.
    let mut signals = match Signals::new([SIGINT, SIGTERM]) {
        Ok(s) => s,
        Err(e) => {
            crate::report::fatal!("serve", "cannot watch signals: {e}");
            return 1;
        }
    };
    // Many sessions need many descriptors: take what the hard limit allows (the node warns if
    // its caps need more).
    kvpeer::node::descriptors::raise_to_hard_limit();
    let allow_all = config.spec.allowlist.allows_all();
    let plane = config.spec.plane.name();
    let pool_config = config.pool.clone();
    if pool_config.follow.is_empty() {
        // Named as the user gave them: the flag, else the key (a config file's, or its
        // environment variable's).
        let default = kvpeer::config::PoolConfig::default();
        let unused: Vec<&str> = [
            (
                args.pool.pull_min_holders.is_some(),
                pool_config.min_holders != default.min_holders,
                "--pull-min-holders",
                "pull_min_holders",
            ),
            (
                args.pool.pull_max_rate.is_some(),
                pool_config.max_rate != default.max_rate,
                "--pull-max-rate",
                "pull_max_rate",
            ),
            (
                args.pool.pull_max_lookups.is_some(),
                pool_config.max_lookups != default.max_lookups,
                "--pull-max-lookups",
                "pull_max_lookups",
            ),
            (
                args.pool.shard.is_some(),
                !pool_config.shard.is_empty(),
                "--shard",
                "pool_shard",
            ),
        ]
        .into_iter()
        .filter_map(|(flag, set, as_flag, as_key)| {
            if flag {
                Some(as_flag)
            } else {
                set.then_some(as_key)
            }
        })
        .collect();
        if !unused.is_empty() {
            warn!(
                settings = %unused.join(" "),
                "pool settings that do nothing without --follow (this node pulls from no engine)"
            );
        }
    }
    let pool_bytes = config.spec.num_blocks.saturating_mul(config.spec.block_len);
    let backing = if config.spec.plane.shared_pool() {
        kvpeer_store::room::Backing::SharedMemory
    } else {
        kvpeer_store::room::Backing::Private
    };
    // A pool the host cannot hold is refused by the build, with the sizes: no "ready follows"
    // before that refusal.
    let fits = kvpeer_store::room::Room::of_this_host()
        .check(
            pool_bytes,
            config.spec.num_blocks,
            config.spec.block_len,
            backing,
        )
        .is_ok();
    if pool_bytes >= LARGE_POOL && fits {
        // Said at any log level: a large pool takes seconds per GiB to allocate and touch,
        // and nothing else is printed until `ready`.
        eprintln!(
            "kvpeer serve: allocating a pool of {} ({} blocks of {} bytes, {}); ready follows",
            kvpeer_store::room::human(pool_bytes),
            config.spec.num_blocks,
            config.spec.block_len,
            if config.spec.plane.shared_pool() {
                "shared memory in /dev/shm"
            } else {
                "private memory"
            }
        );
    }
    let control = config
        .spec
        .listen
        .map_or_else(|| config.spec.id.to_string(), |l| l.to_string());
    let node = match Node::start(config) {
        Ok(n) => Arc::new(n),
        Err(e) => {
            // A control address that cannot be taken says where it came from when no flag gave
            // it (a VLLM_P2P_SIDE_CHANNEL_PORT left in the environment surprises).
            let from = args
                .node
                .listen_source()
                .filter(|_| {
                    e.to_string()
                        .contains(&format!("cannot listen at {control}"))
                })
                .map(|src| format!(" (the address is from {src})"))
                .unwrap_or_default();
            crate::report::fatal!("serve", "{e}{from}");
            return 1;
        }
    };
    let pool = if pool_config.enabled() {
        match PoolNode::start(node.clone(), &pool_config) {
            Ok(p) => Some(Arc::new(p)),
            Err(e) => {
                crate::report::fatal!("serve", "{e}");
                node.shutdown(Duration::from_secs(1));
                return 1;
            }
        }
    } else {
        None
    };
    // After the pool starts: its publisher records the store's changes from its start, so the
    // filled blocks are announced (`--publish-events`) as any block the node takes in later.
    if let Err(e) = fill(&node, args.fill) {
        crate::report::fatal!("serve", "{e}");
        if let Some(pool) = pool {
            pool.shutdown();
        }
        node.shutdown(Duration::from_secs(1));
        return 1;
    }
    let metrics = match &metrics_at {
        Some(addr) => match kvpeer::metrics::serve_with_pool(addr, node.clone(), pool.clone()) {
            Ok(bound) => bound.to_string(),
            Err(e) => {
                crate::report::fatal!("serve", "cannot serve metrics at {addr}: {e}");
                node.shutdown(Duration::from_secs(1));
                return 1;
            }
        },
        None => "-".into(),
    };

    let advertised = node.advertised();
    let spec = node.config();
    println!(
        "kvpeer serve: ready id={} plane={plane} shm={} tcp={} blocks={} block_len={} filled={} metrics={metrics} follow={}",
        node.id(),
        advertised.shm.as_deref().unwrap_or("-"),
        advertised.tcp.as_deref().unwrap_or("-"),
        spec.num_blocks,
        spec.block_len,
        args.fill,
        pool_config.follow.len()
    );
    // A closed stdout (the launcher went away) must not stop the node.
    let _ = std::io::stdout().flush();
    info!(id = %node.id(), "serving");
    let loopback = node.id().host_port().is_ok_and(|(h, _)| {
        // An IPv6 identity's host is bracketed (`[::1]`).
        let h = h.trim_start_matches('[').trim_end_matches(']');
        h == "localhost"
            || h.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    });
    if allow_all && !loopback {
        warn!(
            id = %node.id(),
            "no allowlist: any host that reaches this port can make the node dial an address of \
             its choice; set --allow (docs/configuration.md, Security)"
        );
    }

    if let Some(signal) = signals.forever().next() {
        info!(signal, "stopping on signal");
    }
    // The pool's threads first: they call the node (the metrics server holds the pool too).
    if let Some(pool) = pool {
        pool.shutdown();
    }
    node.shutdown(Duration::from_secs(3));
    0
}

/// Stores synthetic blocks 0..n, a batch per call. With a disk tier, memory full of blocks
/// waiting for the disk makes a batch wait (and be stored again: blocks already held are kept).
fn fill(node: &Node, n: u64) -> Result<(), String> {
    let len = usize::try_from(node.config().block_len).map_err(|e| e.to_string())?;
    let per_batch = (node.config().num_blocks / 4).clamp(1, 256);
    let mut i = 0;
    let mut waited_since: Option<std::time::Instant> = None;
    while i < n {
        let batch = (i..n.min(i + per_batch))
            .map(|k| {
                let key = synthetic::key(k);
                let bytes = synthetic::content(&key, len);
                (key, bytes)
            })
            .collect();
        match node.store(batch) {
            Ok(()) => {
                i = n.min(i + per_batch);
                waited_since = None;
            }
            Err(kvpeer::NodeError::Store(kvpeer_store::StoreError::Full { .. }))
                if node.config().disk.is_some()
                    && waited_since.is_none_or(|t| t.elapsed() < Duration::from_secs(60)) =>
            {
                waited_since.get_or_insert_with(std::time::Instant::now);
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(format!("filling blocks from {i}: {e}")),
        }
    }
    Ok(())
}
