//! AMX (Advanced Matrix Extensions: Intel Sapphire Rapids and later) int8 tiles for the
//! prefill-sized matmuls of the quantised formats whose scales cover 32 elements: Q4_0, Q4_1,
//! Q5_0, Q5_1, Q8_0 and the K-quants Q4_K and Q5_K (Q6_K, with a scale per 16 elements, stays
//! on the VNNI kernels).
//!
//! One `tdpbusd` multiplies a tile of 16 tokens' activations (u8: the Q8 quants plus 128, 32
//! bytes each: one block) by 16 weight rows' signed integers of the same block (the weights'
//! quants minus their offset, or the plain quants of a format with mins), giving the exact
//! i32 dot of every (token, row) pair in the block. Per block the float epilogue then does,
//! for 16 rows of one token at a time,
//!
//! ```text
//! acc += float(dot - 128 * sum(w)) * (dw * dx)      (+ m * s for the formats with mins)
//! ```
//!
//! which is the same arithmetic, value by value, in every tile: a (row, token) result does not
//! depend on the tile, the task split or the thread count. Where the tiles run, the VNNI
//! kernels (decode, and matmuls of fewer than [`MIN_TOKENS`] tokens) take the formats the
//! tiles take in this order too (`Geom::blocks`: the exact dot of each block from their lane
//! sums, then the same float steps), so every matmul of such a format gives the same bits; the
//! VNNI kernels' own order (4-element lane sums, reduced at the end) is kept where the tiles do
//! not run. Either differs from the scalar reference in float summation order only. The VNNI
//! kernels spend four instructions (one `vpdpbusd`, three float) per 64 multiply-adds of a
//! (row, token) pair; this epilogue spends five or six per 16 x 32 (`dot` is free: the tile
//! unit computes it).
//!
//! Weights are unpacked per task, 16 rows at a time, into `tdpbusd`'s B layout (for each
//! block, 8 rows of 64 bytes: row `k` holds the 4 integers of elements `4k..4k + 4` of each of
//! the 16 weight rows), and reused for every token tile of the task; activations are packed
//! once per matmul (`Acts`), tokens padded to a multiple of 16.
//!
//! The tile unit is used only after [`usable`] has confirmed it: CPUID says AMX-TILE and
//! AMX-INT8, the kernel granted this process the tile data state
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM)`) and the AVX-512 VNNI kernels were chosen
//! (`Isa::Avx512`); `ENGRAM_KERNELS_AMX=0` turns it off (see [`enabled`]).

use std::arch::asm;
use std::arch::x86_64::*;
use std::cell::RefCell;
use std::sync::OnceLock;

use super::{has_mins, is_k, k_block, Geom, OutPtr, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q8_0};
use crate::blocks::{f16_at, f32_at, i16_at, q5_values, Q8K_BYTES, QK};
use crate::dot::Isa;

/// Environment variable that turns the AMX kernels off (`0` or `off`; see [`enabled`]).
pub(crate) const AMX_ENV: &str = "ENGRAM_KERNELS_AMX";

/// Fewest tokens for which a matmul takes the AMX kernels: fewer (decode, batched decode) stay
/// on the VNNI kernels, which read the weights' blocks directly instead of unpacking them.
pub(crate) const MIN_TOKENS: usize = 32;

/// Tokens and weight rows per tile.
const TILE: usize = 16;

/// Bytes of one block's B tile: 16 rows x 32 elements.
const B_BYTES: usize = TILE * QK;

/// Weight rows per pool task (two row tiles). A task unpacks its rows once and reuses them for
/// up to [`TOKENS_PER_TASK`] tokens.
pub(crate) const ROWS_PER_TASK: usize = 2 * TILE;

/// Tokens per pool task at most: a task unpacks its rows once for all of them (unpacking is
/// about a sixth of the work at 256 tokens). The matmul splits its tokens further only to give
/// every thread [`MIN_TASKS_PER_THREAD`] tasks.
pub(crate) const TOKENS_PER_TASK: usize = 1024;

/// Tasks per thread below which a matmul splits its tokens into more chunks (of at least
/// [`MIN_TOKENS`]).
pub(crate) const MIN_TASKS_PER_THREAD: usize = 4;

/// Whether matmuls take the AMX kernels: wherever they are [`usable`], unless
/// `ENGRAM_KERNELS_AMX=0` (or `off`) turns them off; decided once per process.
///
/// Where they are on, the VNNI kernels that run decode steps and matmuls of fewer than
/// [`MIN_TOKENS`] tokens sum the formats the tiles take in the tiles' block order
/// (`Geom::blocks`), so a token decoded step by step and the same token inside a prefill get
/// the same bits, as they do where the tiles are off. (Before the VNNI kernels had that order,
/// the difference reached a KL of 0.019 at some positions of a SmolLM2-135M Q4_1 forward pass:
/// `tests/fusion.rs`, the interleaved-prefill test.)
pub(crate) fn enabled() -> bool {
    static ENABLED: OnceLock<bool> = OnceLock::new();
    *ENABLED.get_or_init(|| {
        let off = matches!(
            std::env::var(AMX_ENV).ok().as_deref(),
            Some("0") | Some("off")
        );
        !off && usable()
    })
}

/// Whether the AMX kernels can run in this process (see the module docs): CPUID says
/// AMX-TILE and AMX-INT8, Linux granted the tile data state, and the AVX-512 VNNI kernels
/// were chosen (`Isa::Avx512`). Decided once per process.
pub(crate) fn usable() -> bool {
    static USABLE: OnceLock<bool> = OnceLock::new();
    *USABLE
        .get_or_init(|| Isa::detected() == Isa::Avx512 && cpu_has_amx_int8() && request_tile_data())
}

/// Whether format `fmt` has an AMX kernel.
pub(crate) fn supports(fmt: u8) -> bool {
    matches!(fmt, Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q4_K | Q5_K)
}

/// CPUID leaf 7: AMX-TILE (EDX bit 24) and AMX-INT8 (EDX bit 25).
fn cpu_has_amx_int8() -> bool {
    // CPUID leaf 7 exists on every CPU that has AVX-512 (checked by the caller first).
    let leaf = __cpuid_count(7, 0);
    leaf.edx & (1 << 24) != 0 && leaf.edx & (1 << 25) != 0
}

/// Asks Linux for the AMX tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`), which a process must hold before its first tile instruction. The
/// permission covers every thread of the process.
#[cfg(target_os = "linux")]
fn request_tile_data() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: i64 = 0x1023;
    const XFEATURE_XTILEDATA: i64 = 18;
    let ret: i64;
    // SAFETY: arch_prctl(ARCH_REQ_XCOMP_PERM) only changes this process's permitted xsave
    // features; it reads no memory of ours. The syscall clobbers rcx and r11, declared.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

