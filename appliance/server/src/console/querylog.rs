//! Recent retrieval queries, from the console's retrieval test and from the API
//! (`/api/v1/search`, Dify `/retrieval`), kept in memory for the retrieval page.

use std::collections::VecDeque;
use std::sync::Mutex;

use super::users::now_ms;

/// Queries kept: a screenful of history; older ones fall off.
const KEPT: usize = 200;
/// Characters of a query kept: enough to recognise it, bounded memory.
const QUERY_CHARS: usize = 200;

/// One logged query.
#[derive(Clone, Debug)]
pub struct QueryEntry {
    pub at_ms: u64,
    /// `console`, `api` or `dify`.
    pub source: &'static str,
    /// The console user or the API key id.
    pub who: String,
    pub query: String,
    pub mode: String,
    pub collections: String,
    pub hits: usize,
    pub ms: f64,
}

/// A bounded ring of the newest queries.
#[derive(Default)]
pub struct QueryLog {
    entries: Mutex<VecDeque<QueryEntry>>,
}

impl QueryLog {
    /// Records one query.
    #[allow(clippy::too_many_arguments)]
    pub fn record(
        &self,
        source: &'static str,
        who: &str,
        query: &str,
        mode: &str,
        collections: &[String],
        hits: usize,
        ms: f64,
    ) {
        let e = QueryEntry {
            at_ms: now_ms(),
            source,
            who: who.to_owned(),
            query: query.chars().take(QUERY_CHARS).collect(),
            mode: mode.to_owned(),
            collections: collections.join(", "),
            hits,
            ms,
        };
        let mut q = self.entries.lock().expect("query log lock");
        if q.len() == KEPT {
            q.pop_back();
        }
        q.push_front(e);
    }

    /// Newest first.
    pub fn recent(&self, n: usize) -> Vec<QueryEntry> {
        self.entries
            .lock()
            .expect("query log lock")
            .iter()
            .take(n)
            .cloned()
            .collect()
    }
}
