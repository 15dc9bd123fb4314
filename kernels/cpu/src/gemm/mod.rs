//! Register-tiled integer matmul for the quantised weight formats: the 32-element ones (Q4_0,
//! Q4_1, Q5_0, Q5_1, Q8_0) and the K-quants (Q4_K, Q5_K, Q6_K).
//!
//! - this file: the kernels' data layout (packed activations: [`Panel`]; unpacked weight rows),
//!   the split of a matmul into pool tasks, and the `DotFn` wrappers that make a single dot
//!   product the 1 x 1 case of the same kernel;
//! - `avx512` (x86_64): AVX-512 VNNI (`vpdpbusd`) micro-kernels, tiles of up to 4 rows x 4
//!   tokens;
//! - `avx2` (x86_64): AVX2 + FMA (`vpmaddubsw`) micro-kernels, tiles of up to 2 rows x 4 tokens;
//! - `amx` (x86_64): AMX int8 tiles (`tdpbusd`, 16 tokens x 16 rows per tile) for matmuls of
//!   at least `amx::MIN_TOKENS` tokens (prefill) of every format but Q6_K, on CPUs that have
//!   them (Sapphire Rapids and later), on by default (`ENGRAM_KERNELS_AMX=0` turns them off);
//! - `float`: f32 weights times f32 activations (no quantisation), AVX2 + FMA tiles.
//! - `packed`: f32 weights packed once into 32-row panels ([`PackedF32`]) times f32
//!   activations, outer-product micro-kernels (AVX-512 F, AVX2 + FMA): [`matmul_packed`].
//!
//! The scalar reference is `dot::scalar`; the property tests below check every ISA's tiled
//! kernel against it over ragged shapes.
//!
//! # Layout
//!
//! Blocks are taken in pairs (`k`): a *chunk* is 64 bytes, one 512-bit register. The quants of
//! blocks `2k` and `2k + 1` are arranged as `[b0[0..16], b1[0..16], b0[16..32], b1[16..32]]`, so
//! a Q4 block's low nibbles (elements 0..16) and high nibbles (16..32) unpack with one shift, and
//! each i32 lane of a `vpdpbusd` sums 4 consecutive elements of one block. Every path computes
//! these *natural lane sums* exactly (offsets are removed in integer arithmetic), then per pair
//! `acc += float(lanes) * (dw * dx)` lane by lane (on AVX-512 the K-quants, whose `dx` is the
//! super-block's, take `part += float(lanes) * dw` over a super-block's 4 pairs and then `acc +=
//! part * dx`: one instruction fewer per pair), adds Q4_1's min term
//! `sum_b m_b * s_b` in 16-lane chunks and sums the lanes in a fixed order. A product is
//! therefore bit-identical whatever tile computed it (a decode step and a prefill give the same
//! bits); it differs from the scalar reference only in float summation order. The AMX tiles
//! take exact per-block dots and sum them block by block (see `amx`): the same bits whatever
//! tile, task split or thread count computed them. Where they run a format, the AVX-512 VNNI
//! kernels take that format in the same *block order* (`Geom::blocks`): they reduce each
//! pair's lane sums to the two blocks' exact dots and add `float(dot) * (dw * dx)` (then `m *
//! s`) block by block, so decode steps and prefills still give the same bits.
//!
//! Per token, a panel holds for each pair `k`: the quants chunk (i8; for the VNNI Q8_0 kernel
//! biased by +128 to u8), a chunk of 16 f32 scales `[d0 x4, d1 x4, d0 x4, d1 x4]`, and for
//! Q4_0 a chunk of 16 i32 corrections `-8 * (lane sum of x)`; then, for Q4_1, the Q8_1 `s`
//! fields of every block as f32 in chunks of 16. Unpacked weight rows mirror it: quants (u8
//! nibbles, or i8 for Q8_0), scales, for VNNI Q8_0 the i32 corrections `-128 * (lane sum of w)`,
//! and for Q4_1 the mins.
//!
//! The other formats reuse these kernels by their arithmetic shape:
//! - Q5_0 and Q6_K are *offset* formats like Q4_0 (unsigned quants minus 16 or 32; the panel
//!   carries `-offset * (lane sum of x)`), Q5_1, Q4_K and Q5_K *min* formats like Q4_1 (unsigned
//!   quants times a scale plus a per-block min, `min_b * s_b` with `s_b = dx * sum(x_b)`);
//! - the K-quants (super-blocks of 256, activations in Q8_K) are taken as 32-element sub-blocks
//!   in their natural order: a chunk is 64 consecutive elements (sub-blocks `2k`, `2k + 1`), and
//!   its scales chunk has one f32 per 4 elements: `d * scale` of the element's sub-block (16
//!   elements in Q6_K, 32 in Q4_K/Q5_K; a product of an f16 and a 6- or 8-bit integer, exact in
//!   f32) on the weight side, the super-block's `d` on the activation side. Q4_K/Q5_K mins are
//!   `-dmin * min` per sub-block, and the panel's `s_b` is `d * (bsums of the sub-block)`.

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub(crate) mod float;
mod packed;
#[cfg(target_arch = "x86_64")]
mod raw;

use std::cell::RefCell;
use std::sync::Mutex;

use crate::blocks::{
    f16_at, f32_at, i16_at, k4_scales_field, k4_scales_mins, q5_values, Q4K_BYTES, Q4_0_BYTES,
    Q4_1_BYTES, Q5K_BYTES, Q5_0_BYTES, Q5_1_BYTES, Q6K_BYTES, Q8K_BYTES, Q8_0_BYTES, Q8_1_BYTES,
    QK,
};
use crate::dot::{DotFn, Isa};
use crate::dtype::GgmlType;
use crate::error::Result;
use crate::pool::ThreadPool;
use crate::quantize::quantize_into;

pub use packed::{matmul_packed, PackedF32};

/// Whether the VNNI kernels of `isa` take format `fmt` in the AMX tiles' block order: where
/// the tiles run that format's prefill-sized matmuls in this process (see `amx::enabled`).
fn amx_order(fmt: u8, isa: Isa) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        isa == Isa::Avx512 && amx::supports(fmt) && amx::enabled()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (fmt, isa);
        false
    }
}

/// Whether prefill-sized matmuls take the AMX tiles in this process (see `amx::enabled`).
#[cfg(target_arch = "x86_64")]
pub(crate) fn amx_enabled() -> bool {
    amx::enabled()
}

