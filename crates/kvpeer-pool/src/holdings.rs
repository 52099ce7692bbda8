//! Which followed engine holds which key, and the rule that makes a key worth pulling.
//!
//! One entry per key some followed engine holds (on its CPU tier), with the set of engines
//! holding it (a bit each: at most [`EngineSlot::MAX`] engines per pool node). Bounded: past
//! `max_keys` an entry is forgotten (the pool then merely misses a chance to pull it), fairly
//! among the engines: the oldest of the engine that brought the most entries in (each entry
//! counts for the engine whose announcement made it), so one engine announcing junk keys by
//! the million forgets its own, never another engine's keys while it holds more than they do.
//! An engine that restarted or went away is forgotten whole ([`Holdings::forget_engine`]).
//!
//! Admission: a key becomes a [`PullCandidate`] the moment `min_holders` engines hold it (1:
//! everything any engine holds; 2: only chunks computed on more than one engine, the shared
//! prefixes). It is offered once; [`Holdings::pull_failed`] lets it be offered again by the next
//! engine that announces it. The caller drops candidates its own store already holds (an
//! engine re-announces blocks it fetched from the pool).
//!
//! **Tenants** ([`Holdings::set_groups`]): engines of one tenant form a group, and admission is
//! per group: a key is offered once for each group in which `min_holders` of the group's
//! engines hold it, from one of them, so a pool that keeps tenants apart pulls a key both
//! tenants hold once into each, and never counts one tenant's holders towards another's.
//! Without groups every engine is in one.

use std::collections::{HashMap, VecDeque};

use kvpeer_proto::OffloadKey;

use crate::catalog::{Catalog, CatalogLimits};

/// A followed engine's place in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct EngineSlot(u8);

impl EngineSlot {
    /// Engines one index tracks.
    pub const MAX: usize = 64;

    /// Slot `i`, if `i < MAX`.
    pub fn new(i: usize) -> Option<Self> {
        u8::try_from(i)
            .ok()
            .filter(|&i| usize::from(i) < Self::MAX)
            .map(EngineSlot)
    }

    /// Its number.
    pub fn index(self) -> usize {
        usize::from(self.0)
    }

    fn bit(self) -> u64 {
        1 << self.0
    }
}

/// When a key is worth pulling.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Admission {
    /// Engines that must hold a key before it is pulled (at least 1).
    pub min_holders: u32,
}

impl Default for Admission {
    fn default() -> Self {
        Admission { min_holders: 1 }
    }
}

/// A key to pull, and an engine that holds it (the one that announced it last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullCandidate {
    /// The key.
    pub key: OffloadKey,
    /// Where to pull it from.
    pub from: EngineSlot,
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    holders: u64,
    last_holder: EngineSlot,
    /// Its place in its maker's `order` (an older generation there is stale).
    generation: u64,
    /// The engine whose announcement made the entry (it counts in that engine's share).
    maker: EngineSlot,
    /// The groups it was offered for (and not failed since), as a mask of their engines.
    offered: u64,
}

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// The index.
#[derive(Debug)]
pub struct Holdings {
    entries: FastMap<OffloadKey, Entry>,
    /// Per engine, the keys whose entries it made, by age, with their generation; entries
    /// re-made since are stale and skipped.
    order: Vec<VecDeque<(u64, OffloadKey)>>,
    /// Live entries each engine made (what eviction evens out).
    made: [usize; EngineSlot::MAX],
    /// Items in all of `order` (live and stale).
    queued: usize,
    next_generation: u64,
    max_keys: usize,
    admission: Admission,
    per_engine: [u64; EngineSlot::MAX],
    forgotten: u64,
    /// Each KV cache group's kind (`kv_cache_spec_kind`), as the engines' events said it.
    group_kinds: std::collections::BTreeMap<u32, String>,
    /// What each chunk is beyond its key, from the same events.
    catalog: Catalog,
    /// Each engine's group, as the mask of its engines (all engines: one group).
    groups: [u64; EngineSlot::MAX],
}

/// Groups whose kind the index keeps (models have a handful).
const MAX_GROUP_KINDS: usize = 256;

impl Holdings {
    /// An empty index of at most `max_keys` keys (at least 1).
    pub fn new(max_keys: usize, admission: Admission) -> Self {
        Holdings {
            entries: FastMap::default(),
            order: (0..EngineSlot::MAX).map(|_| VecDeque::new()).collect(),
            made: [0; EngineSlot::MAX],
            queued: 0,
            next_generation: 0,
            max_keys: max_keys.max(1),
            admission: Admission {
                min_holders: admission.min_holders.max(1),
            },
            per_engine: [0; EngineSlot::MAX],
            forgotten: 0,
            group_kinds: std::collections::BTreeMap::new(),
            catalog: Catalog::new(CatalogLimits::default()),
            groups: [u64::MAX; EngineSlot::MAX],
        }
    }

