//! Choosing the next token from logits: greedy, temperature, top-k, top-p, repetition penalty,
//! and OpenAI's presence and frequency penalties and logit bias.

use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::error::{ModelError, Result};

/// How to pick tokens. The defaults are greedy decoding.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax, ties to the lowest id, as llama.cpp).
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p`; 1 disables.
    pub top_p: f32,
    /// Divides positive (multiplies negative) logits of recently seen tokens; 1 disables.
    pub repetition_penalty: f32,
    /// How many recent tokens the repetition penalty looks at.
    pub repeat_last_n: usize,
    /// Seed of the random generator, so sampled runs are reproducible.
    pub seed: u64,
    /// OpenAI's `presence_penalty`, in [-2, 2]: subtracted once from the logit of every token
    /// this sampler has already produced; 0 disables.
    pub presence_penalty: f32,
    /// OpenAI's `frequency_penalty`, in [-2, 2]: subtracted from a token's logit once per time
    /// this sampler has produced it; 0 disables.
    pub frequency_penalty: f32,
    /// OpenAI's `logit_bias`: `(token id, bias in [-100, 100])` added to those logits before
    /// anything else (-100 bans a token, 100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl SamplingParams {
    /// Checks the ranges of every parameter.
    pub fn validate(&self) -> Result<()> {
        let bad = |name, value: f32, reason| {
            Err(ModelError::Sampling {
                name,
                value: value.to_string(),
                reason,
            })
        };
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return bad("temperature", self.temperature, "must be finite and >= 0");
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return bad("top_p", self.top_p, "must be in (0, 1]");
        }
        if !(self.repetition_penalty > 0.0 && self.repetition_penalty.is_finite()) {
            return bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be finite and > 0",
            );
        }
        for (name, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-MAX_PENALTY..=MAX_PENALTY).contains(&value) {
                return bad(name, value, "must be in [-2, 2]");
            }
        }
        if let Some(&(_, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-MAX_LOGIT_BIAS..=MAX_LOGIT_BIAS).contains(b))
        {
            return bad("logit_bias", b, "each bias must be in [-100, 100]");
        }
        Ok(())
    }

    /// Whether these parameters always pick the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0 || self.top_k == 1
    }
}

/// The largest presence or frequency penalty either way (OpenAI's range).
const MAX_PENALTY: f32 = 2.0;
/// The largest logit bias either way (OpenAI's range).
const MAX_LOGIT_BIAS: f32 = 100.0;

/// Picks tokens according to [`SamplingParams`], with its own seeded random generator.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    candidates: Vec<(u32, f32)>,
    /// How often each token has been picked, for the presence and frequency penalties (kept
    /// only when one of them is set).
    picked: HashMap<u32, u32>,
    /// The logits with the bias and penalties added (reused between calls).
    adjusted: Vec<f32>,
}

impl Sampler {
    /// A sampler; fails on out-of-range parameters.
    pub fn new(params: SamplingParams) -> Result<Sampler> {
        params.validate()?;
        Ok(Sampler {
            rng: StdRng::seed_from_u64(params.seed),
            params,
            candidates: Vec::new(),
            picked: HashMap::new(),
            adjusted: Vec::new(),
        })
    }

    /// Picks the next token from `logits`, given the tokens produced so far (`history`, for the
    /// repetition penalty; the presence and frequency penalties count the tokens this sampler
    /// picked, so a prompt's tokens are not penalised, as at OpenAI).
    pub fn sample(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let id = self.pick(logits, history);
        let p = &self.params;
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            *self.picked.entry(id).or_insert(0) += 1;
        }
        id
    }

    fn pick(&mut self, logits: &[f32], history: &[u32]) -> u32 {
        let p = &self.params;
        let logits = if p.logit_bias.is_empty() && self.picked.is_empty() {
            logits
        } else {
            let a = &mut self.adjusted;
            a.clear();
            a.extend_from_slice(logits);
            for &(id, b) in &p.logit_bias {
                if let Some(v) = a.get_mut(id as usize) {
                    *v += b;
                }
            }
            for (&id, &n) in &self.picked {
                if let Some(v) = a.get_mut(id as usize) {
                    *v -= p.presence_penalty + n as f32 * p.frequency_penalty;
                }
            }
            &self.adjusted[..]
        };
        let penalised;
        let logits = if p.repetition_penalty != 1.0 && !history.is_empty() {
            let mut l = logits.to_vec();
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen: Vec<u32> = history[start..].to_vec();
            seen.sort_unstable();
            seen.dedup();
            for id in seen {
                if let Some(v) = l.get_mut(id as usize) {
                    *v = if *v > 0.0 {
                        *v / p.repetition_penalty
                    } else {
                        *v * p.repetition_penalty
                    };
                }
            }
            penalised = l;
            &penalised[..]
        } else {
            logits
        };
        if p.is_greedy() {
            return argmax(logits);
        }

        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &l)| (i as u32, l)));
        // Highest logit first; ties to the lower id so results are stable.
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, by_logit);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(by_logit);
        let max = c[0].1;
        let mut total = 0.0f64;
        for (_, l) in c.iter_mut() {
            *l = ((*l - max) / p.temperature).exp();
            total += f64::from(*l);
        }
        if p.top_p < 1.0 {
            let mut acc = 0.0f64;
            let keep = c
                .iter()
                .position(|&(_, w)| {
                    acc += f64::from(w) / total;
                    acc >= f64::from(p.top_p)
                })
                .map_or(c.len(), |i| i + 1);
            c.truncate(keep);
            total = c.iter().map(|&(_, w)| f64::from(w)).sum();
        }
        let mut r = self.rng.gen::<f64>() * total;
        for &(id, w) in c.iter() {
            r -= f64::from(w);
            if r <= 0.0 {
                return id;
            }
        }
        c.last().expect("at least one candidate").0
    }
}

/// Index of the largest logit; ties go to the lowest id (llama.cpp's greedy rule).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

/// The `k` largest logits as `(id, logit)`, highest first (ties to the lower id). Selects
/// before it sorts, so a few from a whole vocabulary (every token of an answer with OpenAI's
/// `logprobs`) cost one pass, not a sort of the vocabulary.
pub fn top_k(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let mut all: Vec<(u32, f32)> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| (i as u32, l))
        .collect();
    let by = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let k = k.min(all.len());
    if k == 0 {
        return Vec::new();
    }
    all.select_nth_unstable_by(k - 1, by);
    all.truncate(k);
    all.sort_unstable_by(by);
    all
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampler(p: SamplingParams) -> Sampler {
        Sampler::new(p).unwrap()
    }

    #[test]
    fn greedy_is_argmax_with_low_id_ties() {
        let mut s = sampler(SamplingParams::default());
        assert_eq!(s.sample(&[0.0, 3.0, 3.0, 1.0], &[]), 1);
        assert_eq!(argmax(&[5.0, 5.0]), 0);
    }

    #[test]
    fn repetition_penalty_changes_the_choice() {
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = sampler(p);
        // Token 0 (logit 4) was just produced: 4 / 2 = 2 < 3.
        assert_eq!(s.sample(&[4.0, 3.0, -1.0], &[0]), 1);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.1, 2.0, 1.9, -3.0];
        for p in [
            SamplingParams {
                temperature: 1.0,
                top_k: 1,
                ..Default::default()
            },
            SamplingParams {
                temperature: 1.0,
                top_p: 1e-6,
                ..Default::default()
            },
        ] {
            let mut s = sampler(p);
            for _ in 0..20 {
                assert_eq!(s.sample(&logits, &[]), 1);
            }
        }
    }

    #[test]
    fn sampling_is_seeded_and_follows_the_distribution() {
        let logits = [0.0f32, (3.0f32).ln()]; // probabilities 1/4 and 3/4
        let p = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let draw = |p: SamplingParams| {
            let mut s = sampler(p);
            (0..4000)
                .map(|_| s.sample(&logits, &[]))
                .collect::<Vec<_>>()
        };
        let a = draw(p.clone());
        assert_eq!(a, draw(p.clone()), "same seed, same tokens");
        let ones = a.iter().filter(|&&t| t == 1).count() as f64 / a.len() as f64;
        assert!((ones - 0.75).abs() < 0.03, "{ones}");
        assert_ne!(a, draw(SamplingParams { seed: 8, ..p }));
    }

    #[test]
    fn top_k_limits_the_support() {
        let logits = [1.0, 1.0, 1.0, 5.0, 4.0];
        let mut s = sampler(SamplingParams {
            temperature: 5.0,
            top_k: 2,
            ..Default::default()
        });
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits, &[]), 3 | 4));
        }
    }

    /// OpenAI's rule: the logit of a token picked `n` times loses `presence + n * frequency`;
    /// tokens of the history this sampler did not pick (the prompt) are not penalised.
    #[test]
    fn presence_and_frequency_penalties_count_the_picked_tokens() {
        let logits = [3.0, 2.5, 1.0];
        let mut s = sampler(SamplingParams {
            presence_penalty: 0.4,
            ..Default::default()
        });
        // The prompt holds token 0: no penalty yet.
        assert_eq!(s.sample(&logits, &[0, 0, 0]), 0);
        // Picked once: 3.0 - 0.4 = 2.6 still beats 2.5, and stays so (presence counts once).
        assert_eq!(s.sample(&logits, &[0]), 0);
        assert_eq!(s.sample(&logits, &[0, 0]), 0);

        let mut s = sampler(SamplingParams {
            frequency_penalty: 0.2,
            ..Default::default()
        });
        // 3.0, then 2.8, 2.6 (ties go to the lower id, 2.5 loses) and 2.4 < 2.5.
        let picked: Vec<u32> = (0..5).map(|_| s.sample(&logits, &[])).collect();
        assert_eq!(picked, [0, 0, 0, 1, 0]);

        // A negative penalty encourages repeats.
        let mut s = sampler(SamplingParams {
            frequency_penalty: -1.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[2.0, 2.5], &[]), 1);
        assert_eq!(s.sample(&[3.0, 2.5], &[]), 1);
    }

    #[test]
    fn top_k_is_the_largest_first_with_ties_to_the_lower_id() {
        let logits = [1.0, 4.0, 2.0, 4.0, -1.0, 3.0];
        assert_eq!(top_k(&logits, 3), [(1, 4.0), (3, 4.0), (5, 3.0)]);
        assert_eq!(top_k(&logits, 1), [(1, 4.0)]);
        assert_eq!(top_k(&logits, 0), []);
        let all = top_k(&logits, 10);
        assert_eq!(all.len(), 6);
        assert_eq!(all.last(), Some(&(4, -1.0)));
    }

    #[test]
    fn logit_bias_bans_and_forces_tokens() {
        let logits = [5.0, 1.0, -2.0];
        let mut ban = sampler(SamplingParams {
            logit_bias: vec![(0, -100.0)],
            ..Default::default()
        });
        assert_eq!(ban.sample(&logits, &[]), 1);
        let mut force = sampler(SamplingParams {
            temperature: 1.0,
            logit_bias: vec![(2, 100.0)],
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(force.sample(&logits, &[]), 2);
        }
        // An id beyond the logits changes nothing.
        let mut out = sampler(SamplingParams {
            logit_bias: vec![(7, 100.0)],
            ..Default::default()
        });
        assert_eq!(out.sample(&logits, &[]), 0);
    }

    #[test]
    fn bad_parameters_are_refused() {
        for p in [
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            SamplingParams {
                repetition_penalty: 0.0,
                ..Default::default()
            },
            SamplingParams {
                presence_penalty: 2.5,
                ..Default::default()
            },
            SamplingParams {
                frequency_penalty: f32::NAN,
                ..Default::default()
            },
            SamplingParams {
                logit_bias: vec![(3, -101.0)],
                ..Default::default()
            },
        ] {
            assert!(Sampler::new(p).is_err());
        }
    }
}
