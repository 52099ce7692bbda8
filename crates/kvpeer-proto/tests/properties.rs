//! Property tests of the codec.
//!
//! * Any message encodes and decodes back to itself.
//! * Any bytes, and any mutation of a valid payload, decode without panicking into exactly one
//!   outcome, and the outcome agrees with the generic reader: undecodable iff not well-formed.
//! * Decoding a slice at a time (`SlicedDecode`, any number of items a step) gives the same
//!   message or the same error as decoding whole, for valid, mutated and arbitrary payloads,
//!   under tight limits too.
//! * `rmpv`, an independent msgpack implementation, is the oracle for the generic reader and
//!   writer: same values both ways, and the same bytes (both pick the smallest encodings).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvpeer_proto::{
    decode, decode_with_limits, Abort, Connect, ConnectAck, DecodeLimits, Disconnect, Fetch,
    KvRequestId, Lookup, LookupResp, Message, OffloadKey, Outcome, PeerId, RoundSeq, SlicedDecode,
    TransferDone, Value,
};
use proptest::collection::vec;
use proptest::prelude::*;

fn key() -> impl Strategy<Value = OffloadKey> {
    prop_oneof![
        4 => any::<[u8; 36]>().prop_map(|b| OffloadKey::from_bytes(&b)),
        1 => vec(any::<u8>(), 0..80).prop_map(|b| OffloadKey::from_bytes(&b)),
    ]
}

fn id() -> impl Strategy<Value = KvRequestId> {
    prop_oneof![
        "req-[0-9a-f]{16}".prop_map(KvRequestId::from),
        any::<String>().prop_map(KvRequestId::from),
        "r{0,300}".prop_map(KvRequestId::from),
    ]
}

fn round() -> impl Strategy<Value = RoundSeq> {
    prop_oneof![0u64..300, any::<u64>()].prop_map(RoundSeq)
}

fn wide_uint() -> impl Strategy<Value = u64> {
    prop_oneof![0u64..300, 0u64..70_000, any::<u64>()]
}

fn message() -> impl Strategy<Value = Message> {
    let connect = (
        "[0-9.]{1,15}:[0-9]{1,5}",
        vec(any::<u8>(), 0..300),
        wide_uint(),
        wide_uint().prop_map(|v| v.max(1)),
        wide_uint().prop_map(|v| v.max(1)),
        proptest::option::of("[0-9a-f]{0,16}"),
        any::<String>(),
        proptest::option::of(vec(any::<u8>(), 0..80)),
    )
        .prop_map(|(peer, meta, base, blocks, len, fp, seed, auth)| {
            Message::Connect(Connect {
                peer_id: PeerId::new(peer),
                agent_metadata: meta,
                base_addr: base,
                num_blocks: blocks,
                block_len: len,
                config_fingerprint: fp,
                hash_seed: seed,
                kvpeer_auth: auth,
            })
        });
    let pairs = || vec((key(), wide_uint(), any::<bool>()), 0..40);
    prop_oneof![
        connect,
        any::<String>().prop_map(|p| Message::ConnectAck(ConnectAck {
            peer_id: PeerId::new(p)
        })),
        proptest::option::of(any::<String>())
            .prop_map(|kvpeer_reason| Message::Disconnect(Disconnect { kvpeer_reason })),
        (id(), vec(key(), 0..40), round()).prop_map(|(id, keys, r)| Message::Lookup(Lookup {
            kv_request_id: id,
            keys,
            round_seq: r
        })),
        (id(), pairs()).prop_map(|(id, p)| Message::LookupResp(LookupResp {
            kv_request_id: id,
            keys: p.iter().map(|x| x.0.clone()).collect(),
            hits: p.iter().map(|x| x.2).collect(),
        })),
        (id(), pairs(), round()).prop_map(|(id, p, r)| Message::Fetch(Fetch {
            kv_request_id: id,
            keys: p.iter().map(|x| x.0.clone()).collect(),
            block_indexes: p.iter().map(|x| x.1).collect(),
            round_seq: r,
        })),
        (id(), any::<bool>(), round()).prop_map(|(id, s, r)| Message::TransferDone(TransferDone {
            kv_request_id: id,
            success: s,
            round_seq: r
        })),
        (id(), round()).prop_map(|(id, r)| Message::AbortFetch(Abort {
            kv_request_id: id,
            round_seq: r
        })),
        (id(), round()).prop_map(|(id, r)| Message::AbortAck(Abort {
            kv_request_id: id,
            round_seq: r
        })),
    ]
}

