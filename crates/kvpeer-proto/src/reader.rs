//! A bounded msgpack reader over an untrusted byte slice.
//!
//! Contract: never panics, never allocates while reading a token (str and bin borrow from the
//! input), checks every length header against the bytes that remain before using it, and walks
//! nested values without recursion under a depth limit. Cost is linear in the bytes read.
//!
//! Written by hand rather than with `rmp`: `rmp`'s reader works over `io::Read`, so it cannot
//! hand out borrowed, pre-checked slices, and the decoder needs to tell a malformed payload
//! (dropped) from a well-formed one with bad fields (a protocol error) at every step. The
//! msgpack grammar is small (one marker table); `rmpv` checks this reader in the tests.

use crate::error::{MsgpackError, MsgpackErrorKind};

/// One msgpack item. Containers yield only their header; their elements follow.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Token<'a> {
    Nil,
    Bool(bool),
    /// Any int >= 0, whatever marker carried it (`int8 5` is 5 too).
    Uint(u64),
    /// Any int < 0.
    NegInt(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    /// Array header with its element count (already checked against the remaining bytes).
    Array(usize),
    /// Map header with its entry count (already checked against the remaining bytes).
    Map(usize),
    Ext(i8, &'a [u8]),
}

impl Token<'_> {
    /// The msgpack type name used in error messages.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Token::Nil => "nil",
            Token::Bool(_) => "bool",
            Token::Uint(_) | Token::NegInt(_) => "int",
            Token::Float(_) => "float",
            Token::Str(_) => "str",
            Token::Bin(_) => "bin",
            Token::Array(_) => "array",
            Token::Map(_) => "map",
            Token::Ext(..) => "ext",
        }
    }
}

/// Where the skip of one value stands: for each open container, how many values it still owes
/// once the walk returns to it, and how many the innermost one owes now. Kept between calls to
/// [`Reader::skip_some`], so a large value can be walked a slice at a time.
#[derive(Debug, Clone, Default)]
pub(crate) struct Skip {
    open: Vec<usize>,
    owed: usize,
}

impl Skip {
    /// The skip of one value, not started.
    pub(crate) fn new() -> Self {
        Skip {
            open: Vec::new(),
            owed: 1,
        }
    }
}

