//! The kvpeer node: a core, a block store, a data plane and a control channel, driven by one
//! thread: [`build`] makes the parts, [`io::NodeIo`] is one round of I/O, `runtime` is the
//! thread that owns a node behind the [`Node`](crate::Node) handle.

pub mod allow;
pub mod auth;
pub mod build;
pub mod io;
pub mod origin;
pub(crate) mod runtime;
pub mod wake;
