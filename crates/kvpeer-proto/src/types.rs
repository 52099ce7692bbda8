//! Small newtypes for the values that carry meaning on the wire.
//!
//! They are plain data: cheap to clone and compare, usable as map keys, with no validation
//! beyond what the wire format itself implies (vLLM accepts any bytes as a key and any str as
//! an id, and so do these types; the session layer decides what it trusts).

use std::fmt;
use std::sync::Arc;

use smallvec::SmallVec;

/// Bytes of the group index that ends every vLLM offload key.
pub const GROUP_INDEX_LEN: usize = 4;

/// Inline capacity of [`OffloadKey`]: a sha256 block hash (32 bytes) plus the group index.
const KEY_INLINE: usize = 36;

/// A block key as vLLM sends it: `block_hash ‖ group_idx` (the group index as 4 bytes,
/// big-endian). With sha256 prefix hashing the key is 36 bytes.
///
/// Keys of up to 36 bytes are stored inline (no heap allocation), so decoding a `fetch` of 512
/// keys allocates one list, not 513 buffers. Longer keys spill to the heap.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct OffloadKey(SmallVec<[u8; KEY_INLINE]>);

impl OffloadKey {
    /// A key from its wire bytes.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        OffloadKey(SmallVec::from_slice(bytes))
    }

    /// A key from a block hash and a KV-cache group index.
    pub fn from_parts(block_hash: &[u8], group_idx: u32) -> Self {
        let mut key = SmallVec::with_capacity(block_hash.len() + GROUP_INDEX_LEN);
        key.extend_from_slice(block_hash);
        key.extend_from_slice(&group_idx.to_be_bytes());
        OffloadKey(key)
    }

    /// The wire bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }

    /// The block hash: every byte but the last four. `None` for a key shorter than 4 bytes,
    /// which vLLM never produces but a peer may send.
    pub fn block_hash(&self) -> Option<&[u8]> {
        let split = self.0.len().checked_sub(GROUP_INDEX_LEN)?;
        Some(&self.0[..split])
    }

    /// The KV-cache group index: the last four bytes, big-endian. `None` for a key shorter than
    /// 4 bytes.
    pub fn group_idx(&self) -> Option<u32> {
        let split = self.0.len().checked_sub(GROUP_INDEX_LEN)?;
        let mut idx = [0u8; GROUP_INDEX_LEN];
        idx.copy_from_slice(&self.0[split..]);
        Some(u32::from_be_bytes(idx))
    }
}

impl AsRef<[u8]> for OffloadKey {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl From<&[u8]> for OffloadKey {
    fn from(bytes: &[u8]) -> Self {
        OffloadKey::from_bytes(bytes)
    }
}

impl fmt::Debug for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "OffloadKey({self})")
    }
}

/// Lower-case hex, the way keys are shown in logs and in the JSON form.
impl fmt::Display for OffloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0.iter() {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// The id of one KV transfer request, allocated by the orchestrator and shared by the producer
/// and the consumer of the request (`kv_request_id` on the wire).
///
/// Shared, immutable text: the core keeps an id in several places (maps, timers, messages),
/// and a clone costs a reference count, not an allocation.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KvRequestId(Arc<str>);

impl Default for KvRequestId {
    fn default() -> Self {
        KvRequestId(Arc::from(""))
    }
}

impl KvRequestId {
    /// An id from its string.
    pub fn new(id: impl AsRef<str>) -> Self {
        KvRequestId(Arc::from(id.as_ref()))
    }

    /// The id as sent on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for KvRequestId {
    fn from(id: &str) -> Self {
        KvRequestId(Arc::from(id))
    }
}

impl From<String> for KvRequestId {
    fn from(id: String) -> Self {
        KvRequestId(Arc::from(id))
    }
}

/// Longest id `Display` and `Debug` show whole (logs, error messages); a longer one is shown
/// as its first [`SHOWN_ID_HEAD`] bytes and its length. vLLM bounds no id's length, and a
/// peer's megabyte ids must not become megabyte log lines. [`KvRequestId::as_str`] is the
/// whole id.
pub(crate) const SHOWN_ID_BYTES: usize = 128;
/// Bytes of a long id that `Display` and `Debug` show (at most: cut at a character boundary).
pub(crate) const SHOWN_ID_HEAD: usize = 64;

impl KvRequestId {
    /// The id's head and the bytes left out, if it is too long to show whole.
    fn shown(&self) -> (&str, Option<usize>) {
        if self.0.len() <= SHOWN_ID_BYTES {
            return (&self.0, None);
        }
        let mut cut = SHOWN_ID_HEAD;
        while !self.0.is_char_boundary(cut) {
            cut -= 1;
        }
        (&self.0[..cut], Some(self.0.len() - cut))
    }
}

impl fmt::Debug for KvRequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.shown() {
            (id, None) => write!(f, "KvRequestId({id:?})"),
            (head, Some(more)) => write!(f, "KvRequestId({head:?}…+{more} bytes)"),
        }
    }
}

/// The id, or for one over `SHOWN_ID_BYTES` its head and length: `abc…(+1000000 bytes)`.
impl fmt::Display for KvRequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.shown() {
            (id, None) => f.write_str(id),
            (head, Some(more)) => write!(f, "{head}…(+{more} bytes)"),
        }
    }
}

