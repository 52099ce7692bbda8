//! The send side of the tcp plane: per peer, a dial at registration, then one writer thread
//! (which reconnects when its idle connection was closed) and an ACK reader per connection;
//! per plane, one watcher failing transfers not acknowledged by their deadline.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use kvpeer_core::{BlockIndex, PlaneError, Registration, TransferId};
use kvpeer_proto::PeerId;
use kvpeer_store::PoolView;
use tracing::{debug, warn};

use super::wire::{self, ACK_LEN};
use super::{
    abort, close, protocol, Counters, Ends, Links, Sent, TcpPlane, CONNECT_TIMEOUT, KEY_LEN,
    WRITE_STALL_TIMEOUT,
};
use crate::data::shm::Wake;
use crate::lock;

/// Numbers outbound connections, across peers and links, so that an ACK reader can tell its
/// connection from the one that replaced it.
static NEXT_CONN: AtomicU64 = AtomicU64::new(1);

fn next_conn() -> u64 {
    NEXT_CONN.fetch_add(1, Ordering::Relaxed)
}

pub(super) struct Job {
    tid: TransferId,
    local: Vec<BlockIndex>,
    remote: Vec<BlockIndex>,
}

/// A registered peer's outbound link.
pub(super) struct PeerLink {
    jobs: Sender<Job>,
    /// The writer's current connection (to shut it down).
    current: Arc<Mutex<Option<TcpStream>>>,
    stop: Arc<AtomicBool>,
    pub(super) num_blocks: u64,
}

impl PeerLink {
    /// Hands a write to the link's writer; `false` if it is gone.
    pub(super) fn queue(
        &self,
        tid: TransferId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> bool {
        let job = Job {
            tid,
            local: local.to_vec(),
            remote: remote.to_vec(),
        };
        self.jobs.send(job).is_ok()
    }

    /// Ends the link: its writer stops, its connection closes.
    pub(super) fn close(self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(s) = lock(&self.current).as_ref() {
            close(s);
        }
    }

    /// Ends the link at once: as [`PeerLink::close`], and the connection is reset, so bytes a
    /// peer has not read are dropped rather than kept for it.
    fn abort(self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(s) = lock(&self.current).as_ref() {
            abort(s);
        }
    }
}

/// Everything a link's threads need.
#[derive(Clone)]
struct LinkCx {
    peer: PeerId,
    addr: String,
    me: PeerId,
    key: [u8; KEY_LEN],
    ends: Arc<Mutex<Ends>>,
    deadlines: Arc<Condvar>,
    wake: Wake,
    counters: Arc<Counters>,
}

impl TcpPlane {
    /// Drops the outbound link to `peer` (and any dial still running for it).
    pub(super) fn drop_link(&mut self, peer: &PeerId) {
        let link = {
            let mut l = lock(&self.links);
            l.dialing.remove(peer);
            l.map.remove(peer)
        };
        if let Some(link) = link {
            link.close();
        }
        lock(&self.ends).conns.remove(peer);
    }

