//! The `tcp` data plane: peers on any host. The writer streams blocks to the peer's data
//! listener; the receiver reads them straight into its pool and acknowledges; the transfer is
//! done when the acknowledgement arrives.
//!
//! Byte format (all integers big-endian; docs/data-planes.md has the full description):
//!
//! ```text
//! HELLO  writer → receiver, once:  "KVPH" | version u8 = 1 | id_len u16 | writer peer id (UTF-8)
//! WRITE  writer → receiver:        "KVPW" | transfer id u64 | count u32 | count × block index u64
//!                                  | count × block_len bytes, in index order
//! ACK    receiver → writer:        "KVPA" | transfer id u64 | status u8 (0 written, 1 refused)
//! ```
//!
//! **Write permits**: the receiver accepts a WRITE only if every index is inside its pool and
//! is a block it has an outstanding fetch for from that writer ([`DataPlane::expect_writes`]).
//! It claims those permits before reading a single block byte, so no other connection can write
//! the same blocks; anything else is refused (ACK 1) and the connection closed, which faults the
//! writer. A refused write never touches the pool.
//!
//! Threads: a listener and one reader per inbound connection (receive side); per peer one
//! writer and one acknowledgement reader (send side). The core's thread only queues and polls;
//! `wake` runs after each completion. One user-space copy per side: the writer writes from its
//! mapping of the pool, the receiver reads into its mapping of the pool.

use std::collections::{HashMap, HashSet};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_core::{
    BlockIndex, CancelMode, DataPlane, PlanePoll, Registration, RemoteMemory, TransferId,
};
use kvpeer_proto::PeerId;
use memmap2::{Mmap, MmapMut};
use tracing::{debug, warn};

use crate::metadata::AgentMetadata;
use crate::shm::Wake;
use crate::{lock, shm_object};

const HELLO: &[u8; 4] = b"KVPH";
const WRITE: &[u8; 4] = b"KVPW";
const ACK: &[u8; 4] = b"KVPA";
const VERSION: u8 = 1;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Why the plane could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpError {
    /// The local pool could not be mapped.
    #[error("cannot map the local shared-memory object /{name}: {reason}")]
    Local {
        /// Its name.
        name: String,
        /// Why.
        reason: String,
    },
    /// The data listener could not be bound or started.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// The system's error.
        source: std::io::Error,
    },
}

/// The pool as the receive side writes it: a raw base pointer, so that connections write
/// disjoint blocks without a lock held across socket reads (a slow peer must not stall others).
struct PoolWriter {
    map: MmapMut,
    block_len: usize,
    num_blocks: u64,
}

impl PoolWriter {
    /// Where block `index` lies in the mapping: (first byte, length). Only a thread holding
    /// the block's claimed write permit may write through it (see `receive`).
    fn block_ptr(&self, index: u64) -> Option<(*mut u8, usize)> {
        if index >= self.num_blocks {
            return None;
        }
        let start = usize::try_from(index).ok()?.checked_mul(self.block_len)?;
        if start.checked_add(self.block_len)? > self.map.len() {
            return None;
        }
        // In bounds (checked above), so the offset stays inside the mapping.
        Some((
            self.map.as_ptr().wrapping_add(start) as *mut u8,
            self.block_len,
        ))
    }
}

// SAFETY: the mapping is written only through `block_ptr` by threads holding disjoint claimed
// permits (see `receive`), and read by nobody while those writes run.
unsafe impl Sync for PoolWriter {}

type Permits = Arc<Mutex<HashMap<PeerId, HashSet<BlockIndex>>>>;

#[derive(Default)]
struct Ends {
    /// Ended transfers not yet polled, per peer.
    ended: HashMap<PeerId, PlanePoll>,
    /// Transfers written but not acknowledged: tid → peer.
    sent: HashMap<TransferId, PeerId>,
    /// Transfers queued to a writer, not yet sent.
    queued: HashSet<TransferId>,
    faults: HashMap<PeerId, String>,
}

struct Job {
    tid: TransferId,
    local: Vec<BlockIndex>,
    remote: Vec<BlockIndex>,
}

struct PeerLink {
    jobs: Sender<Job>,
    stream: TcpStream,
    num_blocks: u64,
}