/// Format id of Q4_0 weights (const generic parameter of the kernels).
pub(crate) const Q4_0: u8 = 0;
/// Format id of Q4_1 weights.
pub(crate) const Q4_1: u8 = 1;
/// Format id of Q8_0 weights.
pub(crate) const Q8_0: u8 = 2;
/// Format id of Q5_0 weights.
pub(crate) const Q5_0: u8 = 3;
/// Format id of Q5_1 weights.
pub(crate) const Q5_1: u8 = 4;
/// Format id of Q4_K weights.
pub(crate) const Q4_K: u8 = 5;
/// Format id of Q5_K weights.
pub(crate) const Q5_K: u8 = 6;
/// Format id of Q6_K weights.
pub(crate) const Q6_K: u8 = 7;

/// The offset format `f`'s unsigned quants carry (`w = d * (q - offset)`): Q4_0 8, Q5_0 16,
/// Q6_K 32; 0 for the other formats. Offset formats have a corrections chunk per pair in the
/// panel.
pub(crate) const fn offset(f: u8) -> i32 {
    match f {
        Q4_0 => 8,
        Q5_0 => 16,
        Q6_K => 32,
        _ => 0,
    }
}

/// Whether format `f` has per-block mins (`w = d * q + m`): Q4_1, Q5_1, Q4_K, Q5_K.
pub(crate) const fn has_mins(f: u8) -> bool {
    matches!(f, Q4_1 | Q5_1 | Q4_K | Q5_K)
}

/// Whether format `f` is a K-quant (super-blocks of 256 elements, activations in Q8_K).
pub(crate) const fn is_k(f: u8) -> bool {
    matches!(f, Q4_K | Q5_K | Q6_K)
}

/// Chunks per pair in a panel for format `f`: quants and scales, plus the corrections of an
/// offset format.
pub(crate) const fn x_chunks(f: u8) -> usize {
    if offset(f) != 0 {
        3
    } else {
        2
    }
}

/// Rows per pool task. Each task unpacks its rows once per token chunk, so more rows per task
/// means fewer tasks; 32 rows still give >= 18 tasks on the smallest matrices of a 135M model
/// (576 rows), enough to balance 2 to 8 threads.
const ROWS_PER_TASK: usize = 32;

/// Weight bytes a task streams per token chunk, at least (see [`rows_per_task`]). In decode
/// (one token) a task of [`ROWS_PER_TASK`] Q4_1 rows of 576 columns is ~11 KiB, about 1 us,
/// so the ~0.1-0.2 us of claiming it (an atomic on a line shared by all threads) is 10-20% of
/// the work; 24 KiB tasks (64 such rows) halve that, and a layer's fused Q/K/V or gate/up
/// dispatch still has 15 to 48 tasks to balance 2 to 8 threads.
const TASK_BYTES: usize = 24 * 1024;

/// Up to this many tokens (decode steps, small batches) a matrix is split into about
/// [`TASKS_PER_THREAD`] tasks per thread, each a long contiguous run of rows: these matmuls
/// stream the weights from DRAM, and the hardware prefetcher restarts at every task. Going from
/// 24 KiB tasks to 2 per thread took a SmolLM2-135M Q4_1 decode after 512 tokens on 2 threads
/// from 105 to 132 tok/s, and a batched step of 8 sequences from 35 to 31-32 ms (2026-11-24,
/// alternating runs; 1, 3 and 4 tasks per thread measured alike). On many threads the
/// [`TASK_BYTES`] floor decides, as before.
const STREAM_MAX_TOKENS: usize = 16;

/// Tasks per thread for the streaming matmuls (see [`STREAM_MAX_TOKENS`]): 2 rather than 1,
/// so a thread slowed by another tenant hands part of its share to the others.
const TASKS_PER_THREAD: usize = 2;

/// Tokens per pool task (a token chunk). A chunk's packed activations (about 2 bytes per
/// element: 64 tokens x 1536 columns = 196 KiB) stay in L2 while every row tile of the task
/// streams through it, and unpacking a row is amortised over 64 tokens (~3% of the work).
const TOKENS_PER_TASK: usize = 64;

/// One 64-byte, 64-byte-aligned piece of a panel or unpacked weight row: one 512-bit register
/// (two 256-bit ones).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(crate) struct Chunk(pub(crate) [u8; 64]);

impl Chunk {
    const ZERO: Chunk = Chunk([0; 64]);

    fn set_f32(&mut self, lane: usize, v: f32) {
        self.0[4 * lane..4 * lane + 4].copy_from_slice(&v.to_le_bytes());
    }

    fn set_i32(&mut self, lane: usize, v: i32) {
        self.0[4 * lane..4 * lane + 4].copy_from_slice(&v.to_le_bytes());
    }
}

/// Geometry of the packed layouts for one matrix width and format.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Geom {
    /// Format id (`Q4_0` ... `Q6_K`).
    pub(crate) fmt: u8,
    /// Blocks per row (32-element sub-blocks for the K-quants).
    pub(crate) nb: usize,
    /// Block pairs per row.
    pub(crate) np: usize,
    /// 16-block chunks of mins / sums (0 for formats without mins).
    pub(crate) nc: usize,
    /// Chunks per pair in a panel.
    pub(crate) xf: usize,
    /// Chunks per pair in an unpacked weight row.
    pub(crate) wf: usize,
    /// Whether the panel's Q8_0 quants are biased to u8 (+128) and weights carry corrections.
    pub(crate) q8_bias: bool,
    /// Whether the VNNI kernels sum in the AMX tiles' block order (see `amx`): set where the
    /// tiles run this format, so that every matmul of it gives the same bits.
    pub(crate) blocks: bool,
}

impl Geom {
    pub(crate) fn new(fmt: u8, cols: usize, isa: Isa) -> Geom {
        let nb = cols / QK;
        let q8_bias = fmt == Q8_0 && isa.has_vnni();
        Geom {
            fmt,
            nb,
            np: nb.div_ceil(2),
            nc: if has_mins(fmt) { nb.div_ceil(16) } else { 0 },
            xf: x_chunks(fmt),
            wf: if q8_bias { 3 } else { 2 },
            q8_bias,
            blocks: amx_order(fmt, isa),
        }
    }

    /// Chunks per token in a panel.
    pub(crate) fn xstride(&self) -> usize {
        self.np * self.xf + self.nc
    }

    /// Chunks per unpacked weight row.
    pub(crate) fn wstride(&self) -> usize {
        self.np * self.wf + self.nc
    }

