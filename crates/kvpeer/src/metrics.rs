//! The Prometheus endpoint: `GET /metrics` answers the node's [`NodeStats`] in the text
//! exposition format (version 0.0.4).
//!
//! One thread accepts connections and answers each in turn: a scrape is a few kilobytes, and a
//! slow or silent client is cut off by its 2 s read and write timeouts, so it can delay the
//! next scrape but never the node (stats are one call to the runtime thread). Written by hand:
//! the format is a few lines of text, and an HTTP framework would outweigh the node.

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use tracing::{debug, warn};

use crate::api::{Histogram, Node, NodeStats};
use crate::pool::{Pool, PoolStats};

/// Renders `s` in the Prometheus text format.
pub fn render(s: &NodeStats) -> String {
    let mut out = String::new();
    let c = &s.counters;
    let counters: [(&str, &str, u64); 28] = [
        (
            "kvpeer_lookups_sent_total",
            "lookup messages sent to peers",
            c.lookups_sent,
        ),
        (
            "kvpeer_lookup_keys_sent_total",
            "keys looked up at peers",
            c.lookup_keys_sent,
        ),
        (
            "kvpeer_lookup_hits_total",
            "keys peers answered held",
            c.lookup_hits_received,
        ),
        (
            "kvpeer_lookup_misses_total",
            "keys peers answered not held",
            c.lookup_misses_received,
        ),
        (
            "kvpeer_lookups_served_total",
            "lookups answered for peers",
            c.lookups_served,
        ),
        (
            "kvpeer_lookup_hits_served_total",
            "keys answered held to peers",
            c.lookup_hits_served,
        ),
        (
            "kvpeer_lookup_misses_served_total",
            "keys answered not held to peers",
            c.lookup_misses_served,
        ),
        (
            "kvpeer_pending_expired_total",
            "pending keys answered MISS at their deadline",
            c.pending_expired,
        ),
        (
            "kvpeer_lookup_keys_over_cap_total",
            "keys past max_lookup_keys of a peer's lookup, answered MISS unasked",
            c.lookup_keys_over_cap,
        ),
        (
            "kvpeer_lookup_keys_over_share_total",
            "keys answered MISS because their peer's pin share was full",
            c.lookup_keys_over_share,
        ),
        (
            "kvpeer_lookups_over_budget_total",
            "lookups answered MISS at once: their peer held its share of keys, bytes or requests",
            c.lookups_over_budget,
        ),
        (
            "kvpeer_fetches_over_budget_total",
            "fetches failed at once: their peer held its share of keys, bytes or requests",
            c.fetches_over_budget,
        ),
        (
            "kvpeer_lookup_slices_deferred_total",
            "times a peer's lookups waited for a later step (slice done or keys-per-second budget spent)",
            c.lookup_slices_deferred,
        ),
        (
            "kvpeer_lookup_keys_unasked_total",
            "keys never asked because their lookup's pending deadline passed first",
            c.lookup_keys_unasked,
        ),
        (
            "kvpeer_fetches_sent_total",
            "fetches sent to peers",
            c.fetches_sent,
        ),
        (
            "kvpeer_fetch_blocks_sent_total",
            "blocks asked of peers",
            c.fetch_blocks_sent,
        ),
        (
            "kvpeer_fetches_served_total",
            "fetches served for peers",
            c.fetches_served,
        ),
        (
            "kvpeer_fetch_blocks_served_total",
            "blocks peers asked of this node",
            c.fetch_blocks_served,
        ),
        (
            "kvpeer_transfers_ok_total",
            "rounds written to peers",
            c.transfers_ok,
        ),
        (
            "kvpeer_transfers_failed_total",
            "rounds that failed to reach peers",
            c.transfers_failed,
        ),
        (
            "kvpeer_loads_ok_total",
            "loads that landed completely",
            c.loads_ok,
        ),
        (
            "kvpeer_loads_failed_total",
            "loads that failed or were aborted",
            c.loads_failed,
        ),
        (
            "kvpeer_aborts_sent_total",
            "abort_fetch messages sent",
            c.aborts_sent,
        ),
        (
            "kvpeer_abort_acks_total",
            "abort_acks that settled an aborted load",
            c.abort_acks,
        ),
        (
            "kvpeer_sessions_opened_total",
            "sessions opened",
            c.sessions_opened,
        ),
        (
            "kvpeer_sessions_closed_total",
            "sessions ended",
            c.sessions_closed,
        ),
        (
            "kvpeer_protocol_errors_total",
            "peers disconnected for protocol errors",
            c.protocol_errors,
        ),
        (
            "kvpeer_refused_peers_total",
            "peers refused by the allowlist",
            s.refused_peers,
        ),
    ];
    for (name, help, value) in counters {
        metric(&mut out, name, help, "counter", value);
    }
    metric(
        &mut out,
        "kvpeer_bytes_fetched_total",
        "bytes of blocks fetched into this node",
        "counter",
        s.bytes_fetched,
    );
    metric(
        &mut out,
        "kvpeer_bytes_served_total",
        "bytes of blocks peers asked of this node",
        "counter",
        c.fetch_blocks_served * s.store.block_len,
    );
    let gauges: [(&str, &str, u64); 10] = [
        ("kvpeer_sessions", "live sessions", s.core.sessions as u64),
        (
            "kvpeer_client_requests",
            "requests this node is fetching for (open consumer state)",
            s.core.client_requests as u64,
        ),
        (
            "kvpeer_server_requests",
            "requests peers are fetching from this node (open producer state)",
            s.core.server_requests as u64,
        ),
        (
            "kvpeer_inflight_transfers",
            "data-plane transfers in flight",
            s.core.inflight as u64,
        ),
        (
            "kvpeer_store_jobs",
            "pins held for peers (store jobs)",
            s.core.store_jobs as u64,
        ),
        ("kvpeer_pool_blocks", "blocks in the pool", s.store.capacity),
        ("kvpeer_pool_ready_blocks", "readable blocks", s.store.ready),
        (
            "kvpeer_pool_writing_blocks",
            "blocks a load is landing in",
            s.store.writing,
        ),
        (
            "kvpeer_pool_pinned_blocks",
            "blocks pinned for peers",
            s.store.pinned,
        ),
        ("kvpeer_pool_free_blocks", "unused blocks", s.store.free),
    ];
    for (name, help, value) in gauges {
        metric(&mut out, name, help, "gauge", value);
    }
    histogram(
        &mut out,
        "kvpeer_lookup_seconds",
        "lookup calls until every key was answered",
        &s.lookup_latency,
    );
    histogram(
        &mut out,
        "kvpeer_fetch_seconds",
        "fetch calls until the blocks landed or the load failed",
        &s.fetch_latency,
    );
    out
}

