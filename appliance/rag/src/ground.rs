//! Grounding: which retrieved passages a question is answered from, and the evidence sentence
//! its prompt repeats. engramd (QA, chat with collections, the console's chat), `engram ask`
//! and `engram eval qa` all ground through [`ground`].

use engram_fusion::DEFAULT_LAYOUT;
use engram_kb::Models;

use crate::answer::{relevant, relevant_sentence, sentences_to_embed};
use crate::dedup::{retain_distinct, retain_language};
use crate::error::Result;
use crate::evidence::{evidence_to_embed, nearest_evidence};

/// A retrieved passage as grounding reads it.
pub trait Passage {
    /// The passage's text.
    fn text(&self) -> &str;
    /// Its cosine similarity to the question, when the dense index ranked it.
    fn dense(&self) -> Option<f32>;
}

impl Passage for engram_kb::SearchHit {
    fn text(&self) -> &str {
        &self.text
    }

    fn dense(&self) -> Option<f32> {
        self.dense
    }
}

/// What an answer is built from.
#[derive(Debug, Clone)]
pub struct Grounded<H> {
    /// The hits the prompt holds, in rank order (the citations); empty when the question is
    /// refused ([`Grounded::refused`]).
    pub hits: Vec<H>,
    /// The evidence sentence the embedder chose ([`nearest_evidence`]); `None` leaves the
    /// choice to the question's terms ([`crate::rag_prompt_with`]).
    pub evidence: Option<String>,
    /// Whether the first look ([`relevant`]) took the hits.
    pub first_look: bool,
    /// For an English question the first look refused: the best cosine similarity of a
    /// retrieved sentence ([`sentences_to_embed`], [`relevant_sentence`]).
    pub best_sentence: Option<f32>,
}

impl<H> Grounded<H> {
    /// Whether nothing retrieved is about the question: the answer is
    /// [`crate::no_answer`], without running the model.
    pub fn refused(&self) -> bool {
        self.hits.is_empty()
    }
}

/// The hits (`hits`, in rank order) an answer to `question` is built from: none when the best
/// one is not about the question ([`relevant`], then for an English question a second look at
/// the hits' sentences, [`relevant_sentence`]), so the answer says nothing relevant was found
/// instead of the model inventing one from unrelated passages. Otherwise every hit but those
/// that mostly repeat a better-ranked one ([`retain_distinct`]: the same text twice adds no
/// fact, costs prefill and makes fused prefill drift from full prefill) and those in another
/// language than the question when some are in its language ([`retain_language`]), with the
/// evidence sentence chosen by the embedder among those near the best term score
/// ([`evidence_to_embed`], [`nearest_evidence`]). Both looks that need the embedder are one
/// call of `models`.
pub fn ground<H: Passage>(
    models: &Models,
    question: &str,
    mut hits: Vec<H>,
) -> Result<Grounded<H>> {
    let best = hits.iter().filter_map(Passage::dense).reduce(f32::max);
    let first = relevant(question, best, hits.iter().map(Passage::text));
    let refused = |best_sentence| Grounded {
        hits: Vec::new(),
        evidence: None,
        first_look: false,
        best_sentence,
    };
    let second: Vec<String> = if first {
        Vec::new()
    } else {
        let sentences = sentences_to_embed(question, hits.iter().map(Passage::text));
        if sentences.is_empty() {
            return Ok(refused(None));
        }
        sentences.into_iter().map(str::to_owned).collect()
    };
    retain_distinct(&mut hits, Passage::text);
    retain_language(question, &mut hits, Passage::text);
    let candidates = evidence_to_embed(
        question,
        hits.iter().map(Passage::text),
        DEFAULT_LAYOUT.evidence_max_chars,
    );
    if second.is_empty() && candidates.is_empty() {
        return Ok(Grounded {
            hits,
            evidence: None,
            first_look: first,
            best_sentence: None,
        });
    }
    let all: Vec<&str> = second
        .iter()
        .chain(&candidates)
        .map(String::as_str)
        .collect();
    let cosines = models.similarities(question, &all)?;
    let n = second.len();
    let best_sentence = (!first)
        .then(|| cosines[..n].iter().copied().reduce(f32::max))
        .flatten();
    if !first && !relevant_sentence(best_sentence) {
        return Ok(refused(best_sentence));
    }
    Ok(Grounded {
        hits,
        evidence: nearest_evidence(candidates, &cosines[n..]),
        first_look: first,
        best_sentence,
    })
}
