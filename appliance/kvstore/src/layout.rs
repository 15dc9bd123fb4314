//! What one chunk's KV is: its shape, its storage dtype, the model it belongs to, and the data.

use std::fmt;

use half::f16;

use crate::error::{KvStoreError, Result};

/// Most transformer layers a blob may describe (the largest open models have ~130).
pub const MAX_LAYERS: usize = 1024;
/// Most KV heads per layer a blob may describe (multi-head attention models have up to ~128).
pub const MAX_HEADS_KV: usize = 1024;
/// Largest head dimension a blob may describe (common values are 64 to 256).
pub const MAX_HEAD_DIM: usize = 1024;
/// Most tokens in one chunk (chunks are a few hundred tokens; 1 Mi leaves room for whole
/// documents while keeping a hostile header's claimed size far from `u64` overflow).
pub const MAX_TOKENS: usize = 1 << 20;

/// Shape of one chunk's KV: for each of K and V, `n_layer x n_head_kv x n_tokens x head_dim`
/// values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvLayout {
    pub n_layer: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_tokens: usize,
}

impl KvLayout {
    /// Values on one side (K or V): `n_layer * n_head_kv * n_tokens * head_dim`.
    ///
    /// # Panics
    /// On overflow, which a layout within the format limits cannot reach.
    pub fn values_per_side(&self) -> usize {
        self.rows_per_side()
            .checked_mul(self.head_dim)
            .expect("KV layout overflows usize")
    }

    /// Rows (one head's vector for one token) on one side: `n_layer * n_head_kv * n_tokens`.
    pub fn rows_per_side(&self) -> usize {
        self.n_layer
            .checked_mul(self.n_head_kv)
            .and_then(|n| n.checked_mul(self.n_tokens))
            .expect("KV layout overflows usize")
    }

    /// Values of one (layer, head): `n_tokens * head_dim`.
    pub fn values_per_head(&self) -> usize {
        self.n_tokens * self.head_dim
    }

    /// Where one (layer, head) lies within a side, in values (`[layer][head][token][dim]`).
    ///
    /// # Panics
    /// If `layer` or `head` is out of range.
    pub fn head_range(&self, layer: usize, head: usize) -> std::ops::Range<usize> {
        assert!(
            layer < self.n_layer && head < self.n_head_kv,
            "layer {layer} head {head} out of range for {self}"
        );
        let n = self.values_per_head();
        let start = (layer * self.n_head_kv + head) * n;
        start..start + n
    }

    /// Checks every dimension against the format limits (layers, heads and head dimension must
    /// also be non-zero).
    pub fn check_limits(&self) -> Result<()> {
        let dims: [(&'static str, usize, usize, usize); 4] = [
            ("n_layer", self.n_layer, 1, MAX_LAYERS),
            ("n_head_kv", self.n_head_kv, 1, MAX_HEADS_KV),
            ("head_dim", self.head_dim, 1, MAX_HEAD_DIM),
            ("n_tokens", self.n_tokens, 0, MAX_TOKENS),
        ];
        for (what, value, min, max) in dims {
            if value > max {
                return Err(KvStoreError::TooLarge {
                    what,
                    value: value as u64,
                    limit: max as u64,
                });
            }
            if value < min {
                return Err(KvStoreError::BadChunk {
                    what,
                    found: value,
                    expected: min,
                    layout: *self,
                });
            }
        }
        Ok(())
    }
}

impl fmt::Display for KvLayout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} layers x {} KV heads x {} tokens x {} dims",
            self.n_layer, self.n_head_kv, self.n_tokens, self.head_dim
        )
    }
}

/// How a blob stores the values.
///
/// `Int8` is symmetric and per row: for each (layer, K|V, head, token) one f32 scale
/// `max|x| / 127` (0 for an all-zero row) and `q = round(x / scale)`; it halves the size at an
/// error of at most half a step per value. Non-finite values are not expected in KV; NaN
/// quantizes to 0 and infinities to +-127 steps (the scale is taken over finite values only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    F16,
    Int8,
    /// 4-bit codes, KIVI's layout: keys per channel over groups of [`INT4_GROUP`] tokens,
    /// values per token over groups of as many dimensions, each group with an f16 scale and
    /// minimum.
    Int4,
}

/// Tokens (keys) or dimensions (values) sharing one int4 scale and minimum.
pub const INT4_GROUP: usize = 32;

impl KvDtype {
    /// Parses `"f16"`, `"int8"` or `"int4"`.
    pub fn parse(s: &str) -> Result<KvDtype> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "int8" => Ok(KvDtype::Int8),
            "int4" => Ok(KvDtype::Int4),
            _ => Err(KvStoreError::UnknownDtype {
                found: s.to_string(),
            }),
        }
    }

    /// `"f16"`, `"int8"` or `"int4"`, the inverse of [`KvDtype::parse`].
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F16 => "f16",
            KvDtype::Int8 => "int8",
            KvDtype::Int4 => "int4",
        }
    }

    /// The byte a blob stores for this dtype.
    pub(crate) fn code(self) -> u8 {
        match self {
            KvDtype::F16 => 0,
            KvDtype::Int8 => 1,
            KvDtype::Int4 => 2,
        }
    }

    pub(crate) fn from_code(code: u8) -> Option<KvDtype> {
        match code {
            0 => Some(KvDtype::F16),
            1 => Some(KvDtype::Int8),
            2 => Some(KvDtype::Int4),
            _ => None,
        }
    }
}

