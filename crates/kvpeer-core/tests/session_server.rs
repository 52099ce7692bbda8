//! Upstream scenarios of test_sessions.py: the producer (server) role, session teardown,
//! adversarial input, dispatch errors, handshake deadline and data-plane faults.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use kvpeer_core::{BlockIndex, CancelMode, JobId, RequestRoles, TransferId};
use kvpeer_proto::{ConnectAck, Message, MessageType, OffloadKey};
use support::cluster::key;
use support::mock::*;

const S: fn(u64) -> Duration = Duration::from_secs;

/// The core as a PD producer of `rid` with blocks for `keys` stored (job returned).
fn pd_store(m: &mut Mock, rid_: &str, keys: &[OffloadKey]) -> JobId {
    if !m.reqs.contains_key(rid_) {
        m.open(rid_, RequestRoles::decoder());
    }
    let (job, blocks) = m.parent().pin_for_store(keys);
    m.store(job, rid_, keys.to_vec(), blocks);
    job
}

fn running(m: &mut Mock) -> Vec<TransferId> {
    m.plane().running()
}

fn end(m: &mut Mock, tid: TransferId, ok: bool) {
    m.plane().end(tid, ok);
    m.data_plane();
}

fn sent_types(sent: &[Message]) -> Vec<MessageType> {
    sent.iter().map(Message::message_type).collect()
}

// ---------------------------------------------------------------- lookups

/// upstream: TestServerLookupHandling.test_immediate_hits_create_one_store_job
/// upstream: TestServerLookupHandling.test_lookup_then_fetch_round_trip_emits_store_result
/// upstream: TestServerLookupHandling.test_finish_request_called_per_lookup_msg_not_per_kv_request_id
#[test]
fn hits_are_pinned_in_one_job_and_served_by_the_fetch() {
    let mut m = Mock::new();
    m.ready_inbound();
    for i in 1..=3 {
        m.parent().insert(&key(i));
    }
    m.recv(lookup_msg("r", vec![key(1), key(2), key(3), key(2)], 0));
    assert_eq!(
        m.take_sent(),
        vec![lookup_resp(
            "r",
            vec![key(1), key(2), key(3), key(2)],
            vec![true; 4]
        )]
    );
    assert_eq!(m.parent().lookup_jobs, 1, "one store job per lookup pass");
    assert_eq!(
        m.parent().finished_ctxs.len(),
        1,
        "the context closes with the reply"
    );
    m.recv(lookup_msg("r", vec![key(1)], 0));
    assert_eq!(
        m.parent().finished_ctxs.len(),
        2,
        "one context per lookup message"
    );
    assert_eq!(
        m.take_sent(),
        vec![lookup_resp("r", vec![key(1)], vec![true])]
    );
    m.recv(fetch("r", vec![key(1), key(2), key(3)], vec![7, 8, 9], 0));
    let tid = running(&mut m)[0];
    end(&mut m, tid, true);
    assert_eq!(m.take_sent(), vec![transfer_done("r", true, 0)]);
    assert!(
        m.store_results().iter().all(|(_, ok)| *ok),
        "{:?}",
        m.store_results()
    );
    assert_eq!(m.store_results().len(), 2);
    m.assert_clean();
}

/// upstream: TestLookupFlow.test_server_lookup_deferred_until_serve_then_all_misses
/// upstream: TestServerLookupHandling.test_all_misses_no_store_job_finish_fires
#[test]
fn all_misses_answer_without_a_store_job() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.recv(lookup_msg("r", vec![key(1), key(2)], 0));
    assert_eq!(
        m.take_sent(),
        vec![lookup_resp("r", vec![key(1), key(2)], vec![false, false])]
    );
    assert_eq!(m.parent().lookup_jobs, 0);
    assert_eq!(m.parent().finished_ctxs.len(), 1);
    m.recv(fetch("r", vec![], vec![], 0));
    assert!(m.take_sent().is_empty(), "the terminal fetch gets no reply");
    m.assert_clean();
}

/// upstream: TestServerLookupHandling.test_mixed_hit_miss_pending_defers_response_until_aggregate
/// upstream: TestServerLookupHandling.test_pending_resolves_then_aggregate_response_fires
#[test]
fn a_pending_key_holds_the_single_reply_until_it_resolves() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().insert(&key(1));
    m.parent().pending.insert(key(3));
    m.parent().retry.insert(key(4));
    m.recv(lookup_msg("r", vec![key(1), key(2), key(3), key(4)], 0));
    assert!(
        m.take_sent().is_empty(),
        "one reply, once every key is settled"
    );
    m.advance(Duration::from_millis(5));
    assert!(m.take_sent().is_empty());
    m.parent().pending.remove(&key(3));
    m.parent().insert(&key(3));
    m.parent().retry.remove(&key(4));
    m.core.serve(m.now);
    assert_eq!(
        m.take_sent(),
        vec![lookup_resp(
            "r",
            vec![key(1), key(2), key(3), key(4)],
            vec![true, false, true, false]
        )]
    );
    assert_eq!(
        m.parent().lookup_jobs,
        2,
        "the late hit is pinned in its own job"
    );
    m.recv(fetch("r", vec![], vec![], 0));
    m.assert_clean();
}

/// A parent that answers later (an engine) and wakes the core itself is not re-asked on a
/// timer: nothing is due until the lookup's deadline, the reply leaves on `serve`, and a key
/// it never answers is still answered MISS at the deadline.
#[test]
fn a_parent_that_wakes_the_core_is_not_re_polled() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().wakes_core = true;
    m.parent().retry.insert(key(1));
    m.parent().retry.insert(key(2));
    m.recv(lookup_msg("r", vec![key(1), key(2)], 0));
    let asked = m.parent().lookups;
    let due = m.core.poll_timeout().expect("the lookup's deadline");
    assert!(
        due >= m.now + Duration::from_secs(4),
        "no re-poll timer: the next deadline is the lookup's, {:?} away",
        due - m.now
    );
    m.advance(Duration::from_millis(50));
    assert_eq!(m.parent().lookups, asked, "not asked again on a timer");
    assert!(m.take_sent().is_empty());
    m.parent().retry.remove(&key(1));
    m.parent().insert(&key(1));
    m.core.serve(m.now);
    assert!(m.take_sent().is_empty(), "key 2 is still unanswered");
    m.advance(Duration::from_millis(5_000));
    assert_eq!(
        m.take_sent(),
        vec![lookup_resp("r", vec![key(1), key(2)], vec![true, false])]
    );
    m.recv(fetch("r", vec![], vec![], 0));
    m.assert_clean();
}

