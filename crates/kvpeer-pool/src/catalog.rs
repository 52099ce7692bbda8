//! What the pool knows of a chunk beyond its key: its blocks' hashes, its parent, its tokens
//! and its block size, so that the pool's own events describe a chunk the way vLLM's
//! self-describing offloading events do, and a router that hashes tokens (vllm-router,
//! Dynamo's indexer) indexes a pool node as it indexes an engine.
//!
//! Two sources, both on the followed engines' streams (../shared/spec/vllm-integration.md §3):
//!
//! * **a self-describing CPU store** (`medium: "CPU"`, the chunk's block hashes, its parent,
//!   `block_size` tokens per block, all its tokens): the description itself, kept as said. It
//!   also says how many blocks a chunk of that KV cache group has.
//! * **a recurrent group's state checkpoint** (vLLM 0.34: `medium: "CPU"`,
//!   `kv_cache_spec_kind: "mamba"`, one hash, the chunk's last and its key, chained to the hash
//!   before it, no tokens): one state, valid at that hash only, kept as said. It says nothing
//!   of the group's blocks per chunk, and is never walked or counted as a bad store.
//! * **the GPU pool's stores** (any medium but CPU, tokens and parent per event): each block
//!   is kept (its parent and its tokens). A CPU placeholder store (one hash, no tokens) is
//!   then described by walking back from its hash through those blocks to the block before
//!   the chunk: the prefix's root (no parent), or the last block of another chunk this
//!   catalog has seen. The walk's length must be the group's blocks per chunk: the one a
//!   self-describing event said first, or else the shortest walk seen once [`CONFIRMATIONS`]
//!   walks of new chunks agree with it (every prompt's chunks give one each). A walk that
//!   passed a chunk whose announcement was missed is longer: it describes nothing, and a
//!   walked description made before a shorter size was learned is withdrawn.
//!
//! What it cannot know it never makes up ([`Undescribed`]): int hashes (the low 64 bits do
//! not name a key), blocks whose hash depends on more than tokens and parent (`extra_keys`:
//! LoRA names, multimodal inputs, cache salts; lookahead tokens: their values are not kept;
//! a self-describing chunk with a block seen with extra keys in a GPU event, since vLLM's
//! self-describing events never carry them), token ids that are not vLLM's, blocks that were
//! never announced or were forgotten, walks that disagree with the group's chunk size or come
//! before it is confirmed. The caller then publishes vLLM's placeholder form and counts why.
//!
//! Bounded: at most `max_blocks` blocks and `max_chunks` chunks, each set within `max_bytes`
//! (tokens and hashes counted), the oldest learned forgotten first; a walk visits at most
//! `max_walk` blocks. Pure: the pool thread calls it, nothing here blocks or reads a clock.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use kvpeer_proto::events::{BlockHash, BlockStored};
use kvpeer_proto::OffloadKey;

use crate::keys::{CPU_MEDIUM, RECURRENT_KIND};

/// Most chunks [`Catalog::root`] walks through (a 1M-token prompt in 256-token chunks).
pub const MAX_ANCESTORS: usize = 4096;

/// The catalog's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CatalogLimits {
    /// GPU blocks kept (about 200 bytes each with 16-token blocks). Default 262,144.
    pub max_blocks: usize,
    /// Chunks kept, described or not (a described one holds its tokens and hashes). Default
    /// 131,072.
    pub max_chunks: usize,
    /// Longest walk from a chunk's last block back to the block before it. Default 256.
    pub max_walk: usize,
    /// Bytes the kept blocks take together, and the kept chunks together (each budget; token
    /// ids at 4 bytes, hashes at their length, plus a fixed cost per entry): an engine's block
    /// size and hash length are its own to choose. Default 64 MiB.
    pub max_bytes: usize,
}

/// Walks of new chunks that must agree on a group's blocks per chunk before a walk describes
/// a chunk (unless a self-describing event said the size).
pub const CONFIRMATIONS: u32 = 3;

/// What an entry costs beyond its tokens and hashes (map slot, order slot, allocations).
const ENTRY_BYTES: usize = 96;

impl Default for CatalogLimits {
    fn default() -> Self {
        CatalogLimits {
            max_blocks: 1 << 18,
            max_chunks: 1 << 17,
            max_walk: 256,
            max_bytes: 64 << 20,
        }
    }
}

/// A chunk as the pool describes it in its `BlockStored`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkDescription {
    /// Its blocks' hashes in prompt order; the last names the chunk.
    pub block_hashes: Vec<Box<[u8]>>,
    /// The block before its first, `None` at a prefix's root.
    pub parent: Option<Box<[u8]>>,
    /// Its tokens, `block_size` per block.
    pub token_ids: Vec<u32>,
    /// Tokens per block (the engine's block size).
    pub block_size: u64,
    /// The LoRA adapter's id, as the engine said it.
    pub lora_id: Option<i64>,
    /// The LoRA adapter's name, as the engine said it.
    pub lora_name: Option<String>,
}

