//! Errors of decoding and encoding control messages.
//!
//! A payload that fails to decode falls into exactly one of three classes, each with its own
//! consequence for the session that received it (see [`Outcome`]):
//!
//! * [`DecodeError::Undecodable`]: not a well-formed msgpack value within the limits. The control
//!   channel drops it; the session is untouched (vLLM: `msgspec` raised, the transport logged it).
//! * [`DecodeError::Ignored`]: a well-formed value that is no known message (not a map, no `type`,
//!   an unknown `type`). It is logged and the session stays up (vLLM: the dispatch warning branch).
//! * [`DecodeError::Protocol`]: a known message type whose fields fail validation. The session
//!   sends `disconnect` and closes (vLLM: `ValueError` from `validate()`).
//!
//! Every error says where: the byte offset for msgpack errors, the message type and field (with
//! the list index) for protocol errors.

use std::fmt;

use crate::message_type::MessageType;

/// The three ways a payload can fail, plus success, as named in the wire vectors' `expect`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Decodes to a known, valid message.
    Valid,
    /// The control channel drops the payload; the session is untouched.
    Undecodable,
    /// Decodes, but is no known message: logged and ignored, the session stays up.
    Ignored,
    /// A known message type failing validation: the session sends `disconnect` and closes.
    ProtocolError,
}

impl Outcome {
    /// The name used by the wire vectors and by `kvpeer wire decode`.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Valid => "valid",
            Outcome::Undecodable => "undecodable",
            Outcome::Ignored => "ignored",
            Outcome::ProtocolError => "protocol_error",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a payload could not be decoded into a [`Message`](crate::Message).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// Not well-formed msgpack within the limits: drop the payload.
    #[error("undecodable payload: {0}")]
    Undecodable(#[from] MsgpackError),
    /// Well-formed msgpack that is no known message: log it and carry on.
    #[error("ignored payload: {0}")]
    Ignored(#[from] IgnoredReason),
    /// A known message that fails validation: the peer misbehaved; disconnect it.
    #[error("protocol error: {0}")]
    Protocol(#[from] ProtocolError),
}

impl DecodeError {
    /// Which of the three failure classes this is.
    pub fn outcome(&self) -> Outcome {
        match self {
            DecodeError::Undecodable(_) => Outcome::Undecodable,
            DecodeError::Ignored(_) => Outcome::Ignored,
            DecodeError::Protocol(_) => Outcome::ProtocolError,
        }
    }
}

/// A payload that is not well-formed msgpack, or breaks a decoding limit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("at byte {offset}: {kind}")]
pub struct MsgpackError {
    /// Offset in the payload of the marker byte of the offending value.
    pub offset: usize,
    /// What is wrong there.
    pub kind: MsgpackErrorKind,
}

/// What is wrong with a msgpack payload.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MsgpackErrorKind {
    /// The payload has no bytes at all.
    #[error("empty payload: no msgpack value")]
    Empty,
    /// The payload is larger than [`DecodeLimits::max_payload_bytes`](crate::DecodeLimits).
    #[error("payload of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Size of the payload.
        size: usize,
        /// The configured limit.
        limit: usize,
    },
    /// A fixed-size field (an int, a float, a length) runs past the end of the payload.
    #[error("truncated: {needed} bytes needed, {available} available")]
    Truncated {
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the payload.
        available: usize,
    },
    /// `0xc1`, the one marker byte msgpack never uses.
    #[error("reserved marker byte 0x{0:02x}")]
    ReservedMarker(u8),
    /// A length header claims more than the remaining payload could hold. Checked before any
    /// allocation, so a 4 GiB claim in an 11-byte payload costs nothing.
    #[error("{what} header claims {declared} {unit} but only {remaining} bytes remain")]
    LengthExceedsPayload {
        /// `str`, `bin`, `ext`, `array` or `map`.
        what: &'static str,
        /// The length in the header.
        declared: u64,
        /// `bytes`, `items` or `entries`.
        unit: &'static str,
        /// Bytes left in the payload after the header.
        remaining: usize,
    },
    /// A msgpack str whose bytes are not UTF-8.
    #[error("str is not valid UTF-8: {0}")]
    InvalidUtf8(std::str::Utf8Error),
    /// Containers nested deeper than [`DecodeLimits::max_depth`](crate::DecodeLimits).
    #[error("containers nested deeper than the limit of {limit} levels")]
    TooDeep {
        /// The configured limit.
        limit: usize,
    },
    /// Bytes left over after one complete msgpack value.
    #[error("{count} trailing bytes after the msgpack value")]
    TrailingBytes {
        /// How many bytes are left over.
        count: usize,
    },
    /// A timestamp extension (type -1) whose data is not 4, 8 or 12 bytes, which msgpack's
    /// timestamp format forbids (msgspec rejects it too).
    #[error("timestamp extension with {len} data bytes (must be 4, 8 or 12)")]
    InvalidTimestamp {
        /// Length of the extension data.
        len: usize,
    },
}

/// Why a well-formed msgpack value is not a control message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IgnoredReason {
    /// The top-level value is not a map.
    #[error("payload is a msgpack {0}, not a map")]
    NotAMap(&'static str),
    /// The map has no `"type"` key.
    #[error("map has no \"type\" field")]
    MissingType,
    /// `"type"` is present but not a str.
    #[error("\"type\" is a msgpack {0}, not a str")]
    TypeNotStr(&'static str),
    /// `"type"` names no message of the protocol (shown cut to 64 characters).
    #[error("unknown message type {0:?}")]
    UnknownType(String),
}

/// A known message type with a field that fails validation: the peer misbehaved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message_type}: {field}: {reason}")]
pub struct ProtocolError {
    /// The message's `type`.
    pub message_type: MessageType,
    /// The field at fault.
    pub field: FieldPath,
    /// What is wrong with it.
    pub reason: FieldError,
}

/// A field name, with the list index when one element of a list is at fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldPath {
    /// Field name as on the wire.
    pub name: &'static str,
    /// Index into the list, when the field is a list and one element is at fault.
    pub index: Option<usize>,
}

impl FieldPath {
    /// The whole field.
    pub fn field(name: &'static str) -> Self {
        FieldPath { name, index: None }
    }

