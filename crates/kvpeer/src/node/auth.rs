//! The optional authenticated handshake: with a shared secret configured, every `connect` this
//! node sends carries `kvpeer_auth`, and a `connect` without a valid one is refused before the
//! protocol sees it (no session, no dial-back).
//!
//! `kvpeer_auth` = version `3` (1 byte) | unix time in seconds (u64 BE) | nonce (16 random
//! bytes) | HMAC-SHA256(secret, "kvpeer-auth-v3" | the destination's identity | the challenge
//! the destination gave the connection the `connect` goes on | every `connect` field, each
//! length-prefixed | time | nonce) (32 bytes): 57 bytes. Valid means: the MAC matches for
//! *this* node as the destination and for the challenge *this* node gave the connection it came
//! on (compared in constant time), the `connect`'s `peer_id` is the identity of the socket it
//! came on, the time is within [`WINDOW`] of ours, and the nonce was not seen within the
//! window. So a captured `connect` cannot be altered, replayed to this node (on the same
//! connection: the nonce; on any other: the challenge), replayed to another node that shares
//! the secret (the destination is signed), collected by whoever held this node's address
//! before it (or while it restarted) and replayed to it later (the challenge is drawn afresh
//! for each connection), or sent from another identity. It does not hide the `connect` from an
//! eavesdropper (docs/security.md). Off by default, so stock vLLM peers (which never send the
//! field) keep working; between kvpeer nodes it is all or nothing.
//!
//! Used by the node's I/O loop on its own thread.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use kvpeer_proto::{Connect, PeerId};
use sha2::Sha256;

/// How far a peer's clock may be from ours, and how long nonces are remembered.
pub(crate) const WINDOW: Duration = Duration::from_secs(300);
const VERSION: u8 = 3;
const LEN: usize = 1 + 8 + 16 + 32;

/// The secret and the nonces seen within the window.
pub(crate) struct Auth {
    secret: Vec<u8>,
    seen: HashSet<[u8; 16]>,
    /// (time seen, nonce), oldest first, to forget nonces once the window has passed.
    order: VecDeque<(u64, [u8; 16])>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("seen", &self.seen.len())
            .finish()
    }
}

