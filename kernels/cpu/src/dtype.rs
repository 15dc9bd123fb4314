//! GGML tensor types: ids as stored in GGUF, block geometry, names, and which ones we can run.

use std::fmt;

use crate::error::{KernelError, Result};

/// Elements per K-quant super-block (`QK_K` in ggml).
pub const QK_K: usize = 256;

/// A GGML tensor type, with the numeric ids of ggml's `enum ggml_type` (and the GGUF spec).
///
/// Every id listed here has correct [`block_size`](Self::block_size) and
/// [`type_size`](Self::type_size), so a GGUF reader can validate tensor byte sizes even for types
/// this crate cannot compute with; [`is_supported`](Self::is_supported) says which ones it can.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
#[allow(missing_docs)] // the variant names are the ggml names
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2K = 10,
    Q3K = 11,
    Q4K = 12,
    Q5K = 13,
    Q6K = 14,
    Q8K = 15,
    Iq2Xxs = 16,
    Iq2Xs = 17,
    Iq3Xxs = 18,
    Iq1S = 19,
    Iq4Nl = 20,
    Iq3S = 21,
    Iq2S = 22,
    Iq4Xs = 23,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    Iq1M = 29,
    BF16 = 30,
    Tq1_0 = 34,
    Tq2_0 = 35,
    Mxfp4 = 39,
}

