//! The runtime thread: the one thread that owns a node's core, store, plane and control
//! channel, and serves the [`Node`](crate::Node) handle's calls.
//!
//! It sleeps in [`NodeIo::wait`] until a control socket is readable, a data-plane completion or
//! a call arrives (both write to the wake pipe), the core's next deadline, or the nearest
//! deadline of a call it is working on. Nothing polls on an interval: an idle node sleeps until
//! a heartbeat or a peer wakes it. Calls reply on their own channel; a call whose caller has gone
//! away is finished and its reply dropped.

use std::collections::HashMap;
use std::sync::mpsc::{Receiver, Sender, TryRecvError};
use std::time::{Duration, Instant};

use kvpeer_core::{BlockIndex, JobId, LookupResult, Request, RequestRoles};
use kvpeer_proto::{KvRequestId, OffloadKey, PeerId};
use kvpeer_store::{KeyChange, Tenant};
use tracing::{debug, info};

use crate::api::{Histogram, NodeError, NodeStats};
use crate::node::io::NodeIo;
use crate::node::lookup_waits::{Ended, LookupWaits, Waiting};

/// Writes block `i` of a `store_with` call in place.
pub(crate) type FillBlock = Box<dyn FnMut(usize, &mut [u8]) + Send>;

/// A call from the handle.
pub(crate) enum Command {
    Store {
        blocks: Vec<(OffloadKey, Vec<u8>)>,
        reply: Sender<Result<(), NodeError>>,
    },
    StoreWith {
        keys: Vec<OffloadKey>,
        fill: FillBlock,
        reply: Sender<Result<usize, NodeError>>,
    },
    Connect {
        peer: PeerId,
        deadline: Instant,
        reply: Sender<Result<(), NodeError>>,
    },
    /// Opens request `id` for the handle `token` (no answer: a handle's later calls learn
    /// whether it holds the request).
    Open {
        peer: PeerId,
        id: KvRequestId,
        token: u64,
    },
    Lookup {
        id: KvRequestId,
        token: u64,
        keys: Vec<OffloadKey>,
        deadline: Instant,
        reply: Sender<Result<Vec<LookupResult>, NodeError>>,
    },
    Fetch {
        id: KvRequestId,
        token: u64,
        keys: Vec<OffloadKey>,
        deadline: Instant,
        reply: Sender<Result<(), NodeError>>,
    },
    Read {
        keys: Vec<OffloadKey>,
        reply: Sender<Vec<Option<Vec<u8>>>>,
    },
    Finish {
        id: KvRequestId,
        token: u64,
    },
    /// Which keys the store holds readable.
    Contains {
        keys: Vec<OffloadKey>,
        /// In the tenant of this peer (a block pulled from it is its tenant's); `None`: the
        /// node's own blocks.
        tenant_of: Option<PeerId>,
        reply: Sender<Vec<bool>>,
    },
    /// Which keys the store holds readable, each held one made the most recently used.
    Touch {
        keys: Vec<OffloadKey>,
        reply: Sender<Vec<bool>>,
    },
    /// The store's change log since the last call (recording starts with the first call,
    /// at most `max` changes kept between two calls), and how many were dropped for room.
    TakeChanges {
        max: usize,
        reply: Sender<(Vec<KeyChange>, u64)>,
    },
    Stats {
        reply: Sender<NodeStats>,
    },
    Shutdown {
        drain: Duration,
        reply: Sender<()>,
    },
}

struct PendingConnect {
    peer: PeerId,
    since: Instant,
    deadline: Instant,
    reply: Sender<Result<(), NodeError>>,
}

/// Where a waiting lookup's answer goes.
type LookupReply = Sender<Result<Vec<LookupResult>, NodeError>>;

struct PendingLoad {
    started: Instant,
    blocks: Vec<BlockIndex>,
    deadline: Instant,
    /// `None` once the caller has been answered (it gave up waiting).
    reply: Option<Sender<Result<(), NodeError>>>,
}

