//! Following one engine's KV event stream: a SUB (connecting to the engine's bound PUB, or
//! bound for the PUB the engine connects) and, when the engine has one, a DEALER to its replay
//! ROUTER.
//!
//! * The SUB subscribes to its topic prefix once each connection's handshake is done (the
//!   ZMTP 3.0 message `0x01 · prefix`, which libzmq 4.3's PUB takes from ZMTP 3.0 and 3.1 peers
//!   alike), and yields each live `[topic, seq, payload]` whose topic the prefix matches as
//!   [`SubEvent::Live`] (the PUB filters too: libzmq's SUB also checks what it receives).
//!   Every handshake is [`SubEvent::Connected`] (the caller asks for a replay: what was
//!   published meanwhile is only in the engine's buffer), every end of a connected one
//!   [`SubEvent::Lost`]. A connecting SUB reconnects with backoff; a bound one accepts up to
//!   `max_publishers` PUB connections at once (an engine restarting while its old connection
//!   is still open), all feeding the same stream, and with `allowed_publishers` only from those
//!   addresses (the engine's host): a connection from any other is closed at its accept, sent
//!   nothing, so no one else can feed the stream batches or sequence numbers.
//! * [`EventSubscriber::request_replay`] sends `["", from]` on the DEALER (at once when it is
//!   connected, else when it is); the ROUTER's answers come as [`SubEvent::Replayed`] then
//!   [`SubEvent::ReplayEnd`]. A request whose answer was cut by a lost connection is sent
//!   again on the next one, from the batch after the last replayed.
//! * Messages of another shape are dropped and counted ([`SubscriberStats::malformed`]).
//!
//! Bounds: incoming messages under `conn.max_message_bytes` (checked from each frame header);
//! events not yet taken at most `max_pending_events` (past that, sockets are not read, and the
//! engine's PUB drops for us, as libzmq's does for a slow subscriber); replay requests waiting
//! at most `max_replay_requests`.
//!
//! Owned by the pool node's thread: [`EventSubscriber::wait`] or [`super::wait_all`] drives it,
//! [`EventSubscriber::poll_event`] takes what came; nothing blocks.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};

use std::os::fd::BorrowedFd;

use tracing::{debug, warn};

use super::client::{Client, LinkEvent};
use super::wire::{self, ReplayAnswer};
use super::{EventIo, EventsError};
use crate::io::poller::{Poller, Ready, Token};
use crate::zmtp;
use crate::zmtp::connection::{ConnLimits, Incoming, Role};
use crate::zmtp::listener::{Listener as Server, ListenerLimits as ServerLimits};

/// Where the engine's PUB is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubEndpoint {
    /// The engine binds its PUB here (`endpoint = "tcp://*:P"`): connect.
    Connect(SocketAddr),
    /// The engine connects its PUB here (`endpoint = "tcp://host:P"`): bind and accept.
    Bind(SocketAddr),
}

/// Settings of one subscriber.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubscriberConfig {
    /// The engine's PUB.
    pub endpoint: SubEndpoint,
    /// The engine's replay ROUTER (`replay_endpoint`), if it has one.
    pub replay: Option<SocketAddr>,
    /// The topic prefix subscribed to (vLLM's default topic is empty).
    pub topic: Vec<u8>,
    /// Each connection's protocol limits.
    pub conn: ConnLimits,
    /// The first wait before reconnecting, doubled after each failure up to `reconnect_max`.
    pub reconnect_interval: Duration,
    /// The longest wait before reconnecting.
    pub reconnect_max: Duration,
    /// Events held until taken; past it, the sockets are not read.
    pub max_pending_events: usize,
    /// PUB connections a bound SUB accepts at once (and from one source address).
    pub max_publishers: usize,
    /// The only source addresses a bound SUB accepts PUB connections from (`None`: any).
    pub allowed_publishers: Option<Vec<IpAddr>>,
    /// Replay requests waiting for their answer; one more is dropped and counted.
    pub max_replay_requests: usize,
}

