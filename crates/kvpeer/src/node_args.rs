//! Command-line options shared by the commands that run a node (`serve`, `fetch`), resolved
//! with the environment and the config file into a [`kvpeer::NodeConfig`].

use kvpeer::config;

pub(crate) use kvpeer::PlaneKind;

/// The options that make a node. Each one left out falls back to the environment, then the
/// `--config` file, then the default (docs/configuration.md).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct NodeArgs {
    /// A TOML config file (its keys: docs/configuration.md).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<std::path::PathBuf>,
    /// Control-channel address `HOST:PORT`, also the node's identity; port 0 picks a free one
    /// [default: 127.0.0.1:0].
    #[arg(long)]
    pub(crate) listen: Option<String>,
    /// Blocks in the local pool [default: 1024].
    #[arg(long)]
    pub(crate) blocks: Option<u64>,
    /// Bytes per block; peers must agree [default: 65536].
    #[arg(long)]
    pub(crate) block_len: Option<u64>,
    /// Data planes to advertise and use [default: both].
    #[arg(long, value_enum)]
    pub(crate) plane: Option<PlaneKind>,
    /// Prefix-cache hash seed; peers must agree [default: $PYTHONHASHSEED, else vLLM's default
    /// "vllm-none-hash"].
    #[arg(long)]
    pub(crate) hash_seed: Option<String>,
    /// Cap on the bytes per second the tcp plane writes to each peer (suffixes K, M, G: powers
    /// of 1000), so block traffic leaves room on a shared link. Uncapped by default.
    #[arg(long, value_parser = parse_rate, value_name = "BYTES_PER_SECOND")]
    pub(crate) tcp_max_rate: Option<u64>,
    /// Most peers at once [default: 128, as vLLM].
    #[arg(long)]
    pub(crate) max_peers: Option<u64>,
    /// Talk only to peers matching RULE (CIDR, host or host:port; repeat for more). Without
    /// any, every peer is allowed (as vLLM does).
    #[arg(long = "allow", value_name = "RULE")]
    pub(crate) allow: Vec<String>,
    /// Whether a peer's IP identity must come from that address (`false` only behind NAT or
    /// proxies that change source addresses; docs/security.md) [default: true].
    #[arg(long, value_name = "BOOL")]
    pub(crate) bind_identity: Option<bool>,
    /// Turn on the authenticated handshake with the shared secret in FILE (every peer must have
    /// it; stock vLLM peers cannot). Off by default.
    #[arg(long, value_name = "FILE")]
    pub(crate) auth_secret_file: Option<std::path::PathBuf>,
    /// The directory holding NIXL's `libnixl_capi.so`, for `--plane nixl` (e.g. the NIXL
    /// wheel's `site-packages/.nixl_cu12.mesonpy.libs`) [default: the loader's search path].
    #[arg(long, value_name = "DIR")]
    pub(crate) nixl_lib_dir: Option<std::path::PathBuf>,
}

impl NodeArgs {
    /// The node's configuration: flags over environment over file over defaults; `role` tags
    /// the pool's shm object name (which also carries the process id).
    pub(crate) fn resolve(&self, role: &str) -> Result<kvpeer::NodeConfig, String> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                config::from_toml(&text, &path.display().to_string()).map_err(|e| e.to_string())?
            }
            None => config::Settings::default(),
        };
        let env = config::from_env(|var| std::env::var(var).ok());
        let mut flags = config::Settings::default();
        if let Some(listen) = &self.listen {
            let (host, port) = listen
                .rsplit_once(':')
                .ok_or_else(|| format!("flag --listen: {listen:?} is not HOST:PORT"))?;
            flags.set("listen_host", host, "flag --listen");
            flags.set("listen_port", port, "flag --listen");
        }
        let numbers = [
            ("num_blocks", "--blocks", self.blocks),
            ("block_len", "--block-len", self.block_len),
            ("tcp_max_rate", "--tcp-max-rate", self.tcp_max_rate),
            ("max_peers", "--max-peers", self.max_peers),
        ];
        for (key, flag, value) in numbers {
            if let Some(v) = value {
                flags.set(key, v.to_string(), &format!("flag {flag}"));
            }
        }
        if let Some(path) = &self.auth_secret_file {
            flags.set(
                "auth_secret_file",
                path.display().to_string(),
                "flag --auth-secret-file",
            );
        }
        if !self.allow.is_empty() {
            flags.set("allowlist", self.allow.join(","), "flag --allow");
        }
        if let Some(on) = self.bind_identity {
            flags.set("bind_identity", on.to_string(), "flag --bind-identity");
        }
        if let Some(seed) = &self.hash_seed {
            flags.set("hash_seed", seed.clone(), "flag --hash-seed");
        }
        if let Some(plane) = self.plane {
            let name = plane.name();
            flags.set("plane", name, "flag --plane");
        }
        if let Some(dir) = &self.nixl_lib_dir {
            flags.set(
                "nixl_lib_dir",
                dir.display().to_string(),
                "flag --nixl-lib-dir",
            );
        }
        config::resolve(&file, &env, &flags, role).map_err(|e| e.to_string())
    }
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