/// Decoding `payload` never panics, lands in exactly one outcome, and that outcome agrees with
/// the generic reader; a valid message re-encodes to a payload that decodes to it again.
fn classify_consistently(payload: &[u8]) -> Result<Outcome, TestCaseError> {
    let limits = DecodeLimits::default();
    let typed = decode_with_limits(payload, &limits);
    let generic = Value::decode(payload, &limits);
    let outcome = typed
        .as_ref()
        .map_or_else(|e| e.outcome(), |_| Outcome::Valid);
    prop_assert_eq!(
        outcome == Outcome::Undecodable,
        generic.is_err(),
        "typed {:?} vs generic {:?}",
        typed,
        generic
    );
    if let Ok(m) = typed {
        let again = decode(&m.encode().expect("a decoded message encodes")).expect("re-decodes");
        prop_assert_eq!(again, m);
    }
    Ok(outcome)
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, u8),
    Delete(usize),
    /// Overwrite with a byte that is a msgpack marker with a length (most likely to confuse).
    Marker(usize, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let markers = prop::sample::select(vec![
        0xc4u8, 0xc5, 0xc6, 0xd9, 0xda, 0xdb, 0xdc, 0xdd, 0xde, 0xdf, 0x9f, 0x8f, 0xc1, 0xc3, 0xcf,
        0xd3, 0xc0, 0xbf,
    ]);
    prop_oneof![
        (any::<usize>(), 1u8..=255).prop_map(|(i, x)| Mutation::Flip(i, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
        any::<usize>().prop_map(Mutation::Delete),
        (any::<usize>(), markers).prop_map(|(i, b)| Mutation::Marker(i, b)),
    ]
}

fn apply(payload: &mut Vec<u8>, m: &Mutation) {
    let n = payload.len();
    if n == 0 {
        return;
    }
    match *m {
        Mutation::Flip(i, x) => payload[i % n] ^= x,
        Mutation::Truncate(i) => payload.truncate(i % n),
        Mutation::Insert(i, b) => payload.insert(i % (n + 1), b),
        Mutation::Delete(i) => {
            payload.remove(i % n);
        }
        Mutation::Marker(i, b) => payload[i % n] = b,
    }
}

// ---- the rmpv oracle ----

fn rmpv_value() -> impl Strategy<Value = rmpv::Value> {
    let leaf = prop_oneof![
        Just(rmpv::Value::Nil),
        any::<bool>().prop_map(rmpv::Value::Boolean),
        any::<u64>().prop_map(rmpv::Value::from),
        any::<i64>().prop_map(rmpv::Value::from),
        (-300i64..300).prop_map(rmpv::Value::from),
        any::<f64>()
            .prop_filter("NaN never equals itself", |f| !f.is_nan())
            .prop_map(rmpv::Value::F64),
        any::<String>().prop_map(rmpv::Value::from),
        "r{0,300}".prop_map(rmpv::Value::from),
        vec(any::<u8>(), 0..300).prop_map(rmpv::Value::Binary),
        (any::<i8>(), vec(any::<u8>(), 0..20))
            .prop_filter("timestamps have fixed sizes", |(t, d)| {
                *t != -1 || matches!(d.len(), 4 | 8 | 12)
            })
            .prop_map(|(t, d)| rmpv::Value::Ext(t, d)),
    ];
    leaf.prop_recursive(4, 64, 20, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..20).prop_map(rmpv::Value::Array),
            vec((inner.clone(), inner), 0..18).prop_map(rmpv::Value::Map),
        ]
    })
}

