use std::collections::HashSet;

use super::{files_by_size, flip_bytes};
use crate::{Bm25Index, ChunkDoc, IndexError};

fn chunk(chunk_id: u64, doc_id: u64, text: &str) -> ChunkDoc<'_> {
    ChunkDoc {
        chunk_id,
        doc_id,
        text,
    }
}

fn ids(hits: &[crate::Hit]) -> Vec<u64> {
    hits.iter().map(|h| h.chunk_id).collect()
}

const CORPUS: &[(u64, u64, &str)] = &[
    (1, 10, "The engine runs on a single server with two cores."),
    (2, 10, "Fusion assembles the KV cache from stored chunks."),
    (3, 20, "Cats sleep most of the day and hunt at night."),
    (4, 30, "我来到北京清华大学学习计算机科学。"),
    (5, 30, "检索增强生成需要一个好的索引。"),
    (6, 40, "A runner was running through the park."),
];

fn corpus_index(dir: &std::path::Path) -> Bm25Index {
    let mut index = Bm25Index::open_or_create(dir).unwrap();
    let chunks: Vec<ChunkDoc> = CORPUS.iter().map(|&(c, d, t)| chunk(c, d, t)).collect();
    index.add(&chunks).unwrap();
    index.commit(5).unwrap();
    index
}

#[test]
fn writes_are_searchable_after_commit() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = Bm25Index::open_or_create(dir.path()).unwrap();
    assert_eq!((index.seq(), index.len()), (0, 0));
    index.add(&[chunk(1, 1, "hello world")]).unwrap();
    assert!(index.search("hello", 10, None).unwrap().is_empty());
    index.commit(1).unwrap();
    let hits = index.search("hello", 10, None).unwrap();
    assert_eq!(hits.len(), 1);
    assert_eq!((hits[0].chunk_id, hits[0].doc_id), (1, 1));
    assert!(hits[0].score > 0.0);
    assert_eq!((index.seq(), index.len()), (1, 1));
}

#[test]
fn english_stemming_matches_inflections() {
    let dir = tempfile::tempdir().unwrap();
    let index = corpus_index(dir.path());
    let hits = index.search("running", 10, None).unwrap();
    assert_eq!(
        ids(&hits).into_iter().collect::<HashSet<_>>(),
        [1, 6].into()
    );
    // Stop words alone match nothing rather than everything.
    assert!(index.search("the of and", 10, None).unwrap().is_empty());
    assert!(index.search("", 10, None).unwrap().is_empty());
}

#[test]
fn chinese_query_finds_chinese_chunk() {
    let dir = tempfile::tempdir().unwrap();
    let index = corpus_index(dir.path());
    assert_eq!(ids(&index.search("清华大学", 10, None).unwrap()), [4]);
    assert_eq!(ids(&index.search("北京的大学", 10, None).unwrap()), [4]);
    assert_eq!(ids(&index.search("索引", 10, None).unwrap()), [5]);
    // A mixed query reaches chunks of either language.
    let mixed = ids(&index.search("索引 cats", 10, None).unwrap());
    assert_eq!(mixed.into_iter().collect::<HashSet<_>>(), [3, 5].into());
}

#[test]
fn each_script_of_a_mixed_chunk_is_searchable() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = Bm25Index::open_or_create(dir.path()).unwrap();
    // Mostly English with one Chinese sentence (6 % Han), and mostly Chinese with English terms.
    let handbook = "Account security. Passwords are checked at every sign-in and expire after \
        ninety days; administrators reset them from the console under Users. \
        新密码至少需要8个字符。 Keys are listed under API keys and can be revoked at any time.";
    let guide = "部署指南：使用 Kubernetes 部署服务，replicas 设置为三个，并配置健康检查。";
    index
        .add(&[
            chunk(1, 1, handbook),
            chunk(2, 2, guide),
            chunk(3, 3, CORPUS[3].2),
        ])
        .unwrap();
    index.commit(1).unwrap();
    assert_eq!(
        ids(&index.search("新密码至少需要几个字符", 10, None).unwrap())[0],
        1
    );
    assert_eq!(ids(&index.search("password reset", 10, None).unwrap()), [1]);
    assert_eq!(
        ids(&index.search("kubernetes replica", 10, None).unwrap()),
        [2]
    );
    assert_eq!(ids(&index.search("健康检查", 10, None).unwrap()), [2]);
    let ranges = index.highlight("新密码至少需要几个字符", handbook);
    let words: Vec<&str> = ranges.iter().map(|r| &handbook[r.clone()]).collect();
    // Adjacent matches merge into one range.
    assert_eq!(words, ["新密码至少需要", "字符"]);
}

