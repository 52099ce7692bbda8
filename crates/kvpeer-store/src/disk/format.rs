//! The disk tier's file, byte for byte: where each slot lies and what its header says.
//!
//! Pure functions, no I/O: the tier (`tier.rs`) and the I/O threads (`io.rs`) both lay out and
//! read the file through this module only.
//!
//! ```text
//! offset 0            file header page (PAGE bytes)
//!                       0..8    magic  "KVPDISK\x01"
//!                       8..16   block_len (u64, little-endian)
//!                      16..24   slots     (u64)
//!                      24..28   CRC-32C of bytes 0..24
//! offset PAGE + s×stride   slot s: its header page, then the block padded to a page
//!                       0..8    magic  "KVPSLOT\x01"
//!                       8..16   generation (u64; written slots count up from 1 across the file)
//!                      16       tenant name length (u8, at most MAX_TENANT; 0: the default tenant)
//!                      17       0
//!                      18..20   key length (u16, at most MAX_KEY)
//!                      20..24   CRC-32C of the block's bytes
//!                      24..28   CRC-32C of bytes 0..24, the tenant name and the key
//!                      28..     the tenant's name (UTF-8), then the key
//! ```
//!
//! A slot is written with one `pwritev` of its header and data, which is not atomic: a crash
//! may leave any mix of old and new bytes. Every mix is caught when the slot is read: a torn
//! header fails its own CRC (the slot is free), a new header over old or partly written data
//! fails the data's CRC, an old header over new data fails the old CRC (the slot is a miss and
//! is freed). CRC-32C detects a torn write, not an attacker: the file is the node's own, on
//! its own disk (docs/security.md). Zeros (a sparse file's unwritten slots) are no header.
//! The generation orders two slots that name one key (a crash between writing a key's new
//! slot and forgetting its old one): the newer wins. The tenant is written by name, not by its
//! number in this run's rules (numbers follow the names' order, which a new rule shifts): a
//! restart maps each name to the tenant the rules give it then, and drops the blocks of
//! tenants no rule names any more.

/// Alignment and size of every header, and of every transfer with direct I/O.
pub const PAGE: u64 = 4096;
/// The longest tenant name a slot can hold (a tenant's name is at most 64 bytes).
pub const MAX_TENANT: usize = 64;
/// The longest key a slot can hold; a longer one stays in memory only.
pub const MAX_KEY: usize = PAGE as usize - SLOT_KEY_AT - MAX_TENANT;

const FILE_MAGIC: &[u8; 8] = b"KVPDISK\x01";
const SLOT_MAGIC: &[u8; 8] = b"KVPSLOT\x01";
const SLOT_KEY_AT: usize = 28;

/// Where things lie in a file of `slots` blocks of `block_len` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes per block.
    pub block_len: u64,
    /// Blocks the file holds.
    pub slots: u64,
}

impl Layout {
    /// The layout of the most slots of `block_len` bytes that fit in `capacity` bytes of file
    /// (its header page included). `None` if not even one fits.
    pub fn for_capacity(block_len: u64, capacity: u64) -> Option<Layout> {
        if block_len == 0 {
            return None;
        }
        let stride = Self::stride_of(block_len)?;
        let slots = capacity.checked_sub(PAGE)? / stride;
        (slots > 0 && slots < u64::from(u32::MAX)).then_some(Layout { block_len, slots })
    }

    fn stride_of(block_len: u64) -> Option<u64> {
        block_len.checked_next_multiple_of(PAGE)?.checked_add(PAGE)
    }

    /// Bytes from one slot's start to the next: a header page and the block, padded to a page.
    pub fn stride(&self) -> u64 {
        // `for_capacity` and `decode_file_header` checked that it does not overflow.
        Self::stride_of(self.block_len).unwrap_or(u64::MAX)
    }

    /// Bytes of the block as written: padded to a page.
    pub fn padded_block(&self) -> u64 {
        self.stride() - PAGE
    }

    /// Offset of slot `s`'s header page.
    pub fn slot_offset(&self, s: u64) -> u64 {
        PAGE + s * self.stride()
    }

    /// Bytes of the whole file.
    pub fn file_len(&self) -> u64 {
        PAGE + self.slots * self.stride()
    }
}

