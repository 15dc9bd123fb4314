//! Element-wise building blocks of the transformer: RMSNorm, SiLU, softmax and rotary embedding.

use crate::config::{ModelConfig, RopeScaling, RopeStyle};

/// `out = x / rms(x) * weight`, one row of `weight.len()` values at a time.
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let n = weight.len();
    for (row, out_row) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum_sq: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (sum_sq / n as f64 + f64::from(eps)).sqrt()) as f32;
        for ((o, &v), &w) in out_row.iter_mut().zip(row).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// In-place RMSNorm of every `weight.len()`-wide slice of `x` (Qwen3's per-head Q/K norm).
pub fn rms_norm_in_place(x: &mut [f32], weight: &[f32], eps: f32) {
    let n = weight.len();
    for row in x.chunks_exact_mut(n) {
        let sum_sq: f64 = row.iter().map(|&v| f64::from(v) * f64::from(v)).sum();
        let scale = (1.0 / (sum_sq / n as f64 + f64::from(eps)).sqrt()) as f32;
        for (v, &w) in row.iter_mut().zip(weight) {
            *v = *v * scale * w;
        }
    }
}

/// Rotary position embedding for one model: frequencies, scaling and pairing.
#[derive(Debug, Clone)]
pub struct Rope {
    style: RopeStyle,
    head_dim: usize,
    /// Base angle per rotated pair, before any position scaling.
    inv_freq: Vec<f64>,
    /// Per pair: how much of the extrapolated (unscaled) angle YaRN keeps.
    yarn_mix: Vec<f64>,
    /// Position multiplier of the interpolated angle (1 / scaling factor).
    freq_scale: f64,
    /// Magnitude applied to cos and sin (YaRN's attention temperature).
    mscale: f32,
}

impl Rope {
    /// Builds the rotary tables for `cfg`; `freq_factors` are llama 3's per-pair divisors
    /// (`rope_freqs.weight`), when the model has them.
    pub fn new(cfg: &ModelConfig, freq_factors: Option<&[f32]>) -> Rope {
        let n_rot = cfg.rope_dims;
        let pairs = n_rot / 2;
        let base = f64::from(cfg.rope_base);
        let inv_freq: Vec<f64> = (0..pairs)
            .map(|i| {
                let f = base.powf(-2.0 * i as f64 / n_rot as f64);
                f / freq_factors.map_or(1.0, |ff| f64::from(ff[i]))
            })
            .collect();
        let (freq_scale, yarn_mix, mscale) = match cfg.rope_scaling {
            RopeScaling::None => (1.0, vec![0.0; pairs], 1.0),
            RopeScaling::Linear { factor } => (1.0 / f64::from(factor), vec![0.0; pairs], 1.0),
            RopeScaling::Yarn {
                factor,
                original_context,
                ext_factor,
                attn_factor,
                beta_fast,
                beta_slow,
            } => {
                let freq_scale = 1.0 / f64::from(factor);
                // The pair index at which a frequency completes `rotations` turns over the
                // original context (YaRN's correction range).
                let corr_dim = |rotations: f32| {
                    n_rot as f64
                        * (f64::from(original_context)
                            / (f64::from(rotations) * 2.0 * std::f64::consts::PI))
                            .ln()
                        / (2.0 * base.ln())
                };
                let low = corr_dim(beta_fast).floor().max(0.0);
                let high = corr_dim(beta_slow).ceil().min(n_rot as f64 - 1.0);
                let mix = (0..pairs)
                    .map(|i| {
                        let y = (i as f64 - low) / (high - low).max(0.001);
                        (1.0 - y.clamp(0.0, 1.0)) * f64::from(ext_factor)
                    })
                    .collect();
                let mut mscale = f64::from(attn_factor);
                if ext_factor != 0.0 {
                    mscale *= 1.0 + 0.1 * (1.0 / freq_scale).ln();
                }
                (freq_scale, mix, mscale as f32)
            }
        };
        Rope {
            style: cfg.rope_style,
            head_dim: cfg.head_dim,
            inv_freq,
            yarn_mix,
            freq_scale,
            mscale,
        }
    }

    /// Number of rotated pairs per head.
    pub fn pairs(&self) -> usize {
        self.inv_freq.len()
    }

    /// `(cos, sin)` of every pair at `pos`, appended to `out`.
    pub fn angles(&self, pos: i32, out: &mut Vec<(f32, f32)>) {
        let p = f64::from(pos);
        for (&f, &mix) in self.inv_freq.iter().zip(&self.yarn_mix) {
            let extrapolated = p * f;
            let interpolated = extrapolated * self.freq_scale;
            let theta = interpolated * (1.0 - mix) + extrapolated * mix;
            out.push((
                theta.cos() as f32 * self.mscale,
                theta.sin() as f32 * self.mscale,
            ));
        }
    }

