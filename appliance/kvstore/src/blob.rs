//! The KV blob: one chunk's KV as a versioned, checksummed byte string, and its content address.
//!
//! All integers are little-endian; the blob ends with the xxh3-64 of all its preceding bytes.
//! Nothing is padded. (`docs/formats/kv-blob.md` has the full description.)
//!
//! ```text
//! offset
//!      0 +------------------------------------------+
//!        | magic "ENGRAMKV"                     [8] |
//!      8 | format version  u32  (= 1)               |
//!     12 | dtype u8 (0 f16, 1 int8, 2 int4) | 0 [3] |
//!     16 | model fingerprint                   [16] |
//!     32 | token fingerprint (xxh3-128 of ids) [16] |
//!     48 | n_layer u32 | n_head_kv u32              |
//!     56 | head_dim u32 | n_tokens u32              |
//!     64 | token ids: n_tokens x u32                |
//!        +------------------------------------------+
//!        | f16 payload:                             |
//!        |   K [layer][head][token][dim] x f16      |
//!        |   V [layer][head][token][dim] x f16      |
//!        | or int8 payload:                         |
//!        |   K scales [layer][head][token] x f32    |
//!        |   K values [layer][head][token][dim] x i8|
//!        |   V scales, V values (same shapes)       |
//!        | or int4 payload (G = 32):                |
//!        |   K groups [layer][head][token/G][dim]   |
//!        |     x (scale f16, min f16)               |
//!        |   K codes [layer][head][token]           |
//!        |     [ceil(dim/2)] x u8 (low nibble first)|
//!        |   V groups [layer][head][token][dim/G]   |
//!        |     x (scale f16, min f16)               |
//!        |   V codes (as K's)                       |
//!        +------------------------------------------+
//!        | xxh3-64 of everything above  u64         |
//!        +------------------------------------------+
//! ```
//!
//! [`decode`] trusts nothing before the checksum has passed: it checks the length can hold a
//! header, the magic, the checksum, the version, then the header fields against the limits and
//! the length the header implies against the real one (with checked arithmetic, before any
//! allocation), and only then compares model, layout and tokens with what the caller expects.

use std::fmt;
use std::sync::Arc;

use half::f16;
use xxhash_rust::xxh3::{xxh3_128, xxh3_64, Xxh3};
use zerocopy::FromBytes;

use crate::error::{KvStoreError, Result};
use crate::layout::{hex, ChunkKv, KvDtype, KvLayout, ModelFingerprint, INT4_GROUP};

/// First bytes of every blob.
pub const MAGIC: [u8; 8] = *b"ENGRAMKV";
/// Version of the blob layout; part of every [`BlobKey`], so a new version never reads old
/// blobs by mistake: their keys differ and they age out of the tiers.
pub const FORMAT_VERSION: u32 = 1;
/// Bytes before the token ids.
pub const HEADER_LEN: usize = 64;
/// The trailing xxh3-64.
pub const CHECKSUM_LEN: usize = 8;
/// Largest value of an int8 code; the scale maps `max|x|` to it (symmetric, so -127..=127 and
/// -128 is never written).
const INT8_MAX: f32 = 127.0;

/// Content address of a blob: xxh3-128 over (format version, model fingerprint, dtype, token
/// ids), all little-endian.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlobKey(pub [u8; 16]);

impl BlobKey {
    /// The key of the blob `encode(kv, model, dtype)` makes for a chunk with these `tokens`.
    pub fn new(model: &ModelFingerprint, dtype: KvDtype, tokens: &[u32]) -> BlobKey {
        let mut h = Xxh3::new();
        h.update(&FORMAT_VERSION.to_le_bytes());
        h.update(&model.0);
        h.update(&[dtype.code()]);
        for block in tokens.chunks(1024) {
            let bytes: Vec<u8> = block.iter().flat_map(|t| t.to_le_bytes()).collect();
            h.update(&bytes);
        }
        BlobKey(h.digest128().to_le_bytes())
    }

    /// 32 lowercase hex digits (the NVMe tier's file name).
    pub fn to_hex(&self) -> String {
        hex(&self.0)
    }

    /// Parses 32 hex digits (either case); `None` for anything else.
    pub fn from_hex(s: &str) -> Option<BlobKey> {
        let s = s.as_bytes();
        if s.len() != 32 {
            return None;
        }
        let mut out = [0u8; 16];
        for (o, pair) in out.iter_mut().zip(s.chunks_exact(2)) {
            let hi = (pair[0] as char).to_digit(16)?;
            let lo = (pair[1] as char).to_digit(16)?;
            *o = (hi * 16 + lo) as u8;
        }
        Some(BlobKey(out))
    }
}

impl fmt::Display for BlobKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

/// xxh3-128 of the token ids, little-endian: the header's token fingerprint.
pub fn token_fingerprint(tokens: &[u32]) -> [u8; 16] {
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    xxh3_128(&bytes).to_le_bytes()
}

/// A blob's header, as [`inspect`] reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlobInfo {
    pub version: u32,
    pub dtype: KvDtype,
    pub model: ModelFingerprint,
    pub layout: KvLayout,
    pub tokens_fp: [u8; 16],
}

