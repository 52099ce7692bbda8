//! The consumer side of one peer session: lookups (probes), fetch rounds, load timeouts and
//! aborts.
//!
//! Driven by [`Session`](super::Session) on the core's thread. Sends through the session's
//! [`Link`] (gated until the peer's ack) and reports load results as events. Every wait has a
//! deadline on a [`Lane`], as strict as vLLM 0.34's by default: lookups 8 s without progress,
//! loads 10 s for a request that ran its lookups (the peer confirmed every block) and 30 s for
//! one that did not (a PD fetch: the producer may still be computing), abort acks 5 s (then the
//! session ends: a producer that does not confirm an abort may still be writing). A failed
//! load's blocks are reported (handed back) only once fenced (`core/fencing.rs`).

use crate::maps::Map;
use std::time::Instant;

use kvpeer_proto::{Abort, Fetch, KvRequestId, Lookup, Message, OffloadKey, PeerId, RoundSeq};
use tracing::{debug, warn};

use super::{Cx, RoundKey};
use crate::config::CoreConfig;
use crate::core::fencing::Fencing;
use crate::output::{Link, Outbox};
use crate::timer::{earliest, Lane};
use crate::traits::{BlockIndex, JobId, WriteEnd};

/// One load the engine submitted: fetch `keys` into local `blocks`.
#[derive(Debug)]
pub(crate) struct Load {
    pub(crate) job: JobId,
    pub(crate) keys: Vec<OffloadKey>,
    pub(crate) blocks: Vec<BlockIndex>,
}

/// One fetch round in flight.
#[derive(Debug)]
struct InFlight {
    job: JobId,
    /// The local blocks the fetch named (writes into them are expected until it ends).
    blocks: Vec<BlockIndex>,
    submitted_at: Instant,
    /// Its request ran the lookup phase: its deadline is the P2P load timeout, else the PD
    /// one.
    probed: bool,
    aborted_at: Option<Instant>,
    /// The engine finished its request: its end answers none of the request's lookups (an
    /// id that comes back meanwhile is another request).
    of_finished: bool,
}

/// Per-request consumer state. Dropped as soon as it holds nothing live.
#[derive(Debug, Default)]
struct Request {
    /// Probe result per key: `None` while unanswered.
    probes: Map<OffloadKey, Option<bool>>,
    /// Probes still `None`, so "all answered" is O(1).
    unanswered: usize,
    /// Keys registered but not yet sent in a `lookup`.
    unsent: Vec<OffloadKey>,
    /// Already on the flush work-list.
    in_flush_list: bool,
    /// The current round; each fetch closes it and moves to the next.
    round: RoundSeq,
    /// Whether the peer holds lookup state, or the engine finished the request.
    phase: Phase,
    /// Fetch rounds in flight, by round.
    loads: Vec<(RoundSeq, InFlight)>,
    /// When the lookup phase gives up without progress.
    lookup_deadline: Option<Instant>,
    /// It ran the lookup phase (a probe was registered): its loads are symmetric-P2P ones,
    /// of blocks the peer confirmed, and time out sooner than a PD load (vLLM 0.34).
    probed: bool,
}

/// Where a consumer request stands with the peer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
enum Phase {
    /// The peer holds no lookup state of it that a fetch has not closed.
    #[default]
    Quiet,
    /// The peer holds lookup state that no fetch has closed: `finish` owes a terminal fetch.
    LookupOpen,
    /// The engine finished the request; only aborting loads keep it.
    Finished,
}

impl Request {
    fn is_finished(&self) -> bool {
        self.phase == Phase::Finished
    }

    fn is_idle(&self) -> bool {
        self.loads.is_empty() && self.probes.is_empty() && self.unsent.is_empty()
    }

    fn load_mut(&mut self, round: RoundSeq) -> Option<&mut InFlight> {
        self.loads
            .iter_mut()
            .find(|(r, _)| *r == round)
            .map(|(_, l)| l)
    }

