//! The `nixl` data plane (cargo feature `nixl`): NIXL one-sided WRITEs, over its UCX backend,
//! into a peer's registered DRAM — the data plane stock vLLM engines use (`NixlTransport`).
//!
//! The node's pool (the store's [`PoolView`]: a node's own pool is private anonymous memory in
//! huge pages, `kvpeer_store::Pool::anonymous`, an engine's is the engine's; this plane only
//! needs its addresses and never maps anything) is registered with NIXL as one DRAM
//! region; a prepared descriptor list holds one descriptor per block, as vLLM's. What the node
//! advertises in `connect` is NIXL's own metadata blob (what vLLM's `add_remote_agent` reads),
//! and `base_addr` is the pool's address, so a vLLM peer's descriptors
//! (`base_addr + i × block_len`) fall inside the registered region. That formula is all a peer
//! knows (`connect` carries no row stride), so a pool whose stride is not its block length is
//! refused ([`NixlError::Stride`]) rather than written at the wrong places.
//!
//! Registering a peer (loading its metadata, preparing one descriptor per block of its region)
//! runs on a helper thread; the core acks the peer's `connect` only once it has landed. A write
//! is one prepared WRITE request of the named blocks; completion is read by polling the
//! request's state, on a watcher thread while anything is in flight, which wakes the runtime.
//!
//! Progress: NIXL's agent is made without its progress thread. That thread (NIXL's UCX
//! backend, `pthrDelay` 0 as NIXL's Python API sets it) polls UCX without ever blocking, a whole
//! core for as long as the agent lives, transfers or not. Here UCX is progressed only by the
//! watcher thread, and only while this node has work for it: WRITEs of its own in flight (each
//! state check progresses UCX's worker) or WRITEs it expects from a peer
//! ([`DataPlane::expect_writes`], from a fetch sent until its load ends), since a peer's WRITE
//! into this node completes only once this side's worker answers (UCX's wire-up of the peer's
//! endpoint; every byte when UCX moves them over TCP). Between them the watcher waits on a
//! condition variable: an idle node spends no CPU on NIXL.
//!
//! Cancelling never reports a WRITE as stopped while NIXL may still land it (spec §3): `Wait`
//! releases only requests NIXL reports ended. A request whose state check fails with a backend
//! error (NIXL's remote-disconnect class) has ended and failed, and faults its peer; any other
//! error faults the peer but keeps the request in flight, since its WRITE may still land.
//!
//! Loading: `nixl-sys` (feature `stub-api`) resolves `libnixl_capi.so` at the first NIXL call
//! and aborts the process if it is missing, so [`load_library`] loads it first (from a given
//! directory, else the loader's search path) and turns a missing library into an error naming
//! what to install. Called by the core on the runtime thread, like the other planes.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, TryRecvError};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use kvpeer_core::{
    BlockIndex, CancelMode, DataPlane, PlaneError, PlanePoll, Registration, RemoteMemory,
    TransferId, WriteEnd,
};
use kvpeer_proto::PeerId;
use kvpeer_store::PoolView;
use nixl_sys::{
    Agent, AgentConfig, MemType, MemoryRegion, NixlDescriptor, NotificationMap, RegistrationHandle,
    ThreadSync, XferDescList, XferDlistHandle, XferOp, XferRequest, XferStatus,
};
use tracing::{debug, info, warn};

use crate::data::shm::Wake;
use crate::lock;

/// What to install when NIXL cannot be loaded.
pub const INSTALL_HINT: &str = "install NIXL's wheel (`pip install --no-deps nixl==1.5.1 \
     nixl-cu12==1.5.1`) and point `nixl_lib_dir` (or LD_LIBRARY_PATH) at its \
     `site-packages/.nixl_cu12.mesonpy.libs` directory";

/// Why the plane could not start.
#[derive(Debug, thiserror::Error)]
pub enum NixlError {
    /// `libnixl_capi.so` could not be loaded.
    #[error("cannot load NIXL ({reason}): {INSTALL_HINT}")]
    Library {
        /// The loader's message.
        reason: String,
    },
    /// The pool's blocks are not `block_len` apart: peers address them as
    /// `base_addr + i × block_len`.
    #[error(
        "nixl plane: the pool's row stride ({stride} bytes) is not its block length \
         ({block_len}); peers would address its blocks at the wrong places"
    )]
    Stride {
        /// Bytes per block.
        block_len: u64,
        /// Bytes from one block's start to the next.
        stride: u64,
    },
    /// NIXL refused a step of the set-up.
    #[error("nixl plane: {step}: {error}")]
    Setup {
        /// What was being done.
        step: &'static str,
        /// NIXL's error.
        error: nixl_sys::NixlError,
    },
    /// A helper thread could not start.
    #[error("nixl plane: cannot start a thread: {0}")]
    Thread(std::io::Error),
}

