//! Why the tcp plane refused a peer or faulted its link, as types: what a session's end carries
//! (inside the core's `PlaneError`) up to the user's error or log line.

use std::net::SocketAddr;
use std::time::Duration;

use crate::data::metadata::MetadataError;

/// Why a peer's registration was refused.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TcpRefusal {
    /// Its `agent_metadata` is not kvpeer's plane map.
    #[error(transparent)]
    Metadata(#[from] MetadataError),
    /// It advertises no tcp plane.
    #[error("the peer offers no tcp plane")]
    NoTcp,
    /// Its blocks are of another size than ours.
    #[error("block_len {theirs} is not ours ({ours})")]
    BlockLen {
        /// Its block length.
        theirs: u64,
        /// Ours.
        ours: u64,
    },
    /// It advertises tcp without the key its writer must present.
    #[error("peer advertises tcp without tcp_key")]
    NoKey,
    /// Its key is not [`super::KEY_LEN`] bytes.
    #[error("the peer's tcp_key is not {} bytes", super::KEY_LEN)]
    KeyLen,
    /// Its data address is one no peer can have (`0:P`, `0.0.0.0:P`, `[::]:P`: this host to
    /// `connect(2)`), or not `host:port`.
    #[error("the data address {0} is no peer's address")]
    NotAPeerAddress(String),
    /// Its data address is a host name that does not resolve.
    #[error("cannot reach the data listener at {0}: it does not resolve")]
    Unresolved(String),
    /// No thread could be started to resolve its data address.
    #[error("cannot start a resolver thread: {0}")]
    NoResolver(std::io::ErrorKind),
    /// This node's policy is `tls = "required"` and the peer offers no TLS on its tcp plane.
    #[error(
        "the peer offers no TLS on its tcp plane and this node's tls is \"required\" (give the \
         peer tls_cert, tls_key and tls_ca, or set tls = \"preferred\" here)"
    )]
    NoTls,
    /// TLS with a peer whose identity is not an IP address (its certificate names one).
    #[error("the peer's identity {0} is no IP address, which TLS needs to check its certificate")]
    TlsNeedsAnAddress(String),
}

/// Why a peer's link faulted: its transfers fail, and its session winds down.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TcpFault {
    /// The peer's data listener could not be reached (`again`: a connection was up before).
    #[error("cannot {} the data listener at {addr}: {cause}", verb(*.again))]
    Unreachable {
        /// Where.
        addr: SocketAddr,
        /// A connection to it was up before.
        again: bool,
        /// How the connect failed.
        cause: kvpeer_core::LinkLoss,
    },
    /// The connect did not finish in time.
    #[error("cannot {} the data listener at {addr}: no connect within {after:?}", verb(*.again))]
    ConnectTimeout {
        /// Where.
        addr: SocketAddr,
        /// A connection to it was up before.
        again: bool,
        /// How long it was given.
        after: Duration,
    },
    /// No socket could be made (out of descriptors).
    #[error("cannot reach the data listener at {0}: no socket (out of descriptors)")]
    NoSocket(SocketAddr),
    /// The socket could not be registered in the sender's poll.
    #[error("cannot poll a tcp data connection: {0}")]
    Poll(std::io::ErrorKind),
    /// A write failed part-way through a frame (or with WRITEs awaiting their ACK).
    #[error("tcp send failed: {0}")]
    Send(std::io::ErrorKind),
    /// The receiver took none of our bytes for this long.
    #[error("tcp send failed: the receiver took no bytes for {0:?}")]
    Stalled(Duration),
    /// The connection ended with WRITEs awaiting their ACK.
    #[error("tcp data connection lost")]
    Lost,
    /// The receiver refused a write (it refuses only a write it holds no permit for, or one
    /// without the block digests it asked for).
    #[error("the receiver refused a tcp write")]
    WriteRefused,
    /// The receiver acknowledged a transfer not awaiting that ACK on its connection: another
    /// connection's, one not yet fully sent, out of order, or more ACKs than WRITEs.
    #[error(
        "the receiver acknowledged tcp transfer {0} out of turn (not the oldest WRITE it has \
         read whole on this connection)"
    )]
    ForeignAck(u64),
    /// The connection kept closing before a write could go.
    #[error("the tcp data connection keeps closing before a write")]
    KeepsClosing,
    /// A transfer was not acknowledged by its deadline.
    #[error(
        "tcp transfer {tid} ({bytes} bytes) not acknowledged within {allowed:?} of its first byte"
    )]
    Late {
        /// The transfer.
        tid: u64,
        /// Its bytes.
        bytes: u64,
        /// What it was given.
        allowed: Duration,
    },
    /// A write named a block outside our pool (never sent).
    #[error("local block {0} outside the pool")]
    BlockOutside(u64),
    /// Our identity is too long for a HELLO.
    #[error("our peer id is too long for a HELLO")]
    IdTooLong,
    /// A write of more blocks than a frame can count.
    #[error("cannot frame a tcp write of {0} blocks")]
    TooManyBlocks(usize),
    /// TLS with the peer's data listener failed: its certificate (untrusted, expired, not
    /// naming the address dialed), or a record that did not authenticate.
    #[error("TLS on the tcp data connection failed: {0}")]
    Tls(String),
    /// The link uses TLS and this node has no TLS material (never: such a link is refused at
    /// registration).
    #[error("the link uses TLS and this node has no certificate")]
    NoTls,
}

fn verb(again: bool) -> &'static str {
    if again {
        "reconnect to"
    } else {
        "reach"
    }
}
