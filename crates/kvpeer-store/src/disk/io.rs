//! The disk tier's I/O threads: block writes (demotions) and reads (promotions) off the node's
//! thread.
//!
//! The node's thread (the tier, `tier.rs`) submits an [`Op`] and goes on; one of the threads
//! takes it, does the system calls, checks what it read, sends a [`Done`] back and calls the
//! wake hook so the node's thread takes it on its next step. The node's thread never touches
//! the file once the tier is open.
//!
//! Direct I/O (`O_DIRECT`) where the file system allows it, so a demoted block does not also
//! sit in the page cache: every transfer is then page-aligned, a header page and the block in
//! one `pwritev`/`preadv` straight from or into the pool when the block is page-aligned, else
//! through the thread's own aligned buffer. The queue's depth is the number of threads (each
//! has one operation in flight). This is the engine of a kernel without io_uring (or where it
//! is not allowed, as in many containers); `uring.rs` is the other, chosen first where the
//! kernel has it ([`DiskEngine`](super::DiskEngine)).
//!
//! The pool's memory is touched only as the store's rules allow: a write reads a block the
//! store keeps pinned until its `Done`; a read lands in a block the store reserved for it,
//! through a [`WriteClaim`](crate::WriteClaim) of the permit it granted [`DISK_HOLDER`].

use std::fs::File;
use std::io::{IoSlice, IoSliceMut};
use std::os::unix::fs::FileExt;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use kvpeer_core::BlockIndex;
use kvpeer_proto::PeerId;
use tracing::warn;

use super::format::{self, Layout, SlotHeader, PAGE};
use crate::pool::PoolWriter;

/// Called by an I/O thread after it finished an operation: wakes the node's thread.
pub type DiskWake = Arc<dyn Fn() + Send + Sync>;

/// The holder the disk tier's reads claim their blocks as.
pub fn disk_holder() -> &'static PeerId {
    static HOLDER: std::sync::LazyLock<PeerId> =
        std::sync::LazyLock::new(|| PeerId::new("kvpeer-disk-tier"));
    &HOLDER
}

/// One operation for an I/O thread.
#[derive(Debug)]
pub(crate) enum Op {
    /// Writes `block` into `slot` under `header` (its `data_crc` is computed here).
    Write {
        tag: u64,
        slot: u64,
        header: SlotHeader,
        block: BlockIndex,
    },
    /// Zeroes `slot`'s header page: a slot whose block failed its check is no block at the
    /// next start either.
    Clear { tag: u64, slot: u64 },
    /// Reads `slot` into `block` (claimed from [`disk_holder`]'s permit), checking that its
    /// header is `expect` (generation, tenant, key) and its data matches the header's CRC.
    Read {
        tag: u64,
        slot: u64,
        expect: SlotHeader,
        block: BlockIndex,
    },
}

/// What went wrong with one operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DiskFault {
    /// A system call failed.
    #[error("{op} of slot {slot}: {error}")]
    Io {
        /// `read` or `write`.
        op: &'static str,
        /// The slot.
        slot: u64,
        /// The error.
        error: String,
    },
    /// The slot's header is not the one written (a torn write, or another key's).
    #[error("slot {slot}: header {why}")]
    Header {
        /// The slot.
        slot: u64,
        /// What differs.
        why: String,
    },
    /// The block's bytes do not match its header's CRC (a torn write).
    #[error("slot {slot}: block bytes fail their checksum")]
    Data {
        /// The slot.
        slot: u64,
    },
    /// The pool refused the block (not permitted: the store's bug, never a peer's).
    #[error("block {0}: not writable by the disk tier")]
    Pool(BlockIndex),
}

/// One operation's end.
#[derive(Debug)]
pub(crate) struct Done {
    pub tag: u64,
    pub result: Result<(), DiskFault>,
    /// Bytes moved (a header page and the padded block), for the tier's GB/s.
    pub bytes: u64,
}

/// The I/O threads of one tier file.
pub(crate) struct DiskIo {
    submit: Option<Sender<Op>>,
    done: Receiver<Done>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for DiskIo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskIo")
            .field("threads", &self.threads.len())
            .finish()
    }
}

/// What both engines (these threads and the ring, `uring.rs`) work on, and where their
/// operations end.
#[derive(Clone)]
pub(crate) struct Target {
    pub file: Arc<File>,
    /// The file was opened with `O_DIRECT`.
    pub direct: bool,
    pub layout: Layout,
    pub pool: PoolWriter,
    pub done: Sender<Done>,
    pub wake: DiskWake,
}

impl Target {
    /// Whether `len` bytes at `ptr` can go to or from the file as they are (direct I/O needs
    /// page-aligned addresses and lengths; buffered I/O takes anything).
    pub(crate) fn aligned(&self, ptr: *const u8, len: usize) -> bool {
        !self.direct
            || ((ptr as usize).is_multiple_of(PAGE as usize) && (len as u64).is_multiple_of(PAGE))
    }

