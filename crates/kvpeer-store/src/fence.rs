//! Fence words: one `u64` per block of a `shm` pool, in a shared-memory object of their own
//! beside it (`<pool name>.fence`, `num_blocks × 8` bytes, 0600), through which a writing peer
//! and the pool's owner agree on whether a write may still land in a block.
//!
//! Why: on the shm plane the producer copies straight into the consumer's pool. A producer that
//! stalls in the middle of a copy (SIGSTOP, swap, a paused VM) past the consumer's load and
//! abort timeouts would, once resumed, finish the copy into a block the consumer has meanwhile
//! given to another key: wrong KV, served silently. The consumer cannot revoke another
//! process's mapping, so each block carries a word both sides change atomically:
//!
//! ```text
//! word = epoch << 32 | pid << 2 | state      state: 0 idle, 1 armed, 2 writing
//! consumer  fetch sent:  store ARMED(e)           (e: the epoch its `connect` gave that peer)
//! producer  per block:   CAS ARMED(e) -> WRITING(e, pid), copy, CAS WRITING(e, pid) -> ARMED(e)
//!                        (a failed first CAS: the block was revoked; nothing is copied)
//! consumer  load ended:  CAS ARMED(e) -> IDLE: fenced; WRITING: a copy is running, the block
//!                        stays reserved and is asked again until the copy ended, or until the
//!                        writer `pid` no longer exists (killed in the middle of the copy)
//! ```
//!
//! A producer that resumes after the revoke fails its CAS and copies nothing; one stopped in the
//! middle of a copy keeps its block out of use until the copy ends (or the process is gone: a
//! dead process writes nothing). The epoch (fresh per `connect`) keeps an arming for one session
//! from being taken by a writer of an earlier one. The pid is the writer's in its own PID
//! namespace: same-host peers normally share it; a writer in another PID namespace sharing this
//! `/dev/shm` could be taken for dead while it is only stopped (docs/security.md, G2').
//! This protects against honest producers that stall: a same-user process could ignore the
//! words and write the pool directly (docs/security.md: out of scope, it can write our memory).
//!
//! The owner maps its words plainly (like its pool); a peer's words are mapped under the SIGBUS
//! guard ([`crate::guard`]): a consumer that shrinks its object makes the writer's CAS land in
//! private zeroed memory and fail, never end the process. Every `unsafe` is here.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::MmapRaw;
use nix::fcntl::OFlag;
use nix::sys::mman::{shm_open, shm_unlink};
use nix::sys::stat::Mode;
use nix::unistd::ftruncate;

use crate::guard::{GuardError, GuardedRegion};

const IDLE: u64 = 0;
const ARMED: u64 = 1;
const WRITING: u64 = 2;
const STATE_MASK: u64 = 0b11;
/// Linux's largest pid is 2^22 (`pid_max`); 30 bits hold it.
const PID_MASK: u32 = (1 << 30) - 1;

fn armed(epoch: u32) -> u64 {
    u64::from(epoch) << 32 | ARMED
}

fn writing(epoch: u32, pid: u32) -> u64 {
    u64::from(epoch) << 32 | u64::from(pid & PID_MASK) << 2 | WRITING
}

/// The writer's pid in a WRITING word.
fn writer_of(word: u64) -> u32 {
    ((word >> 2) as u32) & PID_MASK
}

/// Whether process `pid` is certainly gone (no such process). A pid that exists, or that we
/// cannot tell about, counts as alive: the block then stays out of use.
fn is_gone(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if raw <= 0 {
        return false;
    }
    matches!(
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(raw), None),
        Err(nix::errno::Errno::ESRCH)
    )
}

/// The name of the fence object of the pool object `pool_name`.
pub fn object_name(pool_name: &str) -> String {
    format!("{pool_name}.fence")
}

/// Bytes of the fence object of a pool of `num_blocks` blocks.
pub fn object_len(num_blocks: u64) -> Option<u64> {
    num_blocks.checked_mul(8)
}

/// Why fence words could not be made or mapped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum FenceError {
    /// The object could not be created.
    #[error("cannot create the fence object /{name}: {source}")]
    Create {
        /// Its name.
        name: String,
        /// The cause.
        source: nix::Error,
    },
    /// The object could not be mapped.
    #[error("cannot map the fence object: {0}")]
    Map(std::io::Error),
    /// No words (an empty pool) or more than the address space holds.
    #[error("no fence words for {0} blocks")]
    BadSize(u64),
    /// The SIGBUS guard refused the mapping.
    #[error(transparent)]
    Guard(#[from] GuardError),
}

