//! The peer allowlist: which peers a node talks to at all.
//!
//! A peer is its identity `host:port`. Rules: an IP network in CIDR form (`10.0.0.0/8`,
//! `fd00::/8`), an address or host name (any port: `10.0.0.5`, `node-a`), or an exact
//! `host:port` (`10.0.0.5:5600`, `[fd00::1]:5600`). Host names are compared as text, never
//! resolved. An empty list allows every peer (vLLM's behaviour).
//!
//! Checked by the node's I/O loop before it dials a peer (a request naming a peer, or a reply
//! to an inbound `connect`) and before it hands an inbound payload to the core: a refused peer is
//! logged with the reason, never dialed, and its messages never reach the protocol. Upstream
//! dials back whatever identity a `connect` claims, which turns every node into a port scanner
//! for anyone who can reach it (spec §8); the allowlist closes that.

use std::net::IpAddr;

use kvpeer_proto::PeerId;

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
    Host(String),
    HostPort(String, u16),
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

    /// `Ok` if `peer` may be talked to, else why not.
    pub fn check(&self, peer: &PeerId) -> Result<(), NotAllowed> {
        if self.rules.is_empty() {
            return Ok(());
        }
        let (host, port) = peer
            .host_port()
            .map_err(|e| NotAllowed::NotHostPort(e.to_string()))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        let ip: Option<IpAddr> = host.parse().ok();
        let allowed = self.rules.iter().any(|rule| match rule {
            Rule::Network { addr, prefix } => ip.is_some_and(|ip| in_network(ip, *addr, *prefix)),
            Rule::Host(h) => same_host(h, host, ip),
            Rule::HostPort(h, p) => *p == port && same_host(h, host, ip),
        });
        if allowed {
            Ok(())
        } else {
            Err(NotAllowed::NotListed)
        }
    }
}

impl Allowlist {
    /// Whether a control connection from `source` may be heard: always with no list or a list
    /// of host names only (a name cannot judge an address); else `source` must match an
    /// address or network rule (a `host:port` rule with an IP host counts, any port).
    pub fn allows_source(&self, source: IpAddr) -> bool {
        let mut ip_rules = self.rules.iter().filter_map(|rule| match rule {
            Rule::Network { addr, prefix } => Some(in_network(source, *addr, *prefix)),
            Rule::Host(h) | Rule::HostPort(h, _) => h
                .parse::<IpAddr>()
                .ok()
                .map(|ip| ip.to_canonical() == source.to_canonical()),
        });
        let Some(first) = ip_rules.next() else {
            return true;
        };
        first || ip_rules.any(|matched| matched)
    }

    /// Whether a rule names the host `host` by name (not by address).
    pub fn names_host(&self, host: &str) -> bool {
        self.rules.iter().any(|rule| match rule {
            Rule::Host(h) | Rule::HostPort(h, _) => {
                h.parse::<IpAddr>().is_err() && h.eq_ignore_ascii_case(host)
            }
            Rule::Network { .. } => false,
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
        let addr: IpAddr = addr.parse().map_err(|_| bad(RuleProblem::NotANetwork))?;
        let max = if addr.is_ipv4() { 32 } else { 128 };
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= max)
            .ok_or_else(|| bad(RuleProblem::BadPrefix))?;
        return Ok(Rule::Network { addr, prefix });
    }
    if rule.parse::<IpAddr>().is_ok() {
        return Ok(Rule::Host(rule.to_owned()));
    }
    if let Some((host, port)) = rule.rsplit_once(':') {
        let port: u16 = port.parse().map_err(|_| bad(RuleProblem::BadPort))?;
        let host = host.trim_start_matches('[').trim_end_matches(']');
        if host.is_empty() {
            return Err(bad(RuleProblem::EmptyHost));
        }
        return Ok(Rule::HostPort(host.to_owned(), port));
    }
    Ok(Rule::Host(rule.to_owned()))
}

fn same_host(rule: &str, host: &str, ip: Option<IpAddr>) -> bool {
    match (rule.parse::<IpAddr>(), ip) {
        (Ok(a), Some(b)) => a == b,
        _ => rule.eq_ignore_ascii_case(host),
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
    fn bad_rules_are_named() {
        for (bad, problem) in [
            ("", RuleProblem::Empty),
            ("10.0.0.0/33", RuleProblem::BadPrefix),
            ("10.0.0.0/x", RuleProblem::BadPrefix),
            ("nope/8", RuleProblem::NotANetwork),
            ("host:port", RuleProblem::BadPort),
            (":5600", RuleProblem::EmptyHost),
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
