//! Deadlines in O(1): one FIFO lane per timeout kind.
//!
//! Every timeout of the protocol is a fixed duration from the moment it is armed, and `now`
//! never goes backwards, so entries pushed to one lane are already in deadline order. A lane is
//! a `VecDeque`: arming is a push, the next deadline is the front, firing is a pop. Entries are
//! never removed early: when a timed thing completes, its entry stays until it reaches the
//! front, where the owner sees it no longer matches and drops it. Cost per operation stays
//! constant however many requests are open, which a scan (vLLM's way) or a sorted structure
//! would not give.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// Deadlines of one fixed duration, in the order they were armed.
#[derive(Debug)]
pub(crate) struct Lane<K> {
    delay: Duration,
    queue: VecDeque<(Instant, K)>,
}

impl<K> Lane<K> {
    pub(crate) fn new(delay: Duration) -> Self {
        Lane {
            delay,
            queue: VecDeque::new(),
        }
    }

    /// Arms a deadline `delay` after `now` and returns it.
    pub(crate) fn arm(&mut self, now: Instant, key: K) -> Instant {
        let deadline = now + self.delay;
        // `now` is non-decreasing (the core enforces it), so the queue stays sorted.
        self.queue.push_back((deadline, key));
        deadline
    }

    /// The fixed duration of this lane.
    pub(crate) fn delay(&self) -> Duration {
        self.delay
    }

    /// The earliest deadline still queued (possibly for something already finished).
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.queue.front().map(|(at, _)| *at)
    }

    /// Takes the earliest entry if its deadline has passed.
    pub(crate) fn pop_due(&mut self, now: Instant) -> Option<(Instant, K)> {
        match self.queue.front() {
            Some((at, _)) if *at <= now => self.queue.pop_front(),
            _ => None,
        }
    }

    pub(crate) fn clear(&mut self) {
        self.queue.clear();
    }

    /// The `i`-th entry from the earliest (stale ones included).
    pub(crate) fn get(&self, i: usize) -> Option<&K> {
        self.queue.get(i).map(|(_, k)| k)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.queue.len()
    }
}

/// The earliest of several optional deadlines.
pub(crate) fn earliest(deadlines: impl IntoIterator<Item = Option<Instant>>) -> Option<Instant> {
    deadlines.into_iter().flatten().min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lane_fires_in_order_and_only_when_due() {
        let t0 = Instant::now();
        let mut lane = Lane::new(Duration::from_secs(30));
        lane.arm(t0, "a");
        lane.arm(t0 + Duration::from_secs(1), "b");
        assert_eq!(lane.next_deadline(), Some(t0 + Duration::from_secs(30)));
        assert!(lane.pop_due(t0 + Duration::from_secs(29)).is_none());
        let due = t0 + Duration::from_secs(31);
        assert_eq!(lane.pop_due(due).map(|(_, k)| k), Some("a"));
        assert_eq!(lane.pop_due(due).map(|(_, k)| k), Some("b"));
        assert!(lane.pop_due(due).is_none());
        assert_eq!(lane.len(), 0);
    }
}
