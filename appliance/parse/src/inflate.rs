//! Reading compressed data with a cap: the zip-bomb defence shared by DOCX members and PDF streams.
//!
//! Declared sizes are only a first filter; what counts is the bytes actually produced, which are
//! read in bounded steps so a bomb is stopped after at most one step past the limit.

use std::io::{self, Read};

use crate::Limits;

/// Below this many inflated bytes the compression ratio is not checked: small XML parts of a
/// DOCX (styles, settings) legitimately compress 50-100x, and a small output cannot exhaust
/// memory whatever its ratio.
pub(crate) const RATIO_FLOOR_BYTES: u64 = 1 << 20;

/// Bytes read per step.
const STEP: usize = 64 << 10;

/// Why a capped read stopped.
#[derive(Debug)]
pub(crate) enum Breach {
    /// The output exceeded `Limits::max_entry_bytes`; carries the bytes seen so far.
    TooBig(u64),
    /// The output exceeded `Limits::max_compression_ratio` times the compressed size.
    Ratio { inflated: u64, compressed: u64 },
    /// The decompressor failed: the data is corrupt.
    Io(io::Error),
}

impl Breach {
    /// A short description and the [`Limits`] field it concerns.
    pub(crate) fn describe(&self, limits: &Limits) -> (String, &'static str, u64) {
        match self {
            Breach::TooBig(n) => (
                format!("inflates to more than {n} bytes"),
                "max_entry_bytes",
                limits.max_entry_bytes,
            ),
            Breach::Ratio {
                inflated,
                compressed,
            } => (
                format!("inflates {compressed} compressed bytes to more than {inflated} bytes"),
                "max_compression_ratio",
                limits.max_compression_ratio,
            ),
            Breach::Io(e) => (format!("cannot be decompressed ({e})"), "", 0),
        }
    }
}

/// Checks a size declared by a container before reading anything.
pub(crate) fn check_declared(
    declared: u64,
    compressed: u64,
    limits: &Limits,
) -> Result<(), Breach> {
    if declared > limits.max_entry_bytes {
        return Err(Breach::TooBig(declared));
    }
    if declared > RATIO_FLOOR_BYTES
        && declared > compressed.saturating_mul(limits.max_compression_ratio)
    {
        return Err(Breach::Ratio {
            inflated: declared,
            compressed,
        });
    }
    Ok(())
}

/// Reads `reader` to the end, failing as soon as the output breaks a limit.
pub(crate) fn read_capped(
    mut reader: impl Read,
    compressed: u64,
    limits: &Limits,
) -> Result<Vec<u8>, Breach> {
    let max_ratio_bytes = compressed
        .saturating_mul(limits.max_compression_ratio)
        .max(RATIO_FLOOR_BYTES);
    let mut out = Vec::new();
    let mut buf = vec![0u8; STEP];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(out),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Breach::Io(e)),
        };
        out.extend_from_slice(&buf[..n]);
        let len = out.len() as u64;
        if len > limits.max_entry_bytes {
            return Err(Breach::TooBig(len));
        }
        if len > max_ratio_bytes {
            return Err(Breach::Ratio {
                inflated: len,
                compressed,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_at_the_size_limit() {
        let limits = Limits {
            max_entry_bytes: 100_000,
            ..Limits::default()
        };
        let zeros = io::repeat(0).take(10 << 20);
        match read_capped(zeros, 10 << 20, &limits) {
            Err(Breach::TooBig(n)) => assert!(n <= 100_000 + STEP as u64),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn stops_at_the_ratio_limit() {
        let zeros = io::repeat(0).take(100 << 20);
        match read_capped(zeros, 1000, &Limits::default()) {
            Err(Breach::Ratio { inflated, .. }) => {
                assert!(inflated <= RATIO_FLOOR_BYTES + STEP as u64)
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn declared_sizes() {
        let limits = Limits::default();
        assert!(check_declared(1000, 10, &limits).is_ok());
        assert!(matches!(
            check_declared(10 << 20, 1000, &limits),
            Err(Breach::Ratio { .. })
        ));
        assert!(matches!(
            check_declared(1 << 40, 1 << 39, &limits),
            Err(Breach::TooBig(_))
        ));
    }
}
