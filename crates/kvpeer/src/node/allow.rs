//! The peer allowlist: which peers a node talks to at all.
//!
//! A peer is its identity `host:port`, read as a [`PeerAddr`] (so `167772165:5600`,
//! `[::ffff:10.0.0.5]:5600` and `10.0.0.5:5600` are one peer, and a rule written in any of
//! those spellings matches all of them). Rules: an IP network in CIDR form (`10.0.0.0/8`,
//! `fd00::/8`), an address or host name (any port: `10.0.0.5`, `node-a`), or an exact
//! `host:port` (`10.0.0.5:5600`, `[fd00::1]:5600`). A rule naming a host by name matches that
//! name; [`Allowlist::resolve_names`] (called once, where a node is built, never on its event
//! loop) adds the addresses the name resolves to then, so the rule also judges addresses: a
//! kvpeer peer's identity and every source address. An empty list allows every peer (vLLM's
//! behaviour).
//!
//! Checked by the node's I/O loop before it dials a peer (a request naming a peer, or a reply
//! to an inbound `connect`) and before it hands an inbound payload to the core: a refused peer is
//! logged with the reason, never dialed, and its messages never reach the protocol. Upstream
//! dials back whatever identity a `connect` claims, which turns every node into a port scanner
//! for anyone who can reach it (spec §8); the allowlist closes that.

use std::net::IpAddr;

use kvpeer_proto::{Host, PeerAddr, PeerId};

/// A rule that does not parse: which one, and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("allowlist rule {rule:?}: {problem}")]
pub struct BadRule {
    /// The rule as written.
    pub rule: String,
    /// What is wrong with it.
    pub problem: RuleProblem,
}

/// What is wrong with an allowlist rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RuleProblem {
    /// Nothing written.
    #[error("empty")]
    Empty,
    /// `x/n` where `x` is not an IP address.
    #[error("not an IP network")]
    NotANetwork,
    /// A prefix length that is not a number up to 32 (IPv4) or 128 (IPv6).
    #[error("bad prefix length")]
    BadPrefix,
    /// `host:port` with a port that is not a number up to 65535.
    #[error("bad port")]
    BadPort,
    /// `:port` with no host.
    #[error("empty host")]
    EmptyHost,
    /// A host that is neither an address nor a host name (`256.1.1.1`, `a b`).
    #[error("not an IP address or a host name")]
    BadHost,
}

/// Why a peer is not allowed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NotAllowed {
    /// The identity is not `host:port`, so no rule can judge it.
    #[error("not a host:port identity ({0})")]
    NotHostPort(String),
    /// No rule matches.
    #[error("not in the allowlist")]
    NotListed,
}

/// One rule.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Rule {
    Network { addr: IpAddr, prefix: u8 },
    Host(Host),
    HostPort(Host, u16),
}

/// The rules; empty allows everyone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    rules: Vec<Rule>,
}

impl Allowlist {
    /// Parses rules; an error names the rule and what is wrong with it.
    pub fn parse<S: AsRef<str>>(rules: &[S]) -> Result<Self, BadRule> {
        let rules = rules
            .iter()
            .map(|r| parse_rule(r.as_ref().trim()))
            .collect::<Result<_, _>>()?;
        Ok(Allowlist { rules })
    }

    /// Whether the list is empty (every peer allowed).
    pub fn allows_all(&self) -> bool {
        self.rules.is_empty()
    }

    /// Adds, for every rule naming a host by name, the addresses `resolve` gives for that name
    /// (the rule keeps matching the name too). Called once where the node is built: the event
    /// loop never resolves. A name that resolves to nothing keeps only its name rule.
    pub fn resolve_names(&mut self, mut resolve: impl FnMut(&str) -> Vec<IpAddr>) {
        let mut added = Vec::new();
        for rule in &self.rules {
            let (name, port) = match rule {
                Rule::Host(Host::Name(n)) => (n, None),
                Rule::HostPort(Host::Name(n), p) => (n, Some(*p)),
                _ => continue,
            };
            for ip in resolve(name) {
                let host = Host::from(ip);
                added.push(match port {
                    None => Rule::Host(host),
                    Some(p) => Rule::HostPort(host, p),
                });
            }
        }
        for rule in added {
            if !self.rules.contains(&rule) {
                self.rules.push(rule);
            }
        }
    }