/// Why a chunk has no description.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Undescribed {
    /// No block of it was announced with tokens, or it was forgotten (the bounds, an engine
    /// that publishes no GPU events, a join after the blocks were announced).
    Unknown,
    /// Its walk back did not reach the block before it within `max_walk` blocks.
    TooLong,
    /// Its walk disagrees with the group's blocks per chunk, or its blocks with each other
    /// (block size, LoRA).
    Inconsistent,
    /// The group's blocks per chunk is not confirmed yet ([`CONFIRMATIONS`]).
    Unconfirmed,
}

/// What the catalog saw (counters since start, and gauges).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CatalogStats {
    /// Blocks kept (gauge).
    pub blocks: u64,
    /// Chunks kept (gauge).
    pub chunks: u64,
    /// Chunks described by a self-describing event.
    pub said: u64,
    /// Recurrent groups' state checkpoints described as said (one hash, no tokens).
    pub states: u64,
    /// Chunks described by a walk through the GPU blocks.
    pub walked: u64,
    /// Blocks announced with extra keys or lookahead tokens (not describable again).
    pub extra_keys: u64,
    /// Stores with int hashes (nothing can be learned from them).
    pub int_hashes: u64,
    /// Stores whose tokens do not match their blocks (`block_size` × hashes).
    pub bad_tokens: u64,
    /// Times a group's blocks per chunk was learned smaller than before (walked descriptions
    /// of another length are then withdrawn).
    pub chunk_size_lowered: u64,
    /// Self-describing chunks refused because a GPU event announced one of their blocks with
    /// extra keys.
    pub tainted_chunks: u64,
}

#[derive(Debug)]
struct Block {
    parent: Option<Box<[u8]>>,
    tokens: Box<[u32]>,
    lora_id: Option<i64>,
    lora_name: Option<Arc<str>>,
    generation: u64,
}

#[derive(Debug)]
struct Chunk {
    description: Option<Arc<ChunkDescription>>,
    /// The description was made by a walk (withdrawn if the group's size is lowered).
    walked: bool,
    /// The root chunk of its prefix, once [`Catalog::root`] found it.
    root: Option<OffloadKey>,
    generation: u64,
}

impl Chunk {
    fn bytes(&self) -> usize {
        ENTRY_BYTES
            + self.root.as_ref().map_or(0, |r| r.as_bytes().len())
            + self
                .description
                .as_ref()
                .map_or(0, |d| description_bytes(d))
    }
}

fn description_bytes(d: &ChunkDescription) -> usize {
    d.token_ids.len() * 4
        + d.block_hashes.iter().map(|h| h.len() + 16).sum::<usize>()
        + d.parent.as_ref().map_or(0, |p| p.len())
        + d.lora_name.as_ref().map_or(0, String::len)
}

impl Block {
    fn bytes(&self) -> usize {
        // The LoRA name is shared by an event's blocks; each is charged for it.
        ENTRY_BYTES
            + self.tokens.len() * 4
            + self.parent.as_ref().map_or(0, |p| p.len())
            + self.lora_name.as_ref().map_or(0, |n| n.len())
    }
}

/// A group's blocks per chunk, and whether an engine said it (a self-describing event) or it
/// was learned from walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChunkSize {
    blocks: usize,
    said: bool,
    /// Walks of new chunks of this length seen (walked sizes only).
    confirmations: u32,
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The catalog.
#[derive(Debug)]
pub struct Catalog {
    limits: CatalogLimits,
    /// Blocks by (hash, group), as an offload key names them.
    blocks: FastMap<OffloadKey, Block>,
    block_order: VecDeque<(u64, OffloadKey)>,
    /// Every CPU chunk seen (a boundary for walks), with its description once known.
    chunks: FastMap<OffloadKey, Chunk>,
    chunk_order: VecDeque<(u64, OffloadKey)>,
    next_generation: u64,
    chunk_sizes: BTreeMap<u32, ChunkSize>,
    /// Bytes held by `blocks`, and by `chunks` (see [`CatalogLimits::max_bytes`]).
    block_bytes: usize,
    chunk_bytes: usize,
    /// Blocks a GPU event announced with extra keys (bounded like `blocks`, oldest first).
    tainted: FastMap<OffloadKey, ()>,
    tainted_order: VecDeque<OffloadKey>,
    stats: CatalogStats,
}

