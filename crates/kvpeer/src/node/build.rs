//! Builds a node's parts from one spec: the block store (its pool a fresh shm object for the
//! planes that let a same-host peer map it, private anonymous memory in huge pages for the
//! others), a data plane, the control channel bound at the node's identity, and the core wired
//! to them.

use std::time::Instant;

use kvpeer_core::{Core, CoreConfig, LocalNode, Parent};
use kvpeer_net::control::{ControlChannel, ControlConfig, ControlError, ControlTls};
use kvpeer_net::data::shm::{ShmError, Wake};
use kvpeer_net::data::tcp::TcpError;
use kvpeer_proto::{DecodeLimits, PeerId};
use kvpeer_store::room::{self, Backing, NoRoom, Room};
use kvpeer_store::{BlockStore, Pool, PoolError, StoreError};
use tracing::info;

use super::allow::Allowlist;
use super::auth::Auth;
use super::io::NodeIo;
pub use super::plane::PlaneKind;
use super::wake::WakePipe;

/// The authenticated handshake's shared secret: its `Debug` says only its length, so a logged
/// or printed [`NodeSpec`] never carries it.
#[derive(Clone, PartialEq, Eq)]
pub struct AuthSecret(Vec<u8>);

impl AuthSecret {
    /// The secret's bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

impl From<Vec<u8>> for AuthSecret {
    fn from(bytes: Vec<u8>) -> Self {
        AuthSecret(bytes)
    }
}

impl std::fmt::Debug for AuthSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AuthSecret(<{} bytes, not shown>)", self.0.len())
    }
}

/// What a node is.
#[derive(Debug, Clone)]
pub struct NodeSpec {
    /// Identity, `host:port`: the address peers dial (`host:0` takes the port bound).
    pub id: PeerId,
    /// Where the control and tcp listeners bind when it is not the identity's address (a
    /// wildcard listen such as `0.0.0.0:5600`, advertised as `id`; port 0 picks one); `None`:
    /// at `id`.
    pub listen: Option<std::net::SocketAddr>,
    /// Its data plane.
    pub plane: PlaneKind,
    /// Blocks in the pool.
    pub num_blocks: u64,
    /// Bytes per block.
    pub block_len: u64,
    /// Name of the pool's shm object (made only for a plane that needs one: shm, both).
    pub shm_name: String,
    /// Where the tcp plane listens (`host:0` picks a port).
    pub tcp_listen: String,
    /// Cap on the tcp plane's bytes per second to each peer (`None`: uncapped).
    pub tcp_max_write_rate: Option<u64>,
    /// Peers writing to this node over tcp send a CRC-32C per block, checked as it lands
    /// ([`TcpPlane::with_block_digests`](kvpeer_net::data::tcp::TcpPlane::with_block_digests)).
    pub tcp_block_digests: bool,
    /// The slowest a peer may take the tcp plane's writes (bytes per second): each transfer
    /// must be acknowledged within `tcp_transfer_timeout` plus its bytes at this rate.
    pub tcp_min_write_rate: u64,
    /// A tcp transfer's allowance on top of its bytes at `tcp_min_write_rate`.
    pub tcp_transfer_timeout: std::time::Duration,
    /// tcp data connections into this node at once.
    pub tcp_max_connections: usize,
    /// Prefix-cache hash seed.
    pub hash_seed: String,
    /// Model configuration fingerprint ("" matches anything).
    pub config_fingerprint: String,
    /// The core's timeouts and limits.
    pub core: CoreConfig,
    /// Which peers the node talks to (empty: all).
    pub allowlist: Allowlist,
    /// Which tenant each peer is, and this node's own (docs/security.md, "Tenants").
    pub tenants: super::tenants::TenantRules,
    /// Whether a peer's IP identity must come from that address (docs/security.md).
    pub bind_identity: bool,
    /// Whether the shm plane accepts version-1 tokens, not bound to a connection's challenge
    /// (docs/security.md, "Fresh proofs"; off by default).
    pub shm_allow_replayable_tokens: bool,
    /// Shared secret for the authenticated handshake (`None`: off, as vLLM).
    pub auth_secret: Option<AuthSecret>,
    /// TLS on the control channel and the tcp data plane (`None`: off).
    pub tls: Option<TlsSpec>,
    /// The control channel's socket settings (frame size limit, heartbeats, queue).
    pub control: ControlConfig,
    /// Bounds on decoding a peer's message (size, nesting, keys per message).
    pub limits: DecodeLimits,
    /// The `nixl` plane's settings (used only with that plane).
    pub nixl: NixlOptions,
    /// The disk tier under the pool's memory (`None`: memory only).
    pub disk: Option<kvpeer_store::disk::DiskConfig>,
}

