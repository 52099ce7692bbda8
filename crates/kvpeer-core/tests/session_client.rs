//! Upstream scenarios of test_sessions.py: the handshake, the consumer (client) role and the
//! lookup flow. Each test names the scenarios it covers on its `upstream:` lines.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::time::Duration;

use kvpeer_core::{
    BlockIndex, CoreConfig, JobId, LinkLoss, LookupResult, Registration, RequestRoles,
};
use kvpeer_proto::{ConnectAck, Disconnect, Message, MessageType};
use support::cluster::{key, local};
use support::fakes::RegistrationMode;
use support::mock::*;

const S: fn(u64) -> Duration = Duration::from_secs;

fn connects(sent: &[Message]) -> usize {
    sent.iter()
        .filter(|m| is_type(m, MessageType::Connect))
        .count()
}

/// upstream: TestConnectHandshake.test_connect_msg_sent_on_creation
/// upstream: TestConnectHandshake.test_hash_seed_advertised_in_connect_msg
#[test]
fn a_new_session_announces_itself_with_connect() {
    let mut m = Mock::new();
    assert!(m.accept());
    let sent = m.take_sent();
    let Message::Connect(c) = &sent[0] else {
        panic!("{sent:?}")
    };
    let l = local(0);
    assert_eq!(
        (&c.peer_id, c.block_len, c.num_blocks),
        (&l.peer_id, l.block_len, l.num_blocks)
    );
    assert_eq!(c.hash_seed, "42");
    assert_eq!(c.fingerprint(), l.config_fingerprint);
    assert_eq!(sent.len(), 1, "nothing but connect before the peer's ack");
}

/// upstream: TestConnectHandshake.test_peer_connect_triggers_add_remote_and_ack
/// upstream: TestConnectHandshake.test_connect_ack_makes_session_ready
/// upstream: TestConnectHandshake.test_config_fingerprint_match_succeeds
/// upstream: TestConnectHandshake.test_hash_seed_match_succeeds
#[test]
fn a_compatible_connect_registers_the_peer_and_acks() {
    let mut m = Mock::new();
    m.accept();
    m.take_sent();
    let c = m.peer_connect();
    m.recv(Message::Connect(c));
    let peer = m.peer.clone();
    assert_eq!(
        m.plane().registrations.get(&peer),
        Some(&Registration::Done)
    );
    assert_eq!(
        m.take_sent(),
        vec![Message::ConnectAck(ConnectAck {
            peer_id: local(0).peer_id
        })]
    );
    assert!(
        !m.core.session_state(&m.peer).unwrap().ready,
        "ready only once the peer acks us"
    );
    m.recv(Message::ConnectAck(ConnectAck {
        peer_id: m.peer.clone(),
    }));
    assert!(m.core.session_state(&m.peer).unwrap().ready);
    m.assert_clean();
}

/// upstream: TestConnectHandshake.test_ack_withheld_until_registration_completes
/// upstream: TestConnectHandshake.test_pending_registration_is_pending_work
#[test]
fn connect_ack_waits_for_the_registration() {
    let mut m = Mock::new();
    m.plane().mode = RegistrationMode::Deferred;
    m.accept();
    m.take_sent();
    let c = m.peer_connect();
    m.recv(Message::Connect(c));
    assert!(
        m.take_sent().is_empty(),
        "no ack while the registration runs"
    );
    assert!(m.core.session_state(&m.peer).unwrap().pending_work);
    m.data_plane();
    assert!(m.take_sent().is_empty());
    let peer = m.peer.clone();
    m.plane().finish_registration(&peer, Registration::Done);
    m.data_plane();
    assert!(matches!(m.take_sent()[..], [Message::ConnectAck(_)]));
    assert!(!m.core.session_state(&m.peer).unwrap().pending_work);
}

/// upstream: TestConnectHandshake.test_failed_registration_rejects_peer
#[test]
fn a_failed_registration_rejects_the_peer_with_disconnect() {
    let mut m = Mock::new();
    m.plane().mode = RegistrationMode::Deferred;
    m.accept();
    let c = m.peer_connect();
    m.recv(Message::Connect(c));
    let peer = m.peer.clone();
    m.plane().finish_registration(
        &peer,
        Registration::Failed(kvpeer_core::PlaneError::words(
            kvpeer_core::PlaneErrorKind::Transport,
            "no route",
        )),
    );
    m.data_plane();
    let sent = m.take_sent();
    // The disconnect tells a kvpeer peer why (`kvpeer_reason`; a vLLM peer skips the field).
    match sent.last() {
        Some(Message::Disconnect(d)) => assert_eq!(
            d.kvpeer_reason.as_deref(),
            Some("my data plane will not take your memory: no route")
        ),
        other => panic!("no disconnect: {other:?}"),
    }
    assert!(!sent.iter().any(|x| is_type(x, MessageType::ConnectAck)));
    assert!(m.closed().unwrap().contains("registration failed"));
    assert!(m.core.session_state(&peer).is_none());
    assert_eq!(m.plane().removed, vec![peer]);
}

/// upstream: TestConnectHandshake.test_failed_ack_send_marks_connection_dead
/// upstream: TestDisconnect.test_send_failure_marks_connection_dead
#[test]
fn a_send_failure_reported_by_the_channel_ends_the_session() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(7, "r", vec![key(1)], vec![3]);
    let peer = m.peer.clone();
    m.core
        .handle_connection_lost(m.now, &peer, LinkLoss::ClosedByPeer);
    m.pump();
    assert_eq!(m.load_results(), vec![(JobId::new(7), false)]);
    assert_eq!(
        m.closed().as_deref(),
        Some("control connection lost: closed by the peer")
    );
    assert_eq!(
        m.lookup("r", &key(1)),
        LookupResult::Miss,
        "the failed request falls back"
    );
}

/// upstream: TestConnectHandshake.test_duplicate_connect_during_registration_is_rejected
#[test]
fn a_second_connect_is_a_protocol_error() {
    for deferred in [true, false] {
        let mut m = Mock::new();
        if deferred {
            m.plane().mode = RegistrationMode::Deferred;
        }
        m.accept();
        let c = m.peer_connect();
        m.recv(Message::Connect(c.clone()));
        m.recv(Message::Connect(c));
        assert_eq!(m.take_sent().last(), Some(&Message::DISCONNECT));
        assert!(m.closed().unwrap().contains("duplicate connect"));
    }
}

/// upstream: TestConnectHandshake.test_messages_queued_before_ack_flush_on_ack
#[test]
fn messages_wait_for_the_peers_ack_then_flush_in_order() {
    let mut m = Mock::new();
    m.dial("r", RequestRoles::prefiller(m.peer.clone()));
    m.load(1, "r", vec![key(1)], vec![10]);
    m.load(2, "r", vec![key(2)], vec![11]);
    assert_eq!(
        connects(&m.take_sent()),
        1,
        "only connect goes out before the ack"
    );
    m.recv(Message::ConnectAck(ConnectAck {
        peer_id: m.peer.clone(),
    }));
    let sent = m.take_sent();
    assert_eq!(
        sent,
        vec![
            fetch("r", vec![key(1)], vec![10], 0),
            fetch("r", vec![key(2)], vec![11], 1)
        ]
    );
}

