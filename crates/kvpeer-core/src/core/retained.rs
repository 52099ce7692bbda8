//! Retained transfers: writes of an ended session that the plane could not stop at once.
//!
//! When a session ends, its running writes are cancelled with [`CancelMode::Wait`]; a write
//! the plane reports still running may go on reading its source blocks (a NIXL WRITE in the
//! NIC, a tcp frame the sender thread is copying, an shm copy in progress). If those blocks were
//! unpinned now, the store could hand them to another request, and the rest of the write would
//! send the ended peer that request's bytes. So, as vLLM 0.34 does (`_retain`,
//! `_poll_retained`), the store jobs such a write reads stay pinned until the plane reports it
//! stopped (done or failed, in its poll of the peer), or until `retained_hold_cap` passes
//! (then it is cancelled with [`CancelMode::Immediate`], released anyway, and counted). A job
//! read by several retained writes is completed (failed) once none reads it. Meanwhile the peer
//! gets no new session (a new session's poll would take the old writes' reports), which the
//! core checks with [`Retained::holds`].
//!
//! Owned by the core, on its thread; no I/O of its own beyond the plane's poll and cancel.

use std::time::{Duration, Instant};

use kvpeer_proto::PeerId;
use smallvec::SmallVec;

use crate::ids::{JobId, TransferId};
use crate::traits::{CancelMode, DataPlane};

use crate::maps::Map;

#[derive(Debug)]
struct Entry {
    peer: PeerId,
    jobs: SmallVec<[JobId; 2]>,
    since: Instant,
}

/// The retained writes, and what releasing them gave back.
#[derive(Debug, Default)]
pub(crate) struct Retained {
    writes: Map<TransferId, Entry>,
    /// Retained writes per peer.
    peers: Map<PeerId, usize>,
}

/// What one look at the retained writes released.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Released {
    /// Store jobs no retained write reads any more: to be completed (failed) now.
    pub(crate) jobs: Vec<JobId>,
    /// Writes released at the hold cap while still running.
    pub(crate) forced: u64,
}

impl Retained {
    /// Keeps `writes` of `peer`'s ended session, from `now`.
    pub(crate) fn add(
        &mut self,
        peer: &PeerId,
        writes: Vec<(TransferId, SmallVec<[JobId; 2]>)>,
        now: Instant,
    ) {
        for (tid, jobs) in writes {
            let entry = Entry {
                peer: peer.clone(),
                jobs,
                since: now,
            };
            if self.writes.insert(tid, entry).is_none() {
                *self.peers.entry(peer.clone()).or_default() += 1;
            }
        }
    }

    /// Whether `peer` has writes retained (then it gets no new session).
    pub(crate) fn holds(&self, peer: &PeerId) -> bool {
        self.peers.contains_key(peer)
    }

    /// Whether any write is retained.
    pub(crate) fn is_empty(&self) -> bool {
        self.writes.is_empty()
    }

    /// When the oldest retained write reaches the hold cap.
    pub(crate) fn next_deadline(&self, cap: Duration) -> Option<Instant> {
        self.writes.values().map(|e| e.since + cap).min()
    }

