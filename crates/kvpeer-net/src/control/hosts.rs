//! Host liveness: the rules by which a connection lost to one peer makes the channel doubt
//! the other peers of the same host, without sockets or clocks of its own.
//!
//! A multi-rank engine (vLLM with data parallelism) has one control port per rank on one host,
//! and each rank's session lives and dies on its own: when the host goes away, each connection
//! to it finds out by its own heartbeat, one after another, and a load to a rank not yet found
//! dead runs its whole timeout (vLLM's issue 56828: 36–43 s of fallback). Here:
//!
//! * a lost connection whose cause says something about the host ([`HostSign`]) starts a
//!   **probe round** for that host: every other ready connection to it is sent a PING at once,
//!   and the host must answer within `probe_timeout` (`Connection::probe`): the peer's bytes,
//!   or its kernel's acknowledgement of ours (`TCP_INFO`: a host that is up acknowledges even
//!   when its process is stopped or busy, and the heartbeat then judges the process). A
//!   connection whose host answers neither is lost (`LinkLoss::ProbeUnanswered`) and its
//!   sessions' loads fail at once. A live host answers in a round trip, so a rank that merely
//!   crashed costs its siblings one PING each;
//! * the round is **announced** to the engine's other ranks on this host (`siblings.rs`), which
//!   probe their own connections to that host;
//! * when nothing on the host answered (the loss is [`HostSign::Unanswered`]: not even its
//!   kernel) and no other ready connection to it is left, the host is **taken for down** for
//!   `hold`: new connections to it are refused at once (`LinkLoss::HostDown`), so new requests
//!   to its other ranks fall back at once instead of waiting out a connect that cannot finish.
//!   A connection to it that finishes its handshake ends that at once. An announcement never
//!   lengthens a hold already running.
//!
//! A round lasts twice `probe_timeout`, longer than its probes, and an unanswered probe starts
//! none: a round's own losses never start another (they may take the host for down), and
//! announcements cost a PING per connection at most once per round. Owned by the channel's
//! outbound side (`control/outbound.rs`), on the node's thread; nothing here blocks.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvpeer_core::HostSign;

/// Hosts remembered at once (rounds and holds); past it the expired go, then the oldest.
const MAX_HOSTS: usize = 4096;

/// What the channel does about one lost connection or one announcement.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Doubt {
    /// Probe every other ready connection to the host.
    pub(crate) probe: bool,
    /// Tell the engine's other ranks on this host (only for what this node saw itself).
    pub(crate) announce: bool,
    /// The host is taken for down: new connections to it are refused until the hold ends.
    pub(crate) down: bool,
}

/// Where a doubt about a host comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// A connection of this node was lost (`probed`: to a round's probe).
    Here { probed: bool },
    /// Another rank of the engine said so.
    Announced,
}

/// The rules' state: rounds under way and hosts taken for down.
#[derive(Debug)]
pub(crate) struct HostWatch {
    probe_timeout: Duration,
    hold: Duration,
    /// Hosts whose round runs until then: no second round before.
    rounds: HashMap<IpAddr, Instant>,
    /// Hosts taken for down until then.
    down: HashMap<IpAddr, Instant>,
    /// Probe rounds started so far.
    rounds_started: u64,
}

impl HostWatch {
    /// Rounds whose probes wait `probe_timeout` (zero: host liveness off, every connection
    /// lives and dies on its own), holds of `hold`.
    pub(crate) fn new(probe_timeout: Duration, hold: Duration) -> Self {
        HostWatch {
            probe_timeout,
            hold,
            rounds: HashMap::new(),
            down: HashMap::new(),
            rounds_started: 0,
        }
    }

    /// Whether host liveness is on (a probe timeout above zero).
    pub(crate) fn enabled(&self) -> bool {
        !self.probe_timeout.is_zero()
    }

    /// Probe rounds started so far.
    pub(crate) fn rounds_started(&self) -> u64 {
        self.rounds_started
    }

    /// How long a probe may go unanswered.
    pub(crate) fn probe_timeout(&self) -> Duration {
        self.probe_timeout
    }

    /// How long a host is taken for down.
    pub(crate) fn hold(&self) -> Duration {
        self.hold
    }

