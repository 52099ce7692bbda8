//! The chunk descriptions a pool with a disk tier keeps beside it, so that a pool started
//! again on its disk describes the blocks it holds as it did (their tokens, parents and block
//! hashes: what Dynamo's indexer needs), not in vLLM's placeholder form, before the engines
//! announce those chunks again.
//!
//! Owned by the pool thread: read once when the pool starts, appended each tick it publishes
//! (buffered, flushed per tick), never on the node's thread. Two files in the tier's
//! directory, `kvpeer-catalog.cur` and `.prev`: when the current one passes [`CAP`] bytes it
//! becomes the previous one (the older previous one goes), so the pair stays within 2 × CAP
//! and holds the newest descriptions. A record is `[length u32 LE][CRC-32C u32 LE][payload]`,
//! the payload a KV event batch of self-describing CPU `BlockStored`s in bytes-hash form, as
//! the pool's catalog learns from an engine; reading stops at the first record that is torn
//! (a crash in the middle of an append), keeping everything before it.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

/// Bytes of one file before it is rotated.
pub(crate) const CAP: u64 = 64 << 20;
const CURRENT: &str = "kvpeer-catalog.cur";
const PREVIOUS: &str = "kvpeer-catalog.prev";
/// The largest record read back (a batch of one tick's descriptions is far smaller).
const MAX_RECORD: usize = 16 << 20;

/// The appending end.
#[derive(Debug)]
pub(crate) struct CatalogFile {
    dir: PathBuf,
    out: BufWriter<File>,
    written: u64,
}

impl CatalogFile {
    /// Opens the pair in `dir` and returns the payloads they hold, oldest first.
    pub(crate) fn open(dir: &Path) -> std::io::Result<(CatalogFile, Vec<Vec<u8>>)> {
        let mut payloads = Vec::new();
        for name in [PREVIOUS, CURRENT] {
            match File::open(dir.join(name)) {
                Ok(file) => {
                    // At most what this module writes (a file rotates once past CAP): a file
                    // grown by something else costs no more memory than ours would.
                    let mut bytes = Vec::new();
                    file.take(CAP + 8 + MAX_RECORD as u64)
                        .read_to_end(&mut bytes)?;
                    payloads.extend(records(&bytes));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.join(CURRENT))?;
        let written = file.metadata()?.len();
        Ok((
            CatalogFile {
                dir: dir.to_path_buf(),
                out: BufWriter::new(file),
                written,
            },
            payloads,
        ))
    }

    /// Appends one payload (flushed by [`CatalogFile::flush`]); rotates past [`CAP`].
    pub(crate) fn append(&mut self, payload: &[u8]) -> std::io::Result<()> {
        let len = u32::try_from(payload.len()).map_err(std::io::Error::other)?;
        self.out.write_all(&len.to_le_bytes())?;
        self.out.write_all(&crc32c::crc32c(payload).to_le_bytes())?;
        self.out.write_all(payload)?;
        self.written += 8 + u64::from(len);
        if self.written > CAP {
            self.out.flush()?;
            std::fs::rename(self.dir.join(CURRENT), self.dir.join(PREVIOUS))?;
            let file = OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join(CURRENT))?;
            self.out = BufWriter::new(file);
            self.written = 0;
        }
        Ok(())
    }

    /// Writes what is buffered.
    pub(crate) fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// The intact records of `bytes`, up to the first torn one.
fn records(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut at = 0usize;
    while let Some(head) = bytes.get(at..at + 8) {
        let len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
        let crc = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
        if len > MAX_RECORD {
            break;
        }
        let Some(payload) = bytes.get(at + 8..at + 8 + len) else {
            break;
        };
        if crc32c::crc32c(payload) != crc {
            break;
        }
        out.push(payload.to_vec());
        at += 8 + len;
    }
    out
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("kvpeer-catfile-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn records_survive_a_reopen_and_a_torn_tail_keeps_what_came_before() {
        let d = dir("torn");
        {
            let (mut f, found) = CatalogFile::open(&d).unwrap();
            assert!(found.is_empty());
            f.append(b"first").unwrap();
            f.append(b"second").unwrap();
            f.flush().unwrap();
        }
        let (_, found) = CatalogFile::open(&d).unwrap();
        assert_eq!(found, vec![b"first".to_vec(), b"second".to_vec()]);
        // A crash in the middle of the next append: half a record.
        let mut raw = std::fs::read(d.join(CURRENT)).unwrap();
        raw.extend_from_slice(&100u32.to_le_bytes());
        raw.extend_from_slice(b"\x01\x02");
        std::fs::write(d.join(CURRENT), &raw).unwrap();
        let (_, found) = CatalogFile::open(&d).unwrap();
        assert_eq!(found.len(), 2);
        // A flipped byte in the second record: only the first is kept.
        let mut raw = std::fs::read(d.join(CURRENT)).unwrap();
        raw[8 + 5 + 8 + 2] ^= 1;
        std::fs::write(d.join(CURRENT), &raw).unwrap();
        let (_, found) = CatalogFile::open(&d).unwrap();
        assert_eq!(found, vec![b"first".to_vec()]);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn past_its_cap_the_file_rotates_and_the_pair_keeps_the_newest() {
        let d = dir("rotate");
        let chunk = vec![7u8; 1 << 20];
        {
            let (mut f, _) = CatalogFile::open(&d).unwrap();
            for _ in 0..(3 * CAP / (1 << 20)) {
                f.append(&chunk).unwrap();
            }
            f.append(b"newest").unwrap();
            f.flush().unwrap();
        }
        let total: u64 = [CURRENT, PREVIOUS]
            .iter()
            .map(|n| std::fs::metadata(d.join(n)).unwrap().len())
            .sum();
        assert!(total <= 2 * CAP + (2 << 20), "{total}");
        let (_, found) = CatalogFile::open(&d).unwrap();
        assert_eq!(found.last().unwrap(), b"newest");
        let _ = std::fs::remove_dir_all(&d);
    }
}
