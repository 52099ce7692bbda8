//! The pool node's own KV event stream, in vLLM's form, so that the routers that index vLLM
//! engines (vllm-router, Dynamo's KV indexer, llm-d's kv-cache indexer, Mooncake's conductor)
//! index a pool node the same way: what its store took in and let go.
//!
//! Like vLLM's `ZmqEventPublisher`: each batch is `(topic, seq as 8 bytes big-endian,
//! payload)` with `seq` from 0; the last `buffer` batches are kept for replay; a replay request
//! for `start` is answered with every kept batch whose `seq ≥ start`, then an end marker whose
//! `seq` is −1. Every key the store takes in is one `BlockStored` (`medium: "CPU"`,
//! `group_idx` = the key's 4-byte group, the group's kind once learned, and no `ownership`
//! unless one is set: an engine's own CPU tier says none, and routers treat a value
//! differently, see [`Publisher::set_ownership`]):
//! in vLLM's **self-describing** form when the [`Catalog`] describes the chunk (its blocks'
//! hashes, the last naming the key, its parent, its tokens, the engine's block size), which is
//! what a router that hashes tokens needs; otherwise in vLLM's placeholder form (the one hash,
//! no tokens, `block_size: 0`), counted by reason, never with a made-up value. Keys let go of
//! are one `BlockRemoved` per group listing every hash the chunk was announced with. Keys
//! shorter than the group suffix name no chunk and are left out.
//!
//! [`HashForm::Int`] publishes each hash as vLLM does with
//! `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, its low 64 bits (the last 8 bytes, big-endian),
//! for routers that take only ints (Dynamo's); a pool that follows such a stream cannot form
//! keys from it.
//!
//! Pure: the caller (the pool node's publishing thread) gives it the store's changes, the
//! catalog and a timestamp, and sends the frames it returns. Memory: the replay buffer, and
//! the hashes of each held chunk announced with more than one (at most [`MAX_FANOUT`] chunks).

use std::collections::VecDeque;

use std::collections::HashMap;

use kvpeer_proto::events::{encode_batch, BlockHash, BlockRemoved, BlockStored, KvEvent};
use kvpeer_proto::{EncodeError, OffloadKey};

use crate::catalog::{split, Catalog, Undescribed};

/// Bytes of hashes remembered for the removal of held chunks announced with more than one
/// (past it, or for a chunk of more than [`MAX_FANOUT_HASHES`], a removal lists only the key's
/// hash, and the chunk is counted in [`PublisherStats::fanout_full`]).
pub const MAX_FANOUT: usize = 64 << 20;
/// Most hashes remembered for one chunk.
pub const MAX_FANOUT_HASHES: usize = 1024;

/// How the pool writes block hashes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum HashForm {
    /// The full hash (as engines with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).
    #[default]
    Bytes,
    /// Its low 64 bits, as an unsigned int (vLLM's default form).
    Int,
}

/// What the publisher wrote (counters since start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PublisherStats {
    /// Stores published with the chunk's description.
    pub described: u64,
    /// Stores published as placeholders because no block of the chunk was known.
    pub undescribed_unknown: u64,
    /// ... because the walk back was too long.
    pub undescribed_too_long: u64,
    /// ... because the walk disagreed with the group's chunk size or its blocks disagreed.
    pub undescribed_inconsistent: u64,
    /// ... because the group's chunk size was not confirmed yet.
    pub undescribed_unconfirmed: u64,
    /// Chunks whose hashes could not be remembered for their removal.
    pub fanout_full: u64,
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// What the store did to one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreChange {
    /// The key's block is readable (fetched from a peer, or put).
    Stored(OffloadKey),
    /// The key's block was evicted or dropped.
    Removed(OffloadKey),
}

/// One message of the stream: topic, sequence number (8 bytes big-endian), payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frames {
    /// The topic.
    pub topic: Vec<u8>,
    /// `seq` as 8 bytes big-endian (−1 for the end of a replay).
    pub seq: [u8; 8],
    /// The `KVEventBatch` (empty for the end of a replay).
    pub payload: Vec<u8>,
}

/// An `ownership` a pool node's events may carry (vLLM's names a secondary tier there), for
/// routers that should tell a pool from an engine's CPU tier.
pub const OWNERSHIP: &str = "kvpeer";