    /// A connection to `host` was lost at `now` with `sign`; `ready_left`: other ready
    /// connections to it (this one not counted); `probed`: it was lost to a probe of a round
    /// (which starts no other).
    pub(crate) fn on_loss(
        &mut self,
        host: IpAddr,
        sign: HostSign,
        now: Instant,
        ready_left: usize,
        probed: bool,
    ) -> Doubt {
        self.doubt(host, sign, now, ready_left, Origin::Here { probed })
    }

    /// Another rank of this engine announced at `now` that it lost a connection to `host`
    /// with `sign`; `ready_left`: this node's ready connections to it.
    pub(crate) fn on_announcement(
        &mut self,
        host: IpAddr,
        sign: HostSign,
        now: Instant,
        ready_left: usize,
    ) -> Doubt {
        self.doubt(host, sign, now, ready_left, Origin::Announced)
    }

    fn doubt(
        &mut self,
        host: IpAddr,
        sign: HostSign,
        now: Instant,
        ready_left: usize,
        origin: Origin,
    ) -> Doubt {
        if !self.enabled() || sign == HostSign::None {
            return Doubt::default();
        }
        let mut doubt = Doubt::default();
        let held = self.is_down(host, now);
        // An announcement starts a hold but never lengthens one (a process repeating them
        // cannot keep a host held).
        let may_hold = !(held && origin == Origin::Announced);
        if sign == HostSign::Unanswered && ready_left == 0 && !self.hold.is_zero() && may_hold {
            doubt.down = !held;
            Self::remember(&mut self.down, host, now + self.hold, now);
        }
        let in_round = self.rounds.get(&host).is_some_and(|until| now < *until);
        if origin == (Origin::Here { probed: true }) {
            // The round's last answering connection gone: the other ranks learn that nothing
            // on the host answers (they may hold it); no new round.
            doubt.announce = doubt.down;
            return doubt;
        }
        if in_round {
            return doubt;
        }
        // Longer than the probes (whose deadlines the timers only ever round up): their
        // losses come inside it.
        Self::remember(&mut self.rounds, host, now + 2 * self.probe_timeout, now);
        self.rounds_started += 1;
        doubt.probe = ready_left > 0;
        doubt.announce = matches!(origin, Origin::Here { .. });
        doubt
    }

    /// A connection to `host` finished its handshake: the host is up.
    pub(crate) fn on_ready(&mut self, host: IpAddr) {
        self.down.remove(&host);
    }

    /// Whether `host` is taken for down at `now` (a hold that ended is forgotten when the map
    /// is next full).
    pub(crate) fn is_down(&self, host: IpAddr, now: Instant) -> bool {
        self.down.get(&host).is_some_and(|until| now < *until)
    }

    /// Hosts taken for down now (for the node's metrics and tests).
    pub(crate) fn hosts_down(&self, now: Instant) -> usize {
        self.down.values().filter(|until| now < **until).count()
    }

