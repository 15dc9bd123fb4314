//! Document parsers for ingest: plain text, Markdown, HTML, PDF and DOCX to normalised UTF-8 text,
//! with the headings, page ranges and title that chunking and citations need.
//!
//! Ingest reads files that users upload, so every parser treats its input as hostile: sizes are
//! bounded by [`Limits`] before and while decoding, DOCX archives are read through capped readers
//! (zip bombs), legacy encodings are decoded only when the guess is trustworthy, and no input
//! makes [`parse`] panic. A document that yields no text is an error that says why (a scanned PDF
//! needs OCR), never an empty success.
//!
//! ```
//! use engram_parse::{parse, Format, Limits};
//!
//! let parsed = parse("notes.md", b"# Pumps\n\nCheck the  valves\nweekly.", &Limits::default())?;
//! assert_eq!(parsed.format, Format::Markdown);
//! assert_eq!(parsed.text, "Pumps\n\nCheck the valves weekly.");
//! assert_eq!(parsed.title.as_deref(), Some("Pumps"));
//! assert_eq!(parsed.headings[0].offset, 0);
//! # Ok::<(), engram_parse::ParseError>(())
//! ```
//!
//! Modules, one per format, all writing through the normaliser in `text`:
//!
//! - `encoding`: bytes to text (BOMs, UTF-8, `<meta charset>`, detection of legacy encodings).
//! - `text`: the normaliser every parser writes through, and plain text.
//! - `markdown`, `html`, `pdf`, `docx`: one parser each.
//! - `ocr`: scanned pages (images, PDF pages without a text layer) read by Tesseract, when the
//!   caller passes an [`Ocr`] to [`parse_with`].
//! - `inflate`: capped decompression (zip bombs) for DOCX members and PDF streams.
//! - `error`: [`ParseError`].
#![forbid(unsafe_code)]

mod docx;
mod encoding;
mod error;
mod html;
mod inflate;
mod markdown;
mod ocr;
mod pdf;
#[cfg(test)]
mod tests;
mod text;

use std::ops::Range;

pub use error::{ParseError, Result};
pub use ocr::{
    tidy as tidy_ocr_text, Ocr, OcrProgress, DEFAULT_LANGUAGES as DEFAULT_OCR_LANGUAGES,
};

/// A document format Engram ingests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Format {
    Text,
    Markdown,
    Html,
    Pdf,
    Docx,
    /// A picture of text (PNG, JPEG, TIFF): read by OCR only.
    Image,
}

/// Bounds on what one document may cost to parse.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Largest input file accepted, in bytes.
    pub max_input_bytes: u64,
    /// Largest extracted text, in bytes.
    pub max_text_bytes: u64,
    /// Largest uncompressed size of any one archive member (DOCX) or compressed PDF stream, in
    /// bytes. Checked against the size the archive declares and against the bytes actually
    /// inflated.
    pub max_entry_bytes: u64,
    /// Largest uncompressed/compressed ratio of an archive member (DOCX) or PDF stream; not
    /// checked below 1 MiB of output.
    pub max_compression_ratio: u64,
    /// Most members in an archive (DOCX).
    pub max_archive_entries: usize,
    /// Most PDF pages read; a longer PDF is refused rather than silently cut.
    pub max_pages: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_input_bytes: 64 << 20,
            max_text_bytes: 32 << 20,
            max_entry_bytes: 128 << 20,
            max_compression_ratio: 200,
            // A large Word document with many images has a few hundred members.
            max_archive_entries: 10_000,
            max_pages: 5000,
        }
    }
}

/// A heading found in the document, for section-aware chunking and citations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Heading {
    /// 1 for a title or `#`, 2 for `##`, ...
    pub level: u8,
    pub text: String,
    /// Byte offset of the heading in [`Parsed::text`].
    pub offset: usize,
}

/// A parsed document: its text and where things are in it.
#[derive(Clone, Debug)]
pub struct Parsed {
    /// UTF-8 text; paragraphs separated by a blank line (`"\n\n"`), whitespace inside a paragraph
    /// collapsed to single spaces, no control characters.
    pub text: String,
    pub format: Format,
    /// The document's title when it names one (HTML `<title>`, first `#` heading, DOCX core title, PDF Title).
    pub title: Option<String>,
    /// PDF only: byte range in `text` of each page, in page order (page number = index + 1).
    /// A page without text has an empty range.
    pub pages: Vec<Range<usize>>,
    pub headings: Vec<Heading>,
    /// Pages whose text OCR read (1-based; an image is page 1).
    pub ocr_pages: Vec<usize>,
    /// Pages OCR could not read, each with why (the document still holds the others' text).
    pub ocr_failures: Vec<String>,
    /// The source encoding ("UTF-8", "UTF-16LE", "GBK", "gb18030", "Shift_JIS", "windows-1252",
    /// ...), as named by the WHATWG Encoding Standard. PDF and DOCX report "UTF-8".
    pub encoding: &'static str,
}

/// Magic bytes of a PDF; the standard allows them anywhere in the first 1024 bytes.
const PDF_MAGIC: &[u8] = b"%PDF-";
/// Magic bytes of PNG, JPEG and TIFF (little- and big-endian).
const IMAGE_MAGICS: &[&[u8]] = &[b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"II*\0", b"MM\0*"];
/// Magic bytes of a zip local file header, which a DOCX starts with.
const ZIP_MAGIC: &[u8] = b"PK\x03\x04";