/// The thread's state besides the node itself.
struct Runtime {
    io: NodeIo,
    /// The requests open now, each with the token of the handle that holds it: one request
    /// per id at a time (the core keys its state by id), and only its own handle's calls
    /// reach it (a second handle for an open id gets `RequestOpen`).
    open: HashMap<KvRequestId, (Request, u64)>,
    connects: Vec<PendingConnect>,
    /// Lookups waiting for answers, asked about again only when the core has news for them.
    lookups: LookupWaits<LookupReply>,
    /// Loads by job, until the core reports them ended (a caller that gave up waiting has
    /// been answered already; its blocks stay reserved until then).
    loads: HashMap<JobId, PendingLoad>,
    next_job: JobId,
    /// Totals and latencies of the calls (the rest of the stats comes from the core and store).
    calls: NodeStats,
}

/// Runs the node until a `Shutdown` call, or until every handle is gone.
pub(crate) fn run(io: NodeIo, calls: Receiver<Command>) {
    let mut rt = Runtime {
        io,
        open: HashMap::new(),
        connects: Vec::new(),
        lookups: LookupWaits::default(),
        loads: HashMap::new(),
        next_job: JobId::new(1),
        calls: NodeStats::default(),
    };
    rt.io.watch_outcomes();
    loop {
        let now = Instant::now();
        rt.io.step(now);
        loop {
            match calls.try_recv() {
                Ok(Command::Shutdown { drain, reply }) => {
                    rt.shutdown(drain);
                    let _ = reply.send(());
                    return;
                }
                Ok(call) => rt.call(call),
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    rt.shutdown(Duration::from_secs(3));
                    return;
                }
            }
        }
        rt.io.flush(Instant::now());
        rt.progress(Instant::now());
        rt.io.flush(Instant::now());
        let max = rt.next_deadline().map_or(Duration::from_secs(3600), |d| {
            d.saturating_duration_since(now)
        });
        rt.io.wait(Instant::now(), max);
    }
}

