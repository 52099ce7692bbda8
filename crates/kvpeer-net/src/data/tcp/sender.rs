//! The send side of the tcp plane: one thread for every peer this node writes to, whatever
//! their number. Each registered peer is a [`Link`]: its jobs in order, at most one data
//! connection (dialed at its first write, not at registration, and closed once idle, so an
//! idle session holds none), the WRITE being sent and the ACKs coming back, all on one
//! non-blocking socket registered in the thread's epoll set. A peer that reads slowly only
//! leaves its own socket unwritable: every other link goes on.
//!
//! What the per-peer writer threads this replaces did, each kept:
//!
//! * **Jobs in order**, each decided under the bookkeeping lock: cancelled meanwhile (skipped),
//!   the peer faulted (every job dropped), or sent on the current connection, which must be
//!   open and not about to idle out at the receiver unless WRITEs await their ACK on it;
//!   otherwise a fresh connection is dialed (same HELLO and key) and the job tried on it, at
//!   most twice per job before the peer is faulted.
//! * **A connection found closed before a byte of a frame left** takes the frame back and
//!   reconnects; one lost in the middle of a frame faults the peer.
//! * **ACKs**: a written transfer is done, a refused one faults the peer (the receiver refuses
//!   only a write it holds no permit for, or one without the block digests it asked for), a
//!   corrupted one (a block did not match its digest) fails alone. An ACK counts only in turn: for the oldest WRITE
//!   whose last byte left on that same connection (a refusal also for the one being sent).
//!   Any other (early, out of order, another connection's, one too many) faults the peer and
//!   completes nothing, so a receiver cannot have our blocks unpinned while we still read
//!   them. At most [`ACK_READS_PER_DRIVE`] reads per drive, then the other links' turn. A
//!   connection that ends with WRITEs awaiting their ACK faults the peer; one that ends idle
//!   is only forgotten (the next write reconnects).
//! * **Deadlines** of transfers awaiting their ACK (`transfer_timeout` + bytes at
//!   `min_write_rate`, a pipelined WRITE also getting the time of those ahead of it): past
//!   one, the peer is faulted and its link reset and dropped. A socket that takes none of a
//!   frame's bytes for [`WRITE_STALL_TIMEOUT`] faults the peer too.
//! * **A byte rate per link** (`max_write_rate`): no more is written than the rate allows
//!   since the link last idled (idle time is not banked beyond a second); the link waits on
//!   its timer, not on a sleep.
//!
//! The core's thread talks to this one through a command queue and a wake pipe
//! ([`SenderHandle`]); results go back through the shared [`Ends`] and the node's wake hook.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_core::{BlockIndex, TransferId};
use kvpeer_proto::PeerId;
use kvpeer_store::PoolView;
use rustls_pki_types::ServerName;
use tracing::{debug, warn};

use super::acks::{Ack, AckTurn, AckViolation};
use super::error::TcpFault;
use super::wire;
use super::{abort, close, Counters, Ends, Sent, TcpPlane, TlsSlot, KEY_LEN, WRITE_STALL_TIMEOUT};
use crate::data::shm::Wake;
use crate::io::poller::{Poller, Ready, Token};
use crate::io::sockio;
use crate::io::timers::Timers;
use crate::lock;

/// Numbers data connections (their poll tokens), across peers and links, so that news of a
/// connection that was replaced is told from news of its successor.
static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

/// The wake pipe's token in the thread's poll.
const WAKE: Token = 0;

/// How long a connect may take before the peer is faulted.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Reads of ACK bytes one drive of a link makes at most (an ACK is 13 bytes; an honest
/// receiver sends one per WRITE): a peer streaming ACKs cannot hold the thread that writes to
/// every peer.
const ACK_READS_PER_DRIVE: usize = 256;

/// How long a TLS handshake may take once TCP's connect is done (the listener gives a HELLO,
/// which follows it, 5 s by default).
const TLS_HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Bytes of records a link's TLS session holds unsent at most (its plaintext is encrypted into
/// them at each write, up to this).
const TLS_SEND_BUFFER: usize = 1 << 20;

/// Under a byte rate, a link writes once this much (or the rest of its frame) is allowed, so a
/// paced link wakes the thread about 16 times per MiB, not once per byte.
const PACE_CHUNK: usize = 64 * 1024;

/// One write to a peer: our blocks `local` into its blocks `remote`.
pub(super) struct Job {
    pub(super) tid: TransferId,
    pub(super) local: Vec<BlockIndex>,
    pub(super) remote: Vec<BlockIndex>,
}

/// A link's writer settings.
#[derive(Debug, Clone)]
pub(super) struct Writer {
    /// Each WRITE carries a CRC-32C per block (the peer asked: `tcp_digests`).
    pub(super) digests: bool,
    /// Cap on bytes per second to this peer.
    pub(super) rate: Option<u64>,
    /// Reconnect before the receiver's idle timeout can race a new WRITE; an idle connection
    /// is closed after this long.
    pub(super) stale_after: Duration,
    /// The slowest a peer may take our WRITEs (bytes per second, at least 1).
    pub(super) min_rate: u64,
    /// A WRITE's fixed allowance on top of its bytes at `min_rate`.
    pub(super) grace: Duration,
}

