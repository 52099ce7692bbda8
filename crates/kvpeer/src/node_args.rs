//! Command-line options shared by the commands that run a node (`serve`, `fetch`), and the
//! dispatch from the chosen data plane to the generic node code.

use kvpeer_core::CoreConfig;
use kvpeer_proto::PeerId;

use kvpeer::node::build::NodeSpec;

pub(crate) use kvpeer::PlaneKind;

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
    /// Cap on the bytes per second the tcp plane writes to each peer (suffixes K, M, G: powers
    /// of 1000), so block traffic leaves room on a shared link. Uncapped by default.
    #[arg(long, value_parser = parse_rate, value_name = "BYTES_PER_SECOND")]
    pub(crate) tcp_max_rate: Option<u64>,
}

/// `100M` → 100,000,000; a plain number is bytes.
fn parse_rate(text: &str) -> Result<u64, String> {
    let (digits, scale) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 1_000),
        Some((i, 'M' | 'm')) => (&text[..i], 1_000_000),
        Some((i, 'G' | 'g')) => (&text[..i], 1_000_000_000),
        _ => (text, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{text:?} is not a positive rate like 500M"))
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
            tcp_max_write_rate: self.tcp_max_rate,
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
            kvpeer::PlaneKind::Shm => {
                type $plane = kvpeer_net::shm::ShmPlane;
                $body
            }
            kvpeer::PlaneKind::Tcp => {
                type $plane = kvpeer_net::tcp::TcpPlane;
                $body
            }
            kvpeer::PlaneKind::Both => {
                type $plane = kvpeer_net::dual::DualPlane;
                $body
            }
        }
    };
}
pub(crate) use with_plane;

#[cfg(test)]
mod tests {
    use super::parse_rate;

    #[test]
    fn rates_parse_with_and_without_suffixes() {
        assert_eq!(parse_rate("1500"), Ok(1500));
        assert_eq!(parse_rate("20M"), Ok(20_000_000));
        assert_eq!(parse_rate("2g"), Ok(2_000_000_000));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("fast").is_err());
        assert!(parse_rate("99999999999999999999G").is_err());
        assert!(parse_rate("").is_err());
    }
}
