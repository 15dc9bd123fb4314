//! End-to-end tests against a real `engramd` bound to 127.0.0.1:0, with the real models
//! (`$ENGRAM_MODELS_DIR`, default `<workspace>/models`) and a temporary data directory.
//!
//! One server serves every test (loading the models once); it is set up with collections
//! `a` (one document) and `b` (one document) and three keys: admin, a key granted only `a`
//! (search + qa), and a search-only key. Generations use 4-8 tokens to keep the suite fast.

mod common;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::OnceLock;
use std::time::Duration;

use common::Resp;
use engram_server::{KeyStore, Scope};
use serde_json::{json, Value};

struct Server {
    addr: SocketAddr,
    admin: String,
    only_a: String,
    search_only: String,
    _dir: tempfile::TempDir,
}

/// Upload limit of the test server, small so the 413 test is cheap.
const TEST_UPLOAD_LIMIT: usize = 1 << 20;

/// Starts the test daemon on `data_dir` (a small upload limit, short generations, a generous
/// failed-key budget); its address.
/// The engine queue of the test daemon (the 2-core profile's, on any machine).
const TEST_QUEUE: usize = 8;

fn start(data_dir: &Path) -> SocketAddr {
    common::start_daemon(
        &format!(
            "[limits]\nmax_upload_bytes = {TEST_UPLOAD_LIMIT}\nmax_tokens = 64\nqueue_depth = {TEST_QUEUE}\n\
             [auth]\nfailures_per_minute = 100000\n[kv]\ndram_mib = 64\nnvme_gib = 1\n\
             [storage]\nreserve_mib = 16\n"
        ),
        data_dir,
    )
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = tempfile::tempdir().unwrap();
        let keys = KeyStore::new(dir.path());
        let (_, admin) = keys.create(vec![Scope::Admin], None).unwrap();
        let (_, only_a) = keys
            .create(vec![Scope::Search, Scope::Qa], Some(vec!["a".into()]))
            .unwrap();
        let (_, search_only) = keys.create(vec![Scope::Search], None).unwrap();
        let addr = start(dir.path());
        let s = Server {
            addr,
            admin,
            only_a,
            search_only,
            _dir: dir,
        };
        for (coll, name, text) in [
            ("a", "leave.md", "# Leave policy\n\nEvery employee gets 25 days of paid leave per year. Unused leave expires in March."),
            ("b", "secret.md", "# Project Falcon\n\nProject Falcon launches in October with a budget of four million."),
        ] {
            let r = s.call("POST", "/api/v1/collections", Some(&s.admin), Some(json!({"name": coll})));
            assert_eq!(r.status, 201, "{}", r.text());
            let r = s.call(
                "POST",
                &format!("/api/v1/collections/{coll}/documents/text"),
                Some(&s.admin),
                Some(json!({"name": name, "text": text, "metadata": {"dept": "hr"}})),
            );
            assert_eq!(r.status, 202, "{}", r.text());
            let id = r.json()["documents"][0]["id"].as_u64().unwrap();
            s.wait_for_stage(coll, id, "done");
        }
        s
    })
}

impl Server {
    /// Polls a document until it reaches `stage` (or a final stage, which must be it);
    /// returns the stages seen on the way.
    fn wait_for_stage(&self, coll: &str, id: u64, stage: &str) -> Vec<String> {
        let mut seen: Vec<String> = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(300);
        loop {
            let r = self.call(
                "GET",
                &format!("/api/v1/collections/{coll}/documents/{id}"),
                Some(&self.admin),
                None,
            );
            assert_eq!(r.status, 200, "{}", r.text());
            let now = r.json()["stage"].as_str().unwrap().to_owned();
            if seen.last() != Some(&now) {
                seen.push(now.clone());
            }
            if now == stage {
                return seen;
            }
            assert!(
                !matches!(now.as_str(), "done" | "failed"),
                "document {id} ended {now}, not {stage}: {}",
                r.text()
            );
            assert!(std::time::Instant::now() < deadline, "{id} stuck at {now}");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn call(&self, method: &str, path: &str, key: Option<&str>, body: Option<Value>) -> Resp {
        let body = body.map(|b| ("application/json", serde_json::to_vec(&b).unwrap()));
        self.raw(method, path, key, body)
    }

    /// One HTTP/1.1 request (see [`common::request`]).
    fn raw(
        &self,
        method: &str,
        path: &str,
        key: Option<&str>,
        body: Option<(&str, Vec<u8>)>,
    ) -> Resp {
        common::request(self.addr, method, path, key, body)
    }
}

/// Every authenticated route, with a body where it takes one.
fn routes() -> Vec<(&'static str, &'static str)> {
    vec![
        ("GET", "/api/v1/collections"),
        ("POST", "/api/v1/collections"),
        ("GET", "/api/v1/collections/a"),
        ("DELETE", "/api/v1/collections/a"),
        ("GET", "/api/v1/collections/a/documents"),
        ("POST", "/api/v1/collections/a/documents"),
        ("POST", "/api/v1/collections/a/documents/text"),
        ("GET", "/api/v1/collections/a/documents/1"),
        ("DELETE", "/api/v1/collections/a/documents/1"),
        ("GET", "/api/v1/collections/a/documents/1/chunks"),
        ("POST", "/api/v1/collections/a/documents/1/cancel"),
        ("POST", "/api/v1/collections/a/documents/1/reindex"),
        ("POST", "/api/v1/search"),
        ("POST", "/api/v1/qa"),
        ("GET", "/api/v1/openapi.json"),
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/embeddings"),
        ("POST", "/retrieval"),
        ("GET", "/readyz"),
        ("GET", "/metrics"),
        ("POST", "/api/v1/admin/backup"),
        ("GET", "/api/v1/admin/version"),
        ("POST", "/api/v1/admin/restore"),
    ]
}

/// A multipart body of file parts, `(file name, bytes)`, and its content type.
fn multipart_files(files: &[(&str, &[u8])]) -> (String, Vec<u8>) {
    let boundary = "EnGrAmTeStBoUnDaRy";
    let mut body = Vec::new();
    for (name, bytes) in files {
        body.extend_from_slice(
            format!(
                "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n\r\n"
            )
            .as_bytes(),
        );
        body.extend_from_slice(bytes);
        body.extend_from_slice(b"\r\n");
    }
    body.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    (format!("multipart/form-data; boundary={boundary}"), body)
}

#[test]
fn healthz_needs_no_key() {
    let s = server();
    let r = s.call("GET", "/healthz", None, None);
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "ok");
}

#[test]
fn every_route_rejects_missing_and_wrong_keys() {
    let s = server();
    let wrong_id = "egk_AAAAAAAA_BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB";
    // A real key id with a wrong secret: the argon2 path.
    let wrong_secret = format!("{}x", &s.search_only[..s.search_only.len() - 1]);
    let wrong_secret = if wrong_secret == s.search_only {
        format!("{}y", &s.search_only[..s.search_only.len() - 1])
    } else {
        wrong_secret
    };
    for (method, path) in routes() {
        for key in [
            None,
            Some(wrong_id),
            Some(wrong_secret.as_str()),
            Some("not-a-key"),
        ] {
            let r = s.call(method, path, key, Some(json!({})));
            if path == "/retrieval" {
                // Dify's contract: 403 with its error codes.
                assert_eq!(r.status, 403, "{path} with {key:?}: {}", r.text());
                let code = r.json()["error_code"].as_u64();
                let want = if key.is_some() { 1002 } else { 1001 };
                assert_eq!(code, Some(want), "{path} with {key:?}: {}", r.text());
                continue;
            }
            assert_eq!(r.status, 401, "{method} {path} with {key:?}: {}", r.text());
            assert_eq!(r.error_type(), "unauthorized", "{method} {path}");
            assert!(r.header("www-authenticate").is_some());
        }
    }
}

#[test]
fn collection_grants_are_enforced() {
    let s = server();
    let k = &s.only_a;
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(k),
        Some(json!({"query": "Falcon", "collections": ["b"]})),
    );
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(r.error_type(), "forbidden");
    let r = s.call(
        "POST",
        "/api/v1/qa",
        Some(k),
        Some(
            json!({"question": "When does Falcon launch?", "collections": ["b"], "max_tokens": 4}),
        ),
    );
    assert_eq!(r.status, 403, "{}", r.text());
    let r = s.call("POST", "/retrieval", Some(k), Some(json!({"knowledge_id": "b", "query": "Falcon", "retrieval_setting": {"top_k": 2, "score_threshold": 0.0}})));
    assert_eq!(r.status, 403);
    assert_eq!(r.json()["error_code"], 1002, "{}", r.text());
    let r = s.call("POST", "/v1/chat/completions", Some(k), Some(json!({"messages": [{"role": "user", "content": "Falcon?"}], "engram": {"collections": ["a", "b"]}, "max_tokens": 4})));
    assert_eq!(r.status, 403);
    let r = s.call("GET", "/api/v1/collections/b/documents", Some(k), None);
    assert_eq!(r.status, 403);
    // Listing shows only the granted collection.
    let r = s.call("GET", "/api/v1/collections", Some(k), None);
    let names: Vec<String> = r.json()["collections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, vec!["a"]);
    // Scopes: a search-only key cannot ask or ingest.
    let r = s.call(
        "POST",
        "/api/v1/qa",
        Some(&s.search_only),
        Some(json!({"question": "x", "collections": ["a"], "max_tokens": 4})),
    );
    assert_eq!(r.status, 403);
    let r = s.call(
        "POST",
        "/api/v1/collections/a/documents/text",
        Some(&s.search_only),
        Some(json!({"name": "x.md", "text": "x"})),
    );
    assert_eq!(r.status, 403);
}

#[test]
fn uploaded_text_is_listed_and_searchable() {
    let s = server();
    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "c"})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let r = s.call(
        "POST",
        "/api/v1/collections/c/documents/text",
        Some(&s.admin),
        Some(json!({"name": "kiwi.md", "text": "# Kiwi\n\nThe kiwi is a flightless bird native to New Zealand.", "metadata": {"kind": "bird"}})),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let doc = r.json()["documents"][0].clone();
    assert_eq!(doc["outcome"], "queued");
    assert_eq!(doc["stage"], "queued");
    let id = doc["id"].as_u64().unwrap();
    s.wait_for_stage("c", id, "done");
    let r = s.call(
        "GET",
        "/api/v1/collections/c/documents",
        Some(&s.admin),
        None,
    );
    let docs = r.json()["documents"].as_array().unwrap().clone();
    assert_eq!(docs.len(), 1);
    assert_eq!(docs[0]["stage"], "done");
    assert!(docs[0]["stages"].as_array().unwrap().len() >= 2);
    let r = s.call(
        "GET",
        &format!("/api/v1/collections/c/documents/{id}/chunks"),
        Some(&s.admin),
        None,
    );
    assert!(!r.json()["chunks"].as_array().unwrap().is_empty());
    for mode in ["bm25", "dense", "hybrid"] {
        let r = s.call(
            "POST",
            "/api/v1/search",
            Some(&s.search_only),
            Some(json!({"query": "flightless bird", "collections": ["c"], "top_k": 3, "mode": mode, "filters": {"kind": "bird"}})),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let hit = &r.json()["hits"][0];
        assert_eq!(hit["document"]["name"], "kiwi.md", "{mode}");
        assert!(hit["span"]["chars"].is_array());
    }
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.search_only),
        Some(json!({"query": "bird", "collections": ["c"], "filters": {"kind": "fish"}})),
    );
    assert!(r.json()["hits"].as_array().unwrap().is_empty());
    // Dify.
    let r = s.call("POST", "/retrieval", Some(&s.search_only), Some(json!({"knowledge_id": "c", "query": "kiwi", "retrieval_setting": {"top_k": 2, "score_threshold": 0.0}})));
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r.json()["records"][0]["content"]
        .as_str()
        .unwrap()
        .contains("kiwi"));
    // Delete the document, then the collection.
    let r = s.call(
        "DELETE",
        &format!("/api/v1/collections/c/documents/{id}"),
        Some(&s.admin),
        None,
    );
    assert_eq!(r.status, 200);
    let r = s.call(
        "GET",
        &format!("/api/v1/collections/c/documents/{id}"),
        Some(&s.admin),
        None,
    );
    assert_eq!(r.status, 404);
    assert_eq!(r.error_type(), "not_found");
    assert_eq!(
        s.call("DELETE", "/api/v1/collections/c", Some(&s.admin), None)
            .status,
        204
    );
}

