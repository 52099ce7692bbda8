//! A node driven by the embedding engine on the engine's own thread, poll-style (as quinn's
//! `Endpoint`): no runtime thread, no calls across threads. The engine calls
//! [`EngineNode::drive`] (wait for I/O at most so long, then handle it) or
//! [`EngineNode::step`] (handle what is there, never wait) whenever it likes, gives work with
//! [`EngineNode::lookup`] and [`EngineNode::load`], and takes results with
//! [`EngineNode::poll_event`]. Peers' lookups of the engine's blocks are answered through the
//! [`EngineLink`] (see [`super::parent`]), from this thread or any other.
//!
//! The engine owns the blocks: which key is in which block, which blocks are free, and the
//! pins. The node only moves bytes between its pool and peers' pools.
//!
//! An engine that must not make system calls on its own thread (vLLM's scheduler thread, under
//! its lock) can leave the I/O to a thread of its own ([`EngineNode::defer_io`]): that thread
//! sleeps on [`EngineNode::wait_plan`] without holding the node and calls
//! [`EngineNode::step`]; the engine's calls then only hand work to the core and wake it.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

use kvpeer_core::{
    BlockIndex, Core, CoreStats, Counters, JobId, LookupResult, Request, RequestRoles,
};
use kvpeer_net::data::shm::Wake;
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};
use kvpeer_store::{BlockBusy, Pool};

use super::parent::{EngineLink, EngineParent, FIRST_PIN_JOB};
use crate::node::build::{build_with, BuildError, NodeSpec};
use crate::node::io::NodeIo;
use crate::node::lookup_waits::{Ended, LookupWaits, Waiting};
use crate::node::plane::Plane;

/// What the engine learns from the node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    /// Every key of a [`EngineNode::lookup`] is answered (`Retry` for none of them): what the
    /// request's producer holds, in the order asked.
    LookedUp {
        /// The request.
        kv_request_id: KvRequestId,
        /// One answer per key asked.
        results: Vec<LookupResult>,
    },
    /// A [`EngineNode::load`] ended: its blocks landed (`success`), or the engine frees them.
    Loaded {
        /// The engine's job.
        job: JobId,
        /// Whether every block landed.
        success: bool,
    },
    /// A [`EngineNode::load`] failed while its producer may still write its blocks (its
    /// session ended on a timeout before the writes were fenced). Only with
    /// [`EngineNode::report_held_loads`] on: the engine may give the load up now (vLLM 0.34's
    /// `JobResult.deferred_release`), but its blocks stay untouched until the
    /// `Loaded { success: false }` of the same job, which follows once no write can land.
    LoadHeld {
        /// The engine's job.
        job: JobId,
    },
    /// A [`EngineNode::store`] ended: the engine may unpin its blocks.
    Stored {
        /// The engine's job.
        job: JobId,
        /// Whether its blocks reached the peer.
        success: bool,
    },
}

/// Why the engine's call was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum EngineError {
    /// Job ids from 2^62 up are the node's own (pins it holds for peers).
    #[error("job id {0} is reserved for the node's own jobs (use ids below 2^62)")]
    ReservedJob(JobId),
    /// `keys` and `blocks` of a load differ in length.
    #[error("a load of {keys} keys into {blocks} blocks")]
    Mismatch {
        /// Keys given.
        keys: usize,
        /// Blocks given.
        blocks: usize,
    },
}

