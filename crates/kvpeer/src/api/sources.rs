//! [`Sources`]: where a consumer looks for a request's blocks when no router (or not only a
//! router) named a producer, and [`Node::pull`]: one request's blocks from several sources.
//!
//! Contract. A fleet's pool nodes split the prefixes among themselves by rendezvous hashing of
//! each prefix's root chunk (`kvpeer_pool::shard`, the pools' `--shard` list). A consumer that
//! lists the same pool nodes, in any order and in any spelling of their addresses (each is hashed
//! in its canonical form, `kvpeer_pool::shard::canonical`), finds the pool that
//! owns a prefix with no coordinator and no extra round trip. A request asks in stages
//! ([`Sources::stages`]): the router's hint first, if there is one; then, for the keys the hint
//! does not hold, the pool that owns the prefix, or every pool at once when the request's root
//! chunk is not known. Each key loads from the source that said it holds it, so one request may
//! pull from several sources, in parallel.
//!
//! A source that cannot be reached, refuses us or does not answer in time holds nothing for
//! this request: the keys fall back to the next stage or to local compute within one lookup
//! timeout (the node's `lookup_timeout`); nothing is served wrong, since every block lands
//! through the same checked fetch as a single-producer request's. [`Node::pull`] blocks the
//! calling thread (it is the [`NodeRequest`](crate::NodeRequest) calls, a stage's sources asked
//! from scoped threads); the vLLM tier does the same thing without blocking
//! (`python/kvpeer/vllm`).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use kvpeer_core::LookupResult;
use kvpeer_proto::{OffloadKey, PeerId};

use super::{Node, NodeError};

/// The pool nodes (and peers) a consumer asks: the same list as the pools' `--shard` (an
/// address in any spelling is the same member).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources {
    pools: Vec<PeerId>,
}

impl Sources {
    /// The pool nodes that split the prefixes (one pool: it owns every prefix).
    pub fn new(pools: impl IntoIterator<Item = PeerId>) -> Self {
        Sources {
            pools: pools.into_iter().collect(),
        }
    }

    /// The pool nodes, as given.
    pub fn pools(&self) -> &[PeerId] {
        &self.pools
    }

    /// The pool that owns the prefix whose root chunk's key is `root` (`None`: no pools).
    pub fn owner(&self, root: &OffloadKey) -> Option<&PeerId> {
        let names: Vec<&str> = self.pools.iter().map(PeerId::as_str).collect();
        kvpeer_pool::shard::owner(&names, root).map(|i| &self.pools[i])
    }

    /// Whom a request asks, stage by stage: the keys a stage's sources all miss go to the next
    /// stage. The hint alone first (if any); then the owner of `root`, or every pool when the
    /// root is not known (one round trip still, to each pool). A pool that is the hint is not
    /// asked twice.
    pub fn stages(&self, hint: Option<&PeerId>, root: Option<&OffloadKey>) -> Vec<Vec<PeerId>> {
        let mut stages = Vec::new();
        if let Some(hint) = hint {
            stages.push(vec![hint.clone()]);
        }
        let pools: Vec<PeerId> = match root.and_then(|r| self.owner(r)) {
            Some(owner) => vec![owner.clone()],
            None => self.pools.clone(),
        };
        // The hint is not asked twice, however either spells the pool's address.
        let hinted = hint.map(|h| kvpeer_pool::shard::canonical(h.as_str()));
        let pools: Vec<PeerId> = pools
            .into_iter()
            .filter(|p| Some(kvpeer_pool::shard::canonical(p.as_str())) != hinted)
            .collect();
        if !pools.is_empty() {
            stages.push(pools);
        }
        stages
    }
}

/// One request for [`Node::pull`].
#[derive(Debug, Clone)]
pub struct Pull {
    /// Names the request at the pools (each pool's request is `id@pool`).
    pub id: String,
    /// The router's hint: a producer and the `kv_request_id` it knows the request by.
    pub hint: Option<(PeerId, String)>,
    /// The key of the prefix's root chunk (its first), when the caller knows it: then one pool
    /// is asked, else all.
    pub root: Option<OffloadKey>,
}

/// What [`Node::pull`] found and fetched.
#[derive(Debug, Default)]
#[non_exhaustive]
pub struct Pulled {
    /// Per key asked, in order: the source that said it holds it.
    pub holders: Vec<Option<PeerId>>,
    /// The leading keys that landed (readable with [`Node::read`]): a prefix is of use only up
    /// to its first gap, so keys after a miss are not fetched.
    pub fetched: usize,
    /// How long the lookups took (all stages).
    pub lookup: Duration,
    /// Sources that failed this request (unreachable, refused, timed out, a failed fetch), with
    /// why: their keys counted as misses or did not land.
    pub failures: Vec<(PeerId, NodeError)>,
}

impl Pulled {
    /// How many keys were fetched from `source`.
    pub fn fetched_from(&self, source: &PeerId) -> usize {
        self.holders[..self.fetched]
            .iter()
            .filter(|h| h.as_ref() == Some(source))
            .count()
    }
}