    /// Puts `engines` in one group (a tenant's engines): admission then counts, and offers,
    /// within each group apart. Engines never named stay in the group of all the unnamed.
    pub fn set_groups(&mut self, groups: &[Vec<EngineSlot>]) {
        let named: u64 = groups.iter().flatten().fold(0, |m, e| m | e.bit());
        self.groups = [!named; EngineSlot::MAX];
        for group in groups {
            let mask = group.iter().fold(0, |m, e| m | e.bit());
            for e in group {
                self.groups[e.index()] = mask;
            }
        }
    }

    /// What each chunk is beyond its key (learned by the followers, read by the publisher).
    pub fn catalog_mut(&mut self) -> &mut Catalog {
        &mut self.catalog
    }

    /// The catalog, to read its counts.
    pub fn catalog(&self) -> &Catalog {
        &self.catalog
    }

    /// An engine said KV cache group `group` is of kind `kind` (its GPU events say it, and
    /// vLLM's self-describing CPU events): kept, so the pool's own events can say it too.
    /// Returns whether that changed what is known. Past `MAX_GROUP_KINDS` groups, new ones
    /// are not kept.
    pub fn learn_group_kind(&mut self, group: u32, kind: &str) -> bool {
        match self.group_kinds.get(&group) {
            Some(known) if known == kind => false,
            None if self.group_kinds.len() >= MAX_GROUP_KINDS => false,
            _ => {
                self.group_kinds.insert(group, kind.to_owned());
                true
            }
        }
    }

    /// The kinds of the groups learned so far.
    pub fn group_kinds(&self) -> &std::collections::BTreeMap<u32, String> {
        &self.group_kinds
    }

    /// `engine` holds `key`; the key, if it just became worth pulling.
    pub fn stored(&mut self, engine: EngineSlot, key: OffloadKey) -> Option<PullCandidate> {
        let entry = match self.entries.get_mut(&key) {
            Some(e) => e,
            None => {
                self.make_room();
                let generation = self.next_generation;
                self.next_generation += 1;
                self.order[engine.index()].push_back((generation, key.clone()));
                self.queued += 1;
                self.made[engine.index()] += 1;
                self.entries.entry(key.clone()).or_insert(Entry {
                    holders: 0,
                    last_holder: engine,
                    generation,
                    maker: engine,
                    offered: 0,
                })
            }
        };
        if entry.holders & engine.bit() == 0 {
            entry.holders |= engine.bit();
            self.per_engine[engine.index()] += 1;
        }
        entry.last_holder = engine;
        let group = self.groups[engine.index()];
        if entry.offered & group != 0
            || (entry.holders & group).count_ones() < self.admission.min_holders
        {
            return None;
        }
        entry.offered |= group;
        Some(PullCandidate { key, from: engine })
    }

    /// `engine` no longer holds `key` (a key no engine holds any more is forgotten).
    pub fn removed(&mut self, engine: EngineSlot, key: &OffloadKey) {
        let Some(entry) = self.entries.get_mut(key) else {
            return;
        };
        if entry.holders & engine.bit() != 0 {
            entry.holders &= !engine.bit();
            self.per_engine[engine.index()] -= 1;
        }
        if entry.holders == 0 {
            let maker = entry.maker;
            self.entries.remove(key);
            self.made[maker.index()] -= 1;
        } else if entry.last_holder == engine {
            entry.last_holder = lowest_holder(entry.holders);
        }
    }

    /// Everything `engine` held is gone (it restarted, or it is no longer followed).
    pub fn forget_engine(&mut self, engine: EngineSlot) {
        if self.per_engine[engine.index()] == 0 {
            return;
        }
        let made = &mut self.made;
        self.entries.retain(|_, e| {
            e.holders &= !engine.bit();
            if e.last_holder == engine && e.holders != 0 {
                e.last_holder = lowest_holder(e.holders);
            }
            if e.holders == 0 {
                made[e.maker.index()] -= 1;
            }
            e.holders != 0
        });
        self.per_engine[engine.index()] = 0;
    }

    /// A pull of `key` from `from` failed: the next engine of its group to announce it offers
    /// it again.
    pub fn pull_failed(&mut self, key: &OffloadKey, from: EngineSlot) {
        if let Some(e) = self.entries.get_mut(key) {
            e.offered &= !self.groups[from.index()];
        }
    }

    /// Engines holding `key`.
    pub fn holders(&self, key: &OffloadKey) -> u32 {
        self.entries.get(key).map_or(0, |e| e.holders.count_ones())
    }

