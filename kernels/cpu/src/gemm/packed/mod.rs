//! f32 x f32 matmul against weights packed once into row panels ([`PackedF32`]), with
//! outer-product (BLAS-style) register-blocked micro-kernels.
//!
//! - this file: the packed layout, the split of a matmul into pool tasks and the loop order
//!   inside a task, the ISA dispatch, and the property tests;
//! - `scalar`: the reference micro-kernel, always compiled (used when no SIMD ISA is present);
//! - `avx512` (x86_64): AVX-512 F, 32 rows x up to 12 tokens per call;
//! - `avx2` (x86_64): AVX2 + FMA, 16 rows (half a panel) x up to 6 tokens per call.
//!
//! # Why a second f32 path
//!
//! The inner-product kernels of `gemm::float` give every (row, token) pair its own vector
//! accumulator and pay a horizontal sum per pair; with tiles of 4 x 4 they load one vector
//! per two FMAs. Here a micro-kernel holds a block of `PANEL` rows x `T` tokens of *outputs*
//! in registers and, per column `k`, loads the panel's `PANEL` weights of that column (two
//! zmm) and broadcasts each token's `x[t][k]` from memory (`vbroadcastss`, a load-port uop)
//! into two FMAs: `2 T` FMAs per two vector loads, no horizontal sums, no shuffles. This is
//! the layout of every BLAS sgemm micro-kernel (BLIS `skx` 32 x 12, OpenBLAS, MKL). The
//! activations are read where they are (`T` strided streams), not packed as BLAS packs its
//! second operand: the kernel already reaches about 88 % of the FMA peak on L2-resident data
//! and 80-90 % at the embedder's shapes, and packing would cost an extra pass over `x` per
//! panel group and a buffer per thread for at most that difference.
//!
//! # Numerics
//!
//! Every output is the chain `acc = fma(W[r][k], x[t][k], acc)` for `k = 0, 1, ..., cols - 1`
//! starting from `+0.0`, on every ISA: the register blocks split rows and tokens, never `k`,
//! and when a task walks `k` in blocks of [`KC`] the next block resumes from the stored partial
//! sum (loaded back into the accumulator, not added to a fresh one). So the result does not
//! depend on the ISA, the tiling, the thread count or `n_tokens`: the scalar reference
//! (`f32::mul_add` in column order) gives the same bits, which the property tests check. The
//! error is that of a sequential f32 sum, at most about `cols * 2^-24 * sum |W[r][k] x[t][k]|`.

mod scalar;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;

use crate::dot::Isa;
use crate::error::{check_len, KernelError, Result};
use crate::pool::ThreadPool;

/// Rows per panel: two AVX-512 registers of 16 f32 lanes (four AVX2 ones, which the AVX2
/// kernel takes as two 16-row halves). One width for every ISA, so a [`PackedF32`] does not
/// depend on the CPU it was packed on and the tests can run every ISA on the same packing.
const PANEL: usize = 32;

/// Columns per `k` block inside a task. A micro-kernel call reads `T x KC` activations
/// (12 x 384 x 4 B = 18 KiB on AVX-512), which stay in L1 (32 KiB on Zen 4, 48 KiB on Sapphire
/// Rapids) while the group's panels stream past from L2 (`PANEL x KC x 4 B` = 48 KiB each). The
/// embedder's widths are 384 (one block) and 1536 (four).
const KC: usize = 384;

/// Most panels in a task's panel group: their `KC`-column slice (8 x 48 KiB = 384 KiB) stays in
/// L2 (1 MiB per core on Zen 4, 2 MiB on Sapphire Rapids) while every token block of the task's
/// chunk streams over it. On one Sapphire Rapids core at 4096 tokens, groups of 8 and 12 panels
/// ran alike, 4 about 5 % and 2 about 15 % slower (more passes over the activations).
const MAX_GROUP_PANELS: usize = 8;

/// Most tokens in a task's chunk. A task loads its panel group into L2 once (384 KiB from L3,
/// a few microseconds) and then computes `256 x 384 x 192` multiply-adds (~0.2 ms at
/// 190 GFLOP/s), so the load is a few per cent; smaller chunks give more tasks to balance.
/// Chunks of 96 to 384 tokens measured alike.
const MAX_CHUNK_TOKENS: usize = 192;

