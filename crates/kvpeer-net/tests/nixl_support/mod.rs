//! Shared by `nixl_progress.rs` and `nixl_progress_over_tcp.rs` (one test per binary: it
//! counts the process's threads, and UCX reads `UCX_TLS` once per process).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory};
use kvpeer_net::data::nixl::{agent_config, NixlConfig, NixlPlane};
use kvpeer_proto::PeerId;
use kvpeer_store::Pool;

const BLOCKS: u64 = 16;
const LEN: u64 = 64 * 1024;
/// The name of the thread that makes the agents: a thread NIXL starts from it inherits it.
const MAKER: &str = "nixl-maker";

fn lib_dir() -> PathBuf {
    std::env::var_os("KVPEER_NIXL_LIB_DIR")
        .map(PathBuf::from)
        .or_else(|| {
            let lib =
                PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/kvpeer-venv/lib");
            std::fs::read_dir(&lib)
                .ok()?
                .filter_map(Result::ok)
                .find_map(|e| {
                    let p = e.path().join("site-packages/.nixl_cu12.mesonpy.libs");
                    p.join("libnixl_capi.so").exists().then_some(p)
                })
        })
        .expect(
            "needs NIXL's wheel: run scripts/test.sh (it installs it) or set KVPEER_NIXL_LIB_DIR",
        )
}

/// `(tid, name)` of every thread of this process.
fn threads() -> HashSet<(String, String)> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(Result::ok)
        .map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).unwrap_or_default();
            (
                t.file_name().to_string_lossy().into_owned(),
                comm.trim().to_owned(),
            )
        })
        .collect()
}

fn wait<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..2000 {
        if let Some(t) = f() {
            return t;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    panic!("timed out waiting for {what}");
}

struct Side {
    plane: NixlPlane,
    pool: Pool,
    id: PeerId,
}

fn side(tag: &str, port: u16) -> Side {
    let mut pool = Pool::anonymous(BLOCKS, LEN, false).unwrap();
    for i in 0..BLOCKS {
        pool.block_mut(BlockIndex::new(i))
            .unwrap()
            .fill(port as u8 ^ i as u8);
    }
    let config = NixlConfig {
        agent_name: format!("kvpeer-progress-{tag}-{}", std::process::id()),
        lib_dir: Some(lib_dir()),
        ..Default::default()
    };
    let plane = NixlPlane::new(&config, pool.view().clone(), Arc::new(|| {})).unwrap();
    Side {
        plane,
        pool,
        id: PeerId::new(format!("127.0.0.1:{port}")),
    }
}

fn register(from: &mut Side, to: &Side) {
    let memory = RemoteMemory {
        agent_metadata: to.plane.metadata().to_vec(),
        base_addr: to.plane.base_addr(),
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    from.plane.add_remote_peer(&to.id, &memory).unwrap();
    let state = wait("registration", || match from.plane.registration(&to.id) {
        Registration::Pending => None,
        other => Some(other),
    });
    assert_eq!(state, Registration::Done);
}

/// `from` WRITEs its blocks `local` into `to`'s blocks `remote`, `to` expecting them as a
/// node does from its fetch until the load ends; the bytes land exactly.
fn write(from: &mut Side, to: &mut Side, local: &[u64], remote: &[u64]) {
    let (l, r): (Vec<_>, Vec<_>) = (
        local.iter().map(|&b| BlockIndex::new(b)).collect(),
        remote.iter().map(|&b| BlockIndex::new(b)).collect(),
    );
    to.plane.expect_writes(&from.id, &r);
    assert_eq!(to.plane.watcher_state().expecting, 1);
    let tid = from.plane.write_blocks(&to.id, &l, &r).unwrap();
    let poll = wait("the WRITE", || {
        let poll = from.plane.poll(&to.id);
        (!poll.done.is_empty() || !poll.failed.is_empty() || poll.peer_fault.is_some())
            .then_some(poll)
    });
    assert_eq!(
        (poll.done, poll.failed, poll.peer_fault),
        (vec![tid], vec![], None)
    );
    for (lb, rb) in l.iter().zip(&r) {
        assert_eq!(from.pool.block(*lb).unwrap(), to.pool.block(*rb).unwrap());
    }
    to.plane.end_writes(&from.id, &r);
    assert_eq!(to.plane.watcher_state().expecting, 0);
}

/// Both watchers park; then, with nothing in flight or expected, they make no sweep at all.
fn assert_idle(sides: &[&Side]) {
    for s in sides {
        wait("the watcher to park", || {
            s.plane.watcher_state().parked.then_some(())
        });
    }
    let before: Vec<_> = sides.iter().map(|s| s.plane.watcher_state()).collect();
    std::thread::sleep(Duration::from_millis(200));
    for (s, was) in sides.iter().zip(before) {
        let now = s.plane.watcher_state();
        assert!(
            now.parked && now.inflight == 0 && now.expecting == 0,
            "{now:?}"
        );
        assert_eq!(now.sweeps, was.sweeps, "an idle watcher progresses nothing");
    }
}

pub(crate) fn exercise() {
    assert!(
        !agent_config().enable_prog_thread,
        "NIXL's progress thread off"
    );
    let before = threads();
    // Made on a thread of a known name: a thread NIXL or UCX starts from it without naming
    // it (NIXL's progress thread) inherits that name.
    let (mut a, mut b, maker) = std::thread::Builder::new()
        .name(MAKER.into())
        .spawn(|| {
            // The maker's own task id ("PID/task/TID"): `join` returns while the kernel may
            // still list the exiting thread under /proc/self/task, so it is left out by id.
            let me = std::fs::read_link("/proc/thread-self").unwrap();
            let tid = me.file_name().unwrap().to_string_lossy().into_owned();
            (side("a", 7301), side("b", 7302), tid)
        })
        .unwrap()
        .join()
        .unwrap();
    let started = || -> Vec<String> {
        threads()
            .difference(&before)
            .filter(|(tid, _)| *tid != maker)
            .map(|(_, n)| n.clone())
            .collect()
    };
    // A thread Rust spawns names itself once it first runs: until then it carries its
    // creator's name, so on a loaded machine a watcher can still read "nixl-maker" here. A
    // thread of that name still there after 2 s is NIXL's.
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while started().iter().any(|n| n == MAKER) && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let started = started();
    assert!(
        !started.iter().any(|n| n == MAKER),
        "a thread NIXL started (its progress thread) is running: {started:?}"
    );
    assert!(
        started.iter().filter(|n| *n == "kvpeer-nixl-wat").count() == 2,
        "one watcher per plane: {started:?}"
    );
    assert_idle(&[&a, &b]);
    register(&mut a, &b);
    register(&mut b, &a);
    assert_idle(&[&a, &b]);
    // Both ways, several times (the first WRITE each way also wires UCX's endpoints up).
    for round in 0..3 {
        write(&mut a, &mut b, &[0, 1, 2, 3], &[8 + round, 4, 5, 15]);
        write(&mut b, &mut a, &[9, 10], &[round, 11]);
    }
    let (sa, sb) = (a.plane.watcher_state(), b.plane.watcher_state());
    assert!(
        sa.sweeps > 0 && sb.sweeps > 0,
        "the watchers progressed UCX: {sa:?} {sb:?}"
    );
    assert_idle(&[&a, &b]);
    a.plane.remove_remote_peer(&b.id);
    b.plane.remove_remote_peer(&a.id);
}
