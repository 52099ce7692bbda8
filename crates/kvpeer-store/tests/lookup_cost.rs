//! What an inbound lookup of N keys costs the core's thread against the real store (docs/
//! security.md, G7: the numbers behind `lookup_slice_keys` and `max_lookup_keys`). Ignored by
//! default (a measurement, not a check); run in release:
//!
//! `cargo test --release -p kvpeer-store --test lookup_cost -- --ignored --nocapture`

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kvpeer_core::{
    BlockIndex, CancelMode, Core, CoreConfig, DataPlane, LocalNode, PlaneError, PlanePoll,
    Registration, RemoteMemory, TransferId,
};
use kvpeer_proto::{Connect, ConnectAck, Lookup, Message, OffloadKey, PeerId, RoundSeq};
use kvpeer_store::{BlockStore, Pool};

/// A data plane that registers everyone and never writes (lookups need none).
struct NoPlane;

impl DataPlane for NoPlane {
    fn add_remote_peer(&mut self, _: &PeerId, _: &RemoteMemory) -> Result<(), PlaneError> {
        Ok(())
    }
    fn registration(&mut self, _: &PeerId) -> Registration {
        Registration::Done
    }
    fn remove_remote_peer(&mut self, _: &PeerId) {}
    fn write_blocks(
        &mut self,
        _: &PeerId,
        _: &[BlockIndex],
        _: &[BlockIndex],
    ) -> Option<TransferId> {
        None
    }
    fn poll(&mut self, _: &PeerId) -> PlanePoll {
        PlanePoll::default()
    }
    fn cancel(&mut self, _: &[TransferId], _: CancelMode) -> Vec<TransferId> {
        Vec::new()
    }
}

fn key(i: u64) -> OffloadKey {
    let mut hash = [0u8; 32];
    hash[..8].copy_from_slice(&i.to_be_bytes());
    OffloadKey::from_parts(&hash, 0)
}

#[test]
#[ignore = "a measurement: run in release with --ignored --nocapture"]
fn cost_of_a_lookup_of_n_keys() {
    let (blocks, block_len) = (65_536u64, 4096u64);
    let mut store =
        BlockStore::with_pool(Pool::anonymous(blocks, block_len, false).unwrap()).unwrap();
    let bytes = vec![7u8; block_len as usize];
    for i in 0..blocks {
        store.put(&key(i), &bytes).unwrap();
    }
    let local = LocalNode {
        peer_id: PeerId::new("127.0.0.1:1"),
        agent_metadata: Vec::new(),
        base_addr: 0,
        num_blocks: blocks,
        block_len,
        config_fingerprint: String::new(),
        hash_seed: "s".into(),
    };
    let config = CoreConfig {
        max_lookup_keys: 1 << 20,
        max_pins_per_peer: Some(1 << 20),
        ..CoreConfig::default()
    };
    let slice = config.lookup_slice_keys;
    let now = Instant::now();
    let mut core = Core::new(config, local, store, NoPlane, now);
    let peer = PeerId::new("127.0.0.1:2");
    assert!(core.handle_inbound(now, peer.clone()));
    let connect = Message::Connect(Connect {
        peer_id: peer.clone(),
        agent_metadata: Vec::new(),
        base_addr: 0,
        num_blocks: 64,
        block_len,
        config_fingerprint: Some(String::new()),
        hash_seed: "s".into(),
        kvpeer_auth: None,
    });
    core.handle_message(now, &peer, connect);
    core.handle_message(
        now,
        &peer,
        Message::ConnectAck(ConnectAck {
            peer_id: peer.clone(),
        }),
    );
    while core.poll_transmit().is_some() {}

    println!("keys    hit-share  decode    first slice  all slices  answer   per key asked");
    let mut t = now;
    for (r, (n, hit_share)) in [
        (4096u64, 1.0),
        (65_536, 1.0),
        (65_536, 0.0),
        (1 << 20, 0.0625),
    ]
    .into_iter()
    .enumerate()
    {
        let held = (n as f64 * hit_share) as u64;
        let keys: Vec<OffloadKey> = (0..n)
            .map(|i| {
                if i < held {
                    key(i % blocks)
                } else {
                    key(1 << 40 | i)
                }
            })
            .collect();
        let payload = Message::Lookup(Lookup {
            kv_request_id: format!("r{r}").as_str().into(),
            keys,
            round_seq: RoundSeq(0),
        })
        .encode()
        .unwrap();
        t += Duration::from_secs(2);
        let started = Instant::now();
        let decoded = kvpeer_proto::decode(&payload).unwrap();
        let decode = started.elapsed();
        let started = Instant::now();
        core.handle_message(t, &peer, decoded);
        let first = started.elapsed();
        let mut answered = None;
        let started = Instant::now();
        let mut slices = 1;
        while answered.is_none() {
            while let Some(tx) = core.poll_transmit() {
                if let Message::LookupResp(resp) = tx.message {
                    answered = Some(resp);
                }
            }
            if answered.is_none() {
                core.handle_timeout(t);
                slices += 1;
            }
        }
        let rest = started.elapsed();
        let started = Instant::now();
        let encoded = Message::LookupResp(answered.unwrap()).encode().unwrap();
        let answer = started.elapsed();
        let asked = first + rest;
        println!(
            "{n:>7}  {hit_share:>9}  {decode:>8.1?}  {first:>11.1?}  {rest:>10.1?}  {answer:>7.1?}  {:.3} us ({slices} slices of {slice}, answer {} B)",
            asked.as_secs_f64() * 1e6 / n as f64,
            encoded.len()
        );
        // Let the pins go before the next round.
        t += Duration::from_secs(60);
        core.handle_timeout(t);
        while core.poll_transmit().is_some() {}
    }
}
