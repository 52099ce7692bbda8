//! A node's configuration from Python: a dict of kvpeer's own keys (those of
//! docs/configuration.md) to values as a config file writes them (a string, a number, a bool,
//! or a list of strings for the list keys), checked by the same builder and bounds as a config
//! file, so Python cannot make a configuration the command line would refuse.

use std::collections::BTreeMap;

use kvpeer::NodeConfig;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::errors::{config_error, ConfigError};

/// `settings` as text: a string as is, a bool `true`/`false`, a number in decimal, a list or
/// tuple of strings one item a line, as a config file's array travels (the list keys:
/// `allowlist`, `follow`, `pool_shard`; a follow spec holds a comma).
/// Any other value is a `ConfigError` naming its key.
pub(crate) fn settings_text(
    settings: &BTreeMap<String, Bound<'_, PyAny>>,
) -> PyResult<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for (key, value) in settings {
        out.insert(key.clone(), text_of(key, value)?);
    }
    Ok(out)
}

fn text_of(key: &str, value: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = value.cast::<PyString>() {
        return Ok(s.to_str()?.to_owned());
    }
    if let Ok(b) = value.cast::<PyBool>() {
        return Ok(if b.is_true() { "true" } else { "false" }.to_owned());
    }
    if value.is_instance_of::<PyInt>() {
        return Ok(value.str()?.to_str()?.to_owned());
    }
    if let Ok(f) = value.cast::<PyFloat>() {
        // As a TOML file's float becomes text: `2.5e9` is "2500000000", not Python's
        // "2500000000.0" (which no whole-number key would take).
        return Ok(f.value().to_string());
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for item in value.try_iter()? {
            let item = item?;
            match item.cast::<PyString>() {
                Ok(s) => items.push(s.to_str()?.to_owned()),
                Err(_) => return Err(bad_value(key, value)),
            }
        }
        return Ok(items.join("\n"));
    }
    Err(bad_value(key, value))
}

fn bad_value(key: &str, value: &Bound<'_, PyAny>) -> PyErr {
    let shown = value
        .repr()
        .map_or_else(|_| "?".to_owned(), |r| r.to_string());
    ConfigError::new_err((
        format!("{key}: {shown} is not a string, a number, a bool or a list of strings"),
        key.to_owned(),
    ))
}

/// The configuration `settings` describe over the declared defaults; `tag` names a pool's
/// shm object, `source` where the user wrote them (errors name it). An unknown key or a bad
/// value is a `ConfigError` naming the key.
pub(crate) fn node_config(
    tag: &str,
    source: &str,
    settings: &BTreeMap<String, String>,
) -> PyResult<NodeConfig> {
    let mut builder = NodeConfig::builder(tag).source(source);
    for (key, value) in settings {
        builder = builder.set(key, value);
    }
    builder.build().map_err(|e| config_error(&e))
}
