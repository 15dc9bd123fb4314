//! Helpers shared by the integration tests: where the models, golden files and binaries are.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// The workspace root (these tests are compiled by `<root>/appliance/cli`).
pub fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("the workspace root exists")
}

/// The models folder filled by `scripts/fetch-models.sh`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("ENGRAM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("models"))
}

/// The default LLM, or a panic that says how to fetch it.
pub fn default_llm() -> PathBuf {
    let p = models_dir().join("SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.is_file(),
        "{} is missing: run scripts/fetch-models.sh first",
        p.display()
    );
    p
}

/// The read-only shared folder (golden outputs, evaluation data).
pub fn shared_dir() -> PathBuf {
    std::env::var_os("ENGRAM_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("../shared"))
}

/// Parses one golden JSON file from `shared/golden`.
pub fn golden(name: &str) -> serde_json::Value {
    let p = shared_dir().join("golden").join(name);
    let text = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("cannot read golden file {}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", p.display()))
}

/// Parses one golden JSON file kept in the repository (`tests/golden`), for references made
/// from files the tests build themselves.
pub fn repo_golden(name: &str) -> serde_json::Value {
    let p = workspace_root().join("tests/golden").join(name);
    let text = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("cannot read golden file {}: {e}", p.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", p.display()))
}

/// llama.cpp's reference outputs for the default LLM.
pub fn smollm2_golden() -> serde_json::Value {
    golden("smollm2-135m-q4_1.llamacpp.json")
}

/// The `engram` binary Cargo built for these tests, or `$ENGRAM_BIN`.
pub fn engram_bin() -> PathBuf {
    std::env::var_os("ENGRAM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_engram")))
}

/// A fresh, empty folder under the target directory for one test's files.
pub fn temp_dir(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("creating a test folder");
    dir
}

/// Token ids from a JSON array (golden files and `engram --json` output).
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an array of ids")
        .iter()
        .map(|x| {
            let id = x.as_u64().expect("an id");
            u32::try_from(id).expect("an id fits in u32")
        })
        .collect()
}
