//! The nixl plane over pools in memory the node does not own (`Pool::external`): it only
//! registers the pool's addresses, so a WRITE from one external region into another lands
//! byte-exact and touches nothing else; a region whose row stride is not its block length is
//! refused, since peers address blocks as `base_addr + i × block_len`.
//!
//! Needs NIXL's wheel: `KVPEER_NIXL_LIB_DIR` names the directory of `libnixl_capi.so`
//! (`scripts/test.sh` installs it into `target/kvpeer-venv`).

#![cfg(feature = "nixl")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::ptr::NonNull;
use std::sync::Arc;
use std::time::Duration;

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory};
use kvpeer_net::data::nixl::{NixlConfig, NixlError, NixlPlane};
use kvpeer_proto::PeerId;
use kvpeer_store::Pool;

const BLOCKS: u64 = 8;
const LEN: u64 = 4096;

fn lib_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("KVPEER_NIXL_LIB_DIR") {
        return dir.into();
    }
    let lib = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/kvpeer-venv/lib");
    std::fs::read_dir(&lib)
        .ok()
        .and_then(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.path().join("site-packages/.nixl_cu12.mesonpy.libs"))
                .find(|p| p.join("libnixl_capi.so").exists())
        })
        .expect(
            "needs NIXL's wheel: run scripts/test.sh (it installs it) or set KVPEER_NIXL_LIB_DIR",
        )
}

/// An external region of [`BLOCKS`] blocks, block `i` filled with `fill(i)`, owned by the pool.
fn region(fill: impl Fn(u64) -> u8) -> (Pool, NonNull<u8>) {
    let mut mem = vec![0u8; (BLOCKS * LEN) as usize];
    for i in 0..BLOCKS {
        let at = (i * LEN) as usize;
        mem[at..at + LEN as usize].fill(fill(i));
    }
    let base = NonNull::new(mem.as_mut_ptr()).unwrap();
    // SAFETY: the pool owns the buffer (keep-alive); the test reads it only through `raw`,
    // while no WRITE is in flight.
    let pool = unsafe { Pool::external(base, BLOCKS, LEN, LEN, Some(Box::new(mem))) }.unwrap();
    (pool, base)
}

fn raw(pool: &Pool, base: NonNull<u8>) -> Vec<u8> {
    // SAFETY: `pool` keeps the region alive, and no WRITE is in flight.
    unsafe { std::slice::from_raw_parts(base.as_ptr(), pool.span_len() as usize) }.to_vec()
}

fn plane(tag: &str, pool: &Pool) -> NixlPlane {
    let config = NixlConfig {
        agent_name: format!("kvpeer-ext-{tag}-{}", std::process::id()),
        lib_dir: Some(lib_dir()),
        ..Default::default()
    };
    NixlPlane::new(&config, pool.view().clone(), Arc::new(|| {})).unwrap()
}

