//! The KV cache: keys (after RoPE) and values of every layer, stored as f16, passed into
//! `forward` rather than owned by the model.

use half::f16;

use std::sync::Mutex;

use engram_kernels::{key_tile_index, ThreadPool, KV_TILE};

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};
use crate::ops::Rope;

/// Keys and values of one sequence, for every layer.
///
/// Layout per layer and KV head: values `[capacity][head_dim]`; keys in tiles of
/// [`KV_TILE`] slots, each tile transposed (`[tile][head_dim][KV_TILE]`), the layout the
/// attention kernel reads without converting or transposing per call. Each slot also records the absolute position its key was
/// rotated to; attention masks by position (a query at position `p` sees the slots at positions
/// `<= p`), which is what lets fusion place stored chunks at arbitrary positions and recompute
/// interior tokens under an exact causal mask.
#[derive(Clone)]
pub struct KvCache {
    n_layer: usize,
    n_head_kv: usize,
    head_dim: usize,
    capacity: usize,
    /// Slots allocated per head: `capacity` rounded up to whole key tiles.
    stride: usize,
    len: usize,
    positions: Vec<i32>,
    k: Vec<Vec<f16>>,
    v: Vec<Vec<f16>>,
}

impl KvCache {
    /// An empty cache with room for `capacity` tokens of the model described by `cfg`.
    pub fn new(cfg: &ModelConfig, capacity: usize) -> KvCache {
        // Storage in whole key tiles, so every head's tiles start at a tile boundary.
        let stride = capacity.div_ceil(KV_TILE) * KV_TILE;
        let per_layer = cfg.n_head_kv * stride * cfg.head_dim;
        KvCache {
            n_layer: cfg.n_layer,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            capacity,
            stride,
            len: 0,
            positions: Vec::with_capacity(capacity),
            k: (0..cfg.n_layer)
                .map(|_| vec![f16::ZERO; per_layer])
                .collect(),
            v: (0..cfg.n_layer)
                .map(|_| vec![f16::ZERO; per_layer])
                .collect(),
        }
    }

    /// Number of filled slots.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no slot is filled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Total number of slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Positions of the filled slots.
    pub fn positions(&self) -> &[i32] {
        &self.positions
    }

    /// The highest position cached, if any.
    pub fn max_position(&self) -> Option<i32> {
        self.positions.iter().copied().max()
    }

