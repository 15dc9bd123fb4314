//! Embedding throughput on real texts, for `bench/embed-vs-st.sh` (side by side with
//! sentence-transformers): reads one JSON string per line, embeds them `batch` at a time as
//! ingestion does, and prints one JSON object with the word pieces per second of the best of
//! `runs` timed passes (after one warm-up).
//!
//! `cargo run --release -p engram-embed --example embed_bench -- MODEL_DIR TEXTS.jsonl THREADS BATCH RUNS`

use std::time::Instant;

use engram_embed::Embedder;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [dir, texts, threads, batch, runs] = &args[..] else {
        return Err("usage: embed_bench MODEL_DIR TEXTS.jsonl THREADS BATCH RUNS".into());
    };
    let (threads, batch, runs): (usize, usize, usize) =
        (threads.parse()?, batch.parse()?, runs.parse()?);
    let embedder = Embedder::load(dir.as_ref(), threads)?;
    let texts: Vec<String> = std::fs::read_to_string(texts)?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(serde_json::from_str)
        .collect::<Result<_, _>>()?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let pieces: usize = refs
        .iter()
        .map(|t| embedder.tokenize(t).map(|ids| ids.len()))
        .sum::<Result<usize, _>>()?;
    let pass = || -> Result<f64, Box<dyn std::error::Error>> {
        let t = Instant::now();
        for b in refs.chunks(batch) {
            std::hint::black_box(embedder.embed(b)?);
        }
        Ok(t.elapsed().as_secs_f64())
    };
    pass()?;
    let mut best = f64::INFINITY;
    for _ in 0..runs {
        best = best.min(pass()?);
    }
    println!(
        "{}",
        serde_json::json!({
            "side": "engram",
            "texts": texts.len(),
            "word_pieces": pieces,
            "threads": threads,
            "batch": batch,
            "seconds": best,
            "word_pieces_per_s": pieces as f64 / best,
        })
    );
    Ok(())
}