/// The mapped words, and how they are reached.
struct Words {
    base: NonNull<AtomicU64>,
    num_blocks: u64,
    _map: MmapRaw,
}

// SAFETY: the words are only ever accessed as atomics; the mapping lives as long as `Words`.
unsafe impl Send for Words {}
// SAFETY: as above: shared access goes through `AtomicU64` only.
unsafe impl Sync for Words {}

impl Words {
    fn map(file: &File, num_blocks: u64) -> Result<Self, FenceError> {
        let len = object_len(num_blocks)
            .filter(|l| *l > 0)
            .and_then(|l| usize::try_from(l).ok())
            .ok_or(FenceError::BadSize(num_blocks))?;
        let map = memmap2::MmapOptions::new()
            .len(len)
            .map_raw(file)
            .map_err(FenceError::Map)?;
        let base = NonNull::new(map.as_mut_ptr().cast::<AtomicU64>())
            .ok_or(FenceError::BadSize(num_blocks))?;
        Ok(Words {
            base,
            num_blocks,
            _map: map,
        })
    }

    fn word(&self, block: u64) -> Option<&AtomicU64> {
        if block >= self.num_blocks {
            return None;
        }
        // SAFETY: `block < num_blocks`, so the word lies inside the mapping of
        // `num_blocks × 8` bytes, which starts page-aligned (so every word is 8-aligned) and
        // lives as long as `self`. The memory is shared with another process, which is what
        // atomics are for; nothing takes a non-atomic reference to it.
        Some(unsafe { &*self.base.as_ptr().add(block as usize) })
    }
}

/// The fence words of this node's own shm pool (the consumer side): created with the pool,
/// unlinked when dropped.
pub struct OwnFence {
    name: String,
    file_id: (u64, u64),
    words: Words,
}

impl std::fmt::Debug for OwnFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OwnFence")
            .field("name", &self.name)
            .finish()
    }
}

impl OwnFence {
    /// Creates `/<pool_name>.fence` for `num_blocks` blocks, every word idle, replacing a stale
    /// one an earlier instance left (the pool itself was just created exclusively, so the name
    /// is ours).
    pub fn create(pool_name: &str, num_blocks: u64) -> Result<Self, FenceError> {
        let name = object_name(pool_name);
        let path = format!("/{name}");
        let len = object_len(num_blocks)
            .filter(|l| *l > 0)
            .and_then(|l| i64::try_from(l).ok())
            .ok_or(FenceError::BadSize(num_blocks))?;
        let create = |source| FenceError::Create {
            name: name.clone(),
            source,
        };
        let _ = shm_unlink(path.as_str());
        let fd = shm_open(
            path.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(create)?;
        let made = (|| {
            ftruncate(&fd, len).map_err(create)?;
            let file = File::from(fd);
            let stat = file.metadata().map_err(FenceError::Map)?;
            let words = Words::map(&file, num_blocks)?;
            Ok(OwnFence {
                name: name.clone(),
                file_id: (stat.dev(), stat.ino()),
                words,
            })
        })();
        if made.is_err() {
            let _ = shm_unlink(path.as_str());
        }
        made
    }

    /// The object's name (without the leading `/`).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// `(st_dev, st_ino)`: a peer naming this object names our own words.
    pub fn file_id(&self) -> (u64, u64) {
        self.file_id
    }

    /// A fetch naming `block` went to the peer whose session has `epoch`: its writes may come.
    pub fn arm(&self, block: u64, epoch: u32) {
        if let Some(w) = self.words.word(block) {
            w.store(armed(epoch), Ordering::SeqCst);
        }
    }

    /// The load that armed `block` ended: no write may start in it from now on. `true` when no
    /// write is in progress in it either (fenced); `false` while a peer's copy into it runs
    /// (ask again later: the copy ends, or its process goes away).
    pub fn revoke(&self, block: u64) -> bool {
        let Some(w) = self.words.word(block) else {
            return true;
        };
        let mut current = w.load(Ordering::SeqCst);
        loop {
            match current & STATE_MASK {
                IDLE => return true,
                // A copy runs, unless its process is gone (it can write nothing more).
                WRITING if !is_gone(writer_of(current)) => return false,
                _ => match w.compare_exchange(current, IDLE, Ordering::SeqCst, Ordering::SeqCst) {
                    Ok(_) => return true,
                    Err(now) => current = now,
                },
            }
        }
    }
}

impl Drop for OwnFence {
    fn drop(&mut self) {
        let _ = shm_unlink(format!("/{}", self.name).as_str());
    }
}

/// A peer's fence words (the producer side), mapped under the SIGBUS guard. Only for an object
/// already checked to be a regular file of this user, of exactly `num_blocks × 8` bytes.
pub struct PeerFence {
    guard: GuardedRegion,
    words: Words,
    /// This process, as the writer its WRITING words name.
    pid: u32,
}

impl std::fmt::Debug for PeerFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerFence")
            .field("num_blocks", &self.words.num_blocks)
            .finish()
    }
}

