//! One object for an [`EngineNode`] of any data plane: the plane is chosen at run time from
//! the settings (`plane = tcp | shm | both | nixl`), and Python holds one class.

use std::time::{Duration, Instant};

use kvpeer::engine::{
    BlockIndex, CoreStats, Counters, EngineError, EngineEvent, EngineLink, EngineNode, JobId,
    KvRequestId, Pool, Request, RequestRoles,
};
use kvpeer::node::build::{BuildError, BuildPlane, NodeSpec};
use kvpeer::{OffloadKey, PlaneKind};
use kvpeer_net::data::dual::DualPlane;
use kvpeer_net::data::shm::ShmPlane;
use kvpeer_net::data::tcp::TcpPlane;

/// What the binding asks of a node, whatever its plane.
pub(crate) trait Engine: Send {
    fn id(&self) -> String;
    fn link(&self) -> EngineLink;
    fn open(&mut self, id: KvRequestId, roles: RequestRoles) -> Request;
    fn lookup(&mut self, request: &Request, keys: Vec<OffloadKey>);
    fn load(
        &mut self,
        job: JobId,
        request: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) -> Result<(), EngineError>;
    fn store(
        &mut self,
        job: JobId,
        request: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) -> Result<(), EngineError>;
    fn finish(&mut self, request: &Request);
    fn step(&mut self);
    fn drive(&mut self, max: Duration);
    fn poll_event(&mut self) -> Option<EngineEvent>;
    fn outstanding(&self) -> (usize, usize);
    fn counters(&self) -> Counters;
    fn set_hash_seed(&mut self, seed: &str);
    fn core_stats(&self) -> CoreStats;
    fn shutdown(self: Box<Self>, drain: Duration) -> Vec<EngineEvent>;
}

impl<D: BuildPlane + Send + 'static> Engine for EngineNode<D>
where
    EngineNode<D>: Send,
{
    fn id(&self) -> String {
        EngineNode::id(self).to_string()
    }
    fn link(&self) -> EngineLink {
        EngineNode::link(self)
    }
    fn open(&mut self, id: KvRequestId, roles: RequestRoles) -> Request {
        self.new_request_with(id, roles)
    }
    fn lookup(&mut self, request: &Request, keys: Vec<OffloadKey>) {
        EngineNode::lookup(self, request, keys)
    }
    fn load(
        &mut self,
        job: JobId,
        request: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) -> Result<(), EngineError> {
        EngineNode::load(self, job, request, keys, blocks)
    }
    fn store(
        &mut self,
        job: JobId,
        request: &Request,
        keys: Vec<OffloadKey>,
        blocks: Vec<BlockIndex>,
    ) -> Result<(), EngineError> {
        EngineNode::store(self, job, request, keys, blocks)
    }
    fn finish(&mut self, request: &Request) {
        EngineNode::finish(self, request)
    }
    fn step(&mut self) {
        EngineNode::step(self, Instant::now())
    }
    fn drive(&mut self, max: Duration) {
        EngineNode::drive(self, max)
    }
    fn poll_event(&mut self) -> Option<EngineEvent> {
        EngineNode::poll_event(self)
    }
    fn outstanding(&self) -> (usize, usize) {
        EngineNode::outstanding(self)
    }
    fn counters(&self) -> Counters {
        EngineNode::counters(self)
    }
    fn set_hash_seed(&mut self, seed: &str) {
        EngineNode::set_hash_seed(self, seed)
    }
    fn core_stats(&self) -> CoreStats {
        EngineNode::core_stats(self)
    }
    fn shutdown(self: Box<Self>, drain: Duration) -> Vec<EngineEvent> {
        EngineNode::shutdown(*self, drain)
    }
}

/// Why no node was built.
#[derive(Debug, thiserror::Error)]
pub(crate) enum StartError {
    /// The node itself (pool, plane, control channel).
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The plane was asked for but is not in this build.
    #[cfg_attr(feature = "nixl", allow(dead_code))]
    #[error("the {0} plane is not in this build of kvpeer (build it with the `nixl` feature)")]
    NotBuilt(PlaneKind),
}

/// A node with `plane` over `pool`.
pub(crate) fn build(
    plane: PlaneKind,
    spec: &NodeSpec,
    pool: Pool,
) -> Result<Box<dyn Engine>, StartError> {
    Ok(match plane {
        PlaneKind::Tcp => Box::new(EngineNode::<TcpPlane>::build(spec, pool)?),
        PlaneKind::Shm => Box::new(EngineNode::<ShmPlane>::build(spec, pool)?),
        PlaneKind::Both => Box::new(EngineNode::<DualPlane>::build(spec, pool)?),
        #[cfg(feature = "nixl")]
        PlaneKind::Nixl => Box::new(EngineNode::<kvpeer_net::data::nixl::NixlPlane>::build(
            spec, pool,
        )?),
        #[cfg(not(feature = "nixl"))]
        PlaneKind::Nixl => return Err(StartError::NotBuilt(plane)),
    })
}
