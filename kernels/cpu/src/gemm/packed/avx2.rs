//! AVX2 + FMA micro-kernel of the packed f32 matmul: 16 panel rows (two ymm, half a panel) x up
//! to 6 tokens, run on each half of a 32-row panel.

use std::arch::x86_64::*;

use super::{Tile, PANEL};

/// Tokens per call. AVX2 has 16 ymm registers and its FMAs cannot broadcast from memory: 6
/// tokens x 2 accumulators + 2 weight vectors + 1 broadcast = 15 (BLIS's Haswell sgemm kernel
/// is the same 16 x 6): 12 FMAs per 8 loads, 12 accumulators to hide the FMA latency. A whole
/// 32-row panel (4 weight vectors) would leave room for 2 tokens: 8 FMAs per 6 loads and only
/// the 8 accumulators the latency needs. Measured at 85-90 % of the AVX2 FMA peak on one core.
pub(super) const TOKENS: usize = 6;

/// Columns per iteration of the kernel's loop (the `column!` calls must match); see the
/// AVX-512 kernel's `UNROLL`. Here it took 384 x 384 x 4096 from 87 to 115 GFLOP/s on one core.
const UNROLL: usize = 4;

/// Computes `tile` for `nt` tokens (1..=[`TOKENS`]), one 16-row half of the panel at a time.
///
/// # Safety
///
/// AVX2 and FMA must be available; the tile's pointers must be valid for `kc` panel columns
/// (32-byte aligned, as [`super::PackedF32`] stores them), `nt` tokens of `kc` columns and `nt`
/// output runs of `valid` rows; no other thread may access those output cells.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile(t: &Tile, nt: usize) {
    for half in [0, 16] {
        if half >= t.valid {
            break;
        }
        let valid = (t.valid - half).min(16);
        // SAFETY (every arm): the caller's promise, for `nt` tokens and rows
        // `half .. half + valid` of the tile's.
        unsafe {
            match nt {
                6 => kernel::<6>(t, half, valid),
                5 => kernel::<5>(t, half, valid),
                4 => kernel::<4>(t, half, valid),
                3 => kernel::<3>(t, half, valid),
                2 => kernel::<2>(t, half, valid),
                1 => kernel::<1>(t, half, valid),
                _ => unreachable!("{nt} tokens in an AVX2 tile"),
            }
        }
    }
}

/// The `16 x T` register block of panel rows `half .. half + 16` (of which `valid` exist).
///
/// # Safety
///
/// As [`tile`], with `nt = T`, `half` 0 or 16 and `half + valid <= t.valid`.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn kernel<const T: usize>(t: &Tile, half: usize, valid: usize) {
    let lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let lo = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32), lanes);
    let hi = _mm256_cmpgt_epi32(_mm256_set1_epi32(valid as i32 - 8), lanes);
    // `wrapping_add`: the second vector of a short half may lie past the end of `out`; its
    // mask is 0, so it is never accessed.
    let out: [*mut f32; T] = std::array::from_fn(|j| t.out.wrapping_add(j * t.ldo + half));
    let mut acc = [[_mm256_setzero_ps(); 2]; T];
    if t.resume {
        for j in 0..T {
            // SAFETY: the masks select the token's `valid` output cells of this half, which the
            // caller vouches for; masked-off lanes are not accessed.
            unsafe {
                acc[j][0] = _mm256_maskload_ps(out[j], lo);
                acc[j][1] = _mm256_maskload_ps(out[j].wrapping_add(8), hi);
            }
        }
    }
    let (mut w, mut x) = (t.w.wrapping_add(half), t.x);
    // One column `$u` past `w` and `x`: two aligned weight loads, then one broadcast and two
    // FMAs per token.
    macro_rules! column {
        ($u:expr) => {
            // SAFETY: column `$u` from `w` and `x` is one of the tile's `kc` columns (in bounds
            // by the caller's promise); `w` stays 32-byte aligned (a column is 128 bytes from a
            // 64-byte aligned start, the half 64 bytes in).
            unsafe {
                let w0 = _mm256_load_ps(w.add($u * PANEL));
                let w1 = _mm256_load_ps(w.add($u * PANEL + 8));
                for (j, a) in acc.iter_mut().enumerate() {
                    let b = _mm256_set1_ps(x.add(j * t.ldx + $u).read());
                    a[0] = _mm256_fmadd_ps(w0, b, a[0]);
                    a[1] = _mm256_fmadd_ps(w1, b, a[1]);
                }
            }
        };
    }
    // `UNROLL` columns per iteration, then the remainder one by one. The pointers advance with
    // `wrapping_add`: after the last column they may point past the data.
    let groups = t.kc / UNROLL;
    for _ in 0..groups {
        column!(0);
        column!(1);
        column!(2);
        column!(3);
        w = w.wrapping_add(UNROLL * PANEL);
        x = x.wrapping_add(UNROLL);
    }
    for _ in groups * UNROLL..t.kc {
        column!(0);
        w = w.wrapping_add(PANEL);
        x = x.wrapping_add(1);
    }
    for j in 0..T {
        // SAFETY: as for the loads.
        unsafe {
            _mm256_maskstore_ps(out[j], lo, acc[j][0]);
            _mm256_maskstore_ps(out[j].wrapping_add(8), hi, acc[j][1]);
        }
    }
}
