//! The JSON form of payloads and messages, as used by the wire vectors and `kvpeer wire`.
//!
//! msgpack maps become JSON objects (entries in wire order), bytes become `{"$bin": "<hex>"}`,
//! extensions become `{"$ext": [type, "<hex>"]}`. Conversions between a [`Message`] and JSON go
//! through the msgpack bytes, so the JSON form obeys exactly the rules of the wire: a message
//! is valid in JSON iff its bytes decode to it.
//!
//! Lossy corners, none of which a valid message has: a map key that is not a str is written as
//! the JSON text of the key; a NaN or infinite float becomes `null`.

use serde_json::{Map, Number, Value as Json};

use crate::decode::decode_with_limits;
use crate::error::{DecodeError, EncodeError, MsgpackError};
use crate::limits::DecodeLimits;
use crate::message::Message;
use crate::value::Value;

/// The JSON key that marks bytes.
pub const BIN_KEY: &str = "$bin";
/// The JSON key that marks a msgpack extension.
pub const EXT_KEY: &str = "$ext";

/// Why a JSON document is not a payload, or not a valid message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum JsonError {
    /// A `{"$bin": ...}` or `{"$ext": ...}` object that is malformed.
    #[error("at {path}: {reason}")]
    Form {
        /// JSON pointer to the offending value.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The value cannot be encoded as msgpack.
    #[error(transparent)]
    Encode(#[from] EncodeError),
    /// The value encodes, but is not a valid message.
    #[error("not a valid message ({kind}): {0}", kind = .0.outcome())]
    Invalid(#[from] DecodeError),
}

/// A msgpack value in JSON form.
pub fn value_to_json(value: &Value) -> Json {
    match value {
        Value::Nil => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Uint(v) => Json::Number(Number::from(*v)),
        Value::NegInt(v) => Json::Number(Number::from(*v)),
        Value::Float(v) => Number::from_f64(*v).map_or(Json::Null, Json::Number),
        Value::Str(s) => Json::String(s.clone()),
        Value::Bin(b) => tagged(BIN_KEY, Json::String(hex::encode(b))),
        Value::Ext(tag, data) => tagged(
            EXT_KEY,
            Json::Array(vec![Json::from(*tag), Json::String(hex::encode(data))]),
        ),
        Value::Array(items) => Json::Array(items.iter().map(value_to_json).collect()),
        Value::Map(entries) => {
            let mut object = Map::with_capacity(entries.len());
            for (k, v) in entries {
                let key = match k {
                    Value::Str(s) => s.clone(),
                    other => value_to_json(other).to_string(),
                };
                object.insert(key, value_to_json(v));
            }
            Json::Object(object)
        }
    }
}

fn tagged(key: &str, inner: Json) -> Json {
    let mut object = Map::with_capacity(1);
    object.insert(key.to_owned(), inner);
    Json::Object(object)
}

/// A JSON document as a msgpack value: integers become ints, other numbers floats.
pub fn value_from_json(json: &Json) -> Result<Value, JsonError> {
    from_json_at(json, &mut String::new())
}

fn from_json_at(json: &Json, path: &mut String) -> Result<Value, JsonError> {
    let form_error = |path: &str, reason: &str| JsonError::Form {
        path: if path.is_empty() {
            "/".into()
        } else {
            path.into()
        },
        reason: reason.into(),
    };
    Ok(match json {
        Json::Null => Value::Nil,
        Json::Bool(b) => Value::Bool(*b),
        Json::Number(n) => {
            if let Some(v) = n.as_u64() {
                Value::Uint(v)
            } else if let Some(v) = n.as_i64() {
                Value::NegInt(v)
            } else {
                Value::Float(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::Str(s.clone()),
        Json::Array(items) => {
            let mut out = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let len = path.len();
                path.push_str(&format!("/{i}"));
                out.push(from_json_at(item, path)?);
                path.truncate(len);
            }
            Value::Array(out)
        }
        Json::Object(object) => {
            if object.len() == 1 {
                if let Some(inner) = object.get(BIN_KEY) {
                    let hex_text = inner
                        .as_str()
                        .ok_or_else(|| form_error(path, "$bin must be a hex string"))?;
                    let bytes = hex::decode(hex_text)
                        .map_err(|e| form_error(path, &format!("$bin is not hex: {e}")))?;
                    return Ok(Value::Bin(bytes));
                }
                if let Some(inner) = object.get(EXT_KEY) {
                    return ext_from_json(inner).ok_or_else(|| {
                        form_error(path, "$ext must be [type -128..127, hex string]")
                    });
                }
            }
            let mut entries = Vec::with_capacity(object.len());
            for (k, v) in object {
                let len = path.len();
                path.push('/');
                path.push_str(&k.replace('~', "~0").replace('/', "~1"));
                let value = from_json_at(v, path)?;
                path.truncate(len);
                entries.push((Value::Str(k.clone()), value));
            }
            Value::Map(entries)
        }
    })
}

fn ext_from_json(json: &Json) -> Option<Value> {
    let [tag, data] = json.as_array()?.as_slice() else {
        return None;
    };
    let tag = i8::try_from(tag.as_i64()?).ok()?;
    let data = hex::decode(data.as_str()?).ok()?;
    Some(Value::Ext(tag, data))
}

/// A message in JSON form, fields in wire order.
pub fn message_to_json(message: &Message) -> Result<Json, JsonError> {
    let bytes = message.encode()?;
    let value = Value::decode(&bytes, &DecodeLimits::default()).map_err(DecodeError::from)?;
    Ok(value_to_json(&value))
}

/// A message from its JSON form, validated as if it had arrived on the wire (unknown fields
/// are ignored, as the decoder ignores them).
pub fn message_from_json(json: &Json) -> Result<Message, JsonError> {
    let payload = payload_from_json(json)?;
    Ok(decode_with_limits(&payload, &DecodeLimits::default())?)
}

/// The msgpack bytes of a JSON document, entries in the document's order (so a vector's JSON
/// gives back the vector's exact bytes), without checking that they form a valid message.
pub fn payload_from_json(json: &Json) -> Result<Vec<u8>, JsonError> {
    Ok(value_from_json(json)?.encode()?)
}

/// A payload in JSON form, whatever it holds.
pub fn payload_to_json(payload: &[u8], limits: &DecodeLimits) -> Result<Json, MsgpackError> {
    Ok(value_to_json(&Value::decode(payload, limits)?))
}
