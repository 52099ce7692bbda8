//! The interfaces the core drives: the local block store ([`Parent`]) and the data plane
//! ([`DataPlane`]). The node implements them with real components; tests with fakes.
//!
//! Both are called from the thread that owns the core, inside its entry points, and must never
//! block: anything slow (registering a peer's memory, moving bytes) starts here and reports its
//! completion later, when the core polls for it.

use std::time::Instant;

use kvpeer_proto::{OffloadKey, PeerId};

use crate::error::PlaneError;

pub use crate::ids::{BlockIndex, JobId, ServeCtx, TransferId};

/// What the local store says about one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookupResult {
    /// Held and readable.
    Hit,
    /// Not held.
    Miss,
    /// Being written (a load into this node is in progress): ask again soon.
    HitPending,
    /// Cannot answer now: ask again soon.
    Retry,
}

/// How a load's writes ended, for [`DataPlane::writes_fenced`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriteEnd {
    /// The peer said its writes into the blocks ended (its `transfer_done` or `abort_ack`);
    /// otherwise the load timed out or the session ended, and a stalled peer may still be in
    /// the middle of a write.
    pub confirmed: bool,
    /// The load ended with its session, and the peer's side ended that session
    /// ([`CloseReason::ended_by_peer`](crate::CloseReason::ended_by_peer)): its process
    /// exited or closed its connection, which a stalled one does not.
    pub peer_ended: bool,
    /// When the load ended (its blocks' writes were ended with [`DataPlane::end_writes`]).
    pub at: Instant,
}

/// Keys pinned by [`Parent::create_store_job`], and where they lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreJob {
    /// The job, completed later with [`Parent::complete_store_job`].
    pub job_id: JobId,
    /// The local block of each key, parallel to the keys passed in.
    pub blocks: Vec<BlockIndex>,
}

/// The local block store, as the producer role sees it.
///
/// Order per context: `on_new_request`, then `lookup`s and `create_store_job`s, then
/// `on_request_finished` (required even when nothing hit). Every job from `create_store_job`,
/// and every job the engine hands to [`Core::submit_store`](crate::Core::submit_store), is
/// completed exactly once with `complete_store_job`, success or not: that is the unpin.
pub trait Parent {
    /// Opens the bookkeeping of one inbound lookup.
    fn on_new_request(&mut self, ctx: &ServeCtx);
    /// Whether the store holds `key`.
    fn lookup(&mut self, key: &OffloadKey, ctx: &ServeCtx) -> LookupResult;
    /// Pins `keys` (each answered `Hit` in this same call of the core) so they cannot be evicted
    /// until the job completes. `None` if the store cannot pin them after all.
    fn create_store_job(&mut self, keys: &[OffloadKey], ctx: &ServeCtx) -> Option<StoreJob>;
    /// Completes (unpins) a store job.
    fn complete_store_job(&mut self, job_id: JobId, success: bool);
    /// Closes the bookkeeping of one inbound lookup.
    fn on_request_finished(&mut self, ctx: &ServeCtx);
    /// Whether this parent calls [`Core::serve`](crate::Core::serve) itself once a key it
    /// answered `Retry` can be answered (an engine that answers later, on its own thread).
    /// Then the core does not re-ask on a timer every `lookup_repoll_interval`; the lookup's
    /// deadline still ends the wait. `false` (the default): the core re-polls.
    fn wakes_core(&self) -> bool {
        false
    }
    /// Takes in work the store finished off the node's thread (a disk tier's reads and
    /// writes). The node calls it on every step, before the core's; it must not block. `true`
    /// if keys it answered `Retry` may be answered now (the node then has the core ask again
    /// at once, [`Core::serve`](crate::Core::serve), not at its next re-poll).
    fn progress(&mut self) -> bool {
        false
    }
}

/// A peer's memory as its `connect` describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteMemory {
    /// The peer's data-plane metadata.
    pub agent_metadata: Vec<u8>,
    /// Base address of its block region.
    pub base_addr: u64,
    /// Blocks in its region.
    pub num_blocks: u64,
    /// Bytes per block.
    pub block_len: u64,
}

/// State of a peer registration started with [`DataPlane::add_remote_peer`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Registration {
    /// Still running.
    Pending,
    /// The peer's memory is registered: writes to it may start.
    Done,
    /// Registration failed.
    Failed(PlaneError),
}

/// What the data plane reports for one peer's transfers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PlanePoll {
    /// Transfers that landed completely.
    pub done: Vec<TransferId>,
    /// Transfers that failed (nothing more of them will land).
    pub failed: Vec<TransferId>,
    /// The peer itself is unusable on the data plane (e.g. gone).
    pub peer_fault: Option<PlaneError>,
}

/// How [`DataPlane::cancel`] treats transfers still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelMode {
    /// Release only transfers that are terminal; report the others as still running. A write
    /// that may still land is never reported as stopped.
    Wait,
    /// Release everything now (shutdown only).
    Immediate,
}

