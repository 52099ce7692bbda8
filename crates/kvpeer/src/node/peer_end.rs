//! Why a peer is out of reach, as the node's callers see it: [`PeerEnd`], kept by the node's
//! I/O driver ([`crate::node::io::NodeIo::close_reason`]) for a caller that waited on the peer
//! (`Node::connect`, a lookup's refusal), and named in its errors.

/// Why a peer is out of reach: how its session ended, or why this node refused what it sent.
/// Its `Display` says it for a user, with what to look at when the peer refused us.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum PeerEnd {
    /// The session ended.
    Session(kvpeer_core::SessionEnd),
    /// This node refused what the peer sent before any session (not a `connect`, a bad proof).
    Refused(kvpeer_core::Refusal),
}

impl PeerEnd {
    /// The session ended before the peer acknowledged our `connect`, for a cause other than
    /// this node closing it (the sessions the core backs off from dialing again).
    pub fn before_handshake(&self) -> bool {
        matches!(self, PeerEnd::Session(end) if end.dial_backoff.is_some())
    }
}

impl std::fmt::Display for PeerEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use kvpeer_core::{CloseReason, LinkLoss};
        let end = match self {
            PeerEnd::Refused(r) => return write!(f, "refused: {r}"),
            PeerEnd::Session(end) => end,
        };
        write!(f, "{}", end.reason)?;
        if !self.before_handshake() {
            return Ok(());
        }
        // A peer that will not have us says nothing of why (a stranger learns nothing), so
        // name what to look at: its log has the cause.
        match &end.reason {
            CloseReason::ConnectionLost(
                LinkLoss::ClosedByPeer | LinkLoss::Socket(std::io::ErrorKind::ConnectionReset),
            ) => write!(
                f,
                " before answering our connect: it refused this node (a kvpeer node's \
                 allowlist, another --auth-secret-file or none, or its sessions full), or it \
                 restarted; its log names which"
            ),
            CloseReason::PeerDisconnected => write!(
                f,
                " before accepting our connect: it refused it (another hash seed, block size, \
                 model or config fingerprint, no data plane in common, a backoff after faults, \
                 or it is full or stopping); its log names which"
            ),
            CloseReason::HandshakeTimeout => write!(
                f,
                ": it took the connection but never answered our connect (overloaded, or a \
                 peer that ignores this node)"
            ),
            _ => Ok(()),
        }
    }
}
