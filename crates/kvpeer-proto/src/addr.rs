//! A peer's address as one canonical value: [`PeerAddr`] (a [`Host`] and a port).
//!
//! Contract. Every place that judges or uses where a peer is (its identity, the data address
//! its `connect` advertises, a router's hint, a consumer's `sources`, the allowlist, the
//! per-host shares) reads the text through [`PeerAddr::parse`] (or [`PeerAddr::of`]), and
//! compares the values, never the text. Parsing is pure (no resolver, no I/O) and makes each
//! address canonical once:
//!
//! * **Every numeric spelling the system's resolver accepts is an address, not a name**: IPv4
//!   in `inet_aton`'s forms (`a.b.c.d`, `a.b.c`, `a.b`, `a`, each part decimal, octal with a
//!   leading `0` or hex with `0x`: `0`, `2130706433`, `0x7f.1`, `017700000001` are all
//!   addresses), IPv6 in brackets. IPv4-mapped IPv6 (`[::ffff:1.2.3.4]`, `[::ffff:102:304]`,
//!   any spelling) is its IPv4 address. The result is kept as an [`IpAddr`], so two spellings
//!   of one address are one value, and [`Display`](std::fmt::Display) writes its one canonical
//!   form.
//! * **A host whose last label starts with a digit must be such a number**, else it is refused
//!   ([`AddrError::BadHost`]): `256.1.1.1` or `08` would otherwise go to DNS as a name (with the
//!   resolver's search domains appended), where a name lets an attacker choose the address.
//! * **`localhost` (and `*.localhost`, RFC 6761) is the loopback address** `127.0.0.1`, as the
//!   kvpeer dialer resolved it (IPv4 first); other names are [`Host::Name`], lower case, a
//!   trailing dot dropped, only letters, digits, `-` and `_` in labels of 1 to 63 bytes.
//!   Whitespace, `%` zones, `/`, `@` and anything else a resolver might read differently are
//!   refused.
//!
//! A name is resolved, if at all, once, at an edge that may block (a command line, a
//! configuration, an API call) and never on a node's event loop; what it resolves to is then
//! judged as an address by the same rules as a literal. [`PeerAddr::is_peer_address`] says
//! whether an address can be a peer's at all (not unspecified, multicast or broadcast: `0`,
//! `0.0.0.0` and `[::]` mean "this host" to `connect(2)`, never a peer's host).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;

use crate::types::PeerId;

/// Why a text is not a peer address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum AddrError {
    /// No `:port` after the host.
    #[error("{0:?} is not HOST:PORT (no port)")]
    NoPort(String),
    /// The port is not a number from 1 to 65535 (0 where a port is to be picked).
    #[error("{0:?}: the port is not a number from 1 to 65535")]
    BadPort(String),
    /// Nothing before the colon.
    #[error("{0:?}: empty host")]
    EmptyHost(String),
    /// The host is neither an address in a form the resolver reads as one nor a host name.
    #[error("{host:?} is not an IP address or a host name ({why})")]
    BadHost {
        /// The host as written.
        host: String,
        /// What is wrong with it.
        why: &'static str,
    },
}

/// A peer's host: an address (canonical: IPv4-mapped IPv6 is IPv4) or a host name (lower
/// case, no trailing dot; `localhost` is never one: it is `127.0.0.1`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Host {
    /// An IP address.
    Ip(IpAddr),
    /// A host name, to be resolved at an edge.
    Name(Arc<str>),
}

