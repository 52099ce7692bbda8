//! `Node`: a standalone kvpeer node for Python, with its own pool and runtime thread (the Rust
//! [`kvpeer::Node`]): store blocks for peers, look up and fetch a peer's blocks, read what
//! landed. Calls that wait for a peer take a timeout and release the GIL while they wait.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use kvpeer::node::build::BuildError;
use kvpeer::{Node as RustNode, NodeError, OffloadKey, PeerId};
use pyo3::exceptions::{PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::{kvpeer_error, ConfigError, PeerUnavailable, PlaneUnavailable};
use crate::settings::{node_config, settings_text};

/// Nodes made by this process so far.
static NODES: AtomicU64 = AtomicU64::new(0);

/// A kvpeer node with its own pool and thread.
///
/// Node(settings: dict[str, str | int | float | bool | list[str]] = {}, tag: str = "python")
///
/// `settings` are kvpeer's configuration keys (docs/configuration.md) with the values a config
/// file takes; unset keys take their defaults. A bad one raises `ConfigError` (its args: the
/// message and the key). Keys are `bytes` (vLLM's: a 32-byte hash and a 4-byte group index);
/// every block is exactly `block_len` bytes. `with kvpeer.Node(...) as node:` stops it at the
/// block's end. Its logs go to Python's `logging` (logger `kvpeer`).
#[pyclass(module = "kvpeer._native", frozen)]
pub(crate) struct Node {
    inner: RustNode,
}

#[pymethods]
impl Node {
    /// Starts a node with `settings` (kvpeer's configuration keys as text, see
    /// docs/configuration.md; unset keys take their defaults); `tag` names its pool's shm
    /// object.
    #[new]
    #[pyo3(signature = (settings=BTreeMap::new(), tag="python"))]
    fn new(
        py: Python<'_>,
        settings: BTreeMap<String, Bound<'_, PyAny>>,
        tag: &str,
    ) -> PyResult<Self> {
        // Each node's pool is a shm object named after the tag and the process: one more
        // number keeps a process's nodes apart.
        let n = NODES.fetch_add(1, Ordering::Relaxed);
        let config = node_config(
            &format!("{tag}-{n}"),
            "kvpeer.Node settings",
            &settings_text(&settings)?,
        )?;
        let inner = py
            .detach(|| RustNode::start(config))
            .map_err(|e| node_error("cannot start the node", e))?;
        Ok(Node { inner })
    }

    /// The node's identity, `host:port` (str): what peers pass as `peer`.
    #[getter]
    fn id(&self) -> String {
        self.inner.id().to_string()
    }

    /// store(blocks: dict[bytes, bytes]) -> None
    ///
    /// Stores `blocks` for peers to fetch: each value exactly `block_len` bytes.
    fn store(&self, py: Python<'_>, blocks: BTreeMap<Vec<u8>, Vec<u8>>) -> PyResult<()> {
        let blocks = blocks
            .into_iter()
            .map(|(k, v)| (OffloadKey::from_bytes(&k), v))
            .collect();
        py.detach(|| self.inner.store(blocks))
            .map_err(|e| node_error("store", e))
    }

    /// lookup(peer: str, keys: list[bytes], kv_request_id: str = "python-lookup",
    ///        timeout_s: float = 10.0) -> list[bool]
    ///
    /// Asks `peer` (`host:port`) which of `keys` it holds, for the request `kv_request_id`;
    /// returns one bool per key. Waits at most `timeout_s`. A peer with no session (nothing
    /// listens, it refused this node, it never answered) raises `PeerUnavailable` saying why.
    #[pyo3(signature = (peer, keys, kv_request_id="python-lookup", timeout_s=10.0))]
    fn lookup(
        &self,
        py: Python<'_>,
        peer: &str,
        keys: Vec<Bound<'_, PyAny>>,
        kv_request_id: &str,
        timeout_s: f64,
    ) -> PyResult<Vec<bool>> {
        let keys = keys_of(&keys)?;
        let timeout = seconds(timeout_s)?;
        py.detach(|| self.pull(peer, kv_request_id, &keys, timeout, false))
            .map_err(|e| node_error("lookup", e))
            .map(|(hits, _)| hits)
    }

    /// fetch(peer: str, keys: list[bytes], kv_request_id: str = "python-fetch",
    ///       timeout_s: float = 10.0) -> list[bytes]
    ///
    /// Looks up `keys` at `peer` and fetches those it holds into this node's pool; returns
    /// the keys fetched (read them with `read`). Waits at most `timeout_s` for each step.
    #[pyo3(signature = (peer, keys, kv_request_id="python-fetch", timeout_s=10.0))]
    fn fetch<'py>(
        &self,
        py: Python<'py>,
        peer: &str,
        keys: Vec<Bound<'py, PyAny>>,
        kv_request_id: &str,
        timeout_s: f64,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let keys = keys_of(&keys)?;
        let timeout = seconds(timeout_s)?;
        let (_, fetched) = py
            .detach(|| self.pull(peer, kv_request_id, &keys, timeout, true))
            .map_err(|e| node_error("fetch", e))?;
        Ok(fetched
            .iter()
            .map(|k| PyBytes::new(py, k.as_bytes()))
            .collect())
    }

    /// read(key: bytes) -> bytes | None
    ///
    /// The `block_len` bytes this node holds for `key`, or None.
    fn read<'py>(&self, py: Python<'py>, key: Vec<u8>) -> Option<Bound<'py, PyBytes>> {
        let key = OffloadKey::from_bytes(&key);
        py.detach(|| self.inner.read(&key))
            .map(|bytes| PyBytes::new(py, &bytes))
    }

    /// stats() -> dict[str, int]
    ///
    /// The node's running totals and open state, by name.
    fn stats(&self, py: Python<'_>) -> PyResult<BTreeMap<&'static str, u64>> {
        let s = py
            .detach(|| self.inner.stats())
            .map_err(|e| node_error("stats", e))?;
        let c = s.counters;
        Ok(BTreeMap::from([
            ("lookups_sent", c.lookups_sent),
            ("lookups_served", c.lookups_served),
            ("lookup_hits_served", c.lookup_hits_served),
            ("fetches_sent", c.fetches_sent),
            ("fetches_served", c.fetches_served),
            ("fetch_blocks_served", c.fetch_blocks_served),
            ("loads_ok", c.loads_ok),
            ("loads_failed", c.loads_failed),
            ("sessions", s.core.sessions as u64),
            ("bytes_fetched", s.bytes_fetched),
            ("refused_peers", s.refused_peers),
        ]))
    }

    /// shutdown(drain_s: float = 3.0) -> None
    ///
    /// Drains running writes for at most `drain_s` seconds, then stops the node.
    #[pyo3(signature = (drain_s=3.0))]
    fn shutdown(&self, py: Python<'_>, drain_s: f64) -> PyResult<()> {
        let drain = seconds(drain_s)?;
        py.detach(|| self.inner.shutdown(drain));
        Ok(())
    }

    fn __repr__(&self) -> String {
        format!("Node(id={:?})", self.inner.id().to_string())
    }

    /// `with kvpeer.Node(...) as node:` — the node itself.
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    /// Leaving the `with` block stops the node (running writes drained for up to 3 s); an
    /// exception in the block goes on.
    #[pyo3(signature = (_kind=None, _value=None, _traceback=None))]
    fn __exit__(
        &self,
        py: Python<'_>,
        _kind: Option<Bound<'_, PyAny>>,
        _value: Option<Bound<'_, PyAny>>,
        _traceback: Option<Bound<'_, PyAny>>,
    ) -> bool {
        py.detach(|| self.inner.shutdown(Duration::from_secs(3)));
        false
    }
}

