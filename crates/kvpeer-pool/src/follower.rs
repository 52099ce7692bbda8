//! One engine's KV event stream, followed: batches in order, gaps and restarts noticed, and
//! replays asked for where they can recover what was lost.
//!
//! What the stream really does (`../shared/spec/vllm-integration.md` §3): every batch carries a
//! sequence number from 0; a subscriber that joins late misses earlier batches with no gap to
//! see, so on every (re)connect the follower asks the publisher's replay socket for everything
//! from the next number it needs (0 the first time); a gap (`seq` jumps ahead) asks for the
//! missing range; a publisher restart (`seq` goes back) means the engine's CPU tier is new: what
//! it held is forgotten and the replay starts at 0 again. While a replay runs, live batches are
//! held (bounded) and applied after it, in order, so a removal never overtakes the store it
//! undoes. The publisher keeps only its last 10,000 batches: what a replay cannot reach is lost
//! for good, counted, and the stream goes on from what there is. A replay that does not end
//! within `replay_timeout` (no replay socket, a dead publisher) is given up the same way.
//!
//! **At most one replay per `min_replay_interval`.** A replay costs the publisher its whole
//! buffer (up to 10,000 batches), and every sequence number the stream carries is the sender's
//! word: a publisher that lies (or whoever reaches a SUB that binds) can make every batch look
//! like a restart or a gap. So a replay wanted sooner than `min_replay_interval` after the last
//! one asked is not asked at once: it is due at the end of the interval (one for all the
//! reasons that came meanwhile, from the earliest batch any of them needed), and live batches
//! are held until its answer, as during any replay. An honest stream loses nothing by it: the
//! batches it needs stay in the publisher's buffer.
//!
//! Malformed batches and events are counted and logged once per kind; they never stop the
//! stream. Memory: the held batches (`max_held_batches` of at most the decoder's payload
//! limit each, and `max_held_bytes` together) and the [`Holdings`].

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use kvpeer_proto::events::{decode_batch, BlockStored, EventError, EventLimits, KvEvent};
use tracing::warn;

use crate::holdings::{EngineSlot, Holdings, PullCandidate};
use crate::keys::{key_event, KeyEvent, Unusable};

/// Bounds of one follower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FollowerLimits {
    /// Live batches held while a replay runs (older ones are dropped past it, and counted).
    pub max_held_batches: usize,
    /// Bytes those held batches may take together (each may be up to the decoder's payload
    /// limit, so the count alone would let a publisher make the follower hold gigabytes).
    pub max_held_bytes: usize,
    /// How long a replay may take before it is given up.
    pub replay_timeout: Duration,
    /// The shortest time between two replays asked of the publisher: a replay wanted sooner
    /// waits until then.
    pub min_replay_interval: Duration,
    /// The decoder's limits.
    pub events: EventLimits,
}

impl Default for FollowerLimits {
    fn default() -> Self {
        FollowerLimits {
            max_held_batches: 4096,
            max_held_bytes: 64 << 20,
            replay_timeout: Duration::from_secs(5),
            min_replay_interval: Duration::from_secs(1),
            events: EventLimits::default(),
        }
    }
}

/// What the follower asks of its caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FollowAction {
    /// Ask the publisher's replay socket for every batch from `from` on.
    Replay {
        /// The first sequence number wanted.
        from: u64,
    },
    /// A key worth pulling from this engine (or another holder).
    Pull(PullCandidate),
}

