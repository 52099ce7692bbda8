//! ZMTP 3.1 with the NULL mechanism: the codec of one connection, without I/O.
//!
//! What a libzmq 4.3 DEALER (vLLM's `ZmqTransport`, pyzmq, kvpeer's own outbound side) and a
//! ROUTER speak to each other (RFC 23/ZMTP and 37/ZMTP 3.1):
//!
//! ```text
//! greeting   0xFF · 8 bytes · 0x7F · major 3 · minor · mechanism (20 bytes, "NULL" + zeros)
//!            · as-server · 31 zero bytes                                       (64 bytes)
//! frame      flags (bit0 MORE, bit1 LONG, bit2 COMMAND) · size (u8, or u64 BE when LONG) · body
//! command    name length (u8) · name · data
//! READY      properties: name length (u8) · name · value length (u32 BE) · value
//!            ("Socket-Type" = "DEALER", "Identity" = the peer's routing identity)
//! PING       TTL (u16 BE, deciseconds) · context (0–16 bytes); answered by PONG · context
//! ```
//!
//! [`Decoder`] takes bytes as they come and yields [`Input`]s; it checks every frame's size from
//! its header before buffering the body, so a peer announcing a frame over the limit is refused
//! before a byte of it is kept. A peer's greeting is judged as soon as its signature and version
//! byte are in (a ZMTP 2 peer sends only 12 bytes and would otherwise wait for ours in vain);
//! any major version from 3 on is accepted, as libzmq does (3.0 and 3.1 frame alike). A decoder
//! made with [`Decoder::discarding`] skips message bodies as they arrive instead of buffering
//! them (the DEALER side, which never reads messages): its memory is bounded by one command.
//! The writers build what either side sends. Pure: no sockets, no clock; `inbound.rs` (the
//! accepting side) and `dealer.rs` (the connecting side) drive it.

/// Bytes of a ZMTP 3 greeting.
pub const GREETING_LEN: usize = 64;

/// The READY property in which a kvpeer ROUTER gives each accepted connection a fresh random
/// challenge (16 bytes): a peer's proofs in its `connect` (the `shm_token`, `kvpeer_auth`) are
/// made for it, so they are good on that one connection of that one instance of the node and
/// nowhere else (docs/security.md, "Fresh proofs"). libzmq and pyzmq keep unknown properties as
/// metadata and otherwise ignore them.
pub const CHALLENGE_PROPERTY: &str = "X-Kvpeer-Challenge";

/// The READY property in which kvpeer's control ROUTER tells its identity (the `host:port` it
/// answers as), so a dialer that named it otherwise (`localhost:5600` for `127.0.0.1:5600`)
/// learns why no session can follow. Other ROUTERs send none; other DEALERs ignore it.
pub const IDENTITY_PROPERTY: &str = "X-Kvpeer-Identity";

/// Bytes of a challenge.
pub const CHALLENGE_LEN: usize = 16;

/// Longest command body this side accepts (READY carries two short properties; PING 18 bytes).
const MAX_COMMAND_BYTES: u64 = 64 * 1024;

/// What one part of a multipart message counts toward the message limit beyond its bytes.
const PART_OVERHEAD: u64 = 64;

/// Most parts in one message (kvpeer's peers send one; ZeroMQ envelopes a few).
const MAX_PARTS: usize = 64;

/// Buffer capacity kept after a message is consumed; a larger one is given back.
const KEEP_CAPACITY: usize = 256 * 1024;

/// Why a connection's bytes are not ZMTP this side accepts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ZmtpError {
    /// The greeting's signature is not ZMTP's.
    #[error("not a ZMTP greeting: its first bytes are \"{}\"", .0.escape_ascii())]
    Signature(Vec<u8>),
    /// A ZMTP version before 3 (the greeting's version byte: ZMTP 2.0 sends 1).
    #[error("the peer speaks an older ZMTP (version byte {0}; ZMTP 2.0 sends 1): ZMTP 3.0 or later is required")]
    Version(u8),
    /// A security mechanism other than NULL.
    #[error("security mechanism {0:?} is not supported (NULL only)")]
    Mechanism(String),
    /// A frame larger than the limit.
    #[error("frame of {size} bytes is over the {limit}-byte limit")]
    TooLarge {
        /// What the header announced.
        size: u64,
        /// The limit.
        limit: u64,
    },
    /// A command that cannot be read, or a message before the handshake.
    #[error("malformed {0}")]
    Malformed(&'static str),
}

