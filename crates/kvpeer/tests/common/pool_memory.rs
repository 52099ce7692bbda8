//! What memory a node's pool is in, as the kernel reports it (`/proc/self/smaps`): a shared
//! `/dev/shm` object for the planes a same-host peer maps (shm, both), private anonymous
//! memory in transparent huge pages for the others (tcp, nixl).

use kvpeer_store::{proc_maps as maps, Pool, HUGE_PAGE};

/// `pool` is a shared `/dev/shm` object (`shared`), or private anonymous memory starting on a
/// huge-page boundary, advised for huge pages (`hg`) and, when the kernel gives huge pages to
/// advised memory, in them. What the kernel is configured to do decides what is asserted;
/// nothing is skipped.
pub(crate) fn assert_pool_memory(pool: &Pool, shared: bool) {
    let usage = maps::usage_at(pool.base_addr()).expect("the pool is mapped");
    if shared {
        assert!(pool.shm().is_some(), "a shm object");
        assert!(
            usage.shared && usage.path.starts_with("/dev/shm/"),
            "a shared /dev/shm mapping: {usage:?}"
        );
        return;
    }
    assert!(pool.shm().is_none(), "no shm object: {usage:?}");
    assert!(
        usage.path.is_empty() && !usage.shared,
        "private anonymous memory: {usage:?}"
    );
    assert_eq!(pool.base_addr() % HUGE_PAGE as u64, 0, "2 MiB-aligned");
    let mode = maps::thp_mode();
    if let Err(why) = usage.check_huge_pages(mode.as_deref()) {
        panic!("THP {mode:?}: {why}: {usage:?}");
    }
}
