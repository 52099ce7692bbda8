//! Where a control message came from: the claimed identity held against the TCP source address.
//!
//! A peer's identity (`host:port`) is only what its socket claims: anyone who reaches the control
//! port can claim any identity. The node holds the claim against the address the message
//! actually came from (libzmq's `Peer-Address`), before the allowlist and before the protocol:
//!
//! * **Identity binding** (on by default, `bind_identity`): an identity whose host is an IP
//!   address must come from that address. A message from a loopback address may also claim any
//!   address of this host's own interfaces (a node on this host that dials us at `127.0.0.1`
//!   while its identity is its LAN address). A host-name identity cannot be checked without
//!   resolving it, which the node never does on its event loop: it is accepted only when the
//!   allowlist is empty (vLLM's behaviour) or names it, and docs/security.md says what that
//!   leaves open.
//! * **Allowlist on the source**: with an allowlist, the source address itself must match one of
//!   its IP or network rules (when it has any), as well as the identity matching a rule.
//!
//! Called by the node's I/O loop on its own thread, for every inbound payload; cheap (no
//! allocation, no system call: this host's addresses are read once at start).

use std::net::IpAddr;

use kvpeer_proto::PeerId;

use super::allow::{Allowlist, NotAllowed};

/// Why a message is not heard from where it came, or a data address is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub(crate) enum OriginError {
    /// The claimed identity is not allowed.
    #[error(transparent)]
    NotAllowed(#[from] NotAllowed),
    /// The source address matches no address or network rule of the allowlist.
    #[error("source address {0} is not in the allowlist")]
    SourceNotAllowed(IpAddr),
    /// The identity is not `host:port`.
    #[error("not a host:port identity")]
    NotHostPort,
    /// An IP identity claimed from another address.
    #[error("identity {peer} claimed from another address ({from})")]
    ClaimedElsewhere {
        /// The identity claimed.
        peer: PeerId,
        /// Where the message came from.
        from: IpAddr,
    },
    /// A host-name identity the allowlist does not name: it cannot be bound to its source.
    #[error("host-name identity {peer} cannot be bound to its source ({from})")]
    UnboundHostName {
        /// The identity claimed.
        peer: PeerId,
        /// Where the message came from.
        from: IpAddr,
    },
    /// An advertised data address the allowlist refuses.
    #[error("data address {addr}: {why}")]
    DataNotAllowed {
        /// The address.
        addr: String,
        /// Why the allowlist refuses it.
        why: NotAllowed,
    },
    /// An advertised data address that is not `host:port`.
    #[error("data address {0} is not host:port")]
    DataNotHostPort(String),
    /// An advertised data address on another host than the peer's.
    #[error("data address {addr} is not on the peer's own host ({peer})")]
    DataElsewhere {
        /// The address.
        addr: String,
        /// The peer that advertised it.
        peer: PeerId,
    },
}

/// This host's interface addresses, read once.
#[derive(Debug, Clone, Default)]
pub(crate) struct LocalAddrs(Vec<IpAddr>);

impl LocalAddrs {
    /// The addresses of this host's interfaces now (empty if the system will not say).
    pub(crate) fn read() -> Self {
        let addrs = nix::ifaddrs::getifaddrs()
            .map(|ifs| {
                ifs.filter_map(|i| i.address)
                    .filter_map(|a| {
                        a.as_sockaddr_in()
                            .map(|v4| IpAddr::V4(v4.ip()))
                            .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))
                    })
                    .collect()
            })
            .unwrap_or_default();
        LocalAddrs(addrs)
    }

    /// Exactly these addresses (tests).
    #[cfg(test)]
    pub(crate) fn of(addrs: Vec<IpAddr>) -> Self {
        LocalAddrs(addrs)
    }

    fn contains(&self, ip: IpAddr) -> bool {
        ip.is_loopback() || self.0.contains(&ip)
    }
}

/// The policy: identity binding on or off, the allowlist, this host's addresses.
#[derive(Debug, Clone)]
pub(crate) struct OriginCheck {
    bind_identity: bool,
    allow: Allowlist,
    local: LocalAddrs,
}

impl Default for OriginCheck {
    fn default() -> Self {
        OriginCheck {
            bind_identity: true,
            allow: Allowlist::default(),
            local: LocalAddrs::default(),
        }
    }
}

