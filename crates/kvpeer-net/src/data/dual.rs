//! The combined data plane: a node advertises both `shm` and `tcp`, and writes to each peer over
//! `shm` when it can open that peer's shared-memory object, else over `tcp`.
//!
//! The choice is made once per peer, at registration: the shm plane opens the object the peer
//! named and proves it is the peer's own pool (size, trailer, the peer's `shm_token` for this
//! node; not this node's pool: see `shm.rs`), all before `add_remote_peer` returns; if any of
//! that fails (another host, another container, a missing `shm` entry or token, a token that
//! does not verify) the shm plane has mapped nothing writable and the tcp plane registers the
//! peer instead. That fallback writes nowhere unproven: tcp writes go to the peer's listener,
//! which checks each against the write permits it granted. Incoming writes need no choice: shm
//! writes land without this node's involvement, tcp writes arrive at its listener and are
//! checked against write permits as usual (permits are always handed to the tcp plane).
//!
//! Transfer ids are this plane's own, mapped to the inner plane's, so the two planes' ids can
//! never collide. Called by the core on the runtime thread, like the planes it wraps.

use std::collections::HashMap;

use kvpeer_core::{
    BlockIndex, CancelMode, DataPlane, PlaneError, PlanePoll, Registration, RemoteMemory,
    TransferId, WriteEnd,
};
use kvpeer_proto::PeerId;
use tracing::debug;

use crate::data::metadata::AgentMetadata;
use crate::data::shm::ShmPlane;
use crate::data::tcp::TcpPlane;

/// Which inner plane carries a peer's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Route {
    /// Same host: straight into the peer's shared-memory object.
    Shm,
    /// Over TCP to the peer's data listener.
    Tcp,
}

/// `shm` where possible, `tcp` otherwise.
pub struct DualPlane {
    shm: ShmPlane,
    tcp: TcpPlane,
    routes: HashMap<PeerId, Route>,
    /// Our transfer id → (route, the inner plane's id).
    transfers: HashMap<TransferId, (Route, TransferId)>,
    /// The reverse of `transfers`.
    outer: HashMap<(Route, TransferId), TransferId>,
    next_id: TransferId,
}

impl DualPlane {
    /// Combines the two planes (both over the node's own pool).
    pub fn new(shm: ShmPlane, tcp: TcpPlane) -> Self {
        DualPlane {
            shm,
            tcp,
            routes: HashMap::new(),
            transfers: HashMap::new(),
            outer: HashMap::new(),
            next_id: TransferId::new(1),
        }
    }

    /// The route chosen for `peer`, once it is registered.
    pub fn route(&self, peer: &PeerId) -> Option<Route> {
        self.routes.get(peer).copied()
    }

    /// Transfers queued or running on either plane.
    pub fn inflight(&self) -> usize {
        self.shm.inflight() + self.tcp.inflight()
    }

    /// The tcp plane (its listener address is advertised).
    pub fn tcp(&self) -> &TcpPlane {
        &self.tcp
    }

    fn plane(&mut self, route: Route) -> &mut dyn DataPlane {
        match route {
            Route::Shm => &mut self.shm,
            Route::Tcp => &mut self.tcp,
        }
    }

    /// Maps the inner plane's ids back to ours.
    fn outer_ids(&self, route: Route, inner: Vec<TransferId>) -> Vec<TransferId> {
        inner
            .into_iter()
            .filter_map(|i| self.outer.get(&(route, i)).copied())
            .collect()
    }

    /// Forgets a terminal transfer.
    fn forget(&mut self, id: TransferId) {
        if let Some(key) = self.transfers.remove(&id) {
            self.outer.remove(&key);
        }
    }
}

impl DataPlane for DualPlane {
    fn add_remote_peer(&mut self, peer: &PeerId, memory: &RemoteMemory) -> Result<(), PlaneError> {
        // Reset the route only: the tcp plane's side of this peer (the key we issued it, the
        // permits it holds as a writer into us) belongs to the session and ends with it, in
        // `remove_remote_peer`; its `add_remote_peer` replaces its own outbound link.
        self.routes.remove(peer);
        self.shm.forget_mapping(peer);
        let offers_shm =
            AgentMetadata::decode(&memory.agent_metadata).is_ok_and(|m| m.shm.is_some());
        if offers_shm {
            self.shm.add_remote_peer(peer, memory)?;
        }
        // Proven and mapped, or refused: the proof is synchronous, and a Failed registration
        // never mapped the object writable.
        let shm_usable =
            offers_shm && !matches!(self.shm.registration(peer), Registration::Failed(_));
        if shm_usable {
            debug!(%peer, "data plane: shm");
            self.routes.insert(peer.clone(), Route::Shm);
            return Ok(());
        }
        self.shm.forget_mapping(peer);
        debug!(%peer, "data plane: tcp (peer's shm object not reachable or not proven)");
        self.routes.insert(peer.clone(), Route::Tcp);
        self.tcp.add_remote_peer(peer, memory)
    }

