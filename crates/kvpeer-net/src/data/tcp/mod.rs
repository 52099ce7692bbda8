//! The `tcp` data plane: peers on any host. The writer streams blocks to the peer's data
//! listener; the receiver reads them straight into its pool and acknowledges; the transfer is
//! done when the acknowledgement arrives.
//!
//! Byte format (all integers big-endian; docs/data-planes.md has the full description; encoded
//! and decoded in `wire.rs`):
//!
//! ```text
//! HELLO  writer → receiver, once per connection:
//!        "KVPH" | version u8 = 2 | id_len u16 | writer peer id (UTF-8) | key (32 bytes)
//! WRITE  writer → receiver:        "KVPW" | transfer id u64 | count u32 | count × block index u64
//!                                  | count × block_len bytes, in index order
//! ACK    receiver → writer:        "KVPA" | transfer id u64 | status u8 (0 written, 1 refused)
//! ```
//!
//! **Keys** (who may open a data connection as writer W). Just before this node's `connect` to
//! peer W leaves, [`DataPlane::connect_metadata`] draws 32 random bytes, remembers them as the
//! key issued to W (replacing any earlier one: a new `connect` is a new session) and puts them
//! in that `connect`'s `agent_metadata` as `tcp_key`. W's writer sends the key in its HELLO; the
//! receiver accepts a HELLO only if it names a writer id with an issued key and carries exactly
//! that key (compared in constant time). Anything else (wrong or missing key, version 1, junk)
//! is closed at once without reading further, and counted ([`TcpCounters::refused_hellos`]).
//! An accepted connection writes only with W's permits, and only while its key is current:
//! when the key is replaced or withdrawn, the connections that presented it are closed.
//!
//! **Key lifetime rule.** A key lives from the `connect` that issued it to the end of that
//! session: `connect_metadata` issues (replacing an earlier key for the same peer and closing
//! what used it), `remove_remote_peer` (the core calls it once, when the session ends)
//! withdraws it and closes the connections that presented it. `add_remote_peer` never touches
//! issued keys (they are about writes *into* us); the combined plane resets only its route and
//! shm side when a peer's `connect` arrives, so neither the key nor the permits of a session
//! are dropped mid-handshake.
//!
//! **Write permits**: the receiver accepts a WRITE only if every index is inside its pool and
//! is a block it has an outstanding fetch for from that writer ([`DataPlane::expect_writes`]).
//! It claims those permits before reading a single block byte, so no other connection can write
//! the same blocks; anything else is refused (ACK 1) and the connection closed, which faults the
//! writer. A refused write never touches the pool.
//!
//! **Limits** ([`TcpLimits`]): connections at once (those still in their HELLO are capped
//! separately, and the oldest of them makes room for a new one, so junk cannot lock out a
//! session's writer), a HELLO deadline, a deadline for each part of a started WRITE, and an
//! idle timeout. A writer whose idle connection was closed reconnects (same key) before its
//! next WRITE; a connection that closes with WRITEs awaiting their ACK faults the peer.
//!
//! **Transfer deadlines** (send side): a WRITE must be acknowledged within
//! `transfer_timeout + bytes / min_write_rate` of its first byte leaving (the rate never above
//! this node's own `max_write_rate`; a WRITE pipelined behind others also gets their time).
//! Past it the peer is faulted (its transfers fail, so their pins are released, and the
//! session winds down) and its data connection is reset, so a consumer that reads a trickle,
//! or never ACKs, holds neither pins nor writer for long.
//!
//! **Connections**: a writer dials the peer's data port at its first WRITE (registration only
//! checks the address and key) and closes the connection once idle for `idle_timeout / 2`, so
//! an idle session holds no data connection on either side.
//!
//! Threads: two per plane, whatever the number of peers: the receiver (`receiver.rs`: the
//! listener and every inbound connection over one epoll set) and the sender (`sender.rs`: every
//! peer's link, its connection, WRITEs and ACKs, and the transfer deadlines, over another). The
//! core's thread only queues and polls; `wake` runs after each completion. One user-space copy per side: the
//! writer sends straight from the pool (a [`PoolView`](kvpeer_store::PoolView)), the receiver reads straight into it,
//! each block through a [`kvpeer_store::WriteClaim`] taken from the pool's permit table
//! ([`PoolWriter`]). The plane never maps the pool itself, so it works the same on a shm pool
//! and on an engine's own memory ([`kvpeer_store::Pool::external`]).

