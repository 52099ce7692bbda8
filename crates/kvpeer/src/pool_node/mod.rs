//! The pool node (issue 15; docs/pool.md): a node that learns what engines hold from the KV
//! events they publish, pulls the blocks worth keeping over P2P (a stock P2P consumer of each
//! engine), serves them to any engine (as every node does), and publishes its own KV events.
//!
//! **Threads and their contract.** [`PoolNode::start`] starts, beside the node's runtime thread:
//!
//! * the **pool thread**, which owns one `EventSubscriber` + `Follower` per followed engine,
//!   the `Holdings` index, and the `EventPublisher` if one is configured. It sleeps in one
//!   `events::wait_all` over every socket, at most [`TICK`] at a time; feeds each follower
//!   what its subscriber brought; carries out the replays the followers ask for; hands pull
//!   candidates to the engine's puller over a bounded channel (full: dropped and counted, the
//!   key offered again by the next engine that announces it); and every [`TICK`] takes the
//!   store's change log (one call to the runtime thread, `Node::take_store_changes`),
//!   publishes it and answers replay requests.
//! * one **puller thread per followed engine**, which takes candidates in groups of up to
//!   [`PULL_BATCH`] keys (a quarter of the pool at most), drops the keys the node holds
//!   already (`Node::contains`), and pulls the rest as a stock consumer of that engine:
//!   `request`, `lookup`, `fetch` of the leading hits, `finish`. Two token buckets bound it:
//!   lookups per second to this engine (`pull_max_lookups`) and bytes per second for all
//!   engines together (`pull_max_rate`). A failed or missed key goes back to the pool thread
//!   (`Holdings::pull_failed`) over a bounded channel. Each wait is the Node API's (its lookup
//!   and load timeouts), so a dead engine costs only its own puller's time.
//!
//! **Who is heard.** Every batch and sequence number of a followed stream is its sender's word,
//! so a SUB that binds (`bind:` in `--follow`) accepts PUB connections only from the followed
//! engine's host (the host of its P2P identity, resolved once at start if it is a name): a PUB
//! from anywhere else is closed at its accept and sent nothing. What the engine's stream says
//! can still make the follower want replays: it asks at most one per engine per
//! `FollowerLimits::min_replay_interval`. Each engine's candidates go to its own puller's
//! queue, and the index forgets the oldest keys of the engine that brought the most in, so one
//! engine's junk cannot push another's candidates out.
//!
//! Nothing here blocks the node's runtime thread: every call to it is a message with a bounded
//! wait. Everything is bounded: the channels, the index (`Holdings`), the followers' held
//! batches, the publisher's replay buffer, the store's change log between two ticks.

mod catalog_file;
mod puller;

use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use kvpeer_net::events::{
    self, EventIo, EventPublisher, EventSubscriber, EventsError, PublisherConfig, SubEndpoint,
    SubEvent, SubscriberConfig,
};
use kvpeer_pool::{
    Admission, CatalogStats, EngineSlot, FollowAction, Follower, FollowerLimits, Holdings,
    Publisher, PublisherStats, StoreChange,
};
use kvpeer_proto::{is_peer_ip, Host, OffloadKey, PeerAddr, PeerId};
use kvpeer_store::KeyChange;
use tracing::{info, warn};

pub use crate::config::{FollowSpec, PoolConfig};

use crate::api::Node;

/// The pool thread's longest sleep, and how often it publishes the store's changes.
pub const TICK: Duration = Duration::from_millis(50);
/// Most keys one pull request looks up.
pub const PULL_BATCH: usize = 64;
/// Candidates waiting for each engine's puller; more are dropped (and counted).
const PULL_QUEUE: usize = 4096;
/// Failed keys waiting for the pool thread; more are dropped (the key is then offered only
/// when its engine announces it again after a restart).
const FAILED_QUEUE: usize = 4096;
/// Keys the index holds, all engines together.
const MAX_KEYS: usize = 1 << 20;
/// Store changes kept between two ticks (older are dropped and counted).
const MAX_CHANGES: usize = 1 << 16;
/// Batches the node's own publisher keeps for replays (vLLM's buffer).
const REPLAY_BUFFER: usize = 10_000;

