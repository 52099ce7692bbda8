//! One followed engine's puller: candidates in groups, each group one consumer request to the
//! engine (lookup, fetch of the leading hits, finish), paced by two token buckets.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_core::LookupResult;
use kvpeer_pool::EngineSlot;
use kvpeer_proto::{OffloadKey, PeerId};
use tracing::{debug, warn};

use super::{PullJob, Shared, PULL_BATCH};
use crate::api::Node;

/// A token bucket of `rate` tokens per second holding up to one second's worth; a take may go
/// into debt (a batch bigger than a second's worth), which the next takes wait off.
#[derive(Debug)]
pub(super) struct Bucket {
    rate: Option<u64>,
    tokens: f64,
    last: Instant,
}

impl Bucket {
    /// `None`: no limit.
    pub(super) fn new(rate: Option<u64>) -> Self {
        Bucket {
            rate,
            tokens: rate.map_or(0.0, |r| r as f64),
            last: Instant::now(),
        }
    }

    /// Takes `n` tokens; how long to wait before using them.
    pub(super) fn take(&mut self, n: u64, now: Instant) -> Duration {
        let Some(rate) = self.rate else {
            return Duration::ZERO;
        };
        let rate = rate as f64;
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * rate).min(rate) - n as f64;
        if self.tokens >= 0.0 {
            Duration::ZERO
        } else {
            Duration::from_secs_f64(-self.tokens / rate)
        }
    }
}

pub(super) struct Puller {
    pub(super) node: Arc<Node>,
    pub(super) peer: PeerId,
    /// Its engine's place in the index (a failed pull is offered again in its tenant's group).
    pub(super) slot: EngineSlot,
    pub(super) lookups: Bucket,
    pub(super) bytes: Arc<Mutex<Bucket>>,
    pub(super) failed: SyncSender<(OffloadKey, EngineSlot)>,
    pub(super) shared: Arc<Shared>,
    pub(super) stop: Arc<AtomicBool>,
}

impl Puller {
    pub(super) fn run(mut self, jobs: &Receiver<PullJob>) {
        let mut next = 0u64;
        // A request never takes more than a quarter of the pool: a pool smaller than what the
        // engines announce then keeps its latest blocks instead of failing whole batches.
        let batch = usize::try_from(self.node.config().num_blocks / 4)
            .unwrap_or(PULL_BATCH)
            .clamp(1, PULL_BATCH);
        // Blocks until a candidate comes (no wake-ups while the engine announces nothing: 64
        // followed engines at rest cost nothing); the pool thread going away (its senders
        // dropped) ends the wait.
        while !self.stop.load(Ordering::Relaxed) {
            let Ok(first) = jobs.recv() else {
                return;
            };
            let mut keys = vec![first.key];
            while keys.len() < batch {
                match jobs.try_recv() {
                    Ok(j) => keys.push(j.key),
                    Err(_) => break,
                }
            }
            next += 1;
            self.pull(keys, next);
        }
    }

    /// Pulls what of `keys` the node does not hold yet.
    fn pull(&mut self, keys: Vec<OffloadKey>, n: u64) {
        let held = match self.node.contains_for(&self.peer, &keys) {
            Ok(h) => h,
            Err(e) => {
                debug!(error = %e, "the node is gone: the puller stops");
                self.stop.store(true, Ordering::Relaxed);
                return;
            }
        };
        let before = keys.len();
        let keys: Vec<OffloadKey> = keys
            .into_iter()
            .zip(held)
            .filter(|(_, h)| !h)
            .map(|(k, _)| k)
            .collect();
        let skipped = (before - keys.len()) as u64;
        self.shared
            .already_held
            .fetch_add(skipped, Ordering::Relaxed);
        if keys.is_empty() {
            return;
        }
        let wait = self.lookups.take(1, Instant::now());
        if !self.sleep(wait) {
            return;
        }
        let spec = self.node.config();
        let (lookup_timeout, load_timeout) = (spec.core.lookup_timeout, spec.core.load_timeout);
        let block_len = spec.block_len;
        // Unique across this node's pullers (one per engine, each counting from 1): the node
        // keeps one open request per id, so two pullers' "…-1" refused one another.
        let id = format!("kvpeer-pool-{}-{}-{n}", std::process::id(), self.peer);
        self.shared.pull_requests.fetch_add(1, Ordering::Relaxed);
        let pulled = match self.node.request(&self.peer, &id) {
            Ok(req) => match req.lookup(&keys, lookup_timeout) {
                Ok(found) => {
                    let hits = found
                        .iter()
                        .take_while(|r| **r == LookupResult::Hit)
                        .count();
                    let bytes = block_len.saturating_mul(hits as u64);
                    let wait = self
                        .bytes
                        .lock()
                        .map_or(Duration::ZERO, |mut b| b.take(bytes, Instant::now()));
                    if hits == 0 || !self.sleep(wait) {
                        0
                    } else {
                        match req.fetch(&keys[..hits], load_timeout) {
                            Ok(()) => hits,
                            Err(e) => {
                                if let Some(suppressed) =
                                    crate::admit_warning("a pull's fetch failed")
                                {
                                    warn!(peer = %self.peer, error = %e, suppressed, "a pull's fetch failed");
                                }
                                0
                            }
                        }
                    }
                }
                Err(e) => {
                    if let Some(suppressed) = crate::admit_warning("a pull's lookup failed") {
                        warn!(peer = %self.peer, error = %e, suppressed, "a pull's lookup failed");
                    }
                    0
                }
            },
            Err(e) => {
                if let Some(suppressed) = crate::admit_warning("cannot open a pull request") {
                    warn!(peer = %self.peer, error = %e, suppressed, "cannot open a pull request");
                }
                0
            }
        };
        let s = &self.shared;
        s.pulled_blocks.fetch_add(pulled as u64, Ordering::Relaxed);
        s.pulled_bytes
            .fetch_add(block_len.saturating_mul(pulled as u64), Ordering::Relaxed);
        let failed = &keys[pulled..];
        s.pull_failures
            .fetch_add(failed.len() as u64, Ordering::Relaxed);
        for key in failed {
            // A full queue: the key waits for its next announcement instead.
            let _ = self.failed.try_send((key.clone(), self.slot));
        }
    }

    /// Sleeps `d` in ticks, unless told to stop (then false).
    fn sleep(&self, d: Duration) -> bool {
        let until = Instant::now() + d;
        loop {
            if self.stop.load(Ordering::Relaxed) {
                return false;
            }
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return true;
            }
            std::thread::sleep(left.min(super::TICK));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Bucket;
    use std::time::{Duration, Instant};

    #[test]
    fn a_bucket_lets_a_seconds_worth_through_then_paces() {
        let t0 = Instant::now();
        let mut b = Bucket::new(Some(10));
        for _ in 0..10 {
            assert_eq!(b.take(1, t0), Duration::ZERO);
        }
        let wait = b.take(1, t0);
        assert!(wait > Duration::from_millis(99) && wait < Duration::from_millis(101));
        assert_eq!(b.take(1, t0 + Duration::from_millis(200)), Duration::ZERO);
        let mut free = Bucket::new(None);
        assert_eq!(free.take(u64::MAX, t0), Duration::ZERO);
    }
}
