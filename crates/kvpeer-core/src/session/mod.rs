//! One session per peer: the handshake, send gating, dispatch of inbound messages to the two
//! roles, and the reasons a session ends.
//!
//! Called by the [`Core`](crate::Core) on its thread. A session never tears itself down: it
//! marks itself dead (recording the first reason) and the core reaps it at the end of the
//! same entry point. After `disconnect` (sent or received) it sends nothing more.

pub(crate) mod client;
pub(crate) mod server;

use std::time::Instant;

use kvpeer_proto::{
    Connect, ConnectAck, Disconnect, KvRequestId, Message, OffloadKey, PeerId, RoundSeq,
};

use crate::config::{CoreConfig, LocalNode};
use crate::error::{
    CloseReason, ConnectRejection, InternalError, PeerSaid, PlaneError, ProtocolViolation,
};
use crate::output::{Event, Link, Outbox};
use crate::timer::earliest;
use crate::traits::{BlockIndex, DataPlane, JobId, Parent, Registration, RemoteMemory, TransferId};
use client::{ClientClose, ClientRole, Load};
use server::{Origin, ServerClose, ServerRole, Supply};

/// One round of one request: what per-round state and deadlines are keyed by, on both sides.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct RoundKey {
    pub(crate) id: KvRequestId,
    pub(crate) round: RoundSeq,
}

impl RoundKey {
    pub(crate) fn new(id: &KvRequestId, round: RoundSeq) -> Self {
        RoundKey {
            id: id.clone(),
            round,
        }
    }
}

/// Everything a session may touch during one entry point of the core.
pub(crate) struct Cx<'a> {
    pub(crate) now: Instant,
    pub(crate) config: &'a CoreConfig,
    pub(crate) parent: &'a mut dyn Parent,
    pub(crate) plane: &'a mut dyn DataPlane,
    pub(crate) out: &'a mut Outbox,
}

/// What a reaped session leaves behind.
#[derive(Debug)]
pub(crate) struct SessionClose {
    pub(crate) client: ClientClose,
    pub(crate) server: ServerClose,
}

/// Where the peer's half of the handshake stands (its `connect`, registered before we ack
/// it), or why the session ended. Our half (the peer's ack of our `connect`) is the
/// [`Link`]'s gate.
#[derive(Debug)]
enum State {
    /// No `connect` from the peer accepted yet.
    AwaitingConnect,
    /// The peer's memory registration is running; `connect_ack` waits for it.
    Registering {
        /// Blocks in the peer's region (from its `connect`), to check fetch indexes against.
        peer_blocks: u64,
    },
    /// The peer's `connect` was accepted and registered, and acked.
    Registered {
        /// Blocks in the peer's region.
        peer_blocks: u64,
    },
    /// The session ended (the first reason wins): nothing more is sent or handled.
    Dead(CloseReason),
}

impl State {
    /// Blocks in the peer's region, once its `connect` was accepted.
    fn peer_blocks(&self) -> Option<u64> {
        match self {
            State::Registering { peer_blocks } | State::Registered { peer_blocks } => {
                Some(*peer_blocks)
            }
            State::AwaitingConnect | State::Dead(_) => None,
        }
    }
}

/// One peer's session.
#[derive(Debug)]
pub(crate) struct Session {
    pub(crate) link: Link,
    /// This node's identity, sent in `connect_ack`.
    local_id: PeerId,
    peer_fault_drain: std::time::Duration,
    client: ClientRole,
    server: ServerRole,
    /// The peer's half of the handshake, or the session's end.
    state: State,
    handshake_deadline: Instant,
    dispatch_errors: u32,
    peer_fault_at: Option<Instant>,
    /// Our `connect`, held until the peer's own is accepted (a session a peer's `connect`
    /// opened): a peer that is refused learns nothing of this node's memory, only
    /// `disconnect`.
    unsent_connect: Option<Message>,
    /// The peer said `disconnect`: the session is dead, yet the `transfer_done`s and
    /// `abort_ack`s that follow it directly still settle its loads, until the core ends that
    /// (at its next input of any other kind).
    hears_terminals: bool,
}

