//! TLS 1.3 with mutual authentication for kvpeer's own links between nodes (the tcp data plane
//! today): the node's certificate, key and trusted CA from PEM files, the policy that says
//! whether a peer must, may or must not use it, and the non-blocking glue between a socket and
//! rustls (`stream.rs`).
//!
//! Who calls it: the node's builder loads [`Tls`] once ([`Tls::load`], on its caller's thread:
//! reads three files); the tcp plane's sender and receiver threads ask it for the current
//! rustls configuration each time they open or accept a connection (`Tls::client`,
//! `Tls::server`). Those calls look at the files' modification times at most once per
//! [`RELOAD_CHECK`] and build new configurations when a file changed, so a rotated certificate
//! is used by the next connection while the open ones keep their sessions; a file that fails to
//! load then (half written, a wrong key) keeps the last good configuration and is logged.
//!
//! Identity: a peer is trusted when its certificate chains to the CA (`tls_ca`) and names the
//! address it speaks for: a server (a data listener) is checked against the IP of the peer's
//! identity (its peer id), a client (a writer) against the IP of the peer id its HELLO claims
//! (`names_ip`), as an IP subject alternative name. Expiry and the chain are checked by webpki
//! at every handshake: sessions are never resumed (no tickets, no cache), so every connection
//! presents its certificates again.
//!
//! Ciphers: TLS 1.3 only, AES-128-GCM first (the fastest with AES-NI), then AES-256-GCM and
//! ChaCha20-Poly1305 (ring's).

mod stream;

pub(crate) use stream::{alert_before_close, flush, read, read_noting_drain, write};

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tracing::{info, warn};

use crate::lock;

/// The first byte of a TLS connection: a handshake record (its ClientHello). ZMTP's greeting
/// starts with 0xFF, kvpeer's data HELLO with `K`, so one byte tells them apart (the control
/// listener's sniff, after its offer, and the tcp plane's receiver both read it).
pub(crate) const HANDSHAKE_RECORD: u8 = 0x16;

/// How often the files are looked at for a change, at most.
pub const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// Whether a peer's link uses TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TlsPolicy {
    /// Never: no certificate is needed, and a peer's TLS connection is refused.
    #[default]
    Off,
    /// TLS with every peer that offers it, plaintext with one that does not (an older kvpeer):
    /// an eavesdropper who can also alter the control channel can force plaintext.
    Preferred,
    /// TLS or nothing: a peer that offers no TLS is refused, a plaintext connection too.
    Required,
}

impl TlsPolicy {
    /// Reads `off`, `preferred` or `required`.
    pub fn parse(text: &str) -> Option<TlsPolicy> {
        match text {
            "off" => Some(TlsPolicy::Off),
            "preferred" => Some(TlsPolicy::Preferred),
            "required" => Some(TlsPolicy::Required),
            _ => None,
        }
    }

    /// The config file's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            TlsPolicy::Off => "off",
            TlsPolicy::Preferred => "preferred",
            TlsPolicy::Required => "required",
        }
    }
}

/// Where the node's TLS material is: PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The node's certificate chain (its own first).
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The certificates of the authorities whose peers are trusted.
    pub ca: PathBuf,
}

/// Why TLS material could not be used.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read, or holds no PEM of the kind needed.
    #[error("{what} {path}: {why}")]
    File {
        /// Which file: "tls_cert", "tls_key", "tls_ca".
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong with it.
        why: String,
    },
    /// The files do not make a configuration (a key that is not the certificate's, a CA that
    /// is not a certificate authority, ...).
    #[error("tls_cert {cert} and tls_key {key} cannot be used: {why}")]
    Config {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's or webpki's reason.
        why: String,
    },
}

/// The rustls configurations built from one reading of the files.
struct Built {
    server: Arc<ServerConfig>,
    client: Arc<ClientConfig>,
}

/// What the last look at the files found.
struct Loaded {
    built: Built,
    /// Each file's identity when it was read.
    stamps: [Option<Stamp>; 3],
    checked: Instant,
}

/// The node's TLS material, reloaded when its files change. Cheap to clone.
#[derive(Clone)]
pub struct Tls {
    files: TlsFiles,
    loaded: Arc<Mutex<Loaded>>,
    reloads: Arc<AtomicU64>,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").field("files", &self.files).finish()
    }
}

impl Tls {
    /// Reads the three files and builds the configurations.
    pub fn load(files: TlsFiles) -> Result<Tls, TlsError> {
        let stamps = stamps(&files);
        let built = build(&files)?;
        Ok(Tls {
            files,
            loaded: Arc::new(Mutex::new(Loaded {
                built,
                stamps,
                checked: Instant::now(),
            })),
            reloads: Arc::default(),
        })
    }

    /// The files it reads.
    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// Times the files were read again after a change and made a new configuration.
    pub fn reloads(&self) -> u64 {
        self.reloads.load(Ordering::Relaxed)
    }

