//! The tcp plane's optional per-block digests (issue 40, `tcp_block_digests`): a receiver that
//! asks for them gets a CRC-32C per block in each WRITE and checks every block as it lands.
//! A byte flipped in transit (a relay between the planes, as a faulty NIC or switch would)
//! fails the write, so the load fails; without digests the same flip lands as wrong KV. An
//! honest transfer is byte-exact either way. Against a raw socket: a WRITE whose digest does
//! not match is refused with ACK 1 and the connection closed; a matching one is written.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::TcpStream;
use std::time::{Duration, Instant};

mod tcp_support;
mod tls_support;

use kvpeer_core::{BlockIndex, DataPlane, PlanePoll, Registration, RemoteMemory};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::tcp::{TcpLimits, TcpPlane};
use kvpeer_proto::PeerId;
use kvpeer_store::Pool;
use tcp_support::*;
use tls_support::Relay;

const RX_ID: &str = "10.0.0.1:5710";
const TX_ID: &str = "10.0.0.2:5710";

/// Registers `rx` (reached at `via`) as `tx`'s peer, with the `agent_metadata` `rx` sends.
fn link(tx: &mut TcpPlane, rx: &mut TcpPlane, via: std::net::SocketAddr) {
    let sent = rx.connect_metadata(&PeerId::new(TX_ID), None, &advertised(rx));
    let mut meta = AgentMetadata::decode(&sent).unwrap();
    meta.tcp = Some(via.to_string());
    let memory = RemoteMemory {
        agent_metadata: meta.encode(),
        base_addr: 0,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    let receiver = PeerId::new(RX_ID);
    tx.add_remote_peer(&receiver, &memory).unwrap();
    let until = Instant::now() + Duration::from_secs(5);
    while tx.registration(&receiver) == Registration::Pending && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(tx.registration(&receiver), Registration::Done);
}

/// Writes `tx`'s block `b` into `rx`'s block `b`; what `tx` polled once it ended.
fn transfer(tx: &mut TcpPlane, rx: &mut TcpPlane, b: u64) -> PlanePoll {
    let receiver = PeerId::new(RX_ID);
    rx.expect_writes(&PeerId::new(TX_ID), &[BlockIndex::new(b)]);
    tx.write_blocks(&receiver, &[BlockIndex::new(b)], &[BlockIndex::new(b)])
        .unwrap();
    let mut seen = PlanePoll::default();
    let until = Instant::now() + Duration::from_secs(10);
    while Instant::now() < until {
        let poll = tx.poll(&receiver);
        seen.done.extend(poll.done);
        seen.failed.extend(poll.failed);
        seen.peer_fault = seen.peer_fault.or(poll.peer_fault);
        if !seen.done.is_empty() || !seen.failed.is_empty() || seen.peer_fault.is_some() {
            break;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    rx.end_writes(&PeerId::new(TX_ID), &[BlockIndex::new(b)]);
    seen
}

/// A pool of [`BLOCKS`] zeroed blocks in private memory.
fn anon() -> Pool {
    Pool::anonymous(BLOCKS, LEN, false).unwrap()
}

/// Block `b` of `pool`.
fn block_of(pool: &Pool, b: u64) -> Vec<u8> {
    pool.view().block(BlockIndex::new(b)).unwrap().to_vec()
}

#[test]
fn a_block_flipped_in_transit_fails_its_transfer_with_digests_and_lands_wrong_without() {
    for digests in [true, false] {
        let (rx_pool, mut tx_pool) = (anon(), anon());
        let mut rx = plane_over(RX_ID, &rx_pool).with_block_digests(digests);
        let mut tx = plane_over(TX_ID, &tx_pool);
        let sent = fill_unique(&mut tx_pool, 1, 11);
        // Byte 1000 of the connection: inside block 1's bytes (the HELLO and the WRITE's
        // header take under 100).
        let relay = Relay::corrupting(rx.addr(), 1000);
        link(&mut tx, &mut rx, relay.addr);
        let poll = transfer(&mut tx, &mut rx, 1);
        let landed = block_of(&rx_pool, 1);
        let differing = sent.iter().zip(&landed).filter(|(a, b)| a != b).count();
        if digests {
            assert!(
                poll.done.is_empty() && !poll.failed.is_empty() && poll.peer_fault.is_none(),
                "the transfer failed, the peer was not faulted: {poll:?}"
            );
            assert_eq!(rx.counters().digest_mismatches, 1);
            assert_eq!(tx.counters().corrupted_writes, 1);
        } else {
            assert_eq!(
                (poll.done.len(), differing),
                (1, 1),
                "without digests the flipped byte lands and the write counts: {poll:?}"
            );
            assert_eq!(rx.counters().digest_mismatches, 0);
        }
        // The same link goes on: the next block (past the flipped byte) lands byte-exact.
        let next = fill_unique(&mut tx_pool, 2, 12);
        let poll = transfer(&mut tx, &mut rx, 2);
        assert_eq!(poll.done.len(), 1, "digests {digests}: {poll:?}");
        assert_eq!(block_of(&rx_pool, 2), next);
        let wire = relay.seen.lock().unwrap().clone();
        let magic = if digests { &b"KVPD"[..] } else { &b"KVPW"[..] };
        assert!(
            tls_support::contains(&wire, magic),
            "the writer sent {}",
            String::from_utf8_lossy(magic)
        );
    }
}

#[test]
fn an_honest_transfer_with_digests_is_byte_exact() {
    let (rx_pool, mut tx_pool) = (anon(), anon());
    let mut rx = plane_over(RX_ID, &rx_pool).with_block_digests(true);
    let mut tx = plane_over(TX_ID, &tx_pool);
    let relay = Relay::to(rx.addr());
    link(&mut tx, &mut rx, relay.addr);
    for b in 0..BLOCKS {
        let sent = fill_unique(&mut tx_pool, b, 100 + b);
        let poll = transfer(&mut tx, &mut rx, b);
        assert_eq!(poll.done.len(), 1, "block {b}: {poll:?}");
        assert_eq!(block_of(&rx_pool, b), sent, "block {b} byte-exact");
    }
    assert_eq!(rx.counters().digest_mismatches, 0);
    assert!(tls_support::contains(&relay.seen.lock().unwrap(), b"KVPD"));
}

/// A `KVPD` WRITE of one block at `index` with `digest`, then its ACK's status (`None`: the
/// connection closed first).
fn write_with_digest(
    s: &mut TcpStream,
    tid: u64,
    index: u64,
    digest: u32,
    body: &[u8],
) -> Option<u8> {
    let mut frame = b"KVPD".to_vec();
    frame.extend_from_slice(&tid.to_be_bytes());
    frame.extend_from_slice(&1u32.to_be_bytes());
    frame.extend_from_slice(&index.to_be_bytes());
    frame.extend_from_slice(&digest.to_be_bytes());
    frame.extend_from_slice(body);
    s.write_all(&frame).ok()?;
    read_ack(s, tid)
}

/// CRC-32C over the block's index (8 bytes, big-endian) and its bytes, as the wire defines it.
fn crc(index: u64, body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&index.to_be_bytes()), body)
}

/// A raw writer: a WRITE whose digest matches is written; one whose block does not match, or
/// whose header names another (permitted) block than the digest was made for, fails with ACK
/// status 2 and the connection goes on; a plain `KVPW` WRITE is refused (ACK 1, closed) by a
/// node that asks for digests.
#[test]
fn raw_writes_are_checked_against_their_digests_and_plain_ones_refused() {
    let store = pool("dg-raw");
    let mut rx = plane("10.0.0.1:5710", &store, TcpLimits::default()).with_block_digests(true);
    let writer = PeerId::new(TX_ID);
    let key = issue(&mut rx, writer.as_str());
    let permitted: Vec<BlockIndex> = (2..6).map(BlockIndex::new).collect();
    rx.expect_writes(&writer, &permitted);
    let body = vec![0x5a_u8; LEN as usize];
    let mut s = TcpStream::connect(rx.addr()).unwrap();
    hello(&mut s, writer.as_str(), &key);
    assert_eq!(
        write_with_digest(&mut s, 1, 2, crc(2, &body), &body),
        Some(0)
    );
    assert_eq!(block(&store, 2), body, "the matching write landed");
    assert_eq!(
        write_with_digest(&mut s, 2, 3, crc(3, &body) ^ 1, &body),
        Some(2),
        "a block that does not match its digest fails its transfer"
    );
    assert_eq!(
        write_with_digest(&mut s, 3, 5, crc(4, &body), &body),
        Some(2),
        "a header whose index changed from 4 to 5 fails too"
    );
    assert_eq!(
        write_with_digest(&mut s, 4, 4, crc(4, &body), &body),
        Some(0),
        "and the connection went on"
    );
    assert_eq!(rx.counters().digest_mismatches, 2);
    assert_eq!(
        write(&mut s, 5, &[(5, 0x11)]),
        Some(1),
        "a plain WRITE to a node that asks for digests"
    );
    assert!(closed(&mut s));
    assert_eq!(rx.counters().writes_without_digests, 1);
}

/// The receiver says it wants digests in its `connect`'s `agent_metadata`, and only then.
#[test]
fn the_connect_asks_for_digests_only_when_they_are_on() {
    for on in [true, false] {
        let store = pool(&format!("dg-meta-{on}"));
        let mut rx = plane(RX_ID, &store, TcpLimits::default()).with_block_digests(on);
        let sent = rx.connect_metadata(&PeerId::new(TX_ID), None, &advertised(&rx));
        assert_eq!(AgentMetadata::decode(&sent).unwrap().tcp_digests, on);
    }
}