/// When a new session sends this node's `connect`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Announce {
    /// At once (we dial, or the channel reports a connection before any message).
    Now,
    /// Once the peer's `connect`, which opened the session, passes the checks; a refused peer
    /// gets only `disconnect`. vLLM's own peers announce at once, so a refused vLLM peer sees
    /// our `connect` and may refuse it itself before our `disconnect` arrives: it learns why
    /// from its own check, and an attacker learns nothing.
    AfterPeersConnect,
}

impl Session {
    /// A session on a fresh connection: announces this node with `connect` as `announce`
    /// says.
    pub(crate) fn open(
        peer: PeerId,
        local: &LocalNode,
        config: &CoreConfig,
        out: &mut Outbox,
        now: Instant,
        announce: Announce,
    ) -> Self {
        let mut link = Link::new(peer.clone(), now);
        let connect = Message::Connect(Connect {
            peer_id: local.peer_id.clone(),
            agent_metadata: local.agent_metadata.clone(),
            base_addr: local.base_addr,
            num_blocks: local.num_blocks,
            block_len: local.block_len,
            config_fingerprint: Some(local.config_fingerprint.clone()),
            hash_seed: local.hash_seed.clone(),
            kvpeer_auth: None,
        });
        let unsent_connect = match announce {
            Announce::Now => {
                link.send_now(out, now, connect);
                None
            }
            Announce::AfterPeersConnect => Some(connect),
        };
        Session {
            link,
            local_id: local.peer_id.clone(),
            peer_fault_drain: config.peer_fault_drain,
            client: ClientRole::new(peer.clone(), config),
            server: ServerRole::new(peer, config, local.num_blocks, now, out.node_held.clone()),
            state: State::AwaitingConnect,
            handshake_deadline: now + config.handshake_timeout,
            dispatch_errors: 0,
            peer_fault_at: None,
            unsent_connect,
            hears_terminals: false,
        }
    }

    pub(crate) fn peer(&self) -> &PeerId {
        &self.link.peer
    }

    /// Whether the peer ever acknowledged our `connect` (it is alive and speaks the protocol).
    pub(crate) fn was_acked(&self) -> bool {
        self.link.was_ready()
    }

    pub(crate) fn is_dead(&self) -> bool {
        matches!(self.state, State::Dead(_))
    }

    /// Whether another `connect` on this session would be a duplicate (one was accepted, or
    /// the peer acked ours: its `connect` comes before its ack).
    pub(crate) fn takes_no_connect(&self) -> bool {
        self.link.is_ready() || !matches!(self.state, State::AwaitingConnect)
    }

    /// Why the session ended, if it did.
    pub(crate) fn death(&self) -> Option<&CloseReason> {
        match &self.state {
            State::Dead(reason) => Some(reason),
            _ => None,
        }
    }

    /// Whether the producer side still holds state for request `id`.
    pub(crate) fn serves(&self, id: &KvRequestId) -> bool {
        self.server.serves(id)
    }

    /// Loads or transfers outstanding, or a registration running.
    pub(crate) fn has_pending_work(&self) -> bool {
        matches!(self.state, State::Registering { .. })
            || self.client.has_active_loads()
            || self.server.has_inflight()
    }

    pub(crate) fn data_plane_fault(&self) -> Option<&PlaneError> {
        self.server.peer_fault.as_ref()
    }

    /// Ends the session without a message (the connection is gone, or the peer said goodbye).
    pub(crate) fn mark_dead(&mut self, reason: CloseReason) {
        self.unsent_connect = None;
        self.hears_terminals = false;
        if !self.is_dead() {
            self.state = State::Dead(reason);
        }
        self.link.close();
    }

    /// Whether the peer's goodbye's terminals are still heard ([`Session::mark_dead`] by the
    /// peer's `disconnect`, and nothing else since).
    pub(crate) fn hears_terminals(&self) -> bool {
        self.hears_terminals
    }

