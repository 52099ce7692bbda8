//! Running totals of what the core did, for metrics. Counted where messages leave
//! ([`Counters::on_sent`]) and arrive ([`Counters::on_received`]), and at a few events no
//! message shows (load ends, protocol errors, expired pending keys, sessions). Plain integers
//! on the core's thread; the node copies them out for its metrics endpoint.

use kvpeer_proto::Message;

/// Totals since the core started; every field only grows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Consumer: `lookup` messages sent, and the keys in them.
    pub lookups_sent: u64,
    /// Consumer: keys looked up.
    pub lookup_keys_sent: u64,
    /// Consumer: keys a peer answered held.
    pub lookup_hits_received: u64,
    /// Consumer: keys a peer answered not held.
    pub lookup_misses_received: u64,
    /// Producer: lookups answered.
    pub lookups_served: u64,
    /// Producer: keys answered held.
    pub lookup_hits_served: u64,
    /// Producer: keys answered not held.
    pub lookup_misses_served: u64,
    /// Producer: pending keys answered MISS because their deadline passed.
    pub pending_expired: u64,
    /// Consumer: non-terminal `fetch` messages sent, and their blocks.
    pub fetches_sent: u64,
    /// Consumer: blocks asked for.
    pub fetch_blocks_sent: u64,
    /// Producer: non-terminal `fetch` messages received, and their blocks.
    pub fetches_served: u64,
    /// Producer: blocks asked of this node.
    pub fetch_blocks_served: u64,
    /// Producer: rounds reported written (`transfer_done` with success).
    pub transfers_ok: u64,
    /// Producer: rounds reported failed.
    pub transfers_failed: u64,
    /// Consumer: loads that landed completely.
    pub loads_ok: u64,
    /// Consumer: loads that failed or were aborted, counted when the failure is reported (a
    /// load held until its blocks are fenced counts at once, once).
    pub loads_failed: u64,
    /// Consumer: failed loads whose blocks were held until the plane fenced the producer's
    /// writes (it had not confirmed they ended).
    pub loads_fencing: u64,
    /// Consumer: `abort_fetch` messages sent.
    pub aborts_sent: u64,
    /// Consumer: `abort_ack`s that settled an aborted load (same request, same round).
    pub abort_acks: u64,
    /// Consumer: loads ended (failed) before their `fetch` left, which still waited for the
    /// peer's ack: finished, timed out or drained meanwhile (no `abort_fetch` sent).
    pub fetches_retired_unsent: u64,
    /// Producer: writes of ended sessions still running when they ended, whose source blocks
    /// stayed pinned until the plane said they stopped (vLLM 0.34's retained transfers).
    pub transfers_retained: u64,
    /// Producer: of those, the ones released at `retained_hold_cap` while still running.
    pub retained_force_released: u64,
    /// Sessions opened (either side started) and ended.
    pub sessions_opened: u64,
    /// Sessions ended, for any reason.
    pub sessions_closed: u64,
    /// Sessions ended to give their slot to a newcomer (sessions or a host's share full).
    pub sessions_evicted: u64,
    /// Peers disconnected for breaking the protocol.
    pub protocol_errors: u64,
    /// Producer: keys past `max_lookup_keys` of a lookup, answered MISS unasked.
    pub lookup_keys_over_cap: u64,
    /// Producer: keys answered MISS (not pinned) because their peer's pin share was full.
    pub lookup_keys_over_share: u64,
    /// Producer: pinned blocks released early, taken from the heaviest holder because all
    /// peers' pins together reached `max_pinned_blocks`.
    pub pins_evicted: u64,
    /// Producer: lookups answered MISS at once: their peer held its share of keys, bytes or
    /// requests already.
    pub lookups_over_budget: u64,
    /// Producer: fetches failed at once for the same reason.
    pub fetches_over_budget: u64,
    /// Producer: times a peer's lookups waited for a later step (slice done or keys-per-second
    /// budget spent) with keys still to ask.
    pub lookup_slices_deferred: u64,
    /// Producer: keys never asked because their lookup's pending deadline passed first.
    pub lookup_keys_unasked: u64,
}

impl Counters {
    /// A message is leaving.
    pub(crate) fn on_sent(&mut self, message: &Message) {
        match message {
            Message::Lookup(l) => {
                self.lookups_sent += 1;
                self.lookup_keys_sent += l.keys.len() as u64;
            }
            Message::LookupResp(r) => {
                self.lookups_served += 1;
                let hits = r.hits.iter().filter(|h| **h).count() as u64;
                self.lookup_hits_served += hits;
                self.lookup_misses_served += r.hits.len() as u64 - hits;
            }
            Message::Fetch(f) if !f.is_terminal() => {
                self.fetches_sent += 1;
                self.fetch_blocks_sent += f.keys.len() as u64;
            }
            Message::TransferDone(t) if t.success => self.transfers_ok += 1,
            Message::TransferDone(_) => self.transfers_failed += 1,
            Message::AbortFetch(_) => self.aborts_sent += 1,
            _ => {}
        }
    }

    /// A valid message arrived.
    pub(crate) fn on_received(&mut self, message: &Message) {
        match message {
            Message::LookupResp(r) => {
                let hits = r.hits.iter().filter(|h| **h).count() as u64;
                self.lookup_hits_received += hits;
                self.lookup_misses_received += r.hits.len() as u64 - hits;
            }
            Message::Fetch(f) if !f.is_terminal() => {
                self.fetches_served += 1;
                self.fetch_blocks_served += f.keys.len() as u64;
            }
            _ => {}
        }
    }
}
