//! The synthetic workload: blocks any tool can reproduce byte for byte.
//!
//! Key `i` is `sha256("kvpeer-synthetic:" + decimal i)` (32 bytes) followed by KV-cache group
//! index 0 as 4 bytes big-endian; the content of a block is `sha256(key)` repeated and cut to
//! `block_len` bytes. (docs/synthetic-workload.md.)

use kvpeer_proto::OffloadKey;
use sha2::{Digest, Sha256};

/// Synthetic key `i`.
pub fn key(i: u64) -> OffloadKey {
    let hash = Sha256::digest(format!("kvpeer-synthetic:{i}").as_bytes());
    OffloadKey::from_parts(&hash, 0)
}

/// The content of the block holding `key`.
pub fn content(key: &OffloadKey, block_len: usize) -> Vec<u8> {
    let pattern = Sha256::digest(key.as_bytes());
    let mut block = Vec::with_capacity(block_len);
    block.extend_from_slice(&pattern[..block_len.min(pattern.len())]);
    // Doubling copies: a 2 MiB block in 16 memcpys rather than byte by byte.
    while block.len() < block_len {
        let more = (block_len - block.len()).min(block.len());
        block.extend_from_within(..more);
    }
    block
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_and_contents_are_what_the_convention_says() {
        let k = key(0);
        assert_eq!(k.as_bytes().len(), 36);
        assert_eq!(k.group_idx(), Some(0));
        // sha256("kvpeer-synthetic:0"), computed independently with Python's hashlib.
        assert_eq!(
            hex::encode(k.block_hash().unwrap_or_default()),
            "e9d6443b8ad29cd5a9f0d030595303938bfb072fb3a8341327484e893a680faa"
        );
        let c = content(&k, 70);
        assert_eq!(c.len(), 70);
        assert_eq!(c[..32], c[32..64]);
        assert_eq!(c[..6], c[64..]);
        assert_eq!(content(&k, 5), c[..5]);
        assert!(content(&k, 0).is_empty());
    }
}
