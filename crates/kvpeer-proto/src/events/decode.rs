//! The bounded decoder of KV event batches (see the module above for the format).

use super::{BlockHash, BlockRemoved, BlockStored, EventBatch, EventError, EventLimits, KvEvent};
use crate::reader::{Reader, Token};

/// `BlockStored`'s fields in declaration order: the positions of the array-encoded form.
const STORED_FIELDS: &[&str] = &[
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
];
/// `BlockRemoved`'s fields in declaration order.
const REMOVED_FIELDS: &[&str] = &[
    "block_hashes",
    "medium",
    "group_idx",
    "locality",
    "ownership",
];

/// Decodes one `KVEventBatch` payload under `limits`.
pub fn decode_batch(payload: &[u8], limits: &EventLimits) -> Result<EventBatch, EventError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(EventError::TooLarge {
            size: payload.len(),
            limit: limits.max_payload_bytes,
        });
    }
    let depth = limits.max_depth.max(4);
    // Well-formed and within the depth limit first; then every walk below is over checked
    // bytes, and an event's bytes can be cut out with `skip_value`.
    let mut check = Reader::new(payload);
    check.skip_value(0, depth)?;
    check.finish()?;

    let mut r = Reader::new(payload);
    let len = match r.next_token()? {
        Token::Array(n) if n >= 2 => n,
        _ => return Err(EventError::NotABatch("not a list of at least [ts, events]")),
    };
    let ts = match r.next_token()? {
        Token::Float(f) => f,
        Token::Uint(u) => u as f64,
        Token::NegInt(i) => i as f64,
        _ => return Err(EventError::NotABatch("ts is not a number")),
    };
    let count = match r.next_token()? {
        Token::Array(n) => n,
        _ => return Err(EventError::NotABatch("events is not a list")),
    };
    if count > limits.max_events {
        return Err(EventError::TooMany {
            what: "events",
            len: count,
            limit: limits.max_events,
        });
    }
    let mut events = Vec::with_capacity(count.min(4096));
    for index in 0..count {
        let start = r.position();
        r.skip_value(2, depth)?;
        events.push(decode_event(r.since(start), index, limits, depth));
    }
    let data_parallel_rank = if len >= 3 {
        match r.next_token()? {
            Token::Nil => None,
            Token::Uint(u) => i64::try_from(u).ok(),
            Token::NegInt(i) => Some(i),
            _ => return Err(EventError::NotABatch("data_parallel_rank is not an int")),
        }
    } else {
        None
    };
    // Fields a later vLLM may append.
    for _ in 3..len {
        r.skip_value(1, depth)?;
    }
    Ok(EventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

/// The kinds of event this decoder reads.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Stored,
    Removed,
}

/// One event's fields as read so far.
#[derive(Default)]
struct Fields {
    block_hashes: Option<Vec<BlockHash>>,
    stored: BlockStored,
}

fn decode_event(
    bytes: &[u8],
    index: usize,
    limits: &EventLimits,
    depth: usize,
) -> Result<KvEvent, EventError> {
    let bad = |what: String| EventError::BadEvent { index, what };
    let mut r = Reader::new(bytes);
    let mut fields = Fields::default();
    let kind = match r.next_token()? {
        Token::Map(n) => {
            // The tag may sit anywhere in the map (msgspec writes it first): find it, then
            // read the fields with the kind known.
            let tag = map_tag(bytes, n, limits, depth).map_err(bad)?;
            let Some(kind) = kind_of(&tag) else {
                return Ok(other(tag));
            };
            for _ in 0..n {
                let name = match r.next_token()? {
                    Token::Str(s) => s,
                    t => return Err(bad(format!("a field name is a {}", t.kind()))),
                };
                read_field(&mut r, kind, name, &mut fields, limits, depth).map_err(bad)?;
            }
            kind
        }
        Token::Array(n) if n >= 1 => {
            let tag = match r.next_token()? {
                Token::Str(s) => short(s, limits).map_err(bad)?,
                t => return Err(bad(format!("the tag is a {}", t.kind()))),
            };
            let Some(kind) = kind_of(&tag) else {
                return Ok(other(tag));
            };
            let names = match kind {
                Kind::Stored => STORED_FIELDS,
                Kind::Removed => REMOVED_FIELDS,
            };
            for position in 1..n {
                match names.get(position - 1) {
                    Some(name) => {
                        read_field(&mut r, kind, name, &mut fields, limits, depth).map_err(bad)?
                    }
                    None => r.skip_value(1, depth)?,
                }
            }
            kind
        }
        Token::Array(_) => return Err(bad("an empty list".into())),
        t => return Err(bad(format!("a {}, not a map or a list", t.kind()))),
    };
    let Some(block_hashes) = fields.block_hashes else {
        return Err(bad("no block_hashes".into()));
    };
    let s = fields.stored;
    Ok(match kind {
        Kind::Stored => KvEvent::Stored(BlockStored { block_hashes, ..s }),
        Kind::Removed => KvEvent::Removed(BlockRemoved {
            block_hashes,
            medium: s.medium,
            group_idx: s.group_idx,
            locality: s.locality,
            ownership: s.ownership,
        }),
    })
}

