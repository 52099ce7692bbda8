//! Node configuration from four sources, with precedence flag > environment > file > default.
//!
//! * **File**: TOML (`--config FILE`), flat keys as in [`KEYS`]; a `[fingerprint_fields]`
//!   table computes `config_fingerprint` vLLM's way (first 16 hex of sha256 over the fields as
//!   sorted-key compact JSON with non-ASCII escaped, like Python's `json.dumps(sort_keys=True,
//!   separators=(",", ":"))`).
//! * **Environment**: the variables vLLM users know (`VLLM_P2P_SIDE_CHANNEL_HOST`, `_PORT`,
//!   `VLLM_P2P_MAX_PEERS`, `VLLM_P2P_HANDSHAKE_TIMEOUT_S`, `VLLM_P2P_IDLE_TIMEOUT_S`,
//!   `PYTHONHASHSEED`).
//! * **Flags**: whatever the command line set ([`Settings`] with only those keys).
//!
//! Everything is checked before anything starts: an unknown key, a wrong type or an
//! out-of-range value is an error naming the key and where it came from.

use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::api::{NodeConfig, PlaneKind};
use crate::node::allow::Allowlist;
use crate::node::build::{NixlOptions, NodeSpec};
use kvpeer_core::CoreConfig;
use kvpeer_net::control::ControlConfig;
use kvpeer_proto::{DecodeLimits, PeerId};

/// Every key a config file may hold, with what it means.
pub const KEYS: &[(&str, &str)] = &[
    ("listen_host", "control-channel host (default 127.0.0.1)"),
    (
        "listen_port",
        "control-channel port, 0 picks one (default 0)",
    ),
    ("num_blocks", "blocks in the pool (default 1024)"),
    (
        "block_len",
        "bytes per block; peers must agree (default 65536)",
    ),
    (
        "hash_seed",
        "prefix-cache hash seed; peers must agree (default $PYTHONHASHSEED, else vLLM's \"vllm-none-hash\")",
    ),
    (
        "config_fingerprint",
        "model configuration fingerprint, \"\" matches any (default \"\")",
    ),
    (
        "plane",
        "data planes: shm, tcp, both or nixl (default both)",
    ),
    (
        "nixl_lib_dir",
        "directory of libnixl_capi.so for the nixl plane (default: loader path)",
    ),
    (
        "nixl_backend_params",
        "UCX backend parameters for the nixl plane, key=value,... (default none)",
    ),
    (
        "tcp_max_rate",
        "cap on tcp bytes per second to each peer (default none)",
    ),
    ("max_peers", "most sessions at once (default 128, as vLLM)"),
    (
        "handshake_timeout_s",
        "seconds a handshake may take (default 30)",
    ),
    (
        "idle_timeout_s",
        "idle session eviction age in seconds, 0 = never (default 300)",
    ),
    (
        "lookup_timeout_s",
        "seconds a lookup may go without progress (default 30)",
    ),
    (
        "load_timeout_s",
        "seconds a fetch may take before it is aborted (default 30)",
    ),
    (
        "store_timeout_s",
        "seconds a pin may be held for a peer (default 30)",
    ),
    (
        "abort_ack_timeout_s",
        "seconds an abort may wait for its ack (default 10)",
    ),
    (
        "lookup_pending_timeout_s",
        "seconds a pending key of an inbound lookup may wait before MISS (default 5)",
    ),
    (
        "unbound_store_timeout_s",
        "seconds a PD producer's stored blocks wait for the fetch (default 60)",
    ),
    (
        "peer_fault_drain_s",
        "seconds a faulted peer's writes may drain before it is dropped (default 10)",
    ),
    (
        "max_message_bytes",
        "largest control message accepted (default 67108864)",
    ),
    (
        "max_keys_per_message",
        "most entries in one list of a message (default 1048576)",
    ),
    (
        "allowlist",
        "peers to talk to: CIDR, host or host:port rules (default: all)",
    ),
    (
        "bind_identity",
        "a peer's IP identity must come from that address: true or false (default true)",
    ),
    (
        "auth_secret_file",
        "file holding the shared secret of the authenticated handshake (default: off)",
    ),
];

