use std::collections::HashSet;
use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{files_by_size, flip_bytes};
use crate::{Hit, IndexError, VectorIndex};

const MODEL: &str = "test-model";

/// `n` random vectors of `dim` (not normalised: the index normalises), chunk `i` in doc `i / 10`.
fn random_items(n: usize, dim: usize, seed: u64) -> Vec<(u64, u64, Vec<f32>)> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n as u64)
        .map(|i| {
            let v = (0..dim).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
            (i, i / 10, v)
        })
        .collect()
}

fn add_all(index: &mut VectorIndex, items: &[(u64, u64, Vec<f32>)]) {
    let refs: Vec<(u64, u64, &[f32])> = items.iter().map(|(c, d, v)| (*c, *d, &v[..])).collect();
    index.add(&refs).unwrap();
}

fn ids(hits: &[Hit]) -> Vec<u64> {
    hits.iter().map(|h| h.chunk_id).collect()
}

fn recall(index: &VectorIndex, queries: &[(u64, u64, Vec<f32>)], k: usize) -> f64 {
    let mut found = 0;
    for (_, _, q) in queries {
        let exact: HashSet<u64> = ids(&index.exact_search(q, k, None).unwrap())
            .into_iter()
            .collect();
        let approx = index.search(q, k, None).unwrap();
        assert_eq!(approx.len(), k);
        found += approx
            .iter()
            .filter(|h| exact.contains(&h.chunk_id))
            .count();
    }
    found as f64 / (queries.len() * k) as f64
}

fn open(dir: &Path, dim: usize) -> VectorIndex {
    VectorIndex::open_or_create(dir, dim, MODEL).unwrap()
}

#[test]
fn search_finds_nearest_and_scores_cosine() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = open(dir.path(), 3);
    index
        .add(&[
            (1, 10, &[1.0, 0.0, 0.0]),
            (2, 10, &[0.0, 2.0, 0.0]),
            (3, 20, &[1.0, 1.0, 0.0]),
        ])
        .unwrap();
    assert_eq!(index.len(), 3);
    let hits = index.search(&[3.0, 0.0, 0.0], 2, None).unwrap();
    assert_eq!(ids(&hits), [1, 3]);
    assert!((hits[0].score - 1.0).abs() < 1e-6);
    assert!((hits[1].score - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
    assert_eq!(hits[1].doc_id, 20);
    assert_eq!(index.search(&[0.0, 1.0, 0.0], 10, None).unwrap().len(), 3);
    assert_eq!(
        index.exact_search(&[0.0, 1.0, 0.0], 1, None).unwrap()[0].chunk_id,
        2
    );
}

#[test]
fn approximate_search_has_high_recall() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = open(dir.path(), 32);
    add_all(&mut index, &random_items(3000, 32, 1));
    let queries = random_items(50, 32, 2);
    let r = recall(&index, &queries, 10);
    assert!(r >= 0.95, "recall@10 = {r}");
}

#[test]
fn rejects_bad_vectors_and_queries() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = open(dir.path(), 3);
    let err = index.add(&[(1, 1, &[1.0, 0.0])]).unwrap_err();
    assert!(matches!(
        err,
        IndexError::VectorDim {
            chunk_id: 1,
            expected: 3,
            found: 2
        }
    ));
    let err = index
        .add(&[(1, 1, &[1.0, 0.0, 0.0]), (2, 1, &[0.0, 0.0, 0.0])])
        .unwrap_err();
    assert!(
        matches!(err, IndexError::BadVector { chunk_id: 2, .. }),
        "{err}"
    );
    assert!(index.add(&[(3, 1, &[f32::NAN, 0.0, 0.0])]).is_err());
    // The batch was rejected whole.
    assert_eq!(index.len(), 0);
    assert!(matches!(
        index.search(&[1.0], 1, None),
        Err(IndexError::QueryDim {
            expected: 3,
            found: 1
        })
    ));
    assert!(matches!(
        index.search(&[0.0; 3], 1, None),
        Err(IndexError::BadQuery { .. })
    ));
    assert!(index.search(&[1.0, 0.0, 0.0], 5, None).unwrap().is_empty());
}

#[test]
fn re_adding_a_chunk_replaces_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = open(dir.path(), 2);
    index
        .add(&[(1, 10, &[1.0, 0.0]), (2, 10, &[0.0, 1.0])])
        .unwrap();
    index.add(&[(1, 11, &[0.0, 1.0])]).unwrap();
    assert_eq!(index.len(), 2);
    assert_eq!(index.tombstones(), 1);
    let hits = index.search(&[1.0, 0.0], 10, None).unwrap();
    assert_eq!(hits.len(), 2);
    let one = hits.iter().find(|h| h.chunk_id == 1).unwrap();
    assert_eq!(one.doc_id, 11);
    assert!(one.score.abs() < 1e-6);
    assert_eq!(index.delete_doc(10).unwrap(), 1);
    assert_eq!(index.delete_doc(11).unwrap(), 1);
    assert!(index.is_empty());
}