    /// Stops hearing the goodbye's terminals: the session waits only to be reaped.
    pub(crate) fn stop_hearing_terminals(&mut self) {
        self.hears_terminals = false;
    }

    /// The peer said `disconnect`: the session ends, but the terminals it sent right after
    /// still settle its loads (vLLM 0.34).
    fn peer_said_goodbye(&mut self) {
        self.mark_dead(CloseReason::PeerDisconnected);
        self.hears_terminals = self.client.has_active_loads();
    }

    /// Ends the session with a `disconnect`, so the peer learns at once.
    pub(crate) fn disconnect(&mut self, out: &mut Outbox, now: Instant, reason: CloseReason) {
        if !self.is_dead() {
            self.link.send_now(out, now, Message::DISCONNECT);
        }
        self.mark_dead(reason);
    }

    /// Refuses the peer's `connect` with a `disconnect` that tells it why (kvpeer's
    /// `kvpeer_reason`: a vLLM peer skips it and sees the plain `disconnect`).
    fn refuse_connect(&mut self, out: &mut Outbox, now: Instant, refusal: ConnectRejection) {
        if !self.is_dead() {
            let told = Disconnect {
                kvpeer_reason: Some(refusal.told_to_peer()),
            };
            self.link.send_now(out, now, Message::Disconnect(told));
        }
        self.mark_dead(CloseReason::ConnectRejected(refusal));
    }

    fn protocol_error(&mut self, cx: &mut Cx<'_>, reason: CloseReason) {
        crate::error_throttled!(cx.out.throttle, cx.now, "protocol error; disconnecting", peer = %self.link.peer, %reason);
        cx.out.counters.protocol_errors += 1;
        self.disconnect(cx.out, cx.now, reason);
    }

    /// An internal error while handling a peer's message: counted; enough in a row end the
    /// session (a peer may be wedging us into a bad state).
    fn internal_error(&mut self, cx: &mut Cx<'_>, reason: InternalError) {
        self.dispatch_errors += 1;
        crate::error_throttled!(cx.out.throttle, cx.now, "internal error handling a message", peer = %self.link.peer, %reason, count = self.dispatch_errors);
        if self.dispatch_errors >= cx.config.max_consecutive_dispatch_errors {
            let count = self.dispatch_errors;
            self.protocol_error(
                cx,
                CloseReason::TooManyInternalErrors {
                    count,
                    last: reason,
                },
            );
        }
    }

    /// A payload the decoder refused as a protocol error.
    pub(crate) fn on_invalid_message(&mut self, cx: &mut Cx<'_>, reason: ProtocolViolation) {
        if !self.is_dead() {
            self.protocol_error(cx, reason.into());
        }
    }

