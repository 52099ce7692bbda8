//! Where a control message came from: the claimed identity held against the TCP source address,
//! and the data address a `connect` advertises held against the same.
//!
//! A peer's identity (`host:port`) is only what its socket claims: anyone who reaches the control
//! port can claim any identity, and the node dials it back. The node reads every address a peer
//! writes as a [`PeerAddr`] (one value whatever the spelling: `0:P`, `2130706433:P`,
//! `[::ffff:127.0.0.1]:P` are addresses, not names) and holds it against the address the
//! message actually came from (libzmq's `Peer-Address`), before the allowlist and before the
//! protocol:
//!
//! * **Identity binding** (on by default, `bind_identity`): an identity whose host is an
//!   address must come from that address. A message from a loopback address may also claim any
//!   address of this host's own interfaces (a node on this host that dials us at `127.0.0.1`
//!   while its identity is its LAN address). An address no peer can have (`0.0.0.0`, `::`,
//!   multicast, broadcast: `connect(2)` reads the first two as "this host") is never an
//!   identity. A host-name identity cannot be checked without resolving it, which the node never
//!   does on its event loop: it is heard only when the allowlist names it (the operator vouches
//!   for the name); with no allowlist it is refused, so a peer cannot make the node dial a name
//!   it chose.
//! * **Data addresses** (the tcp plane's, in `connect`'s `agent_metadata`): with binding, an
//!   address on the host the `connect` came from (or, from loopback, on this host), never a name
//!   the allowlist does not name, never an address no peer can have; and within the allowlist.
//! * **Allowlist on the source**: with an allowlist, the source address itself must match one of
//!   its IP or network rules (when it has any), as well as the identity matching a rule.
//!
//! Called by the node's I/O loop on its own thread, for every inbound payload; cheap (no
//! system call: this host's addresses are read once at start).

use std::net::IpAddr;

use kvpeer_proto::{AddrError, Host, PeerAddr, PeerId};

use super::allow::{Allowlist, NotAllowed};
use super::tenants::{PeerClass, TenantRules};

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
    /// This node has a tenant, and the peer is neither of it nor a shared node.
    #[error("{0} is not of this node's tenant, nor a shared node (tenants)")]
    OtherTenant(PeerId),
    /// The tenant that names the identity has address rules, and the source address matches
    /// none of them.
    #[error(
        "{peer} came from {from}, outside the address rules of the tenant that names it (tenants)"
    )]
    NotTenantsSource {
        /// The identity claimed.
        peer: PeerId,
        /// Where the message came from.
        from: IpAddr,
    },
    /// This node has a tenant, and the source address matches none of its tenant's or shared
    /// nodes' address rules.
    #[error("source address {0} is not of this node's tenant, nor a shared node's (tenants)")]
    SourceOtherTenant(IpAddr),
    /// The identity is not `host:port` with a host that is an address or a name.
    #[error("identity {peer}: {why}")]
    NotHostPort {
        /// The identity claimed.
        peer: PeerId,
        /// Why it is not an address.
        why: AddrError,
    },
    /// An identity no peer can have (unspecified, multicast, broadcast).
    #[error(
        "identity {peer}{} is no peer's address (0.0.0.0 and :: mean this host)",
        read_as(peer, addr)
    )]
    NotAPeerAddress {
        /// The identity claimed.
        peer: PeerId,
        /// What it reads as.
        addr: PeerAddr,
    },
    /// An IP identity claimed from another address.
    #[error("identity {peer}{} claimed from another address ({from}): a node must call itself by an address of its own host (kvpeer: --listen, or --advertise)", read_as(peer, addr))]
    ClaimedElsewhere {
        /// The identity claimed.
        peer: PeerId,
        /// What it reads as.
        addr: PeerAddr,
        /// Where the message came from.
        from: IpAddr,
    },
    /// A host-name identity the allowlist does not name: it cannot be bound to its source.
    #[error("host-name identity {peer} cannot be bound to its source ({from}): call the peer by its address, or name it in the allowlist")]
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
    #[error("data address {addr:?}: {why}")]
    DataNotHostPort {
        /// The address as advertised.
        addr: String,
        /// Why it is not an address.
        why: AddrError,
    },
    /// An advertised data address on another host than the one the `connect` came from, a
    /// name the allowlist does not name, or an address no peer can have.
    #[error("data address {addr} (read as {read}) is not on the peer's own host ({from})")]
    DataElsewhere {
        /// The address as advertised.
        addr: String,
        /// What it reads as.
        read: PeerAddr,
        /// Where the `connect` came from.
        from: IpAddr,
    },
}