/// Why a file or slot header is not one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HeaderError {
    /// The magic bytes are wrong (a slot never written, or not a kvpeer disk file).
    #[error("no header (magic bytes differ)")]
    NoMagic,
    /// The header's own CRC fails: a torn write.
    #[error("header checksum fails (a torn write)")]
    Checksum,
    /// A field is out of range.
    #[error("header field out of range: {0}")]
    Range(&'static str),
}

/// The file header's page.
pub fn encode_file_header(layout: &Layout) -> [u8; PAGE as usize] {
    let mut page = [0u8; PAGE as usize];
    page[0..8].copy_from_slice(FILE_MAGIC);
    page[8..16].copy_from_slice(&layout.block_len.to_le_bytes());
    page[16..24].copy_from_slice(&layout.slots.to_le_bytes());
    let crc = crc32c::crc32c(&page[0..24]);
    page[24..28].copy_from_slice(&crc.to_le_bytes());
    page
}

/// The layout a file header page describes.
pub fn decode_file_header(page: &[u8]) -> Result<Layout, HeaderError> {
    if page.len() < 28 || &page[0..8] != FILE_MAGIC {
        return Err(HeaderError::NoMagic);
    }
    if crc32c::crc32c(&page[0..24]) != le32(&page[24..28]) {
        return Err(HeaderError::Checksum);
    }
    let block_len = le64(&page[8..16]);
    let slots = le64(&page[16..24]);
    if block_len == 0 || Layout::stride_of(block_len).is_none() {
        return Err(HeaderError::Range("block_len"));
    }
    if slots >= u64::from(u32::MAX) {
        return Err(HeaderError::Range("slots"));
    }
    Ok(Layout { block_len, slots })
}

/// What a slot's header says about the block after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotHeader {
    /// Orders slots naming one key: the larger is newer.
    pub generation: u64,
    /// The block's tenant, by name (`""`: the default tenant).
    pub tenant: String,
    /// The block's key bytes (at most [`MAX_KEY`]).
    pub key: Vec<u8>,
    /// CRC-32C of the block's `block_len` bytes.
    pub data_crc: u32,
}

/// Writes `header` into the first page of `page` (which must be at least a page; the rest of
/// the page is zeroed). `Err` if the key is longer than [`MAX_KEY`].
pub fn encode_slot_header(header: &SlotHeader, page: &mut [u8]) -> Result<(), HeaderError> {
    let key_len = header.key.len();
    let tenant = header.tenant.as_bytes();
    if key_len > MAX_KEY || page.len() < PAGE as usize {
        return Err(HeaderError::Range("key length"));
    }
    if tenant.len() > MAX_TENANT {
        return Err(HeaderError::Range("tenant name length"));
    }
    let page = &mut page[..PAGE as usize];
    page.fill(0);
    page[0..8].copy_from_slice(SLOT_MAGIC);
    page[8..16].copy_from_slice(&header.generation.to_le_bytes());
    // `tenant.len() <= MAX_TENANT < u8::MAX`, `key_len <= MAX_KEY < u16::MAX`.
    page[16] = tenant.len() as u8;
    page[18..20].copy_from_slice(&(key_len as u16).to_le_bytes());
    page[20..24].copy_from_slice(&header.data_crc.to_le_bytes());
    let key_at = SLOT_KEY_AT + tenant.len();
    page[SLOT_KEY_AT..key_at].copy_from_slice(tenant);
    page[key_at..key_at + key_len].copy_from_slice(&header.key);
    let crc = header_crc(page, key_at + key_len);
    page[24..28].copy_from_slice(&crc.to_le_bytes());
    Ok(())
}

