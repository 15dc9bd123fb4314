//! `engram eval fusion`: fidelity and speed of each fusion policy against full prefill on
//! identical token ids, over a MuSiQue-shaped file (question, answers, ctxs[{title, text}]).
//!
//! Per question, each passage becomes one chunk whose KV is computed and stored in a
//! temporary tier (DRAM, or an NVMe directory read with O_DIRECT), then every policy prefills
//! the same prompt; `full` is the reference for first-token agreement, answer F1 and the KL
//! divergence at the last prompt position.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use engram_fusion::{
    bos_frame, fused_prefill, kl_divergence, rag_frame_for, rag_prefix_frame, ChunkStore,
    FuseStats, FusedPrompt, Layout, Policy, Prefilled, PrefixCache, DEFAULT_LAYOUT, DEFAULT_SYSTEM,
};
use engram_kernels::f16;
use engram_kvstore::{DramTier, IoMode, KvDtype, KvStore, NvmeOptions, NvmeTier};
use engram_model::{argmax, top_k, KvCache, Logits, Model};
use engram_rag::{rag_prompt_with, retain_distinct, OutputText};
use engram_tokenizer::Detokenizer;
use serde::Deserialize;

use crate::kv_deviation::Deviation;
use crate::ModelArgs;

/// Policies compared when `--policies` is not given.
const DEFAULT_POLICIES: &str = "full,reuse,boundary:16,deviation:0.15";

/// A first token is a near-tie in full prefill below this top-1 minus top-2 logit margin (the
/// line llama.cpp's reference outputs draw, as `engram gpu check` does): a fused cache can flip
/// it through rounding alone.
const DECISIVE_MARGIN: f64 = 0.3;

#[derive(Args)]
pub struct FusionArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// MuSiQue-shaped JSON: `[{"question", "answers": [..], "ctxs": [{"title", "text"}]}]`.
    #[arg(long)]
    data: PathBuf,
    /// Evaluate only the first N questions.
    #[arg(long)]
    limit: Option<usize>,
    /// Comma-separated policies; `full` is always run (it is the reference).
    #[arg(long, default_value = DEFAULT_POLICIES)]
    policies: String,
    /// Where the chunk KV is served from.
    #[arg(long, default_value = "dram", value_parser = ["dram", "nvme"])]
    tier: String,
    /// Directory of the NVMe tier [default: a temporary folder next to the data dir's temp].
    #[arg(long)]
    nvme_dir: Option<PathBuf>,
    /// Stored element type.
    #[arg(long, default_value = "f16", value_parser = ["f16", "int8", "int4"])]
    kv_dtype: String,
    /// Frame chunks are computed in: `context` (the layout's RAG prompt prefix and the neutral
    /// passages, the default), `prefix` (the default layout's prefix alone), `bos` (the model's
    /// BOS token) or `none`.
    #[arg(long, default_value = "context", value_parser = ["context", "prefix", "bos", "none"])]
    frame: String,
    /// Prompt layout (`engram eval qa --layouts` lists them): the default, `grounded`, opens
    /// the passages with the frame's neutral passages; `grounded-plain` is the same without
    /// them (the layout before 2026-11-26).
    #[arg(long, default_value = DEFAULT_LAYOUT.name)]
    layout: String,
    /// Greedy tokens generated per policy for answer F1.
    #[arg(long, default_value_t = 32)]
    answer_tokens: usize,
    /// Also compare each policy's placed chunk KV with full prefill's, layer by layer: the
    /// deviation's size, how coherent it is per (chunk, head), and how well the first chunk
    /// tokens' mean would correct it (`kv_deviation` in the JSON; see `kv_deviation.rs`).
    #[arg(long)]
    kv_deviation: bool,
    /// Passages of a question that make its prompt: `all`, as the data gives them, or
    /// `distinct`, as engramd assembles a prompt (a passage that mostly repeats one before it
    /// is left out, `engram_rag::retain_distinct`). Both policies and full prefill get the
    /// same prompt either way.
    #[arg(long, default_value = "all", value_parser = ["all", "distinct"])]
    passages: String,
    /// Leave out the `full~` row (full prefill with its chunk keys once through a stored
    /// chunk's rounding: the noise floor every policy is read against). It costs about one
    /// more full prefill per question.
    #[arg(long)]
    no_noise_floor: bool,
    /// Also time a prefix-cache hit (the row `prefix-hit`): the prefix and every chunk served
    /// from an exact cache of this very context, as a conventional prefix cache serves a repeated
    /// document set in the same order, and the question prefilled after it. The cache is
    /// filled before the clock starts (one more untimed prefill per question).
    #[arg(long)]
    prefix_hit: bool,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// The name of the noise floor's row in the report.
pub(crate) const FULL_ROUNDED: &str = "full~";

/// The name of the prefix-cache hit's row.
const PREFIX_HIT: &str = "prefix-hit";

/// A row of the report: a fusion policy, or full prefill's own noise floor.
#[derive(Clone, Copy, PartialEq)]
enum Row {
    Policy(Policy),
    /// `full~`: [`full_rounded`].
    FullRounded,
    /// `prefix-hit`: [`prefix_hit`].
    PrefixHit,
}

impl Row {
    fn name(&self) -> String {
        match self {
            Row::Policy(p) => p.name(),
            Row::FullRounded => FULL_ROUNDED.to_string(),
            Row::PrefixHit => PREFIX_HIT.to_string(),
        }
    }
}

