//! The control channel over TLS 1.3 with mutual authentication (issue 40): messages cross both
//! ways and the wire (recorded by a relay in front of one listener) carries none of their
//! bytes; a peer whose certificate another CA issued, or that names another address than the
//! identity it speaks for, is refused with a reason on both sides while an honest pair is
//! served; the policy refuses a plaintext peer where TLS is required (telling it why), takes it
//! where TLS is preferred, and a dialer whose peer speaks no TLS talks to it in clear only where
//! TLS is preferred.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use kvpeer_core::LinkLoss;
use kvpeer_net::control::{ChannelEvent, ControlChannel, ControlConfig, ControlTls};
use kvpeer_net::tls::{Tls, TlsFiles, TlsPolicy};
use kvpeer_proto::PeerId;

mod tls_support;
use tls_support::*;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn config(tls: Option<(TlsPolicy, &TlsFiles)>) -> ControlConfig {
    ControlConfig {
        tls: tls.map(|(policy, files)| ControlTls {
            tls: Tls::load(files.clone()).unwrap(),
            policy,
        }),
        ..ControlConfig::default()
    }
}

fn channel(tls: Option<(TlsPolicy, &TlsFiles)>) -> ControlChannel {
    let id = PeerId::new(format!("127.0.0.1:{}", free_port()));
    ControlChannel::bind(id, config(tls)).unwrap()
}

/// Drives `ch` and `also` until `ch` yields an event `want` takes (10 s at most).
fn expect(
    ch: &mut ControlChannel,
    also: &mut [&mut ControlChannel],
    want: impl Fn(&ChannelEvent) -> bool,
) -> ChannelEvent {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        ch.wait(Duration::from_millis(5)).unwrap();
        for other in also.iter_mut() {
            other.recv();
        }
        if let Some(e) = ch.recv().into_iter().find(|e| want(e)) {
            return e;
        }
    }
    panic!("no matching event within 10 s");
}

fn payload_from(peer: &PeerId, bytes: &[u8]) -> impl Fn(&ChannelEvent) -> bool {
    let (peer, bytes) = (peer.clone(), bytes.to_vec());
    move |e| matches!(e, ChannelEvent::Payload { peer: p, payload, .. } if *p == peer && *payload == bytes)
}

/// The loss of `peer` `a` reports, driving `b` meanwhile; fails if `b` hears any payload.
fn lost(a: &mut ControlChannel, b: &mut ControlChannel, peer: &PeerId) -> LinkLoss {
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        a.wait(Duration::from_millis(5)).unwrap();
        for e in b.recv() {
            assert!(
                !matches!(e, ChannelEvent::Payload { .. }),
                "the refused peer was heard: {e:?}"
            );
        }
        for e in a.recv() {
            if let ChannelEvent::Lost { peer: p, cause } = e {
                if p == *peer {
                    return cause;
                }
            }
        }
    }
    panic!("no loss within 10 s");
}

#[test]
fn messages_cross_over_mutual_tls_both_ways_and_the_wire_carries_none_of_them() {
    let pki = Pki::new("ctl-wire");
    let (fa, fb) = (pki.node("a", &[loopback()]), pki.node("b", &[loopback()]));
    let mut a = channel(Some((TlsPolicy::Required, &fa)));
    // b listens behind a relay: its identity is the relay's port, which a dials.
    let b_port = free_port();
    let relay = Relay::to(format!("127.0.0.1:{b_port}").parse().unwrap());
    let idb = PeerId::new(format!("127.0.0.1:{}", relay.addr.port()));
    let mut b = ControlChannel::bind_at(
        format!("127.0.0.1:{b_port}").parse().unwrap(),
        &idb,
        config(Some((TlsPolicy::Required, &fb))),
    )
    .unwrap();
    let ida = a.identity().clone();
    let secret = b"a connect's tcp_key and kvpeer_auth: never in clear".to_vec();
    a.send(&idb, &secret).unwrap();
    let heard = expect(&mut b, &mut [&mut a], payload_from(&ida, &secret));
    let ChannelEvent::Payload { conn, .. } = heard else {
        unreachable!()
    };
    assert_eq!(b.inbound_tls(conn), Some(true));
    assert_eq!(a.outbound_tls(&idb), Some(true));
    // The reply dials back over TLS too.
    b.send(&ida, b"the answer").unwrap();
    expect(&mut a, &mut [&mut b], payload_from(&idb, b"the answer"));
    assert_eq!(b.outbound_tls(&ida), Some(true));

    let wire = relay.seen.lock().unwrap().clone();
    assert_eq!(
        wire.first(),
        Some(&0x16),
        "the connection opened with a TLS handshake"
    );
    assert!(
        !contains(&wire, &secret[..16]),
        "the message is on the wire"
    );
    assert!(
        !contains(&wire, b"Socket-Type"),
        "ZMTP's READY is on the wire"
    );
    assert!(
        !contains(&wire, ida.as_str().as_bytes()),
        "the identity is on the wire"
    );
}

