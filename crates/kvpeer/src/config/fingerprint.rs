//! vLLM's config fingerprint, computed as vLLM computes it: the first 16 hex digits of sha256
//! over Python's `json.dumps(fields, sort_keys=True, separators=(",", ":"))`. The JSON is
//! written by hand here: serde_json keeps insertion order and never escapes non-ASCII, and the
//! fingerprint depends on both (checked against Python in `crates/kvpeer/tests/config.rs`).

use sha2::{Digest, Sha256};

/// The fingerprint of a config file's `[fingerprint_fields]` table.
pub(crate) fn of_table(fields: &toml::Table) -> String {
    fingerprint(&toml_to_json(&toml::Value::Table(fields.clone())))
}

/// vLLM's config fingerprint of `fields`: "" for no fields, else the first 16 hex digits of
/// sha256 over Python's `json.dumps(fields, sort_keys=True, separators=(",", ":"))`.
pub fn fingerprint(fields: &serde_json::Value) -> String {
    if fields.as_object().is_some_and(|m| m.is_empty()) {
        return String::new();
    }
    let mut canonical = String::new();
    python_json(fields, &mut canonical);
    let digest = Sha256::digest(canonical.as_bytes());
    hex::encode(digest)[..16].to_owned()
}

/// Python's compact, sorted, ASCII-only JSON (written by hand: serde_json keeps insertion
/// order here and never escapes non-ASCII, and the fingerprint depends on both).
fn python_json(v: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    match v {
        Value::Null => out.push_str("null"),
        Value::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => out.push_str(&i.to_string()),
            (_, Some(u), _) => out.push_str(&u.to_string()),
            (_, _, Some(f)) => out.push_str(&python_float(f)),
            _ => out.push_str("null"),
        },
        Value::String(s) => python_str(s, out),
        Value::Array(a) => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                python_json(x, out);
            }
            out.push(']');
        }
        Value::Object(m) => {
            let mut keys: Vec<&String> = m.keys().collect();
            keys.sort();
            out.push('{');
            for (i, k) in keys.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                python_str(k, out);
                out.push(':');
                if let Some(x) = m.get(k) {
                    python_json(x, out);
                }
            }
            out.push('}');
        }
    }
}

fn python_float(f: f64) -> String {
    if f.is_finite() && f == f.trunc() && f.abs() < 1e16 {
        format!("{f:.1}")
    } else {
        format!("{f:?}")
    }
}

fn python_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

fn toml_to_json(v: &toml::Value) -> serde_json::Value {
    match v {
        toml::Value::String(s) => s.clone().into(),
        toml::Value::Integer(i) => (*i).into(),
        toml::Value::Float(f) => {
            serde_json::Number::from_f64(*f).map_or(serde_json::Value::Null, Into::into)
        }
        toml::Value::Boolean(b) => (*b).into(),
        toml::Value::Datetime(d) => d.to_string().into(),
        toml::Value::Array(a) => a.iter().map(toml_to_json).collect(),
        toml::Value::Table(t) => serde_json::Value::Object(
            t.iter()
                .map(|(k, v)| (k.clone(), toml_to_json(v)))
                .collect(),
        ),
    }
}
