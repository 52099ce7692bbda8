//! The disk tier under a store: blocks beyond memory kept on disk and read back byte-exact,
//! a restart that finds them again, torn writes that are misses, never wrong bytes.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::LookupResult;
use kvpeer_proto::OffloadKey;
use kvpeer_store::disk::{DiskConfig, DiskEngine, DiskError, Promote, FILE_NAME};
use kvpeer_store::{BlockStore, KeyChange, Pool, Tenant};

const BLOCK: u64 = 8192;

fn key(n: u64) -> OffloadKey {
    OffloadKey::from_parts(&n.to_be_bytes(), 0)
}

/// Block `n`'s bytes: every byte depends on `n` and its offset.
fn bytes(n: u64) -> Vec<u8> {
    (0..BLOCK)
        .map(|i| (n.wrapping_mul(31) ^ i.wrapping_mul(7)) as u8)
        .collect()
}

/// The engine the store tests run on: io_uring (`KVPEER_DISK_IO=threads` for the threads).
fn engine() -> DiskEngine {
    std::env::var("KVPEER_TEST_DISK_IO")
        .ok()
        .and_then(|e| e.parse().ok())
        .unwrap_or(DiskEngine::Auto)
}

fn config(dir: &std::path::Path, blocks: u64) -> DiskConfig {
    DiskConfig {
        dir: dir.to_path_buf(),
        capacity: 4096 + blocks * (BLOCK + 4096),
        threads: 4,
        promote: Promote::Hot,
        engine: engine(),
        tenant_names: vec!["alpha".into(), "beta".into()],
        default_tenant: String::new(),
    }
}

fn store_on(dir: &std::path::Path, memory_blocks: u64, disk_blocks: u64) -> BlockStore {
    let pool = Pool::anonymous(memory_blocks, BLOCK, false).unwrap();
    let mut store = BlockStore::with_pool(pool).unwrap();
    store
        .attach_disk(&config(dir, disk_blocks), Arc::new(|| {}))
        .unwrap();
    store.record_changes(100_000);
    store
}

