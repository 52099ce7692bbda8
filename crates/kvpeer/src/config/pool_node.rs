//! The pool node's settings (`follow`, `pull_*`, `publish_*`; docs/pool.md), parsed from the
//! configuration keys' text.

use std::net::{SocketAddr, ToSocketAddrs};

use kvpeer_net::events::SubEndpoint;
use kvpeer_proto::PeerId;

/// One followed engine: its KV event stream and the P2P peer the pool pulls from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FollowSpec {
    /// The engine's PUB (connect), or where the engine's PUB connects (bind).
    pub events: SubEndpoint,
    /// The engine's replay ROUTER, if it has one.
    pub replay: Option<SocketAddr>,
    /// The engine's P2P identity (`host:port` of its side channel).
    pub peer: PeerId,
}

/// What the pool node does; off (the default) when it follows nothing and publishes nothing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// The engines followed.
    pub follow: Vec<FollowSpec>,
    /// Engines that must hold a key before it is pulled.
    pub min_holders: u32,
    /// Pulled bytes per second, all engines together (`None`: uncapped).
    pub max_rate: Option<u64>,
    /// Lookups per second to each followed engine.
    pub max_lookups: u64,
    /// Where the PUB of the node's own events binds.
    pub publish: Option<SocketAddr>,
    /// Where the ROUTER answering replays of them binds.
    pub publish_replay: Option<SocketAddr>,
    /// The topic of the node's events.
    pub topic: String,
    /// How the node's events write block hashes.
    pub hash_form: kvpeer_pool::HashForm,
    /// The `ownership` the node's events say (`None`: left out).
    pub ownership: Option<String>,
    /// The P2P identities of every pool node splitting the key space, this one included:
    /// it then pulls only the prefixes whose root chunk rendezvous-hashes to itself
    /// (`kvpeer_pool::shard`). Empty: it pulls everything it admits.
    pub shard: Vec<PeerId>,
    /// Subscribers of the node's events at once.
    pub max_event_subscribers: usize,
    /// Replay clients of the node's events at once.
    pub max_event_replay_clients: usize,
    /// Event connections at once from one source address, per socket.
    pub max_event_per_source: usize,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            follow: Vec::new(),
            min_holders: 1,
            max_rate: None,
            max_lookups: 50,
            publish: None,
            publish_replay: None,
            topic: String::new(),
            hash_form: kvpeer_pool::HashForm::Bytes,
            ownership: None,
            shard: Vec::new(),
            max_event_subscribers: 64,
            max_event_replay_clients: 16,
            max_event_per_source: 16,
        }
    }
}

impl PoolConfig {
    /// Whether there is anything for a pool thread to do.
    pub fn enabled(&self) -> bool {
        !self.follow.is_empty() || self.publish.is_some()
    }
}

/// `EVENTS=PEER`, `EVENTS,REPLAY=PEER`, `bind:EVENTS=PEER`, several separated by `;` or
/// newlines.
pub(crate) fn parse_follow(text: &str) -> Result<Vec<FollowSpec>, String> {
    text.split([';', '\n'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(parse_one)
        .collect()
}

fn parse_one(text: &str) -> Result<FollowSpec, String> {
    let (streams, peer) = text
        .rsplit_once('=')
        .ok_or_else(|| format!("{text:?} is not EVENTS=PEER"))?;
    let peer = PeerId::new(peer.trim());
    if peer.host_port().is_err() {
        return Err(format!(
            "{text:?}: {:?} is not the peer's HOST:PORT",
            peer.as_str()
        ));
    }
    let (events, replay) = match streams.split_once(',') {
        Some((e, r)) => (e.trim(), Some(r.trim())),
        None => (streams.trim(), None),
    };
    let events = match events.strip_prefix("bind:") {
        Some(addr) => SubEndpoint::Bind(endpoint(addr, true)?),
        None => SubEndpoint::Connect(endpoint(events, false)?),
    };
    let replay = replay.map(|r| endpoint(r, false)).transpose()?;
    Ok(FollowSpec {
        events,
        replay,
        peer,
    })
}

/// `tcp://HOST:PORT` (ZeroMQ's form; `*` is every address, for a socket that binds).
pub(crate) fn endpoint(text: &str, bind: bool) -> Result<SocketAddr, String> {
    let addr = text
        .trim()
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("{text:?} is not tcp://HOST:PORT"))?;
    let addr = match addr.strip_prefix("*:") {
        Some(port) if bind => format!("0.0.0.0:{port}"),
        Some(_) => return Err(format!("{text:?}: `*` is only for an address to bind")),
        None => addr.to_owned(),
    };
    addr.to_socket_addrs()
        .map_err(|e| format!("{text:?}: {e}"))?
        .next()
        .ok_or_else(|| format!("{text:?} names no address"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn follow_entries_parse_in_every_form() {
        let f = parse_follow(
            "tcp://127.0.0.1:5557=127.0.0.1:5710; tcp://127.0.0.1:6557,tcp://127.0.0.1:6558=h:1\n\
             bind:tcp://*:7557=127.0.0.1:7710",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(f.len(), 3);
        assert_eq!(
            f[0].events,
            SubEndpoint::Connect(SocketAddr::from(([127, 0, 0, 1], 5557)))
        );
        assert_eq!(f[0].replay, None);
        assert_eq!(f[0].peer, PeerId::new("127.0.0.1:5710"));
        assert_eq!(f[1].replay, Some(SocketAddr::from(([127, 0, 0, 1], 6558))));
        assert_eq!(
            f[2].events,
            SubEndpoint::Bind(SocketAddr::from(([0, 0, 0, 0], 7557)))
        );
    }

    #[test]
    fn bad_entries_say_what_is_wrong() {
        for bad in [
            "tcp://127.0.0.1:5557",
            "tcp://127.0.0.1:5557=nohost",
            "udp://127.0.0.1:5557=h:1",
            "tcp://*:5557=h:1",
            "tcp://127.0.0.1:notaport=h:1",
        ] {
            assert!(parse_follow(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_follow(" ; ").map(|f| f.len()), Ok(0));
    }
}