/// Cursor over a payload. Positions are byte offsets into the original slice.
pub(crate) struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(buf: &'a [u8]) -> Self {
        Reader { buf, pos: 0 }
    }

    /// A cursor over `buf` at byte `pos` (where an earlier reader of the same bytes stopped).
    pub(crate) fn at(buf: &'a [u8], pos: usize) -> Self {
        Reader {
            buf,
            pos: pos.min(buf.len()),
        }
    }

    #[inline]
    pub(crate) fn position(&self) -> usize {
        self.pos
    }

    #[inline]
    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// The bytes from `start` up to the current position.
    #[inline]
    pub(crate) fn since(&self, start: usize) -> &'a [u8] {
        &self.buf[start.min(self.pos)..self.pos]
    }

    #[cold]
    #[inline(never)]
    fn error(&self, offset: usize, kind: MsgpackErrorKind) -> MsgpackError {
        MsgpackError { offset, kind }
    }

    /// Takes `n` bytes of a fixed-size field.
    #[inline]
    fn take_fixed(&mut self, at: usize, n: usize) -> Result<&'a [u8], MsgpackError> {
        let available = self.remaining();
        if n > available {
            return Err(self.error(
                at,
                MsgpackErrorKind::Truncated {
                    needed: n,
                    available,
                },
            ));
        }
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    #[inline]
    fn take_array<const N: usize>(&mut self, at: usize) -> Result<[u8; N], MsgpackError> {
        let bytes = self.take_fixed(at, N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    #[inline]
    fn be_u8(&mut self, at: usize) -> Result<u8, MsgpackError> {
        Ok(self.take_array::<1>(at)?[0])
    }

    #[inline]
    fn be_u16(&mut self, at: usize) -> Result<u16, MsgpackError> {
        Ok(u16::from_be_bytes(self.take_array(at)?))
    }

    #[inline]
    fn be_u32(&mut self, at: usize) -> Result<u32, MsgpackError> {
        Ok(u32::from_be_bytes(self.take_array(at)?))
    }

    #[inline]
    fn be_u64(&mut self, at: usize) -> Result<u64, MsgpackError> {
        Ok(u64::from_be_bytes(self.take_array(at)?))
    }

    /// Takes a length-prefixed body, refusing a length the payload cannot hold.
    #[inline]
    fn take_body(
        &mut self,
        at: usize,
        what: &'static str,
        len: u64,
    ) -> Result<&'a [u8], MsgpackError> {
        let remaining = self.remaining();
        if len > remaining as u64 {
            return Err(self.error(
                at,
                MsgpackErrorKind::LengthExceedsPayload {
                    what,
                    declared: len,
                    unit: "bytes",
                    remaining,
                },
            ));
        }
        // `len <= remaining`, so it fits in usize.
        let n = len as usize;
        let bytes = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(bytes)
    }

    #[inline]
    fn str_body(&mut self, at: usize, len: u64) -> Result<Token<'a>, MsgpackError> {
        let bytes = self.take_body(at, "str", len)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(Token::Str(s)),
            Err(e) => Err(self.error(at, MsgpackErrorKind::InvalidUtf8(e))),
        }
    }

    fn ext_body(&mut self, at: usize, len: u64) -> Result<Token<'a>, MsgpackError> {
        let tag = self.be_u8(at)? as i8;
        let data = self.take_body(at, "ext", len)?;
        // Type -1 is msgpack's timestamp; its data size is fixed by the format.
        if tag == -1 && !matches!(data.len(), 4 | 8 | 12) {
            return Err(self.error(at, MsgpackErrorKind::InvalidTimestamp { len: data.len() }));
        }
        Ok(Token::Ext(tag, data))
    }

    /// A container header: every element needs at least one byte, so a count larger than the
    /// remaining bytes (twice the count for a map) cannot be honest.
    #[inline]
    fn container(&mut self, at: usize, map: bool, count: u64) -> Result<Token<'a>, MsgpackError> {
        let remaining = self.remaining();
        let min_bytes = if map { count.saturating_mul(2) } else { count };
        if min_bytes > remaining as u64 {
            return Err(self.error(
                at,
                MsgpackErrorKind::LengthExceedsPayload {
                    what: if map { "map" } else { "array" },
                    declared: count,
                    unit: if map { "entries" } else { "items" },
                    remaining,
                },
            ));
        }
        // `count <= remaining`, so it fits in usize.
        let n = count as usize;
        Ok(if map { Token::Map(n) } else { Token::Array(n) })
    }

    #[inline]
    fn int(value: i64) -> Token<'a> {
        if value >= 0 {
            Token::Uint(value as u64)
        } else {
            Token::NegInt(value)
        }
    }

    /// Reads the next token. At the end of the payload this is a `Truncated` (or `Empty` for an
    /// empty payload) error.
    #[inline]
    pub(crate) fn next_token(&mut self) -> Result<Token<'a>, MsgpackError> {
        let at = self.pos;
        if self.buf.is_empty() {
            return Err(self.error(at, MsgpackErrorKind::Empty));
        }
        let marker = self.be_u8(at)?;
        let token = match marker {
            0x00..=0x7f => Token::Uint(u64::from(marker)),
            0x80..=0x8f => self.container(at, true, u64::from(marker & 0x0f))?,
            0x90..=0x9f => self.container(at, false, u64::from(marker & 0x0f))?,
            0xa0..=0xbf => self.str_body(at, u64::from(marker & 0x1f))?,
            0xc0 => Token::Nil,
            0xc1 => return Err(self.error(at, MsgpackErrorKind::ReservedMarker(marker))),
            0xc2 => Token::Bool(false),
            0xc3 => Token::Bool(true),
            0xc4 => {
                let len = self.be_u8(at)?;
                Token::Bin(self.take_body(at, "bin", u64::from(len))?)
            }
            0xc5 => {
                let len = self.be_u16(at)?;
                Token::Bin(self.take_body(at, "bin", u64::from(len))?)
            }
            0xc6 => {
                let len = self.be_u32(at)?;
                Token::Bin(self.take_body(at, "bin", u64::from(len))?)
            }
            0xc7 => {
                let len = self.be_u8(at)?;
                self.ext_body(at, u64::from(len))?
            }
            0xc8 => {
                let len = self.be_u16(at)?;
                self.ext_body(at, u64::from(len))?
            }
            0xc9 => {
                let len = self.be_u32(at)?;
                self.ext_body(at, u64::from(len))?
            }
            0xca => Token::Float(f64::from(f32::from_bits(self.be_u32(at)?))),
            0xcb => Token::Float(f64::from_bits(self.be_u64(at)?)),
            0xcc => Token::Uint(u64::from(self.be_u8(at)?)),
            0xcd => Token::Uint(u64::from(self.be_u16(at)?)),
            0xce => Token::Uint(u64::from(self.be_u32(at)?)),
            0xcf => Token::Uint(self.be_u64(at)?),
            0xd0 => Self::int(i64::from(self.be_u8(at)? as i8)),
            0xd1 => Self::int(i64::from(self.be_u16(at)? as i16)),
            0xd2 => Self::int(i64::from(self.be_u32(at)? as i32)),
            0xd3 => Self::int(self.be_u64(at)? as i64),
            0xd4 => self.ext_body(at, 1)?,
            0xd5 => self.ext_body(at, 2)?,
            0xd6 => self.ext_body(at, 4)?,
            0xd7 => self.ext_body(at, 8)?,
            0xd8 => self.ext_body(at, 16)?,
            0xd9 => {
                let len = self.be_u8(at)?;
                self.str_body(at, u64::from(len))?
            }
            0xda => {
                let len = self.be_u16(at)?;
                self.str_body(at, u64::from(len))?
            }
            0xdb => {
                let len = self.be_u32(at)?;
                self.str_body(at, u64::from(len))?
            }
            0xdc => {
                let n = self.be_u16(at)?;
                self.container(at, false, u64::from(n))?
            }
            0xdd => {
                let n = self.be_u32(at)?;
                self.container(at, false, u64::from(n))?
            }
            0xde => {
                let n = self.be_u16(at)?;
                self.container(at, true, u64::from(n))?
            }
            0xdf => {
                let n = self.be_u32(at)?;
                self.container(at, true, u64::from(n))?
            }
            0xe0..=0xff => Token::NegInt(i64::from(marker as i8)),
        };
        Ok(token)
    }

    /// Reads one complete value (with everything nested in it), checking it is well-formed.
    ///
    /// `parent_depth` is the number of containers that enclose the value; a container at
    /// nesting level `parent_depth + 1` or deeper counts against `max_depth`. Iterative: the
    /// stack of open containers is a `Vec` no longer than `max_depth`.
    pub(crate) fn skip_value(
        &mut self,
        parent_depth: usize,
        max_depth: usize,
    ) -> Result<(), MsgpackError> {
        let mut skip = Skip::new();
        let mut unbounded = usize::MAX;
        self.skip_some(&mut skip, parent_depth, max_depth, &mut unbounded)
            .map(|_| ())
    }

    /// Goes on skipping the value `skip` stands for, reading at most `budget` tokens (each
    /// read takes one): `true` once the value is wholly skipped, `false` when the budget ran
    /// out first (call again with `skip` and a fresh budget, at the same position).
    pub(crate) fn skip_some(
        &mut self,
        skip: &mut Skip,
        parent_depth: usize,
        max_depth: usize,
        budget: &mut usize,
    ) -> Result<bool, MsgpackError> {
        loop {
            while skip.owed == 0 {
                match skip.open.pop() {
                    Some(n) => skip.owed = n,
                    None => return Ok(true),
                }
            }
            if *budget == 0 {
                return Ok(false);
            }
            *budget -= 1;
            skip.owed -= 1;
            let at = self.pos;
            let children = match self.next_token()? {
                Token::Array(n) => n,
                // `n <= remaining / 2` (checked), so `2 * n` cannot overflow.
                Token::Map(n) => 2 * n,
                _ => continue,
            };
            if parent_depth + skip.open.len() + 1 > max_depth {
                return Err(self.error(at, MsgpackErrorKind::TooDeep { limit: max_depth }));
            }
            skip.open.push(skip.owed);
            skip.owed = children;
        }
    }

    /// Fails if anything follows the value just read.
    pub(crate) fn finish(&self) -> Result<(), MsgpackError> {
        match self.remaining() {
            0 => Ok(()),
            count => Err(self.error(self.pos, MsgpackErrorKind::TrailingBytes { count })),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn token(bytes: &[u8]) -> Result<Token<'_>, MsgpackError> {
        Reader::new(bytes).next_token()
    }

    #[test]
    fn ints_of_every_width_normalise_by_sign() {
        assert_eq!(token(&[0x05]), Ok(Token::Uint(5)));
        assert_eq!(token(&[0xd0, 0x05]), Ok(Token::Uint(5)));
        assert_eq!(token(&[0xd0, 0xff]), Ok(Token::NegInt(-1)));
        assert_eq!(token(&[0xe0]), Ok(Token::NegInt(-32)));
        assert_eq!(token(&[0xcd, 0x40, 0x00]), Ok(Token::Uint(16384)));
        assert_eq!(
            token(&[0xcf, 0x80, 0, 0, 0, 0, 0, 0, 1]),
            Ok(Token::Uint(0x8000_0000_0000_0001))
        );
        assert_eq!(
            token(&[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0]),
            Ok(Token::NegInt(i64::MIN))
        );
    }

    #[test]
    fn huge_length_headers_fail_without_allocating() {
        for bytes in [
            &[0xc6, 0xff, 0xff, 0xff, 0xff][..],
            &[0xdb, 0xff, 0xff, 0xff, 0xff],
            &[0xdd, 0xff, 0xff, 0xff, 0xff],
            &[0xdf, 0xff, 0xff, 0xff, 0xff],
            &[0xc9, 0xff, 0xff, 0xff, 0xff, 0x01],
        ] {
            let err = token(bytes).expect_err("length exceeds payload");
            assert!(
                matches!(err.kind, MsgpackErrorKind::LengthExceedsPayload { .. }),
                "{err}"
            );
            assert_eq!(err.offset, 0);
        }
    }

    #[test]
    fn map_count_needs_two_bytes_per_entry() {
        // fixmap of 2 entries with 3 bytes left: 4 bytes are the least 2 entries can take.
        let err = token(&[0x82, 0x01, 0x02, 0x03]).expect_err("too few bytes");
        assert!(matches!(
            err.kind,
            MsgpackErrorKind::LengthExceedsPayload { what: "map", .. }
        ));
    }

    #[test]
    fn truncated_fixed_fields_report_need() {
        let err = token(&[0xcd, 0x01]).expect_err("truncated");
        assert_eq!(
            err.kind,
            MsgpackErrorKind::Truncated {
                needed: 2,
                available: 1
            }
        );
    }

    #[test]
    fn skip_bounds_depth_without_recursion() {
        let mut deep = vec![0x91u8; 100_000];
        deep.push(0xc0);
        let err = Reader::new(&deep).skip_value(0, 64).expect_err("too deep");
        assert_eq!(err.kind, MsgpackErrorKind::TooDeep { limit: 64 });
        let mut ok = vec![0x91u8; 64];
        ok.push(0xc0);
        let mut r = Reader::new(&ok);
        assert_eq!(r.skip_value(0, 64), Ok(()));
        assert_eq!(r.finish(), Ok(()));
    }

    #[test]
    fn skip_walks_nested_maps_and_stops_at_value_end() {
        // {"a": [1, {"b": nil}]} followed by one trailing byte.
        let bytes = [0x81, 0xa1, b'a', 0x92, 0x01, 0x81, 0xa1, b'b', 0xc0, 0x07];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.skip_value(0, 8), Ok(()));
        assert_eq!(r.remaining(), 1);
        assert_eq!(
            r.finish().map_err(|e| e.kind),
            Err(MsgpackErrorKind::TrailingBytes { count: 1 })
        );
    }

    #[test]
    fn timestamp_ext_length_is_checked() {
        assert!(token(&[0xd6, 0xff, 0, 0, 0, 1]).is_ok());
        let err = token(&[0xd5, 0xff, 0, 1]).expect_err("bad timestamp");
        assert_eq!(err.kind, MsgpackErrorKind::InvalidTimestamp { len: 2 });
    }
}