impl Host {
    /// Parses a host: an IPv6 address in brackets (or bare), an IPv4 address in any form the
    /// system's resolver takes as numeric, or a host name (see the module's contract).
    pub fn parse(text: &str) -> Result<Host, AddrError> {
        let bad = |why| AddrError::BadHost {
            host: text.to_owned(),
            why,
        };
        if text.is_empty() {
            return Err(AddrError::EmptyHost(text.to_owned()));
        }
        let inner = match (text.strip_prefix('['), text.strip_suffix(']')) {
            (Some(_), Some(_)) if text.len() >= 2 => &text[1..text.len() - 1],
            (None, None) => text,
            _ => return Err(bad("unbalanced brackets")),
        };
        if inner.contains(':') {
            if inner.contains('%') {
                return Err(bad("an IPv6 zone is not a peer's address"));
            }
            let v6: Ipv6Addr = inner.parse().map_err(|_| bad("not an IPv6 address"))?;
            return Ok(Host::Ip(IpAddr::V6(v6).to_canonical()));
        }
        if inner.len() != text.len() {
            return Err(bad("brackets around an IPv4 address or a name"));
        }
        let name = inner.strip_suffix('.').unwrap_or(inner);
        let last = name.rsplit('.').next().unwrap_or("");
        if last.starts_with(|c: char| c.is_ascii_digit()) {
            // The resolver reads it as a number (or tries DNS with it, which a number must
            // never reach): it is an address or nothing.
            return ipv4_aton(inner)
                .map(|v4| Host::Ip(IpAddr::V4(v4)))
                .ok_or_else(|| bad("a number that is not an IPv4 address"));
        }
        if name.len() > 253 {
            return Err(bad("longer than 253 bytes"));
        }
        for label in name.split('.') {
            if label.is_empty() || label.len() > 63 {
                return Err(bad("a label empty or over 63 bytes"));
            }
            if !label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            {
                return Err(bad("only letters, digits, '-' and '_' may name a host"));
            }
        }
        let name = name.to_ascii_lowercase();
        if name == "localhost" || name.ends_with(".localhost") {
            return Ok(Host::Ip(IpAddr::V4(Ipv4Addr::LOCALHOST)));
        }
        Ok(Host::Name(Arc::from(name)))
    }

    /// The address, if it is one.
    pub fn ip(&self) -> Option<IpAddr> {
        match self {
            Host::Ip(ip) => Some(*ip),
            Host::Name(_) => None,
        }
    }

    /// The host name, if it is one.
    pub fn name(&self) -> Option<&str> {
        match self {
            Host::Name(n) => Some(n),
            Host::Ip(_) => None,
        }
    }
}

impl From<IpAddr> for Host {
    fn from(ip: IpAddr) -> Self {
        Host::Ip(ip.to_canonical())
    }
}

impl std::fmt::Display for Host {
    /// The canonical form, without brackets (the key of per-host shares).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Ip(ip) => write!(f, "{ip}"),
            Host::Name(n) => f.write_str(n),
        }
    }
}

/// A peer's address: a [`Host`] and a port, canonical (see the module's contract).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerAddr {
    host: Host,
    port: u16,
}

impl PeerAddr {
    /// An address and port.
    pub fn new(host: Host, port: u16) -> Self {
        PeerAddr { host, port }
    }

    /// Parses `HOST:PORT` (split at the last colon, as vLLM splits identities; an IPv6 host
    /// in brackets), with a port from 1 to 65535.
    pub fn parse(text: &str) -> Result<PeerAddr, AddrError> {
        let addr = Self::parse_any_port(text)?;
        if addr.port == 0 {
            return Err(AddrError::BadPort(text.to_owned()));
        }
        Ok(addr)
    }

    /// [`PeerAddr::parse`], port 0 allowed (a listen address whose port the system picks).
    pub fn parse_any_port(text: &str) -> Result<PeerAddr, AddrError> {
        let (host, port) = text
            .rsplit_once(':')
            .ok_or_else(|| AddrError::NoPort(text.to_owned()))?;
        // A bare IPv6 address (`::1`) has colons but no port.
        if host.contains(':') && !host.starts_with('[') {
            return Err(AddrError::NoPort(text.to_owned()));
        }
        if port.is_empty() || !port.bytes().all(|b| b.is_ascii_digit()) {
            return Err(AddrError::BadPort(text.to_owned()));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| AddrError::BadPort(text.to_owned()))?;
        if host.is_empty() {
            return Err(AddrError::EmptyHost(text.to_owned()));
        }
        Ok(PeerAddr {
            host: Host::parse(host)?,
            port,
        })
    }

    /// The address a peer id names.
    pub fn of(peer: &PeerId) -> Result<PeerAddr, AddrError> {
        Self::parse(peer.as_str())
    }

