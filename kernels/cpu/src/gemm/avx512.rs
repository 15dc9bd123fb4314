//! AVX-512 micro-kernels (x86_64): tiles of up to `R_MAX` rows x `T_MAX` tokens, one
//! `vpdpbusd` per (row, token, block pair) with VNNI, or `vpmaddubsw` + `vpmaddwd` without.
//!
//! Every function below is written once, generic over `V` (VNNI or not), and inlined into two
//! entry points with different `#[target_feature]` sets: `run_span::<true>` is used only as
//! `Isa::Avx512`, which `Isa::detected` / `Isa::available` return only after
//! `is_x86_feature_detected!` confirmed avx512f, avx512bw, avx512vl, avx512vnni, avx2, fma and
//! f16c; `run_span::<false>` only as `Isa::Avx512Bw` (the same without avx512vnni). Without
//! VNNI, Q8_0 takes the sign trick (`|w| * (x * sign w)`, at most 2 x 128 x 127 per i16 pair, so
//! `vpmaddubsw` cannot saturate) on unbiased activations, and the other formats multiply their
//! unsigned quants of at most 6 bits (at most 2 x 63 x 128). Both give the same exact lane sums
//! as `vpdpbusd`.

use std::arch::x86_64::*;

use super::raw::{h16, ld16, prefetch, Raw, RawK};
use super::{
    has_mins, is_k, offset, unpack_row, with_wbuf, x_chunks, Chunk, OutPtr, Span, Q4_0, Q4_1, Q4_K,
    Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
};

/// Rows per register tile. 4 x 4 accumulators (16 zmm) plus 4 activation quants, 4 activation
/// scales, 4 Q4_0 corrections and the current row's quants and scales fit the 32 registers.
const R_MAX: usize = 4;
/// Tokens per register tile (see `R_MAX`).
const T_MAX: usize = 4;

/// Pairs (64 elements) per K-quant super-block (256 elements), which share the activations'
/// scale.
const K_PAIRS: usize = 4;

/// Up to this many tokens per task the kernels read the ggml blocks directly, unpacking in
/// registers for each token tile; beyond, each row is unpacked once into a buffer and reused
/// for every token tile. Unpacking in registers costs about one token's arithmetic per tile;
/// the buffered unpack costs about as much in total at 2 to 4 tiles (a batched decode step of
/// 8 sequences: 33-39 ms direct, 36 ms buffered; 16 sequences: 59-62 ms either way, with
/// `engram-model`'s `examples/batch_decode`, context 512, 2 threads), and wins beyond, where
/// prefill's 64-token chunks are.
const RAW_MAX_TOKENS: usize = 4 * T_MAX;

/// How far ahead (in rows) the direct (decode) path prefetches the weights: the next register
/// tile's rows, issued before the current tile is computed. Without it a 30-layer Q4_1 decode
/// sweep (66 MB, streamed from DRAM) ran at ~6.5 GB/s on one Zen 4 core, with it ~9.6 GB/s;
/// one tile ahead measured as good as or better than 2, 4 or 8 tiles (8 tiles was ~10% slower
/// on 2 threads), since the hardware prefetcher covers the longer range once a task's
/// contiguous rows are streaming.
const PREFETCH_ROWS: usize = R_MAX;

/// How far ahead (in bytes) the direct path also prefetches into L2, on top of the L1 prefetch
/// of the next tile: the hardware prefetcher restarts at every task and needs a few misses to
/// pick a stream up. Measured with 24 KiB tasks: a SmolLM2-135M Q4_1 decode after 512 tokens
/// on 2 threads went from about 103 to 108-114 tok/s (2026-11-24, alternating runs, medians of
/// 7 to 9), 2 to 16 KiB measured alike, and an L1 (T0) prefetch at 8 KiB was slower than none.
/// With the longer decode tasks that followed (`STREAM_MAX_TOKENS` in the parent module) it
/// still measured 114.1 against 110.9 tok/s without it, within the machine's noise.
const PREFETCH_L2_BYTES: usize = 4096;

/// Computes `s` into `out` with the VNNI kernels (`V`) or the AVX-512BW ones.
pub(super) fn run_span<const V: bool>(s: &Span<'_>, out: OutPtr) {
    guard_eq!(s.g.q8_bias, V && s.g.fmt == Q8_0);
    if V {
        // SAFETY: `Isa::Avx512` (the only dispatch arm with `V`) is chosen only after runtime
        // detection of every feature `vnni::run` enables.
        unsafe { vnni::run(s, out) }
    } else {
        // SAFETY: `Isa::Avx512Bw` (the only dispatch arm without `V`) is chosen only after
        // runtime detection of every feature `bw::run` enables.
        unsafe { bw::run(s, out) }
    }
}

