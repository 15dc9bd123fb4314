//! The encoder's non-matmul arithmetic: LayerNorm, activations, softmax
//! attention over packed sequences, and the parallel-for helpers that spread them over the pool.

use std::f64::consts::{FRAC_1_SQRT_2, FRAC_2_SQRT_PI};
use std::sync::Mutex;

use engram_kernels::{matmul_packed, PackedF32, ThreadPool};

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

/// PyTorch's default GELU, `x * Phi(x) = 0.5 x erfc(-x / sqrt 2)`, in f32.
///
/// `erfc` of `a = |x| / sqrt 2` comes from Chebyshev-fitted `t exp(-a^2 + P(t))`,
/// `t = 1 / (1 + a/2)` (Numerical Recipes' `erfcc`: relative error under 1.2e-7 everywhere),
/// so the negative tail keeps its relative accuracy; `erfc(-a) = 2 - erfc(a)` for the positive
/// side. No branch and no libm call: the loop over a row vectorises. Checked against musl's
/// `erfcf` in the tests (it was 14 % of an ingestion profile as a scalar call per element).
#[inline]
#[allow(clippy::excessive_precision)] // the published coefficients, as printed
pub(crate) fn gelu_erf(x: f32) -> f32 {
    let a = x.abs() * std::f32::consts::FRAC_1_SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * a);
    let p = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc_a = t * exp_fast(p - a * a);
    let erfc_minus = if x >= 0.0 { 2.0 - erfc_a } else { erfc_a };
    0.5 * x * erfc_minus
}

/// `e^x` in f32 to about 2 ulp, without a libm call (so loops over it vectorise): `2^n e^r`
/// with `n = round(x / ln 2)`, `r` in `[-ln2/2, ln2/2]` from a two-part `ln 2`, a degree-6
/// Taylor polynomial for `e^r`, and `2^n` built in the exponent bits. Inputs below -87 give 0
/// (as `expf` underflows there), above 88 are clamped.
#[inline]
pub(crate) fn exp_fast(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.3, 88.0);
    // Round to nearest by adding and subtracting 1.5 * 2^23 (exact for |y| < 2^22; no libm
    // call, since the baseline x86-64 has no rounding instruction).
    const ROUND: f32 = 12_582_912.0;
    let n = (x * std::f32::consts::LOG2_E + ROUND) - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // n in [-126, 127]: a normal power of two.
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    p * scale
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
/// the weight matrix) and the context `P V` (`V^T` packed from `V` as it is), with the softmax
/// between them; a 256-token head's scores (256 KiB) stay in L2.
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
    let per_task = par_map(pool, spans.len() * heads, |task| {
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
        for r in p.chunks_exact_mut(len) {
            softmax(r);
        }
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

/// In-place softmax of one row of scores. The maximum and the sum are taken in 8 lanes and
/// the exponentials in a loop of their own, so all three vectorise.
fn softmax(r: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; 8];
    let (chunks, tail) = r.as_chunks::<8>();
    for c in chunks {
        for k in 0..8 {
            m[k] = if c[k] > m[k] { c[k] } else { m[k] };
        }
    }
    let max = tail
        .iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for x in r.iter_mut() {
        *x = exp_fast(*x - max);
    }
    let mut s = [0.0f32; 8];
    let (chunks, tail) = r.as_chunks::<8>();
    for c in chunks {
        for k in 0..8 {
            s[k] += c[k];
        }
    }
    let sum: f32 = s.iter().sum::<f32>() + tail.iter().sum::<f32>();
    let inv = 1.0 / sum;
    r.iter_mut().for_each(|x| *x *= inv);
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
    fn gelu_and_exp_match_libm() {
        let mut worst_gelu = 0.0f64;
        let mut worst_exp = 0.0f64;
        for i in -20_000..=20_000 {
            let x = i as f32 * 1e-3;
            // musl's erff/erfcf, to under 1 ulp.
            let z = x * std::f32::consts::FRAC_1_SQRT_2;
            let want = if z >= 0.0 {
                0.5 * x as f64 * (1.0 + libm::erff(z) as f64)
            } else {
                0.5 * x as f64 * libm::erfcf(-z) as f64
            };
            let got = gelu_erf(x) as f64;
            // Relative to the value, with an absolute floor for values near 0.
            worst_gelu = worst_gelu.max((got - want).abs() / want.abs().max(1e-3));
            let e = (x * 4.0) as f64;
            let rel = (exp_fast(e as f32) as f64 - e.exp()).abs() / e.exp();
            worst_exp = worst_exp.max(rel);
        }
        assert!(worst_gelu < 2e-6, "gelu relative error {worst_gelu:e}");
        assert!(worst_exp < 3e-7, "exp relative error {worst_exp:e}");
        assert_eq!(exp_fast(-100.0), 0.0_f32.max(exp_fast(-100.0)));
        assert!(exp_fast(-100.0) < 1e-37);
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
