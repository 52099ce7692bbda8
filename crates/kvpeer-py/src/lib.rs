//! `kvpeer._native`: kvpeer's Rust node for Python, the extension module of the `kvpeer` pip
//! package (python/kvpeer). Two classes, and the records they exchange with Python
//! (`records.rs`: questions, answers, ended jobs, as named fields):
//!
//! * `tier::EngineTier`: a node inside an inference engine, over the engine's own block
//!   memory, driven poll-style by the engine (what `kvpeer.vllm.KvpeerTier` calls);
//! * `node::Node`: a standalone node with its own pool and runtime thread (`kvpeer.Node`).
//!
//! Contract with Python: every method releases the GIL while Rust works (nothing here waits
//! for the network: the longest wait is a `poll` the caller bounds), and no Rust thread ever
//! calls into Python (the planes' threads see only the pool's memory and channels). The
//! engine's memory is held as a Python buffer export for the node's whole life, so the
//! exporter cannot free or resize it underneath the planes.

mod errors;
mod logs;
mod memory;
mod node;
mod records;
mod settings;
mod tier;

use pyo3::prelude::*;

/// The module: its classes and exceptions.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    logs::init();
    m.add_class::<tier::EngineTier>()?;
    m.add_class::<tier::NativeRequest>()?;
    m.add_class::<node::Node>()?;
    m.add_class::<records::Query>()?;
    m.add_class::<records::Answer>()?;
    m.add_class::<records::LookedUp>()?;
    m.add_class::<records::JobEnd>()?;
    m.add_class::<records::Polled>()?;
    m.add_class::<records::Release>()?;
    m.add_class::<records::Outstanding>()?;
    m.add("KvpeerError", py.get_type::<errors::KvpeerError>())?;
    m.add("ConfigError", py.get_type::<errors::ConfigError>())?;
    m.add(
        "PlaneUnavailable",
        py.get_type::<errors::PlaneUnavailable>(),
    )?;
    m.add("PeerUnavailable", py.get_type::<errors::PeerUnavailable>())?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NIXL_BUILT", cfg!(feature = "nixl"))?;
    m.add("VLLM_PEERS", kvpeer::VLLM_PEERS)?;
    m.add("VLLM_TIER", kvpeer::VLLM_TIER)?;
    m.add_function(pyo3::wrap_pyfunction!(shm_object_of, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(logs::take_logs, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(logs::logs_to_python, m)?)?;
    m.add_function(pyo3::wrap_pyfunction!(shard_owner, m)?)?;
    Ok(())
}

/// The `/dev/shm` object `memory` (a buffer) is a shared mapping of, from its start, or None:
/// whether the `shm` plane can serve it (vLLM's primary tier is
/// `/dev/shm/vllm_offload_<engine>.mmap`).
#[pyfunction]
fn shm_object_of(memory: &Bound<'_, PyAny>) -> PyResult<Option<String>> {
    let py = memory.py();
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((memory,))?;
    let nbytes: u64 = view.getattr("nbytes")?.extract()?;
    let ctypes = py.import("ctypes")?;
    // A read-only buffer cannot be pinned for writing; then it is no pool at all.
    let Ok(pin) = ctypes
        .getattr("c_char")?
        .call_method1("from_buffer", (&view,))
    else {
        return Ok(None);
    };
    let address: usize = ctypes.getattr("addressof")?.call1((&pin,))?.extract()?;
    Ok(memory::shm_object_of(address, nbytes))
}

/// The index in `members` (pool nodes' `host:port`, as in their `--shard` list) of the one that
/// owns the prefix whose root chunk's key is `root`, or None without members: rendezvous
/// hashing, the same function the pools admit by (`kvpeer_pool::shard`).
#[pyfunction]
fn shard_owner(members: Vec<String>, root: &[u8]) -> Option<usize> {
    kvpeer_pool::shard::owner(&members, &kvpeer::OffloadKey::from_bytes(root))
}