impl SubscriberConfig {
    /// A subscriber of `endpoint` with no replay socket, subscribed to every topic, with the
    /// defaults: messages up to 16 MiB + 64 KiB (a batch under the event decoder's limit and
    /// its frames), heartbeats 2 s / 10 s / TTL 10 s, handshake 30 s, reconnect 100 ms doubling
    /// up to 5 s, 4096 events pending, 8 publishers, 16 replay requests.
    pub fn new(endpoint: SubEndpoint) -> Self {
        SubscriberConfig {
            endpoint,
            replay: None,
            topic: Vec::new(),
            conn: ConnLimits {
                max_message_bytes: (16 << 20) + (64 << 10),
                heartbeat_interval: Duration::from_secs(2),
                heartbeat_timeout: Duration::from_secs(10),
                heartbeat_ttl: Duration::from_secs(10),
                handshake_timeout: Duration::from_secs(30),
                send_queue: 64,
                send_queue_bytes: 64 << 10,
                // Batches are taken as they come; `max_pending_events` stops the reading.
                max_incoming: usize::MAX,
            },
            reconnect_interval: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(5),
            max_pending_events: 4096,
            max_publishers: 8,
            allowed_publishers: None,
            max_replay_requests: 16,
        }
    }
}

/// What the stream brought.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubEvent {
    /// A SUB connection's handshake is done and its subscription sent: ask for a replay from
    /// the next batch needed.
    Connected,
    /// A live batch.
    Live {
        /// Its sequence number.
        seq: u64,
        /// The `KVEventBatch` (msgpack).
        payload: Vec<u8>,
    },
    /// A batch the replay socket sent.
    Replayed {
        /// Its sequence number.
        seq: u64,
        /// The `KVEventBatch` (msgpack).
        payload: Vec<u8>,
    },
    /// The end of a replay's answer.
    ReplayEnd,
    /// A connected SUB connection ended.
    Lost {
        /// Why.
        reason: kvpeer_core::LinkLoss,
    },
}

/// Counts of what happened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubscriberStats {
    /// Live batches yielded.
    pub live: u64,
    /// Replayed batches yielded.
    pub replayed: u64,
    /// Replay ends yielded.
    pub replay_ends: u64,
    /// Messages of another shape, dropped.
    pub malformed: u64,
    /// Live messages of a topic the prefix does not match, dropped.
    pub filtered: u64,
    /// SUB handshakes done.
    pub connects: u64,
    /// Connected SUB connections lost.
    pub losses: u64,
    /// Connections (SUB or replay) that failed before their handshake was done.
    pub failed_attempts: u64,
    /// Replay requests taken.
    pub replay_requests: u64,
    /// Replay requests dropped (too many waiting, or no replay socket).
    pub replay_requests_dropped: u64,
    /// PUB connections a bound SUB closed at their accept: their source is not allowed.
    pub refused_publishers: u64,
}

enum SubSide {
    Connect(Box<Client>),
    Bind(Box<Server>),
}

/// Tokens of the subscriber's poll: the connecting SUB, the replay DEALER, a bound SUB's
/// listener (its connections after it).
const SUB: Token = 1;
const REPLAY: Token = 2;
const BOUND: Token = 1 << 32;

/// One engine's KV event stream, followed.
pub struct EventSubscriber {
    poller: Poller,
    ready: Vec<Ready>,
    config: SubscriberConfig,
    sub: SubSide,
    replay: Option<Client>,
    /// Replay requests sent or to send, oldest first: the next `seq` each still needs.
    outstanding: VecDeque<u64>,
    events: VecDeque<SubEvent>,
    stats: SubscriberStats,
}

impl std::fmt::Debug for EventSubscriber {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSubscriber")
            .field("endpoint", &self.config.endpoint)
            .field("replay", &self.config.replay)
            .field("stats", &self.stats)
            .finish()
    }
}

impl EventSubscriber {
    /// A subscriber per `config`: a bound SUB listens at once; connections are made by the
    /// first wait.
    pub fn new(config: SubscriberConfig) -> Result<Self, EventsError> {
        let now = Instant::now();
        let poller = Poller::new().map_err(EventsError::Wait)?;
        let backoff = (config.reconnect_interval, config.reconnect_max);
        let sub = match config.endpoint {
            SubEndpoint::Connect(addr) => SubSide::Connect(Box::new(Client::new(
                addr,
                SUB,
                Role::sub(),
                config.conn.clone(),
                backoff,
                now,
            ))),
            SubEndpoint::Bind(addr) => {
                let limits = ServerLimits {
                    allowed_sources: config.allowed_publishers.clone(),
                    ..ServerLimits::event_stream(
                        config.conn.clone(),
                        config.max_publishers,
                        config.max_publishers,
                        config.conn.heartbeat_timeout,
                    )
                };
                let server =
                    Server::bind(addr, Role::sub(), limits, &poller, BOUND).map_err(|source| {
                        EventsError::Bind {
                            what: "SUB",
                            addr,
                            source,
                        }
                    })?;
                SubSide::Bind(Box::new(server))
            }
        };
        let replay = config.replay.map(|addr| {
            Client::new(
                addr,
                REPLAY,
                Role::dealer(),
                config.conn.clone(),
                backoff,
                now,
            )
        });
        Ok(EventSubscriber {
            poller,
            ready: Vec::new(),
            config,
            sub,
            replay,
            outstanding: VecDeque::new(),
            events: VecDeque::new(),
            stats: SubscriberStats::default(),
        })
    }

