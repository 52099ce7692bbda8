//! How any socket of ours is driven, the one wait loop every driver is built on:
//!
//! * [`poller`]: the thread's epoll set, edge-triggered, each socket registered once under a
//!   token its owner chooses; a wait hands back only what changed, with a timeout in
//!   nanoseconds;
//! * [`timers`]: the sockets' deadlines in one heap, so a wake visits only the sockets due,
//!   on a coarse grid that batches nearby heartbeats into one wake;
//! * [`sockio`]: the non-blocking steps every driver takes on a socket (connect, read within a
//!   budget, write, accept), each telling whether the socket may still have more.
//!
//! The control channel (`control/`) and each KV event socket owner (`events/`) hold one poller
//! and drive their listeners and dialers (`zmtp/`) through it.

pub(crate) mod poller;
pub(crate) mod sockio;
pub(crate) mod timers;
