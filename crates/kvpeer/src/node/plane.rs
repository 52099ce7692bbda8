//! Which data plane a node runs, and the one place a plane is made from its kind: everything
//! above holds it as a [`Plane`] (a boxed [`DataPlane`]), so no other layer is generic over it
//! or matches on its kind.

use kvpeer_core::DataPlane;
use kvpeer_net::data::dual::DualPlane;
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::shm::{ShmPlane, Wake};
use kvpeer_net::data::tcp::{TcpLimits, TcpPlane};
use kvpeer_proto::PeerAddr;
use kvpeer_store::Pool;

use super::build::{BuildError, NodeSpec};

/// Which data planes a node advertises and writes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlaneKind {
    /// Same-host shared memory only.
    Shm,
    /// TCP only.
    Tcp,
    /// Both: shm to peers whose pool this host can open, tcp to the others.
    #[default]
    Both,
    /// NIXL over UCX, as stock vLLM engines use (builds with the `nixl` feature).
    Nixl,
}

impl PlaneKind {
    /// Every plane, in the order of the documentation.
    pub const ALL: [PlaneKind; 4] = [
        PlaneKind::Shm,
        PlaneKind::Tcp,
        PlaneKind::Both,
        PlaneKind::Nixl,
    ];

    /// Its name in flags and config files.
    pub fn name(self) -> &'static str {
        match self {
            PlaneKind::Shm => "shm",
            PlaneKind::Tcp => "tcp",
            PlaneKind::Both => "both",
            PlaneKind::Nixl => "nixl",
        }
    }
}

impl std::fmt::Display for PlaneKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for PlaneKind {
    type Err = String;

    /// A plane by its [`name`](PlaneKind::name).
    fn from_str(s: &str) -> Result<Self, String> {
        PlaneKind::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("{s:?} is not shm, tcp, both or nixl"))
    }
}

/// A node's data plane, whatever its kind.
pub type Plane = Box<dyn DataPlane + Send>;

/// A plane made for a node, and what the node's `connect` says of it.
pub(crate) struct BuiltPlane {
    pub(crate) plane: Plane,
    /// The `agent_metadata` bytes `connect` carries: kvpeer's plane map, or NIXL's own blob.
    pub(crate) agent_metadata: Vec<u8>,
    /// The `base_addr` `connect` carries when the plane registered the pool itself (NIXL);
    /// `None`: the pool's address.
    pub(crate) base_addr: Option<u64>,
}

impl PlaneKind {
    /// Whether the node's own pool must be a shared-memory object (with the trailer proving
    /// whose it is), because a same-host peer maps it and writes into it: the shm plane, alone
    /// or in `both`. Otherwise the pool is private anonymous memory in transparent huge pages
    /// ([`Pool::anonymous`]), which a `/dev/shm` object does not get.
    pub fn shared_pool(self) -> bool {
        matches!(self, PlaneKind::Shm | PlaneKind::Both)
    }