    /// Dispatches one inbound message. Returns the request of a `fetch` it accepted: the tier
    /// binds it to this session (PD routing of later stores).
    pub(crate) fn on_message(
        &mut self,
        cx: &mut Cx<'_>,
        local: &LocalNode,
        message: Message,
    ) -> Option<KvRequestId> {
        if self.is_dead() {
            if self.hears_terminals {
                self.settle_after_goodbye(cx, message);
            }
            return None;
        }
        self.link.last_activity = cx.now;
        let mut fetched = None;
        let result = match message {
            Message::Connect(c) => {
                self.on_connect(cx, local, c);
                Ok(())
            }
            Message::ConnectAck(_) => {
                self.link.set_ready(cx.out, cx.now);
                Ok(())
            }
            Message::Disconnect(Disconnect {
                kvpeer_reason: None,
            }) => {
                crate::info_throttled!(cx.out.throttle, cx.now, "peer disconnected", peer = %self.link.peer);
                self.peer_said_goodbye();
                Ok(())
            }
            // A reason is a refusal of our `connect`: once the peer acked it, a `disconnect` is
            // an end like any other, whatever text it carries.
            Message::Disconnect(Disconnect {
                kvpeer_reason: Some(_),
            }) if self.was_acked() => {
                crate::info_throttled!(cx.out.throttle, cx.now, "peer disconnected", peer = %self.link.peer);
                self.peer_said_goodbye();
                Ok(())
            }
            Message::Disconnect(Disconnect {
                kvpeer_reason: Some(said),
            }) => {
                let said = PeerSaid::new(&said);
                crate::warn_throttled!(cx.out.throttle, cx.now, "the peer refused our connect", peer = %self.link.peer, %said);
                self.mark_dead(CloseReason::RefusedByPeer(said));
                Ok(())
            }
            Message::Fetch(f) => self.on_fetch(cx, f).map(|id| fetched = Some(id)),
            Message::AbortFetch(a) => {
                self.server
                    .on_abort_fetch(&mut self.link, cx, &a.kv_request_id, a.round_seq);
                Ok(())
            }
            Message::Lookup(l) => self
                .server
                .on_lookup(&mut self.link, cx, &l.kv_request_id, l.keys, l.round_seq)
                .map_err(Fault::Internal),
            Message::LookupResp(r) => {
                if self
                    .client
                    .on_lookup_resp(cx.now, &r.kv_request_id, &r.keys, &r.hits)
                {
                    cx.out.event(Event::LookupAnswered {
                        kv_request_id: r.kv_request_id,
                    });
                }
                Ok(())
            }
            Message::TransferDone(t) => {
                self.client
                    .on_transfer_done(cx, &t.kv_request_id, t.success, t.round_seq);
                Ok(())
            }
            Message::AbortAck(a) => {
                self.client.on_abort_ack(cx, &a.kv_request_id, a.round_seq);
                Ok(())
            }
        };
        match result {
            Ok(()) => self.dispatch_errors = 0,
            Err(Fault::Protocol(reason)) => self.protocol_error(cx, reason.into()),
            Err(Fault::Internal(reason)) => self.internal_error(cx, reason),
        }
        fetched
    }

    /// A message after the peer's `disconnect`: a terminal settles its load as it would have
    /// before (a `transfer_done` whose writes the plane confirms succeeds); anything else is
    /// new work for a session that ended, dropped, and ends the hearing.
    fn settle_after_goodbye(&mut self, cx: &mut Cx<'_>, message: Message) {
        match message {
            Message::TransferDone(t) => {
                self.client
                    .on_transfer_done(cx, &t.kv_request_id, t.success, t.round_seq);
            }
            Message::AbortAck(a) => self.client.on_abort_ack(cx, &a.kv_request_id, a.round_seq),
            other => {
                tracing::debug!(peer = %self.link.peer, message = %other.message_type(), "dropping a message after the peer's disconnect");
                self.hears_terminals = false;
            }
        }
        if !self.client.has_active_loads() {
            self.hears_terminals = false;
        }
    }

    /// A `fetch`; its request on success.
    fn on_fetch(&mut self, cx: &mut Cx<'_>, f: kvpeer_proto::Fetch) -> Result<KvRequestId, Fault> {
        // kvpeer's check: an index outside the peer's own region can only be a broken or
        // hostile peer (vLLM leaves it to NIXL to fail the write).
        if let Some(limit) = self.state.peer_blocks() {
            if let Some((position, &index)) = f
                .block_indexes
                .iter()
                .enumerate()
                .find(|(_, idx)| **idx >= limit)
            {
                return Err(Fault::Protocol(ProtocolViolation::FetchOutOfRange {
                    position,
                    index,
                    limit,
                }));
            }
        }
        self.server
            .on_fetch(
                &mut self.link,
                cx,
                &f.kv_request_id,
                &f.keys,
                &f.block_indexes,
                f.round_seq,
            )
            .map_err(Fault::Protocol)?;
        Ok(f.kv_request_id)
    }