    /// Takes what the plane reports of the retained peers' writes (a stopped write is
    /// released), releases those past `cap` at `now` (cancelled [`CancelMode::Immediate`]),
    /// or every one with `all` (the node is shutting down); returns the jobs none reads now.
    pub(crate) fn poll(
        &mut self,
        plane: &mut dyn DataPlane,
        now: Instant,
        cap: Duration,
        all: bool,
    ) -> Released {
        let mut out = Released::default();
        if self.writes.is_empty() {
            return out;
        }
        let mut stopped: Vec<TransferId> = Vec::new();
        let peers: Vec<PeerId> = self.peers.keys().cloned().collect();
        for peer in &peers {
            let poll = plane.poll(peer);
            stopped.extend(poll.done.iter().chain(&poll.failed).copied());
        }
        stopped.retain(|t| self.writes.contains_key(t));
        let expired: Vec<TransferId> = self
            .writes
            .iter()
            .filter(|(t, e)| (all || e.since + cap <= now) && !stopped.contains(t))
            .map(|(t, _)| *t)
            .collect();
        if !expired.is_empty() {
            plane.cancel(&expired, CancelMode::Immediate);
            out.forced = expired.len() as u64;
        }
        let mut freed: Vec<JobId> = Vec::new();
        for tid in stopped.iter().chain(&expired) {
            if let Some(entry) = self.writes.remove(tid) {
                if let Some(n) = self.peers.get_mut(&entry.peer) {
                    *n -= 1;
                    if *n == 0 {
                        self.peers.remove(&entry.peer);
                    }
                }
                freed.extend(entry.jobs);
            }
        }
        freed.sort_unstable();
        freed.dedup();
        // A job another retained write still reads stays pinned.
        freed.retain(|job| !self.writes.values().any(|e| e.jobs.contains(job)));
        out.jobs = freed;
        out
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use crate::error::PlaneError;
    use crate::traits::{BlockIndex, PlanePoll, Registration, RemoteMemory};

    /// A plane that reports the writes the test says stopped, and records cancels.
    #[derive(Default)]
    struct Plane {
        stopped: Map<PeerId, Vec<TransferId>>,
        cancelled: Vec<(Vec<TransferId>, CancelMode)>,
    }

    impl DataPlane for Plane {
        fn add_remote_peer(&mut self, _: &PeerId, _: &RemoteMemory) -> Result<(), PlaneError> {
            Ok(())
        }
        fn registration(&mut self, _: &PeerId) -> Registration {
            Registration::Done
        }
        fn remove_remote_peer(&mut self, _: &PeerId) {}
        fn write_blocks(
            &mut self,
            _: &PeerId,
            _: &[BlockIndex],
            _: &[BlockIndex],
        ) -> Option<TransferId> {
            None
        }
        fn poll(&mut self, peer: &PeerId) -> PlanePoll {
            PlanePoll {
                failed: self.stopped.remove(peer).unwrap_or_default(),
                ..PlanePoll::default()
            }
        }
        fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
            self.cancelled.push((ids.to_vec(), mode));
            Vec::new()
        }
    }

    const CAP: Duration = Duration::from_secs(30);

    fn jobs(ids: &[u64]) -> SmallVec<[JobId; 2]> {
        ids.iter().map(|j| JobId::new(*j)).collect()
    }

    /// vLLM 0.34's `TestRetainedTransfers.test_shared_job_held_until_last_transfer_stops`.
    /// vLLM 0.34's `TestRetainedTransfers.test_other_peers_are_not_held`.
    #[test]
    fn a_job_two_retained_writes_read_is_released_when_the_last_stops() {
        let (a, b) = (PeerId::new("10.0.0.1:1"), PeerId::new("10.0.0.2:1"));
        let (t1, t2, t3) = (TransferId::new(1), TransferId::new(2), TransferId::new(3));
        let now = Instant::now();
        let mut r = Retained::default();
        r.add(&a, vec![(t1, jobs(&[7])), (t2, jobs(&[7, 8]))], now);
        r.add(&b, vec![(t3, jobs(&[9]))], now);
        assert!(r.holds(&a) && r.holds(&b));
        let mut plane = Plane::default();
        plane.stopped.insert(a.clone(), vec![t2]);
        // t2 stopped: job 8 is free, job 7 is still read by t1.
        let out = r.poll(&mut plane, now, CAP, false);
        assert_eq!(out.jobs, vec![JobId::new(8)]);
        assert!(r.holds(&a));
        plane.stopped.insert(a.clone(), vec![t1]);
        let out = r.poll(&mut plane, now, CAP, false);
        assert_eq!(out.jobs, vec![JobId::new(7)]);
        assert!(!r.holds(&a), "a is free");
        assert!(r.holds(&b), "b's write is its own");
        assert_eq!(out.forced, 0);
        assert!(plane.cancelled.is_empty());
        // At the cap b's write is cancelled for good and released.
        assert_eq!(r.next_deadline(CAP), Some(now + CAP));
        let out = r.poll(&mut plane, now + CAP, CAP, false);
        assert_eq!((out.jobs, out.forced), (vec![JobId::new(9)], 1));
        assert_eq!(plane.cancelled, vec![(vec![t3], CancelMode::Immediate)]);
        assert!(r.is_empty() && r.next_deadline(CAP).is_none());
    }

    #[test]
    fn a_report_of_a_write_not_retained_changes_nothing_and_all_releases_everything() {
        let a = PeerId::new("10.0.0.1:1");
        let now = Instant::now();
        let mut r = Retained::default();
        r.add(&a, vec![(TransferId::new(1), jobs(&[1]))], now);
        let mut plane = Plane::default();
        plane.stopped.insert(a.clone(), vec![TransferId::new(99)]);
        assert_eq!(r.poll(&mut plane, now, CAP, false), Released::default());
        // Shutting down: everything goes at once.
        let out = r.poll(&mut plane, now, CAP, true);
        assert_eq!((out.jobs, out.forced), (vec![JobId::new(1)], 1));
        assert!(r.is_empty());
    }
}
