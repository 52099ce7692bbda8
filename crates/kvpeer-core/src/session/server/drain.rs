//! The engine's drain before a cache reset (vLLM's `drain_jobs`): every store this peer's
//! rounds hold that no write reads fails now, as vLLM 0.34's tier does
//! (`_drain_session_stores`), so the engine's wait is bounded by the writes in flight, not by
//! the store timeout.
//!
//! Contract (core thread, from `Core::fail_unwritten_stores`): writes in flight are never
//! cancelled (the engine needs its memory quiet, not aborted); their pins end with them, and
//! their rounds with the last of them. A round left with nothing to write ends at once: a
//! fetched one tells its peer `transfer_done(false)`, an unfetched one is remembered as
//! expired, so a late fetch fails in one round trip and never reads the chunks the reset
//! frees.

use kvpeer_proto::{KvRequestId, RoundSeq};

use super::{Serial, ServerRole};
use crate::output::Link;
use crate::session::{Cx, RoundKey};
use crate::traits::JobId;

impl ServerRole {
    /// Fails every pin of every round that no write reads; returns their jobs.
    pub(crate) fn fail_unwritten_stores(&mut self, link: &mut Link, cx: &mut Cx<'_>) -> Vec<JobId> {
        let rounds: Vec<(KvRequestId, RoundSeq, Serial)> = self
            .requests
            .iter()
            .flat_map(|(id, req)| {
                req.rounds
                    .iter()
                    .map(move |(round, rnd)| (id.clone(), *round, rnd.serial))
            })
            .collect();
        let mut failed = Vec::new();
        for (id, round, serial) in rounds {
            let Some(rnd) = self.round_mut(&id, round, serial) else {
                continue;
            };
            // Nothing more of it is offered to a fetch; what is written now finishes it.
            rnd.available.clear();
            rnd.finishing = true;
            let (fetched, writing) = (rnd.demand_received(), rnd.inflight > 0);
            failed.extend(self.fail_unread_jobs(cx, &id, round, serial));
            if writing {
                continue;
            }
            let aborting = self.aborts.contains_key(&RoundKey::new(&id, round));
            self.finalize(link, cx, &id, round, Some(false), !aborting);
            if !fetched {
                self.expired.insert(RoundKey::new(&id, round), cx.now);
                self.expired_lane.arm(cx.now, RoundKey::new(&id, round));
            }
        }
        failed
    }
}