/// The tcp data plane of one node.
pub struct TcpPlane {
    local_id: PeerId,
    local: Arc<Mmap>,
    num_blocks: u64,
    block_len: u64,
    addr: SocketAddr,
    permits: Permits,
    ends: Arc<Mutex<Ends>>,
    registrations: Arc<Mutex<HashMap<PeerId, Registration>>>,
    links: Arc<Mutex<HashMap<PeerId, PeerLink>>>,
    next_tid: TransferId,
    /// Cap on the bytes per second written to each peer (`None`: as fast as the link goes).
    max_write_rate: Option<u64>,
    wake: Wake,
    stop: Arc<AtomicBool>,
    /// Open inbound connections (to shut them down when the plane goes).
    inbound: Inbound,
}

type Inbound = Arc<Mutex<HashMap<u64, TcpStream>>>;

impl std::fmt::Debug for TcpPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpPlane")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpPlane {
    /// A plane for node `local_id` whose pool is the shared-memory object `pool_name`, with its
    /// data listener bound at `listen` (port 0 picks one: see [`TcpPlane::addr`]).
    pub fn new(
        local_id: PeerId,
        pool_name: &str,
        num_blocks: u64,
        block_len: u64,
        listen: &str,
        wake: Wake,
    ) -> Result<Self, TcpError> {
        let local_err = |reason: String| TcpError::Local {
            name: pool_name.to_owned(),
            reason,
        };
        let ro = shm_object::open(pool_name, false).map_err(local_err)?;
        let rw = shm_object::open(pool_name, true).map_err(local_err)?;
        // SAFETY: read-only view of our own pool; a block is only sent while a store job pins
        // it, so its bytes do not change under the send.
        let local = unsafe { Mmap::map(&ro) }.map_err(|e| local_err(e.to_string()))?;
        // SAFETY: our own pool, written only through `PoolWriter::block` (see there).
        let pool = unsafe { MmapMut::map_mut(&rw) }.map_err(|e| local_err(e.to_string()))?;
        crate::prefault::for_read(&local, "the tcp plane's view of the local pool");
        crate::prefault::for_write(&pool, "the tcp plane's receive mapping");
        if (pool.len() as u64) < num_blocks.saturating_mul(block_len) {
            return Err(local_err("the object is smaller than the pool".into()));
        }
        let listener = TcpListener::bind(listen).map_err(|source| TcpError::Listen {
            addr: listen.into(),
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| TcpError::Listen {
            addr: listen.into(),
            source,
        })?;
        let plane = TcpPlane {
            local_id,
            local: Arc::new(local),
            num_blocks,
            block_len,
            addr,
            permits: Arc::default(),
            ends: Arc::default(),
            registrations: Arc::default(),
            links: Arc::default(),
            next_tid: 0,
            max_write_rate: None,
            wake,
            stop: Arc::default(),
            inbound: Arc::default(),
        };
        let pool = Arc::new(PoolWriter {
            map: pool,
            block_len: block_len as usize,
            num_blocks,
        });
        let (permits, stop, inbound) = (
            plane.permits.clone(),
            plane.stop.clone(),
            plane.inbound.clone(),
        );
        std::thread::Builder::new()
            .name("kvpeer-tcp-listen".into())
            .spawn(move || accept_loop(listener, pool, permits, stop, inbound))
            .map_err(|source| TcpError::Listen {
                addr: listen.into(),
                source,
            })?;
        Ok(plane)
    }

    /// Caps the bytes per second written to each peer, so block traffic cannot starve the
    /// engine's own traffic on a shared link. Applies to links opened afterwards.
    pub fn with_max_write_rate(mut self, bytes_per_second: Option<u64>) -> Self {
        self.max_write_rate = bytes_per_second.filter(|r| *r > 0);
        self
    }

    /// Where the data listener is bound (what `agent_metadata` advertises).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Transfers queued or unacknowledged.
    pub fn inflight(&self) -> usize {
        let e = lock(&self.ends);
        e.queued.len() + e.sent.len()
    }

    /// The data connection to `peer` closed. With writes awaiting their ACK that is a fault
    /// (they cannot be confirmed); an idle connection closing is the peer going away, which
    /// the control channel reports (its `disconnect` can arrive after the close), and a later
    /// write to it fails and faults then.
    fn connection_lost(ends: &Mutex<Ends>, peer: &PeerId, wake: &Wake) {
        let unacked = lock(ends).sent.values().any(|p| p == peer);
        if unacked {
            Self::fault(ends, peer, "tcp data connection lost".into(), wake);
        } else {
            tracing::debug!(%peer, "idle tcp data connection closed by the peer");
        }
    }

    fn fault(ends: &Mutex<Ends>, peer: &PeerId, reason: String, wake: &Wake) {
        let mut e = lock(ends);
        e.faults.entry(peer.clone()).or_insert(reason);
        let lost: Vec<TransferId> = e
            .sent
            .iter()
            .filter(|(_, p)| *p == peer)
            .map(|(t, _)| *t)
            .collect();
        for tid in lost {
            e.sent.remove(&tid);
            e.ended.entry(peer.clone()).or_default().failed.push(tid);
        }
        drop(e);
        wake();
    }
}