    /// `Ok` if `peer` may be talked to, else why not.
    pub fn check(&self, peer: &PeerId) -> Result<(), NotAllowed> {
        if self.rules.is_empty() {
            return Ok(());
        }
        let addr = PeerAddr::of(peer).map_err(|e| NotAllowed::NotHostPort(e.to_string()))?;
        self.check_addr(&addr)
    }

    /// `Ok` if the address `addr` may be talked to (a peer's, or a data address).
    pub fn check_addr(&self, addr: &PeerAddr) -> Result<(), NotAllowed> {
        if self.rules.is_empty() {
            return Ok(());
        }
        let allowed = self.rules.iter().any(|rule| match rule {
            Rule::Network { addr: net, prefix } => {
                addr.ip().is_some_and(|ip| in_network(ip, *net, *prefix))
            }
            Rule::Host(h) => h == addr.host(),
            Rule::HostPort(h, p) => *p == addr.port() && h == addr.host(),
        });
        if allowed {
            Ok(())
        } else {
            Err(NotAllowed::NotListed)
        }
    }

    /// Whether a control connection from `source` may be heard: always with no list or a list
    /// of host names only (a name cannot judge an address); else `source` must match an
    /// address or network rule (a `host:port` rule with an IP host counts, any port).
    pub fn allows_source(&self, source: IpAddr) -> bool {
        let source = source.to_canonical();
        let mut ip_rules = self.rules.iter().filter_map(|rule| match rule {
            Rule::Network { addr, prefix } => Some(in_network(source, *addr, *prefix)),
            Rule::Host(h) | Rule::HostPort(h, _) => h.ip().map(|ip| ip == source),
        });
        let Some(first) = ip_rules.next() else {
            return true;
        };
        first || ip_rules.any(|matched| matched)
    }

    /// Whether a rule names the host `host` by name (not by address).
    pub fn names_host(&self, host: &str) -> bool {
        self.rules.iter().any(|rule| match rule {
            Rule::Host(Host::Name(h)) | Rule::HostPort(Host::Name(h), _) => {
                h.eq_ignore_ascii_case(host)
            }
            _ => false,
        })
    }
}

fn parse_rule(rule: &str) -> Result<Rule, BadRule> {
    let bad = |problem| BadRule {
        rule: rule.to_owned(),
        problem,
    };
    if rule.is_empty() {
        return Err(bad(RuleProblem::Empty));
    }
    if let Some((addr, prefix)) = rule.split_once('/') {
        let addr = match Host::parse(addr) {
            Ok(Host::Ip(ip)) => ip,
            _ => return Err(bad(RuleProblem::NotANetwork)),
        };
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| bad(RuleProblem::BadPrefix))?;
        return Ok(Rule::Network { addr, prefix });
    }
    // A host alone (an IPv6 address has colons but no port), else `host:port`.
    if let Ok(host) = Host::parse(rule) {
        return Ok(Rule::Host(host));
    }
    match rule.rsplit_once(':') {
        Some((host, port)) if !host.contains(':') || host.starts_with('[') => {
            if host.is_empty() {
                return Err(bad(RuleProblem::EmptyHost));
            }
            let port: u16 = port
                .parse()
                .ok()
                .filter(|p| *p != 0 && port.bytes().all(|b| b.is_ascii_digit()))
                .ok_or_else(|| bad(RuleProblem::BadPort))?;
            let host = Host::parse(host).map_err(|_| bad(RuleProblem::BadHost))?;
            Ok(Rule::HostPort(host, port))
        }
        _ => Err(bad(RuleProblem::BadHost)),
    }
}

