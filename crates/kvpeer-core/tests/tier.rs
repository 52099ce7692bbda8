//! Upstream scenarios of test_manager.py: request roles, loads and stores across sessions,
//! parked PD stores, limits, idle eviction, reconnect backoff, shutdown; and two-core flows.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use kvpeer_core::{
    CancelMode, CoreConfig, Event, JobId, LinkLoss, LookupResult, OffloadPolicy, RequestRoles,
};
use kvpeer_proto::{Message, PeerId};
use support::cluster::{id, key, Cluster};
use support::mock::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// upstream: TestLookup.test_lookup_returns_miss_without_kv_params
/// upstream: TestLookup.test_lookup_returns_miss_without_required_fields
/// upstream: TestLookup.test_lookup_returns_miss_without_prefill_key
/// upstream: TestLookup.test_lookup_returns_miss_for_failed_request
#[test]
fn lookup_answers_miss_without_a_usable_producer() {
    let mut m = Mock::new();
    m.dial("none", RequestRoles::default());
    m.dial("decoder", RequestRoles::decoder());
    assert_eq!(m.lookup("none", &key(1)), LookupResult::Miss);
    assert_eq!(m.lookup("decoder", &key(1)), LookupResult::Miss);
    assert_eq!(m.lookup("never-registered", &key(1)), LookupResult::Miss);
    m.ready_source("sym");
    m.load(1, "sym", vec![key(1)], vec![1]);
    m.recv(transfer_done("sym", false, 0));
    assert_eq!(
        m.lookup("sym", &key(2)),
        LookupResult::Miss,
        "a failed request"
    );
}

/// upstream: TestLookup.test_lookup_returns_hit_for_valid_request
/// upstream: TestLookup.test_lookup_returns_hit_for_different_request_id
#[test]
fn a_pd_consumer_assumes_every_key_held_and_failures_stay_per_request() {
    let mut m = Mock::new();
    m.dial("pd", RequestRoles::prefiller(m.peer.clone()));
    m.dial("other", RequestRoles::prefiller(m.peer.clone()));
    assert_eq!(
        m.lookup("pd", &key(1)),
        LookupResult::Hit,
        "no probe for PD"
    );
    m.handshake();
    m.load(1, "pd", vec![key(1)], vec![1]);
    m.recv(transfer_done("pd", false, 0));
    assert_eq!(m.lookup("pd", &key(1)), LookupResult::Miss);
    assert_eq!(m.lookup("other", &key(1)), LookupResult::Hit);
    assert!(m
        .take_sent()
        .iter()
        .all(|x| !is_type(x, kvpeer_proto::MessageType::Lookup)));
}

/// upstream: test_on_new_request_policy
/// upstream: TestSubmitStore.test_extra_top_level_keys_are_ignored
#[test]
fn only_a_producer_leg_asks_for_request_level_offload_and_it_dials_nobody() {
    let mut m = Mock::new();
    let now = m.now;
    let peer = m.peer.clone();
    let policy = |m: &mut Mock, rid: &str, roles| {
        m.core.on_new_request(now, id(rid), roles).offload_policy()
    };
    assert_eq!(
        policy(&mut m, "a", RequestRoles::decoder()),
        OffloadPolicy::RequestLevel
    );
    assert_eq!(
        policy(&mut m, "b", RequestRoles::kv_source(peer)),
        OffloadPolicy::Default
    );
    assert_eq!(
        policy(&mut m, "c", RequestRoles::default()),
        OffloadPolicy::Default
    );
    m.pump();
    let dials = m
        .events
        .iter()
        .filter(|e| matches!(e, Event::Dial(_)))
        .count();
    assert_eq!(dials, 1, "only the consumer dials");
}

/// upstream: TestSubmitStore.test_no_decode_succeeds_immediately
/// upstream: TestSubmitStore.test_missing_kv_request_id_fails
#[test]
fn a_store_for_a_request_that_is_no_pd_producer_completes_at_once() {
    let mut m = Mock::new();
    let (job, blocks) = m.parent().pin_for_store(&[key(1)]);
    m.store(job, "unknown", vec![key(1)], blocks);
    assert_eq!(m.store_results(), vec![(job, true)]);
    m.assert_clean();
}

