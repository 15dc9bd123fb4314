//! Process lifecycle: `sd_notify` messages to systemd (a datagram to `$NOTIFY_SOCKET`, no
//! libsystemd) and the shutdown signal (SIGTERM or SIGINT).

use std::os::unix::net::UnixDatagram;

/// Sends `state` (e.g. `READY=1`) to systemd when run under `Type=notify`; a no-op otherwise.
/// Failures are logged, never fatal: the daemon works without systemd.
pub fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = UnixDatagram::unbound().and_then(|sock| {
        let bytes = path.as_encoded_bytes();
        if let Some(name) = bytes.strip_prefix(b"@") {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
            sock.send_to_addr(state.as_bytes(), &addr)
        } else {
            sock.send_to(state.as_bytes(), &path)
        }
    });
    match sent {
        Ok(_) => tracing::debug!(state, "sd_notify sent"),
        Err(e) => tracing::warn!(state, "sd_notify failed: {e}"),
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("installing the SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("installing the SIGINT handler");
    let which = tokio::select! {
        _ = term.recv() => "SIGTERM",
        _ = int.recv() => "SIGINT",
    };
    tracing::info!(
        signal = which,
        "shutting down: no new connections, finishing in-flight requests"
    );
    sd_notify("STOPPING=1");
}

#[cfg(test)]
mod tests {
    #[test]
    fn notify_reaches_a_datagram_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let sock = std::os::unix::net::UnixDatagram::bind(&path).unwrap();
        // SAFETY-free: tests in this binary do not read NOTIFY_SOCKET concurrently.
        unsafe_env_set(&path);
        super::sd_notify("READY=1");
        let mut buf = [0u8; 64];
        let n = sock.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }

    fn unsafe_env_set(path: &std::path::Path) {
        // set_var is unsafe in edition 2024 only; this crate is edition 2021.
        std::env::set_var("NOTIFY_SOCKET", path);
    }
}