    /// Forgets every slot from `len` on (e.g. to roll back a speculative step).
    pub fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.positions.truncate(len);
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        self.truncate(0);
    }

    /// Checks that the cache was made for a model of this shape.
    pub fn check_layout(&self, cfg: &ModelConfig) -> Result<()> {
        if (self.n_layer, self.n_head_kv, self.head_dim)
            != (cfg.n_layer, cfg.n_head_kv, cfg.head_dim)
        {
            return Err(ModelError::CacheLayout {
                found: self.layout_string(),
                expected: format!(
                    "{} layers x {} KV heads x {} dims",
                    cfg.n_layer, cfg.n_head_kv, cfg.head_dim
                ),
            });
        }
        Ok(())
    }

    fn layout_string(&self) -> String {
        format!(
            "{} layers x {} KV heads x {} dims",
            self.n_layer, self.n_head_kv, self.head_dim
        )
    }

    /// Reserves `n` new slots at the given positions and returns the index of the first.
    pub(crate) fn append_slots(&mut self, positions: &[i32]) -> Result<usize> {
        if self.len + positions.len() > self.capacity {
            return Err(ModelError::CacheFull {
                used: self.len,
                capacity: self.capacity,
                requested: positions.len(),
            });
        }
        let first = self.len;
        self.positions.extend_from_slice(positions);
        self.len += positions.len();
        Ok(first)
    }

    /// Stores one token's keys and values (all KV heads, `n_head_kv * head_dim` values each) in
    /// `slot` of `layer`.
    pub fn write(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let hd = self.head_dim;
        for h in 0..self.n_head_kv {
            let base = h * self.stride * hd;
            let keys = &mut self.k[layer][base..base + self.stride * hd];
            for (d, &src) in k[h * hd..(h + 1) * hd].iter().enumerate() {
                keys[key_tile_index(slot, d, hd)] = f16::from_f32(src);
            }
            let at = base + slot * hd;
            for (dst, &src) in self.v[layer][at..at + hd].iter_mut().zip(&v[h * hd..]) {
                *dst = f16::from_f32(src);
            }
        }
    }

    /// Keys of one KV head in one layer, in the attention kernel's tiled layout, covering the
    /// first `len` slots (whole tiles).
    pub fn keys(&self, layer: usize, head: usize, len: usize) -> &[f16] {
        let at = head * self.stride * self.head_dim;
        &self.k[layer][at..at + len.div_ceil(KV_TILE) * KV_TILE * self.head_dim]
    }

    /// The key stored in `slot` of one KV head and layer, as f32 (for inspection and tests).
    pub fn key(&self, layer: usize, head: usize, slot: usize) -> Vec<f32> {
        let keys = self.keys(layer, head, slot + 1);
        (0..self.head_dim)
            .map(|d| keys[key_tile_index(slot, d, self.head_dim)].to_f32())
            .collect()
    }

    /// Values of one KV head in one layer, for the first `len` slots.
    pub fn values(&self, layer: usize, head: usize, len: usize) -> &[f16] {
        let at = head * self.stride * self.head_dim;
        &self.v[layer][at..at + len * self.head_dim]
    }

    /// Number of layers, KV heads and head width this cache was made for.
    pub fn shape(&self) -> (usize, usize, usize) {
        (self.n_layer, self.n_head_kv, self.head_dim)
    }

    /// Appends tokens whose keys were stored before RoPE, rotating each to its position here
    /// (chunk KV placed at its real positions in a fused prompt). `k(layer, head)` and
    /// `v(layer, head)` give the tokens' `[n][head_dim]` keys and values, `n =
    /// positions.len()`. Layers are placed in parallel on `pool`. Returns the first new slot.
    pub fn append_prerope<'a>(
        &mut self,
        rope: &Rope,
        positions: &[i32],
        k: impl Fn(usize, usize) -> &'a [f16] + Sync,
        v: impl Fn(usize, usize) -> &'a [f16] + Sync,
        pool: &ThreadPool,
    ) -> Result<usize> {
        let (n, hd) = (positions.len(), self.head_dim);
        for layer in 0..self.n_layer {
            for head in 0..self.n_head_kv {
                let (kl, vl) = (k(layer, head).len(), v(layer, head).len());
                if kl != n * hd || vl != n * hd {
                    return Err(ModelError::StoredLayout {
                        found: format!("layer {layer} head {head}: {kl} keys, {vl} values"),
                        expected: format!("{n} tokens x {hd} dims"),
                    });
                }
            }
        }
        let first = self.append_slots(positions)?;
        let pairs = rope.pairs();
        let mut angles = Vec::with_capacity(n * pairs);
        for &p in positions {
            rope.angles(p, &mut angles);
        }
        let (stride, heads) = (self.stride, self.n_head_kv);
        // One task per layer; each owns its layer's storage.
        let layers: Vec<Mutex<(&mut Vec<f16>, &mut Vec<f16>)>> = self
            .k
            .iter_mut()
            .zip(self.v.iter_mut())
            .map(Mutex::new)
            .collect();
        pool.run(layers.len(), |layer| {
            let mut guard = layers[layer].lock().unwrap_or_else(|e| e.into_inner());
            let (kl, vl) = &mut *guard;
            let mut key = vec![0.0f32; hd];
            for head in 0..heads {
                let base = head * stride * hd;
                let (ks, vs) = (k(layer, head), v(layer, head));
                let keys = &mut kl[base..base + stride * hd];
                for t in 0..n {
                    for (dst, src) in key.iter_mut().zip(&ks[t * hd..(t + 1) * hd]) {
                        *dst = src.to_f32();
                    }
                    rope.rotate(&mut key, &angles[t * pairs..(t + 1) * pairs]);
                    for (d, &x) in key.iter().enumerate() {
                        keys[key_tile_index(first + t, d, hd)] = f16::from_f32(x);
                    }
                }
                let at = base + first * hd;
                vl[at..at + n * hd].copy_from_slice(vs);
            }
        });
        Ok(first)
    }

    /// Appends copies of `src`'s slots `range` (keys, values and positions as they are): how a
    /// cached prefix is reused.
    pub fn append_from(&mut self, src: &KvCache, range: std::ops::Range<usize>) -> Result<usize> {
        if src.shape() != self.shape() {
            return Err(ModelError::CacheLayout {
                found: src.layout_string(),
                expected: self.layout_string(),
            });
        }
        let range = range.start..range.end.min(src.len);
        let first = self.append_slots(&src.positions[range.clone()])?;
        let hd = self.head_dim;
        for layer in 0..self.n_layer {
            for head in 0..self.n_head_kv {
                let (sb, db) = (head * src.stride * hd, head * self.stride * hd);
                for (i, slot) in range.clone().enumerate() {
                    for d in 0..hd {
                        self.k[layer][db + key_tile_index(first + i, d, hd)] =
                            src.k[layer][sb + key_tile_index(slot, d, hd)];
                    }
                }
                let n = range.len();
                self.v[layer][db + first * hd..db + (first + n) * hd]
                    .copy_from_slice(&src.v[layer][sb + range.start * hd..sb + range.end * hd]);
            }
        }
        Ok(first)
    }
}
