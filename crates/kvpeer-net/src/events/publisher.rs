//! The pool's own KV event stream, served as vLLM's `ZmqEventPublisher` serves an engine's: a
//! PUB listener and, optionally, a replay ROUTER listener.
//!
//! * PUB: accepts SUB (and XSUB) connections (READY `Socket-Type: PUB`), takes their
//!   subscriptions in both forms libzmq sends (the ZMTP 3.1 SUBSCRIBE and CANCEL commands, and
//!   the ZMTP 3.0 messages `0x01 · prefix` and `0x00 · prefix`; each SUBSCRIBE of a prefix is
//!   undone by one CANCEL), and [`EventPublisher::publish`] queues each multipart message to
//!   every connection with a subscription prefixing its first frame, writing at once where the
//!   socket takes it. A connection whose queue is full (`subscriber.send_queue` messages or
//!   `subscriber.send_queue_bytes` bytes unwritten) misses the message: dropped and counted,
//!   libzmq's `SNDHWM` for a PUB. Publishing never blocks and never grows a queue past that.
//! * Replay ROUTER: accepts DEALER (REQ, ROUTER) connections and takes requests
//!   `["", start_seq (8 bytes BE)]`; a message of another shape is dropped and counted, and so
//!   is a request past the `max_pending_requests` a connection may have waiting.
//!   [`EventPublisher::serve_replays`] answers the waiting requests, in order per connection,
//!   with the messages the caller's function gives for each `start_seq`
//!   (`kvpeer_pool::Publisher::replay`: the kept batches, then the end marker), each sent with
//!   the empty delimiter in front: `["", topic, seq, payload]` … `["", "", -1, ""]`. At most
//!   `max_answers` answers are in progress at once; an answer enters its connection's queue
//!   as the socket takes the previous messages.
//!
//! Bounds: connections capped in all and per source address on each listener; subscriptions
//! per connection at most `max_subscriptions` (one more closes the connection); incoming
//! messages under each listener's `max_message_bytes`; a connection that takes none of our
//! bytes for `stall_timeout` while some wait, or answers no heartbeat, is closed. Memory:
//! each subscriber's queue, plus the answers in progress (`max_answers` times what the
//! caller's replay buffer holds).
//!
//! Owned by the pool node's thread: [`EventPublisher::serve`] (or [`super::wait_all`] then
//! [`EventPublisher::serve_replays`]) drives it; nothing blocks.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use std::os::fd::BorrowedFd;

use kvpeer_core::LinkLoss;
use tracing::{debug, warn};

use super::client::LinkEvent;
use super::{wire, EventIo, EventsError};
use crate::io::poller::{Poller, Ready, Token};
use crate::zmtp::connection::{ConnLimits, Incoming, Role};
use crate::zmtp::listener::{ConnId as PeerId, Listener as Server, ListenerLimits as ServerLimits};

/// Settings of a publisher.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublisherConfig {
    /// Where the PUB listens (vLLM's default port is 5557).
    pub bind: SocketAddr,
    /// Where the replay ROUTER listens, if there is one.
    pub replay_bind: Option<SocketAddr>,
    /// Each subscriber connection's limits (`send_queue` is the PUB's `SNDHWM`).
    pub subscriber: ConnLimits,
    /// Each replay connection's limits.
    pub replay_client: ConnLimits,
    /// Subscriber connections at once.
    pub max_subscribers: usize,
    /// Replay connections at once.
    pub max_replay_clients: usize,
    /// Connections at once from one source address, on each listener.
    pub max_per_source: usize,
    /// Subscriptions one connection may hold.
    pub max_subscriptions: usize,
    /// Replay requests one connection may have waiting.
    pub max_pending_requests: usize,
    /// Replay answers in progress at once.
    pub max_answers: usize,
    /// How long a connection may take none of our bytes while some wait.
    pub stall_timeout: Duration,
}

