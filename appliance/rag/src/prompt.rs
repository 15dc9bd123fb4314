//! The RAG prompt with its evidence sentence: `engram-fusion` lays the passages out in the
//! frame their KV was computed in ([`engram_fusion::build_prompt`]); the sentence repeated
//! after them is chosen here.

use engram_fusion::{build_prompt, FusedPrompt, Layout, DEFAULT_LAYOUT};
use engram_tokenizer::{ChatTemplate, Tokenizer};

use crate::evidence::evidence_within;

/// The fused prompt of `passages` (retrieved, in rank order, best first) in the default layout
/// (see [`rag_prompt_with`]), the evidence sentence chosen by the question's terms.
pub fn rag_prompt<P: AsRef<str>>(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    system: &str,
    passages: &[P],
    question: &str,
) -> engram_tokenizer::Result<FusedPrompt> {
    rag_prompt_with(
        DEFAULT_LAYOUT,
        tokenizer,
        template,
        system,
        passages,
        question,
        None,
    )
}

/// The fused prompt of `passages` asking `question` in `layout` ([`build_prompt`]), with the
/// evidence sentence where the layout shows one: `chosen` (the embedder's choice,
/// [`crate::Grounded::evidence`]), or with `None` the sentence that shares the most of the
/// question's rarer terms ([`evidence_within`]; ties go to the better-ranked passage).
pub fn rag_prompt_with<P: AsRef<str>>(
    layout: Layout,
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    system: &str,
    passages: &[P],
    question: &str,
    chosen: Option<&str>,
) -> engram_tokenizer::Result<FusedPrompt> {
    let shown = !layout.evidence.is_empty() || !layout.evidence_zh.is_empty();
    let evidence = match chosen {
        _ if !shown => None,
        Some(e) => Some(e.to_owned()),
        None => evidence_within(
            question.trim(),
            passages.iter().map(AsRef::as_ref),
            layout.evidence_max_chars,
        ),
    };
    build_prompt(
        layout,
        tokenizer,
        template,
        system,
        passages,
        question,
        evidence.as_deref(),
    )
}