impl PeerFence {
    /// Maps the peer's words.
    pub fn map(file: &File, num_blocks: u64) -> Result<Self, FenceError> {
        let words = Words::map(file, num_blocks)?;
        let len = (num_blocks * 8) as usize;
        let guard = GuardedRegion::register(words.base.as_ptr().cast::<u8>(), len)?;
        Ok(PeerFence {
            guard,
            words,
            pid: std::process::id(),
        })
    }

    /// Takes the right to copy into `block` for the session `epoch`: `false` when the consumer
    /// did not arm it for this session or revoked it (nothing may be copied).
    pub fn begin(&self, block: u64, epoch: u32) -> bool {
        let Some(w) = self.words.word(block) else {
            return false;
        };
        let ok = w
            .compare_exchange(
                armed(epoch),
                writing(epoch, self.pid),
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok();
        ok && !self.guard.faulted()
    }

    /// The copy into `block` ended.
    pub fn end(&self, block: u64, epoch: u32) {
        if let Some(w) = self.words.word(block) {
            let _ = w.compare_exchange(
                writing(epoch, self.pid),
                armed(epoch),
                Ordering::SeqCst,
                Ordering::SeqCst,
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique(tag: &str) -> String {
        format!("kvpeer-fence-test-{tag}-{}", std::process::id())
    }

    fn open_peer(name: &str, blocks: u64) -> PeerFence {
        let fd = shm_open(format!("/{name}").as_str(), OFlag::O_RDWR, Mode::empty()).unwrap();
        PeerFence::map(&File::from(fd), blocks).unwrap()
    }

    #[test]
    fn a_revoked_block_takes_no_write_and_a_running_copy_holds_its_block() {
        let own = OwnFence::create(&unique("a"), 4).unwrap();
        let peer = open_peer(own.name(), 4);
        assert!(!peer.begin(0, 7), "never armed: no write");
        own.arm(0, 7);
        own.arm(1, 7);
        assert!(!peer.begin(0, 8), "armed for another session's epoch");
        assert!(peer.begin(0, 7));
        assert!(!own.revoke(0), "a copy runs: not fenced");
        assert!(own.revoke(1), "armed, not written: fenced at once");
        assert!(
            !peer.begin(1, 7),
            "a writer that resumes after the revoke copies nothing"
        );
        peer.end(0, 7);
        assert!(own.revoke(0), "the copy ended: fenced");
        assert!(!peer.begin(0, 7), "and no later write starts");
        assert!(!peer.begin(9, 7), "outside the pool");
        assert!(own.revoke(9));
    }

    #[test]
    fn a_copy_whose_writer_is_gone_holds_its_block_no_longer() {
        let own = OwnFence::create(&unique("c"), 2).unwrap();
        own.arm(0, 3);
        own.arm(1, 3);
        let w0 = own.words.word(0).unwrap();
        let w1 = own.words.word(1).unwrap();
        // A writer killed in the middle of its copy: a process that has exited (and was reaped).
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        w0.store(writing(3, dead), Ordering::SeqCst);
        assert!(own.revoke(0), "a dead writer writes nothing more");
        assert_eq!(w0.load(Ordering::SeqCst), IDLE);
        // A live writer (this process) holds its block.
        w1.store(writing(3, std::process::id()), Ordering::SeqCst);
        assert!(!own.revoke(1));
        assert_eq!(writer_of(w1.load(Ordering::SeqCst)), std::process::id());
    }

    #[test]
    fn the_object_goes_with_its_owner() {
        let name = unique("b");
        let own = OwnFence::create(&name, 2).unwrap();
        let path = format!("/dev/shm/{}", own.name());
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 16);
        drop(own);
        assert!(std::fs::metadata(&path).is_err());
    }
}