#[test]
fn untrusted_and_wrong_name_certificates_are_refused_on_both_sides_and_an_honest_pair_is_served() {
    let pki = Pki::new("ctl-refuse");
    let other = Pki::new("ctl-refuse-other");
    let good = pki.node("listener", &[loopback()]);
    let cases: Vec<(&str, TlsFiles, TlsFiles, &str)> = vec![
        (
            "a dialer from another CA",
            good.clone(),
            TlsFiles {
                ca: pki.dir.join("ca.pem"),
                ..other.node("dialer-other-ca", &[loopback()])
            },
            "TLS",
        ),
        (
            "a dialer whose certificate names another address than its identity's",
            good.clone(),
            pki.node("dialer-wrong-name", &[ip(10, 0, 0, 9)]),
            "does not name the IP address",
        ),
        (
            "a listener whose certificate names another address than the one dialed",
            pki.node("listener-wrong-name", &[ip(10, 0, 0, 9)]),
            pki.node("dialer", &[loopback()]),
            "TLS",
        ),
    ];
    for (case, listener_files, dialer_files, says) in cases {
        let mut b = channel(Some((TlsPolicy::Required, &listener_files)));
        let mut a = channel(Some((TlsPolicy::Required, &dialer_files)));
        let idb = b.identity().clone();
        a.send(&idb, b"hello").unwrap();
        let cause = lost(&mut a, &mut b, &idb);
        assert!(cause.to_string().contains(says), "{case}: {cause}");
    }
    // The honest pair, same CA, good names.
    let mut b = channel(Some((TlsPolicy::Required, &good)));
    let mut a = channel(Some((
        TlsPolicy::Required,
        &pki.node("honest", &[loopback()]),
    )));
    let (ida, idb) = (a.identity().clone(), b.identity().clone());
    a.send(&idb, b"hello").unwrap();
    expect(&mut b, &mut [&mut a], payload_from(&ida, b"hello"));
}

#[test]
fn a_plaintext_peer_is_refused_where_tls_is_required_and_taken_where_it_is_preferred() {
    let pki = Pki::new("ctl-policy");
    let files = pki.node("node", &[loopback()]);
    // A plaintext dialer (a vLLM engine, an older kvpeer) to a listener that requires TLS is
    // told why.
    let mut b = channel(Some((TlsPolicy::Required, &files)));
    let mut a = channel(None);
    let idb = b.identity().clone();
    a.send(&idb, b"hello").unwrap();
    let cause = lost(&mut a, &mut b, &idb);
    assert_eq!(
        cause,
        LinkLoss::RefusedByPeer(
            "this node takes TLS control connections only (tls = required)".into()
        )
    );
    // Where TLS is preferred it is taken, in clear.
    let mut b = channel(Some((TlsPolicy::Preferred, &files)));
    let mut a = channel(None);
    let (ida, idb) = (a.identity().clone(), b.identity().clone());
    a.send(&idb, b"hello").unwrap();
    let heard = expect(&mut b, &mut [&mut a], payload_from(&ida, b"hello"));
    let ChannelEvent::Payload { conn, .. } = heard else {
        unreachable!()
    };
    assert_eq!(b.inbound_tls(conn), Some(false));
}

#[test]
fn a_dialer_talks_in_clear_to_a_peer_without_tls_only_where_tls_is_preferred() {
    let pki = Pki::new("ctl-fallback");
    let files = pki.node("node", &[loopback()]);
    // Required: the peer's plaintext greeting ends the connection, with the reason.
    let mut b = channel(None);
    let mut a = channel(Some((TlsPolicy::Required, &files)));
    let idb = b.identity().clone();
    a.send(&idb, b"hello").unwrap();
    let cause = lost(&mut a, &mut b, &idb);
    assert!(
        cause.to_string().contains("the peer speaks no TLS"),
        "{cause}"
    );
    // Preferred: dialed again in clear; what was queued arrives, in order.
    let mut b = channel(None);
    let mut a = channel(Some((TlsPolicy::Preferred, &files)));
    let (ida, idb) = (a.identity().clone(), b.identity().clone());
    a.send(&idb, b"first").unwrap();
    a.send(&idb, b"second").unwrap();
    let mut heard = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(10);
    while heard.len() < 2 && Instant::now() < deadline {
        b.wait(Duration::from_millis(5)).unwrap();
        a.recv();
        for e in b.recv() {
            if let ChannelEvent::Payload { peer, payload, .. } = e {
                assert_eq!(peer, ida);
                heard.push(payload);
            }
        }
    }
    assert_eq!(heard, vec![b"first".to_vec(), b"second".to_vec()]);
    assert_eq!(a.outbound_tls(&idb), Some(false));
}