impl PublisherConfig {
    /// A publisher at `bind` without a replay socket, with the defaults: 1000 messages or
    /// 8 MiB queued per subscriber, subscriptions of up to 4 KiB and 256 per connection, 64
    /// subscribers and 16 replay clients (16 per source), 4 requests waiting per connection,
    /// 4 answers at once, heartbeats 2 s / 10 s / TTL 10 s, handshakes and stalls 10 s.
    pub fn new(bind: SocketAddr) -> Self {
        let conn = ConnLimits {
            max_message_bytes: 4096,
            heartbeat_interval: Duration::from_secs(2),
            heartbeat_timeout: Duration::from_secs(10),
            heartbeat_ttl: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            send_queue: 1000,
            send_queue_bytes: 8 << 20,
            // Subscriptions and replay requests taken per connection per round.
            max_incoming: 128,
        };
        PublisherConfig {
            bind,
            replay_bind: None,
            subscriber: conn.clone(),
            replay_client: ConnLimits {
                // A request is 9 bytes and two frames.
                max_message_bytes: 1024,
                ..conn
            },
            max_subscribers: 64,
            max_replay_clients: 16,
            max_per_source: 16,
            max_subscriptions: 256,
            max_pending_requests: 4,
            max_answers: 4,
            stall_timeout: Duration::from_secs(10),
        }
    }
}

/// Counts of what happened.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Subscriber connections open.
    pub subscribers: usize,
    /// Replay connections open.
    pub replay_clients: usize,
    /// Messages published.
    pub published: u64,
    /// Messages queued to a subscriber (one per matching subscriber).
    pub delivered: u64,
    /// Messages a subscriber missed because its queue was full.
    pub dropped: u64,
    /// Connections closed for holding too many subscriptions.
    pub too_many_subscriptions: u64,
    /// Replay requests answered.
    pub replays: u64,
    /// Replay messages of another shape, dropped.
    pub bad_requests: u64,
    /// Replay requests dropped because too many were waiting on their connection.
    pub requests_dropped: u64,
    /// Connections refused over the caps (both listeners; only with caps of zero).
    pub refused: u64,
    /// Connections closed to make room for newcomers over the caps (both listeners).
    pub evicted: u64,
}

#[derive(Debug, Default)]
struct ReplayClient {
    /// `start_seq` of each request not yet answered.
    requests: VecDeque<u64>,
    /// The answer in progress: messages not yet queued to the connection.
    answer: VecDeque<Vec<Vec<u8>>>,
}

/// Tokens of the publisher's poll: the PUB listener (its connections after it), the replay
/// ROUTER's.
const PUBS: Token = 1 << 32;
const REPLAYS: Token = 2 << 32;
const SPAN: u64 = (1 << 32) - 1;

/// The pool's KV event stream: a PUB and an optional replay ROUTER.
#[derive(Debug)]
pub struct EventPublisher {
    poller: Poller,
    config: PublisherConfig,
    pubs: Server,
    /// Each subscriber's prefixes, with how many SUBSCRIBEs each has.
    subscriptions: BTreeMap<PeerId, Vec<(Vec<u8>, u32)>>,
    replay: Option<Server>,
    clients: BTreeMap<PeerId, ReplayClient>,
    stats: PublisherStats,
}

impl EventPublisher {
    /// Listens per `config`.
    pub fn bind(config: PublisherConfig) -> Result<Self, EventsError> {
        let limits = |conn: &ConnLimits, max_connections| {
            ServerLimits::event_stream(
                conn.clone(),
                max_connections,
                config.max_per_source,
                config.stall_timeout,
            )
        };
        let poller = Poller::new().map_err(EventsError::Wait)?;
        let pubs = Server::bind(
            config.bind,
            Role::publisher(),
            limits(&config.subscriber, config.max_subscribers),
            &poller,
            PUBS,
        )
        .map_err(|source| EventsError::Bind {
            what: "PUB",
            addr: config.bind,
            source,
        })?;
        let replay = config
            .replay_bind
            .map(|addr| {
                Server::bind(
                    addr,
                    Role::router(),
                    limits(&config.replay_client, config.max_replay_clients),
                    &poller,
                    REPLAYS,
                )
                .map_err(|source| EventsError::Bind {
                    what: "replay ROUTER",
                    addr,
                    source,
                })
            })
            .transpose()?;
        Ok(EventPublisher {
            poller,
            config,
            pubs,
            subscriptions: BTreeMap::new(),
            replay,
            clients: BTreeMap::new(),
            stats: PublisherStats::default(),
        })
    }

