//! Multiply-adds per second of causal prefill attention at SmolLM2-135M's shape (9 query heads
//! over 3 KV heads of 64 dimensions, an f16 cache), on one and two threads: one layer's
//! `attention` call, timed alone. The cases are whole prompts of 512 and 2048 tokens, and the
//! shape of a fused prefill's question: its last 96 tokens over a 4,352-token cache (a MuSiQue
//! prompt whose chunks were placed from stored KV).
//!
//! ```text
//! cargo run --release -p engram-kernels --example attention_prefill
//! ```
//!
//! The multiply-adds counted are the causal ones (`q . k` and `p v` for every key a query sees:
//! `2 * heads * head_dim` per query and key it sees). `ENGRAM_BENCH_REPS` (default 7) sets the timed
//! repetitions per case; the best one is reported (a noisy neighbour only slows one down).

use std::time::{Duration, Instant};

use engram_kernels::{attention, f16, key_tile_index, Attention, ThreadPool, KV_TILE};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> engram_kernels::Result<()> {
    let reps = env("ENGRAM_BENCH_REPS", 7).max(1);
    let (n_head, n_head_kv, hd) = (9, 3, 64);
    println!(
        "kernels={} heads={n_head}/{n_head_kv} head_dim={hd} reps={reps} (GMAC/s = causal multiply-adds / best time)",
        engram_kernels::kernels_in_use()
    );
    println!(
        "{:>7} {:>7} {:>7} {:>10} {:>10}",
        "cache", "queries", "threads", "ms", "GMAC/s"
    );
    // (cache slots, query tokens): the queries are the last tokens of the cache.
    for (n, n_q) in [(512usize, 512usize), (2048, 2048), (4352, 96)] {
        // Deterministic values in [-1, 1): a fixed hash of the index.
        let val = |i: usize| ((i * 2_654_435_761) % 2000) as f32 / 1000.0 - 1.0;
        let q: Vec<f32> = (0..n_q * n_head * hd).map(|i| 2.0 * val(i)).collect();
        let keys: Vec<Vec<f16>> = (0..n_head_kv)
            .map(|h| {
                let mut t = vec![f16::ZERO; n.div_ceil(KV_TILE) * KV_TILE * hd];
                for slot in 0..n {
                    for d in 0..hd {
                        t[key_tile_index(slot, d, hd)] =
                            f16::from_f32(val((h * n + slot) * hd + d + 7));
                    }
                }
                t
            })
            .collect();
        let values: Vec<Vec<f16>> = (0..n_head_kv)
            .map(|h| {
                (0..n * hd)
                    .map(|i| f16::from_f32(val(h * n * hd + i + 13)))
                    .collect()
            })
            .collect();
        let pos: Vec<i32> = (0..n as i32).collect();
        let q_pos = &pos[n - n_q..];
        let key_refs: Vec<&[f16]> = keys.iter().map(|k| &k[..]).collect();
        let value_refs: Vec<&[f16]> = values.iter().map(|v| &v[..]).collect();
        let a = Attention {
            n_head,
            n_head_kv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            q: &q,
            q_pos,
            keys: &key_refs,
            values: &value_refs,
            kv_pos: &pos,
        };
        let seen: usize = q_pos.iter().map(|&p| p as usize + 1).sum();
        let macs = 2.0 * (n_head * hd) as f64 * seen as f64;
        let mut out = vec![0.0f32; q.len()];
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads)?;
            attention(&a, &mut out, &pool)?;
            let mut best = Duration::MAX;
            for _ in 0..reps {
                let t0 = Instant::now();
                attention(&a, &mut out, &pool)?;
                best = best.min(t0.elapsed());
            }
            let s = best.as_secs_f64();
            println!(
                "{n:>7} {n_q:>7} {threads:>7} {:>10.2} {:>10.1}",
                s * 1e3,
                macs / s / 1e9
            );
        }
    }
    Ok(())
}
