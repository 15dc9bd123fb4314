//! AVX2 + FMA + F16C dot products (x86_64) for formats without a tiled kernel: f16 weights,
//! the K-quants (Q4_K, Q5_K, Q6_K times Q8_K) and Q5_0 / Q5_1 (times Q8_0 / Q8_1).
//!
//! The 32-element quantised formats are in `crate::gemm`. The f16 kernel converts with F16C
//! (exact) and sums each 32-element group in f32 lanes, then adds the group into an f64 total,
//! so it agrees with the scalar reference (f64 throughout) to a few ulps of the group sums.
//!
//! The K-quant kernels unpack 32 quants at a time in registers and take `vpmaddubsw` (u8 x i8
//! pairs, which cannot saturate here: at most 63 x 127 x 2) and `vpmaddwd` with the sub-block
//! scales. Their integer block sums are exact and the float epilogue is the scalar one, so they
//! return the scalar reference's bits. The Q5_0 / Q5_1 kernels do the same per 32-element block:
//! the fifth bits are spread from `qh` to bytes by a shuffle and a compare, and Q5_0's offset of
//! 16 is taken off as `16 * sum(y)` in the same i16 lanes (at most 2 x 16 x 128).

use std::arch::x86_64::*;

use crate::blocks::{
    f16_at, f32_at, i16_at, k4_scales_field, k4_scales_mins, Q4K_BYTES, Q5K_BYTES, Q5_0_BYTES,
    Q5_1_BYTES, Q6K_BYTES, Q8K_BYTES, Q8_0_BYTES, Q8_1_BYTES,
};
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
        GgmlType::Q4K => Some(q4_k_q8_k),
        GgmlType::Q5K => Some(q5_k_q8_k),
        GgmlType::Q6K => Some(q6_k_q8_k),
        GgmlType::Q5_0 => Some(q5_0_q8_0),
        GgmlType::Q5_1 => Some(q5_1_q8_1),
        _ => None,
    }
}

fn q5_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: reachable only through `dot_fn`, handed out only once AVX2, FMA and F16C were
    // detected.
    unsafe { q5_avx2::<false>(w, x) }
}

fn q5_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: as for `q5_0_q8_0`.
    unsafe { q5_avx2::<true>(w, x) }
}

/// Q5_0 (`MIN == false`, times Q8_0) or Q5_1 (times Q8_1), block by block as the scalar kernels:
/// the 32 five-bit quants in element order (low nibbles of `qs` then high ones, bit 4 from bit j
/// of the little-endian `qh`), `vpmaddubsw` against the activations' i8 quants, exact i32 sums,
/// and the scalar epilogue.
#[target_feature(enable = "avx2,fma,f16c")]
fn q5_avx2<const MIN: bool>(w: &[u8], x: &[u8]) -> f32 {
    let (bs, qh_off, xbs, xq_off) = if MIN {
        (Q5_1_BYTES, 4, Q8_1_BYTES, 4)
    } else {
        (Q5_0_BYTES, 2, Q8_0_BYTES, 2)
    };
    let nibble = _mm_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let ones16 = _mm256_set1_epi16(1);
    let sixteen = _mm256_set1_epi8(16);
    // Byte j of a lane takes byte j / 8 of qh; OR-ing in "every bit but j % 8" leaves 0xFF
    // exactly where bit j of qh is set.
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let all = _mm256_set1_epi8(-1);
    let mut sumf = 0f32;
    for (wb, xb) in w.chunks_exact(bs).zip(x.chunks_exact(xbs)) {
        let qh = u32::from_le_bytes([wb[qh_off], wb[qh_off + 1], wb[qh_off + 2], wb[qh_off + 3]]);
        let qs: &[u8; 16] = wb[qh_off + 4..qh_off + 20].try_into().expect("16 bytes");
        // SAFETY: 16 readable bytes; `loadu` has no alignment requirement.
        let qs = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
        let lo = _mm_and_si128(qs, nibble);
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), nibble);
        let bits = _mm256_shuffle_epi8(_mm256_set1_epi32(qh as i32), spread);
        let bits = _mm256_cmpeq_epi8(_mm256_or_si256(bits, others), all);
        let q = _mm256_or_si256(_mm256_set_m128i(hi, lo), _mm256_and_si256(bits, bit4));
        let y = load32(xb, xq_off);
        let mut p = _mm256_maddubs_epi16(q, y);
        if !MIN {
            p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(sixteen, y));
        }
        let sumi = hsum_i32(_mm256_madd_epi16(p, ones16));
        sumf += if MIN {
            (f16_at(wb, 0) * f16_at(xb, 0)) * sumi as f32 + f16_at(wb, 2) * f16_at(xb, 2)
        } else {
            (f16_at(wb, 0) * f16_at(xb, 0)) * sumi as f32
        };
    }
    sumf
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

fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: reachable only through `dot_fn`, handed out only once AVX2, FMA and F16C were
    // detected.
    unsafe { k4_avx2::<false>(w, x) }
}

fn q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: as for `q4_k_q8_k`.
    unsafe { k4_avx2::<true>(w, x) }
}

fn q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    // SAFETY: as for `q4_k_q8_k`.
    unsafe { q6_k_avx2(w, x) }
}