fn accept_loop(
    listener: TcpListener,
    pool: Arc<PoolWriter>,
    permits: Permits,
    stop: Arc<AtomicBool>,
    inbound: Inbound,
) {
    for (n, conn) in listener.incoming().enumerate() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut stream) = conn else { continue };
        let id = n as u64;
        if let Ok(clone) = stream.try_clone() {
            lock(&inbound).insert(id, clone);
        }
        let (pool, permits, inbound) = (pool.clone(), permits.clone(), inbound.clone());
        let spawned = std::thread::Builder::new()
            .name("kvpeer-tcp-recv".into())
            .spawn(move || {
                if let Err(e) = receive(&mut stream, &pool, &permits) {
                    debug!(error = %e, "tcp data connection ended");
                }
                // Whatever ended it, the writer learns at once (and the socket is released).
                let _ = stream.shutdown(Shutdown::Both);
                lock(&inbound).remove(&id);
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start a tcp receive thread");
        }
    }
}

fn read_array<const N: usize>(s: &mut TcpStream) -> std::io::Result<[u8; N]> {
    let mut b = [0u8; N];
    s.read_exact(&mut b)?;
    Ok(b)
}

fn protocol(msg: String) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, msg)
}

/// One inbound connection: HELLO, then WRITEs until the writer closes or breaks a rule.
fn receive(s: &mut TcpStream, pool: &PoolWriter, permits: &Permits) -> std::io::Result<()> {
    s.set_nodelay(true)?;
    if &read_array::<4>(s)? != HELLO || read_array::<1>(s)?[0] != VERSION {
        return Err(protocol("not a kvpeer tcp data connection".into()));
    }
    let id_len = u16::from_be_bytes(read_array(s)?) as usize;
    let mut id = vec![0u8; id_len];
    s.read_exact(&mut id)?;
    let writer =
        PeerId::new(String::from_utf8(id).map_err(|_| protocol("writer id is not UTF-8".into()))?);
    loop {
        let magic = match read_array::<4>(s) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e),
        };
        if &magic != WRITE {
            return Err(protocol(format!("{writer}: bad frame")));
        }
        let tid = u64::from_be_bytes(read_array(s)?);
        let count = u32::from_be_bytes(read_array(s)?) as u64;
        if count == 0 || count > pool.num_blocks {
            return refuse(s, tid, &writer, format!("{count} blocks in one write"));
        }
        let mut indexes = Vec::with_capacity(count as usize);
        for _ in 0..count {
            indexes.push(u64::from_be_bytes(read_array(s)?));
        }
        // Claim every permit of the frame before reading a byte of it (all or nothing).
        let claimed = {
            let mut p = lock(permits);
            let set = p.get_mut(&writer);
            match set {
                Some(set) if indexes.iter().all(|i| set.contains(i)) && unique(&indexes) => {
                    for i in &indexes {
                        set.remove(i);
                    }
                    true
                }
                _ => false,
            }
        };
        if !claimed {
            return refuse(
                s,
                tid,
                &writer,
                format!("write into blocks {indexes:?} without a permit"),
            );
        }
        for &i in &indexes {
            let Some((ptr, len)) = pool.block_ptr(i) else {
                return refuse(s, tid, &writer, format!("block {i} outside the pool"));
            };
            // SAFETY: `ptr..ptr + len` is one block inside the live mapping (`block_ptr` checked
            // the bounds; `pool` keeps the mapping alive). This frame claimed the block's permit
            // above, removing it from the set, so no other thread writes it; the store does not
            // read it until the load that reserved it ends, after this write is acknowledged.
            let block = unsafe { std::slice::from_raw_parts_mut(ptr, len) };
            s.read_exact(block)?;
        }
        let mut ack = [0u8; 13];
        ack[..4].copy_from_slice(ACK);
        ack[4..12].copy_from_slice(&tid.to_be_bytes());
        s.write_all(&ack)?;
    }
}

fn unique(indexes: &[u64]) -> bool {
    let mut seen = HashSet::with_capacity(indexes.len());
    indexes.iter().all(|i| seen.insert(*i))
}

