//! A bounded map with hit/miss counts, for names that are expensive to find
//! and cheap to keep.
//!
//! Two generations approximate least-recently-used eviction without a list:
//! entries go into the young map; when it is full, it becomes the old one
//! (the previous old one is dropped whole), and an old entry that is used
//! again moves back to the young map. So at most `capacity` entries are
//! held, and whatever was used since the last turnover survives it.

use std::{collections::HashMap, hash::Hash};

#[derive(Debug)]
pub struct GenerationalCache<K, V> {
    young: HashMap<K, V>,
    old: HashMap<K, V>,
    /// Entries per generation: half the capacity.
    generation: usize,
    pub hits: u64,
    pub misses: u64,
}

impl<K: Hash + Eq, V: Clone> GenerationalCache<K, V> {
    /// Holds at most `capacity` entries (at least 2).
    pub fn new(capacity: usize) -> Self {
        Self {
            young: HashMap::new(),
            old: HashMap::new(),
            generation: (capacity / 2).max(1),
            hits: 0,
            misses: 0,
        }
    }

    pub fn get(&mut self, key: &K) -> Option<V> {
        if let Some(value) = self.young.get(key) {
            self.hits += 1;
            return Some(value.clone());
        }
        match self.old.remove_entry(key) {
            Some((key, value)) => {
                self.hits += 1;
                self.insert_young(key, value.clone());
                Some(value)
            }
            None => {
                self.misses += 1;
                None
            }
        }
    }

    pub fn insert(&mut self, key: K, value: V) {
        self.old.remove(&key);
        self.insert_young(key, value);
    }

    fn insert_young(&mut self, key: K, value: V) {
        if self.young.len() >= self.generation && !self.young.contains_key(&key) {
            self.old = std::mem::take(&mut self.young);
        }
        self.young.insert(key, value);
    }

    pub fn len(&self) -> usize {
        self.young.len() + self.old.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn never_holds_more_than_its_capacity() {
        let mut cache = GenerationalCache::new(10);
        for key in 0..1000u32 {
            cache.insert(key, key * 2);
            assert!(cache.len() <= 10, "{} entries", cache.len());
        }
        assert_eq!(cache.get(&999), Some(1998));
        assert_eq!(cache.get(&0), None);
        assert_eq!((cache.hits, cache.misses), (1, 1));
    }

    #[test]
    fn entries_in_use_survive_turnovers() {
        const HOT: u32 = u32::MAX;
        let mut cache = GenerationalCache::new(4);
        cache.insert(HOT, 1);
        for key in 0..100 {
            cache.insert(key, key);
            // Used once per generation: always moved back to the young map.
            assert_eq!(cache.get(&HOT), Some(1), "after {key}");
        }
        assert!(cache.len() <= 4);
    }
}