mod acks;
mod error;
mod receiver;
mod sender;
mod wire;

pub use error::{TcpFault, TcpRefusal};

/// Entry points for the fuzz targets in `fuzz/` (the frame codec is private to the plane).
#[doc(hidden)]
pub mod fuzzing {
    /// Every tcp-plane frame decoder over `data`, and the re-encoding of what decodes; panics
    /// where a check fails.
    pub fn frames(data: &[u8]) {
        super::wire::fuzz_frames(data);
    }
}

use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpeer_core::{
    BlockIndex, CancelMode, DataPlane, PlaneError, PlanePoll, Registration, RemoteMemory,
    TransferId, WriteEnd,
};
use kvpeer_proto::{is_peer_ip, PeerAddr, PeerId};
use kvpeer_store::PoolWriter;
use tracing::{debug, warn};

use crate::data::metadata::AgentMetadata;
use crate::data::shm::Wake;
use crate::lock;
use crate::tls::{Tls, TlsPolicy};
use receiver::{Gate, ReceiverHandle};
use sender::{Cmd, Job, SenderHandle, Writer};

/// Bytes of a HELLO key.
pub const KEY_LEN: usize = 32;

/// The plane's TLS policy and material, set once by [`TcpPlane::with_tls`] and read by the
/// sender and receiver threads each time they open or accept a connection.
#[derive(Clone, Default)]
pub(super) struct TlsSlot(Arc<Mutex<Option<(TlsPolicy, Tls)>>>);

impl TlsSlot {
    /// The policy (`Off` without TLS material).
    fn policy(&self) -> TlsPolicy {
        lock(&self.0).as_ref().map_or(TlsPolicy::Off, |(p, _)| *p)
    }

    /// The TLS material, where the policy uses it.
    fn on(&self) -> Option<Tls> {
        match lock(&self.0).as_ref() {
            Some((policy, tls)) if *policy != TlsPolicy::Off => Some(tls.clone()),
            _ => None,
        }
    }

    /// A writer's configuration, where TLS is on.
    fn client(&self) -> Option<Arc<rustls::ClientConfig>> {
        self.on().map(|tls| tls.client())
    }

    /// The listener's configuration, where TLS is on.
    fn server(&self) -> Option<Arc<rustls::ServerConfig>> {
        self.on().map(|tls| tls.server())
    }
}

/// Longest a writer's socket write may make no progress: a receiver that stops reading faults
/// instead of stalling the writer (and the pins its transfers hold) for good.
const WRITE_STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the plane could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TcpError {
    /// The data listener could not be bound or started.
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        /// The address.
        addr: String,
        /// The system's error.
        source: std::io::Error,
    },
}

/// Caps and deadlines of the data port (receive side), and of this node's writes (send side:
/// `idle_timeout`, `min_write_rate`, `transfer_timeout`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpLimits {
    /// Inbound connections open at once. Over it a new connection takes the place of the
    /// oldest one still in its HELLO, or, if all are past their HELLO, is closed at once.
    pub max_connections: usize,
    /// Of those, connections that have not completed their HELLO. Over it the oldest of them
    /// is closed to make room, so idle junk cannot keep a session's writer out.
    pub max_handshaking: usize,
    /// A HELLO must be complete this long after the connection is accepted.
    pub hello_timeout: Duration,
    /// Once a WRITE has started, its header (with the block indexes) must arrive within this
    /// long of its first byte, and each of its blocks within this long of the part before it.
    pub frame_timeout: Duration,
    /// A connection with no frame started for this long is closed. A writer whose connection
    /// has been idle for half this long opens a fresh one before its next WRITE.
    pub idle_timeout: Duration,
    /// Send side: the slowest a peer may take this node's WRITEs, in bytes per second (0 is
    /// taken as 1). With `transfer_timeout` it sets each transfer's deadline.
    pub min_write_rate: u64,
    /// Send side: a WRITE of `n` bytes must be acknowledged within
    /// `transfer_timeout + n / min_write_rate` of its first byte being sent, or the peer is
    /// faulted and its data connection reset.
    pub transfer_timeout: Duration,
}

