//! The tcp plane over TLS 1.3 with mutual authentication: blocks cross byte-exact and the wire
//! (recorded by a relay between the two planes) carries none of their bytes, nor the HELLO's
//! key; an untrusted, expired or wrong-name certificate is refused on both sides, each side
//! saying why, while an honest pair is still served; the policy refuses plaintext where TLS is
//! required and falls back only where it is preferred (and never for a writer that offered
//! TLS); certificates rotated on disk are taken by new connections while the open ones go on; a
//! write larger than the sockets crosses whole; a listener that never answers the handshake
//! faults the link within its deadline.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod tcp_support;
mod tls_support;

use kvpeer_core::{BlockIndex, DataPlane, PlanePoll, Registration, RemoteMemory, TransferId};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::tcp::{TcpLimits, TcpPlane};
use kvpeer_net::tls::{Tls, TlsFiles, TlsPolicy};
use kvpeer_proto::PeerId;
use kvpeer_store::Pool;
use tcp_support::*;
use tls_support::*;

const RX_ID: &str = "10.0.0.1:5710";
const TX_ID: &str = "10.0.0.2:5710";

fn with_tls(plane: TcpPlane, policy: TlsPolicy, files: &TlsFiles) -> TcpPlane {
    plane.with_tls(policy, Tls::load(files.clone()).unwrap())
}

/// A receiver (`RX_ID`) and a writer (`TX_ID`) over fresh pools, each with its policy and
/// files: (receiver's pool, writer's pool, receiver, writer).
fn pair(
    rx_tls: (TlsPolicy, &TlsFiles),
    tx_tls: (TlsPolicy, &TlsFiles),
) -> (Pool, Pool, TcpPlane, TcpPlane) {
    let (rx_pool, tx_pool) = (pool("rx"), pool("tx"));
    let rx = with_tls(
        plane(RX_ID, &rx_pool, TcpLimits::default()),
        rx_tls.0,
        rx_tls.1,
    );
    let tx = with_tls(
        plane(TX_ID, &tx_pool, TcpLimits::default()),
        tx_tls.0,
        tx_tls.1,
    );
    (rx_pool, tx_pool, rx, tx)
}

/// A pool of [`BLOCKS`] zeroed blocks in private memory.
fn pool(_tag: &str) -> Pool {
    Pool::anonymous(BLOCKS, LEN, false).unwrap()
}

/// A tcp plane for node `id` over `pool`, listening on a free loopback port.
fn plane(id: &str, pool: &Pool, limits: TcpLimits) -> TcpPlane {
    TcpPlane::new(
        PeerId::new(id),
        pool.writer(),
        "127.0.0.1:0",
        Arc::new(|| {}),
    )
    .unwrap()
    .with_limits(limits)
}

/// Block `b` of `pool`.
fn block(pool: &Pool, b: u64) -> Vec<u8> {
    pool.view().block(BlockIndex::new(b)).unwrap().to_vec()
}

/// Registers `rx` as a peer of `tx` (its `connect` as `tx` receives it, with `tcp` replaced by
/// `via` where given), and waits for the registration to settle.
fn link(tx: &mut TcpPlane, rx: &mut TcpPlane, via: Option<SocketAddr>) -> Registration {
    link_keyed(tx, rx, via, (BLOCKS, LEN), |_| {}).0
}

