//! What the tcp plane's tests share: a small pool, a plane over it, the key a receiver issues,
//! and the raw frames a writer (honest or not) sends on a data connection.

#![allow(dead_code, clippy::unwrap_used)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use kvpeer_core::{BlockIndex, DataPlane};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::tcp::{TcpLimits, TcpPlane};
use kvpeer_proto::PeerId;
use kvpeer_store::{BlockStore, Pool, StoreConfig};

pub(crate) const BLOCKS: u64 = 8;
pub(crate) const LEN: u64 = 4096;

/// A pool of [`BLOCKS`] blocks, its object named after `tag` and this process.
pub(crate) fn pool(tag: &str) -> BlockStore {
    BlockStore::new(&StoreConfig {
        shm_name: format!("kvpeer-tcp-{tag}-{}", std::process::id()),
        num_blocks: BLOCKS,
        block_len: LEN,
        lock_memory: false,
    })
    .unwrap()
}

/// A tcp plane for node `id` over `store`, listening on a free loopback port.
pub(crate) fn plane(id: &str, store: &BlockStore, limits: TcpLimits) -> TcpPlane {
    TcpPlane::new(
        PeerId::new(id),
        store.pool().writer(),
        "127.0.0.1:0",
        Arc::new(|| {}),
    )
    .unwrap()
    .with_limits(limits)
}

/// What `rx` advertises: its tcp listener.
pub(crate) fn advertised(rx: &TcpPlane) -> Vec<u8> {
    AgentMetadata {
        agent: "rx".into(),
        tcp: Some(rx.addr().to_string()),
        ..Default::default()
    }
    .encode()
}

/// The key `rx` issues to `writer` in its `connect` (a fresh one each call).
pub(crate) fn issue(rx: &mut TcpPlane, writer: &str) -> Vec<u8> {
    let adv = advertised(rx);
    let meta = rx.connect_metadata(&PeerId::new(writer), None, &adv);
    AgentMetadata::decode(&meta).unwrap().tcp_key.unwrap()
}

pub(crate) fn hello_bytes(version: u8, writer: &str, key: &[u8]) -> Vec<u8> {
    let mut f = b"KVPH".to_vec();
    f.push(version);
    f.extend_from_slice(&(writer.len() as u16).to_be_bytes());
    f.extend_from_slice(writer.as_bytes());
    f.extend_from_slice(key);
    f
}

/// Sends a version-2 HELLO on `s`.
pub(crate) fn hello(s: &mut TcpStream, writer: &str, key: &[u8]) {
    s.write_all(&hello_bytes(2, writer, key)).unwrap();
}

/// A connection to `rx` that has sent its HELLO.
pub(crate) fn connect_hello(rx: &TcpPlane, writer: &str, key: &[u8]) -> TcpStream {
    let mut s = TcpStream::connect(rx.addr()).unwrap();
    hello(&mut s, writer, key);
    s
}

pub(crate) fn write_header(tid: u64, indexes: &[u64]) -> Vec<u8> {
    let mut f = b"KVPW".to_vec();
    f.extend_from_slice(&tid.to_be_bytes());
    f.extend_from_slice(&(indexes.len() as u32).to_be_bytes());
    for i in indexes {
        f.extend_from_slice(&i.to_be_bytes());
    }
    f
}

/// Sends one WRITE frame; returns the ACK status, or None if the connection closed instead.
pub(crate) fn write(s: &mut TcpStream, tid: u64, blocks: &[(u64, u8)]) -> Option<u8> {
    let indexes: Vec<u64> = blocks.iter().map(|(i, _)| *i).collect();
    let _ = s.write_all(&write_header(tid, &indexes));
    for (_, fill) in blocks {
        let _ = s.write_all(&vec![*fill; LEN as usize]);
    }
    read_ack(s, tid)
}

/// The status of the ACK of `tid` (checked to name it), or None if the connection closed
/// instead.
pub(crate) fn read_ack(s: &mut TcpStream, tid: u64) -> Option<u8> {
    let mut ack = [0u8; 13];
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    s.read_exact(&mut ack).ok()?;
    assert_eq!(&ack[..4], b"KVPA");
    assert_eq!(u64::from_be_bytes(ack[4..12].try_into().unwrap()), tid);
    Some(ack[12])
}

/// The receiver closed the connection (EOF or reset) within `within`, as opposed to merely
/// not answering.
pub(crate) fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut b = [0u8; 64];
    s.set_read_timeout(Some(within)).unwrap();
    match s.read(&mut b) {
        Ok(0) => true,
        Err(e) => matches!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
        ),
        Ok(_) => false,
    }
}

pub(crate) fn closed(s: &mut TcpStream) -> bool {
    closed_within(s, Duration::from_secs(5))
}

pub(crate) fn block(store: &BlockStore, i: u64) -> Vec<u8> {
    store.pool().block(BlockIndex::new(i)).unwrap().to_vec()
}

/// A tcp plane for node `id` over a bare `pool`, listening on a free loopback port.
pub(crate) fn plane_over(id: &str, pool: &Pool) -> TcpPlane {
    TcpPlane::new(
        PeerId::new(id),
        pool.writer(),
        "127.0.0.1:0",
        Arc::new(|| {}),
    )
    .unwrap()
}

/// Fills `pool`'s block `b` with bytes that occur nowhere else (xorshift from `seed`).
pub(crate) fn fill_unique(pool: &mut Pool, b: u64, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let len = pool.view().block_len();
    let bytes: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect();
    pool.block_mut(BlockIndex::new(b))
        .unwrap()
        .copy_from_slice(&bytes);
    bytes
}