#[cfg(not(target_os = "linux"))]
fn request_tile_data() -> bool {
    false
}

/// A matmul's activations for the AMX kernels: per token, the block quants as u8 (`x + 128`),
/// each block's scale and, for the formats with mins, its `s = dx * sum(x)`.
pub(crate) struct Acts {
    /// Blocks per token (32-element blocks; K-quant super-blocks count 8).
    nb: usize,
    /// Tokens, padded to a multiple of [`TILE`] (the padding is zeros and is never written out).
    padded: usize,
    /// `nb * 32` bytes per token.
    q: Vec<u8>,
    /// `d[t * nb + b]`.
    d: Vec<f32>,
    /// `s[t * nb + b]` (formats with mins; zeros otherwise).
    s: Vec<f32>,
}

impl Acts {
    /// Zeroed activations for `n_tokens` tokens of geometry `g`.
    pub(crate) fn new(g: &Geom, n_tokens: usize) -> Acts {
        let padded = n_tokens.next_multiple_of(TILE);
        Acts {
            nb: g.nb,
            padded,
            q: vec![0; padded * g.nb * QK],
            d: vec![0.0; padded * g.nb],
            s: vec![0.0; padded * g.nb],
        }
    }

    /// Per-token views of every buffer for tokens `per * i ..` (the pieces packing tasks fill in
    /// parallel).
    pub(crate) fn pieces(&mut self, per: usize) -> Vec<ActsPiece<'_>> {
        let nb = self.nb;
        self.q
            .chunks_mut(per * nb * QK)
            .zip(self.d.chunks_mut(per * nb))
            .zip(self.s.chunks_mut(per * nb))
            .map(|((q, d), s)| ActsPiece { nb, q, d, s })
            .collect()
    }
}

