//! [`Node::pull`] over [`Sources`]: a consumer with no producer named asks the pool that owns
//! the prefix (rendezvous of its root chunk), or every pool when it does not know the root; a
//! router's hint is asked first and the owner pool gives the rest, so one request loads from
//! two sources. Each case checks from the sources' side who was asked (their served-lookup
//! counters) and from the consumer's side which bytes landed; a pool that is gone or silent
//! costs one lookup timeout and serves nothing wrong, while the live pool keeps serving.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::TcpListener;
use std::time::{Duration, Instant};

use kvpeer::{synthetic, Node, NodeConfig, OffloadKey, PeerId, PlaneKind, Pull, Sources};

const LEN: u64 = 4096;
const CHUNKS: u64 = 6;

fn node(tag: &str, blocks: u64) -> Node {
    let config = NodeConfig::builder(tag)
        .plane(PlaneKind::Tcp)
        .num_blocks(blocks)
        .block_len(LEN)
        .set("lookup_timeout_s", "1")
        .set("handshake_timeout_s", "1")
        .build()
        .unwrap();
    Node::start(config).unwrap()
}

/// The chunks of prefix `p`: its root is the first.
fn prefix(p: u64) -> Vec<OffloadKey> {
    (0..CHUNKS).map(|c| synthetic::key(p * 1000 + c)).collect()
}

fn hold(n: &Node, keys: &[OffloadKey]) {
    n.store(
        keys.iter()
            .map(|k| (k.clone(), synthetic::content(k, LEN as usize)))
            .collect(),
    )
    .unwrap();
}

fn served_lookups(n: &Node) -> u64 {
    n.stats().unwrap().counters.lookups_served
}

fn byte_exact(n: &Node, keys: &[OffloadKey]) -> bool {
    keys.iter()
        .all(|k| n.read(k) == Some(synthetic::content(k, LEN as usize)))
}

/// A prefix whose root chunk `sources` gives to `owner`.
fn owned_by(sources: &Sources, owner: &PeerId, from: u64) -> u64 {
    (from..from + 1000)
        .find(|&p| sources.owner(&prefix(p)[0]) == Some(owner))
        .unwrap()
}

fn pull(id: &str, root: Option<&OffloadKey>) -> Pull {
    Pull {
        id: id.to_owned(),
        hint: None,
        root: root.cloned(),
    }
}

#[test]
fn a_request_asks_only_the_pool_that_owns_its_prefix() {
    let pools = [node("src-own-p0", 64), node("src-own-p1", 64)];
    let sources = Sources::new(pools.iter().map(|p| p.id().clone()));
    let consumer = node("src-own-c", 64);
    for (i, pool) in pools.iter().enumerate() {
        let p = owned_by(&sources, pool.id(), 100 * i as u64);
        let keys = prefix(p);
        hold(pool, &keys);
        let before = [served_lookups(&pools[0]), served_lookups(&pools[1])];
        let got = consumer
            .pull(&sources, &pull(&format!("own-{i}"), Some(&keys[0])), &keys)
            .unwrap();
        assert_eq!(got.fetched, keys.len(), "{got:?}");
        assert_eq!(got.fetched_from(pool.id()), keys.len());
        assert!(got.failures.is_empty(), "{:?}", got.failures);
        assert!(byte_exact(&consumer, &keys));
        // One round trip to one pool: the other one was not asked.
        let after = [served_lookups(&pools[0]), served_lookups(&pools[1])];
        assert_eq!(after[i], before[i] + 1, "the owner answers one lookup");
        assert_eq!(after[1 - i], before[1 - i], "the other pool is not asked");
    }
}

#[test]
fn a_hint_is_asked_first_and_the_owner_pool_gives_the_rest() {
    let pools = [node("src-hint-p0", 64), node("src-hint-p1", 64)];
    let sources = Sources::new(pools.iter().map(|p| p.id().clone()));
    let hinted = node("src-hint-engine", 64);
    let consumer = node("src-hint-c", 64);
    let owner = &pools[1];
    let keys = prefix(owned_by(&sources, owner.id(), 0));
    // The router's engine holds the first half, the owner pool the whole prefix.
    hold(&hinted, &keys[..3]);
    hold(owner, &keys);
    let request = Pull {
        id: "hinted".to_owned(),
        hint: Some((hinted.id().clone(), "router-kv-1".to_owned())),
        root: Some(keys[0].clone()),
    };
    let got = consumer.pull(&sources, &request, &keys).unwrap();
    assert_eq!(got.fetched, keys.len(), "{got:?}");
    assert_eq!(
        got.fetched_from(hinted.id()),
        3,
        "the hint's chunks from the hint"
    );
    assert_eq!(
        got.fetched_from(owner.id()),
        3,
        "the rest from the owner pool"
    );
    assert!(byte_exact(&consumer, &keys));
    // What each source wrote, from its side: the hint 3 blocks, the owner 3, the other none.
    let written = |n: &Node| n.stats().unwrap().counters.fetch_blocks_served;
    assert_eq!(written(&hinted), 3);
    assert_eq!(written(owner), 3);
    assert_eq!(served_lookups(&pools[0]), 0);
    assert_eq!(written(&pools[0]), 0);
}

