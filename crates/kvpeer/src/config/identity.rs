//! The node's identity (the address peers dial) and where it listens, from `listen_host`,
//! `listen_port` and `advertise`, made at this edge once: host names resolved here, every
//! address canonical ([`PeerAddr`]).
//!
//! Contract: the identity is never an address no peer can dial. A wildcard listen host
//! (`0.0.0.0`, `::`) listens everywhere and is advertised as `advertise`, else as this host's
//! routable address ([`crate::node::routable::routable`]); `advertise` also serves behind NAT
//! (its own port, or the listen port). A listen host name is resolved to its first IPv4
//! address (else its first); `localhost` is `127.0.0.1`.

use std::net::{IpAddr, SocketAddr};

use kvpeer_proto::{is_peer_ip, Host, PeerAddr, PeerId};

use super::{bad, ConfigError, Values, KEY};
use crate::node::resolve::resolve_host;
use crate::node::routable::routable;

/// Where a node listens and what it calls itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Identity {
    /// The identity (`host:0`: the port bound).
    pub(super) id: PeerId,
    /// Where the listeners bind, when not at the identity.
    pub(super) listen: Option<SocketAddr>,
    /// Where the tcp plane's listener binds (`host:0`).
    pub(super) tcp_listen: String,
}

/// `text` as an address, a host name resolved now (first IPv4, else first).
fn address(text: &str) -> Result<IpAddr, String> {
    match Host::parse(text).map_err(|e| e.to_string())? {
        Host::Ip(ip) => Ok(ip),
        Host::Name(name) => {
            let found = resolve_host(&name);
            found
                .iter()
                .find(|ip| ip.is_ipv4())
                .or(found.first())
                .copied()
                .ok_or_else(|| format!("{text:?} does not resolve"))
        }
    }
}

/// The identity and listen address the settings ask for.
pub(super) fn identity(s: &Values<'_>, port: u16, tcp_port: u16) -> Result<Identity, ConfigError> {
    let host = s.text(&KEY.listen_host);
    let src = |key: &super::Key| s.get(key).map_or("default", |(_, src)| src).to_owned();
    let bind = address(&host).map_err(|e| bad(&src(&KEY.listen_host), "listen_host", e))?;
    let advertised = match s.get(&KEY.advertise) {
        None => None,
        Some((text, from)) => {
            let fail = |why: String| bad(from, KEY.advertise.name, why);
            // A host alone (an IPv6 address too, brackets or not), else HOST:PORT.
            let (host, port) = match Host::parse(text) {
                Ok(_) => (text, None),
                Err(_) => match PeerAddr::parse(text) {
                    Ok(a) => (
                        text.rsplit_once(':').map_or(text, |(h, _)| h),
                        Some(a.port()),
                    ),
                    Err(e) => return Err(fail(e.to_string())),
                },
            };
            let ip = address(host).map_err(&fail)?;
            if !is_peer_ip(ip) {
                return Err(fail(format!(
                    "{ip} is no address a peer can dial (0.0.0.0 and :: mean this host)"
                )));
            }
            Some((ip, port))
        }
    };
    if !bind.is_unspecified() && !is_peer_ip(bind) {
        return Err(bad(
            &src(&KEY.listen_host),
            "listen_host",
            format!("{bind} cannot be listened at"),
        ));
    }
    let id_host = match advertised {
        Some((ip, _)) => ip,
        None if bind.is_unspecified() => routable(bind),
        None => bind,
    };
    let id_port = advertised.and_then(|(_, p)| p).unwrap_or(port);
    let listen = (id_host != bind || id_port != port).then_some(SocketAddr::new(bind, port));
    Ok(Identity {
        id: PeerAddr::new(Host::Ip(id_host), id_port).to_peer_id(),
        listen,
        tcp_listen: SocketAddr::new(bind, tcp_port).to_string(),
    })
}
