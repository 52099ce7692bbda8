//! kvpeer's KV event codec (`kvpeer_proto::events`) against vLLM 0.33's own event classes and
//! msgspec encoder (`vllm/distributed/kv_events.py`, extracted unchanged from the released wheel
//! by tests/interop/setup.sh): batches vLLM encodes decode to the same fields, in the map form
//! vLLM 0.33 publishes and in the array form of older releases; batches kvpeer encodes are
//! byte-identical to vLLM's encoding of the same events, and vLLM's typed decoder reads them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::process::Command;

use common::vllm::{python, pythonpath};
use kvpeer_proto::events::{
    decode_batch, encode_batch, BlockHash, BlockRemoved, BlockStored, EventLimits, KvEvent,
};

/// Runs `script` with vLLM's event classes imported; returns its stdout lines.
fn run_python(script: &str) -> Vec<String> {
    let prelude = "import sys, msgspec\n\
        from vllm.distributed.kv_events import KVEventBatch, BlockStored, BlockRemoved, \
        AllBlocksCleared\n";
    let out = Command::new(python())
        .arg("-c")
        .arg(format!("{prelude}{script}"))
        .env("PYTHONPATH", pythonpath())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The events of the tests: a CPU-tier placeholder store (bytes hash, group 3, a tier's
/// ownership), a self-describing store (three int hashes, parent, 48 tokens of 16-token
/// blocks), a removal, and a GPU reset.
const VLLM_EVENTS: &str = "[\
    BlockStored(block_hashes=[bytes(range(32))], parent_block_hash=None, token_ids=[], \
        block_size=0, lora_id=None, medium='CPU', lora_name=None, group_idx=3, \
        ownership='p2p'),\
    BlockStored(block_hashes=[11, 12, 2**64 - 1], parent_block_hash=10, \
        token_ids=list(range(48)), block_size=16, lora_id=None, medium='GPU', \
        lora_name='adapter', extra_keys=[None, None, ('salt',)], \
        kv_cache_spec_kind='full_attention', locality='LOCAL'),\
    BlockRemoved(block_hashes=[bytes(range(32)), b'\\xff' * 32], medium='CPU', group_idx=3),\
    AllBlocksCleared()]";

fn expected_events() -> Vec<KvEvent> {
    let placeholder: Vec<u8> = (0u8..32).collect();
    vec![
        KvEvent::Stored(BlockStored {
            block_hashes: vec![BlockHash::Bytes(placeholder.clone())],
            medium: Some("CPU".into()),
            group_idx: Some(3),
            ownership: Some("p2p".into()),
            ..BlockStored::default()
        }),
        KvEvent::Stored(BlockStored {
            block_hashes: vec![
                BlockHash::Int(11),
                BlockHash::Int(12),
                BlockHash::Int(u64::MAX),
            ],
            parent_block_hash: Some(BlockHash::Int(10)),
            token_ids: (0..48).collect(),
            block_size: 16,
            medium: Some("GPU".into()),
            lora_name: Some("adapter".into()),
            has_extra_keys: true,
            kv_cache_spec_kind: Some("full_attention".into()),
            locality: Some("LOCAL".into()),
            ..BlockStored::default()
        }),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![
                BlockHash::Bytes(placeholder),
                BlockHash::Bytes(vec![0xff; 32]),
            ],
            medium: Some("CPU".into()),
            group_idx: Some(3),
            ..BlockRemoved::default()
        }),
        KvEvent::AllCleared,
    ]
}

#[test]
fn batches_vllm_encodes_decode_to_the_same_events() {
    let lines = run_python(&format!(
        "b = KVEventBatch(ts=1234.5, events={VLLM_EVENTS}, data_parallel_rank=2)\n\
         print(msgspec.msgpack.encode(b).hex())\n"
    ));
    let payload = hex::decode(&lines[0]).unwrap();
    let batch = decode_batch(&payload, &EventLimits::default()).unwrap();
    assert_eq!(batch.ts, 1234.5);
    assert_eq!(batch.data_parallel_rank, Some(2));
    let events: Vec<KvEvent> = batch.events.into_iter().map(Result::unwrap).collect();
    assert_eq!(events, expected_events());
}

/// Older vLLM releases encoded events as tagged arrays (`array_like=True`): the same structs,
/// encoded that way by msgspec, decode to the same events.
#[test]
fn the_array_form_of_older_releases_decodes_too() {
    let lines = run_python(&format!(
        "import msgspec.structs as st\n\
         def arr(e):\n\
         \x20   return [type(e).__name__] + [getattr(e, f) for f in e.__struct_fields__]\n\
         evs = [arr(e) for e in {VLLM_EVENTS}]\n\
         print(msgspec.msgpack.encode([99.0, evs, 0]).hex())\n"
    ));
    let payload = hex::decode(&lines[0]).unwrap();
    let batch = decode_batch(&payload, &EventLimits::default()).unwrap();
    let events: Vec<KvEvent> = batch.events.into_iter().map(Result::unwrap).collect();
    assert_eq!(events, expected_events());
    assert_eq!(batch.data_parallel_rank, Some(0));
}

