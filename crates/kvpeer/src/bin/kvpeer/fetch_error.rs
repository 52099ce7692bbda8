//! Why `kvpeer fetch` stopped before its workload finished: the command's last line (plain or
//! in `--json`'s `error`), typed down to the node's own error so it says which step failed
//! and why (the peer refused us, the handshake timed out, ...).

use kvpeer::engine::{EngineError, PoolError};
use kvpeer::node::build::BuildError;
use kvpeer::NodeError;

/// Why the workload stopped.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    /// SIGINT/SIGTERM could not be watched (the pool's object would outlive a signal).
    #[error("cannot watch signals: {0}")]
    Signals(std::io::Error),
    /// The thread that removes the pool on a signal could not start.
    #[error("cannot start the signal watcher: {0}")]
    SignalWatcher(std::io::Error),
    /// A block does not fit this machine's address space.
    #[error("a block of {0} bytes does not fit in memory here")]
    BlockLen(u64),
    /// The node (`Node`) refused a call or failed it: the handshake, a lookup, a fetch.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// The engine-driven node (`--driven`) could not be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The engine-driven node's pool could not be made.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// The engine-driven node refused a load of request `r`.
    #[error("request {r}: {error}")]
    Load {
        /// The request.
        r: u64,
        /// Why.
        error: EngineError,
    },
    /// One of `--concurrency`'s caller threads panicked (a bug: its requests are lost).
    #[error("a caller thread panicked")]
    CallerPanicked,
    /// The engine-driven node answered one lookup twice.
    #[error("request {0}: a second lookup answer")]
    SecondAnswer(u64),
    /// A request's lookup or fetch took longer than `--timeout-secs`.
    #[error("request {r}: the {phase} took longer than {secs} s")]
    Late {
        /// The request.
        r: u64,
        /// `lookup` or `fetch`.
        phase: &'static str,
        /// The timeout.
        secs: u64,
    },
}
