//! Load generator for a running `engramd` (not a test; see `bench/load.sh`).
//!
//! 1. Throughput: for each stream count (default 1 and 8), that many clients each send
//!    `--requests` chat completions of `--max-tokens` tokens at once; the aggregate decode
//!    rate is the generated tokens (`usage.completion_tokens`) over the phase's wall time,
//!    and the ratio to one stream is printed.
//! 2. Overload: `--clients` clients loop for `--seconds`, counting 2xx, 429 and everything
//!    else (other statuses and connection failures are errors), while the daemon's RSS
//!    (`/proc/<pid>/status`, with `--pid`) is sampled every 100 ms.
//!
//! ```sh
//! cargo run --release -p engram-server --example load -- --url http://127.0.0.1:8080 \
//!     --key "$KEY" --pid "$(pgrep -n engramd)" [--collection handbook]
//! ```

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "support/http.rs"]
mod http;
use http::{addr_of, post};

struct Args {
    addr: SocketAddr,
    key: String,
    collection: Option<String>,
    max_tokens: usize,
    streams: Vec<usize>,
    requests: usize,
    clients: usize,
    seconds: u64,
    pid: Option<u32>,
}

fn args() -> Args {
    let mut a = Args {
        addr: "127.0.0.1:8080".parse().unwrap(),
        key: std::env::var("ENGRAM_KEY").unwrap_or_default(),
        collection: None,
        max_tokens: 64,
        streams: vec![1, 8],
        requests: 2,
        clients: 64,
        seconds: 30,
        pid: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().unwrap_or_else(|| panic!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => a.addr = addr_of(&val()),
            "--key" => a.key = val(),
            "--collection" => a.collection = Some(val()),
            "--max-tokens" => a.max_tokens = val().parse().unwrap(),
            "--streams" => a.streams = val().split(',').map(|s| s.parse().unwrap()).collect(),
            "--requests" => a.requests = val().parse().unwrap(),
            "--clients" => a.clients = val().parse().unwrap(),
            "--seconds" => a.seconds = val().parse().unwrap(),
            "--pid" => a.pid = Some(val().parse().unwrap()),
            _ => panic!("unknown flag {flag}; see the source's header"),
        }
    }
    a
}

fn chat_body(a: &Args, i: usize) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": format!("Write a short story about lighthouse number {i}.")}],
        "max_tokens": a.max_tokens,
        "temperature": 0.7,
        "seed": i,
    });
    if let Some(c) = &a.collection {
        b["engram"] = json!({"collections": [c], "top_k": 3});
    }
    b
}

fn rss_kib(pid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let field = |name: &str| {
        s.lines()
            .find(|l| l.starts_with(name))?
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

fn main() {
    let a = Arc::new(args());
    let mut base = None;
    for &n in &a.streams {
        let start = Instant::now();
        let handles: Vec<_> = (0..n)
            .map(|c| {
                let a = a.clone();
                std::thread::spawn(move || {
                    let mut tokens = 0u64;
                    let mut timings = Vec::new();
                    for r in 0..a.requests {
                        let (status, body) = post(
                            a.addr,
                            &a.key,
                            "/v1/chat/completions",
                            &chat_body(&a, c * 1000 + r),
                        )
                        .expect("the daemon answers");
                        assert_eq!(status, 200, "{body}");
                        tokens += body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        if let Some(t) = body["engram"]["timings"].as_object() {
                            timings.push(t.clone());
                        }
                    }
                    (tokens, timings)
                })
            })
            .collect();
        let (mut tokens, mut timings) = (0u64, Vec::new());
        for h in handles {
            let (t, ts) = h.join().unwrap();
            tokens += t;
            timings.extend(ts);
        }
        let rate = tokens as f64 / start.elapsed().as_secs_f64();
        let ratio = *base.get_or_insert(rate);
        println!(
            "streams={n:<3} tokens={tokens:<6} wall={:>6.1}s aggregate={rate:>7.1} tok/s ({:.2}x one stream)",
            start.elapsed().as_secs_f64(),
            rate / ratio
        );
        if !timings.is_empty() {
            // Where a request's time went, as the daemon reports it (means, milliseconds).
            let mean = |k: &str| {
                timings
                    .iter()
                    .filter_map(|t| t.get(k)?.as_f64())
                    .sum::<f64>()
                    / timings.len() as f64
            };
            println!(
                "            mean ms: queue {:.0}  retrieve {:.0}  prefill {:.0} (kv load {:.0}, recompute {:.0}, question {:.0})  first token {:.0}  decode {:.0}",
                mean("queue_ms"),
                mean("retrieve_ms"),
                mean("prefill_total_ms"),
                mean("kv_load_ms"),
                mean("recompute_ms"),
                mean("question_prefill_ms"),
                mean("first_token_ms"),
                mean("decode_ms"),
            );
        }
    }

    let stop = Arc::new(AtomicBool::new(false));
    let counts: Arc<[AtomicU64; 3]> = Arc::new(Default::default());
    let handles: Vec<_> = (0..a.clients)
        .map(|c| {
            let (a, stop, counts) = (a.clone(), stop.clone(), counts.clone());
            std::thread::spawn(move || {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    let slot = match post(
                        a.addr,
                        &a.key,
                        "/v1/chat/completions",
                        &chat_body(&a, c * 100_000 + i),
                    ) {
                        Ok((s, _)) if (200..300).contains(&s) => 0,
                        Ok((429, _)) => {
                            std::thread::sleep(Duration::from_millis(200));
                            1
                        }
                        Ok(_) | Err(_) => 2,
                    };
                    counts[slot].fetch_add(1, Ordering::Relaxed);
                    i += 1;
                }
            })
        })
        .collect();
    let start = Instant::now();
    let mut peak = 0;
    while start.elapsed() < Duration::from_secs(a.seconds) {
        if let Some((rss, _)) = a.pid.and_then(rss_kib) {
            peak = peak.max(rss);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    stop.store(true, Ordering::Relaxed);
    for h in handles {
        h.join().unwrap();
    }
    let hwm = a.pid.and_then(rss_kib).map(|(_, h)| h);
    println!(
        "clients={} seconds={} ok={} rejected_429={} errors={} peak_rss={} MiB (VmHWM {} MiB)",
        a.clients,
        a.seconds,
        counts[0].load(Ordering::Relaxed),
        counts[1].load(Ordering::Relaxed),
        counts[2].load(Ordering::Relaxed),
        peak >> 10,
        hwm.map_or_else(|| "?".into(), |h| (h >> 10).to_string()),
    );
    if counts[2].load(Ordering::Relaxed) > 0 {
        std::process::exit(1);
    }
}
