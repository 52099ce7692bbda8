//! The P2P offload key a KV event names.
//!
//! vLLM's CPU tier announces each stored chunk as a `BlockStored` with `medium: "CPU"`: in the
//! default (placeholder) form its one hash **is** the chunk's; in the self-describing form it
//! lists every block of the chunk and the **last** hash names it. Either way the chunk's offload
//! key — what a P2P `lookup` asks for — is that last hash followed by `group_idx` as 4 bytes
//! big-endian (`make_offload_key`). A `BlockRemoved` lists every hash of each removed chunk, so
//! each hash is tried as a chunk's last; the ones that are not name nothing the pool tracks.
//!
//! With int hashes (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, vLLM's default) an event carries only
//! the low 64 bits of each hash: the key cannot be formed, so such events can be counted but
//! never pulled (docs/pool.md).

use kvpeer_proto::events::{BlockHash, KvEvent};
use kvpeer_proto::OffloadKey;

/// The medium of vLLM's CPU tier: the one P2P serves from.
pub const CPU_MEDIUM: &str = "CPU";
/// The `kv_cache_spec_kind` of a recurrent (Mamba, linear-attention) group: its stores are
/// state checkpoints, one hash each (vLLM 0.34).
pub const RECURRENT_KIND: &str = "mamba";

/// What an event means for the keys a pool tracks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyEvent {
    /// The engine now holds the chunk `key`.
    Stored(OffloadKey),
    /// The engine no longer holds these keys (some may name no chunk).
    Removed(Vec<OffloadKey>),
    /// Nothing the pool can use, and why.
    Unusable(Unusable),
}

/// Why an event names no key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unusable {
    /// Not the CPU tier (the GPU pool, storage): P2P does not serve it.
    NotCpu,
    /// Int hashes: the full key is not in the event.
    IntHashes,
    /// A store of no block.
    Empty,
    /// `AllBlocksCleared` (the GPU pool was reset) or an unknown type.
    Other,
}

/// What `event` means for the keys a pool tracks.
pub fn key_event(event: &KvEvent) -> KeyEvent {
    match event {
        KvEvent::Stored(s) => {
            if s.medium.as_deref() != Some(CPU_MEDIUM) {
                return KeyEvent::Unusable(Unusable::NotCpu);
            }
            match s.block_hashes.last() {
                None => KeyEvent::Unusable(Unusable::Empty),
                Some(BlockHash::Int(_)) => KeyEvent::Unusable(Unusable::IntHashes),
                Some(BlockHash::Bytes(h)) => {
                    KeyEvent::Stored(OffloadKey::from_parts(h, s.group_idx.unwrap_or(0)))
                }
            }
        }
        KvEvent::Removed(r) => {
            if r.medium.as_deref() != Some(CPU_MEDIUM) {
                return KeyEvent::Unusable(Unusable::NotCpu);
            }
            let group = r.group_idx.unwrap_or(0);
            let keys: Vec<OffloadKey> = r
                .block_hashes
                .iter()
                .filter_map(|h| match h {
                    BlockHash::Bytes(h) => Some(OffloadKey::from_parts(h, group)),
                    BlockHash::Int(_) => None,
                })
                .collect();
            if keys.is_empty() && !r.block_hashes.is_empty() {
                KeyEvent::Unusable(Unusable::IntHashes)
            } else {
                KeyEvent::Removed(keys)
            }
        }
        KvEvent::AllCleared | KvEvent::Other(_) => KeyEvent::Unusable(Unusable::Other),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpeer_proto::events::{BlockRemoved, BlockStored};

    fn stored(hashes: Vec<BlockHash>, medium: &str, group: Option<u32>) -> KvEvent {
        KvEvent::Stored(BlockStored {
            block_hashes: hashes,
            medium: Some(medium.into()),
            group_idx: group,
            ..BlockStored::default()
        })
    }

    #[test]
    fn a_cpu_chunk_is_named_by_its_last_hash_and_group() {
        let e = stored(
            vec![BlockHash::Bytes(vec![1; 32]), BlockHash::Bytes(vec![2; 32])],
            "CPU",
            Some(7),
        );
        let mut want = vec![2u8; 32];
        want.extend_from_slice(&[0, 0, 0, 7]);
        assert_eq!(
            key_event(&e),
            KeyEvent::Stored(OffloadKey::from_bytes(&want))
        );
    }

    #[test]
    fn other_media_and_int_hashes_name_no_key() {
        let gpu = stored(vec![BlockHash::Bytes(vec![1; 32])], "GPU", Some(0));
        assert_eq!(key_event(&gpu), KeyEvent::Unusable(Unusable::NotCpu));
        let ints = stored(vec![BlockHash::Int(5)], "CPU", Some(0));
        assert_eq!(key_event(&ints), KeyEvent::Unusable(Unusable::IntHashes));
        let empty = stored(vec![], "CPU", Some(0));
        assert_eq!(key_event(&empty), KeyEvent::Unusable(Unusable::Empty));
        let removed = KvEvent::Removed(BlockRemoved {
            block_hashes: vec![BlockHash::Int(1)],
            medium: Some("CPU".into()),
            ..BlockRemoved::default()
        });
        assert_eq!(key_event(&removed), KeyEvent::Unusable(Unusable::IntHashes));
    }

    #[test]
    fn a_removal_names_every_hash_as_a_possible_chunk() {
        let removed = KvEvent::Removed(BlockRemoved {
            block_hashes: vec![BlockHash::Bytes(vec![1; 32]), BlockHash::Bytes(vec![2; 32])],
            medium: Some("CPU".into()),
            group_idx: Some(1),
            ..BlockRemoved::default()
        });
        assert_eq!(
            key_event(&removed),
            KeyEvent::Removed(vec![
                OffloadKey::from_parts(&[1; 32], 1),
                OffloadKey::from_parts(&[2; 32], 1)
            ])
        );
    }
}