/// upstream: TestConnectHandshake.test_block_len_mismatch_marks_dead
/// upstream: TestConnectHandshake.test_config_fingerprint_mismatch_marks_dead
/// upstream: TestConnectHandshake.test_hash_seed_mismatch_marks_dead
/// kvpeer: a peer's pool over `max_peer_blocks` is refused the same way.
#[test]
fn an_incompatible_peer_is_refused_with_disconnect_at_once() {
    type Tweak = fn(&mut kvpeer_proto::Connect);
    let ours = local(0);
    // What this node logs, and what the refused peer is told: the cause with both values
    // (the hash seeds by digest only: the seed decides every key).
    let cases: [(Tweak, &str, String); 5] = [
        (
            |c| c.block_len = 32_768,
            "block_len mismatch",
            format!("block_len differs: yours 32768, mine {}", ours.block_len),
        ),
        // A pool larger than `max_peer_blocks` (the plane would map it, or prepare a NIXL
        // descriptor per block) is refused before the plane sees it.
        (
            |c| c.num_blocks = (1 << 22) + 1,
            "4194305 blocks, over the 4194304 this node takes",
            "your pool has 4194305 blocks, over the 4194304 I take (max_peer_blocks)".into(),
        ),
        (
            |c| c.num_blocks = u64::MAX,
            "over the 4194304 this node takes",
            format!("your pool has {} blocks, over the 4194304 I take", u64::MAX),
        ),
        (
            |c| c.config_fingerprint = Some("ffffffffffffffff".into()),
            "fingerprint mismatch",
            format!(
                "config fingerprint differs: yours \"ffffffffffffffff\", mine {:?}",
                ours.config_fingerprint
            ),
        ),
        (
            |c| c.hash_seed = "0".into(),
            "hash seed mismatch",
            format!(
                "hash seed differs: yours (SHA-256 {}...) is not mine, which is not told",
                kvpeer_core::seed_digest("0")
            ),
        ),
    ];
    // A session this node opened (its `connect` sent first), then one the peer's `connect`
    // opens: there the refused peer gets `disconnect` and nothing else, not this node's
    // `connect` (its memory's metadata).
    for opened_here in [true, false] {
        for (tweak, why, told) in &cases {
            let mut m = Mock::new();
            if opened_here {
                m.accept();
                m.take_sent();
            }
            let mut c = m.peer_connect();
            tweak(&mut c);
            m.recv(Message::Connect(c));
            // vLLM stays silent and the peer waits 30 s; kvpeer answers disconnect at once,
            // saying why.
            let sent = m.take_sent();
            let [Message::Disconnect(Disconnect {
                kvpeer_reason: Some(said),
            })] = &sent[..]
            else {
                panic!("{why}: {sent:?}");
            };
            assert!(said.starts_with(told.as_str()), "{why}: {said}");
            // Ours is never told, not even by digest (a digest of a number is searched back).
            assert!(
                !said.contains("42") && !said.contains(&kvpeer_core::seed_digest(&ours.hash_seed)),
                "{said}"
            );
            assert!(m.closed().unwrap().contains(why));
            assert!(
                m.plane().registrations.is_empty(),
                "{why}: never registered"
            );
            m.assert_clean();
        }
    }
}

/// kvpeer: a refused peer reads why in our `disconnect`: its session ends as refused, with
/// what the peer said, cleaned (no control characters) and bounded; a plain `disconnect` is
/// vLLM's, an orderly end.
#[test]
fn a_refusal_said_by_the_peer_ends_the_session_with_its_words() {
    let mut m = Mock::new();
    m.accept();
    m.take_sent();
    let long = format!(
        "block_len differs: yours 16384, mine 8192\n\x1b[31mforged{}",
        "x".repeat(4000)
    );
    m.recv(Message::Disconnect(Disconnect {
        kvpeer_reason: Some(long),
    }));
    let why = m.closed().unwrap();
    assert!(
        why.starts_with(
            "the peer refused our connect: \"block_len differs: yours 16384, mine 8192??[31mforged"
        ),
        "{why}"
    );
    assert!(
        why.len() < 600 && !why.contains('\n') && !why.contains('\x1b'),
        "{why}"
    );

    let mut m = Mock::new();
    m.accept();
    m.take_sent();
    m.recv(Message::DISCONNECT);
    let why = m.closed().unwrap();
    assert!(why.starts_with("peer disconnected"), "{why}");

    // Once the peer acked our connect, a reason it sends is no refusal: an end like any other.
    let mut m = Mock::new();
    m.handshake();
    m.take_sent();
    m.recv(Message::Disconnect(Disconnect {
        kvpeer_reason: Some("block_len differs: yours 1, mine 2".into()),
    }));
    let why = m.closed().unwrap();
    assert!(why.starts_with("peer disconnected"), "{why}");
}

/// kvpeer: `max_peer_blocks` below this node's own pool never refuses a peer configured like
/// this node (a pool as large as ours); one block more is refused.
#[test]
fn a_peer_pool_as_large_as_ours_is_taken_whatever_max_peer_blocks_says() {
    let ours = local(0).num_blocks;
    for (blocks, taken) in [(ours, true), (ours + 1, false)] {
        let mut m = Mock::with_config(kvpeer_core::CoreConfig {
            max_peer_blocks: ours / 10,
            ..Default::default()
        });
        m.accept();
        m.take_sent();
        let mut c = m.peer_connect();
        c.num_blocks = blocks;
        m.recv(Message::Connect(c));
        let sent = m.take_sent();
        if taken {
            assert!(matches!(sent[..], [Message::ConnectAck(_)]), "{sent:?}");
            assert_eq!(m.plane().registrations.len(), 1);
        } else {
            let [Message::Disconnect(Disconnect {
                kvpeer_reason: Some(said),
            })] = &sent[..]
            else {
                panic!("{sent:?}");
            };
            assert!(
                said.contains(&format!("{blocks} blocks, over the {ours} I take")),
                "{said}"
            );
            let why = m.closed().unwrap();
            assert!(
                why.contains(&format!("{blocks} blocks, over the {ours} this node takes")),
                "{why}"
            );
            assert!(m.plane().registrations.is_empty());
        }
    }
}

/// upstream: TestConnectHandshake.test_missing_fingerprint_allowed
#[test]
fn an_empty_or_absent_fingerprint_on_either_side_matches() {
    for (ours, theirs) in [
        ("", Some("abc")),
        ("abc", None),
        ("abc", Some("")),
        ("", None),
    ] {
        let mut m = Mock::with_config(Default::default());
        let mut l = local(0);
        l.config_fingerprint = ours.into();
        m.core = kvpeer_core::Core::new(
            Default::default(),
            l,
            Default::default(),
            Default::default(),
            m.now,
        );
        m.accept();
        m.take_sent();
        let mut c = m.peer_connect();
        c.config_fingerprint = theirs.map(String::from);
        m.recv(Message::Connect(c));
        assert!(
            matches!(m.take_sent()[..], [Message::ConnectAck(_)]),
            "{ours:?} vs {theirs:?}"
        );
    }
}

/// upstream: TestClientFlows.test_request_blocks_sends_fetch
/// upstream: TestClientFlows.test_transfer_done_success
/// upstream: TestSubmitLoad.test_happy_path_with_active_session
#[test]
fn a_load_sends_fetch_and_completes_on_transfer_done() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1), key(2)], vec![10, 11]);
    assert_eq!(
        m.take_sent(),
        vec![fetch("r", vec![key(1), key(2)], vec![10, 11], 0)]
    );
    assert!(
        m.load_results().is_empty(),
        "no result before transfer_done"
    );
    m.recv(transfer_done("r", true, 0));
    assert_eq!(m.load_results(), vec![(JobId::new(5), true)]);
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestClientFlows.test_transfer_done_failure
/// upstream: TestPollOnce.test_failed_load_records_kv_request_id
#[test]
fn a_failed_transfer_fails_the_load_and_the_request_falls_back() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.recv(transfer_done("r", false, 0));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    assert_eq!(
        m.lookup("r", &key(9)),
        LookupResult::Miss,
        "failed ids answer MISS"
    );
    m.finish("r");
    assert_eq!(m.core.stats().failed_ids, 0, "finish prunes the failed id");
    m.assert_clean();
}

/// upstream: TestClientFlows.test_finish_request_sends_abort
/// upstream: TestClientFlows.test_finish_preserves_active_load_until_terminal_result
/// upstream: TestClientFlows.test_finish_abort_ack_emits_one_failure
/// upstream: TestClientFlows.test_late_transfer_done_after_abort_ack_is_ignored
#[test]
fn finish_aborts_the_load_and_keeps_it_until_the_ack() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.take_sent();
    m.finish("r");
    assert_eq!(m.take_sent(), vec![abort_fetch("r", 0)]);
    assert!(m.load_results().is_empty());
    assert!(
        m.core.session_state(&m.peer).unwrap().pending_work,
        "the load is still live"
    );
    m.recv(abort_ack("r", 0));
    m.recv(abort_ack("r", 0));
    m.recv(transfer_done("r", true, 0));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(5), false)],
        "exactly one failure"
    );
    m.assert_clean();
}