/// What the peer said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// Its greeting arrived and is acceptable: send READY now.
    Greeting,
    /// Its READY: the handshake is done.
    Ready {
        /// Its `Socket-Type` property.
        socket_type: Vec<u8>,
        /// Its `Identity` property (empty when it set none).
        identity: Vec<u8>,
        /// Its [`CHALLENGE_PROPERTY`] (a kvpeer ROUTER's per-connection challenge), if any.
        challenge: Option<Vec<u8>>,
        /// Its [`IDENTITY_PROPERTY`] (a kvpeer ROUTER's own identity), if any.
        announced: Option<Vec<u8>>,
    },
    /// A whole message: its frames in order.
    Message(Vec<Vec<u8>>),
    /// A whole message skipped by a [`Decoder::discarding`] (never buffered).
    Discarded {
        /// Its frames.
        frames: usize,
        /// Its bytes.
        bytes: u64,
    },
    /// A heartbeat: answer with [`pong`] carrying this context.
    Ping {
        /// The time to live it announces, in deciseconds (0: none).
        ttl_deciseconds: u16,
        /// The context to echo.
        context: Vec<u8>,
    },
    /// An ERROR command: the peer refuses this connection, saying why (ZMTP 3.1; kvpeer's
    /// ROUTER sends one before it closes a connection whose claimed identity its source
    /// cannot back).
    Error(String),
    /// A SUB's SUBSCRIBE command (ZMTP 3.1): messages whose first frame starts with this
    /// prefix are wanted. (A ZMTP 3.0 SUB sends the message `0x01 · prefix` instead.)
    Subscribe(Vec<u8>),
    /// A SUB's CANCEL command (ZMTP 3.1): one SUBSCRIBE of this prefix is withdrawn. (ZMTP 3.0:
    /// the message `0x00 · prefix`.)
    Cancel(Vec<u8>),
    /// Any other command (PONG, ERROR, ...): it only proves the peer is alive.
    Command,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    Handshake,
    Traffic,
}

/// Incremental decoder of one connection's inbound bytes.
#[derive(Debug)]
pub struct Decoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already consumed.
    at: usize,
    phase: Phase,
    max_frame: u64,
    /// Frames of the message being received (MORE set on all but the last).
    parts: Vec<Vec<u8>>,
    /// How many frames and bytes the message being received has had so far.
    part_count: usize,
    parts_bytes: u64,
    /// Message bodies are skipped, not kept.
    discard: bool,
    /// Bytes of the frame being skipped still to come, and whether more frames follow it.
    skip: u64,
    skip_more: bool,
}

impl Decoder {
    /// A decoder refusing frames (and messages) over `max_frame` bytes.
    pub fn new(max_frame: u64) -> Self {
        Decoder {
            buf: Vec::new(),
            at: 0,
            phase: Phase::Greeting,
            max_frame,
            parts: Vec::new(),
            part_count: 0,
            parts_bytes: 0,
            discard: false,
            skip: 0,
            skip_more: false,
        }
    }

    /// A decoder that skips message bodies as they arrive ([`Input::Discarded`]) under the same
    /// limits: nothing of a message is kept.
    pub fn discarding(max_frame: u64) -> Self {
        Decoder {
            discard: true,
            ..Decoder::new(max_frame)
        }
    }

    /// Bytes buffered now (received, not yet consumed), including the buffer's spare room.
    pub fn buffered(&self) -> usize {
        self.buf.capacity() + self.parts.iter().map(Vec::capacity).sum::<usize>()
    }

    /// Bytes received and not yet consumed (a [`Decoder::discarding`] never holds message
    /// bytes: at most a frame header and one command).
    pub fn pending(&self) -> usize {
        self.buf.len() - self.at
    }

