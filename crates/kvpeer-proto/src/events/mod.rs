//! vLLM's KV event stream: the batches an engine's `ZmqEventPublisher` sends (vLLM 0.33
//! `distributed/kv_events.py`), decoded under limits and encoded in the same form.
//!
//! ```text
//! message   topic · seq (u64 BE, 8 bytes) · payload          (three ZeroMQ frames)
//! payload   KVEventBatch  [ts, events, data_parallel_rank?]   (msgpack array)
//! event     {"type": "BlockStored", "block_hashes": [...], ...}    (tagged map, vLLM ≥ 0.10)
//!           ["BlockStored", block_hashes, parent_block_hash, ...]  (tagged array, older)
//! hash      bin (32 bytes: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) | uint (its low 64 bits)
//! ```
//!
//! The decoder walks the payload with the crate's bounded reader and keeps what a pool needs
//! (hashes, parent, token ids, group, medium, sizes, LoRA, ownership): extra keys and
//! lookahead tokens are only noticed, never stored, so a batch costs memory in proportion to
//! its hashes and tokens, bounded by [`EventLimits`]. A malformed event is that event's error ([`EventError`]); the batch's other
//! events still decode. A batch that is not a batch at all is one error for the whole payload.
//!
//! Pure: no sockets, no clock. Who calls it: the pool node's event follower (issue 15), on its
//! own thread; nothing here blocks.

mod decode;
mod encode;

pub use decode::decode_batch;
pub use encode::encode_batch;

use crate::MsgpackError;

/// A block hash as vLLM publishes it (`ExternalBlockHash`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum BlockHash {
    /// The full hash (32 bytes with vLLM's sha256 hashing), published when
    /// `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`.
    Bytes(Vec<u8>),
    /// The low 64 bits of the hash (its last 8 bytes, big-endian), vLLM's default.
    Int(u64),
}

/// A `BlockStored` event: blocks that are now held on `medium`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockStored {
    /// The blocks, in prompt order; for a CPU-tier chunk the **last** names the chunk.
    pub block_hashes: Vec<BlockHash>,
    /// The block before the first one, if any.
    pub parent_block_hash: Option<BlockHash>,
    /// The tokens of all the event's blocks, in order (`block_size` per block; empty in the CPU
    /// tier's placeholder events).
    pub token_ids: Vec<u32>,
    /// Tokens per block (0 in the CPU tier's placeholder events).
    pub block_size: u64,
    /// The LoRA adapter's id (deprecated by vLLM in favour of `lora_name`, still published).
    pub lora_id: Option<i64>,
    /// Whether the blocks' hashes depend on more than their tokens and parent: `extra_keys`
    /// (LoRA name, multimodal inputs, cache salt) or `lookahead_token_ids` set to something
    /// other than nil. Those values are not kept, so such blocks cannot be described again.
    pub has_extra_keys: bool,
    /// Whether `token_ids` or `lora_id` held what vLLM never sends (a token id that is not an
    /// int below 2³², more ids than [`EventLimits::max_tokens`], a LoRA id beyond `i64`):
    /// the ids are then not kept and the blocks cannot be described again; the event's
    /// hashes still count.
    pub bad_tokens: bool,
    /// `"GPU"`, `"CPU"`, `"STORAGE"`, or unset.
    pub medium: Option<String>,
    /// The KV cache group (set by the offloading connector's events).
    pub group_idx: Option<u32>,
    /// The group's cache kind (`kv_cache_spec_kind`, e.g. full attention), when the publisher
    /// says it: routers classify a group by it (llm-d skips stores of a group whose kind it
    /// never learned).
    pub kv_cache_spec_kind: Option<String>,
    /// The LoRA adapter, if any (blocks of different adapters never share a key).
    pub lora_name: Option<String>,
    /// `LOCAL` or `REMOTE` relative to the publisher, if said.
    pub locality: Option<String>,
    /// The secondary tier that produced it, if any.
    pub ownership: Option<String>,
}

/// A `BlockRemoved` event: blocks no longer held on `medium`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct BlockRemoved {
    /// The blocks (for a CPU-tier chunk, every hash of the chunk).
    pub block_hashes: Vec<BlockHash>,
    /// Where they were held.
    pub medium: Option<String>,
    /// The KV cache group.
    pub group_idx: Option<u32>,
    /// `LOCAL` or `REMOTE`, if said.
    pub locality: Option<String>,
    /// The secondary tier, if any.
    pub ownership: Option<String>,
}

/// One event of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// `BlockStored`.
    Stored(BlockStored),
    /// `BlockRemoved`.
    Removed(BlockRemoved),
    /// `AllBlocksCleared` (the GPU pool was reset).
    AllCleared,
    /// An event type this decoder does not know (its tag), skipped whole.
    Other(String),
}

/// One `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// The publisher's timestamp (seconds).
    pub ts: f64,
    /// Its events, in order; a malformed one is its error.
    pub events: Vec<Result<KvEvent, EventError>>,
    /// The engine's data-parallel rank, if it said.
    pub data_parallel_rank: Option<i64>,
}

/// Bounds on what one payload may make the decoder do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventLimits {
    /// Largest payload. Default 16 MiB (a step of vLLM's publishes far less).
    pub max_payload_bytes: usize,
    /// Most events in one batch. Default 65,536.
    pub max_events: usize,
    /// Most hashes in one event. Default 65,536.
    pub max_hashes: usize,
    /// Longest byte hash. Default 64 (vLLM's are 32).
    pub max_hash_bytes: usize,
    /// Most token ids kept from one event (more make it [`BlockStored::bad_tokens`]). Default
    /// 1,048,576 (a 1M-token prompt's blocks at once).
    pub max_tokens: usize,
    /// Longest string field kept (medium, lora name, ownership, tags). Default 256.
    pub max_str_bytes: usize,
    /// Deepest nesting in fields that are skipped. Default 16.
    pub max_depth: usize,
}

impl Default for EventLimits {
    fn default() -> Self {
        EventLimits {
            max_payload_bytes: 16 << 20,
            max_events: 1 << 16,
            max_hashes: 1 << 16,
            max_hash_bytes: 64,
            max_tokens: 1 << 20,
            max_str_bytes: 256,
            max_depth: 16,
        }
    }
}

/// Why a payload, or one event in it, is not what vLLM publishes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EventError {
    /// Not msgpack, or msgpack beyond the limits.
    #[error("malformed msgpack: {0}")]
    Msgpack(#[from] MsgpackError),
    /// Larger than [`EventLimits::max_payload_bytes`].
    #[error("payload of {size} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// Its size.
        size: usize,
        /// The limit.
        limit: usize,
    },
    /// The payload is not a `[ts, events, ...]` batch.
    #[error("not a KVEventBatch: {0}")]
    NotABatch(&'static str),
    /// A list longer than its limit.
    #[error("{what}: {len} entries, over the limit of {limit}")]
    TooMany {
        /// Which list.
        what: &'static str,
        /// Its length.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// An event whose shape or field is wrong.
    #[error("event {index}: {what}")]
    BadEvent {
        /// Its position in the batch.
        index: usize,
        /// What is wrong.
        what: String,
    },
}
