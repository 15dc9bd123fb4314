//! The kernels' launches, one method per operation. Every buffer argument is checked against
//! the sizes the kernel will touch before the launch, so a wrong shape is an error here rather
//! than an out-of-bounds access on the device.

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use engram_kernels::GgmlType;

use crate::device::{Buffer, Device, Lane};
use crate::{CudaError, Result};

/// Most activation rows a GEMV launch takes (the kernels' `MAX_BATCH`); more go to cuBLAS.
pub const MAX_GEMV_BATCH: usize = 8;

/// Warps per block of the Q8_1 GEMV kernels, which split each row's groups between them, and
/// rows per block (their `GEMV_WARPS` and `ROWS_PER_WARP`).
const GEMV_WARPS: usize = 4;
const GEMV_ROWS_PER_BLOCK: usize = 2;

/// The other block shapes the kernels instantiate (`GEMV_Q8_SHAPES`): name, rows per block,
/// warps per block; for [`GEMV_SHAPE_TYPES`] at 1 and 8 activation rows.
pub(crate) const GEMV_SHAPES: &[(&str, usize, usize)] = &[
    ("r1w4", 1, 4),
    ("r4w4", 4, 4),
    ("r2w8", 2, 8),
    ("r8w2", 8, 2),
];
pub(crate) const GEMV_SHAPE_TYPES: &[&str] = &["q4_0", "q4_k"];
pub(crate) const GEMV_SHAPE_ROWS: &[usize] = &[1, 8];

/// How the decode GEMVs are launched: the kernels' default block shape or another one of
/// [`GEMV_SHAPES`], and optionally a persistent grid of so many blocks per multiprocessor.
/// [`Device::set_gemv_launch`] changes it (benchmarks compare them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GemvLaunch {
    /// Index into [`GEMV_SHAPES`]; `None` is the default shape.
    shape: Option<usize>,
    blocks_per_sm: Option<usize>,
}

impl GemvLaunch {
    /// `default` or one of the shape names (`r1w4`, ...), with `/pN` for a persistent grid of
    /// N blocks per multiprocessor (`r4w4/p4`, `default/p8`).
    pub fn parse(spec: &str) -> Result<GemvLaunch> {
        let (shape, persistent) = match spec.split_once('/') {
            Some((s, p)) => (s, Some(p)),
            None => (spec, None),
        };
        let shape = match shape {
            "default" | "" => None,
            name => Some(
                GEMV_SHAPES
                    .iter()
                    .position(|(n, _, _)| *n == name)
                    .ok_or_else(|| {
                        CudaError::Unsupported(format!("no GEMV block shape `{name}`"))
                    })?,
            ),
        };
        let blocks_per_sm = persistent
            .map(|p| {
                p.strip_prefix('p')
                    .and_then(|n| n.parse::<usize>().ok())
                    .filter(|&n| n > 0)
                    .ok_or_else(|| CudaError::Unsupported(format!("bad persistent grid `{p}`")))
            })
            .transpose()?;
        Ok(GemvLaunch {
            shape,
            blocks_per_sm,
        })
    }
}

/// One weight matrix of a [`Device::matmul_many`] call: `rows` rows of the call's `cols`
/// values, in the GGML block layout of `ty`.
pub struct Weight<'a> {
    pub buf: &'a Buffer,
    pub ty: GgmlType,
    pub rows: usize,
}

/// The arguments of [`Device::kv_import`]: `len` stored slots of layers `first_layer..
/// first_layer + layers` (`[layer][kv_head][len][head_dim]` f16 at `stage_offset` bytes of the
/// stages, keys after RoPE at their stored positions) go to slots `first_slot..` of those layers
/// of the caches, the keys rotated on by the `pairs` (cos, sin) f32 pairs at `shift_offset` bytes
/// of `shift` (pairs as in [`Device::rope`]).
pub struct KvImport<'a> {
    pub stage_k: &'a Buffer,
    pub stage_v: &'a Buffer,
    pub stage_offset: usize,
    pub keys: &'a Buffer,
    pub values: &'a Buffer,
    pub first_layer: usize,
    pub layers: usize,
    pub first_slot: usize,
    pub len: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
    pub shift: &'a Buffer,
    pub shift_offset: usize,
    pub pairs: usize,
    pub neox: bool,
}

/// Scratch buffers of [`Device::matmul_many`]: `q8` for decode ([`Device::q8_scratch`]
/// bytes), `x16` (`n * cols` f16) and `w16` (the largest matrix in f16) for prefill.
pub struct MatmulScratch<'a> {
    pub q8: &'a Buffer,
    pub x16: &'a Buffer,
    pub w16: &'a Buffer,
    /// `q8` already holds the input as Q8_1 (written by [`Device::rms_norm_q8`] or
    /// [`Device::swiglu_q8`]): the decode GEMVs skip quantising it.
    pub q8_ready: bool,
}

/// Whether decode runs the int8 (Q8_1 activations) GEMV for weights of type `ty`.
fn has_q8_gemv(ty: GgmlType) -> bool {
    !matches!(ty, GgmlType::F32 | GgmlType::F16)
}

/// Threads of the element-wise kernels' blocks.
const THREADS: u32 = 256;

/// Query rows (one warp each) per attention block.
const ATTENTION_WARPS: usize = 16;
/// Keys per shared-memory tile of the attention kernel (its `KEY_TILE`).
const KEY_TILE: usize = 32;
/// Calls of at most this many queries (decode, small recomputes) run the decode attention
/// kernel, split over ranges of slots (flash decoding) so that one query still spreads over the
/// GPU's multiprocessors; longer calls run the tiled kernel, whose query tiles fill the GPU.
const DECODE_QUERIES: usize = 8;
/// Slots per split of the decode kernel at least, and most splits.
const DECODE_SLOTS_PER_SPLIT: usize = 64;
const DECODE_MAX_SPLITS: usize = 64;
/// Warps of the decode kernel's blocks (its `DECODE_WARPS`).
const DECODE_WARPS: u32 = 4;

/// The GEMV / dequantise kernel suffix of a weight type, if the GPU path has one.
fn kernel_suffix(ty: GgmlType) -> Option<&'static str> {
    Some(match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::Q4_1 => "q4_1",
        GgmlType::Q5_0 => "q5_0",
        GgmlType::Q5_1 => "q5_1",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4K => "q4_k",
        GgmlType::Q5K => "q5_k",
        GgmlType::Q6K => "q6_k",
        _ => return None,
    })
}

/// Whether the GPU path can multiply weights of type `ty`.
pub fn supports(ty: GgmlType) -> bool {
    kernel_suffix(ty).is_some()
}

fn blocks(n: usize) -> u32 {
    n.div_ceil(THREADS as usize) as u32
}

fn need(buf: &Buffer, bytes: usize, what: &str) -> Result<()> {
    if buf.bytes() < bytes {
        return Err(CudaError::Driver(format!(
            "{what}: buffer of {} bytes, kernel needs {bytes}",
            buf.bytes()
        )));
    }
    Ok(())
}

fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Unsupported(format!("{what} {v} exceeds i32")))
}

/// One layer's attention call: see [`Device::attention`].
pub struct AttentionArgs<'a> {
    /// Queries, `[n_q][n_head * head_dim]` f32, already rotated.
    pub q: &'a Buffer,
    /// Query positions, `[n_q]` i32.
    pub q_pos: &'a Buffer,
    /// Row of `q`, `q_pos` and `out` where this call's queries start (a batch's sequence).
    pub first_row: usize,
    /// The layer's caches, `[kv_heads][capacity][head_dim]` f16, starting at `cache_offset`.
    pub keys: &'a Buffer,
    pub values: &'a Buffer,
    pub cache_offset: usize,
    /// Position of every cache slot, `[capacity]` i32.
    pub kv_pos: &'a Buffer,
    pub n_q: usize,
    pub n_head: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub capacity: usize,
    /// Slots in use.
    pub kv_len: usize,
    pub scale: f32,
    /// Scratch for the splits' partial results: at least [`Device::attention_scratch`] bytes.
    pub partial: &'a Buffer,
    /// Output, `[n_q][n_head * head_dim]` f32.
    pub out: &'a Buffer,
}

/// One sequence's caches in a batched decode step ([`Device::write_seq_table`]): every layer's
/// keys and values (`[layer][kv_head][capacity][head_dim]` f16), the slots' positions, and the
/// slots in use once the step's rows are stored.
pub struct SeqCacheRef<'a> {
    pub keys: &'a Buffer,
    pub values: &'a Buffer,
    pub kv_pos: &'a Buffer,
    pub capacity: usize,
    pub kv_len: usize,
}

/// Bytes per sequence of [`Device::write_seq_table`]'s table (the kernels' `SeqCache`).
pub const SEQ_TABLE_ENTRY: usize = 40;

/// The device's table of a batched decode step's sequences ([`Device::write_seq_table`]).
pub struct SeqTable<'a> {
    buf: &'a Buffer,
    seqs: usize,
    layers: usize,
    max_kv_len: usize,
}

/// The arguments of [`Device::attention_many`]: decode attention of `rows` query rows, row `i`
/// of sequence `seq_of_row[i]` of `table` at position `q_pos[i]`, over that sequence's slots of
/// layer `layer`.
pub struct ManyAttention<'a> {
    pub q: &'a Buffer,
    pub q_pos: &'a Buffer,
    pub seq_of_row: &'a Buffer,
    pub rows: usize,
    pub table: &'a SeqTable<'a>,
    pub layer: usize,
    pub n_head: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scale: f32,
    pub partial: &'a Buffer,
    pub out: &'a Buffer,
}

impl SeqTable<'_> {
    /// Slot ranges each row's attention is split into (the launch's grid depends on it).
    pub fn splits(&self) -> usize {
        Device::many_splits(self)
    }
}

impl Device {
    /// Writes the caches of a batched decode step's sequences to `buf` (40 bytes each), for
    /// [`Device::kv_store_many`] and [`Device::attention_many`]: one launch each per layer for
    /// every sequence, instead of one per sequence. Checks every cache holds `layers` layers.
    pub fn write_seq_table<'a>(
        &self,
        buf: &'a Buffer,
        seqs: &[SeqCacheRef<'_>],
        layers: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<SeqTable<'a>> {
        need(buf, seqs.len() * SEQ_TABLE_ENTRY, "sequence table")?;
        let mut bytes = Vec::with_capacity(seqs.len() * SEQ_TABLE_ENTRY);
        for c in seqs {
            let cache = layers * kv_heads * c.capacity * head_dim * 2;
            need(c.keys, cache, "batched key cache")?;
            need(c.values, cache, "batched value cache")?;
            need(c.kv_pos, c.capacity * 4, "batched slot positions")?;
            if c.kv_len > c.capacity {
                return Err(CudaError::Driver(format!(
                    "{} slots in use of {}",
                    c.kv_len, c.capacity
                )));
            }
            for ptr in [c.keys.at(0), c.values.at(0), c.kv_pos.at(0)] {
                bytes.extend_from_slice(&ptr.to_le_bytes());
            }
            bytes.extend_from_slice(&i32_of(c.capacity, "capacity")?.to_le_bytes());
            bytes.extend_from_slice(&i32_of(c.kv_len, "kv_len")?.to_le_bytes());
            // Each sequence's own split count (its row alone would get the same).
            let splits = attention_splits(1, c.kv_len) as i32;
            bytes.extend_from_slice(&splits.to_le_bytes());
            bytes.extend_from_slice(&0i32.to_le_bytes());
        }
        self.write(buf, 0, &bytes)?;
        Ok(SeqTable {
            buf,
            seqs: seqs.len(),
            layers,
            max_kv_len: seqs.iter().map(|c| c.kv_len).max().unwrap_or(0),
        })
    }

