//! Cross-module tests, in three parts:
//!
//! - `suite` + `conformance!`: the tier conformance suite, written once over `&dyn KvTier` and
//!   run against the DRAM tier and the NVMe tier in every I/O mode (plain and io_uring, buffered
//!   and O_DIRECT).
//! - `nvme`: what only the NVMe tier has: reopen, leftover temp files, files changed behind its
//!   back, the budget across reopen, failed writes, the directory lock.
//! - `store`: `KvStore` over both tiers.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use tempfile::TempDir;

use crate::{
    io_uring_available, BlobKey, DramTier, IoMode, KvStoreError, KvTier, NvmeOptions, NvmeTier,
    TierKind,
};

/// A tier under test and the directory it lives in (dropped after the tier).
struct Fixture {
    tier: Box<dyn KvTier>,
    _dir: Option<TempDir>,
}

/// Makes a tier with a budget; `None` when the mode cannot run here (io_uring refused), after
/// checking that the refusal is reported.
type Factory = fn(u64) -> Option<Fixture>;

fn dram(budget: u64) -> Option<Fixture> {
    Some(Fixture {
        tier: Box::new(DramTier::new(budget)),
        _dir: None,
    })
}

fn nvme_with(budget: u64, io: IoMode, direct: bool) -> Option<Fixture> {
    let dir = tempfile::tempdir().unwrap();
    let tier = NvmeTier::open(
        dir.path(),
        NvmeOptions {
            budget_bytes: budget,
            io,
            direct,
            reserve_free_bytes: 0,
        },
    );
    if io == IoMode::Uring {
        if let Err(e) = io_uring_available() {
            eprintln!("io_uring refused by this kernel ({e}); only the probe-failure path runs");
            let err = tier.expect_err("IoMode::Uring must fail to open when the probe fails");
            assert!(
                matches!(
                    err,
                    KvStoreError::Io {
                        op: "io_uring probe",
                        ..
                    }
                ),
                "{err}"
            );
            return None;
        }
    }
    let tier = tier.unwrap();
    let expected = match io {
        IoMode::Plain => "plain",
        IoMode::Uring => "io_uring",
        IoMode::Auto if io_uring_available().is_ok() => "io_uring",
        IoMode::Auto => "plain",
    };
    assert_eq!(tier.io_mode(), expected);
    Some(Fixture {
        tier: Box::new(tier),
        _dir: Some(dir),
    })
}

fn nvme_plain(budget: u64) -> Option<Fixture> {
    nvme_with(budget, IoMode::Plain, false)
}

fn nvme_plain_direct(budget: u64) -> Option<Fixture> {
    nvme_with(budget, IoMode::Plain, true)
}

fn nvme_uring(budget: u64) -> Option<Fixture> {
    nvme_with(budget, IoMode::Uring, true)
}

fn nvme_uring_buffered(budget: u64) -> Option<Fixture> {
    nvme_with(budget, IoMode::Uring, false)
}

fn nvme_auto(budget: u64) -> Option<Fixture> {
    nvme_with(budget, IoMode::Auto, true)
}

fn key(i: u32) -> BlobKey {
    BlobKey::new(&crate::ModelFingerprint([9; 16]), crate::KvDtype::F16, &[i])
}

/// Deterministic contents of blob `i`, `len` bytes, distinct per `i`.
fn blob(i: u32, len: usize) -> Vec<u8> {
    (0..len)
        .map(|j| (j as u32).wrapping_mul(31).wrapping_add(i.wrapping_mul(97)) as u8)
        .collect()
}

/// Sizes that straddle O_DIRECT's 4096-byte blocks.
fn len_of(i: u32) -> usize {
    3000 + (i as usize * 1237) % 6000
}

/// The conformance cases; each gets a factory so it can pick its budget.
mod suite {
    use super::*;

