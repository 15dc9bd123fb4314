//! The one place this crate touches `unsafe`: mapping a model file read-only into memory.

use std::fs::File;
use std::path::Path;

use crate::error::{GgufError, Result};

/// A read-only memory map of a whole file.
pub(crate) struct MappedFile {
    map: memmap2::Mmap,
}

impl MappedFile {
    pub(crate) fn open(path: &Path) -> Result<MappedFile> {
        let io = |source| GgufError::Io {
            path: path.to_path_buf(),
            source,
        };
        let file = File::open(path).map_err(io)?;
        // SAFETY: the map is read-only and private to this process; model files are installed
        // once and never written in place (the fetch script and the installer replace them by
        // rename), so the bytes under the map do not change while it lives. Truncating a mapped
        // model file from outside is an operator error that the OS reports as SIGBUS, as for
        // every mmap-based model loader (llama.cpp, candle).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Ok(MappedFile { map })
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        &self.map
    }
}
