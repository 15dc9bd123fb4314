//! Embeddings per second for 64 texts of about 50 tokens:
//! `cargo run --release -p engram-embed --example throughput -- [model dir] [threads]`.

use std::time::Instant;

use engram_embed::Embedder;

/// Texts per `embed` call, as an ingest batch would send.
const TEXTS: usize = 64;
/// Words per text; with [CLS], [SEP], the full stop and split words this is about 50 tokens.
const WORDS: usize = 36;
/// Timed repetitions after one warm-up call; the best is reported (these machines are noisy).
const RUNS: usize = 3;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args
        .next()
        .unwrap_or_else(|| "models/all-MiniLM-L6-v2".into());
    let threads = args.next().map_or(Ok(2), |t| t.parse())?;
    let embedder = Embedder::load(dir.as_ref(), threads)?;

    let words = [
        "the",
        "appliance",
        "stores",
        "every",
        "document",
        "in",
        "chunks",
        "and",
        "answers",
        "questions",
        "about",
        "policy",
        "with",
        "citations",
        "from",
        "its",
        "knowledge",
        "base",
        "customers",
        "ask",
        "how",
        "to",
        "reset",
        "passwords",
        "configure",
        "backups",
        "or",
        "renew",
        "licences",
        "before",
        "they",
        "expire",
        "next",
        "month",
        "while",
        "auditors",
    ];
    let mut state = 7u64;
    let texts: Vec<String> = (0..TEXTS)
        .map(|_| {
            let mut s = Vec::with_capacity(WORDS);
            for _ in 0..WORDS {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1);
                s.push(words[(state >> 33) as usize % words.len()]);
            }
            s.join(" ") + "."
        })
        .collect();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let tokens: usize = refs
        .iter()
        .map(|t| embedder.tokenize(t).map(|v| v.len()))
        .sum::<Result<_, _>>()?;

    embedder.embed(&refs)?;
    let mut best = f64::INFINITY;
    for _ in 0..RUNS {
        let t = Instant::now();
        embedder.embed(&refs)?;
        best = best.min(t.elapsed().as_secs_f64());
    }
    println!(
        "{}: {TEXTS} texts, {:.1} tokens each, {threads} threads: {:.3} s, {:.1} embeddings/s, {:.0} tokens/s",
        embedder.model_id(),
        tokens as f64 / TEXTS as f64,
        best,
        TEXTS as f64 / best,
        tokens as f64 / best
    );
    Ok(())
}
