//! Integration tests for engram-kernels, one binary:
//!
//! - `fixtures`: dequantisation, activation quantisation and dot products against fixtures made
//!   with llama.cpp's `gguf` Python package (see `tests/fixtures/README.md`).
//! - `malformed`: bad lengths and unsupported types give errors, never panics.
//! - `matmul`: property tests of `matmul` (1- and 3-thread pools) against a per-row `vec_dot` loop,
//!   and a large matrix that really runs threaded.

mod fixtures;
mod malformed;
mod matmul;
