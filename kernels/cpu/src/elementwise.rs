//! Element-wise kernels of the f32 sentence encoder: bias + erf GELU, row softmax and LayerNorm.
//!
//! Each is compiled once per ISA from one safe body and dispatched at runtime.
//! # Pattern
//!
//! Each kernel is written once, as a safe `#[inline(always)]` function over slices that the
//! compiler vectorises by itself: no branch on the data (selects only), no libm call (the
//! exponential is a polynomial, rounding is the add/subtract-`1.5 * 2^23` trick), reductions
//! kept in [`LANES`] independent accumulators. [`per_isa!`] then defines, for each body, a
//! function that runs it compiled three times: for the build's baseline target (the scalar
//! reference, SSE2 on x86-64), inside a `#[target_feature(enable = "avx2,fma")]` function and
//! inside a `#[target_feature(enable = "avx512f")]` one, so the same loops become 4-, 8- and
//! 16-lane code. The public functions pick the version [`Isa::detected`] names.
//!
//! The per-ISA versions live in this file rather than in `avx2.rs` / `avx512.rs` files (the
//! house default) because they are not separate code: each is a one-line call of the body that
//! only changes how it is compiled, and the macro keeps every `unsafe` in one reviewed place.
//!
//! Rust does not contract `a * b + c` into an FMA nor reassociate float sums unless told to,
//! so every version performs the same IEEE operations in the same order: results are
//! bit-identical on every ISA (the tests check this against the scalar reference).

use crate::dot::Isa;
use crate::error::{KernelError, Result};

/// Independent accumulators of the f32 reductions (softmax's maximum and sum): one 512-bit
/// register, two AVX2 ones, four SSE2 ones. The summation order, and therefore the result,
/// is the same whichever width runs it.
const LANES: usize = 16;

/// Independent f64 accumulators of LayerNorm's statistics: one 512-bit register of f64.
const LANES_F64: usize = 8;

/// Defines `fn $name(isa: Isa, args...)`, which runs the safe body `$body(args...)` compiled
/// for `isa`: the baseline target for `Isa::Scalar`, AVX2 + FMA, or AVX-512 F.
macro_rules! per_isa {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) => $body:path) => {
        $(#[$doc])*
        #[inline]
        fn $name(isa: Isa, $($arg: $ty),*) {
            /// The body compiled with AVX-512 F.
            ///
            /// # Safety
            ///
            /// The CPU must support AVX-512 F.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f")]
            unsafe fn avx512($($arg: $ty),*) {
                $body($($arg),*)
            }

            /// The body compiled with AVX2 and FMA.
            ///
            /// # Safety
            ///
            /// The CPU must support AVX2 and FMA.
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2($($arg: $ty),*) {
                $body($($arg),*)
            }

            match isa {
                // SAFETY: `isa` comes from `Isa::detected` or `Isa::available`, which return
                // an AVX-512 variant only once AVX-512 F (with BW and VL) was detected.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 | Isa::Avx512Bw => unsafe { avx512($($arg),*) },
                // SAFETY: as above; `Isa::Avx2` only once AVX2, FMA and F16C were detected.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2($($arg),*) },
                Isa::Scalar => $body($($arg),*),
            }
        }
    };
}

/// `y = gelu(y + b)` for each row of `bias.len()` values of `y`, with PyTorch's exact GELU
/// (`approximate="none"`): `gelu(x) = x Phi(x) = 0.5 x erfc(-x / sqrt 2)`.
///
/// `erfc` comes from Numerical Recipes' Chebyshev fit (relative error under 1.2e-7
/// everywhere) with a polynomial `exp`, so the negative tail keeps its relative accuracy: the
/// result is within 2e-6 (relative, with a 1e-3 floor near 0) of GELU through musl's `erfcf`.
/// Identical bits on every ISA.
///
/// A last row shorter than `bias` (when `y.len()` is not a multiple of it) takes the first
/// values of `bias`; an empty `bias` leaves `y` as it is.
pub fn gelu_bias_rows(y: &mut [f32], bias: &[f32]) {
    gelu_bias_on(Isa::detected(), y, bias);
}

