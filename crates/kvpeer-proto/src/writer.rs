//! msgpack writers that pick the same encodings as vLLM's encoder (msgspec), so kvpeer's bytes
//! are identical to a vLLM peer's for the same message.
//!
//! The rules: the smallest int encoding (unsigned markers for values >= 0, signed for < 0),
//! `fixstr`/`str8`/`str16`/`str32` by length, `bin8`/`bin16`/`bin32` for bytes (msgpack has no
//! fixbin), `fixarray`/`array16`/`array32` and `fixmap`/`map16`/`map32` by count, `float64` for
//! floats. Writing into a `Vec` cannot fail; only a length beyond 2^32 - 1 can, and it is
//! reported, not truncated.

use crate::error::EncodeError;

fn length(what: &'static str, len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { what, len })
}

/// A length header: the fixed form for small lengths (when the type has one), else 8/16/32-bit.
fn write_header(out: &mut Vec<u8>, len: u32, fix: Option<(u8, u32)>, markers: [Option<u8>; 3]) {
    if let Some((base, max)) = fix {
        if len <= max {
            out.push(base | len as u8);
            return;
        }
    }
    match (len, markers) {
        (0..=0xff, [Some(m8), _, _]) => out.extend_from_slice(&[m8, len as u8]),
        (0..=0xffff, [_, Some(m16), _]) => {
            out.push(m16);
            out.extend_from_slice(&(len as u16).to_be_bytes());
        }
        (_, [_, _, Some(m32)]) => {
            out.push(m32);
            out.extend_from_slice(&len.to_be_bytes());
        }
        // Every header kind below has a 32-bit form.
        _ => {}
    }
}

/// An int >= 0 in the smallest encoding.
pub(crate) fn write_uint(out: &mut Vec<u8>, v: u64) {
    match v {
        0..=0x7f => out.push(v as u8),
        0x80..=0xff => out.extend_from_slice(&[0xcc, v as u8]),
        0x100..=0xffff => {
            out.push(0xcd);
            out.extend_from_slice(&(v as u16).to_be_bytes());
        }
        0x1_0000..=0xffff_ffff => {
            out.push(0xce);
            out.extend_from_slice(&(v as u32).to_be_bytes());
        }
        _ => {
            out.push(0xcf);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

/// Any int in the smallest encoding (unsigned markers when >= 0, as msgspec does).
pub(crate) fn write_int(out: &mut Vec<u8>, v: i64) {
    if v >= 0 {
        return write_uint(out, v as u64);
    }
    match v {
        -32..=-1 => out.push(v as i8 as u8),
        -128..=-33 => out.extend_from_slice(&[0xd0, v as i8 as u8]),
        -32_768..=-129 => {
            out.push(0xd1);
            out.extend_from_slice(&(v as i16).to_be_bytes());
        }
        -2_147_483_648..=-32_769 => {
            out.push(0xd2);
            out.extend_from_slice(&(v as i32).to_be_bytes());
        }
        _ => {
            out.push(0xd3);
            out.extend_from_slice(&v.to_be_bytes());
        }
    }
}

pub(crate) fn write_bool(out: &mut Vec<u8>, v: bool) {
    out.push(if v { 0xc3 } else { 0xc2 });
}

pub(crate) fn write_nil(out: &mut Vec<u8>) {
    out.push(0xc0);
}

pub(crate) fn write_f64(out: &mut Vec<u8>, v: f64) {
    out.push(0xcb);
    out.extend_from_slice(&v.to_bits().to_be_bytes());
}

pub(crate) fn write_str(out: &mut Vec<u8>, s: &str) -> Result<(), EncodeError> {
    let len = length("str", s.len())?;
    write_header(
        out,
        len,
        Some((0xa0, 31)),
        [Some(0xd9), Some(0xda), Some(0xdb)],
    );
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

pub(crate) fn write_bin(out: &mut Vec<u8>, b: &[u8]) -> Result<(), EncodeError> {
    let len = length("bin", b.len())?;
    write_header(out, len, None, [Some(0xc4), Some(0xc5), Some(0xc6)]);
    out.extend_from_slice(b);
    Ok(())
}

pub(crate) fn write_ext(out: &mut Vec<u8>, tag: i8, data: &[u8]) -> Result<(), EncodeError> {
    let len = length("ext", data.len())?;
    let fixed = match len {
        1 => Some(0xd4),
        2 => Some(0xd5),
        4 => Some(0xd6),
        8 => Some(0xd7),
        16 => Some(0xd8),
        _ => None,
    };
    match fixed {
        Some(marker) => out.push(marker),
        None => write_header(out, len, None, [Some(0xc7), Some(0xc8), Some(0xc9)]),
    }
    out.push(tag as u8);
    out.extend_from_slice(data);
    Ok(())
}

pub(crate) fn write_array_len(out: &mut Vec<u8>, n: usize) -> Result<(), EncodeError> {
    let len = length("array", n)?;
    write_header(out, len, Some((0x90, 15)), [None, Some(0xdc), Some(0xdd)]);
    Ok(())
}

pub(crate) fn write_map_len(out: &mut Vec<u8>, n: usize) -> Result<(), EncodeError> {
    let len = length("map", n)?;
    write_header(out, len, Some((0x80, 15)), [None, Some(0xde), Some(0xdf)]);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(f: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        let mut out = Vec::new();
        f(&mut out);
        out
    }

    #[test]
    fn uint_boundaries_use_the_smallest_marker() {
        assert_eq!(bytes(|o| write_uint(o, 127)), [0x7f]);
        assert_eq!(bytes(|o| write_uint(o, 128)), [0xcc, 0x80]);
        assert_eq!(bytes(|o| write_uint(o, 256)), [0xcd, 0x01, 0x00]);
        assert_eq!(bytes(|o| write_uint(o, 65_536)), [0xce, 0, 1, 0, 0]);
        assert_eq!(
            bytes(|o| write_uint(o, 1 << 32)),
            [0xcf, 0, 0, 0, 1, 0, 0, 0, 0]
        );
    }

    #[test]
    fn negative_ints_use_signed_markers() {
        assert_eq!(bytes(|o| write_int(o, -1)), [0xff]);
        assert_eq!(bytes(|o| write_int(o, -33)), [0xd0, 0xdf]);
        assert_eq!(bytes(|o| write_int(o, -129)), [0xd1, 0xff, 0x7f]);
        assert_eq!(bytes(|o| write_int(o, 5)), [0x05]);
    }

    #[test]
    fn str_and_bin_headers_follow_length() {
        let s31 = "r".repeat(31);
        let s32 = "r".repeat(32);
        assert_eq!(bytes(|o| write_str(o, &s31).unwrap())[0], 0xbf);
        assert_eq!(bytes(|o| write_str(o, &s32).unwrap())[..2], [0xd9, 32]);
        assert_eq!(bytes(|o| write_bin(o, &[]).unwrap()), [0xc4, 0x00]);
        assert_eq!(
            bytes(|o| write_bin(o, &[0; 256]).unwrap())[..3],
            [0xc5, 0x01, 0x00]
        );
    }

    #[test]
    fn containers_switch_from_fix_forms_at_16() {
        assert_eq!(bytes(|o| write_array_len(o, 15).unwrap()), [0x9f]);
        assert_eq!(bytes(|o| write_array_len(o, 16).unwrap()), [0xdc, 0, 16]);
        assert_eq!(bytes(|o| write_map_len(o, 8).unwrap()), [0x88]);
        assert_eq!(
            bytes(|o| write_map_len(o, 70_000).unwrap()),
            [0xdf, 0, 1, 0x11, 0x70]
        );
    }
}
