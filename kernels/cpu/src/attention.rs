//! Attention of query tokens over an f16 KV cache: tiled with an online softmax (flash-attention
//! style) so long prompts never hold the full score matrix, grouped-query aware, masked by
//! position.
//!
//! Work is split into tasks of (KV head, tile of query tokens, slice of the cache). A task
//! converts each tile of keys and values from f16 once and reuses it for every query head of
//! the group and every token of the query tile; small tasks (decode) on AVX-512 read the f16
//! straight into their FMAs instead, with the same arithmetic and so the same bits. Keys are transposed into `[head_dim][KV_TILE]`
//! so scores for one query row are computed with broadcasts and FMAs and no horizontal sums.
//! Decode (few query tokens) splits the cache across threads and merges the partial softmax
//! states afterwards.

use half::f16;

use std::cell::RefCell;
use std::sync::OnceLock;

use crate::blocks::f16_bits_to_f32;
use crate::dot::Isa;
use crate::error::{KernelError, Result};
use crate::pool::ThreadPool;

/// Cache slots per tile: 64 keys of up to 128 dims in f32 (32 KiB) plus the same of values fit
/// in L2 next to the scores, and 64 lanes keep four AVX-512 accumulators busy per query row.
pub const KV_TILE: usize = 64;
/// Query rows computed together (at most): 4 rows x 64 keys of scores are 16 AVX-512 registers
/// (half of the register file), and each key row loaded from the tile then feeds 4 rows. A GQA
/// group of 3 (SmolLM2, and 6, 9, ...) takes blocks of 3 instead, so a decode step's 3 rows fill
/// whole blocks; a row's arithmetic does not depend on the block size.
const ROW_BLOCK: usize = 4;
/// Row block of the converting AVX-512 kernel (prefill) for GQA groups of 3: 2 tokens x 3 heads.
/// 6 x 4 score accumulators and 4 key vectors fit the 32 zmm registers, and each key or value
/// row loaded feeds 6 rows instead of 3: 5-10% faster than blocks of 3 at 2048 tokens
/// (`examples/attention_prefill`, alternating runs). A row's arithmetic does not depend on the
/// block, so decode (blocks of 3) and prefill still agree bit for bit.
#[cfg(target_arch = "x86_64")]
const WIDE_ROW_BLOCK: usize = 6;
/// Output dimensions accumulated together: 4 rows x 64 dims, again 16 AVX-512 registers.
const DIM_BLOCK: usize = 64;
/// Query tokens per task: with a GQA group of 4 that is 128 query rows sharing every converted
/// key/value tile, which amortises the conversion while the scores (128 x 64 f32) stay in L2.
pub const Q_TILE: usize = 32;

/// One attention call.
pub struct Attention<'a> {
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads; each serves `n_head / n_head_kv` query heads.
    pub n_head_kv: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Multiplies every score (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Queries, `[n_q][n_head * head_dim]`, already rotated.
    pub q: &'a [f32],
    /// Position of each query token.
    pub q_pos: &'a [i32],
    /// Per KV head, the keys of the cache in tiles of [`KV_TILE`] slots, each tile transposed:
    /// `[len.div_ceil(KV_TILE)][head_dim][KV_TILE]` (see [`key_tile_index`]). Lanes of the last
    /// tile past `len` are never used, whatever they hold.
    pub keys: &'a [&'a [f16]],
    /// Per KV head, the values of the cache, `[len][head_dim]`.
    pub values: &'a [&'a [f16]],
    /// Position of each cache slot. A query at position `p` sees the slots at positions `<= p`.
    pub kv_pos: &'a [i32],
}

impl Attention<'_> {
    fn validate(&self, out: &[f32]) -> Result<()> {
        let len = self.kv_pos.len();
        let hd = self.head_dim;
        let check = |what: &'static str, expected: usize, actual: usize| {
            if expected == actual {
                Ok(())
            } else {
                Err(KernelError::LengthMismatch {
                    what,
                    expected,
                    actual,
                })
            }
        };
        if self.n_head_kv == 0 || hd == 0 || !self.n_head.is_multiple_of(self.n_head_kv) {
            return Err(KernelError::LengthMismatch {
                what: "attention heads (n_head must be a positive multiple of n_head_kv)",
                expected: self.n_head_kv,
                actual: self.n_head,
            });
        }
        let n_q = self.q_pos.len();
        check("attention queries", n_q * self.n_head * hd, self.q.len())?;
        check("attention output", self.q.len(), out.len())?;
        check("attention key heads", self.n_head_kv, self.keys.len())?;
        check("attention value heads", self.n_head_kv, self.values.len())?;
        for (k, v) in self.keys.iter().zip(self.values) {
            check(
                "attention keys",
                len.div_ceil(KV_TILE) * KV_TILE * hd,
                k.len(),
            )?;
            check("attention values", len * hd, v.len())?;
        }
        Ok(())
    }
}

/// Where the key of cache slot `slot`, dimension `d`, lives in the tiled key layout of
/// [`Attention::keys`].
#[inline]
pub fn key_tile_index(slot: usize, d: usize, head_dim: usize) -> usize {
    (slot / KV_TILE) * head_dim * KV_TILE + d * KV_TILE + slot % KV_TILE
}

/// Computes `out[i] = softmax(scale * q_i K^T, masked by position) V` for every query token and
/// head, on the pool's threads. Rows that see no slot at all get zeros.
pub fn attention(a: &Attention<'_>, out: &mut [f32], pool: &ThreadPool) -> Result<()> {
    attention_many(std::slice::from_ref(a), &mut [out], pool)
}

