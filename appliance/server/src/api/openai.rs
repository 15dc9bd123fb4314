//! The OpenAI-compatible API: `/v1/models`, `/v1/chat/completions` (JSON or `data:` chunks
//! ending with `data: [DONE]`; an optional `engram` object turns on retrieval and adds
//! `citations`), `/v1/completions` (text continued as it is), `/v1/embeddings`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use engram_model::SamplingParams;
use futures_util::stream::{self, Stream};
use futures_util::StreamExt;
use serde::Deserialize;
use utoipa::ToSchema;

use crate::api::qa::{check_generation, citations, with_retrieve, Citation};
use crate::api::search::{retrieve, Mode};
use crate::api::{AppState, Caller, Json};
use crate::auth::Scope;
use crate::engine::{Event, Prompt, TokenLogprob};
use crate::error::ApiError;

/// Tokens generated when the request does not say.
pub const DEFAULT_CHAT_MAX_TOKENS: usize = 256;
/// Inputs one embeddings request may carry.
pub const MAX_EMBED_INPUTS: usize = 256;

#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatMessage {
    /// `system`, `developer`, `user`, `assistant` or `tool`.
    pub role: String,
    /// A string, or an array of `{"type": "text", "text": ...}` parts (null for an assistant
    /// message that only calls tools).
    #[schema(value_type = Object)]
    #[serde(default)]
    pub content: serde_json::Value,
    /// An assistant's earlier tool calls, shown to the model again as the JSON it wrote. (A
    /// `tool` message's `tool_call_id` is not needed: an answer makes one call at most.)
    #[schema(value_type = Object)]
    pub tool_calls: Option<serde_json::Value>,
}

/// Engram's extension: retrieval before the answer.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct EngramOptions {
    pub collections: Vec<String>,
    pub top_k: Option<usize>,
    pub policy: Option<String>,
}

/// `stream_options`.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct StreamOptions {
    /// A last chunk with `usage` (and no choices) before `[DONE]`.
    #[serde(default)]
    pub include_usage: bool,
}

/// OpenAI's chat request. Every parameter OpenAI defines is either honoured or, with a value
/// that would change the answer in a way Engram does not implement, refused with a 400 that
/// names it; an unknown parameter is refused as OpenAI refuses it.
#[derive(Debug, Deserialize, ToSchema)]
pub struct ChatRequest {
    /// `engram`, the served model's id, or absent.
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    pub max_tokens: Option<usize>,
    /// Takes precedence over `max_tokens`.
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    /// Nucleus sampling, in (0, 1]; 1 (the default) disables it.
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    /// Up to 4 strings: the answer ends before the first of them (`finish_reason: stop`).
    #[schema(value_type = Object)]
    pub stop: Option<serde_json::Value>,
    /// Choices to generate, 1 to 16 (default 1); choice `i` is sampled with seed `seed + i`,
    /// so at a temperature above 0 they differ and each is reproducible.
    pub n: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// True: each answer token's log probability in `choices[].logprobs.content` (and in each
    /// streamed chunk, for the tokens of its text).
    pub logprobs: Option<bool>,
    /// 0 to 20 most likely alternatives per token (needs `logprobs: true`).
    pub top_logprobs: Option<u32>,
    /// In [-2, 2]: subtracted from the logit of every token the answer already holds.
    pub presence_penalty: Option<f32>,
    /// In [-2, 2]: subtracted from a token's logit once per time the answer holds it.
    pub frequency_penalty: Option<f32>,
    /// `{"token id": bias}`, biases in [-100, 100] added to those logits; the ids are the
    /// served model's (as llama.cpp's and vLLM's servers read them), not OpenAI's.
    #[schema(value_type = Object)]
    pub logit_bias: Option<serde_json::Value>,
    /// `{"type": "text"}` (the default), `{"type": "json_object"}` or `{"type": "json_schema",
    /// "json_schema": {"name": ..., "schema": {...}}}`: the answer is held to the JSON (by
    /// constrained decoding), so it always parses and validates. A schema keyword that cannot
    /// be enforced is refused with a 400 naming it.
    #[schema(value_type = Object)]
    pub response_format: Option<engram_grammar::Json>,
    /// Functions the model may call: `[{"type": "function", "function": {"name": ...,
    /// "description": ..., "parameters": {JSON Schema}}}]`. A call is generated under the
    /// grammar of the tools' parameters (as structured output), so its arguments always parse
    /// and validate.
    #[schema(value_type = Object)]
    pub tools: Option<engram_grammar::Json>,
    /// `auto` (the default with tools: a call or a text answer, the model chooses), `none`,
    /// `required` (one call of any tool) or `{"type": "function", "function": {"name": ...}}`.
    #[schema(value_type = Object)]
    pub tool_choice: Option<serde_json::Value>,
    /// Accepted: an answer makes one call at most, which either value allows.
    #[allow(dead_code)]
    pub parallel_tool_calls: Option<bool>,
    /// The end user: logged with the request, for the caller's audits (it changes nothing, as
    /// at OpenAI).
    pub user: Option<String>,
    pub engram: Option<EngramOptions>,
    /// Anything else: refused, naming it.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub unknown: std::collections::BTreeMap<String, serde_json::Value>,
}

/// The names chat and text completions answer to: `engram` and the chat model's id.
fn chat_models(s: &AppState) -> [String; 2] {
    ["engram".to_owned(), s.engine.info.model_id.clone()]
}

/// The names `/v1/embeddings` answers to: the embedder's id (`all-MiniLM-L6-v2@0148057bd4e7`),
/// its plain name (`all-MiniLM-L6-v2`), `engram`, and the configured aliases (OpenAI's
/// embedding models by default, which clients send unless told otherwise).
fn embedding_models(s: &AppState) -> Vec<String> {
    let id = s.kb.embed_model.to_string();
    let plain = id.split_once('@').map(|(name, _)| name.to_owned());
    let mut names = vec![id];
    names.extend(plain);
    names.push("engram".to_owned());
    names.extend(s.embedding_aliases.iter().cloned());
    names
}

/// The model names `/v1/models` lists, each once: `engram`, the chat model's id, then the
/// embedder's names.
fn model_ids(s: &AppState) -> Vec<String> {
    let mut ids = chat_models(s).to_vec();
    for name in embedding_models(s) {
        if !ids.contains(&name) {
            ids.push(name);
        }
    }
    ids
}

/// 404 `model_not_found` unless `model` is one of `allowed` (absent is fine).
fn check_model(model: Option<&str>, allowed: &[String]) -> Result<(), ApiError> {
    match model {
        Some(m) if !allowed.iter().any(|a| a == m) => Err(ApiError::ModelNotFound {
            model: m.to_owned(),
        }),
        _ => Ok(()),
    }
}

/// The stop strings of `stop` (a string or up to 4 strings).
fn stop_strings(stop: Option<&serde_json::Value>) -> Result<Vec<String>, ApiError> {
    let bad = |why: &str| ApiError::invalid("stop", why.to_owned());
    let list = match stop {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::String(s)) => vec![s.clone()],
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_owned)
                    .ok_or_else(|| bad("expected strings"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(bad("expected a string or an array of up to 4 strings")),
    };
    if list.len() > 4 {
        return Err(bad("at most 4 stop sequences"));
    }
    if list.iter().any(String::is_empty) {
        return Err(bad("a stop sequence is empty"));
    }
    Ok(list)
}

