//! Payload → [`Message`], accepting what vLLM accepts and classifying what it does not.
//!
//! Called by the control channel on every inbound payload, from the runtime thread; it never
//! blocks, never panics, and costs time linear in the payload size (each byte is read at most
//! twice). Steps:
//!
//! 1. The whole payload must be one well-formed msgpack value within the [`DecodeLimits`], with
//!    nothing after it; otherwise it is **undecodable** (msgspec would raise on it too, wherever
//!    the fault lies, even in a field no one reads).
//! 2. It must be a map with a str `type` naming one of the nine messages; otherwise it is
//!    **ignored**.
//! 3. The fields of that type are read by name (any order, last duplicate wins, unknown names
//!    skipped, `config_fingerprint` optional) and checked as protocol.py's `validate()` does,
//!    plus the stricter checks kvpeer adds (bool is not an int, keys are bin); a failure is a
//!    **protocol error** naming the field.

use crate::error::{
    DecodeError, FieldError, FieldPath, IgnoredReason, MsgpackError, ProtocolError,
};
use crate::limits::DecodeLimits;
use crate::message::{
    field, Abort, Connect, ConnectAck, Disconnect, Fetch, Lookup, LookupResp, Message, MessageType,
    TransferDone,
};
use crate::reader::{Reader, Token};
use crate::types::{KvRequestId, OffloadKey, PeerId, RoundSeq};

/// Longest unknown `type` string quoted back in an error.
const MAX_QUOTED_TYPE: usize = 64;

/// Decodes one control payload with the default [`DecodeLimits`].
pub fn decode(payload: &[u8]) -> Result<Message, DecodeError> {
    decode_with_limits(payload, &DecodeLimits::default())
}

/// Decodes one control payload under the given limits.
pub fn decode_with_limits(payload: &[u8], limits: &DecodeLimits) -> Result<Message, DecodeError> {
    let fields = read_top_level(payload, limits)?;
    let message_type = fields.message_type()?;
    let message = fields.typed(message_type)?;
    message.validate()?;
    Ok(message)
}

/// Every field name any message uses; a top-level entry with another name is skipped.
const KNOWN_FIELDS: [&str; 16] = [
    field::TYPE,
    field::PEER_ID,
    field::AGENT_METADATA,
    field::BASE_ADDR,
    field::NUM_BLOCKS,
    field::BLOCK_LEN,
    field::CONFIG_FINGERPRINT,
    field::HASH_SEED,
    field::KV_REQUEST_ID,
    field::KEYS,
    field::HITS,
    field::BLOCK_INDEXES,
    field::ROUND_SEQ,
    field::SUCCESS,
    field::KVPEER_AUTH,
    field::KVPEER_REASON,
];

fn field_slot(name: &str) -> Option<usize> {
    KNOWN_FIELDS.iter().position(|known| *known == name)
}

/// The raw (already well-formed) value of each known top-level field.
struct TopLevel<'a> {
    slots: [Option<&'a [u8]>; KNOWN_FIELDS.len()],
    limits: &'a DecodeLimits,
}

/// Step 1: checks the payload is one well-formed value and, if it is a map, remembers where the
/// value of each known field lies. Step 2's "not a map" is decided here too, after the whole
/// value has been checked.
fn read_top_level<'a>(
    payload: &'a [u8],
    limits: &'a DecodeLimits,
) -> Result<TopLevel<'a>, DecodeError> {
    if payload.len() > limits.max_payload_bytes {
        return Err(MsgpackError {
            offset: 0,
            kind: crate::error::MsgpackErrorKind::TooLarge {
                size: payload.len(),
                limit: limits.max_payload_bytes,
            },
        }
        .into());
    }
    let max_depth = limits.effective_max_depth();
    let mut r = Reader::new(payload);
    let entries = match r.next_token()? {
        Token::Map(n) => n,
        other => {
            let mut whole = Reader::new(payload);
            whole.skip_value(0, max_depth)?;
            whole.finish()?;
            return Err(IgnoredReason::NotAMap(other.kind()).into());
        }
    };
    let mut top = TopLevel {
        slots: [None; KNOWN_FIELDS.len()],
        limits,
    };
    for _ in 0..entries {
        let key_start = r.position();
        r.skip_value(1, max_depth)?;
        let slot = match Reader::new(r.since(key_start)).next_token()? {
            Token::Str(name) => field_slot(name),
            _ => None,
        };
        let value_start = r.position();
        r.skip_value(1, max_depth)?;
        if let Some(slot) = slot {
            top.slots[slot] = Some(r.since(value_start));
        }
    }
    r.finish()?;
    Ok(top)
}

