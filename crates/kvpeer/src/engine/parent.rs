//! The producer side of an embedding engine: peers' lookups and pins answered by the engine,
//! later, on its own thread.
//!
//! vLLM's block manager may be called only inside the engine's own step, under its lock, so a
//! node cannot ask it synchronously as the core asks a [`Parent`]. [`EngineParent`] is the
//! core's parent instead: a key the engine has not answered yet is a new [`Query`] (queued for
//! the engine) and answers `Retry`; the core waits (no re-polling: the parent says it
//! [wakes the core](Parent::wakes_core)) until the engine answers or the lookup's deadline
//! passes. The engine takes the queries with [`EngineLink::take_queries`] whenever it likes,
//! answers each with [`EngineLink::answer`] (a hit carries the block and the engine's own pin
//! on it), and learns with [`EngineLink::take_releases`] which pins the node is done with. An
//! answer wakes the node's loop, whose next step asks the core to serve the waiting lookups.
//!
//! Every pin the engine hands over comes back exactly once as a [`Release`]: after its blocks
//! were written to the peer (or failed to be), or when the lookup ended before they were
//! used. An answer to a question nobody asks any more is refused and its pin stays the
//! engine's. Both sides hold the lock only to move small records; neither blocks on the other.
//!
//! With tenants ([`EngineParent::scope_peers`]), every block of the engine is its node's
//! tenant's (the default tenant when it has none): a peer of another tenant is never asked
//! about, its keys answer MISS at once (docs/security.md, G14).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use kvpeer_core::{BlockIndex, JobId, LookupResult, Parent, ServeCtx, StoreJob};
use kvpeer_net::data::shm::Wake;
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};

/// Names one question to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueryId(u64);

impl QueryId {
    /// Its number, for an engine that keeps questions outside Rust (the Python binding).
    pub fn get(self) -> u64 {
        self.0
    }

    /// The question numbered `n` (an answer to a number never asked is refused).
    pub fn from_raw(n: u64) -> Self {
        QueryId(n)
    }
}

/// The engine's own handle on a pinned block (its block manager's reference, opaque here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct EnginePin(pub u64);

/// A peer asks whether the engine holds `key`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    /// What to pass back to [`EngineLink::answer`].
    pub id: QueryId,
    /// Who asks.
    pub peer: PeerId,
    /// The peer's request.
    pub kv_request_id: KvRequestId,
    /// The key.
    pub key: OffloadKey,
}

/// The engine's answer to a [`Query`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// Held, in `block`, pinned by the engine as `pin` until it comes back as a [`Release`].
    Hit {
        /// Where the key's bytes are in the pool.
        block: BlockIndex,
        /// The engine's pin on it.
        pin: EnginePin,
    },
    /// Not held.
    Miss,
    /// Being written: ask me again (the query comes back).
    Pending,
}

/// A pin the node no longer needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Release {
    /// The engine's pin.
    pub pin: EnginePin,
    /// Whether the block was written to the peer (`false`: unused, or the write failed).
    pub sent: bool,
}

/// Store jobs made from the engine's pins have ids from here up, so that they never meet the
/// ids an engine gives its own jobs (`submit_store`, `submit_load`), which count from 1.
pub(super) const FIRST_PIN_JOB: u64 = 1 << 62;

#[derive(Debug, Clone, Copy)]
enum Slot {
    /// Asked; the engine has not answered.
    Asked(QueryId),
    /// Answered.
    Answered(Answer),
}

#[derive(Debug, Default)]
struct Shared {
    next_query: u64,
    next_job: u64,
    /// Questions the engine has not taken yet.
    asked: VecDeque<Query>,
    /// Open lookups, each key's state.
    lookups: HashMap<ServeCtx, HashMap<OffloadKey, Slot>>,
    /// Which lookup and key each open question belongs to.
    questions: HashMap<QueryId, (ServeCtx, OffloadKey)>,
    /// Pins held by store jobs the core runs.
    jobs: HashMap<JobId, Vec<(EnginePin, BlockIndex)>>,
    /// How many of the engine's pins the node holds on each block (a peer's write reads it,
    /// so the engine must not write it meanwhile).
    pinned: HashMap<BlockIndex, u32>,
    /// Pins given back, not yet taken by the engine.
    releases: Vec<Release>,
    /// Answers arrived since the node last looked.
    answered: bool,
}

