//! `agent_metadata` of a kvpeer node: one msgpack map naming every data plane it offers.
//!
//! ```text
//! {"agent": "<node name>", "shm": "<POSIX shm object name>", "shm_token": <bin 32>,
//!  "shm_epoch": <uint32>, "tcp": "<host>:<port>", "tcp_key": <bin 32>, "tcp_tls": true}
//! ```
//!
//! `shm_epoch` (a consumer's, fresh per `connect`) says its pool has fence words in the object
//! `<shm>.fence` and that a writer must take each block's word for this epoch before copying
//! into it (kvpeer_store::fence); a peer that sends none (kvpeer's Python test transport) gets
//! plain copies.
//!
//! `tcp_tls` (only ever `true`, and absent otherwise) says the tcp listener takes TLS 1.3 with
//! mutual authentication (crate::tls): a writer whose node uses TLS connects with it.
//!
//! `shm` and `tcp` are each optional; unknown keys are ignored so later planes can be added.
//! A writer uses `shm` when it can open the peer's object (same host), else `tcp`.
//! `shm_token` proves the sender owns the object it names and `tcp_key` lets its data port
//! tell the session's writer from anyone else; both are made for one destination (see
//! docs/security.md) and added by the planes just before a `connect` leaves.

use kvpeer_proto::{DecodeLimits, Value};

/// The data planes a node offers.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AgentMetadata {
    /// The node's name (informational).
    pub agent: String,
    /// Its block region's shared-memory object name (without the leading `/`).
    pub shm: Option<String>,
    /// Its tcp data listener, `host:port`.
    pub tcp: Option<String>,
    /// Proof, for one destination, that the sender owns the `shm` object (see `shm.rs`).
    pub shm_token: Option<Vec<u8>>,
    /// The key a writer presents in its tcp HELLO, issued for one destination (see `tcp.rs`).
    pub tcp_key: Option<Vec<u8>>,
    /// The epoch of the sender's fence words for this session (see the module doc).
    pub shm_epoch: Option<u32>,
    /// Its tcp listener takes TLS (see the module doc).
    pub tcp_tls: bool,
    /// Its tcp listener wants each WRITE to carry a CRC-32C per block, checked before the
    /// write counts (`tcp_block_digests`): a corruption in transit fails the load.
    pub tcp_digests: bool,
}

/// `agent_metadata` that is not kvpeer's map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "agent_metadata is not a kvpeer plane map ({0}); a stock vLLM peer sends NIXL's metadata: \
     talk to it with the nixl plane (a kvpeer built with it: `MATURIN_PEP517_ARGS=\"--features \
     nixl\" pip install .` and `pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1`; then plane auto or \
     nixl)"
)]
pub struct MetadataError(pub String);

impl AgentMetadata {
    /// The msgpack bytes sent in `connect`.
    pub fn encode(&self) -> Vec<u8> {
        let mut entries = vec![(Value::Str("agent".into()), Value::Str(self.agent.clone()))];
        if let Some(shm) = &self.shm {
            entries.push((Value::Str("shm".into()), Value::Str(shm.clone())));
        }
        if let Some(token) = &self.shm_token {
            entries.push((Value::Str("shm_token".into()), Value::Bin(token.clone())));
        }
        if let Some(epoch) = self.shm_epoch {
            entries.push((Value::Str("shm_epoch".into()), Value::Uint(epoch.into())));
        }
        if let Some(tcp) = &self.tcp {
            entries.push((Value::Str("tcp".into()), Value::Str(tcp.clone())));
        }
        if let Some(key) = &self.tcp_key {
            entries.push((Value::Str("tcp_key".into()), Value::Bin(key.clone())));
        }
        if self.tcp_tls {
            entries.push((Value::Str("tcp_tls".into()), Value::Bool(true)));
        }
        if self.tcp_digests {
            entries.push((Value::Str("tcp_digests".into()), Value::Bool(true)));
        }
        // A map of three short strs is far below every msgpack length limit.
        Value::Map(entries).encode().unwrap_or_default()
    }

    /// Reads a peer's `agent_metadata`.
    pub fn decode(bytes: &[u8]) -> Result<Self, MetadataError> {
        let limits = DecodeLimits {
            max_payload_bytes: 64 * 1024,
            ..DecodeLimits::default()
        };
        let value = Value::decode(bytes, &limits).map_err(|e| MetadataError(e.to_string()))?;
        if !matches!(value, Value::Map(_)) {
            return Err(MetadataError("not a map".into()));
        }
        let text = |name: &str| -> Result<Option<String>, MetadataError> {
            match value.get(name) {
                None => Ok(None),
                Some(Value::Str(s)) => Ok(Some(s.clone())),
                Some(_) => Err(MetadataError(format!("{name:?} is not a str"))),
            }
        };
        let bin = |name: &str| -> Result<Option<Vec<u8>>, MetadataError> {
            match value.get(name) {
                None => Ok(None),
                Some(Value::Bin(b)) => Ok(Some(b.clone())),
                Some(_) => Err(MetadataError(format!("{name:?} is not bin"))),
            }
        };
        let shm_epoch = match value.get("shm_epoch") {
            None => None,
            Some(Value::Uint(e)) => Some(
                u32::try_from(*e)
                    .map_err(|_| MetadataError("\"shm_epoch\" is not a uint32".into()))?,
            ),
            Some(_) => return Err(MetadataError("\"shm_epoch\" is not a uint32".into())),
        };
        let flag = |name: &str| -> Result<bool, MetadataError> {
            match value.get(name) {
                None => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(MetadataError(format!("{name:?} is not a bool"))),
            }
        };
        Ok(AgentMetadata {
            shm_epoch,
            tcp_tls: flag("tcp_tls")?,
            tcp_digests: flag("tcp_digests")?,
            agent: text("agent")?.unwrap_or_default(),
            shm: text("shm")?,
            tcp: text("tcp")?,
            shm_token: bin("shm_token")?,
            tcp_key: bin("tcp_key")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrips_and_refuses_what_is_not_a_map() {
        let m = AgentMetadata {
            agent: "n1".into(),
            shm: Some("kvpeer-1".into()),
            tcp: Some("127.0.0.1:5711".into()),
            shm_token: Some(vec![7; 32]),
            tcp_key: Some(vec![9; 32]),
            shm_epoch: Some(u32::MAX),
            tcp_tls: true,
            tcp_digests: true,
        };
        assert_eq!(AgentMetadata::decode(&m.encode()), Ok(m));
        assert!(
            AgentMetadata::decode(b"\x81\xa7tcp_tls\x01").is_err(),
            "not a bool"
        );
        assert!(
            AgentMetadata::decode(b"\x81\xabtcp_digests\x01").is_err(),
            "not a bool"
        );
        let bare = AgentMetadata {
            agent: "n2".into(),
            ..Default::default()
        };
        assert_eq!(AgentMetadata::decode(&bare.encode()), Ok(bare));
        assert!(AgentMetadata::decode(b"\x93\x01\x02\x03").is_err());
        assert!(AgentMetadata::decode(b"nixl-opaque-blob").is_err());
        assert!(AgentMetadata::decode(b"\x81\xa3shm\x05").is_err());
        // An epoch past 32 bits, or of another type, is refused.
        assert!(
            AgentMetadata::decode(b"\x81\xa9shm_epoch\xcf\x00\x00\x00\x01\x00\x00\x00\x00")
                .is_err()
        );
        assert!(AgentMetadata::decode(b"\x81\xa9shm_epoch\xa1x").is_err());
    }
}