/// The span driver and the register tile of one variant, compiled with `$features` (a
/// `#[target_feature]` set applies to a whole function, so the VNNI and the AVX-512BW variants
/// are two copies of the same source); `$v` says whether `vpdpbusd` may be used.
macro_rules! variant {
    ($name:ident, $features:literal, $v:literal) => {
        mod $name {
            use super::*;

            /// Whether this variant has VNNI.
            const V: bool = $v;

            #[target_feature(enable = $features)]
            pub(super) fn run(s: &Span<'_>, out: OutPtr) {
                // Block order only where the AMX tiles may run (VNNI).
                if V && s.g.blocks {
                    by_fmt::<true>(s, out)
                } else {
                    by_fmt::<false>(s, out)
                }
            }

            /// [`span_fmt`] for `s`'s format, in block order with `B` (never Q6_K's, which the
            /// AMX tiles do not take, so `Geom::blocks` is never set for it).
            #[inline]
            #[target_feature(enable = $features)]
            fn by_fmt<const B: bool>(s: &Span<'_>, out: OutPtr) {
                match s.g.fmt {
                    Q4_0 => span_fmt::<Q4_0, B>(s, out),
                    Q4_1 => span_fmt::<Q4_1, B>(s, out),
                    Q5_0 => span_fmt::<Q5_0, B>(s, out),
                    Q5_1 => span_fmt::<Q5_1, B>(s, out),
                    Q4_K => span_fmt::<Q4_K, B>(s, out),
                    Q5_K => span_fmt::<Q5_K, B>(s, out),
                    Q6_K => span_fmt::<Q6_K, false>(s, out),
                    _ => span_fmt::<Q8_0, B>(s, out),
                }
            }

            #[inline]
            #[target_feature(enable = $features)]
            fn span_fmt<const F: u8, const B: bool>(s: &Span<'_>, out: OutPtr) {
                let g = &s.g;
                let ws = g.wstride();
                let direct = s.tokens.len() <= RAW_MAX_TOKENS;
                with_wbuf(if direct { 0 } else { R_MAX * ws }, |wbuf| {
                    let mut r0 = s.rows.start;
                    while r0 < s.rows.end {
                        let nr = R_MAX.min(s.rows.end - r0);
                        if direct {
                            prefetch::<_MM_HINT_T0>(s.w, (r0 + PREFETCH_ROWS) * s.wrb, nr * s.wrb);
                            prefetch::<_MM_HINT_T1>(
                                s.w,
                                r0 * s.wrb + PREFETCH_L2_BYTES,
                                nr * s.wrb,
                            );
                        } else {
                            for i in 0..nr {
                                let row = &s.w[(r0 + i) * s.wrb..(r0 + i + 1) * s.wrb];
                                unpack_row(g, row, &mut wbuf[i * ws..(i + 1) * ws]);
                            }
                        }
                        let unpacked = Unpacked {
                            w: &wbuf[..],
                            ws,
                            wf: g.wf,
                            np: g.np,
                        };
                        let src = if direct { None } else { Some(&unpacked) };
                        let mut t0 = s.tokens.start;
                        while t0 < s.tokens.end {
                            let nt = T_MAX.min(s.tokens.end - t0);
                            let at = (r0, t0);
                            match (nr, nt) {
                                (4, 4) => tile_out::<F, 4, 4, B>(s, src, at, out),
                                (4, 3) => tile_out::<F, 4, 3, B>(s, src, at, out),
                                (4, 2) => tile_out::<F, 4, 2, B>(s, src, at, out),
                                (4, _) => tile_out::<F, 4, 1, B>(s, src, at, out),
                                (3, 4) => tile_out::<F, 3, 4, B>(s, src, at, out),
                                (3, 3) => tile_out::<F, 3, 3, B>(s, src, at, out),
                                (3, 2) => tile_out::<F, 3, 2, B>(s, src, at, out),
                                (3, _) => tile_out::<F, 3, 1, B>(s, src, at, out),
                                (2, 4) => tile_out::<F, 2, 4, B>(s, src, at, out),
                                (2, 3) => tile_out::<F, 2, 3, B>(s, src, at, out),
                                (2, 2) => tile_out::<F, 2, 2, B>(s, src, at, out),
                                (2, _) => tile_out::<F, 2, 1, B>(s, src, at, out),
                                (_, 4) => tile_out::<F, 1, 4, B>(s, src, at, out),
                                (_, 3) => tile_out::<F, 1, 3, B>(s, src, at, out),
                                (_, 2) => tile_out::<F, 1, 2, B>(s, src, at, out),
                                (_, _) => tile_out::<F, 1, 1, B>(s, src, at, out),
                            }
                            t0 += nt;
                        }
                        r0 += nr;
                    }
                });
            }

            /// The `R x T` tile at rows `r0..`, tokens `t0..` (`at`), from the ggml blocks
            /// (`unpacked` is `None`: decode) or the unpacked rows, written to `out`.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile_out<const F: u8, const R: usize, const T: usize, const B: bool>(
                s: &Span<'_>,
                unpacked: Option<&Unpacked<'_>>,
                (r0, t0): (usize, usize),
                out: OutPtr,
            ) {
                let (g, xs) = (&s.g, s.g.xstride());
                let x = &s.panel[t0 * xs..(t0 + T) * xs];
                let acc = match unpacked {
                    None => {
                        let row = |i: usize| &s.w[(r0 + i) * s.wrb..(r0 + i + 1) * s.wrb];
                        if is_k(F) {
                            let raw = RawK::<F, R>::new(std::array::from_fn(row), g.nb);
                            tile_any::<F, R, T, B>(&raw, x, xs, g.np, g.nc)
                        } else {
                            let raw = Raw::<F, R>::new(std::array::from_fn(row), g.nb);
                            tile_any::<F, R, T, B>(&raw, x, xs, g.np, g.nc)
                        }
                    }
                    Some(u) => tile_any::<F, R, T, B>(u, x, xs, g.np, g.nc),
                };
                for (i, row) in acc.iter().enumerate() {
                    for (j, v) in row.iter().enumerate() {
                        // SAFETY: this task owns rows `s.rows` x tokens `s.tokens`.
                        unsafe { out.write(r0 + i, t0 + j, *v) };
                    }
                }
            }

            /// One tile: `R` weight rows from `w` times `T` packed tokens (`x`, stride `xs` chunks), `np`
            /// block pairs and `nc` min chunks. Returns `[row][token]` dots.
            ///
            /// Per (row, token, pair): `acc += float(lanes) * (dw * dx)` with exact i32 lane sums
            /// (the K-quants: `part += float(lanes) * dw` over a super-block's 4 pairs, then `acc
            /// += part * dx`); the order of operations does not depend on `R`, `T` or the source
            /// (see the module docs).
            // Indexing the [row][token] register tile by (r, t) reads like the math and unrolls fully.
            #[allow(clippy::needless_range_loop)]
            #[inline]
            #[target_feature(enable = $features)]
            fn tile<const F: u8, const R: usize, const T: usize>(
                w: &impl WSrc,
                x: &[Chunk],
                xs: usize,
                np: usize,
                nc: usize,
            ) -> [[f32; T]; R] {
                let xf = x_chunks(F);
                assert!(x.len() >= T * xs && xs >= np * xf + nc);
                let mut acc = [[_mm512_setzero_ps(); T]; R];
                if is_k(F) {
                    // A K-quant's activation scale is its super-block's, the same for the
                    // super-block's 4 pairs: the pairs take the weights' scales only, and dx
                    // comes in once per super-block (3 instructions per pair instead of 4).
                    assert!(np % K_PAIRS == 0);
                    for sb in 0..np / K_PAIRS {
                        let mut part = [[_mm512_setzero_ps(); T]; R];
                        for k in K_PAIRS * sb..K_PAIRS * (sb + 1) {
                            pair::<F, R, T, false>(w, x, xs, k, &mut part);
                        }
                        for t in 0..T {
                            let xd = ldps(&x[t * xs + K_PAIRS * sb * xf + 1]);
                            for r in 0..R {
                                acc[r][t] = _mm512_fmadd_ps(part[r][t], xd, acc[r][t]);
                            }
                        }
                    }
                } else {
                    for k in 0..np {
                        pair::<F, R, T, true>(w, x, xs, k, &mut acc);
                    }
                }
                if has_mins(F) {
                    for c in 0..nc {
                        for r in 0..R {
                            let m = w.m(r, c);
                            for t in 0..T {
                                let s = ldps(&x[t * xs + np * xf + c]);
                                acc[r][t] = _mm512_fmadd_ps(m, s, acc[r][t]);
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

            /// Pair `k` of an `R x T` tile into `acc`: per (row, token), `acc += float(lanes) *
            /// (dw * dx)` (`DX`), or `acc += float(lanes) * dw` (the K-quants, whose caller
            /// applies dx per super-block), with the exact natural lane sums.
            #[allow(clippy::needless_range_loop)]
            #[inline]
            #[target_feature(enable = $features)]
            fn pair<const F: u8, const R: usize, const T: usize, const DX: bool>(
                w: &impl WSrc,
                x: &[Chunk],
                xs: usize,
                k: usize,
                acc: &mut [[__m512; T]; R],
            ) {
                let (xq, xd, xc) = pair_x::<F, T, DX>(x, xs, k);
                for r in 0..R {
                    let lanes = row_lanes::<F, T>(w, r, k, &xq, &xc);
                    let wd = w.d(r, k);
                    for t in 0..T {
                        let d = if DX { _mm512_mul_ps(wd, xd[t]) } else { wd };
                        acc[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lanes[t]), d, acc[r][t]);
                    }
                }
            }

            /// The `T` tokens' chunks of pair `k`: quants, scales (with `DX`; zeros otherwise)
            /// and, for the offset formats, the corrections (zeros otherwise).
            #[inline]
            #[target_feature(enable = $features)]
            fn pair_x<const F: u8, const T: usize, const DX: bool>(
                x: &[Chunk],
                xs: usize,
                k: usize,
            ) -> ([__m512i; T], [__m512; T], [__m512i; T]) {
                let xf = x_chunks(F);
                let off = offset(F) != 0;
                let zero = _mm512_setzero_si512();
                let mut xq = [zero; T];
                let mut xd = [_mm512_setzero_ps(); T];
                let mut xc = [zero; T];
                for t in 0..T {
                    let b = t * xs + k * xf;
                    xq[t] = ld(&x[b]);
                    if DX {
                        xd[t] = ldps(&x[b + 1]);
                    }
                    if off {
                        xc[t] = ld(&x[b + 2]);
                    }
                }
                (xq, xd, xc)
            }

            /// The exact natural lane sums of row `r`, pair `k` against the `T` tokens' quants
            /// `xq` (and offset corrections `xc`).
            #[allow(clippy::needless_range_loop)]
            #[inline]
            #[target_feature(enable = $features)]
            fn row_lanes<const F: u8, const T: usize>(
                w: &impl WSrc,
                r: usize,
                k: usize,
                xq: &[__m512i; T],
                xc: &[__m512i; T],
            ) -> [__m512i; T] {
                let off = offset(F) != 0;
                let zero = _mm512_setzero_si512();
                let wq = w.q(r, k);
                let wc = if F == Q8_0 && V { w.c(wq, r, k) } else { zero };
                // Without VNNI, Q8_0 multiplies |w| by x with w's sign.
                let (wabs, wneg) = if F == Q8_0 && !V {
                    (_mm512_abs_epi8(wq), _mm512_movepi8_mask(wq))
                } else {
                    (zero, 0)
                };
                let mut lanes = [zero; T];
                for t in 0..T {
                    // Exact natural lane sums: offset formats (q - o) * x = q * x - o *
                    // sum(x) (the corrections `xc`); Q8_0 (x + 128) * w - 128 * sum(w) =
                    // x * w; the others (unsigned quants, mins apart) q * x.
                    // SAFETY (the `V` arms): only the VNNI variant, whose target
                    // features include avx512vnni, has `V`.
                    #[allow(unused_unsafe)]
                    let l = unsafe {
                        let c = if off { xc[t] } else { zero };
                        match (F == Q8_0, V) {
                            (false, true) => _mm512_dpbusd_epi32(c, wq, xq[t]),
                            (true, true) => _mm512_dpbusd_epi32(wc, xq[t], wq),
                            (false, false) if off => _mm512_add_epi32(c, dot_bw(wq, xq[t])),
                            (false, false) => dot_bw(wq, xq[t]),
                            (true, false) => {
                                dot_bw(wabs, _mm512_mask_sub_epi8(xq[t], wneg, zero, xq[t]))
                            }
                        }
                    };
                    lanes[t] = l;
                }
                lanes
            }

            /// [`tile`], or [`tile_blocks`] with `B`.
            #[inline]
            #[target_feature(enable = $features)]
            fn tile_any<const F: u8, const R: usize, const T: usize, const B: bool>(
                w: &impl WSrc,
                x: &[Chunk],
                xs: usize,
                np: usize,
                nc: usize,
            ) -> [[f32; T]; R] {
                if B {
                    tile_blocks::<_, F, R, T>(w, x, xs, np, nc)
                } else {
                    tile::<F, R, T>(w, x, xs, np, nc)
                }
            }

            /// One tile in the AMX tiles' order (see `amx`), for the formats they take: per
            /// (row, token), block by block, `acc = fma(float(dot), dw * dx, acc)` with the
            /// block's exact dot, then `acc = fma(m, s, acc)` for the formats with mins; no
            /// final lane sum. A product then has the same bits here (decode) as in a prefill
            /// on the tiles.
            ///
            /// The (row, token) outputs go in groups of 4 (`o = 4 g + i`, row `o / T`, token
            /// `o % T`): per pair, [`reduce4`] turns their lane sums into one 8-lane register,
            /// block `2k`'s dot of output `i` in lane `i` and block `2k + 1`'s in lane `4 + i`,
            /// and the scales (and mins, sums) are placed to match, so the float steps run 8
            /// lanes wide. The accumulator lives in the low lanes; between the two blocks it
            /// moves to the high ones and back ([`swap`]).
            #[allow(clippy::needless_range_loop)]
            #[inline]
            #[target_feature(enable = $features)]
            fn tile_blocks<W: WSrc, const F: u8, const R: usize, const T: usize>(
                w: &W,
                x: &[Chunk],
                xs: usize,
                np: usize,
                nc: usize,
            ) -> [[f32; T]; R] {
                let xf = x_chunks(F);
                assert!(x.len() >= T * xs && xs >= np * xf + nc);
                assert!(F != Q6_K && R <= 4 && T <= 4);
                let n = R * T;
                let groups = n.div_ceil(4);
                let mins = has_mins(F);
                let zero = _mm512_setzero_si512();
                let zf = _mm256_setzero_ps();
                // Where output `i` of group `g` takes its row's and its token's values from
                // the `[v0(2k) .. v3(2k) | v0(2k + 1) .. v3(2k + 1)]` registers below.
                let place = |g: usize, of: fn(usize) -> usize| {
                    let o = |i: usize| (4 * g + i).min(n - 1);
                    let at = |i: usize| of(o(i)) as i32;
                    _mm256_setr_epi32(
                        at(0),
                        at(1),
                        at(2),
                        at(3),
                        4 + at(0),
                        4 + at(1),
                        4 + at(2),
                        4 + at(3),
                    )
                };
                let row_idx: [__m256i; 4] = std::array::from_fn(|g| place(g, |o| o / T));
                let tok_idx: [__m256i; 4] = std::array::from_fn(|g| place(g, |o| o % T));
                let mut acc = [zf; 4];
                let mut sv = [_mm512_setzero_ps(); T];
                let mut mv = [_mm512_setzero_ps(); R];
                for k in 0..np {
                    if mins && k % 8 == 0 {
                        for t in 0..T {
                            sv[t] = ldps(&x[t * xs + np * xf + k / 8]);
                        }
                        if !W::OWN_MINS {
                            for r in 0..R {
                                mv[r] = w.m(r, k / 8);
                            }
                        }
                    }
                    let (xq, xd, xc) = pair_x::<F, T, true>(x, xs, k);
                    let mut lanes = [zero; 16];
                    for r in 0..R {
                        let l = row_lanes::<F, T>(w, r, k, &xq, &xc);
                        for t in 0..T {
                            lanes[r * T + t] = l[t];
                        }
                    }
                    let dw = w.d4::<F, R>(k);
                    let m = if mins { w.m4::<R>(&mv, k) } else { zf };
                    // The tokens' scales (and sums) as one register, unless there is one.
                    let (dx, s) = if T == 1 {
                        (ab::<F>(xd[0]), if mins { pick(sv[0], k) } else { zf })
                    } else {
                        let get = |i: usize| if i < T { ab::<F>(xd[i]) } else { zf };
                        let dx = place4([get(0), get(1), get(2), get(3)]);
                        let s = if mins {
                            let get = |i: usize| if i < T { pick(sv[i], k) } else { zf };
                            place4([get(0), get(1), get(2), get(3)])
                        } else {
                            zf
                        };
                        (dx, s)
                    };
                    for g in 0..groups {
                        let v = |i: usize| lanes[(4 * g + i).min(15)];
                        let dots = _mm256_cvtepi32_ps(reduce4::<F>([v(0), v(1), v(2), v(3)]));
                        // With one token, output i is row i: the registers are in place.
                        let by_row = |v: __m256| {
                            if T == 1 {
                                v
                            } else {
                                _mm256_permutevar8x32_ps(v, row_idx[g])
                            }
                        };
                        let by_tok = |v: __m256| {
                            if T == 1 {
                                v
                            } else {
                                _mm256_permutevar8x32_ps(v, tok_idx[g])
                            }
                        };
                        let d = _mm256_mul_ps(by_row(dw), by_tok(dx));
                        let (mm, ss) = if mins {
                            (by_row(m), by_tok(s))
                        } else {
                            (zf, zf)
                        };
                        let mut a = acc[g];
                        for _block in 0..2 {
                            a = _mm256_fmadd_ps(dots, d, a);
                            if mins {
                                a = _mm256_fmadd_ps(mm, ss, a);
                            }
                            a = swap(a);
                        }
                        acc[g] = a;
                    }
                }
                let mut out = [[0f32; 8]; 4];
                for g in 0..groups {
                    // SAFETY: 8 writable f32; `storeu` has no alignment requirement.
                    unsafe { _mm256_storeu_ps(out[g].as_mut_ptr(), acc[g]) };
                }
                let mut res = [[0f32; T]; R];
                for r in 0..R {
                    for t in 0..T {
                        let o = r * T + t;
                        res[r][t] = out[o / 4][o % 4];
                    }
                }
                res
            }
        }
    };
}

variant!(
    vnni,
    "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c",
    true
);
variant!(bw, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", false);

/// Loads a chunk as 16 i32 / 64 i8 lanes.
#[inline(always)]
fn ld(c: &Chunk) -> __m512i {
    // SAFETY: a `Chunk` is 64 readable bytes; `loadu` has no alignment requirement (chunks are
    // 64-byte aligned anyway). AVX-512F is enabled in every caller.
    unsafe { _mm512_loadu_si512(c.0.as_ptr().cast()) }
}

/// Loads a chunk as 16 f32 lanes.
#[inline(always)]
fn ldps(c: &Chunk) -> __m512 {
    // SAFETY: as in `ld`.
    unsafe { _mm512_loadu_ps(c.0.as_ptr().cast()) }
}

/// The exact dots of blocks `2k` and `2k + 1` of 4 outputs from their pair's lane sums `v`:
/// `[dot_0(2k) .. dot_3(2k) | dot_0(2k + 1) .. dot_3(2k + 1)]`. A block's lanes are the 128-bit
/// quarters 0 and 2 (the 32-element formats interleave the blocks by quarters) or 0 and 1 (the
/// K-quants' chunks hold the two sub-blocks in halves). Exact (integers).
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn reduce4<const F: u8>(v: [__m512i; 4]) -> __m256i {
    let t01 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[0], v[1]),
        _mm512_unpackhi_epi32(v[0], v[1]),
    );
    let t23 = _mm512_add_epi32(
        _mm512_unpacklo_epi32(v[2], v[3]),
        _mm512_unpackhi_epi32(v[2], v[3]),
    );
    // Per quarter q: the sums of quarter q of v[0], v[1], v[2], v[3].
    let u = _mm512_add_epi32(
        _mm512_unpacklo_epi64(t01, t23),
        _mm512_unpackhi_epi64(t01, t23),
    );
    let u = if is_k(F) {
        _mm512_shuffle_i32x4::<0b11_01_10_00>(u, u)
    } else {
        u
    };
    _mm256_add_epi32(_mm512_castsi512_si256(u), _mm512_extracti64x4_epi64::<1>(u))
}

/// A chunk of per-lane values (scales) as `[v(2k) x4 | v(2k + 1) x4]` (the K-quants' chunks
/// hold the two sub-blocks in halves, with one value per 16 elements; the others interleave
/// the blocks by quarters).
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn ab<const F: u8>(v: __m512) -> __m256 {
    let v = if is_k(F) {
        _mm512_shuffle_f32x4::<0b11_01_10_00>(v, v)
    } else {
        v
    };
    _mm512_castps512_ps256(v)
}

/// Blocks `2k` and `2k + 1` of a 16-block chunk of mins or sums as `[v(2k) x4 | v(2k + 1) x4]`.
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn pick(v: __m512, k: usize) -> __m256 {
    let a = (2 * k % 16) as i32;
    let idx = _mm512_add_epi32(
        _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0),
        _mm512_set1_epi32(a),
    );
    _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, v))
}

