//! The receive side of the tcp plane: the data port's listener, its caps, the keys this node
//! issued, and every inbound connection, all on one thread over one epoll set, whatever the
//! number of peers. Each connection is a state machine fed by non-blocking reads: its HELLO
//! (refused at the first wrong byte), then WRITEs read straight into the pool through the
//! claim of their blocks, each acknowledged; what a connection sent beyond what its state can
//! take waits in its socket, and a slow or silent writer only keeps its own connection open
//! until its deadline.
//!
//! Admission: at most [`ACCEPT_BATCH`] accepts per turn, the connections they bring read before
//! more are taken; within the caps (`max_connections` in all, `max_handshaking` in their
//! HELLO), and over either one a connection still in its HELLO makes room: the oldest of the
//! source holding the most of them (the newcomer counted), reset rather than shut, so a flood
//! from one address pushes out its own connections, not a writer's from another. With every
//! open connection past its HELLO and the total cap reached, the newcomer is refused (reset).
//!
//! Deadlines (one heap, each connection's next one): the HELLO within `hello_timeout` of the
//! accept; between frames at most `idle_timeout`; once a frame started, its header within
//! `frame_timeout` and each block within `frame_timeout` of the part before (a large WRITE
//! under the writer's rate cap may take longer than that as a whole, but never stalls that
//! long); an ACK that the writer does not take within `frame_timeout` closes the connection.
//!
//! Closing from the core's thread (a key replaced or withdrawn, a load that ended) goes
//! through the [`Gate`], which knows each connection's descriptor: `shutdown(2)` on it under
//! the gate's lock, which this thread also holds to forget a connection before it closes the
//! descriptor, so the descriptor is never one reused for something else. The thread then sees
//! the connection end at once.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::IpAddr;
use std::net::{TcpListener, TcpStream};
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_core::{BlockIndex, TransferId};
use kvpeer_proto::PeerId;
use kvpeer_store::{PoolWriter, WriteClaim};
use subtle::ConstantTimeEq;
use tracing::{debug, warn};

use super::wire::{self, WireError, HELLO_START_LEN, WRITE_HEAD_LEN};
use super::{Counters, TcpLimits, TlsSlot, KEY_LEN};
use crate::io::poller::{Poller, Ready, Token};
use crate::io::sockio::{self, Accepted};
use crate::io::timers::Timers;
use crate::lock;
use crate::tls::TlsPolicy;

/// How long the listener rests after `accept` fails (EMFILE and the like) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// At most one warning per this long about failing accepts (the rest are counted).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(1);
/// Connections one round accepts at most before the connections it took are read: a writer's
/// HELLO, already in its socket, is read before a flood behind it can push it out.
const ACCEPT_BATCH: usize = 16;

/// Tokens of the thread's poll: its wake pipe, the listener, connections from `CONNS` on.
const WAKE: Token = 0;
const LISTENER: Token = 1;
const CONNS: Token = 2;

/// A key issued to one writer id by our `connect` to it.
struct Issued {
    key: [u8; KEY_LEN],
    /// Tells this key from earlier ones for the same writer.
    generation: u64,
}

/// An open inbound connection as the gate knows it.
struct Entry {
    /// Its descriptor, open as long as the entry (the receiver forgets the entry, under the
    /// gate's lock, before it closes the descriptor).
    fd: RawFd,
    /// Past its HELLO: the writer and the generation of the key it presented.
    writer: Option<(PeerId, u64)>,
    /// The blocks of the WRITE it is reading (claimed, not yet acknowledged).
    claimed: Vec<BlockIndex>,
}

/// Issued keys and open inbound connections, under one lock so that authenticating a
/// connection and withdrawing its key cannot interleave.
#[derive(Default)]
pub(super) struct Gate {
    keys: HashMap<PeerId, Issued>,
    /// Writers whose `connect` offered TLS, while this node uses it: their HELLO is taken only
    /// over TLS (their key may have been read off the plaintext control channel).
    tls_only: HashSet<PeerId>,
    /// By connection number: the oldest first.
    conns: BTreeMap<u64, Entry>,
    next_generation: u64,
}

/// Ends connection `fd` both ways from any thread: its reader sees the end at once. Called
/// only under the gate's lock, which guarantees `fd` is still the connection's (see the module
/// documentation); `shutdown(2)` touches no memory of ours.
fn shut(fd: RawFd) {
    let _ = nix::sys::socket::shutdown(fd, nix::sys::socket::Shutdown::Both);
}

impl Gate {
    /// Whether `writer`'s connections must be TLS.
    pub(super) fn set_tls_only(&mut self, writer: &PeerId, only: bool) {
        if only {
            self.tls_only.insert(writer.clone());
        } else {
            self.tls_only.remove(writer);
        }
    }

