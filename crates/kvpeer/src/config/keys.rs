//! The one declaration of every configuration key: its name (the TOML key), its default (as it
//! would be written in a file), the environment variable that sets it, and what it means.
//!
//! Everything else is made from this list: the file's serde struct ([`Settings`], unknown keys
//! refused), the environment's reader, the defaults `resolve` and the builder start from, and the
//! help of the command line's flags. A default is written here and nowhere else in this crate;
//! `docs/configuration.md` repeats the table for readers and a test holds it to this list.

use serde::Deserialize;

/// The hash seed a vLLM 0.33 engine advertises when `PYTHONHASHSEED` is unset and its prefix
/// hash is cryptographic (sha256, the default): `DEFAULT_NONE_HASH_SEED`. With a
/// non-cryptographic hash (xxhash) and no `PYTHONHASHSEED`, vLLM picks a random seed per
/// process, and no peer can match it.
pub const VLLM_DEFAULT_HASH_SEED: &str = "vllm-none-hash";

/// One configuration key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key {
    /// Its name in config files and error messages.
    pub name: &'static str,
    /// The value it has when no source sets it, written as in a file (`None`: unset, off).
    pub default: Option<&'static str>,
    /// The environment variable that sets it, if any (vLLM's names).
    pub env: Option<&'static str>,
    /// What it means (one line).
    pub help: &'static str,
}