    /// Dials `peer`'s data listener off the core's thread; the registration is done when the
    /// HELLO is out, failed if the dial fails (reported once: there is no retry loop).
    pub(super) fn start_link(
        &mut self,
        peer: PeerId,
        addr: String,
        key: [u8; KEY_LEN],
        num_blocks: u64,
    ) {
        let dial_no = {
            let mut l = lock(&self.links);
            l.next_dial += 1;
            let n = l.next_dial;
            l.dialing.insert(peer.clone(), n);
            n
        };
        let cx = LinkCx {
            peer: peer.clone(),
            addr,
            me: self.local_id.clone(),
            key,
            ends: self.ends.clone(),
            deadlines: self.deadlines.clone(),
            wake: self.wake.clone(),
            counters: self.counters.clone(),
        };
        let limits = lock(&self.limits).clone();
        let writer = Writer {
            local: self.local.clone(),
            block_len: self.block_len as usize,
            rate: self.max_write_rate,
            // Reconnect before the receiver's idle timeout can race a new WRITE.
            stale_after: limits.idle_timeout / 2,
            // Never asks a peer to take our bytes faster than we send them.
            min_rate: limits
                .min_write_rate
                .min(self.max_write_rate.unwrap_or(u64::MAX))
                .max(1),
            grace: limits.transfer_timeout,
        };
        let who = peer.clone();
        let (links, registrations, wake) = (
            self.links.clone(),
            self.registrations.clone(),
            self.wake.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("kvpeer-tcp-dial".into())
            .spawn(move || {
                let dialed = dial(&cx.addr, &cx.me, &cx.key);
                let mut l = lock(&links);
                if l.dialing.get(&peer) != Some(&dial_no) {
                    // Removed or registered again meanwhile: this dial is moot.
                    if let Ok(s) = &dialed {
                        close(s);
                    }
                    return;
                }
                l.dialing.remove(&peer);
                let addr = cx.addr.clone();
                let state = match dialed.and_then(|s| writer.start(cx, s, num_blocks)) {
                    Ok(link) => {
                        l.map.insert(peer.clone(), link);
                        Registration::Done
                    }
                    Err(e) => Registration::Failed(PlaneError::transport(format!(
                        "cannot reach the data listener at {addr}: {e}"
                    ))),
                };
                lock(&registrations).insert(peer, state);
                drop(l);
                wake();
            });
        if let Err(e) = spawned {
            if let Some(suppressed) = crate::admit_warning("cannot start a tcp dial thread") {
                warn!(error = %e, suppressed, "cannot start a tcp dial thread");
            }
            lock(&self.links).dialing.remove(&who);
            lock(&self.registrations).insert(
                who,
                Registration::Failed(PlaneError::resources(format!(
                    "cannot start a tcp dial thread: {e}"
                ))),
            );
        }
    }
}

/// Opens a data connection and sends the HELLO.
fn dial(addr: &str, me: &PeerId, key: &[u8; KEY_LEN]) -> std::io::Result<TcpStream> {
    let target = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| protocol(format!("{addr} resolves to nothing")))?;
    let mut s = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)?;
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(WRITE_STALL_TIMEOUT))?;
    let hello =
        wire::encode_hello(me.as_str(), key).map_err(|_| protocol("peer id too long".into()))?;
    s.write_all(&hello)?;
    Ok(s)
}

/// A link's writer settings.
struct Writer {
    /// The pool the blocks are sent from.
    local: PoolView,
    block_len: usize,
    rate: Option<u64>,
    stale_after: Duration,
    /// The slowest a peer may take our WRITEs (bytes per second, at least 1).
    min_rate: u64,
    /// A WRITE's fixed allowance on top of its bytes at `min_rate`.
    grace: Duration,
}

/// What the writer does with its next job.
enum Step {
    /// Cancelled before it was sent.
    Skip,
    /// Moved to `sent` on the current connection: write it.
    Send,
    /// The connection is closed (or about to idle out) with nothing awaiting an ACK: open a
    /// fresh one first.
    Reconnect,
    /// The peer is faulted: stop.
    Stop,
}

/// How a frame's send failed.
enum SendError {
    /// Before a byte of it left (the connection was found closed).
    NothingSent(std::io::Error),
    /// Part of it may have reached the receiver.
    Partial(std::io::Error),
}

impl Writer {
    /// Starts the writer and the ACK reader on the freshly dialed `stream`.
    fn start(self, cx: LinkCx, stream: TcpStream, num_blocks: u64) -> std::io::Result<PeerLink> {
        let (tx, rx) = channel::<Job>();
        let conn = next_conn();
        let current = Arc::new(Mutex::new(Some(stream.try_clone()?)));
        let stop = Arc::new(AtomicBool::new(false));
        lock(&cx.ends).conns.insert(cx.peer.clone(), (conn, true));
        spawn_acks(&cx, conn, stream.try_clone()?)?;
        let (cur, halt) = (current.clone(), stop.clone());
        std::thread::Builder::new()
            .name("kvpeer-tcp-send".into())
            .spawn(move || self.run(cx, rx, stream, conn, &cur, &halt))?;
        Ok(PeerLink {
            jobs: tx,
            current,
            stop,
            num_blocks,
        })
    }

