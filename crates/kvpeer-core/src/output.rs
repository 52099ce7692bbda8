//! What the core asks of its caller: messages to send and events to act on, drained with
//! [`Core::poll_transmit`](crate::Core::poll_transmit) and
//! [`Core::poll_event`](crate::Core::poll_event).

use std::collections::VecDeque;
use std::time::Instant;

use kvpeer_proto::{KvRequestId, Message, PeerId, RoundSeq};

use crate::core::fencing::Fencing;
use crate::error::{Refusal, SessionEnd};
use crate::traits::{DataPlane, JobId};

/// One message for one peer's control connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Transmit {
    /// The peer.
    pub peer: PeerId,
    /// The message.
    pub message: Message,
}

/// Something the caller must act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A load job ended: the fetched blocks landed (`success`), or the load failed and its
    /// destination blocks must be freed.
    LoadDone {
        /// The job given to [`Core::submit_load`](crate::Core::submit_load).
        job: JobId,
        /// Its request.
        kv_request_id: KvRequestId,
        /// Whether every block landed.
        success: bool,
    },
    /// A load failed, but its producer may still write its blocks (it did not confirm its
    /// writes ended, and the plane cannot fence them yet): the failure is known now, and the
    /// request's lookups answer MISS; the blocks stay reserved until the load's
    /// [`Event::LoadDone`] (a failure) hands them back, once no write can land in them
    /// (vLLM 0.34's deferred release).
    LoadHeld {
        /// The job given to [`Core::submit_load`](crate::Core::submit_load).
        job: JobId,
        /// Its request.
        kv_request_id: KvRequestId,
    },
    /// A store job ended; the core has already completed it at the [`Parent`](crate::Parent).
    StoreDone {
        /// The job.
        job: JobId,
        /// Whether its blocks reached the peer.
        success: bool,
    },
    /// The producer answered probes of this request: [`Core::lookup`](crate::Core::lookup)
    /// gives new answers for some of its keys. With `LoadDone` (a failed load answers the
    /// request's lookups MISS) and `Close` (the source's session ended: MISS), the only ways a
    /// RETRY becomes an answer, so a caller waiting on lookups asks again only then.
    LookupAnswered {
        /// The request.
        kv_request_id: KvRequestId,
    },
    /// Open a control connection to this peer (a session toward it was created).
    Dial(PeerId),
    /// Close the control connection to this peer: its session ended.
    Close {
        /// The peer.
        peer: PeerId,
        /// Why the session ended, and what that costs the peer.
        end: SessionEnd,
    },
    /// An inbound connection was refused before any session existed; close it.
    Refused {
        /// The peer.
        peer: PeerId,
        /// Why.
        reason: Refusal,
    },
}

/// The queues behind `poll_transmit` and `poll_event`.
#[derive(Debug, Default)]
pub(crate) struct Outbox {
    pub(crate) transmits: VecDeque<Transmit>,
    pub(crate) events: VecDeque<Event>,
    /// Requests whose load failed since the tier last looked: their lookups answer MISS.
    pub(crate) failed_loads: Vec<KvRequestId>,
    /// Running totals for metrics.
    pub(crate) counters: crate::counters::Counters,
    /// Warnings a peer can cause, at most one per kind per second.
    pub(crate) throttle: crate::throttle::WarnThrottle,
    /// What all peers hold together (every session's [`HeldAccount`] adds to it).
    ///
    /// [`HeldAccount`]: crate::session::server::HeldAccount
    pub(crate) node_held: std::sync::Arc<crate::session::server::NodeHeld>,
    /// Failed loads whose blocks a peer may still write (reported once fenced).
    pub(crate) fences: crate::core::fencing::Fences,
}

impl Outbox {
    pub(crate) fn transmit(&mut self, peer: &PeerId, message: Message) {
        self.counters.on_sent(&message);
        self.transmits.push_back(Transmit {
            peer: peer.clone(),
            message,
        });
    }

    pub(crate) fn event(&mut self, event: Event) {
        self.events.push_back(event);
    }