impl Default for TcpLimits {
    fn default() -> Self {
        TcpLimits {
            max_connections: 256,
            max_handshaking: 64,
            hello_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            min_write_rate: 1_000_000,
            transfer_timeout: Duration::from_secs(30),
        }
    }
}

/// What the data port refused or closed, and how often the writer reconnected (for tests and
/// metrics). Monotonic since the plane started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TcpCounters {
    /// HELLOs refused: bad magic or version, bad id, no key issued to that writer, wrong key.
    pub refused_hellos: u64,
    /// Connections closed at once because the connection cap was full of authenticated ones.
    pub refused_over_cap: u64,
    /// Connections still in their HELLO closed to make room for a new one.
    pub evicted_handshaking: u64,
    /// Connections closed because their HELLO did not complete in time.
    pub hello_timeouts: u64,
    /// Connections closed because a started WRITE stalled.
    pub frame_timeouts: u64,
    /// Connections closed after `idle_timeout` without a frame.
    pub idle_closes: u64,
    /// Connections closed because the key they presented was replaced or withdrawn.
    pub key_closes: u64,
    /// `accept` failures (EMFILE and the like).
    pub accept_errors: u64,
    /// Times a writer opened a fresh connection after its idle one closed.
    pub reconnects: u64,
    /// Inbound connections closed because the load their WRITE was landing in ended.
    pub load_closes: u64,
    /// Transfers this node wrote that were not acknowledged by their deadline (each faulted
    /// its peer and reset its data connection).
    pub transfer_timeouts: u64,
    /// Received WRITEs with a block that did not match the digest its writer sent
    /// (`tcp_block_digests`): corrupted in transit, or by the writer. Each failed its
    /// transfer (ACK status 2); the connection went on.
    pub digest_mismatches: u64,
    /// WRITEs this node sent that the receiver found corrupted (ACK status 2): each failed.
    pub corrupted_writes: u64,
    /// Plain WRITEs (no digests) refused because this node asks for digests.
    pub writes_without_digests: u64,
}

#[derive(Default)]
struct Counters {
    refused_hellos: AtomicU64,
    refused_over_cap: AtomicU64,
    evicted_handshaking: AtomicU64,
    hello_timeouts: AtomicU64,
    frame_timeouts: AtomicU64,
    idle_closes: AtomicU64,
    key_closes: AtomicU64,
    accept_errors: AtomicU64,
    reconnects: AtomicU64,
    transfer_timeouts: AtomicU64,
    load_closes: AtomicU64,
    digest_mismatches: AtomicU64,
    corrupted_writes: AtomicU64,
    writes_without_digests: AtomicU64,
}

impl Counters {
    fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn snapshot(&self) -> TcpCounters {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TcpCounters {
            refused_hellos: get(&self.refused_hellos),
            refused_over_cap: get(&self.refused_over_cap),
            evicted_handshaking: get(&self.evicted_handshaking),
            hello_timeouts: get(&self.hello_timeouts),
            frame_timeouts: get(&self.frame_timeouts),
            idle_closes: get(&self.idle_closes),
            key_closes: get(&self.key_closes),
            accept_errors: get(&self.accept_errors),
            reconnects: get(&self.reconnects),
            transfer_timeouts: get(&self.transfer_timeouts),
            load_closes: get(&self.load_closes),
            digest_mismatches: get(&self.digest_mismatches),
            corrupted_writes: get(&self.corrupted_writes),
            writes_without_digests: get(&self.writes_without_digests),
        }
    }
}