/// [`link`] for pools of `dims` (blocks, block length), with `edit` applied to the `connect`
/// as `tx` receives it; and the HELLO key `rx` issued for it.
fn link_keyed(
    tx: &mut TcpPlane,
    rx: &mut TcpPlane,
    via: Option<SocketAddr>,
    dims: (u64, u64),
    edit: impl FnOnce(&mut AgentMetadata),
) -> (Registration, Vec<u8>) {
    let advertised = AgentMetadata {
        agent: "rx".into(),
        tcp: Some(rx.addr().to_string()),
        ..Default::default()
    }
    .encode();
    let sent = rx.connect_metadata(&PeerId::new(TX_ID), None, &advertised);
    let mut meta = AgentMetadata::decode(&sent).unwrap();
    let key = meta.tcp_key.clone().unwrap();
    if let Some(via) = via {
        meta.tcp = Some(via.to_string());
    }
    edit(&mut meta);
    let memory = RemoteMemory {
        agent_metadata: meta.encode(),
        base_addr: 0,
        num_blocks: dims.0,
        block_len: dims.1,
    };
    let receiver = PeerId::new(RX_ID);
    tx.add_remote_peer(&receiver, &memory).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let state = tx.registration(&receiver);
        if state != Registration::Pending || Instant::now() > until {
            return (state, key);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Writes `tx`'s block `b` into `rx`'s block `b` and waits for the end: what `tx` polled.
fn transfer(tx: &mut TcpPlane, rx: &mut TcpPlane, b: u64) -> (Option<TransferId>, PlanePoll) {
    let receiver = PeerId::new(RX_ID);
    rx.expect_writes(&PeerId::new(TX_ID), &[BlockIndex::new(b)]);
    let tid = tx.write_blocks(&receiver, &[BlockIndex::new(b)], &[BlockIndex::new(b)]);
    let mut seen = PlanePoll::default();
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let poll = tx.poll(&receiver);
        seen.done.extend(poll.done);
        seen.failed.extend(poll.failed);
        if poll.peer_fault.is_some() {
            seen.peer_fault = poll.peer_fault;
        }
        if !seen.done.is_empty() || !seen.failed.is_empty() || seen.peer_fault.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    rx.end_writes(&PeerId::new(TX_ID), &[BlockIndex::new(b)]);
    (tid, seen)
}

#[test]
fn blocks_cross_byte_exact_over_mutual_tls_and_the_wire_carries_none_of_their_bytes_nor_the_key() {
    let pki = Pki::new("wire");
    let rx_files = pki.node("rx", &[loopback(), ip(10, 0, 0, 1)]);
    let tx_files = pki.node("tx", &[ip(10, 0, 0, 2)]);
    let (rx_store, mut tx_store, mut rx, mut tx) = pair(
        (TlsPolicy::Required, &rx_files),
        (TlsPolicy::Required, &tx_files),
    );
    let offered = rx.connect_metadata(&PeerId::new(TX_ID), None, &advertised(&rx));
    assert!(
        AgentMetadata::decode(&offered).unwrap().tcp_tls,
        "a node with TLS says so in its connect"
    );
    let relay = Relay::to(rx.addr());
    let (state, key) = link_keyed(&mut tx, &mut rx, Some(relay.addr), (BLOCKS, LEN), |_| {});
    assert_eq!(state, Registration::Done);
    let mut sent = Vec::new();
    for b in 0..BLOCKS {
        let bytes = fill_unique(&mut tx_store, b, 1000 + b);
        let (tid, poll) = transfer(&mut tx, &mut rx, b);
        assert_eq!(poll.done, vec![tid.unwrap()], "block {b}: {poll:?}");
        assert_eq!(block(&rx_store, b), bytes, "block {b} byte-exact");
        sent.push(bytes);
    }
    let wire = relay.seen.lock().unwrap().clone();
    assert!(wire.len() > (BLOCKS * LEN) as usize, "{} bytes", wire.len());
    assert_eq!(wire[0], 0x16, "the connection opened with a TLS handshake");
    for (b, bytes) in sent.iter().enumerate() {
        for window in bytes.chunks(32) {
            assert!(
                !contains(&wire, window),
                "block {b}'s bytes are on the wire"
            );
        }
    }
    assert!(!contains(&wire, &key), "the HELLO's key is on the wire");
    for magic in [&b"KVPH"[..], b"KVPW", TX_ID.as_bytes()] {
        assert!(!contains(&wire, magic), "{magic:?} is on the wire");
    }
}

#[test]
fn untrusted_expired_and_wrong_name_certificates_are_refused_on_both_sides() {
    let pki = Pki::new("refuse");
    let other = Pki::new("refuse-other");
    let rx_files = pki.node("rx", &[loopback(), ip(10, 0, 0, 1)]);
    // What the writer is told: the listener's alert, where it sent one (a certificate it refused);
    // where it refused only the HELLO, the connection's end, seen as EOF or as a failed send,
    // whichever of the two the reset reaches first.
    let ended: &[&str] = &["lost", "send failed"];
    let cases: Vec<(&str, TlsFiles, TlsFiles, &[&str])> = vec![
        (
            "a writer from another CA",
            rx_files.clone(),
            TlsFiles {
                ca: pki.dir.join("ca.pem"),
                ..other.node("tx-other-ca", &[ip(10, 0, 0, 2)])
            },
            &["TLS"],
        ),
        (
            "an expired writer",
            rx_files.clone(),
            pki.issue("tx-expired", &[ip(10, 0, 0, 2)], (2001, 2002)),
            &["TLS"],
        ),
        (
            "a writer whose certificate names another address",
            rx_files.clone(),
            pki.node("tx-wrong-name", &[ip(10, 0, 0, 3)]),
            ended,
        ),
        (
            "a listener whose certificate names the address dialed but not its identity",
            pki.node("rx-wrong-name", &[loopback()]),
            pki.node("tx-ok", &[ip(10, 0, 0, 2)]),
            &["TLS"],
        ),
    ];
    for (case, rx_files, tx_files, tx_says) in cases {
        let (rx_store, mut tx_store, mut rx, mut tx) = pair(
            (TlsPolicy::Required, &rx_files),
            (TlsPolicy::Required, &tx_files),
        );
        assert_eq!(link(&mut tx, &mut rx, None), Registration::Done, "{case}");
        let before = block(&rx_store, 0);
        fill_unique(&mut tx_store, 0, 7);
        let (_, poll) = transfer(&mut tx, &mut rx, 0);
        assert!(poll.done.is_empty(), "{case}: {poll:?}");
        let fault = poll
            .peer_fault
            .clone()
            .unwrap_or_else(|| panic!("{case}: the writer is not told: {poll:?}"));
        assert!(
            tx_says.iter().any(|says| fault.to_string().contains(says)),
            "{case}: {fault}"
        );
        assert_eq!(block(&rx_store, 0), before, "{case}: the pool was written");
        let until = Instant::now() + Duration::from_secs(5);
        while rx.counters().refused_hellos == 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            rx.counters().refused_hellos,
            1,
            "{case}: the listener refused it"
        );
    }
    // The honest pair, with the same CA and the listener's good certificate, is served.
    let (rx_store, mut tx_store, mut rx, mut tx) = pair(
        (TlsPolicy::Required, &rx_files),
        (
            TlsPolicy::Required,
            &pki.node("tx-honest", &[ip(10, 0, 0, 2)]),
        ),
    );
    assert_eq!(link(&mut tx, &mut rx, None), Registration::Done);
    let bytes = fill_unique(&mut tx_store, 3, 3);
    let (tid, poll) = transfer(&mut tx, &mut rx, 3);
    assert_eq!(poll.done, vec![tid.unwrap()], "{poll:?}");
    assert_eq!(block(&rx_store, 3), bytes);
}

#[test]
fn plaintext_is_refused_where_tls_is_required_and_taken_only_where_it_is_preferred() {
    let pki = Pki::new("policy");
    let rx_files = pki.node("rx", &[loopback(), ip(10, 0, 0, 1)]);
    let tx_files = pki.node("tx", &[ip(10, 0, 0, 2)]);

    // A plaintext writer (a raw socket with the right key) against "required", then
    // "preferred".
    for (policy, served) in [(TlsPolicy::Required, false), (TlsPolicy::Preferred, true)] {
        let store = pool("tls-plain");
        let mut rx = with_tls(
            plane(RX_ID, &store, TcpLimits::default()),
            policy,
            &rx_files,
        );
        let key = issue(&mut rx, TX_ID);
        rx.expect_writes(&PeerId::new(TX_ID), &[BlockIndex::new(1)]);
        let mut s = connect_hello(&rx, TX_ID, &key);
        let status = write(&mut s, 5, &[(1, 0x5a)]);
        if served {
            assert_eq!(status, Some(0), "{policy:?}");
            assert_eq!(block(&store, 1), vec![0x5a; LEN as usize]);
        } else {
            assert_eq!(status, None, "{policy:?}: a plaintext write was answered");
            assert!(block(&store, 1).iter().all(|b| *b == 0), "{policy:?}");
            assert_eq!(rx.counters().refused_hellos, 1);
        }
    }

    // A node requiring TLS refuses a peer whose connect offers none, saying so; one that
    // prefers it writes to that peer in plaintext; a node without TLS ignores the offer.
    let (rx_store, mut tx_store) = (pool("tls-offer-rx"), pool("tls-offer-tx"));
    let mut plain_rx = plane(RX_ID, &rx_store, TcpLimits::default());
    let mut tx = with_tls(
        plane(TX_ID, &tx_store, TcpLimits::default()),
        TlsPolicy::Required,
        &tx_files,
    );
    match link(&mut tx, &mut plain_rx, None) {
        Registration::Failed(e) => assert!(
            e.to_string().contains("offers no TLS") && e.to_string().contains("required"),
            "{e}"
        ),
        other => panic!("a peer without TLS was linked under required: {other:?}"),
    }
    let mut tx = with_tls(
        plane(TX_ID, &tx_store, TcpLimits::default()),
        TlsPolicy::Preferred,
        &tx_files,
    );
    assert_eq!(link(&mut tx, &mut plain_rx, None), Registration::Done);
    let bytes = fill_unique(&mut tx_store, 2, 2);
    let (tid, poll) = transfer(&mut tx, &mut plain_rx, 2);
    assert_eq!(poll.done, vec![tid.unwrap()], "{poll:?}");
    assert_eq!(block(&rx_store, 2), bytes);

    let mut tls_rx = with_tls(
        plane(RX_ID, &rx_store, TcpLimits::default()),
        TlsPolicy::Required,
        &rx_files,
    );
    let mut plain_tx = plane(TX_ID, &tx_store, TcpLimits::default());
    assert_eq!(link(&mut plain_tx, &mut tls_rx, None), Registration::Done);
    let (_, poll) = transfer(&mut plain_tx, &mut tls_rx, 4);
    assert!(
        poll.done.is_empty() && poll.peer_fault.is_some(),
        "a plaintext writer was served by a node requiring TLS: {poll:?}"
    );
}

#[test]
fn certificates_rotated_on_disk_are_taken_by_new_connections_while_open_ones_go_on() {
    let pki = Pki::new("rotate");
    let rx_files = pki.node("rx", &[loopback(), ip(10, 0, 0, 1)]);
    let tx_files = pki.node("tx", &[ip(10, 0, 0, 2)]);
    let (rx_store, mut tx_store) = (pool("tls-rot-rx"), pool("tls-rot-tx"));
    let rx_tls = Tls::load(rx_files.clone()).unwrap();
    let tx_tls = Tls::load(tx_files.clone()).unwrap();
    let mut rx =
        plane(RX_ID, &rx_store, TcpLimits::default()).with_tls(TlsPolicy::Required, rx_tls.clone());
    let mut tx =
        plane(TX_ID, &tx_store, TcpLimits::default()).with_tls(TlsPolicy::Required, tx_tls.clone());
    assert_eq!(link(&mut tx, &mut rx, None), Registration::Done);
    let (tid, poll) = transfer(&mut tx, &mut rx, 0);
    assert_eq!(poll.done, vec![tid.unwrap()]);

    // A half-written certificate is not taken: a new connection still handshakes with the
    // last good configuration.
    std::fs::write(&rx_files.cert, "-----BEGIN CERTIFICATE-----\ngarbage").unwrap();
    std::thread::sleep(kvpeer_net::tls::RELOAD_CHECK + Duration::from_millis(100));
    assert_eq!(link(&mut tx, &mut rx, None), Registration::Done);
    let (tid, poll) = transfer(&mut tx, &mut rx, 1);
    assert_eq!(poll.done, vec![tid.unwrap()], "{poll:?}");
    assert_eq!(rx_tls.reloads(), 0);

    // Both nodes move to a new CA: new certificates, keys and CA files, each replaced whole
    // (a rename). The open connection goes on; a new one can only handshake if both sides
    // took the new files (each trusts only the new CA).
    let renewed = Pki::new("rotate-new");
    let replace = |from: &TlsFiles, to: &TlsFiles| {
        for (a, b) in [
            (&from.cert, &to.cert),
            (&from.key, &to.key),
            (&from.ca, &to.ca),
        ] {
            let staged = b.with_extension("staged");
            std::fs::copy(a, &staged).unwrap();
            std::fs::rename(&staged, b).unwrap();
        }
    };
    replace(
        &renewed.node("rx", &[loopback(), ip(10, 0, 0, 1)]),
        &rx_files,
    );
    replace(&renewed.node("tx", &[ip(10, 0, 0, 2)]), &tx_files);
    std::thread::sleep(kvpeer_net::tls::RELOAD_CHECK + Duration::from_millis(100));
    let (tid, poll) = transfer(&mut tx, &mut rx, 2);
    assert_eq!(
        poll.done,
        vec![tid.unwrap()],
        "the open connection goes on: {poll:?}"
    );
    assert_eq!(
        (rx_tls.reloads(), tx_tls.reloads()),
        (0, 0),
        "nothing new was opened"
    );
    assert_eq!(link(&mut tx, &mut rx, None), Registration::Done);
    let bytes = fill_unique(&mut tx_store, 5, 5);
    let (tid, poll) = transfer(&mut tx, &mut rx, 5);
    assert_eq!(poll.done, vec![tid.unwrap()], "a new connection: {poll:?}");
    assert_eq!(block(&rx_store, 5), bytes);
    assert_eq!((rx_tls.reloads(), tx_tls.reloads()), (1, 1));
}

#[test]
fn a_write_larger_than_the_sockets_crosses_byte_exact_over_tls() {
    // 16 blocks of 1 MiB in one WRITE: both sockets fill, records wait in rustls for the
    // writable edge, the receiver drains records across many reads.
    const BIG: u64 = 1 << 20;
    const N: u64 = 16;
    let pki = Pki::new("large");
    let rx_files = pki.node("rx", &[ip(10, 0, 0, 1)]);
    let tx_files = pki.node("tx", &[ip(10, 0, 0, 2)]);
    let rx_pool = Pool::anonymous(N, BIG, false).unwrap();
    let mut tx_pool = Pool::anonymous(N, BIG, false).unwrap();
    let mut rx = with_tls(
        plane(RX_ID, &rx_pool, TcpLimits::default()),
        TlsPolicy::Required,
        &rx_files,
    );
    let mut tx = with_tls(
        plane(TX_ID, &tx_pool, TcpLimits::default()),
        TlsPolicy::Required,
        &tx_files,
    );
    let (state, _) = link_keyed(&mut tx, &mut rx, None, (N, BIG), |_| {});
    assert_eq!(state, Registration::Done);
    let all: Vec<BlockIndex> = (0..N).map(BlockIndex::new).collect();
    let sent: Vec<Vec<u8>> = (0..N)
        .map(|b| fill_unique(&mut tx_pool, b, 500 + b))
        .collect();
    for round in 0..2 {
        rx.expect_writes(&PeerId::new(TX_ID), &all);
        let tid = tx.write_blocks(&PeerId::new(RX_ID), &all, &all).unwrap();
        let until = Instant::now() + Duration::from_secs(30);
        let mut poll = PlanePoll::default();
        while poll.done.is_empty() && poll.peer_fault.is_none() && Instant::now() < until {
            poll = tx.poll(&PeerId::new(RX_ID));
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(poll.done, vec![tid], "round {round}: {poll:?}");
        rx.end_writes(&PeerId::new(TX_ID), &all);
        for (b, bytes) in sent.iter().enumerate() {
            assert!(
                block(&rx_pool, b as u64) == *bytes,
                "round {round}: block {b}"
            );
        }
    }
}

#[test]
fn a_listener_that_never_answers_the_handshake_faults_the_link_within_its_deadline() {
    let pki = Pki::new("silent");
    let rx_files = pki.node("rx", &[loopback(), ip(10, 0, 0, 1)]);
    let tx_files = pki.node("tx", &[ip(10, 0, 0, 2)]);
    let (rx_store, _tx_store, mut rx, mut tx) = pair(
        (TlsPolicy::Required, &rx_files),
        (TlsPolicy::Required, &tx_files),
    );
    // Takes the connection and never answers: the handshake cannot finish.
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = silent.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in silent.incoming().flatten() {
            held.push(s);
        }
    });
    assert_eq!(link(&mut tx, &mut rx, Some(at)), Registration::Done);
    let started = Instant::now();
    let (_, poll) = transfer(&mut tx, &mut rx, 0);
    let fault = poll
        .peer_fault
        .clone()
        .unwrap_or_else(|| panic!("{poll:?}"));
    assert!(fault.to_string().contains("no TLS handshake"), "{fault}");
    assert!(
        started.elapsed() < Duration::from_secs(9),
        "{:?}",
        started.elapsed()
    );
    assert!(block(&rx_store, 0).iter().all(|b| *b == 0));
}

