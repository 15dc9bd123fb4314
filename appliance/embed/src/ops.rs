//! The encoder's non-matmul steps (LayerNorm, bias + activation, softmax attention over packed
//! sequences) on the kernels' element-wise SIMD kernels, and the parallel-for helpers that
//! spread them over the pool.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};
use std::sync::Mutex;

use engram_kernels::{
    gelu_bias_rows, layer_norm_rows, matmul_packed, softmax_rows, PackedF32, ThreadPool,
};

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

/// In-place LayerNorm of one row: `(x - mean) / sqrt(var + eps) * w + b`, statistics in f64,
/// on the kernels' SIMD kernel.
pub(crate) fn layer_norm(row: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    layer_norm_rows(row, w, b, eps)
        .expect("LayerNorm weights as long as the row (checked at load)");
}

/// `row = act(row + b)` for one row of `b.len()` values (`None`: the bias only). PyTorch's
/// exact-erf GELU runs on the kernels' SIMD kernel; the other activations are one loop each
/// (the match outside it), so each vectorises.
pub(crate) fn bias_act(row: &mut [f32], b: &[f32], act: Option<Activation>) {
    let pairs = row.iter_mut().zip(b);
    match act {
        None => pairs.for_each(|(v, &b)| *v += b),
        Some(Activation::Gelu) => gelu_bias_rows(row, b),
        Some(Activation::GeluTanh) => pairs.for_each(|(v, &b)| *v = gelu_tanh(*v + b)),
        Some(Activation::Relu) => pairs.for_each(|(v, &b)| *v = (*v + b).max(0.0)),
    }
}

/// The tanh approximation of GELU (`gelu_new`), in f64 as the reference computes it.
fn gelu_tanh(x: f32) -> f32 {
    let x = x as f64;
    let c = FRAC_2_SQRT_PI * FRAC_1_SQRT_2; // sqrt(2 / pi)
    (0.5 * x * (1.0 + (c * (x + 0.044715 * x * x * x)).tanh())) as f32
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
///
/// One task per (sequence, head) on the pool. Within a task both products run on the kernels'
/// packed f32 GEMM (SIMD, dispatched per CPU): the scores `Q K^T` (the head's keys packed as
/// the weight matrix) and the context `P V` (`V^T` packed from `V` as it is), with the
/// kernels' row softmax between them; a 256-token head's scores (256 KiB) stay in L2.
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
    let per_task = pool.map(spans.len() * heads, |task| {
        let (s, h) = (spans[task / heads], task % heads);
        let len = s.len;
        let at = |i: usize, part: usize| &qkv[(s.start + i) * row + part * hidden + h * d..][..d];
        // Queries pre-scaled (as PyTorch's SDPA scales q); keys are the scores' weight rows;
        // the values, row-major `[len][d]`, are `V^T` stored transposed: packed as they are.
        let mut q = Vec::with_capacity(len * d);
        let mut k = Vec::with_capacity(len * d);
        let mut v = Vec::with_capacity(len * d);
        for i in 0..len {
            q.extend(at(i, 0).iter().map(|&x| x * scale));
            k.extend_from_slice(at(i, 1));
            v.extend_from_slice(at(i, 2));
        }
        let mut p = vec![0.0f32; len * len];
        let keys = PackedF32::pack(&k, len, d).expect("len x d keys");
        matmul_packed(&keys, &q, len, &mut p, pool).expect("shapes checked above");
        softmax_rows(&mut p, len);
        let mut ctx = vec![0.0f32; len * d];
        let values = PackedF32::pack_transposed(&v, d, len).expect("d x len values");
        matmul_packed(&values, &p, len, &mut ctx, pool).expect("shapes checked above");
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

#[cfg(test)]
mod tests {
    use super::*;

    fn gelu(x: f32) -> f32 {
        let mut v = [x];
        bias_act(&mut v, &[0.0], Some(Activation::Gelu));
        v[0]
    }

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
            let got = gelu(x) as f64;
            assert!(
                (got - want).abs() <= want.abs() * 1e-6 + 1e-12,
                "gelu({x}) = {got}, want {want}"
            );
        }
    }

    /// The kernels' GELU against musl's erff/erfcf (the kernels test it against an f64 erfc).
    #[test]
    fn gelu_matches_libm() {
        let xs: Vec<f32> = (-20_000..=20_000).map(|i| i as f32 * 1e-3).collect();
        let mut got = xs.clone();
        bias_act(&mut got, &[0.0], Some(Activation::Gelu));
        let mut worst_gelu = 0.0f64;
        for (&x, &g) in xs.iter().zip(&got) {
            // musl's erff/erfcf, to under 1 ulp.
            let z = x * std::f32::consts::FRAC_1_SQRT_2;
            let want = if z >= 0.0 {
                0.5 * x as f64 * (1.0 + libm::erff(z) as f64)
            } else {
                0.5 * x as f64 * libm::erfcf(-z) as f64
            };
            assert_eq!(g, gelu(x), "one value and a row differ at {x}");
            // Relative to the value, with an absolute floor for values near 0.
            worst_gelu = worst_gelu.max((g as f64 - want).abs() / want.abs().max(1e-3));
        }
        assert!(worst_gelu < 2e-6, "gelu relative error {worst_gelu:e}");
    }

    #[test]
    fn bias_act_adds_then_activates() {
        let b = [1.0f32, -2.0, 0.5];
        let mut row = [0.5f32, 0.5, -1.0];
        bias_act(&mut row, &b, None);
        assert_eq!(row, [1.5, -1.5, -0.5]);
        let mut relu = row;
        bias_act(&mut relu, &[0.0; 3], Some(Activation::Relu));
        assert_eq!(relu, [1.5, 0.0, 0.0]);
        let mut tanh = row;
        bias_act(&mut tanh, &[0.0; 3], Some(Activation::GeluTanh));
        let mut erf = row;
        bias_act(&mut erf, &[0.0; 3], Some(Activation::Gelu));
        for (t, e) in tanh.iter().zip(&erf) {
            assert!((t - e).abs() < 1e-3, "{t} vs {e}");
        }
        assert_eq!(erf, row.map(gelu));
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
    }
}
