//! A guard against SIGBUS from memory a peer controls: the mapping of a peer's shm pool.
//!
//! A proven peer's pool object stays the peer's: it may shrink it (or punch holes in it) at any
//! time, and a store through our mapping of a page past the object's new end raises SIGBUS,
//! which would end the node with every session and cached block. Writing through the file
//! (`pwrite`) cannot fault, but measured 0.2–0.6× of a memcpy (docs/benchmarks.md, "shm writes
//! into a peer's pool"), so the shm plane keeps its mapping and this guard makes the fault
//! harmless, as Wayland compositors do for their clients' shm buffers: every peer mapping is
//! registered here, and a process-wide SIGBUS handler that finds the faulting address inside a
//! registered mapping maps private anonymous memory (`MAP_NORESERVE`, a bounded window from the
//! faulting page on; a store past it faults again) over that part of the mapping, marks the
//! mapping as faulted, and returns. The interrupted copy then
//! completes into memory nobody reads, and the plane, seeing [`GuardedRegion::faulted`], fails
//! the transfer and the peer. A SIGBUS anywhere else goes to the handler that was installed
//! before (or the default action: the process dies, as it would have without the guard).
//!
//! Signal safety: the handler touches only atomics and calls `mmap`, `sigaction` (both plain
//! system calls). Each slot is a seqlock: the writer (registration, never in a handler) makes
//! the sequence odd, writes the range, makes it even; the handler uses a slot only when it read
//! the same even sequence before and after the range. A mapping is registered before any copy
//! into it starts and unregistered after the last one ended (the pool holding it drops the
//! guard before it unmaps), so a copy never faults in a slot being changed.
//!
//! Called from the shm plane's threads (registration: the runtime thread; copies: the runtime or
//! the copy worker).

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};

use nix::libc;
use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};

/// Peer mappings guarded at once (one per peer session on the shm plane; `max_peers` is 128 by
/// default): registration past it fails, and the plane refuses that peer.
pub const MAX_GUARDED: usize = 4096;

/// Why a mapping could not be guarded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GuardError {
    /// Every slot is taken.
    #[error("{MAX_GUARDED} peer mappings are guarded already")]
    Full,
    /// The SIGBUS handler could not be installed.
    #[error("cannot install the SIGBUS guard: {0}")]
    Install(nix::Error),
}

struct Slot {
    seq: AtomicU64,
    start: AtomicUsize,
    len: AtomicUsize,
    faulted: AtomicBool,
}

impl Slot {
    const fn new() -> Self {
        Slot {
            seq: AtomicU64::new(0),
            start: AtomicUsize::new(0),
            len: AtomicUsize::new(0),
            faulted: AtomicBool::new(false),
        }
    }

    /// Writes the range (`len` 0: free) under the seqlock. Writers hold `FREE`'s lock.
    fn set(&self, start: usize, len: usize) {
        self.seq.fetch_add(1, Ordering::AcqRel);
        self.start.store(start, Ordering::Release);
        self.len.store(len, Ordering::Release);
        self.faulted.store(false, Ordering::Release);
        self.seq.fetch_add(1, Ordering::AcqRel);
    }
}

static SLOTS: [Slot; MAX_GUARDED] = [const { Slot::new() }; MAX_GUARDED];
/// Which slots are taken (writers only; never touched by the handler).
static TAKEN: Mutex<[bool; MAX_GUARDED]> = Mutex::new([false; MAX_GUARDED]);
/// The SIGBUS action in place before ours, to pass on faults that are not a peer's.
static PREVIOUS: OnceLock<SigAction> = OnceLock::new();
/// The installation's outcome (once per process).
static INSTALLED: OnceLock<Result<(), nix::errno::Errno>> = OnceLock::new();
/// The page size, read once at installation (the handler reads only this atomic).
static PAGE: AtomicUsize = AtomicUsize::new(4096);

/// A registered peer mapping; unregistered on drop.
#[derive(Debug)]
pub struct GuardedRegion {
    slot: usize,
}

impl GuardedRegion {
    /// Registers `[start, start + len)`, a shared mapping of a peer's object.
    pub fn register(start: *const u8, len: usize) -> Result<Self, GuardError> {
        install()?;
        let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
        let slot = taken.iter().position(|t| !t).ok_or(GuardError::Full)?;
        taken[slot] = true;
        SLOTS[slot].set(start as usize, len);
        Ok(GuardedRegion { slot })
    }

