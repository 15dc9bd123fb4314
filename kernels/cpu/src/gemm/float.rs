//! f32 x f32 matmul for float weights (the embedding model's dense layers): AVX-512 tiles of
//! 4 rows x 4 tokens, or AVX2 + FMA tiles of 2 rows x 4 tokens.
//!
//! Each (row, token) pair has its own f32 accumulator register (16 lanes on AVX-512, 8 on AVX2)
//! fed by one FMA per register width of columns, the lanes are summed in a fixed order and the
//! last columns that do not fill a register are added one by one.
//! The single dot product ([`dot_fn`]) is the 1 x 1 case of the same arithmetic, so a pair's
//! result is bit-identical whatever tile computed it. It differs from the scalar reference (f64
//! accumulation) only in float summation order.
//!
//! Weights and activations are little-endian f32 bytes (the activations' vec-dot type is f32,
//! a plain copy); the kernels read them unaligned.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::ops::Range;

use crate::dot::{DotFn, Isa};
use crate::error::Result;
use crate::pool::ThreadPool;

/// Rows per task: 64 rows of 384 f32 columns are 96 KiB of weights, reused for every token.
const ROWS_PER_TASK: usize = 64;

/// Tokens per task chunk: their activations (at most 1536 columns: 24 KiB each) stay in L2
/// while the task's rows stream past them.
const TOKENS_PER_CHUNK: usize = 32;

/// The f32 x f32 dot product for `isa`, if it has a SIMD one.
pub(crate) fn dot_fn(isa: Isa) -> Option<DotFn> {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bw => Some(dot_avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => Some(dot_avx2),
        _ => None,
    }
}

/// Whether `isa` has the tiled f32 kernel.
pub(crate) fn has_tiled(isa: Isa) -> bool {
    dot_fn(isa).is_some()
}

#[cfg(target_arch = "x86_64")]
fn dot_avx2(w: &[u8], x: &[u8]) -> f32 {
    let n = w.len().min(x.len()) / 4;
    let mut out = [0f32; 1];
    // SAFETY: `dot_fn` hands this out only for a SIMD ISA, which `Isa::detected` returns only
    // once AVX2 and FMA were detected; both slices hold `n` f32 values.
    unsafe { tile_avx2::<1, 1>(w.as_ptr(), 0, x.as_ptr(), 0, n, &mut out, 1) };
    out[0]
}

#[cfg(target_arch = "x86_64")]
fn dot_avx512(w: &[u8], x: &[u8]) -> f32 {
    let n = w.len().min(x.len()) / 4;
    let mut out = [0f32; 1];
    // SAFETY: `dot_fn` hands this out only for `Isa::Avx512` / `Avx512Bw`, which `Isa::detected`
    // returns only once AVX-512 F was detected; both slices hold `n` f32 values.
    unsafe { tile_avx512::<1, 1>(w.as_ptr(), 0, x.as_ptr(), 0, n, &mut out, 1) };
    out[0]
}

/// `out[t * rows + r] = w[r] . x[t]` for f32 rows of `cols` values, split over `pool` by row
/// blocks and token chunks. `w` holds little-endian f32 bytes.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    isa: Isa,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &ThreadPool,
) -> Result<()> {
    guard!(has_tiled(isa));
    guard_eq!(w.len(), rows * cols * 4);
    guard_eq!(x.len(), n_tokens * cols);
    guard_eq!(out.len(), rows * n_tokens);
    let row_tasks = rows.div_ceil(ROWS_PER_TASK);
    let tok_chunks = n_tokens.div_ceil(TOKENS_PER_CHUNK);
    let optr = super::OutPtr::new(out, rows);
    pool.run(row_tasks * tok_chunks, |task| {
        let (rt, tc) = (task % row_tasks, task / row_tasks);
        let (r0, t0) = (rt * ROWS_PER_TASK, tc * TOKENS_PER_CHUNK);
        let (r1, t1) = (
            (r0 + ROWS_PER_TASK).min(rows),
            (t0 + TOKENS_PER_CHUNK).min(n_tokens),
        );
        let (wp, xp) = (w.as_ptr(), x.as_ptr().cast());
        // SAFETY: the ISA's features were detected (`has_tiled`); the row and token ranges are
        // in bounds of `w` and `x`; tasks own disjoint (row, token) cells of `out`.
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bw => unsafe {
                block_avx512(wp, r0..r1, cols, xp, t0..t1, &optr)
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => unsafe { block_avx2(wp, r0..r1, cols, xp, t0..t1, &optr) },
            _ => unreachable!("no tiled f32 kernel for {isa:?}"),
        }
    });
    Ok(())
}

