//! A peer's `agent_metadata` (the planes it offers, its tcp key, whether its listener takes
//! TLS): any bytes never panic, and a map that decodes re-encodes to bytes that decode to it.
#![no_main]
use kvpeer_net::data::metadata::AgentMetadata;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(meta) = AgentMetadata::decode(data) {
        let again = AgentMetadata::decode(&meta.encode()).expect("an encoded map decodes");
        assert_eq!(again, meta);
    }
});
