//! The optional authenticated handshake: with a shared secret configured, every `connect` this
//! node sends carries `kvpeer_auth`, and a `connect` without a valid one is refused before the
//! protocol sees it (no session, no dial-back).
//!
//! `kvpeer_auth` = version `2` (1 byte) | unix time in seconds (u64 BE) | nonce (16 random
//! bytes) | HMAC-SHA256(secret, "kvpeer-auth-v2" | the destination's identity | every `connect`
//! field, each length-prefixed | time | nonce) (32 bytes): 57 bytes. Valid means: the MAC
//! matches for *this* node as the destination (compared in constant time), the `connect`'s
//! `peer_id` is the identity of the socket it came on, the time is within [`WINDOW`] of ours,
//! and the nonce was not seen within the window. So a captured `connect` cannot be altered,
//! replayed to this node, replayed to another node that shares the secret (the destination is
//! signed), or sent from another identity. It does not hide the `connect` from an eavesdropper
//! (docs/security.md). Off by default, so stock vLLM peers (which never send the field) keep
//! working; between kvpeer nodes it is all or nothing.
//!
//! Used by the node's I/O loop on its own thread.

use std::collections::{HashSet, VecDeque};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hmac::{Hmac, Mac};
use kvpeer_proto::{Connect, PeerId};
use sha2::Sha256;

/// How far a peer's clock may be from ours, and how long nonces are remembered.
pub const WINDOW: Duration = Duration::from_secs(300);
const VERSION: u8 = 2;
const LEN: usize = 1 + 8 + 16 + 32;

