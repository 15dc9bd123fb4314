//! AVX2 + FMA dot products (x86_64) for the 32-element formats: Q4_0, Q4_1 and Q8_0 weights.
//!
//! Same integer products as `scalar.rs`; only the float accumulation order differs (eight lanes
//! with FMA), so results agree with scalar to a few ulps of the sum of |terms|.

use std::arch::x86_64::*;

use crate::blocks::{f16_at, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, Q8_1_BYTES};
use crate::dtype::GgmlType;

use super::DotFn;

/// The AVX2 kernel for `ty`, if there is one; the caller falls back to scalar otherwise.
///
/// Only `Isa::dot_fn` calls this, and only for `Isa::Avx2`, which `Isa::detected` returns only
/// after `is_x86_feature_detected!` confirmed AVX2 and FMA: the safe wrappers below rely on it.
pub(super) fn dot_fn(ty: GgmlType) -> Option<DotFn> {
    match ty {
        GgmlType::Q4_0 => Some(q4_0_q8_0),
        GgmlType::Q4_1 => Some(q4_1_q8_1),
        GgmlType::Q8_0 => Some(q8_0_q8_0),
        _ => None,
    }
}

fn q4_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: reachable only through `dot_fn`, handed out only once AVX2 and FMA were detected.
    unsafe { q4_0_q8_0_avx2(w, x) }
}

fn q4_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: reachable only through `dot_fn`, handed out only once AVX2 and FMA were detected.
    unsafe { q4_1_q8_1_avx2(w, x) }
}

fn q8_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: reachable only through `dot_fn`, handed out only once AVX2 and FMA were detected.
    unsafe { q8_0_q8_0_avx2(w, x) }
}

/// Loads 32 bytes.
#[inline]
#[target_feature(enable = "avx2")]
fn load32(b: &[u8; 32]) -> __m256i {
    // SAFETY: `b` is 32 readable bytes and `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(b.as_ptr().cast()) }
}

/// The 16 packed nibbles of a Q4 block as 32 bytes in element order: low nibbles (elements
/// 0..16) then high nibbles (16..32), each 0..=15.
#[inline]
#[target_feature(enable = "avx2")]
fn unpack_nibbles(qs: &[u8; 16]) -> __m256i {
    // SAFETY: `qs` is 16 readable bytes and `loadu` has no alignment requirement.
    let q = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let both = _mm256_set_m128i(_mm_srli_epi16::<4>(q), q);
    _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
}

/// Eight i32 partial sums of `a * b` for signed bytes (`a` in -128..=127, `b` in -127..=127,
/// as activation quantisation produces).
#[inline]
#[target_feature(enable = "avx2")]
fn dot_i8(a: __m256i, b: __m256i) -> __m256i {
    // maddubs multiplies unsigned by signed: move a's sign onto b.
    let ua = _mm256_sign_epi8(a, a);
    let sb = _mm256_sign_epi8(b, a);
    _mm256_madd_epi16(_mm256_maddubs_epi16(ua, sb), _mm256_set1_epi16(1))
}

/// Eight i32 partial sums of `a * b` for unsigned `a` (0..=15) and signed `b`.
#[inline]
#[target_feature(enable = "avx2")]
fn dot_u4_i8(a: __m256i, b: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), _mm256_set1_epi16(1))
}

/// Sum of the eight lanes.
#[inline]
#[target_feature(enable = "avx2")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Splits a block into its fixed-size fields.
#[inline(always)]
fn field<const N: usize>(b: &[u8], off: usize) -> &[u8; N] {
    b[off..off + N].try_into().expect("field within block")
}

#[target_feature(enable = "avx2,fma")]
fn q4_0_q8_0_avx2(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (wb, xb) in w
        .as_chunks::<Q4_0_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_0_BYTES>().0)
    {
        let qw = _mm256_sub_epi8(unpack_nibbles(field(wb, 2)), _mm256_set1_epi8(8));
        let qx = load32(field(xb, 2));
        let d = _mm256_set1_ps(f16_at(wb, 0) * f16_at(xb, 0));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_i8(qw, qx)), acc);
    }
    hsum(acc)
}

#[target_feature(enable = "avx2,fma")]
fn q4_1_q8_1_avx2(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    let mut mins = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q4_1_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_1_BYTES>().0)
    {
        let qw = unpack_nibbles(field(wb, 4));
        let qx = load32(field(xb, 4));
        let d = _mm256_set1_ps(f16_at(wb, 0) * f16_at(xb, 0));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot_u4_i8(qw, qx)), acc);
        mins += f16_at(wb, 2) * f16_at(xb, 2);
    }
    hsum(acc) + mins
}

#[target_feature(enable = "avx2,fma")]
fn q8_0_q8_0_avx2(w: &[u8], x: &[u8]) -> f32 {
    let mut acc = _mm256_setzero_ps();
    for (wb, xb) in w
        .as_chunks::<Q8_0_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_0_BYTES>().0)
    {
        let d = _mm256_set1_ps(f16_at(wb, 0) * f16_at(xb, 0));
        let dot = dot_i8(load32(field(wb, 2)), load32(field(xb, 2)));
        acc = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(dot), acc);
    }
    hsum(acc)
}
