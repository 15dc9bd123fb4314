//! What the daemon's integration tests share: where the models are, and a daemon started on a
//! thread of its own. Each test binary uses its part.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

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
