//! Large inbound payloads decoded a slice at a time, and what their connections sent after
//! them, held in order.
//!
//! A lookup of 131,072 keys takes about 3 ms to decode (release build); decoded in one go it
//! holds the node's one thread that long, and an honest peer's message that arrives meanwhile
//! waits for all of it. [`NodeIo`](super::io::NodeIo) hands a payload of
//! [`EXPENSIVE_PAYLOAD`] bytes or more to [`Decodes`] instead: each of its steps decodes at
//! most [`SLICE_ITEMS`] msgpack items of one connection's payload, connections taking turns
//! host by host (so many connections or many large messages buy a host no more turns than
//! one), and the node serves everyone else between two steps. What the connection sends
//! after the payload (its next messages, its close, its peer's loss) waits behind it here, so
//! the core sees each connection's messages in the order they came; the connection is paused
//! meanwhile (`ControlChannel::pause_inbound`), so what waits here is at most what one round
//! delivered, the rest waiting in its socket.
//!
//! Plain data, owned by `NodeIo` on the node's thread; nothing here blocks or does I/O.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;

use kvpeer_net::control::{ChannelEvent, ConnId};
use kvpeer_proto::{DecodeError, DecodeLimits, Message, PeerId, SlicedDecode};

/// An inbound payload this large (a lookup of about 1,800 keys and more) is decoded a slice
/// at a time.
pub(crate) const EXPENSIVE_PAYLOAD: usize = 64 << 10;

/// Msgpack items one step decodes: p50 52 µs, p99 191 µs of the node's thread for a
/// 131,072-key lookup (release build, docs/benchmarks.md).
pub(crate) const SLICE_ITEMS: usize = 2048;

/// One connection's payload in decoding, and what came after it.
#[derive(Debug)]
struct Backlog {
    peer: PeerId,
    source: IpAddr,
    /// The payload being decoded (none between the end of one and the start of the next).
    decoding: Option<SlicedDecode>,
    /// What the connection delivered after it, in order.
    after: VecDeque<ChannelEvent>,
    /// The bytes it holds (the payload in decoding, what was decoded of it, the payloads held
    /// after it), as last counted into [`Decodes::held_bytes`].
    bytes: usize,
}

impl Backlog {
    fn bytes_now(&self) -> usize {
        let decoding = self.decoding.as_ref().map_or(0, SlicedDecode::held_bytes);
        let after: usize = self
            .after
            .iter()
            .map(|event| match event {
                ChannelEvent::Payload { payload, .. } => payload.capacity(),
                _ => 0,
            })
            .sum();
        decoding.saturating_add(after)
    }
}

/// A payload whose decoding ended: for the caller to handle as if it had decoded it whole.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub(crate) conn: ConnId,
    pub(crate) peer: PeerId,
    pub(crate) source: IpAddr,
    pub(crate) result: Result<Message, DecodeError>,
}

/// The connections with a payload in decoding, hosts in turn.
#[derive(Debug, Default)]
pub(crate) struct Decodes {
    backlogs: HashMap<ConnId, Backlog>,
    /// Hosts with a payload in decoding, the next to have a step first.
    hosts: VecDeque<IpAddr>,
    /// Each such host's connections with a payload in decoding, the next first.
    turns: HashMap<IpAddr, VecDeque<ConnId>>,
    /// What all backlogs hold together (the sum of their `bytes`).
    held_bytes: usize,
}

impl Decodes {
    /// Whether nothing is being decoded or held.
    pub(crate) fn is_empty(&self) -> bool {
        self.backlogs.is_empty()
    }

    /// How many connections have a payload in decoding or events held behind one.
    pub(crate) fn connections(&self) -> usize {
        self.backlogs.len()
    }

    /// Bytes all backlogs hold together.
    pub(crate) fn held_bytes(&self) -> usize {
        self.held_bytes
    }

    /// While all backlogs together hold more than `cap`: of the host whose backlogs hold the
    /// most, the connection holding the most (the caller drops it and closes the connection,
    /// as the listener does with the one buffering the most). By host first, so a host's many
    /// connections cannot make another host's one large message the heaviest.
    pub(crate) fn over(&self, cap: usize) -> Option<ConnId> {
        if self.held_bytes <= cap {
            return None;
        }
        let mut by_host: HashMap<IpAddr, usize> = HashMap::new();
        for backlog in self.backlogs.values() {
            *by_host.entry(backlog.source).or_default() += backlog.bytes;
        }
        let (host, _) = by_host
            .into_iter()
            .max_by_key(|(host, bytes)| (*bytes, std::cmp::Reverse(*host)))?;
        self.backlogs
            .iter()
            .filter(|(_, b)| b.source == host)
            .max_by_key(|(conn, b)| (b.bytes, std::cmp::Reverse(**conn)))
            .map(|(conn, _)| *conn)
    }

