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
//! * **the GPU pool's stores** (any medium but CPU, tokens and parent per event): each block
//!   is kept (its parent and its tokens). A CPU placeholder store (one hash, no tokens) is
//!   then described by walking back from its hash through those blocks to the block before
//!   the chunk: the prefix's root (no parent), or the last block of another chunk this
//!   catalog has seen. The walk's length is the group's blocks per chunk: the shortest seen
//!   (every prompt's first chunk ends at the root, so it is learned from the first prompt),
//!   or the one a self-describing event said; a walk of any other length describes nothing.
//!
//! What it cannot know it never makes up ([`Undescribed`]): int hashes (the low 64 bits do
//! not name a key), blocks whose hash depends on more than tokens and parent (`extra_keys`:
//! LoRA names, multimodal inputs, cache salts; lookahead tokens: their values are not kept),
//! blocks that were never announced or were forgotten, walks that disagree with the group's
//! chunk size. The caller then publishes vLLM's placeholder form and counts why.
//!
//! Bounded: at most `max_blocks` blocks and `max_chunks` chunks, the oldest learned forgotten
//! first; a walk visits at most `max_walk` blocks. Pure: the pool thread calls it, nothing
//! here blocks or reads a clock.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use kvpeer_proto::events::{BlockHash, BlockStored};
use kvpeer_proto::OffloadKey;

use crate::keys::CPU_MEDIUM;

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
    /// Longest walk from a chunk's last block back to the block before it. Default 1,024.
    pub max_walk: usize,
    /// Tokens the kept blocks hold together, and the kept descriptions together (each
    /// budget): an engine's block size is its own to choose. Default 16,777,216 (64 MiB).
    pub max_tokens: usize,
}

