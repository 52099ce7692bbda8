//! The tcp plane over pools in memory the node does not own (`Pool::external`: an engine's
//! registered KV region, block `i` at `base + i × stride`): a transfer out of one such region
//! and into another lands byte-exact, and the bytes between blocks (the stride gaps) and the
//! blocks not written are left as they were, on both sides. Also: a write refused for want of
//! a permit leaves an external region untouched.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpStream;
use std::ptr::NonNull;
use std::time::Duration;

mod tcp_support;

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory};
use kvpeer_proto::PeerId;
use kvpeer_store::Pool;
use memmap2::MmapMut;
use tcp_support::{advertised, closed, hello, issue, plane_over, write, BLOCKS, LEN};

/// Bytes from one block's start to the next: more than a block, and not a multiple of a page.
const STRIDE: u64 = LEN + 328;
/// What the gaps hold before and (it is checked) after every transfer.
const GAP: u8 = 0xEE;
const SPAN: usize = ((BLOCKS - 1) * STRIDE + LEN) as usize;

/// An external region in an anonymous mapping: gaps hold [`GAP`], blocks zero.
fn anonymous_region() -> (Pool, NonNull<u8>) {
    let mut map = MmapMut::map_anon(SPAN).unwrap();
    map.fill(GAP);
    for i in 0..BLOCKS as usize {
        let at = i * STRIDE as usize;
        map[at..at + LEN as usize].fill(0);
    }
    let base = NonNull::new(map.as_mut_ptr()).unwrap();
    // SAFETY: the pool owns the mapping (keep-alive) and is its only user; the test reads it
    // only through `raw`, while no transfer runs.
    let pool = unsafe { Pool::external(base, BLOCKS, LEN, STRIDE, Some(Box::new(map))) }.unwrap();
    (pool, base)
}

/// An external region in a `Vec`: gaps hold [`GAP`], block `i` holds `i + 1`.
fn vec_region() -> (Pool, NonNull<u8>) {
    let mut mem = vec![GAP; SPAN];
    for i in 0..BLOCKS as usize {
        let at = i * STRIDE as usize;
        mem[at..at + LEN as usize].fill(i as u8 + 1);
    }
    let base = NonNull::new(mem.as_mut_ptr()).unwrap();
    // SAFETY: as for `anonymous_region`.
    let pool = unsafe { Pool::external(base, BLOCKS, LEN, STRIDE, Some(Box::new(mem))) }.unwrap();
    (pool, base)
}

/// Every byte of the region at `base`, read raw (gaps included).
fn raw(pool: &Pool, base: NonNull<u8>) -> Vec<u8> {
    assert_eq!(pool.span_len() as usize, SPAN);
    // SAFETY: `pool` keeps the region alive, and no transfer is running.
    unsafe { std::slice::from_raw_parts(base.as_ptr(), SPAN) }.to_vec()
}

fn wait<T>(mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..1000 {
        if let Some(t) = f() {
            return t;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out");
}

#[test]
fn a_transfer_between_external_regions_is_byte_exact_and_leaves_the_gaps() {
    let (rx_pool, rx_base) = anonymous_region();
    let (tx_pool, tx_base) = vec_region();
    let (receiver, writer) = (PeerId::new("10.0.0.1:5710"), PeerId::new("10.0.0.2:5710"));
    let mut rx = plane_over(receiver.as_str(), &rx_pool);
    let mut tx = plane_over(writer.as_str(), &tx_pool);
    let tx_before = raw(&tx_pool, tx_base);
    let rx_before = raw(&rx_pool, rx_base);

    let memory = RemoteMemory {
        agent_metadata: rx.connect_metadata(&writer, None, &advertised(&rx)),
        base_addr: rx_pool.base_addr(),
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    tx.add_remote_peer(&receiver, &memory).unwrap();
    let state = wait(|| match tx.registration(&receiver) {
        Registration::Pending => None,
        other => Some(other),
    });
    assert_eq!(state, Registration::Done);

    // Local blocks 0, 2, 7 (the last, ending the span) into the receiver's 7, 1, 3.
    let (local, remote) = ([0u64, 2, 7], [7u64, 1, 3]);
    let (local, remote) = (local.map(BlockIndex::new), remote.map(BlockIndex::new));
    rx.expect_writes(&writer, &remote);
    let tid = tx.write_blocks(&receiver, &local, &remote).unwrap();
    let poll = wait(|| {
        let poll = tx.poll(&receiver);
        (!poll.done.is_empty() || !poll.failed.is_empty() || poll.peer_fault.is_some())
            .then_some(poll)
    });
    assert_eq!(
        (poll.done, poll.failed, poll.peer_fault),
        (vec![tid], vec![], None)
    );

    let mut want = rx_before;
    for (l, r) in local.iter().zip(remote) {
        let at = (r.get() * STRIDE) as usize;
        want[at..at + LEN as usize].fill(l.get() as u8 + 1);
    }
    let got = raw(&rx_pool, rx_base);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(
            g,
            w,
            "receiver byte {i} (block {}, column {})",
            i as u64 / STRIDE,
            i as u64 % STRIDE
        );
    }
    assert_eq!(
        rx_pool.block(BlockIndex::new(1)).unwrap(),
        &[3u8; LEN as usize][..]
    );
    assert_eq!(
        raw(&tx_pool, tx_base),
        tx_before,
        "the sender's region is only read"
    );
    // The permits were used: nothing more may land.
    rx.end_writes(&writer, &remote);
}

#[test]
fn a_write_without_a_permit_leaves_an_external_region_untouched() {
    let (pool, base) = anonymous_region();
    let mut rx = plane_over("10.0.0.1:5710", &pool);
    let writer = "10.0.0.2:5710";
    let key = issue(&mut rx, writer);
    rx.expect_writes(&PeerId::new(writer), &[BlockIndex::new(2)]);
    let before = raw(&pool, base);
    let mut s = TcpStream::connect(rx.addr()).unwrap();
    hello(&mut s, writer, &key);
    assert_eq!(
        write(&mut s, 1, &[(2, 0x11), (3, 0x11)]),
        Some(1),
        "no permit for 3"
    );
    assert!(closed(&mut s));
    assert_eq!(raw(&pool, base), before);
    // The permit for block 2 survived the refused frame, and lands exactly there.
    let mut s = TcpStream::connect(rx.addr()).unwrap();
    hello(&mut s, writer, &key);
    assert_eq!(write(&mut s, 2, &[(2, 0x5a)]), Some(0));
    let mut want = before;
    let at = (2 * STRIDE) as usize;
    want[at..at + LEN as usize].fill(0x5a);
    assert_eq!(raw(&pool, base), want);
}