/// upstream: TestSubmitLoad.test_missing_params_fails
/// upstream: TestSubmitLoad.test_missing_consumer_flag_fails
/// upstream: TestSubmitLoad.test_empty_keys_succeeds_immediately
/// upstream: TestSubmitLoad.test_no_session_fails
/// upstream: TestGetOrCreateSessionErrorBoundary.test_connect_failure_returns_none
#[test]
fn loads_without_a_producer_fail_and_empty_loads_succeed() {
    let mut m = Mock::new();
    m.dial("none", RequestRoles::decoder());
    m.load(1, "none", vec![key(1)], vec![1]);
    m.dial("pd", RequestRoles::prefiller(m.peer.clone()));
    m.load(2, "pd", vec![], Vec::<u64>::new());
    let peer = m.peer.clone();
    m.core
        .handle_connection_lost(m.now, &peer, LinkLoss::ClosedByPeer);
    m.load(3, "pd", vec![key(1)], vec![1]);
    assert_eq!(
        m.load_results(),
        vec![
            (JobId::new(1), false),
            (JobId::new(2), true),
            (JobId::new(3), false)
        ]
    );
    assert_eq!(
        m.lookup("pd", &key(1)),
        LookupResult::Miss,
        "the dial failed: fall back"
    );
}

/// upstream: TestOnRequestFinished.test_decoder_side_calls_session_finish_request
/// upstream: TestOnRequestFinished.test_p2p_consumer_side_calls_session_finish_request
/// upstream: TestOnRequestFinished.test_prunes_failed_req_ids
#[test]
fn a_pd_consumer_finishing_aborts_its_load_at_the_producer() {
    let mut m = Mock::new();
    m.dial("pd", RequestRoles::prefiller(m.peer.clone()));
    m.handshake();
    m.load(1, "pd", vec![key(1)], vec![1]);
    m.take_sent();
    m.finish("pd");
    assert_eq!(m.take_sent(), vec![abort_fetch("pd", 0)]);
    m.recv(abort_ack("pd", 0));
    assert_eq!(m.core.stats().failed_ids, 0);
    m.assert_clean();
}

/// upstream: TestGetFinished.test_drains_finished_jobs
#[test]
fn events_are_drained_once() {
    let mut m = Mock::new();
    m.load(1, "nobody", vec![key(1)], vec![1]);
    assert!(m.core.poll_event().is_none(), "pump already drained it");
    assert_eq!(m.load_results(), vec![(JobId::new(1), false)]);
}

/// upstream: TestGetFinished.test_reap_fails_probes
#[test]
fn a_dead_session_fails_requests_with_unanswered_probes() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.flush();
    let peer = m.peer.clone();
    m.core
        .handle_connection_lost(m.now, &peer, LinkLoss::ClosedByPeer);
    m.pump();
    assert_eq!(
        m.lookup("r", &key(1)),
        LookupResult::Miss,
        "MISS, not RETRY forever"
    );
}

/// upstream: TestGetFinished.test_unbound_store_reaped_after_timeout
/// upstream: TestGetFinished.test_submit_store_parks_unbound_batch
/// upstream: TestBidirectionalManager.test_late_fetch_after_reap_fails_immediately
#[test]
fn parked_stores_are_reaped_at_60s_and_late_fetches_fail_in_one_round_trip() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    let (j1, b1) = m.parent().pin_for_store(&[key(1)]);
    m.store(j1, "r", vec![key(1)], b1);
    m.advance(S(30));
    let (j2, b2) = m.parent().pin_for_store(&[key(2)]);
    m.store(j2, "r", vec![key(2)], b2);
    m.advance(S(29));
    assert!(m.store_results().is_empty(), "kept within the timeout");
    m.advance(S(2));
    assert_eq!(
        m.store_results(),
        vec![(j1, false), (j2, false)],
        "reaped by the oldest batch"
    );
    let (j3, b3) = m.parent().pin_for_store(&[key(3)]);
    m.store(j3, "r", vec![key(3)], b3);
    assert_eq!(
        m.store_results().last(),
        Some(&(j3, false)),
        "no parking under a reaped id"
    );
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    assert_eq!(
        m.take_sent(),
        vec![transfer_done("r", false, 0)],
        "one round trip, not 30 s"
    );
    m.advance(S(61));
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34's `TestOnRequestFinished.test_dual_role_finish_cleans_both_sessions`: a request
/// that both pulls from a peer (`remote_kv_source`) and produces for a decoder
/// (`remote_decoder`) is two requests to the core, as the tier opens them: finishing both
/// winds each (session, id) down exactly once, on one shared session, whether the ids are the
/// same or not: one `abort_fetch` for the load, one `transfer_done` for the decoder's round,
/// no binding left.
#[test]
fn a_request_in_both_roles_is_finished_once_per_role_on_a_shared_session() {
    for same_id in [false, true] {
        let mut m = Mock::new();
        m.ready_source("warm");
        let peer = m.peer.clone();
        let (src, dst) = if same_id { ("r", "r") } else { ("src", "dst") };
        let source = m.core.on_new_request(
            m.now,
            kvpeer_proto::KvRequestId::from(src),
            RequestRoles::kv_source(peer.clone()),
        );
        let decoder = m.core.on_new_request(
            m.now,
            kvpeer_proto::KvRequestId::from(dst),
            RequestRoles::decoder(),
        );
        m.recv(fetch(dst, vec![key(1)], vec![5], 0));
        let blocks = vec![kvpeer_core::BlockIndex::new(10)];
        m.core
            .submit_load(m.now, JobId::new(1), &source, vec![key(2)], blocks);
        m.pump();
        m.take_sent();
        m.core.finish(m.now, &source);
        m.core.finish(m.now, &decoder);
        m.pump();
        let sent = m.take_sent();
        let aborts = sent.iter().filter(|x| **x == abort_fetch(src, 0)).count();
        let dones = sent
            .iter()
            .filter(|x| matches!(x, Message::TransferDone(t) if t.kv_request_id.as_str() == dst))
            .count();
        assert_eq!((aborts, dones), (1, 1), "same id {same_id}: {sent:?}");
        assert_eq!(m.core.stats().bound_ids, 0, "same id {same_id}");
        m.recv(abort_ack(src, 0));
        assert_eq!(m.load_results(), vec![(JobId::new(1), false)]);
        m.finish("warm");
        m.assert_clean();
    }
}