    /// Bytes per block of the 32-element weight formats and the offset of their 16 (Q4, Q5: the
    /// Q5 fifth bits are the 4 bytes before) or 32 (Q8_0) quant bytes.
    fn wblock(&self) -> (usize, usize) {
        match self.fmt {
            Q4_0 => (Q4_0_BYTES, 2),
            Q4_1 => (Q4_1_BYTES, 4),
            Q5_0 => (Q5_0_BYTES, 6),
            Q5_1 => (Q5_1_BYTES, 8),
            _ => (Q8_0_BYTES, 2),
        }
    }

    /// Bytes per block of the 32-element vec-dot types and the offset of their quants.
    fn xblock(&self) -> (usize, usize) {
        if has_mins(self.fmt) {
            (Q8_1_BYTES, 4)
        } else {
            (Q8_0_BYTES, 2)
        }
    }
}

/// The kernel format of weights of type `ty`, if they have a tiled kernel.
pub(crate) fn fmt_of(ty: GgmlType) -> Option<u8> {
    match ty {
        GgmlType::Q4_0 => Some(Q4_0),
        GgmlType::Q4_1 => Some(Q4_1),
        GgmlType::Q8_0 => Some(Q8_0),
        GgmlType::Q5_0 => Some(Q5_0),
        GgmlType::Q5_1 => Some(Q5_1),
        GgmlType::Q4K => Some(Q4_K),
        GgmlType::Q5K => Some(Q5_K),
        GgmlType::Q6K => Some(Q6_K),
        _ => None,
    }
}

/// The type of the activations format `f` multiplies (its weights' vec-dot type).
fn vec_dot_type(f: u8) -> GgmlType {
    if is_k(f) {
        GgmlType::Q8K
    } else if has_mins(f) {
        GgmlType::Q8_1
    } else {
        GgmlType::Q8_0
    }
}

/// Scales chunk `[d0 x4, d1 x4, d0 x4, d1 x4]` of pair `k`; `d(b)` reads block `b`'s scale.
// The chunk builders below are inlined, so in `unpack_row` (called from the ISA files'
// `#[target_feature]` functions) they are compiled for that ISA: out of line, as generic
// x86-64 code, they were 19% of a batched decode step and about 10% of prefill.
#[inline(always)]
fn scales_chunk(g: &Geom, k: usize, d: impl Fn(usize) -> f32) -> Chunk {
    let mut c = Chunk::ZERO;
    for half in 0..2 {
        let b = 2 * k + half;
        let v = if b < g.nb { d(b) } else { 0.0 };
        for l in 0..4 {
            c.set_f32(4 * half + l, v);
            c.set_f32(8 + 4 * half + l, v);
        }
    }
    c
}

/// Arranges the 32 quants of blocks `2k`, `2k + 1` (`q(b)`) as a chunk (absent block: zeros).
#[inline(always)]
fn quants_chunk<'a>(g: &Geom, k: usize, q: impl Fn(usize) -> &'a [u8]) -> Chunk {
    let mut c = Chunk::ZERO;
    for half in 0..2 {
        let b = 2 * k + half;
        if b < g.nb {
            let qs = q(b);
            c.0[16 * half..16 * half + 16].copy_from_slice(&qs[..16]);
            c.0[32 + 16 * half..32 + 16 * half + 16].copy_from_slice(&qs[16..32]);
        }
    }
    c
}

/// One value per block (`v(b)`, Q4_1's mins or Q8_1's sums) for blocks `16c..16c + 16`, as f32
/// lanes (absent block: 0).
#[inline(always)]
fn per_block_chunk(g: &Geom, c: usize, v: impl Fn(usize) -> f32) -> Chunk {
    let mut ch = Chunk::ZERO;
    for l in 0..16 {
        let b = 16 * c + l;
        if b < g.nb {
            ch.set_f32(l, v(b));
        }
    }
    ch
}

/// i32 lanes `scale * (sum of the 4 signed bytes of each lane of c)`.
#[inline(always)]
fn lane_sums_chunk(c: &Chunk, scale: i32) -> Chunk {
    let mut out = Chunk::ZERO;
    for l in 0..16 {
        let s: i32 = c.0[4 * l..4 * l + 4].iter().map(|&v| v as i8 as i32).sum();
        out.set_i32(l, scale * s);
    }
    out
}

/// Packs one token's activations, already quantised to the vec-dot type (ggml layout, `xq`),
/// into `out` (`g.xstride()` chunks).
pub(crate) fn pack_token(g: &Geom, xq: &[u8], out: &mut [Chunk]) {
    if is_k(g.fmt) {
        return pack_token_k(g, xq, out);
    }
    let (bs, qo) = g.xblock();
    let block = |b: usize| &xq[b * bs..(b + 1) * bs];
    for k in 0..g.np {
        let mut q = quants_chunk(g, k, |b| &block(b)[qo..]);
        let base = k * g.xf;
        if offset(g.fmt) != 0 {
            out[base + 2] = lane_sums_chunk(&q, -offset(g.fmt));
        }
        if g.q8_bias {
            for v in &mut q.0 {
                *v ^= 0x80; // i8 -> u8 + 128
            }
        }
        out[base] = q;
        out[base + 1] = scales_chunk(g, k, |b| f16_at(block(b), 0));
    }
    for c in 0..g.nc {
        out[g.np * g.xf + c] = per_block_chunk(g, c, |b| f16_at(block(b), 2));
    }
}

/// [`pack_token`] for the K-quants: `xq` is Q8_K (super-blocks of 256: `d: f32`, 256 quants,
/// 16 i16 sums of 16), taken 64 elements (a pair of sub-blocks) per chunk in natural order.
fn pack_token_k(g: &Geom, xq: &[u8], out: &mut [Chunk]) {
    let sblock = |k: usize| &xq[k / 4 * Q8K_BYTES..(k / 4 + 1) * Q8K_BYTES];
    for k in 0..g.np {
        let sb = sblock(k);
        let start = 4 + 64 * (k % 4);
        let mut q = Chunk::ZERO;
        q.0.copy_from_slice(&sb[start..start + 64]);
        let base = k * g.xf;
        if offset(g.fmt) != 0 {
            out[base + 2] = lane_sums_chunk(&q, -offset(g.fmt));
        }
        out[base] = q;
        let mut d = Chunk::ZERO;
        let dx = f32_at(sb, 0);
        for l in 0..16 {
            d.set_f32(l, dx);
        }
        out[base + 1] = d;
    }
    for c in 0..g.nc {
        out[g.np * g.xf + c] = per_block_chunk(g, c, |b| {
            let sb = sblock(b / 2);
            let sums = 4 + 256 + 4 * (b % 8);
            f32_at(sb, 0) * (i16_at(sb, sums) as i32 + i16_at(sb, sums + 2) as i32) as f32
        });
    }
}