impl Catalog {
    /// An empty catalog within `limits`.
    pub fn new(limits: CatalogLimits) -> Self {
        Catalog {
            limits: CatalogLimits {
                max_blocks: limits.max_blocks.max(1),
                max_chunks: limits.max_chunks.max(1),
                max_walk: limits.max_walk.max(1),
                max_bytes: limits.max_bytes.max(1),
            },
            block_bytes: 0,
            chunk_bytes: 0,
            tainted: FastMap::default(),
            tainted_order: VecDeque::new(),
            blocks: FastMap::default(),
            block_order: VecDeque::new(),
            chunks: FastMap::default(),
            chunk_order: VecDeque::new(),
            next_generation: 0,
            chunk_sizes: BTreeMap::new(),
            stats: CatalogStats::default(),
        }
    }

    /// Learns what a followed engine's `BlockStored` says.
    pub fn learn(&mut self, event: &BlockStored) {
        let group = event.group_idx.unwrap_or(0);
        let Some(hashes) = byte_hashes(&event.block_hashes) else {
            self.stats.int_hashes += 1;
            return;
        };
        let Some(last) = hashes.last().copied() else {
            return;
        };
        let parent = match &event.parent_block_hash {
            None => None,
            Some(BlockHash::Bytes(p)) => Some(p.as_slice()),
            Some(BlockHash::Int(_)) => {
                self.stats.int_hashes += 1;
                return;
            }
        };
        let cpu = event.medium.as_deref() == Some(CPU_MEDIUM);
        if cpu && event.kv_cache_spec_kind.as_deref() == Some(RECURRENT_KIND) {
            self.learn_state(event, &hashes, parent, group);
            return;
        }
        let with_tokens = !event.token_ids.is_empty() || event.block_size != 0;
        let tokens_fit = usize::try_from(event.block_size)
            .ok()
            .filter(|&size| size > 0)
            .and_then(|size| size.checked_mul(hashes.len()))
            == Some(event.token_ids.len());
        if with_tokens && !tokens_fit {
            self.stats.bad_tokens += 1;
        }
        let clean = !event.has_extra_keys && !event.bad_tokens;
        let describable = with_tokens && tokens_fit && clean;
        if with_tokens && tokens_fit && event.has_extra_keys {
            self.stats.extra_keys += hashes.len() as u64;
            if !cpu {
                for h in &hashes {
                    self.taint(OffloadKey::from_parts(h, group));
                }
            }
        }
        let tainted = cpu
            && !self.tainted.is_empty()
            && hashes
                .iter()
                .any(|h| self.tainted.contains_key(&OffloadKey::from_parts(h, group)));
        // A CPU event's blocks are its chunk's own (described whole below); GPU blocks are
        // what placeholders are walked through.
        if describable && !cpu {
            self.learn_blocks(event, &hashes, parent, group);
        }
        if !cpu {
            return;
        }
        let key = OffloadKey::from_parts(last, group);
        if describable && tainted {
            self.stats.tainted_chunks += 1;
        }
        if describable && !tainted {
            // The first size said stands (vLLM's partial recurrent tails say fewer blocks).
            self.chunk_sizes.entry(group).or_insert(ChunkSize {
                blocks: hashes.len(),
                said: true,
                confirmations: 0,
            });
            if let Some(size) = self.chunk_sizes.get_mut(&group) {
                if !size.said {
                    *size = ChunkSize {
                        blocks: hashes.len(),
                        said: true,
                        confirmations: 0,
                    };
                    self.withdraw_walked(group, hashes.len());
                }
            }
            let description = ChunkDescription {
                block_hashes: hashes.iter().map(|h| Box::from(*h)).collect(),
                parent: parent.map(Box::from),
                token_ids: event.token_ids.clone(),
                block_size: event.block_size,
                lora_id: event.lora_id,
                lora_name: event.lora_name.clone(),
            };
            self.stats.said += 1;
            self.put_chunk(key, Some(Arc::new(description)), false);
        } else if !self.chunks.contains_key(&key) {
            // Seen first: a boundary for later walks, and one more walk of the group's size.
            self.put_chunk(key.clone(), None, false);
            if let Some((hash, _)) = split(&key) {
                let hash = hash.to_vec();
                if let Ok(d) = self.walk(&hash, group) {
                    let count = d.block_hashes.len();
                    if self.observe_walk(group, count) {
                        self.stats.walked += 1;
                        self.put_chunk(key, Some(Arc::new(d)), true);
                    }
                }
            }
        }
    }