    pub fn round_trip(f: Factory) {
        let Some(fx) = f(1 << 20) else { return };
        let t = &*fx.tier;
        assert!(t.is_empty());
        let b = blob(1, 5000);
        t.put(&key(1), &b).unwrap();
        assert!(t.contains(&key(1)));
        assert_eq!(t.len(), 1);
        assert_eq!(&t.get(&key(1)).unwrap().unwrap()[..], &b[..]);
        // Empty and one-byte blobs are legal too.
        t.put(&key(2), &[]).unwrap();
        t.put(&key(3), &[7]).unwrap();
        assert_eq!(t.get(&key(2)).unwrap().unwrap().len(), 0);
        assert_eq!(&t.get(&key(3)).unwrap().unwrap()[..], &[7]);
        assert_eq!(t.used_bytes(), 5001);
        assert_eq!(t.budget_bytes(), 1 << 20);
    }

    pub fn replace(f: Factory) {
        let Some(fx) = f(1 << 20) else { return };
        let t = &*fx.tier;
        t.put(&key(1), &blob(1, 5000)).unwrap();
        t.put(&key(1), &blob(2, 7000)).unwrap();
        assert_eq!(&t.get(&key(1)).unwrap().unwrap()[..], &blob(2, 7000)[..]);
        assert_eq!(t.len(), 1);
        assert_eq!(t.used_bytes(), 7000);
        t.put(&key(1), &blob(3, 10)).unwrap();
        assert_eq!(t.used_bytes(), 10);
        assert_eq!(&t.get(&key(1)).unwrap().unwrap()[..], &blob(3, 10)[..]);
    }

    pub fn remove(f: Factory) {
        let Some(fx) = f(1 << 20) else { return };
        let t = &*fx.tier;
        t.put(&key(1), &blob(1, 4096)).unwrap();
        t.put(&key(2), &blob(2, 100)).unwrap();
        assert!(t.remove(&key(1)).unwrap());
        assert!(!t.remove(&key(1)).unwrap());
        assert!(!t.contains(&key(1)));
        assert!(t.get(&key(1)).unwrap().is_none());
        assert_eq!(t.used_bytes(), 100);
        assert_eq!(t.len(), 1);
    }

    pub fn misses_and_hits_are_counted(f: Factory) {
        let Some(fx) = f(1 << 20) else { return };
        let t = &*fx.tier;
        assert!(t.get(&key(1)).unwrap().is_none());
        let m = t.metrics();
        assert_eq!((m.hits, m.misses, m.reads, m.bytes_read), (0, 1, 0, 0));
        t.put(&key(1), &blob(1, 5000)).unwrap();
        assert_eq!(t.metrics().bytes_written, 5000);
        t.get(&key(1)).unwrap().unwrap();
        t.get(&key(1)).unwrap().unwrap();
        let m = t.metrics();
        assert_eq!((m.hits, m.misses, m.reads, m.bytes_read), (2, 1, 2, 10_000));
        assert_eq!(m.read_latency_hist.iter().sum::<u64>(), 2);
        assert!(m.read_latency_quantile_us(0.99) <= m.read_latency_us_max);
        assert!(m.mean_read_latency_us() <= m.read_latency_us_max as f64);
        // `contains` is not a lookup.
        assert!(t.contains(&key(1)));
        assert_eq!(t.metrics().hits, 2);
    }

    pub fn get_many_keeps_order(f: Factory) {
        let Some(fx) = f(1 << 20) else { return };
        let t = &*fx.tier;
        for i in [0, 2, 4] {
            t.put(&key(i), &blob(i, len_of(i))).unwrap();
        }
        let keys: Vec<BlobKey> = [0, 1, 2, 3, 4, 0].into_iter().map(key).collect();
        let got = t.get_many(&keys);
        assert_eq!(got.len(), 6);
        for (r, i) in got.into_iter().zip([0, 1, 2, 3, 4, 0]) {
            let r = r.unwrap();
            if i % 2 == 0 {
                assert_eq!(&r.unwrap()[..], &blob(i, len_of(i))[..], "key {i}");
            } else {
                assert!(r.is_none(), "key {i}");
            }
        }
        let m = t.metrics();
        assert_eq!((m.hits, m.misses), (4, 2));
        assert!(t.get_many(&[]).is_empty());
    }

