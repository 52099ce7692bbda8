//! The tier: all sessions of one node, the roles of its requests, and what outlives a single
//! session (failed request ids, a PD producer's parked stores, reconnect backoff, limits).
//!
//! Sans-IO: every entry point takes `now` and returns at once. The caller feeds inputs
//! (decoded payloads, connection events, data-plane progress, engine calls, timeouts) and
//! drains outputs in this order: [`Core::poll_transmit`] until empty, then [`Core::poll_event`]
//! until empty, then sleeps until [`Core::poll_timeout`] or the next input. When inputs and a
//! deadline are both due, feed the inputs first: a reply already received must win over the
//! timeout it answers.
//!
//! This file holds the [`Core`] and its API (inputs, outputs, engine calls, shutdown) and the
//! reaping of sessions; `admission` decides which sessions may exist (refusals, backoffs, idle
//! eviction), `parking` holds a PD producer's stores until the peer's fetch, and `request` the
//! engine's handle of a request.

mod admission;
pub(crate) mod fencing;
pub(crate) mod index;
mod parking;
mod request;
mod retained;
mod slices;

pub use fencing::FENCE_RECHECK;
pub use request::{OffloadPolicy, Request, RequestRoles, Source};

use admission::Backoff;
use index::SessionIndex;
use parking::Batch;

use crate::maps::{Map, Set};
use std::time::Instant;

use kvpeer_proto::{
    decode_with_limits, DecodeError, DecodeLimits, KvRequestId, Message, OffloadKey, PeerId,
};
use tracing::{debug, warn};

use crate::config::{CoreConfig, LocalNode};
use crate::error::{CloseReason, LinkLoss, LocalRefusal, ProtocolViolation, Refusal};
use crate::output::{Event, Outbox, Transmit};
use crate::session::client::Load;
use crate::session::{Announce, Cx, Session};
use crate::timer::{earliest, Lane};
use crate::traits::{BlockIndex, CancelMode, DataPlane, JobId, LookupResult, Parent, TransferId};

/// Counts of open state, for metrics and for tests' leak checks.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CoreStats {
    /// Live sessions.
    pub sessions: usize,
    /// Consumer-side request state across sessions.
    pub client_requests: usize,
    /// Producer-side request state across sessions.
    pub server_requests: usize,
    /// Store jobs (pins) held by sessions.
    pub store_jobs: usize,
    /// Data-plane transfers in flight.
    pub inflight: usize,
    /// Messages waiting for a peer's ack.
    pub queued: usize,
    /// Store batches parked for a fetch that has not come.
    pub unbound_batches: usize,
    /// Request ids whose lookups answer MISS.
    pub failed_ids: usize,
    /// Request ids bound to the session that fetched them (PD routing of later stores).
    pub bound_ids: usize,
    /// Failed loads whose blocks wait for the plane to fence their producer's writes.
    pub fencing_loads: usize,
    /// Their blocks (reserved, neither readable nor reusable until fenced).
    pub fencing_blocks: usize,
}

/// The protocol core of one node. How to drive it: the documentation at the top of its source file, `core/mod.rs`.
#[derive(Debug)]
pub struct Core<P: Parent, D: DataPlane> {
    config: CoreConfig,
    local: LocalNode,
    limits: DecodeLimits,
    parent: P,
    plane: D,
    out: Outbox,
    now: Instant,
    sessions: Map<PeerId, Session>,
    /// Requests whose lookups answer MISS (their peer failed them).
    failed: Set<KvRequestId>,
    /// PD producer ids bound to the session whose peer fetched them.
    bound: Map<KvRequestId, PeerId>,
    unbound: Map<KvRequestId, Vec<Batch>>,
    unbound_lane: Lane<KvRequestId>,
    /// When each binding of `bound` is next checked: a binding whose request the engine never
    /// finishes here (a symmetric consumer's fetch: no local request has that id) is dropped
    /// once the session holds no state for it, instead of living as long as the session.
    bound_lane: Lane<KvRequestId>,
    reaped: Map<KvRequestId, Instant>,
    reaped_lane: Lane<KvRequestId>,
    backoff: Map<PeerId, Backoff>,
    faults: Map<PeerId, u32>,
    /// Peers whose dials failed lately, and when they may be dialed again.
    dial_backoff: Map<PeerId, Backoff>,
    /// What each session needs next, so an input reaches only the sessions it concerns.
    index: SessionIndex,
    /// When idle sessions are next looked for (while idle eviction is on).
    idle_check_at: Option<Instant>,
    /// The peer whose `disconnect` was the last message handled: its session is dead, but
    /// the `transfer_done`s and `abort_ack`s it sent right after still settle its loads (vLLM
    /// 0.34 settles a terminal buffered behind a goodbye). Any other input ends that, and the
    /// session is reaped ([`Core::end_settling`]).
    settling: Option<PeerId>,
    /// Writes of ended sessions still running, their source pins held (`core/retained.rs`).
    retained: retained::Retained,
    /// The node is shutting down: ended sessions' writes are abandoned, not retained.
    shutting_down: bool,
}

