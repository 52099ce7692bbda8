//! Admission: which sessions may exist. Inbound connections refused (a duplicate, a backoff)
//! or admitted by evicting a session when the sessions or the newcomer's host's share are full
//! (`make_room_for`: eviction, not refusal, so no host can lock others out), dials held back, the reconnect backoff after data-plane faults and the
//! dial backoff after sessions that never got the peer's ack, and idle eviction near the limit.
//!
//! Contract: a peer in dial backoff gets no answer at all (an answer would make it dial again);
//! one in reconnect backoff gets a `disconnect`; backoffs double per failure in a row within
//! their bounds and are forgotten once long over; only sessions without pending work are
//! evicted, and only when the session count is within the headroom of the limit.

use std::time::{Duration, Instant};

use kvpeer_proto::{Message, PeerId};
use tracing::{debug, info};

use super::Core;
use crate::error::{CloseReason, FaultRecord, Refusal, SessionEnd};
use crate::maps::Map;
use crate::output::Event;
use crate::session::{Announce, Session};
use crate::traits::{DataPlane, Parent};

#[derive(Debug, Clone, Copy)]
pub(super) struct Backoff {
    wait: Duration,
    retry_at: Instant,
}

/// Records one more failure of `peer` in `backoffs` at `now` and returns its wait: `first`
/// after no recent failure, else the previous wait doubled, within `min..=max`. Entries whose
/// wait is long over are forgotten, so the map holds only peers failing lately.
pub(super) fn next_backoff(
    backoffs: &mut Map<PeerId, Backoff>,
    peer: &PeerId,
    now: Instant,
    first: Duration,
    min: Duration,
    max: Duration,
) -> Duration {
    backoffs.retain(|_, b| now <= b.retry_at + max);
    let wait = match backoffs.get(peer) {
        Some(prev) => (prev.wait * 2).max(min).min(max),
        None => first,
    };
    backoffs.insert(
        peer.clone(),
        Backoff {
            wait,
            retry_at: now + wait,
        },
    );
    wait
}

use super::index::host_of;

impl<P: Parent, D: DataPlane> Core<P, D> {
    /// Why an inbound connection from `peer` (no session yet) is refused, if it is: a
    /// duplicate, the session limit, or a backoff. During a reconnect backoff the peer gets a
    /// `disconnect`, so it fails at once.
    pub(super) fn refusal(&mut self, peer: &PeerId) -> Option<Refusal> {
        if self.sessions.contains_key(peer) {
            return Some(Refusal::Duplicate(peer.clone()));
        }
        let wait = self.reconnect_wait(peer);
        let dial_wait = self.dial_backoff.get(peer).map_or(Duration::ZERO, |b| {
            b.retry_at.saturating_duration_since(self.now)
        });
        if dial_wait > Duration::ZERO {
            // Its address kept failing: any answer (even a `disconnect`) would dial it
            // again, so it gets none.
            Some(Refusal::DialBackoff { left: dial_wait })
        } else if self.retained.holds(peer) {
            // A new session's poll would take the old writes' reports (vLLM 0.34 refuses it
            // too): told at once, so its lookups fall back now.
            self.out.transmit(peer, Message::DISCONNECT);
            Some(Refusal::WritesRetained)
        } else if wait > Duration::ZERO {
            self.out.transmit(peer, Message::DISCONNECT);
            Some(Refusal::ReconnectBackoff { left: wait })
        } else {
            self.make_room_for(peer)
        }
    }

    /// Makes a slot for a newcomer from `peer`'s host when the sessions (or that host's share,
    /// `max_peers_per_host`) are full: the session that gives its slot up is one of the
    /// newcomer's own host when that host holds its share, else one of the host holding the
    /// most sessions; among those, one without pending work before one with, then the least
    /// lately active. So one host, or two, cannot hold every slot: a newcomer always gets in,
    /// and a host that floods sessions evicts its own. `Some` refusal only when no session may
    /// give way (a limit of zero).
    pub(super) fn make_room_for(&mut self, peer: &PeerId) -> Option<Refusal> {
        let host = host_of(peer);
        let own = self.index.on_host(&host);
        // Whose sessions may give way: the newcomer's own host's when it holds its share, else
        // those of the hosts holding the most.
        let own_host_full = own >= self.config.max_peers_per_host;
        if !own_host_full && self.sessions.len() < self.config.max_peers {
            return None;
        }
        // A limit is reached: only now is every session looked at.
        let heaviest = self.index.heaviest_host();
        let index = &self.index;
        let gives_way = |h: &str| {
            if own_host_full {
                h == host
            } else {
                index.on_host(h) == heaviest
            }
        };
        let victim = self
            .sessions
            .values()
            .filter(|s| gives_way(&host_of(s.peer())))
            .min_by_key(|s| (s.has_pending_work(), s.link.last_activity))
            .map(|s| s.peer().clone());
        let Some(victim) = victim else {
            return Some(Refusal::SessionLimit {
                open: self.sessions.len(),
                max: self.config.max_peers,
            });
        };
        crate::info_throttled!(self.out.throttle, self.now, "sessions full: evicting the idlest of the heaviest host",
            newcomer = %peer, evicted = %victim);
        if let Some(s) = self.sessions.get_mut(&victim) {
            s.disconnect(&mut self.out, self.now, CloseReason::Evicted);
        }
        self.refresh(&victim);
        self.end_session(&victim);
        self.out.counters.sessions_evicted += 1;
        None
    }

