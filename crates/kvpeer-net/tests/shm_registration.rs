//! The shm plane's registration of a peer: the peer's pool is mapped at once (or refused at
//! once), pre-faulted on a helper thread, and the registration is done when that ends; the
//! helper wakes the runtime. A registration replaced or removed meanwhile never comes back.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::{DataPlane, Registration, RemoteMemory};
use kvpeer_net::metadata::AgentMetadata;
use kvpeer_net::shm::{ShmPlane, Wake};
use kvpeer_proto::PeerId;
use kvpeer_store::{BlockStore, StoreConfig};

const BLOCKS: u64 = 256;
const LEN: u64 = 64 * 1024;

fn pool(tag: &str) -> (BlockStore, String) {
    let name = format!("kvpeer-reg-{tag}-{}", std::process::id());
    let store = BlockStore::new(&StoreConfig {
        shm_name: name.clone(),
        num_blocks: BLOCKS,
        block_len: LEN,
        lock_memory: false,
    })
    .unwrap();
    (store, name)
}

fn memory(shm: &str, num_blocks: u64) -> RemoteMemory {
    RemoteMemory {
        agent_metadata: AgentMetadata {
            agent: "peer".into(),
            shm: Some(shm.into()),
            tcp: None,
        }
        .encode(),
        base_addr: 0,
        num_blocks,
        block_len: LEN,
    }
}

fn plane(name: &str) -> (ShmPlane, Arc<AtomicUsize>) {
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    let wake: Wake = Arc::new(move || {
        w.fetch_add(1, Ordering::SeqCst);
    });
    (ShmPlane::new(name, BLOCKS, LEN, wake).unwrap(), wakes)
}

fn settle(p: &mut ShmPlane, peer: &PeerId) -> Registration {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = p.registration(peer);
        if state != Registration::Pending || Instant::now() > deadline {
            return state;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_peer_pool_is_registered_after_its_prefault_and_the_runtime_is_woken() {
    let (_mine, my_name) = pool("a");
    let (theirs, their_name) = pool("b");
    let (mut p, wakes) = plane(&my_name);
    let peer = PeerId::new("127.0.0.1:7001");
    p.add_remote_peer(&peer, &memory(&their_name, BLOCKS))
        .unwrap();
    assert_eq!(settle(&mut p, &peer), Registration::Done);
    assert!(
        wakes.load(Ordering::SeqCst) >= 1,
        "the helper woke the runtime"
    );
    // The registration is usable: a write lands in the peer's pool.
    let id = p.write_blocks(&peer, &[0], &[5]).expect("a write starts");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p.poll(&peer).done.contains(&id) {
        assert!(Instant::now() < deadline, "the write ends");
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(theirs);
}

#[test]
fn a_registration_replaced_or_removed_while_prefaulting_never_comes_back() {
    let (_mine, my_name) = pool("c");
    let (_small, small_name) = pool("d");
    let (mut p, _) = plane(&my_name);
    let peer = PeerId::new("127.0.0.1:7002");

    // Removed before its pre-fault ends: stays unregistered.
    p.add_remote_peer(&peer, &memory(&small_name, BLOCKS))
        .unwrap();
    p.remove_remote_peer(&peer);
    std::thread::sleep(Duration::from_millis(200));
    assert!(matches!(p.registration(&peer), Registration::Failed(_)));
    assert!(p.write_blocks(&peer, &[0], &[0]).is_none());

    // Replaced by a registration that is refused: the first one's late result does not revive it.
    p.add_remote_peer(&peer, &memory(&small_name, BLOCKS))
        .unwrap();
    p.add_remote_peer(&peer, &memory(&small_name, BLOCKS * 2))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        matches!(p.registration(&peer), Registration::Failed(ref e) if e.contains("claims")),
        "{:?}",
        p.registration(&peer)
    );
    assert!(p.write_blocks(&peer, &[0], &[0]).is_none());
}

#[test]
fn a_missing_or_short_object_is_refused_at_once() {
    let (_mine, my_name) = pool("e");
    let (_theirs, their_name) = pool("f");
    let (mut p, _) = plane(&my_name);
    let (a, b) = (PeerId::new("127.0.0.1:7003"), PeerId::new("127.0.0.1:7004"));
    p.add_remote_peer(&a, &memory("kvpeer-no-such-object", BLOCKS))
        .unwrap();
    p.add_remote_peer(&b, &memory(&their_name, BLOCKS + 1))
        .unwrap();
    assert!(matches!(p.registration(&a), Registration::Failed(_)));
    assert!(matches!(p.registration(&b), Registration::Failed(_)));
}
