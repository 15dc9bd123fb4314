//! Register-tiled integer matmul for the 32-element formats (Q4_0, Q4_1, Q8_0 weights).
//!
//! - this file: the kernels' data layout (packed activations: [`Panel`]; unpacked weight rows),
//!   the split of a matmul into pool tasks, and the `DotFn` wrappers that make a single dot
//!   product the 1 x 1 case of the same kernel;
//! - `avx512` (x86_64): AVX-512 VNNI (`vpdpbusd`) micro-kernels, tiles of up to 4 rows x 4
//!   tokens;
//! - `avx2` (x86_64): AVX2 + FMA (`vpmaddubsw`) micro-kernels, tiles of up to 2 rows x 4 tokens;
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
//! `acc += float(lanes) * (dw * dx)` lane by lane, adds Q4_1's min term
//! `sum_b m_b * s_b` in 16-lane chunks and sums the lanes in a fixed order. A product is
//! therefore bit-identical whatever tile computed it (a decode step and a prefill give the same
//! bits, which the model's consistency tests rely on); it differs from the scalar reference
//! only in float summation order.
//!
//! Per token, a panel holds for each pair `k`: the quants chunk (i8; for the VNNI Q8_0 kernel
//! biased by +128 to u8), a chunk of 16 f32 scales `[d0 x4, d1 x4, d0 x4, d1 x4]`, and for
//! Q4_0 a chunk of 16 i32 corrections `-8 * (lane sum of x)`; then, for Q4_1, the Q8_1 `s`
//! fields of every block as f32 in chunks of 16. Unpacked weight rows mirror it: quants (u8
//! nibbles, or i8 for Q8_0), scales, for VNNI Q8_0 the i32 corrections `-128 * (lane sum of w)`,
//! and for Q4_1 the mins.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub(crate) mod float;
mod packed;
#[cfg(target_arch = "x86_64")]
mod raw;

use std::cell::RefCell;

use crate::blocks::{f16_at, Q4_0_BYTES, Q4_1_BYTES, Q8_0_BYTES, Q8_1_BYTES, QK};
use crate::dot::{DotFn, Isa};
use crate::dtype::GgmlType;
use crate::error::Result;
use crate::pool::ThreadPool;
use crate::quantize::quantize_into;

pub use packed::{matmul_packed, PackedF32};

/// Format id of Q4_0 weights (const generic parameter of the kernels).
pub(crate) const Q4_0: u8 = 0;
/// Format id of Q4_1 weights.
pub(crate) const Q4_1: u8 = 1;
/// Format id of Q8_0 weights.
pub(crate) const Q8_0: u8 = 2;

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
    /// Format id (`Q4_0`, `Q4_1`, `Q8_0`).
    pub(crate) fmt: u8,
    /// Blocks per row.
    pub(crate) nb: usize,
    /// Block pairs per row.
    pub(crate) np: usize,
    /// 16-block chunks of Q4_1 mins / sums (0 for other formats).
    pub(crate) nc: usize,
    /// Chunks per pair in a panel.
    pub(crate) xf: usize,
    /// Chunks per pair in an unpacked weight row.
    pub(crate) wf: usize,
    /// Whether the panel's Q8_0 quants are biased to u8 (+128) and weights carry corrections.
    pub(crate) q8_bias: bool,
}