/// The publishing side's state: the next `seq` and the replay buffer.
#[derive(Debug)]
pub struct Publisher {
    topic: Vec<u8>,
    next_seq: u64,
    buffer: VecDeque<(u64, Vec<u8>)>,
    buffer_len: usize,
    data_parallel_rank: Option<i64>,
    /// The kind of each KV cache group, said in every `BlockStored` of that group (routers
    /// such as llm-d's skip a store of a group whose kind they never learned).
    group_kinds: std::collections::BTreeMap<u32, String>,
    hash_form: HashForm,
    ownership: Option<String>,
    /// Every hash a held chunk was announced with, when more than its key's.
    fanout: FastMap<OffloadKey, Vec<Box<[u8]>>>,
    /// Bytes of the hashes in `fanout`.
    fanout_bytes: usize,
    stats: PublisherStats,
}

impl Publisher {
    /// A stream on `topic` keeping `buffer_len` batches for replay (vLLM keeps 10,000).
    pub fn new(topic: &str, buffer_len: usize) -> Self {
        Publisher {
            topic: topic.as_bytes().to_vec(),
            next_seq: 0,
            buffer: VecDeque::new(),
            buffer_len: buffer_len.max(1),
            data_parallel_rank: Some(0),
            group_kinds: std::collections::BTreeMap::new(),
            hash_form: HashForm::Bytes,
            ownership: None,
            fanout: FastMap::default(),
            fanout_bytes: 0,
            stats: PublisherStats::default(),
        }
    }

    /// Hashes written in `form` from now on.
    pub fn set_hash_form(&mut self, form: HashForm) {
        self.hash_form = form;
    }

    /// The `ownership` every event says from now on (`None`: left out, as an engine's own CPU
    /// tier). Routers differ: vllm-router 0.1.17 scores blocks with an ownership as an
    /// external cache (×0.6 by default, ×0.8 for a host tier without) and removes them only by
    /// a removal of the same ownership; Dynamo's indexer 1.6.1 ignores every event that has
    /// one; llm-d ignores the field (docs/scaling.md).
    pub fn set_ownership(&mut self, ownership: Option<String>) {
        self.ownership = ownership;
    }

    /// What it wrote so far.
    pub fn stats(&self) -> PublisherStats {
        self.stats
    }

    /// The kinds of the KV cache groups, as the followed engines said them.
    pub fn set_group_kinds(&mut self, kinds: &std::collections::BTreeMap<u32, String>) {
        if &self.group_kinds != kinds {
            self.group_kinds = kinds.clone();
        }
    }

    /// One batch for `changes` at time `ts` (seconds), its chunks described from `catalog`
    /// where it can, or `None` if they name no chunk.
    pub fn publish(
        &mut self,
        ts: f64,
        changes: &[StoreChange],
        catalog: &mut Catalog,
    ) -> Result<Option<Frames>, EncodeError> {
        let events = self.events_of(changes, catalog);
        if events.is_empty() {
            return Ok(None);
        }
        let payload = encode_batch(ts, &events, self.data_parallel_rank)?;
        let seq = self.next_seq;
        self.next_seq += 1;
        if self.buffer.len() == self.buffer_len {
            self.buffer.pop_front();
        }
        self.buffer.push_back((seq, payload.clone()));
        Ok(Some(Frames {
            topic: self.topic.clone(),
            seq: seq.to_be_bytes(),
            payload,
        }))
    }

    /// The answer to a replay request from `start`: the kept batches from there, then the end.
    pub fn replay(&self, start: u64) -> Vec<Frames> {
        let mut out: Vec<Frames> = self
            .buffer
            .iter()
            .filter(|(seq, _)| *seq >= start)
            .map(|(seq, payload)| Frames {
                topic: self.topic.clone(),
                seq: seq.to_be_bytes(),
                payload: payload.clone(),
            })
            .collect();
        out.push(Frames {
            topic: Vec::new(),
            seq: (-1i64).to_be_bytes(),
            payload: Vec::new(),
        });
        out
    }

    /// The `seq` the next batch gets.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }
}

