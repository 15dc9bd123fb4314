//! Tests of the indexes on real tantivy and hnsw_rs directories.
//!
//! - `bm25`: analysis, search, filters, deletes, commits, reopening, corruption.
//! - `vector`: search against exact, filters, tombstones and compaction, persistence,
//!   corruption and mismatch.

mod bm25;
mod vector;

use std::fs;
use std::path::{Path, PathBuf};

/// Every regular file under `dir` with its size, largest first.
fn files_by_size(dir: &Path) -> Vec<(PathBuf, u64)> {
    let mut files: Vec<(PathBuf, u64)> = fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_type().unwrap().is_file())
        .map(|e| (e.path(), e.metadata().unwrap().len()))
        .collect();
    files.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    files
}

/// Flips every bit of a few bytes in the middle of `path`.
fn flip_bytes(path: &Path) {
    let mut bytes = fs::read(path).unwrap();
    assert!(!bytes.is_empty(), "{} is empty", path.display());
    let (mid, len) = (bytes.len() / 2, bytes.len());
    for b in &mut bytes[mid..(mid + 4).min(len)] {
        *b ^= 0xFF;
    }
    fs::write(path, bytes).unwrap();
}

fn assert_send_sync<T: Send + Sync>() {}

#[test]
fn indexes_are_send_and_sync() {
    assert_send_sync::<crate::VectorIndex>();
    assert_send_sync::<crate::Bm25Index>();
}