    /// Ends a load that failed: reported now if no write of its producer can land in its
    /// blocks any more, else held until the plane fences them ([`Outbox::settle_fences`]).
    pub(crate) fn fail_load(&mut self, plane: &mut dyn DataPlane, now: Instant, f: Fencing) {
        if plane.writes_fenced(&f.peer, &f.blocks, f.end()) {
            self.load_done(f.job, f.kv_request_id, false, f.live);
        } else {
            self.counters.loads_fencing += 1;
            // Counted as failed now, when the failure is reported (vLLM 0.34's tier hands it
            // on at once), not again when the blocks go back.
            self.counters.loads_failed += 1;
            // A peer can cause it at will (a write it keeps in progress): throttled (G8).
            crate::warn_throttled!(self.throttle, now,
                "a failed load's blocks may still be written by the peer; held until fenced",
                peer = %f.peer, kv_request_id = %f.kv_request_id, blocks = f.blocks.len(),
                confirmed = f.confirmed);
            // The failure is reported now; only the blocks wait. Its lookups answer MISS from
            // now on, so the settled `LoadDone` must not fail the id again.
            if f.live {
                self.failed_loads.push(f.kv_request_id.clone());
            }
            self.events.push_back(Event::LoadHeld {
                job: f.job,
                kv_request_id: f.kv_request_id.clone(),
            });
            self.fences.hold(f, now);
        }
    }

    /// Reports the held loads whose blocks are fenced now.
    pub(crate) fn settle_fences(&mut self, plane: &mut dyn DataPlane, now: Instant) {
        for f in self.fences.take_fenced(plane, now) {
            crate::info_throttled!(self.throttle, now,
                "a failed load's blocks are fenced; handing them back",
                peer = %f.peer, kv_request_id = %f.kv_request_id, blocks = f.blocks.len(),
                waited_ms = now.saturating_duration_since(f.since).as_millis() as u64);
            // Its failure was reported and counted when it was held.
            self.events.push_back(Event::LoadDone {
                job: f.job,
                kv_request_id: f.kv_request_id,
                success: false,
            });
        }
    }

    /// Reports a load's end (exactly once per load job). A failure of a request the engine
    /// still runs also makes its lookups answer MISS (`fail_request`); one of a finished
    /// request must not, or its id would stay in the failed set for ever.
    pub(crate) fn load_done(
        &mut self,
        job: JobId,
        kv_request_id: KvRequestId,
        success: bool,
        live: bool,
    ) {
        if !success && live {
            self.failed_loads.push(kv_request_id.clone());
        }
        if success {
            self.counters.loads_ok += 1;
        } else {
            self.counters.loads_failed += 1;
        }
        self.events.push_back(Event::LoadDone {
            job,
            kv_request_id,
            success,
        });
    }
}

/// One session's way out: gating (nothing but `connect`/`connect_ack` before the peer's ack),
/// and closing (nothing at all after `disconnect`).
#[derive(Debug)]
pub(crate) struct Link {
    pub(crate) peer: PeerId,
    gate: Gate,
    /// The fetches (request, round) still queued when the link closed: never sent, so no
    /// write of theirs can come ([`Link::fetch_never_sent`]).
    unsent_at_close: Vec<(KvRequestId, RoundSeq)>,
    /// Last time a message went out or came in.
    pub(crate) last_activity: Instant,
}

/// Where a link's gate stands; it only moves forward.
#[derive(Debug)]
enum Gate {
    /// The peer has not acked our `connect`: messages wait, in order.
    Waiting(Vec<Message>),
    /// The peer acked our `connect` (it has registered our memory): messages flow.
    Open,
    /// The session is over: nothing more is sent.
    Closed {
        /// Whether the peer had acked our `connect` (a session that never was is a failed
        /// dial).
        was_open: bool,
    },
}

impl Link {
    pub(crate) fn new(peer: PeerId, now: Instant) -> Self {
        Link {
            peer,
            gate: Gate::Waiting(Vec::new()),
            unsent_at_close: Vec::new(),
            last_activity: now,
        }
    }

    /// The peer acked our `connect` and the session is not over: messages flow.
    pub(crate) fn is_ready(&self) -> bool {
        matches!(self.gate, Gate::Open)
    }

    /// Whether the peer ever acked our `connect`, closed or not.
    pub(crate) fn was_ready(&self) -> bool {
        matches!(self.gate, Gate::Open | Gate::Closed { was_open: true })
    }

