//! Fusion of the BM25 and vector candidate lists into one ranking.

use std::collections::HashMap;

use crate::Hit;

/// How BM25 and vector candidates are combined.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FusionMode {
    /// Reciprocal-rank fusion: sum of weight / (k + rank), rank starting at 1.
    Rrf { k: f32 },
    /// Weighted sum of min-max normalised scores.
    Weighted,
}

/// The fusion rule and the weight of each side; a weight of 0 leaves that side out entirely
/// (its candidates do not appear unless the other side found them too).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fusion {
    pub mode: FusionMode,
    pub bm25_weight: f32,
    pub dense_weight: f32,
}

impl Fusion {
    /// The `k` of the original RRF paper (Cormack et al., 2009), which most engines keep.
    pub const RRF_K: f32 = 60.0;
}

impl Default for Fusion {
    /// Equal-weight RRF with k = 60.
    fn default() -> Fusion {
        Fusion {
            mode: FusionMode::Rrf { k: Fusion::RRF_K },
            bm25_weight: 1.0,
            dense_weight: 1.0,
        }
    }
}

/// One fused candidate, with the raw score of each side that found it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Fused {
    pub chunk_id: u64,
    pub doc_id: u64,
    pub bm25: Option<f32>,
    pub dense: Option<f32>,
    pub score: f32,
}

/// Fuses two ranked lists (best first) into one, best first; ties go to the lower chunk id so
/// the order is deterministic.
///
/// - RRF: each list adds `weight / (k + rank)`, rank 1 for its first hit.
/// - Weighted: each list's scores are min-max normalised to [0, 1] (a list whose scores are all
///   equal, a single hit included, normalises to 1) and added with their weights.
///
/// A chunk listed twice in one list counts at its first (best) position.
pub fn fuse(bm25: &[Hit], dense: &[Hit], fusion: Fusion) -> Vec<Fused> {
    let mut by_chunk: HashMap<u64, Fused> = HashMap::with_capacity(bm25.len() + dense.len());
    for (hits, weight, is_bm25) in [
        (bm25, fusion.bm25_weight, true),
        (dense, fusion.dense_weight, false),
    ] {
        if weight == 0.0 || hits.is_empty() {
            continue;
        }
        let (min, max) = hits
            .iter()
            .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), h| {
                (lo.min(h.score), hi.max(h.score))
            });
        for (i, hit) in hits.iter().enumerate() {
            let entry = by_chunk.entry(hit.chunk_id).or_insert(Fused {
                chunk_id: hit.chunk_id,
                doc_id: hit.doc_id,
                bm25: None,
                dense: None,
                score: 0.0,
            });
            let raw = if is_bm25 {
                &mut entry.bm25
            } else {
                &mut entry.dense
            };
            if raw.is_some() {
                continue;
            }
            *raw = Some(hit.score);
            entry.score += weight
                * match fusion.mode {
                    FusionMode::Rrf { k } => 1.0 / (k + (i + 1) as f32),
                    FusionMode::Weighted if max > min => (hit.score - min) / (max - min),
                    FusionMode::Weighted => 1.0,
                };
        }
    }
    let mut fused: Vec<Fused> = by_chunk.into_values().collect();
    fused.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(a.chunk_id.cmp(&b.chunk_id))
    });
    fused
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hit(chunk_id: u64, score: f32) -> Hit {
        Hit {
            chunk_id,
            doc_id: chunk_id / 10,
            score,
        }
    }

    fn close(a: f32, b: f32) -> bool {
        (a - b).abs() < 1e-6
    }

    #[test]
    fn rrf_sums_reciprocal_ranks() {
        let bm25 = [hit(1, 9.0), hit(2, 5.0)];
        let dense = [hit(2, 0.9), hit(3, 0.8)];
        let fused = fuse(&bm25, &dense, Fusion::default());
        let ids: Vec<u64> = fused.iter().map(|f| f.chunk_id).collect();
        assert_eq!(ids, [2, 1, 3]);
        assert!(close(fused[0].score, 1.0 / 62.0 + 1.0 / 61.0));
        assert!(close(fused[1].score, 1.0 / 61.0));
        assert!(close(fused[2].score, 1.0 / 62.0));
        assert_eq!(fused[0].bm25, Some(5.0));
        assert_eq!(fused[0].dense, Some(0.9));
        assert_eq!(fused[1].dense, None);
        assert_eq!(fused[2].bm25, None);
        assert_eq!(fused[0].doc_id, 0);
    }

    #[test]
    fn rrf_weights_and_k() {
        let fusion = Fusion {
            mode: FusionMode::Rrf { k: 1.0 },
            bm25_weight: 2.0,
            dense_weight: 0.5,
        };
        let fused = fuse(&[hit(1, 1.0)], &[hit(1, 1.0), hit(2, 0.5)], fusion);
        assert!(close(fused[0].score, 2.0 / 2.0 + 0.5 / 2.0));
        assert!(close(fused[1].score, 0.5 / 3.0));
    }

    #[test]
    fn weighted_normalises_each_list() {
        let fusion = Fusion {
            mode: FusionMode::Weighted,
            bm25_weight: 0.3,
            dense_weight: 0.7,
        };
        let bm25 = [hit(1, 10.0), hit(2, 6.0), hit(3, 2.0)];
        let dense = [hit(3, 0.9), hit(4, 0.5)];
        let fused = fuse(&bm25, &dense, fusion);
        let score = |id| fused.iter().find(|f| f.chunk_id == id).unwrap().score;
        assert!(close(score(1), 0.3));
        assert!(close(score(2), 0.15));
        assert!(close(score(3), 0.7));
        assert!(close(score(4), 0.0));
        assert_eq!(fused[0].chunk_id, 3);
    }

    #[test]
    fn weighted_single_hit_normalises_to_one() {
        let fusion = Fusion {
            mode: FusionMode::Weighted,
            bm25_weight: 1.0,
            dense_weight: 1.0,
        };
        let fused = fuse(&[hit(7, 3.2)], &[], fusion);
        assert_eq!(fused.len(), 1);
        assert!(close(fused[0].score, 1.0));
    }

    #[test]
    fn zero_weight_removes_a_side() {
        let bm25 = [hit(1, 5.0), hit(2, 4.0)];
        let dense = [hit(3, 0.9), hit(1, 0.8)];
        for mode in [FusionMode::Rrf { k: 60.0 }, FusionMode::Weighted] {
            let fused = fuse(
                &bm25,
                &dense,
                Fusion {
                    mode,
                    bm25_weight: 0.0,
                    dense_weight: 1.0,
                },
            );
            let ids: Vec<u64> = fused.iter().map(|f| f.chunk_id).collect();
            assert_eq!(ids, [3, 1], "{mode:?}");
            assert!(fused.iter().all(|f| f.bm25.is_none()));
        }
    }

    #[test]
    fn ties_break_by_chunk_id() {
        let fused = fuse(&[hit(9, 1.0)], &[hit(4, 1.0)], Fusion::default());
        assert_eq!(fused[0].chunk_id, 4);
        assert_eq!(fused[1].chunk_id, 9);
        assert!(close(fused[0].score, fused[1].score));
    }

    #[test]
    fn duplicates_count_once_at_best_rank() {
        let fused = fuse(&[hit(1, 3.0), hit(1, 2.0)], &[], Fusion::default());
        assert_eq!(fused.len(), 1);
        assert!(close(fused[0].score, 1.0 / 61.0));
        assert_eq!(fused[0].bm25, Some(3.0));
    }

    #[test]
    fn empty_inputs() {
        assert!(fuse(&[], &[], Fusion::default()).is_empty());
    }
}