#[test]
fn filter_never_leaks_and_fills_k() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = open(dir.path(), 16);
    let items = random_items(4000, 16, 3);
    add_all(&mut index, &items);
    let queries = random_items(20, 16, 4);
    // Exact-scan path (few rows allowed) and graph path (half the collection allowed).
    let small: HashSet<u64> = [7, 123, 399].into();
    let half: HashSet<u64> = (0..400).filter(|d| d % 2 == 0).collect();
    for force_graph in [false, true] {
        if force_graph {
            index.set_exact_scan_max_rows(0);
        }
        for (_, _, q) in &queries {
            let hits = index.search(q, 10, Some(&small)).unwrap();
            assert_eq!(hits.len(), 10);
            assert!(hits.iter().all(|h| small.contains(&h.doc_id)));
            assert_eq!(
                ids(&hits),
                ids(&index.exact_search(q, 10, Some(&small)).unwrap())
            );

            let hits = index.search(q, 50, Some(&half)).unwrap();
            assert_eq!(hits.len(), 50);
            assert!(hits.iter().all(|h| half.contains(&h.doc_id)));
            // Fewer allowed chunks than k: all of them.
            let one: HashSet<u64> = [5].into();
            assert_eq!(index.search(q, 50, Some(&one)).unwrap().len(), 10);
        }
    }
    let nothing: HashSet<u64> = [9999].into();
    assert!(index
        .search(&queries[0].2, 5, Some(&nothing))
        .unwrap()
        .is_empty());
}

#[test]
fn tombstones_are_filtered_then_compacted() {
    let dir = tempfile::tempdir().unwrap();
    let mut index = open(dir.path(), 8);
    let items = random_items(1000, 8, 5);
    add_all(&mut index, &items);
    index.commit(1).unwrap();

    // 10% deleted: filtered at query time, kept through the commit.
    for doc in 0..10 {
        assert_eq!(index.delete_doc(doc).unwrap(), 10);
    }
    assert_eq!(index.delete_doc(0).unwrap(), 0);
    assert_eq!((index.len(), index.tombstones()), (900, 100));
    let q = &items[5].2;
    let hits = index.search(q, 100, None).unwrap();
    assert_eq!(hits.len(), 100);
    assert!(hits.iter().all(|h| h.doc_id >= 10));
    index.commit(2).unwrap();
    assert_eq!(index.tombstones(), 100);

    // 30% deleted: the commit compacts.
    for doc in 10..30 {
        index.delete_doc(doc).unwrap();
    }
    let before = index.search(q, 20, None).unwrap();
    index.commit(3).unwrap();
    assert_eq!((index.len(), index.tombstones()), (700, 0));
    assert_eq!(ids(&index.search(q, 20, None).unwrap()), ids(&before));
    drop(index);

    let index = open(dir.path(), 8);
    assert_eq!((index.seq(), index.len(), index.tombstones()), (3, 700, 0));
    assert!(!index.graph_recovered());
    assert_eq!(ids(&index.search(q, 20, None).unwrap()), ids(&before));
}

#[test]
fn commit_and_reopen_restores_everything() {
    let dir = tempfile::tempdir().unwrap();
    let items = random_items(600, 24, 6);
    let queries = random_items(10, 24, 7);
    let before: Vec<Vec<Hit>> = {
        let mut index = open(dir.path(), 24);
        add_all(&mut index, &items[..400]);
        index.commit(1).unwrap();
        add_all(&mut index, &items[400..]);
        index.delete_doc(3).unwrap();
        index.commit(9).unwrap();
        // Tombstone-only commits keep the data file and graph.
        index.delete_doc(4).unwrap();
        index.commit(10).unwrap();
        queries
            .iter()
            .map(|(_, _, q)| index.search(q, 10, None).unwrap())
            .collect()
    };
    let mut index = open(dir.path(), 24);
    assert_eq!(index.seq(), 10);
    assert_eq!(index.len(), 580);
    assert_eq!(index.tombstones(), 20);
    assert!(!index.graph_recovered());
    let after: Vec<Vec<Hit>> = queries
        .iter()
        .map(|(_, _, q)| index.search(q, 10, None).unwrap())
        .collect();
    assert_eq!(after, before);
    // Still writable after a reload of the graph.
    add_all(
        &mut index,
        &random_items(50, 24, 8)
            .into_iter()
            .map(|(c, d, v)| (c + 10_000, d + 1000, v))
            .collect::<Vec<_>>(),
    );
    index.commit(11).unwrap();
    assert_eq!(index.len(), 630);
    // Only the current generation's files remain.
    let names: HashSet<String> = files_by_size(dir.path())
        .into_iter()
        .map(|(p, _)| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 5, "{names:?}");
}