impl GgmlType {
    /// The types this crate can dequantise and multiply (those with a vec-dot type), in id
    /// order.
    pub const SUPPORTED: [GgmlType; 11] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::BF16,
    ];

    /// Every type this crate knows, in id order.
    pub const ALL: [GgmlType; 32] = [
        Self::F32,
        Self::F16,
        Self::Q4_0,
        Self::Q4_1,
        Self::Q5_0,
        Self::Q5_1,
        Self::Q8_0,
        Self::Q8_1,
        Self::Q2K,
        Self::Q3K,
        Self::Q4K,
        Self::Q5K,
        Self::Q6K,
        Self::Q8K,
        Self::Iq2Xxs,
        Self::Iq2Xs,
        Self::Iq3Xxs,
        Self::Iq1S,
        Self::Iq4Nl,
        Self::Iq3S,
        Self::Iq2S,
        Self::Iq4Xs,
        Self::I8,
        Self::I16,
        Self::I32,
        Self::I64,
        Self::F64,
        Self::Iq1M,
        Self::BF16,
        Self::Tq1_0,
        Self::Tq2_0,
        Self::Mxfp4,
    ];

    /// The type with ggml id `id`, or `None` for ids this crate does not know.
    pub fn from_u32(id: u32) -> Option<GgmlType> {
        Self::ALL.iter().copied().find(|t| t.id() == id)
    }

    /// Like [`from_u32`](Self::from_u32), as a [`Result`].
    pub fn try_from_u32(id: u32) -> Result<GgmlType> {
        Self::from_u32(id).ok_or(KernelError::UnknownType { id })
    }

    /// The ggml id.
    pub fn id(self) -> u32 {
        self as u32
    }

    /// The name llama.cpp prints (`ggml_type_name`): `"f32"`, `"q4_0"`, `"q4_K"`, ...
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::Q4_0 => "q4_0",
            Self::Q4_1 => "q4_1",
            Self::Q5_0 => "q5_0",
            Self::Q5_1 => "q5_1",
            Self::Q8_0 => "q8_0",
            Self::Q8_1 => "q8_1",
            Self::Q2K => "q2_K",
            Self::Q3K => "q3_K",
            Self::Q4K => "q4_K",
            Self::Q5K => "q5_K",
            Self::Q6K => "q6_K",
            Self::Q8K => "q8_K",
            Self::Iq2Xxs => "iq2_xxs",
            Self::Iq2Xs => "iq2_xs",
            Self::Iq3Xxs => "iq3_xxs",
            Self::Iq1S => "iq1_s",
            Self::Iq4Nl => "iq4_nl",
            Self::Iq3S => "iq3_s",
            Self::Iq2S => "iq2_s",
            Self::Iq4Xs => "iq4_xs",
            Self::I8 => "i8",
            Self::I16 => "i16",
            Self::I32 => "i32",
            Self::I64 => "i64",
            Self::F64 => "f64",
            Self::Iq1M => "iq1_m",
            Self::BF16 => "bf16",
            Self::Tq1_0 => "tq1_0",
            Self::Tq2_0 => "tq2_0",
            Self::Mxfp4 => "mxfp4",
        }
    }

    /// Elements per block (`ggml_blck_size`).
    pub fn block_size(self) -> usize {
        self.geometry().0
    }

    /// Bytes per block (`ggml_type_size`).
    pub fn type_size(self) -> usize {
        self.geometry().1
    }

    /// (elements, bytes) per block, from the `block_*` structs of ggml-common.h.
    fn geometry(self) -> (usize, usize) {
        match self {
            Self::F32 | Self::I32 => (1, 4),
            Self::F16 | Self::BF16 | Self::I16 => (1, 2),
            Self::I8 => (1, 1),
            Self::I64 | Self::F64 => (1, 8),
            Self::Q4_0 => (32, 2 + 16),
            Self::Q4_1 => (32, 2 + 2 + 16),
            Self::Q5_0 => (32, 2 + 4 + 16),
            Self::Q5_1 => (32, 2 + 2 + 4 + 16),
            Self::Q8_0 => (32, 2 + 32),
            // Current ggml packs d and s as two f16 (`ggml_half2 ds`); very old ggml used two f32.
            Self::Q8_1 => (32, 2 + 2 + 32),
            Self::Iq4Nl => (32, 2 + 16),
            Self::Mxfp4 => (32, 1 + 16),
            Self::Q2K => (QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Self::Q3K => (QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Self::Q4K => (QK_K, 2 + 2 + 12 + QK_K / 2),
            Self::Q5K => (QK_K, 2 + 2 + 12 + QK_K / 8 + QK_K / 2),
            Self::Q6K => (QK_K, QK_K / 2 + QK_K / 4 + QK_K / 16 + 2),
            Self::Q8K => (QK_K, 4 + QK_K + QK_K / 16 * 2),
            Self::Iq2Xxs => (QK_K, 2 + QK_K / 4),
            Self::Iq2Xs => (QK_K, 2 + QK_K / 4 + QK_K / 32),
            Self::Iq3Xxs => (QK_K, 2 + QK_K / 4 + QK_K / 8),
            Self::Iq1S => (QK_K, 2 + QK_K / 8 + QK_K / 16),
            Self::Iq3S => (QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            Self::Iq2S => (QK_K, 2 + QK_K / 4 + QK_K / 16),
            Self::Iq4Xs => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            Self::Iq1M => (QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            Self::Tq1_0 => (QK_K, 2 + 4 * 13),
            Self::Tq2_0 => (QK_K, 2 + QK_K / 4),
        }
    }

    /// Bytes taken by `n_elements` elements, or `None` if `n_elements` is not a whole number of
    /// blocks or the size overflows.
    pub fn row_bytes(self, n_elements: usize) -> Option<usize> {
        let (block, bytes) = self.geometry();
        if !n_elements.is_multiple_of(block) {
            return None;
        }
        (n_elements / block).checked_mul(bytes)
    }

    /// [`row_bytes`](Self::row_bytes) as a [`Result`], naming the argument `what` in the error.
    pub(crate) fn checked_row_bytes(self, n: usize, what: &'static str) -> Result<usize> {
        if !n.is_multiple_of(self.block_size()) {
            return Err(KernelError::NotBlockMultiple {
                what,
                ty: self,
                n,
                block_size: self.block_size(),
            });
        }
        self.row_bytes(n).ok_or(KernelError::Overflow { what })
    }

    /// Whether this crate can dequantise this type and multiply matrices stored in it.
    pub fn is_supported(self) -> bool {
        self.vec_dot_type().is_some()
    }

    /// The type activations are converted to before a dot product with weights of this type,
    /// as ggml's CPU backend does (`vec_dot_type` in its type traits); `None` if unsupported.
    pub fn vec_dot_type(self) -> Option<GgmlType> {
        match self {
            Self::F32 => Some(Self::F32),
            Self::F16 => Some(Self::F16),
            Self::BF16 => Some(Self::BF16),
            Self::Q4_0 | Self::Q5_0 | Self::Q8_0 => Some(Self::Q8_0),
            Self::Q4_1 | Self::Q5_1 => Some(Self::Q8_1),
            Self::Q4K | Self::Q5K | Self::Q6K => Some(Self::Q8K),
            _ => None,
        }
    }

    /// [`vec_dot_type`](Self::vec_dot_type) as a [`Result`], naming the operation in the error.
    pub(crate) fn checked_vec_dot_type(self, op: &'static str) -> Result<GgmlType> {
        self.vec_dot_type()
            .ok_or(KernelError::Unsupported { ty: self, op })
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn supported_list_matches_is_supported() {
        let derived: Vec<GgmlType> = GgmlType::ALL
            .into_iter()
            .filter(|t| t.is_supported())
            .collect();
        assert_eq!(derived, GgmlType::SUPPORTED);
    }

    use super::*;

    #[test]
    fn ids_round_trip_and_are_unique() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_u32(t.id()), Some(t));
        }
        let mut ids: Vec<u32> = GgmlType::ALL.iter().map(|t| t.id()).collect();
        ids.dedup();
        assert_eq!(
            ids.len(),
            GgmlType::ALL.len(),
            "ALL must be sorted and unique"
        );
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 1000, u32::MAX] {
            assert_eq!(GgmlType::from_u32(id), None, "id {id}");
        }
    }

    #[test]
    fn sizes_match_ggml_structs() {
        // sizeof(block_*) from ggml-common.h, written out by hand.
        let expect = [
            (GgmlType::F32, 1, 4),
            (GgmlType::F16, 1, 2),
            (GgmlType::BF16, 1, 2),
            (GgmlType::Q4_0, 32, 18),
            (GgmlType::Q4_1, 32, 20),
            (GgmlType::Q5_0, 32, 22),
            (GgmlType::Q5_1, 32, 24),
            (GgmlType::Q8_0, 32, 34),
            (GgmlType::Q8_1, 32, 36),
            (GgmlType::Q2K, 256, 84),
            (GgmlType::Q3K, 256, 110),
            (GgmlType::Q4K, 256, 144),
            (GgmlType::Q5K, 256, 176),
            (GgmlType::Q6K, 256, 210),
            (GgmlType::Q8K, 256, 292),
            (GgmlType::Iq4Xs, 256, 136),
            (GgmlType::Mxfp4, 32, 17),
        ];
        for (t, b, s) in expect {
            assert_eq!((t.block_size(), t.type_size()), (b, s), "{t}");
        }
    }

    #[test]
    fn row_bytes_checks_blocks_and_overflow() {
        assert_eq!(GgmlType::Q4K.row_bytes(512), Some(288));
        assert_eq!(GgmlType::Q4K.row_bytes(300), None);
        assert_eq!(GgmlType::F32.row_bytes(usize::MAX), None);
        assert_eq!(GgmlType::Q8_0.row_bytes(0), Some(0));
    }

    #[test]
    fn supported_set() {
        let supported: Vec<&str> = GgmlType::ALL
            .iter()
            .filter(|t| t.is_supported())
            .map(|t| t.name())
            .collect();
        assert_eq!(
            supported,
            [
                "f32", "f16", "q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_K", "q5_K", "q6_K",
                "bf16"
            ]
        );
    }
}