    fn take_load(&mut self, round: RoundSeq) -> Option<InFlight> {
        let at = self.loads.iter().position(|(r, _)| *r == round)?;
        Some(self.loads.swap_remove(at).1)
    }
}

/// A deadline of the consumer side that ends the session.
#[derive(Debug)]
pub(crate) enum Expired {
    /// A request's lookups got no progress.
    Lookup(KvRequestId),
    /// An `abort_fetch` got no `abort_ack`.
    AbortAck(KvRequestId),
}

/// What a closed session leaves for the tier to fail.
#[derive(Debug, Default)]
pub(crate) struct ClientClose {
    /// Loads in flight: each fails once its blocks are fenced, or at once if its fetch never
    /// left.
    pub(crate) failed_jobs: Vec<FailedLoad>,
    /// Requests whose lookups can no longer be answered (loads or unanswered probes).
    pub(crate) failed_ids: Vec<KvRequestId>,
}

/// A load a closed session fails.
#[derive(Debug)]
pub(crate) struct FailedLoad {
    pub(crate) job: JobId,
    pub(crate) kv_request_id: KvRequestId,
    /// The engine still runs its request.
    pub(crate) live: bool,
    pub(crate) blocks: Vec<BlockIndex>,
    /// Its fetch never left (it waited for the peer's ack): no write of it can come, so its
    /// blocks go back at once, with no fence (vLLM 0.34: no held release).
    pub(crate) never_sent: bool,
}

/// The consumer side of one session.
#[derive(Debug)]
pub(crate) struct ClientRole {
    peer: PeerId,
    requests: Map<KvRequestId, Box<Request>>,
    /// Requests with unsent probes, visited by the next flush.
    flush_list: Vec<KvRequestId>,
    /// Loads in flight across all requests.
    active_loads: usize,
    /// Loads of requests that ran their lookups (`load_timeout`).
    load_lane: Lane<RoundKey>,
    /// Loads of requests that did not (`pd_load_timeout`).
    pd_load_lane: Lane<RoundKey>,
    abort_lane: Lane<RoundKey>,
    lookup_lane: Lane<KvRequestId>,
}

impl ClientRole {
    pub(crate) fn new(peer: PeerId, config: &CoreConfig) -> Self {
        ClientRole {
            peer,
            requests: Map::default(),
            flush_list: Vec::new(),
            active_loads: 0,
            load_lane: Lane::new(config.load_timeout),
            pd_load_lane: Lane::new(config.pd_load_timeout),
            abort_lane: Lane::new(config.abort_ack_timeout),
            lookup_lane: Lane::new(config.lookup_timeout),
        }
    }

    pub(crate) fn has_active_loads(&self) -> bool {
        self.active_loads > 0
    }

    /// Entries kept, live or not (the memory the role holds).
    pub(crate) fn entries(&self) -> usize {
        self.requests.len()
    }

    /// Drops a request once the engine has finished it and nothing of it is live. Until the
    /// engine finishes it, an idle request keeps its entry (and so its round counter): vLLM
    /// drops it as soon as it is idle and restarts it at round 0, so a late `transfer_done` or
    /// `abort_ack` of the old round 0 can complete the new one (upstream PR #56471).
    fn prune(&mut self, id: &KvRequestId) {
        if self
            .requests
            .get(id)
            .is_some_and(|r| r.is_finished() && r.is_idle())
        {
            self.requests.remove(id);
        }
    }

    /// The request's state, created at the round where it left off.
    fn request(&mut self, id: &KvRequestId) -> &mut Request {
        let req = self.requests.entry(id.clone()).or_default();
        // A finished id that comes back is a new request. Loads of the old one still waiting
        // for their `abort_ack` stay (their blocks are not fenced yet), and the new rounds start
        // after the old ones: an `abort_ack` or `transfer_done` names only the id and the round,
        // so an old round's must never match a new round's load.
        if req.is_finished() {
            let aborting = std::mem::take(&mut req.loads);
            let after = req.round.next();
            **req = Request::default();
            if !aborting.is_empty() {
                req.loads = aborting;
                req.round = after;
            }
        }
        req
    }

