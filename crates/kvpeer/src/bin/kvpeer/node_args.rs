//! Command-line options shared by the commands that run a node (`serve`, `fetch`), resolved
//! with the environment and the config file into a [`kvpeer::NodeConfig`].
//!
//! Each flag sets one configuration key (`--listen` two); its help, default and environment
//! variable come from the key's declaration ([`kvpeer::config::keys`]), so none is written here.

use clap::builder::{PossibleValuesParser, TypedValueParser};
use kvpeer::config::{self, Key, KEY};
use kvpeer::PlaneKind;

/// The help line of a flag that sets `key`: its meaning, default and environment variable.
fn help(key: &Key) -> String {
    help_of(key.help, &[key])
}

/// `what`, then the defaults and environment variables of `keys` (`--listen` sets two).
fn help_of(what: &str, keys: &[&Key]) -> String {
    // The declarations are written as table cells (lower case); flag help starts a sentence.
    let what = what.trim();
    let mut out: String = what.chars().take(1).flat_map(char::to_uppercase).collect();
    out.push_str(what.get(out.len()..).unwrap_or(""));
    if keys.iter().all(|k| k.default.is_some()) {
        let defaults: Vec<&str> = keys.iter().filter_map(|k| k.default).collect();
        out.push_str(&format!(" [default: {}]", defaults.join(":")));
    }
    let env: Vec<&str> = keys.iter().filter_map(|k| k.env).collect();
    if !env.is_empty() {
        out.push_str(&format!(" [env: {}]", env.join(", ")));
    }
    out
}

/// `--plane`'s values: the library's names for its planes.
/// `--plane`: the planes this build has are listed; `nixl` in a build without it is still
/// taken (hidden), so the node refuses it with how to build it.
pub(crate) fn plane_parser() -> impl TypedValueParser<Value = PlaneKind> {
    PossibleValuesParser::new(PlaneKind::ALL.map(|kind| {
        clap::builder::PossibleValue::new(kind.name())
            .hide(kind == PlaneKind::Nixl && !cfg!(feature = "nixl"))
    }))
    .try_map(|s| s.parse())
}