impl Node {
    /// Looks `keys` up at `peer` as request `kv_request_id`, and with `fetch` fetches the hits
    /// into this node's pool. Returns each key's answer and the keys fetched.
    fn pull(
        &self,
        peer: &str,
        kv_request_id: &str,
        keys: &[OffloadKey],
        timeout: Duration,
        fetch: bool,
    ) -> Result<(Vec<bool>, Vec<OffloadKey>), NodeError> {
        let peer = PeerId::new(peer);
        // A session first: a peer that cannot be reached or will not have us is an error that
        // says why (a request's own lookup answers MISS for it, as an engine falls back).
        self.inner.connect(&peer, timeout)?;
        let request = self.inner.request(&peer, kv_request_id)?;
        let hits: Vec<bool> = request
            .lookup(keys, timeout)?
            .into_iter()
            .map(|r| r == kvpeer::LookupResult::Hit)
            .collect();
        let mut fetched = Vec::new();
        if fetch {
            fetched = keys
                .iter()
                .zip(&hits)
                .filter(|(_, hit)| **hit)
                .map(|(k, _)| k.clone())
                .collect();
            if !fetched.is_empty() {
                request.fetch(&fetched, timeout)?;
            }
        }
        Ok((hits, fetched))
    }
}

/// The keys a caller passed: each `bytes` (or a bytes-like object), never `str`, which pyo3
/// would refuse with "Can't extract 'str' to 'Vec'": a key is a block hash.
fn keys_of(keys: &[Bound<'_, PyAny>]) -> PyResult<Vec<OffloadKey>> {
    keys.iter()
        .enumerate()
        .map(|(i, k)| {
            if k.is_instance_of::<pyo3::types::PyString>() {
                return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                    "keys[{i}] is a str: a key is bytes (a block hash, e.g. b\"prefix-0\" or \
                     hashlib.sha256(...).digest())"
                )));
            }
            k.extract::<Vec<u8>>()
                .map(|b| OffloadKey::from_bytes(&b))
                .map_err(|_| {
                    pyo3::exceptions::PyTypeError::new_err(format!(
                        "keys[{i}] is a {}: a key is bytes (a block hash)",
                        k.get_type()
                            .name()
                            .map_or_else(|_| "?".into(), |n| n.to_string())
                    ))
                })
        })
        .collect()
}

fn seconds(s: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(s)
        .map_err(|_| PyValueError::new_err(format!("{s} is not a duration in seconds")))
}

fn node_error(what: &str, e: NodeError) -> PyErr {
    match e {
        NodeError::Timeout(_) => PyTimeoutError::new_err(format!("{what}: {e}")),
        NodeError::Config(c) => ConfigError::new_err((c.to_string(), c.key.clone())),
        e @ NodeError::Build(BuildError::PlaneNotBuilt { .. }) => {
            PlaneUnavailable::new_err(format!("{what}: {e}"))
        }
        e @ (NodeError::Refused { .. } | NodeError::ConnectTimeout { .. }) => {
            PeerUnavailable::new_err(format!("{what}: {e}"))
        }
        e => kvpeer_error(what, &e),
    }
}