    pub fn lru_eviction_keeps_recently_read(f: Factory) {
        let Some(fx) = f(3 * 4000) else { return };
        let t = &*fx.tier;
        for i in 0..3 {
            t.put(&key(i), &blob(i, 4000)).unwrap();
        }
        assert_eq!(t.used_bytes(), 12_000);
        // Reading 0 makes 1 the least recently used.
        t.get(&key(0)).unwrap().unwrap();
        t.put(&key(3), &blob(3, 4000)).unwrap();
        assert!(t.contains(&key(0)), "recently read entry was evicted");
        assert!(!t.contains(&key(1)));
        assert!(t.get(&key(1)).unwrap().is_none());
        assert!(t.contains(&key(2)) && t.contains(&key(3)));
        assert_eq!(t.metrics().evictions, 1);
        // A bigger blob evicts as many as it needs, oldest first.
        t.put(&key(4), &blob(4, 8000)).unwrap();
        assert!(t.used_bytes() <= t.budget_bytes());
        assert!(t.contains(&key(4)));
        assert_eq!(t.len(), 2);
        assert!(t.contains(&key(3)), "{:?}", t.metrics());
        assert_eq!(&t.get(&key(4)).unwrap().unwrap()[..], &blob(4, 8000)[..]);
    }

    pub fn larger_than_budget_is_full(f: Factory) {
        let Some(fx) = f(10_000) else { return };
        let t = &*fx.tier;
        t.put(&key(1), &blob(1, 3000)).unwrap();
        match t.put(&key(2), &blob(2, 10_001)) {
            Err(KvStoreError::Full {
                tier,
                needed: 10_001,
                budget: 10_000,
            }) => assert_eq!(tier, t.kind()),
            other => panic!("expected Full, got {other:?}"),
        }
        assert!(t.contains(&key(1)), "a refused put evicted an entry");
        assert_eq!(t.used_bytes(), 3000);
        // Exactly the budget fits, evicting everything else.
        t.put(&key(2), &blob(2, 10_000)).unwrap();
        assert_eq!(t.used_bytes(), 10_000);
        assert_eq!(t.len(), 1);
    }

    pub fn used_bytes_accounting(f: Factory) {
        let Some(fx) = f(1 << 20) else { return };
        let t = &*fx.tier;
        let mut expected = 0;
        for i in 0..10 {
            t.put(&key(i), &blob(i, len_of(i))).unwrap();
            expected += len_of(i) as u64;
            assert_eq!(t.used_bytes(), expected);
        }
        for i in (0..10).step_by(3) {
            t.remove(&key(i)).unwrap();
            expected -= len_of(i) as u64;
            assert_eq!(t.used_bytes(), expected);
        }
        assert_eq!(t.len(), 6);
    }

