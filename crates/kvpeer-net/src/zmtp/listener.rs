//! One listening socket and its accepted connections, each a [`Connection`] in the listener's
//! [`Role`]: the control channel's ROUTER ([`crate::control::inbound`]) and every listening socket of
//! the KV event stream (the pool's PUB, its replay ROUTER, a SUB that binds) are this type, so
//! each bound against a hostile peer is written once, here.
//!
//! Bounds, per listener ([`ListenerLimits`]):
//!
//! * **Connections**, in all and per source address. One over evicts the holder that is worth
//!   least (`admission.rs`: of its own source, or of the heaviest source when the listener is
//!   full; one that is not engaged (no session, never subscribed or asked) before one that is,
//!   then the idlest), so one process cannot lock the others of its host out.
//! * **Accepts per round** (`accepts_per_round`): a burst of new connections is taken a few at
//!   a time, the open ones read in between. After a failed `accept` (out of descriptors) the
//!   listener rests [`ACCEPT_BACKOFF`] instead of spinning the loop.
//! * **Work per connection per round**: at most `read_budget` bytes read and
//!   [`ConnLimits::max_incoming`] things decoded; what the peer sent beyond waits in its socket
//!   or its decoder until the next round, which comes at once ([`Listener::deadline`] is then
//!   now). A peer flooding at full speed delays each other one by that much work per round.
//! * **Memory**: each connection decodes under its `max_message_bytes` (a 1 TiB frame header
//!   ends it before a byte is kept) and its output queue is bounded by its [`ConnLimits`]; all
//!   connections together hold at most `max_buffered_bytes`, over which the largest holder is
//!   closed.
//! * **Time**: a connection that does not finish its handshake, answers no heartbeat, or takes
//!   none of our bytes for `stall_timeout` while some wait is closed.
//! * When `challenge` is set, each connection's READY carries 16 fresh random bytes
//!   ([`crate::zmtp::CHALLENGE_PROPERTY`]), which a kvpeer peer's proofs are made for.
//!
//! Owned by the thread that drives it (the node's runtime thread, an event stream's thread);
//! every socket is non-blocking and polled with the caller's others ([`Listener::poll_fds`]),
//! so nothing here blocks.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use tracing::{debug, warn};

use kvpeer_core::LinkLoss;

use crate::io::sockio::{self, Accepted};
use crate::zmtp;
use crate::zmtp::admission::{self, Caps, Holder};
use crate::zmtp::connection::{ConnLimits, Connection, Incoming, QueueFull, Role};

/// How long the listener rests after `accept` fails before it is polled again.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// One accepted connection's number, unique for the listener's life.
pub type ConnId = u64;

/// Bounds of one listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ListenerLimits {
    /// Each connection's protocol limits (`max_incoming`: things decoded per round).
    pub(crate) conn: ConnLimits,
    /// Connections at once.
    pub(crate) max_connections: usize,
    /// Connections at once from one source address.
    pub(crate) max_per_source: usize,
    /// How long bytes may wait unwritten with none taken before the connection is closed.
    pub(crate) stall_timeout: Duration,
    /// Bytes read from one connection per round.
    pub(crate) read_budget: usize,
    /// Connections accepted per round.
    pub(crate) accepts_per_round: usize,
    /// Bytes all connections may hold together (partial messages, decoded ones not yet taken,
    /// output); over it the largest holder is closed.
    pub(crate) max_buffered_bytes: usize,
    /// Whether each connection's READY carries a fresh challenge.
    pub(crate) challenge: bool,
    /// Whether a connection that sent a message or subscription is engaged from then on (the
    /// event stream's clients; the control channel marks its own, by session).
    pub(crate) engage_on_request: bool,
    /// The caller's time each connection may be given per round (deficit round robin): with
    /// it, the caller reports what handling each message cost ([`Listener::charge`]), and a
    /// connection is given about this much of it per round, whatever its messages cost, so a
    /// peer whose messages are expensive (or many) delays each other connection by about this
    /// much per round. `None`: only `max_incoming` bounds a round.
    pub(crate) round_quantum: Option<Duration>,
    /// The caller's time one connection's messages may take per second (with
    /// `round_quantum`): past it the connection is neither read nor polled until its share
    /// refills, so no one peer keeps the caller's thread busy (and the core it shares with
    /// other processes) however many rounds it would win. `None`: no rate.
    pub(crate) time_per_second: Option<Duration>,
}

