//! A deterministic cluster of cores with virtual time, like quinn's `Pair`.
//!
//! Messages are encoded to bytes on send and go through `handle_payload` on receipt, so the
//! real codec is in the loop. The network delivers after `latency`, and a test may install a
//! policy that drops, delays or duplicates messages. Time only moves when the driver advances
//! it, to the next delivery or the earliest core deadline, so a 60 s timeout costs nothing.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvpeer_core::{
    BlockIndex, Core, CoreConfig, CoreStats, Event, JobId, LocalNode, LookupResult, Request,
    RequestRoles, TransferId,
};
use kvpeer_proto::{decode, KvRequestId, Message, OffloadKey, PeerId};

use super::fakes::{FakeParent, FakePlane};

pub type TestCore = Core<FakeParent, FakePlane>;

/// What happens to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    Deliver,
    Drop,
    Delay(Duration),
    Duplicate,
}

pub type Policy = Box<dyn FnMut(usize, usize, &Message) -> Fate>;

pub struct Node {
    pub id: PeerId,
    pub core: TestCore,
}

struct Envelope {
    at: Instant,
    seq: u64,
    from: usize,
    to: usize,
    payload: Vec<u8>,
}

pub struct Cluster {
    pub now: Instant,
    pub nodes: Vec<Node>,
    pub latency: Duration,
    /// Transfers end by themselves this long after they start (None: the test ends them).
    pub auto_transfer: Option<Duration>,
    pub policy: Option<Policy>,
    network: Vec<Envelope>,
    seq: u64,
    /// Every event, per node.
    pub events: Vec<(usize, Event)>,
    /// Every message sent: (from, to, message).
    pub sent: Vec<(usize, usize, Message)>,
    transfer_started: HashMap<(usize, TransferId), Instant>,
    next_load_job: JobId,
    /// (from, to) pairs where `from` sent `disconnect` and has not opened a new session since.
    closed_links: HashSet<(usize, usize)>,
    /// Messages sent after `disconnect` on the same session (must stay empty).
    pub after_disconnect: Vec<String>,
    /// The engine's request handles, by (node, name).
    pub reqs: HashMap<(usize, String), Request>,
    /// How many times `settle` ran (to keep tests cheap).
    pub settles: u64,
}

/// At the end of every passing test: finish what the test left open, shut every core down, let
/// the last messages land, and check nothing is left behind.
impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let reqs: Vec<(usize, String)> = self.reqs.keys().cloned().collect();
        for (i, rid) in reqs {
            self.finish(i, &rid);
        }
        self.reqs.clear();
        self.policy = None;
        self.run_for(std::time::Duration::from_secs(1));
        let now = self.now;
        for n in &mut self.nodes {
            n.core.shutdown(now);
        }
        self.settle();
        self.assert_clean();
    }
}

pub fn peer_id(i: usize) -> PeerId {
    PeerId::new(format!("10.0.0.{}:5710", i + 1))
}

pub fn local(i: usize) -> LocalNode {
    LocalNode {
        peer_id: peer_id(i),
        agent_metadata: format!("agent-{i}").into_bytes(),
        base_addr: 0x7f00_0000_0000,
        num_blocks: 100_000,
        block_len: 16_384,
        config_fingerprint: "2291d8cdc310411e".into(),
        hash_seed: "42".into(),
    }
}

pub fn key(n: u64) -> OffloadKey {
    let mut hash = [0u8; 32];
    hash[..8].copy_from_slice(&n.to_be_bytes());
    OffloadKey::from_parts(&hash, 0)
}

/// The consumer block where load `job` puts its `i`-th key.
pub fn dest_block(job: JobId, i: usize) -> BlockIndex {
    BlockIndex::new((job.get() - 1_000_000) * 100 + i as u64)
}

pub fn id(s: &str) -> KvRequestId {
    KvRequestId::from(s)
}

impl Cluster {
    pub fn new(n: usize) -> Self {
        Self::with(n, CoreConfig::default(), local)
    }

