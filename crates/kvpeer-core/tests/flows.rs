//! End-to-end flows through two cores: the happy paths first.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use support::cluster::{key, Cluster};

#[test]
fn symmetric_lookup_fetch_and_finish() {
    let mut c = Cluster::new(2);
    let keys: Vec<_> = (0..8).map(key).collect();
    for k in &keys[..6] {
        c.parent(1).insert(k);
    }
    let (job, hits) = c.symmetric_fetch(0, 1, "req-1", &keys);
    assert_eq!(hits, keys[..6].to_vec());
    let job = job.unwrap();
    assert_eq!(c.load_result(0, job), Some(true));
    c.assert_landed(0, job, &hits);
    c.finish(0, "req-1");
    c.run();
    c.assert_clean();
}
