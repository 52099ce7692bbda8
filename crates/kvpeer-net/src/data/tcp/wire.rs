//! The tcp plane's frames, byte for byte: encoding and decoding of HELLO, WRITE and ACK, pure
//! (no sockets), so the formats live in one place and are tested against fixed byte vectors.
//!
//! ```text
//! HELLO  "KVPH" | version u8 = 2 | id_len u16 BE | writer id (UTF-8, 1..=1024 bytes) | key[32]
//! WRITE  "KVPW" | transfer id u64 BE | count u32 BE | count × block index u64 BE
//!        | count × block_len bytes, in index order (streamed, not handled here)
//!   or   "KVPD" | transfer id u64 BE | count u32 BE | count × block index u64 BE
//!        | count × CRC-32C u32 BE (of each block's index, 8 bytes BE, then its bytes)
//!        | count × block_len bytes
//!        (to a receiver whose `agent_metadata` asks for it: `tcp_digests`)
//! ACK    "KVPA" | transfer id u64 BE | status u8 (0 written, 2 a block did not match its
//!        digest, anything else refused)
//! ```
//!
//! The receiver reads a HELLO in stages so it can refuse junk as early as possible (the magic
//! and version before the length, the length before the id): [`check_hello_start`],
//! [`hello_id_len`], [`hello_body`]. [`decode_hello`] composes them over a whole buffer.

use kvpeer_core::{BlockIndex, TransferId};

use super::KEY_LEN;

/// A HELLO's first bytes.
pub(super) const HELLO_MAGIC: &[u8; 4] = b"KVPH";
/// A WRITE's first bytes.
pub(super) const WRITE_MAGIC: &[u8; 4] = b"KVPW";
/// A WRITE with a digest per block: its first bytes.
pub(super) const DIGEST_WRITE_MAGIC: &[u8; 4] = b"KVPD";
/// An ACK's first bytes.
pub(super) const ACK_MAGIC: &[u8; 4] = b"KVPA";
/// The HELLO version this plane speaks (1 had no key and is refused).
pub(super) const VERSION: u8 = 2;
/// Longest writer id a HELLO may carry.
pub(super) const MAX_ID_LEN: usize = 1024;
/// Bytes of a HELLO before its id: magic, version, id length.
pub(super) const HELLO_HEAD_LEN: usize = 7;
/// Bytes of a HELLO's magic and version, checked before anything else is read.
pub(super) const HELLO_START_LEN: usize = 5;
/// Bytes of a WRITE header after its magic: transfer id and count.
pub(super) const WRITE_HEAD_LEN: usize = 12;
/// Bytes of an ACK.
pub(super) const ACK_LEN: usize = 13;

/// Why bytes are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub(super) enum WireError {
    /// Fewer bytes than the frame needs.
    #[error("truncated frame: {got} bytes, {need} needed")]
    Truncated {
        /// Bytes given.
        got: usize,
        /// Bytes needed.
        need: usize,
    },
    /// More bytes than the frame holds.
    #[error("{0} bytes after the frame")]
    Trailing(usize),
    /// Not a kvpeer v2 HELLO (magic or version).
    #[error("not a kvpeer v2 tcp data connection")]
    NotHello,
    /// A writer id of 0 or more than [`MAX_ID_LEN`] bytes.
    #[error("writer id of {0} bytes")]
    IdLen(usize),
    /// The writer id is not UTF-8.
    #[error("writer id is not UTF-8")]
    IdNotUtf8,
    /// A frame that is not the one expected.
    #[error("bad frame")]
    BadMagic,
    /// A WRITE naming no block, or more than the receiver's pool holds.
    #[error("{count} blocks in one write")]
    BadCount {
        /// The WRITE's transfer id (its refusal names it).
        tid: TransferId,
        /// Blocks it names.
        count: u64,
    },
    /// More block indexes than a WRITE's u32 count can say.
    #[error("{0} blocks do not fit one write")]
    TooManyBlocks(usize),
    /// A digest list not one per block.
    #[error("{digests} digests for {blocks} blocks")]
    DigestCount {
        /// Digests given.
        digests: usize,
        /// Blocks named.
        blocks: usize,
    },
}

