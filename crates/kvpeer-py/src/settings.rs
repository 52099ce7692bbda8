//! A node's configuration from Python: a `dict[str, str]` of kvpeer's own keys (those of
//! docs/configuration.md), checked by the same builder and bounds as a config file, so Python
//! cannot make a configuration the command line would refuse.

use std::collections::BTreeMap;

use kvpeer::NodeConfig;
use pyo3::PyResult;

use crate::errors::config_error;

/// The configuration `settings` describe over the declared defaults; `tag` names a pool's
/// shm object. An unknown key or a bad value is a `ConfigError` naming the key.
pub(crate) fn node_config(tag: &str, settings: &BTreeMap<String, String>) -> PyResult<NodeConfig> {
    let mut builder = NodeConfig::builder(tag);
    for (key, value) in settings {
        builder = builder.set(key, value);
    }
    builder.build().map_err(|e| config_error(&e))
}