    pub fn concurrent_readers_and_writers(f: Factory) {
        // Room for about half the keys, so writers evict while readers read.
        const KEYS: u32 = 40;
        let Some(fx) = f(20 * 6000) else { return };
        let t = &*fx.tier;
        std::thread::scope(|s| {
            for w in 0..4u32 {
                s.spawn(move || {
                    for round in 0..3 {
                        for i in (w..KEYS).step_by(4) {
                            t.put(&key(i), &blob(i, len_of(i))).unwrap();
                            if round == 2 && i % 5 == 0 {
                                t.remove(&key(i)).unwrap();
                            }
                        }
                    }
                });
            }
            for r in 0..4u32 {
                s.spawn(move || {
                    for round in 0..10 {
                        let keys: Vec<BlobKey> = (0..KEYS)
                            .filter(|i| (i + r + round) % 3 == 0)
                            .map(key)
                            .collect();
                        for (k, got) in keys.iter().zip(t.get_many(&keys)) {
                            let i = (0..KEYS).find(|&i| key(i) == *k).unwrap();
                            if let Some(bytes) = got.unwrap() {
                                assert_eq!(&bytes[..], &blob(i, len_of(i))[..], "key {i}");
                            }
                        }
                        if let Some(bytes) = t.get(&key(round)).unwrap() {
                            assert_eq!(&bytes[..], &blob(round, len_of(round))[..]);
                        }
                    }
                });
            }
        });
        assert!(t.used_bytes() <= t.budget_bytes());
        let present: u64 = (0..KEYS)
            .filter(|&i| t.contains(&key(i)))
            .map(|i| len_of(i) as u64)
            .sum();
        assert_eq!(t.used_bytes(), present);
        for i in 0..KEYS {
            if let Some(bytes) = t.get(&key(i)).unwrap() {
                assert_eq!(&bytes[..], &blob(i, len_of(i))[..]);
            }
        }
    }
}

/// One `#[test]` per conformance case for one tier.
macro_rules! conformance {
    ($name:ident, $factory:expr) => {
        mod $name {
            use super::*;

            #[test]
            fn round_trip() {
                suite::round_trip($factory)
            }
            #[test]
            fn replace() {
                suite::replace($factory)
            }
            #[test]
            fn remove() {
                suite::remove($factory)
            }
            #[test]
            fn misses_and_hits_are_counted() {
                suite::misses_and_hits_are_counted($factory)
            }
            #[test]
            fn get_many_keeps_order() {
                suite::get_many_keeps_order($factory)
            }
            #[test]
            fn lru_eviction_keeps_recently_read() {
                suite::lru_eviction_keeps_recently_read($factory)
            }
            #[test]
            fn larger_than_budget_is_full() {
                suite::larger_than_budget_is_full($factory)
            }
            #[test]
            fn used_bytes_accounting() {
                suite::used_bytes_accounting($factory)
            }
            #[test]
            fn concurrent_readers_and_writers() {
                suite::concurrent_readers_and_writers($factory)
            }
        }
    };
}

conformance!(dram_tier, dram);
conformance!(nvme_plain_buffered, nvme_plain);
conformance!(nvme_plain_o_direct, nvme_plain_direct);
conformance!(nvme_io_uring_o_direct, nvme_uring);
conformance!(nvme_io_uring_buffered, nvme_uring_buffered);
conformance!(nvme_auto, nvme_auto);

mod nvme {
    use std::time::{Duration, SystemTime};

    use super::*;
    use crate::{decode, encode, ChunkKv, KvDtype, KvLayout, KvStore, ModelFingerprint};

    fn opts(budget: u64, io: IoMode) -> NvmeOptions {
        NvmeOptions {
            budget_bytes: budget,
            io,
            direct: true,
            reserve_free_bytes: 0,
        }
    }

    fn tmp_files(dir: &Path) -> Vec<String> {
        let mut out = Vec::new();
        for sub in fs::read_dir(dir).unwrap() {
            let sub = sub.unwrap().path();
            if sub.is_dir() {
                for f in fs::read_dir(&sub).unwrap() {
                    let name = f.unwrap().file_name().into_string().unwrap();
                    if name.ends_with(".tmp") {
                        out.push(name);
                    }
                }
            }
        }
        out
    }

