//! The Prometheus endpoint: `GET /metrics` answers the node's [`NodeStats`] in the text
//! exposition format (version 0.0.4).
//!
//! One thread serves every connection over nonblocking sockets (one `poll`), so no client can
//! hold it: each connection must send its whole request head within [`HEAD_DEADLINE`] (however
//! steadily it drips bytes) and in at most [`MAX_HEAD`] bytes, and take its response within
//! [`WRITE_DEADLINE`]; at most [`MAX_CONNECTIONS`] are open, a newcomer evicting the oldest, so
//! a scraper is never refused because stalled clients came first (issue 19). A scrape is a few
//! kilobytes; stats are one call to the runtime thread. Written by hand: the format is a few
//! lines of text, and an HTTP framework would outweigh the node.

use std::fmt::Write as _;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::throttle::WarnThrottle;
use kvpeer_core::warn_throttled;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use tracing::debug;

use crate::api::{Histogram, Node, NodeStats};
use crate::pool_node::{PoolNode, PoolNodeStats};

/// Each tier's figures: memory (`tier="memory"`) and the disk tier (`tier="disk"`), so a
/// dashboard sums or compares them; then the disk tier's own counters.
fn disk_metrics(out: &mut String, d: &kvpeer_store::disk::DiskStats, memory_bytes: u64) {
    use std::fmt::Write;
    let _ = writeln!(
        out,
        "# HELP kvpeer_tier_bytes bytes of blocks each tier holds"
    );
    let _ = writeln!(out, "# TYPE kvpeer_tier_bytes gauge");
    let _ = writeln!(out, "kvpeer_tier_bytes{{tier=\"memory\"}} {memory_bytes}");
    let _ = writeln!(out, "kvpeer_tier_bytes{{tier=\"disk\"}} {}", d.used_bytes);
    let counters: [(&str, &str, u64); 9] = [
        (
            "kvpeer_disk_hits_total",
            "lookups of blocks held only on disk (a read started)",
            d.hits,
        ),
        (
            "kvpeer_disk_promotions_total",
            "blocks read back from disk into memory, checked",
            d.promotions,
        ),
        (
            "kvpeer_disk_demotions_total",
            "blocks written to disk",
            d.demotions,
        ),
        (
            "kvpeer_disk_demotions_skipped_total",
            "blocks left in memory only (no disk slot free, or a key too long)",
            d.demotions_skipped,
        ),
        (
            "kvpeer_disk_evictions_total",
            "blocks dropped from disk to make room",
            d.evictions,
        ),
        (
            "kvpeer_disk_corrupt_total",
            "blocks read back that failed their checksum or header (served as misses)",
            d.corrupt,
        ),
        (
            "kvpeer_disk_io_errors_total",
            "disk reads or writes that failed",
            d.io_errors,
        ),
        (
            "kvpeer_disk_read_bytes_total",
            "bytes read from the disk tier (header pages included)",
            d.bytes_read,
        ),
        (
            "kvpeer_disk_written_bytes_total",
            "bytes written to the disk tier (header pages included)",
            d.bytes_written,
        ),
    ];
    for (name, help, value) in counters {
        metric(out, name, help, "counter", value);
    }
    let gauges: [(&str, &str, u64); 4] = [
        (
            "kvpeer_disk_blocks",
            "blocks the disk tier can hold",
            d.capacity_blocks,
        ),
        ("kvpeer_disk_ready_blocks", "blocks on disk", d.ready_blocks),
        (
            "kvpeer_disk_recovered_blocks",
            "blocks found on disk when the node started",
            d.recovered_blocks,
        ),
        (
            "kvpeer_disk_queue_depth",
            "disk reads and writes in flight",
            d.queue_depth,
        ),
    ];
    for (name, help, value) in gauges {
        metric(out, name, help, "gauge", value);
    }
}

