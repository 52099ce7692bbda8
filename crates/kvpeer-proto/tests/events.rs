//! The KV event decoder against hostile and odd input: limits hold before allocation, one bad
//! event spoils none of its siblings, unknown types and fields pass, and arbitrary bytes never
//! panic. (Against vLLM's own encoder: crates/kvpeer/tests/events_vllm.rs.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvpeer_proto::events::{
    decode_batch, encode_batch, BlockHash, BlockRemoved, BlockStored, EventError, EventLimits,
    KvEvent,
};
use kvpeer_proto::Value;
use proptest::prelude::*;

fn s(x: &str) -> Value {
    Value::Str(x.into())
}

fn stored_map(hashes: Vec<Value>) -> Value {
    Value::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), Value::Array(hashes)),
        (s("parent_block_hash"), Value::Nil),
        (s("token_ids"), Value::Array(vec![])),
        (s("block_size"), Value::Uint(0)),
        (s("lora_id"), Value::Nil),
        (s("medium"), s("CPU")),
        (s("lora_name"), Value::Nil),
        (s("group_idx"), Value::Uint(0)),
    ])
}

fn batch(events: Vec<Value>) -> Vec<u8> {
    Value::Array(vec![
        Value::Float(1.0),
        Value::Array(events),
        Value::Uint(0),
    ])
    .encode()
    .unwrap()
}

fn hash32(b: u8) -> Value {
    Value::Bin(vec![b; 32])
}

#[test]
fn a_malformed_event_spoils_none_of_its_siblings() {
    let payload = batch(vec![
        stored_map(vec![hash32(1)]),
        // block_hashes is a string
        Value::Map(vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), s("nope")),
        ]),
        // no block_hashes at all
        Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("medium"), s("CPU")),
        ]),
        // a group index that does not fit four bytes
        Value::Map(vec![
            (s("type"), s("BlockRemoved")),
            (s("block_hashes"), Value::Array(vec![hash32(2)])),
            (s("group_idx"), Value::Uint(1 << 40)),
        ]),
        Value::Uint(5),
        stored_map(vec![hash32(3)]),
    ]);
    let b = decode_batch(&payload, &EventLimits::default()).unwrap();
    assert_eq!(b.events.len(), 6);
    assert!(
        matches!(&b.events[0], Ok(KvEvent::Stored(e)) if e.block_hashes == [BlockHash::Bytes(vec![1; 32])])
    );
    for (i, e) in b.events[1..5].iter().enumerate() {
        assert!(
            matches!(e, Err(EventError::BadEvent { index, .. }) if *index == i + 1),
            "{e:?}"
        );
    }
    assert!(
        matches!(&b.events[5], Ok(KvEvent::Stored(e)) if e.block_hashes == [BlockHash::Bytes(vec![3; 32])])
    );
}

#[test]
fn unknown_types_and_fields_pass_and_the_tag_may_come_last() {
    let payload = batch(vec![
        Value::Map(vec![
            (s("type"), s("SomethingNew")),
            (s("x"), Value::Uint(1)),
        ]),
        Value::Map(vec![
            (s("block_hashes"), Value::Array(vec![Value::Uint(9)])),
            (
                s("future_field"),
                Value::Map(vec![(s("a"), Value::Array(vec![]))]),
            ),
            (s("medium"), s("CPU")),
            (s("type"), s("BlockRemoved")),
        ]),
    ]);
    let b = decode_batch(&payload, &EventLimits::default()).unwrap();
    assert_eq!(b.events[0], Ok(KvEvent::Other("SomethingNew".into())));
    assert_eq!(
        b.events[1],
        Ok(KvEvent::Removed(BlockRemoved {
            block_hashes: vec![BlockHash::Int(9)],
            medium: Some("CPU".into()),
            ..BlockRemoved::default()
        }))
    );
}