/// Expands the list of keys into [`Keys`]/[`KEY`] (each key by name, checked by the compiler),
/// [`KEYS`] (all of them, in order) and [`Settings`] (what one source sets; serde refuses any
/// other key).
macro_rules! declare_keys {
    ($(
        $(#[doc = $doc:literal])+
        $key:ident $(= $default:expr)? $(, env $env:literal)?;
    )+) => {
        /// Every key, one field each: `KEY.num_blocks.default`.
        #[derive(Debug, Clone, Copy)]
        pub struct Keys {
            $(
                $(#[doc = $doc])+
                pub $key: Key,
            )+
        }

        /// Every key by name.
        pub const KEY: Keys = Keys {
            $(
                $key: Key {
                    name: stringify!($key),
                    default: declare_keys!(@option $($default)?),
                    env: declare_keys!(@option $($env)?),
                    help: concat!($($doc),+),
                },
            )+
        };

        /// Every key, in the order of the documentation.
        pub const KEYS: &[Key] = &[$(KEY.$key),+];

        /// The values one source sets (a file, the environment, the flags, a builder), each with
        /// where it came from. Deserialized from a config file, where any key not declared here
        /// is refused (`deny_unknown_fields`).
        #[derive(Debug, Clone, Default, Deserialize)]
        #[serde(deny_unknown_fields)]
        pub struct Settings {
            $(
                #[serde(default)]
                $key: Option<Setting>,
            )+
            /// A file's `[fingerprint_fields]` table, turned into `config_fingerprint` as the
            /// file is read (not a key of its own).
            #[serde(default)]
            fingerprint_fields: Option<toml::Table>,
            /// The first key `set` was given that is not one (refused by `resolve`).
            #[serde(skip)]
            unknown: Option<(String, String)>,
        }

        impl Settings {
            fn slot(&self, key: &str) -> Option<&Option<Setting>> {
                match key {
                    $(stringify!($key) => Some(&self.$key),)+
                    _ => None,
                }
            }

            fn slot_mut(&mut self, key: &str) -> Option<&mut Option<Setting>> {
                match key {
                    $(stringify!($key) => Some(&mut self.$key),)+
                    _ => None,
                }
            }
        }
    };
    (@option) => { None };
    (@option $value:expr) => { Some($value) };
}

declare_keys! {
    /// control-channel host (with the port: the node's identity, which peers dial)
    listen_host = "127.0.0.1", env "VLLM_P2P_SIDE_CHANNEL_HOST";
    /// control-channel port; 0 picks a free one
    listen_port = "0", env "VLLM_P2P_SIDE_CHANNEL_PORT";
    /// HOST or HOST:PORT peers reach this node at (its identity) when that is not the listen address: behind NAT, or to choose among a wildcard listen's addresses (unset: listen_host; for 0.0.0.0 or :: the host's address on its default route, else its first up non-loopback interface)
    advertise;
    /// blocks in the pool
    num_blocks = "1024";
    /// bytes per block; peers must agree
    block_len = "65536";
    /// prefix-cache hash seed; peers must agree (vLLM advertises $PYTHONHASHSEED when set)
    hash_seed = VLLM_DEFAULT_HASH_SEED, env "PYTHONHASHSEED";
    /// model configuration fingerprint; "" matches anything
    config_fingerprint = "";
    /// data planes: shm, tcp, both or nixl
    plane = "both";
    /// name of the pool's shared-memory object in /dev/shm, for the shm and both planes (unset: kvpeer-TAG-PID); a dead node's object of that name is removed, a live one's refused
    shm_name;
    /// directory of NIXL's libnixl_capi.so, for the nixl plane (unset: the loader's path)
    nixl_lib_dir;
    /// UCX backend parameters for the nixl plane, key=value,...
    nixl_backend_params;
    /// port of the tcp data plane's listener, on the control channel's host; 0 picks a free one (fix it to open one port between hosts)
    tcp_port = "0";
    /// cap on tcp bytes per second to each peer (unset: uncapped)
    tcp_max_rate;
    /// ask peers writing to this node over tcp for a CRC-32C of each block, checked as it lands: a block corrupted in transit fails its load (a miss, never wrong KV); costs a pass over each block on both sides
    tcp_block_digests = "false";
    /// HOST:PORT at which kvpeer serve answers /metrics, /healthz and /readyz (unset: none; the flag --metrics beats it)
    metrics_listen;
    /// slowest a peer may take this node's tcp writes, bytes per second: each transfer must be acknowledged within tcp_transfer_timeout_s plus its bytes at this rate (never above tcp_max_rate)
    tcp_min_rate = "1000000";
    /// seconds a tcp transfer may take beyond its bytes at tcp_min_rate before its peer is faulted and its data connection reset
    tcp_transfer_timeout_s = "30";
    /// most sessions at once (vLLM's default)
    max_peers = "128", env "VLLM_P2P_MAX_PEERS";
    /// most sessions at once with peers of one host; when full, a newcomer evicts the idlest session of its host or of the heaviest
    max_peers_per_host = "32";
    /// seconds a handshake may take
    handshake_timeout_s = "30", env "VLLM_P2P_HANDSHAKE_TIMEOUT_S";
    /// idle-session eviction age in seconds, 0 = never
    idle_timeout_s = "300", env "VLLM_P2P_IDLE_TIMEOUT_S";
    /// seconds a lookup may go without progress (vLLM 0.34's)
    lookup_timeout_s = "8";
    /// seconds a fetch of a request that ran its lookups may take before it is aborted (vLLM 0.34's symmetric-P2P load timeout: the peer confirmed every block)
    load_timeout_s = "10";
    /// seconds a fetch of a request that never looked up (a PD load: the producer may still be computing) may take before it is aborted (vLLM 0.34's)
    pd_load_timeout_s = "30";
    /// seconds a pin may be held for a peer
    store_timeout_s = "30";
    /// seconds an abort may wait for its ack (then the session ends: only that fences the peer)
    abort_ack_timeout_s = "5";
    /// seconds a pending key of an inbound lookup waits before MISS
    lookup_pending_timeout_s = "5";
    /// seconds a PD producer's stored blocks wait for the fetch
    unbound_store_timeout_s = "60";
    /// seconds a faulted peer's writes may drain before it is dropped
    peer_fault_drain_s = "10";
    /// seconds a write to a peer may stay in flight before the peer is faulted and its session ends, on planes that do not bound their writes themselves (nixl; tcp bounds each write by its bytes); a float as vLLM reads it, 0 or less = never (vLLM 0.34's)
    transfer_stall_timeout_s = "20", env "VLLM_P2P_TRANSFER_STALL_TIMEOUT_S";
    /// seconds a write still running when its session ended may keep its source blocks pinned (until the plane says it stopped; the peer gets no new session meanwhile), then they are released anyway (vLLM 0.34's)
    retained_hold_cap_s = "30";
    /// keys of one inbound lookup asked of the store; the rest answer MISS
    max_lookup_keys = "131072";
    /// keys of all peers' queued lookups asked per step of the node's loop, hosts in turn (the rest wait a step)
    lookup_slice_keys = "256";
    /// keys of one peer's lookups asked per second while others' lookups wait (past it they take only the steps others leave; MISS at their deadline)
    lookup_keys_per_s = "262144";
    /// blocks pinned for one peer's lookups at once; past it MISS (unset: 1/8 of num_blocks, at least 256 or the pool)
    max_pins_per_peer;
    /// blocks pinned for all peers' lookups together; past it the heaviest holder's oldest go (unset: half of num_blocks, at least one peer's share)
    max_pinned_blocks;
    /// milliseconds a lookup's pin is kept before that cap may release it
    pin_eviction_min_age_ms = "1000";
    /// keys held for one peer at once (open lookups, pin references, fetches waiting for a store)
    max_held_keys_per_peer = "2097152";
    /// estimated bytes of those keys
    max_held_bytes_per_peer = "268435456";
    /// estimated bytes all peers hold together; past it a peer takes more only within an equal part of it
    max_held_bytes = "1073741824";
    /// requests one peer may have open on this node's producer side
    max_requests_per_peer = "131072";
    /// blocks a peer's pool may have (its connect's num_blocks); a larger pool is refused at the connect
    max_peer_blocks = "4194304";
    /// largest control message accepted, in bytes
    max_message_bytes = "16777216";
    /// most entries in one list of a message
    max_keys_per_message = "131072";
    /// bytes queued unwritten to one peer before its control connection is closed
    send_queue_bytes = "16777216";
    /// inbound control connections at once (a newcomer evicts the idlest when full; unset: 2 per session of max_peers and 64 more, at least 1024)
    max_inbound_connections;
    /// inbound control connections at once from one source address (a newcomer evicts that source's idlest; unset: 2 per session of max_peers_per_host, at least 64)
    max_inbound_per_source;
    /// tcp data connections into this node at once (unset: one per session of max_peers and 64 more, at least 256)
    tcp_max_connections;
    /// bytes read from one inbound control connection per round of the node's loop
    inbound_read_budget = "262144";
    /// messages taken from one inbound control connection per round (the rest wait a round)
    inbound_messages_per_round = "128";
    /// inbound control connections accepted per round (a burst is taken a few at a time)
    inbound_accepts_per_round = "16";
    /// microseconds of the node's thread one inbound control connection's messages get per round
    inbound_round_quantum_us = "100";
    /// milliseconds of the node's thread one inbound control connection's messages may take per second
    inbound_ms_per_s = "150";
    /// milliseconds of silence on a control connection before this node sends a heartbeat PING (libzmq's ZMQ_HEARTBEAT_IVL, as vLLM sets it)
    heartbeat_interval_ms = "2000";
    /// milliseconds a heartbeat PING may go unanswered before the connection is lost (ZMQ_HEARTBEAT_TIMEOUT; also the TTL told to the peer)
    heartbeat_timeout_ms = "10000";
    /// milliseconds the other control connections to a host that lost one (silent, unreachable, or closed) may take to answer a probe before their sessions end too; 0 = off (each connection waits out its own heartbeat)
    host_probe_timeout_ms = "1000";
    /// milliseconds a host is not dialed after a connection to it went unanswered with none left that answers (new sessions to it fail at once); 0 = never held
    host_down_hold_ms = "5000";
    /// name of the group of one engine's ranks on this host (vLLM data parallelism) that tell each other of lost hosts; with liveness_rank (unset: this node alone)
    liveness_group;
    /// this rank in liveness_group, INDEX/MEMBERS (e.g. 0/8)
    liveness_rank;
    /// peers to talk to: CIDR, host or host:port rules (unset: all)
    allowlist;
    /// this node's tenant: all its own blocks are that tenant's, and it talks only to peers of it and to shared nodes (unset: none, as a pool node that keeps tenants apart)
    tenant;
    /// which tenant each peer is, NAME=RULE with the allowlist's rules (alpha=10.0.1.0/24); * names shared nodes (pools) every tenant talks to; a node without a tenant shows each peer only its tenant's blocks (unset: one tenant, everyone's)
    tenants;
    /// a peer's IP identity must come from that address: true or false
    bind_identity = "true";
    /// accept shm tokens not bound to a connection's challenge (replayable; only for peers that cannot read it)
    shm_allow_replayable_tokens = "false";
    /// file holding the shared secret of the authenticated handshake (unset: off)
    auth_secret_file;
    /// TLS 1.3 with mutual authentication on the control channel and the tcp data plane: off, preferred (with every peer that speaks it, plaintext with one that does not) or required (refuses plaintext; needs tls_cert, tls_key and tls_ca)
    tls = "off";
    /// PEM file of this node's certificate chain for TLS (its own first, naming the node's IP address as a subject alternative name); reread when it changes
    tls_cert;
    /// PEM file of this node's private key for TLS (PKCS#8, PKCS#1 or SEC1); reread when it changes
    tls_key;
    /// PEM file of the certificate authorities whose peers TLS trusts; reread when it changes
    tls_ca;
    /// directory of the disk tier under the pool's memory: blocks are written through to a file there, kept on disk when memory evicts them, read back when asked for, and found again after a restart (unset: memory only)
    disk_path;
    /// bytes of disk the tier may use, header pages included (K, M or G: powers of 1000); needed with disk_path
    disk_capacity;
    /// where a block read back from disk goes in memory's eviction order: hot (most recently used) or cold (the first to go unless asked for again while in memory: a scan does not push out hot blocks)
    disk_promote = "hot";
    /// I/O threads of the disk tier: the reads and writes in flight at once (with io_uring: one thread, 8 entries per disk_threads)
    disk_threads = "8";
    /// the disk tier's I/O: auto (io_uring where the kernel allows it, else threads), uring (or the start fails) or threads
    disk_io = "auto";
    /// pool node: engines' KV event streams to follow, EVENTS=PEER or EVENTS,REPLAY=PEER (bind:EVENTS to accept a PUB that connects); `;` between several
    follow;
    /// pool node: engines that must hold a key before it is pulled
    pull_min_holders = "1";
    /// pool node: cap on pulled bytes per second, all engines together (unset: uncapped)
    pull_max_rate;
    /// pool node: most lookups per second sent to each followed engine
    pull_max_lookups = "50";
    /// pool node: where to bind a PUB for the node's own KV events, e.g. tcp://*:5557 (unset: off)
    publish_events;
    /// pool node: where to bind the ROUTER answering replays of its events (unset: none)
    publish_replay;
    /// pool node: the topic of its published KV events
    publish_topic = "";
    /// pool node: how its KV events write block hashes: bytes (the full hash, as engines with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) or int (the low 64 bits, for routers that take only ints, e.g. Dynamo)
    publish_hashes = "bytes";
    /// pool node: the P2P identities (HOST:PORT, comma-separated) of every pool node that splits the key space, itself included; it then pulls only the prefixes whose root chunk rendezvous-hashes to itself (unset: everything it admits)
    pool_shard;
    /// pool node: the ownership its KV events say (empty: none, as an engine's own CPU tier; vllm-router then scores them as a host tier, Dynamo's indexer ignores any value)
    publish_ownership = "";
    /// pool node: subscribers of its KV events at once (a newcomer evicts the idlest when full)
    max_event_subscribers = "64";
    /// pool node: replay clients of its KV events at once
    max_event_replay_clients = "16";
    /// pool node: KV event connections at once from one source address, per socket
    max_event_per_source = "16";
}

/// One key's value as text, and where it came from (`file kvpeer.toml`, `env PYTHONHASHSEED`,
/// `flag --blocks`). A file may write a value as a string, a number, a boolean or (for the
/// allowlist) a list of strings; every source is then checked by the same parser.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Setting {
    pub(crate) value: String,
    pub(crate) source: String,
    /// Written as a TOML array (only the list keys may be).
    pub(crate) list: bool,
    /// Written as text: a string, or an array of strings only.
    pub(crate) text: bool,
}

impl<'de> Deserialize<'de> for Setting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Setting;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a string or a number")
            }

            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Setting, E> {
                Ok(Setting::text(v.to_owned()))
            }

            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Setting, E> {
                Ok(Setting::scalar(v.to_string()))
            }

            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Setting, E> {
                Ok(Setting::scalar(v.to_string()))
            }

            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<Setting, E> {
                Ok(Setting::scalar(v.to_string()))
            }

            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<Setting, E> {
                Ok(Setting::scalar(v.to_string()))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<Setting, A::Error> {
                // The list travels as text, one item a line: every list key splits on newlines
                // as well as on its own separator (`,` for rules and shard members, `;` for
                // follow specs, whose items hold commas), as a flag or a variable gives them.
                // Items of any type are read (a list given to a key of one value is refused
                // for being a list, not for its items); a list key's items must be text.
                let mut items = Vec::new();
                let mut all_text = true;
                while let Some(item) = a.next_element::<Setting>()? {
                    if item.list {
                        return Err(serde::de::Error::custom(
                            "a list inside a list: a list's items are strings",
                        ));
                    }
                    all_text &= item.text;
                    items.push(item.value);
                }
                Ok(Setting {
                    list: true,
                    text: all_text,
                    ..Setting::text(items.join("\n"))
                })
            }
        }
        d.deserialize_any(Visit)
    }
}

