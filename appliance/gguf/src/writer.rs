//! A small GGUF v3 writer: test models and fixtures in memory, generated models streamed to disk.

use std::io::Write;
use std::path::{Path, PathBuf};

use engram_kernels::GgmlType;

use crate::error::{GgufError, Result};
use crate::reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC};
use crate::value::{Value, ValueType};

/// Builds a GGUF v3 file in memory: metadata, then tensors aligned to 32 bytes.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)>,
}

impl GgufWriter {
    /// An empty file.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a metadata entry.
    pub fn metadata(&mut self, key: impl Into<String>, value: Value) -> &mut Self {
        self.metadata.push((key.into(), value));
        self
    }

    /// Adds a tensor of type `ty` with ggml dimensions `dims` (innermost first) and its raw bytes.
    pub fn tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        self.tensors.push((name.into(), dims.to_vec(), ty, data));
        self
    }

    /// Adds an f32 tensor.
    pub fn tensor_f32(&mut self, name: impl Into<String>, dims: &[u64], data: &[f32]) -> &mut Self {
        let bytes = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        self.tensor(name, dims, GgmlType::F32, bytes)
    }

    /// Serialises the file.
    pub fn to_bytes(&self) -> Vec<u8> {
        let entries: Vec<_> = self
            .tensors
            .iter()
            .map(|(name, dims, ty, data)| (name.as_str(), dims.as_slice(), *ty, data.len() as u64))
            .collect();
        let (mut out, offsets) = self.header(&entries);
        let base = out.len() as u64;
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            out.resize((base + off) as usize, 0);
            out.extend_from_slice(data);
        }
        pad_to(&mut out, DEFAULT_ALIGNMENT);
        out
    }

    /// The header (magic, version, counts, metadata and the table of `tensors`, given as name,
    /// dims, type and byte size), padded to the alignment, and each tensor's offset from the
    /// start of the data section.
    fn header(&self, tensors: &[(&str, &[u64], GgmlType, u64)]) -> (Vec<u8>, Vec<u64>) {
        let mut out = Vec::new();
        out.extend_from_slice(&GGUF_MAGIC.to_le_bytes());
        out.extend_from_slice(&3u32.to_le_bytes());
        out.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
        out.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend_from_slice(&(value.value_type() as u32).to_le_bytes());
            put_value(&mut out, value);
        }
        let align = DEFAULT_ALIGNMENT;
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(tensors.len());
        for &(name, dims, ty, size) in tensors {
            put_string(&mut out, name);
            out.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&ty.id().to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + size).div_ceil(align) * align;
        }
        pad_to(&mut out, align);
        (out, offsets)
    }

    /// Writes the file to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut f = std::fs::File::create(path).map_err(io)?;
        f.write_all(&self.to_bytes()).map_err(io)?;
        f.sync_all().map_err(io)
    }

    /// Starts a file too large to build in memory (a generated 7B model is 4 GB and more): writes
    /// the metadata, the tensor table (this writer's tensors, then `later`) and this writer's
    /// tensor bytes, and returns the stream that takes the bytes of `later`, one tensor after
    /// the other, in the order declared. The layout is exactly what [`to_bytes`](Self::to_bytes)
    /// gives for the same tensors.
    ///
    /// The bytes go to `<path>.partial`, renamed to `path` by [`TensorStream::finish`], so an
    /// interrupted run never leaves a truncated model under the wanted name.
    pub fn stream(&self, path: &Path, later: Vec<TensorDecl>) -> Result<TensorStream> {
        let mut entries: Vec<_> = self
            .tensors
            .iter()
            .map(|(name, dims, ty, data)| (name.as_str(), dims.as_slice(), *ty, data.len() as u64))
            .collect();
        let mut sizes = Vec::with_capacity(later.len());
        for d in &later {
            let size = d.byte_size().ok_or_else(|| GgufError::NotBlockMultiple {
                name: d.name.clone(),
                row: d.dims.first().copied().unwrap_or(0),
                ty: d.ty.name(),
                block_size: d.ty.block_size(),
            })?;
            sizes.push(size);
        }
        entries.extend(
            later
                .iter()
                .zip(&sizes)
                .map(|(d, &size)| (d.name.as_str(), d.dims.as_slice(), d.ty, size)),
        );
        let (header, offsets) = self.header(&entries);
        let declared = entries.len();
        drop(entries);
        let partial = partial_path(path);
        let file = std::fs::File::create(&partial).map_err(|source| GgufError::Io {
            path: partial.clone(),
            source,
        })?;
        let later_offsets = offsets[self.tensors.len()..].to_vec();
        let mut stream = TensorStream {
            path: path.to_path_buf(),
            partial,
            out: std::io::BufWriter::with_capacity(STREAM_BUFFER, file),
            pending: later
                .into_iter()
                .zip(sizes)
                .zip(later_offsets)
                .map(|((d, size), offset)| (d, size, offset))
                .collect::<Vec<_>>()
                .into_iter(),
            declared,
            written: 0,
            pos: 0,
            data_start: header.len() as u64,
            failed: false,
        };
        stream.put(&header)?;
        for ((_, _, _, data), off) in self.tensors.iter().zip(offsets) {
            stream.pad(off)?;
            stream.put(data)?;
            stream.written += 1;
        }
        Ok(stream)
    }
}

