//! The tcp plane at many peers: its threads and descriptors do not grow with the number of
//! peers it writes to. One writer plane registers 200 peers (all at one receiver plane, which
//! issued the key the writer presents) and writes one block to each in turn: every block lands
//! byte-exact, and at no point does the process hold more than the two planes' four threads,
//! nor does a link left idle keep a data connection. Runs alone in a child process (it counts
//! the process's threads and descriptors).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

#[allow(dead_code)]
mod fd_support;
mod tcp_support;

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::tcp::TcpLimits;
use kvpeer_proto::PeerId;
use tcp_support::*;

const TX: &str = "10.0.0.2:5710";

/// Threads of this process whose name starts with `prefix`.
fn threads_named(prefix: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.starts_with(prefix))
        .count()
}

/// Descriptors this process holds.
fn descriptors() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
fn threads_and_descriptors_do_not_grow_with_the_peers_written_to() {
    if !fd_support::run_alone("threads_and_descriptors_do_not_grow_with_the_peers_written_to") {
        return;
    }
    const PEERS: u64 = 200;
    let rx_store = pool("scale-rx");
    let mut tx_store = pool("scale-tx");
    let mut rx = plane("10.0.0.1:5710", &rx_store, TcpLimits::default());
    let mut tx = plane(TX, &tx_store, TcpLimits::default());
    let key = issue(&mut rx, TX);
    let memory = RemoteMemory {
        agent_metadata: AgentMetadata {
            agent: "rx".into(),
            tcp: Some(rx.addr().to_string()),
            tcp_key: Some(key),
            ..Default::default()
        }
        .encode(),
        base_addr: 0,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    let bytes: Vec<u8> = (0..LEN).map(|i| (i as u8).wrapping_mul(13)).collect();
    let local = tx_store
        .put(&kvpeer_proto::OffloadKey::from_parts(&[7; 32], 0), &bytes)
        .unwrap();
    let before = descriptors();
    let mut most_threads = 0;
    for i in 0..PEERS {
        let peer = PeerId::new(format!("127.0.0.1:{}", 20_000 + i));
        tx.add_remote_peer(&peer, &memory).unwrap();
        assert_eq!(tx.registration(&peer), Registration::Done);
        let remote = BlockIndex::new(i % BLOCKS);
        rx.expect_writes(&PeerId::new(TX), &[remote]);
        let tid = tx.write_blocks(&peer, &[local], &[remote]).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let poll = tx.poll(&peer);
            if poll.done.contains(&tid) {
                break;
            }
            assert!(
                poll.failed.is_empty() && poll.peer_fault.is_none(),
                "peer {i}: {poll:?}"
            );
            assert!(Instant::now() < deadline, "peer {i}: no completion");
            std::thread::sleep(Duration::from_millis(1));
        }
        most_threads = most_threads.max(threads_named("kvpeer-tcp"));
        let landed = rx_store.pool().view().block(remote).unwrap().to_vec();
        assert_eq!(landed, bytes, "peer {i}: the block landed byte-exact");
    }
    assert!(
        most_threads <= 4,
        "{most_threads} tcp threads for {PEERS} peers (two per plane expected)"
    );
    // The receiver keeps one connection per writer id; the writer keeps at most its last link's.
    let held = descriptors().saturating_sub(before);
    assert!(
        held <= 4,
        "{held} more descriptors after writing to {PEERS} peers"
    );
}