    /// [`Device::kv_store`] for the rows of several sequences in one launch: row `t`'s keys and
    /// values go to slot `slots[t]` of layer `layer` of sequence `seq_of_row[t]` of `table`.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store_many(
        &self,
        k: &Buffer,
        v: &Buffer,
        table: &SeqTable<'_>,
        seq_of_row: &Buffer,
        slots: &Buffer,
        rows: usize,
        layer: usize,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<()> {
        let width = kv_heads * head_dim;
        need(k, rows * width * 4, "kv_store_many keys")?;
        need(v, rows * width * 4, "kv_store_many values")?;
        need(seq_of_row, rows * 4, "kv_store_many sequences")?;
        need(slots, rows * 4, "kv_store_many slots")?;
        if layer >= table.layers {
            return Err(CudaError::Driver(format!(
                "layer {layer} of caches of {}",
                table.layers
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let (kp, vp, tp, sp, slp) = (
            k.at(0),
            v.at(0),
            table.buf.at(0),
            seq_of_row.at(0),
            slots.at(0),
        );
        let (layer_i, h, hd) = (
            i32_of(layer, "layer")?,
            i32_of(kv_heads, "kv heads")?,
            i32_of(head_dim, "head_dim")?,
        );
        let mut b = self.stream.launch_builder(self.func("kv_store_many")?);
        b.arg(&kp)
            .arg(&vp)
            .arg(&tp)
            .arg(&sp)
            .arg(&slp)
            .arg(&layer_i)
            .arg(&h)
            .arg(&hd);
        // SAFETY: one block per row, reading its keys and values (checked above); the caller
        // guarantees every sequence index is below the table's length and every slot below its
        // sequence's capacity, and the table's caches hold every layer (checked when written).
        unsafe { b.launch(per_row(rows)) }?;
        Ok(())
    }

    /// [`Device::attention`] of a batched decode step: every row of every sequence in one
    /// launch (and one to combine the splits), each row over its own sequence's slots.
    pub fn attention_many(&self, a: &ManyAttention<'_>) -> Result<()> {
        attention_heads(a.n_head, a.kv_heads, a.head_dim)?;
        if a.layer >= a.table.layers {
            return Err(CudaError::Driver(format!(
                "layer {} of caches of {}",
                a.layer, a.table.layers
            )));
        }
        let q_width = a.n_head * a.head_dim;
        need(a.q, a.rows * q_width * 4, "attention queries")?;
        need(a.q_pos, a.rows * 4, "attention query positions")?;
        need(a.seq_of_row, a.rows * 4, "attention sequences")?;
        need(a.out, a.rows * q_width * 4, "attention output")?;
        let splits = Self::many_splits(a.table);
        need(
            a.partial,
            Self::attention_many_scratch(a.rows, a.n_head, a.head_dim, splits),
            "attention partials",
        )?;
        if a.rows == 0 || a.table.seqs == 0 {
            return Ok(());
        }
        let part_o = a.partial.at(0);
        let part_ml = a.partial.at(a.rows * a.n_head * splits * a.head_dim * 4);
        let (qp, tp, sp, qpp) = (
            a.q.at(0),
            a.table.buf.at(0),
            a.seq_of_row.at(0),
            a.q_pos.at(0),
        );
        let (n_head, kv_heads, hd, layer) = (
            i32_of(a.n_head, "heads")?,
            i32_of(a.kv_heads, "kv heads")?,
            i32_of(a.head_dim, "head_dim")?,
            i32_of(a.layer, "layer")?,
        );
        let mut b = self
            .stream
            .launch_builder(self.func("attention_decode_many")?);
        b.arg(&qp)
            .arg(&tp)
            .arg(&sp)
            .arg(&qpp)
            .arg(&part_o)
            .arg(&part_ml)
            .arg(&n_head)
            .arg(&kv_heads)
            .arg(&hd)
            .arg(&layer)
            .arg(&a.scale);
        let cfg = LaunchConfig {
            grid_dim: (a.n_head as u32, splits as u32, a.rows as u32),
            block_dim: (32 * DECODE_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: reads the rows' queries and positions (checked above) and, through the table,
        // each row's sequence's slots of one layer (the caller guarantees the sequence indices;
        // the table's caches were checked when written); writes rows * n_head * splits partials
        // (checked above).
        unsafe { b.launch(cfg) }?;
        self.attention_combine(a.partial, a.out, a.rows, a.n_head, a.head_dim, splits)
    }

    /// Slot ranges of a batched decode step: as one sequence of the longest's slots would get.
    fn many_splits(table: &SeqTable<'_>) -> usize {
        attention_splits(1, table.max_kv_len)
    }

    /// Bytes of partials [`Device::attention_many`] needs for `rows` rows over `splits` ranges
    /// (at most [`Device::attention_many_scratch_for`]'s).
    fn attention_many_scratch(rows: usize, n_head: usize, head_dim: usize, splits: usize) -> usize {
        rows * n_head * splits * (head_dim + 2) * 4
    }

    /// Bytes of partials a batched decode step of `rows` rows over at most `kv_len` slots per
    /// sequence needs.
    pub fn attention_many_scratch_for(
        rows: usize,
        n_head: usize,
        head_dim: usize,
        kv_len: usize,
    ) -> usize {
        Self::attention_many_scratch(rows, n_head, head_dim, attention_splits(1, kv_len))
    }
}

impl Device {
    /// `y = W x` for one matrix: [`Device::matmul_many`] with one.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        w: &Weight<'_>,
        cols: usize,
        x: &Buffer,
        n: usize,
        y: &Buffer,
        scratch: &MatmulScratch<'_>,
    ) -> Result<()> {
        self.matmul_many(std::slice::from_ref(w), cols, x, n, &[y], scratch)
    }

    /// `ys[i][j] = ws[i] x[j]` for the `n` rows of `x` (`[n][cols]` f32), each weight matrix
    /// in its GGML block layout. Up to [`MAX_GEMV_BATCH`] rows run the GEMV kernels: the
    /// activations are quantised to Q8_1 once (into `scratch.q8`) for every quantised matrix,
    /// whose weights are then read once for all rows. More rows dequantise each matrix into
    /// `scratch.w16` and the activations (once) into `scratch.x16`, then run cuBLAS (f16 tensor
    /// cores, f32 accumulation).
    pub fn matmul_many(
        &self,
        ws: &[Weight<'_>],
        cols: usize,
        x: &Buffer,
        n: usize,
        ys: &[&Buffer],
        scratch: &MatmulScratch<'_>,
    ) -> Result<()> {
        if ws.len() != ys.len() {
            return Err(CudaError::Driver(format!(
                "{} matrices and {} outputs",
                ws.len(),
                ys.len()
            )));
        }
        need(x, n * cols * 4, "matmul input")?;
        let cols_i = i32_of(cols, "cols")?;
        let n_i = i32_of(n, "n")?;
        for (w, y) in ws.iter().zip(ys) {
            if kernel_suffix(w.ty).is_none() {
                return Err(CudaError::Unsupported(format!(
                    "weights of type {}",
                    w.ty.name()
                )));
            }
            if !cols.is_multiple_of(w.ty.block_size()) || !cols.is_multiple_of(32) {
                return Err(CudaError::Unsupported(format!(
                    "{cols}-wide rows of {}",
                    w.ty.name()
                )));
            }
            let row_bytes = w.ty.row_bytes(cols).expect("multiple of the block size");
            need(w.buf, w.rows * row_bytes, "matmul weights")?;
            need(y, n * w.rows * 4, "matmul output")?;
        }
        if n == 0 {
            return Ok(());
        }
        if n <= MAX_GEMV_BATCH {
            let q8_off = (n * cols).next_multiple_of(16);
            if ws.iter().any(|w| has_q8_gemv(w.ty)) {
                need(
                    scratch.q8,
                    q8_off + n * cols / 32 * 8,
                    "matmul Q8_1 scratch",
                )?;
            }
            if !scratch.q8_ready && ws.iter().any(|w| has_q8_gemv(w.ty)) {
                let (xp, qp, dp, len) = (
                    x.at(0),
                    scratch.q8.at(0),
                    scratch.q8.at(q8_off),
                    (n * cols) as u64,
                );
                let mut b = self.stream.launch_builder(self.func("quantize_q8_1")?);
                b.arg(&xp).arg(&qp).arg(&dp).arg(&len);
                // SAFETY: n * cols floats in, as many bytes and n * cols / 32 pairs out
                // (checked above).
                unsafe { b.launch(elementwise(n * cols)) }?;
            }
            // Runs of up to three matrices of one quantised type share a launch.
            let mut i = 0;
            while i < ws.len() {
                let w = &ws[i];
                let suffix = kernel_suffix(w.ty).expect("checked above");
                if !has_q8_gemv(w.ty) {
                    let rows_i = i32_of(w.rows, "rows")?;
                    let (wp, xp, yp, warps) = (w.buf.at(0), x.at(0), ys[i].at(0), 4usize);
                    let f = self.func(&format!("gemv_{suffix}"))?;
                    let cfg = LaunchConfig {
                        grid_dim: (w.rows.div_ceil(warps) as u32, 1, 1),
                        block_dim: (32 * warps as u32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    let mut b = self.stream.launch_builder(f);
                    b.arg(&wp)
                        .arg(&xp)
                        .arg(&yp)
                        .arg(&rows_i)
                        .arg(&cols_i)
                        .arg(&n_i);
                    // SAFETY: reads rows * row_bytes of w, n * cols floats of x, writes
                    // n * rows floats of y (checked above).
                    unsafe { b.launch(cfg) }?;
                    i += 1;
                    continue;
                }
                let run = ws[i..].iter().take(3).take_while(|v| v.ty == w.ty).count();
                // The launch's block shape: another one only where the kernels have it.
                let shape = self
                    .gemv_launch
                    .shape
                    .filter(|_| GEMV_SHAPE_TYPES.contains(&suffix) && GEMV_SHAPE_ROWS.contains(&n));
                let (tag, per_block, warps) = match shape {
                    Some(k) => {
                        let (name, r, w) = GEMV_SHAPES[k];
                        (format!("_{name}"), r, w)
                    }
                    None => (String::new(), GEMV_ROWS_PER_BLOCK, GEMV_WARPS),
                };
                let mut ptrs = [(0u64, 0u64, 0i32); 3];
                let mut blocks = 0usize;
                for (k, slot) in ptrs.iter_mut().enumerate().take(run) {
                    let (wk, yk) = (&ws[i + k], ys[i + k]);
                    *slot = (wk.buf.at(0), yk.at(0), i32_of(wk.rows, "rows")?);
                    blocks += wk.rows.div_ceil(per_block);
                }
                let f = self.func(&format!("gemv_q8_{suffix}_{n}{tag}"))?;
                let (qp, dp) = (scratch.q8.at(0), scratch.q8.at(q8_off));
                let grid = match self.gemv_launch.blocks_per_sm {
                    Some(per_sm) => blocks.min(per_sm * self.multiprocessors()),
                    None => blocks,
                };
                let cfg = LaunchConfig {
                    grid_dim: (grid as u32, 1, 1),
                    block_dim: (32 * warps as u32, 1, 1),
                    shared_mem_bytes: 0,
                };
                let mut b = self.stream.launch_builder(f);
                for (wp, yp, rows) in &ptrs {
                    b.arg(wp).arg(yp).arg(rows);
                }
                b.arg(&qp).arg(&dp).arg(&cols_i);
                // SAFETY: each of the run's matrices is read for rows * row_bytes and its
                // output written for n * rows floats (checked above); absent slots have 0 rows
                // and get no blocks.
                unsafe { b.launch(cfg) }?;
                i += run;
            }
            return Ok(());
        }
        need(scratch.x16, n * cols * 2, "matmul f16 input scratch")?;
        self.to_f16(x, scratch.x16, n * cols)?;
        for (w, y) in ws.iter().zip(ys) {
            need(scratch.w16, w.rows * cols * 2, "matmul f16 weights scratch")?;
            let suffix = kernel_suffix(w.ty).expect("checked above");
            let rows_i = i32_of(w.rows, "rows")?;
            let f = self.func(&format!("dequant_f16_{suffix}"))?;
            let (wp, w16p) = (w.buf.at(0), scratch.w16.at(0));
            let mut b = self.stream.launch_builder(f);
            b.arg(&wp).arg(&w16p).arg(&rows_i).arg(&cols_i);
            // SAFETY: one thread per 32-value group of the rows x cols matrix, inside both
            // buffers (checked above).
            unsafe { b.launch(elementwise(w.rows * cols / 32)) }?;
            let (alpha, beta) = (1.0f32, 0.0f32);
            // Column-major view: C (rows x n) = W-as-stored transposed (cols x rows, so
            // rows x cols) times X (cols x n).
            // SAFETY: the handle is bound to this device's stream; A is rows x cols f16 (lda
            // cols), B is n x cols f16 (ldb cols), C is n x rows f32 (ldc rows), all inside
            // their buffers (checked above).
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    cublasOperation_t::CUBLAS_OP_T,
                    cublasOperation_t::CUBLAS_OP_N,
                    rows_i,
                    n_i,
                    cols_i,
                    (&alpha as *const f32).cast(),
                    scratch.w16.at(0) as *const _,
                    cudaDataType::CUDA_R_16F,
                    cols_i,
                    scratch.x16.at(0) as *const _,
                    cudaDataType::CUDA_R_16F,
                    cols_i,
                    (&beta as *const f32).cast(),
                    y.at(0) as *mut _,
                    cudaDataType::CUDA_R_32F,
                    rows_i,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
                )
            }?;
        }
        Ok(())
    }

    /// Bytes of [`MatmulScratch::q8`] for `n` rows of `cols` activations.
    pub fn q8_scratch(n: usize, cols: usize) -> usize {
        (n * cols).next_multiple_of(16) + n * cols / 32 * 8
    }

    /// `out = f16(x)` for `n` values.
    pub fn to_f16(&self, x: &Buffer, out: &Buffer, n: usize) -> Result<()> {
        need(x, n * 4, "to_f16 input")?;
        need(out, n * 2, "to_f16 output")?;
        let (xp, op, n64) = (x.at(0), out.at(0), n as u64);
        let mut b = self.stream.launch_builder(self.func("f32_to_f16")?);
        b.arg(&xp).arg(&op).arg(&n64);
        // SAFETY: n values of each buffer, checked above.
        unsafe { b.launch(elementwise(n)) }?;
        Ok(())
    }

    /// RMSNorm of `rows` rows of `width` values of `x` times `w`, into `out` (may be `x`).
    pub fn rms_norm(
        &self,
        x: &Buffer,
        w: &Buffer,
        out: &Buffer,
        rows: usize,
        width: usize,
        eps: f32,
    ) -> Result<()> {
        need(x, rows * width * 4, "rms_norm input")?;
        need(out, rows * width * 4, "rms_norm output")?;
        need(w, width * 4, "rms_norm weight")?;
        if rows == 0 {
            return Ok(());
        }
        let (xp, wp, op, width_i) = (x.at(0), w.at(0), out.at(0), i32_of(width, "width")?);
        let mut b = self.stream.launch_builder(self.func("rms_norm")?);
        b.arg(&xp).arg(&wp).arg(&op).arg(&width_i).arg(&eps);
        let cfg = per_row(rows);
        // SAFETY: one block per row, each touching its own `width` values (checked above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// [`Device::rms_norm`] that also writes the normalised rows as Q8_1 into `q8` (the
    /// layout [`MatmulScratch::q8`] holds for `rows` rows of `width`), so that the decode GEMVs
    /// that follow skip their own quantisation ([`MatmulScratch::q8_ready`]). With `residual`,
    /// first `x += residual` (written back). `width` must be a multiple of 32.
    #[allow(clippy::too_many_arguments)]
    pub fn rms_norm_q8(
        &self,
        x: &Buffer,
        residual: Option<&Buffer>,
        w: &Buffer,
        out: &Buffer,
        rows: usize,
        width: usize,
        eps: f32,
        q8: &Buffer,
    ) -> Result<()> {
        need(x, rows * width * 4, "rms_norm_q8 input")?;
        need(out, rows * width * 4, "rms_norm_q8 output")?;
        need(w, width * 4, "rms_norm_q8 weight")?;
        if let Some(r) = residual {
            need(r, rows * width * 4, "rms_norm_q8 residual")?;
        }
        let q8_off = (rows * width).next_multiple_of(16);
        need(q8, Self::q8_scratch(rows, width), "rms_norm_q8 Q8_1 output")?;
        if !width.is_multiple_of(32) {
            return Err(CudaError::Unsupported(format!(
                "{width}-wide rows for rms_norm_q8"
            )));
        }
        if rows == 0 {
            return Ok(());
        }
        let (xp, wp, op, width_i) = (x.at(0), w.at(0), out.at(0), i32_of(width, "width")?);
        let (qp, dp) = (q8.at(0), q8.at(q8_off));
        let rp = residual.map(|r| r.at(0));
        let kernel = if rp.is_some() {
            "add_rms_norm_q8"
        } else {
            "rms_norm_q8"
        };
        let mut b = self.stream.launch_builder(self.func(kernel)?);
        b.arg(&xp);
        if let Some(rp) = &rp {
            b.arg(rp);
        }
        b.arg(&wp)
            .arg(&op)
            .arg(&width_i)
            .arg(&eps)
            .arg(&qp)
            .arg(&dp);
        // SAFETY: one block per row, each touching its own `width` values of x, the residual
        // and out, and its row's int8 values and group scales of q8 (all checked above).
        unsafe { b.launch(per_row(rows)) }?;
        Ok(())
    }

    /// [`Device::swiglu`] that also writes the result as Q8_1 into `q8` for `rows` rows of
    /// `width` (a multiple of 32), as [`Device::rms_norm_q8`] does.
    pub fn swiglu_q8(
        &self,
        gate: &Buffer,
        up: &Buffer,
        rows: usize,
        width: usize,
        q8: &Buffer,
    ) -> Result<()> {
        let n = rows * width;
        need(gate, n * 4, "swiglu_q8 gate")?;
        need(up, n * 4, "swiglu_q8 up")?;
        need(q8, Self::q8_scratch(rows, width), "swiglu_q8 Q8_1 output")?;
        if !width.is_multiple_of(32) {
            return Err(CudaError::Unsupported(format!(
                "{width}-wide rows for swiglu_q8"
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let (gp, upp, n64) = (gate.at(0), up.at(0), n as u64);
        let (qp, dp) = (q8.at(0), q8.at(n.next_multiple_of(16)));
        let mut b = self.stream.launch_builder(self.func("swiglu_q8")?);
        b.arg(&gp).arg(&upp).arg(&n64).arg(&qp).arg(&dp);
        // SAFETY: n values of gate and up, n int8 values and n / 32 scales of q8 (checked
        // above); the blocks of THREADS threads hold whole 32-value groups.
        unsafe { b.launch(elementwise(n)) }?;
        Ok(())
    }

    /// [`Device::rope`] of the queries (`n_head` heads) and keys (`n_kv` heads) of `rows` rows
    /// in one launch.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_qk(
        &self,
        q: &Buffer,
        k: &Buffer,
        angles: &Buffer,
        rows: usize,
        n_head: usize,
        n_kv: usize,
        head_dim: usize,
        pairs: usize,
        neox: bool,
    ) -> Result<()> {
        need(q, rows * n_head * head_dim * 4, "rope queries")?;
        need(k, rows * n_kv * head_dim * 4, "rope keys")?;
        if !rope_work(angles, rows, head_dim, pairs)? {
            return Ok(());
        }
        let (qp, kp, ap) = (q.at(0), k.at(0), angles.at(0));
        let (h, kvh, hd, p, nx) = (
            i32_of(n_head, "heads")?,
            i32_of(n_kv, "kv heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(pairs, "pairs")?,
            i32::from(neox),
        );
        let mut b = self.stream.launch_builder(self.func("rope_qk")?);
        b.arg(&qp)
            .arg(&kp)
            .arg(&ap)
            .arg(&h)
            .arg(&kvh)
            .arg(&hd)
            .arg(&p)
            .arg(&nx);
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 2, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: block (t, 0) touches row t of q, block (t, 1) row t of k, both row t of the
        // angles (sizes checked above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Adds the `width`-long bias `b` to every row of the first `n` values of `x`.
    pub fn add_bias(&self, x: &Buffer, bias: &Buffer, width: usize, n: usize) -> Result<()> {
        need(x, n * 4, "add_bias input")?;
        need(bias, width * 4, "add_bias bias")?;
        let (xp, bp, w, n64) = (x.at(0), bias.at(0), i32_of(width, "width")?, n as u64);
        let mut b = self.stream.launch_builder(self.func("add_bias")?);
        b.arg(&xp).arg(&bp).arg(&w).arg(&n64);
        // SAFETY: n values of x and width of the bias, checked above.
        unsafe { b.launch(elementwise(n)) }?;
        Ok(())
    }

    /// `x += y` over `n` values.
    pub fn add(&self, x: &Buffer, y: &Buffer, n: usize) -> Result<()> {
        self.pairwise("add", x, y, n)
    }

    /// `gate = silu(gate) * up` over `n` values.
    pub fn swiglu(&self, gate: &Buffer, up: &Buffer, n: usize) -> Result<()> {
        self.pairwise("swiglu", gate, up, n)
    }

    /// Runs the element-wise `kernel(a, b, n)`, which updates `n` f32 values of `a` from `b`.
    fn pairwise(&self, kernel: &str, a: &Buffer, b: &Buffer, n: usize) -> Result<()> {
        need(a, n * 4, kernel)?;
        need(b, n * 4, kernel)?;
        let (ap, bp, n64) = (a.at(0), b.at(0), n as u64);
        let mut l = self.stream.launch_builder(self.func(kernel)?);
        l.arg(&ap).arg(&bp).arg(&n64);
        // SAFETY: n values of each, checked above.
        unsafe { l.launch(elementwise(n)) }?;
        Ok(())
    }

    /// Rotates the `heads` heads of each of `rows` rows of `x` by the row's `(cos, sin)` pairs in
    /// `angles` (`[rows][pairs]` pairs of f32): pairs `(i, i + pairs)` when `neox`, else
    /// `(2i, 2i + 1)`.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        x: &Buffer,
        angles: &Buffer,
        rows: usize,
        heads: usize,
        head_dim: usize,
        pairs: usize,
        neox: bool,
    ) -> Result<()> {
        need(x, rows * heads * head_dim * 4, "rope input")?;
        if !rope_work(angles, rows, head_dim, pairs)? {
            return Ok(());
        }
        let (xp, ap) = (x.at(0), angles.at(0));
        let (h, hd, p, nx) = (
            i32_of(heads, "heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(pairs, "pairs")?,
            i32::from(neox),
        );
        let mut b = self.stream.launch_builder(self.func("rope")?);
        b.arg(&xp).arg(&ap).arg(&h).arg(&hd).arg(&p).arg(&nx);
        let cfg = per_row(rows);
        // SAFETY: block t touches row t of x and of angles only (sizes checked above).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Stores rows `first_row..first_row + rows` of keys and values (`[rows][kv_heads *
    /// head_dim]` f32) as f16 into the slots `slots[row]` (i32, each `< capacity`) of one
    /// layer's caches starting at byte `cache_offset` of `keys` and `values`
    /// (`[kv_heads][capacity][head_dim]`).
    #[allow(clippy::too_many_arguments)]
    pub fn kv_store(
        &self,
        k: &Buffer,
        v: &Buffer,
        keys: &Buffer,
        values: &Buffer,
        cache_offset: usize,
        slots: &Buffer,
        first_row: usize,
        rows: usize,
        kv_heads: usize,
        head_dim: usize,
        capacity: usize,
    ) -> Result<()> {
        let width = kv_heads * head_dim;
        let end = first_row + rows;
        need(k, end * width * 4, "kv_store keys")?;
        need(v, end * width * 4, "kv_store values")?;
        need(slots, end * 4, "kv_store slots")?;
        let layer = kv_heads * capacity * head_dim * 2;
        need(keys, cache_offset + layer, "kv_store key cache")?;
        need(values, cache_offset + layer, "kv_store value cache")?;
        if rows == 0 {
            return Ok(());
        }
        let (kp, vp, kc, vc, sp) = (
            k.at(first_row * width * 4),
            v.at(first_row * width * 4),
            keys.at(cache_offset),
            values.at(cache_offset),
            slots.at(first_row * 4),
        );
        let (h, hd, cap) = (
            i32_of(kv_heads, "kv_heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(capacity, "capacity")?,
        );
        let mut b = self.stream.launch_builder(self.func("kv_store")?);
        b.arg(&kp)
            .arg(&vp)
            .arg(&kc)
            .arg(&vc)
            .arg(&sp)
            .arg(&h)
            .arg(&hd)
            .arg(&cap);
        let cfg = per_row(rows);
        // SAFETY: sizes checked above; the caller guarantees every slot is below `capacity`
        // (the cache's host-side bookkeeping hands them out).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }

    /// Places stored KV into one sequence's caches ([`KvImport`]), queued on `lane`. Fused
    /// prefill from host memory runs it layer by layer on the copy lane while the compute lane
    /// recomputes earlier layers; [`Device::kv_import`] does every layer at once.
    pub fn kv_import_on(&self, lane: Lane, a: &KvImport<'_>) -> Result<()> {
        let staged = a.layers * a.kv_heads * a.len * a.head_dim * 2;
        let layer_bytes = a.kv_heads * a.capacity * a.head_dim * 2;
        for (stage, what) in [(a.stage_k, "staged keys"), (a.stage_v, "staged values")] {
            need(stage, a.stage_offset + staged, what)?;
        }
        for (cache, what) in [(a.keys, "key cache"), (a.values, "value cache")] {
            need(cache, (a.first_layer + a.layers) * layer_bytes, what)?;
        }
        need(a.shift, a.shift_offset + a.pairs * 8, "kv_import shift")?;
        if a.first_slot + a.len > a.capacity || 2 * a.pairs > a.head_dim {
            return Err(CudaError::Unsupported(format!(
                "{} slots at {} of {}, {} pairs in {}",
                a.len, a.first_slot, a.capacity, a.pairs, a.head_dim
            )));
        }
        if !a.stage_offset.is_multiple_of(2) || !a.shift_offset.is_multiple_of(8) {
            return Err(CudaError::Driver("misaligned kv_import offsets".into()));
        }
        if staged == 0 {
            return Ok(());
        }
        let (sk, sv, kc, vc, sh) = (
            a.stage_k.at(a.stage_offset),
            a.stage_v.at(a.stage_offset),
            a.keys.at(a.first_layer * layer_bytes),
            a.values.at(a.first_layer * layer_bytes),
            a.shift.at(a.shift_offset),
        );
        let (first, len_i, layers, heads, hd, cap, pairs_i, neox_i) = (
            i32_of(a.first_slot, "slot")?,
            i32_of(a.len, "len")?,
            i32_of(a.layers, "layers")?,
            i32_of(a.kv_heads, "kv heads")?,
            i32_of(a.head_dim, "head_dim")?,
            i32_of(a.capacity, "capacity")?,
            i32_of(a.pairs, "pairs")?,
            i32::from(a.neox),
        );
        let mut b = self.lane(lane).launch_builder(self.func("kv_import")?);
        b.arg(&sk)
            .arg(&sv)
            .arg(&kc)
            .arg(&vc)
            .arg(&first)
            .arg(&len_i)
            .arg(&layers)
            .arg(&heads)
            .arg(&hd)
            .arg(&cap)
            .arg(&sh)
            .arg(&pairs_i)
            .arg(&neox_i);
        // SAFETY: one thread per staged value of the layers (inside the stages from their
        // offset, checked above); the pointers to the caches start at the first layer, and
        // every destination slot, below `capacity`, lies inside them (checked above).
        unsafe { b.launch(elementwise(staged / 2)) }?;
        Ok(())
    }

    /// [`Device::kv_import_on`] on the compute lane.
    pub fn kv_import(&self, a: &KvImport<'_>) -> Result<()> {
        self.kv_import_on(Lane::Compute, a)
    }

    /// Bytes of partial results [`Device::attention`] needs for `n_q` queries over `kv_len`
    /// slots.
    pub fn attention_scratch(n_q: usize, n_head: usize, head_dim: usize, kv_len: usize) -> usize {
        match gemm_attention_layout(n_q, n_head, head_dim, kv_len) {
            Some(layout) => layout.total,
            None => n_q * n_head * attention_splits(n_q, kv_len) * (head_dim + 2) * 4,
        }
    }

    /// Scaled dot-product attention of each query over the slots of one layer's cache whose
    /// position is at most the query's (the CPU kernel's mask), split over ranges of slots and
    /// merged (flash decoding).
    pub fn attention(&self, a: &AttentionArgs<'_>) -> Result<()> {
        attention_heads(a.n_head, a.kv_heads, a.head_dim)?;
        let q_width = a.n_head * a.head_dim;
        let rows = a.first_row + a.n_q;
        need(a.q, rows * q_width * 4, "attention queries")?;
        need(a.q_pos, rows * 4, "attention query positions")?;
        need(a.out, rows * q_width * 4, "attention output")?;
        need(a.kv_pos, a.kv_len * 4, "attention slot positions")?;
        let layer = a.kv_heads * a.capacity * a.head_dim * 2;
        need(a.keys, a.cache_offset + layer, "attention key cache")?;
        need(a.values, a.cache_offset + layer, "attention value cache")?;
        let splits = attention_splits(a.n_q, a.kv_len);
        need(
            a.partial,
            Self::attention_scratch(a.n_q, a.n_head, a.head_dim, a.kv_len),
            "attention partials",
        )?;
        if a.n_q == 0 {
            return Ok(());
        }
        let part_o = a.partial.at(0);
        let part_ml = a.partial.at(a.n_q * a.n_head * splits * a.head_dim * 4);
        let (qp, kc, vc, kvp, qpp, op) = (
            a.q.at(a.first_row * q_width * 4),
            a.keys.at(a.cache_offset),
            a.values.at(a.cache_offset),
            a.kv_pos.at(0),
            a.q_pos.at(a.first_row * 4),
            a.out.at(a.first_row * q_width * 4),
        );
        let (n_q, n_head, kv_heads, hd, cap, kv_len) = (
            i32_of(a.n_q, "queries")?,
            i32_of(a.n_head, "heads")?,
            i32_of(a.kv_heads, "kv heads")?,
            i32_of(a.head_dim, "head_dim")?,
            i32_of(a.capacity, "capacity")?,
            i32_of(a.kv_len, "kv_len")?,
        );
        if let Some(layout) = gemm_attention_layout(a.n_q, a.n_head, a.head_dim, a.kv_len) {
            return self.attention_gemm(a, &layout);
        }
        if a.n_q <= DECODE_QUERIES {
            let per_split = i32_of(a.kv_len.div_ceil(splits), "slots per split")?;
            let mut b = self.stream.launch_builder(self.func("attention_decode")?);
            b.arg(&qp)
                .arg(&kc)
                .arg(&vc)
                .arg(&kvp)
                .arg(&qpp)
                .arg(&part_o)
                .arg(&part_ml)
                .arg(&n_head)
                .arg(&kv_heads)
                .arg(&hd)
                .arg(&cap)
                .arg(&kv_len)
                .arg(&a.scale)
                .arg(&per_split);
            let cfg = LaunchConfig {
                grid_dim: (a.n_head as u32, splits as u32, a.n_q as u32),
                block_dim: (32 * DECODE_WARPS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: reads the n_q queries, kv_len slots of the layer's caches and their
            // positions; writes n_q * n_head * splits partials (sizes checked above).
            unsafe { b.launch(cfg) }?;
        } else {
            let tiles = i32_of(a.kv_len.div_ceil(KEY_TILE), "tiles")?;
            let smem = (2 * KEY_TILE * (a.head_dim + 4) + ATTENTION_WARPS * a.head_dim) * 4;
            let f = self.func("attention")?;
            if smem > 48 * 1024 {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    smem as i32,
                )?;
            }
            let mut b = self.stream.launch_builder(f);
            b.arg(&qp)
                .arg(&kc)
                .arg(&vc)
                .arg(&kvp)
                .arg(&qpp)
                .arg(&part_o)
                .arg(&part_ml)
                .arg(&n_q)
                .arg(&n_head)
                .arg(&kv_heads)
                .arg(&hd)
                .arg(&cap)
                .arg(&kv_len)
                .arg(&a.scale)
                .arg(&tiles);
            let cfg = LaunchConfig {
                grid_dim: (a.n_q.div_ceil(ATTENTION_WARPS) as u32, a.n_head as u32, 1),
                block_dim: (32 * ATTENTION_WARPS as u32, 1, 1),
                shared_mem_bytes: smem as u32,
            };
            // SAFETY: reads kv_len slots of the layer's caches and their positions, n_q
            // queries; writes n_q * n_head partials; all sizes checked above.
            unsafe { b.launch(cfg) }?;
        }
        self.attention_combine_at(part_o, part_ml, op, a.n_q, a.n_head, a.head_dim, splits)
    }

    /// Merges the `splits` partial results of each of `rows` rows' heads (the partials at the
    /// start of `partial`, laid out as [`Device::attention`] writes them) into `out`.
    fn attention_combine(
        &self,
        partial: &Buffer,
        out: &Buffer,
        rows: usize,
        n_head: usize,
        head_dim: usize,
        splits: usize,
    ) -> Result<()> {
        let part_ml = partial.at(rows * n_head * splits * head_dim * 4);
        let (part_o, op) = (partial.at(0), out.at(0));
        self.attention_combine_at(part_o, part_ml, op, rows, n_head, head_dim, splits)
    }

    /// [`Device::attention_combine`] at device addresses the caller has checked: the partials'
    /// outputs and (max, sum) pairs, and the rows' output.
    #[allow(clippy::too_many_arguments)]
    fn attention_combine_at(
        &self,
        part_o: u64,
        part_ml: u64,
        out: u64,
        rows: usize,
        n_head: usize,
        head_dim: usize,
        splits: usize,
    ) -> Result<()> {
        let (n_head_i, hd, splits_i) = (
            i32_of(n_head, "heads")?,
            i32_of(head_dim, "head_dim")?,
            i32_of(splits, "splits")?,
        );
        let mut b = self.stream.launch_builder(self.func("attention_combine")?);
        b.arg(&part_o)
            .arg(&part_ml)
            .arg(&out)
            .arg(&n_head_i)
            .arg(&hd)
            .arg(&splits_i);
        let cfg = LaunchConfig {
            grid_dim: ((rows * n_head) as u32, 1, 1),
            block_dim: (head_dim as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per (row, head) reading its splits' partials, writing its head
        // (the callers checked both against rows, heads and splits).
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

/// How many slot ranges one attention call is split into.
impl Device {
    /// [`Device::attention`] of a prefill-sized call: per KV head, the scores of its stacked
    /// query heads against the slots (one strided batched GEMM over the KV heads, f16 inputs,
    /// f32 scores), a masked softmax to f16 probabilities, and their product with the values
    /// (a second batched GEMM), as dense-attention libraries do without a fused kernel.
    fn attention_gemm(&self, a: &AttentionArgs<'_>, l: &GemmAttention) -> Result<()> {
        let (n, hd, heads) = (a.n_q, a.head_dim, a.n_head);
        let group = heads / a.kv_heads;
        let q_width = heads * hd;
        let (n_i, heads_i, hd_i, kv_i) = (
            i32_of(n, "queries")?,
            i32_of(heads, "heads")?,
            i32_of(hd, "head_dim")?,
            i32_of(a.kv_len, "kv_len")?,
        );
        let gn = i32_of(group * n, "stacked queries")?;
        let batch = i32_of(a.kv_heads, "kv heads")?;
        let (qp, q16, sp, pp, op) = (
            a.q.at(a.first_row * q_width * 4),
            a.partial.at(l.q16),
            a.partial.at(l.scores),
            a.partial.at(l.probs),
            a.partial.at(l.out),
        );
        let mut b = self.stream.launch_builder(self.func("heads_to_f16")?);
        b.arg(&qp).arg(&q16).arg(&n_i).arg(&heads_i).arg(&hd_i);
        // SAFETY: n * q_width values in (checked by the caller) and out (scratch layout).
        unsafe { b.launch(elementwise(n * q_width)) }?;
        let (scale, zero, one) = (a.scale, 0.0f32, 1.0f32);
        let cache_stride = (a.capacity * hd) as i64;
        // Scores, column-major S^T (kv_len x group*n) = K (as stored: hd x kv_len, transposed)
        // times the head-major queries (hd x group*n), per KV head.
        // SAFETY: the handle is bound to this stream; every operand lies inside its buffer: the
        // caches hold kv_heads * capacity * hd f16 from cache_offset, the scratch the layout.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_T,
                cublasOperation_t::CUBLAS_OP_N,
                kv_i,
                gn,
                hd_i,
                (&scale as *const f32).cast(),
                a.keys.at(a.cache_offset) as *const _,
                cudaDataType::CUDA_R_16F,
                hd_i,
                cache_stride,
                q16 as *const _,
                cudaDataType::CUDA_R_16F,
                hd_i,
                (group * n * hd) as i64,
                (&zero as *const f32).cast(),
                sp as *mut _,
                cudaDataType::CUDA_R_32F,
                kv_i,
                (group * n * a.kv_len) as i64,
                batch,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }?;
        let (kvp, qpp) = (a.kv_pos.at(0), a.q_pos.at(a.first_row * 4));
        let mut b = self.stream.launch_builder(self.func("softmax_masked")?);
        b.arg(&sp).arg(&pp).arg(&kvp).arg(&qpp).arg(&n_i).arg(&kv_i);
        let cfg = LaunchConfig {
            grid_dim: ((heads * n) as u32, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: one block per score row, inside the scratch layout; kv_len slot positions
        // and n query positions (checked by the caller).
        unsafe { b.launch(cfg) }?;
        // Outputs, column-major O^T (hd x group*n) = V (hd x kv_len) times P^T (kv_len x
        // group*n), per KV head.
        // SAFETY: as for the scores.
        unsafe {
            cudarc::cublas::result::gemm_strided_batched_ex(
                *self.blas.handle(),
                cublasOperation_t::CUBLAS_OP_N,
                cublasOperation_t::CUBLAS_OP_N,
                hd_i,
                gn,
                kv_i,
                (&one as *const f32).cast(),
                a.values.at(a.cache_offset) as *const _,
                cudaDataType::CUDA_R_16F,
                hd_i,
                cache_stride,
                pp as *const _,
                cudaDataType::CUDA_R_16F,
                kv_i,
                (group * n * a.kv_len) as i64,
                (&zero as *const f32).cast(),
                op as *mut _,
                cudaDataType::CUDA_R_32F,
                hd_i,
                (group * n * hd) as i64,
                batch,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT_TENSOR_OP,
            )
        }?;
        let out = a.out.at(a.first_row * q_width * 4);
        let mut b = self.stream.launch_builder(self.func("heads_from")?);
        b.arg(&op).arg(&out).arg(&n_i).arg(&heads_i).arg(&hd_i);
        // SAFETY: n * q_width values each way (checked by the caller, scratch layout).
        unsafe { b.launch(elementwise(n * q_width)) }?;
        Ok(())
    }
}

/// Byte offsets of the cuBLAS attention's scratch: f16 queries by head, f32 scores, f16
/// probabilities, f32 outputs by head.
struct GemmAttention {
    q16: usize,
    scores: usize,
    probs: usize,
    out: usize,
    total: usize,
}

/// Calls of more than [`DECODE_QUERIES`] queries run attention as batched cuBLAS GEMMs when
/// the scores fit in this many bytes (a 512-token prefill piece over 4,096 slots of 32 heads
/// needs 400 MiB); beyond it, the tiled kernel.
const GEMM_ATTENTION_LIMIT: usize = 2 << 30;

fn gemm_attention_layout(
    n_q: usize,
    n_head: usize,
    head_dim: usize,
    kv_len: usize,
) -> Option<GemmAttention> {
    if n_q <= DECODE_QUERIES {
        return None;
    }
    let align = |b: usize| b.next_multiple_of(256);
    let q16 = 0;
    let scores = align(n_q * n_head * head_dim * 2);
    let probs = scores + align(n_head * n_q * kv_len * 4);
    let out = probs + align(n_head * n_q * kv_len * 2);
    let total = out + n_q * n_head * head_dim * 4;
    (total <= GEMM_ATTENTION_LIMIT).then_some(GemmAttention {
        q16,
        scores,
        probs,
        out,
        total,
    })
}

/// Only decode-sized calls are split: a prefill's query blocks already fill the GPU, and its
/// partials would grow with queries times slots.
fn attention_splits(n_q: usize, kv_len: usize) -> usize {
    if n_q > DECODE_QUERIES {
        return 1;
    }
    kv_len
        .div_ceil(DECODE_SLOTS_PER_SPLIT)
        .clamp(1, DECODE_MAX_SPLITS)
}

/// An error unless the attention kernels take heads of this shape.
fn attention_heads(n_head: usize, kv_heads: usize, head_dim: usize) -> Result<()> {
    if !head_dim.is_multiple_of(32) || head_dim > 256 {
        return Err(CudaError::Unsupported(format!(
            "attention heads of {head_dim} values (multiples of 32 up to 256 run on the GPU)"
        )));
    }
    if kv_heads == 0 || !n_head.is_multiple_of(kv_heads) {
        return Err(CudaError::Unsupported(format!(
            "{n_head} query heads over {kv_heads} KV heads"
        )));
    }
    Ok(())
}

/// Checks a RoPE call's angles and pairs; whether it has anything to rotate.
fn rope_work(angles: &Buffer, rows: usize, head_dim: usize, pairs: usize) -> Result<bool> {
    need(angles, rows * pairs * 8, "rope angles")?;
    if 2 * pairs > head_dim {
        return Err(CudaError::Unsupported(format!(
            "{pairs} rotary pairs in {head_dim}-wide heads"
        )));
    }
    Ok(rows > 0 && pairs > 0)
}

/// One block of [`THREADS`] per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elementwise(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks(n).max(1), 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_launch_names_a_shape_and_a_persistent_grid() {
        assert_eq!(GemvLaunch::parse("default").unwrap(), GemvLaunch::default());
        let l = GemvLaunch::parse("r4w4/p8").unwrap();
        assert_eq!(GEMV_SHAPES[l.shape.unwrap()], ("r4w4", 4, 4));
        assert_eq!(l.blocks_per_sm, Some(8));
        let l = GemvLaunch::parse("default/p2").unwrap();
        assert_eq!((l.shape, l.blocks_per_sm), (None, Some(2)));
        for bad in ["r3w3", "r1w4/8", "r1w4/p0", "default/px"] {
            assert!(GemvLaunch::parse(bad).is_err(), "{bad}");
        }
    }

    /// The fused kernels' Q8_1 output sits where the GEMVs read it: the layout of
    /// `q8_scratch`, values first and the group scales after them, 16-byte aligned.
    #[test]
    fn q8_scratch_holds_values_then_aligned_scales() {
        for (n, cols) in [(1usize, 576usize), (8, 4096), (3, 1536)] {
            let values = (n * cols).next_multiple_of(16);
            assert_eq!(Device::q8_scratch(n, cols), values + n * cols / 32 * 8);
            assert_eq!(values % 16, 0);
        }
        assert!(Device::q8_scratch(8, 11008) >= Device::q8_scratch(7, 11008));
    }
}
