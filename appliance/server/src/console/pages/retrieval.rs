//! Retrieval testing ("hit testing"): a query over chosen knowledge bases with a mode,
//! weights, fusion rule, top-k and metadata filters; every hit with its BM25, vector and
//! fused scores and the matched spans highlighted; the log of recent console and API queries.

use std::time::Instant;

use askama::Template;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use axum::Extension;
use engram_kb::{
    FusionMode, SearchMode, SearchRequest, DEFAULT_BM25_WEIGHT, DEFAULT_DENSE_WEIGHT, DEFAULT_RRF_K,
};

use crate::api::AppState;
use crate::console::view::{datetime, enc, html, Chrome, Failure, Viewer};

/// Hits shown when the form does not say.
const DEFAULT_TOP_K: usize = 5;
/// Recent queries listed under the form.
const LOG_SHOWN: usize = 30;

/// The form, parsed from the query string (so a test is a link that can be shared).
pub struct Params {
    pub q: String,
    pub mode: String,
    pub fusion: String,
    pub bm25_weight: f32,
    pub dense_weight: f32,
    pub top_k: usize,
    pub collections: Vec<String>,
    /// `key=value` per line.
    pub filters: String,
}

impl Params {
    fn parse(raw: Option<&str>) -> Params {
        let pairs: Vec<(String, String)> =
            serde_urlencoded::from_str(raw.unwrap_or("")).unwrap_or_default();
        let get = |k: &str| pairs.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        let num = |k: &str, d: f32| get(k).and_then(|v| v.trim().parse().ok()).unwrap_or(d);
        Params {
            q: get("q").unwrap_or("").to_owned(),
            mode: get("mode").unwrap_or("hybrid").to_owned(),
            fusion: get("fusion").unwrap_or("weighted").to_owned(),
            bm25_weight: num("bm25_weight", DEFAULT_BM25_WEIGHT),
            dense_weight: num("dense_weight", DEFAULT_DENSE_WEIGHT),
            top_k: get("top_k")
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(DEFAULT_TOP_K),
            collections: pairs
                .iter()
                .filter(|(k, _)| k == "collections")
                .map(|(_, v)| v.clone())
                .collect(),
            filters: get("filters").unwrap_or("").to_owned(),
        }
    }

    pub fn has(&self, collection: &str) -> bool {
        self.collections.iter().any(|c| c == collection)
    }
}

/// A piece of a hit's text, highlighted or not.
pub struct Piece {
    pub text: String,
    pub hit: bool,
}

pub struct HitRow {
    pub rank: usize,
    pub collection: String,
    pub doc_name: String,
    pub doc_href: String,
    pub ordinal: u32,
    pub chars: String,
    pub page: String,
    pub fused: String,
    pub bm25: String,
    pub dense: String,
    pub pieces: Vec<Piece>,
}

pub struct LogRow {
    pub at: String,
    pub source: &'static str,
    pub who: String,
    pub query: String,
    pub mode: String,
    pub collections: String,
    pub hits: usize,
    pub ms: String,
}

#[derive(Template)]
#[template(path = "retrieval.html", config = "../../web/askama.toml")]
pub struct RetrievalPage {
    pub c: Chrome,
    pub p: Params,
    pub all: Vec<String>,
    pub max_top_k: usize,
    pub ran: bool,
    pub error: Option<String>,
    pub hits: Vec<HitRow>,
    pub took: String,
    pub log: Vec<LogRow>,
}

fn score(v: Option<f32>) -> String {
    v.map_or_else(|| "–".into(), |s| format!("{s:.4}"))
}

/// Splits `text` at the highlight byte ranges (clamped to character boundaries).
fn pieces(text: &str, ranges: &[std::ops::Range<usize>]) -> Vec<Piece> {
    let mut out = Vec::new();
    let mut at = 0;
    let mut rs: Vec<_> = ranges.to_vec();
    rs.sort_by_key(|r| r.start);
    for r in rs {
        let (s, e) = (r.start.max(at), r.end.min(text.len()));
        if s >= e || !text.is_char_boundary(s) || !text.is_char_boundary(e) {
            continue;
        }
        if s > at {
            out.push(Piece {
                text: text[at..s].to_owned(),
                hit: false,
            });
        }
        out.push(Piece {
            text: text[s..e].to_owned(),
            hit: true,
        });
        at = e;
    }
    if at < text.len() {
        out.push(Piece {
            text: text[at..].to_owned(),
            hit: false,
        });
    }
    out
}

