//! GFLOP/s of the two f32 matmul paths at the all-MiniLM-L6-v2 embedder's shapes, in one
//! process: `matmul` on `GgmlType::F32` weights (inner-product tiles) against `matmul_packed`
//! on the same weights packed once (outer-product micro-kernels), on 1 and 2 threads.
//!
//! ```text
//! cargo run --release -p engram-kernels --example f32_gemm
//! ENGRAM_KERNELS_ISA=avx2 cargo run --release -p engram-kernels --example f32_gemm
//! ```
//!
//! `ENGRAM_BENCH_TOKENS` (default 4096) sets the token count, `ENGRAM_BENCH_REPS` (default 7)
//! the timed repetitions per case; the best repetition is reported. The two paths alternate,
//! so a noisy neighbour slows both alike.

use std::time::{Duration, Instant};

use engram_kernels::{matmul, matmul_packed, GgmlType, PackedF32, QMatrix, ThreadPool};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() -> engram_kernels::Result<()> {
    let n = env("ENGRAM_BENCH_TOKENS", 4096);
    let reps = env("ENGRAM_BENCH_REPS", 7).max(1);
    let isa = std::env::var("ENGRAM_KERNELS_ISA").unwrap_or_else(|_| "best".into());
    println!("isa={isa} tokens={n} reps={reps} (GFLOP/s = 2 rows cols tokens / best time)");
    println!(
        "{:>12} {:>7} {:>12} {:>12} {:>7}",
        "rows x cols", "threads", "matmul F32", "packed", "ratio"
    );
    for (rows, cols) in [(1152, 384), (384, 384), (1536, 384), (384, 1536)] {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let bytes: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
        let q = QMatrix::new(GgmlType::F32, rows, cols, &bytes)?;
        let p = PackedF32::pack(&w, rows, cols)?;
        let x: Vec<f32> = (0..n * cols)
            .map(|i| (i * 31 % 97) as f32 / 48.0 - 1.0)
            .collect();
        let mut out = vec![0f32; n * rows];
        for threads in [1, 2] {
            let pool = ThreadPool::new(threads)?;
            let (mut old, mut new) = (Duration::MAX, Duration::MAX);
            for rep in 0..=reps {
                let t = Instant::now();
                matmul(&q, &x, n, &mut out, &pool)?;
                let d_old = t.elapsed();
                let t = Instant::now();
                matmul_packed(&p, &x, n, &mut out, &pool)?;
                let d_new = t.elapsed();
                if rep > 0 {
                    // Repetition 0 warms the caches and the pool.
                    old = old.min(d_old);
                    new = new.min(d_new);
                }
            }
            let gf = |d: Duration| 2.0 * (rows * cols * n) as f64 / d.as_secs_f64() / 1e9;
            println!(
                "{:>12} {:>7} {:>12.1} {:>12.1} {:>7.2}",
                format!("{rows}x{cols}"),
                threads,
                gf(old),
                gf(new),
                old.as_secs_f64() / new.as_secs_f64()
            );
        }
    }
    Ok(())
}
