//! The queued ingestion path with the real models: `accept` is durable on its own (a
//! knowledge base dropped before any processing finishes the document when reopened),
//! `process_queued` moves documents through the stages in bounded steps, and cancel and
//! re-index act on the queue.
//!
//! Lives here rather than in the workspace's `tests/` binary because it only needs this
//! crate; it loads the models from `$ENGRAM_MODELS_DIR` (default `<workspace>/models`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use engram_kb::{
    prepare, Admission, ChunkConfig, KbError, KnowledgeBase, Models, NewDocument, Prepared,
    SearchRequest, Stage, CANCELLED,
};

fn models_dir() -> PathBuf {
    std::env::var_os("ENGRAM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../models")))
}

fn models() -> Models {
    static MODELS: OnceLock<Models> = OnceLock::new();
    MODELS
        .get_or_init(|| {
            let dir = models_dir();
            let gguf = engram_gguf::GgufFile::open(dir.join("SmolLM2-135M-Instruct.Q4_1.gguf"))
                .expect("the LLM opens (run scripts/fetch-models.sh)");
            let tokens = engram_tokenizer::Tokenizer::from_gguf(gguf.metadata()).unwrap();
            Models::load(&dir.join("all-MiniLM-L6-v2"), 2, Arc::new(tokens))
                .expect("the embedder loads")
        })
        .clone()
}

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let p = std::env::temp_dir().join(format!("engram-kb-queue-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        TempDir(p)
    }
    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn doc(name: &str, text: &str) -> NewDocument {
    NewDocument::new(name, text.as_bytes().to_vec())
}

fn stage(kb: &KnowledgeBase, coll: &str, id: u64) -> Stage {
    kb.document(coll, &id.to_string()).unwrap().stage
}

/// Runs the queue of `coll` to the end, one small step at a time; returns the steps taken.
fn drain(kb: &mut KnowledgeBase, coll: &str) -> usize {
    let mut steps = 0;
    loop {
        let s = kb.process_queued(coll, 4).unwrap();
        if !s.worked {
            return steps;
        }
        steps += 1;
        assert!(steps < 10_000, "the queue does not drain");
    }
}

#[test]
fn accepted_documents_survive_a_drop_before_processing() {
    let dir = TempDir::new("crash");
    let ids: Vec<u64> = {
        let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
        kb.ensure_collection("c", ChunkConfig::default()).unwrap();
        let ids = ["a", "b", "c"]
            .iter()
            .map(|n| {
                let a = kb
                    .accept(
                        "c",
                        doc(
                            &format!("{n}.md"),
                            &format!("# {n}\n\nThe {n} pump is inspected weekly."),
                        ),
                    )
                    .unwrap();
                assert_eq!(a.outcome, Admission::Queued);
                a.doc
            })
            .collect();
        for &id in &ids {
            assert_eq!(stage(&kb, "c", id), Stage::Queued);
        }
        assert_eq!(kb.queued_documents(), 3);
        // One step only, then the process "dies": the KB is dropped mid-queue.
        kb.process_queued("c", 4).unwrap();
        ids
    };
    let kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    assert_eq!(kb.recovery().resumed, 3);
    for &id in &ids {
        assert_eq!(stage(&kb, "c", id), Stage::Done);
    }
    let hits = kb.search(&SearchRequest::new("c", "b pump")).unwrap().hits;
    assert!(!hits.is_empty());
    assert_eq!(kb.index_sizes("c").unwrap(), (3, 3));
}

#[test]
fn queued_documents_move_through_the_stages_in_steps() {
    let dir = TempDir::new("steps");
    let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    kb.ensure_collection("c", ChunkConfig::default()).unwrap();
    let long: String = (0..40)
        .map(|i| format!("Paragraph {i}: the station pumps water to district {i} every day.\n\n"))
        .collect();
    let a = kb.accept("c", doc("long.md", &long)).unwrap();
    let b = kb
        .accept("c", doc("short.md", "Short note about valves."))
        .unwrap();
    // The same content and name again while queued: nothing new.
    let again = kb
        .accept("c", doc("short.md", "Short note about valves."))
        .unwrap();
    assert_eq!((again.doc, again.outcome), (b.doc, Admission::Unchanged));
    assert_eq!(kb.queued_collections(), vec!["c".to_owned()]);

    // One step prepares both (parse, chunk, embed; chunks stored): they wait for the indexes.
    let first = kb.process_queued("c", 2).unwrap();
    assert!(first.worked && first.done.is_empty());
    let d = kb.document("c", "long.md").unwrap();
    assert_eq!(d.stage, Stage::Indexing);
    let p = d.progress.expect("progress while in the pipeline");
    assert!(p.chunks > 1 && p.chunks_embedded == p.chunks && p.chunks_indexed == 0);
    assert_eq!(p.text_bytes_chunked, p.text_bytes);
    // A search between steps works (and sees nothing yet).
    assert!(kb
        .search(&SearchRequest::new("c", "valves"))
        .unwrap()
        .hits
        .is_empty());
    let mut seen_done = Vec::new();
    while let Ok(s) = kb.process_queued("c", 2) {
        if !s.worked {
            break;
        }
        seen_done.extend(s.done);
    }
    seen_done.sort();
    assert_eq!(seen_done, vec![a.doc, b.doc]);
    let d = kb.document("c", "long.md").unwrap();
    let stages: Vec<Stage> = d.stages.iter().map(|s| s.stage).collect();
    assert_eq!(
        stages,
        [
            Stage::Queued,
            Stage::Parsing,
            Stage::Chunking,
            Stage::Embedding,
            Stage::Indexing,
            Stage::Done
        ]
    );
    assert!(d.chunks > 1);
    assert_eq!(d.progress, None);
    assert_eq!(kb.queued_documents(), 0);
    assert!(kb.queued_collections().is_empty());
    let hits = kb.search(&SearchRequest::new("c", "valves")).unwrap().hits;
    assert_eq!(hits[0].doc_name, "short.md");
    let (bm25, vectors) = kb.index_sizes("c").unwrap();
    assert_eq!((bm25, vectors), (d.chunks as u64 + 1, d.chunks as u64 + 1));
    // Both wait for their chunk KV, durably.
    assert_eq!(kb.kv_pending(0, 10).unwrap(), vec![a.doc, b.doc]);
    assert_eq!(kb.kv_pending_chunks().unwrap(), d.chunks as u64 + 1);
    kb.kv_done(a.doc).unwrap();
    assert_eq!(kb.kv_pending(0, 10).unwrap(), vec![b.doc]);
    assert_eq!(kb.kv_pending_chunks().unwrap(), 1);
}

#[test]
fn cancel_reindex_and_delete_act_on_the_queue() {
    let dir = TempDir::new("cancel");
    let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    kb.ensure_collection("c", ChunkConfig::default()).unwrap();
    let a = kb
        .accept("c", doc("a.md", "Alpha pumps are blue."))
        .unwrap();
    let b = kb.accept("c", doc("b.md", "Beta valves are red.")).unwrap();
    let c = kb
        .accept("c", doc("c.md", "Gamma pipes are green."))
        .unwrap();
    let cancelled = kb.cancel("c", "a.md").unwrap();
    assert_eq!(cancelled.stage, Stage::Failed);
    assert_eq!(cancelled.error.as_deref(), Some(CANCELLED));
    kb.delete_document("c", &c.doc.to_string()).unwrap();
    drain(&mut kb, "c");
    assert_eq!(stage(&kb, "c", a.doc), Stage::Failed);
    assert_eq!(stage(&kb, "c", b.doc), Stage::Done);
    assert_eq!(kb.index_sizes("c").unwrap(), (1, 1));
    // Done documents cannot be cancelled; they can be re-indexed.
    assert!(matches!(
        kb.cancel("c", "b.md"),
        Err(KbError::WrongStage { .. })
    ));
    for name in ["a.md", "b.md"] {
        assert_eq!(kb.reindex("c", name).unwrap().stage, Stage::Queued);
    }
    assert!(matches!(
        kb.reindex("c", "a.md"),
        Err(KbError::WrongStage { .. })
    ));
    drain(&mut kb, "c");
    assert_eq!(stage(&kb, "c", a.doc), Stage::Done);
    assert_eq!(stage(&kb, "c", b.doc), Stage::Done);
    assert_eq!(kb.index_sizes("c").unwrap(), (2, 2));
    let coll = kb.collection("c").unwrap();
    assert_eq!((coll.documents, coll.chunks), (2, 2));
    // Reopening finds everything consistent: nothing rebuilt, nothing resumed.
    drop(kb);
    let kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    assert_eq!(kb.recovery().resumed, 0);
    assert!(kb.recovery().rebuilt.is_empty(), "{:?}", kb.recovery());
    assert_eq!(kb.index_sizes("c").unwrap(), (2, 2));
}

/// Issue 16.1: the same bytes under several names are several documents, each acknowledged
/// id stays resolvable (done, searchable) until deleted, and a name keeps its id across new
/// content.
#[test]
fn duplicate_content_under_other_names_keeps_every_document() {
    let dir = TempDir::new("dupes");
    let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    kb.ensure_collection("c", ChunkConfig::default()).unwrap();
    let text = "The chlorine dosing pump of the east reservoir is calibrated every spring.";
    let ids: Vec<u64> = ["a.txt", "b.txt", "c.txt"]
        .iter()
        .map(|n| {
            let a = kb.accept("c", doc(n, text)).unwrap();
            assert_eq!(a.outcome, Admission::Queued, "{n}");
            a.doc
        })
        .collect();
    assert_eq!(
        ids.iter().collect::<std::collections::HashSet<_>>().len(),
        3
    );
    drain(&mut kb, "c");
    // After processing, the same bytes under a fourth name are a fourth document.
    let d = kb.accept("c", doc("d.txt", text)).unwrap();
    assert_eq!(d.outcome, Admission::Queued);
    assert!(!ids.contains(&d.doc));
    // The same name and bytes again: unchanged, same id; new metadata is applied.
    let mut again = doc("a.txt", text);
    again.metadata.insert("team".into(), "water".into());
    let a2 = kb.accept("c", again).unwrap();
    assert_eq!((a2.doc, a2.outcome), (ids[0], Admission::Unchanged));
    drain(&mut kb, "c");
    let all: Vec<u64> = ids.iter().copied().chain([d.doc]).collect();
    for &id in &all {
        assert_eq!(stage(&kb, "c", id), Stage::Done, "document {id}");
    }
    assert_eq!(
        kb.document("c", "a.txt").unwrap().metadata.get("team"),
        Some(&"water".to_string())
    );
    let mut req = SearchRequest::new("c", "chlorine dosing pump calibration");
    req.k = 10;
    let found: std::collections::HashSet<u64> = kb
        .search(&req)
        .unwrap()
        .hits
        .iter()
        .map(|h| h.doc_id)
        .collect();
    assert_eq!(found, all.iter().copied().collect());

    // New content under a known name replaces it in place: same id, new chunks only.
    let r = kb
        .accept(
            "c",
            doc("b.txt", "The west reservoir has a new ozone generator."),
        )
        .unwrap();
    assert_eq!(
        (r.doc, r.outcome),
        (ids[1], Admission::Replaced { old: ids[1] })
    );
    drain(&mut kb, "c");
    let b = kb.document("c", &ids[1].to_string()).unwrap();
    assert_eq!((b.stage, b.revision), (Stage::Done, 1));
    let hits = kb
        .search(&SearchRequest::new("c", "ozone generator"))
        .unwrap()
        .hits;
    assert_eq!(hits[0].doc_id, ids[1]);
    assert!(kb
        .chunks(ids[1])
        .unwrap()
        .iter()
        .all(|c| c.text.contains("ozone")));

    // Deleting one of the same-content documents keeps the others and their shared blob.
    kb.delete_document("c", "c.txt").unwrap();
    assert_eq!(kb.original_count().unwrap(), 2);
    drop(kb);
    let kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    assert!(kb.recovery().rebuilt.is_empty(), "{:?}", kb.recovery());
    for id in [ids[0], ids[1], d.doc] {
        assert_eq!(stage(&kb, "c", id), Stage::Done, "document {id}");
    }
    assert!(kb.document("c", &ids[2].to_string()).is_err());
    let coll = kb.collection("c").unwrap();
    assert_eq!(coll.documents, 3);
    assert_eq!(kb.index_sizes("c").unwrap(), (3, 3));
}

/// New content under a name while its previous revision is half-way through the pipeline:
/// the old revision is dropped, the new one is what ends up indexed.
#[test]
fn replacing_a_document_in_the_pipeline_indexes_only_the_new_content() {
    let dir = TempDir::new("replace-inflight");
    let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    kb.ensure_collection("c", ChunkConfig::default()).unwrap();
    let long: String = (0..30)
        .map(|i| format!("Paragraph {i}: the old turbine manual, section {i}.\n\n"))
        .collect();
    let first = kb.accept("c", doc("manual.md", &long)).unwrap();
    // One step: prepared, waiting for the indexes.
    kb.process_queued("c", 2).unwrap();
    assert_eq!(stage(&kb, "c", first.doc), Stage::Indexing);
    let second = kb
        .accept(
            "c",
            doc("manual.md", "The new turbine manual has one page."),
        )
        .unwrap();
    assert_eq!(second.doc, first.doc);
    drain(&mut kb, "c");
    let d = kb.document("c", "manual.md").unwrap();
    assert_eq!((d.stage, d.chunks), (Stage::Done, 1));
    assert_eq!(kb.index_sizes("c").unwrap(), (1, 1));
    assert_eq!(kb.collection("c").unwrap().chunks, 1);
}

/// Prepares the next job on a thread of its own, as the daemon does, sending every message back
/// over a channel.
fn spawn_preparer(
    kb: &mut KnowledgeBase,
    batch: usize,
) -> (
    std::sync::mpsc::Receiver<Prepared>,
    std::thread::JoinHandle<()>,
) {
    let job = kb
        .next_job(64, 1 << 30)
        .unwrap()
        .expect("a queued document");
    let models = kb.models().clone();
    let (tx, rx) = std::sync::mpsc::sync_channel(4);
    let t = std::thread::spawn(move || {
        prepare(
            &models,
            &engram_parse::Limits::default(),
            None,
            job,
            batch,
            &mut |m| {
                let _ = tx.send(m);
            },
        );
    });
    (rx, t)
}

fn paragraphs(n: usize, what: &str) -> String {
    (0..n)
        .map(|i| {
            format!(
                "Section {i} of the {what}. The operators of plant {i} check the filters, log \
                 the turbidity and report pressure drops to the control room every morning.\n\n"
            )
        })
        .collect()
}

/// Issue 16.3: the knowledge base answers searches while a large document is prepared on
/// another thread, and a cancel stops that work within a batch.
#[test]
fn searches_are_answered_while_another_thread_prepares_and_cancel_stops_it() {
    let dir = TempDir::new("threaded");
    let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    kb.ensure_collection("c", ChunkConfig::default()).unwrap();
    let small = kb.accept("c", doc("small.md", "Valves are red.")).unwrap();
    drain(&mut kb, "c");
    let big = kb
        .accept("c", doc("big.md", &paragraphs(400, "manual")))
        .unwrap();
    let (rx, worker) = spawn_preparer(&mut kb, 4);
    let mut searched_while_busy = 0;
    let mut embedded = 0;
    for m in rx.iter() {
        if matches!(m, Prepared::Embedded { .. }) {
            embedded += 1;
        }
        kb.apply(m).unwrap();
        // The owner is free between messages: a search is answered, and the big document is
        // still on its way.
        let hits = kb
            .search(&SearchRequest::new("c", "red valves"))
            .unwrap()
            .hits;
        assert_eq!(hits[0].doc_id, small.doc);
        if !stage(&kb, "c", big.doc).is_final() {
            searched_while_busy += 1;
        }
        if embedded == 3 {
            let d = kb.document("c", "big.md").unwrap();
            assert_eq!(d.stage, Stage::Embedding);
            let p = d.progress.unwrap();
            assert!(p.chunks > 20, "{p:?}");
            assert_eq!(p.chunks_embedded, 12);
            // Cancel in the middle of embedding: accepted, and the preparer stops.
            let c = kb.cancel("c", "big.md").unwrap();
            assert_eq!(c.error.as_deref(), Some(CANCELLED));
        }
    }
    worker.join().unwrap();
    assert!(searched_while_busy >= 3);
    assert!(
        embedded <= 5,
        "the preparer went on after the cancel ({embedded} batches)"
    );
    let d = kb.document("c", "big.md").unwrap();
    assert_eq!((d.stage, d.chunks), (Stage::Failed, 0));
    assert!(kb.chunks(d.id).unwrap().is_empty());
    assert_eq!(kb.index_sizes("c").unwrap(), (1, 1));
    // It can be indexed again later.
    kb.reindex("c", "big.md").unwrap();
    drain(&mut kb, "c");
    assert_eq!(stage(&kb, "c", big.doc), Stage::Done);
}

/// Issue 16.6: a document interrupted half-way through embedding is queued again at the next
/// open (which does not wait for it), keeps the chunks it stored and embeds only the rest.
#[test]
fn an_interrupted_document_resumes_after_its_stored_chunks() {
    let dir = TempDir::new("resume");
    let (id, total) = {
        let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
        kb.ensure_collection("c", ChunkConfig::default()).unwrap();
        let big = kb
            .accept("c", doc("big.md", &paragraphs(120, "guide")))
            .unwrap();
        let (rx, worker) = spawn_preparer(&mut kb, 4);
        let mut embedded = 0;
        let mut total = 0;
        for m in rx.iter() {
            if let Prepared::Chunked { chunks, .. } = m {
                total = chunks;
            }
            let is_batch = matches!(m, Prepared::Embedded { .. });
            kb.apply(m).unwrap();
            if is_batch {
                embedded += 1;
                if embedded == 2 {
                    break;
                }
            }
        }
        // The process "dies": the preparer is cut off and the KB dropped.
        drop(rx);
        let _ = worker.join();
        assert_eq!(kb.chunks(big.doc).unwrap().len(), 8);
        (big.doc, total)
    };
    let mut kb = KnowledgeBase::open(dir.path(), models()).unwrap();
    assert_eq!(kb.recovery().resumed, 1);
    assert_eq!(stage(&kb, "c", id), Stage::Embedding);
    assert_eq!(kb.queued_documents(), 1);
    let (rx, worker) = spawn_preparer(&mut kb, 4);
    let mut sent = 0;
    for m in rx.iter() {
        match &m {
            Prepared::Chunked { stored, .. } => assert_eq!(*stored, 8),
            Prepared::Embedded { chunks, .. } => sent += chunks.len() as u32,
            _ => {}
        }
        kb.apply(m).unwrap();
    }
    worker.join().unwrap();
    assert_eq!(
        sent,
        total - 8,
        "only the chunks after the stored ones are embedded"
    );
    drain(&mut kb, "c");
    let d = kb.document("c", &id.to_string()).unwrap();
    assert_eq!((d.stage, d.chunks), (Stage::Done, total));
    assert_eq!(kb.index_sizes("c").unwrap(), (total as u64, total as u64));
}
