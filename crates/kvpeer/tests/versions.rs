//! The supported vLLM releases are stated once (`kvpeer::VLLM_PEERS`, `kvpeer::VLLM_TIER`)
//! and said the same everywhere a user reads them: the README, `kvpeer --help`, the metrics'
//! `kvpeer_build_info`, the Python package; and no page, comment or message states an older
//! range.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

mod common;
use common::BIN;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[test]
fn the_readme_help_and_metrics_state_the_supported_releases_as_declared() {
    let readme = std::fs::read_to_string(repo().join("README.md")).unwrap();
    let statement = readme
        .split("**Supported vLLM releases**")
        .nth(1)
        .expect("the README's statement");
    let statement: String = statement
        .split("\n\n")
        .next()
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    // Each named whole: not followed by another digit (`0.34` is not `0.341`).
    let names = |releases: &str| {
        let said = format!("vLLM {releases}");
        statement
            .match_indices(&said)
            .any(|(at, _)| !statement[at + said.len()..].starts_with(|c: char| c.is_ascii_digit()))
    };
    assert!(
        names(kvpeer::VLLM_PEERS) && names(kvpeer::VLLM_TIER),
        "README: {statement}"
    );

    let help = std::process::Command::new(BIN)
        .arg("--help")
        .output()
        .unwrap();
    // As read, whatever width clap wrapped it to.
    let help = String::from_utf8_lossy(&help.stdout)
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    assert!(help.contains(kvpeer::SUPPORTED_VLLM), "{help}");

    let metrics = kvpeer::metrics::render_process();
    assert!(
        metrics.contains(&format!(
            "kvpeer_build_info{{version=\"{}\",vllm=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            kvpeer::SUPPORTED_VLLM
        )),
        "{metrics}"
    );

    let python = std::fs::read_to_string(repo().join("python/kvpeer/__init__.py")).unwrap();
    assert!(
        python.contains(&format!("({})", kvpeer::VLLM_PEERS))
            && python.contains(&format!("({})", kvpeer::VLLM_TIER)),
        "python/kvpeer/__init__.py"
    );
}

/// Every file a reader or a user meets: the README, docs/, the Python package, the sources.
fn texts(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().into_owned();
        if path.is_dir() {
            if !name.starts_with('.') && name != "target" && name != "__pycache__" {
                texts(&path, out);
            }
        } else if [".md", ".rs", ".py", ".pyi", ".toml"]
            .iter()
            .any(|e| name.ends_with(e))
        {
            out.push(path);
        }
    }
}

/// Where `text` states a range of peers' releases from 0.27 that ends before the newest, or
/// "0.27 and later" (which promises releases nobody tested).
fn stale_ranges(text: &str) -> Vec<String> {
    let newest = kvpeer::VLLM_PEERS.rsplit(' ').next().unwrap();
    let mut found = Vec::new();
    for (at, _) in text.match_indices("0.27") {
        let rest = &text[at + 4..];
        if rest.starts_with(" and later") {
            found.push(format!("0.27{}", &rest[..10]));
            continue;
        }
        let after = [" to ", "–", "-"]
            .iter()
            .find_map(|sep| rest.strip_prefix(sep));
        if let Some(end) = after {
            let end: String = end
                .chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.')
                .collect();
            let end = end.trim_end_matches('.');
            if end.starts_with("0.") && end != newest {
                found.push(format!("0.27..{end}"));
            }
        }
    }
    found
}

#[test]
fn no_page_comment_or_message_states_an_older_range() {
    assert_eq!(stale_ranges("vLLM 0.27 to 0.33."), vec!["0.27..0.33"]);
    assert_eq!(stale_ranges("vLLM 0.27–0.33's"), vec!["0.27..0.33"]);
    assert_eq!(stale_ranges("vLLM 0.27 and later"), vec!["0.27 and later"]);
    assert!(stale_ranges("vLLM 0.27 to 0.34, 0.27–0.34.").is_empty());

    let root = repo();
    let mut files = vec![root.join("README.md")];
    for dir in ["docs", "python", "crates", "tests", "scripts"] {
        texts(&root.join(dir), &mut files);
    }
    let this = Path::new(file!()).file_name().unwrap();
    let mut stale = Vec::new();
    for file in files.iter().filter(|f| f.file_name() != Some(this)) {
        let Ok(text) = std::fs::read_to_string(file) else {
            continue;
        };
        for s in stale_ranges(&text) {
            stale.push(format!(
                "{}: {s}",
                file.strip_prefix(&root).unwrap_or(file).display()
            ));
        }
    }
    assert!(
        stale.is_empty(),
        "older statements of the releases: {stale:#?}"
    );
}
