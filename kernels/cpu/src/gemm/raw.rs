//! Weight rows in ggml layout as the direct (decode) paths of the x86 kernels read them: the
//! row-length check their unchecked loads rely on, block access and the loads of a possibly
//! missing last block, and the prefetch ahead of them. Shared by `avx2` and `avx512`; the register
//! unpacking (`WSrc`) is per ISA.

use std::arch::x86_64::*;

use super::{is_k, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K};
use crate::blocks::{f16_at, k4_scale_min, Q4K_BYTES, Q5K_BYTES, Q6K_BYTES};

/// Rows in ggml layout (`rows[r]`, `nb` blocks of `BS` bytes, quants at `QO`), unpacked in
/// registers on the fly. Built only by [`Raw::new`], which checks that every row holds `nb`
/// blocks, so the hot path reads whole block pairs through raw pointers without per-load
/// bounds checks; only the missing half of an odd last pair takes the checked path.
pub(super) struct Raw<'a, const F: u8, const R: usize> {
    pub(super) rows: [&'a [u8]; R],
    pub(super) nb: usize,
}

impl<'a, const F: u8, const R: usize> Raw<'a, F, R> {
    pub(super) const BS: usize = match F {
        Q4_0 => 18,
        Q4_1 => 20,
        Q5_0 => 22,
        Q5_1 => 24,
        _ => 34,
    };
    /// Offset of the quants (Q5: the 4 bytes of fifth bits come just before).
    pub(super) const QO: usize = match F {
        Q4_1 => 4,
        Q5_0 => 6,
        Q5_1 => 8,
        _ => 2,
    };
    /// Whether the format has a fifth bit per element (`qh`).
    pub(super) const Q5: bool = matches!(F, Q5_0 | Q5_1);

    /// # Panics
    ///
    /// If a row is shorter than `nb` blocks (the invariant the unchecked loads rely on), or for
    /// a K-quant (the direct paths do not read them; they are always unpacked).
    #[inline(always)]
    pub(super) fn new(rows: [&'a [u8]; R], nb: usize) -> Self {
        assert!(!is_k(F), "no direct path for the K-quants");
        assert!(
            rows.iter().all(|r| r.len() >= nb * Self::BS),
            "weight row shorter than {nb} blocks"
        );
        Raw { rows, nb }
    }

    /// Block `b` of row `r`, or `None` past the end (the missing half of a last pair).
    #[inline(always)]
    pub(super) fn block(&self, r: usize, b: usize) -> Option<&[u8]> {
        (b < self.nb).then(|| &self.rows[r][b * Self::BS..(b + 1) * Self::BS])
    }

    /// Pointer to block `b` of row `r`: `BS` readable bytes when `b < nb` (see `new`).
    #[inline(always)]
    pub(super) fn ptr(&self, r: usize, b: usize) -> *const u8 {
        self.rows[r].as_ptr().wrapping_add(b * Self::BS)
    }

    /// The fifth bits (`qh`, little-endian) of block `b` of row `r` (0 past the end).
    #[inline(always)]
    pub(super) fn qh(&self, r: usize, b: usize) -> u32 {
        self.block(r, b).map_or(0, |blk| {
            u32::from_le_bytes([
                blk[Self::QO - 4],
                blk[Self::QO - 3],
                blk[Self::QO - 2],
                blk[Self::QO - 1],
            ])
        })
    }

    /// Whether pair `k` has both blocks (every pair but the last of an odd block count).
    #[inline(always)]
    pub(super) fn full(&self, k: usize) -> bool {
        2 * k + 1 < self.nb
    }
}

/// K-quant rows in ggml layout (`rows[r]`, `nsb` super-blocks of `BS` bytes), for the direct
/// (decode) paths: the ISA files build the quants in registers; the scales and mins, a few per
/// pair, are decoded here, to exactly the values `unpack_row` stores (`d * scale` and
/// `-dmin * min`, exact products), so a tile's result does not depend on the source.
pub(super) struct RawK<'a, const F: u8, const R: usize> {
    pub(super) rows: [&'a [u8]; R],
    pub(super) nsb: usize,
}

impl<'a, const F: u8, const R: usize> RawK<'a, F, R> {
    pub(super) const BS: usize = match F {
        Q4_K => Q4K_BYTES,
        Q5_K => Q5K_BYTES,
        _ => Q6K_BYTES,
    };

