//! Activation quantisation to the vec-dot types (f32, f16, bf16, Q8_0, Q8_1, Q8_K), following
//! ggml's reference `quantize_row_*_ref` so our dot products see the same integers as llama.cpp.

use half::{bf16, f16};

use crate::blocks::{Q8K_BYTES, Q8_0_BYTES, Q8_1_BYTES, QK};
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
        GgmlType::Q8K => {
            for (o, v) in out
                .as_chunks_mut::<Q8K_BYTES>()
                .0
                .iter_mut()
                .zip(x.as_chunks().0)
            {
                q8_k_block(v, o);
            }
        }
        _ => {
            return Err(KernelError::Unsupported {
                ty: target,
                op: "quantize_row",
            })
        }
    }
    Ok(())
}

/// Scale and inverse scale of a Q8_0 / Q8_1 block: d = amax / 127, id = 1 / d (0 when d is 0).
#[inline(always)]
fn q8_scale(x: &[f32; QK]) -> (f32, f32) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    (d, id)
}

/// C's `roundf` (half away from zero) of a value of at most 2^23 in magnitude, as an i32.
///
/// `round()` compiles to a call of libm's `roundf` per element on baseline x86_64 (no SSE4.1),
/// which made quantising a decode step's activations a visible serial cost. Truncation by an
/// integer conversion and an exact comparison of the remainder vectorise with SSE2 and give the
/// same result (NaN gives 0, as `roundf` then `as` does).
#[inline(always)]
fn round_away(x: f32) -> i32 {
    let t = x as i32;
    // Exact: `x` and `t` share sign and exponent range, so the difference is representable.
    let r = x - t as f32;
    let step = if r >= 0.5 {
        1
    } else if r <= -0.5 {
        -1
    } else {
        0
    };
    t + step
}

/// Round half to even (ggml's `nearest_int`) of a value of at most 2^22 in magnitude: adding
/// and subtracting 1.5 * 2^23 leaves the integer part rounded in the FPU's default mode, which
/// is round-half-to-even. Branch-free, so it vectorises (`round_ties_even` is a libm call on
/// baseline x86_64).
#[inline(always)]
fn round_even(x: f32) -> i32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23
    ((x + MAGIC) - MAGIC) as i32
}

fn q8_0_block(x: &[f32; QK], out: &mut [u8; Q8_0_BYTES]) {
    let (d, id) = q8_scale(x);
    out[..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, v) in out[2..].iter_mut().zip(x) {
        // `round` is C's roundf (half away from zero); |v * id| <= 127 up to rounding.
        *o = round_away(v * id) as i8 as u8;
    }
}

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

fn q8_k_block(x: &[f32; QK_K], out: &mut [u8; Q8K_BYTES]) {
    // The element of largest magnitude (first one on ties) maps to exactly -127.
    let mut amax = 0f32;
    let mut max = 0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax == 0.0 {
        out.fill(0);
        return;
    }
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
