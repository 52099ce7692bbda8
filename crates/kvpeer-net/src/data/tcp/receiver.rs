//! The receive side of the tcp plane: the data port's listener, its caps, issued keys, and one
//! reader per inbound connection (HELLO, then WRITEs straight into the pool).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_core::{BlockIndex, TransferId};
use kvpeer_proto::PeerId;
use kvpeer_store::{PoolWriter, WriteClaim};
use subtle::ConstantTimeEq;
use tracing::{debug, warn};

use super::wire::{self, WireError, HELLO_START_LEN, WRITE_HEAD_LEN};
use super::{close, protocol, read_by, Counters, TcpLimits, KEY_LEN};
use crate::lock;

/// How long the listener sleeps after `accept` fails (EMFILE and the like) before trying again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// At most one warning per this long about failing accepts (the rest are counted).
const ACCEPT_LOG_EVERY: Duration = Duration::from_secs(1);

/// A key issued to one writer id by our `connect` to it.
struct Issued {
    key: [u8; KEY_LEN],
    /// Tells this key from earlier ones for the same writer.
    generation: u64,
}

/// An open inbound connection.
struct Conn {
    /// A handle to shut it down from another thread.
    stream: TcpStream,
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
    /// By connection number: the oldest first.
    conns: BTreeMap<u64, Conn>,
    next_conn: u64,
    next_generation: u64,
}

/// What `Gate::admit` decided.
enum Admit {
    /// Admitted as connection `id`, after closing `evicted` connections still in their HELLO.
    Yes { id: u64, evicted: usize },
    /// The cap is full of connections past their HELLO.
    Full,
}

impl Gate {
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

    /// Closes every inbound connection (the plane is going).
    pub(super) fn close_all(&mut self) {
        for (_, c) in std::mem::take(&mut self.conns) {
            close(&c.stream);
        }
    }

    /// Closes the connections authenticated as `writer` with a key other than its current one.
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
                close(&c.stream);
            }
        }
        stale.len()
    }

    /// Takes a new connection (`stream` is a handle to it) within `limits`: over either cap the
    /// oldest connection still in its HELLO is closed to make room; if every open connection
    /// is past its HELLO and the total cap is reached, the new one is refused.
    fn admit(&mut self, stream: TcpStream, limits: &TcpLimits) -> Admit {
        let mut evicted = 0;
        loop {
            let (authenticated, handshaking) = self.counts();
            let total = authenticated + handshaking;
            if total < limits.max_connections.max(1) && handshaking < limits.max_handshaking.max(1)
            {
                break;
            }
            let oldest = self
                .conns
                .iter()
                .find(|(_, c)| c.writer.is_none())
                .map(|(id, _)| *id);
            match oldest.and_then(|id| self.conns.remove(&id)) {
                Some(c) => {
                    close(&c.stream);
                    evicted += 1;
                }
                None => return Admit::Full,
            }
        }
        self.next_conn += 1;
        let id = self.next_conn;
        self.conns.insert(
            id,
            Conn {
                stream,
                writer: None,
                claimed: Vec::new(),
            },
        );
        Admit::Yes { id, evicted }
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
        let conn = self.conns.get_mut(&id)?; // closed meanwhile (evicted, plane going)
        conn.writer = Some((writer.clone(), generation));
        let older: Vec<u64> = self
            .conns
            .iter()
            .filter(|(other, c)| **other != id && matches!(&c.writer, Some((w, _)) if w == writer))
            .map(|(other, _)| *other)
            .collect();
        for other in &older {
            if let Some(c) = self.conns.remove(other) {
                close(&c.stream);
            }
        }
        Some(older.len())
    }

    /// The load that gave `writer` the permits for `blocks` ended: a connection of that writer
    /// still reading a WRITE into any of them is closed (its reader stops at its next read,
    /// the WRITE is never acknowledged). Returns how many were closed.
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
                close(&c.stream);
            }
        }
        cut.len()
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

    fn forget(&mut self, id: u64) {
        self.conns.remove(&id);
    }
}