/// What happened on one connection.
#[derive(Debug)]
pub(crate) enum LinkEvent {
    /// The handshake is done: messages flow. The peer's `Identity` and (accepted connections)
    /// its source address come with it, for a caller that handles events after the round, when
    /// a connection that ended in it is gone.
    Ready {
        /// The `Identity` its READY gave (empty when none).
        identity: Vec<u8>,
        /// Its TCP source address (accepted connections).
        source: Option<IpAddr>,
    },
    /// The peer sent this.
    Incoming(Incoming),
    /// The connection ended (it had reached [`LinkEvent::Ready`] when `was_ready`).
    Lost {
        /// Why.
        reason: String,
        /// Whether it had been ready.
        was_ready: bool,
    },
}

/// Which connections a round reads.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Readable<'a> {
    /// The sockets to read: these (sorted; the poll said so), or every one for `None` (the
    /// caller does not know which are ready). Each within its shares.
    pub(crate) sockets: Option<&'a [ConnId]>,
    /// Connections (sorted) read to the end this round, whatever their shares: the caller
    /// must see everything they sent before it acts on their peer's loss.
    pub(crate) drain: &'a [ConnId],
}

impl<'a> Readable<'a> {
    /// The sockets the poll saw ready, nothing drained.
    pub(crate) fn only(ready: &'a [ConnId]) -> Self {
        Self {
            sockets: Some(ready),
            drain: &[],
        }
    }
}

struct Peer {
    stream: TcpStream,
    source: IpAddr,
    conn: Connection,
    /// When the socket last took bytes, or had none to take.
    last_written: Instant,
    /// When the peer last sent a message or subscription, or took bytes of ours (accepted, if
    /// never): how idle it is when a newcomer needs its slot.
    last_active: Instant,
    /// A client at work (a session bound to it; a subscription or request made), evicted after
    /// the others.
    engaged: bool,
    /// Its deficit round robin credit, in nanoseconds of the caller's time (`round_quantum`):
    /// each round with input adds one quantum (up to one), each message handled takes what it
    /// cost; at zero or less, it is given nothing this round.
    credit_ns: i64,
    /// What one of its messages cost the caller lately (a moving average), to take as many as
    /// its credit covers.
    cost_ns: u64,
    /// Its share of the caller's time per second (`time_per_second`), in nanoseconds, as of
    /// `rate_at`: it refills at that rate up to a tenth of a second's worth.
    rate_ns: i64,
    rate_at: Instant,
}

impl Peer {
    /// Its time-per-second share at `now` (refilled since `rate_at`, not stored).
    fn share_at(&self, now: Instant, per_second: Duration) -> i64 {
        let per_second = per_second.as_nanos();
        let refill =
            now.saturating_duration_since(self.rate_at).as_nanos() * per_second / 1_000_000_000;
        let cap = i64::try_from(per_second / 10).unwrap_or(i64::MAX);
        self.rate_ns
            .saturating_add(i64::try_from(refill).unwrap_or(i64::MAX))
            .min(cap)
    }

    /// Whether it spent its time-per-second share and waits for it to refill.
    fn throttled(&self, now: Instant, per_second: Option<Duration>) -> bool {
        per_second.is_some_and(|r| self.share_at(now, r) <= 0)
    }

    /// When a throttled share is back above zero.
    fn refilled_at(&self, now: Instant, per_second: Duration) -> Instant {
        let debt = u128::from(self.share_at(now, per_second).min(0).unsigned_abs());
        let wait = debt * 1_000_000_000 / per_second.as_nanos().max(1);
        now + Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX))
            + Duration::from_micros(1)
    }
}