    /// Whether the peer's READY arrived.
    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Traffic
    }

    /// Appends bytes read from the connection.
    pub fn push(&mut self, bytes: &[u8]) {
        if self.at > 0 && self.at == self.buf.len() {
            self.buf.clear();
            self.at = 0;
            if self.buf.capacity() > KEEP_CAPACITY {
                // A large message is done: do not hold its buffer while the peer idles.
                self.buf = Vec::new();
            }
        } else if self.at > 64 * 1024 && self.at * 2 > self.buf.len() {
            self.buf.drain(..self.at);
            self.at = 0;
        }
        self.buf.extend_from_slice(bytes);
    }

    /// The next input, if whole; an error ends the connection.
    pub fn next_input(&mut self) -> Result<Option<Input>, ZmtpError> {
        loop {
            if self.skip > 0 {
                let available = (self.buf.len() - self.at) as u64;
                let n = available.min(self.skip);
                // `n` ≤ the bytes buffered, which fit in memory.
                self.at += n as usize;
                self.skip -= n;
                if self.skip > 0 {
                    return Ok(None);
                }
                if !self.skip_more {
                    return Ok(Some(self.end_of_discarded()));
                }
            }
            let rest = &self.buf[self.at..];
            match self.phase {
                Phase::Greeting => {
                    // Refuse a foreign protocol or an old version as soon as its first bytes
                    // show it.
                    check_greeting(&rest[..rest.len().min(GREETING_LEN)])?;
                    if rest.len() < GREETING_LEN {
                        return Ok(None);
                    }
                    self.at += GREETING_LEN;
                    self.phase = Phase::Handshake;
                    return Ok(Some(Input::Greeting));
                }
                Phase::Handshake | Phase::Traffic => {
                    let Some((flags, header, size)) = self.header()? else {
                        return Ok(None);
                    };
                    let message = flags & FLAG_COMMAND == 0;
                    // Each part of a message costs its bytes and its bookkeeping: a stream of
                    // empty frames with MORE must not grow without bound.
                    let (count, bytes) = (
                        self.part_count + 1,
                        self.parts_bytes.saturating_add(size + PART_OVERHEAD),
                    );
                    if message {
                        if self.phase == Phase::Handshake {
                            return Err(ZmtpError::Malformed("message before READY"));
                        }
                        if count > MAX_PARTS || bytes > self.max_frame {
                            return Err(ZmtpError::TooLarge {
                                size: bytes,
                                limit: self.max_frame,
                            });
                        }
                        if self.discard {
                            (self.part_count, self.parts_bytes) = (count, bytes);
                            self.at += header;
                            self.skip = size;
                            self.skip_more = flags & FLAG_MORE != 0;
                            if size == 0 && !self.skip_more {
                                return Ok(Some(self.end_of_discarded()));
                            }
                            continue;
                        }
                    }
                    let Some(body) = self.body(header, size)? else {
                        return Ok(None);
                    };
                    if flags & FLAG_COMMAND != 0 {
                        let input = command(&body)?;
                        if let Input::Ready { .. } = input {
                            if self.phase == Phase::Traffic {
                                return Err(ZmtpError::Malformed("second READY"));
                            }
                            self.phase = Phase::Traffic;
                        } else if self.phase == Phase::Handshake {
                            return Err(ZmtpError::Malformed("command before READY"));
                        }
                        return Ok(Some(input));
                    }
                    (self.part_count, self.parts_bytes) = (count, bytes);
                    self.parts.push(body);
                    if flags & FLAG_MORE == 0 {
                        self.part_count = 0;
                        self.parts_bytes = 0;
                        return Ok(Some(Input::Message(std::mem::take(&mut self.parts))));
                    }
                }
            }
        }
    }

    /// The message whose last frame was just skipped.
    fn end_of_discarded(&mut self) -> Input {
        let frames = std::mem::take(&mut self.part_count);
        let counted = std::mem::take(&mut self.parts_bytes);
        Input::Discarded {
            frames,
            bytes: counted.saturating_sub(frames as u64 * PART_OVERHEAD),
        }
    }

    /// The next frame's header: (flags, header length, body size), the size checked against
    /// the limit before anything else is done with it.
    fn header(&self) -> Result<Option<(u8, usize, u64)>, ZmtpError> {
        let rest = &self.buf[self.at..];
        let Some(&flags) = rest.first() else {
            return Ok(None);
        };
        let (header, size) = if flags & FLAG_LONG != 0 {
            let Some(b) = rest.get(1..9) else {
                return Ok(None);
            };
            let mut n = [0u8; 8];
            n.copy_from_slice(b);
            (9, u64::from_be_bytes(n))
        } else {
            let Some(&n) = rest.get(1) else {
                return Ok(None);
            };
            (2, u64::from(n))
        };
        let limit = if flags & FLAG_COMMAND != 0 {
            MAX_COMMAND_BYTES
        } else {
            self.max_frame
        };
        if size > limit {
            return Err(ZmtpError::TooLarge { size, limit });
        }
        Ok(Some((flags, header, size)))
    }

    /// The body of the frame whose header is at the front, once whole (consumed with it).
    fn body(&mut self, header: usize, size: u64) -> Result<Option<Vec<u8>>, ZmtpError> {
        // `size` ≤ the limit, which fits in memory by configuration.
        let size = usize::try_from(size).map_err(|_| ZmtpError::Malformed("frame size"))?;
        // The body is buffered as it arrives, never reserved from the header: a peer that
        // announces a large frame and sends nothing costs nothing.
        let rest = &self.buf[self.at..];
        let Some(body) = header
            .checked_add(size)
            .and_then(|end| rest.get(header..end))
        else {
            return Ok(None);
        };
        let body = body.to_vec();
        self.at += header + size;
        Ok(Some(body))
    }
}