    #[test]
    fn io_uring_probe_is_reported() {
        match io_uring_available() {
            Ok(()) => {
                let dir = tempfile::tempdir().unwrap();
                let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Uring)).unwrap();
                assert_eq!(t.io_mode(), "io_uring");
                eprintln!("io_uring works here");
            }
            Err(e) => {
                eprintln!("io_uring refused here: {e}");
                let dir = tempfile::tempdir().unwrap();
                let e = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Uring)).unwrap_err();
                assert!(matches!(e, KvStoreError::Io { .. }), "{e}");
                let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Auto)).unwrap();
                assert_eq!(t.io_mode(), "plain");
            }
        }
    }

    #[test]
    fn o_direct_reads_are_reported() {
        let dir = tempfile::tempdir().unwrap();
        let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
        t.put(&key(1), &blob(1, 5000)).unwrap();
        assert_eq!(&t.get(&key(1)).unwrap().unwrap()[..], &blob(1, 5000)[..]);
        eprintln!(
            "O_DIRECT reads {} on this file system",
            if t.direct_io() {
                "work"
            } else {
                "are refused (buffered fallback)"
            }
        );
    }

    #[test]
    fn files_fan_out_by_first_byte() {
        let dir = tempfile::tempdir().unwrap();
        let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
        t.put(&key(1), &blob(1, 10)).unwrap();
        let hex = key(1).to_hex();
        let path = dir.path().join(&hex[..2]).join(format!("{hex}.kv"));
        assert_eq!(t.blob_path(&key(1)), path);
        assert_eq!(fs::read(&path).unwrap(), blob(1, 10));
        assert!(tmp_files(dir.path()).is_empty());
    }

    #[test]
    fn reopen_sees_the_same_entries() {
        for io in [IoMode::Plain, IoMode::Auto] {
            let dir = tempfile::tempdir().unwrap();
            {
                let t = NvmeTier::open(dir.path(), opts(1 << 20, io)).unwrap();
                for i in 0..5 {
                    t.put(&key(i), &blob(i, len_of(i))).unwrap();
                }
                t.remove(&key(2)).unwrap();
            }
            let t = NvmeTier::open(dir.path(), opts(1 << 20, io)).unwrap();
            assert_eq!(t.len(), 4);
            assert_eq!(
                t.used_bytes(),
                [0, 1, 3, 4].iter().map(|&i| len_of(i) as u64).sum::<u64>()
            );
            for i in [0, 1, 3, 4] {
                assert_eq!(
                    &t.get(&key(i)).unwrap().unwrap()[..],
                    &blob(i, len_of(i))[..]
                );
            }
            assert!(t.get(&key(2)).unwrap().is_none());
        }
    }

    #[test]
    fn open_removes_leftover_temp_files_and_ignores_strangers() {
        let dir = tempfile::tempdir().unwrap();
        {
            let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
            t.put(&key(1), &blob(1, 100)).unwrap();
        }
        let sub = t_sub(dir.path(), &key(1));
        fs::write(sub.join(format!("{}.123.0.tmp", key(7).to_hex())), b"torn").unwrap();
        fs::create_dir_all(dir.path().join("ff")).unwrap();
        fs::write(dir.path().join("ff/whatever.tmp"), b"torn").unwrap();
        fs::write(dir.path().join("README"), b"not a blob").unwrap();
        fs::write(sub.join("notes.txt"), b"not a blob").unwrap();
        // A blob file in the wrong fan-out directory is not indexed.
        let hex = key(2).to_hex();
        let wrong = if &hex[..2] == "00" { "01" } else { "00" };
        fs::create_dir_all(dir.path().join(wrong)).unwrap();
        fs::write(dir.path().join(wrong).join(format!("{hex}.kv")), b"x").unwrap();

        let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
        assert!(tmp_files(dir.path()).is_empty());
        assert!(dir.path().join("README").exists());
        assert!(sub.join("notes.txt").exists());
        assert_eq!(t.len(), 1);
        assert!(!t.contains(&key(2)));
    }

    fn t_sub(dir: &Path, key: &BlobKey) -> std::path::PathBuf {
        dir.join(&key.to_hex()[..2])
    }

    #[test]
    fn file_deleted_behind_its_back_is_a_miss() {
        for io in [IoMode::Plain, IoMode::Auto] {
            let dir = tempfile::tempdir().unwrap();
            let t = NvmeTier::open(dir.path(), opts(1 << 20, io)).unwrap();
            t.put(&key(1), &blob(1, 100)).unwrap();
            t.put(&key(2), &blob(2, 100)).unwrap();
            fs::remove_file(t.blob_path(&key(1))).unwrap();
            let got = t.get_many(&[key(1), key(2)]);
            assert!(got[0].as_ref().unwrap().is_none());
            assert!(got[1].as_ref().unwrap().is_some());
            assert!(!t.contains(&key(1)), "index entry of a vanished file kept");
            assert_eq!(t.used_bytes(), 100);
            assert_eq!(t.metrics().misses, 1);
        }
    }

    fn sample_chunk() -> (ChunkKv, ModelFingerprint) {
        let layout = KvLayout {
            n_layer: 2,
            n_head_kv: 2,
            head_dim: 64,
            n_tokens: 16,
        };
        let n = layout.values_per_side();
        let k = (0..n)
            .map(|i| half::f16::from_f32(i as f32 / 100.0))
            .collect();
        let v = (0..n)
            .map(|i| half::f16::from_f32(-(i as f32) / 50.0))
            .collect();
        let kv = ChunkKv::new(layout, (100..116).collect(), k, v).unwrap();
        (kv, ModelFingerprint([3; 16]))
    }

    #[test]
    fn damaged_files_are_returned_and_decode_rejects_them() {
        let (kv, model) = sample_chunk();
        let bytes = encode(&kv, &model, KvDtype::F16);
        let k = BlobKey::new(&model, KvDtype::F16, &kv.tokens);
        for io in [IoMode::Plain, IoMode::Auto] {
            for damage in ["truncate", "flip"] {
                let dir = tempfile::tempdir().unwrap();
                let t = NvmeTier::open(dir.path(), opts(1 << 30, io)).unwrap();
                t.put(&k, &bytes).unwrap();
                let path = t.blob_path(&k);
                let mut on_disk = fs::read(&path).unwrap();
                match damage {
                    "truncate" => on_disk.truncate(on_disk.len() - 100),
                    _ => on_disk[5000] ^= 0x04,
                }
                fs::write(&path, &on_disk).unwrap();
                let got = t
                    .get(&k)
                    .unwrap()
                    .expect("the damaged bytes are still served");
                assert_eq!(&got[..], &on_disk[..]);
                let e = decode(&got, &model, &kv.tokens, &kv.layout).unwrap_err();
                assert!(matches!(e, KvStoreError::Corrupted { .. }), "{damage}: {e}");
                // The consumer reports it and the store drops it.
                let store = KvStore::new(None, Some(t));
                store.report_corrupt(&k);
                assert!(store.get_many(&[k])[0].is_none());
                assert!(!path.exists());
                assert_eq!(store.metrics().corrupt, 1);
            }
        }
    }

    #[test]
    fn budget_is_enforced_across_reopen_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        {
            let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
            for i in 0..5 {
                t.put(&key(i), &blob(i, 1000)).unwrap();
                // Pin modification times so the order does not rest on timestamp resolution.
                let f = fs::File::options()
                    .write(true)
                    .open(t.blob_path(&key(i)))
                    .unwrap();
                f.set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1_000 + u64::from(i)))
                    .unwrap();
            }
        }
        let t = NvmeTier::open(dir.path(), opts(2500, IoMode::Plain)).unwrap();
        assert_eq!(t.used_bytes(), 2000);
        assert!(t.contains(&key(3)) && t.contains(&key(4)));
        for i in 0..3 {
            assert!(!t.contains(&key(i)));
            assert!(
                !t.blob_path(&key(i)).exists(),
                "evicted file {i} left on disk"
            );
        }
        assert_eq!(t.metrics().evictions, 3);
        drop(t);
        let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
        assert_eq!(t.len(), 2);
    }

    #[test]
    fn no_space_removes_the_temp_file_and_keeps_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let t = NvmeTier::open(dir.path(), opts(20_000, IoMode::Plain)).unwrap();
        t.put(&key(1), &blob(1, 8000)).unwrap();
        t.put(&key(2), &blob(2, 8000)).unwrap();
        *t.fail_next_write.lock().unwrap() = Some(libc::ENOSPC);
        match t.put(&key(3), &blob(3, 4000)) {
            Err(KvStoreError::NoSpace { path }) => assert!(path.starts_with(dir.path())),
            other => panic!("expected NoSpace, got {other:?}"),
        }
        assert!(tmp_files(dir.path()).is_empty(), "temp file left behind");
        assert!(!t.contains(&key(3)));
        assert_eq!(t.used_bytes(), 16_000);
        assert_eq!(&t.get(&key(1)).unwrap().unwrap()[..], &blob(1, 8000)[..]);
        assert_eq!(&t.get(&key(2)).unwrap().unwrap()[..], &blob(2, 8000)[..]);
        // The failed write's reservation was released: a blob that fits without eviction
        // goes in without evicting.
        t.put(&key(3), &blob(3, 4000)).unwrap();
        assert_eq!(t.len(), 3);
        assert_eq!(t.metrics().evictions, 0);
        // Other write errors are `Io`, not `NoSpace`.
        *t.fail_next_write.lock().unwrap() = Some(libc::EIO);
        assert!(matches!(
            t.put(&key(4), &blob(4, 10)),
            Err(KvStoreError::Io { op: "write", .. })
        ));
        assert!(tmp_files(dir.path()).is_empty());
    }

    #[test]
    fn unwritable_fanout_directory_fails_the_put_only() {
        let dir = tempfile::tempdir().unwrap();
        let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
        t.put(&key(1), &blob(1, 100)).unwrap();
        // Runs as root here, so a read-only mode would not stop the write: put a plain file
        // where the fan-out directory of the next key must go instead.
        let k = (2..)
            .map(key)
            .find(|k| k.to_hex()[..2] != key(1).to_hex()[..2])
            .unwrap();
        fs::write(t_sub(dir.path(), &k), b"in the way").unwrap();
        let e = t.put(&k, &blob(9, 100)).unwrap_err();
        assert!(matches!(e, KvStoreError::Io { .. }), "{e}");
        assert!(!t.contains(&k));
        assert_eq!(t.used_bytes(), 100);
        assert_eq!(&t.get(&key(1)).unwrap().unwrap()[..], &blob(1, 100)[..]);
    }

    #[test]
    fn removed_directory_gives_errors_and_misses_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("tier");
        let t = NvmeTier::open(&root, opts(1 << 20, IoMode::Auto)).unwrap();
        t.put(&key(1), &blob(1, 100)).unwrap();
        fs::remove_dir_all(&root).unwrap();
        assert!(t.put(&key(2), &blob(2, 100)).is_err());
        assert!(t.get(&key(1)).unwrap().is_none());
        assert!(t.is_empty());
        assert_eq!(t.used_bytes(), 0);
    }

    #[test]
    fn second_open_of_a_directory_is_locked_out() {
        let dir = tempfile::tempdir().unwrap();
        let t = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
        let e = NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap_err();
        assert!(matches!(e, KvStoreError::Locked { .. }), "{e}");
        drop(t);
        NvmeTier::open(dir.path(), opts(1 << 20, IoMode::Plain)).unwrap();
    }

    #[test]
    fn read_errors_are_errors_not_misses() {
        let dir = tempfile::tempdir().unwrap();
        let t = NvmeTier::open(
            dir.path(),
            NvmeOptions {
                budget_bytes: 1 << 20,
                io: IoMode::Plain,
                direct: false,
                reserve_free_bytes: 0,
            },
        )
        .unwrap();
        t.put(&key(1), &blob(1, 100)).unwrap();
        // A directory where the blob file should be: it opens, and reading it fails (EISDIR).
        let path = t.blob_path(&key(1));
        fs::remove_file(&path).unwrap();
        fs::create_dir(&path).unwrap();
        assert!(matches!(t.get(&key(1)), Err(KvStoreError::Io { .. })));
        let store = KvStore::new(Some(DramTier::new(1 << 20)), Some(t));
        assert!(store.get_many(&[key(1)])[0].is_none());
        assert_eq!(store.metrics().io_errors, 1);
    }
}

