//! The control channel's floor: what one message round trip costs between two channels (two
//! ZeroMQ contexts, as two nodes have), in latency and in CPU.
//!
//! Run: `cargo bench -p kvpeer-net --bench control`
//!
//! A kvpeer request is two round trips (lookup → lookup_resp, fetch → transfer_done), so twice
//! this CPU is the part of a request's cost that comes from ZeroMQ itself (its I/O thread,
//! wake-ups, loopback TCP) before kvpeer does anything. CPU is the whole process's (both
//! channels and their I/O threads) from `getrusage`, per round trip.

#![allow(clippy::unwrap_used, clippy::expect_used, missing_docs)]

use std::time::{Duration, Instant};

use kvpeer_net::control::{ChannelEvent, ControlChannel, ControlConfig};

fn cpu() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    let u = getrusage(UsageWho::RUSAGE_SELF).unwrap();
    let tv = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec() as u64) + Duration::from_micros(t.tv_usec() as u64)
    };
    tv(u.user_time()) + tv(u.system_time())
}

/// Waits for the next payload on `ch` (sleeping in `zmq_poll`, as a node does).
fn next(ch: &mut ControlChannel) -> Vec<u8> {
    loop {
        for event in ch.recv() {
            if let ChannelEvent::Payload { payload, .. } = event {
                return payload;
            }
        }
        ch.wait(Duration::from_secs(5)).unwrap();
    }
}

fn main() {
    let mut a = ControlChannel::bind_any_port("127.0.0.1", ControlConfig::default()).unwrap();
    let mut b = ControlChannel::bind_any_port("127.0.0.1", ControlConfig::default()).unwrap();
    let (a_id, b_id) = (a.identity().clone(), b.identity().clone());
    let rounds = 20_000;
    let echo = std::thread::spawn(move || {
        for _ in 0..rounds + 100 {
            let payload = next(&mut b);
            b.send(&a_id, &payload).unwrap();
        }
    });
    a.dial(&b_id).unwrap();
    let message = vec![0x5a; 200]; // about a lookup of a few keys
    for _ in 0..100 {
        a.send(&b_id, &message).unwrap();
        next(&mut a);
    }
    let (t0, c0) = (Instant::now(), cpu());
    let mut samples = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        a.send(&b_id, &message).unwrap();
        next(&mut a);
        samples.push(t.elapsed());
    }
    let (wall, used) = (t0.elapsed(), cpu() - c0);
    echo.join().unwrap();
    samples.sort();
    let us = |d: Duration| d.as_secs_f64() * 1e6;
    println!(
        "control round trip ({rounds} of 200 B, two channels, loopback): p50 {:.1} µs, p99 {:.1} µs, \
         {:.0} round trips/s, CPU {:.1} µs per round trip (both sides)",
        us(samples[rounds / 2]),
        us(samples[rounds * 99 / 100]),
        rounds as f64 / wall.as_secs_f64(),
        us(used) / rounds as f64,
    );
}