/// [`attention`] of several independent calls (the sequences of a batched decode step, each
/// over its own cache) in one pool dispatch: `outs[i]` gets call `i`'s result, bit for bit what
/// [`attention`] on it alone gives (each call is split into tasks as it would be alone).
pub fn attention_many(
    calls: &[Attention<'_>],
    outs: &mut [&mut [f32]],
    pool: &ThreadPool,
) -> Result<()> {
    if calls.len() != outs.len() {
        return Err(KernelError::LengthMismatch {
            what: "attention outputs",
            expected: calls.len(),
            actual: outs.len(),
        });
    }
    for (a, out) in calls.iter().zip(outs.iter()) {
        a.validate(out)?;
    }
    let threads = pool.n_threads();
    // Per call: the position range of each key tile (to skip tiles no query of a task can see
    // and to drop the mask where every query sees the whole tile) and its split count.
    let mut ranges: Vec<Vec<(i32, i32)>> = Vec::with_capacity(calls.len());
    let mut splits_of: Vec<usize> = Vec::with_capacity(calls.len());
    // (call, task), call after call.
    let mut tasks: Vec<(usize, Task)> = Vec::new();
    for (ci, a) in calls.iter().enumerate() {
        let n_q = a.q_pos.len();
        let n_kv_tiles = a.kv_pos.len().div_ceil(KV_TILE);
        let n_q_tiles = n_q.div_ceil(Q_TILE);
        ranges.push(
            a.kv_pos
                .chunks(KV_TILE)
                .map(|c| (*c.iter().min().unwrap(), *c.iter().max().unwrap()))
                .collect(),
        );
        let base_tasks = a.n_head_kv * n_q_tiles;
        // Few tasks (decode): split the cache into slices so there are at least two tasks per
        // thread and a multiple of the thread count (3 KV heads on 2 threads would leave one
        // thread idle for a third of the call).
        let splits = if n_q == 0 || base_tasks >= 2 * threads || n_kv_tiles < 2 {
            1
        } else {
            let mut s = (2 * threads).div_ceil(base_tasks);
            while !(base_tasks * s).is_multiple_of(threads) && s < n_kv_tiles {
                s += 1;
            }
            s.min(n_kv_tiles)
        };
        splits_of.push(splits);
        let tiles_per_split = n_kv_tiles.div_ceil(splits);
        for kvh in 0..a.n_head_kv {
            for qt in 0..n_q_tiles {
                for sp in 0..splits {
                    tasks.push((
                        ci,
                        Task {
                            kvh,
                            q0: qt * Q_TILE,
                            q1: ((qt + 1) * Q_TILE).min(n_q),
                            t0: sp * tiles_per_split,
                            t1: ((sp + 1) * tiles_per_split).min(n_kv_tiles),
                        },
                    ));
                }
            }
        }
    }
    if tasks.is_empty() {
        return Ok(());
    }

    let isa = Isa::detected();
    let results: Vec<OnceLock<Partial>> = tasks.iter().map(|_| OnceLock::new()).collect();
    pool.run(tasks.len(), |i| {
        let (ci, task) = &tasks[i];
        let partial = SCRATCH.with(|sc| {
            let mut sc = sc.borrow_mut();
            sc.fit(calls[*ci].head_dim);
            run_task(isa, &calls[*ci], task, &ranges[*ci], &mut sc)
        });
        // Each index runs exactly once, so the slot is empty.
        let _ = results[i].set(partial);
    });
    let mut partials = results
        .into_iter()
        .map(|r| r.into_inner().expect("the pool ran every task"));

    // Merge the splits of each (call, KV head, query tile) and write normalised rows.
    let mut next = 0;
    for (ci, a) in calls.iter().enumerate() {
        let n_tasks = a.n_head_kv * a.q_pos.len().div_ceil(Q_TILE) * splits_of[ci];
        let own: Vec<Partial> = partials.by_ref().take(n_tasks).collect();
        merge(
            a,
            &tasks[next..next + n_tasks],
            own,
            splits_of[ci],
            outs[ci],
        );
        next += n_tasks;
    }
    Ok(())
}

/// Merges the partial softmax states of one call's tasks (`splits` consecutive tasks per KV
/// head and query tile) into normalised output rows.
fn merge(
    a: &Attention<'_>,
    tasks: &[(usize, Task)],
    partials: Vec<Partial>,
    splits: usize,
    out: &mut [f32],
) {
    let hd = a.head_dim;
    let group = a.n_head / a.n_head_kv;
    let qw = a.n_head * hd;
    for (chunk, tchunk) in partials.chunks(splits).zip(tasks.chunks(splits)) {
        let task = &tchunk[0].1;
        let rows = group * (task.q1 - task.q0);
        for r in 0..rows {
            let m = chunk
                .iter()
                .map(|p| p.m[r])
                .fold(f32::NEG_INFINITY, f32::max);
            let (qi, hg) = (task.q0 + r / group, r % group);
            let h = task.kvh * group + hg;
            let dst = &mut out[qi * qw + h * hd..qi * qw + (h + 1) * hd];
            dst.fill(0.0);
            if m == f32::NEG_INFINITY {
                continue;
            }
            let mut l = 0.0;
            for p in chunk {
                if p.m[r] == f32::NEG_INFINITY {
                    continue;
                }
                let w = (p.m[r] - m).exp();
                l += w * p.l[r];
                for (d, &o) in dst.iter_mut().zip(&p.o[r * hd..(r + 1) * hd]) {
                    *d += w * o;
                }
            }
            let inv = 1.0 / l;
            dst.iter_mut().for_each(|d| *d *= inv);
        }
    }
}

/// A unit of work: one KV head, query tokens `q0..q1`, key tiles `t0..t1`.
struct Task {
    kvh: usize,
    q0: usize,
    q1: usize,
    t0: usize,
    t1: usize,
}

impl Task {
    /// The lowest and highest position of the task's queries.
    fn q_range(&self, a: &Attention<'_>) -> (i32, i32) {
        let q_pos = &a.q_pos[self.q0..self.q1];
        let q_min = *q_pos.iter().min().expect("a task has queries");
        let q_max = *q_pos.iter().max().expect("a task has queries");
        (q_min, q_max)
    }

    /// Rows `r0 .. r0 + nr` of the task (row = query token x head of the group) as a block of
    /// `RB`: each row's query and position; rows past `nr` get `zeros` (a stand-in query) and
    /// the position `i32::MIN`.
    #[inline(always)]
    fn block_queries<'q, const RB: usize>(
        &self,
        a: &Attention<'q>,
        r0: usize,
        nr: usize,
        zeros: &'q [f32],
    ) -> ([&'q [f32]; RB], [i32; RB]) {
        let (hd, group) = (a.head_dim, a.n_head / a.n_head_kv);
        let qw = a.n_head * hd;
        let mut qrows: [&[f32]; RB] = [zeros; RB];
        let mut qpos = [i32::MIN; RB];
        for i in 0..nr {
            let r = r0 + i;
            let (qi, hg) = (self.q0 + r / group, r % group);
            let h = self.kvh * group + hg;
            qrows[i] = &a.q[qi * qw + h * hd..qi * qw + (h + 1) * hd];
            qpos[i] = a.q_pos[qi];
        }
        (qrows, qpos)
    }
}

/// The unnormalised softmax state of a task's rows (row = query token x head of the group):
/// running max `m`, sum of weights `l`, weighted sum of values `o`.
struct Partial {
    m: Vec<f32>,
    l: Vec<f32>,
    o: Vec<f32>,
}

impl Partial {
    /// The state before any tile, for `rows` rows of `hd` dimensions. The outputs come in whole
    /// row blocks of `RB`, so a kernel reads and writes every row of a block without runtime
    /// row indices (which would keep its accumulators out of registers).
    fn empty<const RB: usize>(rows: usize, hd: usize) -> Partial {
        Partial {
            m: vec![f32::NEG_INFINITY; rows],
            l: vec![0.0; rows],
            o: vec![0.0; rows.div_ceil(RB) * RB * hd],
        }
    }
}

/// Per-thread buffers, reused across tasks.
struct Scratch {
    /// Keys of one tile, transposed: `[head_dim][KV_TILE]`.
    kt: Vec<f32>,
    /// Values of one tile: `[KV_TILE][head_dim]`.
    v: Vec<f32>,
    /// Key positions of the tile.
    pos: Vec<i32>,
    /// The current row block's queries, transposed: `[head_dim][ROW_BLOCK]`.
    qt: Vec<[f32; ROW_BLOCK]>,
}

thread_local! {
    /// Each thread's scratch, kept across calls: a decode step runs a few small tasks per
    /// layer, and allocating (and zeroing) 40 KiB per task cost as much as a task's work.
    static SCRATCH: RefCell<Scratch> = const { RefCell::new(Scratch::EMPTY) };
}

impl Scratch {
    const EMPTY: Scratch = Scratch {
        kt: Vec::new(),
        v: Vec::new(),
        pos: Vec::new(),
        qt: Vec::new(),
    };

    /// Buffers for `hd`-dimensional heads.
    #[cfg(test)]
    fn new(hd: usize) -> Scratch {
        let mut s = Scratch::EMPTY;
        s.fit(hd);
        s
    }

    /// Sizes the buffers for `hd`-dimensional heads. Their contents are not reset: a task
    /// writes every element it reads (the tile conversion fills `kt`, `v` and `pos`, the row
    /// block fills `qt`).
    fn fit(&mut self, hd: usize) {
        self.kt.resize(hd * KV_TILE, 0.0);
        self.v.resize(KV_TILE * hd, 0.0);
        self.pos.resize(KV_TILE, 0);
        self.qt.resize(hd, [0.0; ROW_BLOCK]);
    }
}

/// Runs one task with the copy of the kernel compiled for `isa` (the crate's one ISA choice,
/// detected once; see `dot::Isa`).
fn run_task(
    isa: Isa,
    a: &Attention<'_>,
    t: &Task,
    ranges: &[(i32, i32)],
    s: &mut Scratch,
) -> Partial {
    let group = a.n_head / a.n_head_kv;
    if !group.is_multiple_of(ROW_BLOCK) && group.is_multiple_of(3) {
        run_task_rb::<3>(isa, a, t, ranges, s)
    } else {
        run_task_rb::<ROW_BLOCK>(isa, a, t, ranges, s)
    }
}

/// [`run_task`] with row blocks of `RB` rows.
fn run_task_rb<const RB: usize>(
    isa: Isa,
    a: &Attention<'_>,
    t: &Task,
    ranges: &[(i32, i32)],
    s: &mut Scratch,
) -> Partial {
    match isa {
        Isa::Scalar => task_kernel::<RB>(a, t, ranges, s, convert_portable, |x, y, z| x * y + z),
        // SAFETY: `Isa::Avx2` is only chosen on CPUs with AVX2, FMA and F16C.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { task_avx2::<RB>(a, t, ranges, s) },
        // SAFETY: `Isa::Avx512` is only chosen on CPUs with AVX-512 F/BW/VL (and VNNI) on top
        // of everything `Avx2` needs.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx512Bw => unsafe {
            if f16_direct::<RB>(a, t) {
                task_avx512_f16::<RB>(a, t, ranges, s)
            } else {
                task_avx512::<RB>(a, t, ranges, s)
            }
        },
    }
}

/// Row blocks per task up to which the AVX-512 kernel reads keys and values as f16 straight
/// into its FMAs ([`task_avx512_f16`]) instead of converting each tile into the scratch first.
/// A decode task (one token: one row block) uses each converted element for one block only, so
/// the conversion's stores and reloads cost more than they save: with it, converting was about
/// 45% of the attention time of a batched decode step of 8 sequences over 512 tokens. Prefill
/// tasks (up to [`Q_TILE`] tokens) reuse each converted tile for many blocks and keep it.
const F16_DIRECT_MAX_ROW_BLOCKS: usize = 2;

/// Whether task `t` of `a` runs on [`task_avx512_f16`] (head widths in whole [`DIM_BLOCK`]s).
fn f16_direct<const RB: usize>(a: &Attention<'_>, t: &Task) -> bool {
    let rows = a.n_head / a.n_head_kv * (t.q1 - t.q0);
    a.head_dim.is_multiple_of(DIM_BLOCK) && rows.div_ceil(RB) <= F16_DIRECT_MAX_ROW_BLOCKS
}

