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

use crate::error::{DecodeError, FieldError, FieldPath, IgnoredReason, ProtocolError};
use std::cell::RefCell;

use crate::limits::DecodeLimits;
use crate::message::{
    field, Abort, Connect, ConnectAck, Disconnect, Fetch, Lookup, LookupResp, Message, MessageType,
    TransferDone,
};
use crate::reader::{Reader, Skip, Token};
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
    let message = fields.typed(message_type, Prebuilt::default())?;
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
pub(crate) struct TopLevel<'a> {
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
    let mut walk = Walk::new();
    let mut unbounded = usize::MAX;
    walk.advance(payload, limits, &mut unbounded)?;
    Ok(walk.top_level(payload, limits))
}

/// Where step 1 stands: the walk over the payload, which can stop after any token and go on
/// later from there ([`crate::SlicedDecode`] walks a large payload a slice at a time; a whole
/// decode walks it in one go). Positions are byte offsets into the payload.
#[derive(Debug)]
pub(crate) struct Walk {
    pos: usize,
    stage: WalkStage,
    /// Where the value of each known field lies (the last duplicate wins).
    slots: [Option<(usize, usize)>; KNOWN_FIELDS.len()],
}

#[derive(Debug)]
enum WalkStage {
    /// Nothing read yet.
    Start,
    /// The payload is no map (its first token's kind): the whole value is still checked.
    NotAMap(&'static str, Skip),
    /// `left` entries of the top-level map to go; the key of the next one being skipped from
    /// `start`.
    Key {
        left: usize,
        start: usize,
        skip: Skip,
    },
    /// The value of an entry being skipped from `start`, kept in `slot` if its name is known.
    Value {
        left: usize,
        slot: Option<usize>,
        start: usize,
        skip: Skip,
    },
    /// The whole payload is checked.
    Done,
}

impl Walk {
    pub(crate) fn new() -> Self {
        Walk {
            pos: 0,
            stage: WalkStage::Start,
            slots: [None; KNOWN_FIELDS.len()],
        }
    }

    /// Walks on, reading at most `budget` tokens (each read takes one): `Ok(true)` once the
    /// whole payload is checked, `Ok(false)` when the budget ran out first. The errors are the
    /// same, in the same order, however the walk is sliced.
    pub(crate) fn advance(
        &mut self,
        payload: &[u8],
        limits: &DecodeLimits,
        budget: &mut usize,
    ) -> Result<bool, DecodeError> {
        let max_depth = limits.effective_max_depth();
        loop {
            let stage = std::mem::replace(&mut self.stage, WalkStage::Done);
            self.stage = match stage {
                WalkStage::Start => {
                    limits.check_size(payload)?;
                    if *budget == 0 {
                        self.stage = WalkStage::Start;
                        return Ok(false);
                    }
                    *budget -= 1;
                    let mut r = Reader::new(payload);
                    match r.next_token()? {
                        Token::Map(left) => {
                            self.pos = r.position();
                            WalkStage::Key {
                                left,
                                start: self.pos,
                                skip: Skip::new(),
                            }
                        }
                        // The whole value is checked from its start before it is called no map.
                        other => WalkStage::NotAMap(other.kind(), Skip::new()),
                    }
                }
                WalkStage::NotAMap(kind, mut skip) => {
                    if !self.skip_on(payload, &mut skip, 0, max_depth, budget)? {
                        self.stage = WalkStage::NotAMap(kind, skip);
                        return Ok(false);
                    }
                    Reader::at(payload, self.pos).finish()?;
                    return Err(IgnoredReason::NotAMap(kind).into());
                }
                // An error ends the decode: the stage it leaves (`Done`) is never walked on.
                WalkStage::Key { left: 0, .. } => {
                    Reader::at(payload, self.pos).finish()?;
                    WalkStage::Done
                }
                WalkStage::Key {
                    left,
                    start,
                    mut skip,
                } => {
                    if !self.skip_on(payload, &mut skip, 1, max_depth, budget)? {
                        self.stage = WalkStage::Key { left, start, skip };
                        return Ok(false);
                    }
                    let key = payload.get(start..self.pos).unwrap_or_default();
                    let slot = match Reader::new(key).next_token()? {
                        Token::Str(name) => field_slot(name),
                        _ => None,
                    };
                    WalkStage::Value {
                        left,
                        slot,
                        start: self.pos,
                        skip: Skip::new(),
                    }
                }
                WalkStage::Value {
                    left,
                    slot,
                    start,
                    mut skip,
                } => {
                    if !self.skip_on(payload, &mut skip, 1, max_depth, budget)? {
                        self.stage = WalkStage::Value {
                            left,
                            slot,
                            start,
                            skip,
                        };
                        return Ok(false);
                    }
                    if let Some(slot) = slot {
                        self.slots[slot] = Some((start, self.pos));
                    }
                    WalkStage::Key {
                        left: left - 1,
                        start: self.pos,
                        skip: Skip::new(),
                    }
                }
                WalkStage::Done => return Ok(true),
            };
        }
    }