impl fmt::Display for KvDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Opaque 16-byte fingerprint of the model (computed by the caller from architecture, shapes and
/// a weight hash); a blob only decodes for the model that wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ModelFingerprint(pub [u8; 16]);

impl ModelFingerprint {
    /// 32 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }
}

impl fmt::Display for ModelFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// One chunk's keys (pre-RoPE) and values, f16, layout `[layer][head][token][dim]` for each side.
#[derive(Debug, Clone, PartialEq)]
pub struct ChunkKv {
    pub layout: KvLayout,
    pub tokens: Vec<u32>,
    pub k: Vec<f16>,
    pub v: Vec<f16>,
}

impl ChunkKv {
    /// Builds a chunk after checking the buffers against the layout and the format limits.
    pub fn new(layout: KvLayout, tokens: Vec<u32>, k: Vec<f16>, v: Vec<f16>) -> Result<ChunkKv> {
        let kv = ChunkKv {
            layout,
            tokens,
            k,
            v,
        };
        kv.check()?;
        Ok(kv)
    }

    /// The checks of [`ChunkKv::new`], for a chunk built from its public fields.
    pub fn check(&self) -> Result<()> {
        self.layout.check_limits()?;
        let values = self.layout.values_per_side();
        for (what, found, expected) in [
            ("token ids", self.tokens.len(), self.layout.n_tokens),
            ("K values", self.k.len(), values),
            ("V values", self.v.len(), values),
        ] {
            if found != expected {
                return Err(KvStoreError::BadChunk {
                    what,
                    found,
                    expected,
                    layout: self.layout,
                });
            }
        }
        Ok(())
    }

    /// Keys of one (layer, KV head): `n_tokens * head_dim` values, `[token][dim]`.
    ///
    /// # Panics
    /// If `layer` or `head` is out of range.
    pub fn k_head(&self, layer: usize, head: usize) -> &[f16] {
        &self.k[self.layout.head_range(layer, head)]
    }

    /// Values of one (layer, KV head): `n_tokens * head_dim` values, `[token][dim]`.
    ///
    /// # Panics
    /// If `layer` or `head` is out of range.
    pub fn v_head(&self, layer: usize, head: usize) -> &[f16] {
        &self.v[self.layout.head_range(layer, head)]
    }
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            n_layer: 2,
            n_head_kv: 3,
            head_dim: 4,
            n_tokens: 5,
        }
    }

    #[test]
    fn head_slices_follow_layer_head_token_dim() {
        let l = layout();
        let n = l.values_per_side();
        assert_eq!(n, 2 * 3 * 5 * 4);
        let k: Vec<f16> = (0..n).map(|i| f16::from_f32(i as f32)).collect();
        let v: Vec<f16> = (0..n).map(|i| f16::from_f32(-(i as f32))).collect();
        let kv = ChunkKv::new(l, vec![7; 5], k, v).unwrap();
        let h = kv.k_head(1, 2);
        assert_eq!(h.len(), 20);
        assert_eq!(h[0].to_f32(), ((3 + 2) * 20) as f32);
        assert_eq!(kv.v_head(0, 1)[3].to_f32(), -23.0);
    }

    #[test]
    fn chunk_new_rejects_wrong_lengths_and_limits() {
        let l = layout();
        let n = l.values_per_side();
        let z = vec![f16::ZERO; n];
        let e = ChunkKv::new(l, vec![0; 4], z.clone(), z.clone()).unwrap_err();
        assert!(
            matches!(
                e,
                KvStoreError::BadChunk {
                    what: "token ids",
                    ..
                }
            ),
            "{e}"
        );
        let e = ChunkKv::new(l, vec![0; 5], z[1..].to_vec(), z.clone()).unwrap_err();
        assert!(
            matches!(
                e,
                KvStoreError::BadChunk {
                    what: "K values",
                    ..
                }
            ),
            "{e}"
        );
        let big = KvLayout {
            head_dim: MAX_HEAD_DIM + 1,
            ..l
        };
        let e = big.check_limits().unwrap_err();
        assert!(
            matches!(
                e,
                KvStoreError::TooLarge {
                    what: "head_dim",
                    ..
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("1024"), "{e}");
    }

    #[test]
    fn dtype_names_round_trip() {
        for d in [KvDtype::F16, KvDtype::Int8, KvDtype::Int4] {
            assert_eq!(KvDtype::parse(d.name()).unwrap(), d);
            assert_eq!(KvDtype::from_code(d.code()), Some(d));
        }
        assert!(matches!(
            KvDtype::parse("q4"),
            Err(KvStoreError::UnknownDtype { .. })
        ));
    }
}
