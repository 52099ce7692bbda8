//! [`NodeConfig::builder`]: a node's configuration from code, over the declared defaults
//! ([`keys`](super::keys)), checked by the same parser and bounds as a config file, so a builder
//! cannot make a configuration the command line would refuse. It reads neither the environment
//! nor any file; an embedder that wants them calls [`from_env`](super::from_env) /
//! [`from_toml`](super::from_toml) and [`resolve`](super::resolve).
//!
//! ```
//! use kvpeer::{NodeConfig, PlaneKind};
//!
//! # fn main() -> Result<(), kvpeer::config::ConfigError> {
//! let config = NodeConfig::builder("doc")
//!     .num_blocks(64)
//!     .plane(PlaneKind::Tcp)
//!     .allow("10.0.0.0/8")
//!     .build()?;
//! assert_eq!(config.spec.num_blocks, 64);
//! assert_eq!(config.spec.block_len, 65536, "the declared default");
//! assert!(NodeConfig::builder("doc").block_len(0).build().is_err());
//! # Ok(())
//! # }
//! ```

use super::NodeConfig;
use super::{resolve_one, ConfigError, Key, Settings, KEY};
use crate::node::plane::PlaneKind;

/// Where a builder's values come from, in errors, unless [`NodeConfigBuilder::source`] names
/// it.
const SOURCE: &str = "NodeConfig::builder";

/// Settings for one node, each unset one at its default; [`build`](Self::build) checks them.
#[derive(Debug, Clone)]
#[must_use]
pub struct NodeConfigBuilder {
    tag: String,
    source: String,
    settings: Settings,
    allow: Vec<String>,
}

impl NodeConfig {
    /// A builder whose unset settings are the declared defaults (docs/configuration.md); `tag`
    /// names the pool's shm object (with the process id).
    pub fn builder(tag: &str) -> NodeConfigBuilder {
        NodeConfigBuilder {
            tag: tag.to_owned(),
            source: SOURCE.to_owned(),
            settings: Settings::default(),
            allow: Vec::new(),
        }
    }

    /// Every setting at its default, as [`NodeConfig::local`].
    pub(crate) fn defaults(tag: &str) -> NodeConfig {
        match NodeConfig::builder(tag).build() {
            Ok(c) => c,
            // The defaults are constants of this crate, resolved by a unit test.
            Err(e) => unreachable!("the declared defaults resolve: {e}"),
        }
    }
}

impl NodeConfigBuilder {
    /// What errors name as the values' source (`"kvpeer.Node settings"`, an embedder's own
    /// config section): the caller's words for where its user wrote them. Set it first: it
    /// applies to the values set after it.
    pub fn source(mut self, name: &str) -> Self {
        self.source = name.to_owned();
        self
    }

    fn put(mut self, key: &Key, value: impl ToString) -> Self {
        self.settings.set(key.name, value.to_string(), &self.source);
        self
    }

    /// Sets any key by its name in config files (`"idle_timeout_s"`, ...), as text; an
    /// unknown key or a bad value fails [`build`](Self::build).
    pub fn set(mut self, key: &str, value: impl ToString) -> Self {
        self.settings.set(key, value.to_string(), &self.source);
        self
    }

    /// The control channel's host and port (the node's identity; port 0 picks a free one).
    pub fn listen(self, host: &str, port: u16) -> Self {
        self.put(&KEY.listen_host, host).put(&KEY.listen_port, port)
    }

    /// Blocks in the pool.
    pub fn num_blocks(self, blocks: u64) -> Self {
        self.put(&KEY.num_blocks, blocks)
    }

    /// Bytes per block; peers must agree.
    pub fn block_len(self, bytes: u64) -> Self {
        self.put(&KEY.block_len, bytes)
    }

    /// The data planes.
    pub fn plane(self, plane: PlaneKind) -> Self {
        self.put(&KEY.plane, plane.name())
    }

    /// The prefix-cache hash seed; peers must agree.
    pub fn hash_seed(self, seed: &str) -> Self {
        self.put(&KEY.hash_seed, seed)
    }

    /// The model configuration fingerprint ("" matches anything).
    pub fn config_fingerprint(self, fingerprint: &str) -> Self {
        self.put(&KEY.config_fingerprint, fingerprint)
    }

    /// A cap on the tcp plane's bytes per second to each peer.
    pub fn tcp_max_rate(self, bytes_per_second: u64) -> Self {
        self.put(&KEY.tcp_max_rate, bytes_per_second)
    }

    /// Whether peers writing to this node over tcp send a CRC-32C per block, checked as it
    /// lands (a corrupted block fails its load).
    pub fn tcp_block_digests(self, on: bool) -> Self {
        self.put(&KEY.tcp_block_digests, on)
    }

    /// Whether the shm plane also accepts tokens not bound to a connection's challenge (for
    /// peers that cannot read it; replayable: docs/security.md, "Fresh proofs").
    pub fn shm_allow_replayable_tokens(self, allow: bool) -> Self {
        self.put(&KEY.shm_allow_replayable_tokens, allow)
    }

    /// Most sessions at once.
    pub fn max_peers(self, peers: u64) -> Self {
        self.put(&KEY.max_peers, peers)
    }

    /// Adds an allowlist rule (CIDR, host or host:port); with none, every peer is allowed.
    pub fn allow(mut self, rule: &str) -> Self {
        self.allow.push(rule.to_owned());
        self
    }

    /// The configuration, or the first setting that is out of bounds or not understood.
    pub fn build(mut self) -> Result<NodeConfig, ConfigError> {
        if !self.allow.is_empty() {
            let rules = self.allow.join(",");
            self = self.put(&KEY.allowlist, rules);
        }
        resolve_one(&self.settings, &self.tag)
    }
}
