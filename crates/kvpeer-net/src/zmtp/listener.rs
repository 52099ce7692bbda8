//! One listening socket and its accepted connections, each a [`Connection`] in the listener's
//! [`Role`]: the control channel's ROUTER ([`crate::control::inbound`]) and every listening socket of
//! the KV event stream (the pool's PUB, its replay ROUTER, a SUB that binds) are this type, so
//! each bound against a hostile peer is written once, here.
//!
//! Bounds, per listener ([`ListenerLimits`]):
//!
//! * **Sources**: with `allowed_sources`, a connection from any other address is closed at its
//!   accept, before it takes a slot or is sent a byte (a bound SUB takes only its engine's
//!   host: docs/security.md), so it can neither speak nor evict an allowed one.
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
//!   now). With a `round_quantum`, hosts with input are read in the order of their finish
//!   tags, as weighted fair queueing orders packets: a host's virtual time (the caller's time
//!   it used since it came; a host whose input is new starts no further back than just below
//!   the system's virtual time) plus what the next message of the connection it serves first
//!   costs lately. The system's virtual time moves on by each round's work (reading measured,
//!   handling as charged) split among the hosts that had input in it, and never trails the
//!   least-served busy host. A round ends after about one quantum of work in all. So a cheap
//!   message of a host level with the others (an honest consumer's lookup) waits for about one
//!   round's work however many hosts flood, and a host that keeps input keeps the service it
//!   is owed while cheaper messages go first. The system's time counts only work charged to
//!   hosts: moved by the thread's whole time (the core's steps, the writes too), hosts that
//!   keep input would fall ever further behind it and a host whose input is new would wait
//!   for all of them to catch up. Accepting a connection and closing it are charged to its
//!   host too (its share and virtual time, not the system's time), and a host whose last
//!   connection closed keeps both for [`HOST_MEMORY`]: closing and reopening connections buys
//!   a host no fresh share.
//! * **Memory**: each connection decodes under its `max_message_bytes` (a 1 TiB frame header
//!   ends it before a byte is kept) and its output queue is bounded by its [`ConnLimits`]; all
//!   connections together hold at most `max_buffered_bytes`, over which the largest holder is
//!   closed.
//! * **Time**: a connection that does not finish its handshake, answers no heartbeat, or takes
//!   none of our bytes for `stall_timeout` while some wait is closed.
//! * **Ends**: a connection ends once its input is read to its end, so a peer's last messages
//!   (its `disconnect`) come before its loss: a write that fails (the peer closed and our PING
//!   reset the connection) stops our writes, not its reads, and a hang-up seen while its host
//!   is held back waits for the host's turn like its input.
//! * When `challenge` is set, each connection's READY carries 16 fresh random bytes
//!   ([`crate::zmtp::CHALLENGE_PROPERTY`]), which a kvpeer peer's proofs are made for.
//!
//! **Cost per wake.** Every socket is registered once in its owner's [`Poller`] (edge-triggered,
//! tokens `base + id`, the listening socket `base`); the owner hands each readiness to
//! [`Listener::on_ready`], which marks the connection, and [`Listener::progress`] then visits
//! only the connections marked, those whose deadline is due ([`Timers`]: heartbeats,
//! handshakes and stalls on the coarse grid so many share a wake, refilled shares at their time) and those with
//! input left from their last round. Nothing walks every connection: a wake costs what is ready,
//! whatever the number open. Per-source counts and the buffered total are kept as connections
//! change, so admission and the buffer cap look at every connection only when a cap is reached.
//!
//! Owned by the thread that drives it (the node's runtime thread, an event stream's thread);
//! every socket is non-blocking, so nothing here blocks.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use kvpeer_core::LinkLoss;

use crate::io::poller::{Poller, Ready, Token};
use crate::io::sockio::{self, Accepted, ReadEnd};
use crate::io::timers::{coarse, Timers};
use crate::zmtp;
use crate::zmtp::admission::{self, Caps, Holder};
use crate::zmtp::connection::{ConnLimits, Connection, Incoming, QueueFull, Role};
use crate::zmtp::dialer::loss_of;

/// How long the listener rests after `accept` fails before it is polled again.
pub(crate) const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How long a host whose last connection closed keeps its share and virtual time: one that
/// reconnects within it comes back with the debt it left (at most a second's share, refilled
/// within a second), so closing and reopening connections buys a host no fresh share. Past
/// it, it starts as a newcomer.
const HOST_MEMORY: Duration = Duration::from_secs(1);

/// One accepted connection's number, unique for the listener's life (from 1; its token is the
/// listener's base token plus this).
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
    /// The caller's time one source host's messages (all its connections together) may take
    /// per second while another host waits: past it the host's connections are not read until
    /// its share refills or no host under its share has input left, so no host keeps the
    /// caller's thread from the others however many connections or rounds it has, and a host
    /// alone gets all of it (work-conserving). `None`: no rate.
    pub(crate) time_per_second: Option<Duration>,
    /// The only source addresses accepted (compared in canonical form: an IPv4 address and
    /// its IPv4-mapped IPv6 form are one); `None`: any.
    pub(crate) allowed_sources: Option<Vec<IpAddr>>,
}

/// Whether a connection runs over TLS.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum TlsState {
    /// Plaintext ZMTP.
    Plaintext,
    /// TLS, its client certificate (checked against the CA in the handshake; `None` only where
    /// the configuration asks for none).
    Tls(Option<rustls_pki_types::CertificateDer<'static>>),
}

impl TlsState {
    fn of(tls: Option<&rustls::Connection>) -> TlsState {
        match tls {
            None => TlsState::Plaintext,
            Some(tls) => TlsState::Tls(
                tls.peer_certificates()
                    .and_then(|certs| certs.first())
                    .map(|cert| cert.clone().into_owned()),
            ),
        }
    }