/// Four `[v(2k) x4 | v(2k + 1) x4]` registers as one: `[v0(2k) .. v3(2k) | v0(2k + 1) ..
/// v3(2k + 1)]`.
#[inline]
#[target_feature(enable = "avx2")]
fn place4(f: [__m256; 4]) -> __m256 {
    let q01 = _mm256_unpacklo_ps(f[0], f[1]);
    let q23 = _mm256_unpacklo_ps(f[2], f[3]);
    _mm256_castpd_ps(_mm256_unpacklo_pd(
        _mm256_castps_pd(q01),
        _mm256_castps_pd(q23),
    ))
}

/// Swaps the halves: moves [`reduce4`]'s block-`2k` lanes onto the block-`2k + 1` lanes and
/// back.
#[inline]
#[target_feature(enable = "avx2")]
fn swap(a: __m256) -> __m256 {
    _mm256_permute2f128_ps::<0x01>(a, a)
}

/// Sum of the 16 lanes in a fixed order (halves, then quarters, then pairs).
#[inline]
#[target_feature(enable = "avx512f,avx2")]
fn hsum(v: __m512) -> f32 {
    let lo = _mm512_castps512_ps256(v);
    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
    let s = _mm256_add_ps(lo, hi);
    let s = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Where a tile's weight vectors come from: unpacked rows ([`Unpacked`], prefill) or the ggml
/// blocks themselves ([`Raw`], decode). Both build exactly the same vectors (the layout in the
/// module docs), so a tile's result does not depend on the source.
///
/// The methods are only called from `tile`, which enables every feature they use.
trait WSrc {
    /// Quants of row `r`, pair `k`.
    fn q(&self, r: usize, k: usize) -> __m512i;
    /// Scales of row `r`, pair `k`.
    fn d(&self, r: usize, k: usize) -> __m512;
    /// Q8_0 corrections `-128 * (lane sums of q)` of row `r`, pair `k`, whose quants are `q`.
    fn c(&self, q: __m512i, r: usize, k: usize) -> __m512i;
    /// Q4_1 mins of row `r`, blocks `16 c .. 16 c + 16`.
    fn m(&self, r: usize, c: usize) -> __m512;

    /// The scales of blocks `2k` and `2k + 1` of rows `0..R` (at most 4) as `[d_0(2k) ..
    /// d_3(2k) | d_0(2k + 1) .. d_3(2k + 1)]`, rows past `R` zero: what the block-order tile
    /// multiplies by (see `tile_blocks`). The values of [`WSrc::d`].
    #[inline(always)]
    fn d4<const F: u8, const R: usize>(&self, k: usize) -> __m256 {
        // SAFETY: only called from `tile_blocks`, which enables AVX-512F and AVX2.
        unsafe {
            let get = |r: usize| {
                if r < R {
                    ab::<F>(self.d(r, k))
                } else {
                    _mm256_setzero_ps()
                }
            };
            place4([get(0), get(1), get(2), get(3)])
        }
    }

    /// Whether [`WSrc::m4`] reads the mins itself; otherwise the tile loads each row's chunk
    /// of 16 ([`WSrc::m`]) every 8 pairs and passes them in.
    const OWN_MINS: bool = false;

    /// [`WSrc::d4`] for the mins (the values of [`WSrc::m`]); `mv[r]` is row `r`'s chunk of
    /// the 16 blocks around pair `k` (unless [`WSrc::OWN_MINS`]).
    #[inline(always)]
    fn m4<const R: usize>(&self, mv: &[__m512; R], k: usize) -> __m256 {
        // SAFETY: only called from `tile_blocks`, which enables AVX-512F and AVX2.
        unsafe {
            let get = |r: usize| {
                if r < R {
                    pick(mv[r], k)
                } else {
                    _mm256_setzero_ps()
                }
            };
            place4([get(0), get(1), get(2), get(3)])
        }
    }
}

/// Rows unpacked by `unpack_row`: `w[r * ws ..]`, `np` pairs of `wf` chunks then the mins.
struct Unpacked<'a> {
    w: &'a [Chunk],
    ws: usize,
    wf: usize,
    np: usize,
}

