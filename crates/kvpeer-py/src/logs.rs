//! The node's logs for Python. Two ways, chosen once, when the module is imported:
//!
//! * `KVPEER_LOG` set (`info`, `kvpeer_net=debug`, ...): the records go straight to stderr,
//!   formatted as the `kvpeer` binary's are, filtered by it;
//! * otherwise they go to Python's `logging`: a `tracing` layer ([`PythonLogs`]) keeps each
//!   record at or above the level Python asks for in a bounded queue, and one Python thread
//!   (`kvpeer._logs`, started by `import kvpeer`) takes them with [`take_logs`] and logs them
//!   as the logger `kvpeer.<module path>` (`kvpeer.net.control.outbound`). The level is the
//!   effective level of Python's `kvpeer` logger, WARNING unless configured, read again on every
//!   take: `logging.getLogger("kvpeer").setLevel(logging.DEBUG)` takes effect within a second.
//!
//! Contract: any thread of the node may log; pushing a record never blocks and never calls
//! Python (the module's rule: no Rust thread calls into Python). A full queue drops the record
//! and counts it; the next take reports how many were dropped. The queue's lock is held only
//! to push or drain, never across a wait, and taken only with `try_lock` (bounded retries): a
//! process forked while another thread held it gets dropped records in the child, never a hang.
//! A level change rebuilds tracing's callsite cache, so records below the level cost what they
//! cost with no subscriber at all.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use tracing::field::{Field, Visit};
use tracing::level_filters::LevelFilter;
use tracing::subscriber::Interest;
use tracing::{Event, Level, Metadata};
use tracing_subscriber::layer::{Context, SubscriberExt as _};
use tracing_subscriber::Layer;

/// Records waiting for Python at most; more are dropped and counted.
const QUEUE_RECORDS: usize = 4096;

/// Records one take hands over at most (the rest wait for the next).
const TAKE_RECORDS: usize = 256;

/// Whether the records go to Python (decided once, when the module is imported).
static TO_PYTHON: OnceLock<bool> = OnceLock::new();

/// The records waiting for Python, oldest first, at most [`QUEUE_RECORDS`].
static QUEUE: Mutex<VecDeque<Record>> = Mutex::new(VecDeque::new());

/// Signalled when a record is pushed.
static ARRIVED: Condvar = Condvar::new();

/// The most verbose level passed on, as tracing's order (`LevelFilter` as a number: 0 off,
/// 1 error ... 5 trace); WARN until Python says otherwise.
static MAX_LEVEL: AtomicUsize = AtomicUsize::new(level_rank(LevelFilter::WARN));

/// Records the full queue refused since the last take.
static DROPPED: AtomicU64 = AtomicU64::new(0);

/// One log record on its way to Python.
struct Record {
    /// Python's level number (40 error, 30 warning, 20 info, 10 debug, 5 trace).
    level: u32,
    /// tracing's target (`kvpeer_net::control::outbound`).
    target: &'static str,
    /// The message, then the fields as ` key=value`.
    text: String,
}

/// Installs the route: called once, when the module is imported.
pub(crate) fn init() {
    TO_PYTHON.get_or_init(|| {
        if let Ok(filter) = std::env::var("KVPEER_LOG") {
            let filter = tracing_subscriber::EnvFilter::try_new(filter)
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
            // Another subscriber already installed (an embedder's) keeps its place.
            let _ = tracing_subscriber::fmt()
                .with_env_filter(filter)
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .try_init();
            return false;
        }
        let subscriber = tracing_subscriber::registry().with(PythonLogs);
        tracing::subscriber::set_global_default(subscriber).is_ok()
    });
}

/// The queue, if its lock comes free within `tries` attempts (see the module documentation:
/// never a blocking lock).
fn lock_queue(tries: u32, pause: Duration) -> Option<MutexGuard<'static, VecDeque<Record>>> {
    for _ in 0..tries {
        match QUEUE.try_lock() {
            Ok(queue) => return Some(queue),
            // A panic while holding it left whole records (pushes and drains do not panic).
            Err(TryLockError::Poisoned(poisoned)) => return Some(poisoned.into_inner()),
            Err(TryLockError::WouldBlock) if pause.is_zero() => std::thread::yield_now(),
            Err(TryLockError::WouldBlock) => std::thread::sleep(pause),
        }
    }
    None
}

const fn level_rank(filter: LevelFilter) -> usize {
    match filter.into_level() {
        None => 0,
        Some(Level::ERROR) => 1,
        Some(Level::WARN) => 2,
        Some(Level::INFO) => 3,
        Some(Level::DEBUG) => 4,
        Some(Level::TRACE) => 5,
    }
}

fn rank_filter(rank: usize) -> LevelFilter {
    match rank {
        0 => LevelFilter::OFF,
        1 => LevelFilter::ERROR,
        2 => LevelFilter::WARN,
        3 => LevelFilter::INFO,
        4 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// The tracing filter for Python's level number: a record passes when Python would log it.
fn filter_for_python_level(level: i64) -> LevelFilter {
    match level {
        ..=5 => LevelFilter::TRACE,
        6..=10 => LevelFilter::DEBUG,
        11..=20 => LevelFilter::INFO,
        21..=30 => LevelFilter::WARN,
        31..=40 => LevelFilter::ERROR,
        _ => LevelFilter::OFF,
    }
}

fn python_level(level: &Level) -> u32 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => 5,
    }
}