#[derive(Deserialize)]
struct Example {
    question: String,
    answers: Vec<String>,
    ctxs: Vec<Ctx>,
}

#[derive(Deserialize)]
struct Ctx {
    #[serde(default)]
    title: String,
    text: String,
}

/// A passage as one chunk: its title on a line of its own, then its text (the text alone
/// when it has no title). `eval fusion-set` measures passages this way too.
pub(crate) fn passage_text(title: &str, text: &str) -> String {
    if title.is_empty() {
        text.to_string()
    } else {
        format!("{title}\n{text}")
    }
}

/// What `full` gave for a question: its first token, its answer's tokens with the logits each
/// was chosen from, and its answer.
type Reference = (u32, Vec<u32>, Vec<Vec<f32>>, String);

/// Accumulated results of one policy.
#[derive(Default)]
struct Tally {
    first_token_agree: usize,
    first_token_flags: Vec<bool>,
    /// Index in the data file of each question evaluated (skipped ones are absent).
    question: Vec<usize>,
    first_token: Vec<u32>,
    answer: Vec<String>,
    answer_f1: Vec<f64>,
    answer_em: Vec<f64>,
    tf_kl: Vec<f64>,
    kl: Vec<f64>,
    gold_f1: Vec<f64>,
    recompute_fraction: Vec<f64>,
    ttft_ms: Vec<f64>,
    kv_load_ms: Vec<f64>,
    recompute_ms: Vec<f64>,
    rank_ms: Vec<f64>,
    /// Each question's stage times (`FuseStats::timings_json`'s names), for their medians.
    stage_ms: BTreeMap<&'static str, Vec<f64>>,
    n: usize,
}