/// Why a peer's NIXL registration was refused (nothing is written to it).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NixlRefusal {
    /// Its blocks are of another size than ours.
    #[error("block_len {theirs} is not ours ({ours})")]
    BlockLen {
        /// Its block length.
        theirs: u64,
        /// Ours.
        ours: u64,
    },
    /// It offers no region (no blocks, or no NIXL metadata).
    #[error("the peer offers no NIXL region")]
    NoRegion,
    /// It sent this node's own metadata (its WRITEs would land in our own pool).
    #[error("the peer's NIXL metadata is this node's own")]
    OwnMetadata,
    /// Its metadata names this node's own agent.
    #[error("the peer's NIXL agent {0:?} is this node's own")]
    OwnAgent(String),
    /// NIXL did not load its metadata.
    #[error("NIXL refused the peer's metadata: {0}")]
    Metadata(Arc<nixl_sys::NixlError>),
    /// NIXL did not take the descriptors of its blocks.
    #[error("NIXL refused the peer's descriptors: {0}")]
    Descriptors(Arc<nixl_sys::NixlError>),
    /// The registration thread could not start.
    #[error("cannot start the registration thread: {0}")]
    Spawn(Arc<std::io::Error>),
    /// The registration thread ended without a result.
    #[error("the registration thread ended without a result")]
    NoResult,
    /// Its region's addresses overflow (base, blocks and block length as it gave them).
    #[error("the peer's region ({blocks} blocks of {block_len} bytes at {base:#x}) overflows the address space")]
    Region {
        /// Its base address.
        base: u64,
        /// Its blocks.
        blocks: u64,
        /// Its block length.
        block_len: u64,
    },
    /// The peer was removed (or registered again) while its descriptors were being prepared.
    #[error("the registration was cancelled")]
    Cancelled,
}

/// Why a peer's WRITEs failed: its transfers fail, and its session winds down.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum NixlFault {
    /// NIXL reported a WRITE failed (its remote-disconnect class).
    #[error("NIXL reported the WRITE failed")]
    WriteFailed,
    /// NIXL could not say what became of a WRITE.
    #[error("NIXL state check failed: {0}")]
    StateCheck(Arc<nixl_sys::NixlError>),
}

/// How the plane's NIXL agent is made.
#[derive(Debug, Clone, Default)]
pub struct NixlConfig {
    /// The agent's name (unique per process; peers never dial it).
    pub agent_name: String,
    /// Backend parameters set on top of UCX's defaults (e.g. `num_threads`).
    pub backend_params: Vec<(String, String)>,
    /// Where `libnixl_capi.so` lives; `None`: the loader's search path.
    pub lib_dir: Option<PathBuf>,
}

/// Loads `libnixl_capi.so` once per process (from `dir`, or the loader's search path) so that
/// NIXL's later lookup by name finds it; an error names what to install. Also sets, when unset,
/// `NIXL_PLUGIN_DIR` (the library's `plugins/`) and `UCX_MODULES=^ib*` (without it UCX's
/// InfiniBand modules crash the process at exit on machines without RDMA).
pub fn load_library(dir: Option<&Path>) -> Result<(), NixlError> {
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        let path = dir.map_or_else(
            || PathBuf::from("libnixl_capi.so"),
            |d| d.join("libnixl_capi.so"),
        );
        // SAFETY: loading NIXL's C API library runs its initialisers, which is what using NIXL
        // means; it is loaded once, kept for the life of the process (never unloaded), with
        // RTLD_GLOBAL so `nixl-sys`'s own `dlopen("libnixl_capi.so")` finds this copy.
        let library = unsafe {
            libloading::os::unix::Library::open(
                Some(&path),
                libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL,
            )
        }
        .map_err(|e| e.to_string())?;
        // SAFETY: only the symbol's presence is checked; it is not called through this pointer.
        unsafe { library.get::<unsafe extern "C" fn()>(b"nixl_capi_create_agent\0") }
            .map_err(|e| format!("{} lacks NIXL's C API: {e}", path.display()))?;
        if let Some(d) = dir {
            let plugins = d.join("plugins");
            if std::env::var_os("NIXL_PLUGIN_DIR").is_none() && plugins.is_dir() {
                std::env::set_var("NIXL_PLUGIN_DIR", plugins);
            }
        }
        if std::env::var_os("UCX_MODULES").is_none() {
            std::env::set_var("UCX_MODULES", "^ib*");
        }
        std::mem::forget(library);
        Ok(())
    });
    loaded
        .clone()
        .map_err(|reason| NixlError::Library { reason })
}

