//! Tenant-scoped sharing end to end on real sockets (docs/security.md, "Tenants"): engines of
//! tenants alpha and beta, a shared pool node that pulls from both and keeps them apart, and
//! consumers of each tenant. Every promise is checked from the asking side: what its lookups
//! answered and which bytes its fetches landed; and the honest tenant is served byte-exact.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use kvpeer::node::tenants::TenantRules;
use kvpeer::{synthetic, LookupResult, Node, NodeConfig, OffloadKey, PeerId};

const WAIT: Duration = Duration::from_secs(10);
use LookupResult::{Hit, Miss};

/// A port free now (bound and let go: the node binds it a moment later).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Fleet {
    alpha_engine: PeerId,
    beta_engine: PeerId,
    alpha_consumer: PeerId,
    beta_consumer: PeerId,
    pool: PeerId,
}

impl Fleet {
    fn new() -> Self {
        let id = || PeerId::new(format!("127.0.0.1:{}", free_port()));
        Fleet {
            alpha_engine: id(),
            beta_engine: id(),
            alpha_consumer: id(),
            beta_consumer: id(),
            pool: id(),
        }
    }

    /// The fleet's `tenants` rules, as every node is given them.
    fn rules(&self) -> Vec<String> {
        vec![
            format!("alpha={}", self.alpha_engine),
            format!("alpha={}", self.alpha_consumer),
            format!("beta={}", self.beta_engine),
            format!("beta={}", self.beta_consumer),
            format!("*={}", self.pool),
        ]
    }

    fn start(&self, tag: &str, id: &PeerId, tenant: Option<&str>) -> Node {
        let mut c = NodeConfig::local(&format!("tenants-{tag}"));
        c.spec.id = id.clone();
        c.spec.tenants = TenantRules::parse(tenant, &self.rules()).unwrap();
        Node::start(c).unwrap()
    }
}

fn key(n: u64) -> OffloadKey {
    synthetic::key(n)
}

fn filled(node: &Node, byte: u8) -> Vec<u8> {
    vec![byte; node.config().block_len as usize]
}

/// Looks `keys` up at `peer` from `node` and fetches the hits; returns what the lookup said.
fn pull(node: &Node, peer: &PeerId, id: &str, keys: &[OffloadKey]) -> Vec<LookupResult> {
    let r = node.request(peer, id).unwrap();
    let found = r.lookup(keys, WAIT).unwrap();
    let hits: Vec<OffloadKey> = keys
        .iter()
        .zip(&found)
        .filter(|(_, f)| **f == Hit)
        .map(|(k, _)| k.clone())
        .collect();
    if !hits.is_empty() {
        r.fetch(&hits, WAIT).unwrap();
    }
    r.finish();
    found
}