/// Why a `connect` was refused by authentication, or a signature could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AuthError {
    /// The configured secret is too short.
    #[error("the auth secret has {0} bytes; at least 16 are needed")]
    ShortSecret(usize),
    /// No randomness for a nonce.
    #[error("no randomness for a nonce: {0}")]
    NoRandomness(String),
    /// The `connect` names another identity than its socket claims.
    #[error("connect names {named} but came from a socket claiming {sender}")]
    NotTheSender {
        /// The identity in the `connect`.
        named: PeerId,
        /// The identity the socket claims.
        sender: PeerId,
    },
    /// No `kvpeer_auth` field.
    #[error("connect without kvpeer_auth")]
    Missing,
    /// Not version 3 of 57 bytes.
    #[error("kvpeer_auth is not version 3 of 57 bytes (a kvpeer older than this node's?)")]
    BadFormat,
    /// The MAC does not verify.
    #[error(
        "kvpeer_auth does not match (another secret, altered fields, signed for another node, \
         or for another connection or an earlier instance of this one)"
    )]
    Mismatch,
    /// Signed too long ago (or in the future).
    #[error("kvpeer_auth is {0}s off our clock")]
    Stale(u64),
    /// The nonce was seen before.
    #[error("kvpeer_auth replayed (nonce seen before)")]
    Replayed,
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Auth {
    /// Authentication with `secret` (at least 16 bytes).
    pub(crate) fn new(secret: Vec<u8>) -> Result<Self, AuthError> {
        if secret.len() < 16 {
            return Err(AuthError::ShortSecret(secret.len()));
        }
        Ok(Auth {
            secret,
            seen: HashSet::new(),
            order: VecDeque::new(),
        })
    }

    fn mac(
        &self,
        destination: &PeerId,
        challenge: &[u8],
        c: &Connect,
        time: u64,
        nonce: &[u8; 16],
    ) -> Hmac<Sha256> {
        // A key of any length is accepted by HMAC; this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        let mut field = |bytes: &[u8]| {
            mac.update(&(bytes.len() as u64).to_be_bytes());
            mac.update(bytes);
        };
        field(b"kvpeer-auth-v3");
        field(destination.as_str().as_bytes());
        field(challenge);
        field(c.peer_id.as_str().as_bytes());
        field(&c.agent_metadata);
        field(&c.base_addr.to_be_bytes());
        field(&c.num_blocks.to_be_bytes());
        field(&c.block_len.to_be_bytes());
        field(c.fingerprint().as_bytes());
        field(c.hash_seed.as_bytes());
        field(&time.to_be_bytes());
        field(nonce);
        mac
    }

    /// The `kvpeer_auth` value for `c` sent to `destination` on the connection it gave
    /// `challenge` (empty: it gave none, and a kvpeer destination will refuse it), now.
    pub(crate) fn sign(
        &self,
        destination: &PeerId,
        challenge: &[u8],
        c: &Connect,
    ) -> Result<Vec<u8>, AuthError> {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| AuthError::NoRandomness(e.to_string()))?;
        Ok(self.sign_at(destination, challenge, c, unix_now(), nonce))
    }

    fn sign_at(
        &self,
        destination: &PeerId,
        challenge: &[u8],
        c: &Connect,
        time: u64,
        nonce: [u8; 16],
    ) -> Vec<u8> {
        let tag = self
            .mac(destination, challenge, c, time, &nonce)
            .finalize()
            .into_bytes();
        let mut out = Vec::with_capacity(LEN);
        out.push(VERSION);
        out.extend_from_slice(&time.to_be_bytes());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&tag);
        out
    }

    /// Checks the `kvpeer_auth` of `c`, received by this node (`us`) on a connection it gave
    /// `challenge`, whose socket claims identity `sender`; remembers its nonce if it is valid.
    pub(crate) fn verify(
        &mut self,
        us: &PeerId,
        challenge: &[u8],
        sender: &PeerId,
        c: &Connect,
    ) -> Result<(), AuthError> {
        self.verify_at(us, challenge, sender, c, unix_now())
    }

    fn verify_at(
        &mut self,
        us: &PeerId,
        challenge: &[u8],
        sender: &PeerId,
        c: &Connect,
        now: u64,
    ) -> Result<(), AuthError> {
        if c.peer_id != *sender {
            return Err(AuthError::NotTheSender {
                named: c.peer_id.clone(),
                sender: sender.clone(),
            });
        }
        let token = c.kvpeer_auth.as_deref().ok_or(AuthError::Missing)?;
        if token.len() != LEN || token[0] != VERSION {
            return Err(AuthError::BadFormat);
        }
        let mut time = [0u8; 8];
        time.copy_from_slice(&token[1..9]);
        let time = u64::from_be_bytes(time);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&token[9..25]);
        self.mac(us, challenge, c, time, &nonce)
            .verify_slice(&token[25..])
            .map_err(|_| AuthError::Mismatch)?;
        if time.abs_diff(now) > WINDOW.as_secs() {
            return Err(AuthError::Stale(time.abs_diff(now)));
        }
        while self
            .order
            .front()
            .is_some_and(|(t, _)| now.saturating_sub(*t) > 2 * WINDOW.as_secs())
        {
            if let Some((_, old)) = self.order.pop_front() {
                self.seen.remove(&old);
            }
        }
        if !self.seen.insert(nonce) {
            return Err(AuthError::Replayed);
        }
        self.order.push_back((now, nonce));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn connect() -> Connect {
        Connect {
            peer_id: PeerId::new("127.0.0.1:5600"),
            agent_metadata: vec![1, 2, 3],
            base_addr: 7,
            num_blocks: 16,
            block_len: 4096,
            config_fingerprint: None,
            hash_seed: "0".into(),
            kvpeer_auth: None,
        }
    }

    fn auth(secret: &str) -> Auth {
        Auth::new(secret.as_bytes().to_vec()).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The challenge of the connection the tests' `connect`s come on.
    const CH: &[u8] = &[0x42; 16];

    fn us() -> PeerId {
        PeerId::new("127.0.0.1:7000")
    }

    fn sender() -> PeerId {
        PeerId::new("127.0.0.1:5600")
    }

    #[test]
    fn a_signed_connect_verifies_once_and_only_with_the_same_secret_and_fields() {
        let a = auth("a shared secret, 32 bytes long..");
        let mut b = auth("a shared secret, 32 bytes long..");
        let mut c = connect();
        c.kvpeer_auth = Some(a.sign_at(&us(), CH, &c, 1_000_000, [9; 16]));
        assert_eq!(b.verify_at(&us(), CH, &sender(), &c, 1_000_010), Ok(()));
        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &c, 1_000_011),
            Err(AuthError::Replayed)
        );

        let mut other = auth("another secret, also long enough");
        let mut fresh = connect();
        fresh.kvpeer_auth = Some(a.sign_at(&us(), CH, &fresh, 1_000_000, [8; 16]));
        assert_eq!(
            other.verify_at(&us(), CH, &sender(), &fresh, 1_000_000),
            Err(AuthError::Mismatch)
        );

        let mut altered = fresh.clone();
        altered.peer_id = PeerId::new("10.0.0.9:5600");
        assert_eq!(
            b.verify_at(&us(), CH, &altered.peer_id.clone(), &altered, 1_000_000),
            Err(AuthError::Mismatch)
        );
        let mut altered = fresh.clone();
        altered.block_len = 8192;
        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &altered, 1_000_000),
            Err(AuthError::Mismatch)
        );

        let mut old = connect();
        old.kvpeer_auth = Some(a.sign_at(&us(), CH, &old, 1_000_000, [7; 16]));
        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &old, 1_000_000 + 301),
            Err(AuthError::Stale(301))
        );

        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &connect(), 1_000_000),
            Err(AuthError::Missing)
        );
        let mut short = connect();
        short.kvpeer_auth = Some(vec![1; 10]);
        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &short, 1_000_000),
            Err(AuthError::BadFormat)
        );
        assert_eq!(
            Auth::new(b"short".to_vec()).map(|_| ()),
            Err(AuthError::ShortSecret(5))
        );
    }

    #[test]
    fn a_connect_is_bound_to_its_destination_and_its_senders_identity() {
        let a = auth("a shared secret, 32 bytes long..");
        let mut b = auth("a shared secret, 32 bytes long..");
        let mut c = connect();
        c.kvpeer_auth = Some(a.sign_at(&us(), CH, &c, 1_000_000, [3; 16]));
        // Replayed to another node that shares the secret: refused there.
        let other_node = PeerId::new("127.0.0.1:7001");
        assert_eq!(
            b.verify_at(&other_node, CH, &sender(), &c, 1_000_000),
            Err(AuthError::Mismatch),
            "signed for another node"
        );
        // Sent from a socket claiming another identity: refused.
        assert!(matches!(
            b.verify_at(&us(), CH, &PeerId::new("127.0.0.1:6666"), &c, 1_000_000),
            Err(AuthError::NotTheSender { .. })
        ));
        // The intended destination, from the signed identity: accepted.
        assert_eq!(b.verify_at(&us(), CH, &sender(), &c, 1_000_000), Ok(()));
    }

    #[test]
    fn a_connect_is_bound_to_the_connection_its_destination_challenged() {
        let a = auth("a shared secret, 32 bytes long..");
        let mut b = auth("a shared secret, 32 bytes long..");
        let mut c = connect();
        // Collected by whoever held the address earlier (its own challenge), or signed on
        // another connection: the real node's connection has another challenge.
        c.kvpeer_auth = Some(a.sign_at(&us(), &[0x17; 16], &c, 1_000_000, [4; 16]));
        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &c, 1_000_000),
            Err(AuthError::Mismatch)
        );
        // Signed with no challenge (the destination gave none): refused by a challenger.
        c.kvpeer_auth = Some(a.sign_at(&us(), &[], &c, 1_000_000, [5; 16]));
        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &c, 1_000_000),
            Err(AuthError::Mismatch)
        );
        c.kvpeer_auth = Some(a.sign_at(&us(), CH, &c, 1_000_000, [6; 16]));
        assert_eq!(b.verify_at(&us(), CH, &sender(), &c, 1_000_000), Ok(()));
        // A version-2 token (before challenges) is refused by its version.
        let mut v2 = c.kvpeer_auth.clone().unwrap_or_default();
        v2[0] = 2;
        c.kvpeer_auth = Some(v2);
        assert_eq!(
            b.verify_at(&us(), CH, &sender(), &c, 1_000_000),
            Err(AuthError::BadFormat)
        );
    }

    #[test]
    fn nonces_are_forgotten_after_the_window_and_sign_uses_fresh_ones() {
        let a = auth("a shared secret, 32 bytes long..");
        let mut b = auth("a shared secret, 32 bytes long..");
        for i in 0..100u64 {
            let mut c = connect();
            c.kvpeer_auth =
                Some(a.sign_at(&us(), CH, &c, 1_000 + i * 100, (i as u128).to_be_bytes()));
            assert_eq!(
                b.verify_at(&us(), CH, &sender(), &c, 1_000 + i * 100),
                Ok(())
            );
        }
        assert!(b.seen.len() < 20, "old nonces forgotten: {}", b.seen.len());
        let c = connect();
        let (x, y) = (a.sign(&us(), CH, &c), a.sign(&us(), CH, &c));
        assert!(x.is_ok() && y.is_ok());
        assert_ne!(x, y, "each signature has its own nonce");
    }
}
