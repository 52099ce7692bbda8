//! The follower driven deterministically (no sockets, a made-up clock): late joins, gaps,
//! restarts, short replay buffers, timeouts, malformed input, bounded holding, and order.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kvpeer_pool::{
    Admission, EngineSlot, FollowAction, Follower, FollowerLimits, Holdings, PullCandidate,
};
use kvpeer_proto::events::{encode_batch, BlockHash, BlockRemoved, BlockStored, KvEvent};
use kvpeer_proto::OffloadKey;

fn hash(i: u32) -> Vec<u8> {
    let mut h = vec![0xAB; 28];
    h.extend_from_slice(&i.to_be_bytes());
    h
}

fn key(i: u32) -> OffloadKey {
    OffloadKey::from_parts(&hash(i), 0)
}

fn store(i: u32) -> KvEvent {
    KvEvent::Stored(BlockStored {
        block_hashes: vec![BlockHash::Bytes(hash(i))],
        medium: Some("CPU".into()),
        group_idx: Some(0),
        ..BlockStored::default()
    })
}

fn remove(i: u32) -> KvEvent {
    KvEvent::Removed(BlockRemoved {
        block_hashes: vec![BlockHash::Bytes(hash(i))],
        medium: Some("CPU".into()),
        group_idx: Some(0),
        ..BlockRemoved::default()
    })
}

fn batch(events: &[KvEvent]) -> Vec<u8> {
    encode_batch(1.0, events, Some(0)).unwrap()
}

/// Batch `seq` of the test streams: it stores key `seq`.
fn stores(seq: u64) -> Vec<u8> {
    batch(&[store(seq as u32)])
}

fn pulls(actions: &[FollowAction]) -> Vec<OffloadKey> {
    actions
        .iter()
        .filter_map(|a| match a {
            FollowAction::Pull(PullCandidate { key, .. }) => Some(key.clone()),
            FollowAction::Replay { .. } => None,
        })
        .collect()
}

struct Rig {
    now: Instant,
    follower: Follower,
    holdings: Holdings,
    slot: EngineSlot,
}

impl Rig {
    fn new(can_replay: bool, limits: FollowerLimits) -> Self {
        let slot = EngineSlot::new(2).unwrap();
        Rig {
            now: Instant::now(),
            follower: Follower::new(slot, limits, can_replay),
            holdings: Holdings::new(100_000, Admission::default()),
            slot,
        }
    }

    fn live(&mut self, seq: u64, payload: Vec<u8>) -> Vec<FollowAction> {
        self.follower
            .live(self.now, seq, payload, &mut self.holdings)
    }

    fn replayed(&mut self, seq: u64, payload: Vec<u8>) -> Vec<FollowAction> {
        self.follower.replayed(seq, &payload, &mut self.holdings)
    }

    fn held(&self, i: u32) -> bool {
        self.holdings.holds(self.slot, &key(i))
    }
}

#[test]
fn a_late_joiner_replays_from_zero_then_applies_what_came_live_meanwhile() {
    let mut rig = Rig::new(true, FollowerLimits::default());
    assert_eq!(
        rig.follower.connected(rig.now),
        vec![FollowAction::Replay { from: 0 }]
    );
    // Live batch 5 arrives before the replay: held, not applied.
    assert!(rig.live(5, stores(5)).is_empty());
    assert!(!rig.held(5));
    let mut pulled = Vec::new();
    for seq in 0..5 {
        pulled.extend(pulls(&rig.replayed(seq, stores(seq))));
    }
    pulled.extend(pulls(&rig.follower.replay_end(&mut rig.holdings)));
    assert_eq!(pulled, (0..6).map(key).collect::<Vec<_>>());
    assert_eq!(rig.follower.next_seq(), 6);
    let s = rig.follower.stats();
    assert_eq!(
        (s.batches, s.stored, s.lost_batches, s.replays),
        (6, 6, 0, 1)
    );
}

#[test]
fn a_gap_is_replayed_and_a_removal_never_overtakes_its_store() {
    let mut rig = Rig::new(true, FollowerLimits::default());
    rig.live(0, stores(0));
    rig.live(1, stores(1));
    // 2 and 3 are missed; 4 removes what 2 stored.
    assert_eq!(
        rig.live(4, batch(&[remove(2)])),
        vec![FollowAction::Replay { from: 2 }]
    );
    rig.replayed(2, stores(2));
    rig.replayed(3, stores(3));
    rig.replayed(4, batch(&[remove(2)]));
    rig.follower.replay_end(&mut rig.holdings);
    assert!(rig.held(0) && rig.held(1) && rig.held(3));
    assert!(
        !rig.held(2),
        "the removal in batch 4 came after the store in batch 2"
    );
    let s = rig.follower.stats();
    assert_eq!((s.gaps, s.duplicates, s.lost_batches), (1, 1, 0));
    assert_eq!(rig.follower.next_seq(), 5);
}