    /// Hands `done` to the node's thread and wakes it; `false` if the tier is gone.
    pub(crate) fn answer(&self, done: Done) -> bool {
        let sent = self.done.send(done).is_ok();
        if sent {
            (self.wake)();
        }
        sent
    }
}

/// What each thread needs.
struct Worker {
    target: Target,
    ops: Arc<Mutex<Receiver<Op>>>,
    /// A slot's bytes, page-aligned (an anonymous mapping): the header page, and the block
    /// when it cannot go straight from or into the pool.
    buf: memmap2::MmapMut,
}

impl DiskIo {
    /// Starts the I/O over `file` (opened with `O_DIRECT` if `direct`): an io_uring of
    /// `threads × 8` entries unless `engine` says threads or the kernel refuses a ring, else
    /// `threads` I/O threads. Returns the engine that runs.
    pub(crate) fn start(
        file: Arc<File>,
        direct: bool,
        layout: Layout,
        pool: PoolWriter,
        threads: usize,
        wake: DiskWake,
        engine: super::DiskEngine,
    ) -> std::io::Result<(Self, super::DiskEngine)> {
        let (submit, ops) = mpsc::channel();
        let (done_tx, done) = mpsc::channel();
        let target = Target {
            file,
            direct,
            layout,
            pool,
            done: done_tx,
            wake,
        };
        let threads = threads.max(1);
        let ring = match engine {
            super::DiskEngine::Threads => None,
            _ => match super::uring::Ring::new(threads * 8, target.clone()) {
                Ok(ring) => Some(ring),
                Err(e) if engine == super::DiskEngine::Uring => return Err(e),
                Err(e) => {
                    tracing::info!(error = %e, "no io_uring here; the disk tier uses I/O threads");
                    None
                }
            },
        };
        let (handles, engine) = match ring {
            Some(ring) => (
                vec![std::thread::Builder::new()
                    .name("kvpeer-disk-ring".into())
                    .spawn(move || ring.run(ops))?],
                super::DiskEngine::Uring,
            ),
            None => (
                Worker::spawn(&target, ops, threads)?,
                super::DiskEngine::Threads,
            ),
        };
        Ok((
            DiskIo {
                submit: Some(submit),
                done,
                threads: handles,
            },
            engine,
        ))
    }

    /// Queues `op`; `false` if the threads are gone.
    pub(crate) fn submit(&self, op: Op) -> bool {
        self.submit.as_ref().is_some_and(|s| s.send(op).is_ok())
    }

    /// One finished operation, if any (never waits).
    pub(crate) fn try_done(&self) -> Option<Done> {
        self.done.try_recv().ok()
    }
}

