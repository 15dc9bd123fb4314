//! The RAG prompt as segments: the chat template rendered around a marker and split there,
//! so the chunks' stored token ids sit between an exact prefix and the question.

use engram_tokenizer::{ChatTemplate, Message, Tokenizer};

use crate::fuse::FusedPrompt;

/// System prompt of question answering over passages.
pub const DEFAULT_SYSTEM: &str =
    "You are a helpful assistant. Answer the question using only the given passages.";

/// What follows the passages: CacheBlend's MuSiQue instruction, then the question.
pub const QUESTION_INSTRUCTION: &str = "Answer the question directly based on the given passages. Do NOT repeat the question. The answer should be within 5 words.\nQuestion: ";

/// Where the chunks go in the rendered template (a string no user text contains).
const MARKER: &str = "\u{1}ENGRAM-CHUNKS\u{1}";

/// A chunk's text as it appears in the prompt (followed by a blank line); tokenize it once,
/// at ingestion, and store the ids with the chunk's KV.
pub fn chunk_text(text: &str) -> String {
    format!("{}\n\n", text.trim_end())
}

/// Token ids of a chunk as the prompt holds them.
pub fn chunk_tokens(tokenizer: &Tokenizer, text: &str) -> engram_tokenizer::Result<Vec<u32>> {
    tokenizer.encode(&chunk_text(text), false)
}

/// The frame chunks are computed in by default: the RAG prompt's own prefix (chat template,
/// default system prompt, "Passages:"). Each chunk then sees at its start what it sees in a
/// real prompt: the same attention sink at position 0 and the same instructions, and the first
/// chunk of a prompt with the default system prompt is exact. Measured against the BOS-only
/// and empty frames in `docs/bench/` (`engram eval fusion --frame`).
pub fn rag_frame(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
) -> engram_tokenizer::Result<Vec<u32>> {
    Ok(rag_prompt(tokenizer, template, DEFAULT_SYSTEM, Vec::new(), "")?.prefix)
}

/// Builds the fused prompt: `template` applied to a system message and a user message made of
/// "Passages:", the chunks and the question, with the generation prompt. Without a template,
/// a plain "Passages: ... Answer:" layout is used.
pub fn rag_prompt(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    system: &str,
    chunks: Vec<Vec<u32>>,
    question: &str,
) -> engram_tokenizer::Result<FusedPrompt> {
    let user = format!(
        "Passages:\n{MARKER}{QUESTION_INSTRUCTION}{}",
        question.trim()
    );
    let rendered = match template {
        Some(t) => t.render(
            &[Message::new("system", system), Message::new("user", user)],
            true,
        )?,
        None => format!("{system}\n\n{user}\nAnswer:"),
    };
    let (before, after) = rendered
        .split_once(MARKER)
        .unwrap_or((rendered.as_str(), ""));
    // BOS as the model asks for it, unless the template wrote it already.
    let mut prefix = tokenizer.encode(before, true)?;
    if let Some(bos) = tokenizer.bos_id().filter(|_| tokenizer.add_bos()) {
        if prefix.first() != Some(&bos) {
            prefix.insert(0, bos);
        }
    }
    Ok(FusedPrompt {
        prefix,
        chunks,
        suffix: tokenizer.encode(after, true)?,
    })
}
