//! One answer pipeline: from a question and its retrieved hits to a cited answer, the same
//! for engramd (QA, chat with collections, the console's chat), `engram ask` and `engram eval
//! qa`.
//!
//! - [`ground`]: which hits the answer is built from (relevance floors, distinct and
//!   same-language hits) and the evidence sentence the embedder chooses.
//! - [`rag_prompt_with`]: the prompt, with its evidence sentence, laid out by `engram-fusion`
//!   in the frame the chunks' KV was computed in.
//! - [`Answering`] and [`generate`]: the fused prefill call, decoding, and the answer's text
//!   ([`OutputText`], the [`AnswerRule`]s, the [`CopyBias`]).
//!
//! The modules depend one way: `text` (words, stems, sentences) under `dedup`, `answer` and
//! `evidence`; `answer` under `evidence`; all of them under `ground`, `prompt` and `generate`.
#![forbid(unsafe_code)]

mod answer;
mod copy;
mod dedup;
mod error;
mod evidence;
mod generate;
mod ground;
mod prompt;
mod text;

pub use answer::{
    best_coverage, best_term_coverage, no_answer, not_answered, question_coverage, relevant,
    relevant_sentence, sentences_to_embed, AnswerRule, AnswerRules, OutputText, ANSWER_STOPS,
    COVERAGE_FLOOR, DENSE_FLOOR, MAX_CHECKED_SENTENCES, SENTENCE_FLOOR, TERM_COVERAGE_FLOOR,
};
pub use copy::{check_copy_bias, ends_number, CopyBias, DEFAULT_COPY_BIAS, MAX_COPY_BIAS};
pub use dedup::{retain_distinct, retain_language, REDUNDANT_SHARE};
pub use error::{RagError, Result};
pub use evidence::{
    evidence, evidence_candidates, evidence_to_embed, evidence_within, nearest_evidence, Candidate,
    EVIDENCE_NEAR_SHARE, MAX_EVIDENCE_CANDIDATES,
};
pub use generate::{generate, AnswerOptions, Answering, Generated};
pub use ground::{ground, Grounded, Passage};
pub use prompt::{rag_prompt, rag_prompt_with};
