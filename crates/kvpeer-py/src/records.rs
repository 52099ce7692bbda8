//! The records `EngineTier` hands Python and takes from it, as classes with named fields (no
//! tuples whose positions the caller must know, no magic numbers for kinds). Each is frozen: a
//! record describes what happened, Python reads it.

use kvpeer::engine::{Answer as EngineAnswer, BlockIndex, EnginePin, QueryId};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// A peer's question: does the engine hold `key`? Answer it with an [`Answer`] naming `id`.
#[pyclass(module = "kvpeer._native", frozen, get_all)]
pub(crate) struct Query {
    /// What the answer names.
    pub(crate) id: u64,
    /// The peer asking (`host:port`).
    pub(crate) peer: String,
    /// The peer's request.
    pub(crate) kv_request_id: String,
    /// The key asked about.
    pub(crate) key: Py<PyBytes>,
}

#[pymethods]
impl Query {
    fn __repr__(&self) -> String {
        format!(
            "Query(id={}, peer={:?}, kv_request_id={:?})",
            self.id, self.peer, self.kv_request_id
        )
    }
}

/// The engine's answer to one [`Query`]: made by `Answer.hit`, `Answer.miss` or
/// `Answer.pending`.
#[pyclass(module = "kvpeer._native", frozen)]
pub(crate) struct Answer {
    pub(crate) query: QueryId,
    pub(crate) answer: EngineAnswer,
}

#[pymethods]
impl Answer {
    /// The key's bytes are in `block`, pinned by the engine as `pin` until that pin comes
    /// back as a [`Release`].
    #[staticmethod]
    fn hit(query: u64, block: u64, pin: u64) -> Self {
        Answer {
            query: QueryId::from_raw(query),
            answer: EngineAnswer::Hit {
                block: BlockIndex::new(block),
                pin: EnginePin(pin),
            },
        }
    }

    /// Not held.
    #[staticmethod]
    fn miss(query: u64) -> Self {
        Answer {
            query: QueryId::from_raw(query),
            answer: EngineAnswer::Miss,
        }
    }

    /// Being written: the question comes back later.
    #[staticmethod]
    fn pending(query: u64) -> Self {
        Answer {
            query: QueryId::from_raw(query),
            answer: EngineAnswer::Pending,
        }
    }

    fn __repr__(&self) -> String {
        format!("Answer({:?})", self.answer)
    }
}

/// A lookup of the engine's that was answered: per key asked, in order, whether the producer
/// holds it.
#[pyclass(module = "kvpeer._native", frozen, get_all)]
pub(crate) struct LookedUp {
    /// The request whose lookup this is.
    pub(crate) kv_request_id: String,
    /// Per key, in the order asked.
    pub(crate) hits: Vec<bool>,
}

/// A load or a store of the engine's that ended.
#[pyclass(module = "kvpeer._native", frozen, get_all)]
pub(crate) struct JobEnd {
    /// The engine's job id.
    pub(crate) job: u64,
    /// Whether every block landed (a load) or reached the peer (a store).
    pub(crate) success: bool,
    /// A load that failed while its producer may still write its blocks: they stay untouched
    /// until a later `JobEnd` of the same job without `held` (only with `report_held_loads`).
    pub(crate) held: bool,
}

/// What one `poll` (or `shutdown`) returns.
#[pyclass(module = "kvpeer._native", frozen, get_all)]
pub(crate) struct Polled {
    /// Answered lookups, in the order they were asked.
    pub(crate) lookups: Vec<Py<LookedUp>>,
    /// Ended loads.
    pub(crate) loads: Vec<Py<JobEnd>>,
    /// Ended stores.
    pub(crate) stores: Vec<Py<JobEnd>>,
}

/// A pin the node no longer needs.
#[pyclass(module = "kvpeer._native", frozen, get_all)]
pub(crate) struct Release {
    /// The engine's pin (as its `Answer.hit` named it).
    pub(crate) pin: u64,
    /// Whether the block reached the peer (false: unused, or the write failed).
    pub(crate) sent: bool,
}

/// What of the engine's the node still holds for peers.
#[pyclass(module = "kvpeer._native", frozen, get_all)]
pub(crate) struct Outstanding {
    /// Peers' questions the engine has not answered.
    pub(crate) questions: usize,
    /// The engine's pins not given back.
    pub(crate) pins: usize,
}
