//! The nine control messages of vLLM's P2P KV tier, and their byte-exact encoding.
//!
//! Field order on the wire is the order of vLLM's send sites (`type` first), so an encoded
//! message is byte-identical to what a vLLM 0.27–0.34 peer sends. Receivers look fields up by
//! name, so order only matters for that identity. Encoding checks the rules decoding enforces:
//! kvpeer never sends a message a peer would have to reject.

use crate::error::{EncodeError, FieldError, FieldPath, ProtocolError};
use crate::types::{KvRequestId, OffloadKey, PeerId, RoundSeq};
use crate::writer::{write_array_len, write_bin, write_bool, write_map_len, write_str, write_uint};

pub use crate::message_type::MessageType;

/// `connect`: each side's handshake, carrying what the peer needs to write into its memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Connect {
    /// The sender's identity, `host:port`.
    pub peer_id: PeerId,
    /// Data-plane metadata (NIXL's opaque blob, or kvpeer's map of planes).
    pub agent_metadata: Vec<u8>,
    /// Base address of the sender's block region (may exceed `i64::MAX`).
    pub base_addr: u64,
    /// Blocks in the sender's region; > 0.
    pub num_blocks: u64,
    /// Bytes per block; > 0 and equal on both sides.
    pub block_len: u64,
    /// First 16 hex digits of the sha256 of the model configuration. Optional on the wire
    /// (`None` = absent, read as empty); empty is compatible with anything.
    pub config_fingerprint: Option<String>,
    /// The sender's prefix-cache hash seed; must equal the receiver's exactly.
    pub hash_seed: String,
    /// kvpeer's extension, `kvpeer_auth` (bin), sent last and only when set: the sender's proof
    /// that it holds the shared secret (docs/wire-format.md). vLLM ignores unknown fields, so a
    /// `connect` without it is byte-identical to vLLM's and one with it is still accepted.
    pub kvpeer_auth: Option<Vec<u8>>,
}

impl Connect {
    /// The fingerprint as vLLM reads it: absent means empty.
    pub fn fingerprint(&self) -> &str {
        self.config_fingerprint.as_deref().unwrap_or("")
    }
}

/// `connect_ack`: the handshake is accepted and the sender has registered the peer's memory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectAck {
    /// The sender's identity, `host:port`.
    pub peer_id: PeerId,
}

/// `lookup`: which of these keys does the producer hold? Answered by one `lookup_resp`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lookup {
    /// The request the probes belong to.
    pub kv_request_id: KvRequestId,
    /// Keys to probe.
    pub keys: Vec<OffloadKey>,
    /// The round whose fetch the pinned hits are parked for.
    pub round_seq: RoundSeq,
}

/// `lookup_resp`: per-key answers, `keys[i]` held iff `hits[i]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LookupResp {
    /// The request answered.
    pub kv_request_id: KvRequestId,
    /// Keys answered, in the lookup's wire order (duplicates included).
    pub keys: Vec<OffloadKey>,
    /// Parallel to `keys`.
    pub hits: Vec<bool>,
}

/// `fetch`: write `keys[i]` into the sender's block `block_indexes[i]`. Empty lists are the
/// terminal "request finished" fetch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    /// The request.
    pub kv_request_id: KvRequestId,
    /// Keys wanted.
    pub keys: Vec<OffloadKey>,
    /// Destination block index for each key, parallel to `keys`.
    pub block_indexes: Vec<u64>,
    /// The round this fetch closes.
    pub round_seq: RoundSeq,
}

impl Fetch {
    /// Whether this is the terminal "request finished" fetch (no keys).
    pub fn is_terminal(&self) -> bool {
        self.keys.is_empty() && self.block_indexes.is_empty()
    }
}

/// `transfer_done`: every block of a round is written (`success`), or the round failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TransferDone {
    /// The request.
    pub kv_request_id: KvRequestId,
    /// Whether every block landed.
    pub success: bool,
    /// The round completed.
    pub round_seq: RoundSeq,
}

/// `abort_fetch`: cancel a round. Also used for `abort_ack`, which echoes the round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abort {
    /// The request.
    pub kv_request_id: KvRequestId,
    /// The round.
    pub round_seq: RoundSeq,
}

/// `disconnect`: the session ends. vLLM's has no fields (`Disconnect::default()` is its bytes).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Disconnect {
    /// kvpeer's extension, `kvpeer_reason` (str), sent only when a node refuses a peer's
    /// `connect`: why, with both sides' values, written for the refused peer (vLLM, like every
    /// reader of unknown fields, skips it). Untrusted text: whoever shows it bounds and cleans it.
    pub kvpeer_reason: Option<String>,
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Message {
    /// `connect`
    Connect(Connect),
    /// `connect_ack`
    ConnectAck(ConnectAck),
    /// `disconnect`
    Disconnect(Disconnect),
    /// `lookup`
    Lookup(Lookup),
    /// `lookup_resp`
    LookupResp(LookupResp),
    /// `fetch`
    Fetch(Fetch),
    /// `transfer_done`
    TransferDone(TransferDone),
    /// `abort_fetch`
    AbortFetch(Abort),
    /// `abort_ack`
    AbortAck(Abort),
}

