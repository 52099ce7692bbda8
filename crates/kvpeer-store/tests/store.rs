//! The block store's contract: states, pins, eviction order, the `Parent` view, and the
//! shared-memory object another process can open by name.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvpeer_core::{BlockIndex, LookupResult, Parent, ServeCtx};
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};
use kvpeer_store::{BlockStore, StoreConfig, StoreError, Tenant};

const LEN: u64 = 4096;

fn store(tag: &str, blocks: u64) -> BlockStore {
    BlockStore::new(&StoreConfig {
        shm_name: format!("kvpeer-st-{tag}-{}", std::process::id()),
        num_blocks: blocks,
        block_len: LEN,
        lock_memory: false,
    })
    .unwrap()
}

fn key(n: u64) -> OffloadKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&n.to_be_bytes());
    OffloadKey::from_parts(&h, 0)
}

fn bytes(n: u8) -> Vec<u8> {
    vec![n; LEN as usize]
}

#[test]
fn put_then_lookup_and_read() {
    let mut s = store("put", 4);
    let b = s.put(&key(1), &bytes(7)).unwrap();
    assert_eq!(s.lookup(&key(1)), LookupResult::Hit);
    assert_eq!(s.lookup(&key(2)), LookupResult::Miss);
    assert_eq!(s.read(b).unwrap(), &bytes(7)[..]);
    assert_eq!(
        s.put(&key(1), &bytes(9)).unwrap(),
        b,
        "a held key keeps its block"
    );
    assert!(matches!(
        s.put(&key(3), &[1, 2]),
        Err(StoreError::WrongSize { .. })
    ));
    assert_eq!((s.stats().ready, s.stats().free), (1, 3));
}

#[test]
fn a_block_being_written_is_pending_then_ready_or_forgotten() {
    let mut s = store("write", 4);
    let blocks = s.reserve(&[key(1), key(2)]).unwrap();
    assert_eq!(s.lookup(&key(1)), LookupResult::HitPending);
    assert!(
        s.read(blocks[0]).is_err(),
        "not readable while being written"
    );
    s.write_target(blocks[0]).unwrap().fill(5);
    s.finish_write(&blocks[..1], true);
    s.finish_write(&blocks[1..], false);
    assert_eq!(s.lookup(&key(1)), LookupResult::Hit);
    assert_eq!(s.read(blocks[0]).unwrap()[0], 5);
    assert_eq!(
        s.lookup(&key(2)),
        LookupResult::Miss,
        "a failed write frees its block"
    );
    assert_eq!(
        (s.stats().ready, s.stats().writing, s.stats().free),
        (1, 0, 3)
    );
}

#[test]
fn eviction_takes_the_least_recently_used_unpinned_block() {
    let mut s = store("lru", 3);
    for n in 1..=3 {
        s.put(&key(n), &bytes(n as u8)).unwrap();
    }
    assert_eq!(
        s.lookup(&key(1)),
        LookupResult::Hit,
        "1 becomes the most recent"
    );
    let job = s.pin(&[key(2)]).unwrap();
    s.put(&key(4), &bytes(4)).unwrap();
    assert_eq!(
        s.lookup(&key(3)),
        LookupResult::Miss,
        "3 was the oldest unpinned"
    );
    assert_eq!(s.lookup(&key(2)), LookupResult::Hit, "2 is pinned");
    s.put(&key(5), &bytes(5)).unwrap();
    assert_eq!(s.lookup(&key(1)), LookupResult::Miss);
    let three = [key(6), key(7), key(8)];
    assert!(
        matches!(
            s.reserve(&three),
            Err(StoreError::Full {
                wanted: 3,
                available: 2
            })
        ),
        "2 is pinned"
    );
    assert_eq!(s.stats().writing, 0, "a failed reserve takes nothing");
    assert_eq!(s.lookup(&key(4)), LookupResult::Hit, "and evicts nothing");
    s.unpin(job.job_id);
    assert_eq!(s.stats().pinned, 0);
    s.reserve(&three).unwrap();
}

#[test]
fn pins_stack_and_only_readable_keys_pin() {
    let mut s = store("pins", 2);
    s.put(&key(1), &bytes(1)).unwrap();
    let a = s.pin(&[key(1)]).unwrap();
    let b = s.pin(&[key(1)]).unwrap();
    assert_eq!(s.stats().pinned, 1);
    s.unpin(a.job_id);
    assert_eq!(s.stats().pinned, 1, "still held by the second job");
    s.unpin(b.job_id);
    s.unpin(b.job_id);
    assert_eq!((s.stats().pinned, s.stats().jobs), (0, 0));
    s.reserve(&[key(2)]).unwrap();
    assert!(
        s.pin(&[key(1), key(2)]).is_none(),
        "a key being written cannot be pinned"
    );
    assert_eq!(s.stats().pinned, 0, "and nothing was pinned");
}

