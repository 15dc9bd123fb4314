//! Parsing of the GGUF header: metadata and tensor infos, every read bounds-checked.

use engram_kernels::GgmlType;

use crate::error::{corrupted, GgufError, Result};
use crate::value::{Metadata, Value, ValueType};
use crate::TensorInfo;

/// "GGUF" read as a little-endian u32.
pub const GGUF_MAGIC: u32 = 0x4655_4747;
/// Alignment of the tensor data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Deepest array nesting accepted; real files use one level, and the bound stops a crafted file
/// from exhausting the stack.
const MAX_ARRAY_DEPTH: u32 = 8;
/// Most dimensions a tensor may have (ggml's `GGML_MAX_DIMS`).
const MAX_DIMS: u32 = 4;

/// The parsed header of a GGUF file.
pub(crate) struct Header {
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the tensor data section.
    pub data_offset: u64,
}

/// A bounds-checked little-endian cursor over the file bytes.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }

    fn take(&mut self, n: u64, what: &str) -> Result<&'a [u8]> {
        if n > self.remaining() {
            return Err(corrupted(
                self.pos as u64,
                format!(
                    "{what} needs {n} bytes but only {} remain (truncated file?)",
                    self.remaining()
                ),
            ));
        }
        let n = n as usize;
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N as u64, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u8(&mut self, what: &str) -> Result<u8> {
        Ok(self.array::<1>(what)?[0])
    }
    fn u16(&mut self, what: &str) -> Result<u16> {
        Ok(u16::from_le_bytes(self.array(what)?))
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let at = self.pos as u64;
        let len = self.u64(what)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|e| corrupted(at, format!("{what} is not valid UTF-8: {e}")))
    }

    fn value(&mut self, ty: ValueType, depth: u32, what: &str) -> Result<Value> {
        Ok(match ty {
            ValueType::U8 => Value::U8(self.u8(what)?),
            ValueType::I8 => Value::I8(self.u8(what)? as i8),
            ValueType::U16 => Value::U16(self.u16(what)?),
            ValueType::I16 => Value::I16(self.u16(what)? as i16),
            ValueType::U32 => Value::U32(self.u32(what)?),
            ValueType::I32 => Value::I32(self.u32(what)? as i32),
            ValueType::F32 => Value::F32(f32::from_bits(self.u32(what)?)),
            ValueType::U64 => Value::U64(self.u64(what)?),
            ValueType::I64 => Value::I64(self.u64(what)? as i64),
            ValueType::F64 => Value::F64(f64::from_bits(self.u64(what)?)),
            ValueType::Bool => {
                let at = self.pos as u64;
                match self.u8(what)? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(corrupted(at, format!("{what}: bool byte is {b}"))),
                }
            }
            ValueType::String => Value::String(self.string(what)?),
            ValueType::Array => {
                let at = self.pos as u64;
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(corrupted(at, format!("{what}: arrays nested too deeply")));
                }
                let elem = self.value_type(what)?;
                let count = self.u64(what)?;
                // Bound the count by the bytes left before allocating anything.
                let max = self.remaining() / elem.min_encoded_len();
                if count > max {
                    return Err(corrupted(
                        at,
                        format!("{what}: array claims {count} elements, at most {max} fit"),
                    ));
                }
                let mut items = Vec::with_capacity(count as usize);
                for _ in 0..count {
                    items.push(self.value(elem, depth + 1, what)?);
                }
                Value::Array(elem, items)
            }
        })
    }

    fn value_type(&mut self, what: &str) -> Result<ValueType> {
        let at = self.pos as u64;
        let id = self.u32(what)?;
        ValueType::from_u32(id)
            .ok_or_else(|| corrupted(at, format!("{what}: unknown value type {id}")))
    }
}

/// Parses and validates the header of the GGUF file held in `buf`.
pub(crate) fn parse(buf: &[u8]) -> Result<Header> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.u32("magic")?;
    if magic != GGUF_MAGIC {
        return Err(GgufError::BadMagic {
            found: magic,
            expected: GGUF_MAGIC,
        });
    }
    let version = c.u32("version")?;
    if version != 2 && version != 3 {
        return Err(GgufError::UnsupportedVersion { version });
    }
    let n_tensors = c.u64("tensor count")?;
    let n_kv = c.u64("metadata count")?;
    // Each key-value pair needs at least 12 bytes, each tensor info at least 24.
    if n_kv > c.remaining() / 12 || n_tensors > c.remaining() / 24 {
        return Err(corrupted(
            8,
            format!("header claims {n_tensors} tensors and {n_kv} metadata entries, more than the file holds"),
        ));
    }

    let mut entries = Vec::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&format!("metadata key #{i}"))?;
        let ty = c.value_type(&key)?;
        let value = c.value(ty, 0, &key)?;
        entries.push((key, value));
    }
    let metadata = Metadata::from_entries(entries);

    let alignment = match metadata.get("general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some(v) => match v.as_u64() {
            Some(a) if a > 0 && a.is_power_of_two() => a,
            _ => {
                return Err(corrupted(
                    c.pos as u64,
                    format!("general.alignment must be a power of two, found {v:?}"),
                ))
            }
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let at = c.pos as u64;
        let name = c.string(&format!("tensor #{i} name"))?;
        let n_dims = c.u32(&name)?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(corrupted(
                at,
                format!("tensor `{name}` has {n_dims} dimensions"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&name)?);
        }
        let type_id = c.u32(&name)?;
        let offset = c.u64(&name)?;
        let ty = GgmlType::from_u32(type_id).ok_or_else(|| {
            corrupted(
                at,
                format!("tensor `{name}` has unknown ggml type {type_id}"),
            )
        })?;
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .ok_or_else(|| corrupted(at, format!("tensor `{name}` element count overflows")))?;
        let row = dims[0] as usize;
        if ty.row_bytes(row).is_none() {
            return Err(corrupted(
                at,
                format!(
                    "tensor `{name}` rows of {row} elements are not a multiple of the {} block size {}",
                    ty.name(),
                    ty.block_size()
                ),
            ));
        }
        let size = (n_elements / ty.block_size() as u64)
            .checked_mul(ty.type_size() as u64)
            .ok_or_else(|| corrupted(at, format!("tensor `{name}` byte size overflows")))?;
        if offset % alignment != 0 {
            return Err(corrupted(
                at,
                format!("tensor `{name}` offset {offset} is not a multiple of the alignment {alignment}"),
            ));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            size,
        });
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (buf.len() as u64).saturating_sub(data_offset);
    for t in &tensors {
        let end = t.offset.checked_add(t.size);
        if end.is_none_or(|e| e > data_len) {
            return Err(corrupted(
                data_offset + t.offset,
                format!(
                    "tensor `{}` ({} bytes at data offset {}) runs past the end of the file ({} data bytes)",
                    t.name, t.size, t.offset, data_len
                ),
            ));
        }
    }
    if let Some(dup) = first_duplicate(&tensors) {
        return Err(corrupted(
            data_offset,
            format!("tensor `{dup}` appears twice"),
        ));
    }

    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

fn first_duplicate(tensors: &[TensorInfo]) -> Option<&str> {
    let mut names: Vec<&str> = tensors.iter().map(|t| t.name.as_str()).collect();
    names.sort_unstable();
    names.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}
