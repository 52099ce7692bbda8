//! Data-plane throughput against the machine's limit, in one run.
//!
//! Run: `cargo bench -p kvpeer-net --bench planes`
//!
//! One "fetch" writes 64 blocks (64 KiB or 2 MiB each) from one pool into another:
//! * `shm` plane vs a plain `memcpy` of the same bytes between two buffers (target ≥ 0.8×);
//! * `tcp` plane (over loopback, with write permits and acknowledgements) vs a raw loopback
//!   TCP stream of the same bytes into a buffer, acknowledged by one byte (target ≥ 0.85×).
//!
//! Each figure is the median over the runs (the raw TCP limit: the best median of three
//! connections); ratios compare figures of this run.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::shm::ShmPlane;
use kvpeer_net::data::tcp::TcpPlane;
use kvpeer_proto::PeerId;
use kvpeer_store::{BlockStore, StoreConfig};

const PER_FETCH: u64 = 64;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn gbps(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn pool(tag: &str, len: u64) -> BlockStore {
    let name = format!("kvpeer-bench-{tag}-{len}-{}", std::process::id());
    let mut s = BlockStore::new(&StoreConfig {
        shm_name: name,
        num_blocks: PER_FETCH,
        block_len: len,
        lock_memory: false,
    })
    .unwrap();
    // Fill the writer's side so pages are real (and the reader's are touched too).
    for i in 0..PER_FETCH {
        let mut h = [0u8; 32];
        h[..8].copy_from_slice(&i.to_be_bytes());
        let key = kvpeer_proto::OffloadKey::from_parts(&h, 0);
        s.put(&key, &vec![i as u8 ^ 0x5a; len as usize]).unwrap();
    }
    s
}

/// A wake hook that a waiting thread can sleep on (as the node's runtime does).
fn waker() -> (kvpeer_net::data::shm::Wake, std::sync::mpsc::Receiver<()>) {
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = std::sync::Mutex::new(tx);
    (
        Arc::new(move || {
            let _ = tx.lock().map(|t| t.send(()));
        }),
        rx,
    )
}

/// Sleeps until woken, then asks `f`; repeats until it answers.
fn wait<T>(woken: &std::sync::mpsc::Receiver<()>, mut f: impl FnMut() -> Option<T>) -> T {
    loop {
        if let Some(v) = f() {
            return v;
        }
        let _ = woken.recv_timeout(Duration::from_millis(100));
    }
}

fn memcpy_gbps(len: u64, runs: usize) -> f64 {
    let total = (PER_FETCH * len) as usize;
    let src = vec![0x5au8; total];
    let mut dst = vec![0u8; total];
    dst.copy_from_slice(&src);
    let v = (0..runs)
        .map(|_| {
            let t = Instant::now();
            for b in 0..PER_FETCH as usize {
                let r = b * len as usize..(b + 1) * len as usize;
                dst[r.clone()].copy_from_slice(&src[r]);
            }
            std::hint::black_box(&dst);
            gbps(total as u64, t.elapsed())
        })
        .collect();
    median(v)
}

fn register<P: DataPlane>(plane: &mut P, peer: &PeerId, meta: AgentMetadata, len: u64) {
    let memory = RemoteMemory {
        agent_metadata: meta.encode(),
        base_addr: 0,
        num_blocks: PER_FETCH,
        block_len: len,
    };
    plane.add_remote_peer(peer, &memory).unwrap();
    let t = Instant::now();
    while plane.registration(peer) == Registration::Pending {
        assert!(t.elapsed() < Duration::from_secs(10), "registration");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(plane.registration(peer), Registration::Done);
}

fn plane_gbps<P: DataPlane>(
    tx: &mut P,
    woken: &std::sync::mpsc::Receiver<()>,
    rx_permits: &mut dyn FnMut(),
    peer: &PeerId,
    len: u64,
    runs: usize,
) -> f64 {
    let blocks: Vec<BlockIndex> = (0..PER_FETCH).map(BlockIndex::new).collect();
    let v = (0..runs + 1)
        .map(|_| {
            rx_permits();
            let t = Instant::now();
            let tid = tx.write_blocks(peer, &blocks, &blocks).unwrap();
            wait(woken, || {
                let p = tx.poll(peer);
                assert!(p.failed.is_empty() && p.peer_fault.is_none(), "{p:?}");
                p.done.contains(&tid).then_some(())
            });
            gbps(PER_FETCH * len, t.elapsed())
        })
        .skip(1)
        .collect();
    median(v)
}

fn raw_tcp_gbps(len: u64, runs: usize) -> f64 {
    let total = (PER_FETCH * len) as usize;
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let reader = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut buf = vec![0u8; total];
        for _ in 0..=runs {
            s.read_exact(&mut buf).unwrap();
            s.write_all(&[1]).unwrap();
        }
    });
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_nodelay(true).unwrap();
    let src = vec![0x5au8; total];
    let mut ack = [0u8; 1];
    let v = (0..=runs)
        .map(|_| {
            let t = Instant::now();
            for b in 0..PER_FETCH as usize {
                s.write_all(&src[b * len as usize..(b + 1) * len as usize])
                    .unwrap();
            }
            s.read_exact(&mut ack).unwrap();
            gbps(total as u64, t.elapsed())
        })
        .skip(1)
        .collect();
    reader.join().unwrap();
    median(v)
}

