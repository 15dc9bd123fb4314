//! The crate's error type: every fallible kernel entry point returns [`Result`].

use crate::dtype::GgmlType;

/// Why a kernel refused its input. Kernels never panic on bad lengths; they return one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KernelError {
    /// The GGML type id is not one this crate knows.
    #[error("unknown ggml type id {id}")]
    UnknownType {
        /// The raw id, as stored in a GGUF tensor header.
        id: u32,
    },
    /// The type is known (its sizes are) but this crate has no kernel for the operation.
    #[error("ggml type {ty} is not supported by `{op}`")]
    Unsupported {
        /// The offending type.
        ty: GgmlType,
        /// The operation that was asked for.
        op: &'static str,
    },
    /// An element count is not a whole number of blocks.
    #[error("{what}: {n} elements is not a multiple of the {ty} block size {block_size}")]
    NotBlockMultiple {
        /// Which argument was wrong.
        what: &'static str,
        /// The type whose block size applies.
        ty: GgmlType,
        /// The element count given.
        n: usize,
        /// Elements per block of `ty`.
        block_size: usize,
    },
    /// A buffer has the wrong length.
    #[error("{what}: expected length {expected}, got {actual}")]
    LengthMismatch {
        /// Which buffer was wrong (and in what unit: bytes or elements).
        what: &'static str,
        /// The length the other arguments imply.
        expected: usize,
        /// The length given.
        actual: usize,
    },
    /// A size computation overflowed `usize`.
    #[error("{what}: size overflows usize")]
    Overflow {
        /// Which size overflowed.
        what: &'static str,
    },
    /// A row index is past the end of the matrix.
    #[error("{what}: row {row} is out of range for {rows} rows")]
    RowOutOfRange {
        /// Which table or matrix.
        what: &'static str,
        /// The row asked for.
        row: usize,
        /// How many rows there are.
        rows: usize,
    },
    /// The OS refused to start a worker thread of a [`ThreadPool`](crate::ThreadPool).
    #[error("could not spawn a worker thread for a pool of {threads} threads: {reason}")]
    ThreadSpawn {
        /// Threads the pool was asked for.
        threads: usize,
        /// The OS error, as text.
        reason: String,
    },
}

/// `Result` with [`KernelError`].
pub type Result<T> = std::result::Result<T, KernelError>;

/// `Ok` if `expected` (`None`: its computation overflowed) equals `actual`; else
/// [`KernelError::Overflow`] or [`KernelError::LengthMismatch`] naming `what`.
pub(crate) fn check_len(what: &'static str, expected: Option<usize>, actual: usize) -> Result<()> {
    match expected {
        None => Err(KernelError::Overflow { what }),
        Some(e) if e != actual => Err(KernelError::LengthMismatch {
            what,
            expected: e,
            actual,
        }),
        Some(_) => Ok(()),
    }
}
