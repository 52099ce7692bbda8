//! The tcp plane's frames (HELLO, WRITE and its digest form KVPD, ACK): any bytes never panic a
//! decoder, and a frame that decodes re-encodes to the bytes it came from.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    kvpeer_net::data::tcp::fuzzing::frames(data);
});
