//! The fidelity gate: on a model's first load, a fused prefill of built-in text is compared
//! with full prefill; a model whose fused answers drift too far does not use fusion.

use std::path::Path;
use std::sync::Arc;

use engram_kvstore::{DramTier, KvDtype, KvStore};
use engram_model::{argmax, Logits, Model};
use engram_tokenizer::{ChatTemplate, Tokenizer};

use crate::chunks::ChunkStore;
use crate::error::Result;
use crate::fuse::fused_prefill;
use crate::policy::Policy;
use crate::prompt::{build_prompt, DEFAULT_LAYOUT, DEFAULT_SYSTEM};

/// Largest mean KL divergence (nats) of the next-token distribution, full vs fused, at the
/// last prompt position of the built-in prompts. The gate is a smoke test that tells working
/// fusion from broken fusion, not a quality bar (`engram eval fusion` measures quality): on the
/// default model the default policy gives 0.05-0.2 here (short passages make the answer's
/// first-token distribution sensitive), while broken fusion (keys at the wrong positions,
/// chunks computed in an unrelated frame) gives 1 and more.
pub const GATE_MAX_KL: f64 = 0.5;

/// Least share of greedy tokens (over [`GATE_TOKENS`] per prompt, counted up to the first
/// difference) that must match full prefill's. The default policy agrees on 0.5-1 of them here;
/// broken fusion diverges at the first token.
pub const GATE_MIN_AGREEMENT: f64 = 0.25;

/// Greedy tokens compared per prompt: enough to see a drifting answer, few enough to keep the
/// check to about a second on the default model.
pub const GATE_TOKENS: usize = 8;

/// Built-in passages and questions (public-domain style facts).
const PASSAGES: [&str; 3] = [
    "The Danube is Europe's second-longest river. It rises in the Black Forest in Germany and flows for about 2,850 kilometres through ten countries, including Austria, Hungary and Romania, before reaching the Black Sea.",
    "Marie Curie was a physicist and chemist who conducted pioneering research on radioactivity. She was the first woman to win a Nobel Prize and remains the only person to win Nobel Prizes in two different sciences, physics in 1903 and chemistry in 1911.",
    "The Great Wall of China is a series of fortifications built across northern China over many centuries. The best-known sections were built during the Ming dynasty, between the 14th and 17th centuries.",
];
const QUESTIONS: [&str; 3] = [
    "Into which sea does the Danube flow?",
    "In which year did Marie Curie win the Nobel Prize in chemistry?",
    "During which dynasty were the best-known sections of the Great Wall built?",
];

/// The outcome of the self-check.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GateReport {
    pub policy: String,
    pub passed: bool,
    /// Mean KL over the prompts.
    pub mean_kl: f64,
    /// Largest KL over the prompts.
    pub max_kl: f64,
    /// Share of greedy tokens equal to full prefill's.
    pub agreement: f64,
    /// Why fusion was disabled, when it was.
    pub reason: Option<String>,
}

/// The gate's thresholds.
#[derive(Debug, Clone, Copy)]
pub struct GateLimits {
    pub max_mean_kl: f64,
    pub min_agreement: f64,
}

impl Default for GateLimits {
    fn default() -> Self {
        GateLimits {
            max_mean_kl: GATE_MAX_KL,
            min_agreement: GATE_MIN_AGREEMENT,
        }
    }
}

impl GateLimits {
    /// Why measurements fail these limits, or `None` when they pass.
    pub fn verdict(&self, mean_kl: f64, agreement: f64) -> Option<String> {
        if mean_kl > self.max_mean_kl {
            Some(format!(
                "mean KL divergence from full prefill {mean_kl:.3} nats exceeds {}",
                self.max_mean_kl
            ))
        } else if agreement < self.min_agreement {
            Some(format!(
                "greedy agreement with full prefill {agreement:.2} is below {}",
                self.min_agreement
            ))
        } else {
            None
        }
    }
}

/// Runs the self-check for one model and policy.
pub struct FidelityGate;

impl FidelityGate {
    /// Compares `policy` with full prefill on the built-in prompts under the default limits.
    /// The chunks are computed in `frame` into a private DRAM store, so the check never
    /// touches the real tiers.
    pub fn check(
        model: &Model,
        tokenizer: &Tokenizer,
        template: Option<&ChatTemplate>,
        frame: Vec<u32>,
        policy: Policy,
    ) -> Result<GateReport> {
        Self::check_with(
            model,
            tokenizer,
            template,
            frame,
            policy,
            GateLimits::default(),
        )
    }

