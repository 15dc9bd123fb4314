//! TLS on the daemon's own listener (rustls with ring): the certificate and key the
//! configuration names, or a self-signed pair generated at the first start in
//! `<data dir>/tls/` (its SHA-256 fingerprint logged and kept in `tls/fingerprint`, so a client
//! can pin it). Plain HTTP arriving at the TLS port is answered with a redirect to `https://`,
//! and every response over TLS carries `Strict-Transport-Security`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::http::{header, HeaderValue};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::TlsAcceptor;

use crate::error::{Result, ServerError};

/// Where the generated certificate lives, under the data directory.
pub const TLS_DIR: &str = "tls";
/// How long a client may take to finish its handshake or send a plain request's head.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// `Strict-Transport-Security`: a year.
const HSTS: &str = "max-age=31536000";

/// What the configuration asks for (`[tls]`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum TlsSetting {
    /// Plain HTTP.
    Off,
    /// TLS with these PEM files, or with a generated self-signed pair when `None`.
    On(Option<(PathBuf, PathBuf)>),
}

/// The listener's TLS, ready to accept.
pub struct Tls {
    acceptor: TlsAcceptor,
    /// SHA-256 of the certificate (DER), as `AB:CD:...`.
    pub fingerprint: String,
    pub self_signed: bool,
    pub cert_path: PathBuf,
}

/// Loads the configured pair, or the generated one (made now if missing).
pub fn load(
    files: Option<&(PathBuf, PathBuf)>,
    data_dir: &Path,
    listen: SocketAddr,
) -> Result<Tls> {
    let (cert_path, key_path, self_signed) = match files {
        Some((c, k)) => (c.clone(), k.clone(), false),
        None => {
            let dir = data_dir.join(TLS_DIR);
            let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
            if !c.exists() || !k.exists() {
                generate(&dir, listen)?;
            }
            (c, k, true)
        }
    };
    let bad =
        |path: &Path, e: String| ServerError::config("tls", format!("{}: {e}", path.display()));
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&cert_path)
        .map_err(|e| bad(&cert_path, e.to_string()))?
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| bad(&cert_path, e.to_string()))?;
    let leaf = certs
        .first()
        .ok_or_else(|| bad(&cert_path, "no certificate in the file".into()))?;
    let fingerprint = fingerprint(leaf);
    let key = PrivateKeyDer::from_pem_file(&key_path).map_err(|e| bad(&key_path, e.to_string()))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServerError::config("tls", e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| {
            bad(
                &cert_path,
                format!("the key does not fit the certificate: {e}"),
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    if self_signed {
        let _ = std::fs::write(
            data_dir.join(TLS_DIR).join("fingerprint"),
            format!("{fingerprint}\n"),
        );
    }
    Ok(Tls {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        fingerprint,
        self_signed,
        cert_path,
    })
}

/// A self-signed certificate for this host's names and addresses (`localhost`, loopback, the
/// host name, the listen address when it is a specific one), key mode 0600, both written
/// crash-safely.
fn generate(dir: &Path, listen: SocketAddr) -> Result<()> {
    let mut names = vec![
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        "::1".to_owned(),
    ];
    if let Ok(host) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
        let host = host.trim();
        if !host.is_empty() && !names.iter().any(|n| n == host) {
            names.push(host.to_owned());
        }
    }
    if !listen.ip().is_unspecified() && !listen.ip().is_loopback() {
        names.push(listen.ip().to_string());
    }
    let pair = rcgen::generate_simple_self_signed(names)
        .map_err(|e| ServerError::config("tls", format!("generating a certificate: {e}")))?;
    std::fs::create_dir_all(dir).map_err(|e| ServerError::io("creating", dir, e))?;
    crate::atomic::write_atomic(
        &dir.join("key.pem"),
        pair.key_pair.serialize_pem().as_bytes(),
    )?;
    crate::atomic::write_atomic(&dir.join("cert.pem"), pair.cert.pem().as_bytes())?;
    tracing::warn!(
        dir = %dir.display(),
        "generated a self-signed TLS certificate: clients must pin it or trust cert.pem; set \
         [tls] cert and key to use your own"
    );
    Ok(())
}

fn fingerprint(cert: &CertificateDer<'_>) -> String {
    Sha256::digest(cert.as_ref())
        .iter()
        .map(|b| format!("{b:02X}"))
        .collect::<Vec<_>>()
        .join(":")
}

impl Tls {
    /// The TLS stream of a connection to the TLS port, once its handshake is done (within
    /// [`HANDSHAKE_TIMEOUT`]); `None` when it ends first, fails, or turns out to be plain HTTP
    /// (answered with a redirect to `https://`).
    pub(crate) async fn accept(
        &self,
        tcp: tokio::net::TcpStream,
        peer: SocketAddr,
    ) -> Option<tokio_rustls::server::TlsStream<tokio::net::TcpStream>> {
        let mut first = [0u8; 1];
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, tcp.peek(&mut first)).await {
            Ok(Ok(1)) => {}
            _ => return None,
        }
        // A TLS record starts with 0x16 (handshake); anything else is plain HTTP.
        if first[0] != 0x16 {
            let _ = tokio::time::timeout(HANDSHAKE_TIMEOUT, redirect_plain(tcp)).await;
            return None;
        }
        match tokio::time::timeout(HANDSHAKE_TIMEOUT, self.acceptor.accept(tcp)).await {
            Ok(Ok(s)) => Some(s),
            Ok(Err(e)) => {
                tracing::debug!(%peer, "TLS handshake failed: {e}");
                None
            }
            Err(_) => None,
        }
    }
}

/// `app` with `Strict-Transport-Security` on every response, for the TLS listener.
pub(crate) fn with_hsts(app: axum::Router) -> axum::Router {
    app.layer(axum::middleware::map_response(
        |mut res: axum::response::Response| async move {
            res.headers_mut().insert(
                header::STRICT_TRANSPORT_SECURITY,
                HeaderValue::from_static(HSTS),
            );
            res
        },
    ))
}

/// Answers a plain-HTTP request on the TLS port with a permanent redirect to the same path
/// over `https://` (a request without a Host header gets 400).
async fn redirect_plain(mut tcp: tokio::net::TcpStream) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && head.len() < 8192 {
        let n = tcp.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        head.extend_from_slice(&buf[..n]);
    }
    let text = String::from_utf8_lossy(&head);
    let mut lines = text.lines();
    let path = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .filter(|p| p.starts_with('/'))
        .unwrap_or("/")
        .to_owned();
    let host = lines
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim()
                .eq_ignore_ascii_case("host")
                .then(|| v.trim().to_owned())
        })
        .filter(|h| !h.is_empty() && h.bytes().all(|b| b.is_ascii_graphic()));
    let reply = match host {
        Some(h) => {
            let body = "this port speaks HTTPS\n";
            format!(
                "HTTP/1.1 308 Permanent Redirect\r\nLocation: https://{h}{path}\r\n\
                 Content-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                body.len()
            )
        }
        None => {
            let body = "this port speaks HTTPS; plain HTTP without a Host header is refused\n";
            format!(
                "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            )
        }
    };
    tcp.write_all(reply.as_bytes()).await?;
    tcp.shutdown().await
}