/// upstream: TestServerLookupHandling.test_pending_timeout_replies_miss_no_store_job
/// upstream: test_held_promotions_answer_peer_lookups_with_miss
#[test]
fn a_key_still_pending_at_5s_is_answered_miss() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().pending.insert(key(1));
    m.recv(lookup_msg("r", vec![key(1)], 0));
    m.advance(Duration::from_millis(4_900));
    assert!(m.take_sent().is_empty());
    m.advance(Duration::from_millis(200));
    assert_eq!(
        m.take_sent(),
        vec![lookup_resp("r", vec![key(1)], vec![false])]
    );
    assert_eq!(m.parent().lookup_jobs, 0);
    m.recv(fetch("r", vec![], vec![], 0));
    m.assert_clean();
}

/// upstream: TestServerLookupHandling.test_wire_finish_drops_pending_batches_for_kv_request_id
/// upstream: TestServerLookupHandling.test_incoming_fetch_drops_pending_lookups_for_kv_request_id
#[test]
fn the_terminal_fetch_drops_parked_lookups_without_reply() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().pending.insert(key(1));
    m.recv(lookup_msg("r", vec![key(1)], 0));
    m.recv(fetch("r", vec![], vec![], 0));
    m.advance(S(10));
    assert!(
        m.take_sent().is_empty(),
        "no lookup_resp for a closed request"
    );
    assert!(m.parent().open_ctxs.is_empty());
    m.assert_clean();
}

/// upstream: TestServerLookupHandling.test_close_returns_open_batch_ctxs_as_failed_serves
/// upstream: TestDisconnect.test_close_surfaces_inflight_lookups
/// upstream: TestServeExternalRequests.test_flushes_failed_serve_ctxs_then_serves_each_session
#[test]
fn closing_a_session_closes_its_parked_lookup_contexts() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().pending.insert(key(1));
    m.recv(lookup_msg("r", vec![key(1)], 0));
    assert_eq!(m.parent().open_ctxs.len(), 1);
    m.recv(Message::DISCONNECT);
    assert!(m.parent().open_ctxs.is_empty());
    m.assert_clean();
}

/// upstream: TestServerFlows.test_fetch_after_symmetric_supply_timed_out_reads_nothing
#[test]
fn a_fetch_after_its_pins_timed_out_fails_without_reading() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().insert(&key(1));
    m.recv(lookup_msg("r", vec![key(1)], 0));
    m.take_sent();
    m.advance(S(31));
    assert_eq!(
        m.store_results(),
        vec![(JobId::new(1), false)],
        "the pin timed out"
    );
    m.recv(fetch("r", vec![key(1)], vec![7], 0));
    assert!(
        running(&mut m).is_empty(),
        "nothing read from an unpinned block"
    );
    assert_eq!(m.take_sent(), vec![transfer_done("r", false, 0)]);
    m.assert_clean();
}

// ---------------------------------------------------------------- supply and demand (PD)