impl Shared {
    /// Gives a pin back to the engine.
    fn release(&mut self, pin: EnginePin, block: BlockIndex, sent: bool) {
        if let Some(n) = self.pinned.get_mut(&block) {
            *n -= 1;
            if *n == 0 {
                self.pinned.remove(&block);
            }
        }
        self.releases.push(Release { pin, sent });
    }

    fn ask(&mut self, ctx: &ServeCtx, key: &OffloadKey) -> QueryId {
        let id = QueryId(self.next_query);
        self.next_query += 1;
        self.asked.push_back(Query {
            id,
            peer: ctx.peer.clone(),
            kv_request_id: ctx.kv_request_id.clone(),
            key: key.clone(),
        });
        self.questions.insert(id, (ctx.clone(), key.clone()));
        id
    }
}

/// The core's parent for a node embedded in an engine. Made with [`EngineParent::new`], which
/// also gives the engine its [`EngineLink`].
#[derive(Debug)]
pub struct EngineParent {
    shared: Arc<Mutex<Shared>>,
    /// Which peers may see the engine's blocks (`None`: every peer).
    scope: Option<EngineScope>,
}

/// The engine's tenant and the rules that say each peer's.
#[derive(Debug)]
struct EngineScope {
    rules: Arc<crate::node::tenants::TenantRules>,
    own: kvpeer_store::Tenant,
    /// Each peer's verdict, once worked out (cleared past [`SCOPE_CACHE_MAX`]).
    verdicts: HashMap<PeerId, bool>,
    /// Lookups of peers of another tenant, open now: every key MISS.
    denied: HashSet<ServeCtx>,
}

/// Peers whose verdict is remembered before the memory is cleared.
const SCOPE_CACHE_MAX: usize = 4096;

impl EngineScope {
    fn admits(&mut self, peer: &PeerId) -> bool {
        if let Some(v) = self.verdicts.get(peer) {
            return *v;
        }
        let class = self.rules.classify(peer);
        let v = class.shared || class.tenant == self.own;
        if self.verdicts.len() >= SCOPE_CACHE_MAX {
            self.verdicts.clear();
        }
        self.verdicts.insert(peer.clone(), v);
        v
    }
}

/// The engine's end: clone it to any thread.
#[derive(Clone)]
pub struct EngineLink {
    shared: Arc<Mutex<Shared>>,
    wake: Option<Wake>,
}

impl std::fmt::Debug for EngineLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineLink").finish_non_exhaustive()
    }
}

/// The lock, even if a thread panicked while holding it: every record under it is whole
/// between statements, so the state is still consistent.
fn lock(shared: &Mutex<Shared>) -> MutexGuard<'_, Shared> {
    shared
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl EngineParent {
    /// A parent and its link; `wake` (the node's wake hook) is called when the engine answers.
    pub fn new(wake: Option<Wake>) -> (Self, EngineLink) {
        let shared = Arc::new(Mutex::new(Shared {
            next_job: FIRST_PIN_JOB,
            ..Default::default()
        }));
        (
            EngineParent {
                shared: shared.clone(),
                scope: None,
            },
            EngineLink { shared, wake },
        )
    }

    /// Holds peers to `rules`: the engine's blocks are all its node's tenant's (the default
    /// tenant without one), and a peer of another tenant (not a shared node) gets MISS for
    /// every key without the engine being asked.
    /// The rules come with their names resolved (the node's origin check's copy).
    pub fn scope_peers(&mut self, rules: Arc<crate::node::tenants::TenantRules>) {
        let own = rules.own().unwrap_or(kvpeer_store::Tenant::DEFAULT);
        self.scope = Some(EngineScope {
            rules,
            own,
            verdicts: HashMap::new(),
            denied: HashSet::new(),
        });
    }

    /// Whether the engine answered something since the last call (then the core should be
    /// asked to serve its waiting lookups again).
    pub fn take_answered(&mut self) -> bool {
        std::mem::take(&mut lock(&self.shared).answered)
    }

    /// Whether the node holds one of the engine's pins on `block` (a write to a peer may be
    /// reading it).
    pub(super) fn is_pinned(&self, block: BlockIndex) -> bool {
        lock(&self.shared).pinned.contains_key(&block)
    }

    /// Questions the engine has not answered and pins it has not got back: both must be 0
    /// once every lookup has ended and every job completed.
    pub fn outstanding(&self) -> (usize, usize) {
        let s = lock(&self.shared);
        let pins = s.jobs.values().map(Vec::len).sum::<usize>()
            + s.lookups
                .values()
                .flat_map(HashMap::values)
                .filter(|slot| matches!(slot, Slot::Answered(Answer::Hit { .. })))
                .count();
        (s.questions.len(), pins)
    }
}

