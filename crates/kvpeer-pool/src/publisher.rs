//! The pool node's own KV event stream, in vLLM's form, so that the routers that index vLLM
//! engines (llm-d's kv-cache indexer, Dynamo's KV router, Mooncake's conductor) index a pool
//! node the same way: what its store took in and let go, as CPU-tier placeholder events.
//!
//! Like vLLM's `ZmqEventPublisher`: each batch is `(topic, seq as 8 bytes big-endian,
//! payload)` with `seq` from 0; the last `buffer` batches are kept for replay; a replay request
//! for `start` is answered with every kept batch whose `seq ≥ start`, then an end marker whose
//! `seq` is −1. Every key the store takes in is one `BlockStored` (its hash = the key without
//! its 4-byte group, `group_idx` = that group, `medium: "CPU"`, `ownership: "kvpeer"`); keys
//! let go of are one `BlockRemoved` per group. Keys shorter than the group suffix name no
//! chunk and are left out.
//!
//! Pure: the caller (the pool node's publishing thread) gives it the store's changes and a
//! timestamp, and sends the frames it returns.

use std::collections::VecDeque;

use kvpeer_proto::events::{encode_batch, BlockHash, BlockRemoved, BlockStored, KvEvent};
use kvpeer_proto::{EncodeError, OffloadKey, GROUP_INDEX_LEN};

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

/// The `ownership` a pool node's events carry (vLLM's names a secondary tier there).
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
        }
    }

    /// The kinds of the KV cache groups, as the followed engines said them.
    pub fn set_group_kinds(&mut self, kinds: &std::collections::BTreeMap<u32, String>) {
        if &self.group_kinds != kinds {
            self.group_kinds = kinds.clone();
        }
    }

    /// One batch for `changes` at time `ts` (seconds), or `None` if they name no chunk.
    pub fn publish(
        &mut self,
        ts: f64,
        changes: &[StoreChange],
    ) -> Result<Option<Frames>, EncodeError> {
        let events = events_of(changes, &self.group_kinds);
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

/// The events of `changes`, in order: each store one `BlockStored`, each run of removals one
/// `BlockRemoved` per group.
fn events_of(
    changes: &[StoreChange],
    group_kinds: &std::collections::BTreeMap<u32, String>,
) -> Vec<KvEvent> {
    let mut events = Vec::new();
    let mut removed: Vec<(u32, Vec<BlockHash>)> = Vec::new();
    let flush = |removed: &mut Vec<(u32, Vec<BlockHash>)>, events: &mut Vec<KvEvent>| {
        for (group, hashes) in removed.drain(..) {
            events.push(KvEvent::Removed(BlockRemoved {
                block_hashes: hashes,
                medium: Some(crate::keys::CPU_MEDIUM.into()),
                group_idx: Some(group),
                ownership: Some(OWNERSHIP.into()),
                ..BlockRemoved::default()
            }));
        }
    };
    for change in changes {
        match change {
            StoreChange::Stored(key) => {
                let Some((hash, group)) = split(key) else {
                    continue;
                };
                flush(&mut removed, &mut events);
                events.push(KvEvent::Stored(BlockStored {
                    block_hashes: vec![BlockHash::Bytes(hash.to_vec())],
                    medium: Some(crate::keys::CPU_MEDIUM.into()),
                    group_idx: Some(group),
                    kv_cache_spec_kind: group_kinds.get(&group).cloned(),
                    ownership: Some(OWNERSHIP.into()),
                    ..BlockStored::default()
                }));
            }
            StoreChange::Removed(key) => {
                let Some((hash, group)) = split(key) else {
                    continue;
                };
                match removed.iter_mut().find(|(g, _)| *g == group) {
                    Some((_, hashes)) => hashes.push(BlockHash::Bytes(hash.to_vec())),
                    None => removed.push((group, vec![BlockHash::Bytes(hash.to_vec())])),
                }
            }
        }
    }
    flush(&mut removed, &mut events);
    events
}

/// A key's chunk hash and group, if it has both.
fn split(key: &OffloadKey) -> Option<(&[u8], u32)> {
    let bytes = key.as_bytes();
    let at = bytes
        .len()
        .checked_sub(GROUP_INDEX_LEN)
        .filter(|&at| at > 0)?;
    let (hash, group) = bytes.split_at(at);
    let group: [u8; 4] = group.try_into().ok()?;
    Some((hash, u32::from_be_bytes(group)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::keys::{key_event, KeyEvent};
    use kvpeer_proto::events::{decode_batch, EventLimits};

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
        let frames = p.publish(12.5, &changes).unwrap().unwrap();
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
        assert_eq!(p.publish(13.0, &[]).unwrap(), None);
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
        for i in 0..5u8 {
            p.publish(f64::from(i), &[StoreChange::Stored(key(i, 0))])
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
