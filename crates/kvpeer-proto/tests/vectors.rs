//! Every wire vector through the library: one test per vector, so the count shows.
//!
//! Valid vectors must decode to their message, re-encode to their exact bytes when marked
//! `roundtrip`, and their JSON form must give back their exact bytes (field order kept). Every
//! other vector must fail with exactly the outcome it names.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use kvpeer_proto::json::{message_from_json, payload_from_json, payload_to_json};
use kvpeer_proto::{decode, DecodeLimits, Outcome, SlicedDecode};
use libtest_mimic::Failed;
use support::vectors::{self, Vector};

fn check(v: &Vector) -> Result<(), Failed> {
    let decoded = decode(&v.payload);
    // Decoded a few items at a time, every vector gives the same message or the same error.
    for items in [1, 2, 7] {
        let mut sliced = SlicedDecode::new(v.payload.clone(), DecodeLimits::default());
        let result = loop {
            if let Some(result) = sliced.step(items) {
                break result;
            }
        };
        if result != decoded {
            return Err(
                format!("decoded {items} items a step: {result:?}\n  whole: {decoded:?}").into(),
            );
        }
    }
    if v.expect != Outcome::Valid {
        let err = match decoded {
            Ok(m) => return Err(format!("expected {}, decoded {m:?}", v.expect).into()),
            Err(e) => e,
        };
        if err.outcome() != v.expect {
            return Err(format!("expected {}, got {}: {err}", v.expect, err.outcome()).into());
        }
        if err.to_string().len() < 20 {
            return Err(format!("error too terse to help anyone: {err}").into());
        }
        return Ok(());
    }
    let message_json = v.message.as_ref().ok_or("valid vector without a message")?;
    let decoded = decoded.map_err(|e| format!("expected valid, got {}: {e}", e.outcome()))?;
    let expected = message_from_json(message_json).map_err(|e| format!("vector message: {e}"))?;
    if decoded != expected {
        return Err(format!("decoded {decoded:?}\n  expected {expected:?}").into());
    }
    if v.roundtrip {
        let encoded = hex::encode(decoded.encode()?);
        if encoded != v.hex {
            return Err(format!("encoded {encoded}\n  expected {}", v.hex).into());
        }
    }
    // The JSON form keeps field order and unknown fields, so it gives the exact bytes back.
    let from_json = hex::encode(payload_from_json(message_json)?);
    if from_json != v.hex {
        return Err(format!("JSON form encoded {from_json}\n  expected {}", v.hex).into());
    }
    let as_json = payload_to_json(&v.payload, &DecodeLimits::default())?;
    if &as_json != message_json {
        return Err(format!("payload as JSON {as_json}\n  expected {message_json}").into());
    }
    Ok(())
}

fn main() {
    vectors::run_each("vector", check)
}