/// One task: rows `r0..r1` times tokens `t0..t1`, in 2 x 4 tiles and their ragged edges.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_avx2(
    w: *const u8,
    rows: Range<usize>,
    cols: usize,
    x: *const u8,
    toks: Range<usize>,
    out: &super::OutPtr,
) {
    let (r0, r1, t0, t1) = (rows.start, rows.end, toks.start, toks.end);
    let mut t = t0;
    while t < t1 {
        let nt = (t1 - t).min(4);
        let mut r = r0;
        while r < r1 {
            let nr = (r1 - r).min(2);
            let mut tile = [0f32; 8];
            // SAFETY (all arms): rows r..r+nr and tokens t..t+nt are in bounds.
            unsafe {
                match (nr, nt) {
                    (2, 4) => tile_avx2::<2, 4>(w, r, x, t, cols, &mut tile, 4),
                    (2, 3) => tile_avx2::<2, 3>(w, r, x, t, cols, &mut tile, 4),
                    (2, 2) => tile_avx2::<2, 2>(w, r, x, t, cols, &mut tile, 4),
                    (2, _) => tile_avx2::<2, 1>(w, r, x, t, cols, &mut tile, 4),
                    (_, 4) => tile_avx2::<1, 4>(w, r, x, t, cols, &mut tile, 4),
                    (_, 3) => tile_avx2::<1, 3>(w, r, x, t, cols, &mut tile, 4),
                    (_, 2) => tile_avx2::<1, 2>(w, r, x, t, cols, &mut tile, 4),
                    _ => tile_avx2::<1, 1>(w, r, x, t, cols, &mut tile, 4),
                }
            }
            for i in 0..nr {
                for j in 0..nt {
                    // SAFETY: the cell (r + i, t + j) belongs to this task only.
                    unsafe { out.write(r + i, t + j, tile[i * 4 + j]) };
                }
            }
            r += nr;
        }
        t += nt;
    }
}

/// `R x T` dot products of rows `r..r+R` of `w` with tokens `t..t+T` of `x` (f32 rows of `n`
/// values); `out[i * stride + j]` gets (row `r + i`, token `t + j`).
///
/// # Safety
///
/// AVX2 and FMA must be available, and the rows and tokens in bounds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn tile_avx2<const R: usize, const T: usize>(
    w: *const u8,
    r: usize,
    x: *const u8,
    t: usize,
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    let wp: [*const f32; R] = std::array::from_fn(|i| unsafe { w.cast::<f32>().add((r + i) * n) });
    let xp: [*const f32; T] = std::array::from_fn(|j| unsafe { x.cast::<f32>().add((t + j) * n) });
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    let full = n - n % 8;
    let mut k = 0;
    while k < full {
        // SAFETY: k + 8 <= n for every row and token.
        let xv: [__m256; T] = std::array::from_fn(|j| unsafe { _mm256_loadu_ps(xp[j].add(k)) });
        for i in 0..R {
            let wv = unsafe { _mm256_loadu_ps(wp[i].add(k)) };
            for j in 0..T {
                acc[i][j] = _mm256_fmadd_ps(wv, xv[j], acc[i][j]);
            }
        }
        k += 8;
    }
    for i in 0..R {
        for j in 0..T {
            let a = acc[i][j];
            let s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            let mut v = _mm_cvtss_f32(s);
            for kk in full..n {
                // SAFETY: kk < n.
                v += unsafe { wp[i].add(kk).read_unaligned() * xp[j].add(kk).read_unaligned() };
            }
            out[i * stride + j] = v;
        }
    }
}