/// Bytes of a blob with this layout and dtype; `None` if that overflows `u64`.
pub fn encoded_len(layout: &KvLayout, dtype: KvDtype) -> Option<u64> {
    let rows = (layout.n_layer as u64)
        .checked_mul(layout.n_head_kv as u64)?
        .checked_mul(layout.n_tokens as u64)?;
    let values = rows.checked_mul(layout.head_dim as u64)?;
    let payload = match dtype {
        KvDtype::F16 => values.checked_mul(4)?,
        KvDtype::Int8 => rows.checked_mul(4)?.checked_add(values)?.checked_mul(2)?,
        KvDtype::Int4 => {
            let int4 = Int4Layout::new(layout);
            (int4.k_groups() as u64)
                .checked_add(int4.v_groups() as u64)?
                .checked_mul(4)?
                .checked_add(rows.checked_mul(int4.row_bytes() as u64)?.checked_mul(2)?)?
        }
    };
    (HEADER_LEN as u64 + CHECKSUM_LEN as u64)
        .checked_add((layout.n_tokens as u64).checked_mul(4)?)?
        .checked_add(payload)
}

/// Serializes one chunk's KV.
///
/// # Panics
/// If the chunk's buffers disagree with its layout or the layout is above the format limits
/// (see [`try_encode`] for the checked version).
pub fn encode(kv: &ChunkKv, model: &ModelFingerprint, dtype: KvDtype) -> Vec<u8> {
    try_encode(kv, model, dtype).unwrap_or_else(|e| panic!("cannot encode chunk KV: {e}"))
}

/// [`encode`], returning `BadChunk` or `TooLarge` instead of panicking.
pub fn try_encode(kv: &ChunkKv, model: &ModelFingerprint, dtype: KvDtype) -> Result<Vec<u8>> {
    kv.check()?;
    let l = &kv.layout;
    let len = encoded_len(l, dtype).expect("limits keep the length far below u64::MAX");
    let mut b = Vec::with_capacity(usize::try_from(len).map_err(|_| KvStoreError::TooLarge {
        what: "blob length",
        value: len,
        limit: usize::MAX as u64,
    })?);
    b.extend_from_slice(&MAGIC);
    b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    b.push(dtype.code());
    b.extend_from_slice(&[0; 3]);
    b.extend_from_slice(&model.0);
    b.extend_from_slice(&token_fingerprint(&kv.tokens));
    for dim in [l.n_layer, l.n_head_kv, l.head_dim, l.n_tokens] {
        b.extend_from_slice(&(dim as u32).to_le_bytes());
    }
    b.extend(kv.tokens.iter().flat_map(|t| t.to_le_bytes()));
    for (index, side) in [&kv.k, &kv.v].into_iter().enumerate() {
        match dtype {
            KvDtype::F16 => b.extend(side.iter().flat_map(|x| x.to_le_bytes())),
            KvDtype::Int8 => quantize_side(&mut b, side, l.head_dim),
            KvDtype::Int4 => Int4Layout::new(l).quantize(&mut b, side, index == 0),
        }
    }
    let sum = xxh3_64(&b);
    b.extend_from_slice(&sum.to_le_bytes());
    debug_assert_eq!(b.len() as u64, len);
    Ok(b)
}

/// Appends one side's scales, then its codes.
fn quantize_side(b: &mut Vec<u8>, side: &[f16], head_dim: usize) {
    let scales: Vec<f32> = side
        .chunks_exact(head_dim)
        .map(|row| {
            let amax = row
                .iter()
                .map(|x| x.to_f32().abs())
                .filter(|a| a.is_finite())
                .fold(0.0f32, f32::max);
            amax / INT8_MAX
        })
        .collect();
    b.extend(scales.iter().flat_map(|s| s.to_le_bytes()));
    for (row, &scale) in side.chunks_exact(head_dim).zip(&scales) {
        if scale == 0.0 {
            b.extend(std::iter::repeat_n(0u8, head_dim));
            continue;
        }
        // `as i8` saturates and maps NaN to 0; the clamp keeps -128 unused.
        b.extend(
            row.iter()
                .map(|x| (x.to_f32() / scale).round().clamp(-INT8_MAX, INT8_MAX) as i8 as u8),
        );
    }
}

/// A blob whose framing, header and sizes have been verified.
struct Parsed<'a> {
    info: BlobInfo,
    tokens: &'a [u8],
    payload: &'a [u8],
}

/// Verifies length, magic, checksum, version, header fields and the length the header implies,
/// in that order.
fn parse(bytes: &[u8]) -> Result<Parsed<'_>> {
    if bytes.len() < HEADER_LEN + CHECKSUM_LEN {
        return Err(KvStoreError::corrupted(format!(
            "blob is {} bytes, shorter than the {} of header and checksum",
            bytes.len(),
            HEADER_LEN + CHECKSUM_LEN
        )));
    }
    if bytes[..8] != MAGIC {
        return Err(KvStoreError::corrupted("bad magic (not an ENGRAMKV blob)"));
    }
    let (body, sum) = bytes.split_at(bytes.len() - CHECKSUM_LEN);
    if xxh3_64(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
        return Err(KvStoreError::corrupted("checksum mismatch"));
    }
    let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().expect("4 bytes"));
    let version = u32_at(8);
    if version != FORMAT_VERSION {
        return Err(KvStoreError::UnsupportedVersion {
            found: version,
            supported: FORMAT_VERSION,
        });
    }
    let dtype = KvDtype::from_code(body[12])
        .ok_or_else(|| KvStoreError::corrupted(format!("unknown dtype code {}", body[12])))?;
    if body[13..16] != [0; 3] {
        return Err(KvStoreError::corrupted(
            "reserved header bytes are not zero",
        ));
    }
    let model = ModelFingerprint(body[16..32].try_into().expect("16 bytes"));
    let tokens_fp: [u8; 16] = body[32..48].try_into().expect("16 bytes");
    let layout = KvLayout {
        n_layer: u32_at(48) as usize,
        n_head_kv: u32_at(52) as usize,
        head_dim: u32_at(56) as usize,
        n_tokens: u32_at(60) as usize,
    };
    layout
        .check_limits()
        .map_err(|e| KvStoreError::corrupted(format!("header layout: {e}")))?;
    let expected = encoded_len(&layout, dtype);
    if expected != Some(bytes.len() as u64) {
        return Err(KvStoreError::corrupted(format!(
            "header says {layout} ({dtype}) = {} bytes, blob is {} bytes",
            expected.map_or("overflowing".to_string(), |n| n.to_string()),
            bytes.len()
        )));
    }
    let (tokens, payload) = body[HEADER_LEN..].split_at(layout.n_tokens * 4);
    Ok(Parsed {
        info: BlobInfo {
            version,
            dtype,
            model,
            layout,
            tokens_fp,
        },
        tokens,
        payload,
    })
}