/// Some consecutive tokens of an [`Acts`].
pub(crate) struct ActsPiece<'a> {
    nb: usize,
    q: &'a mut [u8],
    d: &'a mut [f32],
    s: &'a mut [f32],
}

impl ActsPiece<'_> {
    /// Packs token `i` of this piece from its quantised activations `xq` (the vec-dot type of
    /// `g.fmt`, ggml layout).
    pub(crate) fn pack(&mut self, g: &Geom, i: usize, xq: &[u8]) {
        let nb = self.nb;
        let q = &mut self.q[i * nb * QK..(i + 1) * nb * QK];
        let d = &mut self.d[i * nb..(i + 1) * nb];
        let s = &mut self.s[i * nb..(i + 1) * nb];
        if is_k(g.fmt) {
            // Q8_K: f32 d, 256 i8 quants, 16 i16 sums of 16.
            for (sbi, sb) in xq.chunks_exact(Q8K_BYTES).enumerate() {
                let dx = f32_at(sb, 0);
                for j in 0..8 {
                    let b = 8 * sbi + j;
                    let sums = 4 + 256 + 4 * j;
                    d[b] = dx;
                    s[b] = dx * (i16_at(sb, sums) as i32 + i16_at(sb, sums + 2) as i32) as f32;
                }
                let dst = &mut q[sbi * 256..(sbi + 1) * 256];
                for (o, &v) in dst.iter_mut().zip(&sb[4..260]) {
                    *o = v ^ 0x80;
                }
            }
            return;
        }
        let (bs, qo) = g.xblock();
        for (b, blk) in xq.chunks_exact(bs).take(nb).enumerate() {
            d[b] = f16_at(blk, 0);
            if has_mins(g.fmt) {
                s[b] = f16_at(blk, 2);
            }
            for (o, &v) in q[b * QK..(b + 1) * QK].iter_mut().zip(&blk[qo..qo + QK]) {
                *o = v ^ 0x80;
            }
        }
    }
}

/// Up to 16 weight rows in `tdpbusd`'s B layout, block by block, with per (block, row): the
/// scale, the correction `-128 * sum(w)` (the activations' +128) and the min.
struct Group {
    /// `nb` tiles of [`B_BYTES`].
    b: Vec<u8>,
    /// `dw[b * 16 + r]`.
    dw: Vec<f32>,
    /// `corr[b * 16 + r]`.
    corr: Vec<i32>,
    /// `m[b * 16 + r]` (formats with mins).
    m: Vec<f32>,
}

impl Group {
    const fn new() -> Group {
        Group {
            b: Vec::new(),
            dw: Vec::new(),
            corr: Vec::new(),
            m: Vec::new(),
        }
    }