/// Unpacks one weight row (ggml layout) into `out` (`g.wstride()` chunks). Portable code: it
/// runs once per row and token chunk, and the ISA files call it from `#[target_feature]`
/// functions, where it is vectorised for that ISA.
#[inline(always)]
pub(crate) fn unpack_row(g: &Geom, w: &[u8], out: &mut [Chunk]) {
    if is_k(g.fmt) {
        return unpack_row_k(g, w, out);
    }
    let (bs, qo) = g.wblock();
    let block = |b: usize| &w[b * bs..(b + 1) * bs];
    for k in 0..g.np {
        let base = k * g.wf;
        if g.fmt == Q8_0 {
            let q = quants_chunk(g, k, |b| &block(b)[qo..]);
            if g.q8_bias {
                out[base + 2] = lane_sums_chunk(&q, -128);
            }
            out[base] = q;
        } else {
            // Nibbles: qs[j] holds element j (low) and j + 16 (high); Q5 adds bit j of qh.
            let mut q = Chunk::ZERO;
            for half in 0..2 {
                let b = 2 * k + half;
                if b < g.nb {
                    let qs = &block(b)[qo..qo + 16];
                    let v = if matches!(g.fmt, Q5_0 | Q5_1) {
                        q5_values(&block(b)[qo - 4..qo], qs)
                    } else {
                        let mut v = [0u8; QK];
                        for (j, &x) in qs.iter().enumerate() {
                            v[j] = x & 0x0F;
                            v[j + 16] = x >> 4;
                        }
                        v
                    };
                    q.0[16 * half..16 * half + 16].copy_from_slice(&v[..16]);
                    q.0[32 + 16 * half..32 + 16 * half + 16].copy_from_slice(&v[16..]);
                }
            }
            out[base] = q;
        }
        out[base + 1] = scales_chunk(g, k, |b| f16_at(block(b), 0));
    }
    for c in 0..g.nc {
        out[g.np * g.wf + c] = per_block_chunk(g, c, |b| f16_at(block(b), 2));
    }
}

/// One K-quant super-block in the kernels' terms: its 256 unsigned quants in natural order, the
/// scale of every 16 elements (`d * scale`) and the min of every 32 (`-dmin * min`; zero for
/// Q6_K).
struct KBlock {
    q: [u8; 256],
    scales: [f32; 16],
    mins: [f32; 8],
}

/// Decodes super-block `b` (`BYTES` long) of format `fmt`.
#[inline(always)]
fn k_block(fmt: u8, b: &[u8]) -> KBlock {
    let mut kb = KBlock {
        q: [0; 256],
        scales: [0.0; 16],
        mins: [0.0; 8],
    };
    if fmt == Q6_K {
        let b: &[u8; Q6K_BYTES] = b.try_into().expect("a Q6_K block");
        let d = f16_at(b, 208);
        for half in 0..2 {
            let ql = &b[64 * half..64 * half + 64];
            let qh = &b[128 + 32 * half..128 + 32 * half + 32];
            let q = &mut kb.q[128 * half..128 * half + 128];
            for l in 0..32 {
                let h = qh[l];
                q[l] = (ql[l] & 0x0F) | ((h & 3) << 4);
                q[l + 32] = (ql[l + 32] & 0x0F) | (((h >> 2) & 3) << 4);
                q[l + 64] = (ql[l] >> 4) | (((h >> 4) & 3) << 4);
                q[l + 96] = (ql[l + 32] >> 4) | (((h >> 6) & 3) << 4);
            }
        }
        for (i, s) in kb.scales.iter_mut().enumerate() {
            *s = d * (b[192 + i] as i8) as f32;
        }
        return kb;
    }
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let (sc, mn) = k4_scales_mins(k4_scales_field(b));
    let (qh, qs) = if fmt == Q5_K {
        (Some(&b[16..48]), &b[48..Q5K_BYTES])
    } else {
        (None, &b[16..Q4K_BYTES])
    };
    for k in 0..4 {
        for l in 0..32 {
            let v = qs[32 * k + l];
            let (mut lo, mut hi) = (v & 0x0F, v >> 4);
            if let Some(qh) = qh {
                lo |= ((qh[l] >> (2 * k)) & 1) << 4;
                hi |= ((qh[l] >> (2 * k + 1)) & 1) << 4;
            }
            kb.q[64 * k + l] = lo;
            kb.q[64 * k + 32 + l] = hi;
        }
    }
    for j in 0..8 {
        let s = d * sc[j] as f32;
        kb.scales[2 * j] = s;
        kb.scales[2 * j + 1] = s;
        kb.mins[j] = -(dmin * mn[j] as f32);
    }
    kb
}

/// [`unpack_row`] for the K-quants (see the module docs' layout).
#[inline(always)]
fn unpack_row_k(g: &Geom, w: &[u8], out: &mut [Chunk]) {
    let bs = match g.fmt {
        Q4_K => Q4K_BYTES,
        Q5_K => Q5K_BYTES,
        _ => Q6K_BYTES,
    };
    for c in 0..g.nc {
        out[g.np * g.wf + c] = Chunk::ZERO;
    }
    for (sbi, b) in w.chunks_exact(bs).enumerate() {
        let kb = k_block(g.fmt, b);
        for j in 0..4 {
            let k = 4 * sbi + j;
            let base = k * g.wf;
            out[base].0.copy_from_slice(&kb.q[64 * j..64 * j + 64]);
            let mut d = Chunk::ZERO;
            for l in 0..16 {
                d.set_f32(l, kb.scales[4 * j + l / 4]);
            }
            out[base + 1] = d;
        }
        if g.nc > 0 {
            for (j, &m) in kb.mins.iter().enumerate() {
                let b = 8 * sbi + j;
                out[g.np * g.wf + b / 16].set_f32(b % 16, m);
            }
        }
    }
}

/// Where a task writes its results: `out[t * rows + r]`, shared by all tasks of a matmul.
#[derive(Clone, Copy)]
pub(crate) struct OutPtr {
    ptr: *mut f32,
    rows: usize,
    len: usize,
}

