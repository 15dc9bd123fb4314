//! The forward pass on an NVIDIA GPU (feature `cuda`), whole or split with the CPU.
//!
//! [`GpuModel`] uploads the weights of the first `n_gpu_layers` blocks once, in their GGML block
//! formats, and runs those layers on the GPU with `engram-kernels-cuda`; the remaining layers
//! and the output head run on the CPU path of the same [`Model`], so the activations cross PCIe
//! once per forward call at the split (as llama.cpp's `-ngl` does). The KV cache of GPU layers
//! lives in device memory ([`GpuCache`]), the rest in an ordinary [`KvCache`]. Every scaling
//! variant of RoPE is the CPU's own: the angles are computed on the host by [`crate::Rope`] and
//! uploaded with the call, and token embeddings are dequantised on the host (as llama.cpp keeps
//! `token_embd` in host memory) and uploaded as f32 rows.

use std::sync::Arc;

use engram_kernels::GgmlType;
use engram_kernels_cuda::{
    AttentionArgs, Buffer, Device, Event, Graph, KvImport, Lane, ManyAttention, MatmulScratch,
    Pinned, SeqCacheRef, Weight, MAX_GEMV_BATCH, SEQ_TABLE_ENTRY,
};

use crate::config::RopeStyle;
use crate::error::{ModelError, Result};
use crate::kv::KvCache;
use crate::model::{Logits, Model};
use crate::weights::{Ffn, Matrix};

/// A weight matrix in device memory, still in its GGML block layout.
struct DeviceMatrix {
    buf: Buffer,
    ty: GgmlType,
    rows: usize,
    cols: usize,
}

impl DeviceMatrix {
    fn weight(&self) -> Weight<'_> {
        Weight {
            buf: &self.buf,
            ty: self.ty,
            rows: self.rows,
        }
    }
}

struct DeviceLayer {
    attn_norm: Buffer,
    wq: DeviceMatrix,
    wk: DeviceMatrix,
    wv: DeviceMatrix,
    wo: DeviceMatrix,
    bq: Option<Buffer>,
    bk: Option<Buffer>,
    bv: Option<Buffer>,
    q_norm: Option<Buffer>,
    k_norm: Option<Buffer>,
    ffn_norm: Buffer,
    w_gate: DeviceMatrix,
    w_up: DeviceMatrix,
    w_down: DeviceMatrix,
}

/// Activation buffers of one call, kept between calls and grown when a call has more rows.
#[derive(Default)]
struct Scratch {
    rows: usize,
    bufs: Vec<Buffer>,
    /// f16 copy of the widest weight matrix (prefill through cuBLAS only).
    w16: Option<Buffer>,
    partial: Option<Buffer>,
    logits: Option<Buffer>,
    /// Q8_1 activations of decode's GEMV.
    q8: Option<Buffer>,
    /// Stored KV on its way into a cache ([`GpuModel::import_kv`],
    /// [`GpuModel::forward_fused_from_host`]): keys and values, and each chunk's shift angles.
    stage: Option<(Buffer, Buffer)>,
    shifts: Option<Buffer>,
    /// The caches of a batched decode step's sequences ([`Device::write_seq_table`]).
    seq_table: Option<Buffer>,
    /// Bumped whenever a buffer is (re)allocated: a captured graph holds the old addresses.
    generation: u64,
}

/// What the forward pass calls before each layer's KV is written (`layer`, the first
/// sequence's cache): fused prefill from host memory queues the stored KV of later layers on
/// the copy lane and makes the compute lane wait for this layer's. A call with a hook is never
/// captured into a graph (its copies and waits change from call to call).
type LayerHook<'h> = dyn FnMut(&Device, &Scratch, &GpuCache, usize) -> Result<()> + 'h;

/// Device times of one layer of [`GpuModel::forward_fused_from_host`] (with `timeline`), in
/// milliseconds from the call's start: when the layer's stored KV began and finished arriving
/// on the copy lane, and when the compute lane reached the layer's attention and when it went
/// on (the difference is the time it waited for that KV).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerTimes {
    pub copy_start_ms: f32,
    pub copy_end_ms: f32,
    pub wait_start_ms: f32,
    pub wait_end_ms: f32,
}

/// Keys (after RoPE at `positions`) and values of a run of slots of every layer, in page-locked
/// host memory, `[layer][kv_head][slot][head_dim]` f16: a chunk's stored KV once read from the
/// DRAM or NVMe tier, ready to be copied to the GPU at the bus's full rate.
pub struct HostKv {
    pub positions: Vec<i32>,
    keys: Pinned,
    values: Pinned,
}

impl HostKv {
    /// Slots held.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no slot is held.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Bytes of keys and values.
    pub fn bytes(&self) -> usize {
        self.keys.bytes().len() + self.values.bytes().len()
    }
}

/// Indices into [`Scratch::bufs`].
const X: usize = 0;
const H: usize = 1;
const Q: usize = 2;
const K: usize = 3;
const V: usize = 4;
const ATTN: usize = 5;
const PROJ: usize = 6;
const GATE: usize = 7;
const UP: usize = 8;
const ANGLES: usize = 9;
const QPOS: usize = 10;
const SLOTS: usize = 11;
const X16: usize = 12;
/// The sequence of each row of a batched decode step (i32).
const SEQ: usize = 13;

/// The KV cache of one sequence for a [`GpuModel`]: f16 keys (after RoPE) and values of the GPU
/// layers in device memory (`[layer][kv_head][capacity][head_dim]`), the CPU layers' in a
/// [`KvCache`], and the position of every slot.
pub struct GpuCache {
    keys: Buffer,
    values: Buffer,
    /// Position of each slot, on the device (attention's mask) and here.
    kv_pos: Buffer,
    positions: Vec<i32>,
    capacity: usize,
    /// The CPU layers' cache (a split placement), in step with `positions`.
    cpu: Option<KvCache>,
}

impl GpuCache {
    /// Filled slots.
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    /// Whether no slot is filled.
    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }

    /// Forgets every slot from `len` on.
    pub fn truncate(&mut self, len: usize) {
        self.positions.truncate(len);
        if let Some(cpu) = &mut self.cpu {
            cpu.truncate(len);
        }
    }
}

/// A [`Model`] with its first layers on a GPU.
pub struct GpuModel {
    model: Arc<Model>,
    dev: Device,
    layers: Vec<DeviceLayer>,
    /// The final norm and output head, on the device when every layer is.
    output: Option<(Buffer, DeviceMatrix)>,
    scratch: Scratch,
    weight_bytes: u64,
    /// Decode runs the fused element-wise kernels ([`GpuModel::set_fused`]).
    fused: bool,
    /// Decode steps replay a captured graph ([`GpuModel::set_graphs`]).
    graphs: bool,
    /// The last captured decode step and what it was captured for.
    graph: std::cell::RefCell<Option<(Vec<u64>, Graph)>>,
    /// Why capturing a decode step failed (graphs stay off from then on).
    graph_error: std::cell::RefCell<Option<String>>,
    /// Seconds per kind of work, when profiling ([`GpuModel::set_profiling`]).
    profile: std::cell::RefCell<Option<Profile>>,
}