/// A plaintext DEALER's greeting, READY claiming `identity`, one message `body` and a frame
/// header claiming 2^40 bytes, written at once: the connection ends in the round that reads
/// its READY.
fn ready_message_and_a_broken_frame(identity: &str, body: &[u8]) -> Vec<u8> {
    let mut out = vec![0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3, 0];
    out.extend_from_slice(b"NULL");
    out.resize(64, 0);
    let mut ready = vec![5u8];
    ready.extend_from_slice(b"READY");
    for (name, value) in [("Socket-Type", "DEALER"), ("Identity", identity)] {
        ready.push(name.len() as u8);
        ready.extend_from_slice(name.as_bytes());
        ready.extend_from_slice(&(value.len() as u32).to_be_bytes());
        ready.extend_from_slice(value.as_bytes());
    }
    out.extend_from_slice(&[0x04, ready.len() as u8]);
    out.extend_from_slice(&ready);
    out.extend_from_slice(&[0x00, body.len() as u8]);
    out.extend_from_slice(body);
    out.push(0x02);
    out.extend_from_slice(&(1u64 << 40).to_be_bytes());
    out
}

/// A connection that ends in the very round its READY came is still judged by what it was
/// (found by review): a plaintext peer under `required` that sends its READY, a message and a
/// broken frame at once has its message dropped with it, never delivered as another node's.
#[test]
fn a_plaintext_message_sent_with_a_broken_frame_is_not_heard_where_tls_is_required() {
    let pki = Pki::new("ctl-same-round");
    let mut b = channel(Some((TlsPolicy::Required, &pki.node("b", &[loopback()]))));
    let mut s = TcpStream::connect(b.identity().as_str()).unwrap();
    s.set_nodelay(true).unwrap();
    s.write_all(&ready_message_and_a_broken_frame(
        "127.0.0.1:9",
        b"I speak for 127.0.0.1:9",
    ))
    .unwrap();
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        b.wait(Duration::from_millis(10)).unwrap();
        for e in b.recv() {
            assert!(
                !matches!(e, ChannelEvent::Payload { .. }),
                "a plaintext message was heard: {e:?}"
            );
        }
    }
}

/// Found by review: a dialer in its TLS handshake waits for the peer's next flight; it must
/// not spin the node's thread meanwhile. Against a port that accepts and never answers, the
/// channel sleeps in its wait (a handful of wakes in half a second, not thousands).
#[test]
fn a_tls_handshake_that_waits_for_its_peer_leaves_the_thread_asleep() {
    let pki = Pki::new("ctl-asleep");
    let mut a = channel(Some((TlsPolicy::Required, &pki.node("a", &[loopback()]))));
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = PeerId::new(format!("127.0.0.1:{}", silent.local_addr().unwrap().port()));
    a.send(&peer, b"hello").unwrap();
    // Let the connect and the ClientHello go.
    for _ in 0..10 {
        a.wait(Duration::from_millis(5)).unwrap();
        a.recv();
    }
    let (_held, _) = silent.accept().unwrap();
    let (started, mut wakes) = (Instant::now(), 0u32);
    while started.elapsed() < Duration::from_millis(500) {
        a.wait(Duration::from_millis(50)).unwrap();
        a.recv();
        wakes += 1;
    }
    assert!(
        wakes < 100,
        "{wakes} wakes in 500 ms while the handshake waited"
    );
}

/// Found by review: only the peer's first byte tells a peer that answers in clear; a later
/// byte of its TLS flight that happens to be 0xFF is a record's, not a greeting. A peer whose
/// first bytes are a TLS record's start, then 0xFF, fails the handshake as TLS (under
/// `required`: it is never taken for a plaintext peer).
#[test]
fn only_the_peers_first_byte_says_it_answers_in_clear() {
    let pki = Pki::new("ctl-first-byte");
    let mut a = channel(Some((TlsPolicy::Required, &pki.node("a", &[loopback()]))));
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let peer = PeerId::new(format!("127.0.0.1:{}", fake.local_addr().unwrap().port()));
    let server = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        s.set_nodelay(true).unwrap();
        s.write_all(&kvpeer_net::zmtp::TLS_OFFER).unwrap();
        let mut hello = [0u8; 512];
        let _ = s.read(&mut hello);
        // A handshake record's header claiming 64 bytes, 5 of them now ...
        let _ = s.write_all(&[0x16, 0x03, 0x03, 0x00, 0x40, 0x02, 0x00, 0x00, 0x3c, 0x03]);
        std::thread::sleep(Duration::from_millis(200));
        // ... and the rest later, starting with 0xFF.
        let _ = s.write_all(&[0xff; 59]);
        std::thread::sleep(Duration::from_millis(500));
    });
    a.send(&peer, b"hello").unwrap();
    let mut b = channel(None);
    let cause = lost(&mut a, &mut b, &peer);
    assert!(
        matches!(&cause, LinkLoss::Tls(_)) && !cause.to_string().contains("speaks no TLS"),
        "{cause}"
    );
    server.join().unwrap();
}