/// A memory region NIXL registers: the pool's blocks.
#[derive(Debug)]
struct Region {
    addr: usize,
    len: usize,
}

impl MemoryRegion for Region {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.addr as *const u8
    }
    fn size(&self) -> usize {
        self.len
    }
}

impl NixlDescriptor for Region {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// A prepared descriptor list, moved from the registration thread to the runtime thread.
struct Dlist(XferDlistHandle);

// SAFETY: the handle is an opaque NIXL pointer owned by the agent, which outlives it; the agent
// runs with NIXL's own read-write locking (`ThreadSync::Rw`), and the handle is used by one
// thread at a time (built on the registration thread, then only by the runtime thread).
unsafe impl Send for Dlist {}

/// A registered peer.
struct Peer {
    name: String,
    dlist: Dlist,
    num_blocks: u64,
}

/// The NIXL agent a peer identity last registered with.
struct AgentSeen {
    name: String,
    /// When an agent of another name took this identity over: the one before is gone (a
    /// process holds its identity's port while it lives, stalled or not), so no write of a
    /// load it was given before then can still land.
    replaced_at: Option<Instant>,
}

/// Identities whose agents are remembered; past it only those of registered peers are kept
/// (a forgotten one only keeps its held loads held longer).
const MAX_AGENTS_SEEN: usize = 4096;

/// A registration on its helper thread: the peer's block count, and where its result arrives.
struct Pending {
    num_blocks: u64,
    result: Receiver<Result<(String, Dlist), NixlRefusal>>,
    /// Set when nobody waits for it any more: its thread stops preparing descriptors.
    cancel: Arc<AtomicBool>,
}

/// A WRITE in flight.
struct Inflight {
    peer: PeerId,
    request: XferRequest,
    /// Its state check failed once already: its peer was faulted for it (once, not per check).
    struck: bool,
}

/// State shared with the watcher thread.
#[derive(Default)]
struct Shared {
    inflight: HashMap<TransferId, Inflight>,
    /// Per peer: ended transfers, and a fault.
    ended: HashMap<PeerId, PlanePoll>,
    /// Per peer: blocks of this node's loads it may still WRITE into (see `expect_writes`).
    expected: HashMap<PeerId, u64>,
    /// The watcher's passes over the work (each progresses UCX).
    sweeps: u64,
    /// The watcher waits for work (on the condition variable).
    parked: bool,
    stop: bool,
}

impl Shared {
    /// Whether UCX must be progressed: WRITEs of ours in flight, or a peer's expected.
    fn busy(&self) -> bool {
        !self.inflight.is_empty() || !self.expected.is_empty()
    }
}

/// What the watcher thread is doing (for tests and diagnostics).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WatcherState {
    /// Passes the watcher made over the work so far; each progressed UCX. Constant while the
    /// plane is idle.
    pub sweeps: u64,
    /// The watcher is waiting for work (no WRITE in flight, none expected), spending no CPU.
    pub parked: bool,
    /// WRITEs of this node in flight.
    pub inflight: usize,
    /// Peers whose WRITEs this node expects.
    pub expecting: usize,
}

/// The nixl data plane of one node.
///
/// Fields drop in declaration order, and NIXL handles need their agent: descriptor lists first,
/// then the memory registration, the agent, and last the view keeping the registered memory
/// alive.
pub struct NixlPlane {
    peers: HashMap<PeerId, Peer>,
    pending: HashMap<PeerId, Pending>,
    local: Dlist,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    watcher: Option<std::thread::JoinHandle<()>>,
    _registration: RegistrationHandle,
    agent: Arc<Agent>,
    pool: PoolView,
    num_blocks: u64,
    block_len: u64,
    metadata: Vec<u8>,
    /// This node's agent name: a peer presenting it is refused.
    agent_name: String,
    failed: HashMap<PeerId, NixlRefusal>,
    /// The agent of the last session each identity was asked to write in
    /// ([`DataPlane::writes_fenced`]).
    agents: HashMap<PeerId, AgentSeen>,
    /// Remote agents a registration thread loaded and then did not keep (cancelled, failed
    /// after the load, or nobody waited any more): unloaded by this plane's thread unless a
    /// registered peer uses the same agent (an honest peer that connected again).
    orphans: Arc<Mutex<Vec<String>>>,
    next_tid: TransferId,
    wake: Wake,
}