/// Time per kind of work: the stream is synchronised at every boundary, so the figures are
/// exact per kind but the whole runs slower than unprofiled.
#[derive(Default)]
struct Profile {
    last: Option<std::time::Instant>,
    seconds: Vec<(&'static str, f64)>,
}

impl GpuModel {
    /// Uploads the weights of the first `n_gpu_layers` blocks (all of them and the output head
    /// when `n_gpu_layers >= n_layer`) to `dev`.
    pub fn new(model: Arc<Model>, dev: Device, n_gpu_layers: usize) -> Result<GpuModel> {
        let cfg = model.config().clone();
        if cfg.head_dim != cfg.head_dim_v {
            return Err(gpu_unsupported("key and value heads of different widths"));
        }
        if cfg.moe.is_some() && n_gpu_layers > 0 {
            // The experts-on-the-CPU placement (attention on the GPU) is not built yet.
            return Err(gpu_unsupported(
                "mixture-of-experts blocks (their routed experts run on the CPU)",
            ));
        }
        let n_gpu = n_gpu_layers.min(cfg.n_layer);
        let mut weight_bytes = 0u64;
        let mut layers = Vec::with_capacity(n_gpu);
        for l in &model.weights.layers[..n_gpu] {
            let Ffn::Dense {
                gate: w_gate,
                up: w_up,
                down: w_down,
            } = &l.ffn
            else {
                unreachable!("mixture-of-experts models are refused above");
            };
            let mut m = |w: &Matrix| -> Result<DeviceMatrix> {
                let dm = upload_matrix(&dev, &model, w)?;
                weight_bytes += dm.buf.bytes() as u64;
                Ok(dm)
            };
            let layer = DeviceLayer {
                wq: m(&l.wq)?,
                wk: m(&l.wk)?,
                wv: m(&l.wv)?,
                wo: m(&l.wo)?,
                w_gate: m(w_gate)?,
                w_up: m(w_up)?,
                w_down: m(w_down)?,
                attn_norm: dev.upload(&l.attn_norm).map_err(gpu)?,
                ffn_norm: dev.upload(&l.ffn_norm).map_err(gpu)?,
                bq: upload_opt(&dev, &l.bq)?,
                bk: upload_opt(&dev, &l.bk)?,
                bv: upload_opt(&dev, &l.bv)?,
                q_norm: upload_opt(&dev, &l.q_norm)?,
                k_norm: upload_opt(&dev, &l.k_norm)?,
            };
            layers.push(layer);
        }
        let output = if n_gpu == cfg.n_layer {
            let head = upload_matrix(&dev, &model, &model.weights.output)?;
            weight_bytes += head.buf.bytes() as u64;
            Some((dev.upload(&model.weights.output_norm).map_err(gpu)?, head))
        } else {
            None
        };
        dev.synchronize().map_err(gpu)?;
        Ok(GpuModel {
            model,
            dev,
            layers,
            output,
            scratch: Scratch::default(),
            weight_bytes,
            fused: false,
            graphs: true,
            graph: std::cell::RefCell::new(None),
            graph_error: std::cell::RefCell::new(None),
            profile: std::cell::RefCell::new(None),
        })
    }

    /// Device memory the forward pass needs besides weights and KV, for calls of up to `rows`
    /// tokens over up to `context` slots: the activation buffers, the f16 copy of the largest
    /// matrix (prefill's cuBLAS input), the attention scratch and one row of logits per token.
    /// The placement planner reserves it ([`crate::placement::PlacementRequest`]).
    pub fn scratch_estimate(model: &Model, rows: usize, context: usize) -> u64 {
        let cfg = model.config();
        let (d, qw, kvw, ff) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.n_ff);
        let activations = rows * (3 * d + 2 * qw + 2 * kvw + 2 * ff + d.max(qw).max(ff) / 2) * 4;
        let largest = [d * qw, d * kvw, qw * d, d * ff, ff * d, cfg.vocab_size * d]
            .into_iter()
            .max()
            .unwrap_or(0);
        let attention = Device::attention_scratch(rows, cfg.n_head, cfg.head_dim, context);
        (activations + 2 * largest + attention + rows * cfg.vocab_size * 4) as u64
    }

