//! A misbehaving peer costs only itself (docs/security.md, G7): one core, two scripted peers
//! (an attacker and an honest one). Pins past a peer's share answer MISS while the other peer
//! still hits and pins; a max-size lookup is served in slices with the other peer's lookup
//! answered in between; a peer past its keys-per-second budget yields to peers within theirs (and,
//! alone, is served on: work-conserving) without its session ending; the
//! state a peer can make the node hold is bounded.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvpeer_core::{Core, CoreConfig, PeerShare};
use kvpeer_proto::{Connect, ConnectAck, DecodeLimits, Message, OffloadKey, PeerId};
use support::cluster::{key, local, peer_id, TestCore};
use support::fakes::{FakeParent, FakePlane};
use support::mock::{fetch, lookup_msg};

/// One core and any number of scripted peers, with virtual time.
struct Peers {
    now: Instant,
    core: TestCore,
    sent: HashMap<PeerId, Vec<Message>>,
}

impl Peers {
    fn new(config: CoreConfig) -> Self {
        let now = Instant::now();
        let mut core = Core::new(
            config,
            local(0),
            FakeParent::default(),
            FakePlane::default(),
            now,
        );
        core.set_decode_limits(DecodeLimits::default());
        Peers {
            now,
            core,
            sent: HashMap::new(),
        }
    }

    fn parent(&mut self) -> &mut FakeParent {
        self.core.parent_mut()
    }

    fn pump(&mut self) {
        while let Some(t) = self.core.poll_transmit() {
            self.sent.entry(t.peer).or_default().push(t.message);
        }
        while self.core.poll_event().is_some() {}
    }

    /// Peer `i` connects and completes the handshake.
    fn join(&mut self, i: usize) -> PeerId {
        self.join_as(peer_id(i), i)
    }

    /// A peer named `peer` (its pool that of `local(i)`) connects and completes the handshake.
    fn join_as(&mut self, peer: PeerId, i: usize) -> PeerId {
        assert!(self.core.handle_inbound(self.now, peer.clone()));
        let l = local(i);
        self.recv(
            &peer,
            Message::Connect(Connect {
                peer_id: peer.clone(),
                agent_metadata: l.agent_metadata,
                base_addr: l.base_addr,
                num_blocks: l.num_blocks,
                block_len: l.block_len,
                config_fingerprint: Some(l.config_fingerprint),
                hash_seed: l.hash_seed,
                kvpeer_auth: None,
            }),
        );
        self.recv(
            &peer,
            Message::ConnectAck(ConnectAck {
                peer_id: peer.clone(),
            }),
        );
        self.take(&peer);
        peer
    }

    fn recv(&mut self, peer: &PeerId, message: Message) {
        self.core.handle_message(self.now, peer, message);
        self.pump();
    }

    /// One step of the node's loop at the current instant: the deadlines that are due.
    fn step(&mut self) {
        if self.core.poll_timeout().is_some_and(|t| t <= self.now) {
            self.core.handle_timeout(self.now);
        }
        self.pump();
    }

    /// Advances virtual time, firing every deadline on the way.
    fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            self.pump();
            match self.core.poll_timeout() {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.core.handle_timeout(self.now);
                }
                _ => break,
            }
        }
        self.now = end;
        self.core.handle_timeout(self.now);
        self.pump();
    }

    fn take(&mut self, peer: &PeerId) -> Vec<Message> {
        self.pump();
        self.sent.remove(peer).unwrap_or_default()
    }

    /// The `lookup_resp`s sent to `peer` (taken), as (request, hits).
    fn responses(&mut self, peer: &PeerId) -> Vec<(String, Vec<OffloadKey>, Vec<bool>)> {
        self.take(peer)
            .into_iter()
            .filter_map(|m| match m {
                Message::LookupResp(r) => Some((r.kv_request_id.to_string(), r.keys, r.hits)),
                _ => None,
            })
            .collect()
    }

    fn share(&self, peer: &PeerId) -> PeerShare {
        self.core.peer_share(peer).expect("a session")
    }

    fn alive(&self, peer: &PeerId) -> bool {
        self.core.session_state(peer).is_some()
    }
}

fn keys(range: std::ops::Range<u64>) -> Vec<OffloadKey> {
    range.map(key).collect()
}

