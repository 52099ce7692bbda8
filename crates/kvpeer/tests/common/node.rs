//! The public API's nodes in tests: synthetic keys, storing them, checking fetched bytes, and
//! waiting until a node holds nothing open.

use std::time::{Duration, Instant};

use kvpeer::config::NodeConfigBuilder;
use kvpeer::{synthetic, Node, OffloadKey};

/// Starts a node in this process from `config`, its loads timing out after `load_timeout` (set
/// on the built spec: a sub-second timeout is no config key).
pub(crate) fn start(config: NodeConfigBuilder, load_timeout: Duration) -> Node {
    let mut config = config.build().unwrap();
    config.spec.core.load_timeout = load_timeout;
    Node::start(config).unwrap()
}

pub(crate) fn keys(range: std::ops::Range<u64>) -> Vec<OffloadKey> {
    range.map(synthetic::key).collect()
}

pub(crate) fn store(node: &Node, ks: &[OffloadKey]) {
    let len = node.config().block_len as usize;
    node.store(
        ks.iter()
            .map(|k| (k.clone(), synthetic::content(k, len)))
            .collect(),
    )
    .unwrap();
}

pub(crate) fn assert_bytes(node: &Node, ks: &[OffloadKey]) {
    let len = node.config().block_len as usize;
    for k in ks {
        assert_eq!(
            node.read(k).as_deref(),
            Some(&synthetic::content(k, len)[..])
        );
    }
}

pub(crate) fn assert_node_clean(node: &Node) {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let s = node.stats().unwrap();
        let open = (
            s.core.client_requests,
            s.core.server_requests,
            s.core.store_jobs,
            s.core.inflight,
            s.store.pinned,
            s.store.writing,
        );
        if open == (0, 0, 0, 0, 0, 0) {
            return;
        }
        assert!(Instant::now() < deadline, "still open: {s:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
