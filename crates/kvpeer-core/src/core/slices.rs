//! Which session's queued lookups the core asks the store about next: hosts in round robin,
//! then each host's sessions in round robin, at most `lookup_slice_keys` keys per step in all
//! (docs/security.md, G7).
//!
//! A lookup that arrives while its session has none queued is asked at once (its first slice,
//! charged to its connection by the control channel's shares); what is left of a large lookup
//! waits here for a step. One step serves slices, taking the next host in turn each time,
//! until `lookup_slice_keys` keys were asked (its last slice may take it past that by less
//! than one slice), so an honest message that arrives during a flood waits for at most one
//! step of others' slices, however many hosts flood and however many sessions each opens (a
//! host's sessions share its turns); each later slice of an honest lookup larger than a slice
//! waits for one turn of the hosts with slices queued. A step with slices left is due at
//! once: the node's loop reads its sockets before the next one (work-conserving: a lone
//! lookup's slices run back to back).
//!
//! A session past its keys-per-second budget waits for its time, but only while others want
//! the steps: a step that no due session fills serves those sessions too
//! ([`Slices::next_spare`]), hosts in turn and a host's sessions in turn as for due slices, so
//! the budget bites only under contention, a lone peer's lookups are never held to it, and
//! many sessions past their budgets buy a host no more of the idle steps than one.
//!
//! Fed by [`crate::core::index::SessionIndex::refresh`] with each session's `slice_at` after
//! every touch; entries are checked against it when taken, so a stale one (the session was
//! served otherwise, ended, or was throttled to later) is dropped then. Sans-IO, on the core's
//! thread.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::time::Instant;

use kvpeer_proto::PeerId;

use super::index::host_of;
use crate::maps::{Map, Set};

/// Sessions in turns: hosts in round robin, then each host's sessions in round robin. Each
/// session is in at most once; one taken leaves until it is pushed again.
#[derive(Debug, Default)]
struct HostTurns {
    /// Hosts with a session here, in turn order; a host is here exactly when it has an entry
    /// in `by_host`.
    hosts: VecDeque<String>,
    /// Each such host's sessions, in turn order.
    by_host: Map<String, VecDeque<PeerId>>,
    /// The sessions in `by_host` (none twice).
    queued: Set<PeerId>,
}

impl HostTurns {
    /// `peer` at the end of its host's turn (its host at the end of the hosts' if new); a
    /// session already in is left where it is.
    fn push(&mut self, peer: &PeerId) {
        if !self.queued.insert(peer.clone()) {
            return;
        }
        let host = host_of(peer);
        match self.by_host.get_mut(&host) {
            Some(sessions) => sessions.push_back(peer.clone()),
            None => {
                self.by_host
                    .insert(host.clone(), VecDeque::from([peer.clone()]));
                self.hosts.push_back(host);
            }
        }
    }

    /// The next host's next session, out of the turns.
    fn pop(&mut self) -> Option<PeerId> {
        while let Some(host) = self.hosts.pop_front() {
            let Some(sessions) = self.by_host.get_mut(&host) else {
                continue;
            };
            let peer = sessions.pop_front();
            if sessions.is_empty() {
                self.by_host.remove(&host);
            } else {
                self.hosts.push_back(host);
            }
            if let Some(peer) = peer {
                self.queued.remove(&peer);
                return Some(peer);
            }
        }
        None
    }

    fn contains(&self, peer: &PeerId) -> bool {
        self.queued.contains(peer)
    }

    fn is_empty(&self) -> bool {
        self.queued.is_empty()
    }
}

/// Sessions wanting a slice of their queued lookups.
#[derive(Debug, Default)]
pub(super) struct Slices {
    /// When each session wants its next slice, as last read off it.
    at: Map<PeerId, Instant>,
    /// Sessions whose slice is due later (its keys-per-second bucket is empty); stale entries
    /// are dropped when they come up.
    timed: BinaryHeap<Reverse<(Instant, PeerId)>>,
    /// Sessions whose slice is due, in their hosts' turns.
    due: HostTurns,
    /// Sessions past their budgets (their time later), in their hosts' turns for the steps
    /// nobody due wants (stale ones, whose time changed or came, dropped when they come up).
    spare: HostTurns,
}