    /// Unpacks weight rows `rows` of `w` (rows of `wrb` bytes, ggml layout); rows past the
    /// end of a short last group are zeros.
    #[inline(always)]
    fn unpack(&mut self, g: &Geom, w: &[u8], wrb: usize, rows: std::ops::Range<usize>) {
        let nb = g.nb;
        // Every cell is written below except those of the rows past a short group's end,
        // which must be zeros.
        let short = rows.len() < TILE;
        self.b.resize(nb * B_BYTES, 0);
        self.dw.resize(nb * TILE, 0.0);
        self.m.resize(nb * TILE, 0.0);
        self.corr.resize(nb * TILE, 0);
        self.b.truncate(nb * B_BYTES);
        self.dw.truncate(nb * TILE);
        self.m.truncate(nb * TILE);
        self.corr.truncate(nb * TILE);
        if short {
            self.b.fill(0);
            self.dw.fill(0.0);
            self.m.fill(0.0);
            self.corr.fill(0);
        }
        for (n, r) in rows.enumerate() {
            let row = &w[r * wrb..(r + 1) * wrb];
            for_each_block(g, row, |b, ints, dw, m| {
                let tile = &mut self.b[b * B_BYTES..(b + 1) * B_BYTES];
                for (k, v) in ints.chunks_exact(4).enumerate() {
                    for (o, &x) in tile[k * 64 + 4 * n..k * 64 + 4 * n + 4].iter_mut().zip(v) {
                        *o = x as u8;
                    }
                }
                let sum: i32 = ints.iter().map(|&v| v as i32).sum();
                self.dw[b * TILE + n] = dw;
                self.corr[b * TILE + n] = -128 * sum;
                self.m[b * TILE + n] = m;
            });
        }
    }
}

/// Calls `f(block, ints, dw, m)` for every 32-element block of one weight row: the block's
/// signed integers (`w = dw * ints + m`), its scale and its min (0 without mins).
#[inline(always)]
fn for_each_block(g: &Geom, row: &[u8], mut f: impl FnMut(usize, &[i8; QK], f32, f32)) {
    let mut ints = [0i8; QK];
    if is_k(g.fmt) {
        let bs = row.len() / (g.nb / 8);
        for (sbi, blk) in row.chunks_exact(bs).enumerate() {
            let kb = k_block(g.fmt, blk);
            for j in 0..8 {
                for (o, &v) in ints.iter_mut().zip(&kb.q[32 * j..32 * j + 32]) {
                    *o = v as i8;
                }
                f(8 * sbi + j, &ints, kb.scales[2 * j], kb.mins[j]);
            }
        }
        return;
    }
    let (bs, qo) = g.wblock();
    for (b, blk) in row.chunks_exact(bs).take(g.nb).enumerate() {
        let dw = f16_at(blk, 0);
        let m = if has_mins(g.fmt) { f16_at(blk, 2) } else { 0.0 };
        match g.fmt {
            Q8_0 => {
                for (o, &v) in ints.iter_mut().zip(&blk[qo..qo + QK]) {
                    *o = v as i8;
                }
            }
            Q5_0 | Q5_1 => {
                let off = if g.fmt == Q5_0 { 16 } else { 0 };
                let v = q5_values(&blk[qo - 4..qo], &blk[qo..qo + 16]);
                for (o, &v) in ints.iter_mut().zip(&v) {
                    *o = v as i8 - off;
                }
            }
            _ => {
                let off = if g.fmt == Q4_0 { 8 } else { 0 };
                for (j, &x) in blk[qo..qo + 16].iter().enumerate() {
                    ints[j] = (x & 0x0F) as i8 - off;
                    ints[j + 16] = (x >> 4) as i8 - off;
                }
            }
        }
        f(b, &ints, dw, m);
    }
}

/// The tiles' arithmetic in scalar code, for the tests: weight row `row` (ggml layout) times
/// token `t` of `acts`, block by block, `acc = fma(float(dot), dw * dx, acc)` then, for the
/// formats with mins, `acc = fma(m, s, acc)`.
#[cfg(test)]
pub(crate) fn reference(g: &Geom, row: &[u8], acts: &Acts, t: usize) -> f32 {
    let nb = acts.nb;
    let q = &acts.q[t * nb * QK..(t + 1) * nb * QK];
    let mut acc = 0f32;
    for_each_block(g, row, |b, ints, dw, m| {
        let dot: i32 = ints
            .iter()
            .zip(&q[b * QK..(b + 1) * QK])
            .map(|(&w, &x)| w as i32 * (x as i32 - 128))
            .sum();
        acc = (dot as f32).mul_add(dw * acts.d[t * nb + b], acc);
        if has_mins(g.fmt) {
            acc = m.mul_add(acts.s[t * nb + b], acc);
        }
    });
    acc
}