/// A tcp receiver over `b` (`pb`, asking for block digests where `digests`) and a writer over
/// `a` (`pa`) registered with it: (receiver, writer, the writer's wake flag).
fn tcp_pair(
    a: &BlockStore,
    b: &BlockStore,
    pa: &PeerId,
    pb: &PeerId,
    len: u64,
    digests: bool,
) -> (TcpPlane, TcpPlane, std::sync::mpsc::Receiver<()>) {
    let mut rx = TcpPlane::new(
        pb.clone(),
        b.pool().writer(),
        "127.0.0.1:0",
        Arc::new(|| {}),
    )
    .unwrap()
    .with_block_digests(digests);
    let (wake, woken) = waker();
    let mut tx = TcpPlane::new(pa.clone(), a.pool().writer(), "127.0.0.1:0", wake).unwrap();
    let advertised = AgentMetadata {
        agent: "b".into(),
        tcp: Some(rx.addr().to_string()),
        ..Default::default()
    };
    // b's `connect` to a carries the key a's HELLO presents to b's data port.
    let with_key =
        AgentMetadata::decode(&rx.connect_metadata(pa, None, &advertised.encode())).unwrap();
    register(&mut tx, pb, with_key, len);
    (rx, tx, woken)
}

fn main() {
    println!("data planes: {PER_FETCH} blocks per fetch, one pool to another in one process, median of runs");
    println!(
        "{:>9} {:>6} {:>12} {:>12} {:>8} {:>8}",
        "block", "plane", "plane GB/s", "limit GB/s", "ratio", "target"
    );
    for (len, runs) in [(64 * 1024u64, 200usize), (2 * 1024 * 1024, 20)] {
        let label = if len >= 1 << 20 {
            format!("{} MiB", len >> 20)
        } else {
            format!("{} KiB", len >> 10)
        };
        let (a, b) = (pool("a", len), pool("b", len));
        let (pa, pb) = (PeerId::new("127.0.0.1:7001"), PeerId::new("127.0.0.1:7002"));

        // shm vs memcpy
        let limit = memcpy_gbps(len, runs);
        let (wake, woken) = waker();
        let mut tx = ShmPlane::new(pa.clone(), a.pool().view().clone(), wake).unwrap();
        register(
            &mut tx,
            &pb,
            AgentMetadata {
                agent: "b".into(),
                shm: b.pool().shm_name().map(str::to_owned),
                // b's proof, made for the writer (a), that it owns its pool.
                shm_token: Some(
                    kvpeer_store::trailer::token(
                        b.pool().shm().unwrap().secret(),
                        pa.as_str(),
                        None,
                    )
                    .to_vec(),
                ),
                tcp: None,
                ..Default::default()
            },
            len,
        );
        let got = plane_gbps(&mut tx, &woken, &mut || {}, &pb, len, runs);
        println!(
            "{label:>9} {:>6} {got:>12.2} {limit:>12.2} {:>7.2}x {:>8}",
            "shm",
            got / limit,
            ">=0.8x"
        );
        drop(tx);

        // tcp vs a raw loopback stream: the limit is the best of three fresh connections (a
        // single one is sometimes scheduled badly, which would flatter the plane).
        let limit = (0..3).map(|_| raw_tcp_gbps(len, runs)).fold(0.0, f64::max);
        let (mut rx, mut tx, woken) = tcp_pair(&a, &b, &pa, &pb, len, false);
        let blocks: Vec<BlockIndex> = (0..PER_FETCH).map(BlockIndex::new).collect();
        let got = plane_gbps(
            &mut tx,
            &woken,
            &mut || rx.expect_writes(&pa, &blocks),
            &pb,
            len,
            runs,
        );
        println!(
            "{label:>9} {:>6} {got:>12.2} {limit:>12.2} {:>7.2}x {:>8}",
            "tcp",
            got / limit,
            ">=0.85x"
        );
        drop((tx, rx));

        // tcp with block digests (`tcp_block_digests`): a CRC-32C per block on each side,
        // beside the same limit and the CRC's own rate on one core.
        let (mut rx, mut tx, woken) = tcp_pair(&a, &b, &pa, &pb, len, true);
        let got = plane_gbps(
            &mut tx,
            &woken,
            &mut || rx.expect_writes(&pa, &blocks),
            &pb,
            len,
            runs,
        );
        assert_eq!(rx.counters().digest_mismatches, 0);
        println!(
            "{label:>9} {:>6} {got:>12.2} {limit:>12.2} {:>7.2}x {:>8}",
            "tcp+crc",
            got / limit,
            "-"
        );
        let view = a.pool().view();
        let block = view.block(BlockIndex::new(0)).unwrap();
        let reps = (1u64 << 30) / len;
        let started = Instant::now();
        let mut acc = 0u32;
        for _ in 0..reps {
            acc ^= crc32c::crc32c(std::hint::black_box(block));
        }
        std::hint::black_box(acc);
        println!(
            "{label:>9} {:>6} {:>12.2} {:>12} {:>8} {:>8}",
            "crc32c",
            gbps(reps * len, started.elapsed()),
            "-",
            "-",
            "1 core"
        );
    }
}