impl WSrc for Unpacked<'_> {
    #[inline(always)]
    fn q(&self, r: usize, k: usize) -> __m512i {
        ld(&self.w[r * self.ws + k * self.wf])
    }
    #[inline(always)]
    fn d(&self, r: usize, k: usize) -> __m512 {
        ldps(&self.w[r * self.ws + k * self.wf + 1])
    }
    #[inline(always)]
    fn c(&self, _q: __m512i, r: usize, k: usize) -> __m512i {
        ld(&self.w[r * self.ws + k * self.wf + 2])
    }
    #[inline(always)]
    fn m(&self, r: usize, c: usize) -> __m512 {
        ldps(&self.w[r * self.ws + self.np * self.wf + c])
    }
}

impl<const F: u8, const R: usize> WSrc for Raw<'_, F, R> {
    #[inline(always)]
    fn q(&self, r: usize, k: usize) -> __m512i {
        if self.full(k) {
            let (p0, p1) = (self.ptr(r, 2 * k), self.ptr(r, 2 * k + 1));
            // SAFETY: blocks `2k` and `2k + 1` are in the row (`full`, and `new` checked the
            // row length), and the loads read bytes `QO..QO + 32` (Q8_0) or `QO..QO + 16` (Q4)
            // of a `BS`-byte block; `loadu` has no alignment requirement. Only called from
            // `tile`, which enables AVX-512F/BW and AVX2.
            unsafe {
                if F == Q8_0 {
                    let a = _mm512_castsi256_si512(_mm256_loadu_si256(p0.add(Self::QO).cast()));
                    let b = _mm512_castsi256_si512(_mm256_loadu_si256(p1.add(Self::QO).cast()));
                    let idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
                    return _mm512_permutex2var_epi64(a, idx, b);
                }
                let v = _mm256_loadu2_m128i(p1.add(Self::QO).cast(), p0.add(Self::QO).cast());
                let v =
                    _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
                let v = _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
                return if Self::Q5 {
                    self.fifth_bits(v, r, k)
                } else {
                    v
                };
            }
        }
        let (b0, b1) = (self.block(r, 2 * k), self.block(r, 2 * k + 1));
        // SAFETY: only called from `tile`, which enables AVX-512F/BW and AVX2.
        unsafe {
            if F == Q8_0 {
                let a = _mm256_set_m128i(ld16(b0, Self::QO + 16), ld16(b0, Self::QO));
                let b = _mm256_set_m128i(ld16(b1, Self::QO + 16), ld16(b1, Self::QO));
                let idx = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0);
                _mm512_permutex2var_epi64(_mm512_castsi256_si512(a), idx, _mm512_castsi256_si512(b))
            } else {
                let v = _mm256_set_m128i(ld16(b1, Self::QO), ld16(b0, Self::QO));
                let m = _mm256_set1_epi8(0x0F);
                let lo = _mm256_and_si256(v, m);
                let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), m);
                let v = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(lo), hi);
                if Self::Q5 {
                    self.fifth_bits(v, r, k)
                } else {
                    v
                }
            }
        }
    }
    #[inline(always)]
    fn d(&self, r: usize, k: usize) -> __m512 {
        let bits = if self.full(k) {
            // SAFETY: both blocks are in the row (`full`, `new`); each starts with its f16
            // scale, read unaligned.
            unsafe {
                let d0 = self.ptr(r, 2 * k).cast::<u16>().read_unaligned();
                let d1 = self.ptr(r, 2 * k + 1).cast::<u16>().read_unaligned();
                d0 as i32 | (d1 as i32) << 16
            }
        } else {
            let (b0, b1) = (self.block(r, 2 * k), self.block(r, 2 * k + 1));
            h16(b0, 0) as i32 | (h16(b1, 0) as i32) << 16
        };
        // SAFETY: only called from `tile`, which enables AVX-512F and F16C.
        unsafe {
            let d01 = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
            let idx = _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0);
            _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(d01))
        }
    }
    #[inline(always)]
    fn c(&self, q: __m512i, _r: usize, _k: usize) -> __m512i {
        // SAFETY: only called from `tile`, which enables AVX-512F and VNNI.
        unsafe {
            let zero = _mm512_setzero_si512();
            let s = _mm512_dpbusd_epi32(zero, _mm512_set1_epi8(-128), q);
            _mm512_sub_epi32(zero, s)
        }
    }
    #[inline(always)]
    fn m(&self, r: usize, c: usize) -> __m512 {
        let b0 = 16 * c;
        let n = self.nb.saturating_sub(b0).min(16);
        let mask: __mmask16 = if n == 16 { 0xFFFF } else { (1u16 << n) - 1 };
        // SAFETY: lane `l` (enabled for `b0 + l < nb` only) reads 4 bytes at offset 2 of block
        // `b0 + l`: the f16 min and the next 2 bytes, inside the `BS`-byte block (`new` checked
        // the row length); masked-off lanes read nothing. Only called from `tile`, which
        // enables AVX-512F/BW.
        unsafe {
            let idx = _mm512_mullo_epi32(
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                _mm512_set1_epi32(Self::BS as i32),
            );
            let base = self.ptr(r, b0).wrapping_add(2);
            let v =
                _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), mask, idx, base.cast());
            _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v))
        }
    }
    #[inline(always)]
    fn d4<const G: u8, const N: usize>(&self, k: usize) -> __m256 {
        self.f16_pairs(k, 0)
    }
    const OWN_MINS: bool = true;
    #[inline(always)]
    fn m4<const N: usize>(&self, _mv: &[__m512; N], k: usize) -> __m256 {
        self.f16_pairs(k, 2)
    }
}

