//! A peer on the other end of a tcp data connection that takes (or gives) bytes a trickle at a
//! time costs only itself: this node's writes to a consumer that reads slowly, or never ACKs,
//! fail at their deadline (`transfer_timeout + bytes / min_write_rate`) and the connection is
//! reset, while an honest consumer of the same writer is served byte-exact meanwhile; a
//! producer trickling into this node's data port is closed at the frame deadline, or as soon as
//! the load it writes for ends.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpListener;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

mod tcp_support;

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory, TransferId};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::tcp::{TcpFault, TcpLimits, TcpPlane};
use kvpeer_proto::PeerId;
use kvpeer_store::{BlockStore, StoreConfig};
use tcp_support::{closed_within, connect_hello, issue, write_header};

const TX: &str = "10.0.0.2:5710";
const RX: &str = "10.0.0.1:5710";
const ATTACKER: &str = "10.0.0.9:5710";
/// The writer's pool: large enough that one WRITE does not fit the sockets' buffers.
const BLOCKS: u64 = 64;
const LEN: u64 = 64 * 1024;
const KEY: [u8; 32] = [0x42; 32];

fn store(tag: &str) -> BlockStore {
    BlockStore::new(&StoreConfig {
        shm_name: format!("kvpeer-trickle-{tag}-{}", std::process::id()),
        num_blocks: BLOCKS,
        block_len: LEN,
        lock_memory: false,
    })
    .unwrap()
}

fn plane(id: &str, store: &BlockStore, limits: TcpLimits) -> TcpPlane {
    TcpPlane::new(
        PeerId::new(id),
        store.pool().writer(),
        "127.0.0.1:0",
        Arc::new(|| {}),
    )
    .unwrap()
    .with_limits(limits)
}

/// A writer store whose every block holds distinct bytes.
fn filled(tag: &str) -> BlockStore {
    let mut s = store(tag);
    for n in 0..BLOCKS {
        let bytes: Vec<u8> = (0..LEN)
            .map(|i| (n as u8).wrapping_mul(31) ^ (i as u8).wrapping_mul(7) ^ (i >> 8) as u8)
            .collect();
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&n.to_be_bytes());
        let key = kvpeer_proto::OffloadKey::from_parts(&h, 0);
        assert_eq!(s.put(&key, &bytes).unwrap().get(), n);
    }
    s
}

fn block(store: &BlockStore, i: u64) -> Vec<u8> {
    store.pool().block(BlockIndex::new(i)).unwrap().to_vec()
}

fn all(n: u64) -> Vec<BlockIndex> {
    (0..n).map(BlockIndex::new).collect()
}

