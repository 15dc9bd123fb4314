//! AVX2 + FMA micro-kernels (x86_64): tiles of up to `R_MAX` rows x `T_MAX` tokens, each block
//! pair as two 256-bit halves through `vpmaddubsw` + `vpmaddwd`.
//!
//! Used only as `Isa::Avx2`, which `Isa::detected` / `Isa::available` return only after
//! `is_x86_feature_detected!` confirmed avx2, fma and f16c: the safe entry point relies on it.

use std::arch::x86_64::*;

use super::raw::{h16, ld16, prefetch, Raw, RawK};
use super::{
    has_mins, is_k, offset, unpack_row, with_wbuf, x_chunks, Chunk, OutPtr, Span, Q4_0, Q4_1, Q4_K,
    Q5_0, Q5_1, Q5_K, Q6_K, Q8_0,
};

/// Rows per register tile: 2 x 4 accumulators leave 8 of the 16 ymm registers for operands.
const R_MAX: usize = 2;
/// Tokens per register tile (see `R_MAX`).
const T_MAX: usize = 4;

/// Up to this many tokens per task the kernels read the ggml blocks directly, unpacking in
/// registers (decode, batched decode); beyond, each row is unpacked once into a buffer and
/// reused for every token tile, as in the AVX-512 kernels (see their `RAW_MAX_TOKENS`).
const RAW_MAX_TOKENS: usize = 4 * T_MAX;

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
        Q5_0 => span_fmt::<Q5_0>(s, out),
        Q5_1 => span_fmt::<Q5_1>(s, out),
        Q4_K => span_fmt::<Q4_K>(s, out),
        Q5_K => span_fmt::<Q5_K>(s, out),
        Q6_K => span_fmt::<Q6_K>(s, out),
        _ => span_fmt::<Q8_0>(s, out),
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn span_fmt<const F: u8>(s: &Span<'_>, out: OutPtr) {
    let g = &s.g;
    let ws = g.wstride();
    let xs = g.xstride();
    let direct = s.tokens.len() <= RAW_MAX_TOKENS;
    with_wbuf(if direct { 0 } else { R_MAX * ws }, |wbuf| {
        let mut r0 = s.rows.start;
        while r0 < s.rows.end {
            let nr = R_MAX.min(s.rows.end - r0);
            let row = |i: usize| &s.w[(r0 + i) * s.wrb..(r0 + i + 1) * s.wrb];
            if direct {
                prefetch::<_MM_HINT_T0>(s.w, (r0 + R_MAX) * s.wrb, nr * s.wrb);
            } else {
                for i in 0..nr {
                    unpack_row(g, row(i), &mut wbuf[i * ws..(i + 1) * ws]);
                }
            }
            let unpacked = Unpacked {
                w: &wbuf[..],
                ws,
                np: g.np,
            };
            let mut t0 = s.tokens.start;
            while t0 < s.tokens.end {
                let nt = T_MAX.min(s.tokens.end - t0);
                let x = &s.panel[t0 * xs..(t0 + nt) * xs];
                macro_rules! tile {
                    ($r:literal, $t:literal) => {{
                        let acc = if direct && is_k(F) {
                            let raw = RawK::<F, $r>::new(std::array::from_fn(row), g.nb);
                            tile::<F, $r, $t>(&raw, x, xs, g.np, g.nc)
                        } else if direct {
                            let raw = Raw::<F, $r>::new(std::array::from_fn(row), g.nb);
                            tile::<F, $r, $t>(&raw, x, xs, g.np, g.nc)
                        } else {
                            tile::<F, $r, $t>(&unpacked, x, xs, g.np, g.nc)
                        };
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

/// Where a tile's weight vectors come from, as in `avx512`: unpacked rows ([`Unpacked`],
/// prefill) or the ggml blocks ([`Raw`], decode), giving exactly the same vectors.
///
/// The methods are only called from `tile`, which enables every feature they use.
trait WSrc {
    /// Quants of row `r`, pair `k`: both 256-bit halves of the chunk.
    fn q(&self, r: usize, k: usize) -> [__m256i; 2];
    /// Scales of row `r`, pair `k`, for each 256-bit half of its quants (`[d0 x4, d1 x4]` twice
    /// for the 32-element formats, per sub-block for the K-quants).
    fn d(&self, r: usize, k: usize) -> [__m256; 2];
    /// Mins of row `r`, blocks `16 c .. 16 c + 16`, as two halves of 8.
    fn m(&self, r: usize, c: usize) -> [__m256; 2];
}

/// Rows unpacked by `unpack_row`: `w[r * ws ..]`, `np` pairs of 2 chunks then the mins.
struct Unpacked<'a> {
    w: &'a [Chunk],
    ws: usize,
    np: usize,
}

impl WSrc for Unpacked<'_> {
    #[inline(always)]
    fn q(&self, r: usize, k: usize) -> [__m256i; 2] {
        let c = &self.w[r * self.ws + k * 2];
        [ld(c, 0), ld(c, 1)]
    }
    #[inline(always)]
    fn d(&self, r: usize, k: usize) -> [__m256; 2] {
        let c = &self.w[r * self.ws + k * 2 + 1];
        [ldps(c, 0), ldps(c, 1)]
    }
    #[inline(always)]
    fn m(&self, r: usize, c: usize) -> [__m256; 2] {
        let m = &self.w[r * self.ws + self.np * 2 + c];
        [ldps(m, 0), ldps(m, 1)]
    }
}

impl<const F: u8, const R: usize> WSrc for Raw<'_, F, R> {
    #[inline(always)]
    fn q(&self, r: usize, k: usize) -> [__m256i; 2] {
        let (b0, b1) = (2 * k, 2 * k + 1);
        let (lo0, lo1, hi0, hi1) = if b1 < self.nb {
            let (p0, p1) = (self.ptr(r, b0), self.ptr(r, b1));
            // SAFETY: both blocks are in the row (`b1 < nb`, `new` checked the length); the
            // loads read bytes `QO..QO + 32` (Q8_0) or `QO..QO + 16` (Q4) of a `BS`-byte block.
            // SSE2 is baseline.
            unsafe {
                let l0 = _mm_loadu_si128(p0.add(Self::QO).cast());
                let l1 = _mm_loadu_si128(p1.add(Self::QO).cast());
                if F == Q8_0 {
                    let h0 = _mm_loadu_si128(p0.add(Self::QO + 16).cast());
                    let h1 = _mm_loadu_si128(p1.add(Self::QO + 16).cast());
                    (l0, l1, h0, h1)
                } else {
                    (l0, l1, l0, l1)
                }
            }
        } else {
            let (c0, c1) = (self.block(r, b0), self.block(r, b1));
            let (l0, l1) = (ld16(c0, Self::QO), ld16(c1, Self::QO));
            if F == Q8_0 {
                (l0, l1, ld16(c0, Self::QO + 16), ld16(c1, Self::QO + 16))
            } else {
                (l0, l1, l0, l1)
            }
        };
        // SAFETY: only called from `tile`, which enables AVX2.
        unsafe {
            let lo = _mm256_set_m128i(lo1, lo0);
            if F == Q8_0 {
                return [lo, _mm256_set_m128i(hi1, hi0)];
            }
            let m = _mm256_set1_epi8(0x0F);
            let q = [
                _mm256_and_si256(lo, m),
                _mm256_and_si256(_mm256_srli_epi16::<4>(lo), m),
            ];
            if !Self::Q5 {
                return q;
            }
            // The fifth bits: bit j of a block's qh is element j's; the low half holds elements
            // 0..16 of blocks b0, b1, the high half elements 16..32.
            let (h0, h1) = (self.qh(r, b0), self.qh(r, b1));
            [
                _mm256_or_si256(q[0], bits_to_bytes((h0 & 0xFFFF) | h1 << 16)),
                _mm256_or_si256(q[1], bits_to_bytes(h0 >> 16 | (h1 >> 16) << 16)),
            ]
        }
    }
    #[inline(always)]
    fn d(&self, r: usize, k: usize) -> [__m256; 2] {
        let bits =
            h16(self.block(r, 2 * k), 0) as i32 | (h16(self.block(r, 2 * k + 1), 0) as i32) << 16;
        // SAFETY: only called from `tile`, which enables AVX2 and F16C.
        unsafe {
            let d01 = _mm_cvtph_ps(_mm_cvtsi32_si128(bits));
            let idx = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
            let d = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d01), idx);
            [d, d]
        }
    }
    #[inline(always)]
    fn m(&self, r: usize, c: usize) -> [__m256; 2] {
        let mut h = [0u16; 16];
        for (l, v) in h.iter_mut().enumerate() {
            *v = h16(self.block(r, 16 * c + l), 2);
        }
        // SAFETY: `h` is 32 readable bytes; only called from `tile`, which enables F16C/AVX.
        unsafe {
            [
                _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().cast())),
                _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr().add(8).cast())),
            ]
        }
    }
}

