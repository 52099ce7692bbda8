//! `EngineTier`: a kvpeer node inside an inference engine, over the engine's own block memory
//! (vLLM's primary tier), driven by the engine from whichever thread holds its lock.
//!
//! Python (`kvpeer.vllm.KvpeerTier`) gives work (`open`, `lookup`, `load`, `store`,
//! `finish`), takes results (`poll`'s events), peers' questions (`take_queries`), and pins the
//! node is done with (`take_releases`). By default the node's I/O runs on a thread of its own
//! (`io_thread`, [`SharedEngine`]): the engine's calls hand work over and take events, with
//! no system call but a wake of that thread; with `io_thread=False`, `poll` drives the node
//! (handles what arrived, waiting at most what it says). Every method releases the GIL while
//! Rust works; none waits on the network beyond the bound the caller gives `poll`. The node's
//! own state sits behind one mutex, so the object may be used from any Python thread, one call
//! at a time or not.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use kvpeer::engine::{
    BlockIndex, EngineEvent, EngineLink, EngineNode, JobId, KvRequestId, LookupResult, Request,
    RequestRoles, SharedEngine,
};
use kvpeer::node::build::BuildError;
use kvpeer::{OffloadKey, PeerId, PlaneKind};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{kvpeer_error, KvpeerError, PlaneUnavailable};
use crate::memory::{engine_pool, Export};
use crate::records::{Answer, JobEnd, LookedUp, Outstanding, Polled, Query, Release};
use crate::settings::node_config;

/// A request as the engine holds it (made by `EngineTier.open`).
#[pyclass(module = "kvpeer._native", frozen)]
pub(crate) struct NativeRequest {
    inner: Request,
}

#[pymethods]
impl NativeRequest {
    /// The request's `kv_request_id`.
    #[getter]
    fn kv_request_id(&self) -> String {
        self.inner.id().as_str().to_owned()
    }

    fn __repr__(&self) -> String {
        // Display: a long id is shown as its head and length.
        format!("NativeRequest({:?})", self.inner.id().to_string())
    }
}

/// A kvpeer node over an engine's block memory (see the module documentation).
#[pyclass(module = "kvpeer._native", frozen)]
pub(crate) struct EngineTier {
    engine: SharedEngine,
    /// The engine's end of the producer side; usable after shutdown (the last releases).
    link: EngineLink,
    /// Dropped after `engine` (declared after it): the memory outlives the node. Let go at
    /// `shutdown`, once the node is gone, so the engine can unmap its memory after it.
    export: Mutex<Option<Export>>,
    id: String,
    num_blocks: u64,
    block_len: u64,
    plane: PlaneKind,
}

#[pymethods]
impl EngineTier {
    /// Builds the node over `memory` (a writable 2-D buffer: one row per block) with
    /// `settings`, kvpeer's configuration keys as text (docs/configuration.md); `tag` names
    /// the node's objects. Binds the control channel and makes the data plane. `io_thread`:
    /// the node's I/O runs on a thread of its own (else on the callers' threads, in `poll`).
    #[new]
    #[pyo3(signature = (memory, settings, tag, *, io_thread=true))]
    fn new(
        py: Python<'_>,
        memory: &Bound<'_, PyAny>,
        settings: BTreeMap<String, String>,
        tag: &str,
        io_thread: bool,
    ) -> PyResult<Self> {
        let config = node_config(tag, "KvpeerTier settings", &settings)?;
        let shm = matches!(config.spec.plane, PlaneKind::Shm | PlaneKind::Both);
        let (pool, export) = engine_pool(memory, shm)?;
        let (num_blocks, block_len) = (pool.num_blocks(), pool.block_len());
        let plane = config.spec.plane;
        let built = py.detach(|| EngineNode::build(&config.spec, pool));
        let engine = match built {
            Ok(e) => e,
            Err(e @ BuildError::PlaneNotBuilt { .. }) => {
                return Err(PlaneUnavailable::new_err(e.to_string()))
            }
            Err(e) => return Err(kvpeer_error("cannot start the kvpeer node", &e)),
        };
        let id = engine.id().to_string();
        let link = engine.link();
        let engine = SharedEngine::new(engine, io_thread)
            .map_err(|e| kvpeer_error("cannot start the kvpeer node's I/O thread", &e))?;
        Ok(EngineTier {
            engine,
            link,
            export: Mutex::new(Some(export)),
            id,
            num_blocks,
            block_len,
            plane,
        })
    }

