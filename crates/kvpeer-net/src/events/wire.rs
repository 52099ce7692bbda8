//! The shapes of the KV event stream's ZeroMQ messages (vLLM 0.33 `ZmqEventPublisher`), built
//! and checked without I/O:
//!
//! ```text
//! PUB → SUB          topic · seq (u64 BE, 8 bytes) · payload
//! DEALER → ROUTER    "" · start_seq (8 bytes BE)          (the ROUTER sees its identity first)
//! ROUTER → DEALER    "" · topic · seq · payload           per buffered batch with seq ≥ start
//!                    "" · "" · -1 (8 bytes BE) · ""       the end of the answer
//! SUB → PUB          0x01 · prefix  (subscribe)  /  0x00 · prefix  (cancel)     ZMTP 3.0 form
//! ```
//!
//! A message of another shape is a [`ShapeError`]: the caller drops it and counts it. vLLM's
//! ROUTER takes a `start_seq` of any length (`int.from_bytes`); kvpeer's takes the 8 bytes
//! vLLM's subscribers send and nothing else.

/// The `seq` frame of a replay's end marker: −1 as 8 bytes big-endian.
pub const END_SEQ: [u8; 8] = (-1i64).to_be_bytes();

/// Why a message is not the shape its socket carries.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ShapeError {
    /// Another number of frames.
    #[error("{got} frames where {want} were expected")]
    Frames {
        /// How many came.
        got: usize,
        /// How many the shape has.
        want: usize,
    },
    /// A sequence number that is not 8 bytes.
    #[error("a sequence number of {0} bytes (8 expected)")]
    Seq(usize),
    /// The first frame is not the empty delimiter.
    #[error("no empty delimiter frame in front")]
    Delimiter,
}

/// One batch of the stream, as a live message or a replayed one carries it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// The topic frame.
    pub topic: Vec<u8>,
    /// The sequence number.
    pub seq: u64,
    /// The `KVEventBatch` payload (msgpack).
    pub payload: Vec<u8>,
}

/// What one message of a replay answer is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplayAnswer {
    /// A buffered batch.
    Batch(Batch),
    /// The end marker (`seq` −1).
    End,
}

fn seq(frame: &[u8]) -> Result<[u8; 8], ShapeError> {
    frame.try_into().map_err(|_| ShapeError::Seq(frame.len()))
}

fn frames<const N: usize>(message: Vec<Vec<u8>>) -> Result<[Vec<u8>; N], ShapeError> {
    let got = message.len();
    message
        .try_into()
        .map_err(|_| ShapeError::Frames { got, want: N })
}

/// A live message `[topic, seq, payload]`.
pub fn parse_live(message: Vec<Vec<u8>>) -> Result<Batch, ShapeError> {
    let [topic, s, payload] = frames(message)?;
    Ok(Batch {
        topic,
        seq: u64::from_be_bytes(seq(&s)?),
        payload,
    })
}

/// The frames of a replay request for every batch from `from` on (what a DEALER sends).
pub fn replay_request(from: u64) -> [Vec<u8>; 2] {
    [Vec::new(), from.to_be_bytes().to_vec()]
}

/// The `start_seq` of a replay request `["", start_seq]` as a ROUTER gets it from a DEALER.
pub fn parse_replay_request(message: &[Vec<u8>]) -> Result<u64, ShapeError> {
    match message {
        [delimiter, s] if delimiter.is_empty() => Ok(u64::from_be_bytes(seq(s)?)),
        [_, _] => Err(ShapeError::Delimiter),
        _ => Err(ShapeError::Frames {
            got: message.len(),
            want: 2,
        }),
    }
}

/// One message of a replay answer, `["", topic, seq, payload]`.
pub fn parse_replay_answer(message: Vec<Vec<u8>>) -> Result<ReplayAnswer, ShapeError> {
    let [delimiter, topic, s, payload] = frames(message)?;
    if !delimiter.is_empty() {
        return Err(ShapeError::Delimiter);
    }
    let s = seq(&s)?;
    if s == END_SEQ {
        return Ok(ReplayAnswer::End);
    }
    Ok(ReplayAnswer::Batch(Batch {
        topic,
        seq: u64::from_be_bytes(s),
        payload,
    }))
}

/// What a subscription message (ZMTP 3.0 form, one frame) asks: `Some((subscribe, prefix))`,
/// `None` for any other message (a PUB ignores those).
pub fn parse_subscription(message: &[Vec<u8>]) -> Option<(bool, &[u8])> {
    match message {
        [frame] => match frame.split_first() {
            Some((1, prefix)) => Some((true, prefix)),
            Some((0, prefix)) => Some((false, prefix)),
            _ => None,
        },
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn v(frames: &[&[u8]]) -> Vec<Vec<u8>> {
        frames.iter().map(|f| f.to_vec()).collect()
    }

    #[test]
    fn live_messages_are_three_frames_with_an_8_byte_seq() {
        let m = v(&[b"kv@a", &5u64.to_be_bytes(), b"payload"]);
        assert_eq!(
            parse_live(m).unwrap(),
            Batch {
                topic: b"kv@a".to_vec(),
                seq: 5,
                payload: b"payload".to_vec()
            }
        );
        assert_eq!(
            parse_live(v(&[b"t", b"p"])),
            Err(ShapeError::Frames { got: 2, want: 3 })
        );
        assert_eq!(
            parse_live(v(&[b"t", &[0; 4], b"p"])),
            Err(ShapeError::Seq(4))
        );
    }

    #[test]
    fn replay_requests_and_answers_have_the_delimiter_in_front() {
        let r = replay_request(7);
        assert_eq!(parse_replay_request(&r), Ok(7));
        assert_eq!(
            parse_replay_request(&v(&[b"x", &[0; 8]])),
            Err(ShapeError::Delimiter)
        );
        assert_eq!(
            parse_replay_request(&v(&[&[0; 8]])),
            Err(ShapeError::Frames { got: 1, want: 2 })
        );
        assert_eq!(
            parse_replay_request(&v(&[b"", &[0; 9]])),
            Err(ShapeError::Seq(9))
        );
        let batch = v(&[b"", b"t", &3u64.to_be_bytes(), b"p"]);
        assert_eq!(
            parse_replay_answer(batch).unwrap(),
            ReplayAnswer::Batch(Batch {
                topic: b"t".to_vec(),
                seq: 3,
                payload: b"p".to_vec()
            })
        );
        let end = v(&[b"", b"", &END_SEQ, b""]);
        assert_eq!(parse_replay_answer(end).unwrap(), ReplayAnswer::End);
        assert_eq!(
            parse_replay_answer(v(&[b"x", b"", &END_SEQ, b""])),
            Err(ShapeError::Delimiter)
        );
    }

    #[test]
    fn subscriptions_in_message_form() {
        assert_eq!(
            parse_subscription(&v(&[b"\x01kv@"])),
            Some((true, &b"kv@"[..]))
        );
        assert_eq!(parse_subscription(&v(&[b"\x00"])), Some((false, &b""[..])));
        assert_eq!(parse_subscription(&v(&[b"\x02x"])), None);
        assert_eq!(parse_subscription(&v(&[b""])), None);
        assert_eq!(parse_subscription(&v(&[b"\x01", b"x"])), None);
    }
}
