//! Chunk KV precompute and the model-bound view of the KV store: compute a chunk's KV in the
//! fixed frame, store it, fetch and verify it.
//!
//! **The frame.** A chunk is prefilled on its own, after `frame` tokens (by default the RAG
//! prompt's prefix and neutral passages, see [`crate::rag_frame`]), at positions `0..frame.len() + n`. The frame's
//! own KV is not stored. What is stored is each chunk token's key before RoPE and its value,
//! for every layer, so fusion can rotate the keys to any position. The frame tokens are bound
//! into the store fingerprint: KV computed in another frame (or by other weights) never
//! matches.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_kvstore::{
    BlobKey, ChunkKv, KvDtype, KvLayout, KvStore, KvTier, ModelFingerprint, SharedKv, TierKind,
};
use engram_model::{KvCache, Logits, Model};
use half::f16;

use crate::error::Result;

/// The minimal frame: the BOS token when the model has one. A chunk computed on its own turns
/// its first token into an attention sink (a token that soaks up attention mass); with a BOS
/// in front, the BOS plays that role, as the real prompt's first token does at question time.
/// `engram eval fusion --frame bos|none|prefix` compares it with the other frames.
pub fn bos_frame(bos: Option<u32>) -> Vec<u32> {
    bos.into_iter().collect()
}

/// The file in the NVMe tier's folder naming (in hex) the fingerprint of the model and frame
/// its chunk KV was computed for; see [`ChunkStore::record_fingerprint`].
pub const FINGERPRINT_RECORD: &str = "chunk-kv-model";

/// Counters of the chunk store, cumulative since start.
#[derive(Debug, Default)]
pub struct ChunkCounters {
    /// Chunks whose KV was computed (ingestion, or a miss at question time).
    pub precomputed: AtomicU64,
    /// Blobs found but rejected (checksum, fingerprint, token or layout mismatch).
    pub rejected: AtomicU64,
    /// The same, by reason ([`Reject`]) and by the tier that served the blob.
    rejected_by: [AtomicU64; Reject::ALL.len()],
    rejected_dram: AtomicU64,
    rejected_nvme: AtomicU64,
    /// Chunks with no stored KV at question time.
    pub missing: AtomicU64,
    /// Puts that no tier accepted (full or failing disk): the KV is used but not kept.
    pub put_failed: AtomicU64,
}

/// What [`ChunkStore::ensure`] did with a chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ensured {
    /// A tier already held its KV.
    Present,
    /// Computed and kept by a tier.
    Stored,
    /// Computed, but no tier kept it (a full or failing disk): it is computed again when a
    /// question needs it.
    NotStored,
}

/// Why a stored blob was not used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reject {
    /// The bytes do not check out: checksum, magic, truncation, a field out of range.
    Checksum,
    /// Written by another version of the blob format.
    Version,
    /// Computed by another model or in another frame.
    Fingerprint,
    /// The KV of other tokens, or of another shape (a hash collision, or a bug).
    Layout,
}

impl Reject {
    pub const ALL: [Reject; 4] = [
        Reject::Checksum,
        Reject::Version,
        Reject::Fingerprint,
        Reject::Layout,
    ];

    /// The reason of a decode error.
    pub fn of(e: &engram_kvstore::KvStoreError) -> Reject {
        use engram_kvstore::KvStoreError as E;
        match e {
            E::UnsupportedVersion { .. } => Reject::Version,
            E::ModelMismatch { .. } => Reject::Fingerprint,
            E::TokenMismatch { .. } | E::LayoutMismatch { .. } => Reject::Layout,
            _ => Reject::Checksum,
        }
    }

    /// Lower-case name, as in the `reason` label of `engram_kv_rejected_total`.
    pub fn name(self) -> &'static str {
        match self {
            Reject::Checksum => "checksum",
            Reject::Version => "version",
            Reject::Fingerprint => "fingerprint",
            Reject::Layout => "layout",
        }
    }
}