/// Steps the store until `done` says so (at most 10 s).
fn settle(store: &mut BlockStore, mut done: impl FnMut(&mut BlockStore) -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !done(store) {
        assert!(Instant::now() < end, "the disk tier did not finish in 10 s");
        store.poll_disk();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Looks `n` up until it is a hit or a miss and, as the core does, pins a hit, reads it and
/// unpins it; returns its bytes if a hit.
fn fetch(store: &mut BlockStore, n: u64) -> Option<Vec<u8>> {
    let mut found = LookupResult::Retry;
    settle(store, |s| {
        found = s.lookup(&key(n));
        found != LookupResult::Retry
    });
    (found == LookupResult::Hit).then(|| {
        let job = store.pin(&[key(n)]).expect("a hit pins");
        let bytes = store.read(job.blocks[0]).unwrap().to_vec();
        store.unpin(job.job_id);
        bytes
    })
}

fn all_written(store: &mut BlockStore) -> bool {
    let s = store.stats();
    s.pinned == 0 && s.disk.unwrap().queue_depth == 0
}

#[test]
fn a_store_holds_four_times_its_memory_and_reads_every_block_back_byte_exact() {
    let dir = tempdir("four-times");
    let mut store = store_on(&dir, 8, 64);
    for n in 0..32 {
        // Memory fills with blocks waiting for the disk: the store says so, and takes the
        // block once the writes caught up.
        loop {
            match store.put(&key(n), &bytes(n)) {
                Ok(_) => break,
                Err(_) => {
                    store.poll_disk();
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
    }
    settle(&mut store, all_written);
    let disk = store.stats().disk.unwrap();
    assert_eq!(disk.demotions, 32);
    assert_eq!(disk.ready_blocks, 32);
    assert_eq!(disk.used_bytes, 32 * BLOCK);
    // Twice over, in an order that makes every block leave memory between its reads.
    for round in 0..2 {
        for n in 0..32 {
            assert_eq!(
                fetch(&mut store, n),
                Some(bytes(n)),
                "block {n}, round {round}"
            );
        }
    }
    let disk = store.stats().disk.unwrap();
    assert!(disk.promotions >= 48, "{disk:?}");
    assert_eq!(disk.corrupt, 0);
    assert_eq!(fetch(&mut store, 99), None, "a key nobody stored is a miss");
    // The change log never said a key went while disk held it.
    let (changes, _) = store.take_changes();
    assert!(
        !changes.iter().any(|c| matches!(c, KeyChange::Removed(_))),
        "{changes:?}"
    );
    assert_eq!(
        changes
            .iter()
            .filter(|c| matches!(c, KeyChange::Stored(_)))
            .count(),
        32
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_restarted_store_finds_what_its_disk_held_announces_it_and_serves_it_byte_exact() {
    let dir = tempdir("restart");
    {
        let mut store = store_on(&dir, 8, 16);
        for n in 0..12 {
            while store.put(&key(n), &bytes(n)).is_err() {
                store.poll_disk();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        settle(&mut store, all_written);
    }
    let mut store = store_on(&dir, 8, 16);
    let disk = store.stats().disk.unwrap();
    assert_eq!(disk.recovered_blocks, 12);
    assert!(store.holds_any(&key(3)) && store.holds_in(Tenant::DEFAULT, &key(11)));
    assert_eq!(store.stats().ready, 0, "memory is not filled at start");
    assert_eq!(
        store.take_changes().0,
        [],
        "the first take only starts the log"
    );
    let (changes, _) = store.take_changes();
    let mut announced: Vec<OffloadKey> = changes
        .into_iter()
        .filter_map(|c| match c {
            KeyChange::Stored(k) => Some(k),
            KeyChange::Removed(_) => None,
        })
        .collect();
    announced.sort();
    let mut want: Vec<OffloadKey> = (0..12).map(key).collect();
    want.sort();
    assert_eq!(announced, want, "every recovered block is announced once");
    for n in 0..12 {
        assert_eq!(fetch(&mut store, n), Some(bytes(n)), "block {n}");
    }
    // A smaller capacity keeps what fits, and the file follows.
    drop(store);
    let mut store = store_on(&dir, 8, 4);
    let found = store.stats().disk.unwrap().recovered_blocks;
    assert!(found <= 4, "{found}");
    for n in 0..12 {
        if let Some(b) = fetch(&mut store, n) {
            assert_eq!(b, bytes(n), "block {n}");
        }
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_torn_block_is_a_miss_never_wrong_bytes_and_its_slot_is_reused() {
    let dir = tempdir("torn");
    {
        let mut store = store_on(&dir, 4, 8);
        for n in 0..4 {
            store.put(&key(n), &bytes(n)).unwrap();
            settle(&mut store, all_written);
        }
    }
    // Slot by slot, as a crash mid-write leaves it: new header, old data (one byte flipped
    // in the block of whichever slot holds key 2), and a header torn in the middle.
    let file = dir.join(FILE_NAME);
    let mut raw = std::fs::read(&file).unwrap();
    let stride = (BLOCK + 4096) as usize;
    let slot_of = |raw: &[u8], n: u64| {
        (0..8).find(|s| {
            let h = &raw[4096 + s * stride..4096 + s * stride + 4096];
            h[28..28 + key(n).as_bytes().len()] == *key(n).as_bytes()
        })
    };
    let s2 = slot_of(&raw, 2).unwrap();
    raw[4096 + s2 * stride + 4096 + 100] ^= 0x01;
    let s3 = slot_of(&raw, 3).unwrap();
    raw[4096 + s3 * stride + 9] ^= 0x80;
    std::fs::write(&file, &raw).unwrap();

    let mut store = store_on(&dir, 4, 8);
    assert_eq!(
        store.stats().disk.unwrap().recovered_blocks,
        3,
        "the torn header is no block"
    );
    assert!(!store.holds_any(&key(3)));
    assert_eq!(
        fetch(&mut store, 2),
        None,
        "a block failing its checksum is a miss"
    );
    assert!(!store.holds_any(&key(2)), "and is held no more");
    let (changes, _) = store.take_changes();
    assert!(changes.contains(&KeyChange::Removed(key(2))), "{changes:?}");
    let disk = store.stats().disk.unwrap();
    assert_eq!(disk.corrupt, 1);
    // Its header is zeroed on disk: the next start does not find it again.
    drop(store);
    let mut store = store_on(&dir, 4, 8);
    assert_eq!(store.stats().disk.unwrap().recovered_blocks, 2);
    assert!(!store.holds_any(&key(2)));
    assert_eq!(fetch(&mut store, 0), Some(bytes(0)));
    assert_eq!(fetch(&mut store, 1), Some(bytes(1)));
    // The freed slots take new blocks.
    for n in 10..16 {
        while store.put(&key(n), &bytes(n)).is_err() {
            store.poll_disk();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    settle(&mut store, all_written);
    for n in 10..16 {
        assert_eq!(fetch(&mut store, n), Some(bytes(n)), "block {n}");
    }
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_of_another_block_size_or_not_a_tier_or_in_use_is_refused_and_left_alone() {
    let dir = tempdir("refusals");
    let store = store_on(&dir, 4, 8);
    let pool = Pool::anonymous(4, BLOCK, false).unwrap();
    let mut second = BlockStore::with_pool(pool).unwrap();
    let err = second
        .attach_disk(&config(&dir, 8), Arc::new(|| {}))
        .unwrap_err();
    assert!(matches!(err, DiskError::InUse(_)), "{err}");
    drop(store);

    let pool = Pool::anonymous(4, 2 * BLOCK, false).unwrap();
    let mut other = BlockStore::with_pool(pool).unwrap();
    let err = other
        .attach_disk(&config(&dir, 8), Arc::new(|| {}))
        .unwrap_err();
    assert!(
        matches!(err, DiskError::OtherBlockLen { found: BLOCK, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("remove the file"), "{err}");

    let strange = tempdir("not-a-tier");
    let file = strange.join(FILE_NAME);
    std::fs::write(&file, b"someone's notes").unwrap();
    let pool = Pool::anonymous(4, BLOCK, false).unwrap();
    let mut third = BlockStore::with_pool(pool).unwrap();
    let err = third
        .attach_disk(&config(&strange, 8), Arc::new(|| {}))
        .unwrap_err();
    assert!(matches!(err, DiskError::NotATier { .. }), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"someone's notes");
    let err = third
        .attach_disk(
            &DiskConfig {
                capacity: 4096,
                ..config(&dir, 1)
            },
            Arc::new(|| {}),
        )
        .unwrap_err();
    assert!(matches!(err, DiskError::TooSmall { .. }), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&strange);
}

#[test]
fn cold_promotion_keeps_the_hot_blocks_in_memory() {
    let dir = tempdir("cold");
    let pool = Pool::anonymous(4, BLOCK, false).unwrap();
    let mut store = BlockStore::with_pool(pool).unwrap();
    let cfg = DiskConfig {
        promote: Promote::Cold,
        ..config(&dir, 32)
    };
    store.attach_disk(&cfg, Arc::new(|| {})).unwrap();
    for n in 0..12 {
        while store.put(&key(n), &bytes(n)).is_err() {
            store.poll_disk();
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    settle(&mut store, all_written);
    // 0..3 read back (cold: first to go), then asked again in memory (hot), then a scan of
    // 4..11 read from disk once each.
    for n in 0..3 {
        for _ in 0..2 {
            assert_eq!(fetch(&mut store, n), Some(bytes(n)));
        }
    }
    let before = store.stats().disk.unwrap().promotions;
    for n in 4..12 {
        assert_eq!(fetch(&mut store, n), Some(bytes(n)));
    }
    let scanned = store.stats().disk.unwrap().promotions;
    assert_eq!(scanned - before, 8);
    for n in 0..3 {
        assert_eq!(fetch(&mut store, n), Some(bytes(n)));
    }
    assert_eq!(
        store.stats().disk.unwrap().promotions,
        scanned,
        "the scan did not push the hot blocks out of memory"
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

fn tempdir(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpeer-disk-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The scenarios above on each engine: io_uring where this kernel has it (else the fallback
/// `auto` picks), and the I/O threads, each in a child run of this test binary.
#[test]
fn both_engines_read_back_byte_exact_recover_and_catch_torn_blocks() {
    if std::env::var("KVPEER_TEST_DISK_IO").is_ok() {
        return; // a child run: the scenarios run as the plain tests of this binary
    }
    let uring_here = io_uring::IoUring::new(2).is_ok();
    for (engine, expect) in [
        (
            "auto",
            if uring_here {
                DiskEngine::Uring
            } else {
                DiskEngine::Threads
            },
        ),
        ("threads", DiskEngine::Threads),
    ] {
        let dir = tempdir(&format!("engine-{engine}"));
        let pool = Pool::anonymous(4, BLOCK, false).unwrap();
        let mut store = BlockStore::with_pool(pool).unwrap();
        store
            .attach_disk(
                &DiskConfig {
                    engine: engine.parse().unwrap(),
                    ..config(&dir, 8)
                },
                Arc::new(|| {}),
            )
            .unwrap();
        assert_eq!(store.stats().disk.unwrap().engine, expect);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .env("KVPEER_TEST_DISK_IO", engine)
            .args(["--test-threads", "2"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "the disk tests on engine {engine}:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("test result: ok. 12 passed"), "{stdout}");
    }
}

fn store_with(dir: &std::path::Path, memory: u64, disk: u64, promote: Promote) -> BlockStore {
    let pool = Pool::anonymous(memory, BLOCK, false).unwrap();
    let mut store = BlockStore::with_pool(pool).unwrap();
    store
        .attach_disk(
            &DiskConfig {
                promote,
                ..config(dir, disk)
            },
            Arc::new(|| {}),
        )
        .unwrap();
    store.record_changes(100_000);
    store
}

/// Stores `n` and waits until it is on disk.
fn put_settled(store: &mut BlockStore, n: u64) {
    while store.put(&key(n), &bytes(n)).is_err() {
        store.poll_disk();
        std::thread::sleep(Duration::from_millis(1));
    }
    settle(store, all_written);
}

/// The core looks up every key of a lookup, then pins the hits: a key only on disk later in
/// the same lookup takes a memory block (evicting the least recently used) and must not take
/// one just answered `Hit`, hot or cold.
#[test]
fn a_promotion_never_evicts_a_block_its_lookup_just_answered_hit() {
    for promote in [Promote::Cold, Promote::Hot] {
        let dir = tempdir(&format!("hit-evict-{promote:?}"));
        let mut store = store_with(&dir, 2, 8, promote);
        for n in 0..4 {
            put_settled(&mut store, n);
        }
        // Memory holds 2 and 3; disk all four. Key 0 read back (taking 2's or 3's block),
        // then a lookup of 0, of the other block still in memory, and of 1, only on disk.
        assert_eq!(store.lookup(&key(0)), LookupResult::Retry);
        settle(&mut store, |s| s.stats().writing == 0);
        let in_memory =
            if store.holds_in(Tenant::DEFAULT, &key(3)) && store.block_of(&key(3)).is_some() {
                3
            } else {
                2
            };
        assert_eq!(store.lookup(&key(0)), LookupResult::Hit);
        assert_eq!(store.lookup(&key(in_memory)), LookupResult::Hit);
        assert_eq!(store.lookup(&key(1)), LookupResult::Retry);
        let job = store.pin(&[key(0), key(in_memory)]);
        assert!(
            job.is_some(),
            "{promote:?}: a block answered Hit was evicted before its pin"
        );
        let job = job.unwrap();
        for (i, n) in [0u64, in_memory].iter().enumerate() {
            assert_eq!(store.read(job.blocks[i]).unwrap(), &bytes(*n)[..]);
        }
        store.unpin(job.job_id);
        drop(store);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// The change log follows what is held, memory or disk, through re-reservations and a disk
/// that drops a key while memory only writes it.
#[test]
fn the_change_log_never_says_removed_while_held_nor_stays_silent_when_gone() {
    let dir = tempdir("log-reserve");
    let mut store = store_with(&dir, 4, 8, Promote::Hot);
    put_settled(&mut store, 0);
    let _ = store.take_changes();
    // Fetched again while held (in memory and on disk): still held throughout.
    let b = store.reserve(&[key(0)]).unwrap();
    store.write_target(b[0]).unwrap().copy_from_slice(&bytes(0));
    store.finish_write(&b, true);
    settle(&mut store, all_written);
    let (changes, _) = store.take_changes();
    assert!(store.holds_in(Tenant::DEFAULT, &key(0)));
    assert!(
        !changes.contains(&KeyChange::Removed(key(0))),
        "{changes:?}"
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);

    let dir = tempdir("log-lost");
    let mut store = store_with(&dir, 2, 3, Promote::Hot);
    for n in 0..3 {
        put_settled(&mut store, n);
    }
    let _ = store.take_changes();
    // Key 0 only on disk; a fetch of it starts; the disk drops it for key 3; the fetch fails.
    let c = store.reserve(&[key(0)]).unwrap();
    put_settled(&mut store, 3);
    store.finish_write(&c, false);
    settle(&mut store, all_written);
    let (changes, _) = store.take_changes();
    assert!(!store.holds_any(&key(0)));
    assert!(changes.contains(&KeyChange::Removed(key(0))), "{changes:?}");
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A header with a valid CRC but an absurd generation (a file from elsewhere, or damaged
/// and re-summed) is no block: opening never overflows, and later writes still count up.
#[test]
fn an_absurd_generation_in_the_file_is_no_block() {
    use kvpeer_store::disk::format::{self, Layout, PAGE};
    use std::os::unix::fs::FileExt;
    let dir = tempdir("generation");
    {
        let mut store = store_with(&dir, 2, 4, Promote::Hot);
        put_settled(&mut store, 0);
        put_settled(&mut store, 1);
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(FILE_NAME))
        .unwrap();
    let layout = Layout::for_capacity(BLOCK, 4096 + 4 * (BLOCK + 4096)).unwrap();
    let mut page = vec![0u8; PAGE as usize];
    file.read_exact_at(&mut page, layout.slot_offset(0))
        .unwrap();
    let mut header = format::decode_slot_header(&page).unwrap();
    let victim = OffloadKey::from_bytes(&header.key);
    header.generation = u64::MAX;
    format::encode_slot_header(&header, &mut page).unwrap();
    file.write_all_at(&page, layout.slot_offset(0)).unwrap();
    let mut store = store_with(&dir, 2, 4, Promote::Hot);
    assert_eq!(store.stats().disk.unwrap().recovered_blocks, 1);
    assert!(!store.holds_any(&victim));
    put_settled(&mut store, 7);
    drop(store);
    let store = store_with(&dir, 2, 4, Promote::Hot);
    assert!(
        store.holds_any(&key(7)),
        "a block written after it is found again"
    );
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Blocks name their tenant by name on disk: a restart whose rules number the tenants
/// otherwise (a tenant added before them) finds each block its own tenant's, and drops those
/// of a tenant no rule names any more. Never another tenant's bytes.
#[test]
fn a_restart_with_other_tenant_rules_keeps_each_block_its_own_tenants() {
    let dir = tempdir("tenants");
    let open = |names: &[&str]| {
        let pool = Pool::anonymous(4, BLOCK, false).unwrap();
        let mut store = BlockStore::with_pool(pool).unwrap();
        store
            .attach_disk(
                &DiskConfig {
                    tenant_names: names.iter().map(|n| (*n).to_owned()).collect(),
                    ..config(&dir, 8)
                },
                Arc::new(|| {}),
            )
            .unwrap();
        store
    };
    let read_in = |store: &mut BlockStore, t: u16| -> Option<Vec<u8>> {
        let mut found = LookupResult::Retry;
        settle(store, |s| {
            found = s.lookup_in(Tenant(t), &key(1));
            found != LookupResult::Retry
        });
        (found == LookupResult::Hit).then(|| {
            let job = store.pin_in(Tenant(t), &[key(1)]).unwrap();
            let bytes = store.read(job.blocks[0]).unwrap().to_vec();
            store.unpin(job.job_id);
            bytes
        })
    };
    {
        let mut store = open(&["alpha", "beta"]);
        store.put_in(Tenant(1), &key(1), &bytes(100)).unwrap();
        store.put_in(Tenant(2), &key(1), &bytes(200)).unwrap();
        settle(&mut store, all_written);
    }
    {
        // "aardvark" comes first now: alpha is 2, beta 3.
        let mut store = open(&["aardvark", "alpha", "beta"]);
        assert_eq!(store.stats().disk.unwrap().recovered_blocks, 2);
        assert_eq!(read_in(&mut store, 1), None, "aardvark holds nothing");
        assert_eq!(
            read_in(&mut store, 2),
            Some(bytes(100)),
            "alpha's own bytes"
        );
        assert_eq!(read_in(&mut store, 3), Some(bytes(200)), "beta's own bytes");
    }
    let mut store = open(&["beta"]);
    assert_eq!(
        store.stats().disk.unwrap().recovered_blocks,
        1,
        "alpha's block is dropped"
    );
    assert_eq!(read_in(&mut store, 1), Some(bytes(200)));
    assert_eq!(read_in(&mut store, 0), None);
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A node with a tenant of its own keeps its blocks in its default index; on disk they are
/// named by that tenant, so the same directory under another tenant serves none of them,
/// and a pool node (no tenant of its own) serves them to their tenant only.
#[test]
fn a_nodes_own_tenant_names_its_blocks_on_disk() {
    let dir = tempdir("own-tenant");
    let open = |own: &str| {
        let pool = Pool::anonymous(4, BLOCK, false).unwrap();
        let mut store = BlockStore::with_pool(pool).unwrap();
        store
            .attach_disk(
                &DiskConfig {
                    default_tenant: own.to_owned(),
                    ..config(&dir, 8)
                },
                Arc::new(|| {}),
            )
            .unwrap();
        store
    };
    {
        let mut alpha = open("alpha");
        alpha.put(&key(1), &bytes(1)).unwrap();
        settle(&mut alpha, all_written);
    }
    let beta = open("beta");
    assert!(
        !beta.holds_in(Tenant::DEFAULT, &key(1)),
        "beta never gets alpha's block"
    );
    assert!(
        beta.holds_in(Tenant(1), &key(1)),
        "it stays alpha's (tenant 1 by the rules)"
    );
    drop(beta);
    let mut pool = open("");
    assert!(!pool.holds_in(Tenant::DEFAULT, &key(1)));
    let mut found = LookupResult::Retry;
    settle(&mut pool, |s| {
        found = s.lookup_in(Tenant(1), &key(1));
        found != LookupResult::Retry
    });
    assert_eq!(found, LookupResult::Hit);
    drop(pool);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A tier whose creation was cut short (its file sized, no header yet: what an older version
/// could leave) is taken as empty, not refused as someone else's file.
#[test]
fn a_file_of_zeros_by_the_tiers_name_is_an_empty_tier() {
    let dir = tempdir("zeros");
    std::fs::write(dir.join(FILE_NAME), vec![0u8; 3 * 4096 + 17]).unwrap();
    let mut store = store_on(&dir, 4, 8);
    assert_eq!(store.stats().disk.unwrap().recovered_blocks, 0);
    put_settled(&mut store, 3);
    drop(store);
    let store = store_on(&dir, 4, 8);
    assert!(store.holds_any(&key(3)));
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
}