    /// The node's identity, `host:port` (its control address, which peers dial).
    #[getter]
    fn id(&self) -> &str {
        &self.id
    }

    /// Blocks in the engine's memory.
    #[getter]
    fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Bytes per block.
    #[getter]
    fn block_len(&self) -> u64 {
        self.block_len
    }

    /// The data plane in use: `tcp`, `shm`, `both` or `nixl`.
    #[getter]
    fn plane(&self) -> &'static str {
        self.plane.name()
    }

    /// Opens a request. `source`: the producer's `host:port` for a consumer (`probe` true for
    /// `remote_kv_source`, false for a PD `remote_prefiller`); `decoder`: this engine produces
    /// the request's blocks for a peer that fetches them (`remote_decoder`).
    #[pyo3(signature = (kv_request_id, *, source=None, probe=true, decoder=false))]
    fn open(
        &self,
        py: Python<'_>,
        kv_request_id: &str,
        source: Option<&str>,
        probe: bool,
        decoder: bool,
    ) -> PyResult<NativeRequest> {
        let id = KvRequestId::new(kv_request_id);
        let roles = RequestRoles {
            source: source.map(|peer| kvpeer_core::Source {
                peer: PeerId::new(peer),
                probe,
            }),
            decoder,
        };
        let inner = py.detach(|| self.with(|engine| Ok(engine.new_request_with(id, roles))))?;
        Ok(NativeRequest { inner })
    }

    /// The prefix-cache hash seed for sessions that begin from now on (vLLM resolves its seed
    /// after building its tiers).
    fn set_hash_seed(&self, py: Python<'_>, seed: &str) -> PyResult<()> {
        py.detach(|| {
            self.with(|engine| {
                engine.set_hash_seed(seed);
                Ok(())
            })
        })
    }

    /// Asks the request's producer about `keys`; answered by a later `poll`.
    fn lookup(&self, py: Python<'_>, request: &NativeRequest, keys: Vec<Vec<u8>>) -> PyResult<()> {
        let keys = offload_keys(keys);
        py.detach(|| {
            self.with(|engine| {
                engine.lookup(&request.inner, keys);
                Ok(())
            })
        })
    }

    /// Fetches `keys` into the engine's `blocks`; ends as a load event of `job`.
    fn load(
        &self,
        py: Python<'_>,
        job: u64,
        request: &NativeRequest,
        keys: Vec<Vec<u8>>,
        blocks: Vec<u64>,
    ) -> PyResult<()> {
        self.submit(py, Job::Load, job, request, keys, blocks)
    }

    /// Offers `keys` in the engine's pinned `blocks` to the peer that fetches the request (a PD
    /// producer); ends as a store event of `job` (at once for a request without that role).
    fn store(
        &self,
        py: Python<'_>,
        job: u64,
        request: &NativeRequest,
        keys: Vec<Vec<u8>>,
        blocks: Vec<u64>,
    ) -> PyResult<()> {
        self.submit(py, Job::Store, job, request, keys, blocks)
    }

    /// Ends a request: its waiting lookups answer miss, its loads still running fail.
    fn finish(&self, py: Python<'_>, request: &NativeRequest) -> PyResult<()> {
        py.detach(|| {
            self.with(|engine| {
                engine.finish(&request.inner);
                Ok(())
            })
        })
    }

    /// Fails every store no write reads: PD stores parked for a decoder that has not fetched
    /// them (a late fetch of their request is refused) and those held in sessions' rounds;
    /// each ends failed in a later `poll`. Writes in flight go on. `drain_jobs` before a
    /// reset. Returns the store jobs failed.
    fn fail_unwritten_stores(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        py.detach(|| {
            self.with(|engine| {
                Ok(engine
                    .fail_unwritten_stores()
                    .into_iter()
                    .map(|j| j.get())
                    .collect())
            })
        })
    }

    /// Aborts every load not aborting yet (each ends failed in a later `poll`, at its
    /// `abort_ack` or with its session): `drain_jobs` before a reset. Returns how many.
    fn abort_loads(&self, py: Python<'_>) -> PyResult<usize> {
        py.detach(|| self.with(|engine| Ok(engine.abort_loads())))
    }

    /// Reports a failed load whose producer may still write its blocks at once, as a
    /// `JobEnd` with `held` set, before its settled `JobEnd` (vLLM 0.34's deferred release).
    fn report_held_loads(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        py.detach(|| {
            self.with(|engine| {
                engine.report_held_loads(on);
                Ok(())
            })
        })
    }

    /// Returns what ended: answered lookups in the order asked, ended loads and stores. When
    /// none has, waits up to `wait_s` seconds for something to (with `io_thread=False`: handles
    /// what arrived first, waiting up to `wait_s` for it).
    #[pyo3(signature = (wait_s=0.0))]
    fn poll(&self, py: Python<'_>, wait_s: f64) -> PyResult<Polled> {
        let wait = duration(wait_s)?;
        let events = py.detach(|| self.engine.poll(wait)).ok_or_else(shut_down)?;
        polled(py, events)
    }

    /// Whether the node's I/O runs on a thread of its own.
    #[getter]
    fn io_thread(&self) -> bool {
        self.engine.has_io_thread()
    }

    /// Peers' questions the engine has not taken.
    fn take_queries(&self, py: Python<'_>) -> PyResult<Vec<Query>> {
        let link = self.link()?;
        let queries = py.detach(|| link.take_queries());
        Ok(queries
            .into_iter()
            .map(|q| Query {
                id: q.id.get(),
                peer: q.peer.to_string(),
                kv_request_id: q.kv_request_id.as_str().to_owned(),
                key: PyBytes::new(py, q.key.as_bytes()).unbind(),
            })
            .collect())
    }

    /// Answers questions (each an `Answer.hit`, `Answer.miss` or `Answer.pending`). Returns,
    /// per answer, whether it was taken (a refused hit's pin stays the engine's).
    fn answer(&self, py: Python<'_>, answers: Vec<PyRef<'_, Answer>>) -> PyResult<Vec<bool>> {
        let link = self.link()?;
        let parsed: Vec<_> = answers.iter().map(|a| (a.query, a.answer)).collect();
        // One wake of the node for all of them.
        Ok(py.detach(|| link.answer_all(parsed)))
    }

    /// Pins the node is done with.
    fn take_releases(&self, py: Python<'_>) -> PyResult<Vec<Release>> {
        let link = self.link()?;
        Ok(py.detach(|| {
            link.take_releases()
                .into_iter()
                .map(|r| Release {
                    pin: r.pin.0,
                    sent: r.sent,
                })
                .collect()
        }))
    }

    /// Questions not answered and pins not given back: both 0 once nothing of the engine's is
    /// held for a peer.
    fn outstanding(&self, py: Python<'_>) -> PyResult<Outstanding> {
        let (questions, pins) = py.detach(|| self.with(|engine| Ok(engine.outstanding())))?;
        Ok(Outstanding { questions, pins })
    }

    /// The node's running totals and open state, by name.
    fn stats(&self, py: Python<'_>) -> PyResult<BTreeMap<&'static str, u64>> {
        py.detach(|| {
            self.with(|engine| {
                let c = engine.counters();
                let s = engine.core_stats();
                Ok(BTreeMap::from([
                    ("lookups_sent", c.lookups_sent),
                    ("lookup_keys_sent", c.lookup_keys_sent),
                    ("lookup_hits_received", c.lookup_hits_received),
                    ("lookup_misses_received", c.lookup_misses_received),
                    ("lookups_served", c.lookups_served),
                    ("lookup_hits_served", c.lookup_hits_served),
                    ("lookup_misses_served", c.lookup_misses_served),
                    ("fetches_sent", c.fetches_sent),
                    ("fetch_blocks_sent", c.fetch_blocks_sent),
                    ("fetches_served", c.fetches_served),
                    ("fetch_blocks_served", c.fetch_blocks_served),
                    ("transfers_ok", c.transfers_ok),
                    ("transfers_failed", c.transfers_failed),
                    ("loads_ok", c.loads_ok),
                    ("loads_failed", c.loads_failed),
                    ("sessions_opened", c.sessions_opened),
                    ("sessions_closed", c.sessions_closed),
                    ("sessions", s.sessions as u64),
                    ("inflight_transfers", s.inflight as u64),
                    ("store_jobs", s.store_jobs as u64),
                ]))
            })
        })
    }

    /// Drains running writes for at most `drain_s` seconds, says `disconnect` to every peer
    /// and stops the node. Returns the loads and stores that ended with it; the pins it held
    /// come back from `take_releases`. Later calls fail, but for the link's (`take_queries`,
    /// `answer`, `take_releases`).
    #[pyo3(signature = (drain_s=3.0))]
    fn shutdown(&self, py: Python<'_>, drain_s: f64) -> PyResult<Polled> {
        let drain = duration(drain_s)?;
        let engine = py.detach(|| self.engine.stop());
        let Some(engine) = engine else {
            return polled(py, Vec::new());
        };
        let events = py.detach(|| engine.shutdown(drain));
        // The node, its pool and its planes are gone: the buffer export goes too (with the
        // GIL held), or stays if something still shares the pool (see `Export`).
        let export = self.export.lock().unwrap_or_else(|p| p.into_inner()).take();
        drop(export);
        polled(py, events)
    }

    fn __repr__(&self) -> String {
        format!(
            "EngineTier(id={:?}, plane={}, blocks={}x{})",
            self.id,
            self.plane.name(),
            self.num_blocks,
            self.block_len
        )
    }
}

