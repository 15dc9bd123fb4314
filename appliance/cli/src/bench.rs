//! `engram bench`: prefill and decode speed, model load time and peak memory, as JSON or a table.

use std::time::Instant;

use anyhow::{bail, Result};
use engram_model::{Logits, Model, PREFILL_CHUNK};

/// What to measure.
pub struct BenchPlan {
    /// Prompt lengths whose prefill speed is measured.
    pub prefill: Vec<usize>,
    /// Tokens decoded one at a time...
    pub decode_tokens: usize,
    /// ...after a context of this many tokens.
    pub decode_context: usize,
    /// Runs of each measurement; the median is reported.
    pub repetitions: usize,
}

/// One figure: its runs and their median.
#[derive(serde::Serialize)]
pub struct Figure {
    pub tokens: usize,
    pub context: usize,
    pub tokens_per_second: f64,
    pub runs: Vec<f64>,
    /// Decode only: bytes one step reads from memory (`Model::decode_bytes` at the middle of
    /// the decoded span), and that times tokens per second, in GB/s (10^9 bytes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_per_token: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gbs: Option<f64>,
}

/// All results of one `engram bench`.
#[derive(serde::Serialize)]
pub struct BenchReport {
    pub model: String,
    pub threads: usize,
    /// `engram_kernels::kernels_in_use()`: the instruction set (and AMX) the run used.
    pub kernels: String,
    pub model_load_ms: f64,
    pub prefill: Vec<Figure>,
    pub decode: Option<Figure>,
    pub peak_rss_mib: f64,
}

/// Deterministic pseudo-random token ids (as llama-bench, the content does not change the
/// work), avoiding the special ids at the bottom of the vocabulary.
pub(crate) fn tokens(n: usize, vocab: usize, seed: u64) -> Vec<u32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (100 + s % (vocab as u64 - 100)) as u32
        })
        .collect()
}

/// Prefills `ids` from position 0 in `PREFILL_CHUNK`-token calls (llama.cpp's default
/// micro-batch) and returns the seconds taken.
fn prefill(model: &Model, ids: &[u32], kv: &mut engram_model::KvCache) -> Result<f64> {
    let start = Instant::now();
    let mut pos = 0usize;
    for chunk in ids.chunks(PREFILL_CHUNK) {
        let positions: Vec<i32> = (pos..pos + chunk.len()).map(|p| p as i32).collect();
        model.forward(chunk, &positions, kv, Logits::Last)?;
        pos += chunk.len();
    }
    Ok(start.elapsed().as_secs_f64())
}

