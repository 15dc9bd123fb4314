//! Nanoseconds per element of activation quantisation (Q8_0, Q8_1, Q8_K) on one thread: a
//! prefill of 512 tokens x 1536 (SmolLM2-135M's feed-forward width), one `quantize_row` per
//! token, as every quantised matmul does before its integer dot products.
//!
//! ```text
//! cargo run --release -p engram-kernels --example quantize_bench
//! ENGRAM_KERNELS_ISA=scalar cargo run --release -p engram-kernels --example quantize_bench
//! ```
//!
//! `ENGRAM_BENCH_REPS` (default 30) sets the timed repetitions; the best one is reported.

use std::time::{Duration, Instant};

use engram_kernels::{quantize_row, GgmlType};

fn main() -> engram_kernels::Result<()> {
    let reps = std::env::var("ENGRAM_BENCH_REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30usize)
        .max(1);
    let (tokens, cols) = (512, 1536);
    let x: Vec<f32> = (0..tokens * cols)
        .map(|i| ((i * 2_654_435_761) % 2000) as f32 / 1000.0 - 1.0)
        .collect();
    println!(
        "kernels={} tokens={tokens} cols={cols} reps={reps}",
        engram_kernels::kernels_in_use()
    );
    for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
        let mut out = Vec::new();
        let mut best = Duration::MAX;
        for _ in 0..reps {
            let t0 = Instant::now();
            for row in x.chunks(cols) {
                quantize_row(ty, row, &mut out)?;
                std::hint::black_box(&out);
            }
            best = best.min(t0.elapsed());
        }
        println!(
            "{:>5} {:>8.3} ms {:>6.2} ns/element",
            format!("{ty:?}"),
            best.as_secs_f64() * 1e3,
            best.as_secs_f64() * 1e9 / x.len() as f64
        );
    }
    Ok(())
}
