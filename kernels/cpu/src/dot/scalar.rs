//! Scalar reference dot products of a weight row with a quantised activation row.
//!
//! Written as plain i32 accumulation over fixed-size arrays so the compiler can auto-vectorise
//! them; the per-ISA files must agree with these (see the property tests in `dot/mod.rs`).
//! Callers pass whole rows whose lengths match (checked once in `dot/mod.rs`).

use crate::blocks::{
    f16_at, f16_bits_to_f32, f32_at, i16_at, k4_scales_field, k4_scales_mins, q5_values, Q4K_BYTES,
    Q4_0_BYTES, Q4_1_BYTES, Q5K_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q6K_BYTES, Q8K_BYTES, Q8_0_BYTES,
    Q8_1_BYTES,
};

/// Accumulator lanes for the float dot products: independent partial sums the compiler can keep
/// in vector registers (8 f64 = two AVX2 or one AVX-512 register).
const FLOAT_LANES: usize = 8;

/// Sums `f(w_i, x_i) as f64` over element pairs in `FLOAT_LANES` interleaved partial sums
/// (ggml's generic float dot accumulates in double too). `B` is the element size in bytes.
#[inline(always)]
fn float_dot<const B: usize>(w: &[u8], x: &[u8], f: impl Fn([u8; B], [u8; B]) -> f32) -> f32 {
    let (w, x) = (w.as_chunks::<B>().0, x.as_chunks::<B>().0);
    let (w8, w_tail) = w.as_chunks::<FLOAT_LANES>();
    let (x8, x_tail) = x.as_chunks::<FLOAT_LANES>();
    let mut acc = [0f64; FLOAT_LANES];
    for (wc, xc) in w8.iter().zip(x8) {
        for k in 0..FLOAT_LANES {
            acc[k] += f(wc[k], xc[k]) as f64;
        }
    }
    let mut sum: f64 = acc.iter().sum();
    for (a, b) in w_tail.iter().zip(x_tail) {
        sum += f(*a, *b) as f64;
    }
    sum as f32
}

pub(crate) fn f32_f32(w: &[u8], x: &[u8]) -> f32 {
    float_dot(w, x, |a, b| f32::from_le_bytes(a) * f32::from_le_bytes(b))
}

pub(crate) fn f16_f16(w: &[u8], x: &[u8]) -> f32 {
    float_dot(w, x, |a, b| {
        f16_bits_to_f32(u16::from_le_bytes(a)) * f16_bits_to_f32(u16::from_le_bytes(b))
    })
}

pub(crate) fn bf16_bf16(w: &[u8], x: &[u8]) -> f32 {
    // bf16 is the top half of an f32.
    let widen = |v: [u8; 2]| f32::from_bits((u16::from_le_bytes(v) as u32) << 16);
    float_dot(w, x, |a, b| widen(a) * widen(b))
}

pub(crate) fn q4_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q4_0_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_0_BYTES>().0)
    {
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = wb[2 + j];
            let lo = (q & 0x0F) as i32 - 8;
            let hi = (q >> 4) as i32 - 8;
            sumi += lo * (xb[2 + j] as i8 as i32) + hi * (xb[18 + j] as i8 as i32);
        }
        sumf += sumi as f32 * f16_at(wb, 0) * f16_at(xb, 0);
    }
    sumf
}

pub(crate) fn q4_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q4_1_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_1_BYTES>().0)
    {
        let mut sumi = 0i32;
        for j in 0..16 {
            let q = wb[4 + j];
            sumi += (q & 0x0F) as i32 * (xb[4 + j] as i8 as i32)
                + (q >> 4) as i32 * (xb[20 + j] as i8 as i32);
        }
        // sum(d*q + m) * dy*qy = d*dy*sumi + m * (dy * sum(qy)), the last factor being `s`.
        sumf += (f16_at(wb, 0) * f16_at(xb, 0)) * sumi as f32 + f16_at(wb, 2) * f16_at(xb, 2);
    }
    sumf
}

/// ggml's `vec_dot_q5_0_q8_0`: integer sums of (q - 16) * y per block, scaled by d * dy.
pub(crate) fn q5_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q5_0_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_0_BYTES>().0)
    {
        let q = q5_values(&wb[2..6], &wb[6..]);
        let mut sumi = 0i32;
        for j in 0..32 {
            sumi += (q[j] as i32 - 16) * (xb[2 + j] as i8 as i32);
        }
        sumf += (f16_at(wb, 0) * f16_at(xb, 0)) * sumi as f32;
    }
    sumf
}

