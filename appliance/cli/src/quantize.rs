//! Weight quantisers: f32 rows to GGML blocks by rounding to nearest, for `engram requantize`.
//!
//! The kernels quantise activations (`engram_kernels::quantize_row`, whose Q8_0 is also the
//! weights' Q8_0 and is used here); these write the other weight formats the CPU engine runs.
//! Every layout is the one `engram_kernels::dequantize_row` reads. The numbers need not match
//! llama-quantize bit for bit, only be sane and deterministic: legacy blocks take the plain
//! round-to-nearest scale, K-quant sub-blocks a small search for scale and min
//! ([`fit_sub_block`]), and every quant is rounded against the scale as stored (f16, and for
//! K-quants the 6- or 8-bit sub-block scale), so the stored rounding never adds to the error.

use anyhow::{bail, Result};
use engram_kernels::{f16, quantize_row as quantize_kernel_row, GgmlType, QK_K};

/// Elements per block of the legacy formats (Q5_0, Q5_1, Q8_0).
const QK: usize = 32;

/// The types [`quantize_row`] writes.
pub const WRITES: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q8_0,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Quantises the row `x` into `out`, which must be exactly `ty.row_bytes(x.len())` long.
pub fn quantize_row(ty: GgmlType, x: &[f32], out: &mut [u8]) -> Result<()> {
    if !WRITES.contains(&ty) {
        bail!("cannot write {ty} weights (writable: {})", names(&WRITES));
    }
    let Some(bytes) = ty.row_bytes(x.len()) else {
        bail!(
            "a row of {} elements is not a whole number of {ty} blocks of {}",
            x.len(),
            ty.block_size()
        );
    };
    if out.len() != bytes {
        bail!(
            "{ty} row of {} elements: output is {} bytes, expected {bytes}",
            x.len(),
            out.len()
        );
    }
    let size = ty.type_size();
    match ty {
        GgmlType::F32 => {
            for (o, v) in out.chunks_exact_mut(4).zip(x) {
                o.copy_from_slice(&v.to_le_bytes());
            }
        }
        GgmlType::F16 => {
            for (o, v) in out.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
            }
        }
        GgmlType::Q8_0 => {
            let mut row = Vec::with_capacity(bytes);
            quantize_kernel_row(GgmlType::Q8_0, x, &mut row)?;
            out.copy_from_slice(&row);
        }
        GgmlType::Q5_0 => blocks(x, out, QK, size, q5_0),
        GgmlType::Q5_1 => blocks(x, out, QK, size, q5_1),
        GgmlType::Q4K => blocks(x, out, QK_K, size, q4_k),
        GgmlType::Q5K => blocks(x, out, QK_K, size, q5_k),
        GgmlType::Q6K => blocks(x, out, QK_K, size, q6_k),
        _ => unreachable!("WRITES lists {ty}"),
    }
    Ok(())
}

/// `ggml` type names joined by commas, for messages.
pub fn names(types: &[GgmlType]) -> String {
    types
        .iter()
        .map(|t| t.name())
        .collect::<Vec<_>>()
        .join(", ")
}

/// Runs `f` on each (block of `n` values, block of `size` bytes) pair.
fn blocks(x: &[f32], out: &mut [u8], n: usize, size: usize, f: fn(&[f32], &mut [u8])) {
    for (v, b) in x.chunks_exact(n).zip(out.chunks_exact_mut(size)) {
        f(v, b);
    }
}

/// `x` rounded to f16, and its bits.
fn to_f16(x: f32) -> (f32, [u8; 2]) {
    let h = f16::from_f32(x);
    (h.to_f32(), h.to_le_bytes())
}

/// The value of largest magnitude (the first one on ties), with its sign.
fn signed_absmax(x: &[f32]) -> f32 {
    x.iter()
        .copied()
        .fold(0f32, |m, v| if v.abs() > m.abs() { v } else { m })
}

/// `round(x / d)` clamped to `lo..=hi`; 0 (clamped) where the scale is 0.
fn round_div(x: f32, d: f32, lo: i32, hi: i32) -> i32 {
    let q = if d == 0.0 { 0.0 } else { (x / d).round() };
    (q as i32).clamp(lo, hi)
}

