//! The engine on mixture-of-experts models against llama.cpp: the tiny Qwen3-MoE and Mixtral
//! shapes of `engram gen-model`, regenerated here and checked byte for byte by sha256 against
//! the files llama.cpp ran, then held to `tests/golden/moe-tiny.llamacpp.json` through
//! `engram generate --prompt-ids` (the random vocabulary spells nothing, so the prompts are ids).
//!
//! The shapes' logits are about 1 in size (random weights of standard deviation 0.02), not the
//! 10 to 20 of a trained model, so the bars are this file's own: each model is held to its
//! reference's noise, llama.cpp's flash-attention path against its default one
//! (`flash_attn_spread`), scaled as the dense golden tests scale theirs (0.6 / 0.47), with a
//! floor of [`FLOOR`]. Routing adds noise of its own: a token whose k-th and (k+1)-th router
//! logits are within float noise (gaps down to 3e-4 over these prompts' 1,700 choices) may
//! take either expert on either side.
//!
//! What this test catches, measured: tokens routed to the wrong experts (expert `e` read as
//! `n - 1 - e`) move the top-5 logits by 0.21 (Qwen3-MoE) and 0.16 (Mixtral), 4x the
//! tolerance, and flip greedy tokens; unnormalised expert weights move Mixtral's by 0.06 but
//! Qwen3-MoE's (4 of 16 experts) by no more than its noise, which the f64 reference test of
//! `engram-model` (`mixture_of_experts_matches_reference`) catches at 23x its tolerance.

use std::path::Path;

use serde_json::Value;

use crate::common;
use crate::engine_golden::{engram_json, engram_stdout};
use crate::engine_golden_kquant::sha256_hex;

/// The golden file, made by `bench/golden/make-moe-golden.sh`.
const GOLDEN: &str = "moe-tiny.llamacpp.json";

/// The smallest logit tolerance, whatever the reference's spread. Measured with the AVX-512
/// kernels: the worst top-5 difference is 0.024 on Qwen3-MoE (a 16-token prompt; 0.005 to
/// 0.011 on the others) and 0.003 on Mixtral.
const FLOOR: f64 = 0.04;

/// Greedy tokens must be equal up to the first step whose llama.cpp margin (top-1 minus top-2)
/// is under this multiple of the tolerance: below it, a flip is the two sides' float order.
const MARGIN_IN_TOLERANCES: f64 = 2.0;

fn tolerance(spread: f64) -> f64 {
    (spread * 0.6 / 0.47).max(FLOOR)
}

/// Writes the model `m` describes with `engram gen-model` and checks it is llama.cpp's file.
fn generate_model(m: &Value, dir: &Path) -> std::path::PathBuf {
    let path = dir.join(m["file"].as_str().unwrap());
    engram_stdout(&[
        "gen-model",
        "--shape",
        m["shape"].as_str().unwrap(),
        "--type",
        m["type"].as_str().unwrap(),
        "--seed",
        "1",
        "--out",
        path.to_str().unwrap(),
    ]);
    let (got, want) = (sha256_hex(&path), m["sha256"].as_str().unwrap());
    assert_eq!(
        got, want,
        "`{}` no longer writes the file llama.cpp's reference was computed on: if the change \
         is meant, regenerate with bench/golden/make-moe-golden.sh",
        m["command"]
    );
    path
}

/// One prompt against the reference; returns the worst top-5 logit difference and failures.
fn check_prompt(model: &Path, p: &Value, tol: f64) -> (f64, Vec<String>) {
    let id = p["id"].as_str().unwrap();
    let prompt = common::ids(&p["prompt_token_ids"]);
    let gold_generated = common::ids(&p["generated_token_ids"]);
    let ids_arg = prompt
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",");
    let n = gold_generated.len().to_string();
    let out = engram_json(&[
        "generate",
        "--model",
        model.to_str().unwrap(),
        "--prompt-ids",
        &ids_arg,
        "--max-tokens",
        &n,
        "--greedy",
        "--ignore-eos",
        "--json",
        "--top-logits",
        "50",
    ]);
    let mut failures = Vec::new();
    assert_eq!(
        common::ids(&out["prompt_token_ids"]),
        prompt,
        "{id}: ids used as given"
    );

    let ours: Vec<(u64, f64)> = out["top_logits_last_prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| (e[0].as_u64().unwrap(), e[1].as_f64().unwrap()))
        .collect();
    let mut worst = 0f64;
    for g in p["top5_last_prompt_position"].as_array().unwrap() {
        let (tok, logit) = (g["id"].as_u64().unwrap(), g["logit"].as_f64().unwrap());
        match ours.iter().find(|(t, _)| *t == tok) {
            Some((_, l)) => {
                worst = worst.max((l - logit).abs());
                if (l - logit).abs() > tol {
                    failures.push(format!(
                        "{id}: token {tok}: logit {l:.4}, llama.cpp {logit:.4}"
                    ));
                }
            }
            None => failures.push(format!(
                "{id}: llama.cpp's top-5 token {tok} not in our top 50"
            )),
        }
    }
    let margins: Vec<f64> = p["greedy_top1_top2_margin"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_f64().unwrap())
        .collect();
    let must = margins
        .iter()
        .position(|&m| m < MARGIN_IN_TOLERANCES * tol)
        .unwrap_or(margins.len());
    let generated = common::ids(&out["generated_token_ids"]);
    let equal = generated
        .iter()
        .zip(&gold_generated)
        .take_while(|(a, b)| a == b)
        .count();
    if equal < must {
        failures.push(format!(
            "{id}: greedy tokens differ at step {equal}, llama.cpp's margin there {:.4}",
            margins[equal]
        ));
    }
    eprintln!(
        "{id}: worst top-5 logit difference {worst:.4}; greedy {equal}/{} equal, {must} required",
        generated.len()
    );
    (worst, failures)
}

#[test]
fn mixture_of_experts_models_match_llama_cpp() {
    let golden = common::repo_golden(GOLDEN);
    let dir = common::temp_dir("moe-golden");
    let mut failures = Vec::new();
    for m in golden["models"].as_array().unwrap() {
        let spread = m["flash_attn_spread"]["worst_top5_logit_change"]
            .as_f64()
            .unwrap();
        let tol = tolerance(spread);
        let path = generate_model(m, &dir);
        let mut worst = 0f64;
        for p in m["prompts"].as_array().unwrap() {
            let (w, f) = check_prompt(&path, p, tol);
            worst = worst.max(w);
            failures.extend(f.into_iter().map(|f| format!("{}: {f}", m["shape"])));
        }
        eprintln!(
            "{}: worst top-5 logit difference {worst:.4} (tolerance {tol:.3})",
            m["shape"]
        );
    }
    std::fs::remove_dir_all(&dir).expect("removing the generated models");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
