//! How a command says why it stopped: one line on stderr, in the format the logs were asked
//! for (`--log-format`). With `human`, `kvpeer serve: <why>`; with `json`, one JSON object as
//! the log lines are (`level`, `fields.message`, `target`), so a log collector reading stderr
//! as JSON never meets a plain line. Called from the command's own thread, once, at its end.

use std::sync::atomic::{AtomicBool, Ordering};

static JSON: AtomicBool = AtomicBool::new(false);

/// Set once by `main`, before any command runs.
pub(crate) fn set_json(json: bool) {
    JSON.store(json, Ordering::Relaxed);
}

/// Whether stderr carries JSON lines.
pub(crate) fn json() -> bool {
    JSON.load(Ordering::Relaxed)
}

/// The line saying why `command` stops (or what is wrong with its arguments).
pub(crate) fn fatal_line(command: &str, message: &str) {
    if json() {
        let line = serde_json::json!({
            "timestamp": timestamp(),
            "level": "ERROR",
            "fields": { "message": message },
            "target": format!("kvpeer {command}").trim_end(),
        });
        eprintln!("{line}");
    } else if command.is_empty() {
        eprintln!("kvpeer: {message}");
    } else {
        eprintln!("kvpeer {command}: {message}");
    }
}

/// Now, written by the JSON log lines' own clock (RFC 3339, UTC).
fn timestamp() -> String {
    use tracing_subscriber::fmt::format::Writer;
    use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
    let mut out = String::new();
    let _ = SystemTime.format_time(&mut Writer::new(&mut out));
    out
}

/// `fatal!("serve", "--fill {} is too many", n)`: [`fatal_line`] with a formatted message.
macro_rules! fatal {
    ($command:literal, $($arg:tt)*) => {
        $crate::report::fatal_line($command, &format!($($arg)*))
    };
}
pub(crate) use fatal;

#[cfg(test)]
mod tests {
    #[test]
    fn the_timestamp_is_rfc3339_utc() {
        let t = super::timestamp();
        assert!(
            t.starts_with("20") && t.ends_with('Z') && &t[10..11] == "T",
            "{t}"
        );
    }
}
