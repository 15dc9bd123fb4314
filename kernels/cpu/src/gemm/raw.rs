//! Weight rows in ggml layout as the direct (decode) paths of the x86 kernels read them: the
//! row-length check their unchecked loads rely on, block access and the loads of a possibly
//! missing last block, and the prefetch ahead of them. Shared by `avx2` and `avx512`; the register
//! unpacking (`WSrc`) is per ISA.

use std::arch::x86_64::*;

use super::{Q4_0, Q4_1};

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
        _ => 34,
    };
    pub(super) const QO: usize = if F == Q4_1 { 4 } else { 2 };

    /// # Panics
    ///
    /// If a row is shorter than `nb` blocks (the invariant the unchecked loads rely on).
    #[inline(always)]
    pub(super) fn new(rows: [&'a [u8]; R], nb: usize) -> Self {
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

    /// Whether pair `k` has both blocks (every pair but the last of an odd block count).
    #[inline(always)]
    pub(super) fn full(&self, k: usize) -> bool {
        2 * k + 1 < self.nb
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
