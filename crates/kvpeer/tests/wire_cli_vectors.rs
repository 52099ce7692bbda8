//! Every wire vector through the `kvpeer wire` binary: one test per vector.
//!
//! `decode` must print the vector's outcome (and for valid vectors exactly its message in JSON
//! form) with exit status 0 for valid, 1 otherwise; `encode` of a valid vector's message must
//! write exactly its bytes, raw and as hex.

#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../../kvpeer-proto/tests/support/vectors.rs"]
mod vectors;

use std::io::Write;
use std::process::{Command, Output, Stdio};

use kvpeer_proto::Outcome;
use libtest_mimic::Failed;
use serde_json::Value as Json;
use vectors::Vector;

fn kvpeer(args: &[&str], stdin: &[u8]) -> Result<Output, Failed> {
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpeer"))
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let mut input = child.stdin.take().ok_or("no stdin")?;
    input.write_all(stdin)?;
    drop(input);
    Ok(child.wait_with_output()?)
}

fn check_decode(v: &Vector, out: &Output) -> Result<(), Failed> {
    let stdout = String::from_utf8(out.stdout.clone())?;
    let line: Json = serde_json::from_str(stdout.trim())
        .map_err(|e| format!("decode printed {stdout:?}: {e}"))?;
    if line["kind"] != v.expect.as_str() {
        return Err(format!("expected {}, printed {line}", v.expect).into());
    }
    let want_status = if v.expect == Outcome::Valid { 0 } else { 1 };
    if out.status.code() != Some(want_status) {
        return Err(format!("exit status {:?}, expected {want_status}", out.status).into());
    }
    match (&v.message, v.expect) {
        (Some(message), Outcome::Valid) if &line["message"] != message => {
            Err(format!("printed {}\n  expected {message}", line["message"]).into())
        }
        (_, Outcome::Valid) => Ok(()),
        _ if line["error"].as_str().is_none_or(str::is_empty) => {
            Err(format!("no error text in {line}").into())
        }
        _ => Ok(()),
    }
}

fn check(v: &Vector) -> Result<(), Failed> {
    check_decode(v, &kvpeer(&["wire", "decode"], &v.payload)?)?;
    if v.hex.len() < 100_000 {
        check_decode(v, &kvpeer(&["wire", "decode", "--hex", &v.hex], b"")?)?;
    }
    check_decode(v, &kvpeer(&["wire", "decode", "--hex"], v.hex.as_bytes())?)?;
    let Some(message) = &v.message else {
        return Ok(());
    };
    let json = serde_json::to_vec(message)?;
    let raw = kvpeer(&["wire", "encode"], &json)?;
    if !raw.status.success() || raw.stdout != v.payload {
        return Err(format!(
            "encode: status {:?}, wrote {}, stderr {}",
            raw.status,
            hex::encode(&raw.stdout),
            String::from_utf8_lossy(&raw.stderr)
        )
        .into());
    }
    let hexed = kvpeer(&["wire", "encode", "--hex"], &json)?;
    if String::from_utf8(hexed.stdout)?.trim() != v.hex {
        return Err("encode --hex wrote other bytes".into());
    }
    Ok(())
}

fn main() {
    vectors::run_each("cli_vector", check)
}