/// Bytes buffered between the generator and the file: large enough that a multi-gigabyte
/// model goes out in few system calls, small next to the tensors themselves.
const STREAM_BUFFER: usize = 8 << 20;

/// A tensor whose bytes come later, through [`TensorStream::write_tensor`].
#[derive(Debug, Clone, PartialEq)]
pub struct TensorDecl {
    pub name: String,
    /// ggml order, innermost first (see [`crate::TensorInfo::dims`]).
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl TensorDecl {
    /// A tensor of type `ty` with ggml dimensions `dims`.
    pub fn new(name: impl Into<String>, dims: &[u64], ty: GgmlType) -> Self {
        TensorDecl {
            name: name.into(),
            dims: dims.to_vec(),
            ty,
        }
    }

    /// Bytes the tensor takes, or `None` when its rows (`dims[0]` elements) are not whole
    /// blocks of its type or the size overflows.
    pub fn byte_size(&self) -> Option<u64> {
        let row = *self.dims.first()?;
        let row_bytes = self.ty.row_bytes(usize::try_from(row).ok()?)? as u64;
        self.dims[1..]
            .iter()
            .try_fold(row_bytes, |acc, &d| acc.checked_mul(d))
    }
}

/// The data section of a file begun by [`GgufWriter::stream`], taking declared tensors in order.
/// After an I/O error it refuses further writes; dropping it unfinished leaves only the
/// `.partial` file behind.
pub struct TensorStream {
    path: PathBuf,
    partial: PathBuf,
    out: std::io::BufWriter<std::fs::File>,
    /// Declared tensors still to come, with their byte sizes and data-section offsets.
    pending: std::vec::IntoIter<(TensorDecl, u64, u64)>,
    declared: usize,
    written: usize,
    /// Bytes written so far, header included.
    pos: u64,
    /// Where the data section starts (the padded header's length).
    data_start: u64,
    failed: bool,
}

impl TensorStream {
    /// The next declared tensor's name, if any is left.
    pub fn next_name(&self) -> Option<&str> {
        self.pending
            .as_slice()
            .first()
            .map(|(d, _, _)| d.name.as_str())
    }

    /// Writes the bytes of the next declared tensor, which must be exactly its size.
    pub fn write_tensor(&mut self, data: &[u8]) -> Result<()> {
        let Some((decl, size, offset)) = self.pending.as_slice().first().cloned() else {
            return Err(GgufError::TensorCount {
                declared: self.declared,
                written: self.written + 1,
            });
        };
        if data.len() as u64 != size {
            return Err(GgufError::TensorBytes {
                name: decl.name,
                found: data.len() as u64,
                expected: size,
            });
        }
        self.pending.next();
        self.pad(offset)?;
        self.put(data)?;
        self.written += 1;
        Ok(())
    }

    /// Pads the file to the alignment, flushes and syncs it and moves it to its final name
    /// (syncing the folder too); every declared tensor must have been written. Returns the file
    /// size in bytes.
    pub fn finish(mut self) -> Result<u64> {
        if self.pending.len() > 0 {
            return Err(GgufError::TensorCount {
                declared: self.declared,
                written: self.written,
            });
        }
        let end = self.data_start + self.data_pos().div_ceil(DEFAULT_ALIGNMENT) * DEFAULT_ALIGNMENT;
        self.put(&vec![0; (end - self.pos) as usize])?;
        let partial = self.partial.clone();
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| GgufError::Io { path, source }
        };
        let file = self
            .out
            .into_inner()
            .map_err(|e| io(&partial)(e.into_error()))?;
        file.sync_all().map_err(io(&partial))?;
        drop(file);
        std::fs::rename(&partial, &self.path).map_err(io(&self.path))?;
        let dir = match self.path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io(dir))?;
        Ok(end)
    }

    /// Zero bytes up to data-section offset `offset`.
    fn pad(&mut self, offset: u64) -> Result<()> {
        let at = self.data_pos();
        debug_assert!(offset >= at, "tensors are written in offset order");
        self.put(&vec![0; (offset - at) as usize])
    }

    fn data_pos(&self) -> u64 {
        self.pos - self.data_start
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        if self.failed {
            return Err(GgufError::Io {
                path: self.partial.clone(),
                source: std::io::Error::other("an earlier write to this file failed"),
            });
        }
        if let Err(source) = self.out.write_all(bytes) {
            self.failed = true;
            return Err(GgufError::Io {
                path: self.partial.clone(),
                source,
            });
        }
        self.pos += bytes.len() as u64;
        Ok(())
    }
}

fn partial_path(path: &Path) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".partial");
    PathBuf::from(name)
}

fn pad_to(out: &mut Vec<u8>, align: u64) {
    let len = (out.len() as u64).div_ceil(align) * align;
    out.resize(len as usize, 0);
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_string(out, s),
        Value::Array(ty, items) => {
            out.extend_from_slice(&(*ty as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Convenience: an array of strings.
pub fn str_array<S: AsRef<str>>(items: &[S]) -> Value {
    Value::Array(
        ValueType::String,
        items
            .iter()
            .map(|s| Value::String(s.as_ref().to_owned()))
            .collect(),
    )
}
