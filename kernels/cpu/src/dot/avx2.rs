//! AVX2 + FMA + F16C dot products (x86_64) for formats without a tiled kernel: f16 weights.
//!
//! The quantised formats are in `crate::gemm`, whose tiled kernels also give the single dot
//! product. The f16 kernel converts with F16C (exact) and sums each 32-element group in f32
//! lanes, then adds the group into an f64 total, so it agrees with the scalar reference (f64
//! throughout) to a few ulps of the group sums.

use std::arch::x86_64::*;

use crate::dtype::GgmlType;

use super::DotFn;

/// The AVX2 kernel for `ty`, if there is one; the caller falls back to scalar otherwise.
///
/// Only `Isa::dot_fn` calls this, and only for an x86 SIMD ISA, which `Isa::detected` returns
/// only after `is_x86_feature_detected!` confirmed AVX2, FMA and F16C: the safe wrappers below
/// rely on it.
pub(super) fn dot_fn(ty: GgmlType) -> Option<DotFn> {
    match ty {
        GgmlType::F16 => Some(f16_f16),
        _ => None,
    }
}

fn f16_f16(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: reachable only through `dot_fn`, handed out only once AVX2, FMA and F16C were
    // detected.
    unsafe { f16_f16_avx2(w, x) }
}

/// Eight f16 values at `b` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn load8(b: &[u8; 16]) -> __m256 {
    // SAFETY: `b` is 16 readable bytes and `loadu` has no alignment requirement.
    _mm256_cvtph_ps(unsafe { _mm_loadu_si128(b.as_ptr().cast()) })
}

#[target_feature(enable = "avx2,fma,f16c")]
fn f16_f16_avx2(w: &[u8], x: &[u8]) -> f32 {
    // 64 bytes = 32 elements per group.
    let (wg, wt) = w.as_chunks::<64>();
    let (xg, xt) = x.as_chunks::<64>();
    let mut total = 0f64;
    for (a, b) in wg.iter().zip(xg) {
        let mut acc = _mm256_setzero_ps();
        for j in 0..4 {
            let wa: &[u8; 16] = a[16 * j..16 * j + 16].try_into().expect("16 bytes");
            let xb: &[u8; 16] = b[16 * j..16 * j + 16].try_into().expect("16 bytes");
            acc = _mm256_fmadd_ps(load8(wa), load8(xb), acc);
        }
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps::<1>(acc));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        total += _mm_cvtss_f32(s) as f64;
    }
    total as f32 + super::scalar::f16_f16(wt, xt)
}