fn from_rmpv(v: &rmpv::Value) -> Value {
    match v {
        rmpv::Value::Nil => Value::Nil,
        rmpv::Value::Boolean(b) => Value::Bool(*b),
        rmpv::Value::Integer(i) => match i.as_u64() {
            Some(u) => Value::Uint(u),
            None => Value::NegInt(i.as_i64().expect("an rmpv int is u64 or i64")),
        },
        rmpv::Value::F32(f) => Value::Float(f64::from(*f)),
        rmpv::Value::F64(f) => Value::Float(*f),
        rmpv::Value::String(s) => Value::Str(s.as_str().expect("generated UTF-8").to_owned()),
        rmpv::Value::Binary(b) => Value::Bin(b.clone()),
        rmpv::Value::Array(items) => Value::Array(items.iter().map(from_rmpv).collect()),
        rmpv::Value::Map(entries) => Value::Map(
            entries
                .iter()
                .map(|(k, v)| (from_rmpv(k), from_rmpv(v)))
                .collect(),
        ),
        rmpv::Value::Ext(t, d) => Value::Ext(*t, d.clone()),
    }
}

/// `payload` decoded `items` items a step: the result, and the steps it took.
fn sliced(
    payload: &[u8],
    limits: &DecodeLimits,
    items: usize,
) -> (Result<Message, kvpeer_proto::DecodeError>, usize) {
    let mut decode = SlicedDecode::new(payload.to_vec(), *limits);
    let mut steps = 0;
    loop {
        steps += 1;
        if let Some(result) = decode.step(items) {
            assert!(decode.is_finished());
            assert_eq!(decode.step(items), None, "nothing after the result");
            return (result, steps);
        }
    }
}

/// Limits tight enough that generated payloads hit them.
fn limits() -> impl Strategy<Value = DecodeLimits> {
    prop_oneof![
        3 => Just(DecodeLimits::default()),
        1 => (0usize..600, 0usize..6, 0usize..40).prop_map(|(bytes, depth, list)| DecodeLimits {
            max_payload_bytes: bytes,
            max_depth: depth,
            max_list_len: list,
        }),
    ]
}

fn agrees_sliced(payload: &[u8], limits: &DecodeLimits, items: usize) -> Result<(), TestCaseError> {
    let whole = decode_with_limits(payload, limits);
    let (result, _) = sliced(payload, limits, items);
    prop_assert_eq!(result, whole);
    Ok(())
}

#[test]
fn a_lookup_of_the_most_keys_is_decoded_in_many_small_steps_to_the_same_message() {
    let lookup = Message::Lookup(Lookup {
        kv_request_id: KvRequestId::from("req-big"),
        keys: (0..1u32 << 17)
            // ASCII bytes, so a key's bin turned into a str below is still valid UTF-8.
            .map(|i| OffloadKey::from_parts(&[b'a' + (i % 26) as u8; 32], 0x3030_3030))
            .collect(),
        round_seq: RoundSeq(3),
    });
    let bytes = lookup.encode().unwrap();
    let (result, steps) = sliced(&bytes, &DecodeLimits::default(), 4096);
    assert_eq!(result.unwrap(), lookup);
    // The walk over 131,075 items and the read of 131,072 keys, 4,096 a step.
    assert_eq!(steps, (131_075usize + 131_072).div_ceil(4096));
    // A key of the wrong type far down the list is the same protocol error, found as late.
    let mut bad = bytes.clone();
    let last = OffloadKey::from_parts(&[b'a' + (131_071 % 26) as u8; 32], 0x3030_3030);
    let mut framed = vec![0xc4, 36]; // bin 8 of 36 bytes
    framed.extend_from_slice(last.as_bytes());
    let at = bytes
        .windows(framed.len())
        .rposition(|w| w == framed.as_slice())
        .unwrap();
    bad[at] = 0xd9; // str 8 of the same length
    let whole = decode(&bad).unwrap_err();
    assert!(whole.to_string().contains("keys[131071]"), "{whole}");
    assert_eq!(
        sliced(&bad, &DecodeLimits::default(), 4096).0.unwrap_err(),
        whole
    );
}

