//! The producer side of one peer session: serving lookups from the local store, matching
//! supply (pinned blocks) with demand (the peer's fetch) per round, writing blocks through the
//! data plane, `transfer_done`, abort drains and store timeouts.
//!
//! Driven by [`Session`](super::Session) on the core's thread. The rules that matter most:
//!
//! * every inbound `lookup` gets exactly one `lookup_resp`, all its keys in wire order, within
//!   the pending deadline (HIT_PENDING/RETRY keys become MISS at 5 s);
//! * a pin (store job) is released exactly once, and never while a write still reads its
//!   blocks;
//! * `abort_ack` goes out only once no write of the round can still land, however long that
//!   takes (a write that may land is never reported stopped).
//!
//! Per-operation cost does not grow with the number of requests: lookups waiting on pending
//! keys sit on a work-list, deadlines on [`Lane`]s, and each job counts the transfers reading it.
//!
//! This file holds the role's state (requests, rounds, pins, transfers in flight) and what
//! every part shares; each concern is in its own file: `lookups` (serving `lookup`s), `supply`
//! (pins offered to a round), `demand` (the peer's `fetch` and the writes it starts),
//! `completions` (transfers that ended, the end of a round), `aborts` (`abort_fetch` drains and
//! cancellation), `timeouts`.

mod aborts;
mod completions;
mod demand;
mod drain;
mod lookups;
mod supply;
mod timeouts;

use std::collections::BTreeMap;

use crate::maps::{Map, Set};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvpeer_proto::{KvRequestId, OffloadKey, PeerId, RoundSeq};
use smallvec::SmallVec;

use super::{Cx, RoundKey};
use crate::config::CoreConfig;
use crate::error::PlaneError;
use crate::output::Event;
use crate::timer::{earliest, Lane};
use crate::traits::{BlockIndex, CancelMode, JobId, ServeCtx, TransferId};

/// One incarnation of a round: a round key can be used again once its round ended, and
/// entries (timer lanes, transfers, orphans) of the old one must not touch the new one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Serial(u64);

/// A store job: local blocks pinned for the peer until the job completes.
#[derive(Debug, Clone, Copy)]
struct Pin {
    job: JobId,
    submitted_at: Instant,
    /// Inflight transfers reading the job's blocks; the pin stays while any does.
    readers: u32,
}

/// A pin whose round ended while a write still read it; it completes when that write ends.
#[derive(Debug)]
struct Orphan {
    pin: Pin,
    id: KvRequestId,
    round: RoundSeq,
    serial: Serial,
}

/// One fetch round of one request: supply (blocks pinned for it) against demand (the fetch).
#[derive(Debug)]
struct Round {
    /// Distinguishes this round from a later one under the same key.
    serial: Serial,
    /// Who supplies the round.
    origin: Origin,
    /// The peer's fetch for the round, once it came.
    demand: Demand,
    /// Blocks we hold for the round, not yet demanded: key → (job, local block).
    available: Map<OffloadKey, (JobId, BlockIndex)>,
    /// Blocks the peer wants that we do not hold yet: key → its block.
    demanded: Map<OffloadKey, BlockIndex>,
    /// Finish as soon as nothing is in flight.
    finishing: bool,
    /// Transfers of this round in flight.
    inflight: usize,
    /// Failed or aborted while transfers may still be writing.
    cancel: Option<Cancelled>,
    /// Pins (store jobs) supplying the round that have not completed; one or two, nearly
    /// always. A pin lives here, with its round, so no table of all pins is needed.
    pins: SmallVec<[Pin; 2]>,
    /// What its parked demand counts toward the peer's held budget (keys, bytes).
    held: Held,
}

/// Who supplies a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    /// The engine's stores (PD): supply may still come after the fetch.
    Store,
    /// Lookup pins (symmetric), or pins that expired: no supply can come after the fetch, so
    /// unmatched demand fails at once.
    Lookup,
}