impl Default for CatalogLimits {
    fn default() -> Self {
        CatalogLimits {
            max_blocks: 1 << 18,
            max_chunks: 1 << 17,
            max_walk: 1024,
            max_tokens: 1 << 24,
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
    /// Chunks described by a walk through the GPU blocks.
    pub walked: u64,
    /// Blocks announced with extra keys or lookahead tokens (not describable again).
    pub extra_keys: u64,
    /// Stores with int hashes (nothing can be learned from them).
    pub int_hashes: u64,
    /// Stores whose tokens do not match their blocks (`block_size` × hashes).
    pub bad_tokens: u64,
    /// Times a group's blocks per chunk was learned smaller than before (descriptions made
    /// before that were too long).
    pub chunk_size_lowered: u64,
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
    generation: u64,
}

impl Chunk {
    fn tokens(&self) -> usize {
        self.description.as_ref().map_or(0, |d| d.token_ids.len())
    }
}

/// A group's blocks per chunk, and whether an engine said it (a self-describing event) or it
/// was learned from walks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ChunkSize {
    blocks: usize,
    said: bool,
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
    /// Tokens held by `blocks`, and by the descriptions in `chunks`.
    block_tokens: usize,
    chunk_tokens: usize,
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
                max_tokens: limits.max_tokens.max(1),
            },
            block_tokens: 0,
            chunk_tokens: 0,
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
        let with_tokens = !event.token_ids.is_empty() || event.block_size != 0;
        let tokens_fit = usize::try_from(event.block_size)
            .ok()
            .filter(|&size| size > 0)
            .and_then(|size| size.checked_mul(hashes.len()))
            == Some(event.token_ids.len());
        if with_tokens && !tokens_fit {
            self.stats.bad_tokens += 1;
        }
        let describable = with_tokens && tokens_fit && !event.has_extra_keys;
        if with_tokens && tokens_fit && event.has_extra_keys {
            self.stats.extra_keys += hashes.len() as u64;
        }
        let cpu = event.medium.as_deref() == Some(CPU_MEDIUM);
        if describable {
            self.learn_blocks(event, &hashes, parent, group);
        }
        if !cpu {
            return;
        }
        let key = OffloadKey::from_parts(last, group);
        if describable {
            self.chunk_sizes.insert(
                group,
                ChunkSize {
                    blocks: hashes.len(),
                    said: true,
                },
            );
            let description = ChunkDescription {
                block_hashes: hashes.iter().map(|h| Box::from(*h)).collect(),
                parent: parent.map(Box::from),
                token_ids: event.token_ids.clone(),
                block_size: event.block_size,
                lora_id: event.lora_id,
                lora_name: event.lora_name.clone(),
            };
            self.stats.said += 1;
            self.put_chunk(key, Some(Arc::new(description)));
        } else if !self.chunks.contains_key(&key) {
            // Seen first: a boundary for later walks, described now if its blocks are here.
            self.put_chunk(key.clone(), None);
            let _ = self.describe(&key);
        }
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
        let description = Arc::new(self.walk(hash, group)?);
        self.stats.walked += 1;
        self.put_chunk(key.clone(), Some(description.clone()));
        Ok(description)
    }

    /// The root chunk of the prefix chunk `key` ends: each chunk's parent is the last block of
    /// the chunk before it, so the walk goes chunk by chunk to one with no parent. Every chunk
    /// on the way must be describable; at most [`MAX_ANCESTORS`] of them.
    pub fn root(&mut self, key: &OffloadKey) -> Result<OffloadKey, Undescribed> {
        let (_, group) = split(key).ok_or(Undescribed::Unknown)?;
        let mut current = key.clone();
        for _ in 0..MAX_ANCESTORS {
            let description = self.describe(&current)?;
            match &description.parent {
                None => return Ok(current),
                Some(parent) => current = OffloadKey::from_parts(parent, group),
            }
        }
        Err(Undescribed::TooLong)
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
        if size > self.limits.max_tokens {
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
                self.block_tokens -= old.tokens.len();
            }
            while !self.blocks.is_empty()
                && (self.blocks.len() >= self.limits.max_blocks
                    || self.block_tokens + size > self.limits.max_tokens)
            {
                self.forget_oldest_block();
            }
            let parent = match i.checked_sub(1) {
                None => parent,
                Some(before) => hashes.get(before).copied(),
            };
            let generation = self.next_generation;
            self.next_generation += 1;
            self.block_order.push_back((generation, key.clone()));
            self.block_tokens += size;
            self.blocks.insert(
                key,
                Block {
                    parent: parent.map(Box::from),
                    tokens: Box::from(tokens),
                    lora_id: event.lora_id,
                    lora_name: lora_name.clone(),
                    generation,
                },
            );
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
        match self.chunk_sizes.get(&group).copied() {
            None => {
                self.chunk_sizes.insert(
                    group,
                    ChunkSize {
                        blocks: count,
                        said: false,
                    },
                );
            }
            Some(known) if known.blocks == count => {}
            Some(known) if !known.said && count < known.blocks => {
                self.stats.chunk_size_lowered += 1;
                self.chunk_sizes.insert(
                    group,
                    ChunkSize {
                        blocks: count,
                        said: false,
                    },
                );
            }
            Some(_) => return Err(Undescribed::Inconsistent),
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

    fn put_chunk(&mut self, key: OffloadKey, description: Option<Arc<ChunkDescription>>) {
        let tokens = description.as_ref().map_or(0, |d| d.token_ids.len());
        if let Some(old) = self.chunks.remove(&key) {
            self.chunk_tokens -= old.tokens();
        }
        if tokens > self.limits.max_tokens {
            return;
        }
        while !self.chunks.is_empty()
            && (self.chunks.len() >= self.limits.max_chunks
                || self.chunk_tokens + tokens > self.limits.max_tokens)
        {
            self.forget_oldest_chunk();
        }
        let generation = self.next_generation;
        self.next_generation += 1;
        self.chunk_order.push_back((generation, key.clone()));
        self.chunk_tokens += tokens;
        self.chunks.insert(
            key,
            Chunk {
                description,
                generation,
            },
        );
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
                    self.block_tokens -= b.tokens.len();
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
                    self.chunk_tokens -= c.tokens();
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
        // group's size learned (2), that is no description, not a made-up one.
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

    #[test]
    fn the_shortest_walk_sets_the_chunk_size_and_is_counted_when_it_lowers_it() {
        let mut c = Catalog::new(CatalogLimits::default());
        // First seen: a chunk ending at 4 whose chunk ending at 2 was missed (4 blocks).
        c.learn(&stored(&[1, 2, 3, 4], None, "GPU"));
        c.learn(&placeholder(4));
        assert_eq!(hashes(&c.describe(&key(4)).unwrap()), vec![1, 2, 3, 4]);
        // Then a prompt's first chunk of 2: the size is lowered, and said.
        c.learn(&stored(&[21, 22], None, "GPU"));
        c.learn(&placeholder(22));
        assert_eq!(hashes(&c.describe(&key(22)).unwrap()), vec![21, 22]);
        assert_eq!(c.stats().chunk_size_lowered, 1);
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
            max_tokens: 1000,
        };
        let mut c = Catalog::new(limits);
        // Huge blocks: 300 tokens each; only 3 fit the token budget.
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
        // The newest are the ones kept.
        assert_eq!(hashes(&c.describe(&key(249)).unwrap()), vec![249]);
        assert!(c.block_order.len() <= 2 * c.blocks.len() + 64);
        assert!(c.chunk_order.len() <= 2 * c.chunks.len() + 64);
    }
}
