//! The chat playground: a question over chosen knowledge bases with a fusion policy,
//! answered through the same path as `/api/v1/qa` (hybrid retrieval, then the engine's
//! fused prefill and decode). Without script the form's POST returns the whole answer; the
//! script streams it from `/console/chat/stream` (server-sent events: `token`, `citations`,
//! `timings`, `done`, `error`), with the session cookie and the `X-CSRF-Token` header.

use std::convert::Infallible;
use std::time::Instant;

use askama::Template;
use axum::extract::{RawForm, State};
use axum::http::StatusCode;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use engram_fusion::Policy;
use futures_util::stream::{self, Stream, StreamExt};
use tokio::sync::mpsc;

use crate::api::qa::{check_generation, citations, with_retrieve, Citation};
use crate::api::search::{retrieve, Mode};
use crate::api::AppState;
use crate::auth::{Principal, Scope};
use crate::console::view::{enc, html, Chrome, Failure, Viewer};
use crate::engine::Event;

/// Passages retrieved into the prompt by default (as `/api/v1/qa`).
const DEFAULT_TOP_K: usize = 5;
/// The policies offered; the configured one is preselected. `query:0.02` is the closest to
/// full prefill at a few times boundary:4's time (`docs/bench/2026-11-27-fusion-query.md`).
const POLICIES: [&str; 6] = [
    "boundary:4",
    "query:0.02",
    "reuse",
    "deviation:0.3",
    "full",
    "boundary:16",
];

/// The playground form.
pub struct ChatForm {
    pub question: String,
    pub collections: Vec<String>,
    pub policy: String,
    pub top_k: usize,
    pub max_tokens: usize,
}

impl ChatForm {
    fn parse(body: &[u8], default_policy: &str, default_max: usize) -> ChatForm {
        let pairs: Vec<(String, String)> = serde_urlencoded::from_bytes(body).unwrap_or_default();
        let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.trim());
        ChatForm {
            question: get("question").unwrap_or("").to_owned(),
            collections: pairs
                .iter()
                .filter(|(k, _)| k == "collections")
                .map(|(_, v)| v.clone())
                .collect(),
            policy: get("policy")
                .filter(|p| !p.is_empty())
                .unwrap_or(default_policy)
                .to_owned(),
            top_k: get("top_k")
                .and_then(|v| v.parse().ok())
                .unwrap_or(DEFAULT_TOP_K),
            max_tokens: get("max_tokens")
                .and_then(|v| v.parse().ok())
                .unwrap_or(default_max),
        }
    }

    pub fn has(&self, c: &str) -> bool {
        self.collections.iter().any(|x| x == c)
    }
}

pub struct CiteRow {
    pub n: usize,
    pub doc_name: String,
    pub collection: String,
    pub href: String,
    pub score: String,
}

impl From<&Citation> for CiteRow {
    fn from(c: &Citation) -> Self {
        CiteRow {
            n: c.n,
            doc_name: c.doc_name.clone(),
            collection: c.collection.clone(),
            href: cite_href(c),
            score: format!("{:.4}", c.score),
        }
    }
}

fn cite_href(c: &Citation) -> String {
    format!(
        "/console/kb/{}/doc/{}#chunk-{}",
        enc(&c.collection),
        c.doc_id,
        c.chunk_id
    )
}

/// One line of the timing breakdown: catalog key, JSON field (the script fills the row
/// from the `timings` event by it) and value.
pub struct TimingRow {
    pub key: &'static str,
    pub field: &'static str,
    pub value: String,
}

/// The timing breakdown's rows in order: (catalog key, JSON field in milliseconds). The rows
/// from the prefix to "other" add up to the prefill total.
const TIMING_ROWS: [(&str, &str); 12] = [
    ("chat.t_retrieve", "retrieve_ms"),
    ("chat.t_queue", "queue_ms"),
    ("chat.t_prefix", "prefix_prefill_ms"),
    ("chat.t_kv_load", "kv_load_ms"),
    ("chat.t_kv_compute", "kv_compute_ms"),
    ("chat.t_rank", "rank_ms"),
    ("chat.t_recompute", "recompute_ms"),
    ("chat.t_prefill", "question_prefill_ms"),
    ("chat.t_prefill_other", "prefill_other_ms"),
    ("chat.t_prefill_total", "prefill_total_ms"),
    ("chat.t_first_token", "first_token_ms"),
    ("chat.t_decode", "decode_ms"),
];