fn take<const N: usize>(bytes: &[u8], at: usize) -> [u8; N] {
    let mut out = [0u8; N];
    out.copy_from_slice(&bytes[at..at + N]);
    out
}

/// A HELLO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Hello {
    /// The writer's peer id.
    pub(super) writer: String,
    /// The key the receiver issued to that writer.
    pub(super) key: [u8; KEY_LEN],
}

/// The HELLO a writer `id` sends with `key`. Only an id whose length does not fit the u16 is
/// refused here; a receiver refuses an empty one or one over [`MAX_ID_LEN`] bytes.
pub(super) fn encode_hello(id: &str, key: &[u8; KEY_LEN]) -> Result<Vec<u8>, WireError> {
    let id = id.as_bytes();
    let id_len = u16::try_from(id.len()).map_err(|_| WireError::IdLen(id.len()))?;
    let mut out = Vec::with_capacity(HELLO_HEAD_LEN + id.len() + KEY_LEN);
    out.extend_from_slice(HELLO_MAGIC);
    out.push(VERSION);
    out.extend_from_slice(&id_len.to_be_bytes());
    out.extend_from_slice(id);
    out.extend_from_slice(key);
    Ok(out)
}

/// Checks a HELLO's first [`HELLO_START_LEN`] bytes: the magic and version 2.
pub(super) fn check_hello_start(start: &[u8; HELLO_START_LEN]) -> Result<(), WireError> {
    if &start[..4] != HELLO_MAGIC || start[4] != VERSION {
        return Err(WireError::NotHello);
    }
    Ok(())
}

/// The writer id's length, from the two bytes after the version.
pub(super) fn hello_id_len(len: [u8; 2]) -> Result<usize, WireError> {
    let id_len = u16::from_be_bytes(len) as usize;
    if id_len == 0 || id_len > MAX_ID_LEN {
        return Err(WireError::IdLen(id_len));
    }
    Ok(id_len)
}

/// The id and key: the `id_len + KEY_LEN` bytes after the HELLO's head.
pub(super) fn hello_body(id_len: usize, body: &[u8]) -> Result<Hello, WireError> {
    let need = id_len + KEY_LEN;
    if body.len() < need {
        return Err(WireError::Truncated {
            got: body.len(),
            need,
        });
    }
    if body.len() > need {
        return Err(WireError::Trailing(body.len() - need));
    }
    let (id, key) = body.split_at(id_len);
    let writer = std::str::from_utf8(id)
        .map_err(|_| WireError::IdNotUtf8)?
        .to_owned();
    Ok(Hello {
        writer,
        key: take::<KEY_LEN>(key, 0),
    })
}

/// A whole HELLO (`bytes` holds exactly one).
pub(super) fn decode_hello(bytes: &[u8]) -> Result<Hello, WireError> {
    let truncated = |need| WireError::Truncated {
        got: bytes.len(),
        need,
    };
    if bytes.len() < HELLO_START_LEN {
        return Err(truncated(HELLO_START_LEN));
    }
    check_hello_start(&take::<HELLO_START_LEN>(bytes, 0))?;
    if bytes.len() < HELLO_HEAD_LEN {
        return Err(truncated(HELLO_HEAD_LEN));
    }
    let id_len = hello_id_len(take::<2>(bytes, HELLO_START_LEN))?;
    hello_body(id_len, &bytes[HELLO_HEAD_LEN..]).map_err(|e| match e {
        WireError::Truncated { need, .. } => truncated(HELLO_HEAD_LEN + need),
        other => other,
    })
}