impl Parent for EngineParent {
    /// The node serves waiting lookups when the engine answers (the link wakes it), so the
    /// core need not re-ask every millisecond while the engine is busy elsewhere.
    fn wakes_core(&self) -> bool {
        true
    }

    fn on_new_request(&mut self, ctx: &ServeCtx) {
        if let Some(scope) = &mut self.scope {
            if !scope.admits(&ctx.peer) {
                scope.denied.insert(ctx.clone());
                return;
            }
        }
        lock(&self.shared).lookups.entry(ctx.clone()).or_default();
    }

    fn lookup(&mut self, key: &OffloadKey, ctx: &ServeCtx) -> LookupResult {
        if let Some(scope) = &self.scope {
            if scope.denied.contains(ctx) {
                return LookupResult::Miss;
            }
        }
        let mut s = lock(&self.shared);
        let slot = s.lookups.get(ctx).and_then(|keys| keys.get(key)).copied();
        match slot {
            Some(Slot::Answered(Answer::Hit { .. })) => LookupResult::Hit,
            Some(Slot::Answered(Answer::Miss)) => LookupResult::Miss,
            Some(Slot::Asked(_)) => LookupResult::Retry,
            None | Some(Slot::Answered(Answer::Pending)) => {
                let id = s.ask(ctx, key);
                s.lookups
                    .entry(ctx.clone())
                    .or_default()
                    .insert(key.clone(), Slot::Asked(id));
                LookupResult::Retry
            }
        }
    }

    fn create_store_job(&mut self, keys: &[OffloadKey], ctx: &ServeCtx) -> Option<StoreJob> {
        let mut s = lock(&self.shared);
        let answers = s.lookups.get_mut(ctx)?;
        let mut blocks = Vec::with_capacity(keys.len());
        let mut pins = Vec::with_capacity(keys.len());
        for key in keys {
            match answers.get(key) {
                Some(Slot::Answered(Answer::Hit { block, pin })) => {
                    blocks.push(*block);
                    pins.push((*pin, *block));
                }
                // The core pins only keys just answered HIT; anything else is refused whole.
                _ => return None,
            }
        }
        // The pins move to the job: the lookup no longer holds them.
        for key in keys {
            answers.insert(key.clone(), Slot::Answered(Answer::Miss));
        }
        let job_id = JobId::new(s.next_job);
        s.next_job += 1;
        s.jobs.insert(job_id, pins);
        Some(StoreJob { job_id, blocks })
    }

    fn complete_store_job(&mut self, job_id: JobId, success: bool) {
        let mut s = lock(&self.shared);
        if let Some(pins) = s.jobs.remove(&job_id) {
            for (pin, block) in pins {
                s.release(pin, block, success);
            }
        }
        // Else one of the engine's own jobs: the core's `StoreDone` tells the engine, which
        // unpins when it hears (`EngineEvent::Stored`).
    }

    fn on_request_finished(&mut self, ctx: &ServeCtx) {
        if let Some(scope) = &mut self.scope {
            if scope.denied.remove(ctx) {
                return;
            }
        }
        let mut s = lock(&self.shared);
        let Some(keys) = s.lookups.remove(ctx) else {
            return;
        };
        for slot in keys.into_values() {
            match slot {
                Slot::Asked(id) => {
                    s.questions.remove(&id);
                }
                Slot::Answered(Answer::Hit { pin, block }) => s.release(pin, block, false),
                Slot::Answered(_) => {}
            }
        }
        // Its questions still queued are skipped when the engine takes them (`take_queries`):
        // filtering the queue here would cost every ended lookup a walk of all of it.
    }
}

