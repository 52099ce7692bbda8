//! The Python the interop tests run, and the PYTHONPATH holding vLLM 0.33's modules; one
//! definition for kvpeer-net's tests and kvpeer's (`crates/kvpeer/tests/common/vllm.rs`
//! includes this file).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The repository's root.
pub(crate) fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Python with pyzmq and msgspec: `KVPEER_PYTHON`, or the venv scripts/test.sh makes.
pub(crate) fn python() -> PathBuf {
    if let Some(p) = std::env::var_os("KVPEER_PYTHON") {
        return PathBuf::from(p);
    }
    let venv = repo().join("target/kvpeer-venv/bin/python");
    assert!(
        venv.exists(),
        "needs the Python of scripts/test.sh's venv (pyzmq, msgspec): run scripts/test.sh (it \
         makes {}) or set KVPEER_PYTHON",
        venv.display()
    );
    venv
}

/// The PYTHONPATH holding vLLM's P2P and KV event modules and the stubs
/// (tests/interop/setup.sh, once per test binary; `KVPEER_INTEROP_PYTHONPATH` names a
/// prepared one).
pub(crate) fn pythonpath() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(p) = std::env::var("KVPEER_INTEROP_PYTHONPATH") {
            return p;
        }
        let out = Command::new("bash")
            .arg(repo().join("tests/interop/setup.sh"))
            .env("KVPEER_PYTHON", python())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "tests/interop/setup.sh failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_owned()
    })
}
