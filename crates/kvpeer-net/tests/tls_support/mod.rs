//! A test certificate authority (rcgen) issuing node certificates into PEM files, and a
//! recording relay, for the TLS suites of the tcp plane and the control channel.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use kvpeer_net::tls::TlsFiles;
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, SanType};

mod relay;
#[allow(unused_imports)] // not every suite that uses the CA records the wire
pub(crate) use relay::{contains, Relay};

/// A certificate authority that issues node certificates into a folder of PEM files.
pub(crate) struct Pki {
    pub(crate) dir: PathBuf,
    ca: rcgen::Certificate,
    ca_key: KeyPair,
}

impl Pki {
    pub(crate) fn new(tag: &str) -> Pki {
        let dir = std::env::temp_dir().join(format!("kvpeer-tls-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("kvpeer test CA {tag}"));
        let ca_key = KeyPair::generate().unwrap();
        let ca = params.self_signed(&ca_key).unwrap();
        std::fs::write(dir.join("ca.pem"), ca.pem()).unwrap();
        Pki { dir, ca, ca_key }
    }

    /// A node certificate naming `ips`, valid from `from` to `until` (years), as `name`.pem
    /// and `name`.key, trusting this CA; its files.
    pub(crate) fn issue(&self, name: &str, ips: &[IpAddr], years: (i32, i32)) -> TlsFiles {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.subject_alt_names = ips.iter().map(|ip| SanType::IpAddress(*ip)).collect();
        params.distinguished_name.push(DnType::CommonName, name);
        params.not_before = rcgen::date_time_ymd(years.0, 1, 1);
        params.not_after = rcgen::date_time_ymd(years.1, 1, 1);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let files = TlsFiles {
            cert: self.dir.join(format!("{name}.pem")),
            key: self.dir.join(format!("{name}.key")),
            ca: self.dir.join("ca.pem"),
        };
        std::fs::write(&files.cert, cert.pem()).unwrap();
        std::fs::write(&files.key, key.serialize_pem()).unwrap();
        files
    }

    /// A certificate for `name` valid now.
    pub(crate) fn node(&self, name: &str, ips: &[IpAddr]) -> TlsFiles {
        self.issue(name, ips, (2020, 2090))
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn ip(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

pub(crate) const LOOPBACK: [u8; 4] = [127, 0, 0, 1];

pub(crate) fn loopback() -> IpAddr {
    ip(LOOPBACK[0], LOOPBACK[1], LOOPBACK[2], LOOPBACK[3])
}