const FLAG_MORE: u8 = 0x01;
const FLAG_LONG: u8 = 0x02;
const FLAG_COMMAND: u8 = 0x04;

/// Checks as much of a greeting as `g` holds (up to its 64 bytes): the signature from its first
/// byte, the major version from byte 10, the mechanism once whole.
fn check_greeting(g: &[u8]) -> Result<(), ZmtpError> {
    let signature_bad = match g.len() {
        0 => false,
        1..=9 => g[0] != 0xFF,
        _ => g[0] != 0xFF || g[9] & 0x01 != 0x01,
    };
    if signature_bad {
        return Err(ZmtpError::Signature(g[..g.len().min(10)].to_vec()));
    }
    match g.get(10) {
        Some(&major) if major < 3 => return Err(ZmtpError::Version(major)),
        _ => {}
    }
    let Some(mechanism) = g.get(12..32) else {
        return Ok(());
    };
    let name_len = mechanism.iter().position(|b| *b == 0).unwrap_or(20);
    if &mechanism[..name_len] != b"NULL" {
        return Err(ZmtpError::Mechanism(
            String::from_utf8_lossy(&mechanism[..name_len]).into_owned(),
        ));
    }
    Ok(())
}

fn command(body: &[u8]) -> Result<Input, ZmtpError> {
    let (&len, rest) = body
        .split_first()
        .ok_or(ZmtpError::Malformed("empty command"))?;
    let name = rest
        .get(..usize::from(len))
        .ok_or(ZmtpError::Malformed("command name"))?;
    let data = &rest[usize::from(len)..];
    match name {
        b"READY" => {
            let mut socket_type = Vec::new();
            let mut identity = Vec::new();
            let mut challenge = None;
            let mut announced = None;
            let mut p = data;
            while let Some((&n, after)) = p.split_first() {
                let key = after
                    .get(..usize::from(n))
                    .ok_or(ZmtpError::Malformed("READY property name"))?;
                let after = &after[usize::from(n)..];
                let vlen = after
                    .get(..4)
                    .map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]) as usize)
                    .ok_or(ZmtpError::Malformed("READY property length"))?;
                let value = after
                    .get(4..4 + vlen)
                    .ok_or(ZmtpError::Malformed("READY property value"))?;
                if key.eq_ignore_ascii_case(b"Socket-Type") {
                    socket_type = value.to_vec();
                } else if key.eq_ignore_ascii_case(b"Identity") {
                    identity = value.to_vec();
                } else if key.eq_ignore_ascii_case(CHALLENGE_PROPERTY.as_bytes()) {
                    challenge = Some(value.to_vec());
                } else if key.eq_ignore_ascii_case(IDENTITY_PROPERTY.as_bytes()) {
                    announced = Some(value.to_vec());
                }
                p = &after[4 + vlen..];
            }
            Ok(Input::Ready {
                socket_type,
                identity,
                challenge,
                announced,
            })
        }
        b"PING" => {
            // TTL (2 bytes) then up to 16 bytes of context.
            let (ttl, context) = match data {
                [a, b, context @ ..] => (u16::from_be_bytes([*a, *b]), context),
                _ => return Err(ZmtpError::Malformed("PING")),
            };
            Ok(Input::Ping {
                ttl_deciseconds: ttl,
                context: context[..context.len().min(16)].to_vec(),
            })
        }
        b"ERROR" => {
            let reason = data
                .split_first()
                .and_then(|(&n, rest)| rest.get(..usize::from(n)))
                .unwrap_or_default();
            Ok(Input::Error(String::from_utf8_lossy(reason).into_owned()))
        }
        b"SUBSCRIBE" => Ok(Input::Subscribe(data.to_vec())),
        b"CANCEL" => Ok(Input::Cancel(data.to_vec())),
        _ => Ok(Input::Command),
    }
}

