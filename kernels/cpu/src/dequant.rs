//! Scalar reference dequantisation: GGML blocks to f32, bit for bit as ggml's `dequantize_row_*`.

use crate::blocks::{
    bf16_at, f16_at, k4_scales_field, k4_scales_mins, q5_values, Q4K_BYTES, Q4_0_BYTES, Q4_1_BYTES,
    Q5K_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q6K_BYTES, Q8_0_BYTES, QK,
};
use crate::dtype::{GgmlType, QK_K};
use crate::error::{KernelError, Result};

/// Dequantises one row: `src` holds `dst.len()` elements of type `ty`.
///
/// Errors if `ty` is not [supported](GgmlType::is_supported), if `dst.len()` is not a whole
/// number of blocks, or if `src` is not exactly that many blocks long.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    ty.checked_vec_dot_type("dequantize_row")?;
    let expected = ty.checked_row_bytes(dst.len(), "dequantize_row dst elements")?;
    if src.len() != expected {
        return Err(KernelError::LengthMismatch {
            what: "dequantize_row src bytes",
            expected,
            actual: src.len(),
        });
    }
    match ty {
        GgmlType::F32 => {
            for (y, b) in dst.iter_mut().zip(src.as_chunks::<4>().0) {
                *y = f32::from_le_bytes(*b);
            }
        }
        GgmlType::F16 => {
            for (i, y) in dst.iter_mut().enumerate() {
                *y = f16_at(src, 2 * i);
            }
        }
        GgmlType::BF16 => {
            for (i, y) in dst.iter_mut().enumerate() {
                *y = bf16_at(src, 2 * i);
            }
        }
        GgmlType::Q4_0 => blocks::<Q4_0_BYTES, QK>(src, dst, q4_0),
        GgmlType::Q4_1 => blocks::<Q4_1_BYTES, QK>(src, dst, q4_1),
        GgmlType::Q5_0 => blocks::<Q5_0_BYTES, QK>(src, dst, q5_0),
        GgmlType::Q5_1 => blocks::<Q5_1_BYTES, QK>(src, dst, q5_1),
        GgmlType::Q8_0 => blocks::<Q8_0_BYTES, QK>(src, dst, q8_0),
        GgmlType::Q4K => blocks::<Q4K_BYTES, QK_K>(src, dst, q4_k),
        GgmlType::Q5K => blocks::<Q5K_BYTES, QK_K>(src, dst, q5_k),
        GgmlType::Q6K => blocks::<Q6K_BYTES, QK_K>(src, dst, q6_k),
        _ => unreachable!("checked_vec_dot_type rejected {ty}"),
    }
    Ok(())
}

/// Runs `f` on each (block, output block) pair; lengths were validated by the caller.
#[inline(always)]
fn blocks<const B: usize, const N: usize>(
    src: &[u8],
    dst: &mut [f32],
    f: impl Fn(&[u8; B], &mut [f32; N]),
) {
    for (b, y) in src
        .as_chunks::<B>()
        .0
        .iter()
        .zip(dst.as_chunks_mut::<N>().0)
    {
        f(b, y);
    }
}