#[test]
fn a_publisher_restart_forgets_the_engines_blocks_and_replays_from_zero() {
    let mut rig = Rig::new(true, FollowerLimits::default());
    for seq in 0..3 {
        rig.live(seq, stores(seq));
    }
    assert_eq!(rig.holdings.count(rig.slot), 3);
    // A new publisher: its batch 1 arrives (its batch 0 was missed).
    assert_eq!(
        rig.live(1, batch(&[store(100)])),
        vec![FollowAction::Replay { from: 0 }]
    );
    assert_eq!(rig.holdings.count(rig.slot), 0);
    rig.replayed(0, batch(&[store(99)]));
    rig.replayed(1, batch(&[store(100)]));
    rig.follower.replay_end(&mut rig.holdings);
    assert!(rig.held(99) && rig.held(100) && !rig.held(0));
    assert_eq!(rig.follower.stats().restarts, 1);

    // A restart seen at its batch 0 applies it at once.
    let mut rig = Rig::new(true, FollowerLimits::default());
    rig.live(0, stores(0));
    rig.live(1, stores(1));
    assert!(rig
        .live(0, batch(&[store(7)]))
        .iter()
        .all(|a| matches!(a, FollowAction::Pull(_))));
    assert!(rig.held(7) && !rig.held(0));
}

#[test]
fn what_the_replay_buffer_no_longer_holds_is_counted_lost() {
    let mut rig = Rig::new(true, FollowerLimits::default());
    rig.live(0, stores(0));
    rig.live(20_000, stores(20_000));
    // The publisher keeps its last 10,000 batches: the replay starts at 10,001.
    for seq in 10_001..=20_000 {
        rig.replayed(seq, stores(seq));
    }
    rig.follower.replay_end(&mut rig.holdings);
    let s = rig.follower.stats();
    assert_eq!(s.lost_batches, 10_000);
    assert_eq!(s.duplicates, 1);
    assert_eq!(rig.follower.next_seq(), 20_001);
    assert!(rig.held(0) && rig.held(10_001) && rig.held(20_000));
}

#[test]
fn a_replay_that_never_ends_is_given_up_and_the_stream_goes_on() {
    let limits = FollowerLimits {
        replay_timeout: Duration::from_secs(5),
        ..FollowerLimits::default()
    };
    let mut rig = Rig::new(true, limits);
    rig.follower.connected(rig.now);
    rig.live(3, stores(3));
    assert_eq!(
        rig.follower.next_deadline(),
        Some(rig.now + Duration::from_secs(5))
    );
    let early = rig.now + Duration::from_secs(4);
    assert!(rig.follower.tick(early, &mut rig.holdings).is_empty());
    assert!(!rig.held(3));
    let late = rig.now + Duration::from_secs(5);
    assert_eq!(
        pulls(&rig.follower.tick(late, &mut rig.holdings)),
        vec![key(3)]
    );
    assert!(!rig.follower.replaying());
    assert_eq!(rig.follower.stats().replays_timed_out, 1);
    // A replay batch after it was given up is ignored.
    assert!(rig.replayed(0, stores(0)).is_empty());
    assert!(!rig.held(0));
}

#[test]
fn without_a_replay_socket_gaps_are_counted_and_skipped() {
    let mut rig = Rig::new(false, FollowerLimits::default());
    assert!(rig.follower.connected(rig.now).is_empty());
    rig.live(0, stores(0));
    assert_eq!(pulls(&rig.live(7, stores(7))), vec![key(7)]);
    let s = rig.follower.stats();
    assert_eq!((s.gaps, s.lost_batches, s.replays), (1, 6, 0));
}

#[test]
fn malformed_batches_and_events_are_counted_and_the_stream_goes_on() {
    let mut rig = Rig::new(false, FollowerLimits::default());
    rig.live(0, b"\xc1 not msgpack".to_vec());
    // A batch with a broken event between two good ones (an int where a map belongs).
    let mut payload = batch(&[store(1), store(2)]);
    // [ts, [e1, e2], 0] → [ts, [e1, 5, e2], 0]: bump the events' count and splice an int in.
    let events_at = 1 + 9;
    assert_eq!(payload[events_at], 0x92);
    payload[events_at] = 0x93;
    let e1_len = encode_batch(1.0, &[store(1)], Some(0)).unwrap().len() - 1 - 9 - 1 - 1;
    payload.insert(events_at + 1 + e1_len, 0x05);
    rig.live(1, payload);
    rig.live(
        2,
        batch(&[KvEvent::Stored(BlockStored {
            block_hashes: vec![BlockHash::Int(9)],
            medium: Some("CPU".into()),
            ..BlockStored::default()
        })]),
    );
    rig.live(
        3,
        batch(&[KvEvent::Stored(BlockStored {
            block_hashes: vec![BlockHash::Bytes(hash(4))],
            medium: Some("GPU".into()),
            ..BlockStored::default()
        })]),
    );
    let s = rig.follower.stats();
    assert_eq!(s.malformed_batches, 1);
    assert_eq!(s.malformed_events, 1);
    assert_eq!((s.int_hashes, s.not_cpu), (1, 1));
    assert!(rig.held(1) && rig.held(2) && !rig.held(4));
    assert_eq!(rig.follower.next_seq(), 4);
}