/// vLLM 0.34's drain fails the stores a session holds too (`_drain_session_stores`), not only
/// the parked ones: a decoder that fetched a round the producer has only partly supplied
/// would otherwise hold the engine's reset until `store_timeout`. Every store no write reads
/// fails at once; a write in flight goes on, and its round ends with it (`transfer_done`
/// false: the rest never comes); a round with nothing to write ends at once.
#[test]
fn the_drain_fails_the_stores_sessions_hold_and_lets_writes_in_flight_finish() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("w", RequestRoles::decoder());
    m.open("idle", RequestRoles::decoder());
    m.recv(fetch("w", vec![key(1), key(2)], vec![5, 6], 0));
    m.recv(fetch("idle", vec![key(3)], vec![7], 0));
    // "w": key 1 is being written, key 9 (not asked for) is held; "idle": key 8 is held.
    let (writing, b1) = m.parent().pin_for_store(&[key(1)]);
    m.store(writing, "w", vec![key(1)], b1);
    let (held, b9) = m.parent().pin_for_store(&[key(9)]);
    m.store(held, "w", vec![key(9)], b9);
    let (idle, b8) = m.parent().pin_for_store(&[key(8)]);
    m.store(idle, "idle", vec![key(8)], b8);
    let tids = m.plane().running();
    assert_eq!(tids.len(), 1, "key 1's write runs");
    m.take_sent();

    let mut failed = m.core.fail_unwritten_stores(m.now);
    m.pump();
    failed.sort();
    let mut expected = vec![held, idle];
    expected.sort();
    assert_eq!(failed, expected);
    let mut ended = m.store_results();
    ended.sort();
    let mut want = vec![(held, false), (idle, false)];
    want.sort();
    assert_eq!(ended, want, "what no write reads fails at once");
    assert_eq!(
        m.take_sent(),
        vec![transfer_done("idle", false, 0)],
        "a round with nothing to write ends at once"
    );
    assert!(
        m.parent().pins.contains_key(&writing),
        "the write still reads it"
    );
    assert_eq!(
        m.plane().running(),
        tids,
        "the write in flight is not cancelled"
    );

    m.plane().end(tids[0], true);
    m.data_plane();
    assert!(m.store_results().contains(&(writing, true)));
    assert_eq!(
        m.take_sent(),
        vec![transfer_done("w", false, 0)],
        "its round ends with its last write: key 2 never comes"
    );
    for rid in ["w", "idle"] {
        m.finish(rid);
    }
    m.assert_clean();
}

/// A symmetric consumer's lookup pinned hits for a round it has not fetched yet: the drain
/// releases them, and the fetch that comes after is refused in one round trip (the reset
/// frees those chunks).
#[test]
fn the_drain_releases_lookup_pins_and_their_late_fetch_is_refused() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().insert(&key(1));
    m.recv(lookup_msg("sym", vec![key(1)], 0));
    assert_eq!(m.take_sent().len(), 1, "answered");
    assert!(!m.parent().pins.is_empty(), "the hit is pinned");
    let failed = m.core.fail_unwritten_stores(m.now);
    m.pump();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(m.parent().pins.is_empty(), "released");
    m.recv(fetch("sym", vec![key(1)], vec![4], 0));
    assert_eq!(m.take_sent(), vec![transfer_done("sym", false, 0)]);
    assert!(m.plane().running().is_empty(), "nothing written");
    // A new round after the drain is served as usual.
    m.recv(lookup_msg("sym", vec![key(1)], 1));
    assert_eq!(m.take_sent().len(), 1, "answered");
    m.recv(fetch("sym", vec![key(1)], vec![4], 1));
    let tids = m.plane().running();
    assert_eq!(tids.len(), 1, "written");
    m.plane().end(tids[0], true);
    m.data_plane();
    assert_eq!(m.take_sent(), vec![transfer_done("sym", true, 1)]);
    m.advance(S(61));
    m.assert_clean();
}

