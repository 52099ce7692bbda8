//! The control channel against a Python peer that speaks like vLLM's `ZmqTransport`: pyzmq
//! ROUTER bound at its identity, a DEALER with that identity, msgspec-encoded payloads; and
//! kvpeer's own DEALER side against a bare pyzmq ROUTER (libzmq 4.3), byte for byte.
//!
//! Python comes from `KVPEER_PYTHON`, or from the venv `scripts/test.sh` makes
//! (`target/kvpeer-venv`, with pyzmq and msgspec). Without either this test fails and says so.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use kvpeer_net::control::{ChannelEvent, ControlChannel, ControlConfig, ControlTls};
use kvpeer_net::tls::{Tls, TlsPolicy};
use kvpeer_proto::{decode, ConnectAck, Message, PeerId};

mod tls_support;
use tls_support::{loopback, Pki, Relay};

fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVPEER_PYTHON") {
        return PathBuf::from(p);
    }
    let venv =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/kvpeer-venv/bin/python");
    assert!(
        venv.exists(),
        "needs Python with pyzmq and msgspec: run scripts/test.sh (it makes {}) or set KVPEER_PYTHON",
        venv.display()
    );
    venv
}

fn free_id() -> PeerId {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    PeerId::new(format!("127.0.0.1:{}", l.local_addr().unwrap().port()))
}

const PEER: &str = r#"
import sys, zmq, msgspec
ours, me = sys.argv[1], sys.argv[2]
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router.bind(f"tcp://{me}")
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.IDENTITY, me.encode())
dealer.setsockopt(zmq.LINGER, 500)
dealer.setsockopt(zmq.SNDHWM, 1000)
dealer.connect(f"tcp://{ours}")
dealer.send(msgspec.msgpack.encode({"type": "connect_ack", "peer_id": me}), zmq.NOBLOCK)
if router.poll(10000) == 0:
    sys.exit("no reply from kvpeer")
frames = router.recv_multipart()
assert len(frames) == 2, frames
msg = msgspec.msgpack.decode(frames[1])
print(frames[0].decode(), msg["type"], msg["peer_id"])
"#;

/// Drives `ch` (its connections progress only on this thread) until `child` exits; returns
/// its output and the channel's events meanwhile.
fn drive_until_exit(ch: &mut ControlChannel, mut child: Child) -> (Output, Vec<ChannelEvent>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut events = Vec::new();
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the Python peer did not finish");
        ch.wait(Duration::from_millis(5)).unwrap();
        events.extend(ch.recv());
    }
    (child.wait_with_output().unwrap(), events)
}

#[test]
fn a_pyzmq_peer_and_the_channel_exchange_messages_both_ways() {
    exchange_with_pyzmq(ControlConfig::default());
}

/// A node with TLS preferred (issue 40) in a mixed fleet: vLLM's libzmq peer speaks no TLS.
/// Its DEALER's plaintext connection is taken, and our reply's TLS connect, answered with
/// libzmq's plaintext greeting, is made again in clear: both ways still work.
#[test]
fn a_channel_preferring_tls_talks_to_a_pyzmq_peer_in_clear_both_ways() {
    let pki = Pki::new("ctl-pyzmq");
    let files = pki.node("node", &[loopback()]);
    exchange_with_pyzmq(ControlConfig {
        tls: Some(ControlTls {
            tls: Tls::load(files).unwrap(),
            policy: TlsPolicy::Preferred,
        }),
        ..ControlConfig::default()
    });
}