#[test]
fn results_are_best_first_and_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = Bm25Index::open_or_create(dir.path()).unwrap();
    let texts: Vec<String> = (0..20)
        .map(|i| format!("{} filler text number {i}", "apple ".repeat(i % 5 + 1)))
        .collect();
    let chunks: Vec<ChunkDoc> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| chunk(i as u64, i as u64, t))
        .collect();
    index.add(&chunks).unwrap();
    index.commit(1).unwrap();
    let hits = index.search("apple", 7, None).unwrap();
    assert_eq!(hits.len(), 7);
    assert!(hits.windows(2).all(|w| w[0].score >= w[1].score));
    assert_eq!(index.search("apple", 0, None).unwrap(), []);
}

/// 3,000 chunks of made-up letter words (no stop words) drawn by a Zipf law, a few in most
/// chunks and many rare, as in natural text; in three segments, document 7 deleted. Returns
/// the index, 300 queries of 1 to 24 words from the same law, and the live documents.
fn zipf_index(dir: &std::path::Path) -> (Bm25Index, Vec<String>, HashSet<u64>) {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    let word = |mut i: usize| {
        let mut w = String::from("zq");
        loop {
            w.push((b'a' + (i % 26) as u8) as char);
            i /= 26;
            if i == 0 {
                break w;
            }
        }
    };
    let weights: Vec<f64> = (1..=2000).map(|r| 1.0 / r as f64).collect();
    let total: f64 = weights.iter().sum();
    let mut rng = StdRng::seed_from_u64(7);
    let draw = |rng: &mut StdRng| {
        let mut u = rng.gen::<f64>() * total;
        weights
            .iter()
            .position(|w| {
                u -= w;
                u <= 0.0
            })
            .unwrap_or(weights.len() - 1)
    };
    let mut index = Bm25Index::open_or_create(dir).unwrap();
    let texts: Vec<String> = (0..3000)
        .map(|_| {
            let n = rng.gen_range(20..60);
            (0..n)
                .map(|_| word(draw(&mut rng)))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    for (part, batch) in texts.chunks(1000).enumerate() {
        let chunks: Vec<ChunkDoc> = batch
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let id = (part * 1000 + i) as u64;
                chunk(id, id / 5, t)
            })
            .collect();
        index.add(&chunks).unwrap();
        if part == 2 {
            index.delete_doc(7).unwrap();
        }
        index.commit(part as u64 + 1).unwrap();
    }
    let queries = (0..300)
        .map(|_| {
            let n = rng.gen_range(1..25);
            (0..n)
                .map(|_| word(draw(&mut rng)))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    (index, queries, (0..600).filter(|&d| d != 7).collect())
}

fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-4 * b.abs().max(1.0)
}

/// The chunks of `hits` that score above `last` (a tie at the last place may go either way).
fn above(hits: &[crate::Hit], last: f32) -> HashSet<u64> {
    hits.iter()
        .filter(|h| h.score > last && !close(h.score, last))
        .map(|h| h.chunk_id)
        .collect()
}

/// The unfiltered search (chunks with a rare term first, then block-max WAND from their
/// threshold) returns what tantivy's plain top k returns: the same scores, and the same
/// chunks above the last place's score. The reference is the filtered search with every live
/// document allowed, which runs `TopDocs`.
#[test]
fn unfiltered_search_matches_the_plain_top_k() {
    let dir = tempfile::tempdir().unwrap();
    let (index, queries, live) = zipf_index(dir.path());
    for query in &queries {
        let fast = index.search(query, 20, None).unwrap();
        let plain = index.search(query, 20, Some(&live)).unwrap();
        assert_eq!(fast.len(), plain.len(), "{query}");
        for (a, b) in fast.iter().zip(&plain) {
            assert!(close(a.score, b.score), "{query}");
        }
        if let Some(last) = plain.last().map(|h| h.score) {
            assert_eq!(above(&fast, last), above(&plain, last), "{query}");
        }
        assert!(fast.iter().all(|h| h.doc_id != 7));
    }
}

/// With the chunks that hold common terms only skipped (as at a million chunks, here by
/// lowering the postings budget to 0), every hit keeps its exact score, the list is as long,
/// its i-th score is at most the plain search's i-th (it ranks a subset of the chunks), and
/// most queries still get the plain top k (197 of 300 here, where a fifth of the vocabulary
/// is common in short chunks; 191 of 200 top 100s at a million chunks).
#[test]
fn skipping_common_only_chunks_keeps_exact_scores() {
    let dir = tempfile::tempdir().unwrap();
    let (mut index, queries, live) = zipf_index(dir.path());
    index.set_common_postings_max(0);
    let mut same = 0;
    for query in &queries {
        let fast = index.search(query, 20, None).unwrap();
        let plain = index.search(query, 20, Some(&live)).unwrap();
        assert_eq!(fast.len(), plain.len(), "{query}");
        for (a, b) in fast.iter().zip(&plain) {
            assert!(a.score <= b.score || close(a.score, b.score), "{query}");
        }
        for h in &fast {
            if let Some(p) = plain.iter().find(|p| p.chunk_id == h.chunk_id) {
                assert!(close(h.score, p.score), "{query}");
            }
        }
        let last = plain.last().map_or(0.0, |h| h.score);
        same += usize::from(above(&fast, last) == above(&plain, last));
    }
    assert!(
        same * 2 >= queries.len(),
        "{same} of {} the same",
        queries.len()
    );
}

#[test]
fn filter_is_applied_inside_the_search() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = Bm25Index::open_or_create(dir.path()).unwrap();
    // Document 1 has 50 chunks that mention "zebra" many times; document 2 has two chunks that
    // mention it once in long text, so they rank below all of document 1's.
    let strong = "zebra zebra zebra stripes";
    let weak = format!("zebra {}", "grass savanna river ".repeat(30));
    let mut chunks: Vec<ChunkDoc> = (0..50).map(|i| chunk(i, 1, strong)).collect();
    chunks.push(chunk(100, 2, &weak));
    chunks.push(chunk(101, 2, &weak));
    chunks.push(chunk(200, 3, "nothing relevant"));
    index.add(&chunks).unwrap();
    index.commit(1).unwrap();

    let only_2: HashSet<u64> = [2].into();
    let hits = index.search("zebra", 5, Some(&only_2)).unwrap();
    assert_eq!(ids(&hits), [100, 101]);
    assert!(hits.iter().all(|h| h.doc_id == 2));

    let two_docs: HashSet<u64> = [1, 2].into();
    let hits = index.search("zebra", 60, Some(&two_docs)).unwrap();
    assert_eq!(hits.len(), 52);

    let none: HashSet<u64> = [3, 99].into();
    assert!(index.search("zebra", 5, Some(&none)).unwrap().is_empty());
    assert!(index
        .search("zebra", 5, Some(&HashSet::new()))
        .unwrap()
        .is_empty());
}