impl std::fmt::Debug for NixlPlane {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlPlane")
            .field("num_blocks", &self.num_blocks)
            .field("block_len", &self.block_len)
            .field("peers", &self.peers.len())
            .finish()
    }
}

/// How often the watcher progresses UCX and checks WRITEs in flight while there are any, or
/// while a peer's are expected (NIXL reports completion only when asked; without its progress
/// thread, nothing else moves UCX).
const WATCH_INTERVAL: Duration = Duration::from_micros(50);

/// The agent's settings: NIXL's read-write locking (the plane calls it from the runtime, the
/// registration and the watcher threads), and no progress thread (see the module's doc).
pub fn agent_config() -> AgentConfig {
    AgentConfig {
        thread_sync: ThreadSync::Rw,
        enable_prog_thread: false,
        ..AgentConfig::default()
    }
}

impl NixlPlane {
    /// A plane for the node whose pool is `pool` (the store's view): its blocks (not a shm
    /// pool's trailer, which holds the secret of the shm plane's tokens) are registered with
    /// NIXL, and peers' WRITEs land in them.
    pub fn new(config: &NixlConfig, pool: PoolView, wake: Wake) -> Result<Self, NixlError> {
        let (num_blocks, block_len) = (pool.num_blocks(), pool.block_len());
        if pool.stride() != block_len {
            return Err(NixlError::Stride {
                block_len,
                stride: pool.stride(),
            });
        }
        load_library(config.lib_dir.as_deref())?;
        let setup = |step| move |error| NixlError::Setup { step, error };
        let agent = Agent::new_configured(&config.agent_name, &agent_config())
            .map_err(setup("create the agent"))?;
        let (_, mut params) = agent
            .get_plugin_params("UCX")
            .map_err(setup("read UCX's parameters"))?;
        for (key, value) in &config.backend_params {
            params
                .set(key, value)
                .map_err(setup("set a UCX parameter"))?;
        }
        agent
            .create_backend("UCX", &params)
            .map_err(setup("create the UCX backend"))?;
        let base = pool.base_addr() as usize;
        // The pool's bytes fit the address space (checked when it was made).
        let region = Region {
            addr: base,
            len: pool.span_len() as usize,
        };
        let started = Instant::now();
        let registration = agent
            .register_memory(&region, None)
            .map_err(setup("register the pool"))?;
        let registered = started.elapsed();
        let mut descs =
            XferDescList::new(MemType::Dram).map_err(setup("prepare the local descriptors"))?;
        for i in 0..num_blocks {
            descs.add_desc(base + (i * block_len) as usize, block_len as usize, 0);
        }
        let local = agent
            .prepare_xfer_dlist("", &descs, None)
            .map_err(setup("prepare the local descriptors"))?;
        info!(
            bytes = region.len,
            register_us = registered.as_micros() as u64,
            prepare_us = (started.elapsed() - registered).as_micros() as u64,
            "nixl: pool registered"
        );
        let metadata = agent
            .get_local_md()
            .map_err(setup("read the agent's metadata"))?;
        let agent = Arc::new(agent);
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        let watcher = {
            let (agent, shared, wake) = (agent.clone(), shared.clone(), wake.clone());
            std::thread::Builder::new()
                .name("kvpeer-nixl-watch".into())
                .spawn(move || watch(&agent, &shared, &wake))
                .map_err(NixlError::Thread)?
        };
        Ok(NixlPlane {
            agent,
            _registration: registration,
            pool,
            local: Dlist(local),
            num_blocks,
            block_len,
            metadata,
            agent_name: config.agent_name.clone(),
            peers: HashMap::new(),
            pending: HashMap::new(),
            failed: HashMap::new(),
            agents: HashMap::new(),
            orphans: Arc::default(),
            next_tid: TransferId::new(0),
            shared,
            watcher: Some(watcher),
            wake,
        })
    }

