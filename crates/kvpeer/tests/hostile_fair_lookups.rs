//! A misbehaving peer costs only itself (docs/security.md, G7), against a real `kvpeer serve`:
//! an attacker (`tests/hostile/attacker.py hoard`, run with `KVPEER_PYTHON`) looks up every key
//! of the node and never fetches, or sends one lookup of a million keys; an honest
//! `kvpeer fetch` on the same host during the attack is served byte-exact (the child checks
//! every byte), and the attacker's own socket shows what it got: HIT for its share of pins, MISS
//! past it. Control runs: the same attacker within its share is served HIT everywhere; the same
//! honest fetch without an attack.
//!
//! Loopback only; ports from the system; every wait bounded; only processes started here are
//! killed (by their handles).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::Value;

mod common;
#[path = "common/hostile.rs"]
mod hostile;

use common::vllm::metric;
use hostile::*;

const BLOCKS: u64 = 4096;

/// `kvpeer serve` on tcp with 4096 blocks of 4 KiB, all filled, plus a config file's `toml`.
fn serve(toml: &str) -> (common::Proc, String, tempfile_path::Path) {
    let file = tempfile_path::Path::new(toml);
    let blocks = BLOCKS.to_string();
    let args = [
        "--config",
        file.as_str(),
        "--plane",
        "tcp",
        "--blocks",
        &blocks,
        "--block-len",
        "4096",
        "--fill",
        &blocks,
        "--metrics",
        "127.0.0.1:0",
    ];
    let (p, id) = serve_at(&args, "info", None);
    (p, id, file)
}

/// A config file that lives as long as the test.
mod tempfile_path {
    pub(crate) struct Path(std::path::PathBuf);

