//! Running a test out of file descriptors. The descriptor limit is process-wide, so such a
//! test re-runs itself alone in a child process ([`run_alone`]); there [`Exhaustion`] lowers
//! the limit and fills every free slot but one.

use std::fs::File;

use nix::sys::resource::{getrlimit, setrlimit, Resource};

/// In the parent, runs the test `name` alone in a child process, asserts that it passed and
/// returns `false` (the parent is done). In the child, returns `true`: run the test.
pub(crate) fn run_alone(name: &str) -> bool {
    const CHILD: &str = "KVPEER_FD_EXHAUSTION_CHILD";
    if std::env::var_os(CHILD).is_some() {
        return true;
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let text =
        String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("1 passed"), "{text}");
    false
}

/// The process out of descriptors but `spare` (the limit bounds descriptor *numbers*, so
/// holes below the highest open descriptor are filled as well). Dropping it gives every
/// slot back and restores the limit.
pub(crate) struct Exhaustion {
    fillers: Vec<File>,
    limits: (u64, u64),
}

impl Exhaustion {
    pub(crate) fn leaving(spare: usize) -> Self {
        let limits = getrlimit(Resource::RLIMIT_NOFILE).unwrap();
        let highest = std::fs::read_dir("/proc/self/fd")
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
            .max()
            .unwrap();
        setrlimit(Resource::RLIMIT_NOFILE, highest + 1, limits.1).unwrap();
        let mut fillers = Vec::new();
        while let Ok(f) = File::open("/dev/null") {
            fillers.push(f);
        }
        for _ in 0..spare {
            drop(fillers.pop());
        }
        Exhaustion { fillers, limits }
    }
}

impl Drop for Exhaustion {
    fn drop(&mut self) {
        self.fillers.clear();
        let _ = setrlimit(Resource::RLIMIT_NOFILE, self.limits.0, self.limits.1);
    }
}