    /// A recurrent group's state checkpoint (vLLM 0.34's `_as_state_checkpoint`): described as
    /// said when it is one, a boundary otherwise (vLLM's placeholder of a key of that group,
    /// extra keys); it never teaches the group's chunk size nor starts a walk (a state has no
    /// blocks to walk through).
    fn learn_state(
        &mut self,
        event: &BlockStored,
        hashes: &[&[u8]],
        parent: Option<&[u8]>,
        group: u32,
    ) {
        let Some(&last) = hashes.last() else {
            return;
        };
        let key = OffloadKey::from_parts(last, group);
        // vLLM's placeholder for a key it has no metadata of carries the group's kind too,
        // with `block_size` 0; a checkpoint keeps the group's block size.
        let checkpoint = hashes.len() == 1
            && event.block_size != 0
            && event.token_ids.is_empty()
            && !event.has_extra_keys
            && !event.bad_tokens;
        if !checkpoint {
            if !self.chunks.contains_key(&key) {
                self.put_chunk(key, None, false);
            }
            return;
        }
        let description = ChunkDescription {
            block_hashes: vec![Box::from(last)],
            parent: parent.map(Box::from),
            token_ids: Vec::new(),
            block_size: event.block_size,
            lora_id: event.lora_id,
            lora_name: event.lora_name.clone(),
        };
        self.stats.states += 1;
        self.put_chunk(key, Some(Arc::new(description)), false);
    }

    /// The description of chunk `key` (made now from the blocks, if it was not before).
    pub fn describe(&mut self, key: &OffloadKey) -> Result<Arc<ChunkDescription>, Undescribed> {
        if let Some(Chunk {
            description: Some(d),
            ..
        }) = self.chunks.get(key)
        {
            return Ok(d.clone());
        }
        let (hash, group) = split(key).ok_or(Undescribed::Unknown)?;
        let hash = hash.to_vec();
        let d = self.walk(&hash, group)?;
        match self.chunk_sizes.get(&group) {
            Some(size) if size.blocks == d.block_hashes.len() => {
                if !size.said && size.confirmations < CONFIRMATIONS {
                    return Err(Undescribed::Unconfirmed);
                }
            }
            Some(_) => return Err(Undescribed::Inconsistent),
            None => return Err(Undescribed::Unconfirmed),
        }
        let description = Arc::new(d);
        self.stats.walked += 1;
        self.put_chunk(key.clone(), Some(description.clone()), true);
        Ok(description)
    }

    /// A walk of a chunk seen for the first time, `count` blocks long: whether it describes
    /// the chunk (the group's size said, or confirmed by this walk and earlier ones).
    fn observe_walk(&mut self, group: u32, count: usize) -> bool {
        let size = self.chunk_sizes.entry(group).or_insert(ChunkSize {
            blocks: count,
            said: false,
            confirmations: 0,
        });
        if size.blocks == count {
            if !size.said {
                size.confirmations = size.confirmations.saturating_add(1);
            }
            return size.said || size.confirmations >= CONFIRMATIONS;
        }
        if size.said || count > size.blocks {
            return false;
        }
        // Shorter than what was learned: the longer walks passed a missed chunk.
        *size = ChunkSize {
            blocks: count,
            said: false,
            confirmations: 1,
        };
        self.stats.chunk_size_lowered += 1;
        self.withdraw_walked(group, count);
        false
    }