/// Packs 32 five-bit values as Q5_0 / Q5_1 store them: element j's low nibble in `qs[j]` (low
/// half) or `qs[j - 16]` (high half), its fifth bit in bit j of the little-endian `qh` word.
fn pack_q5(q: &[u8; QK], qh: &mut [u8], qs: &mut [u8]) {
    let mut h = 0u32;
    for j in 0..QK / 2 {
        qs[j] = (q[j] & 0x0F) | ((q[j + QK / 2] & 0x0F) << 4);
        h |= u32::from(q[j] >> 4) << j;
        h |= u32::from(q[j + QK / 2] >> 4) << (j + QK / 2);
    }
    qh.copy_from_slice(&h.to_le_bytes());
}

/// Q5_0: `d` (f16), `qh` (u32), `qs` (16 bytes); value `(q - 16) * d`. The value of largest
/// magnitude maps to -16, the end with the larger range (as ggml does).
fn q5_0(x: &[f32], b: &mut [u8]) {
    let (d, bits) = to_f16(signed_absmax(x) / -16.0);
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (round_div(v, d, -16, 15) + 16) as u8;
    }
    b[..2].copy_from_slice(&bits);
    let (qh, qs) = b[2..].split_at_mut(4);
    pack_q5(&q, qh, qs);
}

/// Q5_1: `d`, `m` (f16), `qh`, `qs`; value `q * d + m`, spanning the block's min to max.
fn q5_1(x: &[f32], b: &mut [u8]) {
    let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let (m, m_bits) = to_f16(lo);
    let (d, d_bits) = to_f16((hi - m) / 31.0);
    let mut q = [0u8; QK];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = round_div(v - m, d, 0, 31) as u8;
    }
    b[..2].copy_from_slice(&d_bits);
    b[2..4].copy_from_slice(&m_bits);
    let (qh, qs) = b[4..].split_at_mut(4);
    pack_q5(&q, qh, qs);
}

/// Candidate stretches of a K-quant sub-block's range tried by [`fit_sub_block`] on each side
/// of the plain fit, [`SEARCH_DELTA`] quant steps apart: llama.cpp's `make_qkx2_quants` tries
/// the same 21 (nstep 20, rdelta 0.1), which is where its search stops paying off.
const SEARCH_STEPS: i32 = 10;
/// Step of that search, in quant levels.
const SEARCH_DELTA: f32 = 0.1;

/// One K-quant sub-block's scale and min, `x ~ scale * q - min` with `q` in `0..=nmax` and
/// `min >= 0` (the formats store the min as a non-negative offset below zero). Starts from
/// the range of the values (and zero), then tries ranges stretched by up to one quant step each
/// way, refitting scale and min to each one's quants by least squares, and keeps the pair with
/// the smallest squared error: `make_qkx2_quants` without its weights.
fn fit_sub_block(x: &[f32], nmax: u8) -> (f32, f32) {
    let lo = x.iter().copied().fold(0f32, f32::min);
    let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if hi <= lo {
        return (0.0, -lo);
    }
    let top = f32::from(nmax);
    let mut best = ((hi - lo) / top, -lo);
    let mut best_err = sub_block_error(x, best, nmax);
    let n = x.len() as f32;
    for step in -SEARCH_STEPS..=SEARCH_STEPS {
        let inverse = (top + SEARCH_DELTA * step as f32) / (hi - lo);
        let (mut sl, mut sl2, mut sx, mut sxl) = (0f32, 0f32, 0f32, 0f32);
        for &v in x {
            let l = ((v - lo) * inverse).round().clamp(0.0, top);
            sl += l;
            sl2 += l * l;
            sx += v;
            sxl += v * l;
        }
        let det = n * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        // Least squares x ~ scale * l + offset; a positive offset is not storable, so it is
        // pinned to 0 and the scale refitted alone.
        let mut scale = (n * sxl - sl * sx) / det;
        let mut offset = (sl2 * sx - sl * sxl) / det;
        if offset > 0.0 {
            offset = 0.0;
            scale = sxl / sl2;
        }
        if scale <= 0.0 {
            continue;
        }
        let candidate = (scale, -offset);
        let err = sub_block_error(x, candidate, nmax);
        if err < best_err {
            (best, best_err) = (candidate, err);
        }
    }
    best
}

/// The quant of `v` under `scale` and `min` (see [`fit_sub_block`]).
fn k_quant(v: f32, scale: f32, min: f32, nmax: u8) -> u8 {
    round_div(v + min, scale, 0, i32::from(nmax)) as u8
}

