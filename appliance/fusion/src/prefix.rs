//! The prefix cache: exact KV of prompt prefixes (system prompt, later chat history), shared
//! across requests and found by a rolling hash of token ids.
//!
//! An entry is a prefix's KV computed at positions `0..n`, so it is exact for any prompt that
//! starts with the same token ids. Every [`BLOCK`] tokens of an entry (and at its end) the
//! chained xxh3 hash of the ids so far is indexed; a lookup walks the prompt's own block hashes
//! from the longest down, and confirms a hit by comparing the ids, so a hash collision can
//! never serve another prefix's KV.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use engram_model::KvCache;
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Granularity of the prefix index: a lookup finds the last whole block a prompt shares with
/// an entry, then extends the match token by token. 32 tokens keeps the index small (one key
/// per 32 tokens) while a prompt that shares less than one block with every entry (nothing
/// worth reusing) costs no comparison at all.
pub const BLOCK: usize = 32;

/// One cached prefix.
pub struct PrefixEntry {
    pub tokens: Vec<u32>,
    /// KV of `tokens` at positions `0..tokens.len()`.
    pub kv: KvCache,
    bytes: u64,
}

/// What a lookup found: reuse the first `len` slots of `entry.kv`.
pub struct PrefixHit {
    pub entry: Arc<PrefixEntry>,
    pub len: usize,
}

#[derive(Default)]
struct Inner {
    /// Lengths of the cached entries (a prompt may share a whole entry shorter than a block).
    lengths: std::collections::BTreeSet<usize>,
    entries: HashMap<u64, Arc<PrefixEntry>>,
    /// Chained hash of the first `len` ids -> (entry key, len).
    index: HashMap<u64, (u64, usize)>,
    /// Entry key -> tick of its last use.
    recency: HashMap<u64, u64>,
    used: u64,
    tick: u64,
}

/// Exact KV of recently used prefixes under a byte budget, least recently used evicted first.
pub struct PrefixCache {
    budget: u64,
    inner: Mutex<Inner>,
}

/// Chained hashes at each block boundary of `tokens` and at its end, `(len, hash)`, shortest
/// first.
fn boundary_hashes(tokens: &[u32]) -> Vec<(usize, u64)> {
    let mut out = Vec::new();
    let mut h = 0u64;
    for (i, block) in tokens.chunks(BLOCK).enumerate() {
        let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
        h = xxh3_64_with_seed(&bytes, h);
        // A partial last block hashes differently from a whole one only by its content, and
        // its length is part of the key below.
        out.push((i * BLOCK + block.len(), h));
    }
    out
}

/// The chained hash of all of `tokens` (what [`boundary_hashes`] gives at its end).
fn prefix_hash(tokens: &[u32]) -> u64 {
    boundary_hashes(tokens).last().map_or(0, |&(_, h)| h)
}

fn key_of(len: usize, hash: u64) -> u64 {
    hash ^ (len as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

impl PrefixCache {
    /// A cache holding at most `budget_bytes` of KV.
    pub fn new(budget_bytes: u64) -> PrefixCache {
        PrefixCache {
            budget: budget_bytes,
            inner: Mutex::new(Inner::default()),
        }
    }

    /// The longest cached prefix of `tokens` (whole blocks, or a whole entry).
    pub fn lookup(&self, tokens: &[u32]) -> Option<PrefixHit> {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        // Candidate match lengths: every block boundary of the prompt, and every entry length
        // it could contain whole; longest first.
        let mut candidates = boundary_hashes(tokens);
        for &l in inner.lengths.range(..=tokens.len()) {
            if l % BLOCK != 0 && l != tokens.len() {
                candidates.push((l, prefix_hash(&tokens[..l])));
            }
        }
        candidates.sort_by_key(|&(l, _)| l);
        for (len, h) in candidates.into_iter().rev() {
            let Some(&(entry_key, entry_len)) = inner.index.get(&key_of(len, h)) else {
                continue;
            };
            let Some(entry) = inner.entries.get(&entry_key).cloned() else {
                continue;
            };
            let len = len.min(entry_len);
            if entry.tokens[..len] == tokens[..len] {
                // Past the last whole block in common, extend the match token by token.
                let len = len
                    + entry.tokens[len..]
                        .iter()
                        .zip(&tokens[len..])
                        .take_while(|(a, b)| a == b)
                        .count();
                inner.tick += 1;
                let tick = inner.tick;
                inner.recency.insert(entry_key, tick);
                return Some(PrefixHit { entry, len });
            }
        }
        None
    }

    /// Caches `kv` (exactly `tokens` at positions `0..tokens.len()`), evicting the least
    /// recently used entries to stay within the budget. An entry larger than the whole budget
    /// is not cached.
    pub fn insert(&self, tokens: &[u32], kv: KvCache) {
        let bytes = kv_bytes(&kv, tokens.len());
        if bytes > self.budget || tokens.is_empty() {
            return;
        }
        let hashes = boundary_hashes(tokens);
        let Some(&(len, h)) = hashes.last() else {
            return;
        };
        let entry_key = key_of(len, h);
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        if inner.entries.contains_key(&entry_key) {
            return;
        }
        while inner.used + bytes > self.budget {
            let Some((&victim, _)) = inner.recency.iter().min_by_key(|(_, &t)| t) else {
                break;
            };
            inner.recency.remove(&victim);
            if let Some(e) = inner.entries.remove(&victim) {
                inner.used -= e.bytes;
                inner.index.retain(|_, (k, _)| *k != victim);
                let len = e.tokens.len();
                if !inner.entries.values().any(|o| o.tokens.len() == len) {
                    inner.lengths.remove(&len);
                }
            }
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.recency.insert(entry_key, tick);
        let entry = PrefixEntry {
            tokens: tokens.to_vec(),
            kv,
            bytes,
        };
        for (l, hh) in hashes {
            inner.index.insert(key_of(l, hh), (entry_key, len));
        }
        inner.used += bytes;
        inner.lengths.insert(len);
        inner.entries.insert(entry_key, Arc::new(entry));
    }

    /// Bytes of KV held.
    pub fn used_bytes(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).used
    }

    /// Number of cached prefixes.
    pub fn len(&self) -> usize {
        self.inner
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entries
            .len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// f16 keys and values of `n` tokens in every layer.
fn kv_bytes(kv: &KvCache, n: usize) -> u64 {
    let (layers, heads, dim) = kv.shape();
    (2 * layers * heads * dim * n * 2) as u64
}