impl Runtime {
    fn call(&mut self, call: Command) {
        let now = Instant::now();
        match call {
            Command::Store { blocks, reply } => {
                let mut result = Ok(());
                for (key, bytes) in &blocks {
                    if let Err(e) = self.io.core.parent_mut().put(key, bytes) {
                        result = Err(NodeError::Store(e));
                        break;
                    }
                }
                let _ = reply.send(result);
            }
            Command::StoreWith {
                keys,
                mut fill,
                reply,
            } => {
                let _ = reply.send(self.store_in_place(&keys, &mut fill));
            }
            Command::Connect {
                peer,
                deadline,
                reply,
            } => {
                if self.io.core.connect(now, &peer) {
                    self.connects.push(PendingConnect {
                        peer,
                        since: now,
                        deadline,
                        reply,
                    });
                } else {
                    let _ = reply.send(Err(NodeError::Refused { peer, end: None }));
                }
            }
            Command::Open { peer, id, token } => {
                if !self.open.contains_key(&id) {
                    let req =
                        self.io
                            .core
                            .on_new_request(now, id.clone(), RequestRoles::kv_source(peer));
                    self.open.insert(id, (req, token));
                }
            }
            Command::Lookup {
                id,
                token,
                keys,
                deadline,
                reply,
            } => {
                let Some(req) = self.held(&id, token) else {
                    let _ = reply.send(Err(NodeError::RequestOpen(id)));
                    return;
                };
                let waiting = Waiting {
                    started: now,
                    request: req,
                    keys,
                    deadline: Some(deadline),
                    with: reply,
                };
                let latency = &mut self.calls.lookup_latency;
                self.lookups.add(&mut self.io, now, waiting, |w, end| {
                    answer(latency, now, w, end)
                });
            }
            Command::Fetch {
                id,
                token,
                keys,
                deadline,
                reply,
            } => {
                let Some(req) = self.held(&id, token) else {
                    let _ = reply.send(Err(NodeError::RequestOpen(id)));
                    return;
                };
                // The blocks are the tenant's of the peer they come from, or ours from a shared
                // node (one index for all on a node that keeps no tenants apart).
                let me = self.io.core.local().peer_id.clone();
                let store = self.io.core.parent_mut();
                let tenant = req
                    .roles()
                    .source
                    .as_ref()
                    .map_or(Tenant::DEFAULT, |s| store.tenant_of_fetch(&s.peer, &me));
                let blocks = match store.reserve_in(tenant, &keys) {
                    Ok(b) => b,
                    Err(e) => {
                        let _ = reply.send(Err(NodeError::Store(e)));
                        return;
                    }
                };
                let job = self.next_job;
                self.next_job = JobId::new(job.get() + 1);
                self.io
                    .core
                    .submit_load(now, job, &req, keys, blocks.clone());
                let latency = &mut self.calls.lookup_latency;
                self.lookups.recheck(&mut self.io, now, &id, |w, end| {
                    answer(latency, now, w, end)
                });
                self.loads.insert(
                    job,
                    PendingLoad {
                        started: now,
                        blocks,
                        deadline,
                        reply: Some(reply),
                    },
                );
            }
            Command::Read { keys, reply } => {
                let store = self.io.core.parent();
                let out = keys
                    .iter()
                    .map(|k| {
                        store
                            .block_of_any(k)
                            .and_then(|b| store.read(b).ok())
                            .map(<[u8]>::to_vec)
                    })
                    .collect();
                let _ = reply.send(out);
            }
            Command::Contains {
                keys,
                tenant_of,
                reply,
            } => {
                let me = self.io.core.local().peer_id.clone();
                let store = self.io.core.parent_mut();
                let held: Vec<bool> = match tenant_of {
                    // Where a block fetched from that peer would go.
                    Some(p) => {
                        let tenant = store.tenant_of_fetch(&p, &me);
                        keys.iter().map(|k| store.holds_in(tenant, k)).collect()
                    }
                    // Held in memory or on disk: a pool does not pull what its disk holds.
                    None => keys.iter().map(|k| store.holds_any(k)).collect(),
                };
                let _ = reply.send(held);
            }
            Command::Touch { keys, reply } => {
                let store = self.io.core.parent_mut();
                let _ = reply.send(
                    keys.iter()
                        .map(|k| store.lookup_any(k) == LookupResult::Hit)
                        .collect(),
                );
            }
            Command::TakeChanges { max, reply } => {
                let store = self.io.core.parent_mut();
                if !store.recording_changes() {
                    store.record_changes(max);
                }
                let _ = reply.send(store.take_changes());
            }
            Command::Finish { id, token } => {
                // Only the handle that holds the request finishes it (once: its drop).
                if self.held(&id, token).is_some() {
                    if let Some((req, _)) = self.open.remove(&id) {
                        // Its lookups still waiting go too (their caller is gone): asking
                        // the core about a finished request would open it again.
                        drop(self.lookups.remove_request(&id));
                        self.io.core.finish(now, &req);
                    }
                }
            }
            Command::Stats { reply } => {
                let _ = reply.send(NodeStats {
                    core: self.io.core.stats(),
                    store: self.io.core.parent().stats(),
                    counters: *self.io.core.counters(),
                    refused_peers: self.io.refused_peers() as u64,
                    inbound_held_back: self.io.channel().inbound_held_back(),
                    host_liveness: self.io.channel().host_liveness(),
                    ..self.calls.clone()
                });
            }
            Command::Shutdown { .. } => {}
        }
    }

    /// The request `id`, if the handle `token` holds it.
    fn held(&self, id: &KvRequestId, token: u64) -> Option<Request> {
        match self.open.get(id) {
            Some((req, holder)) if *holder == token => Some(req.clone()),
            _ => None,
        }
    }