    /// (connections past their HELLO, connections still in it).
    pub(super) fn counts(&self) -> (usize, usize) {
        let authenticated = self.conns.values().filter(|c| c.writer.is_some()).count();
        (authenticated, self.conns.len() - authenticated)
    }

    /// Issues `key` to `writer`, replacing its earlier key; returns how many connections that
    /// presented the earlier key were closed.
    pub(super) fn issue(&mut self, writer: &PeerId, key: [u8; KEY_LEN]) -> usize {
        self.next_generation += 1;
        let issued = Issued {
            key,
            generation: self.next_generation,
        };
        self.keys.insert(writer.clone(), issued);
        self.close_writer(writer)
    }

    /// Withdraws `writer`'s key; returns how many connections that presented it were closed.
    pub(super) fn withdraw(&mut self, writer: &PeerId) -> usize {
        self.keys.remove(writer);
        self.close_writer(writer)
    }

    /// Ends every inbound connection (the plane is going).
    fn close_all(&mut self) {
        for (_, c) in std::mem::take(&mut self.conns) {
            shut(c.fd);
        }
    }

    /// Ends the connections authenticated as `writer` with a key other than its current one.
    fn close_writer(&mut self, writer: &PeerId) -> usize {
        let current = self.keys.get(writer).map(|k| k.generation);
        let stale: Vec<u64> = self
            .conns
            .iter()
            .filter(
                |(_, c)| matches!(&c.writer, Some((w, g)) if w == writer && Some(*g) != current),
            )
            .map(|(id, _)| *id)
            .collect();
        for id in &stale {
            if let Some(c) = self.conns.remove(id) {
                shut(c.fd);
            }
        }
        stale.len()
    }

    /// The load that gave `writer` the permits for `blocks` ended: a connection of that writer
    /// still reading a WRITE into any of them is ended (its WRITE is never acknowledged).
    /// Returns how many were.
    pub(super) fn end_writes(&mut self, writer: &PeerId, blocks: &[BlockIndex]) -> usize {
        let ended: HashSet<BlockIndex> = blocks.iter().copied().collect();
        let cut: Vec<u64> = self
            .conns
            .iter()
            .filter(|(_, c)| matches!(&c.writer, Some((w, _)) if w == writer))
            .filter(|(_, c)| c.claimed.iter().any(|b| ended.contains(b)))
            .map(|(id, _)| *id)
            .collect();
        for id in &cut {
            if let Some(c) = self.conns.remove(id) {
                shut(c.fd);
            }
        }
        cut.len()
    }

    /// Connection `id` presents `key` as `writer`: accepted only if that writer has an issued
    /// key and it is this one. An accepted connection replaces the writer's older ones (a
    /// writer keeps one connection; it opens another only once the last one is gone).
    fn authenticate(&mut self, id: u64, writer: &PeerId, key: &[u8; KEY_LEN]) -> Option<usize> {
        let issued = self.keys.get(writer)?;
        if !bool::from(issued.key.ct_eq(key)) {
            return None;
        }
        let generation = issued.generation;
        let conn = self.conns.get_mut(&id)?; // ended meanwhile (evicted, key withdrawn)
        conn.writer = Some((writer.clone(), generation));
        let older: Vec<u64> = self
            .conns
            .iter()
            .filter(|(other, c)| **other != id && matches!(&c.writer, Some((w, _)) if w == writer))
            .map(|(other, _)| *other)
            .collect();
        for other in &older {
            if let Some(c) = self.conns.remove(other) {
                shut(c.fd);
            }
        }
        Some(older.len())
    }

    /// Records the blocks connection `id` is writing (empty: none).
    fn set_claimed(&mut self, id: u64, blocks: &[BlockIndex]) {
        if let Some(c) = self.conns.get_mut(&id) {
            c.claimed.clear();
            c.claimed.extend_from_slice(blocks);
        }
    }

    /// Connection `id` is open and its writer's key is still the one it presented.
    fn is_current(&self, id: u64) -> bool {
        match self.conns.get(&id).and_then(|c| c.writer.as_ref()) {
            Some((w, g)) => self.keys.get(w).is_some_and(|k| k.generation == *g),
            None => false,
        }
    }
}