#[test]
fn batches_held_during_a_replay_are_bounded() {
    let limits = FollowerLimits {
        max_held_batches: 2,
        ..FollowerLimits::default()
    };
    let mut rig = Rig::new(true, limits);
    rig.follower.connected(rig.now);
    for seq in 0..5 {
        rig.live(seq, stores(seq));
    }
    rig.follower.replay_end(&mut rig.holdings);
    let s = rig.follower.stats();
    assert_eq!(s.held_dropped, 3);
    // 0..3 were dropped and the (empty) replay did not bring them: lost.
    assert_eq!(s.lost_batches, 3);
    assert!(rig.held(3) && rig.held(4) && !rig.held(0));
}

/// The kind of a KV cache group comes from whatever event of the engine says it (GPU events
/// do), so the pool's own events can say it too.
#[test]
fn a_groups_kind_is_learned_from_the_engines_events() {
    let mut rig = Rig::new(false, FollowerLimits::default());
    rig.live(
        0,
        batch(&[KvEvent::Stored(BlockStored {
            block_hashes: vec![BlockHash::Int(1)],
            medium: Some("GPU".into()),
            group_idx: Some(2),
            kv_cache_spec_kind: Some("sliding_window".into()),
            ..BlockStored::default()
        })]),
    );
    assert_eq!(
        rig.holdings.group_kinds().get(&2).map(String::as_str),
        Some("sliding_window")
    );
    assert_eq!(rig.follower.stats().not_cpu, 1);
}

/// The batches held during a replay are bounded in bytes too: large payloads cannot make the
/// follower hold more than `max_held_bytes`.
#[test]
fn batches_held_during_a_replay_are_bounded_in_bytes() {
    let one = stores(0).len();
    let limits = FollowerLimits {
        max_held_bytes: 2 * one,
        ..FollowerLimits::default()
    };
    let mut rig = Rig::new(true, limits);
    rig.follower.connected(rig.now);
    for seq in 0..5 {
        rig.live(seq, stores(seq));
    }
    rig.follower.replay_end(&mut rig.holdings);
    let s = rig.follower.stats();
    assert_eq!(s.held_dropped, 3);
    assert!(rig.held(3) && rig.held(4) && !rig.held(2));
}

/// Sequence numbers are the sender's word: a stream whose every batch looks like a restart or
/// a gap (forged numbers, alternating low and high) makes the follower ask at most one replay
/// per `min_replay_interval`, and what an honest stream needs is still recovered: the replay
/// that was put off is asked at the end of the interval, from the earliest batch wanted.
#[test]
fn forged_sequence_numbers_make_at_most_one_replay_per_interval() {
    let limits = FollowerLimits {
        min_replay_interval: Duration::from_secs(1),
        ..FollowerLimits::default()
    };
    let mut rig = Rig::new(true, limits);
    let replays = |actions: &[FollowAction]| {
        actions
            .iter()
            .filter(|a| matches!(a, FollowAction::Replay { .. }))
            .count()
    };
    let mut asked = replays(&rig.follower.connected(rig.now));
    asked += replays(&rig.follower.replay_end(&mut rig.holdings));
    let start = rig.now;
    // Ten seconds of forged batches, one every millisecond: 10,000 restarts and gaps.
    for i in 0..10_000u64 {
        rig.now = start + Duration::from_millis(i);
        let seq = if i % 2 == 0 { 1_000_000 + i } else { 1 };
        asked += replays(&rig.live(seq, stores(seq)));
        asked += replays(&rig.follower.tick(rig.now, &mut rig.holdings));
        if i % 7 == 0 {
            // The publisher answers what was asked (an empty buffer) now and then.
            asked += replays(&rig.follower.replay_end(&mut rig.holdings));
        }
    }
    assert!(asked <= 1 + 10 + 1, "{asked} replays in 10 s");
    assert!(rig.follower.stats().replays_deferred > 0);

    // An honest gap right after a replay: put off, then asked from the first batch missed,
    // and everything comes back in order.
    let mut rig = Rig::new(true, limits);
    rig.follower.connected(rig.now);
    rig.replayed(0, stores(0));
    rig.follower.replay_end(&mut rig.holdings);
    assert!(rig.live(3, stores(3)).is_empty(), "too soon: put off");
    assert!(rig.live(4, stores(4)).is_empty());
    assert_eq!(
        rig.follower.next_deadline(),
        Some(rig.now + Duration::from_secs(1))
    );
    assert!(rig
        .follower
        .tick(rig.now + Duration::from_millis(999), &mut rig.holdings)
        .is_empty());
    assert_eq!(
        rig.follower
            .tick(rig.now + Duration::from_secs(1), &mut rig.holdings),
        vec![FollowAction::Replay { from: 1 }]
    );
    for seq in 1..5 {
        rig.replayed(seq, stores(seq));
    }
    rig.follower.replay_end(&mut rig.holdings);
    assert!((0..5).all(|i| rig.held(i)));
    let s = rig.follower.stats();
    assert_eq!((s.replays, s.lost_batches, s.gaps), (2, 0, 1));
    assert_eq!(rig.follower.next_seq(), 5);
}