/// The listener's shared state.
pub(super) struct Accept {
    /// The pool's permit table: the only way to write the pool.
    pub(super) pool: PoolWriter,
    pub(super) gate: Arc<Mutex<Gate>>,
    pub(super) limits: Arc<Mutex<TcpLimits>>,
    pub(super) counters: Arc<Counters>,
    pub(super) stop: Arc<AtomicBool>,
}

impl Accept {
    /// Accepts until the plane stops. A failing `accept` (out of descriptors: EMFILE, ENFILE)
    /// backs off instead of spinning, and is logged at most once a second.
    ///
    /// The listener waits for a pending connection with `poll` and only then calls a
    /// non-blocking `accept`: a blocking `accept` reserves its descriptor before it sleeps, so
    /// it would hold one slot through a shortage and hide it (the connection it then takes is
    /// the only one ever served, and nothing backs off).
    pub(super) fn run(self, listener: TcpListener) {
        if let Err(e) = listener.set_nonblocking(true) {
            warn!(error = %e, "cannot make the tcp data listener non-blocking; not accepting");
            return;
        }
        let mut last_log: Option<Instant> = None;
        let mut unlogged = 0u64;
        loop {
            if self.stop.load(Ordering::SeqCst) {
                return;
            }
            if let Err(e) = wait_readable(&listener) {
                if e != nix::errno::Errno::EINTR {
                    if let Some(suppressed) =
                        crate::admit_warning("cannot wait on the tcp data listener; backing off")
                    {
                        warn!(error = %e, suppressed, "cannot wait on the tcp data listener; backing off");
                    }
                    std::thread::sleep(ACCEPT_BACKOFF);
                }
                continue;
            }
            match listener.accept() {
                Ok((stream, _)) => {
                    if self.stop.load(Ordering::SeqCst) {
                        return;
                    }
                    // Accepted sockets do not inherit O_NONBLOCK on Linux; made sure of here
                    // because every read below relies on blocking reads with timeouts.
                    if let Err(e) = stream.set_nonblocking(false) {
                        debug!(error = %e, "cannot make a tcp data connection blocking");
                        close(&stream);
                        continue;
                    }
                    self.admit(stream);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::Interrupted
                            | std::io::ErrorKind::ConnectionAborted
                            | std::io::ErrorKind::WouldBlock
                    ) => {}
                Err(e) => {
                    Counters::bump(&self.counters.accept_errors);
                    if last_log.is_none_or(|t| t.elapsed() >= ACCEPT_LOG_EVERY) {
                        warn!(error = %e, unlogged, "cannot accept tcp data connections; backing off");
                        last_log = Some(Instant::now());
                        unlogged = 0;
                    } else {
                        unlogged += 1;
                    }
                    std::thread::sleep(ACCEPT_BACKOFF);
                }
            }
        }
    }

    fn admit(&self, stream: TcpStream) {
        let accepted = Instant::now();
        let limits = lock(&self.limits).clone();
        let handle = match stream.try_clone() {
            Ok(h) => h,
            Err(e) => {
                // Out of descriptors: this connection cannot be tracked, so it is not served.
                Counters::bump(&self.counters.accept_errors);
                debug!(error = %e, "cannot track a tcp data connection; closing it");
                close(&stream);
                return;
            }
        };
        let admitted = lock(&self.gate).admit(handle, &limits);
        let id = match admitted {
            Admit::Yes { id, evicted } => {
                for _ in 0..evicted {
                    Counters::bump(&self.counters.evicted_handshaking);
                }
                id
            }
            Admit::Full => {
                Counters::bump(&self.counters.refused_over_cap);
                debug!("tcp data port full; closing a new connection");
                close(&stream);
                return;
            }
        };
        let (pool, gate, counters) = (self.pool.clone(), self.gate.clone(), self.counters.clone());
        let spawned = std::thread::Builder::new()
            .name("kvpeer-tcp-recv".into())
            .spawn(move || {
                let mut stream = stream;
                let mut conn = Connection {
                    id,
                    s: &mut stream,
                    pool: &pool,
                    gate: &gate,
                    limits: &limits,
                    counters: &counters,
                };
                if let Err(e) = conn.receive(accepted) {
                    debug!(error = %e, "tcp data connection ended");
                }
                // Whatever ended it, the writer learns at once (and the socket is released).
                close(&stream);
                lock(&gate).forget(id);
            });
        if let Err(e) = spawned {
            if let Some(suppressed) = crate::admit_warning("cannot start a tcp receive thread") {
                warn!(error = %e, suppressed, "cannot start a tcp receive thread");
            }
            if let Some(c) = lock(&self.gate).conns.remove(&id) {
                close(&c.stream);
            }
        }
    }
}

