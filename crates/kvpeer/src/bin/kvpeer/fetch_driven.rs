//! `kvpeer fetch --driven`: the same workload as [`crate::fetch_cmd`] (what both share: [`crate::fetch_workload`]), with the node driven on
//! the command's own thread, as an inference engine embeds kvpeer ([`kvpeer::engine::EngineNode`]):
//! no runtime thread, so a lookup or a fetch costs no hop to another thread and back.
//!
//! The command is the engine here: it owns the pool's blocks (request slot `i` of the
//! `--concurrency` slots in flight loads into blocks `i·keys ..`), keeps up to `--concurrency`
//! requests in flight on this one thread, and reads the landed blocks back itself. Every phase
//! of a request (its lookup, its load) is bounded by `--timeout-secs`. The handshake with the
//! peer happens inside the first request's lookup (warm-up requests leave it out of the
//! figures).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvpeer::engine::{BlockIndex, EngineEvent, EngineNode, JobId, KvRequestId, Pool, Request};
use kvpeer::node::build::NodeSpec;
use kvpeer::{synthetic, LookupResult, NodeConfig, OffloadKey, PeerId};

use crate::fetch_error::FetchError;
use crate::fetch_workload::{
    block_len, micros, process_cpu, remove_pool_on_signal, request_keys, FetchArgs, Progress, Tally,
};

/// Runs the workload on an engine-driven node of `config`'s plane.
pub(crate) fn fetch(args: &FetchArgs, config: NodeConfig) -> Result<Tally, FetchError> {
    run(args, &config.spec)
}

/// Where one request in flight is.
enum Phase {
    /// Its lookup left at `since`.
    LookingUp { since: Instant },
    /// Its `hits` leading keys are loading as `job` since `since`.
    Loading {
        since: Instant,
        job: JobId,
        hits: usize,
    },
}

/// One request in flight, in slot `slot` (its blocks).
struct InFlight {
    r: u64,
    slot: u64,
    request: Request,
    keys: Vec<OffloadKey>,
    verify: bool,
    phase: Phase,
}

fn run(args: &FetchArgs, spec: &NodeSpec) -> Result<Tally, FetchError> {
    remove_pool_on_signal(&spec.shm_name)?;
    // The engine's memory: a named shared-memory pool, which every plane can serve from (the
    // shm plane needs one).
    let pool = Pool::shm(&spec.shm_name, spec.num_blocks, spec.block_len, false)?;
    let node = EngineNode::build(spec, pool)?;
    tracing::info!(id = %node.id(), peer = %args.peer, "consumer node up (driven)");
    let mut driver = Driver {
        node,
        args,
        peer: PeerId::new(args.peer.clone()),
        block_len: block_len(spec.block_len)?,
        timeout: Duration::from_secs(args.timeout_secs),
        in_flight: HashMap::new(),
        next_job: 0,
        // Read once: `getpid` is a system call per request otherwise.
        pid: std::process::id(),
    };
    let result = driver.workload();
    // `disconnect` to the peer, so it closes the session in order.
    driver.node.shutdown(Duration::from_secs(3));
    result
}

/// The workload's state: the node and the requests in flight.
struct Driver<'a> {
    node: EngineNode,
    args: &'a FetchArgs,
    peer: PeerId,
    block_len: usize,
    timeout: Duration,
    /// Requests in flight by their id.
    in_flight: HashMap<KvRequestId, InFlight>,
    next_job: u64,
    /// This process's id, in the request ids.
    pid: u32,
}

