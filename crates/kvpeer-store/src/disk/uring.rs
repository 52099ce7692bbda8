//! The disk tier's io_uring engine: one thread, one ring, up to `depth` reads and writes in
//! flight, each a `writev`/`readv` of a header page and a block (straight from or into the
//! pool when the block is page-aligned, else through the thread's own aligned buffer).
//!
//! Same contract as the thread engine (`io.rs`): the node's thread submits an [`Op`] over the
//! channel and takes [`Done`]s back, woken by the hook. The ring's thread blocks on the
//! channel while nothing is in flight, else takes what the channel holds, submits it and
//! waits for one completion. Why io_uring: a system call and a context switch per block is what
//! bounds the thread engine at 64 KiB blocks (docs/benchmarks.md, "The disk tier"); the ring
//! submits a batch in one call and completes without a thread per operation.
//!
//! Every buffer an entry names stays valid until its completion is reaped: the thread's own
//! buffers live as long as the thread, which leaves only with nothing in flight (or, on a
//! ring error, leaks them); a write's block is pinned by the store until its `Done`; a read's
//! block is held by its [`WriteClaim`], kept with the entry until completion.

use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, TryRecvError};

use io_uring::{opcode, types, IoUring};
use tracing::{error, warn};

use super::format::{self, SlotHeader, PAGE};
use super::io::{check_read, disk_holder, DiskFault, Done, Op, Target};
use crate::pool::WriteClaim;

/// One entry in flight.
struct Entry {
    tag: u64,
    slot: u64,
    kind: Kind,
    /// What the entry moves: a header page and the block, or the bounce buffer alone.
    iov: [libc::iovec; 2],
    iov_len: u32,
    /// Bytes the operation moves in all.
    total: usize,
}

enum Kind {
    Write,
    Clear,
    Read {
        expect: SlotHeader,
        claim: WriteClaim,
        /// The block came straight into the pool (else it is in the bounce buffer).
        direct: bool,
    },
}

/// The ring's thread.
pub(crate) struct Ring {
    ring: IoUring,
    target: Target,
    /// `depth` buffers of a slot each (header page and block), page-aligned; pages fault in
    /// only when a buffer is used.
    bufs: memmap2::MmapMut,
    stride: usize,
    entries: Vec<Option<Entry>>,
    free: Vec<usize>,
}

// SAFETY: a ring is moved to its own thread once, right after it is made, and only that
// thread uses it from then on. Its raw pointers (the iovecs of entries in flight) name the
// ring's own mapping and the pool's memory, which are valid from any thread of the process.
unsafe impl Send for Ring {}

impl Ring {
    /// A ring of `depth` entries, or the kernel's refusal (no io_uring, or not allowed here).
    pub(crate) fn new(depth: usize, target: Target) -> std::io::Result<Ring> {
        let depth = depth.clamp(1, 4096);
        let ring = IoUring::new(depth as u32)?;
        let stride = usize::try_from(target.layout.stride()).map_err(std::io::Error::other)?;
        let bufs = memmap2::MmapMut::map_anon(stride.checked_mul(depth).ok_or_else(|| {
            std::io::Error::other("the ring's buffers do not fit the address space")
        })?)?;
        Ok(Ring {
            ring,
            target,
            bufs,
            stride,
            entries: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
        })
    }

