//! [`SharedEngine`]: an [`EngineNode`] shared between the engine's threads, with or without an
//! I/O thread of its own.
//!
//! vLLM calls its tiers on the scheduler thread under its lock, step after step, and whatever a
//! tier does there delays the engine. With the I/O thread (`kvpeer-engine-io`), the engine's
//! calls only hand work to the node's core and take its events, under a mutex held for
//! microseconds; every system call (reading and writing the control sockets, the data planes'
//! completions, the wake pipe's reads) happens on the I/O thread, which sleeps on the node's
//! [`wait_plan`](EngineNode::wait_plan) without holding the mutex and steps the node when
//! woken. A peer's lookup, the engine's answer to it and the load's end so move at the speed of
//! the network, not of the engine's steps. Without it, the engine's own calls drive the node
//! ([`EngineNode::step`], [`EngineNode::drive`]), as before.
//!
//! Called from any thread, one call at a time or not. Nothing here waits on the network; the
//! engine's calls wait only for the mutex, which the I/O thread holds for one step. The node
//! is dropped only after the I/O thread is joined, so the descriptor it sleeps on is never
//! closed under it.

use std::os::fd::BorrowedFd;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;
use tracing::{error, warn};

use super::node::{EngineEvent, EngineNode};

/// The longest the I/O thread sleeps without a deadline (it is woken for everything else).
const IDLE_WAIT: Duration = Duration::from_millis(100);

/// The node and what the I/O thread tells the engine's threads.
struct Shared {
    /// `None` once the node was taken out (stopping): the I/O thread then ends.
    node: Mutex<Option<EngineNode>>,
    /// Notified after a step of the I/O thread that left events.
    stepped: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Option<EngineNode>> {
        // A panic inside a call leaves the node as it was between calls: keep serving.
        self.node.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// An [`EngineNode`] behind a mutex, stepped by its own I/O thread or by its callers.
pub struct SharedEngine {
    shared: Arc<Shared>,
    /// Whether an I/O thread steps the node (it may have ended since: the node was taken).
    threaded: bool,
    io_thread: Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for SharedEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedEngine")
            .field("io_thread", &self.threaded)
            .finish_non_exhaustive()
    }
}

impl SharedEngine {
    /// Shares `node`; with `io_thread`, starts the thread that does its I/O (the node's calls
    /// then defer their sending to it: [`EngineNode::defer_io`]).
    pub fn new(mut node: EngineNode, io_thread: bool) -> std::io::Result<Self> {
        if io_thread {
            // One step registers the wake pipe in the channel's poll, so the I/O thread's
            // first sleep already wakes for it.
            node.step(Instant::now());
            node.defer_io(true);
        }
        let shared = Arc::new(Shared {
            node: Mutex::new(Some(node)),
            stepped: Condvar::new(),
        });
        let io_thread = if io_thread {
            let for_thread = shared.clone();
            Some(
                std::thread::Builder::new()
                    .name("kvpeer-engine-io".into())
                    .spawn(move || run_io(&for_thread))?,
            )
        } else {
            None
        };
        Ok(SharedEngine {
            shared,
            threaded: io_thread.is_some(),
            io_thread: Mutex::new(io_thread),
        })
    }

    /// Whether an I/O thread steps the node.
    pub fn has_io_thread(&self) -> bool {
        self.threaded
    }

    /// Runs `f` on the node, under its mutex (`None` once stopped).
    pub fn with<T>(&self, f: impl FnOnce(&mut EngineNode) -> T) -> Option<T> {
        self.shared.lock().as_mut().map(f)
    }

    /// The node's events. Without an I/O thread, the node is stepped first (or driven for at
    /// most `wait` when it is not zero); with one, this waits at most `wait` for a step of it
    /// that leaves events, when there are none; and with a `wait` of zero it never waits for
    /// the node's mutex: while the I/O thread holds it (a step, which on a busy node or a
    /// preempted thread can take a while), there is nothing yet, and the events come with the
    /// next call.
    pub fn poll(&self, wait: Duration) -> Option<Vec<EngineEvent>> {
        let mut guard = if self.threaded && wait.is_zero() {
            match self.shared.node.try_lock() {
                Ok(guard) => guard,
                Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => return Some(Vec::new()),
            }
        } else {
            self.shared.lock()
        };
        if !self.threaded {
            let node = guard.as_mut()?;
            if wait.is_zero() {
                node.step(Instant::now());
            } else {
                node.drive(wait);
            }
        } else if !wait.is_zero() && !guard.as_ref()?.has_events() {
            guard = self
                .shared
                .stepped
                .wait_timeout(guard, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        let node = guard.as_mut()?;
        Some(std::iter::from_fn(|| node.poll_event()).collect())
    }

    /// Takes the node out, once its I/O thread (if any) has ended; `None` if it was taken.
    /// Calls at once are served one after the other: the node is handed out only after the
    /// thread that sleeps on its descriptors was joined.
    pub fn stop(&self) -> Option<EngineNode> {
        let mut thread = self.io_thread.lock().unwrap_or_else(|p| p.into_inner());
        let node = self.shared.lock().take();
        // A `poll` waiting for events returns (with nothing: the node is gone).
        self.shared.stepped.notify_all();
        if let Some(thread) = thread.take() {
            if let Some(node) = &node {
                node.wake_io();
            }
            // Its next look at the mutex finds no node and it ends.
            if thread.join().is_err() {
                error!("the engine's I/O thread panicked");
            }
        }
        drop(thread);
        let mut node = node?;
        node.defer_io(false);
        Some(node)
    }
}

impl Drop for SharedEngine {
    fn drop(&mut self) {
        // The I/O thread ends before the node (and the descriptor it sleeps on) goes.
        drop(self.stop());
    }
}

/// The I/O thread: sleeps on the node's plan without holding it, then steps it.
fn run_io(shared: &Shared) {
    loop {
        let (fd, timeout) = {
            let mut guard = shared.lock();
            let Some(node) = guard.as_mut() else {
                return;
            };
            node.wait_plan(Instant::now(), IDLE_WAIT)
        };
        if !timeout.is_zero() {
            // SAFETY: `fd` is the node's epoll set, open while the node lives; the node is
            // dropped only after this thread is joined (`SharedEngine::stop`), so it is open
            // for the whole wait.
            let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
            let mut fds = [PollFd::new(borrowed, PollFlags::POLLIN)];
            match nix::poll::ppoll(&mut fds, Some(TimeSpec::from_duration(timeout)), None) {
                Ok(_) | Err(Errno::EINTR) => {}
                Err(e) => {
                    if let Some(suppressed) = crate::admit_warning("engine I/O wait failed") {
                        warn!(error = %e, suppressed, "engine I/O wait failed");
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        }
        let mut guard = shared.lock();
        let Some(node) = guard.as_mut() else {
            return;
        };
        // A panic inside a step leaves the node as it was between steps (as a panic inside an
        // engine's call does): keep stepping, or nothing would ever end the engine's loads.
        let stepped = std::panic::catch_unwind(AssertUnwindSafe(|| node.step(Instant::now())));
        if stepped.is_err() {
            if let Some(suppressed) = crate::admit_warning("engine I/O step panicked") {
                error!(
                    suppressed,
                    "a step of the engine's node panicked; stepping on"
                );
            }
        }
        if node.has_events() {
            shared.stepped.notify_all();
        }
    }
}
