//! Node configuration from four sources, with precedence flag > environment > file > default.
//!
//! * **Keys**: declared once, in [`keys`] (name, default, environment variable, meaning); the
//!   file's serde struct, the environment's reader, the defaults and the flags' help come from
//!   that list.
//! * **File**: TOML (`--config FILE`), flat keys; any other key is refused, and a syntax error
//!   names its line and column. A `[fingerprint_fields]` table computes `config_fingerprint`
//!   vLLM's way ([`fingerprint`]).
//! * **Environment**: the variables vLLM users know (`VLLM_P2P_SIDE_CHANNEL_HOST`, `_PORT`,
//!   `VLLM_P2P_MAX_PEERS`, `VLLM_P2P_HANDSHAKE_TIMEOUT_S`, `VLLM_P2P_IDLE_TIMEOUT_S`,
//!   `PYTHONHASHSEED`).
//! * **Flags**: whatever the command line set ([`Settings`] with only those keys); embedders
//!   use [`NodeConfig::builder`] instead.
//!
//! Every source's values are text checked by one parser in [`resolve`], before anything
//! starts: an unknown key, a wrong type or an out-of-range value is an error naming the key and
//! where it came from.

mod builder;
mod fingerprint;
mod identity;
pub mod keys;
mod node_config;
pub(crate) mod pool_node;

use std::time::Duration;

use crate::node::allow::Allowlist;
use crate::node::build::{NixlOptions, NodeSpec};
use crate::node::plane::PlaneKind;
use kvpeer_core::CoreConfig;
use kvpeer_net::control::{ControlConfig, SiblingGroup};
use kvpeer_net::tls::{TlsFiles, TlsPolicy};
use kvpeer_proto::{DecodeLimits, PeerId};
use pool_node::{endpoint, parse_follow};

pub use builder::NodeConfigBuilder;
pub use fingerprint::fingerprint;
pub use keys::{Key, Settings, KEY, KEYS, VLLM_DEFAULT_HASH_SEED};
pub use node_config::NodeConfig;
pub use pool_node::{FollowSpec, PoolConfig};

/// A configuration error: which key, from where, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}: {key}: {problem}")]
pub struct ConfigError {
    /// Where the value came from (`file kvpeer.toml`, `env VLLM_P2P_MAX_PEERS`, `flag`).
    pub source_name: String,
    /// The key; for a file that is not valid TOML, where the fault is (`line 2, column 13`).
    pub key: String,
    /// What is wrong.
    pub problem: String,
}

/// The settings a TOML file holds (`file` names it in errors).
pub fn from_toml(text: &str, file: &str) -> Result<Settings, ConfigError> {
    let source = format!("file {file}");
    let mut out: Settings = toml::from_str(text).map_err(|e| toml_error(text, &source, &e))?;
    out.set_source(&source);
    // The keys that hold several items take an array of them as well as their text form.
    let list_keys = [
        KEY.allowlist.name,
        KEY.tenants.name,
        KEY.follow.name,
        KEY.pool_shard.name,
    ];
    // A list key given one value that is not text (`allowlist = 1`) is no rule either.
    for key in list_keys {
        if out.setting(key).is_some_and(|s| !s.list && !s.text) {
            return Err(bad(
                &source,
                key,
                "expected a string or a list of strings (\"10.0.0.0/8\")".into(),
            ));
        }
    }
    for (key, all_text) in out.lists() {
        if !list_keys.contains(&key) {
            return Err(bad(
                &source,
                key,
                "expected a string or a number, got an array".into(),
            ));
        }
        if !all_text {
            return Err(bad(
                &source,
                key,
                "a list's items are strings (\"10.0.0.0/8\"), not numbers or booleans".into(),
            ));
        }
    }
    if let Some(fields) = out.take_fingerprint_fields() {
        out.set(
            KEY.config_fingerprint.name,
            fingerprint::of_table(&fields),
            &source,
        );
    }
    Ok(out)
}

/// `tcp_port`: a port, never the control port itself (the node would fail to bind it, and a
/// service manager would restart it forever: a configuration error exits 2 instead).
fn tcp_port(s: &Values<'_>, control_port: u64) -> Result<u16, ConfigError> {
    let port = s.number(&KEY.tcp_port, 0, u64::from(u16::MAX))?;
    if port != 0 && port == control_port {
        let src = s.get(&KEY.tcp_port).map_or("default", |(_, src)| src);
        return Err(bad(
            src,
            KEY.tcp_port.name,
            format!("{port} is the control port (listen_port): give the data plane another"),
        ));
    }
    Ok(port as u16)
}

/// "unknown key", with the declared key it most likely meant (a typo: at most two edits, or a
/// third of its length).
fn unknown_key(key: &str) -> String {
    let best = KEYS
        .iter()
        .map(|k| (strsim::damerau_levenshtein(key, k.name), k.name))
        .min();
    match best {
        Some((edits, name)) if edits <= 2.max(key.len() / 3) => {
            format!("unknown key; did you mean {name}?")
        }
        _ => "unknown key (docs/configuration.md lists every key)".to_owned(),
    }
}

