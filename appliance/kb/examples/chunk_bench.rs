//! Chunking speed with the LLM's tokenizer, the fast fit (one encoding of a window per chunk,
//! from the tokenizer's token ends) against the search it replaces (a dozen encodings of
//! candidate spans), in one run on the same text:
//!
//! `cargo run --release -p engram-kb --example chunk_bench -- MODEL.gguf FILE [MAX_BYTES]`
//!
//! Prints the parse time, both chunking times, their ratio and how many chunks differ.

use std::time::Instant;

use engram_kb::{chunk_text, ChunkConfig, TokenCounter};

/// The tokenizer without its token ends: the chunker's search path.
struct SearchOnly<'a>(&'a engram_tokenizer::Tokenizer);

impl TokenCounter for SearchOnly<'_> {
    fn count(&self, text: &str) -> usize {
        self.0.count(text)
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(model), Some(file)) = (args.first(), args.get(1)) else {
        return Err("usage: chunk_bench MODEL.gguf FILE [MAX_BYTES]".into());
    };
    let gguf = engram_gguf::GgufFile::open(model)?;
    let tok = engram_tokenizer::Tokenizer::from_gguf(gguf.metadata())?;
    let bytes = std::fs::read(file)?;
    let limit = args.get(2).map_or(Ok(bytes.len()), |s| s.parse())?;
    let bytes = &bytes[..bytes.len().min(limit)];
    let t = Instant::now();
    let parsed = engram_parse::parse(file, bytes, &engram_parse::Limits::default())?;
    let parse = t.elapsed().as_secs_f64();
    let cfg = ChunkConfig::default();
    let t = Instant::now();
    let fast = chunk_text(&parsed.text, &cfg, &tok);
    let fast_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let search = chunk_text(&parsed.text, &cfg, &SearchOnly(&tok));
    let search_s = t.elapsed().as_secs_f64();
    let differ = fast.iter().zip(&search).filter(|(a, b)| a != b).count()
        + fast.len().abs_diff(search.len());
    if let Some((a, b)) = fast.iter().zip(&search).find(|(a, b)| a != b) {
        if std::env::var_os("CHUNK_BENCH_SHOW").is_some() {
            eprintln!(
                "first difference:\n fast   {a:?} {:?}\n search {b:?} {:?}",
                &parsed.text[a.bytes.end.saturating_sub(40)..a.bytes.end],
                &parsed.text[b.bytes.end.saturating_sub(40)..b.bytes.end]
            );
        }
    }
    println!(
        "{}",
        serde_json::json!({
            "text_bytes": parsed.text.len(),
            "parse_s": parse,
            "chunks": fast.len(),
            "fast_fit_s": fast_s,
            "search_s": search_s,
            "speedup": search_s / fast_s,
            "fast_fit_mb_per_s": parsed.text.len() as f64 / fast_s / 1e6,
            "chunks_that_differ": differ,
        })
    );
    Ok(())
}