impl<const F: u8, const R: usize> WSrc for RawK<'_, F, R> {
    #[inline(always)]
    fn q(&self, r: usize, k: usize) -> [__m256i; 2] {
        let (p, j) = (self.ptr(r, k / 4), k % 4);
        // SAFETY: as in the AVX-512 `RawK::q`: `p` is a whole super-block of the row and every
        // load reads inside it, unaligned. Only called from `tile`, which enables AVX2.
        unsafe {
            let m4 = _mm256_set1_epi8(0x0F);
            if F == Q6_K {
                let (n, odd) = (j / 2, j % 2 == 1);
                let nib = |v: __m256i| {
                    if odd {
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4)
                    } else {
                        _mm256_and_si256(v, m4)
                    }
                };
                let ql0 = _mm256_loadu_si256(p.add(64 * n).cast());
                let ql1 = _mm256_loadu_si256(p.add(64 * n + 32).cast());
                let qh = _mm256_loadu_si256(p.add(128 + 32 * n).cast());
                let sh = 4 * odd as i32;
                let high = |s: i32| {
                    let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(s));
                    _mm256_slli_epi16::<4>(_mm256_and_si256(h, _mm256_set1_epi8(3)))
                };
                return [
                    _mm256_or_si256(nib(ql0), high(sh)),
                    _mm256_or_si256(nib(ql1), high(sh + 2)),
                ];
            }
            let qo = if F == Q5_K { 48 } else { 16 };
            let v = _mm256_loadu_si256(p.add(qo + 32 * j).cast());
            let q = [
                _mm256_and_si256(v, m4),
                _mm256_and_si256(_mm256_srli_epi16::<4>(v), m4),
            ];
            if F != Q5_K {
                return q;
            }
            let qh = _mm256_loadu_si256(p.add(16).cast());
            let bit = |s: i32| {
                let h = _mm256_srl_epi16(qh, _mm_cvtsi32_si128(s));
                _mm256_slli_epi16::<4>(_mm256_and_si256(h, _mm256_set1_epi8(1)))
            };
            let sh = 2 * j as i32;
            [
                _mm256_or_si256(q[0], bit(sh)),
                _mm256_or_si256(q[1], bit(sh + 1)),
            ]
        }
    }
    #[inline(always)]
    fn d(&self, r: usize, k: usize) -> [__m256; 2] {
        let [a, b, c, d] = self.scales(r, k);
        // SAFETY: only called from `tile`, which enables AVX.
        unsafe {
            [
                _mm256_setr_ps(a, a, a, a, b, b, b, b),
                _mm256_setr_ps(c, c, c, c, d, d, d, d),
            ]
        }
    }
    #[inline(always)]
    fn m(&self, r: usize, c: usize) -> [__m256; 2] {
        let m = self.mins(r, c);
        // SAFETY: `m` is 64 readable bytes; only called from `tile`, which enables AVX.
        unsafe {
            [
                _mm256_loadu_ps(m.as_ptr()),
                _mm256_loadu_ps(m.as_ptr().add(8)),
            ]
        }
    }
}

