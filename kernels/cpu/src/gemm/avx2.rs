//! AVX2 + FMA micro-kernels (x86_64): tiles of up to `R_MAX` rows x `T_MAX` tokens, each block
//! pair as two 256-bit halves through `vpmaddubsw` + `vpmaddwd`.
//!
//! Used only as `Isa::Avx2`, which `Isa::detected` / `Isa::available` return only after
//! `is_x86_feature_detected!` confirmed avx2, fma and f16c: the safe entry point relies on it.

use std::arch::x86_64::*;

use super::{unpack_row, with_wbuf, Chunk, OutPtr, Span, Q4_0, Q4_1, Q8_0};

/// Rows per register tile: 2 x 4 accumulators leave 8 of the 16 ymm registers for operands.
const R_MAX: usize = 2;
/// Tokens per register tile (see `R_MAX`).
const T_MAX: usize = 4;

/// Computes `s` into `out` with the AVX2 kernels.
pub(super) fn run_span(s: &Span<'_>, out: OutPtr) {
    // SAFETY: `Isa::Avx2` (the only caller's dispatch arm) is chosen only after runtime
    // detection of every feature `run_span_avx2` enables.
    unsafe { run_span_avx2(s, out) }
}

#[target_feature(enable = "avx2,fma,f16c")]
fn run_span_avx2(s: &Span<'_>, out: OutPtr) {
    match s.g.fmt {
        Q4_0 => span_fmt::<Q4_0>(s, out),
        Q4_1 => span_fmt::<Q4_1>(s, out),
        _ => span_fmt::<Q8_0>(s, out),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn span_fmt<const F: u8>(s: &Span<'_>, out: OutPtr) {
    let g = &s.g;
    let ws = g.wstride();
    let xs = g.xstride();
    with_wbuf(R_MAX * ws, |wbuf| {
        let mut r0 = s.rows.start;
        while r0 < s.rows.end {
            let nr = R_MAX.min(s.rows.end - r0);
            for i in 0..nr {
                let row = &s.w[(r0 + i) * s.wrb..(r0 + i + 1) * s.wrb];
                unpack_row(g, row, &mut wbuf[i * ws..(i + 1) * ws]);
            }
            let mut t0 = s.tokens.start;
            while t0 < s.tokens.end {
                let nt = T_MAX.min(s.tokens.end - t0);
                let x = &s.panel[t0 * xs..(t0 + nt) * xs];
                let w = &wbuf[..nr * ws];
                macro_rules! tile {
                    ($r:literal, $t:literal) => {{
                        let acc = tile::<F, $r, $t>(w, ws, x, xs, g.np, g.nc);
                        for (i, row) in acc.iter().enumerate() {
                            for (j, v) in row.iter().enumerate() {
                                // SAFETY: this task owns rows `s.rows` x tokens `s.tokens`.
                                unsafe { out.write(r0 + i, t0 + j, *v) };
                            }
                        }
                    }};
                }
                match (nr, nt) {
                    (2, 4) => tile!(2, 4),
                    (2, 3) => tile!(2, 3),
                    (2, 2) => tile!(2, 2),
                    (2, _) => tile!(2, 1),
                    (_, 4) => tile!(1, 4),
                    (_, 3) => tile!(1, 3),
                    (_, 2) => tile!(1, 2),
                    (_, _) => tile!(1, 1),
                }
                t0 += nt;
            }
            r0 += nr;
        }
    });
}

/// Loads half `h` (0 or 1) of a chunk as 8 i32 / 32 i8 lanes.
#[inline(always)]
fn ld(c: &Chunk, h: usize) -> __m256i {
    let half: &[u8; 32] = c.0[32 * h..32 * h + 32].try_into().expect("32-byte half");
    // SAFETY: `half` is 32 readable bytes and `loadu` has no alignment requirement. AVX is
    // enabled in every caller.
    unsafe { _mm256_loadu_si256(half.as_ptr().cast()) }
}

/// Loads half `h` of a chunk as 8 f32 lanes.
#[inline(always)]
fn ldps(c: &Chunk, h: usize) -> __m256 {
    let half: &[u8; 32] = c.0[32 * h..32 * h + 32].try_into().expect("32-byte half");
    // SAFETY: as in `ld`.
    unsafe { _mm256_loadu_ps(half.as_ptr().cast()) }
}

/// Sum of the 8 lanes in a fixed order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// One tile, as `avx512::tile` but on 256-bit halves: per (row, token, pair),
/// `acc += float(low lanes) * d; acc += float(high lanes) * d` with `d = dw * dx`.
// Indexing the [row][token] register tile by (r, t) reads like the math and unrolls fully.
#[allow(clippy::needless_range_loop)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn tile<const F: u8, const R: usize, const T: usize>(
    w: &[Chunk],
    ws: usize,
    x: &[Chunk],
    xs: usize,
    np: usize,
    nc: usize,
) -> [[f32; T]; R] {
    let wf = 2;
    let xf = if F == Q4_0 { 3 } else { 2 };
    assert!(w.len() >= R * ws && x.len() >= T * xs && ws >= np * wf + nc && xs >= np * xf + nc);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for k in 0..np {
        for r in 0..R {
            let b = r * ws + k * wf;
            let wq = [ld(&w[b], 0), ld(&w[b], 1)];
            let wd = ldps(&w[b + 1], 0);
            // Q8_0: maddubs wants one unsigned operand; move w's sign onto x.
            let wa = if F == Q8_0 {
                [
                    _mm256_sign_epi8(wq[0], wq[0]),
                    _mm256_sign_epi8(wq[1], wq[1]),
                ]
            } else {
                wq
            };
            for t in 0..T {
                let xb = t * xs + k * xf;
                let d = _mm256_mul_ps(wd, ldps(&x[xb + 1], 0));
                for h in 0..2 {
                    let xq = ld(&x[xb], h);
                    let xq = if F == Q8_0 {
                        _mm256_sign_epi8(xq, wq[h])
                    } else {
                        xq
                    };
                    let mut lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[h], xq), ones);
                    if F == Q4_0 {
                        lanes = _mm256_add_epi32(lanes, ld(&x[xb + 2], h));
                    }
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), d, acc[r][t]);
                }
            }
        }
    }
    if F == Q4_1 {
        for c in 0..nc {
            for r in 0..R {
                let m = &w[r * ws + np * wf + c];
                for t in 0..T {
                    let s = &x[t * xs + np * xf + c];
                    for h in 0..2 {
                        acc[r][t] = _mm256_fmadd_ps(ldps(m, h), ldps(s, h), acc[r][t]);
                    }
                }
            }
        }
    }
    let mut res = [[0f32; T]; R];
    for r in 0..R {
        for t in 0..T {
            res[r][t] = hsum(acc[r][t]);
        }
    }
    res
}