/// TLS on the control channel and the tcp data plane: the policy (preferred or required) and the node's PEM files,
/// read when the node is built and again whenever they change.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSpec {
    /// With peers that offer TLS, or with every peer.
    pub policy: kvpeer_net::tls::TlsPolicy,
    /// The certificate, key and trusted authorities.
    pub files: kvpeer_net::tls::TlsFiles,
}

/// Settings of the `nixl` data plane.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NixlOptions {
    /// The directory holding `libnixl_capi.so` (`None`: the loader's search path).
    pub lib_dir: Option<std::path::PathBuf>,
    /// UCX backend parameters set on top of NIXL's defaults, `key=value`.
    pub backend_params: Vec<(String, String)>,
}

/// Why a node could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BuildError {
    /// The block store.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The disk tier.
    #[error(transparent)]
    Disk(#[from] kvpeer_store::disk::DiskError),
    /// The pool's memory.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The pool does not fit this host's memory (or `/dev/shm`): refused before allocating.
    #[error(transparent)]
    NoRoom(#[from] NoRoom),
    /// The shm plane.
    #[error(transparent)]
    Shm(#[from] ShmError),
    /// The tcp plane.
    #[error(transparent)]
    Tcp(#[from] TcpError),
    /// The TLS files (tls_cert, tls_key, tls_ca).
    #[error(transparent)]
    Tls(#[from] kvpeer_net::tls::TlsError),
    /// The control channel.
    #[error(transparent)]
    Control(#[from] ControlError),
    /// The wake pipe.
    #[error("cannot make the wake pipe: {0}")]
    Wake(std::io::Error),
    /// The nixl plane.
    #[cfg(feature = "nixl")]
    #[error(transparent)]
    Nixl(#[from] kvpeer_net::data::nixl::NixlError),
    /// The authentication secret.
    #[error("authentication: {0}")]
    Auth(#[from] super::auth::AuthError),
    /// An engine given `tenants` rules without a `tenant` of its own.
    #[error("an engine with tenants rules needs a tenant of its own (tenant): all its blocks are that tenant's")]
    EngineWithoutTenant,
    /// This build of kvpeer lacks the data plane asked for (a cargo feature).
    #[error("this kvpeer was built without the {plane} plane: build with `--features {plane}`")]
    PlaneNotBuilt {
        /// Its name.
        plane: &'static str,
    },
}

/// Builds a node with the data plane its spec names; its I/O loop wakes when the plane
/// completes something. An identity with port 0 (`host:0`) binds a port the system picks and
/// takes it as identity. The pool is a shm object named `spec.shm_name` when the plane needs
/// one ([`PlaneKind::shared_pool`]), else private anonymous memory.
///
/// The pool is checked against this host's free memory (and `/dev/shm` for a shm pool) before
/// anything is allocated ([`room`]), and allocated before the control port opens, so no peer
/// connects to a node that cannot answer yet.
pub fn build(spec: &NodeSpec) -> Result<NodeIo, BuildError> {
    let (io, ()) = build_with(
        spec,
        |spec| {
            let shared = spec.plane.shared_pool();
            let bytes = spec.num_blocks.saturating_mul(spec.block_len);
            let backing = if shared {
                Backing::SharedMemory
            } else {
                Backing::Private
            };
            if shared {
                // Dead nodes' objects (a SIGKILL leaves gigabytes in /dev/shm) go first: they
                // take the room the check below counts, and perhaps this node's name.
                let removed = kvpeer_store::stale::remove_stale_objects();
                if !removed.is_empty() {
                    info!(objects = ?removed, "removed the shared-memory pools of kvpeer nodes that are gone");
                }
            }
            Room::of_this_host().check(bytes, spec.num_blocks, spec.block_len, backing)?;
            let memory = if shared {
                format!("shared memory, /dev/shm/{}", spec.shm_name)
            } else {
                "private memory".to_owned()
            };
            // A node with a disk tier starts without touching its memory: the pages fault in
            // as blocks arrive, so a large pool answers at once (docs/pool.md, "Disk tier").
            let lazy = spec.disk.is_some() && !shared;
            info!(blocks = spec.num_blocks, block_len = spec.block_len,
                size = %room::human(bytes), %memory,
                pages = if lazy { "on first use" } else { "pre-faulted" },
                "allocating the pool");
            let started = Instant::now();
            let pool = if shared {
                Pool::shm(&spec.shm_name, spec.num_blocks, spec.block_len, false)?
            } else if lazy {
                Pool::anonymous_lazy(spec.num_blocks, spec.block_len)?
            } else {
                Pool::anonymous(spec.num_blocks, spec.block_len, false)?
            };
            info!(ms = started.elapsed().as_millis() as u64, "pool allocated");
            Ok(pool)
        },
        |pool, wake| {
            let mut store = BlockStore::with_pool(pool)?;
            if let Some(disk) = &spec.disk {
                let started = Instant::now();
                // Blocks on disk name their tenant by name: this run's numbering maps them.
                let disk = kvpeer_store::disk::DiskConfig {
                    tenant_names: spec.tenants.names().to_vec(),
                    default_tenant: spec
                        .tenants
                        .own()
                        .map_or_else(String::new, |t| spec.tenants.name(t).to_owned()),
                    ..disk.clone()
                };
                store.attach_disk(&disk, wake)?;
                let found = store.disk_stats().map_or(0, |d| d.recovered_blocks);
                info!(
                    ms = started.elapsed().as_millis() as u64,
                    blocks = found,
                    "disk tier read: what it holds is served from now on"
                );
            }
            Ok((store, ()))
        },
    )?;
    let mut io = io;
    // A node without a tenant of its own keeps each tenant's blocks apart: a peer's lookups see
    // only its tenant's (a node with one talks to no other tenant). The rules are the origin
    // check's, resolved once.
    if let Some(tenants) = io.tenants().filter(|t| t.own().is_none()) {
        io.core.parent_mut().scope_peers(Box::new(tenants));
    }
    Ok(io)
}

/// Builds a node with the spec's data plane over the pool `make_pool` returns, and the parent
/// `make_parent` makes of that pool (with anything the caller keeps, `T`). The pool is made
/// before the control port opens (a peer that connects is then answered at once, never by a
/// node still allocating), so `make_pool` sees the spec's identity as configured (port 0
/// before the system picks one); `make_parent` runs after the channel is bound (the spec then
/// carries the real identity), once the plane is built over the pool, and gets the node's
/// wake hook.
pub(crate) fn build_with<Q: Parent, T>(
    spec: &NodeSpec,
    make_pool: impl FnOnce(&NodeSpec) -> Result<Pool, BuildError>,
    make_parent: impl FnOnce(Pool, Wake) -> Result<(Q, T), BuildError>,
) -> Result<(NodeIo<Q>, T), BuildError> {
    let pool = make_pool(spec)?;
    // The files are read once: the control channel and the tcp plane share one `Tls` (and so
    // one view of a rotated certificate).
    let tls = match &spec.tls {
        Some(tls) => Some(kvpeer_net::tls::Tls::load(tls.files.clone())?),
        None => None,
    };
    let mut control = spec.control.clone();
    if let (Some(spec_tls), Some(tls)) = (&spec.tls, &tls) {
        // The control channel speaks TLS under the same policy and certificate as the tcp
        // plane: a `connect`'s tokens, keys and proofs never cross the network in clear.
        control.tls = Some(ControlTls {
            tls: tls.clone(),
            policy: spec_tls.policy,
        });
    }
    let channel = match (spec.listen, spec.id.as_str().strip_suffix(":0")) {
        (Some(at), _) => ControlChannel::bind_at(at, &spec.id, control)?,
        (None, Some(host)) => ControlChannel::bind_any_port(host, control)?,
        (None, None) => ControlChannel::bind(spec.id.clone(), control)?,
    };
    let spec = NodeSpec {
        id: channel.identity().clone(),
        ..spec.clone()
    };
    let pipe = WakePipe::new().map_err(BuildError::Wake)?;
    let built = spec.plane.build(&spec, &pool, pipe.hook(), tls.as_ref())?;
    let pool_base = pool.base_addr();
    let (parent, kept) = make_parent(pool, pipe.hook())?;
    let local = LocalNode {
        peer_id: spec.id.clone(),
        agent_metadata: built.agent_metadata,
        base_addr: built.base_addr.unwrap_or(pool_base),
        num_blocks: spec.num_blocks,
        block_len: spec.block_len,
        config_fingerprint: spec.config_fingerprint.clone(),
        hash_seed: spec.hash_seed.clone(),
    };
    let mut core = Core::new(
        spec.core.clone(),
        local,
        parent,
        built.plane,
        Instant::now(),
    );
    core.set_decode_limits(spec.limits);
    let mut io = NodeIo::new(core, channel, Some(pipe));
    // A rule naming a host judges the addresses the name has now, resolved here, once (the
    // node's loop never resolves): a kvpeer peer's identity is its address.
    let mut allow = spec.allowlist.clone();
    allow.resolve_names(super::resolve::resolve_host);
    io.set_origin(spec.bind_identity, allow);
    if !spec.tenants.is_empty() {
        // Resolved here once; the store or the engine's parent share this copy.
        let mut tenants = spec.tenants.clone();
        tenants.resolve_names(super::resolve::resolve_host);
        io.set_tenants(std::sync::Arc::new(tenants));
    }
    io.set_decode_limits(spec.limits);
    if let Some(secret) = &spec.auth_secret {
        io.set_auth(Some(
            Auth::new(secret.as_bytes().to_vec()).map_err(BuildError::Auth)?,
        ));
    }
    Ok((io, kept))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::AuthSecret;
    use crate::NodeConfig;

    #[test]
    fn the_pool_is_made_before_the_control_port_opens() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let mut config = NodeConfig::local("pool-first");
        config.spec.id = kvpeer_proto::PeerId::from_host_port("127.0.0.1", port);
        config.spec.plane = crate::PlaneKind::Tcp;
        config.spec.num_blocks = 4;
        config.spec.block_len = 4096;
        let mut connected_while_allocating = None;
        let built = super::build_with(
            &config.spec,
            |spec| {
                connected_while_allocating =
                    Some(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
                Ok(kvpeer_store::Pool::anonymous(
                    spec.num_blocks,
                    spec.block_len,
                    false,
                )?)
            },
            |pool, _| Ok((kvpeer_store::BlockStore::with_pool(pool)?, ())),
        );
        assert!(built.is_ok(), "{:?}", built.err());
        assert_eq!(connected_while_allocating, Some(false));
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    }

    #[test]
    fn a_printed_spec_never_shows_the_auth_secret() {
        let mut config = NodeConfig::local("secret-debug");
        config.spec.auth_secret = Some(AuthSecret::from(b"hunter2-but-sixteen-bytes".to_vec()));
        let printed = format!("{:?} {:#?}", config, config.spec);
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(
            printed.contains("AuthSecret(<25 bytes, not shown>)"),
            "{printed}"
        );
    }
}
