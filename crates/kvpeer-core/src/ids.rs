//! The core's ids as newtypes: a store job, a data-plane transfer, a local block; and
//! [`ServeCtx`], the handle of one lookup a peer asked. Each is a
//! `u64` underneath (`#[repr(transparent)]`, `Copy`), so a job id cannot be passed where a
//! transfer id is meant, and none of them where a count or a round is.
//!
//! Contract: `new` and `get` convert without loss both ways; `Display` shows the bare
//! number, as the logs always have.

use std::fmt;

use kvpeer_proto::{KvRequestId, PeerId};

macro_rules! id_newtype {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[repr(transparent)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
        pub struct $name(u64);

        impl $name {
            /// The id with this number.
            pub const fn new(n: u64) -> Self {
                $name(n)
            }

            /// Its number.
            pub const fn get(self) -> u64 {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0, f)
            }
        }

        impl From<u64> for $name {
            fn from(n: u64) -> Self {
                $name(n)
            }
        }

        impl From<$name> for u64 {
            fn from(id: $name) -> u64 {
                id.0
            }
        }
    };
}

id_newtype!(
    /// Id of a store job: a set of local blocks pinned for a peer until the job completes.
    JobId
);

id_newtype!(
    /// Id of one data-plane write (a batch of blocks to one peer).
    TransferId
);

id_newtype!(
    /// A block index (a slot of a block pool: ours, or a peer's as its `fetch` names it).
    BlockIndex
);

/// The bookkeeping handle of one inbound lookup on the producer, like vLLM's synthetic
/// `ReqContext`: opened with [`Parent::on_new_request`](crate::Parent::on_new_request), closed with
/// [`Parent::on_request_finished`](crate::Parent::on_request_finished) exactly once. Shown as vLLM names it,
/// `p2p:<peer>:<kv_request_id>:lu<n>`; building one allocates nothing.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ServeCtx {
    /// The peer that asked.
    pub peer: PeerId,
    /// The request it asked about.
    pub kv_request_id: KvRequestId,
    /// Which lookup message of the session (unique per session).
    pub lookup: u64,
}

impl fmt::Display for ServeCtx {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "p2p:{}:{}:lu{}",
            self.peer, self.kv_request_id, self.lookup
        )
    }
}
