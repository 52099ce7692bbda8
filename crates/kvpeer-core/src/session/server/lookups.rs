//! Lookups: inbound `lookup`s served against the local store, HIT pinned in one store job per
//! pass, HIT_PENDING/RETRY keys asked again until the pending deadline.
//!
//! Contract: every inbound `lookup` gets exactly one `lookup_resp`, all its keys in wire order
//! (keys still pending at the deadline answer MISS), unless the request ends first; every
//! serve context is opened and closed exactly once at the parent; a store that will not pin
//! keys it answered HIT is an internal error and those keys answer MISS.
//!
//! Fair shares (docs/security.md, G7): a peer's lookups are asked of the store in arrival
//! order, at most `lookup_slice_keys` keys per core step, so one huge lookup cannot hold the
//! core's thread while other peers wait; past `lookup_keys_per_sec` keys a second the peer's
//! slices yield to every session within its budget, and take only steps nobody else wants
//! (work-conserving: a lone peer is never held to the rate); keys past
//! `max_lookup_keys` of one lookup, and keys that would pin more than the peer's pin share,
//! answer MISS unasked; a lookup that would hold more keys, bytes or requests for the peer than
//! its share answers MISS at once.

use std::time::Instant;

use kvpeer_proto::{KvRequestId, LookupResp, Message, OffloadKey, RoundSeq};

use super::{serve_ctx, ActiveLookup, Answer, Held, Origin, ServerRole, Supply};
use crate::error::InternalError;
use crate::maps::Map;
use crate::output::Link;
use crate::session::Cx;
use crate::traits::LookupResult;

