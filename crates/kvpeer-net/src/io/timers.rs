//! Deadlines of many sockets in one place, so a wake visits only the sockets that are due.
//!
//! A min-heap of `(when, key)`. Each key has at most one deadline that counts, the one its
//! owner set last ([`Timers::set`]); an earlier one still in the heap is stale and skipped
//! when it comes up, so setting a deadline is O(log n) with nothing searched or removed. The
//! heap holds at most one live entry per key plus the stale ones not yet reached; it is
//! rebuilt from the live entries when the stale ones outnumber them.
//!
//! **Batched wakes.** Heartbeats and the other per-connection deadlines are not precise to the
//! microsecond: [`coarse`] puts a deadline on the next 10 ms boundary of a process-wide grid,
//! so the deadlines of many connections that fall in the same 10 ms are met by one wake
//! (with a thousand connections each pinging every 2 s, about 50 wakes a second at most,
//! instead of 500).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::Hash;
use std::sync::LazyLock;
use std::time::{Duration, Instant};

/// The grid of [`coarse`] deadlines.
pub(crate) const GRAIN: Duration = Duration::from_millis(10);

static EPOCH: LazyLock<Instant> = LazyLock::new(Instant::now);

/// `at` moved up to the next [`GRAIN`] boundary (never earlier), so nearby deadlines of many
/// sockets share one wake.
pub(crate) fn coarse(at: Instant) -> Instant {
    let epoch = *EPOCH;
    let since = at.saturating_duration_since(epoch).as_nanos();
    let grain = GRAIN.as_nanos();
    let up = since.div_ceil(grain) * grain;
    epoch + Duration::from_nanos(u64::try_from(up).unwrap_or(u64::MAX))
}

/// One deadline per key.
#[derive(Debug)]
pub(crate) struct Timers<K: Clone + Eq + Hash + Ord> {
    heap: BinaryHeap<Reverse<(Instant, K)>>,
    live: HashMap<K, Instant>,
}

impl<K: Clone + Eq + Hash + Ord> Default for Timers<K> {
    fn default() -> Self {
        Timers {
            heap: BinaryHeap::new(),
            live: HashMap::new(),
        }
    }
}

impl<K: Clone + Eq + Hash + Ord> Timers<K> {
    /// `key`'s deadline is now `at` (`None`: it has none), replacing any earlier one.
    pub(crate) fn set(&mut self, key: K, at: Option<Instant>) {
        match at {
            Some(at) => {
                if self.live.insert(key.clone(), at) != Some(at) {
                    self.heap.push(Reverse((at, key)));
                    self.compact();
                }
            }
            None => {
                self.live.remove(&key);
            }
        }
    }

    /// The earliest deadline of any key.
    pub(crate) fn next(&mut self) -> Option<Instant> {
        while let Some(Reverse((at, key))) = self.heap.peek() {
            if self.live.get(key) == Some(at) {
                return Some(*at);
            }
            self.heap.pop();
        }
        None
    }

    /// Takes the keys whose deadline is at or before `now` (each's deadline is then gone),
    /// earliest first, into `out`.
    pub(crate) fn take_due(&mut self, now: Instant, out: &mut Vec<K>) {
        while let Some(at) = self.next() {
            if at > now {
                return;
            }
            if let Some(Reverse((_, key))) = self.heap.pop() {
                self.live.remove(&key);
                out.push(key);
            }
        }
    }

    /// Rebuilds the heap from the live deadlines once stale entries are most of it.
    fn compact(&mut self) {
        if self.heap.len() > 64 && self.heap.len() > 4 * self.live.len() {
            self.heap = self
                .live
                .iter()
                .map(|(key, at)| Reverse((*at, key.clone())))
                .collect();
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn only_the_last_deadline_of_a_key_counts() {
        let t0 = Instant::now();
        let ms = |n| t0 + Duration::from_millis(n);
        let mut timers = Timers::default();
        timers.set(1u64, Some(ms(30)));
        timers.set(2, Some(ms(10)));
        timers.set(1, Some(ms(5)));
        timers.set(3, Some(ms(20)));
        timers.set(3, None);
        assert_eq!(timers.next(), Some(ms(5)));
        let mut due = Vec::new();
        timers.take_due(ms(10), &mut due);
        assert_eq!(due, vec![1, 2]);
        due.clear();
        // Key 1's earlier deadline (30) was replaced, key 3's cancelled: nothing more.
        timers.take_due(ms(100), &mut due);
        assert!(due.is_empty(), "{due:?}");
        assert_eq!(timers.next(), None);
    }

    #[test]
    fn stale_entries_do_not_grow_without_bound() {
        let t0 = Instant::now();
        let mut timers = Timers::default();
        for i in 0..100_000u64 {
            timers.set(i % 10, Some(t0 + Duration::from_micros(i)));
        }
        assert!(timers.heap.len() <= 65, "{}", timers.heap.len());
        let mut due = Vec::new();
        timers.take_due(t0 + Duration::from_secs(1), &mut due);
        due.sort_unstable();
        assert_eq!(due, (0..10).collect::<Vec<_>>());
    }

    #[test]
    fn coarse_deadlines_share_a_boundary_and_are_never_early() {
        let at = Instant::now() + Duration::from_millis(3);
        let c = coarse(at);
        assert!(c >= at && c < at + GRAIN, "{:?}", c - at);
        assert_eq!(coarse(c - Duration::from_nanos(1)), c);
        assert_eq!(coarse(c), c);
    }
}
