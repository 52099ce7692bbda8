//! Issue 41's disk-tier figures at the store: write and read GB/s of the tier at 64 KiB and
//! 2 MiB blocks, and a restart's time to the first hit. `scripts/bench-pool-disk.sh` runs it
//! beside `fio` on the same file system (the device's limit, measured in the same run).
//!
//! Run: `cargo bench -p kvpeer-store --bench disk_tier -- --dir DIR [--gib G] [--threads T]
//! [--block-len BYTES]...` (defaults: `target/bench-disk`, 2 GiB per block size, 8 threads,
//! 64 KiB and 2 MiB).
//!
//! * **write**: `G` GiB of blocks `put` into a store whose memory holds 64 MiB, as fast as
//!   the store takes them (memory full of blocks waiting for the disk refuses more: the
//!   writer waits), until the last is on disk. Bytes of blocks per second.
//! * **restart**: the store dropped (its writes finished) and made again on the same file:
//!   seconds to open it (every slot's header read) and to the first block read back.
//! * **read**: every block looked up in turn, up to half of memory in flight, each a read
//!   from disk into memory checked against its CRC-32C, then pinned and unpinned as the core
//!   serves a hit; one in 64 compared byte for byte.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvpeer_core::LookupResult;
use kvpeer_proto::OffloadKey;
use kvpeer_store::disk::{DiskConfig, DiskEngine, Promote};
use kvpeer_store::{BlockStore, Pool};

struct Opts {
    dir: PathBuf,
    gib: f64,
    threads: usize,
    block_lens: Vec<u64>,
    engine: DiskEngine,
}

fn opts() -> Opts {
    let mut o = Opts {
        dir: PathBuf::from("target/bench-disk"),
        gib: 2.0,
        threads: 8,
        block_lens: Vec::new(),
        engine: DiskEngine::Auto,
    };
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut val = || args.next().expect("a value after the option");
        match a.as_str() {
            "--dir" => o.dir = PathBuf::from(val()),
            "--gib" => o.gib = val().parse().expect("--gib G"),
            "--threads" => o.threads = val().parse().expect("--threads T"),
            "--block-len" => o.block_lens.push(val().parse().expect("--block-len BYTES")),
            "--engine" => o.engine = val().parse().expect("--engine auto|uring|threads"),
            _ => {} // `--bench`, from cargo
        }
    }
    if o.block_lens.is_empty() {
        o.block_lens = vec![64 << 10, 2 << 20];
    }
    o
}

fn key(n: u64) -> OffloadKey {
    OffloadKey::from_parts(&n.to_be_bytes(), 0)
}

/// Block `n`: a pattern with `n` in its first and last 8 bytes.
fn block(n: u64, pattern: &[u8]) -> Vec<u8> {
    let mut b = pattern.to_vec();
    let len = b.len();
    b[..8].copy_from_slice(&n.to_le_bytes());
    b[len - 8..].copy_from_slice(&n.to_le_bytes());
    b
}

fn store(o: &Opts, block_len: u64, blocks: u64) -> BlockStore {
    let memory = ((64u64 << 20) / block_len).max(32);
    let pool = Pool::anonymous(memory, block_len, false).unwrap();
    let mut s = BlockStore::with_pool(pool).unwrap();
    let slot = block_len.next_multiple_of(4096) + 4096;
    s.attach_disk(
        &DiskConfig {
            dir: o.dir.clone(),
            capacity: 4096 + (blocks + 16) * slot,
            threads: o.threads,
            promote: Promote::Hot,
            engine: o.engine,
            tenant_names: Vec::new(),
            default_tenant: String::new(),
        },
        Arc::new(|| {}),
    )
    .unwrap();
    s
}

fn idle(s: &mut BlockStore) {
    if !s.poll_disk() {
        std::thread::yield_now();
    }
}