    /// Counts connection `conn`'s backlog again into the total.
    fn recount(&mut self, conn: ConnId) {
        if let Some(backlog) = self.backlogs.get_mut(&conn) {
            let now = backlog.bytes_now();
            self.held_bytes = self
                .held_bytes
                .saturating_sub(backlog.bytes)
                .saturating_add(now);
            backlog.bytes = now;
        }
    }

    /// Keeps `event` behind the backlog of its connection, if it has one (`None`); else gives
    /// it back. A peer's loss waits behind the backlog of `bound`, the connection that speaks
    /// for it.
    pub(crate) fn hold(
        &mut self,
        event: ChannelEvent,
        bound: impl Fn(&PeerId) -> Option<ConnId>,
    ) -> Option<ChannelEvent> {
        let conn = match &event {
            ChannelEvent::Payload { conn, .. } | ChannelEvent::InboundClosed { conn, .. } => {
                Some(*conn)
            }
            ChannelEvent::Lost { peer, .. } => bound(peer),
        };
        match conn.filter(|conn| self.backlogs.contains_key(conn)) {
            Some(conn) => {
                if let Some(backlog) = self.backlogs.get_mut(&conn) {
                    backlog.after.push_back(event);
                }
                self.recount(conn);
                None
            }
            None => Some(event),
        }
    }

    /// Starts decoding `payload` of connection `conn` (behind nothing: a connection with a
    /// backlog starts its next payload only once [`Decodes::next_held`] handed it over).
    /// Whether the connection had no backlog before (the caller pauses it).
    pub(crate) fn start(
        &mut self,
        conn: ConnId,
        peer: PeerId,
        source: IpAddr,
        payload: Vec<u8>,
        limits: DecodeLimits,
    ) -> bool {
        let decoding = Some(SlicedDecode::new(payload, limits));
        let new = match self.backlogs.get_mut(&conn) {
            Some(backlog) => {
                backlog.peer = peer;
                backlog.source = source;
                backlog.decoding = decoding;
                false
            }
            None => {
                self.backlogs.insert(
                    conn,
                    Backlog {
                        peer,
                        source,
                        decoding,
                        after: VecDeque::new(),
                        bytes: 0,
                    },
                );
                true
            }
        };
        self.recount(conn);
        // A host whose earlier payload ended may still be in the turns: it keeps its place
        // (once there, never twice).
        if !self.hosts.contains(&source) {
            self.hosts.push_back(source);
        }
        let turns = self.turns.entry(source).or_default();
        if !turns.contains(&conn) {
            turns.push_back(conn);
        }
        new
    }

    /// The connection whose payload has the next step (hosts in turn, a host's connections in
    /// turn), moved to the back of the turns.
    pub(crate) fn next_turn(&mut self) -> Option<ConnId> {
        while let Some(host) = self.hosts.pop_front() {
            let Some(turns) = self.turns.get_mut(&host) else {
                continue;
            };
            while let Some(conn) = turns.pop_front() {
                let decoding = self
                    .backlogs
                    .get(&conn)
                    .is_some_and(|b| b.decoding.is_some());
                if decoding {
                    turns.push_back(conn);
                    self.hosts.push_back(host);
                    return Some(conn);
                }
            }
            self.turns.remove(&host);
        }
        None
    }

    /// One step of connection `conn`'s payload: the payload and its result once decoding
    /// ended (its connection then takes no turns until a next payload starts).
    pub(crate) fn step(&mut self, conn: ConnId) -> Option<Decoded> {
        let backlog = self.backlogs.get_mut(&conn)?;
        let Some(result) = backlog.decoding.as_mut()?.step(SLICE_ITEMS) else {
            // What this step decoded is held until the message is whole.
            self.recount(conn);
            return None;
        };
        backlog.decoding = None;
        if let Some(turns) = self.turns.get_mut(&backlog.source) {
            turns.retain(|c| *c != conn);
        }
        let decoded = Decoded {
            conn,
            peer: backlog.peer.clone(),
            source: backlog.source,
            result,
        };
        self.recount(conn);
        Some(decoded)
    }

