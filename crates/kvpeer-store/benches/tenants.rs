//! What keeping tenants apart costs a lookup, and whether a key another tenant holds can be
//! told from a key nobody holds by its time (docs/security.md, G14).
//!
//! Run: `cargo bench -p kvpeer-store --bench tenants` (release). A store of `BLOCKS` blocks
//! holds two tenants' keys, half each; tenant 1 looks up its own keys (hits), tenant 2's keys
//! (held by another tenant) and keys nobody holds, in batches of `BATCH` taken in turn so that
//! drift in the machine's speed falls on all three alike. The baseline: the same keys in a store
//! that keeps no tenants (one index), a hit and a miss. Printed: ns per lookup, median and p99
//! over the batches, and the ratios that matter: another tenant's key against nobody's (1.0:
//! nothing to tell apart), and each scoped lookup against the unscoped one.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Instant;

use kvpeer_core::LookupResult;
use kvpeer_proto::OffloadKey;
use kvpeer_store::{BlockStore, Pool, Tenant};

const BLOCKS: u64 = 32_768;
const LEN: u64 = 4096;
const BATCH: usize = 4096;
const ROUNDS: usize = 300;

fn key(n: u64) -> OffloadKey {
    let mut h = [0u8; 32];
    h[..8].copy_from_slice(&n.to_le_bytes());
    h[8..16].copy_from_slice(&n.wrapping_mul(0x9e37_79b9_7f4a_7c15).to_le_bytes());
    OffloadKey::from_parts(&h, 0)
}

fn store() -> BlockStore {
    BlockStore::with_pool(Pool::anonymous(BLOCKS, LEN, false).unwrap()).unwrap()
}

/// ns per lookup of one batch of `keys` as `tenant`, checking every answer is `want`.
fn batch(s: &mut BlockStore, tenant: Tenant, keys: &[OffloadKey], want: LookupResult) -> f64 {
    let t = Instant::now();
    for k in keys {
        let r = s.lookup_in(tenant, black_box(k));
        assert_eq!(r, want);
    }
    t.elapsed().as_nanos() as f64 / keys.len() as f64
}

struct Series(Vec<f64>);

impl Series {
    fn pct(&self, p: f64) -> f64 {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v[((v.len() - 1) as f64 * p).round() as usize]
    }
}

fn main() {
    let half = BLOCKS / 2;
    let block = vec![0x5a; LEN as usize];
    let mine: Vec<OffloadKey> = (0..half).map(key).collect();
    let theirs: Vec<OffloadKey> = (half..BLOCKS).map(key).collect();
    let nobodys: Vec<OffloadKey> = (BLOCKS..BLOCKS + half).map(key).collect();

    let mut scoped = store();
    let mut unscoped = store();
    for k in &mine {
        scoped.put_in(Tenant(1), k, &block).unwrap();
        unscoped.put(k, &block).unwrap();
    }
    for k in &theirs {
        scoped.put_in(Tenant(2), k, &block).unwrap();
        unscoped.put(k, &block).unwrap();
    }

    let mut series: Vec<(&str, Series)> = [
        "own hit",
        "another tenant's key",
        "nobody's key",
        "unscoped hit",
        "unscoped miss",
    ]
    .into_iter()
    .map(|n| (n, Series(Vec::new())))
    .collect();
    let mut at = 0;
    for _ in 0..ROUNDS {
        let pick = |keys: &[OffloadKey]| keys[at..at + BATCH].to_vec();
        let (m, t, n) = (pick(&mine), pick(&theirs), pick(&nobodys));
        at = (at + BATCH) % (half as usize - BATCH);
        series[0]
            .1
             .0
            .push(batch(&mut scoped, Tenant(1), &m, LookupResult::Hit));
        series[1]
            .1
             .0
            .push(batch(&mut scoped, Tenant(1), &t, LookupResult::Miss));
        series[2]
            .1
             .0
            .push(batch(&mut scoped, Tenant(1), &n, LookupResult::Miss));
        series[3]
            .1
             .0
            .push(batch(&mut unscoped, Tenant::DEFAULT, &m, LookupResult::Hit));
        series[4].1 .0.push(batch(
            &mut unscoped,
            Tenant::DEFAULT,
            &n,
            LookupResult::Miss,
        ));
    }
    println!(
        "store of {BLOCKS} blocks, two tenants of {half} keys each; {ROUNDS} rounds of {BATCH} lookups per case"
    );
    println!("{:<22} {:>10} {:>10}", "case", "p50 ns", "p99 ns");
    for (name, s) in &series {
        println!("{name:<22} {:>10.1} {:>10.1}", s.pct(0.5), s.pct(0.99));
    }
    let p50 = |i: usize| series[i].1.pct(0.5);
    println!(
        "another tenant's key / nobody's key (p50): {:.3}  (1.0: a miss is a miss)",
        p50(1) / p50(2)
    );
    println!("own hit / unscoped hit (p50): {:.3}", p50(0) / p50(3));
    println!("nobody's key / unscoped miss (p50): {:.3}", p50(2) / p50(4));
}
