//! Lookups: inbound `lookup`s served against the local store, HIT pinned in one store job per
//! pass, HIT_PENDING/RETRY keys asked again until the pending deadline.
//!
//! Contract: every inbound `lookup` gets exactly one `lookup_resp`, all its keys in wire order
//! (keys still pending at the deadline answer MISS), unless the request ends first; every
//! serve context is opened and closed exactly once at the parent; a store that will not pin
//! keys it answered HIT is an internal error and those keys answer MISS.

use kvpeer_proto::{KvRequestId, LookupResp, Message, OffloadKey, RoundSeq};

use super::{serve_ctx, ActiveLookup, Origin, ServerRole, Supply};
use crate::error::InternalError;
use crate::maps::Map;
use crate::output::Link;
use crate::session::Cx;
use crate::traits::LookupResult;

impl ServerRole {
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
                    lookup.answers.insert(key, Some(false));
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
    pub(super) fn finish_lookups(&mut self, cx: &mut Cx<'_>, id: &KvRequestId) {
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
}