/// A ROUTER bound at `argv[3]`, whose DEALER claims identity `argv[2]` (a relay's address in
/// front of the ROUTER) and says hello to `argv[1]`: prints every message the ROUTER receives
/// (routing id in hex, frame count, its msgpack `type` or `undecodable`) until half a second
/// after the first `connect_ack`.
const ROUTER_COUNTING: &str = r#"
import sys, time, zmq, msgspec
ours, me, bind = sys.argv[1], sys.argv[2], sys.argv[3]
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 0)
router.bind(f"tcp://{bind}")
dealer = ctx.socket(zmq.DEALER)
dealer.setsockopt(zmq.IDENTITY, me.encode())
dealer.setsockopt(zmq.LINGER, 500)
dealer.connect(f"tcp://{ours}")
dealer.send(msgspec.msgpack.encode({"type": "connect_ack", "peer_id": me}), zmq.NOBLOCK)
end = None
while True:
    wait = 10000 if end is None else max(0, int((end - time.time()) * 1000))
    if router.poll(wait) == 0:
        break
    frames = router.recv_multipart()
    try:
        what = msgspec.msgpack.decode(frames[-1])["type"]
    except Exception:
        what = "undecodable"
    print(frames[0].hex(), len(frames), what, flush=True)
    if end is None and what == "connect_ack":
        end = time.time() + 0.5
"#;

/// Found in CI: a dialer preferring TLS whose ClientHello reached a libzmq ROUTER before the
/// ROUTER's greeting reached it had its ClientHello decoded as ZMTP/1.0 messages, which the
/// ROUTER handed to the application (`msgspec.DecodeError`). The relay in front of the ROUTER
/// holds its answers back 150 ms, which made that certain: the dialer must wait for the
/// ROUTER's greeting (which offers no TLS) and the ROUTER receive our reply and nothing else,
/// in each of three rounds.
#[test]
fn a_libzmq_router_hearing_our_tls_opening_first_receives_only_our_messages() {
    let pki = Pki::new("ctl-pyzmq-late");
    let files = pki.node("node", &[loopback()]);
    let tls = Tls::load(files).unwrap();
    for round in 0..3 {
        let mut ours = ControlChannel::bind(
            free_id(),
            ControlConfig {
                tls: Some(ControlTls {
                    tls: tls.clone(),
                    policy: TlsPolicy::Preferred,
                }),
                ..ControlConfig::default()
            },
        )
        .unwrap();
        let bind = free_id();
        let relay =
            Relay::answering_late(bind.as_str().parse().unwrap(), Duration::from_millis(150));
        let theirs = PeerId::new(relay.addr.to_string());
        let child = Command::new(python())
            .args([
                "-c",
                ROUTER_COUNTING,
                ours.identity().as_str(),
                theirs.as_str(),
                bind.as_str(),
            ])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            assert!(Instant::now() < deadline, "nothing from the Python peer");
            ours.wait(Duration::from_millis(100)).unwrap();
            if let Some(ChannelEvent::Payload { peer, .. }) = ours.recv().into_iter().next() {
                assert_eq!(peer, theirs);
                break;
            }
        }
        let out = reply_and_wait(&mut ours, &theirs, child);
        let ours_hex: String = ours
            .identity()
            .as_str()
            .bytes()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            format!("{ours_hex} 2 connect_ack"),
            "round {round}: the ROUTER received our reply and nothing else"
        );
        assert_eq!(
            relay.seen.lock().unwrap().first(),
            Some(&kvpeer_net::zmtp::SIGNATURE_FIRST),
            "round {round}: the dialer spoke plaintext ZMTP from its first byte"
        );
    }
}