/// The options that make a node. Each one left out falls back to the environment, then the
/// `--config` file, then the default (docs/configuration.md).
#[derive(Debug, Clone, clap::Args)]
pub(crate) struct NodeArgs {
    /// A TOML config file (its keys: docs/configuration.md).
    #[arg(long, value_name = "FILE")]
    pub(crate) config: Option<std::path::PathBuf>,
    // The help of the flags below comes from the keys' declarations (`help = ...`).
    #[arg(long, value_name = "HOST:PORT", help = help_of(
        "control-channel address, also the node's identity; port 0 picks a free one",
        &[&KEY.listen_host, &KEY.listen_port],
    ))]
    pub(crate) listen: Option<String>,
    #[arg(long, value_name = "HOST[:PORT]", help = help(&KEY.advertise))]
    pub(crate) advertise: Option<String>,
    #[arg(long, help = help(&KEY.num_blocks))]
    pub(crate) blocks: Option<u64>,
    #[arg(long, help = help(&KEY.block_len))]
    pub(crate) block_len: Option<u64>,
    #[arg(long, value_parser = plane_parser(), help = help(&KEY.plane))]
    pub(crate) plane: Option<PlaneKind>,
    #[arg(long, help = help(&KEY.hash_seed))]
    pub(crate) hash_seed: Option<String>,
    #[arg(long, value_name = "NAME", help = help(&KEY.shm_name))]
    pub(crate) shm_name: Option<String>,
    #[arg(long, value_parser = config::parse_rate, value_name = "BYTES_PER_SECOND", help = help_of(
        &format!("{} (suffixes K, M, G: powers of 1000)", KEY.tcp_max_rate.help),
        &[&KEY.tcp_max_rate],
    ))]
    pub(crate) tcp_max_rate: Option<u64>,
    #[arg(long, value_name = "PORT", help = help(&KEY.tcp_port))]
    pub(crate) tcp_port: Option<u16>,
    #[arg(long, help = help(&KEY.max_peers))]
    pub(crate) max_peers: Option<u64>,
    #[arg(long = "allow", value_name = "RULE", help = help_of(
        &format!("{}; repeat for more", KEY.allowlist.help),
        &[&KEY.allowlist],
    ))]
    pub(crate) allow: Vec<String>,
    #[arg(long, value_name = "NAME", help = help(&KEY.tenant))]
    pub(crate) tenant: Option<String>,
    #[arg(long = "tenant-rule", value_name = "NAME=RULE", help = help_of(
        &format!("{}; repeat for more", KEY.tenants.help),
        &[&KEY.tenants],
    ))]
    pub(crate) tenant_rules: Vec<String>,
    #[arg(long, value_name = "DIR", help = help(&KEY.disk_path))]
    pub(crate) disk_path: Option<std::path::PathBuf>,
    #[arg(long, value_name = "BYTES", help = help(&KEY.disk_capacity))]
    pub(crate) disk_capacity: Option<String>,
    #[arg(long, value_name = "hot|cold", help = help(&KEY.disk_promote))]
    pub(crate) disk_promote: Option<String>,
    #[arg(long, value_name = "N", help = help(&KEY.disk_threads))]
    pub(crate) disk_threads: Option<u64>,
    #[arg(long, value_name = "auto|uring|threads", help = help(&KEY.disk_io))]
    pub(crate) disk_io: Option<String>,
    #[arg(long, value_name = "BOOL", help = help_of(
        &format!("{} (false only behind NAT or proxies; docs/security.md)", KEY.bind_identity.help),
        &[&KEY.bind_identity],
    ))]
    pub(crate) bind_identity: Option<bool>,
    #[arg(long, value_name = "BOOL", help = help(&KEY.shm_allow_replayable_tokens))]
    pub(crate) shm_allow_replayable_tokens: Option<bool>,
    #[arg(long, value_name = "BOOL", help = help(&KEY.tcp_block_digests))]
    pub(crate) tcp_block_digests: Option<bool>,
    #[arg(long, value_name = "FILE", help = help(&KEY.auth_secret_file))]
    pub(crate) auth_secret_file: Option<std::path::PathBuf>,
    #[arg(long, value_name = "POLICY", value_parser = ["off", "preferred", "required"], help = help(&KEY.tls))]
    pub(crate) tls: Option<String>,
    #[arg(long, value_name = "FILE", help = help(&KEY.tls_cert))]
    pub(crate) tls_cert: Option<std::path::PathBuf>,
    #[arg(long, value_name = "FILE", help = help(&KEY.tls_key))]
    pub(crate) tls_key: Option<std::path::PathBuf>,
    #[arg(long, value_name = "FILE", help = help(&KEY.tls_ca))]
    pub(crate) tls_ca: Option<std::path::PathBuf>,
    #[arg(long, value_name = "DIR", help = help_of(
        &format!("{} (e.g. the NIXL wheel's site-packages/.nixl_cu12.mesonpy.libs)", KEY.nixl_lib_dir.help),
        &[&KEY.nixl_lib_dir],
    ))]
    pub(crate) nixl_lib_dir: Option<std::path::PathBuf>,
}

/// The options of a pool node (`kvpeer serve` only: a consumer follows no engine).
#[derive(Debug, Clone, Default, clap::Args)]
#[command(next_help_heading = "Pool node (docs/pool.md)")]
pub(crate) struct PoolArgs {
    #[arg(long, value_name = "EVENTS=PEER", help = help_of(
        &format!("{}; repeat for more engines (docs/pool.md)", KEY.follow.help),
        &[&KEY.follow],
    ))]
    pub(crate) follow: Vec<String>,
    #[arg(long, help = help(&KEY.pull_min_holders))]
    pub(crate) pull_min_holders: Option<u64>,
    #[arg(long, value_parser = config::parse_rate, value_name = "BYTES_PER_SECOND", help = help_of(
        &format!("{} (suffixes K, M, G: powers of 1000)", KEY.pull_max_rate.help),
        &[&KEY.pull_max_rate],
    ))]
    pub(crate) pull_max_rate: Option<u64>,
    #[arg(long, help = help(&KEY.pull_max_lookups))]
    pub(crate) pull_max_lookups: Option<u64>,
    #[arg(long, value_name = "ENDPOINT", help = help(&KEY.publish_events))]
    pub(crate) publish_events: Option<String>,
    #[arg(long, value_name = "ENDPOINT", help = help(&KEY.publish_replay))]
    pub(crate) publish_replay: Option<String>,
    #[arg(long, value_name = "TOPIC", help = help(&KEY.publish_topic))]
    pub(crate) publish_topic: Option<String>,
    #[arg(long, value_name = "bytes|int", help = help(&KEY.publish_hashes))]
    pub(crate) publish_hashes: Option<String>,
    #[arg(long, value_name = "HOST:PORT,...", help = help(&KEY.pool_shard))]
    pub(crate) shard: Option<String>,
    #[arg(long, value_name = "NAME", help = help(&KEY.publish_ownership))]
    pub(crate) publish_ownership: Option<String>,
}