    /// [`FidelityGate::check`] under explicit limits.
    pub fn check_with(
        model: &Model,
        tokenizer: &Tokenizer,
        template: Option<&ChatTemplate>,
        frame: Vec<u32>,
        policy: Policy,
        limits: GateLimits,
    ) -> Result<GateReport> {
        let store = ChunkStore::new(
            Arc::new(KvStore::new(Some(DramTier::new(256 << 20)), None)),
            model,
            frame,
            KvDtype::F16,
        );
        let (mut max_kl, mut sum_kl, mut agree, mut total) = (0.0f64, 0.0f64, 0usize, 0usize);
        for (i, q) in QUESTIONS.iter().enumerate() {
            // Rotate the passage order so each question sees its passage in another slot.
            let mut order = PASSAGES;
            order.rotate_left(i);
            let prompt = build_prompt(
                DEFAULT_LAYOUT,
                tokenizer,
                template,
                DEFAULT_SYSTEM,
                &order,
                q,
                None,
            )?;
            let cap = prompt.len() + GATE_TOKENS + 1;
            let mut kv_full = model.new_cache(cap);
            let full = fused_prefill(model, &store, None, &prompt, Policy::Full, &mut kv_full)?;
            let mut kv_fused = model.new_cache(cap);
            let fused = fused_prefill(model, &store, None, &prompt, policy, &mut kv_fused)?;
            let kl = kl_divergence(&full.logits, &fused.logits);
            max_kl = max_kl.max(kl);
            sum_kl += kl;
            let a = greedy(
                model,
                &mut kv_full,
                full.logits,
                full.next_position,
                GATE_TOKENS,
            )?;
            let b = greedy(
                model,
                &mut kv_fused,
                fused.logits,
                fused.next_position,
                GATE_TOKENS,
            )?;
            agree += a.iter().zip(&b).take_while(|(x, y)| x == y).count();
            total += a.len();
        }
        let agreement = agree as f64 / total.max(1) as f64;
        let mean_kl = sum_kl / QUESTIONS.len() as f64;
        let reason = limits.verdict(mean_kl, agreement);
        Ok(GateReport {
            policy: policy.name(),
            passed: reason.is_none(),
            mean_kl,
            max_kl,
            agreement,
            reason,
        })
    }
}

/// Greedy continuation of `n` tokens from `logits` at `pos`.
pub fn greedy(
    model: &Model,
    kv: &mut engram_model::KvCache,
    mut logits: Vec<f32>,
    mut pos: i32,
    n: usize,
) -> Result<Vec<u32>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let id = argmax(&logits);
        out.push(id);
        if i + 1 < n {
            logits = model.forward(&[id], &[pos], kv, Logits::Last)?;
            pos += 1;
        }
    }
    Ok(out)
}

/// KL(p || q) in nats between the softmax distributions of two logit vectors.
pub fn kl_divergence(p_logits: &[f32], q_logits: &[f32]) -> f64 {
    let p = log_softmax(p_logits);
    let q = log_softmax(q_logits);
    p.iter()
        .zip(&q)
        .map(|(&lp, &lq)| lp.exp() * (lp - lq))
        .sum::<f64>()
        .max(0.0)
}

fn log_softmax(x: &[f32]) -> Vec<f64> {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = x.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln() + m;
    x.iter().map(|&v| v as f64 - lse).collect()
}

/// The fidelity gate's verdict for this model, frame and policy under `limits`. The
/// measurement runs once per model, frame and policy (about a second) and is recorded in `dir`
/// (`gate-<model>-<frame>-<policy>.json`); later starts read it back and apply the limits in
/// force.
pub fn recorded_gate(
    model: &Model,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    store: &ChunkStore,
    policy: Policy,
    limits: GateLimits,
    dir: &Path,
) -> Result<GateReport> {
    let fp: String = model
        .fingerprint()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let frame = xxhash_rust::xxh3::xxh3_64(
        &store
            .frame()
            .iter()
            .flat_map(|t| t.to_le_bytes())
            .collect::<Vec<u8>>(),
    );
    let path = dir.join(format!(
        "gate-{fp}-{frame:016x}-{}.json",
        policy.name().replace(':', "_")
    ));
    let recorded = std::fs::read(&path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
        .and_then(|v| {
            Some((
                v["mean_kl"].as_f64()?,
                v["max_kl"].as_f64()?,
                v["agreement"].as_f64()?,
            ))
        });
    let (mean_kl, max_kl, agreement) = match recorded {
        Some(m) => m,
        None => {
            let r =
                FidelityGate::check(model, tokenizer, template, store.frame().to_vec(), policy)?;
            // Best effort: without the record the check simply runs again next start.
            if std::fs::create_dir_all(dir).is_ok() {
                let tmp = path.with_extension("tmp");
                let json = serde_json::json!({
                    "policy": r.policy, "mean_kl": r.mean_kl, "max_kl": r.max_kl,
                    "agreement": r.agreement,
                });
                if std::fs::write(&tmp, json.to_string()).is_ok() {
                    let _ = std::fs::rename(&tmp, &path);
                }
            }
            (r.mean_kl, r.max_kl, r.agreement)
        }
    };
    let reason = limits.verdict(mean_kl, agreement);
    Ok(GateReport {
        policy: policy.name(),
        passed: reason.is_none(),
        mean_kl,
        max_kl,
        agreement,
        reason,
    })
}
