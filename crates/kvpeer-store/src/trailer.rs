//! The pool object's trailer and the `shm` plane's ownership token: the one definition of both
//! formats, used by the pool that writes the trailer and by the planes that check it.
//!
//! A pool object is `num_blocks × block_len + TRAILER_LEN` bytes. The trailer starts right after
//! the last block (so block offsets are those of a pool without one):
//!
//! ```text
//! offset (from the trailer's start)  bytes
//!  0 ..  8                           magic "KVPSHM02" ("KVPSHM01": a pool without fence words)
//!  8 .. 40                           secret: 32 random bytes, drawn when the pool is created
//! 40 .. 4096                         zero
//! ```
//!
//! A node proves to a destination peer `D` that it owns the object it names in `agent_metadata`
//! by sending `shm_token = HMAC-SHA256(secret, msg)` with
//! `msg = u32be(19) ‖ "kvpeer-shm-token-v2" ‖ u32be(len(D)) ‖ D ‖ u32be(len(C)) ‖ C` (`D` the
//! destination's peer id, UTF-8; `C` the challenge the destination's READY gave the connection
//! the `connect` goes on, 16 random bytes). Only a process that can read the object knows the
//! secret; a token made for one destination is worthless to any other, and one made for one
//! connection of the destination is worthless on any other connection or to a later instance
//! at the same address (docs/security.md, "Fresh proofs").
//!
//! A destination that gives no challenge (a ROUTER that is not kvpeer's) gets version 1:
//! `msg = u32be(19) ‖ "kvpeer-shm-token-v1" ‖ u32be(len(D)) ‖ D`, the same for every
//! connection: a kvpeer node accepts it only when configured to (`shm_allow_replayable_tokens`).

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Bytes of the trailer (one page), after the blocks.
pub const TRAILER_LEN: u64 = 4096;
/// The trailer's first bytes in a pool kvpeer makes: version 2, a pool with fence words beside
/// it ([`crate::fence`]). A writer from before the fences (it knows only version 1) refuses such
/// a pool instead of writing into it unfenced.
pub const MAGIC: [u8; 8] = *b"KVPSHM02";
/// The magic of a version-1 pool (no fence words: kvpeer before them, or the Python interop
/// transport); a writer still accepts it.
pub const MAGIC_V1: [u8; 8] = *b"KVPSHM01";
/// Bytes of the secret, right after the magic.
pub const SECRET_LEN: usize = 32;
/// Bytes of a token (an HMAC-SHA256).
pub const TOKEN_LEN: usize = 32;
/// The domain-separation label of a version-1 token (no challenge), first field of its message.
pub const TOKEN_LABEL: &[u8] = b"kvpeer-shm-token-v1";
/// The label of a version-2 token (bound to the destination's challenge).
pub const TOKEN_LABEL_V2: &[u8] = b"kvpeer-shm-token-v2";

/// Why bytes are not a pool trailer.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TrailerError {
    /// Fewer bytes than magic and secret.
    #[error("trailer of {0} bytes is too short")]
    Short(usize),
    /// The first 8 bytes are neither [`MAGIC`] nor [`MAGIC_V1`].
    #[error("trailer magic is neither \"KVPSHM02\" nor \"KVPSHM01\"")]
    BadMagic,
}

/// Size of the object holding `num_blocks` blocks of `block_len` bytes and the trailer; `None`
/// when it overflows.
pub fn object_len(num_blocks: u64, block_len: u64) -> Option<u64> {
    num_blocks.checked_mul(block_len)?.checked_add(TRAILER_LEN)
}

/// The trailer's first [`MAGIC`]` + `[`SECRET_LEN`] bytes for `secret` (the rest is zero).
pub fn encode(secret: &[u8; SECRET_LEN]) -> [u8; MAGIC.len() + SECRET_LEN] {
    let mut out = [0u8; MAGIC.len() + SECRET_LEN];
    out[..MAGIC.len()].copy_from_slice(&MAGIC);
    out[MAGIC.len()..].copy_from_slice(secret);
    out
}

/// The secret of a trailer (`bytes` starts at the trailer's first byte).
pub fn parse_trailer(bytes: &[u8]) -> Result<[u8; SECRET_LEN], TrailerError> {
    let head = bytes
        .get(..MAGIC.len() + SECRET_LEN)
        .ok_or(TrailerError::Short(bytes.len()))?;
    let (magic, secret) = head.split_at(MAGIC.len());
    if magic != MAGIC && magic != MAGIC_V1 {
        return Err(TrailerError::BadMagic);
    }
    let mut out = [0u8; SECRET_LEN];
    out.copy_from_slice(secret);
    Ok(out)
}