/// Why a node command's configuration could not be made.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ArgsError {
    /// `--config` names a file that cannot be read.
    #[error("cannot read {}: {source}", path.display())]
    Read {
        /// The file.
        path: std::path::PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// `--listen` is not `HOST:PORT`.
    #[error("flag --listen: {0:?} is not HOST:PORT")]
    Listen(String),
    /// A key's value is bad, or the keys disagree (the message names the key and its source).
    #[error(transparent)]
    Config(#[from] config::ConfigError),
}

impl NodeArgs {
    /// The node's configuration: flags over environment over file over defaults; `role` tags
    /// the pool's shm object name (which also carries the process id).
    /// `pool` holds the pool node's flags (`serve`); `None` for a command that runs no pool.
    pub(crate) fn resolve(
        &self,
        role: &str,
        pool: Option<&PoolArgs>,
    ) -> Result<kvpeer::NodeConfig, ArgsError> {
        let (file, env, mut flags) = self.sources()?;
        if let Some(pool) = pool {
            pool.flags(&mut flags);
        }
        Ok(config::resolve(&file, &env, &flags, role)?)
    }

    /// Whether any source (flag, environment, file) says where this node listens or what it
    /// advertises: without, a consumer calls itself by its address on the route to its peer.
    pub(crate) fn listen_given(&self) -> Result<bool, ArgsError> {
        let (file, env, flags) = self.sources()?;
        Ok([&file, &env, &flags]
            .iter()
            .any(|s| s.get(KEY.listen_host.name).is_some() || s.get(KEY.advertise.name).is_some()))
    }

    /// Where the control address came from when not from a flag (`env
    /// VLLM_P2P_SIDE_CHANNEL_PORT`, `file kvpeer.toml`): the last source setting its host or port
    /// (flags beat the environment, which beats the file).
    pub(crate) fn listen_source(&self) -> Option<String> {
        let (file, env, flags) = self.sources().ok()?;
        let keys = [KEY.listen_port.name, KEY.listen_host.name];
        if keys.iter().any(|k| flags.get(k).is_some()) {
            return None;
        }
        [&env, &file].iter().find_map(|s| {
            keys.iter()
                .find_map(|k| s.get(k).map(|(_, src)| src.to_owned()))
        })
    }

    /// A key's value from the environment or the file (the environment wins), with where it
    /// came from: for the settings `serve` reads itself (`metrics_listen`).
    pub(crate) fn setting(&self, key: &Key) -> Result<Option<(String, String)>, ArgsError> {
        let (file, env, _) = self.sources()?;
        Ok([&env, &file].iter().find_map(|s| {
            s.get(key.name)
                .map(|(v, src)| (v.to_owned(), src.to_owned()))
        }))
    }

    /// The settings of the file, the environment and the flags.
    fn sources(&self) -> Result<(config::Settings, config::Settings, config::Settings), ArgsError> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|source| ArgsError::Read {
                    path: path.clone(),
                    source,
                })?;
                config::from_toml(&text, &path.display().to_string())?
            }
            None => config::Settings::default(),
        };
        let env = config::from_env(|var| std::env::var(var).ok());
        Ok((file, env, self.flags()?))
    }

    /// The keys the command line set, each named by its flag.
    fn flags(&self) -> Result<config::Settings, ArgsError> {
        let mut flags = config::Settings::default();
        let mut set = |key: &Key, value: Option<String>, flag: &str| {
            if let Some(v) = value {
                flags.set(key.name, v, &format!("flag {flag}"));
            }
        };
        if let Some(listen) = &self.listen {
            let (host, port) = listen
                .rsplit_once(':')
                .ok_or_else(|| ArgsError::Listen(listen.clone()))?;
            set(&KEY.listen_host, Some(host.to_owned()), "--listen");
            set(&KEY.listen_port, Some(port.to_owned()), "--listen");
        }
        set(&KEY.advertise, self.advertise.clone(), "--advertise");
        let text = |v: Option<u64>| v.map(|n| n.to_string());
        let path = |p: &Option<std::path::PathBuf>| p.as_ref().map(|p| p.display().to_string());
        set(&KEY.num_blocks, text(self.blocks), "--blocks");
        set(&KEY.block_len, text(self.block_len), "--block-len");
        set(&KEY.tcp_max_rate, text(self.tcp_max_rate), "--tcp-max-rate");
        set(
            &KEY.tcp_port,
            self.tcp_port.map(|p| p.to_string()),
            "--tcp-port",
        );
        set(&KEY.max_peers, text(self.max_peers), "--max-peers");
        set(&KEY.hash_seed, self.hash_seed.clone(), "--hash-seed");
        set(&KEY.shm_name, self.shm_name.clone(), "--shm-name");
        set(
            &KEY.plane,
            self.plane.map(|p| p.name().to_owned()),
            "--plane",
        );
        let allow = (!self.allow.is_empty()).then(|| self.allow.join(","));
        set(&KEY.allowlist, allow, "--allow");
        set(&KEY.tenant, self.tenant.clone(), "--tenant");
        let rules = (!self.tenant_rules.is_empty()).then(|| self.tenant_rules.join(","));
        set(&KEY.tenants, rules, "--tenant-rule");
        set(
            &KEY.disk_path,
            self.disk_path.as_ref().map(|p| p.display().to_string()),
            "--disk-path",
        );
        set(
            &KEY.disk_capacity,
            self.disk_capacity.clone(),
            "--disk-capacity",
        );
        set(
            &KEY.disk_promote,
            self.disk_promote.clone(),
            "--disk-promote",
        );
        set(&KEY.disk_threads, text(self.disk_threads), "--disk-threads");
        set(&KEY.disk_io, self.disk_io.clone(), "--disk-io");
        set(
            &KEY.bind_identity,
            self.bind_identity.map(|b| b.to_string()),
            "--bind-identity",
        );
        set(
            &KEY.shm_allow_replayable_tokens,
            self.shm_allow_replayable_tokens.map(|b| b.to_string()),
            "--shm-allow-replayable-tokens",
        );
        set(
            &KEY.tcp_block_digests,
            self.tcp_block_digests.map(|b| b.to_string()),
            "--tcp-block-digests",
        );
        set(
            &KEY.auth_secret_file,
            path(&self.auth_secret_file),
            "--auth-secret-file",
        );
        set(&KEY.tls, self.tls.clone(), "--tls");
        set(&KEY.tls_cert, path(&self.tls_cert), "--tls-cert");
        set(&KEY.tls_key, path(&self.tls_key), "--tls-key");
        set(&KEY.tls_ca, path(&self.tls_ca), "--tls-ca");
        set(
            &KEY.nixl_lib_dir,
            path(&self.nixl_lib_dir),
            "--nixl-lib-dir",
        );
        Ok(flags)
    }
}

