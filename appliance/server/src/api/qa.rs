//! `/api/v1/qa`: retrieve, fused prefill, decode; JSON, or server-sent events (`token`,
//! `citations`, `timings`, `done`, or `error`).

use std::convert::Infallible;
use std::time::Instant;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engram_fusion::Policy;
use futures_util::stream::{self, Stream};
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::api::search::{retrieve, Hit, Mode};
use crate::api::{AppState, Caller, Json};
use crate::auth::Scope;
use crate::engine::{Event, Prompt, Summary};
use crate::error::ApiError;

/// Chunks retrieved into the prompt when the request does not say (as `engram ask`).
pub const DEFAULT_QA_TOP_K: usize = 5;
/// Tokens generated when the request does not say.
pub const DEFAULT_QA_MAX_TOKENS: usize = 256;

/// A question.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct QaBody {
    pub question: String,
    pub collections: Vec<String>,
    pub top_k: Option<usize>,
    /// `full`, `reuse`, `boundary:N`, `deviation:R` or `query:R`; the configured policy by default.
    pub policy: Option<String>,
    pub max_tokens: Option<usize>,
    /// 0 (the default) is greedy.
    #[serde(default)]
    pub temperature: f32,
    #[serde(default)]
    pub seed: u64,
    /// Logit bias towards going on with a number or a character the way the retrieved passages
    /// write it (0 turns it off, at most 10); the configured `answers.copy_bias` by default.
    pub copy_bias: Option<f32>,
    #[serde(default)]
    pub stream: bool,
}

/// A passage the answer was generated from.
#[derive(Clone, Debug, Serialize, ToSchema)]
pub struct Citation {
    /// 1-based, in prompt order.
    pub n: usize,
    pub collection: String,
    pub doc_id: u64,
    pub doc_name: String,
    pub chunk_id: u64,
    pub chars: [usize; 2],
    pub page: Option<u32>,
    pub score: f32,
}

/// A non-streamed answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct QaResponse {
    pub answer: String,
    /// The fusion policy the prefill ran under (`full` when fusion did not apply), or `none`
    /// when no retrieved passage was about the question and the answer ("I don't know") was
    /// not generated.
    pub policy: String,
    pub fusion_disabled: Option<String>,
    pub prompt_tokens: usize,
    pub finish_reason: String,
    pub citations: Vec<Citation>,
    /// Stage timings in milliseconds (retrieve, KV load, recompute, prefill, first token, first
    /// visible text (`first_visible_ms`: a held-back answer start shows after its first
    /// token), decode) and counts; `no_relevant_passages: true` when nothing retrieved was about the
    /// question, `evidence_sentence_answer: true` when the answer is the evidence sentence,
    /// quoted from the cited passages: the model wrote no answer, or its answer started with
    /// what the sentence does not support (a number in its first words that neither the
    /// sentence nor the question states, a bare yes or no), or it lacks the kind of value the
    /// question asks for and the sentence holds (an email address, a length of time, a date, a
    /// number, or the number the sentence gives what a "how many" question counts), or most of
    /// its own words are in no retrieved passage. `answer_rules` lists the answer rules that
    /// changed the answer's text by name (`lead`, `empty`, `cut_label`, `echo`, `wanted_value`,
    /// `counted_number`, `ungrounded`, `unstated_number`, `bare_polar`, `repeating`; empty when
    /// none did).
    #[schema(value_type = Object)]
    pub timings: serde_json::Value,
}

/// What an answer is built from ([`grounded`]).
pub struct Grounded {
    /// The hits prompted with, which are the citations.
    pub hits: Vec<Hit>,
    /// The evidence sentence the embedder chose ([`engram_rag::Grounded::evidence`]); `None`
    /// leaves the choice to the question's terms.
    pub evidence: Option<String>,
}

impl Grounded {
    /// The engine's prompt of `question`.
    pub fn prompt(self, question: String) -> Prompt {
        Prompt::Rag {
            question,
            passages: self.hits.into_iter().map(|h| h.text).collect(),
            evidence: self.evidence,
        }
    }
}

/// The hits an answer to `question` is built from, and its evidence sentence: `engram-rag`'s
/// [`engram_rag::ground`] (the relevance floors, distinct and same-language hits, the
/// embedder's evidence choice), run on the knowledge base's thread, which holds the embedder.
/// No hits: nothing relevant was found. The citations are the hits kept.
pub async fn grounded(s: &AppState, question: &str, hits: Vec<Hit>) -> Result<Grounded, ApiError> {
    let q = question.to_owned();
    let g =
        s.kb.call(move |kb| engram_rag::ground(kb.models(), &q, hits))
            .await??;
    Ok(Grounded {
        hits: g.hits,
        evidence: g.evidence,
    })
}

impl engram_rag::Passage for Hit {
    fn text(&self) -> &str {
        &self.text
    }

    fn dense(&self) -> Option<f32> {
        self.dense
    }
}

pub fn citations(hits: &[Hit]) -> Vec<Citation> {
    hits.iter()
        .enumerate()
        .map(|(i, h)| Citation {
            n: i + 1,
            collection: h.collection.clone(),
            doc_id: h.document.id,
            doc_name: h.document.name.clone(),
            chunk_id: h.chunk_id,
            chars: h.span.chars,
            page: h.span.page,
            score: h.score,
        })
        .collect()
}