/// Environment variables and the keys they set.
pub const ENV: &[(&str, &str)] = &[
    ("VLLM_P2P_SIDE_CHANNEL_HOST", "listen_host"),
    ("VLLM_P2P_SIDE_CHANNEL_PORT", "listen_port"),
    ("VLLM_P2P_MAX_PEERS", "max_peers"),
    ("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "handshake_timeout_s"),
    ("VLLM_P2P_IDLE_TIMEOUT_S", "idle_timeout_s"),
    // vLLM derives the seed it advertises from PYTHONHASHSEED when set (kv_cache_utils).
    ("PYTHONHASHSEED", "hash_seed"),
];

/// The hash seed a vLLM 0.33 engine advertises when `PYTHONHASHSEED` is unset and its prefix
/// hash is cryptographic (sha256, the default): `DEFAULT_NONE_HASH_SEED`. With a
/// non-cryptographic hash (xxhash) and no `PYTHONHASHSEED`, vLLM picks a random seed per
/// process, and no peer can match it.
pub const VLLM_DEFAULT_HASH_SEED: &str = "vllm-none-hash";

/// A configuration error: which key, from where, and what is wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}: {key}: {problem}")]
pub struct ConfigError {
    /// Where the value came from (`file kvpeer.toml`, `env VLLM_P2P_MAX_PEERS`, `flag`).
    pub source_name: String,
    /// The key.
    pub key: String,
    /// What is wrong.
    pub problem: String,
}

/// Values as text, each with where it came from; later sources override earlier ones.
#[derive(Debug, Clone, Default)]
pub struct Settings {
    values: Vec<(String, String, String)>, // (key, value, source)
}

impl Settings {
    /// Sets `key` to `value` from `source`.
    pub fn set(&mut self, key: &str, value: impl Into<String>, source: &str) {
        self.values.retain(|(k, _, _)| k != key);
        self.values
            .push((key.to_owned(), value.into(), source.to_owned()));
    }

    fn get(&self, key: &str) -> Option<(&str, &str)> {
        self.values
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, v, s)| (v.as_str(), s.as_str()))
    }

    fn merge(&mut self, later: &Settings) {
        for (k, v, s) in &later.values {
            self.set(k, v.clone(), s);
        }
    }
}

/// The settings a TOML file holds.
pub fn from_toml(text: &str, file: &str) -> Result<Settings, ConfigError> {
    let source = format!("file {file}");
    let err = |key: &str, problem: String| ConfigError {
        source_name: source.clone(),
        key: key.to_owned(),
        problem,
    };
    let table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| err("(syntax)", e.message().to_owned()))?;
    let mut out = Settings::default();
    for (key, value) in &table {
        if key == "fingerprint_fields" {
            let json = toml_to_json(value);
            let fields = json
                .as_object()
                .ok_or_else(|| err(key, "must be a table".into()))?;
            out.set(
                "config_fingerprint",
                fingerprint(&serde_json::Value::Object(fields.clone())),
                &source,
            );
            continue;
        }
        if !KEYS.iter().any(|(k, _)| k == key) {
            return Err(err(key, "unknown key".into()));
        }
        let text = match value {
            toml::Value::Array(rules) if key == "allowlist" => {
                let mut list = Vec::new();
                for r in rules {
                    match r.as_str() {
                        Some(r) => list.push(r.to_owned()),
                        None => return Err(err(key, "every rule must be a string".into())),
                    }
                }
                list.join(",")
            }
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(i) => i.to_string(),
            toml::Value::Float(f) => f.to_string(),
            other => {
                return Err(err(
                    key,
                    format!("expected a string or a number, got a {}", other.type_str()),
                ))
            }
        };
        out.set(key, text, &source);
    }
    Ok(out)
}

/// The settings the environment holds (`lookup` reads one variable).
pub fn from_env(lookup: impl Fn(&str) -> Option<String>) -> Settings {
    let mut out = Settings::default();
    for (var, key) in ENV {
        if let Some(v) = lookup(var) {
            out.set(key, v, &format!("env {var}"));
        }
    }
    out
}