#[test]
fn what_a_sliced_decode_holds_counts_a_lists_room_from_its_header_on() {
    // 131,072 empty keys: 263 KB of payload that decode to about 6 MiB of keys.
    let lookup = Message::Lookup(Lookup {
        kv_request_id: KvRequestId::from("r"),
        keys: vec![OffloadKey::from_bytes(&[]); 1 << 17],
        round_seq: RoundSeq(0),
    });
    let bytes = lookup.encode().unwrap();
    let mut decode = SlicedDecode::new(bytes.clone(), DecodeLimits::default());
    // The walk (131,075 items) holds only the payload (twice: keys too long to be inline
    // would spill their bytes); the step that ends it reads the list's header, and from then
    // on the whole list's room counts, though few keys were read yet.
    for _ in 0..131_075usize / 2048 {
        assert_eq!(decode.step(2048), None);
        assert_eq!(
            decode.held_bytes(),
            2 * bytes.len(),
            "the walk holds only the payload"
        );
    }
    assert_eq!(decode.step(2048), None);
    let room = decode.held_bytes() - 2 * bytes.len();
    assert!(
        room >= (1 << 17) * 24,
        "the list's room is counted at its header: {room} bytes"
    );
    loop {
        assert_eq!(
            decode.held_bytes(),
            2 * bytes.len() + room,
            "no growth after"
        );
        if let Some(result) = decode.step(2048) {
            assert_eq!(result.unwrap(), lookup);
            break;
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn sliced_decoding_agrees_on_valid_messages(m in message(), items in 1usize..64, limits in limits()) {
        agrees_sliced(&m.encode().expect("generated messages are valid"), &limits, items)?;
    }

    #[test]
    fn sliced_decoding_agrees_on_mutated_payloads(
        m in message(),
        mutations in vec(mutation(), 1..4),
        items in 1usize..16,
        limits in limits(),
    ) {
        let mut bytes = m.encode().expect("generated messages are valid");
        for mutation in &mutations {
            apply(&mut bytes, mutation);
        }
        agrees_sliced(&bytes, &limits, items)?;
    }

    #[test]
    fn sliced_decoding_agrees_on_arbitrary_maps_and_bytes(
        fields in vec(("[a-z_]{1,14}", rmpv_value()), 0..8),
        bytes in vec(any::<u8>(), 0..256),
        items in 1usize..8,
        limits in limits(),
    ) {
        let mut map_bytes = Vec::new();
        let map = rmpv::Value::Map(
            fields.into_iter().map(|(k, v)| (rmpv::Value::from(k), v)).collect(),
        );
        rmpv::encode::write_value(&mut map_bytes, &map).expect("encodes");
        agrees_sliced(&map_bytes, &limits, items)?;
        agrees_sliced(&bytes, &limits, items)?;
    }

    #[test]
    fn any_message_roundtrips(m in message()) {
        let bytes = m.encode().expect("generated messages are valid");
        prop_assert_eq!(decode(&bytes).expect("decodes"), m.clone());
        // The generic view of the same bytes re-encodes to the same bytes.
        let generic = Value::decode(&bytes, &DecodeLimits::default()).expect("well-formed");
        prop_assert_eq!(generic.encode().expect("encodes"), bytes);
    }

    #[test]
    fn arbitrary_bytes_are_classified(bytes in vec(any::<u8>(), 0..512)) {
        classify_consistently(&bytes)?;
    }

    #[test]
    fn arbitrary_maps_are_classified(fields in vec(("[a-z_]{1,14}", rmpv_value()), 0..8)) {
        // Maps whose keys look like field names reach the typed checks far more often than
        // random bytes do.
        let mut bytes = Vec::new();
        let map = rmpv::Value::Map(
            fields.into_iter().map(|(k, v)| (rmpv::Value::from(k), v)).collect(),
        );
        rmpv::encode::write_value(&mut bytes, &map).expect("encodes");
        classify_consistently(&bytes)?;
    }

    #[test]
    fn mutated_valid_payloads_are_classified(
        m in message(),
        mutations in vec(mutation(), 1..4),
    ) {
        let mut bytes = m.encode().expect("generated messages are valid");
        for mutation in &mutations {
            apply(&mut bytes, mutation);
        }
        classify_consistently(&bytes)?;
    }

    #[test]
    fn generic_reader_matches_rmpv(v in rmpv_value()) {
        let mut bytes = Vec::new();
        rmpv::encode::write_value(&mut bytes, &v).expect("encodes");
        let ours = Value::decode(&bytes, &DecodeLimits::default()).expect("rmpv output is valid");
        prop_assert_eq!(&ours, &from_rmpv(&v));
        // Both writers pick the smallest encodings, so the bytes agree too.
        prop_assert_eq!(ours.encode().expect("encodes"), bytes.clone());
        let back = rmpv::decode::read_value(&mut bytes.as_slice()).expect("rmpv reads ours");
        prop_assert_eq!(back, v);
    }
}