    /// Where the PUB listens.
    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.pubs.local_addr()
    }

    /// Where the replay ROUTER listens, if there is one.
    pub fn replay_addr(&self) -> Option<SocketAddr> {
        self.replay.as_ref().and_then(|r| r.local_addr().ok())
    }

    /// What happened so far.
    pub fn stats(&self) -> PublisherStats {
        PublisherStats {
            subscribers: self.pubs.connections(),
            replay_clients: self.replay.as_ref().map_or(0, Server::connections),
            refused: self.pubs.refused() + self.replay.as_ref().map_or(0, Server::refused),
            evicted: self.pubs.evicted() + self.replay.as_ref().map_or(0, Server::evicted),
            ..self.stats
        }
    }

    /// Subscriber connections whose subscription is in (the handshake done and at least one
    /// prefix taken).
    pub fn subscribed(&self) -> usize {
        self.subscriptions
            .values()
            .filter(|s| !s.is_empty())
            .count()
    }

    /// Subscriptions held, over every connection (a prefix subscribed twice counts once).
    pub fn subscriptions(&self) -> usize {
        self.subscriptions.values().map(Vec::len).sum()
    }

    /// Sends one message (`parts[0]` is its topic) to every subscriber whose subscription
    /// prefixes the topic; a subscriber whose queue is full misses it (counted). Never blocks.
    pub fn publish(&mut self, parts: &[&[u8]]) {
        let now = Instant::now();
        self.stats.published += 1;
        let topic = parts.first().copied().unwrap_or_default();
        let matching: Vec<PeerId> = self
            .subscriptions
            .iter()
            .filter(|(_, subs)| subs.iter().any(|(p, _)| topic.starts_with(p)))
            .map(|(id, _)| *id)
            .collect();
        for id in matching {
            match self.pubs.queue(now, id, parts) {
                Ok(()) => {
                    self.stats.delivered += 1;
                    // Written at once when the socket takes it; else POLLOUT wakes the wait.
                    let idle = self.pubs.connection(id).is_some_and(|c| c.queued() == 1);
                    if idle {
                        self.pubs.flush(now, id);
                    }
                }
                Err(_) => {
                    self.stats.dropped += 1;
                    if let Some(suppressed) = crate::admit_warning("KV event dropped") {
                        warn!(
                            subscriber = id,
                            suppressed, "a KV event subscriber does not keep up: message dropped"
                        );
                    }
                }
            }
        }
    }

    /// Answers the replay requests waiting, each with the messages `replay(start_seq)` gives
    /// (the empty delimiter is put in front of each), as far as `max_answers` allows.
    pub fn serve_replays<R, M>(&mut self, mut replay: impl FnMut(u64) -> R)
    where
        R: IntoIterator<Item = M>,
        M: IntoIterator<Item = Vec<u8>>,
    {
        let mut answering = self
            .clients
            .values()
            .filter(|c| !c.answer.is_empty())
            .count();
        let now = Instant::now();
        let mut started = Vec::new();
        for (id, client) in &mut self.clients {
            if answering >= self.config.max_answers {
                break;
            }
            if !client.answer.is_empty() {
                continue;
            }
            let Some(start) = client.requests.pop_front() else {
                continue;
            };
            client.answer = replay(start)
                .into_iter()
                .map(|m| std::iter::once(Vec::new()).chain(m).collect())
                .collect();
            self.stats.replays += 1;
            answering += 1;
            started.push(*id);
        }
        for id in started {
            self.feed(now, id);
        }
    }

    /// Sleeps until something may have happened (or `timeout`), drives the sockets, then
    /// answers the replay requests that came with `replay` ([`EventPublisher::serve_replays`]).
    pub fn serve<R, M>(
        &mut self,
        timeout: Duration,
        replay: impl FnMut(u64) -> R,
    ) -> Result<bool, EventsError>
    where
        R: IntoIterator<Item = M>,
        M: IntoIterator<Item = Vec<u8>>,
    {
        let woke = super::wait_all(&mut [self], timeout, None)?;
        self.serve_replays(replay);
        Ok(woke)
    }

    /// Moves as much of connection `id`'s answer into its queue as fits, and writes.
    fn feed(&mut self, now: Instant, id: PeerId) {
        let (Some(server), Some(client)) = (&mut self.replay, self.clients.get_mut(&id)) else {
            return;
        };
        while let Some(message) = client.answer.front() {
            let parts: Vec<&[u8]> = message.iter().map(Vec::as_slice).collect();
            if server.queue(now, id, &parts).is_err() {
                break;
            }
            client.answer.pop_front();
        }
        server.flush(now, id);
    }

    fn on_pub_events(&mut self, events: Vec<(PeerId, LinkEvent)>) {
        for (id, event) in events {
            let subscription = match event {
                LinkEvent::Ready { .. } => {
                    self.subscriptions.insert(id, Vec::new());
                    continue;
                }
                LinkEvent::Lost { .. } => {
                    self.subscriptions.remove(&id);
                    continue;
                }
                LinkEvent::Incoming(Incoming::Subscribe(prefix)) => (true, prefix),
                LinkEvent::Incoming(Incoming::Cancel(prefix)) => (false, prefix),
                LinkEvent::Incoming(Incoming::Message(frames)) => {
                    match wire::parse_subscription(&frames) {
                        Some((subscribe, prefix)) => (subscribe, prefix.to_vec()),
                        // A PUB ignores anything else a SUB sends.
                        None => continue,
                    }
                }
            };
            self.subscription(id, subscription);
        }
    }

    /// Applies one SUBSCRIBE (`true`) or CANCEL of connection `id`.
    fn subscription(&mut self, id: PeerId, (subscribe, prefix): (bool, Vec<u8>)) {
        let Some(subs) = self.subscriptions.get_mut(&id) else {
            return;
        };
        let at = subs.iter().position(|(p, _)| *p == prefix);
        match (subscribe, at) {
            (true, Some(at)) => subs[at].1 = subs[at].1.saturating_add(1),
            (true, None) if subs.len() >= self.config.max_subscriptions => {
                self.stats.too_many_subscriptions += 1;
                let mut out = Vec::new();
                let reason = LinkLoss::TooManySubscriptions(self.config.max_subscriptions);
                self.pubs.close(id, reason, &mut out);
                self.on_pub_events(out);
            }
            (true, None) => subs.push((prefix, 1)),
            (false, Some(at)) => {
                subs[at].1 -= 1;
                if subs[at].1 == 0 {
                    subs.swap_remove(at);
                }
            }
            (false, None) => {}
        }
    }

    fn on_replay_events(&mut self, events: Vec<(PeerId, LinkEvent)>) {
        for (id, event) in events {
            match event {
                LinkEvent::Ready { .. } => {
                    self.clients.insert(id, ReplayClient::default());
                }
                LinkEvent::Lost { .. } => {
                    self.clients.remove(&id);
                }
                LinkEvent::Incoming(Incoming::Message(frames)) => {
                    let Some(client) = self.clients.get_mut(&id) else {
                        continue;
                    };
                    match wire::parse_replay_request(&frames) {
                        Ok(_) if client.requests.len() >= self.config.max_pending_requests => {
                            self.stats.requests_dropped += 1;
                        }
                        Ok(start) => client.requests.push_back(start),
                        Err(e) => {
                            self.stats.bad_requests += 1;
                            if let Some(suppressed) = crate::admit_warning("bad replay request") {
                                warn!(client = id, error = %e, suppressed,
                                    "dropping a replay request of another shape");
                            }
                        }
                    }
                }
                LinkEvent::Incoming(Incoming::Subscribe(_) | Incoming::Cancel(_)) => {
                    self.stats.bad_requests += 1;
                }
            }
        }
    }
}

