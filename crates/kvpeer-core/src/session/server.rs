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

use std::collections::BTreeMap;

use crate::maps::{Map, Set};
use std::time::Instant;

use kvpeer_proto::{
    Abort, KvRequestId, LookupResp, Message, OffloadKey, PeerId, RoundSeq, TransferDone,
};
use smallvec::SmallVec;
use tracing::{debug, warn};

use super::{Cx, RoundKey};
use crate::config::CoreConfig;
use crate::error::{InternalError, PlaneError, ProtocolViolation};
use crate::output::{Event, Link};
use crate::timer::{earliest, Lane};
use crate::traits::{BlockIndex, CancelMode, JobId, LookupResult, ServeCtx, TransferId};

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
    serial: u64,
}

/// One fetch round of one request: supply (blocks pinned for it) against demand (the fetch).
#[derive(Debug)]
struct Round {
    /// Distinguishes this round from a later one under the same key.
    serial: u64,
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
}

/// Who supplies a round.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
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

    fn new(serial: u64) -> Self {
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

/// An inbound lookup whose keys are not all answered yet.
#[derive(Debug)]
struct ActiveLookup {
    ctx: ServeCtx,
    round: RoundSeq,
    keys: Vec<OffloadKey>,
    /// Every key seen: `Some(hit)` once answered, `None` while pending (this also removes
    /// duplicates of the lookup's keys in O(1)).
    answers: Map<OffloadKey, Option<bool>>,
    /// Unique keys still HIT_PENDING/RETRY.
    pending: Vec<OffloadKey>,
    deadline: Instant,
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
    serial: u64,
    blocks: usize,
    jobs: SmallVec<[JobId; 2]>,
}

/// Blocks pinned for a peer by one store job, offered as supply to one round.
#[derive(Debug)]
pub(crate) struct Supply<'a> {
    pub(crate) job: JobId,
    pub(crate) keys: &'a [OffloadKey],
    pub(crate) blocks: &'a [BlockIndex],
    pub(crate) round: RoundSeq,
    /// Pinned by a lookup (symmetric) rather than stored by the engine (PD).
    pub(crate) from_lookup: bool,
}

/// What a closed session leaves behind (already completed at the parent).
#[derive(Debug, Default)]
pub(crate) struct ServerClose {
    pub(crate) failed_stores: usize,
    pub(crate) released_serves: usize,
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
    store_lane: Lane<(RoundKey, u64, JobId)>,
    /// Rounds whose demand waits for supply (a PD fetch before its store): failed when no
    /// supply came within the store timeout, so a peer's fetches cannot park state forever.
    demand_lane: Lane<(RoundKey, u64)>,
    /// Rounds dropped because every pin expired before any fetch: a late fetch for one fails
    /// in one round trip. Remembered for one more store timeout.
    expired: Map<RoundKey, Instant>,
    expired_lane: Lane<RoundKey>,
    lookup_lane: Lane<(KvRequestId, u64)>,
    next_lookup_id: u64,
    next_serial: u64,
    /// Aborts draining: (request, round) → when the abort arrived.
    aborts: Map<RoundKey, Instant>,
    slow_aborts: Set<RoundKey>,
    abort_warn_lane: Lane<RoundKey>,
    /// Rounds whose cancellation waits for the data plane: retried at the retry interval.
    retry_lane: Lane<(RoundKey, u64)>,
    /// When pending lookup keys are next asked again.
    repoll_at: Option<Instant>,
    /// The data plane reported this peer unusable; no new writes.
    pub(crate) peer_fault: Option<PlaneError>,
}

fn serve_ctx(peer: &PeerId, id: &KvRequestId, n: u64) -> ServeCtx {
    ServeCtx {
        peer: peer.clone(),
        kv_request_id: id.clone(),
        lookup: n,
    }
}

