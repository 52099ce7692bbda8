//! Rate-limited warnings: a peer must not be able to fill the disk with logs.
//!
//! Each kind of warning (a `&'static str`) is logged at most [`BURST`] times per interval; the
//! ones beyond are counted, and the next one logged carries that count (`suppressed`). A burst
//! rather than one line keeps distinct events close together visible (a few refused peers in a
//! row) while a flood costs a few lines a second. The owner
//! passes the time in (the core reads no clock), so this is usable from the sans-IO core and
//! from I/O threads alike. Memory is one entry per kind, and kinds are static strings.

use std::time::{Duration, Instant};

use crate::maps::Map;

/// The interval of the default throttle.
pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(1);

/// Warnings of one kind logged per interval at most.
pub const BURST: u32 = 5;

#[derive(Debug, Clone, Copy)]
struct Slot {
    window_start: Instant,
    logged: u32,
    suppressed: u64,
}

/// Which warnings to log now, per kind.
#[derive(Debug, Clone)]
pub struct WarnThrottle {
    interval: Duration,
    /// The latest time the owner told (for callers without a `now` at hand).
    ticked: Option<Instant>,
    slots: Map<&'static str, Slot>,
    total_suppressed: u64,
}

impl Default for WarnThrottle {
    fn default() -> Self {
        WarnThrottle::new(DEFAULT_INTERVAL)
    }
}

impl WarnThrottle {
    /// At most [`BURST`] warnings of each kind per `interval`.
    pub fn new(interval: Duration) -> Self {
        WarnThrottle {
            interval,
            ticked: None,
            slots: Map::default(),
            total_suppressed: 0,
        }
    }

    /// Whether a warning of `kind` happening at `now` is logged: `Some(n)` with the number of
    /// its kind suppressed since the last one logged, or `None` (counted, not logged).
    pub fn admit(&mut self, kind: &'static str, now: Instant) -> Option<u64> {
        let slot = self.slots.entry(kind).or_insert(Slot {
            window_start: now,
            logged: 0,
            suppressed: 0,
        });
        if now.saturating_duration_since(slot.window_start) >= self.interval {
            slot.window_start = now;
            slot.logged = 0;
        }
        if slot.logged < BURST {
            slot.logged += 1;
            Some(std::mem::take(&mut slot.suppressed))
        } else {
            slot.suppressed += 1;
            self.total_suppressed += 1;
            None
        }
    }

    /// Records the owner's current time, for [`WarnThrottle::ticked`].
    pub fn tick(&mut self, now: Instant) {
        self.ticked = Some(now);
    }

    /// The latest time given to [`WarnThrottle::tick`] (the owner's clock, never read here).
    /// Before any tick, a throttle admits everything.
    pub fn ticked(&self) -> Option<Instant> {
        self.ticked
    }

    /// As [`WarnThrottle::admit`] at the last tick; before any tick, always admitted.
    pub fn admit_ticked(&mut self, kind: &'static str) -> Option<u64> {
        match self.ticked {
            Some(now) => self.admit(kind, now),
            None => Some(0),
        }
    }

    /// Warnings not logged so far, all kinds together.
    pub fn total_suppressed(&self) -> u64 {
        self.total_suppressed
    }
}

/// `warn!` through a [`WarnThrottle`]: `warn_throttled!(throttle, now, "message", fields...)`
/// logs the message with its fields and the `suppressed` count, or only counts it.
#[macro_export]
macro_rules! warn_throttled {
    ($throttle:expr, $now:expr, $msg:literal) => {
        if let Some(suppressed) = $throttle.admit($msg, $now) {
            tracing::warn!(suppressed, $msg);
        }
    };
    ($throttle:expr, $now:expr, $msg:literal, $($field:tt)+) => {
        if let Some(suppressed) = $throttle.admit($msg, $now) {
            tracing::warn!($($field)+, suppressed, $msg);
        }
    };
}

/// [`warn_throttled!`] at `error` level: for errors a peer can cause at will.
#[macro_export]
macro_rules! error_throttled {
    ($throttle:expr, $now:expr, $msg:literal) => {
        if let Some(suppressed) = $throttle.admit($msg, $now) {
            tracing::error!(suppressed, $msg);
        }
    };
    ($throttle:expr, $now:expr, $msg:literal, $($field:tt)+) => {
        if let Some(suppressed) = $throttle.admit($msg, $now) {
            tracing::error!($($field)+, suppressed, $msg);
        }
    };
}

/// [`warn_throttled!`] at `info` level: for routine lines a peer can repeat at will (a session
/// opened and closed in a loop).
#[macro_export]
macro_rules! info_throttled {
    ($throttle:expr, $now:expr, $msg:literal) => {
        if let Some(suppressed) = $throttle.admit($msg, $now) {
            tracing::info!(suppressed, $msg);
        }
    };
    ($throttle:expr, $now:expr, $msg:literal, $($field:tt)+) => {
        if let Some(suppressed) = $throttle.admit($msg, $now) {
            tracing::info!($($field)+, suppressed, $msg);
        }
    };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_per_kind_per_interval_and_the_rest_counted() {
        let t0 = Instant::now();
        let mut t = WarnThrottle::new(Duration::from_secs(1));
        for _ in 0..BURST {
            assert_eq!(t.admit("junk", t0), Some(0));
        }
        for i in 1..=1000u64 {
            assert_eq!(t.admit("junk", t0 + Duration::from_micros(i)), None);
        }
        assert_eq!(t.admit("other", t0), Some(0), "kinds are separate");
        assert_eq!(t.admit("junk", t0 + Duration::from_secs(1)), Some(1000));
        for _ in 1..BURST {
            assert_eq!(t.admit("junk", t0 + Duration::from_millis(1500)), Some(0));
        }
        assert_eq!(t.admit("junk", t0 + Duration::from_millis(1500)), None);
        assert_eq!(t.admit("junk", t0 + Duration::from_secs(3)), Some(1));
        assert_eq!(t.total_suppressed(), 1001);
    }
}