impl<const F: u8, const R: usize> WSrc for RawK<'_, F, R> {
    #[inline(always)]
    fn q(&self, r: usize, k: usize) -> __m512i {
        let (p, j) = (self.ptr(r, k / 4), k % 4);
        // SAFETY: `p` points to a whole super-block of the row (`k / 4 < nsb`: the tile only
        // asks for the row's pairs; `new` checked the length); every load below reads inside
        // its `BS` bytes (Q6_K: ql 0..128, qh 128..192; Q4_K: qs 16..144; Q5_K: qh 16..48, qs
        // 48..176), unaligned. Only called from `tile`, which enables AVX-512F/BW and AVX2.
        unsafe {
            let m4 = _mm512_set1_epi8(0x0F);
            if F == Q6_K {
                // Pair j: elements 64 j .. 64 j + 64: half j / 2's ql (low nibbles for an even
                // j, high for an odd one) and qh's 2-bit fields 2 (j % 2) * 2 and the next.
                let (n, odd) = (j / 2, j % 2 == 1);
                let ql = _mm512_loadu_si512(p.add(64 * n).cast());
                let nib = if odd {
                    _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4)
                } else {
                    _mm512_and_si512(ql, m4)
                };
                let qh = _mm256_loadu_si256(p.add(128 + 32 * n).cast());
                let sh = 4 * odd as i32;
                let h = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(sh))),
                    _mm256_srl_epi16(qh, _mm_cvtsi32_si128(sh + 2)),
                );
                let h = _mm512_slli_epi16::<4>(_mm512_and_si512(h, _mm512_set1_epi8(3)));
                return _mm512_or_si512(nib, h);
            }
            // Q4_K / Q5_K: 32 bytes of qs, sub-block 2j in the low nibbles, 2j + 1 in the high.
            let qo = if F == Q5_K { 48 } else { 16 };
            let v = _mm256_loadu_si256(p.add(qo + 32 * j).cast());
            let q = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(v), _mm256_srli_epi16::<4>(v));
            let q = _mm512_and_si512(q, m4);
            if F != Q5_K {
                return q;
            }
            // Q5_K: bits 2j and 2j + 1 of qh[l] are the fifth bits of element l of each.
            let qh = _mm256_loadu_si256(p.add(16).cast());
            let sh = 2 * j as i32;
            let h = _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(sh))),
                _mm256_srl_epi16(qh, _mm_cvtsi32_si128(sh + 1)),
            );
            _mm512_or_si512(
                q,
                _mm512_slli_epi16::<4>(_mm512_and_si512(h, _mm512_set1_epi8(1))),
            )
        }
    }
    #[inline(always)]
    fn d(&self, r: usize, k: usize) -> __m512 {
        let s = self.scales(r, k);
        // SAFETY: `s` is 16 readable bytes; only called from `tile`, which enables AVX-512F.
        unsafe {
            let idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
            _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_loadu_ps(s.as_ptr())))
        }
    }
    #[inline(always)]
    fn c(&self, _q: __m512i, _r: usize, _k: usize) -> __m512i {
        unreachable!("corrections are Q8_0's only")
    }
    #[inline(always)]
    fn m(&self, r: usize, c: usize) -> __m512 {
        let m = self.mins(r, c);
        // SAFETY: `m` is 64 readable bytes; only called from `tile`, which enables AVX-512F.
        unsafe { _mm512_loadu_ps(m.as_ptr()) }
    }
    #[inline(always)]
    fn d4<const G: u8, const N: usize>(&self, k: usize) -> __m256 {
        let s: [[f32; 4]; 4] =
            std::array::from_fn(|r| if r < R { self.scales(r, k) } else { [0.0; 4] });
        // Sub-block 2k's scale is the pair's first, 2k + 1's its third (one per 16 elements).
        // SAFETY: only called from `tile_blocks`, which enables AVX.
        unsafe {
            _mm256_setr_ps(
                s[0][0], s[1][0], s[2][0], s[3][0], s[0][2], s[1][2], s[2][2], s[3][2],
            )
        }
    }
}

