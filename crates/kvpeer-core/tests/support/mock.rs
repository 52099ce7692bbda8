//! One core and a scripted peer (like h2's mock peer): the test writes exactly what the peer
//! sends and reads exactly what the core sends back, with virtual time.

use std::time::{Duration, Instant};

use std::collections::HashMap;

use kvpeer_core::{
    BlockIndex, Core, CoreConfig, Event, JobId, LookupResult, Request, RequestRoles,
};
use kvpeer_proto::{
    Abort, Connect, ConnectAck, Fetch, KvRequestId, LookupResp, Message, OffloadKey, PeerId,
    RoundSeq, TransferDone,
};

use super::cluster::{local, peer_id, TestCore};
use super::fakes::{FakeParent, FakePlane};

pub struct Mock {
    pub now: Instant,
    pub core: TestCore,
    /// The scripted peer.
    pub peer: PeerId,
    /// Everything the core sent to the peer, not yet taken.
    pub sent: Vec<Message>,
    /// Every event.
    pub events: Vec<Event>,
    /// The engine's request handles, by name.
    pub reqs: HashMap<String, Request>,
}

impl Mock {
    pub fn new() -> Self {
        Self::with_config(CoreConfig::default())
    }

    pub fn with_config(config: CoreConfig) -> Self {
        let now = Instant::now();
        Mock {
            now,
            core: Core::new(
                config,
                local(0),
                FakeParent::default(),
                FakePlane::default(),
                now,
            ),
            peer: peer_id(1),
            sent: Vec::new(),
            events: Vec::new(),
            reqs: HashMap::new(),
        }
    }

    pub fn parent(&mut self) -> &mut FakeParent {
        self.core.parent_mut()
    }

    pub fn plane(&mut self) -> &mut FakePlane {
        self.core.plane_mut()
    }

    /// Collects the core's outputs.
    pub fn pump(&mut self) {
        while let Some(t) = self.core.poll_transmit() {
            if t.peer == self.peer {
                self.sent.push(t.message);
            }
        }
        while let Some(e) = self.core.poll_event() {
            self.events.push(e);
        }
    }

    pub fn take_sent(&mut self) -> Vec<Message> {
        self.pump();
        std::mem::take(&mut self.sent)
    }

    /// The peer's `connect`, compatible with the core's node.
    pub fn peer_connect(&self) -> Connect {
        let l = local(1);
        Connect {
            peer_id: l.peer_id,
            agent_metadata: l.agent_metadata,
            base_addr: l.base_addr,
            num_blocks: l.num_blocks,
            block_len: l.block_len,
            config_fingerprint: Some(l.config_fingerprint),
            hash_seed: l.hash_seed,
            kvpeer_auth: None,
        }
    }

    /// The peer connects to the core (an inbound session).
    pub fn accept(&mut self) -> bool {
        let accepted = self.core.handle_inbound(self.now, self.peer.clone());
        self.pump();
        accepted
    }

    /// The engine opens a request with `roles` (a consumer dials its producer).
    pub fn open(&mut self, rid: &str, roles: RequestRoles) -> Request {
        let req = self
            .core
            .on_new_request(self.now, KvRequestId::from(rid), roles);
        self.reqs.insert(rid.to_owned(), req.clone());
        self.pump();
        req
    }

    /// The core dials the peer (a consumer request toward it).
    pub fn dial(&mut self, rid: &str, roles: RequestRoles) {
        self.open(rid, roles);
    }

    /// The handle of request `rid`; a request the test never opened is opened with no roles.
    pub fn req(&mut self, rid: &str) -> Request {
        match self.reqs.get(rid) {
            Some(r) => r.clone(),
            None => self.open(rid, RequestRoles::default()),
        }
    }

    /// The engine stores blocks for `rid` (pinned as job `job`).
    pub fn store(
        &mut self,
        job: impl Into<JobId>,
        rid: &str,
        keys: Vec<OffloadKey>,
        blocks: Vec<impl Into<BlockIndex>>,
    ) {
        let req = self.req(rid);
        let blocks = blocks.into_iter().map(Into::into).collect();
        self.core
            .submit_store(self.now, job.into(), &req, keys, blocks);
        self.pump();
    }

    /// The peer sends a message.
    pub fn recv(&mut self, message: Message) {
        self.core
            .handle_message(self.now, &self.peer.clone(), message);
        self.pump();
    }

    /// The peer sends raw bytes.
    pub fn recv_raw(&mut self, payload: &[u8]) {
        self.core
            .handle_payload(self.now, &self.peer.clone(), payload);
        self.pump();
    }

    /// Full handshake from the peer's side: its connect, then its ack of ours.
    pub fn handshake(&mut self) {
        let c = self.peer_connect();
        self.recv(Message::Connect(c));
        self.recv(Message::ConnectAck(ConnectAck {
            peer_id: self.peer.clone(),
        }));
    }

    /// Accept an inbound peer and complete the handshake; forget what was sent.
    pub fn ready_inbound(&mut self) {
        assert!(self.accept());
        self.handshake();
        self.take_sent();
    }

    /// Dial the peer for a symmetric consumer request and complete the handshake.
    pub fn ready_source(&mut self, rid: &str) {
        self.dial(rid, RequestRoles::kv_source(self.peer.clone()));
        self.handshake();
        self.take_sent();
    }

    /// Advances virtual time, firing every deadline on the way.
    pub fn advance(&mut self, d: Duration) {
        let end = self.now + d;
        loop {
            self.pump();
            match self.core.poll_timeout() {
                Some(t) if t <= end => {
                    self.now = self.now.max(t);
                    self.core.handle_timeout(self.now);
                }
                _ => break,
            }
        }
        self.now = end;
        self.core.handle_timeout(self.now);
        self.pump();
    }

