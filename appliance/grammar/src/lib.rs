//! Constrained decoding: structured output that always parses and validates.
//!
//! - [`compile`] turns a JSON Schema (subset, see [`schema`](compile)) into a byte-level
//!   [`Grammar`]; [`json_object`] is the grammar of any JSON object.
//! - [`Matcher`] follows a grammar byte by byte, keeping every reading still possible.
//! - [`TokenTrie`] finds, for a matcher's state, every vocabulary token that keeps the output
//!   inside the grammar; [`Constrained`] applies that as a logits mask step by step.
//!
//! Nothing here knows a model or a tokenizer: the caller hands over the tokens' bytes.
#![forbid(unsafe_code)]

mod error;
mod grammar;
mod json;
mod mask;
mod schema;
#[cfg(test)]
mod tests;

pub use error::{GrammarError, Result};
pub use grammar::{ByteSet, Elem, Grammar, Matcher, RuleId};
pub use json::Json;
pub use mask::{Constrained, StateId, States, TokenTrie};
pub use schema::{
    compile, json_object, tool_call, MAX_ITEMS_BOUND, MAX_LENGTH_BOUND, MAX_RULES, MAX_WS,
};