/// A TOML or serde error as a [`ConfigError`]: the key it is about (an unknown key, or the key
/// on the line of a value of the wrong type), else its line and column.
fn toml_error(text: &str, source: &str, e: &toml::de::Error) -> ConfigError {
    // One line, as every configuration error is.
    let message = e.message().trim_end().replace('\n', "; ");
    let message = message.as_str();
    // serde's wording for a key `deny_unknown_fields` refuses.
    if let Some(rest) = message.strip_prefix("unknown field `") {
        if let Some((key, _)) = rest.split_once('`') {
            return bad(source, key, unknown_key(key));
        }
    }
    let Some(span) = e.span() else {
        return bad(source, "(file)", message.to_owned());
    };
    let start = span.start.min(text.len());
    let before = text.get(..start).unwrap_or("");
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = before.matches('\n').count() + 1;
    let column = before[line_start..].chars().count() + 1;
    // A value of the wrong type: its span is the value, which follows `key =` on its line.
    let key = before[line_start..]
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"'))
        .filter(|k| KEYS.iter().any(|d| d.name == *k) || *k == "fingerprint_fields");
    match key {
        Some(key) => bad(
            source,
            key,
            format!("{message} (line {line}, column {column})"),
        ),
        None => bad(
            source,
            &format!("line {line}, column {column}"),
            message.to_owned(),
        ),
    }
}

/// The settings the environment holds (`lookup` reads one variable).
pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Settings {
    let mut out = Settings::default();
    for key in KEYS {
        if let Some(var) = key.env {
            if let Some(v) = lookup(var) {
                out.set(key.name, v, &format!("env {var}"));
            }
        }
    }
    out
}

/// Resolves defaults < file < env < flags into a node configuration; `tag` names the pool's
/// shm object (with the process id).
pub fn resolve(
    file: &Settings,
    env: &Settings,
    flags: &Settings,
    tag: &str,
) -> Result<NodeConfig, ConfigError> {
    let mut merged = file.clone();
    merged.merge(env);
    merged.merge(flags);
    resolve_one(&merged, tag)
}

/// `host_probe_timeout_ms`: 0 (off), or long enough for a live host's kernel to acknowledge a
/// PING (Linux delays an ACK up to 200 ms).
fn probe_timeout(s: &Values<'_>) -> Result<Duration, ConfigError> {
    let ms = s.number(&KEY.host_probe_timeout_ms, 0, 3_600_000)?;
    if ms != 0 && ms < MIN_PROBE_MS {
        let src = s.get(&KEY.host_probe_timeout_ms).map_or("", |(_, src)| src);
        return Err(bad(
            src,
            "host_probe_timeout_ms",
            format!(
                "{ms} ms is shorter than a live host may take to acknowledge a probe (its \
                 kernel delays an ACK up to 200 ms): at least {MIN_PROBE_MS}, or 0 for off"
            ),
        ));
    }
    Ok(Duration::from_millis(ms))
}

/// The shortest probe timeout: above Linux's longest delayed ACK (200 ms).
const MIN_PROBE_MS: u64 = 250;

/// A shared-memory object's name as `shm_open` takes it without its `/`: 1 to 200 bytes of
/// letters, digits, `-`, `_` and `.`, not starting with `.` and not ending in `.fence` (the
/// pool's fence words take that name).
fn shm_object_name(name: &str) -> Result<&str, String> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && !name.starts_with('.')
        && !name.ends_with(".fence")
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(name)
    } else {
        Err(format!(
            "{name:?} is no shared-memory object name: 1 to 200 letters, digits, '-', '_' or '.', \
             not starting with '.' nor ending in .fence"
        ))
    }
}

/// The engine's ranks on this host this node tells of lost hosts: `liveness_group` (its
/// name) with `liveness_rank` (`INDEX/MEMBERS`), both or neither.
fn liveness_group(s: &Values<'_>) -> Result<Option<SiblingGroup>, ConfigError> {
    let (name, rank) = match (s.get(&KEY.liveness_group), s.get(&KEY.liveness_rank)) {
        (None, None) => return Ok(None),
        (Some((name, _)), Some(rank)) => (name, rank),
        (Some((_, src)), None) => {
            return Err(bad(
                src,
                "liveness_group",
                "needs liveness_rank (INDEX/MEMBERS) too".into(),
            ))
        }
        (None, Some((_, src))) => {
            return Err(bad(src, "liveness_rank", "needs liveness_group too".into()))
        }
    };
    let (rank, src) = rank;
    let parsed = rank
        .split_once('/')
        .and_then(|(i, n)| Some((i.trim().parse::<u32>().ok()?, n.trim().parse::<u32>().ok()?)));
    let Some((index, members)) = parsed else {
        return Err(bad(
            src,
            "liveness_rank",
            format!("{rank:?} is not INDEX/MEMBERS (e.g. 0/8)"),
        ));
    };
    SiblingGroup::new(name, index, members)
        .map(Some)
        .map_err(|why| bad(src, "liveness_rank", why))
}