/// The kernel for AVX2 + FMA: tiles converted to f32 once, then [`tile_rows_avx2`] with the
/// row block's accumulators in registers. Head widths that are not whole [`AVX2_LANES`] take
/// [`task_kernel`] compiled for AVX2 instead.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2<const RB: usize>(
    a: &Attention<'_>,
    t: &Task,
    r: &[(i32, i32)],
    s: &mut Scratch,
) -> Partial {
    if a.head_dim.is_multiple_of(AVX2_LANES) {
        // SAFETY: the caller guarantees the CPU features.
        return unsafe {
            if RB == 3 {
                task_avx2_tiles::<WIDE_ROW_BLOCK>(a, t, r, s)
            } else {
                task_avx2_tiles::<RB>(a, t, r, s)
            }
        };
    }
    task_kernel::<RB>(
        a,
        t,
        r,
        s,
        |src, dst| {
            // SAFETY: this function only runs on CPUs with F16C (checked by `Isa::detected`).
            unsafe { convert_f16c(src, dst) }
        },
        f32::mul_add,
    )
}

/// Key slots (scores) or value dimensions (outputs) the AVX2 kernel computes per pass: two ymm
/// per row, so a block of 6 rows is 12 accumulators, plus 2 key or value vectors and a
/// broadcast: 15 of the 16 registers.
#[cfg(target_arch = "x86_64")]
const AVX2_LANES: usize = 16;

/// One task on AVX2: [`task_avx512_tiles`]'s structure (each tile converted to f32 once, the
/// online softmax per row block) with passes of [`AVX2_LANES`] slots or dimensions, whose
/// accumulators stay in registers.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `head_dim` must be whole [`AVX2_LANES`] (checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn task_avx2_tiles<const RB: usize>(
    a: &Attention<'_>,
    t: &Task,
    ranges: &[(i32, i32)],
    sc: &mut Scratch,
) -> Partial {
    let hd = a.head_dim;
    assert!(hd.is_multiple_of(AVX2_LANES), "head width {hd}");
    for_each_tile::<RB>(a, t, ranges, sc, |tl, kt, vt, skt, sv, part| {
        // SAFETY: the caller guarantees the CPU features; the scratch holds a whole tile.
        unsafe {
            let (kt, vt) = convert_tile(kt, vt, skt, sv);
            tile_rows_avx2::<RB>(a, t, tl, kt, vt, part);
        }
    })
}

/// [`tile_rows_avx512`] for AVX2: scores in passes of [`AVX2_LANES`] slots, the softmax on the
/// stored scores, outputs in passes of [`AVX2_LANES`] dimensions.
///
/// # Safety
/// The CPU must support AVX2, FMA and F16C; `kt` must hold `head_dim * KV_TILE` elements and
/// `vt` `tl.bk * head_dim` (checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
// Indexing the register block by (row, lane group) reads like the math.
#[allow(clippy::needless_range_loop)]
unsafe fn tile_rows_avx2<const RB: usize>(
    a: &Attention<'_>,
    t: &Task,
    tl: &TileRows<'_>,
    kt: &[f32],
    vt: &[f32],
    p: &mut Partial,
) {
    use std::arch::x86_64::*;
    const V: usize = AVX2_LANES / 8;
    let hd = a.head_dim;
    assert!(kt.len() >= hd * KV_TILE && vt.len() >= tl.bk * hd);
    let rows = p.m.len();
    for r0 in (0..rows).step_by(RB) {
        let nr = RB.min(rows - r0);
        let (qrows, qpos) = t.block_queries::<RB>(a, r0, nr, tl.zeros);
        if qpos[..nr].iter().all(|&q| q < tl.lo) {
            continue;
        }

        // Scores: s[i][j] = sum_d q_i[d] * kt[d][j], d in order, AVX2_LANES slots a pass.
        let mut s = [[0.0f32; KV_TILE]; RB];
        for j0 in (0..KV_TILE).step_by(AVX2_LANES) {
            let mut acc = [[_mm256_setzero_ps(); V]; RB];
            for d in 0..hd {
                let mut k = [_mm256_setzero_ps(); V];
                for (c, kc) in k.iter_mut().enumerate() {
                    // SAFETY: d * KV_TILE + j0 + 8c + 8 <= hd * KV_TILE <= kt.len().
                    *kc = unsafe { _mm256_loadu_ps(kt.as_ptr().add(d * KV_TILE + j0 + 8 * c)) };
                }
                for i in 0..RB {
                    let q = _mm256_set1_ps(qrows[i][d]);
                    for c in 0..V {
                        acc[i][c] = _mm256_fmadd_ps(q, k[c], acc[i][c]);
                    }
                }
            }
            for i in 0..RB {
                for c in 0..V {
                    // SAFETY: lanes j0 + 8c .. + 8 of a KV_TILE-long row.
                    unsafe { _mm256_storeu_ps(s[i][j0 + 8 * c..].as_mut_ptr(), acc[i][c]) };
                }
            }
        }

        // The online softmax, 8 lanes at a time over each row's stored scores.
        let mut correction = [1.0f32; RB];
        for i in 0..RB {
            if i >= nr || qpos[i] < tl.lo {
                s[i] = [0.0; KV_TILE];
                continue;
            }
            let row = &mut s[i];
            let qp = _mm256_set1_epi32(qpos[i]);
            let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
            for c in 0..KV_TILE / 8 {
                // SAFETY: lanes 8c..8c + 8 of the row and of the tile's KV_TILE positions.
                unsafe {
                    let mut x = _mm256_mul_ps(
                        _mm256_loadu_ps(row[8 * c..].as_ptr()),
                        _mm256_set1_ps(a.scale),
                    );
                    if tl.masked {
                        let pos = _mm256_loadu_si256(tl.pos[8 * c..].as_ptr().cast());
                        let after = _mm256_castsi256_ps(_mm256_cmpgt_epi32(pos, qp));
                        x = _mm256_blendv_ps(x, _mm256_set1_ps(f32::NEG_INFINITY), after);
                    }
                    _mm256_storeu_ps(row[8 * c..].as_mut_ptr(), x);
                    mx = _mm256_max_ps(mx, x);
                }
            }
            let tile_max = hmax256(mx);
            if tile_max == f32::NEG_INFINITY {
                *row = [0.0; KV_TILE];
                continue;
            }
            let (m, l) = (&mut p.m[r0 + i], &mut p.l[r0 + i]);
            let m_new = m.max(tile_max);
            correction[i] = if *m == f32::NEG_INFINITY {
                0.0
            } else {
                (*m - m_new).exp()
            };
            // `lane_sum`'s 16 partial sums as two halves of 8 (even and odd 8-lane groups).
            let mut sum = [_mm256_setzero_ps(); 2];
            for c in 0..KV_TILE / 8 {
                // SAFETY: lanes 8c..8c + 8 of the row; the caller guarantees AVX2 and FMA.
                unsafe {
                    let x = _mm256_loadu_ps(row[8 * c..].as_ptr());
                    let e = exp_approx_avx2(_mm256_sub_ps(x, _mm256_set1_ps(m_new)));
                    sum[c % 2] = _mm256_add_ps(sum[c % 2], e);
                    _mm256_storeu_ps(row[8 * c..].as_mut_ptr(), e);
                }
            }
            let mut lanes = [0.0f32; LANES];
            // SAFETY: two 8-lane stores into 16 lanes.
            unsafe {
                _mm256_storeu_ps(lanes.as_mut_ptr(), sum[0]);
                _mm256_storeu_ps(lanes[8..].as_mut_ptr(), sum[1]);
            }
            *l = *l * correction[i] + lanes.iter().sum::<f32>();
            *m = m_new;
        }

        // Outputs: o_i = o_i * correction_i + sum_j p_i[j] * v[j], AVX2_LANES dims a pass.
        let ob = &mut p.o[r0 * hd..(r0 + RB) * hd];
        for d0 in (0..hd).step_by(AVX2_LANES) {
            let mut acc = [[_mm256_setzero_ps(); V]; RB];
            for i in 0..RB {
                let cf = _mm256_set1_ps(correction[i]);
                for c in 0..V {
                    // SAFETY: lanes d0 + 8c .. + 8 of row i's hd outputs.
                    let y = unsafe { _mm256_loadu_ps(ob[i * hd + d0 + 8 * c..].as_ptr()) };
                    acc[i][c] = _mm256_mul_ps(y, cf);
                }
            }
            for j in 0..tl.bk {
                let mut v = [_mm256_setzero_ps(); V];
                for (c, vc) in v.iter_mut().enumerate() {
                    // SAFETY: j * hd + d0 + 8c + 8 <= bk * hd <= vt.len() (asserted).
                    *vc = unsafe { _mm256_loadu_ps(vt.as_ptr().add(j * hd + d0 + 8 * c)) };
                }
                for i in 0..RB {
                    let pij = _mm256_set1_ps(s[i][j]);
                    for c in 0..V {
                        acc[i][c] = _mm256_fmadd_ps(pij, v[c], acc[i][c]);
                    }
                }
            }
            for i in 0..RB {
                for c in 0..V {
                    // SAFETY: as for the loads above.
                    unsafe { _mm256_storeu_ps(ob[i * hd + d0 + 8 * c..].as_mut_ptr(), acc[i][c]) };
                }
            }
        }
    }
}

/// Maximum of 8 lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
fn hmax256(v: std::arch::x86_64::__m256) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    let m = _mm_max_ss(m, _mm_movehdup_ps(m));
    _mm_cvtss_f32(m)
}