/// The first byte of every ZMTP 3 greeting (its signature's).
pub const SIGNATURE_FIRST: u8 = 0xFF;

/// A greeting's signature: 0xFF, 8 bytes of padding, 0x7F.
pub const SIGNATURE_LEN: usize = 10;

/// The signature a control listener that takes TLS sends first, at accept (kvpeer's, not
/// ZMTP's): its padding, which ZMTP 3 says is not significant, says "kvp-tls" and a version.
/// A dialer that wants TLS waits for the listener's signature before it sends anything: this
/// one, and its ClientHello follows; any other (libzmq's padding is its identity's length,
/// ours zeros), and it speaks plaintext ZMTP on the same connection (`preferred`) or ends it
/// (`required`). A dialer with TLS off reads it as the start of a ZMTP greeting, as libzmq does.
///
/// Why the listener offers rather than the dialer trying: a libzmq peer reads any first byte
/// but 0xFF as ZMTP/1.0, where a byte is a frame's length, and hands a ClientHello's random
/// bytes to its application as messages (seen in vLLM's ROUTER: `msgspec.DecodeError`).
pub const TLS_OFFER: [u8; SIGNATURE_LEN] = [
    SIGNATURE_FIRST,
    b'k',
    b'v',
    b'p',
    b'-',
    b't',
    b'l',
    b's',
    1,
    0x7F,
];

/// This side's greeting: ZMTP 3.1, NULL, not as-server (NULL ignores it).
pub fn greeting() -> [u8; GREETING_LEN] {
    let mut g = [0u8; GREETING_LEN];
    g[0] = SIGNATURE_FIRST;
    g[9] = 0x7F;
    g[10] = 3;
    g[11] = 1;
    g[12..16].copy_from_slice(b"NULL");
    g
}

fn command_frame(name: &[u8], data: &[u8]) -> Vec<u8> {
    let body_len = 1 + name.len() + data.len();
    let mut out = Vec::with_capacity(9 + body_len);
    if body_len > 255 {
        out.push(FLAG_COMMAND | FLAG_LONG);
        out.extend_from_slice(&(body_len as u64).to_be_bytes());
    } else {
        out.push(FLAG_COMMAND);
        out.push(body_len as u8);
    }
    // Command names here are short constants.
    out.push(name.len() as u8);
    out.extend_from_slice(name);
    out.extend_from_slice(data);
    out
}

/// READY with `Socket-Type` = `socket_type` (what a ROUTER sends).
pub fn ready(socket_type: &str) -> Vec<u8> {
    ready_with(&[("Socket-Type", socket_type.as_bytes())])
}

