//! A test that plays an inference engine embedding kvpeer: the engine owns its blocks, its
//! key index and its pins, drives an [`EngineNode`] from its own thread (no runtime thread),
//! and answers peers' lookups later, in its own "step", through the [`EngineLink`]. A stock
//! runtime-thread [`Node`] is the peer on the other side.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpeer::engine::{
    Answer, BlockBusy, BlockIndex, EngineEvent, EngineNode, EnginePin, JobId, KvRequestId, Pool,
    RequestRoles, SharedEngine,
};
use kvpeer::node::build::NodeSpec;
use kvpeer::{synthetic, LookupResult, Node, NodeConfig, OffloadKey, PlaneKind};

const WAIT: Duration = Duration::from_secs(10);

/// Blocks in an engine's pool here (its block length is the nodes' default).
const ENGINE_BLOCKS: u64 = 64;
/// The engine's row stride: a block and then 4 KiB that are not the pool's.
const GAP: u64 = 4096;

/// An engine's own memory, as vLLM registers its KV region: `ENGINE_BLOCKS` rows of
/// `block_len + GAP` bytes, allocated by the engine (here a `Vec`), not by kvpeer.
fn engine_memory(block_len: u64) -> Pool {
    let stride = block_len + GAP;
    let mut memory = vec![0u8; (ENGINE_BLOCKS * stride) as usize];
    let base = NonNull::new(memory.as_mut_ptr()).unwrap();
    // SAFETY: the Vec's buffer stays put and alive until the pool drops `keep_alive` (which
    // owns the Vec), and nothing else reaches it meanwhile.
    unsafe {
        Pool::external(
            base,
            ENGINE_BLOCKS,
            block_len,
            stride,
            Some(Box::new(memory)),
        )
    }
    .unwrap()
}

/// An engine's node over its own memory, with the tcp plane (a shared-memory plane needs a
/// named object; external memory is for tcp and nixl).
fn engine_node(tag: &str) -> EngineNode {
    let spec = NodeSpec {
        plane: PlaneKind::Tcp,
        ..NodeConfig::local(tag).spec
    };
    EngineNode::build(&spec, engine_memory(spec.block_len)).unwrap()
}

/// What the engine's thread saw, for the test to check after it stopped.
#[derive(Debug, Default)]
struct EngineLog {
    queries: usize,
    /// Pins handed out and not yet back, per block.
    pins: HashMap<u64, u32>,
    released_sent: usize,
    released_unused: usize,
    /// Questions and pins the node still held when the engine stopped.
    outstanding: (usize, usize),
    /// Writes into a block pinned for a peer, refused.
    writes_refused_while_pinned: u32,
}

/// Runs an engine on its own thread: `held` keys in blocks 10, 11, ... of its pool. Its step
/// drives the node, then (every 20 ms, like an engine's forward pass) answers what peers
/// asked, and takes back released pins.
fn run_engine(
    mut node: EngineNode,
    held: Vec<OffloadKey>,
    stop: Arc<AtomicBool>,
    released: Arc<AtomicUsize>,
) -> std::thread::JoinHandle<EngineLog> {
    std::thread::spawn(move || {
        let block_len = node.block_len() as usize;
        let mut index = HashMap::new();
        for (i, key) in held.iter().enumerate() {
            let block = 10 + i as u64;
            node.write_block(BlockIndex::new(block), &synthetic::content(key, block_len))
                .unwrap();
            index.insert(key.clone(), block);
        }
        let link = node.link();
        let mut log = EngineLog::default();
        let mut next_step = Instant::now();
        let mut next_pin = 0u64;
        let mut pin_blocks = HashMap::new();
        while !stop.load(Ordering::SeqCst) {
            node.drive(Duration::from_millis(5));
            if Instant::now() < next_step {
                continue;
            }
            next_step = Instant::now() + Duration::from_millis(20);
            for q in link.take_queries() {
                log.queries += 1;
                let answer = match index.get(&q.key) {
                    Some(&block) => {
                        next_pin += 1;
                        pin_blocks.insert(next_pin, block);
                        *log.pins.entry(block).or_default() += 1;
                        Answer::Hit {
                            block: BlockIndex::new(block),
                            pin: EnginePin(next_pin),
                        }
                    }
                    None => Answer::Miss,
                };
                if !link.answer(q.id, answer) {
                    if let Answer::Hit { pin, .. } = answer {
                        let block = pin_blocks.remove(&pin.0).unwrap();
                        *log.pins.get_mut(&block).unwrap() -= 1;
                    }
                } else if let Answer::Hit { block, .. } = answer {
                    // Pinned for a peer: the engine cannot overwrite it until it comes back.
                    let refused = node.write_block(block, &vec![0xFF; block_len]);
                    log.writes_refused_while_pinned += u32::from(refused.is_err());
                }
            }
            for r in link.take_releases() {
                let block = pin_blocks
                    .remove(&r.pin.0)
                    .expect("each pin comes back once");
                *log.pins.get_mut(&block).unwrap() -= 1;
                released.fetch_add(1, Ordering::SeqCst);
                if r.sent {
                    log.released_sent += 1;
                } else {
                    log.released_unused += 1;
                }
            }
        }
        log.outstanding = node.outstanding();
        node.shutdown(Duration::from_secs(1));
        log
    })
}

