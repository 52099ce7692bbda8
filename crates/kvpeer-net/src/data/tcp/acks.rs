//! Which ACK a data connection may take next: the sender's rule for ACKs, without a socket.
//!
//! The sender thread (`sender.rs`) owns one [`AckTurn`] per data connection. It tells it when a
//! WRITE's last byte has left ([`AckTurn::left`]), reads the receiver's bytes into
//! [`AckTurn::room`] (at most the rest of one ACK per read, so a peer streaming ACKs is read a
//! bounded amount per drive) and hands each read's length to [`AckTurn::filled`], which says
//! what a whole ACK means. Nothing here blocks, locks or reads a clock.
//!
//! The rule, and why: an honest receiver acknowledges a WRITE only once it has read all of it,
//! in the order the WRITEs came. So an ACK counts only for the oldest WRITE whose last byte left
//! on this connection. Counting a WRITE before its last byte has left would let the core unpin
//! its blocks (and reuse them for another request's data) while the rest of the frame is still
//! read from them. A refusal comes as soon as the receiver has read a WRITE's header, so it may
//! also name the WRITE still being sent when none awaits its ACK. Anything else (early, out of
//! order, repeated, one too many, another connection's transfer, bytes that are not an ACK) is
//! a violation: the connection's peer is faulted and the ACK completes nothing.

use std::collections::VecDeque;

use kvpeer_core::TransferId;

use super::wire::{self, AckStatus, ACK_LEN};

/// What a whole ACK, taken in turn, says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ack {
    /// The receiver wrote the transfer's blocks.
    Written(TransferId),
    /// The receiver refused the transfer (no permit, or no digests it asked for), and closes.
    Refused(TransferId),
    /// The receiver read the whole transfer, but a block did not match its digest: the
    /// transfer failed; the connection goes on.
    Corrupted(TransferId),
}

/// An ACK that must not count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum AckViolation {
    /// An ACK for a transfer that is not next in turn on this connection.
    OutOfTurn(TransferId),
    /// Thirteen bytes that are not an ACK.
    NotAnAck,
}

/// One data connection's WRITEs awaiting their ACK, and the ACK being read.
#[derive(Debug, Default)]
pub(super) struct AckTurn {
    /// WRITEs whose last byte left on this connection, oldest first.
    unacked: VecDeque<TransferId>,
    /// The bytes of the ACK being read.
    partial: [u8; ACK_LEN],
    partial_len: usize,
}

impl AckTurn {
    /// The last byte of transfer `tid`'s WRITE left on this connection: its ACK may come.
    pub(super) fn left(&mut self, tid: TransferId) {
        self.unacked.push_back(tid);
    }

    /// WRITEs that have left and await their ACK.
    #[cfg(test)]
    fn awaiting(&self) -> usize {
        self.unacked.len()
    }

    /// Where the next read goes: the rest of the ACK being read (never empty).
    pub(super) fn room(&mut self) -> &mut [u8] {
        &mut self.partial[self.partial_len..]
    }