/// `GET /console/retrieval?q=...`.
pub async fn page(
    State(s): State<AppState>,
    Extension(v): Extension<Viewer>,
    RawQuery(raw): RawQuery,
) -> Result<Response, Failure> {
    let mut p = Params::parse(raw.as_deref());
    let all: Vec<String> =
        s.kb.call(|kb| kb.collections())
            .await??
            .into_iter()
            .map(|c| c.name)
            .collect();
    if p.collections.is_empty() {
        p.collections = all.clone();
    }
    let path = format!(
        "/console/retrieval{}",
        raw.as_deref().map_or(String::new(), |r| format!("?{r}"))
    );
    let mut page = RetrievalPage {
        c: v.chrome("retrieval", "nav.retrieval", &path),
        all,
        max_top_k: s.limits.max_top_k,
        ran: false,
        error: None,
        hits: Vec::new(),
        took: String::new(),
        log: Vec::new(),
        p,
    };
    if !page.p.q.trim().is_empty() {
        page.ran = true;
        match run(&s, &v, &page.p).await {
            Ok((hits, took)) => {
                page.hits = hits;
                page.took = format!("{took:.1} ms");
            }
            Err(e) => page.error = Some(page.c.t.get(&e).to_owned()),
        }
    }
    page.log = s
        .console
        .queries
        .recent(LOG_SHOWN)
        .into_iter()
        .map(|e| LogRow {
            at: datetime(e.at_ms),
            source: e.source,
            who: e.who,
            query: e.query,
            mode: e.mode,
            collections: e.collections,
            hits: e.hits,
            ms: format!("{:.1}", e.ms),
        })
        .collect();
    Ok(html(&page))
}

/// Runs the test search; an error is a catalog key or the knowledge base's message.
async fn run(s: &AppState, v: &Viewer, p: &Params) -> Result<(Vec<HitRow>, f64), String> {
    if p.top_k == 0 || p.top_k > s.limits.max_top_k {
        return Err("retrieval.bad_top_k".into());
    }
    if p.collections.is_empty() {
        return Err("retrieval.no_collection".into());
    }
    let mode = match p.mode.as_str() {
        "bm25" => SearchMode::Bm25,
        "dense" => SearchMode::Dense,
        _ => SearchMode::Hybrid,
    };
    let fusion = if p.fusion == "weighted" {
        FusionMode::Weighted
    } else {
        FusionMode::Rrf { k: DEFAULT_RRF_K }
    };
    let metadata: Vec<(String, String)> = p
        .filters
        .lines()
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .filter(|(k, _)| !k.is_empty())
        .collect();
    let reqs: Vec<SearchRequest> = p
        .collections
        .iter()
        .map(|c| {
            let mut r = SearchRequest::new(c, p.q.clone());
            r.k = p.top_k;
            r.mode = mode;
            r.fusion = fusion;
            r.bm25_weight = p.bm25_weight.clamp(0.0, 10.0);
            r.dense_weight = p.dense_weight.clamp(0.0, 10.0);
            r.metadata = metadata.clone();
            r
        })
        .collect();
    let t = Instant::now();
    let hits =
        s.kb.call(move |kb| {
            let found = kb.search_many(&reqs)?;
            Ok::<_, engram_kb::KbError>(
                found
                    .into_iter()
                    .map(|(i, h)| (reqs[i].collection.clone(), h))
                    .collect::<Vec<_>>(),
            )
        })
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| e.to_string())?;
    let took = t.elapsed().as_secs_f64() * 1e3;
    s.console.queries.record(
        "console",
        &v.user,
        &p.q,
        &p.mode,
        &p.collections,
        hits.len(),
        took,
    );
    let rows = hits
        .into_iter()
        .enumerate()
        .map(|(i, (c, h))| HitRow {
            rank: i + 1,
            doc_href: format!(
                "/console/kb/{}/doc/{}#chunk-{}",
                enc(&c),
                h.doc_id,
                h.chunk_id
            ),
            collection: c,
            doc_name: h.doc_name.clone(),
            ordinal: h.ordinal,
            chars: format!("{}..{}", h.chars.start, h.chars.end),
            page: h.page.map_or_else(String::new, |p| p.to_string()),
            fused: score(Some(h.score)),
            bm25: score(h.bm25),
            dense: score(h.dense),
            pieces: pieces(&h.text, &h.highlights),
        })
        .collect();
    Ok((rows, took))
}

#[cfg(test)]
mod tests {
    #[test]
    fn highlights_split_the_text() {
        let p = super::pieces("paid leave per year", &[5..10, 30..40]);
        let s: Vec<_> = p.iter().map(|p| (p.text.as_str(), p.hit)).collect();
        assert_eq!(s, [("paid ", false), ("leave", true), (" per year", false)]);
    }
}