/// Squared error of a sub-block quantised with `(scale, min)`.
fn sub_block_error(x: &[f32], (scale, min): (f32, f32), nmax: u8) -> f32 {
    x.iter()
        .map(|&v| {
            let e = scale * f32::from(k_quant(v, scale, min, nmax)) - min - v;
            e * e
        })
        .sum()
}

/// A Q4_K / Q5_K super-block: eight sub-blocks of 32 with 6-bit scales and mins under the f16
/// `d` and `dmin`. Writes `d`, `dmin` and the scales field (bytes 0..16) and returns the quants,
/// each rounded against its sub-block's scale and min as stored.
fn k_super_block(x: &[f32], nmax: u8, b: &mut [u8]) -> [u8; QK_K] {
    let mut fits = [(0f32, 0f32); 8];
    for (fit, sub) in fits.iter_mut().zip(x.chunks_exact(32)) {
        *fit = fit_sub_block(sub, nmax);
    }
    let max_scale = fits.iter().fold(0f32, |m, f| m.max(f.0));
    let max_min = fits.iter().fold(0f32, |m, f| m.max(f.1));
    let (d, d_bits) = to_f16(max_scale / 63.0);
    let (dmin, dmin_bits) = to_f16(max_min / 63.0);
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for (j, &(scale, min)) in fits.iter().enumerate() {
        sc[j] = round_div(scale, d, 0, 63) as u8;
        mn[j] = round_div(min, dmin, 0, 63) as u8;
    }
    b[..2].copy_from_slice(&d_bits);
    b[2..4].copy_from_slice(&dmin_bits);
    b[4..16].copy_from_slice(&pack_k4_scales(&sc, &mn));
    let mut q = [0u8; QK_K];
    for (i, (q, &v)) in q.iter_mut().zip(x).enumerate() {
        let j = i / 32;
        *q = k_quant(v, d * f32::from(sc[j]), dmin * f32::from(mn[j]), nmax);
    }
    q
}

/// Q4_K: `d`, `dmin`, scales (12 bytes), `qs` (128): sub-block pair (2k, 2k+1) shares
/// `qs[32k..32k + 32]`, the first in the low nibbles.
fn q4_k(x: &[f32], b: &mut [u8]) {
    let q = k_super_block(x, 15, b);
    let qs = &mut b[16..];
    for k in 0..QK_K / 64 {
        for l in 0..32 {
            qs[32 * k + l] = q[64 * k + l] | (q[64 * k + 32 + l] << 4);
        }
    }
}

/// Q5_K: as Q4_K with `qh` (32 bytes) before `qs`: bit `2k` of `qh[l]` is the fifth bit of
/// sub-block 2k's element l, bit `2k + 1` that of sub-block 2k + 1's.
fn q5_k(x: &[f32], b: &mut [u8]) {
    let q = k_super_block(x, 31, b);
    let (qh, qs) = b[16..].split_at_mut(32);
    qh.fill(0);
    for k in 0..QK_K / 64 {
        for l in 0..32 {
            let (lo, hi) = (q[64 * k + l], q[64 * k + 32 + l]);
            qs[32 * k + l] = (lo & 0x0F) | ((hi & 0x0F) << 4);
            qh[l] |= ((lo >> 4) << (2 * k)) | ((hi >> 4) << (2 * k + 1));
        }
    }
}