/// Where one inbound connection is.
enum Rx {
    /// Reading its HELLO: magic and version, then the id's length, then id and key.
    Hello { buf: Vec<u8>, need: usize },
    /// Between frames (its deadline is the idle timeout).
    Idle,
    /// A WRITE's magic and header (`buf` fills up to 4 + [`WRITE_HEAD_LEN`]).
    Head { buf: Vec<u8> },
    /// A WRITE's block indexes (and its digests, for a WRITE that carries them).
    Indexes {
        tid: TransferId,
        buf: Vec<u8>,
        need: usize,
        digests: bool,
    },
    /// A WRITE's blocks, straight into the pool: block `nth`, `at` bytes of it in; each
    /// block checked against its digest once in (none: the WRITE carried none). `corrupt`:
    /// a block did not match (the rest is still read, so the stream stays in step).
    Blocks {
        tid: TransferId,
        claim: WriteClaim,
        count: usize,
        nth: usize,
        at: usize,
        digests: Vec<(BlockIndex, u32)>,
        corrupt: Option<usize>,
    },
    /// Its ACK on its way out.
    Ack {
        bytes: [u8; wire::ACK_LEN],
        at: usize,
    },
}

/// An inbound connection.
struct Conn {
    stream: TcpStream,
    /// Whether its first byte was looked at: a TLS handshake's (0x16) or a plaintext HELLO's.
    sniffed: bool,
    /// Its TLS session, for a connection that opened with one: every read and write goes
    /// through it, the HELLO first.
    tls: Option<Box<rustls::Connection>>,
    state: Rx,
    writer: Option<PeerId>,
    /// The current part's deadline (HELLO, idle, frame part, ACK).
    deadline: Instant,
    readable: bool,
    writable: bool,
}

/// What the receiver thread shares with the plane.
pub(super) struct Shared {
    pub(super) pool: PoolWriter,
    pub(super) gate: Arc<Mutex<Gate>>,
    pub(super) limits: Arc<Mutex<TcpLimits>>,
    pub(super) counters: Arc<Counters>,
    /// The plane's TLS policy and material.
    pub(super) tls: TlsSlot,
    /// This node asks writers for block digests: a WRITE without them is refused.
    pub(super) digests: Arc<std::sync::atomic::AtomicBool>,
}