    /// Where a bound SUB listens.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        match &self.sub {
            SubSide::Bind(server) => server.local_addr().ok(),
            SubSide::Connect(_) => None,
        }
    }

    /// Whether a SUB connection's handshake is done.
    pub fn is_connected(&self) -> bool {
        match &self.sub {
            SubSide::Connect(client) => client.is_ready(),
            SubSide::Bind(server) => server
                .ids()
                .any(|id| server.connection(id).is_some_and(|c| c.is_ready())),
        }
    }

    /// Whether the replay DEALER's handshake is done.
    pub fn replay_connected(&self) -> bool {
        self.replay.as_ref().is_some_and(Client::is_ready)
    }

    /// What happened so far.
    pub fn stats(&self) -> SubscriberStats {
        let refused_publishers = match &self.sub {
            SubSide::Bind(server) => server.refused_sources(),
            SubSide::Connect(_) => 0,
        };
        SubscriberStats {
            refused_publishers,
            ..self.stats
        }
    }

    /// Asks the engine's replay socket for every batch from `from` on. Never blocks: sent at
    /// once when the DEALER is connected, else once it is.
    pub fn request_replay(&mut self, from: u64) {
        let Some(replay) = &mut self.replay else {
            self.stats.replay_requests_dropped += 1;
            debug!("a replay asked of an engine without a replay socket: dropped");
            return;
        };
        if self.outstanding.len() >= self.config.max_replay_requests {
            self.stats.replay_requests_dropped += 1;
            if let Some(suppressed) = crate::admit_warning("replay request dropped") {
                warn!(
                    from,
                    waiting = self.outstanding.len(),
                    suppressed,
                    "too many replay requests waiting: dropping this one"
                );
            }
            return;
        }
        self.stats.replay_requests += 1;
        self.outstanding.push_back(from);
        if replay.is_ready() {
            send_request(replay, from);
        }
    }

    /// The next thing that happened, in order.
    pub fn poll_event(&mut self) -> Option<SubEvent> {
        self.events.pop_front()
    }

    /// Sleeps until something may have happened (or `timeout`), then drives the sockets; take
    /// what came with [`EventSubscriber::poll_event`]. Returns at once while events wait.
    pub fn wait(&mut self, timeout: Duration) -> Result<bool, EventsError> {
        super::wait_all(&mut [self], timeout, None)
    }

    fn reading(&self) -> bool {
        self.events.len() < self.config.max_pending_events
    }

    /// What a SUB connection (`peer` on a bound SUB) did.
    fn on_sub(&mut self, peer: Option<u64>, event: LinkEvent, now: Instant) {
        match event {
            LinkEvent::Ready { .. } => {
                let subscription = zmtp::subscription(&self.config.topic, true);
                match (&mut self.sub, peer) {
                    (SubSide::Connect(client), _) => {
                        let _ = client.send(&[&subscription]);
                    }
                    (SubSide::Bind(server), Some(id)) => {
                        let _ = server.queue(now, id, &[&subscription]);
                        server.flush(now, id);
                    }
                    (SubSide::Bind(_), None) => {}
                }
                self.stats.connects += 1;
                self.events.push_back(SubEvent::Connected);
            }
            LinkEvent::Incoming(Incoming::Message(frames)) => match wire::parse_live(frames) {
                Ok(batch) if batch.topic.starts_with(&self.config.topic) => {
                    self.stats.live += 1;
                    self.events.push_back(SubEvent::Live {
                        seq: batch.seq,
                        payload: batch.payload,
                    });
                }
                Ok(_) => self.stats.filtered += 1,
                Err(e) => self.malformed("live", &e),
            },
            // A PUB sends no subscriptions.
            LinkEvent::Incoming(Incoming::Subscribe(_) | Incoming::Cancel(_)) => {}
            LinkEvent::Lost { reason, was_ready } => {
                if was_ready {
                    self.stats.losses += 1;
                    self.events.push_back(SubEvent::Lost { reason });
                } else {
                    self.stats.failed_attempts += 1;
                }
            }
        }
    }

    /// What the replay DEALER did.
    fn on_replay(&mut self, event: LinkEvent) {
        match event {
            LinkEvent::Ready { .. } => {
                if let Some(replay) = &mut self.replay {
                    for from in &self.outstanding {
                        send_request(replay, *from);
                    }
                }
            }
            LinkEvent::Incoming(Incoming::Message(frames)) => {
                match wire::parse_replay_answer(frames) {
                    Ok(ReplayAnswer::Batch(batch)) => {
                        if let Some(next) = self.outstanding.front_mut() {
                            *next = batch.seq.saturating_add(1);
                        }
                        self.stats.replayed += 1;
                        self.events.push_back(SubEvent::Replayed {
                            seq: batch.seq,
                            payload: batch.payload,
                        });
                    }
                    Ok(ReplayAnswer::End) => {
                        self.outstanding.pop_front();
                        self.stats.replay_ends += 1;
                        self.events.push_back(SubEvent::ReplayEnd);
                    }
                    Err(e) => self.malformed("replay", &e),
                }
            }
            LinkEvent::Incoming(Incoming::Subscribe(_) | Incoming::Cancel(_)) => {}
            LinkEvent::Lost { was_ready, .. } => {
                if !was_ready {
                    self.stats.failed_attempts += 1;
                }
            }
        }
    }

    fn malformed(&mut self, what: &str, e: &wire::ShapeError) {
        self.stats.malformed += 1;
        if let Some(suppressed) = crate::admit_warning("malformed KV event message") {
            warn!(what, error = %e, suppressed, "dropping a KV event stream message");
        }
    }
}

