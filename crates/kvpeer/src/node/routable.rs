//! Which of this host's addresses a peer can reach it at: what a node advertises when it
//! listens on a wildcard address (`0.0.0.0`, `::`, which no peer can dial), and what a
//! consumer calls itself toward one peer when no listen address was given.
//!
//! Contract: [`route_to`] is the source address the kernel picks for a packet to the peer
//! (a UDP socket `connect`ed to it, then `getsockname`: nothing is sent). [`routable`] is the
//! address of the interface that holds the default route (`/proc/net/route`, then
//! `/proc/net/ipv6_route`), else the first address of an interface that is up and not
//! loopback, else loopback: so a host in a network namespace with one link and no default
//! route advertises that link's address.
//! Called at an edge (configuration, a command), never on a node's event loop.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};

/// The address this host would send from to reach `peer` (`None`: no route).
pub fn route_to(peer: IpAddr) -> Option<IpAddr> {
    let peer = peer.to_canonical();
    let any: IpAddr = match peer {
        IpAddr::V4(_) => Ipv4Addr::UNSPECIFIED.into(),
        IpAddr::V6(_) => Ipv6Addr::UNSPECIFIED.into(),
    };
    let socket = UdpSocket::bind(SocketAddr::new(any, 0)).ok()?;
    // A UDP connect only chooses the route and the source address; no packet leaves.
    socket.connect(SocketAddr::new(peer, 9)).ok()?;
    let local = socket.local_addr().ok()?.ip().to_canonical();
    (!local.is_unspecified()).then_some(local)
}

/// This host's address a peer can reach it at (see the module's contract); IPv6 ones only
/// for a `::` listen, and IPv4 first even then (`[::]` takes both families, peers mostly
/// dial IPv4).
pub fn routable(wildcard: IpAddr) -> IpAddr {
    let v6_ok = wildcard.is_ipv6();
    let read = |path: &str| std::fs::read_to_string(path).unwrap_or_default();
    let mut default_ifaces = default_route_ifaces(&read("/proc/net/route"), false);
    if v6_ok {
        default_ifaces.extend(default_route_ifaces(&read("/proc/net/ipv6_route"), true));
    }
    choose(&default_ifaces, &interfaces(), v6_ok)
}

/// The interfaces holding a default route in the kernel's route table text (`/proc/net/route`:
/// destination and mask `00000000`; `ipv6_route`: destination `0…0` of prefix length 0).
pub(crate) fn default_route_ifaces(table: &str, v6: bool) -> Vec<String> {
    table
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let default = if v6 {
                f.len() >= 10 && f[0].bytes().all(|b| b == b'0') && f[1] == "00"
            } else {
                f.len() >= 8 && f[1] == "00000000" && f[7] == "00000000"
            };
            let iface = if v6 { f.last() } else { f.first() };
            iface.filter(|_| default).map(|i| (*i).to_owned())
        })
        .filter(|i| i != "lo")
        .collect()
}

/// One interface address: its interface, the address, whether it is up and loopback.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Iface {
    pub(crate) name: String,
    pub(crate) ip: IpAddr,
    pub(crate) up: bool,
    pub(crate) loopback: bool,
}

/// This host's interface addresses now (empty if the system will not say).
fn interfaces() -> Vec<Iface> {
    use nix::net::if_::InterfaceFlags;
    nix::ifaddrs::getifaddrs()
        .map(|ifs| {
            ifs.filter_map(|i| {
                let a = i.address?;
                let ip = a
                    .as_sockaddr_in()
                    .map(|v4| IpAddr::V4(v4.ip()))
                    .or_else(|| a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())))?;
                Some(Iface {
                    name: i.interface_name.clone(),
                    ip: ip.to_canonical(),
                    up: i.flags.contains(InterfaceFlags::IFF_UP),
                    loopback: i.flags.contains(InterfaceFlags::IFF_LOOPBACK) || ip.is_loopback(),
                })
            })
            .collect()
        })
        .unwrap_or_default()
}

/// The choice, without the system: the first usable address of an interface holding a
/// default route; else of any up, non-loopback interface; IPv4 first; IPv6 only when `v6_ok`
/// and never link-local (it needs a zone to dial); else loopback.
pub(crate) fn choose(default_ifaces: &[String], ifaces: &[Iface], v6_ok: bool) -> IpAddr {
    let usable = |i: &&Iface| {
        i.up && !i.loopback
            && !i.ip.is_unspecified()
            && match i.ip {
                IpAddr::V4(_) => true,
                IpAddr::V6(v6) => v6_ok && (v6.segments()[0] & 0xffc0) != 0xfe80,
            }
    };
    let first = |among: &dyn Fn(&Iface) -> bool| {
        let mut found = ifaces.iter().filter(usable).filter(|i| among(i));
        let all: Vec<&Iface> = found.by_ref().collect();
        all.iter()
            .find(|i| i.ip.is_ipv4())
            .or(all.first())
            .map(|i| i.ip)
    };
    first(&|i| default_ifaces.contains(&i.name))
        .or_else(|| first(&|_| true))
        .unwrap_or(IpAddr::V4(Ipv4Addr::LOCALHOST))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn iface(name: &str, ip: &str, up: bool) -> Iface {
        let ip: IpAddr = ip.parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        Iface {
            name: name.to_owned(),
            ip,
            up,
            loopback: ip.is_loopback(),
        }
    }

    #[test]
    fn the_default_routes_interface_first_then_an_up_interface_then_loopback() {
        let ifs = [
            iface("lo", "127.0.0.1", true),
            iface("eth0", "fe80::1", true),
            iface("eth9", "10.9.0.7", false),
            iface("eth1", "2001:db8::7", true),
            iface("eth1", "10.1.0.7", true),
            iface("eth2", "10.2.0.7", true),
        ];
        let via = |name: &str| vec![name.to_owned()];
        assert_eq!(choose(&via("eth2"), &ifs, false).to_string(), "10.2.0.7");
        // No default route (a namespace with one link): its up, non-loopback address.
        assert_eq!(choose(&[], &ifs, false).to_string(), "10.1.0.7");
        assert_eq!(choose(&[], &ifs[..4], true).to_string(), "2001:db8::7");
        assert_eq!(choose(&[], &ifs[..4], false).to_string(), "127.0.0.1");
        assert_eq!(choose(&[], &[], false).to_string(), "127.0.0.1");
    }

    #[test]
    fn default_routes_are_read_from_the_kernels_tables() {
        let v4 = "Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n\
                  eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                  eth1\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n";
        assert_eq!(default_route_ifaces(v4, false), vec!["eth0".to_owned()]);
        let v6 = "fd000000000000000000000000000000 40 00000000000000000000000000000000 00 \
                  00000000000000000000000000000000 00000100 00000001 00000000 00000001 eth1\n\
                  00000000000000000000000000000000 00 00000000000000000000000000000000 00 \
                  fd000000000000000000000000000001 00000400 00000002 00000000 00000003 eth2\n";
        assert_eq!(default_route_ifaces(v6, true), vec!["eth2".to_owned()]);
    }

    #[test]
    fn the_route_to_a_loopback_peer_is_loopback() {
        assert_eq!(
            route_to(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            Some(IpAddr::V4(Ipv4Addr::LOCALHOST))
        );
        let here = routable(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        assert!(!here.is_unspecified(), "{here}");
    }
}
