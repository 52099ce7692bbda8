//! The pool node in process, on the tcp plane: an engine (a kvpeer node holding synthetic
//! blocks) announces them on a KV event stream in vLLM's form (kvpeer's own native PUB and
//! replay ROUTER, driven by a thread of the test), and a second node with a [`PoolNode`] follows
//! it. Publisher restarts, malformed batches, a pool smaller than what is announced, and the
//! pool's own published stream. (Against stock vLLM over NIXL: `pool_nixl.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::net::SocketAddr;
use std::sync::mpsc::{channel, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use kvpeer::node::tenants::TenantRules;
use kvpeer::pool_node::{FollowSpec, PoolConfig, PoolNode, PoolNodeStats};
use kvpeer::{synthetic, LookupResult, Node, NodeConfig, OffloadKey, PlaneKind};
use kvpeer_net::events::{EventPublisher, PublisherConfig, SubEndpoint};
use kvpeer_pool::keys::{key_event, KeyEvent};
use kvpeer_pool::{Catalog, CatalogLimits, HashForm, Publisher, StoreChange};
use kvpeer_proto::events::{encode_batch, BlockHash, BlockStored, KvEvent};

mod common;
use common::engines::{engine, keys, node, LEN};
use common::events::replayed_until;
use common::free_port;

enum Say {
    /// A batch announcing these keys stored.
    Stored(Vec<OffloadKey>),
    /// A payload that is no batch.
    Garbage,
    /// The publisher restarts: `seq` from 0, its buffer empty.
    Restart,
    /// A batch announcing these keys that the subscriber misses (kept for replay, never sent
    /// live: what a PUB past its high-water mark does).
    Missed(Vec<OffloadKey>),
    /// A batch of these events, as given.
    Events(Vec<KvEvent>),
}

/// An engine's KV event stream, driven by a thread: a PUB and a replay ROUTER on loopback.
struct Stream {
    /// What to say, and where the thread acknowledges it (kept, and published if live).
    tx: Option<Sender<(Say, Sender<()>)>>,
    events: SocketAddr,
    replay: SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl Stream {
    fn start() -> Stream {
        let mut config = PublisherConfig::new(SocketAddr::from(([127, 0, 0, 1], 0)));
        config.replay_bind = Some(SocketAddr::from(([127, 0, 0, 1], 0)));
        let mut socket = EventPublisher::bind(config).unwrap();
        let events = socket.local_addr().unwrap();
        let replay = socket.replay_addr().unwrap();
        let (tx, rx) = channel::<(Say, Sender<()>)>();
        let thread = std::thread::spawn(move || {
            let mut seq = 0u64;
            let mut kept: Vec<(u64, Vec<u8>)> = Vec::new();
            loop {
                let replay = |start: u64| {
                    let mut out: Vec<Vec<Vec<u8>>> = kept
                        .iter()
                        .filter(|(s, _)| *s >= start)
                        .map(|(s, p)| vec![Vec::new(), s.to_be_bytes().to_vec(), p.clone()])
                        .collect();
                    out.push(vec![Vec::new(), (-1i64).to_be_bytes().to_vec(), Vec::new()]);
                    out
                };
                socket.serve(Duration::from_millis(10), replay).unwrap();
                let (said, done) = match rx.try_recv() {
                    Ok(s) => s,
                    Err(std::sync::mpsc::TryRecvError::Empty) => continue,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => return,
                };
                let live = !matches!(said, Say::Missed(_));
                let payload = match said {
                    Say::Restart => {
                        seq = 0;
                        kept.clear();
                        let _ = done.send(());
                        continue;
                    }
                    Say::Garbage => b"\xc1 not msgpack".to_vec(),
                    Say::Events(events) => encode_batch(1.0, &events, Some(0)).unwrap(),
                    Say::Stored(keys) | Say::Missed(keys) => {
                        let changes: Vec<StoreChange> =
                            keys.into_iter().map(StoreChange::Stored).collect();
                        Publisher::new("", 1)
                            .publish(1.0, &changes, &mut Catalog::new(CatalogLimits::default()))
                            .unwrap()
                            .unwrap()
                            .payload
                    }
                };
                if live {
                    socket.publish(&[b"", &seq.to_be_bytes(), &payload]);
                }
                kept.push((seq, payload));
                seq += 1;
                let _ = done.send(());
            }
        });
        Stream {
            tx: Some(tx),
            events,
            replay,
            thread: Some(thread),
        }
    }

    /// Says `s` and returns once the stream kept it (so a follower that starts next finds it
    /// in the replay, not only in a live message it may not be subscribed for yet).
    fn say(&self, s: Say) {
        let (done, said) = channel();
        self.tx.as_ref().unwrap().send((s, done)).unwrap();
        said.recv_timeout(Duration::from_secs(10)).unwrap();
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn follow(stream: &Stream, engine: &Node) -> PoolConfig {
    PoolConfig {
        follow: vec![FollowSpec {
            events: SubEndpoint::Connect(stream.events),
            replay: Some(stream.replay),
            peer: engine.id().clone(),
        }],
        ..PoolConfig::default()
    }
}

/// Waits (bounded) until `done(stats)`; the last stats.
fn wait_for(pool: &PoolNode, what: &str, done: impl Fn(&PoolNodeStats) -> bool) -> PoolNodeStats {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = pool.stats();
        if done(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "{what}: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_holds(node: &Node, keys: &[OffloadKey]) {
    for k in keys {
        assert_eq!(
            node.read(k),
            Some(synthetic::content(k, LEN as usize)),
            "{k:?}"
        );
    }
}

#[test]
fn a_pool_pulls_what_an_engine_announces_and_publishes_what_it_took_in() {
    let engine = engine("pool-e1", 8);
    let stream = Stream::start();
    // Announced before the pool follows: the replay on connect brings it.
    stream.say(Say::Stored(keys(0..8)));
    let pool_node = Arc::new(node("pool-p1", 64));
    let publish = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let publish_replay = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let config = PoolConfig {
        publish: Some(publish),
        publish_replay: Some(publish_replay),
        topic: "kv@pool".into(),
        ..follow(&stream, &engine)
    };
    let pool = PoolNode::start(pool_node.clone(), &config).unwrap();
    let s = wait_for(&pool, "8 pulled", |s| s.pulled_blocks == 8);
    assert_eq!((s.pull_failures, s.malformed, s.batches), (0, 0, 1));
    assert_eq!(s.pulled_bytes, 8 * LEN);
    assert_holds(&pool_node, &keys(0..8));

    // A second announcement of the same keys pulls nothing again.
    stream.say(Say::Stored(keys(0..8)));
    let s = wait_for(&pool, "the second batch", |s| s.batches == 2);
    assert_eq!(s.pulled_blocks, 8);

    // The pool's own stream: a late subscriber's replay names every key it took in.
    let _ = wait_for(&pool, "published", |s| s.published_batches >= 1);
    let mut stored: Vec<OffloadKey> = replayed_until(publish, publish_replay, |_| true)
        .iter()
        .filter_map(|e| match key_event(e) {
            KeyEvent::Stored(k) => Some(k),
            _ => None,
        })
        .collect();
    stored.sort();
    let mut want = keys(0..8);
    want.sort();
    assert_eq!(stored, want);
    pool.shutdown();
}

/// A GPU block's hash in the test prompt: chunk `c`'s first block is made up here, its second
/// is the chunk's key (a CPU chunk is named by its last block's hash).
fn block_hash(c: u64, second: bool) -> Vec<u8> {
    if second {
        synthetic::key(c).as_bytes()[..32].to_vec()
    } else {
        let mut h = vec![0xb0; 32];
        h[..8].copy_from_slice(&c.to_be_bytes());
        h
    }
}

fn tokens_of(c: u64) -> Vec<u32> {
    (0..32).map(|t| (c * 100 + t) as u32).collect()
}

/// An engine's stream says a 4-chunk prompt on its GPU pool (blocks of 16 tokens, tokens and
/// parents), then offloads chunks 0..5 to its CPU tier (vLLM's placeholder events): chunk 4's
/// blocks were never announced.
fn announce_prompt(stream: &Stream) {
    let blocks: Vec<Vec<u8>> = (0..4)
        .flat_map(|c| [block_hash(c, false), block_hash(c, true)])
        .collect();
    stream.say(Say::Events(vec![KvEvent::Stored(BlockStored {
        block_hashes: blocks.iter().cloned().map(BlockHash::Bytes).collect(),
        token_ids: (0..4).flat_map(tokens_of).collect(),
        block_size: 16,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        kv_cache_spec_kind: Some("full_attention".into()),
        ..BlockStored::default()
    })]));
    stream.say(Say::Stored(keys(0..5)));
}

/// What routers need from a pool's events: an engine announces a 4-chunk prompt on its GPU
/// pool (blocks of 16 tokens, tokens and parents) and offloads each chunk of 2 blocks to its
/// CPU tier (vLLM's placeholder events); the pool pulls them and publishes each chunk with
/// its two block hashes, its parent, its 32 tokens and block size 16, in bytes and in the int
/// form, with no `ownership` (as an engine's own CPU tier) or the one set: what a subscriber
/// of the pool's stream receives. A chunk whose blocks were never announced is published as
/// vLLM's placeholder, counted, never with made-up tokens.
#[test]
fn a_pool_describes_the_chunks_it_took_in_with_the_engines_tokens_and_parents() {
    for (form, ownership) in [(HashForm::Bytes, None), (HashForm::Int, Some("kvpeer"))] {
        let engine = engine("pool-e7", 5);
        let stream = Stream::start();
        announce_prompt(&stream);
        let pool_node = Arc::new(node("pool-p7", 64));
        let publish = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let publish_replay = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let config = PoolConfig {
            publish: Some(publish),
            publish_replay: Some(publish_replay),
            hash_form: form,
            ownership: ownership.map(str::to_owned),
            ..follow(&stream, &engine)
        };
        let pool = PoolNode::start(pool_node.clone(), &config).unwrap();
        wait_for(&pool, "5 pulled", |s| s.pulled_blocks == 5);
        let s = wait_for(&pool, "5 published", |s| {
            s.published_described + s.published_undescribed[0] == 5
        });
        assert_eq!(
            (s.published_described, s.published_undescribed),
            (4, [1, 0, 0, 0])
        );
        let as_form = |h: &[u8]| match form {
            HashForm::Bytes => BlockHash::Bytes(h.to_vec()),
            HashForm::Int => BlockHash::Int(kvpeer_pool::low_64_bits(h)),
        };
        let mut stores: Vec<BlockStored> = replayed_until(publish, publish_replay, |_| true)
            .into_iter()
            .filter_map(|e| match e {
                KvEvent::Stored(s) => Some(s),
                _ => None,
            })
            .collect();
        assert_eq!(stores.len(), 5, "{stores:?}");
        // In the order the pool took them in; sort by the chunk's name for the check.
        let key_hash = |c: u64| as_form(&block_hash(c, true));
        for c in 0..4u64 {
            let at = stores
                .iter()
                .position(|s| s.block_hashes.last() == Some(&key_hash(c)))
                .unwrap_or_else(|| panic!("chunk {c} not published: {stores:?}"));
            let s = stores.remove(at);
            assert_eq!(
                s.block_hashes,
                vec![as_form(&block_hash(c, false)), key_hash(c)]
            );
            let parent = c.checked_sub(1).map(key_hash);
            assert_eq!(s.parent_block_hash, parent, "chunk {c}");
            assert_eq!(s.token_ids, tokens_of(c));
            assert_eq!(s.block_size, 16);
            assert_eq!(s.group_idx, Some(0));
            assert_eq!(s.medium.as_deref(), Some("CPU"));
            assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
            assert_eq!(s.ownership.as_deref(), ownership);
        }
        // Chunk 4: no GPU block of it was announced: vLLM's placeholder.
        assert_eq!(stores.len(), 1);
        assert_eq!(stores[0].block_hashes, vec![key_hash(4)]);
        assert!(stores[0].token_ids.is_empty() && stores[0].block_size == 0);
        assert_eq!(stores[0].parent_block_hash, None);
        pool.shutdown();
    }
}

#[test]
fn a_publisher_restart_forgets_the_engine_and_learns_it_again() {
    let engine = engine("pool-e2", 8);
    let stream = Stream::start();
    let pool_node = Arc::new(node("pool-p2", 64));
    let pool = PoolNode::start(pool_node.clone(), &follow(&stream, &engine)).unwrap();
    // Found in CI (health.rs): before the pool thread's first tick its stats said 0 engines,
    // and `/readyz` called a pool that had not tried yet ready. From the start it follows one.
    let first = pool.stats();
    assert_eq!(first.engines, 1, "{first:?}");
    stream.say(Say::Stored(keys(0..2)));
    stream.say(Say::Stored(keys(2..4)));
    let s = wait_for(&pool, "4 pulled", |s| s.pulled_blocks == 4);
    assert_eq!(s.indexed_keys, 4);
    stream.say(Say::Restart);
    stream.say(Say::Stored(keys(4..8)));
    let s = wait_for(&pool, "the restart seen, 4 more pulled", |s| {
        s.restarts == 1 && s.pulled_blocks == 8
    });
    assert_eq!(s.indexed_keys, 4, "what the old engine held is forgotten");
    assert_holds(&pool_node, &keys(0..8));
    pool.shutdown();
}

/// A batch missed on the live stream shows as a gap in `seq`: the pool asks the engine's
/// replay socket for it, and pulls what it announced too, nothing lost.
#[test]
fn a_gap_is_recovered_through_the_replay_socket() {
    let engine = engine("pool-e5", 6);
    let stream = Stream::start();
    let pool_node = Arc::new(node("pool-p5", 64));
    let pool = PoolNode::start(pool_node.clone(), &follow(&stream, &engine)).unwrap();
    stream.say(Say::Stored(keys(0..2)));
    wait_for(&pool, "2 pulled", |s| s.pulled_blocks == 2);
    stream.say(Say::Missed(keys(2..4)));
    stream.say(Say::Stored(keys(4..6)));
    let s = wait_for(&pool, "the gap replayed, 6 pulled", |s| {
        s.pulled_blocks == 6
    });
    assert_eq!((s.gaps, s.lost_batches, s.restarts), (1, 0, 0), "{s:?}");
    assert_holds(&pool_node, &keys(0..6));
    pool.shutdown();
}

#[test]
fn a_malformed_batch_is_counted_and_the_stream_goes_on() {
    let engine = engine("pool-e3", 4);
    let stream = Stream::start();
    let pool_node = Arc::new(node("pool-p3", 64));
    let pool = PoolNode::start(pool_node.clone(), &follow(&stream, &engine)).unwrap();
    stream.say(Say::Garbage);
    stream.say(Say::Stored(keys(0..4)));
    let s = wait_for(&pool, "4 pulled after the bad batch", |s| {
        s.pulled_blocks == 4
    });
    assert_eq!((s.malformed, s.gaps, s.restarts), (1, 0, 0));
    assert_holds(&pool_node, &keys(0..4));
    pool.shutdown();
}

#[test]
fn a_pool_smaller_than_what_is_announced_keeps_within_its_blocks() {
    let engine = engine("pool-e4", 32);
    let stream = Stream::start();
    let pool_node = Arc::new(node("pool-p4", 8));
    let pool = PoolNode::start(pool_node.clone(), &follow(&stream, &engine)).unwrap();
    for i in 0..4 {
        stream.say(Say::Stored(keys(i * 8..i * 8 + 8)));
    }
    let s = wait_for(&pool, "every candidate tried", |s| {
        s.candidates == 32 && s.pulled_blocks + s.pull_failures + s.already_held >= 32
    });
    assert!(s.pulled_blocks >= 8, "{s:?}");
    let store = pool_node.stats().unwrap().store;
    assert!(store.ready <= 8, "{store:?}");
    // The latest batch's blocks are the ones kept (LRU), whole.
    assert_holds(&pool_node, &keys(24..32));
    pool.shutdown();
}

/// `pull_min_holders` 2: a chunk is pulled only once two followed engines hold it (a shared
/// prefix); what one engine alone announced is indexed, never pulled.
#[test]
fn with_two_holders_required_only_shared_chunks_are_pulled() {
    let (engine_a, engine_b) = (engine("pool-e6a", 8), engine("pool-e6b", 8));
    let (stream_a, stream_b) = (Stream::start(), Stream::start());
    let pool_node = Arc::new(node("pool-p6", 64));
    let mut config = follow(&stream_a, &engine_a);
    config.follow.extend(follow(&stream_b, &engine_b).follow);
    config.min_holders = 2;
    let pool = PoolNode::start(pool_node.clone(), &config).unwrap();
    // A announces 0..6, B announces 4..8: only 4 and 5 are held by both.
    stream_a.say(Say::Stored(keys(0..6)));
    stream_b.say(Say::Stored(keys(4..8)));
    let s = wait_for(&pool, "the shared chunks pulled", |s| {
        s.indexed_keys == 8 && s.pulled_blocks == 2
    });
    assert_eq!(s.candidates, 2, "{s:?}");
    assert_holds(&pool_node, &keys(4..6));
    assert_eq!(
        pool_node.contains(&keys(0..8)).unwrap(),
        vec![false, false, false, false, true, true, false, false]
    );
    pool.shutdown();
}

/// A prompt `p` of two chunks (synthetic keys 2p and 2p + 1), as an engine's GPU pool
/// announces it: four blocks of 16 tokens, the second of each chunk its key's hash.
fn prompt_gpu_event(p: u64) -> KvEvent {
    let blocks: Vec<Vec<u8>> = [2 * p, 2 * p + 1]
        .into_iter()
        .flat_map(|c| [block_hash(c, false), block_hash(c, true)])
        .collect();
    KvEvent::Stored(BlockStored {
        block_hashes: blocks.into_iter().map(BlockHash::Bytes).collect(),
        token_ids: [2 * p, 2 * p + 1].into_iter().flat_map(tokens_of).collect(),
        block_size: 16,
        medium: Some("GPU".into()),
        group_idx: Some(0),
        ..BlockStored::default()
    })
}

/// `shard`: two pool nodes follow the same engine and split its prefixes by rendezvous
/// hashing of each prefix's root chunk: each pulls exactly the prompts whose root it owns
/// (both chunks of each, never one without the other), none is pulled twice, and together
/// they hold all of them. A chunk whose prefix's root is unknown (its engine sent no GPU
/// events for it) is pulled by neither, and counted.
#[test]
fn sharded_pools_split_the_prefixes_by_their_root_chunk() {
    let prompts = 8u64;
    let engine = engine("pool-e9", 2 * prompts + 1);
    let stream = Stream::start();
    let (a, b) = (
        Arc::new(node("pool-p9a", 64)),
        Arc::new(node("pool-p9b", 64)),
    );
    let members = vec![a.id().clone(), b.id().clone()];
    let config = PoolConfig {
        shard: members.clone(),
        ..follow(&stream, &engine)
    };
    let pool_a = PoolNode::start(a.clone(), &config).unwrap();
    let pool_b = PoolNode::start(b.clone(), &config).unwrap();
    wait_for(&pool_a, "a connected", |s| s.connected == 1);
    wait_for(&pool_b, "b connected", |s| s.connected == 1);
    stream.say(Say::Events((0..prompts).map(prompt_gpu_event).collect()));
    stream.say(Say::Stored(keys(0..2 * prompts + 1)));
    let owner = |p: u64| {
        let root = synthetic::key(2 * p);
        kvpeer_pool::shard::owner(&[members[0].as_str(), members[1].as_str()], &root).unwrap()
    };
    let mine = |i: usize| -> Vec<OffloadKey> {
        (0..prompts)
            .filter(|&p| owner(p) == i)
            .flat_map(|p| keys(2 * p..2 * p + 2))
            .collect()
    };
    for (i, (pool, held)) in [(&pool_a, &a), (&pool_b, &b)].into_iter().enumerate() {
        let want = mine(i);
        let s = wait_for(pool, "its share pulled", |s| {
            s.pulled_blocks == want.len() as u64 && s.shard_unknown_root >= 1
        });
        assert_eq!(s.shard_others, 2 * prompts - want.len() as u64, "{s:?}");
        assert_holds(held, &want);
        let all = keys(0..2 * prompts + 1);
        let holds = held.contains(&all).unwrap();
        for (k, h) in all.iter().zip(holds) {
            assert_eq!(h, want.contains(k), "{k:?}");
        }
    }
    pool_a.shutdown();
    pool_b.shutdown();

    // A node that is not among the members it is given refuses to start.
    let stranger = Arc::new(node("pool-p9c", 8));
    assert!(matches!(
        PoolNode::start(stranger, &config),
        Err(kvpeer::pool_node::PoolNodeError::NotInShard { .. })
    ));
}

#[test]
fn a_touched_block_is_kept_and_an_untouched_one_evicted() {
    let n = engine("pool-touch", 2);
    let k = keys(0..3);
    assert_eq!(n.touch(&k).unwrap(), vec![true, true, false]);
    assert_eq!(n.contains(&k[1..2]).unwrap(), vec![true]);
    n.touch(&k[..1]).unwrap();
    // 0 is now the most recently used (contains left the order alone): storing 2 evicts 1.
    n.store(vec![(
        k[2].clone(),
        synthetic::content(&k[2], LEN as usize),
    )])
    .unwrap();
    assert_eq!(n.contains(&k).unwrap(), vec![true, false, true]);
}

#[test]
fn a_pool_with_tenants_pulls_each_engines_blocks_into_its_tenant_and_serves_them_only_to_it() {
    // Alpha's engine holds 0..4, beta's 2..6: 2 and 3 are held by both tenants.
    let (alpha, beta) = (engine("pool-t-a", 4), node("pool-t-b", 8));
    beta.store(
        keys(2..6)
            .into_iter()
            .map(|k| {
                let v = synthetic::content(&k, LEN as usize);
                (k, v)
            })
            .collect(),
    )
    .unwrap();
    let (alpha_reader, beta_reader) = (node("pool-t-ar", 8), node("pool-t-br", 8));
    let rules = [
        format!("alpha={}", alpha.id()),
        format!("alpha={}", alpha_reader.id()),
        format!("beta={}", beta.id()),
        format!("beta={}", beta_reader.id()),
    ];
    let mut spec = NodeConfig::builder("pool-t-p")
        .plane(PlaneKind::Tcp)
        .num_blocks(64)
        .block_len(LEN)
        .build()
        .unwrap();
    spec.spec.tenants = TenantRules::parse(None, &rules).unwrap();
    let pool_node = Arc::new(Node::start(spec).unwrap());
    let (stream_a, stream_b) = (Stream::start(), Stream::start());
    let mut config = follow(&stream_a, &alpha);
    config.follow.extend(follow(&stream_b, &beta).follow);
    let pool = PoolNode::start(pool_node.clone(), &config).unwrap();
    stream_a.say(Say::Stored(keys(0..4)));
    stream_b.say(Say::Stored(keys(2..6)));
    // The keys both hold are pulled once per tenant: 4 + 4.
    let s = wait_for(&pool, "both tenants' blocks pulled", |s| {
        s.pulled_blocks == 8
    });
    assert_eq!(s.pull_failures, 0, "{s:?}");
    let all = keys(0..6);
    assert_eq!(
        pool_node.contains_for(alpha.id(), &all).unwrap(),
        [true, true, true, true, false, false]
    );
    assert_eq!(
        pool_node.contains_for(beta.id(), &all).unwrap(),
        [false, false, true, true, true, true]
    );
    // Announced again: nothing pulled again (each tenant already holds its own).
    stream_a.say(Say::Stored(keys(0..4)));
    stream_b.say(Say::Stored(keys(2..6)));
    let s = wait_for(&pool, "the second batches", |s| s.batches == 4);
    assert_eq!(s.pulled_blocks, 8, "{s:?}");

    // Each tenant's reader finds at the pool exactly its tenant's blocks, byte-exact.
    for (reader, want) in [(&alpha_reader, 0..4), (&beta_reader, 2..6)] {
        let r = reader.request(pool_node.id(), "read").unwrap();
        let found = r.lookup(&all, Duration::from_secs(10)).unwrap();
        let hits: Vec<u64> = (0..6)
            .filter(|i| found[*i as usize] == LookupResult::Hit)
            .collect();
        assert_eq!(hits, want.clone().collect::<Vec<_>>(), "{}", reader.id());
        r.fetch(&keys(want.clone()), Duration::from_secs(10))
            .unwrap();
        r.finish();
        assert_holds(reader, &keys(want));
    }
    pool.shutdown();
}

#[test]
fn a_pool_with_tenants_refuses_to_follow_an_engine_of_no_tenant() {
    let (alpha, other) = (node("pool-t2-a", 4), node("pool-t2-o", 4));
    let mut spec = NodeConfig::builder("pool-t2-p")
        .plane(PlaneKind::Tcp)
        .num_blocks(16)
        .block_len(LEN)
        .build()
        .unwrap();
    spec.spec.tenants = TenantRules::parse(None, &[format!("alpha={}", alpha.id())]).unwrap();
    let pool_node = Arc::new(Node::start(spec).unwrap());
    let (stream_a, stream_o) = (Stream::start(), Stream::start());
    let mut config = follow(&stream_a, &alpha);
    config.follow.extend(follow(&stream_o, &other).follow);
    let Err(e) = PoolNode::start(pool_node, &config) else {
        panic!("a pool following an engine of no tenant started");
    };
    assert!(
        matches!(&e, kvpeer::pool_node::PoolNodeError::EngineOfNoTenant(p) if p == other.id()),
        "{e}"
    );
    assert!(e.to_string().contains("no one tenant's"), "{e}");
}

/// A pool node of `blocks` blocks in memory over a disk tier in `dir` holding up to
/// `disk_blocks`.
fn node_on_disk(tag: &str, blocks: u64, dir: &std::path::Path, disk_blocks: u64) -> Node {
    let mut config = NodeConfig::builder(tag)
        .plane(PlaneKind::Tcp)
        .num_blocks(blocks)
        .block_len(LEN)
        .build()
        .unwrap();
    config.spec.disk = Some(kvpeer_store::disk::DiskConfig {
        dir: dir.to_path_buf(),
        capacity: 4096 + disk_blocks * (LEN + 4096),
        threads: 4,
        promote: kvpeer_store::disk::Promote::Hot,
        engine: kvpeer_store::disk::DiskEngine::Auto,
        tenant_names: Vec::new(),
        default_tenant: String::new(),
    });
    Node::start(config).unwrap()
}

#[test]
fn a_pool_restarted_on_its_disk_serves_what_it_held_republishes_it_and_pulls_nothing_again() {
    let dir = std::env::temp_dir().join(format!("kvpeer-pool-disk-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let engine = engine("pool-d-e", 24);
    let stream = Stream::start();
    stream.say(Say::Stored(keys(0..24)));
    let publish = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let publish_replay = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let config = PoolConfig {
        publish: Some(publish),
        publish_replay: Some(publish_replay),
        ..follow(&stream, &engine)
    };
    // Memory for 8 blocks, disk for 32: 24 pulled, most of them only on disk.
    let pool_node = Arc::new(node_on_disk("pool-d-p1", 8, &dir, 32));
    let pool = PoolNode::start(pool_node.clone(), &config).unwrap();
    let s = wait_for(&pool, "24 pulled", |s| s.pulled_blocks == 24);
    assert_eq!(s.pull_failures, 0);
    let deadline = Instant::now() + Duration::from_secs(10);
    while pool_node.stats().unwrap().store.disk.unwrap().demotions < 24 {
        assert!(
            Instant::now() < deadline,
            "{:?}",
            pool_node.stats().unwrap().store
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    pool.shutdown();
    pool_node.shutdown(Duration::from_secs(3));
    drop(pool_node);

    // Started again on the same disk: the engine's stream is replayed on connect, and every
    // key it names is held already.
    let pool_node = Arc::new(node_on_disk("pool-d-p2", 8, &dir, 32));
    let disk = pool_node.stats().unwrap().store.disk.unwrap();
    assert_eq!(disk.recovered_blocks, 24, "{disk:?}");
    let pool = PoolNode::start(pool_node.clone(), &config).unwrap();
    let s = wait_for(&pool, "the replay judged", |s| s.already_held == 24);
    assert_eq!((s.pulled_blocks, s.pull_requests), (0, 0), "{s:?}");
    // Its own stream says it holds all 24 again (a router that lost it re-indexes).
    let _ = wait_for(&pool, "published", |s| s.published_batches >= 1);
    let mut stored: Vec<OffloadKey> = replayed_until(publish, publish_replay, |_| true)
        .iter()
        .filter_map(|e| match key_event(e) {
            KeyEvent::Stored(k) => Some(k),
            _ => None,
        })
        .collect();
    stored.sort();
    stored.dedup();
    let mut want = keys(0..24);
    want.sort();
    assert_eq!(stored, want);
    // And serves every one byte-exact, from disk through its 8 blocks of memory.
    let reader = node("pool-d-r", 32);
    for chunk in keys(0..24).chunks(6) {
        let r = reader.request(pool_node.id(), "disk-read").unwrap();
        let found = r.lookup(chunk, Duration::from_secs(10)).unwrap();
        assert!(found.iter().all(|f| *f == LookupResult::Hit), "{found:?}");
        r.fetch(chunk, Duration::from_secs(10)).unwrap();
        r.finish();
    }
    assert_holds(&reader, &keys(0..24));
    assert_eq!(pool.stats().pulled_blocks, 0);
    pool.shutdown();
    pool_node.shutdown(Duration::from_secs(3));
    drop(pool_node);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A pool restarted on its disk announces the chunks it holds described as before (tokens,
/// parents, every block hash: what Dynamo's indexer needs), from the descriptions it kept
/// beside its disk tier, with no engine announcing them again (the restarted pool follows
/// none here).
#[test]
fn a_pool_restarted_on_its_disk_describes_its_chunks_as_before() {
    let dir = std::env::temp_dir().join(format!("kvpeer-pool-desc-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let engine = engine("pool-dd-e", 5);
    let stream = Stream::start();
    announce_prompt(&stream);
    let publish = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let publish_replay = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let publishing = PoolConfig {
        publish: Some(publish),
        publish_replay: Some(publish_replay),
        ..PoolConfig::default()
    };
    let pool_node = Arc::new(node_on_disk("pool-dd-p1", 16, &dir, 32));
    let pool = PoolNode::start(
        pool_node.clone(),
        &PoolConfig {
            publish: Some(publish),
            publish_replay: Some(publish_replay),
            ..follow(&stream, &engine)
        },
    )
    .unwrap();
    wait_for(&pool, "5 pulled", |s| s.pulled_blocks == 5);
    wait_for(&pool, "5 published", |s| {
        s.published_described + s.published_undescribed[0] == 5
    });
    pool.shutdown();
    pool_node.shutdown(Duration::from_secs(3));
    drop(pool_node);

    let pool_node = Arc::new(node_on_disk("pool-dd-p2", 16, &dir, 32));
    let pool = PoolNode::start(pool_node.clone(), &publishing).unwrap();
    let s = wait_for(&pool, "the republish", |s| {
        s.published_described + s.published_undescribed[0] == 5
    });
    assert_eq!(
        (s.published_described, s.published_undescribed[0]),
        (4, 1),
        "{s:?}"
    );
    let mut stores: Vec<BlockStored> = replayed_until(publish, publish_replay, |_| true)
        .into_iter()
        .filter_map(|e| match e {
            KvEvent::Stored(s) => Some(s),
            _ => None,
        })
        .collect();
    assert_eq!(stores.len(), 5, "{stores:?}");
    let key_hash = |c: u64| BlockHash::Bytes(block_hash(c, true));
    for c in 0..4u64 {
        let at = stores
            .iter()
            .position(|s| s.block_hashes.last() == Some(&key_hash(c)))
            .unwrap_or_else(|| panic!("chunk {c} not announced: {stores:?}"));
        let s = stores.remove(at);
        assert_eq!(
            s.block_hashes,
            vec![BlockHash::Bytes(block_hash(c, false)), key_hash(c)]
        );
        assert_eq!(
            s.parent_block_hash,
            c.checked_sub(1).map(key_hash),
            "chunk {c}"
        );
        assert_eq!(s.token_ids, tokens_of(c));
        assert_eq!(s.block_size, 16);
    }
    assert!(
        stores[0].token_ids.is_empty(),
        "chunk 4 was never described"
    );
    pool.shutdown();
    pool_node.shutdown(Duration::from_secs(3));
    drop(pool_node);
    let _ = std::fs::remove_dir_all(&dir);
}