    /// Nothing more is sent; queued messages are dropped.
    pub(crate) fn close(&mut self) {
        let was_open = self.was_ready();
        if let Gate::Waiting(queued) = std::mem::replace(&mut self.gate, Gate::Closed { was_open })
        {
            self.unsent_at_close = queued
                .into_iter()
                .filter_map(|m| match m {
                    Message::Fetch(f) if !f.block_indexes.is_empty() => {
                        Some((f.kv_request_id, f.round_seq))
                    }
                    _ => None,
                })
                .collect();
        }
    }

    /// Whether the fetch of round `round` of `id` never left: still queued for the peer's
    /// ack, or queued when the link closed before it came. (A fetch handed on may have been
    /// written to the socket, whatever became of the connection.)
    pub(crate) fn fetch_never_sent(&self, id: &KvRequestId, round: RoundSeq) -> bool {
        let is_it = |(i, r): &(KvRequestId, RoundSeq)| i == id && *r == round;
        match &self.gate {
            Gate::Waiting(queued) => queued.iter().any(|m| is_fetch_of(m, id, round)),
            Gate::Open => false,
            Gate::Closed { .. } => self.unsent_at_close.iter().any(is_it),
        }
    }

    /// Sends now if the peer is ready, else queues until its ack.
    pub(crate) fn send(&mut self, out: &mut Outbox, now: Instant, message: Message) {
        match &mut self.gate {
            Gate::Closed { .. } => {}
            Gate::Waiting(queued) => queued.push(message),
            Gate::Open => self.send_now(out, now, message),
        }
    }

    /// Sends without gating (`connect`, `connect_ack`, `disconnect`).
    pub(crate) fn send_now(&mut self, out: &mut Outbox, now: Instant, message: Message) {
        if matches!(self.gate, Gate::Closed { .. }) {
            return;
        }
        out.transmit(&self.peer, message);
        self.last_activity = now;
    }

    /// The peer's ack arrived: flush the queue in order.
    pub(crate) fn set_ready(&mut self, out: &mut Outbox, now: Instant) {
        let queued = match std::mem::replace(&mut self.gate, Gate::Open) {
            Gate::Waiting(queued) => queued,
            // A repeated ack changes nothing; a closed link stays closed.
            other => {
                self.gate = other;
                return;
            }
        };
        for message in queued {
            self.send_now(out, now, message);
        }
    }

    /// Takes back the queued `fetch` of round `round` of `id` (with blocks), still waiting
    /// for the peer's ack; whether it was there. Once taken, the peer never learns of it.
    pub(crate) fn retract_queued_fetch(&mut self, id: &KvRequestId, round: RoundSeq) -> bool {
        self.retract(|m| is_fetch_of(m, id, round))
    }

    /// Takes back a queued terminal (empty) `fetch` of `id`, still waiting for the peer's ack:
    /// a newer round of the id is about to be queued, and the terminal would close it on the
    /// peer (vLLM 0.34 checks the same when it sends one). Whether one was there.
    pub(crate) fn retract_queued_terminal(&mut self, id: &KvRequestId) -> bool {
        self.retract(|m| {
            matches!(m, Message::Fetch(f)
                if f.kv_request_id == *id && f.block_indexes.is_empty() && f.keys.is_empty())
        })
    }

    fn retract(&mut self, matches: impl Fn(&Message) -> bool) -> bool {
        let Gate::Waiting(queued) = &mut self.gate else {
            return false;
        };
        match queued.iter().position(matches) {
            Some(at) => {
                queued.remove(at);
                true
            }
            None => false,
        }
    }

    pub(crate) fn queued_len(&self) -> usize {
        match &self.gate {
            Gate::Waiting(queued) => queued.len(),
            Gate::Open | Gate::Closed { .. } => 0,
        }
    }
}

/// Whether `m` is the fetch (with blocks) of round `round` of `id`.
fn is_fetch_of(m: &Message, id: &KvRequestId, round: RoundSeq) -> bool {
    matches!(m, Message::Fetch(f)
        if f.kv_request_id == *id && f.round_seq == round && !f.block_indexes.is_empty())
}