#[test]
fn multipart_upload_and_size_limit() {
    let s = server();
    let boundary = "XyZbOuNdArY";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"metadata\"\r\n\r\n{{\"src\":\"mp\"}}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"tea.txt\"\r\nContent-Type: text/plain\r\n\r\n\
         Green tea is steeped at eighty degrees for two minutes.\r\n--{boundary}--\r\n"
    );
    let ct = format!("multipart/form-data; boundary={boundary}");
    let r = s.raw(
        "POST",
        "/api/v1/collections/a/documents",
        Some(&s.admin),
        Some((&ct, body.into_bytes())),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(r.json()["documents"][0]["outcome"], "queued");
    let id = r.json()["documents"][0]["id"].as_u64().unwrap();
    s.wait_for_stage("a", id, "done");
    let big = vec![b'a'; TEST_UPLOAD_LIMIT + 10];
    let r = s.raw(
        "POST",
        "/api/v1/collections/a/documents/text",
        Some(&s.admin),
        Some(("application/json", big)),
    );
    assert_eq!(r.status, 413, "{}", r.text());
    assert_eq!(r.error_type(), "payload_too_large");
}

#[test]
fn qa_returns_an_answer_with_citations() {
    let s = server();
    let r = s.call(
        "POST",
        "/api/v1/qa",
        Some(&s.only_a),
        Some(json!({"question": "How many days of paid leave?", "collections": ["a"], "top_k": 2, "max_tokens": 6})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["answer"].is_string());
    assert_eq!(v["citations"][0]["doc_name"], "leave.md");
    let first_token = v["timings"]["first_token_ms"].as_f64().unwrap();
    assert!(first_token > 0.0);
    // The first text that went out: at or after the first token (an answer's start may be
    // held back until its checks decide).
    let first_visible = v["timings"]["first_visible_ms"].as_f64().unwrap();
    assert!(first_visible >= first_token, "{v}");
    assert!(v["timings"]["retrieve_ms"].is_number());
    assert!(v["timings"]["answer_rules"].is_array(), "{v}");
}

#[test]
fn qa_stream_ends_with_done() {
    let s = server();
    let r = s.call(
        "POST",
        "/api/v1/qa",
        Some(&s.only_a),
        Some(json!({"question": "When does unused leave expire?", "collections": ["a"], "top_k": 2, "max_tokens": 4, "stream": true})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    // With its charset: Python's `requests` reads a `text/` type without one as ISO-8859-1.
    assert_eq!(
        r.header("content-type"),
        Some("text/event-stream; charset=utf-8")
    );
    let text = r.text();
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert!(events.contains(&"token"), "{text}");
    assert_eq!(
        &events[events.len() - 3..],
        ["citations", "timings", "done"],
        "{text}"
    );
}

#[test]
fn openai_chat_json_and_stream() {
    let s = server();
    let r = s.call(
        "POST",
        "/v1/chat/completions",
        Some(&s.only_a),
        Some(json!({"model": "engram", "messages": [{"role": "user", "content": "How many leave days?"}], "max_tokens": 4, "engram": {"collections": ["a"], "top_k": 1}})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "chat.completion");
    assert!(v["choices"][0]["message"]["content"].is_string());
    assert_eq!(v["citations"][0]["collection"], "a");
    let r = s.call(
        "POST",
        "/v1/chat/completions",
        Some(&s.only_a),
        Some(json!({"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}], "max_tokens": 4, "stream": true})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let text = r.text();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*data.last().unwrap(), "[DONE]", "{text}");
    let first: Value = serde_json::from_str(data[0]).unwrap();
    assert_eq!(first["object"], "chat.completion.chunk");
    let last: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert!(last["choices"][0]["finish_reason"].is_string(), "{text}");
    // stream_options.include_usage: one more chunk, with the usage and no choices.
    let r = s.call(
        "POST",
        "/v1/chat/completions",
        Some(&s.only_a),
        Some(
            json!({"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4,
            "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    let text = r.text();
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    let usage: Value = serde_json::from_str(data[data.len() - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]), "{text}");
    let u = &usage["usage"];
    assert!(u["prompt_tokens"].as_u64().unwrap() > 0, "{text}");
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap())
    );
    let finish: Value = serde_json::from_str(data[data.len() - 3]).unwrap();
    assert!(finish["choices"][0]["finish_reason"].is_string(), "{text}");
}

#[test]
fn openai_models_and_embeddings() {
    let s = server();
    let r = s.call("GET", "/v1/models", Some(&s.search_only), None);
    assert_eq!(r.status, 200);
    let ids: Vec<String> = r.json()["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids[0], "engram");
    let embedder = ids
        .iter()
        .find(|id| id.starts_with("all-MiniLM-L6-v2@"))
        .expect("the embedder's id")
        .clone();
    // The embedder answers to its plain name, `engram` and OpenAI's names (what clients send
    // by default), each listed once.
    for name in [
        "all-MiniLM-L6-v2",
        "text-embedding-ada-002",
        "text-embedding-3-small",
    ] {
        assert_eq!(ids.iter().filter(|id| *id == name).count(), 1, "{ids:?}");
    }
    for model in [
        embedder.as_str(),
        "all-MiniLM-L6-v2",
        "engram",
        "text-embedding-ada-002",
        "text-embedding-3-small",
    ] {
        let r = s.call(
            "POST",
            "/v1/embeddings",
            Some(&s.search_only),
            Some(json!({"input": "paid leave", "model": model})),
        );
        assert_eq!(r.status, 200, "{model}: {}", r.text());
    }
    let r = s.call(
        "POST",
        "/v1/embeddings",
        Some(&s.search_only),
        Some(json!({"input": "paid leave", "model": "gpt-4o"})),
    );
    assert_eq!(r.error_type(), "model_not_found");
    for id in &ids {
        let r = s.call(
            "GET",
            &format!("/v1/models/{id}"),
            Some(&s.search_only),
            None,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["id"], id.as_str());
    }
    let r = s.call("GET", "/v1/models/gpt-4o", Some(&s.search_only), None);
    assert_eq!(r.status, 404);
    assert_eq!(r.error_type(), "model_not_found");
    let r = s.call(
        "POST",
        "/v1/embeddings",
        Some(&s.search_only),
        Some(json!({"input": "x", "dimensions": 256})),
    );
    assert_eq!(r.status, 400);
    assert!(r.text().contains("`dimensions`"), "{}", r.text());
    let r = s.call(
        "POST",
        "/v1/embeddings",
        Some(&s.search_only),
        Some(json!({"input": ["hello", "world"]})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["data"].as_array().unwrap().len(), 2);
    assert_eq!(v["data"][0]["embedding"].as_array().unwrap().len(), 384);
    // cl100k_base token ids (what OpenAI's clients send): read back as text, so the same vector
    // as the text. tiktoken: "hello world" = [15339, 1917], "hello" = [15339].
    let embed = |input: Value| {
        let r = s.call(
            "POST",
            "/v1/embeddings",
            Some(&s.search_only),
            Some(json!({"input": input})),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d["embedding"].clone())
            .collect::<Vec<_>>()
    };
    let text = embed(json!(["hello world", "hello"]));
    assert_eq!(embed(json!([[15339, 1917], [15339]])), text);
    assert_eq!(embed(json!([15339, 1917])), text[..1]);
    for bad in [
        json!([[15339, 999_999]]),
        json!([[1.5]]),
        json!([[]]),
        json!([]),
        // As OpenAI: no embedding of nothing.
        json!(""),
        json!(["paid leave", ""]),
    ] {
        let r = s.call(
            "POST",
            "/v1/embeddings",
            Some(&s.search_only),
            Some(json!({"input": bad})),
        );
        assert_eq!(r.status, 400, "{bad}: {}", r.text());
        assert!(r.text().contains("`input`"), "{}", r.text());
    }
}

#[test]
fn errors_share_one_shape() {
    let s = server();
    let r = s.raw(
        "POST",
        "/api/v1/search",
        Some(&s.search_only),
        Some(("application/json", b"{not json".to_vec())),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.error_type(), "invalid_json");
    let r = s.raw(
        "POST",
        "/api/v1/search",
        Some(&s.search_only),
        Some(("text/plain", b"{}".to_vec())),
    );
    assert_eq!(r.error_type(), "invalid_json");
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.search_only),
        Some(json!({"query": "x", "collections": ["a"], "top_k": 0})),
    );
    assert_eq!(
        (r.status, r.error_type().as_str()),
        (400, "invalid_request")
    );
    // A copy bias outside 0..=10 is refused by name before anything is retrieved.
    let r = s.call(
        "POST",
        "/api/v1/qa",
        Some(&s.admin),
        Some(json!({"question": "x", "collections": ["a"], "max_tokens": 8, "copy_bias": 11})),
    );
    assert_eq!(
        (r.status, r.error_type().as_str()),
        (400, "invalid_request")
    );
    assert!(r.text().contains("copy_bias"), "{}", r.text());
    let r = s.call("GET", "/api/v1/nowhere", Some(&s.admin), None);
    assert_eq!((r.status, r.error_type().as_str()), (404, "not_found"));
    let r = s.call("PUT", "/api/v1/search", Some(&s.admin), Some(json!({})));
    assert_eq!(r.status, 405);
    assert_eq!(r.error_type(), "method_not_allowed");
    let r = s.call("GET", "/api/v1/collections/none", Some(&s.admin), None);
    assert_eq!((r.status, r.error_type().as_str()), (404, "not_found"));
    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "a"})),
    );
    assert_eq!((r.status, r.error_type().as_str()), (409, "conflict"));
    // A value that does not fit names its field in plain words, not Rust's types or serde's
    // position ("expected usize at line 1 column 77").
    let r = s.call(
        "POST",
        "/api/v1/qa",
        Some(&s.admin),
        Some(json!({"question": "x", "collections": ["a"], "max_tokens": -1})),
    );
    assert_eq!(
        (r.status, r.error_type().as_str()),
        (400, "invalid_request")
    );
    assert_eq!(
        r.json()["error"]["message"],
        "invalid `max_tokens`: expected a whole number, 0 or more, got integer -1"
    );
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.admin),
        Some(json!({"query": "x", "collections": ["a"], "mode": "fuzzy"})),
    );
    assert_eq!(
        r.json()["error"]["message"],
        "invalid `mode`: unknown value \"fuzzy\"; expected one of bm25, dense, hybrid"
    );
    let r = s.call(
        "POST",
        "/v1/chat/completions",
        Some(&s.admin),
        Some(json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1})),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("max_tokens") && !r.text().contains("usize"),
        "{}",
        r.text()
    );
    // A head larger than the daemon reads: the same shape (hyper's own 431 had no body).
    let big = format!("Bearer {}", "k".repeat(1 << 20));
    let r = common::send(
        s.addr,
        "GET",
        "/api/v1/collections",
        &[("Authorization", &big)],
        None,
    );
    assert_eq!(
        (r.status, r.error_type().as_str()),
        (431, "headers_too_large"),
        "{}",
        r.text()
    );
}

#[test]
fn uploads_no_parser_reads_are_refused_naming_what_is_read() {
    let s = server();
    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "formats"})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    // A GIF's signature and header: binary, no format Engram reads (OCR reads PNG, JPEG and
    // TIFF).
    let png: &[u8] = b"GIF89a\x10\0\x10\0\x80\0\0\xff\xff\xff\0\0\0!\xf9\x04";
    let (ct, body) = multipart_files(&[("scan.gif", png)]);
    let r = s.raw(
        "POST",
        "/api/v1/collections/formats/documents",
        Some(&s.admin),
        Some((&ct, body)),
    );
    assert_eq!(
        (r.status, r.error_type().as_str()),
        (415, "unsupported_media_type"),
        "{}",
        r.text()
    );
    let message = r.json()["error"]["message"].as_str().unwrap().to_owned();
    assert!(
        message.contains("scan.gif") && message.contains("PDF, DOCX, HTML, Markdown or plain text"),
        "{message}"
    );
    // Beside a readable file: that one is queued, the image refused by name, nothing stored
    // of it.
    let (ct, body) = multipart_files(&[
        ("scan.gif", png),
        ("notes.txt", b"The loading dock closes at six."),
    ]);
    let r = s.raw(
        "POST",
        "/api/v1/collections/formats/documents",
        Some(&s.admin),
        Some((&ct, body)),
    );
    assert_eq!(r.status, 207, "{}", r.text());
    let docs = r.json()["documents"].as_array().unwrap().clone();
    assert_eq!(docs[0]["outcome"], "failed", "{docs:?}");
    assert!(docs[0]["id"].is_null(), "{docs:?}");
    assert!(docs[0]["reason"]
        .as_str()
        .unwrap()
        .contains("unsupported format"));
    assert_eq!(docs[1]["outcome"], "queued", "{docs:?}");
    let r = s.call(
        "GET",
        "/api/v1/collections/formats/documents",
        Some(&s.admin),
        None,
    );
    let names: Vec<String> = r.json()["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, ["notes.txt"], "{}", r.text());
    let id = docs[1]["id"].as_u64().unwrap();
    s.wait_for_stage("formats", id, "done");
}