/// One task on AVX-512: rows `r0..r1` times tokens `t0..t1`, in 4 x 4 tiles and their edges.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn block_avx512(
    w: *const u8,
    rows: Range<usize>,
    cols: usize,
    x: *const u8,
    toks: Range<usize>,
    out: &super::OutPtr,
) {
    let (r0, r1, t0, t1) = (rows.start, rows.end, toks.start, toks.end);
    macro_rules! tile {
        ($r:literal, $t:literal, $row:expr, $tok:expr, $buf:expr) => {
            // SAFETY: rows and tokens in bounds (the caller's promise, kept by the loops).
            unsafe { tile_avx512::<$r, $t>(w, $row, x, $tok, cols, $buf, 4) }
        };
    }
    let mut t = t0;
    while t < t1 {
        let nt = (t1 - t).min(4);
        let mut r = r0;
        while r < r1 {
            let nr = (r1 - r).min(4);
            let mut tile = [0f32; 16];
            let buf = &mut tile[..];
            match (nr, nt) {
                (4, 4) => tile!(4, 4, r, t, buf),
                (4, 3) => tile!(4, 3, r, t, buf),
                (4, 2) => tile!(4, 2, r, t, buf),
                (4, _) => tile!(4, 1, r, t, buf),
                (3, 4) => tile!(3, 4, r, t, buf),
                (3, 3) => tile!(3, 3, r, t, buf),
                (3, 2) => tile!(3, 2, r, t, buf),
                (3, _) => tile!(3, 1, r, t, buf),
                (2, 4) => tile!(2, 4, r, t, buf),
                (2, 3) => tile!(2, 3, r, t, buf),
                (2, 2) => tile!(2, 2, r, t, buf),
                (2, _) => tile!(2, 1, r, t, buf),
                (_, 4) => tile!(1, 4, r, t, buf),
                (_, 3) => tile!(1, 3, r, t, buf),
                (_, 2) => tile!(1, 2, r, t, buf),
                _ => tile!(1, 1, r, t, buf),
            }
            for i in 0..nr {
                for j in 0..nt {
                    // SAFETY: the cell (r + i, t + j) belongs to this task only.
                    unsafe { out.write(r + i, t + j, tile[i * 4 + j]) };
                }
            }
            r += nr;
        }
        t += nt;
    }
}

/// [`tile_avx2`] with 16-lane registers.
///
/// # Safety
///
/// AVX-512 F must be available, and the rows and tokens in bounds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile_avx512<const R: usize, const T: usize>(
    w: *const u8,
    r: usize,
    x: *const u8,
    t: usize,
    n: usize,
    out: &mut [f32],
    stride: usize,
) {
    let wp: [*const f32; R] = std::array::from_fn(|i| unsafe { w.cast::<f32>().add((r + i) * n) });
    let xp: [*const f32; T] = std::array::from_fn(|j| unsafe { x.cast::<f32>().add((t + j) * n) });
    let mut acc = [[_mm512_setzero_ps(); T]; R];
    let full = n - n % 16;
    let mut k = 0;
    while k < full {
        // SAFETY: k + 16 <= n for every row and token.
        let xv: [__m512; T] = std::array::from_fn(|j| unsafe { _mm512_loadu_ps(xp[j].add(k)) });
        for i in 0..R {
            let wv = unsafe { _mm512_loadu_ps(wp[i].add(k)) };
            for j in 0..T {
                acc[i][j] = _mm512_fmadd_ps(wv, xv[j], acc[i][j]);
            }
        }
        k += 16;
    }
    for i in 0..R {
        for j in 0..T {
            let mut v = _mm512_reduce_add_ps(acc[i][j]);
            for kk in full..n {
                // SAFETY: kk < n.
                v += unsafe { wp[i].add(kk).read_unaligned() * xp[j].add(kk).read_unaligned() };
            }
            out[i * stride + j] = v;
        }
    }
}
