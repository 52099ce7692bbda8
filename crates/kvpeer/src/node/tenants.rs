//! Tenants: which tenant each peer belongs to, and so whose blocks it may see.
//!
//! Configured as `tenant` (this node's own tenant: an engine's blocks are all its tenant's) and
//! `tenants`, rules `NAME=RULE` in the allowlist's syntax (`alpha=10.0.1.0/24`,
//! `beta=10.0.2.7:5600`), matched against a peer's identity, which the node already holds to
//! its source address (identity binding), its `kvpeer_auth` and, under TLS, its certificate
//! (docs/security.md, "Tenants"). The name `*` marks shared nodes (pool nodes) that every tenant
//! talks to.
//!
//! * **A node with a tenant** (an engine: all its blocks are its tenant's) talks only to peers
//!   of its tenant and to shared nodes: any other peer is refused as the allowlist refuses one
//!   (never dialed, its messages never reach the protocol), so it learns nothing, not even a
//!   miss.
//! * **A node without one** (a pool node holding many tenants' blocks) keeps each tenant's
//!   blocks in an index of its own ([`kvpeer_store::Tenant`]): a block pulled from a peer
//!   belongs to that peer's tenant (from a shared node: to this node's own tenant by the
//!   rules), and a peer's lookups see only its tenant's index.
//! * **Fail closed.** A peer that no rule names, or that two tenants' rules name, is nobody's
//!   ([`Tenant::NOBODY`]): it sees no block and no block is stored for it, so a rule that does
//!   not match (a host name against address rules, a typo) costs misses, never a leak. Shared
//!   nodes see the default tenant (the node's own blocks).
//! * A tenant is as strong as the identity it is read from: an address rule is held to the
//!   message's source address ([`TenantRules::source_fits`]); a port separates processes on
//!   one host only as far as they are honest (TLS names an IP address, not a port); a host-name
//!   identity is heard only when the allowlist names it (docs/security.md, G3, G14).
//!
//! Built once where the node is built (names resolved there, as the allowlist's); asked on the
//! node's thread, by the origin check and by the store (which keeps each peer's answer).

use std::collections::BTreeMap;
use std::net::IpAddr;

use kvpeer_proto::{PeerAddr, PeerId};
use kvpeer_store::{Tenant, TenantOf};

use super::allow::{Allowlist, BadRule};

/// The name that marks shared nodes in `tenants`.
pub const SHARED: &str = "*";

/// Why the tenant settings are refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TenantsError {
    /// A rule without `NAME=`.
    #[error("tenant rule {0:?}: expected NAME=RULE (e.g. alpha=10.0.1.0/24)")]
    NoName(String),
    /// A tenant name that is empty, too long, or holds other than letters, digits, `.`, `_`, `-`.
    #[error("tenant name {0:?}: 1 to 64 letters, digits, '.', '_' or '-' (or * for shared nodes)")]
    BadName(String),
    /// The rule part does not parse.
    #[error("tenant {tenant:?}: {rule}")]
    BadRule {
        /// The tenant the rule is for.
        tenant: String,
        /// What is wrong with it.
        rule: BadRule,
    },
    /// More tenants than the store can number.
    #[error("{0} tenants is more than a node keeps apart (65534)")]
    TooMany(usize),
    /// `tenant` set with no rules: the node would talk to no peer.
    #[error("tenant {0:?} is set but tenants has no rule: the node would talk to no peer")]
    NoRules(String),
    /// `tenant` names a tenant no rule names (a typo?): its own peers would be refused.
    #[error("tenant {0:?} is named by no rule in tenants (NAME=RULE): this node and its tenant's peers must be")]
    Unnamed(String),
    /// `tenant = "*"`.
    #[error("a node's own tenant cannot be * (shared nodes keep no tenant of their own)")]
    OwnShared,
}

/// What the rules say of one peer ([`TenantRules::classify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerClass {
    /// Its tenant.
    pub tenant: Tenant,
    /// Whether a `*` rule names it (a shared node).
    pub shared: bool,
}

/// The rules, numbered: tenant `i + 1` is `names[i]` (the default tenant is 0).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TenantRules {
    names: Vec<String>,
    rules: Vec<Allowlist>,
    /// Rules naming shared nodes (`*=...`), if any.
    shared: Option<Allowlist>,
    /// This node's own tenant.
    own: Option<Tenant>,
}