    /// Makes this plane over the node's pool (the store's: the planes never map it
    /// themselves), waking the node through `wake`; `tls` is the node's TLS material, loaded
    /// once for the control channel and the tcp plane (`spec.tls` says the policy).
    pub(crate) fn build(
        self,
        spec: &NodeSpec,
        pool: &Pool,
        wake: Wake,
        tls: Option<&kvpeer_net::tls::Tls>,
    ) -> Result<BuiltPlane, BuildError> {
        let kvpeer_map = |plane: Plane, meta: AgentMetadata| BuiltPlane {
            plane,
            agent_metadata: meta.encode(),
            base_addr: None,
        };
        Ok(match self {
            PlaneKind::Shm => {
                let (plane, meta) = shm(spec, pool, wake)?;
                kvpeer_map(Box::new(plane), meta)
            }
            PlaneKind::Tcp => {
                let (plane, meta) = tcp(spec, pool, wake, tls)?;
                kvpeer_map(Box::new(plane), meta)
            }
            PlaneKind::Both => {
                let (shm, _) = shm(spec, pool, wake.clone())?;
                let (tcp, meta) = tcp(spec, pool, wake, tls)?;
                let meta = AgentMetadata {
                    shm: Some(spec.shm_name.clone()),
                    ..meta
                };
                kvpeer_map(Box::new(DualPlane::new(shm, tcp)), meta)
            }
            #[cfg(feature = "nixl")]
            PlaneKind::Nixl => {
                let config = kvpeer_net::data::nixl::NixlConfig {
                    // Unique per node and start (a restart in a container often gets the same
                    // pid, and a consumer tells a new process by its agent's name: G2');
                    // NIXL refuses a peer agent with its own name.
                    agent_name: format!(
                        "kvpeer-{}-{}-{:016x}",
                        spec.id,
                        std::process::id(),
                        start_nonce()
                    ),
                    backend_params: spec.nixl.backend_params.clone(),
                    lib_dir: spec.nixl.lib_dir.clone(),
                };
                let plane =
                    kvpeer_net::data::nixl::NixlPlane::new(&config, pool.view().clone(), wake)?;
                BuiltPlane {
                    agent_metadata: plane.metadata().to_vec(),
                    base_addr: Some(plane.base_addr()),
                    plane: Box::new(plane),
                }
            }
            #[cfg(not(feature = "nixl"))]
            PlaneKind::Nixl => return Err(BuildError::PlaneNotBuilt { plane: "nixl" }),
        })
    }
}

fn shm(spec: &NodeSpec, pool: &Pool, wake: Wake) -> Result<(ShmPlane, AgentMetadata), BuildError> {
    let mut plane = ShmPlane::new(spec.id.clone(), pool.view().clone(), wake)?;
    plane.set_allow_replayable_tokens(spec.shm_allow_replayable_tokens);
    let meta = AgentMetadata {
        agent: spec.id.to_string(),
        shm: Some(spec.shm_name.clone()),
        tcp: None,
        ..Default::default()
    };
    Ok((plane, meta))
}

fn tcp(
    spec: &NodeSpec,
    pool: &Pool,
    wake: Wake,
    tls: Option<&kvpeer_net::tls::Tls>,
) -> Result<(TcpPlane, AgentMetadata), BuildError> {
    let mut plane = TcpPlane::new(spec.id.clone(), pool.writer(), &spec.tcp_listen, wake)?
        .with_max_write_rate(spec.tcp_max_write_rate)
        .with_block_digests(spec.tcp_block_digests)
        .with_limits(TcpLimits {
            min_write_rate: spec.tcp_min_write_rate,
            transfer_timeout: spec.tcp_transfer_timeout,
            max_connections: spec.tcp_max_connections,
            ..TcpLimits::default()
        });
    if let (Some(spec_tls), Some(tls)) = (&spec.tls, tls) {
        plane = plane.with_tls(spec_tls.policy, tls.clone());
    }
    // Peers reach the data listener at the identity's host (a wildcard-bound listener's own
    // address, 0.0.0.0, is this host to whoever dials it, never this node).
    let data = PeerAddr::of(&spec.id).map_or_else(
        |_| plane.addr().to_string(),
        |id| id.with_port(plane.addr().port()).to_string(),
    );
    let meta = AgentMetadata {
        agent: spec.id.to_string(),
        shm: None,
        tcp: Some(data),
        ..Default::default()
    };
    Ok((plane, meta))
}

/// A value that differs per start of a node (random; the clock when no randomness is at
/// hand: a name need not be secret, only new).
#[cfg(feature = "nixl")]
fn start_nonce() -> u64 {
    let mut bytes = [0u8; 8];
    match getrandom::fill(&mut bytes) {
        Ok(()) => u64::from_le_bytes(bytes),
        Err(_) => std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
    }
}