impl PoolArgs {
    /// Adds the keys these flags set to `flags`, each named by its flag.
    fn flags(&self, flags: &mut config::Settings) {
        let mut set = |key: &Key, value: Option<String>, flag: &str| {
            if let Some(v) = value {
                flags.set(key.name, v, &format!("flag {flag}"));
            }
        };
        let text = |v: Option<u64>| v.map(|n| n.to_string());
        let follow = (!self.follow.is_empty()).then(|| self.follow.join(";"));
        set(&KEY.follow, follow, "--follow");
        set(
            &KEY.pull_min_holders,
            text(self.pull_min_holders),
            "--pull-min-holders",
        );
        set(
            &KEY.pull_max_rate,
            text(self.pull_max_rate),
            "--pull-max-rate",
        );
        set(
            &KEY.pull_max_lookups,
            text(self.pull_max_lookups),
            "--pull-max-lookups",
        );
        set(
            &KEY.publish_events,
            self.publish_events.clone(),
            "--publish-events",
        );
        set(
            &KEY.publish_replay,
            self.publish_replay.clone(),
            "--publish-replay",
        );
        set(
            &KEY.publish_topic,
            self.publish_topic.clone(),
            "--publish-topic",
        );
        set(
            &KEY.publish_hashes,
            self.publish_hashes.clone(),
            "--publish-hashes",
        );
        set(&KEY.pool_shard, self.shard.clone(), "--shard");
        set(
            &KEY.publish_ownership,
            self.publish_ownership.clone(),
            "--publish-ownership",
        );
    }
}

#[cfg(test)]
mod tests {
    use kvpeer::config::parse_rate;

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