impl EngineLink {
    /// The questions peers asked since the last call, oldest first.
    pub fn take_queries(&self) -> Vec<Query> {
        let mut s = lock(&self.shared);
        let Shared {
            asked, questions, ..
        } = &mut *s;
        // A question whose lookup ended is no longer asked.
        asked
            .drain(..)
            .filter(|q| questions.contains_key(&q.id))
            .collect()
    }

    /// Answers question `id`. `false` if nobody asks any more (the lookup ended): a hit's pin
    /// then stays the engine's to drop. A `true` hit's pin comes back once as a [`Release`].
    pub fn answer(&self, id: QueryId, answer: Answer) -> bool {
        self.answer_all([(id, answer)])
            .first()
            .copied()
            .unwrap_or(false)
    }

    /// Answers several questions at once (as [`EngineLink::answer`] each, in order), waking
    /// the node once: whether each was taken.
    pub fn answer_all(&self, answers: impl IntoIterator<Item = (QueryId, Answer)>) -> Vec<bool> {
        let taken: Vec<bool> = {
            let mut s = lock(&self.shared);
            answers
                .into_iter()
                .map(|(id, answer)| {
                    let Some((ctx, key)) = s.questions.remove(&id) else {
                        return false;
                    };
                    let Some(slot) = s.lookups.get_mut(&ctx).and_then(|keys| keys.get_mut(&key))
                    else {
                        return false;
                    };
                    *slot = Slot::Answered(answer);
                    if let Answer::Hit { block, .. } = answer {
                        *s.pinned.entry(block).or_default() += 1;
                    }
                    s.answered = true;
                    true
                })
                .collect()
        };
        if taken.contains(&true) {
            if let Some(wake) = &self.wake {
                wake();
            }
        }
        taken
    }