/// READY with these properties, in order (a DEALER's: `Socket-Type` and `Identity`). Names are
/// short constants; a value's length is written as a u32 (identities are host:port strings).
pub fn ready_with(properties: &[(&str, &[u8])]) -> Vec<u8> {
    let mut data = Vec::new();
    for (name, value) in properties {
        data.push(name.len() as u8);
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(&(value.len() as u32).to_be_bytes());
        data.extend_from_slice(value);
    }
    command_frame(b"READY", &data)
}

/// ERROR with `reason` (at most 255 bytes, cut at a character boundary): ZMTP 3.1's way of
/// telling a peer why its connection is refused.
pub fn error(reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(255);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut data = Vec::with_capacity(end + 1);
    data.push(end as u8);
    data.extend_from_slice(&reason.as_bytes()[..end]);
    command_frame(b"ERROR", &data)
}

/// PING with a TTL (deciseconds) and no context.
pub fn ping(ttl_deciseconds: u16) -> Vec<u8> {
    command_frame(b"PING", &ttl_deciseconds.to_be_bytes())
}

/// PONG echoing a PING's context.
pub fn pong(context: &[u8]) -> Vec<u8> {
    command_frame(b"PONG", context)
}

/// One message frame (no MORE): how a DEALER sends a one-frame message.
pub fn message_frame(body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + body.len());
    write_message_frame(&mut out, body);
    out
}

/// Appends one message frame (no MORE) carrying `body` to `out`: short up to 255 bytes, long
/// (a u64 size) beyond.
pub fn write_message_frame(out: &mut Vec<u8>, body: &[u8]) {
    write_frame(out, body, false);
}

/// Appends one message frame carrying `body` to `out`, with MORE set when `more` (another
/// frame of the same message follows).
pub fn write_frame(out: &mut Vec<u8>, body: &[u8], more: bool) {
    let more = if more { FLAG_MORE } else { 0 };
    if body.len() > 255 {
        out.push(FLAG_LONG | more);
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    } else {
        out.push(more);
        out.push(body.len() as u8);
    }
    out.extend_from_slice(body);
}

/// Room [`begin_frame`] leaves for a frame's header: the long form's flags and 8-byte size.
const LONG_HEADER: usize = 9;

/// Starts a single-frame message whose body the caller appends to `out` itself (encoding
/// straight into a connection's queue, so a large body is not copied there from a buffer of
/// its own): leaves room for the header and returns where it starts, for [`end_frame`].
pub(crate) fn begin_frame(out: &mut Vec<u8>, body_hint: usize) -> usize {
    let start = out.len();
    out.reserve(LONG_HEADER.saturating_add(body_hint));
    out.extend_from_slice(&[0; LONG_HEADER]);
    start
}

/// Writes the header of the frame [`begin_frame`] started at `start`, its body being
/// everything appended after the room for the header: the bytes are those [`write_frame`]
/// writes (a body of up to 255 bytes gets the short header, the body moved up to it). The
/// writer in between only appends; were the room gone, nothing is written.
pub(crate) fn end_frame(out: &mut Vec<u8>, start: usize) {
    let Some(body) = out.len().checked_sub(start.saturating_add(LONG_HEADER)) else {
        debug_assert!(false, "a frame's body writer took bytes away");
        return;
    };
    if body > 255 {
        out[start] = FLAG_LONG;
        out[start + 1..start + LONG_HEADER].copy_from_slice(&(body as u64).to_be_bytes());
    } else {
        out[start + LONG_HEADER - 2] = 0;
        out[start + LONG_HEADER - 1] = body as u8;
        out.drain(start..start + LONG_HEADER - 2);
    }
}

/// Appends a multipart message (MORE on every frame but the last) to `out`; no frames is one
/// empty frame (a message has at least one).
pub fn write_message(out: &mut Vec<u8>, parts: &[&[u8]]) {
    match parts.split_last() {
        None => write_frame(out, &[], false),
        Some((last, first)) => {
            for part in first {
                write_frame(out, part, true);
            }
            write_frame(out, last, false);
        }
    }
}

