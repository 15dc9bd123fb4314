//! A RAG answer's generation: its output text and copy bias set up from its prompt
//! ([`Answering`], which engramd's batched engine and [`generate`] share), and the one-sequence
//! decode loop `engram ask` and `engram eval qa` run.

use std::time::{Duration, Instant};

use engram_fusion::{fused_prefill, ChunkStore, FuseStats, FusedPrompt, Policy};
use engram_model::{Logits, Model, Sampler, SamplingParams};
use engram_tokenizer::{Detokenizer, Tokenizer};

use crate::answer::{AnswerRules, OutputText};
use crate::copy::CopyBias;
use crate::error::Result;

/// How an answer's text is made and cleaned: engramd's `[answers]` settings, `engram ask`'s
/// flags.
#[derive(Debug, Clone, Copy)]
pub struct AnswerOptions {
    /// The bias of the answer's tokens towards the passages' spelling ([`CopyBias`]; 0: off).
    pub copy_bias: f32,
    /// Whether an answer's start is checked against the evidence sentence
    /// ([`OutputText::check_start`]).
    pub check_start: bool,
    /// The answer rules turned off ([`OutputText::rules_off`]).
    pub rules_off: AnswerRules,
}

/// A RAG answer's way out: its text cleaned and cut ([`OutputText`]) and its logits biased
/// towards the passages ([`CopyBias`]), both set up from the prompt the model reads.
#[derive(Debug)]
pub struct Answering {
    pub out: OutputText,
    pub copy: Option<CopyBias>,
}

impl Answering {
    /// The answer to `question` from `prompt` (built from `passages`), also cut at `stops`:
    /// the evidence sentence the prompt shows stands in for an answer the model does not give
    /// ([`OutputText::or_sentence`]), and the passages' words judge its start
    /// ([`OutputText::from_passages`]).
    pub fn new<P: AsRef<str>>(
        prompt: &FusedPrompt,
        tokenizer: &Tokenizer,
        question: &str,
        passages: &[P],
        stops: &[String],
        opts: AnswerOptions,
    ) -> Answering {
        let mut out = OutputText::answer(question, stops);
        out.or_sentence(&prompt.evidence_text);
        out.from_passages(passages.iter().map(AsRef::as_ref));
        out.check_start(opts.check_start);
        out.rules_off(opts.rules_off);
        Answering {
            out,
            copy: CopyBias::from_prompt(prompt, tokenizer, opts.copy_bias),
        }
    }
}

/// A generated answer.
#[derive(Debug)]
pub struct Generated {
    /// The answer up to the first stop string.
    pub text: String,
    /// Whether the model wrote no answer and `text` is the evidence sentence
    /// ([`OutputText::or_sentence`]).
    pub fell_back: bool,
    /// The answer rules that changed the answer.
    pub rules: AnswerRules,
    pub prefilled: FuseStats,
    /// From the start of the prefill to the first token.
    pub first_token: Duration,
    pub decode: Duration,
    pub generated: usize,
}

/// Prefills `prompt` (built from `passages` to ask `question`) under `policy` and decodes an
/// answer at `temperature` (greedy at 0) until the end-of-generation token, the end of the
/// answer ([`OutputText`]: a stop string, the answer repeating itself) or `max_tokens`, its
/// text made as [`Answering`] makes engramd's; `on_piece` gets the text as it becomes final,
/// as engramd streams it.
#[allow(clippy::too_many_arguments)]
pub fn generate<P: AsRef<str>>(
    model: &Model,
    tokenizer: &Tokenizer,
    store: &ChunkStore,
    prompt: &FusedPrompt,
    question: &str,
    passages: &[P],
    policy: Policy,
    max_tokens: usize,
    temperature: f32,
    opts: AnswerOptions,
    on_piece: &mut dyn FnMut(&str),
) -> Result<Generated> {
    let started = Instant::now();
    let mut kv = model.new_cache(prompt.len() + max_tokens + 1);
    let done = fused_prefill(model, store, None, prompt, policy, &mut kv)?;
    let mut sampler = Sampler::new(SamplingParams {
        temperature,
        ..SamplingParams::default()
    })?;
    let Answering { mut out, copy } =
        Answering::new(prompt, tokenizer, question, passages, &[], opts);
    let mut history = prompt.tokens();
    let prompt_len = history.len();
    let mut detok = Detokenizer::new(tokenizer, true);
    let mut logits = done.logits;
    let decode_start = Instant::now();
    let mut first_token = None;
    let mut generated = 0;
    let mut stopped = false;
    for (i, pos) in (done.next_position..).take(max_tokens).enumerate() {
        if let Some(c) = &copy {
            c.apply(&history[prompt_len..], &mut logits);
        }
        let id = sampler.sample(&logits, &history);
        first_token.get_or_insert_with(|| started.elapsed());
        if tokenizer.is_eog(id) {
            break;
        }
        generated += 1;
        history.push(id);
        let (piece, ended) = out.push(&detok.push(id));
        on_piece(&piece);
        if ended {
            stopped = true;
            break;
        }
        if i + 1 < max_tokens {
            logits = model.forward(&[id], &[pos], &mut kv, Logits::Last)?;
        }
    }
    if !stopped {
        on_piece(&out.finish().0);
    }
    Ok(Generated {
        text: out.text().to_owned(),
        fell_back: out.fell_back(),
        rules: out.rules_fired(),
        prefilled: done.stats,
        first_token: first_token.unwrap_or_default(),
        decode: decode_start.elapsed(),
        generated,
    })
}
