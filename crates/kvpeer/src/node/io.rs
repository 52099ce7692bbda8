//! One node's I/O loop: the glue between the sans-IO core and the real control channel.
//!
//! [`NodeIo::step`] does one round: inbound payloads and lost connections into the core, data-
//! plane progress, due deadlines, then the core's outputs out (messages first, then events:
//! dial, close, refuse; load results are kept for the caller until it takes them, store
//! results are dropped: the core has completed them already). The runtime thread calls it
//! after [`NodeIo::wait`], which sleeps until the channel is readable or the core's next
//! deadline. Owned by that one thread.
//!
//! Before the protocol sees anything, an inbound payload must pass the origin check (its
//! claimed identity against the connection's source address, and the allowlist: see
//! `node/origin.rs`); a `connect` must also name data addresses the node may connect to and,
//! with a secret, prove it. Nothing leaves for a peer outside the allowlist: not a dial, not
//! a queued message. Warnings a peer can cause are rate-limited.
//!
//! Fresh proofs: every inbound connection gets a random challenge in this node's READY, and a
//! `connect` that arrives is checked against the challenge of the connection it came on (the
//! data plane's `shm_token` via [`DataPlane::bind_challenge`], `kvpeer_auth` here). The other
//! way, this node's own `connect` to a peer waits (with everything queued behind it) until the
//! peer's READY told the challenge of our connection, and its proofs are made for that one
//! ([`NodeIo::flush`]): so nothing this node sends can be replayed to another connection or to
//! a later instance of the peer at the same address.