    /// The configuration a data listener accepts with (reloaded first if a file changed).
    pub(crate) fn server(&self) -> Arc<ServerConfig> {
        self.fresh(|b| b.server.clone())
    }

    /// The configuration a writer connects with (reloaded first if a file changed).
    pub(crate) fn client(&self) -> Arc<ClientConfig> {
        self.fresh(|b| b.client.clone())
    }

    fn fresh<T>(&self, pick: impl Fn(&Built) -> T) -> T {
        let mut loaded = lock(&self.loaded);
        if loaded.checked.elapsed() >= RELOAD_CHECK {
            loaded.checked = Instant::now();
            let now = stamps(&self.files);
            if now != loaded.stamps {
                match build(&self.files) {
                    Ok(built) => {
                        loaded.built = built;
                        loaded.stamps = now;
                        self.reloads.fetch_add(1, Ordering::Relaxed);
                        info!(cert = %self.files.cert.display(), "TLS certificate files changed; new connections use them");
                    }
                    Err(e) => {
                        // Keep the last good one; look again at the next change (a file still
                        // being written changes again).
                        loaded.stamps = now;
                        if let Some(suppressed) = crate::admit_warning("TLS files reload failed") {
                            warn!(error = %e, suppressed, "TLS certificate files changed but cannot be used; keeping the previous ones");
                        }
                    }
                }
            }
        }
        pick(&loaded.built)
    }
}

/// Whether `cert` (DER) is valid for the IP address `ip` (an IP subject alternative name).
pub(crate) fn names_ip(cert: &CertificateDer<'_>, ip: IpAddr) -> bool {
    let Ok(end) = webpki::EndEntityCert::try_from(cert) else {
        return false;
    };
    end.verify_is_valid_for_subject_name(&ServerName::IpAddress(ip.into()))
        .is_ok()
}

/// What tells one version of a file from another: its inode (a rename puts a new one in
/// place), its change time (set by any write, even one that keeps the modification time, as
/// `cp -p` does), modification time and length.
type Stamp = (u64, i64, i64, SystemTime, u64);

fn stamps(files: &TlsFiles) -> [Option<Stamp>; 3] {
    use std::os::unix::fs::MetadataExt as _;
    let stamp = |p: &Path| {
        let m = std::fs::metadata(p).ok()?;
        Some((
            m.ino(),
            m.ctime(),
            m.ctime_nsec(),
            m.modified().ok()?,
            m.len(),
        ))
    };
    [stamp(&files.cert), stamp(&files.key), stamp(&files.ca)]
}

/// ring's provider with TLS 1.3's suites, AES-128-GCM first.
///
/// rustls 0.23.48 marks ring's provider deprecated because ring has no post-quantum key
/// exchange (X25519MLKEM768 is aws-lc-rs's). kvpeer keeps ring: aws-lc-rs is a large C build
/// (the CI's two cores build every feature set), and the key exchange is X25519; the trade is
/// stated in docs/security.md.
#[allow(deprecated)]
fn provider() -> Arc<CryptoProvider> {
    let mut provider = rustls::crypto::ring::default_provider();
    provider.cipher_suites = vec![
        rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
        rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384,
        rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
    ];
    Arc::new(provider)
}

fn file_error(what: &'static str, path: &Path, why: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        what,
        path: path.to_path_buf(),
        why: why.to_string(),
    }
}

fn certificates(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
        .map_err(|e| file_error(what, path, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(what, path, e))?;
    if certs.is_empty() {
        return Err(file_error(what, path, "no CERTIFICATE in it"));
    }
    Ok(certs)
}

fn build(files: &TlsFiles) -> Result<Built, TlsError> {
    let chain = certificates("tls_cert", &files.cert)?;
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| file_error("tls_key", &files.key, e))?;
    let mut roots = RootCertStore::empty();
    for ca in certificates("tls_ca", &files.ca)? {
        roots
            .add(ca)
            .map_err(|e| file_error("tls_ca", &files.ca, e))?;
    }
    let roots = Arc::new(roots);
    let config_error = |why: String| TlsError::Config {
        cert: files.cert.clone(),
        key: files.key.clone(),
        why,
    };
    let provider = provider();
    let client_verifier =
        WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| config_error(e.to_string()))?;
    let mut server = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config_error(e.to_string()))?
        .with_client_cert_verifier(client_verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| config_error(e.to_string()))?;
    // No resumption: a resumed session would skip the peer's certificate (its expiry, a CA
    // dropped since), and data connections are few and long-lived.
    server.send_tls13_tickets = 0;
    server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    let server_verifier = WebPkiServerVerifier::builder_with_provider(roots, provider.clone())
        .build()
        .map_err(|e| config_error(e.to_string()))?;
    let mut client = ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|e| config_error(e.to_string()))?
        .with_webpki_verifier(server_verifier)
        .with_client_auth_cert(chain, key)
        .map_err(|e| config_error(e.to_string()))?;
    client.resumption = rustls::client::Resumption::disabled();
    Ok(Built {
        server: Arc::new(server),
        client: Arc::new(client),
    })
}
