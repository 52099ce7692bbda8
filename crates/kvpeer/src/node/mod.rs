//! The kvpeer node: a core, a block store, a data plane and a control channel, driven by one
//! thread: [`build`] makes the parts, [`io::NodeIo`] is one round of I/O, `runtime` is the
//! thread that owns a node behind the [`Node`](crate::Node) handle.
//!
//! Public for configuration ([`allow::Allowlist`], [`build::NodeSpec`]) and as the low-level
//! driver ([`build::build`], [`io::NodeIo`]) that tests and tools use to run a core over real
//! sockets from their own loop; the rest (authentication, origin checks, the wake pipe, the
//! runtime thread) is internal.

pub mod allow;
pub(crate) mod auth;
pub mod build;
pub(crate) mod decodes;
pub mod descriptors;
pub mod identity_probe;
pub mod io;
pub(crate) mod lookup_waits;
pub(crate) mod origin;
pub(crate) mod outcomes;
pub mod peer_end;
pub mod plane;
pub mod resolve;
pub mod routable;
pub mod tenants;
pub(crate) mod wake;

pub use auth::AuthError;