/// Tasks per thread the split aims for (when the shape allows), so that a thread slowed by
/// another tenant of the machine hands part of its share to the others.
const TASKS_PER_THREAD: usize = 4;

/// Multiply-adds a task should have at least before the split makes more tasks: 2^18 take
/// about 2.5 us on one core, against roughly 0.2 us to hand out a task and up to tens of
/// microseconds to wake a sleeping worker. A one-token product (a search query) of a 384 x 384
/// layer is 2^17: one task, run on the caller.
const MIN_TASK_MACS: usize = 1 << 18;

/// One 64-byte-aligned cache line of 16 f32: the storage unit of [`PackedF32`], so that every
/// weight load of the micro-kernels is line-aligned (no split loads).
#[derive(Clone, Copy, Debug, PartialEq)]
#[repr(C, align(64))]
struct Line([f32; 16]);

/// Lines per panel column.
const LINES_PER_COL: usize = PANEL / 16;

/// A `rows x cols` f32 weight matrix `W` (PyTorch's `[out, in]`), re-laid-out once for
/// [`matmul_packed`].
///
/// Layout: panels of 32 rows; panel `p` holds, for each column `k` in order, the 32 values
/// `W[32 p .. 32 p + 32][k]` contiguously (rows past `rows` are zero), so a micro-kernel reads a
/// panel front to back. The storage is 64-byte aligned. Packing costs one pass over `W`; do it
/// when the model is loaded (or, for attention, once per head and sequence).
#[derive(Clone, Debug, PartialEq)]
pub struct PackedF32 {
    rows: usize,
    cols: usize,
    /// `panels * cols * LINES_PER_COL` lines.
    data: Vec<Line>,
}

impl PackedF32 {
    /// Packs a row-major `rows x cols` matrix (`w[r * cols + k] = W[r][k]`).
    pub fn pack(w: &[f32], rows: usize, cols: usize) -> Result<PackedF32> {
        check_len(
            "PackedF32::pack w elements",
            rows.checked_mul(cols),
            w.len(),
        )?;
        let mut p = PackedF32::zeroed(rows, cols)?;
        for r in 0..rows {
            let (panel, i) = (r / PANEL, r % PANEL);
            let base = panel * cols * LINES_PER_COL + i / 16;
            for (k, &v) in w[r * cols..(r + 1) * cols].iter().enumerate() {
                p.data[base + k * LINES_PER_COL].0[i % 16] = v;
            }
        }
        Ok(p)
    }

    /// Packs `W` given as its transpose `W^T`, row-major `cols x rows` (`wt[k * rows + r] =
    /// W[r][k]`). For attention's `P V`, `W = V^T`, so `wt` is `V` as stored (`[len][d]`) and
    /// no transpose is needed; each panel column is a contiguous copy (with `rows == 32` the
    /// whole packing is one copy of `wt`).
    pub fn pack_transposed(wt: &[f32], rows: usize, cols: usize) -> Result<PackedF32> {
        check_len(
            "PackedF32::pack_transposed wt elements",
            rows.checked_mul(cols),
            wt.len(),
        )?;
        let mut p = PackedF32::zeroed(rows, cols)?;
        for panel in 0..rows.div_ceil(PANEL) {
            let (r0, r1) = (panel * PANEL, ((panel + 1) * PANEL).min(rows));
            for k in 0..cols {
                let src = &wt[k * rows + r0..k * rows + r1];
                let dst = (panel * cols + k) * LINES_PER_COL;
                for (line, part) in src.chunks(16).enumerate() {
                    p.data[dst + line].0[..part.len()].copy_from_slice(part);
                }
            }
        }
        Ok(p)
    }

    /// Rows of `W` (outputs per token).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Columns of `W` (inputs per token).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// A zero matrix of the right size, or `Overflow`.
    fn zeroed(rows: usize, cols: usize) -> Result<PackedF32> {
        let lines = rows
            .div_ceil(PANEL)
            .checked_mul(cols)
            .and_then(|n| n.checked_mul(LINES_PER_COL))
            .filter(|&n| n.checked_mul(std::mem::size_of::<Line>()).is_some())
            .ok_or(KernelError::Overflow {
                what: "PackedF32 size",
            })?;
        Ok(PackedF32 {
            rows,
            cols,
            data: vec![Line([0.0; 16]); lines],
        })
    }

