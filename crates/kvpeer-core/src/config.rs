//! Every number the core uses, with vLLM 0.33's values as defaults.

use std::time::Duration;

use kvpeer_proto::PeerId;

/// Timeouts and limits of the protocol core. `Default` is vLLM 0.33's behaviour.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoreConfig {
    /// Most sessions at once, inbound and outbound (`VLLM_P2P_MAX_PEERS`).
    pub max_peers: usize,
    /// Most sessions at once with peers of one host (the host of their identity, which the
    /// node binds to the source address: docs/security.md, G3). When the limit or this share
    /// is reached, a newcomer takes the slot of a session of its own host (over the share) or
    /// of the host holding the most, idle first, least lately active first.
    pub max_peers_per_host: usize,
    /// A session must finish its handshake within this (`VLLM_P2P_HANDSHAKE_TIMEOUT_S`).
    pub handshake_timeout: Duration,
    /// Idle sessions older than this are evicted when few peer slots are left
    /// (`VLLM_P2P_IDLE_TIMEOUT_S`); zero disables eviction.
    pub idle_timeout: Duration,
    /// Idle eviction runs only when at least `max_peers - idle_headroom` sessions exist.
    pub idle_headroom: usize,
    /// A consumer's lookup without progress for this long disconnects the peer (vLLM 0.34:
    /// 8 s; 0.33: 30 s).
    pub lookup_timeout: Duration,
    /// A load (fetch round) of a request that ran its lookups not done within this is aborted:
    /// the peer confirmed every block, so a fetch still not done is stuck (vLLM 0.34's
    /// symmetric-P2P load timeout, 10 s; 0.33 had one timeout for all loads, 30 s).
    pub load_timeout: Duration,
    /// A load of a request that never looked up (a PD fetch: the producer may still be
    /// computing its blocks) not done within this is aborted (vLLM 0.34: 30 s).
    pub pd_load_timeout: Duration,
    /// An aborted load whose `abort_ack` does not come within this ends the session, the only
    /// fence of the peer's writes (vLLM 0.34: 5 s; 0.33 failed the load after 10 s and kept
    /// the session).
    pub abort_ack_timeout: Duration,
    /// A store job (a pin held for a peer) older than this is failed.
    pub store_timeout: Duration,
    /// HIT_PENDING/RETRY keys of an inbound lookup become MISS after this.
    pub lookup_pending_timeout: Duration,
    /// How often pending keys of inbound lookups are looked up again.
    pub lookup_repoll_interval: Duration,
    /// An abort still draining after this is logged (the ack still waits for the drain).
    pub cancel_drain_warning: Duration,
    /// Least time between two wait-mode cancel attempts of one round.
    pub cancel_retry_interval: Duration,
    /// A data-plane fault disconnects the peer once inflight writes drain, or after this.
    pub peer_fault_drain: Duration,
    /// A write to a peer still in flight this long after it was posted faults the peer and ends
    /// its session at once, on planes that do not bound their writes themselves
    /// ([`DataPlane::bounds_write_time`](crate::DataPlane::bounds_write_time)): vLLM 0.34's
    /// `VLLM_P2P_TRANSFER_STALL_TIMEOUT_S` on NIXL, where a WRITE that never completes would
    /// otherwise go unnoticed; zero disables it.
    pub transfer_stall_timeout: Duration,
    /// A write still running when its session ended keeps its source blocks pinned until the
    /// plane says it stopped, at most this long (then they are released anyway, and counted);
    /// the peer gets no new session meanwhile. vLLM 0.34's `_RETAINED_HOLD_CAP_S`.
    pub retained_hold_cap: Duration,
    /// First reconnect backoff after a repeated data-plane fault (the first fault waits 0).
    pub reconnect_min_backoff: Duration,
    /// Longest reconnect backoff; also how long a fault is remembered after its wait ends.
    pub reconnect_max_backoff: Duration,
    /// Wait before dialing a peer again after a dial of ours failed before the peer acked our
    /// `connect` (refused, lost, timed out); doubles per failure in a row.
    pub dial_min_backoff: Duration,
    /// Longest wait between failed dials of one peer.
    pub dial_max_backoff: Duration,
    /// A PD producer's stored blocks wait this long for the consumer's fetch.
    pub unbound_store_timeout: Duration,
    /// How long ids of reaped unbound stores are remembered, so late fetches fail at once.
    pub reaped_id_retention: Duration,
    /// Consecutive internal errors in dispatch that disconnect a peer.
    pub max_consecutive_dispatch_errors: u32,
    /// Keys of one inbound `lookup` asked of the store; the keys past it answer MISS unasked
    /// (the `lookup_resp` still lists every key). vLLM sends one key per block of a request.
    pub max_lookup_keys: usize,
    /// Keys of one slice of a peer's lookups (the first asked as the lookup arrives), and keys
    /// of all peers' queued lookups asked per core step, hosts in turn (`core/slices.rs`); the
    /// rest of a larger lookup waits for later steps, so other peers' messages are handled in
    /// between.
    pub lookup_slice_keys: usize,
    /// Keys of one peer's lookups asked of the store per second while other sessions' lookups
    /// wait (a token bucket holding one second's worth); past it the peer's lookups take only
    /// the core's steps no session within its budget wants (keys still unasked at the lookup's
    /// pending deadline answer MISS). Work-conserving: alone, a peer is never held to it.
    pub lookup_keys_per_sec: u64,
    /// Distinct blocks pinned for one peer's lookups at once (each pin reference also counts
    /// toward `max_held_keys_per_peer`); keys past it answer MISS (not pinned).
    /// `None`: one eighth of the pool, but at least 256 blocks (or the whole pool if smaller).
    pub max_pins_per_peer: Option<usize>,
    /// Blocks pinned for all peers' lookups together (each peer's distinct blocks, summed);
    /// past it the heaviest holder's oldest pins that no write reads and no fetch asked for are
    /// released (that lookup's fetch then fails), so lookups never fetched cannot keep the pool
    /// from taking new blocks, and a newcomer's lookups still pin. `None`: half the pool, but at
    /// least one peer's share.
    pub max_pinned_blocks: Option<usize>,
    /// How old a lookup's pin must be before the node-wide cap may release it: a consumer
    /// fetches right after its lookup, so a younger pin is likely about to be read.
    pub pin_eviction_min_age: Duration,
    /// Keys held for one peer at once: its open lookups (unanswered, at least 1 each), its pin
    /// references and the keys of its fetches waiting for a store. A lookup past it answers MISS at once, a fetch
    /// fails at once.
    pub max_held_keys_per_peer: usize,
    /// Estimated bytes of what [`CoreConfig::max_held_keys_per_peer`] counts, bounded the same way.
    pub max_held_bytes_per_peer: usize,
    /// Estimated bytes all peers hold together (the sum of what `max_held_bytes_per_peer`
    /// bounds per peer). Past it, a peer takes more only while it holds less than an equal
    /// part of it (this cap over the peers holding anything), so many sessions each at their
    /// own share cannot hold the node's memory, and a peer holding little is still served;
    /// the total stays under twice this.
    pub max_held_bytes: usize,
    /// Requests one peer may have open on this node's producer side at once; a lookup or
    /// fetch that would open another is answered MISS / failed at once.
    pub max_requests_per_peer: usize,
    /// Blocks a peer's pool may have (its `connect`'s `num_blocks`): a larger one is refused
    /// at the `connect`, before the data plane maps it or prepares a descriptor per block
    /// (NIXL), so a number the peer chose cannot make this node allocate without bound. A
    /// pool no larger than this node's own is always taken.
    pub max_peer_blocks: u64,
}

