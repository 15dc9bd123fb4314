//! Quantised matrix times activations (`QMatrix`, `matmul`) and embedding-row lookup.

use crate::dequant::dequantize_row;
use crate::dot::Isa;
use crate::dtype::GgmlType;
use crate::error::{check_len, KernelError, Result};
use crate::gemm;
use crate::pool::ThreadPool;
use crate::quantize::quantize_into;

/// Weight bytes times tokens per pool task of the per-pair dot loop (formats without a tiled
/// kernel: f16, bf16, and any format on the scalar ISA): about 64 KiB of streamed weights, tens
/// of microseconds of work, which dwarfs the ~100 ns of claiming a task and still splits a
/// 576 x 576 f16 matrix into ~10 tasks.
const DOT_BYTES_PER_TASK: usize = 64 * 1024;

/// A row-major weight matrix in a GGML format: `rows` rows of `cols` elements each.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    /// Storage type of every row.
    pub ty: GgmlType,
    /// Number of rows (output features).
    pub rows: usize,
    /// Elements per row (input features); a multiple of `ty`'s block size.
    pub cols: usize,
    /// `rows * ty.row_bytes(cols)` bytes.
    pub data: &'a [u8],
}

impl<'a> QMatrix<'a> {
    /// Wraps `data`, checking that `ty` is supported and `data` holds exactly `rows` rows of
    /// `cols` elements.
    pub fn new(ty: GgmlType, rows: usize, cols: usize, data: &'a [u8]) -> Result<Self> {
        let m = QMatrix {
            ty,
            rows,
            cols,
            data,
        };
        m.validate()?;
        Ok(m)
    }

    /// Bytes per row.
    pub fn row_bytes(&self) -> usize {
        self.cols / self.ty.block_size() * self.ty.type_size()
    }

    /// Row `i`'s bytes.
    ///
    /// # Panics
    ///
    /// If `i >= rows` or the matrix was built with inconsistent public fields (not via `new`).
    pub fn row(&self, i: usize) -> &'a [u8] {
        assert!(i < self.rows, "row {i} out of range for {} rows", self.rows);
        let rb = self.row_bytes();
        &self.data[i * rb..(i + 1) * rb]
    }

    /// Checks the invariants `new` establishes (the fields are public, so `matmul` re-checks).
    fn validate(&self) -> Result<usize> {
        self.ty.checked_vec_dot_type("QMatrix")?;
        let rb = self.ty.checked_row_bytes(self.cols, "QMatrix cols")?;
        let expected = rb.checked_mul(self.rows).ok_or(KernelError::Overflow {
            what: "QMatrix data",
        })?;
        if self.data.len() != expected {
            return Err(KernelError::LengthMismatch {
                what: "QMatrix data bytes",
                expected,
                actual: self.data.len(),
            });
        }
        Ok(rb)
    }
}

/// `out[t * rows + r] = dot(w.row(r), x[t * cols .. (t + 1) * cols])` for `t` in `0..n_tokens`.
///
/// Each token's activations are quantised once to `w.ty`'s vec-dot type, as llama.cpp does (in
/// parallel on `pool`), then every (row, token) pair is an integer dot product. The quantised
/// formats use the register-tiled kernels (tiles of rows x tokens, split over `pool` by row
/// blocks and token chunks); float types take one dot per pair, rows split over `pool`. Either
/// way a pair's result does not depend on `n_tokens`, the tiling or the thread count, and equals
/// [`vec_dot`](crate::vec_dot) of that pair bit for bit.
pub fn matmul(
    w: &QMatrix<'_>,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &ThreadPool,
) -> Result<()> {
    matmul_on(
        Isa::detected(),
        w,
        x,
        n_tokens,
        out,
        pool,
        DOT_BYTES_PER_TASK,
    )
}