/// The header in `page` (a slot's first page).
pub fn decode_slot_header(page: &[u8]) -> Result<SlotHeader, HeaderError> {
    if page.len() < PAGE as usize || &page[0..8] != SLOT_MAGIC {
        return Err(HeaderError::NoMagic);
    }
    let tenant_len = usize::from(page[16]);
    let key_len = usize::from(u16::from_le_bytes([page[18], page[19]]));
    if key_len > MAX_KEY || tenant_len > MAX_TENANT || page[17] != 0 {
        return Err(HeaderError::Checksum);
    }
    let key_at = SLOT_KEY_AT + tenant_len;
    if header_crc(page, key_at + key_len) != le32(&page[24..28]) {
        return Err(HeaderError::Checksum);
    }
    let tenant = std::str::from_utf8(&page[SLOT_KEY_AT..key_at])
        .map_err(|_| HeaderError::Range("tenant name"))?;
    let generation = le64(&page[8..16]);
    // Generations count up by one per write from 1: one past half the range is no file's.
    if generation == 0 || generation > u64::MAX / 2 {
        return Err(HeaderError::Range("generation"));
    }
    Ok(SlotHeader {
        generation,
        tenant: tenant.to_owned(),
        key: page[key_at..key_at + key_len].to_vec(),
        data_crc: le32(&page[20..24]),
    })
}

/// CRC-32C of the header's fields and of the `names_end - 28` bytes of names after them.
fn header_crc(page: &[u8], names_end: usize) -> u32 {
    let crc = crc32c::crc32c(&page[0..24]);
    crc32c::crc32c_append(crc, &page[SLOT_KEY_AT..names_end])
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn header() -> SlotHeader {
        SlotHeader {
            generation: 7,
            tenant: "alpha".into(),
            key: b"some-block-hash\0\0\0\x01".to_vec(),
            data_crc: 0xdead_beef,
        }
    }

    #[test]
    fn a_slot_header_round_trips_and_any_flipped_byte_is_caught() {
        let mut page = vec![0u8; PAGE as usize];
        encode_slot_header(&header(), &mut page).unwrap();
        assert_eq!(decode_slot_header(&page), Ok(header()));
        for at in 0..SLOT_KEY_AT + 5 + header().key.len() {
            let mut torn = page.clone();
            torn[at] ^= 0x40;
            assert!(
                decode_slot_header(&torn).is_err(),
                "byte {at} flipped went unnoticed"
            );
        }
    }

    #[test]
    fn zeros_and_garbage_are_no_header() {
        assert_eq!(
            decode_slot_header(&[0u8; PAGE as usize]),
            Err(HeaderError::NoMagic)
        );
        let mut page = vec![0xffu8; PAGE as usize];
        page[0..8].copy_from_slice(SLOT_MAGIC);
        assert_eq!(decode_slot_header(&page), Err(HeaderError::Checksum));
        assert_eq!(decode_slot_header(&[1, 2, 3]), Err(HeaderError::NoMagic));
    }

    #[test]
    fn a_key_too_long_for_a_slot_is_refused() {
        let mut h = header();
        h.key = vec![1; MAX_KEY + 1];
        let mut page = vec![0u8; PAGE as usize];
        assert!(encode_slot_header(&h, &mut page).is_err());
        h.key = vec![1; MAX_KEY];
        encode_slot_header(&h, &mut page).unwrap();
        assert_eq!(decode_slot_header(&page).unwrap().key.len(), MAX_KEY);
    }

    #[test]
    fn layout_pads_blocks_to_pages_and_fits_capacity() {
        let l = Layout::for_capacity(65536, PAGE + 10 * (65536 + PAGE) + 5).unwrap();
        assert_eq!(l.slots, 10);
        assert_eq!(l.stride(), 65536 + PAGE);
        assert_eq!(l.slot_offset(2), PAGE + 2 * (65536 + PAGE));
        assert_eq!(l.file_len(), PAGE + 10 * (65536 + PAGE));
        let small = Layout::for_capacity(100, 1 << 20).unwrap();
        assert_eq!(small.padded_block(), PAGE);
        assert_eq!(Layout::for_capacity(65536, 65536), None);
        assert_eq!(Layout::for_capacity(0, 1 << 30), None);
        assert_eq!(Layout::for_capacity(u64::MAX, u64::MAX), None);
    }

    #[test]
    fn a_file_header_round_trips_and_refuses_torn_or_absurd_ones() {
        let l = Layout {
            block_len: 2 << 20,
            slots: 4096,
        };
        let page = encode_file_header(&l);
        assert_eq!(decode_file_header(&page), Ok(l));
        let mut torn = page;
        torn[9] ^= 1;
        assert_eq!(decode_file_header(&torn), Err(HeaderError::Checksum));
        assert_eq!(decode_file_header(&[0u8; 64]), Err(HeaderError::NoMagic));
    }
}