impl<P: Parent, D: DataPlane> Core<P, D> {
    /// A core with no sessions. `now` is the starting time; later calls must not go back.
    pub fn new(config: CoreConfig, local: LocalNode, parent: P, plane: D, now: Instant) -> Self {
        let unbound_lane = Lane::new(config.unbound_store_timeout);
        let bound_lane = Lane::new(config.unbound_store_timeout);
        let reaped_lane = Lane::new(config.reaped_id_retention);
        Core {
            config,
            local,
            limits: DecodeLimits::default(),
            parent,
            plane,
            out: Outbox::default(),
            now,
            sessions: Map::default(),
            failed: Set::default(),
            bound: Map::default(),
            unbound: Map::default(),
            unbound_lane,
            bound_lane,
            reaped: Map::default(),
            reaped_lane,
            backoff: Map::default(),
            faults: Map::default(),
            dial_backoff: Map::default(),
            index: SessionIndex::default(),
            idle_check_at: None,
            settling: None,
            retained: retained::Retained::default(),
            shutting_down: false,
        }
    }

    /// Replaces the decoding limits applied by [`Core::handle_payload`].
    pub fn set_decode_limits(&mut self, limits: DecodeLimits) {
        self.limits = limits;
    }

    /// The configuration in force.
    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// This node's identity and layout.
    pub fn local(&self) -> &LocalNode {
        &self.local
    }

    /// Changes the prefix-cache hash seed this node advertises and checks, for sessions that
    /// begin from now on (an engine learns its seed only after the node is built: vLLM draws
    /// it when it initialises its hashing). Sessions already open keep the seed they agreed.
    pub fn set_hash_seed(&mut self, seed: String) {
        self.local.hash_seed = seed;
    }

    /// The local store.
    pub fn parent(&self) -> &P {
        &self.parent
    }

    /// The local store, mutably (the engine stores and allocates blocks through it).
    pub fn parent_mut(&mut self) -> &mut P {
        &mut self.parent
    }

    /// The data plane.
    pub fn plane(&self) -> &D {
        &self.plane
    }

    /// The data plane, mutably.
    pub fn plane_mut(&mut self) -> &mut D {
        &mut self.plane
    }

    /// Every entry point starts here: the clock moves on, and a goodbye's terminals are
    /// over (only the peer's next messages may still settle its loads).
    fn advance(&mut self, now: Instant) {
        self.tick(now);
        self.end_settling();
    }

    /// The clock moves on (and nothing else).
    fn tick(&mut self, now: Instant) {
        if now > self.now {
            self.now = now;
        }
        self.out.throttle.tick(self.now);
    }

    /// Ends the settling of the session whose peer said goodbye: its loads still open fail and
    /// the session is reaped.
    fn end_settling(&mut self) {
        let Some(peer) = self.settling.take() else {
            return;
        };
        if let Some(session) = self.sessions.get_mut(&peer) {
            session.stop_hearing_terminals();
        }
        self.settle();
    }

    /// Runs `f` on one session with everything it may touch, then reads what changed off it.
    fn with_session<R>(
        &mut self,
        peer: &PeerId,
        f: impl FnOnce(&mut Session, &mut Cx<'_>, &LocalNode) -> R,
    ) -> Option<R> {
        let result = {
            let (sessions, mut cx, local) = self.split();
            let session = sessions.get_mut(peer)?;
            f(session, &mut cx, local)
        };
        self.refresh(peer);
        Some(result)
    }

    /// Runs `f` on each of `peers`' sessions (those that exist), as [`Core::with_session`].
    fn with_sessions(
        &mut self,
        peers: impl IntoIterator<Item = PeerId>,
        mut f: impl FnMut(&mut Session, &mut Cx<'_>),
    ) {
        for peer in peers {
            self.with_session(&peer, |s, cx, _| f(s, cx));
        }
    }

    /// Reads what changed off `peer`'s session (after a direct touch).
    fn refresh(&mut self, peer: &PeerId) {
        if let Some(session) = self.sessions.get(peer) {
            self.index.refresh(peer, session, self.now);
        }
    }

    /// Lends the sessions, what a session may touch, and this node's identity, at once.
    fn split(&mut self) -> (&mut Map<PeerId, Session>, Cx<'_>, &LocalNode) {
        let cx = Cx {
            now: self.now,
            config: &self.config,
            parent: &mut self.parent,
            plane: &mut self.plane,
            out: &mut self.out,
        };
        (&mut self.sessions, cx, &self.local)
    }

    // ---------------------------------------------------------------- outputs

    /// The next message to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.transmits.pop_front()
    }

    /// Whether messages wait to be sent ([`Core::poll_transmit`]).
    pub fn has_transmits(&self) -> bool {
        !self.out.transmits.is_empty()
    }

    /// Whether a transmit or an event waits to be taken ([`Core::poll_transmit`],
    /// [`Core::poll_event`]).
    pub fn has_output(&self) -> bool {
        !self.out.transmits.is_empty() || !self.out.events.is_empty()
    }

    /// The next event to act on, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.out.events.pop_front()
    }