    fn run(
        self,
        cx: LinkCx,
        rx: Receiver<Job>,
        mut out: TcpStream,
        mut conn: u64,
        current: &Mutex<Option<TcpStream>>,
        stop: &AtomicBool,
    ) {
        let mut pacer = self.rate.map(Pacer::new);
        let mut last_sent = Instant::now();
        for job in rx {
            let mut reconnects = 0;
            loop {
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                match self.step(&cx, &job, conn, last_sent) {
                    Step::Stop => return,
                    Step::Skip => break,
                    Step::Reconnect => {
                        reconnects += 1;
                        if reconnects > 2 {
                            let why = "the tcp data connection keeps closing before a write";
                            TcpPlane::fault(&cx.ends, &cx.peer, why.into(), &cx.wake);
                            return;
                        }
                        match reconnect(&cx, &out, current, stop) {
                            Ok((s, n)) => {
                                (out, conn) = (s, n);
                                last_sent = Instant::now();
                            }
                            Err(_) if stop.load(Ordering::SeqCst) => return,
                            Err(e) => {
                                let why = format!(
                                    "cannot reconnect to the data listener at {}: {e}",
                                    cx.addr
                                );
                                TcpPlane::fault(&cx.ends, &cx.peer, why, &cx.wake);
                                return;
                            }
                        }
                    }
                    Step::Send => {
                        match send(&mut out, &job, &self.local, self.block_len, pacer.as_mut()) {
                            Ok(()) => {
                                last_sent = Instant::now();
                                break;
                            }
                            Err(SendError::NothingSent(e)) if retract(&cx, &job, conn) => {
                                debug!(peer = %cx.peer, error = %e, "tcp data connection found closed; reconnecting");
                            }
                            Err(_) if stop.load(Ordering::SeqCst) => return,
                            Err(SendError::NothingSent(e) | SendError::Partial(e)) => {
                                let why = format!("tcp send failed: {e}");
                                TcpPlane::fault(&cx.ends, &cx.peer, why, &cx.wake);
                                return;
                            }
                        }
                    }
                }
            }
        }
    }

    /// Decides, under the bookkeeping lock, what to do with `job` on connection `conn`.
    fn step(&self, cx: &LinkCx, job: &Job, conn: u64, last_sent: Instant) -> Step {
        let mut e = lock(&cx.ends);
        if e.faults.contains_key(&cx.peer) {
            return Step::Stop;
        }
        if !e.queued.contains_key(&job.tid) {
            return Step::Skip;
        }
        let open = e.conns.get(&cx.peer) == Some(&(conn, true));
        let pending = e.sent.values().any(|s| s.peer == cx.peer && s.conn == conn);
        // With WRITEs awaiting their ACK the connection is in use: if it closes, they fault.
        if pending || (open && last_sent.elapsed() < self.stale_after) {
            e.queued.remove(&job.tid);
            let now = Instant::now();
            let bytes = (job.local.len() as u64).saturating_mul(self.block_len as u64);
            let own = bytes_at(bytes, self.min_rate);
            // Pipelined behind WRITEs still awaiting their ACK, it gets their time too.
            let ahead = e
                .sent
                .values()
                .filter(|s| s.peer == cx.peer)
                .map(|s| s.deadline)
                .max();
            let mut deadline = later(now, self.grace.saturating_add(own));
            if let Some(ahead) = ahead {
                deadline = deadline.max(later(ahead, own));
            }
            e.sent.insert(
                job.tid,
                Sent {
                    peer: cx.peer.clone(),
                    conn,
                    deadline,
                    started: now,
                    bytes,
                },
            );
            if e.next_deadline.is_none_or(|next| deadline < next) {
                cx.deadlines.notify_all();
            }
            return Step::Send;
        }
        Step::Reconnect
    }
}

/// How long `bytes` take at `rate` bytes per second (at least 1).
fn bytes_at(bytes: u64, rate: u64) -> Duration {
    let rate = rate.max(1);
    let secs = bytes / rate;
    let nanos = (bytes % rate) as u128 * 1_000_000_000 / rate as u128;
    Duration::new(secs, nanos as u32)
}

/// `t + d`, or as far as an `Instant` goes (a deadline that far off never comes).
fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .or_else(|| t.checked_add(Duration::from_secs(100 * 365 * 86_400)))
        .unwrap_or(t)
}

/// Takes back a job whose frame never left (its connection was found closed) if nothing else
/// awaits an ACK on that connection; `false` if it is too late (the ACK reader faulted it).
fn retract(cx: &LinkCx, job: &Job, conn: u64) -> bool {
    let mut e = lock(&cx.ends);
    if !e
        .sent
        .get(&job.tid)
        .is_some_and(|s| s.peer == cx.peer && s.conn == conn)
    {
        return false;
    }
    let others = e
        .sent
        .iter()
        .any(|(t, s)| *t != job.tid && s.peer == cx.peer && s.conn == conn);
    if others {
        return false;
    }
    e.sent.remove(&job.tid);
    e.queued.insert(job.tid, cx.peer.clone());
    if let Some(c) = e.conns.get_mut(&cx.peer) {
        if c.0 == conn {
            c.1 = false;
        }
    }
    true
}

