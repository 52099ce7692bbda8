//! The block region: `num_blocks × block_len` bytes in a POSIX shared-memory object, followed by
//! the pool's trailer (magic and a random secret, [`crate::trailer`]), which lets the `shm` plane
//! prove to a peer that this node owns the object it names.
//!
//! Shared memory so that a peer on the same host (the `shm` data plane, or a Python process
//! with `multiprocessing.shared_memory`) can map the same bytes by name and write blocks in
//! place. The object is created exclusively and unlinked when the region is dropped; the
//! mapping is page-aligned (mmap), and can be locked in memory.

use std::fs::File;
use std::ops::Range;

use memmap2::MmapMut;
use nix::fcntl::OFlag;
use nix::sys::mman::{mlock, shm_open, shm_unlink};
use nix::sys::stat::Mode;
use nix::unistd::ftruncate;
use tracing::debug;

use crate::trailer::{self, SECRET_LEN};

/// Why a region could not be made.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegionError {
    /// `num_blocks` or `block_len` is 0, or their product overflows.
    #[error("a region of {num_blocks} blocks of {block_len} bytes is impossible")]
    BadSize {
        /// Blocks asked for.
        num_blocks: u64,
        /// Bytes per block asked for.
        block_len: u64,
    },
    /// The shared-memory object could not be created or sized.
    #[error("cannot create shared-memory object /{name}: {source}")]
    Create {
        /// Its name.
        name: String,
        /// The system's error.
        source: nix::Error,
    },
    /// The object could not be mapped.
    #[error("cannot map shared-memory object /{name}: {source}")]
    Map {
        /// Its name.
        name: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// No randomness for the pool's secret.
    #[error("no randomness for the pool's secret: {0}")]
    Random(getrandom::Error),
    /// `mlock` failed (raise `ulimit -l`, or run without locking).
    #[error("cannot lock {bytes} bytes in memory: {source}")]
    Lock {
        /// Bytes to lock.
        bytes: usize,
        /// The system's error.
        source: nix::Error,
    },
}

/// A mapped shared-memory object holding the blocks. Owned by one store; dropping it unmaps
/// and unlinks the object (peers that mapped it keep their mapping until they unmap).
#[derive(Debug)]
pub struct Region {
    name: String,
    map: MmapMut,
    num_blocks: u64,
    block_len: u64,
    secret: [u8; SECRET_LEN],
}

impl Region {
    /// Creates `/name` with room for `num_blocks × block_len` bytes, zeroed, and the trailer
    /// (a fresh secret), and maps it.
    pub fn create(
        name: &str,
        num_blocks: u64,
        block_len: u64,
        lock: bool,
    ) -> Result<Self, RegionError> {
        let bad = || RegionError::BadSize {
            num_blocks,
            block_len,
        };
        let blocks_len = num_blocks
            .checked_mul(block_len)
            .filter(|b| *b > 0)
            .ok_or_else(bad)?;
        let bytes = trailer::object_len(num_blocks, block_len).ok_or_else(bad)?;
        let size = i64::try_from(bytes).map_err(|_| bad())?;
        let len = usize::try_from(bytes).map_err(|_| bad())?;
        let trailer_at = usize::try_from(blocks_len).map_err(|_| bad())?;
        let secret = trailer::new_secret().map_err(RegionError::Random)?;
        let path = format!("/{name}");
        let create = |source| RegionError::Create {
            name: name.to_owned(),
            source,
        };
        let fd = shm_open(
            path.as_str(),
            OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR,
            Mode::S_IRUSR | Mode::S_IWUSR,
        )
        .map_err(create)?;
        // From here on the object exists: unlink it on any failure.
        let cleanup = |e: RegionError| {
            let _ = shm_unlink(path.as_str());
            e
        };
        ftruncate(&fd, size).map_err(|e| cleanup(create(e)))?;
        let file = File::from(fd);
        // SAFETY: the object was just created exclusively (O_EXCL) with mode 0600 and sized;
        // only this process and peers that the data plane deliberately lets write blocks map it.
        // The map is only ever accessed through slices of whole blocks handed out by the store,
        // which tolerates concurrent writes by a peer into blocks it reserved for that peer.
        let mut map = unsafe { MmapMut::map_mut(&file) }.map_err(|source| {
            cleanup(RegionError::Map {
                name: name.to_owned(),
                source,
            })
        })?;
        let head = trailer::encode(&secret);
        match map.get_mut(trailer_at..trailer_at + head.len()) {
            Some(dst) => dst.copy_from_slice(&head),
            // The object was sized to hold the trailer just above.
            None => return Err(cleanup(bad())),
        }
        // Allocate every page now, not on a transfer's first touch: a fresh page costs a fault
        // and a zeroing, which made a first 128 MiB fetch several times slower than the copy
        // itself. Best effort: kernels before 5.14 refuse the advice and fault lazily instead.
        if let Err(e) = map.advise(memmap2::Advice::PopulateWrite) {
            debug!(name, error = %e, "could not pre-fault the pool; pages fault in on first use");
        }
        if lock {
            let ptr = std::ptr::NonNull::new(map.as_ptr() as *mut std::ffi::c_void);
            if let Some(ptr) = ptr {
                // SAFETY: `ptr`/`len` describe exactly our live mapping.
                unsafe { mlock(ptr, len) }
                    .map_err(|source| cleanup(RegionError::Lock { bytes: len, source }))?;
            }
        }
        Ok(Region {
            name: name.to_owned(),
            map,
            num_blocks,
            block_len,
            secret,
        })
    }