pub fn run(a: FusionArgs) -> Result<()> {
    let mut policies: Vec<Policy> = vec![Policy::Full];
    for p in a.policies.split(',').filter(|p| !p.trim().is_empty()) {
        let p: Policy = p.parse()?;
        if !policies.contains(&p) {
            policies.push(p);
        }
    }
    let text = std::fs::read_to_string(&a.data)
        .with_context(|| format!("reading {}", a.data.display()))?;
    let mut examples: Vec<Example> = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a list of question/answers/ctxs", a.data.display()))?;
    if let Some(n) = a.limit {
        examples.truncate(n);
    }
    if examples.is_empty() {
        bail!("{}: no questions", a.data.display());
    }
    let Some(layout) = Layout::named(&a.layout) else {
        bail!("unknown layout `{}`", a.layout);
    };
    let mut rows: Vec<Row> = policies.iter().map(|&p| Row::Policy(p)).collect();
    if !a.no_noise_floor {
        rows.insert(1, Row::FullRounded);
    }
    if a.prefix_hit {
        rows.push(Row::PrefixHit);
    }
    let loaded = a.model.load()?;
    let (model, tokenizer) = (&loaded.model, &loaded.tokenizer);
    let dtype = KvDtype::parse(&a.kv_dtype)?;
    let frame = match a.frame.as_str() {
        "context" => rag_frame_for(layout, tokenizer, loaded.template.as_ref())?,
        "prefix" => rag_prefix_frame(tokenizer, loaded.template.as_ref())?,
        "bos" => bos_frame(tokenizer.bos_id()),
        _ => Vec::new(),
    };

    let tmp_dir = a.nvme_dir.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!("engram-fusion-eval-{}", std::process::id()))
    });
    let store = match a.tier.as_str() {
        "dram" => KvStore::new(Some(DramTier::new(8 << 30)), None),
        _ => {
            let nvme = NvmeTier::open(
                &tmp_dir,
                NvmeOptions {
                    budget_bytes: 16 << 30,
                    io: IoMode::Auto,
                    direct: true,
                    reserve_free_bytes: 0,
                },
            )?;
            eprintln!(
                "NVMe tier at {} ({}, O_DIRECT)",
                tmp_dir.display(),
                nvme.io_mode()
            );
            KvStore::new(None, Some(nvme))
        }
    };
    let chunks = ChunkStore::new(Arc::new(store), model, frame, dtype);
    let prefixes = PrefixCache::new(256 << 20);

    let mut tallies: BTreeMap<String, Tally> = BTreeMap::new();
    let mut deviations: BTreeMap<String, Deviation> = BTreeMap::new();
    let mut skipped = 0usize;
    // Full prefill's top-1 minus top-2 first-token logit, per question.
    let mut full_margins: Vec<f64> = Vec::new();
    // Passages in each question's prompt (fewer than the data's with `--passages distinct`).
    let mut passages_kept: Vec<f64> = Vec::new();
    let mut prompt_tokens: Vec<f64> = Vec::new();
    let order: Vec<String> = rows.iter().map(Row::name).collect();
    for (qi, ex) in examples.iter().enumerate() {
        let mut texts: Vec<String> = ex
            .ctxs
            .iter()
            .map(|c| passage_text(&c.title, &c.text))
            .collect();
        if a.passages == "distinct" {
            retain_distinct(&mut texts, String::as_str);
        }
        let prompt = rag_prompt_with(
            layout,
            tokenizer,
            loaded.template.as_ref(),
            DEFAULT_SYSTEM,
            &texts,
            &ex.question,
            None,
        )?;
        if prompt.len() + a.answer_tokens + 1 > model.config().context_length {
            eprintln!(
                "[{}/{}] skipped: {} prompt tokens do not fit the context of {}",
                qi + 1,
                examples.len(),
                prompt.len(),
                model.config().context_length
            );
            skipped += 1;
            continue;
        }
        passages_kept.push(texts.len() as f64);
        prompt_tokens.push(prompt.len() as f64);
        // Ingestion: every chunk's KV computed and stored (not part of TTFT).
        for c in &prompt.chunks {
            chunks.ensure(model, c)?;
        }
        let mut kv = model.new_cache(prompt.len() + a.answer_tokens + 1);
        let mut reference: Option<Reference> = None;
        let mut full_kv: Option<engram_model::KvCache> = None;
        for &row in &rows {
            let done = match row {
                Row::Policy(policy) => {
                    fused_prefill(model, &chunks, Some(&prefixes), &prompt, policy, &mut kv)?
                }
                Row::FullRounded => full_rounded(model, &prompt, &mut kv)?,
                Row::PrefixHit => prefix_hit(model, &prompt, &mut kv)?,
            };
            if a.kv_deviation {
                match &full_kv {
                    None => {
                        let mut snap = model.new_cache(kv.len());
                        snap.append_from(&kv, 0..kv.len())?;
                        full_kv = Some(snap);
                    }
                    Some(full) => deviations.entry(row.name()).or_default().add(
                        model.rope(),
                        &prompt,
                        full,
                        &kv,
                    ),
                }
            }
            let base = kv.len();
            let first = argmax(&done.logits);
            let (ids, steps) = decode(
                &loaded,
                &mut kv,
                done.logits.clone(),
                done.next_position,
                a.answer_tokens,
                None,
            )?;
            let (answer, answer_len) = answer_of(&loaded, &ids, &ex.question);
            let t = tallies.entry(row.name()).or_default();
            let tf_kl = match &reference {
                None => 0.0,
                Some((_, ref_ids, ref_steps, _)) => {
                    // Teacher-forced: this policy's cache fed full's answer tokens.
                    kv.truncate(base);
                    let (_, forced) = decode(
                        &loaded,
                        &mut kv,
                        done.logits.clone(),
                        done.next_position,
                        ref_ids.len(),
                        Some(ref_ids),
                    )?;
                    mean(
                        &ref_steps
                            .iter()
                            .zip(&forced)
                            .map(|(r, f)| kl_divergence(r, f))
                            .collect::<Vec<_>>(),
                    )
                }
            };
            if reference.is_none() {
                full_margins.push(top2_margin(&done.logits));
            }
            let (ref_first, _, ref_steps, ref_answer) = reference.get_or_insert_with(|| {
                // The answer's tokens (at least the first, even when it ends the answer).
                let n = answer_len.max(1).min(steps.len());
                let forced: Vec<u32> = if ids.is_empty() {
                    vec![first]
                } else {
                    ids[..n].to_vec()
                };
                (first, forced, steps[..n.max(1)].to_vec(), answer.clone())
            });
            t.n += 1;
            t.question.push(qi);
            t.first_token.push(first);
            t.answer.push(answer.clone());
            t.first_token_agree += usize::from(first == *ref_first);
            t.first_token_flags.push(first == *ref_first);
            t.kl.push(kl_divergence(&ref_steps[0], &done.logits));
            t.tf_kl.push(tf_kl);
            t.answer_f1.push(token_f1(&answer, ref_answer));
            t.answer_em.push(f64::from(u8::from(
                normalize(&answer) == normalize(ref_answer),
            )));
            t.gold_f1.push(
                ex.answers
                    .iter()
                    .map(|g| token_f1(&answer, g))
                    .fold(0.0, f64::max),
            );
            let s: &FuseStats = &done.stats;
            t.recompute_fraction.push(s.recompute_fraction());
            t.ttft_ms.push(ms(s.total_time));
            t.kv_load_ms.push(ms(s.kv_load_time()));
            t.recompute_ms.push(ms(s.recompute_time + s.suffix_time));
            t.rank_ms.push(ms(s.rank_time));
            for (stage, d) in [
                ("kv_read", s.kv_read_time),
                ("kv_decode", s.kv_decode_time),
                ("kv_place", s.kv_place_time),
                ("rank", s.rank_time),
                ("recompute", s.recompute_time),
                ("question_prefill", s.suffix_time),
            ] {
                t.stage_ms.entry(stage).or_default().push(ms(d));
            }
            if s.chunks_computed > 0 && row != Row::Policy(Policy::Full) {
                eprintln!(
                    "question {qi}: {} chunks had no stored KV and were computed",
                    s.chunks_computed
                );
            }
        }
        for c in &prompt.chunks {
            chunks.store().remove(&chunks.key(c))?;
        }
        eprintln!(
            "[{}/{}] {} tokens; TTFT ms: {}",
            qi + 1,
            examples.len(),
            prompt.len(),
            order
                .iter()
                .map(|p| format!(
                    "{p} {:.0}",
                    tallies[p].ttft_ms.last().copied().unwrap_or(0.0)
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    if a.tier == "nvme" && a.nvme_dir.is_none() {
        let _ = std::fs::remove_dir_all(&tmp_dir);
    }

    if tallies.is_empty() {
        bail!("every question was skipped (none fits the model's context)");
    }
    let full_ttft = median(&tallies["full"].ttft_ms);
    let full_gold = tallies["full"].gold_f1.clone();
    let mut out = serde_json::Map::new();
    for name in &order {
        let t = &tallies[name];
        let ttft = median(&t.ttft_ms);
        let decisive: Vec<bool> = t
            .first_token_flags
            .iter()
            .zip(&full_margins)
            .filter(|(_, &m)| m >= DECISIVE_MARGIN)
            .map(|(&f, _)| f)
            .collect();
        let delta: Vec<f64> = t
            .gold_f1
            .iter()
            .zip(&full_gold)
            .map(|(p, f)| p - f)
            .collect();
        out.insert(
            name.clone(),
            serde_json::json!({
                "first_token_agreement": t.first_token_agree as f64 / t.n as f64,
                "first_token_agreement_decisive":
                    decisive.iter().filter(|&&f| f).count() as f64 / decisive.len().max(1) as f64,
                "decisive_questions": decisive.len(),
                "answer_f1_vs_full": mean(&t.answer_f1),
                "answer_em_vs_full": mean(&t.answer_em),
                "tf_kl_mean": mean(&t.tf_kl),
                "tf_kl_median": median(&t.tf_kl),
                "tf_kl_p90": quantile(&t.tf_kl, 0.9),
                "gold_f1_delta_ci95": bootstrap_ci95(&delta),
                "kl_mean": mean(&t.kl),
                "kl_median": median(&t.kl),
                "kl_max": t.kl.iter().copied().fold(0.0, f64::max),
                "gold_f1": mean(&t.gold_f1),
                "recompute_fraction": mean(&t.recompute_fraction),
                "ttft_ms_median": ttft,
                "ttft_ratio_vs_full": ttft / full_ttft,
                "ttft_speedup_vs_full": full_ttft / ttft,
                "kv_load_ms_median": median(&t.kv_load_ms),
                "compute_ms_median": median(&t.recompute_ms),
                "rank_ms_median": median(&t.rank_ms),
                "stage_ms_median": t
                    .stage_ms
                    .iter()
                    .map(|(k, v)| (k.to_string(), serde_json::json!(median(v))))
                    .collect::<serde_json::Map<_, _>>(),
                "questions": t.n,
                "per_question": {
                    "question": t.question,
                    "first_token": t.first_token,
                    "answer": t.answer,
                    "kl": t.kl,
                    "answer_f1_vs_full": t.answer_f1,
                    "tf_kl": t.tf_kl,
                    "first_token_agree": t.first_token_flags,
                    "ttft_ms": t.ttft_ms,
                    "gold_f1": t.gold_f1,
                },
            }),
        );
    }
    // Full prefill's margins, once: every policy's decisive questions are these.
    out["full"]["per_question"]["full_first_token_margin"] = serde_json::json!(full_margins);
    let kv_deviation: serde_json::Map<String, serde_json::Value> = deviations
        .iter()
        .map(|(name, d)| (name.clone(), d.json()))
        .collect();
    // Full prefill against itself under a rounding-level change: how close to `full` a policy
    // can be shown to be.
    let noise_floor = out.get(FULL_ROUNDED).map_or(serde_json::Value::Null, |v| {
        serde_json::json!({
            "row": FULL_ROUNDED,
            "first_token_agreement": v["first_token_agreement"],
            "first_token_agreement_decisive": v["first_token_agreement_decisive"],
            "answer_f1_vs_full": v["answer_f1_vs_full"],
            "answer_em_vs_full": v["answer_em_vs_full"],
            "tf_kl_mean": v["tf_kl_mean"],
            "tf_kl_p90": v["tf_kl_p90"],
        })
    });
    let report = serde_json::json!({
        "policies": out,
        "noise_floor": noise_floor,
        "kv_deviation": kv_deviation,
        "config": {
            "data": a.data.display().to_string(),
            "questions": examples.len() - skipped,
            "skipped_too_long": skipped,
            "tier": a.tier,
            "kv_dtype": a.kv_dtype,
            "frame": a.frame,
            "layout": layout.name,
            "threads": model.threads(),
            "answer_tokens": a.answer_tokens,
            "passages": a.passages,
            "passages_per_question_mean": mean(&passages_kept),
            "prompt_tokens_median": median(&prompt_tokens),
        },
    });
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    println!(
        "{} questions ({skipped} skipped as too long), KV from {} ({}), frame {}, {} threads",
        examples.len() - skipped,
        a.tier,
        a.kv_dtype,
        a.frame,
        model.threads()
    );
    println!(
        "{:<16} {:>8} {:>8} {:>8} {:>9} {:>9} {:>8} {:>8} {:>17} {:>9} {:>10} {:>8} {:>9}",
        "policy",
        "1st-tok",
        "F1/full",
        "EM/full",
        "KL mean",
        "TF-KL",
        "TF-p90",
        "gold F1",
        "delta CI95",
        "recomp",
        "TTFT ms",
        "speedup",
        "KV ms"
    );
    for name in &order {
        let v = &report["policies"][name];
        println!(
            "{:<16} {:>8.3} {:>8.3} {:>8.3} {:>9.4} {:>9.4} {:>8.4} {:>8.3} {:>17} {:>9.3} {:>10.1} {:>7.1}x {:>9.1}",
            name,
            v["first_token_agreement"].as_f64().unwrap_or(0.0),
            v["answer_f1_vs_full"].as_f64().unwrap_or(0.0),
            v["answer_em_vs_full"].as_f64().unwrap_or(0.0),
            v["kl_mean"].as_f64().unwrap_or(0.0),
            v["tf_kl_mean"].as_f64().unwrap_or(0.0),
            v["tf_kl_p90"].as_f64().unwrap_or(0.0),
            v["gold_f1"].as_f64().unwrap_or(0.0),
            format!(
                "[{:+.3}, {:+.3}]",
                v["gold_f1_delta_ci95"][0].as_f64().unwrap_or(0.0),
                v["gold_f1_delta_ci95"][1].as_f64().unwrap_or(0.0)
            ),
            v["recompute_fraction"].as_f64().unwrap_or(0.0),
            v["ttft_ms_median"].as_f64().unwrap_or(0.0),
            v["ttft_speedup_vs_full"].as_f64().unwrap_or(0.0),
            v["kv_load_ms_median"].as_f64().unwrap_or(0.0),
        );
    }
    println!(
        "first-token agreement where full's top-2 logit margin is at least {DECISIVE_MARGIN} \
         ({} of {} questions): {}",
        report["policies"]["full"]["decisive_questions"],
        examples.len() - skipped,
        order
            .iter()
            .map(|p| format!(
                "{p} {:.3}",
                report["policies"][p]["first_token_agreement_decisive"]
                    .as_f64()
                    .unwrap_or(0.0)
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let floor = &report["noise_floor"];
    if floor.is_object() {
        let f = |k: &str| floor[k].as_f64().unwrap_or(0.0);
        println!(
            "noise floor ({FULL_ROUNDED}: full prefill, its chunk keys once through a stored \
             chunk's rounding): first token {:.3} ({:.3} decisive), answer F1 vs full {:.3}, \
             tf KL {:.4}; a policy that reaches these is as close to full as full is to itself",
            f("first_token_agreement"),
            f("first_token_agreement_decisive"),
            f("answer_f1_vs_full"),
            f("tf_kl_mean"),
        );
    }
    for (name, d) in &report["kv_deviation"]
        .as_object()
        .cloned()
        .unwrap_or_default()
    {
        println!(
            "\nKV deviation of `{name}` from full ({} chunks; rel = |d|^2/|full|^2, coherent = \
             share of |d|^2 in the (chunk, head) mean, boundary = residual after subtracting \
             the first {} tokens' mean):",
            d["chunks_compared"], d["boundary_tokens"]
        );
        println!(
            "{:<6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9}   rel by position 0-3 / 4-15 / 16-63 / 64+ (values)",
            "layer", "K rel", "K coh", "K bound", "V rel", "V coh", "V bound"
        );
        let rows = d["layers"].as_array().cloned().unwrap_or_default();
        let all = std::iter::once(("all".to_string(), d["all_layers"].clone()));
        for (l, row) in rows
            .into_iter()
            .enumerate()
            .map(|(l, r)| (l.to_string(), r))
            .chain(all)
        {
            let f = |kv: &str, k: &str| row[kv][k].as_f64().unwrap_or(0.0);
            let pos: Vec<String> = row["values"]["rel_by_position"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|x| format!("{:.4}", x.as_f64().unwrap_or(0.0)))
                        .collect()
                })
                .unwrap_or_default();
            println!(
                "{:<6} {:>9.4} {:>9.3} {:>9.3} {:>9.4} {:>9.3} {:>9.3}   {}",
                l,
                f("keys", "rel"),
                f("keys", "coherent"),
                f("keys", "boundary"),
                f("values", "rel"),
                f("values", "coherent"),
                f("values", "boundary"),
                pos.join(" / ")
            );
        }
    }
    Ok(())
}

/// `full~`, full prefill's own noise floor: the prefix and the chunks prefilled in one pass as
/// `full` does, then every chunk token's keys taken once through what placing a stored chunk
/// does to them (rotated back before RoPE, rounded to f16, rotated to their position again:
/// [`KvCache::append_prerope`]), then the suffix prefilled over that cache in a pass of its
/// own, as every fused policy prefills it. No stored KV is read, so what separates this row
/// from `full` is rounding and batch composition alone: a policy's distance from `full` is
/// read against this row's.
fn full_rounded(model: &Model, prompt: &FusedPrompt, kv: &mut KvCache) -> Result<Prefilled> {
    let start = Instant::now();
    kv.clear();
    let head = prefill_head(model, prompt, kv)?;
    let (n_layer, n_head_kv, hd) = kv.shape();
    let rope = model.rope();
    let (mut k, mut v) = (vec![0.0f32; n_head_kv * hd], vec![0.0f32; n_head_kv * hd]);
    for slot in prompt.prefix.len()..head.len() {
        let pos = kv.positions()[slot];
        for layer in 0..n_layer {
            for h in 0..n_head_kv {
                let key = &mut k[h * hd..(h + 1) * hd];
                key.copy_from_slice(&kv.key(layer, h, slot));
                rope.shift(key, -pos);
                for x in key.iter_mut() {
                    *x = f16::from_f32(*x).to_f32();
                }
                rope.shift(key, pos);
                let stored = &kv.values(layer, h, slot + 1)[slot * hd..];
                for (dst, src) in v[h * hd..(h + 1) * hd].iter_mut().zip(stored) {
                    *dst = src.to_f32();
                }
            }
            kv.write(layer, slot, &k, &v);
        }
    }
    let (logits, next_position) = prefill_suffix(model, prompt, kv)?;
    Ok(Prefilled {
        logits,
        next_position,
        stats: FuseStats {
            policy: FULL_ROUNDED.to_string(),
            prompt_tokens: prompt.len(),
            prefix_tokens: prompt.prefix.len(),
            chunk_tokens: prompt.chunk_tokens(),
            recomputed_chunk_tokens: prompt.chunk_tokens(),
            suffix_tokens: prompt.suffix.len(),
            total_time: start.elapsed(),
            ..FuseStats::default()
        },
    })
}

/// Prefills the prompt up to its suffix (the prefix and the chunks, one pass, positions from 0)
/// into `kv`, empty; returns those tokens.
fn prefill_head(model: &Model, prompt: &FusedPrompt, kv: &mut KvCache) -> Result<Vec<u32>> {
    let head: Vec<u32> = prompt
        .prefix
        .iter()
        .chain(prompt.chunks.iter().flatten())
        .copied()
        .collect();
    let positions: Vec<i32> = (0..head.len() as i32).collect();
    model.prefill(&head, &positions, kv, Logits::None)?;
    Ok(head)
}

/// Prefills the suffix after what `kv` holds (the rest of the prompt): its last logits, and the
/// position of the first generated token.
fn prefill_suffix(
    model: &Model,
    prompt: &FusedPrompt,
    kv: &mut KvCache,
) -> Result<(Vec<f32>, i32)> {
    let at = kv.len() as i32;
    let end = at + prompt.suffix.len() as i32;
    let positions: Vec<i32> = (at..end).collect();
    let logits = model.prefill(&prompt.suffix, &positions, kv, Logits::Last)?;
    Ok((logits, end))
}

/// `prefix-hit`: the prompt up to its suffix prefilled and cached in a [`PrefixCache`] of its
/// own, untimed; then, timed, the cached KV copied in (the lookup a hit makes) and the suffix
/// prefilled after it. The best case of a conventional prefix cache: the same passages, in the
/// same order, asked about again.
fn prefix_hit(model: &Model, prompt: &FusedPrompt, kv: &mut KvCache) -> Result<Prefilled> {
    let mut filled = model.new_cache(prompt.len() - prompt.suffix.len());
    let head = prefill_head(model, prompt, &mut filled)?;
    let cache = PrefixCache::new(u64::MAX);
    cache.insert(&head, filled);

    let start = Instant::now();
    kv.clear();
    let Some(hit) = cache.lookup(&head).filter(|h| h.len == head.len()) else {
        bail!(
            "the prefix cache did not return the {} tokens just cached",
            head.len()
        );
    };
    kv.append_from(&hit.entry.kv, 0..hit.len)?;
    let copied = start.elapsed();
    let (logits, next_position) = prefill_suffix(model, prompt, kv)?;
    let total = start.elapsed();
    Ok(Prefilled {
        logits,
        next_position,
        stats: FuseStats {
            policy: PREFIX_HIT.to_string(),
            prompt_tokens: prompt.len(),
            prefix_tokens: prompt.prefix.len(),
            prefix_cached_tokens: head.len(),
            chunk_tokens: prompt.chunk_tokens(),
            suffix_tokens: prompt.suffix.len(),
            prefix_time: copied,
            suffix_time: total - copied,
            total_time: total,
            ..FuseStats::default()
        },
    })
}

/// Greedy decoding of up to `n` tokens (stopping at an end-of-generation token), or the
/// `forced` tokens fed one by one: the tokens, and the logits each was chosen from.
fn decode(
    loaded: &crate::Loaded,
    kv: &mut engram_model::KvCache,
    mut logits: Vec<f32>,
    mut pos: i32,
    n: usize,
    forced: Option<&[u32]>,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let mut ids = Vec::with_capacity(n);
    let mut steps = Vec::with_capacity(n);
    for i in 0..n {
        let id = forced.map_or_else(|| argmax(&logits), |f| f[i]);
        if forced.is_none() && loaded.tokenizer.is_eog(id) {
            steps.push(logits);
            break;
        }
        ids.push(id);
        if i + 1 < n {
            let next = loaded.model.forward(&[id], &[pos], kv, Logits::Last)?;
            steps.push(std::mem::replace(&mut logits, next));
            pos += 1;
        } else {
            steps.push(std::mem::take(&mut logits));
        }
    }
    Ok((ids, steps))
}

/// The answer in `ids` as engramd sends it ([`OutputText`]: up to a stop string or the answer
/// repeating itself, without a leading label or the question repeated), and how many of the
/// tokens it took.
fn answer_of(loaded: &crate::Loaded, ids: &[u32], question: &str) -> (String, usize) {
    let mut text = OutputText::answer(question, &[]);
    let mut detok = Detokenizer::new(&loaded.tokenizer, true);
    for (i, &id) in ids.iter().enumerate() {
        if text.push(&detok.push(id)).1 {
            return (text.text().trim().to_owned(), i + 1);
        }
    }
    text.finish();
    (text.text().trim().to_owned(), ids.len())
}

/// The 2.5 % and 97.5 % points of the mean of `v` over 2,000 bootstrap resamples (a fixed
/// seed, so a run is reproducible).
pub(crate) fn bootstrap_ci95(v: &[f64]) -> [f64; 2] {
    if v.is_empty() {
        return [0.0, 0.0];
    }
    let mut state: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut means: Vec<f64> = (0..2000)
        .map(|_| {
            (0..v.len())
                .map(|_| v[(next() % v.len() as u64) as usize])
                .sum::<f64>()
                / v.len() as f64
        })
        .collect();
    means.sort_by(f64::total_cmp);
    [quantile(&means, 0.025), quantile(&means, 0.975)]
}

/// The `q` quantile of `v` (nearest rank).
pub(crate) fn quantile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * q).round() as usize]
}

/// The largest logit minus the second largest (0 with fewer than two).
fn top2_margin(logits: &[f32]) -> f64 {
    match top_k(logits, 2)[..] {
        [(_, a), (_, b)] => f64::from(a - b),
        _ => 0.0,
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub(crate) fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.iter().sum::<f64>() / v.len() as f64
}

fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let m = s.len() / 2;
    if s.len() % 2 == 1 {
        s[m]
    } else {
        (s[m - 1] + s[m]) / 2.0
    }
}

/// SQuAD's answer tokens (see [`crate::qa_eval::squad_tokens`]).
fn normalize(s: &str) -> Vec<String> {
    crate::qa_eval::squad_tokens(s)
}

/// SQuAD token F1 between a prediction and a reference (1 when both are empty).
pub fn token_f1(prediction: &str, reference: &str) -> f64 {
    crate::qa_eval::overlap_f1(&normalize(prediction), &normalize(reference))
}

/// `engram eval fusion-diff`: how far two `eval fusion --json` runs agree, policy by policy.
#[derive(Args)]
pub struct FusionDiffArgs {
    /// The first run's JSON (`eval fusion --json`), the reference.
    a: PathBuf,
    /// The second run's JSON, over the same data file.
    b: PathBuf,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

/// What one policy gave for one question in one run.
#[derive(Debug)]
struct Answered {
    first_token: u64,
    answer: String,
}

/// One policy's answers in one run, by question index.
fn run_answers(report: &serde_json::Value, policy: &str) -> BTreeMap<u64, Answered> {
    let q = &report["policies"][policy]["per_question"];
    let (ids, firsts, answers) = (
        q["question"].as_array(),
        q["first_token"].as_array(),
        q["answer"].as_array(),
    );
    let (Some(ids), Some(firsts), Some(answers)) = (ids, firsts, answers) else {
        return BTreeMap::new();
    };
    ids.iter()
        .zip(firsts)
        .zip(answers)
        .filter_map(|((i, f), a)| {
            let answered = Answered {
                first_token: f.as_u64()?,
                answer: a.as_str()?.to_owned(),
            };
            Some((i.as_u64()?, answered))
        })
        .collect()
}

/// Agreement of two runs of one policy on the questions both answered: first token, answer F1
/// and exact match (the measures `eval fusion` takes against full prefill).
#[derive(Debug, PartialEq)]
struct RunAgreement {
    questions: usize,
    first_token: f64,
    answer_f1: f64,
    answer_em: f64,
}

fn run_agreement(a: &BTreeMap<u64, Answered>, b: &BTreeMap<u64, Answered>) -> Option<RunAgreement> {
    let pairs: Vec<(&Answered, &Answered)> =
        a.iter().filter_map(|(q, x)| Some((x, b.get(q)?))).collect();
    if pairs.is_empty() {
        return None;
    }
    let n = pairs.len() as f64;
    let share = |f: &dyn Fn(&Answered, &Answered) -> f64| {
        pairs.iter().map(|(x, y)| f(x, y)).sum::<f64>() / n
    };
    let same = |yes: bool| f64::from(u8::from(yes));
    Some(RunAgreement {
        questions: pairs.len(),
        first_token: share(&|x, y| same(x.first_token == y.first_token)),
        answer_f1: share(&|x, y| token_f1(&y.answer, &x.answer)),
        answer_em: share(&|x, y| same(normalize(&x.answer) == normalize(&y.answer))),
    })
}

/// Compares two `eval fusion` runs (two builds, two machines, two instruction sets): for each
/// policy in both, how often the runs give the same first token and the same answer. Run on
/// `full` alone, it is the reference's own reproducibility, the floor under what any fused
/// policy can agree with it.
pub fn diff(a: FusionDiffArgs) -> Result<()> {
    let read = |p: &PathBuf| -> Result<serde_json::Value> {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))
    };
    let (ra, rb) = (read(&a.a)?, read(&a.b)?);
    let names: Vec<String> = ra["policies"]
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    let gold = gold_answers(&ra, &rb);
    let mut out = serde_json::Map::new();
    for name in names {
        let (x, y) = (run_answers(&ra, &name), run_answers(&rb, &name));
        if x.is_empty() {
            bail!(
                "{}: policy {name} has no per-question answers (written before they were recorded)",
                a.a.display()
            );
        }
        if let Some(g) = run_agreement(&x, &y) {
            let mut v = serde_json::json!({
                "questions": g.questions,
                "first_token_agreement": g.first_token,
                "answer_f1": g.answer_f1,
                "answer_em": g.answer_em,
            });
            if let Some(gold) = &gold {
                let (fa, fb, ci) = gold_f1_pair(&x, &y, gold);
                v["gold_f1_a"] = fa.into();
                v["gold_f1_b"] = fb.into();
                v["gold_f1_delta_ci95"] = serde_json::json!(ci);
            }
            out.insert(name, v);
        }
    }
    if out.is_empty() {
        bail!("the two runs share no policy and question");
    }
    if a.json {
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("{} against {}", a.b.display(), a.a.display());
    println!(
        "{:<16} {:>9} {:>8} {:>8} {:>8} {:>9} {:>9} {:>18}",
        "policy", "questions", "1st-tok", "F1", "EM", "gold F1 a", "gold F1 b", "b - a CI95"
    );
    for (name, v) in &out {
        let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:<16} {:>9} {:>8.3} {:>8.3} {:>8.3} {:>9.3} {:>9.3}   [{:+.3}, {:+.3}]",
            name,
            v["questions"],
            f("first_token_agreement"),
            f("answer_f1"),
            f("answer_em"),
            f("gold_f1_a"),
            f("gold_f1_b"),
            v["gold_f1_delta_ci95"][0].as_f64().unwrap_or(f64::NAN),
            v["gold_f1_delta_ci95"][1].as_f64().unwrap_or(f64::NAN),
        );
    }
    Ok(())
}