/// Refuses the parameters whose values Engram does not implement, naming each; returns the
/// penalties and biases asked for.
fn check_chat(b: &ChatRequest, vocab: usize) -> Result<Shaping, ApiError> {
    let no = |param: &str, why: &str| Err(ApiError::invalid(param, why.to_owned()));
    let shaping = check_common(
        &Common {
            unknown: &b.unknown,
            n: b.n,
            presence_penalty: b.presence_penalty,
            frequency_penalty: b.frequency_penalty,
            logit_bias: b.logit_bias.as_ref(),
            top_p: b.top_p,
        },
        vocab,
    )?;
    if b.top_logprobs.is_some_and(|n| n > MAX_TOP_LOGPROBS) {
        return no("top_logprobs", "must be in 0..=20");
    }
    if b.top_logprobs.is_some_and(|n| n > 0) && b.logprobs != Some(true) {
        return no("top_logprobs", "needs `logprobs: true`");
    }
    Ok(shaping)
}

/// The grammar and the instruction for the model that `response_format` asks for; `None` for
/// plain text.
fn structured_output(
    format: Option<&engram_grammar::Json>,
) -> Result<Option<(Arc<engram_grammar::Grammar>, String)>, ApiError> {
    use engram_grammar::Json;
    let Some(format) = format else {
        return Ok(None);
    };
    let bad = |field: &str, why: String| ApiError::invalid(field, why);
    match format.get("type").and_then(Json::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some((
            Arc::new(engram_grammar::json_object()),
            "Respond only with a JSON object.".to_owned(),
        ))),
        Some("json_schema") => {
            let spec = format.get("json_schema").ok_or_else(|| {
                bad(
                    "response_format.json_schema",
                    "missing: {\"name\": ..., \"schema\": {...}}".to_owned(),
                )
            })?;
            let schema = spec.get("schema").cloned().unwrap_or(Json::Bool(true));
            let grammar = engram_grammar::compile(&schema)
                .map_err(|e| bad("response_format.json_schema.schema", e.to_string()))?;
            Ok(Some((
                Arc::new(grammar),
                format!(
                    "Respond only with JSON that matches this JSON schema: {}",
                    schema.to_json_string()
                ),
            )))
        }
        other => Err(bad(
            "response_format",
            format!(
                "type {} is not text, json_object or json_schema",
                other.map_or("(missing)".to_owned(), |t| format!("`{t}`"))
            ),
        )),
    }
}

/// The grammar and the instruction for the model that `tools` and `tool_choice` ask for;
/// `None` when no tool may be called.
fn tool_use(b: &ChatRequest) -> Result<Option<(Arc<engram_grammar::Grammar>, String)>, ApiError> {
    use engram_grammar::Json;
    let listed: &[Json] = match &b.tools {
        None | Some(Json::Null) => &[],
        Some(Json::Array(t)) => t,
        Some(_) => return Err(ApiError::invalid("tools", "expected an array of tools")),
    };
    let mut tools = Vec::with_capacity(listed.len());
    for (i, t) in listed.iter().enumerate() {
        let field = |f: &str| format!("tools[{i}].{f}");
        if t.get("type").and_then(Json::as_str) != Some("function") {
            return Err(ApiError::invalid(
                field("type"),
                "only `function` tools exist",
            ));
        }
        let f = t
            .get("function")
            .ok_or_else(|| ApiError::invalid(field("function"), "missing"))?;
        let name = f
            .get("name")
            .and_then(Json::as_str)
            .filter(|n| {
                !n.is_empty()
                    && n.len() <= 64
                    && n.bytes()
                        .all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-')
            })
            .ok_or_else(|| {
                ApiError::invalid(
                    field("function.name"),
                    "1 to 64 letters, digits, underscores or dashes",
                )
            })?;
        let parameters = f.get("parameters").cloned().unwrap_or_else(|| {
            Json::Object(vec![
                ("type".into(), Json::String("object".into())),
                ("properties".into(), Json::Object(Vec::new())),
            ])
        });
        let description = f.get("description").and_then(Json::as_str).unwrap_or("");
        tools.push((name.to_owned(), description.to_owned(), parameters));
    }
    let choice = match &b.tool_choice {
        None | Some(serde_json::Value::Null) => "auto".to_owned(),
        Some(serde_json::Value::String(c)) if ["none", "auto", "required"].contains(&c.as_str()) => {
            c.clone()
        }
        Some(c) => match c["function"]["name"].as_str() {
            Some(n) if c["type"] == "function" => {
                if !tools.iter().any(|t| t.0 == n) {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        format!("`{n}` is not one of the tools"),
                    ));
                }
                n.to_owned()
            }
            _ => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "expected none, auto, required or {\"type\": \"function\", \"function\": {\"name\": ...}}",
                ))
            }
        },
    };
    if tools.is_empty() {
        return match choice.as_str() {
            "none" | "auto" => Ok(None),
            _ => Err(ApiError::invalid(
                "tool_choice",
                "there are no tools to call",
            )),
        };
    }
    if choice == "none" {
        return Ok(None);
    }
    let callable: Vec<_> = match choice.as_str() {
        "auto" | "required" => tools.iter().collect(),
        named => tools.iter().filter(|t| t.0 == named).collect(),
    };
    let grammar = engram_grammar::tool_call(
        &callable
            .iter()
            .map(|(n, _, p)| (n.as_str(), p))
            .collect::<Vec<_>>(),
        choice == "auto",
    )
    .map_err(|e| ApiError::invalid("tools", e.to_string()))?;
    let mut instruction = String::from("You can call these tools:\n");
    for (name, description, parameters) in &callable {
        instruction.push_str(&format!(
            "- {name}: {description} Arguments (JSON schema): {}\n",
            parameters.to_json_string()
        ));
    }
    instruction.push_str(
        "To call a tool, answer only with JSON: {\"name\": <tool name>, \"arguments\": <arguments>}.",
    );
    if choice == "auto" {
        instruction.push_str(" If no tool is needed, answer in plain text.");
    }
    Ok(Some((Arc::new(grammar), instruction)))
}

/// An answer generated under a tool grammar that is a call (it starts with `{` and parses):
/// OpenAI's `tool_calls` entry, the arguments as a JSON string.
fn tool_call_of(answer: &str) -> Option<serde_json::Value> {
    let text = answer.trim();
    if !text.starts_with('{') {
        return None;
    }
    let call: serde_json::Value = serde_json::from_str(text).ok()?;
    let name = call["name"].as_str()?;
    Some(serde_json::json!({
        "id": format!("call_{:024x}", rand::random::<u128>() >> 32),
        "type": "function",
        "function": {"name": name, "arguments": call["arguments"].to_string()},
    }))
}

/// An assistant's earlier tool calls as the JSON the model writes for one (one per line).
fn calls_text(calls: &serde_json::Value) -> Result<String, ApiError> {
    let bad = || {
        ApiError::invalid(
            "messages[].tool_calls",
            "expected [{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": \"{...}\"}}]",
        )
    };
    let mut lines = Vec::new();
    for c in calls.as_array().ok_or_else(bad)? {
        let name = c["function"]["name"].as_str().ok_or_else(bad)?;
        let args = c["function"]["arguments"].as_str().ok_or_else(bad)?;
        let args: serde_json::Value =
            serde_json::from_str(args).unwrap_or_else(|_| serde_json::Value::String(args.into()));
        lines.push(serde_json::json!({"name": name, "arguments": args}).to_string());
    }
    Ok(lines.join("\n"))
}