/// upstream: TestServerFlows.test_store_then_fetch_matches
/// upstream: TestServerFlows.test_transfer_completion_emits_store_result_and_done
/// upstream: TestPollOnce.test_new_fetch_id_binds_and_replays_unbound_batches
/// upstream: TestSubmitStore.test_no_binding_yet_parks_in_unbound_stores
#[test]
fn stored_blocks_wait_for_the_fetch_then_transfer() {
    let mut m = Mock::new();
    m.ready_inbound();
    let job = pd_store(&mut m, "r", &[key(1), key(2)]);
    assert_eq!(m.core.stats().unbound_batches, 1);
    m.recv(fetch("r", vec![key(1), key(2)], vec![5, 6], 0));
    let tid = running(&mut m)[0];
    assert_eq!(
        m.plane().transfers[&tid].remote,
        vec![BlockIndex::new(5), BlockIndex::new(6)]
    );
    end(&mut m, tid, true);
    assert_eq!(m.take_sent(), vec![transfer_done("r", true, 0)]);
    assert_eq!(m.store_results(), vec![(job, true)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestServerFlows.test_fetch_then_store_matches
/// upstream: TestSubmitStore.test_routes_to_bound_session
/// upstream: TestPollOnce.test_new_fetch_id_with_no_unbound_still_binds
/// upstream: TestFinishRequestServerSide.test_partial_match_completes_in_two_rounds
#[test]
fn a_fetch_before_the_stores_binds_and_matches_them_as_they_come() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    m.recv(fetch("r", vec![key(1), key(2)], vec![5, 6], 0));
    assert!(running(&mut m).is_empty());
    let j1 = pd_store(&mut m, "r", &[key(1)]);
    assert_eq!(
        m.core.stats().unbound_batches,
        0,
        "bound: routed straight to the session"
    );
    let t1 = running(&mut m)[0];
    end(&mut m, t1, true);
    assert!(m.take_sent().is_empty(), "one block still missing");
    let j2 = pd_store(&mut m, "r", &[key(2)]);
    let t2 = running(&mut m)[0];
    end(&mut m, t2, true);
    assert_eq!(m.take_sent(), vec![transfer_done("r", true, 0)]);
    assert_eq!(m.store_results(), vec![(j1, true), (j2, true)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestFinishRequestServerSide.test_no_inflight_unmatched_demand_sends_failure
/// upstream: TestFinishRequestServerSide.test_finish_request_no_inflight_emits_store_failure
/// upstream: TestOnRequestFinished.test_prefiller_bound_id_routes_via_kv_to_session
#[test]
fn finishing_with_unmet_demand_fails_the_round_at_once() {
    let mut m = Mock::new();
    m.ready_inbound();
    let job = pd_store(&mut m, "r", &[key(9)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.finish("r");
    assert_eq!(m.take_sent(), vec![transfer_done("r", false, 0)]);
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.assert_clean();
}

/// upstream: TestFinishRequestServerSide.test_with_inflight_defers_then_fires_on_last_transfer
/// upstream: TestFinishRequestServerSide.test_finish_request_remaining_zero_emits_success_via_inflight
/// upstream: TestFinishRequestServerSide.test_full_demand_satisfied_still_sends_success
#[test]
fn finishing_with_writes_in_flight_waits_for_the_last_one() {
    let mut m = Mock::new();
    m.ready_inbound();
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.finish("r");
    assert!(m.take_sent().is_empty());
    let tid = running(&mut m)[0];
    end(&mut m, tid, true);
    assert_eq!(m.take_sent(), vec![transfer_done("r", true, 0)]);
    assert_eq!(m.store_results(), vec![(job, true)]);
    m.assert_clean();
}

/// upstream: TestFinishRequestServerSide.test_prefiller_first_finish_before_fetch
/// upstream: TestOnRequestFinished.test_prefiller_unbound_id_leaves_batches_parked
#[test]
fn a_producer_finishing_before_the_fetch_still_serves_it() {
    let mut m = Mock::new();
    m.ready_inbound();
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.finish("r");
    assert_eq!(
        m.core.stats().unbound_batches,
        1,
        "parked stores survive a finish"
    );
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    let tid = running(&mut m)[0];
    end(&mut m, tid, true);
    assert_eq!(m.take_sent(), vec![transfer_done("r", true, 0)]);
    assert_eq!(m.store_results(), vec![(job, true)]);
    m.assert_clean();
}

/// upstream: TestFinishRequestServerSide.test_unknown_request_is_noop
/// upstream: TestOnRequestFinished.test_no_kv_params_does_nothing
/// upstream: TestOnRequestFinished.test_no_kv_request_id_does_nothing
#[test]
fn finishing_an_unknown_request_does_nothing() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.finish("nobody");
    assert!(m.take_sent().is_empty());
    assert!(m.events.is_empty());
    m.assert_clean();
}

/// upstream: TestFinishRequestServerSide.test_write_blocks_failure_finalizes_with_failure
#[test]
fn a_write_that_cannot_start_fails_the_round_now() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.plane().fail_writes = true;
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    assert_eq!(m.take_sent(), vec![transfer_done("r", false, 0)]);
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestFinishRequestServerSide.test_write_blocks_failure_finalizes_after_last_inflight_completes
#[test]
fn a_failed_write_start_waits_for_its_siblings_in_flight() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    m.recv(fetch("r", vec![key(1), key(2)], vec![5, 6], 0));
    let j1 = pd_store(&mut m, "r", &[key(1)]);
    let t1 = running(&mut m)[0];
    m.plane().fail_writes = true;
    let j2 = pd_store(&mut m, "r", &[key(2)]);
    assert!(
        m.take_sent().is_empty(),
        "the round waits for its write in flight"
    );
    end(&mut m, t1, true);
    assert_eq!(m.take_sent(), vec![transfer_done("r", false, 0)]);
    // j1's blocks landed before the round failed for want of j2's.
    assert_eq!(m.store_results(), vec![(j1, true), (j2, false)]);
    m.finish("r");
    m.assert_clean();
}

// ---------------------------------------------------------------- aborts

/// upstream: TestServerFlows.test_abort_fetch_replies_with_ack
#[test]
fn an_abort_with_nothing_in_flight_is_acked_at_once_echoing_the_round() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.recv(abort_fetch("unknown", 7));
    assert_eq!(m.take_sent(), vec![abort_ack("unknown", 7)]);
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(2)], vec![5], 0));
    m.recv(abort_fetch("r", 0));
    assert_eq!(
        m.take_sent(),
        vec![abort_ack("r", 0)],
        "no transfer_done for an aborted round"
    );
    m.finish("r");
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.assert_clean();
}

/// A mock whose stall timer is off: the store-timeout and abort scenarios below keep a write
/// stuck past 20 s, which vLLM 0.34's stall timer (`transfer_stall_timeout`) would fault first
/// (`a_write_in_flight_past_the_stall_timeout_faults_the_peer`).
fn without_stall_timer() -> Mock {
    Mock::with_config(kvpeer_core::CoreConfig {
        transfer_stall_timeout: S(0),
        ..Default::default()
    })
}

/// upstream: TestServerFlows.test_abort_fetch_defers_ack_when_cancel_pending
/// upstream: TestServerFlows.test_abort_fetch_acks_after_drain
/// upstream: TestServerFlows.test_abort_fetch_never_force_cancels_after_timeout
/// upstream: TestServerFlows.test_abort_fetch_idempotent_while_draining
/// upstream: TestServerFlows.test_abort_acks_after_late_terminal_without_transfer_done
#[test]
fn an_abort_is_acked_only_once_no_write_can_land() {
    let mut m = without_stall_timer();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    let tid = running(&mut m)[0];
    m.recv(abort_fetch("r", 0));
    m.recv(abort_fetch("r", 0));
    m.advance(S(60));
    assert!(
        m.take_sent().is_empty(),
        "never acked while the write may land, however long"
    );
    assert!(m.parent().pins.contains_key(&job), "and the pin is held");
    assert!(
        m.plane()
            .cancels
            .iter()
            .all(|(_, mode)| *mode == CancelMode::Wait),
        "never forced"
    );
    end(&mut m, tid, false);
    assert_eq!(
        m.take_sent(),
        vec![abort_ack("r", 0)],
        "ack, and no transfer_done"
    );
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestServerFlows.test_abort_drain_cancel_retry_is_paced
#[test]
fn abort_drain_retries_cancels_at_the_retry_interval() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.recv(abort_fetch("r", 0));
    let first = m.plane().cancels.len();
    m.recv(abort_fetch("r", 0));
    assert_eq!(
        m.plane().cancels.len(),
        first,
        "a duplicate abort within 100 ms does not cancel again"
    );
    m.advance(S(1));
    let tries = m.plane().cancels.len() - first;
    assert!(
        (9..=11).contains(&tries),
        "about one cancel per 100 ms, got {tries}"
    );
    let tid = running(&mut m)[0];
    m.plane().transfers.get_mut(&tid).unwrap().stuck = false;
    m.advance(Duration::from_millis(100));
    assert_eq!(m.take_sent(), vec![abort_ack("r", 0)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestServerFlows.test_abort_keeps_pins_only_of_jobs_being_written
#[test]
fn an_abort_releases_pins_no_write_reads() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    m.open("r", RequestRoles::decoder());
    m.recv(fetch("r", vec![key(1), key(2)], vec![5, 6], 0));
    let written = pd_store(&mut m, "r", &[key(1)]);
    let idle = pd_store(&mut m, "r", &[key(3)]);
    m.recv(abort_fetch("r", 0));
    assert_eq!(
        m.store_results(),
        vec![(idle, false)],
        "the unread job is released at once"
    );
    assert!(m.parent().pins.contains_key(&written));
    let tid = running(&mut m)[0];
    end(&mut m, tid, true);
    assert_eq!(m.store_results(), vec![(idle, false), (written, false)]);
    assert_eq!(m.take_sent(), vec![abort_ack("r", 0)]);
    m.finish("r");
    m.assert_clean();
}

// ---------------------------------------------------------------- store timeouts

/// upstream: TestServerFlows.test_store_timeout
/// upstream: TestGetFinished.test_unbound_store_kept_within_timeout
#[test]
fn a_bound_store_never_fetched_times_out_at_30s() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    m.recv(fetch("r", vec![key(7)], vec![5], 0));
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.advance(S(29));
    assert!(m.store_results().is_empty());
    m.advance(S(2));
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestServerFlows.test_store_timeout_cancels_stuck_transfer_after_confirmation
/// upstream: TestServerFlows.test_store_timeout_keeps_pins_until_cancel_or_late_terminal
/// upstream: TestServerFlows.test_unconfirmed_store_cancel_never_acks_or_tears_down
/// upstream: TestServerFlows.test_store_timeout_cancel_retry_is_paced
#[test]
fn a_store_timeout_with_a_write_in_flight_keeps_the_pin_until_it_stops() {
    let mut m = without_stall_timer();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.advance(S(31));
    assert!(
        m.store_results().is_empty(),
        "the write may land: the pin stays"
    );
    let before = m.plane().cancels.len();
    m.advance(S(1));
    let tries = m.plane().cancels.len() - before;
    assert!(
        (9..=11).contains(&tries),
        "cancel retried about every 100 ms: {tries}"
    );
    assert!(
        m.closed().is_none(),
        "an unconfirmed cancel never tears the session down"
    );
    let tid = running(&mut m)[0];
    m.plane().transfers.get_mut(&tid).unwrap().stuck = false;
    m.advance(Duration::from_millis(100));
    assert_eq!(m.store_results(), vec![(job, false)]);
    assert_eq!(m.take_sent(), vec![transfer_done("r", false, 0)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestServerFlows.test_store_timeout_waits_for_other_transfers_in_round
/// upstream: TestServerFlows.test_failed_transfer_keeps_sibling_pins_until_terminal
#[test]
fn a_failed_write_keeps_its_siblings_pins_until_they_end() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    m.recv(fetch("r", vec![key(1), key(2)], vec![5, 6], 0));
    let j1 = pd_store(&mut m, "r", &[key(1)]);
    let j2 = pd_store(&mut m, "r", &[key(2)]);
    let tids = running(&mut m);
    end(&mut m, tids[0], false);
    assert_eq!(m.store_results(), vec![(j1, false)]);
    assert!(
        m.parent().pins.contains_key(&j2),
        "the sibling write still reads its blocks"
    );
    assert!(
        m.take_sent().is_empty(),
        "the round ends when its last write does"
    );
    end(&mut m, tids[1], true);
    assert_eq!(m.store_results(), vec![(j1, false), (j2, false)]);
    assert_eq!(m.take_sent(), vec![transfer_done("r", false, 0)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestServerFlows.test_abort_during_store_timeout_keeps_unconfirmed_pins
#[test]
fn an_abort_during_a_store_timeout_drain_keeps_the_pins() {
    let mut m = without_stall_timer();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.advance(S(31));
    m.recv(abort_fetch("r", 0));
    m.advance(S(5));
    assert!(m.parent().pins.contains_key(&job));
    assert!(m.take_sent().is_empty());
    let tid = running(&mut m)[0];
    end(&mut m, tid, true);
    assert_eq!(m.take_sent(), vec![abort_ack("r", 0)]);
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.finish("r");
    m.assert_clean();
}

// ---------------------------------------------------------------- both roles, teardown

/// upstream: TestBidirectional.test_session_handles_both_roles_concurrently
#[test]
fn one_session_consumes_and_produces_at_once() {
    let mut m = Mock::new();
    m.ready_source("mine");
    m.parent().insert(&key(1));
    m.load(1, "mine", vec![key(5)], vec![50]);
    m.recv(lookup_msg("theirs", vec![key(1)], 0));
    m.recv(fetch("theirs", vec![key(1)], vec![9], 0));
    m.recv(transfer_done("mine", true, 0));
    let tid = running(&mut m)[0];
    end(&mut m, tid, true);
    let sent = m.take_sent();
    assert_eq!(
        sent_types(&sent),
        vec![
            MessageType::Fetch,
            MessageType::LookupResp,
            MessageType::TransferDone
        ]
    );
    assert_eq!(m.load_results(), vec![(JobId::new(1), true)]);
    m.finish("mine");
    m.assert_clean();
}

/// upstream: TestDisconnect.test_disconnect_marks_session_dead
/// upstream: TestDisconnect.test_close_returns_pending_loads_and_stores
/// upstream: TestConnectionDeathMidTransfer.test_dead_connection_with_pending_work_surfaces_failures
/// upstream: TestGetFinished.test_reaps_dead_sessions
#[test]
fn a_peer_disconnect_fails_everything_open_with_it() {
    let mut m = Mock::new();
    m.ready_source("mine");
    m.load(1, "mine", vec![key(5)], vec![50]);
    m.parent().insert(&key(1));
    m.recv(lookup_msg("theirs", vec![key(1)], 0));
    m.recv(fetch("theirs", vec![key(1)], vec![9], 0));
    m.recv(Message::DISCONNECT);
    // The next turn of the node's loop (what a goodbye's own terminals may still settle:
    // session_client.rs).
    m.advance(S(0));
    assert_eq!(m.load_results(), vec![(JobId::new(1), false)]);
    assert_eq!(m.store_results().len(), 1);
    assert_eq!(m.closed().as_deref(), Some("peer disconnected"));
    let peer = m.peer.clone();
    assert!(m.core.session_state(&peer).is_none());
    assert_eq!(m.plane().removed, vec![peer]);
    assert!(
        !m.take_sent().contains(&Message::DISCONNECT),
        "no reply to a goodbye"
    );
    m.finish("mine");
    m.assert_clean();
}

// ---------------------------------------------------------------- adversarial input

/// upstream: TestAdversarial.test_unknown_message_type_logged
/// upstream: TestAdversarial.test_empty_message
/// upstream: TestAdversarial.test_non_dict_message
#[test]
fn payloads_that_are_no_message_are_ignored_and_the_session_lives() {
    let mut m = Mock::new();
    m.ready_inbound();
    for payload in [
        &[0x81, 0xa4, b't', b'y', b'p', b'e', 0xa2, b'h', b'i'][..],
        &[0x80],
        &[0x93, 1, 2, 3],
        &[],
        &[0xc1],
    ] {
        m.recv_raw(payload);
    }
    assert!(m.closed().is_none());
    m.parent().insert(&key(1));
    m.recv(lookup_msg("r", vec![key(1)], 0));
    assert_eq!(m.take_sent().len(), 1, "still served");
    m.recv(fetch("r", vec![], vec![], 0));
    m.assert_clean();
}

/// upstream: TestAdversarial.test_fetch_mismatched_lengths
/// upstream: TestAdversarial.test_transfer_done_missing_kv_request_id
/// upstream: TestDispatchErrorHandling.test_value_error_disconnects_on_first_occurrence
/// upstream: TestDispatchErrorHandling.test_transfer_done_missing_field_disconnects
#[test]
fn a_malformed_known_message_disconnects_at_once() {
    let bad: [&[u8]; 2] = [
        // fetch with 0 keys and 1 index
        b"\x85\xa4type\xa5fetch\xadkv_request_id\xa1r\xa4keys\x90\xadblock_indexes\x91\x01\xa9round_seq\x00",
        // transfer_done without kv_request_id
        b"\x83\xa4type\xadtransfer_done\xa7success\xc3\xa9round_seq\x00",
    ];
    for payload in bad {
        let mut m = Mock::new();
        m.ready_source("r");
        m.load(1, "r", vec![key(1)], vec![5]);
        m.take_sent();
        m.recv_raw(payload);
        assert_eq!(m.take_sent(), vec![Message::DISCONNECT]);
        assert!(m.closed().unwrap().starts_with("protocol error"));
        assert_eq!(m.load_results(), vec![(JobId::new(1), false)]);
    }
}

/// kvpeer's check: a fetch naming a block beyond the peer's own region.
#[test]
fn a_fetch_index_outside_the_peers_region_is_a_protocol_error() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.recv(fetch("r", vec![key(1)], vec![100_000], 0));
    assert_eq!(m.take_sent(), vec![Message::DISCONNECT]);
    assert!(m
        .closed()
        .unwrap()
        .contains("outside the peer's 100000 blocks"));
}

/// upstream: TestAdversarial.test_duplicate_connect_ack
#[test]
fn a_second_connect_ack_changes_nothing() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(1, "r", vec![key(1)], vec![5]);
    assert_eq!(m.take_sent().len(), 1);
    m.recv(Message::ConnectAck(ConnectAck {
        peer_id: m.peer.clone(),
    }));
    assert!(m.take_sent().is_empty());
    assert!(m.closed().is_none());
}

/// vLLM behaviour (server.py on_fetch): a duplicate fetch for a round disconnects the peer.
#[test]
fn a_second_fetch_for_a_round_is_a_protocol_error() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    assert_eq!(m.take_sent(), vec![Message::DISCONNECT]);
    assert!(m.closed().unwrap().contains("duplicate fetch"));
}

/// upstream: TestDispatchErrorHandling.test_internal_error_does_not_disconnect_once
/// upstream: TestDispatchErrorHandling.test_internal_error_threshold_disconnects
/// upstream: TestDispatchErrorHandling.test_internal_error_counter_resets_on_success
#[test]
fn internal_errors_disconnect_only_when_five_come_in_a_row() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().insert(&key(1));
    m.parent().refuse_pins = true;
    for _ in 0..4 {
        m.recv(lookup_msg("r", vec![key(1)], 0));
    }
    assert!(m.closed().is_none(), "4 in a row: still up");
    assert_eq!(m.take_sent().len(), 4, "each lookup still answered (MISS)");
    m.recv(abort_fetch("x", 0));
    for _ in 0..4 {
        m.recv(lookup_msg("r", vec![key(1)], 0));
    }
    assert!(
        m.closed().is_none(),
        "a success in between resets the count"
    );
    m.recv(lookup_msg("r", vec![key(1)], 0));
    assert!(m
        .closed()
        .unwrap()
        .contains("too many consecutive dispatch errors (5)"));
    m.assert_clean();
}

/// upstream: TestInflightPerReqInvariant.test_invariant_holds_through_lifecycle
/// upstream: TestInflightPerReqInvariant.test_has_inflight_for_correct_with_many_requests
#[test]
fn inflight_bookkeeping_stays_exact_across_many_requests() {
    let mut m = Mock::new();
    m.ready_inbound();
    for i in 0..50 {
        let r = format!("r{i}");
        pd_store(&mut m, &r, &[key(i)]);
        m.recv(fetch(&r, vec![key(i)], vec![i], 0));
    }
    assert_eq!(m.core.stats().inflight, 50);
    for (n, tid) in running(&mut m).into_iter().enumerate() {
        end(&mut m, tid, n % 2 == 0);
        assert_eq!(m.core.stats().inflight, 49 - n);
    }
    for i in 0..50 {
        m.finish(&format!("r{i}"));
    }
    m.assert_clean();
}

// ---------------------------------------------------------------- deadlines, faults

/// upstream: TestHandshakeDeadline.test_marks_dead_after_timeout
/// upstream: TestHandshakeDeadline.test_no_timeout_when_ready
#[test]
fn an_unfinished_handshake_dies_at_30s_a_finished_one_never() {
    let mut m = Mock::new();
    m.accept();
    m.advance(S(29));
    assert!(m.closed().is_none());
    m.advance(S(2));
    assert_eq!(
        m.closed().as_deref(),
        Some("handshake timed out; not dialed again for 250 ms"),
        "an unacked session backs its peer off"
    );
    let mut ok = Mock::new();
    ok.ready_inbound();
    ok.advance(S(600));
    assert!(ok.closed().is_none());
}

/// upstream: TestHandshakeDeadline.test_buffered_ack_at_deadline_completes_handshake
#[test]
fn an_ack_handled_at_the_handshake_deadline_completes_it() {
    let mut m = Mock::new();
    m.accept();
    m.now += S(30);
    m.handshake();
    m.advance(S(0));
    assert!(m.closed().is_none());
    assert!(m.core.session_state(&m.peer).unwrap().ready);
}

/// upstream: TestHandshakeDeadline.test_activity_timestamp_updated_on_recv
/// upstream: TestIdleSessionEviction.test_active_session_kept
#[test]
fn traffic_keeps_a_session_from_idle_eviction() {
    let config = kvpeer_core::CoreConfig {
        max_peers: 1,
        ..Default::default()
    };
    let mut m = Mock::with_config(config);
    m.ready_inbound();
    for _ in 0..10 {
        m.advance(S(200));
        m.recv(abort_fetch("x", 0));
    }
    assert!(m.closed().is_none(), "2000 s old but never idle 300 s");
    m.advance(S(301));
    assert_eq!(m.closed().as_deref(), Some("idle"));
}

/// upstream: TestPeerFaultEscalation.test_fault_with_nothing_inflight_disconnects
/// upstream: TestPeerFaultEscalation.test_death_reasons
#[test]
fn a_data_plane_fault_with_nothing_in_flight_disconnects_now() {
    let mut m = Mock::new();
    m.ready_inbound();
    let peer = m.peer.clone();
    m.plane().fault(&peer, "remote gone");
    m.data_plane();
    assert_eq!(m.take_sent(), vec![Message::DISCONNECT]);
    assert!(m.closed().unwrap().starts_with("data plane: remote gone"));
}

/// upstream: TestPeerFaultEscalation.test_fault_waits_for_inflight_then_disconnects
#[test]
fn a_data_plane_fault_waits_for_writes_in_flight() {
    let mut m = Mock::new();
    m.ready_inbound();
    pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    let peer = m.peer.clone();
    m.plane().fault(&peer, "remote gone");
    m.data_plane();
    assert!(m.closed().is_none());
    let tid = running(&mut m)[0];
    end(&mut m, tid, false);
    assert!(m.closed().unwrap().starts_with("data plane"));
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestPeerFaultEscalation.test_fault_disconnects_after_drain_deadline
/// upstream: TestPeerFaultEscalation.test_first_death_reason_wins
#[test]
fn a_data_plane_fault_disconnects_after_10s_even_with_stuck_writes() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    let peer = m.peer.clone();
    m.plane().fault(&peer, "remote gone");
    m.data_plane();
    m.advance(S(9));
    assert!(m.closed().is_none());
    m.advance(S(2));
    m.recv(Message::DISCONNECT);
    assert!(
        m.closed().unwrap().starts_with("data plane: remote gone"),
        "the first reason wins"
    );
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34 (`VLLM_P2P_TRANSFER_STALL_TIMEOUT_S`): a write still in flight 20 s after it was
/// posted faults the peer (nothing else notices a wedged NIXL WRITE) and ends its session at
/// once (a stalled write will not drain); with the timer off (zero), nothing happens.
#[test]
fn a_write_in_flight_past_the_stall_timeout_faults_the_peer() {
    for stall in [S(20), S(0)] {
        let config = kvpeer_core::CoreConfig {
            transfer_stall_timeout: stall,
            store_timeout: S(600),
            ..Default::default()
        };
        let mut m = Mock::with_config(config);
        m.ready_inbound();
        m.plane().writes_stuck = true;
        pd_store(&mut m, "r", &[key(1)]);
        m.recv(fetch("r", vec![key(1)], vec![5], 0));
        m.advance(S(19));
        assert!(m.closed().is_none());
        m.advance(S(2));
        if stall.is_zero() {
            m.advance(S(10));
            assert!(m.closed().is_none(), "no stall timer");
            continue;
        }
        let closed = m.closed().expect("the stalled peer's session ended");
        assert!(
            closed.starts_with("data plane: a write to the peer was still in flight 20s"),
            "{closed}"
        );
        assert_eq!(m.take_sent().last(), Some(&Message::DISCONNECT));
        m.finish("r");
        m.assert_clean();
    }
}

/// vLLM 0.34's `TestPeerFaultEscalation.test_transfer_done_in_same_poll_is_not_stalled`: a
/// write past the stall timeout that the plane already reports done completes (its store
/// succeeds, the peer gets `transfer_done`), whichever the driver hands the core first: the
/// deadline or the plane's news.
#[test]
fn a_write_done_when_its_stall_deadline_fires_completes_and_faults_nothing() {
    let mut m = Mock::new();
    m.ready_inbound();
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    let tid = running(&mut m)[0];
    // The write ends, but the core hears of it only with the deadline.
    m.plane().end(tid, true);
    m.advance(S(21));
    assert!(m.closed().is_none(), "{:?}", m.closed());
    assert_eq!(m.store_results(), vec![(job, true)]);
    assert_eq!(m.take_sent(), vec![transfer_done("r", true, 0)]);
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34's `TestPeerFaultEscalation.test_stalled_peer_gets_no_new_writes`: once a write
/// stalls past its deadline, the peer's next fetch starts no write (its session ended, the
/// fetch is not served).
#[test]
fn a_stalled_peer_gets_no_new_write() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    let stalled = running(&mut m);
    assert_eq!(stalled.len(), 1);
    m.advance(S(21));
    assert!(m.closed().is_some(), "the stall ended the session");
    let made = m.plane().transfers.len();
    pd_store(&mut m, "r2", &[key(2)]);
    m.recv(fetch("r2", vec![key(2)], vec![6], 0));
    assert_eq!(m.plane().transfers.len(), made, "no new write");
    assert!(
        !m.take_sent()
            .iter()
            .any(|x| is_type(x, MessageType::TransferDone)),
        "nothing served"
    );
    for rid in ["r", "r2"] {
        m.finish(rid);
    }
    m.advance(S(61));
}

// ---------------------------------------------------------------- hostile peers: bounded state

/// Not upstream (vLLM keeps such a request until the session ends): a lookup that hits and is
/// never fetched leaves no request state behind once its pins time out, and a late fetch for
/// it still fails in one round trip.
#[test]
fn hits_never_fetched_leave_no_request_state_after_the_store_timeout() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().insert(&key(1));
    for i in 0..1000 {
        m.recv(lookup_msg(&format!("r{i}"), vec![key(1)], 0));
    }
    m.take_sent();
    assert_eq!(m.core.stats().server_requests, 1000);
    m.advance(S(31));
    assert_eq!(m.store_results().len(), 1000, "every pin released once");
    assert_eq!(m.core.stats().server_requests, 0, "no request state left");
    m.recv(fetch("r7", vec![key(1)], vec![3], 0));
    assert!(running(&mut m).is_empty(), "nothing read");
    assert_eq!(m.take_sent(), vec![transfer_done("r7", false, 0)]);
    // Remembered for one more store timeout only.
    m.advance(S(31));
    assert_eq!(m.core.stats().server_requests, 0);
    m.assert_clean();
}

/// Not upstream: a fetch whose demand no store ever supplies (a peer fetching ids this node
/// never looked up) fails at the store timeout instead of parking its state forever.
#[test]
fn fetch_demand_no_store_supplies_fails_at_the_store_timeout() {
    let mut m = Mock::new();
    m.ready_inbound();
    for i in 0..100 {
        m.recv(fetch(&format!("junk{i}"), vec![key(9)], vec![1], 0));
    }
    assert!(running(&mut m).is_empty());
    assert!(m.take_sent().is_empty(), "demand waits for a store (PD)");
    assert_eq!(m.core.stats().server_requests, 100);
    m.advance(S(29));
    assert_eq!(
        m.core.stats().server_requests,
        100,
        "not before the timeout"
    );
    m.advance(S(2));
    let sent = m.take_sent();
    assert_eq!(sent.len(), 100);
    assert!(sent.iter().all(|s| matches!(
        s,
        Message::TransferDone(d) if !d.success && d.round_seq.0 == 0
    )));
    assert_eq!(m.core.stats().server_requests, 0);
    assert!(m.closed().is_none(), "the session lives on");
    m.assert_clean();
}

/// Not upstream (vLLM keeps `_kv_to_session` entries for ids no local request finishes): a
/// symmetric consumer's fetched ids stay bound to its session (for PD stores that may follow)
/// only while the session holds state for them; a long-lived session's bindings do not grow
/// with the requests it served.
#[test]
fn fetched_ids_are_unbound_once_the_session_no_longer_serves_them() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.parent().insert(&key(1));
    for i in 0..500 {
        let id = format!("r{i}");
        m.recv(lookup_msg(&id, vec![key(1)], 0));
        m.recv(fetch(&id, vec![key(1)], vec![2], 0));
        let tid = running(&mut m)[0];
        end(&mut m, tid, true);
    }
    m.take_sent();
    assert_eq!(m.core.stats().server_requests, 0);
    assert_eq!(m.core.stats().bound_ids, 500, "bound while recent");
    m.advance(S(61));
    assert_eq!(
        m.core.stats().bound_ids,
        0,
        "released once nothing is served for them"
    );
    // A PD store for a released id parks until a fetch binds it again (as before any fetch).
    let job = pd_store(&mut m, "r7", &[key(1)]);
    assert_eq!(m.core.stats().unbound_batches, 1);
    m.recv(fetch("r7", vec![key(1)], vec![3], 0));
    let tid = running(&mut m)[0];
    end(&mut m, tid, true);
    assert_eq!(m.take_sent(), vec![transfer_done("r7", true, 0)]);
    assert!(m.store_results().contains(&(job, true)));
    m.finish("r7");
    m.assert_clean();
}

/// vLLM 0.34 (`TestBidirectionalManager.test_retired_unsent_fetch_releases_parked_producer_blocks`,
/// M:1581): a decoder whose fetch never left (it timed out or finished before we acked its
/// connect) sends the terminal fetch in its place; the stores parked for that request are
/// released by it at once, not at the store timeout.
#[test]
fn a_terminal_fetch_releases_the_stores_parked_for_its_request() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.open("r", RequestRoles::decoder());
    m.open("s", RequestRoles::decoder());
    let job = pd_store(&mut m, "r", &[key(1)]);
    let other = pd_store(&mut m, "s", &[key(2)]);
    assert!(
        m.store_results().is_empty(),
        "parked for the decoders' fetches"
    );
    m.recv(fetch("r", vec![], vec![], 1));
    assert_eq!(m.store_results(), vec![(job, false)], "released at once");
    assert!(
        m.take_sent().is_empty(),
        "a terminal fetch gets no transfer_done"
    );
    // The request is over: a late fetch of it fails in one round trip.
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    assert_eq!(m.take_sent(), vec![transfer_done("r", false, 0)]);
    // Another request's parked store is still served.
    m.recv(fetch("s", vec![key(2)], vec![6], 0));
    let t = running(&mut m)[0];
    end(&mut m, t, true);
    assert_eq!(m.take_sent(), vec![transfer_done("s", true, 0)]);
    assert_eq!(m.store_results(), vec![(job, false), (other, true)]);
    m.finish("r");
    m.finish("s");
    m.assert_clean();
}

// ---------------------------------------------------------------- retained writes (vLLM 0.34)

/// A mock whose writes never end by themselves and keep running when the peer is removed (a
/// NIXL WRITE already in the NIC), with a PD store for "r" fetched into a running write.
fn retained_write() -> (Mock, JobId, TransferId) {
    let mut m = Mock::new();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    m.plane().removal_keeps_writes = true;
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    let tid = running(&mut m)[0];
    (m, job, tid)
}

/// vLLM 0.34's `TestDisconnect.test_close_retains_running_transfer`.
/// vLLM 0.34's `TestRetainedTransfers.test_reap_holds_pins_until_transfer_stops`.
/// A write still running when its session ends keeps its store job pinned (the engine's
/// blocks are not handed back: another request could get them while the write still reads
/// them) until the plane reports it stopped; then the job fails.
#[test]
fn a_write_running_when_its_session_ends_keeps_its_job_pinned_until_it_stops() {
    let (mut m, job, tid) = retained_write();
    m.recv(Message::DISCONNECT);
    assert!(m.closed().is_some());
    assert_eq!(
        m.plane().cancels.last(),
        Some(&(vec![tid], CancelMode::Wait)),
        "cancelled without abandoning it"
    );
    assert_eq!(m.store_results(), vec![], "the job stays pinned");
    assert_eq!(m.core.counters().transfers_retained, 1);
    m.advance(S(5));
    assert_eq!(m.store_results(), vec![]);
    m.plane().end(tid, false);
    m.data_plane();
    assert_eq!(
        m.store_results(),
        vec![(job, false)],
        "released once it stopped"
    );
    assert_eq!(m.core.counters().retained_force_released, 0);
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34's `TestRetainedTransfers.test_hold_cap_force_releases`.
#[test]
fn a_retained_write_is_released_at_the_hold_cap() {
    let (mut m, job, tid) = retained_write();
    m.recv(Message::DISCONNECT);
    m.advance(S(29));
    assert_eq!(m.store_results(), vec![]);
    // Fired only at the deadlines the core asks for (not at the end of the span, as `advance`
    // does): the hold cap must be one of them.
    let end = m.now + S(2);
    while let Some(t) = m.core.poll_timeout().filter(|t| *t <= end) {
        m.now = m.now.max(t);
        m.core.handle_timeout(m.now);
        m.pump();
    }
    assert_eq!(
        m.plane().cancels.last(),
        Some(&(vec![tid], CancelMode::Immediate)),
        "abandoned at the cap"
    );
    assert_eq!(m.store_results(), vec![(job, false)]);
    assert_eq!(m.core.counters().retained_force_released, 1);
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34's `TestRetainedTransfers.test_outbound_waits_for_retained_transfers`.
/// vLLM 0.34's `TestRetainedTransfers.test_inbound_is_told_to_disconnect_while_retained`.
/// While its writes are retained the peer gets no new session: it is not dialed (a request
/// toward it answers MISS), and its inbound connection is told `disconnect`; once they stop,
/// both work again.
#[test]
fn a_peer_with_retained_writes_gets_no_new_session_until_they_stop() {
    let (mut m, _job, tid) = retained_write();
    m.recv(Message::DISCONNECT);
    m.take_sent();
    let peer = m.peer.clone();
    m.open("c", RequestRoles::kv_source(peer.clone()));
    assert_eq!(
        m.lookup("c", &key(9)),
        kvpeer_core::LookupResult::Miss,
        "not dialed"
    );
    assert!(
        !m.take_sent()
            .iter()
            .any(|x| matches!(x, Message::Connect(_))),
        "no connect sent"
    );
    m.finish("c");
    assert!(!m.accept(), "inbound refused");
    assert_eq!(m.take_sent(), vec![Message::DISCONNECT], "and told so");
    m.plane().end(tid, false);
    m.data_plane();
    assert!(m.accept(), "the writes stopped: the peer is welcome again");
    m.handshake();
    m.finish("r");
}

/// A plane whose removal of the peer stops its writes (tcp: the link's connection closes, and
/// its WRITEs are reported failed) releases them with the session: nothing is held.
#[test]
fn writes_the_peers_removal_stops_are_released_with_the_session() {
    let mut m = Mock::new();
    m.ready_inbound();
    m.plane().writes_stuck = true;
    let job = pd_store(&mut m, "r", &[key(1)]);
    m.recv(fetch("r", vec![key(1)], vec![5], 0));
    m.recv(Message::DISCONNECT);
    assert_eq!(m.store_results(), vec![(job, false)]);
    assert_eq!(m.core.counters().transfers_retained, 1);
    assert!(m.accept(), "nothing retained: the peer may come back");
    m.handshake();
    m.finish("r");
}

/// vLLM 0.34's `TestRetainedTransfers.test_shutdown_fails_retained_jobs`: a shutdown abandons
/// writes retained before it and fails their jobs at once.
#[test]
fn a_shutdown_fails_the_jobs_of_retained_writes_at_once() {
    let (mut m, job, tid) = retained_write();
    m.recv(Message::DISCONNECT);
    assert_eq!(m.store_results(), vec![]);
    m.core.shutdown(m.now);
    m.pump();
    assert_eq!(
        m.plane().cancels.last(),
        Some(&(vec![tid], CancelMode::Immediate))
    );
    assert_eq!(m.store_results(), vec![(job, false)]);
    assert_eq!(
        m.core.counters().retained_force_released,
        0,
        "a shutdown is no hold cap"
    );
    m.finish("r");
}

/// vLLM 0.34's `TestRetainedTransfers.test_drain_jobs_waits_for_retained_transfers`: a
/// graceful shutdown's drain is not done while a retained write may still read its blocks.
#[test]
fn a_drain_waits_for_retained_writes() {
    let (mut m, job, tid) = retained_write();
    m.recv(Message::DISCONNECT);
    assert!(
        !m.core.shutdown_drain(m.now),
        "a retained write may still read its blocks"
    );
    m.plane().end(tid, false);
    assert!(m.core.shutdown_drain(m.now));
    m.pump();
    assert_eq!(m.store_results(), vec![(job, false)]);
    m.finish("r");
}