#[test]
fn empty_index_round_trips() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut index = open(dir.path(), 4);
        index.commit(3).unwrap();
    }
    let index = open(dir.path(), 4);
    assert_eq!((index.seq(), index.len()), (3, 0));
}

#[test]
fn uncommitted_writes_are_lost_on_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut index = open(dir.path(), 4);
        add_all(&mut index, &random_items(30, 4, 9));
        index.commit(1).unwrap();
        index.delete_doc(0).unwrap();
        add_all(
            &mut index,
            &random_items(5, 4, 10)
                .into_iter()
                .map(|(c, d, v)| (c + 100, d, v))
                .collect::<Vec<_>>(),
        );
    }
    let index = open(dir.path(), 4);
    assert_eq!((index.seq(), index.len(), index.tombstones()), (1, 30, 0));
}

#[test]
fn dimension_and_model_mismatch() {
    let dir = tempfile::tempdir().unwrap();
    {
        let mut index = open(dir.path(), 4);
        add_all(&mut index, &random_items(10, 4, 11));
        index.commit(1).unwrap();
    }
    let err = VectorIndex::open_or_create(dir.path(), 8, MODEL)
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            IndexError::Mismatch {
                what: "dimension",
                ..
            }
        ),
        "{err}"
    );
    let err = VectorIndex::open_or_create(dir.path(), 4, "other-model")
        .err()
        .unwrap();
    assert!(
        matches!(
            err,
            IndexError::Mismatch {
                what: "embedding model",
                ..
            }
        ),
        "{err}"
    );
    assert!(err.needs_rebuild());
    open(dir.path(), 4);
}

fn committed_index(dir: &Path) -> Vec<(u64, u64, Vec<f32>)> {
    let items = random_items(300, 16, 12);
    let mut index = open(dir, 16);
    add_all(&mut index, &items);
    index.commit(1).unwrap();
    items
}

fn file_named(dir: &Path, prefix: &str, suffix: &str) -> std::path::PathBuf {
    files_by_size(dir)
        .into_iter()
        .map(|(p, _)| p)
        .find(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with(prefix) && name.ends_with(suffix)
        })
        .unwrap()
}

#[test]
fn flipped_vector_file_bytes_are_corrupt() {
    for (prefix, suffix) in [("vectors-", ".bin"), ("manifest", ".engv")] {
        let dir = tempfile::tempdir().unwrap();
        committed_index(dir.path());
        flip_bytes(&file_named(dir.path(), prefix, suffix));
        let err = VectorIndex::open_or_create(dir.path(), 16, MODEL)
            .err()
            .unwrap();
        assert!(matches!(err, IndexError::Corrupt { .. }), "{prefix}: {err}");
    }
}

#[test]
fn truncated_or_missing_data_file_is_corrupt() {
    let dir = tempfile::tempdir().unwrap();
    committed_index(dir.path());
    let data = file_named(dir.path(), "vectors-", ".bin");
    let bytes = std::fs::read(&data).unwrap();
    std::fs::write(&data, &bytes[..bytes.len() - 100]).unwrap();
    assert!(matches!(
        VectorIndex::open_or_create(dir.path(), 16, MODEL),
        Err(IndexError::Corrupt { .. })
    ));
    std::fs::remove_file(&data).unwrap();
    assert!(matches!(
        VectorIndex::open_or_create(dir.path(), 16, MODEL),
        Err(IndexError::Corrupt { .. })
    ));
}

#[test]
fn damaged_graph_is_rebuilt_from_vectors() {
    for suffix in [".hnsw.graph", ".hnsw.data"] {
        let dir = tempfile::tempdir().unwrap();
        let items = committed_index(dir.path());
        flip_bytes(&file_named(dir.path(), "graph-", suffix));
        let mut index = open(dir.path(), 16);
        assert!(index.graph_recovered(), "{suffix}");
        assert_eq!(index.len(), 300);
        let q = &items[17].2;
        assert_eq!(index.search(q, 1, None).unwrap()[0].chunk_id, 17);
        // The next commit writes a sound graph.
        index.commit(2).unwrap();
        drop(index);
        assert!(!open(dir.path(), 16).graph_recovered());
    }
}

#[test]
fn second_writer_is_locked_out() {
    let dir = tempfile::tempdir().unwrap();
    let _first = open(dir.path(), 4);
    let err = VectorIndex::open_or_create(dir.path(), 4, MODEL)
        .err()
        .unwrap();
    assert!(matches!(err, IndexError::Locked { .. }), "{err}");
}