    pub fn with(n: usize, config: CoreConfig, local_of: impl Fn(usize) -> LocalNode) -> Self {
        let now = Instant::now();
        let nodes = (0..n)
            .map(|i| Node {
                id: peer_id(i),
                core: Core::new(
                    config.clone(),
                    local_of(i),
                    FakeParent::default(),
                    FakePlane::default(),
                    now,
                ),
            })
            .collect();
        Cluster {
            now,
            nodes,
            latency: Duration::from_micros(100),
            auto_transfer: Some(Duration::from_millis(1)),
            policy: None,
            network: Vec::new(),
            seq: 0,
            events: Vec::new(),
            sent: Vec::new(),
            transfer_started: HashMap::new(),
            next_load_job: JobId::new(1_000_000),
            closed_links: HashSet::new(),
            after_disconnect: Vec::new(),
            reqs: HashMap::new(),
            settles: 0,
        }
    }

    pub fn core(&mut self, i: usize) -> &mut TestCore {
        &mut self.nodes[i].core
    }

    pub fn parent(&mut self, i: usize) -> &mut FakeParent {
        self.nodes[i].core.parent_mut()
    }

    pub fn plane(&mut self, i: usize) -> &mut FakePlane {
        self.nodes[i].core.plane_mut()
    }

    pub fn index_of(&self, peer: &PeerId) -> Option<usize> {
        self.nodes.iter().position(|n| &n.id == peer)
    }

    pub fn load_job(&mut self) -> JobId {
        self.next_load_job = JobId::new(self.next_load_job.get() + 1);
        self.next_load_job
    }

    /// Moves outputs of every node into the network and the event log.
    fn drain(&mut self) -> bool {
        let mut moved = false;
        for i in 0..self.nodes.len() {
            while let Some(t) = self.nodes[i].core.poll_transmit() {
                moved = true;
                let Some(to) = self.index_of(&t.peer) else {
                    continue;
                };
                match &t.message {
                    Message::Connect(_) => {
                        self.closed_links.remove(&(i, to));
                    }
                    _ if self.closed_links.contains(&(i, to)) => {
                        self.after_disconnect.push(format!(
                            "node {i} sent {:?} to node {to} after disconnect",
                            t.message
                        ));
                    }
                    _ => {}
                }
                if t.message == Message::DISCONNECT {
                    self.closed_links.insert((i, to));
                }
                self.sent.push((i, to, t.message.clone()));
                let fate = match self.policy.as_mut() {
                    Some(p) => p(i, to, &t.message),
                    None => Fate::Deliver,
                };
                let payload = t
                    .message
                    .encode()
                    .expect("the core only sends valid messages");
                let delays: Vec<Duration> = match fate {
                    Fate::Deliver => vec![self.latency],
                    Fate::Drop => vec![],
                    Fate::Delay(d) => vec![self.latency + d],
                    Fate::Duplicate => vec![self.latency, self.latency],
                };
                for d in delays {
                    self.seq += 1;
                    self.network.push(Envelope {
                        at: self.now + d,
                        seq: self.seq,
                        from: i,
                        to,
                        payload: payload.clone(),
                    });
                }
            }
            while let Some(e) = self.nodes[i].core.poll_event() {
                moved = true;
                self.events.push((i, e));
            }
        }
        moved
    }

    /// Delivers every message due by now, in order.
    fn deliver(&mut self) -> bool {
        let now = self.now;
        let mut due: Vec<Envelope> = Vec::new();
        let mut rest = Vec::new();
        for e in self.network.drain(..) {
            if e.at <= now {
                due.push(e)
            } else {
                rest.push(e)
            }
        }
        self.network = rest;
        due.sort_by_key(|e| (e.at, e.seq));
        let delivered = !due.is_empty();
        for e in due {
            let from = self.nodes[e.from].id.clone();
            // Like the ZeroMQ channel, every frame goes to the core; a frame from an unknown
            // identity opens an inbound session only if it is a `connect`.
            self.nodes[e.to].core.handle_payload(now, &from, &e.payload);
        }
        delivered
    }

    /// Ends transfers whose time has come (moving their bytes), and tells the writers.
    fn run_transfers(&mut self) -> bool {
        let Some(after) = self.auto_transfer else {
            return false;
        };
        let mut any = false;
        for i in 0..self.nodes.len() {
            for tid in self.nodes[i].core.plane().running() {
                let started = *self.transfer_started.entry((i, tid)).or_insert(self.now);
                if self.now >= started + after && !self.nodes[i].core.plane().transfers[&tid].stuck
                {
                    self.end_transfer(i, tid, true);
                    any = true;
                }
            }
        }
        any
    }