/// upstream: TestClientFlows.test_finish_abort_timeout_emits_one_failure
#[test]
fn finish_without_an_ack_fails_the_load_at_the_ack_timeout() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.finish("r");
    m.advance(S(4));
    assert!(m.load_results().is_empty());
    m.advance(S(2));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    m.advance(S(60));
    assert_eq!(m.load_results().len(), 1);
    m.assert_clean();
}

/// upstream: TestClientFlows.test_active_loads_work_list_tracks_in_flight
#[test]
fn pending_work_tracks_loads_not_probes() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.flush();
    assert!(
        !m.core.session_state(&m.peer).unwrap().pending_work,
        "a probe is no load"
    );
    m.load(5, "r", vec![key(1)], vec![10]);
    assert!(m.core.session_state(&m.peer).unwrap().pending_work);
    m.recv(transfer_done("r", true, 0));
    assert!(!m.core.session_state(&m.peer).unwrap().pending_work);
}

/// upstream: TestClientFlows.test_load_timeout_sends_abort
/// upstream: TestClientFlows.test_load_abort_ack_clears_request
#[test]
fn a_load_times_out_into_an_abort_and_the_ack_fails_it() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.load(6, "r", vec![key(2)], vec![11]);
    m.take_sent();
    m.advance(S(29));
    assert!(m.take_sent().is_empty());
    m.advance(S(2));
    assert_eq!(
        m.take_sent(),
        vec![abort_fetch("r", 0), abort_fetch("r", 1)]
    );
    m.recv(abort_ack("r", 1));
    m.recv(abort_ack("r", 0));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(6), false), (JobId::new(5), false)]
    );
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34: a load of a request that ran its lookups (the peer confirmed every block) is
/// aborted after the P2P load timeout (10 s), one of a request that never looked up (a PD
/// fetch: the producer may still be computing) only after the PD one (30 s); a finished id
/// that comes back without lookups is a PD request again.
#[test]
fn a_probed_load_times_out_sooner_than_a_pd_load() {
    let mut m = Mock::new();
    m.ready_source("p");
    m.dial("d", RequestRoles::kv_source(m.peer.clone()));
    m.lookup("p", &key(1));
    m.flush();
    m.recv(lookup_resp("p", vec![key(1)], vec![true]));
    m.load(5, "p", vec![key(1)], vec![10]);
    m.load(6, "d", vec![key(2)], vec![11]);
    m.take_sent();
    m.advance(S(9));
    assert!(m.take_sent().is_empty());
    m.advance(S(2));
    assert_eq!(
        m.take_sent(),
        vec![abort_fetch("p", 0)],
        "the probed load only"
    );
    m.recv(abort_ack("p", 0));
    m.advance(S(18));
    assert!(m.take_sent().is_empty(), "29 s: the PD load still waits");
    m.advance(S(2));
    assert_eq!(m.take_sent(), vec![abort_fetch("d", 0)]);
    m.recv(abort_ack("d", 0));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(5), false), (JobId::new(6), false)]
    );
    m.finish("p");
    m.finish("d");
    // "p" comes back as a new request that does not look up: a PD load, 30 s.
    m.load(7, "p", vec![key(3)], vec![12]);
    m.take_sent();
    m.advance(S(11));
    assert!(m.take_sent().is_empty(), "a PD load of a reused id");
    m.advance(S(20));
    assert_eq!(m.take_sent(), vec![abort_fetch("p", 0)]);
    m.recv(abort_ack("p", 0));
    assert_eq!(m.load_results().last(), Some(&(JobId::new(7), false)));
    m.finish("p");
    m.assert_clean();
}

/// upstream: TestClientFlows.test_load_abort_ack_timeout_surfaces_failure
/// (0.33 failed the load and kept the session; 0.34 ends the session, as here: only that fences
/// the peer's writes)
#[test]
fn an_unanswered_abort_ends_the_session_and_fails_the_load() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.advance(S(30));
    assert!(m.load_results().is_empty(), "aborted, not acked yet");
    m.advance(S(10));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    assert_eq!(m.closed().as_deref(), Some("abort_ack timed out"));
    assert!(m.core.session_state(&m.peer).is_none(), "the session ended");
    let peer = m.peer.clone();
    assert!(
        m.plane().removed.contains(&peer),
        "and the peer's memory is forgotten"
    );
    m.finish("r");
    assert_eq!(m.core.stats().client_requests, 0);
    m.assert_clean();
}

/// A producer stalled in the middle of a write (SIGSTOP, a GC pause) past the load and abort
/// timeouts: the load fails and its session ends, but its blocks are handed back (the failure
/// reported) only once the plane says no write of that peer can land in them any more.
#[test]
fn a_failed_loads_blocks_are_handed_back_only_once_fenced() {
    let mut m = Mock::new();
    m.plane().fence_needs_write_end = true;
    m.ready_source("r");
    m.load(5, "r", vec![key(1), key(2)], vec![10, 11]);
    m.stall_write(11);
    m.advance(S(40));
    assert_eq!(m.closed().as_deref(), Some("abort_ack timed out"));
    assert!(
        m.load_results().is_empty(),
        "block 11 may still be written: held"
    );
    assert_eq!(
        m.held_loads(),
        vec![JobId::new(5)],
        "the failure itself is reported at once (vLLM 0.34's deferred release)"
    );
    assert_eq!(
        m.lookup("r", &key(3)),
        LookupResult::Miss,
        "and the request's lookups answer MISS from then on"
    );
    assert_eq!(m.core.stats().fencing_loads, 1);
    assert_eq!(m.core.stats().fencing_blocks, 2);
    assert_eq!(
        m.core.counters().loads_failed,
        1,
        "counted when reported (CI: vLLM 0.34's tier read 0 after the job had failed)"
    );
    assert!(m.core.poll_timeout().is_some(), "the fence is asked again");
    m.advance(S(5));
    assert!(m.load_results().is_empty(), "still writing: still held");
    let t1 = m.core.poll_timeout().unwrap();
    let gap = t1 - m.now;
    m.advance(gap);
    let t2 = m.core.poll_timeout().unwrap();
    assert!(
        t2 - t1 >= Duration::from_millis(500),
        "a fence that does not settle is asked less and less often: {:?}",
        t2 - t1
    );
    // The stalled producer resumes and its write ends: the block is fenced at the next ask.
    m.plane().writing.clear();
    m.advance(S(1));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    assert_eq!(m.core.stats().fencing_loads, 0);
    assert_eq!(m.core.counters().loads_failed, 1, "and not counted again");
    m.finish("r");
    m.assert_clean();
}

/// A host whose producers left their share of blocks that they may still write (stalled past
/// every timeout) gets no more loads until those are fenced: each is failed at once, no fetch
/// sent, no block reserved for it; a stalling host costs its own share of the pool, not the
/// pool. Once the blocks are fenced, its loads go out again.
#[test]
fn a_host_holding_its_share_of_unfenced_blocks_gets_no_more_loads() {
    let mut m = Mock::with_config(CoreConfig {
        max_pins_per_peer: Some(2),
        ..CoreConfig::default()
    });
    m.plane().fence_needs_write_end = true;
    m.ready_source("r");
    m.load(5, "r", vec![key(1), key(2)], vec![10, 11]);
    m.stall_write(11);
    m.advance(S(41));
    assert_eq!(m.held_loads(), vec![JobId::new(5)]);
    assert_eq!(m.core.stats().fencing_blocks, 2);
    m.finish("r");

    // The same peer again (a new session): its host holds its share of 2.
    m.ready_source("r2");
    m.take_sent();
    for (job, block) in [(6, 12), (7, 13)] {
        m.load(job, "r2", vec![key(block)], vec![block]);
        assert!(
            m.load_results().contains(&(JobId::new(job), false)),
            "refused at once: {:?}",
            m.load_results()
        );
    }
    assert!(
        !m.take_sent()
            .iter()
            .any(|msg| is_type(msg, kvpeer_proto::MessageType::Fetch)),
        "no fetch went out for them"
    );
    let peer = m.peer.clone();
    assert!(
        !m.plane()
            .permits
            .get(&peer)
            .is_some_and(|p| p.contains(&BlockIndex::new(12))),
        "and the peer may write none of their blocks"
    );

    // The stalled write ends: its blocks are fenced, and the host's loads go out again, one
    // larger than its share too (a share bounds what it holds, not what it may load).
    m.plane().writing.clear();
    m.advance(S(2));
    assert!(m.load_results().contains(&(JobId::new(5), false)));
    assert_eq!(m.core.stats().fencing_blocks, 0);
    m.load(8, "r2", vec![key(4), key(5), key(6)], vec![13, 14, 15]);
    let round = fetch_round(&m.take_sent()).expect("the host's loads go out again");
    m.recv(transfer_done("r2", true, round));
    assert!(m.load_results().contains(&(JobId::new(8), true)));
    m.finish("r2");
    m.assert_clean();
}