/// In-place softmax of each `row_len`-value row of `x`: `e^(v - max) / sum`, the maximum
/// taken over the row. Identical bits on every ISA; the exponential is within 3e-7 of `expf`.
///
/// A last row shorter than `row_len` is a row of its own; `row_len == 0` leaves `x` as it
/// is. A row of only `-inf` gives NaN.
pub fn softmax_rows(x: &mut [f32], row_len: usize) {
    softmax_on(Isa::detected(), x, row_len);
}

/// In-place LayerNorm of each `w.len()`-value row of `x`:
/// `(v - mean) / sqrt(var + eps) * w + b`, with the mean and the (biased) variance in f64 as
/// PyTorch computes them on the CPU. Identical bits on every ISA.
///
/// Errors if `b` is not as long as `w`, or `x` is not whole rows.
pub fn layer_norm_rows(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) -> Result<()> {
    if b.len() != w.len() {
        return Err(KernelError::LengthMismatch {
            what: "layer_norm_rows shift (b)",
            expected: w.len(),
            actual: b.len(),
        });
    }
    if (w.is_empty() && !x.is_empty()) || (!w.is_empty() && !x.len().is_multiple_of(w.len())) {
        return Err(KernelError::LengthMismatch {
            what: "layer_norm_rows values (whole rows of w.len())",
            expected: x.len().next_multiple_of(w.len().max(1)),
            actual: x.len(),
        });
    }
    layer_norm_on(Isa::detected(), x, w, b, eps);
    Ok(())
}

per_isa! {
    /// [`gelu_bias_rows`] on `isa`.
    fn gelu_bias_on(y: &mut [f32], bias: &[f32]) => gelu_bias_body
}

per_isa! {
    /// [`softmax_rows`] on `isa`.
    fn softmax_on(x: &mut [f32], row_len: usize) => softmax_body
}

per_isa! {
    /// [`layer_norm_rows`] on `isa` (lengths checked by the caller).
    fn layer_norm_on(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) => layer_norm_body
}

#[inline(always)]
fn gelu_bias_body(y: &mut [f32], bias: &[f32]) {
    if bias.is_empty() {
        return;
    }
    for row in y.chunks_mut(bias.len()) {
        for (v, &b) in row.iter_mut().zip(bias) {
            *v = gelu_erf(*v + b);
        }
    }
}

#[inline(always)]
fn softmax_body(x: &mut [f32], row_len: usize) {
    if row_len == 0 {
        return;
    }
    for row in x.chunks_mut(row_len) {
        softmax_row(row);
    }
}

#[inline(always)]
fn layer_norm_body(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    if w.is_empty() {
        return;
    }
    for row in x.chunks_exact_mut(w.len()) {
        layer_norm_row(row, w, b, eps);
    }
}