/// ggml's `vec_dot_q5_1_q8_1`: as Q4_1, with the fifth bit from qh.
pub(crate) fn q5_1_q8_1(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q5_1_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_1_BYTES>().0)
    {
        let q = q5_values(&wb[4..8], &wb[8..]);
        let mut sumi = 0i32;
        for j in 0..32 {
            sumi += q[j] as i32 * (xb[4 + j] as i8 as i32);
        }
        sumf += (f16_at(wb, 0) * f16_at(xb, 0)) * sumi as f32 + f16_at(wb, 2) * f16_at(xb, 2);
    }
    sumf
}

pub(crate) fn q8_0_q8_0(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q8_0_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8_0_BYTES>().0)
    {
        let mut sumi = 0i32;
        for j in 0..32 {
            sumi += (wb[2 + j] as i8 as i32) * (xb[2 + j] as i8 as i32);
        }
        sumf += sumi as f32 * (f16_at(wb, 0) * f16_at(xb, 0));
    }
    sumf
}

/// `sum(bsums[j] * mins[j / 2])`: the min term of Q4_K / Q5_K, from Q8_K's group sums.
#[inline(always)]
pub(super) fn k4_min_term(xb: &[u8; Q8K_BYTES], mins: &[u8; 8]) -> i32 {
    let mut s = 0i32;
    for j in 0..16 {
        s += i16_at(xb, 260 + 2 * j) as i32 * mins[j / 2] as i32;
    }
    s
}

pub(crate) fn q4_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q4K_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8K_BYTES>().0)
    {
        let (sc, mn) = k4_scales_mins(k4_scales_field(wb));
        let qs = &wb[16..];
        let q8 = &xb[4..260];
        let mut sumi = 0i32;
        for k in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[32 * k + l];
                lo += (q & 0x0F) as i32 * (q8[64 * k + l] as i8 as i32);
                hi += (q >> 4) as i32 * (q8[64 * k + 32 + l] as i8 as i32);
            }
            sumi += sc[2 * k] as i32 * lo + sc[2 * k + 1] as i32 * hi;
        }
        let yd = f32_at(xb, 0);
        sumf += f16_at(wb, 0) * yd * sumi as f32 - f16_at(wb, 2) * yd * k4_min_term(xb, &mn) as f32;
    }
    sumf
}

pub(crate) fn q5_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q5K_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8K_BYTES>().0)
    {
        let (sc, mn) = k4_scales_mins(k4_scales_field(wb));
        let qh = &wb[16..48];
        let qs = &wb[48..];
        let q8 = &xb[4..260];
        let mut sumi = 0i32;
        for k in 0..4 {
            let (mut lo, mut hi) = (0i32, 0i32);
            for l in 0..32 {
                let q = qs[32 * k + l];
                let h = qh[l];
                let ql = (q & 0x0F) | (((h >> (2 * k)) & 1) << 4);
                let qhi = (q >> 4) | (((h >> (2 * k + 1)) & 1) << 4);
                lo += ql as i32 * (q8[64 * k + l] as i8 as i32);
                hi += qhi as i32 * (q8[64 * k + 32 + l] as i8 as i32);
            }
            sumi += sc[2 * k] as i32 * lo + sc[2 * k + 1] as i32 * hi;
        }
        let yd = f32_at(xb, 0);
        sumf += f16_at(wb, 0) * yd * sumi as f32 - f16_at(wb, 2) * yd * k4_min_term(xb, &mn) as f32;
    }
    sumf
}

pub(crate) fn q6_k_q8_k(w: &[u8], x: &[u8]) -> f32 {
    let mut sumf = 0f32;
    for (wb, xb) in w
        .as_chunks::<Q6K_BYTES>()
        .0
        .iter()
        .zip(x.as_chunks::<Q8K_BYTES>().0)
    {
        let q8 = &xb[4..260];
        // Unpack to signed 6-bit values in element order, then one dot per 16-element group.
        let mut q = [0i8; 256];
        for half in 0..2 {
            let ql = &wb[64 * half..64 * half + 64];
            let qh = &wb[128 + 32 * half..128 + 32 * half + 32];
            let out = &mut q[128 * half..128 * half + 128];
            for l in 0..32 {
                let h = qh[l];
                out[l] = ((ql[l] & 0x0F) | ((h & 3) << 4)) as i8 - 32;
                out[l + 32] = ((ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4)) as i8 - 32;
                out[l + 64] = ((ql[l] >> 4) | (((h >> 4) & 3) << 4)) as i8 - 32;
                out[l + 96] = ((ql[l + 32] >> 4) | (((h >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        let mut sumi = 0i32;
        for g in 0..16 {
            let mut s = 0i32;
            for l in 0..16 {
                s += q[16 * g + l] as i32 * (q8[16 * g + l] as i8 as i32);
            }
            sumi += (wb[192 + g] as i8 as i32) * s;
        }
        sumf += f16_at(wb, 208) * f32_at(xb, 0) * sumi as f32;
    }
    sumf
}