#[test]
fn readyz_and_metrics() {
    let s = server();
    let r = s.call("GET", "/readyz", Some(&s.search_only), None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["ready"], true);
    // The GPUs found at start, or why none is usable; generation runs on the CPU here (no
    // GPU, or a build without `cuda`), saying why.
    let gpu = &r.json()["gpu"];
    assert_eq!(gpu["serving"], "cpu", "{gpu}");
    assert!(gpu["placement"].is_null(), "{gpu}");
    assert!(
        !gpu["serving_reason"].as_str().unwrap_or("").is_empty(),
        "{gpu}"
    );
    assert!(
        gpu["available"].is_boolean() && gpu["devices"].is_array(),
        "{gpu}"
    );
    // The default build, the one the package ships, has GPU support (the `cuda` feature).
    assert_eq!(gpu["cuda_compiled"], cfg!(feature = "cuda"), "{gpu}");
    if gpu["available"] == false {
        assert!(!gpu["reason"].as_str().unwrap_or("").is_empty(), "{gpu}");
    }
    let r = s.call("GET", "/metrics", Some(&s.search_only), None);
    assert_eq!(r.status, 403);
    let r = s.call("GET", "/metrics", Some(&s.admin), None);
    assert_eq!(r.status, 200);
    let text = r.text();
    assert!(text.contains("engram_http_requests_total"), "{text}");
    assert!(text.contains("engram_generation_queue_depth"));
    assert!(text.contains("engram_gpu_devices"), "{text}");
    // Every answer rule is counted from the start, at 0 until it changes an answer.
    assert!(
        text.contains("engram_answer_rule_total{rule=\"bare_polar\"}"),
        "{text}"
    );
    let r = s.call("GET", "/api/v1/openapi.json", Some(&s.search_only), None);
    assert_eq!(r.json()["openapi"], "3.1.0");
}

#[test]
fn uploads_are_queued_then_processed_and_can_be_cancelled_or_reindexed() {
    let s = server();
    // Small chunks: the big document has a few hundred, embedded 16 per step.
    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "q", "chunk_tokens": 32, "overlap_tokens": 0})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let long: String = (0..400)
        .map(|i| {
            format!("Section {i}. The reservoir level is checked at gauge {i} every hour.\n\n")
        })
        .collect();
    let boundary = "QqQbOuNdArY";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big.md\"\r\n\r\n{long}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"small.md\"\r\n\r\n\
         Small note: the spillway opens at 90 percent.\r\n--{boundary}--\r\n"
    );
    let ct = format!("multipart/form-data; boundary={boundary}");
    let r = s.raw(
        "POST",
        "/api/v1/collections/q/documents",
        Some(&s.admin),
        Some((&ct, body.into_bytes())),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let docs = r.json()["documents"].as_array().unwrap().clone();
    for d in &docs {
        assert_eq!(d["outcome"], "queued", "{d}");
        assert_eq!(d["stage"], "queued", "{d}");
    }
    let (big, small) = (
        docs[0]["id"].as_u64().unwrap(),
        docs[1]["id"].as_u64().unwrap(),
    );
    // The small one waits while the big one is embedded: cancel it while it is queued.
    let r = s.call(
        "POST",
        &format!("/api/v1/collections/q/documents/{small}/cancel"),
        Some(&s.admin),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stage"], "failed");
    assert_eq!(r.json()["error"], "cancelled");
    assert_eq!(r.json()["failure"], "cancelled");
    // The big one goes through visible stages; a search in between answers.
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.admin),
        Some(json!({"query": "reservoir", "collections": ["q"]})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = s.wait_for_stage("q", big, "done");
    assert_eq!(seen.last().map(String::as_str), Some("done"));
    let r = s.call(
        "GET",
        &format!("/api/v1/collections/q/documents/{big}"),
        Some(&s.admin),
        None,
    );
    let stages: Vec<String> = r.json()["stages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["stage"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        stages,
        [
            "queued",
            "parsing",
            "chunking",
            "embedding",
            "indexing",
            "done"
        ]
    );
    // Done: cannot be cancelled. The cancelled one can be re-indexed, then it is found.
    let r = s.call(
        "POST",
        &format!("/api/v1/collections/q/documents/{big}/cancel"),
        Some(&s.admin),
        None,
    );
    assert_eq!(r.status, 409, "{}", r.text());
    assert_eq!(r.error_type(), "conflict");
    let r = s.call(
        "POST",
        "/api/v1/collections/q/documents/small.md/reindex",
        Some(&s.admin),
        None,
    );
    assert_eq!(r.status, 202, "{}", r.text());
    assert_eq!(r.json()["stage"], "queued");
    s.wait_for_stage("q", small, "done");
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.admin),
        Some(json!({"query": "spillway", "collections": ["q"], "mode": "bm25"})),
    );
    assert_eq!(
        r.json()["hits"][0]["document"]["name"],
        "small.md",
        "{}",
        r.text()
    );
    // A search-only key cannot cancel or re-index.
    let r = s.call(
        "POST",
        &format!("/api/v1/collections/q/documents/{big}/reindex"),
        Some(&s.search_only),
        None,
    );
    assert_eq!(r.status, 403);
    // The chunk KV stage ran for the indexed chunks (the engine is otherwise idle here).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    loop {
        let m = s.call("GET", "/metrics", Some(&s.admin), None).text();
        let kv = m
            .lines()
            .filter(|l| l.starts_with("engram_ingested_total{outcome=\"kv_"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>();
        if kv > 0.0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no chunk KV computed:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        s.call("DELETE", "/api/v1/collections/q", Some(&s.admin), None)
            .status,
        204
    );
}

/// Decode steps that served more than one sequence so far (continuous batching).
fn batched_steps(s: &Server) -> u64 {
    let text = s.call("GET", "/metrics", Some(&s.admin), None).text();
    let value = |prefix: &str| -> u64 {
        text.lines()
            .find_map(|l| l.strip_prefix(prefix))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or_else(|| panic!("{prefix} missing from /metrics")) as u64
    };
    value("engram_decode_batch_size_count ") - value("engram_decode_batch_size_bucket{le=\"1\"} ")
}

