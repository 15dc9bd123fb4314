//! The BERT embedder (all-MiniLM-L6-v2) against sentence-transformers' reference vectors.
//!
//! Token ids must match exactly; each embedding must have cosine >= 0.999 with the reference
//! and should agree to about 1e-5 per component (the file rounds to 7 significant digits);
//! query/passage cosines must agree to 1e-3.

use std::sync::OnceLock;

use engram_embed::Embedder;
use serde_json::Value;

use crate::common::{self, ids};

/// Least cosine between our embedding and the reference, per text.
const MIN_COSINE: f64 = 0.999;
/// Largest component difference tolerated: float noise plus the file's 7-digit rounding.
const MAX_ABS_DIFF: f64 = 1e-5;
/// Largest difference between our pair cosine and the reference one.
const PAIR_COSINE_TOL: f64 = 1e-3;

struct Fixture {
    embedder: Embedder,
    golden: Value,
}

/// Loaded once and shared by the tests of this module.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = common::models_dir().join("all-MiniLM-L6-v2");
        assert!(
            dir.join("model.safetensors").is_file(),
            "{} is missing: run scripts/fetch-models.sh first",
            dir.display()
        );
        Fixture {
            embedder: Embedder::load(&dir, 2).expect("all-MiniLM-L6-v2 loads"),
            golden: common::golden("minilm-l6-v2.sentence-transformers.json"),
        }
    })
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("a float array")
        .iter()
        .map(|x| x.as_f64().expect("a float"))
        .collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

fn to_f64(v: &[f32]) -> Vec<f64> {
    v.iter().map(|&x| x as f64).collect()
}

#[test]
fn token_ids_match() {
    let f = fixture();
    let texts = f.golden["texts"].as_array().expect("texts");
    let mut bad = Vec::new();
    for t in texts {
        let want = ids(&t["input_ids"]);
        let got = f
            .embedder
            .tokenize(t["text"].as_str().expect("text"))
            .expect("tokenizes");
        if got != want {
            bad.push(format!("{}:\n  got  {got:?}\n  want {want:?}", t["id"]));
        }
    }
    assert!(
        bad.is_empty(),
        "token ids differ for {} texts:\n{}",
        bad.len(),
        bad.join("\n")
    );
    assert_eq!(f.embedder.max_tokens(), 256);
}

#[test]
fn embeddings_match() {
    let f = fixture();
    let texts = f.golden["texts"].as_array().expect("texts");
    let strs: Vec<&str> = texts
        .iter()
        .map(|t| t["text"].as_str().expect("text"))
        .collect();
    let got = f.embedder.embed(&strs).expect("embeds");
    assert_eq!(got.len(), texts.len());
    let (mut min_cos, mut min_id) = (f64::INFINITY, String::new());
    let (mut max_diff, mut max_id) = (0.0f64, String::new());
    for (t, v) in texts.iter().zip(&got) {
        let want = floats(&t["embedding"]);
        assert_eq!(v.len(), want.len(), "dimension of {}", t["id"]);
        let v = to_f64(v);
        let c = cosine(&v, &want);
        let d = v
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        if c < min_cos {
            (min_cos, min_id) = (c, t["id"].to_string());
        }
        if d > max_diff {
            (max_diff, max_id) = (d, t["id"].to_string());
        }
    }
    let summary = format!(
        "over {} texts: min cosine {min_cos:.9} (1 - cos = {:.1e}, {min_id}), \
         max abs diff {max_diff:.3e} ({max_id})",
        texts.len(),
        1.0 - min_cos
    );
    eprintln!("embed_golden: {summary}");
    assert!(min_cos >= MIN_COSINE, "cosine below {MIN_COSINE} {summary}");
    assert!(
        max_diff <= MAX_ABS_DIFF,
        "component diff above {MAX_ABS_DIFF:e} {summary}"
    );
}

#[test]
fn pair_cosines_match() {
    let f = fixture();
    let pairs = f.golden["pairs"].as_array().expect("pairs");
    let mut report = Vec::new();
    let mut worst = 0.0f64;
    for p in pairs {
        let q = f
            .embedder
            .embed_one(p["query"].as_str().expect("query"))
            .expect("embeds");
        let d = f
            .embedder
            .embed_one(p["passage"].as_str().expect("passage"))
            .expect("embeds");
        let got = cosine(&to_f64(&q), &to_f64(&d));
        let want = p["cosine"].as_f64().expect("cosine");
        worst = worst.max((got - want).abs());
        report.push(format!("{}: got {got:.7} want {want:.7}", p["id"]));
    }
    eprintln!("embed_golden: pair cosines off by at most {worst:.3e}");
    assert!(
        worst <= PAIR_COSINE_TOL,
        "pair cosine off by {worst:.3e} (> {PAIR_COSINE_TOL:e}):\n{}",
        report.join("\n")
    );
}
