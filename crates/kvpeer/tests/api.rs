//! The public API (`kvpeer::Node`) end to end on 127.0.0.1: two nodes, each on its runtime
//! thread; store, lookup with hits and misses, fetch, read, finish, stats; errors for misuse
//! and for a peer that never answers; graceful shutdown leaves nothing pinned.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use kvpeer::{synthetic, LookupResult, Node, NodeConfig, NodeError, PeerId, PlaneKind};

mod common;
use common::node::store;

const WAIT: Duration = Duration::from_secs(10);

fn pair(tag: &str, plane: PlaneKind) -> (Node, Node) {
    let mut p = NodeConfig::local(&format!("api-{tag}-p"));
    let mut c = NodeConfig::local(&format!("api-{tag}-c"));
    p.spec.plane = plane;
    c.spec.plane = plane;
    (Node::start(p).unwrap(), Node::start(c).unwrap())
}

fn share(tag: &str, plane: PlaneKind) {
    let (producer, consumer) = pair(tag, plane);
    let len = producer.config().block_len as usize;
    let keys: Vec<_> = (0..10).map(synthetic::key).collect();
    store(&producer, &keys[..6]);

    let r1 = consumer.request(producer.id(), "r1").unwrap();
    assert_eq!(r1.id().as_str(), "r1");
    assert_eq!(r1.peer(), producer.id());
    let found = r1.lookup(&keys, WAIT).unwrap();
    assert_eq!(found[..6], [LookupResult::Hit; 6]);
    assert_eq!(found[6..], [LookupResult::Miss; 4]);
    r1.fetch(&keys[..6], WAIT).unwrap();
    for k in &keys[..6] {
        assert_eq!(consumer.read(k), Some(synthetic::content(k, len)));
    }
    assert_eq!(consumer.read(&keys[7]), None);
    r1.finish();

    // A request that misses everything, finished without a fetch (terminal empty fetch).
    let r2 = consumer.request(producer.id(), "r2").unwrap();
    let found = r2.lookup(&keys[8..], WAIT).unwrap();
    assert_eq!(found, [LookupResult::Miss; 2]);
    r2.finish();

    // The producer lets go of everything it held for the consumer.
    let deadline = Instant::now() + WAIT;
    loop {
        let stats = producer.stats().unwrap();
        let (core, store) = (stats.core, stats.store);
        if core.server_requests == 0 && store.pinned == 0 {
            assert_eq!(store.jobs, 0);
            break;
        }
        assert!(Instant::now() < deadline, "{core:?} {store:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let stats = consumer.stats().unwrap();
    let (core, store) = (stats.core, stats.store);
    assert_eq!((core.client_requests, store.writing), (0, 0), "{core:?}");
    assert_eq!(store.ready, 6);
    // The running totals saw it all: 12 keys looked up, 6 held, one fetch of 6 blocks.
    let c = stats.counters;
    assert_eq!(
        (c.lookup_keys_sent, c.lookup_hits_received),
        (12, 6),
        "{c:?}"
    );
    assert_eq!(
        (c.fetches_sent, c.fetch_blocks_sent, c.loads_ok),
        (1, 6, 1),
        "{c:?}"
    );
    assert_eq!(stats.bytes_fetched, 6 * len as u64);
    assert_eq!(stats.lookup_latency.total(), 2);
    assert_eq!(stats.fetch_latency.total(), 1);
    let p = producer.stats().unwrap().counters;
    assert_eq!(
        (p.lookup_hits_served, p.lookup_misses_served),
        (6, 6),
        "{p:?}"
    );
    assert_eq!(
        (p.fetches_served, p.fetch_blocks_served, p.transfers_ok),
        (1, 6, 1),
        "{p:?}"
    );
    consumer.shutdown(Duration::from_secs(3));
    producer.shutdown(Duration::from_secs(3));
    assert!(matches!(consumer.stats(), Err(NodeError::ShutDown)));
}

#[test]
fn two_nodes_share_blocks_through_the_api_over_tcp() {
    share("tcp", PlaneKind::Tcp);
}

#[test]
fn two_nodes_share_blocks_through_the_api_with_both_planes() {
    share("both", PlaneKind::Both);
}

#[test]
fn misuse_and_silent_peers_get_clear_errors_in_bounded_time() {
    let node = Node::start(NodeConfig::local("api-errors")).unwrap();
    let key = synthetic::key(1);
    let idle = PeerId::new("127.0.0.1:1");
    let early = node.request(&idle, "never-looked-up").unwrap();
    assert!(matches!(
        early.fetch(std::slice::from_ref(&key), WAIT),
        Err(NodeError::FetchBeforeLookup(id)) if id.as_str() == "never-looked-up"
    ));
    // One request per id at a time: a second handle for it can neither use it nor, dropped,
    // finish it; once the first is finished, the id is free again.
    let second = node.request(&idle, "never-looked-up").unwrap();
    assert!(matches!(
        second.lookup(std::slice::from_ref(&key), WAIT),
        Err(NodeError::RequestOpen(id)) if id.as_str() == "never-looked-up"
    ));
    drop(second);
    assert!(
        early.lookup(std::slice::from_ref(&key), WAIT).is_ok(),
        "the second handle's drop left the first request open, its own"
    );
    early.finish();
    let again = node.request(&idle, "never-looked-up").unwrap();
    assert!(matches!(
        again.fetch(std::slice::from_ref(&key), WAIT),
        Err(NodeError::FetchBeforeLookup(_))
    ));
    again.finish();
    assert!(matches!(
        node.store(vec![(key.clone(), vec![0u8; 3])]),
        Err(NodeError::Store(_))
    ));
    // Nobody listens there: the connection fails, so the keys answer MISS (the engine computes
    // them itself) well before the timeout.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = PeerId::new(nobody.local_addr().unwrap().to_string());
    drop(nobody);
    let t = Instant::now();
    let gone_req = node.request(&gone, "r").unwrap();
    let r = gone_req.lookup(std::slice::from_ref(&key), Duration::from_secs(5));
    assert!(matches!(&r, Ok(v) if *v == [LookupResult::Miss]), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    // A peer that accepts the connection and never speaks: the call gives up at its timeout.
    let mute = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent = PeerId::new(mute.local_addr().unwrap().to_string());
    let silent_req = node.request(&silent, "s").unwrap();
    let t = Instant::now();
    let r = silent_req.lookup(&[key], Duration::from_millis(300));
    assert!(matches!(r, Err(NodeError::Timeout("lookup"))), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    silent_req.finish();
    drop(mute);
    gone_req.finish();
    node.shutdown(Duration::from_secs(1));
}

#[test]
fn the_allowlist_refuses_peers_both_ways_and_never_dials_them() {
    use kvpeer::node::allow::Allowlist;
    let mut strict = NodeConfig::local("api-allow-strict");
    // Only some other node may talk to it.
    strict.spec.allowlist = Allowlist::parse(&["127.0.0.1:1", "10.0.0.0/8"]).unwrap();
    let strict = Node::start(strict).unwrap();
    let open = Node::start(NodeConfig::local("api-allow-open")).unwrap();
    let key = synthetic::key(1);
    let len = open.config().block_len as usize;
    open.store(vec![(key.clone(), synthetic::content(&key, len))])
        .unwrap();

    // Outbound: the strict node will not dial a peer outside its list; the keys answer MISS.
    let t = Instant::now();
    let out = strict.request(open.id(), "out").unwrap();
    let r = out.lookup(std::slice::from_ref(&key), WAIT);
    assert!(matches!(&r, Ok(v) if *v == [LookupResult::Miss]), "{r:?}");
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    out.finish();

    // Inbound: the open node's connect is dropped before the protocol sees it and its
    // connection closed; no session opens and nothing is dialed back, so the open node's
    // lookup fails over to MISS as soon as its connection is gone.
    let inbound = open.request(strict.id(), "in").unwrap();
    let r = inbound.lookup(&[key], Duration::from_secs(5));
    assert!(matches!(&r, Ok(v) if *v == [LookupResult::Miss]), "{r:?}");
    inbound.finish();
    let stats = strict.stats().unwrap();
    assert_eq!(stats.core.sessions, 0, "{:?}", stats.core);
    assert_eq!(
        stats.refused_peers, 1,
        "the open node, refused both ways, logged once"
    );
    strict.shutdown(Duration::from_secs(1));
    open.shutdown(Duration::from_secs(1));
}

#[test]
fn a_graceful_shutdown_mid_fetch_finishes_the_write_and_loses_no_block() {
    let mut p = NodeConfig::local("api-drain-p");
    p.spec.plane = PlaneKind::Tcp;
    // 64 blocks of 64 KiB at 8 MB/s: the write takes about half a second.
    p.spec.tcp_max_write_rate = Some(8_000_000);
    let mut c = NodeConfig::local("api-drain-c");
    c.spec.plane = PlaneKind::Tcp;
    let (producer, consumer) = (Node::start(p).unwrap(), Node::start(c).unwrap());
    let len = producer.config().block_len as usize;
    let keys: Vec<_> = (0..64).map(synthetic::key).collect();
    store(&producer, &keys);
    let req = consumer.request(producer.id(), "r").unwrap();
    let found = req.lookup(&keys, WAIT).unwrap();
    assert!(found.iter().all(|f| *f == LookupResult::Hit));

    let fetched = std::thread::scope(|s| {
        let fetch = s.spawn(|| req.fetch(&keys, WAIT));
        // Wait until the producer is writing (bounded), then shut it down mid-write: it drains
        // (up to 5 s) before it disconnects.
        let deadline = Instant::now() + WAIT;
        while producer.stats().unwrap().core.inflight == 0 {
            assert!(Instant::now() < deadline, "the write never started");
            std::thread::sleep(Duration::from_millis(2));
        }
        // Submitted is not yet running: the drain cancels writes still queued (their loads fail
        // cleanly) and waits for running ones. Give the tcp writer thread time to pick it up;
        // the paced write still has most of its half second to go.
        std::thread::sleep(Duration::from_millis(100));
        producer.shutdown(Duration::from_secs(5));
        fetch.join().unwrap()
    });
    fetched.expect("the inflight write finished before the producer left");
    for k in &keys {
        assert_eq!(consumer.read(k), Some(synthetic::content(k, len)));
    }
    req.finish();
    let stats = consumer.stats().unwrap();
    let (core, store) = (stats.core, stats.store);
    assert_eq!(
        (store.pinned, store.writing, store.jobs),
        (0, 0, 0),
        "{store:?}"
    );
    assert_eq!((core.client_requests, core.inflight), (0, 0), "{core:?}");
    consumer.shutdown(Duration::from_secs(1));
}

#[test]
fn the_authenticated_handshake_admits_only_peers_with_the_secret() {
    let node = |tag: &str, secret: Option<&str>| {
        let mut c = NodeConfig::local(tag);
        c.spec.auth_secret = secret.map(|s| s.as_bytes().to_vec().into());
        Node::start(c).unwrap()
    };
    let secret = "sixteen+ bytes of shared secret";
    let producer = node("api-auth-p", Some(secret));
    let key = synthetic::key(3);
    let len = producer.config().block_len as usize;
    producer
        .store(vec![(key.clone(), synthetic::content(&key, len))])
        .unwrap();
    let keys = std::slice::from_ref(&key);

    // Same secret: the handshake completes and blocks flow.
    let friend = node("api-auth-friend", Some(secret));
    let a = friend.request(producer.id(), "a").unwrap();
    assert_eq!(a.lookup(keys, WAIT).unwrap(), [LookupResult::Hit]);
    a.fetch(keys, WAIT).unwrap();
    assert_eq!(friend.read(&key), Some(synthetic::content(&key, len)));
    a.finish();

    // No secret (a stock vLLM peer, say), or another one: refused, nothing opens.
    for (tag, secret) in [
        ("api-auth-none", None),
        ("api-auth-other", Some("a different secret, long enough")),
    ] {
        let stranger = node(tag, secret);
        let b = stranger.request(producer.id(), "b").unwrap();
        let r = b.lookup(keys, Duration::from_secs(5));
        assert!(
            matches!(&r, Ok(v) if *v == [LookupResult::Miss]),
            "{tag}: refused and its connection closed, so it misses: {r:?}"
        );
        b.finish();
        stranger.shutdown(Duration::from_secs(1));
    }
    let stats = producer.stats().unwrap();
    assert_eq!(stats.core.sessions, 1, "only the friend: {:?}", stats.core);
    assert_eq!(stats.refused_peers, 2);
    friend.shutdown(Duration::from_secs(1));
    producer.shutdown(Duration::from_secs(1));
}

#[test]
fn a_producer_writes_blocks_in_place_and_peers_fetch_them() {
    let (producer, consumer) = pair("inplace", PlaneKind::Both);
    let len = producer.config().block_len as usize;
    let keys: Vec<_> = (100..104).map(synthetic::key).collect();
    let owned = keys.clone();
    let written = producer
        .store_with(&keys, move |i, block| {
            block.copy_from_slice(&synthetic::content(&owned[i], block.len()))
        })
        .unwrap();
    assert_eq!(written, 4);
    // Keys already held are left alone.
    let again = producer
        .store_with(&keys[..2], |_, _| panic!("held keys are not rewritten"))
        .unwrap();
    assert_eq!(again, 0);
    // A fill that panics fails the call; nothing of it is kept and the node carries on.
    let other = [synthetic::key(200)];
    let r = producer.store_with(&other, |_, _| panic!("engine bug"));
    assert!(matches!(r, Err(NodeError::FillPanicked)), "{r:?}");
    assert_eq!(producer.read(&other[0]), None);
    let req = consumer.request(producer.id(), "r").unwrap();
    assert_eq!(req.lookup(&keys, WAIT).unwrap(), [LookupResult::Hit; 4]);
    req.fetch(&keys, WAIT).unwrap();
    for k in &keys {
        assert_eq!(consumer.read(k), Some(synthetic::content(k, len)));
    }
    req.finish();
    consumer.shutdown(Duration::from_secs(1));
    producer.shutdown(Duration::from_secs(1));
}

#[test]
fn a_message_over_the_key_limit_costs_the_sender_its_session() {
    let mut p = NodeConfig::local("api-limit-p");
    p.spec.limits.max_list_len = 4;
    let producer = Node::start(p).unwrap();
    let consumer = Node::start(NodeConfig::local("api-limit-c")).unwrap();
    let keys: Vec<_> = (0..8).map(synthetic::key).collect();
    // Eight keys in one lookup: a protocol error at the producer, which disconnects; the
    // consumer's keys fall back to MISS.
    let big = consumer.request(producer.id(), "big").unwrap();
    let r = big.lookup(&keys, WAIT).unwrap();
    assert_eq!(r, [LookupResult::Miss; 8]);
    big.finish();
    let deadline = Instant::now() + WAIT;
    while producer.stats().unwrap().counters.protocol_errors == 0 {
        assert!(Instant::now() < deadline, "no protocol error counted");
        std::thread::sleep(Duration::from_millis(5));
    }
    consumer.shutdown(Duration::from_secs(1));
    producer.shutdown(Duration::from_secs(1));
}

#[test]
fn connect_opens_the_session_ahead_of_any_request() {
    let (producer, consumer) = pair("connect", PlaneKind::Tcp);
    consumer.connect(producer.id(), WAIT).unwrap();
    let stats = consumer.stats().unwrap();
    assert_eq!((stats.core.sessions, stats.lookup_latency.total()), (1, 0));
    // Nobody there: the connection fails and the call says so, well before its timeout.
    let nobody = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let gone = PeerId::new(nobody.local_addr().unwrap().to_string());
    drop(nobody);
    let r = consumer.connect(&gone, Duration::from_secs(5));
    assert!(matches!(r, Err(NodeError::Refused { .. })), "{r:?}");
    consumer.shutdown(Duration::from_secs(1));
    producer.shutdown(Duration::from_secs(1));
}

#[test]
fn a_dropped_request_is_finished_and_the_producer_lets_go() {
    let (producer, consumer) = pair("drop", PlaneKind::Both);
    let keys: Vec<_> = (0..4).map(synthetic::key).collect();
    store(&producer, &keys);
    let held_open = |node: &Node| {
        let s = node.stats().unwrap();
        (s.core.server_requests, s.store.pinned)
    };
    let until = |what: &str, done: &dyn Fn() -> bool| {
        let deadline = Instant::now() + WAIT;
        while !done() {
            assert!(Instant::now() < deadline, "{what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    {
        // Looked up (the producer holds the hits for us), never fetched nor finished.
        let forgotten = consumer.request(producer.id(), "forgotten").unwrap();
        assert_eq!(
            forgotten.lookup(&keys, WAIT).unwrap(),
            [LookupResult::Hit; 4]
        );
        until("the producer holds the lookup", &|| {
            held_open(&producer).0 == 1
        });
    }
    until("the dropped request was finished at the producer", &|| {
        held_open(&producer) == (0, 0)
    });
    assert_eq!(consumer.stats().unwrap().core.client_requests, 0);
    // Its id is free again.
    consumer
        .request(producer.id(), "forgotten")
        .unwrap()
        .finish();

    // A handle that outlives its node fails cleanly and drops without blocking or panicking.
    let late = consumer.request(producer.id(), "late").unwrap();
    consumer.shutdown(Duration::from_secs(1));
    assert!(matches!(
        late.lookup(&keys, Duration::from_millis(100)),
        Err(NodeError::ShutDown)
    ));
    assert!(matches!(
        consumer.request(producer.id(), "after"),
        Err(NodeError::ShutDown)
    ));
    let t = Instant::now();
    drop(late);
    assert!(
        t.elapsed() < Duration::from_millis(100),
        "{:?}",
        t.elapsed()
    );
    producer.shutdown(Duration::from_secs(1));
}
