//! Host names made addresses, once, at an edge: a command line, a configuration, a node being
//! built. Never called on a node's event loop (it blocks on the system's resolver).
//!
//! Contract: [`resolve_peer`] reads `host:port` as a [`PeerAddr`] first (so every numeric
//! spelling is the address it is and never reaches the resolver), and resolves only a host
//! name, taking the first IPv4 address, else the first (as the control channel's dialer
//! does); an address no peer can have (`0.0.0.0`, `::`, multicast) is refused whichever way
//! it came. What it returns is then judged by the same rules as an address written as one.

use std::net::{IpAddr, ToSocketAddrs};

use kvpeer_proto::{is_peer_ip, AddrError, Host, PeerAddr};

/// Why `host:port` gave no peer address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ResolveError {
    /// Not `host:port` with an address or a host name.
    #[error(transparent)]
    Addr(#[from] AddrError),
    /// The name does not resolve (the resolver's words).
    #[error("cannot resolve {name}: {detail}")]
    Unresolved {
        /// The name.
        name: String,
        /// What the resolver said.
        detail: String,
    },
    /// An address no peer can have (`0.0.0.0`, `::`, multicast), as written or resolved.
    #[error("{0} is no peer's address (0.0.0.0 and :: mean this host, not a peer)")]
    NotAPeerAddress(String),
}

/// Every address `name` resolves to, canonical (IPv4-mapped IPv6 as IPv4), in the resolver's
/// order; empty when it does not resolve.
pub fn resolve_host(name: &str) -> Vec<IpAddr> {
    (name, 0)
        .to_socket_addrs()
        .map(|addrs| addrs.map(|a| a.ip().to_canonical()).collect())
        .unwrap_or_default()
}

/// Whether an identity a node told (`told`, in its READY) is on the host we reached it at
/// (`dialed`): the same address, or, reached on loopback, an address of this host (the rule a
/// node's identity check applies to a claimed identity, docs/security.md G3). A node may call
/// itself by another of its own addresses; it may not send our next dial, and our `connect`,
/// to another machine.
pub fn on_dialed_host(dialed: &PeerAddr, told: &PeerAddr) -> bool {
    match (dialed.ip(), told.ip()) {
        (Some(d), Some(t)) => {
            t == d || (d.is_loopback() && crate::node::origin::LocalAddrs::read().contains(t))
        }
        _ => false,
    }
}

/// `text` (`host:port`) as a peer's address: an address as written (any spelling), or a host
/// name resolved now to its first IPv4 address, else its first.
pub fn resolve_peer(text: &str) -> Result<PeerAddr, ResolveError> {
    let addr = PeerAddr::parse(text)?;
    let addr = match addr.host() {
        Host::Ip(_) => addr,
        Host::Name(name) => {
            let found = (name.as_ref(), addr.port())
                .to_socket_addrs()
                .map_err(|e| ResolveError::Unresolved {
                    name: name.to_string(),
                    detail: e.to_string(),
                })?
                .map(|a| a.ip().to_canonical())
                .filter(|ip| is_peer_ip(*ip))
                .collect::<Vec<_>>();
            let ip = found
                .iter()
                .find(|ip| ip.is_ipv4())
                .or(found.first())
                .copied()
                .ok_or_else(|| ResolveError::Unresolved {
                    name: name.to_string(),
                    detail: "no address a peer can have".into(),
                })?;
            PeerAddr::new(Host::Ip(ip), addr.port())
        }
    };
    if !addr.is_peer_address() {
        return Err(ResolveError::NotAPeerAddress(addr.to_string()));
    }
    Ok(addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_told_identity_is_followed_only_on_the_host_dialed() {
        let a = |t: &str| PeerAddr::parse(t).unwrap();
        assert!(on_dialed_host(&a("10.0.0.5:5600"), &a("10.0.0.5:5601")));
        assert!(on_dialed_host(&a("127.0.0.2:5600"), &a("127.0.0.1:5600")));
        // A node reached at one machine cannot send our next dial to another.
        assert!(!on_dialed_host(&a("10.0.0.5:5600"), &a("10.0.0.6:5600")));
        assert!(!on_dialed_host(&a("10.0.0.5:5600"), &a("127.0.0.1:5600")));
        assert!(!on_dialed_host(&a("127.0.0.1:5600"), &a("192.0.2.1:5600")));
    }

    #[test]
    fn addresses_are_read_as_written_and_localhost_is_loopback() {
        let got = |t: &str| resolve_peer(t).map(|a| a.to_string());
        assert_eq!(got("2130706433:5600"), Ok("127.0.0.1:5600".into()));
        assert_eq!(got("localhost:5600"), Ok("127.0.0.1:5600".into()));
        assert_eq!(got("[::ffff:127.0.0.1]:5600"), Ok("127.0.0.1:5600".into()));
        assert!(matches!(
            resolve_peer("0:5600"),
            Err(ResolveError::NotAPeerAddress(_))
        ));
        assert!(matches!(
            resolve_peer("256.1.1.1:5600"),
            Err(ResolveError::Addr(_))
        ));
    }
}
