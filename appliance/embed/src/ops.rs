//! The encoder's non-matmul arithmetic: LayerNorm, activations, softmax
//! attention over packed sequences, and the parallel-for helpers that spread them over the pool.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};
use std::sync::Mutex;

use engram_kernels::ThreadPool;

use crate::config::Activation;

/// Pieces per pool thread when splitting row-wise work: a few more than one so that threads
/// that finish early (or share a core with another process) take up the slack.
const PIECES_PER_THREAD: usize = 4;

/// Runs `f(row_index, row)` on every `row_len`-element row of `data`, rows split over `pool`.
pub(crate) fn par_rows<F>(pool: &ThreadPool, data: &mut [f32], row_len: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    if row_len == 0 || data.is_empty() {
        return;
    }
    let n_rows = data.len() / row_len;
    let per = n_rows.div_ceil(pool.n_threads() * PIECES_PER_THREAD).max(1);
    // One part per task; each task locks only its own part, so the locks never contend.
    let parts: Vec<Mutex<&mut [f32]>> = data.chunks_mut(per * row_len).map(Mutex::new).collect();
    pool.run(parts.len(), |i| {
        let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
        for (j, row) in part.chunks_exact_mut(row_len).enumerate() {
            f(i * per + j, row);
        }
    });
}

/// `f(i)` for `i` in `0..n` on `pool`, results in index order.
pub(crate) fn par_map<T, F>(pool: &ThreadPool, n: usize, f: F) -> Vec<T>
where
    T: Send,
    F: Fn(usize) -> T + Sync,
{
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    pool.run(n, |i| {
        let v = f(i);
        *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
    });
    slots
        .into_iter()
        .map(|s| {
            s.into_inner()
                .unwrap_or_else(|p| p.into_inner())
                .expect("ThreadPool::run runs every task")
        })
        .collect()
}

/// In-place LayerNorm of one row: `(x - mean) / sqrt(var + eps) * w + b`, statistics in f64.
pub(crate) fn layer_norm(row: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = row.len() as f64;
    let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = row
        .iter()
        .map(|&v| {
            let d = v as f64 - mean;
            d * d
        })
        .sum::<f64>()
        / n;
    let rstd = 1.0 / (var + eps as f64).sqrt();
    for ((x, &w), &b) in row.iter_mut().zip(w).zip(b) {
        *x = ((*x as f64 - mean) * rstd) as f32 * w + b;
    }
}

/// The activation applied element-wise.
pub(crate) fn activate(act: Activation, x: f32) -> f32 {
    match act {
        Activation::Gelu => gelu_erf(x),
        Activation::GeluTanh => {
            let x = x as f64;
            let c = FRAC_2_SQRT_PI * FRAC_1_SQRT_2; // sqrt(2 / pi)
            (0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())) as f32
        }
        Activation::Relu => x.max(0.0),
    }
}

/// PyTorch's default GELU, `x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))`, in f32 as PyTorch
/// computes it, with musl's erff/erfcf (`libm`, under 1 ulp): for negative x through erfc so
/// that the tiny tail values keep their relative accuracy.
pub(crate) fn gelu_erf(x: f32) -> f32 {
    let z = x * std::f32::consts::FRAC_1_SQRT_2;
    if z >= 0.0 {
        0.5 * x * (1.0 + libm::erff(z))
    } else {
        0.5 * x * libm::erfcf(-z)
    }
}

/// Where one sequence's tokens sit in a packed batch.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    /// First token's row.
    pub start: usize,
    /// Tokens.
    pub len: usize,
}