    /// The next event held behind connection `conn`'s payload, once that is decoded and
    /// handled. `None` when a next payload is in decoding, or when nothing is left (the
    /// backlog is gone then: the caller resumes the connection, `true` the second value).
    pub(crate) fn next_held(&mut self, conn: ConnId) -> (Option<ChannelEvent>, bool) {
        let Some(backlog) = self.backlogs.get_mut(&conn) else {
            return (None, false);
        };
        if backlog.decoding.is_some() {
            return (None, false);
        }
        match backlog.after.pop_front() {
            Some(event) => {
                self.recount(conn);
                (Some(event), false)
            }
            None => {
                // Nothing is left behind it, so nothing to give back.
                drop(self.forget(conn));
                (None, true)
            }
        }
    }

    /// Drops connection `conn`'s backlog (the node closed it: nothing it sent is handled),
    /// and gives back the peer losses held behind it, which the caller must still handle.
    #[must_use]
    pub(crate) fn forget(&mut self, conn: ConnId) -> Vec<ChannelEvent> {
        let Some(backlog) = self.backlogs.remove(&conn) else {
            return Vec::new();
        };
        self.held_bytes = self.held_bytes.saturating_sub(backlog.bytes);
        if let Some(turns) = self.turns.get_mut(&backlog.source) {
            turns.retain(|c| *c != conn);
        }
        backlog
            .after
            .into_iter()
            .filter(|event| matches!(event, ChannelEvent::Lost { .. }))
            .collect()
    }

