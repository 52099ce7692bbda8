//! Lookups a driver's callers wait on, answered when the core says something changed for
//! them ([`crate::node::outcomes`]) or when their deadline passes, never by asking the core
//! about every waiting lookup on every wake.
//!
//! Used on the node's thread by [`crate::api::runtime`] (a `Node` caller's blocking lookup,
//! with a deadline) and by [`crate::engine::EngineNode`] (the engine's lookups, no deadline:
//! the core's own lookup timeout ends them). Nothing here blocks.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use kvpeer_core::{LookupResult, Parent, Request};
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

use crate::node::io::NodeIo;

/// One waiting lookup and what its driver keeps with it (`T`: where the answer goes).
pub(crate) struct Waiting<T> {
    pub(crate) started: Instant,
    pub(crate) request: Request,
    pub(crate) keys: Vec<OffloadKey>,
    /// When the caller stops waiting (`None`: never, the core's own timeout answers it).
    pub(crate) deadline: Option<Instant>,
    pub(crate) with: T,
}

/// How a waiting lookup ended.
pub(crate) enum Ended {
    /// Every key answered.
    Answered(Vec<LookupResult>),
    /// Its deadline passed first.
    Expired,
}

/// The waiting lookups, by request.
pub(crate) struct LookupWaits<T> {
    by_request: HashMap<KvRequestId, Vec<Waiting<T>>>,
    /// The earliest deadline of them: a wake before it looks at none.
    next_deadline: Option<Instant>,
}

impl<T> Default for LookupWaits<T> {
    fn default() -> Self {
        LookupWaits {
            by_request: HashMap::new(),
            next_deadline: None,
        }
    }
}

impl<T> LookupWaits<T> {
    pub(crate) fn is_empty(&self) -> bool {
        self.by_request.is_empty()
    }

    /// The earliest deadline of the waiting lookups.
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.next_deadline
    }

    /// Asks the core about the lookup's keys (the probes leave at once, one `lookup` per
    /// request and peer), then ends it at once (`done`) if the core can answer every key
    /// already, else keeps it until it can.
    pub(crate) fn add<P: Parent>(
        &mut self,
        io: &mut NodeIo<P>,
        now: Instant,
        waiting: Waiting<T>,
        done: impl FnOnce(Waiting<T>, Ended),
    ) {
        for key in &waiting.keys {
            io.core.lookup(now, &waiting.request, key);
        }
        io.core.flush_lookups(now);
        if let Some(results) = io.lookup_answers(now, &waiting.request, &waiting.keys) {
            done(waiting, Ended::Answered(results));
            return;
        }
        if let Some(d) = waiting.deadline {
            self.next_deadline = Some(self.next_deadline.map_or(d, |n| n.min(d)));
        }
        self.by_request
            .entry(waiting.request.id().clone())
            .or_default()
            .push(waiting);
    }

    /// Ends the lookups the core has news for (`answered` requests, requests whose source's
    /// session `ended`) that it can answer now, and those whose deadline passed.
    pub(crate) fn progress<P: Parent>(
        &mut self,
        io: &mut NodeIo<P>,
        now: Instant,
        answered: &HashSet<KvRequestId>,
        ended: &HashSet<PeerId>,
        mut done: impl FnMut(Waiting<T>, Ended),
    ) {
        if self.by_request.is_empty() {
            // Nothing waits: no deadline either. A deadline kept past the last answered or
            // removed lookup would stay in the past once reached and make every wait of the
            // driver's loop return at once (a core spun at 50,000 wakes a second from the
            // lookup timeout on, issue 36).
            self.next_deadline = None;
            return;
        }
        let mut touched: Vec<KvRequestId> = answered
            .iter()
            .filter(|id| self.by_request.contains_key(*id))
            .cloned()
            .collect();
        if !ended.is_empty() {
            // A session's end is rare: a scan of the waiting requests is fine then.
            touched.extend(
                self.by_request
                    .iter()
                    .filter(|(id, waits)| {
                        !answered.contains(*id)
                            && waits.first().is_some_and(|w| {
                                w.request
                                    .roles()
                                    .source
                                    .as_ref()
                                    .is_some_and(|s| ended.contains(&s.peer))
                            })
                    })
                    .map(|(id, _)| id.clone()),
            );
        }
        for id in touched {
            let Some(waits) = self.by_request.remove(&id) else {
                continue;
            };
            let mut kept = Vec::new();
            for w in waits {
                match io.lookup_answers(now, &w.request, &w.keys) {
                    Some(results) => done(w, Ended::Answered(results)),
                    None => kept.push(w),
                }
            }
            if !kept.is_empty() {
                self.by_request.insert(id, kept);
            }
        }
        if self.next_deadline.is_some_and(|d| now >= d) {
            self.expire(now, &mut done);
        }
    }

    /// Asks again for request `id`'s lookups at once (the driver just started a load of it:
    /// the fetch closes the round and its unanswered probes are asked again in the next one).
    pub(crate) fn recheck<P: Parent>(
        &mut self,
        io: &mut NodeIo<P>,
        now: Instant,
        id: &KvRequestId,
        done: impl FnMut(Waiting<T>, Ended),
    ) {
        if self.by_request.contains_key(id) {
            self.progress(io, now, &HashSet::from([id.clone()]), &HashSet::new(), done);
        }
    }

    /// Ends every lookup past its deadline and finds the next deadline.
    fn expire(&mut self, now: Instant, done: &mut impl FnMut(Waiting<T>, Ended)) {
        let mut next: Option<Instant> = None;
        self.by_request.retain(|_, waits| {
            let mut kept = Vec::with_capacity(waits.len());
            for w in waits.drain(..) {
                match w.deadline {
                    Some(d) if now >= d => done(w, Ended::Expired),
                    Some(d) => {
                        next = Some(next.map_or(d, |n| n.min(d)));
                        kept.push(w);
                    }
                    None => kept.push(w),
                }
            }
            *waits = kept;
            !waits.is_empty()
        });
        self.next_deadline = next;
    }

    /// Takes the lookups of request `id` (its caller is gone, or the request ended).
    pub(crate) fn remove_request(&mut self, id: &KvRequestId) -> Vec<Waiting<T>> {
        let removed = self.by_request.remove(id).unwrap_or_default();
        if self.by_request.is_empty() {
            self.next_deadline = None;
        }
        removed
    }

    /// Takes every waiting lookup.
    pub(crate) fn drain(&mut self) -> Vec<Waiting<T>> {
        self.next_deadline = None;
        self.by_request.drain().flat_map(|(_, w)| w).collect()
    }
}