    /// Remembers that `peer`'s session we fetch from is its agent `name` (see [`AgentSeen`]).
    fn saw_agent(
        agents: &mut HashMap<PeerId, AgentSeen>,
        peers: &HashMap<PeerId, Peer>,
        peer: &PeerId,
        name: &str,
    ) {
        if agents.len() >= MAX_AGENTS_SEEN && !agents.contains_key(peer) {
            agents.retain(|p, _| peers.contains_key(p));
        }
        match agents.get_mut(peer) {
            Some(seen) if seen.name == name => {}
            Some(seen) => {
                debug!(%peer, old = %seen.name, new = %name, "nixl: the peer's agent was replaced");
                seen.name = name.to_owned();
                seen.replaced_at = Some(Instant::now());
            }
            None => {
                agents.insert(
                    peer.clone(),
                    AgentSeen {
                        name: name.to_owned(),
                        replaced_at: None,
                    },
                );
            }
        }
    }

    /// NIXL's metadata blob: what this node advertises as `agent_metadata`.
    pub fn metadata(&self) -> &[u8] {
        &self.metadata
    }

    /// Whether NIXL holds a loaded remote agent of this name (what a registration loads and
    /// a removal or a failed registration unloads).
    pub fn holds_remote_agent(&self, name: &str) -> bool {
        self.agent.check_remote_metadata(name, None)
    }

    /// Unloads the remote agents registration threads loaded and did not keep, unless a
    /// registered peer uses one of them.
    fn release_orphans(&mut self) {
        let orphans = std::mem::take(&mut *lock(&self.orphans));
        for name in orphans {
            if self.peers.values().any(|p| p.name == name) {
                continue;
            }
            if let Err(e) = self.agent.invalidate_remote_md(&name) {
                debug!(agent = %name, error = %e, "nixl: unloading a registration's leftover failed");
            }
        }
    }

    /// The registered region's address: what this node advertises as `base_addr`.
    pub fn base_addr(&self) -> u64 {
        self.pool.base_addr()
    }

    /// What the watcher thread is doing: whether it waits for work, and how often it has
    /// progressed UCX.
    pub fn watcher_state(&self) -> WatcherState {
        let s = lock(&self.shared.0);
        WatcherState {
            sweeps: s.sweeps,
            parked: s.parked,
            inflight: s.inflight.len(),
            expecting: s.expected.len(),
        }
    }
}

/// A peer's region as its `connect` gave it (its block count already bounded by the core's
/// `max_peer_blocks`): refused if its addresses overflow.
fn region_fits(base: u64, num_blocks: u64, block_len: u64) -> Result<(), NixlRefusal> {
    let end = num_blocks
        .checked_mul(block_len)
        .and_then(|len| len.checked_add(base));
    match end {
        Some(end) if usize::try_from(end).is_ok() && usize::try_from(block_len).is_ok() => Ok(()),
        _ => Err(NixlRefusal::Region {
            base,
            blocks: num_blocks,
            block_len,
        }),
    }
}

/// One descriptor per block of a peer's region at `base` (which [`region_fits`]), prepared
/// for its agent `agent_name`; `None` once `cancel` is set (the peer was removed or registered
/// again), so a replaced registration does not go on allocating.
fn prepare(
    agent: &Agent,
    agent_name: &str,
    base: u64,
    num_blocks: u64,
    block_len: u64,
    cancel: &AtomicBool,
) -> Result<Option<XferDlistHandle>, nixl_sys::NixlError> {
    let mut descs = XferDescList::new(MemType::Dram)?;
    for i in 0..num_blocks {
        if i % 4096 == 0 && cancel.load(Ordering::Relaxed) {
            return Ok(None);
        }
        descs.add_desc((base + i * block_len) as usize, block_len as usize, 0);
    }
    agent.prepare_xfer_dlist(agent_name, &descs, None).map(Some)
}

/// The watcher: while WRITEs are in flight or expected, progresses UCX every
/// [`WATCH_INTERVAL`] (asking NIXL for each WRITE's state does it; with none of ours in flight,
/// asking for notifications does); ended WRITEs move to `ended` and wake the runtime. With
/// nothing to do it waits on the condition variable.
fn watch(agent: &Agent, shared: &(Mutex<Shared>, Condvar), wake: &Wake) {
    let (state, ready) = shared;
    let mut s = lock(state);
    loop {
        while !s.busy() && !s.stop {
            s.parked = true;
            s = ready.wait(s).unwrap_or_else(|p| p.into_inner());
        }
        s.parked = false;
        if s.stop {
            return;
        }
        s.sweeps += 1;
        if s.inflight.is_empty() {
            // Only a peer's WRITEs are expected: progress UCX so they can land and complete.
            drop(s);
            progress(agent);
            s = lock(state);
        } else if check_inflight(agent, &mut s) {
            wake();
        }
        drop(s);
        std::thread::sleep(WATCH_INTERVAL);
        s = lock(state);
    }
}