/// Replaces the writer's connection `old` (closed, or idle for long) with a fresh one: same
/// HELLO and key, a new ACK reader.
fn reconnect(
    cx: &LinkCx,
    old: &TcpStream,
    current: &Mutex<Option<TcpStream>>,
    stop: &AtomicBool,
) -> std::io::Result<(TcpStream, u64)> {
    close(old);
    let s = dial(&cx.addr, &cx.me, &cx.key)?;
    let conn = next_conn();
    lock(&cx.ends).conns.insert(cx.peer.clone(), (conn, true));
    spawn_acks(cx, conn, s.try_clone()?)?;
    {
        let mut cur = lock(current);
        *cur = Some(s.try_clone()?);
        if stop.load(Ordering::SeqCst) {
            // The link was dropped while we dialed.
            close(&s);
        }
    }
    Counters::bump(&cx.counters.reconnects);
    debug!(peer = %cx.peer, "tcp data connection reopened");
    Ok((s, conn))
}

/// Starts the ACK reader of connection `conn`.
fn spawn_acks(cx: &LinkCx, conn: u64, inp: TcpStream) -> std::io::Result<()> {
    let cx = cx.clone();
    std::thread::Builder::new()
        .name("kvpeer-tcp-ack".into())
        .spawn(move || read_acks(&cx, conn, inp))?;
    Ok(())
}

/// Acknowledgements in, until the connection ends. Closing with WRITEs awaiting their ACK is a
/// fault of the peer; closing idle only marks the connection closed, and the writer opens a
/// fresh one before its next WRITE.
fn read_acks(cx: &LinkCx, conn: u64, mut inp: TcpStream) {
    loop {
        let mut frame = [0u8; ACK_LEN];
        let ack = inp
            .read_exact(&mut frame)
            .ok()
            .and_then(|()| wire::decode_ack(&frame).ok());
        let Some((tid, written)) = ack else {
            let mut e = lock(&cx.ends);
            let pending: Vec<TransferId> = e
                .sent
                .iter()
                .filter(|(_, s)| s.peer == cx.peer && s.conn == conn)
                .map(|(t, _)| *t)
                .collect();
            let current = e.conns.get(&cx.peer).is_some_and(|c| c.0 == conn);
            if !pending.is_empty() && current {
                drop(e);
                let why = "tcp data connection lost".to_string();
                TcpPlane::fault(&cx.ends, &cx.peer, why, &cx.wake);
            } else if !pending.is_empty() {
                // The link was dropped (its session ended): its writes fail, but a fault now
                // would land on the peer's next session.
                for t in &pending {
                    e.sent.remove(t);
                }
                e.ended
                    .entry(cx.peer.clone())
                    .or_default()
                    .failed
                    .extend(pending);
                drop(e);
                (cx.wake)();
            } else {
                if let Some(c) = e.conns.get_mut(&cx.peer) {
                    if c.0 == conn {
                        c.1 = false;
                    }
                }
                debug!(peer = %cx.peer, "idle tcp data connection closed; the next write reconnects");
            }
            return;
        };
        let mut e = lock(&cx.ends);
        let mut refused = false;
        if e.sent.remove(&tid).is_some() {
            let report = e.ended.entry(cx.peer.clone()).or_default();
            if written {
                report.done.push(tid)
            } else {
                report.failed.push(tid);
                refused = true;
            }
        }
        drop(e);
        if refused {
            // The receiver refuses only a write it holds no permit for, and closes: a fault.
            let why = "the receiver refused a tcp write".to_string();
            TcpPlane::fault(&cx.ends, &cx.peer, why, &cx.wake);
            return;
        }
        (cx.wake)();
    }
}

fn send(
    out: &mut TcpStream,
    job: &Job,
    local: &PoolView,
    block_len: usize,
    mut pacer: Option<&mut Pacer>,
) -> Result<(), SendError> {
    // More blocks than a u32 counts never reach here (both pools index under 2^32 blocks).
    let header = wire::encode_write_header(job.tid, &job.remote)
        .map_err(|e| SendError::Partial(protocol(e.to_string())))?;
    // The first write tells a connection found closed (nothing of the frame left) from one
    // lost in the middle of it.
    let first = loop {
        match out.write(&header) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Ok(0) => return Err(SendError::NothingSent(std::io::ErrorKind::WriteZero.into())),
            Ok(n) => break n,
            Err(e) => return Err(SendError::NothingSent(e)),
        }
    };
    out.write_all(&header[first..])
        .map_err(SendError::Partial)?;
    for &l in &job.local {
        let block = local.block(l).ok_or_else(|| {
            SendError::Partial(protocol(format!("local block {l} outside the pool")))
        })?;
        out.write_all(block).map_err(SendError::Partial)?;
        if let Some(p) = pacer.as_deref_mut() {
            p.sent(block_len as u64);
        }
    }
    Ok(())
}