/// Field names on the wire, shared by the encoder and the decoder.
pub(crate) mod field {
    pub(crate) const TYPE: &str = "type";
    pub(crate) const PEER_ID: &str = "peer_id";
    pub(crate) const AGENT_METADATA: &str = "agent_metadata";
    pub(crate) const BASE_ADDR: &str = "base_addr";
    pub(crate) const NUM_BLOCKS: &str = "num_blocks";
    pub(crate) const BLOCK_LEN: &str = "block_len";
    pub(crate) const CONFIG_FINGERPRINT: &str = "config_fingerprint";
    pub(crate) const HASH_SEED: &str = "hash_seed";
    pub(crate) const KVPEER_AUTH: &str = "kvpeer_auth";
    pub(crate) const KVPEER_REASON: &str = "kvpeer_reason";
    pub(crate) const KV_REQUEST_ID: &str = "kv_request_id";
    pub(crate) const KEYS: &str = "keys";
    pub(crate) const HITS: &str = "hits";
    pub(crate) const BLOCK_INDEXES: &str = "block_indexes";
    pub(crate) const ROUND_SEQ: &str = "round_seq";
    pub(crate) const SUCCESS: &str = "success";
}

impl Message {
    /// vLLM's `disconnect`: no fields.
    pub const DISCONNECT: Message = Message::Disconnect(Disconnect {
        kvpeer_reason: None,
    });

    /// The message's `type`.
    pub fn message_type(&self) -> MessageType {
        match self {
            Message::Connect(_) => MessageType::Connect,
            Message::ConnectAck(_) => MessageType::ConnectAck,
            Message::Disconnect(_) => MessageType::Disconnect,
            Message::Lookup(_) => MessageType::Lookup,
            Message::LookupResp(_) => MessageType::LookupResp,
            Message::Fetch(_) => MessageType::Fetch,
            Message::TransferDone(_) => MessageType::TransferDone,
            Message::AbortFetch(_) => MessageType::AbortFetch,
            Message::AbortAck(_) => MessageType::AbortAck,
        }
    }

    /// The request a message is about, for messages that name one.
    pub fn kv_request_id(&self) -> Option<&KvRequestId> {
        match self {
            Message::Lookup(m) => Some(&m.kv_request_id),
            Message::LookupResp(m) => Some(&m.kv_request_id),
            Message::Fetch(m) => Some(&m.kv_request_id),
            Message::TransferDone(m) => Some(&m.kv_request_id),
            Message::AbortFetch(m) | Message::AbortAck(m) => Some(&m.kv_request_id),
            Message::Connect(_) | Message::ConnectAck(_) | Message::Disconnect(_) => None,
        }
    }

    /// Checks the rules of protocol.py's `validate()` that the field types cannot express:
    /// positive `num_blocks`/`block_len`, and parallel lists of equal length. Decoding runs
    /// this on every message; encoding refuses a message that fails it.
    pub fn validate(&self) -> Result<(), ProtocolError> {
        let ty = self.message_type();
        let fail = |name, reason| ProtocolError {
            message_type: ty,
            field: FieldPath::field(name),
            reason,
        };
        let positive = |name, v: u64| {
            if v == 0 {
                Err(fail(name, FieldError::NotPositive(0)))
            } else {
                Ok(())
            }
        };
        let same_len = |name, len: usize, other, other_len: usize| {
            if len != other_len {
                Err(fail(
                    name,
                    FieldError::LengthMismatch {
                        len,
                        other,
                        other_len,
                    },
                ))
            } else {
                Ok(())
            }
        };
        match self {
            Message::Connect(m) => {
                positive(field::NUM_BLOCKS, m.num_blocks)?;
                positive(field::BLOCK_LEN, m.block_len)
            }
            Message::Fetch(m) => same_len(
                field::BLOCK_INDEXES,
                m.block_indexes.len(),
                field::KEYS,
                m.keys.len(),
            ),
            Message::LookupResp(m) => {
                same_len(field::HITS, m.hits.len(), field::KEYS, m.keys.len())
            }
            _ => Ok(()),
        }
    }

