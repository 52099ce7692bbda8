//! Parking: a PD producer's stores that wait for the peer's fetch, the binding of a request to
//! the session that fetched it, and the requests whose parked stores were reaped.
//!
//! Contract: a parked store is offered to the session of the first fetch for its request, or
//! fails at the unbound store timeout; a request whose stores were reaped fails its later
//! stores and fetches for the reaped-id retention; a binding outlives its session's state for
//! the request by at most one timeout.

use std::time::Instant;

use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

use super::Core;
use crate::traits::{BlockIndex, DataPlane, JobId, Parent};

#[derive(Debug)]
pub(super) struct Batch {
    pub(super) job: JobId,
    keys: Vec<OffloadKey>,
    blocks: Vec<BlockIndex>,
    submitted_at: Instant,
}

impl<P: Parent, D: DataPlane> Core<P, D> {
    /// A PD producer's store: failed if its parked stores were reaped, offered to the bound
    /// session if a fetch came, else parked until one does (or the unbound timeout).
    pub(super) fn park_store(
        &mut self,
        job: JobId,
        id: &KvRequestId,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) {
        if self.reaped.contains_key(id) {
            crate::warn_throttled!(self.out.throttle, self.now, "store for a request whose parked stores were reaped; failing it", kv_request_id = %id, job = job.get());
            self.complete_store(job, false);
            return;
        }
        if let Some(peer) = self.bound.get(id).cloned() {
            self.with_session(&peer, |s, cx, _| {
                s.add_stored_blocks(cx, id, &keys, &blocks, job)
            });
            self.settle();
            return;
        }
        let batches = self.unbound.entry(id.clone()).or_default();
        if batches.is_empty() {
            self.unbound_lane.arm(self.now, id.clone());
        }
        batches.push(Batch {
            job,
            keys,
            blocks,
            submitted_at: self.now,
        });
    }

    /// PD producer: a fetch binds its id to the session and replays parked stores; a fetch
    /// for a reaped id fails in one round trip. Only a fetch its session goes on serving
    /// binds, and never over another session still serving the id. A terminal fetch
    /// (`terminal`: the request is over at the decoder, whose fetch never left: vLLM 0.34's
    /// retire) reaps the stores parked for the id that no session serves, at once instead of
    /// at the unbound store timeout.
    pub(super) fn bind_fetch(&mut self, peer: &PeerId, id: KvRequestId, terminal: bool) {
        if self.reaped.contains_key(&id) {
            self.with_session(peer, |s, cx, _| s.finish_request(cx, &id));
            for batch in self.unbound.remove(&id).unwrap_or_default() {
                self.complete_store(batch.job, false);
            }
            return;
        }
        let serves = |core: &Self, p: &PeerId| core.sessions.get(p).is_some_and(|s| s.serves(&id));
        // A fetch its session does not hold (terminal, refused past the peer's share) routes
        // nothing: no binding, so a stream of them cannot grow the map.
        if !serves(self, peer) {
            // The decoder ended the request before it ever fetched: what waits for its fetch
            // is released. No more power than the first fetch's, which would take the stores
            // (it can only end them), and never over a session that serves the id.
            let held = self
                .bound
                .get(&id)
                .is_some_and(|holder| serves(self, holder));
            if terminal && !held && self.unbound.contains_key(&id) {
                crate::warn_throttled!(self.out.throttle, self.now, "the decoder ended a request before fetching it; failing its parked stores",
                    %peer, kv_request_id = %id);
                self.reap(id, &mut Vec::new());
            }
            return;
        }
        // Another live session's binding stays: a peer naming an id it saw cannot take the
        // stores meant for the session that fetched it first.
        if let Some(holder) = self.bound.get(&id) {
            if holder != peer && serves(self, holder) {
                crate::warn_throttled!(self.out.throttle, self.now, "fetch for an id another session holds; stores stay routed to it",
                    %peer, %holder, kv_request_id = %id);
                return;
            }
        }
        if self.bound.insert(id.clone(), peer.clone()).is_none() {
            self.bound_lane.arm(self.now, id.clone());
        }
        for batch in self.unbound.remove(&id).unwrap_or_default() {
            self.with_session(peer, |s, cx, _| {
                s.add_stored_blocks(cx, &id, &batch.keys, &batch.blocks, batch.job)
            });
        }
    }

    /// Bindings checked now: kept (and checked again later) while their session still serves
    /// the request, else dropped; a store for it later parks unbound, as before any fetch.
    pub(super) fn release_idle_bindings(&mut self) {
        while let Some((_, id)) = self.bound_lane.pop_due(self.now) {
            let Some(peer) = self.bound.get(&id) else {
                continue;
            };
            if self.sessions.get(peer).is_some_and(|s| s.serves(&id)) {
                self.bound_lane.arm(self.now, id);
            } else {
                self.bound.remove(&id);
            }
        }
    }

    pub(super) fn reap_unbound(&mut self) {
        let delay = self.unbound_lane.delay();
        while let Some((deadline, id)) = self.unbound_lane.pop_due(self.now) {
            let current = self
                .unbound
                .get(&id)
                .and_then(|b| b.first())
                .map(|b| b.submitted_at + delay);
            if current != Some(deadline) {
                continue;
            }
            let jobs = self.unbound.get(&id).map_or(0, Vec::len);
            crate::warn_throttled!(self.out.throttle, self.now, "parked stores were never fetched; failing them", kv_request_id = %id, jobs);
            self.reap(id, &mut Vec::new());
        }
    }

    /// Every parked store fails now, its request reaped (`fail_unwritten_stores`).
    pub(super) fn reap_all_unbound(&mut self) -> Vec<JobId> {
        let ids: Vec<KvRequestId> = self.unbound.keys().cloned().collect();
        let mut failed = Vec::new();
        for id in ids {
            self.reap(id, &mut failed);
        }
        failed
    }

    /// Fails request `id`'s parked stores (their jobs added to `failed`) and remembers it as
    /// reaped, so its later stores and fetches fail for the reaped retention.
    fn reap(&mut self, id: KvRequestId, failed: &mut Vec<JobId>) {
        for batch in self.unbound.remove(&id).unwrap_or_default() {
            self.complete_store(batch.job, false);
            failed.push(batch.job);
        }
        self.reaped.insert(id.clone(), self.now);
        self.reaped_lane.arm(self.now, id);
    }

    pub(super) fn expire_reaped(&mut self) {
        let delay = self.reaped_lane.delay();
        while let Some((deadline, id)) = self.reaped_lane.pop_due(self.now) {
            if self.reaped.get(&id).map(|at| *at + delay) == Some(deadline) {
                self.reaped.remove(&id);
            }
        }
    }
}