impl ServerRole {
    /// An inbound `lookup`: queued behind the peer's earlier lookups still being asked, and
    /// served at once (its first slice) if there are none.
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
        let held = Held::of(&keys);
        let end = keys.len().min(cx.config.max_lookup_keys);
        // Empty until a key hits or is pending (no allocation for a lookup that misses).
        let answers = Map::default();
        let mut lookup = ActiveLookup {
            ctx,
            round,
            keys,
            next: 0,
            end,
            held,
            answers,
            pending: Vec::new(),
            deadline: cx.now + self.lookup_lane.delay(),
        };
        // A new request also pays for its id (`no_room_for` checks the id alone).
        let mut need = held;
        if !self.requests.contains_key(id) {
            need.add(Held::id(id));
        }
        let over_budget = self.no_room_for(id, cx.config) || self.held.over(need, cx.config);
        if over_budget {
            crate::warn_throttled!(cx.out.throttle, cx.now, "peer holds its share of lookups; answering MISS",
                peer = %self.peer, kv_request_id = %id, keys = lookup.keys.len(),
                held_keys = self.held.keys, held_bytes = self.held.bytes, requests = self.requests.len());
            cx.out.counters.lookups_over_budget += 1;
            lookup.end = 0;
            self.held.add(held);
            self.finish_lookup(link, cx, id, lookup);
            return Ok(());
        }
        if end < lookup.keys.len() {
            let over = lookup.keys.len() - end;
            crate::warn_throttled!(cx.out.throttle, cx.now, "lookup has more keys than max_lookup_keys; the rest answer MISS",
                peer = %self.peer, kv_request_id = %id, keys = lookup.keys.len(), asked = end);
            cx.out.counters.lookup_keys_over_cap += over as u64;
        }
        self.held.add(held);
        self.lookup_lane.arm(cx.now, (id.clone(), n));
        self.request_entry(id).lookups.insert(n, lookup);
        self.backlog.push_back((id.clone(), n));
        if self.backlog.len() == 1 {
            self.serve_backlog(link, cx, false).1
        } else {
            // Behind the peer's earlier lookups: the next slice (already timed) reaches it.
            Ok(())
        }
    }

    /// Asks the store about the next slice of the peer's queued lookups: at most
    /// `lookup_slice_keys` keys, and no more than the peer's keys-per-second budget holds
    /// unless `spare` (a step no session within its budget wanted: the slice is whole, and the
    /// bucket is emptied, not put in debt). A lookup whose keys were all asked is answered (or
    /// parked on its pending keys). Returns how many keys were asked; what is left is due at
    /// `slice_at`, which the core's step serves in its host's turn (`core/slices.rs`).
    pub(crate) fn serve_backlog(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        spare: bool,
    ) -> (usize, Result<(), InternalError>) {
        self.slice_at = None;
        let slice = cx.config.lookup_slice_keys.max(1);
        // Refilled to `now` first either way: spare time then empties what the bucket holds now.
        let available = self.bucket.available(cx.now);
        let mut budget = if spare { slice } else { slice.min(available) };
        let mut asked = 0;
        let mut result = Ok(());
        while let Some((id, n)) = self.backlog.front().cloned() {
            let Some(mut lookup) = self
                .requests
                .get_mut(&id)
                .and_then(|r| r.lookups.remove(&n))
            else {
                // Answered (deadline) or dropped (the request ended) meanwhile.
                self.backlog.pop_front();
                continue;
            };
            if lookup.next >= lookup.end {
                // Its keys were all asked (deadline): parked or answered elsewhere.
                self.reinsert(&id, n, lookup);
                self.backlog.pop_front();
                continue;
            }
            if budget == 0 {
                self.reinsert(&id, n, lookup);
                break;
            }
            let take = budget.min(lookup.end - lookup.next);
            let keys = std::mem::take(&mut lookup.keys);
            let slice = &keys[lookup.next..lookup.next + take];
            if let Err(e) = self.poll_keys(link, cx, &id, &mut lookup, slice, true) {
                result = Err(e);
            }
            lookup.keys = keys;
            lookup.next += take;
            budget -= take;
            asked += take;
            if spare {
                self.bucket.take_spare(take);
            } else {
                self.bucket.take(take);
            }
            if lookup.next < lookup.end {
                self.reinsert(&id, n, lookup);
                continue;
            }
            self.backlog.pop_front();
            if lookup.pending.is_empty() {
                self.finish_lookup(link, cx, &id, lookup);
                self.prune(&id);
            } else {
                self.reinsert(&id, n, lookup);
                self.serve_list.insert(id.clone());
                self.arm_repoll(cx);
            }
        }
        if let Some((id, n)) = self.backlog.front() {
            cx.out.counters.lookup_slices_deferred += 1;
            let left = self
                .requests
                .get(id)
                .and_then(|r| r.lookups.get(n))
                .map_or(1, |l| l.end.saturating_sub(l.next).max(1));
            let want = left.min(slice);
            self.slice_at = Some(if self.bucket.available(cx.now) >= want {
                cx.now
            } else {
                self.bucket.when(cx.now, want)
            });
        }
        (asked, result)
    }

    /// When this peer's queued lookups want their next slice (`None`: none queued).
    pub(crate) fn slice_at(&self) -> Option<Instant> {
        self.slice_at
    }

    fn reinsert(&mut self, id: &KvRequestId, n: u64, lookup: ActiveLookup) {
        self.request_entry(id).lookups.insert(n, lookup);
    }

    pub(super) fn arm_repoll(&mut self, cx: &Cx<'_>) {
        if cx.parent.wakes_core() {
            // The parent calls `Core::serve` when it knows more; only deadlines remain.
            return;
        }
        if self.repoll_at.is_none() {
            self.repoll_at = Some(cx.now + cx.config.lookup_repoll_interval);
        }
    }

    /// Asks the parent about `keys`, pins new hits in one store job as supply of the lookup's
    /// round. `Err` if the parent would not pin keys it had just answered HIT (an internal
    /// error; those keys are answered MISS).
    pub(super) fn poll_keys(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        lookup: &mut ActiveLookup,
        keys: &[OffloadKey],
        first_pass: bool,
    ) -> Result<(), InternalError> {
        if first_pass && self.pinned.len() >= self.max_pins {
            // The peer holds its whole share pinned: every key of this slice is MISS, unasked,
            // and left out of `answers` (a key absent from it is answered MISS), so a hoarder's
            // lookups cost the node their decoding and their answer, no work per key.
            crate::warn_throttled!(cx.out.throttle, cx.now, "peer holds its share of pins; answering MISS",
                peer = %self.peer, kv_request_id = %id, keys = keys.len(), pinned = self.pinned.len(), share = self.max_pins);
            cx.out.counters.lookup_keys_over_share += keys.len() as u64;
            return Ok(());
        }
        let mut hits: Vec<OffloadKey> = Vec::new();
        let mut over_share = 0u64;
        for key in keys {
            match lookup.answers.get(key) {
                Some(Answer::Hit | Answer::Miss) => continue,
                // First pass: a repeat of a key already pending in this message.
                Some(Answer::Pending) if first_pass => continue,
                _ => {}
            }
            let more = Held::pins(hits.len() + 1);
            if self.pinned.len() + hits.len() >= self.max_pins || self.held.over(more, cx.config) {
                // The peer holds its share of the pool pinned (or of held keys: pins of the
                // same blocks over and over): MISS, not asked, not pinned.
                if !first_pass {
                    lookup.answers.insert(key.clone(), Answer::Miss);
                }
                over_share += 1;
                continue;
            }
            match cx.parent.lookup(key, &lookup.ctx) {
                LookupResult::Hit => {
                    lookup.answers.insert(key.clone(), Answer::Hit);
                    hits.push(key.clone());
                }
                LookupResult::Miss => {
                    if !first_pass {
                        // A pending key that settled as MISS.
                        lookup.answers.insert(key.clone(), Answer::Miss);
                    }
                }
                LookupResult::HitPending | LookupResult::Retry => {
                    if first_pass {
                        lookup.answers.insert(key.clone(), Answer::Pending);
                    }
                    lookup.pending.push(key.clone());
                }
            }
        }
        if over_share > 0 {
            crate::warn_throttled!(cx.out.throttle, cx.now, "peer holds its share of pins; answering MISS",
                peer = %self.peer, kv_request_id = %id, keys = over_share, pinned = self.pinned.len(), share = self.max_pins);
            cx.out.counters.lookup_keys_over_share += over_share;
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
                    origin: Origin::Lookup,
                };
                self.add_stored_blocks(link, cx, id, supply);
                Ok(())
            }
            other => {
                if let Some(job) = other {
                    cx.parent.complete_store_job(job.job_id, false);
                }
                for key in hits {
                    lookup.answers.insert(key, Answer::Miss);
                }
                Err(InternalError::PinRefused(lookup.ctx.clone()))
            }
        }
    }

    /// Answers a lookup (one `lookup_resp`, every key in wire order) and closes its context.
    pub(super) fn finish_lookup(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        lookup: ActiveLookup,
    ) {
        self.held.sub(lookup.held);
        if lookup.next < lookup.end {
            cx.out.counters.lookup_keys_unasked += (lookup.end - lookup.next) as u64;
        }
        if !lookup.keys.is_empty() {
            // Keys past the last one asked were never answered: MISS without a map probe.
            let asked = lookup.next.min(lookup.end);
            let hits = if lookup.answers.is_empty() {
                // Nothing hit: no probe per key.
                vec![false; lookup.keys.len()]
            } else {
                lookup
                    .keys
                    .iter()
                    .enumerate()
                    .map(|(i, k)| i < asked && lookup.answers.get(k) == Some(&Answer::Hit))
                    .collect()
            };
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
                // Still queued for its first pass: the backlog asks it, unless time is up.
                let queued = lookup.next < lookup.end;
                if queued && cx.now < lookup.deadline {
                    self.reinsert(&id, n, lookup);
                    continue;
                }
                if !queued {
                    let keys = std::mem::take(&mut lookup.pending);
                    if let Err(e) = self.poll_keys(link, cx, &id, &mut lookup, &keys, false) {
                        result = Err(e);
                    }
                }
                if !lookup.pending.is_empty() && cx.now >= lookup.deadline {
                    cx.out.counters.pending_expired += lookup.pending.len() as u64;
                    for key in std::mem::take(&mut lookup.pending) {
                        lookup.answers.insert(key, Answer::Miss);
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
                .is_some_and(|r| r.lookups.values().any(|l| l.next >= l.end))
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
    pub(super) fn finish_lookups(&mut self, cx: &mut Cx<'_>, id: &KvRequestId) {
        let Some(req) = self.requests.get_mut(id) else {
            return;
        };
        for (_, lookup) in std::mem::take(&mut req.lookups) {
            self.held.sub(lookup.held);
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
}