/// Which of the engine's jobs [`EngineTier::submit`] hands over.
#[derive(Clone, Copy)]
enum Job {
    Load,
    Store,
}

impl EngineTier {
    /// Hands a load or a store of `keys` in `blocks` to the node, without the GIL.
    fn submit(
        &self,
        py: Python<'_>,
        kind: Job,
        job: u64,
        request: &NativeRequest,
        keys: Vec<Vec<u8>>,
        blocks: Vec<u64>,
    ) -> PyResult<()> {
        let (job, keys, blocks) = (JobId::new(job), offload_keys(keys), block_indices(blocks));
        py.detach(|| {
            self.with(|engine| {
                match kind {
                    Job::Load => engine.load(job, &request.inner, keys, blocks),
                    Job::Store => engine.store(job, &request.inner, keys, blocks),
                }
                .map_err(|e| PyValueError::new_err(e.to_string()))
            })
        })
    }

    fn with<T>(&self, f: impl FnOnce(&mut EngineNode) -> PyResult<T>) -> PyResult<T> {
        self.engine.with(f).unwrap_or_else(|| Err(shut_down()))
    }

    fn link(&self) -> PyResult<EngineLink> {
        Ok(self.link.clone())
    }
}

fn shut_down() -> PyErr {
    KvpeerError::new_err("the kvpeer node was shut down")
}