/// Why the pool could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PoolNodeError {
    /// A KV event socket could not be set up.
    #[error(transparent)]
    Events(#[from] EventsError),
    /// An engine slot was out of range (more engines than a pool node follows).
    #[error("a pool node follows at most {} engines", EngineSlot::MAX)]
    TooManyEngines,
    /// The pool keeps tenants apart and a followed engine is no one tenant's (no rule of
    /// `tenants` names it, or two tenants' rules do): its blocks would be nobody's.
    #[error(
        "followed engine {0} is no one tenant's: name it in exactly one tenant's rules (tenants)"
    )]
    EngineOfNoTenant(PeerId),
    /// A thread could not be started.
    #[error("cannot start the pool's threads: {0}")]
    Thread(#[source] std::io::Error),
    /// A followed engine's host could not be made addresses (a SUB that binds accepts only
    /// those).
    #[error("cannot tell which addresses engine {peer} publishes from: {detail}")]
    EngineHost {
        /// The engine's P2P identity.
        peer: String,
        /// Why.
        detail: String,
    },
    /// `shard` lists the pool nodes splitting the key space, and this node is not among them.
    #[error("pool_shard lists {members:?} but not this node ({me}): every member lists all, itself included")]
    NotInShard {
        /// This node's identity.
        me: String,
        /// The list.
        members: Vec<String>,
    },
}

/// What the pool did so far (counters since start, and a few gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolNodeStats {
    /// Engines followed.
    pub engines: u64,
    /// Followed engines whose event stream is connected (gauge).
    pub connected: u64,
    /// Event batches applied.
    pub batches: u64,
    /// Events read.
    pub events: u64,
    /// Batches and events that did not decode (dropped; the stream goes on).
    pub malformed: u64,
    /// Gaps in sequence numbers seen.
    pub gaps: u64,
    /// Publisher restarts seen (what that engine held is forgotten).
    pub restarts: u64,
    /// Batches no replay could recover.
    pub lost_batches: u64,
    /// Replays asked for.
    pub replays: u64,
    /// Replays wanted sooner than the interval allows, put off to its end.
    pub replays_deferred: u64,
    /// PUB connections a bound SUB closed at their accept (not from the engine's host).
    pub refused_publishers: u64,
    /// Events with int hashes (no key can be formed).
    pub int_hashes: u64,
    /// Keys the index holds (gauge).
    pub indexed_keys: u64,
    /// Pull candidates handed to the pullers.
    pub candidates: u64,
    /// Candidates dropped because a puller's queue was full.
    pub candidates_dropped: u64,
    /// Candidates the node held already (not pulled).
    pub already_held: u64,
    /// Pull requests made (one lookup, at most one fetch).
    pub pull_requests: u64,
    /// Blocks pulled.
    pub pulled_blocks: u64,
    /// Bytes pulled.
    pub pulled_bytes: u64,
    /// Keys whose pull failed or missed.
    pub pull_failures: u64,
    /// Event batches the node published.
    pub published_batches: u64,
    /// Store changes dropped before they could be published (the log overflowed).
    pub publish_dropped: u64,
    /// Stores the node published with the chunk's blocks, tokens and parent.
    pub published_described: u64,
    /// Stores it published as placeholders, nothing having described the chunk (`Unknown`:
    /// its blocks were never announced with tokens; `TooLong`; `Inconsistent`; `Unconfirmed`:
    /// see `kvpeer_pool::Undescribed`).
    pub published_undescribed: [u64; 4],
    /// GPU blocks the catalog keeps (gauge).
    pub catalog_blocks: u64,
    /// Chunks the catalog keeps (gauge).
    pub catalog_chunks: u64,
    /// Blocks announced with extra keys (LoRA, multimodal, cache salt): not describable.
    pub extra_key_blocks: u64,
    /// Connections subscribed to the node's events (gauge).
    pub event_subscribers: u64,
    /// Candidates not pulled because another pool node owns their prefix (`shard`).
    pub shard_others: u64,
    /// Candidates not pulled because their prefix's root is not known (`shard`: a chunk whose
    /// ancestors were not all described); offered again when an engine announces them again.
    pub shard_unknown_root: u64,
}