/// f16 -> f32 with the F16C instruction, 8 values at a time.
///
/// # Safety
/// The CPU must support F16C and AVX; `dst` must be at least as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn convert_f16c(src: &[f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm256_cvtph_ps, _mm256_storeu_ps, _mm_loadu_si128};
    assert!(dst.len() >= src.len());
    let n8 = src.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: `i + 8 <= src.len() <= dst.len()`; unaligned loads and stores are used.
        unsafe {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }
    convert_portable(&src[n8..], &mut dst[n8..]);
}

/// The kernel for AVX-512 that converts each tile of keys and values to f32 once (prefill: many
/// row blocks reuse it), then runs [`tile_rows_avx512`] on the converted tile. Head widths that
/// are not whole [`DIM_BLOCK`]s take [`task_kernel`] compiled for AVX-512 instead.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn task_avx512<const RB: usize>(
    a: &Attention<'_>,
    t: &Task,
    r: &[(i32, i32)],
    s: &mut Scratch,
) -> Partial {
    if a.head_dim.is_multiple_of(DIM_BLOCK) {
        // SAFETY: the caller guarantees the CPU features.
        return unsafe {
            if RB == 3 {
                task_avx512_tiles::<WIDE_ROW_BLOCK, true>(a, t, r, s)
            } else {
                task_avx512_tiles::<RB, true>(a, t, r, s)
            }
        };
    }
    task_kernel::<RB>(
        a,
        t,
        r,
        s,
        |src, dst| {
            // SAFETY: this function only runs on CPUs with F16C (checked by `Isa::detected`).
            unsafe { convert_f16c(src, dst) }
        },
        f32::mul_add,
    )
}

/// The AVX-512 kernel for small tasks (see [`F16_DIRECT_MAX_ROW_BLOCKS`]): keys and values are
/// converted from f16 as they are loaded, with the same arithmetic as [`task_avx512`] (so the
/// same bits). Needs `head_dim` in whole [`DIM_BLOCK`]s.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL, FMA and F16C.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn task_avx512_f16<const RB: usize>(
    a: &Attention<'_>,
    t: &Task,
    r: &[(i32, i32)],
    s: &mut Scratch,
) -> Partial {
    // SAFETY: the caller guarantees the CPU features.
    unsafe { task_avx512_tiles::<RB, false>(a, t, r, s) }
}

/// Vectors of 16 f32 lanes per tile row (keys) or [`DIM_BLOCK`] (values).
#[cfg(target_arch = "x86_64")]
const VECS: usize = KV_TILE / 16;

/// 16 consecutive keys or values as 16 f32 lanes: f32 from a converted tile, f16 straight from
/// the cache (converted exactly, so both give the same lanes).
#[cfg(target_arch = "x86_64")]
trait Lanes: Copy {
    /// # Safety
    /// `p` must point at 16 readable elements, on a CPU with AVX-512 F and F16C.
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
}

#[cfg(target_arch = "x86_64")]
impl Lanes for f32 {
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        // SAFETY: the caller's contract.
        unsafe { std::arch::x86_64::_mm512_loadu_ps(p) }
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for f16 {
    #[inline(always)]
    unsafe fn load16(p: *const f16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::{_mm256_loadu_si256, _mm512_cvtph_ps};
        // SAFETY: the caller's contract.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p.cast())) }
    }
}

/// One task on AVX-512 with a row block's scores and outputs in registers: the arithmetic of
/// [`task_kernel`], operation for operation. With `CONVERT` each tile is converted to f32 in
/// the scratch first; without, keys and values are read as f16 (see [`f16_direct`]).
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL, FMA and F16C; `head_dim` must be whole
/// [`DIM_BLOCK`]s (checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn task_avx512_tiles<const RB: usize, const CONVERT: bool>(
    a: &Attention<'_>,
    t: &Task,
    ranges: &[(i32, i32)],
    sc: &mut Scratch,
) -> Partial {
    const { assert!(DIM_BLOCK == KV_TILE && KV_TILE.is_multiple_of(16)) };
    let hd = a.head_dim;
    assert!(hd.is_multiple_of(DIM_BLOCK), "head width {hd}");
    for_each_tile::<RB>(a, t, ranges, sc, |tl, kt, vt, skt, sv, part| {
        if CONVERT {
            // SAFETY: the caller guarantees the CPU features; the scratch holds a whole tile.
            unsafe {
                let (kt, vt) = convert_tile(kt, vt, skt, sv);
                tile_rows_avx512::<RB, f32>(a, t, tl, kt, vt, part);
            }
        } else {
            // SAFETY: the caller guarantees the CPU features.
            unsafe { tile_rows_avx512::<RB, f16>(a, t, tl, kt, vt, part) };
        }
    })
}

/// A tile's transposed keys `kt` and value rows `vt` converted to f32 into the scratch (`skt`,
/// `sv`); returns the converted keys and the converted values (as many as `vt` holds).
///
/// # Safety
/// The CPU must support F16C and AVX; `skt` and `sv` must be at least as long as `kt` and `vt`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
#[inline]
unsafe fn convert_tile<'s>(
    kt: &[f16],
    vt: &[f16],
    skt: &'s mut [f32],
    sv: &'s mut [f32],
) -> (&'s [f32], &'s [f32]) {
    let sv = &mut sv[..vt.len()];
    // SAFETY: the caller's contract.
    unsafe {
        convert_f16c(kt, skt);
        convert_f16c(vt, sv);
    }
    (skt, sv)
}

/// The tile loop of the register kernels ([`task_avx512_tiles`], [`task_avx2_tiles`]): for
/// each tile of task `t` that some query sees, the slots' positions (into the scratch) and the
/// tile's [`TileRows`], then `each(tile rows, transposed keys, first bk value rows, scratch
/// keys, scratch values, partial)`, with keys and values still in f16. Returns the task's
/// partial result.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn for_each_tile<const RB: usize>(
    a: &Attention<'_>,
    t: &Task,
    ranges: &[(i32, i32)],
    sc: &mut Scratch,
    mut each: impl FnMut(&TileRows<'_>, &[f16], &[f16], &mut [f32], &mut [f32], &mut Partial),
) -> Partial {
    let hd = a.head_dim;
    let rows = a.n_head / a.n_head_kv * (t.q1 - t.q0);
    let mut part = Partial::empty::<RB>(rows, hd);
    let (keys, values) = (a.keys[t.kvh], a.values[t.kvh]);
    let len = a.kv_pos.len();
    let zeros = vec![0.0f32; hd];
    let (q_min, q_max) = t.q_range(a);

    for (tile, &(lo, hi)) in ranges.iter().enumerate().take(t.t1).skip(t.t0) {
        if lo > q_max {
            continue; // no query of this task sees any slot of the tile
        }
        let j0 = tile * KV_TILE;
        let bk = KV_TILE.min(len - j0);
        for (j, p) in sc.pos.iter_mut().enumerate() {
            *p = if j < bk { a.kv_pos[j0 + j] } else { i32::MAX };
        }
        let tl = TileRows {
            lo,
            masked: hi > q_min || bk < KV_TILE,
            bk,
            pos: &sc.pos,
            zeros: &zeros,
        };
        // The tile's transposed keys and its values' rows (only the first `bk` are read).
        let kt = &keys[tile * hd * KV_TILE..(tile + 1) * hd * KV_TILE];
        let vt = &values[j0 * hd..(j0 + bk) * hd];
        each(&tl, kt, vt, &mut sc.kt, &mut sc.v, &mut part);
    }
    part
}

/// What every row block of a task needs to know about the current tile.
#[cfg(target_arch = "x86_64")]
struct TileRows<'s> {
    /// The tile's lowest slot position.
    lo: i32,
    /// Whether some slot may be past some query (or the tile is short): scores are masked.
    masked: bool,
    /// Slots in the tile.
    bk: usize,
    /// The slots' positions, `i32::MAX` past `bk`.
    pos: &'s [i32],
    /// A stand-in query for the rows past the task's last.
    zeros: &'s [f32],
}