#[test]
fn a_shared_pool_serves_each_tenant_only_its_own_blocks_and_a_tenant_node_talks_to_no_other() {
    let fleet = Fleet::new();
    let alpha = fleet.start("ae", &fleet.alpha_engine, Some("alpha"));
    let beta = fleet.start("be", &fleet.beta_engine, Some("beta"));
    let pool = fleet.start("pool", &fleet.pool, None);
    let alpha_consumer = fleet.start("ac", &fleet.alpha_consumer, Some("alpha"));
    let beta_consumer = fleet.start("bc", &fleet.beta_consumer, Some("beta"));
    // A peer no rule names: nobody's (it sees nothing).
    let stranger = Node::start(NodeConfig::local("tenants-stranger")).unwrap();

    // Both tenants hold key 0 (with different bytes), and one key each of their own.
    let (shared_key, alpha_key, beta_key, pool_key) = (key(0), key(1), key(2), key(3));
    alpha
        .store(vec![
            (shared_key.clone(), filled(&alpha, 0xa1)),
            (alpha_key.clone(), filled(&alpha, 0xa2)),
        ])
        .unwrap();
    beta.store(vec![
        (shared_key.clone(), filled(&beta, 0xb1)),
        (beta_key.clone(), filled(&beta, 0xb2)),
    ])
    .unwrap();
    // The pool's own block: the default tenant's.
    pool.store(vec![(pool_key.clone(), filled(&pool, 0xd0))])
        .unwrap();

    // The pool pulls from both engines (shared nodes may talk to every tenant).
    let all = [
        shared_key.clone(),
        alpha_key.clone(),
        beta_key.clone(),
        pool_key.clone(),
    ];
    assert_eq!(
        pull(&pool, alpha.id(), "pool-a", &all),
        [Hit, Hit, Miss, Miss]
    );
    assert_eq!(
        pull(&pool, beta.id(), "pool-b", &all),
        [Hit, Miss, Hit, Miss]
    );
    assert_eq!(
        pool.contains_for(alpha.id(), &all).unwrap(),
        [true, true, false, false]
    );
    assert_eq!(
        pool.contains_for(beta.id(), &all).unwrap(),
        [true, false, true, false]
    );

    // Each tenant's consumer sees exactly its tenant's blocks at the pool, and lands its own
    // tenant's bytes for the key both hold.
    assert_eq!(
        pull(&alpha_consumer, pool.id(), "ac", &all),
        [Hit, Hit, Miss, Miss]
    );
    assert_eq!(alpha_consumer.read(&shared_key), Some(filled(&alpha, 0xa1)));
    assert_eq!(alpha_consumer.read(&alpha_key), Some(filled(&alpha, 0xa2)));
    assert_eq!(alpha_consumer.read(&beta_key), None);
    assert_eq!(
        pull(&beta_consumer, pool.id(), "bc", &all),
        [Hit, Miss, Hit, Miss]
    );
    assert_eq!(beta_consumer.read(&shared_key), Some(filled(&beta, 0xb1)));
    assert_eq!(beta_consumer.read(&beta_key), Some(filled(&beta, 0xb2)));
    assert_eq!(beta_consumer.read(&alpha_key), None);
    // A peer no rule names sees nothing, not even the pool's own block (the default tenant's,
    // which only shared nodes see): a rule that does not match fails closed.
    assert_eq!(
        pull(&stranger, pool.id(), "st", &all),
        [Miss, Miss, Miss, Miss]
    );
    assert_eq!(stranger.read(&pool_key), None);
    assert_eq!(stranger.read(&shared_key), None);
    // The pool's own view (its API) sees every tenant's blocks.
    assert_eq!(pool.contains(&all).unwrap(), [true, true, true, true]);

    // A tenant's node talks to no other tenant: alpha's consumer is never let near beta's
    // engine (not dialed: its keys answer MISS), and beta's engine, asked by the stranger,
    // refuses it too; beta's engine served neither a single key.
    let before = beta.stats().unwrap().counters;
    assert_eq!(
        pull(&alpha_consumer, beta.id(), "ac-b", &all),
        [Miss, Miss, Miss, Miss]
    );
    assert_eq!(
        pull(&stranger, beta.id(), "st-b", &all),
        [Miss, Miss, Miss, Miss]
    );
    let after = beta.stats().unwrap();
    assert_eq!(
        (
            after.counters.lookup_hits_served,
            after.counters.lookup_misses_served
        ),
        (before.lookup_hits_served, before.lookup_misses_served),
        "beta's engine answered a peer of another tenant"
    );
    assert_eq!(alpha_consumer.read(&beta_key), None);
    // Refused on each side where the check is: alpha's consumer never dialed, beta's engine
    // dropped the stranger's connect.
    assert_eq!(after.refused_peers, 1, "the stranger");
    assert_eq!(
        alpha_consumer.stats().unwrap().refused_peers,
        1,
        "beta's engine"
    );
    assert_eq!(
        alpha_consumer.stats().unwrap().core.sessions,
        1,
        "the pool's only"
    );
    // Beta's engine still serves its own tenant byte-exact.
    let beta_consumer_key = key(4);
    beta.store(vec![(beta_consumer_key.clone(), filled(&beta, 0xb4))])
        .unwrap();
    assert_eq!(
        pull(
            &beta_consumer,
            beta.id(),
            "bc-b",
            std::slice::from_ref(&beta_consumer_key)
        ),
        [Hit]
    );
    assert_eq!(
        beta_consumer.read(&beta_consumer_key),
        Some(filled(&beta, 0xb4))
    );

    for node in [
        &alpha,
        &beta,
        &pool,
        &alpha_consumer,
        &beta_consumer,
        &stranger,
    ] {
        node.shutdown(Duration::from_secs(1));
    }
}