/// Progresses UCX's worker once, for WRITEs other agents make into this node's pool: NIXL's
/// notification check does it (the agent has no progress thread). kvpeer sends and reads no
/// notifications; any a peer sends are dropped.
fn progress(agent: &Agent) {
    let result = NotificationMap::new().and_then(|mut notifs| {
        agent.get_notifications(&mut notifs, None)?;
        notifs.is_empty()
    });
    match result {
        Ok(true) => {}
        Ok(false) => debug!("nixl: dropped a peer's notifications (kvpeer uses none)"),
        Err(error) => debug!(%error, "nixl: progressing UCX failed"),
    }
}

/// Asks NIXL for the state of every WRITE in flight (which progresses UCX); ended ones move to
/// `ended`. Whether anything ended (or its peer was faulted).
fn check_inflight(agent: &Agent, s: &mut Shared) -> bool {
    let mut ended = false;
    let Shared {
        inflight,
        ended: reports,
        ..
    } = s;
    inflight.retain(|&id, entry| match agent.get_xfer_status(&entry.request) {
        Ok(XferStatus::InProgress) => true,
        Ok(XferStatus::Success) => {
            reports.entry(entry.peer.clone()).or_default().done.push(id);
            ended = true;
            false
        }
        // NIXL's remote-disconnect class: nothing more of this WRITE can land.
        Err(nixl_sys::NixlError::BackendError) => {
            let poll = reports.entry(entry.peer.clone()).or_default();
            poll.failed.push(id);
            poll.peer_fault = Some(PlaneError::transport(NixlFault::WriteFailed));
            if let Some(suppressed) = crate::admit_warning("nixl WRITE failed") {
                warn!(peer = %entry.peer, transfer = id.get(), suppressed, "nixl WRITE failed");
            }
            ended = true;
            false
        }
        // Any other error says nothing about the WRITE itself: it stays in flight (it may
        // still land) and its peer is faulted, once, so the session winds down.
        Err(error) => {
            if !entry.struck {
                entry.struck = true;
                if let Some(suppressed) = crate::admit_warning("nixl state check failed") {
                    warn!(peer = %entry.peer, transfer = id.get(), %error, suppressed, "nixl state check failed");
                }
                let poll = reports.entry(entry.peer.clone()).or_default();
                poll.peer_fault = Some(PlaneError::transport(NixlFault::StateCheck(Arc::new(error))));
                ended = true;
            }
            true
        }
    });
    ended
}

