//! Codec speed: time per message and throughput (bytes/s and keys/s) for decode and encode.
//!
//! Run: `cargo bench -p kvpeer-proto --bench codec`
//!
//! The target (issue 2): a `fetch` of 512 keys decodes and encodes in well under 50 µs. The
//! `fetch_keys` cases at 16 → 512 → 8,192 keys show the cost per key stays flat (linear decode).
//! The `baseline_rmpv` group runs `rmpv`, a general msgpack library, on the same bytes in the
//! same run, as a reference point for the machine's speed.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use divan::counter::{BytesCount, ItemsCount};
use divan::{black_box, Bencher};
use kvpeer_proto::{
    decode, Abort, Connect, Fetch, KvRequestId, Lookup, Message, OffloadKey, PeerId, RoundSeq,
    TransferDone,
};

fn main() {
    divan::main();
}

const KEY_COUNTS: [usize; 4] = [1, 16, 512, 8192];

fn key(i: usize) -> OffloadKey {
    let mut hash = [0u8; 32];
    hash[..8].copy_from_slice(&(i as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15).to_be_bytes());
    hash[31] = i as u8;
    OffloadKey::from_parts(&hash, (i % 3) as u32)
}

fn fetch(keys: usize) -> Message {
    Message::Fetch(Fetch {
        kv_request_id: KvRequestId::from("req-93d2affc3073bc48"),
        keys: (0..keys).map(key).collect(),
        block_indexes: (0..keys as u64).map(|i| i * 7 % 100_000).collect(),
        round_seq: RoundSeq(3),
    })
}

fn small_messages() -> Vec<(&'static str, Message)> {
    vec![
        (
            "connect",
            Message::Connect(Connect {
                peer_id: PeerId::new("10.0.253.230:5717"),
                agent_metadata: vec![0x5a; 182],
                base_addr: 139_694_693_854_864,
                num_blocks: 995_853,
                block_len: 16_384,
                config_fingerprint: Some("2291d8cdc310411e".into()),
                hash_seed: "42".into(),
                kvpeer_auth: None,
            }),
        ),
        (
            "lookup_600",
            Message::Lookup(Lookup {
                kv_request_id: KvRequestId::from("req-5a11494f0a453e8c"),
                keys: (0..600).map(key).collect(),
                round_seq: RoundSeq(0),
            }),
        ),
        (
            "transfer_done",
            Message::TransferDone(TransferDone {
                kv_request_id: KvRequestId::from("req-a16164867fa011e4"),
                success: true,
                round_seq: RoundSeq(127_259),
            }),
        ),
        (
            "abort_fetch",
            Message::AbortFetch(Abort {
                kv_request_id: KvRequestId::from("req-49d8ab518427694d"),
                round_seq: RoundSeq(4),
            }),
        ),
    ]
}

#[divan::bench(args = KEY_COUNTS)]
fn decode_fetch_keys(bencher: Bencher, keys: usize) {
    let payload = fetch(keys).encode().unwrap();
    bencher
        .counter(BytesCount::of_slice(&payload))
        .counter(ItemsCount::new(keys))
        .bench(|| decode(black_box(&payload)).unwrap());
}

#[divan::bench(args = KEY_COUNTS)]
fn encode_fetch_keys(bencher: Bencher, keys: usize) {
    let message = fetch(keys);
    let size = message.encode().unwrap().len();
    let mut out = Vec::with_capacity(size);
    bencher
        .counter(BytesCount::new(size))
        .counter(ItemsCount::new(keys))
        .bench_local(|| {
            out.clear();
            black_box(&message).encode_into(&mut out).unwrap();
            black_box(out.len())
        });
}

#[divan::bench(args = ["connect", "lookup_600", "transfer_done", "abort_fetch"])]
fn decode_message(bencher: Bencher, name: &str) {
    let messages = small_messages();
    let (_, message) = messages.iter().find(|(n, _)| *n == name).unwrap();
    let payload = message.encode().unwrap();
    bencher
        .counter(BytesCount::of_slice(&payload))
        .bench(|| decode(black_box(&payload)).unwrap());
}

#[divan::bench(args = ["connect", "lookup_600", "transfer_done", "abort_fetch"])]
fn encode_message(bencher: Bencher, name: &str) {
    let messages = small_messages();
    let (_, message) = messages.iter().find(|(n, _)| *n == name).unwrap();
    let size = message.encode().unwrap().len();
    let mut out = Vec::with_capacity(size);
    bencher.counter(BytesCount::new(size)).bench_local(|| {
        out.clear();
        black_box(message).encode_into(&mut out).unwrap();
        black_box(out.len())
    });
}

/// Hostile input is cheap: a 4 GiB length claim, and 100,000 nested arrays.
#[divan::bench(args = ["bin32_claims_4gib", "deep_nesting_100k"])]
fn reject_hostile(bencher: Bencher, name: &str) {
    let payload = match name {
        "bin32_claims_4gib" => vec![
            0x81, 0xa4, b't', b'y', b'p', b'e', 0xc6, 0xff, 0xff, 0xff, 0xff,
        ],
        _ => {
            let mut p = vec![0x91u8; 100_000];
            p.push(0xc0);
            p
        }
    };
    bencher
        .counter(BytesCount::of_slice(&payload))
        .bench(|| decode(black_box(&payload)).unwrap_err());
}

/// Same bytes, decoded into a generic value tree and encoded back by `rmpv`.
mod baseline_rmpv {
    use super::*;

    #[divan::bench(args = KEY_COUNTS)]
    fn decode_fetch_keys(bencher: Bencher, keys: usize) {
        let payload = fetch(keys).encode().unwrap();
        bencher
            .counter(BytesCount::of_slice(&payload))
            .counter(ItemsCount::new(keys))
            .bench(|| rmpv::decode::read_value(&mut black_box(payload.as_slice())).unwrap());
    }

    #[divan::bench(args = KEY_COUNTS)]
    fn encode_fetch_keys(bencher: Bencher, keys: usize) {
        let payload = fetch(keys).encode().unwrap();
        let value = rmpv::decode::read_value(&mut payload.as_slice()).unwrap();
        let mut out = Vec::with_capacity(payload.len());
        bencher
            .counter(BytesCount::of_slice(&payload))
            .counter(ItemsCount::new(keys))
            .bench_local(|| {
                out.clear();
                rmpv::encode::write_value(&mut out, black_box(&value)).unwrap();
                black_box(out.len())
            });
    }
}
