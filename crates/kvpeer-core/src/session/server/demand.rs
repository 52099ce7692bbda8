//! Demand: the peer's `fetch` for a round, and the writes it starts.
//!
//! Contract: a second non-empty fetch for a round is a protocol violation; the empty fetch ends
//! the request on the peer's side (no `transfer_done`); demand that supply can never meet
//! (symmetric) fails at once, demand waiting for a PD store is bounded by the store timeout; a
//! write that cannot start finishes its round as failed once nothing else is in flight.

use kvpeer_proto::{KvRequestId, Message, OffloadKey, RoundSeq, TransferDone};

use super::{Demand, Held, Inflight, Matched, Origin, Round, Serial, ServerRole};
use crate::error::ProtocolViolation;
use crate::maps::Map;
use crate::output::Link;
use crate::session::{Cx, RoundKey};
use crate::traits::BlockIndex;

impl ServerRole {
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
        if !keys.is_empty() && self.no_room_for(id, cx.config) {
            // The peer holds its share of requests: fail the round without keeping anything.
            crate::warn_throttled!(cx.out.throttle, cx.now, "peer holds its share of requests; failing its fetch",
                peer = %self.peer, kv_request_id = %id, requests = self.requests.len());
            cx.out.counters.fetches_over_budget += 1;
            link.send(
                cx.out,
                cx.now,
                Message::TransferDone(TransferDone {
                    kv_request_id: id.clone(),
                    success: false,
                    round_seq: round,
                }),
            );
            return Ok(());
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
        let (symmetric_miss, parked, finishing, inflight) = (
            rnd.origin == Origin::Lookup && !rnd.demanded.is_empty(),
            rnd.origin == Origin::Store && !rnd.demanded.is_empty(),
            rnd.finishing,
            rnd.inflight,
        );
        if parked {
            // Demand parked for a later store (PD): bounded by the store timeout, and by the
            // peer's share of held keys and bytes.
            let held = Held::of(keys);
            if self.held.over(held, cx.config) {
                crate::warn_throttled!(cx.out.throttle, cx.now, "peer holds its share of parked fetches; failing its fetch",
                    peer = %self.peer, kv_request_id = %id, keys = keys.len(), held_keys = self.held.keys, held_bytes = self.held.bytes);
                cx.out.counters.fetches_over_budget += 1;
                self.finalize(link, cx, id, round, Some(false), true);
                return Ok(());
            }
            if let Some(rnd) = self.round_mut(id, round, serial) {
                rnd.held = held;
                self.held.add(held);
            }
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

    pub(super) fn submit_transfer(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        serial: Serial,
        matched: Matched,
    ) {
        let tid = match self.peer_fault {
            None => cx
                .plane
                .write_blocks(&self.peer, &matched.local, &matched.remote),
            Some(_) => None,
        };
        let Some(tid) = tid else {
            crate::warn_throttled!(cx.out.throttle, cx.now, "write_blocks failed", peer = %self.peer, kv_request_id = %id, round = %round, blocks = matched.local.len());
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
        self.request_entry(id).inflight.push(tid);
        self.inflight.insert(
            tid,
            Inflight {
                id: id.clone(),
                round,
                serial,
                blocks: matched.local.len(),
                jobs: matched.jobs,
                posted_at: cx.now,
            },
        );
        // Writes of a plane that bounds them itself (tcp: by their bytes) are not timed here.
        if !self.stall_lane.delay().is_zero() && !cx.plane.bounds_write_time(&self.peer) {
            self.stall_lane.arm(cx.now, tid);
        }
    }
}
