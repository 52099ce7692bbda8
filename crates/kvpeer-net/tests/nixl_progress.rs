//! Who progresses UCX in the nixl plane: NIXL's agent has no progress thread (that thread polls
//! UCX without blocking, a whole core per agent for the agent's life), the plane's watcher
//! progresses it only while WRITEs are in flight or expected, and waits otherwise. Checked here
//! by mechanism, not by timing: the threads NIXL starts, WRITEs in both directions completing
//! with the target's watcher driving UCX only while it expects them (over UCX's default
//! transports and, in `nixl_progress_over_tcp`, over UCX's TCP transport, where every byte needs
//! the target's progress), and the watchers parked, their sweep counts frozen, once nothing is
//! in flight or expected.
//!
//! One test per binary run (`harness` default, single test): it counts the process's threads.
//! Needs NIXL's wheel: `KVPEER_NIXL_LIB_DIR` names the directory of `libnixl_capi.so`.

#![cfg(feature = "nixl")]

mod nixl_support;

#[test]
fn nixl_progress_is_driven_only_while_writes_are_in_flight_or_expected() {
    if std::env::var_os("UCX_NET_DEVICES").is_none() {
        std::env::set_var("UCX_NET_DEVICES", "lo");
    }
    nixl_support::exercise();
}
