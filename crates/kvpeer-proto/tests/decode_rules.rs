//! The decoding rules one by one: what vLLM accepts, what kvpeer refuses on top, the limits,
//! and the precision of error messages. Payloads are written in JSON form for readability.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvpeer_proto::json::payload_from_json;
use kvpeer_proto::{
    decode, decode_with_limits, DecodeError, DecodeLimits, Disconnect, EncodeError, Fetch,
    FieldError, FieldPath, IgnoredReason, KvRequestId, Message, MessageType, MsgpackErrorKind,
    OffloadKey, Outcome, ProtocolError, RoundSeq,
};
use serde_json::json;

fn bytes(doc: serde_json::Value) -> Vec<u8> {
    payload_from_json(&doc).unwrap()
}

fn protocol_error(payload: &[u8]) -> ProtocolError {
    match decode(payload) {
        Err(DecodeError::Protocol(e)) => e,
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

fn fetch_json() -> serde_json::Value {
    json!({"type": "fetch", "kv_request_id": "req-1",
           "keys": [{"$bin": "00".repeat(36)}, {"$bin": "11".repeat(36)}],
           "block_indexes": [3, 4], "round_seq": 1})
}

#[test]
fn duplicate_fields_keep_the_last_like_a_dict() {
    let mut payload = vec![0x83];
    payload.extend(bytes(json!("type")));
    payload.extend(bytes(json!("abort_ack")));
    payload.extend(bytes(json!("kv_request_id")));
    payload.extend(bytes(json!("first")));
    payload.extend(bytes(json!("round_seq")));
    payload.extend(bytes(json!(2)));
    payload[0] = 0x84;
    payload.extend(bytes(json!("kv_request_id")));
    payload.extend(bytes(json!("second")));
    match decode(&payload).unwrap() {
        Message::AbortAck(a) => assert_eq!(a.kv_request_id.as_str(), "second"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_fields_of_any_shape_are_ignored() {
    let mut doc = fetch_json();
    doc["trace"] = json!({"spans": [1, -2, 3.5, null, {"$bin": "ff"}, {"deep": [[[]]]}]});
    doc["auth"] = json!({"$ext": [5, "0102"]});
    assert!(matches!(decode(&bytes(doc)).unwrap(), Message::Fetch(_)));
    let extra = bytes(json!({"type": "disconnect", "reason": "bye", "n": 7}));
    assert_eq!(decode(&extra).unwrap(), Message::DISCONNECT);
}

/// kvpeer's `kvpeer_reason` on a refusal's `disconnect`: read back exactly, written after
/// `type`; without it the bytes are vLLM's (`{"type": "disconnect"}`), and a reason that is not
/// a str is a protocol error like any known field of the wrong type.
#[test]
fn a_disconnect_carries_kvpeers_reason_and_is_vllms_without_it() {
    let said = "block_len differs: yours 8192, mine 4096";
    let with = Message::Disconnect(Disconnect {
        kvpeer_reason: Some(said.to_owned()),
    });
    let encoded = with.encode().unwrap();
    assert_eq!(
        encoded,
        bytes(json!({"type": "disconnect", "kvpeer_reason": said}))
    );
    assert_eq!(decode(&encoded).unwrap(), with);
    assert_eq!(
        Message::DISCONNECT.encode().unwrap(),
        bytes(json!({"type": "disconnect"}))
    );
    let wrong = bytes(json!({"type": "disconnect", "kvpeer_reason": 7}));
    assert!(decode(&wrong).is_err());
}

#[test]
fn a_fault_in_an_unknown_field_still_makes_the_payload_undecodable() {
    // msgspec decodes the whole payload first, so invalid UTF-8 anywhere is fatal.
    let mut payload = bytes(json!({"type": "disconnect", "x": "ab"}));
    let len = payload.len();
    payload[len - 2] = 0xff;
    assert_eq!(
        decode(&payload).unwrap_err().outcome(),
        Outcome::Undecodable
    );
}

#[test]
fn ints_are_accepted_in_any_encoding() {
    // round_seq 5 as int8 (signed marker, positive value), as vLLM's msgspec would accept.
    let mut payload = bytes(json!({"type": "abort_fetch", "kv_request_id": "r"}));
    payload[0] = 0x83;
    payload.extend(bytes(json!("round_seq")));
    payload.extend([0xd0, 0x05]);
    match decode(&payload).unwrap() {
        Message::AbortFetch(a) => assert_eq!(a.round_seq, RoundSeq(5)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn u64_addresses_above_i64_survive() {
    let doc = json!({"type": "connect", "peer_id": "10.0.0.1:5710", "agent_metadata": {"$bin": ""},
                     "base_addr": u64::MAX, "num_blocks": 1, "block_len": 16, "hash_seed": "0"});
    match decode(&bytes(doc)).unwrap() {
        Message::Connect(c) => {
            assert_eq!(c.base_addr, u64::MAX);
            assert_eq!(c.config_fingerprint, None);
            assert_eq!(c.fingerprint(), "");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn errors_name_message_field_index_and_reason() {
    let mut doc = fetch_json();
    doc["block_indexes"] = json!([3, -4]);
    let e = protocol_error(&bytes(doc));
    assert_eq!(e.message_type, MessageType::Fetch);
    assert_eq!(e.field, FieldPath::element("block_indexes", 1));
    assert_eq!(e.reason, FieldError::Negative(-4));
    assert_eq!(
        e.to_string(),
        "fetch: block_indexes[1]: expected a non-negative int, got -4"
    );

    let mut doc = fetch_json();
    doc["keys"][1] = json!("not-bytes");
    let e = protocol_error(&bytes(doc));
    assert_eq!(e.to_string(), "fetch: keys[1]: expected bin, got str");

    let doc = json!({"type": "connect", "peer_id": "h:1", "agent_metadata": {"$bin": ""},
                     "base_addr": 0, "num_blocks": -3, "block_len": 16, "hash_seed": "0"});
    let e = protocol_error(&bytes(doc));
    assert_eq!(
        e.to_string(),
        "connect: num_blocks: expected a positive int, got -3"
    );
}

#[test]
fn kvpeer_is_stricter_than_vllm_where_vllm_is_lenient_by_accident() {
    // bool as int: Python's isinstance(True, int) is True; kvpeer refuses.
    let mut doc = fetch_json();
    doc["block_indexes"] = json!([true, 4]);
    assert_eq!(
        protocol_error(&bytes(doc)).reason,
        FieldError::WrongType {
            expected: "int",
            got: "bool"
        }
    );
    // A config_fingerprint that is present must be a str.
    let doc = json!({"type": "connect", "peer_id": "h:1", "agent_metadata": {"$bin": ""},
                     "base_addr": 0, "num_blocks": 1, "block_len": 16, "hash_seed": "0",
                     "config_fingerprint": 5});
    assert_eq!(
        protocol_error(&bytes(doc)).field,
        FieldPath::field("config_fingerprint")
    );
}

#[test]
fn ignored_payloads_say_why() {
    let cases = [
        (json!([1, 2]), IgnoredReason::NotAMap("array")),
        (json!({"kind": "x"}), IgnoredReason::MissingType),
        (json!({"type": 5}), IgnoredReason::TypeNotStr("int")),
        (
            json!({"type": "hello"}),
            IgnoredReason::UnknownType("hello".into()),
        ),
    ];
    for (doc, reason) in cases {
        assert_eq!(decode(&bytes(doc)), Err(DecodeError::Ignored(reason)));
    }
    let long = "t".repeat(1000);
    match decode(&bytes(json!({ "type": long }))) {
        Err(DecodeError::Ignored(IgnoredReason::UnknownType(quoted))) => {
            assert_eq!(quoted.len(), 64)
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn payload_limit_is_checked_first() {
    let payload = bytes(fetch_json());
    let limits = DecodeLimits {
        max_payload_bytes: payload.len() - 1,
        ..DecodeLimits::default()
    };
    let err = decode_with_limits(&payload, &limits).unwrap_err();
    match err {
        DecodeError::Undecodable(e) => assert_eq!(
            e.kind,
            MsgpackErrorKind::TooLarge {
                size: payload.len(),
                limit: payload.len() - 1
            }
        ),
        other => panic!("{other:?}"),
    }
    let exact = DecodeLimits {
        max_payload_bytes: payload.len(),
        ..DecodeLimits::default()
    };
    assert!(decode_with_limits(&payload, &exact).is_ok());
}

#[test]
fn list_limit_is_a_protocol_error_before_allocation() {
    let limits = DecodeLimits {
        max_list_len: 1,
        ..DecodeLimits::default()
    };
    let err = decode_with_limits(&bytes(fetch_json()), &limits).unwrap_err();
    match err {
        DecodeError::Protocol(e) => {
            assert_eq!(e.reason, FieldError::TooManyEntries { len: 2, limit: 1 })
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn depth_limit_applies_to_unknown_fields() {
    let mut doc = json!({"type": "disconnect"});
    let mut nested = json!(0);
    for _ in 0..10 {
        nested = json!([nested]);
    }
    doc["x"] = nested;
    let payload = bytes(doc);
    assert!(decode(&payload).is_ok());
    let shallow = DecodeLimits {
        max_depth: 8,
        ..DecodeLimits::default()
    };
    let err = decode_with_limits(&payload, &shallow).unwrap_err();
    assert!(
        matches!(&err, DecodeError::Undecodable(e) if e.kind == MsgpackErrorKind::TooDeep { limit: 8 }),
        "{err}"
    );
}

#[test]
fn encode_refuses_what_a_peer_must_reject_and_writes_nothing() {
    let bad = Message::Fetch(Fetch {
        kv_request_id: KvRequestId::from("r"),
        keys: vec![OffloadKey::from_parts(&[1; 32], 0)],
        block_indexes: vec![],
        round_seq: RoundSeq(0),
    });
    let mut out = vec![0xaa];
    let err = bad.encode_into(&mut out).unwrap_err();
    assert!(matches!(err, EncodeError::Invalid(_)), "{err}");
    assert_eq!(out, [0xaa], "a refused message leaves the buffer as it was");
}

#[test]
fn terminal_fetch_is_recognised() {
    let doc = json!({"type": "fetch", "kv_request_id": "r", "keys": [], "block_indexes": [],
                     "round_seq": 4});
    match decode(&bytes(doc)).unwrap() {
        Message::Fetch(f) => assert!(f.is_terminal()),
        other => panic!("{other:?}"),
    }
    match decode(&bytes(fetch_json())).unwrap() {
        Message::Fetch(f) => assert!(!f.is_terminal()),
        other => panic!("{other:?}"),
    }
}

/// An edit of a `connect` message's fields.
type Tweak = Box<dyn FnOnce(&mut serde_json::Map<String, serde_json::Value>)>;

fn connect_json() -> serde_json::Value {
    json!({"type": "connect", "peer_id": "10.0.0.1:5710", "agent_metadata": {"$bin": "0a0b"},
           "base_addr": 4096, "num_blocks": 8, "block_len": 16384,
           "config_fingerprint": "2291d8cdc310411e", "hash_seed": "42"})
}

fn connect_error(
    tweak: impl FnOnce(&mut serde_json::Map<String, serde_json::Value>),
) -> ProtocolError {
    let mut doc = connect_json();
    tweak(doc.as_object_mut().unwrap());
    protocol_error(&bytes(doc))
}

/// upstream: TestConnectMsgValidation.test_valid_message_passes
/// upstream: TestConnectMsgValidation.test_missing_peer_id
/// upstream: TestConnectMsgValidation.test_missing_agent_metadata
/// upstream: TestConnectMsgValidation.test_agent_metadata_wrong_type
/// upstream: TestConnectMsgValidation.test_base_addr_negative
/// upstream: TestConnectMsgValidation.test_num_blocks_zero
/// upstream: TestConnectMsgValidation.test_block_len_zero
/// upstream: TestConnectMsgValidation.test_missing_hash_seed
/// upstream: TestConnectMsgValidation.test_hash_seed_wrong_type
#[test]
fn connect_validation_matches_protocol_py() {
    assert!(matches!(
        decode(&bytes(connect_json())).unwrap(),
        Message::Connect(_)
    ));
    let cases: Vec<(Tweak, &str, FieldError)> = vec![
        (
            Box::new(|m| {
                m.remove("peer_id");
            }),
            "peer_id",
            FieldError::Missing,
        ),
        (
            Box::new(|m| {
                m.remove("agent_metadata");
            }),
            "agent_metadata",
            FieldError::Missing,
        ),
        (
            Box::new(|m| {
                m.insert("agent_metadata".into(), json!("text"));
            }),
            "agent_metadata",
            FieldError::WrongType {
                expected: "bin",
                got: "str",
            },
        ),
        (
            Box::new(|m| {
                m.insert("base_addr".into(), json!(-1));
            }),
            "base_addr",
            FieldError::Negative(-1),
        ),
        (
            Box::new(|m| {
                m.insert("num_blocks".into(), json!(0));
            }),
            "num_blocks",
            FieldError::NotPositive(0),
        ),
        (
            Box::new(|m| {
                m.insert("block_len".into(), json!(0));
            }),
            "block_len",
            FieldError::NotPositive(0),
        ),
        (
            Box::new(|m| {
                m.remove("hash_seed");
            }),
            "hash_seed",
            FieldError::Missing,
        ),
        (
            Box::new(|m| {
                m.insert("hash_seed".into(), json!(42));
            }),
            "hash_seed",
            FieldError::WrongType {
                expected: "str",
                got: "int",
            },
        ),
    ];
    for (tweak, field, reason) in cases {
        let e = connect_error(tweak);
        assert_eq!(
            (e.message_type, e.field.name, &e.reason),
            (MessageType::Connect, field, &reason)
        );
    }
}

/// upstream: TestFetchMsgValidation.test_valid_message_passes
/// upstream: TestFetchMsgValidation.test_length_mismatch
/// upstream: TestFetchMsgValidation.test_negative_index
/// upstream: TestTransferDoneMsgValidation.test_valid_message_passes
/// upstream: TestTransferDoneMsgValidation.test_success_wrong_type
#[test]
fn fetch_and_transfer_done_validation_matches_protocol_py() {
    assert!(matches!(
        decode(&bytes(fetch_json())).unwrap(),
        Message::Fetch(_)
    ));
    let mut doc = fetch_json();
    doc["block_indexes"] = json!([3]);
    assert!(matches!(
        protocol_error(&bytes(doc)).reason,
        FieldError::LengthMismatch {
            len: 1,
            other_len: 2,
            ..
        }
    ));
    let mut doc = fetch_json();
    doc["block_indexes"] = json!([3, -1]);
    assert_eq!(protocol_error(&bytes(doc)).reason, FieldError::Negative(-1));
    let done =
        json!({"type": "transfer_done", "kv_request_id": "r", "success": true, "round_seq": 3});
    assert!(matches!(
        decode(&bytes(done.clone())).unwrap(),
        Message::TransferDone(_)
    ));
    let mut bad = done;
    bad["success"] = json!(1);
    let e = protocol_error(&bytes(bad));
    assert_eq!(
        (e.field.name, e.reason),
        (
            "success",
            FieldError::WrongType {
                expected: "bool",
                got: "int"
            }
        )
    );
}