/// Puts `instruction` in the system message (a new first one when there is none).
fn instruct(messages: &mut Vec<(String, String)>, instruction: String) {
    match messages.first_mut() {
        Some((role, content)) if role == "system" => {
            content.push_str("\n\n");
            content.push_str(&instruction);
        }
        _ => messages.insert(0, ("system".to_owned(), instruction)),
    }
}

/// The parameters chat and text completions share the rules of.
struct Common<'a> {
    unknown: &'a std::collections::BTreeMap<String, serde_json::Value>,
    n: Option<u32>,
    presence_penalty: Option<f32>,
    frequency_penalty: Option<f32>,
    logit_bias: Option<&'a serde_json::Value>,
    top_p: Option<f32>,
}

/// Most choices (`n`, `best_of`) one request may ask for: each is a sequence of the engine's
/// decode batch.
const MAX_CHOICES: u32 = 16;

/// What the shared parameters ask of the sampler.
struct Shaping {
    /// Choices to return.
    n: usize,
    presence_penalty: f32,
    frequency_penalty: f32,
    logit_bias: Vec<(u32, f32)>,
}

/// Refuses, naming it, an unknown argument, a number of choices outside 1..=[`MAX_CHOICES`], a penalty or a bias outside
/// the ranges [`SamplingParams::validate`] allows, a `logit_bias` that is not ids of the model
/// (`vocab` of them) mapped to numbers, or a `top_p` outside (0, 1]; returns the penalties and
/// biases.
fn check_common(c: &Common<'_>, vocab: usize) -> Result<Shaping, ApiError> {
    let no = |param: &str, why: String| Err(ApiError::invalid(param, why));
    if let Some(name) = c.unknown.keys().next() {
        return no(name, "unrecognized request argument".into());
    }
    let n = c.n.unwrap_or(1);
    if !(1..=MAX_CHOICES).contains(&n) {
        return no("n", format!("must be in 1..={MAX_CHOICES}"));
    }
    if let Some(p) = c.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return no("top_p", "must be in (0, 1]".into());
        }
    }
    let shaping = Shaping {
        n: n as usize,
        presence_penalty: c.presence_penalty.unwrap_or(0.0),
        frequency_penalty: c.frequency_penalty.unwrap_or(0.0),
        logit_bias: logit_bias(c.logit_bias, vocab)?,
    };
    // The engine's sampler checks these again; checked here, a bad value is a 400 before a
    // stream starts rather than an error event inside it.
    SamplingParams {
        presence_penalty: shaping.presence_penalty,
        frequency_penalty: shaping.frequency_penalty,
        logit_bias: shaping.logit_bias.clone(),
        ..SamplingParams::default()
    }
    .validate()
    .map_err(crate::engine::sampling_error)?;
    Ok(shaping)
}

/// Most alternatives per token a chat request may ask for (OpenAI's limit).
const MAX_TOP_LOGPROBS: u32 = 20;
/// Most alternatives per token a text completion may ask for (OpenAI's limit).
const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// Chat's `logprobs` content entries (OpenAI's shape: `token`, `logprob`, `bytes`,
/// `top_logprobs`). A token that is part of a UTF-8 character shows U+FFFD in `token`; its
/// `bytes` are exact.
fn chat_logprobs(tokens: &[TokenLogprob]) -> serde_json::Value {
    let entry = |bytes: &[u8], logprob: f32| {
        serde_json::json!({
            "token": String::from_utf8_lossy(bytes),
            "logprob": logprob,
            "bytes": bytes,
        })
    };
    let content: Vec<serde_json::Value> = tokens
        .iter()
        .map(|t| {
            let mut e = entry(&t.bytes, t.logprob);
            e["top_logprobs"] = t.top.iter().map(|(b, l)| entry(b, *l)).collect();
            e
        })
        .collect();
    serde_json::json!({ "content": content })
}