/// Reads only the header (for listing and inspection) after verifying the checksum and sizes.
pub fn inspect(bytes: &[u8]) -> Result<BlobInfo> {
    parse(bytes).map(|p| p.info)
}

/// Verifies a blob and returns its KV (int8 and int4 dequantized to f16).
///
/// In order: framing and checksum (before trusting any field), version, header limits, the
/// header's implied length against the real one; then the model fingerprint (`ModelMismatch`),
/// the layout's `n_layer`, `n_head_kv` and `head_dim` against `expected` (`LayoutMismatch`),
/// and the stored token ids against `tokens` (`TokenMismatch`). `expected.n_tokens` is not
/// consulted: `tokens.len()` is the chunk's length.
pub fn decode(
    bytes: &[u8],
    model: &ModelFingerprint,
    tokens: &[u32],
    expected: &KvLayout,
) -> Result<ChunkKv> {
    check(bytes, model, tokens, expected).map(Checked::decode)
}

/// [`decode`] for a blob the caller holds shared: the same checks, in the same order, and
/// where an f16 blob's keys and values can be read where they lie (a little-endian machine,
/// 2-byte aligned bytes), they are borrowed from `bytes` rather than copied. Copying was most
/// of a fetch from the DRAM tier (about 23 KB a token on SmolLM2-135M).
pub fn decode_shared(
    bytes: &Arc<[u8]>,
    model: &ModelFingerprint,
    tokens: &[u32],
    expected: &KvLayout,
) -> Result<SharedKv> {
    let checked = check(bytes, model, tokens, expected)?;
    let in_place = cfg!(target_endian = "little")
        && checked.info.dtype == KvDtype::F16
        && <[f16]>::ref_from_bytes(checked.payload).is_ok();
    if !in_place {
        return Ok(checked.decode().into());
    }
    Ok(SharedKv {
        layout: checked.info.layout,
        sides: Sides::InPlace {
            bytes: Arc::clone(bytes),
            k_at: checked.payload.as_ptr() as usize - bytes.as_ptr() as usize,
        },
    })
}

/// One chunk's keys (pre-RoPE) and values as [`decode_shared`] serves them: borrowed from the
/// blob's bytes, or decoded into their own buffers. The same layout as [`ChunkKv`].
#[derive(Debug, Clone)]
pub struct SharedKv {
    layout: KvLayout,
    sides: Sides,
}

#[derive(Debug, Clone)]
enum Sides {
    /// A verified f16 blob whose payload (K, then V) starts at byte `k_at`, 2-byte aligned.
    InPlace {
        bytes: Arc<[u8]>,
        k_at: usize,
    },
    Owned {
        k: Vec<f16>,
        v: Vec<f16>,
    },
}

impl From<ChunkKv> for SharedKv {
    fn from(kv: ChunkKv) -> SharedKv {
        SharedKv {
            layout: kv.layout,
            sides: Sides::Owned { k: kv.k, v: kv.v },
        }
    }
}

impl SharedKv {
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Whether the keys and values are read from the blob's bytes (nothing was copied).
    pub fn is_in_place(&self) -> bool {
        matches!(self.sides, Sides::InPlace { .. })
    }

    /// Keys of one (layer, KV head): `n_tokens * head_dim` values, `[token][dim]`.
    ///
    /// # Panics
    /// If `layer` or `head` is out of range.
    pub fn k_head(&self, layer: usize, head: usize) -> &[f16] {
        self.side(0, layer, head)
    }

    /// Values of one (layer, KV head): `n_tokens * head_dim` values, `[token][dim]`.
    ///
    /// # Panics
    /// If `layer` or `head` is out of range.
    pub fn v_head(&self, layer: usize, head: usize) -> &[f16] {
        self.side(1, layer, head)
    }

    /// Side 0 (K) or 1 (V) of one (layer, KV head).
    fn side(&self, side: usize, layer: usize, head: usize) -> &[f16] {
        let r = self.layout.head_range(layer, head);
        match &self.sides {
            Sides::Owned { k, v } => &[k, v][side][r],
            Sides::InPlace { bytes, k_at } => {
                let at = k_at + 2 * (side * self.layout.values_per_side() + r.start);
                // `decode_shared` checked the payload's length and alignment, and every head
                // starts an even number of bytes into it.
                <[f16]>::ref_from_bytes(&bytes[at..at + 2 * r.len()])
                    .expect("a verified, aligned f16 payload")
            }
        }
    }
}

/// A blob that passed [`decode`]'s checks.
struct Checked<'a> {
    info: BlobInfo,
    /// Its token ids (equal to the caller's).
    stored: Vec<u32>,
    payload: &'a [u8],
}