/// The rows for an answer's timings (`null`: the empty table before an answer).
fn timing_rows(t: &serde_json::Value) -> Vec<TimingRow> {
    let mut rows: Vec<TimingRow> = TIMING_ROWS
        .iter()
        .map(|&(key, field)| TimingRow {
            key,
            field,
            value: t[field]
                .as_f64()
                .map_or_else(|| "–".into(), |v| format!("{v:.1} ms")),
        })
        .collect();
    let k = &t["kv_chunks"];
    rows.push(TimingRow {
        key: "chat.t_kv_tiers",
        field: "kv_chunks",
        value: if k.is_null() {
            "–".into()
        } else {
            format!(
                "DRAM {} · NVMe {} · ↻ {}",
                k["dram"], k["nvme"], k["computed"]
            )
        },
    });
    rows.push(TimingRow {
        key: "chat.t_tokens",
        field: "generated_tokens",
        value: t["generated_tokens"]
            .as_u64()
            .map_or_else(|| "–".into(), |n| n.to_string()),
    });
    rows
}

#[derive(Template)]
#[template(path = "chat.html", config = "../../web/askama.toml")]
pub struct ChatPage {
    pub c: Chrome,
    pub f: ChatForm,
    pub all: Vec<String>,
    pub policies: Vec<String>,
    pub max_tokens_limit: usize,
    pub top_k_limit: usize,
    pub answered: bool,
    pub answer: String,
    pub error: Option<String>,
    pub cites: Vec<CiteRow>,
    pub timings: Vec<TimingRow>,
    pub policy_used: String,
    pub fusion_disabled: Option<String>,
}

async fn chat_page(s: &AppState, v: &Viewer, f: ChatForm) -> Result<ChatPage, Failure> {
    let all: Vec<String> =
        s.kb.call(|kb| kb.collections())
            .await??
            .into_iter()
            .map(|c| c.name)
            .collect();
    let mut policies: Vec<String> = vec![s.console.facts.policy.clone()];
    policies.extend(
        POLICIES
            .iter()
            .map(|p| p.to_string())
            .filter(|p| *p != s.console.facts.policy),
    );
    Ok(ChatPage {
        c: v.chrome("chat", "nav.chat", "/console/chat"),
        f,
        all,
        policies,
        max_tokens_limit: s.limits.max_tokens,
        top_k_limit: s.limits.max_top_k,
        answered: false,
        answer: String::new(),
        error: None,
        cites: Vec::new(),
        timings: timing_rows(&serde_json::Value::Null),
        policy_used: String::new(),
        fusion_disabled: None,
    })
}

/// The playground's default answer length, within the daemon's limit.
fn default_max_tokens(s: &AppState) -> usize {
    s.console
        .settings
        .get()
        .chat_max_tokens
        .min(s.limits.max_tokens)
}

/// `GET /console/chat`.
pub async fn page(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
) -> Result<Response, Failure> {
    let f = ChatForm::parse(b"", &s.console.facts.policy, default_max_tokens(&s));
    Ok(html(&chat_page(&s, &v, f).await?))
}

/// The console user acts with an admin principal: every collection, every scope.
fn principal(v: &Viewer) -> Principal {
    Principal {
        key_id: format!("console:{}", v.user),
        scopes: vec![Scope::Admin],
        collections: None,
    }
}