impl Publisher {
    /// The events of `changes`, in order: each store one `BlockStored`, each run of removals
    /// one `BlockRemoved` per group.
    fn events_of(&mut self, changes: &[StoreChange], catalog: &mut Catalog) -> Vec<KvEvent> {
        let mut events = Vec::new();
        let mut removed: Vec<(u32, Vec<BlockHash>)> = Vec::new();
        for change in changes {
            match change {
                StoreChange::Stored(key) => {
                    let Some((hash, group)) = split(key) else {
                        continue;
                    };
                    self.flush_removed(&mut removed, &mut events);
                    let stored = self.stored(key, hash, group, catalog);
                    events.push(KvEvent::Stored(stored));
                }
                StoreChange::Removed(key) => {
                    let Some((hash, group)) = split(key) else {
                        continue;
                    };
                    let hashes: Vec<BlockHash> = match self.forget_fanout(key) {
                        Some(all) => all.iter().map(|h| self.hash(h)).collect(),
                        None => vec![self.hash(hash)],
                    };
                    match removed.iter_mut().find(|(g, _)| *g == group) {
                        Some((_, list)) => list.extend(hashes),
                        None => removed.push((group, hashes)),
                    }
                }
            }
        }
        self.flush_removed(&mut removed, &mut events);
        events
    }

    /// The `BlockStored` of held chunk `key`: described if the catalog can, else vLLM's
    /// placeholder.
    fn stored(
        &mut self,
        key: &OffloadKey,
        hash: &[u8],
        group: u32,
        catalog: &mut Catalog,
    ) -> BlockStored {
        let mut stored = BlockStored {
            medium: Some(crate::keys::CPU_MEDIUM.into()),
            group_idx: Some(group),
            kv_cache_spec_kind: self.group_kinds.get(&group).cloned(),
            ownership: self.ownership.clone(),
            ..BlockStored::default()
        };
        match catalog.describe(key) {
            Ok(d) => {
                self.stats.described += 1;
                stored.block_hashes = d.block_hashes.iter().map(|h| self.hash(h)).collect();
                stored.parent_block_hash = d.parent.as_deref().map(|p| self.hash(p));
                stored.token_ids = d.token_ids.clone();
                stored.block_size = d.block_size;
                stored.lora_id = d.lora_id;
                stored.lora_name = d.lora_name.clone();
                self.forget_fanout(key);
                if d.block_hashes.len() > 1 {
                    let bytes = fanout_bytes(&d.block_hashes);
                    if d.block_hashes.len() <= MAX_FANOUT_HASHES
                        && self.fanout_bytes + bytes <= MAX_FANOUT
                    {
                        self.fanout_bytes += bytes;
                        self.fanout.insert(key.clone(), d.block_hashes.clone());
                    } else {
                        self.stats.fanout_full += 1;
                    }
                }
            }
            Err(why) => {
                match why {
                    Undescribed::Unknown => self.stats.undescribed_unknown += 1,
                    Undescribed::TooLong => self.stats.undescribed_too_long += 1,
                    Undescribed::Inconsistent => self.stats.undescribed_inconsistent += 1,
                    Undescribed::Unconfirmed => self.stats.undescribed_unconfirmed += 1,
                }
                stored.block_hashes = vec![self.hash(hash)];
                self.forget_fanout(key);
            }
        }
        stored
    }

    fn forget_fanout(&mut self, key: &OffloadKey) -> Option<Vec<Box<[u8]>>> {
        let hashes = self.fanout.remove(key)?;
        self.fanout_bytes -= fanout_bytes(&hashes);
        Some(hashes)
    }

    fn hash(&self, h: &[u8]) -> BlockHash {
        match self.hash_form {
            HashForm::Bytes => BlockHash::Bytes(h.to_vec()),
            HashForm::Int => BlockHash::Int(low_64_bits(h)),
        }
    }

    fn flush_removed(&self, removed: &mut Vec<(u32, Vec<BlockHash>)>, events: &mut Vec<KvEvent>) {
        for (group, hashes) in removed.drain(..) {
            events.push(KvEvent::Removed(BlockRemoved {
                block_hashes: hashes,
                medium: Some(crate::keys::CPU_MEDIUM.into()),
                group_idx: Some(group),
                ownership: self.ownership.clone(),
                ..BlockRemoved::default()
            }));
        }
    }
}

/// What a chunk's hashes cost in the fan-out map (with each allocation's overhead).
fn fanout_bytes(hashes: &[Box<[u8]>]) -> usize {
    64 + hashes.iter().map(|h| h.len() + 16).sum::<usize>()
}