/// The core's thread's side of the receiver thread: its wake pipe (to stop it).
pub(super) struct ReceiverHandle {
    wake: File,
    gate: Arc<Mutex<Gate>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for ReceiverHandle {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        lock(&self.gate).close_all();
        let _ = (&self.wake).write(&[1]);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Starts the receiver thread on `listener`.
pub(super) fn start(listener: TcpListener, shared: Shared) -> std::io::Result<ReceiverHandle> {
    listener.set_nonblocking(true)?;
    let (read, write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC)?;
    let read = File::from(read);
    let poller = Poller::new()?;
    poller.add_input(read.as_fd(), WAKE)?;
    poller.add_input(listener.as_fd(), LISTENER)?;
    let stop: Arc<std::sync::atomic::AtomicBool> = Arc::default();
    let gate = shared.gate.clone();
    let mut receiver = Receiver {
        poller,
        wake: read,
        listener,
        shared,
        stop: stop.clone(),
        conns: HashMap::new(),
        in_hello: BTreeMap::new(),
        in_hello_from: HashMap::new(),
        timers: Timers::default(),
        next_conn: CONNS,
        accept_pending: true,
        accept_paused_until: None,
        last_accept_log: None,
        unlogged_accepts: 0,
    };
    let thread = std::thread::Builder::new()
        .name("kvpeer-tcp-recv".into())
        .spawn(move || receiver.run())?;
    Ok(ReceiverHandle {
        wake: File::from(write),
        gate,
        stop,
        thread: Some(thread),
    })
}

/// Why a connection ends.
enum End {
    /// In order (the writer closed it, idled out, or its key went): nothing to say.
    Quiet(&'static str),
    /// Refused or broken: said at debug level.
    Broken(String),
}

struct Receiver {
    poller: Poller,
    wake: File,
    listener: TcpListener,
    shared: Shared,
    stop: Arc<std::sync::atomic::AtomicBool>,
    conns: HashMap<u64, Conn>,
    /// The connections still in their HELLO (the oldest first), by source address, and how
    /// many each source holds: who makes room when the port is full.
    in_hello: BTreeMap<u64, IpAddr>,
    in_hello_from: HashMap<IpAddr, usize>,
    timers: Timers<u64>,
    next_conn: u64,
    /// The poll said connections wait, and no accept found none since.
    accept_pending: bool,
    accept_paused_until: Option<Instant>,
    last_accept_log: Option<Instant>,
    unlogged_accepts: u64,
}

impl Receiver {
    fn run(&mut self) {
        let mut ready: Vec<Ready> = Vec::new();
        loop {
            if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let now = Instant::now();
            let accept_at = if self.accept_pending {
                Some(self.accept_paused_until.unwrap_or(now))
            } else {
                None
            };
            let timeout = [self.timers.next(), accept_at]
                .into_iter()
                .flatten()
                .min()
                .map_or(Duration::from_secs(3600), |at| {
                    at.saturating_duration_since(now)
                });
            ready.clear();
            if self.poller.wait(timeout, &mut ready).is_err() {
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut visit = Vec::new();
            for r in &ready {
                match r.token {
                    WAKE => {
                        let mut buf = [0u8; 64];
                        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
                    }
                    LISTENER => self.accept_pending = true,
                    id => {
                        if let Some(c) = self.conns.get_mut(&id) {
                            c.readable |= r.readable || r.closed;
                            c.writable |= r.writable;
                            visit.push(id);
                        }
                    }
                }
            }
            if self.stop.load(std::sync::atomic::Ordering::SeqCst) {
                return;
            }
            let now = Instant::now();
            self.accept(now, &mut visit);
            self.timers.take_due(now, &mut visit);
            visit.sort_unstable();
            visit.dedup();
            for id in visit {
                self.drive(id, now);
            }
        }
    }

    /// Accepts what waits, [`ACCEPT_BATCH`] at most (unless resting after a failed accept),
    /// each new connection within the caps; the new ones go to `visit`. With more waiting,
    /// `accept_pending` stays set and the next round takes them, after these were read.
    fn accept(&mut self, now: Instant, visit: &mut Vec<u64>) {
        if !self.accept_pending || self.accept_paused_until.is_some_and(|t| now < t) {
            return;
        }
        self.accept_paused_until = None;
        for _ in 0..ACCEPT_BATCH {
            let (stream, source) = match sockio::accept(&self.listener) {
                Accepted::Stream(stream, source) => (stream, source),
                Accepted::None => {
                    self.accept_pending = false;
                    return;
                }
                Accepted::Failed(e) => {
                    Counters::bump(&self.shared.counters.accept_errors);
                    if self
                        .last_accept_log
                        .is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY)
                    {
                        warn!(error = %e, unlogged = self.unlogged_accepts,
                            "cannot accept tcp data connections; backing off");
                        self.last_accept_log = Some(now);
                        self.unlogged_accepts = 0;
                    } else {
                        self.unlogged_accepts += 1;
                    }
                    self.accept_paused_until = Some(now + ACCEPT_BACKOFF);
                    return;
                }
            };
            if let Some(id) = self.admit(stream, source, now) {
                visit.push(id);
            }
        }
    }

    /// Takes a new connection within the caps: over either cap a connection still in its
    /// HELLO is closed to make room, the oldest of the source that holds the most of them
    /// (the new one counted), so a flood from one address pushes out its own connections, not
    /// a writer's from another; if every open connection is past its HELLO and the total cap
    /// is reached, the new one is refused.
    fn admit(&mut self, stream: TcpStream, source: IpAddr, now: Instant) -> Option<u64> {
        let limits = lock(&self.shared.limits).clone();
        let mut evicted = Vec::new();
        let id = self.next_conn;
        {
            let gate = self.shared.gate.clone();
            let mut gate = lock(&gate);
            loop {
                let total = gate.conns.len();
                if total < limits.max_connections.max(1)
                    && self.in_hello.len() < limits.max_handshaking.max(1)
                {
                    break;
                }
                match self.eviction_victim(source) {
                    Some(o) => {
                        gate.conns.remove(&o);
                        self.left_hello(o);
                        evicted.push(o);
                    }
                    None => {
                        drop(gate);
                        Counters::bump(&self.shared.counters.refused_over_cap);
                        debug!("tcp data port full; closing a new connection");
                        super::reset_on_close(&stream);
                        return None;
                    }
                }
            }
            gate.conns.insert(
                id,
                Entry {
                    fd: stream.as_raw_fd(),
                    writer: None,
                    claimed: Vec::new(),
                },
            );
        }
        for o in evicted {
            Counters::bump(&self.shared.counters.evicted_handshaking);
            // Reset, not shut: a flood of junk leaves no TIME_WAIT here (its gate entry went
            // above, so the descriptor closes as the connection drops).
            self.timers.set(o, None);
            if let Some(c) = self.conns.remove(&o) {
                super::reset_on_close(&c.stream);
            }
        }
        if let Err(e) = self.poller.add(stream.as_fd(), id) {
            debug!(error = %e, "cannot poll a tcp data connection; closing it");
            lock(&self.shared.gate).conns.remove(&id);
            return None;
        }
        self.next_conn += 1;
        self.in_hello.insert(id, source);
        *self.in_hello_from.entry(source).or_default() += 1;
        let deadline = now + limits.hello_timeout;
        self.conns.insert(
            id,
            Conn {
                stream,
                sniffed: false,
                tls: None,
                state: Rx::Hello {
                    buf: Vec::with_capacity(HELLO_START_LEN),
                    need: HELLO_START_LEN,
                },
                writer: None,
                deadline,
                readable: true,
                writable: true,
            },
        );
        self.timers.set(id, Some(deadline));
        Some(id)
    }

    /// The connection in its HELLO that makes room for a new one from `source`: the oldest of
    /// the source with the most connections in their HELLO, the new one counted.
    fn eviction_victim(&self, source: IpAddr) -> Option<u64> {
        let held = |ip: &IpAddr| {
            self.in_hello_from.get(ip).copied().unwrap_or(0) + usize::from(*ip == source)
        };
        self.in_hello
            .iter()
            .max_by_key(|(id, ip)| (held(ip), Reverse(**id)))
            .map(|(id, _)| *id)
    }

    /// Connection `id` is no longer in its HELLO (past it, or gone).
    fn left_hello(&mut self, id: u64) {
        let Some(source) = self.in_hello.remove(&id) else {
            return;
        };
        if let Some(n) = self.in_hello_from.get_mut(&source) {
            *n -= 1;
            if *n == 0 {
                self.in_hello_from.remove(&source);
            }
        }
    }

    /// Forgets connection `id` (first at the gate, then its descriptor closes).
    fn forget(&mut self, id: u64) {
        self.left_hello(id);
        lock(&self.shared.gate).conns.remove(&id);
        self.timers.set(id, None);
        if let Some(c) = self.conns.remove(&id) {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
    }

    /// Drives connection `id` at `now`: reads what its state takes, writes its ACK, and ends
    /// it past its deadline or on any refusal.
    fn drive(&mut self, id: u64, now: Instant) {
        let Some(mut conn) = self.conns.remove(&id) else {
            return;
        };
        let limits = lock(&self.shared.limits).clone();
        let result = self.step(id, &mut conn, now, &limits);
        let deadline = conn.deadline;
        self.conns.insert(id, conn);
        match result {
            Ok(()) => self.timers.set(id, Some(deadline)),
            Err(End::Quiet(why)) => {
                debug!(id, why, "tcp data connection ended");
                self.forget(id);
            }
            Err(End::Broken(why)) => {
                debug!(id, %why, "tcp data connection ended");
                self.forget(id);
            }
        }
    }

    fn step(&mut self, id: u64, c: &mut Conn, now: Instant, limits: &TcpLimits) -> Result<(), End> {
        loop {
            // Records rustls could not send yet (a full socket) go first.
            if let Some(tls) = &mut c.tls {
                if c.writable {
                    match crate::tls::flush(&c.stream, tls) {
                        Ok(()) => {}
                        Err(e) if e.kind() == ErrorKind::WouldBlock => c.writable = false,
                        Err(e) => return Err(End::Broken(format!("TLS: {e}"))),
                    }
                }
            }
            // An ACK waiting to leave comes first (the writer reads them in order).
            if let Rx::Ack { bytes, at } = &mut c.state {
                let wrote = match &mut c.tls {
                    Some(tls) => crate::tls::write(&c.stream, tls, &bytes[*at..]),
                    None => (&c.stream).write(&bytes[*at..]),
                };
                match wrote {
                    Ok(n) => *at += n,
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        c.writable = false;
                        if now >= c.deadline {
                            return Err(End::Broken("the writer does not take its ACK".into()));
                        }
                        return Ok(());
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                    Err(e) => return Err(End::Broken(format!("cannot send an ACK: {e}"))),
                }
                if *at < wire::ACK_LEN {
                    continue;
                }
                c.state = Rx::Idle;
                c.deadline = now + limits.idle_timeout;
            }
            if now >= c.deadline {
                return Err(self.timed_out(c, limits));
            }
            if !c.readable {
                return Ok(());
            }
            if !c.sniffed && !self.sniff(c)? {
                return Ok(());
            }
            // The buffer this state reads into next.
            let read = match &mut c.state {
                Rx::Hello { buf, need } | Rx::Indexes { buf, need, .. } => {
                    let at = buf.len();
                    buf.resize(*need, 0);
                    let r = recv(&c.stream, &mut c.tls, &mut buf[at..]);
                    let n = *r.as_ref().unwrap_or(&0);
                    buf.truncate(at + n);
                    r
                }
                Rx::Idle => {
                    let mut first = [0u8; 1];
                    let r = recv(&c.stream, &mut c.tls, &mut first);
                    if matches!(r, Ok(1)) {
                        let mut buf = Vec::with_capacity(4 + WRITE_HEAD_LEN);
                        buf.push(first[0]);
                        c.state = Rx::Head { buf };
                        // Once a frame's first byte is in, the rest runs on the frame clock.
                        c.deadline = now + limits.frame_timeout;
                    }
                    r
                }
                Rx::Head { buf } => {
                    let at = buf.len();
                    buf.resize(4 + WRITE_HEAD_LEN, 0);
                    let r = recv(&c.stream, &mut c.tls, &mut buf[at..]);
                    let n = *r.as_ref().unwrap_or(&0);
                    buf.truncate(at + n);
                    r
                }
                Rx::Blocks { claim, nth, at, .. } => match claim.block_mut(*nth) {
                    Some(block) => recv(&c.stream, &mut c.tls, &mut block[*at..]),
                    None => return Err(End::Broken(format!("no block {nth} in a claim"))),
                },
                Rx::Ack { .. } => continue,
            };
            let n = match read {
                Ok(0) => return Err(self.ended(c)),
                Ok(n) => n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    c.readable = false;
                    return Ok(());
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::InvalidData && c.tls.is_some() => {
                    // The writer's certificate (untrusted, expired), or a forged record.
                    return Err(self.refuse_hello(&c.stream, format!("TLS: {e}")));
                }
                Err(e) => return Err(End::Broken(format!("read failed: {e}"))),
            };
            self.advance(id, c, n, now, limits)?;
        }
    }

    /// The connection's end of stream: in order between frames, broken inside one.
    fn ended(&self, c: &Conn) -> End {
        match c.state {
            Rx::Idle => End::Quiet("closed by the writer"),
            _ => End::Broken("closed in the middle of a frame".into()),
        }
    }

    /// The current part's deadline passed: counted by what it was.
    fn timed_out(&self, c: &Conn, limits: &TcpLimits) -> End {
        let counters = &self.shared.counters;
        match &c.state {
            Rx::Hello { .. } => {
                Counters::bump(&counters.hello_timeouts);
                End::Broken(format!("no HELLO within {:?}", limits.hello_timeout))
            }
            Rx::Idle => {
                Counters::bump(&counters.idle_closes);
                debug!(writer = ?c.writer, "closing an idle tcp data connection");
                End::Quiet("idle")
            }
            Rx::Ack { .. } => End::Broken("the writer does not take its ACK".into()),
            _ => {
                Counters::bump(&counters.frame_timeouts);
                End::Broken(format!(
                    "a frame part not in within {:?}",
                    limits.frame_timeout
                ))
            }
        }
    }

    /// `n` more bytes arrived in the current state's buffer: moves the state on.
    fn advance(
        &mut self,
        id: u64,
        c: &mut Conn,
        n: usize,
        now: Instant,
        limits: &TcpLimits,
    ) -> Result<(), End> {
        match &mut c.state {
            Rx::Hello { buf, need } => {
                if buf.len() < *need {
                    return Ok(());
                }
                if *need == HELLO_START_LEN {
                    let start: [u8; HELLO_START_LEN] = buf[..].try_into().unwrap_or([0; 5]);
                    wire::check_hello_start(&start)
                        .map_err(|e| self.refuse_hello(&c.stream, e.to_string()))?;
                    *need += 2;
                } else if *need == HELLO_START_LEN + 2 {
                    let len = [buf[HELLO_START_LEN], buf[HELLO_START_LEN + 1]];
                    let id_len = wire::hello_id_len(len)
                        .map_err(|e| self.refuse_hello(&c.stream, e.to_string()))?;
                    *need += id_len + KEY_LEN;
                } else {
                    let hello = wire::decode_hello(buf)
                        .map_err(|e| self.refuse_hello(&c.stream, e.to_string()))?;
                    let (writer, key) = (PeerId::new(hello.writer), hello.key);
                    if c.tls.is_none() && lock(&self.shared.gate).tls_only.contains(&writer) {
                        return Err(self.refuse_hello(
                            &c.stream,
                            format!(
                                "{writer}: a plaintext connection from a writer that offered TLS"
                            ),
                        ));
                    }
                    // Over TLS the writer's certificate must name the address it speaks for.
                    if let Some(tls) = &c.tls {
                        if !certificate_names(tls, &writer) {
                            return Err(self.refuse_hello(
                                &c.stream,
                                format!("{writer}: its TLS certificate does not name its address"),
                            ));
                        }
                    }
                    let authenticated = lock(&self.shared.gate).authenticate(id, &writer, &key);
                    match authenticated {
                        Some(replaced) => {
                            debug!(%writer, replaced, "tcp data connection authenticated");
                            self.left_hello(id);
                            c.writer = Some(writer);
                            c.state = Rx::Idle;
                            c.deadline = now + limits.idle_timeout;
                        }
                        None => {
                            return Err(self
                                .refuse_hello(&c.stream, format!("{writer}: no such key issued")))
                        }
                    }
                }
            }
            Rx::Idle => {}
            Rx::Head { buf } => {
                if buf.len() < 4 + WRITE_HEAD_LEN {
                    return Ok(());
                }
                let writer = c.writer.clone().unwrap_or_default();
                let magic: [u8; 4] = buf[..4].try_into().unwrap_or([0; 4]);
                let digests = wire::check_write_magic(&magic)
                    .map_err(|e| End::Broken(format!("{writer}: {e}")))?;
                let head: [u8; WRITE_HEAD_LEN] = buf[4..].try_into().unwrap_or([0; WRITE_HEAD_LEN]);
                if !digests
                    && self
                        .shared
                        .digests
                        .load(std::sync::atomic::Ordering::Relaxed)
                {
                    Counters::bump(&self.shared.counters.writes_without_digests);
                    let tid =
                        TransferId::new(u64::from_be_bytes(head[..8].try_into().unwrap_or([0; 8])));
                    return Err(self.refuse(
                        c,
                        tid,
                        "a WRITE without block digests, and this node asks for them (tcp_block_digests)"
                            .into(),
                    ));
                }
                match wire::decode_write_head(&head, self.shared.pool.num_blocks()) {
                    Ok((tid, count)) => {
                        let per_block = if digests { 12 } else { 8 };
                        c.state = Rx::Indexes {
                            tid,
                            buf: Vec::with_capacity(count.min(1 << 16) * per_block),
                            need: count * per_block,
                            digests,
                        };
                    }
                    Err(WireError::BadCount { tid, count }) => {
                        return Err(self.refuse(c, tid, format!("{count} blocks in one write")))
                    }
                    Err(e) => return Err(End::Broken(format!("{writer}: {e}"))),
                }
            }
            Rx::Indexes {
                tid,
                buf,
                need,
                digests,
            } => {
                if buf.len() < *need {
                    return Ok(());
                }
                let tid = *tid;
                let writer = c.writer.clone().unwrap_or_default();
                let broken = |e: WireError| End::Broken(format!("{writer}: {e}"));
                let indexes_len = if *digests { *need / 12 * 8 } else { *need };
                let (raw_indexes, raw_digests) = buf.split_at(indexes_len);
                let indexes = wire::decode_indexes(raw_indexes).map_err(broken)?;
                let digests = wire::decode_digests(raw_digests).map_err(broken)?;
                let claim = self.claim(id, c, tid, &writer, &indexes)?;
                c.state = Rx::Blocks {
                    tid,
                    claim,
                    count: indexes.len(),
                    nth: 0,
                    at: 0,
                    digests: indexes.iter().copied().zip(digests).collect(),
                    corrupt: None,
                };
                // Each block on its own clock.
                c.deadline = now + limits.frame_timeout;
            }
            Rx::Blocks {
                tid,
                claim,
                count,
                nth,
                at,
                digests,
                corrupt,
            } => {
                *at += n;
                let len = claim.block_mut(*nth).map_or(0, |b| b.len());
                if *at < len {
                    return Ok(());
                }
                if let Some(&(index, want)) = digests.get(*nth) {
                    let got = claim.block_mut(*nth).map(|b| wire::digest(index, b));
                    if got != Some(want) && corrupt.is_none() {
                        // Corrupted on the way (or by the writer): the transfer fails (ACK
                        // status 2), so the load fails and its blocks never count as that key's.
                        *corrupt = Some(*nth);
                    }
                }
                *nth += 1;
                *at = 0;
                c.deadline = now + limits.frame_timeout;
                if *nth < *count {
                    return Ok(());
                }
                // Every byte is in: the write is over before the writer hears of it (and before
                // the load can end, which ends connections still writing its blocks).
                let tid = *tid;
                let status = match *corrupt {
                    None => wire::AckStatus::Written,
                    Some(nth) => {
                        Counters::bump(&self.shared.counters.digest_mismatches);
                        let writer = c.writer.clone().unwrap_or_default();
                        if let Some(suppressed) =
                            crate::admit_warning("a tcp write arrived corrupted")
                        {
                            warn!(%writer, tid = tid.get(), block = nth, suppressed,
                                "a block of a tcp write does not match its digest; the transfer failed");
                        }
                        wire::AckStatus::Corrupted
                    }
                };
                c.state = Rx::Ack {
                    bytes: wire::encode_ack_status(tid, status),
                    at: 0,
                };
                lock(&self.shared.gate).set_claimed(id, &[]);
                c.deadline = now + limits.frame_timeout;
            }
            Rx::Ack { .. } => {}
        }
        Ok(())
    }

    fn refuse_hello(&self, stream: &TcpStream, why: String) -> End {
        Counters::bump(&self.shared.counters.refused_hellos);
        if let Some(suppressed) = crate::admit_warning("refusing a tcp data connection") {
            warn!(%why, peer = ?stream.peer_addr().ok(), suppressed, "refusing a tcp data connection");
        }
        End::Broken(why)
    }

    /// Claims every permit of the frame before reading a byte of it (all or nothing: each
    /// block inside the pool, named once, permitted to this writer), and only while the key
    /// this connection presented is still current. The claim is the only way to write the
    /// blocks.
    fn claim(
        &mut self,
        id: u64,
        c: &mut Conn,
        tid: TransferId,
        writer: &PeerId,
        indexes: &[BlockIndex],
    ) -> Result<WriteClaim, End> {
        let claimed = {
            let mut gate = lock(&self.shared.gate);
            if !gate.is_current(id) {
                return Err(End::Quiet("its key was withdrawn"));
            }
            let claimed = self.shared.pool.claim(writer, indexes);
            if claimed.is_ok() {
                gate.set_claimed(id, indexes);
            }
            claimed
        };
        claimed.map_err(|e| self.refuse(c, tid, e.to_string()))
    }

    /// Refuses transfer `tid` (ACK 1, best effort) and ends the connection.
    fn refuse(&self, c: &mut Conn, tid: TransferId, why: String) -> End {
        let writer = c.writer.clone().unwrap_or_default();
        if let Some(suppressed) = crate::admit_warning("refusing a tcp write") {
            warn!(%writer, tid = tid.get(), %why, suppressed, "refusing a tcp write");
        }
        let refusal = wire::encode_ack(tid, false);
        let _ = match &mut c.tls {
            Some(tls) => crate::tls::write(&c.stream, tls, &refusal),
            None => (&c.stream).write(&refusal),
        };
        End::Broken(why)
    }

    /// Looks at a new connection's first byte, left in the socket: a TLS handshake record
    /// (0x16) starts a TLS session where this node's policy takes TLS; anything else is read
    /// as a plaintext HELLO where it takes plaintext. `Ok(false)`: no byte yet.
    fn sniff(&self, c: &mut Conn) -> Result<bool, End> {
        let mut first = [0u8; 1];
        loop {
            match recv_peek(&c.stream, &mut first) {
                Ok(0) => return Err(self.ended(c)),
                Ok(_) => break,
                Err(nix::errno::Errno::EAGAIN) => {
                    c.readable = false;
                    return Ok(false);
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => return Err(End::Broken(format!("read failed: {e}"))),
            }
        }
        let policy = self.shared.tls.policy();
        if first[0] == crate::tls::HANDSHAKE_RECORD {
            let Some(config) = self.shared.tls.server() else {
                return Err(self.refuse_hello(
                    &c.stream,
                    "a TLS connection, and this node's tls is \"off\"".into(),
                ));
            };
            let session = rustls::ServerConnection::new(config)
                .map_err(|e| End::Broken(format!("TLS: {e}")))?;
            c.tls = Some(Box::new(rustls::Connection::Server(session)));
        } else if policy == TlsPolicy::Required {
            return Err(self.refuse_hello(
                &c.stream,
                "a plaintext connection, and this node's tls is \"required\"".into(),
            ));
        }
        c.sniffed = true;
        Ok(true)
    }
}

/// Reads from a connection, through its TLS session where it has one.
fn recv(
    stream: &TcpStream,
    tls: &mut Option<Box<rustls::Connection>>,
    buf: &mut [u8],
) -> std::io::Result<usize> {
    match tls {
        Some(tls) => crate::tls::read(stream, tls, buf),
        None => (&*stream).read(buf),
    }
}

/// Reads bytes without taking them from the socket.
fn recv_peek(stream: &TcpStream, buf: &mut [u8]) -> nix::Result<usize> {
    nix::sys::socket::recv(
        stream.as_raw_fd(),
        buf,
        nix::sys::socket::MsgFlags::MSG_PEEK,
    )
}

/// Whether the TLS session's peer certificate names the IP address of `writer` (`IP:PORT`).
fn certificate_names(tls: &rustls::Connection, writer: &PeerId) -> bool {
    let ip = kvpeer_proto::PeerAddr::parse(writer.as_str())
        .ok()
        .and_then(|a| a.socket_addr())
        .map(|a| a.ip());
    let cert = tls.peer_certificates().and_then(|certs| certs.first());
    match (cert, ip) {
        (Some(cert), Some(ip)) => crate::tls::names_ip(cert, ip),
        _ => false,
    }
}