/// Where an int4 payload's groups and codes are: keys grouped per channel over [`INT4_GROUP`]
/// tokens (KIVI: a key channel's outliers persist across tokens), values per token over
/// [`INT4_GROUP`] dimensions; each group an asymmetric range (f16 scale and minimum, code 0 is
/// the minimum, 15 the maximum). Codes are packed two to a byte, low nibble first, each row
/// starting on a byte.
#[derive(Debug, Clone, Copy)]
struct Int4Layout {
    layout: KvLayout,
}

impl Int4Layout {
    fn new(layout: &KvLayout) -> Int4Layout {
        Int4Layout { layout: *layout }
    }

    fn heads(&self) -> usize {
        self.layout.n_layer * self.layout.n_head_kv
    }

    /// Token groups of one (layer, head) of keys.
    fn token_groups(&self) -> usize {
        self.layout.n_tokens.div_ceil(INT4_GROUP)
    }

    /// Dimension groups of one value row.
    fn dim_groups(&self) -> usize {
        self.layout.head_dim.div_ceil(INT4_GROUP)
    }

    fn k_groups(&self) -> usize {
        self.heads() * self.token_groups() * self.layout.head_dim
    }

    fn v_groups(&self) -> usize {
        self.heads() * self.layout.n_tokens * self.dim_groups()
    }

    fn row_bytes(&self) -> usize {
        self.layout.head_dim.div_ceil(2)
    }

    fn side_bytes(&self, keys: bool) -> usize {
        let groups = if keys {
            self.k_groups()
        } else {
            self.v_groups()
        };
        groups * 4 + self.heads() * self.layout.n_tokens * self.row_bytes()
    }

    /// The (scale, minimum) of each group of one side, in the payload's order.
    fn ranges(&self, side: &[f16], keys: bool) -> Vec<(f16, f16)> {
        let (n, d) = (self.layout.n_tokens, self.layout.head_dim);
        let mut out = Vec::with_capacity(if keys {
            self.k_groups()
        } else {
            self.v_groups()
        });
        if n * d == 0 {
            return out;
        }
        for head in side.chunks_exact(n * d) {
            if keys {
                for g in 0..self.token_groups() {
                    let rows = g * INT4_GROUP..((g + 1) * INT4_GROUP).min(n);
                    for dim in 0..d {
                        out.push(range_of(rows.clone().map(|t| head[t * d + dim])));
                    }
                }
            } else {
                for row in head.chunks_exact(d) {
                    for g in row.chunks(INT4_GROUP) {
                        out.push(range_of(g.iter().copied()));
                    }
                }
            }
        }
        out
    }

    /// The group of value `(token, dim)` of (layer, head) `h`.
    fn group_of(&self, keys: bool, h: usize, token: usize, dim: usize) -> usize {
        if keys {
            (h * self.token_groups() + token / INT4_GROUP) * self.layout.head_dim + dim
        } else {
            (h * self.layout.n_tokens + token) * self.dim_groups() + dim / INT4_GROUP
        }
    }

    /// Appends one side: its groups' ranges, then its codes.
    fn quantize(&self, b: &mut Vec<u8>, side: &[f16], keys: bool) {
        let ranges = self.ranges(side, keys);
        for (scale, min) in &ranges {
            b.extend_from_slice(&scale.to_le_bytes());
            b.extend_from_slice(&min.to_le_bytes());
        }
        let (n, d) = (self.layout.n_tokens, self.layout.head_dim);
        if n * d == 0 {
            return;
        }
        for (h, head) in side.chunks_exact(n * d).enumerate() {
            for (t, row) in head.chunks_exact(d).enumerate() {
                let code = |dim: usize| -> u8 {
                    let (scale, min) = ranges[self.group_of(keys, h, t, dim)];
                    let (scale, min) = (scale.to_f32(), min.to_f32());
                    if scale == 0.0 {
                        return 0;
                    }
                    // NaN becomes 0 through `as u8`; infinities clamp to the range's ends.
                    ((row[dim].to_f32() - min) / scale).round().clamp(0.0, 15.0) as u8
                };
                for pair in (0..d).step_by(2) {
                    let high = if pair + 1 < d { code(pair + 1) } else { 0 };
                    b.push(code(pair) | (high << 4));
                }
            }
        }
    }

    /// One side back to f16, from its bytes (`side_bytes` of them).
    fn dequantize(&self, bytes: &[u8], keys: bool) -> Vec<f16> {
        let groups = if keys {
            self.k_groups()
        } else {
            self.v_groups()
        };
        let (params, codes) = bytes.split_at(groups * 4);
        let ranges: Vec<(f32, f32)> = params
            .chunks_exact(4)
            .map(|p| {
                (
                    f16::from_le_bytes([p[0], p[1]]).to_f32(),
                    f16::from_le_bytes([p[2], p[3]]).to_f32(),
                )
            })
            .collect();
        let (n, d) = (self.layout.n_tokens, self.layout.head_dim);
        let mut out = Vec::with_capacity(self.heads() * n * d);
        for (row_index, row) in codes.chunks_exact(self.row_bytes()).enumerate() {
            let (h, t) = (row_index / n, row_index % n);
            for dim in 0..d {
                let q = (row[dim / 2] >> (4 * (dim % 2))) & 0x0f;
                let (scale, min) = ranges[self.group_of(keys, h, t, dim)];
                out.push(f16::from_f32(min + f32::from(q) * scale));
            }
        }
        out
    }
}

/// The asymmetric 4-bit range of some values: (scale, minimum), both as stored (f16), over the
/// finite values; (0, 0) when none is finite. Codes are clamped to 0..=15, so the f16 rounding
/// of the scale and minimum costs at most a fraction of a step at the range's ends.
fn range_of(values: impl Iterator<Item = f16>) -> (f16, f16) {
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    for x in values.map(f16::to_f32).filter(|x| x.is_finite()) {
        lo = lo.min(x);
        hi = hi.max(x);
    }
    if lo > hi {
        return (f16::ZERO, f16::ZERO);
    }
    let min = f16::from_f32(lo);
    let scale = f16::from_f32((hi - min.to_f32()) / 15.0);
    (scale, min)
}