/// [`resolve`] over one set of settings (the sources already merged).
pub(crate) fn resolve_one(set: &Settings, tag: &str) -> Result<NodeConfig, ConfigError> {
    if let Some((key, source)) = set.unknown() {
        return Err(bad(source, key, unknown_key(key)));
    }
    let s = Values(set);
    let port: u64 = s.number(&KEY.listen_port, 0, u64::from(u16::MAX))?;
    let secs = |key: &Key, min: u64| -> Result<Duration, ConfigError> {
        s.number(key, min, 86_400 * 365).map(Duration::from_secs)
    };
    let core = CoreConfig {
        max_peers: s.number(&KEY.max_peers, 1, 1 << 20)? as usize,
        max_peers_per_host: s.number(&KEY.max_peers_per_host, 1, 1 << 20)? as usize,
        handshake_timeout: secs(&KEY.handshake_timeout_s, 1)?,
        idle_timeout: secs(&KEY.idle_timeout_s, 0)?,
        lookup_timeout: secs(&KEY.lookup_timeout_s, 1)?,
        load_timeout: secs(&KEY.load_timeout_s, 1)?,
        pd_load_timeout: secs(&KEY.pd_load_timeout_s, 1)?,
        store_timeout: secs(&KEY.store_timeout_s, 1)?,
        abort_ack_timeout: secs(&KEY.abort_ack_timeout_s, 1)?,
        lookup_pending_timeout: secs(&KEY.lookup_pending_timeout_s, 1)?,
        unbound_store_timeout: secs(&KEY.unbound_store_timeout_s, 1)?,
        peer_fault_drain: secs(&KEY.peer_fault_drain_s, 1)?,
        transfer_stall_timeout: s.seconds_or_off(&KEY.transfer_stall_timeout_s)?,
        retained_hold_cap: secs(&KEY.retained_hold_cap_s, 1)?,
        max_lookup_keys: s.number(&KEY.max_lookup_keys, 1, 1 << 24)? as usize,
        lookup_slice_keys: s.number(&KEY.lookup_slice_keys, 1, 1 << 24)? as usize,
        lookup_keys_per_sec: s.number(&KEY.lookup_keys_per_s, 1, 1 << 40)?,
        max_pins_per_peer: match s.get(&KEY.max_pins_per_peer) {
            None => None,
            Some(_) => Some(s.number(&KEY.max_pins_per_peer, 1, u64::from(u32::MAX))? as usize),
        },
        max_pinned_blocks: match s.get(&KEY.max_pinned_blocks) {
            None => None,
            Some(_) => Some(s.number(&KEY.max_pinned_blocks, 1, u64::from(u32::MAX))? as usize),
        },
        pin_eviction_min_age: Duration::from_millis(s.number(
            &KEY.pin_eviction_min_age_ms,
            0,
            3_600_000,
        )?),
        max_held_keys_per_peer: s.number(&KEY.max_held_keys_per_peer, 1, 1 << 32)? as usize,
        max_held_bytes_per_peer: s.number(&KEY.max_held_bytes_per_peer, 1024, 1 << 44)? as usize,
        max_held_bytes: s.number(&KEY.max_held_bytes, 1024, 1 << 46)? as usize,
        max_requests_per_peer: s.number(&KEY.max_requests_per_peer, 1, 1 << 24)? as usize,
        max_peer_blocks: s.number(&KEY.max_peer_blocks, 1, 1 << 40)?,
        ..CoreConfig::default()
    };
    let caps = Caps::for_sessions(core.max_peers, core.max_peers_per_host);
    let max_message = s.number(&KEY.max_message_bytes, 1024, 1 << 31)?;
    let limits = DecodeLimits {
        max_payload_bytes: max_message as usize,
        max_list_len: s.number(&KEY.max_keys_per_message, 1, 1 << 24)? as usize,
        ..DecodeLimits::default()
    };
    let heartbeat_timeout =
        Duration::from_millis(s.number(&KEY.heartbeat_timeout_ms, 10, 3_600_000)?);
    let control = ControlConfig {
        max_message_bytes: max_message as i64,
        send_queue_bytes: s.number(&KEY.send_queue_bytes, 1024, 1 << 40)? as usize,
        max_inbound: match s.get(&KEY.max_inbound_connections) {
            Some(_) => s.number(&KEY.max_inbound_connections, 1, 1 << 20)? as usize,
            None => caps.inbound,
        },
        max_inbound_per_source: match s.get(&KEY.max_inbound_per_source) {
            Some(_) => s.number(&KEY.max_inbound_per_source, 1, 1 << 20)? as usize,
            None => caps.inbound_per_source,
        },
        inbound_read_budget: s.number(&KEY.inbound_read_budget, 1024, 1 << 30)? as usize,
        inbound_messages_per_round: s.number(&KEY.inbound_messages_per_round, 1, 1 << 20)? as usize,
        inbound_accepts_per_round: s.number(&KEY.inbound_accepts_per_round, 1, 1 << 20)? as usize,
        inbound_round_quantum: Duration::from_micros(s.number(
            &KEY.inbound_round_quantum_us,
            1,
            1_000_000,
        )?),
        inbound_time_per_second: Duration::from_millis(s.number(&KEY.inbound_ms_per_s, 1, 1000)?),
        heartbeat_interval: Duration::from_millis(s.number(
            &KEY.heartbeat_interval_ms,
            10,
            3_600_000,
        )?),
        heartbeat_timeout,
        // The TTL our PINGs tell the peer: how long it may wait for us, as long as we wait.
        heartbeat_ttl: heartbeat_timeout,
        host_probe_timeout: probe_timeout(&s)?,
        host_down_hold: Duration::from_millis(s.number(&KEY.host_down_hold_ms, 0, 3_600_000)?),
        siblings: liveness_group(&s)?,
        ..ControlConfig::default()
    };
    let plane: PlaneKind = s.parsed(&KEY.plane)?;
    let nixl = NixlOptions {
        lib_dir: s.get(&KEY.nixl_lib_dir).map(|(v, _)| v.into()),
        backend_params: match s.get(&KEY.nixl_backend_params) {
            None => Vec::new(),
            Some((v, src)) => v
                .split(',')
                .filter(|kv| !kv.trim().is_empty())
                .map(|kv| match kv.split_once('=') {
                    Some((k, v)) if !k.trim().is_empty() => {
                        Ok((k.trim().to_owned(), v.trim().to_owned()))
                    }
                    _ => Err(bad(
                        src,
                        "nixl_backend_params",
                        format!("{kv:?} is not key=value"),
                    )),
                })
                .collect::<Result<_, _>>()?,
        },
    };
    let tcp_max_write_rate = match s.get(&KEY.tcp_max_rate) {
        None => None,
        Some(_) => Some(s.rate(&KEY.tcp_max_rate)?),
    };
    let identity::Identity {
        id,
        listen,
        tcp_listen,
    } = identity::identity(&s, port as u16, tcp_port(&s, port)?)?;
    Ok(NodeConfig {
        spec: NodeSpec {
            id,
            listen,
            plane,
            num_blocks: s.number(&KEY.num_blocks, 1, u64::from(u32::MAX) - 1)?,
            block_len: s.number(&KEY.block_len, 1, 1 << 30)?,
            shm_name: match s.get(&KEY.shm_name) {
                None => format!("kvpeer-{tag}-{}", std::process::id()),
                Some((name, src)) => shm_object_name(name)
                    .map_err(|why| bad(src, "shm_name", why))?
                    .to_owned(),
            },
            tcp_listen,
            tcp_max_write_rate,
            tcp_block_digests: s.boolean(&KEY.tcp_block_digests)?,
            tcp_min_write_rate: s.rate(&KEY.tcp_min_rate)?,
            tcp_max_connections: match s.get(&KEY.tcp_max_connections) {
                Some(_) => s.number(&KEY.tcp_max_connections, 1, 1 << 20)? as usize,
                None => caps.tcp_connections,
            },
            tcp_transfer_timeout: secs(&KEY.tcp_transfer_timeout_s, 1)?,
            hash_seed: s.text(&KEY.hash_seed),
            config_fingerprint: s.text(&KEY.config_fingerprint),
            core,
            allowlist: allowlist(&s)?,
            tenants: tenants(&s)?,
            bind_identity: s.boolean(&KEY.bind_identity)?,
            shm_allow_replayable_tokens: s.boolean(&KEY.shm_allow_replayable_tokens)?,
            auth_secret: auth_secret(&s)?.map(crate::node::build::AuthSecret::from),
            tls: tls(&s)?,
            control,
            limits,
            nixl,
            disk: disk(&s)?,
        },
        pool: pool(&s)?,
    })
}