/// Whether the peer's fetch for a round came.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Demand {
    /// Not yet: supply waits for it.
    Awaiting,
    /// It came; this many of its blocks are still to be written before the round succeeds.
    Received { remaining: usize },
}

/// A cancelled round (failed or aborted while transfers may still be writing).
#[derive(Debug, Clone, Copy)]
struct Cancelled {
    /// When its transfers were last asked to stop (at most once per retry interval).
    last_stop_at: Option<Instant>,
}

impl Round {
    fn demand_received(&self) -> bool {
        matches!(self.demand, Demand::Received { .. })
    }

    fn is_cancelled(&self) -> bool {
        self.cancel.is_some()
    }

    /// Cancels the round; `true` if it was not cancelled before.
    fn cancel(&mut self) -> bool {
        let first = self.cancel.is_none();
        self.cancel.get_or_insert(Cancelled { last_stop_at: None });
        first
    }

    /// `blocks` more landed; returns how many the fetch still waits for (0 before any fetch).
    fn landed(&mut self, blocks: usize) -> usize {
        match &mut self.demand {
            Demand::Received { remaining } => {
                *remaining = remaining.saturating_sub(blocks);
                *remaining
            }
            Demand::Awaiting => 0,
        }
    }

    /// Every block the fetch asked for was written.
    fn fully_written(&self) -> bool {
        matches!(self.demand, Demand::Received { remaining: 0 })
    }

    fn pin_mut(&mut self, job: JobId) -> Option<&mut Pin> {
        self.pins.iter_mut().find(|p| p.job == job)
    }

    fn remove_pin(&mut self, job: JobId) -> Option<Pin> {
        let at = self.pins.iter().position(|p| p.job == job)?;
        Some(self.pins.swap_remove(at))
    }

    fn new(serial: Serial) -> Self {
        Round {
            serial,
            origin: Origin::Store,
            demand: Demand::Awaiting,
            available: Map::default(),
            demanded: Map::default(),
            finishing: false,
            inflight: 0,
            cancel: None,
            pins: SmallVec::new(),
            held: Held::default(),
        }
    }
}

/// Local → remote block pairs ready to write, and the jobs they read.
#[derive(Debug, Default)]
struct Matched {
    local: Vec<BlockIndex>,
    remote: Vec<BlockIndex>,
    jobs: SmallVec<[JobId; 2]>,
}

impl Matched {
    fn add(&mut self, local: BlockIndex, remote: BlockIndex, job: JobId) {
        self.local.push(local);
        self.remote.push(remote);
        if !self.jobs.contains(&job) {
            self.jobs.push(job);
        }
    }
}

/// Keys and estimated bytes held for a peer (its open requests' ids, its open lookups, its
/// fetches waiting for a store, its pins), counted against `max_held_keys_per_peer` /
/// `max_held_bytes_per_peer`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Held {
    pub(crate) keys: usize,
    pub(crate) bytes: usize,
}

impl Held {
    /// Estimated memory per key held: the key in the message's list, its copy in a map at the
    /// map's worst load, and the map's control bytes.
    pub(super) const BYTES_PER_KEY: usize = 3 * std::mem::size_of::<OffloadKey>() + 8;
    /// Estimated memory of the entry holding them (an open lookup with its context, or a
    /// round with its maps), beyond its keys.
    const BYTES_PER_ENTRY: usize =
        256 + std::mem::size_of::<ActiveLookup>() + std::mem::size_of::<Round>();

    /// Copies of a request's id the node keeps while it is open (its request's entry, the
    /// serving context that embeds it, the timer lanes and maps keyed by it).
    const COPIES_PER_ID: usize = 4;

    /// What an open request's id costs, from its entry's creation to its removal (whatever it
    /// holds meanwhile): vLLM accepts ids of any length a message carries (tens of KiB are in
    /// its own vectors), so a peer's long ids are paid from its share, not ours.
    pub(crate) fn id(id: &KvRequestId) -> Self {
        Held {
            keys: 0,
            bytes: Self::COPIES_PER_ID * id.as_str().len(),
        }
    }

