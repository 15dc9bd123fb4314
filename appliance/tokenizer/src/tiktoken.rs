//! A tiktoken vocabulary (`*.tiktoken`: one base64 token and its rank per line), to turn back
//! into text the token ids a client computed with OpenAI's tokenizer. OpenAI's embedding
//! clients send `cl100k_base` ids by default (LangChain's `OpenAIEmbeddings`); Engram's own
//! models tokenize differently, so the ids are decoded and the text embedded.

use std::path::Path;

use base64::Engine as _;

use crate::error::{Result, TokenizerError};

/// Token bytes by rank.
pub struct TiktokenVocab {
    pieces: Vec<Vec<u8>>,
}

impl std::fmt::Debug for TiktokenVocab {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TiktokenVocab({} tokens)", self.pieces.len())
    }
}

impl TiktokenVocab {
    /// Reads a `*.tiktoken` file.
    pub fn load(path: &Path) -> Result<TiktokenVocab> {
        let bad = |reason: String| TokenizerError::Tiktoken {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read_to_string(path).map_err(|e| bad(e.to_string()))?;
        Self::parse(&text).map_err(bad)
    }

    /// Parses the lines of a `*.tiktoken` file: every rank from 0 up, each once.
    pub fn parse(text: &str) -> std::result::Result<TiktokenVocab, String> {
        let mut pieces: Vec<Option<Vec<u8>>> = Vec::new();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
            let at = |why: &str| format!("line {}: {why}", n + 1);
            let (token, rank) = line
                .split_once(' ')
                .ok_or_else(|| at("expected `<base64 token> <rank>`"))?;
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(token)
                .map_err(|e| at(&format!("bad base64: {e}")))?;
            let rank: usize = rank.trim().parse().map_err(|_| at("bad rank"))?;
            if rank >= pieces.len() {
                pieces.resize(rank + 1, None);
            }
            if pieces[rank].replace(bytes).is_some() {
                return Err(at(&format!("rank {rank} appears twice")));
            }
        }
        if pieces.is_empty() {
            return Err("no tokens".into());
        }
        let pieces = pieces
            .into_iter()
            .enumerate()
            .map(|(rank, p)| p.ok_or_else(|| format!("rank {rank} is missing")))
            .collect::<std::result::Result<_, _>>()?;
        Ok(TiktokenVocab { pieces })
    }

    /// Number of tokens.
    pub fn len(&self) -> usize {
        self.pieces.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.is_empty()
    }

    /// The text of `ids` (invalid UTF-8 replaced by U+FFFD, as tiktoken's `decode` does), or
    /// the first id outside the vocabulary.
    pub fn decode(&self, ids: &[i64]) -> std::result::Result<String, i64> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let piece = usize::try_from(id)
                .ok()
                .and_then(|i| self.pieces.get(i))
                .ok_or(id)?;
            bytes.extend_from_slice(piece);
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ranks_and_decodes() {
        // "a" 0, "b" 1, "ab" 2, "é" (two bytes) 3.
        let v = TiktokenVocab::parse("YQ== 0\nYg== 1\nYWI= 2\nw6k= 3\n").unwrap();
        assert_eq!(v.len(), 4);
        assert_eq!(v.decode(&[2, 1, 3]).unwrap(), "abbé");
        assert_eq!(v.decode(&[0, 4]), Err(4));
        assert_eq!(v.decode(&[-1]), Err(-1));
        assert!(TiktokenVocab::parse("YQ== 0\nYg== 0\n")
            .unwrap_err()
            .contains("twice"));
        assert!(TiktokenVocab::parse("YQ== 1\n")
            .unwrap_err()
            .contains("rank 0"));
        assert!(TiktokenVocab::parse("!!! 0\n")
            .unwrap_err()
            .contains("base64"));
    }

    /// The real cl100k_base file when scripts/fetch-models.sh put it in ./models.
    #[test]
    fn cl100k_base_decodes_known_ids() {
        let path = Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/cl100k_base.tiktoken"
        ));
        if !path.exists() {
            eprintln!(
                "skipped: {} is absent (scripts/fetch-models.sh)",
                path.display()
            );
            return;
        }
        let v = TiktokenVocab::load(path).unwrap();
        assert_eq!(v.len(), 100_256);
        // tiktoken: cl100k_base.encode("hello world") == [15339, 1917].
        assert_eq!(v.decode(&[15339, 1917]).unwrap(), "hello world");
    }
}