/// A node an engine drives from its own thread.
pub struct EngineNode {
    io: NodeIo<EngineParent>,
    link: EngineLink,
    pool: Pool,
    /// The engine's lookups not answered yet, asked about again only when the core has news
    /// for their request (no deadline here: the core's lookup timeout ends a silent one).
    lookups: LookupWaits<()>,
    /// Blocks of the engine's own stores still running (a write to a peer may read them).
    storing: std::collections::HashMap<JobId, Vec<BlockIndex>>,
    /// `shutdown` ran (else `Drop` ends the sessions).
    shut_down: bool,
    /// Failed loads whose blocks are still held are announced ([`EngineEvent::LoadHeld`]).
    report_held: bool,
    events: VecDeque<EngineEvent>,
    /// The engine's calls leave sending to the thread that steps the node
    /// ([`EngineNode::defer_io`]).
    deferred_io: bool,
    /// That thread was woken and has not stepped since: the next call need not wake it.
    step_requested: bool,
    /// When that thread steps next unless woken (its last [`EngineNode::wait_plan`]).
    planned_step: Option<Instant>,
    /// Wakes [`EngineNode::wait_plan`]'s descriptor (the node's wake pipe).
    wake: Wake,
}

impl std::fmt::Debug for EngineNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineNode")
            .field("id", self.id())
            .finish_non_exhaustive()
    }
}

impl EngineNode {
    /// Builds the node over `pool`, the engine's block memory: its own registered region
    /// ([`Pool::external`], for the tcp and nixl planes), or a shared-memory object
    /// ([`Pool::shm`], or the engine's own adopted with [`Pool::adopt_shm`]: every plane). Binds the control channel and makes the data plane.
    pub fn build(spec: &NodeSpec, pool: Pool) -> Result<Self, BuildError> {
        if !spec.tenants.is_empty() && spec.tenants.own().is_none() {
            return Err(BuildError::EngineWithoutTenant);
        }
        let spec = NodeSpec {
            num_blocks: pool.num_blocks(),
            block_len: pool.block_len(),
            // The shm plane advertises the pool's own object (an engine's, when adopted).
            shm_name: pool.shm_name().unwrap_or(&spec.shm_name).to_owned(),
            ..spec.clone()
        };
        let (io, (link, pool, wake)) = build_with::<EngineParent, _>(
            &spec,
            |_| Ok(pool),
            |pool, wake| {
                let (parent, link) = EngineParent::new(Some(wake.clone()));
                Ok((parent, (link, pool, wake)))
            },
        )?;
        let mut io = io;
        if let Some(tenants) = io.tenants() {
            io.core.parent_mut().scope_peers(tenants);
        }
        io.watch_outcomes();
        Ok(EngineNode {
            io,
            link,
            pool,
            lookups: LookupWaits::default(),
            storing: Default::default(),
            shut_down: false,
            report_held: false,
            events: VecDeque::new(),
            deferred_io: false,
            step_requested: false,
            planned_step: None,
            wake,
        })
    }

    /// Leaves sending to a thread of the engine's own that sleeps on
    /// [`EngineNode::wait_plan`] (without holding the node) and calls [`EngineNode::step`]
    /// when woken. The engine's calls (`lookup`, `load`, `store`, `finish`) then hand their
    /// work to the core and wake that thread (one byte into the wake pipe while it may sleep,
    /// none while a wake is pending) instead of sending on the caller's thread; what they
    /// cause comes out at that thread's next step. Only that thread may then step or drive the
    /// node: a step marks the stepping thread awake, so a step on another thread while it
    /// sleeps would leave the next wakes unwritten until its planned time. Off by default: the
    /// caller's thread sends.
    pub fn defer_io(&mut self, on: bool) {
        self.deferred_io = on;
    }

    /// What a thread that steps the node needs to sleep without holding it: a descriptor that
    /// becomes readable when the network, a data plane or an engine call has work for a step
    /// (the control channel's epoll set, which holds the wake pipe once the node has stepped
    /// once), and how long it may sleep (until the node's next deadline, at most `max`). The
    /// descriptor stays valid while the node lives. With [`EngineNode::defer_io`], an engine
    /// call wakes that thread only when it left something to send or a deadline before then.
    /// Call it right before each sleep (it arms the wake pipe: wakes write from then on), and
    /// step after it returns whatever the wait: a zero wait means news came while the thread
    /// was awake, which only a step picks up.
    pub fn wait_plan(&mut self, now: Instant, max: Duration) -> (RawFd, Duration) {
        let (fd, deadline) = self.io.wait_plan(now);
        let wait = deadline.map_or(max, |at| at.saturating_duration_since(now).min(max));
        self.planned_step = Some(now + wait);
        (fd, wait)
    }