    fn on_connect(&mut self, cx: &mut Cx<'_>, local: &LocalNode, c: Connect) {
        if self.takes_no_connect() {
            self.protocol_error(cx, ProtocolViolation::DuplicateConnect.into());
            return;
        }
        // The routing identity is only what the peer's socket claims; a `connect` naming
        // another peer would register that peer's memory under this session (vLLM's peers
        // always send their own identity in both places).
        let refusal = if c.peer_id != self.link.peer {
            Some(ConnectRejection::PeerIdMismatch {
                named: c.peer_id.clone(),
                from: self.link.peer.clone(),
            })
        } else if c.block_len != local.block_len {
            Some(ConnectRejection::BlockLen {
                remote: c.block_len,
                local: local.block_len,
            })
        } else if !local.config_fingerprint.is_empty()
            && !c.fingerprint().is_empty()
            && c.fingerprint() != local.config_fingerprint
        {
            Some(ConnectRejection::Fingerprint {
                remote: c.fingerprint().to_owned(),
                local: local.config_fingerprint.clone(),
            })
        } else if c.num_blocks > cx.config.max_peer_blocks.max(local.num_blocks) {
            // A pool as large as ours is always taken: a peer configured like this node is
            // never refused by it.
            Some(ConnectRejection::PoolTooLarge {
                blocks: c.num_blocks,
                most: cx.config.max_peer_blocks.max(local.num_blocks),
            })
        } else if c.hash_seed != local.hash_seed {
            Some(ConnectRejection::HashSeed {
                remote: c.hash_seed.clone(),
                local: local.hash_seed.clone(),
            })
        } else {
            let memory = RemoteMemory {
                agent_metadata: c.agent_metadata,
                base_addr: c.base_addr,
                num_blocks: c.num_blocks,
                block_len: c.block_len,
            };
            cx.plane
                .add_remote_peer(&self.link.peer, &memory)
                .err()
                .map(ConnectRejection::PlaneRefused)
        };
        if let Some(reason) = refusal {
            // vLLM drops the peer silently and it waits 30 s for an ack; kvpeer tells it.
            crate::warn_throttled!(cx.out.throttle, cx.now, "rejecting peer connect", peer = %self.link.peer, %reason);
            self.refuse_connect(cx.out, cx.now, reason);
            return;
        }
        if let Some(connect) = self.unsent_connect.take() {
            self.link.send_now(cx.out, cx.now, connect);
        }
        self.state = State::Registering {
            peer_blocks: c.num_blocks,
        };
        self.poll_registration(cx);
    }

    /// Sends `connect_ack` once the peer's memory is registered; a failed registration ends
    /// the session.
    fn poll_registration(&mut self, cx: &mut Cx<'_>) {
        let State::Registering { peer_blocks } = self.state else {
            return;
        };
        match cx.plane.registration(&self.link.peer) {
            Registration::Pending => {}
            Registration::Done => {
                self.state = State::Registered { peer_blocks };
                let ack = Message::ConnectAck(ConnectAck {
                    peer_id: self.local_id.clone(),
                });
                self.link.send_now(cx.out, cx.now, ack);
            }
            Registration::Failed(e) => {
                crate::warn_throttled!(cx.out.throttle, cx.now, "peer registration failed; rejecting peer", peer = %self.link.peer, error = %e);
                // The refused peer is told why, as for a refused `connect` (`kvpeer_reason`:
                // a vLLM peer skips it), e.g. that it offers no TLS where TLS is required.
                let told = Disconnect {
                    kvpeer_reason: Some(format!("my data plane will not take your memory: {e}")),
                };
                if !self.is_dead() {
                    self.link
                        .send_now(cx.out, cx.now, Message::Disconnect(told));
                }
                self.mark_dead(CloseReason::RegistrationFailed(e));
            }
        }
    }

    /// The data plane may have progressed: registrations, completions, faults.
    pub(crate) fn on_data_plane(&mut self, cx: &mut Cx<'_>) {
        if self.is_dead() {
            return;
        }
        self.poll_registration(cx);
        if !self.is_dead() {
            self.server.poll_plane(&mut self.link, cx);
            self.escalate_peer_fault(cx);
        }
    }

