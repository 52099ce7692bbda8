//! One node's I/O loop: the glue between the sans-IO core and the real control channel.
//!
//! [`NodeIo::step`] does one round: inbound payloads and lost connections into the core, data-
//! plane progress, due deadlines, then the core's outputs out (messages first, then events:
//! dial, close, refuse; load and store results are kept for the caller). The runtime thread
//! calls it after [`NodeIo::wait`], which sleeps until the channel is readable or the core's
//! next deadline. Owned by that one thread.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use kvpeer_core::{Core, DataPlane, Event};
use kvpeer_net::control::{ChannelEvent, ControlChannel};
use kvpeer_proto::{decode_with_limits, DecodeLimits, Message, PeerId};
use kvpeer_store::BlockStore;
use tracing::warn;

use super::allow::Allowlist;
use super::auth::Auth;
use super::wake::WakePipe;

/// A core, its store and plane, and its control channel.
pub struct NodeIo<D: DataPlane> {
    /// The protocol core (with the store as its parent and the data plane).
    pub core: Core<BlockStore, D>,
    /// The ZeroMQ control channel.
    pub channel: ControlChannel,
    /// Load and store results not yet taken by the caller.
    pub results: Vec<Event>,
    /// Why the latest sessions ended or connections were refused (peer, refused?, reason),
    /// newest last, at most [`NodeIo::CLOSED_KEPT`]: lets a caller waiting on a peer say why
    /// it is gone.
    pub closed: std::collections::VecDeque<(PeerId, bool, String)>,
    /// Woken by the data plane's completions.
    wake: Option<WakePipe>,
    /// Which peers this node talks to.
    allow: Allowlist,
    /// Refused peers already logged (each is logged once).
    refused: HashSet<PeerId>,
    /// The authenticated handshake, when a secret is configured.
    auth: Option<Auth>,
    /// The same decoding bounds as the core's (used to read a `connect` before the core).
    limits: DecodeLimits,
}

impl<D: DataPlane> NodeIo<D> {
    /// How many session-end reasons [`NodeIo::closed`] keeps.
    pub const CLOSED_KEPT: usize = 16;

    /// Why the session with `peer` ended, if it ended lately (a refusal of what the peer sent
    /// after that, a stale message, says less, so it counts only when no session ended).
    pub fn close_reason(&self, peer: &PeerId) -> Option<&str> {
        let latest = |refused: bool| {
            self.closed
                .iter()
                .rev()
                .find(|(p, r, _)| p == peer && *r == refused)
                .map(|(_, _, reason)| reason.as_str())
        };
        latest(false).or_else(|| latest(true))
    }

    /// Wires a core to a channel bound at the core's own identity.
    pub fn new(core: Core<BlockStore, D>, channel: ControlChannel, wake: Option<WakePipe>) -> Self {
        NodeIo {
            core,
            channel,
            results: Vec::new(),
            closed: Default::default(),
            wake,
            allow: Allowlist::default(),
            refused: HashSet::new(),
            auth: None,
            limits: DecodeLimits::default(),
        }
    }

    /// The decoding bounds (the core's are set separately, with `Core::set_decode_limits`).
    pub fn set_decode_limits(&mut self, limits: DecodeLimits) {
        self.limits = limits;
    }

    /// Requires and sends `kvpeer_auth` on every `connect` (see [`Auth`]).
    pub fn set_auth(&mut self, auth: Option<Auth>) {
        self.auth = auth;
    }

    /// An inbound payload: with authentication on, a `connect` must prove the secret before
    /// the core sees it; everything else goes to the core as it came.
    fn inbound(&mut self, now: Instant, peer: &PeerId, payload: &[u8]) {
        let Some(auth) = self.auth.as_mut() else {
            self.core.handle_payload(now, peer, payload);
            return;
        };
        match decode_with_limits(payload, &self.limits) {
            Ok(Message::Connect(c)) => match auth.verify(&c) {
                Ok(()) => self.core.handle_message(now, peer, Message::Connect(c)),
                Err(reason) => {
                    if self.refused.insert(peer.clone()) {
                        warn!(%peer, %reason, "peer refused: authentication failed");
                    }
                    self.channel.close(peer);
                }
            },
            Ok(message) => self.core.handle_message(now, peer, message),
            Err(_) => self.core.handle_payload(now, peer, payload),
        }
    }