/// One tile for every row block of task `t`: scores `q K^T` with the block's accumulators in
/// registers (one key row loaded per dimension feeds `RB` rows), the online softmax, then
/// `o = o * correction + p V`. `kt` is the tile's keys transposed (`[head_dim][KV_TILE]`), `vt`
/// its first `tl.bk` value rows.
///
/// # Safety
/// The CPU must support AVX-512 F, BW and VL, FMA and F16C; `kt` must hold `head_dim *
/// KV_TILE` elements and `vt` `tl.bk * head_dim` (checked).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
// Indexing the register block by (row, dimension) and (row, slot) reads like the math.
#[allow(clippy::needless_range_loop)]
unsafe fn tile_rows_avx512<const RB: usize, T: Lanes>(
    a: &Attention<'_>,
    t: &Task,
    tl: &TileRows<'_>,
    kt: &[T],
    vt: &[T],
    p: &mut Partial,
) {
    use std::arch::x86_64::*;
    let hd = a.head_dim;
    assert!(kt.len() >= hd * KV_TILE && vt.len() >= tl.bk * hd);
    let rows = p.m.len();
    const { assert!(VECS == 4) };
    let mut pos = [_mm512_setzero_si512(); VECS];
    for (c, pc) in pos.iter_mut().enumerate() {
        // SAFETY: lanes 16c..16c + 16 of the tile's KV_TILE positions.
        *pc = unsafe { _mm512_loadu_si512(tl.pos[16 * c..16 * c + 16].as_ptr().cast()) };
    }
    for r0 in (0..rows).step_by(RB) {
        let nr = RB.min(rows - r0);
        let (qrows, qpos) = t.block_queries::<RB>(a, r0, nr, tl.zeros);
        if qpos[..nr].iter().all(|&q| q < tl.lo) {
            continue;
        }

        // Scores: s[i][j] = sum_d q_i[d] * kt[d][j], d in order.
        let mut acc = [[_mm512_setzero_ps(); VECS]; RB];
        for d in 0..hd {
            let mut k = [_mm512_setzero_ps(); VECS];
            for (c, kc) in k.iter_mut().enumerate() {
                // SAFETY: d * KV_TILE + 16c + 16 <= hd * KV_TILE <= kt.len() (asserted).
                *kc = unsafe { T::load16(kt.as_ptr().add(d * KV_TILE + 16 * c)) };
            }
            for i in 0..RB {
                let q = _mm512_set1_ps(qrows[i][d]);
                for c in 0..VECS {
                    acc[i][c] = _mm512_fmadd_ps(q, k[c], acc[i][c]);
                }
            }
        }
        // The online softmax on the scores in registers; `s` gets the weights e^(x - m) the
        // value loop broadcasts (0 for rows or slots not seen).
        let mut s = [[0.0f32; KV_TILE]; RB];
        let mut correction = [1.0f32; RB];
        for i in 0..RB {
            if i >= nr || qpos[i] < tl.lo {
                continue;
            }
            let mut x = [_mm512_setzero_ps(); VECS];
            for c in 0..VECS {
                x[c] = _mm512_mul_ps(acc[i][c], _mm512_set1_ps(a.scale));
            }
            if tl.masked {
                let qp = _mm512_set1_epi32(qpos[i]);
                for c in 0..VECS {
                    let seen = _mm512_cmple_epi32_mask(pos[c], qp);
                    x[c] = _mm512_mask_blend_ps(seen, _mm512_set1_ps(f32::NEG_INFINITY), x[c]);
                }
            }
            let tile_max = _mm512_reduce_max_ps(_mm512_max_ps(
                _mm512_max_ps(x[0], x[1]),
                _mm512_max_ps(x[2], x[3]),
            ));
            if tile_max == f32::NEG_INFINITY {
                continue;
            }
            let (m, l) = (&mut p.m[r0 + i], &mut p.l[r0 + i]);
            let m_new = m.max(tile_max);
            correction[i] = if *m == f32::NEG_INFINITY {
                0.0
            } else {
                (*m - m_new).exp()
            };
            // `lane_sum`'s 16 partial sums, then its serial sum of them (the same bits).
            let mut sum = _mm512_setzero_ps();
            for c in 0..VECS {
                // SAFETY: the caller guarantees AVX-512 F.
                let e = unsafe { exp_approx_avx512(_mm512_sub_ps(x[c], _mm512_set1_ps(m_new))) };
                sum = _mm512_add_ps(sum, e);
                // SAFETY: lanes 16c..16c + 16 of a KV_TILE-long row.
                unsafe { _mm512_storeu_ps(s[i][16 * c..].as_mut_ptr(), e) };
            }
            let mut lanes = [0.0f32; LANES];
            // SAFETY: 16 lanes.
            unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sum) };
            *l = *l * correction[i] + lanes.iter().sum::<f32>();
            *m = m_new;
        }

        // Outputs: o_i = o_i * correction_i + sum_j p_i[j] * v[j], DIM_BLOCK dims at a time.
        let ob = &mut p.o[r0 * hd..(r0 + RB) * hd];
        for d0 in (0..hd).step_by(DIM_BLOCK) {
            let mut acc = [[_mm512_setzero_ps(); VECS]; RB];
            for i in 0..RB {
                let cf = _mm512_set1_ps(correction[i]);
                let orow = &ob[i * hd + d0..i * hd + d0 + DIM_BLOCK];
                for c in 0..VECS {
                    // SAFETY: lanes 16c..16c + 16 of a DIM_BLOCK-long slice.
                    let y = unsafe { _mm512_loadu_ps(orow[16 * c..].as_ptr()) };
                    acc[i][c] = _mm512_mul_ps(y, cf);
                }
            }
            for j in 0..tl.bk {
                let mut v = [_mm512_setzero_ps(); VECS];
                for (c, vc) in v.iter_mut().enumerate() {
                    // SAFETY: j * hd + d0 + 16c + 16 <= bk * hd <= vt.len() (asserted).
                    *vc = unsafe { T::load16(vt.as_ptr().add(j * hd + d0 + 16 * c)) };
                }
                for i in 0..RB {
                    let pij = _mm512_set1_ps(s[i][j]);
                    for c in 0..VECS {
                        acc[i][c] = _mm512_fmadd_ps(pij, v[c], acc[i][c]);
                    }
                }
            }
            for i in 0..RB {
                let orow = &mut ob[i * hd + d0..i * hd + d0 + DIM_BLOCK];
                for c in 0..VECS {
                    // SAFETY: as for the loads above.
                    unsafe { _mm512_storeu_ps(orow[16 * c..].as_mut_ptr(), acc[i][c]) };
                }
            }
        }
    }
}

/// Portable exact f16 -> f32 (branch-free, so it vectorises where the ISA allows).
#[inline(always)]
fn convert_portable(src: &[f16], dst: &mut [f32]) {
    for (d, &x) in dst.iter_mut().zip(src) {
        *d = f16_bits_to_f32(x.to_bits());
    }
}

/// One task, written as plain loops over fixed-width tiles so that each `#[target_feature]`
/// copy above vectorises them for its instruction set.
#[inline(always)]
fn task_kernel<const RB: usize>(
    a: &Attention<'_>,
    t: &Task,
    ranges: &[(i32, i32)],
    sc: &mut Scratch,
    convert: impl Fn(&[f16], &mut [f32]),
    // `x * y + z`: one fused instruction where the ISA has FMA (Rust never contracts a multiply
    // and an add by itself), a plain multiply and add in the portable copy.
    madd: impl Fn(f32, f32, f32) -> f32 + Copy,
) -> Partial {
    let hd = a.head_dim;
    let rows = a.n_head / a.n_head_kv * (t.q1 - t.q0);
    let Partial {
        mut m,
        mut l,
        mut o,
    } = Partial::empty::<RB>(rows, hd);
    let (q_min, q_max) = t.q_range(a);
    let (keys, values) = (a.keys[t.kvh], a.values[t.kvh]);
    let len = a.kv_pos.len();
    let zeros = vec![0.0f32; hd];

    for (tile, &(lo, hi)) in ranges.iter().enumerate().take(t.t1).skip(t.t0) {
        if lo > q_max {
            continue; // no query of this task sees any slot of the tile
        }
        let masked = hi > q_min;
        let j0 = tile * KV_TILE;
        let bk = KV_TILE.min(len - j0);

        // Convert the tile: keys are stored transposed already; values as they are, with the
        // rows of a short tile zeroed (their weights are 0, and 0 * inf would be NaN).
        convert(
            &keys[tile * hd * KV_TILE..(tile + 1) * hd * KV_TILE],
            &mut sc.kt,
        );
        for j in 0..KV_TILE {
            if j < bk {
                convert(
                    &values[(j0 + j) * hd..(j0 + j + 1) * hd],
                    &mut sc.v[j * hd..(j + 1) * hd],
                );
                sc.pos[j] = a.kv_pos[j0 + j];
            } else {
                sc.v[j * hd..(j + 1) * hd].fill(0.0);
                sc.pos[j] = i32::MAX;
            }
        }

        // Query rows in blocks of RB: each key or value row loaded from the tile feeds
        // RB rows of FMAs, with the scores and outputs of the block in registers.
        for r0 in (0..rows).step_by(RB) {
            let nr = RB.min(rows - r0);
            let (qrows, qpos) = t.block_queries::<RB>(a, r0, nr, &zeros);
            if qpos[..nr].iter().all(|&p| p < lo) {
                continue;
            }

            // The block's queries transposed, `[d][RB]`, so the loop below reads them
            // with constant row indices.
            for (d, qd) in sc.qt.iter_mut().enumerate() {
                for (x, q) in qd.iter_mut().zip(&qrows) {
                    *x = q[d];
                }
            }
            // Scores: s[i][j] = sum_d q_i[d] * kt[d][j].
            let mut s = [[0.0f32; KV_TILE]; RB];
            for (krow, qd) in sc.kt.chunks_exact(KV_TILE).zip(&sc.qt) {
                for (si, &q) in s.iter_mut().zip(qd) {
                    for (sj, &kj) in si.iter_mut().zip(krow) {
                        *sj = madd(q, kj, *sj);
                    }
                }
            }

            // Mask, online softmax; s becomes the weights p (0 for rows or keys not seen).
            let rs = RowState {
                m: &mut m[r0..],
                l: &mut l[r0..],
                nr,
                qpos: &qpos,
            };
            let correction =
                softmax_block(&mut s, rs, &sc.pos, lo, masked || bk < KV_TILE, a.scale);

            // Outputs: o_i = o_i * correction_i + sum_j p_i[j] * v[j], DIM_BLOCK dims at a time.
            let ob = &mut o[r0 * hd..(r0 + RB) * hd];
            if hd.is_multiple_of(DIM_BLOCK) {
                for d0 in (0..hd).step_by(DIM_BLOCK) {
                    let mut acc = [[0.0f32; DIM_BLOCK]; RB];
                    for (i, acci) in acc.iter_mut().enumerate() {
                        let orow = &ob[i * hd + d0..i * hd + d0 + DIM_BLOCK];
                        for (x, &y) in acci.iter_mut().zip(orow) {
                            *x = y * correction[i];
                        }
                    }
                    for j in 0..bk {
                        let vrow: &[f32; DIM_BLOCK] = sc.v[j * hd + d0..j * hd + d0 + DIM_BLOCK]
                            .try_into()
                            .expect("DIM_BLOCK values");
                        for (acci, si) in acc.iter_mut().zip(&s) {
                            let p = si[j];
                            for (x, &v) in acci.iter_mut().zip(vrow) {
                                *x = madd(p, v, *x);
                            }
                        }
                    }
                    for (i, acci) in acc.iter().enumerate() {
                        ob[i * hd + d0..i * hd + d0 + DIM_BLOCK].copy_from_slice(acci);
                    }
                }
            } else {
                for (i, (orow, si)) in ob.chunks_exact_mut(hd).zip(&s).enumerate() {
                    orow.iter_mut().for_each(|x| *x *= correction[i]);
                    for (j, &p) in si.iter().enumerate().take(bk) {
                        for (x, &v) in orow.iter_mut().zip(&sc.v[j * hd..(j + 1) * hd]) {
                            *x = madd(p, v, *x);
                        }
                    }
                }
            }
        }
    }
    Partial { m, l, o }
}

