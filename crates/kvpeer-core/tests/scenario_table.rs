//! The table of upstream scenarios is complete and true.
//!
//! Reads the upstream scenario list carried in `upstream_scenarios.txt` (the reference spec's
//! Appendix A: test_sessions.py, Appendix B: test_manager.py; checked against
//! `../shared/spec/vllm-p2p-reference.md` when that file is beside the checkout, as in CI), the
//! `/// upstream: Class.test_name` lines on the tests of this workspace, and
//! `upstream_not_applicable.txt` (scenario | reason).
//! Fails if a scenario is covered by neither, by both, or if an annotation names a scenario
//! that does not exist upstream. Then checks `docs/upstream-scenarios.md` is the table these
//! sources give; `KVPEER_BLESS=1` rewrites it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// (appendix, scenario) in spec order, as carried in `upstream_scenarios.txt`.
fn upstream() -> Vec<(char, String)> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/upstream_scenarios.txt");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (appendix, name) = l.split_once(' ').unwrap_or_else(|| panic!("bad line: {l}"));
            let appendix = match appendix {
                "A" => 'A',
                "B" => 'B',
                other => panic!("appendix {other:?} in: {l}"),
            };
            (appendix, name.trim().to_owned())
        })
        .collect()
}

/// (appendix, scenario) in spec order, read from the reference spec itself, when it is beside
/// the checkout (`../shared`, as in CI; a user's clone has none).
fn upstream_from_spec() -> Option<Vec<(char, String)>> {
    let spec = root().join("../shared/spec/vllm-p2p-reference.md");
    let text = std::fs::read_to_string(&spec).ok()?;
    let mut appendix = ' ';
    let mut out = Vec::new();
    for line in text.lines() {
        if line.starts_with("## Appendix A") {
            appendix = 'A';
        } else if line.starts_with("## Appendix B") {
            appendix = 'B';
        } else if line.starts_with("## ") {
            appendix = ' ';
        }
        if appendix == ' ' || !line.starts_with("- `") {
            continue;
        }
        // - `+` L424 `TestX.test_y` — ...
        let name = line.split('`').nth(3).expect("scenario line");
        out.push((appendix, name.to_owned()));
    }
    Some(out)
}

#[test]
fn the_carried_scenario_list_is_the_specs() {
    // Without the spec beside the checkout there is nothing to compare with (CI has it, and
    // scripts/test.sh refuses to run without it).
    if let Some(spec) = upstream_from_spec() {
        assert_eq!(
            upstream(),
            spec,
            "tests/upstream_scenarios.txt differs from ../shared/spec/vllm-p2p-reference.md"
        );
    }
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let path = entry.path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n == "target") {
                continue;
            }
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// scenario → tests that name it (as `file::test`).
fn annotations() -> BTreeMap<String, Vec<String>> {
    let mut files = Vec::new();
    rust_files(&root().join("crates"), &mut files);
    let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        let rel = file.strip_prefix(root()).unwrap().display().to_string();
        let mut pending: Vec<String> = Vec::new();
        for line in text.lines() {
            let t = line.trim();
            if let Some(name) = t.strip_prefix("/// upstream: ") {
                pending.push(name.trim().to_owned());
            } else if let Some(rest) = t.strip_prefix("fn ") {
                let test = rest.split('(').next().unwrap();
                for name in pending.drain(..) {
                    map.entry(name).or_default().push(format!("{rel}::{test}"));
                }
            }
        }
    }
    map
}

fn not_applicable() -> BTreeMap<String, String> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/upstream_not_applicable.txt");
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter(|l| !l.trim().is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (name, reason) = l
                .split_once('|')
                .unwrap_or_else(|| panic!("no reason: {l}"));
            (name.trim().to_owned(), reason.trim().to_owned())
        })
        .collect()
}

#[test]
fn every_upstream_scenario_has_a_test_or_a_reason() {
    let scenarios = upstream();
    assert_eq!(scenarios.len(), 220, "the spec lists 131 + 89 scenarios");
    let known: BTreeSet<&str> = scenarios.iter().map(|(_, n)| n.as_str()).collect();
    let tests = annotations();
    let na = not_applicable();
    let mut problems = Vec::new();
    for name in tests.keys().chain(na.keys()) {
        if !known.contains(name.as_str()) {
            problems.push(format!("{name}: no such upstream scenario"));
        }
    }
    for (_, name) in &scenarios {
        match (tests.contains_key(name), na.contains_key(name)) {
            (false, false) => problems.push(format!("{name}: neither a test nor a reason")),
            (true, true) => {
                problems.push(format!("{name}: both a test and a not-applicable reason"))
            }
            _ => {}
        }
    }
    assert!(
        problems.is_empty(),
        "{} problems:\n{}",
        problems.len(),
        problems.join("\n")
    );

    let mut table = String::from(
        "# Upstream scenarios and the tests that cover them\n\n\
         Every test scenario of vLLM 0.33's `test_sessions.py` (Appendix A below) and\n\
         `test_manager.py` (Appendix B), mapped to the kvpeer test that covers it, or to the reason it\n\
         does not apply. Generated from the `/// upstream:` lines on the tests and from\n\
         `crates/kvpeer-core/tests/upstream_not_applicable.txt`; the test\n\
         `crates/kvpeer-core/tests/scenario_table.rs` fails when this file is out of date or a\n\
         scenario is unaccounted for (`KVPEER_BLESS=1 cargo test -p kvpeer-core --test scenario_table`\n\
         rewrites it).\n",
    );
    let covered = scenarios
        .iter()
        .filter(|(_, n)| tests.contains_key(n))
        .count();
    let _ = writeln!(
        table,
        "\nCovered by tests: {covered}; not applicable: {}.\n",
        scenarios.len() - covered
    );
    for (appendix, title) in [('A', "test_sessions.py"), ('B', "test_manager.py")] {
        let _ = writeln!(
            table,
            "## Appendix {appendix}: {title}\n\n| upstream scenario | kvpeer |\n|---|---|"
        );
        for (_, name) in scenarios.iter().filter(|(a, _)| *a == appendix) {
            let cell = match tests.get(name) {
                Some(list) => list
                    .iter()
                    .map(|t| format!("`{t}`"))
                    .collect::<Vec<_>>()
                    .join("<br>"),
                None => format!("n/a: {}", na[name]),
            };
            let _ = writeln!(table, "| `{name}` | {cell} |");
        }
        table.push('\n');
    }
    let doc = root().join("docs/upstream-scenarios.md");
    if std::env::var_os("KVPEER_BLESS").is_some() {
        std::fs::write(&doc, &table).unwrap();
    }
    let current = std::fs::read_to_string(&doc).unwrap_or_default();
    assert!(current == table, "docs/upstream-scenarios.md is out of date: run KVPEER_BLESS=1 cargo test -p kvpeer-core --test scenario_table");
}