fn other(tag: String) -> KvEvent {
    if tag == "AllBlocksCleared" {
        KvEvent::AllCleared
    } else {
        KvEvent::Other(tag)
    }
}

fn kind_of(tag: &str) -> Option<Kind> {
    match tag {
        "BlockStored" => Some(Kind::Stored),
        "BlockRemoved" => Some(Kind::Removed),
        _ => None,
    }
}

/// The `type` entry of a map event of `n` entries starting at `bytes`.
fn map_tag(bytes: &[u8], n: usize, limits: &EventLimits, depth: usize) -> Result<String, String> {
    let mut r = Reader::new(bytes);
    let msgpack = |e: crate::MsgpackError| e.to_string();
    r.next_token().map_err(msgpack)?;
    for _ in 0..n {
        let key = r.next_token().map_err(msgpack)?;
        if key == Token::Str("type") {
            return match r.next_token().map_err(msgpack)? {
                Token::Str(s) => short(s, limits),
                t => Err(format!("type is a {}", t.kind())),
            };
        }
        r.skip_value(1, depth).map_err(msgpack)?;
    }
    Err("no type".into())
}

/// A string field kept, within the length limit.
fn short(s: &str, limits: &EventLimits) -> Result<String, String> {
    if s.len() > limits.max_str_bytes {
        return Err(format!(
            "a string of {} bytes, over the limit of {}",
            s.len(),
            limits.max_str_bytes
        ));
    }
    Ok(s.to_owned())
}