/// Nanoseconds as an `i64`, saturating.
fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// A listener and its connections.
pub(crate) struct Listener {
    listener: TcpListener,
    role: Role,
    limits: ListenerLimits,
    peers: BTreeMap<ConnId, Peer>,
    next: ConnId,
    accept_paused_until: Option<Instant>,
    refused: u64,
    evicted: u64,
}

impl std::fmt::Debug for Listener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Listener")
            .field("addr", &self.listener.local_addr().ok())
            .field("role", &self.role.socket_type)
            .field("connections", &self.peers.len())
            .finish()
    }
}

impl ListenerLimits {
    /// Limits for a listener of the KV event stream: `max_connections` of `conn`, `max_per_source`
    /// from one address; each connection read up to 4 MiB per round; all together may hold what
    /// every connection may hold at once (so the total never closes one within its own bounds).
    pub(crate) fn event_stream(
        conn: ConnLimits,
        max_connections: usize,
        max_per_source: usize,
        stall_timeout: Duration,
    ) -> Self {
        let read_budget = 4 << 20;
        let per_connection = conn
            .send_queue_bytes
            .saturating_add(usize::try_from(conn.max_message_bytes).unwrap_or(usize::MAX))
            .saturating_mul(2)
            .saturating_add(read_budget);
        ListenerLimits {
            conn,
            max_connections,
            max_per_source,
            stall_timeout,
            read_budget,
            accepts_per_round: 16,
            max_buffered_bytes: per_connection.saturating_mul(max_connections),
            challenge: false,
            engage_on_request: true,
            round_quantum: None,
            time_per_second: None,
        }
    }
}

impl Listener {
    /// Listens at `addr` (port 0 picks one).
    pub(crate) fn bind(
        addr: SocketAddr,
        role: Role,
        limits: ListenerLimits,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        // The one place the budgets are made usable: a zero share means none (a quantum or a
        // rate of zero would give a connection nothing, ever), a zero count one.
        let limits = ListenerLimits {
            read_budget: limits.read_budget.max(1),
            accepts_per_round: limits.accepts_per_round.max(1),
            round_quantum: limits.round_quantum.filter(|q| !q.is_zero()),
            time_per_second: limits.time_per_second.filter(|r| !r.is_zero()),
            ..limits
        };
        Ok(Listener {
            listener,
            role,
            limits,
            peers: BTreeMap::new(),
            next: 0,
            accept_paused_until: None,
            refused: 0,
            evicted: 0,
        })
    }

    /// The address bound.
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Connections open now.
    pub(crate) fn connections(&self) -> usize {
        self.peers.len()
    }

    /// Connections refused over the caps (only when no slot can be had: caps of zero).
    pub(crate) fn refused(&self) -> u64 {
        self.refused
    }

