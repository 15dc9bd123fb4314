//! A validating, memory-mapped reader for GGUF model files (versions 2 and 3).
//!
//! Engram loads customer models it has never seen, so every count, length and offset in the
//! file is checked against the bytes actually present before it is used: a truncated or lying
//! file gives [`GgufError::Corrupted`], never a panic or an out-of-bounds read. Tensor data stays
//! in the page cache through a read-only memory map; [`GgufFile::tensor_data`] hands out slices.
//!
//! ```no_run
//! let file = engram_gguf::GgufFile::open("models/SmolLM2-135M-Instruct.Q4_1.gguf")?;
//! let arch = file.metadata().get_str("general.architecture")?;
//! let embd = file.tensor("token_embd.weight")?;
//! println!("{arch}: {} tensors, token_embd is {:?} {:?}", file.tensors().len(), embd.ty, embd.dims);
//! # Ok::<(), engram_gguf::GgufError>(())
//! ```
#![deny(unsafe_code)]

mod error;
#[allow(unsafe_code)]
mod mmap;
mod reader;
mod value;
mod writer;

use std::path::{Path, PathBuf};

pub use engram_kernels::GgmlType;
pub use error::{GgufError, Result};
pub use reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC};
pub use value::{Metadata, Value, ValueType};
pub use writer::{str_array, GgufWriter, TensorDecl, TensorStream};

/// Where and how one tensor is stored.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost (contiguous) dimension, i.e. a matrix of `n`
    /// rows of `k` elements has `dims == [k, n]`.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section.
    pub offset: u64,
    /// Size in bytes, derived from the dims and type (validated to lie inside the file).
    pub size: u64,
}

impl TensorInfo {
    /// Total number of elements.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

enum Backing {
    Mapped(mmap::MappedFile),
    Owned(Vec<u8>),
}

/// An open GGUF file: its metadata, tensor table and mapped bytes.
pub struct GgufFile {
    path: Option<PathBuf>,
    backing: Backing,
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_entries", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("file_size", &self.file_size())
            .finish()
    }
}

impl GgufFile {
    /// Maps and validates the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let map = mmap::MappedFile::open(path)?;
        Self::build(Some(path.to_path_buf()), Backing::Mapped(map))
    }

    /// Validates a GGUF file held in memory (tests, embedded models).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::build(None, Backing::Owned(bytes))
    }

    fn build(path: Option<PathBuf>, backing: Backing) -> Result<GgufFile> {
        let bytes = match &backing {
            Backing::Mapped(m) => m.bytes(),
            Backing::Owned(v) => v.as_slice(),
        };
        let h = reader::parse(bytes)?;
        Ok(GgufFile {
            path,
            backing,
            version: h.version,
            metadata: h.metadata,
            tensors: h.tensors,
            alignment: h.alignment,
            data_offset: h.data_offset,
        })
    }

    fn bytes(&self) -> &[u8] {
        match &self.backing {
            Backing::Mapped(m) => m.bytes(),
            Backing::Owned(v) => v,
        }
    }

    /// The file's path, when it was opened from disk.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// GGUF format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Alignment of tensor data in bytes.
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// Total size of the file in bytes.
    pub fn file_size(&self) -> u64 {
        self.bytes().len() as u64
    }

    /// The metadata table.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// All tensor infos in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The info of the tensor called `name`.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors
            .iter()
            .find(|t| t.name == name)
            .ok_or_else(|| GgufError::MissingTensor { name: name.into() })
    }

    /// Whether a tensor called `name` exists.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensors.iter().any(|t| t.name == name)
    }

    /// The raw bytes of a tensor (bounds were validated when the file was opened).
    pub fn tensor_data(&self, info: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + info.offset) as usize;
        &self.bytes()[start..start + info.size as usize]
    }
}

#[cfg(test)]
mod tests;