/// The data plane: one-sided writes of local blocks into a peer's blocks.
pub trait DataPlane {
    /// Starts registering a peer's memory. Completion is read with
    /// [`DataPlane::registration`]; `connect_ack` waits for it.
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), PlaneError>;
    /// The state of the peer's registration.
    fn registration(&mut self, peer: &PeerId) -> Registration;
    /// Forgets a peer: its registration (pending or done) and every write permit it held.
    fn remove_remote_peer(&mut self, peer: &PeerId);
    /// Starts writing local blocks `local[i]` into the peer's blocks `remote[i]`. `None` if the
    /// write could not be started.
    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId>;
    /// Completions and faults for one peer's transfers since the last poll.
    fn poll(&mut self, peer: &PeerId) -> PlanePoll;
    /// Cancels transfers; returns those still running (always empty for `Immediate`).
    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId>;

    /// The peers whose [`DataPlane::poll`] may have something new since the last call (a
    /// transfer ended, a fault), appended to `out`: the core polls only those (and the
    /// sessions whose registration is settling or whose fault drains), so a completion costs
    /// the same with one peer or thousands. `false` (the default) when the plane does not keep
    /// them: every session is then polled at each plane event.
    fn take_news(&mut self, _out: &mut Vec<PeerId>) -> bool {
        false
    }

    /// This node sent `peer` a fetch naming these local blocks: its writes into them may come.
    /// A plane that can check incoming writes (tcp) refuses every other write from that peer.
    fn expect_writes(&mut self, _peer: &PeerId, _blocks: &[BlockIndex]) {}

    /// The load that named these blocks ended (done, failed or aborted): no more writes from
    /// `peer` into them.
    fn end_writes(&mut self, _peer: &PeerId, _blocks: &[BlockIndex]) {}

    /// Whether no write of `peer` can land in `blocks` any more, for a load that named them and
    /// has ended ([`DataPlane::end_writes`] was called), `end` saying how and when. The core hands
    /// a load's blocks back (its [`Event::LoadDone`](crate::Event::LoadDone)) only once this is
    /// true, asking again every [`FENCE_RECHECK`](crate::FENCE_RECHECK) and after the peer was
    /// removed, so a late write never lands in a block that serves another key. A plane whose
    /// writes cannot outlive [`DataPlane::end_writes`] keeps the default, `true`.
    fn writes_fenced(&mut self, _peer: &PeerId, _blocks: &[BlockIndex], _end: WriteEnd) -> bool {
        true
    }

    /// Whether this plane bounds how long a write to `peer` may take on its own (the tcp
    /// plane: its transfer timeout plus the write's bytes at its slowest allowed rate; the shm
    /// plane: a copy in this process). The core's stall timer (`transfer_stall_timeout`, vLLM
    /// 0.34's NIXL stall timeout) covers the writes of the others, where one that never
    /// completes would go unnoticed: a time-only bound would fault a large or rate-limited
    /// tcp write that is still moving. Default: `false`.
    fn bounds_write_time(&self, _peer: &PeerId) -> bool {
        false
    }

    /// The `agent_metadata` that this node's `connect` to `peer` carries, given what the node
    /// advertises to everyone and the challenge `peer` gave the connection the `connect` goes
    /// on (a kvpeer node gives one per connection; `None` from other peers). Planes that bind
    /// writes to one destination (a token proving the pool is ours, a key for the data
    /// connection) add per-destination fields here, bound to the challenge where they are
    /// proofs; called by the node just before a `connect` leaves, once per `connect`.
    fn connect_metadata(
        &mut self,
        _peer: &PeerId,
        _challenge: Option<&[u8]>,
        advertised: &[u8],
    ) -> Vec<u8> {
        advertised.to_vec()
    }

    /// The challenge this node gave the connection `peer`'s `connect` came on, told just before
    /// the core sees that `connect` (so before [`DataPlane::add_remote_peer`]): a plane that
    /// checks a proof in the peer's metadata requires it to be made for this challenge, so a
    /// proof captured on another connection, or made for an earlier instance of this node at
    /// the same address, is refused. `None`: no challenge was given (a test driving the core
    /// without a channel).
    fn bind_challenge(&mut self, _peer: &PeerId, _challenge: Option<&[u8]>) {}
}

/// A boxed plane is a plane: what a node holds when its plane is chosen at run time.
impl<T: DataPlane + ?Sized> DataPlane for Box<T> {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), PlaneError> {
        (**self).add_remote_peer(peer, memory)
    }
    fn registration(&mut self, peer: &PeerId) -> Registration {
        (**self).registration(peer)
    }
    fn remove_remote_peer(&mut self, peer: &PeerId) {
        (**self).remove_remote_peer(peer)
    }
    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId> {
        (**self).write_blocks(peer, local, remote)
    }
    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        (**self).poll(peer)
    }
    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
        (**self).cancel(ids, mode)
    }
    fn take_news(&mut self, out: &mut Vec<PeerId>) -> bool {
        (**self).take_news(out)
    }
    fn expect_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        (**self).expect_writes(peer, blocks)
    }
    fn end_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        (**self).end_writes(peer, blocks)
    }
    fn writes_fenced(&mut self, peer: &PeerId, blocks: &[BlockIndex], end: WriteEnd) -> bool {
        (**self).writes_fenced(peer, blocks, end)
    }
    fn bounds_write_time(&self, peer: &PeerId) -> bool {
        (**self).bounds_write_time(peer)
    }
    fn connect_metadata(
        &mut self,
        peer: &PeerId,
        challenge: Option<&[u8]>,
        advertised: &[u8],
    ) -> Vec<u8> {
        (**self).connect_metadata(peer, challenge, advertised)
    }
    fn bind_challenge(&mut self, peer: &PeerId, challenge: Option<&[u8]>) {
        (**self).bind_challenge(peer, challenge)
    }
}