/// Retrieval and submission: the job's events, its citations and the retrieval time.
async fn start(
    s: &AppState,
    v: &Viewer,
    f: &ChatForm,
) -> Result<(mpsc::Receiver<Event>, Vec<Citation>, f64), Failure> {
    let bad = |e: crate::error::ApiError| Failure::new(StatusCode::BAD_REQUEST, e.to_string());
    check_generation(s, f.max_tokens, 0.0).map_err(bad)?;
    let policy: Policy = f.policy.parse().map_err(|e: engram_fusion::FusionError| {
        Failure::new(StatusCode::BAD_REQUEST, e.to_string())
    })?;
    if f.question.trim().is_empty() {
        return Err(Failure::new(StatusCode::BAD_REQUEST, "chat.no_question"));
    }
    if f.collections.is_empty() {
        return Err(Failure::new(StatusCode::BAD_REQUEST, "chat.no_collection"));
    }
    let t = Instant::now();
    let hits = retrieve(
        s,
        &principal(v),
        &f.collections,
        &f.question,
        f.top_k,
        Mode::Hybrid,
        &Default::default(),
    )
    .await?;
    let grounded = crate::api::qa::grounded(s, &f.question, hits).await?;
    let retrieve_ms = t.elapsed().as_secs_f64() * 1e3;
    let cites = citations(&grounded.hits);
    let rx = s.engine.submit(
        "qa",
        grounded.prompt(f.question.clone()),
        f.max_tokens,
        crate::engine::Sampling::new(0.0, 0),
        Some(policy),
    )?;
    Ok((rx, cites, retrieve_ms))
}

/// `POST /console/chat`: the whole answer as a page (no script needed).
pub async fn answer(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    RawForm(body): RawForm,
) -> Result<Response, Failure> {
    let f = ChatForm::parse(&body, &s.console.facts.policy, default_max_tokens(&s));
    let result = match start(&s, &v, &f).await {
        Ok((rx, cites, retrieve_ms)) => crate::engine::collect(rx)
            .await
            .map(|(a, sum)| (a, sum, cites, retrieve_ms))
            .map_err(Failure::from),
        Err(e) => Err(e),
    };
    let mut page = chat_page(&s, &v, f).await?;
    page.answered = true;
    match result {
        Ok((answer, sum, cites, retrieve_ms)) => {
            page.answer = answer.trim().to_owned();
            page.cites = cites.iter().map(CiteRow::from).collect();
            page.policy_used = sum.policy.clone();
            page.fusion_disabled = sum.fusion_disabled.clone();
            page.timings = timing_rows(&with_retrieve(sum.timings, retrieve_ms));
        }
        Err(e) => page.error = Some(page.c.t.get(&e.message).to_owned()),
    }
    Ok(html(&page))
}

fn json_event(name: &str, data: &serde_json::Value) -> SseEvent {
    SseEvent::default().event(name).data(data.to_string())
}

/// `POST /console/chat/stream`: server-sent events for the script.
pub async fn stream(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    RawForm(body): RawForm,
) -> Response {
    let f = ChatForm::parse(&body, &s.console.facts.policy, default_max_tokens(&s));
    match start(&s, &v, &f).await {
        Ok((rx, cites, retrieve_ms)) => Sse::new(events(rx, cites, retrieve_ms))
            .keep_alive(KeepAlive::default())
            .into_response(),
        Err(e) => {
            let msg = v.lang.catalog().get(&e.message).to_owned();
            let ev = json_event("error", &serde_json::json!({"error": {"message": msg}}));
            Sse::new(stream::iter([Ok::<_, Infallible>(ev)])).into_response()
        }
    }
}

/// Tokens, then citations (with their console links), timings and done.
fn events(
    rx: mpsc::Receiver<Event>,
    cites: Vec<Citation>,
    retrieve_ms: f64,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    stream::unfold(Some((rx, cites)), move |state| async move {
        let (mut rx, cites) = state?;
        match rx.recv().await {
            Some(Event::Token(t)) => Some((
                vec![json_event("token", &serde_json::json!({ "text": t }))],
                Some((rx, cites)),
            )),
            Some(Event::Done(sum)) => {
                let links: Vec<serde_json::Value> = cites
                    .iter()
                    .map(|c| {
                        let mut j = serde_json::to_value(c).expect("json");
                        j["href"] = cite_href(c).into();
                        j
                    })
                    .collect();
                let done = serde_json::json!({
                    "finish_reason": sum.finish_reason,
                    "policy": sum.policy,
                    "fusion_disabled": sum.fusion_disabled,
                    "generated_tokens": sum.generated_tokens,
                });
                Some((
                    vec![
                        json_event("citations", &serde_json::Value::Array(links)),
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
                    &serde_json::json!({"error": {"message": "the engine dropped the job"}}),
                )],
                None,
            )),
        }
    })
    .flat_map(|evs| stream::iter(evs.into_iter().map(Ok)))
}