fn mac(secret: &[u8; SECRET_LEN], destination: &str, challenge: Option<&[u8]>) -> Hmac<Sha256> {
    // Any key length is valid for HMAC: this cannot fail.
    let mut mac = match <Hmac<Sha256> as Mac>::new_from_slice(secret) {
        Ok(mac) => mac,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    let fields: &[&[u8]] = match challenge {
        Some(c) => &[TOKEN_LABEL_V2, destination.as_bytes(), c],
        None => &[TOKEN_LABEL, destination.as_bytes()],
    };
    for field in fields {
        // Peer ids and the label are far below 4 GiB; a longer one is cut to u32::MAX in the
        // prefix, which no honest destination reaches.
        let len = u32::try_from(field.len()).unwrap_or(u32::MAX);
        mac.update(&len.to_be_bytes());
        mac.update(field);
    }
    mac
}

/// The token proving ownership of the pool with `secret` to the peer `destination`, on the
/// connection it gave `challenge` (version 2), or with none (version 1).
pub fn token(
    secret: &[u8; SECRET_LEN],
    destination: &str,
    challenge: Option<&[u8]>,
) -> [u8; TOKEN_LEN] {
    mac(secret, destination, challenge)
        .finalize()
        .into_bytes()
        .into()
}

/// Whether `candidate` is [`token`]`(secret, destination, challenge)`, compared in constant
/// time.
pub fn verify(
    secret: &[u8; SECRET_LEN],
    destination: &str,
    challenge: Option<&[u8]>,
    candidate: &[u8],
) -> bool {
    mac(secret, destination, challenge)
        .verify_slice(candidate)
        .is_ok()
}

/// A fresh random secret.
pub fn new_secret() -> Result<[u8; SECRET_LEN], getrandom::Error> {
    let mut secret = [0u8; SECRET_LEN];
    getrandom::fill(&mut secret)?;
    Ok(secret)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trailer_round_trips_and_bad_ones_are_refused() {
        let secret = [0x5a; SECRET_LEN];
        let mut page = vec![0u8; TRAILER_LEN as usize];
        page[..40].copy_from_slice(&encode(&secret));
        assert_eq!(&page[..8], b"KVPSHM02");
        assert_eq!(parse_trailer(&page), Ok(secret));
        assert_eq!(parse_trailer(&page[..39]), Err(TrailerError::Short(39)));
        page[0] ^= 1;
        assert_eq!(parse_trailer(&page), Err(TrailerError::BadMagic));
        assert_eq!(
            parse_trailer(&[0; 4096]),
            Err(TrailerError::BadMagic),
            "zeros"
        );
    }

    #[test]
    fn the_object_holds_the_blocks_then_one_page() {
        assert_eq!(object_len(4, 1024), Some(4 * 1024 + 4096));
        assert_eq!(object_len(u64::MAX, 2), None);
        assert_eq!(object_len(1, u64::MAX), None);
    }

    #[test]
    fn a_token_is_the_hmac_of_the_length_prefixed_label_and_destination() {
        let secret: [u8; 32] = std::array::from_fn(|i| i as u8);
        let t = token(&secret, "127.0.0.1:5711", None);
        // The message, built by hand.
        let mut msg = Vec::new();
        msg.extend_from_slice(&19u32.to_be_bytes());
        msg.extend_from_slice(b"kvpeer-shm-token-v1");
        msg.extend_from_slice(&14u32.to_be_bytes());
        msg.extend_from_slice(b"127.0.0.1:5711");
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&secret).unwrap();
        mac.update(&msg);
        assert_eq!(t, <[u8; 32]>::from(mac.finalize().into_bytes()));
        // Fixed vector (Python's hmac gives the same: docs/data-planes.md).
        assert_eq!(
            hex(&t),
            "7ba935412f31d30eb915b985a49c68248b39e94a95ab35e266e6bc248ba1eea2"
        );
        assert!(verify(&secret, "127.0.0.1:5711", None, &t));
    }

    #[test]
    fn a_v2_token_adds_the_length_prefixed_challenge_under_its_own_label() {
        let secret: [u8; 32] = std::array::from_fn(|i| i as u8);
        let challenge = [0xc5u8; 16];
        let t = token(&secret, "127.0.0.1:5711", Some(&challenge));
        let mut msg = Vec::new();
        msg.extend_from_slice(&19u32.to_be_bytes());
        msg.extend_from_slice(b"kvpeer-shm-token-v2");
        msg.extend_from_slice(&14u32.to_be_bytes());
        msg.extend_from_slice(b"127.0.0.1:5711");
        msg.extend_from_slice(&16u32.to_be_bytes());
        msg.extend_from_slice(&challenge);
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&secret).unwrap();
        mac.update(&msg);
        assert_eq!(t, <[u8; 32]>::from(mac.finalize().into_bytes()));
        assert!(verify(&secret, "127.0.0.1:5711", Some(&challenge), &t));
        // Another connection's challenge, or none (version 1), does not verify it.
        assert!(!verify(&secret, "127.0.0.1:5711", Some(&[0xc6; 16]), &t));
        assert!(!verify(&secret, "127.0.0.1:5711", None, &t));
        let v1 = token(&secret, "127.0.0.1:5711", None);
        assert!(!verify(&secret, "127.0.0.1:5711", Some(&challenge), &v1));
    }

    #[test]
    fn a_token_binds_secret_and_destination() {
        let (a, b) = ([1u8; 32], [2u8; 32]);
        let c = Some(&[9u8; 16][..]);
        let t = token(&a, "127.0.0.1:1", c);
        assert!(verify(&a, "127.0.0.1:1", c, &t));
        assert!(!verify(&a, "127.0.0.1:2", c, &t), "another destination");
        assert!(!verify(&b, "127.0.0.1:1", c, &t), "another secret");
        assert!(!verify(&a, "127.0.0.1:1", c, &t[..31]), "truncated");
        assert!(!verify(&a, "127.0.0.1:1", c, &[]), "empty");
        // Length prefixes keep field boundaries: no two (label, destination) pairs collide.
        assert_ne!(token(&a, "x", None), token(&a, "x\0", None));
        assert_ne!(token(&a, "x", Some(b"y")), token(&a, "xy", Some(b"")));
    }

    #[test]
    fn secrets_are_random() {
        assert_ne!(new_secret().unwrap(), new_secret().unwrap());
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }
}