impl OriginError {
    /// Whether the peer is told why (a ZMTP ERROR before the connection closes): an identity
    /// its source cannot back is a mistake of the peer's configuration (a consumer that calls
    /// itself `127.0.0.1` across hosts), and saying so tells it nothing it does not know (its
    /// own claim, the address it came from). Allowlist refusals say nothing (a stranger learns
    /// nothing of the list).
    pub(crate) fn tells_peer(&self) -> bool {
        matches!(
            self,
            OriginError::NotHostPort { .. }
                | OriginError::NotAPeerAddress { .. }
                | OriginError::ClaimedElsewhere { .. }
                | OriginError::UnboundHostName { .. }
        )
    }
}

/// ` (address A)` when the identity as written is not its canonical form, else nothing.
fn read_as(peer: &PeerId, addr: &PeerAddr) -> String {
    let canonical = addr.to_string();
    if canonical == peer.as_str() {
        String::new()
    } else {
        format!(" (address {canonical})")
    }
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
                    .map(|ip| ip.to_canonical())
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

    /// Whether `ip` is this host's (any loopback address is).
    pub(crate) fn contains(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        ip.is_loopback() || self.0.contains(&ip)
    }
}

/// The policy: identity binding on or off, the allowlist, this host's addresses.
#[derive(Debug, Clone)]
pub(crate) struct OriginCheck {
    bind_identity: bool,
    allow: Allowlist,
    local: LocalAddrs,
    /// A node with a tenant talks only to its tenant's peers and shared nodes; every node
    /// with tenants holds a peer's source to the address rules of the tenant that names it.
    tenants: Option<std::sync::Arc<TenantRules>>,
}

impl Default for OriginCheck {
    fn default() -> Self {
        OriginCheck {
            bind_identity: true,
            allow: Allowlist::default(),
            local: LocalAddrs::default(),
            tenants: None,
        }
    }
}

impl OriginCheck {
    /// A policy.
    pub(crate) fn new(bind_identity: bool, allow: Allowlist, local: LocalAddrs) -> Self {
        OriginCheck {
            bind_identity,
            allow,
            local,
            tenants: None,
        }
    }

    /// Holds every peer to `tenants` as well (no check with no tenant configured).
    pub(crate) fn set_tenants(&mut self, tenants: std::sync::Arc<TenantRules>) {
        self.tenants = (!tenants.is_empty()).then_some(tenants);
    }

    /// The tenant rules in force, if any.
    pub(crate) fn tenants(&self) -> Option<std::sync::Arc<TenantRules>> {
        self.tenants.clone()
    }

    /// `Ok` if this node may dial `peer` (or send it anything): the allowlist and the tenant.
    pub(crate) fn check_dial(&self, peer: &PeerId) -> Result<(), OriginError> {
        self.check_peer(peer).map(|_| ())
    }

    /// The allowlist and the tenant's verdict on `peer`, and its class when tenants are kept
    /// (read once, for [`OriginCheck::check`]'s source checks too).
    fn check_peer(&self, peer: &PeerId) -> Result<Option<PeerClass>, OriginError> {
        self.allow.check(peer)?;
        let Some(t) = &self.tenants else {
            return Ok(None);
        };
        let class = t.classify(peer);
        if !t.admits_class(class) {
            return Err(OriginError::OtherTenant(peer.clone()));
        }
        Ok(Some(class))
    }

