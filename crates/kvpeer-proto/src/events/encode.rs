//! KV event batches in the bytes vLLM 0.33's publisher sends (msgspec's encoding of its
//! structs, checked against it in `crates/kvpeer/tests/events_vllm.rs`): the batch an array
//! `[ts, events, data_parallel_rank]` (nil when unset), each event a map tagged by `"type"`
//! with the required fields always present and the optional ones only when set, in
//! declaration order. msgspec reserves a map's header by the struct's field count, not by the
//! fields written: `BlockStored` (20 fields with its tag) always gets a map16 header, the
//! smaller structs a fixmap.
//!
//! `extra_keys` and `lookahead_token_ids` are never written (the decoder does not keep them):
//! a pool node describes again only blocks whose hash depends on their tokens and parent alone.

use super::{BlockHash, KvEvent};
use crate::error::EncodeError;
use crate::writer::{
    write_array_len, write_bin, write_f64, write_int, write_map_len, write_nil, write_str,
    write_uint,
};

/// The payload of one batch.
pub fn encode_batch(
    ts: f64,
    events: &[KvEvent],
    data_parallel_rank: Option<i64>,
) -> Result<Vec<u8>, EncodeError> {
    let mut out = Vec::with_capacity(16 + events.len() * 160);
    write_array_len(&mut out, 3)?;
    write_f64(&mut out, ts);
    write_array_len(&mut out, events.len())?;
    for event in events {
        encode_event(&mut out, event)?;
    }
    match data_parallel_rank {
        Some(rank) => write_int(&mut out, rank),
        None => write_nil(&mut out),
    }
    Ok(out)
}

fn encode_event(out: &mut Vec<u8>, event: &KvEvent) -> Result<(), EncodeError> {
    match event {
        KvEvent::Stored(s) => {
            let optional = [
                s.group_idx.is_some(),
                s.kv_cache_spec_kind.is_some(),
                s.locality.is_some(),
                s.ownership.is_some(),
            ];
            // map16 always (see the module doc); at most 12 entries here.
            let entries = 8 + optional.iter().filter(|x| **x).count() as u16;
            out.push(0xde);
            out.extend_from_slice(&entries.to_be_bytes());
            tag(out, "BlockStored")?;
            write_str(out, "block_hashes")?;
            hashes(out, &s.block_hashes)?;
            write_str(out, "parent_block_hash")?;
            match &s.parent_block_hash {
                Some(h) => hash(out, h)?,
                None => write_nil(out),
            }
            write_str(out, "token_ids")?;
            write_array_len(out, s.token_ids.len())?;
            for &token in &s.token_ids {
                write_uint(out, u64::from(token));
            }
            write_str(out, "block_size")?;
            write_uint(out, s.block_size);
            write_str(out, "lora_id")?;
            match s.lora_id {
                Some(id) => write_int(out, id),
                None => write_nil(out),
            }
            opt_str(out, "medium", s.medium.as_deref(), true)?;
            opt_str(out, "lora_name", s.lora_name.as_deref(), true)?;
            group(out, s.group_idx)?;
            opt_str(
                out,
                "kv_cache_spec_kind",
                s.kv_cache_spec_kind.as_deref(),
                false,
            )?;
            opt_str(out, "locality", s.locality.as_deref(), false)?;
            opt_str(out, "ownership", s.ownership.as_deref(), false)?;
        }
        KvEvent::Removed(r) => {
            let optional = [
                r.group_idx.is_some(),
                r.locality.is_some(),
                r.ownership.is_some(),
            ];
            write_map_len(out, 3 + optional.iter().filter(|x| **x).count())?;
            tag(out, "BlockRemoved")?;
            write_str(out, "block_hashes")?;
            hashes(out, &r.block_hashes)?;
            opt_str(out, "medium", r.medium.as_deref(), true)?;
            group(out, r.group_idx)?;
            opt_str(out, "locality", r.locality.as_deref(), false)?;
            opt_str(out, "ownership", r.ownership.as_deref(), false)?;
        }
        KvEvent::AllCleared => {
            write_map_len(out, 1)?;
            tag(out, "AllBlocksCleared")?;
        }
        KvEvent::Other(name) => {
            write_map_len(out, 1)?;
            tag(out, name)?;
        }
    }
    Ok(())
}

fn tag(out: &mut Vec<u8>, name: &str) -> Result<(), EncodeError> {
    write_str(out, "type")?;
    write_str(out, name)
}

fn hashes(out: &mut Vec<u8>, hashes: &[BlockHash]) -> Result<(), EncodeError> {
    write_array_len(out, hashes.len())?;
    hashes.iter().try_for_each(|h| hash(out, h))
}

fn hash(out: &mut Vec<u8>, h: &BlockHash) -> Result<(), EncodeError> {
    match h {
        BlockHash::Bytes(b) => write_bin(out, b),
        BlockHash::Int(i) => {
            write_uint(out, *i);
            Ok(())
        }
    }
}

fn group(out: &mut Vec<u8>, group_idx: Option<u32>) -> Result<(), EncodeError> {
    if let Some(g) = group_idx {
        write_str(out, "group_idx")?;
        write_uint(out, u64::from(g));
    }
    Ok(())
}

/// A string field: written as nil when unset if `required`, left out otherwise.
fn opt_str(
    out: &mut Vec<u8>,
    name: &str,
    value: Option<&str>,
    required: bool,
) -> Result<(), EncodeError> {
    match value {
        Some(v) => {
            write_str(out, name)?;
            write_str(out, v)
        }
        None if required => {
            write_str(out, name)?;
            write_nil(out);
            Ok(())
        }
        None => Ok(()),
    }
}