    /// When [`Core::handle_timeout`] must next be called, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.settling.is_some() {
            // A goodbye's session is reaped at the next input or deadline, whichever first.
            return Some(self.now);
        }
        earliest([
            self.index.next_deadline(),
            self.index.slices.next_deadline(self.now),
            self.unbound_lane.next_deadline(),
            self.bound_lane.next_deadline(),
            self.reaped_lane.next_deadline(),
            self.idle_check_at.filter(|_| self.idle_eviction_active()),
            self.out.fences.next_deadline(),
            self.retained.next_deadline(self.config.retained_hold_cap),
        ])
    }

    /// Running totals since the core started (for metrics).
    pub fn counters(&self) -> &crate::counters::Counters {
        &self.out.counters
    }

    /// Counts of open state.
    pub fn stats(&self) -> CoreStats {
        let mut stats = CoreStats {
            sessions: self.sessions.len(),
            unbound_batches: self.unbound.values().map(Vec::len).sum(),
            bound_ids: self.bound.len(),
            failed_ids: self.failed.len(),
            fencing_loads: self.out.fences.len(),
            fencing_blocks: self.out.fences.held_blocks(),
            ..CoreStats::default()
        };
        for session in self.sessions.values() {
            let (client, server, jobs, inflight, queued) = session.counts();
            stats.client_requests += client;
            stats.server_requests += server;
            stats.store_jobs += jobs;
            stats.inflight += inflight;
            stats.queued += queued;
        }
        stats
    }

    /// What this node's producer side holds for `peer` against its fair share (docs/security.md,
    /// G7), or `None` without a session.
    pub fn peer_share(&self, peer: &PeerId) -> Option<PeerShare> {
        self.sessions.get(peer).map(|s| {
            let (held_keys, held_bytes, pinned_blocks) = s.shares();
            let (_, requests, pins, _, _) = s.counts();
            PeerShare {
                held_keys,
                held_bytes,
                pinned_blocks,
                requests,
                pins,
            }
        })
    }

    /// Whether any write to a peer is running on the data plane (a walk over every session:
    /// for a caller about to stop, not for every step).
    pub fn has_inflight(&self) -> bool {
        !self.retained.is_empty() || self.sessions.values().any(|s| s.counts().3 > 0)
    }

    /// Whether a session with `peer` exists, and whether the peer has acked our `connect`.
    pub fn session_state(&self, peer: &PeerId) -> Option<SessionState> {
        self.sessions.get(peer).map(|s| SessionState {
            ready: s.link.is_ready(),
            pending_work: s.has_pending_work(),
            connected: s.takes_no_connect(),
        })
    }

    // ---------------------------------------------------------------- control channel

    /// A control connection from a peer without a session. Returns whether it was accepted;
    /// a refusal comes with an [`Event::Refused`] (and a `disconnect` during backoff, so the
    /// peer fails at once).
    pub fn handle_inbound(&mut self, now: Instant, peer: PeerId) -> bool {
        self.advance(now);
        self.accept_inbound(peer, Announce::Now)
    }

    fn accept_inbound(&mut self, peer: PeerId, announce: Announce) -> bool {
        if let Some(reason) = self.refusal(&peer) {
            crate::warn_throttled!(self.out.throttle, self.now, "refusing inbound peer", %peer, %reason);
            self.out.event(Event::Refused { peer, reason });
            return false;
        }
        crate::info_throttled!(self.out.throttle, self.now, "accepting inbound peer", %peer);
        self.open_session(peer, announce);
        true
    }

    /// One payload from `peer`'s control connection: decoded, classified, dispatched. From a
    /// peer without a session only a `connect` is accepted (it opens an inbound session);
    /// anything else is a leftover of an ended session and is dropped.
    pub fn handle_payload(&mut self, now: Instant, peer: &PeerId, payload: &[u8]) {
        self.tick(now);
        match decode_with_limits(payload, &self.limits) {
            Ok(message) => self.handle_message(now, peer, message),
            Err(e) => self.handle_undecodable(now, peer, e),
        }
    }

    /// A payload from `peer` that did not decode (the caller decoded it, e.g. a slice at a
    /// time), with the error: what [`Core::handle_payload`] does with it.
    pub fn handle_undecodable(&mut self, now: Instant, peer: &PeerId, error: DecodeError) {
        // Even from the peer that said goodbye: a fault after it rejects what follows.
        self.advance(now);
        match error {
            e if !self.sessions.contains_key(peer) => {
                // Not a `connect`, so it opens no session: the channel closes the connection.
                crate::warn_throttled!(self.out.throttle, self.now, "refusing a bad first payload from a peer without a session", %peer, error = %e);
                self.out.event(Event::Refused {
                    peer: peer.clone(),
                    reason: Refusal::BadFirstPayload(e),
                });
            }
            DecodeError::Protocol(e) => {
                self.with_session(peer, |s, cx, _| {
                    s.on_invalid_message(cx, ProtocolViolation::Malformed(e))
                });
                self.settle();
            }
            DecodeError::Ignored(e) => {
                crate::warn_throttled!(self.out.throttle, self.now, "ignoring a payload that is no known message", %peer, error = %e)
            }
            e => {
                crate::warn_throttled!(self.out.throttle, self.now, "dropping an undecodable payload", %peer, error = %e)
            }
        }
    }

    /// One decoded message from `peer` (the same rule for unknown peers as
    /// [`Core::handle_payload`]).
    pub fn handle_message(&mut self, now: Instant, peer: &PeerId, message: Message) {
        self.tick(now);
        let terminal = matches!(message, Message::TransferDone(_) | Message::AbortAck(_));
        let terminal_fetch = matches!(&message, Message::Fetch(f) if f.keys.is_empty());
        if !(terminal && self.settling.as_ref() == Some(peer)) {
            self.end_settling();
        }
        self.out.counters.on_received(&message);
        if !self.sessions.contains_key(peer) && !self.accept_first_message(peer, &message) {
            return;
        }
        let fetched = self
            .with_session(peer, |s, cx, local| s.on_message(cx, local, message))
            .flatten();
        if let Some(id) = fetched {
            self.bind_fetch(peer, id, terminal_fetch);
        }
        // Settling (still, or from this goodbye on) while the session hears terminals; any
        // other peer's settling was ended above.
        self.settling = self
            .sessions
            .get(peer)
            .filter(|s| s.hears_terminals())
            .map(|_| peer.clone());
        self.settle();
    }

    /// A message from a peer without a session. A live peer always opens with `connect` (its
    /// outbound socket keeps order), so anything else is a leftover of an ended session: a
    /// late ack, a duplicate `disconnect`. Opening a session for it would answer with a
    /// `connect` that collides with the peer's own next session, and the two sides can then
    /// kill each other's sessions forever (seen in the lossy-network test). Only `connect`
    /// opens a session.
    fn accept_first_message(&mut self, peer: &PeerId, message: &Message) -> bool {
        if matches!(message, Message::Connect(_)) {
            // Our `connect` waits for the checks of theirs (dispatched next).
            return self.accept_inbound(peer.clone(), Announce::AfterPeersConnect);
        }
        debug!(%peer, message = %message.message_type(), "dropping a message from a peer without a session");
        self.out.event(Event::Refused {
            peer: peer.clone(),
            reason: Refusal::NotAConnect(message.message_type()),
        });
        false
    }

    /// The control connection to `peer` is gone, for `cause` (socket closed, heartbeat lost,
    /// send failed, ...).
    pub fn handle_connection_lost(&mut self, now: Instant, peer: &PeerId, cause: LinkLoss) {
        self.close_session(now, peer, CloseReason::ConnectionLost(cause));
    }

    /// The node will not talk to `peer` (e.g. it is outside the allowlist): its session ends
    /// with `reason`, and its requests fall back at once.
    pub fn handle_connection_refused(&mut self, now: Instant, peer: &PeerId, reason: LocalRefusal) {
        self.close_session(now, peer, CloseReason::Refused(reason));
    }

    /// Ends `peer`'s session (if any) for `reason`, without a message.
    fn close_session(&mut self, now: Instant, peer: &PeerId, reason: CloseReason) {
        self.advance(now);
        if let Some(session) = self.sessions.get_mut(peer) {
            session.mark_dead(reason);
        }
        self.refresh(peer);
        self.settle();
    }

    // ---------------------------------------------------------------- data plane

    /// The data plane may have progressed (a registration, a completion, a fault).
    pub fn handle_data_plane(&mut self, now: Instant) {
        self.advance(now);
        // The sessions the plane has news for, and those whose news it may not announce (a
        // registration settling, a fault draining); every session if the plane cannot tell.
        let mut peers = Vec::new();
        if self.plane.take_news(&mut peers) {
            peers.extend(self.index.plane_watch.iter().cloned());
            peers.sort_unstable();
            peers.dedup();
        } else {
            peers = self.sessions.keys().cloned().collect();
        }
        self.with_sessions(peers, |s, cx| s.on_data_plane(cx));
        self.poll_retained();
        self.settle();
    }

    /// Releases the retained writes that stopped or reached the hold cap, and completes
    /// (fails) the store jobs none of them reads any more (`core/retained.rs`).
    fn poll_retained(&mut self) {
        if self.retained.is_empty() {
            return;
        }
        let released = self.retained.poll(
            &mut self.plane,
            self.now,
            self.config.retained_hold_cap,
            self.shutting_down,
        );
        if released.forced > 0 && !self.shutting_down {
            self.out.counters.retained_force_released += released.forced;
            warn!(
                writes = released.forced,
                cap_s = self.config.retained_hold_cap.as_secs_f64(),
                "writes of ended sessions still running at the hold cap: their source blocks are released anyway"
            );
        }
        for job in released.jobs {
            self.complete_store(job, false);
        }
    }

    // ---------------------------------------------------------------- timers

    /// Fires every deadline at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.advance(now);
        let due = self.index.due(self.now);
        self.with_sessions(due, |s, cx| s.handle_timeout(cx));
        self.serve_slices();
        self.reap_unbound();
        self.release_idle_bindings();
        self.expire_reaped();
        self.evict_idle();
        self.poll_retained();
        self.settle();
    }

    /// One step of queued lookups (`core/slices.rs`): slices of the sessions due, hosts in
    /// turn, until `lookup_slice_keys` keys were asked (the last slice may go past that by less
    /// than one slice); what the due sessions leave of the step goes to sessions past their
    /// keys-per-second budget (work-conserving). A session is served at most once per step (it
    /// goes back in its host's turn only at the step's end), so a step always ends.
    fn serve_slices(&mut self) {
        let budget = self.config.lookup_slice_keys.max(1);
        let mut asked = 0;
        let mut served = Vec::new();
        while asked < budget {
            let (peer, spare) = match self.index.slices.next(self.now) {
                Some(peer) => (peer, false),
                None => match self.index.slices.next_spare(self.now) {
                    Some(peer) => (peer, true),
                    None => break,
                },
            };
            let keys = {
                let (sessions, mut cx, _) = self.split();
                sessions
                    .get_mut(&peer)
                    .map(|s| s.serve_slice(&mut cx, spare))
            };
            asked += keys.unwrap_or(0);
            served.push(peer);
        }
        for peer in served {
            self.refresh(&peer);
        }
    }

    // ---------------------------------------------------------------- engine

    /// A new request and its roles; keep the returned [`Request`] for every later call about
    /// it. A consumer opens (or reuses) a session to its producer; if that is not possible the
    /// request's lookups answer MISS.
    pub fn on_new_request(
        &mut self,
        now: Instant,
        id: KvRequestId,
        roles: RequestRoles,
    ) -> Request {
        self.advance(now);
        if let Some(source) = &roles.source {
            let peer = source.peer.clone();
            if !self.ensure_session(&peer) {
                self.failed.insert(id.clone());
            }
        }
        Request { id, roles }
    }

    /// Whether the request's producer holds `key`: `Hit`, `Miss`, or `Retry` (asked; look again
    /// after the next [`Core::flush_lookups`] has been answered).
    pub fn lookup(&mut self, now: Instant, req: &Request, key: &OffloadKey) -> LookupResult {
        self.advance(now);
        let id = &req.id;
        let Some(source) = &req.roles.source else {
            return LookupResult::Miss;
        };
        if self.failed.contains(id) {
            return LookupResult::Miss;
        }
        if !source.probe {
            return LookupResult::Hit;
        }
        let answer = match self.sessions.get_mut(&source.peer) {
            None => return LookupResult::Miss,
            Some(session) => session.register_lookup(id, key),
        };
        match answer {
            Some(true) => LookupResult::Hit,
            Some(false) => LookupResult::Miss,
            None => {
                // A probe waits for the next flush.
                let peer = source.peer.clone();
                self.refresh(&peer);
                LookupResult::Retry
            }
        }
    }

    /// Sends the probes registered since the last flush (one `lookup` per request and peer).
    /// vLLM does this once per scheduler step.
    pub fn flush_lookups(&mut self, now: Instant) {
        self.advance(now);
        let flushing: Vec<PeerId> = self.index.flushing.iter().cloned().collect();
        self.with_sessions(flushing, |s, cx| s.flush_lookups(cx.out, cx.now));
    }

    /// Asks the store again about inbound lookups waiting on pending keys (call when blocks
    /// being written become readable; a timer does it anyway every `lookup_repoll_interval`).
    pub fn serve(&mut self, now: Instant) {
        self.advance(now);
        let serving: Vec<PeerId> = self.index.serving.iter().cloned().collect();
        self.with_sessions(serving, |s, cx| s.serve(cx));
        self.settle();
    }

    /// Fetches `keys` into local `blocks` (one round); the result comes as
    /// [`Event::LoadDone`] for `job`.
    pub fn submit_load(
        &mut self,
        now: Instant,
        job: JobId,
        req: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) {
        self.advance(now);
        let id = &req.id;
        let Some(source) = &req.roles.source else {
            warn!(kv_request_id = %id, job = job.get(), "load for a request that has no producer");
            self.out.load_done(job, id.clone(), false, true);
            self.settle();
            return;
        };
        if keys.is_empty() {
            self.out.load_done(job, id.clone(), true, true);
            return;
        }
        let now = self.now;
        let host = index::host_of(&source.peer);
        let held = self.out.fences.held_blocks_of_host(&host);
        let share = self.config.pins_per_peer(self.local.num_blocks);
        if held >= share {
            // Its producers left its share of blocks that they may still write: a host that
            // stalls costs about its own share of the pool (plus the one load that took it
            // past), not everyone's (docs/security.md, G2').
            crate::warn_throttled!(self.out.throttle, now,
                "load refused: the producer's host holds its share of blocks it may still write",
                kv_request_id = %id, peer = %source.peer, held, share);
            self.out.load_done(job, id.clone(), false, true);
            self.settle();
            return;
        }
        match self.sessions.get_mut(&source.peer) {
            Some(session) if !session.is_dead() => {
                // From now on the producer may write into these blocks (and only these).
                self.plane.expect_writes(&source.peer, &blocks);
                session.request_blocks(&mut self.out, now, id, Load { job, keys, blocks });
                let peer = source.peer.clone();
                self.refresh(&peer);
            }
            _ => {
                warn!(kv_request_id = %id, job = job.get(), peer = %source.peer, "load with no session to the producer");
                self.out.load_done(job, id.clone(), false, true);
            }
        }
        self.settle();
    }

    /// Blocks the engine stored for a request (already pinned in the store as job `job`).
    /// For a PD producer they wait for the peer's fetch; otherwise the job completes at once.
    pub fn submit_store(
        &mut self,
        now: Instant,
        job: JobId,
        req: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) {
        self.advance(now);
        if !req.roles.decoder {
            self.complete_store(job, true);
            return;
        }
        self.park_store(job, &req.id, keys, blocks);
    }

    /// The request finished on this node: consumer loads are aborted and lookup state
    /// released at the producer; a PD producer's rounds end.
    pub fn finish(&mut self, now: Instant, req: &Request) {
        self.advance(now);
        let id = &req.id;
        self.failed.remove(id);
        let peer = match &req.roles.source {
            Some(source) => Some(source.peer.clone()),
            None => self.bound.remove(id),
        };
        if let Some(peer) = peer {
            self.with_session(&peer, |s, cx, _| s.finish_request(cx, id));
        }
        self.settle();
    }

    /// Fails every store job no write reads (vLLM's `drain_jobs` before a reset, as vLLM
    /// 0.34's own P2P tier does, `_drain_session_stores`), so the engine's wait is bounded by
    /// the writes in flight, not by `store_timeout`:
    /// * PD stores still parked for a fetch that has not come: each job ends failed now, and
    ///   its request is remembered as reaped, so a late fetch of it is refused in one round
    ///   trip and never served the chunks the reset frees;
    /// * stores (and lookup pins) a session's rounds hold that no write reads: they fail now;
    ///   a round left with nothing to write ends (`transfer_done(false)` to a peer that
    ///   fetched it; one not fetched yet is refused in one round trip when it is).
    ///
    /// Writes in flight are not cancelled: their jobs end with them. Returns the jobs failed
    /// (their `StoreDone` events follow).
    pub fn fail_unwritten_stores(&mut self, now: Instant) -> Vec<JobId> {
        self.advance(now);
        let mut failed = self.reap_all_unbound();
        let peers: Vec<PeerId> = self.sessions.keys().cloned().collect();
        for peer in peers {
            if let Some(jobs) = self.with_session(&peer, |s, cx, _| s.fail_unwritten_stores(cx)) {
                failed.extend(jobs);
            }
        }
        self.settle();
        failed
    }

    /// Aborts every load not aborting yet (vLLM's `drain_jobs` before a reset, as vLLM 0.34's
    /// own P2P tier does, `abort_loads`): each `abort_fetch` goes now, as at the load's
    /// timeout, so a producer that never writes holds the reset for one round trip, or for
    /// the abort-ack timeout when it does not answer either, not for the whole load timeout.
    /// Each load ends failed at its `abort_ack`, or with its session. Returns how many.
    pub fn abort_loads(&mut self, now: Instant) -> usize {
        self.advance(now);
        let peers: Vec<PeerId> = self.sessions.keys().cloned().collect();
        let mut aborted = 0;
        for peer in peers {
            aborted += self
                .with_session(&peer, |s, cx, _| s.abort_loads(cx))
                .unwrap_or(0);
        }
        self.settle();
        aborted
    }

    // ---------------------------------------------------------------- shutdown

    /// First step of a graceful shutdown: asks the data plane to stop inflight transfers
    /// without abandoning any that may still land. Returns `true` once none remain; call again
    /// (after data-plane progress) until then or until the caller's drain bound passes.
    pub fn shutdown_drain(&mut self, now: Instant) -> bool {
        self.advance(now);
        let ids: Vec<TransferId> = self
            .sessions
            .values()
            .flat_map(Session::inflight_ids)
            .collect();
        // Writes of ended sessions are waited for too (vLLM 0.34's `drain_jobs`).
        self.poll_retained();
        if ids.is_empty() {
            self.settle();
            return self.retained.is_empty();
        }
        let still = self.plane.cancel(&ids, CancelMode::Wait);
        let peers: Vec<PeerId> = self.sessions.keys().cloned().collect();
        self.with_sessions(peers, |s, cx| s.on_data_plane(cx));
        self.settle();
        still.is_empty()
            && self.retained.is_empty()
            && self.sessions.values().all(|s| s.inflight_ids().is_empty())
    }

    /// Ends everything: remaining transfers are abandoned, every session sends `disconnect`
    /// and closes, parked stores fail.
    pub fn shutdown(&mut self, now: Instant) {
        self.advance(now);
        self.shutting_down = true;
        let peers: Vec<PeerId> = self.sessions.keys().cloned().collect();
        for peer in peers {
            self.end_session(&peer);
        }
        // Writes retained before the shutdown are abandoned too.
        self.poll_retained();
        for (_, batches) in std::mem::take(&mut self.unbound) {
            for batch in batches {
                self.complete_store(batch.job, false);
            }
        }
        self.unbound_lane.clear();
        self.bound_lane.clear();
        self.reaped.clear();
        self.reaped_lane.clear();
        self.bound.clear();
    }

    // ---------------------------------------------------------------- internals

    fn complete_store(&mut self, job: JobId, success: bool) {
        self.parent.complete_store_job(job, success);
        self.out.event(Event::StoreDone { job, success });
    }

    /// Opens a session toward `peer` ahead of any request (the handshake then runs as usual);
    /// `false` if it cannot (reconnect backoff, session limit). A no-op if one exists.
    pub fn connect(&mut self, now: Instant, peer: &PeerId) -> bool {
        self.advance(now);
        let opened = self.ensure_session(peer);
        self.settle();
        opened
    }

    /// After every entry point: failed loads mark their ids, dead sessions are reaped.
    fn settle(&mut self) {
        if self.out.fences.due(self.now) {
            self.out.settle_fences(&mut self.plane, self.now);
        }
        self.drain_failed_loads();
        self.enforce_pin_cap();
        let dead: Vec<PeerId> = self
            .index
            .dead
            .iter()
            .filter(|peer| self.settling.as_ref() != Some(*peer))
            .cloned()
            .collect();
        for peer in dead {
            self.end_session(&peer);
        }
    }

    /// While all peers' lookup pins together exceed `max_pinned_blocks`, releases the heaviest
    /// holder's oldest idle ones (docs/security.md, G7: eviction, not refusal).
    fn enforce_pin_cap(&mut self) {
        let cap = self.config.pinned_blocks_total(self.local.num_blocks);
        let mut over = self.index.pins.saturating_sub(cap);
        if over == 0 {
            return;
        }
        // Heaviest first; one whose pins are all read, fetched or young is passed over.
        let mut holders: Vec<(usize, PeerId)> = self
            .sessions
            .values()
            .filter(|s| !s.is_dead())
            .map(|s| (s.shares().2, s.peer().clone()))
            .collect();
        holders.sort_by_key(|h| std::cmp::Reverse(h.0));
        for (_, peer) in holders {
            let released = self
                .with_session(&peer, |s, cx, _| s.evict_oldest_pins(cx, over))
                .unwrap_or(0);
            if released == 0 {
                continue;
            }
            self.out.counters.pins_evicted += released as u64;
            crate::warn_throttled!(self.out.throttle, self.now,
                "all peers' pins reached the node's cap; releasing the heaviest holder's oldest",
                %peer, released, cap);
            over = over.saturating_sub(released);
            if over == 0 {
                return;
            }
        }
    }

    /// Failed loads make their requests answer MISS (the outbox collects them where loads end,
    /// deep in a session, and the tier holds the set).
    fn drain_failed_loads(&mut self) {
        self.failed.extend(self.out.failed_loads.drain(..));
    }

    fn end_session(&mut self, peer: &PeerId) {
        let Some(mut session) = self.sessions.remove(peer) else {
            return;
        };
        self.index.remove(peer);
        self.out.counters.sessions_closed += 1;
        self.bound.retain(|_, p| p != peer);
        let peer_ended = session.death().is_some_and(CloseReason::ended_by_peer);
        // At shutdown the process goes: nothing is retained for writes that may go on.
        let mode = if self.shutting_down {
            CancelMode::Immediate
        } else {
            CancelMode::Wait
        };
        let mut closed = session.close(&mut self.split().1, mode);
        // The peer's registration goes first: its removal is what fences its writes on planes
        // that cannot revoke single blocks (nixl), so the loads below are asked after it.
        self.plane.remove_remote_peer(peer);
        let retained = std::mem::take(&mut closed.server.retained);
        if !retained.is_empty() {
            self.out.counters.transfers_retained += retained.len() as u64;
            crate::warn_throttled!(self.out.throttle, self.now, "writes of an ended session still running: their source blocks stay pinned until they stop",
                %peer, writes = retained.len(), cap_s = self.config.retained_hold_cap.as_secs_f64());
            self.retained.add(peer, retained, self.now);
            // A plane whose removal of the peer stopped them says so at once.
            self.poll_retained();
        }
        for load in closed.client.failed_jobs {
            self.plane.end_writes(peer, &load.blocks);
            if load.never_sent {
                // The peer never learned of these blocks: nothing of it can land.
                self.out
                    .load_done(load.job, load.kv_request_id, false, load.live);
                continue;
            }
            let fencing = fencing::Fencing {
                job: load.job,
                kv_request_id: load.kv_request_id,
                live: load.live,
                peer: peer.clone(),
                blocks: load.blocks,
                confirmed: false,
                peer_ended,
                since: self.now,
            };
            self.out.fail_load(&mut self.plane, self.now, fencing);
        }
        self.failed.extend(closed.client.failed_ids);
        self.drain_failed_loads();
        let end = self.account_end(peer, &session);
        // An orderly end (either side said `disconnect`, or we closed it) is routine; anything
        // else (timeouts, lost connections, faults, protocol errors) is worth a warning.
        let reason = &end;
        if end.is_orderly() {
            crate::info_throttled!(self.out.throttle, self.now, "session closed", %peer, %reason);
        } else {
            crate::warn_throttled!(self.out.throttle, self.now, "peer down",
                %peer,
                %reason,
                failed_stores = closed.server.failed_stores,
                released_serves = closed.server.released_serves
            );
        }
        self.out.event(Event::Close {
            peer: peer.clone(),
            end,
        });
    }
}

/// What a node holds for one peer, counted against the peer's fair share.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PeerShare {
    /// Keys of its open lookups and parked fetch demand (`max_held_keys_per_peer`).
    pub held_keys: usize,
    /// Their estimated bytes (`max_held_bytes_per_peer`).
    pub held_bytes: usize,
    /// Blocks pinned for its lookups (`max_pins_per_peer`).
    pub pinned_blocks: usize,
    /// Producer-side requests open for it (`max_requests_per_peer`).
    pub requests: usize,
    /// Store jobs (pins) open for it.
    pub pins: usize,
}

/// What the caller can see of one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionState {
    /// The peer acked our `connect`: messages flow.
    pub ready: bool,
    /// Loads, transfers or a registration outstanding.
    pub pending_work: bool,
    /// The handshake has gone past the peer's `connect` (one was accepted, or it acked ours):
    /// a `connect` now comes from a new incarnation of the peer, or is a protocol error.
    pub connected: bool,
}
