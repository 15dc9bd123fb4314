//! Engram's end-to-end tests live in `main.rs`; this library target is intentionally empty.