    /// Whether it runs over TLS with a certificate that names `ip`.
    pub(crate) fn names(&self, ip: IpAddr) -> bool {
        matches!(self, TlsState::Tls(Some(cert)) if crate::tls::names_ip(cert, ip))
    }
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
        /// Whether it runs over TLS, with the certificate it presented: read when its READY
        /// came, so a caller that looks after the round (when the connection may be gone)
        /// still judges it by what it was.
        tls: TlsState,
    },
    /// The peer sent this.
    Incoming(Incoming),
    /// The connection ended (it had reached [`LinkEvent::Ready`] when `was_ready`).
    Lost {
        /// Why.
        reason: LinkLoss,
        /// Whether it had been ready.
        was_ready: bool,
    },
}

struct Peer {
    stream: TcpStream,
    /// Its TLS session, once its first byte said it speaks TLS ([`Listener::set_tls`]).
    tls: Option<rustls::Connection>,
    /// Its first byte has not come yet, on a listener that takes TLS: nothing is written to
    /// it (our greeting waits) until it says which it speaks.
    sniffing: bool,
    source: IpAddr,
    conn: Connection,
    /// The poll said input (or the end of stream) arrived, and no read has drained it since.
    readable: bool,
    /// The socket takes bytes (no write has been refused since the poll said so).
    writable: bool,
    /// The poll said it hung up or failed.
    closed: bool,
    /// A write failed (the peer reset or left): nothing more is written to it, but what it sent
    /// before is still read, at its shares, to its end (its last messages, its `disconnect`,
    /// were sent before it went and come before its loss); then it closes for this reason.
    ending: Option<LinkLoss>,
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
    /// What one of its messages cost the caller lately (a moving average that rises at once), to
    /// take as many as its credit covers.
    cost_ns: u64,
    /// What it holds, as last counted into the listener's total.
    buffered: usize,
    /// The caller is still working off what it delivered ([`Listener::set_paused`]): it is
    /// neither read nor given messages (its timers still run) until the caller resumes it.
    paused: bool,
}

/// One source host (canonical address): its connections, and its share of the caller's time
/// per second (`time_per_second`), which all of them draw on.
struct HostShare {
    conns: usize,
    /// The caller's time its connections took, in nanoseconds since it came (its virtual
    /// time): a round reads hosts with input in the order of it plus their next message's cost
    /// (their finish tags).
    used_ns: i64,
    /// In nanoseconds, as of `rate_at`: it refills at that rate up to a tenth of a second's
    /// worth.
    rate_ns: i64,
    rate_at: Instant,
}

impl HostShare {
    /// A host that came at `now`, its time used starting at the system's virtual time (the
    /// listener's floor: a newcomer is never ahead of one that was served long).
    fn new(now: Instant, per_second: Option<Duration>, used_floor: i64) -> Self {
        HostShare {
            conns: 0,
            used_ns: used_floor,
            rate_ns: per_second.map_or(0, |r| nanos(r) / 10),
            rate_at: now,
        }
    }

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

    /// Whether it spent its time-per-second share (it then waits for the refill while a host
    /// under its share has input).
    fn over(&self, now: Instant, per_second: Option<Duration>) -> bool {
        per_second.is_some_and(|r| self.share_at(now, r) <= 0)
    }

    /// When a throttled share is back above zero.
    fn refilled_at(&self, now: Instant, per_second: Duration) -> Instant {
        let debt = u128::from(self.share_at(now, per_second).min(0).unsigned_abs());
        let wait = debt * 1_000_000_000 / per_second.as_nanos().max(1);
        now + Duration::from_nanos(u64::try_from(wait).unwrap_or(u64::MAX))
            + Duration::from_micros(1)
    }

    /// Takes `ns` of this thread's time from its time-per-second share (debt bounded to one
    /// second's share, so it waits at most a second, far inside its heartbeat timeout).
    fn spend(&mut self, ns: i64, per_second: Option<Duration>) {
        self.used_ns = self.used_ns.saturating_add(ns.max(0));
        if let Some(per_second) = per_second {
            let now = Instant::now().max(self.rate_at);
            self.rate_ns = self
                .share_at(now, per_second)
                .saturating_sub(ns)
                .max(-nanos(per_second));
            self.rate_at = now;
        }
    }
}

impl Peer {
    /// Drops what waits to be written (a connection whose write failed writes no more).
    fn drop_output(&mut self) {
        let queued = self.conn.transmit().len();
        self.conn.advance(queued);
    }

    /// Whether it has input to be given a round for: in its socket or its decoder.
    fn has_input(&self) -> bool {
        !self.paused && (self.readable || self.conn.holds_input())
    }
}

/// Reads connection `p`'s first byte without taking it, on a listener that takes TLS (`tls`),
/// whose offer ([`zmtp::TLS_OFFER`]) went at accept: a TLS handshake record starts its TLS
/// session, inside which our whole greeting goes; anything else is plaintext ZMTP, whose
/// greeting goes on after the offer's signature (a wrong greeting fails there, as from any
/// peer). Not come yet: it stays sniffing, unread until its next readiness.
fn sniff(p: &mut Peer, tls: Option<&crate::tls::Tls>) -> Result<(), LinkLoss> {
    let mut first = [0u8; 1];
    if sockio::peek_up_to(&p.stream, &mut first)? == 0 {
        p.readable = false;
        return Ok(());
    }
    let first = first[0];
    p.sniffing = false;
    match tls {
        Some(tls) if first == crate::tls::HANDSHAKE_RECORD => {
            let session = rustls::ServerConnection::new(tls.server())
                .map_err(|e| LinkLoss::Tls(e.to_string().into()))?;
            p.tls = Some(rustls::Connection::Server(session));
        }
        // The offer was our greeting's signature.
        _ => p.conn.advance(zmtp::SIGNATURE_LEN),
    }
    Ok(())
}

/// Takes `ns` of the caller's time from connection `p`'s round credit and its host's share;
/// when its host has a share, when that share was charged (the refill's reference).
fn spend(
    hosts: &mut HashMap<IpAddr, HostShare>,
    p: &mut Peer,
    ns: i64,
    per_second: Option<Duration>,
) -> Option<Instant> {
    p.credit_ns = p.credit_ns.saturating_sub(ns);
    let host = hosts.get_mut(&p.source)?;
    host.spend(ns, per_second);
    per_second.map(|_| host.rate_at)
}