    /// `n` bytes were read into [`AckTurn::room`]. `being_sent` is the transfer whose WRITE is
    /// leaving now (the connection's front frame), if any. `Ok(None)` while the ACK is not
    /// whole; once it is, what it says, or why it must not count.
    pub(super) fn filled(
        &mut self,
        n: usize,
        being_sent: Option<TransferId>,
    ) -> Result<Option<Ack>, AckViolation> {
        self.partial_len = (self.partial_len + n).min(ACK_LEN);
        if self.partial_len < ACK_LEN {
            return Ok(None);
        }
        self.partial_len = 0;
        let (tid, status) = wire::decode_ack(&self.partial).map_err(|_| AckViolation::NotAnAck)?;
        let next = self.unacked.front() == Some(&tid);
        // Only a refusal may come before the WRITE's last byte left; a corrupted block is
        // known only once every byte was read.
        let refusal_of_the_one_leaving =
            status == AckStatus::Refused && self.unacked.is_empty() && being_sent == Some(tid);
        if next {
            self.unacked.pop_front();
        } else if !refusal_of_the_one_leaving {
            return Err(AckViolation::OutOfTurn(tid));
        }
        Ok(Some(match status {
            AckStatus::Written => Ack::Written(tid),
            AckStatus::Refused => Ack::Refused(tid),
            AckStatus::Corrupted => Ack::Corrupted(tid),
        }))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn t(n: u64) -> TransferId {
        TransferId::new(n)
    }

    /// Feeds a whole ACK, in reads of `chunk` bytes, as the sender reads it.
    fn feed(
        turn: &mut AckTurn,
        tid: TransferId,
        written: bool,
        chunk: usize,
        being_sent: Option<TransferId>,
    ) -> Result<Option<Ack>, AckViolation> {
        let bytes = wire::encode_ack(tid, written);
        let mut at = 0;
        loop {
            let room = turn.room();
            let n = chunk.min(room.len()).min(ACK_LEN - at);
            room[..n].copy_from_slice(&bytes[at..at + n]);
            at += n;
            let said = turn.filled(n, being_sent)?;
            if at == ACK_LEN {
                return Ok(said);
            }
            assert_eq!(said, None, "an ACK is whole only at its 13th byte");
        }
    }

    #[test]
    fn acks_count_in_the_order_the_writes_left_whatever_the_reads() {
        for chunk in [1, 2, 5, 12, 13] {
            let mut turn = AckTurn::default();
            turn.left(t(1));
            turn.left(t(2));
            assert_eq!(turn.awaiting(), 2);
            assert_eq!(
                feed(&mut turn, t(1), true, chunk, None),
                Ok(Some(Ack::Written(t(1))))
            );
            assert_eq!(
                feed(&mut turn, t(2), true, chunk, None),
                Ok(Some(Ack::Written(t(2))))
            );
            assert_eq!(turn.awaiting(), 0);
        }
    }

    #[test]
    fn an_ack_before_its_writes_last_byte_left_is_a_violation() {
        // WRITE 7 is still leaving (the connection's front frame): its blocks are still read.
        let mut turn = AckTurn::default();
        assert_eq!(
            feed(&mut turn, t(7), true, 13, Some(t(7))),
            Err(AckViolation::OutOfTurn(t(7)))
        );
        // The same once it left: in turn.
        let mut turn = AckTurn::default();
        turn.left(t(7));
        assert_eq!(
            feed(&mut turn, t(7), true, 13, None),
            Ok(Some(Ack::Written(t(7))))
        );
    }

    #[test]
    fn out_of_order_repeated_one_too_many_and_foreign_acks_are_violations() {
        let mut turn = AckTurn::default();
        turn.left(t(1));
        turn.left(t(2));
        assert_eq!(
            feed(&mut turn, t(2), true, 13, None),
            Err(AckViolation::OutOfTurn(t(2))),
            "the second WRITE's ACK before the first's"
        );
        let mut turn = AckTurn::default();
        turn.left(t(1));
        assert_eq!(
            feed(&mut turn, t(1), true, 13, None),
            Ok(Some(Ack::Written(t(1))))
        );
        assert_eq!(
            feed(&mut turn, t(1), true, 13, None),
            Err(AckViolation::OutOfTurn(t(1))),
            "repeated"
        );
        assert_eq!(
            feed(&mut turn, t(99), true, 13, None),
            Err(AckViolation::OutOfTurn(t(99))),
            "one too many, for a transfer this connection never sent"
        );
    }

    #[test]
    fn a_refusal_may_name_the_oldest_write_or_the_one_leaving_when_none_awaits() {
        let mut turn = AckTurn::default();
        turn.left(t(3));
        assert_eq!(
            feed(&mut turn, t(3), false, 4, None),
            Ok(Some(Ack::Refused(t(3))))
        );
        assert_eq!(turn.awaiting(), 0);
        // Nothing awaits: the WRITE leaving now may be refused after its header was read.
        assert_eq!(
            feed(&mut turn, t(4), false, 13, Some(t(4))),
            Ok(Some(Ack::Refused(t(4))))
        );
        // But not while an older one awaits its ACK, and never as "written".
        let mut turn = AckTurn::default();
        turn.left(t(5));
        assert_eq!(
            feed(&mut turn, t(6), false, 13, Some(t(6))),
            Err(AckViolation::OutOfTurn(t(6)))
        );
        let mut turn = AckTurn::default();
        assert_eq!(
            feed(&mut turn, t(6), true, 13, Some(t(6))),
            Err(AckViolation::OutOfTurn(t(6)))
        );
    }

    #[test]
    fn thirteen_bytes_that_are_not_an_ack_are_a_violation() {
        let mut turn = AckTurn::default();
        turn.left(t(1));
        turn.room().copy_from_slice(b"KVPW\0\0\0\0\0\0\0\x01\0");
        assert_eq!(turn.filled(ACK_LEN, None), Err(AckViolation::NotAnAck));
        assert_eq!(turn.awaiting(), 1, "nothing completed");
    }
}