impl Checked<'_> {
    /// The keys and values in buffers of their own (int8 and int4 dequantized to f16).
    fn decode(self) -> ChunkKv {
        let Checked {
            info,
            stored,
            payload,
        } = self;
        let l = info.layout;
        let n = l.values_per_side();
        let (k, v) = match info.dtype {
            KvDtype::F16 => {
                let (kb, vb) = payload.split_at(n * 2);
                (f16_side(kb), f16_side(vb))
            }
            KvDtype::Int8 => {
                let (kb, vb) = payload.split_at(l.rows_per_side() * 4 + n);
                (
                    dequantize_side(kb, l.head_dim),
                    dequantize_side(vb, l.head_dim),
                )
            }
            KvDtype::Int4 => {
                let int4 = Int4Layout::new(&l);
                let (kb, vb) = payload.split_at(int4.side_bytes(true));
                (int4.dequantize(kb, true), int4.dequantize(vb, false))
            }
        };
        ChunkKv {
            layout: l,
            tokens: stored,
            k,
            v,
        }
    }
}

/// [`decode`]'s checks, in its order.
fn check<'a>(
    bytes: &'a [u8],
    model: &ModelFingerprint,
    tokens: &[u32],
    expected: &KvLayout,
) -> Result<Checked<'a>> {
    let Parsed {
        info,
        tokens: token_bytes,
        payload,
    } = parse(bytes)?;
    if info.model != *model {
        return Err(KvStoreError::ModelMismatch {
            found: info.model,
            expected: *model,
        });
    }
    let l = info.layout;
    if (l.n_layer, l.n_head_kv, l.head_dim)
        != (expected.n_layer, expected.n_head_kv, expected.head_dim)
    {
        return Err(KvStoreError::LayoutMismatch {
            found: l,
            expected: KvLayout {
                n_tokens: tokens.len(),
                ..*expected
            },
        });
    }
    let stored: Vec<u32> = token_bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    if token_fingerprint(&stored) != info.tokens_fp {
        return Err(KvStoreError::corrupted(
            "token fingerprint disagrees with the stored token ids",
        ));
    }
    if stored != tokens {
        return Err(KvStoreError::TokenMismatch {
            stored_tokens: stored.len(),
            expected_tokens: tokens.len(),
        });
    }
    Ok(Checked {
        info,
        stored,
        payload,
    })
}