/// Bidirectional softmax attention of every sequence in a packed batch.
///
/// `qkv` holds one row of `3 * hidden` per token (queries, keys, values, each split into
/// `heads` heads of `hidden / heads`); the context vectors come back as `tokens x hidden`. A
/// sequence attends only to its own tokens, which is what the padding mask achieves in a padded
/// batch.
pub(crate) fn attention(
    pool: &ThreadPool,
    qkv: &[f32],
    spans: &[Span],
    hidden: usize,
    heads: usize,
) -> Vec<f32> {
    let d = hidden / heads;
    let row = 3 * hidden;
    let scale = 1.0 / (d as f32).sqrt();
    let tokens = spans.iter().map(|s| s.start + s.len).max().unwrap_or(0);
    // One task per (sequence, head): the scores of a 256-token sequence fit in L1.
    let per_task = par_map(pool, spans.len() * heads, |task| {
        let (s, h) = (spans[task / heads], task % heads);
        let q_at = |i: usize| &qkv[(s.start + i) * row + h * d..][..d];
        let k_at = |j: usize| &qkv[(s.start + j) * row + hidden + h * d..][..d];
        let v_at = |j: usize| &qkv[(s.start + j) * row + 2 * hidden + h * d..][..d];
        let mut ctx = vec![0.0f32; s.len * d];
        let mut p = vec![0.0f32; s.len];
        for (i, c) in ctx.chunks_exact_mut(d).enumerate() {
            let q = q_at(i);
            let mut max = f32::NEG_INFINITY;
            for (j, pj) in p.iter_mut().enumerate() {
                *pj = dot(q, k_at(j)) * scale;
                max = max.max(*pj);
            }
            let mut sum = 0.0f32;
            for pj in p.iter_mut() {
                *pj = (*pj - max).exp();
                sum += *pj;
            }
            let inv = 1.0 / sum;
            for (j, &pj) in p.iter().enumerate() {
                let w = pj * inv;
                for (c, &v) in c.iter_mut().zip(v_at(j)) {
                    *c += w * v;
                }
            }
        }
        ctx
    });
    let mut out = vec![0.0f32; tokens * hidden];
    for (task, ctx) in per_task.iter().enumerate() {
        let (s, h) = (spans[task / heads], task % heads);
        for (i, c) in ctx.chunks_exact(d).enumerate() {
            out[(s.start + i) * hidden + h * d..][..d].copy_from_slice(c);
        }
    }
    out
}

/// Dot product with four accumulators (lets the compiler vectorise).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 4];
    let (ac, at) = a.as_chunks::<4>();
    let (bc, bt) = b.as_chunks::<4>();
    for (x, y) in ac.iter().zip(bc) {
        for k in 0..4 {
            acc[k] += x[k] * y[k];
        }
    }
    let tail: f32 = at.iter().zip(bt).map(|(x, y)| x * y).sum();
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_known_values() {
        // 0.5 x erfc(-x / sqrt 2) from Python's math.erfc.
        let cases = [
            (0.0f32, 0.0f64),
            (1.0, 0.8413447460685429),
            (-1.0, -0.15865525393145707),
            (3.0, 2.99595030590511),
            (-3.0, -4.049694094890287e-3),
            (-8.0, -4.9767684594174555e-15),
        ];
        for (x, want) in cases {
            let got = gelu_erf(x) as f64;
            assert!(
                (got - want).abs() <= want.abs() * 1e-6 + 1e-12,
                "gelu({x}) = {got}, want {want}"
            );
        }
    }

    #[test]
    fn layer_norm_normalises() {
        let mut row = [1.0f32, 2.0, 3.0, 4.0];
        layer_norm(&mut row, &[1.0; 4], &[0.5; 4], 0.0);
        let s = 1.0 / 1.25f32.sqrt();
        for (got, want) in row.iter().zip([-1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s]) {
            assert!((got - (want + 0.5)).abs() < 1e-6);
        }
    }

    #[test]
    fn par_helpers_visit_everything_in_order() {
        let pool = ThreadPool::new(3).unwrap();
        let mut data: Vec<f32> = vec![0.0; 7 * 5];
        par_rows(&pool, &mut data, 5, |i, row| row.fill(i as f32));
        for (i, row) in data.chunks(5).enumerate() {
            assert!(row.iter().all(|&v| v == i as f32));
        }
        assert_eq!(
            par_map(&pool, 50, |i| i * 2),
            (0..50).map(|i| i * 2).collect::<Vec<_>>()
        );
    }
}