/// Checks the numbers a generation request carries.
pub fn check_generation(s: &AppState, max_tokens: usize, temperature: f32) -> Result<(), ApiError> {
    if max_tokens == 0 || max_tokens > s.limits.max_tokens {
        return Err(ApiError::invalid(
            "max_tokens",
            format!("{max_tokens} is outside 1..={}", s.limits.max_tokens),
        ));
    }
    if !(temperature.is_finite() && (0.0..=2.0).contains(&temperature)) {
        return Err(ApiError::invalid(
            "temperature",
            format!("{temperature} is outside 0..=2"),
        ));
    }
    Ok(())
}

pub(crate) fn with_retrieve(mut timings: serde_json::Value, retrieve_ms: f64) -> serde_json::Value {
    if let Some(o) = timings.as_object_mut() {
        o.insert("retrieve_ms".into(), retrieve_ms.into());
    }
    timings
}

/// Answers a question from the collections. Scope `qa`.
#[utoipa::path(post, path = "/api/v1/qa", tag = "qa", request_body = QaBody,
    responses((status = 200, body = QaResponse, description = "JSON, or text/event-stream when `stream` is true"),
        (status = 429, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn qa(
    State(s): State<AppState>,
    caller: Caller,
    Json(b): Json<QaBody>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Qa)?;
    let max_tokens = b.max_tokens.unwrap_or(DEFAULT_QA_MAX_TOKENS);
    check_generation(&s, max_tokens, b.temperature)?;
    let policy: Option<Policy> = b
        .policy
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(|e: engram_fusion::FusionError| ApiError::invalid("policy", e.to_string()))?;
    if let Some(bias) = b.copy_bias {
        engram_rag::check_copy_bias(bias).map_err(|e| ApiError::invalid("copy_bias", e))?;
    }
    if b.question.trim().is_empty() {
        return Err(ApiError::invalid("question", "must not be empty"));
    }
    s.limits.check_query("question", &b.question)?;
    let t = Instant::now();
    let hits = retrieve(
        &s,
        &caller,
        &b.collections,
        &b.question,
        b.top_k.unwrap_or(DEFAULT_QA_TOP_K),
        Mode::Hybrid,
        &Default::default(),
    )
    .await?;
    let grounded = grounded(&s, &b.question, hits).await?;
    let retrieve_ms = t.elapsed().as_secs_f64() * 1e3;
    let cites = citations(&grounded.hits);
    let rx = s.engine.submit(
        "qa",
        grounded.prompt(b.question.clone()),
        max_tokens,
        crate::engine::Sampling {
            copy_bias: b.copy_bias,
            ..crate::engine::Sampling::new(b.temperature, b.seed)
        },
        policy,
    )?;
    if !b.stream {
        let (answer, sum) = crate::engine::collect(rx).await?;
        return Ok(axum::Json(response(answer, sum, cites, retrieve_ms)).into_response());
    }
    Ok(Sse::new(sse_stream(rx, cites, retrieve_ms))
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn response(
    answer: String,
    sum: Summary,
    citations: Vec<Citation>,
    retrieve_ms: f64,
) -> QaResponse {
    QaResponse {
        answer: answer.trim().to_owned(),
        policy: sum.policy,
        fusion_disabled: sum.fusion_disabled,
        prompt_tokens: sum.prompt_tokens,
        finish_reason: sum.finish_reason.to_owned(),
        citations,
        timings: with_retrieve(sum.timings, retrieve_ms),
    }
}

fn json_event(name: &str, data: &serde_json::Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

/// Tokens as they come, then citations, timings and done; an engine error ends the stream
/// with an `error` event carrying the usual error body. Dropping the stream (client gone)
/// drops the receiver, which cancels the job at its next token.
fn sse_stream(
    rx: tokio::sync::mpsc::Receiver<Event>,
    cites: Vec<Citation>,
    retrieve_ms: f64,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(Some((rx, cites)), move |state| async move {
        let (mut rx, cites) = state?;
        match rx.recv().await {
            Some(Event::Token(t)) => Some((
                vec![json_event("token", &serde_json::json!({"text": t}))],
                Some((rx, cites)),
            )),
            Some(Event::Done(sum)) => {
                let done = serde_json::json!({
                    "finish_reason": sum.finish_reason,
                    "policy": sum.policy,
                    "fusion_disabled": sum.fusion_disabled,
                    "prompt_tokens": sum.prompt_tokens,
                    "generated_tokens": sum.generated_tokens,
                });
                Some((
                    vec![
                        json_event("citations", &serde_json::to_value(&cites).expect("json")),
                        json_event("timings", &with_retrieve(sum.timings, retrieve_ms)),
                        json_event("done", &done),
                    ],
                    None,
                ))
            }
            // Not asked for here.
            Some(Event::Logprobs(_)) => Some((Vec::new(), Some((rx, cites)))),
            Some(Event::Error(e)) => Some((vec![json_event("error", &e.body())], None)),
            None => Some((
                vec![json_event(
                    "error",
                    &ApiError::internal("the engine dropped the job").body(),
                )],
                None,
            )),
        }
    })
    .flat_map(|events| stream::iter(events.into_iter().map(Ok)))
}