/// What the threads count together.
#[derive(Debug, Default)]
struct Shared {
    /// The pool thread's part, replaced each tick.
    followed: Mutex<PoolNodeStats>,
    candidates: AtomicU64,
    candidates_dropped: AtomicU64,
    already_held: AtomicU64,
    pull_requests: AtomicU64,
    pulled_blocks: AtomicU64,
    pulled_bytes: AtomicU64,
    pull_failures: AtomicU64,
}

/// A running pool: its threads, until [`PoolNode::shutdown`] (or drop).
#[derive(Debug)]
pub struct PoolNode {
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    /// Taken by the first shutdown: a pool shared with a metrics server (an `Arc`) is still
    /// stopped before its node is.
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A pull candidate on its way to the engine's puller.
#[derive(Debug)]
struct PullJob {
    key: OffloadKey,
}

impl PoolNode {
    /// Starts the pool thread and a puller per followed engine for `node`.
    pub fn start(node: Arc<Node>, config: &PoolConfig) -> Result<PoolNode, PoolNodeError> {
        // Before any thread starts: a followed engine of no one tenant stops the start here.
        let groups = tenant_groups(&node, config)?;
        // This node among the members, however the list spells its address.
        let me = kvpeer_pool::shard::canonical(node.id().as_str());
        let shard = match config
            .shard
            .iter()
            .position(|m| kvpeer_pool::shard::canonical(m.as_str()) == me)
        {
            _ if config.shard.is_empty() => None,
            Some(me) => Some(Shard {
                members: config.shard.iter().map(|m| m.as_str().to_owned()).collect(),
                me,
            }),
            None => {
                return Err(PoolNodeError::NotInShard {
                    me: node.id().as_str().to_owned(),
                    members: config.shard.iter().map(|m| m.as_str().to_owned()).collect(),
                })
            }
        };
        // Until the pool thread's first tick, its followed engines count as followed and not
        // connected: `/readyz` must not call a pool that has not tried yet ready.
        let shared = Arc::new(Shared {
            followed: Mutex::new(PoolNodeStats {
                engines: config.follow.len() as u64,
                ..PoolNodeStats::default()
            }),
            ..Shared::default()
        });
        let stop = Arc::new(AtomicBool::new(false));
        let (failed_tx, failed_rx) = sync_channel::<(OffloadKey, EngineSlot)>(FAILED_QUEUE);
        let bytes = Arc::new(Mutex::new(puller::Bucket::new(config.max_rate)));
        let mut engines = Vec::new();
        let mut threads = Vec::new();
        for (i, spec) in config.follow.iter().enumerate() {
            let slot = EngineSlot::new(i).ok_or(PoolNodeError::TooManyEngines)?;
            let mut sub_config = SubscriberConfig::new(spec.events);
            sub_config.replay = spec.replay;
            if let SubEndpoint::Bind(_) = spec.events {
                let from = engine_addrs(&spec.peer)?;
                info!(engine = i, publishers = ?from, "the bound SUB accepts PUB connections only from the engine's host");
                sub_config.allowed_publishers = Some(from);
            }
            let subscriber = EventSubscriber::new(sub_config)?;
            let follower = Follower::new(slot, FollowerLimits::default(), spec.replay.is_some());
            let (tx, rx) = sync_channel::<PullJob>(PULL_QUEUE);
            let puller = puller::Puller {
                node: node.clone(),
                peer: spec.peer.clone(),
                slot,
                lookups: puller::Bucket::new(Some(config.max_lookups)),
                bytes: bytes.clone(),
                failed: failed_tx.clone(),
                shared: shared.clone(),
                stop: stop.clone(),
            };
            threads.push(spawn(&format!("kvpeer-pull-{i}"), move || {
                puller.run(&rx);
            })?);
            info!(engine = i, events = ?spec.events, replay = ?spec.replay, peer = %spec.peer, "following");
            engines.push(Engine {
                subscriber,
                follower,
                pulls: tx,
                events: spec.events,
                since: Instant::now(),
                heard: false,
                warned_silent: false,
            });
        }
        let publishing = match config.publish {
            Some(bind) => {
                let mut pub_config = PublisherConfig::new(bind);
                pub_config.replay_bind = config.publish_replay;
                pub_config.max_subscribers = config.max_event_subscribers;
                pub_config.max_replay_clients = config.max_event_replay_clients;
                pub_config.max_per_source = config.max_event_per_source;
                let socket = EventPublisher::bind(pub_config)?;
                info!(events = ?socket.local_addr().ok(), replay = ?socket.replay_addr(), "publishing KV events");
                // Recording starts now: what the store held before is not announced.
                let _ = node.take_store_changes(MAX_CHANGES);
                let mut publisher = Publisher::new(&config.topic, REPLAY_BUFFER);
                publisher.set_hash_form(config.hash_form);
                publisher.set_ownership(config.ownership.clone());
                Some((socket, publisher))
            }
            None => None,
        };
        let mut thread = PoolThread {
            node,
            engines,
            holdings: Holdings::new(
                MAX_KEYS,
                Admission {
                    min_holders: config.min_holders,
                },
            ),
            publishing,
            shard,
            shard_counts: ShardCounts::default(),
            failed: failed_rx,
            shared: shared.clone(),
            stop: stop.clone(),
            published: 0,
            publish_dropped: 0,
            catalog_file: None,
        };
        thread.holdings.set_groups(&groups);
        if let Some(disk) = &thread.node.config().disk {
            thread.catalog_file = load_catalog(&disk.dir, thread.holdings.catalog_mut());
        }
        threads.push(spawn("kvpeer-pool", move || thread.run())?);
        Ok(PoolNode {
            shared,
            stop,
            threads: Mutex::new(threads),
        })
    }

