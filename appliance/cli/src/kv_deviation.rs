//! `engram eval fusion --kv-deviation`: where a fused prompt's placed chunk KV differs from
//! full prefill's, layer by layer, and whether the difference is coherent enough to correct.
//!
//! Issue 19 asks whether the frame's bias is coherent across a chunk's stored tokens. If the
//! deviation `d_t = placed_t - full_t` of a chunk's tokens were mostly one offset per (chunk,
//! layer, head), the boundary tokens that `boundary:N` recomputes anyway would estimate it, and
//! adding it to the rest of the chunk would cost nothing. Per layer, over every chunk but the
//! first (whose stored KV is exact when the prompt's prefix is the frame) and every KV head:
//!
//! - `rel`: `sum |d|^2 / sum |full|^2`, the size of the error;
//! - `coherent`: the share of `sum |d|^2` that each (chunk, head)'s mean deviation explains
//!   (an oracle: the mean of the very tokens it corrects);
//! - `boundary`: the residual `sum |d_t - m|^2 / sum |d_t|^2` over tokens `t >= N` when `m` is
//!   the mean deviation of the chunk's first `N` tokens (what boundary recompute would give;
//!   below 1 helps, above 1 hurts);
//! - the error by position in the chunk (`rel` of tokens 0-3, 4-15, 16-63, 64 on).
//!
//! Keys are compared before RoPE (both caches' keys rotated back by their position), so a
//! common offset is not hidden by each position's rotation.

use engram_fusion::FusedPrompt;
use engram_model::{KvCache, Rope};

/// Tokens at the start of a chunk whose mean deviation is the `boundary` estimate.
const BOUNDARY: usize = 4;

/// Upper bounds of the position buckets in a chunk (the last is open).
const BUCKETS: [usize; 3] = [4, 16, 64];

/// Sums of one layer's keys or values over every compared (chunk, head).
#[derive(Clone, Default)]
struct Sums {
    dev: f64,
    reference: f64,
    coherent: f64,
    /// Over tokens at or past [`BOUNDARY`]: `|d - m|^2` and `|d|^2`.
    boundary_resid: f64,
    boundary_dev: f64,
    bucket_dev: [f64; 4],
    bucket_ref: [f64; 4],
}

impl Sums {
    /// Adds one (chunk, head): `dev[t]` and `reference[t]` for the chunk's tokens.
    fn add(&mut self, dev: &[Vec<f32>], reference: &[Vec<f32>]) {
        let n = dev.len();
        let hd = dev.first().map_or(0, Vec::len);
        let mut mean = vec![0.0f64; hd];
        let mut head = vec![0.0f64; hd];
        for (t, d) in dev.iter().enumerate() {
            for (i, &x) in d.iter().enumerate() {
                mean[i] += f64::from(x) / n as f64;
                if t < BOUNDARY {
                    head[i] += f64::from(x) / BOUNDARY.min(n) as f64;
                }
            }
        }
        for (t, (d, r)) in dev.iter().zip(reference).enumerate() {
            let dd: f64 = d.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            let rr: f64 = r.iter().map(|&x| f64::from(x) * f64::from(x)).sum();
            self.dev += dd;
            self.reference += rr;
            let b = BUCKETS.iter().position(|&e| t < e).unwrap_or(BUCKETS.len());
            self.bucket_dev[b] += dd;
            self.bucket_ref[b] += rr;
            if t >= BOUNDARY {
                self.boundary_dev += dd;
                self.boundary_resid += d
                    .iter()
                    .zip(&head)
                    .map(|(&x, &m)| (f64::from(x) - m).powi(2))
                    .sum::<f64>();
            }
        }
        self.coherent += n as f64 * mean.iter().map(|m| m * m).sum::<f64>();
    }

    /// Adds another layer's sums (every layer together).
    fn merge(&mut self, o: &Sums) {
        self.dev += o.dev;
        self.reference += o.reference;
        self.coherent += o.coherent;
        self.boundary_resid += o.boundary_resid;
        self.boundary_dev += o.boundary_dev;
        for b in 0..4 {
            self.bucket_dev[b] += o.bucket_dev[b];
            self.bucket_ref[b] += o.bucket_ref[b];
        }
    }

    fn json(&self) -> serde_json::Value {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        serde_json::json!({
            "rel": ratio(self.dev, self.reference),
            "coherent": ratio(self.coherent, self.dev),
            "boundary": ratio(self.boundary_resid, self.boundary_dev),
            "rel_by_position": (0..4)
                .map(|b| ratio(self.bucket_dev[b], self.bucket_ref[b]))
                .collect::<Vec<_>>(),
        })
    }
}

/// Per layer: keys and values.
#[derive(Default)]
pub(crate) struct Deviation {
    keys: Vec<Sums>,
    values: Vec<Sums>,
    chunks: usize,
}

impl Deviation {
    /// Compares the chunk tokens of `placed` (a fused prefill) with `full` (full prefill of the
    /// same prompt, slot for slot).
    pub(crate) fn add(
        &mut self,
        rope: &Rope,
        prompt: &FusedPrompt,
        full: &KvCache,
        placed: &KvCache,
    ) {
        let (layers, heads, hd) = full.shape();
        if self.keys.is_empty() {
            self.keys = vec![Sums::default(); layers];
            self.values = vec![Sums::default(); layers];
        }
        let mut start = prompt.prefix.len();
        let mut spans = Vec::new();
        for c in &prompt.chunks {
            spans.push(start..start + c.len());
            start += c.len();
        }
        // The first chunk follows the prefix alone, as it was stored: not compared.
        let spans = &spans[1.min(spans.len())..];
        self.chunks += spans.len();
        let positions = full.positions();
        for l in 0..layers {
            for h in 0..heads {
                let (fv, pv) = (full.values(l, h, start), placed.values(l, h, start));
                for span in spans {
                    let mut kd = Vec::with_capacity(span.len());
                    let mut kr = Vec::with_capacity(span.len());
                    let mut vd = Vec::with_capacity(span.len());
                    let mut vr = Vec::with_capacity(span.len());
                    for s in span.clone() {
                        let mut a = full.key(l, h, s);
                        let mut b = placed.key(l, h, s);
                        rope.shift(&mut a, -positions[s]);
                        rope.shift(&mut b, -positions[s]);
                        kd.push(b.iter().zip(&a).map(|(b, a)| b - a).collect());
                        kr.push(a);
                        let (a, b) = (&fv[s * hd..(s + 1) * hd], &pv[s * hd..(s + 1) * hd]);
                        vd.push(
                            b.iter()
                                .zip(a)
                                .map(|(b, a)| b.to_f32() - a.to_f32())
                                .collect(),
                        );
                        vr.push(a.iter().map(|x| x.to_f32()).collect());
                    }
                    self.keys[l].add(&kd, &kr);
                    self.values[l].add(&vd, &vr);
                }
            }
        }
    }

    /// Per layer, keys and values (see the module docs), and every layer together.
    pub(crate) fn json(&self) -> serde_json::Value {
        let total = |v: &[Sums]| {
            let mut t = Sums::default();
            for s in v {
                t.merge(s);
            }
            t.json()
        };
        serde_json::json!({
            "chunks_compared": self.chunks,
            "boundary_tokens": BOUNDARY,
            "all_layers": { "keys": total(&self.keys), "values": total(&self.values) },
            "layers": self.keys.iter().zip(&self.values)
                .map(|(k, v)| serde_json::json!({ "keys": k.json(), "values": v.json() }))
                .collect::<Vec<_>>(),
        })
    }
}
