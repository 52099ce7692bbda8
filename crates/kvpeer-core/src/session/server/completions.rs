//! Completions: transfers that ended (done or failed), the pins they read, and the end of a
//! round.
//!
//! Contract: a pin completes exactly once, and never while a transfer still reads it (a pin
//! whose round ended first waits as an orphan); a round succeeds only if every demanded block
//! was written and it was not cancelled; `transfer_done` goes to the peer only for a round it
//! fetched, and not while an abort of it drains.

use kvpeer_proto::{KvRequestId, Message, RoundSeq, TransferDone};
use smallvec::SmallVec;
use tracing::debug;

use super::{Inflight, Orphan, Serial, ServerRole};
use crate::output::Link;
use crate::session::{Cx, RoundKey};
use crate::traits::{JobId, TransferId};

impl ServerRole {
    pub(super) fn pop_inflight(&mut self, tid: TransferId) -> Option<Inflight> {
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
    pub(super) fn settle_transfer_jobs(&mut self, cx: &mut Cx<'_>, xfer: &Inflight, success: bool) {
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

    /// Fails a round's pins that no inflight transfer reads (those keep their pins); their
    /// jobs.
    pub(super) fn fail_unread_jobs(
        &mut self,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
        serial: Serial,
    ) -> SmallVec<[JobId; 2]> {
        let Some(rnd) = self.round_mut(id, round, serial) else {
            return SmallVec::new();
        };
        let unread: SmallVec<[JobId; 2]> = rnd
            .pins
            .iter()
            .filter(|p| p.readers == 0)
            .map(|p| p.job)
            .collect();
        rnd.pins.retain(|p| p.readers > 0);
        for &job in &unread {
            self.complete_pin(cx, job, false);
        }
        unread
    }

    /// Ends one round: its jobs complete (success only if every block was written), and the
    /// peer gets `transfer_done` when `send_done` and it asked. A cancelled round with
    /// transfers still in flight waits for them.
    pub(super) fn finalize(
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
        self.held.sub(rnd.held);
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
    pub(super) fn finalize_cancelled(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        round: RoundSeq,
    ) {
        let aborting = self.aborts.contains_key(&RoundKey::new(id, round));
        self.finalize(link, cx, id, round, Some(false), !aborting);
    }

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
                crate::warn_throttled!(cx.out.throttle, cx.now, "data plane reported an unknown transfer done", peer = %self.peer, tid = tid.get());
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
                crate::warn_throttled!(cx.out.throttle, cx.now, "data plane reported an unknown transfer failed", peer = %self.peer, tid = tid.get());
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

    pub(super) fn after_transfer_end(&mut self, link: &mut Link, cx: &mut Cx<'_>, xfer: &Inflight) {
        let key = RoundKey::new(&xfer.id, xfer.round);
        if self.aborts.contains_key(&key) {
            self.drain_abort(link, cx, &xfer.id, xfer.round);
        }
        self.prune(&xfer.id);
    }
}