    /// Rows of `nb` 32-element sub-blocks (a multiple of 8).
    ///
    /// # Panics
    ///
    /// If `F` is not a K-quant, `nb` not a whole number of super-blocks, or a row shorter than
    /// them (the invariant the unchecked loads rely on).
    #[inline(always)]
    pub(super) fn new(rows: [&'a [u8]; R], nb: usize) -> Self {
        assert!(
            is_k(F) && nb.is_multiple_of(8),
            "K-quant rows of whole super-blocks"
        );
        let nsb = nb / 8;
        assert!(
            rows.iter().all(|r| r.len() >= nsb * Self::BS),
            "weight row shorter than {nsb} super-blocks"
        );
        RawK { rows, nsb }
    }

    /// Super-block `sb` of row `r`.
    #[inline(always)]
    pub(super) fn sblock(&self, r: usize, sb: usize) -> &'a [u8] {
        &self.rows[r][sb * Self::BS..(sb + 1) * Self::BS]
    }

    /// Pointer to super-block `sb` of row `r`: `BS` readable bytes when `sb < nsb` (see `new`).
    #[inline(always)]
    pub(super) fn ptr(&self, r: usize, sb: usize) -> *const u8 {
        guard!(sb < self.nsb);
        self.rows[r].as_ptr().wrapping_add(sb * Self::BS)
    }

    /// `d * scale` of the four 16-element groups of pair `k` (sub-blocks `2k`, `2k + 1`) of
    /// row `r`.
    #[inline(always)]
    pub(super) fn scales(&self, r: usize, k: usize) -> [f32; 4] {
        let b = self.sblock(r, k / 4);
        let j = k % 4;
        if F == Q6_K {
            let d = f16_at(b, 208);
            return std::array::from_fn(|i| d * (b[192 + 4 * j + i] as i8) as f32);
        }
        let d = f16_at(b, 0);
        let s: &[u8; 12] = b[4..16].try_into().expect("12-byte window");
        let (s0, s1) = (k4_scale_min(s, 2 * j).0, k4_scale_min(s, 2 * j + 1).0);
        let (a, c) = (d * s0 as f32, d * s1 as f32);
        [a, a, c, c]
    }

    /// `-dmin * min` of sub-blocks `16 c .. 16 c + 16` of row `r` (0 past the row's end).
    #[inline(always)]
    pub(super) fn mins(&self, r: usize, c: usize) -> [f32; 16] {
        let mut m = [0f32; 16];
        for half in 0..2 {
            let sb = 2 * c + half;
            if sb < self.nsb {
                let b = self.sblock(r, sb);
                let dmin = f16_at(b, 2);
                let s: &[u8; 12] = b[4..16].try_into().expect("12-byte window");
                for j in 0..8 {
                    m[8 * half + j] = -(dmin * k4_scale_min(s, j).1 as f32);
                }
            }
        }
        m
    }
}

/// Prefetches `len` bytes of `w` from `start` (the part inside `w`; nothing past it) with
/// `HINT` (`_MM_HINT_T0`: into L1; `_MM_HINT_T1`: into L2): the direct paths' weight rows ahead.
#[inline(always)]
pub(super) fn prefetch<const HINT: i32>(w: &[u8], start: usize, len: usize) {
    let end = (start + len).min(w.len());
    let mut o = start;
    while o < end {
        // SAFETY: `o < w.len()`, so the pointer is inside `w`; a prefetch never faults and
        // reads nothing architecturally. SSE is baseline on x86_64.
        unsafe { _mm_prefetch::<HINT>(w.as_ptr().add(o).cast()) };
        o += 64;
    }
}

/// Loads 16 bytes (zeros for a missing block).
#[inline(always)]
pub(super) fn ld16(b: Option<&[u8]>, off: usize) -> __m128i {
    match b {
        Some(b) => {
            let v: &[u8; 16] = b[off..off + 16].try_into().expect("16 bytes in block");
            // SAFETY: 16 readable bytes; `loadu` has no alignment requirement; SSE2 is baseline.
            unsafe { _mm_loadu_si128(v.as_ptr().cast()) }
        }
        // SAFETY: SSE2 is baseline on x86_64.
        None => unsafe { _mm_setzero_si128() },
    }
}

/// The f16 bits at the start of `off` in block `b` (0 for a missing block).
#[inline(always)]
pub(super) fn h16(b: Option<&[u8]>, off: usize) -> u16 {
    b.map_or(0, |b| u16::from_le_bytes([b[off], b[off + 1]]))
}