/// Text completions' `logprobs` (`tokens`, `token_logprobs`, `top_logprobs` as objects of
/// token to log probability, `text_offset` in characters from the prompt's start), for the
/// tokens after the first `offset` characters.
fn text_logprobs(tokens: &[TokenLogprob], offset: &mut usize) -> serde_json::Value {
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let mut offsets = Vec::with_capacity(tokens.len());
    for t in tokens {
        offsets.push(*offset);
        *offset += text(&t.bytes).chars().count();
    }
    serde_json::json!({
        "tokens": tokens.iter().map(|t| text(&t.bytes)).collect::<Vec<_>>(),
        "token_logprobs": tokens.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": tokens
            .iter()
            .map(|t| {
                // An echoed prompt's first token: no log probability, no alternatives.
                if t.logprob.is_nan() {
                    return serde_json::Value::Null;
                }
                t.top
                    .iter()
                    .map(|(b, l)| (text(b), serde_json::json!(l)))
                    .collect::<serde_json::Map<_, _>>()
                    .into()
            })
            .collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

/// Formats the log probabilities of a streamed chunk's tokens.
type LogprobFormat = Box<dyn FnMut(&[TokenLogprob]) -> serde_json::Value + Send>;

/// Most entries a `logit_bias` may have (OpenAI's limit).
const MAX_LOGIT_BIASES: usize = 300;

/// `logit_bias` as `(id, bias)`: an object of token ids (decimal strings below `vocab`) to
/// numbers (their range is [`SamplingParams::validate`]'s); absent or null is none.
fn logit_bias(v: Option<&serde_json::Value>, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |why: String| ApiError::invalid("logit_bias", why);
    let map = match v {
        None | Some(serde_json::Value::Null) => return Ok(Vec::new()),
        Some(serde_json::Value::Object(m)) => m,
        Some(_) => return Err(bad("expected an object of token ids to biases".into())),
    };
    if map.len() > MAX_LOGIT_BIASES {
        return Err(bad(format!("at most {MAX_LOGIT_BIASES} entries")));
    }
    map.iter()
        .map(|(k, b)| {
            let id = k
                .parse::<u32>()
                .ok()
                .filter(|&id| (id as usize) < vocab)
                .ok_or_else(|| {
                    bad(format!(
                        "`{k}` is not a token id of the model (0 to {})",
                        vocab.saturating_sub(1)
                    ))
                })?;
            let bias = b
                .as_f64()
                .ok_or_else(|| bad(format!("the bias of `{k}` must be a number in [-100, 100]")))?;
            Ok((id, bias as f32))
        })
        .collect()
}

fn text_of(content: &serde_json::Value) -> Result<String, ApiError> {
    match content {
        serde_json::Value::String(s) => Ok(s.clone()),
        serde_json::Value::Array(parts) => Ok(parts
            .iter()
            .filter_map(|p| p.get("text").and_then(|t| t.as_str()))
            .collect::<Vec<_>>()
            .join("")),
        serde_json::Value::Null => Ok(String::new()),
        _ => Err(ApiError::invalid(
            "messages[].content",
            "expected a string or an array of text parts",
        )),
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn model_object(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "engram"})
}

/// The models served: `engram` and the chat model's own id (both answer chat completions),
/// and the embedder's id, plain name and aliases (embeddings; `engram` answers them too).
#[utoipa::path(get, path = "/v1/models", tag = "openai",
    responses((status = 200, description = "OpenAI model list")), security(("bearer" = [])))]
pub async fn models(State(s): State<AppState>) -> axum::Json<serde_json::Value> {
    axum::Json(serde_json::json!({
        "object": "list",
        "data": model_ids(&s).iter().map(|id| model_object(id)).collect::<Vec<_>>(),
    }))
}

/// One model; 404 `model_not_found` for a name not served.
#[utoipa::path(get, path = "/v1/models/{id}", tag = "openai",
    params(("id" = String, Path, description = "a model name from /v1/models")),
    responses((status = 200, description = "OpenAI model object"),
        (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn model(
    State(s): State<AppState>,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    check_model(Some(&id), &model_ids(&s))?;
    Ok(axum::Json(model_object(&id)))
}

/// Chat completions; with `engram.collections`, retrieval-augmented through fused prefill.
/// Scope `qa`.
#[utoipa::path(post, path = "/v1/chat/completions", tag = "openai", request_body = ChatRequest,
    responses((status = 200, description = "chat.completion, or chat.completion.chunk events ending with [DONE]"),
        (status = 400, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn chat(
    State(s): State<AppState>,
    caller: Caller,
    Json(b): Json<ChatRequest>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Qa)?;
    let shaping = check_chat(&b, s.engine.info.vocab_size)?;
    if shaping.n > s.engine.queue_depth() {
        return Err(ApiError::invalid(
            "n",
            format!(
                "{} choices cannot be queued: the engine queue holds {}",
                shaping.n,
                s.engine.queue_depth()
            ),
        ));
    }
    let logprobs = (b.logprobs == Some(true)).then(|| b.top_logprobs.unwrap_or(0) as usize);
    if let Some(u) = &b.user {
        tracing::info!(key = %caller.key_id, end_user = %u, "chat completion");
    }
    check_model(b.model.as_deref(), &chat_models(&s))?;
    let stops = stop_strings(b.stop.as_ref())?;
    let include_usage = b.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let max_tokens = b
        .max_completion_tokens
        .or(b.max_tokens)
        .unwrap_or(DEFAULT_CHAT_MAX_TOKENS);
    let temperature = b.temperature.unwrap_or(0.0);
    check_generation(&s, max_tokens, temperature)?;
    if b.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "at least one message is needed",
        ));
    }
    let mut messages = Vec::with_capacity(b.messages.len());
    for m in &b.messages {
        if !matches!(
            m.role.as_str(),
            "system" | "user" | "assistant" | "developer" | "tool"
        ) {
            return Err(ApiError::invalid(
                "messages[].role",
                format!("`{}` is not system, user, assistant or tool", m.role),
            ));
        }
        let mut text = text_of(&m.content)?;
        if let Some(calls) = m.tool_calls.as_ref().filter(|c| !c.is_null()) {
            if !text.is_empty() {
                text.push('\n');
            }
            text.push_str(&calls_text(calls)?);
        }
        messages.push((m.role.replace("developer", "system"), text));
    }
    let structured = structured_output(b.response_format.as_ref())?;
    let tools = tool_use(&b)?;
    if structured.is_some() && tools.is_some() {
        return Err(ApiError::invalid(
            "response_format",
            "structured output together with tools is not supported (set tool_choice to none)",
        ));
    }
    let calls_tools = tools.is_some();
    if let (Some(_), Some(_)) = (&b.engram, structured.as_ref().or(tools.as_ref())) {
        let param = if calls_tools {
            "tools"
        } else {
            "response_format"
        };
        return Err(ApiError::invalid(
            param,
            "not supported with engram retrieval (the grounded answer is text)",
        ));
    }
    let grammar = structured.or(tools).map(|(grammar, instruction)| {
        instruct(&mut messages, instruction);
        grammar
    });
    let model = b
        .model
        .clone()
        .unwrap_or_else(|| s.engine.info.model_id.clone());
    let (prompt, cites, policy, retrieve_ms) = match &b.engram {
        Some(e) => {
            let question = messages
                .iter()
                .rev()
                .find(|(r, _)| r == "user")
                .map(|(_, c)| c.clone())
                .ok_or_else(|| ApiError::invalid("messages", "retrieval needs a user message"))?;
            s.limits.check_query("messages[].content", &question)?;
            let policy = e.policy.as_deref().map(str::parse).transpose().map_err(
                |e: engram_fusion::FusionError| ApiError::invalid("engram.policy", e.to_string()),
            )?;
            let t = Instant::now();
            let hits = retrieve(
                &s,
                &caller,
                &e.collections,
                &question,
                e.top_k.unwrap_or(crate::api::qa::DEFAULT_QA_TOP_K),
                Mode::Hybrid,
                &Default::default(),
            )
            .await?;
            let grounded = crate::api::qa::grounded(&s, &question, hits).await?;
            let ms = t.elapsed().as_secs_f64() * 1e3;
            let cites = citations(&grounded.hits);
            (grounded.prompt(question), Some(cites), policy, Some(ms))
        }
        None => (Prompt::Chat { messages }, None, None, None),
    };
    let rxs = submit_choices(
        &s,
        "chat",
        prompt,
        max_tokens,
        crate::engine::Sampling {
            temperature,
            top_p: b.top_p.unwrap_or(1.0),
            seed: b.seed.unwrap_or(0),
            stops,
            grammar,
            copy_bias: None,
            presence_penalty: shaping.presence_penalty,
            frequency_penalty: shaping.frequency_penalty,
            logit_bias: shaping.logit_bias,
            logprobs,
            prompt_logprobs: None,
        },
        policy,
        shaping.n,
    )?;
    let id = format!("chatcmpl-{:016x}", rand::random::<u64>());
    let created = unix_now();
    if calls_tools {
        // A call is known to be one only once it parses: each choice is answered whole, also
        // when streamed.
        let results = collect_choices(rxs).await?;
        let mut choices = Vec::with_capacity(results.len());
        let mut sums = Vec::with_capacity(results.len());
        for (i, (answer, sum, lps)) in results.into_iter().enumerate() {
            let lps = logprobs.map(|_| chat_logprobs(&lps));
            let call = (sum.finish_reason == "stop")
                .then(|| tool_call_of(&answer))
                .flatten();
            let finish = if call.is_some() {
                "tool_calls"
            } else {
                sum.finish_reason
            };
            choices.push((i, answer, call, finish, lps));
            sums.push(sum);
        }
        if !b.stream {
            let choices = choices
                .into_iter()
                .map(|(i, answer, call, finish, lps)| {
                    let message = match &call {
                        Some(c) => serde_json::json!(
                            {"role": "assistant", "content": null, "tool_calls": [c]}),
                        None => serde_json::json!({"role": "assistant", "content": answer.trim()}),
                    };
                    serde_json::json!({"index": i, "message": message,
                        "logprobs": lps.unwrap_or_default(), "finish_reason": finish})
                })
                .collect();
            let body = completion(&id, created, &model, choices, &sums);
            return Ok(axum::Json(body).into_response());
        }
        let chunk = |i: usize, delta: serde_json::Value, finish: Option<&str>| {
            serde_json::json!({
                "id": id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": [{"index": i, "delta": delta, "finish_reason": finish}],
            })
        };
        let mut events = Vec::new();
        for (i, answer, call, finish, lps) in choices {
            let delta = match call {
                Some(mut c) => {
                    c["index"] = 0.into();
                    serde_json::json!({"tool_calls": [c]})
                }
                None => serde_json::json!({"content": answer.trim()}),
            };
            let mut delta = chunk(i, delta, None);
            if let Some(l) = lps {
                delta["choices"][0]["logprobs"] = l;
            }
            events.extend([
                chunk(
                    i,
                    serde_json::json!({"role": "assistant", "content": ""}),
                    None,
                ),
                delta,
                chunk(i, serde_json::json!({}), Some(finish)),
            ]);
        }
        if include_usage {
            let mut usage = chunk(0, serde_json::json!({}), None);
            usage["choices"] = serde_json::json!([]);
            usage["usage"] = usage_of(&sums);
            events.push(usage);
        }
        let events: Vec<SseEvent> = events
            .iter()
            .map(data)
            .chain([SseEvent::default().data("[DONE]")])
            .collect();
        return Ok(
            Sse::new(stream::iter(events.into_iter().map(Ok::<_, Infallible>))).into_response(),
        );
    }
    if !b.stream {
        let results = collect_choices(rxs).await?;
        let choices = results
            .iter()
            .enumerate()
            .map(|(i, (answer, sum, lps))| {
                serde_json::json!({
                    "index": i,
                    "message": {"role": "assistant", "content": answer.trim()},
                    "logprobs": logprobs.map(|_| chat_logprobs(lps)),
                    "finish_reason": sum.finish_reason,
                })
            })
            .collect();
        let sums: Vec<_> = results.into_iter().map(|(_, sum, _)| sum).collect();
        let mut body = completion(&id, created, &model, choices, &sums);
        if let Some(c) = cites {
            // Every choice answers from the same passages; the first one's timings.
            let first = &sums[0];
            body["citations"] = serde_json::to_value(c).expect("json");
            body["engram"] = serde_json::json!({
                "policy": first.policy,
                "fusion_disabled": first.fusion_disabled,
                "timings": with_retrieve(first.timings.clone(), retrieve_ms.unwrap_or(0.0)),
            });
        }
        return Ok(axum::Json(body).into_response());
    }
    Ok(Sse::new(chunks(
        rxs,
        id,
        created,
        model,
        cites,
        include_usage,
        logprobs.is_some(),
    ))
    .keep_alive(KeepAlive::default())
    .into_response())
}

/// A whole `chat.completion` of `choices` (their `index`, `message`, `logprobs` and
/// `finish_reason`), with the usage of the jobs that made them.
fn completion(
    id: &str,
    created: u64,
    model: &str,
    choices: Vec<serde_json::Value>,
    sums: &[crate::engine::Summary],
) -> serde_json::Value {
    serde_json::json!({
        "id": id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage_of(sums),
    })
}

/// OpenAI's `usage` of one request's jobs (its choices, in order): the prompt once, every
/// job's completion tokens; `cached_tokens`: prompt tokens whose KV came from the prefix cache
/// (the system prompt, an earlier turn of the conversation) for the first choice.
fn usage_of(sums: &[crate::engine::Summary]) -> serde_json::Value {
    usage_of_batch(sums, sums.len())
}

/// [`usage_of`] for a batch of prompts, `per_prompt` jobs each (`sums` prompt by prompt):
/// each prompt counted once.
fn usage_of_batch(sums: &[crate::engine::Summary], per_prompt: usize) -> serde_json::Value {
    let firsts = || sums.iter().step_by(per_prompt.max(1));
    let prompt: usize = firsts().map(|s| s.prompt_tokens).sum();
    let cached: usize = firsts().map(|s| s.cached_tokens).sum();
    let completion: usize = sums.iter().map(|s| s.generated_tokens).sum();
    serde_json::json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

fn data(v: &serde_json::Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

/// `chat.completion.chunk` events of choices `rxs`: each choice's role, then the content
/// pieces as they come (with their tokens' log probabilities when asked), each choice's finish
/// reason (with the citations when retrieval ran), with `include_usage` a chunk with the usage
/// and no choices, then `[DONE]`.
fn chunks(
    rxs: Vec<tokio::sync::mpsc::Receiver<Event>>,
    id: String,
    created: u64,
    model: String,
    cites: Option<Vec<Citation>>,
    include_usage: bool,
    logprobs: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let chunk = move |index: usize, text: Option<&str>, finish: Option<&str>| {
        let delta = match text {
            Some(t) => serde_json::json!({"content": t}),
            None => serde_json::json!({}),
        };
        serde_json::json!({
            "id": id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": finish}],
        })
    };
    let roles: Vec<_> = (0..rxs.len())
        .map(|i| {
            let mut first = chunk(i, None, None);
            first["choices"][0]["delta"] = serde_json::json!({"role": "assistant", "content": ""});
            Ok(data(&first))
        })
        .collect();
    let formats = if logprobs {
        (0..rxs.len())
            .map(|_| Box::new(|l: &[TokenLogprob]| chat_logprobs(l)) as LogprobFormat)
            .collect()
    } else {
        Vec::new()
    };
    let cites = cites.map(|c| serde_json::to_value(c).expect("json"));
    let per_prompt = rxs.len();
    stream::iter(roles).chain(generation_events(
        rxs,
        per_prompt,
        include_usage,
        chunk,
        cites,
        formats,
    ))
}

/// The events of streamed generations, one per choice (`rxs[i]` is choice `i`), as they come:
/// `chunk(i, Some(text), None)` per piece of text (with `formats`, one per choice, its tokens' log
/// probabilities in the choice's `logprobs`), then `chunk(i, None, Some(finish_reason))` (with
/// `citations` when given, and the log probabilities of tokens whose text never went out); once
/// every choice has finished, with `include_usage` a chunk with no choices and the `usage` of them
/// all (`per_prompt` choices to a prompt), then `[DONE]`. An error ends the stream with its body
/// and `[DONE]` (the other choices' jobs are cancelled as their receivers drop).
fn generation_events(
    rxs: Vec<tokio::sync::mpsc::Receiver<Event>>,
    per_prompt: usize,
    include_usage: bool,
    chunk: impl Fn(usize, Option<&str>, Option<&str>) -> serde_json::Value + Send + 'static,
    citations: Option<serde_json::Value>,
    formats: Vec<LogprobFormat>,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    struct State<C> {
        events: stream::SelectAll<stream::BoxStream<'static, (usize, Event)>>,
        chunk: C,
        citations: Option<serde_json::Value>,
        /// Per choice: how its log probabilities are formatted, and those of tokens whose
        /// text has not gone out yet.
        formats: Vec<Option<LogprobFormat>>,
        pending: Vec<Vec<TokenLogprob>>,
        /// Each choice's summary, once it has finished.
        finished: Vec<Option<crate::engine::Summary>>,
        open: usize,
    }
    impl<C> State<C> {
        /// Adds choice `i`'s pending log probabilities to a chunk.
        fn attach(&mut self, i: usize, ev: &mut serde_json::Value) {
            if let Some(format) = &mut self.formats[i] {
                if !self.pending[i].is_empty() {
                    ev["choices"][0]["logprobs"] = format(&std::mem::take(&mut self.pending[i]));
                }
            }
        }
    }
    let done = || SseEvent::default().data("[DONE]");
    let choices = rxs.len();
    let mut formats: Vec<Option<LogprobFormat>> = formats.into_iter().map(Some).collect();
    formats.resize_with(choices, || None);
    let events = stream::select_all(rxs.into_iter().enumerate().map(|(i, rx)| {
        stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|e| (e, rx)) })
            .map(move |e| (i, e))
            .boxed()
    }));
    let state = State {
        events,
        chunk,
        citations,
        formats,
        pending: vec![Vec::new(); choices],
        finished: vec![None; choices],
        open: choices,
    };
    stream::unfold(Some(state), move |state| async move {
        let mut st = state?;
        let events = match st.events.next().await {
            Some((i, Event::Token(t))) => {
                let mut ev = (st.chunk)(i, Some(&t), None);
                st.attach(i, &mut ev);
                return Some((vec![data(&ev)], Some(st)));
            }
            Some((i, Event::Logprobs(l))) => {
                st.pending[i].extend(l);
                return Some((Vec::new(), Some(st)));
            }
            Some((i, Event::Done(sum))) => {
                let mut last = (st.chunk)(i, None, Some(sum.finish_reason));
                st.attach(i, &mut last);
                if let Some(c) = &st.citations {
                    last["citations"] = c.clone();
                }
                st.finished[i] = Some(sum);
                st.open -= 1;
                if st.open > 0 {
                    return Some((vec![data(&last)], Some(st)));
                }
                let mut events = vec![data(&last)];
                if include_usage {
                    let mut usage = (st.chunk)(0, None, None);
                    usage["choices"] = serde_json::json!([]);
                    let sums: Vec<_> = st.finished.drain(..).flatten().collect();
                    usage["usage"] = usage_of_batch(&sums, per_prompt);
                    events.push(data(&usage));
                }
                events
            }
            Some((_, Event::Error(e))) => vec![data(&e.body())],
            None => vec![data(
                &ApiError::internal("the engine dropped the job").body(),
            )],
        };
        Some(([events, vec![done()]].concat(), None))
    })
    .flat_map(stream::iter)
    .map(Ok)
}