    /// Sets `host`'s time in `map`, keeping the map within [`MAX_HOSTS`].
    fn remember(map: &mut HashMap<IpAddr, Instant>, host: IpAddr, until: Instant, now: Instant) {
        if map.len() >= MAX_HOSTS && !map.contains_key(&host) {
            map.retain(|_, t| now < *t);
            if map.len() >= MAX_HOSTS {
                if let Some(oldest) = map.iter().min_by_key(|(_, t)| **t).map(|(h, _)| *h) {
                    map.remove(&oldest);
                }
            }
        }
        let at = map.entry(host).or_insert(until);
        *at = (*at).max(until);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const H: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 5));
    const OTHER: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 6));

    fn watch() -> HostWatch {
        HostWatch::new(Duration::from_secs(1), Duration::from_secs(5))
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_silent_connection_probes_the_hosts_others_once_per_round_and_tells_the_siblings() {
        let t = Instant::now();
        let mut w = watch();
        let first = w.on_loss(H, HostSign::Unanswered, t, 3, false);
        assert_eq!(
            first,
            Doubt {
                probe: true,
                announce: true,
                down: false
            },
            "three others answer for the host until their probes say otherwise"
        );
        // The round's own casualties (unanswered probes, at their deadline or later: timers
        // round up) start no second round, at any time; the last of them takes the host down
        // and tells the other ranks so.
        for at in [ms(1000), ms(1015), ms(1999), ms(2500)] {
            let cascade = w.on_loss(H, HostSign::Unanswered, t + at, 2, true);
            assert_eq!(cascade, Doubt::default(), "{at:?}");
        }
        let last = w.on_loss(H, HostSign::Unanswered, t + ms(1020), 0, true);
        assert_eq!(
            last,
            Doubt {
                probe: false,
                announce: true,
                down: true
            }
        );
        // Another host is its own matter.
        assert!(w.on_loss(OTHER, HostSign::Unanswered, t, 1, false).probe);
        // Nor does any loss before the round's end (twice the probe timeout)...
        assert!(
            !w.on_loss(H, HostSign::ProcessGone, t + ms(1999), 1, false)
                .probe
        );
        // ...after it, a new loss starts a new one.
        assert!(
            w.on_loss(H, HostSign::ProcessGone, t + ms(2000), 1, false)
                .probe
        );
        assert_eq!(w.rounds_started(), 3);
    }

    #[test]
    fn a_host_is_down_only_when_nothing_on_it_answered_and_no_connection_is_left() {
        let t = Instant::now();
        let mut w = watch();
        // A process that closed its connection: its host's kernel answered; never down.
        let gone = w.on_loss(H, HostSign::ProcessGone, t, 0, false);
        assert_eq!(
            gone,
            Doubt {
                probe: false,
                announce: true,
                down: false
            }
        );
        assert!(!w.is_down(H, t));
        // Silence with another connection still ready: probed, not down.
        let mut w = watch();
        assert!(!w.on_loss(H, HostSign::Unanswered, t, 1, false).down);
        assert!(!w.is_down(H, t));
        // The last probed connection fails too: down, for the hold.
        let last = w.on_loss(H, HostSign::Unanswered, t + ms(1000), 0, true);
        assert!(last.down && !last.probe);
        assert!(w.is_down(H, t + ms(1000)));
        assert!(w.is_down(H, t + ms(5999)));
        assert!(!w.is_down(H, t + ms(6000)), "the hold ends");
        assert_eq!(w.hosts_down(t + ms(6000)), 0);
        // A connection that finishes its handshake ends a hold at once.
        w.on_loss(H, HostSign::Unanswered, t + ms(7000), 0, false);
        assert!(w.is_down(H, t + ms(7001)));
        w.on_ready(H);
        assert!(!w.is_down(H, t + ms(7002)));
        // Losses that say nothing of the host do nothing.
        let mut w = watch();
        assert_eq!(w.on_loss(H, HostSign::None, t, 0, false), Doubt::default());
        assert!(!w.is_down(H, t));
    }

    #[test]
    fn an_announcement_probes_and_holds_but_is_never_passed_on() {
        let t = Instant::now();
        let mut w = watch();
        let heard = w.on_announcement(H, HostSign::Unanswered, t, 2);
        assert_eq!(
            heard,
            Doubt {
                probe: true,
                announce: false,
                down: false
            }
        );
        // A rank with no connection to the host takes it for down at once, for the hold; more
        // announcements never lengthen it.
        let mut w = watch();
        assert!(w.on_announcement(H, HostSign::Unanswered, t, 0).down);
        assert!(w.is_down(H, t));
        for i in 1..50 {
            w.on_announcement(H, HostSign::Unanswered, t + ms(100 * i), 0);
        }
        assert!(w.is_down(H, t + ms(4999)));
        assert!(
            !w.is_down(H, t + ms(5000)),
            "held 5 s from the first, however many came"
        );
        // A flood of announcements costs one round per probe timeout.
        let mut w = watch();
        let rounds = (0..1000)
            .filter(|i| {
                w.on_announcement(H, HostSign::ProcessGone, t + ms(*i), 4)
                    .probe
            })
            .count();
        assert_eq!(rounds, 1);
    }

    #[test]
    fn off_when_the_probe_timeout_is_zero_and_bounded_in_hosts() {
        let t = Instant::now();
        let mut w = HostWatch::new(Duration::ZERO, Duration::from_secs(5));
        assert_eq!(
            w.on_loss(H, HostSign::Unanswered, t, 0, false),
            Doubt::default()
        );
        assert!(!w.is_down(H, t));
        let mut w = watch();
        for i in 0..(MAX_HOSTS as u32 + 100) {
            let host = IpAddr::V4(std::net::Ipv4Addr::from(0x0A00_0000 + i));
            w.on_loss(host, HostSign::Unanswered, t + ms(u64::from(i)), 0, false);
        }
        assert!(w.rounds.len() <= MAX_HOSTS && w.down.len() <= MAX_HOSTS);
    }
}