#[test]
fn a_block_fetched_from_a_shared_node_is_the_fetchers_tenants() {
    let fleet = Fleet::new();
    let alpha = fleet.start("f-ae", &fleet.alpha_engine, Some("alpha"));
    let pool = fleet.start("f-pool", &fleet.pool, None);
    // Alpha's consumer runs with no tenant of its own (it keeps tenants apart like a pool).
    let keeper = fleet.start("f-ac", &fleet.alpha_consumer, None);
    let beta = fleet.start("f-bc", &fleet.beta_consumer, Some("beta"));
    let stranger = Node::start(NodeConfig::local("tenants-f-stranger")).unwrap();
    let k = key(7);
    alpha
        .store(vec![(k.clone(), filled(&alpha, 0xa7))])
        .unwrap();
    let one = std::slice::from_ref(&k);
    assert_eq!(pull(&pool, alpha.id(), "p", one), [Hit]);
    // The pool served it to the keeper as alpha's: the keeper holds it as alpha's.
    assert_eq!(pull(&keeper, pool.id(), "k", one), [Hit]);
    assert_eq!(keeper.contains_for(pool.id(), one).unwrap(), [true]);
    assert_eq!(keeper.read(&k), Some(filled(&alpha, 0xa7)));
    // So another tenant's peer, and a peer of none, asking the keeper find nothing.
    assert_eq!(pull(&beta, keeper.id(), "b", one), [Miss]);
    assert_eq!(beta.read(&k), None);
    assert_eq!(pull(&stranger, keeper.id(), "s", one), [Miss]);
    assert_eq!(stranger.read(&k), None);
    for node in [&alpha, &pool, &keeper, &beta, &stranger] {
        node.shutdown(Duration::from_secs(1));
    }
}

#[test]
fn an_engine_with_tenants_rules_needs_a_tenant_of_its_own() {
    use kvpeer::engine::EngineNode;
    use kvpeer::node::build::BuildError;
    let fleet = Fleet::new();
    let mut c = NodeConfig::local("tenants-engine");
    c.spec.plane = kvpeer::PlaneKind::Tcp;
    c.spec.tenants = TenantRules::parse(None, &fleet.rules()).unwrap();
    let pool = kvpeer_store::Pool::anonymous(4, c.spec.block_len, false).unwrap();
    assert!(matches!(
        EngineNode::build(&c.spec, pool),
        Err(BuildError::EngineWithoutTenant)
    ));
}

#[test]
fn bad_tenant_settings_are_refused_with_the_key_and_why() {
    use kvpeer::config::{from_toml, resolve, Settings};
    let err = |toml: &str| {
        let file = from_toml(toml, "kvpeer.toml").unwrap();
        resolve(&file, &Settings::default(), &Settings::default(), "t").unwrap_err()
    };
    let e = err("tenants = [\"10.0.0.0/8\"]\n");
    assert_eq!(e.key, "tenants");
    assert!(e.problem.contains("NAME=RULE"), "{e}");
    let e = err("tenant = \"alpha\"\n");
    assert_eq!(e.key, "tenant");
    assert!(e.problem.contains("no rule"), "{e}");
    let e = err("tenant = \"*\"\ntenants = [\"a=10.0.0.1\"]\n");
    assert_eq!(e.key, "tenant");
    // A good one: the rules as the file lists them.
    let file = from_toml(
        "tenant = \"alpha\"\ntenants = [\"alpha=10.0.1.0/24\", \"*=10.0.0.1:7000\"]\n",
        "kvpeer.toml",
    )
    .unwrap();
    let c = resolve(&file, &Settings::default(), &Settings::default(), "t").unwrap();
    let own = c.spec.tenants.own().unwrap();
    assert_eq!(c.spec.tenants.name(own), "alpha");
    assert_eq!(c.spec.tenants.tenant_of(&PeerId::new("10.0.1.9:1")), own);
    assert!(c.spec.tenants.is_shared(&PeerId::new("10.0.0.1:7000")));
}