#[derive(Default)]
struct Ends {
    /// Ended transfers not yet polled, per peer.
    ended: HashMap<PeerId, PlanePoll>,
    /// Transfers written but not acknowledged.
    sent: HashMap<TransferId, Sent>,
    /// Transfers queued to a writer, not yet sent: tid → peer.
    queued: HashMap<TransferId, PeerId>,
    faults: HashMap<PeerId, TcpFault>,
    /// Per peer, its writer's current connection: (its number, still open).
    conns: HashMap<PeerId, (u64, bool)>,
}

/// A transfer written (or being written) and not yet acknowledged.
#[derive(Debug, Clone)]
struct Sent {
    peer: PeerId,
    /// The connection it went out on.
    conn: u64,
    /// Its ACK must arrive by then.
    deadline: Instant,
    /// When its first byte was sent, and its bytes (for the log line of a late one).
    started: Instant,
    bytes: u64,
}

/// The tcp data plane of one node.
pub struct TcpPlane {
    /// The pool's permit table, and the receive side's only way to write it.
    pool: PoolWriter,
    num_blocks: u64,
    block_len: u64,
    addr: SocketAddr,
    ends: Arc<Mutex<Ends>>,
    registrations: Arc<Mutex<HashMap<PeerId, Registration>>>,
    /// The peers with a link, and their pools' blocks.
    linked: Arc<Mutex<HashMap<PeerId, u64>>>,
    next_tid: TransferId,
    /// Cap on the bytes per second written to each peer (`None`: as fast as the link goes).
    max_write_rate: Option<u64>,
    /// Peers writing to us are asked for a digest per block, checked before a write counts
    /// (shared with the receiver thread, which then refuses WRITEs without them).
    digests: Arc<AtomicBool>,
    limits: Arc<Mutex<TcpLimits>>,
    counters: Arc<Counters>,
    wake: Wake,
    /// Issued keys and open inbound connections.
    gate: Arc<Mutex<Gate>>,
    /// TLS: the policy and material both threads use.
    tls: TlsSlot,
    sender: SenderHandle,
    /// Stops the receiver thread when dropped (after the sender: the field order).
    _receiver: ReceiverHandle,
}

impl std::fmt::Debug for TcpPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpPlane")
            .field("addr", &self.addr)
            .finish()
    }
}

impl TcpPlane {
    /// A plane for node `local_id` over the pool `pool` writes into (a shm object or external
    /// memory: only its addresses matter), with its data listener bound at `listen` (port 0
    /// picks one: see [`TcpPlane::addr`]).
    pub fn new(
        local_id: PeerId,
        pool: PoolWriter,
        listen: &str,
        wake: Wake,
    ) -> Result<Self, TcpError> {
        let local = pool.view();
        let (num_blocks, block_len) = (local.num_blocks(), local.block_len());
        let listen_err = |source| TcpError::Listen {
            addr: listen.into(),
            source,
        };
        let listener = TcpListener::bind(listen).map_err(listen_err)?;
        let addr = listener.local_addr().map_err(listen_err)?;
        let ends: Arc<Mutex<Ends>> = Arc::default();
        let limits: Arc<Mutex<TcpLimits>> = Arc::default();
        let counters: Arc<Counters> = Arc::default();
        let gate: Arc<Mutex<Gate>> = Arc::default();
        let linked: Arc<Mutex<HashMap<PeerId, u64>>> = Arc::default();
        let tls = TlsSlot::default();
        let digests: Arc<AtomicBool> = Arc::default();
        let receiver = receiver::start(
            listener,
            receiver::Shared {
                pool: pool.clone(),
                gate: gate.clone(),
                limits: limits.clone(),
                counters: counters.clone(),
                tls: tls.clone(),
                digests: digests.clone(),
            },
        )
        .map_err(listen_err)?;
        let sender = sender::start(sender::Shared {
            me: local_id,
            local,
            block_len: block_len as usize,
            ends: ends.clone(),
            counters: counters.clone(),
            wake: wake.clone(),
            linked: linked.clone(),
            tls: tls.clone(),
        })
        .map_err(listen_err)?;
        Ok(TcpPlane {
            pool,
            num_blocks,
            block_len,
            addr,
            ends,
            registrations: Arc::default(),
            linked,
            next_tid: TransferId::new(0),
            max_write_rate: None,
            digests,
            limits,
            counters,
            wake,
            gate,
            tls,
            sender,
            _receiver: receiver,
        })
    }