/// Reads field `name` of an event of `kind` into `fields` (unknown ones are skipped).
fn read_field(
    r: &mut Reader<'_>,
    kind: Kind,
    name: &str,
    fields: &mut Fields,
    limits: &EventLimits,
    depth: usize,
) -> Result<(), String> {
    let at = |e: String| format!("{name}: {e}");
    let msgpack = |e: crate::MsgpackError| format!("{name}: {e}");
    let s = &mut fields.stored;
    match (kind, name) {
        (_, "block_hashes") => {
            let n = match r.next_token().map_err(msgpack)? {
                Token::Array(n) => n,
                t => return Err(at(format!("a {}, not a list", t.kind()))),
            };
            if n > limits.max_hashes {
                return Err(at(format!(
                    "{n} hashes, over the limit of {}",
                    limits.max_hashes
                )));
            }
            let mut hashes = Vec::with_capacity(n);
            for _ in 0..n {
                hashes.push(hash(r.next_token().map_err(msgpack)?, limits).map_err(at)?);
            }
            fields.block_hashes = Some(hashes);
        }
        (Kind::Stored, "parent_block_hash") => {
            s.parent_block_hash = match r.next_token().map_err(msgpack)? {
                Token::Nil => None,
                t => Some(hash(t, limits).map_err(at)?),
            };
        }
        (Kind::Stored, "token_ids") => {
            // Ids that are not vLLM's (not ints below 2^32, or more than the limit) make the
            // event's blocks undescribable, not the event unreadable: its key still counts.
            let start = r.position();
            r.skip_value(1, depth).map_err(msgpack)?;
            let mut value = Reader::new(r.since(start));
            s.token_ids.clear();
            match value.next_token().map_err(msgpack)? {
                Token::Nil => {}
                Token::Array(n) if n <= limits.max_tokens => {
                    let mut tokens = Vec::with_capacity(n);
                    for _ in 0..n {
                        match value.next_token().map_err(msgpack)? {
                            Token::Uint(u) if u <= u64::from(u32::MAX) => tokens.push(u as u32),
                            _ => {
                                s.bad_tokens = true;
                                tokens.clear();
                                break;
                            }
                        }
                    }
                    if !s.bad_tokens {
                        s.token_ids = tokens;
                    }
                }
                Token::Array(_) => s.bad_tokens = true,
                t => return Err(at(format!("a {}, not a list", t.kind()))),
            }
        }
        (Kind::Stored, "lora_id") => {
            s.lora_id = match r.next_token().map_err(msgpack)? {
                Token::Nil => None,
                Token::Uint(u) => match i64::try_from(u) {
                    Ok(id) => Some(id),
                    Err(_) => {
                        s.bad_tokens = true;
                        None
                    }
                },
                Token::NegInt(i) => Some(i),
                t => return Err(at(format!("a {}, not an id", t.kind()))),
            };
        }
        (Kind::Stored, "extra_keys" | "lookahead_token_ids") => {
            if not_all_nil(r, depth).map_err(msgpack)? {
                s.has_extra_keys = true;
            }
        }
        (Kind::Stored, "block_size") => {
            s.block_size = match r.next_token().map_err(msgpack)? {
                Token::Uint(u) => u,
                Token::Nil => 0,
                t => return Err(at(format!("a {}, not a size", t.kind()))),
            };
        }
        (_, "medium") => s.medium = opt_str(r, limits).map_err(at)?,
        (Kind::Stored, "lora_name") => s.lora_name = opt_str(r, limits).map_err(at)?,
        (Kind::Stored, "kv_cache_spec_kind") => {
            s.kv_cache_spec_kind = opt_str(r, limits).map_err(at)?
        }
        (_, "locality") => s.locality = opt_str(r, limits).map_err(at)?,
        (_, "ownership") => s.ownership = opt_str(r, limits).map_err(at)?,
        (_, "group_idx") => {
            s.group_idx = match r.next_token().map_err(msgpack)? {
                Token::Nil => None,
                Token::Uint(u) => {
                    Some(u32::try_from(u).map_err(|_| at(format!("{u} does not fit 4 bytes")))?)
                }
                t => return Err(at(format!("a {}, not a group index", t.kind()))),
            };
        }
        _ => r.skip_value(1, depth).map_err(msgpack)?,
    }
    Ok(())
}

/// Skips one field's value; whether anything in it is not nil (nil, or a list of nils, is
/// vLLM's "none").
fn not_all_nil(r: &mut Reader<'_>, depth: usize) -> Result<bool, crate::MsgpackError> {
    let start = r.position();
    r.skip_value(1, depth)?;
    let mut value = Reader::new(r.since(start));
    match value.next_token()? {
        Token::Nil => Ok(false),
        Token::Array(n) => {
            for _ in 0..n {
                let at = value.position();
                value.skip_value(2, depth)?;
                if value.since(at) != [0xc0] {
                    return Ok(true);
                }
            }
            Ok(false)
        }
        _ => Ok(true),
    }
}

fn hash(t: Token<'_>, limits: &EventLimits) -> Result<BlockHash, String> {
    match t {
        Token::Bin(b) if !b.is_empty() && b.len() <= limits.max_hash_bytes => {
            Ok(BlockHash::Bytes(b.to_vec()))
        }
        Token::Bin(b) => Err(format!(
            "a hash of {} bytes (1 to {} accepted)",
            b.len(),
            limits.max_hash_bytes
        )),
        Token::Uint(u) => Ok(BlockHash::Int(u)),
        // Two's complement: the same 64 bits a signed publisher meant.
        Token::NegInt(i) => Ok(BlockHash::Int(i as u64)),
        t => Err(format!("a hash is a {}", t.kind())),
    }
}

fn opt_str(r: &mut Reader<'_>, limits: &EventLimits) -> Result<Option<String>, String> {
    match r.next_token().map_err(|e| e.to_string())? {
        Token::Nil => Ok(None),
        Token::Str(s) => short(s, limits).map(Some),
        t => Err(format!("a {}, not a string", t.kind())),
    }
}
