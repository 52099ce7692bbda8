//! Any payload: the generic reader agrees with the typed decoder on what is well-formed, and
//! re-encodes what it reads to a value it reads back unchanged.
#![no_main]
use kvpeer_proto::{DecodeLimits, Outcome, Value};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = DecodeLimits::default();
    let generic = Value::decode(data, &limits);
    let typed = kvpeer_proto::decode_with_limits(data, &limits);
    let undecodable = matches!(&typed, Err(e) if e.outcome() == Outcome::Undecodable);
    assert_eq!(generic.is_err(), undecodable);
    if let Ok(value) = generic {
        let bytes = value.encode().expect("a read value encodes");
        let again = Value::decode(&bytes, &limits).expect("re-reads");
        // NaN floats are the one value not equal to itself.
        if !format!("{value:?}").contains("NaN") {
            assert_eq!(again, value);
        }
    }
});
