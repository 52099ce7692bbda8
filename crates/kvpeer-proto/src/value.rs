//! Any msgpack value, owned: for inspecting payloads as they are on the wire, unknown fields
//! included, and for crafting payloads field by field (the `kvpeer wire` tools, tests).
//!
//! Not on the hot path: the session decodes straight into [`Message`](crate::Message). The same
//! bounded reader and limits apply, so a hostile payload costs no more here than there.

use crate::error::{EncodeError, MsgpackError};
use crate::limits::DecodeLimits;
use crate::reader::{Reader, Token};
use crate::writer::{
    write_array_len, write_bin, write_bool, write_ext, write_f64, write_int, write_map_len,
    write_nil, write_str, write_uint,
};

/// One msgpack value. Maps keep their entries in wire order, duplicates included.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `nil`
    Nil,
    /// `true` / `false`
    Bool(bool),
    /// An int >= 0.
    Uint(u64),
    /// An int < 0.
    NegInt(i64),
    /// A float (32-bit floats are widened).
    Float(f64),
    /// A UTF-8 str.
    Str(String),
    /// Bytes.
    Bin(Vec<u8>),
    /// A list.
    Array(Vec<Value>),
    /// A map, entries in wire order.
    Map(Vec<(Value, Value)>),
    /// An extension: type tag and data.
    Ext(i8, Vec<u8>),
}

impl Value {
    /// Decodes one whole payload (no trailing bytes) under `limits`.
    pub fn decode(payload: &[u8], limits: &DecodeLimits) -> Result<Value, MsgpackError> {
        let max_depth = limits.effective_max_depth();
        limits.check_size(payload)?;
        // Check first, build second: the build may then recurse, since the depth is bounded.
        let mut check = Reader::new(payload);
        check.skip_value(0, max_depth)?;
        check.finish()?;
        build(&mut Reader::new(payload))
    }

    /// The msgpack encoding, with msgspec's choice of markers and entries in the given order.
    pub fn encode(&self) -> Result<Vec<u8>, EncodeError> {
        let mut out = Vec::new();
        self.encode_into(&mut out)?;
        Ok(out)
    }

    /// Appends the msgpack encoding to `out`.
    pub fn encode_into(&self, out: &mut Vec<u8>) -> Result<(), EncodeError> {
        match self {
            Value::Nil => write_nil(out),
            Value::Bool(b) => write_bool(out, *b),
            Value::Uint(v) => write_uint(out, *v),
            Value::NegInt(v) => write_int(out, *v),
            Value::Float(v) => write_f64(out, *v),
            Value::Str(s) => write_str(out, s)?,
            Value::Bin(b) => write_bin(out, b)?,
            Value::Ext(tag, data) => write_ext(out, *tag, data)?,
            Value::Array(items) => {
                write_array_len(out, items.len())?;
                for item in items {
                    item.encode_into(out)?;
                }
            }
            Value::Map(entries) => {
                write_map_len(out, entries.len())?;
                for (k, v) in entries {
                    k.encode_into(out)?;
                    v.encode_into(out)?;
                }
            }
        }
        Ok(())
    }

    /// The entry under a str key (the last one, as a dict would keep), if this is a map.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries
                .iter()
                .rev()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }
}

/// Most elements reserved up front for one container: a header may claim as many elements as
/// there are bytes left, and each element takes 32 bytes here, so trust grows with the data.
const MAX_PREALLOCATED: usize = 4096;

/// Builds a value the caller has already checked to be well-formed within the depth limit.
fn build(r: &mut Reader<'_>) -> Result<Value, MsgpackError> {
    Ok(match r.next_token()? {
        Token::Nil => Value::Nil,
        Token::Bool(b) => Value::Bool(b),
        Token::Uint(v) => Value::Uint(v),
        Token::NegInt(v) => Value::NegInt(v),
        Token::Float(v) => Value::Float(v),
        Token::Str(s) => Value::Str(s.to_owned()),
        Token::Bin(b) => Value::Bin(b.to_vec()),
        Token::Ext(tag, data) => Value::Ext(tag, data.to_vec()),
        Token::Array(n) => {
            let mut items = Vec::with_capacity(n.min(MAX_PREALLOCATED));
            for _ in 0..n {
                items.push(build(r)?);
            }
            Value::Array(items)
        }
        Token::Map(n) => {
            let mut entries = Vec::with_capacity(n.min(MAX_PREALLOCATED));
            for _ in 0..n {
                let k = build(r)?;
                let v = build(r)?;
                entries.push((k, v));
            }
            Value::Map(entries)
        }
    })
}
