//! The shm plane's registration of a peer: the object the peer names is proven to be the peer's
//! own pool before anything is mapped writable (not this node's pool; exactly blocks plus
//! trailer long; the trailer's magic; the peer's `shm_token` made from the trailer's secret for
//! this node), then mapped, pre-faulted on a helper thread, and the registration is done when
//! that ends; the helper wakes the runtime. A registration replaced or removed meanwhile never
//! comes back. A refused peer's writes never land anywhere.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer_core::{BlockIndex, DataPlane, Registration, RemoteMemory};
use kvpeer_net::data::metadata::AgentMetadata;
use kvpeer_net::data::shm::{ShmPlane, ShmRefusal, Wake};
use kvpeer_proto::{OffloadKey, PeerId};
use kvpeer_store::trailer::{self, TRAILER_LEN};
use kvpeer_store::{BlockStore, StoreConfig};

const BLOCKS: u64 = 256;
const LEN: u64 = 64 * 1024;
/// The node whose plane registers peers in these tests.
const ME: &str = "127.0.0.1:7000";

fn me() -> PeerId {
    PeerId::new(ME)
}

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

/// The token the owner of `store`'s pool sends this node.
fn token_for_me(store: &BlockStore) -> Option<Vec<u8>> {
    Some(trailer::token(store.pool().shm().unwrap().secret(), ME, None).to_vec())
}

fn memory(shm: &str, num_blocks: u64, shm_token: Option<Vec<u8>>) -> RemoteMemory {
    RemoteMemory {
        agent_metadata: AgentMetadata {
            agent: "peer".into(),
            shm: Some(shm.into()),
            shm_token,
            tcp: None,
            ..Default::default()
        }
        .encode(),
        base_addr: 0,
        num_blocks,
        block_len: LEN,
    }
}

fn plane_for(id: PeerId, store: &BlockStore) -> (ShmPlane, Arc<AtomicUsize>) {
    let wakes = Arc::new(AtomicUsize::new(0));
    let w = wakes.clone();
    let wake: Wake = Arc::new(move || {
        w.fetch_add(1, Ordering::SeqCst);
    });
    let pool = store.pool().view().clone();
    (ShmPlane::new(id, pool, wake).unwrap(), wakes)
}