    /// Registers a probe, or returns its answer. `None` means "ask again later" (RETRY).
    /// Answers stay until a fetch closes the round or the request finishes.
    pub(crate) fn register_lookup(&mut self, id: &KvRequestId, key: &OffloadKey) -> Option<bool> {
        let req = self.request(id);
        req.probed = true;
        if let Some(answer) = req.probes.get(key) {
            return *answer;
        }
        req.probes.insert(key.clone(), None);
        req.unanswered += 1;
        req.unsent.push(key.clone());
        if !req.in_flush_list {
            req.in_flush_list = true;
            self.flush_list.push(id.clone());
        }
        None
    }

    /// Sends one `lookup` per request with new probes. Nothing before the peer's ack: the
    /// lookup deadline must not run while the peer cannot answer.
    pub(crate) fn flush(&mut self, link: &mut Link, out: &mut Outbox, now: Instant) {
        if !link.is_ready() {
            return;
        }
        for id in std::mem::take(&mut self.flush_list) {
            let Some(req) = self.requests.get_mut(&id) else {
                continue;
            };
            req.in_flush_list = false;
            if req.unsent.is_empty() {
                continue;
            }
            req.phase = Phase::LookupOpen;
            if req.lookup_deadline.is_none() {
                req.lookup_deadline = Some(self.lookup_lane.arm(now, id.clone()));
            }
            let keys = std::mem::take(&mut req.unsent);
            let round = req.round;
            debug!(peer = %link.peer, kv_request_id = %id, keys = keys.len(), "send lookup");
            link.send(
                out,
                now,
                Message::Lookup(Lookup {
                    kv_request_id: id,
                    keys,
                    round_seq: round,
                }),
            );
        }
    }

    /// Applies a `lookup_resp`. Pairs for unknown keys are ignored, so replies may be split
    /// or merged. Progress (a newly answered probe) re-arms the deadline; nothing else does.
    /// Whether it answered anything (a probe's answer is new or changed).
    pub(crate) fn on_lookup_resp(
        &mut self,
        now: Instant,
        id: &KvRequestId,
        keys: &[OffloadKey],
        hits: &[bool],
    ) -> bool {
        let Some(req) = self.requests.get_mut(id) else {
            return false;
        };
        let mut changed = false;
        let mut progressed = false;
        for (key, hit) in keys.iter().zip(hits) {
            if let Some(answer) = req.probes.get_mut(key) {
                if answer.is_none() {
                    req.unanswered -= 1;
                    progressed = true;
                }
                changed |= *answer != Some(*hit);
                *answer = Some(*hit);
            }
        }
        if req.unanswered == 0 {
            req.lookup_deadline = None;
        } else if progressed {
            req.lookup_deadline = Some(self.lookup_lane.arm(now, id.clone()));
        }
        changed
    }

    /// Sends the `fetch` that closes the current round, and starts its load.
    pub(crate) fn request_blocks(
        &mut self,
        link: &mut Link,
        out: &mut Outbox,
        now: Instant,
        id: &KvRequestId,
        load: Load,
    ) {
        let Load { job, keys, blocks } = load;
        // The wire's indexes, read before the load keeps its blocks (one allocation, as the
        // clone it replaces).
        let block_indexes = blocks.iter().map(|b| b.get()).collect();
        let req = self.request(id);
        let round = req.round;
        let probed = req.probed;
        req.round = round.next();
        req.loads.push((
            round,
            InFlight {
                job,
                blocks,
                submitted_at: now,
                probed,
                aborted_at: None,
                of_finished: false,
            },
        ));
        req.phase = Phase::Quiet;
        // The fetch closes the round: the next round probes afresh, since served blocks are
        // unpinned at the producer and may be evicted. The map's memory goes too: a request
        // often waits for its load with nothing more to probe.
        req.probes = Map::default();
        req.unanswered = 0;
        req.lookup_deadline = None;
        self.active_loads += 1;
        let lane = if probed {
            &mut self.load_lane
        } else {
            &mut self.pd_load_lane
        };
        lane.arm(now, RoundKey::new(id, round));
        debug!(peer = %link.peer, kv_request_id = %id, round = %round, blocks = keys.len(), "send fetch");
        // A terminal left by a retired fetch of this id would close this round on the peer.
        link.retract_queued_terminal(id);
        link.send(
            out,
            now,
            Message::Fetch(Fetch {
                kv_request_id: id.clone(),
                keys,
                block_indexes,
                round_seq: round,
            }),
        );
    }