    /// Uses TLS 1.3 with mutual authentication per `policy` (module `crate::tls`): with
    /// `Preferred` or `Required` the listener takes TLS connections and `connect` says so
    /// (`tcp_tls`), and this node's writes to a peer that offers TLS use it; `Required` also
    /// refuses plaintext connections and peers that offer no TLS. Applies to connections opened
    /// afterwards.
    pub fn with_tls(self, policy: TlsPolicy, tls: Tls) -> Self {
        *lock(&self.tls.0) = Some((policy, tls));
        self
    }

    /// The TLS policy in force.
    pub fn tls_policy(&self) -> TlsPolicy {
        self.tls.policy()
    }

    /// Caps the bytes per second written to each peer, so block traffic cannot starve the
    /// engine's own traffic on a shared link. Applies to links opened afterwards.
    pub fn with_max_write_rate(mut self, bytes_per_second: Option<u64>) -> Self {
        self.max_write_rate = bytes_per_second.filter(|r| *r > 0);
        self
    }

    /// Asks every peer that writes to us for a CRC-32C of each block it sends (over the block's
    /// index and bytes), checked as the block lands: a block that does not match fails its
    /// transfer (ACK status 2; the connection and the peer go on), so the load fails and the
    /// engine recomputes (a corruption in transit is a miss, never wrong KV). Said in the
    /// `agent_metadata` of the `connect`s sent from now on (`tcp_digests`). A WRITE without
    /// digests is refused from then on: a writer that does not know them cannot write to us.
    /// TLS's AEAD already covers transit where TLS is on.
    pub fn with_block_digests(self, on: bool) -> Self {
        self.digests.store(on, Ordering::Relaxed);
        self
    }

    /// Sets the data port's caps and deadlines (defaults: [`TcpLimits::default`]). Applies to
    /// connections accepted and links opened afterwards.
    pub fn with_limits(self, limits: TcpLimits) -> Self {
        *lock(&self.limits) = limits;
        self
    }

    /// Where the data listener is bound (what `agent_metadata` advertises).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The data address a peer's `agent_metadata` names (its `tcp` entry), if any.
    pub fn peer_data_addr(memory: &RemoteMemory) -> Option<String> {
        AgentMetadata::decode(&memory.agent_metadata).ok()?.tcp
    }

    /// Transfers queued or unacknowledged.
    pub fn inflight(&self) -> usize {
        let e = lock(&self.ends);
        e.queued.len() + e.sent.len()
    }

    /// What the data port refused or closed so far.
    pub fn counters(&self) -> TcpCounters {
        self.counters.snapshot()
    }

    /// Inbound connections open now: (past their HELLO, still in it).
    pub fn inbound_connections(&self) -> (usize, usize) {
        lock(&self.gate).counts()
    }

    /// Drops the outbound link to `peer` (its connection closes; WRITEs awaiting their ACK
    /// fail).
    fn drop_link(&mut self, peer: &PeerId) {
        lock(&self.linked).remove(peer);
        self.sender.send(Cmd::Unlink {
            peer: peer.clone(),
            abort: false,
        });
    }

