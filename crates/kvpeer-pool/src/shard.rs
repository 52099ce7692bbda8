//! Which pool node owns a prefix, when several split the key space: rendezvous (highest random
//! weight) hashing of the prefix's **root chunk** over the pool nodes' P2P identities.
//!
//! Every chunk of one prefix belongs to the pool that owns the prefix's first chunk, so a
//! request finds its whole prefix on one pool, in one lookup round trip, and the pools need no
//! coordinator: each computes the same owner from the same member list. Adding or removing a
//! member moves only the prefixes it wins or held (about 1/n of them).
//!
//! The weight of member `m` for root key `k` is the first 8 bytes, big-endian, of
//! `SHA-256(m as UTF-8 · 0x00 · k)`; the highest weight owns `k` (ties, which need equal
//! digests, go to the member listed first). A tier or router choosing a pool computes the same
//! thing (the unit tests hold vectors computed with Python's `hashlib`). Pure: no I/O.
//!
//! A member is hashed in its canonical form ([`PeerAddr`]: `localhost:5600`, `2130706433:5600`
//! and `[::ffff:127.0.0.1]:5600` are all `127.0.0.1:5600`; a host name in lower case), so a
//! consumer's `sources` and the pools' `--shard` agree on owners however each spells a pool;
//! a member that is not `host:port` is hashed as written. A router hashing by itself should
//! write members canonically (an IPv4 address as a.b.c.d).

use kvpeer_proto::{OffloadKey, PeerAddr};
use sha2::{Digest, Sha256};

/// The weight of `member` for the prefix whose root chunk is `root`.
pub fn weight(member: &str, root: &OffloadKey) -> u64 {
    let mut h = Sha256::new();
    h.update(member.as_bytes());
    h.update([0u8]);
    h.update(root.as_bytes());
    let digest = h.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    u64::from_be_bytes(first)
}

/// `member` as it is hashed: its canonical `host:port`, or as written when it is not one.
pub fn canonical(member: &str) -> String {
    PeerAddr::parse(member).map_or_else(|_| member.to_owned(), |a| a.to_string())
}

/// The index in `members` of the one that owns the prefix rooted at `root` (`None` if there
/// are no members).
pub fn owner<S: AsRef<str>>(members: &[S], root: &OffloadKey) -> Option<usize> {
    let mut best: Option<(u64, usize)> = None;
    for (i, m) in members.iter().enumerate() {
        let w = weight(&canonical(m.as_ref()), root);
        if best.is_none_or(|(bw, _)| w > bw) {
            best = Some((w, i));
        }
    }
    best.map(|(_, i)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn root(i: u32) -> OffloadKey {
        let mut h = [0u8; 32];
        h[..4].copy_from_slice(&i.to_be_bytes());
        OffloadKey::from_parts(&h, 0)
    }

    /// Vectors computed with Python's hashlib (`hashlib.sha256(m.encode() + b"\0" +
    /// key).digest()[:8]`), the form a tier or router in Python uses.
    #[test]
    fn weights_are_the_documented_digest() {
        let k = OffloadKey::from_parts(&[7u8; 32], 0);
        let members = ["10.0.0.5:5710", "10.0.0.6:5710", "10.0.0.7:5710"];
        let want = [
            0x935a_6f37_4595_1cf9,
            0xf6f3_b538_3fee_63e4,
            0xc84a_37e6_c89d_2edc,
        ];
        for (m, w) in members.iter().zip(want) {
            assert_eq!(weight(m, &k), w, "{m}");
        }
        assert_eq!(owner(&members, &k), Some(1));
    }

    #[test]
    fn a_member_spelled_otherwise_owns_the_same_prefixes() {
        let canonical = ["10.0.0.5:5710", "127.0.0.1:5710", "node-c:5710"];
        let spelled = ["167772165:5710", "localhost:5710", "NODE-C:5710"];
        for i in 0..200 {
            assert_eq!(
                owner(&canonical, &root(i)),
                owner(&spelled, &root(i)),
                "{i}"
            );
        }
    }

    #[test]
    fn owners_split_roots_evenly_and_move_little_when_a_member_leaves() {
        let four = ["a:1", "b:2", "c:3", "d:4"];
        let mut counts = [0usize; 4];
        let roots: Vec<OffloadKey> = (0..4000).map(root).collect();
        for r in &roots {
            counts[owner(&four, r).unwrap()] += 1;
        }
        for c in counts {
            assert!((800..1200).contains(&c), "{counts:?}");
        }
        // Without d, only d's roots move; every other root keeps its owner.
        let three = &four[..3];
        for r in &roots {
            let before = owner(&four, r).unwrap();
            let after = owner(three, r).unwrap();
            if before != 3 {
                assert_eq!(before, after);
            }
        }
        assert_eq!(owner::<&str>(&[], &roots[0]), None);
    }
}