impl Setting {
    fn text(value: String) -> Setting {
        Setting {
            value,
            source: String::new(),
            list: false,
            text: true,
        }
    }

    /// A number or a bool, kept as its text.
    fn scalar(value: String) -> Setting {
        Setting {
            text: false,
            ..Setting::text(value)
        }
    }
}

impl Settings {
    /// Sets `key` to `value` from `source` (a later `set` of the same key replaces it). A name
    /// that is no key is remembered and refused by `resolve`.
    pub fn set(&mut self, key: &str, value: impl Into<String>, source: &str) {
        let setting = Setting {
            value: value.into(),
            source: source.to_owned(),
            list: false,
            text: true,
        };
        match self.slot_mut(key) {
            Some(slot) => *slot = Some(setting),
            None => {
                self.unknown
                    .get_or_insert_with(|| (key.to_owned(), source.to_owned()));
            }
        }
    }

    /// The value of `key` and its source, if this source sets it.
    pub fn get(&self, key: &str) -> Option<(&str, &str)> {
        self.slot(key)
            .and_then(Option::as_ref)
            .map(|s| (s.value.as_str(), s.source.as_str()))
    }

    pub(crate) fn setting(&self, key: &str) -> Option<&Setting> {
        self.slot(key).and_then(Option::as_ref)
    }