/// The Python logger for a tracing target: `kvpeer_net::control` is `kvpeer.net.control`,
/// `kvpeer::node` is `kvpeer.node`, anything else `kvpeer.<target>`.
fn logger_name(target: &str) -> String {
    let dotted = target.replace("::", ".");
    match dotted.strip_prefix("kvpeer") {
        Some(rest) if rest.is_empty() || rest.starts_with('.') => format!("kvpeer{rest}"),
        Some(rest) if rest.starts_with('_') => format!("kvpeer.{}", &rest[1..]),
        _ => format!("kvpeer.{dotted}"),
    }
}

/// The layer that queues records for Python (see the module documentation).
struct PythonLogs;

impl<S: tracing::Subscriber> Layer<S> for PythonLogs {
    fn register_callsite(&self, metadata: &'static Metadata<'static>) -> Interest {
        if self.passes(metadata) {
            Interest::always()
        } else {
            Interest::never()
        }
    }

    fn enabled(&self, metadata: &Metadata<'_>, _: Context<'_, S>) -> bool {
        self.passes(metadata)
    }

    fn max_level_hint(&self) -> Option<LevelFilter> {
        Some(rank_filter(MAX_LEVEL.load(Ordering::Relaxed)))
    }

    fn on_event(&self, event: &Event<'_>, _: Context<'_, S>) {
        let metadata = event.metadata();
        let mut text = TextVisitor::default();
        event.record(&mut text);
        let record = Record {
            level: python_level(metadata.level()),
            target: metadata.target(),
            text: text.finish(),
        };
        // The lock is held only to push or drain: a few yields cover a drain in progress.
        match lock_queue(64, Duration::ZERO) {
            Some(mut queue) if queue.len() < QUEUE_RECORDS => {
                queue.push_back(record);
                drop(queue);
                ARRIVED.notify_one();
            }
            _ => {
                DROPPED.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

impl PythonLogs {
    fn passes(&self, metadata: &Metadata<'_>) -> bool {
        *metadata.level() <= rank_filter(MAX_LEVEL.load(Ordering::Relaxed))
    }
}

/// A record's message first, then its other fields as ` key=value`.
#[derive(Default)]
struct TextVisitor {
    message: String,
    fields: String,
}

impl TextVisitor {
    fn finish(mut self) -> String {
        self.message.push_str(&self.fields);
        self.message
    }
}

impl Visit for TextVisitor {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.message.push_str(value);
        } else {
            let _ = write!(self.fields, " {}={}", field.name(), value);
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            let _ = write!(self.message, "{value:?}");
        } else {
            let _ = write!(self.fields, " {}={:?}", field.name(), value);
        }
    }
}

/// Whether the node's records go to Python's `logging` (`KVPEER_LOG` unset): the Python side
/// starts its thread only then.
#[pyfunction]
pub(crate) fn logs_to_python() -> bool {
    TO_PYTHON.get() == Some(&true)
}

/// Takes the records waiting for Python, waiting up to `timeout_s` for the first: a list of
/// `(level, logger, message)`, Python's level numbers and logger names. `level` is the
/// effective level of Python's `kvpeer` logger: records below it are not made from now on.
/// Without the Python route (`KVPEER_LOG` set) it returns nothing at once.
#[pyfunction]
pub(crate) fn take_logs(
    py: Python<'_>,
    level: i64,
    timeout_s: f64,
) -> PyResult<Vec<(u32, String, String)>> {
    if !logs_to_python() {
        // Nothing ever comes: wait out the timeout (without the GIL) rather than return at
        // once, so a caller's loop cannot spin.
        let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::ZERO);
        py.detach(|| std::thread::sleep(timeout));
        return Ok(Vec::new());
    }
    let wanted = level_rank(filter_for_python_level(level));
    if MAX_LEVEL.swap(wanted, Ordering::Relaxed) != wanted {
        tracing::callsite::rebuild_interest_cache();
    }
    let timeout = Duration::try_from_secs_f64(timeout_s.max(0.0)).unwrap_or(Duration::ZERO);
    let records: Vec<Record> = py.detach(|| {
        let deadline = Instant::now() + timeout;
        let Some(mut queue) = lock_queue(20, Duration::from_millis(1)) else {
            return Vec::new();
        };
        while queue.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            queue = match ARRIVED.wait_timeout(queue, left) {
                Ok((queue, _)) => queue,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
        let n = queue.len().min(TAKE_RECORDS);
        queue.drain(..n).collect()
    });
    let mut out: Vec<(u32, String, String)> = records
        .into_iter()
        .map(|r| (r.level, logger_name(r.target), r.text))
        .collect();
    let dropped = DROPPED.swap(0, Ordering::Relaxed);
    if dropped > 0 {
        out.push((
            30,
            "kvpeer".to_owned(),
            format!("{dropped} log records dropped: more came than Python's logging took"),
        ));
    }
    Ok(out)
}
