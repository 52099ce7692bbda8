//! The tcp plane's receive side against a raw socket: only writes into blocks with an
//! outstanding permit from that writer land; everything else is refused, the connection closed,
//! and the pool left untouched. And a writer whose receiver dies sees its transfers fail.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use kvpeer_core::{DataPlane, Registration, RemoteMemory};
use kvpeer_net::metadata::AgentMetadata;
use kvpeer_net::tcp::TcpPlane;
use kvpeer_proto::PeerId;
use kvpeer_store::{BlockStore, StoreConfig};

const BLOCKS: u64 = 8;
const LEN: u64 = 4096;

fn pool(tag: &str) -> BlockStore {
    let name = format!("kvpeer-tp-{tag}-{}", std::process::id());
    BlockStore::new(&StoreConfig {
        shm_name: name,
        num_blocks: BLOCKS,
        block_len: LEN,
        lock_memory: false,
    })
    .unwrap()
}

fn plane(id: &str, store: &BlockStore) -> TcpPlane {
    TcpPlane::new(
        PeerId::new(id),
        store.region().name(),
        BLOCKS,
        LEN,
        "127.0.0.1:0",
        Arc::new(|| {}),
    )
    .unwrap()
}

/// The key `rx` issues to `writer` (what its `connect` to that writer would carry).
fn key_for(rx: &mut TcpPlane, writer: &str) -> Vec<u8> {
    let advertised = AgentMetadata {
        agent: "rx".into(),
        tcp: Some(rx.addr().to_string()),
        ..Default::default()
    }
    .encode();
    let meta = rx.connect_metadata(&PeerId::new(writer), &advertised);
    AgentMetadata::decode(&meta).unwrap().tcp_key.unwrap()
}

fn hello(s: &mut TcpStream, writer: &str, key: &[u8]) {
    let mut f = b"KVPH\x02".to_vec();
    f.extend_from_slice(&(writer.len() as u16).to_be_bytes());
    f.extend_from_slice(writer.as_bytes());
    f.extend_from_slice(key);
    s.write_all(&f).unwrap();
}

/// Sends one WRITE frame; returns the ACK status, or None if the connection closed instead.
fn write(s: &mut TcpStream, tid: u64, blocks: &[(u64, u8)]) -> Option<u8> {
    let mut f = b"KVPW".to_vec();
    f.extend_from_slice(&tid.to_be_bytes());
    f.extend_from_slice(&(blocks.len() as u32).to_be_bytes());
    for (i, _) in blocks {
        f.extend_from_slice(&i.to_be_bytes());
    }
    let _ = s.write_all(&f);
    for (_, fill) in blocks {
        let _ = s.write_all(&vec![*fill; LEN as usize]);
    }
    let mut ack = [0u8; 13];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_exact(&mut ack).ok()?;
    assert_eq!(&ack[..4], b"KVPA");
    assert_eq!(u64::from_be_bytes(ack[4..12].try_into().unwrap()), tid);
    Some(ack[12])
}

/// The receiver closed the connection (EOF or reset), as opposed to merely not answering.
fn connection_closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    match s.read(&mut b) {
        Ok(0) => true,
        Err(e) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        Ok(_) => false,
    }
}

fn block(store: &BlockStore, i: u64) -> Vec<u8> {
    store.region().block(i).unwrap().to_vec()
}

#[test]
fn only_permitted_writes_land_and_each_permit_is_used_once() {
    let store = pool("ok");
    let mut rx = plane("10.0.0.1:5710", &store);
    let writer = PeerId::new("10.0.0.2:5710");
    let key = key_for(&mut rx, writer.as_str());
    rx.expect_writes(&writer, &[3, 4]);

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
    assert!(connection_closed(&mut s), "and the writer is cut off");
    assert_eq!(
        block(&store, 3),
        vec![0xaa; LEN as usize],
        "the refused write never touched the pool"
    );
}

#[test]
fn writes_without_a_permit_or_out_of_range_or_from_strangers_are_refused() {
    let store = pool("bad");
    let mut rx = plane("10.0.0.1:5710", &store);
    let writer = PeerId::new("10.0.0.2:5710");
    rx.expect_writes(&writer, &[1]);
    let key = key_for(&mut rx, writer.as_str());
    let stranger_key = key_for(&mut rx, "10.0.0.9:5710");
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
        assert!(connection_closed(&mut s));
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
    rx.end_writes(&writer, &[1]);
}

#[test]
fn a_connection_that_is_not_the_protocol_is_dropped() {
    let store = pool("junk");
    let rx = plane("10.0.0.1:5710", &store);
    let mut s = TcpStream::connect(rx.addr()).unwrap();
    s.write_all(b"GET / HTTP/1.1\r\n\r\n").unwrap();
    assert!(connection_closed(&mut s));
}

#[test]
fn a_writer_sees_its_transfers_fail_when_the_receiver_dies() {
    let (rx_store, tx_store) = (pool("rx"), pool("tx"));
    let mut rx = plane("10.0.0.1:5710", &rx_store);
    let mut tx = plane("10.0.0.2:5710", &tx_store);
    let receiver = PeerId::new("10.0.0.1:5710");
    let advertised = AgentMetadata {
        agent: "rx".into(),
        shm: None,
        tcp: Some(rx.addr().to_string()),
        ..Default::default()
    }
    .encode();
    let memory = RemoteMemory {
        agent_metadata: rx.connect_metadata(&PeerId::new("10.0.0.2:5710"), &advertised),
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
    rx.expect_writes(&PeerId::new("10.0.0.2:5710"), &[0]);
    let tid = tx.write_blocks(&receiver, &[0], &[0]).unwrap();
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
        if let Some(t) = tx.write_blocks(&receiver, &[1], &[1]) {
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
        tx.write_blocks(&receiver, &[1], &[1]).is_none(),
        "no new writes to a faulted peer"
    );
}
