//! The SIGBUS guard of peers' mappings (`guard.rs`, `Pool::map_peer`): a peer that shrinks its
//! object under our mapping makes our stores land in private memory and the pool say
//! `peer_faulted`, instead of killing this process; mapping a sparse object allocates nothing.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, MetadataExt};

use kvpeer_core::BlockIndex;
use kvpeer_store::Pool;

const LEN: u64 = 64 * 1024;

/// A fresh object in /dev/shm (tmpfs, as a peer's pool), removed on drop.
struct Object {
    path: String,
    file: File,
}

impl Object {
    fn new(tag: &str, bytes: u64) -> Object {
        let path = format!("/dev/shm/kvpeer-guard-{tag}-{}", std::process::id());
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(&path)
            .unwrap();
        file.set_len(bytes).unwrap();
        Object { path, file }
    }
}

impl Drop for Object {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

#[test]
fn a_store_past_a_shrunk_peer_object_is_caught_not_fatal() {
    let blocks = 32;
    let obj = Object::new("shrink", blocks * LEN + 4096);
    let mut pool = Pool::map_peer(&obj.file, blocks, LEN).unwrap();
    pool.block_mut(BlockIndex::new(1)).unwrap().fill(0x11);
    assert!(!pool.peer_faulted());
    let mut got = vec![0u8; LEN as usize];
    obj.file.read_exact_at(&mut got, LEN).unwrap();
    assert!(
        got.iter().all(|b| *b == 0x11),
        "a store lands in the object"
    );

    // The peer cuts its object to two blocks under our mapping.
    obj.file.set_len(2 * LEN).unwrap();
    pool.block_mut(BlockIndex::new(20)).unwrap().fill(0x22); // would be SIGBUS
    assert!(pool.peer_faulted(), "the fault is reported");
    // Every later store lands in private memory too; the object is not grown by us.
    pool.block_mut(BlockIndex::new(31)).unwrap().fill(0x33);
    assert_eq!(obj.file.metadata().unwrap().len(), 2 * LEN);
    obj.file.read_exact_at(&mut got, LEN).unwrap();
    assert!(got.iter().all(|b| *b == 0x11), "what landed before stays");
    drop(pool);

    // Another peer's mapping is not affected by the first one's fault.
    let other = Object::new("other", blocks * LEN + 4096);
    let mut pool = Pool::map_peer(&other.file, blocks, LEN).unwrap();
    pool.block_mut(BlockIndex::new(3)).unwrap().fill(0x44);
    assert!(!pool.peer_faulted());
    other.file.read_exact_at(&mut got, 3 * LEN).unwrap();
    assert!(got.iter().all(|b| *b == 0x44));
}

#[test]
fn mapping_a_sparse_peer_object_allocates_none_of_it() {
    let blocks = 16 * 1024; // 1 GiB of 64 KiB blocks, sparse
    let obj = Object::new("sparse", blocks * LEN + 4096);
    let mut pool = Pool::map_peer(&obj.file, blocks, LEN).unwrap();
    assert_eq!(
        obj.file.metadata().unwrap().blocks(),
        0,
        "nothing allocated"
    );
    pool.block_mut(BlockIndex::new(7)).unwrap().fill(1);
    let allocated = obj.file.metadata().unwrap().blocks() * 512;
    assert!(
        allocated <= 2 * LEN,
        "only the block written is allocated: {allocated}"
    );
}

#[test]
fn many_peer_mappings_come_and_go_without_running_out_of_guards() {
    let obj = Object::new("churn", 4 * LEN + 4096);
    for _ in 0..(2 * kvpeer_store::guard::MAX_GUARDED) {
        let mut pool = Pool::map_peer(&obj.file, 4, LEN).unwrap();
        pool.block_mut(BlockIndex::new(0)).unwrap()[0] = 9;
        assert!(!pool.peer_faulted());
    }
}

#[test]
fn a_fault_in_a_huge_sparse_mapping_costs_a_bounded_window_not_the_mapping() {
    // 8 GiB of 64 KiB blocks, sparse (costs nothing), then cut to one block: a store near its
    // end is caught with a bounded private window, whatever the machine's memory.
    let blocks = 128 * 1024;
    let obj = Object::new("huge", blocks * LEN + 4096);
    let mut pool = Pool::map_peer(&obj.file, blocks, LEN).unwrap();
    obj.file.set_len(LEN).unwrap();
    pool.block_mut(BlockIndex::new(blocks - 1))
        .unwrap()
        .fill(0x55);
    assert!(pool.peer_faulted());
    pool.block_mut(BlockIndex::new(blocks / 2))
        .unwrap()
        .fill(0x66);
    assert_eq!(obj.file.metadata().unwrap().len(), LEN);
}
