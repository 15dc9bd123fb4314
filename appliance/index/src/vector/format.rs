//! The vector index's files: the manifest, the data file, and crash-safe writes.
//!
//! A committed vector index is three kinds of file in its directory:
//!
//! ```text
//! manifest.engv            rewritten at every commit (small: header + tombstone bitmap)
//! vectors-<gen>.bin        chunk ids, doc ids and unit vectors; written when rows change
//! graph-<gen>.hnsw.graph   hnsw_rs dump of the graph (links), written with the data file
//! graph-<gen>.hnsw.data    hnsw_rs dump of the graph's copy of the vectors
//! ```
//!
//! All integers are little-endian; every file ends with the xxh3-64 of all its preceding bytes.
//!
//! ```text
//! manifest.engv                          vectors-<gen>.bin
//! +---------------------------+          +------------------------------+
//! | magic "ENGVMAN\0"     [8] |          | magic "ENGVDAT\0"        [8] |
//! | format version   u32      |          | format version   u32         |
//! | dim              u32      |          | dim              u32         |
//! | seq              u64      |          | rows             u64         |
//! | generation       u64      |          | rows x (chunk_id u64,        |
//! | rows             u64      |          |         doc_id   u64)        |
//! | live             u64      |          | rows x dim x f32             |
//! | model_id    len u32 + utf8|          | xxh3 of the above  u64       |
//! | data file   len u32 + utf8|          +------------------------------+
//! | data xxh3        u64      |
//! | graph basename len u32 + utf8 (empty: no graph)
//! | graph file xxh3  u64      |
//! | graph data xxh3  u64      |
//! | tombstones  ceil(rows/8) bytes, bit i = row i deleted (LSB first)
//! | xxh3 of the above  u64    |
//! +---------------------------+
//! ```
//!
//! The manifest names the data and graph files of its generation and records their checksums,
//! so a reader never mixes generations. A commit writes the new generation's files under new
//! names, fsyncs them, then replaces the manifest (temp file, fsync, rename, fsync of the
//! directory) and only then deletes the previous generation: a crash at any point leaves one
//! complete generation that the manifest points to.

use std::fs::{self, File};
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::error::{IndexError, Result};

pub(crate) const MANIFEST: &str = "manifest.engv";
const MANIFEST_MAGIC: [u8; 8] = *b"ENGVMAN\0";
const DATA_MAGIC: [u8; 8] = *b"ENGVDAT\0";
/// Version of both files' layout (and of the graph's distance, `UnitDot`).
pub const FORMAT_VERSION: u32 = 1;

/// The hnsw_rs dump of one generation.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct GraphFiles {
    pub basename: String,
    pub graph_xxh3: u64,
    pub data_xxh3: u64,
}

impl GraphFiles {
    pub fn paths(&self, dir: &Path) -> [PathBuf; 2] {
        graph_paths(dir, &self.basename)
    }
}

pub(crate) fn graph_paths(dir: &Path, basename: &str) -> [PathBuf; 2] {
    [
        dir.join(format!("{basename}.hnsw.graph")),
        dir.join(format!("{basename}.hnsw.data")),
    ]
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Manifest {
    pub dim: u32,
    pub model_id: String,
    pub seq: u64,
    pub generation: u64,
    pub rows: u64,
    pub live: u64,
    pub data_file: String,
    pub data_xxh3: u64,
    pub graph: Option<GraphFiles>,
    pub dead: Vec<bool>,
}

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(128 + self.dead.len() / 8);
        b.extend_from_slice(&MANIFEST_MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        b.extend_from_slice(&self.dim.to_le_bytes());
        for v in [self.seq, self.generation, self.rows, self.live] {
            b.extend_from_slice(&v.to_le_bytes());
        }
        put_str(&mut b, &self.model_id);
        put_str(&mut b, &self.data_file);
        b.extend_from_slice(&self.data_xxh3.to_le_bytes());
        let (name, g, d) = match &self.graph {
            Some(g) => (g.basename.as_str(), g.graph_xxh3, g.data_xxh3),
            None => ("", 0, 0),
        };
        put_str(&mut b, name);
        b.extend_from_slice(&g.to_le_bytes());
        b.extend_from_slice(&d.to_le_bytes());
        let mut bits = vec![0u8; self.dead.len().div_ceil(8)];
        for (i, _) in self.dead.iter().enumerate().filter(|(_, d)| **d) {
            bits[i / 8] |= 1 << (i % 8);
        }
        b.extend_from_slice(&bits);
        let sum = xxh3_64(&b);
        b.extend_from_slice(&sum.to_le_bytes());
        b
    }

    pub fn decode(path: &Path, bytes: &[u8]) -> Result<Manifest> {
        let body = check_framing(path, bytes, &MANIFEST_MAGIC)?;
        let mut r = Reader::new(path, &body[12..]);
        let dim = r.u32()?;
        let seq = r.u64()?;
        let generation = r.u64()?;
        let rows = r.u64()?;
        let live = r.u64()?;
        let model_id = r.string()?;
        let data_file = r.string()?;
        let data_xxh3 = r.u64()?;
        let basename = r.string()?;
        let graph_xxh3 = r.u64()?;
        let graph_data_xxh3 = r.u64()?;
        let nbits = usize::try_from(rows).map_err(|_| r.bad("row count"))?;
        let bits = r.bytes(nbits.div_ceil(8))?;
        if !r.rest().is_empty() {
            return Err(r.bad("trailing bytes"));
        }
        let dead: Vec<bool> = (0..nbits)
            .map(|i| bits[i / 8] >> (i % 8) & 1 == 1)
            .collect();
        if dead.iter().filter(|d| !**d).count() as u64 != live {
            return Err(IndexError::corrupt(
                path,
                "live count disagrees with tombstones",
            ));
        }
        let graph = (!basename.is_empty()).then_some(GraphFiles {
            basename,
            graph_xxh3,
            data_xxh3: graph_data_xxh3,
        });
        Ok(Manifest {
            dim,
            model_id,
            seq,
            generation,
            rows,
            live,
            data_file,
            data_xxh3,
            graph,
            dead,
        })
    }
}