/// The connection caps a number of sessions needs, when the configuration does not set them:
/// the one place they follow `max_peers` (docs/scaling.md, "Many peers"), so that raising it
/// is enough for the node to hold that many sessions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Caps {
    /// Inbound control connections in all: each session's peer holds one, and a peer that
    /// reconnects briefly holds two.
    pub(crate) inbound: usize,
    /// Inbound control connections from one source address.
    pub(crate) inbound_per_source: usize,
    /// tcp data connections into the node: at most one per writing peer.
    pub(crate) tcp_connections: usize,
}

impl Caps {
    /// The caps for `max_peers` sessions, `per_host` of them from one host.
    pub(crate) fn for_sessions(max_peers: usize, per_host: usize) -> Self {
        Caps {
            inbound: (2 * max_peers + 64).max(1024),
            inbound_per_source: (2 * per_host).max(64),
            tcp_connections: (max_peers + 64).max(256),
        }
    }
}

fn pool(s: &Values<'_>) -> Result<PoolConfig, ConfigError> {
    let follow = match s.get(&KEY.follow) {
        None => Vec::new(),
        Some((v, src)) => parse_follow(v).map_err(|e| bad(src, KEY.follow.name, e))?,
    };
    let endpoint_of = |key: &Key| -> Result<Option<std::net::SocketAddr>, ConfigError> {
        s.get(key)
            .map(|(v, src)| endpoint(v, true).map_err(|e| bad(src, key.name, e)))
            .transpose()
    };
    let max_rate = match s.get(&KEY.pull_max_rate) {
        None => None,
        Some(_) => Some(s.rate(&KEY.pull_max_rate)?),
    };
    let config = PoolConfig {
        follow,
        min_holders: s.number(
            &KEY.pull_min_holders,
            1,
            kvpeer_pool::EngineSlot::MAX as u64,
        )? as u32,
        max_rate,
        max_lookups: s.number(&KEY.pull_max_lookups, 1, 1 << 20)?,
        publish: endpoint_of(&KEY.publish_events)?,
        publish_replay: endpoint_of(&KEY.publish_replay)?,
        topic: s.text(&KEY.publish_topic),
        ownership: Some(s.text(&KEY.publish_ownership).trim().to_owned()).filter(|o| !o.is_empty()),
        shard: match s.get(&KEY.pool_shard) {
            None => Vec::new(),
            Some((text, src)) => {
                let mut members = Vec::new();
                for m in text
                    .split([',', '\n'])
                    .map(str::trim)
                    .filter(|m| !m.is_empty())
                {
                    let id = PeerId::new(m);
                    if id.host_port().is_err() {
                        return Err(bad(
                            src,
                            KEY.pool_shard.name,
                            format!("{m:?} is not HOST:PORT"),
                        ));
                    }
                    let same = |o: &PeerId| {
                        kvpeer_pool::shard::canonical(o.as_str())
                            == kvpeer_pool::shard::canonical(id.as_str())
                    };
                    if members.iter().any(same) {
                        return Err(bad(
                            src,
                            KEY.pool_shard.name,
                            format!("{m:?} is listed twice"),
                        ));
                    }
                    members.push(id);
                }
                members
            }
        },
        hash_form: match s.text(&KEY.publish_hashes).trim() {
            "bytes" => kvpeer_pool::HashForm::Bytes,
            "int" => kvpeer_pool::HashForm::Int,
            other => {
                let src = s.get(&KEY.publish_hashes).map_or("default", |(_, src)| src);
                return Err(bad(
                    src,
                    KEY.publish_hashes.name,
                    format!("{other:?} is not bytes or int"),
                ));
            }
        },
        max_event_subscribers: s.number(&KEY.max_event_subscribers, 1, 1 << 20)? as usize,
        max_event_replay_clients: s.number(&KEY.max_event_replay_clients, 1, 1 << 20)? as usize,
        max_event_per_source: s.number(&KEY.max_event_per_source, 1, 1 << 20)? as usize,
    };
    if config.follow.len() > kvpeer_pool::EngineSlot::MAX {
        let src = s.get(&KEY.follow).map_or("default", |(_, src)| src);
        return Err(bad(
            src,
            KEY.follow.name,
            format!(
                "at most {} engines per pool node",
                kvpeer_pool::EngineSlot::MAX
            ),
        ));
    }
    if config.publish_replay.is_some() && config.publish.is_none() {
        let src = s.get(&KEY.publish_replay).map_or("default", |(_, src)| src);
        return Err(bad(
            src,
            KEY.publish_replay.name,
            "needs publish_events".into(),
        ));
    }
    Ok(config)
}