/// What the core's thread asks of the sender thread.
pub(super) enum Cmd {
    /// Writes to `peer` go to its data listener at `addr`, presenting `key`.
    Link {
        peer: PeerId,
        addr: SocketAddr,
        key: [u8; KEY_LEN],
        writer: Writer,
        /// Its connections speak TLS (the peer offers it and this node's policy uses it),
        /// and the listener's certificate must name this address: the peer's identity's.
        tls: Option<std::net::IpAddr>,
    },
    /// `peer` is gone: its link and connection end (`abort`: reset, not closed in order).
    Unlink { peer: PeerId, abort: bool },
    /// A write to `peer`, queued behind its others.
    Job { peer: PeerId, job: Job },
    /// The plane is going.
    Stop,
}

/// A way to give the sender thread commands: its queue and the pipe that wakes it.
#[derive(Clone)]
pub(super) struct CmdQueue {
    queue: Arc<Mutex<VecDeque<Cmd>>>,
    wake: Arc<File>,
}

impl CmdQueue {
    /// Queues `cmd` and wakes the thread.
    pub(super) fn send(&self, cmd: Cmd) {
        lock(&self.queue).push_back(cmd);
        // A full pipe already means "wake up".
        let _ = (&*self.wake).write(&[1]);
    }
}

/// The core's thread's side of the sender thread (stops it when dropped).
pub(super) struct SenderHandle {
    queue: CmdQueue,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SenderHandle {
    /// Queues `cmd` and wakes the thread.
    pub(super) fn send(&self, cmd: Cmd) {
        self.queue.send(cmd);
    }

    /// Another way in (for a helper thread that links a peer once its name resolved).
    pub(super) fn queue(&self) -> CmdQueue {
        self.queue.clone()
    }
}

impl Drop for SenderHandle {
    fn drop(&mut self) {
        self.send(Cmd::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What the sender thread shares with the plane.
pub(super) struct Shared {
    pub(super) me: PeerId,
    pub(super) local: PoolView,
    pub(super) block_len: usize,
    pub(super) ends: Arc<Mutex<Ends>>,
    pub(super) counters: Arc<Counters>,
    pub(super) wake: Wake,
    /// The peers with a link and their pools' blocks (what `write_blocks` checks); a link this
    /// thread drops (a transfer past its deadline) leaves it.
    pub(super) linked: Arc<Mutex<HashMap<PeerId, u64>>>,
    /// The plane's TLS material, for the links that use it.
    pub(super) tls: TlsSlot,
}

/// Starts the sender thread.
pub(super) fn start(shared: Shared) -> std::io::Result<SenderHandle> {
    let (read, write) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_NONBLOCK | nix::fcntl::OFlag::O_CLOEXEC)?;
    let read = File::from(read);
    let poller = Poller::new()?;
    poller.add_input(read.as_fd(), WAKE)?;
    let queue: Arc<Mutex<VecDeque<Cmd>>> = Arc::default();
    let mut sender = Sender {
        poller,
        wake: read,
        queue: queue.clone(),
        shared,
        links: HashMap::new(),
        by_conn: HashMap::new(),
        timers: Timers::default(),
        deadlines: BinaryHeap::new(),
    };
    let thread = std::thread::Builder::new()
        .name("kvpeer-tcp-send".into())
        .spawn(move || sender.run())?;
    Ok(SenderHandle {
        queue: CmdQueue {
            queue,
            wake: Arc::new(File::from(write)),
        },
        thread: Some(thread),
    })
}

/// A frame on its way out: the HELLO of a fresh connection, or a WRITE (header, then blocks).
struct Frame {
    /// The WRITE's transfer (`None`: a HELLO).
    tid: Option<TransferId>,
    head: Vec<u8>,
    blocks: Vec<BlockIndex>,
    /// Bytes of the frame written so far (the header's, then the blocks').
    written: usize,
}

impl Frame {
    fn len(&self, block_len: usize) -> usize {
        self.head.len() + self.blocks.len() * block_len
    }
}

/// A data connection to a peer's listener.
struct Conn {
    id: u64,
    stream: TcpStream,
    /// TCP's connect has not finished (since `since`).
    connecting: Option<Instant>,
    readable: bool,
    writable: bool,
    /// The HELLO, then WRITEs, one at a time.
    out: VecDeque<Frame>,
    /// The WRITEs whose last byte left on this connection, awaiting their ACK, and the ACK
    /// being read: which ACK may count next (`acks.rs`).
    acks: AckTurn,
    /// Its TLS session, for a link that uses TLS: every frame goes through it, the HELLO
    /// (with the key) included; nothing but its handshake is written before that is done.
    tls: Option<Box<rustls::Connection>>,
    /// When bytes last left (or a frame was queued onto an idle connection).
    progressed: Instant,
}

/// One registered peer.
struct Link {
    peer: PeerId,
    addr: SocketAddr,
    key: [u8; KEY_LEN],
    writer: Writer,
    jobs: VecDeque<Job>,
    conn: Option<Conn>,
    /// Whether the current connection has seen its end (the next write reconnects).
    conn_open: bool,
    /// When the last WRITE was queued on the connection.
    last_sent: Instant,
    /// Reconnects for the job at the head of the queue.
    reconnects: u32,
    /// The byte rate's window: since when, and what left in it.
    paced_since: Instant,
    paced_bytes: u64,
    /// The peer faulted: nothing more is written.
    stopped: bool,
    /// A connection of this link has been up before (the next one is a reconnect).
    connected_before: bool,
    /// Its connections speak TLS, with a listener whose certificate names this address.
    tls: Option<std::net::IpAddr>,
}

/// The sender thread's state.
struct Sender {
    poller: Poller,
    wake: File,
    queue: Arc<Mutex<VecDeque<Cmd>>>,
    shared: Shared,
    links: HashMap<PeerId, Link>,
    /// A connection's poll token (its number) → its peer.
    by_conn: HashMap<u64, PeerId>,
    /// Per link (by its connection's number, or 0 for none: keyed by peer below), when it
    /// must be driven without news: pacing, write stalls, connect and idle deadlines.
    timers: Timers<PeerKey>,
    /// Transfers awaiting their ACK, by deadline (stale entries skipped).
    deadlines: BinaryHeap<std::cmp::Reverse<(Instant, TransferId)>>,
}

/// A link's key in the timer heap (a peer id ordered by its text).
type PeerKey = PeerId;

/// What one step of a link's head job decided.
enum Step {
    Skip,
    /// Sent, with the deadline of its ACK.
    Send(Instant),
    Reconnect,
    Stop,
}

/// How `t + d` is written when it would overflow.
fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(t)
}

/// How long `bytes` take at `rate` bytes per second (at least 1).
fn bytes_at(bytes: u64, rate: u64) -> Duration {
    let rate = rate.max(1);
    let secs = bytes / rate;
    let nanos = (bytes % rate) as u128 * 1_000_000_000 / rate as u128;
    Duration::new(secs, nanos as u32)
}

impl Sender {
    fn run(&mut self) {
        let mut ready: Vec<Ready> = Vec::new();
        loop {
            let now = Instant::now();
            let timeout = [self.timers.next(), self.next_deadline()]
                .into_iter()
                .flatten()
                .min()
                .map_or(Duration::from_secs(3600), |at| {
                    at.saturating_duration_since(now)
                });
            ready.clear();
            if let Err(e) = self.poller.wait(timeout, &mut ready) {
                if let Some(suppressed) = crate::admit_warning("tcp sender wait failed") {
                    warn!(error = %e, suppressed, "the tcp sender cannot wait on its sockets");
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            let mut touched: Vec<PeerId> = Vec::new();
            for r in &ready {
                if r.token == WAKE {
                    continue;
                }
                let Some(peer) = self.by_conn.get(&r.token).cloned() else {
                    continue;
                };
                if let Some(c) = self
                    .links
                    .get_mut(&peer)
                    .and_then(|l| l.conn.as_mut())
                    .filter(|c| c.id == r.token)
                {
                    c.readable |= r.readable || r.closed;
                    c.writable |= r.writable;
                    touched.push(peer);
                }
            }
            if !self.commands(&mut touched) {
                return;
            }
            let now = Instant::now();
            let mut due = Vec::new();
            self.timers.take_due(now, &mut due);
            touched.extend(due);
            touched.sort_unstable();
            touched.dedup();
            for peer in touched {
                self.drive(&peer, now);
            }
            self.expire(now);
        }
    }

    /// Takes the queued commands (draining the wake pipe first); `false` on `Stop`.
    fn commands(&mut self, touched: &mut Vec<PeerId>) -> bool {
        let mut buf = [0u8; 256];
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
        let cmds: Vec<Cmd> = lock(&self.queue).drain(..).collect();
        for cmd in cmds {
            match cmd {
                Cmd::Stop => {
                    for (_, link) in self.links.drain() {
                        if let Some(c) = &link.conn {
                            close(&c.stream);
                        }
                    }
                    return false;
                }
                Cmd::Link {
                    peer,
                    addr,
                    key,
                    writer,
                    tls,
                } => {
                    self.unlink(&peer, false, false);
                    let now = Instant::now();
                    self.links.insert(
                        peer.clone(),
                        Link {
                            peer: peer.clone(),
                            addr,
                            key,
                            writer,
                            jobs: VecDeque::new(),
                            conn: None,
                            conn_open: false,
                            last_sent: now,
                            reconnects: 0,
                            paced_since: now,
                            paced_bytes: 0,
                            stopped: false,
                            connected_before: false,
                            tls,
                        },
                    );
                }
                Cmd::Unlink { peer, abort } => self.unlink(&peer, abort, false),
                Cmd::Job { peer, job } => match self.links.get_mut(&peer).filter(|l| !l.stopped) {
                    Some(link) => {
                        link.jobs.push_back(job);
                        touched.push(peer);
                    }
                    None => {
                        // The link went (or faulted) meanwhile: the job never leaves.
                        let mut e = lock(&self.shared.ends);
                        if e.queued.remove(&job.tid).is_some() {
                            e.ended.entry(peer).or_default().failed.push(job.tid);
                        }
                        drop(e);
                        (self.shared.wake)();
                    }
                },
            }
        }
        true
    }

    /// Ends `peer`'s link: its connection closes (reset with `abort`), WRITEs awaiting their
    /// ACK on it fail (a fault now would land on the peer's next session), its queued jobs are
    /// never sent. `own`: this thread drops the link by itself (a transfer past its deadline),
    /// so the plane's record of it goes too; a link dropped or replaced on the plane's command
    /// leaves that record to the plane, which already holds the next registration's there
    /// (removing it here made a peer registered again unwritable).
    fn unlink(&mut self, peer: &PeerId, abort_conn: bool, own: bool) {
        let Some(link) = self.links.remove(peer) else {
            return;
        };
        if own {
            lock(&self.shared.linked).remove(peer);
        }
        self.timers.set(peer.clone(), None);
        if let Some(c) = &link.conn {
            self.by_conn.remove(&c.id);
            if abort_conn {
                abort(&c.stream);
            } else {
                close(&c.stream);
            }
            let mut e = lock(&self.shared.ends);
            let pending: Vec<TransferId> = e
                .sent
                .iter()
                .filter(|(_, s)| s.peer == *peer && s.conn == c.id)
                .map(|(t, _)| *t)
                .collect();
            if !pending.is_empty() {
                for t in &pending {
                    e.sent.remove(t);
                }
                e.ended
                    .entry(peer.clone())
                    .or_default()
                    .failed
                    .extend(pending);
                drop(e);
                (self.shared.wake)();
            }
        }
        lock(&self.shared.ends).conns.remove(peer);
    }

    /// Faults `peer` (its transfers fail, the core winds the session down) and stops its link.
    fn fault(&mut self, peer: &PeerId, why: TcpFault) {
        debug!(%peer, %why, "tcp link faulted");
        TcpPlane::fault(&self.shared.ends, peer, why, &self.shared.wake);
        if let Some(link) = self.links.get_mut(peer) {
            link.stopped = true;
            link.jobs.clear();
        }
    }

    /// Drives `peer`'s link at `now`: its connection's connect, ACKs and writes, then its jobs.
    fn drive(&mut self, peer: &PeerId, now: Instant) {
        let Some(mut link) = self.links.remove(peer) else {
            return;
        };
        let result = self.drive_link(&mut link, now);
        let stopped = link.stopped;
        self.links.insert(peer.clone(), link);
        if let Err(why) = result {
            self.fault(peer, why);
        } else if stopped {
            // Faulted elsewhere: nothing more goes; the connection stays until the link is
            // dropped with the session.
        }
        self.rearm(peer, now);
    }

    /// Sets `peer`'s next deadline: its connect, a write stall, its pace, its idle close.
    fn rearm(&mut self, peer: &PeerId, now: Instant) {
        let Some(link) = self.links.get(peer) else {
            self.timers.set(peer.clone(), None);
            return;
        };
        let mut at: Option<Instant> = None;
        let mut consider = |t: Instant| at = Some(at.map_or(t, |a| a.min(t)));
        if let Some(c) = &link.conn {
            if !link.stopped && c.connecting.is_none() && c.readable {
                // ACKs left unread by the last drive's budget.
                consider(now);
            }
            if let Some(since) = c.connecting {
                consider(since + CONNECT_TIMEOUT);
            } else if c.tls.as_ref().is_some_and(|t| t.is_handshaking()) {
                consider(c.progressed + TLS_HANDSHAKE_TIMEOUT);
            } else if !c.out.is_empty() {
                consider(c.progressed + WRITE_STALL_TIMEOUT);
                if let Some(ready) = self.pace_ready_at(link, now) {
                    consider(ready);
                }
            } else if link.jobs.is_empty() && !self.awaits_acks(link) {
                // Idle: closed before the receiver's idle timeout would close it.
                consider(link.last_sent + link.writer.stale_after);
            }
        }
        if !link.jobs.is_empty() && link.conn.is_none() {
            consider(now);
        }
        self.timers.set(peer.clone(), at);
    }

    /// Whether WRITEs on `link`'s current connection await their ACK.
    fn awaits_acks(&self, link: &Link) -> bool {
        let Some(c) = &link.conn else {
            return false;
        };
        lock(&self.shared.ends)
            .sent
            .values()
            .any(|s| s.peer == link.peer && s.conn == c.id)
    }

    /// When the pace lets `link` write its next chunk (`None`: now, or it has no pace).
    fn pace_ready_at(&self, link: &Link, now: Instant) -> Option<Instant> {
        let rate = link.writer.rate?;
        if pace_allows(link, now) >= PACE_CHUNK {
            return None;
        }
        let due = link.paced_since + bytes_at(link.paced_bytes, rate);
        Some(due.max(now + Duration::from_micros(50)))
    }

    fn drive_link(&mut self, link: &mut Link, now: Instant) -> Result<(), TcpFault> {
        if link.stopped {
            return Ok(());
        }
        // The connection: its connect, ACKs, end, then what it has to write.
        if let Some(c) = &mut link.conn {
            if let Some(since) = c.connecting {
                let again = link.connected_before;
                if c.writable || c.readable {
                    match sockio::connect_done(&c.stream, link.addr) {
                        Ok(true) => {
                            c.connecting = None;
                            c.progressed = now;
                            if link.connected_before {
                                Counters::bump(&self.shared.counters.reconnects);
                                debug!(peer = %link.peer, "tcp data connection reopened");
                            }
                            link.connected_before = true;
                        }
                        Ok(false) => {}
                        Err(cause) => {
                            return Err(TcpFault::Unreachable {
                                addr: link.addr,
                                again,
                                cause,
                            })
                        }
                    }
                }
                if c.connecting.is_some() && now >= since + CONNECT_TIMEOUT {
                    return Err(TcpFault::ConnectTimeout {
                        addr: link.addr,
                        again,
                        after: CONNECT_TIMEOUT,
                    });
                }
            }
        }
        if link
            .conn
            .as_ref()
            .is_some_and(|c| c.connecting.is_none() && c.readable)
        {
            self.read_acks(link)?;
        }
        loop {
            let progressed = self.write(link, now)?;
            if link.stopped {
                return Ok(());
            }
            let idle = link
                .conn
                .as_ref()
                .is_none_or(|c| c.connecting.is_none() && c.out.is_empty());
            if !idle {
                break;
            }
            // Nothing on its way out: the next job, if any.
            let Some(job) = link.jobs.front() else {
                self.close_if_stale(link, now);
                break;
            };
            match self.step(link, job.tid, now) {
                Step::Stop => {
                    link.stopped = true;
                    link.jobs.clear();
                    return Ok(());
                }
                Step::Skip => {
                    link.jobs.pop_front();
                    link.reconnects = 0;
                }
                Step::Send(deadline) => {
                    let Some(job) = link.jobs.pop_front() else {
                        break;
                    };
                    self.deadlines.push(std::cmp::Reverse((deadline, job.tid)));
                    link.reconnects = 0;
                    // The blocks are pinned until the write ends: their digests now are those
                    // of the bytes sent.
                    let digests = link.writer.digests.then(|| {
                        job.local
                            .iter()
                            .zip(&job.remote)
                            .map(|(local, remote)| {
                                self.shared
                                    .local
                                    .block(*local)
                                    .map_or(0, |b| wire::digest(*remote, b))
                            })
                            .collect::<Vec<u32>>()
                    });
                    let head = wire::encode_write_header(job.tid, &job.remote, digests.as_deref())
                        .map_err(|_| TcpFault::TooManyBlocks(job.remote.len()))?;
                    if let Some(rate) = link.writer.rate {
                        // Idle time is not banked beyond a second: a pause does not buy a
                        // burst.
                        let due = bytes_at(link.paced_bytes, rate);
                        let idle = link.conn.as_ref().is_none_or(|c| c.out.is_empty());
                        if idle
                            && now.saturating_duration_since(link.paced_since)
                                > Duration::from_secs(1) + due
                        {
                            link.paced_since = now;
                            link.paced_bytes = 0;
                        }
                    }
                    if let Some(c) = &mut link.conn {
                        if c.out.is_empty() {
                            c.progressed = now;
                        }
                        c.out.push_back(Frame {
                            tid: Some(job.tid),
                            head,
                            blocks: job.local,
                            written: 0,
                        });
                    }
                    link.last_sent = now;
                }
                Step::Reconnect => {
                    link.reconnects += 1;
                    if link.reconnects > 2 {
                        return Err(TcpFault::KeepsClosing);
                    }
                    self.reconnect(link, now)?;
                }
            }
            let _ = progressed;
        }
        Ok(())
    }

    /// Closes `link`'s connection once it idled for `stale_after` with nothing awaiting an
    /// ACK: an idle session holds no data connection.
    fn close_if_stale(&mut self, link: &mut Link, now: Instant) {
        let stale = now.saturating_duration_since(link.last_sent) >= link.writer.stale_after;
        if stale && link.conn.is_some() && !self.awaits_acks(link) {
            if let Some(c) = link.conn.take() {
                self.by_conn.remove(&c.id);
                close(&c.stream);
                debug!(peer = %link.peer, "idle tcp data connection closed");
            }
            link.conn_open = false;
            if let Some(c) = lock(&self.shared.ends).conns.get_mut(&link.peer) {
                c.1 = false;
            }
        }
    }

    /// Decides, under the bookkeeping lock, what to do with job `tid` now.
    fn step(&self, link: &Link, tid: TransferId, now: Instant) -> Step {
        let mut e = lock(&self.shared.ends);
        if e.faults.contains_key(&link.peer) {
            return Step::Stop;
        }
        if !e.queued.contains_key(&tid) {
            return Step::Skip;
        }
        let Some(conn) = link.conn.as_ref().filter(|c| c.connecting.is_none()) else {
            return Step::Reconnect;
        };
        let open = link.conn_open && e.conns.get(&link.peer) == Some(&(conn.id, true));
        let pending = e
            .sent
            .values()
            .any(|s| s.peer == link.peer && s.conn == conn.id);
        let fresh = now.saturating_duration_since(link.last_sent) < link.writer.stale_after;
        // With WRITEs awaiting their ACK the connection is in use: if it closes, they fault.
        if !(pending || (open && fresh)) {
            return Step::Reconnect;
        }
        e.queued.remove(&tid);
        let job = link.jobs.front();
        let bytes = job.map_or(0, |j| j.local.len() as u64) * self.shared.block_len as u64;
        let own = bytes_at(bytes, link.writer.min_rate);
        // Pipelined behind WRITEs still awaiting their ACK, it gets their time too.
        let ahead = e
            .sent
            .values()
            .filter(|s| s.peer == link.peer)
            .map(|s| s.deadline)
            .max();
        let mut deadline = later(now, link.writer.grace.saturating_add(own));
        if let Some(ahead) = ahead {
            deadline = deadline.max(later(ahead, own));
        }
        e.sent.insert(
            tid,
            Sent {
                peer: link.peer.clone(),
                conn: conn.id,
                deadline,
                started: now,
                bytes,
            },
        );
        drop(e);
        Step::Send(deadline)
    }

    /// Replaces `link`'s connection with a fresh one (dialed now; the HELLO queued first).
    fn reconnect(&mut self, link: &mut Link, now: Instant) -> Result<(), TcpFault> {
        if let Some(old) = link.conn.take() {
            self.by_conn.remove(&old.id);
            close(&old.stream);
        }
        let stream = match sockio::start_connect(link.addr) {
            Ok(s) => s,
            Err(Some(cause)) => {
                return Err(TcpFault::Unreachable {
                    addr: link.addr,
                    again: link.connected_before,
                    cause,
                })
            }
            Err(None) => return Err(TcpFault::NoSocket(link.addr)),
        };
        let tls = if let Some(identity) = link.tls {
            let config = self.shared.tls.client().ok_or(TcpFault::NoTls)?;
            // The data listener must prove it is the peer: its certificate names the IP of the
            // peer's identity (not only the address dialed, which the peer's connect chose).
            let name = ServerName::IpAddress(identity.into());
            let mut session = rustls::ClientConnection::new(config, name)
                .map_err(|e| TcpFault::Tls(e.to_string()))?;
            // Records for this much plaintext are made per write, so a block goes out in few
            // system calls (rustls's default is 64 KiB).
            session.set_buffer_limit(Some(TLS_SEND_BUFFER));
            Some(Box::new(rustls::Connection::Client(session)))
        } else {
            None
        };
        let id = NEXT_CONN.fetch_add(1, Ordering::Relaxed);
        self.poller
            .add(stream.as_fd(), id)
            .map_err(|e| TcpFault::Poll(e.kind()))?;
        let hello = wire::encode_hello(self.shared.me.as_str(), &link.key)
            .map_err(|_| TcpFault::IdTooLong)?;
        let mut out = VecDeque::new();
        out.push_back(Frame {
            tid: None,
            head: hello,
            blocks: Vec::new(),
            written: 0,
        });
        link.conn = Some(Conn {
            id,
            stream,
            connecting: Some(now),
            readable: false,
            writable: true,
            out,
            acks: AckTurn::default(),
            tls,
            progressed: now,
        });
        link.conn_open = true;
        link.last_sent = now;
        self.by_conn.insert(id, link.peer.clone());
        lock(&self.shared.ends)
            .conns
            .insert(link.peer.clone(), (id, true));
        Ok(())
    }

    /// Writes what `link`'s connection has queued, as far as the socket and the pace allow;
    /// whether any byte went.
    fn write(&mut self, link: &mut Link, now: Instant) -> Result<bool, TcpFault> {
        let block_len = self.shared.block_len;
        let mut allowed = pace_allows(link, now);
        let Some(c) = &mut link.conn else {
            return Ok(false);
        };
        if c.connecting.is_some() {
            return Ok(false);
        }
        if let Some(tls) = &mut c.tls {
            // What rustls has ready goes first (the handshake's messages, records the socket
            // did not take); no frame is written before the handshake is done.
            if c.writable {
                match crate::tls::flush(&c.stream, tls) {
                    Ok(()) => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => c.writable = false,
                    Err(e) => return Err(tls_fault(e)),
                }
            }
            if tls.is_handshaking() {
                // A listener that took the connection and never answers (a hung peer,
                // something else on that port) faults the link, not the thread.
                if now.saturating_duration_since(c.progressed) >= TLS_HANDSHAKE_TIMEOUT {
                    return Err(TcpFault::Tls(format!(
                        "no TLS handshake with the data listener within {TLS_HANDSHAKE_TIMEOUT:?}"
                    )));
                }
                return Ok(false);
            }
        }
        let mut any = false;
        while c.writable && allowed > 0 {
            let Some(frame) = c.out.front_mut() else {
                break;
            };
            let total = frame.len(block_len);
            if link.writer.rate.is_some() && allowed < PACE_CHUNK.min(total - frame.written) {
                // Under a pace: a chunk at a time (the link's timer says when).
                break;
            }
            // The next slice of the frame: the header's rest, or the current block's.
            let slice: &[u8] = if frame.written < frame.head.len() {
                &frame.head[frame.written..]
            } else {
                let into = frame.written - frame.head.len();
                let (nth, at) = (into / block_len.max(1), into % block_len.max(1));
                let Some(&b) = frame.blocks.get(nth) else {
                    c.out.pop_front();
                    continue;
                };
                let Some(block) = self.shared.local.block(b) else {
                    return Err(TcpFault::BlockOutside(b.get()));
                };
                &block[at..]
            };
            let slice = &slice[..slice.len().min(allowed)];
            let wrote = match &mut c.tls {
                Some(tls) => crate::tls::write(&c.stream, tls, slice),
                None => (&c.stream).write(slice),
            };
            match wrote {
                Ok(0) => return Err(TcpFault::Send(ErrorKind::WriteZero)),
                Ok(n) => {
                    frame.written += n;
                    any = true;
                    c.progressed = now;
                    if link.writer.rate.is_some() {
                        link.paced_bytes += n as u64;
                        allowed = allowed.saturating_sub(n);
                    }
                    if frame.written >= total {
                        if let Some(tid) = frame.tid {
                            c.acks.left(tid);
                        }
                        c.out.pop_front();
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => c.writable = false,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::InvalidData && c.tls.is_some() => {
                    return Err(tls_fault(e));
                }
                Err(e) => {
                    // A listener that refused our certificate sent an alert and closed: its
                    // reason, where it arrived before the reset, says more than the pipe.
                    if let Some(tls) = &mut c.tls {
                        if let Some(alert) = crate::tls::alert_before_close(&c.stream, tls) {
                            return Err(tls_fault(alert));
                        }
                    }
                    let untouched = frame.written == 0 && frame.tid.is_some();
                    let tid = frame.tid;
                    return match (untouched, tid) {
                        (true, Some(tid)) => {
                            // Found closed before a byte of this frame left: take it back
                            // (if nothing else awaits an ACK there) and reconnect.
                            if self.retract(link, tid) {
                                debug!(peer = %link.peer, error = %e,
                                    "tcp data connection found closed; reconnecting");
                                Ok(any)
                            } else {
                                Err(TcpFault::Send(e.kind()))
                            }
                        }
                        _ => Err(TcpFault::Send(e.kind())),
                    };
                }
            }
        }
        if let Some(c) = &link.conn {
            if !c.out.is_empty()
                && now.saturating_duration_since(c.progressed) >= WRITE_STALL_TIMEOUT
            {
                return Err(TcpFault::Stalled(WRITE_STALL_TIMEOUT));
            }
        }
        Ok(any)
    }

    /// Takes back transfer `tid`, whose frame never left because `link`'s connection was found
    /// closed, if nothing else awaits an ACK on it: the job goes back to the queue's front and
    /// the connection is dropped. `false` if it is too late.
    fn retract(&mut self, link: &mut Link, tid: TransferId) -> bool {
        let Some(conn_id) = link.conn.as_ref().map(|c| c.id) else {
            return false;
        };
        let mut e = lock(&self.shared.ends);
        if !e
            .sent
            .get(&tid)
            .is_some_and(|s| s.peer == link.peer && s.conn == conn_id)
        {
            return false;
        }
        let others = e
            .sent
            .iter()
            .any(|(t, s)| *t != tid && s.peer == link.peer && s.conn == conn_id);
        if others {
            return false;
        }
        e.sent.remove(&tid);
        e.queued.insert(tid, link.peer.clone());
        if let Some(c) = e.conns.get_mut(&link.peer) {
            if c.0 == conn_id {
                c.1 = false;
            }
        }
        drop(e);
        if let Some(c) = link.conn.take() {
            self.by_conn.remove(&c.id);
            close(&c.stream);
            if let Some(frame) = c.out.into_iter().find(|f| f.tid == Some(tid)) {
                link.jobs.push_front(Job {
                    tid,
                    local: frame.blocks,
                    remote: decode_remote(&frame.head),
                });
            }
        }
        link.conn_open = false;
        true
    }

    /// ACKs in, until the socket has no more (or this drive's budget is spent). An ACK counts
    /// only for a WRITE awaiting it on this connection: one for another connection's
    /// transfer, or more ACKs than WRITEs, faults this peer and completes nothing. The
    /// connection's end: with WRITEs awaiting their ACK on it, a fault; idle, it is only
    /// forgotten (the next write reconnects).
    fn read_acks(&mut self, link: &mut Link) -> Result<(), TcpFault> {
        let Some(c) = &mut link.conn else {
            return Ok(());
        };
        let mut acks = Vec::new();
        let mut ended = false;
        let mut excess = None;
        let mut reads = 0;
        loop {
            if reads == ACK_READS_PER_DRIVE {
                // `readable` stays set: `rearm` drives this link again at once, after the
                // other links had their turn.
                break;
            }
            reads += 1;
            let read = match &mut c.tls {
                Some(tls) => crate::tls::read(&c.stream, tls, c.acks.room()),
                None => (&c.stream).read(c.acks.room()),
            };
            match read {
                Ok(0) => {
                    ended = true;
                    break;
                }
                Ok(n) => {
                    let being_sent = c.out.front().and_then(|f| f.tid);
                    match c.acks.filled(n, being_sent) {
                        Ok(None) => {}
                        Ok(Some(ack)) => acks.push(ack),
                        // Not in turn: early (before its WRITE's last byte left), for
                        // another connection's transfer, repeated, or one too many.
                        Err(AckViolation::OutOfTurn(tid)) => {
                            excess = Some(tid);
                            break;
                        }
                        Err(AckViolation::NotAnAck) => {
                            ended = true;
                            break;
                        }
                    }
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    c.readable = false;
                    break;
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // The handshake failed (the listener's certificate), or a record did not
                // authenticate: the peer is faulted with the reason.
                Err(e) if e.kind() == ErrorKind::InvalidData && c.tls.is_some() => {
                    return Err(tls_fault(e));
                }
                Err(_) => {
                    ended = true;
                    break;
                }
            }
        }
        let conn_id = c.id;
        if !acks.is_empty() || excess.is_some() {
            let mut refused = false;
            let mut foreign = excess;
            let mut e = lock(&self.shared.ends);
            for ack in acks {
                let tid = match ack {
                    Ack::Written(t) | Ack::Refused(t) | Ack::Corrupted(t) => t,
                };
                match e.sent.get(&tid) {
                    // Awaiting its ACK on this very connection: the one ACK that counts.
                    Some(s) if s.peer == link.peer && s.conn == conn_id => {}
                    // Another connection's transfer (another peer's, most likely): a lie
                    // that must not complete it; the liar is faulted, the transfer waits
                    // for its own ACK.
                    Some(_) => {
                        foreign = Some(tid);
                        break;
                    }
                    // Not awaited (cancelled at once, or never ours): nothing to do.
                    None => continue,
                }
                if e.sent.remove(&tid).is_some() {
                    let report = e.ended.entry(link.peer.clone()).or_default();
                    match ack {
                        Ack::Written(_) => report.done.push(tid),
                        // A block did not match its digest (`tcp_block_digests`): that
                        // transfer fails (its load is a miss); the link and the peer go on.
                        Ack::Corrupted(_) => {
                            report.failed.push(tid);
                            Counters::bump(&self.shared.counters.corrupted_writes);
                            if let Some(suppressed) =
                                crate::admit_warning("a tcp write arrived corrupted")
                            {
                                warn!(peer = %link.peer, tid = tid.get(), suppressed,
                                    "the receiver found a block of our write corrupted (digest mismatch); the transfer failed");
                            }
                        }
                        Ack::Refused(_) => {
                            report.failed.push(tid);
                            refused = true;
                        }
                    }
                }
            }
            drop(e);
            (self.shared.wake)();
            if let Some(tid) = foreign {
                return Err(TcpFault::ForeignAck(tid.get()));
            }
            if refused {
                // The receiver refuses only a write it holds no permit for (or one without
                // the digests it asked for), and closes.
                return Err(TcpFault::WriteRefused);
            }
        }
        if ended {
            let pending = lock(&self.shared.ends)
                .sent
                .values()
                .any(|s| s.peer == link.peer && s.conn == conn_id);
            if pending {
                return Err(TcpFault::Lost);
            }
            if let Some(c) = link.conn.take() {
                self.by_conn.remove(&c.id);
                close(&c.stream);
            }
            link.conn_open = false;
            if let Some(c) = lock(&self.shared.ends).conns.get_mut(&link.peer) {
                if c.0 == conn_id {
                    c.1 = false;
                }
            }
            debug!(peer = %link.peer, "idle tcp data connection closed; the next write reconnects");
        }
        Ok(())
    }

    /// The earliest deadline of a transfer awaiting its ACK.
    fn next_deadline(&mut self) -> Option<Instant> {
        self.deadlines.peek().map(|d| d.0 .0)
    }

    /// Fails the transfers unacknowledged past their deadline: each faults its peer, whose link
    /// is reset and dropped, so its socket's buffers go at once.
    fn expire(&mut self, now: Instant) {
        while let Some(std::cmp::Reverse((at, tid))) = self.deadlines.peek().copied() {
            if at > now {
                break;
            }
            self.deadlines.pop();
            let sent = {
                let e = lock(&self.shared.ends);
                match e.sent.get(&tid) {
                    Some(s) if s.deadline <= now && !e.faults.contains_key(&s.peer) => s.clone(),
                    _ => continue,
                }
            };
            Counters::bump(&self.shared.counters.transfer_timeouts);
            let took = sent.started.elapsed();
            let allowed = sent.deadline.saturating_duration_since(sent.started);
            let why = TcpFault::Late {
                tid: tid.get(),
                bytes: sent.bytes,
                allowed,
            };
            if let Some(suppressed) = crate::admit_warning("tcp transfer past its deadline") {
                warn!(peer = %sent.peer, tid = tid.get(), bytes = sent.bytes, ?took, ?allowed, suppressed,
                    "tcp transfer not acknowledged by its deadline; faulting the peer and resetting its data connection");
            }
            TcpPlane::fault(&self.shared.ends, &sent.peer, why, &self.shared.wake);
            self.unlink(&sent.peer, true, true);
        }
    }
}

/// Bytes the pace lets `link` write now (`usize::MAX` without a pace): what the rate allows
/// since the window opened, plus one chunk, which goes at once (as a writer that sleeps after
/// each write until its bytes are due).
fn pace_allows(link: &Link, now: Instant) -> usize {
    let Some(rate) = link.writer.rate else {
        return usize::MAX;
    };
    let elapsed = now.saturating_duration_since(link.paced_since);
    let allowed = (elapsed.as_secs_f64() * rate as f64) as u64 + PACE_CHUNK as u64;
    usize::try_from(allowed.saturating_sub(link.paced_bytes)).unwrap_or(usize::MAX)
}

/// A TLS error of a data connection, with rustls's reason.
fn tls_fault(e: std::io::Error) -> TcpFault {
    TcpFault::Tls(e.to_string())
}

/// The block indexes a WRITE header names (to re-queue a frame that never left; its digests,
/// if any, follow them).
fn decode_remote(head: &[u8]) -> Vec<BlockIndex> {
    let count = head
        .get(4 + 8..4 + wire::WRITE_HEAD_LEN)
        .and_then(|c| <[u8; 4]>::try_from(c).ok())
        .map_or(0, |c| u32::from_be_bytes(c) as usize);
    head.get(4 + wire::WRITE_HEAD_LEN..4 + wire::WRITE_HEAD_LEN + 8 * count)
        .and_then(|raw| wire::decode_indexes(raw).ok())
        .unwrap_or_default()
}
