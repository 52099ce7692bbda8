//! `nixl_progress.rs` with UCX moving the bytes over TCP (`UCX_TLS=tcp`): there the target's
//! worker must run for every byte of a peer's WRITE, so WRITEs complete only because the
//! target's watcher progresses UCX while it expects them. Its own binary: UCX reads `UCX_TLS`
//! once per process.

#![cfg(feature = "nixl")]

mod nixl_support;

#[test]
fn nixl_progress_over_ucx_tcp_is_driven_by_the_targets_watcher() {
    std::env::set_var("UCX_TLS", "tcp");
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    nixl_support::exercise();
}