    /// Wakes the thread sleeping on [`EngineNode::wait_plan`] (one byte into the wake pipe, or
    /// only a flag its next plan reads while it is awake).
    pub fn wake_io(&self) {
        (self.wake)();
    }

    /// Whether [`EngineNode::poll_event`] has something.
    pub fn has_events(&self) -> bool {
        !self.events.is_empty()
    }

    /// After an engine call: sends what it caused now, or wakes the thread that will, if the
    /// call left something to send or to report, or a deadline before that thread's next step.
    /// A wake costs the caller a system call (and on a VM 10-20 µs: the other thread's wake-up
    /// is charged to the writer), so a call that changed nothing the thread must act on soon
    /// (a lookup answered from the probes, a finish with nothing to abort) wakes nobody.
    fn send_or_wake(&mut self, now: Instant) {
        if self.deferred_io {
            self.wake_if_needed();
        } else {
            self.io.flush(now);
        }
    }

    /// With [`EngineNode::defer_io`]: wakes the I/O thread if the engine's call left it
    /// something to do soon (see [`EngineNode::send_or_wake`]); nothing otherwise.
    fn wake_if_needed(&mut self) {
        if !self.deferred_io || self.step_requested {
            return;
        }
        let core = &self.io.core;
        let sooner = core
            .poll_timeout()
            .is_some_and(|at| self.planned_step.is_none_or(|planned| at < planned));
        if core.has_output() || sooner {
            self.step_requested = true;
            (self.wake)();
        }
    }

    /// Announces a failed load whose blocks its producer may still write at once
    /// ([`EngineEvent::LoadHeld`]), before its `Loaded { success: false }` (off by default: an
    /// engine that frees a failed load's blocks when told must only hear of it once fenced).
    pub fn report_held_loads(&mut self, on: bool) {
        self.report_held = on;
    }

    /// The node's identity (its control address).
    pub fn id(&self) -> &PeerId {
        self.io.channel.identity()
    }