    /// What holding `keys` costs (an empty list still costs one key: its entry); the request's
    /// id is paid by the request ([`Held::id`]).
    pub(crate) fn of(keys: &[OffloadKey]) -> Self {
        let heap: usize = keys
            .iter()
            .map(|k| k.as_bytes().len())
            .filter(|&n| n > std::mem::size_of::<OffloadKey>())
            .sum();
        Held {
            keys: keys.len().max(1),
            bytes: Self::BYTES_PER_ENTRY + keys.len().max(1) * Self::BYTES_PER_KEY + 2 * heap,
        }
    }

    /// What `n` pin references hold (their keys in the round's supply, the store's job).
    pub(super) fn pins(n: usize) -> Self {
        Held {
            keys: n,
            bytes: n * Self::BYTES_PER_KEY,
        }
    }

    fn add(&mut self, other: Held) {
        self.keys += other.keys;
        self.bytes += other.bytes;
    }

    fn sub(&mut self, other: Held) {
        self.keys = self.keys.saturating_sub(other.keys);
        self.bytes = self.bytes.saturating_sub(other.bytes);
    }
}

/// What all sessions' peers hold together (bytes, and how many peers hold any): shared by
/// every [`HeldAccount`] of one core. The core runs on one thread; atomics only make it `Send`.
#[derive(Debug, Default)]
pub(crate) struct NodeHeld {
    bytes: AtomicUsize,
    holders: AtomicUsize,
}

impl NodeHeld {
    /// Bytes all peers hold.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }
}

/// One peer's [`Held`], kept in step with the node's total ([`NodeHeld`]).
#[derive(Debug)]
pub(crate) struct HeldAccount {
    mine: Held,
    node: Arc<NodeHeld>,
}

impl std::ops::Deref for HeldAccount {
    type Target = Held;
    fn deref(&self) -> &Held {
        &self.mine
    }
}

impl HeldAccount {
    fn new(node: Arc<NodeHeld>) -> Self {
        HeldAccount {
            mine: Held::default(),
            node,
        }
    }

    fn add(&mut self, other: Held) {
        if self.mine.bytes == 0 && other.bytes > 0 {
            self.node.holders.fetch_add(1, Ordering::Relaxed);
        }
        self.node.bytes.fetch_add(other.bytes, Ordering::Relaxed);
        self.mine.add(other);
    }

    fn sub(&mut self, other: Held) {
        let before = self.mine.bytes;
        self.mine.sub(other);
        self.node
            .bytes
            .fetch_sub(before - self.mine.bytes, Ordering::Relaxed);
        if before > 0 && self.mine.bytes == 0 {
            self.node.holders.fetch_sub(1, Ordering::Relaxed);
        }
    }

    fn clear(&mut self) {
        let all = self.mine;
        self.sub(all);
    }

    /// Whether holding `more` would take this peer past its share: its own caps, or, with
    /// all peers together past `max_held_bytes`, more than an equal part of that cap.
    fn over(&self, more: Held, config: &CoreConfig) -> bool {
        let mine = self.mine.bytes + more.bytes;
        if self.mine.keys + more.keys > config.max_held_keys_per_peer
            || mine > config.max_held_bytes_per_peer
        {
            return true;
        }
        if self.node.bytes() + more.bytes <= config.max_held_bytes {
            return false;
        }
        let holders = self.node.holders.load(Ordering::Relaxed) + usize::from(self.mine.bytes == 0);
        mine > config.max_held_bytes / holders.max(1)
    }
}

impl Drop for HeldAccount {
    fn drop(&mut self) {
        self.clear();
    }
}

/// A per-peer token bucket of keys looked up per second (one second's worth at most).
#[derive(Debug)]
struct KeyBucket {
    rate: f64,
    tokens: f64,
    at: Instant,
}

impl KeyBucket {
    fn new(rate: u64, now: Instant) -> Self {
        let rate = rate.max(1) as f64;
        KeyBucket {
            rate,
            tokens: rate,
            at: now,
        }
    }