    /// Whether a store into the mapping faulted (the peer shrank its object): what was written
    /// since went to private memory, and the mapping no longer reaches the peer's object.
    pub fn faulted(&self) -> bool {
        SLOTS[self.slot].faulted.load(Ordering::Acquire)
    }
}

impl Drop for GuardedRegion {
    fn drop(&mut self) {
        let mut taken = TAKEN.lock().unwrap_or_else(|p| p.into_inner());
        SLOTS[self.slot].set(0, 0);
        if let Some(t) = taken.get_mut(self.slot) {
            *t = false;
        }
    }
}

fn install() -> Result<(), GuardError> {
    let outcome = INSTALLED.get_or_init(|| {
        // SAFETY: sysconf has no preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if let Some(size) = usize::try_from(size).ok().filter(|s| s.is_power_of_two()) {
            PAGE.store(size, Ordering::Release);
        }
        let ours = SigAction::new(
            SigHandler::SigAction(on_sigbus),
            SaFlags::SA_SIGINFO | SaFlags::SA_ONSTACK,
            SigSet::empty(),
        );
        // SAFETY: the handler is async-signal-safe (atomics, mmap, sigaction and calling the
        // previous handler only); the previous action is kept so other faults are passed on.
        match unsafe { sigaction(Signal::SIGBUS, &ours) } {
            Ok(previous) => {
                let _ = PREVIOUS.set(previous);
                Ok(())
            }
            Err(e) => Err(e),
        }
    });
    (*outcome).map_err(GuardError::Install)
}

/// The slot whose registered range holds `addr`, with that range (`start`, `len`) as read
/// under the slot's seqlock.
fn guarded_slot(addr: usize) -> Option<(&'static Slot, usize, usize)> {
    SLOTS.iter().find_map(|slot| {
        let before = slot.seq.load(Ordering::Acquire);
        if before % 2 == 1 {
            return None;
        }
        let start = slot.start.load(Ordering::Acquire);
        let len = slot.len.load(Ordering::Acquire);
        let after = slot.seq.load(Ordering::Acquire);
        (before == after && len > 0 && addr >= start && addr - start < len)
            .then_some((slot, start, len))
    })
}

/// Bytes of private memory mapped per fault: a bounded window from the faulting page (a later
/// store past it faults again and maps the next window), so the handler never asks the kernel
/// for more than this however large the peer's (possibly sparse) mapping is.
const WINDOW: usize = 2 << 20;

extern "C" fn on_sigbus(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for an SA_SIGINFO handler; `si_addr` is the
    // faulting address for a SIGBUS the kernel raised (`si_code` > 0; a SIGBUS sent by a
    // process, `si_code` <= 0, carries no address and is passed on).
    let (code, addr) = unsafe { ((*info).si_code, (*info).si_addr() as usize) };
    // SAFETY: errno is thread-local; saved here and restored before returning, as a handler
    // must (mmap may set it).
    let errno = unsafe { *libc::__errno_location() };
    let guarded = if code > 0 { guarded_slot(addr) } else { None };
    if let Some((slot, start, len)) = guarded {
        let page = PAGE.load(Ordering::Acquire);
        let from = addr & !(page - 1);
        let end = (start + len).min(from.saturating_add(WINDOW));
        // SAFETY: `[from, end)` lies inside a registered peer mapping (checked above), which
        // this process mapped for its shm plane and writes only through the copy that faulted;
        // replacing it with private anonymous pages makes the faulting store (re-executed on
        // return) and every later one land in memory nobody reads. MAP_FIXED over our own
        // mapping is the intent.
        let mapped = unsafe {
            libc::mmap(
                from as *mut libc::c_void,
                end - from,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_FIXED | libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if mapped != libc::MAP_FAILED {
            slot.faulted.store(true, Ordering::Release);
            // SAFETY: as above.
            unsafe { *libc::__errno_location() = errno };
            return;
        }
    }
    pass_on(sig, info, context);
}

/// A SIGBUS that is not a peer's: to the previous handler, or the default action (the faulting
/// instruction runs again on return and the default action ends the process, as without us).
fn pass_on(sig: libc::c_int, info: *mut libc::siginfo_t, context: *mut libc::c_void) {
    match PREVIOUS.get().map(SigAction::handler) {
        Some(SigHandler::SigAction(previous)) => previous(sig, info, context),
        Some(SigHandler::Handler(previous)) => previous(sig),
        _ => {
            let default = SigAction::new(SigHandler::SigDfl, SaFlags::empty(), SigSet::empty());
            // SAFETY: restoring the default action is always sound.
            let _ = unsafe { sigaction(Signal::SIGBUS, &default) };
        }
    }
}