/// The merged settings, read key by key with each key's declared default.
struct Values<'a>(&'a Settings);

impl Values<'_> {
    /// The value a source set, with its source.
    fn get(&self, key: &Key) -> Option<(&str, &str)> {
        self.0.get(key.name)
    }

    /// The value a source set, else the default (`None`: neither).
    fn value(&self, key: &Key) -> Option<(&str, &str)> {
        self.get(key).or(key.default.map(|d| (d, "default")))
    }

    fn text(&self, key: &Key) -> String {
        self.value(key)
            .map_or_else(String::new, |(v, _)| v.to_owned())
    }

    fn number(&self, key: &Key, min: u64, max: u64) -> Result<u64, ConfigError> {
        let Some((v, src)) = self.value(key) else {
            return Err(bad("default", key.name, "no value".into()));
        };
        let n: u64 = v
            .trim()
            .parse()
            .map_err(|_| bad(src, key.name, format!("{v:?} is not a whole number")))?;
        if n < min || n > max {
            return Err(bad(src, key.name, format!("{n} is outside {min}..={max}")));
        }
        Ok(n)
    }

    /// Seconds as vLLM reads its float variables (`VLLM_P2P_TRANSFER_STALL_TIMEOUT_S`:
    /// `20`, `20.0`, `0.5`), zero or less meaning off (a zero duration), at most a year.
    fn seconds_or_off(&self, key: &Key) -> Result<Duration, ConfigError> {
        let Some((v, src)) = self.value(key) else {
            return Err(bad("default", key.name, "no value".into()));
        };
        let secs: f64 = v
            .trim()
            .parse()
            .map_err(|_| bad(src, key.name, format!("{v:?} is not a number of seconds")))?;
        if secs.is_nan() || secs > 86_400.0 * 365.0 {
            return Err(bad(
                src,
                key.name,
                format!("{v:?} is not 0..=31536000 seconds"),
            ));
        }
        Ok(Duration::from_secs_f64(secs.max(0.0)))
    }

    /// A rate in bytes per second: a whole number, or one with a suffix K, M or G (powers of
    /// 1000), in a file, the environment and flags alike.
    fn rate(&self, key: &Key) -> Result<u64, ConfigError> {
        let Some((v, src)) = self.value(key) else {
            return Err(bad("default", key.name, "no value".into()));
        };
        parse_rate(v.trim()).map_err(|e| bad(src, key.name, e))
    }

    fn parsed<T: std::str::FromStr<Err = String>>(&self, key: &Key) -> Result<T, ConfigError> {
        let Some((v, src)) = self.value(key) else {
            return Err(bad("default", key.name, "no value".into()));
        };
        v.parse().map_err(|e| bad(src, key.name, e))
    }

    fn boolean(&self, key: &Key) -> Result<bool, ConfigError> {
        let Some((v, src)) = self.value(key) else {
            return Err(bad("default", key.name, "no value".into()));
        };
        match v.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            other => Err(bad(
                src,
                key.name,
                format!("{other:?} is not true or false"),
            )),
        }
    }
}