/// The round of the one fetch among `sent`.
fn fetch_round(sent: &[Message]) -> Option<u64> {
    let rounds: Vec<u64> = sent
        .iter()
        .filter_map(|msg| match msg {
            Message::Fetch(f) => Some(f.round_seq.0),
            _ => None,
        })
        .collect();
    match rounds[..] {
        [round] => Some(round),
        _ => None,
    }
}

/// A peer confirming a failed load (`transfer_done` false) while the plane still sees its write
/// in progress does not get the blocks handed back early either.
#[test]
fn a_confirmed_failure_still_waits_for_the_planes_fence() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.stall_write(10);
    m.recv(transfer_done("r", false, 0));
    assert!(
        m.load_results().is_empty(),
        "held while the plane sees a write"
    );
    m.advance(Duration::from_millis(25));
    assert!(m.load_results().is_empty());
    m.plane().writing.clear();
    m.advance(Duration::from_millis(100));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    assert!(
        m.closed().is_none(),
        "a confirmed failure keeps the session"
    );
    m.finish("r");
    m.assert_clean();
}

/// upstream: TestLookupFlow.test_lookup_deadline_starts_after_handshake
#[test]
fn the_lookup_deadline_starts_when_the_lookup_is_sent() {
    let mut m = Mock::new();
    m.dial("r", RequestRoles::kv_source(m.peer.clone()));
    assert_eq!(m.lookup("r", &key(1)), LookupResult::Retry);
    m.flush();
    assert_eq!(connects(&m.take_sent()), 1, "no lookup before the ack");
    m.advance(S(20));
    m.handshake();
    m.flush();
    assert_eq!(
        m.take_sent()
            .iter()
            .filter(|x| is_type(x, MessageType::Lookup))
            .count(),
        1
    );
    m.advance(S(7));
    assert!(
        m.closed().is_none(),
        "27 s after registering, 7 s after sending: alive"
    );
    m.advance(S(2));
    assert_eq!(m.closed().as_deref(), Some("lookup response timed out"));
    assert_eq!(m.take_sent().last(), Some(&Message::DISCONNECT));
    assert_eq!(m.lookup("r", &key(1)), LookupResult::Miss);
}

/// upstream: TestLookupFlow.test_partial_response_rearms_lookup_deadline
/// upstream: TestLookupFlow.test_lookup_progress_keeps_overlapping_batches_alive
#[test]
fn progress_rearms_the_lookup_deadline() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.lookup("r", &key(2));
    m.flush();
    m.advance(S(3));
    m.lookup("r", &key(3));
    m.flush();
    m.advance(S(4));
    m.recv(lookup_resp("r", vec![key(1)], vec![true]));
    m.advance(S(7));
    assert!(
        m.closed().is_none(),
        "14 s after the first lookup, 7 s after progress"
    );
    m.recv(lookup_resp("r", vec![key(2), key(3)], vec![false, true]));
    m.advance(S(60));
    assert!(
        m.closed().is_none(),
        "every probe answered: no deadline left"
    );
}

/// upstream: TestLookupFlow.test_buffered_lookup_response_precedes_expiry
#[test]
fn a_reply_handled_at_the_deadline_wins_over_the_timeout() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.flush();
    m.now += S(30);
    m.recv(lookup_resp("r", vec![key(1)], vec![true]));
    m.advance(S(0));
    assert!(m.closed().is_none());
    assert_eq!(m.lookup("r", &key(1)), LookupResult::Hit);
}

/// upstream: TestLookupFlow.test_duplicate_responses_and_new_keys_do_not_rearm
#[test]
fn duplicate_answers_and_unknown_keys_do_not_rearm() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.lookup("r", &key(2));
    m.flush();
    m.recv(lookup_resp("r", vec![key(1)], vec![true]));
    m.advance(S(20));
    m.recv(lookup_resp("r", vec![key(1), key(99)], vec![true, true]));
    m.advance(S(11));
    assert_eq!(m.closed().as_deref(), Some("lookup response timed out"));
}

/// upstream: TestLookupFlow.test_lookup_expiry_preserves_completed_transfers
/// upstream: TestBidirectionalManager.test_unanswered_lookup_falls_back_to_local_prefill
#[test]
fn lookup_expiry_fails_what_is_open_and_keeps_what_completed() {
    let mut m = Mock::new();
    m.ready_source("a");
    m.dial("b", RequestRoles::kv_source(m.peer.clone()));
    m.load(1, "a", vec![key(1)], vec![10]);
    m.recv(transfer_done("a", true, 0));
    m.load(2, "a", vec![key(2)], vec![11]);
    m.lookup("b", &key(3));
    m.flush();
    m.advance(S(31));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(1), true), (JobId::new(2), false)]
    );
    assert_eq!(
        m.lookup("b", &key(3)),
        LookupResult::Miss,
        "falls back to local prefill"
    );
    m.finish("a");
    m.finish("b");
    m.assert_clean();
}

/// upstream: TestLookupFlow.test_lookup_deadline_cleared_before_next_batch
/// upstream: TestLookupFlow.test_request_blocks_clears_probe_cache
#[test]
fn a_fetch_closes_the_round_and_the_next_round_probes_afresh() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.flush();
    m.recv(lookup_resp("r", vec![key(1)], vec![true]));
    m.load(5, "r", vec![key(1)], vec![10]);
    m.recv(transfer_done("r", true, 0));
    m.take_sent();
    assert_eq!(
        m.lookup("r", &key(1)),
        LookupResult::Retry,
        "a served key is probed again"
    );
    m.flush();
    assert_eq!(m.take_sent(), vec![lookup_msg("r", vec![key(1)], 1)]);
    m.advance(S(7));
    assert!(m.closed().is_none(), "the new round has a fresh deadline");
    m.recv(lookup_resp("r", vec![key(1)], vec![false]));
    m.advance(S(60));
    assert!(m.closed().is_none());
}

/// upstream: TestLookupFlow.test_aggregate_flush_resolve_round_trip
/// upstream: TestLookupFlow.test_separate_lookup_msg_per_kv_request_id
/// upstream: TestLookup.test_lookup_returns_hit_for_valid_request
/// upstream: TestLookup.test_lookup_returns_hit_for_different_request_id
#[test]
fn probes_are_sent_once_per_request_and_answers_are_cached() {
    let mut m = Mock::new();
    m.ready_source("a");
    m.dial("b", RequestRoles::kv_source(m.peer.clone()));
    for _ in 0..3 {
        assert_eq!(m.lookup("a", &key(1)), LookupResult::Retry);
        assert_eq!(m.lookup("a", &key(2)), LookupResult::Retry);
        assert_eq!(m.lookup("b", &key(1)), LookupResult::Retry);
    }
    m.flush();
    let mut sent = m.take_sent();
    sent.sort_by_key(|x| format!("{x:?}"));
    assert_eq!(
        sent,
        vec![
            lookup_msg("a", vec![key(1), key(2)], 0),
            lookup_msg("b", vec![key(1)], 0)
        ]
    );
    m.recv(lookup_resp("a", vec![key(1), key(2)], vec![true, false]));
    m.recv(lookup_resp("b", vec![key(1)], vec![true]));
    for _ in 0..3 {
        assert_eq!(m.lookup("a", &key(1)), LookupResult::Hit);
        assert_eq!(m.lookup("a", &key(2)), LookupResult::Miss);
        assert_eq!(m.lookup("b", &key(1)), LookupResult::Hit);
    }
    m.flush();
    assert!(
        m.take_sent().is_empty(),
        "answered probes are never sent again"
    );
}