impl Node {
    /// Finds `keys` (one prefix's chunks, in order) at `sources` as [`Sources::stages`] says,
    /// then fetches the leading run of found keys, each from the source that holds it, every
    /// source in parallel. Waits at most the node's `lookup_timeout` per stage and its
    /// `load_timeout` for the fetches. Sources that fail are reported in
    /// [`Pulled::failures`], not as an error: the caller computes what did not land. Errors
    /// only when this node is shut down.
    pub fn pull(
        &self,
        sources: &Sources,
        pull: &Pull,
        keys: &[OffloadKey],
    ) -> Result<Pulled, NodeError> {
        let (lookup_timeout, load_timeout) = {
            let core = &self.config().core;
            (core.lookup_timeout, core.load_timeout)
        };
        let hint = pull.hint.as_ref().map(|(peer, _)| peer);
        let mut pulled = Pulled {
            holders: vec![None; keys.len()],
            ..Pulled::default()
        };
        // One request per source this pull asks; kept open until the fetches are done.
        let mut requests = BTreeMap::new();
        let started = Instant::now();
        for stage in sources.stages(hint, pull.root.as_ref()) {
            let wanted: Vec<usize> = (0..keys.len())
                .filter(|&i| pulled.holders[i].is_none())
                .collect();
            if wanted.is_empty() {
                break;
            }
            let asked: Vec<OffloadKey> = wanted.iter().map(|&i| keys[i].clone()).collect();
            for peer in &stage {
                let id = match &pull.hint {
                    Some((hint, id)) if hint == peer => id.clone(),
                    _ => format!("{}@{peer}", pull.id),
                };
                requests.insert(peer.clone(), self.request(peer, &id)?);
            }
            // The session first, so that a source that is gone or refuses us says why (a
            // lookup of a lost session answers all-miss).
            let ask = |peer: &PeerId| {
                let deadline = Instant::now() + lookup_timeout;
                self.connect(peer, lookup_timeout)?;
                let left = deadline.saturating_duration_since(Instant::now());
                requests[peer].lookup(&asked, left)
            };
            let answers: Vec<(PeerId, Result<Vec<LookupResult>, NodeError>)> = match &stage[..] {
                // One source (the common case): no thread.
                [peer] => vec![(peer.clone(), ask(peer))],
                _ => std::thread::scope(|s| {
                    let running: Vec<_> = stage
                        .iter()
                        .map(|peer| (peer.clone(), s.spawn(|| ask(peer))))
                        .collect();
                    running
                        .into_iter()
                        .map(|(peer, t)| (peer, t.join().unwrap_or(Err(NodeError::ShutDown))))
                        .collect()
                }),
            };
            for (peer, answer) in answers {
                match answer {
                    Ok(results) => {
                        for (&i, result) in wanted.iter().zip(results) {
                            if result == LookupResult::Hit && pulled.holders[i].is_none() {
                                pulled.holders[i] = Some(peer.clone());
                            }
                        }
                    }
                    Err(NodeError::ShutDown) => return Err(NodeError::ShutDown),
                    Err(e) => pulled.failures.push((peer, e)),
                }
            }
        }
        pulled.lookup = started.elapsed();
        let leading = pulled.holders.iter().take_while(|h| h.is_some()).count();
        let mut by_source: BTreeMap<&PeerId, Vec<OffloadKey>> = BTreeMap::new();
        for (key, holder) in keys.iter().zip(&pulled.holders).take(leading) {
            if let Some(holder) = holder {
                by_source.entry(holder).or_default().push(key.clone());
            }
        }
        let fetch = |peer: &PeerId, want: &[OffloadKey]| requests[peer].fetch(want, load_timeout);
        let fetched: Vec<(PeerId, Result<(), NodeError>)> = if by_source.len() == 1 {
            by_source
                .iter()
                .map(|(peer, want)| ((*peer).clone(), fetch(peer, want)))
                .collect()
        } else {
            std::thread::scope(|s| {
                let running: Vec<_> = by_source
                    .iter()
                    .map(|(peer, want)| ((*peer).clone(), s.spawn(|| fetch(peer, want))))
                    .collect();
                running
                    .into_iter()
                    .map(|(peer, t)| (peer, t.join().unwrap_or(Err(NodeError::ShutDown))))
                    .collect()
            })
        };
        let mut landed = leading;
        for (peer, result) in fetched {
            if let Err(e) = result {
                // The prefix stops at this source's first key: what follows is of no use.
                if let Some(first) = pulled
                    .holders
                    .iter()
                    .position(|h| h.as_ref() == Some(&peer))
                {
                    landed = landed.min(first);
                }
                if matches!(e, NodeError::ShutDown) {
                    return Err(e);
                }
                pulled.failures.push((peer, e));
            }
        }
        pulled.fetched = landed;
        Ok(pulled)
    }
}