    /// `Ok` if a message claiming `peer` may have come from `source`, else why not.
    pub(crate) fn check(&self, peer: &PeerId, source: IpAddr) -> Result<(), OriginError> {
        let source = source.to_canonical();
        let class = self.check_peer(peer)?;
        if !self.allow.allows_source(source) {
            return Err(OriginError::SourceNotAllowed(source));
        }
        if let (Some(t), Some(class)) = (&self.tenants, class) {
            if !t.admits_source(source) {
                return Err(OriginError::SourceOtherTenant(source));
            }
            if !t.class_source_fits(class, source) {
                return Err(OriginError::NotTenantsSource {
                    peer: peer.clone(),
                    from: source,
                });
            }
        }
        if !self.bind_identity {
            return Ok(());
        }
        let addr = PeerAddr::of(peer).map_err(|why| OriginError::NotHostPort {
            peer: peer.clone(),
            why,
        })?;
        if !addr.is_peer_address() {
            return Err(OriginError::NotAPeerAddress {
                peer: peer.clone(),
                addr,
            });
        }
        match addr.host() {
            Host::Ip(ip) if self.on_host_of(*ip, source) => Ok(()),
            Host::Ip(_) => Err(OriginError::ClaimedElsewhere {
                peer: peer.clone(),
                addr,
                from: source,
            }),
            Host::Name(name) if self.allow.names_host(name) => Ok(()),
            Host::Name(_) => Err(OriginError::UnboundHostName {
                peer: peer.clone(),
                from: source,
            }),
        }
    }

    /// Whether `ip` is on the host a message from `source` came from: the same address, or,
    /// from loopback, an address of this host.
    fn on_host_of(&self, ip: IpAddr, source: IpAddr) -> bool {
        ip == source || (source.is_loopback() && self.local.contains(ip))
    }