/// The running softmax state of one row block inside a task: the rows' max `m` and sum `l`
/// (from the block's first row on), how many rows are real (`nr`) and their query positions.
struct RowState<'s, const RB: usize> {
    m: &'s mut [f32],
    l: &'s mut [f32],
    nr: usize,
    qpos: &'s [i32; RB],
}

/// One row block's step of the online softmax over a tile: scales the scores `s` (masking the
/// slots at positions `pos` after a row's query where `masked`), turns them into the weights
/// `e^(s - m)` (0 for rows or slots not seen), updates the rows' `m` and `l` and returns the
/// factor each row's output accumulated so far must be multiplied by. Shared by every kernel,
/// so they agree bit for bit.
#[inline(always)]
fn softmax_block<const RB: usize>(
    s: &mut [[f32; KV_TILE]; RB],
    rs: RowState<'_, RB>,
    pos: &[i32],
    lo: i32,
    masked: bool,
    scale: f32,
) -> [f32; RB] {
    let (m, l) = (rs.m, rs.l);
    let mut correction = [1.0f32; RB];
    for i in 0..RB {
        let si = &mut s[i];
        if i >= rs.nr || rs.qpos[i] < lo {
            *si = [0.0; KV_TILE];
            continue;
        }
        let qp = rs.qpos[i];
        if masked {
            for (sj, &pj) in si.iter_mut().zip(pos) {
                *sj = if pj <= qp {
                    *sj * scale
                } else {
                    f32::NEG_INFINITY
                };
            }
        } else {
            for v in si.iter_mut() {
                *v *= scale;
            }
        }
        let tile_max = lane_max(si);
        if tile_max == f32::NEG_INFINITY {
            *si = [0.0; KV_TILE];
            continue;
        }
        let m_new = m[i].max(tile_max);
        correction[i] = if m[i] == f32::NEG_INFINITY {
            0.0
        } else {
            (m[i] - m_new).exp()
        };
        for v in si.iter_mut() {
            *v = exp_approx(*v - m_new);
        }
        l[i] = l[i] * correction[i] + lane_sum(si);
        m[i] = m_new;
    }
    correction
}

/// Lanes of the partial reductions below: one AVX-512 register of f32.
const LANES: usize = 16;

/// Maximum of a score row, reduced through `LANES` partial maxima so it vectorises (a plain
/// fold is a serial chain of scalar `max`).
#[inline(always)]
fn lane_max(x: &[f32; KV_TILE]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    for c in x.chunks_exact(LANES) {
        for (m, &v) in m.iter_mut().zip(c) {
            *m = m.max(v);
        }
    }
    m.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// Sum of a weight row through `LANES` partial sums (the order differs from a serial sum by
/// rounding only).
#[inline(always)]
fn lane_sum(x: &[f32; KV_TILE]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for c in x.chunks_exact(LANES) {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v;
        }
    }
    acc.iter().sum()
}

/// `log2(e)` and `ln 2` split in two (the high part exact in few bits) for [`exp_approx`].
const EXP_LOG2E: f32 = std::f32::consts::LOG2_E;
const EXP_LN2_HI: f32 = 0.693_145_75;
const EXP_LN2_LO: f32 = 1.428_606_8e-6;
/// The Taylor coefficients of `e^r` from the innermost out: `1/6!, 1/5!, 1/4!, 1/3!, 1/2!, 1`
/// (the constant 1 is added last).
const EXP_POLY: [f32; 6] = [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0];

/// `e^x` for `x <= 0` (and `-inf` -> 0), branch-free so loops over it vectorise. Splits `x` into
/// `n ln2 + r` with `|r| <= ln2/2`, evaluates a degree-6 polynomial for `e^r` (relative error
/// below 2e-7, the rounding of f32 itself) and scales by `2^n` through the exponent bits. The
/// vector copies ([`exp_approx_avx512`], [`exp_approx_avx2`]) do the same operations in the
/// same order, so every kernel gets the same bits.
#[inline(always)]
fn exp_approx(x: f32) -> f32 {
    // Below this e^x underflows f32; clamping also maps -inf to 0.
    let x = x.max(-87.0);
    let n = (x * EXP_LOG2E).round();
    let r = x - n * EXP_LN2_HI - n * EXP_LN2_LO;
    let mut p = r * EXP_POLY[0];
    for c in &EXP_POLY[1..] {
        p = r * (*c + p);
    }
    let p = 1.0 + p;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    let y = p * scale;
    // x was clamped at -87: values that small are exactly zero weight.
    if x <= -87.0 {
        0.0
    } else {
        y
    }
}

/// [`exp_approx`] on 16 lanes, operation for operation (no fused multiply-adds, the reduction's
/// rounding half away from zero), so the same bits as the scalar one and every kernel's softmax
/// agrees with [`softmax_block`]'s.
///
/// # Safety
/// The CPU must support AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp_approx_avx512(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let set = _mm512_set1_ps;
    let x = _mm512_max_ps(x, set(-87.0));
    let y = _mm512_mul_ps(x, set(EXP_LOG2E));
    // `f32::round`: truncate, then one step away from zero where the rest is at least a half.
    let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
    let rest = _mm512_sub_ps(y, t);
    let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(rest, set(0.5));
    let down = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(rest, set(-0.5));
    let n = _mm512_mask_sub_ps(_mm512_mask_add_ps(t, up, t, set(1.0)), down, t, set(1.0));
    let r = _mm512_sub_ps(
        _mm512_sub_ps(x, _mm512_mul_ps(n, set(EXP_LN2_HI))),
        _mm512_mul_ps(n, set(EXP_LN2_LO)),
    );
    let mut p = _mm512_mul_ps(r, set(EXP_POLY[0]));
    for c in &EXP_POLY[1..] {
        p = _mm512_mul_ps(r, _mm512_add_ps(set(*c), p));
    }
    let p = _mm512_add_ps(set(1.0), p);
    let two_n = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(n),
        _mm512_set1_epi32(127),
    )));
    // Lanes clamped at -87 are exactly zero weight (and -inf gives 0).
    let live = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(x, set(-87.0));
    _mm512_maskz_mov_ps(live, _mm512_mul_ps(p, two_n))
}