#[test]
fn the_store_is_the_producers_parent() {
    let mut s = store("parent", 2);
    let ctx = ServeCtx {
        peer: PeerId::new("10.0.0.2:5710"),
        kv_request_id: KvRequestId::from("r"),
        lookup: 1,
    };
    s.put(&key(1), &bytes(1)).unwrap();
    s.on_new_request(&ctx);
    assert_eq!(Parent::lookup(&mut s, &key(1), &ctx), LookupResult::Hit);
    let job = s.create_store_job(&[key(1)], &ctx).unwrap();
    assert_eq!(job.blocks, vec![s.block_of(&key(1)).unwrap()]);
    s.on_request_finished(&ctx);
    assert_eq!(s.stats().open_contexts, 0);
    s.complete_store_job(job.job_id, false);
    assert_eq!(s.stats().pinned, 0, "a failed job unpins too");
}

#[test]
fn python_opens_the_same_shared_memory_by_name() {
    let mut s = store("py", 2);
    assert_eq!(
        s.put(&key(1), &bytes(0xab)).unwrap(),
        BlockIndex::new(0),
        "free blocks are taken lowest first"
    );
    let name = s.pool().shm_name().unwrap().to_owned();
    // Python reads block 0 and writes into block 1, at `block × block_len`.
    let script = format!(
        "from multiprocessing import shared_memory as s\n\
         m = s.SharedMemory(name='{name}')\n\
         print(bytes(m.buf[0:4]).hex())\n\
         m.buf[{LEN}] = 0x5a\n\
         m.close()\n"
    );
    let out = std::process::Command::new("python3")
        .arg("-c")
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "abababab");
    assert_eq!(s.reserve(&[key(2)]).unwrap(), vec![BlockIndex::new(1)]);
    assert_eq!(
        s.write_target(BlockIndex::new(1)).unwrap()[0],
        0x5a,
        "Python's write landed in block 1"
    );
}

#[test]
fn bookkeeping_per_block_stays_small() {
    let bytes = BlockStore::overhead_per_block();
    println!("bookkeeping per block: {bytes} bytes");
    // docs/data-planes.md promises at most 256 bytes: 0.4% of a 64 KiB block, 0.01% of 2 MiB.
    assert!(bytes <= 256, "{bytes} bytes per block");
}

#[test]
fn a_store_over_external_memory_writes_only_its_blocks() {
    use kvpeer_store::Pool;
    use std::ptr::NonNull;
    // Three blocks of LEN bytes, a row stride of LEN + 512: the gaps must stay 0xEE.
    let stride = LEN + 512;
    let total = (2 * stride + LEN) as usize;
    let mut mem = vec![0xEEu8; total];
    let base = NonNull::new(mem.as_mut_ptr()).unwrap();
    // SAFETY: the pool owns the buffer (keep-alive); it is read below only through raw reads
    // while nothing writes.
    let pool = unsafe { Pool::external(base, 3, LEN, stride, Some(Box::new(mem))) }.unwrap();
    let mut s = BlockStore::with_pool(pool).unwrap();
    assert!(s.pool().shm().is_none());
    let b = s.put(&key(1), &bytes(0x11)).unwrap();
    let c = s.put(&key(2), &bytes(0x22)).unwrap();
    assert_eq!(s.read(b).unwrap(), &bytes(0x11)[..]);
    assert_eq!(s.read(c).unwrap(), &bytes(0x22)[..]);
    // SAFETY: as above; the store is idle.
    let raw = unsafe { std::slice::from_raw_parts(base.as_ptr(), total) }.to_vec();
    for (i, byte) in raw.iter().enumerate() {
        let (row, col) = (i as u64 / stride, i as u64 % stride);
        let want = match (row, col < LEN) {
            (0, true) => 0x11,
            (1, true) => 0x22,
            _ => 0xEE,
        };
        assert_eq!(*byte, want, "byte {i}");
    }
    assert_eq!(s.stats().capacity, 3);
}