    /// Its host.
    pub fn host(&self) -> &Host {
        &self.host
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Its IP address, if the host is one.
    pub fn ip(&self) -> Option<IpAddr> {
        self.host.ip()
    }

    /// The socket address, if the host is an address.
    pub fn socket_addr(&self) -> Option<SocketAddr> {
        self.ip().map(|ip| SocketAddr::new(ip, self.port))
    }

    /// The same host at another port.
    pub fn with_port(&self, port: u16) -> PeerAddr {
        PeerAddr {
            host: self.host.clone(),
            port,
        }
    }

    /// Whether the host can be a peer's: a name (judged once resolved), or an address that is
    /// neither unspecified (`0.0.0.0`, `::`: "this host" to `connect(2)`), multicast nor the
    /// IPv4 broadcast address.
    pub fn is_peer_address(&self) -> bool {
        self.ip().is_none_or(is_peer_ip)
    }

    /// The canonical `host:port` as a peer id (IPv6 in brackets).
    pub fn to_peer_id(&self) -> PeerId {
        PeerId::new(self.to_string())
    }
}

impl From<SocketAddr> for PeerAddr {
    fn from(addr: SocketAddr) -> Self {
        PeerAddr {
            host: Host::from(addr.ip()),
            port: addr.port(),
        }
    }
}

impl std::fmt::Display for PeerAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.host {
            Host::Ip(IpAddr::V6(v6)) => write!(f, "[{v6}]:{}", self.port),
            host => write!(f, "{host}:{}", self.port),
        }
    }
}

impl std::str::FromStr for PeerAddr {
    type Err = AddrError;

    fn from_str(s: &str) -> Result<Self, AddrError> {
        PeerAddr::parse(s)
    }
}

/// Whether `ip` can be a peer's address (see [`PeerAddr::is_peer_address`]).
pub fn is_peer_ip(ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    !(ip.is_unspecified() || ip.is_multicast() || ip == IpAddr::V4(Ipv4Addr::BROADCAST))
}

/// IPv4 in `inet_aton(3)`'s forms, exactly (nothing after the number; glibc's `getaddrinfo`
/// reads these as numeric hosts): one to four parts, each decimal, octal (a leading `0`) or hex
/// (`0x`), the last part filling the bytes the others left.
fn ipv4_aton(text: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = text.split('.').collect();
    if parts.len() > 4 {
        return None;
    }
    let mut values = Vec::with_capacity(parts.len());
    for part in &parts {
        values.push(aton_part(part)?);
    }
    let (last, leading) = values.split_last()?;
    let mut addr: u32 = 0;
    for (i, v) in leading.iter().enumerate() {
        if *v > 0xff {
            return None;
        }
        addr |= (*v as u32) << (24 - 8 * i);
    }
    let room = 32 - 8 * leading.len() as u32;
    if room < 32 && *last >> room != 0 || room == 32 && *last > u64::from(u32::MAX) {
        return None;
    }
    Some(Ipv4Addr::from(addr | *last as u32))
}