    /// Takes every key `later` sets (later sources win).
    pub(crate) fn merge(&mut self, later: &Settings) {
        for key in KEYS {
            if let (Some(slot), Some(value)) = (self.slot_mut(key.name), later.setting(key.name)) {
                *slot = Some(value.clone());
            }
        }
        if self.unknown.is_none() {
            self.unknown.clone_from(&later.unknown);
        }
    }

    /// Names every value's source (serde fills in values only).
    pub(crate) fn set_source(&mut self, source: &str) {
        for key in KEYS {
            if let Some(Some(s)) = self.slot_mut(key.name) {
                s.source = source.to_owned();
            }
        }
    }

    /// The keys this source set as TOML arrays, and whether every item was text.
    pub(crate) fn lists(&self) -> impl Iterator<Item = (&'static str, bool)> + '_ {
        KEYS.iter().filter_map(|k| {
            self.setting(k.name)
                .filter(|s| s.list)
                .map(|s| (k.name, s.text))
        })
    }

    pub(crate) fn take_fingerprint_fields(&mut self) -> Option<toml::Table> {
        self.fingerprint_fields.take()
    }

    pub(crate) fn unknown(&self) -> Option<&(String, String)> {
        self.unknown.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_key_is_a_field_of_the_file_and_named_once() {
        for (i, k) in KEYS.iter().enumerate() {
            let mut s = Settings::default();
            s.set(k.name, "1", "t");
            assert_eq!(s.get(k.name), Some(("1", "t")), "{}", k.name);
            assert!(s.unknown().is_none());
            assert!(KEYS[..i].iter().all(|o| o.name != k.name), "{}", k.name);
        }
        let mut s = Settings::default();
        s.set("num_blokcs", "1", "t");
        assert_eq!(s.unknown(), Some(&("num_blokcs".into(), "t".into())));
    }
}