/// The rows of a data file.
pub(crate) struct Data {
    pub ids: Vec<(u64, u64)>,
    pub vectors: Vec<f32>,
}

/// Writes a data file (not atomically: it gets a fresh name and the manifest commits it);
/// returns its checksum.
pub(crate) fn write_data(
    path: &Path,
    dim: usize,
    ids: &[(u64, u64)],
    vectors: &[f32],
) -> Result<u64> {
    let io = |e| IndexError::io(path, e);
    let file = File::create(path).map_err(io)?;
    let mut w = HashingWriter {
        inner: BufWriter::with_capacity(1 << 20, file),
        hasher: Xxh3::new(),
    };
    let mut header = Vec::with_capacity(24);
    header.extend_from_slice(&DATA_MAGIC);
    header.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    header.extend_from_slice(&(dim as u32).to_le_bytes());
    header.extend_from_slice(&(ids.len() as u64).to_le_bytes());
    w.write_all(&header).map_err(io)?;
    let mut buf = Vec::with_capacity(16 * 4096);
    for block in ids.chunks(4096) {
        buf.clear();
        for (chunk_id, doc_id) in block {
            buf.extend_from_slice(&chunk_id.to_le_bytes());
            buf.extend_from_slice(&doc_id.to_le_bytes());
        }
        w.write_all(&buf).map_err(io)?;
    }
    for block in vectors.chunks(16 * 1024) {
        buf.clear();
        buf.extend(block.iter().flat_map(|x| x.to_le_bytes()));
        w.write_all(&buf).map_err(io)?;
    }
    let sum = w.hasher.digest();
    let mut inner = w.inner;
    inner.write_all(&sum.to_le_bytes()).map_err(io)?;
    let file = inner.into_inner().map_err(|e| io(e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(sum)
}

/// Reads and verifies a data file; `expected_xxh3` binds it to the manifest that names it.
pub(crate) fn read_data(path: &Path, dim: usize, rows: u64, expected_xxh3: u64) -> Result<Data> {
    let bytes = fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => IndexError::corrupt(path, "data file is missing"),
        _ => IndexError::io(path, e),
    })?;
    let body = check_framing(path, &bytes, &DATA_MAGIC)?;
    if xxh3_64(body) != expected_xxh3 {
        return Err(IndexError::corrupt(
            path,
            "data file is not the one the manifest names",
        ));
    }
    let mut r = Reader::new(path, &body[12..]);
    let file_dim = r.u32()? as usize;
    let file_rows = r.u64()?;
    if file_dim != dim || file_rows != rows {
        return Err(r.bad("dimension or row count disagrees with the manifest"));
    }
    let rows = usize::try_from(rows).map_err(|_| r.bad("row count"))?;
    let id_bytes = r.bytes(rows.checked_mul(16).ok_or_else(|| r.bad("row count"))?)?;
    let ids = id_bytes
        .chunks_exact(16)
        .map(|c| {
            (
                u64::from_le_bytes(c[..8].try_into().expect("8 bytes")),
                u64::from_le_bytes(c[8..].try_into().expect("8 bytes")),
            )
        })
        .collect();
    let vec_bytes = r.rest();
    if vec_bytes.len() != rows * dim * 4 {
        return Err(r.bad("vector block has the wrong length"));
    }
    let vectors = vec_bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
        .collect();
    Ok(Data { ids, vectors })
}