#[test]
fn the_node_cannot_write_a_block_a_peer_may_write() {
    let mut s = store("granted", 2);
    let blocks = s.reserve(&[key(1)]).unwrap();
    let peer = PeerId::new("10.0.0.2:5710");
    let writer = s.pool().writer();
    writer.grant(&peer, &blocks);
    assert!(matches!(
        s.write_target(blocks[0]),
        Err(StoreError::BadBlock { .. })
    ));
    let claim = writer.claim(&peer, &blocks).unwrap();
    assert!(
        s.write_target(blocks[0]).is_err(),
        "being written by the peer"
    );
    drop(claim);
    assert!(s.write_target(blocks[0]).is_ok(), "the peer's write ended");
}

/// The change log a pool node publishes: a key is announced when its block becomes readable
/// and withdrawn when it is evicted or fetched again; a write that failed was never announced;
/// the log is bounded, the oldest dropped and counted; off, it records nothing.
#[test]
fn the_change_log_follows_what_is_readable() {
    use kvpeer_store::KeyChange::{Removed, Stored};
    let mut s = store("changes", 2);
    s.put(&key(0), &bytes(0)).unwrap();
    assert_eq!(s.take_changes(), (vec![], 0), "off until asked for");
    s.record_changes(100);
    s.put(&key(1), &bytes(1)).unwrap();
    // A third key evicts the least recently used (key 0).
    s.put(&key(2), &bytes(2)).unwrap();
    // A failed write is never announced (it evicts key 1 first, which is).
    let b = s.reserve(&[key(3)]).unwrap();
    s.finish_write(&b, false);
    // Key 2 fetched again: withdrawn, then announced once the write lands.
    let b = s.reserve(&[key(2)]).unwrap();
    s.finish_write(&b, true);
    assert_eq!(
        s.take_changes(),
        (
            vec![
                Stored(key(1)),
                Removed(key(0)),
                Stored(key(2)),
                Removed(key(1)),
                Removed(key(2)),
                Stored(key(2)),
            ],
            0
        )
    );
    s.record_changes(2);
    for n in 10..15 {
        s.put(&key(n), &bytes(n as u8)).unwrap();
    }
    let (changes, dropped) = s.take_changes();
    assert_eq!(changes, vec![Removed(key(12)), Stored(key(14))]);
    // 10 took the block the failed write freed; 11..=14 each evicted one: 9 changes.
    assert_eq!(dropped, 7);
}

/// Tenants by the peer's host: `10.0.1.*` is tenant 1, `10.0.2.*` tenant 2, the rest default.
#[derive(Debug)]
struct ByHost;

impl kvpeer_store::TenantOf for ByHost {
    fn tenant_of(&self, peer: &PeerId) -> Tenant {
        let id = peer.to_string();
        if id.starts_with("10.0.1.") {
            Tenant(1)
        } else if id.starts_with("10.0.2.") {
            Tenant(2)
        } else {
            Tenant::DEFAULT
        }
    }
}

fn ctx_of(peer: &str) -> ServeCtx {
    ServeCtx {
        peer: PeerId::new(peer),
        kv_request_id: KvRequestId::from("r"),
        lookup: 1,
    }
}

#[test]
fn a_tenants_block_is_a_plain_miss_to_every_other_tenant() {
    let mut s = store("tenants", 8);
    let a = s.put_in(Tenant(1), &key(1), &bytes(0xa1)).unwrap();
    // The same key, another tenant: its own block, its own bytes.
    let b = s.put_in(Tenant(2), &key(1), &bytes(0xb2)).unwrap();
    assert_ne!(a, b);
    assert_eq!(s.lookup_in(Tenant(1), &key(1)), LookupResult::Hit);
    assert_eq!(s.lookup_in(Tenant(3), &key(1)), LookupResult::Miss);
    assert_eq!(s.lookup(&key(1)), LookupResult::Miss, "the default tenant");
    assert_eq!(s.lookup_in(Tenant::NOBODY, &key(1)), LookupResult::Miss);
    assert_eq!(
        s.read(s.block_of_in(Tenant(1), &key(1)).unwrap()).unwrap(),
        &bytes(0xa1)[..]
    );
    assert_eq!(
        s.read(s.block_of_in(Tenant(2), &key(1)).unwrap()).unwrap(),
        &bytes(0xb2)[..]
    );
    assert!(s.pin_in(Tenant(3), &[key(1)]).is_none());
    assert!(matches!(
        s.reserve_in(Tenant::NOBODY, &[key(5)]),
        Err(StoreError::NoTenant)
    ));
    // A tenant's fetch of the key moves only its own entry.
    let again = s.reserve_in(Tenant(2), &[key(1)]).unwrap();
    assert_eq!(s.lookup_in(Tenant(2), &key(1)), LookupResult::HitPending);
    assert_eq!(s.lookup_in(Tenant(1), &key(1)), LookupResult::Hit);
    s.finish_write(&again, false);
    assert_eq!(s.lookup_in(Tenant(2), &key(1)), LookupResult::Miss);
    assert_eq!(s.block_of_in(Tenant(1), &key(1)), Some(a));
}