// SAFETY: an `OutPtr` is only used by the tasks of one `matmul_tiled` call, which write disjoint
// (row, token) cells (see `OutPtr::write`) while the call holds the `&mut [f32]` it came from.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The cells of `out`, `rows` per token.
    pub(crate) fn new(out: &mut [f32], rows: usize) -> OutPtr {
        OutPtr {
            ptr: out.as_mut_ptr(),
            rows,
            len: out.len(),
        }
    }

    /// Writes `v` as the result of row `r`, token `t`.
    ///
    /// # Safety
    ///
    /// No other thread may access cell `(r, t)` during the call; `r < rows` and the cell lies
    /// inside the buffer (checked).
    pub(crate) unsafe fn write(&self, r: usize, t: usize, v: f32) {
        let i = t * self.rows + r;
        assert!(
            r < self.rows && i < self.len,
            "output cell ({r}, {t}) out of range"
        );
        // SAFETY: `i` is in bounds (asserted) and the caller guarantees exclusive access.
        unsafe { *self.ptr.add(i) = v };
    }

    /// Writes `v` as the results of rows `r0..r0 + v.len()`, token `t`.
    ///
    /// # Safety
    ///
    /// No other thread may access those cells during the call; they lie in row range and
    /// inside the buffer (checked).
    pub(crate) unsafe fn write_run(&self, r0: usize, t: usize, v: &[f32]) {
        let i = t * self.rows + r0;
        assert!(
            r0 + v.len() <= self.rows && i + v.len() <= self.len,
            "output cells ({r0}.., {t}) out of range"
        );
        // SAFETY: `i..i + v.len()` is in bounds (asserted) and the caller guarantees exclusive
        // access; `v` cannot overlap the output, which no one else may reference.
        unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), self.ptr.add(i), v.len()) };
    }
}

/// The work of one task: rows `r0..r1` of the weights against tokens `t0..t1` of the panel.
pub(crate) struct Span<'a> {
    pub(crate) g: Geom,
    /// The whole weight matrix (ggml layout) and its row size in bytes.
    pub(crate) w: &'a [u8],
    pub(crate) wrb: usize,
    pub(crate) rows: std::ops::Range<usize>,
    /// The whole panel.
    pub(crate) panel: &'a [Chunk],
    pub(crate) tokens: std::ops::Range<usize>,
}