#[test]
fn an_engine_answers_lookups_from_its_own_thread_and_a_peer_fetches_its_blocks() {
    let engine = engine_node("eng-producer");
    let engine_id = engine.id().clone();
    let held: Vec<OffloadKey> = (0..6).map(synthetic::key).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let released = Arc::new(AtomicUsize::new(0));
    let thread = run_engine(engine, held.clone(), stop.clone(), released.clone());

    let consumer = Node::start(NodeConfig::local("eng-consumer")).unwrap();
    let block_len = consumer.config().block_len as usize;
    let mut asked = held[..4].to_vec();
    asked.push(synthetic::key(99)); // not held
    let req = consumer.request(&engine_id, "req-1").unwrap();
    let found = req.lookup(&asked, WAIT).unwrap();
    assert_eq!(
        found,
        [
            LookupResult::Hit,
            LookupResult::Hit,
            LookupResult::Hit,
            LookupResult::Hit,
            LookupResult::Miss
        ]
    );
    req.fetch(&asked[..4], WAIT).unwrap();
    req.finish();
    for key in &asked[..4] {
        assert_eq!(
            consumer.read(key),
            Some(synthetic::content(key, block_len)),
            "byte-exact from the engine's block"
        );
    }
    assert_eq!(consumer.read(&asked[4]), None);

    // Every pin comes back once its write completed: wait (bounded) for the engine to see it.
    let deadline = Instant::now() + WAIT;
    while released.load(Ordering::SeqCst) < 4 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    stop.store(true, Ordering::SeqCst);
    let log = thread.join().unwrap();
    assert_eq!(log.queries, 5, "one question per key asked");
    assert_eq!(
        log.released_sent, 4,
        "the four pins came back after their writes"
    );
    assert_eq!(log.released_unused, 0);
    assert!(
        log.pins.values().all(|&n| n == 0),
        "no pin left: {:?}",
        log.pins
    );
    assert_eq!(log.outstanding, (0, 0));
    assert_eq!(
        log.writes_refused_while_pinned, 4,
        "no write into a block a peer's write may be reading (the fetched bytes above are intact)"
    );
    consumer.shutdown(Duration::from_secs(1));
}

/// A runtime-thread node on the tcp plane holding `keys` (their synthetic contents), and its
/// block length.
fn producer_holding(tag: &str, keys: &[OffloadKey]) -> (Node, usize) {
    let producer = Node::start(
        NodeConfig::builder(tag)
            .plane(PlaneKind::Tcp)
            .build()
            .unwrap(),
    )
    .unwrap();
    let block_len = producer.config().block_len as usize;
    producer
        .store(
            keys.iter()
                .map(|k| (k.clone(), synthetic::content(k, block_len)))
                .collect(),
        )
        .unwrap();
    (producer, block_len)
}

#[test]
fn an_engine_driven_without_a_runtime_thread_loads_into_blocks_it_chose() {
    let keys: Vec<OffloadKey> = (0..3).map(synthetic::key).collect();
    let (producer, block_len) = producer_holding("eng-src", &keys);

    let mut engine = engine_node("eng-consumer2");
    let req = engine.new_request(KvRequestId::from("req-e"), producer.id().clone());
    let mut asked = keys.clone();
    asked.push(synthetic::key(42)); // not held
    engine.lookup(&req, asked.clone());
    let found = drive_until(&mut engine, |e| matches!(e, EngineEvent::LookedUp { .. }));
    assert_eq!(
        found,
        EngineEvent::LookedUp {
            kv_request_id: KvRequestId::from("req-e"),
            results: vec![
                LookupResult::Hit,
                LookupResult::Hit,
                LookupResult::Hit,
                LookupResult::Miss
            ],
        }
    );
    // The engine's own choice of blocks, out of order.
    let blocks = blocks(&[7, 3, 11]);
    engine
        .load(JobId::new(5), &req, keys.clone(), blocks.clone())
        .unwrap();
    let loaded = drive_until(&mut engine, |e| matches!(e, EngineEvent::Loaded { .. }));
    assert_eq!(
        loaded,
        EngineEvent::Loaded {
            job: JobId::new(5),
            success: true
        }
    );
    engine.finish(&req);
    for (key, block) in keys.iter().zip(&blocks) {
        assert_eq!(read(&engine, *block), synthetic::content(key, block_len));
    }
    for untouched in [0u64, 1, 2, 4, 5, 6, 8, 9, 10, 12] {
        assert!(
            read(&engine, BlockIndex::new(untouched))
                .iter()
                .all(|&b| b == 0),
            "block {untouched} was not the load's"
        );
    }
    assert!(engine
        .load(JobId::new(1 << 62), &req, vec![], vec![])
        .is_err());
    engine.step(Instant::now());
    assert_eq!(
        engine.poll_event(),
        None,
        "every event consumed, none twice"
    );
    assert_eq!(engine.outstanding(), (0, 0));
    engine.shutdown(Duration::from_secs(1));
    producer.shutdown(Duration::from_secs(1));
}