fn refuse(s: &mut TcpStream, tid: TransferId, writer: &PeerId, why: String) -> std::io::Result<()> {
    warn!(%writer, tid, %why, "refusing a tcp write");
    let mut nack = [0u8; 13];
    nack[..4].copy_from_slice(ACK);
    nack[4..12].copy_from_slice(&tid.to_be_bytes());
    nack[12] = 1;
    let _ = s.write_all(&nack);
    let _ = s.shutdown(Shutdown::Both);
    Err(protocol(why))
}

impl TcpPlane {
    fn start_link(&self, peer: PeerId, addr: String, num_blocks: u64) {
        let (ends, registrations, links, wake) = (
            self.ends.clone(),
            self.registrations.clone(),
            self.links.clone(),
            self.wake.clone(),
        );
        let (local, block_len, me, rate) = (
            self.local.clone(),
            self.block_len as usize,
            self.local_id.clone(),
            self.max_write_rate,
        );
        let spawned = std::thread::Builder::new()
            .name("kvpeer-tcp-dial".into())
            .spawn(move || {
                let result = dial(&addr, &me).and_then(|stream| {
                    let (tx, rx) = channel::<Job>();
                    let writer = stream.try_clone()?;
                    let acks = stream.try_clone()?;
                    lock(&links).insert(
                        peer.clone(),
                        PeerLink {
                            jobs: tx,
                            stream,
                            num_blocks,
                        },
                    );
                    // Writer: frames out, straight from the local mapping.
                    let (e1, w1, p1) = (ends.clone(), wake.clone(), peer.clone());
                    std::thread::Builder::new()
                        .name("kvpeer-tcp-send".into())
                        .spawn(move || {
                            let mut out = writer;
                            let mut pacer = rate.map(Pacer::new);
                            for job in rx {
                                {
                                    // Queued to sent in one step: `inflight` never sees a gap.
                                    let mut e = lock(&e1);
                                    if !e.queued.remove(&job.tid) {
                                        continue; // cancelled before it was sent
                                    }
                                    e.sent.insert(job.tid, p1.clone());
                                }
                                if let Err(e) =
                                    send(&mut out, &job, &local, block_len, pacer.as_mut())
                                {
                                    TcpPlane::fault(&e1, &p1, format!("tcp send failed: {e}"), &w1);
                                    return;
                                }
                            }
                        })?;
                    // Acknowledgements in.
                    let (e2, w2, p2) = (ends.clone(), wake.clone(), peer.clone());
                    std::thread::Builder::new()
                        .name("kvpeer-tcp-ack".into())
                        .spawn(move || {
                            let mut inp = acks;
                            loop {
                                let frame = read_array::<13>(&mut inp);
                                let Ok(frame) = frame.and_then(|f| {
                                    if &f[..4] == ACK {
                                        Ok(f)
                                    } else {
                                        Err(protocol("bad ack".into()))
                                    }
                                }) else {
                                    TcpPlane::connection_lost(&e2, &p2, &w2);
                                    return;
                                };
                                let mut tid = [0u8; 8];
                                tid.copy_from_slice(&frame[4..12]);
                                let tid = u64::from_be_bytes(tid);
                                let mut e = lock(&e2);
                                if e.sent.remove(&tid).is_some() {
                                    let report = e.ended.entry(p2.clone()).or_default();
                                    if frame[12] == 0 {
                                        report.done.push(tid)
                                    } else {
                                        report.failed.push(tid)
                                    }
                                }
                                drop(e);
                                w2();
                            }
                        })?;
                    Ok(())
                });
                let state = match result {
                    Ok(()) => Registration::Done,
                    Err(e) => Registration::Failed(format!(
                        "cannot reach the data listener at {addr}: {e}"
                    )),
                };
                lock(&registrations).insert(peer, state);
                wake();
            });
        if let Err(e) = spawned {
            warn!(error = %e, "cannot start a tcp dial thread");
        }
    }
}

fn dial(addr: &str, me: &PeerId) -> std::io::Result<TcpStream> {
    let target = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| protocol(format!("{addr} resolves to nothing")))?;
    let mut s = TcpStream::connect_timeout(&target, CONNECT_TIMEOUT)?;
    s.set_nodelay(true)?;
    let id = me.as_str().as_bytes();
    let id_len = u16::try_from(id.len()).map_err(|_| protocol("peer id too long".into()))?;
    let mut hello = Vec::with_capacity(7 + id.len());
    hello.extend_from_slice(HELLO);
    hello.push(VERSION);
    hello.extend_from_slice(&id_len.to_be_bytes());
    hello.extend_from_slice(id);
    s.write_all(&hello)?;
    Ok(s)
}

