//! The tier trait every place chunk KV lives implements, and the metrics each tier keeps.

use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use crate::blob::BlobKey;
use crate::error::Result;

/// Which tier a blob came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TierKind {
    Dram,
    Nvme,
}

impl TierKind {
    /// `"dram"` or `"nvme"` (metrics labels, logs).
    pub fn name(self) -> &'static str {
        match self {
            TierKind::Dram => "dram",
            TierKind::Nvme => "nvme",
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A byte-budgeted, LRU-evicting store of blobs by key.
///
/// Every implementation passes the same conformance suite (`src/tests.rs`).
pub trait KvTier: Send + Sync {
    fn kind(&self) -> TierKind;
    /// The blob, or `None` on a miss. A hit makes the entry the most recently used.
    fn get(&self, key: &BlobKey) -> Result<Option<Arc<[u8]>>>;
    /// Batched read, one result per key in order. The NVMe tier submits all reads in one
    /// io_uring batch.
    fn get_many(&self, keys: &[BlobKey]) -> Vec<Result<Option<Arc<[u8]>>>>;
    /// Stores `bytes` under `key`, replacing an existing entry and evicting least recently used
    /// entries to fit the budget; a blob larger than the whole budget is `Full`.
    fn put(&self, key: &BlobKey, bytes: &[u8]) -> Result<()>;
    /// Drops the entry; `false` if there was none.
    fn remove(&self, key: &BlobKey) -> Result<bool>;
    /// Whether the tier has an entry for `key` (does not change recency or metrics).
    fn contains(&self, key: &BlobKey) -> bool;
    /// Bytes of the stored blobs.
    fn used_bytes(&self) -> u64;
    fn budget_bytes(&self) -> u64;
    /// Number of stored blobs.
    fn len(&self) -> usize;
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A snapshot of the counters.
    fn metrics(&self) -> TierMetrics;
}

/// Buckets of the read-latency histogram: bucket 0 counts reads under 1 us, bucket `i` reads in
/// `[2^(i-1), 2^i)` us, the last one everything from 2^22 us (~4 s) up: wide enough for a DRAM
/// hit and a stalled disk alike, small enough to snapshot by value.
pub const LATENCY_BUCKETS: usize = 24;

/// Counters of one tier, as a snapshot.
///
/// `hits`/`misses` count lookups; `reads` counts blobs actually read (the hits), each with one
/// latency sample: for a batch, the time from the batch's start until that blob's bytes are in
/// hand. `bytes_written` counts what `put` stored (including promotions into DRAM).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TierMetrics {
    pub hits: u64,
    pub misses: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub evictions: u64,
    pub reads: u64,
    pub read_latency_us_total: u64,
    pub read_latency_us_max: u64,
    /// See [`LATENCY_BUCKETS`].
    pub read_latency_hist: [u64; LATENCY_BUCKETS],
}

impl TierMetrics {
    /// Upper bound of the histogram bucket holding the `q` quantile (0..=1) of read latencies,
    /// capped at the observed maximum; 0 when nothing was read.
    pub fn read_latency_quantile_us(&self, q: f64) -> u64 {
        let total: u64 = self.read_latency_hist.iter().sum();
        if total == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, &n) in self.read_latency_hist.iter().enumerate() {
            seen += n;
            if seen >= rank {
                let upper = if i == 0 { 0 } else { (1u64 << i) - 1 };
                return upper.min(self.read_latency_us_max);
            }
        }
        self.read_latency_us_max
    }

    /// Mean read latency in microseconds; 0 when nothing was read.
    pub fn mean_read_latency_us(&self) -> f64 {
        if self.reads == 0 {
            0.0
        } else {
            self.read_latency_us_total as f64 / self.reads as f64
        }
    }
}

pub(crate) fn latency_bucket(us: u64) -> usize {
    ((u64::BITS - us.leading_zeros()) as usize).min(LATENCY_BUCKETS - 1)
}

/// The live counters behind [`TierMetrics`]; relaxed atomics, so a snapshot taken while other
/// threads work may be a few events apart between fields.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    bytes_read: AtomicU64,
    bytes_written: AtomicU64,
    evictions: AtomicU64,
    reads: AtomicU64,
    latency_total: AtomicU64,
    latency_max: AtomicU64,
    hist: [AtomicU64; LATENCY_BUCKETS],
}

impl Counters {
    pub fn hit(&self, bytes: usize, latency: Duration) {
        let us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.hits.fetch_add(1, Relaxed);
        self.reads.fetch_add(1, Relaxed);
        self.bytes_read.fetch_add(bytes as u64, Relaxed);
        self.latency_total.fetch_add(us, Relaxed);
        self.latency_max.fetch_max(us, Relaxed);
        self.hist[latency_bucket(us)].fetch_add(1, Relaxed);
    }

    pub fn miss(&self) {
        self.misses.fetch_add(1, Relaxed);
    }

    pub fn written(&self, bytes: usize) {
        self.bytes_written.fetch_add(bytes as u64, Relaxed);
    }

    pub fn evicted(&self, n: usize) {
        self.evictions.fetch_add(n as u64, Relaxed);
    }

    pub fn snapshot(&self) -> TierMetrics {
        TierMetrics {
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            bytes_written: self.bytes_written.load(Relaxed),
            evictions: self.evictions.load(Relaxed),
            reads: self.reads.load(Relaxed),
            read_latency_us_total: self.latency_total.load(Relaxed),
            read_latency_us_max: self.latency_max.load(Relaxed),
            read_latency_hist: std::array::from_fn(|i| self.hist[i].load(Relaxed)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_log2_microseconds() {
        assert_eq!(latency_bucket(0), 0);
        assert_eq!(latency_bucket(1), 1);
        assert_eq!(latency_bucket(2), 2);
        assert_eq!(latency_bucket(3), 2);
        assert_eq!(latency_bucket(4), 3);
        assert_eq!(latency_bucket(u64::MAX), LATENCY_BUCKETS - 1);
    }

    #[test]
    fn quantiles_come_from_the_histogram() {
        let c = Counters::default();
        assert_eq!(c.snapshot().read_latency_quantile_us(0.5), 0);
        for _ in 0..98 {
            c.hit(1, Duration::from_micros(10));
        }
        c.hit(1, Duration::from_micros(1000));
        c.hit(1, Duration::from_micros(1000));
        let m = c.snapshot();
        assert_eq!(m.reads, 100);
        assert_eq!(m.read_latency_quantile_us(0.5), 15);
        assert_eq!(m.read_latency_quantile_us(0.98), 15);
        assert_eq!(m.read_latency_quantile_us(0.99), 1000);
        assert_eq!(m.read_latency_quantile_us(1.0), 1000);
        assert!((m.mean_read_latency_us() - 29.8).abs() < 1e-9);
    }
}