    /// One element of a list field.
    pub fn element(name: &'static str, index: usize) -> Self {
        FieldPath {
            name,
            index: Some(index),
        }
    }
}

impl fmt::Display for FieldPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.index {
            Some(i) => write!(f, "{}[{}]", self.name, i),
            None => f.write_str(self.name),
        }
    }
}

/// What is wrong with one field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FieldError {
    /// A required field is absent.
    #[error("required field is missing")]
    Missing,
    /// The field has the wrong msgpack type.
    #[error("expected {expected}, got {got}")]
    WrongType {
        /// The type the protocol requires.
        expected: &'static str,
        /// The msgpack type found.
        got: &'static str,
    },
    /// An int that must be >= 0 is negative.
    #[error("expected a non-negative int, got {0}")]
    Negative(i64),
    /// An int that must be > 0 is zero (or negative).
    #[error("expected a positive int, got {0}")]
    NotPositive(i64),
    /// Two parallel lists differ in length.
    #[error("has {len} entries but {other} has {other_len}")]
    LengthMismatch {
        /// Length of this list.
        len: usize,
        /// Name of the list it must match.
        other: &'static str,
        /// Length of that list.
        other_len: usize,
    },
    /// A list longer than [`DecodeLimits::max_list_len`](crate::DecodeLimits).
    #[error("{len} entries exceed the limit of {limit}")]
    TooManyEntries {
        /// Length of the list.
        len: usize,
        /// The configured limit.
        limit: usize,
    },
}

/// Why a message could not be encoded. Encoding refuses anything a peer would have to reject,
/// so kvpeer never sends a message that costs it its session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// The message breaks a rule of the protocol (the same rules decoding enforces).
    #[error("refusing to encode an invalid message: {0}")]
    Invalid(#[from] ProtocolError),
    /// A str, bin or list longer than msgpack's 32-bit length field can carry.
    #[error("{what} of {len} elements is longer than msgpack allows (2^32 - 1)")]
    TooLong {
        /// `str`, `bin`, `array` or `map`.
        what: &'static str,
        /// Its length.
        len: usize,
    },
}