#[test]
fn delete_doc_removes_its_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = corpus_index(dir.path());
    assert_eq!(index.len(), 6);
    index.delete_doc(10).unwrap();
    // Deletes also reach chunks added in the same commit.
    index.add(&[chunk(7, 50, "engine")]).unwrap();
    index.delete_doc(50).unwrap();
    index.commit(6).unwrap();
    assert_eq!(index.len(), 4);
    assert!(index.search("engine fusion", 10, None).unwrap().is_empty());
    assert_eq!(ids(&index.search("cats", 10, None).unwrap()), [3]);
}

#[test]
fn seq_and_data_survive_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let before = {
        let mut index = corpus_index(dir.path());
        index.delete_doc(20).unwrap();
        index.commit(42).unwrap();
        index.search("running 清华", 10, None).unwrap()
    };
    let index = Bm25Index::open_or_create(dir.path()).unwrap();
    assert_eq!(index.seq(), 42);
    assert_eq!(index.len(), 5);
    assert_eq!(index.search("running 清华", 10, None).unwrap(), before);
    assert!(index.search("cats", 10, None).unwrap().is_empty());
}

#[test]
fn uncommitted_writes_are_lost_on_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut index = corpus_index(dir.path());
        index.add(&[chunk(9, 9, "uncommitted words")]).unwrap();
    }
    let index = Bm25Index::open_or_create(dir.path()).unwrap();
    assert_eq!((index.seq(), index.len()), (5, 6));
    assert!(index.search("uncommitted", 10, None).unwrap().is_empty());
}

#[test]
fn query_syntax_characters_are_plain_text() {
    let dir = tempfile::tempdir().unwrap();
    let index = corpus_index(dir.path());
    for q in [
        "text:\"cats\" AND (sleep OR -night) ^2",
        "[a TO b] {c} ~ * ? \\ / : cats!",
        "\"",
        "AND OR NOT",
        "（清华）：“大学”",
    ] {
        index.search(q, 10, None).unwrap();
    }
    assert_eq!(ids(&index.search("cats:sleep)", 10, None).unwrap()), [3]);
}