fn f16_side(bytes: &[u8]) -> Vec<f16> {
    bytes
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// One side of an int8 payload: all scales, then all codes.
fn dequantize_side(bytes: &[u8], head_dim: usize) -> Vec<f16> {
    let rows = bytes.len() / (4 + head_dim);
    let (scales, codes) = bytes.split_at(rows * 4);
    let mut out = Vec::with_capacity(codes.len());
    for (scale, row) in scales.chunks_exact(4).zip(codes.chunks_exact(head_dim)) {
        let scale = f32::from_le_bytes(scale.try_into().expect("4 bytes"));
        out.extend(
            row.iter()
                .map(|&q| f16::from_f32(f32::from(q as i8) * scale)),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    const MODEL: ModelFingerprint = ModelFingerprint([7; 16]);

    fn chunk(layout: KvLayout, seed: u32) -> ChunkKv {
        let n = layout.values_per_side();
        let val = |i: usize, s: f32| {
            let x = ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 16) as f32;
            f16::from_f32((x / 65536.0 - 0.5) * s)
        };
        ChunkKv {
            layout,
            tokens: (0..layout.n_tokens as u32).map(|t| t * 31 + seed).collect(),
            k: (0..n).map(|i| val(i, 8.0)).collect(),
            v: (0..n).map(|i| val(i + n, 0.25)).collect(),
        }
    }

    fn small() -> KvLayout {
        KvLayout {
            n_layer: 2,
            n_head_kv: 2,
            head_dim: 4,
            n_tokens: 3,
        }
    }

    fn bits(v: &[f16]) -> Vec<u16> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Rewrites the trailing checksum so a tampered header gets past the checksum check.
    fn reseal(b: &mut [u8]) {
        let n = b.len() - CHECKSUM_LEN;
        let sum = xxh3_64(&b[..n]);
        b[n..].copy_from_slice(&sum.to_le_bytes());
    }

    #[test]
    fn f16_round_trip_is_exact() {
        let kv = chunk(small(), 1);
        let b = encode(&kv, &MODEL, KvDtype::F16);
        assert_eq!(
            b.len() as u64,
            encoded_len(&kv.layout, KvDtype::F16).unwrap()
        );
        let back = decode(&b, &MODEL, &kv.tokens, &kv.layout).unwrap();
        assert_eq!(bits(&back.k), bits(&kv.k));
        assert_eq!(bits(&back.v), bits(&kv.v));
        assert_eq!(back.tokens, kv.tokens);
        assert_eq!(back.layout, kv.layout);
    }

    #[test]
    fn a_shared_blob_is_read_in_place_with_decodes_checks() {
        let l = KvLayout {
            n_layer: 3,
            n_head_kv: 2,
            head_dim: 8,
            n_tokens: 5,
        };
        let kv = chunk(l, 7);
        // f16: borrowed from the bytes, head for head the values `decode` copies.
        let b: Arc<[u8]> = encode(&kv, &MODEL, KvDtype::F16).into();
        let shared = decode_shared(&b, &MODEL, &kv.tokens, &l).unwrap();
        assert!(shared.is_in_place());
        assert_eq!(*shared.layout(), l);
        for layer in 0..l.n_layer {
            for head in 0..l.n_head_kv {
                assert_eq!(
                    bits(shared.k_head(layer, head)),
                    bits(kv.k_head(layer, head))
                );
                assert_eq!(
                    bits(shared.v_head(layer, head)),
                    bits(kv.v_head(layer, head))
                );
            }
        }
        // int8 is dequantized into buffers, as `decode` does.
        let b8: Arc<[u8]> = encode(&kv, &MODEL, KvDtype::Int8).into();
        let shared = decode_shared(&b8, &MODEL, &kv.tokens, &l).unwrap();
        let copied = decode(&b8, &MODEL, &kv.tokens, &l).unwrap();
        assert!(!shared.is_in_place());
        assert_eq!(bits(shared.v_head(2, 1)), bits(copied.v_head(2, 1)));
        // The same refusals as `decode`: a flipped payload byte, another model, other tokens.
        let mut bad = b.to_vec();
        bad[HEADER_LEN + 4 * l.n_tokens + 3] ^= 0x10;
        let e = decode_shared(&bad.into(), &MODEL, &kv.tokens, &l).unwrap_err();
        assert!(e.is_corrupt(), "{e}");
        let e = decode_shared(&b, &ModelFingerprint([8; 16]), &kv.tokens, &l).unwrap_err();
        assert!(matches!(e, KvStoreError::ModelMismatch { .. }), "{e}");
        let e = decode_shared(&b, &MODEL, &kv.tokens[1..], &l).unwrap_err();
        assert!(matches!(e, KvStoreError::TokenMismatch { .. }), "{e}");
    }

    fn assert_int8_close(orig: &[f16], back: &[f16], head_dim: usize) {
        for (row, brow) in orig.chunks(head_dim).zip(back.chunks(head_dim)) {
            let amax = row.iter().map(|x| x.to_f32().abs()).fold(0.0, f32::max);
            let step = amax / 127.0;
            for (x, y) in row.iter().zip(brow) {
                let (x, y) = (x.to_f32(), y.to_f32());
                let tol = step * 0.5 * (1.0 + 1e-5) + y.abs() * (1.0 / 2048.0) + 1e-7;
                assert!((x - y).abs() <= tol, "{x} vs {y} (step {step})");
            }
        }
    }

    /// Every int4 value within half a step (its group's range / 15, f16-rounded) of the
    /// original: keys grouped per channel over 32 tokens, values per token over 32 dimensions.
    fn assert_int4_close(l: &KvLayout, orig: &[f16], back: &[f16], keys: bool) {
        let (n, d) = (l.n_tokens, l.head_dim);
        let group = |h: usize, t: usize, dim: usize| -> Vec<f32> {
            let at = |t: usize, dim: usize| orig[h * n * d + t * d + dim].to_f32();
            if keys {
                let g = t / INT4_GROUP;
                (g * INT4_GROUP..((g + 1) * INT4_GROUP).min(n))
                    .map(|t| at(t, dim))
                    .collect()
            } else {
                let g = dim / INT4_GROUP;
                (g * INT4_GROUP..((g + 1) * INT4_GROUP).min(d))
                    .map(|dim| at(t, dim))
                    .collect()
            }
        };
        for h in 0..l.n_layer * l.n_head_kv {
            for t in 0..n {
                for dim in 0..d {
                    let vals = group(h, t, dim);
                    let lo = vals.iter().copied().fold(f32::INFINITY, f32::min);
                    let hi = vals.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let step = (hi - lo) / 15.0;
                    let i = h * n * d + t * d + dim;
                    let (x, y) = (orig[i].to_f32(), back[i].to_f32());
                    // Half a step, plus the f16 rounding of the scale, minimum and result.
                    let tol = step * 0.5 + (hi.abs().max(lo.abs())) * 4e-3 + 1e-6;
                    assert!(
                        (x - y).abs() <= tol,
                        "keys {keys} h {h} t {t} d {dim}: {x} vs {y} (step {step})"
                    );
                }
            }
        }
    }

    #[test]
    fn int4_round_trip_within_half_a_step() {
        // 70 tokens: two full key groups and a partial one; head_dim 40: a partial value group.
        let l = KvLayout {
            n_layer: 2,
            n_head_kv: 2,
            head_dim: 40,
            n_tokens: 70,
        };
        let mut kv = chunk(l, 9);
        // A key channel with an outlier the per-channel grouping keeps to itself, and an
        // all-zero value row (a zero range).
        for t in 0..70 {
            kv.k[t * 40 + 3] = f16::from_f32(60.0 + t as f32 * 0.01);
        }
        kv.v[..40].fill(f16::ZERO);
        let b = encode(&kv, &MODEL, KvDtype::Int4);
        assert_eq!(b.len() as u64, encoded_len(&l, KvDtype::Int4).unwrap());
        assert_eq!(inspect(&b).unwrap().dtype, KvDtype::Int4);
        let back = decode(&b, &MODEL, &kv.tokens, &l).unwrap();
        assert_int4_close(&l, &kv.k, &back.k, true);
        assert_int4_close(&l, &kv.v, &back.v, false);
        assert!(back.v[..40].iter().all(|x| x.to_f32() == 0.0));
        // The outlier channel does not widen its neighbours' steps: channel 4 of head 0 stays
        // within its own range's half step (8 / 15 / 2 of the chunk's key scale), far below
        // what sharing channel 3's 60 would cost.
        let worst = (0..70)
            .map(|t| (kv.k[t * 40 + 4].to_f32() - back.k[t * 40 + 4].to_f32()).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 0.3, "{worst}");
        // Shared decoding gives the same values (int4 is never read in place).
        let shared = decode_shared(&Arc::from(b.clone()), &MODEL, &kv.tokens, &l).unwrap();
        assert!(!shared.is_in_place());
        assert_eq!(bits(shared.k_head(1, 1)), bits(&back.k[3 * 70 * 40..]));
    }

    #[test]
    fn int4_survives_non_finite_values() {
        let l = small();
        let mut kv = chunk(l, 2);
        kv.k[1] = f16::INFINITY;
        kv.k[2] = f16::NAN;
        kv.v[0] = f16::NEG_INFINITY;
        let b = encode(&kv, &MODEL, KvDtype::Int4);
        let back = decode(&b, &MODEL, &kv.tokens, &l).unwrap();
        assert!(back.k.iter().chain(&back.v).all(|x| x.is_finite()));
    }

    #[test]
    fn int8_round_trip_within_half_a_step() {
        let l = KvLayout {
            n_layer: 3,
            n_head_kv: 2,
            head_dim: 16,
            n_tokens: 9,
        };
        let mut kv = chunk(l, 5);
        // An all-zero row must come back as zeros (scale 0).
        kv.k[..16].fill(f16::ZERO);
        let b = encode(&kv, &MODEL, KvDtype::Int8);
        assert_eq!(b.len() as u64, encoded_len(&l, KvDtype::Int8).unwrap());
        let back = decode(&b, &MODEL, &kv.tokens, &l).unwrap();
        assert_int8_close(&kv.k, &back.k, 16);
        assert_int8_close(&kv.v, &back.v, 16);
        assert!(back.k[..16].iter().all(|x| x.to_f32() == 0.0));
        assert_eq!(inspect(&b).unwrap().dtype, KvDtype::Int8);
    }

    #[test]
    fn int8_survives_non_finite_values() {
        let l = KvLayout {
            n_layer: 1,
            n_head_kv: 1,
            head_dim: 4,
            n_tokens: 1,
        };
        let mut kv = chunk(l, 1);
        kv.k = vec![
            f16::NAN,
            f16::INFINITY,
            f16::NEG_INFINITY,
            f16::from_f32(1.0),
        ];
        let b = encode(&kv, &MODEL, KvDtype::Int8);
        let back = decode(&b, &MODEL, &kv.tokens, &l).unwrap();
        let got: Vec<f32> = back.k.iter().map(|x| x.to_f32()).collect();
        assert_eq!(got, vec![0.0, 1.0, -1.0, 1.0]);
    }

    #[test]
    fn every_flipped_byte_is_rejected() {
        for dtype in [KvDtype::F16, KvDtype::Int8] {
            let kv = chunk(small(), 2);
            let b = encode(&kv, &MODEL, dtype);
            for i in 0..b.len() {
                for mask in [0x01, 0x80] {
                    let mut c = b.clone();
                    c[i] ^= mask;
                    let e = decode(&c, &MODEL, &kv.tokens, &kv.layout).unwrap_err();
                    assert!(e.is_corrupt(), "{dtype} byte {i}: {e}");
                    assert!(inspect(&c).is_err(), "{dtype} byte {i}");
                }
            }
        }
    }

    #[test]
    fn every_truncation_is_rejected() {
        let kv = chunk(small(), 3);
        let b = encode(&kv, &MODEL, KvDtype::F16);
        for n in 0..b.len() {
            let e = decode(&b[..n], &MODEL, &kv.tokens, &kv.layout).unwrap_err();
            assert!(matches!(e, KvStoreError::Corrupted { .. }), "len {n}: {e}");
        }
        let mut longer = b.clone();
        longer.push(0);
        assert!(decode(&longer, &MODEL, &kv.tokens, &kv.layout)
            .unwrap_err()
            .is_corrupt());
    }

    #[test]
    fn mismatches_are_named() {
        let kv = chunk(small(), 4);
        let b = encode(&kv, &MODEL, KvDtype::F16);
        let other = ModelFingerprint([8; 16]);
        let e = decode(&b, &other, &kv.tokens, &kv.layout).unwrap_err();
        assert!(matches!(e, KvStoreError::ModelMismatch { .. }), "{e}");
        assert!(!e.is_corrupt());

        let mut wrong = kv.tokens.clone();
        wrong[1] += 1;
        let e = decode(&b, &MODEL, &wrong, &kv.layout).unwrap_err();
        assert!(
            matches!(
                e,
                KvStoreError::TokenMismatch {
                    stored_tokens: 3,
                    expected_tokens: 3
                }
            ),
            "{e}"
        );
        let e = decode(&b, &MODEL, &kv.tokens[..2], &kv.layout).unwrap_err();
        assert!(
            matches!(
                e,
                KvStoreError::TokenMismatch {
                    stored_tokens: 3,
                    expected_tokens: 2
                }
            ),
            "{e}"
        );

        for l in [
            KvLayout {
                n_layer: 3,
                ..small()
            },
            KvLayout {
                n_head_kv: 1,
                ..small()
            },
            KvLayout {
                head_dim: 8,
                ..small()
            },
        ] {
            let e = decode(&b, &MODEL, &kv.tokens, &l).unwrap_err();
            assert!(matches!(e, KvStoreError::LayoutMismatch { .. }), "{e}");
        }
    }

    #[test]
    fn hostile_header_is_rejected_before_allocating() {
        let kv = chunk(small(), 5);
        let b = encode(&kv, &MODEL, KvDtype::F16);
        // Claimed sizes within and beyond the limits, each with a valid checksum.
        for (at, value) in [
            (60, MAX_TOKENS_U32),
            (60, u32::MAX),
            (48, u32::MAX),
            (52, 1024),
            (56, 0),
        ] {
            let mut c = b.clone();
            c[at..at + 4].copy_from_slice(&value.to_le_bytes());
            reseal(&mut c);
            let e = decode(&c, &MODEL, &kv.tokens, &kv.layout).unwrap_err();
            assert!(
                matches!(e, KvStoreError::Corrupted { .. }),
                "{at}={value}: {e}"
            );
            assert!(inspect(&c).is_err());
        }
        let mut c = b.clone();
        c[8] = 2;
        reseal(&mut c);
        assert!(matches!(
            inspect(&c),
            Err(KvStoreError::UnsupportedVersion {
                found: 2,
                supported: 1
            })
        ));
        let mut c = b.clone();
        c[12] = 9;
        reseal(&mut c);
        assert!(inspect(&c).unwrap_err().to_string().contains("dtype"));
        let mut c = b.clone();
        c[14] = 1;
        reseal(&mut c);
        assert!(inspect(&c).unwrap_err().to_string().contains("reserved"));
        // A token fingerprint that disagrees with the ids is corruption, not a token mismatch.
        let mut c = b.clone();
        c[40] ^= 1;
        reseal(&mut c);
        let e = decode(&c, &MODEL, &kv.tokens, &kv.layout).unwrap_err();
        assert!(e.is_corrupt(), "{e}");
    }

    const MAX_TOKENS_U32: u32 = crate::layout::MAX_TOKENS as u32;

    #[test]
    fn smollm2_chunk_sizes_match_the_format_page() {
        let l = KvLayout {
            n_layer: 30,
            n_head_kv: 3,
            head_dim: 64,
            n_tokens: 256,
        };
        assert_eq!(encoded_len(&l, KvDtype::F16), Some(5_899_336));
        assert_eq!(encoded_len(&l, KvDtype::Int8), Some(3_134_536));
        assert_eq!(encoded_len(&l, KvDtype::Int4), Some(1_844_296));
    }

    #[test]
    fn inspect_reads_the_header() {
        let kv = chunk(small(), 6);
        let b = encode(&kv, &MODEL, KvDtype::F16);
        let info = inspect(&b).unwrap();
        assert_eq!(
            info,
            BlobInfo {
                version: FORMAT_VERSION,
                dtype: KvDtype::F16,
                model: MODEL,
                layout: kv.layout,
                tokens_fp: token_fingerprint(&kv.tokens),
            }
        );
    }

    #[test]
    fn try_encode_refuses_inconsistent_chunks() {
        let mut kv = chunk(small(), 7);
        kv.v.pop();
        let e = try_encode(&kv, &MODEL, KvDtype::F16).unwrap_err();
        assert!(
            matches!(
                e,
                KvStoreError::BadChunk {
                    what: "V values",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn blob_keys_are_stable_and_distinct() {
        let t = [1u32, 2, 3];
        let a = BlobKey::new(&MODEL, KvDtype::F16, &t);
        assert_eq!(a, BlobKey::new(&MODEL, KvDtype::F16, &t));
        assert_ne!(a, BlobKey::new(&MODEL, KvDtype::Int8, &t));
        assert_ne!(
            a,
            BlobKey::new(&ModelFingerprint([0; 16]), KvDtype::F16, &t)
        );
        assert_ne!(a, BlobKey::new(&MODEL, KvDtype::F16, &[1, 2]));
        assert_eq!(a.to_hex().len(), 32);
        assert_eq!(a.to_string(), a.to_hex());
        assert_eq!(BlobKey::from_hex(&a.to_hex()), Some(a));
        assert_eq!(BlobKey::from_hex(&a.to_hex().to_uppercase()), Some(a));
        assert_eq!(BlobKey::from_hex("xyz"), None);
        assert_eq!(BlobKey::from_hex(&"g".repeat(32)), None);
        // Pinned: a change here orphans every stored blob; bump FORMAT_VERSION instead.
        let pinned = BlobKey::new(&ModelFingerprint([0; 16]), KvDtype::F16, &[1, 2, 3]);
        assert_eq!(pinned.to_hex(), "3976928b66241aa19a4f130670b7e076");
    }

    fn layouts() -> impl Strategy<Value = KvLayout> {
        (1usize..4, 1usize..4, 1usize..17, 0usize..12).prop_map(|(a, b, c, d)| KvLayout {
            n_layer: a,
            n_head_kv: b,
            head_dim: c,
            n_tokens: d,
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn random_layouts_round_trip(l in layouts(), seed in any::<u32>(), code in 0u8..3) {
            let kv = chunk(l, seed);
            let dtype = KvDtype::from_code(code).unwrap();
            let int8 = dtype == KvDtype::Int8;
            let b = encode(&kv, &MODEL, dtype);
            prop_assert_eq!(b.len() as u64, encoded_len(&l, dtype).unwrap());
            prop_assert_eq!(inspect(&b).unwrap().layout, l);
            let back = decode(&b, &MODEL, &kv.tokens, &l).unwrap();
            prop_assert_eq!(&back.tokens, &kv.tokens);
            if int8 {
                assert_int8_close(&kv.k, &back.k, l.head_dim);
                assert_int8_close(&kv.v, &back.v, l.head_dim);
            } else if dtype == KvDtype::Int4 {
                assert_int4_close(&l, &kv.k, &back.k, true);
                assert_int4_close(&l, &kv.v, &back.v, false);
            } else {
                prop_assert_eq!(bits(&back.k), bits(&kv.k));
                prop_assert_eq!(bits(&back.v), bits(&kv.v));
            }
        }
    }
}