/// upstream: TestLookupFlow.test_flush_uses_work_list_not_full_scan
/// upstream: TestLookupFlow.test_multiple_lookup_msgs_across_steps
#[test]
fn a_flush_sends_only_keys_new_since_the_last_one() {
    let mut m = Mock::new();
    m.ready_source("r0");
    for i in 1..200 {
        m.dial(&format!("r{i}"), RequestRoles::kv_source(m.peer.clone()));
        m.lookup(&format!("r{i}"), &key(i));
    }
    m.flush();
    assert_eq!(m.take_sent().len(), 199);
    m.lookup("r0", &key(1));
    m.flush();
    assert_eq!(
        m.take_sent(),
        vec![lookup_msg("r0", vec![key(1)], 0)],
        "only the request with new keys"
    );
    m.lookup("r0", &key(2));
    m.lookup("r0", &key(1));
    m.flush();
    assert_eq!(m.take_sent(), vec![lookup_msg("r0", vec![key(2)], 0)]);
}

/// upstream: TestLookupFlow.test_split_response_resolves_across_messages
#[test]
fn answers_may_be_split_across_replies() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.lookup("r", &key(2));
    m.flush();
    m.recv(lookup_resp("r", vec![key(2)], vec![true]));
    assert_eq!(m.lookup("r", &key(1)), LookupResult::Retry);
    assert_eq!(m.lookup("r", &key(2)), LookupResult::Hit);
    m.recv(lookup_resp("r", vec![key(1)], vec![false]));
    assert_eq!(m.lookup("r", &key(1)), LookupResult::Miss);
}

/// upstream: TestLookupFlow.test_finish_request_cancels_pending_lookups
/// upstream: TestLookupFlow.test_finish_without_flushed_lookup_sends_no_fetch
#[test]
fn finish_drops_unsent_probes_and_owes_nothing() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.finish("r");
    m.flush();
    assert!(m.take_sent().is_empty(), "no lookup, no terminal fetch");
    m.assert_clean();
}

/// upstream: TestLookupFlow.test_finish_after_flushed_lookup_sends_empty_fetch
#[test]
fn finish_after_an_unfetched_lookup_sends_the_terminal_fetch() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.flush();
    m.recv(lookup_resp("r", vec![key(1)], vec![false]));
    m.take_sent();
    m.finish("r");
    assert_eq!(m.take_sent(), vec![fetch("r", vec![], vec![], 0)]);
    m.assert_clean();
}

/// upstream: TestLookupFlow.test_finish_after_real_fetch_sends_no_second_fetch
#[test]
fn finish_after_a_real_fetch_sends_no_terminal_fetch() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.flush();
    m.recv(lookup_resp("r", vec![key(1)], vec![true]));
    m.load(5, "r", vec![key(1)], vec![10]);
    m.recv(transfer_done("r", true, 0));
    m.take_sent();
    m.finish("r");
    assert!(m.take_sent().is_empty());
    // A later round's lookup re-opens it: then finish owes the terminal fetch of round 1.
    let mut m2 = Mock::new();
    m2.ready_source("r");
    m2.load(5, "r", vec![key(1)], vec![10]);
    m2.lookup("r", &key(2));
    m2.flush();
    m2.take_sent();
    m2.finish("r");
    assert_eq!(
        m2.take_sent(),
        vec![abort_fetch("r", 0), fetch("r", vec![], vec![], 1)]
    );
}

/// kvpeer's write permits: a fetch lets the producer write into the blocks it names, until the
/// load ends, however it ends (the tcp plane refuses every other write).
#[test]
fn a_load_grants_write_permits_until_it_ends() {
    let mut m = Mock::new();
    m.ready_source("r");
    let peer = m.peer.clone();
    let permits = |m: &mut Mock| {
        let mut v: Vec<u64> = m
            .plane()
            .permits
            .get(&peer)
            .map(|s| s.iter().map(|b| b.get()).collect())
            .unwrap_or_default();
        v.sort_unstable();
        v
    };
    m.load(1, "r", vec![key(1), key(2)], vec![10, 11]);
    m.load(2, "r", vec![key(3)], vec![12]);
    assert_eq!(permits(&mut m), vec![10, 11, 12]);
    m.recv(transfer_done("r", true, 0));
    assert_eq!(
        permits(&mut m),
        vec![12],
        "a finished load closes its blocks"
    );
    m.recv(transfer_done("r", false, 1));
    assert!(permits(&mut m).is_empty(), "so does a failed one");
    m.load(3, "r", vec![key(4)], vec![13]);
    m.advance(S(41));
    assert_eq!(m.load_results().last(), Some(&(JobId::new(3), false)));
    assert!(permits(&mut m).is_empty(), "and one whose abort timed out");
    m.finish("r");
}

/// Not upstream (vLLM re-dials at once): a peer whose dials keep failing before it acks is
/// dialed again only after a backoff that doubles from 250 ms to 5 s; requests naming it in
/// between miss at once without a dial. A session the peer acked resets the backoff.
#[test]
fn failed_dials_back_off_instead_of_re_dialing_at_once() {
    use kvpeer_core::Event;
    let mut m = Mock::new();
    let dials = |m: &mut Mock| {
        let n = m
            .events
            .iter()
            .filter(|e| matches!(e, Event::Dial(_)))
            .count();
        m.events.clear();
        n
    };
    let peer = m.peer.clone();
    let mut n = 0;
    let mut try_request = |m: &mut Mock| {
        n += 1;
        let rid = format!("r{n}");
        m.dial(&rid, RequestRoles::kv_source(peer.clone()));
        m.lookup(&rid, &key(1));
        m.flush();
    };
    try_request(&mut m);
    assert_eq!(dials(&mut m), 1);
    m.core
        .handle_connection_lost(m.now, &m.peer.clone(), LinkLoss::ClosedByPeer);
    m.pump();
    assert!(m
        .closed()
        .is_some_and(|r| r.contains("not dialed again for 250 ms")));
    m.events.clear();
    for wait_ms in [250u64, 500, 1000, 2000, 4000, 5000, 5000] {
        // Within the wait: requests miss and nothing is dialed.
        for _ in 0..20 {
            try_request(&mut m);
        }
        assert_eq!(dials(&mut m), 0, "no dial during the {wait_ms} ms wait");
        m.advance(Duration::from_millis(wait_ms));
        try_request(&mut m);
        assert_eq!(dials(&mut m), 1, "one dial after {wait_ms} ms");
        m.core
            .handle_connection_lost(m.now, &m.peer.clone(), LinkLoss::ClosedByPeer);
        m.pump();
        m.take_sent();
    }
    // A dial the peer acks resets it: the next failure waits 250 ms again.
    m.advance(S(5));
    try_request(&mut m);
    m.handshake();
    m.take_sent();
    m.core
        .handle_connection_lost(m.now, &m.peer.clone(), LinkLoss::ClosedByPeer);
    m.pump();
    m.events.clear();
    try_request(&mut m);
    assert_eq!(dials(&mut m), 1, "an acked session leaves no backoff");
}

/// Not upstream: a `connect` naming another peer than the connection it came on is refused
/// before any registration (it would register that peer's memory under this session).
#[test]
fn a_connect_naming_another_peer_is_refused_before_registration() {
    let mut m = Mock::new();
    let mut c = m.peer_connect();
    c.peer_id = kvpeer_proto::PeerId::new("10.9.9.9:5600");
    m.recv(Message::Connect(c));
    assert!(m.plane().registrations.is_empty(), "nothing registered");
    let sent = m.take_sent();
    assert!(
        sent.iter().any(|s| is_type(s, MessageType::Disconnect)),
        "{sent:?}"
    );
    assert!(m
        .closed()
        .is_some_and(|r| r.contains("connect names peer 10.9.9.9:5600")));
}