/// Picks the format from the file name's extension, falling back to the content's magic bytes.
pub fn detect_format(file_name: &str, bytes: &[u8]) -> Result<Format> {
    let ext = std::path::Path::new(file_name)
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    let unsupported = |detail: String| ParseError::UnsupportedFormat {
        file: file_name.to_owned(),
        detail,
    };
    match ext.as_deref() {
        Some("txt" | "text" | "log") => return Ok(Format::Text),
        Some("md" | "markdown" | "mdown" | "mkd" | "mkdn") => return Ok(Format::Markdown),
        Some("html" | "htm" | "xhtml") => return Ok(Format::Html),
        Some("pdf") => return Ok(Format::Pdf),
        Some("docx") => return Ok(Format::Docx),
        Some("png" | "jpg" | "jpeg" | "tif" | "tiff") => return Ok(Format::Image),
        Some("doc") => return Err(unsupported("legacy Word .doc; save it as .docx".to_owned())),
        _ => {}
    }
    let head = &bytes[..bytes.len().min(1024)];
    if head.windows(PDF_MAGIC.len()).any(|w| w == PDF_MAGIC) {
        return Ok(Format::Pdf);
    }
    if IMAGE_MAGICS.iter().any(|m| bytes.starts_with(m)) {
        return Ok(Format::Image);
    }
    if bytes.starts_with(ZIP_MAGIC) {
        return if bytes.windows(b"word/".len()).any(|w| w == b"word/") {
            Ok(Format::Docx)
        } else {
            Err(unsupported(
                "a zip archive that is not a DOCX document".to_owned(),
            ))
        };
    }
    let start: Vec<u8> = head
        .iter()
        .skip_while(|b| b.is_ascii_whitespace())
        .take(64)
        .map(u8::to_ascii_lowercase)
        .collect();
    let start = start.strip_prefix(b"\xef\xbb\xbf").unwrap_or(&start);
    if start.starts_with(b"<!doctype html") || start.starts_with(b"<html") {
        return Ok(Format::Html);
    }
    if !head.contains(&0) || encoding_rs::Encoding::for_bom(bytes).is_some() {
        return Ok(Format::Text);
    }
    Err(unsupported(match ext {
        Some(ext) => format!("extension .{ext} and binary content"),
        None => "no extension and binary content".to_owned(),
    }))
}

/// Parses one document, with no OCR: an image is refused and a PDF without a text layer is an
/// error that says so.
pub fn parse(file_name: &str, bytes: &[u8], limits: &Limits) -> Result<Parsed> {
    parse_with(file_name, bytes, limits, None, &mut |_| {})
}

/// Parses one document, reading images and the PDF pages without a text layer with `ocr` when
/// given; `progress` hears after every page OCR reads.
pub fn parse_with(
    file_name: &str,
    bytes: &[u8],
    limits: &Limits,
    ocr: Option<&Ocr>,
    progress: &mut dyn FnMut(OcrProgress),
) -> Result<Parsed> {
    if bytes.len() as u64 > limits.max_input_bytes {
        return Err(ParseError::TooLarge {
            file: file_name.to_owned(),
            what: "the input file",
            size: bytes.len() as u64,
            limit_name: "max_input_bytes",
            limit: limits.max_input_bytes,
        });
    }
    let format = detect_format(file_name, bytes)?;
    let parsed = match format {
        Format::Text => parse_text(file_name, bytes, limits)?,
        Format::Markdown => markdown::parse(file_name, bytes, limits)?,
        Format::Html => html::parse(file_name, bytes, limits)?,
        Format::Pdf => pdf::parse(file_name, bytes, limits, ocr, progress)?,
        Format::Docx => docx::parse(file_name, bytes, limits)?,
        Format::Image => parse_image(file_name, bytes, limits, ocr, progress)?,
    };
    if parsed.text.is_empty() {
        return Err(ParseError::Empty {
            file: file_name.to_owned(),
            format,
        });
    }
    Ok(parsed)
}

fn parse_image(
    file: &str,
    bytes: &[u8],
    limits: &Limits,
    ocr: Option<&Ocr>,
    progress: &mut dyn FnMut(OcrProgress),
) -> Result<Parsed> {
    let Some(ocr) = ocr else {
        return Err(ParseError::NeedsOcr {
            file: file.to_owned(),
            what: "an image".into(),
        });
    };
    let text = ocr.image(bytes).map_err(|reason| ParseError::OcrFailed {
        file: file.to_owned(),
        reason,
    });
    progress(OcrProgress { done: 1, pages: 1 });
    let text = text?;
    let mut out = text::TextBuilder::new(file, limits.max_text_bytes);
    text::parse_plain(&text, &mut out)?;
    let (text, headings) = out.finish();
    Ok(Parsed {
        text,
        format: Format::Image,
        title: None,
        pages: Vec::new(),
        headings,
        ocr_pages: vec![1],
        ocr_failures: Vec::new(),
        encoding: "UTF-8",
    })
}

fn parse_text(file: &str, bytes: &[u8], limits: &Limits) -> Result<Parsed> {
    let decoded = encoding::decode(file, bytes, None)?;
    let mut out = text::TextBuilder::new(file, limits.max_text_bytes);
    text::parse_plain(&decoded.text, &mut out)?;
    let (text, headings) = out.finish();
    Ok(Parsed {
        text,
        format: Format::Text,
        title: None,
        pages: Vec::new(),
        headings,
        ocr_pages: Vec::new(),
        ocr_failures: Vec::new(),
        encoding: decoded.encoding,
    })
}