/// Bytes [`write_message`] appends for `parts`.
pub fn message_len(parts: &[&[u8]]) -> usize {
    parts
        .iter()
        .map(|p| p.len() + if p.len() > 255 { 9 } else { 2 })
        .sum::<usize>()
        .max(2)
}

/// The body of a ZMTP 3.0 subscription message, which a SUB sends as an ordinary message:
/// `0x01 · prefix` to subscribe, `0x00 · prefix` to cancel. libzmq 4.3's PUB and XPUB take it
/// from ZMTP 3.0 and 3.1 peers alike (a 3.1 libzmq SUB sends the SUBSCRIBE command instead).
pub fn subscription(prefix: &[u8], subscribe: bool) -> Vec<u8> {
    let mut body = Vec::with_capacity(1 + prefix.len());
    body.push(u8::from(subscribe));
    body.extend_from_slice(prefix);
    body
}

/// A ZMTP 3.1 SUBSCRIBE (or, when not `subscribe`, CANCEL) command for `prefix`.
pub fn subscription_command(prefix: &[u8], subscribe: bool) -> Vec<u8> {
    let name: &[u8] = if subscribe { b"SUBSCRIBE" } else { b"CANCEL" };
    command_frame(name, prefix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready_with_identity(id: &[u8]) -> Vec<u8> {
        ready_with(&[("Socket-Type", b"DEALER"), ("Identity", id)])
    }

    fn all(d: &mut Decoder) -> Result<Vec<Input>, ZmtpError> {
        let mut out = Vec::new();
        while let Some(i) = d.next_input()? {
            out.push(i);
        }
        Ok(out)
    }

    #[test]
    fn a_dealer_session_byte_by_byte() {
        let mut bytes = greeting().to_vec();
        bytes.extend(ready_with_identity(b"127.0.0.1:5600"));
        bytes.extend(ping(100));
        bytes.extend(message_frame(b"hello"));
        let big = vec![7u8; 300];
        bytes.extend(message_frame(&big));
        let mut d = Decoder::new(1 << 20);
        let mut got = Vec::new();
        for b in &bytes {
            d.push(std::slice::from_ref(b));
            got.extend(all(&mut d).unwrap());
        }
        assert_eq!(
            got,
            vec![
                Input::Greeting,
                Input::Ready {
                    socket_type: b"DEALER".to_vec(),
                    identity: b"127.0.0.1:5600".to_vec(),
                    challenge: None,
                    announced: None,
                },
                Input::Ping {
                    ttl_deciseconds: 100,
                    context: vec![]
                },
                Input::Message(vec![b"hello".to_vec()]),
                Input::Message(vec![big]),
            ]
        );
        assert!(d.is_ready());
    }

    #[test]
    fn an_error_command_carries_its_reason_cut_at_255_bytes() {
        let mut d = Decoder::new(1 << 20);
        d.push(&greeting());
        d.push(&ready_with_identity(b"x:1"));
        d.push(&error(
            "identity 10.0.0.5:1 claimed from another address (10.0.0.6)",
        ));
        let long = "é".repeat(200);
        d.push(&error(&long));
        let got = all(&mut d).unwrap();
        assert_eq!(
            got[2],
            Input::Error("identity 10.0.0.5:1 claimed from another address (10.0.0.6)".into())
        );
        // 400 bytes of two-byte characters: 127 of them (254 bytes), never half of one.
        assert_eq!(got[3], Input::Error("é".repeat(127)));
    }

    #[test]
    fn a_huge_frame_is_refused_from_its_header() {
        let mut d = Decoder::new(64 << 20);
        d.push(&greeting());
        d.push(&ready_with_identity(b"x:1"));
        let mut header = vec![FLAG_LONG];
        header.extend_from_slice(&(1u64 << 40).to_be_bytes());
        d.push(&header);
        let e = all(&mut d).unwrap_err();
        assert!(matches!(e, ZmtpError::TooLarge { size, .. } if size == 1 << 40));
        assert!(d.buf.capacity() < 4096, "nothing allocated for the body");
    }

    #[test]
    fn foreign_bytes_bad_versions_and_mechanisms_are_refused() {
        let mut d = Decoder::new(1024);
        d.push(b"GET / HTTP/1.1\r\n");
        assert!(matches!(d.next_input(), Err(ZmtpError::Signature(_))));
        let mut g = greeting();
        g[10] = 2;
        let mut d = Decoder::new(1024);
        d.push(&g);
        assert_eq!(d.next_input(), Err(ZmtpError::Version(2)));
        let mut g = greeting();
        g[12..17].copy_from_slice(b"CURVE");
        let mut d = Decoder::new(1024);
        d.push(&g);
        assert!(matches!(d.next_input(), Err(ZmtpError::Mechanism(m)) if m == "CURVE"));
        // A message before READY.
        let mut d = Decoder::new(1024);
        d.push(&greeting());
        d.push(&message_frame(b"early"));
        assert_eq!(d.next_input(), Ok(Some(Input::Greeting)));
        assert!(matches!(d.next_input(), Err(ZmtpError::Malformed(_))));
    }

    #[test]
    fn endless_empty_parts_are_refused() {
        let mut d = Decoder::new(64 << 20);
        d.push(&greeting());
        d.push(&ready_with_identity(b"x:1"));
        assert_eq!(all(&mut d).unwrap().len(), 2);
        let empties = [FLAG_MORE, 0].repeat(MAX_PARTS + 1);
        d.push(&empties);
        assert!(matches!(d.next_input(), Err(ZmtpError::TooLarge { .. })));
        assert!(d.buffered() < 64 * 1024, "{}", d.buffered());
    }

    #[test]
    fn a_large_messages_buffer_is_given_back() {
        let mut d = Decoder::new(64 << 20);
        d.push(&greeting());
        d.push(&ready_with_identity(b"x:1"));
        d.push(&message_frame(&vec![1u8; 4 << 20]));
        assert_eq!(all(&mut d).unwrap().len(), 3);
        d.push(&ping(1));
        assert!(d.buffered() <= KEEP_CAPACITY, "{}", d.buffered());
    }

    #[test]
    fn subscriptions_come_as_commands_and_multipart_messages_frame_with_more() {
        let mut d = Decoder::new(1 << 20);
        d.push(&greeting());
        d.push(&ready("SUB"));
        d.push(&subscription_command(b"kv@a", true));
        d.push(&subscription_command(b"", false));
        let mut bytes = Vec::new();
        write_message(&mut bytes, &[b"topic", &[0; 8], &vec![5; 300]]);
        assert_eq!(
            bytes.len(),
            message_len(&[b"topic", &[0; 8], &vec![5; 300]])
        );
        write_message(&mut bytes, &[]);
        assert_eq!(message_len(&[]), 2);
        d.push(&bytes);
        let got = all(&mut d).unwrap();
        assert_eq!(
            got[2..],
            [
                Input::Subscribe(b"kv@a".to_vec()),
                Input::Cancel(Vec::new()),
                Input::Message(vec![b"topic".to_vec(), vec![0; 8], vec![5; 300]]),
                Input::Message(vec![Vec::new()]),
            ]
        );
        assert_eq!(subscription(b"ab", true), b"\x01ab");
        assert_eq!(subscription(b"ab", false), b"\x00ab");
    }

    #[test]
    fn multipart_messages_stay_whole_and_count_toward_the_limit() {
        let mut d = Decoder::new(200);
        d.push(&greeting());
        d.push(&ready_with_identity(b"x:1"));
        d.push(&[FLAG_MORE, 3, b'a', b'b', b'c', 0, 2, b'd', b'e']);
        let got = all(&mut d).unwrap();
        assert_eq!(
            got[2],
            Input::Message(vec![b"abc".to_vec(), b"de".to_vec()])
        );
        // Two parts of 70 bytes: 2 × (70 + the per-part overhead) > 200.
        let mut two = vec![FLAG_MORE, 70];
        two.extend_from_slice(&[1; 70]);
        two.extend_from_slice(&[0, 70]);
        two.extend_from_slice(&[2; 70]);
        d.push(&two);
        assert!(matches!(d.next_input(), Err(ZmtpError::TooLarge { .. })));
    }
}