/// The disk tier: `disk_path` turns it on and needs `disk_capacity`.
fn disk(s: &Values<'_>) -> Result<Option<kvpeer_store::disk::DiskConfig>, ConfigError> {
    let Some((dir, _)) = s.get(&KEY.disk_path) else {
        if let Some((_, src)) = s.get(&KEY.disk_capacity) {
            return Err(bad(
                src,
                KEY.disk_capacity.name,
                "set without disk_path".into(),
            ));
        }
        return Ok(None);
    };
    if s.get(&KEY.disk_capacity).is_none() {
        return Err(bad(
            "default",
            KEY.disk_capacity.name,
            "disk_path is set: say how many bytes the disk tier may use".into(),
        ));
    }
    Ok(Some(kvpeer_store::disk::DiskConfig {
        dir: std::path::PathBuf::from(dir),
        capacity: s.rate(&KEY.disk_capacity)?,
        threads: s.number(&KEY.disk_threads, 1, 256)? as usize,
        promote: s.parsed(&KEY.disk_promote)?,
        engine: s.parsed(&KEY.disk_io)?,
        // Filled where the node is built, from the `tenants` rules.
        tenant_names: Vec::new(),
        default_tenant: String::new(),
    }))
}

fn allowlist(s: &Values<'_>) -> Result<Allowlist, ConfigError> {
    let Some((v, src)) = s.get(&KEY.allowlist) else {
        return Ok(Allowlist::default());
    };
    let rules: Vec<&str> = v
        .split([',', '\n'])
        .filter(|r| !r.trim().is_empty())
        .collect();
    Allowlist::parse(&rules).map_err(|e| bad(src, "allowlist", e.to_string()))
}

fn tenants(s: &Values<'_>) -> Result<crate::node::tenants::TenantRules, ConfigError> {
    let own = s.get(&KEY.tenant);
    let rules = s.get(&KEY.tenants);
    let src = rules.or(own).map_or("", |(_, src)| src);
    let rules: Vec<&str> = rules.map_or(Vec::new(), |(v, _)| {
        v.split([',', '\n'])
            .filter(|r| !r.trim().is_empty())
            .collect()
    });
    crate::node::tenants::TenantRules::parse(own.map(|(v, _)| v), &rules).map_err(|e| {
        let key = match e {
            crate::node::tenants::TenantsError::NoRules(_)
            | crate::node::tenants::TenantsError::OwnShared => "tenant",
            _ => "tenants",
        };
        bad(src, key, e.to_string())
    })
}

/// The TLS policy and, where it is on, its three files (each needed: named when missing).
fn tls(s: &Values<'_>) -> Result<Option<crate::node::build::TlsSpec>, ConfigError> {
    let Some((policy, src)) = s.value(&KEY.tls) else {
        return Ok(None);
    };
    let policy = TlsPolicy::parse(policy.trim()).ok_or_else(|| {
        bad(
            src,
            "tls",
            format!("{policy:?} is not off, preferred or required"),
        )
    })?;
    if policy == TlsPolicy::Off {
        return Ok(None);
    }
    let file = |key: &Key| -> Result<std::path::PathBuf, ConfigError> {
        match s.get(key) {
            Some((path, _)) => Ok(path.into()),
            None => Err(bad(
                src,
                key.name,
                format!("tls is {:?}, which needs {}", policy.as_str(), key.name),
            )),
        }
    };
    Ok(Some(crate::node::build::TlsSpec {
        policy,
        files: TlsFiles {
            cert: file(&KEY.tls_cert)?,
            key: file(&KEY.tls_key)?,
            ca: file(&KEY.tls_ca)?,
        },
    }))
}