/// Sends the request for everything from `from` on `replay` (its queue holds far more than
/// the requests a subscriber keeps waiting).
fn send_request(replay: &mut Client, from: u64) {
    let [delimiter, seq] = wire::replay_request(from);
    if replay.send(&[&delimiter, &seq]).is_err() {
        debug!(
            from,
            "replay request not queued; sent again on the next connection"
        );
    }
}

impl EventIo for EventSubscriber {
    fn poll_fd(&self) -> BorrowedFd<'_> {
        self.poller.fd()
    }

    fn next_deadline(&mut self, now: Instant) -> Option<Instant> {
        if !self.events.is_empty() {
            return Some(now);
        }
        let read = self.reading();
        let sub = match &mut self.sub {
            SubSide::Connect(client) => client.deadline(now, read),
            SubSide::Bind(server) => server.deadline(now, read),
        };
        let replay = self.replay.as_ref().and_then(|r| r.deadline(now, read));
        sub.into_iter().chain(replay).min()
    }

    fn progress(&mut self, now: Instant, polled: bool) {
        if polled {
            self.ready.clear();
            if let Err(e) = self.poller.wait(Duration::ZERO, &mut self.ready) {
                debug!(error = %e, "cannot take the KV event sockets' news");
            }
            for r in std::mem::take(&mut self.ready) {
                match (&mut self.sub, r.token) {
                    (SubSide::Connect(client), SUB) => client.on_ready(r),
                    (_, REPLAY) => {
                        if let Some(replay) = &mut self.replay {
                            replay.on_ready(r);
                        }
                    }
                    (SubSide::Bind(server), t) if t >= BOUND => server.on_ready(r),
                    _ => {}
                }
            }
        }
        let read = self.reading();
        match &mut self.sub {
            SubSide::Connect(client) => {
                let mut out = Vec::new();
                client.progress(&self.poller, now, read, &mut out);
                for event in out {
                    self.on_sub(None, event, now);
                }
            }
            SubSide::Bind(server) => {
                let mut out = Vec::new();
                server.progress(&self.poller, now, read, &[], &mut out);
                for (id, event) in out {
                    self.on_sub(Some(id), event, now);
                }
            }
        }
        if let Some(replay) = &mut self.replay {
            let mut out = Vec::new();
            replay.progress(&self.poller, now, read, &mut out);
            for event in out {
                self.on_replay(event);
            }
        }
    }
}
