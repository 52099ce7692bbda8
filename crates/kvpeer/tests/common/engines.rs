//! In-process nodes of the pool tests (`pool.rs`, `pool_hostile.rs`): tcp nodes of 4 KiB blocks
//! on 127.0.0.1, and engines' P2P sides holding synthetic blocks.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use kvpeer::{synthetic, Node, NodeConfig, OffloadKey, PlaneKind};

/// Bytes per block of these nodes.
pub(crate) const LEN: u64 = 4096;

/// A tcp node of `blocks` blocks.
pub(crate) fn node(tag: &str, blocks: u64) -> Node {
    let config = NodeConfig::builder(tag)
        .plane(PlaneKind::Tcp)
        .num_blocks(blocks)
        .block_len(LEN)
        .build()
        .unwrap();
    Node::start(config).unwrap()
}

/// Synthetic keys `range`.
pub(crate) fn keys(range: std::ops::Range<u64>) -> Vec<OffloadKey> {
    range.map(synthetic::key).collect()
}

/// An engine's P2P side: a node holding synthetic blocks `0..n`.
pub(crate) fn engine(tag: &str, n: u64) -> Node {
    let e = node(tag, n.max(1));
    let blocks = keys(0..n)
        .into_iter()
        .map(|k| {
            let v = synthetic::content(&k, LEN as usize);
            (k, v)
        })
        .collect();
    e.store(blocks).unwrap();
    e
}
