//! Stored chunk KV: the versioned, checksummed blob format and the DRAM and NVMe tiers.
//!
//! At ingestion Engram computes each chunk's KV cache (keys before rotary embedding, values as
//! they are, every layer) and stores it, so a question loads the chunk's KV instead of
//! recomputing it. This crate stores bytes plus a layout descriptor and knows nothing of the
//! model: the caller supplies a [`ModelFingerprint`] and the expected [`KvLayout`], and
//! [`decode`] refuses a blob of another model, chunk or shape, or one whose bytes changed.
//!
//! - `layout`: [`KvLayout`], [`KvDtype`], [`ModelFingerprint`], [`ChunkKv`] and the format limits.
//! - `blob`: [`encode`], [`decode`], [`inspect`] and the content address [`BlobKey`]
//!   (format: `docs/formats/kv-blob.md`).
//! - `tier`: the [`KvTier`] trait and [`TierMetrics`]; `lru` the index both tiers keep.
//! - `dram`: [`DramTier`], blobs in memory under a byte budget.
//! - `nvme`: [`NvmeTier`], one file per blob, crash-safe writes, io_uring batched reads, O_DIRECT
//!   (layout: `docs/formats/kv-tiers.md`); `io` holds the crate's only `unsafe`.
//! - `store`: [`KvStore`], DRAM then NVMe, write-through, promotion on NVMe hits.
//!
//! ```
//! use engram_kvstore::{
//!     decode, encode, BlobKey, ChunkKv, DramTier, KvDtype, KvLayout, KvStore, ModelFingerprint,
//!     NvmeOptions, NvmeTier, TierKind,
//! };
//! use half::f16;
//!
//! # fn main() -> engram_kvstore::Result<()> {
//! let dir = tempfile::tempdir().unwrap();
//! let model = ModelFingerprint([1; 16]);
//! let layout = KvLayout { n_layer: 2, n_head_kv: 1, head_dim: 4, n_tokens: 3 };
//! let n = layout.values_per_side();
//! let kv = ChunkKv::new(layout, vec![10, 11, 12], vec![f16::ONE; n], vec![f16::ZERO; n])?;
//!
//! // Ingestion: encode and store under the chunk's content address.
//! let store = KvStore::new(
//!     Some(DramTier::new(1 << 20)),
//!     Some(NvmeTier::open(dir.path(), NvmeOptions::new(1 << 30))?),
//! );
//! let key = BlobKey::new(&model, KvDtype::F16, &kv.tokens);
//! assert!(store.put(&key, &encode(&kv, &model, KvDtype::F16)).stored());
//!
//! // Question time: batched lookup, then decode against what the caller expects.
//! let found = store.get_many(&[key]);
//! let (bytes, tier) = found[0].as_ref().expect("stored above");
//! assert_eq!(*tier, TierKind::Dram);
//! match decode(bytes, &model, &[10, 11, 12], &layout) {
//!     Ok(back) => assert_eq!(back, kv),
//!     Err(_) => store.report_corrupt(&key), // then recompute the chunk
//! }
//! # Ok(())
//! # }
//! ```

// `unsafe` is allowed in `io` only.
#![deny(unsafe_code)]

mod blob;
mod dram;
mod error;
mod io;
mod layout;
mod lru;
mod nvme;
mod store;
mod tier;

#[cfg(test)]
mod tests;

pub use blob::{
    decode, decode_shared, encode, encoded_len, inspect, token_fingerprint, try_encode, BlobInfo,
    BlobKey, SharedKv, CHECKSUM_LEN, FORMAT_VERSION, HEADER_LEN, MAGIC,
};
pub use dram::DramTier;
pub use error::{KvStoreError, Result};
pub use io::drop_cached_pages;
pub use layout::{
    ChunkKv, KvDtype, KvLayout, ModelFingerprint, MAX_HEADS_KV, MAX_HEAD_DIM, MAX_LAYERS,
    MAX_TOKENS,
};
pub use nvme::{disk_space, io_uring_available, DiskSpace, IoMode, NvmeOptions, NvmeTier};
pub use store::{KvStore, PutOutcome, StoreMetrics};
pub use tier::{KvTier, TierKind, TierMetrics, LATENCY_BUCKETS};