    /// A data-plane fault ends the session once inflight writes drain (or after the cap).
    fn escalate_peer_fault(&mut self, cx: &mut Cx<'_>) {
        let Some(fault) = self.server.peer_fault.clone() else {
            return;
        };
        if self.is_dead() {
            return;
        }
        let since = match self.peer_fault_at {
            Some(since) => since,
            None => {
                crate::warn_throttled!(cx.out.throttle, cx.now, "data plane faulted; disconnecting once inflight transfers drain", peer = %self.link.peer, %fault);
                *self.peer_fault_at.insert(cx.now)
            }
        };
        // A stalled write will not drain: the session ends at once (vLLM 0.34).
        if self.server.has_inflight()
            && !self.server.transfer_stalled
            && cx.now < since + cx.config.peer_fault_drain
        {
            return;
        }
        self.disconnect(cx.out, cx.now, CloseReason::DataPlaneFault(fault));
    }

    pub(crate) fn handle_timeout(&mut self, cx: &mut Cx<'_>) {
        if self.is_dead() {
            return;
        }
        if !self.link.is_ready() && cx.now >= self.handshake_deadline {
            crate::warn_throttled!(cx.out.throttle, cx.now, "handshake timed out", peer = %self.link.peer);
            self.mark_dead(CloseReason::HandshakeTimeout);
            return;
        }
        match self.client.handle_timeout(&mut self.link, cx) {
            Some(client::Expired::Lookup(id)) => {
                crate::warn_throttled!(cx.out.throttle, cx.now, "lookup response timed out; disconnecting the peer", peer = %self.link.peer, kv_request_id = %id);
                self.disconnect(cx.out, cx.now, CloseReason::LookupTimeout);
                return;
            }
            Some(client::Expired::AbortAck(id)) => {
                crate::warn_throttled!(cx.out.throttle, cx.now, "abort_ack timed out; disconnecting the peer to fence its writes", peer = %self.link.peer, kv_request_id = %id);
                self.disconnect(cx.out, cx.now, CloseReason::AbortAckTimeout);
                return;
            }
            None => {}
        }
        if let Err(e) = self.server.handle_timeout(&mut self.link, cx) {
            self.internal_error(cx, e);
        }
        self.escalate_peer_fault(cx);
    }

    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        if self.is_dead() {
            return None;
        }
        let handshake = (!self.link.is_ready()).then_some(self.handshake_deadline);
        let fault = self.peer_fault_at.map(|at| at + self.peer_fault_drain);
        earliest([
            handshake,
            self.client.next_deadline(),
            self.server.next_deadline(),
            fault,
        ])
    }

    // ---- engine-facing ----

    pub(crate) fn register_lookup(&mut self, id: &KvRequestId, key: &OffloadKey) -> Option<bool> {
        self.client.register_lookup(id, key)
    }

    pub(crate) fn flush_lookups(&mut self, out: &mut Outbox, now: Instant) {
        if !self.is_dead() {
            self.client.flush(&mut self.link, out, now);
        }
    }

    pub(crate) fn request_blocks(
        &mut self,
        out: &mut Outbox,
        now: Instant,
        id: &KvRequestId,
        load: Load,
    ) {
        self.client
            .request_blocks(&mut self.link, out, now, id, load);
    }

    pub(crate) fn add_stored_blocks(
        &mut self,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        keys: &[OffloadKey],
        blocks: &[BlockIndex],
        job: JobId,
    ) {
        // PD stores all belong to round 0, the single round of a PD consumer.
        let supply = Supply {
            job,
            keys,
            blocks,
            round: RoundSeq(0),
            origin: Origin::Store,
        };
        self.server
            .add_stored_blocks(&mut self.link, cx, id, supply);
    }

    /// When its queued lookups want their next slice (`None`: none, or the session is dead):
    /// the core's step serves it in its host's turn (`core/slices.rs`).
    pub(crate) fn slice_at(&self) -> Option<Instant> {
        if self.is_dead() {
            return None;
        }
        self.server.slice_at()
    }

    /// Asks the store about the next slice of its queued lookups; how many keys that was.
    /// `spare`: the step had no session within its keys-per-second budget to serve, so this
    /// one is served past its own.
    pub(crate) fn serve_slice(&mut self, cx: &mut Cx<'_>, spare: bool) -> usize {
        if self.is_dead() {
            return 0;
        }
        let (asked, result) = self.server.serve_backlog(&mut self.link, cx, spare);
        if let Err(e) = result {
            self.internal_error(cx, e);
        }
        asked
    }

    pub(crate) fn serve(&mut self, cx: &mut Cx<'_>) {
        if self.is_dead() {
            return;
        }
        if let Err(e) = self.server.serve(&mut self.link, cx) {
            self.internal_error(cx, e);
        }
    }

    /// The request finished locally: both roles wind it down.
    pub(crate) fn finish_request(&mut self, cx: &mut Cx<'_>, id: &KvRequestId) {
        self.client.finish(&mut self.link, cx, id);
        self.server.finish(&mut self.link, cx, id);
    }

    /// The engine drains before a reset: every store this session holds that no write reads
    /// fails now (`server/drain.rs`); returns their jobs.
    pub(crate) fn fail_unwritten_stores(&mut self, cx: &mut Cx<'_>) -> Vec<JobId> {
        self.server.fail_unwritten_stores(&mut self.link, cx)
    }

    /// The engine drains before a reset: every load not aborting yet is aborted now (ends at
    /// its `abort_ack`); returns how many.
    pub(crate) fn abort_loads(&mut self, cx: &mut Cx<'_>) -> usize {
        if self.is_dead() {
            return 0;
        }
        self.client.abort_loads(&mut self.link, cx)
    }

    /// Inflight transfer ids (shutdown drain).
    pub(crate) fn inflight_ids(&self) -> Vec<TransferId> {
        self.server.inflight_ids()
    }

    /// Open state, for invariant checks: (client requests, server requests, store jobs,
    /// inflight transfers, queued messages).
    pub(crate) fn counts(&self) -> (usize, usize, usize, usize, usize) {
        let (requests, jobs, inflight) = self.server.counts();
        (
            self.client.entries(),
            requests,
            jobs,
            inflight,
            self.link.queued_len(),
        )
    }

    /// Whether the data plane's news may not reach it (its registration is settling, or a fault
    /// waits for its writes to drain): such a session is polled at every plane event.
    pub(crate) fn watches_plane(&self) -> bool {
        !self.is_dead()
            && (matches!(self.state, State::Registering { .. })
                || self.peer_fault_at.is_some()
                || self.server.peer_fault.is_some())
    }

    /// Whether inbound lookups wait for blocks being written (a `serve` would ask them again).
    pub(crate) fn wants_serve(&self) -> bool {
        !self.is_dead() && self.server.has_serve_list()
    }

    /// Whether probes wait to be sent (a `flush_lookups` would send them).
    pub(crate) fn wants_flush(&self) -> bool {
        !self.is_dead() && self.client.has_flush_list()
    }

    /// What the producer side holds for the peer: (keys, estimated bytes, pinned blocks).
    /// Releases up to `want` of this peer's oldest idle lookup pins (blocks released).
    pub(crate) fn evict_oldest_pins(&mut self, cx: &mut Cx<'_>, want: usize) -> usize {
        self.server.evict_oldest_pins(&mut self.link, cx, want)
    }

    pub(crate) fn shares(&self) -> (usize, usize, usize) {
        let (held, pinned) = self.server.shares();
        (held.keys, held.bytes, pinned)
    }

    /// Tears the session down, sending `disconnect` if it has not ended yet; `mode`: how its
    /// running writes are cancelled ([`ServerRole::close`]).
    pub(crate) fn close(&mut self, cx: &mut Cx<'_>, mode: crate::CancelMode) -> SessionClose {
        if !self.is_dead() {
            self.disconnect(cx.out, cx.now, CloseReason::Closed);
        }
        self.link.close();
        SessionClose {
            client: self.client.close(&self.link),
            server: self.server.close(cx, mode),
        }
    }
}

/// Why handling a message failed.
enum Fault {
    /// The peer broke the protocol: disconnect now.
    Protocol(ProtocolViolation),
    /// Something went wrong on our side: count it.
    Internal(InternalError),
}