mod store {
    use super::*;
    use crate::{KvStore, StoreMetrics};

    fn both(dram_budget: u64) -> (KvStore, TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let nvme = NvmeTier::open(dir.path(), NvmeOptions::new(1 << 20)).unwrap();
        (
            KvStore::new(Some(DramTier::new(dram_budget)), Some(nvme)),
            dir,
        )
    }

    fn tiers(store: &KvStore, keys: &[BlobKey]) -> Vec<Option<TierKind>> {
        store
            .get_many(keys)
            .into_iter()
            .map(|r| r.map(|(_, t)| t))
            .collect()
    }

    #[test]
    fn reads_dram_first_then_nvme_and_promotes() {
        let (store, _dir) = both(2 * 5000);
        for i in 0..3 {
            assert!(store.put(&key(i), &blob(i, 5000)).stored());
        }
        // DRAM holds 1 and 2; 0 is only on NVMe.
        assert_eq!(
            tiers(&store, &[key(0), key(1), key(2), key(9)]),
            vec![
                Some(TierKind::Nvme),
                Some(TierKind::Dram),
                Some(TierKind::Dram),
                None
            ]
        );
        // The NVMe hit was promoted.
        assert!(store.dram().unwrap().contains(&key(0)));
        let got = store.get_many(&[key(0)]);
        let (bytes, tier) = got[0].as_ref().unwrap();
        assert_eq!(*tier, TierKind::Dram);
        assert_eq!(&bytes[..], &blob(0, 5000)[..]);
        let m = store.metrics();
        assert_eq!(m.nvme.as_ref().unwrap().hits, 1);
        assert_eq!(m.nvme.as_ref().unwrap().misses, 1);
        assert_eq!(m.io_errors, 0);
    }

