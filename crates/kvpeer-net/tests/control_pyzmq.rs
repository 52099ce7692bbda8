//! The control channel against a Python peer that speaks like vLLM's `ZmqTransport`: pyzmq
//! ROUTER bound at its identity, a DEALER with that identity, msgspec-encoded payloads.
//!
//! Python comes from `KVPEER_PYTHON`, or from the venv `scripts/test.sh` makes
//! (`target/kvpeer-venv`, with pyzmq and msgspec). Without either this test fails and says so.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use kvpeer_net::control::{ChannelEvent, ControlChannel, ControlConfig};
use kvpeer_proto::{decode, ConnectAck, Message, PeerId};

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

#[test]
fn a_pyzmq_peer_and_the_channel_exchange_messages_both_ways() {
    let mut ours = ControlChannel::bind(free_id(), ControlConfig::default()).unwrap();
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
    let reply = Message::ConnectAck(ConnectAck {
        peer_id: ours.identity().clone(),
    })
    .encode()
    .unwrap();
    ours.send(&theirs, &reply).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "python: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("{} connect_ack {}", ours.identity(), ours.identity()),
        "the Python ROUTER got [our identity, our payload] and msgspec decoded it"
    );
}
