//! [`NodeConfig`]: everything a node is started with, made by [`super::resolve`] (files,
//! vLLM's environment, flags) or [`NodeConfig::builder`]; read by `Node::start`, the pool
//! node and the CLI.

use super::pool_node::PoolConfig;
use crate::node::build::NodeSpec;

/// How to start a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node itself: identity (`host:0` picks a port), pool, seeds, timeouts.
    pub spec: NodeSpec,
    /// The pool node's settings (`kvpeer serve --follow`; off by default): read by
    /// [`crate::pool_node::PoolNode::start`], not by [`crate::Node::start`].
    pub pool: PoolConfig,
}

impl NodeConfig {
    /// A node on 127.0.0.1 with a port the system picks and every other setting at its
    /// default (docs/configuration.md: 1024 blocks of 64 KiB, both planes); `tag` names its
    /// pool's shm object (with the process id). [`NodeConfig::builder`] changes settings.
    pub fn local(tag: &str) -> Self {
        NodeConfig::defaults(tag)
    }
}