    /// The CPU model this runs (configuration, tokenizer, the CPU layers).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.dev
    }

    /// Makes decode calls (up to [`MAX_GEMV_BATCH`] rows) run the fused element-wise kernels:
    /// the residual add with the next norm, the norms and SwiGLU with the GEMVs' Q8_1
    /// quantisation, both RoPEs in one launch (six launches fewer per layer, the same
    /// arithmetic in the same order). Off by default: it saves launches, which graphs already
    /// remove, and its one-block norm is slower than the norm and quantisation it replaces
    /// (measured on an H200: 1.07x decode of a 1B without graphs, 0.96x of a 7B with them).
    pub fn set_fused(&mut self, on: bool) {
        self.fused = on;
    }

    /// Whether decode calls (up to [`MAX_GEMV_BATCH`] rows, every layer on the GPU) replay a
    /// graph of the step's launches, captured once per batch shape and caches (and again each
    /// time the attention's split count grows, every 64 slots): one launch instead of hundreds.
    /// On by default (on an H200: 1.13x decode of a 7B, 1.24x of a 1B at batch 1,
    /// docs/bench/2026-11-28-gpu.md).
    pub fn set_graphs(&mut self, on: bool) {
        self.graphs = on;
        *self.graph.borrow_mut() = None;
        *self.graph_error.borrow_mut() = None;
    }

    /// Why decode steps stopped replaying graphs, if capturing one failed (they then run
    /// launch by launch, as without [`GpuModel::set_graphs`]).
    pub fn graph_error(&self) -> Option<String> {
        self.graph_error.borrow().clone()
    }

    /// Starts (or stops) timing each kind of work of the forward calls: matmuls, attention,
    /// element-wise kernels, input uploads, the output head. Profiling synchronises the device
    /// between kinds, so it slows the calls down.
    pub fn set_profiling(&mut self, on: bool) {
        *self.profile.borrow_mut() = on.then(Profile::default);
    }

    /// Seconds spent per kind of work since profiling started, and resets them.
    pub fn take_profile(&self) -> Vec<(&'static str, f64)> {
        match self.profile.borrow_mut().as_mut() {
            Some(p) => std::mem::take(&mut p.seconds),
            None => Vec::new(),
        }
    }

    /// Ends a stretch of `what` work: with profiling on, waits for the device and charges the
    /// time since the last mark to `what`.
    fn mark(&self, what: &'static str) -> Result<()> {
        let mut guard = self.profile.borrow_mut();
        let Some(p) = guard.as_mut() else {
            return Ok(());
        };
        self.dev.synchronize().map_err(gpu)?;
        let now = std::time::Instant::now();
        if let Some(last) = p.last {
            let secs = (now - last).as_secs_f64();
            match p.seconds.iter_mut().find(|(w, _)| *w == what) {
                Some(entry) => entry.1 += secs,
                None => p.seconds.push((what, secs)),
            }
        }
        p.last = Some(now);
        Ok(())
    }

    /// Frees the uploaded weights and hands the device back (to place the model anew).
    pub fn into_device(self) -> Device {
        self.dev
    }

    /// Blocks running on the GPU (the first ones).
    pub fn n_gpu_layers(&self) -> usize {
        self.layers.len()
    }

    /// Bytes of weights uploaded to the device.
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes
    }

    /// One line: where the layers, the head and the KV cache run.
    pub fn describe(&self) -> String {
        let n = self.model.config().n_layer;
        let g = self.layers.len();
        let dev = format!("cuda:{}", self.dev.info().ordinal);
        let gib = self.weight_bytes as f64 / (1u64 << 30) as f64;
        match g {
            0 => "every layer on the CPU".into(),
            _ if g == n => format!("all {n} layers and the output head on {dev} ({gib:.2} GiB of weights)"),
            _ => format!(
                "layers 0-{} on {dev} ({gib:.2} GiB of weights), layers {g}-{} and the output head on the CPU",
                g - 1,
                n - 1
            ),
        }
    }

    /// An empty cache for `capacity` tokens: the GPU layers' part in device memory.
    pub fn new_cache(&self, capacity: usize) -> Result<GpuCache> {
        let cfg = self.model.config();
        let per_layer = cfg.n_head_kv * capacity * cfg.head_dim * 2;
        let bytes = (per_layer * self.layers.len()).max(1);
        let cpu = (self.layers.len() < cfg.n_layer).then(|| self.model.new_cache(capacity));
        Ok(GpuCache {
            keys: self.dev.alloc(bytes).map_err(gpu)?,
            values: self.dev.alloc(bytes).map_err(gpu)?,
            kv_pos: self.dev.alloc(capacity.max(1) * 4).map_err(gpu)?,
            positions: Vec::with_capacity(capacity),
            capacity,
            cpu,
        })
    }

    /// A cache for `capacity` tokens holding everything `kv` holds (a prompt prefilled on the
    /// CPU, fused or not): the GPU layers' keys and values copied to device memory (keys are
    /// untiled on the way), the CPU layers' kept in the cache's [`KvCache`]. Decode then runs
    /// here ([`GpuModel::forward_batch`]).
    pub fn upload_cache(&self, kv: &KvCache, capacity: usize) -> Result<GpuCache> {
        let cfg = self.model.config();
        kv.check_layout(cfg)?;
        let len = kv.len();
        if len > capacity {
            return Err(ModelError::CacheFull {
                used: 0,
                capacity,
                requested: len,
            });
        }
        let mut cache = self.new_cache(capacity)?;
        let (heads, hd) = (cfg.n_head_kv, cfg.head_dim);
        for l in 0..self.layers.len() {
            for h in 0..heads {
                let at = ((l * heads + h) * capacity) * hd * 2;
                self.dev
                    .write(&cache.keys, at, &kv.key_rows(l, h, len))
                    .map_err(gpu)?;
                self.dev
                    .write(&cache.values, at, kv.values(l, h, len))
                    .map_err(gpu)?;
            }
        }
        if len > 0 {
            self.dev
                .write(&cache.kv_pos, 0, kv.positions())
                .map_err(gpu)?;
        }
        if let Some(cpu) = &mut cache.cpu {
            cpu.append_from(kv, 0..len)?;
        }
        cache.positions.extend_from_slice(kv.positions());
        Ok(cache)
    }

    /// The whole of `kv` as a CPU [`KvCache`] of `kv.len()` slots (a finished conversation
    /// kept for its next turn): the inverse of [`GpuModel::upload_cache`].
    pub fn download_cache(&self, kv: &GpuCache) -> Result<KvCache> {
        let cfg = self.model.config();
        let (heads, hd, len) = (cfg.n_head_kv, cfg.head_dim, kv.len());
        let n_gpu = self.layers.len();
        let read = |buf: &Buffer, l: usize, h: usize| -> Result<Vec<half::f16>> {
            let mut out = vec![half::f16::ZERO; len * hd];
            if len > 0 {
                let at = ((l * heads + h) * kv.capacity) * hd * 2;
                self.dev.read(buf, at, &mut out).map_err(gpu)?;
            }
            Ok(out)
        };
        let mut keys = Vec::with_capacity(cfg.n_layer * heads);
        let mut values = Vec::with_capacity(cfg.n_layer * heads);
        for l in 0..cfg.n_layer {
            for h in 0..heads {
                if l < n_gpu {
                    keys.push(read(&kv.keys, l, h)?);
                    values.push(read(&kv.values, l, h)?);
                } else {
                    let cpu = kv.cpu.as_ref().ok_or_else(|| {
                        ModelError::Gpu("a split cache without its CPU part".into())
                    })?;
                    keys.push(cpu.key_rows(l, h, len));
                    values.push(cpu.values(l, h, len).to_vec());
                }
            }
        }
        let mut out = self.model.new_cache(len);
        out.append_rows(
            &kv.positions,
            |l, h| keys[l * heads + h].clone(),
            |l, h| values[l * heads + h].clone(),
        )?;
        Ok(out)
    }

    /// Checks the way `engramd` serves from this GPU against the CPU path, before it does:
    /// `prompt` prefilled on the CPU, its cache uploaded ([`GpuModel::upload_cache`]) to two
    /// sequences decoded together ([`GpuModel::forward_batch`]) for `steps` tokens, fed the
    /// CPU's greedy tokens, and the cache read back ([`GpuModel::download_cache`]). Passes when
    /// at every step both sequences' logits agree with the CPU's ([`same_top`]) and the
    /// read-back cache holds the CPU cache's positions. Returns the largest
    /// absolute logit difference over the top 5, or why it failed.
    pub fn check_serving(&mut self, prompt: &[u32], steps: usize) -> Result<f32> {
        let model = self.model.clone();
        let v = model.config().vocab_size;
        if prompt.is_empty() {
            return Err(ModelError::Gpu("an empty check prompt".into()));
        }
        let capacity = prompt.len() + steps + 1;
        let positions: Vec<i32> = (0..prompt.len() as i32).collect();
        let mut cpu = model.new_cache(capacity);
        let mut want = model.forward(prompt, &positions, &mut cpu, Logits::Last)?;
        let mut a = self.upload_cache(&cpu, capacity)?;
        let mut b = self.upload_cache(&cpu, capacity)?;
        let mut worst = 0f32;
        for step in 0..steps {
            let token = [crate::argmax(&want)];
            let pos = [(prompt.len() + step) as i32];
            let got = self.forward_batch(
                &mut [
                    (&token[..], &pos[..], &mut a),
                    (&token[..], &pos[..], &mut b),
                ],
                Logits::Last,
            )?;
            want = model.forward(&token, &pos, &mut cpu, Logits::Last)?;
            for (seq, row) in got.chunks_exact(v).enumerate() {
                let (mine, theirs) = (top_ids(row, 5), top_ids(&want, 5));
                if !same_top(row, &want) {
                    return Err(ModelError::Gpu(format!(
                        "step {step}, sequence {seq}: GPU top 5 {mine:?}, CPU top 5 {theirs:?}"
                    )));
                }
                for &i in &theirs {
                    worst = worst.max((row[i] - want[i]).abs());
                }
            }
        }
        let back = self.download_cache(&a)?;
        if back.positions() != cpu.positions() {
            return Err(ModelError::Gpu(format!(
                "the cache read back holds positions {:?}, not {:?}",
                back.positions(),
                cpu.positions()
            )));
        }
        Ok(worst)
    }

    /// Copies slots `range` of `kv` (every layer; the model must be wholly on the GPU) to
    /// page-locked host memory: how chunk KV computed on the GPU is kept in DRAM.
    pub fn export_kv(&self, kv: &GpuCache, range: std::ops::Range<usize>) -> Result<HostKv> {
        let cfg = self.model.config();
        if self.output.is_none() {
            return Err(gpu_unsupported("exporting KV with layers on the CPU"));
        }
        if range.end > kv.len() || range.start > range.end {
            return Err(ModelError::Gpu(format!(
                "slots {range:?} of a cache holding {}",
                kv.len()
            )));
        }
        let (len, hd, heads) = (range.len(), cfg.head_dim, cfg.n_head_kv);
        let bytes = cfg.n_layer * heads * len * hd * 2;
        let mut keys = self.dev.pinned(bytes).map_err(gpu)?;
        let mut values = self.dev.pinned(bytes).map_err(gpu)?;
        let mut row = vec![0u16; len * hd];
        for (cache, host) in [(&kv.keys, &mut keys), (&kv.values, &mut values)] {
            let out = host.bytes_mut().map_err(gpu)?;
            for lh in 0..cfg.n_layer * heads {
                let src = (lh * kv.capacity + range.start) * hd * 2;
                self.dev.read(cache, src, &mut row).map_err(gpu)?;
                let dst = &mut out[lh * len * hd * 2..(lh + 1) * len * hd * 2];
                for (d, v) in dst.chunks_exact_mut(2).zip(&row) {
                    d.copy_from_slice(&v.to_le_bytes());
                }
            }
        }
        Ok(HostKv {
            positions: kv.positions[range].to_vec(),
            keys,
            values,
        })
    }

    /// Appends `stored` to `kv` moved by `shift` positions: one asynchronous copy each of the
    /// keys and values from page-locked memory, then a kernel that places every layer's slots
    /// and rotates the keys on by `shift` ([`crate::Rope::shift`], so YaRN's magnitude is not
    /// applied twice). Returns once the work is queued.
    pub fn import_kv(&mut self, kv: &mut GpuCache, stored: &HostKv, shift: i32) -> Result<()> {
        let cfg = self.model.config().clone();
        if self.output.is_none() {
            return Err(gpu_unsupported("importing KV with layers on the CPU"));
        }
        let len = stored.len();
        if kv.len() + len > kv.capacity {
            return Err(ModelError::CacheFull {
                used: kv.len(),
                capacity: kv.capacity,
                requested: len,
            });
        }
        let bytes = stored.keys.bytes().len();
        let positions = self.moved_positions(stored, shift)?;
        let angles: Vec<f32> = self
            .model
            .rope
            .shift_angles(shift)
            .iter()
            .flat_map(|&(c, s)| [c, s])
            .collect();
        self.ensure_stage(bytes)?;
        self.ensure_shifts(angles.len() * 4)?;
        let (stage_k, stage_v) = self.scratch.stage.as_ref().expect("allocated above");
        let shift_buf = self.scratch.shifts.as_ref().expect("allocated above");
        let dev = &self.dev;
        dev.write_pinned(stage_k, 0, &stored.keys, 0, bytes)
            .map_err(gpu)?;
        dev.write_pinned(stage_v, 0, &stored.values, 0, bytes)
            .map_err(gpu)?;
        dev.write(shift_buf, 0, &angles).map_err(gpu)?;
        let first = kv.len();
        dev.kv_import(&KvImport {
            stage_k,
            stage_v,
            stage_offset: 0,
            keys: &kv.keys,
            values: &kv.values,
            first_layer: 0,
            layers: cfg.n_layer,
            first_slot: first,
            len,
            kv_heads: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            capacity: kv.capacity,
            shift: shift_buf,
            shift_offset: 0,
            pairs: self.model.rope.pairs(),
            neox: cfg.rope_style == RopeStyle::NeoX,
        })
        .map_err(gpu)?;
        dev.write(&kv.kv_pos, first * 4, &positions).map_err(gpu)?;
        kv.positions.extend_from_slice(&positions);
        Ok(())
    }

    /// [`Model::forward`] on the GPU: runs `tokens` at `positions`, appending their keys and
    /// values to `kv`, and returns the logits asked for. The same position mask as the CPU path:
    /// token `i` attends to every slot whose position is `<= positions[i]`.
    pub fn forward(
        &mut self,
        tokens: &[u32],
        positions: &[i32],
        kv: &mut GpuCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_batch(&mut [(tokens, positions, kv)], logits)
    }

    /// [`Model::forward_batch`] on the GPU: several sequences, each over its own cache, share
    /// every weight read (decode of a batch costs about as much memory traffic as one).
    /// Returns the logits asked for, sequence after sequence.
    pub fn forward_batch(
        &mut self,
        seqs: &mut [(&[u32], &[i32], &mut GpuCache)],
        logits: Logits,
    ) -> Result<Vec<f32>> {
        self.forward_inner(seqs, &[], logits, None)
    }

    /// Fused prefill's recompute: the first `overwrite.len()` tokens are already in `kv` (slot
    /// `overwrite[i]` holds position `positions[i]`, e.g. stored chunk KV placed by
    /// [`GpuModel::import_kv`]) and get fresh keys and values in place; the rest are appended.
    /// Masking stays by position, as in [`Model::forward_blend`]'s recompute.
    pub fn forward_fused(
        &mut self,
        tokens: &[u32],
        positions: &[i32],
        overwrite: &[usize],
        kv: &mut GpuCache,
        logits: Logits,
    ) -> Result<Vec<f32>> {
        check_overwrite(kv, tokens, positions, overwrite)?;
        self.forward_inner(&mut [(tokens, positions, kv)], overwrite, logits, None)
    }

    /// Fused prefill straight from host memory: appends the stored `chunks` to `kv` (each moved
    /// by its shift, as [`GpuModel::import_kv`] does) and runs [`GpuModel::forward_fused`] in
    /// one call, with the chunks' KV copied to the device layer by layer on the copy lane while
    /// the compute lane works: layer `l`'s attention waits only for layer `l`'s stored KV, so
    /// the PCIe copy of later layers overlaps the recompute of earlier ones. `overwrite` names
    /// slots counted after the chunks are appended. With `timeline`, also returns each layer's
    /// [`LayerTimes`].
    #[allow(clippy::too_many_arguments)]
    pub fn forward_fused_from_host(
        &mut self,
        chunks: &[(&HostKv, i32)],
        tokens: &[u32],
        positions: &[i32],
        overwrite: &[usize],
        kv: &mut GpuCache,
        logits: Logits,
        timeline: bool,
    ) -> Result<(Vec<f32>, Vec<LayerTimes>)> {
        let cfg = self.model.config().clone();
        if self.output.is_none() {
            return Err(gpu_unsupported("importing KV with layers on the CPU"));
        }
        let (heads, hd, n_layer) = (cfg.n_head_kv, cfg.head_dim, cfg.n_layer);
        let pairs = self.model.rope.pairs();
        let first = kv.len();
        let total: usize = chunks.iter().map(|(c, _)| c.len()).sum();
        if first + total > kv.capacity {
            return Err(ModelError::CacheFull {
                used: first,
                capacity: kv.capacity,
                requested: total,
            });
        }
        // Where each chunk goes: its first slot, its length, its bytes into a layer's stage.
        let mut placed = Vec::with_capacity(chunks.len());
        let mut shifted = Vec::with_capacity(total);
        let mut angles: Vec<f32> = Vec::with_capacity(chunks.len() * pairs * 2);
        let (mut slot, mut stage_bytes) = (first, 0usize);
        for (ci, (c, shift)) in chunks.iter().enumerate() {
            let len = c.len();
            shifted.extend(self.moved_positions(c, *shift)?);
            let table = self.model.rope.shift_angles(*shift);
            angles.extend(table.iter().take(pairs).flat_map(|&(c, s)| [c, s]));
            angles.resize((ci + 1) * pairs * 2, 0.0);
            placed.push((slot, len, stage_bytes));
            slot += len;
            stage_bytes += heads * len * hd * 2;
        }
        self.ensure_stage(stage_bytes)?;
        self.ensure_shifts(angles.len() * 4)?;
        let dev = &self.dev;
        // The copy lane may reuse the stage only after the compute lane's earlier work.
        let before = dev.record(Lane::Compute, false).map_err(gpu)?;
        dev.wait_for(Lane::Copy, &before).map_err(gpu)?;
        let table = self.scratch.shifts.as_ref().expect("allocated above");
        dev.write_on(Lane::Copy, table, 0, &angles).map_err(gpu)?;
        dev.write(&kv.kv_pos, first * 4, &shifted).map_err(gpu)?;
        kv.positions.extend_from_slice(&shifted);
        if let Err(e) = check_overwrite(kv, tokens, positions, overwrite) {
            kv.truncate(first);
            return Err(e);
        }
        let start = dev.record(Lane::Compute, timeline).map_err(gpu)?;

        let neox = cfg.rope_style == RopeStyle::NeoX;
        let mut copies: Vec<(Option<Event>, Event)> = Vec::with_capacity(n_layer);
        let mut waits: Vec<(Event, Event)> = Vec::with_capacity(n_layer);
        // Layers whose copies are queued ahead of the compute lane.
        const AHEAD: usize = 2;
        let mut hook = |dev: &Device, s: &Scratch, cache: &GpuCache, layer: usize| -> Result<()> {
            let (stage_k, stage_v) = s.stage.as_ref().expect("allocated above");
            let table = s.shifts.as_ref().expect("allocated above");
            while copies.len() < n_layer && copies.len() <= layer + AHEAD {
                let l = copies.len();
                let begun = timeline
                    .then(|| dev.record(Lane::Copy, true))
                    .transpose()
                    .map_err(gpu)?;
                for ((c, _), &(_, len, offset)) in chunks.iter().zip(&placed) {
                    let per_layer = heads * len * hd * 2;
                    for (stage, host) in [(stage_k, &c.keys), (stage_v, &c.values)] {
                        dev.write_pinned_on(
                            Lane::Copy,
                            stage,
                            offset,
                            host,
                            l * per_layer,
                            per_layer,
                        )
                        .map_err(gpu)?;
                    }
                }
                for (ci, &(slot, len, offset)) in placed.iter().enumerate() {
                    let args = KvImport {
                        stage_k,
                        stage_v,
                        stage_offset: offset,
                        keys: &cache.keys,
                        values: &cache.values,
                        first_layer: l,
                        layers: 1,
                        first_slot: slot,
                        len,
                        kv_heads: heads,
                        head_dim: hd,
                        capacity: cache.capacity,
                        shift: table,
                        shift_offset: ci * pairs * 8,
                        pairs,
                        neox,
                    };
                    dev.kv_import_on(Lane::Copy, &args).map_err(gpu)?;
                }
                copies.push((begun, dev.record(Lane::Copy, timeline).map_err(gpu)?));
            }
            let reached = dev.record(Lane::Compute, timeline).map_err(gpu)?;
            dev.wait_for(Lane::Compute, &copies[layer].1).map_err(gpu)?;
            waits.push((reached, dev.record(Lane::Compute, timeline).map_err(gpu)?));
            Ok(())
        };
        let out = self.forward_inner(
            &mut [(tokens, positions, &mut *kv)],
            overwrite,
            logits,
            Some(&mut hook),
        );
        let out = match out {
            Ok(out) => out,
            Err(e) => {
                self.dev.synchronize().map_err(gpu)?;
                kv.truncate(first);
                return Err(e);
            }
        };
        if !timeline {
            return Ok((out, Vec::new()));
        }
        self.dev.synchronize().map_err(gpu)?;
        let ms = |e: &Event| e.ms_since(&start).map_err(gpu);
        let mut times = Vec::with_capacity(n_layer);
        for ((begun, done), (reached, went)) in copies.iter().zip(&waits) {
            times.push(LayerTimes {
                copy_start_ms: begun.as_ref().map(ms).transpose()?.unwrap_or(0.0),
                copy_end_ms: ms(done)?,
                wait_start_ms: ms(reached)?,
                wait_end_ms: ms(went)?,
            });
        }
        Ok((out, times))
    }

    fn forward_inner(
        &mut self,
        seqs: &mut [(&[u32], &[i32], &mut GpuCache)],
        overwrite: &[usize],
        logits: Logits,
        hook: Option<&mut LayerHook<'_>>,
    ) -> Result<Vec<f32>> {
        let mut bounds = vec![0usize];
        for (tokens, positions, kv) in seqs.iter() {
            self.model.check_tokens(tokens, positions)?;
            let appended = tokens.len() - overwrite.len().min(tokens.len());
            if kv.len() + appended > kv.capacity {
                return Err(ModelError::CacheFull {
                    used: kv.len(),
                    capacity: kv.capacity,
                    requested: appended,
                });
            }
            bounds.push(bounds.last().unwrap() + tokens.len());
        }
        let n = *bounds.last().unwrap();
        if n == 0 {
            return Ok(Vec::new());
        }
        if !overwrite.is_empty() && self.output.is_none() {
            return Err(gpu_unsupported(
                "recomputing stored slots with layers on the CPU (place every layer on the GPU)",
            ));
        }
        let first_slots: Vec<usize> = seqs.iter().map(|s| s.2.len()).collect();
        let result = self.run(seqs, &bounds, overwrite, logits, hook);
        if result.is_err() {
            for (s, &first) in seqs.iter_mut().zip(&first_slots) {
                s.2.truncate(first);
            }
        }
        result
    }

    /// Runs the call: the first `overwrite.len()` tokens of the first sequence recompute those
    /// slots, every other token is appended to its sequence's cache.
    fn run(
        &mut self,
        seqs: &mut [(&[u32], &[i32], &mut GpuCache)],
        bounds: &[usize],
        overwrite: &[usize],
        logits: Logits,
        mut hook: Option<&mut LayerHook<'_>>,
    ) -> Result<Vec<f32>> {
        let model = self.model.clone();
        let cfg = model.config();
        let n = bounds[bounds.len() - 1];
        let (d, qw, kvw, ff, hd) = (
            cfg.n_embd,
            cfg.q_width(),
            cfg.kv_width(),
            cfg.n_ff,
            cfg.head_dim,
        );
        // A decode step replayed from a graph: every launch argument must stay the same from
        // step to step, so the attention reads the slots in use from the device (the batched
        // kernels, also for one sequence).
        let graphed = self.graphs
            && hook.is_none()
            && self.graph_error.borrow().is_none()
            && self.output.is_some()
            && n <= MAX_GEMV_BATCH
            && overwrite.is_empty()
            && self.profile.borrow().is_none();
        // A batched decode step stores and attends every sequence's rows in one launch each.
        let many = (seqs.len() > 1 || graphed) && n <= MAX_GEMV_BATCH && overwrite.is_empty();
        let partial = if many {
            let longest = seqs.iter().map(|(t, _, kv)| kv.len() + t.len()).max();
            Device::attention_many_scratch_for(n, cfg.n_head, hd, longest.unwrap_or(0))
        } else {
            seqs.iter()
                .map(|(t, _, kv)| {
                    Device::attention_scratch(t.len(), cfg.n_head, hd, kv.len() + t.len())
                })
                .max()
                .unwrap_or(0)
        };
        self.ensure_scratch(n, partial)?;
        if many
            && self
                .scratch
                .seq_table
                .as_ref()
                .is_none_or(|t| t.bytes() < seqs.len() * SEQ_TABLE_ENTRY)
        {
            self.scratch.seq_table = None;
            let bytes = seqs.len().max(MAX_GEMV_BATCH) * SEQ_TABLE_ENTRY;
            self.scratch.seq_table = Some(self.dev.alloc(bytes).map_err(gpu)?);
            self.scratch.generation += 1;
        }
        let dev = &self.dev;
        let s = &self.scratch;
        let b = |i: usize| &s.bufs[i];

        self.mark("host")?;
        // Inputs: embeddings, rotary angles, positions and destination slots.
        let mut x = vec![0.0f32; n * d];
        let tokens: Vec<u32> = seqs.iter().flat_map(|s| s.0.iter().copied()).collect();
        let positions: Vec<i32> = seqs.iter().flat_map(|s| s.1.iter().copied()).collect();
        for (t, &tok) in tokens.iter().enumerate() {
            model.weights.embed(tok, &mut x[t * d..(t + 1) * d])?;
        }
        let pairs = model.rope.pairs();
        let mut angles = Vec::with_capacity(n * pairs);
        for &p in &positions {
            model.rope.angles(p, &mut angles);
        }
        let angles: Vec<f32> = angles.iter().flat_map(|&(c, s)| [c, s]).collect();
        let mut slots = Vec::with_capacity(n);
        for (si, (tokens, pos, kv)) in seqs.iter_mut().enumerate() {
            let skip = if si == 0 { overwrite.len() } else { 0 };
            slots.extend(overwrite[..skip].iter().map(|&s| s as i32));
            let first = kv.len();
            slots.extend((first..first + tokens.len() - skip).map(|s| s as i32));
            dev.write(&kv.kv_pos, first * 4, &pos[skip..])
                .map_err(gpu)?;
            kv.positions.extend_from_slice(&pos[skip..]);
        }
        dev.write(b(X), 0, &x).map_err(gpu)?;
        dev.write(b(ANGLES), 0, &angles).map_err(gpu)?;
        dev.write(b(QPOS), 0, &positions).map_err(gpu)?;
        dev.write(b(SLOTS), 0, &slots).map_err(gpu)?;
        let table = if many {
            let seq_of_row: Vec<i32> = (0..seqs.len())
                .flat_map(|si| std::iter::repeat_n(si as i32, bounds[si + 1] - bounds[si]))
                .collect();
            dev.write(b(SEQ), 0, &seq_of_row).map_err(gpu)?;
            let refs: Vec<SeqCacheRef<'_>> = seqs
                .iter()
                .map(|(_, _, kv)| SeqCacheRef {
                    keys: &kv.keys,
                    values: &kv.values,
                    kv_pos: &kv.kv_pos,
                    capacity: kv.capacity,
                    kv_len: kv.len(),
                })
                .collect();
            let buf = s.seq_table.as_ref().expect("allocated above");
            let layers = self.layers.len();
            Some(
                dev.write_seq_table(buf, &refs, layers, cfg.n_head_kv, hd)
                    .map_err(gpu)?,
            )
        } else {
            None
        };
        self.mark("inputs")?;

        let q8 = s.q8.as_ref().expect("sized by ensure_scratch");
        let mscratch = |q8_ready: bool| MatmulScratch {
            q8,
            x16: b(X16),
            w16: s.w16.as_ref().unwrap_or(b(X16)),
            q8_ready,
        };
        // Matrices sharing one input (Q, K, V; gate, up) quantise or convert it once; with
        // `ready`, a fused kernel has already written its Q8_1 copy.
        let mm = |ms: &[&DeviceMatrix], input: &Buffer, outs: &[&Buffer], ready: bool| {
            let ws: Vec<Weight<'_>> = ms.iter().map(|m| m.weight()).collect();
            dev.matmul_many(&ws, ms[0].cols, input, n, outs, &mscratch(ready))
                .map_err(gpu)
        };
        // Decode fuses the residual adds, norms, SwiGLU and the GEMVs' activation quantisation
        // (and both RoPEs) into fewer launches: the same arithmetic, in the same order.
        let fuse = self.fused && n <= MAX_GEMV_BATCH && d % 32 == 0 && ff % 32 == 0;
        let neox = cfg.rope_style == RopeStyle::NeoX;
        let layer_bytes = cfg.n_head_kv * hd * 2;
        // Rows whose logits are wanted (indices into the call's rows).
        let wanted: Vec<usize> = match logits {
            Logits::None => Vec::new(),
            Logits::Last => bounds[1..].iter().map(|&end| end - 1).collect(),
            Logits::All => (0..n).collect(),
        };
        let logits_buf = s.logits.as_ref().expect("sized by ensure_scratch");
        {
            // Everything queued from here to the logits: the layers, then (every layer on the
            // GPU) the wanted rows gathered into H, normalised and multiplied by the head.
            let mut work = || -> Result<()> {
                for (li, layer) in self.layers.iter().enumerate() {
                    if fuse {
                        // The previous layer's FFN output is added here, before the norm.
                        let residual = (li > 0).then(|| b(PROJ));
                        dev.rms_norm_q8(
                            b(X),
                            residual,
                            &layer.attn_norm,
                            b(H),
                            n,
                            d,
                            cfg.rms_eps,
                            q8,
                        )
                        .map_err(gpu)?;
                    } else {
                        dev.rms_norm(b(X), &layer.attn_norm, b(H), n, d, cfg.rms_eps)
                            .map_err(gpu)?;
                    }
                    self.mark("elementwise")?;
                    mm(
                        &[&layer.wq, &layer.wk, &layer.wv],
                        b(H),
                        &[b(Q), b(K), b(V)],
                        fuse,
                    )?;
                    self.mark("matmul")?;
                    for (buf, bias, width) in
                        [(Q, &layer.bq, qw), (K, &layer.bk, kvw), (V, &layer.bv, kvw)]
                    {
                        if let Some(bias) = bias {
                            dev.add_bias(b(buf), bias, width, n * width).map_err(gpu)?;
                        }
                    }
                    if let Some(w) = &layer.q_norm {
                        dev.rms_norm(b(Q), w, b(Q), n * cfg.n_head, hd, cfg.rms_eps)
                            .map_err(gpu)?;
                    }
                    if let Some(w) = &layer.k_norm {
                        dev.rms_norm(b(K), w, b(K), n * cfg.n_head_kv, hd, cfg.rms_eps)
                            .map_err(gpu)?;
                    }
                    if fuse {
                        let (nh, nkv) = (cfg.n_head, cfg.n_head_kv);
                        dev.rope_qk(b(Q), b(K), b(ANGLES), n, nh, nkv, hd, pairs, neox)
                            .map_err(gpu)?;
                    } else {
                        dev.rope(b(Q), b(ANGLES), n, cfg.n_head, hd, pairs, neox)
                            .map_err(gpu)?;
                        dev.rope(b(K), b(ANGLES), n, cfg.n_head_kv, hd, pairs, neox)
                            .map_err(gpu)?;
                    }
                    self.mark("elementwise")?;
                    if let Some(hook) = hook.as_deref_mut() {
                        hook(dev, s, &*seqs[0].2, li)?;
                    }
                    if let Some(table) = &table {
                        let kvh = cfg.n_head_kv;
                        dev.kv_store_many(b(K), b(V), table, b(SEQ), b(SLOTS), n, li, kvh, hd)
                            .map_err(gpu)?;
                        dev.attention_many(&ManyAttention {
                            q: b(Q),
                            q_pos: b(QPOS),
                            seq_of_row: b(SEQ),
                            rows: n,
                            table,
                            layer: li,
                            n_head: cfg.n_head,
                            kv_heads: kvh,
                            head_dim: hd,
                            scale: 1.0 / (hd as f32).sqrt(),
                            partial: s.partial.as_ref().expect("sized by ensure_scratch"),
                            out: b(ATTN),
                        })
                        .map_err(gpu)?;
                    }
                    for (si, (_, _, kv)) in seqs.iter().enumerate().filter(|_| table.is_none()) {
                        let rows = bounds[si]..bounds[si + 1];
                        let offset = li * layer_bytes * kv.capacity;
                        dev.kv_store(
                            b(K),
                            b(V),
                            &kv.keys,
                            &kv.values,
                            offset,
                            b(SLOTS),
                            rows.start,
                            rows.len(),
                            cfg.n_head_kv,
                            hd,
                            kv.capacity,
                        )
                        .map_err(gpu)?;
                        dev.attention(&AttentionArgs {
                            q: b(Q),
                            q_pos: b(QPOS),
                            first_row: rows.start,
                            keys: &kv.keys,
                            values: &kv.values,
                            cache_offset: offset,
                            kv_pos: &kv.kv_pos,
                            n_q: rows.len(),
                            n_head: cfg.n_head,
                            kv_heads: cfg.n_head_kv,
                            head_dim: hd,
                            capacity: kv.capacity,
                            kv_len: kv.len(),
                            scale: 1.0 / (hd as f32).sqrt(),
                            partial: s.partial.as_ref().expect("sized by ensure_scratch"),
                            out: b(ATTN),
                        })
                        .map_err(gpu)?;
                    }
                    self.mark("attention")?;
                    mm(&[&layer.wo], b(ATTN), &[b(PROJ)], false)?;
                    self.mark("matmul")?;
                    if fuse {
                        let proj = Some(b(PROJ));
                        dev.rms_norm_q8(b(X), proj, &layer.ffn_norm, b(H), n, d, cfg.rms_eps, q8)
                            .map_err(gpu)?;
                    } else {
                        dev.add(b(X), b(PROJ), n * d).map_err(gpu)?;
                        dev.rms_norm(b(X), &layer.ffn_norm, b(H), n, d, cfg.rms_eps)
                            .map_err(gpu)?;
                    }
                    self.mark("elementwise")?;
                    mm(&[&layer.w_gate, &layer.w_up], b(H), &[b(GATE), b(UP)], fuse)?;
                    self.mark("matmul")?;
                    if fuse {
                        dev.swiglu_q8(b(GATE), b(UP), n, ff, q8).map_err(gpu)?;
                    } else {
                        dev.swiglu(b(GATE), b(UP), n * ff).map_err(gpu)?;
                    }
                    self.mark("elementwise")?;
                    mm(&[&layer.w_down], b(GATE), &[b(PROJ)], fuse)?;
                    self.mark("matmul")?;
                    if !fuse {
                        dev.add(b(X), b(PROJ), n * d).map_err(gpu)?;
                    }
                    self.mark("elementwise")?;
                }
                if fuse && !self.layers.is_empty() {
                    // The last layer's FFN output, which no next layer's norm added.
                    dev.add(b(X), b(PROJ), n * d).map_err(gpu)?;
                }
                if let Some((norm, head)) = &self.output {
                    if !wanted.is_empty() {
                        for (i, &r) in wanted.iter().enumerate() {
                            dev.copy(b(X), r * d * 4, b(H), i * d * 4, d * 4)
                                .map_err(gpu)?;
                        }
                        let m = wanted.len();
                        dev.rms_norm(b(H), norm, b(H), m, d, cfg.rms_eps)
                            .map_err(gpu)?;
                        let (w, cols) = (head.weight(), head.cols);
                        dev.matmul(&w, cols, b(H), m, logits_buf, &mscratch(false))
                            .map_err(gpu)?;
                    }
                }
                Ok(())
            };
            match &table {
                Some(table) if graphed => {
                    // What the graph's launches hold on to: the batch's shape and rows, the
                    // caches, the attention's splits, the buffers and how the kernels run.
                    let mut key = vec![
                        n as u64,
                        u64::from(fuse),
                        table.splits() as u64,
                        s.generation,
                        wanted.len() as u64,
                    ];
                    key.extend(wanted.iter().map(|&r| r as u64));
                    for (_, _, kv) in seqs.iter() {
                        key.extend([
                            kv.keys.address(),
                            kv.values.address(),
                            kv.kv_pos.address(),
                            kv.capacity as u64,
                        ]);
                    }
                    let mut cached = self.graph.borrow_mut();
                    if cached.as_ref().is_none_or(|(k, _)| *k != key) {
                        *cached = None;
                        dev.begin_capture().map_err(gpu)?;
                        let queued = work();
                        let graph = dev.end_capture();
                        queued?;
                        match graph {
                            Ok(graph) => *cached = Some((key, graph)),
                            // Nothing ran while capturing: queue the same work plainly, and
                            // stop capturing (the reason stays in `graph_error`).
                            Err(e) => {
                                *self.graph_error.borrow_mut() = Some(e.to_string());
                                work()?;
                            }
                        }
                    }
                    if let Some((_, graph)) = cached.as_ref() {
                        dev.launch_graph(graph).map_err(gpu)?;
                    }
                }
                _ => work()?,
            }
        }

        let Some(_) = &self.output else {
            // Split placement: the activations cross to the CPU for the remaining layers, all
            // sequences in one batched call.
            dev.read(b(X), 0, &mut x).map_err(gpu)?;
            let first_layer = self.layers.len();
            let mut cpu_seqs: Vec<crate::model::Sequence<'_>> = seqs
                .iter_mut()
                .map(|(tokens, pos, kv)| crate::model::Sequence {
                    tokens,
                    positions: pos,
                    kv: kv.cpu.as_mut().expect("split caches have a CPU part"),
                })
                .collect();
            return model.forward_batch_from_layer(&x, first_layer, &mut cpu_seqs, logits);
        };
        if wanted.is_empty() {
            dev.synchronize().map_err(gpu)?;
            return Ok(Vec::new());
        }
        let mut out = vec![0.0f32; wanted.len() * cfg.vocab_size];
        dev.read(logits_buf, 0, &mut out).map_err(gpu)?;
        self.mark("head")?;
        Ok(out)
    }

    /// The positions `stored`'s slots take moved by `shift`, once its size is checked against
    /// this model (both [`GpuModel::import_kv`] and [`GpuModel::forward_fused_from_host`]).
    fn moved_positions(&self, stored: &HostKv, shift: i32) -> Result<Vec<i32>> {
        let cfg = self.model.config();
        let (len, bytes) = (stored.len(), stored.keys.bytes().len());
        if bytes != cfg.n_layer * cfg.n_head_kv * len * cfg.head_dim * 2
            || stored.values.bytes().len() != bytes
        {
            return Err(ModelError::Gpu(format!(
                "stored KV of {bytes} bytes for {len} slots does not fit this model"
            )));
        }
        stored
            .positions
            .iter()
            .map(|&p| p.checked_add(shift).filter(|p| *p >= 0))
            .collect::<Option<_>>()
            .ok_or(ModelError::BadPosition {
                position: i64::from(shift),
            })
    }

    /// Makes the buffer of shift angles hold `bytes` (it only grows).
    fn ensure_shifts(&mut self, bytes: usize) -> Result<()> {
        if self
            .scratch
            .shifts
            .as_ref()
            .is_none_or(|b| b.bytes() < bytes)
        {
            self.scratch.shifts = None;
            self.scratch.shifts = Some(self.dev.alloc(bytes.max(8)).map_err(gpu)?);
        }
        Ok(())
    }

    /// Makes the staging buffers of stored keys and values hold `bytes` each (they only grow).
    fn ensure_stage(&mut self, bytes: usize) -> Result<()> {
        if self
            .scratch
            .stage
            .as_ref()
            .is_none_or(|(k, _)| k.bytes() < bytes)
        {
            self.scratch.stage = None;
            let k = self.dev.alloc(bytes.max(2)).map_err(gpu)?;
            let v = self.dev.alloc(bytes.max(2)).map_err(gpu)?;
            self.scratch.stage = Some((k, v));
        }
        Ok(())
    }

    /// Makes the activation buffers hold `n` rows and the attention partials `partial` bytes
    /// (they only grow).
    fn ensure_scratch(&mut self, n: usize, partial: usize) -> Result<()> {
        if self
            .scratch
            .partial
            .as_ref()
            .is_none_or(|p| p.bytes() < partial)
        {
            self.scratch.partial = None;
            self.scratch.partial = Some(self.dev.alloc(partial.max(4)).map_err(gpu)?);
            self.scratch.generation += 1;
        }
        if n <= self.scratch.rows {
            return Ok(());
        }
        let cfg = self.model.config();
        let rows = n.max(self.scratch.rows).max(MAX_GEMV_BATCH);
        let (d, qw, kvw, ff) = (cfg.n_embd, cfg.q_width(), cfg.kv_width(), cfg.n_ff);
        let widest = d.max(qw).max(ff);
        let f32s = [
            rows * d,
            rows * d,
            rows * qw,
            rows * kvw,
            rows * kvw,
            rows * qw,
            rows * d,
            rows * ff,
            rows * ff,
            rows * self.model.rope.pairs() * 2,
            rows,
            rows,
            rows * widest / 2,
            rows,
        ];
        // Free the old buffers before allocating the larger ones.
        self.scratch.generation += 1;
        self.scratch.bufs.clear();
        self.scratch.w16 = None;
        self.scratch.logits = None;
        self.scratch.q8 = None;
        for len in f32s {
            self.scratch
                .bufs
                .push(self.dev.alloc(len.max(1) * 4).map_err(gpu)?);
        }
        // cuBLAS prefill dequantises each matrix into one f16 scratch: the largest matrix.
        let largest = self
            .layers
            .iter()
            .flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down])
            .chain(self.output.as_ref().map(|(_, h)| h))
            .map(|m| m.rows * m.cols)
            .max()
            .unwrap_or(0);
        self.scratch.w16 = if rows > MAX_GEMV_BATCH {
            Some(self.dev.alloc(largest.max(1) * 2).map_err(gpu)?)
        } else {
            None
        };
        self.scratch.q8 = Some(
            self.dev
                .alloc(Device::q8_scratch(MAX_GEMV_BATCH, widest))
                .map_err(gpu)?,
        );
        self.scratch.logits = Some(self.dev.alloc(rows * cfg.vocab_size * 4).map_err(gpu)?);
        self.scratch.rows = rows;
        Ok(())
    }
}