fn offload_keys(keys: Vec<Vec<u8>>) -> Vec<OffloadKey> {
    keys.iter().map(|k| OffloadKey::from_bytes(k)).collect()
}

fn block_indices(blocks: Vec<u64>) -> Vec<BlockIndex> {
    blocks.into_iter().map(BlockIndex::new).collect()
}

fn duration(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err(format!("{seconds} is not a duration in seconds")))
}

/// The engine's events as Python's records.
fn polled(py: Python<'_>, events: Vec<EngineEvent>) -> PyResult<Polled> {
    let (mut lookups, mut loads, mut stores) = (Vec::new(), Vec::new(), Vec::new());
    for event in events {
        match event {
            EngineEvent::LookedUp {
                kv_request_id,
                results,
            } => lookups.push(Py::new(
                py,
                LookedUp {
                    kv_request_id: kv_request_id.as_str().to_owned(),
                    hits: results
                        .into_iter()
                        .map(|r| r == LookupResult::Hit)
                        .collect(),
                },
            )?),
            EngineEvent::Loaded { job, success } => loads.push(Py::new(
                py,
                JobEnd {
                    job: job.get(),
                    success,
                    held: false,
                },
            )?),
            EngineEvent::LoadHeld { job } => loads.push(Py::new(
                py,
                JobEnd {
                    job: job.get(),
                    success: false,
                    held: true,
                },
            )?),
            EngineEvent::Stored { job, success } => stores.push(Py::new(
                py,
                JobEnd {
                    job: job.get(),
                    success,
                    held: false,
                },
            )?),
        }
    }
    Ok(Polled {
        lookups,
        loads,
        stores,
    })
}
