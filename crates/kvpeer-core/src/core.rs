//! The tier: all sessions of one node, the roles of its requests, and what outlives a single
//! session (failed request ids, a PD producer's parked stores, reconnect backoff, limits).
//!
//! Sans-IO: every entry point takes `now` and returns at once. The caller feeds inputs
//! (decoded payloads, connection events, data-plane progress, engine calls, timeouts) and
//! drains outputs in this order: [`Core::poll_transmit`] until empty, then [`Core::poll_event`]
//! until empty, then sleeps until [`Core::poll_timeout`] or the next input. When inputs and a
//! deadline are both due, feed the inputs first: a reply already received must win over the
//! timeout it answers.

use crate::maps::{Map, Set};
use std::time::{Duration, Instant};

use kvpeer_proto::{
    decode_with_limits, DecodeError, DecodeLimits, KvRequestId, Message, OffloadKey, PeerId,
};
use tracing::{debug, info, warn};

use crate::config::{CoreConfig, LocalNode};
use crate::error::{CloseReason, FaultRecord, ProtocolViolation, Refusal, SessionEnd};
use crate::output::{Event, Outbox, Transmit};
use crate::session::client::Load;
use crate::session::{Cx, Session};
use crate::timer::{earliest, Lane};
use crate::traits::{BlockIndex, CancelMode, DataPlane, JobId, LookupResult, Parent, TransferId};

/// Where a consumer request gets its blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    /// The producer.
    pub peer: PeerId,
    /// Probe with `lookup` first (`remote_kv_source`, symmetric); without probing every key is
    /// assumed held (`remote_prefiller`, PD).
    pub probe: bool,
}

/// The roles one request plays on this node (vLLM's `kv_transfer_params`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestRoles {
    /// This node fetches the request's blocks from a peer.
    pub source: Option<Source>,
    /// This node produces the request's blocks for a peer that fetches them
    /// (`remote_decoder`): its stores wait for the peer's fetch.
    pub decoder: bool,
}

impl RequestRoles {
    /// A symmetric consumer (`remote_kv_source`): probes `peer`, then fetches the hits.
    pub fn kv_source(peer: PeerId) -> Self {
        RequestRoles {
            source: Some(Source { peer, probe: true }),
            decoder: false,
        }
    }

    /// A PD consumer (`remote_prefiller`): fetches from `peer` without probing.
    pub fn prefiller(peer: PeerId) -> Self {
        RequestRoles {
            source: Some(Source { peer, probe: false }),
            decoder: false,
        }
    }

    /// A PD producer (`remote_decoder`): stores wait for the peer's fetch.
    pub fn decoder() -> Self {
        RequestRoles {
            source: None,
            decoder: true,
        }
    }
}

/// A request as the engine holds it, like vLLM's `ReqContext`: its id and roles. Made by
/// [`Core::on_new_request`] and passed back to every later call about the request, so the core
/// keeps no table of requests (one fewer lookup per operation) and cannot be asked about a
/// request it never saw.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    id: KvRequestId,
    roles: RequestRoles,
}

impl Request {
    /// The request's `kv_request_id`.
    pub fn id(&self) -> &KvRequestId {
        &self.id
    }

    /// Its roles on this node.
    pub fn roles(&self) -> &RequestRoles {
        &self.roles
    }

    /// How much of it the engine should offload: all of it for a PD producer.
    pub fn offload_policy(&self) -> OffloadPolicy {
        if self.roles.decoder {
            OffloadPolicy::RequestLevel
        } else {
            OffloadPolicy::Default
        }
    }
}

/// How much of a request the engine should offload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadPolicy {
    /// The engine's usual policy.
    Default,
    /// Every block of the request, prefix hits included (a PD producer: the peer needs all).
    RequestLevel,
}

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
}

#[derive(Debug)]
struct Batch {
    job: JobId,
    keys: Vec<OffloadKey>,
    blocks: Vec<BlockIndex>,
    submitted_at: Instant,
}