#[test]
fn a_peer_past_its_pin_share_gets_miss_while_another_still_hits_and_pins() {
    let config = CoreConfig {
        max_pins_per_peer: Some(8),
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    for k in keys(0..64) {
        p.parent().insert(&k);
    }
    let attacker = p.join(1);
    let honest = p.join(2);

    // The attacker looks up every key and never fetches.
    p.recv(&attacker, lookup_msg("a1", keys(0..64), 0));
    let resp = p.responses(&attacker);
    assert_eq!(resp.len(), 1, "one lookup_resp per lookup");
    let hits = &resp[0].2;
    assert_eq!(hits.len(), 64);
    assert!(hits[..8].iter().all(|h| *h), "its share hits: {hits:?}");
    assert!(hits[8..].iter().all(|h| !*h), "past its share: MISS");
    p.recv(&attacker, lookup_msg("a2", keys(0..64), 0));
    assert!(p.responses(&attacker)[0].2.iter().all(|h| !h));
    assert_eq!(p.share(&attacker).pinned_blocks, 8);
    assert_eq!(p.parent().lookup_jobs, 1, "only the share was pinned");
    assert_eq!(p.core.counters().lookup_keys_over_share, 56 + 64);

    // The honest peer still hits, its blocks are pinned, and its fetch is served.
    let pins_before = p.parent().pins.len();
    p.recv(&honest, lookup_msg("h", keys(10..16), 0));
    let resp = p.responses(&honest);
    assert_eq!(resp.len(), 1);
    assert_eq!(resp[0].2, vec![true; 6]);
    assert_eq!(
        p.parent().pins.len(),
        pins_before + 1,
        "pinned for the honest peer"
    );
    assert_eq!(p.share(&honest).pinned_blocks, 6);
    p.recv(&honest, fetch("h", keys(10..16), (0..6).collect(), 0));
    let running = p.core.plane_mut().running();
    assert_eq!(running.len(), 1, "the honest fetch is written");
    p.core.plane_mut().end(running[0], true);
    p.core.handle_data_plane(p.now);
    let done: Vec<Message> = p.take(&honest);
    assert!(
        done.iter()
            .any(|m| matches!(m, Message::TransferDone(t) if t.success)),
        "{done:?}"
    );
    assert_eq!(p.share(&honest).pinned_blocks, 0, "its pin went back");

    // The attacker's pins go at the store timeout; then it may pin its share again.
    p.advance(Duration::from_secs(31));
    assert_eq!(p.share(&attacker).pinned_blocks, 0);
    assert!(p.alive(&attacker) && p.alive(&honest));
    p.recv(&attacker, lookup_msg("a3", keys(0..16), 0));
    let hits = &p.responses(&attacker)[0].2;
    assert_eq!(hits.iter().filter(|h| **h).count(), 8);
}

#[test]
fn a_max_size_lookup_is_served_in_slices_with_another_peers_lookup_answered_between() {
    let config = CoreConfig::default();
    let (slice, cap) = (config.lookup_slice_keys, config.max_lookup_keys);
    let mut p = Peers::new(config);
    let n = DecodeLimits::default().max_list_len as u64;
    // A few keys held: one inside the asked part, one past `max_lookup_keys`.
    p.parent().insert(&key(7));
    p.parent().insert(&key(cap as u64 + 5));
    for k in keys(1_000_000_000..1_000_000_003) {
        p.parent().insert(&k);
    }
    let attacker = p.join(1);
    let honest = p.join(2);

    let started = Instant::now();
    p.recv(&attacker, lookup_msg("huge", keys(0..n), 0));
    let first_slice = started.elapsed();
    assert!(p.responses(&attacker).is_empty(), "not answered in one go");
    assert_eq!(p.parent().lookups, slice, "one slice asked");

    // The honest peer's lookup, arriving meanwhile, is answered at once.
    let honest_keys = keys(1_000_000_000..1_000_000_003);
    p.recv(&honest, lookup_msg("h", honest_keys.clone(), 0));
    let resp = p.responses(&honest);
    assert_eq!(resp, vec![("h".into(), honest_keys, vec![true; 3])]);
    assert!(p.responses(&attacker).is_empty());

    // Each further step of the loop asks one more slice, until the cap.
    let mut steps = 0;
    let mut resp = Vec::new();
    let started = Instant::now();
    while resp.is_empty() {
        steps += 1;
        assert!(steps <= cap / slice + 2, "bounded");
        p.step();
        resp = p.responses(&attacker);
        assert!(p.parent().lookups <= 3 + slice * (steps + 1));
    }
    let rest = started.elapsed();
    assert_eq!(steps, cap.div_ceil(slice) - 1);
    assert_eq!(resp.len(), 1, "one lookup_resp for the lookup");
    let (_, keys_back, hits) = &resp[0];
    assert_eq!(keys_back.len(), n as usize, "every key, in wire order");
    assert_eq!(keys_back[12345], key(12345));
    let held: Vec<usize> = (0..hits.len()).filter(|&i| hits[i]).collect();
    assert_eq!(held, vec![7], "the key past max_lookup_keys is not asked");
    assert_eq!(p.parent().lookups, cap + 3);
    assert_eq!(
        p.core.counters().lookup_keys_over_cap,
        n - cap as u64,
        "counted"
    );
    let share = p.share(&attacker);
    assert_eq!(
        (share.held_keys, share.pinned_blocks),
        (1, 1),
        "once answered, only its pin of the one hit is held"
    );
    assert!(p.alive(&attacker));
    eprintln!(
        "lookup of {n} keys: first slice of {slice} keys {first_slice:?} (incl. the copy of the \
         message), {steps} more slices {rest:?} ({:.2} us per key asked)",
        rest.as_secs_f64() * 1e6 / (cap - slice) as f64
    );
}

/// A step asks `lookup_slice_keys` keys in all, hosts in turn, and many sessions of one host
/// share its turn: four sessions of host 10.0.0.9 and one session on each of three other hosts,
/// each with a 4,096-key lookup queued, are served one slice per step; the three lone hosts'
/// lookups are answered after 4 x 15 steps while the four sessions of 10.0.0.9 together have
/// had a quarter of them (none answered yet), and all are answered in full in the end. A lookup
/// of another host that arrives meanwhile is answered at once.
#[test]
fn a_step_serves_hosts_in_turn_and_a_hosts_sessions_share_its_turn() {
    let config = CoreConfig::default();
    let slice = config.lookup_slice_keys;
    let per_lookup = 4096 / slice;
    let mut p = Peers::new(config);
    let many: Vec<PeerId> = (0..4)
        .map(|i| p.join_as(PeerId::new(format!("10.0.0.9:{}", 6000 + i)), 10 + i))
        .collect();
    let lone: Vec<PeerId> = (0..3)
        .map(|i| p.join_as(PeerId::new(format!("10.0.1.{}:7000", i + 1)), 20 + i))
        .collect();
    let honest = p.join(2);
    for (i, peer) in many.iter().chain(&lone).enumerate() {
        let base = 10_000 * i as u64;
        p.recv(peer, lookup_msg("big", keys(base..base + 4096), 0));
    }
    // Each lookup's first slice is asked as it arrives (charged to its connection).
    assert_eq!(p.parent().lookups, 7 * slice);
    for step in 0..4 * (per_lookup - 1) {
        let asked = p.parent().lookups;
        p.step();
        assert_eq!(
            p.parent().lookups - asked,
            slice,
            "step {step} asks one slice in all"
        );
        if step == 10 {
            let asked = p.parent().lookups;
            p.recv(&honest, lookup_msg("h", keys(500_000..500_008), 0));
            assert_eq!(p.responses(&honest).len(), 1, "answered at once");
            assert_eq!(p.parent().lookups - asked, 8);
        }
    }
    for peer in &lone {
        assert_eq!(p.responses(peer).len(), 1, "a lone host's lookup is done");
    }
    let answered = |p: &mut Peers| {
        many.iter()
            .map(|peer| p.responses(peer).len())
            .sum::<usize>()
    };
    assert_eq!(
        answered(&mut p),
        0,
        "the four sessions of one host had one host's turns, not four"
    );
    for _ in 0..4 * per_lookup {
        p.step();
    }
    assert_eq!(answered(&mut p), 4, "each big lookup answered in full");
}

/// Work-conserving: with nobody else wanting the core's steps, a peer past its keys-per-second
/// budget is served on, without waiting for its bucket (before, its lookups waited a second
/// per budget's worth however idle the node was).
#[test]
fn a_lone_peer_is_not_held_to_the_keys_per_second_budget() {
    let config = CoreConfig {
        lookup_keys_per_sec: 10_000,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    p.parent().insert(&key(29_999));
    let lone = p.join(1);
    for r in 0..3 {
        p.recv(
            &lone,
            lookup_msg(&format!("a{r}"), keys(r * 10_000..(r + 1) * 10_000), 0),
        );
    }
    // Steps at the same instant (no time for the bucket to refill): three budgets' worth.
    for _ in 0..4 * 30_000 / CoreConfig::default().lookup_slice_keys {
        p.step();
    }
    let answered = p.responses(&lone);
    assert_eq!(answered.len(), 3, "all three lookups answered at once");
    assert_eq!(p.parent().lookups, 30_000, "every key asked");
    assert!(answered[2].2[9_999], "its last key hit");
    assert!(
        p.core.poll_timeout().is_none_or(|t| t > p.now),
        "nothing left to serve: no wake now"
    );
}

/// Under contention the budget bites: a peer past it yields every step to a peer within its
/// own, keeps its session, and is served on in the steps nobody else wants.
#[test]
fn the_keys_per_second_budget_yields_to_peers_within_theirs() {
    let config = CoreConfig {
        lookup_keys_per_sec: 10_000,
        ..CoreConfig::default()
    };
    let slice = CoreConfig::default().lookup_slice_keys as u64;
    let mut p = Peers::new(config);
    p.parent().insert(&key(1));
    p.parent().insert(&key(100_000));
    let attacker = p.join(1);
    let honest = p.join(2);
    // The attacker spends its second's budget alone.
    p.recv(&attacker, lookup_msg("a0", keys(0..10_000), 0));
    while p.responses(&attacker).is_empty() {
        p.step();
    }
    assert_eq!(p.parent().lookups, 10_000);
    // Two more of its lookups, and the honest peer's large one, queued at the same instant.
    p.recv(&attacker, lookup_msg("a1", keys(10_000..20_000), 0));
    p.recv(&attacker, lookup_msg("a2", keys(20_000..30_000), 0));
    assert_eq!(
        p.parent().lookups,
        10_000,
        "nothing of the attacker's asked at arrival"
    );
    p.recv(&honest, lookup_msg("h", keys(100_000..105_000), 0));
    let mut steps = 0;
    let honest_answer = loop {
        let r = p.responses(&honest);
        if !r.is_empty() {
            break r;
        }
        p.step();
        steps += 1;
        assert!(steps < 1_000, "the honest lookup was never answered");
    };
    assert!(honest_answer[0].2[0], "the honest peer's key hits");
    // Every step went to the honest peer's slices; the attacker had at most what the honest
    // peer's last slice left of the last step.
    let attacker_asked = p.parent().lookups as u64 - 10_000 - 5_000;
    assert!(
        attacker_asked <= slice,
        "the attacker over its budget had {attacker_asked} keys asked in the {steps} steps the \
         honest peer wanted"
    );
    // With the honest peer done, the attacker takes the idle steps, still at the same instant.
    for _ in 0..4 * 20_000 / slice {
        p.step();
    }
    assert_eq!(p.responses(&attacker).len(), 2);
    assert_eq!(p.parent().lookups, 35_000);
    assert!(p.core.counters().lookup_slices_deferred > 0);
    assert!(p.alive(&attacker), "deferred, not disconnected");
    let share = p.share(&attacker);
    assert_eq!(
        (share.held_keys, share.pinned_blocks),
        (1, 1),
        "its one pin"
    );
}

/// A lookup's keys still unasked when its pending deadline comes answer MISS, the rest as the
/// store said; the session is kept. One key a step (`lookup_slice_keys = 1`), a step a
/// millisecond: the node's thread is the limit here, about 5,000 keys in the 5 s.
#[test]
fn keys_still_unasked_at_the_pending_deadline_answer_miss() {
    let config = CoreConfig {
        lookup_slice_keys: 1,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    for k in keys(0..10_000) {
        p.parent().insert(&k);
    }
    let attacker = p.join(1);
    p.recv(&attacker, lookup_msg("a", keys(0..10_000), 0));
    for _ in 0..4_900 {
        p.now += Duration::from_millis(1);
        p.step();
    }
    assert!(p.responses(&attacker).is_empty());
    for _ in 0..200 {
        p.now += Duration::from_millis(1);
        p.step();
    }
    let resp = p.responses(&attacker);
    assert_eq!(resp.len(), 1, "answered at the deadline");
    let hits = &resp[0].2;
    let asked = hits.iter().filter(|h| **h).count();
    assert!(
        (5_000..=6_100).contains(&asked),
        "{asked} keys asked in 5 s"
    );
    assert!(hits[..asked].iter().all(|h| *h) && hits[asked..].iter().all(|h| !h));
    assert_eq!(
        p.core.counters().lookup_keys_unasked,
        (10_000 - asked) as u64
    );
    assert!(p.alive(&attacker));
}

#[test]
fn what_a_peer_can_make_the_node_hold_is_bounded() {
    let config = CoreConfig {
        max_held_keys_per_peer: 1_000,
        max_requests_per_peer: 4,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    // Keys the store cannot answer yet: the lookups stay open until their deadline (the store
    // says when it knows more, so the core does not re-ask on a timer).
    p.parent().wakes_core = true;
    for k in keys(0..2_000) {
        p.parent().retry.insert(k);
    }
    let attacker = p.join(1);
    let honest = p.join(2);
    p.recv(&attacker, lookup_msg("a1", keys(0..600), 0));
    assert!(p.responses(&attacker).is_empty(), "held, pending");
    assert_eq!(p.share(&attacker).held_keys, 600);
    // Past its share of held keys: answered MISS at once, nothing held.
    p.recv(&attacker, lookup_msg("a2", keys(600..1_200), 0));
    let resp = p.responses(&attacker);
    assert_eq!(resp.len(), 1);
    assert_eq!(resp[0].2, vec![false; 600]);
    assert_eq!(p.share(&attacker).held_keys, 600);
    assert_eq!(p.core.counters().lookups_over_budget, 1);

    // Fetches for ids nothing will store: parked (PD) up to the request share, the rest fail.
    for r in 0..10u64 {
        p.recv(
            &attacker,
            fetch(&format!("f{r}"), keys(5_000 + r..5_001 + r), vec![r], 0),
        );
    }
    let failed = p
        .take(&attacker)
        .into_iter()
        .filter(|m| matches!(m, Message::TransferDone(t) if !t.success))
        .count();
    let share = p.share(&attacker);
    assert!(share.requests <= 4, "{share:?}");
    assert_eq!(failed, 10 - 3, "a1 holds one request, three fetches parked");
    assert_eq!(share.held_keys, 603);
    assert!(share.held_bytes > 0);
    assert!(p.core.counters().fetches_over_budget >= 7);

    // The honest peer is unaffected.
    p.parent().insert(&key(9_999));
    p.recv(&honest, lookup_msg("h", vec![key(9_999)], 0));
    assert_eq!(p.responses(&honest)[0].2, vec![true]);

    // Everything held goes back at the deadlines; the session lives on.
    p.advance(Duration::from_secs(31));
    let share = p.share(&attacker);
    assert_eq!((share.held_keys, share.requests), (0, 0), "{share:?}");
    assert!(p.alive(&attacker));
}

#[test]
fn long_keys_count_against_the_peers_share_of_bytes() {
    let config = CoreConfig {
        max_held_bytes_per_peer: 1 << 20,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    let long = |i: u32| OffloadKey::from(&[&i.to_be_bytes()[..], &[0xab; 1020]].concat()[..]);
    let first: Vec<OffloadKey> = (0..300).map(long).collect();
    let second: Vec<OffloadKey> = (300..600).map(long).collect();
    p.parent().wakes_core = true;
    for k in first.iter().chain(&second) {
        p.parent().retry.insert(k.clone());
    }
    let attacker = p.join(1);
    p.recv(&attacker, lookup_msg("a1", first, 0));
    assert!(p.responses(&attacker).is_empty(), "held, pending");
    let held = p.share(&attacker).held_bytes;
    assert!((600_000..1 << 20).contains(&held), "{held} bytes estimated");
    p.recv(&attacker, lookup_msg("a2", second, 0));
    let resp = p.responses(&attacker);
    assert_eq!(resp.len(), 1, "past the share of bytes: answered at once");
    assert_eq!(resp[0].2, vec![false; 300]);
    assert_eq!(p.share(&attacker).held_bytes, held);
    p.advance(Duration::from_secs(6));
    assert_eq!(p.share(&attacker).held_bytes, 0);
    assert!(p.alive(&attacker));
}

/// vLLM accepts request ids as long as a message can carry (its own vectors have 70,000
/// bytes): the node keeps copies of a peer's id while its request is open, so the id's length
/// is paid from the peer's share of bytes like its keys; an honest peer still hits.
#[test]
fn long_request_ids_count_against_the_peers_share_of_bytes() {
    let config = CoreConfig {
        max_held_bytes_per_peer: 1 << 20,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    p.parent().wakes_core = true;
    for k in keys(0..10) {
        p.parent().retry.insert(k);
    }
    let attacker = p.join(1);
    let honest = p.join(2);
    let id = |i: u64| format!("{i}{}", "r".repeat(100_000));
    // Each lookup holds one key, and an id of 100 KB: about 400 KB of the peer's 1 MiB.
    p.recv(&attacker, lookup_msg(&id(0), keys(0..1), 0));
    p.recv(&attacker, lookup_msg(&id(1), keys(1..2), 0));
    assert!(p.responses(&attacker).is_empty(), "held, pending");
    let held = p.share(&attacker).held_bytes;
    assert!((800_000..1 << 20).contains(&held), "{held} bytes estimated");
    p.recv(&attacker, lookup_msg(&id(2), keys(2..3), 0));
    let resp = p.responses(&attacker);
    assert_eq!(resp.len(), 1, "past the share of bytes: answered at once");
    assert_eq!(resp[0].2, vec![false]);
    assert_eq!(p.share(&attacker).held_bytes, held);
    p.parent().insert(&key(9_999));
    p.recv(&honest, lookup_msg("h", vec![key(9_999)], 0));
    assert_eq!(p.responses(&honest)[0].2, vec![true]);
    p.advance(Duration::from_secs(6));
    assert_eq!(p.share(&attacker).held_bytes, 0);
    assert!(p.alive(&attacker));
}

/// A request stays open after its lookup is answered (its pins wait for the fetch, up to the
/// store timeout) and the node keeps its id meanwhile: the id is paid for as long as the
/// request lives, not only while its lookup is unanswered. Lookups with 100 KB ids hitting one
/// shared block are answered HIT until the peer's share of bytes is spent, then MISS at once;
/// the share comes back when the requests end; an honest peer hits throughout.
#[test]
fn a_long_id_is_paid_for_as_long_as_its_request_is_open() {
    let config = CoreConfig {
        max_held_bytes_per_peer: 1 << 20,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    p.parent().insert(&key(1));
    p.parent().insert(&key(9_999));
    let attacker = p.join(1);
    let honest = p.join(2);
    let id = |i: u64| format!("{i}{}", "r".repeat(100_000));
    let mut hits = 0;
    for i in 0..100 {
        p.recv(&attacker, lookup_msg(&id(i), keys(1..2), 0));
        let resp = p.responses(&attacker);
        assert_eq!(resp.len(), 1, "lookup {i} answered at once");
        if resp[0].2 == vec![true] {
            hits += 1;
        } else {
            break;
        }
    }
    // About 400 KB per open request: two fit in 1 MiB, a third does not.
    assert_eq!(hits, 2, "requests answered HIT while their ids were held");
    assert!(p.share(&attacker).held_bytes > 800_000);
    p.recv(&honest, lookup_msg("h", vec![key(9_999)], 0));
    assert_eq!(p.responses(&honest)[0].2, vec![true]);
    // The requests end (their pins at the store timeout): the share is whole again.
    p.advance(Duration::from_secs(31));
    assert_eq!(p.share(&attacker).held_bytes, 0);
    p.recv(&attacker, lookup_msg(&id(1_000), keys(1..2), 0));
    assert_eq!(p.responses(&attacker)[0].2, vec![true]);
    assert!(p.alive(&attacker));
}

/// Many sessions, each within its own share of held bytes, cannot together hold more than the
/// node's `max_held_bytes` (twice it at worst): once the total is past it a peer takes more
/// only within an equal part of it, so the later attackers' long-id lookups answer MISS at
/// once; an honest peer holding little still hits; everything comes back when the lookups end.
#[test]
fn the_peers_together_hold_at_most_the_nodes_share_of_bytes() {
    let config = CoreConfig {
        max_held_bytes_per_peer: 1 << 20,
        max_held_bytes: 2 << 20,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    p.parent().wakes_core = true;
    for k in keys(0..100) {
        p.parent().retry.insert(k);
    }
    p.parent().insert(&key(9_999));
    let attackers: Vec<_> = (1..=8).map(|i| p.join(i)).collect();
    let honest = p.join(20);
    let id = |i: u64| format!("{i}{}", "r".repeat(100_000));
    let mut refused = 0;
    for (a, attacker) in attackers.iter().enumerate() {
        for j in 0..3u64 {
            let n = a as u64 * 3 + j;
            // A pending key: the lookup (and its 100 KB id) stays held.
            p.recv(attacker, lookup_msg(&id(n), keys(n..n + 1), 0));
            if !p.responses(attacker).is_empty() {
                refused += 1;
            }
        }
    }
    let held: usize = attackers.iter().map(|a| p.share(a).held_bytes).sum();
    println!("attackers hold {held} bytes; {refused} lookups refused");
    // Each alone could hold 2 lookups (~800 KB): 6.4 MB for the 8 without a node cap.
    assert!(held <= 4 << 20, "{held} bytes held by the attackers");
    assert!(held < 3_000_000, "{held} bytes held by the attackers");
    assert!(refused >= 8 + 3, "{refused} refused");
    p.recv(&honest, lookup_msg("h", vec![key(9_999)], 0));
    assert_eq!(p.responses(&honest)[0].2, vec![true]);
    p.advance(Duration::from_secs(6));
    for a in &attackers {
        assert_eq!(p.share(a).held_bytes, 0);
        assert!(p.alive(a));
    }
}

#[test]
fn the_pin_share_counts_distinct_blocks_and_bounds_repeated_pins() {
    let config = CoreConfig {
        max_pins_per_peer: Some(8),
        // 16 pins of 4 blocks, and the 4 keys of the lookup being served.
        max_held_keys_per_peer: 68,
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    for k in keys(0..4) {
        p.parent().insert(&k);
    }
    let peer = p.join(1);
    // The same four keys, looked up again and again (as many requests of one prompt do): each
    // pins the same blocks, so the share of distinct blocks is never reached...
    for r in 0..16 {
        p.recv(&peer, lookup_msg(&format!("r{r}"), keys(0..4), 0));
        assert_eq!(p.responses(&peer)[0].2, vec![true; 4], "lookup {r}");
    }
    assert_eq!(p.share(&peer).pinned_blocks, 4);
    assert_eq!(p.share(&peer).pins, 16);
    // ...but the pins themselves are bounded: each pin reference is held for the peer.
    p.recv(&peer, lookup_msg("r16", keys(0..4), 0));
    assert_eq!(p.responses(&peer)[0].2, vec![false; 4]);
    assert_eq!(p.share(&peer).pins, 16);
    p.advance(Duration::from_secs(31));
    assert_eq!(p.share(&peer).pinned_blocks, 0);
    assert_eq!(p.share(&peer).pins, 0);
}

/// All peers' pins together are capped (`max_pinned_blocks`), with eviction: a hoarder holding
/// its share of pins, never fetched, loses its oldest ones when an honest peer's lookups need
/// room, so the honest peer hits, pins and is served byte-for-byte as asked; the hoarder's later
/// fetch of an evicted lookup fails at once (from its side: `transfer_done(success=false)`, no
/// write), and its newest pins still serve it.
#[test]
fn all_peers_pins_are_capped_and_the_heaviest_holders_oldest_go_first() {
    let config = CoreConfig {
        max_pins_per_peer: Some(32),
        max_pinned_blocks: Some(40),
        ..CoreConfig::default()
    };
    let mut p = Peers::new(config);
    for k in keys(0..64) {
        p.parent().insert(&k);
    }
    let hoarder = p.join(1);
    let honest = p.join(2);

    // The hoarder pins its whole share in two lookups, oldest first, and never fetches.
    p.recv(&hoarder, lookup_msg("old", keys(0..16), 0));
    p.recv(&hoarder, lookup_msg("new", keys(16..32), 0));
    for (_, _, hits) in p.responses(&hoarder) {
        assert!(hits.iter().all(|h| *h));
    }
    assert_eq!(p.share(&hoarder).pinned_blocks, 32);

    // The honest peer's 16 keys bring all pins to 48 > 40 at once: the honest peer hits and
    // pins, but the hoarder's pins are younger than `pin_eviction_min_age` (a fetch may be on
    // its way), so nothing goes yet.
    p.recv(&honest, lookup_msg("h", keys(40..56), 0));
    let resp = p.responses(&honest);
    assert_eq!(resp[0].2, vec![true; 16], "the honest peer hits");
    assert_eq!(p.core.counters().pins_evicted, 0, "young pins stay");
    // A second later (the next step of the node), the hoarder's oldest lookup goes.
    p.advance(Duration::from_millis(1500));
    assert_eq!(
        p.share(&honest).pinned_blocks,
        16,
        "the honest peer keeps its pins"
    );
    assert_eq!(
        p.share(&hoarder).pinned_blocks,
        16,
        "the hoarder's oldest 16 went"
    );
    assert_eq!(p.core.counters().pins_evicted, 16);
    assert!(
        p.alive(&hoarder) && p.alive(&honest),
        "eviction ends no session"
    );

    // The honest fetch is written and succeeds.
    p.recv(&honest, fetch("h", keys(40..56), (0..16).collect(), 0));
    let running = p.core.plane_mut().running();
    assert_eq!(running.len(), 1, "the honest fetch is written");
    p.core.plane_mut().end(running[0], true);
    p.core.handle_data_plane(p.now);
    assert!(p
        .take(&honest)
        .iter()
        .any(|m| matches!(m, Message::TransferDone(t) if t.success)));

    // From the hoarder's side: its evicted lookup's fetch fails at once, nothing written; its
    // newer one is still served.
    p.recv(&hoarder, fetch("old", keys(0..16), (0..16).collect(), 0));
    assert!(
        p.core.plane_mut().running().is_empty(),
        "no write for an evicted pin"
    );
    let got = p.take(&hoarder);
    assert!(
        got.iter()
            .any(|m| matches!(m, Message::TransferDone(t) if !t.success)),
        "{got:?}"
    );
    p.recv(&hoarder, fetch("new", keys(16..32), (0..16).collect(), 0));
    assert_eq!(
        p.core.plane_mut().running().len(),
        1,
        "its newest pins serve it"
    );
}

/// A fetch binds its id to the fetching session (a PD store for it later goes there): a
/// stream of terminal fetches (empty lists: "request finished") with fresh ids binds nothing,
/// however long; and a peer fetching an id another session already serves cannot take its
/// binding: the PD store for it is written to the session that fetched it first, byte for
/// byte the blocks the store named.
#[test]
fn fetches_cannot_grow_the_bindings_or_take_another_sessions() {
    let mut p = Peers::new(CoreConfig::default());
    let attacker = p.join(1);
    let honest = p.join(2);
    for i in 0..10_000 {
        p.recv(&attacker, fetch(&format!("t{i}"), vec![], vec![], 0));
    }
    assert_eq!(p.core.stats().bound_ids, 0, "terminal fetches bind nothing");

    // The honest consumer fetches "x" ahead of its store (PD); then the attacker names it.
    p.recv(&honest, fetch("x", keys(0..2), vec![5, 6], 0));
    p.recv(&attacker, fetch("x", keys(0..2), vec![1, 2], 0));
    assert_eq!(p.core.stats().bound_ids, 1);
    // The engine stores "x": its blocks are written to the honest consumer's blocks 5 and 6.
    let req = p.core.on_new_request(
        p.now,
        kvpeer_proto::KvRequestId::from("x"),
        kvpeer_core::RequestRoles::decoder(),
    );
    let (job, blocks) = p.parent().pin_for_store(&keys(0..2));
    p.core
        .submit_store(p.now, job, &req, keys(0..2), blocks.clone());
    p.pump();
    let writes: Vec<_> = p.core.plane().transfers.values().cloned().collect();
    assert_eq!(writes.len(), 1, "{writes:?}");
    assert_eq!(writes[0].peer, honest);
    assert_eq!(writes[0].local, blocks);
    assert_eq!(
        writes[0].remote,
        vec![
            kvpeer_core::BlockIndex::new(5),
            kvpeer_core::BlockIndex::new(6)
        ]
    );
    assert!(p.alive(&attacker) && p.alive(&honest));
}