/// vLLM 0.34's `test_drain_aborted_round_sends_only_abort_ack`: an abort waiting behind a
/// write when the drain comes gets exactly one terminal, its `abort_ack`, once the write ends.
#[test]
fn an_abort_waiting_behind_a_write_at_the_drain_gets_only_its_abort_ack() {
    let mut m = Mock::with_config(CoreConfig {
        transfer_stall_timeout: S(0),
        ..Default::default()
    });
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.plane().writes_stuck = true;
    let (job, blocks) = m.parent().pin_for_store(&[key(1)]);
    m.store(job, "r", vec![key(1)], blocks);
    let tids = m.plane().running();
    assert_eq!(tids.len(), 1);
    m.recv(abort_fetch("r", 0));
    assert!(m.take_sent().is_empty(), "the ack waits for the write");
    assert!(
        m.core.fail_unwritten_stores(m.now).is_empty(),
        "the write reads the only store"
    );
    m.plane().end(tids[0], true);
    m.data_plane();
    m.advance(S(1));
    assert_eq!(m.take_sent(), vec![abort_ack("r", 0)], "one terminal");
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34's `test_drain_fails_unfetched_stores_and_rejects_late_fetch` (not in the 0.33
/// scenario list): an engine's drain before a reset fails the stores parked for a decoder at
/// once, and the decoder's late fetch is refused in one round trip.
#[test]
fn parked_stores_fail_at_once_when_the_engine_drains_and_a_late_fetch_is_refused() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    let (j1, b1) = m.parent().pin_for_store(&[key(1)]);
    m.store(j1, "r", vec![key(1)], b1);
    let (j2, b2) = m.parent().pin_for_store(&[key(2)]);
    m.store(j2, "r", vec![key(2)], b2);
    assert!(m.store_results().is_empty(), "parked");
    let failed = m.core.fail_unwritten_stores(m.now);
    assert_eq!(failed, vec![j1, j2]);
    m.pump();
    assert_eq!(m.store_results(), vec![(j1, false), (j2, false)]);
    assert!(
        m.core.fail_unwritten_stores(m.now).is_empty(),
        "nothing left parked"
    );
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    assert_eq!(
        m.take_sent(),
        vec![transfer_done("r", false, 0)],
        "the late fetch is refused in one round trip"
    );
    m.advance(S(61));
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestSessionCapLimit.test_outbound_rejected_at_capacity
/// upstream: TestSessionCapLimit.test_on_new_request_records_failure_on_cap
/// upstream: TestSessionCapLimit.test_inbound_rejected_at_capacity
/// upstream: TestSessionCapLimit.test_existing_session_reused_below_cap
/// upstream: TestAcceptNewPeers.test_creates_session_for_new_peer
#[test]
fn the_session_limit_applies_in_and_out() {
    // vLLM refuses a newcomer at the limit; kvpeer gives it the slot of the idlest session of
    // the host holding the most (docs/behaviour.md, "Sessions full"), so no host can lock the
    // others out. A request over the limit whose peer cannot get a slot still falls back.
    let config = CoreConfig {
        max_peers: 2,
        ..Default::default()
    };
    let mut m = Mock::with_config(config);
    let p = |i: u8| PeerId::new(format!("10.1.0.{i}:5710"));
    assert!(m.core.handle_inbound(m.now, p(2)));
    m.now += S(1);
    m.open("a", RequestRoles::kv_source(p(1)));
    m.open("b", RequestRoles::kv_source(p(1)));
    m.pump();
    assert_eq!(
        m.core.stats().sessions,
        2,
        "the second request reused its peer's session"
    );
    assert_eq!(m.lookup("a", &key(1)), LookupResult::Retry);
    // p(2)'s session has been quiet longest: a newcomer takes its slot.
    m.now += S(1);
    assert!(m.core.handle_inbound(m.now, p(4)));
    m.pump();
    assert_eq!(m.core.stats().sessions, 2);
    assert!(
        m.core.session_state(&p(2)).is_none(),
        "the idle one gave way"
    );
    assert!(
        m.core.session_state(&p(1)).is_some(),
        "the busy one kept its slot"
    );
    assert_eq!(m.core.counters().sessions_evicted, 1);
    assert_eq!(m.lookup("a", &key(1)), LookupResult::Retry);
}

/// One host opening sessions from many ports holds at most its share (`max_peers_per_host`):
/// past it, its newcomers evict its own sessions, never another host's; and when every slot
/// is taken, a newcomer from another host gets the slot of the heaviest host's idlest session.
#[test]
fn a_host_flooding_sessions_evicts_its_own_and_others_still_get_in() {
    let config = CoreConfig {
        max_peers: 8,
        max_peers_per_host: 4,
        ..Default::default()
    };
    let mut m = Mock::with_config(config);
    let attacker = |port: u16| PeerId::new(format!("10.9.0.1:{port}"));
    let honest = |i: u8| PeerId::new(format!("10.1.0.{i}:5710"));
    // Three honest peers of three hosts hold sessions with work (a lookup waiting).
    for i in 1..=3u8 {
        let name = format!("h{i}");
        m.open(&name, RequestRoles::kv_source(honest(i)));
        assert_eq!(m.lookup(&name, &key(u64::from(i))), LookupResult::Retry);
    }
    m.pump();
    // The attacker opens 100 sessions from one host, one after another.
    for port in 0..100u16 {
        m.now += S(1);
        assert!(
            m.core.handle_inbound(m.now, attacker(6000 + port)),
            "a newcomer always gets in"
        );
        m.pump();
    }
    let sessions = |m: &Mock, f: &dyn Fn(&PeerId) -> bool| {
        (0..200u16)
            .map(attacker)
            .chain((1..=9u8).map(honest))
            .chain((6000..6100u16).map(attacker))
            .filter(|p| f(p) && m.core.session_state(p).is_some())
            .count()
    };
    assert_eq!(
        sessions(&m, &|p| p.as_str().starts_with("10.9.")),
        4,
        "the attacker's host holds its share, no more"
    );
    for i in 1..=3u8 {
        assert!(
            m.core.session_state(&honest(i)).is_some(),
            "honest {i} kept its slot"
        );
    }
    // The attacker's newest sessions are the ones left (each newcomer evicted its oldest).
    assert!(m.core.session_state(&attacker(6099)).is_some());
    assert!(m.core.session_state(&attacker(6000)).is_none());
    // An honest newcomer of another host fills the last slot; two more each take the slot of
    // the heaviest host's idlest session: the attacker's.
    for i in 4..=5u8 {
        m.now += S(1);
        assert!(m.core.handle_inbound(m.now, honest(i)));
    }
    assert_eq!(m.core.stats().sessions, 8);
    m.now += S(1);
    assert!(
        m.core.handle_inbound(m.now, honest(6)),
        "a newcomer at the limit"
    );
    m.pump();
    assert_eq!(m.core.stats().sessions, 8);
    assert_eq!(sessions(&m, &|p| p.as_str().starts_with("10.9.")), 2);
    for i in 1..=6u8 {
        assert!(
            m.core.session_state(&honest(i)).is_some(),
            "honest {i} served"
        );
    }
}

/// A host's share counts its address, not its spelling: one attacker host writing its address
/// a hundred ways (IPv4-mapped IPv6 with every choice of zeros and case, its decimal form)
/// holds its one share, and cannot evict the sessions of an honest host that holds more than
/// any single spelling (before, each spelling was a host of one session, so the honest host was
/// the heaviest and gave its sessions up to every newcomer).
#[test]
fn one_host_spelled_many_ways_is_one_host() {
    let config = CoreConfig {
        max_peers: 8,
        max_peers_per_host: 4,
        ..Default::default()
    };
    let mut m = Mock::with_config(config);
    let honest = |port: u16| PeerId::new(format!("10.1.0.1:{port}"));
    // 10.9.0.1, spelled: 6 prefixes × 4 cases × 2 × 4 zero paddings, and as one number.
    let mut spellings = vec!["168361985".to_owned()];
    for prefix in ["::", "0::", "0:0::", "0:0:0::", "0:0:0:0::", "0:0:0:0:0:"] {
        for ffff in ["ffff", "FFFF", "Ffff", "fFfF"] {
            for high in ["a09", "0a09"] {
                for low in ["1", "01", "001", "0001"] {
                    spellings.push(format!("[{prefix}{ffff}:{high}:{low}]"));
                }
            }
        }
    }
    let attacker = |i: usize| PeerId::new(format!("{}:{}", spellings[i], 6000 + i));
    for port in 1..=3u16 {
        m.now += S(1);
        assert!(m.core.handle_inbound(m.now, honest(port)));
    }
    m.pump();
    for i in 0..100 {
        m.now += S(1);
        assert!(
            m.core.handle_inbound(m.now, attacker(i)),
            "a newcomer gets in"
        );
        m.pump();
    }
    for port in 1..=3u16 {
        assert!(
            m.core.session_state(&honest(port)).is_some(),
            "the honest host kept session {port}"
        );
    }
    let held = (0..100)
        .filter(|i| m.core.session_state(&attacker(*i)).is_some())
        .count();
    assert_eq!(
        held, 4,
        "the attacker's host holds its share, however spelled"
    );
}

/// upstream: TestAcceptNewPeers.test_duplicate_connection_is_closed_and_existing_session_untouched
#[test]
fn a_duplicate_inbound_connection_is_refused_and_the_session_kept() {
    let mut m = Mock::new();
    m.ready_source("r");
    assert!(!m.accept());
    assert!(m.core.session_state(&m.peer).unwrap().ready);
    assert!(m.closed().is_none());
}

/// upstream: TestIdleSessionEviction.test_idle_session_evicted
/// upstream: TestIdleSessionEviction.test_idle_session_kept_below_headroom
/// upstream: TestIdleSessionEviction.test_session_with_pending_work_not_evicted
/// upstream: TestIdleSessionEviction.test_disabled_when_zero
#[test]
fn idle_sessions_are_evicted_only_when_slots_are_scarce() {
    let run = |max_peers: usize, idle: u64, busy: bool| {
        let config = CoreConfig {
            max_peers,
            idle_timeout: S(idle),
            ..Default::default()
        };
        let mut m = Mock::with_config(config);
        m.ready_source("r");
        if busy {
            m.load(1, "r", vec![key(1)], vec![1]);
            m.plane().writes_stuck = true;
        }
        m.advance(S(301));
        m.closed()
    };
    assert_eq!(
        run(9, 300, false).as_deref(),
        Some("idle"),
        "1 session >= 9 - 8: evicted"
    );
    assert_eq!(run(10, 300, false), None, "1 session < 10 - 8: kept");
    assert_eq!(run(9, 0, false), None, "idle timeout 0 disables eviction");
    let busy = run(9, 300, true);
    assert!(
        busy.is_none() || busy.as_deref() != Some("idle"),
        "a session with a load in flight is not idle: {busy:?}"
    );
}

/// upstream: TestReconnectBackoff.test_first_fault_reconnects_at_once
/// upstream: TestReconnectBackoff.test_backoff_doubles_up_to_max
/// upstream: TestReconnectBackoff.test_outbound_connect_is_skipped_during_backoff
/// upstream: TestReconnectBackoff.test_inbound_is_told_to_disconnect_during_backoff
/// upstream: TestReconnectBackoff.test_peer_down_log_counts_faults_across_backoff_reset
#[test]
fn data_plane_faults_back_off_reconnects_doubling_to_60s() {
    let mut m = Mock::new();
    let peer = m.peer.clone();
    let mut waits = Vec::new();
    for round in 0..9 {
        m.events.clear();
        m.plane().faults.clear();
        assert!(
            m.accept(),
            "round {round}: accepted once the backoff ran out"
        );
        m.handshake();
        m.plane().fault(&peer, "gone");
        m.data_plane();
        let reason = m.closed().unwrap();
        assert!(
            reason.contains(&format!("data-plane fault #{}", round + 1)),
            "{reason}"
        );
        let wait = reason
            .split("reconnect backoff ")
            .nth(1)
            .map_or(0, |s| s.trim_end_matches('s').parse::<u64>().unwrap());
        waits.push(wait);
        if wait > 0 {
            m.take_sent();
            assert!(!m.accept(), "inbound during backoff is refused");
            assert_eq!(
                m.take_sent(),
                vec![Message::DISCONNECT],
                "and told so at once"
            );
            m.dial(&format!("x{round}"), RequestRoles::kv_source(peer.clone()));
            assert_eq!(
                m.lookup(&format!("x{round}"), &key(1)),
                LookupResult::Miss,
                "no dial during backoff"
            );
            m.finish(&format!("x{round}"));
        }
        m.advance(S(wait));
    }
    assert_eq!(waits, vec![0, 1, 2, 4, 8, 16, 32, 60, 60]);
}

/// upstream: TestReconnectBackoff.test_control_plane_death_does_not_back_off
/// upstream: TestReconnectBackoff.test_healthy_peer_resets_backoff
#[test]
fn only_data_plane_faults_back_off_and_quiet_time_resets_it() {
    let mut m = Mock::new();
    let peer = m.peer.clone();
    for _ in 0..3 {
        m.accept();
        m.handshake();
        m.core
            .handle_connection_lost(m.now, &peer, LinkLoss::ClosedByPeer);
        m.pump();
        assert!(!m.closed().unwrap().contains("backoff"));
        m.events.clear();
    }
    for expected in [0, 1] {
        m.accept();
        m.handshake();
        m.plane().fault(&peer, "gone");
        m.data_plane();
        assert_eq!(m.closed().unwrap().contains("backoff"), expected > 0);
        m.plane().faults.clear();
        m.events.clear();
        m.advance(S(expected));
    }
    m.advance(S(61));
    m.accept();
    m.handshake();
    m.plane().fault(&peer, "gone");
    m.data_plane();
    assert!(
        !m.closed().unwrap().contains("backoff"),
        "60 s after the wait ended the peer starts over"
    );
}

/// upstream: TestShutdownDrain.test_shutdown_no_inflight_skips_drain
/// upstream: TestShutdownDrain.test_shutdown_drains_inflight_via_wait_cancel
/// upstream: TestShutdownDrain.test_shutdown_force_cancels_after_timeout
#[test]
fn shutdown_drains_writes_then_closes_everything() {
    let mut m = Mock::new();
    m.ready_inbound();
    assert!(
        m.core.shutdown_drain(m.now),
        "nothing in flight: nothing to drain"
    );
    assert!(m.plane().cancels.is_empty());
    m.open("r", RequestRoles::decoder());
    let (job, blocks) = m.parent().pin_for_store(&[key(1)]);
    m.store(job, "r", vec![key(1)], blocks);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.plane()
        .transfers
        .values_mut()
        .for_each(|x| x.stuck = true);
    assert!(
        !m.core.shutdown_drain(m.now),
        "a write that may land is waited for"
    );
    assert_eq!(m.plane().cancels.last().unwrap().1, CancelMode::Wait);
    m.core.shutdown(m.now + S(3));
    m.pump();
    assert_eq!(m.plane().cancels.last().unwrap().1, CancelMode::Immediate);
    assert_eq!(m.take_sent().last(), Some(&Message::DISCONNECT));
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestHasPendingWork.test_returns_true_unconditionally_to_keep_engine_ticking
/// upstream: TestHasPendingWork.test_returns_true_even_when_sessions_present
/// upstream: TestDrainJobs.test_returns_immediately_when_quiescent
/// upstream: TestDrainJobs.test_returns_when_session_has_no_inflight_or_inbound
#[test]
fn an_idle_core_asks_for_no_wakeup_and_reports_pending_work_exactly() {
    let mut m = Mock::new();
    assert_eq!(
        m.core.poll_timeout(),
        None,
        "no session: sleep until an input"
    );
    m.ready_inbound();
    assert!(!m.core.session_state(&m.peer).unwrap().pending_work);
    m.open("r", RequestRoles::prefiller(m.peer.clone()));
    m.load(1, "r", vec![key(1)], vec![1]);
    assert!(m.core.session_state(&m.peer).unwrap().pending_work);
    assert!(m.core.poll_timeout().is_some(), "the load timeout is armed");
    m.recv(transfer_done("r", true, 0));
    m.finish("r");
    m.advance(S(31));
    let idle_wake = m.core.poll_timeout();
    assert!(
        idle_wake.is_none(),
        "stale deadlines drain away: {idle_wake:?}"
    );
}

/// upstream: TestServeExternalRequests.test_no_failed_serves_still_serves_sessions
#[test]
fn serve_repolls_pending_keys_across_sessions() {
    let mut c = Cluster::new(3);
    c.parent(2).pending.insert(key(1));
    for consumer in [0, 1] {
        c.connect(consumer, 2);
        let peer = c.nodes[2].id.clone();
        c.open(consumer, "r", RequestRoles::kv_source(peer));
        c.lookup(consumer, "r", &key(1));
        let now = c.now;
        c.core(consumer).flush_lookups(now);
    }
    c.run();
    c.parent(2).pending.clear();
    c.parent(2).insert(&key(1));
    let now = c.now;
    c.core(2).serve(now);
    c.run();
    for consumer in [0, 1] {
        assert_eq!(c.lookup(consumer, "r", &key(1)), LookupResult::Hit);
        c.finish(consumer, "r");
    }
    c.run();
    c.assert_clean();
}

/// upstream: TestBidirectionalManager.test_both_loads_succeed
/// upstream: TestPollOnce.test_orchestrates_accept_poll_and_reap
#[test]
fn two_nodes_fetch_from_each_other_at_once() {
    let mut c = Cluster::new(2);
    for k in 0..4 {
        c.parent(0).insert(&key(100 + k));
        c.parent(1).insert(&key(200 + k));
    }
    let (j0, h0) = c.symmetric_fetch(0, 1, "from-1", &(200..204).map(key).collect::<Vec<_>>());
    let (j1, h1) = c.symmetric_fetch(1, 0, "from-0", &(100..104).map(key).collect::<Vec<_>>());
    assert_eq!((h0.len(), h1.len()), (4, 4));
    assert_eq!(c.load_result(0, j0.unwrap()), Some(true));
    assert_eq!(c.load_result(1, j1.unwrap()), Some(true));
    c.assert_landed(0, j0.unwrap(), &h0);
    c.assert_landed(1, j1.unwrap(), &h1);
    assert_eq!(
        c.stats(0).sessions,
        1,
        "one session per peer pair, both roles"
    );
    c.finish(0, "from-1");
    c.finish(1, "from-0");
    c.run();
    c.assert_clean();
}

/// upstream: TestBidirectionalManager.test_lookup_expiry_allows_zmq_reconnect
#[test]
fn after_a_lookup_expiry_the_peers_reconnect_and_serve_again() {
    let mut c = Cluster::new(2);
    c.parent(1).insert(&key(1));
    // The producer's replies are lost for a while.
    let mut drop_replies = true;
    c.policy = Some(Box::new(move |from, _, m| {
        if from == 1 && matches!(m, Message::LookupResp(_)) && drop_replies {
            drop_replies = false;
            support::cluster::Fate::Drop
        } else {
            support::cluster::Fate::Deliver
        }
    }));
    let (job, _) = c.symmetric_fetch(0, 1, "a", &[key(1)]);
    assert!(job.is_none());
    c.run_for(S(31));
    assert!(c.events_of(0).iter().any(
        |e| matches!(e, Event::Close { end, .. } if end.to_string() == "lookup response timed out")
    ));
    c.finish(0, "a");
    let (job, hits) = c.symmetric_fetch(0, 1, "b", &[key(1)]);
    assert_eq!(hits, vec![key(1)], "a fresh session with a full handshake");
    assert_eq!(c.load_result(0, job.unwrap()), Some(true));
    c.finish(0, "b");
    c.run();
    c.assert_clean();
}

/// The network may delay, duplicate and reorder: every load still ends exactly once, and
/// nothing leaks.
#[test]
fn a_lossy_reordering_network_never_leaks_or_double_reports() {
    let seeds: u64 = std::env::var("KVPEER_LOSSY_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    for seed in 0..seeds {
        let mut c = Cluster::new(2);
        for k in 0..16 {
            c.parent(1).insert(&key(k));
        }
        let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        c.policy = Some(Box::new(move |_, _, m| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let r = (state >> 33) % 10;
            match (r, m) {
                (_, Message::Connect(_) | Message::ConnectAck(_)) => {
                    support::cluster::Fate::Deliver
                }
                (0, _) => support::cluster::Fate::Duplicate,
                (1, _) => support::cluster::Fate::Delay(Duration::from_millis(50)),
                (2, Message::TransferDone(_) | Message::LookupResp(_)) => {
                    support::cluster::Fate::Drop
                }
                _ => support::cluster::Fate::Deliver,
            }
        }));
        let mut jobs = Vec::new();
        for r in 0..8u64 {
            let keys: Vec<_> = (r * 2..r * 2 + 3).map(key).collect();
            let (job, _) = c.symmetric_fetch(0, 1, &format!("r{r}"), &keys);
            jobs.extend(job);
        }
        c.run_for(S(120));
        for r in 0..8u64 {
            c.finish(0, &format!("r{r}"));
        }
        c.run_for(S(120));
        assert!(
            c.settles < 5_000,
            "seed {seed}: the cluster churned ({} settles)",
            c.settles
        );
        for job in jobs {
            assert!(
                c.load_result(0, job).is_some(),
                "seed {seed}: load {job} never ended"
            );
        }
        c.assert_clean();
    }
}

/// A leftover of an ended session (a late ack, a duplicate `disconnect`) opens no session:
/// only `connect` does. Without this rule two peers can kill each other's sessions forever.
#[test]
fn only_a_connect_opens_an_inbound_session() {
    let mut m = Mock::new();
    m.recv(Message::ConnectAck(kvpeer_proto::ConnectAck {
        peer_id: m.peer.clone(),
    }));
    m.recv(Message::DISCONNECT);
    m.recv(transfer_done("r", true, 0));
    m.recv_raw(&[0xc1]);
    m.recv_raw(&[0x93, 1, 2, 3]);
    assert_eq!(m.core.stats().sessions, 0);
    assert!(m.take_sent().is_empty());
    let refused = m
        .events
        .iter()
        .filter(|e| matches!(e, Event::Refused { .. }))
        .count();
    assert_eq!(
        refused, 5,
        "each leftover or bad payload closes its connection"
    );
    let c = m.peer_connect();
    m.recv(Message::Connect(c));
    assert_eq!(m.core.stats().sessions, 1);
    assert!(matches!(
        m.take_sent()[..],
        [Message::Connect(_), Message::ConnectAck(_)]
    ));
}