/// [`matmul`] on a given ISA and with the dot loop's task size as a parameter (tests force
/// ISAs and tiny tasks).
fn matmul_on(
    isa: Isa,
    w: &QMatrix<'_>,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    pool: &ThreadPool,
    bytes_per_task: usize,
) -> Result<()> {
    let wrb = check_shapes(w, x, n_tokens, out.len())?;
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    if w.cols == 0 {
        out.fill(0.0);
        return Ok(());
    }
    if let (Some(fmt), true) = (gemm::fmt_of(w.ty), gemm::has_tiled(isa)) {
        return gemm::matmul_tiled(isa, fmt, w.data, w.rows, w.cols, x, n_tokens, out, pool);
    }
    if w.ty == GgmlType::F32 && gemm::float::has_tiled(isa) {
        return gemm::float::matmul(isa, w.data, w.rows, w.cols, x, n_tokens, out, pool);
    }
    let dot = isa.dot_fn(w.ty).ok_or(KernelError::Unsupported {
        ty: w.ty,
        op: "matmul",
    })?;

    // Quantise each token's activations once, tokens split over the pool.
    let vd = w.ty.checked_vec_dot_type("matmul")?;
    let xrb = vd.checked_row_bytes(w.cols, "matmul cols")?;
    let mut xq = vec![0u8; xrb * n_tokens];
    {
        let per = n_tokens.div_ceil(pool.n_threads());
        // One part per task; each task locks only its own part.
        let parts: Vec<Part<'_>> = xq
            .chunks_mut(xrb * per)
            .zip(x.chunks(w.cols * per))
            .map(std::sync::Mutex::new)
            .collect();
        let err = std::sync::Mutex::new(None);
        pool.run(parts.len(), |i| {
            let mut part = parts[i].lock().unwrap_or_else(|p| p.into_inner());
            let (q, xs) = &mut *part;
            for (q, xt) in q.chunks_exact_mut(xrb).zip(xs.chunks_exact(w.cols)) {
                if let Err(e) = quantize_into(vd, xt, q) {
                    *err.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                }
            }
        });
        if let Some(e) = err.into_inner().unwrap_or_else(|p| p.into_inner()) {
            return Err(e);
        }
    }

    // Rows split into blocks; each task walks its rows in the outer loop and the tokens in the
    // inner one, so a weight row is read from memory once and reused for all tokens.
    let rows_per_task = (bytes_per_task / wrb.saturating_mul(n_tokens).max(1)).clamp(1, w.rows);
    let n_tasks = w.rows.div_ceil(rows_per_task);
    let rows = w.rows;
    let optr = SharedOut(out.as_mut_ptr(), out.len());
    let (data, xq) = (w.data, &xq[..]);
    pool.run(n_tasks, |task| {
        let r0 = task * rows_per_task;
        for r in r0..(r0 + rows_per_task).min(rows) {
            let wrow = &data[r * wrb..(r + 1) * wrb];
            for t in 0..n_tokens {
                let v = dot(wrow, &xq[t * xrb..(t + 1) * xrb]);
                // SAFETY: tasks own disjoint row ranges, so cell (r, t) is written by this task
                // only, while `matmul` holds `out` borrowed mutably.
                unsafe { optr.write(t * rows + r, v) };
            }
        }
    });
    Ok(())
}

/// Validates `w` and the lengths of `x` and `out` for `n_tokens` tokens; returns `w`'s row size.
fn check_shapes(w: &QMatrix<'_>, x: &[f32], n_tokens: usize, out_len: usize) -> Result<usize> {
    let wrb = w.validate()?;
    check_len("matmul x elements", n_tokens.checked_mul(w.cols), x.len())?;
    check_len("matmul out elements", n_tokens.checked_mul(w.rows), out_len)?;
    Ok(wrb)
}