    /// Links `peer`'s data listener at `addr` (`host:port`) with `key`: done at once for an IP
    /// address (the connection is made at the first write); a host name is resolved first on
    /// a short-lived thread, and the registration waits for it.
    fn start_link(
        &mut self,
        peer: PeerId,
        addr: String,
        key: [u8; KEY_LEN],
        num_blocks: u64,
        tls: Option<std::net::IpAddr>,
        digests: bool,
    ) {
        let limits = lock(&self.limits).clone();
        let writer = Writer {
            digests,
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
        // Read once as an address, whatever its spelling (the node checked this very value:
        // `0:P` or `2130706433:P` is the address it is, never a name for a resolver), and
        // never one no peer can have (`0.0.0.0` is this host to `connect(2)`).
        let parsed = PeerAddr::parse(&addr);
        if let Ok(a) = &parsed {
            if !a.is_peer_address() {
                lock(&self.registrations).insert(
                    peer,
                    Registration::Failed(PlaneError::transport(TcpRefusal::NotAPeerAddress(addr))),
                );
                return;
            }
        }
        let literal = parsed.ok().and_then(|a| a.socket_addr());
        if let Some(socket) = literal {
            lock(&self.linked).insert(peer.clone(), num_blocks);
            self.sender.send(Cmd::Link {
                peer: peer.clone(),
                addr: socket,
                key,
                writer,
                tls,
            });
            lock(&self.registrations).insert(peer, Registration::Done);
            return;
        }
        lock(&self.registrations).insert(peer.clone(), Registration::Pending);
        let (registrations, linked, wake) = (
            self.registrations.clone(),
            self.linked.clone(),
            self.wake.clone(),
        );
        let sender = self.sender.queue();
        let who = peer.clone();
        let spawned = std::thread::Builder::new()
            .name("kvpeer-tcp-resolve".into())
            .spawn(move || {
                let found = addr
                    .to_socket_addrs()
                    .ok()
                    .and_then(|mut a| a.find(|a| is_peer_ip(a.ip())));
                let mut regs = lock(&registrations);
                // Removed or registered again meanwhile: this one is moot.
                if regs.get(&peer) != Some(&Registration::Pending) {
                    return;
                }
                let state = match found {
                    Some(socket) => {
                        lock(&linked).insert(peer.clone(), num_blocks);
                        sender.send(Cmd::Link {
                            peer: peer.clone(),
                            addr: socket,
                            key,
                            writer,
                            tls,
                        });
                        Registration::Done
                    }
                    None => {
                        Registration::Failed(PlaneError::transport(TcpRefusal::Unresolved(addr)))
                    }
                };
                regs.insert(peer, state);
                drop(regs);
                wake();
            });
        if let Err(e) = spawned {
            lock(&self.registrations).insert(
                who,
                Registration::Failed(PlaneError::resources(TcpRefusal::NoResolver(e.kind()))),
            );
        }
    }

    /// A fault of `peer`'s data connection: its unacknowledged and queued transfers fail, and
    /// the core winds the session down.
    fn fault(ends: &Mutex<Ends>, peer: &PeerId, reason: TcpFault, wake: &Wake) {
        let mut e = lock(ends);
        e.faults.entry(peer.clone()).or_insert(reason);
        let mut lost: Vec<TransferId> = e
            .sent
            .iter()
            .filter(|(_, s)| s.peer == *peer)
            .map(|(t, _)| *t)
            .collect();
        for tid in &lost {
            e.sent.remove(tid);
        }
        // Never sent, so they cannot land: released as failed.
        let unsent: Vec<TransferId> = e
            .queued
            .iter()
            .filter(|(_, p)| *p == peer)
            .map(|(t, _)| *t)
            .collect();
        for tid in &unsent {
            e.queued.remove(tid);
        }
        lost.extend(unsent);
        if !lost.is_empty() {
            e.ended.entry(peer.clone()).or_default().failed.extend(lost);
        }
        drop(e);
        wake();
    }
}

impl DataPlane for TcpPlane {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), PlaneError> {
        let meta = AgentMetadata::decode(&memory.agent_metadata)
            .map_err(|e| PlaneError::rejected(TcpRefusal::Metadata(e)))?;
        let addr = meta
            .tcp
            .ok_or_else(|| PlaneError::rejected(TcpRefusal::NoTcp))?;
        if memory.block_len != self.block_len {
            return Err(PlaneError::rejected(TcpRefusal::BlockLen {
                theirs: memory.block_len,
                ours: self.block_len,
            }));
        }
        // A new registration replaces the old link (issued keys stay: they are about writes
        // into us).
        self.drop_link(peer);
        lock(&self.ends).faults.remove(peer);
        let key = match meta.tcp_key.map(<[u8; KEY_LEN]>::try_from) {
            Some(Ok(key)) => key,
            Some(Err(_)) => {
                lock(&self.registrations).insert(
                    peer.clone(),
                    Registration::Failed(PlaneError::rejected(TcpRefusal::KeyLen)),
                );
                return Ok(());
            }
            None => {
                lock(&self.registrations).insert(
                    peer.clone(),
                    Registration::Failed(PlaneError::rejected(TcpRefusal::NoKey)),
                );
                return Ok(());
            }
        };
        // TLS where both use it; a peer offering none is refused under "required", and taken in
        // plaintext under "preferred" (an older kvpeer).
        // A peer whose connect offers TLS writes into us only over TLS (its key alone, read
        // off the control channel, opens no plaintext connection), whatever our policy.
        lock(&self.gate).set_tls_only(peer, meta.tcp_tls && self.tls.policy() != TlsPolicy::Off);
        let identity = PeerAddr::parse(peer.as_str())
            .ok()
            .and_then(|a| a.socket_addr())
            .map(|a| a.ip());
        let tls = match (self.tls.policy(), meta.tcp_tls) {
            (TlsPolicy::Off, _) => None,
            (_, true) => match identity {
                Some(ip) => Some(ip),
                None => {
                    lock(&self.registrations).insert(
                        peer.clone(),
                        Registration::Failed(PlaneError::rejected(TcpRefusal::TlsNeedsAnAddress(
                            peer.to_string(),
                        ))),
                    );
                    return Ok(());
                }
            },
            (TlsPolicy::Preferred, false) => {
                debug!(%peer, "the peer offers no TLS on its tcp plane; writing to it in plaintext (tls = preferred)");
                None
            }
            (TlsPolicy::Required, false) => {
                lock(&self.registrations).insert(
                    peer.clone(),
                    Registration::Failed(PlaneError::rejected(TcpRefusal::NoTls)),
                );
                return Ok(());
            }
        };
        self.start_link(
            peer.clone(),
            addr,
            key,
            memory.num_blocks,
            tls,
            meta.tcp_digests,
        );
        Ok(())
    }