/// A copy of the counters at one moment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChunkCounts {
    pub precomputed: u64,
    /// Rejections by reason, in [`Reject::ALL`] order.
    pub rejected: [u64; Reject::ALL.len()],
    /// Rejections of blobs the DRAM tier and the NVMe tier served (a tier counts them as hits).
    pub rejected_dram: u64,
    pub rejected_nvme: u64,
    pub missing: u64,
    pub put_failed: u64,
}

impl ChunkCounters {
    /// The counters now.
    pub fn snapshot(&self) -> ChunkCounts {
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ChunkCounts {
            precomputed: l(&self.precomputed),
            rejected: std::array::from_fn(|i| l(&self.rejected_by[i])),
            rejected_dram: l(&self.rejected_dram),
            rejected_nvme: l(&self.rejected_nvme),
            missing: l(&self.missing),
            put_failed: l(&self.put_failed),
        }
    }

    fn reject(&self, reason: Reject, tier: TierKind) {
        self.rejected.fetch_add(1, Ordering::Relaxed);
        let i = Reject::ALL
            .iter()
            .position(|&r| r == reason)
            .expect("every reason is in ALL");
        self.rejected_by[i].fetch_add(1, Ordering::Relaxed);
        match tier {
            TierKind::Dram => &self.rejected_dram,
            TierKind::Nvme => &self.rejected_nvme,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
}

/// Where one chunk's KV came from at question time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    Tier(TierKind),
    /// Not stored (or rejected): computed now.
    Computed,
}

/// One fetched chunk.
pub struct Fetched {
    /// Read in place from a stored f16 blob, or decoded (int8, or computed here).
    pub kv: SharedKv,
    pub source: Source,
    /// Stored bytes read (0 when computed).
    pub bytes: u64,
}

/// Timings of a fetch.
#[derive(Debug, Clone, Copy, Default)]
pub struct FetchTimes {
    /// Reading the blobs from the tiers.
    pub read: Duration,
    /// Verifying and decoding them.
    pub decode: Duration,
    /// Computing the chunks that were missing or rejected.
    pub compute: Duration,
}

/// The KV store as one model sees it: keys bound to the model and frame, layouts checked.
pub struct ChunkStore {
    store: Arc<KvStore>,
    fingerprint: ModelFingerprint,
    dtype: KvDtype,
    frame: Vec<u32>,
    /// The frame's own KV, computed on first use and shared by every precompute.
    frame_kv: std::sync::OnceLock<KvCache>,
    pub counters: ChunkCounters,
}

impl ChunkStore {
    /// A view of `store` for `model`, computing chunks after `frame` and storing `dtype`.
    pub fn new(store: Arc<KvStore>, model: &Model, frame: Vec<u32>, dtype: KvDtype) -> ChunkStore {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        h.update(b"engram-chunk-kv-frame-v1");
        h.update(&model.fingerprint());
        for t in &frame {
            h.update(&t.to_le_bytes());
        }
        ChunkStore {
            store,
            fingerprint: ModelFingerprint(h.digest128().to_le_bytes()),
            dtype,
            frame,
            frame_kv: std::sync::OnceLock::new(),
            counters: ChunkCounters::default(),
        }
    }

    /// What stored KV is bound to: the model's weights and shapes, and the frame.
    pub fn fingerprint(&self) -> ModelFingerprint {
        self.fingerprint
    }