/// 32 bytes at `b[off..off + 32]`.
#[inline]
#[target_feature(enable = "avx2")]
fn load32(b: &[u8], off: usize) -> __m256i {
    let v: &[u8; 32] = b[off..off + 32].try_into().expect("32 bytes");
    // SAFETY: 32 readable bytes; `loadu` has no alignment requirement.
    unsafe { _mm256_loadu_si256(v.as_ptr().cast()) }
}

/// The sum of the eight i32 lanes (exact: the block sums fit i32, as in the scalar kernels).
#[inline]
#[target_feature(enable = "avx2")]
fn hsum_i32(v: __m256i) -> i32 {
    let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
    let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
    _mm_cvtsi128_si32(s)
}

/// Q4_K (`Q5 == false`) or Q5_K times Q8_K. Per 64 elements `k`: 32 quant bytes hold sub-block
/// `2k` in their low nibbles and `2k + 1` in their high ones; Q5_K adds bit `2k` / `2k + 1` of
/// `qh[l]` as bit 4.
#[target_feature(enable = "avx2,fma,f16c")]
fn k4_avx2<const Q5: bool>(w: &[u8], x: &[u8]) -> f32 {
    let bs = if Q5 { Q5K_BYTES } else { Q4K_BYTES };
    let qs_off = if Q5 { 48 } else { 16 };
    let nibble = _mm256_set1_epi8(0x0F);
    let bit4 = _mm256_set1_epi8(0x10);
    let mut sumf = 0f32;
    for (wb, xb) in w.chunks_exact(bs).zip(x.as_chunks::<Q8K_BYTES>().0) {
        let (sc, mn) = k4_scales_mins(k4_scales_field(wb));
        let qh = if Q5 {
            load32(wb, 16)
        } else {
            _mm256_setzero_si256()
        };
        let mut acc = _mm256_setzero_si256();
        for k in 0..4 {
            let q = load32(wb, qs_off + 32 * k);
            let mut lo = _mm256_and_si256(q, nibble);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), nibble);
            if Q5 {
                // Bit 2k of each qh byte to bit 4 (shifting 16-bit lanes keeps each byte's own
                // bits in place below the mask).
                let s = _mm_cvtsi32_si128(2 * k as i32);
                let h = _mm256_srl_epi16(qh, s);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_slli_epi16::<4>(h), bit4));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_slli_epi16::<3>(h), bit4));
            }
            let plo = _mm256_maddubs_epi16(lo, load32(xb, 4 + 64 * k));
            let phi = _mm256_maddubs_epi16(hi, load32(xb, 4 + 64 * k + 32));
            let slo = _mm256_madd_epi16(plo, _mm256_set1_epi16(sc[2 * k] as i16));
            let shi = _mm256_madd_epi16(phi, _mm256_set1_epi16(sc[2 * k + 1] as i16));
            acc = _mm256_add_epi32(acc, _mm256_add_epi32(slo, shi));
        }
        let sumi = hsum_i32(acc);
        let yd = f32_at(xb, 0);
        sumf += f16_at(wb, 0) * yd * sumi as f32
            - f16_at(wb, 2) * yd * super::scalar::k4_min_term(xb, &mn) as f32;
    }
    sumf
}

/// Q6_K times Q8_K. Each half of a block (128 elements) has 64 bytes of low nibbles `ql` and 32
/// bytes `qh` of 2-bit high parts; element `l + 32 j` (j = 0..4) takes its low nibble from
/// `ql[l + 32 (j & 1)]` (low nibble for j < 2, high for j >= 2) and bits `2j..2j+2` of `qh[l]`.
/// The quants are taken unsigned (0..64), and `32 * sum(y)` per 16-element group (the Q8_K
/// `bsums`) is subtracted to give the signed products exactly.
#[target_feature(enable = "avx2,fma,f16c")]
fn q6_k_avx2(w: &[u8], x: &[u8]) -> f32 {
    let nibble = _mm256_set1_epi8(0x0F);
    let two = _mm256_set1_epi8(0x30);
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q6K_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8K_BYTES>().0)
    {
        let sc: [i16; 16] = std::array::from_fn(|g| wb[192 + g] as i8 as i16);
        let mut acc = _mm256_setzero_si256();
        for half in 0..2 {
            let a = load32(wb, 64 * half);
            let b = load32(wb, 64 * half + 32);
            let h = load32(wb, 128 + 32 * half);
            let u = [
                _mm256_or_si256(
                    _mm256_and_si256(a, nibble),
                    _mm256_and_si256(_mm256_slli_epi16::<4>(h), two),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(b, nibble),
                    _mm256_and_si256(_mm256_slli_epi16::<2>(h), two),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(a), nibble),
                    _mm256_and_si256(h, two),
                ),
                _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16::<4>(b), nibble),
                    _mm256_and_si256(_mm256_srli_epi16::<2>(h), two),
                ),
            ];
            for (j, u) in u.into_iter().enumerate() {
                let g = 8 * half + 2 * j;
                let p = _mm256_maddubs_epi16(u, load32(xb, 4 + 128 * half + 32 * j));
                let scale = _mm256_set_m128i(_mm_set1_epi16(sc[g + 1]), _mm_set1_epi16(sc[g]));
                acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, scale));
            }
        }
        let bias: i32 = (0..16)
            .map(|g| sc[g] as i32 * i16_at(xb, 260 + 2 * g) as i32)
            .sum();
        let sumi = hsum_i32(acc) - 32 * bias;
        sumf += f16_at(wb, 208) * f32_at(xb, 0) * sumi as f32;
    }
    sumf
}