/// vLLM's int form of a hash: the bytes as a big-endian number, its low 64 bits.
pub fn low_64_bits(hash: &[u8]) -> u64 {
    hash.iter()
        .rev()
        .take(8)
        .rev()
        .fold(0u64, |n, &b| (n << 8) | u64::from(b))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::CatalogLimits;
    use crate::keys::{key_event, KeyEvent};
    use kvpeer_proto::events::{decode_batch, EventLimits};

    /// A GPU store of `blocks` (hash byte i, 2 tokens each: 10i, 10i+1) after `parent`.
    fn gpu(blocks: &[u8], parent: Option<u8>) -> BlockStored {
        BlockStored {
            block_hashes: blocks
                .iter()
                .map(|&b| BlockHash::Bytes(vec![b; 32]))
                .collect(),
            parent_block_hash: parent.map(|p| BlockHash::Bytes(vec![p; 32])),
            token_ids: blocks
                .iter()
                .flat_map(|&b| [u32::from(b) * 10, u32::from(b) * 10 + 1])
                .collect(),
            block_size: 2,
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..BlockStored::default()
        }
    }

    fn placeholder(hash: u8) -> BlockStored {
        BlockStored {
            block_hashes: vec![BlockHash::Bytes(vec![hash; 32])],
            medium: Some("CPU".into()),
            group_idx: Some(0),
            ..BlockStored::default()
        }
    }

    fn stores(frames: &Frames) -> Vec<KvEvent> {
        decode_batch(&frames.payload, &EventLimits::default())
            .unwrap()
            .events
            .into_iter()
            .map(Result::unwrap)
            .collect()
    }

    #[test]
    fn a_chunk_the_engines_described_is_published_with_its_blocks_tokens_and_parent() {
        let mut catalog = Catalog::new(CatalogLimits::default());
        // One prompt of 6 blocks (1..=6), chunks of 2 blocks: the engine's GPU events, then
        // its CPU tier's placeholders for the chunks ending at 2, 4 and 6.
        catalog.learn(&gpu(&[1, 2, 3], None));
        catalog.learn(&gpu(&[4, 5, 6], Some(3)));
        for last in [2, 4, 6] {
            catalog.learn(&placeholder(last));
        }
        let mut p = Publisher::new("kv@pool", 10);
        let frames = p
            .publish(
                1.0,
                &[
                    StoreChange::Stored(key(4, 0)),
                    StoreChange::Stored(key(9, 0)),
                ],
                &mut catalog,
            )
            .unwrap()
            .unwrap();
        let events = stores(&frames);
        let KvEvent::Stored(described) = &events[0] else {
            panic!("{events:?}")
        };
        assert_eq!(
            described.block_hashes,
            vec![BlockHash::Bytes(vec![3; 32]), BlockHash::Bytes(vec![4; 32])]
        );
        assert_eq!(
            described.parent_block_hash,
            Some(BlockHash::Bytes(vec![2; 32]))
        );
        assert_eq!(described.token_ids, vec![30, 31, 40, 41]);
        assert_eq!(described.block_size, 2);
        assert_eq!(described.ownership, None);
        // The same chunk still names the same key to a follower (its last hash).
        assert_eq!(key_event(&events[0]), KeyEvent::Stored(key(4, 0)));
        // A chunk nothing described: vLLM's placeholder, counted.
        let KvEvent::Stored(unknown) = &events[1] else {
            panic!("{events:?}")
        };
        assert_eq!(unknown.block_hashes, vec![BlockHash::Bytes(vec![9; 32])]);
        assert!(unknown.token_ids.is_empty() && unknown.block_size == 0);
        assert_eq!(p.stats().described, 1);
        assert_eq!(p.stats().undescribed_unknown, 1);

        // Its removal lists every hash it was announced with, as vLLM's does.
        let frames = p
            .publish(2.0, &[StoreChange::Removed(key(4, 0))], &mut catalog)
            .unwrap()
            .unwrap();
        let KvEvent::Removed(r) = &stores(&frames)[0] else {
            panic!()
        };
        assert_eq!(
            r.block_hashes,
            vec![BlockHash::Bytes(vec![3; 32]), BlockHash::Bytes(vec![4; 32])]
        );
    }

    #[test]
    fn the_int_form_is_the_low_64_bits_of_every_hash() {
        let mut catalog = Catalog::new(CatalogLimits::default());
        let mut hash = [0u8; 32];
        hash[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
        hash[0] = 0xff;
        let root = BlockStored {
            block_hashes: vec![BlockHash::Bytes(hash.to_vec())],
            token_ids: vec![7, 8],
            block_size: 2,
            medium: Some("CPU".into()),
            group_idx: Some(0),
            ..BlockStored::default()
        };
        catalog.learn(&root);
        let mut p = Publisher::new("", 10);
        p.set_hash_form(HashForm::Int);
        let k = OffloadKey::from_parts(&hash, 0);
        let frames = p
            .publish(
                1.0,
                &[StoreChange::Stored(k.clone()), StoreChange::Removed(k)],
                &mut catalog,
            )
            .unwrap()
            .unwrap();
        let events = stores(&frames);
        let KvEvent::Stored(s) = &events[0] else {
            panic!()
        };
        assert_eq!(s.block_hashes, vec![BlockHash::Int(0x0102_0304_0506_0708)]);
        assert_eq!(s.parent_block_hash, None);
        assert_eq!(s.token_ids, vec![7, 8]);
        let KvEvent::Removed(r) = &events[1] else {
            panic!()
        };
        assert_eq!(r.block_hashes, vec![BlockHash::Int(0x0102_0304_0506_0708)]);
        assert_eq!(low_64_bits(&[1, 2]), 0x0102);
    }

    fn key(i: u8, group: u32) -> OffloadKey {
        OffloadKey::from_parts(&[i; 32], group)
    }

    #[test]
    fn what_the_pool_publishes_names_the_same_keys_to_a_follower() {
        let mut p = Publisher::new("kv@pool", 10);
        let changes = vec![
            StoreChange::Removed(key(9, 0)),
            StoreChange::Removed(key(8, 1)),
            StoreChange::Removed(key(7, 0)),
            StoreChange::Stored(key(1, 0)),
            StoreChange::Stored(key(2, 5)),
            StoreChange::Stored(OffloadKey::from_bytes(&[1, 2])),
        ];
        let mut catalog = Catalog::new(CatalogLimits::default());
        let frames = p.publish(12.5, &changes, &mut catalog).unwrap().unwrap();
        assert_eq!(frames.topic, b"kv@pool");
        assert_eq!(frames.seq, 0u64.to_be_bytes());
        let batch = decode_batch(&frames.payload, &EventLimits::default()).unwrap();
        let named: Vec<KeyEvent> = batch
            .events
            .iter()
            .map(|e| key_event(e.as_ref().unwrap()))
            .collect();
        assert_eq!(
            named,
            vec![
                KeyEvent::Removed(vec![key(9, 0), key(7, 0)]),
                KeyEvent::Removed(vec![key(8, 1)]),
                KeyEvent::Stored(key(1, 0)),
                KeyEvent::Stored(key(2, 5)),
            ]
        );
        assert_eq!(p.publish(13.0, &[], &mut catalog).unwrap(), None);
        assert_eq!(p.next_seq(), 1);

        // With the groups' kinds learned, each store says its group's kind.
        let kinds = [(0, "full_attention".to_string())].into_iter().collect();
        p.set_group_kinds(&kinds);
        let frames = p
            .publish(
                14.0,
                &[
                    StoreChange::Stored(key(3, 0)),
                    StoreChange::Stored(key(4, 5)),
                ],
                &mut catalog,
            )
            .unwrap()
            .unwrap();
        let batch = decode_batch(&frames.payload, &EventLimits::default()).unwrap();
        let said: Vec<Option<String>> = batch
            .events
            .iter()
            .map(|e| match e {
                Ok(KvEvent::Stored(s)) => s.kv_cache_spec_kind.clone(),
                _ => None,
            })
            .collect();
        assert_eq!(said, vec![Some("full_attention".into()), None]);
    }

    #[test]
    fn a_replay_sends_what_is_kept_from_start_then_the_end_marker() {
        let mut p = Publisher::new("", 3);
        let mut catalog = Catalog::new(CatalogLimits::default());
        for i in 0..5u8 {
            p.publish(
                f64::from(i),
                &[StoreChange::Stored(key(i, 0))],
                &mut catalog,
            )
            .unwrap();
        }
        let seqs = |frames: Vec<Frames>| -> Vec<i64> {
            frames.iter().map(|f| i64::from_be_bytes(f.seq)).collect()
        };
        assert_eq!(seqs(p.replay(0)), vec![2, 3, 4, -1]);
        assert_eq!(seqs(p.replay(4)), vec![4, -1]);
        assert_eq!(seqs(p.replay(9)), vec![-1]);
        let end = p.replay(9).pop().unwrap();
        assert!(end.topic.is_empty() && end.payload.is_empty());
    }
}