impl EventIo for EventPublisher {
    fn poll_fd(&self) -> BorrowedFd<'_> {
        self.poller.fd()
    }

    fn next_deadline(&mut self, now: Instant) -> Option<Instant> {
        let replay = self.replay.as_mut().and_then(|r| r.deadline(now, true));
        self.pubs
            .deadline(now, true)
            .into_iter()
            .chain(replay)
            .min()
    }

    fn progress(&mut self, now: Instant, polled: bool) {
        if polled {
            let mut ready: Vec<Ready> = Vec::new();
            if let Err(e) = self.poller.wait(Duration::ZERO, &mut ready) {
                debug!(error = %e, "cannot take the KV event sockets' news");
            }
            for r in ready {
                if self.pubs.owns(r.token, SPAN) {
                    self.pubs.on_ready(r);
                } else if let Some(replay) = self.replay.as_mut().filter(|s| s.owns(r.token, SPAN))
                {
                    replay.on_ready(r);
                }
            }
        }
        let mut out = Vec::new();
        self.pubs.progress(&self.poller, now, true, &[], &mut out);
        self.on_pub_events(out);
        if let Some(replay) = &mut self.replay {
            let mut out = Vec::new();
            replay.progress(&self.poller, now, true, &[], &mut out);
            self.on_replay_events(out);
            let answering: Vec<PeerId> = self
                .clients
                .iter()
                .filter(|(_, c)| !c.answer.is_empty())
                .map(|(id, _)| *id)
                .collect();
            for id in answering {
                self.feed(now, id);
            }
        }
    }
}
