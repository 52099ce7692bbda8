//! The kvpeer node: a core, a block store, a data plane and a control channel, driven by one
//! thread. Today: the I/O step ([`io::NodeIo`]); the runtime thread, the public API and
//! configuration come next (issue 5).

pub mod build;
pub mod io;
pub mod wake;
