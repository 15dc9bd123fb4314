//! What the daemon's integration tests share: where the models are, and a daemon started on a
//! thread of its own. Each test binary uses its part.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::Value;

use engram_server::{Daemon, Overrides, RawConfig};

/// `$ENGRAM_MODELS_DIR`, default `<workspace>/models`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("ENGRAM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models")))
}

/// Starts a daemon on `data_dir` with the configuration `toml` (plus the models, 2 threads
/// and an ephemeral loopback port) on a thread of its own; returns its address once it
/// serves.
pub fn start_daemon(toml: &str, data_dir: &Path) -> SocketAddr {
    let mut raw = RawConfig::parse(toml).unwrap();
    raw.models.dir = Some(models_dir());
    raw.models.threads = Some(2);
    raw.apply_overrides(&Overrides {
        listen: Some("127.0.0.1:0".into()),
        data_dir: Some(data_dir.to_owned()),
    });
    let config = raw.validate().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let d = Daemon::build(config).await.expect("the daemon starts");
            tx.send(d.local_addr()).unwrap();
            d.serve(std::future::pending()).await.unwrap();
        });
    });
    rx.recv_timeout(Duration::from_secs(300))
        .expect("server up")
}

/// A response, read whole.
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.text()))
    }
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    pub fn error_type(&self) -> String {
        self.json()["error"]["type"]
            .as_str()
            .unwrap_or("")
            .to_owned()
    }
}

/// One HTTP/1.1 request with `Connection: close`; the response read to the end (chunked bodies
/// decoded).
pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: Option<&str>,
    body: Option<(&str, Vec<u8>)>,
) -> Resp {
    let auth = key.map(|k| format!("Bearer {k}"));
    let headers: Vec<(&str, &str)> = auth.iter().map(|a| ("Authorization", a.as_str())).collect();
    send(addr, method, path, &headers, body)
}

/// [`request`] with any request headers (a `Cookie`, a CSRF token, `Accept-Language`).
pub fn send(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<(&str, Vec<u8>)>,
) -> Resp {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(300))).unwrap();
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    let bytes = match body {
        Some((ct, b)) => {
            head.push_str(&format!(
                "Content-Type: {ct}\r\nContent-Length: {}\r\n",
                b.len()
            ));
            b
        }
        None => Vec::new(),
    };
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    let _ = s.write_all(&bytes);
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("a response head");
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect();
    let mut body = raw[split + 4..].to_vec();
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    if chunked {
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(nl) = body[at..].windows(2).position(|w| w == b"\r\n") {
            let size =
                usize::from_str_radix(std::str::from_utf8(&body[at..at + nl]).unwrap().trim(), 16)
                    .unwrap();
            at += nl + 2;
            if size == 0 {
                break;
            }
            out.extend_from_slice(&body[at..at + size]);
            at += size + 2;
        }
        body = out;
    }
    Resp {
        status,
        headers,
        body,
    }
}