impl Slices {
    /// `peer` wants its next slice at `at` (`None`: it has none queued), as read at `now`.
    pub(super) fn set(&mut self, peer: &PeerId, at: Option<Instant>, now: Instant) {
        let Some(at) = at else {
            self.at.remove(peer);
            return;
        };
        if self.at.get(peer) == Some(&at) && (at > now || self.due.contains(peer)) {
            return;
        }
        self.at.insert(peer.clone(), at);
        if at <= now {
            self.due.push(peer);
        } else {
            self.timed.push(Reverse((at, peer.clone())));
            self.spare.push(peer);
        }
    }

    /// `peer`'s session is gone.
    pub(super) fn remove(&mut self, peer: &PeerId) {
        self.at.remove(peer);
    }

    /// Moves the sessions whose time came into their hosts' turns.
    fn promote(&mut self, now: Instant) {
        while let Some(Reverse((at, _))) = self.timed.peek() {
            if *at > now {
                break;
            }
            let Some(Reverse((at, peer))) = self.timed.pop() else {
                break;
            };
            if self.at.get(&peer) == Some(&at) {
                self.due.push(&peer);
            }
        }
    }

    /// The next session to serve a slice of at `now`: the next host's next session. It leaves
    /// the turns; [`Slices::set`] puts it back at the end of its host's (and its host at the
    /// end of the hosts') if it still has slices due after it was served.
    pub(super) fn next(&mut self, now: Instant) -> Option<PeerId> {
        self.promote(now);
        while let Some(peer) = self.due.pop() {
            if self.at.get(&peer).is_some_and(|at| *at <= now) {
                return Some(peer);
            }
        }
        None
    }

    /// A session past its budget to serve on a step the due sessions left room in (called
    /// when [`Slices::next`] has none): the next host's next such session. Like `next`, it
    /// leaves the turns until [`Slices::set`] puts it back; stale entries on the way (a
    /// session that ended, was served otherwise, or is due: `next`'s) are dropped.
    pub(super) fn next_spare(&mut self, now: Instant) -> Option<PeerId> {
        while let Some(peer) = self.spare.pop() {
            if self.due.contains(&peer) || self.at.get(&peer).is_none_or(|at| *at <= now) {
                continue;
            }
            // Out of the map too, so that `set` takes its next time even if unchanged.
            self.at.remove(&peer);
            return Some(peer);
        }
        None
    }

    /// When a step has slices to serve: `now` while a session's slice is due or a session past
    /// its budget waits (a step serves it when no due session wants the room), else when the
    /// first such time comes. Possibly stale: a wake that finds nothing serves nothing and
    /// drops what it found stale.
    pub(super) fn next_deadline(&self, now: Instant) -> Option<Instant> {
        if !self.due.is_empty() || !self.spare.is_empty() {
            return Some(now);
        }
        self.timed.peek().map(|Reverse((at, _))| *at)
    }