/// One inbound connection's reader.
struct Connection<'a> {
    id: u64,
    s: &'a mut TcpStream,
    pool: &'a PoolWriter,
    gate: &'a Mutex<Gate>,
    limits: &'a TcpLimits,
    counters: &'a Counters,
}

impl Connection<'_> {
    /// HELLO, then WRITEs until the writer closes, breaks a rule, stalls, or idles out.
    fn receive(&mut self, accepted: Instant) -> std::io::Result<()> {
        self.s.set_nodelay(true)?;
        // An ACK must not block forever on a writer that never reads.
        self.s.set_write_timeout(Some(self.limits.frame_timeout))?;
        let writer = self.hello(accepted + self.limits.hello_timeout)?;
        let mut idle_since = Instant::now();
        loop {
            let mut magic = [0u8; 4];
            // Between frames the writer may idle up to `idle_timeout`; once a frame's first
            // byte is in, the rest runs on the frame clock.
            match read_by(
                self.s,
                &mut magic[..1],
                idle_since + self.limits.idle_timeout,
            ) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
                Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {
                    Counters::bump(&self.counters.idle_closes);
                    debug!(%writer, "closing an idle tcp data connection");
                    return Ok(());
                }
                Err(e) => return Err(e),
            }
            let deadline = Instant::now() + self.limits.frame_timeout;
            self.frame_part(&mut magic[1..], deadline)?;
            wire::check_write_magic(&magic).map_err(|e| protocol(format!("{writer}: {e}")))?;
            let mut head = [0u8; WRITE_HEAD_LEN];
            self.frame_part(&mut head, deadline)?;
            let (tid, count) = match wire::decode_write_head(&head, self.pool.num_blocks()) {
                Ok(head) => head,
                Err(WireError::BadCount { tid, count }) => {
                    return Err(self.refuse(tid, &writer, format!("{count} blocks in one write")))
                }
                Err(e) => return Err(protocol(format!("{writer}: {e}"))),
            };
            let mut raw = vec![0u8; count * 8];
            self.frame_part(&mut raw, deadline)?;
            let indexes =
                wire::decode_indexes(&raw).map_err(|e| protocol(format!("{writer}: {e}")))?;
            let mut claim = self.claim(tid, &writer, &indexes)?;
            for nth in 0..indexes.len() {
                // The claim holds exactly `indexes`, in order, so every `nth` is there.
                let Some(block) = claim.block_mut(nth) else {
                    return Err(self.refuse(tid, &writer, format!("no block {nth} in a claim")));
                };
                // Each block on its own clock: a large WRITE under the writer's rate cap may
                // take longer than `frame_timeout` as a whole, but never stalls that long.
                self.frame_part(block, Instant::now() + self.limits.frame_timeout)?;
            }
            // Every byte is in: the write is over before the writer hears of it (and before the
            // load can end, which closes connections still writing its blocks).
            drop(claim);
            lock(self.gate).set_claimed(self.id, &[]);
            self.s.write_all(&wire::encode_ack(tid, true))?;
            idle_since = Instant::now();
        }
    }

    /// Reads and checks the HELLO (by `deadline`); anything but a current key for the named
    /// writer closes the connection without reading further.
    fn hello(&mut self, deadline: Instant) -> std::io::Result<PeerId> {
        // Magic and version first, then the id's length, then id and key: junk is refused
        // before the next part is waited for.
        let mut start = [0u8; HELLO_START_LEN];
        self.hello_part(&mut start, deadline)?;
        wire::check_hello_start(&start).map_err(|e| self.refuse_hello(e.to_string()))?;
        let mut id_len = [0u8; 2];
        self.hello_part(&mut id_len, deadline)?;
        let id_len = wire::hello_id_len(id_len).map_err(|e| self.refuse_hello(e.to_string()))?;
        let mut rest = vec![0u8; id_len + KEY_LEN];
        self.hello_part(&mut rest, deadline)?;
        let hello =
            wire::hello_body(id_len, &rest).map_err(|e| self.refuse_hello(e.to_string()))?;
        let (writer, key) = (PeerId::new(hello.writer), hello.key);
        let authenticated = lock(self.gate).authenticate(self.id, &writer, &key);
        match authenticated {
            Some(replaced) => {
                debug!(%writer, replaced, "tcp data connection authenticated");
                Ok(writer)
            }
            None => Err(self.refuse_hello(format!("{writer}: no such key issued"))),
        }
    }

    fn refuse_hello(&self, why: String) -> std::io::Error {
        Counters::bump(&self.counters.refused_hellos);
        if let Some(suppressed) = crate::admit_warning("refusing a tcp data connection") {
            warn!(%why, peer = ?self.s.peer_addr().ok(), suppressed, "refusing a tcp data connection");
        }
        protocol(why)
    }

    fn hello_part(&mut self, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
        read_by(self.s, buf, deadline).inspect_err(|e| {
            if e.kind() == std::io::ErrorKind::TimedOut {
                Counters::bump(&self.counters.hello_timeouts);
            }
        })
    }

    fn frame_part(&mut self, buf: &mut [u8], deadline: Instant) -> std::io::Result<()> {
        read_by(self.s, buf, deadline).inspect_err(|e| {
            if e.kind() == std::io::ErrorKind::TimedOut {
                Counters::bump(&self.counters.frame_timeouts);
            }
        })
    }

    /// Claims every permit of the frame before reading a byte of it (all or nothing: each
    /// block inside the pool, named once, permitted to this writer), and only while the key
    /// this connection presented is still current. The claim is the only way to write the
    /// blocks.
    fn claim(
        &mut self,
        tid: TransferId,
        writer: &PeerId,
        indexes: &[BlockIndex],
    ) -> std::io::Result<WriteClaim> {
        let claimed = {
            let mut gate = lock(self.gate);
            if !gate.is_current(self.id) {
                return Err(protocol(format!("{writer}: its key was withdrawn")));
            }
            let claimed = self.pool.claim(writer, indexes);
            if claimed.is_ok() {
                gate.set_claimed(self.id, indexes);
            }
            claimed
        };
        claimed.map_err(|e| self.refuse(tid, writer, e.to_string()))
    }

    /// Refuses transfer `tid` (ACK 1) and closes the connection; the error ends the reader.
    fn refuse(&mut self, tid: TransferId, writer: &PeerId, why: String) -> std::io::Error {
        if let Some(suppressed) = crate::admit_warning("refusing a tcp write") {
            warn!(%writer, tid = tid.get(), %why, suppressed, "refusing a tcp write");
        }
        let _ = self.s.write_all(&wire::encode_ack(tid, false));
        close(self.s);
        protocol(why)
    }
}

/// Blocks until `listener` has a connection to accept (or an error), without reserving a
/// descriptor the way a blocking `accept` does.
fn wait_readable(listener: &TcpListener) -> nix::Result<()> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(listener.as_fd(), PollFlags::POLLIN)];
    poll(&mut fds, PollTimeout::NONE).map(|_| ())
}