    /// Records this store's fingerprint in the NVMe tier's folder ([`FINGERPRINT_RECORD`],
    /// replaced crash-safely) and returns whether the chunk KV stored there belonged to
    /// something else: another fingerprint was recorded, or none while the tier holds blobs.
    /// Every writer of chunk KV records it (the daemon and the command line), so a model or
    /// frame change is seen once, by whoever runs next. Without an NVMe tier, `false`.
    pub fn record_fingerprint(&self) -> std::io::Result<bool> {
        let Some(tier) = self.store.nvme() else {
            return Ok(false);
        };
        let hex: String = self
            .fingerprint
            .0
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let path = tier.dir().join(FINGERPRINT_RECORD);
        let recorded = match std::fs::read_to_string(&path) {
            Ok(s) => Some(s.trim().to_owned()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(e),
        };
        if recorded.as_deref() == Some(hex.as_str()) {
            return Ok(false);
        }
        let tmp = path.with_extension("tmp");
        {
            use std::io::Write;
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(hex.as_bytes())?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, &path)?;
        std::fs::File::open(tier.dir())?.sync_all()?;
        Ok(match recorded {
            Some(_) => true,
            None => tier.len() > 0,
        })
    }

    /// The tiers underneath.
    pub fn store(&self) -> &KvStore {
        &self.store
    }

    /// The frame chunks are computed in.
    pub fn frame(&self) -> &[u32] {
        &self.frame
    }

    /// The stored element type.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// The key a chunk's KV is stored under.
    pub fn key(&self, tokens: &[u32]) -> BlobKey {
        BlobKey::new(&self.fingerprint, self.dtype, tokens)
    }

    /// Computes `tokens`' KV in the frame.
    pub fn precompute(&self, model: &Model, tokens: &[u32]) -> Result<ChunkKv> {
        let frame_kv = match self.frame_kv.get() {
            Some(f) => f,
            None => {
                let f = frame_cache(model, &self.frame)?;
                self.frame_kv.get_or_init(|| f)
            }
        };
        let kv = precompute_after(model, frame_kv, tokens)?;
        self.counters.precomputed.fetch_add(1, Ordering::Relaxed);
        Ok(kv)
    }

    /// Stores a chunk's KV. Returns whether a tier kept it; a failure is counted, not fatal
    /// (the chunk is recomputed when next needed).
    pub fn put(&self, kv: &ChunkKv) -> bool {
        self.encode_and_put(kv).1
    }

    /// Encodes `kv` and offers it to the tiers; returns the blob and whether a tier kept it.
    fn encode_and_put(&self, kv: &ChunkKv) -> (Vec<u8>, bool) {
        let bytes = engram_kvstore::encode(kv, &self.fingerprint, self.dtype);
        let stored = self.store.put(&self.key(&kv.tokens), &bytes).stored();
        if !stored {
            self.counters.put_failed.fetch_add(1, Ordering::Relaxed);
        }
        (bytes, stored)
    }

    /// Ingestion: computes and stores the chunk's KV unless a tier already holds it.
    pub fn ensure(&self, model: &Model, tokens: &[u32]) -> Result<Ensured> {
        let key = self.key(tokens);
        let held = self.store.dram().is_some_and(|t| t.contains(&key))
            || self.store.nvme().is_some_and(|t| t.contains(&key));
        if held {
            return Ok(Ensured::Present);
        }
        let kv = self.precompute(model, tokens)?;
        Ok(if self.put(&kv) {
            Ensured::Stored
        } else {
            Ensured::NotStored
        })
    }

    /// Question time: every chunk's KV, from the tiers in one batch, verified; a chunk that is
    /// missing or whose blob is rejected is computed now (and stored again).
    pub fn fetch(&self, model: &Model, chunks: &[&[u32]]) -> Result<(Vec<Fetched>, FetchTimes)> {
        let cfg = model.config();
        let mut times = FetchTimes::default();
        let keys: Vec<BlobKey> = chunks.iter().map(|c| self.key(c)).collect();
        let t = Instant::now();
        let found = self.store.get_many(&keys);
        times.read = t.elapsed();
        let expected = |tokens: &[u32]| KvLayout {
            n_layer: cfg.n_layer,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            n_tokens: tokens.len(),
        };
        // Every blob is verified and decoded on the model's pool: each is independent, and
        // checksumming and copying a few megabytes each is most of a fetch from DRAM.
        let t = Instant::now();
        let decoded = model.pool().map(found.len(), |i| {
            found[i].as_ref().map(|(bytes, _)| {
                engram_kvstore::decode_shared(
                    bytes,
                    &self.fingerprint,
                    chunks[i],
                    &expected(chunks[i]),
                )
            })
        });
        times.decode = t.elapsed();
        let mut out = Vec::with_capacity(chunks.len());
        for (((tokens, key), hit), kv) in chunks.iter().zip(&keys).zip(found).zip(decoded) {
            let expected = expected(tokens);
            if let (Some((bytes, tier)), Some(kv)) = (hit, kv) {
                match kv {
                    Ok(kv) => {
                        out.push(Fetched {
                            kv,
                            source: Source::Tier(tier),
                            bytes: bytes.len() as u64,
                        });
                        continue;
                    }
                    Err(e) => {
                        let reason = Reject::of(&e);
                        self.counters.reject(reason, tier);
                        self.store.report_corrupt(key);
                        tracing::warn!(
                            key = %key,
                            tier = %tier,
                            reason = reason.name(),
                            "chunk KV rejected, recomputing: {e}"
                        );
                    }
                }
            } else {
                self.counters.missing.fetch_add(1, Ordering::Relaxed);
            }
            let t = Instant::now();
            let kv = self.precompute(model, tokens)?;
            let (bytes, _) = self.encode_and_put(&kv);
            // Serve what a later request will read back (int8 rounding included), so an
            // answer does not depend on whether the chunk was stored before.
            let kv = engram_kvstore::decode(&bytes, &self.fingerprint, tokens, &expected)?.into();
            times.compute += t.elapsed();
            out.push(Fetched {
                kv,
                source: Source::Computed,
                bytes: 0,
            });
        }
        Ok((out, times))
    }
}

/// Prefills `frame ++ tokens` at positions `0..` and returns the chunk tokens' keys before
/// RoPE and values, `[layer][head][token][dim]`.
pub fn precompute(model: &Model, frame: &[u32], tokens: &[u32]) -> Result<ChunkKv> {
    precompute_after(model, &frame_cache(model, frame)?, tokens)
}

/// The frame's KV at positions `0..frame.len()`.
fn frame_cache(model: &Model, frame: &[u32]) -> Result<KvCache> {
    let mut kv = model.new_cache(frame.len());
    let positions: Vec<i32> = (0..frame.len() as i32).collect();
    model.forward(frame, &positions, &mut kv, Logits::None)?;
    Ok(kv)
}

/// [`precompute`] with the frame's KV already computed (`frame_kv` holds exactly the frame at
/// positions `0..`): the frame costs nothing per chunk but its attention.
pub fn precompute_after(model: &Model, frame_kv: &KvCache, tokens: &[u32]) -> Result<ChunkKv> {
    let cfg = model.config();
    let (f, n, hd, heads) = (frame_kv.len(), tokens.len(), cfg.head_dim, cfg.n_head_kv);
    let layout = KvLayout {
        n_layer: cfg.n_layer,
        n_head_kv: heads,
        head_dim: hd,
        n_tokens: n,
    };
    let mut k = vec![f16::ZERO; layout.values_per_side()];
    let mut v = k.clone();
    let mut cache = model.new_cache(f + n);
    cache.append_from(frame_kv, 0..f)?;
    let positions: Vec<i32> = (f as i32..(f + n) as i32).collect();
    let kvw = heads * hd;
    let mut observe = |layer: usize, ks: &[f32], vs: &[f32]| {
        for h in 0..heads {
            let base = (layer * heads + h) * n * hd;
            for t in 0..n {
                let src = t * kvw + h * hd;
                let dst = base + t * hd;
                for d in 0..hd {
                    k[dst + d] = f16::from_f32(ks[src + d]);
                    v[dst + d] = f16::from_f32(vs[src + d]);
                }
            }
        }
    };
    model.forward_observed(tokens, &positions, &mut cache, Logits::None, &mut observe)?;
    Ok(ChunkKv {
        layout,
        tokens: tokens.to_vec(),
        k,
        v,
    })
}