#[test]
fn a_listener_without_tls_refuses_a_tls_writer_and_a_tls_writers_key_opens_no_plaintext_connection()
{
    let pki = Pki::new("off");
    let rx_files = pki.node("rx", &[loopback(), ip(10, 0, 0, 1)]);
    let tx_files = pki.node("tx", &[ip(10, 0, 0, 2)]);
    // A writer told (falsely) that the listener takes TLS: the listener, with tls off, refuses
    // the handshake at its first byte.
    let (rx_pool, tx_pool) = (pool("off-rx"), pool("off-tx"));
    let mut plain_rx = plane(RX_ID, &rx_pool, TcpLimits::default());
    let mut tx = with_tls(
        plane(TX_ID, &tx_pool, TcpLimits::default()),
        TlsPolicy::Required,
        &tx_files,
    );
    let (state, _) = link_keyed(&mut tx, &mut plain_rx, None, (BLOCKS, LEN), |m| {
        m.tcp_tls = true
    });
    assert_eq!(state, Registration::Done);
    let (_, poll) = transfer(&mut tx, &mut plain_rx, 0);
    assert!(
        poll.done.is_empty() && poll.peer_fault.is_some(),
        "{poll:?}"
    );
    let until = Instant::now() + Duration::from_secs(5);
    while plain_rx.counters().refused_hellos == 0 && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(5));
    }
    // (the writer may try once more on a fresh connection before it gives the peer up)
    assert!(plain_rx.counters().refused_hellos >= 1);
    assert!(block(&rx_pool, 0).iter().all(|b| *b == 0));

    // A listener that prefers TLS, whose peer's connect offered it: that peer's key, read off
    // the plaintext control channel by an eavesdropper, opens no plaintext connection.
    let (rx_store, _tx_store, mut rx, mut tx) = pair(
        (TlsPolicy::Preferred, &rx_files),
        (TlsPolicy::Preferred, &tx_files),
    );
    let offered = tx.connect_metadata(&PeerId::new(RX_ID), None, &advertised(&tx));
    assert!(AgentMetadata::decode(&offered).unwrap().tcp_tls);
    let memory = RemoteMemory {
        agent_metadata: offered,
        base_addr: 0,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    rx.add_remote_peer(&PeerId::new(TX_ID), &memory).unwrap();
    let key = issue(&mut rx, TX_ID);
    rx.expect_writes(&PeerId::new(TX_ID), &[BlockIndex::new(1)]);
    let mut s = connect_hello(&rx, TX_ID, &key);
    assert_eq!(
        write(&mut s, 9, &[(1, 0x77)]),
        None,
        "the stolen key was served"
    );
    assert!(block(&rx_store, 1).iter().all(|b| *b == 0));
    // The writer itself, over TLS, is served.
    assert_eq!(link(&mut tx, &mut rx, None), Registration::Done);
    let (tid, poll) = transfer(&mut tx, &mut rx, 2);
    assert_eq!(poll.done, vec![tid.unwrap()], "{poll:?}");
}