    /// Ends transfer `tid` of node `i` (moving its bytes on success) and tells node `i`.
    pub fn end_transfer(&mut self, i: usize, tid: TransferId, success: bool) {
        let Some(xfer) = self.nodes[i].core.plane_mut().end(tid, success) else {
            return;
        };
        if success {
            if let Some(to) = self.index_of(&xfer.peer) {
                for (l, r) in xfer.local.iter().zip(&xfer.remote) {
                    if let Some(k) = self.nodes[i].core.parent().key_in(*l) {
                        self.nodes[to].core.parent_mut().landed.insert(*r, k);
                    }
                }
            }
        }
        let now = self.now;
        self.nodes[i].core.handle_data_plane(now);
    }

    fn next_time(&self) -> Option<Instant> {
        let net = self.network.iter().map(|e| e.at).min();
        let timers = self
            .nodes
            .iter()
            .filter_map(|n| n.core.poll_timeout())
            .min();
        let xfers = self.auto_transfer.and_then(|after| {
            self.transfer_started
                .iter()
                .filter(|((i, t), _)| {
                    self.nodes[*i]
                        .core
                        .plane()
                        .transfers
                        .get(t)
                        .is_some_and(|x| x.state == super::fakes::XferState::Running && !x.stuck)
                })
                .map(|(_, at)| *at + after)
                .min()
        });
        [net, timers, xfers].into_iter().flatten().min()
    }

    /// Processes everything due now, without moving time.
    pub fn settle(&mut self) {
        for _ in 0..10_000 {
            self.settles += 1;
            let a = self.drain();
            let b = self.deliver();
            let c = self.run_transfers();
            let now = self.now;
            let mut d = false;
            for n in &mut self.nodes {
                if n.core.poll_timeout().is_some_and(|t| t <= now) {
                    n.core.handle_timeout(now);
                    d = true;
                }
            }
            if !(a || b || c || d) {
                return;
            }
        }
        panic!("cluster did not settle");
    }