    /// Whole keys available at `now`.
    fn available(&mut self, now: Instant) -> usize {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.rate);
        self.at = self.at.max(now);
        self.tokens as usize
    }

    fn take(&mut self, n: usize) {
        self.tokens -= n as f64;
    }

    /// Keys asked on the node's spare time (no other session wanted the step): they leave the
    /// bucket empty, never in debt, so a peer that used idle time is not held back for it once
    /// others compete.
    fn take_spare(&mut self, n: usize) {
        self.tokens = (self.tokens - n as f64).max(0.0);
    }

    /// When `n` keys will be available (at least 1 ms from `now`).
    fn when(&self, now: Instant, n: usize) -> Instant {
        let want = (n as f64).min(self.rate) - self.tokens;
        let wait = (want / self.rate).max(0.001);
        now + std::time::Duration::from_secs_f64(wait)
    }
}

/// An inbound lookup whose keys are not all answered yet.
#[derive(Debug)]
struct ActiveLookup {
    ctx: ServeCtx,
    round: RoundSeq,
    keys: Vec<OffloadKey>,
    /// The first key of `keys` not asked yet (the lookup is served in slices).
    next: usize,
    /// Keys from here on are answered MISS unasked (`max_lookup_keys`).
    end: usize,
    /// What the lookup counts toward the peer's held budget.
    held: Held,
    /// The keys that hit (pinned), are pending, or were settled MISS after either (a pending
    /// key that missed or expired, a hit the store would not pin); a key absent is MISS too.
    /// Keys that simply miss are not kept: a lookup of keys the node lacks (most of a flood)
    /// costs no entry per key, and a repeat of a key kept here is not asked (or pinned) again.
    answers: Map<OffloadKey, Answer>,
    /// Unique keys still HIT_PENDING/RETRY.
    pending: Vec<OffloadKey>,
    deadline: Instant,
}

/// What one key of a lookup was answered, when kept ([`ActiveLookup::answers`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// HIT, pinned for the lookup's round.
    Hit,
    /// HIT_PENDING or RETRY: asked again until the lookup's deadline.
    Pending,
    /// MISS after being pending or refused its pin: not asked again in this lookup.
    Miss,
}

#[derive(Debug, Default)]
struct Request {
    /// Open rounds by number: a request has one or two, so a list beats a map.
    rounds: Vec<(RoundSeq, Round)>,
    lookups: BTreeMap<u64, ActiveLookup>,
    /// Its transfers in flight (one or two, nearly always).
    inflight: SmallVec<[TransferId; 2]>,
    /// Aborts of this request still draining.
    aborts: usize,
}

impl Request {
    fn round(&self, key: RoundSeq) -> Option<&Round> {
        self.rounds.iter().find(|(k, _)| *k == key).map(|(_, r)| r)
    }

    fn round_mut(&mut self, key: RoundSeq) -> Option<&mut Round> {
        self.rounds
            .iter_mut()
            .find(|(k, _)| *k == key)
            .map(|(_, r)| r)
    }

    fn remove_round(&mut self, key: RoundSeq) -> Option<Round> {
        let at = self.rounds.iter().position(|(k, _)| *k == key)?;
        Some(self.rounds.swap_remove(at).1)
    }

    fn round_keys(&self) -> Vec<RoundSeq> {
        self.rounds.iter().map(|(k, _)| *k).collect()
    }

    fn is_idle(&self) -> bool {
        self.rounds.is_empty()
            && self.lookups.is_empty()
            && self.inflight.is_empty()
            && self.aborts == 0
    }
}

#[derive(Debug)]
struct Inflight {
    id: KvRequestId,
    round: RoundSeq,
    serial: Serial,
    blocks: usize,
    jobs: SmallVec<[JobId; 2]>,
    /// When it was posted (its stall deadline is `transfer_stall_timeout` later).
    posted_at: Instant,
}