/// Submits `n` jobs of one request, choice `i` sampled with seed `sampling.seed + i` (so
/// sampled choices differ and each is reproducible); one receiver per choice.
fn submit_choices(
    s: &AppState,
    kind: &'static str,
    prompt: Prompt,
    max_tokens: usize,
    sampling: crate::engine::Sampling,
    policy: Option<engram_fusion::Policy>,
    n: usize,
) -> Result<Vec<tokio::sync::mpsc::Receiver<Event>>, ApiError> {
    // An error drops the receivers already made, which cancels their jobs.
    (0..n)
        .map(|i| {
            let sampling = crate::engine::Sampling {
                seed: sampling.seed.wrapping_add(i as u64),
                ..sampling.clone()
            };
            s.engine
                .submit(kind, prompt.clone(), max_tokens, sampling, policy)
        })
        .collect()
}

/// Every choice's text, summary and log probabilities, in choice order.
async fn collect_choices(
    rxs: Vec<tokio::sync::mpsc::Receiver<Event>>,
) -> Result<Vec<(String, crate::engine::Summary, Vec<TokenLogprob>)>, ApiError> {
    futures_util::future::try_join_all(rxs.into_iter().map(crate::engine::collect_logprobs)).await
}

/// OpenAI's (legacy) completions request. As for chat, every parameter is honoured or
/// refused by name.
#[derive(Debug, Deserialize, ToSchema)]
pub struct CompletionRequest {
    /// `engram`, the served model's id, or absent.
    pub model: Option<String>,
    /// What to continue: a string, an array of token ids (the served model's, used as they
    /// are, no BOS added), or a batch: an array of strings or of token id arrays (choices
    /// are numbered prompt by prompt, `n` each).
    #[schema(value_type = Object)]
    pub prompt: serde_json::Value,
    /// Default 16, as at OpenAI.
    pub max_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub seed: Option<u64>,
    #[schema(value_type = Object)]
    pub stop: Option<serde_json::Value>,
    /// Choices to return, 1 to 16 (default 1), sampled as chat's.
    pub n: Option<u32>,
    /// Candidates to generate, `n` to 16 (default `n`): the `n` whose tokens have the highest
    /// mean log probability are returned, best first (not with `stream`). Usage counts them
    /// all.
    pub best_of: Option<u32>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
    /// 0 to 5: each token's log probability and that many most likely alternatives
    /// (`choices[].logprobs`: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).
    pub logprobs: Option<u32>,
    /// True: each choice's text starts with the prompt; with `logprobs`, so do the entries
    /// (each prompt token's log probability given the ones before it; the first's is null),
    /// and `max_tokens` may be 0 (the prompt alone, as scoring harnesses ask).
    pub echo: Option<bool>,
    /// Only null or empty.
    pub suffix: Option<String>,
    /// In [-2, 2], as in chat.
    pub presence_penalty: Option<f32>,
    /// In [-2, 2], as in chat.
    pub frequency_penalty: Option<f32>,
    /// `{"token id": bias}`, as in chat.
    #[schema(value_type = Object)]
    pub logit_bias: Option<serde_json::Value>,
    /// The end user: logged with the request.
    pub user: Option<String>,
    /// Anything else: refused, naming it.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub unknown: std::collections::BTreeMap<String, serde_json::Value>,
}