impl Geom {
    pub(crate) fn new(fmt: u8, cols: usize, isa: Isa) -> Geom {
        let nb = cols / QK;
        let q8_bias = fmt == Q8_0 && isa.has_vnni();
        Geom {
            fmt,
            nb,
            np: nb.div_ceil(2),
            nc: if fmt == Q4_1 { nb.div_ceil(16) } else { 0 },
            xf: if fmt == Q4_0 { 3 } else { 2 },
            wf: if q8_bias { 3 } else { 2 },
            q8_bias,
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

    /// Bytes per block of the weights and of their vec-dot type, and the quants' offsets.
    fn wblock(&self) -> (usize, usize) {
        match self.fmt {
            Q4_0 => (Q4_0_BYTES, 2),
            Q4_1 => (Q4_1_BYTES, 4),
            _ => (Q8_0_BYTES, 2),
        }
    }

    fn xblock(&self) -> (usize, usize) {
        if self.fmt == Q4_1 {
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
        _ => None,
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
    let (bs, qo) = g.xblock();
    let block = |b: usize| &xq[b * bs..(b + 1) * bs];
    for k in 0..g.np {
        let mut q = quants_chunk(g, k, |b| &block(b)[qo..]);
        let base = k * g.xf;
        if g.fmt == Q4_0 {
            out[base + 2] = lane_sums_chunk(&q, -8);
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

/// Unpacks one weight row (ggml layout) into `out` (`g.wstride()` chunks). Portable code: it
/// runs once per row and token chunk, and the ISA files call it from `#[target_feature]`
/// functions, where it is vectorised for that ISA.
#[inline(always)]
pub(crate) fn unpack_row(g: &Geom, w: &[u8], out: &mut [Chunk]) {
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
            // Nibbles: qs[j] holds element j (low) and j + 16 (high).
            let mut q = Chunk::ZERO;
            for half in 0..2 {
                let b = 2 * k + half;
                if b < g.nb {
                    let qs = &block(b)[qo..qo + 16];
                    for (j, &v) in qs.iter().enumerate() {
                        q.0[16 * half + j] = v & 0x0F;
                        q.0[32 + 16 * half + j] = v >> 4;
                    }
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
    matmul_tiled_many(isa, fmt, &[(w, rows)], cols, x, n_tokens, &mut [out], pool)
}

/// [`matmul_tiled`] for several matrices of the same format and width sharing the input `x`
/// (`ws[i] = (data, rows)`, results in `outs[i]`): the activations are quantised and packed
/// once, and every matrix's tasks run in one pool dispatch. Each result is bit-identical to
/// what `matmul_tiled` computes for that matrix alone (same tiles, same spans).
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
) -> Result<()> {
    assert_eq!(ws.len(), outs.len(), "one output per matrix");
    let g = Geom::new(fmt, cols, isa);
    let vd = if fmt == Q4_1 {
        GgmlType::Q8_1
    } else {
        GgmlType::Q8_0
    };
    let xrb = vd.checked_row_bytes(cols, "matmul cols")?;
    let xs = g.xstride();
    let mut panel = vec![Chunk::ZERO; xs * n_tokens];

    // Quantise and pack the activations, in parallel over token groups (one token, as in
    // decode, is a single group, which `run` executes inline on the caller).
    {
        let pp = OutPtrChunks(panel.as_mut_ptr(), panel.len());
        let per = n_tokens.div_ceil(pool.n_threads()).max(1);
        let groups = n_tokens.div_ceil(per);
        let err = std::sync::Mutex::new(None);
        pool.run(groups, |gi| {
            let t0 = gi * per;
            let t1 = (t0 + per).min(n_tokens);
            XQ.with(|b| {
                let mut xq = b.borrow_mut();
                xq.resize(xrb, 0);
                for t in t0..t1 {
                    if let Err(e) = quantize_into(vd, &x[t * cols..(t + 1) * cols], &mut xq) {
                        *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                        return;
                    }
                    // SAFETY: token groups are disjoint, so this token's chunks are written by
                    // this task only, and `panel` outlives the `run` call.
                    let dst = unsafe { pp.slice(t * xs, xs) };
                    pack_token(&g, &xq, dst);
                }
            });
        });
        if let Some(e) = err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
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
fn dot_tiled(isa: Isa, fmt: u8, w: &[u8], xq: &[u8]) -> f32 {
    let (bs, _) = Geom::new(fmt, QK, isa).wblock();
    let cols = w.len() / bs * QK;
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
    macro_rules! f {
        ($isa:expr, $fmt:expr) => {{
            fn dot(w: &[u8], x: &[u8]) -> f32 {
                dot_tiled($isa, $fmt, w, x)
            }
            Some(dot as DotFn)
        }};
    }
    match (isa, fmt_of(ty)?) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Q4_0) => f!(Isa::Avx512, Q4_0),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, Q4_1) => f!(Isa::Avx512, Q4_1),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, _) => f!(Isa::Avx512, Q8_0),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Bw, Q4_0) => f!(Isa::Avx512Bw, Q4_0),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Bw, Q4_1) => f!(Isa::Avx512Bw, Q4_1),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512Bw, _) => f!(Isa::Avx512Bw, Q8_0),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Q4_0) => f!(Isa::Avx2, Q4_0),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, Q4_1) => f!(Isa::Avx2, Q4_1),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => f!(Isa::Avx2, Q8_0),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::tests::random_row;
    use crate::quantize::quantize_activations;
    use proptest::prelude::*;

    const FMTS: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

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

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]

        /// Every tiled ISA, over ragged shapes (rows and tokens not multiples of the tile, odd
        /// block counts), matches the scalar dot product within float-order tolerance, and
        /// equals its own 1 x 1 dot bit for bit.
        #[test]
        fn tiled_matmul_matches_scalar(
            ty_idx in 0..3usize,
            rows in 1usize..40,
            blocks in 1usize..12,
            // Past 16 tokens a task leaves the direct (decode) path for unpacked rows.
            n_tokens in 1usize..24,
            bytes in prop::collection::vec(any::<u8>(), 64..512),
            xs in prop::collection::vec(-4.0f32..4.0, 23 * 384),
            threads in 1usize..4,
        ) {
            let ty = FMTS[ty_idx];
            let cols = blocks * QK;
            let w: Vec<u8> = (0..rows)
                .flat_map(|r| {
                    let rot: Vec<u8> = bytes.iter().cycle().skip(r * 7).take(bytes.len())
                        .copied().collect();
                    random_row(ty, cols, &rot)
                })
                .collect();
            let wrb = w.len() / rows;
            let x = &xs[..n_tokens * cols];
            let pool = ThreadPool::new(threads).unwrap();
            let scalar = Isa::Scalar.dot_fn(ty).unwrap();
            let mut xq = Vec::new();
            for isa in Isa::available().into_iter().filter(|&i| has_tiled(i)) {
                let mut out = vec![f32::NAN; rows * n_tokens];
                matmul_tiled(isa, fmt_of(ty).unwrap(), &w, rows, cols, x, n_tokens, &mut out,
                    &pool).unwrap();
                let one = dot_fn(isa, ty).unwrap();
                for t in 0..n_tokens {
                    let xt = &x[t * cols..(t + 1) * cols];
                    quantize_activations(ty, xt, &mut xq).unwrap();
                    for r in 0..rows {
                        let wr = &w[r * wrb..(r + 1) * wrb];
                        let got = out[t * rows + r];
                        let reference = scalar(wr, &xq);
                        // Integer sums are exact; only the float combination differs: allow
                        // 1e-6 of sum |w_i x_i| (a few ulps of the largest partial sum).
                        let mut wf = vec![0f32; cols];
                        crate::dequant::dequantize_row(ty, wr, &mut wf).unwrap();
                        let scale: f32 = wf.iter().zip(xt).map(|(a, b)| (a * b).abs()).sum();
                        prop_assert!((got - reference).abs() <= 1e-6 * (1.0 + scale),
                            "{ty} {isa:?} r={r} t={t}: {got} vs scalar {reference}");
                        prop_assert_eq!(got.to_bits(), one(wr, &xq).to_bits(),
                            "{} {:?} tile vs 1x1", ty, isa);
                    }
                }
            }
        }
    }
}