    /// Drops stale timed entries once they are most of the heap (a session throttled over and
    /// over pushes one per throttle).
    pub(super) fn compact(&mut self) {
        if self.timed.len() > 64 && self.timed.len() > 4 * self.at.len() {
            let at = &self.at;
            self.timed
                .retain(|Reverse((when, peer))| at.get(peer) == Some(when));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn peer(s: &str) -> PeerId {
        PeerId::new(s)
    }

    #[test]
    fn hosts_take_turns_and_a_hosts_sessions_share_its_turn() {
        let now = Instant::now();
        let mut s = Slices::default();
        for p in ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3", "10.0.0.2:1"] {
            s.set(&peer(p), Some(now), now);
        }
        let mut order = Vec::new();
        for _ in 0..6 {
            let p = s.next(now).unwrap();
            // Each served session still has slices: it goes back in its host's turn.
            s.set(&p, Some(now), now);
            order.push(p.as_str().to_owned());
        }
        assert_eq!(
            order,
            [
                "10.0.0.1:1",
                "10.0.0.2:1",
                "10.0.0.1:2",
                "10.0.0.2:1",
                "10.0.0.1:3",
                "10.0.0.2:1"
            ]
        );
    }

    #[test]
    fn a_throttled_session_waits_for_its_time_and_a_stale_entry_is_skipped() {
        let now = Instant::now();
        let later = now + Duration::from_millis(5);
        let mut s = Slices::default();
        s.set(&peer("10.0.0.1:1"), Some(later), now);
        s.set(&peer("10.0.0.2:1"), Some(now), now);
        assert_eq!(s.next_deadline(now), Some(now));
        assert_eq!(s.next(now).unwrap().as_str(), "10.0.0.2:1");
        assert_eq!(s.next(now), None);
        assert_eq!(s.next(later).unwrap().as_str(), "10.0.0.1:1");
        // Served elsewhere (its slice_at cleared) before its turn came: skipped.
        s.set(&peer("10.0.0.3:1"), Some(now), now);
        s.set(&peer("10.0.0.3:1"), None, now);
        assert_eq!(s.next(now), None);
        // Ended while queued: skipped too.
        s.set(&peer("10.0.0.4:1"), Some(now), now);
        s.remove(&peer("10.0.0.4:1"));
        assert_eq!(s.next(now), None);
        // 10.0.0.1:1 waited for idle steps too before its time came: that entry is stale now,
        // dropped by the next look (one step that serves nothing), not served.
        assert_eq!(s.next_spare(later), None);
        assert_eq!(s.next_deadline(later), None);
    }

    #[test]
    fn sessions_past_their_budget_take_the_steps_nobody_due_wants() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let mut s = Slices::default();
        s.set(&peer("10.0.0.1:1"), Some(now + ms(9)), now);
        s.set(&peer("10.0.0.2:1"), Some(now + ms(3)), now);
        s.set(&peer("10.0.0.3:1"), Some(now), now);
        // Someone waits: the step is due now, not when the first budget refills.
        assert_eq!(s.next_deadline(now), Some(now));
        // The due session comes first; only then the throttled ones, hosts in turn.
        assert_eq!(s.next(now).unwrap().as_str(), "10.0.0.3:1");
        assert_eq!(s.next(now), None);
        assert_eq!(s.next_spare(now).unwrap().as_str(), "10.0.0.1:1");
        assert_eq!(s.next_spare(now).unwrap().as_str(), "10.0.0.2:1");
        assert_eq!(s.next_spare(now), None, "each once per step");
        // Served on spare time and still over budget at the same time: taken again next step.
        s.set(&peer("10.0.0.2:1"), Some(now + ms(3)), now);
        assert_eq!(s.next_spare(now).unwrap().as_str(), "10.0.0.2:1");
        // A stale entry (the session was served on its own, or ended) is dropped, not served.
        s.set(&peer("10.0.0.4:1"), Some(now + ms(1)), now);
        s.set(&peer("10.0.0.4:1"), None, now);
        assert_eq!(s.next_spare(now), None);
        // Nobody waits for idle steps now; the heap's (stale) times are all that is left.
        assert!(s.next_deadline(now).is_none_or(|t| t > now), "no wake now");
    }

    #[test]
    fn many_sessions_past_their_budget_buy_a_host_no_more_idle_steps_than_one() {
        let now = Instant::now();
        let later = now + Duration::from_millis(5);
        let mut s = Slices::default();
        for p in ["10.0.0.1:1", "10.0.0.1:2", "10.0.0.1:3", "10.0.0.2:1"] {
            s.set(&peer(p), Some(later), now);
        }
        let mut order = Vec::new();
        for _ in 0..6 {
            let p = s.next_spare(now).unwrap();
            // Still over its budget after its slice: back in its host's turn.
            s.set(&p, Some(later), now);
            order.push(p.as_str().to_owned());
        }
        assert_eq!(
            order,
            [
                "10.0.0.1:1",
                "10.0.0.2:1",
                "10.0.0.1:2",
                "10.0.0.2:1",
                "10.0.0.1:3",
                "10.0.0.2:1"
            ]
        );
    }
}
