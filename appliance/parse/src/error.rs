//! The crate's one error type: what went wrong with a document, and what to do about it.

use crate::Format;

/// Why a document could not be parsed. Every message names the file, says what happened and what
/// to do about it.
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    /// A size limit in [`crate::Limits`] was exceeded.
    #[error("{file}: {what} is {size} bytes, over the limit Limits::{limit_name} = {limit}; split the document or raise the limit")]
    TooLarge {
        file: String,
        /// What was measured ("input", "extracted text", "PDF page count", ...).
        what: &'static str,
        size: u64,
        /// The name of the [`crate::Limits`] field that was broken.
        limit_name: &'static str,
        limit: u64,
    },
    /// Neither the extension nor the content names a format Engram reads.
    #[error("{file}: unsupported format ({detail}); convert it to PDF, DOCX, HTML, Markdown or plain text")]
    UnsupportedFormat { file: String, detail: String },
    /// Text whose encoding is binary, unknown or inconsistent.
    #[error("{file}: cannot decode the text as {detected} ({reason}); convert the file to UTF-8 or check that it is really a text document")]
    Encoding {
        file: String,
        /// The encoding that was declared or guessed, or "binary".
        detected: String,
        reason: String,
    },
    /// A PDF with pages but no text on any of them.
    #[error("{file}: no text layer on any of {pages} pages (scanned PDF?) and OCR is off here: turn it on (engramd: [ingest] ocr) or run OCR first (e.g. `ocrmypdf in.pdf out.pdf`) and ingest the result")]
    NoTextLayer { file: String, pages: usize },
    /// An image, or a PDF without a text layer, where OCR is off or not installed.
    #[error("{file}: {what} needs OCR, which is off here (engramd: [ingest] ocr, and Debian's tesseract-ocr and poppler-utils); run OCR first (e.g. `ocrmypdf in.pdf out.pdf`) or turn it on")]
    NeedsOcr { file: String, what: String },
    /// OCR read no text from any page that needed it.
    #[error("{file}: OCR found no text: {reason}; check the scan (300 dpi, straight, dark on light) or its language")]
    OcrFailed { file: String, reason: String },
    /// A PDF that needs a password.
    #[error("{file}: the PDF is encrypted and needs a password; remove the protection and ingest it again")]
    Encrypted { file: String },
    /// The file is broken or not what its extension says.
    #[error("{file}: malformed {format:?} file: {reason}; re-export or repair it and try again")]
    Malformed {
        file: String,
        format: Format,
        reason: String,
    },
    /// A DOCX archive breaks a safety limit (a zip bomb, or a file built to look like one).
    #[error("{file}: archive member {member:?} {reason}, over the limit Limits::{limit_name} = {limit}; the file may be a zip bomb, re-save it from the editor or raise the limit")]
    ArchiveLimit {
        file: String,
        member: String,
        /// What was broken, e.g. "inflates to more than 134217728 bytes".
        reason: String,
        limit_name: &'static str,
        limit: u64,
    },
    /// The document parsed but holds no text.
    #[error(
        "{file}: the {format:?} document contains no text; check that the right file was uploaded"
    )]
    Empty { file: String, format: Format },
}

impl ParseError {
    /// A stable snake_case name for logs, metrics labels and API error bodies.
    pub fn error_type(&self) -> &'static str {
        match self {
            ParseError::TooLarge { .. } => "too_large",
            ParseError::UnsupportedFormat { .. } => "unsupported_format",
            ParseError::Encoding { .. } => "encoding",
            ParseError::NoTextLayer { .. } => "no_text_layer",
            ParseError::NeedsOcr { .. } => "needs_ocr",
            ParseError::OcrFailed { .. } => "ocr_failed",
            ParseError::Encrypted { .. } => "encrypted",
            ParseError::Malformed { .. } => "malformed",
            ParseError::ArchiveLimit { .. } => "archive_limit",
            ParseError::Empty { .. } => "empty",
        }
    }
}

/// The crate's result type.
pub type Result<T, E = ParseError> = std::result::Result<T, E>;