/// The host part of an identity, without IPv6 brackets, and its IP if it is one.
fn host_of(peer: &PeerId) -> Option<(String, Option<IpAddr>)> {
    let (host, _) = peer.host_port().ok()?;
    let host = host
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_owned();
    let ip = host.parse().ok();
    Some((host, ip))
}

impl OriginCheck {
    /// A policy.
    pub(crate) fn new(bind_identity: bool, allow: Allowlist, local: LocalAddrs) -> Self {
        OriginCheck {
            bind_identity,
            allow,
            local,
        }
    }

    /// The allowlist (for checks of peers we dial, which have no source yet).
    pub(crate) fn allowlist(&self) -> &Allowlist {
        &self.allow
    }

    /// `Ok` if a message claiming `peer` may have come from `source`, else why not.
    pub(crate) fn check(&self, peer: &PeerId, source: IpAddr) -> Result<(), OriginError> {
        self.allow.check(peer)?;
        if !self.allow.allows_source(source) {
            return Err(OriginError::SourceNotAllowed(source));
        }
        if !self.bind_identity {
            return Ok(());
        }
        let Some((host, ip)) = host_of(peer) else {
            return Err(OriginError::NotHostPort);
        };
        match ip {
            Some(ip) if same_ip(ip, source) => Ok(()),
            Some(ip) if source.is_loopback() && self.local.contains(ip) => Ok(()),
            Some(_) => Err(OriginError::ClaimedElsewhere {
                peer: peer.clone(),
                from: source,
            }),
            None if self.allow.allows_all() || self.allow.names_host(&host) => Ok(()),
            None => Err(OriginError::UnboundHostName {
                peer: peer.clone(),
                from: source,
            }),
        }
    }

    /// `Ok` if this node may open a data connection to `addr` (`host:port`) that `peer`
    /// advertised: with an allowlist, the address must be allowed as a peer would be; with
    /// identity binding, an IP-literal data host must be the peer's own host (or, from a peer
    /// of this host, one of this host's addresses), so a peer cannot aim our writer at a third
    /// machine.
    ///
    /// A peer the allowlist names exactly (`host:port`) may advertise a data address on its own
    /// host (the same IP, or the same host name): its data port is not its control port, and
    /// listing one peer must not break its tcp plane. It can aim our writer at no other host.
    pub(crate) fn check_data_addr(&self, peer: &PeerId, addr: &str) -> Result<(), OriginError> {
        let data = PeerId::new(addr);
        if let Err(why) = self.allow.check(&data) {
            let own_host = match (host_of(peer), host_of(&data)) {
                (Some((_, Some(p))), Some((_, Some(d)))) => same_ip(p, d),
                (Some((p, None)), Some((d, None))) => p.eq_ignore_ascii_case(&d),
                _ => false,
            };
            if !(own_host && self.allow.check(peer).is_ok()) {
                return Err(OriginError::DataNotAllowed {
                    addr: addr.to_owned(),
                    why,
                });
            }
        }
        if !self.bind_identity {
            return Ok(());
        }
        let (Some((_, peer_ip)), Some((data_host, data_ip))) = (host_of(peer), host_of(&data))
        else {
            return Err(OriginError::DataNotHostPort(addr.to_owned()));
        };
        match (peer_ip, data_ip) {
            (Some(p), Some(d)) if same_ip(p, d) => Ok(()),
            (Some(p), Some(d)) if self.local.contains(p) && self.local.contains(d) => Ok(()),
            (_, None) if self.allow.allows_all() || self.allow.names_host(&data_host) => Ok(()),
            (None, Some(_)) if self.allow.allows_all() => Ok(()),
            _ => Err(OriginError::DataElsewhere {
                addr: addr.to_owned(),
                peer: peer.clone(),
            }),
        }
    }
}