fn metric(out: &mut String, name: &str, help: &str, kind: &str, value: u64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    let mut cumulative = 0;
    for (bound, count) in Histogram::BOUNDS_US.iter().zip(h.counts) {
        cumulative += count;
        let le = *bound as f64 / 1e6;
        let _ = writeln!(out, "{name}_bucket{{le=\"{le}\"}} {cumulative}");
    }
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.total());
    let _ = writeln!(out, "{name}_sum {}", h.sum_seconds);
    let _ = writeln!(out, "{name}_count {}", h.total());
}

/// Renders the pool node's counters (`kvpeer_pool_*`) in the Prometheus text format.
pub fn render_pool(s: &PoolStats) -> String {
    let mut out = String::new();
    let counters: [(&str, &str, u64); 18] = [
        (
            "kvpeer_follow_event_batches_total",
            "KV event batches applied",
            s.batches,
        ),
        ("kvpeer_follow_events_total", "KV events read", s.events),
        (
            "kvpeer_follow_malformed_total",
            "KV event batches and events that did not decode",
            s.malformed,
        ),
        (
            "kvpeer_follow_gaps_total",
            "gaps in KV event sequence numbers",
            s.gaps,
        ),
        (
            "kvpeer_follow_restarts_total",
            "KV event publisher restarts seen",
            s.restarts,
        ),
        (
            "kvpeer_follow_lost_batches_total",
            "KV event batches no replay recovered",
            s.lost_batches,
        ),
        (
            "kvpeer_follow_replays_total",
            "KV event replays asked for",
            s.replays,
        ),
        (
            "kvpeer_follow_int_hash_events_total",
            "KV events with int hashes (no key)",
            s.int_hashes,
        ),
        (
            "kvpeer_follow_candidates_total",
            "pull candidates handed to the pullers",
            s.candidates,
        ),
        (
            "kvpeer_follow_candidates_dropped_total",
            "pull candidates dropped (a puller's queue was full)",
            s.candidates_dropped,
        ),
        (
            "kvpeer_follow_already_held_total",
            "pull candidates the node held already",
            s.already_held,
        ),
        (
            "kvpeer_follow_pull_requests_total",
            "pull requests made to engines",
            s.pull_requests,
        ),
        (
            "kvpeer_follow_pulled_blocks_total",
            "blocks pulled from engines",
            s.pulled_blocks,
        ),
        (
            "kvpeer_follow_pulled_bytes_total",
            "bytes pulled from engines",
            s.pulled_bytes,
        ),
        (
            "kvpeer_follow_pull_failures_total",
            "keys whose pull failed or missed",
            s.pull_failures,
        ),
        (
            "kvpeer_events_published_total",
            "KV event batches the node published",
            s.published_batches,
        ),
        (
            "kvpeer_events_publish_dropped_total",
            "store changes dropped before publishing",
            s.publish_dropped,
        ),
        ("kvpeer_follow_engines", "engines followed", s.engines),
    ];
    for (name, help, v) in counters {
        let kind = if name.ends_with("_total") {
            "counter"
        } else {
            "gauge"
        };
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
        );
    }
    for (name, help, v) in [
        (
            "kvpeer_follow_connected_engines",
            "followed engines whose event stream is connected",
            s.connected,
        ),
        (
            "kvpeer_follow_indexed_keys",
            "keys the pool's index holds",
            s.indexed_keys,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    out
}

/// Serves `GET /metrics` for `node` at `addr` (port 0 picks one) on a thread of its own, until
/// the process ends. Returns the bound address.
pub fn serve(addr: &str, node: Arc<Node>) -> std::io::Result<SocketAddr> {
    serve_with_pool(addr, node, None)
}

/// [`serve`], plus the pool node's counters (`kvpeer_pool_*`) when there is a pool.
pub fn serve_with_pool(
    addr: &str,
    node: Arc<Node>,
    pool: Option<Arc<Pool>>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    std::thread::Builder::new()
        .name("kvpeer-metrics".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(stream) => {
                        if let Err(e) = answer(stream, &node, pool.as_deref()) {
                            debug!(error = %e, "metrics request failed");
                        }
                    }
                    Err(e) => warn!(error = %e, "metrics accept failed"),
                }
            }
        })?;
    Ok(bound)
}