    /// Restricts the peers this node talks to (see [`Allowlist`]).
    pub fn set_allowlist(&mut self, allow: Allowlist) {
        self.allow = allow;
    }

    /// Peers refused by the allowlist so far.
    pub fn refused_peers(&self) -> usize {
        self.refused.len()
    }

    /// `true` if `peer` may be talked to; logs a refusal once per peer.
    fn allowed(&mut self, peer: &PeerId, what: &str) -> bool {
        match self.allow.check(peer) {
            Ok(()) => true,
            Err(reason) => {
                if self.refused.insert(peer.clone()) {
                    warn!(%peer, %reason, what, "peer refused");
                }
                false
            }
        }
    }

    /// Another handle on the wake pipe's write end: writing a byte wakes [`NodeIo::wait`].
    pub fn wake_writer(&self) -> Option<std::io::Result<std::fs::File>> {
        self.wake.as_ref().map(WakePipe::writer)
    }

    /// Takes the result of load `job` if it has ended: `Some(true)` when every block landed,
    /// `Some(false)` when it failed or was aborted. Other results stay.
    pub fn take_load_result(&mut self, job: kvpeer_core::JobId) -> Option<bool> {
        let at = self
            .results
            .iter()
            .position(|e| matches!(e, Event::LoadDone { job: j, .. } if *j == job))?;
        match self.results.remove(at) {
            Event::LoadDone { success, .. } => Some(success),
            _ => None,
        }
    }

    /// One round of I/O at `now`.
    pub fn step(&mut self, now: Instant) {
        if let Some(w) = &self.wake {
            w.drain();
        }
        for event in self.channel.recv() {
            match event {
                ChannelEvent::Payload { peer, payload } => {
                    if self.allowed(&peer, "inbound message") {
                        self.inbound(now, &peer, &payload)
                    }
                }
                ChannelEvent::Lost { peer, .. } => self.core.handle_connection_lost(now, &peer),
            }
        }
        self.core.handle_data_plane(now);
        if self.core.poll_timeout().is_some_and(|t| t <= now) {
            self.core.handle_timeout(now);
        }
        self.flush(now);
    }

    /// Carries out the core's outputs until it has none.
    pub fn flush(&mut self, now: Instant) {
        loop {
            let mut progressed = false;
            while let Some(mut t) = self.core.poll_transmit() {
                progressed = true;
                if let (Some(auth), Message::Connect(c)) = (&self.auth, &mut t.message) {
                    match auth.sign(c) {
                        Ok(token) => c.kvpeer_auth = Some(token),
                        Err(e) => warn!(peer = %t.peer, error = %e, "cannot sign connect"),
                    }
                }
                let sent = match t.message.encode() {
                    Ok(payload) => self
                        .channel
                        .send(&t.peer, &payload)
                        .map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = sent {
                    warn!(peer = %t.peer, error = %e, "send failed");
                    self.core.handle_connection_lost(now, &t.peer);
                }
            }
            while let Some(event) = self.core.poll_event() {
                progressed = true;
                match event {
                    Event::Dial(peer) => {
                        if !self.allowed(&peer, "dial") {
                            // Never dialed: its requests fall back at once.
                            self.core.handle_connection_lost(now, &peer);
                        } else if let Err(e) = self.channel.dial(&peer) {
                            warn!(%peer, error = %e, "dial failed");
                            self.core.handle_connection_lost(now, &peer);
                        }
                    }
                    Event::Close { peer, reason } => self.closed_with(peer, false, reason),
                    Event::Refused { peer, reason } => self.closed_with(peer, true, reason),
                    result => self.results.push(result),
                }
            }
            if !progressed {
                return;
            }
        }
    }

    fn closed_with(&mut self, peer: PeerId, refused: bool, reason: String) {
        self.channel.close(&peer);
        if self.closed.len() == Self::CLOSED_KEPT {
            self.closed.pop_front();
        }
        self.closed.push_back((peer, refused, reason));
    }

    /// Sleeps until the channel may have input, the data plane completes something, the core's
    /// next deadline, or `max`.
    pub fn wait(&self, now: Instant, max: Duration) {
        let until_deadline = self
            .core
            .poll_timeout()
            .map_or(max, |t| t.saturating_duration_since(now).min(max));
        let fd = self.wake.as_ref().map(WakePipe::fd);
        if let Err(e) = self.channel.wait_with(until_deadline, fd) {
            warn!(error = %e, "control channel wait failed");
        }
    }
}
