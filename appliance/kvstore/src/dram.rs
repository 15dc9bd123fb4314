//! The DRAM tier: blobs in memory under a byte budget, least recently used evicted first.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Instant;

use crate::blob::BlobKey;
use crate::error::{KvStoreError, Result};
use crate::lru::Lru;
use crate::tier::{Counters, KvTier, TierKind, TierMetrics};

/// Blobs in memory. Values are `Arc<[u8]>`, so a hit hands out the stored bytes without copying
/// them and an evicted blob stays valid for readers that still hold it.
///
/// One mutex guards the index; it is held only for map updates (never for a copy or I/O).
#[derive(Debug)]
pub struct DramTier {
    budget: u64,
    lru: Mutex<Lru<Arc<[u8]>>>,
    counters: Counters,
}

impl DramTier {
    pub fn new(budget_bytes: u64) -> DramTier {
        DramTier {
            budget: budget_bytes,
            lru: Mutex::new(Lru::default()),
            counters: Counters::default(),
        }
    }

    /// [`KvTier::put`] of bytes already in an `Arc` (a promotion from NVMe), without copying.
    pub fn put_arc(&self, key: &BlobKey, bytes: Arc<[u8]>) -> Result<()> {
        let size = bytes.len() as u64;
        if size > self.budget {
            return Err(KvStoreError::Full {
                tier: TierKind::Dram,
                needed: size,
                budget: self.budget,
            });
        }
        let mut evicted = Vec::new();
        {
            let mut lru = self.lock();
            lru.remove(key);
            while lru.used() + size > self.budget {
                match lru.pop_lru_except(None) {
                    // Dropped after the lock is released, in case it is the last reference.
                    Some((_, slot)) => evicted.push(slot.value),
                    None => break,
                }
            }
            lru.insert(*key, bytes, size);
        }
        self.counters.evicted(evicted.len());
        self.counters.written(size as usize);
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, Lru<Arc<[u8]>>> {
        // The index is consistent after every statement that can panic, so a poisoned lock is
        // still usable.
        self.lru.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl KvTier for DramTier {
    fn kind(&self) -> TierKind {
        TierKind::Dram
    }

    fn get(&self, key: &BlobKey) -> Result<Option<Arc<[u8]>>> {
        let start = Instant::now();
        let found = self.lock().touch(key).map(|slot| Arc::clone(&slot.value));
        match &found {
            Some(bytes) => self.counters.hit(bytes.len(), start.elapsed()),
            None => self.counters.miss(),
        }
        Ok(found)
    }

    fn get_many(&self, keys: &[BlobKey]) -> Vec<Result<Option<Arc<[u8]>>>> {
        keys.iter().map(|k| self.get(k)).collect()
    }

    fn put(&self, key: &BlobKey, bytes: &[u8]) -> Result<()> {
        if bytes.len() as u64 > self.budget {
            return Err(KvStoreError::Full {
                tier: TierKind::Dram,
                needed: bytes.len() as u64,
                budget: self.budget,
            });
        }
        self.put_arc(key, Arc::from(bytes))
    }

    fn remove(&self, key: &BlobKey) -> Result<bool> {
        let removed = self.lock().remove(key);
        Ok(removed.is_some())
    }

    fn contains(&self, key: &BlobKey) -> bool {
        self.lock().contains(key)
    }

    fn used_bytes(&self) -> u64 {
        self.lock().used()
    }

    fn budget_bytes(&self) -> u64 {
        self.budget
    }

    fn len(&self) -> usize {
        self.lock().len()
    }

    fn metrics(&self) -> TierMetrics {
        self.counters.snapshot()
    }
}