    /// Whether `engine` holds `key`.
    pub fn holds(&self, engine: EngineSlot, key: &OffloadKey) -> bool {
        self.entries
            .get(key)
            .is_some_and(|e| e.holders & engine.bit() != 0)
    }

    /// Keys `engine` holds.
    pub fn count(&self, engine: EngineSlot) -> u64 {
        self.per_engine[engine.index()]
    }

    /// Keys in the index.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keys forgotten to stay within `max_keys`.
    pub fn forgotten(&self) -> u64 {
        self.forgotten
    }

    /// Forgets entries until one more fits: each time the oldest of the engine that made the
    /// most live entries.
    fn make_room(&mut self) {
        while self.entries.len() >= self.max_keys {
            let Some(heaviest) = (0..EngineSlot::MAX)
                .filter(|&i| self.made[i] > 0)
                .max_by_key(|&i| (self.made[i], std::cmp::Reverse(i)))
            else {
                return;
            };
            let Some((generation, key)) = self.order[heaviest].pop_front() else {
                // Its count says it made live entries: never the case.
                return;
            };
            self.queued -= 1;
            let live = self
                .entries
                .get(&key)
                .is_some_and(|e| e.generation == generation);
            if live {
                if let Some(e) = self.entries.remove(&key) {
                    for i in 0..EngineSlot::MAX {
                        if e.holders & (1 << i) != 0 {
                            self.per_engine[i] -= 1;
                        }
                    }
                    self.made[e.maker.index()] -= 1;
                }
                self.forgotten += 1;
            }
        }
        // Stale generations pile up when keys come and go; drop them once they dominate.
        if self.queued > 2 * self.max_keys + 1024 {
            let entries = &self.entries;
            let live =
                |(g, k): &(u64, OffloadKey)| entries.get(k).is_some_and(|e| e.generation == *g);
            for order in &mut self.order {
                order.retain(live);
            }
            self.queued = self.order.iter().map(VecDeque::len).sum();
        }
    }
}

