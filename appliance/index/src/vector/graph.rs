//! The HNSW graph (hnsw_rs) behind the vector index, and its distance.
//!
//! hnsw_rs ties a reloaded `Hnsw<'b, ..>` to the `HnswIo` loader that produced it (`'a: 'b`,
//! for its optional mmap of the data file). [`Graph`] keeps both in one self-referential cell
//! (`self_cell`), so a reloaded graph is owned like a freshly built one and nothing leaks.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use hnsw_rs::prelude::{AnnT, Distance, FilterT, Hnsw, HnswIo};

/// Links per node on the upper layers (hnsw_rs keeps twice as many on layer 0). On 384-d
/// clustered vectors (`benches/retrieval.rs`), M = 24 with ef_construction = 200 gained under a
/// point of recall over 16 / 128 but took twice the build time and 1.5x the query time.
const MAX_CONNECTIONS: usize = 16;
/// Candidate list while inserting; see `MAX_CONNECTIONS` for the measurement behind it.
const EF_CONSTRUCTION: usize = 128;
/// hnsw_rs's cap on layers; with M = 24, 16 layers cover far more points than a collection holds.
const MAX_LAYERS: usize = 16;
/// Batches at least this large are inserted with hnsw_rs's rayon-parallel insert.
const PARALLEL_INSERT_MIN: usize = 256;

/// Cosine distance for unit vectors: 1 - dot, clamped at 0 (hnsw_rs asserts non-negative
/// distances, which rounding can break for a vector and itself).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct UnitDot;

impl Distance<f32> for UnitDot {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        (1.0 - dot(a, b)).max(0.0)
    }
}

/// Dot product with eight independent accumulators, which the compiler keeps in SIMD
/// registers (a single running sum would serialise every addition).
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let (ca, ta) = a.as_chunks::<8>();
    let (cb, tb) = b.as_chunks::<8>();
    let mut acc = [0.0f32; 8];
    for (x, y) in ca.iter().zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = ta.iter().zip(tb).map(|(x, y)| x * y).sum();
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]) + tail
}

type HnswGraph<'a> = Hnsw<'a, f32, UnitDot>;

self_cell::self_cell!(
    struct GraphCell {
        owner: HnswIo,

        #[not_covariant]
        dependent: HnswGraph,
    }
);

/// An HNSW graph over row numbers of the vector index.
pub(crate) struct Graph(GraphCell);

impl Graph {
    /// An empty graph sized for about `capacity` points.
    pub fn new(capacity: usize) -> Graph {
        Graph(GraphCell::new(HnswIo::default(), |_| {
            Hnsw::new(
                MAX_CONNECTIONS,
                capacity.max(1024),
                MAX_LAYERS,
                EF_CONSTRUCTION,
                UnitDot,
            )
        }))
    }

    /// Builds a graph over `vectors` (row-major, `dim` wide), row `i` as point `i`.
    pub fn build(vectors: &[f32], dim: usize) -> Graph {
        let graph = Graph::new(vectors.len() / dim.max(1));
        let items: Vec<(&[f32], usize)> = vectors.chunks_exact(dim).zip(0..).collect();
        graph.insert(&items);
        graph
    }

    /// Reloads a dump made by [`Graph::dump`]. The caller has verified the files' checksums;
    /// hnsw_rs still asserts on malformed input, so a panic while loading is caught and
    /// reported as an error.
    pub fn load(dir: &Path, basename: &str) -> Result<Graph, String> {
        let io = HnswIo::new(dir, basename);
        catch_unwind(AssertUnwindSafe(|| {
            GraphCell::try_new(io, |io| {
                io.load_hnsw_with_dist(UnitDot).map_err(|e| e.to_string())
            })
        }))
        .map_err(|_| "hnsw_rs panicked while loading the graph".to_string())?
        .map(Graph)
    }

    /// Dumps the graph as `dir/<basename>.hnsw.{graph,data}`; returns the basename hnsw_rs
    /// actually used (it picks another one rather than overwrite a file it may have mapped).
    pub fn dump(&self, dir: &Path, basename: &str) -> Result<String, String> {
        self.0
            .with_dependent(|_, g| g.file_dump(dir, basename))
            .map_err(|e| e.to_string())
    }

    pub fn len(&self) -> usize {
        self.0.with_dependent(|_, g| g.get_nb_point())
    }

    /// Inserts `(vector, row)` pairs.
    pub fn insert(&self, items: &[(&[f32], usize)]) {
        self.0.with_dependent(|_, g| {
            if items.len() >= PARALLEL_INSERT_MIN {
                g.parallel_insert_slice(&items.to_vec());
            } else {
                for &item in items {
                    g.insert_slice(item);
                }
            }
        })
    }

    /// The `k` nearest rows that pass `filter`, as `(row, distance)`, nearest first.
    pub fn search(
        &self,
        query: &[f32],
        k: usize,
        ef: usize,
        filter: Option<&dyn FilterT>,
    ) -> Vec<(usize, f32)> {
        self.0.with_dependent(|_, g| {
            g.search_filter(query, k, ef, filter)
                .into_iter()
                .map(|n| (n.d_id, n.distance))
                .collect()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive() {
        for n in [0, 1, 7, 8, 9, 384, 385] {
            let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.37).sin()).collect();
            let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.11).cos()).collect();
            let naive: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!((dot(&a, &b) - naive).abs() < 1e-4, "n = {n}");
        }
    }

    #[test]
    fn unit_dot_never_negative() {
        let v = [0.6f32, 0.8];
        assert!(UnitDot.eval(&v, &v) >= 0.0);
    }
}