#[test]
fn concurrent_chats_share_decode_steps_and_answer_as_they_do_alone() {
    let s = server();
    let prompts = [
        "Name three colours.",
        "What is the capital of France?",
        "Count from one to five.",
    ];
    let ask = |p: &str| -> String {
        let r = s.call(
            "POST",
            "/v1/chat/completions",
            Some(&s.admin),
            Some(json!({"messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0})),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let alone: Vec<String> = prompts.iter().map(|p| ask(p)).collect();
    let before = batched_steps(s);
    let together: Vec<String> = std::thread::scope(|sc| {
        let handles: Vec<_> = prompts.iter().map(|p| sc.spawn(move || ask(p))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // A sequence's logits do not depend on what else is in its batch (greedy, so the text
    // is the same too).
    assert_eq!(together, alone);
    assert!(
        batched_steps(s) > before,
        "three concurrent chats never shared a decode step"
    );
}

/// Issue 16.1: the same bytes under several names, through the multipart and the text routes,
/// are several documents; every acknowledged id stays resolvable, `done` and searchable.
#[test]
fn duplicate_content_under_other_names_is_kept_through_every_route() {
    let s = server();
    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "dup"})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let text = "The chlorine dosing pump of the east reservoir is calibrated every spring.";
    let boundary = "DuPbOuNdArY";
    let body = format!(
        "--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.txt\"\r\n\r\n{text}\r\n\
         --{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"b.txt\"\r\n\r\n{text}\r\n--{boundary}--\r\n"
    );
    let ct = format!("multipart/form-data; boundary={boundary}");
    let r = s.raw(
        "POST",
        "/api/v1/collections/dup/documents",
        Some(&s.admin),
        Some((&ct, body.into_bytes())),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let mut ids: Vec<u64> = r.json()["documents"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| {
            assert_eq!(d["outcome"], "queued", "{d}");
            d["id"].as_u64().unwrap()
        })
        .collect();
    let upload_text = |name: &str| {
        let r = s.call(
            "POST",
            "/api/v1/collections/dup/documents/text",
            Some(&s.admin),
            Some(json!({"name": name, "text": text})),
        );
        assert_eq!(r.status, 202, "{}", r.text());
        r.json()["documents"][0].clone()
    };
    let c = upload_text("c.txt");
    assert_eq!(c["outcome"], "queued", "{c}");
    ids.push(c["id"].as_u64().unwrap());
    for &id in &ids {
        s.wait_for_stage("dup", id, "done");
    }
    // After processing: a fourth name is a fourth document; a known name is unchanged.
    let d = upload_text("d.txt");
    assert_eq!(d["outcome"], "queued", "{d}");
    ids.push(d["id"].as_u64().unwrap());
    let again = upload_text("a.txt");
    assert_eq!(again["outcome"], "unchanged", "{again}");
    assert_eq!(again["id"].as_u64(), Some(ids[0]));
    s.wait_for_stage("dup", ids[3], "done");
    let distinct: std::collections::HashSet<u64> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), 4, "{ids:?}");
    for &id in &ids {
        let r = s.call(
            "GET",
            &format!("/api/v1/collections/dup/documents/{id}"),
            Some(&s.admin),
            None,
        );
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["stage"], "done");
    }
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.admin),
        Some(json!({"query": "chlorine dosing pump", "collections": ["dup"], "top_k": 10})),
    );
    let found: std::collections::HashSet<u64> = r.json()["hits"]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h["document"]["id"].as_u64().unwrap())
        .collect();
    assert_eq!(found, distinct, "{}", r.text());
    assert_eq!(
        s.call("DELETE", "/api/v1/collections/dup", Some(&s.admin), None)
            .status,
        204
    );
}

/// A metric's value (summed over the label sets whose line starts with `prefix`).
fn metric(s: &Server, prefix: &str) -> f64 {
    s.call("GET", "/metrics", Some(&s.admin), None)
        .text()
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

/// Issue 16.3: while a large document is embedded, its progress shows, searches are answered
/// (the document still in the pipeline), and deleting it stops the work within a batch.
#[test]
fn a_large_document_shows_progress_and_stops_when_deleted() {
    let s = server();
    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "large", "chunk_tokens": 32, "overlap_tokens": 0})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let long: String = (0..600)
        .map(|i| format!("Section {i}. Gauge {i} of the canal is read at dawn and at dusk.\n\n"))
        .collect();
    let r = s.call(
        "POST",
        "/api/v1/collections/large/documents/text",
        Some(&s.admin),
        Some(json!({"name": "canal.md", "text": long})),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let id = r.json()["documents"][0]["id"].as_u64().unwrap();
    let path = format!("/api/v1/collections/large/documents/{id}");
    // Embedding, with a few chunks done.
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let progress = loop {
        let d = s.call("GET", &path, Some(&s.admin), None).json();
        if d["stage"] == "embedding" && d["progress"]["chunks_embedded"].as_u64() > Some(0) {
            break d["progress"].clone();
        }
        assert_ne!(
            d["stage"], "done",
            "the document finished before it could be observed"
        );
        assert!(std::time::Instant::now() < deadline, "{d}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let total = progress["chunks"].as_u64().unwrap();
    assert!(total > 100, "{progress}");
    assert_eq!(progress["text_bytes_chunked"], progress["text_bytes"]);
    // A search is answered while the document is still in the pipeline.
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.admin),
        Some(json!({"query": "paid leave", "collections": ["a"]})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let d = s.call("GET", &path, Some(&s.admin), None).json();
    assert_eq!(d["stage"], "embedding", "{d}");
    // Deleting it stops the preparer: at most the batch under way (16 chunks) is embedded
    // afterwards, plus the odd small document of a test running beside this one.
    let embedded = || metric(s, "engram_ingest_chunks_total{stage=\"embedded\"}");
    let t0 = embedded();
    std::thread::sleep(Duration::from_secs(3));
    let working = embedded() - t0;
    let r = s.call("DELETE", &path, Some(&s.admin), None);
    assert_eq!(r.status, 200, "{}", r.text());
    let t1 = embedded();
    std::thread::sleep(Duration::from_secs(3));
    let after = embedded() - t1;
    assert!(
        after <= 24.0,
        "{after} chunks embedded in the 3 s after the delete ({working} in the 3 s before)"
    );
    assert_eq!(s.call("GET", &path, Some(&s.admin), None).status, 404);
    assert_eq!(
        s.call("DELETE", "/api/v1/collections/large", Some(&s.admin), None)
            .status,
        204
    );
}

/// Issue 16.7 and the upload status contract: an oversized query or question is a 400 naming
/// the field; an upload where some documents failed is a 207, one where all failed is the
/// failure's own status (never a 202 that reads as success).
#[test]
fn oversized_queries_and_failed_uploads_are_errors() {
    let s = server();
    let long = "pump ".repeat(1000);
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.admin),
        Some(json!({"query": long, "collections": ["a"]})),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(
        r.text().contains("`query`") && r.text().contains("max_query_bytes"),
        "{}",
        r.text()
    );
    let r = s.call(
        "POST",
        "/api/v1/qa",
        Some(&s.admin),
        Some(json!({"question": long, "collections": ["a"], "max_tokens": 4})),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("`question`"), "{}", r.text());
    let r = s.call(
        "POST",
        "/retrieval",
        Some(&s.admin),
        Some(json!({"knowledge_id": "a", "query": long, "retrieval_setting": {"top_k": 2}})),
    );
    assert_eq!(r.status, 400, "{}", r.text());

    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "partial"})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let bad_name = "n".repeat(1100);
    let (ct, body) = multipart_files(&[
        (&bad_name, b"refused"),
        ("partial-ok.txt", b"The partial upload keeps this one."),
    ]);
    let r = s.raw(
        "POST",
        "/api/v1/collections/partial/documents",
        Some(&s.admin),
        Some((&ct, body)),
    );
    assert_eq!(r.status, 207, "{}", r.text());
    let docs = r.json()["documents"].as_array().unwrap().clone();
    assert_eq!(docs[0]["outcome"], "failed");
    assert!(docs[0]["reason"]
        .as_str()
        .unwrap()
        .contains("document name"));
    assert_eq!(docs[1]["outcome"], "queued");
    let (ct, body) = multipart_files(&[(&bad_name, b"refused")]);
    let r = s.raw(
        "POST",
        "/api/v1/collections/partial/documents",
        Some(&s.admin),
        Some((&ct, body)),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.error_type(), "invalid_request");
    let id = docs[1]["id"].as_u64().unwrap();
    s.wait_for_stage("partial", id, "done");
    assert_eq!(
        s.call(
            "DELETE",
            "/api/v1/collections/partial",
            Some(&s.admin),
            None
        )
        .status,
        204
    );
}

#[test]
fn a_backup_taken_while_serving_restores_into_a_working_daemon() {
    use engram_server::backup;
    let s = server();
    let r = s.call("POST", "/api/v1/admin/backup", Some(&s.search_only), None);
    assert_eq!(r.status, 403, "{}", r.text());
    let r = s.call("POST", "/api/v1/admin/backup", Some(&s.admin), None);
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("application/zstd"));
    // Named by its UTC time (engram-backup-20261207T101500Z.tar.zst), not epoch seconds.
    let disposition = r.header("content-disposition").unwrap();
    let name = disposition
        .split("filename=\"")
        .nth(1)
        .and_then(|n| n.strip_suffix('"'))
        .unwrap();
    let stamp = name
        .strip_prefix("engram-backup-")
        .and_then(|n| n.strip_suffix("Z.tar.zst"))
        .unwrap_or_else(|| panic!("{disposition}"));
    assert!(
        stamp.len() == 15
            && stamp.as_bytes()[8] == b'T'
            && stamp.starts_with("20")
            && stamp.chars().filter(char::is_ascii_digit).count() == 14,
        "{disposition}"
    );
    let m = backup::verify(&r.body[..]).unwrap();
    assert_eq!(
        (m.format.as_str(), m.version, m.kv),
        ("engram-backup", 1, false)
    );
    for want in ["keys.json", "catalog/db", "collections/"] {
        assert!(
            m.files.iter().any(|f| f.path.starts_with(want)),
            "{want} missing from {:?}",
            m.files.iter().map(|f| &f.path).collect::<Vec<_>>()
        );
    }
    assert!(m
        .files
        .iter()
        .all(|f| !f.path.ends_with("LOCK") && !f.path.ends_with(".lock")));

    let dir = tempfile::tempdir().unwrap();
    let target = dir.path().join("data");
    backup::restore(&r.body[..], &target).unwrap();
    let again = backup::restore(&r.body[..], &target).unwrap_err();
    assert!(again.to_string().contains("not empty"), "{again}");

    // A daemon on the restored directory: the same keys, collections and documents, searchable.
    let restored = Server {
        addr: start(&target),
        admin: s.admin.clone(),
        only_a: s.only_a.clone(),
        search_only: s.search_only.clone(),
        _dir: dir,
    };
    let r = restored.call(
        "GET",
        "/api/v1/collections/a/documents/leave.md",
        Some(&restored.admin),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["stage"], "done");
    let r = restored.call(
        "POST",
        "/api/v1/search",
        Some(&restored.only_a),
        Some(json!({"query": "paid leave per year", "collections": ["a"], "mode": "bm25"})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["hits"][0]["document"]["name"], "leave.md");
}