    /// The request finished locally: abort its loads (kept until acked or timed out; one whose
    /// fetch never left fails now, [`ClientRole::retire_unsent`]), send the terminal empty
    /// fetch if the peer holds lookup state, drop the probes.
    pub(crate) fn finish(&mut self, link: &mut Link, cx: &mut Cx<'_>, id: &KvRequestId) {
        let now = cx.now;
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        let mut unsent = Vec::new();
        for (round, load) in &mut req.loads {
            load.of_finished = true;
            if load.aborted_at.is_some() {
                continue;
            }
            if link.retract_queued_fetch(id, *round) {
                unsent.push(*round);
                continue;
            }
            load.aborted_at = Some(now);
            self.abort_lane.arm(now, RoundKey::new(id, *round));
            link.send(
                cx.out,
                now,
                Message::AbortFetch(Abort {
                    kv_request_id: id.clone(),
                    round_seq: *round,
                }),
            );
        }
        if req.phase == Phase::LookupOpen && unsent.is_empty() {
            send_terminal(link, cx.out, now, id, req.round);
        }
        for round in unsent {
            self.retire_unsent(link, cx, id, round);
        }
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        req.probes.clear();
        req.unanswered = 0;
        req.unsent.clear();
        req.lookup_deadline = None;
        req.phase = Phase::Finished;
        self.prune(id);
    }

    /// Ends load `round` of `id`, whose `fetch` was taken back before it left (it waited for
    /// the peer's ack), as failed, now: the peer never learned of it, so no `abort_fetch` goes
    /// and no write of it can land (vLLM 0.34's retire). A terminal fetch goes in its place
    /// when the link opens, so a producer that parked the request's stores (PD) releases them,
    /// unless another load of the request is live (its fetch would be closed by it); a newer
    /// fetch of the id queued before then takes it back ([`Link::retract_queued_terminal`]).
    fn retire_unsent(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
    ) {
        let Some(next_round) = self.requests.get(id).map(|r| r.round) else {
            return;
        };
        // As if the peer had confirmed its end: it never learned of it.
        if !self.complete(cx, id, round, false) {
            return;
        }
        cx.out.counters.fetches_retired_unsent += 1;
        // The terminal would close every round of the id on the peer: not while another load
        // of it is live (a later round queued behind, whose own fetch serves the request).
        let live_load = self
            .requests
            .get(id)
            .is_some_and(|r| r.loads.iter().any(|(_, l)| l.aborted_at.is_none()));
        link.retract_queued_terminal(id);
        if !live_load {
            send_terminal(link, cx.out, cx.now, id, next_round);
        }
    }