/// Counts of what the stream brought.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FollowerStats {
    /// Batches applied (live and replayed).
    pub batches: u64,
    /// Events read in them.
    pub events: u64,
    /// Stores of CPU-tier chunks.
    pub stored: u64,
    /// Removals.
    pub removed: u64,
    /// Events of another medium.
    pub not_cpu: u64,
    /// Events with int hashes (no key can be formed).
    pub int_hashes: u64,
    /// Payloads that are not a batch.
    pub malformed_batches: u64,
    /// Events that are not an event.
    pub malformed_events: u64,
    /// Live batches whose number jumped ahead.
    pub gaps: u64,
    /// Times the numbers went back (the publisher restarted).
    pub restarts: u64,
    /// Replays asked for.
    pub replays: u64,
    /// Replays wanted sooner than `min_replay_interval` after the last one, and so put off to
    /// the end of the interval (several such are one replay).
    pub replays_deferred: u64,
    /// Batches no replay could bring back (before the publisher's buffer, or given up).
    pub lost_batches: u64,
    /// Replays that did not end in time.
    pub replays_timed_out: u64,
    /// Live batches dropped because too many were held during a replay.
    pub held_dropped: u64,
    /// Replayed or held batches already applied, skipped.
    pub duplicates: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Replay {
    Idle,
    /// Asked at `since`; its answer not ended yet.
    Waiting {
        since: Instant,
    },
    /// Wanted from `from`, to be asked at `at` (the end of the interval since the last one).
    Due {
        from: u64,
        at: Instant,
    },
}

/// One followed engine's stream.
#[derive(Debug)]
pub struct Follower {
    slot: EngineSlot,
    limits: FollowerLimits,
    /// Whether the publisher has a replay socket.
    can_replay: bool,
    /// The next sequence number to apply; `None` before the first.
    next: Option<u64>,
    replay: Replay,
    /// When the last replay was asked.
    last_replay: Option<Instant>,
    held: VecDeque<(u64, Vec<u8>)>,
    /// Bytes of `held`.
    held_bytes: usize,
    stats: FollowerStats,
    /// Kinds of trouble already logged (one warning per kind per follower).
    logged: u16,
}

const LOG_MALFORMED_BATCH: u16 = 1;
const LOG_MALFORMED_EVENT: u16 = 1 << 1;
const LOG_INT_HASHES: u16 = 1 << 2;
const LOG_GAP: u16 = 1 << 3;
const LOG_RESTART: u16 = 1 << 4;
const LOG_LOST: u16 = 1 << 5;
const LOG_REPLAY_TIMEOUT: u16 = 1 << 6;
const LOG_HELD_DROPPED: u16 = 1 << 7;

impl Follower {
    /// A follower for the engine in `slot`; `can_replay` if its publisher has a replay socket.
    pub fn new(slot: EngineSlot, limits: FollowerLimits, can_replay: bool) -> Self {
        Follower {
            slot,
            limits,
            can_replay,
            next: None,
            replay: Replay::Idle,
            last_replay: None,
            held: VecDeque::new(),
            held_bytes: 0,
            stats: FollowerStats::default(),
            logged: 0,
        }
    }

    /// The engine's slot.
    pub fn slot(&self) -> EngineSlot {
        self.slot
    }

    /// What the stream brought so far.
    pub fn stats(&self) -> FollowerStats {
        self.stats
    }

    /// The next sequence number the follower needs (0 before the first batch).
    pub fn next_seq(&self) -> u64 {
        self.next.unwrap_or(0)
    }

    /// Whether a replay is running or due (live batches are held meanwhile).
    pub fn replaying(&self) -> bool {
        !matches!(self.replay, Replay::Idle)
    }

    /// The subscription is (re)connected: whatever was published meanwhile is only in the
    /// publisher's replay buffer, so ask for it.
    pub fn connected(&mut self, now: Instant) -> Vec<FollowAction> {
        let mut out = Vec::new();
        self.ask_replay(now, self.next_seq(), &mut out);
        out
    }

    /// A live batch `seq` arrived on the subscription.
    pub fn live(
        &mut self,
        now: Instant,
        seq: u64,
        payload: Vec<u8>,
        holdings: &mut Holdings,
    ) -> Vec<FollowAction> {
        let mut out = Vec::new();
        if self.replaying() {
            self.hold(seq, payload);
            return out;
        }
        match self.next {
            Some(next) if seq < next => {
                // Numbers went back: a new publisher (vLLM's restart at 0, no epoch), whose
                // engine holds nothing of what the old one announced.
                self.stats.restarts += 1;
                self.log_once(LOG_RESTART, || {
                    format!(
                        "the publisher restarted (seq {seq} after {next}): forgetting its blocks"
                    )
                });
                holdings.forget_engine(self.slot);
                self.next = None;
                if self.can_replay && seq > 0 {
                    self.hold(seq, payload);
                    self.ask_replay(now, 0, &mut out);
                } else {
                    self.apply(seq, &payload, holdings, &mut out);
                }
            }
            Some(next) if seq > next => {
                self.stats.gaps += 1;
                self.log_once(LOG_GAP, || {
                    format!("batches {next}..{seq} were missed on the subscription")
                });
                if self.can_replay {
                    self.hold(seq, payload);
                    self.ask_replay(now, next, &mut out);
                } else {
                    self.lost(seq - next);
                    self.apply(seq, &payload, holdings, &mut out);
                }
            }
            _ => self.apply(seq, &payload, holdings, &mut out),
        }
        out
    }