    /// Rotates every head in `x` (heads of `head_dim` values) by the given angles.
    pub fn rotate(&self, x: &mut [f32], angles: &[(f32, f32)]) {
        let half = self.pairs();
        for head in x.chunks_exact_mut(self.head_dim) {
            for (i, &(c, s)) in angles.iter().enumerate() {
                let (a, b) = match self.style {
                    RopeStyle::Interleaved => (2 * i, 2 * i + 1),
                    RopeStyle::NeoX => (i, i + half),
                };
                let (x0, x1) = (head[a], head[b]);
                head[a] = x0 * c - x1 * s;
                head[b] = x0 * s + x1 * c;
            }
        }
    }

    /// Rotates `x` (one token's heads, not yet rotated) to position `pos`: what the forward pass
    /// does to a fresh key, including YaRN's magnitude scaling.
    pub fn rotate_at(&self, x: &mut [f32], pos: i32) {
        let mut angles = Vec::with_capacity(self.pairs());
        self.angles(pos, &mut angles);
        self.rotate(x, &angles);
    }

    /// Moves already-rotated heads by `delta` positions. Rotations compose, but YaRN's magnitude
    /// was applied when the key was first rotated, so the shift is a pure rotation.
    pub fn shift(&self, x: &mut [f32], delta: i32) {
        let angles = self.shift_angles(delta);
        self.rotate(x, &angles);
    }

    /// The `(cos, sin)` of every pair that [`Rope::shift`] rotates by.
    pub fn shift_angles(&self, delta: i32) -> Vec<(f32, f32)> {
        let mut angles = Vec::with_capacity(self.pairs());
        self.angles(delta, &mut angles);
        let inv = 1.0 / self.mscale;
        for (c, s) in &mut angles {
            *c *= inv;
            *s *= inv;
        }
        angles
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Architecture;

    fn cfg(style: RopeStyle, scaling: RopeScaling) -> ModelConfig {
        ModelConfig {
            arch: Architecture::Llama,
            n_layer: 1,
            n_embd: 8,
            n_ff: 8,
            n_head: 1,
            n_head_kv: 1,
            head_dim: 8,
            head_dim_v: 8,
            vocab_size: 4,
            context_length: 64,
            rms_eps: 1e-5,
            rope_base: 10_000.0,
            rope_dims: 8,
            rope_style: style,
            rope_scaling: scaling,
            moe: None,
        }
    }

    #[test]
    fn rotations_compose_and_preserve_norm() {
        for style in [RopeStyle::Interleaved, RopeStyle::NeoX] {
            let rope = Rope::new(&cfg(style, RopeScaling::None), None);
            let x: Vec<f32> = (0..8).map(|i| i as f32 * 0.3 - 1.0).collect();
            let mut a = x.clone();
            rope.rotate_at(&mut a, 7);
            let mut b = x.clone();
            rope.rotate_at(&mut b, 3);
            rope.rotate_at(&mut b, 4);
            for (u, v) in a.iter().zip(&b) {
                assert!((u - v).abs() < 1e-5, "{a:?} vs {b:?}");
            }
            let n = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>();
            assert!((n(&a) - n(&x)).abs() < 1e-4);
        }
    }

    #[test]
    fn linear_scaling_divides_positions() {
        let plain = Rope::new(&cfg(RopeStyle::Interleaved, RopeScaling::None), None);
        let lin = Rope::new(
            &cfg(RopeStyle::Interleaved, RopeScaling::Linear { factor: 4.0 }),
            None,
        );
        let x: Vec<f32> = (0..8).map(|i| (i as f32).sin()).collect();
        let (mut a, mut b) = (x.clone(), x.clone());
        plain.rotate_at(&mut a, 3);
        lin.rotate_at(&mut b, 12);
        for (u, v) in a.iter().zip(&b) {
            assert!((u - v).abs() < 1e-5);
        }
    }

    #[test]
    fn yarn_keeps_high_frequencies_and_interpolates_low_ones() {
        let rope = Rope::new(
            &cfg(
                RopeStyle::NeoX,
                RopeScaling::Yarn {
                    factor: 4.0,
                    original_context: 32,
                    ext_factor: 1.0,
                    attn_factor: 1.0,
                    beta_fast: 32.0,
                    beta_slow: 1.0,
                },
            ),
            None,
        );
        assert_eq!(rope.yarn_mix[0], 1.0);
        assert_eq!(*rope.yarn_mix.last().unwrap(), 0.0);
        assert!(rope.mscale > 1.0);

        // Shifting a rotated key equals rotating the raw key at the sum of the positions.
        let x: Vec<f32> = (0..8).map(|i| (i as f32 * 0.7).cos()).collect();
        let mut direct = x.clone();
        rope.rotate_at(&mut direct, 40);
        let mut shifted = x;
        rope.rotate_at(&mut shifted, 15);
        rope.shift(&mut shifted, 25);
        for (a, b) in direct.iter().zip(&shifted) {
            assert!((a - b).abs() < 1e-5, "{direct:?} vs {shifted:?}");
        }
    }

    #[test]
    fn rms_norm_scales_by_root_mean_square() {
        let mut out = vec![0.0; 2];
        rms_norm(&[3.0, 4.0], &[1.0, 2.0], 0.0, &mut out);
        let rms = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / rms).abs() < 1e-6 && (out[1] - 8.0 / rms).abs() < 1e-6);
    }
}