/// Several matrices times the same activations: `outs[i]` gets [`matmul`]`(ws[i], x)`, bit for
/// bit. When the matrices share a type and width with a tiled kernel (a layer's Q/K/V, or its
/// gate/up projections), `x` is quantised once and all their tasks run in one pool dispatch,
/// which at one token (decode) saves the per-call quantisation and thread synchronisation;
/// otherwise it is `matmul` on each in turn.
pub fn matmul_many(
    ws: &[QMatrix<'_>],
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &ThreadPool,
) -> Result<()> {
    matmul_many_on(Isa::detected(), ws, x, n_tokens, outs, pool, true)
}

/// [`matmul_many`] on a given ISA (tests force ISAs); with `amx` false, a fused call never
/// takes the AMX tiles nor their block order ([`matmul_many_no_amx`]).
fn matmul_many_on(
    isa: Isa,
    ws: &[QMatrix<'_>],
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &ThreadPool,
    amx: bool,
) -> Result<()> {
    if ws.len() != outs.len() {
        return Err(KernelError::LengthMismatch {
            what: "matmul_many outputs",
            expected: ws.len(),
            actual: outs.len(),
        });
    }
    for (w, out) in ws.iter().zip(outs.iter()) {
        check_shapes(w, x, n_tokens, out.len())?;
    }
    let Some(first) = ws.first() else {
        return Ok(());
    };
    let fused = ws.iter().all(|w| w.ty == first.ty && w.cols == first.cols)
        && first.cols > 0
        && n_tokens > 0
        && gemm::has_tiled(isa);
    match (gemm::fmt_of(first.ty), fused) {
        (Some(fmt), true) => {
            let mats: Vec<(&[u8], usize)> = ws.iter().map(|w| (w.data, w.rows)).collect();
            gemm::matmul_tiled_many(isa, fmt, &mats, first.cols, x, n_tokens, outs, pool, amx)
        }
        _ => {
            for (w, out) in ws.iter().zip(outs.iter_mut()) {
                matmul_on(isa, w, x, n_tokens, out, pool, DOT_BYTES_PER_TASK)?;
            }
            Ok(())
        }
    }
}

/// [`matmul_many`] without the AMX tiles: for matrices of one quantised type and width, the
/// register-tiled kernels in their natural order for every batch size, bit for bit what
/// `matmul_many` gives in a process without AMX (`ENGRAM_KERNELS_AMX=0`); other mixes are
/// `matmul_many` on each. For matrices whose batches stay small, a mixture-of-experts
/// block's experts (a prefill's tokens spread over them, about 32 each): the tiles' per-call
/// unpack of the weights does not pay there, and the block order the AVX-512 VNNI kernels
/// take where the tiles run costs a decode step a third of its speed. Every call on the same
/// matrices then sums in one order, so a token's result still does not depend on the batch.
pub fn matmul_many_no_amx(
    ws: &[QMatrix<'_>],
    x: &[f32],
    n_tokens: usize,
    outs: &mut [&mut [f32]],
    pool: &ThreadPool,
) -> Result<()> {
    matmul_many_on(Isa::detected(), ws, x, n_tokens, outs, pool, false)
}

/// A run of tokens' quantised activations and their f32 source, quantised by one task.
type Part<'a> = std::sync::Mutex<(&'a mut [u8], &'a [f32])>;

/// `out`'s pointer, shared by the tasks of one dot-loop matmul (they write disjoint cells).
#[derive(Clone, Copy)]
struct SharedOut(*mut f32, usize);

// SAFETY: used only inside one `pool.run` whose tasks write disjoint cells of the buffer.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// # Safety
    ///
    /// No other thread accesses cell `i` during the call; `i` is checked to be in bounds.
    unsafe fn write(&self, i: usize, v: f32) {
        assert!(i < self.1, "output index {i} out of range");
        // SAFETY: in bounds (asserted); exclusivity is the caller's promise.
        unsafe { *self.0.add(i) = v };
    }
}

/// Dequantises row `row` of an embedding table of type `ty` with `cols` elements per row into
/// `out` (`out.len() == cols`).
pub fn embedding_row(
    ty: GgmlType,
    data: &[u8],
    row: usize,
    cols: usize,
    out: &mut [f32],
) -> Result<()> {
    let rb = ty.checked_row_bytes(cols, "embedding_row cols")?;
    if out.len() != cols {
        return Err(KernelError::LengthMismatch {
            what: "embedding_row out elements",
            expected: cols,
            actual: out.len(),
        });
    }
    let rows = data.len().checked_div(rb).unwrap_or(0);
    if row >= rows {
        return Err(KernelError::RowOutOfRange {
            what: "embedding_row",
            row,
            rows,
        });
    }
    dequantize_row(ty, &data[row * rb..(row + 1) * rb], out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::quantize_activations;
    use crate::vec_dot;
    use proptest::prelude::*;

    /// A matrix of Q4_K / Q8_0 / f16 from seeded bytes with sane scales.
    fn weights(ty: GgmlType, rows: usize, cols: usize, seed: u8) -> Vec<u8> {
        let len = rows * ty.row_bytes(cols).unwrap();
        let mut d: Vec<u8> = (0..len)
            .map(|i| (i as u8).wrapping_mul(37) ^ seed)
            .collect();
        let (ts, offs): (usize, &[usize]) = match ty {
            GgmlType::Q8_0 => (34, &[0]),
            GgmlType::Q4_1 => (20, &[0, 2]),
            GgmlType::Q4K => (144, &[0, 2]),
            _ => (2, &[0]),
        };
        for (i, b) in d.chunks_exact_mut(ts).enumerate() {
            for &o in offs {
                let v = half::f16::from_f32(0.01 + (i % 7) as f32 * 0.003);
                b[o..o + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        d
    }

    /// `matmul_many_no_amx`: a token's row has the same bits alone (a decode step) as in a
    /// 40-token batch (past the AMX tiles' threshold, which the regular path would take on a
    /// CPU with them), and stays within float order of `matmul_many`.
    #[test]
    fn matmul_many_no_amx_is_batch_invariant() {
        let (rows, cols, n) = (48, 512, 40);
        for ty in [GgmlType::Q4K, GgmlType::Q8_0, GgmlType::Q4_1] {
            let (a, b) = (weights(ty, rows, cols, 3), weights(ty, rows, cols, 9));
            let ws = [
                QMatrix::new(ty, rows, cols, &a).unwrap(),
                QMatrix::new(ty, rows, cols, &b).unwrap(),
            ];
            let x: Vec<f32> = (0..n * cols)
                .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
                .collect();
            let pool = ThreadPool::new(2).unwrap();
            let (mut g, mut u) = (vec![0f32; n * rows], vec![0f32; n * rows]);
            matmul_many_no_amx(&ws, &x, n, &mut [&mut g, &mut u], &pool).unwrap();
            let (mut g1, mut u1) = (vec![0f32; rows], vec![0f32; rows]);
            for t in [0, 17, n - 1] {
                let xt = &x[t * cols..(t + 1) * cols];
                matmul_many_no_amx(&ws, xt, 1, &mut [&mut g1, &mut u1], &pool).unwrap();
                assert_eq!(g1, g[t * rows..(t + 1) * rows], "{ty}: token {t}");
                assert_eq!(u1, u[t * rows..(t + 1) * rows], "{ty}: token {t}");
            }
            let mut regular = vec![0f32; n * rows];
            matmul_many(&ws[..1], &x, n, &mut [&mut regular], &pool).unwrap();
            for (a, b) in regular.iter().zip(&g) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + a.abs()), "{ty}: {a} vs {b}");
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Forced multi-threading (one row per dot task) gives the same bits as a per-row loop,
        /// and on every ISA a token's results do not depend on how many tokens share the call.
        #[test]
        fn threaded_split_matches_vec_dot_loop(
            ty in prop::sample::select(vec![GgmlType::Q4K, GgmlType::Q8_0, GgmlType::F16,
                GgmlType::Q4_1]),
            rows in 1usize..20,
            n_tokens in 1usize..5,
            seed in any::<u8>(),
            xs in prop::collection::vec(-2.0f32..2.0, 4 * 256),
        ) {
            let cols = 256;
            let data = weights(ty, rows, cols, seed);
            let w = QMatrix::new(ty, rows, cols, &data).unwrap();
            let x = &xs[..n_tokens * cols];
            let mut expected = vec![0f32; n_tokens * rows];
            let mut xq = Vec::new();
            for t in 0..n_tokens {
                quantize_activations(ty, &x[t * cols..(t + 1) * cols], &mut xq).unwrap();
                for r in 0..rows {
                    expected[t * rows + r] = vec_dot(ty, w.row(r), &xq, cols).unwrap();
                }
            }
            for threads in [1, 2, 3, 7] {
                let pool = ThreadPool::new(threads).unwrap();
                for isa in Isa::available() {
                    let mut out = vec![f32::NAN; n_tokens * rows];
                    matmul_on(isa, &w, x, n_tokens, &mut out, &pool, 0).unwrap();
                    if isa == Isa::detected() {
                        prop_assert_eq!(&out, &expected, "threads={}", threads);
                    }
                    // Every ISA: the same bits whatever the thread count and token count.
                    let mut single = vec![f32::NAN; rows];
                    matmul_on(isa, &w, &x[..cols], 1, &mut single, &pool, 0).unwrap();
                    prop_assert_eq!(&single[..], &out[..rows], "{:?} threads={}", isa, threads);
                }
            }
        }

        /// f32 weights (the tiled float kernels) over ragged shapes: every ISA agrees with the
        /// f64 reference to float rounding, and a token's bits do not depend on the tile or the
        /// thread count that computed it.
        #[test]
        fn f32_matmul_matches_reference(
            rows in 1usize..11,
            cols in 1usize..70,
            n_tokens in 1usize..7,
            ws in prop::collection::vec(-1.0f32..1.0, 10 * 69),
            xs in prop::collection::vec(-2.0f32..2.0, 6 * 69),
        ) {
            let (w_f, x) = (&ws[..rows * cols], &xs[..n_tokens * cols]);
            let data: Vec<u8> = w_f.iter().flat_map(|v| v.to_le_bytes()).collect();
            let w = QMatrix::new(GgmlType::F32, rows, cols, &data).unwrap();
            for threads in [1, 3] {
                let pool = ThreadPool::new(threads).unwrap();
                for isa in Isa::available() {
                    let mut out = vec![f32::NAN; n_tokens * rows];
                    matmul_on(isa, &w, x, n_tokens, &mut out, &pool, 0).unwrap();
                    for t in 0..n_tokens {
                        for r in 0..rows {
                            let want: f64 = (0..cols)
                                .map(|k| w_f[r * cols + k] as f64 * x[t * cols + k] as f64)
                                .sum();
                            let got = out[t * rows + r] as f64;
                            prop_assert!((got - want).abs() <= 1e-5 * (1.0 + cols as f64),
                                "{:?} ({}, {}): {} vs {}", isa, r, t, got, want);
                        }
                    }
                    let mut single = vec![f32::NAN; rows];
                    matmul_on(isa, &w, &x[(n_tokens - 1) * cols..], 1, &mut single, &pool, 0)
                        .unwrap();
                    prop_assert_eq!(&single[..], &out[(n_tokens - 1) * rows..], "{:?}", isa);
                }
            }
        }

        /// `matmul_many` equals `matmul` on each matrix bit for bit, on every ISA and thread
        /// count, over ragged row counts (including an empty matrix) and mixed types (which
        /// take the unfused path).
        #[test]
        fn matmul_many_matches_separate_matmuls(
            ty in prop::sample::select(vec![GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4K]),
            mixed in any::<bool>(),
            rows in prop::collection::vec(0usize..23, 1..4),
            n_tokens in 1usize..4,
            seed in any::<u8>(),
            xs in prop::collection::vec(-2.0f32..2.0, 3 * 256),
        ) {
            let cols = 256;
            let tys: Vec<GgmlType> = (0..rows.len())
                .map(|i| if mixed && i == 1 { GgmlType::Q8_0 } else { ty })
                .collect();
            let data: Vec<Vec<u8>> = rows.iter().zip(&tys).enumerate()
                .map(|(i, (&r, &t))| weights(t, r, cols, seed.wrapping_add(i as u8)))
                .collect();
            let ws: Vec<QMatrix<'_>> = data.iter().zip(&rows).zip(&tys)
                .map(|((d, &r), &t)| QMatrix::new(t, r, cols, d).unwrap())
                .collect();
            let x = &xs[..n_tokens * cols];
            for threads in [1, 2, 3] {
                let pool = ThreadPool::new(threads).unwrap();
                for isa in Isa::available() {
                    let mut outs: Vec<Vec<f32>> =
                        rows.iter().map(|&r| vec![f32::NAN; r * n_tokens]).collect();
                    let mut refs: Vec<&mut [f32]> =
                        outs.iter_mut().map(|o| &mut o[..]).collect();
                    matmul_many_on(isa, &ws, x, n_tokens, &mut refs, &pool, true).unwrap();
                    for (w, got) in ws.iter().zip(&outs) {
                        let mut one = vec![f32::NAN; w.rows * n_tokens];
                        matmul_on(isa, w, x, n_tokens, &mut one, &pool, DOT_BYTES_PER_TASK)
                            .unwrap();
                        prop_assert_eq!(&one, got, "{:?} threads={}", isa, threads);
                    }
                }
            }
        }
    }
}