#[test]
fn limits_hold_before_anything_is_kept() {
    let limits = EventLimits {
        max_events: 4,
        max_hashes: 3,
        max_hash_bytes: 32,
        max_tokens: 5,
        max_str_bytes: 8,
        max_payload_bytes: 4096,
        max_depth: 6,
    };
    let many = batch(vec![stored_map(vec![hash32(1)]); 5]);
    assert!(matches!(
        decode_batch(&many, &limits),
        Err(EventError::TooMany {
            what: "events",
            len: 5,
            limit: 4
        })
    ));
    let wide = batch(vec![stored_map(vec![hash32(1); 4])]);
    assert!(matches!(
        decode_batch(&wide, &limits).unwrap().events[0],
        Err(EventError::BadEvent { .. })
    ));
    // Token ids: within the limit they are kept; past it, or not ids, the event is an error.
    let with_tokens = |tokens: Vec<Value>| {
        let mut e = stored_map(vec![hash32(1)]);
        if let Value::Map(entries) = &mut e {
            entries[3].1 = Value::Array(tokens);
        }
        batch(vec![e])
    };
    let token_limits = EventLimits {
        max_tokens: 5,
        ..EventLimits::default()
    };
    let five = with_tokens((0..5).map(Value::Uint).collect());
    match &decode_batch(&five, &token_limits).unwrap().events[0] {
        Ok(KvEvent::Stored(s)) => assert_eq!(s.token_ids, vec![0, 1, 2, 3, 4]),
        other => panic!("{other:?}"),
    }
    // Past the limit, or not ids: the event still decodes (its hashes count), its tokens are
    // not kept and it says so.
    for bad in [
        (0..6).map(Value::Uint).collect(),
        vec![Value::Uint(1 << 32)],
        vec![Value::Uint(1), s("a")],
        vec![Value::Array(vec![Value::Uint(1)])],
    ] {
        match &decode_batch(&with_tokens(bad.clone()), &token_limits)
            .unwrap()
            .events[0]
        {
            Ok(KvEvent::Stored(st)) => {
                assert!(st.bad_tokens && st.token_ids.is_empty(), "{bad:?}");
                assert_eq!(st.block_hashes, vec![BlockHash::Bytes(vec![1; 32])]);
            }
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let long_hash = batch(vec![stored_map(vec![Value::Bin(vec![0; 33])])]);
    assert!(decode_batch(&long_hash, &limits).unwrap().events[0].is_err());
    let mut long_medium = stored_map(vec![hash32(1)]);
    if let Value::Map(entries) = &mut long_medium {
        entries[6].1 = s("a-very-long-medium");
    }
    assert!(decode_batch(&batch(vec![long_medium]), &limits)
        .unwrap()
        .events[0]
        .is_err());
    let big = vec![0x90; 4097];
    assert!(matches!(
        decode_batch(&big, &limits),
        Err(EventError::TooLarge {
            size: 4097,
            limit: 4096
        })
    ));
    // Nesting beyond the limit in a skipped field: the whole payload is refused.
    let mut deep = Value::Uint(0);
    for _ in 0..10 {
        deep = Value::Array(vec![deep]);
    }
    let mut nested = stored_map(vec![hash32(1)]);
    if let Value::Map(entries) = &mut nested {
        entries.push((s("extra_keys"), deep));
    }
    assert!(matches!(
        decode_batch(&batch(vec![nested]), &limits),
        Err(EventError::Msgpack(_))
    ));
    // A list header claiming 2^32 - 1 events in a 10-byte payload: refused from the header.
    let lying = [
        0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0xdd, 0xff, 0xff, 0xff, 0xff,
    ];
    assert!(decode_batch(&lying, &EventLimits::default()).is_err());
}

/// `extra_keys` and `lookahead_token_ids` are noticed, not kept: nil or a list of nils is
/// vLLM's "none"; anything else means the blocks' hashes depend on more than their tokens.
#[test]
fn extra_keys_are_noticed_only_when_some_block_has_one() {
    let with = |field: &str, value: Value| {
        let mut e = stored_map(vec![hash32(1), hash32(2)]);
        if let Value::Map(entries) = &mut e {
            entries.push((s(field), value));
        }
        match &decode_batch(&batch(vec![e]), &EventLimits::default())
            .unwrap()
            .events[0]
        {
            Ok(KvEvent::Stored(s)) => s.has_extra_keys,
            other => panic!("{other:?}"),
        }
    };
    assert!(!with("extra_keys", Value::Nil));
    assert!(!with(
        "extra_keys",
        Value::Array(vec![Value::Nil, Value::Nil])
    ));
    assert!(with(
        "extra_keys",
        Value::Array(vec![Value::Nil, Value::Array(vec![s("salt")])])
    ));
    assert!(with(
        "extra_keys",
        Value::Map(vec![(s("a"), Value::Uint(1))])
    ));
    assert!(!with("lookahead_token_ids", Value::Nil));
    assert!(with(
        "lookahead_token_ids",
        Value::Array(vec![Value::Array(vec![Value::Uint(5)])])
    ));
}

#[test]
fn what_is_not_a_batch_is_one_clear_error() {
    let limits = EventLimits::default();
    for (payload, why) in [
        (Value::Map(vec![]), "not a list"),
        (Value::Array(vec![Value::Float(1.0)]), "not a list"),
        (Value::Array(vec![s("x"), Value::Array(vec![])]), "ts"),
        (
            Value::Array(vec![Value::Float(1.0), Value::Uint(3)]),
            "events",
        ),
        (
            Value::Array(vec![Value::Float(1.0), Value::Array(vec![]), s("rank")]),
            "data_parallel_rank",
        ),
    ] {
        let err = decode_batch(&payload.encode().unwrap(), &limits).unwrap_err();
        assert!(
            matches!(&err, EventError::NotABatch(m) if m.contains(why)),
            "{err}"
        );
    }
    assert!(matches!(
        decode_batch(&[0xc1], &limits),
        Err(EventError::Msgpack(_))
    ));
    assert!(decode_batch(&[], &limits).is_err());
}

fn any_hash() -> impl Strategy<Value = BlockHash> {
    prop_oneof![
        any::<u64>().prop_map(BlockHash::Int),
        proptest::collection::vec(any::<u8>(), 1..=64).prop_map(BlockHash::Bytes),
    ]
}

fn any_event() -> impl Strategy<Value = KvEvent> {
    let name = proptest::option::of("[A-Z]{1,8}");
    prop_oneof![
        (
            proptest::collection::vec(any_hash(), 0..6),
            proptest::option::of(any_hash()),
            any::<u64>(),
            name.clone(),
            proptest::option::of(any::<u32>()),
            name.clone(),
            name.clone(),
            (
                name.clone(),
                proptest::collection::vec(any::<u32>(), 0..40),
                proptest::option::of(any::<i64>()),
            ),
        )
            .prop_map(
                |(
                    block_hashes,
                    parent_block_hash,
                    block_size,
                    medium,
                    group_idx,
                    lora_name,
                    locality,
                    (ownership, token_ids, lora_id),
                )| {
                    KvEvent::Stored(BlockStored {
                        block_hashes,
                        parent_block_hash,
                        token_ids,
                        lora_id,
                        has_extra_keys: false,
                        bad_tokens: false,
                        block_size,
                        medium,
                        group_idx,
                        kv_cache_spec_kind: lora_name.as_ref().map(|n| format!("{n}_kind")),
                        lora_name,
                        locality,
                        ownership,
                    })
                }
            ),
        (
            proptest::collection::vec(any_hash(), 0..6),
            name.clone(),
            proptest::option::of(any::<u32>()),
            name.clone(),
            name,
        )
            .prop_map(|(block_hashes, medium, group_idx, locality, ownership)| {
                KvEvent::Removed(BlockRemoved {
                    block_hashes,
                    medium,
                    group_idx,
                    locality,
                    ownership,
                })
            }),
        Just(KvEvent::AllCleared),
        "[a-z]{1,12}".prop_map(KvEvent::Other),
    ]
}

proptest! {
    #[test]
    fn what_is_encoded_decodes_to_itself(
        events in proptest::collection::vec(any_event(), 0..8),
        ts in -1e12f64..1e12,
        rank in proptest::option::of(-100i64..100),
    ) {
        let payload = encode_batch(ts, &events, rank).unwrap();
        let b = decode_batch(&payload, &EventLimits::default()).unwrap();
        prop_assert_eq!(b.ts, ts);
        prop_assert_eq!(b.data_parallel_rank, rank);
        let back: Vec<KvEvent> = b.events.into_iter().map(Result::unwrap).collect();
        prop_assert_eq!(back, events);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = decode_batch(&bytes, &EventLimits::default());
    }

    #[test]
    fn corrupted_batches_never_panic(
        events in proptest::collection::vec(any_event(), 1..4),
        flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut payload = encode_batch(1.0, &events, Some(0)).unwrap();
        for (at, byte) in flips {
            let i = at.index(payload.len());
            payload[i] = byte;
        }
        let _ = decode_batch(&payload, &EventLimits::default());
    }
}