impl TenantRules {
    /// Parses `tenant` and the `NAME=RULE` rules; an error names the rule and what is wrong.
    pub fn parse<S: AsRef<str>>(own: Option<&str>, rules: &[S]) -> Result<Self, TenantsError> {
        let mut by_name: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for rule in rules {
            let rule = rule.as_ref().trim();
            let (name, body) = rule
                .split_once('=')
                .ok_or_else(|| TenantsError::NoName(rule.to_owned()))?;
            let name = name.trim();
            if name != SHARED && !valid_name(name) {
                return Err(TenantsError::BadName(name.to_owned()));
            }
            by_name
                .entry(name.to_owned())
                .or_default()
                .push(body.trim().to_owned());
        }
        let mut out = TenantRules::default();
        for (name, bodies) in by_name {
            let list = Allowlist::parse(&bodies).map_err(|rule| TenantsError::BadRule {
                tenant: name.clone(),
                rule,
            })?;
            if name == SHARED {
                out.shared = Some(list);
            } else {
                out.names.push(name);
                out.rules.push(list);
            }
        }
        if let Some(own) = own.map(str::trim) {
            if own == SHARED {
                return Err(TenantsError::OwnShared);
            }
            if !valid_name(own) {
                return Err(TenantsError::BadName(own.to_owned()));
            }
            if out.names.is_empty() && out.shared.is_none() {
                return Err(TenantsError::NoRules(own.to_owned()));
            }
            out.own = Some(
                out.number(own)
                    .ok_or_else(|| TenantsError::Unnamed(own.to_owned()))?,
            );
        }
        // 0 is the default tenant, u16::MAX nobody.
        if out.names.len() >= usize::from(u16::MAX) - 1 {
            return Err(TenantsError::TooMany(out.names.len()));
        }
        Ok(out)
    }

    /// Whether no tenant is configured (every peer is the default tenant).
    pub fn is_empty(&self) -> bool {
        self.names.is_empty() && self.shared.is_none()
    }

    /// This node's own tenant, if it has one (then it talks only to that tenant's peers and to
    /// shared nodes).
    pub fn own(&self) -> Option<Tenant> {
        self.own
    }

    /// The tenants' names by number: tenant `i + 1` is `names()[i]`.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The name of tenant `t` (`""` for the default tenant and for nobody).
    pub fn name(&self, t: Tenant) -> &str {
        usize::from(t.0)
            .checked_sub(1)
            .and_then(|i| self.names.get(i))
            .map_or("", String::as_str)
    }

    fn number(&self, name: &str) -> Option<Tenant> {
        let i = self.names.iter().position(|n| n == name)?;
        u16::try_from(i + 1).ok().map(Tenant)
    }

    /// Adds the addresses of names in every rule (as [`Allowlist::resolve_names`]); called once
    /// where the node is built.
    pub fn resolve_names(&mut self, mut resolve: impl FnMut(&str) -> Vec<IpAddr>) {
        for list in self.rules.iter_mut().chain(self.shared.as_mut()) {
            list.resolve_names(&mut resolve);
        }
    }

    /// Which tenant `peer` is, and whether it is a shared node: its identity read once, each
    /// list asked about that reading (every inbound message is judged, so no list parses it
    /// again). The tenant is the one whose rules name it; the default tenant for a shared node
    /// no tenant's rule names, and for everyone when no tenant is configured; else nobody (no
    /// rule names it, or several tenants' do).
    pub fn classify(&self, peer: &PeerId) -> PeerClass {
        if self.is_empty() {
            return PeerClass {
                tenant: Tenant::DEFAULT,
                shared: false,
            };
        }
        // Not `host:port`: no rule can name it.
        let addr = PeerAddr::of(peer).ok();
        let names = |list: &Allowlist| {
            !list.allows_all() && addr.as_ref().is_some_and(|a| list.check_addr(a).is_ok())
        };
        let shared = self.shared.as_ref().is_some_and(names);
        let mut found = None;
        for (i, list) in self.rules.iter().enumerate() {
            if names(list) {
                if found.is_some() {
                    return PeerClass {
                        tenant: Tenant::NOBODY,
                        shared,
                    };
                }
                found = Some(u16::try_from(i + 1).map_or(Tenant::NOBODY, Tenant));
            }
        }
        let tenant = match found {
            Some(t) => t,
            None if shared => Tenant::DEFAULT,
            None => Tenant::NOBODY,
        };
        PeerClass { tenant, shared }
    }