    /// Panel `p`'s first value; the panel holds `cols * PANEL` values.
    fn panel_ptr(&self, p: usize) -> *const f32 {
        guard!(p < self.rows.div_ceil(PANEL));
        self.data[p * self.cols * LINES_PER_COL..]
            .as_ptr()
            .cast::<f32>()
    }
}

/// `out[t * rows + r] = sum_k W[r][k] * x[t * cols + k]` for `t` in `0..n_tokens`, with
/// `(rows, cols)` those of `w`: the output layout of [`matmul`](crate::matmul).
///
/// Each output is an f32 fused multiply-add chain over `k` in order (see the module docs), so
/// it is bit-identical on every ISA, tiling and thread count. The work is split over `pool`
/// by panel groups and token chunks; called from inside a pool task it runs inline.
///
/// ```
/// use engram_kernels::{matmul_packed, PackedF32, ThreadPool};
///
/// // W = [[1, 2, 3], [4, 5, 6]] (2 x 3), packed once.
/// let w = PackedF32::pack(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 2, 3)?;
/// let pool = ThreadPool::new(2)?;
/// let x = [1.0, 0.0, 1.0, /* token 1: */ 0.0, 1.0, 0.0];
/// let mut out = [0.0f32; 4];
/// matmul_packed(&w, &x, 2, &mut out, &pool)?;
/// assert_eq!(out, [4.0, 10.0, /* token 1: */ 2.0, 5.0]);
/// # Ok::<(), engram_kernels::KernelError>(())
/// ```
pub fn matmul_packed(
    w: &PackedF32,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &ThreadPool,
) -> Result<()> {
    matmul_packed_on(Isa::detected(), w, x, n_tokens, out, pool, MIN_TASK_MACS)
}

/// The operands of one micro-kernel call: panel rows `32 p ..` times `nt` tokens over the
/// columns `k0 .. k0 + kc`.
struct Tile {
    /// The panel's column `k0` (`PANEL` values per column, 64-byte aligned).
    w: *const f32,
    /// Token 0's column `k0`; token `j`'s is `x + j * ldx`.
    x: *const f32,
    /// Elements between consecutive tokens of `x` (the matrix's `cols`).
    ldx: usize,
    /// Columns to multiply.
    kc: usize,
    /// Output of token 0, panel row 0; token `j`'s is `out + j * ldo`.
    out: *mut f32,
    /// Elements between consecutive tokens of `out` (the matrix's `rows`).
    ldo: usize,
    /// Panel rows that exist (1..=PANEL); only these are read from or written to `out`.
    valid: usize,
    /// Whether `out` already holds the sums over the columns before `k0` (resume the chain)
    /// rather than nothing (start from `+0.0`).
    resume: bool,
}

/// A micro-kernel driver: computes `tile` for `nt` tokens (1..=its token block).
///
/// # Safety
///
/// The ISA's features must be present; every pointer of `tile` must be valid for the panel
/// columns, tokens and rows it names, and no other thread may access those output cells.
type TileFn = unsafe fn(tile: &Tile, nt: usize);

/// An ISA's micro-kernel and its token block.
#[derive(Clone, Copy)]
struct Kernel {
    /// Tokens per micro-kernel call (the register block's width).
    tokens: usize,
    tile: TileFn,
}

impl Kernel {
    fn of(isa: Isa) -> Kernel {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 | Isa::Avx512Bw => Kernel {
                tokens: avx512::TOKENS,
                tile: avx512::tile,
            },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => Kernel {
                tokens: avx2::TOKENS,
                tile: avx2::tile,
            },
            Isa::Scalar => Kernel {
                tokens: scalar::TOKENS,
                tile: scalar::tile,
            },
        }
    }
}

/// How a matmul is split into pool tasks: `n_groups` panel groups x `n_chunks` token chunks,
/// task index group-major.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Split {
    n_panels: usize,
    n_groups: usize,
    /// Tokens per chunk (a multiple of the kernel's token block, except in the last chunk).
    chunk: usize,
    n_chunks: usize,
}