    /// Walked descriptions of `group` that are not `count` blocks long are withdrawn.
    fn withdraw_walked(&mut self, group: u32, count: usize) {
        let stale: Vec<OffloadKey> = self
            .chunks
            .iter()
            .filter(|(k, c)| {
                c.walked
                    && split(k).is_some_and(|(_, g)| g == group)
                    && c.description
                        .as_ref()
                        .is_some_and(|d| d.block_hashes.len() != count)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in stale {
            if let Some(c) = self.chunks.get_mut(&k) {
                self.chunk_bytes -= c.bytes();
                c.description = None;
                c.walked = false;
                self.chunk_bytes += c.bytes();
            }
        }
    }

    fn taint(&mut self, key: OffloadKey) {
        if self.tainted.contains_key(&key) {
            return;
        }
        while self.tainted.len() >= self.limits.max_blocks {
            match self.tainted_order.pop_front() {
                Some(old) => {
                    self.tainted.remove(&old);
                }
                None => break,
            }
        }
        self.tainted_order.push_back(key.clone());
        self.tainted.insert(key, ());
    }

    /// The root chunk of the prefix chunk `key` ends: each chunk's parent is the last block of
    /// the chunk before it, so the walk goes chunk by chunk to one with no parent. Every chunk
    /// on the way must be describable; at most [`MAX_ANCESTORS`] of them.
    ///
    /// Each chunk on the way remembers the root found (a prefix's root does not change), so
    /// the chunks of one prompt, asked in order, cost one step each rather than one per
    /// ancestor.
    pub fn root(&mut self, key: &OffloadKey) -> Result<OffloadKey, Undescribed> {
        let (_, group) = split(key).ok_or(Undescribed::Unknown)?;
        let mut visited = Vec::new();
        let mut current = key.clone();
        let root = loop {
            if let Some(root) = self.chunks.get(&current).and_then(|c| c.root.clone()) {
                break root;
            }
            if visited.len() >= MAX_ANCESTORS {
                return Err(Undescribed::TooLong);
            }
            let description = self.describe(&current)?;
            visited.push(current.clone());
            match &description.parent {
                None => break current,
                Some(parent) => current = OffloadKey::from_parts(parent, group),
            }
        };
        for k in visited {
            if let Some(chunk) = self.chunks.get_mut(&k) {
                self.chunk_bytes -= chunk.bytes();
                chunk.root = Some(root.clone());
                self.chunk_bytes += chunk.bytes();
            }
        }
        Ok(root)
    }

    /// What the catalog saw.
    pub fn stats(&self) -> CatalogStats {
        CatalogStats {
            blocks: self.blocks.len() as u64,
            chunks: self.chunks.len() as u64,
            ..self.stats
        }
    }

    fn learn_blocks(
        &mut self,
        event: &BlockStored,
        hashes: &[&[u8]],
        parent: Option<&[u8]>,
        group: u32,
    ) {
        // The caller checked that block_size fits usize and × hashes = the tokens.
        let Ok(size) = usize::try_from(event.block_size) else {
            return;
        };
        if ENTRY_BYTES + size * 4 > self.limits.max_bytes {
            return;
        }
        let lora_name: Option<Arc<str>> = event.lora_name.as_deref().map(Arc::from);
        for (i, (hash, tokens)) in hashes
            .iter()
            .zip(event.token_ids.chunks_exact(size))
            .enumerate()
        {
            let key = OffloadKey::from_parts(hash, group);
            if let Some(old) = self.blocks.remove(&key) {
                self.block_bytes -= old.bytes();
            }
            let parent = match i.checked_sub(1) {
                None => parent,
                Some(before) => hashes.get(before).copied(),
            };
            let generation = self.next_generation;
            self.next_generation += 1;
            let block = Block {
                parent: parent.map(Box::from),
                tokens: Box::from(tokens),
                lora_id: event.lora_id,
                lora_name: lora_name.clone(),
                generation,
            };
            while !self.blocks.is_empty()
                && (self.blocks.len() >= self.limits.max_blocks
                    || self.block_bytes + block.bytes() > self.limits.max_bytes)
            {
                self.forget_oldest_block();
            }
            if block.bytes() > self.limits.max_bytes {
                continue;
            }
            self.block_order.push_back((generation, key.clone()));
            self.block_bytes += block.bytes();
            self.blocks.insert(key, block);
        }
        self.compact_block_order();
    }

    /// The chunk ending at block `hash`: back to the root, or to another chunk's last block.
    fn walk(&mut self, hash: &[u8], group: u32) -> Result<ChunkDescription, Undescribed> {
        let mut path: Vec<(Box<[u8]>, &Block)> = Vec::new();
        let mut current = OffloadKey::from_parts(hash, group);
        let mut current_hash: Box<[u8]> = Box::from(hash);
        loop {
            let block = self.blocks.get(&current).ok_or(Undescribed::Unknown)?;
            path.push((current_hash, block));
            let Some(parent) = &block.parent else {
                break;
            };
            let parent_key = OffloadKey::from_parts(parent, group);
            if self.chunks.contains_key(&parent_key) {
                break;
            }
            if path.len() >= self.limits.max_walk {
                return Err(Undescribed::TooLong);
            }
            current = parent_key;
            current_hash = parent.clone();
        }
        let first = path.last().map(|(_, b)| *b).ok_or(Undescribed::Unknown)?;
        let (size, lora_id, lora_name) =
            (first.tokens.len(), first.lora_id, first.lora_name.clone());
        if path.iter().any(|(_, b)| {
            b.tokens.len() != size || b.lora_id != lora_id || b.lora_name != lora_name
        }) {
            return Err(Undescribed::Inconsistent);
        }
        let parent = first.parent.clone();
        let count = path.len();
        let mut token_ids = Vec::with_capacity(count * size);
        let mut block_hashes = Vec::with_capacity(count);
        for (h, b) in path.into_iter().rev() {
            token_ids.extend_from_slice(&b.tokens);
            block_hashes.push(h);
        }
        Ok(ChunkDescription {
            block_hashes,
            parent,
            token_ids,
            block_size: size as u64,
            lora_id,
            lora_name: lora_name.map(|n| n.to_string()),
        })
    }

    fn put_chunk(
        &mut self,
        key: OffloadKey,
        description: Option<Arc<ChunkDescription>>,
        walked: bool,
    ) {
        let root = match self.chunks.remove(&key) {
            Some(old) => {
                self.chunk_bytes -= old.bytes();
                old.root
            }
            None => None,
        };
        let generation = self.next_generation;
        self.next_generation += 1;
        let chunk = Chunk {
            description,
            walked,
            root,
            generation,
        };
        if chunk.bytes() > self.limits.max_bytes {
            return;
        }
        while !self.chunks.is_empty()
            && (self.chunks.len() >= self.limits.max_chunks
                || self.chunk_bytes + chunk.bytes() > self.limits.max_bytes)
        {
            self.forget_oldest_chunk();
        }
        self.chunk_order.push_back((generation, key.clone()));
        self.chunk_bytes += chunk.bytes();
        self.chunks.insert(key, chunk);
        self.compact_chunk_order();
    }

    fn forget_oldest_block(&mut self) {
        while let Some((generation, key)) = self.block_order.pop_front() {
            if self
                .blocks
                .get(&key)
                .is_some_and(|b| b.generation == generation)
            {
                if let Some(b) = self.blocks.remove(&key) {
                    self.block_bytes -= b.bytes();
                }
                return;
            }
        }
    }

    fn forget_oldest_chunk(&mut self) {
        while let Some((generation, key)) = self.chunk_order.pop_front() {
            if self
                .chunks
                .get(&key)
                .is_some_and(|c| c.generation == generation)
            {
                if let Some(c) = self.chunks.remove(&key) {
                    self.chunk_bytes -= c.bytes();
                }
                return;
            }
        }
    }

    /// Drops stale order entries once they outnumber the live ones (re-learned keys leave
    /// one behind each time), so the order stays within twice the map.
    fn compact_block_order(&mut self) {
        if self.block_order.len() > 2 * self.blocks.len() + 64 {
            let blocks = &self.blocks;
            self.block_order
                .retain(|(g, k)| blocks.get(k).is_some_and(|b| b.generation == *g));
        }
    }

    fn compact_chunk_order(&mut self) {
        if self.chunk_order.len() > 2 * self.chunks.len() + 64 {
            let chunks = &self.chunks;
            self.chunk_order
                .retain(|(g, k)| chunks.get(k).is_some_and(|c| c.generation == *g));
        }
    }
}

/// The hashes as bytes, if none is an int.
fn byte_hashes(hashes: &[BlockHash]) -> Option<Vec<&[u8]>> {
    hashes
        .iter()
        .map(|h| match h {
            BlockHash::Bytes(b) => Some(b.as_slice()),
            BlockHash::Int(_) => None,
        })
        .collect()
}

/// A key's hash and group (the key's last 4 bytes), if it has both.
pub(crate) fn split(key: &OffloadKey) -> Option<(&[u8], u32)> {
    let bytes = key.as_bytes();
    let at = bytes
        .len()
        .checked_sub(kvpeer_proto::GROUP_INDEX_LEN)
        .filter(|&at| at > 0)?;
    let (hash, group) = bytes.split_at(at);
    let group: [u8; 4] = group.try_into().ok()?;
    Some((hash, u32::from_be_bytes(group)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(b: u8) -> BlockHash {
        BlockHash::Bytes(vec![b; 32])
    }

    /// A store of `blocks` (1 token each: the hash byte) after `parent` on `medium`.
    fn stored(blocks: &[u8], parent: Option<u8>, medium: &str) -> BlockStored {
        BlockStored {
            block_hashes: blocks.iter().map(|&b| h(b)).collect(),
            parent_block_hash: parent.map(h),
            token_ids: blocks.iter().map(|&b| u32::from(b)).collect(),
            block_size: 1,
            medium: Some(medium.into()),
            group_idx: Some(0),
            ..BlockStored::default()
        }
    }

    fn placeholder(b: u8) -> BlockStored {
        BlockStored {
            block_hashes: vec![h(b)],
            medium: Some("CPU".into()),
            group_idx: Some(0),
            ..BlockStored::default()
        }
    }

    fn key(b: u8) -> OffloadKey {
        OffloadKey::from_parts(&[b; 32], 0)
    }

    fn hashes(d: &ChunkDescription) -> Vec<u8> {
        d.block_hashes.iter().map(|h| h[0]).collect()
    }

    #[test]
    fn a_self_describing_store_is_kept_as_said() {
        let mut c = Catalog::new(CatalogLimits::default());
        c.learn(&stored(&[5, 6, 7], Some(4), "CPU"));
        let d = c.describe(&key(7)).unwrap();
        assert_eq!(hashes(&d), vec![5, 6, 7]);
        assert_eq!(d.parent.as_deref(), Some(&[4u8; 32][..]));
        assert_eq!(d.token_ids, vec![5, 6, 7]);
        assert_eq!(c.stats().said, 1);
        // A chunk of the same group walked through GPU blocks must then have 3 blocks too.
        c.learn(&stored(&[1, 2], None, "GPU"));
        c.learn(&placeholder(2));
        assert_eq!(c.describe(&key(2)), Err(Undescribed::Inconsistent));
    }

    /// vLLM 0.34's recurrent state checkpoint (`kv_cache_spec_kind: "mamba"`): one hash, the
    /// chunk's last, chained to the hash before it, no tokens, the group's block size. Kept as
    /// said (before: counted as a store whose tokens do not fit, and left undescribed), and it
    /// teaches its group no chunk size; vLLM's placeholder of such a group's key stays
    /// undescribed.
    #[test]
    fn a_recurrent_state_checkpoint_is_kept_as_said_and_teaches_no_chunk_size() {
        let mut c = Catalog::new(CatalogLimits::default());
        let state = |hash: u8, parent: Option<u8>, block_size: u64| BlockStored {
            block_hashes: vec![h(hash)],
            parent_block_hash: parent.map(h),
            block_size,
            medium: Some("CPU".into()),
            group_idx: Some(1),
            kv_cache_spec_kind: Some("mamba".into()),
            ..BlockStored::default()
        };
        c.learn(&state(9, Some(8), 16));
        let d = c.describe(&OffloadKey::from_parts(&[9; 32], 1)).unwrap();
        assert_eq!(hashes(&d), vec![9]);
        assert_eq!(d.parent.as_deref(), Some(&[8u8; 32][..]));
        assert!(d.token_ids.is_empty());
        assert_eq!(d.block_size, 16);
        let stats = c.stats();
        assert_eq!((stats.states, stats.said, stats.bad_tokens), (1, 0, 0));
        assert!(
            !c.chunk_sizes.contains_key(&1),
            "a state is no chunk of blocks"
        );
        // vLLM's placeholder of a key of that group (`block_size` 0): nothing describes it.
        c.learn(&state(20, None, 0));
        assert_eq!(
            c.describe(&OffloadKey::from_parts(&[20; 32], 1)),
            Err(Undescribed::Unknown)
        );
        assert_eq!(c.stats().states, 1);
    }

    #[test]
    fn placeholders_are_described_by_walking_back_to_the_previous_chunk() {
        let mut c = Catalog::new(CatalogLimits::default());
        c.learn(&stored(&[1, 2, 3, 4, 5, 6], None, "GPU"));
        for last in [2, 4, 6] {
            c.learn(&placeholder(last));
        }
        assert_eq!(hashes(&c.describe(&key(2)).unwrap()), vec![1, 2]);
        let d = c.describe(&key(6)).unwrap();
        assert_eq!(hashes(&d), vec![5, 6]);
        assert_eq!(d.parent.as_deref(), Some(&[4u8; 32][..]));
        assert_eq!(d.token_ids, vec![5, 6]);
        assert_eq!(d.block_size, 1);

        // A chunk whose previous chunk was never announced walks two chunks' worth: with the
        // group's size confirmed (2), that is no description, not a made-up one.
        c.learn(&stored(&[11, 12, 13, 14], Some(6), "GPU"));
        c.learn(&placeholder(14));
        assert_eq!(c.describe(&key(14)), Err(Undescribed::Inconsistent));
        // A block never announced, and a key too short to name one.
        assert_eq!(c.describe(&key(99)), Err(Undescribed::Unknown));
        assert_eq!(
            c.describe(&OffloadKey::from_bytes(&[1, 2])),
            Err(Undescribed::Unknown)
        );
    }

    /// The first walk seen passed a missed chunk (4 blocks, not 2): it describes nothing until
    /// the size is confirmed, and once a prompt's chunks of 2 lower and confirm it, the long
    /// one stays undescribed; a walked description made before is withdrawn.
    #[test]
    fn a_walk_describes_only_once_the_chunk_size_is_confirmed_and_a_shorter_one_wins() {
        let mut c = Catalog::new(CatalogLimits::default());
        c.learn(&stored(&[1, 2, 3, 4], None, "GPU"));
        c.learn(&placeholder(4));
        assert_eq!(c.describe(&key(4)), Err(Undescribed::Unconfirmed));
        // Three more 4-block walks confirm 4 (what a late join past lost chunks may see).
        for p in [10u8, 20, 30] {
            c.learn(&stored(&[p + 1, p + 2, p + 3, p + 4], None, "GPU"));
            c.learn(&placeholder(p + 4));
        }
        assert_eq!(hashes(&c.describe(&key(14)).unwrap()), vec![11, 12, 13, 14]);
        // A prompt in chunks of 2: the size is lowered, the 4-block descriptions withdrawn.
        c.learn(&stored(&[41, 42, 43, 44, 45, 46], None, "GPU"));
        for last in [42, 44, 46] {
            c.learn(&placeholder(last));
        }
        assert_eq!(c.stats().chunk_size_lowered, 1);
        assert_eq!(hashes(&c.describe(&key(44)).unwrap()), vec![43, 44]);
        assert_eq!(c.describe(&key(14)), Err(Undescribed::Inconsistent));
        assert_eq!(c.describe(&key(4)), Err(Undescribed::Inconsistent));
    }

    /// vLLM's self-describing events never carry extra keys: a chunk one of whose blocks a GPU
    /// event announced with extra keys is not taken as described; a partial tail (fewer
    /// blocks) does not change the size said first.
    #[test]
    fn self_describing_chunks_of_tainted_blocks_are_refused_and_the_first_size_stands() {
        let mut c = Catalog::new(CatalogLimits::default());
        let mut salted = stored(&[1, 2], None, "GPU");
        salted.has_extra_keys = true;
        c.learn(&salted);
        c.learn(&stored(&[1, 2], None, "CPU"));
        assert_eq!(c.describe(&key(2)), Err(Undescribed::Unknown));
        assert_eq!(c.stats().tainted_chunks, 1);
        c.learn(&stored(&[5, 6, 7], None, "CPU"));
        c.learn(&stored(&[8], Some(7), "CPU"));
        assert_eq!(hashes(&c.describe(&key(8)).unwrap()), vec![8]);
        c.learn(&stored(&[9, 10, 11], None, "GPU"));
        c.learn(&placeholder(11));
        assert_eq!(hashes(&c.describe(&key(11)).unwrap()), vec![9, 10, 11]);
    }

    #[test]
    fn what_cannot_be_described_again_is_not() {
        let mut c = Catalog::new(CatalogLimits::default());
        let mut lora = stored(&[1, 2], None, "GPU");
        lora.has_extra_keys = true;
        c.learn(&lora);
        c.learn(&placeholder(2));
        assert_eq!(c.describe(&key(2)), Err(Undescribed::Unknown));
        assert_eq!(c.stats().extra_keys, 2);

        let ints = BlockStored {
            block_hashes: vec![BlockHash::Int(3)],
            token_ids: vec![3],
            block_size: 1,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        };
        c.learn(&ints);
        assert_eq!(c.stats().int_hashes, 1);

        // Tokens that do not fit the blocks (3 tokens for 2 blocks of 1).
        let mut bad = stored(&[7, 8], None, "GPU");
        bad.token_ids.push(9);
        c.learn(&bad);
        c.learn(&placeholder(8));
        assert_eq!(c.describe(&key(8)), Err(Undescribed::Unknown));
        assert_eq!(c.stats().bad_tokens, 1);
    }

    #[test]
    fn a_chunks_root_is_found_through_its_parents() {
        let mut c = Catalog::new(CatalogLimits::default());
        c.learn(&stored(&[1, 2, 3, 4, 5, 6], None, "GPU"));
        for last in [2, 4, 6] {
            c.learn(&placeholder(last));
        }
        for last in [2, 4, 6] {
            assert_eq!(c.root(&key(last)), Ok(key(2)));
        }
        // A chunk whose ancestors are not all known has no root.
        c.learn(&stored(&[8, 9], Some(7), "GPU"));
        c.learn(&placeholder(9));
        assert_eq!(c.root(&key(9)), Err(Undescribed::Unknown));
    }

    #[test]
    fn a_walk_stops_at_its_limit() {
        let mut c = Catalog::new(CatalogLimits {
            max_walk: 3,
            ..CatalogLimits::default()
        });
        c.learn(&stored(&[1, 2, 3, 4, 5], None, "GPU"));
        c.learn(&placeholder(5));
        assert_eq!(c.describe(&key(5)), Err(Undescribed::TooLong));
    }

    #[test]
    fn blocks_and_chunks_stay_within_their_bounds() {
        let limits = CatalogLimits {
            max_blocks: 100,
            max_chunks: 10,
            max_walk: 1024,
            max_bytes: 4000,
        };
        let mut c = Catalog::new(limits);
        // Huge blocks: 300 tokens each (1,296 bytes with their entry); only 3 fit the budget.
        for i in 0..50u8 {
            c.learn(&BlockStored {
                block_hashes: vec![h(i)],
                token_ids: vec![1; 300],
                block_size: 300,
                medium: Some("GPU".into()),
                ..BlockStored::default()
            });
        }
        assert!(c.stats().blocks <= 3, "{:?}", c.stats());
        // Many small blocks and chunks: the counts hold.
        for i in 0..250u8 {
            c.learn(&stored(&[i], None, "GPU"));
            c.learn(&placeholder(i));
        }
        let s = c.stats();
        assert!(s.blocks <= 100 && s.chunks <= 10, "{s:?}");
        assert!(c.block_bytes <= 4000 && c.chunk_bytes <= 4000);
        // The newest are the ones kept.
        assert_eq!(hashes(&c.describe(&key(249)).unwrap()), vec![249]);
        // Many hashes of 64 bytes count as bytes, not as tokens.
        let wide = BlockStored {
            block_hashes: (0..60u8).map(|i| BlockHash::Bytes(vec![i; 64])).collect(),
            token_ids: vec![0; 60],
            block_size: 1,
            medium: Some("CPU".into()),
            ..BlockStored::default()
        };
        c.learn(&wide);
        assert!(c.chunk_bytes <= 4000, "{}", c.chunk_bytes);
        assert!(c.block_order.len() <= 2 * c.blocks.len() + 64);
        assert!(c.chunk_order.len() <= 2 * c.chunks.len() + 64);
    }
}