fn q4_0(b: &[u8; Q4_0_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for j in 0..QK / 2 {
        let q = b[2 + j];
        y[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
        y[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
    }
}

fn q4_1(b: &[u8; Q4_1_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for j in 0..QK / 2 {
        let q = b[4 + j];
        y[j] = (q & 0x0F) as f32 * d + m;
        y[j + QK / 2] = (q >> 4) as f32 * d + m;
    }
}

fn q5_0(b: &[u8; Q5_0_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for (y, q) in y.iter_mut().zip(q5_values(&b[2..6], &b[6..])) {
        *y = (q as i32 - 16) as f32 * d;
    }
}

fn q5_1(b: &[u8; Q5_1_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    let m = f16_at(b, 2);
    for (y, q) in y.iter_mut().zip(q5_values(&b[4..8], &b[8..])) {
        *y = q as f32 * d + m;
    }
}

fn q8_0(b: &[u8; Q8_0_BYTES], y: &mut [f32; QK]) {
    let d = f16_at(b, 0);
    for j in 0..QK {
        y[j] = b[2 + j] as i8 as f32 * d;
    }
}

/// Q4_K: 8 sub-blocks of 32; sub-block pair (2k, 2k+1) shares qs[32k..32k+32], low nibbles first.
fn q4_k(b: &[u8; Q4K_BYTES], y: &mut [f32; QK_K]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = k4_scales_mins(k4_scales_field(b));
    let qs = &b[16..];
    for k in 0..QK_K / 64 {
        let (d1, m1) = (d * sc[2 * k] as f32, dmin * mn[2 * k] as f32);
        let (d2, m2) = (d * sc[2 * k + 1] as f32, dmin * mn[2 * k + 1] as f32);
        for l in 0..32 {
            let q = qs[32 * k + l];
            y[64 * k + l] = d1 * (q & 0x0F) as f32 - m1;
            y[64 * k + 32 + l] = d2 * (q >> 4) as f32 - m2;
        }
    }
}

/// Q5_K: as Q4_K, plus a fifth bit per element from qh: bit `2k` for sub-block 2k, `2k+1` next.
fn q5_k(b: &[u8; Q5K_BYTES], y: &mut [f32; QK_K]) {
    let d = f16_at(b, 0);
    let dmin = f16_at(b, 2);
    let (sc, mn) = k4_scales_mins(k4_scales_field(b));
    let qh = &b[16..48];
    let qs = &b[48..];
    for k in 0..QK_K / 64 {
        let (d1, m1) = (d * sc[2 * k] as f32, dmin * mn[2 * k] as f32);
        let (d2, m2) = (d * sc[2 * k + 1] as f32, dmin * mn[2 * k + 1] as f32);
        for l in 0..32 {
            let q = qs[32 * k + l];
            let h = qh[l];
            let lo = (q & 0x0F) | (((h >> (2 * k)) & 1) << 4);
            let hi = (q >> 4) | (((h >> (2 * k + 1)) & 1) << 4);
            y[64 * k + l] = d1 * lo as f32 - m1;
            y[64 * k + 32 + l] = d2 * hi as f32 - m2;
        }
    }
}

/// Q6_K: two halves of 128; in each, element `32i + l` (i in 0..4) takes its low 4 bits from
/// ql (low nibbles of ql[0..64] for i = 0, 1, high nibbles for i = 2, 3) and its top 2 bits
/// from qh[l] bits 2i..2i+2; 16 signed 8-bit scales, one per 16 elements.
fn q6_k(b: &[u8; Q6K_BYTES], y: &mut [f32; QK_K]) {
    let d = f16_at(b, 208);
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let h = qh[l];
            let q1 = ((ql[l] & 0x0F) | ((h & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q4_0_known_block() {
        // d = 0.5, qs[0] = 0x9F: element 0 = (15 - 8) * 0.5, element 16 = (9 - 8) * 0.5.
        let mut b = vec![0u8; Q4_0_BYTES];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b[2] = 0x9F;
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q4_0, &b, &mut y).unwrap();
        assert_eq!(y[0], 3.5);
        assert_eq!(y[16], 0.5);
        assert_eq!(y[1], -4.0);
    }

    #[test]
    fn q5_known_blocks() {
        // qs[0] = 0x9F, qh bit 0 and bit 16 set: element 0 = 15 | 16 = 31, element 16 = 9 | 16
        // = 25, element 1 = 0 (no bits).
        let mut b = vec![0u8; Q5_0_BYTES];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b[2..6].copy_from_slice(&(1u32 | 1 << 16).to_le_bytes());
        b[6] = 0x9F;
        let mut y = [0f32; 32];
        dequantize_row(GgmlType::Q5_0, &b, &mut y).unwrap();
        assert_eq!(
            (y[0], y[16], y[1]),
            ((31 - 16) as f32 * 0.5, (25 - 16) as f32 * 0.5, -8.0)
        );

        let mut b = vec![0u8; Q5_1_BYTES];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        b[2..4].copy_from_slice(&half::f16::from_f32(-1.0).to_le_bytes());
        b[4..8].copy_from_slice(&(1u32 << 31).to_le_bytes());
        b[8 + 15] = 0x30;
        dequantize_row(GgmlType::Q5_1, &b, &mut y).unwrap();
        // Element 31: high nibble of qs[15] (3) with qh bit 31: 19.
        assert_eq!((y[31], y[0]), (19.0 * 0.5 - 1.0, -1.0));
    }

    #[test]
    fn rejects_bad_lengths_and_types() {
        let mut y = [0f32; 32];
        assert!(matches!(
            dequantize_row(GgmlType::Q4_0, &[0; 17], &mut y),
            Err(KernelError::LengthMismatch { .. })
        ));
        assert!(matches!(
            dequantize_row(GgmlType::Q4_0, &[0; 18], &mut y[..31]),
            Err(KernelError::NotBlockMultiple { .. })
        ));
        assert!(matches!(
            dequantize_row(GgmlType::Q2K, &[0; 84], &mut [0f32; 256]),
            Err(KernelError::Unsupported { .. })
        ));
    }
}