    /// Runs until `now + span`, jumping from one due thing to the next.
    pub fn run_for(&mut self, span: Duration) {
        let end = self.now + span;
        self.settle();
        for _ in 0..1_000_000 {
            match self.next_time() {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.settle();
                }
                _ => {
                    self.now = end;
                    self.settle();
                    return;
                }
            }
        }
        panic!("run_for did not finish");
    }

    /// Runs until nothing is due in the next 600 virtual seconds... or `limit` passes.
    pub fn run(&mut self) {
        self.run_for(Duration::from_millis(50));
    }

    pub fn advance(&mut self, d: Duration) {
        self.run_for(d);
    }

    // ---- workload helpers ----

    pub fn events_of(&self, i: usize) -> Vec<Event> {
        self.events
            .iter()
            .filter(|(n, _)| *n == i)
            .map(|(_, e)| e.clone())
            .collect()
    }

    pub fn load_results(&self, i: usize) -> Vec<(JobId, bool)> {
        self.events
            .iter()
            .filter(|(n, _)| *n == i)
            .filter_map(|(_, e)| match e {
                Event::LoadDone { job, success, .. } => Some((*job, *success)),
                _ => None,
            })
            .collect()
    }

    pub fn load_result(&self, i: usize, job: JobId) -> Option<bool> {
        let all: Vec<bool> = self
            .load_results(i)
            .into_iter()
            .filter(|(j, _)| *j == job)
            .map(|(_, s)| s)
            .collect();
        assert!(all.len() <= 1, "load {job} reported {} times", all.len());
        all.first().copied()
    }

    pub fn sent_from(&self, i: usize) -> Vec<Message> {
        self.sent
            .iter()
            .filter(|(f, _, _)| *f == i)
            .map(|(_, _, m)| m.clone())
            .collect()
    }

    pub fn count_sent(&self, i: usize, f: impl Fn(&Message) -> bool) -> usize {
        self.sent.iter().filter(|(n, _, m)| *n == i && f(m)).count()
    }

    /// Node `i`'s engine opens request `rid` with `roles`.
    pub fn open(&mut self, i: usize, rid: &str, roles: RequestRoles) -> Request {
        let now = self.now;
        let req = self.nodes[i].core.on_new_request(now, id(rid), roles);
        self.reqs.insert((i, rid.to_owned()), req.clone());
        req
    }

    fn req(&self, i: usize, rid: &str) -> Request {
        self.reqs
            .get(&(i, rid.to_owned()))
            .cloned()
            .expect("request opened by the test")
    }

    pub fn lookup(&mut self, i: usize, rid: &str, key: &OffloadKey) -> LookupResult {
        let (now, req) = (self.now, self.req(i, rid));
        self.nodes[i].core.lookup(now, &req, key)
    }

    pub fn finish(&mut self, i: usize, rid: &str) {
        let (now, req) = (self.now, self.req(i, rid));
        self.nodes[i].core.finish(now, &req);
    }

    /// Connects node `a` to node `b` (a dials b) and runs the handshake.
    pub fn connect(&mut self, a: usize, b: usize) {
        let peer = self.nodes[b].id.clone();
        self.open(a, "__warmup", RequestRoles::prefiller(peer));
        self.finish(a, "__warmup");
        self.run();
    }

    /// A symmetric consumer request on `c` toward `p`: probe keys, wait for answers, fetch the
    /// hits into fresh blocks. Returns (load job if any, hits).
    pub fn symmetric_fetch(
        &mut self,
        c: usize,
        p: usize,
        rid: &str,
        keys: &[OffloadKey],
    ) -> (Option<JobId>, Vec<OffloadKey>) {
        let peer = self.nodes[p].id.clone();
        let req = self.open(c, rid, RequestRoles::kv_source(peer));
        self.run();
        for k in keys {
            self.lookup(c, rid, k);
        }
        let now = self.now;
        self.nodes[c].core.flush_lookups(now);
        self.run();
        let hits: Vec<OffloadKey> = keys
            .iter()
            .filter(|k| self.lookup(c, rid, k) == LookupResult::Hit)
            .cloned()
            .collect();
        if hits.is_empty() {
            return (None, hits);
        }
        let job = self.load_job();
        let blocks: Vec<BlockIndex> = (0..hits.len()).map(|i| dest_block(job, i)).collect();
        let now = self.now;
        self.nodes[c]
            .core
            .submit_load(now, job, &req, hits.clone(), blocks);
        self.run();
        (Some(job), hits)
    }

    /// Checks the blocks of load `job` (allocated by `symmetric_fetch`) hold `keys`.
    pub fn assert_landed(&mut self, c: usize, job: JobId, keys: &[OffloadKey]) {
        for (i, k) in keys.iter().enumerate() {
            let block = dest_block(job, i);
            assert_eq!(
                self.nodes[c].core.parent().landed.get(&block),
                Some(k),
                "block {block} of load {job}"
            );
        }
    }

    pub fn stats(&self, i: usize) -> CoreStats {
        self.nodes[i].core.stats()
    }

    /// The invariants every test ends with: nothing pinned, no request state, every job
    /// reported once, no message after disconnect, the fakes saw no misuse.
    pub fn assert_clean(&mut self) {
        assert!(
            self.after_disconnect.is_empty(),
            "{:?}",
            self.after_disconnect
        );
        for i in 0..self.nodes.len() {
            let parent = self.nodes[i].core.parent();
            assert!(
                parent.violations.is_empty(),
                "node {i}: {:?}",
                parent.violations
            );
            assert!(
                parent.pins.is_empty(),
                "node {i}: pins left {:?}",
                parent.pins
            );
            assert!(
                parent.open_ctxs.is_empty(),
                "node {i}: serve contexts left {:?}",
                parent.open_ctxs
            );
            let mut seen = HashSet::new();
            for (j, _) in &parent.completed {
                assert!(seen.insert(*j), "node {i}: store job {j} completed twice");
            }
            let mut loads = HashSet::new();
            for (j, _) in self.load_results(i) {
                assert!(loads.insert(j), "node {i}: load {j} reported twice");
            }
            let s = self.nodes[i].core.stats();
            assert_eq!(
                (
                    s.client_requests,
                    s.server_requests,
                    s.store_jobs,
                    s.inflight,
                    s.unbound_batches,
                    s.failed_ids
                ),
                (0, 0, 0, 0, 0, 0),
                "node {i}: state left: {s:?}"
            );
        }
    }

    /// Decodes nothing: a helper for tests that craft raw payloads.
    pub fn raw(&mut self, from: usize, to: usize, payload: &[u8]) {
        let peer = self.nodes[from].id.clone();
        let now = self.now;
        self.nodes[to].core.handle_payload(now, &peer, payload);
        let _ = decode(payload);
        self.settle();
    }
}
