//! The disk tier in real `kvpeer serve` processes: a pool holding six times its memory serves
//! every block byte-exact, and a pool killed (SIGKILL) in the middle of heavy writes, started
//! again on its disk, serves what survived byte-exact (each block under its own key only) and
//! nothing torn. A SIGTERM loses nothing. The consumer is an in-process `Node` that checks
//! every byte it received against the block its key names.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use kvpeer::{synthetic, LookupResult, Node, NodeConfig, OffloadKey, PeerId, PlaneKind};

mod common;
use common::Proc;

const LEN: u64 = 65536;

/// A directory for one test's tier, removed when dropped.
struct TierDir(PathBuf);

impl TierDir {
    fn new(tag: &str) -> TierDir {
        let dir = std::env::temp_dir().join(format!("kvpeer-tier-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        TierDir(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TierDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn serve_args<'a>(
    dir: &'a TierDir,
    capacity: &'a str,
    blocks: &'a str,
    fill: &'a str,
) -> Vec<&'a str> {
    vec![
        "--plane",
        "tcp",
        "--blocks",
        blocks,
        "--block-len",
        "65536",
        "--disk-path",
        dir.path(),
        "--disk-capacity",
        capacity,
        "--fill",
        fill,
    ]
}

fn reader(tag: &str) -> Node {
    reader_on(tag, PlaneKind::Tcp)
}

fn reader_on(tag: &str, plane: PlaneKind) -> Node {
    let config = NodeConfig::builder(tag)
        .plane(plane)
        .num_blocks(64)
        .block_len(LEN)
        .build()
        .unwrap();
    Node::start(config).unwrap()
}

/// Asks `from` for synthetic keys `range`, `per` at a time, fetches the hits and checks each
/// byte received. Returns the keys that hit.
fn read_all(node: &Node, from: &PeerId, range: std::ops::Range<u64>, per: usize) -> Vec<u64> {
    let all: Vec<u64> = range.collect();
    let mut hits = Vec::new();
    for (n, chunk) in all.chunks(per).enumerate() {
        let keys: Vec<OffloadKey> = chunk.iter().map(|i| synthetic::key(*i)).collect();
        let r = node.request(from, &format!("disk-{n}")).unwrap();
        let found = r.lookup(&keys, Duration::from_secs(20)).unwrap();
        let hit: Vec<OffloadKey> = keys
            .iter()
            .zip(&found)
            .filter(|(_, f)| **f == LookupResult::Hit)
            .map(|(k, _)| k.clone())
            .collect();
        if !hit.is_empty() {
            r.fetch(&hit, Duration::from_secs(20)).unwrap();
        }
        r.finish();
        for (i, k) in chunk.iter().zip(&keys) {
            if hit.contains(k) {
                assert_eq!(
                    node.read(k),
                    Some(synthetic::content(k, LEN as usize)),
                    "block {i}: its bytes are not its key's"
                );
                hits.push(*i);
            }
        }
    }
    hits
}

/// The blocks `serve` found on its disk, from its log (read by a thread: waited for).
fn recovered(serve: &Proc) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = serve.log();
        let found = log
            .lines()
            .find(|l| l.contains("disk tier open"))
            .and_then(|l| common::field(l, "recovered"))
            .and_then(|v| v.parse().ok());
        if let Some(n) = found {
            return n;
        }
        assert!(Instant::now() < deadline, "no 'disk tier open' line: {log}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// On every plane a host's peers use: tcp, and shm (the producer copies into the consumer's
/// shared memory from blocks it read back from disk).
#[test]
fn a_pool_six_times_its_memory_serves_every_block_byte_exact() {
    for (plane, kind) in [("tcp", PlaneKind::Tcp), ("shm", PlaneKind::Shm)] {
        let dir = TierDir::new(&format!("six-{plane}"));
        let mut args = serve_args(&dir, "10M", "16", "96");
        args[1] = plane;
        let (serve, id) = Proc::serve(&args);
        let r = reader_on(&format!("disk-six-{plane}"), kind);
        let hits = read_all(&r, &id, 0..96, 8);
        assert_eq!(hits.len(), 96, "{plane}: every block is served");
        drop(serve);
    }
}

#[test]
fn a_pool_killed_mid_write_serves_only_intact_blocks_and_a_stopped_one_loses_none() {
    let dir = TierDir::new("kill");
    // Heavy writes: 6,000 blocks (393 MB, a few seconds) through 32 blocks of memory.
    let mut first = Proc::spawn(
        &[&["serve"][..], &serve_args(&dir, "420M", "32", "6000")].concat(),
        "serve",
    );
    // Killed once a few hundred blocks are down and writes are still going.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let log = first.log();
        if log.contains("disk tier open") {
            break;
        }
        assert!(Instant::now() < deadline, "the tier never opened: {log}");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        first.stdout.try_recv().is_err(),
        "the fill (before the ready line) ended before the kill: make it larger"
    );
    first.kill9();

    let (second, id) = Proc::serve(&serve_args(&dir, "420M", "32", "0"));
    let found = recovered(&second);
    assert!(found > 0 && found < 6000, "{found} blocks recovered");
    let r = reader("disk-kill-r");
    let hits = read_all(&r, &id, 0..6000, 16);
    // Each hit was checked byte for byte against its own key; a torn block is a miss.
    assert!(
        hits.len() as u64 >= found.saturating_sub(64) && hits.len() as u64 <= found,
        "{} hits of {found} recovered",
        hits.len()
    );
    let mut second = second;
    assert_eq!(second.terminate(Duration::from_secs(30)), 0);

    // Stopped cleanly, it keeps everything: the third start finds what the second held.
    let (third, id) = Proc::serve(&serve_args(&dir, "420M", "32", "0"));
    assert_eq!(recovered(&third), found);
    let again = read_all(&r, &id, 0..6000, 16);
    assert_eq!(again, hits);
    drop(third);
}

#[test]
fn a_stopped_pool_restarts_holding_everything_it_filled() {
    let dir = TierDir::new("term");
    let (mut first, _) = Proc::serve(&serve_args(&dir, "10M", "8", "100"));
    assert_eq!(first.terminate(Duration::from_secs(30)), 0);
    let (second, id) = Proc::serve(&serve_args(&dir, "10M", "8", "0"));
    assert_eq!(recovered(&second), 100);
    let r = reader("disk-term-r");
    assert_eq!(read_all(&r, &id, 0..100, 4).len(), 100);
    drop(second);
}

/// docs/pool.md, "Upgrading pools, one at a time", run as written: two pools on their own
/// disks, each stopped with SIGTERM and started again with the same configuration and address
/// in turn. The other pool serves throughout; each serves all its blocks once it is back.
#[test]
fn the_rolling_upgrade_of_two_pools_keeps_every_block_served_byte_exact() {
    let dirs = [TierDir::new("roll-a"), TierDir::new("roll-b")];
    let listens = [0, 1].map(|_| format!("127.0.0.1:{}", common::free_port()));
    let start = |i: usize, fill: &str| {
        let mut args = serve_args(&dirs[i], "10M", "16", fill);
        args.extend(["--listen", listens[i].as_str()]);
        Proc::serve(&args)
    };
    let (a, a_id) = start(0, "40");
    let (b, b_id) = start(1, "40");
    let mut pools = [(a, a_id), (b, b_id)];
    for i in 0..2 {
        let other = 1 - i;
        assert_eq!(
            pools[i].0.terminate(Duration::from_secs(30)),
            0,
            "pool {i} stops cleanly"
        );
        let r = reader(&format!("disk-roll-{i}-during"));
        assert_eq!(
            read_all(&r, &pools[other].1, 0..40, 4).len(),
            40,
            "pool {other} serves while pool {i} is down"
        );
        let (again, id) = start(i, "0");
        assert_eq!(id, pools[i].1, "back at the same address");
        assert_eq!(recovered(&again), 40);
        pools[i] = (again, id);
        let r = reader(&format!("disk-roll-{i}-after"));
        assert_eq!(
            read_all(&r, &pools[i].1, 0..40, 4).len(),
            40,
            "pool {i} serves every block it held"
        );
    }
}