/// A lookup/fetch round of one request (`round_seq` on the wire). Rounds start at 0 and each
/// non-empty fetch closes one; completions, aborts and acks name their round.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct RoundSeq(pub u64);

impl RoundSeq {
    /// The round after this one.
    pub fn next(self) -> RoundSeq {
        RoundSeq(self.0.saturating_add(1))
    }
}

impl fmt::Display for RoundSeq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A peer's identity: `"host:port"`, the address its control socket is bound to and the ZeroMQ
/// identity of its outbound sockets. Peers dial each other back at this address.
///
/// The wire carries it as a plain str and vLLM does not check its form, so any str is kept
/// as-is; [`PeerId::parse`] and [`PeerId::host_port`] check the form where it matters.
///
/// Shared, immutable text like [`KvRequestId`]: cloning it is cheap.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(Arc<str>);

impl Default for PeerId {
    fn default() -> Self {
        PeerId(Arc::from(""))
    }
}

/// A str that is not of the form `host:port`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("peer id {id:?} is not host:port ({reason})")]
pub struct PeerIdError {
    /// The offending id.
    pub id: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl PeerId {
    /// A peer id exactly as received, unchecked.
    pub fn new(id: impl AsRef<str>) -> Self {
        PeerId(Arc::from(id.as_ref()))
    }

    /// A checked peer id: a non-empty host, a colon, and a port in 1..=65535.
    pub fn parse(id: &str) -> Result<Self, PeerIdError> {
        let peer = PeerId(Arc::from(id));
        peer.host_port()?;
        Ok(peer)
    }

    /// A peer id from its parts (IPv6 hosts are bracketed, as in `[::1]:5710`).
    pub fn from_host_port(host: &str, port: u16) -> Self {
        if host.contains(':') && !host.starts_with('[') {
            PeerId::new(format!("[{host}]:{port}"))
        } else {
            PeerId::new(format!("{host}:{port}"))
        }
    }

    /// Splits at the last colon, as vLLM does (`peer_id.rsplit(":", 1)`).
    pub fn host_port(&self) -> Result<(&str, u16), PeerIdError> {
        let fail = |reason| PeerIdError {
            id: self.0.to_string(),
            reason,
        };
        let (host, port) = self.0.rsplit_once(':').ok_or_else(|| fail("no colon"))?;
        if host.is_empty() {
            return Err(fail("empty host"));
        }
        let port: u16 = port.parse().map_err(|_| fail("port is not a number"))?;
        if port == 0 {
            return Err(fail("port 0"));
        }
        Ok((host, port))
    }

    /// The id as sent on the wire.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for PeerId {
    fn from(id: &str) -> Self {
        PeerId(Arc::from(id))
    }
}

impl fmt::Debug for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PeerId({:?})", self.0)
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer's megabyte id is shown as its head and length (logs stay short), cut at a
    /// character boundary; a short one whole; `as_str` is always the whole id.
    #[test]
    fn long_request_ids_are_shown_short() {
        let short = KvRequestId::new("r".repeat(SHOWN_ID_BYTES));
        assert_eq!(short.to_string(), short.as_str());
        assert_eq!(
            format!("{short:?}"),
            format!("KvRequestId({:?})", short.as_str())
        );
        let long = KvRequestId::new(format!("{}{}", "é".repeat(40), "x".repeat(1 << 20)));
        let shown = long.to_string();
        assert_eq!(
            shown,
            format!("{}…(+{} bytes)", "é".repeat(32), (1 << 20) + 16)
        );
        assert!(format!("{long:?}").len() < 2 * SHOWN_ID_BYTES);
        assert_eq!(long.as_str().len(), 80 + (1 << 20));
    }

    #[test]
    fn offload_key_splits_hash_and_group() {
        let hash = [7u8; 32];
        let key = OffloadKey::from_parts(&hash, 3);
        assert_eq!(key.as_bytes().len(), 36);
        assert_eq!(key.block_hash(), Some(&hash[..]));
        assert_eq!(key.group_idx(), Some(3));
        assert!(!key.0.spilled(), "a 36-byte key must be stored inline");
        let short = OffloadKey::from_bytes(&[1, 2, 3]);
        assert_eq!(short.block_hash(), None);
        assert_eq!(short.group_idx(), None);
        assert_eq!(OffloadKey::from_bytes(&[0, 0, 1, 0]).group_idx(), Some(256));
    }

    /// upstream: TestPeerIdFromParams.test_valid_params
    /// upstream: TestPeerIdFromParams.test_missing_host
    /// upstream: TestPeerIdFromParams.test_missing_port
    /// upstream: TestPeerIdFromParams.test_empty_dict
    #[test]
    fn peer_id_splits_at_last_colon() {
        let p = PeerId::parse("10.0.0.1:5710").unwrap();
        assert_eq!(p.host_port().unwrap(), ("10.0.0.1", 5710));
        let v6 = PeerId::from_host_port("::1", 5710);
        assert_eq!(v6.as_str(), "[::1]:5710");
        assert_eq!(v6.host_port().unwrap(), ("[::1]", 5710));
        for bad in ["", "host", ":5710", "h:0", "h:70000", "h:x"] {
            assert!(PeerId::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }
}