/// Text completions: the prompt continued as it is (no chat template). Scope `qa`.
#[utoipa::path(post, path = "/v1/completions", tag = "openai", request_body = CompletionRequest,
    responses((status = 200, description = "text_completion, or its chunks ending with [DONE]"),
        (status = 400, body = crate::api::openapi::ErrorBody),
        (status = 404, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn completions(
    State(s): State<AppState>,
    caller: Caller,
    Json(b): Json<CompletionRequest>,
) -> Result<Response, ApiError> {
    caller.require(Scope::Qa)?;
    let no = |param: &str, why: &str| Err(ApiError::invalid(param, why.to_owned()));
    let shaping = check_common(
        &Common {
            unknown: &b.unknown,
            n: b.n,
            presence_penalty: b.presence_penalty,
            frequency_penalty: b.frequency_penalty,
            logit_bias: b.logit_bias.as_ref(),
            top_p: b.top_p,
        },
        s.engine.info.vocab_size,
    )?;
    let n = shaping.n;
    let best_of = b.best_of.map_or(n, |m| m as usize);
    if best_of < n || best_of > MAX_CHOICES as usize {
        return no(
            "best_of",
            &format!("must be in n..={MAX_CHOICES} (n is {n})"),
        );
    }
    if best_of > n && b.stream {
        return no(
            "best_of",
            "candidates are ranked once complete, so they cannot be streamed",
        );
    }
    if b.logprobs.is_some_and(|n| n > MAX_COMPLETION_LOGPROBS) {
        return no("logprobs", "must be in 0..=5");
    }
    let echo = b.echo == Some(true);
    if b.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
        return no("suffix", "insertion (a suffix) is not implemented");
    }
    check_model(b.model.as_deref(), &chat_models(&s))?;
    let prompts = completion_prompts(&b.prompt)?;
    let limit = MAX_BATCH_CANDIDATES.min(s.engine.queue_depth());
    if prompts.len() * best_of > limit {
        // Named by what the caller would change.
        let param = match (prompts.len(), b.best_of) {
            (1, Some(_)) => "best_of",
            (1, None) => "n",
            _ => "prompt",
        };
        return no(
            param,
            &format!(
                "{} prompts of {best_of} candidates each: at most {limit} in one request (the \
                 engine queue holds {})",
                prompts.len(),
                s.engine.queue_depth()
            ),
        );
    }
    // Each prompt's text: what `echo` puts first and what `text_offset` counts from.
    let texts: Vec<String> = prompts
        .iter()
        .map(|p| match p {
            Prompt::Text { text } => text.clone(),
            Prompt::Tokens { ids } => s.engine.decode(ids),
            _ => unreachable!("completion_prompts makes text and token prompts only"),
        })
        .collect();
    if let Some(u) = &b.user {
        tracing::info!(key = %caller.key_id, end_user = %u, "completion");
    }
    let max_tokens = b.max_tokens.unwrap_or(16);
    let temperature = b.temperature.unwrap_or(1.0);
    // With `echo`, 0 asks for the prompt alone (its log probabilities, say).
    check_generation(
        &s,
        if echo { max_tokens.max(1) } else { max_tokens },
        temperature,
    )?;
    // `text_offset` counts from the prompt's start, as OpenAI's does; with `echo` the
    // entries start with the prompt's own tokens.
    let prompt_chars: Vec<usize> = texts
        .iter()
        .map(|t| if echo { 0 } else { t.chars().count() })
        .collect();
    let echoed: Option<Vec<String>> = echo.then_some(texts);
    // Ranking candidates needs each token's log probability.
    let job_logprobs = b
        .logprobs
        .map(|n| n as usize)
        .or((best_of > n).then_some(0));
    let sampling = crate::engine::Sampling {
        temperature,
        top_p: b.top_p.unwrap_or(1.0),
        seed: b.seed.unwrap_or(0),
        stops: stop_strings(b.stop.as_ref())?,
        grammar: None,
        copy_bias: None,
        presence_penalty: shaping.presence_penalty,
        frequency_penalty: shaping.frequency_penalty,
        logit_bias: shaping.logit_bias,
        logprobs: job_logprobs,
        prompt_logprobs: b.logprobs.filter(|_| echo).map(|n| n as usize),
    };
    // Prompt by prompt, `best_of` candidates each: candidate `i` of prompt `p` is `rxs[p *
    // best_of + i]`. An error drops the receivers made, which cancels their jobs.
    let mut rxs = Vec::with_capacity(prompts.len() * best_of);
    for prompt in prompts {
        rxs.extend(submit_choices(
            &s,
            "chat",
            prompt,
            max_tokens,
            sampling.clone(),
            None,
            best_of,
        )?);
    }
    let id = format!("cmpl-{:016x}", rand::random::<u64>());
    let created = unix_now();
    let model = b.model.unwrap_or_else(|| s.engine.info.model_id.clone());
    if !b.stream {
        let mut results = collect_choices(rxs).await?;
        let sums: Vec<_> = results.iter().map(|(_, sum, _)| sum.clone()).collect();
        let mut choices = Vec::with_capacity(prompt_chars.len() * n);
        for (p, &chars) in prompt_chars.iter().enumerate() {
            let rest = results.split_off(best_of.min(results.len()));
            let candidates = std::mem::replace(&mut results, rest);
            for (text, sum, lps) in best_choices(candidates, n) {
                let mut offset = chars;
                let logprobs = b.logprobs.map(|_| text_logprobs(&lps, &mut offset));
                let text = match &echoed {
                    Some(e) => format!("{}{text}", e[p]),
                    None => text,
                };
                choices.push(serde_json::json!({"text": text, "index": choices.len(),
                    "logprobs": logprobs, "finish_reason": sum.finish_reason}));
            }
        }
        return Ok(axum::Json(serde_json::json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": choices,
            "usage": usage_of_batch(&sums, best_of),
        }))
        .into_response());
    }
    // Streamed, `best_of` is `n`: choice `i` is `rxs[i]`, of prompt `i / n`.
    let include_usage = b.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let chunk = move |index: usize, text: Option<&str>, finish: Option<&str>| {
        serde_json::json!({
            "id": id,
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [{"text": text.unwrap_or(""), "index": index, "logprobs": null,
                "finish_reason": finish}],
        })
    };
    let echoes: Vec<_> = match &echoed {
        Some(e) => (0..rxs.len())
            .map(|i| Ok(data(&chunk(i, Some(&e[i / n]), None))))
            .collect(),
        None => Vec::new(),
    };
    let formats = match b.logprobs {
        Some(_) => (0..rxs.len())
            .map(|i| {
                let mut offset = prompt_chars[i / n];
                Box::new(move |l: &[TokenLogprob]| text_logprobs(l, &mut offset)) as LogprobFormat
            })
            .collect(),
        None => Vec::new(),
    };
    let events = generation_events(rxs, n, include_usage, chunk, None, formats);
    Ok(Sse::new(stream::iter(echoes).chain(events))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// Most prompts' candidates (`best_of` each) one completions request may ask for (and no more
/// than the engine queue holds, or the request could never be queued): four requests' worth
/// of [`MAX_CHOICES`], so a harness's batch of 16 prompts scored one candidate each fits, and
/// one request cannot hold a large queue alone.
const MAX_BATCH_CANDIDATES: usize = 64;

/// The prompts of a completions `prompt`, as OpenAI takes it: a string, an array of token ids,
/// or a batch (an array of strings, or of token id arrays). Token ids are the served model's
/// (as vLLM's and llama.cpp's servers read them); the engine checks them against its
/// vocabulary.
fn completion_prompts(v: &serde_json::Value) -> Result<Vec<Prompt>, ApiError> {
    let bad = |why: &str| ApiError::invalid("prompt", why.to_owned());
    let ids = |a: &[serde_json::Value]| -> Result<Prompt, ApiError> {
        a.iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| bad("token ids are non-negative integers"))
            })
            .collect::<Result<Vec<u32>, _>>()
            .map(|ids| Prompt::Tokens { ids })
    };
    let expected = "expected a string, an array of token ids, or an array of strings or of \
                    token id arrays";
    match v {
        serde_json::Value::String(t) => Ok(vec![Prompt::Text { text: t.clone() }]),
        serde_json::Value::Array(a) if a.is_empty() => Err(bad("the prompt array is empty")),
        serde_json::Value::Array(a) if a.iter().all(serde_json::Value::is_number) => {
            Ok(vec![ids(a)?])
        }
        serde_json::Value::Array(a) => a
            .iter()
            .map(|p| match p {
                serde_json::Value::String(t) => Ok(Prompt::Text { text: t.clone() }),
                serde_json::Value::Array(t) => ids(t),
                _ => Err(bad(expected)),
            })
            .collect(),
        _ => Err(bad(expected)),
    }
}

