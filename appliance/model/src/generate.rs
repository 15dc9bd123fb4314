//! The generation loop: chunked prefill, then decode with sampling, streaming text, stopping on
//! end-of-generation tokens and stop strings.

use std::time::{Duration, Instant};

use engram_tokenizer::{Detokenizer, Tokenizer};

use crate::error::Result;
use crate::kv::KvCache;
use crate::model::{Logits, Model};
use crate::sampling::{top_k, Sampler, SamplingParams};

/// Prompt tokens per forward call during prefill. Bounds the activations held at once (like
/// llama.cpp's 512-token micro-batch) while keeping weight reuse high.
pub const PREFILL_CHUNK: usize = 512;

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The full prompt's token ids. A cache that already holds a prefix of them is reused.
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends when the text produced contains one of these (the stop string itself is
    /// not returned).
    pub stop_strings: Vec<String>,
    /// Keep generating past end-of-generation tokens (the golden files record 32 tokens
    /// regardless of EOG).
    pub ignore_eos: bool,
}

/// Why generation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-generation token.
    Eog,
    /// A stop string appeared.
    Stop,
    /// `max_tokens` were produced.
    Length,
    /// The callback asked to stop (e.g. the client went away).
    Cancelled,
}

/// Timings of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache instead of being recomputed.
    pub cached_prompt_tokens: usize,
    pub generated_tokens: usize,
    pub prefill: Duration,
    /// From the start of the call to the first generated token.
    pub time_to_first_token: Duration,
    pub decode: Duration,
}

impl GenerationStats {
    /// Decode speed in tokens per second (tokens after the first over the decode time).
    pub fn decode_tokens_per_second(&self) -> f64 {
        let n = self.generated_tokens.saturating_sub(1);
        if n == 0 || self.decode.is_zero() {
            return 0.0;
        }
        n as f64 / self.decode.as_secs_f64()
    }

    /// Prefill speed in tokens per second.
    pub fn prefill_tokens_per_second(&self) -> f64 {
        let n = self.prompt_tokens - self.cached_prompt_tokens;
        if n == 0 || self.prefill.is_zero() {
            return 0.0;
        }
        n as f64 / self.prefill.as_secs_f64()
    }
}

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish_reason: FinishReason,
    /// The five most likely next tokens at the last prompt position, `(id, logit)`.
    pub top5_last_prompt: Vec<(u32, f32)>,
    /// All logits at the last prompt position (for scoring and reference checks).
    pub last_prompt_logits: Vec<f32>,
    pub stats: GenerationStats,
}

/// Runs the prompt through `model` (reusing the longest prefix already in `kv`), then samples up
/// to `max_tokens` tokens. `on_text` receives text as it becomes valid UTF-8 and known not to be
/// part of a stop string; returning `false` cancels.
pub fn generate(
    model: &Model,
    tokenizer: &Tokenizer,
    kv: &mut KvCache,
    cached_ids: &mut Vec<u32>,
    req: &GenerateRequest,
    mut on_text: impl FnMut(&str) -> bool,
) -> Result<Generation> {
    let start = Instant::now();
    let mut sampler = Sampler::new(req.sampling.clone())?;

    // Reuse the cached prefix, but always recompute at least the last prompt token so there
    // are logits to sample from.
    let common = cached_ids
        .iter()
        .zip(&req.prompt)
        .take_while(|(a, b)| a == b)
        .count()
        .min(req.prompt.len().saturating_sub(1));
    kv.truncate(common);
    cached_ids.truncate(common);

    let mut logits = Vec::new();
    let mut pos = common;
    for chunk in req.prompt[common..].chunks(PREFILL_CHUNK) {
        let positions: Vec<i32> = (pos..pos + chunk.len()).map(|p| p as i32).collect();
        logits = model.forward(chunk, &positions, kv, Logits::Last)?;
        cached_ids.extend_from_slice(chunk);
        pos += chunk.len();
    }
    let prefill = start.elapsed();
    let top5_last_prompt = top_k(&logits, 5);
    let last_prompt_logits = logits.clone();

    let mut out = Vec::new();
    let mut detok = Detokenizer::new(tokenizer, true);
    let mut stop = StopMatcher::new(&req.stop_strings);
    let mut first_token_at = None;
    let mut finish = FinishReason::Length;
    let mut history = req.prompt.clone();
    while out.len() < req.max_tokens {
        let id = sampler.sample(&logits, &history);
        first_token_at.get_or_insert_with(|| start.elapsed());
        out.push(id);
        history.push(id);
        if tokenizer.is_eog(id) && !req.ignore_eos {
            finish = FinishReason::Eog;
            break;
        }
        let (emit, hit) = stop.push(&detok.push(id));
        if !emit.is_empty() && !on_text(&emit) {
            finish = FinishReason::Cancelled;
            break;
        }
        if hit {
            finish = FinishReason::Stop;
            break;
        }
        if out.len() == req.max_tokens {
            break;
        }
        logits = model.forward(&[id], &[pos as i32], kv, Logits::Last)?;
        cached_ids.push(id);
        pos += 1;
    }
    if finish == FinishReason::Length || finish == FinishReason::Eog {
        let rest = stop.flush();
        if !rest.is_empty() {
            on_text(&rest);
        }
    }
    let ttft = first_token_at.unwrap_or_else(|| start.elapsed());
    Ok(Generation {
        text: stop.text().to_owned(),
        stats: GenerationStats {
            prompt_tokens: req.prompt.len(),
            cached_prompt_tokens: common,
            generated_tokens: out.len(),
            prefill,
            time_to_first_token: ttft,
            decode: start.elapsed().saturating_sub(ttft),
        },
        token_ids: out,
        finish_reason: finish,
        top5_last_prompt,
        last_prompt_logits,
    })
}