/// 0x10 in byte `i` where bit `i` of `m` is set, else 0 (a Q5 fifth bit per element).
#[inline(always)]
fn bits_to_bytes(m: u32) -> __m256i {
    // SAFETY: only called from `Raw::q`, inlined into `tile`, which enables AVX2.
    unsafe {
        // Byte i takes byte i / 8 of m (each 128-bit lane holds all four), then bit i % 8.
        let v = _mm256_shuffle_epi8(
            _mm256_set1_epi32(m as i32),
            _mm256_setr_epi8(
                0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3,
                3, 3, 3, 3,
            ),
        );
        let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(v, bit), bit);
        _mm256_and_si256(set, _mm256_set1_epi8(0x10))
    }
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
    w: &impl WSrc,
    x: &[Chunk],
    xs: usize,
    np: usize,
    nc: usize,
) -> [[f32; T]; R] {
    let xf = x_chunks(F);
    assert!(x.len() >= T * xs && xs >= np * xf + nc);
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); T]; R];
    for k in 0..np {
        for r in 0..R {
            let wq = w.q(r, k);
            let wd = w.d(r, k);
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
                // The activations' scales are the same in both halves.
                let xd = ldps(&x[xb + 1], 0);
                let d0 = _mm256_mul_ps(wd[0], xd);
                let d = [
                    d0,
                    if is_k(F) {
                        _mm256_mul_ps(wd[1], xd)
                    } else {
                        d0
                    },
                ];
                for h in 0..2 {
                    let xq = ld(&x[xb], h);
                    let xq = if F == Q8_0 {
                        _mm256_sign_epi8(xq, wq[h])
                    } else {
                        xq
                    };
                    let mut lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(wa[h], xq), ones);
                    if offset(F) != 0 {
                        lanes = _mm256_add_epi32(lanes, ld(&x[xb + 2], h));
                    }
                    acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), d[h], acc[r][t]);
                }
            }
        }
    }
    if has_mins(F) {
        for c in 0..nc {
            for r in 0..R {
                let m = w.m(r, c);
                for t in 0..T {
                    let s = &x[t * xs + np * xf + c];
                    for h in 0..2 {
                        acc[r][t] = _mm256_fmadd_ps(m[h], ldps(s, h), acc[r][t]);
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
