//! Activation quantisation to the vec-dot types (f32, f16, bf16, Q8_0, Q8_1, Q8_K), following
//! ggml's reference `quantize_row_*_ref` so our dot products see the same integers as llama.cpp.

use half::{bf16, f16};

use crate::blocks::{Q8K_BYTES, Q8_0_BYTES, Q8_1_BYTES, QK};
use crate::dot::Isa;
use crate::dtype::{GgmlType, QK_K};
use crate::error::{KernelError, Result};

/// Quantises `x` into `target`'s block format, replacing the contents of `out`.
///
/// `target` must be a vec-dot type: F32, F16, BF16, Q8_0, Q8_1 or Q8_K. Q8_0 output is also a
/// valid Q8_0 weight tensor. Rounding follows ggml's reference code: Q8_0 and Q8_1 round half
/// away from zero (`roundf`), Q8_K rounds half to even (`nearest_int`), f16/bf16 round to nearest
/// even.
pub fn quantize_row(target: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
    let bytes = target.checked_row_bytes(x.len(), "quantize_row x elements")?;
    out.clear();
    out.resize(bytes, 0);
    quantize_into(target, x, out)
}

/// Quantises the activation row `x` to the vec-dot type of weights of type `weights`
/// ([`GgmlType::vec_dot_type`]), replacing the contents of `out`; the result is what
/// [`vec_dot`](crate::vec_dot) takes as its `quantized_x`.
pub fn quantize_activations(weights: GgmlType, x: &[f32], out: &mut Vec<u8>) -> Result<()> {
    quantize_row(
        weights.checked_vec_dot_type("quantize_activations")?,
        x,
        out,
    )
}

/// Quantises `x` into `out`, which must be exactly `target.row_bytes(x.len())` long.
pub(crate) fn quantize_into(target: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    let expected = target.checked_row_bytes(x.len(), "quantize x elements")?;
    if out.len() != expected {
        return Err(KernelError::LengthMismatch {
            what: "quantize out bytes",
            expected,
            actual: out.len(),
        });
    }
    match target {
        GgmlType::F32 => {
            for (o, v) in out.as_chunks_mut::<4>().0.iter_mut().zip(x) {
                *o = v.to_le_bytes();
            }
        }
        GgmlType::F16 => {
            for (o, v) in out.as_chunks_mut::<2>().0.iter_mut().zip(x) {
                *o = f16::from_f32(*v).to_le_bytes();
            }
        }
        GgmlType::BF16 => {
            for (o, v) in out.as_chunks_mut::<2>().0.iter_mut().zip(x) {
                *o = bf16::from_f32(*v).to_le_bytes();
            }
        }
        GgmlType::Q8_0 | GgmlType::Q8_1 | GgmlType::Q8K => quantize_blocks(target, x, out),
        _ => {
            return Err(KernelError::Unsupported {
                ty: target,
                op: "quantize_row",
            })
        }
    }
    Ok(())
}