/// Blocks pinned for a peer by one store job, offered as supply to one round.
#[derive(Debug)]
pub(crate) struct Supply<'a> {
    pub(crate) job: JobId,
    pub(crate) keys: &'a [OffloadKey],
    pub(crate) blocks: &'a [BlockIndex],
    pub(crate) round: RoundSeq,
    /// Pinned by a lookup (symmetric), or stored by the engine (PD).
    pub(crate) origin: Origin,
}

/// What a closed session leaves behind (already completed at the parent).
#[derive(Debug, Default)]
pub(crate) struct ServerClose {
    pub(crate) failed_stores: usize,
    pub(crate) released_serves: usize,
    /// Writes the plane could not stop at once (they may still be reading their source
    /// blocks), each with the store jobs it reads: those jobs are left pinned, for the core to
    /// complete once the plane says the write stopped (vLLM 0.34's retained transfers).
    pub(crate) retained: Vec<(TransferId, SmallVec<[JobId; 2]>)>,
}

/// The producer side of one session.
#[derive(Debug)]
pub(crate) struct ServerRole {
    peer: PeerId,
    requests: Map<KvRequestId, Box<Request>>,
    /// Requests with lookups waiting on pending keys.
    serve_list: Set<KvRequestId>,
    inflight: Map<TransferId, Inflight>,
    /// Pins whose round ended while a write still read them (rare).
    orphans: Map<JobId, Orphan>,
    /// Pins not completed yet, in rounds and orphaned.
    open_pins: usize,
    store_lane: Lane<(RoundKey, Serial, JobId)>,
    /// Rounds whose demand waits for supply (a PD fetch before its store): failed when no
    /// supply came within the store timeout, so a peer's fetches cannot park state forever.
    demand_lane: Lane<(RoundKey, Serial)>,
    /// Rounds dropped because every pin expired before any fetch: a late fetch for one fails
    /// in one round trip. Remembered for one more store timeout.
    expired: Map<RoundKey, Instant>,
    expired_lane: Lane<RoundKey>,
    lookup_lane: Lane<(KvRequestId, u64)>,
    next_lookup_id: u64,
    next_serial: Serial,
    /// Aborts draining: (request, round) → when the abort arrived.
    aborts: Map<RoundKey, Instant>,
    slow_aborts: Set<RoundKey>,
    abort_warn_lane: Lane<RoundKey>,
    /// Rounds whose cancellation waits for the data plane: retried at the retry interval.
    retry_lane: Lane<(RoundKey, Serial)>,
    /// Writes in flight, by when they were posted: one still in flight at its deadline faults
    /// the peer (`transfer_stall_timeout`; none armed when zero).
    stall_lane: Lane<TransferId>,
    /// When pending lookup keys are next asked again.
    repoll_at: Option<Instant>,
    /// Lookups whose keys are not all asked yet, in arrival order: a slice at a time, in this
    /// peer's host's turns of the core's steps (`core/slices.rs`).
    backlog: std::collections::VecDeque<(KvRequestId, u64)>,
    /// When the backlog is next served.
    slice_at: Option<Instant>,
    /// Keys per second this peer's lookups may ask of the store while other sessions' lookups
    /// wait for the core's steps (work-conserving: past it, the peer is served only on steps
    /// no session within its budget wants).
    bucket: KeyBucket,
    /// Keys and bytes held for this peer (open lookups, parked demand), and its part of the
    /// node's total.
    held: HeldAccount,
    /// Distinct blocks pinned by this peer's lookups (how many of its pins hold each), and
    /// the blocks of each open lookup pin (their references count as held keys).
    pinned: Map<BlockIndex, u32>,
    pin_blocks: Map<JobId, Vec<BlockIndex>>,
    /// Most blocks this peer's lookups may hold pinned.
    max_pins: usize,
    /// The data plane reported this peer unusable; no new writes.
    pub(crate) peer_fault: Option<PlaneError>,
    /// The fault is a write that stayed in flight past `transfer_stall_timeout`: waiting for
    /// the writes to drain is pointless, the session ends at once (as vLLM 0.34).
    pub(crate) transfer_stalled: bool,
}