/// Not upstream: a session a peer's `connect` opens announces this node once that `connect`
/// passed the checks: our `connect`, then `connect_ack` when the registration is done.
#[test]
fn a_peers_connect_that_passes_is_answered_with_connect_then_ack() {
    let mut m = Mock::new();
    let c = m.peer_connect();
    m.recv(Message::Connect(c));
    let sent = m.take_sent();
    let kinds: Vec<_> = sent.iter().map(|s| s.message_type()).collect();
    assert_eq!(
        kinds,
        vec![MessageType::Connect, MessageType::ConnectAck],
        "{sent:?}"
    );
    assert_eq!(m.plane().registrations.len(), 1);
    assert!(m.closed().is_none());
}

/// The number of `LookupAnswered` events for request `r` since the last call.
fn answered_events(m: &mut Mock, r: &str) -> usize {
    m.pump();
    let n = m
        .events
        .iter()
        .filter(|e| {
            matches!(e, kvpeer_core::Event::LookupAnswered { kv_request_id }
                if kv_request_id.as_str() == r)
        })
        .count();
    m.events.clear();
    n
}

/// A driver waiting on lookups asks the core again only when it reports news: every reply
/// that answers a probe (or changes an answer) is one `LookupAnswered`; a reply with nothing
/// new is none, so a driver that waited for the event never misses an answer.
#[test]
fn each_reply_that_answers_something_is_one_event() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.lookup("r", &key(1));
    m.lookup("r", &key(2));
    m.flush();
    assert_eq!(answered_events(&mut m, "r"), 0, "nothing answered yet");
    m.recv(lookup_resp("r", vec![key(2)], vec![true]));
    assert_eq!(answered_events(&mut m, "r"), 1);
    assert_eq!(m.lookup("r", &key(1)), LookupResult::Retry);
    m.recv(lookup_resp("r", vec![key(2), key(99)], vec![true, true]));
    assert_eq!(
        answered_events(&mut m, "r"),
        0,
        "a duplicate answers nothing"
    );
    m.recv(lookup_resp("r", vec![key(1)], vec![false]));
    assert_eq!(answered_events(&mut m, "r"), 1);
    assert_eq!(m.lookup("r", &key(1)), LookupResult::Miss);
    assert_eq!(m.lookup("r", &key(2)), LookupResult::Hit);
}

/// A request id that comes back while its finished predecessor's load still waits for its
/// `abort_ack` (a router retrying a request id): the old load is kept and reported once acked,
/// and the new request's rounds start after the old ones, so the old round's `abort_ack` can
/// never complete (and hand back the blocks of) the new round's load.
#[test]
fn a_reused_id_keeps_its_aborting_load_and_starts_after_its_rounds() {
    let mut m = Mock::new();
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.take_sent();
    m.finish("r");
    assert_eq!(m.take_sent(), vec![abort_fetch("r", 0)]);
    m.load(6, "r", vec![key(2)], vec![11]);
    let sent = m.take_sent();
    let new_round = fetch_round(&sent).unwrap_or_else(|| panic!("one fetch: {sent:?}"));
    assert!(new_round > 0, "the new load is not round 0: {sent:?}");
    // The old round's ack ends the old load only; the new one still runs.
    m.recv(abort_ack("r", 0));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    assert_eq!(
        m.lookup("r", &key(2)),
        LookupResult::Retry,
        "the old load's end fails none of the new request's lookups"
    );
    m.recv(transfer_done("r", true, new_round));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(5), false), (JobId::new(6), true)]
    );
    m.finish("r");
    m.assert_clean();
}

/// The engine finishes a request while its failed load waits for the fence: once fenced, the
/// load's end does not put the finished id back among the failed ones for ever.
#[test]
fn finishing_a_request_while_its_load_waits_for_the_fence_leaves_no_failed_id() {
    let mut m = Mock::new();
    m.plane().fence_needs_write_end = true;
    m.ready_source("r");
    m.load(5, "r", vec![key(1)], vec![10]);
    m.stall_write(10);
    m.advance(S(41));
    assert_eq!(m.core.stats().fencing_loads, 1);
    m.finish("r");
    m.plane().writing.clear();
    m.advance(S(2));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    assert_eq!(m.core.stats().failed_ids, 0);
    m.assert_clean();
}

/// vLLM 0.34 still settles loads with the `transfer_done` and `abort_ack` a peer sent before
/// its `disconnect` (`P2PSession._accept_buffered_terminals`). kvpeer handles a peer's messages
/// in the order they were sent, and its channel delivers everything that arrived before a
/// connection's loss ahead of the loss (kvpeer-net `control.rs`), so terminals just ahead of
/// the peer's `disconnect`, or of its connection's end, settle their loads: a success counts,
/// and an acked abort hands its blocks back without waiting for a fence.
#[test]
fn a_peers_terminals_sent_just_before_it_leaves_settle_its_loads() {
    for leaves_by_disconnect in [true, false] {
        let mut m = Mock::new();
        m.ready_source("r");
        let peer = m.peer.clone();
        m.dial("s", RequestRoles::kv_source(peer.clone()));
        m.load(5, "r", vec![key(1)], vec![10]);
        m.load(6, "s", vec![key(2)], vec![11]);
        m.finish("s");
        assert!(m.take_sent().contains(&abort_fetch("s", 0)));
        m.recv(transfer_done("r", true, 0));
        m.recv(abort_ack("s", 0));
        if leaves_by_disconnect {
            m.recv(Message::DISCONNECT);
        } else {
            m.core
                .handle_connection_lost(m.now, &peer, LinkLoss::ClosedByPeer);
            m.pump();
        }
        assert_eq!(
            m.load_results(),
            vec![(JobId::new(5), true), (JobId::new(6), false)],
            "disconnect: {leaves_by_disconnect}"
        );
        assert!(m.held_loads().is_empty(), "both were settled by the peer");
        assert!(m.closed().is_some(), "the session ended");
        m.finish("r");
        m.assert_clean();
    }
}

/// vLLM 0.34 settles a load with the `transfer_done` or `abort_ack` its peer sent right after
/// its `disconnect` (`TestDisconnect.test_buffered_terminal_settles_load_after_disconnect`): the
/// session is over, new work there is not taken, but a success that arrived with the goodbye
/// counts. kvpeer hears such terminals until its next input of any other kind (the next
/// round of I/O, a deadline, any other message), then fails what is still open.
#[test]
fn a_peers_terminals_sent_right_after_its_disconnect_still_settle_its_loads() {
    let mut m = Mock::new();
    m.ready_source("r");
    let peer = m.peer.clone();
    for rid in ["s", "t"] {
        m.dial(rid, RequestRoles::kv_source(peer.clone()));
    }
    m.load(5, "r", vec![key(1)], vec![10]);
    m.load(6, "s", vec![key(2)], vec![11]);
    m.load(7, "t", vec![key(3)], vec![12]);
    m.finish("s");
    assert!(m.take_sent().contains(&abort_fetch("s", 0)));
    m.parent().insert(&key(9));

    m.recv(Message::DISCONNECT);
    assert!(
        m.load_results().is_empty(),
        "still hearing the goodbye's terminals"
    );
    assert!(
        m.core.poll_timeout().is_some_and(|t| t <= m.now),
        "reaped at the next turn"
    );
    m.recv(transfer_done("r", true, 0));
    m.recv(abort_ack("s", 0));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(5), true), (JobId::new(6), false)]
    );
    assert!(
        m.held_loads().is_empty(),
        "the acked abort's blocks are handed back"
    );
    // New work after the goodbye is not taken, and it ends the hearing.
    m.recv(fetch("theirs", vec![key(9)], vec![3], 0));
    m.recv(transfer_done("t", true, 0));
    assert_eq!(
        m.load_results(),
        vec![
            (JobId::new(5), true),
            (JobId::new(6), false),
            (JobId::new(7), false)
        ]
    );
    assert!(
        m.take_sent().is_empty(),
        "no answer to anything after a goodbye"
    );
    assert!(m.plane().running().is_empty(), "the fetch was not served");
    assert_eq!(m.closed().as_deref(), Some("peer disconnected"));
    assert_eq!(m.plane().removed, vec![peer.clone()]);
    assert!(m.core.session_state(&peer).is_none());
    for rid in ["r", "t"] {
        m.finish(rid);
    }
    m.assert_clean();
}