    /// Ends a load (once) the peer confirmed ended (`transfer_done`, `abort_ack`): its blocks
    /// take no more writes from the peer; its result is out, a failure once the plane says no
    /// write of the peer can still land in them (a success whose blocks are not fenced is a
    /// failure: their bytes could still change).
    fn complete(
        &mut self,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        success: bool,
    ) -> bool {
        let Some(req) = self.requests.get_mut(id) else {
            return false;
        };
        let Some(load) = req.take_load(round) else {
            return false;
        };
        let live = !req.is_finished() && !load.of_finished;
        self.active_loads -= 1;
        cx.plane.end_writes(&self.peer, &load.blocks);
        let end = WriteEnd {
            confirmed: true,
            peer_ended: false,
            at: cx.now,
        };
        if success && cx.plane.writes_fenced(&self.peer, &load.blocks, end) {
            cx.out.load_done(load.job, id.clone(), true, live);
        } else {
            let fencing = Fencing {
                job: load.job,
                kv_request_id: id.clone(),
                live,
                peer: self.peer.clone(),
                blocks: load.blocks,
                confirmed: true,
                peer_ended: false,
                since: cx.now,
            };
            cx.out.fail_load(cx.plane, cx.now, fencing);
        }
        self.prune(id);
        true
    }

    pub(crate) fn on_transfer_done(
        &mut self,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        success: bool,
        round: RoundSeq,
    ) {
        if !self.complete(cx, id, round, success) {
            if let Some(suppressed) = cx
                .out
                .throttle
                .admit_ticked("transfer_done for no load in flight")
            {
                warn!(kv_request_id = %id, round = %round, suppressed, "transfer_done for no load in flight (duplicate, or raced with an abort)");
            }
        }
    }

    pub(crate) fn on_abort_ack(&mut self, cx: &mut Cx<'_>, id: &KvRequestId, round: RoundSeq) {
        if self.complete(cx, id, round, false) {
            cx.out.counters.abort_acks += 1;
        } else {
            if let Some(suppressed) = cx
                .out
                .throttle
                .admit_ticked("abort_ack for no load in flight")
            {
                warn!(kv_request_id = %id, round = %round, suppressed, "abort_ack for no load in flight (duplicate, or raced with a timeout)");
            }
        }
    }

    /// Fires due deadlines: loads past their timeout are aborted. Returns what expired, if
    /// anything, that ends the session: a request whose lookup phase got no progress, or an
    /// abort that got no `abort_ack` (the peer may still be writing its blocks: only the
    /// session's end fences them, vLLM 0.34's escalation).
    pub(crate) fn handle_timeout(&mut self, link: &mut Link, cx: &mut Cx<'_>) -> Option<Expired> {
        let now = cx.now;
        let mut due = Vec::new();
        for (lane, probed) in [(&mut self.load_lane, true), (&mut self.pd_load_lane, false)] {
            while let Some((deadline, key)) = lane.pop_due(now) {
                due.push((deadline, lane.delay(), probed, key));
            }
        }
        // Aborts go out in the order their loads timed out, whichever lane.
        due.sort_by_key(|(deadline, ..)| *deadline);
        for (deadline, delay, probed, RoundKey { id, round }) in due {
            let Some(load) = self.requests.get_mut(&id).and_then(|r| r.load_mut(round)) else {
                continue;
            };
            // A request id can come back after it finished, with round numbers from 0 again:
            // only the load started exactly one delay before this deadline, on its lane, is the
            // one armed.
            if load.aborted_at.is_some()
                || load.probed != probed
                || load.submitted_at + delay != deadline
            {
                continue;
            }
            if link.retract_queued_fetch(&id, round) {
                crate::warn_throttled!(cx.out.throttle, now, "load timed out before its fetch was sent (the peer never acked our connect); failed, no abort_fetch", peer = %link.peer, kv_request_id = %id, round = %round);
                self.retire_unsent(link, cx, &id, round);
                continue;
            }
            crate::warn_throttled!(cx.out.throttle, now, "load timed out; sending abort_fetch", peer = %link.peer, kv_request_id = %id, round = %round);
            load.aborted_at = Some(now);
            self.abort_lane.arm(now, RoundKey::new(&id, round));
            link.send(
                cx.out,
                now,
                Message::AbortFetch(Abort {
                    kv_request_id: id,
                    round_seq: round,
                }),
            );
        }
        let abort_delay = self.abort_lane.delay();
        while let Some((deadline, RoundKey { id, round })) = self.abort_lane.pop_due(now) {
            let fired = self
                .requests
                .get_mut(&id)
                .and_then(|r| r.load_mut(round))
                .is_some_and(|l| l.aborted_at.map(|at| at + abort_delay) == Some(deadline));
            if fired {
                return Some(Expired::AbortAck(id));
            }
        }
        let mut expired = None;
        while let Some((deadline, id)) = self.lookup_lane.pop_due(now) {
            let current = self.requests.get(&id).and_then(|r| r.lookup_deadline);
            if current == Some(deadline) && expired.is_none() {
                expired = Some(Expired::Lookup(id));
            }
        }
        expired
    }