    /// Appends the msgpack encoding to `out`, byte-identical to vLLM's encoder.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        self.validate()?;
        let start = out.len();
        let result = self.write(out);
        if result.is_err() {
            out.truncate(start);
        }
        result
    }

    /// The msgpack encoding, byte-identical to vLLM's encoder.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::with_capacity(self.encoded_len_hint());
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// A close upper estimate of the encoded size, to size buffers in one allocation.
    pub fn encoded_len_hint(&self) -> usize {
        const KEY: usize = 40;
        const HEADER: usize = 64;
        match self {
            Message::Connect(m) => {
                HEADER * 3
                    + m.agent_metadata.len()
                    + m.hash_seed.len()
                    + m.kvpeer_auth.as_ref().map_or(0, Vec::len)
            }
            Message::Lookup(m) => HEADER + m.kv_request_id.as_str().len() + m.keys.len() * KEY,
            Message::LookupResp(m) => {
                HEADER + m.kv_request_id.as_str().len() + m.keys.len() * (KEY + 1)
            }
            Message::Fetch(m) => HEADER + m.kv_request_id.as_str().len() + m.keys.len() * (KEY + 9),
            Message::TransferDone(m) => HEADER + m.kv_request_id.as_str().len(),
            Message::AbortFetch(m) | Message::AbortAck(m) => {
                HEADER + m.kv_request_id.as_str().len()
            }
            Message::ConnectAck(m) => HEADER + m.peer_id.as_str().len(),
            Message::Disconnect(m) => HEADER + m.kvpeer_reason.as_ref().map_or(0, String::len),
        }
    }

    fn write(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        let w = &mut MapWriter { out };
        let ty = self.message_type().as_str();
        match self {
            Message::Connect(m) => {
                let fields = 7
                    + usize::from(m.config_fingerprint.is_some())
                    + usize::from(m.kvpeer_auth.is_some());
                w.begin(fields, ty)?;
                w.str(field::PEER_ID, m.peer_id.as_str())?;
                w.bin(field::AGENT_METADATA, &m.agent_metadata)?;
                w.uint(field::BASE_ADDR, m.base_addr)?;
                w.uint(field::NUM_BLOCKS, m.num_blocks)?;
                w.uint(field::BLOCK_LEN, m.block_len)?;
                if let Some(fp) = &m.config_fingerprint {
                    w.str(field::CONFIG_FINGERPRINT, fp)?;
                }
                w.str(field::HASH_SEED, &m.hash_seed)?;
                if let Some(auth) = &m.kvpeer_auth {
                    w.bin(field::KVPEER_AUTH, auth)?;
                }
            }
            Message::ConnectAck(m) => {
                w.begin(2, ty)?;
                w.str(field::PEER_ID, m.peer_id.as_str())?;
            }
            Message::Disconnect(m) => {
                w.begin(1 + usize::from(m.kvpeer_reason.is_some()), ty)?;
                if let Some(reason) = &m.kvpeer_reason {
                    w.str(field::KVPEER_REASON, reason)?;
                }
            }
            Message::Lookup(m) => {
                w.begin(4, ty)?;
                w.str(field::KV_REQUEST_ID, m.kv_request_id.as_str())?;
                w.keys(field::KEYS, &m.keys)?;
                w.uint(field::ROUND_SEQ, m.round_seq.0)?;
            }
            Message::LookupResp(m) => {
                w.begin(4, ty)?;
                w.str(field::KV_REQUEST_ID, m.kv_request_id.as_str())?;
                w.keys(field::KEYS, &m.keys)?;
                w.name(field::HITS)?;
                write_array_len(w.out, m.hits.len())?;
                for &hit in &m.hits {
                    write_bool(w.out, hit);
                }
            }
            Message::Fetch(m) => {
                w.begin(5, ty)?;
                w.str(field::KV_REQUEST_ID, m.kv_request_id.as_str())?;
                w.keys(field::KEYS, &m.keys)?;
                w.name(field::BLOCK_INDEXES)?;
                write_array_len(w.out, m.block_indexes.len())?;
                for &idx in &m.block_indexes {
                    write_uint(w.out, idx);
                }
                w.uint(field::ROUND_SEQ, m.round_seq.0)?;
            }
            Message::TransferDone(m) => {
                w.begin(4, ty)?;
                w.str(field::KV_REQUEST_ID, m.kv_request_id.as_str())?;
                w.name(field::SUCCESS)?;
                write_bool(w.out, m.success);
                w.uint(field::ROUND_SEQ, m.round_seq.0)?;
            }
            Message::AbortFetch(m) | Message::AbortAck(m) => {
                w.begin(3, ty)?;
                w.str(field::KV_REQUEST_ID, m.kv_request_id.as_str())?;
                w.uint(field::ROUND_SEQ, m.round_seq.0)?;
            }
        }
        Ok(())
    }
}

/// Writes the top-level map one `name: value` pair at a time.
struct MapWriter<'o> {
    out: &'o mut Vec<u8>,
}

impl MapWriter<'_> {
    fn begin(&mut self, fields: usize, ty: &str) -> Result<(), EncodeError> {
        write_map_len(self.out, fields)?;
        self.str(field::TYPE, ty)
    }

    fn name(&mut self, name: &str) -> Result<(), EncodeError> {
        write_str(self.out, name)
    }

    fn str(&mut self, name: &str, v: &str) -> Result<(), EncodeError> {
        self.name(name)?;
        write_str(self.out, v)
    }

    fn bin(&mut self, name: &str, v: &[u8]) -> Result<(), EncodeError> {
        self.name(name)?;
        write_bin(self.out, v)
    }

    fn uint(&mut self, name: &str, v: u64) -> Result<(), EncodeError> {
        self.name(name)?;
        write_uint(self.out, v);
        Ok(())
    }

    fn keys(&mut self, name: &str, keys: &[OffloadKey]) -> Result<(), EncodeError> {
        self.name(name)?;
        write_array_len(self.out, keys.len())?;
        for key in keys {
            write_bin(self.out, key.as_bytes())?;
        }
        Ok(())
    }
}
