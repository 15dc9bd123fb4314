//! Byte layouts of the GGML blocks (little-endian, as in ggml-common.h) and small field readers.
//!
//! Blocks are handled as `&[u8; SIZE]` so every field offset below is checked at compile time
//! and the kernels' inner loops index fixed-size arrays (no bounds checks, easy to vectorise).

use half::bf16;

/// `block_q4_0`: `d: f16`, `qs: [u8; 16]` (element j in the low nibble of qs[j], j+16 in the high).
pub(crate) const Q4_0_BYTES: usize = 18;
/// `block_q4_1`: `d: f16`, `m: f16`, `qs: [u8; 16]`; value = d * q + m.
pub(crate) const Q4_1_BYTES: usize = 20;
/// `block_q5_0`: `d: f16`, `qh: [u8; 4]` (bit j: the fifth bit of element j), `qs: [u8; 16]` (as
/// Q4_0); value = d * (q - 16). Where a K-quant does not fit (rows not a multiple of 256, as in
/// SmolLM2's 576), llama-quantize writes these.
pub(crate) const Q5_0_BYTES: usize = 22;
/// `block_q5_1`: `d: f16`, `m: f16`, `qh: [u8; 4]`, `qs: [u8; 16]`; value = d * q + m.
pub(crate) const Q5_1_BYTES: usize = 24;
/// `block_q8_0`: `d: f16`, `qs: [i8; 32]`.
pub(crate) const Q8_0_BYTES: usize = 34;
/// `block_q8_1`: `d: f16`, `s: f16` (= d * sum(qs)), `qs: [i8; 32]`.
pub(crate) const Q8_1_BYTES: usize = 36;
/// `block_q4_K`: `d: f16`, `dmin: f16`, `scales: [u8; 12]` (8 six-bit scales and mins),
/// `qs: [u8; 128]`.
pub(crate) const Q4K_BYTES: usize = 144;
/// `block_q5_K`: `d: f16`, `dmin: f16`, `scales: [u8; 12]`, `qh: [u8; 32]`, `qs: [u8; 128]`.
pub(crate) const Q5K_BYTES: usize = 176;
/// `block_q6_K`: `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d: f16`.
pub(crate) const Q6K_BYTES: usize = 210;
/// `block_q8_K`: `d: f32`, `qs: [i8; 256]`, `bsums: [i16; 16]` (sums of qs in groups of 16).
pub(crate) const Q8K_BYTES: usize = 292;

/// Elements per block of the 32-element formats.
pub(crate) const QK: usize = 32;

/// Reads the little-endian f16 at `off` as f32.
#[inline(always)]
pub(crate) fn f16_at(b: &[u8], off: usize) -> f32 {
    f16_bits_to_f32(u16::from_le_bytes([b[off], b[off + 1]]))
}

/// Exact f16 -> f32 without branches, so loops over it auto-vectorise (`half`'s portable
/// conversion branches per value). Shifting the f16 exponent and mantissa into an f32 gives the
/// value times 2^-112 (denormals included); multiplying by 2^112 is exact. Inf and NaN (f16
/// exponent 31) come out at or above 2^16 and get the f32 all-ones exponent, payload kept.
#[inline(always)]
pub(crate) fn f16_bits_to_f32(h: u16) -> f32 {
    const SCALE: f32 = f32::from_bits((127 + 112) << 23); // 2^112
    const INF_NAN_FLOOR: f32 = 65536.0; // smallest f16-exponent-31 value after scaling
    let h = h as u32;
    let v = f32::from_bits((h & 0x7FFF) << 13) * SCALE;
    let exp_fix = if v >= INF_NAN_FLOOR { 0xFF << 23 } else { 0 };
    f32::from_bits(v.to_bits() | exp_fix | ((h & 0x8000) << 16))
}