/// One part of an `inet_aton` address: `0x` hex (digits may be none: `0x` is 0, as glibc
/// reads it), `0` octal, else decimal; `None` past 2^32 or on a digit of another base.
fn aton_part(part: &str) -> Option<u64> {
    if part.is_empty() {
        return None;
    }
    let (digits, radix) =
        if let Some(hex) = part.strip_prefix("0x").or_else(|| part.strip_prefix("0X")) {
            (hex, 16)
        } else if part.len() > 1 && part.starts_with('0') {
            (&part[1..], 8)
        } else {
            (part, 10)
        };
    let mut value: u64 = 0;
    for c in digits.chars() {
        value = value
            .checked_mul(radix)?
            .checked_add(u64::from(c.to_digit(radix as u32)?))?;
        if value > u64::from(u32::MAX) {
            return None;
        }
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(s: &str) -> Host {
        Host::parse(s).unwrap_or_else(|e| panic!("{s:?}: {e}"))
    }

    fn v4(s: &str) -> Host {
        Host::Ip(IpAddr::V4(s.parse().unwrap_or(Ipv4Addr::UNSPECIFIED)))
    }

    #[test]
    fn every_numeric_ipv4_spelling_is_one_address() {
        for spelling in [
            "10.0.0.5",
            "167772165",
            "0xa000005",
            "0XA000005",
            "01200000005",
            "10.5",
            "10.0.5",
            "0xa.0.0.5",
            "012.0.0.05",
            "10.0x000005",
        ] {
            assert_eq!(host(spelling), v4("10.0.0.5"), "{spelling}");
        }
        for zero in ["0", "0x0", "00", "0.0", "0.0.0.0", "0x", "0.0.0"] {
            assert_eq!(host(zero), v4("0.0.0.0"), "{zero}");
        }
        assert_eq!(host("4294967295"), v4("255.255.255.255"));
    }

    #[test]
    fn numbers_that_are_not_addresses_are_refused_not_taken_as_names() {
        for bad in [
            "256.1.1.1",
            "1.2.3.4.5",
            "08",
            "0x1g",
            "4294967296",
            "1.16777216",
            "1.2.65536",
            "1..2",
            "99999999999999999999999",
            "1.2.3.4 ",
            "example.123",
            "10.0.0.5.",
        ] {
            assert!(
                matches!(Host::parse(bad), Err(AddrError::BadHost { .. })),
                "{bad:?}: {:?}",
                Host::parse(bad)
            );
        }
    }

    #[test]
    fn ipv4_mapped_ipv6_in_any_spelling_is_the_ipv4_address() {
        for spelling in [
            "[::ffff:127.0.0.1]",
            "[::FFFF:7F00:1]",
            "[0:0:0:0:0:ffff:7f00:0001]",
            "[0::ffff:127.0.0.1]",
            "::ffff:7f00:1",
        ] {
            assert_eq!(host(spelling), v4("127.0.0.1"), "{spelling}");
        }
        assert_eq!(
            host("[::1]"),
            Host::Ip("::1".parse().unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED)))
        );
        assert!(Host::parse("[fe80::1%eth0]").is_err(), "zones are refused");
        assert!(Host::parse("[10.0.0.5]").is_err());
        assert!(Host::parse("[::1").is_err());
    }

    #[test]
    fn names_are_lower_case_and_localhost_is_loopback() {
        assert_eq!(
            host("Node-A.example."),
            Host::Name(Arc::from("node-a.example"))
        );
        assert_eq!(host("LOCALHOST"), v4("127.0.0.1"));
        assert_eq!(host("db.localhost"), v4("127.0.0.1"));
        for bad in ["a b", "a/b", "a@b", "é.example", "a..b", ""] {
            assert!(Host::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn addresses_parse_compare_and_print_canonically() {
        let a = PeerAddr::parse("[::ffff:10.0.0.5]:5600");
        let b = PeerAddr::parse("167772165:5600");
        assert_eq!(a, b);
        assert_eq!(
            a.as_ref().map(ToString::to_string).ok(),
            Some("10.0.0.5:5600".to_owned())
        );
        assert_eq!(
            PeerAddr::parse("[::1]:7").map(|a| a.to_string()).ok(),
            Some("[::1]:7".to_owned())
        );
        assert!(matches!(PeerAddr::parse("h:0"), Err(AddrError::BadPort(_))));
        assert!(PeerAddr::parse_any_port("h:0").is_ok());
        assert!(matches!(PeerAddr::parse("::1"), Err(AddrError::NoPort(_))));
        assert!(matches!(
            PeerAddr::parse("h:+1"),
            Err(AddrError::BadPort(_))
        ));
        assert!(matches!(
            PeerAddr::parse(":1"),
            Err(AddrError::EmptyHost(_))
        ));
    }

    #[test]
    fn unspecified_multicast_and_broadcast_are_no_peers_addresses() {
        for no in [
            "0:1",
            "0.0.0.0:1",
            "[::]:1",
            "[::ffff:0.0.0.0]:1",
            "224.0.0.1:1",
            "4294967295:1",
        ] {
            let a = PeerAddr::parse(no).unwrap_or_else(|e| panic!("{no}: {e}"));
            assert!(!a.is_peer_address(), "{no}");
        }
        for yes in ["127.0.0.1:1", "10.0.0.5:1", "[::1]:1", "node-a:1"] {
            let a = PeerAddr::parse(yes).unwrap_or_else(|e| panic!("{yes}: {e}"));
            assert!(a.is_peer_address(), "{yes}");
        }
    }
}