    /// The engine's end of the producer side: queries to answer, pins coming back.
    pub fn link(&self) -> EngineLink {
        self.link.clone()
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> u64 {
        self.pool.num_blocks()
    }

    /// Bytes per block.
    pub fn block_len(&self) -> u64 {
        self.pool.block_len()
    }

    /// Copies block `block` into `out` (a block's length): what a load brought. Refused while
    /// a peer may write it (a load into it is running). Copies, never lends: no reference to
    /// the pool escapes, so nothing can alias a peer's write.
    pub fn read_block(&self, block: BlockIndex, out: &mut [u8]) -> Result<(), BlockBusy> {
        // No permit can be granted while `self` is borrowed (grants come from this node's
        // core, on the engine's thread), so the check holds for the copy.
        let bytes = self.pool.quiet_block(block)?;
        let given = out.len();
        copy_whole(out, bytes, given)
    }

    /// Writes `bytes` (a block's length) into block `block`, for peers to fetch. Refused while
    /// a peer may write the block (a load into it) or a write to a peer may read it (a pin the
    /// node holds on it, or a store of the engine's still running).
    pub fn write_block(&mut self, block: BlockIndex, bytes: &[u8]) -> Result<(), BlockBusy> {
        let stored = self.storing.values().any(|blocks| blocks.contains(&block));
        if stored || self.io.core.parent().is_pinned(block) {
            return Err(BlockBusy::PeerRead);
        }
        let target = self.pool.block_mut(block)?;
        copy_whole(target, bytes, bytes.len())
    }

    /// Waits at most `max` for the network, a data-plane completion, an engine's answer or the
    /// node's next deadline, then handles what came ([`EngineNode::step`]).
    pub fn drive(&mut self, max: Duration) {
        let now = Instant::now();
        self.io.wait(now, max);
        self.handle(Instant::now());
    }

    /// Handles what is there (messages, completions, deadlines, the engine's answers) and
    /// sends what is due. Never waits.
    pub fn step(&mut self, now: Instant) {
        self.step_requested = false;
        // One poll of every socket with no timeout says which have input, so the step reads
        // only those (without it, every connection and the listener is tried: a system call
        // each, on the engine's thread, for an idle node too).
        self.io.wait(now, Duration::ZERO);
        self.handle(now);
    }

    /// What `step` and `drive` do once the sockets were polled.
    fn handle(&mut self, now: Instant) {
        self.io.step(now);
        if self.io.core.parent_mut().take_answered() {
            self.io.core.serve(now);
        }
        self.collect(now);
        self.io.flush(now);
        if self.io.core.has_inflight() {
            // Writes this step started may be done already (a small NIXL WRITE on one host):
            // their `transfer_done` leaves now instead of at the engine's next step.
            self.io.core.handle_data_plane(now);
            self.collect(now);
            self.io.flush(now);
        }
    }

    /// Opens a request whose KV source is `peer` (it is dialed when the first lookup leaves).
    pub fn new_request(&mut self, kv_request_id: KvRequestId, peer: PeerId) -> Request {
        self.new_request_with(kv_request_id, RequestRoles::kv_source(peer))
    }

    /// Opens a request with any roles: a PD producer ([`RequestRoles::decoder`]) stores for a
    /// peer that fetches; a PD consumer ([`RequestRoles::prefiller`]) loads without a lookup.
    pub fn new_request_with(&mut self, kv_request_id: KvRequestId, roles: RequestRoles) -> Request {
        let now = Instant::now();
        let request = self.io.core.on_new_request(now, kv_request_id, roles);
        // A new source is dialed now (its handshake, not the engine's next call).
        self.wake_if_needed();
        request
    }

    /// Offers `keys` in the engine's `blocks` (pinned by the engine) to the peer that will fetch
    /// the request (a PD producer); [`EngineEvent::Stored`] for `job` says when the engine may
    /// unpin them. For a request without that role the job ends at once.
    pub fn store(
        &mut self,
        job: JobId,
        request: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) -> Result<(), EngineError> {
        self.submit(job, keys, blocks, true, |core, now, keys, blocks| {
            core.submit_store(now, job, request, keys, blocks)
        })?;
        self.wake_if_needed();
        Ok(())
    }

    /// Asks the request's producer about `keys`; the answer comes as
    /// [`EngineEvent::LookedUp`] (keys it could not be asked about answer `Miss`).
    pub fn lookup(&mut self, request: &Request, keys: Vec<OffloadKey>) {
        let now = Instant::now();
        let waiting = Waiting {
            started: now,
            request: request.clone(),
            keys,
            deadline: None,
            with: (),
        };
        let events = &mut self.events;
        self.lookups.add(&mut self.io, now, waiting, |w, end| {
            looked_up(events, w, end)
        });
        self.send_or_wake(now);
    }

    /// Fetches `keys` (looked up before) into the engine's `blocks`; the result comes as
    /// [`EngineEvent::Loaded`] for `job`. The blocks are the engine's to keep untouched until
    /// then.
    pub fn load(
        &mut self,
        job: JobId,
        request: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) -> Result<(), EngineError> {
        self.submit(job, keys, blocks, false, |core, now, keys, blocks| {
            core.submit_load(now, job, request, keys, blocks)
        })?;
        // The fetch closed the round: a lookup of this request still waiting asks again.
        let now = Instant::now();
        let events = &mut self.events;
        self.lookups
            .recheck(&mut self.io, now, request.id(), |w, end| {
                looked_up(events, w, end)
            });
        if self.deferred_io {
            // Its new probes go out with the fetch (queued now, sent by the I/O thread).
            self.io.core.flush_lookups(now);
            self.wake_if_needed();
        }
        Ok(())
    }

    /// Checks an engine's job, hands it to the core with `submit`, and sends what it caused
    /// (a store for a request without the PD role ends at once: its event is collected). The
    /// blocks of a store (`offered`) stay unwritable for the engine until it ends.
    fn submit(
        &mut self,
        job: JobId,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
        offered: bool,
        submit: impl FnOnce(&mut Core<EngineParent, Plane>, Instant, Vec<OffloadKey>, Vec<BlockIndex>),
    ) -> Result<(), EngineError> {
        check_job(job, keys.len(), blocks.len())?;
        if offered {
            // Before the core sees it: a store that ends at once is collected just below.
            self.storing.insert(job, blocks.clone());
        }
        let now = Instant::now();
        submit(&mut self.io.core, now, keys, blocks);
        if self.deferred_io {
            // What it caused comes out at the I/O thread's step (`load` and `store` wake it).
            return Ok(());
        }
        // What the job caused at once (a store that ends at once, a load that fails at once)
        // reaches the outcomes through the flush, and comes out as events before we return.
        self.io.flush(now);
        self.collect(now);
        self.io.flush(now);
        Ok(())
    }

    /// Ends a request: its lookups and loads still waiting are answered `Miss` / failed.
    pub fn finish(&mut self, request: &Request) {
        let now = Instant::now();
        // Answered here, before the core forgets the request: asking the core about it after
        // `finish` would open it again and send a new lookup to the producer.
        for l in self.lookups.remove_request(request.id()) {
            self.events.push_back(EngineEvent::LookedUp {
                kv_request_id: l.request.id().clone(),
                results: vec![LookupResult::Miss; l.keys.len()],
            });
        }
        self.io.core.finish(now, request);
        if self.deferred_io {
            self.wake_if_needed();
            return;
        }
        self.collect(now);
        self.io.flush(now);
    }

    /// Fails every store no write reads (`Core::fail_unwritten_stores`): PD stores parked for a
    /// decoder that has not fetched them (a later fetch of their request is refused) and those
    /// sessions' rounds hold. What an engine's `drain_jobs` does before a reset frees the
    /// chunks those stores name; writes in flight go on. Returns the store jobs failed (their
    /// `StoreEnded` events follow).
    pub fn fail_unwritten_stores(&mut self) -> Vec<JobId> {
        let now = Instant::now();
        let failed = self.io.core.fail_unwritten_stores(now);
        if self.deferred_io {
            self.wake_if_needed();
            return failed;
        }
        // As `submit`: the failed stores reach the outcomes through the flush, and come out as
        // events before we return.
        self.io.flush(now);
        self.collect(now);
        self.io.flush(now);
        failed
    }

    /// Aborts every load not aborting yet (`Core::abort_loads`): what an engine's
    /// `drain_jobs` does before a reset, so a producer that never writes cannot hold it for the
    /// load timeout. Each load ends failed (its `LoadEnded` comes at its `abort_ack`, or with
    /// its session). Returns how many were aborted.
    pub fn abort_loads(&mut self) -> usize {
        let now = Instant::now();
        let aborted = self.io.core.abort_loads(now);
        if self.deferred_io {
            self.wake_if_needed();
            return aborted;
        }
        self.io.flush(now);
        self.collect(now);
        self.io.flush(now);
        aborted
    }

    /// The next result, if any.
    pub fn poll_event(&mut self) -> Option<EngineEvent> {
        self.events.pop_front()
    }

    /// Questions the engine has not answered and pins it has not got back (both 0 once every
    /// peer's lookup ended and every write completed).
    pub fn outstanding(&self) -> (usize, usize) {
        self.io.core.parent().outstanding()
    }

    /// The prefix-cache hash seed for sessions that begin from now on (an engine may learn
    /// its own only after the node is built).
    pub fn set_hash_seed(&mut self, seed: &str) {
        self.io.core.set_hash_seed(seed.to_owned());
    }

    /// Running totals of the protocol (lookups, hits, fetches, transfers, errors).
    pub fn counters(&self) -> Counters {
        *self.io.core.counters()
    }

    /// Open state of the protocol (sessions, requests, pins held for peers, transfers).
    pub fn core_stats(&self) -> CoreStats {
        self.io.core.stats()
    }

    /// Drains running writes for at most `drain`, then says `disconnect` to every peer.
    /// Returns the events not taken yet, the last ones included (the engine's loads and
    /// stores that ended with the shutdown: their blocks are the engine's again); pins the
    /// node held come back through the [`EngineLink`]. Dropping the node does the same with
    /// no drain, the events lost.
    pub fn shutdown(mut self, drain: Duration) -> Vec<EngineEvent> {
        self.io.shutdown(drain);
        self.shut_down = true;
        self.collect(Instant::now());
        self.events.drain(..).collect()
    }

    /// Turns what the core reported into events: answered lookups, ended loads and stores.
    fn collect(&mut self, now: Instant) {
        let news = self.io.take_outcomes();
        let events = &mut self.events;
        self.lookups
            .progress(&mut self.io, now, &news.answered, &news.ended, |w, end| {
                looked_up(events, w, end)
            });
        if !self.lookups.is_empty() {
            // Keys asked while the session was still opening go out now.
            self.io.core.flush_lookups(now);
        }
        // A held load (failed, its producer may still write its blocks) is reported to an
        // engine that can defer freeing its blocks (vLLM 0.34) at once; every engine gets its
        // result once it is fenced (vLLM 0.32/0.33 free a failed load's blocks when told).
        let held = self.io.take_held_loads();
        if self.report_held {
            self.events
                .extend(held.into_iter().map(|job| EngineEvent::LoadHeld { job }));
        }
        self.events.extend(
            self.io
                .take_load_results()
                .into_iter()
                .map(|(job, success)| EngineEvent::Loaded { job, success }),
        );
        for (job, success) in news.stores {
            // The engine's own stores only (the node's pins of its blocks for peers' lookups
            // end as store jobs too, and go back through the link).
            if self.storing.remove(&job).is_some() {
                self.events.push_back(EngineEvent::Stored { job, success });
            }
        }
    }
}

/// The event of an engine's lookup that ended (it has no deadline of its own).
fn looked_up(events: &mut VecDeque<EngineEvent>, waiting: Waiting<()>, end: Ended) {
    let results = match end {
        Ended::Answered(results) => results,
        Ended::Expired => vec![LookupResult::Miss; waiting.keys.len()],
    };
    events.push_back(EngineEvent::LookedUp {
        kv_request_id: waiting.request.id().clone(),
        results,
    });
}

impl Drop for EngineNode {
    fn drop(&mut self) {
        if !self.shut_down {
            // Sessions end and every job completes, so the engine's pins come back through
            // its link and peers hear `disconnect` instead of a silent close.
            self.io.shutdown(Duration::ZERO);
        }
    }
}

/// Copies a whole block between the pool and the caller's buffer of `given` bytes.
fn copy_whole(dst: &mut [u8], src: &[u8], given: usize) -> Result<(), BlockBusy> {
    if dst.len() != src.len() {
        let want = if given == dst.len() {
            src.len()
        } else {
            dst.len()
        };
        return Err(BlockBusy::WrongLength { got: given, want });
    }
    dst.copy_from_slice(src);
    Ok(())
}

/// An engine's job id and the lengths of its keys and blocks, checked.
fn check_job(job: JobId, keys: usize, blocks: usize) -> Result<(), EngineError> {
    if job.get() >= FIRST_PIN_JOB {
        return Err(EngineError::ReservedJob(job));
    }
    if keys != blocks {
        return Err(EngineError::Mismatch { keys, blocks });
    }
    Ok(())
}