/// A WRITE's header: magic, transfer id, count and the block indexes, then, with `digests`
/// (one per block), each block's CRC-32C (the blocks follow).
pub(super) fn encode_write_header(
    tid: TransferId,
    indexes: &[BlockIndex],
    digests: Option<&[u32]>,
) -> Result<Vec<u8>, WireError> {
    let count =
        u32::try_from(indexes.len()).map_err(|_| WireError::TooManyBlocks(indexes.len()))?;
    if let Some(d) = digests.filter(|d| d.len() != indexes.len()) {
        return Err(WireError::DigestCount {
            digests: d.len(),
            blocks: indexes.len(),
        });
    }
    let per_block = if digests.is_some() { 12 } else { 8 };
    let mut out = Vec::with_capacity(4 + WRITE_HEAD_LEN + per_block * indexes.len());
    out.extend_from_slice(if digests.is_some() {
        DIGEST_WRITE_MAGIC
    } else {
        WRITE_MAGIC
    });
    out.extend_from_slice(&tid.get().to_be_bytes());
    out.extend_from_slice(&count.to_be_bytes());
    for i in indexes {
        out.extend_from_slice(&i.get().to_be_bytes());
    }
    for d in digests.unwrap_or_default() {
        out.extend_from_slice(&d.to_be_bytes());
    }
    Ok(out)
}

/// Checks a frame's magic is a WRITE's; whether its header carries digests.
pub(super) fn check_write_magic(magic: &[u8; 4]) -> Result<bool, WireError> {
    match magic {
        m if m == WRITE_MAGIC => Ok(false),
        m if m == DIGEST_WRITE_MAGIC => Ok(true),
        _ => Err(WireError::BadMagic),
    }
}

/// A WRITE's digests: `raw` is `count × 4` bytes.
pub(super) fn decode_digests(raw: &[u8]) -> Result<Vec<u32>, WireError> {
    if !raw.len().is_multiple_of(4) {
        return Err(WireError::Truncated {
            got: raw.len(),
            need: raw.len().next_multiple_of(4),
        });
    }
    Ok(raw
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes(take::<4>(c, 0)))
        .collect())
}

/// The digest of the block a WRITE names at receiver index `index`: CRC-32C over the index
/// (8 bytes, big-endian) and then the block's bytes, so a block that lands under another index
/// (a flipped bit in the header) fails too.
pub(super) fn digest(index: BlockIndex, block: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&index.get().to_be_bytes()), block)
}

/// A WRITE's transfer id and block count, from the [`WRITE_HEAD_LEN`] bytes after its magic;
/// a count of 0 or over `max_blocks` (the receiver's pool) is refused, naming the transfer.
pub(super) fn decode_write_head(
    head: &[u8; WRITE_HEAD_LEN],
    max_blocks: u64,
) -> Result<(TransferId, usize), WireError> {
    let tid = TransferId::new(u64::from_be_bytes(take::<8>(head, 0)));
    let count = u64::from(u32::from_be_bytes(take::<4>(head, 8)));
    if count == 0 || count > max_blocks {
        return Err(WireError::BadCount { tid, count });
    }
    // At most u32::MAX: fits usize on the 64-bit targets kvpeer builds for.
    Ok((tid, count as usize))
}

/// The block indexes of a WRITE: `raw` is `count × 8` bytes.
pub(super) fn decode_indexes(raw: &[u8]) -> Result<Vec<BlockIndex>, WireError> {
    if !raw.len().is_multiple_of(8) {
        return Err(WireError::Truncated {
            got: raw.len(),
            need: raw.len().next_multiple_of(8),
        });
    }
    Ok(raw
        .chunks_exact(8)
        .map(|c| BlockIndex::new(u64::from_be_bytes(take::<8>(c, 0))))
        .collect())
}

/// What an ACK says of its transfer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AckStatus {
    /// Every block landed (status 0).
    Written,
    /// Refused (status 1, or any the writer does not know): the receiver closes.
    Refused,
    /// Every byte was read, but a block did not match its digest (status 2): that transfer
    /// failed, and the connection goes on.
    Corrupted,
}

/// An ACK: transfer `tid` written (`true`) or refused.
pub(super) fn encode_ack(tid: TransferId, written: bool) -> [u8; ACK_LEN] {
    encode_ack_status(
        tid,
        if written {
            AckStatus::Written
        } else {
            AckStatus::Refused
        },
    )
}

/// An ACK for transfer `tid` with `status`.
pub(super) fn encode_ack_status(tid: TransferId, status: AckStatus) -> [u8; ACK_LEN] {
    let mut out = [0u8; ACK_LEN];
    out[..4].copy_from_slice(ACK_MAGIC);
    out[4..12].copy_from_slice(&tid.get().to_be_bytes());
    out[12] = match status {
        AckStatus::Written => 0,
        AckStatus::Refused => 1,
        AckStatus::Corrupted => 2,
    };
    out
}

