//! Loads that ended but whose blocks a peer may still write: held until the data plane says
//! no write of theirs can land ([`DataPlane::writes_fenced`]), then reported.
//!
//! A producer that stalls past the consumer's load and abort-ack timeouts (a GC pause, swap,
//! SIGSTOP, or a hostile peer doing it on purpose) and then finishes its write would land its
//! bytes in blocks the consumer handed to another key meanwhile: wrong KV served silently. So a
//! load whose end the peer did not confirm (`transfer_done`, `abort_ack`) is reported failed at
//! once (`Event::LoadHeld`), and its blocks handed back (`LoadDone`) only once the plane fenced
//! the peer's access to them: on shm when no write of that session is in progress in them
//! (their fence words revoked), on tcp when no claim of the writer holds them, on nixl when the
//! peer's side ended the session or another process took its identity. Until then the blocks
//! stay reserved at the caller (the store, the engine), so nothing else can be written to or
//! read from them.
//!
//! Owned by the [`Core`](crate::Core) on its thread; asked again after every event that can
//! settle a fence (a session's end, plane progress) and every [`FENCE_RECHECK`] while any load
//! waits. Each entry is a load that was in flight; on nixl one may wait as long as its producer
//! stays stalled, so what a host may leave here is bounded by its share (`submit_load`).

use std::time::{Duration, Instant};

use kvpeer_proto::{KvRequestId, PeerId};

use crate::traits::{BlockIndex, DataPlane, JobId, WriteEnd};

/// How soon loads waiting for their fence are asked about again; the wait doubles while none
/// settles, up to `FENCE_RECHECK_MAX` (a block a killed writer left mid-copy never settles,
/// and must not keep an idle node waking 50 times a second).
pub const FENCE_RECHECK: Duration = Duration::from_millis(20);
/// The longest wait between two asks.
pub(crate) const FENCE_RECHECK_MAX: Duration = Duration::from_secs(1);

/// One ended load whose blocks wait for their fence.
#[derive(Debug)]
pub(crate) struct Fencing {
    pub(crate) job: JobId,
    pub(crate) kv_request_id: KvRequestId,
    /// Whether the engine still runs the request (its failure then makes its lookups answer
    /// MISS: done when the load is held, not again when it settles).
    pub(crate) live: bool,
    /// The producer that was writing them.
    pub(crate) peer: PeerId,
    pub(crate) blocks: Vec<BlockIndex>,
    /// The peer said its writes ended.
    pub(crate) confirmed: bool,
    /// Its session ended from the peer's side (see [`WriteEnd::peer_ended`]).
    pub(crate) peer_ended: bool,
    /// When it started waiting (for the log once it settles).
    pub(crate) since: Instant,
}

impl Fencing {
    /// How its writes ended, for the plane.
    pub(crate) fn end(&self) -> WriteEnd {
        WriteEnd {
            confirmed: self.confirmed,
            peer_ended: self.peer_ended,
            at: self.since,
        }
    }
}

/// The loads waiting for their fence.
#[derive(Debug, Default)]
pub(crate) struct Fences {
    /// Each with its producer's host ([`host_of`](super::index::host_of)), read once.
    waiting: Vec<(String, Fencing)>,
    /// When they are asked about again.
    recheck_at: Option<Instant>,
    /// The current wait between asks.
    interval: Duration,
}

impl Fences {
    /// Blocks held by loads still waiting.
    pub(crate) fn held_blocks(&self) -> usize {
        self.waiting.iter().map(|(_, f)| f.blocks.len()).sum()
    }

    pub(crate) fn len(&self) -> usize {
        self.waiting.len()
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.recheck_at
    }

    /// Holds a load whose blocks are not fenced yet.
    pub(crate) fn hold(&mut self, f: Fencing, now: Instant) {
        self.waiting.push((super::index::host_of(&f.peer), f));
        self.interval = FENCE_RECHECK;
        self.recheck_at = Some(now + FENCE_RECHECK);
    }

    /// Blocks held by loads from peers of `host` ([`host_of`](super::index::host_of)).
    pub(crate) fn held_blocks_of_host(&self, host: &str) -> usize {
        self.waiting
            .iter()
            .filter(|(of, _)| of == host)
            .map(|(_, f)| f.blocks.len())
            .sum()
    }

    /// Takes every waiting load whose blocks are now fenced; arms the next recheck.
    pub(crate) fn take_fenced(&mut self, plane: &mut dyn DataPlane, now: Instant) -> Vec<Fencing> {
        let mut fenced = Vec::new();
        let mut i = 0;
        while i < self.waiting.len() {
            let (_, f) = &self.waiting[i];
            if plane.writes_fenced(&f.peer, &f.blocks, f.end()) {
                fenced.push(self.waiting.swap_remove(i).1);
            } else {
                i += 1;
            }
        }
        self.interval = if fenced.is_empty() {
            (self.interval * 2).clamp(FENCE_RECHECK, FENCE_RECHECK_MAX)
        } else {
            FENCE_RECHECK
        };
        self.recheck_at = (!self.waiting.is_empty()).then(|| now + self.interval);
        fenced
    }

    /// Whether a recheck is due.
    pub(crate) fn due(&self, now: Instant) -> bool {
        self.recheck_at.is_some_and(|at| at <= now)
    }
}
