//! SIGTERM during uploads loses no acknowledged document: the real `engramd` binary is
//! started on a throwaway data directory, several clients upload concurrently, the daemon
//! gets SIGTERM while uploads are in flight, and after a restart every document whose upload
//! got a 2xx is there (queued, in progress or done) and then gets done.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Upload clients running at once.
const CLIENTS: usize = 6;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// One request with `Connection: close`; `None` when the connection fails or the response is
/// cut (the daemon is going away), else (status, body).
fn call(
    addr: SocketAddr,
    method: &str,
    path: &str,
    key: &str,
    body: Option<&Value>,
) -> Option<(u16, Value)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(120))).ok()?;
    let body = body
        .map(|b| serde_json::to_vec(b).unwrap())
        .unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    s.write_all(&body).ok()?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).ok()?;
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = String::from_utf8_lossy(&raw[..split]);
    let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = Vec::new();
        let mut at = 0;
        while let Some(nl) = body[at..].windows(2).position(|w| w == b"\r\n") {
            let size =
                usize::from_str_radix(std::str::from_utf8(&body[at..at + nl]).ok()?.trim(), 16)
                    .ok()?;
            at += nl + 2;
            if size == 0 {
                break;
            }
            out.extend_from_slice(body.get(at..at + size)?);
            at += size + 2;
        }
        body = out;
    }
    Some((status, serde_json::from_slice(&body).unwrap_or(Value::Null)))
}

struct Daemon {
    child: Child,
    addr: SocketAddr,
}

impl Daemon {
    fn start(data: &Path, config: &Path) -> Daemon {
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_engramd"))
            .args(["--config"])
            .arg(config)
            .arg("--data-dir")
            .arg(data)
            .args(["--listen", &addr.to_string()])
            .env("ENGRAM_MODELS_DIR", common::models_dir())
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("engramd starts");
        let deadline = Instant::now() + Duration::from_secs(300);
        let mut d = Daemon { child, addr };
        loop {
            if let Some((200, _)) = call(addr, "GET", "/healthz", "", None) {
                return d;
            }
            if let Some(status) = d.child.try_wait().unwrap() {
                panic!("engramd exited while starting: {status}");
            }
            assert!(Instant::now() < deadline, "engramd did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn terminate(&mut self) {
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap()
            .success();
        assert!(ok, "kill -TERM failed");
    }

    /// Waits for the process to exit; returns whether it exited on its own in time.
    fn wait(&mut self, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if self.child.try_wait().unwrap().is_some() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        false
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        if self.child.try_wait().ok().flatten().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

#[test]
fn sigterm_during_uploads_loses_no_acknowledged_document() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let config = dir.path().join("engramd.toml");
    std::fs::write(
        &config,
        "[models]\nthreads = 2\n[kv]\ndram_mib = 64\nnvme_gib = 1\n[limits]\ningest_concurrency = 64\n\
         [storage]\nreserve_mib = 16\n",
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_engramd"))
        .args(["keys", "create", "--scopes", "admin", "--data-dir"])
        .arg(&data)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = String::from_utf8(out.stdout).unwrap().trim().to_owned();

    let mut d = Daemon::start(&data, &config);
    let addr = d.addr;
    let r = call(
        addr,
        "POST",
        "/api/v1/collections",
        &key,
        Some(&json!({"name": "up"})),
    )
    .unwrap();
    assert_eq!(r.0, 201, "{}", r.1);

    // Clients upload until the daemon stops answering; every 2xx is an acknowledgement.
    let acked: Arc<Mutex<Vec<(String, u64)>>> = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let clients: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let (acked, stop, key) = (acked.clone(), stop.clone(), key.clone());
            std::thread::spawn(move || {
                let mut misses = 0;
                for i in 0.. {
                    if stop.load(Ordering::Relaxed) || misses >= 3 {
                        break;
                    }
                    let name = format!("c{c}-{i}.md");
                    let text = format!(
                        "# Note {c}-{i}\n\nClient {c} wrote note {i}: valve {i} at station {c} \
                         was inspected and {} litres flowed.\n",
                        c * 1000 + i
                    );
                    match call(
                        addr,
                        "POST",
                        "/api/v1/collections/up/documents/text",
                        &key,
                        Some(&json!({"name": name, "text": text})),
                    ) {
                        Some((status, body)) if (200..300).contains(&status) => {
                            let doc = &body["documents"][0];
                            let id = doc["id"].as_u64().unwrap_or_else(|| panic!("{body}"));
                            acked.lock().unwrap().push((name, id));
                        }
                        Some((429, _)) => std::thread::sleep(Duration::from_millis(20)),
                        Some((status, body)) => panic!("upload answered {status}: {body}"),
                        None => misses += 1,
                    }
                }
            })
        })
        .collect();
    // Let uploads (and background processing) run, then SIGTERM in the middle of them.
    let t = Instant::now();
    while acked.lock().unwrap().len() < 20 && t.elapsed() < Duration::from_secs(60) {
        std::thread::sleep(Duration::from_millis(20));
    }
    d.terminate();
    let exited = d.wait(Duration::from_secs(120));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    assert!(exited, "engramd did not stop within 120 s of SIGTERM");
    let acked = acked.lock().unwrap().clone();
    assert!(
        acked.len() >= 20,
        "only {} uploads acknowledged",
        acked.len()
    );

    // Restart: every acknowledged document is there, then done.
    let d = Daemon::start(&data, &config);
    let list = |d: &Daemon| {
        let (status, body) = call(
            d.addr,
            "GET",
            "/api/v1/collections/up/documents",
            &key,
            None,
        )
        .unwrap();
        assert_eq!(status, 200, "{body}");
        body["documents"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| {
                (
                    v["id"].as_u64().unwrap(),
                    (
                        v["name"].as_str().unwrap().to_owned(),
                        v["stage"].as_str().unwrap().to_owned(),
                    ),
                )
            })
            .collect::<std::collections::HashMap<u64, (String, String)>>()
    };
    let docs = list(&d);
    for (name, id) in &acked {
        let (n, stage) = docs
            .get(id)
            .unwrap_or_else(|| panic!("acknowledged document {name} ({id}) is lost"));
        assert_eq!(n, name);
        assert_ne!(stage, "failed", "{name}");
    }
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let docs = list(&d);
        if acked.iter().all(|(_, id)| docs[id].1 == "done") {
            break;
        }
        assert!(Instant::now() < deadline, "not all documents got done");
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "{} uploads acknowledged before SIGTERM; all done after restart",
        acked.len()
    );
}