/// An ACK's transfer id and what it says.
pub(super) fn decode_ack(frame: &[u8; ACK_LEN]) -> Result<(TransferId, AckStatus), WireError> {
    if &frame[..4] != ACK_MAGIC {
        return Err(WireError::BadMagic);
    }
    let tid = TransferId::new(u64::from_be_bytes(take::<8>(frame, 4)));
    let status = match frame[12] {
        0 => AckStatus::Written,
        2 => AckStatus::Corrupted,
        _ => AckStatus::Refused,
    };
    Ok((tid, status))
}

/// The fuzz target `tcp_frames` (fuzz/): every decoder over any bytes, and each frame that
/// decodes re-encoded to the bytes it came from. Panics (the fuzzer's finding) where that fails.
pub(super) fn fuzz_frames(data: &[u8]) {
    if let Ok(hello) = decode_hello(data) {
        let again = encode_hello(&hello.writer, &hello.key);
        assert_eq!(again.as_deref(), Ok(data), "a HELLO re-encodes to itself");
    }
    if data.len() >= 4 + WRITE_HEAD_LEN {
        if let Ok(digests) = check_write_magic(&take::<4>(data, 0)) {
            // A receiver's pool of 4,096 blocks: larger counts are refused by the head.
            if let Ok((tid, count)) = decode_write_head(&take::<WRITE_HEAD_LEN>(data, 4), 4096) {
                assert!((1..=4096).contains(&count));
                let at = 4 + WRITE_HEAD_LEN;
                let per = if digests { 12 } else { 8 };
                if let Some(head) = data.get(..at + per * count) {
                    let indexes = decode_indexes(&head[at..at + 8 * count]);
                    let digests = digests.then(|| decode_digests(&head[at + 8 * count..]));
                    let (Ok(indexes), Some(Ok(_)) | None) = (&indexes, &digests) else {
                        panic!("whole lists failed to decode: {indexes:?} {digests:?}");
                    };
                    let digests = digests.and_then(Result::ok);
                    let again = encode_write_header(tid, indexes, digests.as_deref());
                    assert_eq!(
                        again.as_deref(),
                        Ok(head),
                        "a WRITE header re-encodes to itself"
                    );
                }
            }
        }
    }
    if data.len() >= ACK_LEN {
        let frame = take::<ACK_LEN>(data, 0);
        if let Ok((tid, status)) = decode_ack(&frame) {
            let again = encode_ack_status(tid, status);
            assert_eq!(again[..12], frame[..12]);
            if matches!(frame[12], 0..=2) {
                assert_eq!(again, frame, "a known status re-encodes to itself");
            }
        }
    }
    // Lists of any length: a whole number of items or a clear error, never a panic.
    match decode_indexes(data) {
        Ok(v) => assert_eq!(v.len() * 8, data.len()),
        Err(e) => assert!(matches!(e, WireError::Truncated { .. })),
    }
    match decode_digests(data) {
        Ok(v) => assert_eq!(v.len() * 4, data.len()),
        Err(e) => assert!(matches!(e, WireError::Truncated { .. })),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn the_fuzz_targets_checks_hold_on_every_frame_kind() {
        let hello = encode_hello("10.0.0.1:5600", &KEY).unwrap();
        let write = encode_write_header(
            TransferId::new(9),
            &[BlockIndex::new(1), BlockIndex::new(7)],
            None,
        )
        .unwrap();
        let digested = encode_write_header(
            TransferId::new(9),
            &[BlockIndex::new(1)],
            Some(&[0xdead_beef]),
        )
        .unwrap();
        let ack = encode_ack_status(TransferId::new(3), AckStatus::Corrupted);
        for frame in [
            &hello[..],
            &write,
            &digested,
            &ack,
            b"",
            b"KVPD",
            &[0xff; 40],
        ] {
            fuzz_frames(frame);
        }
    }

    const KEY: [u8; KEY_LEN] = [0xA5; KEY_LEN];

    fn hello_vector() -> Vec<u8> {
        let mut v = vec![b'K', b'V', b'P', b'H', 0x02, 0x00, 0x03, b'a', b':', b'1'];
        v.extend_from_slice(&[0xA5; 32]);
        v
    }

    #[test]
    fn a_hello_is_these_exact_bytes_and_decodes_back() {
        let bytes = encode_hello("a:1", &KEY).unwrap();
        assert_eq!(bytes, hello_vector());
        assert_eq!(
            decode_hello(&bytes).unwrap(),
            Hello {
                writer: "a:1".into(),
                key: KEY
            }
        );
        // The staged decoders agree with the whole-buffer one.
        check_hello_start(&bytes[..5].try_into().unwrap()).unwrap();
        assert_eq!(hello_id_len([bytes[5], bytes[6]]), Ok(3));
        assert_eq!(hello_body(3, &bytes[7..]).unwrap().writer, "a:1");
    }

    #[test]
    fn truncated_oversized_and_wrong_version_hellos_are_refused() {
        let v = hello_vector();
        for cut in 0..v.len() {
            assert!(
                matches!(decode_hello(&v[..cut]), Err(WireError::Truncated { .. })),
                "cut at {cut}"
            );
        }
        let mut long = v.clone();
        long.push(0);
        assert_eq!(decode_hello(&long), Err(WireError::Trailing(1)));
        let mut v1 = v.clone();
        v1[4] = 1;
        assert_eq!(decode_hello(&v1), Err(WireError::NotHello), "version 1");
        let mut v3 = v.clone();
        v3[4] = 3;
        assert_eq!(decode_hello(&v3), Err(WireError::NotHello), "version 3");
        let mut magic = v.clone();
        magic[0] = b'X';
        assert_eq!(decode_hello(&magic), Err(WireError::NotHello));
        assert_eq!(hello_id_len([0x04, 0x01]), Err(WireError::IdLen(1025)));
        assert_eq!(hello_id_len([0x04, 0x00]), Ok(1024));
        assert_eq!(hello_id_len([0, 0]), Err(WireError::IdLen(0)));
        assert_eq!(
            encode_hello(&"x".repeat(65536), &KEY),
            Err(WireError::IdLen(65536))
        );
        // Encodable, but a receiver refuses it.
        let oversized = encode_hello(&"x".repeat(1025), &KEY).unwrap();
        assert_eq!(decode_hello(&oversized), Err(WireError::IdLen(1025)));
        let mut bad_utf8 = v.clone();
        bad_utf8[7] = 0xFF;
        assert_eq!(decode_hello(&bad_utf8), Err(WireError::IdNotUtf8));
    }

    #[test]
    fn a_write_header_is_these_exact_bytes_and_decodes_back() {
        let bytes = encode_write_header(
            0x0102_0304_0506_0708.into(),
            &[1.into(), 0xFFEE.into()],
            None,
        )
        .unwrap();
        let want: Vec<u8> = [
            &b"KVPW"[..],
            &[1, 2, 3, 4, 5, 6, 7, 8],
            &[0, 0, 0, 2],
            &[0, 0, 0, 0, 0, 0, 0, 1],
            &[0, 0, 0, 0, 0, 0, 0xFF, 0xEE],
        ]
        .concat();
        assert_eq!(bytes, want);
        assert!(!check_write_magic(&bytes[..4].try_into().unwrap()).unwrap());
        let (tid, count) = decode_write_head(&bytes[4..16].try_into().unwrap(), 8).unwrap();
        assert_eq!((tid.get(), count), (0x0102_0304_0506_0708, 2));
        assert_eq!(
            decode_indexes(&bytes[16..]).unwrap(),
            vec![BlockIndex::new(1), BlockIndex::new(0xFFEE)]
        );
    }

    #[test]
    fn a_write_header_with_digests_is_these_exact_bytes_and_decodes_back() {
        let indexes = [BlockIndex::new(1), BlockIndex::new(0xFFEE)];
        let bytes = encode_write_header(
            0x0102_0304_0506_0708.into(),
            &indexes,
            Some(&[0xDEAD_BEEF, 7]),
        )
        .unwrap();
        let want: Vec<u8> = [
            &b"KVPD"[..],
            &[1, 2, 3, 4, 5, 6, 7, 8],
            &[0, 0, 0, 2],
            &[0, 0, 0, 0, 0, 0, 0, 1],
            &[0, 0, 0, 0, 0, 0, 0xFF, 0xEE],
            &[0xDE, 0xAD, 0xBE, 0xEF],
            &[0, 0, 0, 7],
        ]
        .concat();
        assert_eq!(bytes, want);
        assert!(check_write_magic(&bytes[..4].try_into().unwrap()).unwrap());
        assert_eq!(decode_indexes(&bytes[16..32]).unwrap(), indexes);
        assert_eq!(decode_digests(&bytes[32..]).unwrap(), vec![0xDEAD_BEEF, 7]);
        assert!(decode_digests(&[0; 5]).is_err());
        assert_eq!(
            encode_write_header(1.into(), &indexes, Some(&[1])),
            Err(WireError::DigestCount {
                digests: 1,
                blocks: 2
            })
        );
        // CRC-32C's check value (RFC 3720): "123456789" → 0xE3069283; the index comes first.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        let mut with_index = 7u64.to_be_bytes().to_vec();
        with_index.extend_from_slice(b"123456789");
        assert_eq!(
            digest(BlockIndex::new(7), b"123456789"),
            crc32c::crc32c(&with_index)
        );
        assert_ne!(
            digest(BlockIndex::new(7), b"123456789"),
            digest(BlockIndex::new(6), b"123456789"),
            "the same bytes under another index"
        );
        let ack = encode_ack_status(3.into(), AckStatus::Corrupted);
        assert_eq!(ack[12], 2);
        assert_eq!(decode_ack(&ack).unwrap(), (3.into(), AckStatus::Corrupted));
        let mut odd = ack;
        odd[12] = 9;
        assert_eq!(decode_ack(&odd).unwrap().1, AckStatus::Refused);
    }

    #[test]
    fn bad_writes_are_refused() {
        assert_eq!(check_write_magic(b"KVPA"), Err(WireError::BadMagic));
        let head = |count: u32| {
            let mut h = [0u8; WRITE_HEAD_LEN];
            h[..8].copy_from_slice(&7u64.to_be_bytes());
            h[8..].copy_from_slice(&count.to_be_bytes());
            h
        };
        assert_eq!(
            decode_write_head(&head(0), 8),
            Err(WireError::BadCount {
                tid: TransferId::new(7),
                count: 0
            })
        );
        assert_eq!(
            decode_write_head(&head(9), 8),
            Err(WireError::BadCount {
                tid: TransferId::new(7),
                count: 9
            }),
            "more blocks than the pool holds"
        );
        assert_eq!(
            decode_write_head(&head(u32::MAX), 8),
            Err(WireError::BadCount {
                tid: TransferId::new(7),
                count: u64::from(u32::MAX)
            })
        );
        assert_eq!(decode_write_head(&head(8), 8), Ok((TransferId::new(7), 8)));
        assert!(matches!(
            decode_indexes(&[0; 12]),
            Err(WireError::Truncated { got: 12, need: 16 })
        ));
    }

    #[test]
    fn an_ack_is_these_exact_bytes_and_any_status_but_0_or_2_is_a_refusal() {
        let ok = encode_ack(TransferId::new(0x0A0B), true);
        assert_eq!(
            ok,
            [b'K', b'V', b'P', b'A', 0, 0, 0, 0, 0, 0, 0x0A, 0x0B, 0]
        );
        assert_eq!(
            decode_ack(&ok),
            Ok((TransferId::new(0x0A0B), AckStatus::Written))
        );
        let refused = encode_ack(TransferId::new(5), false);
        assert_eq!(refused[12], 1);
        assert_eq!(
            decode_ack(&refused),
            Ok((TransferId::new(5), AckStatus::Refused))
        );
        let mut odd = ok;
        odd[12] = 7;
        assert_eq!(
            decode_ack(&odd),
            Ok((TransferId::new(0x0A0B), AckStatus::Refused))
        );
        let mut junk = ok;
        junk[3] = b'W';
        assert_eq!(decode_ack(&junk), Err(WireError::BadMagic));
    }
}