/// [`exp_approx`] on 8 lanes, operation for operation as [`exp_approx_avx512`].
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn exp_approx_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let set = _mm256_set1_ps;
    let x = _mm256_max_ps(x, set(-87.0));
    let y = _mm256_mul_ps(x, set(EXP_LOG2E));
    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
    let rest = _mm256_sub_ps(y, t);
    let up = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(rest, set(0.5)), set(1.0));
    let down = _mm256_and_ps(_mm256_cmp_ps::<_CMP_LE_OQ>(rest, set(-0.5)), set(1.0));
    // t + 1, t - 1 or t + 0: exact (|t| < 2^7).
    let n = _mm256_sub_ps(_mm256_add_ps(t, up), down);
    let r = _mm256_sub_ps(
        _mm256_sub_ps(x, _mm256_mul_ps(n, set(EXP_LN2_HI))),
        _mm256_mul_ps(n, set(EXP_LN2_LO)),
    );
    let mut p = _mm256_mul_ps(r, set(EXP_POLY[0]));
    for c in &EXP_POLY[1..] {
        p = _mm256_mul_ps(r, _mm256_add_ps(set(*c), p));
    }
    let p = _mm256_add_ps(set(1.0), p);
    let two_n = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(n),
        _mm256_set1_epi32(127),
    )));
    let live = _mm256_cmp_ps::<_CMP_GT_OQ>(x, set(-87.0));
    _mm256_and_ps(live, _mm256_mul_ps(p, two_n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Naive f64 attention over the same inputs.
    fn reference(a: &Attention<'_>) -> Vec<f32> {
        let (hd, group) = (a.head_dim, a.n_head / a.n_head_kv);
        let qw = a.n_head * hd;
        let n_q = a.q_pos.len();
        let mut out = vec![0.0f32; n_q * qw];
        for i in 0..n_q {
            for h in 0..a.n_head {
                let kvh = h / group;
                let q = &a.q[i * qw + h * hd..i * qw + (h + 1) * hd];
                let vis: Vec<usize> = (0..a.kv_pos.len())
                    .filter(|&j| a.kv_pos[j] <= a.q_pos[i])
                    .collect();
                if vis.is_empty() {
                    continue;
                }
                let scores: Vec<f64> = vis
                    .iter()
                    .map(|&j| {
                        q.iter()
                            .enumerate()
                            .map(|(d, &x)| f64::from(x) * f64::from(key_of(a.keys[kvh], j, d, hd)))
                            .sum::<f64>()
                            * f64::from(a.scale)
                    })
                    .collect();
                let mx = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
                let z: f64 = w.iter().sum();
                for d in 0..hd {
                    let v: f64 = vis
                        .iter()
                        .zip(&w)
                        .map(|(&j, &w)| w * f64::from(a.values[kvh][j * hd + d].to_f32()))
                        .sum();
                    out[i * qw + h * hd + d] = (v / z) as f32;
                }
            }
        }
        out
    }

    /// Rearranges `[len][hd]` keys into the tiled layout, filling unused lanes with `fill`.
    fn tile_keys(k: Vec<Vec<f16>>, len: usize, hd: usize, fill: f16) -> Vec<Vec<f16>> {
        k.into_iter()
            .map(|rows| {
                let mut t = vec![fill; len.div_ceil(KV_TILE) * KV_TILE * hd];
                for slot in 0..len {
                    for d in 0..hd {
                        t[key_tile_index(slot, d, hd)] = rows[slot * hd + d];
                    }
                }
                t
            })
            .collect()
    }

    /// The key of `slot` from the tiled layout.
    fn key_of(k: &[f16], slot: usize, d: usize, hd: usize) -> f32 {
        k[key_tile_index(slot, d, hd)].to_f32()
    }

    struct Case {
        n_head: usize,
        n_head_kv: usize,
        hd: usize,
        q: Vec<f32>,
        q_pos: Vec<i32>,
        k: Vec<Vec<f16>>,
        v: Vec<Vec<f16>>,
        kv_pos: Vec<i32>,
    }

    fn case(seed: u64, n_q: usize, len: usize, n_head_kv: usize, group: usize, hd: usize) -> Case {
        let mut s = seed | 1;
        let mut rnd = move || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s % 20_000) as f32 / 10_000.0 - 1.0
        };
        let n_head = n_head_kv * group;
        let q = (0..n_q * n_head * hd).map(|_| 2.0 * rnd()).collect();
        let k = (0..n_head_kv)
            .map(|_| (0..len * hd).map(|_| f16::from_f32(2.0 * rnd())).collect())
            .collect();
        // Garbage in the unused lanes of the last tile must not matter.
        let k = tile_keys(k, len, hd, f16::INFINITY);
        let v = (0..n_head_kv)
            .map(|_| (0..len * hd).map(|_| f16::from_f32(rnd())).collect())
            .collect();
        // Cache positions 0..len in a shuffled order, queries at the last n_q positions plus
        // one interior position (as fusion's recomputed tokens are).
        let mut kv_pos: Vec<i32> = (0..len as i32).collect();
        for i in (1..len).rev() {
            let j = ((rnd() + 1.0) * 0.5 * i as f32) as usize % (i + 1);
            kv_pos.swap(i, j);
        }
        let mut q_pos: Vec<i32> = (0..n_q).map(|i| (len - n_q + i) as i32).collect();
        if n_q > 1 {
            q_pos[0] = (len / 3) as i32;
        }
        Case {
            n_head,
            n_head_kv,
            hd,
            q,
            q_pos,
            k,
            v,
            kv_pos,
        }
    }

    fn run(c: &Case, isa: Option<Isa>, threads: usize) -> (Vec<f32>, Vec<f32>) {
        let keys: Vec<&[f16]> = c.k.iter().map(|v| &v[..]).collect();
        let values: Vec<&[f16]> = c.v.iter().map(|v| &v[..]).collect();
        let a = Attention {
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.hd,
            scale: 1.0 / (c.hd as f32).sqrt(),
            q: &c.q,
            q_pos: &c.q_pos,
            keys: &keys,
            values: &values,
            kv_pos: &c.kv_pos,
        };
        let mut out = vec![0.0; c.q.len()];
        match isa {
            None => attention(&a, &mut out, &ThreadPool::new(threads).unwrap()).unwrap(),
            Some(isa) => {
                // Drive one ISA directly through the same task split as `attention`.
                let ranges: Vec<(i32, i32)> = c
                    .kv_pos
                    .chunks(KV_TILE)
                    .map(|ch| (*ch.iter().min().unwrap(), *ch.iter().max().unwrap()))
                    .collect();
                let group = c.n_head / c.n_head_kv;
                let qw = c.n_head * c.hd;
                for kvh in 0..c.n_head_kv {
                    for q0 in (0..c.q_pos.len()).step_by(Q_TILE) {
                        let t = Task {
                            kvh,
                            q0,
                            q1: (q0 + Q_TILE).min(c.q_pos.len()),
                            t0: 0,
                            t1: ranges.len(),
                        };
                        let mut sc = Scratch::new(c.hd);
                        let p = run_task(isa, &a, &t, &ranges, &mut sc);
                        for r in 0..group * (t.q1 - t.q0) {
                            let (qi, h) = (q0 + r / group, kvh * group + r % group);
                            for d in 0..c.hd {
                                out[qi * qw + h * c.hd + d] = if p.m[r] == f32::NEG_INFINITY {
                                    0.0
                                } else {
                                    p.o[r * c.hd + d] / p.l[r]
                                };
                            }
                        }
                    }
                }
            }
        }
        (out, reference(&a))
    }

    /// Case `c` as an attention call, with its key tiles' position ranges, handed to `f`.
    fn with_call<R>(c: &Case, f: impl FnOnce(&Attention<'_>, &[(i32, i32)]) -> R) -> R {
        let keys: Vec<&[f16]> = c.k.iter().map(|v| &v[..]).collect();
        let values: Vec<&[f16]> = c.v.iter().map(|v| &v[..]).collect();
        let a = Attention {
            n_head: c.n_head,
            n_head_kv: c.n_head_kv,
            head_dim: c.hd,
            scale: 1.0 / (c.hd as f32).sqrt(),
            q: &c.q,
            q_pos: &c.q_pos,
            keys: &keys,
            values: &values,
            kv_pos: &c.kv_pos,
        };
        let ranges: Vec<(i32, i32)> = c
            .kv_pos
            .chunks(KV_TILE)
            .map(|ch| (*ch.iter().min().unwrap(), *ch.iter().max().unwrap()))
            .collect();
        f(&a, &ranges)
    }

    fn max_err(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn exp_approx_is_accurate() {
        for i in 0..=2000 {
            let x = -(i as f32) * 0.05;
            let (got, want) = (exp_approx(x), (f64::from(x)).exp() as f32);
            assert!(
                (got - want).abs() <= 4e-7 * want.max(1e-30),
                "{x}: {got} vs {want}"
            );
        }
        assert_eq!(exp_approx(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_approx(0.0), 1.0);
    }

    /// Several calls in one dispatch (a batched decode step's sequences, plus a prefill tile
    /// and an empty call) give each call exactly what it gets alone.
    #[test]
    fn many_calls_in_one_dispatch_equal_each_call_alone() {
        let cases = [
            case(11, 1, 300, 3, 3, 64),
            case(12, 1, 70, 3, 3, 64),
            case(13, 40, 90, 2, 4, 32),
            case(14, 0, 10, 3, 3, 64),
            case(15, 1, 1, 3, 3, 64),
        ];
        for threads in [1, 2, 3] {
            let pool = ThreadPool::new(threads).unwrap();
            let keys: Vec<Vec<&[f16]>> = cases
                .iter()
                .map(|c| c.k.iter().map(|v| &v[..]).collect())
                .collect();
            let values: Vec<Vec<&[f16]>> = cases
                .iter()
                .map(|c| c.v.iter().map(|v| &v[..]).collect())
                .collect();
            let calls: Vec<Attention<'_>> = cases
                .iter()
                .zip(keys.iter().zip(&values))
                .map(|(c, (k, v))| Attention {
                    n_head: c.n_head,
                    n_head_kv: c.n_head_kv,
                    head_dim: c.hd,
                    scale: 1.0 / (c.hd as f32).sqrt(),
                    q: &c.q,
                    q_pos: &c.q_pos,
                    keys: k,
                    values: v,
                    kv_pos: &c.kv_pos,
                })
                .collect();
            let mut together: Vec<Vec<f32>> =
                cases.iter().map(|c| vec![f32::NAN; c.q.len()]).collect();
            let mut outs: Vec<&mut [f32]> = together.iter_mut().map(|o| &mut o[..]).collect();
            attention_many(&calls, &mut outs, &pool).unwrap();
            for (i, (a, got)) in calls.iter().zip(&together).enumerate() {
                let mut alone = vec![0.0; got.len()];
                attention(a, &mut alone, &pool).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(got), bits(&alone), "call {i}, {threads} threads");
            }
            let err = attention_many(&calls, &mut [], &pool).unwrap_err();
            assert!(matches!(err, KernelError::LengthMismatch { .. }), "{err:?}");
        }
    }

    #[test]
    fn prefill_decode_and_gqa_match_the_reference() {
        for (n_q, len, kvh, group, hd) in [
            (1, 1, 1, 1, 64),
            (1, 700, 3, 3, 64),
            (37, 37, 3, 3, 64),
            (100, 300, 2, 4, 128),
            (5, 130, 1, 8, 32),
        ] {
            for threads in [1, 2, 3] {
                let c = case(n_q as u64 * 31 + len as u64, n_q, len, kvh, group, hd);
                let (got, want) = run(&c, None, threads);
                let err = max_err(&got, &want);
                assert!(err < 2e-5, "n_q {n_q} len {len} threads {threads}: {err}");
            }
        }
    }

    #[test]
    fn every_isa_matches_the_reference() {
        // GQA groups of 3 (blocks of 6 in prefill), 4, 8 and 1; head widths of 64, 32, 128
        // and 16 (the register kernels' and the portable fallback's).
        for (seed, n_q, len, kvh, group, hd) in [
            (5, 70, 200, 3, 3, 64),
            (6, 33, 100, 2, 4, 32),
            (7, 5, 130, 1, 8, 128),
            (8, 40, 90, 2, 1, 16),
        ] {
            let c = case(seed, n_q, len, kvh, group, hd);
            for isa in Isa::available() {
                let (got, want) = run(&c, Some(isa), 1);
                let err = max_err(&got, &want);
                assert!(err < 2e-5, "{isa:?}, case {seed}: {err}");
            }
        }
    }

    /// Task `t` on the converting AVX-512 kernel and on the f16-direct one, which the dispatch
    /// would choose for it. Only call where the CPU has AVX-512.
    #[cfg(target_arch = "x86_64")]
    fn both_avx512<const RB: usize>(
        a: &Attention<'_>,
        t: &Task,
        ranges: &[(i32, i32)],
    ) -> (Partial, Partial) {
        assert!(
            f16_direct::<RB>(a, t),
            "a task the dispatch keeps off the direct kernel"
        );
        let hd = a.head_dim;
        // SAFETY: the caller checked that this CPU has AVX-512 F/BW/VL; every ISA with them has
        // FMA and F16C too (`Isa::detected`).
        unsafe {
            (
                task_avx512::<RB>(a, t, ranges, &mut Scratch::new(hd)),
                task_avx512_f16::<RB>(a, t, ranges, &mut Scratch::new(hd)),
            )
        }
    }

    /// The AVX-512 kernel that reads f16 directly gives what the converting one gives, bit for
    /// bit, on the small tasks it takes (decode, fusion's few recomputed tokens): short and
    /// masked tiles, GQA groups of 3 and 4, head widths of 64 and 128, cache slices.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn f16_direct_kernel_equals_the_converting_kernel() {
        if !Isa::available().contains(&Isa::Avx512Bw) && !Isa::available().contains(&Isa::Avx512) {
            eprintln!("no AVX-512 here: nothing to compare");
            return;
        }
        for (seed, n_q, len, kvh, group, hd) in [
            (1, 1, 700, 3, 3, 64),
            (2, 2, 130, 3, 3, 64),
            (3, 1, 63, 2, 4, 128),
            (4, 2, 200, 1, 4, 64),
            (5, 1, 1, 3, 3, 64),
        ] {
            let c = case(seed, n_q, len, kvh, group, hd);
            with_call(&c, |a, ranges| {
                let n_tiles = ranges.len();
                for (t0, t1) in [
                    (0, n_tiles),
                    (0, n_tiles.div_ceil(2)),
                    (n_tiles / 2, n_tiles),
                ] {
                    for kvh in 0..c.n_head_kv {
                        let t = Task {
                            kvh,
                            q0: 0,
                            q1: n_q,
                            t0,
                            t1,
                        };
                        let (p, q) = if group == 3 {
                            both_avx512::<3>(a, &t, ranges)
                        } else {
                            both_avx512::<4>(a, &t, ranges)
                        };
                        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        let what = format!("case {seed}, head {kvh}, tiles {t0}..{t1}");
                        assert_eq!(bits(&p.m), bits(&q.m), "{what}: max");
                        assert_eq!(bits(&p.l), bits(&q.l), "{what}: sum");
                        // Row blocks of different sizes pad the outputs differently: compare the rows.
                        let real = p.m.len() * c.hd;
                        assert_eq!(bits(&p.o[..real]), bits(&q.o[..real]), "{what}: outputs");
                    }
                }
            });
        }
    }

    /// The register kernels (AVX-512 and AVX2, prefill and decode tasks) compute exactly what
    /// the portable kernel computes with fused multiply-adds, which every x86 ISA ran before
    /// them: the same bits, so making attention faster changed no answer.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn register_kernels_equal_the_portable_kernel_bit_for_bit() {
        for (seed, n_q, len, kvh, group, hd) in [
            (21, 70, 200, 3, 3, 64),
            (22, 1, 700, 3, 3, 64),
            (23, 2, 130, 3, 3, 64),
            (24, 33, 100, 2, 4, 64),
            (25, 5, 130, 1, 8, 128),
            (26, 40, 90, 2, 1, 32),
        ] {
            let c = case(seed, n_q, len, kvh, group, hd);
            with_call(&c, |a, ranges| {
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                for kvh in 0..c.n_head_kv {
                    for q0 in (0..n_q).step_by(Q_TILE) {
                        let t = Task {
                            kvh,
                            q0,
                            q1: (q0 + Q_TILE).min(n_q),
                            t0: 0,
                            t1: ranges.len(),
                        };
                        let want = task_kernel::<ROW_BLOCK>(
                            a,
                            &t,
                            ranges,
                            &mut Scratch::new(hd),
                            convert_portable,
                            f32::mul_add,
                        );
                        let real = want.m.len() * hd;
                        for isa in Isa::available() {
                            if isa == Isa::Scalar {
                                continue; // no fused multiply-add: its own bits
                            }
                            let got = run_task(isa, a, &t, ranges, &mut Scratch::new(hd));
                            let what = format!("{isa:?}, case {seed}, head {kvh}, queries {q0}..");
                            assert_eq!(bits(&got.m), bits(&want.m), "{what}: max");
                            assert_eq!(bits(&got.l), bits(&want.l), "{what}: sum");
                            assert_eq!(
                                bits(&got.o[..real]),
                                bits(&want.o[..real]),
                                "{what}: outputs"
                            );
                        }
                    }
                }
            });
        }
    }

    #[test]
    fn a_query_that_sees_nothing_gets_zeros() {
        let mut c = case(9, 2, 10, 1, 2, 16);
        c.q_pos = vec![-1, 9];
        let (got, want) = run(&c, None, 2);
        assert!(got[..2 * 16].iter().all(|&x| x == 0.0));
        assert!(max_err(&got, &want) < 2e-5);
    }

    #[test]
    fn bad_shapes_are_errors() {
        let c = case(1, 2, 4, 1, 2, 16);
        let keys: Vec<&[f16]> = c.k.iter().map(|v| &v[..3]).collect(); // too short
        let values: Vec<&[f16]> = c.v.iter().map(|v| &v[..]).collect();
        let a = Attention {
            n_head: 2,
            n_head_kv: 1,
            head_dim: 16,
            scale: 1.0,
            q: &c.q,
            q_pos: &c.q_pos,
            keys: &keys,
            values: &values,
            kv_pos: &c.kv_pos,
        };
        let mut out = vec![0.0; c.q.len()];
        assert!(attention(&a, &mut out, &ThreadPool::new(1).unwrap()).is_err());
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(24))]
        #[test]
        fn random_shapes(seed in 0u64..1000, n_q in 1usize..70, extra in 0usize..150,
                         kvh in 1usize..4, group in 1usize..5, threads in 1usize..4) {
            let c = case(seed, n_q, n_q + extra, kvh, group, 32);
            let (got, want) = run(&c, None, threads);
            prop_assert!(max_err(&got, &want) < 2e-5);
        }
    }
}
