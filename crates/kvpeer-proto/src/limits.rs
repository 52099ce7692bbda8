//! Decoding limits: how much an untrusted peer can make the decoder work or allocate.
//!
//! The decoder checks every length header against the bytes that remain before it allocates, so
//! memory is always bounded by the payload size; these limits bound it further.

/// Limits applied while decoding one payload. `Default` gives the values kvpeer uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Largest payload accepted, in bytes. Default 16 MiB, the same bound the control channel
    /// sets on its sockets: three times a lookup of the most keys (131,072 of 36 bytes), and a
    /// bound on what one peer's message costs the node (docs/security.md, G10).
    pub max_payload_bytes: usize,
    /// Deepest container nesting accepted. Messages need 2 levels (map, then list); unknown
    /// fields may nest more. Default 64; values above [`DecodeLimits::MAX_DEPTH_CEILING`] are
    /// treated as the ceiling, which keeps every walk well inside the thread's stack.
    pub max_depth: usize,
    /// Most entries in one list field (`keys`, `block_indexes`, `hits`). Default 131,072: the
    /// blocks of a two-million-token prompt at vLLM's 16 tokens per block (vLLM sends one key
    /// per block). Checked at the list header, before the list is allocated.
    pub max_list_len: usize,
}

impl DecodeLimits {
    /// Default payload limit: 16 MiB.
    pub const DEFAULT_MAX_PAYLOAD_BYTES: usize = 16 * 1024 * 1024;
    /// Default nesting limit.
    pub const DEFAULT_MAX_DEPTH: usize = 64;
    /// Default list length limit.
    pub const DEFAULT_MAX_LIST_LEN: usize = 1 << 17;
    /// Hard ceiling on `max_depth`.
    pub const MAX_DEPTH_CEILING: usize = 512;

    /// Nesting every message needs: the top-level map and a list inside it.
    pub const MIN_DEPTH: usize = 2;

    /// Refuses a payload longer than `max_payload_bytes`, before anything of it is read.
    pub(crate) fn check_size(&self, payload: &[u8]) -> Result<(), crate::error::MsgpackError> {
        if payload.len() > self.max_payload_bytes {
            return Err(crate::error::MsgpackError {
                offset: 0,
                kind: crate::error::MsgpackErrorKind::TooLarge {
                    size: payload.len(),
                    limit: self.max_payload_bytes,
                },
            });
        }
        Ok(())
    }

    /// The nesting limit in force: `max_depth` kept between [`Self::MIN_DEPTH`] (below it no
    /// message could decode) and [`Self::MAX_DEPTH_CEILING`].
    pub fn effective_max_depth(&self) -> usize {
        self.max_depth
            .clamp(Self::MIN_DEPTH, Self::MAX_DEPTH_CEILING)
    }
}

impl Default for DecodeLimits {
    fn default() -> Self {
        DecodeLimits {
            max_payload_bytes: Self::DEFAULT_MAX_PAYLOAD_BYTES,
            max_depth: Self::DEFAULT_MAX_DEPTH,
            max_list_len: Self::DEFAULT_MAX_LIST_LEN,
        }
    }
}
