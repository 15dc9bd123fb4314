//! AVX-512 F micro-kernel of the packed f32 matmul: 32 panel rows (two zmm) x up to 12 tokens.

use std::arch::x86_64::*;

use super::{Tile, PANEL};

/// Tokens per call. The kernel keeps `2 x TOKENS` accumulators, the column's two weight
/// vectors and one broadcast in registers, 27 of the 32 zmm. Per column it issues 2 weight
/// loads, 12 broadcast loads (`vbroadcastss zmm, m32`, a pure load-port uop) and 24 FMAs, so
/// the two FMA ports stay the bottleneck, and 24 independent accumulators hide the FMA latency
/// (4 cycles x 2 ports = 8 needed). Each broadcast feeds two FMAs, so one broadcast load per
/// token beats folding it into both FMAs as an `m32{1to16}` operand (two loads); LLVM picks
/// this form from `_mm512_set1_ps` of a loaded value. BLIS's Skylake-X sgemm kernel has the
/// same 32 x 12 shape; 14 tokens (30 zmm) measured the same and leave a longer token tail.
pub(super) const TOKENS: usize = 12;

/// Columns per iteration of the kernel's loop (the `column!` calls must match). Unrolling lets
/// each token's address be computed once per iteration, the columns then use constant
/// displacements: about 14 integer uops per 96 FMAs instead of about 12 per 24, which had
/// taken issue slots from the FMA ports (165 -> 185 GFLOP/s on one Sapphire Rapids core at
/// 384 x 384 x 4096). Unrolling by 8 ran out of general-purpose registers and was slower.
const UNROLL: usize = 4;

/// Computes `tile` for `nt` tokens (1..=[`TOKENS`]).
///
/// # Safety
///
/// AVX-512 F must be available; the tile's pointers must be valid for `kc` panel columns
/// (64-byte aligned, as [`super::PackedF32`] stores them), `nt` tokens of `kc` columns and `nt`
/// output runs of `valid` rows; no other thread may access those output cells.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile(t: &Tile, nt: usize) {
    // SAFETY (every arm): the caller's promise, for `nt` tokens.
    unsafe {
        match nt {
            12 => kernel::<12>(t),
            11 => kernel::<11>(t),
            10 => kernel::<10>(t),
            9 => kernel::<9>(t),
            8 => kernel::<8>(t),
            7 => kernel::<7>(t),
            6 => kernel::<6>(t),
            5 => kernel::<5>(t),
            4 => kernel::<4>(t),
            3 => kernel::<3>(t),
            2 => kernel::<2>(t),
            1 => kernel::<1>(t),
            _ => unreachable!("{nt} tokens in an AVX-512 tile"),
        }
    }
}

/// The `PANEL x T` register block: per column, two aligned weight loads and, per token, one
/// broadcast of its value and two FMAs. Rows past `valid` are computed (their weights are
/// zero) but masked off on load and store.
///
/// # Safety
///
/// As [`tile`], with `nt = T`.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn kernel<const T: usize>(t: &Tile) {
    let v = t.valid;
    let lo: __mmask16 = if v >= 16 { 0xffff } else { (1 << v) - 1 };
    let hi: __mmask16 = if v >= 32 {
        0xffff
    } else if v > 16 {
        (1 << (v - 16)) - 1
    } else {
        0
    };
    // `wrapping_add`: the second half of a short last panel lies past the end of `out`; its
    // mask is 0, so it is never accessed.
    let out: [*mut f32; T] = std::array::from_fn(|j| t.out.wrapping_add(j * t.ldo));
    let mut acc = [[_mm512_setzero_ps(); 2]; T];
    if t.resume {
        for j in 0..T {
            // SAFETY: the masks select the token's `valid` output cells, which the caller
            // vouches for; masked-off lanes are not accessed.
            unsafe {
                acc[j][0] = _mm512_maskz_loadu_ps(lo, out[j]);
                acc[j][1] = _mm512_maskz_loadu_ps(hi, out[j].wrapping_add(16));
            }
        }
    }
    let (mut w, mut x) = (t.w, t.x);
    // One column `$u` past `w` and `x`: two aligned weight loads, then one broadcast and two
    // FMAs per token.
    macro_rules! column {
        ($u:expr) => {
            // SAFETY: column `$u` from `w` and `x` is one of the tile's `kc` columns (in bounds
            // by the caller's promise); `w` stays 64-byte aligned (a column is 128 bytes from
            // an aligned start).
            unsafe {
                let w0 = _mm512_load_ps(w.add($u * PANEL));
                let w1 = _mm512_load_ps(w.add($u * PANEL + 16));
                for (j, a) in acc.iter_mut().enumerate() {
                    let b = _mm512_set1_ps(x.add(j * t.ldx + $u).read());
                    a[0] = _mm512_fmadd_ps(w0, b, a[0]);
                    a[1] = _mm512_fmadd_ps(w1, b, a[1]);
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
            _mm512_mask_storeu_ps(out[j], lo, acc[j][0]);
            _mm512_mask_storeu_ps(out[j].wrapping_add(16), hi, acc[j][1]);
        }
    }
}