fn answer(mut stream: TcpStream, node: &Node, pool: Option<&Pool>) -> std::io::Result<()> {
    stream.set_read_timeout(Some(Duration::from_secs(2)))?;
    stream.set_write_timeout(Some(Duration::from_secs(2)))?;
    // The request line and headers, bounded: nothing else of the request matters.
    let mut buf = [0u8; 4096];
    let mut len = 0;
    while len < buf.len() && !buf[..len].windows(4).any(|w| w == b"\r\n\r\n") {
        let n = stream.read(&mut buf[len..])?;
        if n == 0 {
            break;
        }
        len += n;
    }
    let request = String::from_utf8_lossy(&buf[..len]);
    let path = request.split_whitespace().nth(1).unwrap_or("");
    let (status, body) = match (request.starts_with("GET "), path) {
        (true, "/metrics") => match node.stats() {
            Ok(s) => {
                let mut body = render(&s);
                if let Some(pool) = pool {
                    body.push_str(&render_pool(&pool.stats()));
                }
                ("200 OK", body)
            }
            Err(e) => ("503 Service Unavailable", format!("{e}\n")),
        },
        (true, _) => ("404 Not Found", "try /metrics\n".to_owned()),
        _ => ("405 Method Not Allowed", "GET only\n".to_owned()),
    };
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}