fn plane(store: &BlockStore) -> (ShmPlane, Arc<AtomicUsize>) {
    plane_for(me(), store)
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

/// Every byte of the object `/name`, blocks and trailer.
fn object_bytes(name: &str) -> Vec<u8> {
    std::fs::read(format!("/dev/shm/{name}")).unwrap()
}

fn key(n: u8) -> OffloadKey {
    OffloadKey::from_parts(&[n; 32], 0)
}

/// Puts a recognisable block into `store`; returns its index and bytes.
fn fill(store: &mut BlockStore, n: u8) -> (u64, Vec<u8>) {
    let bytes: Vec<u8> = (0..LEN).map(|i| n ^ (i as u8).wrapping_mul(31)).collect();
    let block = store.put(&key(n), &bytes).unwrap();
    (block.get(), bytes)
}

/// Asserts `peer`'s registration was refused with a reason containing `why`, and that a write
/// to it does not start.
fn assert_refused(p: &mut ShmPlane, peer: &PeerId, why: &str) {
    match settle(p, peer) {
        Registration::Failed(reason) => {
            let refusal = reason.downcast_ref::<ShmRefusal>();
            assert!(
                refusal.is_some_and(|r| r.to_string().contains(why)),
                "{reason:?}, not {why:?}"
            )
        }
        other => panic!("registered: {other:?} (expected refusal: {why})"),
    }
    assert!(
        p.write_blocks(peer, &[BlockIndex::new(0)], &[BlockIndex::new(0)])
            .is_none(),
        "no write starts"
    );
}

#[test]
fn a_peer_pool_is_registered_at_once_and_written_through_its_object() {
    let (mut mine, _) = pool("a");
    let (theirs, their_name) = pool("b");
    let (local, bytes) = fill(&mut mine, 7);
    let (mut p, _) = plane(&mine);
    let peer = PeerId::new("127.0.0.1:7001");
    p.add_remote_peer(&peer, &memory(&their_name, BLOCKS, token_for_me(&theirs)))
        .unwrap();
    // No mapping, no pre-fault: the registration is done when the proof is.
    assert_eq!(p.registration(&peer), Registration::Done);
    // The registration is usable: a write lands in the peer's pool, byte-exact, and nowhere
    // else (its trailer is untouched).
    let before = object_bytes(&their_name);
    let id = p
        .write_blocks(&peer, &[BlockIndex::new(local)], &[BlockIndex::new(5)])
        .expect("a write starts");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !p.poll(&peer).done.contains(&id) {
        assert!(Instant::now() < deadline, "the write ends");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(theirs.pool().block(BlockIndex::new(5)).unwrap(), &bytes[..]);
    let after = object_bytes(&their_name);
    let (l, r) = (5 * LEN as usize, 6 * LEN as usize);
    assert_eq!(before[..l], after[..l]);
    assert_eq!(
        before[r..],
        after[r..],
        "other blocks and the trailer unchanged"
    );
    // The trailer cannot be written: no block index reaches it.
    assert!(p
        .write_blocks(&peer, &[BlockIndex::new(local)], &[BlockIndex::new(BLOCKS)])
        .is_none());
}

#[test]
fn a_registration_replaced_or_removed_never_comes_back() {
    let (mine, _) = pool("c");
    let (small, small_name) = pool("d");
    let (mut p, _) = plane(&mine);
    let peer = PeerId::new("127.0.0.1:7002");
    let token = token_for_me(&small);

    // Removed before its pre-fault ends: stays unregistered.
    p.add_remote_peer(&peer, &memory(&small_name, BLOCKS, token.clone()))
        .unwrap();
    p.remove_remote_peer(&peer);
    std::thread::sleep(Duration::from_millis(200));
    assert!(matches!(p.registration(&peer), Registration::Failed(_)));
    assert!(p
        .write_blocks(&peer, &[BlockIndex::new(0)], &[BlockIndex::new(0)])
        .is_none());

    // Replaced by a registration that is refused: the first one's late result does not revive it.
    p.add_remote_peer(&peer, &memory(&small_name, BLOCKS, token.clone()))
        .unwrap();
    p.add_remote_peer(&peer, &memory(&small_name, BLOCKS * 2, token))
        .unwrap();
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        matches!(p.registration(&peer), Registration::Failed(ref e)
            if matches!(e.downcast_ref::<ShmRefusal>(), Some(ShmRefusal::WrongSize { .. }))),
        "{:?}",
        p.registration(&peer)
    );
    assert!(p
        .write_blocks(&peer, &[BlockIndex::new(0)], &[BlockIndex::new(0)])
        .is_none());
}

#[test]
fn a_missing_or_short_object_is_refused_at_once() {
    let (mine, _) = pool("e");
    let (theirs, their_name) = pool("f");
    let (mut p, _) = plane(&mine);
    let (a, b) = (PeerId::new("127.0.0.1:7003"), PeerId::new("127.0.0.1:7004"));
    p.add_remote_peer(
        &a,
        &memory("kvpeer-no-such-object", BLOCKS, Some(vec![0; 32])),
    )
    .unwrap();
    p.add_remote_peer(&b, &memory(&their_name, BLOCKS + 1, token_for_me(&theirs)))
        .unwrap();
    assert!(matches!(p.registration(&a), Registration::Failed(_)));
    assert!(matches!(p.registration(&b), Registration::Failed(_)));
}

#[test]
fn a_peer_naming_this_nodes_own_pool_is_refused_whatever_its_token() {
    let (mut mine, my_name) = pool("own");
    let (local, _) = fill(&mut mine, 9);
    let (mut p, _) = plane(&mine);
    let before = object_bytes(&my_name);
    let peer = PeerId::new("127.0.0.1:7010");
    let tokens = [
        // The one token that would verify against our own trailer: made with our own secret
        // for our own id. Only the (device, inode) check stops it.
        ("a valid token", token_for_me(&mine)),
        ("a token for another node", {
            Some(
                trailer::token(mine.pool().shm().unwrap().secret(), "127.0.0.1:7010", None)
                    .to_vec(),
            )
        }),
        ("garbage", Some(vec![0xa5; 32])),
    ];
    for (what, token) in tokens {
        p.add_remote_peer(&peer, &memory(&my_name, BLOCKS, token))
            .unwrap();
        match settle(&mut p, &peer) {
            Registration::Failed(reason) => {
                assert!(
                    matches!(reason.downcast_ref(), Some(ShmRefusal::OwnPool(_))),
                    "{what}: {reason:?}"
                );
            }
            other => panic!("{what}: registered ({other:?})"),
        }
        assert!(
            p.write_blocks(&peer, &[BlockIndex::new(local)], &[BlockIndex::new(1)])
                .is_none(),
            "{what}"
        );
    }
    // No token at all: refused too.
    p.add_remote_peer(&peer, &memory(&my_name, BLOCKS, None))
        .unwrap();
    assert_refused(&mut p, &peer, "no shm_token");
    assert!(
        object_bytes(&my_name) == before,
        "the node's own pool is unchanged"
    );
}

#[test]
fn a_peer_naming_another_pool_without_its_token_is_refused() {
    let (mut mine, _) = pool("g");
    let (victim, victim_name) = pool("victim");
    let (other, _other_name) = pool("other");
    let (local, _) = fill(&mut mine, 3);
    let (mut p, _) = plane(&mine);
    let before = object_bytes(&victim_name);
    let peer = PeerId::new("127.0.0.1:7011");
    let cases = [
        ("no shm_token", None),
        (
            "does not prove",
            // The victim's token, but made for another node (sniffed from a connect to it).
            Some(
                trailer::token(
                    victim.pool().shm().unwrap().secret(),
                    "127.0.0.1:7999",
                    None,
                )
                .to_vec(),
            ),
        ),
        (
            "does not prove",
            // A token for us, but from another pool's secret.
            token_for_me(&other),
        ),
        ("does not prove", Some(vec![0; 32])),
        ("does not prove", Some(Vec::new())),
        (
            "does not prove",
            token_for_me(&victim).map(|t| t[..16].to_vec()),
        ),
    ];
    for (why, token) in cases {
        p.add_remote_peer(&peer, &memory(&victim_name, BLOCKS, token))
            .unwrap();
        assert_refused(&mut p, &peer, why);
        assert!(p
            .write_blocks(&peer, &[BlockIndex::new(local)], &[BlockIndex::new(2)])
            .is_none());
    }
    assert!(
        object_bytes(&victim_name) == before,
        "the other pool is unchanged"
    );
    // The right token for us registers (the object itself was fine).
    p.add_remote_peer(&peer, &memory(&victim_name, BLOCKS, token_for_me(&victim)))
        .unwrap();
    assert_eq!(settle(&mut p, &peer), Registration::Done);
}

#[test]
fn a_peer_lying_about_its_size_or_an_object_without_a_trailer_is_refused() {
    let (mine, _) = pool("h");
    let (theirs, their_name) = pool("i");
    let (mut p, _) = plane(&mine);
    let peer = PeerId::new("127.0.0.1:7012");
    let before = object_bytes(&their_name);
    // Fewer blocks than the object holds (the trailer would lie inside the claimed range's
    // tail) or more: the size is checked exactly.
    for claimed in [BLOCKS - 1, BLOCKS + 1, 1] {
        p.add_remote_peer(&peer, &memory(&their_name, claimed, token_for_me(&theirs)))
            .unwrap();
        assert_refused(&mut p, &peer, "claims");
    }
    assert!(object_bytes(&their_name) == before);

    // An object of the right size whose "trailer" has the wrong magic, with a token made from
    // the bytes where the secret would be.
    let fake = format!("kvpeer-reg-fake-{}", std::process::id());
    let mut bytes = vec![0u8; (BLOCKS * LEN + TRAILER_LEN) as usize];
    let at = (BLOCKS * LEN) as usize;
    bytes[at..at + 8].copy_from_slice(b"KVPSHM00");
    bytes[at + 8..at + 40].fill(0x11);
    std::fs::write(format!("/dev/shm/{fake}"), &bytes).unwrap();
    let forged = trailer::token(&[0x11; 32], ME, None).to_vec();
    p.add_remote_peer(&peer, &memory(&fake, BLOCKS, Some(forged.clone())))
        .unwrap();
    assert_refused(&mut p, &peer, "magic");
    // A plain object of blocks only (the old format): its size does not match.
    let old = format!("kvpeer-reg-old-{}", std::process::id());
    std::fs::write(
        format!("/dev/shm/{old}"),
        vec![0u8; (BLOCKS * LEN) as usize],
    )
    .unwrap();
    p.add_remote_peer(&peer, &memory(&old, BLOCKS, Some(forged)))
        .unwrap();
    assert_refused(&mut p, &peer, "claims");
    assert!(object_bytes(&fake) == bytes, "the fake object is unchanged");
    let _ = std::fs::remove_file(format!("/dev/shm/{fake}"));
    let _ = std::fs::remove_file(format!("/dev/shm/{old}"));
}

#[test]
fn connect_metadata_carries_a_token_for_each_destination() {
    let (mine, _) = pool("j");
    let (theirs, their_name) = pool("k");
    let (mut p, _) = plane(&mine);
    let them = PeerId::new("127.0.0.1:7013");
    let (mut q, _) = plane_for(them.clone(), &theirs);
    let advertised = AgentMetadata {
        agent: them.to_string(),
        shm: Some(their_name.clone()),
        tcp: Some("127.0.0.1:1".into()),
        ..Default::default()
    }
    .encode();

    // The peer's connect to us carries its token for us; registering it works.
    let to_me = q.connect_metadata(&me(), None, &advertised);
    let meta = AgentMetadata::decode(&to_me).unwrap();
    assert_eq!(meta.shm_token, token_for_me(&theirs));
    assert_eq!(
        meta.tcp.as_deref(),
        Some("127.0.0.1:1"),
        "other fields kept"
    );
    let memory_of = |agent_metadata: Vec<u8>| RemoteMemory {
        agent_metadata,
        base_addr: 0,
        num_blocks: BLOCKS,
        block_len: LEN,
    };
    p.add_remote_peer(&them, &memory_of(to_me)).unwrap();
    assert_eq!(settle(&mut p, &them), Registration::Done);

    // Its connect to someone else carries another token, which we refuse.
    let to_other = q.connect_metadata(&PeerId::new("127.0.0.1:7014"), None, &advertised);
    assert_ne!(
        AgentMetadata::decode(&to_other).unwrap().shm_token,
        meta.shm_token
    );
    p.add_remote_peer(&them, &memory_of(to_other)).unwrap();
    assert_refused(&mut p, &them, "does not prove");

    // Metadata naming no shm object, or not kvpeer's map, goes out unchanged.
    let tcp_only = AgentMetadata {
        agent: "x".into(),
        tcp: Some("127.0.0.1:1".into()),
        ..Default::default()
    }
    .encode();
    assert_eq!(q.connect_metadata(&me(), None, &tcp_only), tcp_only);
    assert_eq!(q.connect_metadata(&me(), None, b"\xc1nixl"), b"\xc1nixl");
}

#[test]
fn a_pool_in_external_memory_is_refused_with_a_typed_error() {
    use kvpeer_net::data::shm::ShmError;
    use kvpeer_store::Pool;
    let mut mem = vec![0u8; (BLOCKS * LEN) as usize];
    let base = std::ptr::NonNull::new(mem.as_mut_ptr()).unwrap();
    // SAFETY: the pool owns the buffer (keep-alive); nothing else touches it.
    let pool = unsafe { Pool::external(base, BLOCKS, LEN, LEN, Some(Box::new(mem))) }.unwrap();
    let refused = ShmPlane::new(me(), pool.view().clone(), Arc::new(|| {}));
    assert!(matches!(refused, Err(ShmError::NotShm)), "{refused:?}");
}
