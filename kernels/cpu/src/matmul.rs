//! Quantised matrix times activations (`QMatrix`, `matmul`) and embedding-row lookup.

use crate::dequant::dequantize_row;
use crate::dot::{dot_fn, DotFn};
use crate::dtype::GgmlType;
use crate::error::{KernelError, Result};
use crate::quantize::quantize_into;

/// Below this many weight bytes per thread (times the tokens of the call, since each token
/// streams every row once), extra threads cost more to start than they save:
/// `std::thread::scope` spawns cost tens of microseconds, about the time one core takes to
/// stream 256 KiB of quantised weights.
const MIN_BYTES_PER_THREAD: usize = 256 * 1024;

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
/// Each token's activations are quantised once to `w.ty`'s vec-dot type, as llama.cpp does, then
/// every (row, token) pair is an integer dot product. Rows are split across up to `threads`
/// threads (0 counts as 1); each thread walks its rows in the outer loop and the tokens in the
/// inner one, so a weight row is read from memory once and reused for all tokens.
pub fn matmul(
    w: &QMatrix<'_>,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    threads: usize,
) -> Result<()> {
    matmul_split(w, x, n_tokens, out, threads, MIN_BYTES_PER_THREAD)
}

/// [`matmul`] with the per-thread work floor as a parameter (tests set it to 0 to force threads).
fn matmul_split(
    w: &QMatrix<'_>,
    x: &[f32],
    n_tokens: usize,
    out: &mut [f32],
    threads: usize,
    min_bytes_per_thread: usize,
) -> Result<()> {
    let wrb = w.validate()?;
    let expect = |what, expected: Option<usize>, actual| match expected {
        None => Err(KernelError::Overflow { what }),
        Some(e) if e != actual => Err(KernelError::LengthMismatch {
            what,
            expected: e,
            actual,
        }),
        Some(_) => Ok(()),
    };
    expect("matmul x elements", n_tokens.checked_mul(w.cols), x.len())?;
    expect(
        "matmul out elements",
        n_tokens.checked_mul(w.rows),
        out.len(),
    )?;
    if n_tokens == 0 || w.rows == 0 {
        return Ok(());
    }
    let dot = dot_fn(w.ty, "matmul")?;

    // Quantise each token's activations once.
    let vd = w.ty.checked_vec_dot_type("matmul")?;
    let xrb = vd.checked_row_bytes(w.cols, "matmul cols")?;
    let mut xq = vec![0u8; xrb * n_tokens];
    if xrb > 0 {
        for (q, xt) in xq.chunks_exact_mut(xrb).zip(x.chunks_exact(w.cols)) {
            quantize_into(vd, xt, q)?;
        }
    }
    let job = Job {
        dot,
        data: w.data,
        wrb,
        xq: &xq,
        xrb,
        n_tokens,
    };

    let by_size = w
        .data
        .len()
        .saturating_mul(n_tokens)
        .checked_div(min_bytes_per_thread)
        .unwrap_or(usize::MAX)
        .max(1);
    let threads = threads.clamp(1, w.rows).min(by_size);
    if threads == 1 {
        job.run_strided(0, w.rows, out, w.rows);
        return Ok(());
    }
    let chunk = w.rows.div_ceil(threads);
    if n_tokens == 1 {
        // One token: each thread owns a contiguous slice of `out`.
        std::thread::scope(|s| {
            for (i, o) in out.chunks_mut(chunk).enumerate() {
                let job = &job;
                s.spawn(move || job.run_strided(i * chunk, o.len(), o, o.len()));
            }
        });
    } else {
        // Several tokens: a thread's outputs are strided in `out`; it fills a private
        // [token][row] buffer that is copied into place after the join.
        let parts: Vec<(usize, Vec<f32>)> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..w.rows)
                .step_by(chunk)
                .map(|r0| {
                    let job = &job;
                    let len = chunk.min(w.rows - r0);
                    s.spawn(move || {
                        let mut local = vec![0f32; len * n_tokens];
                        job.run_strided(r0, len, &mut local, len);
                        (r0, local)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)))
                .collect()
        });
        for (r0, local) in parts {
            let len = local.len() / n_tokens;
            for (t, src) in local.chunks_exact(len).enumerate() {
                out[t * w.rows + r0..t * w.rows + r0 + len].copy_from_slice(src);
            }
        }
    }
    Ok(())
}

/// The validated inputs of one `matmul`, shared by its threads.
struct Job<'a> {
    dot: DotFn,
    data: &'a [u8],
    wrb: usize,
    xq: &'a [u8],
    xrb: usize,
    n_tokens: usize,
}

impl Job<'_> {
    /// Computes rows `r0..r0 + len` for every token into `out[t * stride + (r - r0)]`.
    fn run_strided(&self, r0: usize, len: usize, out: &mut [f32], stride: usize) {
        for r in 0..len {
            let wrow = &self.data[(r0 + r) * self.wrb..(r0 + r + 1) * self.wrb];
            for t in 0..self.n_tokens {
                let xrow = &self.xq[t * self.xrb..(t + 1) * self.xrb];
                out[t * stride + r] = (self.dot)(wrow, xrow);
            }
        }
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

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// Forced multi-threading (no work floor) gives the same bits as a per-row loop.
        #[test]
        fn threaded_split_matches_vec_dot_loop(
            ty in prop::sample::select(vec![GgmlType::Q4K, GgmlType::Q8_0, GgmlType::F16]),
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
                let mut out = vec![f32::NAN; n_tokens * rows];
                matmul_split(&w, x, n_tokens, &mut out, threads, 0).unwrap();
                prop_assert_eq!(&out, &expected, "threads={}", threads);
            }
        }
    }
}
