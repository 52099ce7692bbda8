//! vLLM's KV event stream on the wire, spoken natively (no libzmq): the sockets of vLLM 0.33's
//! `ZmqEventPublisher` (`vllm/distributed/kv_events.py`) from both ends.
//!
//! * [`EventSubscriber`] follows one engine: a SUB that connects to the engine's bound PUB
//!   (`endpoint = "tcp://*:P"`) or binds and accepts the PUB the engine connects
//!   (`endpoint = "tcp://host:P"`), plus, when the engine has a replay socket, a DEALER to its
//!   ROUTER for [`EventSubscriber::request_replay`]. It yields [`SubEvent`]s, which is what
//!   `kvpeer_pool::Follower` takes (`connected`, `live`, `replayed`, `replay_end`).
//! * [`EventPublisher`] is the pool's own stream: a PUB listener whose subscribers get every
//!   published message whose topic their subscription prefixes (drops past a bounded
//!   per-connection queue, counted: libzmq's `SNDHWM` for a PUB), and an optional replay ROUTER
//!   answering each `["", start_seq]` with the messages `kvpeer_pool::Publisher::replay` gives.
//! * [`wire`]: the messages' shapes.
//!
//! The protocol of each connection is [`Connection`](crate::zmtp::connection::Connection) (sans-IO);
//! `client.rs` (a connecting socket that reconnects with backoff) and the crate's listener
//! (`listener.rs`: a listening socket and its accepted connections, capped, which the control
//! ROUTER is too) carry it over non-blocking TCP.
//!
//! **Threads.** Everything here is owned by one thread (the pool node's), which may drive any
//! number of subscribers and publishers together without blocking: each is an [`EventIo`] with
//! its own epoll set (every socket it holds registered once, as the control channel's are),
//! whose descriptor turns readable when one of them has news; [`wait_all`] sleeps in one
//! `ppoll(2)` over those descriptors and an extra one of the caller's (a wake pipe), then lets
//! each driver take its news and drive only the sockets that have some or are due. After a
//! wait the caller takes what happened (`EventSubscriber::poll_event`,
//! `EventPublisher::serve_replays`); `publish` and `request_replay` never block (they write at
//! once when the socket takes it, else queue, bounded). Nothing reads a clock except at the
//! entry points (`wait_all`, `publish`).

mod client;
mod publisher;
mod subscriber;
pub mod wire;

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollFlags};
use nix::sys::time::TimeSpec;

pub use publisher::{EventPublisher, PublisherConfig, PublisherStats};
pub use subscriber::{EventSubscriber, SubEndpoint, SubEvent, SubscriberConfig, SubscriberStats};

/// Why a KV event socket could not be set up or waited on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum EventsError {
    /// A listening socket could not be bound.
    #[error("cannot listen for the KV event stream ({what}) at {addr}: {source}")]
    Bind {
        /// Which socket (`"PUB"`, `"replay ROUTER"`, `"SUB"`).
        what: &'static str,
        /// Where.
        addr: std::net::SocketAddr,
        /// The system's error.
        source: std::io::Error,
    },
    /// Waiting on the sockets failed.
    #[error("cannot wait on the KV event sockets: {0}")]
    Wait(#[source] std::io::Error),
}

/// Something one thread drives with others in one wait: the descriptor of its epoll set, its
/// next deadline, and what to do after the wait. [`wait_all`] calls the three in that order.
pub trait EventIo {
    /// Its epoll set: readable while one of its sockets has news.
    fn poll_fd(&self) -> BorrowedFd<'_>;
    /// When it must be driven without news (`now` or earlier: at once, e.g. while it holds
    /// events not yet taken).
    fn next_deadline(&mut self, now: Instant) -> Option<Instant>;
    /// The wait returned (`polled`: its descriptor was readable): takes its sockets' news,
    /// reads, writes and runs the deadlines due at `now`.
    fn progress(&mut self, now: Instant, polled: bool);
}

/// Sleeps in one `ppoll(2)` over every driver's epoll set and `extra` (readable wakes it)
/// until something is ready, the nearest deadline, or `timeout`; then drives each. Whether any
/// descriptor was ready (a signal counts as a wake-up).
pub fn wait_all(
    drivers: &mut [&mut dyn EventIo],
    timeout: Duration,
    extra: Option<BorrowedFd<'_>>,
) -> Result<bool, EventsError> {
    let now = Instant::now();
    let mut timeout = timeout;
    for d in drivers.iter_mut() {
        if let Some(at) = d.next_deadline(now) {
            timeout = timeout.min(at.saturating_duration_since(now));
        }
    }
    let mut fds = Vec::with_capacity(drivers.len() + 1);
    if let Some(fd) = extra {
        fds.push(PollFd::new(fd, PollFlags::POLLIN));
    }
    for d in drivers.iter() {
        fds.push(PollFd::new(d.poll_fd(), PollFlags::POLLIN));
    }
    let spec = TimeSpec::from_duration(timeout.min(Duration::from_secs(86_400)));
    let woke = match nix::poll::ppoll(&mut fds, Some(spec), None) {
        Ok(n) => n > 0,
        // A signal woke us: drive everything once, as after any wake-up.
        Err(nix::errno::Errno::EINTR) => true,
        Err(e) => return Err(EventsError::Wait(e.into())),
    };
    let polled: Vec<bool> = fds
        .iter()
        .skip(usize::from(extra.is_some()))
        .map(|fd| fd.revents().is_some_and(|r| !r.is_empty()))
        .collect();
    drop(fds);
    let now = Instant::now();
    for (d, polled) in drivers.iter_mut().zip(polled) {
        d.progress(now, polled);
    }
    Ok(woke)
}