/// Replaces `dir/name` with `bytes` crash-safely: temp file, fsync, rename, fsync of `dir`.
pub(crate) fn write_atomic(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!("{name}.tmp"));
    let path = dir.join(name);
    let mut f = File::create(&tmp).map_err(|e| IndexError::io(&tmp, e))?;
    f.write_all(bytes).map_err(|e| IndexError::io(&tmp, e))?;
    f.sync_all().map_err(|e| IndexError::io(&tmp, e))?;
    drop(f);
    fs::rename(&tmp, &path).map_err(|e| IndexError::io(&path, e))?;
    sync_dir(dir)
}

pub(crate) fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| IndexError::io(dir, e))
}

/// fsyncs a file written by someone else (hnsw_rs) and returns its xxh3.
pub(crate) fn sync_and_hash(path: &Path) -> Result<u64> {
    let io = |e| IndexError::io(path, e);
    let mut f = File::open(path).map_err(io)?;
    f.sync_all().map_err(io)?;
    hash_reader(&mut f).map_err(io)
}

/// xxh3 of a file, `None` if it cannot be read.
pub(crate) fn hash_file(path: &Path) -> Option<u64> {
    hash_reader(&mut File::open(path).ok()?).ok()
}

fn hash_reader(r: &mut impl Read) -> std::io::Result<u64> {
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match r.read(&mut buf)? {
            0 => return Ok(hasher.digest()),
            n => hasher.update(&buf[..n]),
        }
    }
}

/// Checks magic, version and trailing checksum; returns the bytes before the checksum.
fn check_framing<'a>(path: &Path, bytes: &'a [u8], magic: &[u8; 8]) -> Result<&'a [u8]> {
    if bytes.len() < 12 + 8 || bytes[..8] != magic[..] {
        return Err(IndexError::corrupt(path, "bad magic or truncated file"));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(IndexError::Mismatch {
            path: path.to_path_buf(),
            what: "format version",
            expected: FORMAT_VERSION.to_string(),
            found: version.to_string(),
        });
    }
    let (body, sum) = bytes.split_at(bytes.len() - 8);
    if xxh3_64(body) != u64::from_le_bytes(sum.try_into().expect("8 bytes")) {
        return Err(IndexError::corrupt(path, "checksum mismatch"));
    }
    Ok(body)
}

fn put_str(b: &mut Vec<u8>, s: &str) {
    b.extend_from_slice(&(s.len() as u32).to_le_bytes());
    b.extend_from_slice(s.as_bytes());
}

struct HashingWriter<W> {
    inner: W,
    hasher: Xxh3,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Bounds-checked little-endian reads; running short means a corrupt file.
struct Reader<'a> {
    path: &'a Path,
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(path: &'a Path, buf: &'a [u8]) -> Reader<'a> {
        Reader { path, buf }
    }

    fn bad(&self, what: &str) -> IndexError {
        IndexError::corrupt(self.path, format!("bad {what}"))
    }

    fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.buf.len() < n {
            return Err(IndexError::corrupt(self.path, "truncated"));
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(
            self.bytes(4)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(
            self.bytes(8)?.try_into().expect("8 bytes"),
        ))
    }

    fn string(&mut self) -> Result<String> {
        let len = self.u32()? as usize;
        let bytes = self.bytes(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.bad("string"))
    }

    fn rest(&self) -> &'a [u8] {
        self.buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest() -> Manifest {
        Manifest {
            dim: 4,
            model_id: "m".into(),
            seq: 7,
            generation: 3,
            rows: 10,
            live: 8,
            data_file: "vectors-3.bin".into(),
            data_xxh3: 99,
            graph: Some(GraphFiles {
                basename: "graph-3".into(),
                graph_xxh3: 1,
                data_xxh3: 2,
            }),
            dead: (0..10).map(|i| i == 2 || i == 9).collect(),
        }
    }

    #[test]
    fn manifest_round_trips() {
        let m = manifest();
        let p = Path::new("m");
        assert_eq!(Manifest::decode(p, &m.encode()).unwrap(), m);
    }

    #[test]
    fn manifest_detects_any_flipped_byte() {
        let bytes = manifest().encode();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x10;
            let err = Manifest::decode(Path::new("m"), &b).unwrap_err();
            assert!(err.needs_rebuild(), "byte {i}: {err}");
        }
        let err = Manifest::decode(Path::new("m"), &bytes[..bytes.len() - 1]).unwrap_err();
        assert!(matches!(err, IndexError::Corrupt { .. }));
    }
}