    /// A batch the replay socket sent (ignored unless a replay is running).
    pub fn replayed(
        &mut self,
        seq: u64,
        payload: &[u8],
        holdings: &mut Holdings,
    ) -> Vec<FollowAction> {
        let mut out = Vec::new();
        if !matches!(self.replay, Replay::Waiting { .. }) {
            return out;
        }
        match self.next {
            Some(next) if seq < next => self.stats.duplicates += 1,
            Some(next) if seq > next => {
                // The publisher's buffer does not reach back that far.
                self.lost(seq - next);
                self.apply(seq, payload, holdings, &mut out);
            }
            _ => self.apply(seq, payload, holdings, &mut out),
        }
        out
    }

    /// The replay's end marker arrived: the held live batches are applied, in order.
    pub fn replay_end(&mut self, holdings: &mut Holdings) -> Vec<FollowAction> {
        let mut out = Vec::new();
        if matches!(self.replay, Replay::Waiting { .. }) {
            self.replay = Replay::Idle;
            self.drain_held(holdings, &mut out);
        }
        out
    }

    /// Time passed: a replay that is due is asked; one past its deadline is given up (what it
    /// would have brought is lost; the held batches are applied).
    pub fn tick(&mut self, now: Instant, holdings: &mut Holdings) -> Vec<FollowAction> {
        let mut out = Vec::new();
        if let Replay::Due { from, at } = self.replay {
            if now >= at {
                self.start_replay(now, from, &mut out);
            }
            return out;
        }
        if let Replay::Waiting { since } = self.replay {
            if now.saturating_duration_since(since) >= self.limits.replay_timeout {
                self.stats.replays_timed_out += 1;
                let timeout = self.limits.replay_timeout;
                self.log_once(LOG_REPLAY_TIMEOUT, || {
                    format!("no end of replay within {timeout:?}: going on without it")
                });
                self.replay = Replay::Idle;
                self.drain_held(holdings, &mut out);
            }
        }
        out
    }

    /// When [`Follower::tick`] next has something to do.
    pub fn next_deadline(&self) -> Option<Instant> {
        match self.replay {
            Replay::Waiting { since } => Some(since + self.limits.replay_timeout),
            Replay::Due { at, .. } => Some(at),
            Replay::Idle => None,
        }
    }

    /// Wants a replay from `from`: asked now, or at the end of the interval since the last one
    /// (then one replay serves every reason that came before it, from the earliest batch).
    fn ask_replay(&mut self, now: Instant, from: u64, out: &mut Vec<FollowAction>) {
        if !self.can_replay {
            return;
        }
        // From here on, batch `from` is the one needed: anything later that comes first (a
        // live batch held, a replay that starts later) means the ones before it are lost.
        self.next = Some(from);
        let earliest = self
            .last_replay
            .map(|last| last + self.limits.min_replay_interval);
        match earliest {
            Some(at) if now < at => {
                self.stats.replays_deferred += 1;
                let from = match self.replay {
                    Replay::Due { from: due, .. } => due.min(from),
                    _ => from,
                };
                self.next = Some(from);
                self.replay = Replay::Due { from, at };
            }
            _ => self.start_replay(now, from, out),
        }
    }

    fn start_replay(&mut self, now: Instant, from: u64, out: &mut Vec<FollowAction>) {
        self.stats.replays += 1;
        self.last_replay = Some(now);
        self.replay = Replay::Waiting { since: now };
        self.next = Some(from);
        out.push(FollowAction::Replay { from });
    }