/// What ends the hearing of a goodbye's terminals before they come: the next turn of the
/// node's loop (a deadline), or a message from the peer that does not decode (vLLM 0.34's
/// `test_local_protocol_fault_rejects_buffered_success`: a fault rejects the success behind
/// it). The load fails, and a success that comes later is not taken.
#[test]
fn a_goodbyes_terminals_are_heard_only_until_the_next_turn_or_a_bad_message() {
    // transfer_done without kv_request_id
    let malformed: &[u8] = b"\x83\xa4type\xadtransfer_done\xa7success\xc3\xa9round_seq\x00";
    for by_fault in [false, true] {
        let mut m = Mock::new();
        m.ready_source("r");
        m.load(5, "r", vec![key(1)], vec![10]);
        m.take_sent();
        m.recv(Message::DISCONNECT);
        if by_fault {
            m.recv_raw(malformed);
        } else {
            m.advance(Duration::ZERO);
        }
        assert_eq!(m.load_results(), vec![(JobId::new(5), false)], "{by_fault}");
        m.recv(transfer_done("r", true, 0));
        assert_eq!(m.load_results(), vec![(JobId::new(5), false)], "{by_fault}");
        assert!(
            !m.take_sent().contains(&Message::DISCONNECT),
            "no reply to a goodbye"
        );
        m.finish("r");
        m.assert_clean();
    }
}

/// vLLM 0.34's `abort_loads` (`TestClientFlows.test_abort_loads_fails_each_load_once`): the
/// engine's drain before a reset aborts every load not aborting yet, once, so a producer that
/// never writes cannot hold the reset for the load timeout; each load fails at its
/// `abort_ack`, and one whose producer answers nothing ends with the session at the abort-ack
/// timeout.
#[test]
fn the_drain_aborts_every_load_once_and_each_fails_at_its_ack() {
    let mut m = Mock::new();
    m.ready_source("r");
    let peer = m.peer.clone();
    m.dial("s", RequestRoles::kv_source(peer.clone()));
    m.load(5, "r", vec![key(1)], vec![10]);
    m.load(6, "s", vec![key(2)], vec![11]);
    m.finish("s");
    m.take_sent();
    assert_eq!(m.core.abort_loads(m.now), 1, "s was aborting already");
    assert_eq!(m.take_sent(), vec![abort_fetch("r", 0)]);
    assert_eq!(m.core.abort_loads(m.now), 0, "once");
    assert!(m.take_sent().is_empty());
    m.recv(abort_ack("r", 0));
    assert_eq!(m.load_results(), vec![(JobId::new(5), false)]);
    // The producer never acks s's abort: its session ends at the abort-ack timeout (5 s),
    // well before the load timeout (10 s).
    m.advance(Duration::from_secs(6));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(5), false), (JobId::new(6), false)]
    );
    assert_eq!(m.closed().as_deref(), Some("abort_ack timed out"));
    m.finish("r");
    m.assert_clean();
}

/// What one request's peer has been told, read off the wire: rounds whose lookups it holds,
/// fetches it is serving, aborted fetches it has not acked.
#[derive(Default)]
struct PeerView {
    lookup_rounds: Vec<u64>,
    fetching: Vec<u64>,
    aborting: Vec<u64>,
    unanswered: Vec<kvpeer_proto::OffloadKey>,
}

impl PeerView {
    /// Applies what the core sent; panics on a terminal `fetch` that would close a newer live
    /// round (0.34's `can_send_terminal_fetch`).
    fn read(&mut self, sent: Vec<Message>, history: &[&str]) {
        for message in sent {
            match message {
                Message::Lookup(l) => {
                    self.lookup_rounds.push(l.round_seq.0);
                    self.unanswered.extend(l.keys);
                }
                Message::Fetch(f) if f.block_indexes.is_empty() => {
                    let round = f.round_seq.0;
                    assert!(
                        self.fetching.is_empty() && self.lookup_rounds.iter().all(|r| *r == round),
                        "terminal fetch of round {round} while the peer holds lookups of rounds \
                         {:?} and serves fetches of rounds {:?}; after {history:?}",
                        self.lookup_rounds,
                        self.fetching
                    );
                    self.lookup_rounds.clear();
                    self.unanswered.clear();
                }
                Message::Fetch(f) => {
                    self.lookup_rounds.retain(|r| *r > f.round_seq.0);
                    self.unanswered.clear();
                    self.fetching.push(f.round_seq.0);
                }
                Message::AbortFetch(a) => {
                    self.fetching.retain(|r| *r != a.round_seq.0);
                    self.aborting.push(a.round_seq.0);
                }
                _ => {}
            }
        }
    }
}

/// vLLM 0.34 holds back a terminal `fetch` (the "request finished" signal) when the request
/// has a newer live round, since the peer would close that round's state with it
/// (`can_send_terminal_fetch`, for a terminal queued before the peer's ack). kvpeer sends the
/// terminal only from `finish`, after aborting the loads and dropping the probes, and never
/// sends lookups before the ack, so none can. Checked over every sequence of up to
/// [`TERMINAL_STEPS`] engine and peer steps on one request id (reused after each finish), the
/// handshake among them; a sequence with a step that does nothing is the shorter one.
#[test]
fn a_terminal_fetch_never_closes_a_newer_live_round() {
    let (mut sequences, mut terminals) = (0, 0);
    let mut prefix = Vec::new();
    explore_terminal_sequences(&mut prefix, &mut sequences, &mut terminals);
    assert!(
        terminals > 1000,
        "{sequences} sequences, {terminals} of them ending in a terminal fetch"
    );
}

const TERMINAL_STEPS: usize = 7;
const STEPS: [&str; 8] = [
    "ack",
    "lookup",
    "flush",
    "answer",
    "load",
    "done",
    "abort_ack",
    "finish",
];

/// Extends `prefix` by every step that does something, runs each sequence, and goes deeper.
fn explore_terminal_sequences(
    prefix: &mut Vec<&'static str>,
    sequences: &mut u32,
    terminals: &mut u32,
) {
    for step in STEPS {
        prefix.push(step);
        if let Some(ends_in_terminal) = run_terminal_sequence(prefix) {
            *sequences += 1;
            *terminals += u32::from(ends_in_terminal);
            if prefix.len() < TERMINAL_STEPS {
                explore_terminal_sequences(prefix, sequences, terminals);
            }
        }
        prefix.pop();
    }
}