#[test]
fn without_the_root_every_pool_is_asked_once_and_the_holder_serves() {
    let pools = [node("src-fan-p0", 64), node("src-fan-p1", 64)];
    let sources = Sources::new(pools.iter().map(|p| p.id().clone()));
    let consumer = node("src-fan-c", 64);
    let keys = prefix(owned_by(&sources, pools[0].id(), 0));
    hold(&pools[0], &keys);
    let got = consumer.pull(&sources, &pull("fan", None), &keys).unwrap();
    assert_eq!(got.fetched_from(pools[0].id()), keys.len(), "{got:?}");
    assert!(byte_exact(&consumer, &keys));
    assert_eq!(served_lookups(&pools[0]), 1);
    assert_eq!(served_lookups(&pools[1]), 1, "asked once, held nothing");
    assert_eq!(pools[1].stats().unwrap().counters.fetch_blocks_served, 0);
}

#[test]
fn a_pool_that_is_gone_or_silent_costs_one_lookup_timeout_and_the_live_pool_still_serves() {
    let live = node("src-down-live", 64);
    // One address nothing listens on, one that accepts and never says a word.
    let gone = {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        PeerId::new(l.local_addr().unwrap().to_string())
    };
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_id = PeerId::new(silent.local_addr().unwrap().to_string());
    let sources = Sources::new([live.id().clone(), gone.clone(), silent_id.clone()]);
    let consumer = node("src-down-c", 64);
    for dead in [&gone, &silent_id] {
        // A prefix the dead pool owns: a miss, within the lookup timeout, nothing landed.
        let keys = prefix(owned_by(&sources, dead, 0));
        let started = Instant::now();
        let got = consumer
            .pull(&sources, &pull("dead", Some(&keys[0])), &keys)
            .unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        assert_eq!(got.fetched, 0);
        assert!(got.holders.iter().all(Option::is_none));
        assert_eq!(got.failures.len(), 1, "{:?}", got.failures);
        assert_eq!(&got.failures[0].0, dead);
        assert!(keys.iter().all(|k| consumer.read(k).is_none()));
    }
    // The same consumer still gets the live pool's prefixes, byte-exact, without a root too.
    let keys = prefix(owned_by(&sources, live.id(), 0));
    hold(&live, &keys);
    let got = consumer
        .pull(&sources, &pull("live", Some(&keys[0])), &keys)
        .unwrap();
    assert_eq!(got.fetched_from(live.id()), keys.len(), "{got:?}");
    assert!(byte_exact(&consumer, &keys));
    drop(silent);
}

#[test]
fn stages_ask_the_hint_then_the_owner_and_never_a_source_twice() {
    let members: Vec<PeerId> = ["10.0.0.5:5710", "10.0.0.6:5710", "10.0.0.7:5710"]
        .iter()
        .map(PeerId::new)
        .collect();
    let sources = Sources::new(members.clone());
    // Vector of kvpeer_pool::shard (Python's hashlib): this root belongs to the second member.
    let root = OffloadKey::from_parts(&[7u8; 32], 0);
    assert_eq!(sources.owner(&root), Some(&members[1]));
    let hint = PeerId::new("10.0.0.9:5710");
    assert_eq!(
        sources.stages(Some(&hint), Some(&root)),
        vec![vec![hint.clone()], vec![members[1].clone()]]
    );
    assert_eq!(sources.stages(None, None), vec![members.clone()]);
    // The hint is the owner: asked once.
    assert_eq!(
        sources.stages(Some(&members[1]), Some(&root)),
        vec![vec![members[1].clone()]]
    );
    assert!(Sources::default().stages(None, Some(&root)).is_empty());
}
