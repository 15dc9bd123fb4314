//! Engram's GPU kernels: the forward pass's operations on an NVIDIA GPU.
//!
//! The kernels are CUDA C (`kernels.cu`), compiled at run time by NVRTC for the device's own
//! architecture and cached on disk keyed by the source's hash and the architecture (see
//! [`Device::open`]): no CUDA toolkit is needed to build Engram, one binary serves every GPU
//! generation, and the first start on a new GPU pays the compile once. Weights stay in their GGML
//! block formats in device memory; decode multiplies them with dequantising GEMV kernels (up to
//! [`MAX_GEMV_BATCH`] activation rows per read of the weights), prefill dequantises each matrix
//! into an f16 scratch and calls cuBLAS (tensor cores, f32 accumulation).
//!
//! Every CUDA library is opened dynamically and probed before first use ([`probe`]), so a
//! machine without a driver gets an [`CudaError::Unavailable`] it can log, never a panic.

mod device;
mod nvrtc;
mod ops;

pub use device::{
    compile_ptx, compile_ptx_with, driver_version, probe, runtime, Buffer, Device, DeviceInfo,
    Event, Graph, Lane, Pinned,
};
pub use nvrtc::{cuda_version, Nvrtc};
pub use ops::{
    supports, AttentionArgs, GemvLaunch, KvImport, ManyAttention, MatmulScratch, SeqCacheRef,
    SeqTable, Weight, MAX_GEMV_BATCH, SEQ_TABLE_ENTRY,
};

/// Errors of the GPU path.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// No usable GPU: no driver library, no device, or a library the path needs is missing.
    #[error("no usable CUDA GPU: {0}")]
    Unavailable(String),
    /// A CUDA driver call failed.
    #[error("CUDA driver: {0}")]
    Driver(String),
    /// NVRTC could not compile the kernels (the log follows).
    #[error("compiling the CUDA kernels: {0}")]
    Compile(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS: {0}")]
    Blas(String),
    /// The GPU path has no kernel for this case.
    #[error("not supported on the GPU: {0}")]
    Unsupported(String),
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, CudaError>;

impl From<cudarc::driver::DriverError> for CudaError {
    fn from(e: cudarc::driver::DriverError) -> Self {
        CudaError::Driver(e.to_string())
    }
}

impl From<cudarc::cublas::result::CublasError> for CudaError {
    fn from(e: cudarc::cublas::result::CublasError) -> Self {
        CudaError::Blas(e.to_string())
    }
}