#[test]
fn highlight_returns_byte_ranges_of_matches() {
    let dir = tempfile::tempdir().unwrap();
    let index = Bm25Index::open_or_create(dir.path()).unwrap();
    let text = "The Runner runs; RUNNING is fun.";
    let ranges = index.highlight("running", text);
    let words: Vec<&str> = ranges.iter().map(|r| &text[r.clone()]).collect();
    assert_eq!(words, ["runs", "RUNNING"]);

    let zh = "我来到北京清华大学";
    let ranges = index.highlight("清华大学", zh);
    // Search-mode sub-words overlap ("清华", "华大", "大学", "清华大学"): merged into one range.
    assert_eq!(
        ranges.iter().map(|r| &zh[r.clone()]).collect::<Vec<_>>(),
        ["清华大学"]
    );
    assert!(index.highlight("the", text).is_empty());
    assert!(index.highlight("", text).is_empty());
}

#[test]
fn flipped_segment_bytes_are_corrupt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(corpus_index(dir.path()));
    // The largest files are segment files (store, postings, fast fields), never meta.json.
    let (victim, _) = files_by_size(dir.path())
        .into_iter()
        .find(|(p, _)| p.extension().is_some_and(|e| e != "json" && e != "lock"))
        .unwrap();
    flip_bytes(&victim);
    let err = Bm25Index::open_or_create(dir.path()).err().unwrap();
    assert!(matches!(err, IndexError::Corrupt { .. }), "{err}");
    assert!(err.needs_rebuild());
}

#[test]
fn every_damaged_segment_file_is_detected() {
    let dir = tempfile::tempdir().unwrap();
    drop(corpus_index(dir.path()));
    let segment_files: Vec<_> = files_by_size(dir.path())
        .into_iter()
        .filter(|(p, size)| *size > 0 && p.extension().is_some_and(|e| e != "json" && e != "lock"))
        .collect();
    assert!(segment_files.len() >= 3, "{segment_files:?}");
    for (path, _) in segment_files {
        let original = std::fs::read(&path).unwrap();
        flip_bytes(&path);
        let result = Bm25Index::open_or_create(dir.path());
        assert!(
            matches!(result, Err(IndexError::Corrupt { .. })),
            "{}: {:?}",
            path.display(),
            result.err()
        );
        std::fs::write(&path, original).unwrap();
    }
    Bm25Index::open_or_create(dir.path()).unwrap();
}

#[test]
fn damaged_meta_is_corrupt_on_open() {
    let dir = tempfile::tempdir().unwrap();
    drop(corpus_index(dir.path()));
    std::fs::write(dir.path().join("meta.json"), b"{\"segments\": [").unwrap();
    let err = Bm25Index::open_or_create(dir.path()).err().unwrap();
    assert!(matches!(err, IndexError::Corrupt { .. }), "{err}");
}

#[test]
fn second_writer_is_locked_out() {
    let dir = tempfile::tempdir().unwrap();
    let _first = Bm25Index::open_or_create(dir.path()).unwrap();
    let err = Bm25Index::open_or_create(dir.path()).err().unwrap();
    assert!(matches!(err, IndexError::Locked { .. }), "{err}");
}

#[test]
fn a_format_1_index_is_a_mismatch_naming_its_format() {
    use tantivy::schema::{Schema, TEXT};
    let dir = tempfile::tempdir().unwrap();
    // Format 1's layout: an English and a Chinese text field.
    let mut schema = Schema::builder();
    schema.add_u64_field("chunk_id", tantivy::schema::INDEXED);
    let text_en = schema.add_text_field("text_en", TEXT);
    schema.add_text_field("text_zh", TEXT);
    let index = tantivy::Index::create_in_dir(dir.path(), schema.build()).unwrap();
    let mut writer: tantivy::IndexWriter = index.writer_with_num_threads(1, 15 << 20).unwrap();
    writer
        .add_document(tantivy::doc!(text_en => "an old chunk"))
        .unwrap();
    let mut prepared = writer.prepare_commit().unwrap();
    prepared.set_payload("engram-bm25 v1 seq=3");
    prepared.commit().unwrap();
    drop(writer);

    match Bm25Index::open_or_create(dir.path()) {
        Err(e @ IndexError::Mismatch { .. }) => {
            assert!(e.needs_rebuild());
            let message = e.to_string();
            assert!(
                message.contains("engram-bm25 v1") && message.contains("engram-bm25 v2"),
                "{message}"
            );
        }
        other => panic!("expected a mismatch, got {:?}", other.map(|_| ())),
    }
}
