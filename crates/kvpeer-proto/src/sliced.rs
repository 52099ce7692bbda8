//! Decoding a large payload a slice at a time, with the same result as [`crate::decode`].
//!
//! A lookup of 131,072 keys takes the decoder about 3 ms; decoded whole, it holds the node's
//! one thread that long, and an honest peer's message that arrives meanwhile waits for all of
//! it. [`SlicedDecode`] does the same work in steps of at most a given number of msgpack items
//! (step 1's walk over the payload, then each element of the list fields), so the caller can
//! serve others between two steps. Whatever the slicing, the result is the message, or the
//! first error, that [`crate::decode_with_limits`] gives for the same bytes and limits (the
//! property tests in `tests/properties.rs` and the wire vectors holds it to that).
//!
//! Sans-IO and single-threaded: the caller owns it and calls [`SlicedDecode::step`] from its
//! own thread; a step never blocks and reads at most `items` items (one more for the message's
//! scalar fields once the lists are read: they are few and small; a `connect`'s
//! `agent_metadata` is copied whole, bounded by the payload).

use crate::decode::{ListRead, Prebuilt, Walk};
use crate::error::DecodeError;
use crate::limits::DecodeLimits;
use crate::message::{Message, MessageType};

/// One payload being decoded a slice at a time.
#[derive(Debug)]
pub struct SlicedDecode {
    payload: Vec<u8>,
    limits: DecodeLimits,
    walk: Walk,
    /// Known once the walk is done.
    ty: Option<MessageType>,
    /// The message type's list fields still to read, the next first.
    lists: std::collections::VecDeque<ListRead>,
    prebuilt: Prebuilt,
    finished: bool,
}

impl SlicedDecode {
    /// Starts decoding `payload` under `limits` (nothing is read until the first step).
    pub fn new(payload: Vec<u8>, limits: DecodeLimits) -> Self {
        SlicedDecode {
            payload,
            limits,
            walk: Walk::new(),
            ty: None,
            lists: Default::default(),
            prebuilt: Prebuilt::default(),
            finished: false,
        }
    }

    /// The payload being decoded.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Gives the payload back.
    pub fn into_payload(self) -> Vec<u8> {
        self.payload
    }

    /// Bytes this decode holds now: the payload twice (itself, and the bytes of keys too long
    /// to be held inline, which come from it) and the room of each list whose header was read
    /// (reserved whole then, as a whole decode does: a list's header is checked against the
    /// limit and the payload, but a list of empty keys decodes to about 24 times its bytes).
    pub fn held_bytes(&self) -> usize {
        self.payload.capacity().saturating_mul(2)
            + self.lists.iter().map(ListRead::held_bytes).sum::<usize>()
            + self.prebuilt.held_bytes()
    }

    /// Whether a step returned the result already.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Decodes on, reading at most `items` msgpack items (at least one): the message or the
    /// error once decoding ends, `None` while there is more to do. After the result, `None`.
    pub fn step(&mut self, items: usize) -> Option<Result<Message, DecodeError>> {
        if self.finished {
            return None;
        }
        let mut budget = items.max(1);
        let result = self.advance(&mut budget).transpose()?;
        self.finished = true;
        Some(result)
    }

    fn advance(&mut self, budget: &mut usize) -> Result<Option<Message>, DecodeError> {
        let ty = match self.ty {
            Some(ty) => ty,
            None => {
                if !self.walk.advance(&self.payload, &self.limits, budget)? {
                    return Ok(None);
                }
                let ty = self
                    .walk
                    .top_level(&self.payload, &self.limits)
                    .message_type()?;
                self.ty = Some(ty);
                self.lists = ListRead::of(ty).into();
                ty
            }
        };
        let top = self.walk.top_level(&self.payload, &self.limits);
        let fields = crate::decode::Fields::new(&top, ty);
        while let Some(list) = self.lists.front_mut() {
            if *budget == 0 {
                return Ok(None);
            }
            let read = match fields.read_some(list, budget) {
                Ok(false) => return Ok(None),
                Ok(true) => Ok(()),
                // Kept for step 3, which reports it where it reads this field (an earlier
                // field's error comes first, as in a whole decode).
                Err(e) => Err(e),
            };
            if let Some(list) = self.lists.pop_front() {
                list.finish(read, &mut self.prebuilt);
            }
        }
        let message = top.typed(ty, std::mem::take(&mut self.prebuilt))?;
        message.validate()?;
        Ok(Some(message))
    }
}