fn lowest_holder(holders: u64) -> EngineSlot {
    // `holders` is not zero: trailing_zeros < 64 fits a slot.
    EngineSlot(holders.trailing_zeros() as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u8) -> OffloadKey {
        OffloadKey::from_parts(&[i; 32], 0)
    }

    fn slot(i: usize) -> EngineSlot {
        EngineSlot::new(i).unwrap_or_else(|| panic!("slot {i}"))
    }

    #[test]
    fn one_holder_is_enough_by_default_and_a_key_is_offered_once() {
        let mut h = Holdings::new(100, Admission::default());
        assert_eq!(
            h.stored(slot(0), key(1)),
            Some(PullCandidate {
                key: key(1),
                from: slot(0)
            })
        );
        assert_eq!(h.stored(slot(1), key(1)), None);
        assert_eq!(h.holders(&key(1)), 2);
        h.pull_failed(&key(1), slot(0));
        assert_eq!(
            h.stored(slot(1), key(1)),
            Some(PullCandidate {
                key: key(1),
                from: slot(1)
            })
        );
    }

    #[test]
    fn each_tenants_group_is_offered_a_key_once_counting_only_its_own_holders() {
        let mut h = Holdings::new(100, Admission { min_holders: 2 });
        // Engines 0 and 1 are tenant alpha's, 2 and 3 beta's, 4 of no tenant.
        h.set_groups(&[vec![slot(0), slot(1)], vec![slot(2), slot(3)]]);
        assert_eq!(h.stored(slot(0), key(1)), None);
        assert_eq!(
            h.stored(slot(2), key(1)),
            None,
            "beta's holder is not alpha's second"
        );
        assert_eq!(h.stored(slot(4), key(1)), None);
        assert_eq!(h.stored(slot(1), key(1)).map(|c| c.from), Some(slot(1)));
        assert_eq!(h.stored(slot(1), key(1)), None, "alpha's offered once");
        assert_eq!(h.stored(slot(3), key(1)).map(|c| c.from), Some(slot(3)));
        // A failed pull is offered again in its own group only.
        h.pull_failed(&key(1), slot(3));
        assert_eq!(h.stored(slot(0), key(1)), None);
        assert_eq!(h.stored(slot(2), key(1)).map(|c| c.from), Some(slot(2)));
        // With one holder enough, the engines of no tenant are a group of their own.
        let mut h = Holdings::new(100, Admission::default());
        h.set_groups(&[vec![slot(0)]]);
        assert!(h.stored(slot(0), key(2)).is_some());
        assert_eq!(h.stored(slot(4), key(2)).map(|c| c.from), Some(slot(4)));
        assert_eq!(h.stored(slot(5), key(2)), None);
    }

    #[test]
    fn shared_only_waits_for_a_second_engine() {
        let mut h = Holdings::new(100, Admission { min_holders: 2 });
        assert_eq!(h.stored(slot(0), key(1)), None);
        assert_eq!(
            h.stored(slot(0), key(1)),
            None,
            "the same engine twice is one holder"
        );
        assert_eq!(h.stored(slot(3), key(1)).map(|c| c.from), Some(slot(3)));
    }

    #[test]
    fn removals_and_restarts_forget_what_is_gone() {
        let mut h = Holdings::new(100, Admission::default());
        h.stored(slot(0), key(1));
        h.stored(slot(1), key(1));
        h.stored(slot(0), key(2));
        h.removed(slot(0), &key(1));
        assert_eq!(h.holders(&key(1)), 1);
        assert!(!h.holds(slot(0), &key(1)));
        h.forget_engine(slot(0));
        assert_eq!(h.count(slot(0)), 0);
        assert_eq!(h.holders(&key(2)), 0);
        assert_eq!(h.len(), 1);
        h.removed(slot(1), &key(1));
        assert!(h.is_empty());
        // Removing what is not there changes nothing.
        h.removed(slot(5), &key(9));
        assert!(h.is_empty());
    }

    #[test]
    fn the_index_stays_within_its_bound_forgetting_the_oldest() {
        let mut h = Holdings::new(3, Admission::default());
        for i in 0..10u8 {
            h.stored(slot(usize::from(i % 2)), key(i));
            assert!(h.len() <= 3);
        }
        assert_eq!(h.forgotten(), 7);
        assert_eq!(h.holders(&key(9)), 1);
        assert_eq!(h.holders(&key(6)), 0);
        assert_eq!(h.count(slot(0)) + h.count(slot(1)), 3);
        // Keys that come and go do not grow the age queue without bound.
        for round in 0..10_000u32 {
            let k = OffloadKey::from_parts(&round.to_be_bytes(), 1);
            h.stored(slot(0), k.clone());
            h.removed(slot(0), &k);
        }
        assert!(h.queued <= 2 * 3 + 1024 + 1);
        assert_eq!(h.queued, h.order.iter().map(VecDeque::len).sum::<usize>());
    }

    /// One engine announcing junk keys by the thousand forgets its own oldest, never the keys
    /// another engine brought in while it holds fewer: those are still offered and held.
    #[test]
    fn a_flooding_engine_forgets_its_own_keys_not_another_engines() {
        let mut h = Holdings::new(100, Admission::default());
        let real: Vec<OffloadKey> = (0..40u8).map(key).collect();
        for k in &real {
            assert!(h.stored(slot(1), k.clone()).is_some());
        }
        for i in 0..100_000u32 {
            let junk = OffloadKey::from_parts(&i.to_be_bytes(), 7);
            h.stored(slot(0), junk);
            assert!(h.len() <= 100);
        }
        assert!(
            real.iter().all(|k| h.holds(slot(1), k)),
            "real keys forgotten"
        );
        assert_eq!((h.count(slot(0)), h.count(slot(1))), (60, 40));
        // A key both hold counts for the one that made it: the flooder's share, not the other's.
        h.stored(slot(0), real[0].clone());
        assert_eq!(h.holders(&real[0]), 2);
        assert_eq!(h.made[0] + h.made[1], h.len());
        // Past an equal share the other engine's oldest go too (the bound holds for all).
        for i in 0..1000u32 {
            h.stored(slot(1), OffloadKey::from_parts(&i.to_be_bytes(), 9));
        }
        assert_eq!(h.len(), 100);
        assert!(h.made[0].abs_diff(h.made[1]) <= 2, "{:?}", &h.made[..2]);
    }

    #[test]
    fn group_kinds_are_learned_and_bounded() {
        let mut h = Holdings::new(10, Admission::default());
        assert!(h.learn_group_kind(0, "full_attention"));
        assert!(!h.learn_group_kind(0, "full_attention"));
        assert!(
            h.learn_group_kind(0, "sliding_window"),
            "a changed kind is news"
        );
        for g in 1..1000 {
            h.learn_group_kind(g, "mamba");
        }
        assert_eq!(h.group_kinds().len(), MAX_GROUP_KINDS);
        assert_eq!(h.group_kinds()[&0], "sliding_window");
    }

    #[test]
    fn slots_stop_at_sixty_four() {
        assert!(EngineSlot::new(63).is_some());
        assert!(EngineSlot::new(64).is_none());
        assert!(EngineSlot::new(1000).is_none());
    }
}
