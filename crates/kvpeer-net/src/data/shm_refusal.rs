//! Why the shm plane refused a peer's pool, as a type: what a refused registration carries
//! (inside the core's `PlaneError`) up to the session's end and the user's log line. Every
//! field is the peer's claim or what this node found, so the message says which check failed.

use std::sync::Arc;

use kvpeer_store::trailer::TrailerError;
use kvpeer_store::PoolError;

use crate::data::metadata::MetadataError;

/// Why a peer's pool was not proven (nothing was written into it).
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ShmRefusal {
    /// Its `agent_metadata` is not kvpeer's plane map.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// It advertises no shm plane.
    #[error("the peer offers no shm plane")]
    NoShm,
    /// Its blocks are of another size than ours.
    #[error("block_len {theirs} is not ours ({ours})")]
    BlockLen {
        /// Its block length.
        theirs: u64,
        /// Ours.
        ours: u64,
    },
    /// It names an object but sends no token proving it owns it.
    #[error("the peer sent no shm_token proving it owns {0:?}")]
    NoToken(String),
    /// The object it names cannot be opened.
    #[error("cannot open {0:?}: {1}")]
    Open(String, nix::Error),
    /// The object cannot be examined.
    #[error("cannot fstat {0:?}: {1}")]
    Stat(String, std::io::ErrorKind),
    /// The name is not a shared-memory object (a directory, a device ...).
    #[error("{0:?} is not a shared-memory object")]
    NotShm(String),
    /// The object belongs to another user.
    #[error("{name:?} belongs to uid {owner}, not to this node's uid {ours}")]
    OtherUser {
        /// The object.
        name: String,
        /// Its owner.
        owner: u32,
        /// This node's effective uid.
        ours: u32,
    },
    /// The object is this node's own pool.
    #[error("{0:?} is this node's own pool")]
    OwnPool(String),
    /// The pool it claims has no size (0 blocks, or more bytes than a u64).
    #[error("the peer claims an impossible pool of {0} blocks")]
    ImpossiblePool(u64),
    /// The object's size is not the pool the peer claims.
    #[error("{name:?} holds {holds} bytes, the peer claims {blocks} blocks and a trailer ({expected} bytes)")]
    WrongSize {
        /// The object.
        name: String,
        /// Its size.
        holds: u64,
        /// The blocks the peer claims.
        blocks: u64,
        /// The size those blocks and a trailer take.
        expected: u64,
    },
    /// The object's trailer cannot be read.
    #[error("cannot read the trailer of {0:?}: {1}")]
    Trailer(String, std::io::ErrorKind),
    /// The object's trailer is not a kvpeer pool's.
    #[error("{0:?}: {1}")]
    BadTrailer(String, TrailerError),
    /// The token is not the one the object's secret makes for this node and connection.
    #[error(
        "the peer's shm_token does not prove it owns {0:?} (wrong, for another node, or for an \
         earlier connection)"
    )]
    Unproven(String),
    /// The proven object could not be mapped.
    #[error("cannot map {0:?}: {1}")]
    Map(String, Arc<PoolError>),
    /// The fence words the peer's `shm_epoch` announces are not a proper object: missing, of
    /// another user, this node's own, or not one word per block.
    #[error("the fence words {name:?} of the peer's pool are unusable: {why}")]
    Fence {
        /// The fence object's name.
        name: String,
        /// What is wrong with it.
        why: String,
    },
}
