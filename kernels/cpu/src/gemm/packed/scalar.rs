//! The reference micro-kernel of the packed f32 matmul, always compiled: plain loops of
//! `f32::mul_add` in column order, the rounding sequence every SIMD kernel reproduces.
//!
//! `mul_add` is one correctly rounded fused multiply-add, an instruction on CPUs with FMA and a
//! (slow) libm routine on x86_64 CPUs without it, which have no AVX2 either. This kernel is
//! the fallback for those and the yardstick of the tests, not a fast path.

use super::{Tile, PANEL};

/// Tokens per call. Any value gives the same bits; 4 keeps the loops short.
pub(super) const TOKENS: usize = 4;

/// Computes `tile` for `nt` tokens: output (row `i`, token `j`) continues (or starts from
/// `+0.0`) the chain `acc = mul_add(W[i][k], x[j][k], acc)` over the tile's columns.
///
/// # Safety
///
/// The tile's pointers must be valid for `kc` panel columns, `nt` tokens of `kc` columns and
/// `nt` output runs of `valid` rows, and no other thread may access those output cells.
pub(super) unsafe fn tile(t: &Tile, nt: usize) {
    for j in 0..nt {
        for i in 0..t.valid {
            // SAFETY: (row i, token j) is inside the tile's output (the caller's promise).
            let o = unsafe { t.out.add(j * t.ldo + i) };
            // SAFETY: as above; `resume` says the cell holds a partial sum.
            let mut acc = if t.resume { unsafe { o.read() } } else { 0.0 };
            for k in 0..t.kc {
                // SAFETY: column k < kc of the panel and of token j are in range.
                let (w, x) =
                    unsafe { (t.w.add(k * PANEL + i).read(), t.x.add(j * t.ldx + k).read()) };
                acc = w.mul_add(x, acc);
            }
            // SAFETY: as for the read.
            unsafe { o.write(acc) };
        }
    }
}