fn serve_ctx(peer: &PeerId, id: &KvRequestId, n: u64) -> ServeCtx {
    ServeCtx {
        peer: peer.clone(),
        kv_request_id: id.clone(),
        lookup: n,
    }
}

impl ServerRole {
    pub(crate) fn new(
        peer: PeerId,
        config: &CoreConfig,
        num_blocks: u64,
        now: Instant,
        node_held: Arc<NodeHeld>,
    ) -> Self {
        ServerRole {
            peer,
            requests: Map::default(),
            serve_list: Set::default(),
            inflight: Map::default(),
            orphans: Map::default(),
            open_pins: 0,
            store_lane: Lane::new(config.store_timeout),
            demand_lane: Lane::new(config.store_timeout),
            expired: Map::default(),
            expired_lane: Lane::new(config.store_timeout),
            lookup_lane: Lane::new(config.lookup_pending_timeout),
            next_lookup_id: 0,
            next_serial: Serial(0),
            aborts: Map::default(),
            slow_aborts: Set::default(),
            abort_warn_lane: Lane::new(config.cancel_drain_warning),
            retry_lane: Lane::new(config.cancel_retry_interval),
            stall_lane: Lane::new(config.transfer_stall_timeout),
            repoll_at: None,
            backlog: std::collections::VecDeque::new(),
            slice_at: None,
            bucket: KeyBucket::new(config.lookup_keys_per_sec, now),
            held: HeldAccount::new(node_held),
            pinned: Map::default(),
            pin_blocks: Map::default(),
            max_pins: config.pins_per_peer(num_blocks),
            peer_fault: None,
            transfer_stalled: false,
        }
    }

    /// Whether lookups wait for blocks being written (the next `serve` asks them again).
    pub(crate) fn has_serve_list(&self) -> bool {
        !self.serve_list.is_empty()
    }

    pub(crate) fn has_inflight(&self) -> bool {
        !self.inflight.is_empty()
    }