    /// The engine drains before a reset (vLLM 0.34's `abort_loads`): every load not aborting
    /// yet is aborted now, as at its timeout, so a producer that never writes cannot hold the
    /// reset for the whole load timeout. Each ends at its `abort_ack` (failed), or with the
    /// session at the abort-ack timeout; one whose fetch never left fails now. Returns how many
    /// were aborted.
    pub(crate) fn abort_loads(&mut self, link: &mut Link, cx: &mut Cx<'_>) -> usize {
        let now = cx.now;
        let (mut aborted, mut unsent) = (Vec::new(), Vec::new());
        for (id, req) in self.requests.iter_mut() {
            for (round, load) in req.loads.iter_mut() {
                if load.aborted_at.is_some() {
                    continue;
                }
                if link.retract_queued_fetch(id, *round) {
                    unsent.push(RoundKey::new(id, *round));
                } else {
                    load.aborted_at = Some(now);
                    aborted.push(RoundKey::new(id, *round));
                }
            }
        }
        for key in unsent {
            self.retire_unsent(link, cx, &key.id, key.round);
        }
        for key in &aborted {
            self.abort_lane.arm(now, key.clone());
            link.send(
                cx.out,
                now,
                Message::AbortFetch(Abort {
                    kv_request_id: key.id.clone(),
                    round_seq: key.round,
                }),
            );
        }
        aborted.len()
    }

    /// Whether probes wait for the next flush.
    pub(crate) fn has_flush_list(&self) -> bool {
        !self.flush_list.is_empty()
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        earliest([
            self.load_lane.next_deadline(),
            self.pd_load_lane.next_deadline(),
            self.abort_lane.next_deadline(),
            self.lookup_lane.next_deadline(),
        ])
    }

    /// Tears down: every load in flight fails; every request with a load or an unanswered
    /// probe is reported so its lookups answer MISS from now on. `link` (closed or not) says
    /// which fetches never left.
    pub(crate) fn close(&mut self, link: &Link) -> ClientClose {
        let mut result = ClientClose::default();
        for (id, req) in self.requests.drain() {
            let live = !req.is_finished();
            if live && (!req.loads.is_empty() || req.unanswered > 0) {
                result.failed_ids.push(id.clone());
            }
            for (round, load) in req.loads {
                result.failed_jobs.push(FailedLoad {
                    job: load.job,
                    kv_request_id: id.clone(),
                    live: live && !load.of_finished,
                    blocks: load.blocks,
                    never_sent: link.fetch_never_sent(&id, round),
                });
            }
        }
        self.flush_list.clear();
        self.active_loads = 0;
        self.load_lane.clear();
        self.pd_load_lane.clear();
        self.abort_lane.clear();
        self.lookup_lane.clear();
        result
    }
}

/// Queues the terminal (empty) fetch of `id` at `round`: the request is over on our side, and
/// the peer releases what it holds of it (lookup pins, parked stores).
fn send_terminal(
    link: &mut Link,
    out: &mut Outbox,
    now: Instant,
    id: &KvRequestId,
    round: RoundSeq,
) {
    link.send(
        out,
        now,
        Message::Fetch(Fetch {
            kv_request_id: id.clone(),
            keys: Vec::new(),
            block_indexes: Vec::new(),
            round_seq: round,
        }),
    );
}