#[derive(Debug, Clone, Copy)]
struct Backoff {
    wait: Duration,
    retry_at: Instant,
}

/// Records one more failure of `peer` in `backoffs` at `now` and returns its wait: `first`
/// after no recent failure, else the previous wait doubled, within `min..=max`. Entries whose
/// wait is long over are forgotten, so the map holds only peers failing lately.
fn next_backoff(
    backoffs: &mut Map<PeerId, Backoff>,
    peer: &PeerId,
    now: Instant,
    first: Duration,
    min: Duration,
    max: Duration,
) -> Duration {
    backoffs.retain(|_, b| now <= b.retry_at + max);
    let wait = match backoffs.get(peer) {
        Some(prev) => (prev.wait * 2).max(min).min(max),
        None => first,
    };
    backoffs.insert(
        peer.clone(),
        Backoff {
            wait,
            retry_at: now + wait,
        },
    );
    wait
}

/// The protocol core of one node. See the [module documentation](self) for how to drive it.
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

    fn advance(&mut self, now: Instant) {
        if now > self.now {
            self.now = now;
        }
        self.out.throttle.tick(self.now);
    }

    /// Runs `f` on one session with everything it may touch.
    fn with_session<R>(
        &mut self,
        peer: &PeerId,
        f: impl FnOnce(&mut Session, &mut Cx<'_>, &LocalNode) -> R,
    ) -> Option<R> {
        let (sessions, mut cx, local) = self.split();
        let session = sessions.get_mut(peer)?;
        Some(f(session, &mut cx, local))
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

    /// Runs `f` on every session.
    fn each_session(&mut self, mut f: impl FnMut(&mut Session, &mut Cx<'_>)) {
        let (sessions, mut cx, _) = self.split();
        for session in sessions.values_mut() {
            f(session, &mut cx);
        }
    }

    // ---------------------------------------------------------------- outputs

    /// The next message to send, if any.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.out.transmits.pop_front()
    }

    /// The next event to act on, if any.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.out.events.pop_front()
    }

    /// When [`Core::handle_timeout`] must next be called, if ever.
    pub fn poll_timeout(&self) -> Option<Instant> {
        let sessions = self.sessions.values().map(Session::next_deadline);
        earliest(sessions.chain([
            self.unbound_lane.next_deadline(),
            self.bound_lane.next_deadline(),
            self.reaped_lane.next_deadline(),
            self.idle_deadline(),
        ]))
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

    /// Whether a session with `peer` exists, and whether the peer has acked our `connect`.
    pub fn session_state(&self, peer: &PeerId) -> Option<SessionState> {
        self.sessions.get(peer).map(|s| SessionState {
            ready: s.link.is_ready(),
            pending_work: s.has_pending_work(),
        })
    }

    // ---------------------------------------------------------------- control channel

    /// A control connection from a peer without a session. Returns whether it was accepted;
    /// a refusal comes with an [`Event::Refused`] (and a `disconnect` during backoff, so the
    /// peer fails at once).
    pub fn handle_inbound(&mut self, now: Instant, peer: PeerId) -> bool {
        self.advance(now);
        let refusal = if self.sessions.contains_key(&peer) {
            Some(Refusal::Duplicate(peer.clone()))
        } else if self.sessions.len() >= self.config.max_peers {
            Some(Refusal::SessionLimit {
                open: self.sessions.len(),
                max: self.config.max_peers,
            })
        } else {
            let wait = self.reconnect_wait(&peer);
            let dial_wait = self.dial_backoff.get(&peer).map_or(Duration::ZERO, |b| {
                b.retry_at.saturating_duration_since(self.now)
            });
            if dial_wait > Duration::ZERO {
                // Its address kept failing: any answer (even a `disconnect`) would dial it
                // again, so it gets none.
                Some(Refusal::DialBackoff { left: dial_wait })
            } else if wait > Duration::ZERO {
                self.out.transmit(&peer, Message::Disconnect);
                Some(Refusal::ReconnectBackoff { left: wait })
            } else {
                None
            }
        };
        if let Some(reason) = refusal {
            crate::warn_throttled!(self.out.throttle, self.now, "refusing inbound peer", %peer, %reason);
            self.out.event(Event::Refused { peer, reason });
            return false;
        }
        info!(%peer, "accepting inbound peer");
        let session = Session::open(
            peer.clone(),
            &self.local,
            &self.config,
            &mut self.out,
            self.now,
        );
        self.out.counters.sessions_opened += 1;
        self.sessions.insert(peer, session);
        true
    }

    /// One payload from `peer`'s control connection: decoded, classified, dispatched. From a
    /// peer without a session only a `connect` is accepted (it opens an inbound session);
    /// anything else is a leftover of an ended session and is dropped.
    pub fn handle_payload(&mut self, now: Instant, peer: &PeerId, payload: &[u8]) {
        self.advance(now);
        match decode_with_limits(payload, &self.limits) {
            Ok(message) => self.handle_message(now, peer, message),
            Err(e) if !self.sessions.contains_key(peer) => {
                // Not a `connect`, so it opens no session: the channel closes the connection.
                crate::warn_throttled!(self.out.throttle, self.now, "refusing a bad first payload from a peer without a session", %peer, error = %e);
                self.out.event(Event::Refused {
                    peer: peer.clone(),
                    reason: Refusal::BadFirstPayload(e),
                });
            }
            Err(DecodeError::Protocol(e)) => {
                self.with_session(peer, |s, cx, _| {
                    s.on_invalid_message(cx, ProtocolViolation::Malformed(e))
                });
                self.settle();
            }
            Err(DecodeError::Ignored(e)) => {
                crate::warn_throttled!(self.out.throttle, self.now, "ignoring a payload that is no known message", %peer, error = %e)
            }
            Err(e) => {
                crate::warn_throttled!(self.out.throttle, self.now, "dropping an undecodable payload", %peer, error = %e)
            }
        }
    }

    /// One decoded message from `peer` (the same rule for unknown peers as
    /// [`Core::handle_payload`]).
    pub fn handle_message(&mut self, now: Instant, peer: &PeerId, message: Message) {
        self.advance(now);
        self.out.counters.on_received(&message);
        if !self.sessions.contains_key(peer) && !self.accept_first_message(peer, &message) {
            return;
        }
        let handled = self.with_session(peer, |s, cx, local| {
            s.on_message(cx, local, message);
            std::mem::take(&mut s.new_fetch_ids)
        });
        if let Some(fetched) = handled {
            self.bind_fetches(peer, fetched);
        }
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
            return self.handle_inbound(self.now, peer.clone());
        }
        debug!(%peer, message = %message.message_type(), "dropping a message from a peer without a session");
        self.out.event(Event::Refused {
            peer: peer.clone(),
            reason: Refusal::NotAConnect(message.message_type()),
        });
        false
    }

    /// The control connection to `peer` is gone (socket closed, heartbeat lost, send failed).
    pub fn handle_connection_lost(&mut self, now: Instant, peer: &PeerId) {
        self.close_session(now, peer, CloseReason::ConnectionLost);
    }

    /// The node will not talk to `peer` (e.g. it is outside the allowlist): its session ends
    /// with `reason`, and its requests fall back at once.
    pub fn handle_connection_refused(&mut self, now: Instant, peer: &PeerId, reason: &str) {
        self.close_session(now, peer, CloseReason::Refused(reason.into()));
    }

    /// Ends `peer`'s session (if any) for `reason`, without a message.
    fn close_session(&mut self, now: Instant, peer: &PeerId, reason: CloseReason) {
        self.advance(now);
        if let Some(session) = self.sessions.get_mut(peer) {
            session.mark_dead(reason);
        }
        self.settle();
    }

    // ---------------------------------------------------------------- data plane

    /// The data plane may have progressed (a registration, a completion, a fault).
    pub fn handle_data_plane(&mut self, now: Instant) {
        self.advance(now);
        self.each_session(|s, cx| s.on_data_plane(cx));
        self.settle();
    }

    // ---------------------------------------------------------------- timers

    /// Fires every deadline at or before `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.advance(now);
        self.each_session(|s, cx| s.handle_timeout(cx));
        self.reap_unbound();
        self.release_idle_bindings();
        self.expire_reaped();
        self.evict_idle();
        self.settle();
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
        match self.sessions.get_mut(&source.peer) {
            None => LookupResult::Miss,
            Some(session) => match session.register_lookup(id, key) {
                Some(true) => LookupResult::Hit,
                Some(false) => LookupResult::Miss,
                None => LookupResult::Retry,
            },
        }
    }

    /// Sends the probes registered since the last flush (one `lookup` per request and peer).
    /// vLLM does this once per scheduler step.
    pub fn flush_lookups(&mut self, now: Instant) {
        self.advance(now);
        let now = self.now;
        for session in self.sessions.values_mut() {
            session.flush_lookups(&mut self.out, now);
        }
    }

    /// Asks the store again about inbound lookups waiting on pending keys (call when blocks
    /// being written become readable; a timer does it anyway every `lookup_repoll_interval`).
    pub fn serve(&mut self, now: Instant) {
        self.advance(now);
        self.each_session(|s, cx| s.serve(cx));
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
        match self.sessions.get_mut(&source.peer) {
            Some(session) if !session.is_dead() => {
                // From now on the producer may write into these blocks (and only these).
                self.plane.expect_writes(&source.peer, &blocks);
                session.request_blocks(&mut self.out, now, id, Load { job, keys, blocks })
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
        let id = &req.id;
        if !req.roles.decoder {
            self.complete_store(job, true);
            return;
        }
        if self.reaped.contains_key(id) {
            warn!(kv_request_id = %id, job = job.get(), "store for a request whose parked stores were reaped; failing it");
            self.complete_store(job, false);
            return;
        }
        if let Some(peer) = self.bound.get(id).cloned() {
            self.with_session(&peer, |s, cx, _| {
                s.add_stored_blocks(cx, id, &keys, &blocks, job)
            });
            self.settle();
            return;
        }
        let batches = self.unbound.entry(id.clone()).or_default();
        if batches.is_empty() {
            self.unbound_lane.arm(self.now, id.clone());
        }
        batches.push(Batch {
            job,
            keys,
            blocks,
            submitted_at: self.now,
        });
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
        if ids.is_empty() {
            return true;
        }
        let still = self.plane.cancel(&ids, CancelMode::Wait);
        self.each_session(|s, cx| s.on_data_plane(cx));
        self.settle();
        still.is_empty() && self.sessions.values().all(|s| s.inflight_ids().is_empty())
    }

    /// Ends everything: remaining transfers are abandoned, every session sends `disconnect`
    /// and closes, parked stores fail.
    pub fn shutdown(&mut self, now: Instant) {
        self.advance(now);
        let peers: Vec<PeerId> = self.sessions.keys().cloned().collect();
        for peer in peers {
            self.end_session(&peer);
        }
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

    /// Opens a session toward `peer` unless one exists; `false` if it cannot.
    fn ensure_session(&mut self, peer: &PeerId) -> bool {
        if self.sessions.contains_key(peer) {
            return true;
        }
        if self.reconnect_wait(peer) > Duration::ZERO {
            debug!(%peer, "not dialing: reconnect backoff after a data-plane fault");
            return false;
        }
        if self
            .dial_backoff
            .get(peer)
            .is_some_and(|b| b.retry_at > self.now)
        {
            debug!(%peer, "not dialing: backoff after failed dials");
            return false;
        }
        if self.sessions.len() >= self.config.max_peers {
            warn!(%peer, limit = self.config.max_peers, "not dialing: session limit reached");
            return false;
        }
        info!(%peer, "opening a session");
        self.out.event(Event::Dial(peer.clone()));
        let session = Session::open(
            peer.clone(),
            &self.local,
            &self.config,
            &mut self.out,
            self.now,
        );
        self.out.counters.sessions_opened += 1;
        self.sessions.insert(peer.clone(), session);
        true
    }

    /// PD producer: a fetch binds its id to the session and replays parked stores; a fetch
    /// for a reaped id fails in one round trip.
    fn bind_fetches(&mut self, peer: &PeerId, fetched: Vec<KvRequestId>) {
        for id in fetched {
            if self.reaped.contains_key(&id) {
                self.with_session(peer, |s, cx, _| s.finish_request(cx, &id));
                for batch in self.unbound.remove(&id).unwrap_or_default() {
                    self.complete_store(batch.job, false);
                }
                continue;
            }
            if self.bound.insert(id.clone(), peer.clone()).is_none() {
                self.bound_lane.arm(self.now, id.clone());
            }
            for batch in self.unbound.remove(&id).unwrap_or_default() {
                self.with_session(peer, |s, cx, _| {
                    s.add_stored_blocks(cx, &id, &batch.keys, &batch.blocks, batch.job)
                });
            }
        }
    }

    /// After every entry point: failed loads mark their ids, dead sessions are reaped.
    fn settle(&mut self) {
        self.drain_load_ends();
        let dead: Vec<PeerId> = self
            .sessions
            .values()
            .filter(|s| s.is_dead())
            .map(|s| s.peer().clone())
            .collect();
        for peer in dead {
            self.end_session(&peer);
        }
    }

    /// Failed loads make their requests answer MISS; ended loads' blocks take no more writes.
    fn drain_load_ends(&mut self) {
        self.failed.extend(self.out.failed_loads.drain(..));
        for (peer, blocks) in std::mem::take(&mut self.out.ended_writes) {
            self.plane.end_writes(&peer, &blocks);
        }
    }

    fn end_session(&mut self, peer: &PeerId) {
        let Some(mut session) = self.sessions.remove(peer) else {
            return;
        };
        self.out.counters.sessions_closed += 1;
        self.bound.retain(|_, p| p != peer);
        let closed = session.close(&mut self.split().1);
        for (job, id, live) in closed.client.failed_jobs {
            self.out.load_done(job, id, false, live);
        }
        self.failed.extend(closed.client.failed_ids);
        self.drain_load_ends();
        self.plane.remove_remote_peer(peer);
        let mut end = SessionEnd {
            reason: session.death().cloned().unwrap_or(CloseReason::Closed),
            dial_backoff: None,
            fault: None,
        };
        // A session that ends before the peer acked our `connect` is a failed dial, whoever
        // opened it (an inbound `connect` makes us dial back): the peer is neither dialed nor
        // answered again until its backoff passes.
        if session.was_acked() {
            self.dial_backoff.remove(peer);
        } else if end.reason != CloseReason::Closed {
            end.dial_backoff = Some(self.schedule_dial_backoff(peer));
        }
        if session.data_plane_fault().is_some() {
            let count = self.faults.entry(peer.clone()).or_default();
            *count += 1;
            let count = *count;
            end.fault = Some(FaultRecord {
                count,
                reconnect_backoff: self.schedule_backoff(peer),
            });
        }
        // An orderly end (either side said `disconnect`, or we closed it) is routine; anything
        // else (timeouts, lost connections, faults, protocol errors) is worth a warning.
        let reason = &end;
        if end.is_orderly() {
            info!(%peer, %reason, "session closed");
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

    /// A data-plane fault: the first reconnect waits 0, then `reconnect_min_backoff` doubling
    /// per fault in a row up to `reconnect_max_backoff`.
    fn schedule_backoff(&mut self, peer: &PeerId) -> Duration {
        let (min, max) = (
            self.config.reconnect_min_backoff,
            self.config.reconnect_max_backoff,
        );
        next_backoff(&mut self.backoff, peer, self.now, Duration::ZERO, min, max)
    }

    /// A session that ended before the peer acked our `connect`: the next dial (or answer)
    /// waits `dial_min_backoff`, doubling per failure in a row up to `dial_max_backoff`.
    fn schedule_dial_backoff(&mut self, peer: &PeerId) -> Duration {
        let (min, max) = (self.config.dial_min_backoff, self.config.dial_max_backoff);
        next_backoff(&mut self.dial_backoff, peer, self.now, min, min, max)
    }

    fn reconnect_wait(&self, peer: &PeerId) -> Duration {
        self.backoff.get(peer).map_or(Duration::ZERO, |b| {
            b.retry_at.saturating_duration_since(self.now)
        })
    }

    /// Bindings checked now: kept (and checked again later) while their session still serves
    /// the request, else dropped; a store for it later parks unbound, as before any fetch.
    fn release_idle_bindings(&mut self) {
        while let Some((_, id)) = self.bound_lane.pop_due(self.now) {
            let Some(peer) = self.bound.get(&id) else {
                continue;
            };
            if self.sessions.get(peer).is_some_and(|s| s.serves(&id)) {
                self.bound_lane.arm(self.now, id);
            } else {
                self.bound.remove(&id);
            }
        }
    }

    fn reap_unbound(&mut self) {
        let delay = self.unbound_lane.delay();
        while let Some((deadline, id)) = self.unbound_lane.pop_due(self.now) {
            let current = self
                .unbound
                .get(&id)
                .and_then(|b| b.first())
                .map(|b| b.submitted_at + delay);
            if current != Some(deadline) {
                continue;
            }
            let batches = self.unbound.remove(&id).unwrap_or_default();
            warn!(kv_request_id = %id, jobs = batches.len(), "parked stores were never fetched; failing them");
            for batch in batches {
                self.complete_store(batch.job, false);
            }
            self.reaped.insert(id.clone(), self.now);
            self.reaped_lane.arm(self.now, id);
        }
    }

    fn expire_reaped(&mut self) {
        let delay = self.reaped_lane.delay();
        while let Some((deadline, id)) = self.reaped_lane.pop_due(self.now) {
            if self.reaped.get(&id).map(|at| *at + delay) == Some(deadline) {
                self.reaped.remove(&id);
            }
        }
    }

    fn idle_eviction_active(&self) -> bool {
        let headroom = self
            .config
            .idle_headroom
            .min(self.config.max_peers.saturating_sub(1));
        !self.config.idle_timeout.is_zero()
            && self.sessions.len() >= self.config.max_peers.saturating_sub(headroom)
    }

    fn idle_deadline(&self) -> Option<Instant> {
        if !self.idle_eviction_active() {
            return None;
        }
        self.sessions
            .values()
            .filter(|s| !s.has_pending_work())
            .map(|s| s.link.last_activity + self.config.idle_timeout)
            .min()
    }

    fn evict_idle(&mut self) {
        if !self.idle_eviction_active() {
            return;
        }
        let idle: Vec<PeerId> = self
            .sessions
            .values()
            .filter(|s| {
                !s.has_pending_work() && s.link.last_activity + self.config.idle_timeout <= self.now
            })
            .map(|s| s.peer().clone())
            .collect();
        for peer in idle {
            info!(%peer, "evicting an idle peer");
            if let Some(s) = self.sessions.get_mut(&peer) {
                s.disconnect(&mut self.out, self.now, CloseReason::Idle);
            }
            self.end_session(&peer);
        }
    }
}

/// What the caller can see of one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SessionState {
    /// The peer acked our `connect`: messages flow.
    pub ready: bool,
    /// Loads, transfers or a registration outstanding.
    pub pending_work: bool,
}