/// The `n` best of `candidates` by their generated tokens' mean log probability (OpenAI's
/// `best_of`; an echoed prompt's entries, first in the list, do not count), best first; all of
/// them, in order, when there are no more than `n`. A candidate with no token ranks last.
fn best_choices(
    mut candidates: Vec<(String, crate::engine::Summary, Vec<TokenLogprob>)>,
    n: usize,
) -> Vec<(String, crate::engine::Summary, Vec<TokenLogprob>)> {
    if candidates.len() <= n {
        return candidates;
    }
    let mean = |c: &(String, crate::engine::Summary, Vec<TokenLogprob>)| {
        let lps = &c.2[c.2.len().saturating_sub(c.1.generated_tokens)..];
        if lps.is_empty() {
            f32::NEG_INFINITY
        } else {
            lps.iter().map(|l| l.logprob).sum::<f32>() / lps.len() as f32
        }
    };
    candidates.sort_by(|a, b| mean(b).total_cmp(&mean(a)));
    candidates.truncate(n);
    candidates
}

/// OpenAI's embeddings request.
#[derive(Debug, Deserialize, ToSchema)]
pub struct EmbeddingsRequest {
    /// A string, an array of strings, an array of cl100k_base token ids (what OpenAI's
    /// clients send), or an array of such arrays.
    #[schema(value_type = Object)]
    pub input: serde_json::Value,
    pub model: Option<String>,
    /// `float` (the default) or `base64` (little-endian f32, as OpenAI's clients ask for).
    pub encoding_format: Option<String>,
    /// Only the embedder's own size (384 for all-MiniLM-L6-v2).
    pub dimensions: Option<usize>,
    /// The end user: logged with the request.
    pub user: Option<String>,
    /// Anything else: refused, naming it.
    #[serde(flatten)]
    #[schema(value_type = Object)]
    pub unknown: std::collections::BTreeMap<String, serde_json::Value>,
}