fn wait<T>(mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..2000 {
        if let Some(t) = f() {
            return t;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out");
}

/// Waits (bounded) for `peer`'s registration at `plane` to settle.
fn settled(plane: &mut NixlPlane, peer: &PeerId) -> Registration {
    wait(|| match plane.registration(peer) {
        Registration::Pending => None,
        other => Some(other),
    })
}

/// Waits (bounded) for `plane` to report something of `peer`'s transfers.
fn outcome(plane: &mut NixlPlane, peer: &PeerId) -> kvpeer_core::PlanePoll {
    wait(|| {
        let poll = plane.poll(peer);
        (!poll.done.is_empty() || !poll.failed.is_empty() || poll.peer_fault.is_some())
            .then_some(poll)
    })
}

#[test]
fn a_nixl_write_between_external_regions_is_byte_exact() {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let (a_pool, a_base) = region(|i| i as u8 + 1);
    let (b_pool, b_base) = region(|_| 0);
    let mut a = plane("a", &a_pool);
    let mut b = plane("b", &b_pool);
    assert_eq!(b.base_addr(), b_pool.base_addr(), "the pool's own address");
    let a_before = raw(&a_pool, a_base);
    let b_before = raw(&b_pool, b_base);

    let pb = PeerId::new("127.0.0.1:7102");
    let memory = RemoteMemory {
        agent_metadata: b.metadata().to_vec(),
        base_addr: b.base_addr(),
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    a.add_remote_peer(&pb, &memory).unwrap();
    let state = settled(&mut a, &pb);
    assert_eq!(state, Registration::Done);

    let (local, remote) = ([0u64, 2, 7], [5u64, 1, 7]);
    let (local, remote) = (local.map(BlockIndex::new), remote.map(BlockIndex::new));
    // b expects a's WRITE (as a node does from its fetch on): its watcher progresses UCX.
    let pa = PeerId::new("127.0.0.1:7101");
    b.expect_writes(&pa, &remote);
    let tid = a.write_blocks(&pb, &local, &remote).unwrap();
    let poll = outcome(&mut a, &pb);
    assert_eq!(
        (poll.done, poll.failed, poll.peer_fault),
        (vec![tid], vec![], None)
    );
    let mut want = b_before;
    for (l, r) in local.iter().zip(remote) {
        let at = (r.get() * LEN) as usize;
        want[at..at + LEN as usize].fill(l.get() as u8 + 1);
    }
    assert!(
        raw(&b_pool, b_base) == want,
        "only the written blocks changed"
    );
    assert!(raw(&a_pool, a_base) == a_before, "the source is only read");
    b.end_writes(&pa, &remote);
    a.remove_remote_peer(&pb);
}

#[test]
fn a_region_whose_stride_is_not_its_block_length_is_refused() {
    let mut mem = vec![0u8; (3 * (LEN + 64) + LEN) as usize];
    let base = NonNull::new(mem.as_mut_ptr()).unwrap();
    // SAFETY: the pool owns the buffer; the plane refuses it before touching anything.
    let pool = unsafe { Pool::external(base, 4, LEN, LEN + 64, Some(Box::new(mem))) }.unwrap();
    let refused = NixlPlane::new(&NixlConfig::default(), pool.view().clone(), Arc::new(|| {}));
    assert!(
        matches!(
            refused,
            Err(NixlError::Stride {
                block_len: LEN,
                stride
            }) if stride == LEN + 64
        ),
        "{refused:?}"
    );
}

/// A peer's region comes from its `connect`: one whose addresses overflow (a base near the top
/// of the address space) is refused as `NixlRefusal::Region` at once, before NIXL loads its
/// metadata, and the plane still registers an honest peer and writes to it byte-exact.
#[test]
fn a_peer_region_that_overflows_the_address_space_is_refused() {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let (a_pool, _) = region(|i| i as u8 + 1);
    let (b_pool, b_base) = region(|_| 0);
    let mut a = plane("ovf-a", &a_pool);
    let b = plane("ovf-b", &b_pool);
    let liar = PeerId::new("127.0.0.1:7103");
    let memory = RemoteMemory {
        agent_metadata: b.metadata().to_vec(),
        base_addr: u64::MAX - LEN,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    // Refused at once, before NIXL loads the peer's metadata (nothing of it stays loaded).
    let e = a.add_remote_peer(&liar, &memory).unwrap_err();
    assert!(
        matches!(
            e.downcast_ref::<kvpeer_net::data::nixl::NixlRefusal>(),
            Some(kvpeer_net::data::nixl::NixlRefusal::Region { base, .. }) if *base == u64::MAX - LEN
        ),
        "{e:?}"
    );
    let b_name = format!("kvpeer-ext-ovf-b-{}", std::process::id());
    assert!(
        !a.holds_remote_agent(&b_name),
        "the liar's agent was loaded"
    );
    // The same agent, honestly described, registers and is written byte-exact.
    let honest = PeerId::new("127.0.0.1:7104");
    let memory = RemoteMemory {
        base_addr: b.base_addr(),
        ..memory
    };
    a.add_remote_peer(&honest, &memory).unwrap();
    let state = settled(&mut a, &honest);
    assert_eq!(state, Registration::Done);
    let mut b = b;
    let pa = PeerId::new("127.0.0.1:7101");
    let (local, remote) = ([BlockIndex::new(3)], [BlockIndex::new(6)]);
    b.expect_writes(&pa, &remote);
    let tid = a.write_blocks(&honest, &local, &remote).unwrap();
    let poll = outcome(&mut a, &honest);
    assert_eq!((poll.done, poll.peer_fault.is_none()), (vec![tid], true));
    let bytes = raw(&b_pool, b_base);
    let at = (6 * LEN) as usize;
    assert!(bytes[at..at + LEN as usize].iter().all(|x| *x == 4));
    assert!(bytes[..at]
        .iter()
        .chain(&bytes[at + LEN as usize..])
        .all(|x| *x == 0));
    b.end_writes(&pa, &remote);
    a.remove_remote_peer(&honest);
}

/// A registration that is dropped while NIXL prepares the peer's descriptors (the session
/// ended, or the peer connected again) leaves nothing of the peer loaded in NIXL, whether it
/// was cancelled mid-way or had just finished; the agent still registers an honest peer
/// afterwards and writes to it byte-exact.
#[test]
fn a_dropped_registration_unloads_the_peers_agent() {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    let (a_pool, _) = region(|i| i as u8 + 1);
    let (b_pool, b_base) = region(|_| 0);
    let mut a = plane("drop-a", &a_pool);
    let mut b = plane("drop-b", &b_pool);
    let b_name = format!("kvpeer-ext-drop-b-{}", std::process::id());
    let gone = PeerId::new("127.0.0.1:7105");
    // 4 Mi blocks: a descriptor each, long to prepare.
    let memory = RemoteMemory {
        agent_metadata: b.metadata().to_vec(),
        base_addr: b.base_addr(),
        num_blocks: 1 << 22,
        block_len: LEN,
    };
    a.add_remote_peer(&gone, &memory).unwrap();
    wait(|| a.holds_remote_agent(&b_name).then_some(()));
    a.remove_remote_peer(&gone);
    wait(|| {
        // Each call lets the plane unload what the registration left behind.
        let _ = a.registration(&gone);
        (!a.holds_remote_agent(&b_name)).then_some(())
    });

    let honest = PeerId::new("127.0.0.1:7106");
    let memory = RemoteMemory {
        num_blocks: BLOCKS,
        ..memory
    };
    a.add_remote_peer(&honest, &memory).unwrap();
    let state = settled(&mut a, &honest);
    assert_eq!(state, Registration::Done);
    assert!(a.holds_remote_agent(&b_name));
    let pa = PeerId::new("127.0.0.1:7101");
    let (local, remote) = ([BlockIndex::new(2)], [BlockIndex::new(5)]);
    b.expect_writes(&pa, &remote);
    let tid = a.write_blocks(&honest, &local, &remote).unwrap();
    let poll = outcome(&mut a, &honest);
    assert_eq!((poll.done, poll.peer_fault.is_none()), (vec![tid], true));
    let bytes = raw(&b_pool, b_base);
    let at = (5 * LEN) as usize;
    assert!(bytes[at..at + LEN as usize].iter().all(|x| *x == 3));
    b.end_writes(&pa, &remote);
    a.remove_remote_peer(&honest);
}