impl CoreConfig {
    /// Blocks a peer's lookups may hold pinned, for a pool of `num_blocks`.
    pub fn pins_per_peer(&self, num_blocks: u64) -> usize {
        self.max_pins_per_peer.unwrap_or_else(|| {
            let pool = usize::try_from(num_blocks).unwrap_or(usize::MAX);
            (pool / 8).max(pool.min(256))
        })
    }

    /// Blocks all peers' lookups may hold pinned together, for a pool of `num_blocks`.
    pub fn pinned_blocks_total(&self, num_blocks: u64) -> usize {
        self.max_pinned_blocks.unwrap_or_else(|| {
            let pool = usize::try_from(num_blocks).unwrap_or(usize::MAX);
            (pool / 2).max(self.pins_per_peer(num_blocks))
        })
    }
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            max_peers: 128,
            max_peers_per_host: 32,
            handshake_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(300),
            idle_headroom: 8,
            lookup_timeout: Duration::from_secs(8),
            load_timeout: Duration::from_secs(10),
            pd_load_timeout: Duration::from_secs(30),
            abort_ack_timeout: Duration::from_secs(5),
            store_timeout: Duration::from_secs(30),
            lookup_pending_timeout: Duration::from_secs(5),
            lookup_repoll_interval: Duration::from_millis(1),
            cancel_drain_warning: Duration::from_secs(10),
            cancel_retry_interval: Duration::from_millis(100),
            peer_fault_drain: Duration::from_secs(10),
            transfer_stall_timeout: Duration::from_secs(20),
            retained_hold_cap: Duration::from_secs(30),
            reconnect_min_backoff: Duration::from_secs(1),
            reconnect_max_backoff: Duration::from_secs(60),
            dial_min_backoff: Duration::from_millis(250),
            dial_max_backoff: Duration::from_secs(5),
            unbound_store_timeout: Duration::from_secs(60),
            reaped_id_retention: Duration::from_secs(60),
            max_consecutive_dispatch_errors: 5,
            max_lookup_keys: 1 << 17,
            lookup_slice_keys: 256,
            lookup_keys_per_sec: 1 << 18,
            max_pins_per_peer: None,
            max_pinned_blocks: None,
            pin_eviction_min_age: Duration::from_secs(1),
            max_held_keys_per_peer: 1 << 21,
            max_held_bytes_per_peer: 256 << 20,
            max_held_bytes: 1 << 30,
            max_requests_per_peer: 1 << 17,
            max_peer_blocks: 1 << 22,
        }
    }
}

/// What this node tells its peers in `connect`, and checks theirs against.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalNode {
    /// This node's identity, `host:port` of its control socket.
    pub peer_id: PeerId,
    /// Data-plane metadata advertised in `connect`.
    pub agent_metadata: Vec<u8>,
    /// Base address of the block region (informational for non-RDMA planes).
    pub base_addr: u64,
    /// Blocks in the region.
    pub num_blocks: u64,
    /// Bytes per block; peers must match it exactly.
    pub block_len: u64,
    /// Model configuration fingerprint; empty matches anything.
    pub config_fingerprint: String,
    /// Prefix-cache hash seed; peers must match it exactly.
    pub hash_seed: String,
}