    /// The tenant `peer` belongs to ([`TenantRules::classify`]).
    pub fn tenant_of(&self, peer: &PeerId) -> Tenant {
        self.classify(peer).tenant
    }

    /// Whether `peer` is a shared node (a `*` rule names it).
    pub fn is_shared(&self, peer: &PeerId) -> bool {
        self.classify(peer).shared
    }

    /// Whether a message claiming `peer` may come from `source` as far as tenants go: the
    /// address rules of the tenant that names `peer` (or of shared nodes, for a shared node)
    /// must admit `source` when that tenant has any (a tenant named by host names only admits
    /// any source: a name cannot judge an address, as in the allowlist). So a peer cannot take
    /// another tenant's identity from an address outside that tenant's networks.
    pub fn source_fits(&self, peer: &PeerId, source: IpAddr) -> bool {
        self.class_source_fits(self.classify(peer), source)
    }

    /// [`TenantRules::source_fits`] for a peer already classified.
    pub fn class_source_fits(&self, class: PeerClass, source: IpAddr) -> bool {
        let t = class.tenant;
        let list = match usize::from(t.0)
            .checked_sub(1)
            .and_then(|i| self.rules.get(i))
        {
            Some(list) => list,
            None if t == Tenant::DEFAULT => match &self.shared {
                Some(list) => list,
                None => return true,
            },
            // Nobody's: it sees nothing whatever its source.
            None => return true,
        };
        list.allows_source(source)
    }

    /// For a node with a tenant: whether it may talk to `peer` (of its tenant, or shared).
    /// Always for a node without one.
    pub fn admits(&self, peer: &PeerId) -> bool {
        self.own.is_none() || self.admits_class(self.classify(peer))
    }

    /// [`TenantRules::admits`] for a peer already classified.
    pub fn admits_class(&self, class: PeerClass) -> bool {
        match self.own {
            None => true,
            Some(own) => class.shared || class.tenant == own,
        }
    }

    /// For a node with a tenant: whether a message may come from `source`, by the IP rules of
    /// its tenant and of shared nodes (a tenant named only by host names admits any source:
    /// a name cannot judge an address, as in the allowlist). Always for a node without one.
    pub fn admits_source(&self, source: IpAddr) -> bool {
        let Some(own) = self.own else {
            return true;
        };
        let own_list = usize::from(own.0)
            .checked_sub(1)
            .and_then(|i| self.rules.get(i));
        let lists = own_list.into_iter().chain(self.shared.as_ref());
        let mut any = false;
        for list in lists.filter(|l| !l.allows_all()) {
            any = true;
            if list.allows_source(source) {
                return true;
            }
        }
        !any
    }
}

impl TenantOf for TenantRules {
    fn tenant_of(&self, peer: &PeerId) -> Tenant {
        TenantRules::tenant_of(self, peer)
    }

    fn is_shared(&self, peer: &PeerId) -> bool {
        TenantRules::is_shared(self, peer)
    }
}