impl<'a> TopLevel<'a> {
    /// Step 2: the message type, or why the map is no message.
    fn message_type(&self) -> Result<MessageType, DecodeError> {
        let Some(raw) = self.slots[0] else {
            return Err(IgnoredReason::MissingType.into());
        };
        match Reader::new(raw).next_token()? {
            Token::Str(name) => MessageType::from_wire(name).ok_or_else(|| {
                let quoted: String = name.chars().take(MAX_QUOTED_TYPE).collect();
                IgnoredReason::UnknownType(quoted).into()
            }),
            other => Err(IgnoredReason::TypeNotStr(other.kind()).into()),
        }
    }

    /// Step 3: the typed message, in protocol.py's validation order.
    fn typed(&self, ty: MessageType) -> Result<Message, DecodeError> {
        let f = Fields { top: self, ty };
        Ok(match ty {
            MessageType::Connect => Message::Connect(Connect {
                peer_id: PeerId::new(f.str(field::PEER_ID)?),
                agent_metadata: f.bin(field::AGENT_METADATA)?.to_vec(),
                base_addr: f.uint(field::BASE_ADDR, Sign::NonNegative)?,
                num_blocks: f.uint(field::NUM_BLOCKS, Sign::Positive)?,
                block_len: f.uint(field::BLOCK_LEN, Sign::Positive)?,
                hash_seed: f.str(field::HASH_SEED)?.to_owned(),
                config_fingerprint: f.optional_str(field::CONFIG_FINGERPRINT)?,
                kvpeer_auth: f.optional_bin(field::KVPEER_AUTH)?,
            }),
            MessageType::ConnectAck => Message::ConnectAck(ConnectAck {
                peer_id: PeerId::new(f.str(field::PEER_ID)?),
            }),
            MessageType::Disconnect => Message::Disconnect(Disconnect {
                kvpeer_reason: f.optional_str(field::KVPEER_REASON)?,
            }),
            MessageType::Fetch => Message::Fetch(Fetch {
                kv_request_id: f.request_id()?,
                round_seq: f.round_seq()?,
                keys: f.keys(field::KEYS)?,
                block_indexes: f.uints(field::BLOCK_INDEXES)?,
            }),
            MessageType::Lookup => Message::Lookup(Lookup {
                kv_request_id: f.request_id()?,
                keys: f.keys(field::KEYS)?,
                round_seq: f.round_seq()?,
            }),
            MessageType::LookupResp => Message::LookupResp(LookupResp {
                kv_request_id: f.request_id()?,
                keys: f.keys(field::KEYS)?,
                hits: f.bools(field::HITS)?,
            }),
            MessageType::TransferDone => Message::TransferDone(TransferDone {
                kv_request_id: f.request_id()?,
                success: f.bool(field::SUCCESS)?,
                round_seq: f.round_seq()?,
            }),
            MessageType::AbortFetch => Message::AbortFetch(f.abort()?),
            MessageType::AbortAck => Message::AbortAck(f.abort()?),
        })
    }
}

/// The sign rule of an int field.
#[derive(Clone, Copy)]
enum Sign {
    NonNegative,
    Positive,
}

/// Typed access to the fields of one message type, turning mismatches into protocol errors.
struct Fields<'t, 'a> {
    top: &'t TopLevel<'a>,
    ty: MessageType,
}

