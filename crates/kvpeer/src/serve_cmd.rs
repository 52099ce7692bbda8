//! `kvpeer serve`: runs a node with a block pool until SIGINT or SIGTERM, serving its blocks to
//! every peer that asks. `--fill N` first stores synthetic blocks 0..N (docs/synthetic-workload.md).
//!
//! Once listening it prints one line to stdout, `kvpeer serve: ready id=HOST:PORT ...`, so scripts
//! and tests know where to connect. The node runs on the main thread; signals write to its wake
//! pipe, so it sleeps until there is work and stops promptly.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer::node::build::{build, BuildPlane, NodeSpec};
use kvpeer::synthetic;
use kvpeer_net::metadata::AgentMetadata;
use signal_hook::consts::{SIGINT, SIGTERM};
use tracing::{error, info, warn};

use crate::node_args::{with_plane, NodeArgs};

/// `kvpeer serve` options.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    #[command(flatten)]
    node: NodeArgs,
    /// Store synthetic blocks 0..N before serving.
    #[arg(long, default_value_t = 0)]
    fill: u64,
}

/// Runs the command; returns the exit status.
pub(crate) fn run(args: ServeArgs) -> u8 {
    let config = match args.node.resolve("serve") {
        Ok(c) => c,
        Err(e) => {
            eprintln!("kvpeer serve: {e}");
            return 2;
        }
    };
    if args.fill > config.spec.num_blocks {
        eprintln!(
            "kvpeer serve: --fill {} is more than the pool's {} blocks",
            args.fill, config.spec.num_blocks
        );
        return 2;
    }
    let result = with_plane!(config.plane, P => serve::<P>(&args, &config.spec));
    match result {
        Ok(()) => 0,
        Err(e) => {
            error!(error = %e, "serve failed");
            eprintln!("kvpeer serve: {e}");
            1
        }
    }
}

fn serve<P: BuildPlane>(args: &ServeArgs, spec: &NodeSpec) -> Result<(), String> {
    let mut node = build::<P>(spec).map_err(|e| e.to_string())?;
    let block_len = usize::try_from(spec.block_len).map_err(|e| e.to_string())?;
    for i in 0..args.fill {
        let key = synthetic::key(i);
        node.core
            .parent_mut()
            .put(&key, &synthetic::content(&key, block_len))
            .map_err(|e| format!("filling block {i}: {e}"))?;
    }

    let stop = Arc::new(AtomicBool::new(false));
    for signal in [SIGINT, SIGTERM] {
        signal_hook::flag::register(signal, stop.clone()).map_err(|e| e.to_string())?;
        if let Some(writer) = node.wake_writer() {
            let writer = writer.map_err(|e| e.to_string())?;
            signal_hook::low_level::pipe::register(signal, writer).map_err(|e| e.to_string())?;
        }
    }

    let local = node.core.local();
    let meta = AgentMetadata::decode(&local.agent_metadata).unwrap_or_default();
    println!(
        "kvpeer serve: ready id={} shm={} tcp={} blocks={} block_len={} filled={}",
        local.peer_id,
        meta.shm.as_deref().unwrap_or("-"),
        meta.tcp.as_deref().unwrap_or("-"),
        local.num_blocks,
        local.block_len,
        args.fill
    );
    // A closed stdout (the launcher went away) must not stop the node.
    let _ = std::io::stdout().flush();
    info!(id = %local.peer_id, "serving");
    let loopback = local.peer_id.host_port().is_ok_and(|(h, _)| {
        h == "localhost"
            || h.parse::<std::net::IpAddr>()
                .is_ok_and(|ip| ip.is_loopback())
    });
    if spec.allowlist.allows_all() && !loopback {
        warn!(
            id = %local.peer_id,
            "no allowlist: any host that reaches this port can make the node dial an address of \
             its choice; set --allow (docs/configuration.md, Security)"
        );
    }

    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        node.step(now);
        // A server has no loads of its own; nothing waits for these results.
        node.results.clear();
        node.wait(now, Duration::from_secs(3600));
    }
    let stats = node.core.stats();
    info!(sessions = stats.sessions, "stopping on signal");
    Ok(())
}