/// The secret and the nonces seen within the window.
pub struct Auth {
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

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Auth {
    /// Authentication with `secret` (at least 16 bytes).
    pub fn new(secret: Vec<u8>) -> Result<Self, String> {
        if secret.len() < 16 {
            return Err(format!(
                "the auth secret has {} bytes; at least 16 are needed",
                secret.len()
            ));
        }
        Ok(Auth {
            secret,
            seen: HashSet::new(),
            order: VecDeque::new(),
        })
    }

    fn mac(&self, destination: &PeerId, c: &Connect, time: u64, nonce: &[u8; 16]) -> Hmac<Sha256> {
        // A key of any length is accepted by HMAC; this cannot fail.
        let mut mac = <Hmac<Sha256> as Mac>::new_from_slice(&self.secret)
            .unwrap_or_else(|_| unreachable!("HMAC takes keys of any length"));
        let mut field = |bytes: &[u8]| {
            mac.update(&(bytes.len() as u64).to_be_bytes());
            mac.update(bytes);
        };
        field(b"kvpeer-auth-v2");
        field(destination.as_str().as_bytes());
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

    /// The `kvpeer_auth` value for `c` sent to `destination`, now.
    pub fn sign(&self, destination: &PeerId, c: &Connect) -> Result<Vec<u8>, String> {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).map_err(|e| format!("no randomness for a nonce: {e}"))?;
        Ok(self.sign_at(destination, c, unix_now(), nonce))
    }

    fn sign_at(&self, destination: &PeerId, c: &Connect, time: u64, nonce: [u8; 16]) -> Vec<u8> {
        let tag = self
            .mac(destination, c, time, &nonce)
            .finalize()
            .into_bytes();
        let mut out = Vec::with_capacity(LEN);
        out.push(VERSION);
        out.extend_from_slice(&time.to_be_bytes());
        out.extend_from_slice(&nonce);
        out.extend_from_slice(&tag);
        out
    }

    /// Checks the `kvpeer_auth` of `c`, received by this node (`us`) on a socket claiming
    /// identity `sender`; remembers its nonce if it is valid.
    pub fn verify(&mut self, us: &PeerId, sender: &PeerId, c: &Connect) -> Result<(), String> {
        self.verify_at(us, sender, c, unix_now())
    }

    fn verify_at(
        &mut self,
        us: &PeerId,
        sender: &PeerId,
        c: &Connect,
        now: u64,
    ) -> Result<(), String> {
        if c.peer_id != *sender {
            return Err(format!(
                "connect names {} but came from a socket claiming {sender}",
                c.peer_id
            ));
        }
        let token = c
            .kvpeer_auth
            .as_deref()
            .ok_or("connect without kvpeer_auth")?;
        if token.len() != LEN || token[0] != VERSION {
            return Err("kvpeer_auth is not version 2 of 57 bytes".into());
        }
        let mut time = [0u8; 8];
        time.copy_from_slice(&token[1..9]);
        let time = u64::from_be_bytes(time);
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&token[9..25]);
        self.mac(us, c, time, &nonce)
            .verify_slice(&token[25..])
            .map_err(|_| {
                "kvpeer_auth does not match (another secret, altered fields, or signed for another node)"
            })?;
        if time.abs_diff(now) > WINDOW.as_secs() {
            return Err(format!(
                "kvpeer_auth is {}s off our clock",
                time.abs_diff(now)
            ));
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
            return Err("kvpeer_auth replayed (nonce seen before)".into());
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
        c.kvpeer_auth = Some(a.sign_at(&us(), &c, 1_000_000, [9; 16]));
        assert_eq!(b.verify_at(&us(), &sender(), &c, 1_000_010), Ok(()));
        assert!(b
            .verify_at(&us(), &sender(), &c, 1_000_011)
            .unwrap_err()
            .contains("replayed"));

        let mut other = auth("another secret, also long enough");
        let mut fresh = connect();
        fresh.kvpeer_auth = Some(a.sign_at(&us(), &fresh, 1_000_000, [8; 16]));
        assert!(other
            .verify_at(&us(), &sender(), &fresh, 1_000_000)
            .unwrap_err()
            .contains("does not match"));

        let mut altered = fresh.clone();
        altered.peer_id = PeerId::new("10.0.0.9:5600");
        assert!(b
            .verify_at(&us(), &altered.peer_id.clone(), &altered, 1_000_000)
            .unwrap_err()
            .contains("does not match"));
        let mut altered = fresh.clone();
        altered.block_len = 8192;
        assert!(b.verify_at(&us(), &sender(), &altered, 1_000_000).is_err());

        let mut old = connect();
        old.kvpeer_auth = Some(a.sign_at(&us(), &old, 1_000_000, [7; 16]));
        assert!(b
            .verify_at(&us(), &sender(), &old, 1_000_000 + 301)
            .unwrap_err()
            .contains("off our clock"));

        assert!(b
            .verify_at(&us(), &sender(), &connect(), 1_000_000)
            .unwrap_err()
            .contains("without"));
        let mut short = connect();
        short.kvpeer_auth = Some(vec![1; 10]);
        assert!(b.verify_at(&us(), &sender(), &short, 1_000_000).is_err());
        assert!(Auth::new(b"short".to_vec()).is_err());
    }

    #[test]
    fn a_connect_is_bound_to_its_destination_and_its_senders_identity() {
        let a = auth("a shared secret, 32 bytes long..");
        let mut b = auth("a shared secret, 32 bytes long..");
        let mut c = connect();
        c.kvpeer_auth = Some(a.sign_at(&us(), &c, 1_000_000, [3; 16]));
        // Replayed to another node that shares the secret: refused there.
        let other_node = PeerId::new("127.0.0.1:7001");
        let e = b
            .verify_at(&other_node, &sender(), &c, 1_000_000)
            .unwrap_err();
        assert!(e.contains("another node"), "{e}");
        // Sent from a socket claiming another identity: refused.
        let e = b
            .verify_at(&us(), &PeerId::new("127.0.0.1:6666"), &c, 1_000_000)
            .unwrap_err();
        assert!(e.contains("came from a socket claiming"), "{e}");
        // The intended destination, from the signed identity: accepted.
        assert_eq!(b.verify_at(&us(), &sender(), &c, 1_000_000), Ok(()));
    }

    #[test]
    fn nonces_are_forgotten_after_the_window_and_sign_uses_fresh_ones() {
        let a = auth("a shared secret, 32 bytes long..");
        let mut b = auth("a shared secret, 32 bytes long..");
        for i in 0..100u64 {
            let mut c = connect();
            c.kvpeer_auth = Some(a.sign_at(&us(), &c, 1_000 + i * 100, (i as u128).to_be_bytes()));
            assert_eq!(b.verify_at(&us(), &sender(), &c, 1_000 + i * 100), Ok(()));
        }
        assert!(b.seen.len() < 20, "old nonces forgotten: {}", b.seen.len());
        let c = connect();
        let (x, y) = (a.sign(&us(), &c), a.sign(&us(), &c));
        assert!(x.is_ok() && y.is_ok());
        assert_ne!(x, y, "each signature has its own nonce");
    }
}