fn in_network(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    match (ip.to_canonical(), net) {
        (IpAddr::V4(ip), IpAddr::V4(net)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(ip) & mask == u32::from(net) & mask
        }
        (IpAddr::V6(ip), IpAddr::V6(net)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(ip) & mask == u128::from(net) & mask
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allows(rules: &[&str], peer: &str) -> bool {
        Allowlist::parse(rules)
            .unwrap_or_default()
            .check(&PeerId::new(peer))
            .is_ok()
    }

    #[test]
    fn rules_match_networks_hosts_and_exact_peers() {
        assert!(allows(&[], "203.0.113.9:1"), "empty allows all");
        assert!(allows(&["10.0.0.0/8"], "10.200.3.4:5600"));
        assert!(!allows(&["10.0.0.0/8"], "11.0.0.1:5600"));
        assert!(allows(&["0.0.0.0/0"], "192.0.2.1:1"));
        assert!(allows(&["127.0.0.1"], "127.0.0.1:9"));
        assert!(allows(&["127.0.0.1:5600"], "127.0.0.1:5600"));
        assert!(!allows(&["127.0.0.1:5600"], "127.0.0.1:5601"));
        assert!(allows(&["node-a"], "NODE-A:1"));
        assert!(!allows(&["node-a"], "node-b:1"));
        assert!(allows(&["fd00::/8"], "[fd00::1]:5600"));
        assert!(allows(&["[fd00::1]:5600"], "[fd00::1]:5600"));
        assert!(
            !allows(&["fd00::/8"], "10.0.0.1:5600"),
            "families never mix"
        );
        assert!(
            !allows(&["10.0.0.0/8"], "node-a:1"),
            "names are not resolved"
        );
    }

    #[test]
    fn rules_and_peers_match_whatever_the_spelling() {
        // One address written four ways, in the rule or in the peer.
        for rule in ["10.0.0.5", "167772165", "0xa.0.0.5", "::ffff:10.0.0.5"] {
            for peer in ["10.0.0.5:1", "167772165:1", "[::ffff:a00:5]:1", "10.5:1"] {
                assert!(allows(&[rule], peer), "{rule} / {peer}");
            }
            assert!(!allows(&[rule], "10.0.0.6:1"), "{rule}");
        }
        assert!(allows(&["10.0.0.0/8"], "[::ffff:10.1.2.3]:1"));
        assert!(allows(&["10.0.0.0/8"], "167772165:1"));
        assert!(allows(&["localhost"], "127.0.0.1:9"));
        assert!(allows(&["127.0.0.1:9"], "LocalHost:9"));
        // A number that is no address names nothing (nor reaches DNS as a name).
        assert!(!allows(&["0.0.0.0/0"], "256.1.1.1:1"));
        let list = Allowlist::parse(&["10.0.0.5"]).unwrap_or_default();
        assert!(list.allows_source("::ffff:10.0.0.5".parse().unwrap_or(IpAddr::from([0; 4]))));
    }

    #[test]
    fn a_name_rule_judges_the_addresses_it_resolved_to_at_start() {
        let mut list = Allowlist::parse(&["node-b", "node-c:5600"]).unwrap_or_default();
        let ten = |last: u8| IpAddr::from([10, 0, 0, last]);
        assert!(list.allows_source(ten(6)), "names only: sources unjudged");
        assert!(list.check(&PeerId::new("10.0.0.6:5600")).is_err());
        list.resolve_names(|name| match name {
            "node-b" => vec![ten(6)],
            "node-c" => vec![ten(7)],
            _ => vec![],
        });
        assert!(list.check(&PeerId::new("10.0.0.6:1")).is_ok());
        assert!(
            list.check(&PeerId::new("node-b:1")).is_ok(),
            "the name still matches"
        );
        assert!(list.check(&PeerId::new("10.0.0.7:5600")).is_ok());
        assert!(list.check(&PeerId::new("10.0.0.7:5601")).is_err());
        assert!(list.allows_source(ten(6)) && list.allows_source(ten(7)));
        assert!(!list.allows_source(ten(8)));
    }

    #[test]
    fn bad_rules_are_named() {
        for (bad, problem) in [
            ("", RuleProblem::Empty),
            ("10.0.0.0/33", RuleProblem::BadPrefix),
            ("10.0.0.0/x", RuleProblem::BadPrefix),
            ("nope/8", RuleProblem::NotANetwork),
            ("host:port", RuleProblem::BadPort),
            (":5600", RuleProblem::EmptyHost),
            ("256.1.1.1", RuleProblem::BadHost),
            ("256.1.1.1:5600", RuleProblem::BadHost),
        ] {
            let e = Allowlist::parse(&["10.0.0.1", bad]).unwrap_err();
            assert_eq!(
                e,
                BadRule {
                    rule: bad.into(),
                    problem
                }
            );
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }
}