/// PyTorch's default GELU, `x * Phi(x) = 0.5 x erfc(-x / sqrt 2)`, in f32.
///
/// `erfc` of `a = |x| / sqrt 2` comes from Chebyshev-fitted `t exp(-a^2 + P(t))`,
/// `t = 1 / (1 + a/2)` (Numerical Recipes' `erfcc`: relative error under 1.2e-7 everywhere),
/// so the negative tail keeps its relative accuracy; `erfc(-a) = 2 - erfc(a)` for the positive
/// side. No branch and no libm call, so a loop over it vectorises.
#[inline(always)]
#[allow(clippy::excessive_precision)] // the published coefficients, as printed
fn gelu_erf(x: f32) -> f32 {
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
/// Taylor polynomial for `e^r`, and `2^n` built in the exponent bits. Inputs below -87.3 give
/// about 1e-38 (where `expf` goes subnormal, then 0), above 88 are clamped; NaN gives NaN.
#[inline(always)]
fn exp_fast(x: f32) -> f32 {
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    // Round to nearest by adding and subtracting 1.5 * 2^23 (exact for |y| < 2^22; no libm
    // call, since the baseline x86-64 has no rounding instruction).
    const ROUND: f32 = 12_582_912.0;
    let x = x.clamp(-87.3, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // `shifted` is `1.5 * 2^23 + n` exactly, so its low mantissa bits hold `n` (in
    // [-126, 127]): integer arithmetic on the bits gives the exponent field of `2^n`, a normal
    // power of two, without a float-to-int conversion.
    let n_bits = shifted.to_bits().wrapping_sub(ROUND.to_bits());
    let scale = f32::from_bits(n_bits.wrapping_add(127) << 23);
    p * scale
}

/// In-place softmax of one row. The maximum and the sum run in [`LANES`] accumulators, the
/// exponentials in the sum's loop, so the three passes vectorise.
#[inline(always)]
fn softmax_row(r: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; LANES];
    let (chunks, tail) = r.as_chunks::<LANES>();
    for c in chunks {
        for k in 0..LANES {
            m[k] = if c[k] > m[k] { c[k] } else { m[k] };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in m.iter().chain(tail) {
        max = if v > max { v } else { max };
    }

    let mut s = [0.0f32; LANES];
    let (chunks, tail) = r.as_chunks_mut::<LANES>();
    for c in chunks {
        for k in 0..LANES {
            let e = exp_fast(c[k] - max);
            c[k] = e;
            s[k] += e;
        }
    }
    let mut sum = 0.0f32;
    for v in tail {
        *v = exp_fast(*v - max);
        sum += *v;
    }
    let sum = s.iter().fold(0.0f32, |a, &b| a + b) + sum;

    let inv = 1.0 / sum;
    for v in r.iter_mut() {
        *v *= inv;
    }
}

/// In-place LayerNorm of one row (`w` and `b` as long as it), statistics in f64 summed in
/// [`LANES_F64`] accumulators.
#[inline(always)]
fn layer_norm_row(row: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let n = row.len() as f64;
    let (chunks, tail) = row.as_chunks::<LANES_F64>();
    let mut s = [0.0f64; LANES_F64];
    for c in chunks {
        for k in 0..LANES_F64 {
            s[k] += c[k] as f64;
        }
    }
    let tail_sum = tail.iter().fold(0.0f64, |a, &v| a + v as f64);
    let mean = (s.iter().fold(0.0f64, |a, &v| a + v) + tail_sum) / n;

    let mut s = [0.0f64; LANES_F64];
    for c in chunks {
        for k in 0..LANES_F64 {
            let d = c[k] as f64 - mean;
            s[k] += d * d;
        }
    }
    let tail_sum = tail.iter().fold(0.0f64, |a, &v| {
        let d = v as f64 - mean;
        a + d * d
    });
    let var = (s.iter().fold(0.0f64, |a, &v| a + v) + tail_sum) / n;

    let rstd = 1.0 / (var + eps as f64).sqrt();
    for ((x, &w), &b) in row.iter_mut().zip(w).zip(b) {
        *x = ((*x as f64 - mean) * rstd) as f32 * w + b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `a` and `b` hold the same bits, value by value.
    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.iter().zip(b).all(|(a, b)| a.to_bits() == b.to_bits())
    }

    /// erfc in f64 to about 1e-13 relative, the tests' reference: the power series of erf
    /// below 2 (no cancellation worth counting: erfc(2) = 4.7e-3), the continued fraction
    /// `erfc z = e^(-z^2) / sqrt(pi) / (z + (1/2) / (z + 1 / (z + (3/2) / (z + ...))))` above.
    fn erfc_ref(z: f64) -> f64 {
        if z < 0.0 {
            return 2.0 - erfc_ref(-z);
        }
        if z < 2.0 {
            // erf z = 2/sqrt(pi) sum_n (-1)^n z^(2n+1) / (n! (2n+1)).
            let (mut term, mut sum, mut n) = (z, z, 0.0f64);
            while term.abs() > 1e-17 * sum.abs() {
                n += 1.0;
                term *= -z * z / n;
                sum += term / (2.0 * n + 1.0);
            }
            1.0 - std::f64::consts::FRAC_2_SQRT_PI * sum
        } else {
            let mut k = z;
            for n in (1..=80).rev() {
                k = z + (n as f64 / 2.0) / k;
            }
            (-z * z).exp() / std::f64::consts::PI.sqrt() / k
        }
    }

    fn gelu_ref(x: f32) -> f64 {
        let x = x as f64;
        0.5 * x * erfc_ref(-x * std::f64::consts::FRAC_1_SQRT_2)
    }

    fn gelu_one(isa: Isa, x: f32) -> f32 {
        let mut y = [x];
        gelu_bias_on(isa, &mut y, &[0.0]);
        y[0]
    }

    /// Values that cover GELU's and exp's ranges: both tails, zero, denormal-producing
    /// inputs, and a sweep with irregular steps so every SIMD tail length occurs.
    fn test_values(n: usize) -> Vec<f32> {
        let mut v: Vec<f32> = (0..n)
            .map(|i| ((i as f32 * 0.618_034).fract() - 0.5) * 24.0 + (i % 7) as f32 * 1e-3)
            .collect();
        v.extend([
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            100.0,
            -100.0,
            1e30,
            -1e30,
            88.0,
            -87.0,
            3.0,
            -3.0,
            10.5,
            -10.5,
            f32::MAX,
            f32::MIN,
        ]);
        v
    }

    #[test]
    fn reference_erfc_matches_python() {
        // math.erfc from Python.
        for (z, want) in [
            (0.5f64, 0.4795001221869535),
            (1.9, 0.007_209_570_764_742_532),
            (2.1, 0.002_979_466_656_332_984),
            (5.0, 1.5374597944280351e-12),
            (-1.0, 1.842_700_792_949_715),
        ] {
            assert!((erfc_ref(z) - want).abs() <= want * 1e-13, "erfc({z})");
        }
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
        for isa in Isa::available() {
            for (x, want) in cases {
                let got = gelu_one(isa, x) as f64;
                assert!(
                    (got - want).abs() <= want.abs() * 1e-6 + 1e-12,
                    "{isa:?}: gelu({x}) = {got}, want {want}"
                );
            }
        }
    }

    #[test]
    fn gelu_and_exp_are_accurate() {
        let mut worst_gelu = 0.0f64;
        let mut worst_exp = 0.0f64;
        let xs: Vec<f32> = (-20_000..=20_000).map(|i| i as f32 * 1e-3).collect();
        let mut got = xs.clone();
        gelu_bias_rows(&mut got, &[0.0; 7]);
        for (&x, &g) in xs.iter().zip(&got) {
            let want = gelu_ref(x);
            // Relative to the value, with an absolute floor for values near 0.
            worst_gelu = worst_gelu.max((g as f64 - want).abs() / want.abs().max(1e-3));
            let e = (x * 4.0) as f64;
            let rel = (exp_fast(e as f32) as f64 - e.exp()).abs() / e.exp();
            worst_exp = worst_exp.max(rel);
        }
        // Under 2e-6 against musl's erfcf too (checked in engram-embed, which has libm).
        assert!(worst_gelu < 1.5e-6, "gelu relative error {worst_gelu:e}");
        assert!(worst_exp < 3e-7, "exp relative error {worst_exp:e}");
        assert!(exp_fast(-100.0) >= 0.0 && exp_fast(-100.0) < 1e-37);
        assert_eq!(exp_fast(1000.0), exp_fast(88.0));
        assert!(exp_fast(f32::NAN).is_nan());
    }

    #[test]
    fn gelu_tails_and_extremes() {
        for isa in Isa::available() {
            for x in [1e30f32, f32::MAX, 20.0, 100.0] {
                assert_eq!(gelu_one(isa, x), x, "{isa:?}: gelu({x})");
            }
            for x in [-1e30f32, f32::MIN, -20.0, -100.0] {
                let g = gelu_one(isa, x);
                assert!(g <= 0.0 && g > -1e-30, "{isa:?}: gelu({x}) = {g}");
            }
            assert_eq!(gelu_one(isa, 0.0), 0.0);
            assert!(gelu_one(isa, f32::NAN).is_nan());
        }
    }

    #[test]
    fn gelu_bias_is_bit_identical_on_every_isa() {
        let x = test_values(1000);
        for row_len in [1, 3, 16, 17, 64, 1536] {
            let bias: Vec<f32> = (0..row_len).map(|i| (i as f32 * 0.37).sin()).collect();
            let mut want = x.clone();
            gelu_bias_on(Isa::Scalar, &mut want, &bias);
            // Element by element (the reference's own definition).
            for (i, (&v, &w)) in x.iter().zip(&want).enumerate() {
                assert_eq!(gelu_erf(v + bias[i % row_len]).to_bits(), w.to_bits());
            }
            for isa in Isa::available() {
                let mut got = x.clone();
                gelu_bias_on(isa, &mut got, &bias);
                assert!(same_bits(&got, &want), "{isa:?}, rows of {row_len}");
            }
        }
        // Degenerate shapes do nothing or touch only what exists.
        for isa in Isa::available() {
            gelu_bias_on(isa, &mut [], &[1.0]);
            let mut one = [1.0f32];
            gelu_bias_on(isa, &mut one, &[]);
            assert_eq!(one, [1.0]);
            gelu_bias_on(isa, &mut one, &[0.0, 5.0]);
            assert_eq!(one[0], gelu_erf(1.0));
        }
    }

    fn softmax_ref(row: &[f32]) -> Vec<f64> {
        let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - max).exp()).collect();
        let s: f64 = e.iter().sum();
        e.iter().map(|v| v / s).collect()
    }

    #[test]
    fn softmax_is_accurate_and_bit_identical_on_every_isa() {
        let x: Vec<f32> = test_values(2000)
            .into_iter()
            .filter(|v| v.abs() < 1e6)
            .collect();
        for row_len in [1, 2, 15, 16, 17, 31, 100, 256] {
            let n = x.len() / row_len * row_len;
            let mut want = x[..n].to_vec();
            softmax_on(Isa::Scalar, &mut want, row_len);
            for (row, got) in x[..n].chunks(row_len).zip(want.chunks(row_len)) {
                let r = softmax_ref(row);
                let mut total = 0.0f64;
                for (&g, &r) in got.iter().zip(&r) {
                    // f32's rounding of `v - max` (up to 24 here: 1.4e-6 absolute) moves
                    // `e^(v - max)` by as much relative; exp itself adds 3e-7.
                    assert!((g as f64 - r).abs() <= 3e-6 * r + 1e-30, "{g} vs {r}");
                    total += g as f64;
                }
                assert!(
                    (total - 1.0).abs() < 1e-5,
                    "rows of {row_len} sum to {total}"
                );
            }
            for isa in Isa::available() {
                let mut got = x[..n].to_vec();
                softmax_on(isa, &mut got, row_len);
                assert!(same_bits(&got, &want), "{isa:?}, rows of {row_len}");
            }
        }
        for isa in Isa::available() {
            softmax_on(isa, &mut [], 4);
            let mut v = [3.0f32, -1e30, 7.0];
            softmax_on(isa, &mut v, 0);
            assert_eq!(v, [3.0, -1e30, 7.0]);
            // Rows of one: each is 1. A short last row is a row of its own.
            softmax_on(isa, &mut v, 1);
            assert_eq!(v, [1.0; 3]);
            let mut v = [0.0f32, 0.0, 0.0, 5.0, 5.0];
            softmax_on(isa, &mut v, 3);
            assert_eq!(v[..3], [1.0 / 3.0; 3]);
            assert_eq!(v[3..], [0.5, 0.5]);
            // Large scores: max-subtracted, no overflow; tiny ones underflow to ~0.
            let mut v = [1e30f32, 1e30 - 1e24, -1e30, 88.0];
            softmax_on(isa, &mut v, 4);
            assert!(v.iter().all(|p| p.is_finite() && *p >= 0.0), "{v:?}");
            assert!(v[2] < 1e-37 && v[3] < 1e-37);
        }
    }

    #[test]
    fn softmax_rows_dispatches() {
        let mut v = vec![0.5f32; 300];
        softmax_rows(&mut v, 100);
        assert!(v.iter().all(|&p| (p - 0.01).abs() < 1e-8));
    }

    fn layer_norm_ref(row: &[f32], w: &[f32], b: &[f32], eps: f32) -> Vec<f64> {
        let n = row.len() as f64;
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
        let rstd = 1.0 / (var + eps as f64).sqrt();
        row.iter()
            .zip(w)
            .zip(b)
            .map(|((&v, &w), &b)| (v as f64 - mean) * rstd * w as f64 + b as f64)
            .collect()
    }

    #[test]
    fn layer_norm_is_accurate_and_bit_identical_on_every_isa() {
        let x: Vec<f32> = test_values(3000)
            .into_iter()
            .filter(|v| v.abs() < 1e6)
            .map(|v| v + 3.0)
            .collect();
        for row_len in [1, 2, 7, 8, 9, 384, 1000] {
            let n = x.len() / row_len * row_len;
            let w: Vec<f32> = (0..row_len).map(|i| 1.0 + (i as f32).sin() * 0.5).collect();
            let b: Vec<f32> = (0..row_len).map(|i| (i as f32 * 0.3).cos() * 0.1).collect();
            let mut want = x[..n].to_vec();
            layer_norm_on(Isa::Scalar, &mut want, &w, &b, 1e-12);
            for (row, got) in x[..n].chunks(row_len).zip(want.chunks(row_len)) {
                for (&g, r) in got.iter().zip(layer_norm_ref(row, &w, &b, 1e-12)) {
                    assert!((g as f64 - r).abs() <= 1e-6 * (1.0 + r.abs()), "{g} vs {r}");
                }
            }
            for isa in Isa::available() {
                let mut got = x[..n].to_vec();
                layer_norm_on(isa, &mut got, &w, &b, 1e-12);
                assert!(same_bits(&got, &want), "{isa:?}, rows of {row_len}");
            }
        }
    }

    #[test]
    fn layer_norm_rows_checks_lengths() {
        let mut row = [1.0f32, 2.0, 3.0, 4.0];
        layer_norm_rows(&mut row, &[1.0; 4], &[0.5; 4], 0.0).unwrap();
        let s = 1.0 / 1.25f32.sqrt();
        for (got, want) in row.iter().zip([-1.5 * s, -0.5 * s, 0.5 * s, 1.5 * s]) {
            assert!((got - (want + 0.5)).abs() < 1e-6);
        }
        assert!(layer_norm_rows(&mut row, &[1.0; 4], &[0.5; 3], 0.0).is_err());
        assert!(layer_norm_rows(&mut row, &[1.0; 3], &[0.5; 3], 0.0).is_err());
        assert!(layer_norm_rows(&mut row, &[], &[], 0.0).is_err());
        assert!(layer_norm_rows(&mut [], &[], &[], 0.0).is_ok());
        assert!(layer_norm_rows(&mut [], &[1.0], &[0.0], 0.0).is_ok());
        // A constant row is all shift.
        let mut row = [2.5f32; 5];
        layer_norm_rows(&mut row, &[3.0; 5], &[0.25; 5], 1e-5).unwrap();
        assert_eq!(row, [0.25; 5]);
    }
}
