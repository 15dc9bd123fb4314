//! The KV cache: keys (after RoPE) and values of every layer, stored as f16, passed into
//! `forward` rather than owned by the model.

use half::f16;
use half::slice::HalfFloatSliceExt;

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

    /// Dot products of `queries` (`[nq][head_dim]`, already rotated) with the keys of slots
    /// `0..len` of one KV head and layer: `out[i * len + s] = queries[i] . key(s)`. For callers
    /// that need attention weights outside the attention kernel (a fused prefill choosing the
    /// stored tokens a question attends to); each key tile is widened to f32 once for all
    /// queries.
    pub fn key_dots(
        &self,
        layer: usize,
        head: usize,
        len: usize,
        queries: &[f32],
        out: &mut [f32],
    ) {
        let hd = self.head_dim;
        let nq = queries.len() / hd;
        assert!(
            out.len() >= nq * len,
            "key_dots: out holds {} of {} scores",
            out.len(),
            nq * len
        );
        let keys = self.keys(layer, head, len);
        // Slots per accumulator block: 16 f32 for each of two queries stay in registers while
        // the tile's rows (`[head_dim][KV_TILE]`) stream past.
        const B: usize = 16;
        let mut tile = vec![0.0f32; hd * KV_TILE];
        for (ti, k) in keys.chunks_exact(hd * KV_TILE).enumerate() {
            k.convert_to_f32_slice(&mut tile);
            let first = ti * KV_TILE;
            for b in (0..KV_TILE.min(len - first)).step_by(B) {
                let n = B.min(len - first - b);
                let mut qi = 0;
                while qi < nq {
                    let q0 = &queries[qi * hd..(qi + 1) * hd];
                    let q1 = &queries[(qi + 1).min(nq - 1) * hd..][..hd];
                    let (mut a0, mut a1) = ([0.0f32; B], [0.0f32; B]);
                    for d in 0..hd {
                        let row: &[f32; B] = tile[d * KV_TILE + b..][..B].try_into().expect("B");
                        for j in 0..B {
                            a0[j] += q0[d] * row[j];
                            a1[j] += q1[d] * row[j];
                        }
                    }
                    let at = qi * len + first + b;
                    out[at..at + n].copy_from_slice(&a0[..n]);
                    if qi + 1 < nq {
                        let at = (qi + 1) * len + first + b;
                        out[at..at + n].copy_from_slice(&a1[..n]);
                    }
                    qi += 2;
                }
            }
        }
    }

    /// Values of one KV head in one layer, for the first `len` slots.
    pub fn values(&self, layer: usize, head: usize, len: usize) -> &[f16] {
        let at = head * self.stride * self.head_dim;
        &self.v[layer][at..at + len * self.head_dim]
    }

    /// Keys of one KV head in one layer for the first `len` slots, untiled: `[len][head_dim]`
    /// (the layout a GPU cache holds).
    pub fn key_rows(&self, layer: usize, head: usize, len: usize) -> Vec<f16> {
        let hd = self.head_dim;
        let keys = &self.k[layer][head * self.stride * hd..];
        let mut out = Vec::with_capacity(len.min(self.len) * hd);
        for slot in 0..len.min(self.len) {
            out.extend((0..hd).map(|d| keys[key_tile_index(slot, d, hd)]));
        }
        out
    }

    /// Appends slots whose keys are already rotated to `positions` (a GPU cache read back):
    /// `k(layer, head)` and `v(layer, head)` give the tokens' `[n][head_dim]` keys and values,
    /// `n = positions.len()`, as [`KvCache::key_rows`] and [`KvCache::values`] return them.
    /// Returns the first new slot.
    pub fn append_rows(
        &mut self,
        positions: &[i32],
        k: impl Fn(usize, usize) -> Vec<f16>,
        v: impl Fn(usize, usize) -> Vec<f16>,
    ) -> Result<usize> {
        let (n, hd) = (positions.len(), self.head_dim);
        let mut rows = Vec::with_capacity(self.n_layer * self.n_head_kv);
        for layer in 0..self.n_layer {
            for head in 0..self.n_head_kv {
                let (ks, vs) = (k(layer, head), v(layer, head));
                if ks.len() != n * hd || vs.len() != n * hd {
                    return Err(ModelError::StoredLayout {
                        found: format!(
                            "layer {layer} head {head}: {} keys, {} values",
                            ks.len(),
                            vs.len()
                        ),
                        expected: format!("{n} tokens x {hd} dims"),
                    });
                }
                rows.push((ks, vs));
            }
        }
        let first = self.append_slots(positions)?;
        for (i, (ks, vs)) in rows.iter().enumerate() {
            let (layer, head) = (i / self.n_head_kv, i % self.n_head_kv);
            let base = head * self.stride * hd;
            for t in 0..n {
                for d in 0..hd {
                    self.k[layer][base + key_tile_index(first + t, d, hd)] = ks[t * hd + d];
                }
            }
            let at = base + first * hd;
            self.v[layer][at..at + n * hd].copy_from_slice(vs);
        }
        Ok(first)
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
            // A tile's worth of keys at a time: converted to f32 and back in one slice call
            // each (F16C where the CPU has it), rotated token by token, then scattered into
            // the tile's `[head_dim][KV_TILE]` rows.
            let mut key = vec![0.0f32; KV_TILE * hd];
            let mut rotated = vec![f16::ZERO; KV_TILE * hd];
            for head in 0..heads {
                let base = head * stride * hd;
                let (ks, vs) = (k(layer, head), v(layer, head));
                let keys = &mut kl[base..base + stride * hd];
                let mut t = 0;
                while t < n {
                    // The tokens from `t` to the end of slot `first + t`'s tile.
                    let m = (KV_TILE - (first + t) % KV_TILE).min(n - t);
                    let (key, rotated) = (&mut key[..m * hd], &mut rotated[..m * hd]);
                    ks[t * hd..(t + m) * hd].convert_to_f32_slice(key);
                    for (i, x) in key.chunks_exact_mut(hd).enumerate() {
                        rope.rotate(x, &angles[(t + i) * pairs..(t + i + 1) * pairs]);
                    }
                    rotated.convert_from_f32_slice(key);
                    let tile = key_tile_index(first + t, 0, hd);
                    for d in 0..hd {
                        let row = &mut keys[tile + d * KV_TILE..][..m];
                        for (i, dst) in row.iter_mut().enumerate() {
                            *dst = rotated[i * hd + d];
                        }
                    }
                    t += m;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Architecture, RopeScaling, RopeStyle};

    fn cfg(head_dim: usize) -> ModelConfig {
        ModelConfig {
            arch: Architecture::Llama,
            n_layer: 2,
            n_embd: 2 * head_dim,
            n_ff: 8,
            n_head: 2,
            n_head_kv: 2,
            head_dim,
            head_dim_v: head_dim,
            vocab_size: 4,
            context_length: 512,
            rms_eps: 1e-5,
            rope_base: 10_000.0,
            rope_dims: head_dim,
            rope_style: RopeStyle::NeoX,
            rope_scaling: RopeScaling::None,
            moe: None,
        }
    }

    /// Rows read out with `key_rows`/`values` and appended with `append_rows` (a GPU cache's
    /// round trip) give the same cache, also when appended after slots already there.
    #[test]
    fn rows_round_trip_through_append_rows() {
        let hd = 16;
        let c = cfg(hd);
        let kvw = c.n_head_kv * hd;
        for len in [1, 15, 17, 40] {
            let mut kv = KvCache::new(&c, len);
            let positions: Vec<i32> = (0..len as i32).map(|p| p * 3 + 1).collect();
            kv.append_slots(&positions).expect("slots");
            for s in 0..len {
                let k: Vec<f32> = (0..kvw)
                    .map(|i| ((s * 13 + i * 5) % 19) as f32 / 9.0)
                    .collect();
                let v: Vec<f32> = (0..kvw).map(|i| ((s * 7 + i) % 11) as f32 - 5.0).collect();
                kv.write(0, s, &k, &v);
                kv.write(1, s, &v, &k);
            }
            let mut back = KvCache::new(&c, len + 5);
            back.append_slots(&[100, 101, 102]).expect("slots");
            let first = back
                .append_rows(
                    &positions,
                    |l, h| kv.key_rows(l, h, len),
                    |l, h| kv.values(l, h, len).to_vec(),
                )
                .expect("rows");
            assert_eq!(first, 3);
            assert_eq!(&back.positions()[3..], kv.positions());
            for l in 0..2 {
                for h in 0..c.n_head_kv {
                    for s in 0..len {
                        assert_eq!(back.key(l, h, first + s), kv.key(l, h, s), "len {len}");
                    }
                    assert_eq!(
                        &back.values(l, h, first + len)[first * hd..],
                        kv.values(l, h, len)
                    );
                }
            }
            // A wrong row count is refused, nothing appended.
            let before = back.len();
            let e = back.append_rows(
                &positions,
                |_, _| Vec::new(),
                |l, h| kv.values(l, h, len).to_vec(),
            );
            assert!(matches!(e, Err(ModelError::StoredLayout { .. })), "{e:?}");
            assert_eq!(back.len(), before);
        }
    }

    /// `key_dots` equals the plain dot products with `key`, for lengths that end inside a key
    /// tile and inside an accumulator block, and an odd number of queries.
    #[test]
    fn key_dots_are_the_dot_products_with_every_key() {
        let hd = 16;
        let c = cfg(hd);
        let kvw = c.n_head_kv * hd;
        for len in [1, 15, 17, 64, 100, 150] {
            let mut kv = KvCache::new(&c, len);
            let positions: Vec<i32> = (0..len as i32).collect();
            let first = kv.append_slots(&positions).expect("slots");
            for s in 0..len {
                let k: Vec<f32> = (0..kvw)
                    .map(|i| ((s * 31 + i * 7) % 23) as f32 / 11.0 - 1.0)
                    .collect();
                let v = vec![0.0; kvw];
                for layer in 0..c.n_layer {
                    kv.write(layer, first + s, &k, &v);
                }
            }
            let nq = 3;
            let q: Vec<f32> = (0..nq * hd)
                .map(|i| ((i * 13) % 17) as f32 / 8.0 - 1.0)
                .collect();
            for (layer, head) in [(0, 0), (1, 1)] {
                let mut out = vec![f32::NAN; nq * len];
                kv.key_dots(layer, head, len, &q, &mut out);
                for (qi, qv) in q.chunks_exact(hd).enumerate() {
                    for s in 0..len {
                        let want: f32 = kv
                            .key(layer, head, s)
                            .iter()
                            .zip(qv)
                            .map(|(a, b)| a * b)
                            .sum();
                        let got = out[qi * len + s];
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "len {len} q {qi} slot {s}: {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    /// `append_prerope` writes each key rotated to its position and rounded to f16 once, and
    /// each value as stored, wherever the new slots fall: starting inside a key tile, and
    /// spanning whole tiles and part of another.
    #[test]
    fn append_prerope_rotates_every_key_to_its_position() {
        let hd = 16;
        let c = cfg(hd);
        let rope = Rope::new(&c, None);
        let pool = ThreadPool::new(2).expect("pool");
        for (before, n) in [(0, 1), (0, 64), (37, 150), (63, 2), (64, 65)] {
            let mut kv = KvCache::new(&c, before + n);
            let earlier: Vec<i32> = (0..before as i32).collect();
            kv.append_slots(&earlier).expect("slots");
            let at = 500 - n as i32;
            let positions: Vec<i32> = (at..at + n as i32).collect();
            // [layer][head][token][dim], distinct per layer and head.
            let side = |salt: usize| -> Vec<f16> {
                (0..c.n_layer * c.n_head_kv * n * hd)
                    .map(|i| f16::from_f32(((i * 37 + salt) % 41) as f32 / 20.0 - 1.0))
                    .collect()
            };
            let (ks, vs) = (side(3), side(11));
            let head = |l: usize, h: usize| -> std::ops::Range<usize> {
                let at = (l * c.n_head_kv + h) * n * hd;
                at..at + n * hd
            };
            let first = kv
                .append_prerope(
                    &rope,
                    &positions,
                    |l, h| &ks[head(l, h)],
                    |l, h| &vs[head(l, h)],
                    &pool,
                )
                .expect("place");
            assert_eq!(first, before);
            for l in 0..c.n_layer {
                for h in 0..c.n_head_kv {
                    let (kh, vh) = (&ks[head(l, h)], &vs[head(l, h)]);
                    let values = kv.values(l, h, first + n);
                    for t in 0..n {
                        let mut want: Vec<f32> = kh[t * hd..(t + 1) * hd]
                            .iter()
                            .map(|x| x.to_f32())
                            .collect();
                        rope.rotate_at(&mut want, positions[t]);
                        let want: Vec<f32> =
                            want.iter().map(|&x| f16::from_f32(x).to_f32()).collect();
                        assert_eq!(
                            kv.key(l, h, first + t),
                            want,
                            "{before}+{n}: key {l}/{h}/{t}"
                        );
                        assert_eq!(
                            &values[(first + t) * hd..][..hd],
                            &vh[t * hd..(t + 1) * hd],
                            "value {l}/{h}/{t}"
                        );
                    }
                }
            }
        }
    }
}