/// Nanoseconds as an `i64`, saturating.
fn nanos(d: Duration) -> i64 {
    i64::try_from(d.as_nanos()).unwrap_or(i64::MAX)
}

/// A listener and its connections.
pub(crate) struct Listener {
    listener: TcpListener,
    /// TLS for connections that open with a TLS handshake (`None`: plaintext ZMTP only).
    tls: Option<crate::tls::Tls>,
    /// The listening socket's token; connection `id`'s is `base + id`.
    base: Token,
    role: Role,
    limits: ListenerLimits,
    peers: BTreeMap<ConnId, Peer>,
    next: ConnId,
    /// The poll said connections wait to be accepted, and no accept has found none since.
    pending_accepts: bool,
    accept_paused_until: Option<Instant>,
    /// Connections to give a round without a new event: input left over, a write the poll
    /// said may go on, or readiness not yet handled.
    active: BTreeSet<ConnId>,
    /// Each connection's next deadline (heartbeat, handshake, stall, refilled share).
    timers: Timers<ConnId>,
    /// Each source address's connections and time share (hosts first, then connections).
    hosts: HashMap<IpAddr, HostShare>,
    /// Hosts whose last connection closed less than [`HOST_MEMORY`] ago, with their shares,
    /// in the order they left (at most `max_connections` of them).
    departed: HashMap<IpAddr, (Instant, HostShare)>,
    departed_order: std::collections::VecDeque<(Instant, IpAddr)>,
    /// Connections with input held back this round because their host was over its share
    /// while another host under its share had input: given a round again at their host's
    /// refill, or as soon as no host under its share has input left (work-conserving).
    held: BTreeSet<ConnId>,
    /// Rounds a connection was held back that way (a metric: zero while nobody competes).
    held_back: u64,
    /// The system's virtual time (never decreasing): moved on by each round's work (reading
    /// measured, handling as charged) split among the hosts with input in it, and up to the
    /// least `used_ns` of the hosts that had input left after the round. A host whose input is
    /// new is ordered from just below it, so it goes first but cannot bank the time it did not
    /// use.
    used_floor: i64,
    /// The hosts that had input in the last round: only a host not among them (its input is
    /// new) is raised to the system's virtual time.
    had_input: HashSet<IpAddr>,
    /// Handling charged since the last round, in nanoseconds: it moves the system's virtual
    /// time on with the next round's reading.
    charged_since_round: i64,
    /// What all connections hold together (the sum of each's `buffered`).
    buffered: usize,
    refused: u64,
    refused_sources: u64,
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
            allowed_sources: None,
        }
    }
}

impl Listener {
    /// Listens at `addr` (port 0 picks one), registered in `poller` as `base` (its
    /// connections as `base + id`).
    pub(crate) fn bind(
        addr: SocketAddr,
        role: Role,
        limits: ListenerLimits,
        poller: &Poller,
        base: Token,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        poller.add_input(listener.as_fd(), base)?;
        // The one place the budgets are made usable: a zero share means none (a quantum or a
        // rate of zero would give a connection nothing, ever), a zero count one.
        let limits = ListenerLimits {
            read_budget: limits.read_budget.max(1),
            accepts_per_round: limits.accepts_per_round.max(1),
            round_quantum: limits.round_quantum.filter(|q| !q.is_zero()),
            time_per_second: limits.time_per_second.filter(|r| !r.is_zero()),
            allowed_sources: limits
                .allowed_sources
                .map(|a| a.iter().map(IpAddr::to_canonical).collect()),
            ..limits
        };
        Ok(Listener {
            listener,
            tls: None,
            base,
            role,
            limits,
            peers: BTreeMap::new(),
            next: 0,
            // Connections may have queued before the registration.
            pending_accepts: true,
            accept_paused_until: None,
            active: BTreeSet::new(),
            timers: Timers::default(),
            hosts: HashMap::new(),
            departed: HashMap::new(),
            departed_order: std::collections::VecDeque::new(),
            held: BTreeSet::new(),
            held_back: 0,
            used_floor: 0,
            had_input: HashSet::new(),
            charged_since_round: 0,
            buffered: 0,
            refused: 0,
            refused_sources: 0,
            evicted: 0,
        })
    }

    /// Takes TLS connections too (`None`: plaintext ZMTP only): each connection is offered
    /// TLS at accept ([`zmtp::TLS_OFFER`]), its first byte says which it speaks (a TLS
    /// handshake record, 0x16, or ZMTP's signature, 0xFF), and the rest of our greeting waits
    /// for it. Whether a plaintext one may stay is the owner's to decide
    /// ([`Listener::tls_of`]).
    pub(crate) fn set_tls(&mut self, tls: Option<crate::tls::Tls>) {
        self.tls = tls;
    }

    /// Whether connection `id` runs over TLS (`None`: no such connection).
    pub(crate) fn is_tls(&self, id: ConnId) -> Option<bool> {
        self.peers.get(&id).map(|p| p.tls.is_some())
    }

    /// The address bound.
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    /// Whether `token` is this listener's (the listening socket or one of its connections),
    /// given the owner's token space: `base ..= base + span`.
    pub(crate) fn owns(&self, token: Token, span: u64) -> bool {
        token >= self.base && token - self.base <= span
    }

    /// Connections open now.
    pub(crate) fn connections(&self) -> usize {
        self.peers.len()
    }

    /// Connections refused over the caps (only when no slot can be had: caps of zero).
    pub(crate) fn refused(&self) -> u64 {
        self.refused
    }

    /// Connections from a source `allowed_sources` does not name, closed at their accept.
    pub(crate) fn refused_sources(&self) -> u64 {
        self.refused_sources
    }

    /// Connections closed to make room for a newcomer.
    pub(crate) fn evicted(&self) -> u64 {
        self.evicted
    }

    /// The connections' numbers, in order.
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