impl ServerRole {
    pub(crate) fn new(peer: PeerId, config: &CoreConfig) -> Self {
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
            next_serial: 0,
            aborts: Map::default(),
            slow_aborts: Set::default(),
            abort_warn_lane: Lane::new(config.cancel_drain_warning),
            retry_lane: Lane::new(config.cancel_retry_interval),
            repoll_at: None,
            peer_fault: None,
        }
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
        }
    }

    fn round_mut(&mut self, id: &KvRequestId, round: RoundSeq, serial: u64) -> Option<&mut Round> {
        self.requests
            .get_mut(id)?
            .round_mut(round)
            .filter(|r| r.serial == serial)
    }

    fn round_or_new(&mut self, id: &KvRequestId, round: RoundSeq) -> &mut Round {
        let req = self.requests.entry(id.clone()).or_default();
        let at = match req.rounds.iter().position(|(k, _)| *k == round) {
            Some(at) => at,
            None => {
                self.next_serial += 1;
                req.rounds.push((round, Round::new(self.next_serial)));
                req.rounds.len() - 1
            }
        };
        &mut req.rounds[at].1
    }

    /// Completes a pin (store job) at the parent. The caller has just removed it from where it
    /// lived, so each pin completes exactly once.
    fn complete_pin(&mut self, cx: &mut Cx<'_>, job: JobId, success: bool) {
        self.open_pins -= 1;
        cx.parent.complete_store_job(job, success);
        cx.out.event(Event::StoreDone { job, success });
    }

    // ---- supply ----

    /// Blocks pinned for `id`'s round `round` (lookup pins, or a PD producer's stored blocks):
    /// matched against the round's demand, the rest kept as supply.
    pub(crate) fn add_stored_blocks(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        supply: Supply<'_>,
    ) {
        let Supply {
            job,
            keys,
            blocks,
            round,
            from_lookup,
        } = supply;
        let rnd = self.round_or_new(id, round);
        let serial = rnd.serial;
        if rnd.is_cancelled() {
            cx.parent.complete_store_job(job, false);
            cx.out.event(Event::StoreDone {
                job,
                success: false,
            });
            return;
        }
        if from_lookup {
            rnd.origin = Origin::Lookup;
        }
        let new_pin = rnd.pin_mut(job).is_none();
        if new_pin {
            rnd.pins.push(Pin {
                job,
                submitted_at: cx.now,
                readers: 0,
            });
        }
        let mut matched = Matched::default();
        for (key, &local) in keys.iter().zip(blocks) {
            match rnd.demanded.remove(key) {
                Some(remote) => matched.add(local, remote, job),
                None => {
                    rnd.available.insert(key.clone(), (job, local));
                }
            }
        }
        let demand_received = rnd.demand_received();
        if new_pin {
            self.open_pins += 1;
            self.store_lane
                .arm(cx.now, (RoundKey::new(id, round), serial, job));
        }
        if !matched.local.is_empty() && demand_received {
            self.submit_transfer(link, cx, id, round, serial, matched);
        }
    }

    // ---- demand ----

    /// A `fetch`. A non-empty fetch closes its round; the empty one closes the request. A
    /// second fetch for a round is a protocol violation (`Err`).
    pub(crate) fn on_fetch(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        keys: &[OffloadKey],
        indexes: &[u64],
        round: RoundSeq,
    ) -> Result<(), ProtocolViolation> {
        let existing = self.requests.get(id).and_then(|r| r.round(round));
        if existing.is_some_and(Round::demand_received) {
            return Err(ProtocolViolation::DuplicateFetch {
                id: id.clone(),
                round,
            });
        }
        let expired =
            existing.is_none() && self.expired.remove(&RoundKey::new(id, round)).is_some();
        let rnd = self.round_or_new(id, round);
        let serial = rnd.serial;
        // Its supply came from lookups whose pins expired: nothing can serve it any more.
        if expired {
            rnd.origin = Origin::Lookup;
        }
        rnd.demand = Demand::Received {
            remaining: keys.len(),
        };
        let mut matched = Matched::default();
        for (key, &remote) in keys.iter().zip(indexes) {
            let remote = BlockIndex::new(remote);
            match rnd.available.remove(key) {
                Some((job, local)) => matched.add(local, remote, job),
                None => {
                    rnd.demanded.insert(key.clone(), remote);
                }
            }
        }
        if rnd.available.is_empty() {
            // Every supplied block is matched: give the map's memory back while the writes run.
            rnd.available = Map::default();
        }
        if keys.is_empty() {
            // Terminal fetch: the request is over on the peer's side. No transfer_done.
            self.finish_lookups(cx, id);
            let rounds: Vec<RoundSeq> = self
                .requests
                .get(id)
                .map(|r| r.round_keys())
                .unwrap_or_default();
            for key in rounds {
                self.finalize(link, cx, id, key, None, false);
            }
            return Ok(());
        }
        let (symmetric_miss, finishing, inflight) = (
            rnd.origin == Origin::Lookup && !rnd.demanded.is_empty(),
            rnd.finishing,
            rnd.inflight,
        );
        if rnd.origin == Origin::Store && !rnd.demanded.is_empty() {
            // Demand parked for a later store (PD): bounded by the store timeout.
            self.demand_lane
                .arm(cx.now, (RoundKey::new(id, round), serial));
        }
        if symmetric_miss {
            // A symmetric round's supply always comes before its fetch: unmatched demand can
            // never be served, so fail now rather than at the peer's load timeout.
            crate::warn_throttled!(cx.out.throttle, cx.now, "fetch wants blocks no lookup pinned; failing the round", peer = %self.peer, kv_request_id = %id, round = %round);
            self.finalize(link, cx, id, round, Some(false), true);
        } else if !matched.local.is_empty() {
            self.submit_transfer(link, cx, id, round, serial, matched);
        } else if finishing && inflight == 0 {
            self.finalize(link, cx, id, round, None, true);
        }
        Ok(())
    }

    fn submit_transfer(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        serial: u64,
        matched: Matched,
    ) {
        let tid = match self.peer_fault {
            None => cx
                .plane
                .write_blocks(&self.peer, &matched.local, &matched.remote),
            Some(_) => None,
        };
        let Some(tid) = tid else {
            warn!(peer = %self.peer, kv_request_id = %id, round = %round, blocks = matched.local.len(), "write_blocks failed");
            let Some(rnd) = self.round_mut(id, round, serial) else {
                return;
            };
            rnd.finishing = true;
            if rnd.inflight == 0 {
                self.finalize(link, cx, id, round, Some(false), true);
            }
            return;
        };
        if let Some(rnd) = self.round_mut(id, round, serial) {
            for job in &matched.jobs {
                if let Some(pin) = rnd.pin_mut(*job) {
                    pin.readers += 1;
                }
            }
        }
        if let Some(rnd) = self.round_mut(id, round, serial) {
            rnd.inflight += 1;
        }
        self.requests
            .entry(id.clone())
            .or_default()
            .inflight
            .push(tid);
        self.inflight.insert(
            tid,
            Inflight {
                id: id.clone(),
                round,
                serial,
                blocks: matched.local.len(),
                jobs: matched.jobs,
            },
        );
    }

    fn pop_inflight(&mut self, tid: TransferId) -> Option<Inflight> {
        let xfer = self.inflight.remove(&tid)?;
        for &job in &xfer.jobs {
            let pin = match self.round_mut(&xfer.id, xfer.round, xfer.serial) {
                Some(rnd) => rnd.pin_mut(job),
                None => self.orphans.get_mut(&job).map(|o| &mut o.pin),
            };
            if let Some(pin) = pin {
                pin.readers = pin.readers.saturating_sub(1);
            }
        }
        if let Some(rnd) = self.round_mut(&xfer.id, xfer.round, xfer.serial) {
            rnd.inflight -= 1;
        }
        if let Some(req) = self.requests.get_mut(&xfer.id) {
            req.inflight.retain(|t| *t != tid);
        }
        Some(xfer)
    }

    /// Completes the pins a terminal transfer read, unless another transfer still reads them.
    fn settle_transfer_jobs(&mut self, cx: &mut Cx<'_>, xfer: &Inflight, success: bool) {
        for &job in &xfer.jobs {
            let done = match self.round_mut(&xfer.id, xfer.round, xfer.serial) {
                Some(rnd) => match rnd.pin_mut(job) {
                    Some(pin) if pin.readers == 0 => rnd.remove_pin(job).is_some(),
                    _ => false,
                },
                None => match self.orphans.get(&job) {
                    Some(o) if o.pin.readers == 0 => self.orphans.remove(&job).is_some(),
                    _ => false,
                },
            };
            if done {
                self.complete_pin(cx, job, success);
            }
        }
    }

    /// Fails a round's pins that no inflight transfer reads (those keep their pins).
    fn fail_unread_jobs(
        &mut self,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        serial: u64,
    ) {
        let Some(rnd) = self.round_mut(id, round, serial) else {
            return;
        };
        let unread: SmallVec<[JobId; 2]> = rnd
            .pins
            .iter()
            .filter(|p| p.readers == 0)
            .map(|p| p.job)
            .collect();
        rnd.pins.retain(|p| p.readers > 0);
        for job in unread {
            self.complete_pin(cx, job, false);
        }
    }

    /// Ends one round: its jobs complete (success only if every block was written), and the
    /// peer gets `transfer_done` when `send_done` and it asked. A cancelled round with
    /// transfers still in flight waits for them.
    fn finalize(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        success: Option<bool>,
        send_done: bool,
    ) {
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        let Some(rnd) = req.round(round) else {
            return;
        };
        if rnd.is_cancelled() && rnd.inflight > 0 {
            return;
        }
        let Some(rnd) = req.remove_round(round) else {
            return;
        };
        let success = !rnd.is_cancelled() && success.unwrap_or_else(|| rnd.fully_written());
        let (serial, demand_received) = (rnd.serial, rnd.demand_received());
        for pin in rnd.pins {
            if pin.readers == 0 {
                self.complete_pin(cx, pin.job, success);
            } else {
                // Still read by a transfer: it completes when that transfer ends.
                let orphan = Orphan {
                    pin,
                    id: id.clone(),
                    round,
                    serial,
                };
                self.orphans.insert(pin.job, orphan);
            }
        }
        debug!(peer = %self.peer, kv_request_id = %id, round = %round, success, send_done, "round finalized");
        if send_done && demand_received {
            link.send(
                cx.out,
                cx.now,
                Message::TransferDone(TransferDone {
                    kv_request_id: id.clone(),
                    success,
                    round_seq: round,
                }),
            );
        }
        self.prune(id);
    }

    /// A cancelled round whose last transfer ended: no `transfer_done` if an abort is draining
    /// (the `abort_ack` answers the peer instead).
    fn finalize_cancelled(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
    ) {
        let aborting = self.aborts.contains_key(&RoundKey::new(id, round));
        self.finalize(link, cx, id, round, Some(false), !aborting);
    }

    // ---- completions ----

    /// Collects this peer's transfer completions and faults from the data plane.
    pub(crate) fn poll_plane(&mut self, link: &mut Link, cx: &mut Cx<'_>) {
        let poll = cx.plane.poll(&self.peer);
        if let Some(fault) = poll.peer_fault {
            if self.peer_fault.is_none() {
                self.peer_fault = Some(fault);
            }
        }
        for tid in poll.done {
            let Some(xfer) = self.pop_inflight(tid) else {
                warn!(peer = %self.peer, tid = tid.get(), "data plane reported an unknown transfer done");
                continue;
            };
            let cancelled = self
                .round_mut(&xfer.id, xfer.round, xfer.serial)
                .map(|r| r.is_cancelled());
            self.settle_transfer_jobs(cx, &xfer, cancelled != Some(true));
            if let Some(rnd) = self.round_mut(&xfer.id, xfer.round, xfer.serial) {
                let remaining = rnd.landed(xfer.blocks);
                let (cancelled, finishing, inflight) =
                    (rnd.is_cancelled(), rnd.finishing, rnd.inflight);
                if cancelled {
                    if inflight == 0 {
                        self.finalize_cancelled(link, cx, &xfer.id, xfer.round);
                    }
                } else if remaining == 0 {
                    self.finalize(link, cx, &xfer.id, xfer.round, Some(true), true);
                } else if finishing && inflight == 0 {
                    self.finalize(link, cx, &xfer.id, xfer.round, Some(false), true);
                }
            }
            self.after_transfer_end(link, cx, &xfer);
        }
        for tid in poll.failed {
            let Some(xfer) = self.pop_inflight(tid) else {
                warn!(peer = %self.peer, tid = tid.get(), "data plane reported an unknown transfer failed");
                continue;
            };
            let in_round = self
                .round_mut(&xfer.id, xfer.round, xfer.serial)
                .map(|r| r.cancel());
            if in_round == Some(true) {
                // The round fails, but its other transfers may still be writing: their jobs
                // keep their pins until those end.
                self.fail_unread_jobs(cx, &xfer.id, xfer.round, xfer.serial);
            }
            self.settle_transfer_jobs(cx, &xfer, false);
            if self
                .round_mut(&xfer.id, xfer.round, xfer.serial)
                .is_some_and(|r| r.inflight == 0)
            {
                self.finalize_cancelled(link, cx, &xfer.id, xfer.round);
            }
            self.after_transfer_end(link, cx, &xfer);
        }
    }

    fn after_transfer_end(&mut self, link: &mut Link, cx: &mut Cx<'_>, xfer: &Inflight) {
        let key = RoundKey::new(&xfer.id, xfer.round);
        if self.aborts.contains_key(&key) {
            self.drain_abort(link, cx, &xfer.id, xfer.round);
        }
        self.prune(&xfer.id);
    }

    // ---- aborts ----

    /// An `abort_fetch`: cancel the round, ack once no write of it can land. Idempotent.
    pub(crate) fn on_abort_fetch(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
    ) {
        let key = RoundKey::new(id, round);
        if !self.aborts.contains_key(&key) {
            if !self.requests.contains_key(id) {
                crate::warn_throttled!(cx.out.throttle, cx.now, "abort_fetch for an unknown request (acked anyway)", peer = %self.peer, kv_request_id = %id, round = %round);
            }
            self.aborts.insert(key.clone(), cx.now);
            self.abort_warn_lane.arm(cx.now, key);
            self.requests.entry(id.clone()).or_default().aborts += 1;
        }
        self.drain_abort(link, cx, id, round);
    }

    fn drain_abort(&mut self, link: &mut Link, cx: &mut Cx<'_>, id: &KvRequestId, round: RoundSeq) {
        let serial = self
            .requests
            .get(id)
            .and_then(|r| r.round(round))
            .map(|r| r.serial);
        if let Some(serial) = serial {
            let first = self
                .round_mut(id, round, serial)
                .is_some_and(|r| r.cancel());
            if first {
                self.fail_unread_jobs(cx, id, round, serial);
            }
        }
        let ids: Vec<TransferId> = self
            .requests
            .get(id)
            .map(|r| {
                r.inflight
                    .iter()
                    .copied()
                    .filter(|t| self.inflight.get(t).is_some_and(|x| x.round == round))
                    .collect()
            })
            .unwrap_or_default();
        if !ids.is_empty() {
            let Some(serial) = serial.or_else(|| {
                ids.first()
                    .and_then(|t| self.inflight.get(t))
                    .map(|x| x.serial)
            }) else {
                return;
            };
            if !self.cancel_due(id, round, serial, cx.now) {
                return;
            }
            let still = cx.plane.cancel(&ids, CancelMode::Wait);
            for tid in &ids {
                if !still.contains(tid) {
                    if let Some(xfer) = self.pop_inflight(*tid) {
                        self.settle_transfer_jobs(cx, &xfer, false);
                    }
                }
            }
            if !still.is_empty() {
                self.retry_lane
                    .arm(cx.now, (RoundKey::new(id, round), serial));
                return;
            }
        }
        if serial.is_some() {
            self.finalize(link, cx, id, round, Some(false), false);
        }
        self.finish_abort(link, cx, id, round);
    }

    fn finish_abort(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
    ) {
        let key = RoundKey::new(id, round);
        if self.aborts.remove(&key).is_some() {
            if let Some(req) = self.requests.get_mut(id) {
                req.aborts -= 1;
            }
        }
        self.slow_aborts.remove(&key);
        link.send(
            cx.out,
            cx.now,
            Message::AbortAck(Abort {
                kv_request_id: id.clone(),
                round_seq: round,
            }),
        );
        self.prune(id);
    }

    /// At most one wait-mode cancel per round per retry interval.
    fn cancel_due(&mut self, id: &KvRequestId, round: RoundSeq, serial: u64, now: Instant) -> bool {
        let interval = self.retry_lane.delay();
        let Some(rnd) = self.round_mut(id, round, serial) else {
            return true;
        };
        // Only a cancelled round is stopped: both callers cancel it first.
        let Some(cancel) = &mut rnd.cancel else {
            return true;
        };
        if cancel.last_stop_at.is_some_and(|at| now < at + interval) {
            return false;
        }
        cancel.last_stop_at = Some(now);
        true
    }

    /// Cancels a round whose store jobs timed out: wait-mode, released transfers settle.
    fn cancel_round(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        serial: u64,
    ) {
        if self.aborts.contains_key(&RoundKey::new(id, round)) {
            self.drain_abort(link, cx, id, round);
            return;
        }
        // The round may be gone already (its pins orphaned): its transfers still need stopping.
        if let Some(rnd) = self.round_mut(id, round, serial) {
            rnd.cancel();
        }
        if !self.cancel_due(id, round, serial, cx.now) {
            return;
        }
        let ids = self.round_transfers(id, round, serial);
        let still = if ids.is_empty() {
            Vec::new()
        } else {
            cx.plane.cancel(&ids, CancelMode::Wait)
        };
        for tid in &ids {
            if !still.contains(tid) {
                if let Some(xfer) = self.pop_inflight(*tid) {
                    self.settle_transfer_jobs(cx, &xfer, false);
                }
            }
        }
        if self
            .round_mut(id, round, serial)
            .is_some_and(|r| r.inflight == 0)
        {
            self.finalize_cancelled(link, cx, id, round);
        } else if !self.round_transfers(id, round, serial).is_empty() {
            self.retry_lane
                .arm(cx.now, (RoundKey::new(id, round), serial));
        }
    }

    /// The transfers in flight for one round (from the request's own short list).
    fn round_transfers(&self, id: &KvRequestId, round: RoundSeq, serial: u64) -> Vec<TransferId> {
        let Some(req) = self.requests.get(id) else {
            return Vec::new();
        };
        req.inflight
            .iter()
            .copied()
            .filter(|t| {
                self.inflight
                    .get(t)
                    .is_some_and(|x| x.round == round && x.serial == serial)
            })
            .collect()
    }

    // ---- lookups ----

    /// An inbound `lookup`, served at once against the parent.
    pub(crate) fn on_lookup(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        keys: Vec<OffloadKey>,
        round: RoundSeq,
    ) -> Result<(), InternalError> {
        self.next_lookup_id += 1;
        let n = self.next_lookup_id;
        let ctx = serve_ctx(&self.peer, id, n);
        cx.parent.on_new_request(&ctx);
        let mut lookup = ActiveLookup {
            ctx,
            round,
            keys,
            answers: Map::default(),
            pending: Vec::new(),
            deadline: cx.now + self.lookup_lane.delay(),
        };
        // Each unique key once, in wire order.
        let keys = lookup.keys.clone();
        let pin_failed = self.poll_keys(link, cx, id, &mut lookup, keys, true);
        if lookup.pending.is_empty() {
            self.finish_lookup(link, cx, id, lookup);
        } else {
            self.lookup_lane.arm(cx.now, (id.clone(), n));
            self.requests
                .entry(id.clone())
                .or_default()
                .lookups
                .insert(n, lookup);
            self.serve_list.insert(id.clone());
            self.arm_repoll(cx);
        }
        pin_failed
    }

    fn arm_repoll(&mut self, cx: &Cx<'_>) {
        if self.repoll_at.is_none() {
            self.repoll_at = Some(cx.now + cx.config.lookup_repoll_interval);
        }
    }

    /// Asks the parent about `keys`, pins new hits in one store job as supply of the lookup's
    /// round. `Err` if the parent would not pin keys it had just answered HIT (an internal
    /// error; those keys are answered MISS).
    fn poll_keys(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        lookup: &mut ActiveLookup,
        keys: Vec<OffloadKey>,
        first_pass: bool,
    ) -> Result<(), InternalError> {
        let mut hits: Vec<OffloadKey> = Vec::new();
        lookup.pending.clear();
        for key in keys {
            match lookup.answers.get(&key) {
                Some(Some(_)) => continue,
                // First pass: a repeat of a key already polled in this message.
                Some(None) if first_pass => continue,
                _ => {}
            }
            match cx.parent.lookup(&key, &lookup.ctx) {
                LookupResult::Hit => {
                    lookup.answers.insert(key.clone(), Some(true));
                    hits.push(key);
                }
                LookupResult::Miss => {
                    lookup.answers.insert(key, Some(false));
                }
                LookupResult::HitPending | LookupResult::Retry => {
                    lookup.answers.insert(key.clone(), None);
                    lookup.pending.push(key);
                }
            }
        }
        if hits.is_empty() {
            return Ok(());
        }
        match cx.parent.create_store_job(&hits, &lookup.ctx) {
            Some(job) if job.blocks.len() == hits.len() => {
                let supply = Supply {
                    job: job.job_id,
                    keys: &hits,
                    blocks: &job.blocks,
                    round: lookup.round,
                    from_lookup: true,
                };
                self.add_stored_blocks(link, cx, id, supply);
                Ok(())
            }
            other => {
                if let Some(job) = other {
                    cx.parent.complete_store_job(job.job_id, false);
                }
                for key in hits {
                    lookup.answers.insert(key, Some(false));
                }
                Err(InternalError::PinRefused(lookup.ctx.clone()))
            }
        }
    }

    /// Answers a lookup (one `lookup_resp`, every key in wire order) and closes its context.
    fn finish_lookup(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        lookup: ActiveLookup,
    ) {
        if !lookup.keys.is_empty() {
            let hits = lookup
                .keys
                .iter()
                .map(|k| lookup.answers.get(k).copied().flatten().unwrap_or(false))
                .collect();
            link.send(
                cx.out,
                cx.now,
                Message::LookupResp(LookupResp {
                    kv_request_id: id.clone(),
                    keys: lookup.keys,
                    hits,
                }),
            );
        }
        cx.parent.on_request_finished(&lookup.ctx);
    }

    /// Asks again about pending keys of parked lookups; answers those now complete, and those
    /// past their deadline with MISS for what is still pending.
    pub(crate) fn serve(&mut self, link: &mut Link, cx: &mut Cx<'_>) -> Result<(), InternalError> {
        self.repoll_at = None;
        let mut result = Ok(());
        for id in self.serve_list.drain().collect::<Vec<_>>() {
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            let parked = std::mem::take(&mut req.lookups);
            for (n, mut lookup) in parked {
                let keys = std::mem::take(&mut lookup.pending);
                if let Err(e) = self.poll_keys(link, cx, &id, &mut lookup, keys, false) {
                    result = Err(e);
                }
                if !lookup.pending.is_empty() && cx.now >= lookup.deadline {
                    cx.out.counters.pending_expired += lookup.pending.len() as u64;
                    for key in std::mem::take(&mut lookup.pending) {
                        lookup.answers.insert(key, Some(false));
                    }
                }
                if lookup.pending.is_empty() {
                    self.finish_lookup(link, cx, &id, lookup);
                } else if let Some(req) = self.requests.get_mut(&id) {
                    req.lookups.insert(n, lookup);
                }
            }
            if self
                .requests
                .get(&id)
                .is_some_and(|r| !r.lookups.is_empty())
            {
                self.serve_list.insert(id);
            } else {
                self.prune(&id);
            }
        }
        if !self.serve_list.is_empty() {
            self.arm_repoll(cx);
        }
        result
    }

    /// Closes the lookup phase of a request (terminal fetch or local finish): parked lookups
    /// are dropped without a reply and their contexts closed.
    fn finish_lookups(&mut self, cx: &mut Cx<'_>, id: &KvRequestId) {
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        for (_, lookup) in std::mem::take(&mut req.lookups) {
            cx.parent.on_request_finished(&lookup.ctx);
        }
        self.serve_list.remove(id);
        self.prune(id);
    }

    /// The request finished locally (a PD producer): rounds still waiting for stores fail now,
    /// so the peer does not wait out its load timeout.
    pub(crate) fn finish(&mut self, link: &mut Link, cx: &mut Cx<'_>, id: &KvRequestId) {
        self.finish_lookups(cx, id);
        let rounds: Vec<(RoundSeq, bool)> = match self.requests.get_mut(id) {
            Some(req) => req
                .rounds
                .iter_mut()
                .map(|(k, r)| {
                    r.finishing = true;
                    (*k, r.demand_received() && r.inflight == 0)
                })
                .collect(),
            None => return,
        };
        for (round, ready) in rounds {
            if ready {
                self.finalize(link, cx, id, round, None, true);
            }
        }
    }

    // ---- timeouts ----

    pub(crate) fn handle_timeout(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
    ) -> Result<(), InternalError> {
        let now = cx.now;
        let mut result = Ok(());
        if self.repoll_at.is_some_and(|at| at <= now) {
            result = self.serve(link, cx);
        }
        while let Some((_, (id, n))) = self.lookup_lane.pop_due(now) {
            if self
                .requests
                .get(&id)
                .is_some_and(|r| r.lookups.contains_key(&n))
            {
                self.serve_list.insert(id);
                if let Err(e) = self.serve(link, cx) {
                    result = Err(e);
                }
            }
        }
        let store_delay = self.store_lane.delay();
        while let Some((deadline, (RoundKey { id, round }, serial, job))) =
            self.store_lane.pop_due(now)
        {
            let expired = |pin: &Pin| pin.submitted_at + store_delay == deadline;
            let readers = match self.round_mut(&id, round, serial) {
                Some(rnd) => match rnd.pin_mut(job) {
                    Some(pin) if expired(pin) => {
                        let readers = pin.readers;
                        // The job's blocks must not be offered to a fetch any more.
                        rnd.available.retain(|_, (j, _)| *j != job);
                        Some(readers)
                    }
                    _ => None,
                },
                None => self
                    .orphans
                    .get(&job)
                    .filter(|o| {
                        o.id == id && o.round == round && o.serial == serial && expired(&o.pin)
                    })
                    .map(|o| o.pin.readers),
            };
            let Some(readers) = readers else {
                continue;
            };
            crate::warn_throttled!(cx.out.throttle, now, "store job timed out", peer = %self.peer, job = job.get(), kv_request_id = %id);
            if readers > 0 {
                // Writes still read it: cancel them; the pin stays until they are terminal.
                self.cancel_round(link, cx, &id, round, serial);
            } else if let Some(rnd) = self.round_mut(&id, round, serial) {
                if rnd.remove_pin(job).is_some() {
                    let unfetched =
                        rnd.pins.is_empty() && !rnd.demand_received() && rnd.inflight == 0;
                    self.complete_pin(cx, job, false);
                    if unfetched {
                        // Hit and never fetched: drop the round (and the request, if that was
                        // all it held) instead of keeping it until the session ends.
                        self.finalize(link, cx, &id, round, Some(false), false);
                        self.expired.insert(RoundKey::new(&id, round), now);
                        self.expired_lane.arm(now, RoundKey::new(&id, round));
                    }
                }
            }
        }
        let demand_delay = self.demand_lane.delay();
        while let Some((_, (RoundKey { id, round }, serial))) = self.demand_lane.pop_due(now) {
            let starved = self.round_mut(&id, round, serial).is_some_and(|r| {
                !r.is_cancelled() && r.inflight == 0 && !r.demanded.is_empty() && r.pins.is_empty()
            });
            if starved {
                debug!(peer = %self.peer, kv_request_id = %id, round = %round, waited = ?demand_delay,
                    "fetch demand got no supply within the store timeout; failing the round");
                self.finalize(link, cx, &id, round, Some(false), true);
            }
        }
        let expired_delay = self.expired_lane.delay();
        while let Some((at, key)) = self.expired_lane.pop_due(now) {
            if self
                .expired
                .get(&key)
                .is_some_and(|t| *t + expired_delay == at)
            {
                self.expired.remove(&key);
            }
        }
        while let Some((_, (RoundKey { id, round }, serial))) = self.retry_lane.pop_due(now) {
            if !self.round_transfers(&id, round, serial).is_empty() {
                self.cancel_round(link, cx, &id, round, serial);
            }
        }
        while let Some((_, key)) = self.abort_warn_lane.pop_due(now) {
            if self.aborts.contains_key(&key) && self.slow_aborts.insert(key.clone()) {
                warn!(peer = %self.peer, kv_request_id = %key.id, round = %key.round,
                    "abort still waiting for transfers to stop; holding their pins and the abort_ack");
            }
        }
        result
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        earliest([
            self.repoll_at,
            self.lookup_lane.next_deadline(),
            self.store_lane.next_deadline(),
            self.demand_lane.next_deadline(),
            self.expired_lane.next_deadline(),
            self.retry_lane.next_deadline(),
            self.abort_warn_lane.next_deadline(),
        ])
    }

    /// Tears down: every store job fails, inflight transfers are cancelled, parked lookups'
    /// contexts are closed.
    pub(crate) fn close(&mut self, cx: &mut Cx<'_>) -> ServerClose {
        let mut result = ServerClose::default();
        if !self.inflight.is_empty() {
            let ids: Vec<TransferId> = self.inflight.keys().copied().collect();
            cx.plane.cancel(&ids, CancelMode::Immediate);
        }
        self.inflight.clear();
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
        self.retry_lane.clear();
        self.abort_warn_lane.clear();
        self.repoll_at = None;
        result
    }

    /// Transfer ids in flight (for shutdown drains).
    pub(crate) fn inflight_ids(&self) -> Vec<TransferId> {
        self.inflight.keys().copied().collect()
    }
}