    #[test]
    fn put_reports_each_tier() {
        let (store, _dir) = both(1000);
        let out = store.put(&key(1), &blob(1, 5000));
        assert!(matches!(
            out.dram,
            Some(Err(KvStoreError::Full {
                tier: TierKind::Dram,
                ..
            }))
        ));
        assert!(matches!(out.nvme, Some(Ok(()))));
        assert!(out.stored());
        // Too big to promote: still served from NVMe, every time.
        assert_eq!(tiers(&store, &[key(1)]), vec![Some(TierKind::Nvme)]);
        assert_eq!(tiers(&store, &[key(1)]), vec![Some(TierKind::Nvme)]);
    }

    #[test]
    fn remove_and_report_corrupt_drop_both_copies() {
        let (store, _dir) = both(1 << 20);
        store.put(&key(1), &blob(1, 100));
        store.put(&key(2), &blob(2, 100));
        store.remove(&key(1)).unwrap();
        store.report_corrupt(&key(2));
        assert_eq!(tiers(&store, &[key(1), key(2)]), vec![None, None]);
        assert!(!store.nvme().unwrap().contains(&key(2)));
        assert_eq!(store.metrics().corrupt, 1);
    }

    #[test]
    fn single_tier_and_empty_stores() {
        let empty = KvStore::new(None, None);
        assert!(!empty.put(&key(1), &[1]).stored());
        assert_eq!(empty.get_many(&[key(1)]).len(), 1);
        assert!(empty.get_many(&[key(1)])[0].is_none());
        assert_eq!(empty.metrics(), StoreMetrics::default());

        let dram_only = KvStore::new(Some(DramTier::new(100)), None);
        assert!(dram_only.put(&key(1), &[1, 2]).stored());
        let got = dram_only.get_many(&[key(1)]);
        assert_eq!(
            got[0].as_ref().map(|(b, _)| Arc::clone(b)).unwrap()[..],
            [1, 2]
        );
    }
}