impl DataPlane for NixlPlane {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), PlaneError> {
        if memory.block_len != self.block_len {
            return Err(PlaneError::rejected(NixlRefusal::BlockLen {
                theirs: memory.block_len,
                ours: self.block_len,
            }));
        }
        if memory.num_blocks == 0 || memory.agent_metadata.is_empty() {
            return Err(PlaneError::rejected(NixlRefusal::NoRegion));
        }
        // A peer replaying our own metadata would have us WRITE into our own pool.
        if memory.agent_metadata == self.metadata {
            if let Some(suppressed) = crate::admit_warning(
                "nixl registration refused: the peer sent this node's own metadata",
            ) {
                warn!(%peer, suppressed, "nixl registration refused: the peer sent this node's own metadata");
            }
            return Err(PlaneError::rejected(NixlRefusal::OwnMetadata));
        }
        // Before NIXL loads anything of the peer's (a refusal after the load would leave its
        // agent loaded).
        region_fits(memory.base_addr, memory.num_blocks, memory.block_len)
            .map_err(PlaneError::rejected)?;
        self.remove_remote_peer(peer);
        let (tx, rx) = channel();
        let (agent, wake) = (self.agent.clone(), self.wake.clone());
        let orphans = self.orphans.clone();
        let own_name = self.agent_name.clone();
        let who = peer.clone();
        let memory = memory.clone();
        let cancel = Arc::new(AtomicBool::new(false));
        let cancel_flag = cancel.clone();
        std::thread::Builder::new()
            .name("kvpeer-nixl-register".into())
            .spawn(move || {
                let started = Instant::now();
                let result = agent
                    .load_remote_md(&memory.agent_metadata)
                    .map_err(|e| NixlRefusal::Metadata(Arc::new(e)))
                    .and_then(|name| {
                        // NIXL itself refuses a blob with its own agent's name; checked here
                        // too, so the refusal does not depend on NIXL's version. Nothing is
                        // invalidated: our own name must stay ours.
                        if name == own_name {
                            if let Some(suppressed) = crate::admit_warning("nixl registration refused: the peer presents this node's own agent") {
                                warn!(peer = %who, suppressed, "nixl registration refused: the peer presents this node's own agent");
                            }
                            return Err(NixlRefusal::OwnAgent(name));
                        }
                        let prepared = prepare(
                            &agent,
                            &name,
                            memory.base_addr,
                            memory.num_blocks,
                            memory.block_len,
                            &cancel_flag,
                        )
                        .map_err(|e| NixlRefusal::Descriptors(Arc::new(e)))
                        .and_then(|d| d.ok_or(NixlRefusal::Cancelled));
                        match prepared {
                            Ok(d) => Ok((name, Dlist(d))),
                            Err(e) => {
                                // Loaded but not kept: the plane unloads it.
                                lock(&orphans).push(name);
                                Err(e)
                            }
                        }
                    });
                if let Some(suppressed) = crate::admit_warning("nixl: peer registered") {
                    info!(
                        peer = %who,
                        ok = result.is_ok(),
                        elapsed_us = started.elapsed().as_micros() as u64,
                        suppressed,
                        "nixl: peer registered"
                    );
                }
                // Nobody waits any more (the peer was removed or registered again): release
                // what was built; the plane unloads the agent.
                if let Err(std::sync::mpsc::SendError(Ok((name, dlist)))) = tx.send(result) {
                    drop(dlist);
                    lock(&orphans).push(name);
                }
                wake();
            })
            .map_err(|e| PlaneError::resources(NixlRefusal::Spawn(Arc::new(e))))?;
        self.pending.insert(
            peer.clone(),
            Pending {
                num_blocks: memory.num_blocks,
                result: rx,
                cancel,
            },
        );
        Ok(())
    }

    fn registration(&mut self, peer: &PeerId) -> Registration {
        self.release_orphans();
        if self.peers.contains_key(peer) {
            return Registration::Done;
        }
        if let Some(reason) = self.failed.get(peer) {
            return Registration::Failed(PlaneError::rejected(reason.clone()));
        }
        let Some(pending) = self.pending.get(peer) else {
            return Registration::Failed(PlaneError::not_registered());
        };
        match pending.result.try_recv() {
            Err(TryRecvError::Empty) => Registration::Pending,
            Err(TryRecvError::Disconnected) => {
                self.pending.remove(peer);
                let reason = NixlRefusal::NoResult;
                self.failed.insert(peer.clone(), reason.clone());
                Registration::Failed(PlaneError::resources(reason))
            }
            Ok(result) => {
                let num_blocks = pending.num_blocks;
                self.pending.remove(peer);
                debug!(%peer, "nixl registration landed");
                match result {
                    Ok((name, dlist)) => {
                        self.peers.insert(
                            peer.clone(),
                            Peer {
                                name,
                                dlist,
                                num_blocks,
                            },
                        );
                        Registration::Done
                    }
                    Err(reason) => {
                        self.failed.insert(peer.clone(), reason.clone());
                        Registration::Failed(PlaneError::rejected(reason))
                    }
                }
            }
        }
    }

    fn remove_remote_peer(&mut self, peer: &PeerId) {
        // A registration still running is dropped with its receiver; its handles are released
        // when the thread's send fails and the result is dropped. One that finished but was
        // not read yet is released here: its agent is unloaded like any leftover.
        if let Some(pending) = self.pending.remove(peer) {
            pending.cancel.store(true, Ordering::Relaxed);
            if let Ok(Ok((name, dlist))) = pending.result.try_recv() {
                drop(dlist);
                lock(&self.orphans).push(name);
            }
        }
        self.failed.remove(peer);
        lock(&self.shared.0).expected.remove(peer);
        if let Some(p) = self.peers.remove(peer) {
            drop(p.dlist);
            if let Err(e) = self.agent.invalidate_remote_md(&p.name) {
                debug!(%peer, error = %e, "nixl: invalidating the peer's metadata failed");
            }
        }
        self.release_orphans();
    }

    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId> {
        let p = self.peers.get(peer)?;
        // NIXL refuses an empty request.
        if local.is_empty() || !crate::write_in_range(local, remote, self.num_blocks, p.num_blocks)
        {
            if let Some(suppressed) =
                crate::admit_warning("nixl write refused: block index out of range")
            {
                warn!(%peer, suppressed, "nixl write refused: block index out of range");
            }
            return None;
        }
        let index = |v: &[BlockIndex]| -> Option<Vec<i32>> {
            v.iter().map(|b| i32::try_from(b.get()).ok()).collect()
        };
        let (l, r) = (index(local)?, index(remote)?);
        let request = match self
            .agent
            .make_xfer_req(XferOp::Write, &self.local.0, &l, &p.dlist.0, &r, None)
            .and_then(|req| self.agent.post_xfer_req(&req, None).map(|_| req))
        {
            Ok(req) => req,
            Err(e) => {
                if let Some(suppressed) = crate::admit_warning("nixl WRITE could not be posted") {
                    warn!(%peer, error = %e, suppressed, "nixl WRITE could not be posted");
                }
                return None;
            }
        };
        self.next_tid = TransferId::new(self.next_tid.get() + 1);
        let tid = self.next_tid;
        let (state, ready) = &*self.shared;
        lock(state).inflight.insert(
            tid,
            Inflight {
                peer: peer.clone(),
                request,
                struck: false,
            },
        );
        ready.notify_one();
        Some(tid)
    }

    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        lock(&self.shared.0).ended.remove(peer).unwrap_or_default()
    }

    fn expect_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        if blocks.is_empty() {
            return;
        }
        // The agent of the session we fetch from: its session is established, through our
        // dial to the identity's port, so the process behind it holds that port. An agent
        // that merely registered (an inbound `connect` claiming the identity) proves nothing.
        if let Some(p) = self.peers.get(peer) {
            Self::saw_agent(&mut self.agents, &self.peers, peer, &p.name);
        }
        let (state, ready) = &*self.shared;
        let mut s = lock(state);
        let left = s.expected.entry(peer.clone()).or_default();
        *left = left.saturating_add(blocks.len() as u64);
        ready.notify_one();
    }

    fn end_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        let mut s = lock(&self.shared.0);
        if let Some(left) = s.expected.get_mut(peer) {
            *left = left.saturating_sub(blocks.len() as u64);
            if *left == 0 {
                s.expected.remove(peer);
            }
        }
    }

    /// NIXL writes are one-sided: this node sees nothing of them, and the primary region stays
    /// registered for every peer. Nor does the session's end stop them: a producer that
    /// resumes after it keeps the metadata it loaded and its endpoint, and UCX's loopback
    /// transports (tcp, cma) check no key on our side (measured: a SIGSTOPped `kvpeer serve`
    /// resumed after the session ended wrote its blocks; vLLM 0.34 releases at that point).
    /// So the fence is the peer's word that its writes ended (`transfer_done`, `abort_ack`),
    /// or a sign that its process is gone: its side ended the session (`disconnect`, or its
    /// host closed or reset the connection: it exited), or another agent took its identity
    /// after the load ended (seen when we fetch from it, through a session we dialed). A
    /// stalled process gives none of these; its blocks stay held (at most a share per host:
    /// the core).
    fn writes_fenced(&mut self, peer: &PeerId, _blocks: &[BlockIndex], end: WriteEnd) -> bool {
        end.confirmed
            || end.peer_ended
            || self
                .agents
                .get(peer)
                .and_then(|a| a.replaced_at)
                .is_some_and(|replaced| replaced > end.at)
    }

    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
        let mut s = lock(&self.shared.0);
        match mode {
            // Only ended WRITEs were removed from `inflight`; the rest may still land.
            CancelMode::Wait => ids
                .iter()
                .copied()
                .filter(|id| s.inflight.contains_key(id))
                .collect(),
            CancelMode::Immediate => {
                for id in ids {
                    // Dropping the request releases it; NIXL aborts what it still can.
                    s.inflight.remove(id);
                }
                Vec::new()
            }
        }
    }
}

impl Drop for NixlPlane {
    fn drop(&mut self) {
        {
            let (state, ready) = &*self.shared;
            let mut s = lock(state);
            s.stop = true;
            s.inflight.clear();
            ready.notify_all();
        }
        if let Some(w) = self.watcher.take() {
            let _ = w.join();
        }
        for (_, p) in self.peers.drain() {
            drop(p.dlist);
            let _ = self.agent.invalidate_remote_md(&p.name);
        }
        self.release_orphans();
    }
}