/// Holds one writer to a byte rate: after each block it sleeps until the bytes sent so far
/// are due. Idle time is not banked beyond one second, so a pause does not buy a burst.
struct Pacer {
    rate: u64,
    since: Instant,
    bytes: u64,
}

impl Pacer {
    fn new(bytes_per_second: u64) -> Self {
        Pacer {
            rate: bytes_per_second,
            since: Instant::now(),
            bytes: 0,
        }
    }

    fn sent(&mut self, n: u64) {
        let now = Instant::now();
        if now.duration_since(self.since) > Duration::from_secs(1) + self.due(self.bytes) {
            self.since = now;
            self.bytes = 0;
        }
        self.bytes += n;
        let due = self.since + self.due(self.bytes);
        if due > now {
            std::thread::sleep(due - now);
        }
    }

    fn due(&self, bytes: u64) -> Duration {
        Duration::from_secs_f64(bytes as f64 / self.rate as f64)
    }
}

/// The plane's deadline watcher: sleeps until the earliest deadline of a transfer awaiting its
/// ACK (or until one is sent, with nothing pending), and fails each transfer past it.
pub(super) struct Watch {
    pub(super) ends: Arc<Mutex<Ends>>,
    pub(super) deadlines: Arc<Condvar>,
    pub(super) links: Arc<Mutex<Links>>,
    pub(super) counters: Arc<Counters>,
    pub(super) wake: Wake,
    pub(super) stop: Arc<AtomicBool>,
}

impl Watch {
    pub(super) fn run(self) {
        let mut e = lock(&self.ends);
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            let now = Instant::now();
            let late: Vec<(TransferId, Sent)> = e
                .sent
                .iter()
                .filter(|(_, s)| s.deadline <= now)
                .map(|(t, s)| (*t, s.clone()))
                .collect();
            if !late.is_empty() {
                e.next_deadline = None;
                drop(e);
                for (tid, sent) in late {
                    self.expire(tid, &sent);
                }
                e = lock(&self.ends);
                continue;
            }
            let next = e.sent.values().map(|s| s.deadline).min();
            e.next_deadline = next;
            e = match next {
                None => self.deadlines.wait(e).unwrap_or_else(|p| p.into_inner()),
                Some(at) => {
                    let left = at.saturating_duration_since(now);
                    let waited = self.deadlines.wait_timeout(e, left);
                    waited.unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
    }

    /// Fails transfer `tid`, still unacknowledged past its deadline: its peer is faulted (its
    /// transfers fail, the session winds down) and its link reset and dropped, so the writer
    /// thread, the ACK reader and the socket's buffers go at once.
    fn expire(&self, tid: TransferId, sent: &Sent) {
        let mut links = lock(&self.links);
        {
            let e = lock(&self.ends);
            // Acknowledged, failed or cancelled meanwhile, or already faulted.
            let pending = e.sent.get(&tid).is_some_and(|s| s.conn == sent.conn);
            if !pending || e.faults.contains_key(&sent.peer) {
                return;
            }
        }
        Counters::bump(&self.counters.transfer_timeouts);
        let took = sent.started.elapsed();
        let allowed = sent.deadline.saturating_duration_since(sent.started);
        let why = format!(
            "tcp transfer {} ({} bytes) not acknowledged within {allowed:?} of its first byte",
            tid.get(),
            sent.bytes
        );
        if let Some(suppressed) = crate::admit_warning("tcp transfer past its deadline") {
            warn!(peer = %sent.peer, tid = tid.get(), bytes = sent.bytes, ?took, ?allowed, suppressed,
                "tcp transfer not acknowledged by its deadline; faulting the peer and resetting its data connection");
        }
        TcpPlane::fault(&self.ends, &sent.peer, why, &self.wake);
        let link = links.map.remove(&sent.peer);
        drop(links);
        lock(&self.ends).conns.remove(&sent.peer);
        if let Some(link) = link {
            link.abort();
        }
    }
}
