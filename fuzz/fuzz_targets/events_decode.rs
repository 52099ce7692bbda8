//! vLLM KV event batches (`kvpeer_proto::events::decode_batch`): any bytes give a batch or an
//! error, never a panic; what decodes stays within the limits, and a batch that decodes cleanly
//! encodes to bytes that decode to the same events.
#![no_main]

use kvpeer_proto::events::{decode_batch, encode_batch, EventLimits, KvEvent};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let limits = EventLimits::default();
    let Ok(batch) = decode_batch(data, &limits) else {
        return;
    };
    assert!(batch.events.len() <= limits.max_events);
    let events: Vec<KvEvent> = batch.events.into_iter().filter_map(Result::ok).collect();
    for e in &events {
        if let KvEvent::Stored(s) = e {
            assert!(s.block_hashes.len() <= limits.max_hashes);
        }
    }
    // extra keys are noticed, not kept: compare without them.
    let events: Vec<KvEvent> = events
        .into_iter()
        .map(|e| match e {
            KvEvent::Stored(mut s) => {
                assert!(s.token_ids.len() <= limits.max_tokens);
                s.has_extra_keys = false;
                KvEvent::Stored(s)
            }
            other => other,
        })
        .collect();
    let Ok(again) = encode_batch(batch.ts, &events, batch.data_parallel_rank) else {
        return;
    };
    let back = decode_batch(&again, &limits).expect("kvpeer's own encoding decodes");
    let back: Vec<KvEvent> = back.events.into_iter().map(|e| e.expect("clean")).collect();
    assert_eq!(back, events);
});
