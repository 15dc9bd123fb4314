//! Multiply-adds per second of the quantised matmul at SmolLM2-135M's prefill shapes (the
//! gate/up and down projections, 512 tokens), for the weight types of the benchmark's variants,
//! on one and two threads: the figure the AMX tiles are compared on against the VNNI kernels.
//!
//! ```text
//! cargo run --release -p engram-kernels --example quant_gemm                       # AMX where the CPU has it
//! ENGRAM_KERNELS_AMX=0 cargo run --release -p engram-kernels --example quant_gemm  # VNNI
//! ```
//!
//! `ENGRAM_BENCH_TOKENS` (default 512) sets the token count, `ENGRAM_BENCH_REPS` (default 9)
//! the timed repetitions per case; the best repetition is reported (a noisy neighbour only
//! ever slows a repetition down).

use std::time::{Duration, Instant};

use engram_kernels::{f16, matmul, quantize_row, GgmlType, QMatrix, ThreadPool};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Deterministic weights of type `ty` with sane scales (as the `matmul` bench makes them).
fn weights(ty: GgmlType, rows: usize, cols: usize) -> engram_kernels::Result<Vec<u8>> {
    if ty == GgmlType::Q8_0 {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut b = Vec::new();
        quantize_row(GgmlType::Q8_0, &w, &mut b)?;
        return Ok(b);
    }
    let mut d: Vec<u8> = (0..rows * ty.row_bytes(cols).expect("whole blocks"))
        .map(|i| (i as u8).wrapping_mul(37) ^ 0x5a)
        .collect();
    for b in d.chunks_exact_mut(ty.type_size()) {
        b[0..2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4K) {
            b[2..4].copy_from_slice(&f16::from_f32(-0.05).to_le_bytes());
        }
    }
    Ok(d)
}

fn main() -> engram_kernels::Result<()> {
    let n = env("ENGRAM_BENCH_TOKENS", 512);
    let reps = env("ENGRAM_BENCH_REPS", 9).max(1);
    println!(
        "kernels={} tokens={n} reps={reps} (GMAC/s = rows cols tokens / best time)",
        engram_kernels::kernels_in_use()
    );
    println!(
        "{:>6} {:>12} {:>7} {:>10}",
        "type", "rows x cols", "threads", "GMAC/s"
    );
    let types = [
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q4K,
    ];
    for ty in types {
        for (rows, cols) in [(1536, 576), (576, 1536)] {
            if cols % ty.block_size() != 0 {
                continue;
            }
            let bytes = weights(ty, rows, cols)?;
            let q = QMatrix::new(ty, rows, cols, &bytes)?;
            let x: Vec<f32> = (0..n * cols)
                .map(|i| (i * 104729 % 2000) as f32 / 1000.0 - 1.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            for threads in [1, 2] {
                let pool = ThreadPool::new(threads)?;
                let mut best = Duration::MAX;
                for _ in 0..=reps {
                    let t = Instant::now();
                    matmul(&q, &x, n, &mut out, &pool)?;
                    best = best.min(t.elapsed());
                }
                let macs = (rows * cols * n) as f64;
                println!(
                    "{:>6} {:>12} {:>7} {:>10.1}",
                    ty.to_string(),
                    format!("{rows} x {cols}"),
                    threads,
                    macs / best.as_secs_f64() / 1e9
                );
            }
        }
    }
    Ok(())
}