impl Split {
    /// Panel groups of at most [`MAX_GROUP_PANELS`] panels and token chunks of at most
    /// [`MAX_CHUNK_TOKENS`] tokens, in whole token blocks of `block`; more of either (smaller
    /// ones) until there are [`TASKS_PER_THREAD`] tasks per thread, or tasks would get fewer
    /// than `min_task_macs` ([`MIN_TASK_MACS`]) multiply-adds, or the shape runs out: tokens are split first (a
    /// group's weights are then shared by more tasks), panels next.
    fn new(
        rows: usize,
        cols: usize,
        n_tokens: usize,
        block: usize,
        threads: usize,
        min_task_macs: usize,
    ) -> Split {
        let n_panels = rows.div_ceil(PANEL).max(1);
        let macs = rows.saturating_mul(cols).saturating_mul(n_tokens);
        let min_tasks = (threads * TASKS_PER_THREAD)
            .min(macs / min_task_macs.max(1))
            .max(1);
        let n_blocks = n_tokens.div_ceil(block).max(1);
        // The group cap keeps weights in L2 for the next token block; with one block there is
        // no next one.
        let mut n_groups = if n_blocks > 1 {
            n_panels.div_ceil(MAX_GROUP_PANELS)
        } else {
            1
        };
        let n_chunks = n_tokens
            .div_ceil(MAX_CHUNK_TOKENS)
            .max(min_tasks.div_ceil(n_groups))
            .min(n_blocks);
        if n_groups * n_chunks < min_tasks {
            n_groups = min_tasks.div_ceil(n_chunks).min(n_panels);
        }
        let chunk = n_blocks.div_ceil(n_chunks) * block;
        Split {
            n_panels,
            n_groups,
            chunk,
            n_chunks: n_tokens.div_ceil(chunk).max(1),
        }
    }

    fn n_tasks(&self) -> usize {
        self.n_groups * self.n_chunks
    }

    /// Task `i`'s panels and tokens. Group-major: the tasks a thread claims one after another
    /// mostly share a group, whose weights then stay in that core's L2.
    fn task(&self, i: usize, n_tokens: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (g, c) = (i / self.n_chunks, i % self.n_chunks);
        let panels = g * self.n_panels / self.n_groups..(g + 1) * self.n_panels / self.n_groups;
        let tokens = (c * self.chunk).min(n_tokens)..((c + 1) * self.chunk).min(n_tokens);
        (panels, tokens)
    }
}

/// `out`'s pointer, shared by the tasks of one matmul, which write disjoint cells.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: an `OutPtr` is used only by the tasks of one `matmul_packed_on` call, which write
// disjoint (panel rows x token chunk) cells while the call holds `out` borrowed mutably.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

/// [`matmul_packed`] on a given ISA and with the task floor as a parameter (tests force ISAs
/// and fine splits). `isa` must be one `Isa::detected` or `Isa::available` returned.
fn matmul_packed_on(
    isa: Isa,
    w: &PackedF32,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &ThreadPool,
    min_task_macs: usize,
) -> Result<()> {
    let (rows, cols) = (w.rows, w.cols);
    check_len(
        "matmul_packed x elements",
        n_tokens.checked_mul(cols),
        x.len(),
    )?;
    check_len(
        "matmul_packed out elements",
        n_tokens.checked_mul(rows),
        out.len(),
    )?;
    if n_tokens == 0 || rows == 0 {
        return Ok(());
    }
    if cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    let kernel = Kernel::of(isa);
    let split = Split::new(
        rows,
        cols,
        n_tokens,
        kernel.tokens,
        pool.n_threads(),
        min_task_macs,
    );
    let optr = OutPtr(out.as_mut_ptr());
    pool.run(split.n_tasks(), |task| {
        let (panels, tokens) = split.task(task, n_tokens);
        // SAFETY: `kernel` is `isa`'s, whose features were detected; the panels and tokens
        // are in range of `w`, `x` and `out` (checked above, `Split` stays inside them); tasks
        // own disjoint (panels x tokens) blocks of `out`, which outlives `run`.
        unsafe { run_task(kernel, w, x, panels, tokens, optr) };
    });
    Ok(())
}