    impl Path {
        pub(crate) fn new(text: &str) -> Self {
            use std::sync::atomic::{AtomicUsize, Ordering};
            static N: AtomicUsize = AtomicUsize::new(0);
            let path = std::env::temp_dir().join(format!(
                "kvpeer-fair-{}-{}.toml",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&path, text).unwrap();
            Path(path)
        }

        pub(crate) fn as_str(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }

    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn epoch() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// The attacker looks up all 4096 keys of the node twice and never fetches. With the default
/// share (1/8 of the pool: 512 blocks) its socket gets HIT for the first 512 keys and MISS for
/// the rest, and MISS for everything in its second lookup (its share is pinned); an honest fetch
/// meanwhile is served byte-exact. Control: a second attacker within its share gets HIT for
/// every key.
#[test]
fn hoarded_pins_answer_miss_past_the_share_and_an_honest_fetch_is_served() {
    let (server, id, _file) = serve("");
    let share = BLOCKS / 8;
    let last = (BLOCKS - 1).to_string();
    let keys = format!("0-{last}");
    let attacker = attacker(&[
        "hoard", "--node", &id, "--keys", &keys, "--rounds", "2", "--hold", "20", "--wait", "20",
    ]);
    let hoarded = attacker.event("hoarded");
    println!("hoarded: {hoarded}");
    let lookups = hoarded["lookups"].as_array().unwrap();
    assert_eq!(n(&lookups[0]["answered"]), BLOCKS, "one answer per key");
    assert_eq!(n(&lookups[0]["hits"]), share, "its share hits: {hoarded}");
    assert_eq!(n(&lookups[0]["first_miss"]), share, "{hoarded}");
    assert_eq!(n(&lookups[0]["hits_after_first_miss"]), 0, "{hoarded}");
    assert_eq!(n(&lookups[1]["answered"]), BLOCKS);
    assert_eq!(
        n(&lookups[1]["hits"]),
        0,
        "share pinned: all MISS: {hoarded}"
    );

    // An honest peer on the same host, during the attack, past the attacker's pinned share.
    let run = honest_fetch(&id, "tcp", 4, 8, &["--first", "1000"]);
    assert_fetch_ok(&run, 32, "during the hoarding");
    // The node counted the MISS it answered past the share: 3584 + 4096 keys.
    let over = metric(&server, "kvpeer_lookup_keys_over_share_total");
    assert_eq!(over, (2 * BLOCKS - share) as f64);

    // Control: the same attacker, within its share, is served HIT for every key.
    let within = format!("{}-{}", 2 * share, 3 * share - 1);
    let control = attack(&[
        "hoard", "--node", &id, "--keys", &within, "--rounds", "1", "--wait", "20",
    ]);
    println!("control: {control}");
    assert_eq!(n(&control["lookups"][0]["hits"]), share, "{control}");
    drop(attacker);
}

/// Hoarders of one host that each pin their share (512 blocks), never fetched, reach the
/// node-wide cap (`max_pinned_blocks` 1024) after two of them; a third one still gets its whole
/// share (its socket: HIT for every key), because the heaviest holder's oldest pins are released
/// for it (`kvpeer_pins_evicted_total` counts 512), so the pinned total stays at the cap; an honest
/// fetch meanwhile is served byte-exact.
#[test]
fn all_peers_pins_are_capped_by_evicting_the_heaviest_holders_oldest() {
    let (server, id, _file) = serve("max_pinned_blocks = 1024\n");
    let share = BLOCKS / 8;
    let hoard = |i: u64| {
        let keys = format!("{}-{}", i * share, (i + 1) * share - 1);
        attacker(&[
            "hoard", "--node", &id, "--keys", &keys, "--rounds", "1", "--hold", "20", "--wait",
            "20",
        ])
    };
    let first = hoard(0);
    let second = hoard(1);
    for h in [&first, &second] {
        let got = h.event("hoarded");
        assert_eq!(n(&got["lookups"][0]["hits"]), share, "{got}");
    }
    assert_eq!(
        metric(&server, "kvpeer_pins_evicted_total"),
        0.0,
        "at the cap, not over"
    );
    // Pins a second old or more may go (younger ones are likely about to be fetched).
    std::thread::sleep(Duration::from_millis(1200));
    let third = hoard(2);
    let got = third.event("hoarded");
    assert_eq!(
        n(&got["lookups"][0]["hits"]),
        share,
        "the newcomer pins its whole share: {got}"
    );
    assert_eq!(
        metric(&server, "kvpeer_pins_evicted_total"),
        share as f64,
        "one holder's oldest pins went for it: {}",
        server.log()
    );
    let run = honest_fetch(&id, "tcp", 4, 8, &["--first", "3000"]);
    assert_fetch_ok(&run, 32, "with the pool's pins at the cap");
    drop((first, second, third));
}

/// The attacker sends one lookup of 1,048,576 keys (the most one message may carry), all asked
/// of the store (`max_lookup_keys` raised to that). The node asks them a slice per step of its
/// loop, so an honest fetch started meanwhile is served byte-exact before the huge lookup is
/// answered, in a fraction of the huge lookup's time; the attacker gets one `lookup_resp` with
/// every key, HIT for its share only.
#[test]
fn a_huge_lookup_does_not_stop_an_honest_peer_being_served() {
    let (_server, id, _file) = serve(
        "max_lookup_keys = 1048576\nmax_keys_per_message = 1048576\nmax_message_bytes = 67108864\n",
    );
    let share = BLOCKS / 8;

    // Control: the honest fetch alone.
    let started = Instant::now();
    let run = honest_fetch(&id, "tcp", 4, 8, &[]);
    let alone = started.elapsed();
    assert_fetch_ok(&run, 32, "control, no attack");

    let huge = 1u64 << 20;
    let attacker = attacker(&[
        "hoard",
        "--node",
        &id,
        "--keys",
        "0-7",
        "--rounds",
        "0",
        "--huge",
        &huge.to_string(),
        "--hold",
        "1",
        "--wait",
        "120",
    ]);
    attacker.event("huge_sending");
    // Let the message reach the node and its slices begin.
    std::thread::sleep(Duration::from_millis(500));
    let started = Instant::now();
    let run = honest_fetch(&id, "tcp", 4, 8, &["--first", "2000"]);
    let during = started.elapsed();
    let honest_done = epoch();
    assert_fetch_ok(&run, 32, "during the huge lookup");
    let answered = attacker.event("huge_answered");
    println!("alone {alone:?}, during the huge lookup {during:?}; {answered}");
    let h = &answered["huge"];
    assert_eq!(n(&h["answered"]), huge, "one lookup_resp, every key: {h}");
    assert_eq!(n(&h["hits"]), share, "{h}");
    assert_eq!(n(&h["first_miss"]), share, "{h}");
    let secs = h["seconds"].as_f64().unwrap();
    println!(
        "huge lookup: {huge} keys answered in {secs:.2} s ({:.2} us per key, decode, slices, \
         answer and loopback included)",
        secs * 1e6 / huge as f64
    );
    // Served between the slices, the honest fetch takes a fraction of the huge lookup's time
    // (only the huge message's decoding, which is not sliced, holds it up); asked in one go
    // (as before), it waited for all of it.
    assert!(
        during.as_secs_f64() < 0.5 * secs,
        "the honest fetch took {during:?}, the huge lookup {secs:.2} s: it waited for it ({h})"
    );
    assert!(
        honest_done < h["at"].as_f64().unwrap(),
        "the honest fetch ended after the huge lookup was answered ({h})"
    );
    drop(attacker);
}

/// The shares are work-conserving: a lone consumer is not capped while no other host
/// competes. With the node's time share per host cut to 1 ms a second (`inbound_ms_per_s = 1`),
/// a lone `kvpeer fetch` of 2,000 requests (lookups of 8 keys, and fetches) is never held back
/// (`kvpeer_inbound_held_back_total` stays 0) and is served byte-exact; held to 1 ms of the
/// node's thread a second, as the share was applied before whether or not anyone competed,
/// the same run takes minutes (a debug node spends some 100 µs of its thread per request).
#[test]
fn a_lone_consumer_is_not_capped_by_the_shares() {
    let (server, id, _file) = serve("inbound_ms_per_s = 1\n");
    let run = honest_fetch(&id, "tcp", 2000, 8, &[]);
    // 16,000 keys asked, the node's 4,096 held ones hit (each fetched once, then held by the
    // consumer), the rest miss.
    assert_fetch_ok(&run, BLOCKS, "a lone consumer under a 1 ms/s share");
    assert_eq!(run.summary["requests"], 2000, "{}", run.summary);
    assert_eq!(
        metric(&server, "kvpeer_inbound_held_back_total"),
        0.0,
        "a lone consumer was held back for its share"
    );
    assert!(metric(&server, "kvpeer_fetch_blocks_served_total") >= BLOCKS as f64);
    assert!(metric(&server, "kvpeer_lookups_served_total") >= 2000.0);
}

/// The keys-per-second budget is work-conserving too: with `lookup_keys_per_s = 500` and no
/// other peer wanting the node, a lookup of all 4,096 keys is asked in full and every key hits
/// (the attacker's socket shows it). Held to the rate whether or not anyone competed, as
/// before, about 500 + 5 × 500 keys are asked by the lookup's 5 s pending deadline and the
/// rest answer MISS.
#[test]
fn a_lone_peer_is_not_held_to_the_keys_per_second_budget() {
    let (_server, id, _file) = serve("lookup_keys_per_s = 500\nmax_pins_per_peer = 4096\n");
    let last = (BLOCKS - 1).to_string();
    let keys = format!("0-{last}");
    let summary = attack(&["hoard", "--node", &id, "--keys", &keys, "--wait", "20"]);
    let lookup = &summary["lookups"][0];
    assert_eq!(
        n(&lookup["answered"]),
        BLOCKS,
        "one answer per key: {summary}"
    );
    assert_eq!(
        n(&lookup["hits"]),
        BLOCKS,
        "every held key hits, none left unasked at the deadline: {summary}"
    );
}

/// A flood spread over many hosts leaves an honest consumer its turns (issue 37). Sixty
/// sessions from sixty source addresses (127.0.1.1 on: no per-host or per-source share ever
/// fills) send 8,192-key lookups back to back while an honest `kvpeer fetch` of 300 requests
/// runs: its every block is byte-exact, and it completes more requests per second than the
/// whole flood gets lookups answered, both measured in the same window on the same node (so
/// the bound holds on any machine and build). Before hosts took turns in the node's steps and
/// rounds, every step asked a slice of each of the sixty sessions' lookups before the honest
/// one's came up: the honest consumer got about one request answered per ten flood lookups.
#[test]
fn a_flood_spread_over_many_hosts_leaves_an_honest_consumer_its_turns() {
    let (_server, id, _file) = serve("max_peers = 128\n");
    let flood = attacker(&[
        "spread",
        "--node",
        &id,
        "--hosts",
        "60",
        "--keys",
        "8192",
        "--duration",
        "300",
        "--block-len",
        "4096",
        "--num-blocks",
        "64",
    ]);
    flood.event("flooding");
    // The flood's count as the honest run starts and as it ends (its reports come once a
    // second: the first at or after each moment).
    let progress_at = |moment: f64| loop {
        let p = flood.event("progress");
        if p["at"].as_f64().unwrap() >= moment {
            return p;
        }
    };
    let before = progress_at(epoch());
    let run = honest_fetch(&id, "tcp", 300, 8, &[]);
    let after = progress_at(epoch());
    assert_fetch_ok(&run, 2400, "during a flood of 60 hosts");
    let honest_rate = 300.0 / run.summary["seconds"].as_f64().unwrap();
    let flood_lookups = n(&after["answered"]) - n(&before["answered"]);
    let window = after["at"].as_f64().unwrap() - before["at"].as_f64().unwrap();
    let flood_rate = flood_lookups as f64 / window;
    println!(
        "honest: {honest_rate:.0} requests/s, lookup p50 {} us, p99 {} us; flood: {flood_rate:.0} \
         lookups/s of 8,192 keys ({flood_lookups} in {window:.1} s)",
        run.summary["lookup_p50_us"], run.summary["lookup_p99_us"]
    );
    assert!(
        flood_lookups > 0,
        "the flood was not served at all: {after}"
    );
    assert!(
        honest_rate >= flood_rate,
        "the honest consumer waited behind the flood: {honest_rate:.0} requests/s against \
         {flood_rate:.0} flood lookups/s ({})",
        run.summary
    );
    drop(flood);
}