    /// Skips on in the value `skip` stands for, from where the walk stands (see
    /// [`Reader::skip_some`]).
    fn skip_on(
        &mut self,
        payload: &[u8],
        skip: &mut Skip,
        parent_depth: usize,
        max_depth: usize,
        budget: &mut usize,
    ) -> Result<bool, DecodeError> {
        let mut r = Reader::at(payload, self.pos);
        let done = r.skip_some(skip, parent_depth, max_depth, budget)?;
        self.pos = r.position();
        Ok(done)
    }

    /// The known fields' values, once [`Walk::advance`] said the payload is checked.
    pub(crate) fn top_level<'a>(
        &self,
        payload: &'a [u8],
        limits: &'a DecodeLimits,
    ) -> TopLevel<'a> {
        TopLevel {
            slots: self
                .slots
                .map(|slot| slot.and_then(|(start, end)| payload.get(start..end))),
            limits,
        }
    }
}

impl<'a> TopLevel<'a> {
    /// Step 2: the message type, or why the map is no message.
    pub(crate) fn message_type(&self) -> Result<MessageType, DecodeError> {
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

    /// Step 3: the typed message, in protocol.py's validation order (list fields in
    /// `prebuilt` are taken from there, with the error reading them gave, if any).
    pub(crate) fn typed(
        &self,
        ty: MessageType,
        prebuilt: Prebuilt,
    ) -> Result<Message, DecodeError> {
        let f = Fields {
            top: self,
            ty,
            prebuilt: RefCell::new(prebuilt),
        };
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
pub(crate) struct Fields<'t, 'a> {
    top: &'t TopLevel<'a>,
    ty: MessageType,
    /// List fields read already, a slice at a time.
    prebuilt: RefCell<Prebuilt>,
}

/// List fields read before step 3 (by [`crate::SlicedDecode`], a slice at a time), each with
/// its value or the error reading it gave: step 3 takes them where it would read the field, so
/// the message, or the first error in protocol.py's order, is the same as a whole decode's.
/// A message has at most one list of each kind (`keys`; `block_indexes`; `hits`).
#[derive(Debug, Default)]
pub(crate) struct Prebuilt {
    keys: Option<Result<Vec<OffloadKey>, DecodeError>>,
    uints: Option<Result<Vec<u64>, DecodeError>>,
    bools: Option<Result<Vec<bool>, DecodeError>>,
}

/// The elements one list field holds.
#[derive(Debug)]
enum ListItems {
    Keys(Vec<OffloadKey>),
    Uints(Vec<u64>),
    Bools(Vec<bool>),
}

impl ListItems {
    /// Elements read so far.
    fn len(&self) -> usize {
        match self {
            ListItems::Keys(v) => v.len(),
            ListItems::Uints(v) => v.len(),
            ListItems::Bools(v) => v.len(),
        }
    }

    /// Bytes allocated for the elements (a key longer than its inline room holds its bytes
    /// on the heap too: at most its own size in the payload, which the caller counts).
    fn held_bytes(&self) -> usize {
        match self {
            ListItems::Keys(v) => v.capacity() * std::mem::size_of::<OffloadKey>(),
            ListItems::Uints(v) => v.capacity() * std::mem::size_of::<u64>(),
            ListItems::Bools(v) => v.capacity(),
        }
    }
}

impl Prebuilt {
    /// Bytes allocated for the lists read so far.
    pub(crate) fn held_bytes(&self) -> usize {
        let keys = self.keys.as_ref().and_then(|r| r.as_ref().ok());
        let uints = self.uints.as_ref().and_then(|r| r.as_ref().ok());
        let bools = self.bools.as_ref().and_then(|r| r.as_ref().ok());
        keys.map_or(0, |v| v.capacity() * std::mem::size_of::<OffloadKey>())
            + uints.map_or(0, |v| v.capacity() * std::mem::size_of::<u64>())
            + bools.map_or(0, Vec::capacity)
    }
}

/// One list field being read a slice at a time: where its next element lies in the field's
/// bytes, and what was read of it.
#[derive(Debug)]
pub(crate) struct ListRead {
    name: &'static str,
    items: ListItems,
    /// Where the next element lies in the field's value, once the list header was read.
    next: Option<(usize, usize)>,
}

impl ListRead {
    /// The list fields of a message type, in the order step 3 reads them.
    pub(crate) fn of(ty: MessageType) -> Vec<ListRead> {
        let list = |name, items| ListRead {
            name,
            items,
            next: None,
        };
        match ty {
            MessageType::Fetch => vec![
                list(field::KEYS, ListItems::Keys(Vec::new())),
                list(field::BLOCK_INDEXES, ListItems::Uints(Vec::new())),
            ],
            MessageType::Lookup => vec![list(field::KEYS, ListItems::Keys(Vec::new()))],
            MessageType::LookupResp => vec![
                list(field::KEYS, ListItems::Keys(Vec::new())),
                list(field::HITS, ListItems::Bools(Vec::new())),
            ],
            _ => Vec::new(),
        }
    }

    /// Bytes allocated for its elements: the whole list's room once its header was read.
    pub(crate) fn held_bytes(&self) -> usize {
        self.items.held_bytes()
    }

    /// Hands what was read (or the error reading it gave) to step 3.
    pub(crate) fn finish(self, result: Result<(), DecodeError>, prebuilt: &mut Prebuilt) {
        match self.items {
            ListItems::Keys(v) => prebuilt.keys = Some(result.map(|()| v)),
            ListItems::Uints(v) => prebuilt.uints = Some(result.map(|()| v)),
            ListItems::Bools(v) => prebuilt.bools = Some(result.map(|()| v)),
        }
    }
}

impl<'t, 'a> Fields<'t, 'a> {
    /// Typed access to `top`'s fields as message type `ty`, nothing read before.
    pub(crate) fn new(top: &'t TopLevel<'a>, ty: MessageType) -> Self {
        Fields {
            top,
            ty,
            prebuilt: RefCell::new(Prebuilt::default()),
        }
    }

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
    fn key(&self, at: FieldPath, token: Token<'_>) -> Result<OffloadKey, DecodeError> {
        match token {
            Token::Bin(b) => Ok(OffloadKey::from_bytes(b)),
            other => Err(self.wrong_type(at, "bin", &other)),
        }
    }

    fn uint_element(&self, at: FieldPath, token: Token<'_>) -> Result<u64, DecodeError> {
        self.int_token(at, token, Sign::NonNegative)
    }

    fn bool_element(&self, at: FieldPath, token: Token<'_>) -> Result<bool, DecodeError> {
        match token {
            Token::Bool(b) => Ok(b),
            other => Err(self.wrong_type(at, "bool", &other)),
        }
    }

    fn keys(&self, name: &'static str) -> Result<Vec<OffloadKey>, DecodeError> {
        if let Some(read) = self.prebuilt.borrow_mut().keys.take() {
            return read;
        }
        self.elements(name, |f, at, token| f.key(at, token))
    }

    fn uints(&self, name: &'static str) -> Result<Vec<u64>, DecodeError> {
        if let Some(read) = self.prebuilt.borrow_mut().uints.take() {
            return read;
        }
        self.elements(name, |f, at, token| f.uint_element(at, token))
    }

    fn bools(&self, name: &'static str) -> Result<Vec<bool>, DecodeError> {
        if let Some(read) = self.prebuilt.borrow_mut().bools.take() {
            return read;
        }
        self.elements(name, |f, at, token| f.bool_element(at, token))
    }

    /// Reads on in list field `list`, at most `budget` elements (each takes one): `Ok(true)`
    /// once the whole list is read. Its header is checked first, as [`Fields::elements`] does,
    /// and each element as that would: the same values, the same errors.
    pub(crate) fn read_some(
        &self,
        list: &mut ListRead,
        budget: &mut usize,
    ) -> Result<bool, DecodeError> {
        let (mut pos, len) = match list.next {
            Some(next) => next,
            None => {
                let (r, len) = self.list(list.name)?;
                // Room for the whole list at once, as a whole decode takes it (its length was
                // checked against the limit and the payload): growing it a step at a time
                // would copy it as it doubles. The caller counts this room as held
                // ([`ListRead::held_bytes`]) from this step on.
                match &mut list.items {
                    ListItems::Keys(v) => v.reserve_exact(len),
                    ListItems::Uints(v) => v.reserve_exact(len),
                    ListItems::Bools(v) => v.reserve_exact(len),
                }
                (r.position(), len)
            }
        };
        let raw = field_slot(list.name)
            .and_then(|slot| self.top.slots[slot])
            .unwrap_or_default();
        let mut r = Reader::at(raw, pos);
        let mut index = list.items.len();
        while index < len && *budget > 0 {
            *budget -= 1;
            let token = r.next_token()?;
            let at = FieldPath::element(list.name, index);
            match &mut list.items {
                ListItems::Keys(v) => v.push(self.key(at, token)?),
                ListItems::Uints(v) => v.push(self.uint_element(at, token)?),
                ListItems::Bools(v) => v.push(self.bool_element(at, token)?),
            }
            index += 1;
        }
        pos = r.position();
        list.next = Some((pos, len));
        Ok(index == len)
    }
}