/// Finds stop strings in streamed text, holding back any tail that could still become one.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Text accepted so far (never contains a stop string).
    text: String,
    /// Bytes of `text` already handed out.
    emitted: usize,
    /// A stop string was reached: `text` ends before it.
    stopped: bool,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> StopMatcher {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            text: String::new(),
            emitted: 0,
            stopped: false,
        }
    }

    /// Adds `piece`; returns the text now safe to emit and whether a stop string was hit (the
    /// text is then cut just before it).
    pub fn push(&mut self, piece: &str) -> (String, bool) {
        let search_from = self.emitted;
        self.text.push_str(piece);
        let hit = self
            .stops
            .iter()
            .filter_map(|s| {
                self.text[search_from..]
                    .find(s.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(cut) = hit {
            self.stopped = true;
            self.text.truncate(cut);
            return (self.take(self.text.len()), true);
        }
        // Hold back the longest suffix that is a prefix of some stop string.
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(&self.text[self.emitted..], s))
            .max()
            .unwrap_or(0);
        let upto = self.text.len() - hold;
        (self.take(upto), false)
    }

    /// Releases any held-back text (generation ended without a stop string).
    pub fn flush(&mut self) -> String {
        self.take(self.text.len())
    }

    /// Whether a stop string was reached.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// All accepted text.
    pub fn text(&self) -> &str {
        &self.text
    }

    fn take(&mut self, upto: usize) -> String {
        let s = self.text[self.emitted..upto].to_owned();
        self.emitted = upto;
        s
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`, on char boundaries.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    (1..stop.len().min(text.len() + 1))
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k)
                && stop.is_char_boundary(k)
                && text.ends_with(&stop[..k])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool, String) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut emitted = String::new();
        for p in pieces {
            let (e, hit) = m.push(p);
            emitted += &e;
            if hit {
                return (emitted, true, m.text().into());
            }
        }
        emitted += &m.flush();
        (emitted, false, m.text().into())
    }

    #[test]
    fn stop_string_split_across_pieces() {
        let (out, hit, text) = run(&["\nUser:"], &["Hello", "\nUs", "er:", " more"]);
        assert!(hit);
        assert_eq!(out, "Hello");
        assert_eq!(text, "Hello");
    }

    #[test]
    fn near_miss_is_released() {
        // "ST" is held back until "OX" shows it was not the stop string.
        let stops = vec!["STOP".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("a ST"), ("a ".to_string(), false));
        assert_eq!(m.push("OX"), ("STOX".to_string(), false));
        let (out, hit, _) = run(&["STOP"], &["a ST", "x"]);
        assert!(!hit);
        assert_eq!(out, "a STx");
    }

    #[test]
    fn no_stops_streams_everything() {
        let (out, hit, _) = run(&[], &["a", "b"]);
        assert!(!hit);
        assert_eq!(out, "ab");
    }

    #[test]
    fn multibyte_stop() {
        let (out, hit, _) = run(&["。"], &["你好", "。再见"]);
        assert!(hit);
        assert_eq!(out, "你好");
    }
}
