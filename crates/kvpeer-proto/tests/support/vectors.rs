//! Loads the wire vectors made with vLLM's own encoder: the copy carried in
//! `crates/kvpeer-proto/tests/data/wire-vectors.json` (of `../shared/vectors/wire-vectors.json`;
//! scripts/test.sh also runs these tests on the shared file itself when it is beside the
//! checkout, and checks the copy is the same), or the file `KVPEER_VECTORS` names (vectors
//! generated from other random values, tests/vectors/gen_vectors.py).
//!
//! Shared by the library's and the CLI's vector tests. A missing or malformed file is an error,
//! never a skip.

// Included by several test binaries; each reads a different subset of the fields.
#![allow(dead_code)]

use std::path::PathBuf;

use kvpeer_proto::Outcome;
use serde_json::Value as Json;

/// One vector.
pub(crate) struct Vector {
    pub(crate) name: String,
    pub(crate) expect: Outcome,
    /// For valid vectors: encoding `message` must give exactly `payload`.
    pub(crate) roundtrip: bool,
    /// For valid vectors: the message in JSON form.
    pub(crate) message: Option<Json>,
    /// The msgpack payload.
    pub(crate) payload: Vec<u8>,
    pub(crate) hex: String,
}

pub(crate) fn path() -> PathBuf {
    if let Some(p) = std::env::var_os("KVPEER_VECTORS") {
        return PathBuf::from(p);
    }
    // Relative to either crate that includes this file (kvpeer-proto, kvpeer).
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../kvpeer-proto/tests/data/wire-vectors.json")
}

fn outcome(name: &str) -> Result<Outcome, String> {
    [
        Outcome::Valid,
        Outcome::Undecodable,
        Outcome::Ignored,
        Outcome::ProtocolError,
    ]
    .into_iter()
    .find(|o| o.as_str() == name)
    .ok_or_else(|| format!("unknown expect {name:?}"))
}

pub(crate) fn load() -> Result<Vec<Vector>, String> {
    let path = path();
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("cannot read wire vectors at {}: {e}", path.display()))?;
    let doc: Json =
        serde_json::from_str(&text).map_err(|e| format!("{} is not JSON: {e}", path.display()))?;
    let list = doc["vectors"]
        .as_array()
        .ok_or_else(|| format!("{}: no \"vectors\" list", path.display()))?;
    let mut vectors = Vec::with_capacity(list.len());
    for v in list {
        let name = v["name"]
            .as_str()
            .ok_or("vector without a name")?
            .to_owned();
        let hex = v["msgpack_hex"]
            .as_str()
            .ok_or_else(|| format!("{name}: no msgpack_hex"))?
            .to_owned();
        let payload = hex::decode(&hex).map_err(|e| format!("{name}: bad hex: {e}"))?;
        let expect = outcome(v["expect"].as_str().unwrap_or_default())
            .map_err(|e| format!("{name}: {e}"))?;
        vectors.push(Vector {
            expect,
            roundtrip: v["roundtrip"].as_bool().unwrap_or(false),
            message: v.get("message").filter(|m| !m.is_null()).cloned(),
            payload,
            hex,
            name,
        });
    }
    if vectors.is_empty() {
        return Err(format!("{}: no vectors", path.display()));
    }
    Ok(vectors)
}

/// Runs `check` on every vector as one libtest trial each (named `prefix::<vector name>`), and
/// exits with libtest's status. A vector file that cannot be loaded fails the run.
pub(crate) fn run_each(
    prefix: &'static str,
    check: fn(&Vector) -> Result<(), libtest_mimic::Failed>,
) -> ! {
    let args = libtest_mimic::Arguments::from_args();
    let vectors = match load() {
        Ok(v) => v,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    };
    let trials = vectors
        .into_iter()
        .map(|v| libtest_mimic::Trial::test(format!("{prefix}::{}", v.name), move || check(&v)))
        .collect();
    libtest_mimic::run(&args, trials).exit()
}
