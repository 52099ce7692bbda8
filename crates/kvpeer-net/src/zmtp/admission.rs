//! Who gets a connection slot when a listener is full: the one policy of every kvpeer listener
//! (the control ROUTER, `inbound.rs`, and the KV event stream's PUB and replay ROUTER,
//! `events/server.rs`), so each bound is written once.
//!
//! A listener holds at most `max_connections` in all and `max_per_source` from one source
//! address. Every process on a host shares that host's address (all of loopback, for peers on
//! the node's own host), so refusing a newcomer once a source is full would let one process
//! lock every other process of its host out with a few dozen idle connections. Instead a
//! newcomer always gets in, and the holder that is worth least gives its slot up:
//!
//! 1. within the newcomer's own source when that source is full; when the whole listener is
//!    full, among every connection;
//! 2. there, a connection that carries no session before one that does (the node marks the
//!    connection a live session is bound to: an honest peer's working connection), so a flood
//!    spread over many sources evicts its own connections before any source's sessions;
//! 3. then one of the source holding the most connections (the heaviest holder);
//! 4. then the idlest: the one whose last message is oldest (a connection that never sent one
//!    counts from when it was accepted), so connections that only sit and answer heartbeats go
//!    first; ties go to the oldest connection.
//!
//! A flood of fresh connections therefore evicts its own older ones and never the connections
//! honest sessions run on; the cost to a flooder is its own churn. Sans-IO: the caller gives the
//! holders and closes the one named. Called on the listener's own thread.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::Instant;

/// What the policy knows of one connection holding a slot.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Holder<Id> {
    /// The caller's name for it.
    pub(crate) id: Id,
    /// Its TCP source address.
    pub(crate) source: IpAddr,
    /// When it last sent a message (or was accepted, if it never did).
    pub(crate) last_active: Instant,
    /// Whether a live session is bound to it.
    pub(crate) holds_session: bool,
}

/// The caps of one listener.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// Connections at once.
    pub(crate) max_connections: usize,
    /// Connections at once from one source address.
    pub(crate) max_per_source: usize,
}

/// Whether a newcomer from `source` fits, and if not which holder to close for it: `None` when
/// it fits as things are, `Some(id)` for the holder to evict. With caps of zero (nothing may
/// be held) and no holder, `None` too: the caller's cap check still applies.
pub(crate) fn evict_for<Id: Copy>(
    holders: &[Holder<Id>],
    source: IpAddr,
    caps: Caps,
) -> Option<Id> {
    let mut counts: HashMap<IpAddr, usize> = HashMap::new();
    for h in holders {
        *counts.entry(h.source).or_default() += 1;
    }
    let own_source_full = counts.get(&source).copied().unwrap_or(0) >= caps.max_per_source;
    if !own_source_full && holders.len() < caps.max_connections {
        return None;
    }
    holders
        .iter()
        .filter(|h| !own_source_full || h.source == source)
        .min_by_key(|h| {
            let weight = counts.get(&h.source).copied().unwrap_or(0);
            (h.holds_session, std::cmp::Reverse(weight), h.last_active)
        })
        .map(|h| h.id)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap_or(IpAddr::from([0, 0, 0, 0]))
    }

    fn holder(id: u64, source: &str, age_ms: u64, session: bool, t0: Instant) -> Holder<u64> {
        Holder {
            id,
            source: ip(source),
            last_active: t0 + Duration::from_millis(1000 - age_ms),
            holds_session: session,
        }
    }

    const CAPS: Caps = Caps {
        max_connections: 4,
        max_per_source: 2,
    };

    #[test]
    fn a_newcomer_that_fits_evicts_nobody() {
        let t0 = Instant::now();
        let held = [holder(1, "127.0.0.1", 5, false, t0)];
        assert_eq!(evict_for(&held, ip("127.0.0.1"), CAPS), None);
    }

    #[test]
    fn a_full_source_gives_up_its_idlest_connection_without_a_session() {
        let t0 = Instant::now();
        // 1 is the idlest of the source but carries a session; 2 is idle and carries none.
        let held = [
            holder(1, "127.0.0.1", 900, true, t0),
            holder(2, "127.0.0.1", 100, false, t0),
            holder(3, "127.0.0.2", 999, false, t0),
        ];
        assert_eq!(evict_for(&held, ip("127.0.0.1"), CAPS), Some(2));
    }

    #[test]
    fn among_equals_the_longest_silent_goes() {
        let t0 = Instant::now();
        let held = [
            holder(1, "127.0.0.1", 100, false, t0),
            holder(2, "127.0.0.1", 700, false, t0),
        ];
        assert_eq!(evict_for(&held, ip("127.0.0.1"), CAPS), Some(2));
    }

    #[test]
    fn a_full_listener_takes_a_connection_without_a_session_from_any_source_first() {
        let t0 = Instant::now();
        let caps = Caps {
            max_connections: 4,
            max_per_source: 4,
        };
        // Loopback holds the most, all with sessions; a flooder's lone connections elsewhere
        // carry none: one of those goes, the idlest.
        let held = [
            holder(1, "127.0.0.1", 900, true, t0),
            holder(2, "127.0.0.1", 800, true, t0),
            holder(3, "10.0.0.7", 100, false, t0),
            holder(4, "10.0.0.8", 200, false, t0),
        ];
        assert_eq!(evict_for(&held, ip("10.0.0.9"), caps), Some(4));
    }

    #[test]
    fn a_full_listener_takes_from_the_heaviest_source_not_the_newcomers() {
        let t0 = Instant::now();
        let caps = Caps {
            max_connections: 4,
            max_per_source: 3,
        };
        let held = [
            holder(1, "127.0.0.9", 999, false, t0),
            holder(2, "127.0.0.2", 10, false, t0),
            holder(3, "127.0.0.2", 20, false, t0),
            holder(4, "127.0.0.2", 30, false, t0),
        ];
        // The newcomer's own source holds one, the heaviest (127.0.0.2) three: its idlest goes.
        assert_eq!(evict_for(&held, ip("127.0.0.9"), caps), Some(4));
    }
}