/// Q6_K: `ql` (128 bytes), `qh` (64), sixteen signed 8-bit scales (one per 16 values), `d`
/// (f16, last); value `d * scale * (q - 32)`. Each sub-block's value of largest magnitude maps
/// to -32, and the sub-block scale of largest magnitude to -128 (as ggml does). In each half of
/// 128, value `32i + l` keeps its low 4 bits in `ql[l]` (i = 0, 2: low and high nibble) or
/// `ql[l + 32]` (i = 1, 3) and its top 2 bits in bits `2i..2i + 2` of `qh[l]`.
fn q6_k(x: &[f32], b: &mut [u8]) {
    let mut scales = [0f32; QK_K / 16];
    for (s, sub) in scales.iter_mut().zip(x.chunks_exact(16)) {
        *s = signed_absmax(sub) / -32.0;
    }
    let (d, d_bits) = to_f16(signed_absmax(&scales) / -128.0);
    let mut sc = [0i8; QK_K / 16];
    for (sc, &s) in sc.iter_mut().zip(&scales) {
        *sc = round_div(s, d, -128, 127) as i8;
    }
    let mut q = [0u8; QK_K];
    for (i, (q, &v)) in q.iter_mut().zip(x).enumerate() {
        *q = (round_div(v, d * f32::from(sc[i / 16]), -32, 31) + 32) as u8;
    }
    for half in 0..2 {
        let q = &q[128 * half..128 * half + 128];
        for l in 0..32 {
            let (q1, q2, q3, q4) = (q[l], q[l + 32], q[l + 64], q[l + 96]);
            b[64 * half + l] = (q1 & 0x0F) | ((q3 & 0x0F) << 4);
            b[64 * half + l + 32] = (q2 & 0x0F) | ((q4 & 0x0F) << 4);
            b[128 + 32 * half + l] =
                (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
    for (o, s) in b[192..208].iter_mut().zip(sc) {
        *o = s as u8;
    }
    b[208..210].copy_from_slice(&d_bits);
}

/// The 12-byte `scales` field of a Q4_K / Q5_K block from eight 6-bit scales and mins (the
/// inverse of the kernels' `k4_scales_mins`): scales and mins 0..4 in the low 6 bits of bytes
/// 0..4 and 4..8, those of 4..8 split into low nibbles (bytes 8..12) and top 2 bits (the top
/// bits of bytes 0..8).
pub fn pack_k4_scales(sc: &[u8; 8], mn: &[u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        s[j + 4] = (mn[j] & 63) | ((mn[j + 4] >> 4) << 6);
        s[j + 8] = (sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_kernels::dequantize_row;

    /// Deterministic weight-like values: a sum of four uniforms (near normal), standard
    /// deviation about `std`, with an occasional outlier of 6 std as real weight rows have.
    fn weights(n: usize, seed: u64, std: f32) -> Vec<f32> {
        let mut s = seed;
        let mut next = move || {
            s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        (0..n)
            .map(|i| {
                let bits = next();
                let sum: u64 = (0..4).map(|k| (bits >> (16 * k)) & 0xFFFF).sum();
                let v = (sum as f32 / 65536.0 - 2.0) * 3f32.sqrt() * std;
                if i % 97 == 5 {
                    6.0 * std * v.signum()
                } else {
                    v
                }
            })
            .collect()
    }

    fn round_trip(ty: GgmlType, x: &[f32]) -> Vec<f32> {
        let mut bytes = vec![0u8; ty.row_bytes(x.len()).unwrap()];
        quantize_row(ty, x, &mut bytes).unwrap();
        let mut y = vec![0f32; x.len()];
        dequantize_row(ty, &bytes, &mut y).unwrap();
        y
    }

    fn rms(a: &[f32]) -> f32 {
        (a.iter().map(|v| v * v).sum::<f32>() / a.len() as f32).sqrt()
    }

    /// dequantize(quantize(x)) is close to x: the RMS error, relative to the values' RMS, is
    /// what round to nearest gives at each width (uniform steps over about 8 std, step / sqrt 12:
    /// 4 bits ~0.13, 5 bits ~0.065, 6 bits ~0.035, 8 bits ~0.008), and no value is further than
    /// its block's range over the number of steps. A wrong layout puts values in the wrong place
    /// and fails by far.
    #[test]
    fn round_trip_error_is_that_of_the_width() {
        let n = QK_K * 16;
        for (ty, bound, steps) in [
            (GgmlType::Q5_0, 0.09, 31.0),
            (GgmlType::Q5_1, 0.08, 31.0),
            (GgmlType::Q8_0, 0.012, 254.0),
            (GgmlType::Q4K, 0.15, 15.0),
            (GgmlType::Q5K, 0.075, 31.0),
            (GgmlType::Q6K, 0.045, 63.0),
            (GgmlType::F16, 1e-3, 2048.0),
        ] {
            for (seed, std) in [(1, 0.02), (2, 1.0), (3, 1e-3)] {
                let x = weights(n, seed, std);
                let y = round_trip(ty, &x);
                let err: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a - b).collect();
                let rel = rms(&err) / rms(&x);
                assert!(rel < bound, "{ty} std {std}: relative RMS error {rel}");
                for (i, (xb, eb)) in x
                    .chunks(ty.block_size())
                    .zip(err.chunks(ty.block_size()))
                    .enumerate()
                {
                    let lo = xb.iter().copied().fold(0f32, f32::min);
                    let hi = xb.iter().copied().fold(0f32, f32::max);
                    let worst = eb.iter().fold(0f32, |m, e| m.max(e.abs()));
                    assert!(
                        worst <= (hi - lo) / steps * 1.01 + 1e-7,
                        "{ty} std {std} block {i}: error {worst} over range {}",
                        hi - lo
                    );
                }
            }
        }
        let x = weights(64, 4, 1.0);
        assert_eq!(round_trip(GgmlType::F32, &x), x);
    }

    /// Values exactly on a block's grid come back exactly, so every bit sits where the kernels'
    /// dequantisation reads it.
    #[test]
    fn values_on_the_grid_come_back_exactly() {
        // Q5_0: d = 0.25, every quant -16..15 once, so the extreme -16 is present.
        let x: Vec<f32> = (0..QK).map(|i| ((i % 32) as f32 - 16.0) * 0.25).collect();
        assert_eq!(round_trip(GgmlType::Q5_0, &x), x);
        // Q5_1: m = -1, d = 0.5, quants 0..31 in a scrambled order.
        let x: Vec<f32> = (0..QK).map(|i| ((i * 7) % 32) as f32 * 0.5 - 1.0).collect();
        assert_eq!(round_trip(GgmlType::Q5_1, &x), x);
        // Q6_K: integers -31..=32 with 32 first in every sub-block, so each sub-block scale is
        // -1 (32 maps to quant -32), d = -1 / -128 and every sub-block scale -128, exactly.
        let x: Vec<f32> = (0..QK_K)
            .map(|i| {
                let q = if i % 16 == 0 { 0 } else { (i * 5 % 64) as i32 };
                (32 - q) as f32
            })
            .collect();
        assert_eq!(round_trip(GgmlType::Q6K, &x), x);
        // Q4_K / Q5_K: sub-block j has scale (63 - j) / 64 and min (63 - 2j) / 16, so that
        // d = 1/64 and dmin = 1/16 are exact, and every level 0..=nmax (scrambled), so the
        // range fit is exact and the search cannot beat it.
        for (ty, nmax) in [(GgmlType::Q4K, 15usize), (GgmlType::Q5K, 31)] {
            let x: Vec<f32> = (0..QK_K)
                .map(|i| {
                    let j = (i / 32) as f32;
                    let level = (i * 13) % 32 % (nmax + 1);
                    level as f32 * (63.0 - j) / 64.0 - (63.0 - 2.0 * j) / 16.0
                })
                .collect();
            assert_eq!(round_trip(ty, &x), x, "{ty}");
        }
    }

    #[test]
    fn constant_and_zero_blocks_stay_finite() {
        for ty in WRITES {
            for x in [vec![0f32; QK_K], vec![0.5f32; QK_K], vec![-3f32; QK_K]] {
                let y = round_trip(ty, &x);
                let err = x
                    .iter()
                    .zip(&y)
                    .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                assert!(err <= 0.01 * x[0].abs(), "{ty} {}: error {err}", x[0]);
            }
        }
    }

    #[test]
    fn rejects_bad_rows() {
        let x = [0f32; 64];
        assert!(quantize_row(GgmlType::Q4K, &x, &mut [0; 144]).is_err());
        assert!(quantize_row(GgmlType::Q5_0, &x, &mut [0; 43]).is_err());
        assert!(quantize_row(GgmlType::Q4_0, &x, &mut [0; 36]).is_err());
    }

    #[test]
    fn k4_scales_pack_as_the_kernels_read_them() {
        // Every 6-bit scale and min in some sub-block: a Q4_K block of all-15 quants then reads
        // d * sc - dmin * mn per sub-block.
        for base in (0..64u8).step_by(8) {
            let sc: [u8; 8] = std::array::from_fn(|j| base + j as u8);
            let mn: [u8; 8] = std::array::from_fn(|j| 63 - base - j as u8);
            let mut b = vec![0u8; 144];
            b[..2].copy_from_slice(&f16::from_f32(1.0).to_le_bytes());
            b[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
            b[4..16].copy_from_slice(&pack_k4_scales(&sc, &mn));
            b[16..].fill(0xFF);
            let mut y = [0f32; QK_K];
            dequantize_row(GgmlType::Q4K, &b, &mut y).unwrap();
            for j in 0..8 {
                let want = 15.0 * f32::from(sc[j]) - 0.5 * f32::from(mn[j]);
                assert_eq!(y[32 * j], want, "sub-block {j}");
            }
        }
    }
}