/// Resolves defaults < file < env < flags into a node configuration.
pub fn resolve(
    file: &Settings,
    env: &Settings,
    flags: &Settings,
    tag: &str,
) -> Result<NodeConfig, ConfigError> {
    let mut s = file.clone();
    s.merge(env);
    s.merge(flags);
    let core_default = CoreConfig::default();
    let host = text(&s, "listen_host", "127.0.0.1");
    let port: u64 = number(&s, "listen_port", 0, 0, u64::from(u16::MAX))?;
    let secs = |key: &str, default: Duration, min: u64| -> Result<Duration, ConfigError> {
        number(&s, key, default.as_secs(), min, 86_400 * 365).map(Duration::from_secs)
    };
    let core = CoreConfig {
        max_peers: number(&s, "max_peers", core_default.max_peers as u64, 1, 1 << 20)? as usize,
        handshake_timeout: secs("handshake_timeout_s", core_default.handshake_timeout, 1)?,
        idle_timeout: secs("idle_timeout_s", core_default.idle_timeout, 0)?,
        lookup_timeout: secs("lookup_timeout_s", core_default.lookup_timeout, 1)?,
        load_timeout: secs("load_timeout_s", core_default.load_timeout, 1)?,
        store_timeout: secs("store_timeout_s", core_default.store_timeout, 1)?,
        abort_ack_timeout: secs("abort_ack_timeout_s", core_default.abort_ack_timeout, 1)?,
        lookup_pending_timeout: secs(
            "lookup_pending_timeout_s",
            core_default.lookup_pending_timeout,
            1,
        )?,
        unbound_store_timeout: secs(
            "unbound_store_timeout_s",
            core_default.unbound_store_timeout,
            1,
        )?,
        peer_fault_drain: secs("peer_fault_drain_s", core_default.peer_fault_drain, 1)?,
        ..core_default
    };
    let limits_default = DecodeLimits::default();
    let max_message = number(
        &s,
        "max_message_bytes",
        limits_default.max_payload_bytes as u64,
        1024,
        1 << 31,
    )?;
    let limits = DecodeLimits {
        max_payload_bytes: max_message as usize,
        max_list_len: number(
            &s,
            "max_keys_per_message",
            limits_default.max_list_len as u64,
            1,
            1 << 24,
        )? as usize,
        ..limits_default
    };
    let control = ControlConfig {
        max_message_bytes: max_message as i64,
        ..ControlConfig::default()
    };
    let plane = match s.get("plane") {
        None => PlaneKind::Both,
        Some(("shm", _)) => PlaneKind::Shm,
        Some(("tcp", _)) => PlaneKind::Tcp,
        Some(("both", _)) => PlaneKind::Both,
        Some(("nixl", _)) => PlaneKind::Nixl,
        Some((v, src)) => {
            return Err(bad(
                src,
                "plane",
                format!("{v:?} is not shm, tcp, both or nixl"),
            ))
        }
    };
    let nixl = NixlOptions {
        lib_dir: s.get("nixl_lib_dir").map(|(v, _)| v.into()),
        backend_params: match s.get("nixl_backend_params") {
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
    let tcp_max_write_rate = match s.get("tcp_max_rate") {
        None => None,
        Some(_) => Some(number(&s, "tcp_max_rate", 0, 1, u64::MAX)?),
    };
    let id = PeerId::new(format!("{host}:{port}"));
    if port != 0 && id.host_port().is_err() {
        let (_, src) = s.get("listen_host").unwrap_or(("", "default"));
        return Err(bad(src, "listen_host", format!("{host:?} is not a host")));
    }
    Ok(NodeConfig {
        spec: NodeSpec {
            id,
            num_blocks: number(&s, "num_blocks", 1024, 1, u64::from(u32::MAX) - 1)?,
            block_len: number(&s, "block_len", 64 * 1024, 1, 1 << 30)?,
            shm_name: format!("kvpeer-{tag}-{}", std::process::id()),
            tcp_listen: format!("{host}:0"),
            tcp_max_write_rate,
            hash_seed: text(&s, "hash_seed", VLLM_DEFAULT_HASH_SEED),
            config_fingerprint: text(&s, "config_fingerprint", ""),
            core,
            allowlist: allowlist(&s)?,
            bind_identity: boolean(&s, "bind_identity", true)?,
            auth_secret: auth_secret(&s)?,
            control,
            limits,
            nixl,
        },
        plane,
    })
}

fn allowlist(s: &Settings) -> Result<Allowlist, ConfigError> {
    let Some((v, src)) = s.get("allowlist") else {
        return Ok(Allowlist::default());
    };
    let rules: Vec<&str> = v.split(',').filter(|r| !r.trim().is_empty()).collect();
    Allowlist::parse(&rules).map_err(|e| bad(src, "allowlist", e.to_string()))
}

fn auth_secret(s: &Settings) -> Result<Option<Vec<u8>>, ConfigError> {
    let Some((path, src)) = s.get("auth_secret_file") else {
        return Ok(None);
    };
    let bytes = std::fs::read(path).map_err(|e| {
        bad(
            src,
            "auth_secret_file",
            format!("cannot read {path:?}: {e}"),
        )
    })?;
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

fn boolean(s: &Settings, key: &str, default: bool) -> Result<bool, ConfigError> {
    match s.get(key) {
        None => Ok(default),
        Some((v, src)) => match v.trim().to_ascii_lowercase().as_str() {
            "true" | "1" | "yes" | "on" => Ok(true),
            "false" | "0" | "no" | "off" => Ok(false),
            other => Err(bad(src, key, format!("{other:?} is not true or false"))),
        },
    }
}

fn text(s: &Settings, key: &str, default: &str) -> String {
    s.get(key).map_or(default.to_owned(), |(v, _)| v.to_owned())
}

fn number(s: &Settings, key: &str, default: u64, min: u64, max: u64) -> Result<u64, ConfigError> {
    let Some((v, src)) = s.get(key) else {
        return Ok(default);
    };
    let n: u64 = v
        .trim()
        .parse()
        .map_err(|_| bad(src, key, format!("{v:?} is not a whole number")))?;
    if n < min || n > max {
        return Err(bad(src, key, format!("{n} is outside {min}..={max}")));
    }
    Ok(n)
}

fn toml_to_json(v: &toml::Value) -> serde_json::Value {
    match v {
        toml::Value::String(s) => s.clone().into(),
        toml::Value::Integer(i) => (*i).into(),
        toml::Value::Float(f) => {
            serde_json::Number::from_f64(*f).map_or(serde_json::Value::Null, Into::into)
        }
        toml::Value::Boolean(b) => (*b).into(),
        toml::Value::Datetime(d) => d.to_string().into(),
        toml::Value::Array(a) => a.iter().map(toml_to_json).collect(),
        toml::Value::Table(t) => serde_json::Value::Object(
            t.iter()
                .map(|(k, v)| (k.clone(), toml_to_json(v)))
                .collect(),
        ),
    }
}

/// vLLM's config fingerprint of `fields`: "" for no fields, else the first 16 hex digits of
/// sha256 over Python's `json.dumps(fields, sort_keys=True, separators=(",", ":"))`.
pub fn fingerprint(fields: &serde_json::Value) -> String {
    if fields.as_object().is_some_and(|m| m.is_empty()) {
        return String::new();
    }
    let mut canonical = String::new();
    python_json(fields, &mut canonical);
    let digest = Sha256::digest(canonical.as_bytes());
    hex::encode(digest)[..16].to_owned()
}

/// Python's compact, sorted, ASCII-only JSON (written by hand: serde_json keeps insertion
/// order here and never escapes non-ASCII, and the fingerprint depends on both).
fn python_json(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&python_float(f)),
            _ => out.push_str("null"),
        },
        Value::String(s) => python_str(s, out),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                python_json(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                python_str(k, out);
                out.push(':');
                if let Some(x) = m.get(k) {
                    python_json(x, out);
                }
            }
            out.push('}');
        }
    }
}

fn python_float(f: f64) -> String {
    if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f:?}")
    }
}

fn python_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}
