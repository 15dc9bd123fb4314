//! `matmul` at the shapes of SmolLM2-135M (n_embd 576, n_ff 1536, 3 KV heads of 64, vocabulary
//! 49152): Q4_1 layer matrices and the Q8_0 output head, 1 token (decode), 8 tokens (a batched
//! decode step of 8 sequences) and 512 tokens (prefill), on a 2-thread pool (the appliance's default profile). Also the K-quants of larger
//! models (a 1024 x 1024 slice) and the f32 matrices of the all-MiniLM-L6-v2 embedder.
//!
//! Throughput is reported in elements (`rows * cols * tokens` multiply-adds); GFLOP/s is twice
//! that. The ISA is chosen once per process, so compare ISAs with separate runs:
//!
//! ```text
//! cargo bench -p engram-kernels --bench matmul
//! ENGRAM_KERNELS_ISA=avx2 cargo bench -p engram-kernels --bench matmul
//! ENGRAM_KERNELS_ISA=scalar cargo bench -p engram-kernels --bench matmul -- 'tokens=1$'
//! ```
//!
//! `ENGRAM_BENCH_THREADS` overrides the thread count.
//!
//! The `f32 embedder` groups compare, on 1 and 2 threads, `matmul` on `GgmlType::F32` weights
//! with `matmul_packed` on the same weights packed once, at the all-MiniLM-L6-v2 shapes with
//! 4096 tokens (a batch of 32 to 64 chunks):
//!
//! ```text
//! cargo bench -p engram-kernels --bench matmul -- 'f32 embedder'
//! ```
//!
//! `examples/f32_gemm.rs` prints the same comparison as a GFLOP/s table.

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use engram_kernels::{
    f16, matmul, matmul_packed, quantize_row, GgmlType, PackedF32, QMatrix, ThreadPool,
};

/// Threads of the pool unless `ENGRAM_BENCH_THREADS` says otherwise: the 2-core profile that
/// the llama.cpp comparison uses.
const DEFAULT_THREADS: usize = 2;

/// Deterministic weights of type `ty` with sane scales.
fn weights(ty: GgmlType, rows: usize, cols: usize) -> Vec<u8> {
    if ty == GgmlType::F32 {
        return (0..rows * cols)
            .flat_map(|i| ((i * 7919 % 1000) as f32 / 500.0 - 1.0).to_le_bytes())
            .collect();
    }
    if ty == GgmlType::Q8_0 {
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| (i * 7919 % 1000) as f32 / 500.0 - 1.0)
            .collect();
        let mut b = Vec::new();
        quantize_row(GgmlType::Q8_0, &w, &mut b).expect("quantize");
        return b;
    }
    let ts = ty.type_size();
    let mut d: Vec<u8> = (0..rows * ty.row_bytes(cols).expect("row bytes"))
        .map(|i| (i as u8).wrapping_mul(37) ^ 0x5a)
        .collect();
    for b in d.chunks_exact_mut(ts) {
        // Q6_K keeps its scale at the end of the block.
        let d_at = if ty == GgmlType::Q6K { 208 } else { 0 };
        b[d_at..d_at + 2].copy_from_slice(&f16::from_f32(0.01).to_le_bytes());
        if matches!(ty, GgmlType::Q4_1 | GgmlType::Q4K | GgmlType::Q5K) {
            b[2..4].copy_from_slice(&f16::from_f32(-0.05).to_le_bytes());
        }
    }
    d
}

fn bench_matmul(c: &mut Criterion) {
    let threads = std::env::var("ENGRAM_BENCH_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(DEFAULT_THREADS);
    let pool = ThreadPool::new(threads).expect("pool");
    let isa = std::env::var("ENGRAM_KERNELS_ISA").unwrap_or_else(|_| "best".into());
    let shapes = [
        (GgmlType::Q4_1, 576, 576, "attn_q/attn_output"),
        (GgmlType::Q4_1, 192, 576, "attn_k/attn_v"),
        (GgmlType::Q4_1, 1536, 576, "ffn_gate/ffn_up"),
        (GgmlType::Q4_1, 576, 1536, "ffn_down"),
        (GgmlType::Q8_0, 49152, 576, "output"),
        (GgmlType::Q4K, 1024, 1024, "7B-style slice"),
        (GgmlType::Q5K, 1024, 1024, "7B-style slice"),
        (GgmlType::Q6K, 1024, 1024, "7B-style slice"),
        (GgmlType::F32, 1152, 384, "MiniLM attn_qkv"),
        (GgmlType::F32, 1536, 384, "MiniLM ffn_up"),
    ];
    let mut g = c.benchmark_group(format!("matmul/{isa}/threads={threads}"));
    g.sample_size(10);
    for (ty, rows, cols, what) in shapes {
        let data = weights(ty, rows, cols);
        let w = QMatrix::new(ty, rows, cols, &data).expect("matrix");
        for n in [1usize, 8, 512] {
            if rows > 10_000 && n > 1 {
                continue; // prefill computes logits for the last token only
            }
            let x: Vec<f32> = (0..n * cols)
                .map(|i| (i * 31 % 97) as f32 / 48.0 - 1.0)
                .collect();
            let mut out = vec![0f32; n * rows];
            g.throughput(Throughput::Elements((rows * cols * n) as u64));
            let id = BenchmarkId::new(format!("{ty} {rows}x{cols} {what}"), format!("tokens={n}"));
            g.bench_function(id, |b| {
                b.iter(|| matmul(&w, &x, n, &mut out, &pool).expect("matmul"))
            });
        }
    }
    g.finish();
}

/// The embedder's f32 dense layers (fused Q/K/V, attention output, FFN up and down) through
/// both f32 paths, 4096 tokens, on 1 and 2 threads.
fn bench_f32_embedder(c: &mut Criterion) {
    const TOKENS: usize = 4096;
    let shapes = [
        (1152, 384, "attn_qkv"),
        (384, 384, "attn_output"),
        (1536, 384, "ffn_up"),
        (384, 1536, "ffn_down"),
    ];
    for threads in [1, 2] {
        let pool = ThreadPool::new(threads).expect("pool");
        let mut g = c.benchmark_group(format!("f32 embedder/threads={threads}"));
        g.sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(3));
        for (rows, cols, what) in shapes {
            let data = weights(GgmlType::F32, rows, cols);
            let w = QMatrix::new(GgmlType::F32, rows, cols, &data).expect("matrix");
            let wf: Vec<f32> = data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let packed = PackedF32::pack(&wf, rows, cols).expect("pack");
            let x: Vec<f32> = (0..TOKENS * cols)
                .map(|i| (i * 31 % 97) as f32 / 48.0 - 1.0)
                .collect();
            let mut out = vec![0f32; TOKENS * rows];
            g.throughput(Throughput::Elements((rows * cols * TOKENS) as u64));
            let shape = format!("{rows}x{cols} {what} tokens={TOKENS}");
            g.bench_function(BenchmarkId::new("matmul F32", &shape), |b| {
                b.iter(|| matmul(&w, &x, TOKENS, &mut out, &pool).expect("matmul"))
            });
            g.bench_function(BenchmarkId::new("matmul_packed", &shape), |b| {
                b.iter(|| matmul_packed(&packed, &x, TOKENS, &mut out, &pool).expect("packed"))
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench_matmul, bench_f32_embedder);
criterion_main!(benches);
