//! Any valid message: its JSON form converts back to the same message.
#![no_main]
use kvpeer_proto::json::{message_from_json, message_to_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = kvpeer_proto::decode(data) {
        let json = message_to_json(&message).expect("a valid message has a JSON form");
        assert_eq!(message_from_json(&json).ok(), Some(message));
    }
});