/// Threads of this process named as the engine's I/O thread (`kvpeer-engine-io`, cut to the
/// kernel's 15 characters), once there are `want` of them (a new thread names itself after it
/// started), or what there are after a while.
fn io_threads(want: usize) -> usize {
    let count = || {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
            .filter(|name| name.trim_end() == "kvpeer-engine-i")
            .count()
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    while count() != want && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    count()
}

/// Waits for an event of the shared engine (its I/O thread steps it; nothing here does).
fn wait_shared(engine: &SharedEngine, want: impl Fn(&EngineEvent) -> bool) -> EngineEvent {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        for e in engine.poll(Duration::from_millis(20)).unwrap() {
            if want(&e) {
                return e;
            }
        }
    }
    panic!("no such event within {WAIT:?}");
}

/// With its I/O thread ([`SharedEngine`]), an engine that never steps its node looks up and
/// loads from a peer byte-exact: the lookup, the fetch and the load's end move on the node's
/// own thread, the engine only hands work over and takes events. `stop` ends that thread
/// before handing the node back, and so does dropping the shared engine.
#[test]
fn a_shared_engine_loads_without_being_stepped_and_its_io_thread_ends_with_it() {
    let keys: Vec<OffloadKey> = (0..4).map(|i| synthetic::key(100 + i)).collect();
    let (producer, block_len) = producer_holding("eng-shared-src", &keys);
    let before = io_threads(0);
    let shared = SharedEngine::new(engine_node("eng-shared"), true).unwrap();
    assert!(shared.has_io_thread());
    assert_eq!(io_threads(before + 1), before + 1);
    let req = shared
        .with(|node| {
            let req = node.new_request(KvRequestId::from("req-shared"), producer.id().clone());
            node.lookup(&req, keys.clone());
            req
        })
        .unwrap();
    let found = wait_shared(&shared, |e| matches!(e, EngineEvent::LookedUp { .. }));
    assert_eq!(
        found,
        EngineEvent::LookedUp {
            kv_request_id: KvRequestId::from("req-shared"),
            results: vec![LookupResult::Hit; keys.len()],
        }
    );
    let blocks = blocks(&[9, 2, 30, 17]);
    shared
        .with(|node| node.load(JobId::new(7), &req, keys.clone(), blocks.clone()))
        .unwrap()
        .unwrap();
    let loaded = wait_shared(&shared, |e| matches!(e, EngineEvent::Loaded { .. }));
    assert_eq!(
        loaded,
        EngineEvent::Loaded {
            job: JobId::new(7),
            success: true
        }
    );
    let node = shared.stop().expect("the node comes back once");
    assert!(shared.stop().is_none() && shared.poll(Duration::ZERO).is_none());
    assert_eq!(io_threads(before), before, "stop ended the I/O thread");
    for (key, block) in keys.iter().zip(&blocks) {
        assert_eq!(read(&node, *block), synthetic::content(key, block_len));
    }
    node.shutdown(Duration::from_secs(1));

    let dropped = SharedEngine::new(engine_node("eng-shared-drop"), true).unwrap();
    assert_eq!(io_threads(before + 1), before + 1);
    drop(dropped);
    assert_eq!(
        io_threads(before),
        before,
        "dropping it ended the I/O thread"
    );
    producer.shutdown(Duration::from_secs(1));
}

fn drive_until(engine: &mut EngineNode, want: impl Fn(&EngineEvent) -> bool) -> EngineEvent {
    let deadline = Instant::now() + WAIT;
    while Instant::now() < deadline {
        engine.drive(Duration::from_millis(5));
        while let Some(e) = engine.poll_event() {
            if want(&e) {
                return e;
            }
        }
    }
    panic!("no such event within {WAIT:?}");
}

