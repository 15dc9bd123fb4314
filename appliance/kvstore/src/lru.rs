//! The byte-accounted LRU index both tiers keep behind their mutex.
//!
//! A hash map from key to entry plus an ordered map from a recency tick to key: touching an
//! entry moves it to a fresh tick, the least recently used entry is the first tick. Both maps
//! are `O(log n)` or better, and a few thousand chunks per tier make this cheap.

use std::collections::{BTreeMap, HashMap};

use crate::blob::BlobKey;

/// One entry: the tier's value (DRAM: the bytes; NVMe: a generation number), its size in bytes
/// and its recency tick.
#[derive(Debug)]
pub(crate) struct Slot<V> {
    pub value: V,
    pub size: u64,
    tick: u64,
}

#[derive(Debug)]
pub(crate) struct Lru<V> {
    map: HashMap<BlobKey, Slot<V>>,
    order: BTreeMap<u64, BlobKey>,
    next_tick: u64,
    used: u64,
}

impl<V> Default for Lru<V> {
    fn default() -> Self {
        Lru {
            map: HashMap::new(),
            order: BTreeMap::new(),
            next_tick: 0,
            used: 0,
        }
    }
}

impl<V> Lru<V> {
    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn used(&self) -> u64 {
        self.used
    }

    pub fn contains(&self, key: &BlobKey) -> bool {
        self.map.contains_key(key)
    }

    pub fn peek(&self, key: &BlobKey) -> Option<&Slot<V>> {
        self.map.get(key)
    }

    /// The entry, made the most recently used.
    pub fn touch(&mut self, key: &BlobKey) -> Option<&Slot<V>> {
        let tick = self.next_tick;
        let slot = self.map.get_mut(key)?;
        self.order.remove(&slot.tick);
        slot.tick = tick;
        self.order.insert(tick, *key);
        self.next_tick += 1;
        Some(slot)
    }

    /// Inserts as the most recently used entry; returns the entry it replaced.
    pub fn insert(&mut self, key: BlobKey, value: V, size: u64) -> Option<Slot<V>> {
        let old = self.remove(&key);
        let tick = self.next_tick;
        self.next_tick += 1;
        self.order.insert(tick, key);
        self.map.insert(key, Slot { value, size, tick });
        self.used += size;
        old
    }

    pub fn remove(&mut self, key: &BlobKey) -> Option<Slot<V>> {
        let slot = self.map.remove(key)?;
        self.order.remove(&slot.tick);
        self.used -= slot.size;
        Some(slot)
    }

    /// Removes the least recently used entry other than `keep`.
    pub fn pop_lru_except(&mut self, keep: Option<&BlobKey>) -> Option<(BlobKey, Slot<V>)> {
        let key = *self.order.values().find(|k| Some(*k) != keep)?;
        let slot = self.remove(&key).expect("order and map agree");
        Some((key, slot))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn k(i: u8) -> BlobKey {
        BlobKey([i; 16])
    }

    #[test]
    fn touch_moves_to_the_back_and_sizes_add_up() {
        let mut l = Lru::default();
        for i in 0..4 {
            l.insert(k(i), (), 10 + u64::from(i));
        }
        assert_eq!(l.used(), 46);
        l.touch(&k(0));
        assert_eq!(l.pop_lru_except(None).unwrap().0, k(1));
        assert_eq!(l.pop_lru_except(Some(&k(2))).unwrap().0, k(3));
        assert_eq!(l.insert(k(2), (), 5).unwrap().size, 12);
        assert_eq!(l.used(), 15);
        assert_eq!(l.len(), 2);
        assert_eq!(l.pop_lru_except(None).unwrap().0, k(0));
        assert!(l.pop_lru_except(Some(&k(2))).is_none());
        assert!(l.remove(&k(2)).is_some());
        assert_eq!(l.used(), 0);
    }
}