/// The work of one AMX task: rows `rows` of the weights against tokens `tokens` of `acts`.
pub(crate) struct AmxSpan<'a> {
    pub(crate) g: Geom,
    pub(crate) w: &'a [u8],
    pub(crate) wrb: usize,
    pub(crate) rows: std::ops::Range<usize>,
    pub(crate) acts: &'a Acts,
    pub(crate) tokens: std::ops::Range<usize>,
}

/// Blocks whose dots one tile instruction sequence computes: 4 independent `tdpbusd` (tiles
/// 0 to 3), so the tile unit pipelines them while the float epilogue of earlier blocks runs.
const BATCH: usize = 4;

/// The tile configuration: palette 1; tmm0-3 the 16 x 16 i32 dots of 4 blocks (64-byte rows),
/// tmm4-5 16 tokens x 32 activation bytes, tmm6-7 8 rows x 64 weight bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> TileConfig {
        let mut c = [0u8; 64];
        c[0] = 1; // palette
        let shapes = [
            (TILE, 64u16),
            (TILE, 64),
            (TILE, 64),
            (TILE, 64),
            (TILE, QK as u16),
            (TILE, QK as u16),
            (QK / 4, 64),
            (QK / 4, 64),
        ];
        for (t, (rows, colsb)) in shapes.into_iter().enumerate() {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&colsb.to_le_bytes());
            c[48 + t] = rows as u8;
        }
        TileConfig(c)
    }
}

/// Where `tdpbusd`'s 16 x 16 dots are stored for the epilogue: two buffers of [`BATCH`]
/// blocks, so the tile unit fills one while the epilogue reads the other.
#[repr(C, align(64))]
struct Dots([[[i32; TILE]; TILE]; 2 * BATCH]);

thread_local! {
    /// Per-thread unpacked weight rows.
    static GROUP: RefCell<Group> = const { RefCell::new(Group::new()) };
    /// Per-thread store of the tile dots (8 KiB, zeroed once rather than per tile).
    static DOTS: RefCell<Dots> = const { RefCell::new(Dots([[[0; TILE]; TILE]; 2 * BATCH])) };
}

/// Computes `s` into `out`.
pub(crate) fn run_span(s: &AmxSpan<'_>, out: OutPtr) {
    assert!(usable(), "the AMX kernels run only where `usable` said so");
    assert!(s.tokens.end <= s.acts.padded && s.acts.nb == s.g.nb);
    GROUP.with(|grp| {
        DOTS.with(|dots| {
            // SAFETY: `usable()` checked that this CPU has AMX-TILE and AMX-INT8 and that the
            // process holds the tile data permission, and (through `Isa::Avx512`) AVX-512
            // F/BW/VL/VNNI, AVX2, FMA and F16C.
            unsafe { span(s, out, &mut grp.borrow_mut(), &mut dots.borrow_mut()) }
        })
    });
}

/// [`run_span`]'s body, compiled for AVX-512 (the unpacking loops are inlined into it).
///
/// # Safety
///
/// The CPU must have AMX-TILE, AMX-INT8, AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C, and the
/// process must hold the tile data permission.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn span(s: &AmxSpan<'_>, out: OutPtr, grp: &mut Group, dots: &mut Dots) {
    let cfg = TileConfig::new();
    let mins = has_mins(s.g.fmt);
    // SAFETY: the caller's promise; `cfg` is a valid palette-1 configuration.
    unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack)) };
    let mut r0 = s.rows.start;
    while r0 < s.rows.end {
        let nr = TILE.min(s.rows.end - r0);
        grp.unpack(&s.g, s.w, s.wrb, r0..r0 + nr);
        let mut t0 = s.tokens.start;
        while t0 < s.tokens.end {
            let nt = TILE.min(s.tokens.end - t0);
            // SAFETY: the caller's promise, and this thread loaded the configuration above.
            let acc = unsafe {
                if mins {
                    tile::<true>(s.acts, t0, grp, dots)
                } else {
                    tile::<false>(s.acts, t0, grp, dots)
                }
            };
            for (t, row) in acc.iter().enumerate().take(nt) {
                // SAFETY: this task owns rows `s.rows` x tokens `s.tokens`.
                unsafe { out.write_run(r0, t0 + t, &row[..nr]) };
            }
            t0 += TILE;
        }
        r0 += nr;
    }
    // SAFETY: as for `ldtilecfg`; releasing the tiles only drops their contents.
    unsafe { asm!("tilerelease", options(nostack, nomem)) };
}