/// Renders `s` in the Prometheus text format.
pub fn render(s: &NodeStats) -> String {
    let mut out = String::new();
    let c = &s.counters;
    let counters: [(&str, &str, u64); 38] = [
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
            "kvpeer_pins_evicted_total",
            "pinned blocks released early from the heaviest holder: all peers' pins reached max_pinned_blocks",
            c.pins_evicted,
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
            "kvpeer_fetches_retired_unsent_total",
            "loads failed before their fetch left (it waited for the peer's ack)",
            c.fetches_retired_unsent,
        ),
        (
            "kvpeer_transfers_retained_total",
            "writes of ended sessions still running, their source blocks held until they stopped",
            c.transfers_retained,
        ),
        (
            "kvpeer_retained_force_released_total",
            "retained writes released at the hold cap while still running",
            c.retained_force_released,
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
            "kvpeer_sessions_evicted_total",
            "sessions ended to give their slot to a newcomer (sessions or a host's share full)",
            c.sessions_evicted,
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
        (
            "kvpeer_inbound_held_back_total",
            "rounds an inbound connection was held back for its host's time share while another host waited",
            s.inbound_held_back,
        ),
        (
            "kvpeer_host_probe_rounds_total",
            "probe rounds started: a connection to a host lost, or another rank of the engine said so",
            s.host_liveness.probe_rounds,
        ),
        (
            "kvpeer_host_probe_losses_total",
            "control connections ended because they answered no liveness probe after another connection to their host was lost",
            s.host_liveness.probe_losses,
        ),
        (
            "kvpeer_host_dials_refused_total",
            "connections refused at once because their host was taken for down",
            s.host_liveness.refused_dials,
        ),
        (
            "kvpeer_liveness_datagrams_refused_total",
            "datagrams on the liveness group's socket dropped (malformed, or from another user)",
            s.host_liveness.sibling_datagrams_refused,
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
    let gauges: [(&str, &str, u64); 12] = [
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
        (
            "kvpeer_fencing_blocks",
            "blocks of failed loads held until no write of their producer can land",
            s.core.fencing_blocks as u64,
        ),
        (
            "kvpeer_hosts_down",
            "hosts taken for down: a connection to each went unanswered and none answers since",
            s.host_liveness.hosts_down as u64,
        ),
    ];
    for (name, help, value) in gauges {
        metric(&mut out, name, help, "gauge", value);
    }
    if let Some(d) = s.store.disk {
        disk_metrics(&mut out, &d, s.store.ready * s.store.block_len);
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
pub fn render_pool(s: &PoolNodeStats) -> String {
    let mut out = String::new();
    let counters: [(&str, &str, u64); 24] = [
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
            "kvpeer_follow_replays_deferred_total",
            "KV event replays put off to the end of the interval since the last one",
            s.replays_deferred,
        ),
        (
            "kvpeer_follow_refused_publishers_total",
            "PUB connections a bound SUB closed at their accept: not from the followed engine's host",
            s.refused_publishers,
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
        (
            "kvpeer_events_published_described_total",
            "chunks the node published with their blocks, tokens and parent",
            s.published_described,
        ),
        (
            "kvpeer_follow_shard_others_total",
            "candidates not pulled: another pool node owns their prefix",
            s.shard_others,
        ),
        (
            "kvpeer_follow_shard_unknown_root_total",
            "candidates not pulled: their prefix's root chunk is not known",
            s.shard_unknown_root,
        ),
        (
            "kvpeer_follow_extra_key_blocks_total",
            "blocks announced with extra keys (LoRA, multimodal, cache salt): never described",
            s.extra_key_blocks,
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
        (
            "kvpeer_events_subscribers",
            "connections subscribed to the node's KV events",
            s.event_subscribers,
        ),
        (
            "kvpeer_catalog_blocks",
            "GPU blocks the pool keeps to describe chunks",
            s.catalog_blocks,
        ),
        (
            "kvpeer_catalog_chunks",
            "chunks the pool keeps (described or not)",
            s.catalog_chunks,
        ),
    ] {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
    }
    let name = "kvpeer_events_published_undescribed_total";
    let _ = writeln!(
        out,
        "# HELP {name} chunks published as placeholders (no tokens), by why\n# TYPE {name} counter"
    );
    for (reason, v) in ["unknown", "too_long", "inconsistent", "unconfirmed"]
        .iter()
        .zip(s.published_undescribed)
    {
        let _ = writeln!(out, "{name}{{reason=\"{reason}\"}} {v}");
    }
    out
}

// ---------------------------------------------------------------------------------------------
// The HTTP endpoint

/// Connections the endpoint keeps open at once. A newcomer past this evicts the oldest open
/// connection (it is not refused): a scraper that connects gets its turn however many stalled
/// clients came before it, and an honest scrape takes milliseconds, so it is never the oldest
/// for long.
pub const MAX_CONNECTIONS: usize = 32;

/// The whole request head (request line and headers) must arrive within this after the
/// connection is accepted, however slowly or steadily its bytes come; then it is closed.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(5);

/// The longest request head read: a longer one is answered `431` and closed.
pub const MAX_HEAD: usize = 8 * 1024;

/// The whole response must be taken by the client within this after its request; then the
/// connection is closed.
pub const WRITE_DEADLINE: Duration = Duration::from_secs(5);

/// Connections accepted per turn of the loop, so a flood of connects cannot keep the endpoint
/// from reading the ones it holds.
const ACCEPTS_PER_TURN: usize = 16;

/// After a failed accept (out of descriptors, most likely) the listener rests this long: the
/// connection still waiting would keep it readable and spin the loop.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(100);

/// The longest the loop sleeps without looking at its deadlines.
const MAX_WAIT: Duration = Duration::from_secs(1);

/// Why the endpoint closed a connection before (or instead of) a complete answer.
#[derive(Debug, thiserror::Error)]
enum Closed {
    #[error("request head not complete within {HEAD_DEADLINE:?}")]
    HeadDeadline,
    #[error("response not taken within {WRITE_DEADLINE:?}")]
    WriteDeadline,
    #[error("evicted: {MAX_CONNECTIONS} connections were open")]
    Evicted,
    #[error("the client closed before its request head was complete")]
    Eof,
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// How the endpoint has treated its clients (`kvpeer_metrics_*`).
#[derive(Debug, Default, Clone, Copy)]
struct EndpointStats {
    /// Connections closed at their head or write deadline.
    timed_out: u64,
    /// Connections evicted by a newcomer when [`MAX_CONNECTIONS`] were open.
    evicted: u64,
    /// Request heads over [`MAX_HEAD`].
    too_large: u64,
}

impl EndpointStats {
    fn render(&self) -> String {
        let mut out = String::new();
        for (name, help, value) in [
            (
                "kvpeer_metrics_timed_out_total",
                "metrics connections closed at their request or response deadline",
                self.timed_out,
            ),
            (
                "kvpeer_metrics_evicted_total",
                "metrics connections evicted by a newer one while the endpoint was full",
                self.evicted,
            ),
            (
                "kvpeer_metrics_oversized_total",
                "metrics requests whose head was over the limit",
                self.too_large,
            ),
        ] {
            metric(&mut out, name, help, "counter", value);
        }
        out
    }
}

enum State {
    /// Reading the request head: what came so far.
    Reading(Vec<u8>),
    /// Writing the response: its bytes and how many went.
    Writing(Vec<u8>, usize),
}

struct Conn {
    stream: TcpStream,
    accepted: Instant,
    /// When the current state must be over.
    deadline: Instant,
    state: State,
}

/// Where a request head ends (after its blank line; a bare-LF blank line is taken too), if it
/// has.
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n").map(|i| i + 4);
    let lf = buf.windows(2).position(|w| w == b"\n\n").map(|i| i + 2);
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// `GET /metrics` for `node` (and `pool`) over nonblocking sockets, on one thread: every
/// connection has a deadline for its request head and one for its response, heads are bounded,
/// and at most [`MAX_CONNECTIONS`] are open (a newcomer evicts the oldest).
struct Endpoint {
    listener: TcpListener,
    node: Arc<Node>,
    pool: Option<Arc<PoolNode>>,
    conns: Vec<Conn>,
    accept_paused_until: Option<Instant>,
    throttle: WarnThrottle,
    stats: EndpointStats,
}

impl Endpoint {
    fn run(mut self) {
        loop {
            let now = Instant::now();
            self.throttle.tick(now);
            self.expire(now);
            let ready = match self.wait(now) {
                Ok(ready) => ready,
                Err(e) => {
                    warn_throttled!(self.throttle, now, "the metrics endpoint's wait failed; retrying", error = %e);
                    std::thread::sleep(ACCEPT_BACKOFF);
                    continue;
                }
            };
            let now = Instant::now();
            // Connections first (newest last), then newcomers: a flood of connects cannot
            // starve the connections already held.
            let mut closed = Vec::new();
            for (i, ready) in ready.conns.iter().enumerate() {
                if *ready {
                    if let Err(e) = self.step(i) {
                        closed.push((i, e));
                    }
                }
            }
            for (i, why) in closed.into_iter().rev() {
                let c = self.conns.swap_remove(i);
                self.closing(&c, &why);
            }
            // Done writing: closed in `step` by marking them (see `finished`).
            self.conns.retain(|c| !finished(c));
            if ready.listener {
                self.accept(now);
            }
        }
    }

    /// Closes the connections past their deadline.
    fn expire(&mut self, now: Instant) {
        let mut i = 0;
        while i < self.conns.len() {
            if self.conns[i].deadline <= now {
                let c = self.conns.swap_remove(i);
                let why = match c.state {
                    State::Reading(_) => Closed::HeadDeadline,
                    State::Writing(..) => Closed::WriteDeadline,
                };
                self.stats.timed_out += 1;
                self.closing(&c, &why);
            } else {
                i += 1;
            }
        }
    }

    /// Waits until the listener or a connection is ready, or the next deadline.
    fn wait(&self, now: Instant) -> nix::Result<Ready> {
        let listening = self.accept_paused_until.is_none_or(|t| t <= now);
        let mut until = now + MAX_WAIT;
        if let Some(t) = self.accept_paused_until.filter(|t| *t > now) {
            until = until.min(t);
        }
        for c in &self.conns {
            until = until.min(c.deadline);
        }
        let mut fds: Vec<PollFd<'_>> = Vec::with_capacity(self.conns.len() + 1);
        fds.push(PollFd::new(
            self.listener.as_fd(),
            if listening {
                PollFlags::POLLIN
            } else {
                PollFlags::empty()
            },
        ));
        for c in &self.conns {
            let flags = match c.state {
                State::Reading(_) => PollFlags::POLLIN,
                State::Writing(..) => PollFlags::POLLOUT,
            };
            fds.push(PollFd::new(c.stream.as_fd(), flags));
        }
        let wait = until.saturating_duration_since(now);
        // Rounded up: a timeout rounded down to 0 ms would spin until the deadline.
        let ms = u16::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(u16::MAX);
        match poll(&mut fds, PollTimeout::from(ms)) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(e),
        }
        let is_ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        Ok(Ready {
            listener: listening && is_ready(&fds[0]),
            conns: fds[1..].iter().map(is_ready).collect(),
        })
    }

    /// Accepts what waits (a bounded number per turn), evicting the oldest connections to keep
    /// at most [`MAX_CONNECTIONS`].
    fn accept(&mut self, now: Instant) {
        for _ in 0..ACCEPTS_PER_TURN {
            let stream = match self.listener.accept() {
                Ok((stream, _)) => stream,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => {
                    warn_throttled!(self.throttle, now, "cannot accept a metrics connection; backing off", error = %e);
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    return;
                }
            };
            if let Err(e) = stream.set_nonblocking(true) {
                debug!(error = %e, "cannot make a metrics connection non-blocking");
                continue;
            }
            if self.conns.len() >= MAX_CONNECTIONS {
                if let Some(oldest) = (0..self.conns.len()).min_by_key(|i| self.conns[*i].accepted)
                {
                    let c = self.conns.swap_remove(oldest);
                    self.stats.evicted += 1;
                    warn_throttled!(self.throttle, now, "metrics endpoint full; evicting the oldest connection",
                        open = MAX_CONNECTIONS, peer = ?c.stream.peer_addr().ok());
                    self.closing(&c, &Closed::Evicted);
                }
            }
            self.conns.push(Conn {
                stream,
                accepted: now,
                deadline: now + HEAD_DEADLINE,
                state: State::Reading(Vec::new()),
            });
        }
    }

    /// Reads or writes what connection `i` is ready for; an error closes it.
    fn step(&mut self, i: usize) -> Result<(), Closed> {
        if let Some(head) = self.read_head(i)? {
            let response = match head {
                Head::Complete(head) => self.respond(&head),
                Head::TooLarge => {
                    self.stats.too_large += 1;
                    response(
                        "431 Request Header Fields Too Large",
                        &format!("request head over {MAX_HEAD} bytes\n"),
                    )
                }
            };
            let c = &mut self.conns[i];
            c.state = State::Writing(response, 0);
            c.deadline = Instant::now() + WRITE_DEADLINE;
        }
        let c = &mut self.conns[i];
        if let State::Writing(bytes, sent) = &mut c.state {
            while *sent < bytes.len() {
                match c.stream.write(&bytes[*sent..]) {
                    Ok(0) => return Err(Closed::Io(ErrorKind::WriteZero.into())),
                    Ok(n) => *sent += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e.into()),
                }
            }
        }
        Ok(())
    }

    /// Reads what connection `i` sent of its request head: the head once it is complete or
    /// over [`MAX_HEAD`], `None` while it is not (or the connection is writing already).
    fn read_head(&mut self, i: usize) -> Result<Option<Head>, Closed> {
        let c = &mut self.conns[i];
        let State::Reading(buf) = &mut c.state else {
            return Ok(None);
        };
        let mut chunk = [0u8; 4096];
        let mut eof = false;
        loop {
            // One byte over the bound tells a head that is too long from one that just fits.
            let room = (MAX_HEAD + 1).saturating_sub(buf.len()).min(chunk.len());
            if room == 0 || head_end(buf).is_some() {
                break;
            }
            match c.stream.read(&mut chunk[..room]) {
                Ok(0) if buf.is_empty() => return Err(Closed::Eof),
                Ok(0) => {
                    eof = true;
                    break;
                }
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) => return Err(e.into()),
            }
        }
        Ok(match head_end(buf) {
            Some(end) => Some(Head::Complete(
                String::from_utf8_lossy(&buf[..end]).into_owned(),
            )),
            None if buf.len() > MAX_HEAD => Some(Head::TooLarge),
            // A client that sent part of a head and closed its side is answered as it stands.
            None if eof => Some(Head::Complete(String::from_utf8_lossy(buf).into_owned())),
            None => None,
        })
    }

    /// The response to a request head: `/metrics`, `/healthz` (the node's runtime thread
    /// answers), `/readyz` (it answers and every followed engine's event stream is
    /// connected: the pool is allocated before the node starts). A query string is ignored.
    fn respond(&self, head: &str) -> Vec<u8> {
        let target = head.split_whitespace().nth(1).unwrap_or("");
        let path = target.split_once('?').map_or(target, |(p, _)| p);
        match (head.starts_with("GET "), path) {
            (true, "/metrics") => match self.node.stats() {
                Ok(s) => {
                    let mut body = render(&s);
                    if let Some(pool) = &self.pool {
                        body.push_str(&render_pool(&pool.stats()));
                    }
                    body.push_str(&self.stats.render());
                    body.push_str(&render_process());
                    response("200 OK", &body)
                }
                Err(e) => response("503 Service Unavailable", &format!("{e}\n")),
            },
            (true, "/healthz") => match self.node.stats() {
                Ok(_) => response("200 OK", "ok\n"),
                Err(e) => response("503 Service Unavailable", &format!("{e}\n")),
            },
            (true, "/readyz") => match self.node.stats() {
                Err(e) => response("503 Service Unavailable", &format!("{e}\n")),
                Ok(_) => match self.pool.as_ref().map(|p| p.stats()) {
                    Some(p) if p.connected < p.engines => response(
                        "503 Service Unavailable",
                        &format!(
                            "not ready: {} of {} followed engines' event streams connected\n",
                            p.connected, p.engines
                        ),
                    ),
                    _ => response("200 OK", "ready\n"),
                },
            },
            (true, _) => response("404 Not Found", "try /metrics, /healthz or /readyz\n"),
            _ => response("405 Method Not Allowed", "GET only\n"),
        }
    }

    fn closing(&self, c: &Conn, why: &Closed) {
        debug!(peer = ?c.stream.peer_addr().ok(), reason = %why, "closing a metrics connection");
    }
}

/// A request head read to its end, or one too long to read.
enum Head {
    Complete(String),
    TooLarge,
}

/// Which sockets `poll` said are ready.
struct Ready {
    listener: bool,
    conns: Vec<bool>,
}

/// Whether `c` has written all of its response (then it is closed).
fn finished(c: &Conn) -> bool {
    matches!(&c.state, State::Writing(bytes, sent) if *sent >= bytes.len())
}

/// The build and the process: `kvpeer_build_info` (1, labelled with the version and the vLLM
/// releases it speaks with) and the usual `process_*` series, read from `/proc/self`.
pub fn render_process() -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "# HELP kvpeer_build_info the kvpeer build (always 1)\n# TYPE kvpeer_build_info gauge\n\
         kvpeer_build_info{{version=\"{}\",vllm=\"{}\"}} 1",
        env!("CARGO_PKG_VERSION"),
        crate::SUPPORTED_VLLM
    );
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command's closing parenthesis (the command may hold spaces): utime and
    // stime are the 12th and 13th, starttime the 20th, rss the 22nd (in pages).
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .map_or(Vec::new(), |(_, rest)| rest.split_whitespace().collect());
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    let ticks = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .unwrap_or(100) as f64;
    let page = nix::unistd::sysconf(nix::unistd::SysconfVar::PAGE_SIZE)
        .ok()
        .flatten()
        .filter(|p| *p > 0)
        .unwrap_or(4096) as u64;
    if let (Some(user), Some(system)) = (field(11), field(12)) {
        let _ = writeln!(
            out,
            "# HELP process_cpu_seconds_total CPU time of the process, user and system\n\
             # TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total {}",
            (user + system) as f64 / ticks
        );
    }
    if let Some(rss) = field(21) {
        let _ = writeln!(
            out,
            "# HELP process_resident_memory_bytes resident memory of the process\n\
             # TYPE process_resident_memory_bytes gauge\nprocess_resident_memory_bytes {}",
            rss * page
        );
    }
    let boot = std::fs::read_to_string("/proc/stat").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("btime "))
            .and_then(|v| v.trim().parse::<u64>().ok())
    });
    if let (Some(boot), Some(start)) = (boot, field(19)) {
        let _ = writeln!(
            out,
            "# HELP process_start_time_seconds when the process started, seconds since the epoch\n\
             # TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}",
            boot as f64 + start as f64 / ticks
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        let _ = writeln!(
            out,
            "# HELP process_open_fds open file descriptors\n# TYPE process_open_fds gauge\n\
             process_open_fds {}",
            fds.count()
        );
    }
    out
}

fn response(status: &str, body: &str) -> Vec<u8> {
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
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
    pool: Option<Arc<PoolNode>>,
) -> std::io::Result<SocketAddr> {
    let listener = TcpListener::bind(addr)?;
    let bound = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let endpoint = Endpoint {
        listener,
        node,
        pool,
        conns: Vec::with_capacity(MAX_CONNECTIONS),
        accept_paused_until: None,
        throttle: WarnThrottle::default(),
        stats: EndpointStats::default(),
    };
    std::thread::Builder::new()
        .name("kvpeer-metrics".into())
        .spawn(move || endpoint.run())?;
    Ok(bound)
}
