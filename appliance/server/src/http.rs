//! The listener: one HTTP/1.1 connection loop (hyper) for plain HTTP and for TLS, with the
//! limits on a request's head and a bounded graceful shutdown.

use std::time::Duration;

use axum::extract::{ConnectInfo, Request};
use axum::http::HeaderValue;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use tower::ServiceExt;

use crate::error::ApiError;
use crate::tls::Tls;

/// How long in-flight requests get to finish at shutdown.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(110);

/// The most bytes of request headers a request may carry (names and values). Far above real
/// requests (a long bearer token or a session cookie is a few hundred bytes), it still answers
/// an oversized head with the JSON error every refusal has, `431 headers_too_large`, which
/// hyper's own limit ([`MAX_HEAD_BYTES`]) cannot.
pub const MAX_HEADER_BYTES: usize = 64 << 10;

/// The largest request head hyper buffers before it refuses the connection itself with a bare
/// 431 and no body. Large enough that heads up to a few MiB reach [`limit_headers`] and get the
/// JSON error; a connection's buffer only grows that far when its client sends such a head.
pub const MAX_HEAD_BYTES: usize = 4 << 20;

/// Refuses a request whose headers add up to more than [`MAX_HEADER_BYTES`] with `431`
/// (before authentication: the key is not even read).
pub async fn limit_headers(req: Request, next: Next) -> Response {
    let bytes: usize = req
        .headers()
        .iter()
        .map(|(k, v)| k.as_str().len() + v.len())
        .sum();
    if bytes > MAX_HEADER_BYTES {
        return ApiError::HeadersTooLarge {
            limit: MAX_HEADER_BYTES,
        }
        .into_response();
    }
    next.run(req).await
}

/// Serves `app` on `listener` (over TLS when `tls` is given) until `shutdown` resolves, then
/// stops accepting and lets in-flight requests finish (up to [`DRAIN_TIMEOUT`]).
pub async fn serve(
    listener: tokio::net::TcpListener,
    app: axum::Router,
    tls: Option<Tls>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let https = tls.is_some();
    let app = if https {
        crate::tls::with_hsts(app)
    } else {
        app
    };
    let tls = tls.map(std::sync::Arc::new);
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of descriptors and the like: wait a little rather than spin.
                    tracing::warn!("accept: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Streamed answers write a small event per token: none waits on Nagle's algorithm for
        // the client's delayed acknowledgement.
        let _ = tcp.set_nodelay(true);
        let tls = tls.clone();
        let app = app.clone();
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let service =
                hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let mut req = req.map(axum::body::Body::new);
                    req.extensions_mut().insert(ConnectInfo(peer));
                    if https {
                        // What the console reads to mark its cookies Secure (as behind a TLS
                        // proxy); set here, so a client cannot say otherwise.
                        req.headers_mut()
                            .insert("x-forwarded-proto", HeaderValue::from_static("https"));
                    }
                    app.clone().oneshot(req)
                });
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder.max_buf_size(MAX_HEAD_BYTES);
            let served = match tls {
                Some(tls) => {
                    let Some(stream) = tls.accept(tcp, peer).await else {
                        return;
                    };
                    let conn =
                        builder.serve_connection(hyper_util::rt::TokioIo::new(stream), service);
                    watcher.watch(conn).await
                }
                None => {
                    let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(tcp), service);
                    watcher.watch(conn).await
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, "connection: {e}");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(DRAIN_TIMEOUT, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("requests still running after {DRAIN_TIMEOUT:?}: closing them");
    }
    Ok(())
}
