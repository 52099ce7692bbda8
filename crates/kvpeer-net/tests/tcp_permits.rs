//! The tcp plane's receive side against a raw socket: only writes into blocks with an
//! outstanding permit from that writer land; everything else is refused, the connection closed,
//! and the pool left untouched. And a writer whose receiver dies sees its transfers fail.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

mod tcp_support;

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::tcp::TcpLimits;
use kvpeer_proto::PeerId;
use tcp_support::*;

#[test]
fn only_permitted_writes_land_and_each_permit_is_used_once() {
    let store = pool("ok");
    let mut rx = plane("10.0.0.1:5710", &store, TcpLimits::default());
    let writer = PeerId::new("10.0.0.2:5710");
    let key = issue(&mut rx, writer.as_str());
    rx.expect_writes(&writer, &[BlockIndex::new(3), BlockIndex::new(4)]);

    let mut s = TcpStream::connect(rx.addr()).unwrap();
    hello(&mut s, writer.as_str(), &key);
    assert_eq!(
        write(&mut s, 1, &[(3, 0xaa), (4, 0xbb)]),
        Some(0),
        "written"
    );
    assert_eq!(block(&store, 3), vec![0xaa; LEN as usize]);
    assert_eq!(block(&store, 4), vec![0xbb; LEN as usize]);

    assert_eq!(
        write(&mut s, 2, &[(3, 0xcc)]),
        Some(1),
        "the permit was used: refused"
    );
    assert!(closed(&mut s), "and the writer is cut off");
    assert_eq!(
        block(&store, 3),
        vec![0xaa; LEN as usize],
        "the refused write never touched the pool"
    );
}

#[test]
fn writes_without_a_permit_or_out_of_range_or_from_strangers_are_refused() {
    let store = pool("bad");
    let mut rx = plane("10.0.0.1:5710", &store, TcpLimits::default());
    let writer = PeerId::new("10.0.0.2:5710");
    rx.expect_writes(&writer, &[BlockIndex::new(1)]);
    let key = issue(&mut rx, writer.as_str());
    let stranger_key = issue(&mut rx, "10.0.0.9:5710");
    let cases: [(&str, Vec<(u64, u8)>); 4] = [
        ("10.0.0.2:5710", vec![(5, 0x11)]), // no permit for block 5
        ("10.0.0.2:5710", vec![(1, 0x11), (5, 0x11)]), // one of two without a permit
        ("10.0.0.2:5710", vec![(1000, 0x11)]), // outside the pool
        ("10.0.0.9:5710", vec![(1, 0x11)]), // a writer with no permits at all
    ];
    for (who, blocks) in cases {
        let mut s = TcpStream::connect(rx.addr()).unwrap();
        let k = if who == writer.as_str() {
            &key
        } else {
            &stranger_key
        };
        hello(&mut s, who, k);
        assert_eq!(write(&mut s, 9, &blocks), Some(1), "{who} {blocks:?}");
        assert!(closed(&mut s));
    }
    for i in 0..BLOCKS {
        assert!(
            block(&store, i).iter().all(|b| *b == 0),
            "block {i} untouched"
        );
    }
    // The permit of block 1 survived the refused all-or-nothing frame.
    let mut s = TcpStream::connect(rx.addr()).unwrap();
    hello(&mut s, writer.as_str(), &key);
    assert_eq!(write(&mut s, 10, &[(1, 0x22)]), Some(0));
    rx.end_writes(&writer, &[BlockIndex::new(1)]);
}

#[test]
fn a_connection_that_is_not_the_protocol_is_dropped() {
    let store = pool("junk");
    let rx = plane("10.0.0.1:5710", &store, TcpLimits::default());
    let mut s = TcpStream::connect(rx.addr()).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(closed(&mut s));
}

#[test]
fn a_writer_sees_its_transfers_fail_when_the_receiver_dies() {
    let (rx_store, tx_store) = (pool("rx"), pool("tx"));
    let mut rx = plane("10.0.0.1:5710", &rx_store, TcpLimits::default());
    let mut tx = plane("10.0.0.2:5710", &tx_store, TcpLimits::default());
    let receiver = PeerId::new("10.0.0.1:5710");
    let advertised = AgentMetadata {
        agent: "rx".into(),
        shm: None,
        tcp: Some(rx.addr().to_string()),
        ..Default::default()
    }
    .encode();
    let memory = RemoteMemory {
        agent_metadata: rx.connect_metadata(&PeerId::new("10.0.0.2:5710"), None, &advertised),
        base_addr: 0,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    tx.add_remote_peer(&receiver, &memory).unwrap();
    let mut state = Registration::Pending;
    for _ in 0..400 {
        state = tx.registration(&receiver);
        if state != Registration::Pending {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(state, Registration::Done);
    rx.expect_writes(&PeerId::new("10.0.0.2:5710"), &[BlockIndex::new(0)]);
    let tid = tx
        .write_blocks(&receiver, &[BlockIndex::new(0)], &[BlockIndex::new(0)])
        .unwrap();
    let mut done = Vec::new();
    for _ in 0..400 {
        done.extend(tx.poll(&receiver).done);
        if !done.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(done, vec![tid]);
    drop(rx);
    let mut fault = None;
    for _ in 0..400 {
        if let Some(t) = tx.write_blocks(&receiver, &[BlockIndex::new(1)], &[BlockIndex::new(1)]) {
            let _ = t;
        }
        let poll = tx.poll(&receiver);
        if poll.peer_fault.is_some() {
            fault = poll.peer_fault;
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(
        fault.is_some(),
        "the dead receiver is reported as a peer fault"
    );
    assert!(
        tx.write_blocks(&receiver, &[BlockIndex::new(1)], &[BlockIndex::new(1)])
            .is_none(),
        "no new writes to a faulted peer"
    );
}

/// A peer registered again (a new `connect` while its link stands) stays writable: the sender
/// thread's replacing of the link once removed the plane's record of the new one, and every
/// write to that peer was then refused at once.
#[test]
fn a_peer_registered_again_while_linked_stays_writable() {
    let (rx_store, tx_store) = (pool("again-rx"), pool("again-tx"));
    let mut rx = plane("10.0.0.1:5710", &rx_store, TcpLimits::default());
    let mut tx = plane("10.0.0.2:5710", &tx_store, TcpLimits::default());
    let receiver = PeerId::new("10.0.0.1:5710");
    let writer = PeerId::new("10.0.0.2:5710");
    for round in 0..3u64 {
        let memory = RemoteMemory {
            agent_metadata: rx.connect_metadata(&writer, None, &advertised(&rx)),
            base_addr: 0,
            num_blocks: BLOCKS,
            block_len: LEN,
        };
        tx.add_remote_peer(&receiver, &memory).unwrap();
        for _ in 0..400 {
            if tx.registration(&receiver) != Registration::Pending {
                break;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // Two writes per registration: the second comes after the sender thread took the
        // registration's commands.
        for b in [round * 2, round * 2 + 1] {
            rx.expect_writes(&writer, &[BlockIndex::new(b)]);
            let tid = tx
                .write_blocks(&receiver, &[BlockIndex::new(b)], &[BlockIndex::new(b)])
                .unwrap_or_else(|| panic!("round {round}: block {b} refused"));
            let mut done = Vec::new();
            for _ in 0..400 {
                done.extend(tx.poll(&receiver).done);
                if !done.is_empty() {
                    break;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(done, vec![tid], "round {round}, block {b}");
            rx.end_writes(&writer, &[BlockIndex::new(b)]);
        }
    }
}