    /// The pool's secret, as in its trailer: the key of the `shm` plane's ownership tokens.
    pub fn secret(&self) -> &[u8; SECRET_LEN] {
        &self.secret
    }

    /// The object's name, as for `shm_open` without the leading `/`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Blocks in the region.
    pub fn num_blocks(&self) -> u64 {
        self.num_blocks
    }

    /// Bytes per block.
    pub fn block_len(&self) -> u64 {
        self.block_len
    }

    /// Address of the first byte (what `connect` advertises as `base_addr`).
    pub fn base_addr(&self) -> u64 {
        self.map.as_ptr() as u64
    }

    fn range(&self, block: u64) -> Option<Range<usize>> {
        if block >= self.num_blocks {
            return None;
        }
        let start = usize::try_from(block * self.block_len).ok()?;
        Some(start..start + self.block_len as usize)
    }

    /// The bytes of one block.
    pub fn block(&self, block: u64) -> Option<&[u8]> {
        self.range(block).map(|r| &self.map[r])
    }

    /// The bytes of one block, to write.
    pub fn block_mut(&mut self, block: u64) -> Option<&mut [u8]> {
        self.range(block).map(|r| &mut self.map[r])
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        let _ = shm_unlink(format!("/{}", self.name).as_str());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unique(tag: &str) -> String {
        format!("kvpeer-test-{tag}-{}", std::process::id())
    }

    #[test]
    fn blocks_are_separate_and_the_object_is_unlinked_on_drop() {
        let name = unique("region");
        let mut r = Region::create(&name, 4, 4096, false).unwrap();
        assert_eq!(r.base_addr() % 4096, 0, "page-aligned");
        r.block_mut(2).unwrap().fill(7);
        assert!(r.block(1).unwrap().iter().all(|b| *b == 0));
        assert!(r.block(2).unwrap().iter().all(|b| *b == 7));
        assert!(r.block(4).is_none());
        // The trailer follows the blocks: magic and the secret, then zeros.
        let len = std::fs::metadata(format!("/dev/shm/{name}")).unwrap().len();
        assert_eq!(len, 4 * 4096 + trailer::TRAILER_LEN);
        let raw = std::fs::read(format!("/dev/shm/{name}")).unwrap();
        assert_eq!(trailer::parse_trailer(&raw[4 * 4096..]), Ok(*r.secret()));
        assert!(raw[4 * 4096 + 40..].iter().all(|b| *b == 0));
        assert_ne!(*r.secret(), [0; 32]);
        assert!(std::path::Path::new(&format!("/dev/shm/{name}")).exists());
        drop(r);
        assert!(!std::path::Path::new(&format!("/dev/shm/{name}")).exists());
    }

    #[test]
    fn a_name_in_use_or_a_zero_size_is_refused() {
        let name = unique("dup");
        let _r = Region::create(&name, 1, 4096, false).unwrap();
        assert!(matches!(
            Region::create(&name, 1, 4096, false),
            Err(RegionError::Create { .. })
        ));
        assert!(matches!(
            Region::create(&unique("zero"), 0, 4096, false),
            Err(RegionError::BadSize { .. })
        ));
        assert!(matches!(
            Region::create(&unique("big"), u64::MAX, 2, false),
            Err(RegionError::BadSize { .. })
        ));
    }
}