    /// Drops every backlog (the node shuts down): the connections they paused.
    pub(crate) fn forget_all(&mut self) -> Vec<ConnId> {
        let conns: Vec<ConnId> = self.backlogs.keys().copied().collect();
        self.backlogs.clear();
        self.hosts.clear();
        self.turns.clear();
        self.held_bytes = 0;
        conns
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvpeer_proto::{KvRequestId, Lookup, OffloadKey, RoundSeq};

    fn lookup(keys: u32) -> (Message, Vec<u8>) {
        let m = Message::Lookup(Lookup {
            kv_request_id: KvRequestId::from("r"),
            keys: (0..keys)
                .map(|i| OffloadKey::from_parts(&[7; 32], i))
                .collect(),
            round_seq: RoundSeq(1),
        });
        let bytes = m.encode().unwrap_or_default();
        (m, bytes)
    }

    fn peer(host: IpAddr) -> PeerId {
        PeerId::new(format!("{host}:5000"))
    }

    fn payload(conn: ConnId, host: IpAddr, bytes: &[u8]) -> ChannelEvent {
        ChannelEvent::Payload {
            peer: peer(host),
            conn,
            source: host,
            payload: bytes.to_vec(),
        }
    }

    #[test]
    fn a_payload_is_decoded_in_steps_and_what_came_after_waits_behind_it() {
        let host: IpAddr = [127, 0, 0, 2].into();
        let (message, bytes) = lookup(10_000);
        let mut d = Decodes::default();
        assert!(d.start(1, peer(host), host, bytes.clone(), DecodeLimits::default()));
        let small = payload(1, host, b"next");
        assert!(d.hold(small.clone(), |_| None).is_none(), "held behind");
        let closed = ChannelEvent::InboundClosed {
            conn: 1,
            peer: Some(peer(host)),
        };
        assert!(d.hold(closed.clone(), |_| None).is_none());
        let other = payload(2, host, b"other");
        assert_eq!(d.hold(other.clone(), |_| None), Some(other), "not held");
        let mut steps = 0;
        let decoded = loop {
            let conn = d.next_turn().unwrap();
            assert_eq!(conn, 1);
            steps += 1;
            if let Some(decoded) = d.step(conn) {
                break decoded;
            }
            assert_eq!(d.next_held(1), (None, false), "nothing before the payload");
        };
        // 10,003 items walked and 10,000 keys read, 2,048 a step.
        assert_eq!(steps, 20_003usize.div_ceil(SLICE_ITEMS));
        assert_eq!(decoded.result, Ok(message));
        assert_eq!(d.next_turn(), None, "decoded: no more turns");
        assert_eq!(d.next_held(1), (Some(small), false));
        assert_eq!(d.next_held(1), (Some(closed), false));
        assert_eq!(d.next_held(1), (None, true), "done: resume");
        assert!(d.is_empty());
    }

    #[test]
    fn hosts_take_turns_however_many_connections_each_decodes_for() {
        let (flood, honest): (IpAddr, IpAddr) = ([127, 0, 0, 2].into(), [127, 0, 0, 3].into());
        let (_, bytes) = lookup(20_000);
        let mut d = Decodes::default();
        for conn in 1..=4 {
            d.start(
                conn,
                peer(flood),
                flood,
                bytes.clone(),
                DecodeLimits::default(),
            );
        }
        d.start(9, peer(honest), honest, bytes, DecodeLimits::default());
        let turns: Vec<ConnId> = (0..8).filter_map(|_| d.next_turn()).collect();
        assert_eq!(turns, [1, 9, 2, 9, 3, 9, 4, 9]);
    }

    #[test]
    fn the_backlog_holding_the_most_is_named_once_all_hold_more_than_the_cap() {
        let host: IpAddr = [127, 0, 0, 2].into();
        let (_, small) = lookup(2_000);
        let (_, large) = lookup(20_000);
        let mut d = Decodes::default();
        d.start(1, peer(host), host, small.clone(), DecodeLimits::default());
        d.start(2, peer(host), host, large.clone(), DecodeLimits::default());
        let payloads = 2 * (small.len() + large.len()); // clones: capacity = length
        assert_eq!(
            d.held_bytes(),
            payloads,
            "the payloads (twice: spilled keys)"
        );
        assert_eq!(d.over(payloads), None);
        assert_eq!(d.over(payloads - 1), Some(2));
        // Decoding grows what it holds, step by step, with the keys read.
        let mut grew = false;
        while d.step(2).is_none() {
            grew |= d.held_bytes() > payloads;
        }
        assert!(grew, "the keys read are counted");
        // Decoded and handed over: only the first payload is held.
        assert_eq!(d.held_bytes(), 2 * small.len());
        let next = large.clone();
        assert!(d.hold(payload(1, host, &next), |_| None).is_none());
        assert_eq!(d.held_bytes(), 2 * small.len() + next.len());
        assert!(d.forget(1).is_empty());
        assert_eq!(d.held_bytes(), 0);
    }

    #[test]
    fn the_heaviest_host_gives_up_a_connection_before_a_lighter_host_its_one_large_message() {
        let (flood, honest): (IpAddr, IpAddr) = ([127, 0, 0, 2].into(), [127, 0, 0, 3].into());
        let (_, small) = lookup(2_000);
        let (_, large) = lookup(6_000);
        let mut d = Decodes::default();
        d.start(
            9,
            peer(honest),
            honest,
            large.clone(),
            DecodeLimits::default(),
        );
        for conn in 1..=4 {
            d.start(
                conn,
                peer(flood),
                flood,
                small.clone(),
                DecodeLimits::default(),
            );
        }
        // The honest connection holds the most of any one; the flood's host more in all.
        assert!(large.len() > small.len() && 4 * small.len() > large.len());
        assert_eq!(d.over(d.held_bytes() - 1), Some(1));
    }

    #[test]
    fn a_host_that_starts_its_next_payload_gets_no_second_place_in_the_turns() {
        let (a, b): (IpAddr, IpAddr) = ([127, 0, 0, 2].into(), [127, 0, 0, 3].into());
        let (_, small) = lookup(100);
        let (_, large) = lookup(20_000);
        let mut d = Decodes::default();
        d.start(1, peer(a), a, small, DecodeLimits::default());
        d.start(2, peer(b), b, large.clone(), DecodeLimits::default());
        assert_eq!(d.next_turn(), Some(1));
        assert!(
            d.step(1).is_some(),
            "a's first payload is decoded in one step"
        );
        d.start(1, peer(a), a, large, DecodeLimits::default());
        let turns: Vec<ConnId> = (0..6).filter_map(|_| d.next_turn()).collect();
        assert_eq!(turns, [2, 1, 2, 1, 2, 1]);
    }

    #[test]
    fn a_peers_loss_waits_behind_the_backlog_of_the_connection_that_speaks_for_it() {
        let host: IpAddr = [127, 0, 0, 2].into();
        let (_, bytes) = lookup(5_000);
        let mut d = Decodes::default();
        d.start(3, peer(host), host, bytes, DecodeLimits::default());
        let lost = ChannelEvent::Lost {
            peer: peer(host),
            cause: kvpeer_core::LinkLoss::ClosedByPeer,
        };
        assert!(d.hold(lost.clone(), |_| Some(3)).is_none());
        assert_eq!(d.hold(lost.clone(), |_| None), Some(lost.clone()));
        assert!(d.hold(payload(3, host, b"dropped"), |_| None).is_none());
        // The node closes the connection: what it sent is dropped, the peer's loss is not.
        assert_eq!(d.forget(3), vec![lost]);
        assert!(d.is_empty());
        assert_eq!(d.held_bytes(), 0);
        assert_eq!(d.next_turn(), None);
        assert_eq!(d.next_held(3), (None, false));
    }
}
