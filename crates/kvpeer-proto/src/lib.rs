//! The control messages of vLLM's peer-to-peer KV-cache tier, wire-compatible with vLLM
//! 0.27–0.34 (README.md, "Supported vLLM releases").
//!
//! Every control payload is one msgpack map with a `type` field. This crate turns payloads into
//! typed [`Message`]s and back:
//!
//! * **Encoding is byte-identical to vLLM's** (msgspec): fields in the order of vLLM's send
//!   sites, bytes as msgpack `bin`, the smallest int encodings, `u64` where a value may exceed
//!   `i64`. It refuses to encode anything a peer would have to reject.
//! * **Decoding accepts what vLLM accepts** (any field order, unknown fields ignored,
//!   `config_fingerprint` optional) and classifies what it does not into the three outcomes of
//!   [`DecodeError`]: undecodable (drop), ignored (log), protocol error (disconnect).
//! * **Hostile input is cheap**: no panics, no allocation driven by an unchecked length, bounded
//!   nesting and payload size ([`DecodeLimits`]), trailing bytes rejected, linear time.
//! * **Large payloads can be decoded a slice at a time** ([`SlicedDecode`]: at most so many
//!   items a step, the same message or the same first error as [`decode_with_limits`]), so a
//!   node serves others between two steps of a 131,072-key lookup.
//!
//! Pure: no I/O, no clock, no threads; callable from any thread.
//!
//! ```
//! use kvpeer_proto::{decode, KvRequestId, Message, OffloadKey, RoundSeq, Fetch};
//!
//! let fetch = Message::Fetch(Fetch {
//!     kv_request_id: KvRequestId::from("req-1"),
//!     keys: vec![OffloadKey::from_parts(&[0xab; 32], 0)],
//!     block_indexes: vec![13],
//!     round_seq: RoundSeq(0),
//! });
//! let bytes = fetch.encode()?;
//! assert_eq!(decode(&bytes)?, fetch);
//!
//! // A fetch whose lists differ in length is a protocol error: the peer gets disconnected.
//! let bad = kvpeer_proto::json::payload_from_json(&serde_json::json!({
//!     "type": "fetch", "kv_request_id": "r", "keys": [], "block_indexes": [1], "round_seq": 0
//! }))?;
//! let err = decode(&bad).unwrap_err();
//! assert_eq!(err.outcome(), kvpeer_proto::Outcome::ProtocolError);
//! assert_eq!(
//!     err.to_string(),
//!     "protocol error: fetch: block_indexes: has 1 entries but keys has 0"
//! );
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![forbid(unsafe_code)]

mod addr;
mod decode;
mod error;
pub mod events;
pub mod json;
mod limits;
mod message;
mod message_type;
mod reader;
mod sliced;
mod types;
mod value;
mod writer;

pub use addr::{is_peer_ip, AddrError, Host, PeerAddr};
pub use decode::{decode, decode_with_limits};
pub use error::{
    DecodeError, EncodeError, FieldError, FieldPath, IgnoredReason, MsgpackError, MsgpackErrorKind,
    Outcome, ProtocolError,
};
pub use limits::DecodeLimits;
pub use message::{
    Abort, Connect, ConnectAck, Disconnect, Fetch, Lookup, LookupResp, Message, MessageType,
    TransferDone,
};
pub use sliced::SlicedDecode;
pub use types::{KvRequestId, OffloadKey, PeerId, PeerIdError, RoundSeq, GROUP_INDEX_LEN};
pub use value::Value;