fn wait_registered(tx: &mut TcpPlane, peer: &str) {
    let peer = PeerId::new(peer);
    let until = Instant::now() + Duration::from_secs(5);
    while tx.registration(&peer) == Registration::Pending {
        assert!(Instant::now() < until, "registration never ended");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(tx.registration(&peer), Registration::Done);
}

/// Registers at `tx` a consumer listening at `addr` (key [`KEY`]).
fn register(tx: &mut TcpPlane, peer: &str, addr: String) {
    let memory = RemoteMemory {
        agent_metadata: AgentMetadata {
            agent: peer.into(),
            tcp: Some(addr),
            tcp_key: Some(KEY.to_vec()),
            ..Default::default()
        }
        .encode(),
        base_addr: 0,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    tx.add_remote_peer(&PeerId::new(peer), &memory).unwrap();
    wait_registered(tx, peer);
}

/// Registers the honest `rx` at `tx` the way a session does (`rx`'s `connect` issues the key).
fn register_honest(tx: &mut TcpPlane, rx: &mut TcpPlane) {
    let adv = AgentMetadata {
        agent: "rx".into(),
        tcp: Some(rx.addr().to_string()),
        ..Default::default()
    }
    .encode();
    let memory = RemoteMemory {
        agent_metadata: rx.connect_metadata(&PeerId::new(TX), None, &adv),
        base_addr: 0,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    tx.add_remote_peer(&PeerId::new(RX), &memory).unwrap();
    wait_registered(tx, RX);
}

/// Polls `tx` for `peer` until `tid` ends (or `within` passes): `Ok` done, `Err` failed (with
/// the tcp fault its peer was marked with, if any).
fn outcome(
    tx: &mut TcpPlane,
    peer: &str,
    tid: TransferId,
    within: Duration,
) -> Result<(), Option<TcpFault>> {
    let peer = PeerId::new(peer);
    let until = Instant::now() + within;
    while Instant::now() < until {
        let poll = tx.poll(&peer);
        if poll.done.contains(&tid) {
            return Ok(());
        }
        if poll.failed.contains(&tid) {
            return Err(poll
                .peer_fault
                .and_then(|e| e.downcast_ref::<TcpFault>().cloned()));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("transfer {tid:?} to {peer} did not end within {within:?}");
}

/// How the fake consumer reads its data connection.
#[derive(Clone, Copy)]
enum Reading {
    /// `chunk` bytes, then a pause of `every`; never gets to an ACK.
    Trickle { chunk: usize, every: Duration },
    /// As fast as it can; ACKs each WRITE.
    Full,
    /// As fast as it can; never ACKs.
    NoAck,
}

/// What the fake consumer saw.
struct Seen {
    /// Every byte the writer sent it.
    bytes: Vec<u8>,
    /// When it saw the connection closed (EOF or reset), if it did.
    closed_at: Option<Instant>,
}

/// A consumer's data port that accepts one connection (with a small receive buffer) and
/// reads it as `how` says, for at most `for_`.
fn consumer(how: Reading, for_: Duration) -> (String, JoinHandle<Seen>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    nix::sys::socket::setsockopt(&listener, nix::sys::socket::sockopt::RcvBuf, &4096).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let handle = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let until = Instant::now() + for_;
        let mut seen = Seen {
            bytes: Vec::new(),
            closed_at: None,
        };
        let frame = 4 + 12 + BLOCKS as usize * 8 + (BLOCKS * LEN) as usize;
        let hello = 4 + 1 + 2 + TX.len() + 32;
        let mut buf = vec![0u8; 256 * 1024];
        while Instant::now() < until {
            let want = match how {
                Reading::Trickle { chunk, .. } => chunk,
                _ => buf.len(),
            };
            s.set_read_timeout(Some(Duration::from_millis(100)))
                .unwrap();
            match s.read(&mut buf[..want]) {
                Ok(0) => {
                    seen.closed_at = Some(Instant::now());
                    break;
                }
                Ok(n) => seen.bytes.extend_from_slice(&buf[..n]),
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                    seen.closed_at = Some(Instant::now());
                    break;
                }
                Err(_) => {} // timeout
            }
            match how {
                Reading::Trickle { every, .. } => std::thread::sleep(every),
                Reading::Full if seen.bytes.len() == hello + frame => {
                    let tid = &seen.bytes[hello + 4..hello + 12];
                    let mut ack = b"KVPA".to_vec();
                    ack.extend_from_slice(tid);
                    ack.push(0);
                    s.write_all(&ack).unwrap();
                }
                _ => {}
            }
        }
        seen
    });
    (addr, handle)
}

/// What a writer sends a consumer: its HELLO, then one WRITE of `tx_store`'s every block into
/// the same indexes.
fn expected_bytes(tid: TransferId, tx_store: &BlockStore) -> Vec<u8> {
    let mut b = b"KVPH\x02".to_vec();
    b.extend_from_slice(&(TX.len() as u16).to_be_bytes());
    b.extend_from_slice(TX.as_bytes());
    b.extend_from_slice(&KEY);
    let indexes: Vec<u64> = (0..BLOCKS).collect();
    b.extend_from_slice(&write_header(tid.get(), &indexes));
    for i in 0..BLOCKS {
        b.extend_from_slice(&block(tx_store, i));
    }
    b
}

/// The writer's bound in these tests: 0.5 s plus the bytes at 2 MB/s (a whole-pool WRITE of
/// 4 MiB: about 2.6 s).
fn writer_limits() -> TcpLimits {
    TcpLimits {
        min_write_rate: 2_000_000,
        transfer_timeout: Duration::from_millis(500),
        ..TcpLimits::default()
    }
}

#[test]
fn a_trickle_reading_consumer_is_failed_within_its_deadline_while_others_are_served() {
    let (tx_store, rx_store) = (filled("tr-tx"), store("tr-rx"));
    let mut tx = plane(TX, &tx_store, writer_limits());
    let mut rx = plane(RX, &rx_store, TcpLimits::default());
    // 1 KiB every 20 ms: about 50 KB/s, far under the 2 MB/s the writer asks for.
    let trickle = Reading::Trickle {
        chunk: 1024,
        every: Duration::from_millis(20),
    };
    let (addr, attacker) = consumer(trickle, Duration::from_secs(20));
    register(&mut tx, ATTACKER, addr);
    register_honest(&mut tx, &mut rx);

    let start = Instant::now();
    let slow = tx
        .write_blocks(&PeerId::new(ATTACKER), &all(BLOCKS), &all(BLOCKS))
        .unwrap();
    // While the writer to the attacker is stuck in its socket, the honest consumer is served.
    std::thread::sleep(Duration::from_millis(300));
    for round in 0..3u64 {
        rx.expect_writes(&PeerId::new(TX), &all(BLOCKS));
        let tid = tx
            .write_blocks(&PeerId::new(RX), &all(BLOCKS), &all(BLOCKS))
            .unwrap();
        outcome(&mut tx, RX, tid, Duration::from_secs(5)).unwrap();
        for i in 0..BLOCKS {
            assert!(
                block(&rx_store, i) == block(&tx_store, i),
                "round {round}, block {i}"
            );
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "the honest consumer waited for the slow one: {:?}",
        start.elapsed()
    );

    let err = outcome(&mut tx, ATTACKER, slow, Duration::from_secs(15)).unwrap_err();
    let failed_at = start.elapsed();
    assert!(matches!(err, Some(TcpFault::Late { .. })), "{err:?}");
    assert!(
        failed_at >= Duration::from_millis(2400) && failed_at < Duration::from_secs(5),
        "failed after {failed_at:?}; the bound is about 2.6 s"
    );
    assert_eq!(tx.counters().transfer_timeouts, 1);
    assert!(
        tx.write_blocks(&PeerId::new(ATTACKER), &all(1), &all(1))
            .is_none(),
        "no more writes to the faulted peer"
    );

    let seen = attacker.join().unwrap();
    let closed_at = seen
        .closed_at
        .expect("the attacker's socket was never closed");
    assert!(
        closed_at.duration_since(start) < failed_at + Duration::from_secs(1),
        "closed {:?} after the start",
        closed_at.duration_since(start)
    );
    let expected = expected_bytes(slow, &tx_store);
    assert!(!seen.bytes.is_empty());
    assert!(
        seen.bytes.len() < expected.len() / 4,
        "the attacker got {} of {} bytes",
        seen.bytes.len(),
        expected.len()
    );
    assert!(
        expected.starts_with(&seen.bytes),
        "what the attacker got is the frame's start"
    );

    // The honest consumer is still served after the fault.
    rx.expect_writes(&PeerId::new(TX), &all(2));
    let tid = tx.write_blocks(&PeerId::new(RX), &all(2), &all(2)).unwrap();
    outcome(&mut tx, RX, tid, Duration::from_secs(5)).unwrap();
}

#[test]
fn a_consumer_that_reads_everything_but_never_acknowledges_is_failed_at_its_deadline() {
    let tx_store = filled("na-tx");
    let mut tx = plane(TX, &tx_store, writer_limits());
    let (addr, attacker) = consumer(Reading::NoAck, Duration::from_secs(10));
    register(&mut tx, ATTACKER, addr);
    let start = Instant::now();
    // One block (64 KiB): 0.5 s + 33 ms.
    let tid = tx
        .write_blocks(&PeerId::new(ATTACKER), &all(1), &all(1))
        .unwrap();
    let err = outcome(&mut tx, ATTACKER, tid, Duration::from_secs(8)).unwrap_err();
    let took = start.elapsed();
    assert!(matches!(err, Some(TcpFault::Late { .. })), "{err:?}");
    assert!(
        took >= Duration::from_millis(500) && took < Duration::from_secs(2),
        "{took:?}"
    );
    let seen = attacker.join().unwrap();
    assert!(seen.closed_at.is_some(), "the connection was closed");
    let hello = 4 + 1 + 2 + TX.len() + 32;
    assert_eq!(
        seen.bytes.len(),
        hello + 16 + 8 + LEN as usize,
        "the whole WRITE arrived"
    );
}

#[test]
fn the_same_consumer_reading_at_full_speed_is_served() {
    let tx_store = filled("fs-tx");
    let mut tx = plane(TX, &tx_store, writer_limits());
    let (addr, consumer) = consumer(Reading::Full, Duration::from_secs(4));
    register(&mut tx, ATTACKER, addr);
    let tid = tx
        .write_blocks(&PeerId::new(ATTACKER), &all(BLOCKS), &all(BLOCKS))
        .unwrap();
    outcome(&mut tx, ATTACKER, tid, Duration::from_secs(5)).unwrap();
    assert_eq!(tx.counters().transfer_timeouts, 0);
    let seen = consumer.join().unwrap();
    assert!(
        seen.bytes == expected_bytes(tid, &tx_store),
        "every byte, as sent"
    );
}

/// The receive side (this node as consumer): a producer writing a trickle into the data port is
/// closed at the frame deadline, unacknowledged, its thread and connection gone; an honest
/// writer is served meanwhile.
#[test]
fn a_producer_writing_a_trickle_is_closed_at_the_frame_deadline() {
    let rx_store = store("pt-rx");
    let limits = TcpLimits {
        frame_timeout: Duration::from_millis(500),
        ..TcpLimits::default()
    };
    let mut rx = plane(RX, &rx_store, limits);
    let (slow_id, honest_id) = ("10.0.0.7:1", "10.0.0.8:1");
    let slow_key = issue(&mut rx, slow_id);
    let honest_key = issue(&mut rx, honest_id);
    rx.expect_writes(&PeerId::new(slow_id), &all(1));
    let mut slow = connect_hello(&rx, slow_id, &slow_key);
    slow.write_all(&write_header(1, &[0])).unwrap();
    let start = Instant::now();
    let trickler = std::thread::spawn(move || {
        // 64 bytes every 50 ms: the 64 KiB block would take 50 s.
        let mut sent = 0;
        while slow.write_all(&[0xab; 64]).is_ok() && start.elapsed() < Duration::from_secs(5) {
            sent += 64;
            std::thread::sleep(Duration::from_millis(50));
        }
        let closed = closed_within(&mut slow, Duration::from_secs(1));
        (sent, closed, start.elapsed())
    });

    rx.expect_writes(&PeerId::new(honest_id), &[BlockIndex::new(5)]);
    let mut honest = connect_hello(&rx, honest_id, &honest_key);
    honest.write_all(&write_header(2, &[5])).unwrap();
    honest.write_all(&vec![0x55; LEN as usize]).unwrap();
    let mut ack = [0u8; 13];
    honest
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    honest.read_exact(&mut ack).unwrap();
    assert_eq!(ack[12], 0, "the honest write is acknowledged");
    assert!(start.elapsed() < Duration::from_millis(400));
    assert_eq!(block(&rx_store, 5), vec![0x55; LEN as usize]);

    let (sent, closed, took) = trickler.join().unwrap();
    assert!(closed, "the trickling producer's connection was closed");
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert!(sent < LEN as usize / 4, "{sent} bytes sent");
    assert_eq!(rx.counters().frame_timeouts, 1);
    let until = Instant::now() + Duration::from_secs(2);
    while rx.inbound_connections() != (1, 0) {
        assert!(Instant::now() < until, "{:?}", rx.inbound_connections());
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A WRITE whose blocks each arrive within the frame deadline may as a whole take far longer;
/// when the load it writes for ends (its permits are withdrawn), its connection is closed at
/// once: the write is never acknowledged and its later blocks are not read.
#[test]
fn a_slow_write_is_cut_off_when_its_load_ends() {
    let rx_store = store("le-rx");
    let limits = TcpLimits {
        frame_timeout: Duration::from_secs(1),
        ..TcpLimits::default()
    };
    let mut rx = plane(RX, &rx_store, limits);
    let key = issue(&mut rx, TX);
    let blocks = all(4);
    rx.expect_writes(&PeerId::new(TX), &blocks);
    let mut s = connect_hello(&rx, TX, &key);
    s.write_all(&write_header(1, &[0, 1, 2, 3])).unwrap();
    s.write_all(&vec![0x11; LEN as usize]).unwrap();
    let writer = std::thread::spawn(move || {
        // One block every 0.6 s: each inside the 1 s frame deadline, 2.4 s in all.
        for fill in [0x22u8, 0x33, 0x44] {
            std::thread::sleep(Duration::from_millis(600));
            if s.write_all(&vec![fill; LEN as usize]).is_err() {
                break;
            }
        }
        let mut got = Vec::new();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let _ = s.read_to_end(&mut got);
        got
    });
    std::thread::sleep(Duration::from_millis(300));
    // The load fails (its timeout, say): the node withdraws the fetch's permits.
    let ended = Instant::now();
    rx.end_writes(&PeerId::new(TX), &blocks);
    let until = Instant::now() + Duration::from_secs(2);
    while rx.inbound_connections() != (0, 0) {
        assert!(Instant::now() < until, "{:?}", rx.inbound_connections());
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        ended.elapsed() < Duration::from_millis(300),
        "{:?}",
        ended.elapsed()
    );
    let got = writer.join().unwrap();
    assert!(got.is_empty(), "no ACK: {got:?}");
    assert_eq!(block(&rx_store, 0), vec![0x11; LEN as usize]);
    for i in 2..4 {
        assert!(block(&rx_store, i).iter().all(|b| *b == 0), "block {i}");
    }
}
