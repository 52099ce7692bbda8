//! The module's Python exceptions, and how Rust errors become them.
//!
//! * `KvpeerError` (a `RuntimeError`): the node could not do what was asked (build, bind,
//!   shut down); the message is the Rust error's chain.
//! * `ConfigError` (a `ValueError`): a setting is unknown or out of bounds; `args` is
//!   `(message, key)`, so a caller can name the key in its own terms.
//! * `PlaneUnavailable` (a `KvpeerError`): the plane asked for is not in this build (nixl).
//! * `PeerUnavailable` (a `KvpeerError`): `Node.lookup`/`fetch` found no session with the
//!   peer: nothing listens, not a control port, it refused this node, it differs in
//!   configuration, or it did not answer in time; the message says which.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::PyErr;

create_exception!(
    _native,
    KvpeerError,
    PyRuntimeError,
    "kvpeer could not do what was asked."
);
create_exception!(
    _native,
    ConfigError,
    PyValueError,
    "A setting is unknown or has a bad value; args[1] names the key."
);
create_exception!(
    _native,
    PlaneUnavailable,
    KvpeerError,
    "The data plane asked for is not in this build."
);

create_exception!(
    _native,
    PeerUnavailable,
    KvpeerError,
    "No session with the peer (unreachable, refused, or silent); the message says which."
);

/// `e` and those of its sources its own text does not already say, as a `KvpeerError`.
pub(crate) fn kvpeer_error(what: &str, e: &(dyn std::error::Error + 'static)) -> PyErr {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let said = s.to_string();
        if !text.contains(&said) {
            text.push_str(&format!(": {said}"));
        }
        source = s.source();
    }
    if !text.starts_with(what) {
        text = format!("{what}: {text}");
    }
    KvpeerError::new_err(text)
}

/// A configuration error, naming its key.
pub(crate) fn config_error(e: &kvpeer::config::ConfigError) -> PyErr {
    ConfigError::new_err((e.to_string(), e.key.clone()))
}