impl Drop for DiskIo {
    fn drop(&mut self) {
        // The threads finish what they hold and exit when the queue is closed and empty: the
        // pool they read and write outlives them (each holds a writer of it).
        self.submit = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Worker {
    /// `threads` workers taking `ops` in turn.
    fn spawn(
        target: &Target,
        ops: Receiver<Op>,
        threads: usize,
    ) -> std::io::Result<Vec<JoinHandle<()>>> {
        let ops = Arc::new(Mutex::new(ops));
        let len = usize::try_from(target.layout.stride()).map_err(std::io::Error::other)?;
        (0..threads)
            .map(|n| {
                let worker = Worker {
                    target: target.clone(),
                    ops: ops.clone(),
                    buf: memmap2::MmapMut::map_anon(len)?,
                };
                std::thread::Builder::new()
                    .name(format!("kvpeer-disk-{n}"))
                    .spawn(move || worker.run())
            })
            .collect()
    }

    fn run(mut self) {
        loop {
            let op = {
                let ops = self.ops.lock().unwrap_or_else(|p| p.into_inner());
                ops.recv()
            };
            let Ok(op) = op else { return };
            let done = match op {
                Op::Write {
                    tag,
                    slot,
                    header,
                    block,
                } => Done {
                    tag,
                    result: self.write(slot, header, block),
                    bytes: self.target.layout.stride(),
                },
                Op::Clear { tag, slot } => Done {
                    tag,
                    result: self.clear(slot),
                    bytes: PAGE,
                },
                Op::Read {
                    tag,
                    slot,
                    expect,
                    block,
                } => Done {
                    tag,
                    result: self.read(slot, &expect, block),
                    bytes: self.target.layout.stride(),
                },
            };
            if !self.target.answer(done) {
                return;
            }
        }
    }

    fn io_fault(op: &'static str, slot: u64, error: impl std::fmt::Display) -> DiskFault {
        DiskFault::Io {
            op,
            slot,
            error: error.to_string(),
        }
    }

    fn write(
        &mut self,
        slot: u64,
        mut header: SlotHeader,
        block: BlockIndex,
    ) -> Result<(), DiskFault> {
        let view = self.target.pool.view();
        let data = view.block(block).ok_or(DiskFault::Pool(block))?;
        header.data_crc = crc32c::crc32c(data);
        let offset = self.target.layout.slot_offset(slot);
        let page = PAGE as usize;
        format::encode_slot_header(&header, &mut self.buf[..page]).map_err(|e| {
            DiskFault::Header {
                slot,
                why: e.to_string(),
            }
        })?;
        let padded = self.target.layout.padded_block() as usize;
        let written = if data.len() == padded && self.target.aligned(data.as_ptr(), data.len()) {
            let iov = [IoSlice::new(&self.buf[..page]), IoSlice::new(data)];
            pwritev_all(&self.target.file, &iov, offset)
        } else {
            self.buf[page..page + data.len()].copy_from_slice(data);
            self.buf[page + data.len()..page + padded].fill(0);
            self.target
                .file
                .write_all_at(&self.buf[..page + padded], offset)
        };
        written.map_err(|e| Self::io_fault("write", slot, e))
    }

    fn clear(&mut self, slot: u64) -> Result<(), DiskFault> {
        let page = PAGE as usize;
        self.buf[..page].fill(0);
        self.target
            .file
            .write_all_at(&self.buf[..page], self.target.layout.slot_offset(slot))
            .map_err(|e| Self::io_fault("clear", slot, e))
    }

    fn read(&mut self, slot: u64, expect: &SlotHeader, block: BlockIndex) -> Result<(), DiskFault> {
        let mut claim = self
            .target
            .pool
            .claim(disk_holder(), &[block])
            .map_err(|_| DiskFault::Pool(block))?;
        let Some(dest) = claim.block_mut(0) else {
            return Err(DiskFault::Pool(block));
        };
        let offset = self.target.layout.slot_offset(slot);
        let page = PAGE as usize;
        let padded = self.target.layout.padded_block() as usize;
        let direct_ok = dest.len() == padded && self.target.aligned(dest.as_ptr(), dest.len());
        let read = if direct_ok {
            let (head, _) = self.buf.split_at_mut(page);
            let mut iov = [IoSliceMut::new(head), IoSliceMut::new(dest)];
            preadv_all(&self.target.file, &mut iov, offset)
        } else {
            self.target
                .file
                .read_exact_at(&mut self.buf[..page + padded], offset)
        };
        read.map_err(|e| Self::io_fault("read", slot, e))?;
        let (head, rest) = self.buf.split_at(page);
        check_read(slot, head, expect, dest, (!direct_ok).then_some(rest))
    }
}

/// Checks a slot just read: its header (`head`) must be `expect`'s (generation, tenant,
/// key) and the block's bytes its CRC. The bytes are in `dest` already, or in `bounce` (the
/// slot's bytes after the header page), copied into `dest` first.
pub(crate) fn check_read(
    slot: u64,
    head: &[u8],
    expect: &SlotHeader,
    dest: &mut [u8],
    bounce: Option<&[u8]>,
) -> Result<(), DiskFault> {
    let found = format::decode_slot_header(head).map_err(|e| DiskFault::Header {
        slot,
        why: e.to_string(),
    })?;
    if found.generation != expect.generation
        || found.tenant != expect.tenant
        || found.key != expect.key
    {
        return Err(DiskFault::Header {
            slot,
            why: "names another block than the one written there".into(),
        });
    }
    if let Some(bytes) = bounce {
        let Some(src) = bytes.get(..dest.len()) else {
            return Err(DiskFault::Data { slot });
        };
        dest.copy_from_slice(src);
    }
    if crc32c::crc32c(dest) != found.data_crc {
        return Err(DiskFault::Data { slot });
    }
    Ok(())
}

/// `pwritev` until every byte is written (a short write is retried from where it stopped).
fn pwritev_all(file: &File, iov: &[IoSlice<'_>; 2], offset: u64) -> std::io::Result<()> {
    let total: usize = iov.iter().map(|s| s.len()).sum();
    let n = nix::sys::uio::pwritev(file, iov, to_off(offset)?).map_err(std::io::Error::from)?;
    if n == total {
        return Ok(());
    }
    // Rare (a signal, a full disk): finish with plain writes of what is left.
    let mut done = n;
    let mut at = 0;
    for s in iov {
        let end = at + s.len();
        if done < end {
            let from = done.max(at) - at;
            file.write_all_at(&s[from..], offset + (at + from) as u64)?;
            done = end;
        }
        at = end;
    }
    Ok(())
}

/// `preadv` of every byte; a short read (past the file's end) is an error.
fn preadv_all(file: &File, iov: &mut [IoSliceMut<'_>; 2], offset: u64) -> std::io::Result<()> {
    let total: usize = iov.iter().map(|s| s.len()).sum();
    let n = nix::sys::uio::preadv(file, iov, to_off(offset)?).map_err(std::io::Error::from)?;
    if n != total {
        warn!(read = n, wanted = total, "short read of a disk-tier slot");
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof));
    }
    Ok(())
}

fn to_off(offset: u64) -> std::io::Result<i64> {
    i64::try_from(offset).map_err(std::io::Error::other)
}