    pub fn lookup(&mut self, rid: &str, key: &OffloadKey) -> LookupResult {
        let req = self.req(rid);
        let r = self.core.lookup(self.now, &req, key);
        self.pump();
        r
    }

    pub fn flush(&mut self) {
        self.core.flush_lookups(self.now);
        self.pump();
    }

    pub fn load(
        &mut self,
        job: impl Into<JobId>,
        rid: &str,
        keys: Vec<OffloadKey>,
        blocks: Vec<impl Into<BlockIndex>>,
    ) {
        let req = self.req(rid);
        let blocks = blocks.into_iter().map(Into::into).collect();
        self.core
            .submit_load(self.now, job.into(), &req, keys, blocks);
        self.pump();
    }

    pub fn finish(&mut self, rid: &str) {
        let req = self.req(rid);
        self.core.finish(self.now, &req);
        self.pump();
    }

    pub fn data_plane(&mut self) {
        self.core.handle_data_plane(self.now);
        self.pump();
    }

    /// The scripted peer is in the middle of writing local block `block` (a stalled producer):
    /// the plane does not fence it until the test clears `plane().writing`.
    pub fn stall_write(&mut self, block: u64) {
        let peer = self.peer.clone();
        self.plane()
            .writing
            .entry(peer)
            .or_default()
            .insert(BlockIndex::new(block));
    }

    pub fn load_results(&self) -> Vec<(JobId, bool)> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::LoadDone { job, success, .. } => Some((*job, *success)),
                _ => None,
            })
            .collect()
    }

    /// Loads reported failed while their blocks stay held (`LoadHeld`).
    pub fn held_loads(&self) -> Vec<JobId> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::LoadHeld { job, .. } => Some(*job),
                _ => None,
            })
            .collect()
    }

    pub fn store_results(&self) -> Vec<(JobId, bool)> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::StoreDone { job, success } => Some((*job, *success)),
                _ => None,
            })
            .collect()
    }

    pub fn closed(&self) -> Option<String> {
        self.events.iter().find_map(|e| match e {
            Event::Close { end, .. } => Some(end.to_string()),
            _ => None,
        })
    }

    /// The invariants every session test ends with (at the core's side).
    pub fn assert_clean(&mut self) {
        self.pump();
        self.check_invariants();
    }

    fn check_invariants(&mut self) {
        let p = self.core.parent();
        assert!(p.violations.is_empty(), "{:?}", p.violations);
        assert!(p.pins.is_empty(), "pins left: {:?}", p.pins);
        assert!(p.open_ctxs.is_empty(), "contexts left: {:?}", p.open_ctxs);
        let mut seen = std::collections::HashSet::new();
        for (j, _) in &p.completed {
            assert!(seen.insert(*j), "store job {j} completed twice");
        }
        let mut loads = std::collections::HashSet::new();
        for (j, _) in self.load_results() {
            assert!(loads.insert(j), "load {j} reported twice");
        }
        let s = self.core.stats();
        assert_eq!(
            (
                s.client_requests,
                s.server_requests,
                s.store_jobs,
                s.inflight,
                s.unbound_batches
            ),
            (0, 0, 0, 0, 0),
            "state left: {s:?}"
        );
        if let Some(at) = self.sent.iter().position(|m| *m == Message::DISCONNECT) {
            let after: Vec<_> = self.sent[at + 1..]
                .iter()
                .take_while(|m| !matches!(m, Message::Connect(_)))
                .collect();
            assert!(after.is_empty(), "sent after disconnect: {after:?}");
        }
    }
}

/// At the end of every passing test: finish what the test left open, shut the core down, and
/// check nothing is left behind (the invariants hold after any test, not only those that call
/// `assert_clean` themselves).
impl Drop for Mock {
    fn drop(&mut self) {
        if std::thread::panicking() {
            return;
        }
        let reqs: Vec<Request> = self.reqs.values().cloned().collect();
        for req in &reqs {
            self.core.finish(self.now, req);
        }
        self.core.shutdown(self.now);
        self.pump();
        self.reqs.clear();
        self.check_invariants();
    }
}

pub fn rid(s: &str) -> KvRequestId {
    KvRequestId::from(s)
}

pub fn fetch(id: &str, keys: Vec<OffloadKey>, blocks: Vec<u64>, round: u64) -> Message {
    Message::Fetch(Fetch {
        kv_request_id: rid(id),
        keys,
        block_indexes: blocks,
        round_seq: RoundSeq(round),
    })
}

pub fn transfer_done(id: &str, success: bool, round: u64) -> Message {
    Message::TransferDone(TransferDone {
        kv_request_id: rid(id),
        success,
        round_seq: RoundSeq(round),
    })
}

pub fn abort_fetch(id: &str, round: u64) -> Message {
    Message::AbortFetch(Abort {
        kv_request_id: rid(id),
        round_seq: RoundSeq(round),
    })
}

pub fn abort_ack(id: &str, round: u64) -> Message {
    Message::AbortAck(Abort {
        kv_request_id: rid(id),
        round_seq: RoundSeq(round),
    })
}

pub fn lookup_msg(id: &str, keys: Vec<OffloadKey>, round: u64) -> Message {
    Message::Lookup(kvpeer_proto::Lookup {
        kv_request_id: rid(id),
        keys,
        round_seq: RoundSeq(round),
    })
}

pub fn lookup_resp(id: &str, keys: Vec<OffloadKey>, hits: Vec<bool>) -> Message {
    Message::LookupResp(LookupResp {
        kv_request_id: rid(id),
        keys,
        hits,
    })
}

pub fn is_type(m: &Message, t: kvpeer_proto::MessageType) -> bool {
    m.message_type() == t
}