    /// Allocates blocks for the keys not held yet, lets `fill` write each in place, and makes
    /// them readable; returns how many were written.
    fn store_in_place(
        &mut self,
        keys: &[OffloadKey],
        fill: &mut FillBlock,
    ) -> Result<usize, NodeError> {
        let store = self.io.core.parent_mut();
        let (positions, new): (Vec<usize>, Vec<OffloadKey>) = keys
            .iter()
            .enumerate()
            .filter(|(_, k)| store.block_of(k).is_none())
            .map(|(i, k)| (i, k.clone()))
            .unzip();
        let blocks = store.reserve(&new).map_err(NodeError::Store)?;
        for (&i, &b) in positions.iter().zip(&blocks) {
            let written = match store.write_target(b) {
                // A panicking `fill` must not take the node's thread down with it.
                Ok(bytes) => {
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| fill(i, bytes)))
                        .map_err(|_| NodeError::FillPanicked)
                }
                Err(e) => Err(NodeError::Store(e)),
            };
            if let Err(e) = written {
                store.finish_write(&blocks, false);
                return Err(e);
            }
        }
        store.finish_write(&blocks, true);
        Ok(blocks.len())
    }

    /// Answers calls whose work is done or whose deadline passed.
    fn progress(&mut self, now: Instant) {
        let io = &self.io;
        self.connects
            .retain(|c| match io.core.session_state(&c.peer) {
                Some(s) if s.ready => {
                    let _ = c.reply.send(Ok(()));
                    false
                }
                None => {
                    let _ = c.reply.send(Err(NodeError::Refused {
                        peer: c.peer.clone(),
                        end: io.close_reason(&c.peer).cloned().map(Box::new),
                    }));
                    false
                }
                Some(_) if now >= c.deadline => {
                    let _ = c.reply.send(Err(NodeError::ConnectTimeout {
                        peer: c.peer.clone(),
                        after: c.deadline.saturating_duration_since(c.since),
                        stage: io.channel.outbound_stage(&c.peer),
                    }));
                    false
                }
                Some(_) => true,
            });
        let news = self.io.take_outcomes();
        let latency = &mut self.calls.lookup_latency;
        self.lookups
            .progress(&mut self.io, now, &news.answered, &news.ended, |w, end| {
                answer(latency, now, w, end)
            });
        if !self.lookups.is_empty() {
            // Keys still at RETRY (no session yet, or asked while it was opening) go out now.
            self.io.core.flush_lookups(now);
        }
        for job in self.io.take_held_loads() {
            // Failed now; its blocks stay reserved here until its result below.
            if let Some(reply) = self.loads.get_mut(&job).and_then(|l| l.reply.take()) {
                let _ = reply.send(Err(NodeError::LoadFailed));
            }
        }
        for (job, success) in self.io.take_load_results() {
            let Some(l) = self.loads.remove(&job) else {
                continue;
            };
            self.io.core.parent_mut().finish_write(&l.blocks, success);
            if success {
                self.calls.bytes_fetched += l.blocks.len() as u64 * self.io.core.local().block_len;
            }
            if let Some(reply) = l.reply {
                self.calls
                    .fetch_latency
                    .record(now.saturating_duration_since(l.started));
                let _ = reply.send(if success {
                    Ok(())
                } else {
                    Err(NodeError::LoadFailed)
                });
            }
        }
        for l in self.loads.values_mut() {
            if now >= l.deadline {
                // The caller stops waiting; the core's own load deadline ends the round, and
                // the blocks are released when it does.
                if let Some(reply) = l.reply.take() {
                    let _ = reply.send(Err(NodeError::Timeout("fetch")));
                }
            }
        }
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.lookups
            .next_deadline()
            .into_iter()
            .chain(self.connects.iter().map(|c| c.deadline))
            .chain(
                self.loads
                    .values()
                    .filter(|l| l.reply.is_some())
                    .map(|l| l.deadline),
            )
            .min()
    }

    /// Drains inflight transfers (bounded by `drain`), then ends every session with a
    /// `disconnect` and lets the messages leave.
    fn shutdown(&mut self, drain: Duration) {
        info!("shutting down");
        self.io.shutdown(drain);
        for (_, l) in self.loads.drain() {
            self.io.core.parent_mut().finish_write(&l.blocks, false);
            if let Some(reply) = l.reply {
                let _ = reply.send(Err(NodeError::ShutDown));
            }
        }
        for l in self.lookups.drain() {
            let _ = l.with.send(Err(NodeError::ShutDown));
        }
        for c in self.connects.drain(..) {
            let _ = c.reply.send(Err(NodeError::ShutDown));
        }
        debug!("runtime stopped");
    }
}

/// Answers a lookup that ended: its results, or the caller's timeout.
fn answer(latency: &mut Histogram, now: Instant, waiting: Waiting<LookupReply>, end: Ended) {
    let result = match end {
        Ended::Answered(results) => {
            latency.record(now.saturating_duration_since(waiting.started));
            Ok(results)
        }
        Ended::Expired => Err(NodeError::Timeout("lookup")),
    };
    let _ = waiting.with.send(result);
}
