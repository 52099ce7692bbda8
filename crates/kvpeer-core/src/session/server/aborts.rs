//! Aborts and cancellation: `abort_fetch` drains, and rounds whose store jobs timed out.
//!
//! Contract: `abort_ack` goes out only once no write of the round can still land (a write the
//! data plane reports still running is never reported stopped); an abort is idempotent and is
//! acked even for an unknown request; transfers are asked to stop at most once per retry
//! interval per round.

use std::time::Instant;

use kvpeer_proto::{Abort, KvRequestId, Message, RoundSeq};

use super::{Serial, ServerRole};
use crate::output::Link;
use crate::session::{Cx, RoundKey};
use crate::traits::{CancelMode, TransferId};

impl ServerRole {
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
            self.request_entry(id).aborts += 1;
        }
        self.drain_abort(link, cx, id, round);
    }

    pub(super) fn drain_abort(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
    ) {
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
            self.settle_stopped(cx, &ids, &still);
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

    pub(super) fn finish_abort(
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
    pub(super) fn cancel_due(
        &mut self,
        id: &KvRequestId,
        round: RoundSeq,
        serial: Serial,
        now: Instant,
    ) -> bool {
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

    /// Transfers of `asked` that a wait-mode cancel stopped (not in `still`): gone, and the
    /// pins they read settle as failed.
    fn settle_stopped(&mut self, cx: &mut Cx<'_>, asked: &[TransferId], still: &[TransferId]) {
        for tid in asked {
            if !still.contains(tid) {
                if let Some(xfer) = self.pop_inflight(*tid) {
                    self.settle_transfer_jobs(cx, &xfer, false);
                }
            }
        }
    }

    /// Cancels a round whose store jobs timed out: wait-mode, released transfers settle.
    pub(super) fn cancel_round(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        serial: Serial,
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
        self.settle_stopped(cx, &ids, &still);
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
    pub(super) fn round_transfers(
        &self,
        id: &KvRequestId,
        round: RoundSeq,
        serial: Serial,
    ) -> Vec<TransferId> {
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
}