    /// Pins the node is done with since the last call.
    pub fn take_releases(&self) -> Vec<Release> {
        std::mem::take(&mut lock(&self.shared).releases)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn ctx(n: u64) -> ServeCtx {
        ServeCtx {
            peer: PeerId::new("127.0.0.1:9"),
            kv_request_id: KvRequestId::from("r"),
            lookup: n,
        }
    }

    fn key(i: u8) -> OffloadKey {
        OffloadKey::from(&[i; 8][..])
    }

    fn hit(block: u64, pin: u64) -> Answer {
        Answer::Hit {
            block: BlockIndex::new(block),
            pin: EnginePin(pin),
        }
    }

    #[test]
    fn a_key_is_asked_once_and_answers_retry_until_the_engine_answers() {
        let (mut parent, link) = EngineParent::new(None);
        let c = ctx(1);
        parent.on_new_request(&c);
        assert_eq!(parent.lookup(&key(1), &c), LookupResult::Retry);
        assert_eq!(parent.lookup(&key(1), &c), LookupResult::Retry);
        let queries = link.take_queries();
        assert_eq!(queries.len(), 1, "asked once however often the core polls");
        assert_eq!(queries[0].key, key(1));
        assert!(!parent.take_answered());
        assert!(link.answer(queries[0].id, hit(4, 40)));
        assert!(parent.take_answered());
        assert_eq!(parent.lookup(&key(1), &c), LookupResult::Hit);
        let job = parent.create_store_job(&[key(1)], &c).unwrap();
        assert_eq!(job.blocks, vec![BlockIndex::new(4)]);
        parent.on_request_finished(&c);
        assert!(link.take_releases().is_empty(), "the job holds the pin");
        assert_eq!(parent.outstanding(), (0, 1));
        parent.complete_store_job(job.job_id, true);
        assert_eq!(
            link.take_releases(),
            vec![Release {
                pin: EnginePin(40),
                sent: true
            }]
        );
        assert_eq!(parent.outstanding(), (0, 0));
    }

    #[test]
    fn a_peer_of_another_tenant_gets_miss_and_the_engine_is_never_asked() {
        let (mut parent, link) = EngineParent::new(None);
        parent.scope_peers(Arc::new(
            crate::node::tenants::TenantRules::parse(
                Some("alpha"),
                &["alpha=10.0.1.0/24", "beta=10.0.2.0/24", "*=10.0.0.1:7000"],
            )
            .unwrap(),
        ));
        let at = |peer: &str, n: u64| ServeCtx {
            peer: PeerId::new(peer),
            kv_request_id: KvRequestId::from("r"),
            lookup: n,
        };
        let (alpha, pool, beta, unnamed) = (
            at("10.0.1.5:5600", 1),
            at("10.0.0.1:7000", 2),
            at("10.0.2.5:5600", 3),
            at("10.0.9.9:5600", 4),
        );
        for c in [&alpha, &pool, &beta, &unnamed] {
            parent.on_new_request(c);
        }
        assert_eq!(parent.lookup(&key(1), &alpha), LookupResult::Retry);
        assert_eq!(parent.lookup(&key(1), &pool), LookupResult::Retry);
        assert_eq!(parent.lookup(&key(1), &beta), LookupResult::Miss);
        assert_eq!(parent.lookup(&key(1), &unnamed), LookupResult::Miss);
        let asked: Vec<PeerId> = link.take_queries().into_iter().map(|q| q.peer).collect();
        assert_eq!(
            asked,
            [alpha.peer.clone(), pool.peer.clone()],
            "beta's and the unnamed peer's keys never asked"
        );
        assert!(parent.create_store_job(&[key(1)], &beta).is_none());
        for c in [&alpha, &pool, &beta, &unnamed] {
            parent.on_request_finished(c);
        }
        assert_eq!(parent.outstanding(), (0, 0));
    }

    #[test]
    fn pending_asks_again_and_miss_is_final() {
        let (mut parent, link) = EngineParent::new(None);
        let c = ctx(1);
        parent.on_new_request(&c);
        parent.lookup(&key(1), &c);
        parent.lookup(&key(2), &c);
        let q = link.take_queries();
        assert!(link.answer(q[0].id, Answer::Pending));
        assert!(link.answer(q[1].id, Answer::Miss));
        assert_eq!(parent.lookup(&key(1), &c), LookupResult::Retry);
        assert_eq!(parent.lookup(&key(2), &c), LookupResult::Miss);
        let again = link.take_queries();
        assert_eq!(again.len(), 1);
        assert_eq!(again[0].key, key(1));
        assert_ne!(again[0].id, q[0].id);
        assert!(
            !link.answer(q[0].id, Answer::Miss),
            "an old question is gone"
        );
    }

    #[test]
    fn a_lookup_that_ends_first_withdraws_its_questions_and_returns_unused_pins() {
        let (mut parent, link) = EngineParent::new(None);
        let c = ctx(1);
        parent.on_new_request(&c);
        parent.lookup(&key(1), &c);
        parent.lookup(&key(2), &c);
        parent.lookup(&key(3), &c);
        let q = link.take_queries();
        parent.lookup(&key(4), &c); // asked, never taken by the engine
        assert!(link.answer(q[0].id, hit(1, 10)));
        parent.on_request_finished(&c);
        assert!(
            link.take_queries().is_empty(),
            "a withdrawn question is not handed out"
        );
        assert!(
            !link.answer(q[1].id, hit(2, 20)),
            "the pin stays the engine's"
        );
        assert!(!link.answer(q[2].id, Answer::Miss));
        assert_eq!(
            link.take_releases(),
            vec![Release {
                pin: EnginePin(10),
                sent: false
            }],
            "the hit nobody used comes back unused, once"
        );
        assert_eq!(parent.outstanding(), (0, 0));
    }

    #[test]
    fn a_store_job_is_made_only_from_hits() {
        let (mut parent, link) = EngineParent::new(None);
        let c = ctx(1);
        parent.on_new_request(&c);
        parent.lookup(&key(1), &c);
        parent.lookup(&key(2), &c);
        let q = link.take_queries();
        link.answer(q[0].id, hit(1, 10));
        link.answer(q[1].id, Answer::Miss);
        assert_eq!(parent.create_store_job(&[key(1), key(2)], &c), None);
        assert_eq!(parent.create_store_job(&[key(1)], &ctx(2)), None);
        let job = parent.create_store_job(&[key(1)], &c).unwrap();
        assert!(job.job_id.get() >= FIRST_PIN_JOB);
        parent.complete_store_job(job.job_id, false);
        parent.complete_store_job(job.job_id, false);
        assert_eq!(
            link.take_releases(),
            vec![Release {
                pin: EnginePin(10),
                sent: false
            }],
            "completed twice, released once"
        );
    }
}