    fn registration(&mut self, peer: &PeerId) -> Registration {
        lock(&self.registrations)
            .get(peer)
            .cloned()
            .unwrap_or_else(|| Registration::Failed(PlaneError::not_registered()))
    }

    fn remove_remote_peer(&mut self, peer: &PeerId) {
        lock(&self.registrations).remove(peer);
        lock(&self.gate).set_tls_only(peer, false);
        // The key we issued to `peer` ends with the session that used it (module doc).
        let closed = lock(&self.gate).withdraw(peer);
        for _ in 0..closed {
            Counters::bump(&self.counters.key_closes);
        }
        self.pool.revoke_all(peer);
        self.drop_link(peer);
    }

    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId> {
        let peer_blocks = *lock(&self.linked).get(peer)?;
        let ok =
            !local.is_empty() && crate::write_in_range(local, remote, self.num_blocks, peer_blocks);
        if !ok || lock(&self.ends).faults.contains_key(peer) {
            return None;
        }
        self.next_tid = TransferId::new(self.next_tid.get() + 1);
        let tid = self.next_tid;
        lock(&self.ends).queued.insert(tid, peer.clone());
        self.sender.send(Cmd::Job {
            peer: peer.clone(),
            job: Job {
                tid,
                local: local.to_vec(),
                remote: remote.to_vec(),
            },
        });
        Some(tid)
    }

    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        let mut e = lock(&self.ends);
        let mut poll = e.ended.remove(peer).unwrap_or_default();
        poll.peer_fault = e.faults.get(peer).map(|f| PlaneError::transport(f.clone()));
        poll
    }

    fn take_news(&mut self, out: &mut Vec<PeerId>) -> bool {
        let e = lock(&self.ends);
        out.extend(e.ended.keys().cloned());
        out.extend(e.faults.keys().cloned());
        true
    }

    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
        let mut e = lock(&self.ends);
        let mut still = Vec::new();
        for &tid in ids {
            if e.queued.remove(&tid).is_some() {
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
        self.pool.grant(peer, blocks);
    }

    fn end_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        self.pool.revoke(peer, blocks);
        // A WRITE still landing in the ended load's blocks is cut off now, not at its deadline.
        let cut = lock(&self.gate).end_writes(peer, blocks);
        for _ in 0..cut {
            Counters::bump(&self.counters.load_closes);
        }
        if cut > 0 {
            debug!(%peer, cut, "closed tcp data connections still writing an ended load");
        }
    }

    fn bounds_write_time(&self, _peer: &PeerId) -> bool {
        // Each write must be acknowledged within `tcp_transfer_timeout` plus its bytes at `tcp_min_rate`, or its peer is faulted.
        true
    }

    fn writes_fenced(&mut self, _peer: &PeerId, blocks: &[BlockIndex], _end: WriteEnd) -> bool {
        // `end_writes` revoked the permits and cut the connections reading into the blocks; a
        // claim taken before that lives until the receiver drops it (its read ended).
        self.pool.unclaimed(blocks)
    }

    fn connect_metadata(
        &mut self,
        peer: &PeerId,
        // The key is fresh per `connect` and withdrawn with the session: nothing to bind to
        // the challenge (a writer's HELLO proves it holds the key this node issued).
        _challenge: Option<&[u8]>,
        advertised: &[u8],
    ) -> Vec<u8> {
        let mut meta = match AgentMetadata::decode(advertised) {
            Ok(meta) if meta.tcp.is_some() => meta,
            _ => return advertised.to_vec(),
        };
        let mut key = [0u8; KEY_LEN];
        if let Err(e) = getrandom::fill(&mut key) {
            // Without a key the peer's writer refuses to register (no tcp writes into us from
            // it this session), which is safe; an old key must not stand in.
            if let Some(suppressed) = crate::admit_warning(
                "no randomness for a tcp key; the peer cannot write to us over tcp",
            ) {
                warn!(%peer, error = %e, suppressed, "no randomness for a tcp key; the peer cannot write to us over tcp");
            }
            let closed = lock(&self.gate).withdraw(peer);
            for _ in 0..closed {
                Counters::bump(&self.counters.key_closes);
            }
            return advertised.to_vec();
        }
        let closed = lock(&self.gate).issue(peer, key);
        for _ in 0..closed {
            Counters::bump(&self.counters.key_closes);
        }
        meta.tcp_key = Some(key.to_vec());
        meta.tcp_tls = self.tls.policy() != TlsPolicy::Off;
        meta.tcp_digests = self.digests.load(Ordering::Relaxed);
        meta.encode()
    }
}

/// Shuts a socket both ways, so whatever reads it sees the end at once.
fn close(s: &TcpStream) {
    let _ = s.shutdown(Shutdown::Both);
}

/// Shuts a socket both ways and makes its last close a reset: bytes still in its send buffer
/// (a peer that stopped reading) are dropped instead of trickling out ahead of the FIN.
fn abort(s: &TcpStream) {
    reset_on_close(s);
    close(s);
}

/// Makes the socket's last close a reset (no FIN, and no TIME_WAIT left on this side).
fn reset_on_close(s: &TcpStream) {
    let off = nix::sys::socket::sockopt::Linger;
    let now = nix::libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    let _ = nix::sys::socket::setsockopt(s, off, &now);
}