    /// Takes `ops` until the tier closes the channel and nothing is in flight.
    pub(crate) fn run(mut self, ops: Receiver<Op>) {
        let mut closed = false;
        loop {
            // Take what the channel holds (waiting only while nothing is in flight).
            while !closed && !self.free.is_empty() {
                let waiting = self.entries.len() - self.free.len();
                let op = if waiting == 0 {
                    match ops.recv() {
                        Ok(op) => op,
                        Err(_) => {
                            closed = true;
                            break;
                        }
                    }
                } else {
                    match ops.try_recv() {
                        Ok(op) => op,
                        Err(TryRecvError::Empty) => break,
                        Err(TryRecvError::Disconnected) => {
                            closed = true;
                            break;
                        }
                    }
                };
                self.start(op);
            }
            let in_flight_now = self.entries.len() - self.free.len();
            if in_flight_now == 0 {
                if closed {
                    return;
                }
                continue;
            }
            match self.ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => {
                    error!(error = %e, "the disk tier's ring failed; its operations fail and the ring's memory is left as it is");
                    self.abandon(&e);
                    return;
                }
            }
            self.reap();
        }
    }

    /// Prepares `op` and queues its entry (or answers it at once when it cannot start).
    fn start(&mut self, op: Op) {
        let Some(i) = self.free.pop() else { return };
        let buf = self.bufs[i * self.stride..].as_mut_ptr();
        let page = PAGE as usize;
        let padded = self.target.layout.padded_block() as usize;
        let prepared = match op {
            Op::Write {
                tag,
                slot,
                mut header,
                block,
            } => self.prepare_write(i, tag, slot, &mut header, block),
            Op::Clear { tag, slot } => {
                self.bufs[i * self.stride..i * self.stride + page].fill(0);
                Ok(Entry {
                    tag,
                    slot,
                    kind: Kind::Clear,
                    iov: [iovec(buf, page), iovec(buf, 0)],
                    iov_len: 1,
                    total: page,
                })
            }
            Op::Read {
                tag,
                slot,
                expect,
                block,
            } => match self.target.pool.claim(disk_holder(), &[block]) {
                Err(_) => Err((tag, DiskFault::Pool(block))),
                Ok(mut claim) => match claim.block_mut(0).map(|d| (d.as_mut_ptr(), d.len())) {
                    None => Err((tag, DiskFault::Pool(block))),
                    Some((dest, len)) => {
                        let direct = len == padded && self.target.aligned(dest, len);
                        let (iov, iov_len) = if direct {
                            ([iovec(buf, page), iovec(dest, len)], 2)
                        } else {
                            ([iovec(buf, page + padded), iovec(buf, 0)], 1)
                        };
                        Ok(Entry {
                            tag,
                            slot,
                            kind: Kind::Read {
                                expect,
                                claim,
                                direct,
                            },
                            iov,
                            iov_len,
                            total: page + padded,
                        })
                    }
                },
            },
        };
        let entry = match prepared {
            Ok(e) => e,
            Err((tag, fault)) => {
                self.free.push(i);
                self.answer(tag, Err(fault), 0);
                return;
            }
        };
        self.entries[i] = Some(entry);
        let Some(e) = &self.entries[i] else { return };
        let fd = types::Fd(self.target.file.as_raw_fd());
        let offset = self.target.layout.slot_offset(e.slot);
        let sqe = match e.kind {
            Kind::Read { .. } => opcode::Readv::new(fd, e.iov.as_ptr(), e.iov_len)
                .offset(offset)
                .build(),
            Kind::Write | Kind::Clear => opcode::Writev::new(fd, e.iov.as_ptr(), e.iov_len)
                .offset(offset)
                .build(),
        }
        .user_data(i as u64);
        // SAFETY: the entry names `e.iov` (inside `self.entries[i]`, a Vec never resized, the
        // entry kept until its completion is reaped) and through it: the thread's buffer `i`
        // (alive as long as `self`, which `run` leaves only with nothing in flight, else
        // leaks), and a pool block, alive as long as our `PoolWriter` and kept from other
        // users by the store's pin (a write) or the entry's `WriteClaim` (a read).
        let pushed = unsafe { self.ring.submission().push(&sqe) };
        if pushed.is_err() {
            // The ring has `depth` entries and at most `depth` are in flight: never full.
            if let Some(e) = self.entries[i].take() {
                self.free.push(i);
                self.answer(
                    e.tag,
                    Err(DiskFault::Io {
                        op: "submit",
                        slot: e.slot,
                        error: "the ring is full".into(),
                    }),
                    0,
                );
            }
        }
    }

    fn prepare_write(
        &mut self,
        i: usize,
        tag: u64,
        slot: u64,
        header: &mut SlotHeader,
        block: kvpeer_core::BlockIndex,
    ) -> Result<Entry, (u64, DiskFault)> {
        let page = PAGE as usize;
        let padded = self.target.layout.padded_block() as usize;
        let view = self.target.pool.view();
        let data = view.block(block).ok_or((tag, DiskFault::Pool(block)))?;
        header.data_crc = crc32c::crc32c(data);
        let at = i * self.stride;
        format::encode_slot_header(header, &mut self.bufs[at..at + page]).map_err(|e| {
            (
                tag,
                DiskFault::Header {
                    slot,
                    why: e.to_string(),
                },
            )
        })?;
        let buf = self.bufs[at..].as_mut_ptr();
        if data.len() == padded && self.target.aligned(data.as_ptr(), data.len()) {
            // The block is read by the kernel from the pool (pinned until the `Done`).
            Ok(Entry {
                tag,
                slot,
                kind: Kind::Write,
                iov: [
                    iovec(buf, page),
                    iovec(data.as_ptr().cast_mut(), data.len()),
                ],
                iov_len: 2,
                total: page + padded,
            })
        } else {
            self.bufs[at + page..at + page + data.len()].copy_from_slice(data);
            self.bufs[at + page + data.len()..at + page + padded].fill(0);
            Ok(Entry {
                tag,
                slot,
                kind: Kind::Write,
                iov: [iovec(buf, page + padded), iovec(buf, 0)],
                iov_len: 1,
                total: page + padded,
            })
        }
    }

    /// Takes every completion the ring holds.
    fn reap(&mut self) {
        let finished: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|c| (c.user_data(), c.result()))
            .collect();
        for (i, result) in finished {
            let i = i as usize;
            let Some(entry) = self.entries.get_mut(i).and_then(Option::take) else {
                continue;
            };
            self.free.push(i);
            let at = i * self.stride;
            let op = match entry.kind {
                Kind::Read { .. } => "read",
                Kind::Write => "write",
                Kind::Clear => "clear",
            };
            let moved = usize::try_from(result).ok();
            let outcome = match moved {
                Some(n) if n == entry.total => Ok(()),
                Some(n) => Err(DiskFault::Io {
                    op,
                    slot: entry.slot,
                    error: format!("{n} of {} bytes", entry.total),
                }),
                None => Err(DiskFault::Io {
                    op,
                    slot: entry.slot,
                    error: std::io::Error::from_raw_os_error(-result).to_string(),
                }),
            };
            let outcome = match (outcome, entry.kind) {
                (
                    Ok(()),
                    Kind::Read {
                        expect,
                        mut claim,
                        direct,
                    },
                ) => {
                    let page = PAGE as usize;
                    let (head, rest) = self.bufs[at..at + self.stride].split_at(page);
                    let block = claim.blocks()[0];
                    match claim.block_mut(0) {
                        Some(dest) => {
                            check_read(entry.slot, head, &expect, dest, (!direct).then_some(rest))
                        }
                        None => Err(DiskFault::Pool(block)),
                    }
                }
                (outcome, _) => outcome,
            };
            self.answer(entry.tag, outcome, entry.total as u64);
        }
    }

    fn answer(&self, tag: u64, result: Result<(), DiskFault>, bytes: u64) {
        self.target.answer(Done { tag, result, bytes });
    }

    /// The ring failed: the writes in flight are answered failed (their slots are then
    /// freed: a late write is caught by the CRCs), the reads never (their blocks stay
    /// reserved, their lookups miss at their deadline: the kernel may still write them), and
    /// the buffers are never given back.
    fn abandon(mut self, e: &std::io::Error) {
        for slot in self.entries.iter_mut() {
            if let Some(entry) = slot.take() {
                match entry.kind {
                    Kind::Read { claim, .. } => std::mem::forget(claim),
                    Kind::Write | Kind::Clear => {
                        let _ = self.target.done.send(Done {
                            tag: entry.tag,
                            result: Err(DiskFault::Io {
                                op: "ring",
                                slot: entry.slot,
                                error: e.to_string(),
                            }),
                            bytes: 0,
                        });
                    }
                }
            }
        }
        (self.target.wake)();
        warn!("the disk tier's ring buffers are leaked until the process ends");
        std::mem::forget(self.bufs);
    }
}

fn iovec(base: *mut u8, len: usize) -> libc::iovec {
    libc::iovec {
        iov_base: base.cast(),
        iov_len: len,
    }
}