fn auth_secret(s: &Values<'_>) -> Result<Option<Vec<u8>>, ConfigError> {
    let Some((path, src)) = s.get(&KEY.auth_secret_file) else {
        return Ok(None);
    };
    let bytes = std::fs::read(path).map_err(|e| {
        bad(
            src,
            "auth_secret_file",
            format!("cannot read {path:?}: {e}"),
        )
    })?;
    // As ssh does for its keys: a secret others may read is no secret; a group that may read it
    // may be deliberate (the engines' service group), so that is said, not refused.
    if let Ok(meta) = std::fs::metadata(path) {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o004 != 0 {
            return Err(bad(
                src,
                "auth_secret_file",
                format!(
                    "{path:?} can be read by every user (mode {mode:04o}): `chmod 600` it \
                     (or 640 for a service group)"
                ),
            ));
        }
        if mode & 0o040 != 0 {
            tracing::warn!(
                path = %path,
                mode = %format_args!("{mode:04o}"),
                "the auth secret can be read by the file's group; every member can join the fleet"
            );
        }
    }
    let secret = bytes.trim_ascii().to_vec();
    if secret.len() < 16 {
        return Err(bad(
            src,
            "auth_secret_file",
            format!(
                "{path:?} holds {} bytes; at least 16 are needed",
                secret.len()
            ),
        ));
    }
    Ok(Some(secret))
}

fn bad(source: &str, key: &str, problem: String) -> ConfigError {
    ConfigError {
        source_name: source.to_owned(),
        key: key.to_owned(),
        problem,
    }
}