#[test]
fn the_version_and_its_history_are_served_to_admins() {
    let s = server();
    let r = s.call("GET", "/api/v1/admin/version", Some(&s.search_only), None);
    assert_eq!(r.status, 403, "{}", r.text());
    let r = s.call("GET", "/api/v1/admin/version", Some(&s.admin), None);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["version"], engram_server::versions::version());
    assert_eq!(v["formats"]["catalog_schema"], engram_kb::SCHEMA_VERSION);
    // This data directory's first start is its install.
    let history = v["history"].as_array().unwrap();
    assert_eq!(history.len(), 1, "{v}");
    assert_eq!(history[0]["kind"], "install");
    assert_eq!(history[0]["version"], engram_server::versions::version());
    assert!(history[0]["previous"].is_null());
}

#[test]
fn a_restore_is_verified_and_staged_for_the_next_start() {
    use engram_server::backup;
    let s = server();
    let zstd = |b: &[u8]| Some(("application/zstd", b.to_vec()));
    let r = s.raw("POST", "/api/v1/admin/restore", Some(&s.only_a), zstd(b"x"));
    assert_eq!(r.status, 403, "{}", r.text());
    let archive = s.call("POST", "/api/v1/admin/backup", Some(&s.admin), None);
    assert_eq!(archive.status, 200, "{}", archive.text());
    // Damaged: refused, nothing staged.
    let cut = &archive.body[..archive.body.len() / 2];
    let r = s.raw("POST", "/api/v1/admin/restore", Some(&s.admin), zstd(cut));
    assert_eq!(r.status, 400, "{}", r.text());
    assert_eq!(r.json()["error"]["type"], "invalid_request", "{}", r.text());
    assert!(!backup::restore_staged(s._dir.path()));
    // Whole: staged beside the served data, which goes on being served.
    let r = s.raw(
        "POST",
        "/api/v1/admin/restore",
        Some(&s.admin),
        zstd(&archive.body),
    );
    assert_eq!(r.status, 202, "{}", r.text());
    let v = r.json();
    assert_eq!(v["staged"], true);
    assert_eq!(v["engram_version"], engram_server::versions::version());
    assert!(v["files"].as_u64().unwrap() > 3, "{v}");
    assert!(backup::restore_staged(s._dir.path()));
    let r = s.call(
        "GET",
        "/api/v1/collections/a/documents/leave.md",
        Some(&s.admin),
        None,
    );
    assert_eq!(r.status, 200, "{}", r.text());
}

/// Dify's External Knowledge API as Dify's client calls it (`api/services/external_knowledge_service.py`:
/// a JSON POST to `{endpoint}/retrieval` with `Authorization: Bearer`), and the answers its
/// client reads: records with scores in [0, 1] that a threshold of 0.5 keeps, and errors as
/// `{"error_code", "error_msg"}`.
#[test]
fn difys_external_knowledge_contract() {
    let s = server();
    let ask = |key: Option<&str>, body: Value| s.call("POST", "/retrieval", key, Some(body));
    let request = |kb: &str, threshold: f64, condition: Value| {
        json!({
            "knowledge_id": kb,
            "query": "How many days of paid leave do employees get per year?",
            "retrieval_setting": {"top_k": 4, "score_threshold": threshold},
            "metadata_condition": condition,
        })
    };
    // Dify's default threshold once enabled, 0.5: the relevant chunk passes it.
    let r = ask(Some(&s.only_a), request("a", 0.5, Value::Null));
    assert_eq!(r.status, 200, "{}", r.text());
    let records = r.json()["records"].as_array().unwrap().clone();
    assert!(!records.is_empty(), "nothing passed 0.5: {}", r.text());
    for rec in &records {
        let score = rec["score"].as_f64().unwrap();
        assert!((0.5..=1.0).contains(&score), "{rec}");
        assert!(
            rec["content"].is_string() && rec["title"].is_string(),
            "{rec}"
        );
    }
    assert_eq!(records[0]["metadata"]["path"], "leave.md");
    // A threshold above every score keeps nothing; 0 keeps what the ranking found.
    let r = ask(Some(&s.only_a), request("a", 0.99, Value::Null));
    assert_eq!(r.json()["records"], json!([]), "{}", r.text());
    // Metadata condition on `path`, the field the records carry.
    let on_path = |p: &str| {
        json!({"logical_operator": "and", "conditions": [
            {"name": ["path"], "comparison_operator": "is", "value": p}]})
    };
    let r = ask(Some(&s.only_a), request("a", 0.0, on_path("leave.md")));
    let records = r.json()["records"].as_array().unwrap().clone();
    assert!(!records.is_empty(), "{}", r.text());
    assert!(records.iter().all(|x| x["metadata"]["path"] == "leave.md"));
    let r = ask(Some(&s.only_a), request("a", 0.0, on_path("nothing.md")));
    assert_eq!(r.json()["records"], json!([]), "{}", r.text());
    // Errors, in Dify's shape and statuses.
    let error = |r: &Resp| (r.status, r.json()["error_code"].as_u64().unwrap_or(0));
    assert_eq!(
        error(&ask(None, request("a", 0.0, Value::Null))),
        (403, 1001)
    );
    let wrong = "egk_AAAAAAAA_BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBB";
    assert_eq!(
        error(&ask(Some(wrong), request("a", 0.0, Value::Null))),
        (403, 1002)
    );
    let r = ask(Some(&s.admin), request("no-such-kb", 0.0, Value::Null));
    assert_eq!(error(&r), (404, 2001), "{}", r.text());
    assert!(r.json()["error_msg"]
        .as_str()
        .unwrap()
        .contains("no-such-kb"));
    assert!(r.json().get("error").is_none(), "only Dify's fields");
}

/// Every OpenAI chat parameter is honoured or refused by name: nothing is accepted and
/// ignored.
#[test]
fn openai_chat_parameters_are_honoured_or_refused_by_name() {
    let s = server();
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 16, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        s.call("POST", "/v1/chat/completions", Some(&s.admin), Some(body))
    };
    for (param, value) in [
        ("n", json!(0)),
        ("n", json!(17)),
        ("top_logprobs", json!(3)),
        ("presence_penalty", json!(2.5)),
        ("frequency_penalty", json!(-3)),
        ("logit_bias", json!({"50256": -100, "word": 1})),
        ("logit_bias", json!({"1000000": 5})),
        ("logit_bias", json!({"12": 101})),
        ("logit_bias", json!([12])),
        ("response_format", json!({"type": "xml"})),
        ("tools", json!({"type": "function"})),
        ("tool_choice", json!("required")),
        ("top_p", json!(0)),
        ("stop", json!(["a", "b", "c", "d", "e"])),
        ("functions", json!([])),
    ] {
        let r = chat(json!({ param: value }));
        assert_eq!(r.status, 400, "{param}: {}", r.text());
        assert!(
            r.text().contains(&format!("`{param}`")),
            "{param}: {}",
            r.text()
        );
    }
    let r = chat(json!({"model": "gpt-4o"}));
    assert_eq!(r.status, 404, "{}", r.text());
    assert_eq!(r.error_type(), "model_not_found");
    // Accepted with their no-op values; `engram` names the served model.
    let plain = chat(
        json!({"model": "engram", "n": 1, "logprobs": false, "presence_penalty": 0,
        "frequency_penalty": 0, "logit_bias": {}, "response_format": {"type": "text"},
        "tools": [], "user": "u-1", "top_p": 1}),
    );
    assert_eq!(plain.status, 200, "{}", plain.text());
    let answer = plain.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    // `stop`: the answer ends before the first stop string, with finish_reason stop.
    let cut_at = answer.char_indices().nth(4).map(|(i, _)| i).unwrap();
    let stop: String = answer[cut_at..].chars().take(2).collect();
    let r = chat(json!({"stop": stop}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let first = answer.find(&stop).unwrap();
    assert_eq!(
        v["choices"][0]["message"]["content"],
        answer[..first].trim()
    );
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() < 16);
    // `max_completion_tokens` wins over `max_tokens`.
    let r = chat(json!({"max_completion_tokens": 3}));
    assert!(r.json()["usage"]["completion_tokens"].as_u64().unwrap() <= 3);
    // `top_p` with a seed: sampled, and the same seed gives the same answer.
    let sampled = |seed: u64| {
        let r = chat(json!({"temperature": 1.0, "top_p": 0.9, "seed": seed}));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["message"]["content"].clone()
    };
    assert_eq!(sampled(7), sampled(7));
}