impl<'a> Fields<'_, 'a> {
    fn error(&self, field: FieldPath, reason: FieldError) -> DecodeError {
        ProtocolError {
            message_type: self.ty,
            field,
            reason,
        }
        .into()
    }

    fn wrong_type(&self, field: FieldPath, expected: &'static str, got: &Token<'_>) -> DecodeError {
        self.error(
            field,
            FieldError::WrongType {
                expected,
                got: got.kind(),
            },
        )
    }

    /// The token of a field, or `None` when the field is absent.
    fn optional(&self, name: &'static str) -> Result<Option<(Reader<'a>, Token<'a>)>, DecodeError> {
        let Some(slot) = field_slot(name) else {
            return Ok(None);
        };
        let Some(raw) = self.top.slots[slot] else {
            return Ok(None);
        };
        let mut r = Reader::new(raw);
        let token = r.next_token()?;
        Ok(Some((r, token)))
    }

    fn required(&self, name: &'static str) -> Result<(Reader<'a>, Token<'a>), DecodeError> {
        self.optional(name)?
            .ok_or_else(|| self.error(FieldPath::field(name), FieldError::Missing))
    }

    fn optional_str(&self, name: &'static str) -> Result<Option<String>, DecodeError> {
        match self.optional(name)? {
            None => Ok(None),
            Some((_, Token::Str(s))) => Ok(Some(s.to_owned())),
            Some((_, other)) => Err(self.wrong_type(FieldPath::field(name), "str", &other)),
        }
    }

    fn str(&self, name: &'static str) -> Result<&'a str, DecodeError> {
        match self.required(name)? {
            (_, Token::Str(s)) => Ok(s),
            (_, other) => Err(self.wrong_type(FieldPath::field(name), "str", &other)),
        }
    }

    fn optional_bin(&self, name: &'static str) -> Result<Option<Vec<u8>>, DecodeError> {
        match self.optional(name)? {
            None => Ok(None),
            Some((_, Token::Bin(b))) => Ok(Some(b.to_vec())),
            Some((_, other)) => Err(self.wrong_type(FieldPath::field(name), "bin", &other)),
        }
    }

    fn bin(&self, name: &'static str) -> Result<&'a [u8], DecodeError> {
        match self.required(name)? {
            (_, Token::Bin(b)) => Ok(b),
            (_, other) => Err(self.wrong_type(FieldPath::field(name), "bin", &other)),
        }
    }

    fn bool(&self, name: &'static str) -> Result<bool, DecodeError> {
        match self.required(name)? {
            (_, Token::Bool(b)) => Ok(b),
            (_, other) => Err(self.wrong_type(FieldPath::field(name), "bool", &other)),
        }
    }

    /// An int under a sign rule. A bool is not an int here (Python says it is; kvpeer is
    /// stricter, as the vectors mark).
    fn int_token(&self, at: FieldPath, token: Token<'_>, sign: Sign) -> Result<u64, DecodeError> {
        match (token, sign) {
            (Token::Uint(0), Sign::Positive) => Err(self.error(at, FieldError::NotPositive(0))),
            (Token::Uint(v), _) => Ok(v),
            (Token::NegInt(v), Sign::Positive) => Err(self.error(at, FieldError::NotPositive(v))),
            (Token::NegInt(v), Sign::NonNegative) => Err(self.error(at, FieldError::Negative(v))),
            (other, _) => Err(self.wrong_type(at, "int", &other)),
        }
    }

    fn uint(&self, name: &'static str, sign: Sign) -> Result<u64, DecodeError> {
        let (_, token) = self.required(name)?;
        self.int_token(FieldPath::field(name), token, sign)
    }

    fn request_id(&self) -> Result<KvRequestId, DecodeError> {
        Ok(KvRequestId::new(self.str(field::KV_REQUEST_ID)?))
    }

    fn round_seq(&self) -> Result<RoundSeq, DecodeError> {
        Ok(RoundSeq(self.uint(field::ROUND_SEQ, Sign::NonNegative)?))
    }

    fn abort(&self) -> Result<Abort, DecodeError> {
        Ok(Abort {
            kv_request_id: self.request_id()?,
            round_seq: self.round_seq()?,
        })
    }

    /// A list field: a reader positioned at its first element, and its length, checked
    /// against the list limit before anything is allocated for it.
    fn list(&self, name: &'static str) -> Result<(Reader<'a>, usize), DecodeError> {
        match self.required(name)? {
            (r, Token::Array(len)) => {
                let limit = self.top.limits.max_list_len;
                if len > limit {
                    return Err(self.error(
                        FieldPath::field(name),
                        FieldError::TooManyEntries { len, limit },
                    ));
                }
                Ok((r, len))
            }
            (_, other) => Err(self.wrong_type(FieldPath::field(name), "list", &other)),
        }
    }

    /// Reads every element of a list field with `element`.
    fn elements<T>(
        &self,
        name: &'static str,
        mut element: impl FnMut(&Self, FieldPath, Token<'a>) -> Result<T, DecodeError>,
    ) -> Result<Vec<T>, DecodeError> {
        let (mut r, len) = self.list(name)?;
        let mut out = Vec::with_capacity(len);
        for i in 0..len {
            let token = r.next_token()?;
            out.push(element(self, FieldPath::element(name, i), token)?);
        }
        Ok(out)
    }

    /// Keys must be bin. vLLM turns an int key into that many zero bytes by accident and fails
    /// on a str key with an internal error; kvpeer refuses both as protocol errors.
    fn keys(&self, name: &'static str) -> Result<Vec<OffloadKey>, DecodeError> {
        self.elements(name, |f, at, token| match token {
            Token::Bin(b) => Ok(OffloadKey::from_bytes(b)),
            other => Err(f.wrong_type(at, "bin", &other)),
        })
    }

    fn uints(&self, name: &'static str) -> Result<Vec<u64>, DecodeError> {
        self.elements(name, |f, at, token| {
            f.int_token(at, token, Sign::NonNegative)
        })
    }

    fn bools(&self, name: &'static str) -> Result<Vec<bool>, DecodeError> {
        self.elements(name, |f, at, token| match token {
            Token::Bool(b) => Ok(b),
            other => Err(f.wrong_type(at, "bool", &other)),
        })
    }
}
