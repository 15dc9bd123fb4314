//! Fusion policies: which tokens of the stored chunks are recomputed.

use std::fmt;
use std::str::FromStr;

use crate::error::FusionError;

/// The default policy: EPIC's boundary recomputation with 4 tokens per chunk. With the default
/// frame (`rag_frame`: the prompt's prefix and a context passage) chunks have no attention sink
/// of their own, and on MuSiQue every policy from `reuse` to `deviation:0.3` gave the same
/// fidelity (mean KL 0.044-0.053, `docs/bench/2026-11-21-fusion.md`); `boundary:4` measured
/// the lowest KL of those at 20x or more (41x), and its 4 tokens keep a guard against chunk
/// start sinks where a model or frame has them (without a frame, `reuse` gave KL 0.64 and
/// `boundary:16` 0.17).
pub const DEFAULT_POLICY: Policy = Policy::Boundary(4);

/// CacheBlend's check layer: layer 0 attends almost only to each token itself, so layer 1 is
/// the first whose values show how much a token's context changed.
pub const CHECK_LAYER: usize = 1;

/// How a fused prompt's chunks are prefilled.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Policy {
    /// Plain prefill of every token: the reference.
    Full,
    /// Stored KV as is; only the suffix (question) is computed.
    Reuse,
    /// EPIC: the first N tokens of each chunk are recomputed, plus the suffix.
    Boundary(usize),
    /// CacheBlend: every token through the check layer, then the fraction R of chunk tokens
    /// whose values deviate most, plus the suffix, through the rest.
    Deviation(f32),
    /// Query-aware (A3, ProphetKV) on top of `boundary:4`: the suffix is run over the stored
    /// KV through the first 12 layers to see which stored tokens its last 8 tokens attend to
    /// (attention mass summed over those layers, heads and tokens); each chunk's first 4
    /// tokens and the fraction R of chunk tokens with the most mass are recomputed, then the
    /// suffix again.
    Query(f32),
}

impl Policy {
    /// A short stable name, e.g. `boundary:16` (parses back to the same policy).
    pub fn name(&self) -> String {
        self.to_string()
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Policy::Full => write!(f, "full"),
            Policy::Reuse => write!(f, "reuse"),
            Policy::Boundary(n) => write!(f, "boundary:{n}"),
            Policy::Deviation(r) => write!(f, "deviation:{r}"),
            Policy::Query(r) => write!(f, "query:{r}"),
        }
    }
}

impl FromStr for Policy {
    type Err = FusionError;

    fn from_str(text: &str) -> Result<Policy, FusionError> {
        let bad = |reason| FusionError::BadPolicy {
            text: text.into(),
            reason,
        };
        let t = text.trim();
        match t.split_once(':') {
            None if t == "full" => Ok(Policy::Full),
            None if t == "reuse" => Ok(Policy::Reuse),
            None if t == "boundary" => Ok(DEFAULT_POLICY),
            Some(("boundary", n)) => n
                .parse()
                .map(Policy::Boundary)
                .map_err(|_| bad("N must be a whole number of tokens")),
            Some(("deviation", r)) => match r.parse::<f32>() {
                Ok(r) if (0.0..=1.0).contains(&r) => Ok(Policy::Deviation(r)),
                _ => Err(bad("R must be a fraction between 0 and 1")),
            },
            Some(("query", r)) => match r.parse::<f32>() {
                Ok(r) if (0.0..=1.0).contains(&r) => Ok(Policy::Query(r)),
                _ => Err(bad("R must be a fraction between 0 and 1")),
            },
            _ => Err(bad("unknown policy")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_back() {
        for p in [
            Policy::Full,
            Policy::Reuse,
            Policy::Boundary(16),
            Policy::Deviation(0.15),
            Policy::Query(0.03),
        ] {
            assert_eq!(p.name().parse::<Policy>().unwrap(), p);
        }
        assert_eq!("boundary".parse::<Policy>().unwrap(), DEFAULT_POLICY);
        for bad in [
            "",
            "boundary:x",
            "deviation:1.5",
            "blend",
            "deviation:-0.1",
            "query:2",
        ] {
            assert!(bad.parse::<Policy>().is_err(), "{bad}");
        }
    }
}