/// `response_format` json_object and json_schema: the answer always parses and follows the
/// schema (constrained decoding), streamed or not; what cannot be enforced is a 400 naming it.
#[test]
fn openai_structured_output_parses_and_validates() {
    let s = server();
    // The body is sent as written: a `Value` would sort the schema's properties.
    let chat = |content: &str, format: &str, stream: bool| {
        let body = format!(
            r#"{{"messages": [{{"role": "user", "content": {}}}], "max_tokens": 64,
                "temperature": 0, "stream": {stream}, "response_format": {format}}}"#,
            json!(content)
        );
        s.raw(
            "POST",
            "/v1/chat/completions",
            Some(&s.admin),
            Some(("application/json", body.into_bytes())),
        )
    };
    let content = |r: &Resp| {
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let object = content(&chat(
        "Describe a cat.",
        r#"{"type": "json_object"}"#,
        false,
    ));
    let v: Value = serde_json::from_str(&object).unwrap_or_else(|e| panic!("{object}: {e}"));
    assert!(v.is_object(), "{object}");
    // Properties come in the schema's order (written here out of alphabetical order).
    let schema = r#"{"type": "json_schema", "json_schema": {"name": "person", "strict": true,
        "schema": {"type": "object", "additionalProperties": false,
            "properties": {"name": {"type": "string", "maxLength": 24},
                "born": {"type": "integer"},
                "role": {"enum": ["mathematician", "poet", "other"]},
                "known_for": {"type": "array", "maxItems": 2,
                    "items": {"type": "string", "maxLength": 24}}},
            "required": ["name", "born", "role", "known_for"]}}}"#;
    let question = "Ada Lovelace, born 1815, wrote the first computer program.";
    let text = content(&chat(question, schema, false));
    let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text}: {e}"));
    assert!(v["name"].as_str().unwrap().chars().count() <= 24, "{text}");
    assert!(v["born"].is_i64(), "{text}");
    assert!(["mathematician", "poet", "other"].contains(&v["role"].as_str().unwrap()));
    assert!(v["known_for"].as_array().unwrap().len() <= 2);
    let order: Vec<usize> = ["\"name\"", "\"born\"", "\"role\"", "\"known_for\""]
        .iter()
        .map(|k| text.find(k).unwrap())
        .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{text}");
    // Streamed: the same text in pieces.
    let r = chat(question, schema, true);
    assert_eq!(r.status, 200, "{}", r.text());
    let streamed: String = r
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect();
    assert_eq!(streamed.trim(), text);
    // A keyword the grammar cannot enforce, a bad type, and retrieval: refused by name.
    let r = chat(
        "x",
        r#"{"type": "json_schema", "json_schema": {"name": "n",
            "schema": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0}}}}}"#,
        false,
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let why = r.text();
    assert!(
        why.contains("`minimum`") && why.contains("#/properties/age"),
        "{why}"
    );
    assert!(why.contains("response_format.json_schema.schema"), "{why}");
    let r = chat(
        "x",
        r#"{"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "thing"}}}"#,
        false,
    );
    assert_eq!(r.status, 400, "{}", r.text());
    let r = s.call(
        "POST",
        "/v1/chat/completions",
        Some(&s.admin),
        Some(
            json!({"messages": [{"role": "user", "content": "leave?"}], "max_tokens": 4,
            "response_format": {"type": "json_object"}, "engram": {"collections": ["a"]}}),
        ),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("`response_format`"), "{}", r.text());
}