/// `100M` → 100,000,000 bytes per second (suffixes K, M, G: powers of 1000); a plain number is
/// bytes. Zero is no rate.
pub fn parse_rate(text: &str) -> Result<u64, String> {
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
    use super::*;

    #[test]
    fn the_connection_caps_follow_max_peers_unless_set() {
        let mut set = Settings::default();
        set.set("max_peers", "4096", "t");
        let c = resolve_one(&set, "t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.spec.control.max_inbound, 2 * 4096 + 64);
        assert_eq!(c.spec.control.max_inbound_per_source, 64);
        assert_eq!(c.spec.tcp_max_connections, 4096 + 64);
        set.set("max_peers_per_host", "4096", "t");
        set.set("max_inbound_connections", "500", "t");
        set.set("tcp_max_connections", "300", "t");
        let c = resolve_one(&set, "t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.spec.control.max_inbound, 500, "a value set wins");
        assert_eq!(c.spec.control.max_inbound_per_source, 2 * 4096);
        assert_eq!(c.spec.tcp_max_connections, 300);
        // The defaults of a default node are what they always were.
        let d = resolve_one(&Settings::default(), "t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(d.spec.control.max_inbound, 1024);
        assert_eq!(d.spec.control.max_inbound_per_source, 64);
        assert_eq!(d.spec.tcp_max_connections, 256);
    }

    /// The declared defaults are the ones the core and the decoder were written with (vLLM's),
    /// so a node and a bare core agree; and they all resolve.
    #[test]
    fn the_declared_defaults_resolve_to_the_cores_own() {
        let c = resolve_one(&Settings::default(), "t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.spec.core, CoreConfig::default());
        assert_eq!(c.spec.limits, DecodeLimits::default());
        assert_eq!(c.spec.control, ControlConfig::default());
        assert_eq!(c.spec.nixl, NixlOptions::default());
        assert_eq!(c.spec.plane, PlaneKind::default());
        assert!(c.spec.allowlist.allows_all() && c.spec.bind_identity);
        assert_eq!(c.spec.tcp_max_write_rate, None);
        assert!(!c.spec.tcp_block_digests, "digests are off by default");
        let tcp = kvpeer_net::data::tcp::TcpLimits::default();
        assert_eq!(c.spec.tcp_min_write_rate, tcp.min_write_rate);
        assert_eq!(c.spec.tcp_transfer_timeout, tcp.transfer_timeout);
        assert_eq!(c.spec.auth_secret, None);
        // The pool node's event sockets: the publisher's own defaults.
        let publisher = kvpeer_net::events::PublisherConfig::new(([127, 0, 0, 1], 0).into());
        let pool = PoolConfig::default();
        for (resolved, declared, publishers) in [
            (
                c.pool.max_event_subscribers,
                pool.max_event_subscribers,
                publisher.max_subscribers,
            ),
            (
                c.pool.max_event_replay_clients,
                pool.max_event_replay_clients,
                publisher.max_replay_clients,
            ),
            (
                c.pool.max_event_per_source,
                pool.max_event_per_source,
                publisher.max_per_source,
            ),
        ] {
            assert_eq!((resolved, declared), (publishers, publishers));
        }
    }

    /// Each fair-share key of the listener and the pins reaches what it configures (a key that
    /// is declared but never read would leave the default).
    #[test]
    fn the_round_budget_pin_and_event_socket_keys_reach_their_config() {
        let mut set = Settings::default();
        for (key, value) in [
            ("inbound_read_budget", "4096"),
            ("inbound_messages_per_round", "7"),
            ("inbound_accepts_per_round", "3"),
            ("inbound_round_quantum_us", "90"),
            ("inbound_ms_per_s", "40"),
            ("max_pinned_blocks", "77"),
            ("pin_eviction_min_age_ms", "250"),
            ("max_event_subscribers", "5"),
            ("max_event_replay_clients", "4"),
            ("max_event_per_source", "2"),
        ] {
            set.set(key, value, "t");
        }
        let c = resolve_one(&set, "t").unwrap_or_else(|e| panic!("{e}"));
        let control = &c.spec.control;
        assert_eq!(
            (
                control.inbound_read_budget,
                control.inbound_messages_per_round,
                control.inbound_accepts_per_round,
                control.inbound_round_quantum,
                control.inbound_time_per_second,
            ),
            (
                4096,
                7,
                3,
                Duration::from_micros(90),
                Duration::from_millis(40)
            )
        );
        assert_eq!(c.spec.core.max_pinned_blocks, Some(77));
        assert_eq!(c.spec.core.pin_eviction_min_age, Duration::from_millis(250));
        assert_eq!(
            (
                c.pool.max_event_subscribers,
                c.pool.max_event_replay_clients,
                c.pool.max_event_per_source
            ),
            (5, 4, 2)
        );
        for (key, value) in [("inbound_round_quantum_us", "0"), ("inbound_ms_per_s", "0")] {
            let mut set = Settings::default();
            set.set(key, value, "t");
            let e = resolve_one(&set, "t").unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn list_keys_take_arrays_in_a_file_whose_items_hold_their_own_separators() {
        let text = r#"
follow = ["tcp://10.0.0.6:5557,tcp://10.0.0.6:5558=10.0.0.6:5710", "tcp://10.0.0.7:5557=10.0.0.7:5710"]
pool_shard = ["10.0.0.1:5710", "10.0.0.2:5710"]
allowlist = ["10.0.0.0/24"]
"#;
        let set = from_toml(text, "pool.toml").unwrap();
        let c = resolve_one(&set, "t").unwrap();
        assert_eq!(c.pool.follow.len(), 2);
        assert!(c.pool.follow[0].replay.is_some());
        assert_eq!(c.pool.follow[1].peer, PeerId::new("10.0.0.7:5710"));
        assert_eq!(c.pool.shard.len(), 2);
        let err = from_toml(r#"max_peers = ["1"]"#, "x.toml").unwrap_err();
        assert!(err.to_string().contains("max_peers"), "{err}");
    }

    #[test]
    fn the_pool_keys_resolve_and_bad_values_name_their_key() {
        let mut set = Settings::default();
        set.set(
            "follow",
            "tcp://127.0.0.1:5557,tcp://127.0.0.1:5558=127.0.0.1:5710",
            "t",
        );
        set.set("pull_max_rate", "1000", "t");
        set.set("tcp_max_rate", "500M", "t");
        set.set("tcp_min_rate", "2k", "t");
        set.set("tcp_block_digests", "true", "t");
        set.set("publish_events", "tcp://*:5557", "t");
        set.set("publish_hashes", "int", "t");
        set.set("publish_ownership", "kvpeer", "t");
        set.set("pool_shard", "10.0.0.5:5710, 10.0.0.6:5710", "t");
        let c = resolve_one(&set, "t").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(c.pool.hash_form, kvpeer_pool::HashForm::Int);
        assert_eq!(c.pool.ownership.as_deref(), Some("kvpeer"));
        assert_eq!(
            c.pool.shard,
            vec![PeerId::new("10.0.0.5:5710"), PeerId::new("10.0.0.6:5710")]
        );
        assert_eq!(c.pool.follow.len(), 1);
        assert_eq!(c.pool.max_rate, Some(1000));
        // Rates take the flags' suffixes in a file and the environment too.
        assert_eq!(c.spec.tcp_max_write_rate, Some(500_000_000));
        assert_eq!(c.spec.tcp_min_write_rate, 2000);
        assert!(c.spec.tcp_block_digests);
        assert_eq!(c.pool.min_holders, 1);
        assert!(c.pool.enabled());
        assert!(!resolve_one(&Settings::default(), "t")
            .unwrap_or_else(|e| panic!("{e}"))
            .pool
            .enabled());
        for (key, value) in [
            ("follow", "tcp://127.0.0.1:5557"),
            ("pull_min_holders", "0"),
            ("pull_max_rate", "fast"),
            ("pull_max_lookups", "0"),
            ("publish_events", "127.0.0.1:5557"),
            ("publish_replay", "tcp://*:5558"),
            ("publish_hashes", "hex"),
            ("pool_shard", "10.0.0.5"),
            ("pool_shard", "a:1,a:1"),
        ] {
            let mut set = Settings::default();
            set.set(key, value, "t");
            let e = resolve_one(&set, "t").map(|_| ()).unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
    }
}