    fn registration(&mut self, peer: &PeerId) -> Registration {
        match self.route(peer) {
            Some(route) => self.plane(route).registration(peer),
            None => Registration::Failed(PlaneError::not_registered()),
        }
    }

    fn remove_remote_peer(&mut self, peer: &PeerId) {
        // Both: the route's registration, and the write permits the tcp plane holds for this
        // peer as a writer into us whatever its route.
        self.routes.remove(peer);
        self.shm.remove_remote_peer(peer);
        self.tcp.remove_remote_peer(peer);
    }

    fn write_blocks(
        &mut self,
        peer: &PeerId,
        local: &[BlockIndex],
        remote: &[BlockIndex],
    ) -> Option<TransferId> {
        let route = self.route(peer)?;
        let inner = self.plane(route).write_blocks(peer, local, remote)?;
        let id = self.next_id;
        self.next_id = TransferId::new(self.next_id.get() + 1);
        self.transfers.insert(id, (route, inner));
        self.outer.insert((route, inner), id);
        Some(id)
    }

    fn poll(&mut self, peer: &PeerId) -> PlanePoll {
        // A peer with a route is polled there; one whose route went with its session (its
        // writes still running were retained by the core) on both, so the end of a write the
        // inner plane reports after the removal still comes out.
        // A routeless peer's faults are not reported (as before: only a registered peer's).
        let routed = self.route(peer);
        let routes: &[Route] = match routed {
            Some(Route::Shm) => &[Route::Shm],
            Some(Route::Tcp) => &[Route::Tcp],
            None => &[Route::Shm, Route::Tcp],
        };
        let mut out = PlanePoll::default();
        for &route in routes {
            let inner = self.plane(route).poll(peer);
            let done = self.outer_ids(route, inner.done);
            let failed = self.outer_ids(route, inner.failed);
            for id in done.iter().chain(&failed) {
                self.forget(*id);
            }
            out.done.extend(done);
            out.failed.extend(failed);
            if routed.is_some() {
                out.peer_fault = inner.peer_fault;
            }
        }
        out
    }

    fn take_news(&mut self, out: &mut Vec<PeerId>) -> bool {
        // Both sides are asked (a peer routed to one may have news left on the other).
        let shm = self.shm.take_news(out);
        let tcp = self.tcp.take_news(out);
        shm && tcp
    }

    fn cancel(&mut self, ids: &[TransferId], mode: CancelMode) -> Vec<TransferId> {
        let mut running = Vec::new();
        for route in [Route::Shm, Route::Tcp] {
            let inner: Vec<TransferId> = ids
                .iter()
                .filter_map(|id| self.transfers.get(id))
                .filter(|(r, _)| *r == route)
                .map(|(_, i)| *i)
                .collect();
            if inner.is_empty() {
                continue;
            }
            let still = self.plane(route).cancel(&inner, mode);
            running.extend(self.outer_ids(route, still));
        }
        for id in ids {
            if !running.contains(id) {
                self.forget(*id);
            }
        }
        running
    }

    fn expect_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        self.shm.expect_writes(peer, blocks);
        self.tcp.expect_writes(peer, blocks);
    }

    fn end_writes(&mut self, peer: &PeerId, blocks: &[BlockIndex]) {
        self.shm.end_writes(peer, blocks);
        self.tcp.end_writes(peer, blocks);
    }

    fn bounds_write_time(&self, _peer: &PeerId) -> bool {
        // Either plane: a copy in this process, or a tcp write under its own deadline.
        true
    }

    fn writes_fenced(&mut self, peer: &PeerId, blocks: &[BlockIndex], end: WriteEnd) -> bool {
        // Both: whichever plane the peer chose, neither may still be writing.
        let shm = self.shm.writes_fenced(peer, blocks, end);
        let tcp = self.tcp.writes_fenced(peer, blocks, end);
        shm && tcp
    }

    fn connect_metadata(
        &mut self,
        peer: &PeerId,
        challenge: Option<&[u8]>,
        advertised: &[u8],
    ) -> Vec<u8> {
        let with_shm = self.shm.connect_metadata(peer, challenge, advertised);
        self.tcp.connect_metadata(peer, challenge, &with_shm)
    }

    fn bind_challenge(&mut self, peer: &PeerId, challenge: Option<&[u8]>) {
        self.shm.bind_challenge(peer, challenge);
    }
}
