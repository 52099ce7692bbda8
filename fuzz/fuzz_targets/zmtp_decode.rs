//! Any bytes from a control-channel peer, cut into reads of any size: the accepting side's
//! decoder (`zmtp::Decoder`) and the connecting side's (`dealer::Dealer`, whose decoder skips
//! message bodies) never panic, and their limits hold:
//!
//! * every message the accepting decoder yields is within the frame limit and the part count;
//! * the skipping decoder yields exactly what the keeping one does (messages as their frame
//!   count and size), stops with the same error, and never holds a message byte: what it keeps
//!   is at most one frame header and one command;
//! * the DEALER answers, queues and times out without panicking, and holds no more than one
//!   command besides what it has to write;
//! * a connection in each role that keeps what the peer sends (the KV event stream's SUB, PUB,
//!   replay DEALER and ROUTER, and the control channel's ROUTER with its challenge) yields only
//!   messages within the limit, never more than `max_incoming` at once (decoding pauses there
//!   and resumes in order, as a listener's rounds take them), holds no more than one message
//!   and one read besides what it has to write, and the event stream's shape checks
//!   (`events::wire`) take whatever it yields without panicking.
#![no_main]
use std::time::{Duration, Instant};

use kvpeer_net::connection::{ConnLimits, Connection, Incoming, Role};
use kvpeer_net::dealer::{Dealer, DealerLimits};
use kvpeer_net::events::wire;
use kvpeer_net::zmtp::{Decoder, Input, ZmtpError};
use libfuzzer_sys::fuzz_target;

/// Small, so the limit paths are reached by small inputs.
const LIMIT: u64 = 300;
/// A frame header and the longest command a decoder accepts.
const MOST_HELD: usize = 9 + 64 * 1024;

/// What a decoder said, with messages as (frames, bytes) so both kinds compare.
#[derive(Debug, PartialEq)]
enum Seen {
    Input(Input),
    Message(usize, u64),
    Error(ZmtpError),
}

fn next(d: &mut Decoder) -> Option<Seen> {
    match d.next_input() {
        Ok(None) => None,
        Ok(Some(Input::Message(frames))) => {
            let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
            assert!(bytes <= LIMIT, "a message over the limit: {bytes}");
            assert!(frames.len() <= 64, "too many parts: {}", frames.len());
            Some(Seen::Message(frames.len(), bytes))
        }
        Ok(Some(Input::Discarded { frames, bytes })) => Some(Seen::Message(frames, bytes)),
        Ok(Some(Input::Ping { context, .. })) if context.len() > 16 => {
            panic!("a PING context over 16 bytes")
        }
        Ok(Some(i)) => Some(Seen::Input(i)),
        Err(e) => Some(Seen::Error(e)),
    }
}

/// What a listener does with one thing a connection yielded: the limits hold and the event
/// stream's shape checks take it without panicking.
fn take(incoming: Incoming) {
    match incoming {
        Incoming::Message(frames) => {
            let bytes: u64 = frames.iter().map(|f| f.len() as u64).sum();
            assert!(bytes <= LIMIT, "a message over the limit: {bytes}");
            let _ = wire::parse_subscription(&frames);
            let _ = wire::parse_replay_request(&frames);
            let _ = wire::parse_live(frames.clone());
            let _ = wire::parse_replay_answer(frames);
        }
        Incoming::Subscribe(p) | Incoming::Cancel(p) => assert!(p.len() <= 64 * 1024),
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&cut, stream)) = data.split_first() else {
        return;
    };
    let cut = usize::from(cut % 64) + 1;
    let (mut keeping, mut skipping) = (Decoder::new(LIMIT), Decoder::discarding(LIMIT));
    let (mut kept, mut skipped) = (Vec::new(), Vec::new());
    'feed: for chunk in stream.chunks(cut) {
        keeping.push(chunk);
        skipping.push(chunk);
        for (d, seen) in [(&mut keeping, &mut kept), (&mut skipping, &mut skipped)] {
            while let Some(s) = next(d) {
                let end = matches!(s, Seen::Error(_));
                seen.push(s);
                if end {
                    break 'feed;
                }
            }
        }
        assert!(
            skipping.pending() <= MOST_HELD,
            "the skipping decoder holds {} bytes",
            skipping.pending()
        );
    }
    // The keeping decoder may have stopped on an error the skipping one has not reached yet
    // (it consumed the same bytes up to there): compare what both saw.
    let n = kept.len().min(skipped.len());
    assert_eq!(kept[..n], skipped[..n]);

    let limits = DealerLimits {
        max_message_bytes: LIMIT,
        heartbeat_interval: Duration::from_millis(1),
        heartbeat_timeout: Duration::from_millis(3),
        heartbeat_ttl: Duration::from_secs(10),
        handshake_timeout: Duration::from_millis(5),
        send_queue: 4,
        send_queue_bytes: 4096,
    };
    let t = Instant::now();
    let mut dealer = Dealer::new(b"127.0.0.1:5600", limits.clone());
    dealer.connected(t);
    let _ = dealer.queue(b"hello");
    for (i, chunk) in stream.chunks(cut).enumerate() {
        let now = t + Duration::from_millis(i as u64);
        if dealer.handle_bytes(chunk, now).is_err() || dealer.handle_timeout(now).is_err() {
            break;
        }
        let _ = dealer.queue(chunk);
        // The socket takes half of what is there.
        let n = dealer.transmit().len().div_ceil(2);
        dealer.advance(n);
        assert!(dealer.queued() <= 4);
        assert!(dealer.pending() <= MOST_HELD);
    }

    let conn_limits = ConnLimits {
        send_queue_bytes: 1024,
        // Small, so decoding pauses and resumes (a listener's round) within small inputs.
        max_incoming: 3,
        ..ConnLimits::from(limits)
    };
    let mut control_router = Role::control_router();
    control_router.challenge = Some([7; 16]);
    for role in [
        Role::sub(),
        Role::publisher(),
        Role::dealer(),
        Role::router(),
        control_router,
    ] {
        let mut c = Connection::new(role, conn_limits.clone());
        c.connected(t);
        let _ = c.queue(&[b"", &0u64.to_be_bytes()]);
        'conn: for (i, chunk) in stream.chunks(cut).enumerate() {
            let now = t + Duration::from_millis(i as u64);
            if c.handle_bytes(chunk, now).is_err() || c.handle_timeout(now).is_err() {
                break;
            }
            // As a listener's rounds: take what is held (at most `max_incoming`), let the
            // decoder go on, and read no more until it holds nothing whole.
            loop {
                // Held: at most one message being received, one read, and one command, plus
                // the things decoded and not taken yet.
                assert!(c.pending() <= MOST_HELD + LIMIT as usize + cut);
                let mut taken = 0;
                while let Some(incoming) = c.poll_incoming() {
                    taken += 1;
                    assert!(taken <= 3, "more than max_incoming held");
                    take(incoming);
                }
                if !c.holds_input() {
                    break;
                }
                if c.decode_held(now).is_err() {
                    break 'conn;
                }
            }
            let _ = c.queue(&[chunk, chunk]);
            let n = c.transmit().len().div_ceil(2);
            c.advance(n);
            assert!(c.queued() <= 4);
        }
    }
});