    /// Opens a session toward `peer` unless one exists; `false` if it cannot.
    pub(super) fn ensure_session(&mut self, peer: &PeerId) -> bool {
        if self.sessions.contains_key(peer) {
            return true;
        }
        if self.reconnect_wait(peer) > Duration::ZERO {
            debug!(%peer, "not dialing: reconnect backoff after a data-plane fault");
            return false;
        }
        if self.retained.holds(peer) {
            debug!(%peer, "not dialing: writes of its ended session are still running");
            return false;
        }
        if self
            .dial_backoff
            .get(peer)
            .is_some_and(|b| b.retry_at > self.now)
        {
            debug!(%peer, "not dialing: backoff after failed dials");
            return false;
        }
        if let Some(refusal) = self.make_room_for(peer) {
            crate::warn_throttled!(self.out.throttle, self.now, "not dialing: session limit reached", %peer, %refusal);
            return false;
        }
        info!(%peer, "opening a session");
        self.out.event(Event::Dial(peer.clone()));
        self.open_session(peer.clone(), Announce::Now);
        true
    }

    /// A new session with `peer`; it sends our `connect` as `announce` says.
    pub(super) fn open_session(&mut self, peer: PeerId, announce: Announce) {
        let session = Session::open(
            peer.clone(),
            &self.local,
            &self.config,
            &mut self.out,
            self.now,
            announce,
        );
        self.out.counters.sessions_opened += 1;
        self.index.opened(&peer, &session, self.now);
        self.sessions.insert(peer, session);
    }

    /// What a session's end costs its peer: a dial backoff if it ended before the peer acked
    /// our `connect`, a reconnect backoff after a data-plane fault.
    pub(super) fn account_end(&mut self, peer: &PeerId, session: &Session) -> SessionEnd {
        let mut end = SessionEnd {
            reason: session.death().cloned().unwrap_or(CloseReason::Closed),
            dial_backoff: None,
            fault: None,
        };
        // A session that ends before the peer acked our `connect` is a failed dial, whoever
        // opened it (an inbound `connect` makes us dial back): the peer is neither dialed nor
        // answered again until its backoff passes.
        if session.was_acked() {
            self.dial_backoff.remove(peer);
        } else if end.reason != CloseReason::Closed {
            end.dial_backoff = Some(self.schedule_dial_backoff(peer));
        }
        if session.data_plane_fault().is_some() {
            let count = self.faults.entry(peer.clone()).or_default();
            *count += 1;
            let count = *count;
            end.fault = Some(FaultRecord {
                count,
                reconnect_backoff: self.schedule_backoff(peer),
            });
        }
        end
    }

    /// A data-plane fault: the first reconnect waits 0, then `reconnect_min_backoff` doubling
    /// per fault in a row up to `reconnect_max_backoff`.
    pub(super) fn schedule_backoff(&mut self, peer: &PeerId) -> Duration {
        let (min, max) = (
            self.config.reconnect_min_backoff,
            self.config.reconnect_max_backoff,
        );
        next_backoff(&mut self.backoff, peer, self.now, Duration::ZERO, min, max)
    }

    /// A session that ended before the peer acked our `connect`: the next dial (or answer)
    /// waits `dial_min_backoff`, doubling per failure in a row up to `dial_max_backoff`.
    pub(super) fn schedule_dial_backoff(&mut self, peer: &PeerId) -> Duration {
        let (min, max) = (self.config.dial_min_backoff, self.config.dial_max_backoff);
        next_backoff(&mut self.dial_backoff, peer, self.now, min, min, max)
    }

    pub(super) fn reconnect_wait(&self, peer: &PeerId) -> Duration {
        self.backoff.get(peer).map_or(Duration::ZERO, |b| {
            b.retry_at.saturating_duration_since(self.now)
        })
    }

    pub(super) fn idle_eviction_active(&self) -> bool {
        let headroom = self
            .config
            .idle_headroom
            .min(self.config.max_peers.saturating_sub(1));
        !self.config.idle_timeout.is_zero()
            && self.sessions.len() >= self.config.max_peers.saturating_sub(headroom)
    }

    /// Evicts the sessions idle past `idle_timeout` while eviction is on, and sets when to look
    /// again: the next session's idle deadline, but no sooner than a second (or an eighth of
    /// the timeout) from now, so the walk over the sessions this takes runs at most that often
    /// however many there are (a session may outlive its deadline by that much).
    pub(super) fn evict_idle(&mut self) {
        if !self.idle_eviction_active() {
            self.idle_check_at = None;
            return;
        }
        if self.idle_check_at.is_some_and(|at| at > self.now) {
            return;
        }
        let idle: Vec<PeerId> = self
            .sessions
            .values()
            .filter(|s| {
                !s.has_pending_work() && s.link.last_activity + self.config.idle_timeout <= self.now
            })
            .map(|s| s.peer().clone())
            .collect();
        for peer in idle {
            crate::info_throttled!(self.out.throttle, self.now, "evicting an idle peer", %peer);
            if let Some(s) = self.sessions.get_mut(&peer) {
                s.disconnect(&mut self.out, self.now, CloseReason::Idle);
            }
            self.refresh(&peer);
            self.end_session(&peer);
        }
        let next = self
            .sessions
            .values()
            .filter(|s| !s.has_pending_work())
            .map(|s| s.link.last_activity + self.config.idle_timeout)
            .min()
            .unwrap_or(self.now + self.config.idle_timeout);
        let spacing = (self.config.idle_timeout / 8).min(Duration::from_secs(1));
        self.idle_check_at = Some(next.max(self.now + spacing));
    }
}
