//! Driving a [`NodeIo`] by hand on the test's thread (the runtime thread's job in a `Node`).

use std::time::{Duration, Instant};

use kvpeer::node::build::BuildPlane;
use kvpeer::node::io::NodeIo;

/// Steps `n` until `done` holds; panics after `timeout`, with the node's open state.
pub(crate) fn step_until<P: BuildPlane>(
    n: &mut NodeIo<P>,
    timeout: Duration,
    mut done: impl FnMut(&mut NodeIo<P>) -> bool,
) {
    let deadline = Instant::now() + timeout;
    while Instant::now() < deadline {
        let now = Instant::now();
        n.step(now);
        if done(n) {
            return;
        }
        n.wait(now, Duration::from_millis(2));
    }
    panic!(
        "condition not reached within {timeout:?}: core {:?}, store {:?}",
        n.core.stats(),
        n.core.parent().stats()
    );
}
