//! The console's pages, one file each: handlers with their template structs.

pub mod accounts;
pub mod assets;
pub mod audit;
pub mod chat;
pub mod dashboard;
pub mod documents;
pub mod kb;
pub mod keys;
pub mod retrieval;
pub mod settings;
pub mod signin;