fn upload_matrix(dev: &Device, model: &Model, w: &Matrix) -> Result<DeviceMatrix> {
    let ty = w.info.ty;
    if !engram_kernels_cuda::supports(ty) {
        return Err(gpu_unsupported(&format!(
            "tensor `{}` of type {}",
            w.info.name,
            ty.name()
        )));
    }
    let data = model.weights.file.tensor_data(&w.info);
    Ok(DeviceMatrix {
        buf: dev.upload(data).map_err(gpu)?,
        ty,
        rows: w.rows,
        cols: w.cols,
    })
}

/// An error unless the first `overwrite.len()` tokens name slots of `kv` holding their
/// positions (fused prefill's recompute).
fn check_overwrite(
    kv: &GpuCache,
    tokens: &[u32],
    positions: &[i32],
    overwrite: &[usize],
) -> Result<()> {
    if overwrite.len() > tokens.len() {
        return Err(ModelError::OverwriteCount {
            overwrite: overwrite.len(),
            tokens: tokens.len(),
        });
    }
    for (i, &slot) in overwrite.iter().enumerate() {
        if kv.positions.get(slot) != positions.get(i) {
            return Err(ModelError::OverwriteSlot {
                index: i,
                slot,
                position: positions.get(i).copied().unwrap_or(-1),
            });
        }
    }
    Ok(())
}

fn upload_opt(dev: &Device, v: &Option<Vec<f32>>) -> Result<Option<Buffer>> {
    v.as_ref().map(|v| dev.upload(v).map_err(gpu)).transpose()
}

/// Whether the GPU's logits `got` agree with the CPU's `want` as rounding allows and a broken
/// kernel or a misplaced cache would not: each side's top token among the other's top 3, and
/// their top 5s sharing at least 3 tokens.
pub fn same_top(got: &[f32], want: &[f32]) -> bool {
    let (mine, theirs) = (top_ids(got, 5), top_ids(want, 5));
    let shared = mine.iter().filter(|i| theirs.contains(i)).count();
    theirs[..3].contains(&mine[0]) && mine[..3].contains(&theirs[0]) && shared >= 3
}

/// The indices of the `k` largest values, largest first.
fn top_ids(v: &[f32], k: usize) -> Vec<usize> {
    crate::top_k(v, k)
        .into_iter()
        .map(|(i, _)| i as usize)
        .collect()
}

fn gpu(e: engram_kernels_cuda::CudaError) -> ModelError {
    ModelError::Gpu(e.to_string())
}

fn gpu_unsupported(what: &str) -> ModelError {
    ModelError::Gpu(format!("not supported on the GPU: {what}"))
}
