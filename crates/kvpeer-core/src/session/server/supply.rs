//! Supply: blocks pinned for a round (lookup pins, or a PD producer's stored blocks), matched
//! against the round's demand.
//!
//! Contract: each pin is counted open once and armed on the store lane once; supply for a
//! cancelled round completes its job at once (failed); matched blocks are written only once the
//! peer's fetch came.

use kvpeer_proto::KvRequestId;

use super::{Held, Matched, Origin, Pin, ServerRole, Supply};
use crate::output::{Event, Link};
use crate::session::{Cx, RoundKey};

impl ServerRole {
    /// Blocks pinned for `id`'s round `round` (lookup pins, or a PD producer's stored blocks):
    /// matched against the round's demand, the rest kept as supply.
    pub(crate) fn add_stored_blocks(
        &mut self,
        link: &mut Link,
        cx: &mut Cx<'_>,
        id: &KvRequestId,
        supply: Supply<'_>,
    ) {
        let Supply {
            job,
            keys,
            blocks,
            round,
            origin,
        } = supply;
        let rnd = self.round_or_new(id, round);
        let serial = rnd.serial;
        if rnd.is_cancelled() {
            cx.parent.complete_store_job(job, false);
            cx.out.event(Event::StoreDone {
                job,
                success: false,
            });
            return;
        }
        if origin == Origin::Lookup {
            rnd.origin = Origin::Lookup;
        }
        let new_pin = rnd.pin_mut(job).is_none();
        if new_pin {
            rnd.pins.push(Pin {
                job,
                submitted_at: cx.now,
                readers: 0,
            });
        }
        let mut matched = Matched::default();
        for (key, &local) in keys.iter().zip(blocks) {
            match rnd.demanded.remove(key) {
                Some(remote) => matched.add(local, remote, job),
                None => {
                    rnd.available.insert(key.clone(), (job, local));
                }
            }
        }
        let demand_received = rnd.demand_received();
        if new_pin {
            self.open_pins += 1;
            if origin == Origin::Lookup {
                for &block in blocks {
                    *self.pinned.entry(block).or_default() += 1;
                }
                self.held.add(Held::pins(blocks.len()));
                self.pin_blocks.insert(job, blocks.to_vec());
            }
            self.store_lane
                .arm(cx.now, (RoundKey::new(id, round), serial, job));
        }
        if !matched.local.is_empty() && demand_received {
            self.submit_transfer(link, cx, id, round, serial, matched);
        }
    }
}