/// Sends `theirs` our `connect_ack` and drives `ours` until the Python peer `child` exits,
/// which it must do successfully; its output.
fn reply_and_wait(ours: &mut ControlChannel, theirs: &PeerId, child: Child) -> Output {
    let reply = Message::ConnectAck(ConnectAck {
        peer_id: ours.identity().clone(),
    })
    .encode()
    .unwrap();
    ours.send(theirs, &reply).unwrap();
    let (out, events) = drive_until_exit(ours, child);
    assert!(
        out.status.success(),
        "python: {}; the channel's events: {events:?}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn exchange_with_pyzmq(config: ControlConfig) {
    let mut ours = ControlChannel::bind(free_id(), config).unwrap();
    let theirs = free_id();
    let child = Command::new(python())
        .args(["-c", PEER, ours.identity().as_str(), theirs.as_str()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    let payload = loop {
        assert!(Instant::now() < deadline, "nothing from the Python peer");
        ours.wait(Duration::from_millis(100)).unwrap();
        if let Some(ChannelEvent::Payload { peer, payload, .. }) = ours.recv().into_iter().next() {
            assert_eq!(peer, theirs, "the ROUTER sees the DEALER's identity");
            break payload;
        }
    };
    assert_eq!(
        decode(&payload).unwrap(),
        Message::ConnectAck(ConnectAck {
            peer_id: theirs.clone()
        })
    );
    let out = reply_and_wait(&mut ours, &theirs, child);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{} connect_ack {}", ours.identity(), ours.identity()),
        "the Python ROUTER got [our identity, our payload] and msgspec decoded it"
    );
}

/// A bare pyzmq ROUTER (libzmq's, with vLLM's heartbeat settings) bound at `argv[1]`: prints
/// every message it receives as hex frames, one line each, until it has `argv[2]` of them, then
/// sends one message back to the DEALER (which the DEALER drops, as libzmq's were never read).
const ROUTER: &str = r#"
import sys, zmq
me, want = sys.argv[1], int(sys.argv[2])
ctx = zmq.Context()
router = ctx.socket(zmq.ROUTER)
router.setsockopt(zmq.LINGER, 500)
for opt, v in ((zmq.HEARTBEAT_IVL, 2000), (zmq.HEARTBEAT_TIMEOUT, 10000), (zmq.HEARTBEAT_TTL, 10000)):
    router.setsockopt(opt, v)
router.bind(f"tcp://{me}")
print("bound", flush=True)
for _ in range(want):
    if router.poll(20000) == 0:
        sys.exit("no message from kvpeer")
    frames = router.recv_multipart()
    print(" ".join(f.hex() for f in frames), flush=True)
router.send_multipart([frames[0], b"dropped by the DEALER"])
"#;

#[test]
fn kvpeer_dealer_to_a_pyzmq_router_carries_its_identity_and_exact_bytes() {
    let mut ours = ControlChannel::bind(free_id(), ControlConfig::default()).unwrap();
    let theirs = free_id();
    // Short, exactly 255 (the last short frame), 256 (the first long one), 64 KiB, empty.
    let payloads: Vec<Vec<u8>> = vec![
        b"\x81\xa4type\xaadisconnect".to_vec(),
        (0..255u32).map(|i| i as u8).collect(),
        (0..256u32).map(|i| (i * 7) as u8).collect(),
        (0..65536u32).map(|i| (i % 251) as u8).collect(),
        Vec::new(),
    ];
    let mut child = Command::new(python())
        .args([
            "-u",
            "-c",
            ROUTER,
            theirs.as_str(),
            &payloads.len().to_string(),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // A refused connect is lost (as libzmq's monitor reported CLOSED), so the first send
    // waits for Python to say it listens. Its output is read as it comes (a pipe holds 64 KiB).
    let mut stdout = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    std::io::BufRead::read_line(&mut stdout, &mut line).unwrap();
    assert_eq!(line.trim(), "bound");
    let reader = std::thread::spawn(move || {
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut rest).unwrap();
        rest
    });
    for p in &payloads {
        ours.send(&theirs, p).unwrap();
    }
    let (out, events) = drive_until_exit(&mut ours, child);
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !events
            .iter()
            .any(|e| matches!(e, ChannelEvent::Payload { .. })),
        "what the ROUTER sent the DEALER is dropped: {events:?}"
    );
    let printed = reader.join().unwrap();
    let identity_hex: String = ours
        .identity()
        .as_str()
        .bytes()
        .map(|b| format!("{b:02x}"))
        .collect();
    let lines: Vec<&str> = printed.lines().collect();
    assert_eq!(lines.len(), payloads.len(), "{lines:?}");
    for (line, p) in lines.iter().zip(&payloads) {
        let hex: String = p.iter().map(|b| format!("{b:02x}")).collect();
        // An empty frame prints as nothing after the separator.
        assert_eq!(
            line.trim_end(),
            format!("{identity_hex} {hex}").trim_end(),
            "pyzmq's ROUTER got [our identity, the exact payload]"
        );
    }
}