/// Runs `steps` on a fresh session, checking every message on the wire against the peer's
/// view; `None` if a step did nothing, else whether the last one sent a terminal fetch.
fn run_terminal_sequence(steps: &[&'static str]) -> Option<bool> {
    let mut m = Mock::new();
    let peer = m.peer.clone();
    m.dial("r", RequestRoles::kv_source(peer));
    let mut view = PeerView::default();
    view.read(m.take_sent(), &[]);
    let (mut acked, mut ends_in_terminal) = (false, false);
    for (at, step) in steps.iter().enumerate() {
        let next = at as u64 + 1;
        match *step {
            "ack" if !acked => {
                acked = true;
                m.handshake();
            }
            "lookup" => {
                m.lookup("r", &key(next));
            }
            "flush" => m.flush(),
            "answer" if acked && !view.unanswered.is_empty() => {
                let keys = std::mem::take(&mut view.unanswered);
                let hits = vec![true; keys.len()];
                m.recv(Message::LookupResp(kvpeer_proto::LookupResp {
                    kv_request_id: rid("r"),
                    keys,
                    hits,
                }));
            }
            "load" => m.load(next, "r", vec![key(100 + next)], vec![next]),
            "done" if acked && !view.fetching.is_empty() => {
                let round = view.fetching.remove(0);
                m.recv(transfer_done("r", true, round));
            }
            "abort_ack" if acked && !view.aborting.is_empty() => {
                let round = view.aborting.remove(0);
                m.recv(abort_ack("r", round));
            }
            "finish" => m.finish("r"),
            _ => return None,
        }
        let sent = m.take_sent();
        ends_in_terminal = sent
            .iter()
            .any(|s| matches!(s, Message::Fetch(f) if f.block_indexes.is_empty()));
        view.read(sent, &steps[..=at]);
    }
    Some(ends_in_terminal)
}

/// The fetches sent, as their block indexes (`[]`: a terminal fetch), and the `abort_fetch`es.
fn fetches_and_aborts(sent: &[Message]) -> (Vec<Vec<u64>>, usize) {
    let fetches = sent
        .iter()
        .filter_map(|m| match m {
            Message::Fetch(f) => Some(f.block_indexes.clone()),
            _ => None,
        })
        .collect();
    let aborts = sent
        .iter()
        .filter(|m| matches!(m, Message::AbortFetch(_)))
        .count();
    (fetches, aborts)
}

/// A consumer that dialed its PD producer and queued load 7 (`r`, block 0) before the ack.
/// The handshake outlives the PD load timeout (30 s) here, so a timeout is the load's, not the
/// session's.
fn pd_load_before_the_ack() -> (Mock, kvpeer_proto::PeerId) {
    let mut m = Mock::with_config(CoreConfig {
        handshake_timeout: Duration::from_secs(120),
        ..CoreConfig::default()
    });
    let peer = m.peer.clone();
    m.dial("r", RequestRoles::prefiller(peer.clone()));
    m.load(7, "r", vec![key(1)], vec![0]);
    (m, peer)
}

/// vLLM 0.34 (`TestDisconnect.test_unsent_fetch_retires_without_abort`, S:3194; the consumer's
/// half of `TestBidirectionalManager.test_retired_unsent_fetch_releases_parked_producer_blocks`,
/// M:1581, whose producer's half is `session_server.rs`'s terminal-fetch test).
///
/// A PD load whose fetch still waits for the producer's ack when its request finishes, or
/// when it times out, fails at once with no `abort_fetch`: the producer never learns of it,
/// nothing of it can land, its blocks go back now. No work is left pending. The producer gets
/// a terminal fetch in its place (it releases the stores it parked for the request), unless a
/// newer fetch of the id is queued before the ack (the terminal would close it). Before, an
/// `abort_fetch` queued behind the fetch, and a producer slow to ack ended the session at the
/// abort-ack timeout (5 s).
#[test]
fn a_load_whose_fetch_never_left_fails_at_once_with_no_abort_fetch() {
    for finished in [true, false] {
        for ack_first in [true, false] {
            let case = format!("finished {finished}, ack first {ack_first}");
            let (mut m, peer) = pd_load_before_the_ack();
            assert_eq!(connects(&m.take_sent()), 1, "{case}: only connect went");
            if finished {
                m.finish("r");
            } else {
                m.advance(Duration::from_secs(31));
            }
            assert_eq!(
                m.load_results(),
                vec![(JobId::new(7), false)],
                "{case}: failed at once"
            );
            assert!(
                m.held_loads().is_empty(),
                "{case}: its blocks went back now"
            );
            assert!(
                !m.core.session_state(&peer).unwrap().pending_work,
                "{case}: no work left"
            );
            assert!(m.closed().is_none(), "{case}: the session lives on");
            assert!(
                m.plane().permits.get(&peer).is_none_or(|p| p.is_empty()),
                "{case}: the plane takes no write of the peer into block 0"
            );
            if finished {
                m.dial("r", RequestRoles::prefiller(peer.clone()));
            }
            let ack = Message::ConnectAck(ConnectAck {
                peer_id: peer.clone(),
            });
            let mut sent = Vec::new();
            if ack_first {
                m.recv(ack.clone());
                sent.extend(m.take_sent());
            }
            m.load(8, "r", vec![key(2)], vec![1]);
            if !ack_first {
                m.recv(ack);
            }
            sent.extend(m.take_sent());
            let expected: Vec<Vec<u64>> = if ack_first {
                vec![vec![], vec![1]]
            } else {
                vec![vec![1]]
            };
            assert_eq!(fetches_and_aborts(&sent), (expected, 0), "{case}: {sent:?}");
            // A finished id that comes back is a new request, with rounds from 0 again.
            let round = fetch_round(&sent[sent.len() - 1..]).unwrap();
            m.recv(transfer_done("r", true, round));
            assert_eq!(
                m.load_results(),
                vec![(JobId::new(7), false), (JobId::new(8), true)],
                "{case}: the replacement is served"
            );
            m.finish("r");
            m.assert_clean();
        }
    }
}

/// The drain before a reset (vLLM 0.34's `abort_loads`) ends a load whose fetch never left at
/// once too, with no `abort_fetch`, instead of holding the reset for an abort the producer
/// cannot ack before it acks our connect.
#[test]
fn the_drain_retires_a_load_whose_fetch_never_left() {
    let mut m = Mock::new();
    let peer = m.peer.clone();
    m.dial("r", RequestRoles::prefiller(peer.clone()));
    m.load(7, "r", vec![key(1)], vec![0]);
    m.take_sent();
    assert_eq!(m.core.abort_loads(m.now), 0, "nothing to abort on the wire");
    m.pump();
    assert_eq!(m.load_results(), vec![(JobId::new(7), false)]);
    assert!(!m.core.session_state(&peer).unwrap().pending_work);
    m.recv(Message::ConnectAck(ConnectAck {
        peer_id: peer.clone(),
    }));
    assert_eq!(
        fetches_and_aborts(&m.take_sent()),
        (vec![vec![]], 0),
        "only the terminal fetch goes"
    );
    m.advance(Duration::from_secs(60));
    assert_eq!(m.load_results().len(), 1);
    m.finish("r");
    m.assert_clean();
}

/// vLLM 0.34 (`TestDisconnect.test_dead_connection_does_not_flush_unsent_fetch`, S:3226):
/// when the connection dies before the peer acked our `connect`, a load whose fetch never
/// left fails with its blocks handed back at once (no held release: the peer never learned of
/// them); a load whose fetch was handed on is held until the plane fences it, as before.
#[test]
fn a_session_lost_before_its_ack_hands_back_the_blocks_of_fetches_never_sent() {
    for sent in [false, true] {
        let mut m = Mock::new();
        m.plane().fence_needs_write_end = true;
        let peer = m.peer.clone();
        if sent {
            m.ready_source("r");
        } else {
            m.dial("r", RequestRoles::prefiller(peer.clone()));
        }
        m.load(5, "r", vec![key(1)], vec![10]);
        // A write the plane cannot rule out without the peer's end (nixl after a close).
        m.stall_write(10);
        m.core
            .handle_connection_lost(m.now, &peer, LinkLoss::ClosedByPeer);
        m.pump();
        assert!(m.closed().is_some(), "sent {sent}: the session ended");
        if sent {
            assert!(m.load_results().is_empty(), "the handed-on fetch is held");
            assert_eq!(m.held_loads(), vec![JobId::new(5)]);
            m.plane().writing.clear();
            m.advance(S(5));
        } else {
            assert!(m.held_loads().is_empty(), "nothing to hold");
        }
        assert_eq!(
            m.load_results(),
            vec![(JobId::new(5), false)],
            "sent {sent}: failed once"
        );
        let fetches = m
            .take_sent()
            .iter()
            .filter(|msg| matches!(msg, Message::Fetch(_)))
            .count();
        assert_eq!(
            fetches,
            usize::from(sent),
            "sent {sent}: fetches on the wire"
        );
        m.finish("r");
        m.assert_clean();
    }
}

/// Found by review: a load that times out with its fetch unsent while a later round of the
/// same request waits behind it must not queue a terminal fetch after that round's fetch (the
/// producer would close the live round: no `transfer_done` for it, ever). The later round is
/// served.
#[test]
fn a_retired_fetch_leaves_no_terminal_behind_a_live_later_round() {
    let (mut m, peer) = pd_load_before_the_ack();
    m.advance(Duration::from_secs(20));
    m.load(8, "r", vec![key(2)], vec![1]);
    m.advance(Duration::from_secs(11));
    assert_eq!(m.load_results(), vec![(JobId::new(7), false)]);
    m.take_sent();
    m.recv(Message::ConnectAck(ConnectAck {
        peer_id: peer.clone(),
    }));
    let sent = m.take_sent();
    assert_eq!(
        fetches_and_aborts(&sent),
        (vec![vec![1]], 0),
        "only round 1's fetch, no terminal: {sent:?}"
    );
    m.recv(transfer_done("r", true, 1));
    assert_eq!(
        m.load_results(),
        vec![(JobId::new(7), false), (JobId::new(8), true)]
    );
    m.finish("r");
    m.assert_clean();
}