    /// Open requests, store jobs and inflight transfers (for invariant checks and stats).
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        (self.requests.len(), self.open_pins, self.inflight.len())
    }

    /// Whether this side still holds state for request `id`.
    pub(crate) fn serves(&self, id: &KvRequestId) -> bool {
        self.requests.contains_key(id)
    }

    fn prune(&mut self, id: &KvRequestId) {
        if self.requests.get(id).is_some_and(|r| r.is_idle()) {
            self.requests.remove(id);
            self.held.sub(Held::id(id));
        }
    }

    /// Request `id`'s entry, made (and its id's cost charged) if it has none: the one way an
    /// entry is made, as [`ServerRole::prune`] is the one way it goes (or `close`, all at once).
    fn request_entry(&mut self, id: &KvRequestId) -> &mut Request {
        if !self.requests.contains_key(id) {
            self.held.add(Held::id(id));
        }
        self.requests.entry(id.clone()).or_default()
    }

    /// Whether opening request `id` would take the peer past its share of requests or of held
    /// bytes (an id already open costs nothing more).
    fn no_room_for(&self, id: &KvRequestId, config: &crate::CoreConfig) -> bool {
        !self.requests.contains_key(id)
            && (self.requests.len() >= config.max_requests_per_peer
                || self.held.over(Held::id(id), config))
    }

    fn round_mut(
        &mut self,
        id: &KvRequestId,
        round: RoundSeq,
        serial: Serial,
    ) -> Option<&mut Round> {
        self.requests
            .get_mut(id)?
            .round_mut(round)
            .filter(|r| r.serial == serial)
    }

    fn round_or_new(&mut self, id: &KvRequestId, round: RoundSeq) -> &mut Round {
        if self
            .requests
            .get(id)
            .is_none_or(|r| r.round(round).is_none())
        {
            self.next_serial = Serial(self.next_serial.0 + 1);
        }
        let serial = self.next_serial;
        let req = self.request_entry(id);
        let at = match req.rounds.iter().position(|(k, _)| *k == round) {
            Some(at) => at,
            None => {
                req.rounds.push((round, Round::new(serial)));
                req.rounds.len() - 1
            }
        };
        &mut req.rounds[at].1
    }

    /// Completes a pin (store job) at the parent. The caller has just removed it from where it
    /// lived, so each pin completes exactly once.
    fn complete_pin(&mut self, cx: &mut Cx<'_>, job: JobId, success: bool) {
        self.forget_pin(job);
        cx.parent.complete_store_job(job, success);
        cx.out.event(Event::StoreDone { job, success });
    }

    /// The session's own record of a pin goes (its share of the peer's budget, its blocks'
    /// count); completing it at the parent is the caller's.
    fn forget_pin(&mut self, job: JobId) {
        self.open_pins -= 1;
        if let Some(blocks) = self.pin_blocks.remove(&job) {
            self.held.sub(Held::pins(blocks.len()));
            for block in blocks {
                if let Some(n) = self.pinned.get_mut(&block) {
                    *n -= 1;
                    if *n == 0 {
                        self.pinned.remove(&block);
                    }
                }
            }
        }
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        earliest([
            self.repoll_at,
            self.lookup_lane.next_deadline(),
            self.store_lane.next_deadline(),
            self.demand_lane.next_deadline(),
            self.expired_lane.next_deadline(),
            self.retry_lane.next_deadline(),
            self.stall_lane.next_deadline(),
            self.abort_warn_lane.next_deadline(),
        ])
    }

    /// Tears down: inflight transfers are cancelled (`mode`: [`CancelMode::Wait`] keeps the
    /// ones the plane cannot stop at once, [`CancelMode::Immediate`] abandons them, at
    /// shutdown), every store job fails but those a kept transfer reads (they go to the core
    /// with it, still pinned), parked lookups' contexts are closed.
    pub(crate) fn close(&mut self, cx: &mut Cx<'_>, mode: CancelMode) -> ServerClose {
        let mut result = ServerClose::default();
        if !self.inflight.is_empty() {
            let ids: Vec<TransferId> = self.inflight.keys().copied().collect();
            let still = cx.plane.cancel(&ids, mode);
            for tid in still {
                if let Some(inflight) = self.inflight.get(&tid) {
                    result.retained.push((tid, inflight.jobs.clone()));
                }
            }
        }
        self.inflight.clear();
        let kept: Vec<JobId> = result
            .retained
            .iter()
            .flat_map(|(_, jobs)| jobs.iter().copied())
            .collect();
        let mut pins: Vec<JobId> = self.orphans.drain().map(|(job, _)| job).collect();
        for (_, req) in self.requests.drain() {
            for (_, rnd) in req.rounds {
                pins.extend(rnd.pins.iter().map(|p| p.job));
            }
            for (_, lookup) in req.lookups {
                cx.parent.on_request_finished(&lookup.ctx);
                result.released_serves += 1;
            }
        }
        for job in pins {
            if kept.contains(&job) {
                // Still read by a running write: the core completes it once that stops.
                self.forget_pin(job);
                continue;
            }
            self.complete_pin(cx, job, false);
            result.failed_stores += 1;
        }
        self.serve_list.clear();
        self.aborts.clear();
        self.slow_aborts.clear();
        self.store_lane.clear();
        self.demand_lane.clear();
        self.expired.clear();
        self.expired_lane.clear();
        self.lookup_lane.clear();
        self.stall_lane.clear();
        self.retry_lane.clear();
        self.abort_warn_lane.clear();
        self.repoll_at = None;
        self.backlog.clear();
        self.slice_at = None;
        self.held.clear();
        self.pinned.clear();
        self.pin_blocks.clear();
        result
    }

    /// Keys and bytes held for the peer, blocks pinned for its lookups (for tests and stats).
    pub(crate) fn shares(&self) -> (Held, usize) {
        (*self.held, self.pinned.len())
    }

    /// Transfer ids in flight (for shutdown drains).
    pub(crate) fn inflight_ids(&self) -> Vec<TransferId> {
        self.inflight.keys().copied().collect()
    }
}