/// Reads the little-endian bf16 at `off` as f32.
#[inline(always)]
pub(crate) fn bf16_at(b: &[u8], off: usize) -> f32 {
    bf16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// Reads the little-endian f32 at `off`.
#[inline(always)]
pub(crate) fn f32_at(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Reads the little-endian i16 at `off`.
#[inline(always)]
pub(crate) fn i16_at(b: &[u8], off: usize) -> i16 {
    i16::from_le_bytes([b[off], b[off + 1]])
}

/// Unpacks the 12-byte `scales` field of Q4_K / Q5_K into 8 six-bit scales and 8 six-bit mins
/// (ggml's `get_scale_min_k4`). Bytes 0..4 hold scales 0..4 in their low 6 bits, bytes 4..8 the
/// mins 0..4; scales and mins 4..8 take their low 4 bits from bytes 8..12 (low / high nibble)
/// and their top 2 bits from the top 2 bits of bytes 0..4 (scales) and 4..8 (mins).
#[inline(always)]
pub(crate) fn k4_scales_mins(s: &[u8; 12]) -> ([u8; 8], [u8; 8]) {
    let mut sc = [0u8; 8];
    let mut mn = [0u8; 8];
    for j in 0..4 {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
    (sc, mn)
}

/// Scale and min `j` (0..8) of a Q4_K / Q5_K `scales` field: one entry of [`k4_scales_mins`].
#[inline(always)]
pub(crate) fn k4_scale_min(s: &[u8; 12], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    }
}

/// The `scales` field of a Q4_K / Q5_K block (bytes 4..16).
#[inline(always)]
pub(crate) fn k4_scales_field(b: &[u8]) -> &[u8; 12] {
    // A fixed 12-byte window at a fixed offset; callers pass whole blocks (>= 16 bytes).
    b[4..16].try_into().expect("12-byte window")
}

/// The 32 five-bit values of a Q5_0 / Q5_1 block: `qs` (16 bytes, element j in the low nibble of
/// qs[j], j + 16 in the high) and the little-endian `qh` word (bit j: element j's fifth bit).
#[inline(always)]
pub(crate) fn q5_values(qh: &[u8], qs: &[u8]) -> [u8; QK] {
    let qh = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]);
    let mut q = [0u8; QK];
    for j in 0..QK / 2 {
        q[j] = (qs[j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
        q[j + QK / 2] = (qs[j] >> 4) | ((((qh >> (j + QK / 2)) & 1) as u8) << 4);
    }
    q
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_conversion_exact_for_all_bit_patterns() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_bits_to_f32(h);
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn k4_scales_unpack_known_bits() {
        // scale 5 = 0b10_1101: low nibble 0b1101 in byte 9's low half, top bits 0b10 in byte 1.
        let mut s = [0u8; 12];
        s[9] = 0b1101;
        s[1] = 0b10 << 6 | 7; // also scale 1 = 7
        s[5] = 0b01 << 6 | 9; // min 1 = 9, min 5 gets top bits 0b01
        s[9] |= 0b0011 << 4; // min 5 low nibble
        let (sc, mn) = k4_scales_mins(&s);
        assert_eq!(sc[1], 7);
        assert_eq!(sc[5], 0b10_1101);
        assert_eq!(mn[1], 9);
        assert_eq!(mn[5], 0b01_0011);
        for j in 0..8 {
            assert_eq!(k4_scale_min(&s, j), (sc[j], mn[j]), "entry {j}");
        }
    }

    #[test]
    fn k4_scale_min_matches_the_whole_unpack() {
        for seed in 0u32..64 {
            let s: [u8; 12] = std::array::from_fn(|i| {
                (seed.wrapping_mul(2_654_435_761) >> (i % 24)) as u8 ^ (i as u8).wrapping_mul(37)
            });
            let (sc, mn) = k4_scales_mins(&s);
            for j in 0..8 {
                assert_eq!(k4_scale_min(&s, j), (sc[j], mn[j]), "seed {seed} entry {j}");
            }
        }
    }
}
