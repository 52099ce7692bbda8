//! Any payload: decoding never panics, and a valid message re-encodes to bytes that decode to it.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = kvpeer_proto::decode(data) {
        let bytes = message.encode().expect("a decoded message is valid");
        assert_eq!(kvpeer_proto::decode(&bytes).ok(), Some(message));
    }
});