/// PD between two engines, both driven from this one thread: the producer offers blocks it
/// pinned for a request, the consumer fetches them without a lookup into blocks it chose, and
/// the producer hears when it may unpin.
#[test]
fn two_engines_do_prefill_decode_from_one_thread() {
    let mut producer = engine_node("eng-pd-p");
    let mut consumer = engine_node("eng-pd-c");
    let block_len = producer.block_len() as usize;
    let keys: Vec<OffloadKey> = (0..3).map(|i| synthetic::key(100 + i)).collect();
    for (key, block) in keys.iter().zip([20u64, 21, 22]) {
        producer
            .write_block(BlockIndex::new(block), &synthetic::content(key, block_len))
            .unwrap();
    }
    let id = KvRequestId::from("pd-1");
    let offered = producer.new_request_with(id.clone(), RequestRoles::decoder());
    producer
        .store(JobId::new(9), &offered, keys.clone(), blocks(&[20, 21, 22]))
        .unwrap();
    assert!(
        matches!(
            producer.write_block(BlockIndex::new(21), &vec![0; block_len]),
            Err(BlockBusy::PeerRead)
        ),
        "a block offered to a peer is not writable until its store ends"
    );
    let fetching =
        consumer.new_request_with(id.clone(), RequestRoles::prefiller(producer.id().clone()));
    consumer
        .load(JobId::new(3), &fetching, keys.clone(), blocks(&[2, 0, 1]))
        .unwrap();

    let deadline = Instant::now() + WAIT;
    let (mut loaded, mut stored) = (None, None);
    while (loaded.is_none() || stored.is_none()) && Instant::now() < deadline {
        producer.drive(Duration::from_millis(2));
        consumer.drive(Duration::from_millis(2));
        while let Some(e) = consumer.poll_event() {
            if let EngineEvent::Loaded { job, success } = e {
                loaded = Some((job, success));
            }
        }
        while let Some(e) = producer.poll_event() {
            if let EngineEvent::Stored { job, success } = e {
                stored = Some((job, success));
            }
        }
    }
    assert_eq!(loaded, Some((JobId::new(3), true)));
    assert_eq!(
        stored,
        Some((JobId::new(9), true)),
        "the producer may unpin"
    );
    for (key, block) in keys.iter().zip([2u64, 0, 1]) {
        assert_eq!(
            read(&consumer, BlockIndex::new(block)),
            synthetic::content(key, block_len)
        );
    }
    assert!(read(&consumer, BlockIndex::new(3)).iter().all(|&b| b == 0));
    assert!(
        producer
            .write_block(BlockIndex::new(21), &vec![0; block_len])
            .is_ok(),
        "writable again once the store ended"
    );
    consumer.finish(&fetching);
    producer.finish(&offered);
    assert_eq!(producer.outstanding(), (0, 0));
    for engine in [&mut producer, &mut consumer] {
        engine.step(Instant::now());
        assert_eq!(
            engine.poll_event(),
            None,
            "every event consumed, none twice"
        );
    }
    consumer.shutdown(Duration::from_secs(1));
    producer.shutdown(Duration::from_secs(1));
}

fn blocks(indexes: &[u64]) -> Vec<BlockIndex> {
    indexes.iter().map(|&i| BlockIndex::new(i)).collect()
}

fn read(engine: &EngineNode, block: BlockIndex) -> Vec<u8> {
    let mut out = vec![0u8; engine.block_len() as usize];
    engine.read_block(block, &mut out).unwrap();
    out
}

/// A lookup still waiting when the engine finishes its request is answered MISS at once,
/// exactly once, and the finished request is not asked about again.
#[test]
fn finishing_a_request_answers_its_waiting_lookup_miss_once() {
    // A producer that accepts the connection and never says a word.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_id = kvpeer::PeerId::new(silent.local_addr().unwrap().to_string());
    let mut engine = engine_node("eng-finish");
    let req = engine.new_request(KvRequestId::from("req-f"), silent_id);
    engine.lookup(&req, vec![synthetic::key(1), synthetic::key(2)]);
    engine.drive(Duration::from_millis(20));
    assert_eq!(engine.poll_event(), None, "nobody answered yet");
    engine.finish(&req);
    assert_eq!(
        engine.poll_event(),
        Some(EngineEvent::LookedUp {
            kv_request_id: KvRequestId::from("req-f"),
            results: vec![LookupResult::Miss, LookupResult::Miss],
        })
    );
    for _ in 0..10 {
        engine.drive(Duration::from_millis(5));
    }
    assert_eq!(engine.poll_event(), None, "answered once");
    engine.shutdown(Duration::from_millis(100));
}