thread_local! {
    /// Per-thread buffer for unpacked weight rows (a few KiB: one row tile).
    static WBUF: RefCell<Vec<Chunk>> = const { RefCell::new(Vec::new()) };
    /// Per-thread buffer for one token's ggml-layout quantised activations.
    static XQ: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` with a zeroed per-thread buffer of `n` chunks.
pub(crate) fn with_wbuf<R>(n: usize, f: impl FnOnce(&mut [Chunk]) -> R) -> R {
    WBUF.with(|b| {
        let mut b = b.borrow_mut();
        if b.len() < n {
            b.resize(n, Chunk::ZERO);
        }
        f(&mut b[..n])
    })
}

/// Computes one span on `isa` (which must have a tiled kernel) into `out`.
fn run_span(isa: Isa, s: &Span<'_>, out: OutPtr) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx512::run_span::<true>(s, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bw => avx512::run_span::<false>(s, out),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::run_span(s, out),
        Isa::Scalar => unreachable!("no tiled kernel for the scalar ISA"),
    }
}

/// Whether `isa` has tiled kernels (else `matmul` uses the per-pair dot products).
pub(crate) fn has_tiled(isa: Isa) -> bool {
    isa != Isa::Scalar
}

/// `out[t * rows + r] = dot(w row r, x token t)` with the tiled kernels of `isa`, on `pool`.
/// Lengths were checked by the caller; `fmt` is `w`'s format id.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_tiled(
    isa: Isa,
    fmt: u8,
    w: &[u8],
    rows: usize,
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &ThreadPool,
) -> Result<()> {
    matmul_tiled_many(
        isa,
        fmt,
        &[(w, rows)],
        cols,
        x,
        n_tokens,
        &mut [out],
        pool,
        true,
    )
}

/// [`matmul_tiled`] for several matrices of the same format and width sharing the input `x`
/// (`ws[i] = (data, rows)`, results in `outs[i]`): the activations are quantised and packed
/// once, and every matrix's tasks run in one pool dispatch. Each result is bit-identical to
/// what `matmul_tiled` computes for that matrix alone (same tiles, same spans). With `amx`
/// false the AMX tiles are never taken and the register tiles sum in their natural order even
/// where the tiles run `fmt` (the results of a process without AMX).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_tiled_many(
    isa: Isa,
    fmt: u8,
    ws: &[(&[u8], usize)],
    cols: usize,
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &ThreadPool,
    amx: bool,
) -> Result<()> {
    assert_eq!(ws.len(), outs.len(), "one output per matrix");
    let mut g = Geom::new(fmt, cols, isa);
    g.blocks &= amx;
    let vd = vec_dot_type(fmt);
    let xrb = vd.checked_row_bytes(cols, "matmul cols")?;
    // `g.blocks`: the tiles run this format in this process (`amx_order`).
    #[cfg(target_arch = "x86_64")]
    if g.blocks && n_tokens >= amx::MIN_TOKENS {
        return matmul_amx(g, xrb, ws, x, n_tokens, outs, pool);
    }
    matmul_panel(isa, g, xrb, ws, x, n_tokens, outs, pool)
}

/// [`matmul_tiled_many`] on `isa`'s register tiles, with geometry `g` (`xrb`: bytes per
/// quantised activation row).
#[allow(clippy::too_many_arguments)]
fn matmul_panel(
    isa: Isa,
    g: Geom,
    xrb: usize,
    ws: &[(&[u8], usize)],
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &ThreadPool,
) -> Result<()> {
    let vd = vec_dot_type(g.fmt);
    let cols = g.nb * QK;
    let xs = g.xstride();
    let mut panel = vec![Chunk::ZERO; xs * n_tokens];

    // Quantise and pack the activations, in parallel over token groups (one token, as in
    // decode, is a single group, which `run` executes inline on the caller).
    {
        let pp = OutPtrChunks(panel.as_mut_ptr(), panel.len());
        quantize_tokens(vd, xrb, x, cols, n_tokens, pool, |_, t, xq| {
            // SAFETY: token groups are disjoint, so this token's chunks are written by this
            // task only, and `panel` outlives the `run` call.
            let dst = unsafe { pp.slice(t * xs, xs) };
            pack_token(&g, xq, dst);
        })?;
    }

    let tc = if n_tokens <= TOKENS_PER_TASK {
        n_tokens
    } else {
        TOKENS_PER_TASK
    };
    let n_tc = n_tokens.div_ceil(tc);
    // Per matrix: its geometry, output and the index of its first task.
    let mut jobs = Vec::with_capacity(ws.len());
    let mut n_tasks = 0;
    for (&(w, rows), out) in ws.iter().zip(outs.iter_mut()) {
        if rows == 0 {
            continue;
        }
        let wrb = w.len() / rows;
        let rpt = rows_per_task(wrb, tc, rows, pool.n_threads());
        let n_rb = rows.div_ceil(rpt);
        let optr = OutPtr {
            ptr: out.as_mut_ptr(),
            rows,
            len: out.len(),
        };
        jobs.push((n_tasks, w, wrb, rows, rpt, n_rb, optr));
        n_tasks += n_rb * n_tc;
    }
    let panel = &panel[..];
    let jobs = &jobs[..];
    pool.run(n_tasks, |task| {
        let j = jobs.partition_point(|job| job.0 <= task) - 1;
        let (first, w, wrb, rows, rpt, n_rb, optr) = jobs[j];
        let task = task - first;
        // Row-block major: neighbouring tasks share a token chunk, which stays in L3/L2.
        let (tci, rbi) = (task / n_rb, task % n_rb);
        let span = Span {
            g,
            w,
            wrb,
            rows: rbi * rpt..((rbi + 1) * rpt).min(rows),
            panel,
            tokens: tci * tc..((tci + 1) * tc).min(n_tokens),
        };
        run_span(isa, &span, optr);
    });
    Ok(())
}

/// [`matmul_tiled_many`] on the AMX tiles (see `amx`): the activations are quantised and
/// packed once, then every matrix is split into tasks of [`amx::ROWS_PER_TASK`] rows x
/// [`amx::TOKENS_PER_TASK`] tokens.
#[cfg(target_arch = "x86_64")]
fn matmul_amx(
    g: Geom,
    xrb: usize,
    ws: &[(&[u8], usize)],
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &ThreadPool,
) -> Result<()> {
    let cols = g.nb * QK;
    let mut acts = amx::Acts::new(&g, n_tokens);
    {
        let per = tokens_per_group(n_tokens, pool);
        let pieces: Vec<_> = acts.pieces(per).into_iter().map(Mutex::new).collect();
        quantize_tokens(
            vec_dot_type(g.fmt),
            xrb,
            x,
            cols,
            n_tokens,
            pool,
            |gi, t, xq| {
                let mut piece = pieces[gi].lock().unwrap_or_else(|p| p.into_inner());
                piece.pack(&g, t - gi * per, xq);
            },
        )?;
    }

    let rpt = amx::ROWS_PER_TASK;
    let row_blocks: usize = ws.iter().map(|&(_, rows)| rows.div_ceil(rpt)).sum();
    let mut tc = n_tokens.min(amx::TOKENS_PER_TASK);
    while row_blocks * n_tokens.div_ceil(tc) < amx::MIN_TASKS_PER_THREAD * pool.n_threads()
        && tc >= 2 * amx::MIN_TOKENS
    {
        tc = (tc / 2).next_multiple_of(16);
    }
    let n_tc = n_tokens.div_ceil(tc);
    let mut jobs = Vec::with_capacity(ws.len());
    let mut n_tasks = 0;
    for (&(w, rows), out) in ws.iter().zip(outs.iter_mut()) {
        if rows == 0 {
            continue;
        }
        let n_rb = rows.div_ceil(rpt);
        jobs.push((
            n_tasks,
            w,
            w.len() / rows,
            rows,
            n_rb,
            OutPtr::new(out, rows),
        ));
        n_tasks += n_rb * n_tc;
    }
    let (acts, jobs) = (&acts, &jobs[..]);
    pool.run(n_tasks, |task| {
        let j = jobs.partition_point(|job| job.0 <= task) - 1;
        let (first, w, wrb, rows, n_rb, optr) = jobs[j];
        let task = task - first;
        let (tci, rbi) = (task / n_rb, task % n_rb);
        let span = amx::AmxSpan {
            g,
            w,
            wrb,
            rows: rbi * rpt..((rbi + 1) * rpt).min(rows),
            acts,
            tokens: tci * tc..((tci + 1) * tc).min(n_tokens),
        };
        amx::run_span(&span, optr);
    });
    Ok(())
}

/// Tokens per group when the activations are quantised in parallel: one group per thread.
fn tokens_per_group(n_tokens: usize, pool: &ThreadPool) -> usize {
    n_tokens.div_ceil(pool.n_threads()).max(1)
}

/// Quantises each token of `x` (`cols` values each) to the vec-dot type `vd` (`xrb` bytes a
/// token), in parallel over groups of [`tokens_per_group`] tokens, and hands group `gi`,
/// token `t` and its quantised row to `pack(gi, t, xq)`. The first quantisation error, if any,
/// is returned after every group has run.
#[allow(clippy::too_many_arguments)]
fn quantize_tokens(
    vd: GgmlType,
    xrb: usize,
    x: &[f32],
    cols: usize,
    n_tokens: usize,
    pool: &ThreadPool,
    pack: impl Fn(usize, usize, &[u8]) + Sync,
) -> Result<()> {
    let per = tokens_per_group(n_tokens, pool);
    let err = Mutex::new(None);
    pool.run(n_tokens.div_ceil(per), |gi| {
        XQ.with(|b| {
            let mut xq = b.borrow_mut();
            xq.resize(xrb, 0);
            for t in gi * per..((gi + 1) * per).min(n_tokens) {
                if let Err(e) = quantize_into(vd, &x[t * cols..(t + 1) * cols], &mut xq) {
                    *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    return;
                }
                pack(gi, t, &xq);
            }
        });
    });
    match err.into_inner().unwrap_or_else(|p| p.into_inner()) {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Rows per task for rows of `wrb` bytes and token chunks of `tc` tokens: at least
/// [`ROWS_PER_TASK`], more (in multiples of 4, the register tile) when few tokens make a task
/// short, so that a task streams about [`TASK_BYTES`] of weights; for at most
/// [`STREAM_MAX_TOKENS`] tokens, also at least a `1 / (threads * TASKS_PER_THREAD)` share of
/// the `rows`.
fn rows_per_task(wrb: usize, tc: usize, rows: usize, threads: usize) -> usize {
    let by_bytes = TASK_BYTES / wrb.saturating_mul(tc).max(1) / 4 * 4;
    let by_threads = if tc <= STREAM_MAX_TOKENS {
        rows.div_ceil(threads.max(1) * TASKS_PER_THREAD)
            .next_multiple_of(4)
    } else {
        0
    };
    by_bytes.max(ROWS_PER_TASK).max(by_threads)
}

/// A raw pointer to a panel under construction, shared by the packing tasks.
#[derive(Clone, Copy)]
struct OutPtrChunks(*mut Chunk, usize);

// SAFETY: used only inside one `pool.run` whose tasks write disjoint token ranges.
unsafe impl Send for OutPtrChunks {}
// SAFETY: as above.
unsafe impl Sync for OutPtrChunks {}

impl OutPtrChunks {
    /// # Safety
    ///
    /// No other live reference may overlap `start..start + len`; the range is checked to lie
    /// in the buffer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, start: usize, len: usize) -> &mut [Chunk] {
        assert!(start + len <= self.1, "panel range out of bounds");
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(start), len) }
    }
}

/// One dot product through the tiled kernel (the 1 x 1 tile): `w` and `xq` are one weight row
/// and one quantised activation row in ggml layout. Slow (it packs both), but bit-identical to
/// what `matmul` computes for that pair on the same ISA.
fn dot_tiled(isa: Isa, ty: GgmlType, w: &[u8], xq: &[u8]) -> f32 {
    let fmt = fmt_of(ty).expect("a tiled format");
    let cols = w.len() / ty.type_size() * ty.block_size();
    let g = Geom::new(fmt, cols, isa);
    let mut panel = vec![Chunk::ZERO; g.xstride()];
    pack_token(&g, xq, &mut panel);
    let mut out = [0f32];
    let optr = OutPtr {
        ptr: out.as_mut_ptr(),
        rows: 1,
        len: 1,
    };
    let span = Span {
        g,
        w,
        wrb: w.len(),
        rows: 0..1,
        panel: &panel,
        tokens: 0..1,
    };
    run_span(isa, &span, optr);
    out[0]
}

/// The `DotFn` of `isa`'s tiled kernel for `ty`, if there is one.
pub(crate) fn dot_fn(isa: Isa, ty: GgmlType) -> Option<DotFn> {
    if ty == GgmlType::F32 {
        return float::dot_fn(isa);
    }
    fmt_of(ty)?;
    // One function per (ISA, type): a `DotFn` is a plain `fn` pointer.
    macro_rules! f {
        ($isa:expr) => {
            f!($isa; Q4_0, Q4_1, Q8_0, Q5_0, Q5_1, Q4K, Q5K, Q6K)
        };
        ($isa:expr; $($ty:ident),*) => {
            match ty {
                $(GgmlType::$ty => {
                    fn dot(w: &[u8], x: &[u8]) -> f32 {
                        dot_tiled($isa, GgmlType::$ty, w, x)
                    }
                    Some(dot as DotFn)
                })*
                _ => None,
            }
        };
    }
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => f!(Isa::Avx512),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Bw => f!(Isa::Avx512Bw),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => f!(Isa::Avx2),
        Isa::Scalar => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::tests::random_row;
    use crate::quantize::quantize_activations;
    use proptest::prelude::*;

    const FMTS: [GgmlType; 8] = [
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q8_0,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
    ];

    /// Decode splits a matrix into about `TASKS_PER_THREAD` contiguous tasks per thread on few
    /// threads, keeps the byte floor on many, and prefill's token chunks are unaffected.
    #[test]
    fn rows_per_task_split() {
        // SmolLM2-135M Q4_1: 576 columns are 360 bytes per row.
        let wrb = 360;
        let rpt = rows_per_task(wrb, 1, 1536, 2);
        assert_eq!((rpt, 1536usize.div_ceil(rpt)), (384, 4));
        assert_eq!(rows_per_task(wrb, 1, 1536, 64), TASK_BYTES / wrb / 4 * 4);
        assert_eq!(rows_per_task(wrb, 64, 1536, 2), ROWS_PER_TASK);
        assert_eq!(rpt % 4, 0);
        assert_eq!(rows_per_task(wrb, 1, 1, 2) % 4, 0);
    }

    /// The width for `blocks` blocks of `ty` (super-blocks of 256 for the K-quants, a third
    /// as many) and `rows` weight rows of it, each a rotation of `bytes`.
    fn ragged_weights(ty: GgmlType, rows: usize, blocks: usize, bytes: &[u8]) -> (usize, Vec<u8>) {
        let cols = if ty.block_size() == QK {
            blocks * QK
        } else {
            blocks.div_ceil(3) * 256
        };
        let w = (0..rows)
            .flat_map(|r| {
                let rot: Vec<u8> = bytes
                    .iter()
                    .cycle()
                    .skip(r * 7)
                    .take(bytes.len())
                    .copied()
                    .collect();
                random_row(ty, cols, &rot)
            })
            .collect();
        (cols, w)
    }

    /// Checks a matmul's `out` (`[token][row]`) against the scalar dot product: integer sums
    /// are exact and only the float combination differs, so each result must be within 1e-6
    /// of `sum |w_i x_i|` (a few ulps of the largest partial sum).
    fn check_against_scalar(
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        x: &[f32],
        out: &[f32],
        what: &str,
    ) -> std::result::Result<(), TestCaseError> {
        let (cols, wrb) = (x.len() / (out.len() / rows), w.len() / rows);
        let scalar = Isa::Scalar.dot_fn(ty).unwrap();
        let (mut xq, mut wf) = (Vec::new(), vec![0f32; cols]);
        for (t, xt) in x.chunks_exact(cols).enumerate() {
            quantize_activations(ty, xt, &mut xq).unwrap();
            for r in 0..rows {
                let wr = &w[r * wrb..(r + 1) * wrb];
                let (got, reference) = (out[t * rows + r], scalar(wr, &xq));
                crate::dequant::dequantize_row(ty, wr, &mut wf).unwrap();
                let scale: f32 = wf.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                prop_assert!(
                    (got - reference).abs() <= 1e-6 * (1.0 + scale),
                    "{ty} {what} r={r} t={t}: {got} vs scalar {reference}"
                );
            }
        }
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Every tiled ISA, over ragged shapes (rows and tokens not multiples of the tile, odd
        /// block counts), matches the scalar dot product within float-order tolerance, and
        /// equals its own 1 x 1 dot bit for bit.
        #[test]
        fn tiled_matmul_matches_scalar(
            ty_idx in 0..FMTS.len(),
            rows in 1usize..40,
            // Blocks of 32, or super-blocks of 256 for the K-quants.
            blocks in 1usize..12,
            // Past 16 tokens a task leaves the direct (decode) path for unpacked rows.
            n_tokens in 1usize..24,
            bytes in prop::collection::vec(any::<u8>(), 64..512),
            xs in prop::collection::vec(-4.0f32..4.0, 23 * 1024),
            threads in 1usize..4,
        ) {
            let ty = FMTS[ty_idx];
            let (cols, w) = ragged_weights(ty, rows, blocks, &bytes);
            let wrb = w.len() / rows;
            let x = &xs[..n_tokens * cols];
            let pool = ThreadPool::new(threads).unwrap();
            let mut xq = Vec::new();
            for isa in Isa::available().into_iter().filter(|&i| has_tiled(i)) {
                let mut out = vec![f32::NAN; rows * n_tokens];
                matmul_tiled(isa, fmt_of(ty).unwrap(), &w, rows, cols, x, n_tokens, &mut out,
                    &pool).unwrap();
                check_against_scalar(ty, &w, rows, x, &out, &format!("{isa:?}"))?;
                let one = dot_fn(isa, ty).unwrap();
                for t in 0..n_tokens {
                    quantize_activations(ty, &x[t * cols..(t + 1) * cols], &mut xq).unwrap();
                    for r in 0..rows {
                        let wr = &w[r * wrb..(r + 1) * wrb];
                        prop_assert_eq!(out[t * rows + r].to_bits(), one(wr, &xq).to_bits(),
                            "{} {:?} tile vs 1x1", ty, isa);
                    }
                }
            }
        }

        /// The AMX tiles (where this CPU has them), over ragged shapes past `amx::MIN_TOKENS`
        /// tokens: every format they take matches the scalar dot product within float-order
        /// tolerance, and a token's results have the same bits whatever the thread count and
        /// whichever other tokens share the call.
        #[cfg(target_arch = "x86_64")]
        #[test]
        fn amx_matmul_matches_scalar(
            ty_idx in 0..FMTS.len() - 1,
            rows in 1usize..40,
            blocks in 1usize..12,
            n_tokens in amx::MIN_TOKENS..amx::MIN_TOKENS + 40,
            bytes in prop::collection::vec(any::<u8>(), 64..512),
            xs in prop::collection::vec(-4.0f32..4.0, 80 * 1024),
            threads in 1usize..4,
        ) {
            if !amx::usable() {
                eprintln!("no AMX here: amx_matmul_matches_scalar checks nothing");
                return Ok(());
            }
            let ty = FMTS[ty_idx];
            let fmt = fmt_of(ty).unwrap();
            // The AMX path directly: `matmul_tiled` takes it only when it is enabled.
            let amx = |w: &[u8], rows, cols, x: &[f32], n, out: &mut [f32], pool: &ThreadPool| {
                let g = Geom::new(fmt, cols, Isa::Avx512);
                let xrb = vec_dot_type(fmt).row_bytes(cols).unwrap();
                matmul_amx(g, xrb, &[(w, rows)], x, n, &mut [out], pool).unwrap();
            };
            prop_assert!(amx::supports(fmt));
            let (cols, w) = ragged_weights(ty, rows, blocks, &bytes);
            let x = &xs[..n_tokens * cols];
            let pool = ThreadPool::new(threads).unwrap();
            let mut out = vec![f32::NAN; rows * n_tokens];
            amx(&w, rows, cols, x, n_tokens, &mut out, &pool);
            check_against_scalar(ty, &w, rows, x, &out, "AMX")?;
            // The last MIN_TOKENS tokens alone, on one thread: the same bits.
            let tail = n_tokens - amx::MIN_TOKENS;
            let mut alone = vec![f32::NAN; rows * amx::MIN_TOKENS];
            amx(&w, rows, cols, &x[tail * cols..], amx::MIN_TOKENS, &mut alone,
                &ThreadPool::new(1).unwrap());
            prop_assert_eq!(&alone[..], &out[tail * rows..], "{} AMX: split", ty);
        }

        /// The VNNI kernels in the AMX tiles' block order (`Geom::blocks`, on where the tiles
        /// run), over ragged shapes on both the direct (decode) and the unpacked paths: every
        /// result has the bits of the tiles' arithmetic in scalar code (`amx::reference`), and
        /// of the tiles themselves where this CPU has them. So a token decoded step by step
        /// and the same token in a prefill on the tiles get the same bits.
        #[cfg(target_arch = "x86_64")]
        #[test]
        fn vnni_block_order_matches_the_tiles_bit_for_bit(
            ty_idx in 0..FMTS.len() - 1,
            rows in 1usize..40,
            blocks in 1usize..12,
            n_tokens in 1usize..24,
            bytes in prop::collection::vec(any::<u8>(), 64..512),
            xs in prop::collection::vec(-4.0f32..4.0, 23 * 1024),
            threads in 1usize..4,
        ) {
            if !Isa::available().contains(&Isa::Avx512) {
                eprintln!("no AVX-512 VNNI here: vnni_block_order checks nothing");
                return Ok(());
            }
            let ty = FMTS[ty_idx];
            let fmt = fmt_of(ty).unwrap();
            let (cols, w) = ragged_weights(ty, rows, blocks, &bytes);
            let wrb = w.len() / rows;
            let x = &xs[..n_tokens * cols];
            let pool = ThreadPool::new(threads).unwrap();
            let g = Geom { blocks: true, ..Geom::new(fmt, cols, Isa::Avx512) };
            let xrb = vec_dot_type(fmt).row_bytes(cols).unwrap();
            let mut out = vec![f32::NAN; rows * n_tokens];
            matmul_panel(Isa::Avx512, g, xrb, &[(&w, rows)], x, n_tokens, &mut [&mut out], &pool)
                .unwrap();
            check_against_scalar(ty, &w, rows, x, &out, "VNNI block order")?;
            let mut acts = amx::Acts::new(&g, n_tokens);
            {
                let mut pieces = acts.pieces(n_tokens);
                let mut xq = Vec::new();
                for t in 0..n_tokens {
                    quantize_activations(ty, &x[t * cols..(t + 1) * cols], &mut xq).unwrap();
                    pieces[0].pack(&g, t, &xq);
                }
            }
            for t in 0..n_tokens {
                for r in 0..rows {
                    let want = amx::reference(&g, &w[r * wrb..(r + 1) * wrb], &acts, t);
                    prop_assert_eq!(out[t * rows + r].to_bits(), want.to_bits(),
                        "{} r={} t={}: {} vs the tiles' order {}", ty, r, t, out[t * rows + r],
                        want);
                }
            }
            if amx::usable() {
                let mut tiles = vec![f32::NAN; rows * n_tokens];
                matmul_amx(g, xrb, &[(&w, rows)], x, n_tokens, &mut [&mut tiles], &pool)
                    .unwrap();
                prop_assert_eq!(&tiles[..], &out[..], "{} VNNI block order vs AMX", ty);
            }
        }
    }
}
