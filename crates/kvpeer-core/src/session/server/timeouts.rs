//! Timeouts of the producer side: lookup re-polls and deadlines, store jobs, demand waiting
//! for supply, forgotten expired rounds, cancellation retries, slow-abort warnings.
//!
//! Contract: an entry fires only if it still matches what it timed (the same pin, the same
//! round serial); a stale entry is dropped; a store job that times out while read cancels the
//! writes reading it, and one never fetched drops its round.

use std::time::Instant;

use tracing::debug;

use super::{Pin, ServerRole};
use crate::error::{InternalError, PlaneError, TransferStalled};
use crate::output::Link;
use crate::session::{Cx, RoundKey};

impl ServerRole {
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
        let stall_delay = self.stall_lane.delay();
        if self.stall_lane.next_deadline().is_some_and(|at| at <= now) {
            // A write the plane already reports done is no stall, whichever of the two the
            // driver hands the core first (vLLM 0.34: "done in the same poll").
            self.poll_plane(link, cx);
        }
        while let Some((deadline, tid)) = self.stall_lane.pop_due(now) {
            let stalled = self
                .inflight
                .get(&tid)
                .is_some_and(|t| t.posted_at + stall_delay == deadline);
            if stalled && self.peer_fault.is_none() {
                // Nothing is released here: the write and its pins stay until the plane says
                // it ended; the session ends once it drains, or after `peer_fault_drain`.
                crate::warn_throttled!(cx.out.throttle, now, "a write to the peer made no progress; faulting the peer",
                    peer = %self.peer, stalled_s = stall_delay.as_secs_f64());
                self.peer_fault = Some(PlaneError::transport(TransferStalled(stall_delay)));
                self.transfer_stalled = true;
            }
        }
        while let Some((_, key)) = self.abort_warn_lane.pop_due(now) {
            if self.aborts.contains_key(&key) && self.slow_aborts.insert(key.clone()) {
                crate::warn_throttled!(cx.out.throttle, now,
                    "abort still waiting for transfers to stop; holding their pins and the abort_ack",
                    peer = %self.peer, kv_request_id = %key.id, round = %key.round);
            }
        }
        result
    }
}

impl ServerRole {
    /// Releases this peer's oldest lookup pins that no write reads and no fetch asked for yet,
    /// as their store timeout would (the round is dropped; a later fetch of it fails in one
    /// round trip), until `want` distinct blocks went or none is left: the node-wide pin cap
    /// (`CoreConfig::max_pinned_blocks`) takes them from its heaviest holder. A pin younger than
    /// `pin_eviction_min_age` stays (its fetch is likely on the way: a consumer fetches right
    /// after its lookup). The blocks released.
    pub(crate) fn evict_oldest_pins(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        want: usize,
    ) -> usize {
        let before = self.pinned.len();
        let min_age = cx.config.pin_eviction_min_age;
        let mut i = 0;
        while before.saturating_sub(self.pinned.len()) < want {
            let Some((key, serial, job)) = self.store_lane.get(i).cloned() else {
                break;
            };
            i += 1;
            let RoundKey { id, round } = key;
            let Some(rnd) = self.round_mut(&id, round, serial) else {
                continue;
            };
            let young = |at: Instant| cx.now.saturating_duration_since(at) < min_age;
            if rnd.pin_mut(job).is_some_and(|pin| young(pin.submitted_at)) {
                break; // the lane is in pinning order: every later one is younger
            }
            let idle = rnd.pin_mut(job).is_some_and(|pin| pin.readers == 0)
                && !rnd.demand_received()
                && rnd.inflight == 0;
            if !idle {
                continue;
            }
            rnd.available.retain(|_, (j, _)| *j != job);
            if rnd.remove_pin(job).is_none() {
                continue;
            }
            let unfetched = rnd.pins.is_empty();
            self.complete_pin(cx, job, false);
            if unfetched {
                self.finalize(link, cx, &id, round, Some(false), false);
                self.expired.insert(RoundKey::new(&id, round), cx.now);
                self.expired_lane.arm(cx.now, RoundKey::new(&id, round));
            }
        }
        before.saturating_sub(self.pinned.len())
    }
}