/// The dots of blocks `b..b + BATCH` of the 16 tokens at `a` (stride `arow`) and the weight
/// tiles at `w`, stored to `c` (BATCH x 16 x 16 i32).
///
/// # Safety
///
/// As [`tile`]'s, and the reads and the stores lie inside their buffers.
#[inline(always)]
unsafe fn dots4(a: *const u8, arow: usize, w: *const u8, c: *mut [[i32; TILE]; TILE]) {
    // SAFETY: the caller's promise.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "tileloadd tmm4, [{a} + {sa} * 1]",
            "tileloadd tmm6, [{w} + {s64} * 1]",
            "tdpbusd tmm0, tmm4, tmm6",
            "tileloadd tmm5, [{a} + {sa} * 1 + 32]",
            "tileloadd tmm7, [{w} + {s64} * 1 + 512]",
            "tdpbusd tmm1, tmm5, tmm7",
            "tileloadd tmm4, [{a} + {sa} * 1 + 64]",
            "tileloadd tmm6, [{w} + {s64} * 1 + 1024]",
            "tdpbusd tmm2, tmm4, tmm6",
            "tileloadd tmm5, [{a} + {sa} * 1 + 96]",
            "tileloadd tmm7, [{w} + {s64} * 1 + 1536]",
            "tdpbusd tmm3, tmm5, tmm7",
            "tilestored [{c} + {s64} * 1], tmm0",
            "tilestored [{c} + {s64} * 1 + 1024], tmm1",
            "tilestored [{c} + {s64} * 1 + 2048], tmm2",
            "tilestored [{c} + {s64} * 1 + 3072], tmm3",
            a = in(reg) a,
            sa = in(reg) arow,
            w = in(reg) w,
            s64 = in(reg) 64usize,
            c = in(reg) c,
            options(nostack),
        );
    }
}

/// The dots of one block (see [`dots4`]).
///
/// # Safety
///
/// As [`dots4`]'s.
#[inline(always)]
unsafe fn dots1(a: *const u8, arow: usize, w: *const u8, c: *mut [[i32; TILE]; TILE]) {
    // SAFETY: the caller's promise.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tileloadd tmm4, [{a} + {sa} * 1]",
            "tileloadd tmm6, [{w} + {s64} * 1]",
            "tdpbusd tmm0, tmm4, tmm6",
            "tilestored [{c} + {s64} * 1], tmm0",
            a = in(reg) a,
            sa = in(reg) arow,
            w = in(reg) w,
            s64 = in(reg) 64usize,
            c = in(reg) c,
            options(nostack),
        );
    }
}

/// The epilogue of one block for tokens `$t` of a tile (see [`tile`]): unrolled by hand, so
/// the 16 accumulators stay in registers.
macro_rules! tokens {
    ($mins:ident, $acc:ident, $d:ident, $sx:ident, $dots:ident, $nb:ident, $bi:ident,
     $dw:ident, $corr:ident, $m:ident; $($t:literal)*) => {$(
        // SAFETY: token $t < 16 and block $bi < nb index inside the 16 tokens' `d` and `s`
        // (asserted in `tile`); the dots slot holds 16 rows of 16 i32, written by the tile
        // stores before this epilogue.
        let (dx, s, q) = unsafe {
            (*$d.add($t * $nb + $bi), *$sx.add($t * $nb + $bi),
             _mm512_load_si512($dots.add($t * TILE).cast()))
        };
        let dot = _mm512_add_epi32(q, $corr);
        let scale = _mm512_mul_ps($dw, _mm512_set1_ps(dx));
        $acc[$t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, $acc[$t]);
        if $mins {
            $acc[$t] = _mm512_fmadd_ps($m, _mm512_set1_ps(s), $acc[$t]);
        }
    )*};
}