/// What a pool node publishes (placeholder stores, described chunks with their tokens,
/// parent and block size in bytes and in int hashes, removals): byte-identical to vLLM's own
/// encoding of the same events, and read back by vLLM's typed decoder.
#[test]
fn batches_kvpeer_encodes_are_byte_identical_to_vllms() {
    let key_hash: Vec<u8> = (100u8..132).collect();
    let events = vec![
        KvEvent::Stored(BlockStored {
            block_hashes: vec![BlockHash::Bytes(key_hash.clone())],
            medium: Some("CPU".into()),
            group_idx: Some(0),
            ..BlockStored::default()
        }),
        KvEvent::Stored(BlockStored {
            block_hashes: vec![BlockHash::Int(77)],
            medium: Some("CPU".into()),
            group_idx: Some(70000),
            kv_cache_spec_kind: Some("full_attention".into()),
            locality: Some("LOCAL".into()),
            ownership: Some("kvpeer".into()),
            ..BlockStored::default()
        }),
        KvEvent::Stored(BlockStored {
            block_hashes: vec![
                BlockHash::Bytes(vec![7; 32]),
                BlockHash::Bytes(key_hash.clone()),
            ],
            parent_block_hash: Some(BlockHash::Bytes(vec![6; 32])),
            token_ids: (0..32).map(|t| t * 1000).collect(),
            block_size: 16,
            medium: Some("CPU".into()),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ownership: Some("kvpeer".into()),
            ..BlockStored::default()
        }),
        KvEvent::Stored(BlockStored {
            block_hashes: vec![BlockHash::Int(u64::MAX), BlockHash::Int(3)],
            parent_block_hash: Some(BlockHash::Int(1 << 63)),
            token_ids: vec![5, 70000, u32::MAX, 0],
            block_size: 2,
            lora_id: Some(-3),
            medium: Some("CPU".into()),
            lora_name: Some("adapter".into()),
            group_idx: Some(1),
            ..BlockStored::default()
        }),
        KvEvent::Removed(BlockRemoved {
            block_hashes: vec![BlockHash::Bytes(key_hash), BlockHash::Int(5)],
            medium: Some("CPU".into()),
            group_idx: Some(0),
            ..BlockRemoved::default()
        }),
        KvEvent::AllCleared,
    ];
    let ours = encode_batch(7.25, &events, Some(1)).unwrap();
    let unset_rank = encode_batch(7.25, &events[5..], None).unwrap();
    let script = format!(
        "ours = bytes.fromhex('{}')\n\
         h = bytes(range(100, 132))\n\
         evs = [BlockStored(block_hashes=[h], parent_block_hash=None, token_ids=[], \
             block_size=0, lora_id=None, medium='CPU', lora_name=None, group_idx=0),\
           BlockStored(block_hashes=[77], parent_block_hash=None, token_ids=[], block_size=0, \
             lora_id=None, medium='CPU', lora_name=None, group_idx=70000, \
             kv_cache_spec_kind='full_attention', locality='LOCAL', \
             ownership='kvpeer'),\
           BlockStored(block_hashes=[bytes([7] * 32), h], parent_block_hash=bytes([6] * 32), \
             token_ids=[t * 1000 for t in range(32)], block_size=16, lora_id=None, \
             medium='CPU', lora_name=None, group_idx=0, \
             kv_cache_spec_kind='full_attention', ownership='kvpeer'),\
           BlockStored(block_hashes=[2**64 - 1, 3], parent_block_hash=2**63, \
             token_ids=[5, 70000, 2**32 - 1, 0], block_size=2, lora_id=-3, medium='CPU', \
             lora_name='adapter', group_idx=1),\
           BlockRemoved(block_hashes=[h, 5], medium='CPU', group_idx=0),\
           AllBlocksCleared()]\n\
         print(msgspec.msgpack.encode(KVEventBatch(ts=7.25, events=evs, \
             data_parallel_rank=1)).hex())\n\
         print(msgspec.msgpack.encode(KVEventBatch(ts=7.25, events=evs[5:])).hex())\n\
         b = msgspec.msgpack.Decoder(KVEventBatch).decode(ours)\n\
         print(b == KVEventBatch(ts=7.25, events=evs, data_parallel_rank=1))\n",
        hex::encode(&ours)
    );
    let lines = run_python(&script);
    assert_eq!(hex::encode(&ours), lines[0]);
    assert_eq!(hex::encode(&unset_rank), lines[1]);
    assert_eq!(
        lines[2], "True",
        "vLLM's decoder reads kvpeer's batch as the same batch"
    );
}
