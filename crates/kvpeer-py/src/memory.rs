//! The engine's block memory as a kvpeer pool: a writable Python buffer (vLLM's
//! `primary_kv_view`, a 2-D memoryview of `(num_chunks, row_stride)` bytes) becomes a
//! [`Pool::external`] of `num_chunks` blocks, each a row.
//!
//! The memory is pinned by a buffer export held for the node's whole life: `ctypes`'
//! `c_char.from_buffer` (the limited C API of CPython 3.10, which this abi3 module targets,
//! has no buffer protocol; ctypes' export is the same `PyObject_GetBuffer` underneath). While
//! it is held the exporter can neither free nor resize the memory (an `mmap` refuses to close,
//! a `bytearray` to grow). [`Export`] holds it, and lets it go only once the pool and
//! everything that shares it (planes' views) are gone; if something still held the pool, it
//! is never let go (a leaked export, never a freed buffer under a writer).

use std::ptr::NonNull;
use std::sync::Arc;

use kvpeer::engine::Pool;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

/// How long letting go of the export waits for the planes' threads to drop their views.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The export of the engine's memory, outliving the pool made over it.
pub(crate) struct Export {
    /// The ctypes object holding the export.
    pin: Option<Py<PyAny>>,
    /// One reference is the pool's `keep_alive`: while any pool (or a view of it) lives, the
    /// count is above 1.
    alive: Arc<()>,
}

impl Drop for Export {
    fn drop(&mut self) {
        let Some(pin) = self.pin.take() else {
            return;
        };
        // A plane's threads let go of their views as they end, which may be just after the
        // node that stopped them: wait a little for them (bounded) before deciding.
        let deadline = std::time::Instant::now() + RELEASE_WAIT;
        while Arc::strong_count(&self.alive) > 1 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        if Arc::strong_count(&self.alive) == 1 {
            // Without the GIL, pyo3 defers the release to the next time it is held.
            drop(pin);
        } else {
            tracing::error!(
                "the engine's memory is still shared by a plane: its buffer stays exported"
            );
            std::mem::forget(pin);
        }
    }
}

/// The `/dev/shm` object the engine's memory is a shared mapping of, from its start, if any
/// (vLLM's primary tier is `/dev/shm/vllm_offload_<engine>.mmap`): what the shm plane serves.
pub(crate) fn shm_object_of(address: usize, len: u64) -> Option<String> {
    let mapping = kvpeer_store::proc_maps::shared_file_at(address as u64, len)?;
    let path = mapping.path.to_str()?;
    let name = path.strip_prefix("/dev/shm/")?;
    // A deleted object (" (deleted)") cannot be opened by name; nor a nested path.
    (mapping.offset == 0 && !name.contains('/') && !name.contains(' ')).then(|| name.to_owned())
}

/// The pool over `memory`, and the export that keeps it alive (drop it after the pool). The
/// block length is the row stride (vLLM's `block_size_bytes = primary_kv_view.strides[0]`).
/// With `shm`, the memory must be a mapping of a `/dev/shm` object (see [`shm_object_of`]),
/// adopted so that the shm plane can serve it ([`Pool::adopt_shm`]).
pub(crate) fn engine_pool(memory: &Bound<'_, PyAny>, shm: bool) -> PyResult<(Pool, Export)> {
    let py = memory.py();
    let bad = |what: String| PyValueError::new_err(format!("the engine's memory {what}"));
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((memory,))
        .map_err(|e| bad(format!("is not a buffer: {e}")))?;
    if view.getattr("readonly")?.extract::<bool>()? {
        return Err(bad("is read-only: peers write loaded blocks into it".into()));
    }
    if !view.getattr("c_contiguous")?.extract::<bool>()? {
        return Err(bad("must be C-contiguous (rows one after another)".into()));
    }
    let item = view.getattr("itemsize")?.extract::<usize>()?;
    let shape: Vec<usize> = view.getattr("shape")?.extract()?;
    let (rows, row_len) = match shape.as_slice() {
        [rows, row_items] => (*rows as u64, (*row_items * item) as u64),
        other => {
            return Err(bad(format!(
                "must have two dimensions (blocks, bytes per block), not {}",
                other.len()
            )))
        }
    };
    if rows == 0 || row_len == 0 {
        return Err(bad("is empty".into()));
    }
    let ctypes = py.import("ctypes")?;
    let pin = ctypes
        .getattr("c_char")?
        .call_method1("from_buffer", (&view,))
        .map_err(|e| bad(format!("cannot be pinned: {e}")))?;
    let address: usize = ctypes.getattr("addressof")?.call1((&pin,))?.extract()?;
    let base = NonNull::new(address as *mut u8).ok_or_else(|| bad("is at address 0".into()))?;
    let object = match shm {
        true => Some(shm_object_of(address, rows * row_len).ok_or_else(|| {
            bad(
                "is not a mapping of a /dev/shm object, which the shm plane needs (vLLM's \
                 primary tier is one: /dev/shm/vllm_offload_<engine>.mmap)"
                    .into(),
            )
        })?),
        false => None,
    };
    let alive = Arc::new(());
    // SAFETY: `base` is the start of `rows × row_len` writable, C-contiguous bytes (checked
    // above on the memoryview whose export `pin` holds); the export pins them (the exporter
    // can neither free nor resize them) until `Export` lets `pin` go, which it does only once
    // the pool's `keep_alive` (a clone of `alive`) is dropped. Python code may still write
    // the same bytes (the engine filling or reading its blocks) through its own buffer, never
    // through Rust references; kvpeer writes only into blocks the engine gave it for a load.
    // (`adopt_shm` also checks that `base` is a shared mapping of the object it names.)
    let keep_alive: Box<dyn std::any::Any + Send + Sync> = Box::new(alive.clone());
    let pool = unsafe {
        match object {
            Some(name) => Pool::adopt_shm(&name, base, rows, row_len, Some(keep_alive)),
            None => Pool::external(base, rows, row_len, row_len, Some(keep_alive)),
        }
    }
    .map_err(|e| bad(e.to_string()))?;
    Ok((
        pool,
        Export {
            pin: Some(pin.unbind()),
            alive,
        },
    ))
}