fn median(runs: &[f64]) -> f64 {
    let mut v = runs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs the plan on a loaded model.
pub fn run(model: &Model, model_name: &str, load_ms: f64, plan: &BenchPlan) -> Result<BenchReport> {
    if plan.repetitions == 0 {
        bail!("--repetitions must be at least 1");
    }
    let vocab = model.config().vocab_size;
    let max_ctx = plan
        .prefill
        .iter()
        .copied()
        .chain([plan.decode_context + plan.decode_tokens])
        .max()
        .unwrap_or(0);
    let mut kv = model.new_cache(max_ctx.max(1));

    // One short warm-up run pages the weights in and starts the workers.
    prefill(model, &tokens(16, vocab, 0), &mut kv)?;

    let mut prefill_figs = Vec::new();
    for &n in &plan.prefill {
        let ids = tokens(n, vocab, n as u64);
        let mut runs = Vec::new();
        for _ in 0..plan.repetitions {
            kv.clear();
            runs.push(n as f64 / prefill(model, &ids, &mut kv)?);
        }
        prefill_figs.push(Figure {
            tokens: n,
            context: 0,
            tokens_per_second: median(&runs),
            runs,
            bytes_per_token: None,
            gbs: None,
        });
    }

    let decode = if plan.decode_tokens > 0 {
        let ctx_ids = tokens(plan.decode_context, vocab, 7);
        let next = tokens(plan.decode_tokens, vocab, 11);
        let mut runs = Vec::new();
        for _ in 0..plan.repetitions {
            kv.clear();
            prefill(model, &ctx_ids, &mut kv)?;
            let start = Instant::now();
            for (i, &t) in next.iter().enumerate() {
                let pos = (plan.decode_context + i) as i32;
                model.forward(&[t], &[pos], &mut kv, Logits::Last)?;
            }
            runs.push(plan.decode_tokens as f64 / start.elapsed().as_secs_f64());
        }
        let bytes = model.decode_bytes(plan.decode_context + plan.decode_tokens / 2);
        let tokens_per_second = median(&runs);
        Some(Figure {
            tokens: plan.decode_tokens,
            context: plan.decode_context,
            tokens_per_second,
            runs,
            bytes_per_token: Some(bytes),
            gbs: Some(bytes as f64 * tokens_per_second / 1e9),
        })
    } else {
        None
    };

    Ok(BenchReport {
        model: model_name.to_owned(),
        threads: model.threads(),
        kernels: engram_kernels::kernels_in_use(),
        model_load_ms: load_ms,
        prefill: prefill_figs,
        decode,
        peak_rss_mib: peak_rss_mib(),
    })
}

/// The process's peak resident set size (`VmHWM`), in MiB; 0 where /proc is unavailable.
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Prints the report as a table.
pub fn print_table(r: &BenchReport) {
    println!("model        {}", r.model);
    println!("threads      {}", r.threads);
    println!("kernels      {}", r.kernels);
    println!("load         {:.0} ms", r.model_load_ms);
    println!("{:<24} {:>10}", "test", "tokens/s");
    for f in &r.prefill {
        println!(
            "{:<24} {:>10.1}",
            format!("prefill {}", f.tokens),
            f.tokens_per_second
        );
    }
    if let Some(d) = &r.decode {
        println!(
            "{:<24} {:>10.1}",
            format!("decode {} @ {}", d.tokens, d.context),
            d.tokens_per_second
        );
        if let (Some(bytes), Some(gbs)) = (d.bytes_per_token, d.gbs) {
            println!(
                "decode reads {:.1} MiB a token: {gbs:.1} GB/s",
                bytes as f64 / (1 << 20) as f64
            );
        }
    }
    println!("peak RSS     {:.1} MiB", r.peak_rss_mib);
}

/// Bytes the read-bandwidth probe streams through: far beyond any last-level cache.
pub const READ_PROBE_BYTES: usize = 1 << 30;

/// What [`read_bandwidth`] measured.
#[derive(serde::Serialize)]
pub struct Bandwidth {
    pub threads: usize,
    pub buffer_mib: usize,
    /// GB/s (10^9 bytes) of each pass; the best is the figure.
    pub runs: Vec<f64>,
    pub read_gbs: f64,
}

/// The machine's memory read bandwidth as decode sees it, STREAM-like: `threads` threads each
/// sum their share of a [`READ_PROBE_BYTES`] buffer (written first, so every page is real), with
/// eight independent accumulators so the loads, not the adds, set the pace. The best of `passes`
/// passes. Run apart from `engram bench`'s other figures: the buffer would count in their peak
/// RSS.
pub fn read_bandwidth(threads: usize, passes: usize) -> Bandwidth {
    let threads = threads.max(1);
    let words = READ_PROBE_BYTES / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads);
    let mut runs = Vec::with_capacity(passes);
    for _ in 0..passes.max(1) {
        let start = Instant::now();
        let total: u64 = std::thread::scope(|scope| {
            let workers: Vec<_> = buffer
                .chunks(share)
                .map(|part| scope.spawn(move || sum_words(part)))
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap_or(0))
                .fold(0, u64::wrapping_add)
        });
        std::hint::black_box(total);
        runs.push(READ_PROBE_BYTES as f64 / start.elapsed().as_secs_f64() / 1e9);
    }
    let read_gbs = runs.iter().copied().fold(0.0, f64::max);
    Bandwidth {
        threads,
        buffer_mib: READ_PROBE_BYTES >> 20,
        runs,
        read_gbs,
    }
}

fn sum_words(words: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let mut lanes = words.chunks_exact(8);
    for block in &mut lanes {
        for (a, w) in acc.iter_mut().zip(block) {
            *a = a.wrapping_add(*w);
        }
    }
    let tail = lanes
        .remainder()
        .iter()
        .fold(0, |a: u64, w| a.wrapping_add(*w));
    acc.iter().fold(tail, |a, w| a.wrapping_add(*w))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn word_sums_cover_every_word() {
        let words: Vec<u64> = (1..=1001).collect();
        assert_eq!(sum_words(&words), 1001 * 1002 / 2);
        assert_eq!(sum_words(&[]), 0);
    }
}