    fn hold(&mut self, seq: u64, payload: Vec<u8>) {
        while !self.held.is_empty()
            && (self.held.len() >= self.limits.max_held_batches.max(1)
                || self.held_bytes + payload.len() > self.limits.max_held_bytes)
        {
            if let Some((_, old)) = self.held.pop_front() {
                self.held_bytes -= old.len();
            }
            self.stats.held_dropped += 1;
            self.log_once(LOG_HELD_DROPPED, || {
                "too many live batches during a replay: dropping the oldest".into()
            });
        }
        self.held_bytes += payload.len();
        self.held.push_back((seq, payload));
    }

    fn drain_held(&mut self, holdings: &mut Holdings, out: &mut Vec<FollowAction>) {
        self.held_bytes = 0;
        let mut held: Vec<(u64, Vec<u8>)> = self.held.drain(..).collect();
        held.sort_by_key(|(seq, _)| *seq);
        for (seq, payload) in held {
            match self.next {
                Some(next) if seq < next => self.stats.duplicates += 1,
                Some(next) if seq > next => {
                    self.lost(seq - next);
                    self.apply(seq, &payload, holdings, out);
                }
                _ => self.apply(seq, &payload, holdings, out),
            }
        }
    }

    fn lost(&mut self, batches: u64) {
        self.stats.lost_batches += batches;
        self.log_once(LOG_LOST, || {
            format!("{batches} batches could not be recovered (older than the publisher's buffer)")
        });
    }

    /// Applies batch `seq` to `holdings`; the keys that became worth pulling go to `out`.
    fn apply(
        &mut self,
        seq: u64,
        payload: &[u8],
        holdings: &mut Holdings,
        out: &mut Vec<FollowAction>,
    ) {
        self.next = Some(seq.saturating_add(1));
        let batch = match decode_batch(payload, &self.limits.events) {
            Ok(b) => b,
            Err(e) => {
                self.stats.malformed_batches += 1;
                self.log_once(LOG_MALFORMED_BATCH, || format!("batch {seq} dropped: {e}"));
                return;
            }
        };
        self.stats.batches += 1;
        for event in batch.events {
            self.stats.events += 1;
            let event = match event {
                Ok(e) => e,
                Err(e) => {
                    self.malformed_event(seq, &e);
                    continue;
                }
            };
            if let KvEvent::Stored(stored) = &event {
                if let BlockStored {
                    group_idx: Some(group),
                    kv_cache_spec_kind: Some(kind),
                    ..
                } = stored
                {
                    holdings.learn_group_kind(*group, kind);
                }
                holdings.catalog_mut().learn(stored);
            }
            match key_event(&event) {
                KeyEvent::Stored(key) => {
                    self.stats.stored += 1;
                    if let Some(c) = holdings.stored(self.slot, key) {
                        out.push(FollowAction::Pull(c));
                    }
                }
                KeyEvent::Removed(keys) => {
                    self.stats.removed += 1;
                    for key in &keys {
                        holdings.removed(self.slot, key);
                    }
                }
                KeyEvent::Unusable(Unusable::NotCpu) => self.stats.not_cpu += 1,
                KeyEvent::Unusable(Unusable::IntHashes) => {
                    self.stats.int_hashes += 1;
                    self.log_once(LOG_INT_HASHES, || {
                        "the engine publishes int block hashes: no P2P key can be formed \
                         (start it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)"
                            .into()
                    });
                }
                KeyEvent::Unusable(Unusable::Empty | Unusable::Other) => {}
            }
        }
    }

    fn malformed_event(&mut self, seq: u64, e: &EventError) {
        self.stats.malformed_events += 1;
        self.log_once(LOG_MALFORMED_EVENT, || {
            format!("in batch {seq}, an event dropped: {e}")
        });
    }

    fn log_once(&mut self, kind: u16, message: impl FnOnce() -> String) {
        if self.logged & kind == 0 {
            self.logged |= kind;
            let slot = self.slot.index();
            warn!(engine = slot, "{} (logged once)", message());
        }
    }
}