use std::collections::{HashMap, HashSet, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

use kvpeer_core::throttle::WarnThrottle;
use kvpeer_core::{warn_throttled, Core, DataPlane, Event, JobId, LinkLoss, LocalRefusal, Parent};

use crate::node::outcomes::{self, Outcomes};
use crate::node::peer_end::PeerEnd;
use kvpeer_net::control::ConnId;
use kvpeer_net::control::{ChannelEvent, ControlChannel, SendError};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_proto::{decode_with_limits, DecodeError, DecodeLimits, Message, PeerId};
use kvpeer_store::BlockStore;
use tracing::{debug, warn};

use super::allow::Allowlist;
use super::auth::{Auth, AuthError};
use super::origin::{LocalAddrs, OriginCheck, OriginError};
use super::plane::Plane;
use super::wake::WakePipe;

use super::decodes::{Decoded, Decodes, EXPENSIVE_PAYLOAD};

/// The node's time one step gives the large payloads in decoding (at least one slice): about
/// one round of the control channel's (`inbound_round_quantum_us`, 100 µs).
const DECODE_TIME_PER_STEP: Duration = Duration::from_micros(100);

/// The payloads in decoding and what waits behind them may hold together this many messages
/// of the largest size (`DecodeLimits::max_payload_bytes`, 16 MiB by default: 128 MiB), the
/// bound the control channel sets on partial messages.
const DECODE_HELD_MESSAGES: usize = 8;

/// The inbound connection an event of the channel's is about (none for a peer's loss).
fn event_conn(event: &ChannelEvent) -> Option<ConnId> {
    match event {
        ChannelEvent::Payload { conn, .. } | ChannelEvent::InboundClosed { conn, .. } => {
            Some(*conn)
        }
        ChannelEvent::Lost { .. } => None,
    }
}

/// Why a `connect` is refused before the protocol sees it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
enum ConnectRefused {
    /// It advertises a data address this node may not connect to.
    #[error(transparent)]
    DataAddress(#[from] OriginError),
    /// Authentication is on and it does not prove the secret for this node.
    #[error("authentication failed: {0}")]
    Auth(#[from] AuthError),
}

/// A core, its parent and plane, and its control channel. The parent is the node's own block
/// store, or an engine's (see [`crate::engine`]).
///
/// The low-level driver under [`Node`](crate::Node) and [`EngineNode`](crate::engine::EngineNode):
/// public for tests and tools that drive a core over real sockets themselves (reach the core
/// through [`NodeIo::core`]/[`NodeIo::core_mut`], take load results with
/// [`NodeIo::take_load_result`]); an application wants one of those two instead.
pub struct NodeIo<P: Parent = BlockStore> {
    /// The protocol core (with the store as its parent and the data plane). The crate's own
    /// drivers reach it directly; others through [`NodeIo::core`]/[`NodeIo::core_mut`].
    pub(crate) core: Core<P, Plane>,
    /// The ZeroMQ control channel.
    pub(crate) channel: ControlChannel,
    /// Results of loads (job → every block landed) not yet taken by the caller. Each load's
    /// caller takes its result once (the runtime keeps a load until it does), so this holds
    /// only loads that ended since the caller last looked.
    loads_done: HashMap<JobId, bool>,
    /// Loads that failed while their blocks stay reserved (the core's `LoadHeld`: their
    /// producer may still write them); each also ends in `loads_done` once fenced.
    loads_held: Vec<JobId>,
    /// What the core reported for the drivers that answer callers (lookups with new answers,
    /// ended sessions and stores), once one watches.
    outcomes: Outcomes,
    /// Why the latest sessions ended or connections were refused, newest last, at most
    /// [`NodeIo::CLOSED_KEPT`]: lets a caller waiting on a peer say why it is gone.
    closed: std::collections::VecDeque<(PeerId, PeerEnd)>,
    /// Woken by the data plane's completions.
    wake: Option<WakePipe>,
    /// Which peers this node talks to, judged by identity and source address.
    origin: OriginCheck,
    /// Refused peers lately seen (bounded: cleared when full), to count each once.
    refused: HashSet<PeerId>,
    /// Peers refused so far (each counted once while it stays in `refused`).
    refused_total: u64,
    /// Warnings a peer can cause, at most one per kind per second.
    throttle: WarnThrottle,
    /// The inbound connection that speaks for each peer with a session (the one its accepted
    /// `connect` came on). Several connections may claim one identity: messages from the others
    /// are dropped, except a `connect`, which takes the identity over (the newest wins, so a
    /// restarted peer is not locked out by its old connection, nor anyone by a squatter).
    bound: HashMap<PeerId, ConnId>,
    /// The authenticated handshake, when a secret is configured.
    auth: Option<Auth>,
    /// The same decoding bounds as the core's (used to read a `connect` before the core).
    limits: DecodeLimits,
    /// Messages for peers whose `connect` waits for the challenge of our connection to them
    /// (the `connect` first, then what the core sent after it, in order); released by
    /// [`NodeIo::release_held`] once the connection is ready, dropped when it is lost.
    held: HashMap<PeerId, Held>,
    /// Peers whose session ended while messages were held for them (a refusal's `disconnect`
    /// among them): their connection closes once those left, not before.
    close_after_held: HashSet<PeerId>,
    /// A peer whose session ends because it dialed again while our connection to it is still
    /// open: that connection stays for its next session (see [`NodeIo::take_over`]).
    keep_outbound: Option<PeerId>,
    /// Large payloads decoded a slice at a time, and what their connections sent after them.
    decodes: Decodes,
    /// Inbound connections the node closed while handling this round's events (their later
    /// events in the round are dropped).
    closed_this_round: HashSet<ConnId>,
}

/// What waits for one peer's challenge: since when, and the messages in order.
#[derive(Debug)]
struct Held {
    since: Instant,
    queue: VecDeque<Message>,
}

/// How long messages may wait for a peer's challenge: the control channel's handshake timeout
/// (a connection that never becomes ready, and is never reported lost either, e.g. one whose
/// name never resolves, gives its messages up then and is reported lost to the core).
const HELD_TIMEOUT: Duration = Duration::from_secs(30);

/// Messages held for one peer while its `connect` waits for the challenge, at most: the
/// control DEALER's own send queue (a peer that never finishes its handshake is lost at the
/// handshake timeout, and its held messages with it).
const MAX_HELD: usize = 1000;

impl<P: Parent> NodeIo<P> {
    /// How many session-end reasons the node keeps (for [`NodeIo::close_reason`]).
    const CLOSED_KEPT: usize = 16;

    /// Why the session with `peer` ended, if it ended lately (a refusal of what the peer sent
    /// after that, a stale message, says less, so it counts only when no session ended).
    pub fn close_reason(&self, peer: &PeerId) -> Option<&PeerEnd> {
        let latest = |refused: bool| {
            self.closed
                .iter()
                .rev()
                .find(|(p, end)| p == peer && matches!(end, PeerEnd::Refused(_)) == refused)
                .map(|(_, end)| end)
        };
        latest(false).or_else(|| latest(true))
    }

    /// The protocol core (with its parent and data plane).
    pub fn core(&self) -> &Core<P, Plane> {
        &self.core
    }

    /// The protocol core, to drive it: the caller then calls [`NodeIo::flush`] (or `step`) to
    /// carry out what it asked for.
    pub fn core_mut(&mut self) -> &mut Core<P, Plane> {
        &mut self.core
    }

    /// The control channel.
    pub fn channel(&self) -> &ControlChannel {
        &self.channel
    }

    /// Whether a load result is waiting to be taken (without taking it).
    pub fn load_done(&self, job: JobId) -> Option<bool> {
        self.loads_done.get(&job).copied()
    }

    /// How many load results are waiting to be taken.
    pub fn waiting_load_results(&self) -> usize {
        self.loads_done.len()
    }

    /// Wires a core to a channel bound at the core's own identity.
    pub(crate) fn new(
        core: Core<P, Plane>,
        channel: ControlChannel,
        wake: Option<WakePipe>,
    ) -> Self {
        NodeIo {
            core,
            channel,
            loads_done: HashMap::new(),
            loads_held: Vec::new(),
            outcomes: Outcomes::default(),
            closed: Default::default(),
            wake,
            origin: OriginCheck::default(),
            refused: HashSet::new(),
            refused_total: 0,
            throttle: WarnThrottle::default(),
            bound: HashMap::new(),
            auth: None,
            limits: DecodeLimits::default(),
            held: HashMap::new(),
            close_after_held: HashSet::new(),
            keep_outbound: None,
            decodes: Decodes::default(),
            closed_this_round: HashSet::new(),
        }
    }

    /// The decoding bounds (the core's are set separately, with `Core::set_decode_limits`).
    pub(crate) fn set_decode_limits(&mut self, limits: DecodeLimits) {
        self.limits = limits;
    }

    /// Requires and sends `kvpeer_auth` on every `connect` (see [`Auth`]).
    pub(crate) fn set_auth(&mut self, auth: Option<Auth>) {
        self.auth = auth;
    }

    /// An inbound payload on connection `conn` that passed the origin check. Decoded once
    /// here: a `connect` must name data addresses this node may connect to and, with
    /// authentication on, prove the secret for this node; then it binds the peer's session to
    /// its connection. Anything else is heard only from the bound connection. What does not
    /// decode goes to the core as it came (it classifies and answers bad payloads).
    fn inbound(
        &mut self,
        now: Instant,
        peer: &PeerId,
        conn: ConnId,
        source: IpAddr,
        decoded: Result<Message, DecodeError>,
    ) {
        let message = match decoded {
            Ok(message) => message,
            Err(e) => {
                if self.speaks_for(peer, conn) {
                    self.core.handle_undecodable(now, peer, e);
                }
                return;
            }
        };
        let Message::Connect(c) = &message else {
            if self.speaks_for(peer, conn) {
                self.core.handle_message(now, peer, message);
            } else {
                warn_throttled!(self.throttle, now, "dropping a message from a connection that holds no session",
                    %peer, conn);
            }
            return;
        };
        let challenge = self.channel.inbound_challenge(conn).map(<[u8]>::to_vec);
        if let Err(reason) = self.check_connect(peer, source, challenge.as_deref(), c) {
            self.refuse(now, peer, &reason, "connect");
            self.close_inbound(now, conn);
            return;
        }
        let session = self.core.session_state(peer);
        match self.bound.get(peer) {
            Some(&old) if old != conn && session.is_some() => {
                // A new connection's `connect` for a live session: the peer restarted, or its
                // old connection is half-dead. The newest wins.
                debug!(%peer, old, conn, "a newer connection takes the peer's identity over");
                self.take_over(now, peer);
                self.close_inbound(now, old);
            }
            None if session.is_some_and(|s| s.connected) => {
                // The session's own connection closed (the peer dropped it: vLLM's tier does
                // when its heartbeat expires, e.g. after a pause) while ours to it lived on,
                // and the peer dials again with a new `connect`: a new incarnation, not a
                // duplicate (answered as a protocol error, it would end the new session).
                debug!(%peer, conn, "a peer whose connection closed dials again");
                self.take_over(now, peer);
            }
            _ => {}
        }
        self.bind(peer, conn);
        // The plane checks the `connect`'s proofs against this connection's challenge.
        self.core
            .plane_mut()
            .bind_challenge(peer, challenge.as_deref());
        self.core.handle_message(now, peer, message);
    }

    /// Ends `peer`'s session before its new `connect` opens the next one. Our connection to it
    /// stays when it is still open: a peer that dialed again while alive (its ROUTER kept)
    /// would otherwise see our new connection claim the identity of the old one before its
    /// ROUTER dropped that, and libzmq ignores a connection with an identity in use. A peer
    /// that restarted closed it (its end of stream is seen here), so we dial afresh.
    fn take_over(&mut self, now: Instant, peer: &PeerId) {
        if self.channel.outbound_open(peer) {
            self.keep_outbound = Some(peer.clone());
        }
        self.core
            .handle_connection_lost(now, peer, LinkLoss::Replaced);
        self.flush(now);
        self.keep_outbound = None;
    }

    /// Binds `peer`'s session to inbound connection `conn` (and tells the channel, so a full
    /// listener evicts connections without a session first).
    fn bind(&mut self, peer: &PeerId, conn: ConnId) {
        if let Some(old) = self.bound.insert(peer.clone(), conn) {
            if old != conn {
                self.channel.set_holds_session(old, false);
            }
        }
        self.channel.set_holds_session(conn, true);
    }

    /// Forgets which connection speaks for `peer`.
    fn unbind(&mut self, peer: &PeerId) {
        if let Some(conn) = self.bound.remove(peer) {
            self.channel.set_holds_session(conn, false);
        }
    }

    /// Whether connection `conn` may speak for `peer`: it is the bound one, or none is bound and
    /// the peer has a session (its DEALER reconnected, so the session moves to this
    /// connection), or the peer has no session (the core answers what a stranger sends).
    fn speaks_for(&mut self, peer: &PeerId, conn: ConnId) -> bool {
        match self.bound.get(peer) {
            Some(&bound) => bound == conn,
            None => {
                if self.core.session_state(peer).is_some() {
                    self.bind(peer, conn);
                }
                true
            }
        }
    }

    /// Inbound connections open now (for stats and tests).
    pub fn inbound_connections(&self) -> usize {
        self.channel.inbound_connections()
    }

    /// Whether a `connect` from `peer` may open a session: its advertised tcp data address
    /// must be one this node may connect to, and with a secret it must be signed for us.
    fn check_connect(
        &mut self,
        peer: &PeerId,
        source: IpAddr,
        challenge: Option<&[u8]>,
        c: &kvpeer_proto::Connect,
    ) -> Result<(), ConnectRefused> {
        // Only kvpeer's plane map names addresses; NIXL's blob is NIXL's (docs/security.md).
        if let Ok(AgentMetadata {
            tcp: Some(addr), ..
        }) = AgentMetadata::decode(&c.agent_metadata)
        {
            self.origin.check_data_addr(peer, source, &addr)?;
        }
        if let Some(auth) = self.auth.as_mut() {
            let us = self.channel.identity().clone();
            auth.verify(&us, challenge.unwrap_or_default(), peer, c)?;
        }
        Ok(())
    }

    /// Which peers this node talks to: the allowlist (see [`Allowlist`]), and whether a
    /// claimed IP identity must come from that address (see [`OriginCheck`]).
    pub(crate) fn set_origin(&mut self, bind_identity: bool, allow: Allowlist) {
        self.origin = OriginCheck::new(bind_identity, allow, LocalAddrs::read());
    }

    /// Holds every peer to `tenants` too (a node with a tenant talks only to its tenant's peers
    /// and to shared nodes); call after [`NodeIo::set_origin`].
    pub(crate) fn set_tenants(&mut self, tenants: std::sync::Arc<super::tenants::TenantRules>) {
        self.origin.set_tenants(tenants);
    }

    /// The tenant rules in force, their names resolved where the node was built (`None`: no
    /// tenant configured).
    pub(crate) fn tenants(&self) -> Option<std::sync::Arc<super::tenants::TenantRules>> {
        self.origin.tenants()
    }

    /// Peers refused so far (allowlist, origin, authentication, data addresses).
    pub fn refused_peers(&self) -> usize {
        usize::try_from(self.refused_total).unwrap_or(usize::MAX)
    }

    /// Warnings suppressed by the rate limit so far.
    pub fn suppressed_warnings(&self) -> u64 {
        self.throttle.total_suppressed()
    }

    /// Counts a refusal (once per peer while remembered) and logs it, rate-limited.
    fn refuse(&mut self, now: Instant, peer: &PeerId, reason: &dyn std::fmt::Display, what: &str) {
        const REMEMBERED: usize = 4096;
        if self.refused.len() >= REMEMBERED {
            self.refused.clear();
        }
        if self.refused.insert(peer.clone()) {
            self.refused_total += 1;
        }
        warn_throttled!(self.throttle, now, "peer refused", %peer, %reason, what);
    }

    /// `Ok` if a payload claiming `peer` from `source` may reach the protocol, else why not
    /// (counted and logged).
    fn heard(&mut self, now: Instant, peer: &PeerId, source: IpAddr) -> Result<(), OriginError> {
        self.origin.check(peer, source).inspect_err(|reason| {
            self.refuse(now, peer, reason, "inbound message");
        })
    }

    /// `true` if this node may open a connection to `peer` (or send it anything).
    fn may_dial(&mut self, now: Instant, peer: &PeerId) -> bool {
        match self.origin.check_dial(peer) {
            Ok(()) => true,
            Err(reason) => {
                self.refuse(now, peer, &reason, "dial");
                false
            }
        }
    }

    /// Another handle on the wake pipe's write end: writing a byte wakes [`NodeIo::wait`].
    pub(crate) fn wake_writer(&self) -> Option<std::io::Result<std::fs::File>> {
        self.wake.as_ref().map(WakePipe::writer)
    }

    /// Takes the result of load `job` if it has ended: `Some(true)` when every block landed,
    /// `Some(false)` when it failed or was aborted. Other results stay.
    pub fn take_load_result(&mut self, job: JobId) -> Option<bool> {
        self.loads_done.remove(&job)
    }

    /// A graceful end: steps until the core's running writes drained (at most `drain`), then
    /// ends every session with a `disconnect` and lets the messages leave.
    pub(crate) fn shutdown(&mut self, drain: Duration) {
        let until = Instant::now() + drain;
        loop {
            let now = Instant::now();
            self.step(now);
            if self.core.shutdown_drain(now) || now >= until {
                break;
            }
            self.wait(now, until.saturating_duration_since(now));
        }
        let now = Instant::now();
        self.core.shutdown(now);
        self.flush(now);
        self.let_peers_read_the_disconnect();
    }

    /// After the `disconnect`s left: waits (at most the channel's linger) until the peers
    /// closed their connections to this node, each once it has read our `disconnect`. Closing
    /// ours first would let a peer see its connection drop in the same poll as the message and
    /// take the end for a loss (vLLM's transport sweeps a connection whose monitor reported it
    /// closed before its session reads what came on it). What arrives meanwhile is dropped.
    fn let_peers_read_the_disconnect(&mut self) {
        // Nothing more is handled: a connection paused for a large message is read again, so
        // its close is seen.
        for conn in self.decodes.forget_all() {
            self.channel.pause_inbound(conn, false);
        }
        let until = Instant::now() + self.channel.linger();
        while self.channel.inbound_connections() > 0 {
            let now = Instant::now();
            if now >= until {
                break;
            }
            if self.channel.wait(until - now).is_err() {
                break;
            }
            drop(self.channel.recv());
        }
    }

    /// What the request's producer said of each of `keys`, once none is still `Retry` (asked,
    /// not answered yet); `None` before that.
    pub(crate) fn lookup_answers(
        &mut self,
        now: Instant,
        request: &kvpeer_core::Request,
        keys: &[kvpeer_proto::OffloadKey],
    ) -> Option<Vec<kvpeer_core::LookupResult>> {
        let results: Vec<_> = keys
            .iter()
            .map(|k| self.core.lookup(now, request, k))
            .collect();
        (!results.contains(&kvpeer_core::LookupResult::Retry)).then_some(results)
    }

    /// Starts recording the core's outcomes for [`NodeIo::take_outcomes`] (a driver that
    /// answers callers calls it once, then takes them after every step).
    pub(crate) fn watch_outcomes(&mut self) {
        self.outcomes.watch();
    }

    /// The core's outcomes since the last call.
    pub(crate) fn take_outcomes(&mut self) -> outcomes::Taken {
        self.outcomes.take()
    }

    /// Loads known failed since the last call whose blocks stay reserved until their result
    /// (a failure) comes through [`NodeIo::take_load_results`], each once.
    pub fn take_held_loads(&mut self) -> Vec<JobId> {
        std::mem::take(&mut self.loads_held)
    }

    /// Every load result not yet taken (job, every block landed), each once.
    pub fn take_load_results(&mut self) -> Vec<(JobId, bool)> {
        self.loads_done.drain().collect()
    }

    /// One round of I/O at `now`: the channel's round of input, each message handled, then the
    /// core's deadlines and step of queued work, then its outputs carried out. Answers already
    /// made leave before a large message is handled and before the core's step, so an honest
    /// peer's answer never waits behind a flood's work of the same round.
    pub fn step(&mut self, now: Instant) {
        let events = self.channel.recv();
        if let Some(w) = &self.wake {
            // Emptied only when the poll said something was written (`recv` consulted it): a
            // read that finds nothing would be a system call on every wake.
            if self.channel.take_extra_ready() {
                w.drain();
            }
        }
        for event in events {
            if event_conn(&event).is_some_and(|conn| self.closed_this_round.contains(&conn)) {
                // The node closed its connection earlier in this round: what it delivered
                // with it is dropped, as the listener would have had it not been read yet.
                continue;
            }
            // What a connection sent after a payload still in decoding waits behind it.
            let bound = &self.bound;
            if let Some(event) = self.decodes.hold(event, |peer| bound.get(peer).copied()) {
                self.on_event(now, event);
            }
        }
        self.closed_this_round.clear();
        self.decode_slices(now);
        self.release_held(now);
        // Disk-tier reads that landed answer the lookups waiting on them (`Retry`) now, not
        // at the core's next re-poll; writes that ended unpin their blocks.
        if self.core.parent_mut().progress() {
            self.core.serve(now);
        }
        self.core.handle_data_plane(now);
        if self.core.poll_timeout().is_some_and(|t| t <= now) {
            if self.core.has_transmits() {
                // What this round's messages are answered with leaves before the core's step
                // of queued work (slices of large lookups).
                self.flush(now);
            }
            self.core.handle_timeout(now);
        }
        self.flush(now);
    }

    /// One event of the channel's, in the order its connection delivered it.
    fn on_event(&mut self, now: Instant, event: ChannelEvent) {
        match event {
            ChannelEvent::Payload {
                peer,
                conn,
                source,
                payload,
            } => {
                // What handling it costs this thread is charged to its connection: the channel
                // gives each connection about the same time per round.
                let started = Instant::now();
                match self.heard(now, &peer, source) {
                    Ok(()) if payload.len() >= EXPENSIVE_PAYLOAD => {
                        // Decoded a slice at a time between everyone else's work; the
                        // connection waits (paused) until it and what came after are handled.
                        if self.decodes.start(conn, peer, source, payload, self.limits) {
                            self.channel.pause_inbound(conn, true);
                        }
                        self.shed_decodes(now);
                    }
                    Ok(()) => {
                        let decoded = decode_with_limits(&payload, &self.limits);
                        self.inbound(now, &peer, conn, source, decoded);
                    }
                    // A claim its source cannot back: this connection is never heard.
                    // The peer is told why when that is its own mistake (an identity it
                    // cannot have from where it is), not what the allowlist holds.
                    Err(reason) if reason.tells_peer() => {
                        self.refuse_inbound(now, conn, &reason.to_string())
                    }
                    Err(_) => self.close_inbound(now, conn),
                }
                self.channel.charge_inbound(conn, started.elapsed());
            }
            ChannelEvent::InboundClosed {
                conn,
                peer: Some(peer),
            } => {
                if self.bound.get(&peer) == Some(&conn) {
                    self.bound.remove(&peer);
                }
            }
            ChannelEvent::InboundClosed { peer: None, .. } => {}
            ChannelEvent::Lost { peer, cause } => {
                // What waited for this connection's challenge goes with it.
                self.held.remove(&peer);
                self.close_after_held.remove(&peer);
                self.core.handle_connection_lost(now, &peer, cause)
            }
        }
    }

    /// Gives the large payloads in decoding about [`DECODE_TIME_PER_STEP`] of this thread (at
    /// least one slice), hosts in turn, each slice charged to its connection; a payload whose
    /// decoding ends is handled, and then what its connection sent after it, in order, up to
    /// its next large payload.
    fn decode_slices(&mut self, now: Instant) {
        if !self.decodes.is_empty() && self.core.has_transmits() {
            // Answers to this round's cheap messages (the round reads them first: an honest
            // consumer's lookup) leave before the decoding work, not after.
            self.flush(now);
        }
        let started = Instant::now();
        while let Some(conn) = self.decodes.next_turn() {
            let slice = Instant::now();
            let decoded = self.decodes.step(conn);
            let mut cost = slice.elapsed();
            if let Some(Decoded {
                conn,
                peer,
                source,
                result,
            }) = decoded
            {
                if self.core.has_transmits() {
                    // Others' answers leave first (not charged to this connection).
                    self.flush(now);
                }
                let handling = Instant::now();
                self.inbound(now, &peer, conn, source, result);
                cost += handling.elapsed();
                self.channel.charge_inbound(conn, cost);
                self.handle_held(now, conn);
            } else {
                self.channel.charge_inbound(conn, cost);
            }
            if started.elapsed() >= DECODE_TIME_PER_STEP {
                break;
            }
        }
        self.shed_decodes(now);
    }

    /// While the payloads in decoding and what waits behind them hold more than
    /// [`DECODE_HELD_MESSAGES`] messages of the largest size, the connection holding the most
    /// is refused and what it sent dropped (the listener's rule for partial messages, applied
    /// to delivered ones): many connections each sending a large message, or messages whose
    /// lists decode to many times their size, cannot make the node hold memory without bound.
    fn shed_decodes(&mut self, now: Instant) {
        let cap = self
            .limits
            .max_payload_bytes
            .saturating_mul(DECODE_HELD_MESSAGES);
        while let Some(conn) = self.decodes.over(cap) {
            warn_throttled!(self.throttle, now,
                "large messages in decoding hold too much; refusing the connection holding the most",
                conn, held_bytes = self.decodes.held_bytes(), cap);
            self.refuse_inbound(now, conn, "too much undecoded input held");
        }
    }

    /// Handles what connection `conn` sent after its payload just handled, in order, until a
    /// next large payload starts decoding; resumes the connection once nothing is left.
    fn handle_held(&mut self, now: Instant, conn: ConnId) {
        loop {
            match self.decodes.next_held(conn) {
                (Some(event), _) => self.on_event(now, event),
                (None, resume) => {
                    if resume {
                        self.channel.pause_inbound(conn, false);
                    }
                    return;
                }
            }
        }
    }

    /// Closes inbound connection `conn`; nothing it sent that waits here is handled (a loss
    /// of its peer held behind it still is).
    fn close_inbound(&mut self, now: Instant, conn: ConnId) {
        self.channel.close_inbound(conn);
        self.closed_here(now, conn);
    }

    /// Refuses inbound connection `conn` with `reason` (as [`NodeIo::close_inbound`]).
    fn refuse_inbound(&mut self, now: Instant, conn: ConnId, reason: &str) {
        self.channel.refuse_inbound(conn, reason);
        self.closed_here(now, conn);
    }

    /// The node closed inbound connection `conn` (the channel reports no close it was asked
    /// for): it speaks for no peer any more, what it sent that waits here or comes later in
    /// this round is dropped, and a loss of its peer held behind it is handled.
    fn closed_here(&mut self, now: Instant, conn: ConnId) {
        self.bound.retain(|_, bound| *bound != conn);
        self.closed_this_round.insert(conn);
        for event in self.decodes.forget(conn) {
            self.on_event(now, event);
        }
    }

    /// Inbound connections with a large payload in decoding (or messages held behind one).
    pub fn decoding_connections(&self) -> usize {
        self.decodes.connections()
    }

    /// Bytes the large payloads in decoding, what was decoded of them and the payloads held
    /// behind them take together (bounded: eight messages of the largest
    /// size, past which the connection holding the most is refused).
    pub fn decoding_held_bytes(&self) -> usize {
        self.decodes.held_bytes()
    }

    /// Carries out the core's outputs until it has none.
    pub fn flush(&mut self, now: Instant) {
        loop {
            let mut progressed = false;
            while let Some(t) = self.core.poll_transmit() {
                progressed = true;
                if !self.may_dial(now, &t.peer) {
                    // Never dialed, never sent to: its requests fall back at once.
                    self.core
                        .handle_connection_refused(now, &t.peer, LocalRefusal::NotAllowed);
                    continue;
                }
                if let Some(held) = self.held.get_mut(&t.peer) {
                    // Behind a `connect` that waits for its challenge: order is kept. A new
                    // session's `connect` among them means the connection is to stay open.
                    if matches!(t.message, Message::Connect(_)) {
                        self.close_after_held.remove(&t.peer);
                    }
                    if held.queue.len() < MAX_HELD {
                        held.queue.push_back(t.message);
                    } else {
                        warn_throttled!(self.throttle, now,
                            "the peer never finished its handshake; too many messages held",
                            peer = %t.peer, held = held.queue.len());
                        self.held.remove(&t.peer);
                        self.close_after_held.remove(&t.peer);
                        self.channel.close(&t.peer);
                        self.core
                            .handle_connection_lost(now, &t.peer, LinkLoss::NoHandshake);
                    }
                    continue;
                }
                if matches!(t.message, Message::Connect(_)) {
                    match self
                        .channel
                        .outbound_challenge(&t.peer)
                        .map(|c| c.map(<[u8]>::to_vec))
                    {
                        Some(challenge) => {
                            self.send_connect(now, &t.peer, t.message, challenge.as_deref());
                        }
                        None => {
                            // Its proofs are made for our connection's challenge: wait for
                            // the peer's READY (the connection opens now if it is not open).
                            if let Err(e) = self.channel.dial(&t.peer) {
                                warn_throttled!(self.throttle, now, "dial failed", peer = %t.peer, error = %e);
                                self.core.handle_connection_lost(
                                    now,
                                    &t.peer,
                                    LinkLoss::DialFailed(e),
                                );
                                continue;
                            }
                            self.held.insert(
                                t.peer,
                                Held {
                                    since: now,
                                    queue: VecDeque::from([t.message]),
                                },
                            );
                        }
                    }
                    continue;
                }
                self.send(now, &t.peer, &t.message);
            }
            while let Some(event) = self.core.poll_event() {
                progressed = true;
                match event {
                    Event::Dial(peer) => {
                        if !self.may_dial(now, &peer) {
                            // Never dialed: its requests fall back at once.
                            self.core.handle_connection_refused(
                                now,
                                &peer,
                                LocalRefusal::NotAllowed,
                            );
                        } else if let Err(e) = self.channel.dial(&peer) {
                            warn_throttled!(self.throttle, now, "dial failed", %peer, error = %e);
                            self.core
                                .handle_connection_lost(now, &peer, LinkLoss::DialFailed(e));
                        }
                    }
                    Event::Close { peer, end } => {
                        self.outcomes.session_ended(&peer);
                        self.closed_with(peer, PeerEnd::Session(end))
                    }
                    Event::Refused { peer, reason } => {
                        self.outcomes.session_ended(&peer);
                        self.closed_with(peer, PeerEnd::Refused(reason))
                    }
                    Event::LookupAnswered { kv_request_id } => {
                        self.outcomes.lookup_answered(kv_request_id);
                    }
                    Event::LoadDone {
                        job,
                        kv_request_id,
                        success,
                    } => {
                        if !success {
                            // The request's lookups answer MISS from now on.
                            self.outcomes.lookup_answered(kv_request_id);
                        }
                        self.loads_done.insert(job, success);
                    }
                    Event::LoadHeld { job, kv_request_id } => {
                        // The request's lookups answer MISS from now on.
                        self.outcomes.lookup_answered(kv_request_id);
                        self.loads_held.push(job);
                    }
                    Event::StoreDone { job, success } => {
                        // Already completed at the parent by the core.
                        debug!(job = job.get(), success, "store job done");
                        self.outcomes.store_done(job, success);
                    }
                }
            }
            if !progressed {
                return;
            }
        }
    }

    /// Makes the proofs of our `connect` to `peer` for the challenge its READY gave our
    /// connection (`None`: a ROUTER that gives none, such as a stock vLLM engine's), signs it
    /// when authentication is on, and sends it.
    fn send_connect(
        &mut self,
        now: Instant,
        peer: &PeerId,
        mut message: Message,
        challenge: Option<&[u8]>,
    ) -> bool {
        if let Message::Connect(c) = &mut message {
            c.agent_metadata =
                self.core
                    .plane_mut()
                    .connect_metadata(peer, challenge, &c.agent_metadata);
            if let Some(auth) = &self.auth {
                match auth.sign(peer, challenge.unwrap_or_default(), c) {
                    Ok(token) => c.kvpeer_auth = Some(token),
                    Err(e) => {
                        warn_throttled!(self.throttle, now, "cannot sign connect", %peer, error = %e)
                    }
                }
            }
        }
        self.send(now, peer, &message)
    }

    /// Encodes and sends one message; a failed send loses the peer's connection (`false`).
    fn send(&mut self, now: Instant, peer: &PeerId, message: &Message) -> bool {
        // Encoded straight into the connection's queue: an answer of 8,192 keys (300 KiB) is
        // not copied there from a buffer of its own. What it cost is not charged to the peer's
        // host: the honest consumer beside a spread flood is the heaviest host there, and
        // charged for its answers it waited behind the flood's (docs/benchmarks.md).
        let sent = self
            .channel
            .send_message(peer, message)
            .map_err(SendError::into_cause);
        if let Err(cause) = sent {
            warn_throttled!(self.throttle, now, "send failed", %peer, error = %cause);
            self.held.remove(peer);
            self.close_after_held.remove(peer);
            self.channel.close(peer);
            self.core.handle_connection_lost(now, peer, cause);
            return false;
        }
        true
    }

    /// Sends what waited for a challenge, for every peer whose connection is now ready: each
    /// `connect` (the first, and a later session's) with its proofs made for that connection,
    /// the rest as it came, in order. What waited longer than [`HELD_TIMEOUT`] for a connection
    /// that never became ready is dropped, the connection closed and reported lost.
    fn release_held(&mut self, now: Instant) {
        if self.held.is_empty() {
            return;
        }
        let mut ready = Vec::new();
        let mut expired = Vec::new();
        for (peer, held) in &self.held {
            match self.channel.outbound_challenge(peer) {
                Some(challenge) => ready.push((peer.clone(), challenge.map(<[u8]>::to_vec))),
                None if now.saturating_duration_since(held.since) >= HELD_TIMEOUT => {
                    expired.push(peer.clone())
                }
                None => {}
            }
        }
        for peer in expired {
            warn_throttled!(self.throttle, now, "no handshake with the peer in time; its messages dropped", %peer);
            self.held.remove(&peer);
            self.close_after_held.remove(&peer);
            self.channel.close(&peer);
            self.core
                .handle_connection_lost(now, &peer, LinkLoss::NoHandshake);
        }
        for (peer, challenge) in ready {
            let Some(held) = self.held.remove(&peer) else {
                continue;
            };
            for message in held.queue {
                let sent = match message {
                    Message::Connect(_) => {
                        self.send_connect(now, &peer, message, challenge.as_deref())
                    }
                    _ => self.send(now, &peer, &message),
                };
                if !sent {
                    break; // the connection is lost (the core was told)
                }
            }
            if self.close_after_held.remove(&peer) {
                // Its session ended meanwhile: what it was told lingers out, then it closes.
                self.channel.close(&peer);
            }
        }
    }

    fn closed_with(&mut self, peer: PeerId, end: PeerEnd) {
        if self.held.contains_key(&peer) {
            // Its `connect` (and what followed, a `disconnect` with a refusal) still waits for
            // the challenge: they leave first (or go with the connection when it is lost).
            self.close_after_held.insert(peer.clone());
        } else if self.keep_outbound.as_ref() != Some(&peer) {
            self.channel.close(&peer);
        }
        if self.core.session_state(&peer).is_none() {
            // No session (it ended, or none was opened): the next `connect` binds whichever
            // connection sends it, and a refused stranger leaves no entry behind.
            self.unbind(&peer);
        }
        if self.closed.len() == Self::CLOSED_KEPT {
            self.closed.pop_front();
        }
        self.closed.push_back((peer, end));
    }

    /// What [`NodeIo::wait`] sleeps on, for a thread that sleeps outside the node's owner (an
    /// engine's I/O thread): the control channel's epoll set (readable when a socket, the data
    /// plane or a caller has news; the wake pipe is in it from the first `wait`) and the
    /// nearest of the channel's and the core's deadlines. It arms the wake pipe (hooks write
    /// from then on), so call it right before each sleep; `now` as the deadline means a hook
    /// ran while the thread was awake: step before sleeping.
    pub fn wait_plan(&mut self, now: Instant) -> (std::os::fd::RawFd, Option<Instant>) {
        let (fd, channel) = self.channel.wait_plan(now);
        if !self.decodes.is_empty() {
            // A payload in decoding has its next slice in the next step.
            return (fd, Some(now));
        }
        if self.wake.as_ref().is_some_and(WakePipe::prepare_sleep) {
            // A plane or the parent had news while this thread was awake: step at once.
            return (fd, Some(now));
        }
        let deadline = [channel, self.core.poll_timeout()]
            .into_iter()
            .flatten()
            .min();
        (fd, deadline)
    }

    /// Sleeps until the channel may have input, the data plane completes something, the core's
    /// next deadline, or `max`.
    pub fn wait(&mut self, now: Instant, max: Duration) {
        let until_deadline = self
            .core
            .poll_timeout()
            .map_or(max, |t| t.saturating_duration_since(now).min(max));
        let fd = self.wake.as_ref().map(WakePipe::fd);
        // News while this thread was awake (an inline copy's completion): only a look at the
        // sockets, no sleep.
        let news = self.wake.as_ref().is_some_and(WakePipe::prepare_sleep);
        // A payload in decoding has its next slice in the next step: only a look at the sockets.
        let timeout = if news || !self.decodes.is_empty() {
            Duration::ZERO
        } else {
            until_deadline
        };
        if let Err(e) = self.channel.wait_with(timeout, fd) {
            if let Some(suppressed) = crate::admit_warning("control channel wait failed") {
                warn!(error = %e, suppressed, "control channel wait failed");
            }
        }
        if let Some(w) = &self.wake {
            w.awake();
        }
    }
}