impl Driver<'_> {
    fn workload(&mut self) -> Result<Tally, FetchError> {
        let args = self.args;
        let mut tally = Tally::default();
        let mut progress = Progress::new(args.warmup + args.requests, !args.json);
        // The warm-up, one request at a time and every byte checked, then the timed requests
        // with `concurrency` in flight.
        self.run_requests(0..args.warmup, 1, true, &mut tally, &mut progress)?;
        if args.warmup > 0 {
            tally = Tally {
                failed_loads: tally.failed_loads,
                corrupt_blocks: tally.corrupt_blocks,
                ..Tally::default()
            };
        }
        let (started, cpu_before) = (Instant::now(), process_cpu());
        let timed = args.warmup..args.warmup + args.requests;
        self.run_requests(
            timed,
            args.concurrency.max(1),
            !args.no_verify,
            &mut tally,
            &mut progress,
        )?;
        progress.done();
        tally.workload = started.elapsed();
        tally.cpu = process_cpu().saturating_sub(cpu_before);
        // Our own shutdown comes after this: any session that ended so far ended under us.
        tally.sessions_lost = self.node.counters().sessions_closed;
        Ok(tally)
    }

    /// Runs requests `rs` with up to `concurrency` in flight, driving the node in between.
    fn run_requests(
        &mut self,
        rs: std::ops::Range<u64>,
        concurrency: u64,
        verify: bool,
        tally: &mut Tally,
        progress: &mut Progress,
    ) -> Result<(), FetchError> {
        let mut next = rs.start;
        let mut free_slots: Vec<u64> = (0..concurrency).rev().collect();
        while (next < rs.end && crate::fetch_workload::interrupted().is_none())
            || !self.in_flight.is_empty()
        {
            while next < rs.end && crate::fetch_workload::interrupted().is_none() {
                let Some(slot) = free_slots.pop() else { break };
                progress.show(next, tally);
                self.start(next, slot, verify);
                next += 1;
            }
            self.node.drive(self.until_next_deadline());
            while let Some(event) = self.node.poll_event() {
                if let Some(slot) = self.on_event(event, tally)? {
                    free_slots.push(slot);
                }
            }
            self.check_deadlines()?;
        }
        Ok(())
    }

    /// Opens request `r` in `slot` and sends its lookup.
    fn start(&mut self, r: u64, slot: u64, verify: bool) {
        let id = KvRequestId::from(format!("kvpeer-fetch-{}-{r}", self.pid));
        let request = self.node.new_request(id.clone(), self.peer.clone());
        let keys = request_keys(self.args, r);
        self.node.lookup(&request, keys.clone());
        self.in_flight.insert(
            id,
            InFlight {
                r,
                slot,
                request,
                keys,
                verify,
                phase: Phase::LookingUp {
                    since: Instant::now(),
                },
            },
        );
    }

    /// Moves the request `event` is about; returns its slot when the request ended.
    fn on_event(
        &mut self,
        event: EngineEvent,
        tally: &mut Tally,
    ) -> Result<Option<u64>, FetchError> {
        match event {
            EngineEvent::LookedUp {
                kv_request_id,
                results,
            } => {
                let Some(mut req) = self.in_flight.remove(&kv_request_id) else {
                    return Ok(None);
                };
                let Phase::LookingUp { since } = req.phase else {
                    return Err(FetchError::SecondAnswer(req.r));
                };
                tally.lookup_us.push(micros(since.elapsed()));
                // A prefix cache uses the leading run of hits.
                let hits = results
                    .iter()
                    .take_while(|f| **f == LookupResult::Hit)
                    .count();
                tally.hits += hits as u64;
                tally.misses += (req.keys.len() - hits) as u64;
                if hits == 0 {
                    // No fetch: finishing sends the terminal empty fetch.
                    self.node.finish(&req.request);
                    return Ok(Some(req.slot));
                }
                self.next_job += 1;
                let job = JobId::new(self.next_job);
                let first = req.slot * self.args.keys;
                let blocks = (first..first + hits as u64).map(BlockIndex::new).collect();
                self.node
                    .load(job, &req.request, req.keys[..hits].to_vec(), blocks)
                    .map_err(|error| FetchError::Load { r: req.r, error })?;
                req.phase = Phase::Loading {
                    since: Instant::now(),
                    job,
                    hits,
                };
                self.in_flight.insert(kv_request_id, req);
                Ok(None)
            }
            EngineEvent::Loaded { job, success } => {
                let Some(id) = self.in_flight.iter().find_map(|(id, f)| {
                    matches!(f.phase, Phase::Loading { job: j, .. } if j == job).then(|| id.clone())
                }) else {
                    return Ok(None);
                };
                let Some(req) = self.in_flight.remove(&id) else {
                    return Ok(None);
                };
                if let Phase::Loading { since, hits, .. } = req.phase {
                    if success {
                        tally.fetch_us.push(micros(since.elapsed()));
                        self.account_blocks(&req, hits, tally);
                    } else {
                        tally.failed_loads += 1;
                    }
                }
                self.node.finish(&req.request);
                Ok(Some(req.slot))
            }
            EngineEvent::Stored { .. } | EngineEvent::LoadHeld { .. } => Ok(None),
        }
    }

    /// Counts the bytes of a landed load, and checks them against the synthetic content.
    fn account_blocks(&self, req: &InFlight, hits: usize, tally: &mut Tally) {
        if !req.verify {
            tally.bytes += hits as u64 * self.block_len as u64;
            return;
        }
        let mut buf = vec![0u8; self.block_len];
        let first = req.slot * self.args.keys;
        for (i, key) in req.keys[..hits].iter().enumerate() {
            let block = BlockIndex::new(first + i as u64);
            match self.node.read_block(block, &mut buf) {
                Ok(()) => {
                    tally.bytes += buf.len() as u64;
                    if buf != synthetic::content(key, self.block_len) {
                        tally.corrupt_blocks += 1;
                    }
                }
                Err(_) => tally.corrupt_blocks += 1,
            }
        }
    }

    /// How long the next drive may wait: until the earliest phase deadline (at most 100 ms,
    /// so a stalled run is noticed).
    fn until_next_deadline(&self) -> Duration {
        let now = Instant::now();
        self.in_flight
            .values()
            .map(|f| (self.phase_since(f) + self.timeout).saturating_duration_since(now))
            .min()
            .unwrap_or(Duration::ZERO)
            .min(Duration::from_millis(100))
    }

    fn phase_since(&self, f: &InFlight) -> Instant {
        match f.phase {
            Phase::LookingUp { since } | Phase::Loading { since, .. } => since,
        }
    }

    /// A request whose phase took longer than `--timeout-secs` ends the run.
    fn check_deadlines(&self) -> Result<(), FetchError> {
        for f in self.in_flight.values() {
            if self.phase_since(f).elapsed() > self.timeout {
                let what = match f.phase {
                    Phase::LookingUp { .. } => "lookup",
                    Phase::Loading { .. } => "fetch",
                };
                return Err(FetchError::Late {
                    r: f.r,
                    phase: what,
                    secs: self.args.timeout_secs,
                });
            }
        }
        Ok(())
    }
}