    /// Connections closed to make room for a newcomer.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// The connections' numbers, in [`Listener::poll_fds`] order (after the listener).
    pub(crate) fn ids(&self) -> impl Iterator<Item = ConnId> + '_ {
        self.peers.keys().copied()
    }

    /// Connection `id`'s protocol state.
    pub(crate) fn connection(&self, id: ConnId) -> Option<&Connection> {
        self.peers.get(&id).map(|p| &p.conn)
    }

    /// Marks connection `id` as engaged (a session is bound to it) or not: an engaged one gives
    /// its slot up to a newcomer only after every other one of its source.
    pub(crate) fn set_engaged(&mut self, id: ConnId, engaged: bool) {
        if let Some(p) = self.peers.get_mut(&id) {
            p.engaged = engaged;
        }
    }

    /// Connection `id`'s handling of one message cost the caller `cost` (with `round_quantum`).
    pub(crate) fn charge(&mut self, id: ConnId, cost: Duration) {
        if let Some(p) = self.peers.get_mut(&id) {
            let ns = nanos(cost);
            p.credit_ns = p.credit_ns.saturating_sub(ns);
            p.cost_ns = (p
                .cost_ns
                .saturating_mul(7)
                .saturating_add(ns.unsigned_abs()))
                / 8;
            if let Some(per_second) = self.limits.time_per_second {
                let now = Instant::now().max(p.rate_at);
                // Debt is bounded to one second's share, so a connection waits at most a second
                // (far inside its heartbeat timeout) however expensive one message was.
                p.rate_ns = p
                    .share_at(now, per_second)
                    .saturating_sub(ns)
                    .max(-nanos(per_second));
                p.rate_at = now;
            }
        }
    }

    /// Whether the listener itself is polled at `now` (not while it rests after a failed
    /// `accept`; [`Listener::deadline`] wakes the caller when that ends).
    fn listening(&self, now: Instant) -> bool {
        self.accept_paused_until.is_none_or(|until| now >= until)
    }

    /// Descriptors to poll, appended to `fds`: the listener (asked for nothing while it rests),
    /// then each connection (input only when `read`), [`Listener::fd_count`] in all.
    pub(crate) fn poll_fds<'a>(&'a self, now: Instant, read: bool, fds: &mut Vec<PollFd<'a>>) {
        let flags = if self.listening(now) {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        fds.push(PollFd::new(self.listener.as_fd(), flags));
        for p in self.peers.values() {
            // A connection that spent its time per second is not read until it refills (its
            // deadline wakes the caller then).
            let read = read && !p.throttled(now, self.limits.time_per_second);
            let mut flags = if read {
                PollFlags::POLLIN
            } else {
                PollFlags::empty()
            };
            if !p.conn.transmit().is_empty() {
                flags |= PollFlags::POLLOUT;
            }
            fds.push(PollFd::new(p.stream.as_fd(), flags));
        }
    }

    /// How many descriptors [`Listener::poll_fds`] appends.
    pub(crate) fn fd_count(&self) -> usize {
        1 + self.peers.len()
    }

    /// Whether a connection holds input it was not given a round for yet: the next round
    /// should come at once.
    fn has_backlog(&self, now: Instant) -> bool {
        self.peers
            .values()
            .any(|p| p.conn.holds_input() && !p.throttled(now, self.limits.time_per_second))
    }

    /// When [`Listener::progress`] has something to do without readiness (`now` when a
    /// connection holds input left from its last round).
    pub(crate) fn deadline(&self, now: Instant) -> Option<Instant> {
        if self.has_backlog(now) {
            return Some(now);
        }
        let stall = self.limits.stall_timeout;
        let per_second = self.limits.time_per_second;
        self.peers
            .values()
            .filter_map(|p| {
                let stalled = (!p.conn.transmit().is_empty()).then_some(p.last_written + stall);
                let refilled = per_second
                    .filter(|_| p.throttled(now, per_second))
                    .map(|r| p.refilled_at(now, r));
                [p.conn.poll_timeout(), stalled, refilled]
                    .into_iter()
                    .flatten()
                    .min()
            })
            .chain(self.accept_paused_until)
            .min()
    }

    /// Queues a message to connection `id` at `now` (not written yet: [`Listener::flush`]).
    pub(crate) fn queue(
        &mut self,
        now: Instant,
        id: ConnId,
        parts: &[&[u8]],
    ) -> Result<(), QueueFull> {
        match self.peers.get_mut(&id) {
            Some(p) if p.conn.is_ready() => {
                if p.conn.transmit().is_empty() {
                    // The stall clock starts when bytes start waiting.
                    p.last_written = now;
                }
                p.conn.queue(parts)
            }
            _ => Err(QueueFull),
        }
    }

    /// Writes what connection `id` has queued until its socket would block; a connection
    /// that fails is closed and reported in `out`.
    pub(crate) fn flush(&mut self, now: Instant, id: ConnId, out: &mut Vec<(ConnId, LinkEvent)>) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        match sockio::write_available(&mut p.stream, &mut p.conn) {
            Ok(wrote) => {
                if wrote && self.limits.engage_on_request {
                    // A subscriber taking our messages is at work; our own PINGs to a control
                    // connection say nothing of it.
                    p.last_active = now;
                }
                if wrote || p.conn.transmit().is_empty() {
                    p.last_written = now;
                }
            }
            Err(reason) => self.close(id, reason.to_string(), out),
        }
    }

    /// Closes connection `id`, reporting it in `out`.
    pub(crate) fn close(&mut self, id: ConnId, reason: String, out: &mut Vec<(ConnId, LinkEvent)>) {
        let Some(p) = self.peers.remove(&id) else {
            return;
        };
        let _ = p.stream.shutdown(std::net::Shutdown::Both);
        debug!(id, source = %p.source, role = self.role.socket_type, %reason,
            "connection ended");
        out.push((
            id,
            LinkEvent::Lost {
                reason,
                was_ready: p.conn.is_ready(),
            },
        ));
    }

    /// As [`Listener::progress_ids`], with the connections to read given by the poll's
    /// `revents` in [`Listener::poll_fds`] order (the listener's first; empty: none ready),
    /// read only when `read`.
    pub(crate) fn progress(
        &mut self,
        now: Instant,
        revents: &[PollFlags],
        read: bool,
        out: &mut Vec<(ConnId, LinkEvent)>,
    ) {
        let listener_ready = revents.first().is_some_and(|r| !r.is_empty());
        let ready: Vec<ConnId> = if read {
            self.ids()
                .zip(revents.iter().skip(1))
                .filter(|(_, r)| !r.is_empty())
                .map(|(id, _)| id)
                .collect()
        } else {
            Vec::new()
        };
        self.progress_ids(now, listener_ready, Readable::only(&ready), out);
    }

    /// Accepts what waits (when `listener_ready`), gives each connection its round (what its
    /// decoder held from the last one, then its socket when `readable`), runs every deadline
    /// due at `now` and writes what is queued. What happened goes to `out`.
    pub(crate) fn progress_ids(
        &mut self,
        now: Instant,
        listener_ready: bool,
        readable: Readable<'_>,
        out: &mut Vec<(ConnId, LinkEvent)>,
    ) {
        if self.accept_paused_until.is_some_and(|until| now >= until) {
            // Rested: the listener is polled again from the next wait (its deadline is gone).
            self.accept_paused_until = None;
        }
        let ids: Vec<ConnId> = self.peers.keys().copied().collect();
        if listener_ready {
            // New connections send their greeting and READY at once.
            for id in self.accept(now, out) {
                self.flush(now, id, out);
            }
        }
        let per_second = self.limits.time_per_second;
        // The poll's order is the map's: sorted.
        let polled = |id: ConnId| {
            readable
                .sockets
                .is_some_and(|ready| ready.binary_search(&id).is_ok())
        };
        let drained = |id: ConnId| readable.drain.binary_search(&id).is_ok();
        let is_read = |id: ConnId| readable.sockets.is_none() || polled(id) || drained(id);
        // Deficit round robin: every connection with input gets the same number of quanta this
        // round, as many as it takes for one of them to be out of debt (one, unless all are in
        // debt: then no round is wasted on giving nobody anything).
        let quanta = self.limits.round_quantum.map(|q| {
            let q = nanos(q);
            self.peers
                .iter()
                .filter(|(&id, p)| {
                    (is_read(id) || p.conn.holds_input()) && !p.throttled(now, per_second)
                })
                .map(|(_, p)| {
                    (1 - p.credit_ns.min(0))
                        .unsigned_abs()
                        .div_ceil(q.unsigned_abs())
                })
                .min()
                .unwrap_or(1)
                .max(1)
                .try_into()
                .unwrap_or(i64::MAX)
                .saturating_mul(q)
        });
        let mut read_any = false;
        for id in ids {
            let Some(p) = self.peers.get_mut(&id) else {
                continue;
            };
            let read = is_read(id);
            read_any |= read;
            // A drained connection's peer was lost: the caller must see all it sent first (its
            // last messages, its `disconnect`, come before the loss), whatever its shares.
            let drain = drained(id);
            let throttled = p.throttled(now, per_second) && !drain;
            // A throttled connection is polled for nothing but our writes: reported ready
            // with nothing to write, it was reset or hung up.
            let hung_up = throttled && polled(id) && p.conn.transmit().is_empty();
            // What this round may take of it: with a quantum, as many messages as its credit
            // covers at what they cost lately (none while it is in debt or throttled), else
            // `max_incoming`.
            let share = match (self.limits.round_quantum, quanta) {
                _ if drain => usize::MAX,
                (Some(_), _) if throttled => 0,
                (Some(quantum), Some(quanta)) => {
                    let quantum = nanos(quantum);
                    if read || p.conn.holds_input() {
                        p.credit_ns = p.credit_ns.saturating_add(quanta).min(quantum);
                    }
                    if p.credit_ns <= 0 {
                        0
                    } else {
                        let covered = p.credit_ns.unsigned_abs() / p.cost_ns.max(1);
                        usize::try_from(covered).unwrap_or(usize::MAX).max(1)
                    }
                }
                _ => usize::MAX,
            };
            let was_ready = p.conn.is_ready();
            let mut step = || -> Result<(), String> {
                if hung_up {
                    return Err("reset or hung up while throttled".into());
                }
                if share > 0 {
                    if p.conn.holds_input() {
                        p.conn.decode_held(now).map_err(|e| e.to_string())?;
                    }
                    if read && !p.conn.holds_input() {
                        // Reading stops once the connection holds this round's share, so what
                        // it sent beyond (its end of stream too) waits in the socket.
                        let conn = &mut p.conn;
                        sockio::read_while(&mut p.stream, self.limits.read_budget, |bytes| {
                            conn.handle_bytes(bytes, now)
                                .map_err(|e| LinkLoss::Zmtp(e.to_string().into()))?;
                            Ok(!conn.decoding_paused())
                        })
                        .map_err(|e| e.to_string())?;
                    }
                }
                p.conn.handle_timeout(now).map_err(|e| e.to_string())?;
                if !p.conn.transmit().is_empty()
                    && now.saturating_duration_since(p.last_written) >= self.limits.stall_timeout
                {
                    return Err(format!(
                        "the peer took none of our bytes for {:?}",
                        self.limits.stall_timeout
                    ));
                }
                Ok(())
            };
            let result = step();
            if !was_ready && p.conn.is_ready() {
                out.push((
                    id,
                    LinkEvent::Ready {
                        identity: p.conn.peer_identity().unwrap_or_default().to_vec(),
                        source: Some(p.source),
                    },
                ));
            }
            // A connection that ends gives up everything it sent before (a peer's last
            // messages, its `disconnect`, come before its loss), whatever its share.
            let share = if result.is_err() { usize::MAX } else { share };
            let mut taken = 0;
            while taken < share {
                let incoming = match p.conn.poll_incoming() {
                    Some(incoming) => incoming,
                    None if result.is_err() && p.conn.holds_input() => {
                        if p.conn.decode_held(now).is_err() {
                            break;
                        }
                        continue;
                    }
                    None => break,
                };
                taken += 1;
                if matches!(incoming, Incoming::Message(_) | Incoming::Subscribe(_)) {
                    p.last_active = now;
                    p.engaged |= self.limits.engage_on_request;
                }
                out.push((id, LinkEvent::Incoming(incoming)));
            }
            match result {
                Ok(()) => self.flush(now, id, out),
                Err(reason) => self.close(id, reason, out),
            }
        }
        if read_any {
            // Buffers grow only by reading.
            self.shed_buffers(out);
        }
    }

    /// Closes the connection holding the most while all together hold more than
    /// `max_buffered_bytes`, so many connections holding large partial messages cannot exhaust
    /// memory.
    fn shed_buffers(&mut self, out: &mut Vec<(ConnId, LinkEvent)>) {
        loop {
            let total: usize = self.peers.values().map(|p| p.conn.buffered()).sum();
            if total <= self.limits.max_buffered_bytes {
                return;
            }
            let Some((&hog, _)) = self.peers.iter().max_by_key(|(_, p)| p.conn.buffered()) else {
                return;
            };
            if let Some(suppressed) = crate::admit_warning("listener buffers over the cap") {
                warn!(
                    total,
                    cap = self.limits.max_buffered_bytes,
                    suppressed,
                    role = self.role.socket_type,
                    "closing the connection holding the most buffered bytes"
                );
            }
            self.close(hog, "buffers over the node's cap".into(), out);
        }
    }

    /// Makes a slot for a newcomer from `source` when a cap is reached, closing the holder the
    /// admission policy names (reported in `out`); `false` when no slot can be had.
    fn make_room(&mut self, source: IpAddr, out: &mut Vec<(ConnId, LinkEvent)>) -> bool {
        let caps = Caps {
            max_connections: self.limits.max_connections,
            max_per_source: self.limits.max_per_source,
        };
        let holders: Vec<Holder<ConnId>> = self
            .peers
            .iter()
            .map(|(&id, p)| Holder {
                id,
                source: p.source,
                last_active: p.last_active,
                holds_session: p.engaged,
            })
            .collect();
        if let Some(victim) = admission::evict_for(&holders, source, caps) {
            self.evicted += 1;
            if let Some(suppressed) = crate::admit_warning("connection evicted") {
                warn!(%source, open = self.peers.len(), suppressed, role = self.role.socket_type,
                    "connections full: closing the idlest of the heaviest source");
            }
            self.close(
                victim,
                "evicted for a newcomer (connections full)".into(),
                out,
            );
        }
        let from_source = self.peers.values().filter(|p| p.source == source).count();
        self.peers.len() < caps.max_connections && from_source < caps.max_per_source
    }

    /// Accepts up to `accepts_per_round` waiting connections; their numbers.
    fn accept(&mut self, now: Instant, out: &mut Vec<(ConnId, LinkEvent)>) -> Vec<ConnId> {
        let mut accepted = Vec::new();
        if !self.listening(now) {
            return accepted;
        }
        self.accept_paused_until = None;
        for _ in 0..self.limits.accepts_per_round {
            let (stream, source) = match sockio::accept(&self.listener) {
                Accepted::Stream(stream, source) => (stream, source),
                Accepted::None => break,
                Accepted::Failed(e) => {
                    if let Some(suppressed) = crate::admit_warning("cannot accept") {
                        warn!(error = %e, suppressed, role = self.role.socket_type,
                            "cannot accept a connection");
                    }
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    break;
                }
            };
            if !self.make_room(source, out) {
                self.refused += 1;
                continue; // no slot can be had (caps of zero): dropped, closed
            }
            let mut role = self.role.clone();
            if self.limits.challenge {
                let mut challenge = [0u8; zmtp::CHALLENGE_LEN];
                if let Err(e) = getrandom::fill(&mut challenge) {
                    if let Some(suppressed) = crate::admit_warning("no randomness") {
                        warn!(error = %e, suppressed, "no randomness for a connection's challenge");
                    }
                    continue;
                }
                role.challenge = Some(challenge);
            }
            let mut conn = Connection::new(role, self.limits.conn.clone());
            conn.connected(now);
            self.next += 1;
            debug!(id = self.next, %source, role = self.role.socket_type, "connection accepted");
            self.peers.insert(
                self.next,
                Peer {
                    stream,
                    source,
                    conn,
                    last_written: now,
                    last_active: now,
                    engaged: false,
                    credit_ns: 0,
                    // Until its messages were charged: a sixteenth of a quantum each, so its
                    // first round takes at most 16 of them.
                    cost_ns: self
                        .limits
                        .round_quantum
                        .map_or(0, |q| nanos(q).unsigned_abs() / 16),
                    rate_ns: self.limits.time_per_second.map_or(0, |r| nanos(r) / 10),
                    rate_at: now,
                },
            );
            accepted.push(self.next);
        }
        accepted
    }
}
