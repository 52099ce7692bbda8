//! Command-line options shared by the commands that run a node (`serve`, `fetch`), and the
//! dispatch from the chosen data plane to the generic node code.

use kvpeer_core::CoreConfig;
use kvpeer_proto::PeerId;

use kvpeer::node::build::NodeSpec;

/// Which data planes a node advertises and writes with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum PlaneKind {
    /// Same-host shared memory only.
    Shm,
    /// TCP only.
    Tcp,
    /// Both: shm to peers whose pool this host can open, tcp to the others.
    Both,
}

/// The options that make a node.
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct NodeArgs {
    /// Control-channel address `HOST:PORT`, also the node's identity; port 0 picks a free one.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub(crate) listen: String,
    /// Blocks in the local pool.
    #[arg(long, default_value_t = 1024)]
    pub(crate) blocks: u64,
    /// Bytes per block (peers must agree).
    #[arg(long, default_value_t = 64 * 1024)]
    pub(crate) block_len: u64,
    /// Data planes to advertise and use.
    #[arg(long, value_enum, default_value_t = PlaneKind::Both)]
    pub(crate) plane: PlaneKind,
    /// Prefix-cache hash seed (peers must agree).
    #[arg(long, default_value = "0")]
    pub(crate) hash_seed: String,
}

impl NodeArgs {
    /// The node spec; `role` tags the pool's shm object name, which also carries the process id
    /// so two nodes on one host never collide.
    pub(crate) fn spec(&self, role: &str) -> NodeSpec {
        let host = self
            .listen
            .rsplit_once(':')
            .map_or(self.listen.as_str(), |(h, _)| h);
        NodeSpec {
            id: PeerId::new(self.listen.clone()),
            num_blocks: self.blocks,
            block_len: self.block_len,
            shm_name: format!("kvpeer-{role}-{}", std::process::id()),
            tcp_listen: format!("{host}:0"),
            hash_seed: self.hash_seed.clone(),
            config_fingerprint: String::new(),
            core: CoreConfig::default(),
        }
    }
}

/// Runs `$body` with the type alias `$plane` bound to the chosen data plane type.
macro_rules! with_plane {
    ($kind:expr, $plane:ident => $body:expr) => {
        match $kind {
            $crate::node_args::PlaneKind::Shm => {
                type $plane = kvpeer_net::shm::ShmPlane;
                $body
            }
            $crate::node_args::PlaneKind::Tcp => {
                type $plane = kvpeer_net::tcp::TcpPlane;
                $body
            }
            $crate::node_args::PlaneKind::Both => {
                type $plane = kvpeer_net::dual::DualPlane;
                $body
            }
        }
    };
}
pub(crate) use with_plane;