    /// Pauses connection `id` (not read, nothing of it delivered, its heartbeats and deadlines
    /// still run) or resumes it: the caller holds work of it that must be done first (a large
    /// message it decodes a slice at a time), and what the connection sends meanwhile waits in
    /// its socket, so nothing queues without bound in the caller. A connection being drained
    /// (its peer was lost) is read to its end all the same.
    pub(crate) fn set_paused(&mut self, id: ConnId, paused: bool) {
        if let Some(p) = self.peers.get_mut(&id) {
            let resumed = p.paused && !paused;
            p.paused = paused;
            if resumed {
                // What arrived meanwhile, or its end of stream, gets a round.
                self.active.insert(id);
            }
        }
    }

    /// Connection `id`'s handling of one message cost the caller `cost` (with `round_quantum`).
    pub(crate) fn charge(&mut self, id: ConnId, cost: Duration) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        let ns = nanos(cost);
        // Up at once, down slowly: a connection whose messages turned expensive is not given
        // a round's worth of them at what they used to cost.
        let average = (p
            .cost_ns
            .saturating_mul(7)
            .saturating_add(ns.unsigned_abs()))
            / 8;
        p.cost_ns = average.max(ns.unsigned_abs());
        let per_second = self.limits.time_per_second;
        self.charged_since_round = self.charged_since_round.saturating_add(ns.max(0));
        if let Some(now) = spend(&mut self.hosts, p, ns, per_second) {
            // A share spent: held-back input waits for the refill, which its deadline wakes.
            self.rearm(id, now);
        }
    }

    /// Rounds connections were held back for their host's share while another host waited.
    pub(crate) fn held_back(&self) -> u64 {
        self.held_back
    }

    /// Readiness the owner's poll reported for `token` (this listener's).
    pub(crate) fn on_ready(&mut self, ready: Ready) {
        let id = ready.token - self.base;
        if id == 0 {
            self.pending_accepts |= ready.readable;
            return;
        }
        if let Some(p) = self.peers.get_mut(&id) {
            p.readable |= ready.readable;
            p.writable |= ready.writable;
            p.closed |= ready.closed;
            self.active.insert(id);
        }
    }

    /// Whether the listening socket is polled at `now` (not while it rests after a failed
    /// `accept`; [`Listener::deadline`] wakes the caller when that ends).
    fn listening(&self, now: Instant) -> bool {
        self.accept_paused_until.is_none_or(|until| now >= until)
    }

    /// When [`Listener::progress`] has something to do without a new event: now while
    /// connections wait to be accepted or to be given a round (`reading`: their sockets may be
    /// read; else only input held in their decoders counts), else the earliest deadline.
    pub(crate) fn deadline(&mut self, now: Instant, reading: bool) -> Option<Instant> {
        if self.pending_accepts && self.listening(now) {
            return Some(now);
        }
        let work =
            |p: &Peer| (reading && p.readable) || p.conn.holds_input() || p.closed || p.writable;
        if self
            .active
            .iter()
            .any(|id| self.peers.get(id).is_some_and(work))
        {
            return Some(now);
        }
        let paused = self.accept_paused_until.filter(|_| self.pending_accepts);
        self.timers.next().into_iter().chain(paused).min()
    }

    /// Queues a message to connection `id` at `now` (not written yet: [`Listener::flush`]).
    pub(crate) fn queue(
        &mut self,
        now: Instant,
        id: ConnId,
        parts: &[&[u8]],
    ) -> Result<(), QueueFull> {
        let p = match self.peers.get_mut(&id) {
            // One whose write failed takes nothing more (it only has its input read).
            Some(p) if p.conn.is_ready() && p.ending.is_none() => p,
            _ => return Err(QueueFull),
        };
        if p.conn.transmit().is_empty() {
            // The stall clock starts when bytes start waiting.
            p.last_written = now;
        }
        p.conn.queue(parts)?;
        self.account(id);
        Ok(())
    }

    /// Writes what connection `id` has queued until its socket would block. A connection whose
    /// write fails writes nothing more, and ends once its input is read to the end (reported by
    /// [`Listener::progress`]).
    pub(crate) fn flush(&mut self, now: Instant, id: ConnId) {
        let Some(p) = self.peers.get_mut(&id) else {
            return;
        };
        if p.ending.is_some() {
            // Its heartbeats and answers go nowhere: dropped, so nothing waits to be written.
            p.drop_output();
            p.last_written = now;
            self.account(id);
            self.rearm(id, now);
            return;
        }
        if p.sniffing {
            // The rest of our greeting waits for its first byte (TLS or not).
            p.last_written = now;
            self.rearm(id, now);
            return;
        }
        let tls_pending = p.tls.as_ref().is_some_and(|t| t.wants_write());
        if !p.writable || (p.conn.transmit().is_empty() && !tls_pending) {
            if p.conn.transmit().is_empty() {
                p.last_written = now;
            }
            self.rearm(id, now);
            return;
        }
        match sockio::write_available(&mut p.stream, p.tls.as_mut(), &mut p.conn) {
            Ok(wrote) => {
                p.writable = !wrote.blocked;
                if wrote.any && self.limits.engage_on_request {
                    // A subscriber taking our messages is at work; our own PINGs to a control
                    // connection say nothing of it.
                    p.last_active = now;
                }
                if wrote.any || p.conn.transmit().is_empty() {
                    p.last_written = now;
                }
                self.account(id);
                self.rearm(id, now);
            }
            Err(reason) => {
                // Not closed yet: the peer's input still in its socket or decoder is read first
                // (a peer that sent its `disconnect` and closed resets the connection when our
                // next PING reaches it; closing here would lose that message). The read ends
                // at the end of its stream or the socket's error, which a failed socket has.
                p.ending = Some(reason);
                p.readable = true;
                p.drop_output();
                self.account(id);
                self.rearm(id, now);
                self.active.insert(id);
            }
        }
    }

    /// Tells `identity` in the READY of every connection accepted from now on
    /// ([`crate::zmtp::IDENTITY_PROPERTY`]).
    pub(crate) fn announce(&mut self, identity: &[u8]) {
        self.role.announce = Some(identity.to_vec());
    }

    /// Closes connection `id` after telling the peer why (a ZMTP ERROR written now, best
    /// effort: a few bytes a fresh socket buffer always takes), reporting it in `out`.
    pub(crate) fn refuse(&mut self, id: ConnId, reason: &str, out: &mut Vec<(ConnId, LinkEvent)>) {
        if let Some(p) = self.peers.get_mut(&id) {
            p.conn.queue_error(reason);
            if !p.sniffing {
                let _ = sockio::write_available(&mut p.stream, p.tls.as_mut(), &mut p.conn);
            }
        }
        self.close(id, LinkLoss::ClosedHere, out);
    }

    /// Closes connection `id`, reporting it in `out`.
    pub(crate) fn close(
        &mut self,
        id: ConnId,
        reason: LinkLoss,
        out: &mut Vec<(ConnId, LinkEvent)>,
    ) {
        let started = Instant::now();
        let Some(p) = self.peers.remove(&id) else {
            return;
        };
        let _ = p.stream.shutdown(std::net::Shutdown::Both);
        self.buffered = self.buffered.saturating_sub(p.buffered);
        let source = p.source;
        // The socket's close is part of what the connection cost.
        drop(p.stream);
        if let Some(h) = self.hosts.get_mut(&source) {
            h.spend(nanos(started.elapsed()), self.limits.time_per_second);
            h.conns = h.conns.saturating_sub(1);
            if h.conns == 0 {
                // Its share is kept a while (`HOST_MEMORY`): a host that reconnects comes back
                // with the debt it left, not as a newcomer.
                if let Some(share) = self.hosts.remove(&source) {
                    self.remember_departed(source, share, started);
                }
            }
        }
        self.active.remove(&id);
        self.held.remove(&id);
        self.timers.set(id, None);
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

    /// Keeps the share of `host`, whose last connection closed at `now`, for [`HOST_MEMORY`].
    fn remember_departed(&mut self, host: IpAddr, share: HostShare, now: Instant) {
        self.forget_departed(now);
        if self.departed.len() >= self.limits.max_connections.max(1) {
            // Full (a churn of more hosts than connections in a second): the oldest go first.
            while let Some((at, old)) = self.departed_order.pop_front() {
                if self.departed.get(&old).is_some_and(|(left, _)| *left == at) {
                    self.departed.remove(&old);
                    break;
                }
            }
        }
        self.departed.insert(host, (now, share));
        self.departed_order.push_back((now, host));
    }

    /// Drops the departed hosts' shares older than [`HOST_MEMORY`].
    fn forget_departed(&mut self, now: Instant) {
        let cap = self.limits.max_connections.max(1).saturating_mul(2);
        if self.departed_order.len() > cap {
            // Entries of hosts that came back (or left again) since: only the live ones count.
            let departed = &self.departed;
            self.departed_order
                .retain(|(at, host)| departed.get(host).is_some_and(|(left, _)| left == at));
        }
        while let Some(&(at, host)) = self.departed_order.front() {
            if now.saturating_duration_since(at) < HOST_MEMORY && self.departed_order.len() <= cap {
                break;
            }
            self.departed_order.pop_front();
            if self
                .departed
                .get(&host)
                .is_some_and(|(left, _)| *left == at)
            {
                self.departed.remove(&host);
            }
        }
    }

    /// The share of `host`, which has a new connection at `now`: its own while it has others,
    /// the one it left if it left less than [`HOST_MEMORY`] ago, else a newcomer's.
    fn host_share(&mut self, host: IpAddr, now: Instant) -> &mut HostShare {
        if !self.hosts.contains_key(&host) {
            self.forget_departed(now);
        }
        let (departed, per_second, floor) = (
            &mut self.departed,
            self.limits.time_per_second,
            self.used_floor,
        );
        self.hosts
            .entry(host)
            .or_insert_with(|| match departed.remove(&host) {
                Some((_, share)) => share,
                None => HostShare::new(now, per_second, floor),
            })
    }

    /// Counts connection `id`'s buffers into the total again.
    fn account(&mut self, id: ConnId) {
        if let Some(p) = self.peers.get_mut(&id) {
            let now = p.conn.buffered();
            self.buffered = self.buffered.saturating_sub(p.buffered).saturating_add(now);
            p.buffered = now;
        }
    }

    /// Sets connection `id`'s next deadline: its protocol's (heartbeats, handshake) and the
    /// stall of bytes waiting on the coarse grid (many connections share a wake), the refill
    /// of its host's spent share while it has input at its time (a busy peer held back for a
    /// few hundred microseconds must not wait for the grid's next boundary: measured, a
    /// consumer's lookup p99 went from under 1 ms to 7 ms that way).
    fn rearm(&mut self, id: ConnId, now: Instant) {
        let Some(p) = self.peers.get(&id) else {
            return;
        };
        let stalled =
            (!p.conn.transmit().is_empty()).then_some(p.last_written + self.limits.stall_timeout);
        // Only a connection held back waits for its host's refill (one that is not, because
        // no other host competes, is read on: no wake is needed for it).
        let per_second = self.limits.time_per_second;
        let held = self.held.contains(&id);
        let refilled = self.hosts.get(&p.source).and_then(|h| {
            per_second
                .filter(|_| held && p.has_input() && h.over(now, per_second))
                .map(|r| h.refilled_at(now, r))
        });
        let grid = [p.conn.poll_timeout(), stalled]
            .into_iter()
            .flatten()
            .min()
            .map(coarse);
        let at = grid.into_iter().chain(refilled).min();
        self.timers.set(id, at);
    }

    /// Accepts what waits, gives each connection that needs one its round (what its decoder
    /// held from the last one, then its socket when `reading`), runs the deadlines due at `now`
    /// and writes what is queued; the connections in `drain` (sorted) are read to the end this
    /// round, whatever their shares: the caller must see everything they sent before it acts on
    /// their peer's loss. New connections are registered in `poller`. What happened goes to
    /// `out`.
    pub(crate) fn progress(
        &mut self,
        poller: &Poller,
        now: Instant,
        reading: bool,
        drain: &[ConnId],
        out: &mut Vec<(ConnId, LinkEvent)>,
    ) {
        if self.accept_paused_until.is_some_and(|until| now >= until) {
            self.accept_paused_until = None;
        }
        if self.pending_accepts {
            // New connections send their greeting and READY at once.
            for id in self.accept(poller, now, out) {
                self.flush(now, id);
            }
        }
        let mut due = Vec::new();
        self.timers.take_due(now, &mut due);
        let mut visit: BTreeSet<ConnId> = std::mem::take(&mut self.active);
        visit.extend(due);
        visit.extend(
            drain
                .iter()
                .copied()
                .filter(|id| self.peers.contains_key(id)),
        );
        let per_second = self.limits.time_per_second;
        let drained = |id: ConnId| drain.binary_search(&id).is_ok();
        let is_read = |p: &Peer, id: ConnId| (reading && p.readable && !p.paused) || drained(id);
        // Input to give it this round (a paused connection has none until resumed).
        let has_work = |p: &Peer, id: ConnId| {
            is_read(p, id) || (p.conn.holds_input() && (!p.paused || drained(id)))
        };
        // Hosts first: the connections of each host with input this round, and whether any
        // host under its time share has input. Only then is a host over its share held back
        // (work-conserving: a host alone, or hosts all over their shares, get the whole
        // thread, split by the round robin below).
        let mut inputs: HashMap<IpAddr, usize> = HashMap::new();
        let shared = per_second.is_some() || self.limits.round_quantum.is_some();
        for p in visit
            .iter()
            .filter(|_| shared)
            .filter_map(|id| self.peers.get(id).filter(|p| has_work(p, *id)))
        {
            *inputs.entry(p.source).or_default() += 1;
        }
        let over = |hosts: &HashMap<IpAddr, HostShare>, source: &IpAddr| {
            hosts.get(source).is_some_and(|h| h.over(now, per_second))
        };
        let contended = per_second.is_some()
            && inputs.len() > 1
            && inputs.keys().any(|source| !over(&self.hosts, source));
        let held_back = |hosts: &HashMap<IpAddr, HostShare>, p: &Peer, id: ConnId| {
            contended && !drained(id) && over(hosts, &p.source)
        };
        // Deficit round robin over hosts, then over a host's connections: every host with input
        // gets the same number of quanta this round, as many as it takes for one of its
        // connections to be out of debt (one, unless all are in debt: then no round is wasted
        // on giving nobody anything), split among its connections with input, so many
        // connections buy a host nothing.
        let quanta = self.limits.round_quantum.map(|q| {
            let q = nanos(q);
            visit
                .iter()
                .filter_map(|id| self.peers.get(id).map(|p| (*id, p)))
                .filter(|(id, p)| has_work(p, *id) && !held_back(&self.hosts, p, *id))
                .map(|(_, p)| {
                    let split = inputs.get(&p.source).copied().unwrap_or(1).max(1);
                    let q = (q / i64::try_from(split).unwrap_or(i64::MAX)).max(1);
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
        // Hosts in the order of their finish tags, and with a quantum about one quantum of
        // work per round in all (one connection's messages at least): the round ends there and
        // the rest have theirs next, at once. So a cheap message of a host level with the
        // others (an honest consumer's lookup) waits for at most one round's work, not for a
        // message of every host that floods, however many they are. Connections without
        // input to compete with (timers, writes, drains) come first: they cost next to
        // nothing, or must not wait.
        let round_budget = self.limits.round_quantum.map(nanos);
        let floor = self.used_floor.saturating_sub(round_budget.unwrap_or(0));
        if round_budget.is_some() {
            // A host whose input is new (it had none in the last round) starts no further back
            // than just below the system's virtual time: what it did not use while idle is not
            // banked (stored, not only ordered by, so it cannot go first for long after it
            // returns). A host that kept input keeps its place: the service it is owed while
            // cheaper messages go first is not taken from it (weighted fair queueing's start
            // tag).
            for source in inputs.keys() {
                if self.had_input.contains(source) {
                    continue;
                }
                if let Some(h) = self.hosts.get_mut(source) {
                    h.used_ns = h.used_ns.max(floor);
                }
            }
            self.had_input.clear();
            self.had_input.extend(inputs.keys().copied());
        }
        let competes_now = |p: &Peer, id: ConnId| {
            round_budget.is_some()
                && has_work(p, id)
                && !drained(id)
                && !held_back(&self.hosts, p, id)
        };
        // Each host's finish tag: where its time would stand after the next message of the
        // connection it serves first (one with a session, then the one with the most round
        // credit), at what that connection's messages cost lately. A host whose next message
        // is cheap (an honest consumer's lookup) goes before one level with it whose next
        // message is costly (8,192 keys to decode), as weighted fair queueing orders packets;
        // a cheap connection beside a costly one that goes first buys its host nothing.
        let mut first: HashMap<IpAddr, ((bool, i64, ConnId), u64)> = HashMap::new();
        for (id, p) in visit
            .iter()
            .filter_map(|id| self.peers.get(id).map(|p| (*id, p)))
        {
            if competes_now(p, id) {
                let order = (!p.engaged, p.credit_ns.saturating_neg(), id);
                let entry = first.entry(p.source).or_insert((order, p.cost_ns));
                if order < entry.0 {
                    *entry = (order, p.cost_ns);
                }
            }
        }
        // Within a host, connections at work first (a session bound: an honest consumer beside
        // a flood of its own host's connections that have none), then the one with the most
        // round credit (whose messages cost least lately).
        let mut ordered: Vec<(i64, bool, i64, ConnId)> = visit
            .into_iter()
            .map(|id| match self.peers.get(&id) {
                Some(p) if competes_now(p, id) => {
                    let host = self.hosts.get(&p.source).map_or(floor, |h| h.used_ns);
                    let cost = first.get(&p.source).map_or(p.cost_ns, |(_, cost)| *cost);
                    let finish = host.saturating_add(i64::try_from(cost).unwrap_or(i64::MAX));
                    (finish, !p.engaged, p.credit_ns.saturating_neg(), id)
                }
                _ => (i64::MIN, false, 0, id),
            })
            .collect();
        ordered.sort_unstable();
        let mut spent: i64 = 0;
        let mut read_spent: i64 = 0;
        let mut read_any = false;
        for (key, _, _, id) in ordered {
            let competes = key != i64::MIN;
            if competes && round_budget.is_some_and(|budget| spent >= budget) {
                // Its turn is the next round's, which comes at once.
                self.active.insert(id);
                continue;
            }
            let held = match self.peers.get(&id) {
                Some(p) => held_back(&self.hosts, p, id),
                None => continue,
            };
            // Held again below if it still is (a refill's wake, or new readiness, visits it).
            self.held.remove(&id);
            let Some(p) = self.peers.get_mut(&id) else {
                continue;
            };
            let read = is_read(p, id);
            read_any |= read;
            // A drained connection's peer was lost: the caller must see all it sent first (its
            // last messages, its `disconnect`, come before the loss), whatever its shares.
            let drain = drained(id);
            // Its host's part of this round, split among the host's connections with input.
            let split = i64::try_from(inputs.get(&p.source).copied().unwrap_or(1).max(1))
                .unwrap_or(i64::MAX);
            // What this round may take of it: with a quantum, as many messages as its credit
            // covers at what they cost lately (none while it is in debt or held back), else
            // `max_incoming`.
            let share = match (self.limits.round_quantum, quanta) {
                _ if drain => usize::MAX,
                _ if p.paused => 0,
                (Some(_), _) if held => 0,
                (Some(quantum), Some(quanta)) => {
                    let quantum = (nanos(quantum) / split).max(1);
                    let quanta = (quanta / split).max(1);
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
            // Decoding input held from an earlier round costs as much as reading new input.
            let works = read || p.conn.holds_input();
            let budget = self.limits.read_budget;
            let stall = self.limits.stall_timeout;
            let tls = self.tls.as_ref();
            let mut step = || -> Result<(), LinkLoss> {
                if share > 0 {
                    if p.conn.holds_input() {
                        p.conn.decode_held(now).map_err(loss_of)?;
                    }
                    if read && p.sniffing {
                        sniff(p, tls)?;
                    }
                    if read && !p.sniffing && !p.conn.holds_input() {
                        // Reading stops once the connection holds this round's share, so what
                        // it sent beyond (its end of stream too) waits in the socket.
                        let conn = &mut p.conn;
                        let end =
                            sockio::read_while(&mut p.stream, p.tls.as_mut(), budget, |bytes| {
                                conn.handle_bytes(bytes, now).map_err(loss_of)?;
                                Ok(!conn.decoding_paused())
                            })?;
                        // A socket that hung up or failed always has its end of stream or its
                        // error left to read after its last bytes (a short read stops before
                        // it): read again next round, so it ends then rather than spinning
                        // unread (the poll reports a hang-up once).
                        p.readable = end == ReadEnd::More || p.closed || p.ending.is_some();
                    }
                }
                p.conn.handle_timeout(now).map_err(loss_of)?;
                if !p.conn.transmit().is_empty()
                    && now.saturating_duration_since(p.last_written) >= stall
                {
                    return Err(LinkLoss::Stalled(stall));
                }
                Ok(())
            };
            let started = Instant::now();
            let result = step();
            if works && share > 0 && !drain {
                // Reading and decoding cost this thread too, whether or not a message came of
                // it (a flood of PINGs or unknown commands hands the caller nothing to charge):
                // the connection pays it from its shares like the caller's handling.
                spend(&mut self.hosts, p, nanos(started.elapsed()), per_second);
            }
            if !was_ready && p.conn.is_ready() {
                out.push((
                    id,
                    LinkEvent::Ready {
                        identity: p.conn.peer_identity().unwrap_or_default().to_vec(),
                        source: Some(p.source),
                        tls: TlsState::of(p.tls.as_ref()),
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
            if competes {
                // What this round took of the caller: reading and decoding now, handling the
                // messages taken as they cost lately (charged when handled).
                let handling =
                    i64::try_from(p.cost_ns.saturating_mul(taken as u64)).unwrap_or(i64::MAX);
                let read = nanos(started.elapsed());
                read_spent = read_spent.saturating_add(read);
                spent = spent.saturating_add(read).saturating_add(handling);
            }
            match result {
                Ok(()) => {
                    // Input left (its share was taken, or the socket was not drained) gets the
                    // next round at once, unless its time share is spent: its refill wakes it.
                    let more = (p.readable && reading) || p.conn.holds_input();
                    if p.paused {
                        // Resuming it gives it a round.
                    } else if held && (more || p.closed) {
                        // Not read while held, even when the poll says it hung up: what it
                        // sent before waits for its share like the rest (its end of stream
                        // comes after it).
                        self.held_back += 1;
                        self.held.insert(id);
                    } else if more || p.closed {
                        self.active.insert(id);
                    }
                    self.flush(now, id);
                    self.account(id);
                }
                Err(reason) => {
                    // A connection whose write failed first ends for that reason.
                    let first = self.peers.get_mut(&id).and_then(|p| p.ending.take());
                    self.close(id, first.unwrap_or(reason), out)
                }
            }
        }
        if read_any && self.buffered > self.limits.max_buffered_bytes {
            // Buffers grow only by reading.
            self.shed_buffers(out);
        }
        self.release_held(now);
        if round_budget.is_some() {
            // The work actually done: this round's reading, and the handling charged since
            // the last round (estimates of it, which fall slowly, would run the system's time
            // ahead of every host's).
            let handled = std::mem::take(&mut self.charged_since_round);
            self.advance_floor(read_spent.saturating_add(handled), inputs.len());
        }
    }

    /// Moves `used_floor` (the system's virtual time) on after a round in which the caller
    /// did `spent` of work for `hosts` hosts with input: by `spent / hosts`, what each of them
    /// would have had of it in an equal split, then up to the least-served host that still has
    /// input (it never falls). So a host that used the thread while nobody else wanted it
    /// (an honest consumer alone beside hosts that send now and then) is not behind them for
    /// it afterwards, and a host that idled starts from it, not from what it left unused.
    fn advance_floor(&mut self, spent: i64, hosts: usize) {
        let hosts = i64::try_from(hosts.max(1)).unwrap_or(i64::MAX);
        self.used_floor = self.used_floor.saturating_add(spent.max(0) / hosts);
        self.raise_floor();
    }

    /// Raises `used_floor` to the least-served host that still has input (it never falls:
    /// a host that had none meanwhile starts from it, not from what it left unused).
    fn raise_floor(&mut self) {
        let least = self
            .active
            .iter()
            .filter_map(|id| self.peers.get(id))
            .filter(|p| p.has_input())
            .filter_map(|p| self.hosts.get(&p.source).map(|h| h.used_ns))
            .min();
        if let Some(least) = least {
            self.used_floor = self.used_floor.max(least);
        }
    }

    /// Gives the held-back connections a round again once no host under its share has input
    /// left to go first (work-conserving: the thread never idles while input waits).
    fn release_held(&mut self, now: Instant) {
        if self.held.is_empty() {
            return;
        }
        let per_second = self.limits.time_per_second;
        let waits_under_share = self.active.iter().any(|id| {
            self.peers.get(id).is_some_and(|p| {
                p.has_input()
                    && self
                        .hosts
                        .get(&p.source)
                        .is_some_and(|h| !h.over(now, per_second))
            })
        });
        if !waits_under_share {
            self.active.append(&mut self.held);
        }
    }

    /// Closes the connection holding the most while all together hold more than
    /// `max_buffered_bytes`, so many connections holding large partial messages cannot exhaust
    /// memory.
    fn shed_buffers(&mut self, out: &mut Vec<(ConnId, LinkEvent)>) {
        while self.buffered > self.limits.max_buffered_bytes {
            let Some((&hog, _)) = self.peers.iter().max_by_key(|(_, p)| p.buffered) else {
                return;
            };
            if let Some(suppressed) = crate::admit_warning("listener buffers over the cap") {
                warn!(
                    total = self.buffered,
                    cap = self.limits.max_buffered_bytes,
                    suppressed,
                    role = self.role.socket_type,
                    "closing the connection holding the most buffered bytes"
                );
            }
            self.close(hog, LinkLoss::OverBuffers, out);
        }
    }

    /// Makes a slot for a newcomer from `source` when a cap is reached, closing the holder the
    /// admission policy names (reported in `out`); `false` when no slot can be had.
    fn make_room(&mut self, source: IpAddr, out: &mut Vec<(ConnId, LinkEvent)>) -> bool {
        let caps = Caps {
            max_connections: self.limits.max_connections,
            max_per_source: self.limits.max_per_source,
        };
        let from_source = |l: &Self| l.hosts.get(&source).map_or(0, |h| h.conns);
        let fits =
            |l: &Self| l.peers.len() < caps.max_connections && from_source(l) < caps.max_per_source;
        if fits(self) {
            return true;
        }
        // A cap is reached: only now is every holder looked at.
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
            self.close(victim, LinkLoss::Evicted, out);
        }
        fits(self)
    }

    /// Accepts up to `accepts_per_round` waiting connections; their numbers.
    fn accept(
        &mut self,
        poller: &Poller,
        now: Instant,
        out: &mut Vec<(ConnId, LinkEvent)>,
    ) -> Vec<ConnId> {
        let mut accepted = Vec::new();
        if !self.listening(now) {
            return accepted;
        }
        self.accept_paused_until = None;
        for _ in 0..self.limits.accepts_per_round {
            // What accepting costs this thread (the call, the checks, the setup) is charged to
            // the host that connected.
            let started = Instant::now();
            let (mut stream, source) = match sockio::accept(&self.listener) {
                Accepted::Stream(stream, source) => (stream, source),
                Accepted::None => {
                    self.pending_accepts = false;
                    break;
                }
                Accepted::Failed(e) => {
                    if let Some(suppressed) = crate::admit_warning("cannot accept") {
                        warn!(error = %e, suppressed, role = self.role.socket_type,
                            "cannot accept a connection");
                    }
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    break;
                }
            };
            if let Some(allowed) = &self.limits.allowed_sources {
                if !allowed.contains(&source.to_canonical()) {
                    // Closed before anything is read from it or sent to it, and before it
                    // could take a slot (or make room by evicting an allowed one).
                    self.refused_sources += 1;
                    if let Some(suppressed) = crate::admit_warning("connection source refused") {
                        warn!(%source, ?allowed, suppressed, role = self.role.socket_type,
                            "a connection from an address not allowed here: closed");
                    }
                    continue;
                }
            }
            if self.tls.is_some() {
                // Our offer of TLS goes first: a dialer that wants TLS waits for it (see
                // `zmtp::TLS_OFFER`). A fresh socket takes its 10 bytes. Written before a slot
                // is made, so a socket that fails it evicts nobody.
                if let Err(e) = sockio::write_opening(&mut stream, &zmtp::TLS_OFFER) {
                    debug!(%source, error = %e, "an accepted connection took no TLS offer; closed");
                    continue;
                }
            }
            // An eviction's close is charged to the evicted connection's host (`close`), not
            // again to this one's.
            let room_started = Instant::now();
            let room = self.make_room(source, out);
            let making_room = room_started.elapsed();
            if !room {
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
            let id = self.next + 1;
            if let Err(e) = poller.add(stream.as_fd(), self.base + id) {
                if let Some(suppressed) = crate::admit_warning("cannot poll a connection") {
                    warn!(error = %e, suppressed, role = self.role.socket_type,
                        "cannot poll an accepted connection; closing it");
                }
                continue;
            }
            self.next = id;
            let mut conn = Connection::new(role, self.limits.conn.clone());
            conn.connected(now);
            debug!(id, %source, role = self.role.socket_type, "connection accepted");
            self.host_share(source, now).conns += 1;
            self.peers.insert(
                id,
                Peer {
                    stream,
                    tls: None,
                    sniffing: self.tls.is_some(),
                    source,
                    conn,
                    // Its READY may have come with the connection.
                    readable: true,
                    writable: true,
                    closed: false,
                    ending: None,
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
                    buffered: 0,
                    paused: false,
                },
            );
            self.active.insert(id);
            self.account(id);
            if let Some(p) = self.peers.get_mut(&id) {
                spend(
                    &mut self.hosts,
                    p,
                    nanos(started.elapsed().saturating_sub(making_room)),
                    self.limits.time_per_second,
                );
            }
            accepted.push(id);
        }
        accepted
    }
}