fn send(
    out: &mut TcpStream,
    job: &Job,
    local: &Mmap,
    block_len: usize,
    mut pacer: Option<&mut Pacer>,
) -> std::io::Result<()> {
    let mut header = Vec::with_capacity(16 + 8 * job.remote.len());
    header.extend_from_slice(WRITE);
    header.extend_from_slice(&job.tid.to_be_bytes());
    header.extend_from_slice(&(job.remote.len() as u32).to_be_bytes());
    for r in &job.remote {
        header.extend_from_slice(&r.to_be_bytes());
    }
    out.write_all(&header)?;
    for &l in &job.local {
        let start = l as usize * block_len;
        let block = local
            .get(start..start + block_len)
            .ok_or_else(|| protocol(format!("local block {l} outside the pool")))?;
        out.write_all(block)?;
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

impl DataPlane for TcpPlane {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), String> {
        let meta = AgentMetadata::decode(&memory.agent_metadata).map_err(|e| e.to_string())?;
        let addr = meta.tcp.ok_or("the peer offers no tcp plane")?;
        if memory.block_len != self.block_len {
            return Err(format!(
                "block_len {} is not ours ({})",
                memory.block_len, self.block_len
            ));
        }
        lock(&self.registrations).insert(peer.clone(), Registration::Pending);
        lock(&self.ends).faults.remove(peer);
        self.start_link(peer.clone(), addr, memory.num_blocks);
        Ok(())
    }

    fn registration(&mut self, peer: &PeerId) -> Registration {
        lock(&self.registrations)
            .get(peer)
            .cloned()
            .unwrap_or_else(|| Registration::Failed("not registered".into()))
    }

    fn remove_remote_peer(&mut self, peer: &PeerId) {
        lock(&self.registrations).remove(peer);
        lock(&self.permits).remove(peer);
        if let Some(link) = lock(&self.links).remove(peer) {
            let _ = link.stream.shutdown(Shutdown::Both);
        }
    }

    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId> {
        let links = lock(&self.links);
        let link = links.get(peer)?;
        let ok = !local.is_empty()
            && local.len() == remote.len()
            && local.iter().all(|l| *l < self.num_blocks)
            && remote.iter().all(|r| *r < link.num_blocks);
        if !ok || lock(&self.ends).faults.contains_key(peer) {
            return None;
        }
        self.next_tid += 1;
        let tid = self.next_tid;
        lock(&self.ends).queued.insert(tid);
        if link
            .jobs
            .send(Job {
                tid,
                local: local.to_vec(),
                remote: remote.to_vec(),
            })
            .is_err()
        {
            lock(&self.ends).queued.remove(&tid);
            return None;
        }
        Some(tid)
    }

    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        let mut e = lock(&self.ends);
        let mut poll = e.ended.remove(peer).unwrap_or_default();
        poll.peer_fault = e.faults.get(peer).cloned();
        poll
    }

    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
        let mut e = lock(&self.ends);
        let mut still = Vec::new();
        for &tid in ids {
            if e.queued.remove(&tid) {
                continue; // never sent: released
            }
            if e.sent.contains_key(&tid) {
                match mode {
                    // Sent: its bytes may still land; never reported stopped.
                    CancelMode::Wait => still.push(tid),
                    CancelMode::Immediate => {
                        e.sent.remove(&tid);
                    }
                }
                continue;
            }
            for poll in e.ended.values_mut() {
                poll.done.retain(|t| *t != tid);
                poll.failed.retain(|t| *t != tid);
            }
        }
        still
    }

    fn expect_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        lock(&self.permits)
            .entry(peer.clone())
            .or_default()
            .extend(blocks.iter().copied());
    }

    fn end_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        let mut p = lock(&self.permits);
        if let Some(set) = p.get_mut(peer) {
            for b in blocks {
                set.remove(b);
            }
            if set.is_empty() {
                p.remove(peer);
            }
        }
    }
}

impl Drop for TcpPlane {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the listener out of accept().
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
        for (_, s) in lock(&self.inbound).drain() {
            let _ = s.shutdown(Shutdown::Both);
        }
        for (_, link) in lock(&self.links).drain() {
            let _ = link.stream.shutdown(Shutdown::Both);
        }
    }
}