/// `tools`: a call is generated under the grammar of the tools' parameters (its arguments parse
/// and validate), named or required or left to the model; the conversation goes on with the
/// tool's answer.
#[test]
fn openai_tool_calls() {
    let s = server();
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"], "additionalProperties": false}}}]);
    let chat = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "max_tokens": 64, "temperature": 0, "tools": tools});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        s.call("POST", "/v1/chat/completions", Some(&s.admin), Some(body))
    };
    for choice in [
        json!("required"),
        json!({"type": "function", "function": {"name": "get_weather"}}),
    ] {
        let r = chat(json!({"tool_choice": choice}));
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert!(c["message"]["content"].is_null(), "{v}");
        let call = &c["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert!(call["id"].as_str().unwrap().starts_with("call_"));
        assert_eq!(call["function"]["name"], "get_weather");
        let args: Value =
            serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
        assert!(
            args["city"]
                .as_str()
                .is_some_and(|c| c.chars().count() <= 30),
            "{args}"
        );
        assert_eq!(args.as_object().unwrap().len(), 1, "{args}");
    }
    // Streamed: the call in one delta, then finish_reason tool_calls.
    let r = chat(json!({"tool_choice": "required", "stream": true}));
    let events: Vec<Value> = r
        .text()
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let call = events
        .iter()
        .find_map(|e| e["choices"][0]["delta"]["tool_calls"].get(0).cloned())
        .expect("a tool_calls delta");
    assert_eq!(
        (call["index"].clone(), call["function"]["name"].clone()),
        (json!(0), json!("get_weather"))
    );
    assert_eq!(
        events.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    // The tool's answer goes back in: the model answers (in text, or with another call).
    let r = chat(json!({"messages": [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"}]}));
    assert_eq!(r.status, 200, "{}", r.text());
    let finish = r.json()["choices"][0]["finish_reason"].clone();
    assert!(
        ["stop", "length", "tool_calls"].contains(&finish.as_str().unwrap()),
        "{}",
        r.text()
    );
    // tool_choice none: plain text, the tools not offered.
    let r = chat(json!({"tool_choice": "none"}));
    assert!(
        r.json()["choices"][0]["message"]["content"].is_string(),
        "{}",
        r.text()
    );
    // Refused by name.
    for (extra, field) in [
        (
            json!({"tools": [{"type": "function", "function": {"name": "get weather!"}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "code_interpreter"}]}),
            "tools[0].type",
        ),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "launch"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f",
            "parameters": {"type": "string", "pattern": "x"}}}]}),
            "tools",
        ),
        (
            json!({"response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (json!({"engram": {"collections": ["a"]}}), "tools"),
    ] {
        let r = chat(extra.clone());
        assert_eq!(r.status, 400, "{extra}: {}", r.text());
        assert!(
            r.text().contains(&format!("`{field}`")),
            "{extra}: {}",
            r.text()
        );
    }
}

/// A conversation continued with its history does not prefill the history again: each turn's
/// `cached_tokens` covers the previous turn's prompt and answer.
#[test]
fn conversation_turns_reuse_the_history_kv() {
    let s = server();
    let mut messages =
        vec![json!({"role": "system", "content": "You are a terse geography tutor."})];
    let mut previous_total = 0;
    for (turn, q) in [
        "What is the capital of Peru?",
        "And of Chile?",
        "Which is further south?",
    ]
    .into_iter()
    .enumerate()
    {
        messages.push(json!({"role": "user", "content": q}));
        let r = s.call(
            "POST",
            "/v1/chat/completions",
            Some(&s.admin),
            Some(json!({"messages": messages, "max_tokens": 12, "temperature": 0})),
        );
        assert_eq!(r.status, 200, "{}", r.text());
        let v = r.json();
        let usage = &v["usage"];
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap();
        let prompt = usage["prompt_tokens"].as_u64().unwrap();
        assert!(cached < prompt, "{usage}");
        if turn > 0 {
            // The previous turn's prompt and answer, less what re-tokenizing the answer and
            // the template's end of turn may change.
            assert!(
                cached + 4 >= previous_total,
                "turn {turn}: {usage}, before {previous_total}"
            );
        }
        previous_total = usage["total_tokens"].as_u64().unwrap();
        let answer = v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
        messages.push(json!({"role": "assistant", "content": answer}));
    }
    let metrics = s.call("GET", "/metrics", Some(&s.admin), None).text();
    let hits: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("engram_prefix_cache_tokens_total{result=\"hit\"} "))
        .expect("the prefix cache's hit counter")
        .parse()
        .unwrap();
    assert!(hits > 0.0, "{metrics}");
}

#[test]
fn openai_text_completions() {
    let s = server();
    let complete = |extra: Value| {
        let mut body = json!({"model": "engram", "prompt": "The capital of France is",
            "max_tokens": 6, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        s.call("POST", "/v1/completions", Some(&s.only_a), Some(body))
    };
    let r = complete(json!({}));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "text_completion");
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    assert!(!text.is_empty(), "{v}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() <= 6);
    // Greedy: the same text again, and streamed pieces that add up to it.
    assert_eq!(
        complete(json!({})).json()["choices"][0]["text"],
        text.as_str()
    );
    let r = complete(json!({"stream": true, "stream_options": {"include_usage": true}}));
    let body = r.text();
    let data: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let streamed: String = data
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed, text);
    assert!(
        data.last().unwrap()["usage"]["total_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{body}"
    );
    for (param, value) in [
        ("logprobs", json!(6)),
        ("best_of", json!(17)),
        ("n", json!(17)),
        ("suffix", json!("end")),
        ("logit_bias", json!({"-1": -100})),
        ("frequency_penalty", json!(2.01)),
        ("prompt", json!([-1, 2])),
        ("prompt", json!([[1, 2], {"a": 1}])),
        ("prompt", json!([])),
        ("prompt", json!([49152])),
        ("prompt", json!(7)),
        ("functions", json!([])),
    ] {
        let r = complete(json!({ param: value }));
        assert_eq!(r.status, 400, "{param}: {}", r.text());
        assert!(
            r.text().contains(&format!("`{param}`")),
            "{param}: {}",
            r.text()
        );
    }
    assert_eq!(complete(json!({"model": "davinci-002"})).status, 404);
    // Combinations that cannot be honoured.
    for (param, extra) in [
        ("best_of", json!({"n": 3, "best_of": 2})),
        ("best_of", json!({"best_of": 2, "stream": true})),
    ] {
        let r = complete(extra);
        assert_eq!(r.status, 400, "{param}: {}", r.text());
        assert!(r.text().contains(&format!("`{param}`")), "{}", r.text());
    }
}

/// `echo` with `logprobs`: the prompt's own tokens scored (what evaluation harnesses ask with
/// `max_tokens: 0`), the first token without a log probability, the rest as the model gives
/// them: a greedy continuation, echoed back as prompt, scores as it did when generated.
#[test]
fn openai_echo_scores_the_prompt() {
    let s = server();
    let call = |body: Value| {
        let r = s.call("POST", "/v1/completions", Some(&s.only_a), Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
        r
    };
    let prompt = "The capital of France is";
    let gen =
        call(json!({"prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0})).json();
    let cont = gen["choices"][0]["text"].as_str().unwrap().to_owned();
    let gen_lps = gen["choices"][0]["logprobs"].clone();
    let whole = format!("{prompt}{cont}");
    let v = call(json!({"prompt": whole, "max_tokens": 0, "echo": true, "logprobs": 2})).json();
    let c = &v["choices"][0];
    assert_eq!(c["text"], whole.as_str(), "{v}");
    assert_eq!(c["finish_reason"], "length", "{v}");
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    let lp = &c["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), whole, "the prompt's tokens, no BOS: {lp}");
    assert!(
        lp["token_logprobs"][0].is_null() && lp["top_logprobs"][0].is_null(),
        "{lp}"
    );
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap())
        .collect();
    assert_eq!(offsets[0], 0);
    assert!(offsets.windows(2).all(|w| w[0] <= w[1]), "{offsets:?}");
    for (t, top) in lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .zip(lp["top_logprobs"].as_array().unwrap())
        .skip(1)
    {
        let t = t.as_f64().unwrap();
        assert!(t <= 0.0, "{lp}");
        // The best alternative is at least as likely as the token written.
        let best = top
            .as_object()
            .unwrap()
            .values()
            .map(|l| l.as_f64().unwrap())
            .fold(f64::NEG_INFINITY, f64::max);
        assert!(best >= t - 1e-4, "{top} vs {t}");
    }
    // The continuation's tokens (the text splits into the same ones), scored as prompt, score
    // as they did when generated.
    let gen_tokens = gen_lps["tokens"].as_array().unwrap();
    let k = gen_tokens.len();
    assert_eq!(
        &lp["tokens"].as_array().unwrap()[tokens.len() - k..],
        gen_tokens.as_slice()
    );
    let scored = &lp["token_logprobs"].as_array().unwrap()[tokens.len() - k..];
    for (a, b) in scored
        .iter()
        .zip(gen_lps["token_logprobs"].as_array().unwrap())
    {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!(
            (a - b).abs() < 0.05,
            "prefill {a} vs decode {b}: {lp} {gen_lps}"
        );
    }
    // With generation after the prompt: the prompt's entries, then the generated ones, the
    // same streamed.
    let body = json!({"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": true,
        "logprobs": 1});
    let v = call(body.clone()).json();
    let entries = v["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .clone();
    let text = v["choices"][0]["text"].as_str().unwrap().to_owned();
    assert!(text.starts_with(prompt), "{v}");
    let generated = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    let prompt_entries = entries.len() - generated;
    let joined: String = entries[..prompt_entries]
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(joined, prompt, "{v}");
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let objects = sse_objects(&call(streamed).text());
    let all: Vec<Value> = objects
        .iter()
        .flat_map(|o| {
            o["choices"][0]["logprobs"]["tokens"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(all, entries);
    let streamed_text: String = objects
        .iter()
        .filter_map(|o| o["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(streamed_text, text);
    // `max_tokens: 0` without `echo` stays refused.
    let r = s.call(
        "POST",
        "/v1/completions",
        Some(&s.only_a),
        Some(json!({"prompt": prompt, "max_tokens": 0})),
    );
    assert_eq!(r.status, 400, "{}", r.text());
}

/// A token array prompt is the served model's ids taken as they are, and a batch of prompts
/// gets `n` choices each, numbered prompt by prompt: what lm-evaluation-harness's
/// `local-completions` sends by default (a batch of token arrays, `echo` with `logprobs` and
/// one token to score a continuation).
#[test]
fn openai_token_prompts_and_batches() {
    let s = server();
    let tok = default_tokenizer();
    let call = |body: Value| {
        let r = s.call("POST", "/v1/completions", Some(&s.only_a), Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()
    };
    let texts = ["The capital of France is", "One, two, three,"];
    // The ids the engine would run for each text (BOS where the model adds one).
    let ids: Vec<Vec<u32>> = texts
        .iter()
        .map(|t| tok.encode_prompt(t).unwrap())
        .collect();
    let greedy = json!({"max_tokens": 6, "temperature": 0});
    let with = |prompt: Value| {
        let mut b = greedy.clone();
        b["prompt"] = prompt;
        b
    };
    let by_text: Vec<Value> = texts.iter().map(|t| call(with(json!(t)))).collect();
    // One token array: the same text and usage as its text.
    let one = call(with(json!(ids[0])));
    assert_eq!(
        one["choices"][0]["text"], by_text[0]["choices"][0]["text"],
        "{one}"
    );
    assert_eq!(one["usage"], by_text[0]["usage"], "{one}");
    // A batch, of token arrays and of strings: choice `i` answers prompt `i`, usage sums them.
    for batch in [json!(ids), json!(texts)] {
        let v = call(with(batch));
        let choices = v["choices"].as_array().unwrap();
        assert_eq!(choices.len(), 2, "{v}");
        for (i, c) in choices.iter().enumerate() {
            assert_eq!(c["index"], i, "{v}");
            assert_eq!(c["text"], by_text[i]["choices"][0]["text"], "{v}");
        }
        for field in ["prompt_tokens", "completion_tokens"] {
            let sum: u64 = by_text
                .iter()
                .map(|b| b["usage"][field].as_u64().unwrap())
                .sum();
            assert_eq!(v["usage"][field], sum, "{field}: {v}");
        }
    }
    // `n` choices each, numbered prompt by prompt, sampled; streamed the same way.
    let mut sampled = with(json!(ids));
    sampled["n"] = json!(2);
    sampled["temperature"] = json!(1.0);
    sampled["seed"] = json!(3);
    let v = call(sampled.clone());
    let got: Vec<&str> = v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(got.len(), 4, "{v}");
    let alone = call({
        let mut b = sampled.clone();
        b["prompt"] = json!(ids[1]);
        b
    });
    assert_eq!(got[2], alone["choices"][0]["text"], "{v} {alone}");
    assert_eq!(got[3], alone["choices"][1]["text"], "{v} {alone}");
    sampled["stream"] = json!(true);
    let r = s.call("POST", "/v1/completions", Some(&s.only_a), Some(sampled));
    assert_eq!(r.status, 200, "{}", r.text());
    let mut streamed = vec![String::new(); 4];
    for o in sse_objects(&r.text()) {
        let c = &o["choices"][0];
        streamed[c["index"].as_u64().unwrap() as usize].push_str(c["text"].as_str().unwrap());
    }
    assert_eq!(streamed, got);
    // Scoring as the harness does: a batch of one token array (context and continuation),
    // `echo`, `logprobs: 1`, one token. Every sent id is an entry, the first without a log
    // probability; the ids after the text's own match its echo's scores.
    let v = call(
        json!({"prompt": [ids[0]], "max_tokens": 1, "temperature": 0, "echo": true,
        "logprobs": 1}),
    );
    let c = &v["choices"][0];
    let lp = &c["logprobs"];
    let entries = lp["tokens"].as_array().unwrap();
    assert_eq!(entries.len(), ids[0].len() + 1, "{v}");
    assert!(lp["token_logprobs"][0].is_null(), "{lp}");
    let joined: String = entries.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(joined, c["text"], "{v}");
    let text_echo = call(
        json!({"prompt": texts[0], "max_tokens": 1, "temperature": 0,
        "echo": true, "logprobs": 1}),
    );
    let text_lps = text_echo["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap()
        .clone();
    // The text's echo leaves out a BOS the engine added; the token prompt sent it.
    let skip = entries.len() - text_lps.len();
    for (a, b) in lp["token_logprobs"].as_array().unwrap()[skip + 1..]
        .iter()
        .zip(&text_lps[1..])
    {
        let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
        assert!((a - b).abs() < 1e-4, "{a} vs {b}: {v} {text_echo}");
    }
    // Too many candidates in one request: refused, naming the prompt.
    let r = s.call(
        "POST",
        "/v1/completions",
        Some(&s.only_a),
        Some(json!({"prompt": vec![ids[0].clone(); 5], "n": 16, "max_tokens": 1})),
    );
    assert_eq!(r.status, 400, "{}", r.text());
    assert!(r.text().contains("`prompt`"), "{}", r.text());
}

/// A request of more choices than the engine queue holds could never be queued: refused with
/// a 400 naming what to change, not a 429 to retry forever.
#[test]
fn openai_choices_beyond_the_queue_are_refused() {
    let s = server();
    let over = TEST_QUEUE + 1;
    for (path, body, param) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Hi"}], "n": over, "max_tokens": 1}),
            "n",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "n": over, "max_tokens": 1}),
            "n",
        ),
        (
            "/v1/completions",
            json!({"prompt": "Hi", "best_of": over, "max_tokens": 1}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": vec!["Hi"; over], "max_tokens": 1}),
            "prompt",
        ),
    ] {
        let r = s.call("POST", path, Some(&s.only_a), Some(body));
        assert_eq!(r.status, 400, "{path} {param}: {}", r.text());
        assert!(r.text().contains(&format!("`{param}`")), "{}", r.text());
        assert!(r.text().contains("queue"), "{}", r.text());
    }
    // As many as it holds are served (once the other tests' jobs leave room: they share the
    // daemon).
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let r = loop {
        let r = s.call(
            "POST",
            "/v1/completions",
            Some(&s.only_a),
            Some(json!({"prompt": vec!["Hi"; TEST_QUEUE], "max_tokens": 1})),
        );
        if r.status != 429 || std::time::Instant::now() > deadline {
            break r;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["choices"].as_array().unwrap().len(), TEST_QUEUE);
}

/// The `data:` objects of an SSE body, without `[DONE]`.
fn sse_objects(body: &str) -> Vec<Value> {
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
    body.lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect()
}

/// OpenAI's `n` (several choices, each reproducible by its seed, streamed interleaved by
/// index), `best_of` (the candidates with the highest mean token log probability) and `echo`.
#[test]
fn openai_several_choices() {
    let s = server();
    let call = |path: &str, body: Value| {
        let r = s.call("POST", path, Some(&s.only_a), Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
        r
    };
    let ask = json!({"messages": [{"role": "user", "content": "Write a short poem about rain."}],
        "max_tokens": 10, "temperature": 1.0, "seed": 5, "n": 3, "logprobs": true});
    let v = call("/v1/chat/completions", ask.clone()).json();
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3, "{v}");
    let mut tokens = 0;
    let mut texts = Vec::new();
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        tokens += c["logprobs"]["content"].as_array().unwrap().len();
        texts.push(c["message"]["content"].as_str().unwrap().to_owned());
    }
    // Usage: the prompt once, every choice's tokens.
    assert_eq!(v["usage"]["completion_tokens"], tokens, "{v}");
    assert!(texts[0] != texts[1] || texts[1] != texts[2], "{texts:?}");
    // Choice 1 is the single answer seeded with seed + 1.
    let mut one = ask.clone();
    one["n"] = json!(1);
    one["seed"] = json!(6);
    let single = call("/v1/chat/completions", one).json();
    assert_eq!(
        single["choices"][0]["message"]["content"],
        texts[1].as_str()
    );
    // Streamed: each choice's role, pieces and finish under its index, the usage once.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let objects = sse_objects(&call("/v1/chat/completions", streamed).text());
    let mut pieces = vec![String::new(); 3];
    let mut finishes = [0; 3];
    let mut roles = [0; 3];
    for o in &objects[..objects.len() - 1] {
        let c = &o["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        pieces[i].push_str(c["delta"]["content"].as_str().unwrap_or(""));
        roles[i] += usize::from(c["delta"]["role"] == "assistant");
        finishes[i] += usize::from(c["finish_reason"].is_string());
    }
    assert_eq!((roles, finishes), ([1; 3], [1; 3]), "{objects:?}");
    for (p, t) in pieces.iter().zip(&texts) {
        assert_eq!(p.trim(), t, "{objects:?}");
    }
    // The same tokens (how many the prefix cache served differs by then).
    let usage = &objects.last().unwrap()["usage"];
    for field in ["prompt_tokens", "completion_tokens"] {
        assert_eq!(usage[field], v["usage"][field], "{usage}");
    }

    // Text completions: `best_of` returns the candidates of highest mean log probability.
    let prompt = "Once upon a time";
    let base = json!({"prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 11});
    let mut all = base.clone();
    all["n"] = json!(4);
    all["logprobs"] = json!(0);
    let all = call("/v1/completions", all).json();
    let mut ranked: Vec<(f64, String)> = all["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let lps = c["logprobs"]["token_logprobs"].as_array().unwrap();
            let sum: f64 = lps.iter().map(|l| l.as_f64().unwrap()).sum();
            (
                sum / lps.len() as f64,
                c["text"].as_str().unwrap().to_owned(),
            )
        })
        .collect();
    ranked.sort_by(|a, b| b.0.total_cmp(&a.0));
    let mut best = base.clone();
    best["n"] = json!(2);
    best["best_of"] = json!(4);
    let best = call("/v1/completions", best).json();
    let got: Vec<&str> = best["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap())
        .collect();
    assert_eq!(got, [ranked[0].1.as_str(), ranked[1].1.as_str()], "{best}");
    assert_eq!(
        best["usage"]["completion_tokens"],
        all["usage"]["completion_tokens"]
    );
    assert!(best["choices"][0]["logprobs"].is_null(), "{best}");

    // `echo`: the prompt, then the completion; streamed as a first piece.
    let mut echo = base.clone();
    echo["echo"] = json!(true);
    echo["temperature"] = json!(0);
    let plain = {
        let mut p = echo.clone();
        p["echo"] = json!(false);
        call("/v1/completions", p).json()["choices"][0]["text"]
            .as_str()
            .unwrap()
            .to_owned()
    };
    let echoed = call("/v1/completions", echo.clone()).json();
    assert_eq!(echoed["choices"][0]["text"], format!("{prompt}{plain}"));
    echo["stream"] = json!(true);
    let objects = sse_objects(&call("/v1/completions", echo).text());
    let text: String = objects
        .iter()
        .filter_map(|o| o["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(text, format!("{prompt}{plain}"));
}

/// OpenAI's `logprobs`: every generated token with its log probability and the most likely
/// alternatives, the same whether streamed or not, in chat's and text completions' shapes.
#[test]
fn openai_logprobs() {
    let s = server();
    let call = |path: &str, body: Value| {
        let r = s.call("POST", path, Some(&s.only_a), Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
        r
    };
    let ask = json!({"messages": [{"role": "user", "content": "Name three colours."}],
        "max_tokens": 12, "temperature": 0, "logprobs": true, "top_logprobs": 3});
    let v = call("/v1/chat/completions", ask.clone()).json();
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(
        content.len() as u64,
        v["usage"]["completion_tokens"].as_u64().unwrap(),
        "{v}"
    );
    let mut bytes = Vec::new();
    for t in &content {
        let lp = t["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0, "{t}");
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3, "{t}");
        // Greedy: the token taken is the most likely one.
        assert_eq!(top[0]["bytes"], t["bytes"], "{t}");
        assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6);
        assert!(top[1]["logprob"].as_f64().unwrap() <= lp);
        bytes.extend(
            t["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    // The tokens' bytes are the answer.
    assert_eq!(
        String::from_utf8(bytes).unwrap().trim(),
        v["choices"][0]["message"]["content"],
    );
    // Streamed: the same entries, spread over the chunks.
    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    let body = call("/v1/chat/completions", streamed).text();
    let entries: Vec<Value> = body
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .flat_map(|c| {
            c["choices"][0]["logprobs"]["content"]
                .as_array()
                .cloned()
                .unwrap_or_default()
        })
        .collect();
    assert_eq!(entries, content);
    // Without `logprobs`, null.
    let mut plain = ask.clone();
    plain["logprobs"] = json!(false);
    plain["top_logprobs"] = json!(0);
    assert!(call("/v1/chat/completions", plain).json()["choices"][0]["logprobs"].is_null());

    // Text completions: tokens, their log probabilities, the top 2 as objects, offsets.
    let prompt = "The capital of France is";
    let v = call(
        "/v1/completions",
        json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 2}),
    )
    .json();
    let l = &v["choices"][0]["logprobs"];
    let tokens: Vec<&str> = l["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(tokens.concat(), v["choices"][0]["text"], "{v}");
    let offsets = l["text_offset"].as_array().unwrap();
    assert_eq!(offsets[0], prompt.chars().count());
    for (i, t) in tokens.iter().enumerate() {
        let top = l["top_logprobs"][i].as_object().unwrap();
        assert!(top.len() <= 2, "{top:?}");
        assert!(top.contains_key(*t), "{top:?} {t:?}");
        assert!(l["token_logprobs"][i].as_f64().unwrap() <= 0.0);
        if i > 0 {
            assert_eq!(
                offsets[i].as_u64().unwrap(),
                offsets[i - 1].as_u64().unwrap() + tokens[i - 1].chars().count() as u64
            );
        }
    }
}

/// The default model's tokenizer, for the token ids the OpenAI routes take.
fn default_tokenizer() -> engram_tokenizer::Tokenizer {
    let file =
        engram_gguf::GgufFile::open(common::models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf"))
            .expect("the default model opens");
    engram_tokenizer::Tokenizer::from_gguf(file.metadata()).expect("its tokenizer")
}

/// OpenAI's `logit_bias`, `presence_penalty` and `frequency_penalty` change what is generated
/// as OpenAI defines them, with the served model's token ids.
#[test]
fn openai_logit_bias_and_penalties_shape_the_text() {
    let s = server();
    let tok = default_tokenizer();
    let complete = |prompt: &str, extra: Value| {
        let mut body = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let r = s.call("POST", "/v1/completions", Some(&s.only_a), Some(body));
        assert_eq!(r.status, 200, "{}", r.text());
        r.json()["choices"][0]["text"].as_str().unwrap().to_owned()
    };
    let prompt = "The capital of France is";
    let text = complete(prompt, json!({}));
    // Every token of the greedy text banned: another text.
    let banned: serde_json::Map<String, Value> = tok
        .encode(&text, false)
        .unwrap()
        .into_iter()
        .map(|id| (id.to_string(), json!(-100)))
        .collect();
    assert!(!banned.is_empty());
    let other = complete(prompt, json!({ "logit_bias": banned }));
    assert_ne!(other, text);
    // One token forced: every step takes it.
    let the = tok.encode(" the", false).unwrap();
    assert_eq!(the.len(), 1, "{the:?}");
    let forced = complete(prompt, json!({ "logit_bias": { the[0].to_string(): 100 } }));
    assert_eq!(forced, " the".repeat(8));
    // A repetitive prompt: greedy repeats; the frequency penalty (each repeat costs more) breaks
    // the run, a negative one keeps it.
    let counting = "1 1 1 1 1 1 1 1 1 1 1 1";
    let ones = |t: &str| t.matches('1').count();
    let plain = complete(counting, json!({}));
    assert!(
        ones(&plain) >= 4 && plain.split_whitespace().all(|w| w == "1"),
        "{plain:?}"
    );
    let frequency = complete(counting, json!({"frequency_penalty": 2}));
    assert!(ones(&frequency) < ones(&plain), "{frequency:?}");
    // The presence penalty costs any repeat the same 2: a comma repeats less.
    let alternating = "a, b, a, b, a, b, a, b,";
    let commas = |t: &str| t.matches(',').count();
    let plain_ab = complete(alternating, json!({}));
    let presence = complete(alternating, json!({"presence_penalty": 2}));
    assert!(
        commas(&presence) < commas(&plain_ab),
        "{plain_ab:?} then {presence:?}"
    );
    assert_eq!(complete(counting, json!({"frequency_penalty": -2})), plain);
}

/// A scanned page as PNG and a PDF whose second page is a scan: engramd reads them with
/// Tesseract (OCR is on by default where it is installed; CI installs it), shows the OCR
/// progress, and the scanned sentences are searchable. Where Tesseract is missing the image
/// is refused at upload instead, saying OCR is off.
#[test]
fn scanned_documents_are_read_by_ocr() {
    let s = server();
    let r = s.call(
        "POST",
        "/api/v1/collections",
        Some(&s.admin),
        Some(json!({"name": "scans"})),
    );
    assert_eq!(r.status, 201, "{}", r.text());
    let fixtures = concat!(env!("CARGO_MANIFEST_DIR"), "/../parse/tests/fixtures");
    let png = std::fs::read(format!("{fixtures}/scan-en.png")).unwrap();
    let pdf = std::fs::read(format!("{fixtures}/mixed.pdf")).unwrap();
    let installed =
        engram_parse::Ocr::detect(engram_parse::DEFAULT_OCR_LANGUAGES, Duration::from_secs(60))
            .is_ok();
    assert!(
        installed || std::env::var_os("ENGRAM_REQUIRE_OCR").is_none(),
        "ENGRAM_REQUIRE_OCR is set but Tesseract is not installed"
    );
    let (ct, body) = multipart_files(&[("pump-checks.png", &png), ("inspection.pdf", &pdf)]);
    let r = s.raw(
        "POST",
        "/api/v1/collections/scans/documents",
        Some(&s.admin),
        Some((&ct, body)),
    );
    if !installed {
        assert_eq!(r.status, 207, "{}", r.text());
        let docs = r.json()["documents"].as_array().unwrap().clone();
        assert!(
            docs[0]["reason"].as_str().unwrap().contains("OCR is off"),
            "{docs:?}"
        );
        return;
    }
    assert_eq!(r.status, 202, "{}", r.text());
    let docs = r.json()["documents"].as_array().unwrap().clone();
    for d in &docs {
        let id = d["id"].as_u64().unwrap();
        s.wait_for_stage("scans", id, "done");
        let r = s.call(
            "GET",
            &format!("/api/v1/collections/scans/documents/{id}"),
            Some(&s.admin),
            None,
        );
        let doc = r.json();
        assert!(doc["warnings"].as_array().unwrap().is_empty(), "{doc}");
        assert!(doc["failure"].is_null(), "{doc}");
    }
    let r = s.call(
        "POST",
        "/api/v1/search",
        Some(&s.admin),
        Some(json!({"query": "when does the alarm sound", "collections": ["scans"], "top_k": 5, "mode": "bm25"})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let hits = r.json()["hits"].as_array().unwrap().clone();
    let texts: Vec<String> = hits
        .iter()
        .map(|h| h["text"].as_str().unwrap_or("").to_owned())
        .collect();
    assert!(
        texts
            .iter()
            .any(|t| t.contains("the alarm sounds at 6 bar")),
        "{texts:?}"
    );
    let names: Vec<&str> = hits
        .iter()
        .map(|h| h["document"]["name"].as_str().unwrap())
        .collect();
    assert!(
        names.contains(&"pump-checks.png") && names.contains(&"inspection.pdf"),
        "{names:?}"
    );
}
