//! What the core keeps about its sessions so that an input reaches only the sessions it
//! concerns, whatever their number: each session's next deadline in one heap (a timeout fires
//! the sessions due, not every session), the sessions the data plane's news may not reach, the
//! ones with lookups waiting to be served again or probes waiting to be sent, the pins of all
//! peers together (the node-wide pin cap), and the sessions per host (admission).
//!
//! Kept up to date by [`SessionIndex::refresh`], which the core calls after every entry point
//! touched a session (each fact is O(1) to read off a session); a session that ended is
//! [`SessionIndex::remove`]d. Sans-IO, on the core's thread.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use kvpeer_proto::{PeerAddr, PeerId};

use super::slices::Slices;
use crate::maps::{Map, Set};
use crate::session::Session;

/// What was last read off one session.
#[derive(Debug, Default)]
struct Tracked {
    deadline: Option<Instant>,
    pins: usize,
}

/// The core's index of its sessions.
#[derive(Debug, Default)]
pub(super) struct SessionIndex {
    tracked: Map<PeerId, Tracked>,
    /// Every session's deadline as pushed; an entry is live while it equals the session's
    /// tracked one (stale ones are dropped when they come up).
    deadlines: BinaryHeap<Reverse<(Instant, PeerId)>>,
    /// Sessions whose registration is settling or whose fault waits: polled at every plane
    /// event.
    pub(super) plane_watch: Set<PeerId>,
    /// Sessions with lookups waiting for blocks being written.
    pub(super) serving: Set<PeerId>,
    /// Sessions with probes waiting to be sent.
    pub(super) flushing: Set<PeerId>,
    /// Sessions that died and wait to be reaped.
    pub(super) dead: Set<PeerId>,
    /// Blocks pinned for every peer's lookups together.
    pub(super) pins: usize,
    /// Sessions per host.
    hosts: Map<String, usize>,
    /// Sessions with queued lookups, in their hosts' turns.
    pub(super) slices: Slices,
}

/// The host a peer's identity names, canonical ([`PeerAddr`]): one host however it is
/// spelled (`[::ffff:10.0.0.5]:1`, `167772165:2` and `10.0.0.5:3` are the host `10.0.0.5`), so
/// a peer cannot multiply its host's share by respelling it. An identity that is no address
/// keys by its host part as written (the whole id when it is not `host:port`).
pub(crate) fn host_of(peer: &PeerId) -> String {
    match PeerAddr::of(peer) {
        Ok(addr) => addr.host().to_string(),
        Err(_) => peer
            .host_port()
            .map_or(peer.as_str(), |(host, _)| host)
            .to_owned(),
    }
}

fn set_member(set: &mut Set<PeerId>, peer: &PeerId, member: bool) {
    if member {
        if !set.contains(peer) {
            set.insert(peer.clone());
        }
    } else {
        set.remove(peer);
    }
}

impl SessionIndex {
    /// A session was opened for `peer`.
    pub(super) fn opened(&mut self, peer: &PeerId, session: &Session, now: Instant) {
        *self.hosts.entry(host_of(peer)).or_default() += 1;
        self.refresh(peer, session, now);
    }

    /// Reads what changed off `peer`'s session after something touched it at `now`.
    pub(super) fn refresh(&mut self, peer: &PeerId, session: &Session, now: Instant) {
        let tracked = match self.tracked.get_mut(peer) {
            Some(t) => t,
            None => self.tracked.entry(peer.clone()).or_default(),
        };
        let deadline = session.next_deadline();
        if deadline != tracked.deadline {
            tracked.deadline = deadline;
            if let Some(at) = deadline {
                self.deadlines.push(Reverse((at, peer.clone())));
            }
        }
        let pins = session.shares().2;
        self.pins = self.pins.saturating_sub(tracked.pins).saturating_add(pins);
        tracked.pins = pins;
        set_member(&mut self.plane_watch, peer, session.watches_plane());
        set_member(&mut self.serving, peer, session.wants_serve());
        set_member(&mut self.flushing, peer, session.wants_flush());
        set_member(&mut self.dead, peer, session.is_dead());
        self.slices.set(peer, session.slice_at(), now);
        self.compact();
        self.drop_stale();
    }

    /// `peer`'s session is gone.
    pub(super) fn remove(&mut self, peer: &PeerId) {
        if let Some(t) = self.tracked.remove(peer) {
            self.pins = self.pins.saturating_sub(t.pins);
            let host = host_of(peer);
            if let Some(n) = self.hosts.get_mut(&host) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    self.hosts.remove(&host);
                }
            }
        }
        self.plane_watch.remove(peer);
        self.serving.remove(peer);
        self.flushing.remove(peer);
        self.dead.remove(peer);
        self.slices.remove(peer);
        self.drop_stale();
    }

    /// Sessions open from `host`.
    pub(super) fn on_host(&self, host: &str) -> usize {
        self.hosts.get(host).copied().unwrap_or(0)
    }

    /// The most sessions any one host has.
    pub(super) fn heaviest_host(&self) -> usize {
        self.hosts.values().copied().max().unwrap_or(0)
    }

    /// The earliest deadline of any session (the heap's top is kept live by every change).
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.deadlines.peek().map(|Reverse((at, _))| *at)
    }

    /// Pops stale entries off the top, so the top is always a live deadline.
    fn drop_stale(&mut self) {
        while let Some(Reverse((at, peer))) = self.deadlines.peek() {
            if self.tracked.get(peer).and_then(|t| t.deadline) == Some(*at) {
                return;
            }
            self.deadlines.pop();
        }
    }

    /// The sessions whose deadline is at or before `now`, earliest first (each is refreshed by
    /// the caller after it ran its timeouts).
    pub(super) fn due(&mut self, now: Instant) -> Vec<PeerId> {
        let mut due = Vec::new();
        while let Some(at) = self.next_deadline() {
            if at > now {
                break;
            }
            if let Some(Reverse((_, peer))) = self.deadlines.pop() {
                if let Some(t) = self.tracked.get_mut(&peer) {
                    t.deadline = None;
                }
                due.push(peer);
            }
            self.drop_stale();
        }
        due
    }

    /// Rebuilds the heap from the live deadlines once stale entries are most of it.
    fn compact(&mut self) {
        self.slices.compact();
        if self.deadlines.len() > 64 && self.deadlines.len() > 4 * self.tracked.len() {
            self.deadlines = self
                .tracked
                .iter()
                .filter_map(|(peer, t)| t.deadline.map(|at| Reverse((at, peer.clone()))))
                .collect();
        }
    }
}