impl<const F: u8, const R: usize> Raw<'_, F, R> {
    /// The f16 at byte `off` of blocks `2k` and `2k + 1` (the scale at 0, Q4_1's and Q5_1's
    /// min at 2) of rows `0..R`, as [`WSrc::d4`] places them (missing blocks and rows: 0).
    #[inline(always)]
    fn f16_pairs(&self, k: usize, off: usize) -> __m256 {
        let bits = |r: usize| -> i32 {
            if r >= R {
                return 0;
            }
            if self.full(k) {
                // SAFETY: both blocks are in the row (`full`, `new`); `off + 2 <= BS`.
                unsafe {
                    let d0 = self.ptr(r, 2 * k).add(off).cast::<u16>().read_unaligned();
                    let d1 = self
                        .ptr(r, 2 * k + 1)
                        .add(off)
                        .cast::<u16>()
                        .read_unaligned();
                    d0 as i32 | (d1 as i32) << 16
                }
            } else {
                let (b0, b1) = (self.block(r, 2 * k), self.block(r, 2 * k + 1));
                h16(b0, off) as i32 | (h16(b1, off) as i32) << 16
            }
        };
        // SAFETY: only called from `tile_blocks`, which enables AVX2, AVX-512F and F16C.
        unsafe {
            // [r0(2k) r0(2k+1) r1(2k) ..] to [r0(2k) r1(2k) r2(2k) r3(2k) | r0(2k+1) ..].
            let h = _mm256_cvtph_ps(_mm_setr_epi32(bits(0), bits(1), bits(2), bits(3)));
            _mm256_permutevar8x32_ps(h, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7))
        }
    }

    /// `q` (the nibbles of pair `k` of row `r`, chunk layout) with the Q5 fifth bits added: bit
    /// `j` of a block's `qh` is element `j`'s, so the chunk's 64 bytes take, in order, bits
    /// 0..16 of block `2k`, 0..16 of `2k + 1`, 16..32 of `2k`, 16..32 of `2k + 1`.
    #[inline(always)]
    fn fifth_bits(&self, q: __m512i, r: usize, k: usize) -> __m512i {
        let (h0, h1) = (self.qh(r, 2 * k) as u64, self.qh(r, 2 * k + 1) as u64);
        let mask = (h0 & 0xFFFF) | (h1 & 0xFFFF) << 16 | (h0 >> 16) << 32 | (h1 >> 16) << 48;
        // SAFETY: only called from `tile` (through `q`), which enables AVX-512F/BW.
        unsafe { _mm512_or_si512(q, _mm512_maskz_mov_epi8(mask, _mm512_set1_epi8(0x10))) }
    }
}

/// `vpdpbusd` from zero without VNNI: `u8 x i8` products summed in fours into i32 lanes. Exact
/// while no pair of products exceeds i16 (see the module docs).
#[inline(always)]
fn dot_bw(u: __m512i, s: __m512i) -> __m512i {
    // SAFETY: AVX-512BW is enabled by the entry points this is inlined into.
    unsafe { _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)) }
}