/// The gold answers of the data file both runs were measured on, by question index: none when
/// they name different files (the same questions are then not known to be the same) or the
/// file cannot be read.
fn gold_answers(a: &serde_json::Value, b: &serde_json::Value) -> Option<Vec<Vec<String>>> {
    let data = a["config"]["data"].as_str()?;
    if b["config"]["data"].as_str()? != data {
        return None;
    }
    let examples: Vec<Example> = serde_json::from_str(&std::fs::read_to_string(data).ok()?).ok()?;
    Some(examples.into_iter().map(|e| e.answers).collect())
}

/// Gold F1 of each run's answers on the questions both answered, and the 95 % bootstrap
/// interval of the paired difference (b - a): whether a change of prompt or build costs
/// answers, not only whether it changes them.
fn gold_f1_pair(
    a: &BTreeMap<u64, Answered>,
    b: &BTreeMap<u64, Answered>,
    gold: &[Vec<String>],
) -> (f64, f64, [f64; 2]) {
    let f1 = |x: &Answered, q: u64| {
        gold.get(q as usize).map_or(0.0, |g| {
            g.iter().map(|r| token_f1(&x.answer, r)).fold(0.0, f64::max)
        })
    };
    let pairs: Vec<(f64, f64)> = a
        .iter()
        .filter_map(|(&q, x)| Some((f1(x, q), f1(b.get(&q)?, q))))
        .collect();
    let fa: Vec<f64> = pairs.iter().map(|p| p.0).collect();
    let fb: Vec<f64> = pairs.iter().map(|p| p.1).collect();
    let delta: Vec<f64> = pairs.iter().map(|p| p.1 - p.0).collect();
    (mean(&fa), mean(&fb), bootstrap_ci95(&delta))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f1_follows_squad() {
        assert_eq!(token_f1("The Exeter College", "exeter college"), 1.0);
        assert_eq!(token_f1("", ""), 1.0);
        assert_eq!(token_f1("paris", ""), 0.0);
        let f = token_f1("exeter college oxford", "exeter college");
        assert!((f - 0.8).abs() < 1e-9);
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
    }

    #[test]
    fn runs_agree_on_the_questions_both_answered() {
        let run = |v: &[(u64, u64, &str)]| -> BTreeMap<u64, Answered> {
            v.iter()
                .map(|&(q, first_token, a)| {
                    let answer = a.to_owned();
                    (
                        q,
                        Answered {
                            first_token,
                            answer,
                        },
                    )
                })
                .collect()
        };
        let a = run(&[(0, 7, "30 days"), (1, 3, "Paris"), (2, 5, "the Rhine")]);
        let b = run(&[(0, 7, "30 days"), (2, 9, "Rhine river"), (4, 1, "x")]);
        let g = run_agreement(&a, &b).expect("questions 0 and 2 in both");
        assert_eq!(g.questions, 2);
        assert!((g.first_token - 0.5).abs() < 1e-9);
        // "the Rhine" ("rhine", SQuAD drops articles) against "Rhine river": F1 2/3.
        assert!(
            (g.answer_f1 - (1.0 + 2.0 / 3.0) / 2.0).abs() < 1e-9,
            "{g:?}"
        );
        assert!((g.answer_em - 0.5).abs() < 1e-9);
        assert_eq!(run_agreement(&a, &run(&[(9, 1, "")])), None);

        // Gold F1 of each run on questions 0 and 2, the best over each question's answers.
        let gold: Vec<Vec<String>> = [&["30 days"][..], &["Paris"], &["Rhine", "the Rhine river"]]
            .iter()
            .map(|g| g.iter().map(|s| s.to_string()).collect())
            .collect();
        let (fa, fb, ci) = gold_f1_pair(&a, &b, &gold);
        assert!((fa - 1.0).abs() < 1e-9, "{fa}");
        assert!((fb - 1.0).abs() < 1e-9, "{fb}");
        assert_eq!(ci, [0.0, 0.0]);
        let worse = run(&[(0, 7, "thirty"), (2, 9, "Rhine river")]);
        let (_, fb, ci) = gold_f1_pair(&a, &worse, &gold);
        assert!((fb - 0.5).abs() < 1e-9, "{fb}");
        assert!(ci[0] <= -0.5 && ci[1] <= 0.0, "{ci:?}");
    }

    #[test]
    fn top2_margin_is_the_gap_below_the_largest() {
        assert!((top2_margin(&[0.5, 2.0, 1.25, -3.0]) - 0.75).abs() < 1e-9);
        assert!((top2_margin(&[2.0, 0.5, 2.0]) - 0.0).abs() < 1e-9);
        assert_eq!(top2_margin(&[1.0]), 0.0);
    }
}