/// One task: the panels `panels` of `w` times the tokens `tokens` of `x`, into `out`.
///
/// Loop order (outermost first), the GotoBLAS arrangement with `W` as the packed operand:
///
/// 1. `k` blocks of [`KC`] columns: the group's `KC`-column slice (at most
///    [`MAX_GROUP_PANELS`] x 48 KiB) is brought into L2 once per block;
/// 2. token blocks of `kernel.tokens`: the block's activations (`T x KC`, 18 KiB) are read into
///    L1 by the first panel and stay there for the others;
/// 3. panels of the group: each streams its 48 KiB slice from L2 through the micro-kernel,
///    which keeps the `PANEL x T` outputs in registers over the whole `KC` columns and loads
///    or stores them once.
///
/// # Safety
///
/// `kernel` must be for a detected ISA; `panels` and `tokens` must be in range of `w`, of `x`
/// (`w.cols` per token) and of `out` (`w.rows` per token), and no other thread may access the
/// task's output cells during the call.
unsafe fn run_task(
    kernel: Kernel,
    w: &PackedF32,
    x: &[f32],
    panels: std::ops::Range<usize>,
    tokens: std::ops::Range<usize>,
    out: OutPtr,
) {
    let (rows, cols) = (w.rows, w.cols);
    let mut k0 = 0;
    while k0 < cols {
        let kc = KC.min(cols - k0);
        let mut t = tokens.start;
        while t < tokens.end {
            let nt = kernel.tokens.min(tokens.end - t);
            for p in panels.clone() {
                let tile = Tile {
                    // SAFETY (pointer arithmetic): column `k0 < cols` of panel `p` lies in the
                    // panel; token `t` column `k0` and output cell (t, 32 p) lie in `x` and
                    // `out` (the caller's ranges).
                    w: unsafe { w.panel_ptr(p).add(k0 * PANEL) },
                    x: unsafe { x.as_ptr().add(t * cols + k0) },
                    ldx: cols,
                    kc,
                    out: unsafe { out.0.add(t * rows + p * PANEL) },
                    ldo: rows,
                    valid: PANEL.min(rows - p * PANEL),
                    resume: k0 > 0,
                };
                // SAFETY: the tile's panel columns `k0..k0 + kc`, tokens `t..t + nt` and rows
                // `32 p .. 32 p + valid` are in range (above), and this task owns those cells.
                unsafe { (kernel.tile)(&tile, nt) };
            }
            t += nt;
        }
        k0 += kc;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Mutex;

    /// Deterministic pseudo-random values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// The transpose of the row-major `rows x cols` matrix `w`.
    fn transpose(w: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        let mut t = vec![0f32; w.len()];
        for r in 0..rows {
            for k in 0..cols {
                t[k * rows + r] = w[r * cols + k];
            }
        }
        t
    }

    /// Checks `got` against an f64 product of the unpacked matrix: each output within the
    /// error bound of a sequential f32 sum of `cols` terms, `cols * 2^-23 * sum |w x|`.
    fn check_near_f64(w: &[f32], x: &[f32], rows: usize, cols: usize, got: &[f32]) {
        for t in 0..got.len() / rows.max(1) {
            for r in 0..rows {
                let (wr, xt) = (&w[r * cols..(r + 1) * cols], &x[t * cols..(t + 1) * cols]);
                let exact: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                let scale: f64 = wr.iter().zip(xt).map(|(&a, &b)| (a * b).abs() as f64).sum();
                let tol = cols as f64 * f32::EPSILON as f64 * scale + 1e-30;
                let g = got[t * rows + r] as f64;
                assert!(
                    (g - exact).abs() <= tol,
                    "r={r} t={t}: {g} vs f64 {exact} (tolerance {tol})"
                );
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every ISA available here gives the scalar reference's bits over ragged shapes (rows
        /// and tokens not multiples of the panel or token block, widths across a `KC` block
        /// boundary), on 1 to 3 threads, and the scalar result is within an f32 sum's error
        /// bound of an f64 product.
        #[test]
        fn every_isa_matches_scalar(
            rows in 1usize..80,
            cols in prop_oneof![1usize..100, (KC - 3)..(KC + 40)],
            n_tokens in 1usize..30,
            seed in any::<u64>(),
            threads in 1usize..4,
        ) {
            let w = values(rows * cols, seed);
            let x = values(n_tokens * cols, seed ^ 0xdead_beef);
            let packed = PackedF32::pack(&w, rows, cols).unwrap();
            let pool = ThreadPool::new(threads).unwrap();
            let one = ThreadPool::new(1).unwrap();
            let mut want = vec![f32::NAN; rows * n_tokens];
            matmul_packed_on(Isa::Scalar, &packed, &x, n_tokens, &mut want, &one, 1).unwrap();
            check_near_f64(&w, &x, rows, cols, &want);
            for isa in Isa::available() {
                let mut got = vec![f32::NAN; rows * n_tokens];
                matmul_packed_on(isa, &packed, &x, n_tokens, &mut got, &pool, 1).unwrap();
                for (i, (g, e)) in got.iter().zip(&want).enumerate() {
                    prop_assert_eq!(g.to_bits(), e.to_bits(),
                        "{:?} r={} t={}: {} vs scalar {}", isa, i % rows, i / rows, g, e);
                }
            }
        }

        /// `pack` of `W` and `pack_transposed` of `W^T` give the same packing.
        #[test]
        fn pack_and_pack_transposed_agree(
            rows in 0usize..80, cols in 0usize..50, seed in any::<u64>(),
        ) {
            let w = values(rows * cols, seed);
            let a = PackedF32::pack(&w, rows, cols).unwrap();
            let b = PackedF32::pack_transposed(&transpose(&w, rows, cols), rows, cols).unwrap();
            prop_assert_eq!(a, b);
        }
    }

    /// The packed layout is the documented one: panel-major, 32 rows per column, zero padding.
    #[test]
    fn packed_layout() {
        let (rows, cols) = (40, 3);
        let w: Vec<f32> = (0..rows * cols).map(|i| i as f32 + 1.0).collect();
        let p = PackedF32::pack(&w, rows, cols).unwrap();
        let flat: Vec<f32> = p.data.iter().flat_map(|l| l.0).collect();
        assert_eq!(flat.len(), 2 * cols * PANEL);
        for panel in 0..2 {
            for k in 0..cols {
                for i in 0..PANEL {
                    let r = panel * PANEL + i;
                    let want = if r < rows { w[r * cols + k] } else { 0.0 };
                    assert_eq!(flat[(panel * cols + k) * PANEL + i], want, "r={r} k={k}");
                }
            }
        }
        // With 32 rows, packing the transpose is a plain copy.
        let v = values(32 * 7, 3);
        let p = PackedF32::pack_transposed(&v, 32, 7).unwrap();
        assert_eq!(p.data.iter().flat_map(|l| l.0).collect::<Vec<_>>(), v);
    }

    /// The embedder's shapes, larger than the property test's, on every ISA and 2 threads.
    #[test]
    fn embedder_shapes_match_scalar() {
        let pool = ThreadPool::new(2).unwrap();
        let one = ThreadPool::new(1).unwrap();
        for (rows, cols, n_tokens) in [(384, 1536, 37), (1152, 384, 13), (32, 256, 256)] {
            let w = values(rows * cols, rows as u64);
            let x = values(n_tokens * cols, cols as u64);
            let packed = PackedF32::pack(&w, rows, cols).unwrap();
            let mut want = vec![0f32; rows * n_tokens];
            matmul_packed_on(Isa::Scalar, &packed, &x, n_tokens, &mut want, &one, 1).unwrap();
            check_near_f64(&w, &x, rows, cols, &want);
            for isa in Isa::available() {
                let mut got = vec![0f32; rows * n_tokens];
                matmul_packed_on(isa, &packed, &x, n_tokens, &mut got, &pool, 1).unwrap();
                assert!(got == want, "{isa:?} {rows}x{cols} x {n_tokens}");
            }
        }
    }

    #[test]
    fn bad_lengths_are_errors() {
        let pool = ThreadPool::new(2).unwrap();
        let w = vec![0.5f32; 6];
        assert!(matches!(
            PackedF32::pack(&w, 2, 4),
            Err(KernelError::LengthMismatch {
                expected: 8,
                actual: 6,
                ..
            })
        ));
        assert!(PackedF32::pack_transposed(&w, 4, 2).is_err());
        assert!(matches!(
            PackedF32::pack(&w, usize::MAX, 2),
            Err(KernelError::Overflow { .. })
        ));
        assert!(matches!(
            PackedF32::pack_transposed(&[], usize::MAX / 4, 8),
            Err(KernelError::Overflow { .. })
        ));
        let p = PackedF32::pack(&w, 2, 3).unwrap();
        assert_eq!((p.rows(), p.cols()), (2, 3));
        let x = vec![1.0f32; 6];
        let mut out = vec![0f32; 4];
        assert!(matmul_packed(&p, &x, 2, &mut out, &pool).is_ok());
        assert_eq!(out, [1.5; 4]);
        assert!(matmul_packed(&p, &x[..5], 2, &mut out, &pool).is_err());
        assert!(matmul_packed(&p, &x, 2, &mut out[..3], &pool).is_err());
        assert!(matmul_packed(&p, &x, 3, &mut out, &pool).is_err());
        assert!(matches!(
            matmul_packed(&p, &x, usize::MAX, &mut out, &pool),
            Err(KernelError::Overflow { .. })
        ));
        // Empty shapes: nothing to do, or zeros for zero columns.
        let empty = PackedF32::pack(&[], 3, 0).unwrap();
        let mut out = vec![f32::NAN; 6];
        matmul_packed(&empty, &[], 2, &mut out, &pool).unwrap();
        assert_eq!(out, [0.0; 6]);
        matmul_packed(&p, &[], 0, &mut [], &pool).unwrap();
    }

    /// A `matmul_packed` inside a pool task (the embedder's per-head attention) runs inline and
    /// gives the same bits as a top-level call spread over the pool.
    #[test]
    fn nested_in_a_pool_task() {
        let pool = ThreadPool::new(2).unwrap();
        let (rows, cols, n_tokens) = (32, 200, 50);
        let heads: Vec<(PackedF32, Vec<f32>)> = (0..4)
            .map(|h| {
                let v = values(cols * rows, h);
                let x = values(n_tokens * cols, h + 10);
                (PackedF32::pack_transposed(&v, rows, cols).unwrap(), x)
            })
            .collect();
        let nested: Vec<Mutex<Vec<f32>>> = (0..heads.len())
            .map(|_| Mutex::new(vec![0f32; rows * n_tokens]))
            .collect();
        pool.run(heads.len(), |h| {
            let (w, x) = &heads[h];
            let mut out = nested[h].lock().unwrap();
            // A split into many tasks, which the pool runs inline on this thread.
            matmul_packed_on(Isa::detected(), w, x, n_tokens, &mut out, &pool, 1).unwrap();
        });
        for ((w, x), got) in heads.iter().zip(nested) {
            let mut want = vec![0f32; rows * n_tokens];
            matmul_packed_on(Isa::detected(), w, x, n_tokens, &mut want, &pool, 1).unwrap();
            assert!(got.into_inner().unwrap() == want);
        }
    }

    /// The split gives both threads work at the embedder's shapes, leaves tiny products in one
    /// task, and keeps groups and chunks within their caps.
    #[test]
    fn split_shapes() {
        let shapes = [
            (384, 384, 4096),
            (32, 256, 256),
            (1152, 384, 4096),
            (384, 1536, 1),
            (384, 384, 1),
            (32, 5, 7),
        ];
        for (rows, cols, n_tokens) in shapes {
            for block in [12, 6, 4] {
                let s = Split::new(rows, cols, n_tokens, block, 2, MIN_TASK_MACS);
                let macs = rows * cols * n_tokens;
                if macs >= 2 * MIN_TASK_MACS {
                    assert!(s.n_tasks() >= 2, "{rows}x{cols} x {n_tokens}: {s:?}");
                } else {
                    assert_eq!(s.n_tasks(), 1, "{rows}x{cols} x {n_tokens}: {s:?}");
                }
                assert!(s.chunk.is_multiple_of(block) && s.chunk > 0);
                if n_tokens > block {
                    assert!(s.n_panels.div_ceil(s.n_groups) <= MAX_GROUP_PANELS);
                }
                assert!(s.chunk <= MAX_CHUNK_TOKENS.next_multiple_of(block));
                // Every panel and token is covered exactly once.
                let mut seen = vec![0u8; s.n_panels * n_tokens];
                for i in 0..s.n_tasks() {
                    let (ps, ts) = s.task(i, n_tokens);
                    for p in ps {
                        for t in ts.clone() {
                            seen[p * n_tokens + t] += 1;
                        }
                    }
                }
                assert!(seen.iter().all(|&c| c == 1), "{rows} x {n_tokens}: {s:?}");
            }
        }
    }
}