fn valid_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn peer(s: &str) -> PeerId {
        PeerId::new(s)
    }

    #[test]
    fn each_peer_is_the_one_tenant_whose_rules_name_it() {
        let t = TenantRules::parse(
            None,
            &[
                "beta=10.0.2.0/24",
                "alpha=10.0.1.0/24",
                "alpha=10.0.9.9:5600",
                "*=10.0.0.1",
            ],
        )
        .unwrap();
        let alpha = t.tenant_of(&peer("10.0.1.7:5600"));
        assert_eq!(t.name(alpha), "alpha");
        assert_eq!(t.tenant_of(&peer("10.0.9.9:5600")), alpha);
        // No rule names it: nobody's (fail closed), not the default tenant's.
        assert_eq!(t.tenant_of(&peer("10.0.9.9:5601")), Tenant::NOBODY);
        assert_eq!(
            t.tenant_of(&peer("vm:5600")),
            Tenant::NOBODY,
            "a name against addresses"
        );
        assert_eq!(t.name(t.tenant_of(&peer("10.0.2.3:1"))), "beta");
        // A shared node sees the default tenant (the node's own blocks).
        assert_eq!(t.tenant_of(&peer("10.0.0.1:7000")), Tenant::DEFAULT);
        assert!(t.is_shared(&peer("10.0.0.1:7000")));
        // With no tenant configured, everyone is the default tenant.
        let none = TenantRules::parse::<&str>(None, &[]).unwrap();
        assert_eq!(none.tenant_of(&peer("10.0.9.9:1")), Tenant::DEFAULT);
        // A node without a tenant of its own talks to everyone the allowlist admits.
        assert!(t.admits(&peer("10.0.2.3:1")) && t.own().is_none());
    }

    #[test]
    fn a_peer_two_tenants_name_sees_nobodys_blocks() {
        let t = TenantRules::parse(None, &["a=10.0.0.0/16", "b=10.0.5.0/24"]).unwrap();
        assert_eq!(t.tenant_of(&peer("10.0.5.1:1")), Tenant::NOBODY);
        assert_eq!(t.name(t.tenant_of(&peer("10.0.6.1:1"))), "a");
    }

    #[test]
    fn a_peer_is_held_to_the_address_rules_of_the_tenant_that_names_it() {
        let t = TenantRules::parse(
            None,
            &["a=10.0.1.0/24", "a=engine-a", "b=engine-b", "*=10.0.0.1"],
        )
        .unwrap();
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        // `engine-a` is tenant a's, whose address rule says where a's messages come from.
        assert!(t.source_fits(&peer("engine-a:5600"), ip("10.0.1.9")));
        assert!(
            !t.source_fits(&peer("engine-a:5600"), ip("10.0.2.9")),
            "from b's host"
        );
        // b is named by a host name only: no address to hold it to.
        assert!(t.source_fits(&peer("engine-b:5600"), ip("10.0.7.7")));
        assert!(t.source_fits(&peer("10.0.0.1:7000"), ip("10.0.0.1")));
        assert!(!t.source_fits(&peer("10.0.0.1:7000"), ip("10.0.0.2")));
    }

    #[test]
    fn a_node_with_a_tenant_admits_only_its_tenant_and_shared_nodes() {
        let t = TenantRules::parse(
            Some("alpha"),
            &["alpha=10.0.1.0/24", "beta=10.0.2.0/24", "*=10.0.0.1:7000"],
        )
        .unwrap();
        assert!(t.admits(&peer("10.0.1.7:5600")));
        assert!(t.admits(&peer("10.0.0.1:7000")));
        assert!(!t.admits(&peer("10.0.2.7:5600")), "another tenant");
        assert!(!t.admits(&peer("10.0.3.7:5600")), "no tenant");
        assert!(!t.admits(&peer("10.0.0.1:7001")), "not the shared node");
        assert!(t.admits_source("10.0.1.9".parse().unwrap()));
        assert!(t.admits_source("10.0.0.1".parse().unwrap()));
        assert!(!t.admits_source("10.0.2.7".parse().unwrap()));
    }

    #[test]
    fn bad_settings_say_which_rule_and_why() {
        let e = |own: Option<&str>, rules: &[&str]| TenantRules::parse(own, rules).unwrap_err();
        assert_eq!(
            e(None, &["10.0.0.0/8"]),
            TenantsError::NoName("10.0.0.0/8".into())
        );
        assert_eq!(
            e(None, &["a b=10.0.0.1"]),
            TenantsError::BadName("a b".into())
        );
        assert!(matches!(
            e(None, &["a=10.0.0.0/99"]),
            TenantsError::BadRule { tenant, .. } if tenant == "a"
        ));
        assert_eq!(e(Some("a"), &[]), TenantsError::NoRules("a".into()));
        assert_eq!(e(Some("*"), &["a=10.0.0.1"]), TenantsError::OwnShared);
        // An own tenant no rule names (a typo): refused, not a node that talks to no peer.
        assert_eq!(
            e(Some("alpah"), &["alpha=10.0.0.1", "*=10.0.0.2"]),
            TenantsError::Unnamed("alpah".into())
        );
    }
}