#[test]
fn evicting_one_tenants_block_leaves_the_others_key() {
    let mut s = store("tenant-evict", 2);
    s.put_in(Tenant(1), &key(1), &bytes(1)).unwrap();
    s.put_in(Tenant(2), &key(1), &bytes(2)).unwrap();
    // A third block evicts the least recently used: tenant 1's.
    s.put_in(Tenant(2), &key(2), &bytes(3)).unwrap();
    assert_eq!(s.lookup_in(Tenant(1), &key(1)), LookupResult::Miss);
    let b = s.block_of_in(Tenant(2), &key(1)).unwrap();
    assert_eq!(s.read(b).unwrap(), &bytes(2)[..]);
}

#[test]
fn peers_look_up_and_pin_only_their_tenants_blocks() {
    let mut s = store("tenant-peers", 8);
    s.put_in(Tenant(1), &key(1), &bytes(1)).unwrap();
    s.put_in(Tenant(2), &key(2), &bytes(2)).unwrap();
    s.put(&key(3), &bytes(3)).unwrap();
    s.scope_peers(Box::new(ByHost));
    let (one, two, other) = (
        ctx_of("10.0.1.5:5600"),
        ctx_of("10.0.2.5:5600"),
        ctx_of("10.0.9.5:5600"),
    );
    let seen = |s: &mut BlockStore, ctx: &ServeCtx| {
        (1..=3)
            .map(|n| Parent::lookup(s, &key(n), ctx) == LookupResult::Hit)
            .collect::<Vec<_>>()
    };
    assert_eq!(seen(&mut s, &one), [true, false, false]);
    assert_eq!(seen(&mut s, &two), [false, true, false]);
    assert_eq!(seen(&mut s, &other), [false, false, true]);
    assert!(s.create_store_job(&[key(2)], &one).is_none());
    let job = s.create_store_job(&[key(1)], &one).unwrap();
    assert_eq!(s.read(job.blocks[0]).unwrap(), &bytes(1)[..]);
    s.complete_store_job(job.job_id, true);
}

#[test]
fn the_change_log_says_a_key_is_held_while_any_tenant_holds_it() {
    use kvpeer_store::KeyChange;
    let mut s = store("tenant-log", 3);
    s.record_changes(64);
    s.put_in(Tenant(1), &key(1), &bytes(1)).unwrap();
    s.put_in(Tenant(2), &key(1), &bytes(2)).unwrap();
    assert_eq!(s.take_changes(), (vec![KeyChange::Stored(key(1))], 0));
    // Tenant 1's block is evicted (the least recently used): tenant 2 still holds the key.
    s.put(&key(2), &bytes(3)).unwrap();
    s.put(&key(3), &bytes(4)).unwrap();
    assert_eq!(s.lookup_in(Tenant(1), &key(1)), LookupResult::Miss);
    assert_eq!(
        s.take_changes(),
        (
            vec![KeyChange::Stored(key(2)), KeyChange::Stored(key(3))],
            0
        )
    );
    // Then tenant 2's goes too: now the key is gone.
    s.put(&key(4), &bytes(5)).unwrap();
    assert_eq!(s.lookup_in(Tenant(2), &key(1)), LookupResult::Miss);
    assert_eq!(
        s.take_changes(),
        (
            vec![KeyChange::Removed(key(1)), KeyChange::Stored(key(4))],
            0
        )
    );
}

#[test]
fn a_tenants_index_gives_back_its_room_once_its_blocks_went_to_another() {
    let mut s = store("tenant-shrink", 8192);
    for n in 0..8192 {
        s.put_in(Tenant(1), &key(n), &bytes(1)).unwrap();
    }
    let full = s.index_capacity(Tenant(1));
    // Tenant 2 takes the whole pool: tenant 1's blocks are evicted one by one.
    for n in 0..8192 {
        s.put_in(Tenant(2), &key(100_000 + n), &bytes(2)).unwrap();
    }
    assert_eq!(s.lookup_in(Tenant(1), &key(0)), LookupResult::Miss);
    assert!(
        s.index_capacity(Tenant(1)) * 8 <= full,
        "{} of {full}",
        s.index_capacity(Tenant(1))
    );
}
