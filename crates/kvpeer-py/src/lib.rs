//! `kvpeer._native`: kvpeer's Rust node for Python, the extension module of the `kvpeer` pip
//! package (python/kvpeer). Two classes:
//!
//! * [`tier::EngineTier`]: a node inside an inference engine, over the engine's own block
//!   memory, driven poll-style by the engine (what `kvpeer.vllm.KvpeerTier` calls);
//! * [`node::Node`]: a standalone node with its own pool and runtime thread (`kvpeer.Node`).
//!
//! Contract with Python: every method releases the GIL while Rust works (nothing here waits
//! for the network: the longest wait is a `poll` the caller bounds), and no Rust thread ever
//! calls into Python (the planes' threads see only the pool's memory and channels). The
//! engine's memory is held as a Python buffer export for the node's whole life, so the
//! exporter cannot free or resize it underneath the planes.

mod engine;
mod errors;
mod memory;
mod node;
mod settings;
mod tier;

use pyo3::prelude::*;

/// The module: its classes and exceptions.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<tier::EngineTier>()?;
    m.add_class::<tier::NativeRequest>()?;
    m.add_class::<node::Node>()?;
    m.add("KvpeerError", py.get_type::<errors::KvpeerError>())?;
    m.add("ConfigError", py.get_type::<errors::ConfigError>())?;
    m.add(
        "PlaneUnavailable",
        py.get_type::<errors::PlaneUnavailable>(),
    )?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("NIXL_BUILT", cfg!(feature = "nixl"))?;
    Ok(())
}
