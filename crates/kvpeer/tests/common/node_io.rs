//! Driving [`NodeIo`]s by hand on the test's thread (the runtime thread's job in a `Node`), and
//! checking that one holds nothing open.

use std::time::{Duration, Instant};

use kvpeer::node::io::NodeIo;

/// Steps `n` until `done` holds; panics after `timeout`, with the node's open state.
pub(crate) fn step_until(n: &mut NodeIo, timeout: Duration, done: impl FnMut(&mut NodeIo) -> bool) {
    if !step_for(n, timeout, Duration::from_millis(2), done) {
        panic!(
            "condition not reached within {timeout:?}: core {:?}, store {:?}",
            n.core().stats(),
            n.core().parent().stats()
        );
    }
}

/// Steps `n` (resting up to `pause` between steps) until `done` holds or `timeout` passes;
/// whether it held.
pub(crate) fn step_for(
    n: &mut NodeIo,
    timeout: Duration,
    pause: Duration,
    mut done: impl FnMut(&mut NodeIo) -> bool,
) -> bool {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let now = Instant::now();
        n.step(now);
        if done(n) {
            return true;
        }
        n.wait(now, pause);
    }
    false
}

/// Steps two nodes together until `done` holds; panics after `timeout`.
pub(crate) fn step_both_until(
    a: &mut NodeIo,
    b: &mut NodeIo,
    timeout: Duration,
    mut done: impl FnMut(&mut NodeIo, &mut NodeIo) -> bool,
) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let now = Instant::now();
        a.step(now);
        b.step(now);
        if done(a, b) {
            return;
        }
        a.wait(now, Duration::from_millis(2));
    }
    panic!("condition not reached within {timeout:?}");
}

/// Nothing pinned, written, or held for any peer.
pub(crate) fn assert_clean(n: &NodeIo) {
    let s = n.core().parent().stats();
    assert_eq!((s.pinned, s.jobs, s.writing), (0, 0, 0), "{s:?}");
    let k = n.core().stats();
    assert_eq!(
        (
            k.client_requests,
            k.server_requests,
            k.store_jobs,
            k.inflight
        ),
        (0, 0, 0, 0),
        "{k:?}"
    );
}