/// One 16-token x 16-row tile over every block: returns `[token][row]` results. The dots of
/// the next [`BATCH`] blocks are computed (into the other half of `dots`) before the epilogue
/// of the current ones, so the tile unit and the float epilogue overlap.
///
/// # Safety
///
/// The CPU must have AMX-TILE, AMX-INT8, AVX-512 F/BW/VL/VNNI, FMA and F16C, the process must
/// hold the tile data permission, and the calling thread must have loaded [`TileConfig`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
unsafe fn tile<const MINS: bool>(
    acts: &Acts,
    t0: usize,
    grp: &Group,
    dots: &mut Dots,
) -> [[f32; TILE]; TILE] {
    let nb = acts.nb;
    let arow = nb * QK;
    assert!(t0 + TILE <= acts.padded);
    assert!(grp.b.len() == nb * B_BYTES && grp.dw.len() == nb * TILE);
    assert!(grp.corr.len() == nb * TILE && grp.m.len() == nb * TILE);
    let a = acts.q[t0 * arow..(t0 + TILE) * arow].as_ptr();
    let d = acts.d[t0 * nb..(t0 + TILE) * nb].as_ptr();
    let sx = acts.s[t0 * nb..(t0 + TILE) * nb].as_ptr();
    let w = grp.b.as_ptr();
    let c = dots.0.as_mut_ptr();
    let mut acc = [_mm512_setzero_ps(); TILE];
    // The float epilogue of block `bi`, whose dots are at `c + slot` (a macro rather than a
    // closure: the 16 accumulators must stay in registers).
    macro_rules! epilogue {
        ($bi:expr, $slot:expr) => {{
            let (bi, slot): (usize, usize) = ($bi, $slot);
            let corr = _mm512_loadu_si512(grp.corr[bi * TILE..].as_ptr().cast());
            let dw = _mm512_loadu_ps(grp.dw[bi * TILE..].as_ptr());
            let m = _mm512_loadu_ps(grp.m[bi * TILE..].as_ptr());
            // Read through `c`, the pointer the tile stores wrote through.
            let dots = c.wrapping_add(slot).cast::<i32>();
            tokens!(MINS, acc, d, sx, dots, nb, bi, dw, corr, m;
                0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
        }};
    }
    // SAFETY (every `dots4` / `dots1` below): the A tiles read 16 rows of 32 bytes at stride
    // `arow` from `a + 32 b`: the 16 tokens' block b < nb, inside `acts.q` (asserted above);
    // the B tiles read block b's 512-byte tile inside `grp.b` (asserted); the dots go to slots
    // `0..2 BATCH` of `dots`. The CPU features and the configuration are the caller's promise.
    let batches = nb / BATCH;
    if batches > 0 {
        unsafe { dots4(a, arow, w, c) };
    }
    for k in 0..batches {
        let half = (k % 2) * BATCH;
        if k + 1 < batches {
            let (b, next) = ((k + 1) * BATCH, BATCH - half);
            unsafe { dots4(a.add(b * QK), arow, w.add(b * B_BYTES), c.add(next)) };
        }
        for i in 0..BATCH {
            epilogue!(k * BATCH + i, half + i);
        }
    }
    for bi in batches * BATCH..nb {
        unsafe { dots1(a.add(bi * QK), arow, w.add(bi * B_BYTES), c) };
        epilogue!(bi, 0);
    }
    let mut res = [[0f32; TILE]; TILE];
    for (r, a) in res.iter_mut().zip(&acc) {
        _mm512_storeu_ps(r.as_mut_ptr(), *a);
    }
    res
}