/// Equal addresses, an IPv4 address also matching its IPv4-mapped IPv6 form.
fn same_ip(a: IpAddr, b: IpAddr) -> bool {
    a.to_canonical() == b.to_canonical()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse()
            .unwrap_or_else(|e| panic!("{s:?} is not an address: {e}"))
    }

    fn check(rules: &[&str], peer: &str, source: &str) -> Result<(), OriginError> {
        let allow = Allowlist::parse(rules).unwrap_or_default();
        let local = LocalAddrs::of(vec!["192.0.2.10".parse().unwrap_or(IpAddr::from([0; 4]))]);
        OriginCheck::new(true, allow, local).check(&PeerId::new(peer), ip(source))
    }

    #[test]
    fn an_ip_identity_must_come_from_its_address() {
        assert_eq!(check(&[], "10.0.0.5:5600", "10.0.0.5"), Ok(()));
        assert_eq!(check(&[], "[::1]:5600", "::1"), Ok(()));
        assert_eq!(check(&[], "10.0.0.5:5600", "::ffff:10.0.0.5"), Ok(()));
        let e = check(&[], "10.0.0.5:5600", "10.0.0.6").unwrap_err();
        assert!(matches!(e, OriginError::ClaimedElsewhere { .. }), "{e}");
        // A remote host cannot claim this host's loopback or its addresses.
        assert!(check(&[], "127.0.0.1:5600", "10.0.0.6").is_err());
        assert!(check(&[], "192.0.2.10:5600", "10.0.0.6").is_err());
        // A local process may claim this host's own addresses from loopback.
        assert_eq!(check(&[], "192.0.2.10:5600", "127.0.0.1"), Ok(()));
        assert!(check(&[], "10.0.0.5:5600", "127.0.0.1").is_err());
    }

    #[test]
    fn the_allowlist_judges_the_source_as_well_as_the_claim() {
        assert_eq!(check(&["10.0.0.0/8"], "10.0.0.5:1", "10.0.0.5"), Ok(()));
        // The claim is allowed, the source is not (with binding off, only the source rule).
        let allow = Allowlist::parse(&["10.0.0.0/8"]).unwrap_or_default();
        let loose = OriginCheck::new(false, allow, LocalAddrs::default());
        let e = loose
            .check(&PeerId::new("10.0.0.5:1"), ip("203.0.113.1"))
            .unwrap_err();
        assert_eq!(e, OriginError::SourceNotAllowed(ip("203.0.113.1")));
        assert_eq!(
            loose.check(&PeerId::new("10.0.0.5:1"), ip("10.9.9.9")),
            Ok(())
        );
        // Host names: only when the list names them (or there is no list).
        assert_eq!(check(&[], "node-a:1", "10.0.0.5"), Ok(()));
        assert_eq!(
            check(&["node-a", "10.0.0.0/8"], "node-a:1", "10.0.0.5"),
            Ok(())
        );
        assert!(check(&["10.0.0.0/8"], "node-a:1", "10.0.0.5").is_err());
    }

    #[test]
    fn data_addresses_stay_on_the_peers_host_and_in_the_list() {
        let local = LocalAddrs::of(vec![]);
        let open = OriginCheck::new(true, Allowlist::default(), local.clone());
        let p = PeerId::new("10.0.0.5:5600");
        assert_eq!(open.check_data_addr(&p, "10.0.0.5:7000"), Ok(()));
        assert!(open.check_data_addr(&p, "10.0.0.6:22").is_err());
        let lo = PeerId::new("127.0.0.1:5600");
        assert_eq!(open.check_data_addr(&lo, "127.0.0.1:7000"), Ok(()));
        assert!(open.check_data_addr(&lo, "10.0.0.6:7000").is_err());
        let listed = OriginCheck::new(
            false,
            Allowlist::parse(&["10.0.0.0/24"]).unwrap_or_default(),
            local,
        );
        assert_eq!(listed.check_data_addr(&p, "10.0.0.6:7000"), Ok(()));
        assert!(listed.check_data_addr(&p, "10.0.1.6:7000").is_err());
    }

    #[test]
    fn a_peer_listed_by_host_and_port_may_advertise_data_on_its_own_host_only() {
        let exact = OriginCheck::new(
            true,
            Allowlist::parse(&["127.0.0.1:5600", "node-b:5600"]).unwrap_or_default(),
            LocalAddrs::of(vec![]),
        );
        let p = PeerId::new("127.0.0.1:5600");
        assert_eq!(exact.check_data_addr(&p, "127.0.0.1:41000"), Ok(()));
        // Not on another host, nor for a peer the list does not name.
        assert!(exact.check_data_addr(&p, "10.0.0.6:41000").is_err());
        let unlisted = PeerId::new("127.0.0.1:5601");
        let e = exact
            .check_data_addr(&unlisted, "127.0.0.1:41000")
            .unwrap_err();
        assert!(matches!(e, OriginError::DataNotAllowed { .. }), "{e}");
        let named = PeerId::new("node-b:5600");
        assert_eq!(exact.check_data_addr(&named, "NODE-B:41000"), Ok(()));
        assert!(exact.check_data_addr(&named, "node-c:41000").is_err());
    }
}
