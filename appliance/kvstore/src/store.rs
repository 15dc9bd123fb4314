//! The tiers together: DRAM first, then NVMe; an NVMe hit is promoted into DRAM.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

use crate::blob::BlobKey;
use crate::dram::DramTier;
use crate::error::Result;
use crate::nvme::NvmeTier;
use crate::tier::{KvTier, TierKind, TierMetrics};

/// What each tier did with a [`KvStore::put`] (`None`: the store has no such tier).
#[derive(Debug)]
pub struct PutOutcome {
    pub dram: Option<Result<()>>,
    pub nvme: Option<Result<()>>,
}

impl PutOutcome {
    /// At least one tier stored the blob.
    pub fn stored(&self) -> bool {
        matches!(self.dram, Some(Ok(()))) || matches!(self.nvme, Some(Ok(())))
    }
}

/// Counters of the store and its tiers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StoreMetrics {
    pub dram: Option<TierMetrics>,
    pub nvme: Option<TierMetrics>,
    /// Tier reads that failed with an I/O error (each served as a miss).
    pub io_errors: u64,
    /// Blobs the consumer reported as undecodable ([`KvStore::report_corrupt`]).
    pub corrupt: u64,
}

/// The DRAM and NVMe tiers as one store: write-through, read DRAM first, promote NVMe hits.
#[derive(Debug, Default)]
pub struct KvStore {
    dram: Option<DramTier>,
    nvme: Option<Arc<NvmeTier>>,
    io_errors: AtomicU64,
    corrupt: AtomicU64,
}

impl KvStore {
    pub fn new(dram: Option<DramTier>, nvme: Option<NvmeTier>) -> KvStore {
        KvStore::with_shared_nvme(dram, nvme.map(Arc::new))
    }

    /// A store over an NVMe tier that others hold too (the daemon's disk guard asks it to make
    /// room when the disk runs low).
    pub fn with_shared_nvme(dram: Option<DramTier>, nvme: Option<Arc<NvmeTier>>) -> KvStore {
        KvStore {
            dram,
            nvme,
            io_errors: AtomicU64::new(0),
            corrupt: AtomicU64::new(0),
        }
    }

    /// Write-through: DRAM (best effort, evicting) and NVMe. Each tier's result is in the
    /// outcome; [`PutOutcome::stored`] says whether at least one tier has the blob.
    pub fn put(&self, key: &BlobKey, bytes: &[u8]) -> PutOutcome {
        PutOutcome {
            dram: self.dram.as_ref().map(|t| t.put(key, bytes)),
            nvme: self.nvme.as_ref().map(|t| t.put(key, bytes)),
        }
    }

    /// Batched lookup, one result per key in order, each saying which tier served it. The keys
    /// DRAM misses go to NVMe in one batch; NVMe hits are promoted into DRAM (best effort). A
    /// tier's I/O error is counted in [`StoreMetrics::io_errors`] and served as a miss.
    pub fn get_many(&self, keys: &[BlobKey]) -> Vec<Option<(Arc<[u8]>, TierKind)>> {
        let mut out: Vec<Option<(Arc<[u8]>, TierKind)>> = vec![None; keys.len()];
        if let Some(dram) = &self.dram {
            for (slot, r) in out.iter_mut().zip(dram.get_many(keys)) {
                *slot = self.ok_or_count(r).map(|b| (b, TierKind::Dram));
            }
        }
        let Some(nvme) = &self.nvme else {
            return out;
        };
        let missing: Vec<usize> = (0..keys.len()).filter(|&i| out[i].is_none()).collect();
        if missing.is_empty() {
            return out;
        }
        let wanted: Vec<BlobKey> = missing.iter().map(|&i| keys[i]).collect();
        for (&i, r) in missing.iter().zip(nvme.get_many(&wanted)) {
            if let Some(bytes) = self.ok_or_count(r) {
                if let Some(dram) = &self.dram {
                    // Too big for the DRAM budget is the only failure; the NVMe copy serves.
                    let _ = dram.put_arc(&keys[i], Arc::clone(&bytes));
                }
                out[i] = Some((bytes, TierKind::Nvme));
            }
        }
        out
    }

    fn ok_or_count(&self, r: Result<Option<Arc<[u8]>>>) -> Option<Arc<[u8]>> {
        r.unwrap_or_else(|_| {
            self.io_errors.fetch_add(1, Relaxed);
            None
        })
    }

    /// Removes the blob from both tiers (both are tried; the first error is returned).
    pub fn remove(&self, key: &BlobKey) -> Result<()> {
        let dram = self.dram.as_ref().map_or(Ok(false), |t| t.remove(key));
        let nvme = self.nvme.as_ref().map_or(Ok(false), |t| t.remove(key));
        dram.and(nvme).map(|_| ())
    }

    pub fn dram(&self) -> Option<&DramTier> {
        self.dram.as_ref()
    }

    pub fn nvme(&self) -> Option<&NvmeTier> {
        self.nvme.as_deref()
    }

    pub fn metrics(&self) -> StoreMetrics {
        StoreMetrics {
            dram: self.dram.as_ref().map(|t| t.metrics()),
            nvme: self.nvme.as_ref().map(|t| t.metrics()),
            io_errors: self.io_errors.load(Relaxed),
            corrupt: self.corrupt.load(Relaxed),
        }
    }

    /// Called by the consumer when `decode` rejected a blob: drops it from both tiers (so the
    /// recomputed KV replaces it) and counts it.
    pub fn report_corrupt(&self, key: &BlobKey) {
        self.corrupt.fetch_add(1, Relaxed);
        if self.remove(key).is_err() {
            self.io_errors.fetch_add(1, Relaxed);
        }
    }
}