/// Sentence embeddings from the knowledge base's embedder. Scope `search`.
#[utoipa::path(post, path = "/v1/embeddings", tag = "openai", request_body = EmbeddingsRequest,
    responses((status = 200, description = "OpenAI embedding list"), (status = 400, body = crate::api::openapi::ErrorBody)),
    security(("bearer" = [])))]
pub async fn embeddings(
    State(s): State<AppState>,
    caller: Caller,
    Json(b): Json<EmbeddingsRequest>,
) -> Result<axum::Json<serde_json::Value>, ApiError> {
    caller.require(Scope::Search)?;
    if let Some(name) = b.unknown.keys().next() {
        return Err(ApiError::invalid(name, "unrecognized request argument"));
    }
    if let Some(u) = &b.user {
        tracing::info!(key = %caller.key_id, end_user = %u, "embeddings");
    }
    check_model(b.model.as_deref(), &embedding_models(&s))?;
    let dim = s.kb.embed_dim;
    if b.dimensions.is_some_and(|d| d != dim) {
        return Err(ApiError::invalid(
            "dimensions",
            format!("the embedder's vectors have {dim} dimensions; no other size is served"),
        ));
    }
    let inputs = embedding_inputs(b.input, s.token_vocab.as_deref())?;
    let base64 = match b.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("{other:?}: expected \"float\" or \"base64\""),
            ))
        }
    };
    if inputs.is_empty() || inputs.len() > MAX_EMBED_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!("{} inputs; 1..={MAX_EMBED_INPUTS} allowed", inputs.len()),
        ));
    }
    // As OpenAI: an empty string has no embedding (a vector of it would be the model's
    // [CLS] and [SEP] alone, close to every short text).
    if let Some(i) = inputs.iter().position(|t| t.is_empty()) {
        return Err(ApiError::invalid(
            "input",
            format!("input {i} is an empty string; every input needs text to embed"),
        ));
    }
    let (vectors, tokens) =
        s.kb.call(move |kb| {
            let e = &kb.models().embedder;
            let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
            let tokens: usize = inputs
                .iter()
                .map(|t| e.tokenize(t).map_or(0, |v| v.len()))
                .sum();
            e.embed(&refs).map(|v| (v, tokens))
        })
        .await?
        .map_err(|e| ApiError::internal(format!("embedding: {e}")))?;
    Ok(axum::Json(serde_json::json!({
        "object": "list",
        "data": vectors.iter().enumerate().map(|(i, v)| {
            let embedding = if base64 {
                serde_json::Value::String(base64_f32(v))
            } else {
                serde_json::json!(v)
            };
            serde_json::json!({"object": "embedding", "index": i, "embedding": embedding})
        }).collect::<Vec<_>>(),
        "model": b.model.unwrap_or_else(|| s.kb.embed_model.to_string()),
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    })))
}

/// The texts of an embeddings `input`: a string, an array of strings, an array of token ids or
/// an array of such arrays. Token ids are OpenAI's cl100k_base ids (what its embedding clients
/// compute, LangChain's `OpenAIEmbeddings` by default), decoded back to text with `vocab`.
fn embedding_inputs(
    input: serde_json::Value,
    vocab: Option<&engram_tokenizer::TiktokenVocab>,
) -> Result<Vec<String>, ApiError> {
    use serde_json::Value;
    let tokens = |ids: &[Value]| -> Result<String, ApiError> {
        let vocab = vocab.ok_or_else(|| {
            ApiError::invalid(
                "input",
                "token arrays need the cl100k_base vocabulary (models/cl100k_base.tiktoken, \
                 from scripts/fetch-models.sh); send text instead",
            )
        })?;
        let ids: Vec<i64> = ids
            .iter()
            .map(|v| {
                v.as_i64()
                    .ok_or_else(|| ApiError::invalid("input", "token ids are integers"))
            })
            .collect::<Result<_, _>>()?;
        vocab.decode(&ids).map_err(|id| {
            ApiError::invalid(
                "input",
                format!(
                    "token id {id} is not in cl100k_base ({} tokens)",
                    vocab.len()
                ),
            )
        })
    };
    match input {
        Value::String(s) => Ok(vec![s]),
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_number) => Ok(vec![tokens(&a)?]),
        Value::Array(a) => a
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                Value::Array(ids) if !ids.is_empty() => tokens(&ids),
                _ => Err(ApiError::invalid(
                    "input",
                    "expected strings or non-empty arrays of token ids",
                )),
            })
            .collect(),
        _ => Err(ApiError::invalid(
            "input",
            "expected a string, an array of strings, or token ids",
        )),
    }
}

/// Standard base64 (with padding) of the vector's little-endian f32 bytes: OpenAI's
/// `encoding_format: "base64"`.
fn base64_f32(v: &[f32]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for c in bytes.chunks(3) {
        let n = (c[0] as u32) << 16
            | (*c.get(1).unwrap_or(&0) as u32) << 8
            | *c.get(2).unwrap_or(&0) as u32;
        for i in 0..4 {
            if i <= c.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn base64_matches_the_standard_alphabet_and_padding() {
        // 1.0f32 = 00 00 80 3f
        assert_eq!(super::base64_f32(&[1.0]), "AACAPw==");
        assert_eq!(super::base64_f32(&[1.0, -2.0, 0.5]), "AACAPwAAAMAAAAA/");
        assert_eq!(super::base64_f32(&[]), "");
    }
}