    /// `Ok` if this node may open a data connection to `addr` (`host:port`), advertised by
    /// `peer` in a `connect` that came from `source`: never an address no peer can have; with
    /// an allowlist, an address allowed as a peer would be; with identity binding, an address
    /// on the host the `connect` came from (or, from loopback, on this host), and a name only
    /// when the allowlist names it, so a peer cannot aim our writer at a third machine in any
    /// spelling.
    ///
    /// A peer the allowlist names exactly (`host:port`) may advertise a data address on its own
    /// host (the same address, or the same host name): its data port is not its control port,
    /// and listing one peer must not break its tcp plane. It can aim our writer at no other host.
    pub(crate) fn check_data_addr(
        &self,
        peer: &PeerId,
        source: IpAddr,
        addr: &str,
    ) -> Result<(), OriginError> {
        let source = source.to_canonical();
        let data = PeerAddr::parse(addr).map_err(|why| OriginError::DataNotHostPort {
            addr: addr.to_owned(),
            why,
        })?;
        let elsewhere = || OriginError::DataElsewhere {
            addr: addr.to_owned(),
            read: data.clone(),
            from: source,
        };
        if !data.is_peer_address() {
            return Err(elsewhere());
        }
        if let Err(why) = self.allow.check_addr(&data) {
            let own_host = PeerAddr::of(peer).is_ok_and(|p| p.host() == data.host())
                || data.ip() == Some(source);
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
        match data.host() {
            Host::Ip(ip) if self.on_host_of(*ip, source) => Ok(()),
            Host::Name(name) if self.allow.names_host(name) => Ok(()),
            _ => Err(elsewhere()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse()
            .unwrap_or_else(|e| panic!("{s:?} is not an address: {e}"))
    }

    fn policy(rules: &[&str]) -> OriginCheck {
        let allow = Allowlist::parse(rules).unwrap_or_default();
        OriginCheck::new(true, allow, LocalAddrs::of(vec![ip("192.0.2.10")]))
    }

    fn check(rules: &[&str], peer: &str, source: &str) -> Result<(), OriginError> {
        policy(rules).check(&PeerId::new(peer), ip(source))
    }

    #[test]
    fn an_ip_identity_must_come_from_its_address() {
        assert_eq!(check(&[], "10.0.0.5:5600", "10.0.0.5"), Ok(()));
        assert_eq!(check(&[], "[::1]:5600", "::1"), Ok(()));
        assert_eq!(check(&[], "10.0.0.5:5600", "::ffff:10.0.0.5"), Ok(()));
        let e = check(&[], "10.0.0.5:5600", "10.0.0.6").unwrap_err();
        assert!(matches!(e, OriginError::ClaimedElsewhere { .. }), "{e}");
        // The refusal names both addresses.
        assert!(
            e.to_string().contains("10.0.0.5") && e.to_string().contains("10.0.0.6"),
            "{e}"
        );
        // A remote host cannot claim this host's loopback or its addresses.
        assert!(check(&[], "127.0.0.1:5600", "10.0.0.6").is_err());
        assert!(check(&[], "localhost:5600", "10.0.0.6").is_err());
        assert!(check(&[], "192.0.2.10:5600", "10.0.0.6").is_err());
        // A local process may claim this host's own addresses from loopback.
        assert_eq!(check(&[], "192.0.2.10:5600", "127.0.0.1"), Ok(()));
        assert_eq!(check(&[], "localhost:5600", "127.0.0.1"), Ok(()));
        assert!(check(&[], "10.0.0.5:5600", "127.0.0.1").is_err());
    }

    #[test]
    fn an_identity_spelled_as_a_number_is_judged_as_its_address() {
        // 167772166 = 10.0.0.6, 0xa000006 too: a third host, from 10.0.0.5.
        for spelled in [
            "167772166:22",
            "0xa000006:22",
            "10.6:22",
            "[::ffff:a00:6]:22",
        ] {
            let e = check(&[], spelled, "10.0.0.5").unwrap_err();
            assert!(
                matches!(e, OriginError::ClaimedElsewhere { .. }),
                "{spelled}: {e}"
            );
            assert_eq!(
                check(&[], spelled, "10.0.0.6"),
                Ok(()),
                "{spelled} from itself"
            );
        }
        // `0`, `0.0.0.0`, `[::]`: "this host" to connect(2), no peer's address, even from
        // loopback (where every address of this host may be claimed).
        for spelled in ["0:22", "0x0:22", "0.0:22", "[::]:22", "[::ffff:0.0.0.0]:22"] {
            for source in ["10.0.0.5", "127.0.0.1"] {
                let e = check(&[], spelled, source).unwrap_err();
                assert!(
                    matches!(e, OriginError::NotAPeerAddress { .. }),
                    "{spelled}: {e}"
                );
            }
        }
        // A number that is no address is refused, never taken for a name.
        let e = check(&[], "256.0.0.1:22", "10.0.0.5").unwrap_err();
        assert!(matches!(e, OriginError::NotHostPort { .. }), "{e}");
    }

    #[test]
    fn a_host_name_identity_is_heard_only_when_the_allowlist_names_it() {
        let e = check(&[], "node-a:1", "10.0.0.5").unwrap_err();
        assert!(matches!(e, OriginError::UnboundHostName { .. }), "{e}");
        assert_eq!(
            check(&["node-a", "10.0.0.0/8"], "node-a:1", "10.0.0.5"),
            Ok(())
        );
        assert!(check(&["10.0.0.0/8"], "node-a:1", "10.0.0.5").is_err());
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
    }

    fn data(policy: &OriginCheck, peer: &str, source: &str, addr: &str) -> Result<(), OriginError> {
        policy.check_data_addr(&PeerId::new(peer), ip(source), addr)
    }

    #[test]
    fn data_addresses_stay_on_the_peers_host_and_in_the_list() {
        let open = OriginCheck::new(true, Allowlist::default(), LocalAddrs::of(vec![]));
        let p = "10.0.0.5:5600";
        assert_eq!(data(&open, p, "10.0.0.5", "10.0.0.5:7000"), Ok(()));
        assert_eq!(data(&open, p, "10.0.0.5", "167772165:7000"), Ok(()));
        assert!(data(&open, p, "10.0.0.5", "10.0.0.6:22").is_err());
        let lo = "127.0.0.1:5600";
        assert_eq!(data(&open, lo, "127.0.0.1", "127.0.0.1:7000"), Ok(()));
        assert!(data(&open, lo, "127.0.0.1", "10.0.0.6:7000").is_err());
        let listed = OriginCheck::new(
            false,
            Allowlist::parse(&["10.0.0.0/24"]).unwrap_or_default(),
            LocalAddrs::of(vec![]),
        );
        assert_eq!(data(&listed, p, "10.0.0.5", "10.0.0.6:7000"), Ok(()));
        assert!(data(&listed, p, "10.0.0.5", "10.0.1.6:7000").is_err());
    }

    #[test]
    fn a_data_address_in_another_spelling_or_a_name_cannot_leave_the_peers_host() {
        let open = OriginCheck::new(true, Allowlist::default(), LocalAddrs::of(vec![]));
        let p = "10.0.0.5:5600";
        // Numbers and mapped forms of a third host, of "this host" and names: all refused
        // (before, any of them that was not a literal passed as a "host name").
        for addr in [
            "167772166:22",
            "0xa.0.0.6:22",
            "[::ffff:10.0.0.6]:22",
            "0:22",
            "0.0.0.0:22",
            "[::]:22",
            "evil.example:22",
            "localhost:22",
        ] {
            let e = data(&open, p, "10.0.0.5", addr).unwrap_err();
            assert!(
                matches!(e, OriginError::DataElsewhere { .. }),
                "{addr}: {e}"
            );
        }
        // From loopback too, `0` is no address of this host's peers.
        assert!(data(&open, "127.0.0.1:1", "127.0.0.1", "0:22").is_err());
        let e = data(&open, p, "10.0.0.5", "256.1.1.1:22").unwrap_err();
        assert!(matches!(e, OriginError::DataNotHostPort { .. }), "{e}");
        // Even with binding off, `0` never passes: it is this host.
        let loose = OriginCheck::new(false, Allowlist::default(), LocalAddrs::of(vec![]));
        assert!(data(&loose, p, "10.0.0.5", "0:22").is_err());
        assert_eq!(data(&loose, p, "10.0.0.5", "10.0.0.6:22"), Ok(()));
    }

    #[test]
    fn a_peer_listed_by_host_and_port_may_advertise_data_on_its_own_host_only() {
        let exact = OriginCheck::new(
            true,
            Allowlist::parse(&["127.0.0.1:5600", "node-b:5600"]).unwrap_or_default(),
            LocalAddrs::of(vec![]),
        );
        let p = "127.0.0.1:5600";
        assert_eq!(data(&exact, p, "127.0.0.1", "127.0.0.1:41000"), Ok(()));
        // Not on another host, nor for a peer the list does not name.
        assert!(data(&exact, p, "127.0.0.1", "10.0.0.6:41000").is_err());
        let e = data(&exact, "127.0.0.1:5601", "127.0.0.1", "127.0.0.1:41000").unwrap_err();
        assert!(matches!(e, OriginError::DataNotAllowed { .. }), "{e}");
        assert_eq!(
            data(&exact, "node-b:5600", "10.0.0.6", "NODE-B:41000"),
            Ok(())
        );
        assert!(data(&exact, "node-b:5600", "10.0.0.6", "node-c:41000").is_err());
    }
}