/// The Q8 block formats of [`quantize_into`] (checked there) on the copy of the loops compiled
/// for this CPU's vector width: the same IEEE operations in every copy (no contraction, exact
/// maxima and roundings), so the same bytes.
fn quantize_blocks(target: GgmlType, x: &[f32], out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    match Isa::detected() {
        // SAFETY: `Isa::Avx512`/`Avx512Bw` are only detected on CPUs with AVX-512 F/BW/VL.
        Isa::Avx512 | Isa::Avx512Bw => return unsafe { blocks_avx512(target, x, out) },
        // SAFETY: `Isa::Avx2` is only detected on CPUs with AVX2 and FMA.
        Isa::Avx2 => return unsafe { blocks_avx2(target, x, out) },
        Isa::Scalar => {}
    }
    blocks_portable(target, x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn blocks_avx512(target: GgmlType, x: &[f32], out: &mut [u8]) {
    blocks_portable(target, x, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn blocks_avx2(target: GgmlType, x: &[f32], out: &mut [u8]) {
    blocks_portable(target, x, out)
}

/// The block loops, written to vectorise for whichever copy inlines them.
#[inline(always)]
fn blocks_portable(target: GgmlType, x: &[f32], out: &mut [u8]) {
    match target {
        GgmlType::Q8_0 => {
            for (o, v) in out
                .as_chunks_mut::<Q8_0_BYTES>()
                .0
                .iter_mut()
                .zip(x.as_chunks().0)
            {
                q8_0_block(v, o);
            }
        }
        GgmlType::Q8_1 => {
            for (o, v) in out
                .as_chunks_mut::<Q8_1_BYTES>()
                .0
                .iter_mut()
                .zip(x.as_chunks().0)
            {
                q8_1_block(v, o);
            }
        }
        _ => {
            for (o, v) in out
                .as_chunks_mut::<Q8K_BYTES>()
                .0
                .iter_mut()
                .zip(x.as_chunks().0)
            {
                q8_k_block(v, o);
            }
        }
    }
}

/// Largest magnitude in `x` (NaN ignored, as `f32::max` does), through 16 partial maxima so
/// the loop vectorises; a maximum does not depend on the order it is taken in.
#[inline(always)]
fn amax(x: &[f32]) -> f32 {
    let mut m = [0f32; 16];
    for c in x.chunks_exact(16) {
        for (m, v) in m.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    // Pairwise halving, not a serial fold: 4 dependent steps instead of 16.
    for w in [8, 4, 2, 1] {
        for i in 0..w {
            m[i] = m[i].max(m[i + w]);
        }
    }
    let mut a = m[0];
    for v in x.chunks_exact(16).remainder() {
        a = a.max(v.abs());
    }
    a
}

/// Scale and inverse scale of a Q8_0 / Q8_1 block: d = amax / 127, id = 1 / d (0 when d is 0).
#[inline(always)]
fn q8_scale(x: &[f32; QK]) -> (f32, f32) {
    let d = amax(x) / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// `1.5 * 2^23`: adding and subtracting it rounds a value of magnitude below 2^22 to an integer
/// in the FPU's default mode (half to even), and the sum's low mantissa bits are then that
/// integer (two's complement, offset by the constant's bits).
const MAGIC: f32 = 12_582_912.0;

/// The integer value of `y`, an integer of magnitude below 2^22, read from the bits of
/// `y + MAGIC`. Unlike `y as i32` (Rust's saturating cast, which x86 can only do one lane at a
/// time with compares and moves) it is an add and an integer subtract, which vectorise.
#[inline(always)]
fn int_of(y: f32) -> i32 {
    ((y + MAGIC).to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32)
}

/// C's `roundf` (half away from zero) of a value of magnitude below 2^22, as an i32; NaN gives
/// 0 (as `roundf` then `as` does).
///
/// `round()` is a libm call per element on baseline x86_64 (no SSE4.1), and a saturating float
/// to integer cast does not vectorise: this rounds half to even with [`MAGIC`], moves the ties
/// that went toward zero one step away, and reads the integer with [`int_of`], all in branch-free
/// lane operations.
#[inline(always)]
fn round_away(x: f32) -> i32 {
    let n = (x + MAGIC) - MAGIC;
    // Exact: `n` is within 0.5 of `x`.
    let r = x - n;
    let step = if r == 0.5 && x > 0.0 {
        1.0
    } else if r == -0.5 && x < 0.0 {
        -1.0
    } else {
        0.0
    };
    if x.is_nan() {
        0
    } else {
        int_of(n + step)
    }
}

/// Round half to even (ggml's `nearest_int`) of a value of magnitude below 2^22, branch-free so
/// it vectorises (`round_ties_even` is a libm call on baseline x86_64). NaN gives 0.
#[inline(always)]
fn round_even(x: f32) -> i32 {
    if x.is_nan() {
        0
    } else {
        int_of((x + MAGIC) - MAGIC)
    }
}

#[inline(always)]
fn q8_0_block(x: &[f32; QK], out: &mut [u8; Q8_0_BYTES]) {
    let (d, id) = q8_scale(x);
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        // `round` is C's roundf (half away from zero); |v * id| <= 127 up to rounding.
        *o = round_away(v * id) as i8 as u8;
    }
}

#[inline(always)]
fn q8_1_block(x: &[f32; QK], out: &mut [u8; Q8_1_BYTES]) {
    let (d, id) = q8_scale(x);
    let mut sum = 0i32;
    for (o, v) in out[4..].iter_mut().zip(x) {
        let q = round_away(v * id) as i8;
        sum += q as i32;
        *o = q as u8;
    }
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    out[2..4].copy_from_slice(&f16::from_f32(sum as f32 * d).to_le_bytes());
}

#[inline(always)]
fn q8_k_block(x: &[f32; QK_K], out: &mut [u8; Q8K_BYTES]) {
    // The element of largest magnitude (first one on ties) maps to exactly -127.
    let a = amax(x);
    if a == 0.0 {
        out.fill(0);
        return;
    }
    let max = x
        .chunks_exact(16)
        // The first 16 with the maximum (no early exit inside, so the test vectorises).
        .find(|c| c.iter().fold(false, |hit, v| hit | (v.abs() == a)))
        .and_then(|c| c.iter().find(|v| v.abs() == a))
        .copied()
        .expect("the maximum is an element");
    let iscale = -127.0 / max;
    let (d, rest) = out.split_at_mut(4);
    let (qs, bsums) = rest.split_at_mut(QK_K);
    for (o, v) in qs.iter_mut().zip(x) {
        // ggml's `nearest_int` rounds half to even.
        *o = round_even(iscale * v).min(127) as i8 as u8;
    }
    for (bs, group) in bsums
        .as_chunks_mut::<2>()
        .0
        .iter_mut()
        .zip(qs.as_chunks::<16>().0)
    {
        let s: i32 = group.iter().map(|&q| q as i8 as i32).sum();
        *bs = (s as i16).to_le_bytes();
    }
    d.copy_from_slice(&(1.0 / iscale).to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{f16_at, f32_at, i16_at};

    proptest::proptest! {
        /// The vectorisable roundings agree with the standard library's on every value the
        /// quantisers can produce (|v| <= 128), including exact halves and their neighbours.
        #[test]
        fn roundings_match_std(v in -128.0f32..128.0, half in -256i32..256, ulps in -2i32..3) {
            let h = half as f32 * 0.5;
            let near = f32::from_bits((h.to_bits() as i32 + ulps) as u32);
            for x in [v, h, near, -near] {
                proptest::prop_assert_eq!(round_away(x), x.round() as i32, "{}", x);
                proptest::prop_assert_eq!(round_even(x), x.round_ties_even() as i32, "{}", x);
            }
        }
    }

    /// Every compiled copy of the block loops gives the bytes of the portable one (ties, NaN,
    /// zeros and a largest magnitude that appears with both signs included).
    #[test]
    fn every_copy_gives_the_same_bytes() {
        let mut x: Vec<f32> = (0..4 * QK_K)
            .map(|i| ((i * 2_654_435_761) % 20_001) as f32 / 10_000.0 - 1.0)
            .collect();
        x[3] = f32::NAN;
        x[40..72].fill(0.0);
        x[300] = 5.0;
        x[301] = -5.0;
        x[600] = -7.0;
        x[610] = 7.0;
        // d = 1 exactly for the block at 128: exact halves to round.
        x[128] = 127.0;
        for (k, v) in x[129..160].iter_mut().enumerate() {
            *v = k as f32 - 15.5;
        }
        for ty in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
            let n = ty.row_bytes(x.len()).unwrap();
            let mut want = vec![0u8; n];
            blocks_portable(ty, &x, &mut want);
            for isa in Isa::available() {
                let mut got = vec![0xAAu8; n];
                match isa {
                    // SAFETY: `available` lists only what this CPU runs.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx512 | Isa::Avx512Bw => unsafe { blocks_avx512(ty, &x, &mut got) },
                    // SAFETY: as above.
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { blocks_avx2(ty, &x, &mut got) },
                    Isa::Scalar => blocks_portable(ty, &x, &mut got),
                }
                assert_eq!(got, want, "{ty:?} on {isa:?}");
            }
        }
    }

    #[test]
    fn q8_0_rounds_half_away_from_zero() {
        // amax 127 gives d = 1 exactly, so the quants are round(x).
        let mut x = [0f32; 32];
        x[0] = 127.0;
        x[1] = 2.5;
        x[2] = -2.5;
        x[3] = 0.49;
        let mut out = Vec::new();
        quantize_row(GgmlType::Q8_0, &x, &mut out).unwrap();
        assert_eq!(f16_at(&out, 0), 1.0);
        assert_eq!(&out[2..6], &[127, 3, (-3i8) as u8, 0]);
    }

    #[test]
    fn q8_1_sum_field() {
        let x: Vec<f32> = (0..32).map(|i| i as f32 - 10.0).collect();
        let mut out = Vec::new();
        quantize_row(GgmlType::Q8_1, &x, &mut out).unwrap();
        let d = f16_at(&out, 0);
        let sum: i32 = out[4..].iter().map(|&q| q as i8 as i32).sum();
        let s = f16_at(&out, 2);
        assert_eq!(s, f16::from_f32(sum as f32 * (21.0 / 127.0)).to_f32());
        assert!((d - 21.0 / 127.0).abs() < 1e-3);
    }

    #[test]
    fn q8_k_max_maps_to_minus_127_and_bsums() {
        let mut x = [0.25f32; 256];
        x[7] = 2.0;
        x[8] = -2.0; // same magnitude, later: does not win
        let mut out = Vec::new();
        quantize_row(GgmlType::Q8K, &x, &mut out).unwrap();
        assert_eq!(out[4 + 7] as i8, -127);
        assert_eq!(out[4 + 8] as i8, 127);
        assert_eq!(f32_at(&out, 0), 1.0 / (-127.0 / 2.0));
        // 0.25 * -63.5 = -15.875 -> -16
        assert_eq!(out[4] as i8, -16);
        assert_eq!(i16_at(&out, 260), -16 * 14 - 127 + 127);
        assert_eq!(i16_at(&out, 262), -16 * 16);
    }

    #[test]
    fn q8_k_rounds_half_to_even() {
        // max = -127 gives iscale = 1, so the quants are x rounded half to even.
        let mut x = [0f32; 256];
        x[0] = -127.0;
        x[1] = 2.5;
        x[2] = -3.5;
        x[3] = 0.5;
        let mut out = Vec::new();
        quantize_row(GgmlType::Q8K, &x, &mut out).unwrap();
        assert_eq!(f32_at(&out, 0), 1.0);
        assert_eq!(&out[4..8], &[(-127i8) as u8, 2, (-4i8) as u8, 0]);
    }

    #[test]
    fn zero_blocks_quantise_to_zero() {
        let mut out = Vec::new();
        for t in [GgmlType::Q8_0, GgmlType::Q8_1, GgmlType::Q8K] {
            quantize_row(t, &[0.0; 256], &mut out).unwrap();
            assert!(out.iter().all(|&b| b == 0), "{t}");
        }
    }

    #[test]
    fn rejects_bad_lengths() {
        let mut out = Vec::new();
        assert!(quantize_row(GgmlType::Q8_0, &[0.0; 33], &mut out).is_err());
        assert!(quantize_activations(GgmlType::Q4K, &[0.0; 32], &mut out).is_err());
        assert!(quantize_row(GgmlType::Q4_0, &[0.0; 32], &mut out).is_err());
        assert!(quantize_into(GgmlType::Q8_0, &[0.0; 32], &mut [0u8; 33]).is_err());
    }
}