fn main() {
    let o = opts();
    println!(
        "disk tier at {}: {} GiB per block size, engine {}, {} I/O threads (io_uring: {} entries), memory 64 MiB",
        o.dir.display(),
        o.gib,
        o.engine.name(),
        o.threads,
        o.threads * 8
    );
    println!("| block | write GB/s | restart: open | restart: first hit | read GB/s | blocks |");
    println!("|---|---|---|---|---|---|");
    for &len in &o.block_lens {
        let _ = std::fs::remove_dir_all(&o.dir);
        let n = ((o.gib * (1u64 << 30) as f64) / len as f64) as u64;
        let pattern: Vec<u8> = (0..len).map(|i| (i * 131 % 251) as u8).collect();
        let blocks: Vec<Vec<u8>> = (0..64).map(|i| block(i, &pattern)).collect();

        let mut s = store(&o, len, n);
        let started = Instant::now();
        for i in 0..n {
            let mut b = blocks[(i % 64) as usize].clone();
            b[..8].copy_from_slice(&i.to_le_bytes());
            b[len as usize - 8..].copy_from_slice(&i.to_le_bytes());
            while s.put(&key(i), &b).is_err() {
                idle(&mut s);
            }
        }
        while s.stats().pinned > 0 || s.stats().disk.unwrap().queue_depth > 0 {
            idle(&mut s);
        }
        let write_s = started.elapsed().as_secs_f64();
        let d = s.stats().disk.unwrap();
        assert_eq!(d.demotions, n, "{d:?}");
        drop(s);

        let reopened = Instant::now();
        let mut s = store(&o, len, n);
        let open_s = reopened.elapsed().as_secs_f64();
        assert_eq!(s.stats().disk.unwrap().recovered_blocks, n);
        while s.lookup(&key(0)) != LookupResult::Hit {
            idle(&mut s);
        }
        let job = s.pin(&[key(0)]).unwrap();
        s.unpin(job.job_id);
        let first_hit_s = reopened.elapsed().as_secs_f64();

        let memory = s.stats().capacity;
        let window = (memory / 2).max(1);
        let started = Instant::now();
        let mut next = 1u64;
        let mut waiting: std::collections::VecDeque<u64> = Default::default();
        let mut done = 1u64;
        while done < n {
            while next < n && (waiting.len() as u64) < window {
                match s.lookup(&key(next)) {
                    LookupResult::Hit => {
                        // As the core does: a hit is pinned, served, unpinned.
                        let job = s.pin(&[key(next)]).unwrap();
                        s.unpin(job.job_id);
                        done += 1;
                    }
                    _ => waiting.push_back(next),
                }
                next += 1;
            }
            idle(&mut s);
            let mut still = std::collections::VecDeque::new();
            for k in waiting.drain(..) {
                match s.lookup(&key(k)) {
                    LookupResult::Hit => {
                        let job = s.pin(&[key(k)]).unwrap();
                        if k % 64 == 0 {
                            let b = s.read(job.blocks[0]).unwrap();
                            assert_eq!(&b[..8], &k.to_le_bytes(), "block {k}");
                            assert_eq!(&b[8..len as usize - 8], &pattern[8..len as usize - 8]);
                        }
                        s.unpin(job.job_id);
                        done += 1;
                    }
                    LookupResult::Miss => panic!("block {k} lost"),
                    _ => still.push_back(k),
                }
            }
            waiting = still;
        }
        let read_s = started.elapsed().as_secs_f64();
        let d = s.stats().disk.unwrap();
        assert_eq!(d.corrupt + d.io_errors, 0, "{d:?}");
        drop(s);
        let gb = (n * len) as f64 / 1e9;
        println!(
            "| {} KiB | {:.2} | {:.3} s | {:.3} s | {:.2} | {n} |",
            len >> 10,
            gb / write_s,
            open_s,
            first_hit_s,
            gb / (read_s.max(1e-9)),
        );
    }
    let _ = std::fs::remove_dir_all(&o.dir);
}