    /// What the pool did so far.
    pub fn stats(&self) -> PoolNodeStats {
        let s = &self.shared;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let followed = s.followed.lock().map(|f| *f).unwrap_or_default();
        PoolNodeStats {
            candidates: load(&s.candidates),
            candidates_dropped: load(&s.candidates_dropped),
            already_held: load(&s.already_held),
            pull_requests: load(&s.pull_requests),
            pulled_blocks: load(&s.pulled_blocks),
            pulled_bytes: load(&s.pulled_bytes),
            pull_failures: load(&s.pull_failures),
            ..followed
        }
    }

    /// Stops the threads and waits for them (a puller finishes the request it is in, within
    /// the node's timeouts). Call it before the node's shutdown, from any holder of the pool:
    /// a pool thread left running calls a node that is gone. Later calls do nothing.
    pub fn shutdown(&self) {
        self.stop.store(true, Ordering::Relaxed);
        let threads = match self.threads.lock() {
            Ok(mut t) => std::mem::take(&mut *t),
            Err(poisoned) => std::mem::take(&mut *poisoned.into_inner()),
        };
        for t in threads {
            let _ = t.join();
        }
    }
}

impl Drop for PoolNode {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Opens the chunk descriptions kept in `dir` and teaches them to `catalog` (a pool started
/// again on its disk describes what it holds as before). `None`, with a warning, if the file
/// cannot be opened: the pool then describes what the engines announce again, as without it.
fn load_catalog(
    dir: &std::path::Path,
    catalog: &mut kvpeer_pool::Catalog,
) -> Option<catalog_file::CatalogFile> {
    let (file, payloads) = match catalog_file::CatalogFile::open(dir) {
        Ok(opened) => opened,
        Err(e) => {
            warn!(dir = %dir.display(), error = %e, "cannot open the pool's kept chunk descriptions; blocks found on disk are announced undescribed until the engines announce them again");
            return None;
        }
    };
    let limits = kvpeer_proto::events::EventLimits::default();
    let mut learned = 0u64;
    for payload in &payloads {
        let Ok(batch) = kvpeer_proto::events::decode_batch(payload, &limits) else {
            continue;
        };
        for event in batch.events.into_iter().flatten() {
            if let kvpeer_proto::events::KvEvent::Stored(stored) = event {
                catalog.learn(&stored);
                learned += 1;
            }
        }
    }
    info!(dir = %dir.display(), descriptions = learned, "the pool's chunk descriptions read back");
    Some(file)
}

/// Appends the descriptions of the chunks `changes` stored (those the catalog can describe),
/// as self-describing CPU events in bytes-hash form, whatever form the pool publishes.
fn keep_descriptions(
    file: &mut catalog_file::CatalogFile,
    ts: f64,
    changes: &[StoreChange],
    catalog: &mut kvpeer_pool::Catalog,
) {
    use kvpeer_proto::events::{BlockHash, BlockStored, KvEvent};
    let mut events = Vec::new();
    for change in changes {
        let StoreChange::Stored(key) = change else {
            continue;
        };
        let Ok(d) = catalog.describe(key) else {
            continue;
        };
        events.push(KvEvent::Stored(BlockStored {
            block_hashes: d
                .block_hashes
                .iter()
                .map(|h| BlockHash::Bytes(h.to_vec()))
                .collect(),
            parent_block_hash: d.parent.as_deref().map(|p| BlockHash::Bytes(p.to_vec())),
            token_ids: d.token_ids.clone(),
            block_size: d.block_size,
            lora_id: d.lora_id,
            lora_name: d.lora_name.clone(),
            medium: Some(kvpeer_pool::keys::CPU_MEDIUM.into()),
            group_idx: key.group_idx(),
            ..BlockStored::default()
        }));
    }
    if events.is_empty() {
        return;
    }
    let kept = kvpeer_proto::events::encode_batch(ts, &events, None)
        .map_err(|e| e.to_string())
        .and_then(|payload| file.append(&payload).map_err(|e| e.to_string()))
        .and_then(|()| file.flush().map_err(|e| e.to_string()));
    if let Err(e) = kept {
        if let Some(suppressed) = crate::admit_warning("cannot keep the pool's chunk descriptions")
        {
            warn!(error = %e, suppressed, "cannot keep the pool's chunk descriptions; a restart announces those chunks undescribed");
        }
    }
}

/// What `node`'s store took in and let go since the last call, as a [`Publisher`] takes it,
/// and how many changes were dropped for room (`Node::take_store_changes`).
pub fn store_changes(node: &Node, max: usize) -> Result<(Vec<StoreChange>, u64), crate::NodeError> {
    let (changes, dropped) = node.take_store_changes(max)?;
    let changes = changes
        .into_iter()
        .map(|c| match c {
            KeyChange::Stored(k) => StoreChange::Stored(k),
            KeyChange::Removed(k) => StoreChange::Removed(k),
        })
        .collect();
    Ok((changes, dropped))
}

/// The addresses of `peer`'s host (an engine's P2P identity), which a SUB that binds for its
/// PUB accepts connections from: read as every other peer address is ([`PeerAddr`]: any
/// spelling of an IP is that IP), a name resolved now (once, at start: the pool thread never
/// resolves).
fn engine_addrs(peer: &PeerId) -> Result<Vec<IpAddr>, PoolNodeError> {
    let fail = |detail: String| PoolNodeError::EngineHost {
        peer: peer.as_str().to_owned(),
        detail,
    };
    let addr = PeerAddr::of(peer).map_err(|e| fail(e.to_string()))?;
    let addrs: Vec<IpAddr> = match addr.host() {
        Host::Ip(ip) => vec![*ip],
        Host::Name(name) => crate::node::resolve::resolve_host(name),
    };
    let addrs: Vec<IpAddr> = addrs.into_iter().filter(|ip| is_peer_ip(*ip)).collect();
    if addrs.is_empty() {
        return Err(fail(format!(
            "{} names no host a PUB could connect from",
            addr.host()
        )));
    }
    Ok(addrs)
}

fn spawn(name: &str, f: impl FnOnce() + Send + 'static) -> Result<JoinHandle<()>, PoolNodeError> {
    std::thread::Builder::new()
        .name(name.to_owned())
        .spawn(f)
        .map_err(PoolNodeError::Thread)
}

/// One followed engine.
struct Engine {
    subscriber: EventSubscriber,
    follower: Follower,
    pulls: SyncSender<PullJob>,
    /// Where its events come from, for the warning below.
    events: SubEndpoint,
    /// Following since; whether its stream ever connected, and whether that was warned of.
    since: Instant,
    heard: bool,
    warned_silent: bool,
}

/// A followed stream that never connected for this long is warned of (once): `--follow` at
/// an endpoint nothing publishes on would otherwise wait without a word.
const SILENT_FOLLOW_WARNING: Duration = Duration::from_secs(10);

/// The pool nodes splitting the key space, and which one this is.
struct Shard {
    members: Vec<String>,
    me: usize,
}

/// Candidates `shard` kept from the pullers.
#[derive(Debug, Default, Clone, Copy)]
struct ShardCounts {
    others: u64,
    unknown_root: u64,
}

struct PoolThread {
    node: Arc<Node>,
    engines: Vec<Engine>,
    holdings: Holdings,
    publishing: Option<(EventPublisher, Publisher)>,
    shard: Option<Shard>,
    shard_counts: ShardCounts,
    /// Pulls that failed: the key, and the engine it was to come from.
    failed: Receiver<(OffloadKey, EngineSlot)>,
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    published: u64,
    publish_dropped: u64,
    /// With a disk tier: the descriptions of the chunks published, kept beside it.
    catalog_file: Option<catalog_file::CatalogFile>,
}

impl PoolThread {
    fn run(&mut self) {
        let mut last_publish = Instant::now();
        while !self.stop.load(Ordering::Relaxed) {
            if let Err(e) = self.wait() {
                if let Some(suppressed) =
                    crate::admit_warning("the pool's wait failed; retrying after a tick")
                {
                    warn!(error = %e, suppressed, "the pool's wait failed; retrying after a tick");
                }
                std::thread::sleep(TICK);
            }
            let now = Instant::now();
            self.follow(now);
            while let Ok((key, from)) = self.failed.try_recv() {
                self.holdings.pull_failed(&key, from);
            }
            if now.saturating_duration_since(last_publish) >= TICK {
                last_publish = now;
                self.publish();
            }
            self.count();
        }
    }

    fn wait(&mut self) -> Result<bool, EventsError> {
        let mut drivers: Vec<&mut dyn EventIo> = Vec::with_capacity(self.engines.len() + 1);
        for e in &mut self.engines {
            drivers.push(&mut e.subscriber);
        }
        if let Some((socket, _)) = &mut self.publishing {
            drivers.push(socket);
        }
        events::wait_all(&mut drivers, TICK, None)
    }

    /// Feeds every follower what its subscriber brought, and carries out what comes back.
    fn follow(&mut self, now: Instant) {
        for engine in &mut self.engines {
            while let Some(event) = engine.subscriber.poll_event() {
                let f = &mut engine.follower;
                let actions = match event {
                    SubEvent::Connected => {
                        engine.heard = true;
                        if let Some(suppressed) = crate::admit_warning("event stream connected") {
                            info!(
                                engine = f.slot().index(),
                                suppressed, "event stream connected"
                            );
                        }
                        f.connected(now)
                    }
                    SubEvent::Live { seq, payload } => {
                        f.live(now, seq, payload, &mut self.holdings)
                    }
                    SubEvent::Replayed { seq, payload } => {
                        f.replayed(seq, &payload, &mut self.holdings)
                    }
                    SubEvent::ReplayEnd => f.replay_end(&mut self.holdings),
                    SubEvent::Lost { reason } => {
                        if let Some(suppressed) =
                            crate::admit_warning("event stream lost; reconnecting")
                        {
                            warn!(engine = f.slot().index(), %reason, suppressed, "event stream lost; reconnecting");
                        }
                        Vec::new()
                    }
                };
                let actions = in_shard(
                    self.shard.as_ref(),
                    &mut self.holdings,
                    &mut self.shard_counts,
                    actions,
                );
                carry_out(engine, actions, &mut self.holdings, &self.shared);
            }
            if !engine.heard
                && !engine.warned_silent
                && now.saturating_duration_since(engine.since) >= SILENT_FOLLOW_WARNING
            {
                engine.warned_silent = true;
                let what = match engine.events {
                    SubEndpoint::Connect(addr) => format!(
                        "nothing publishes at tcp://{addr} (is the engine up, started with \
                         --kv-events-config naming this endpoint?)"
                    ),
                    SubEndpoint::Bind(addr) => format!(
                        "no publisher connected to tcp://{addr} (is the engine's KV event \
                         endpoint pointed here?)"
                    ),
                };
                warn!(
                    engine = engine.follower.slot().index(),
                    "no KV event stream after {}s: {what}; still trying",
                    SILENT_FOLLOW_WARNING.as_secs()
                );
            }
            let actions = engine.follower.tick(now, &mut self.holdings);
            let actions = in_shard(
                self.shard.as_ref(),
                &mut self.holdings,
                &mut self.shard_counts,
                actions,
            );
            carry_out(engine, actions, &mut self.holdings, &self.shared);
        }
    }

    /// Publishes what the store took in and let go since the last tick, and answers replays.
    fn publish(&mut self) {
        let Some((socket, publisher)) = &mut self.publishing else {
            return;
        };
        match store_changes(&self.node, MAX_CHANGES) {
            Ok((changes, dropped)) => {
                self.publish_dropped += dropped;
                let ts = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64());
                publisher.set_group_kinds(self.holdings.group_kinds());
                let before = publisher.stats();
                let result = publisher.publish(ts, &changes, self.holdings.catalog_mut());
                if let Some(file) = &mut self.catalog_file {
                    keep_descriptions(file, ts, &changes, self.holdings.catalog_mut());
                }
                let follows_engines = !self.engines.is_empty();
                log_undescribed(
                    before,
                    publisher.stats(),
                    self.holdings.catalog().stats(),
                    follows_engines,
                );
                match result {
                    Ok(Some(frames)) => {
                        socket.publish(&[&frames.topic, &frames.seq, &frames.payload]);
                        self.published += 1;
                    }
                    Ok(None) => {}
                    Err(e) => warn!(error = %e, "cannot encode the pool's KV events"),
                }
            }
            Err(e) => warn!(error = %e, "cannot take the store's changes"),
        }
        socket.serve_replays(|start| {
            publisher
                .replay(start)
                .into_iter()
                .map(|f| vec![f.topic, f.seq.to_vec(), f.payload])
        });
    }

    fn count(&self) {
        let mut s = PoolNodeStats {
            engines: self.engines.len() as u64,
            indexed_keys: self.holdings.len() as u64,
            published_batches: self.published,
            publish_dropped: self.publish_dropped,
            ..PoolNodeStats::default()
        };
        if let Some((socket, publisher)) = &self.publishing {
            s.event_subscribers = socket.subscribed() as u64;
            let p = publisher.stats();
            s.published_described = p.described;
            s.published_undescribed = [
                p.undescribed_unknown,
                p.undescribed_too_long,
                p.undescribed_inconsistent,
                p.undescribed_unconfirmed,
            ];
        }
        s.shard_others = self.shard_counts.others;
        s.shard_unknown_root = self.shard_counts.unknown_root;
        let c = self.holdings.catalog().stats();
        s.catalog_blocks = c.blocks;
        s.catalog_chunks = c.chunks;
        s.extra_key_blocks = c.extra_keys;
        for e in &self.engines {
            let f = e.follower.stats();
            s.connected += u64::from(e.subscriber.is_connected());
            s.batches += f.batches;
            s.events += f.events;
            s.malformed += f.malformed_batches + f.malformed_events;
            s.gaps += f.gaps;
            s.restarts += f.restarts;
            s.lost_batches += f.lost_batches;
            s.replays += f.replays;
            s.replays_deferred += f.replays_deferred;
            s.refused_publishers += e.subscriber.stats().refused_publishers;
            s.int_hashes += f.int_hashes;
        }
        if let Ok(mut followed) = self.shared.followed.lock() {
            *followed = s;
        }
    }
}

/// Says once per reason that the node published a chunk without its description, and what
/// it would need (the first time a count grows; the counts are metrics). A node that follows
/// no engine has no tokens to describe its blocks with (`--fill` blocks, stores): that is
/// expected, so it is said once at info, in a line.
fn log_undescribed(
    before: PublisherStats,
    after: PublisherStats,
    catalog: CatalogStats,
    follows_engines: bool,
) {
    static LOGGED: [AtomicBool; 4] = [
        AtomicBool::new(false),
        AtomicBool::new(false),
        AtomicBool::new(false),
        AtomicBool::new(false),
    ];
    let grew = [
        after.undescribed_unknown > before.undescribed_unknown,
        after.undescribed_too_long > before.undescribed_too_long,
        after.undescribed_inconsistent > before.undescribed_inconsistent,
        after.undescribed_unconfirmed > before.undescribed_unconfirmed,
    ];
    let why = [
        "none of its blocks was announced with tokens (`kvpeer serve --fill` blocks never are): follow the engines whose GPU events \
         carry them (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0), or enable vLLM's \
         self_describing_kv_events; blocks with extra keys (LoRA, multimodal, cache salt) are \
         never described",
        "the walk back through its blocks did not reach the chunk before it",
        "its blocks disagree with the group's blocks per chunk (a chunk announcement was \
         missed) or with each other",
        "the group's blocks per chunk is not confirmed yet (fewer walks of new chunks agree \
         than kvpeer_pool::CONFIRMATIONS, and no self-describing event said it)",
    ];
    for i in 0..4 {
        if grew[i] && !LOGGED[i].swap(true, Ordering::Relaxed) {
            if i == 0 && !follows_engines {
                info!(
                    "publishing this node's blocks as vLLM's placeholder events (no tokens: it \
                     follows no engine that could describe them); routers that hash tokens do \
                     not index them"
                );
                continue;
            }
            warn!(
                extra_key_blocks = catalog.extra_keys,
                int_hash_stores = catalog.int_hashes,
                "a chunk was published in vLLM's placeholder form (no tokens, block_size 0), \
                 which routers that hash tokens do not index: {} (logged once; counted in \
                 kvpeer_events_published_undescribed_total)",
                why[i]
            );
        }
    }
}

/// The followed engines of each tenant, for a node that keeps tenants apart (none without
/// tenants, or with a tenant of its own: then all its blocks are one tenant's). Engines of no
/// tenant are left out: they share one group.
fn tenant_groups(node: &Node, config: &PoolConfig) -> Result<Vec<Vec<EngineSlot>>, PoolNodeError> {
    // As the node holds them: their names were resolved where it was built.
    let rules = &node.config().tenants;
    if rules.is_empty() || rules.own().is_some() {
        return Ok(Vec::new());
    }
    let mut groups: std::collections::BTreeMap<_, Vec<EngineSlot>> = Default::default();
    for (i, spec) in config.follow.iter().enumerate() {
        let tenant = rules.tenant_of(&spec.peer);
        if tenant == kvpeer_store::Tenant::NOBODY {
            return Err(PoolNodeError::EngineOfNoTenant(spec.peer.clone()));
        }
        if let Some(slot) = EngineSlot::new(i) {
            if tenant != kvpeer_store::Tenant::DEFAULT {
                info!(engine = i, peer = %spec.peer, tenant = rules.name(tenant), "its blocks are its tenant's");
                groups.entry(tenant).or_default().push(slot);
            }
        }
    }
    Ok(groups.into_values().collect())
}

/// The actions without the candidates another pool node owns (by their prefix's root chunk)
/// or whose root is not known yet (offered again by the next announcement).
fn in_shard(
    shard: Option<&Shard>,
    holdings: &mut Holdings,
    counts: &mut ShardCounts,
    actions: Vec<FollowAction>,
) -> Vec<FollowAction> {
    let Some(shard) = shard else {
        return actions;
    };
    actions
        .into_iter()
        .filter(|action| {
            let FollowAction::Pull(candidate) = action else {
                return true;
            };
            match holdings.catalog_mut().root(&candidate.key) {
                Ok(root) => {
                    let mine = kvpeer_pool::shard::owner(&shard.members, &root) == Some(shard.me);
                    counts.others += u64::from(!mine);
                    mine
                }
                Err(_) => {
                    counts.unknown_root += 1;
                    holdings.pull_failed(&candidate.key, candidate.from);
                    false
                }
            }
        })
        .collect()
}

/// Carries out a follower's actions: replays asked of its subscriber, candidates handed to its
/// puller (a full queue drops one, offered again when an engine next announces it).
fn carry_out(
    engine: &mut Engine,
    actions: Vec<FollowAction>,
    holdings: &mut Holdings,
    shared: &Shared,
) {
    for action in actions {
        match action {
            FollowAction::Replay { from } => engine.subscriber.request_replay(from),
            FollowAction::Pull(c) => match engine.pulls.try_send(PullJob { key: c.key }) {
                Ok(()) => {
                    shared.candidates.fetch_add(1, Ordering::Relaxed);
                }
                Err(TrySendError::Full(job) | TrySendError::Disconnected(job)) => {
                    holdings.pull_failed(&job.key, c.from);
                    shared.candidates_dropped.fetch_add(1, Ordering::Relaxed);
                }
            },
        }
    }
}
