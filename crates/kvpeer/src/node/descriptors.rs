//! File descriptors a node needs for its sessions, against what the process may open.
//!
//! An idle session holds two (the peer's control connection to us, ours to it); one that moves
//! blocks over tcp holds one more while it writes. At `max_peers = 4096` that is over 8,000,
//! past the soft limit many systems start processes with (1,024), so `kvpeer serve` raises its
//! soft limit to the hard one ([`raise_to_hard_limit`]) and every node says once, at start,
//! when its caps need more than the process may open ([`check`]), with the fix (docs/scaling.md,
//! "Many peers"). A library never raises a process's limit by itself: an engine sets its own
//! (vLLM raises its soft limit at start).

use nix::sys::resource::{getrlimit, setrlimit, Resource};
use tracing::{info, warn};

use super::build::NodeSpec;

/// Descriptors a node of `spec` may hold at once with every session open: two per session,
/// one per tcp data connection, and a few dozen of its own (listeners, pipes, epoll sets).
pub fn needed(spec: &NodeSpec) -> u64 {
    let sessions = spec.core.max_peers as u64;
    2 * sessions + spec.tcp_max_connections as u64 + 64
}

/// The process's soft and hard limits on open descriptors.
fn limits() -> Option<(u64, u64)> {
    getrlimit(Resource::RLIMIT_NOFILE).ok()
}

/// Raises the soft limit on open descriptors to the hard one (what `ulimit -n` may be raised
/// to without privileges); the soft limit in force after.
pub fn raise_to_hard_limit() -> Option<u64> {
    let (soft, hard) = limits()?;
    if soft < hard && setrlimit(Resource::RLIMIT_NOFILE, hard, hard).is_ok() {
        info!(
            from = soft,
            to = hard,
            "raised the open-descriptor limit to its hard limit"
        );
        return Some(hard);
    }
    Some(soft)
}

/// Warns once when `spec`'s caps may need more descriptors than the process may open: past
/// that, new connections are refused by the system (the node stays up, serving the sessions it
/// has, and counts the failed accepts).
pub fn check(spec: &NodeSpec) {
    let Some((soft, hard)) = limits() else {
        return;
    };
    let need = needed(spec);
    if soft < need {
        warn!(
            max_peers = spec.core.max_peers,
            need,
            limit = soft,
            hard_limit = hard,
            "max_peers may need more open descriptors than this process may hold: raise the \
             limit (`ulimit -n {need}`; the hard limit with `ulimit -Hn` as root, or \
             LimitNOFILE= in a systemd unit; docs/scaling.md, \"Many peers\")"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::NodeConfig;

    #[test]
    fn the_need_grows_with_the_sessions_and_the_tcp_cap() {
        let small = NodeConfig::local("fd-need").spec;
        let big = NodeConfig::builder("fd-need-big")
            .max_peers(4096)
            .build()
            .map(|c| c.spec);
        let Ok(big) = big else {
            panic!("a config of 4096 peers builds");
        };
        assert_eq!(needed(&small), 2 * 128 + 256 + 64);
        assert_eq!(needed(&big), 2 * 4096 + (4096 + 64) + 64);
    }
}
