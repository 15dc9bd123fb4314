//! PDF text layer, page by page, through pdf-extract (glyph positions, font encodings, ToUnicode).
//!
//! pdf-extract was written for well-formed files: it unwraps freely and recurses into form
//! XObjects without a bound. So the document is checked and prepared before any page is read:
//! images are replaced by empty forms (their data is never decoded as content), Flate streams
//! must inflate within [`Limits`], page-tree parents and form nesting must be shallow and acyclic
//! (recursion there would overflow the stack, which no `catch_unwind` can stop). Each page is then
//! extracted under `catch_unwind`, so a panic left in pdf-extract becomes a `Malformed` error
//! naming the page instead of taking the ingest process down (this relies on `panic = "unwind"`,
//! the default; a profile that aborts on panic would lose that protection).

use std::collections::HashSet;
use std::panic::{catch_unwind, AssertUnwindSafe};

use pdf_extract::content::Content;
use pdf_extract::{Dictionary, Document, Object, ObjectId, PlainTextOutput, Stream, StringFormat};

use crate::error::{ParseError, Result};
use crate::inflate;
use crate::ocr::{Ocr, OcrProgress};
use crate::text::{collapse, parse_plain, TextBuilder};
use crate::{Format, Limits, Parsed};

/// Deepest page-tree ancestry followed; real files nest pages 2-4 levels (balanced trees of
/// thousands of pages stay under 10).
const MAX_TREE_DEPTH: usize = 64;
/// Deepest nesting of form XObjects; real files use 1-3 levels.
const MAX_FORM_DEPTH: usize = 16;
/// Most form XObject invocations on one page, counting nested ones: stops forms that call each
/// other several times per level from multiplying into billions of calls.
const MAX_FORM_CALLS: usize = 10_000;

pub(crate) fn parse(
    file: &str,
    bytes: &[u8],
    limits: &Limits,
    ocr: Option<&Ocr>,
    progress: &mut dyn FnMut(OcrProgress),
) -> Result<Parsed> {
    let malformed = |reason: String| ParseError::Malformed {
        file: file.to_owned(),
        format: Format::Pdf,
        reason,
    };
    let mut doc = match catch_unwind(|| Document::load_mem(bytes)) {
        Ok(Ok(doc)) => doc,
        Ok(Err(e)) => return Err(malformed(format!("cannot read the file structure ({e})"))),
        Err(panic) => {
            return Err(malformed(format!(
                "the PDF reader failed ({})",
                panic_message(&panic)
            )))
        }
    };
    if doc.is_encrypted() && doc.decrypt("").is_err() {
        return Err(ParseError::Encrypted {
            file: file.to_owned(),
        });
    }
    let pages = doc.get_pages();
    if pages.is_empty() {
        return Err(malformed("it has no pages".to_owned()));
    }
    if pages.len() > limits.max_pages {
        return Err(ParseError::TooLarge {
            file: file.to_owned(),
            what: "the page count",
            size: pages.len() as u64,
            limit_name: "max_pages",
            limit: limits.max_pages as u64,
        });
    }
    blank_images(&mut doc);
    check_streams(file, &doc, limits)?;
    for (&number, &id) in &pages {
        check_page(&doc, id).map_err(|reason| malformed(format!("page {number}: {reason}")))?;
    }

    // Every page's text layer first, so that OCR knows how many pages it has to read.
    let mut layers = Vec::with_capacity(pages.len());
    for &number in pages.keys() {
        let mut raw = String::new();
        let result = catch_unwind(AssertUnwindSafe(|| {
            let mut output = PlainTextOutput::new(&mut raw);
            pdf_extract::output_doc_page(&doc, &mut output, number)
        }));
        match result {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(malformed(format!("page {number}: {e:?}"))),
            Err(panic) => {
                return Err(malformed(format!(
                    "page {number}: the PDF reader failed ({})",
                    panic_message(&panic)
                )))
            }
        }
        // A page whose text layer holds no text is a scan.
        let scanned = collapse(&raw).trim().is_empty();
        layers.push((number as usize, raw, scanned));
    }
    // OCR reads the scans where the caller passed one, page by page in the document's order.
    let scans = layers.iter().filter(|(_, _, scanned)| *scanned).count();
    let mut out = TextBuilder::new(file, limits.max_text_bytes);
    let mut ranges = Vec::with_capacity(pages.len());
    let (mut ocr_pages, mut ocr_failures) = (Vec::new(), Vec::new());
    let mut done = 0;
    for (number, raw, scanned) in &layers {
        let mark = out.mark();
        match ocr {
            Some(ocr) if *scanned => {
                let read = ocr.pdf_page(bytes, *number);
                done += 1;
                progress(OcrProgress { done, pages: scans });
                match read {
                    Ok(text) if !text.trim().is_empty() => {
                        parse_plain(&text, &mut out)?;
                        ocr_pages.push(*number);
                    }
                    Ok(_) => ocr_failures.push(format!("page {number}: OCR found no text")),
                    Err(why) => ocr_failures.push(format!("page {number}: {why}")),
                }
            }
            _ => parse_plain(raw, &mut out)?,
        }
        ranges.push(out.range_since(mark));
    }
    if out.is_empty() {
        if let (Some(_), Some(first)) = (ocr, ocr_failures.first()) {
            return Err(ParseError::OcrFailed {
                file: file.to_owned(),
                reason: format!(
                    "none of {} pages gave text ({first}{})",
                    pages.len(),
                    if ocr_failures.len() > 1 { ", ..." } else { "" }
                ),
            });
        }
        return Err(ParseError::NoTextLayer {
            file: file.to_owned(),
            pages: pages.len(),
        });
    }
    let (text, headings) = out.finish();
    Ok(Parsed {
        text,
        format: Format::Pdf,
        title: info_title(&doc),
        pages: ranges,
        headings,
        ocr_pages,
        ocr_failures,
        encoding: "UTF-8",
    })
}

/// Replaces every image XObject by an empty form: text extraction never needs pixels, and
/// pdf-extract would otherwise decompress each image and try to read it as a content stream.
fn blank_images(doc: &mut Document) {
    for object in doc.objects.values_mut() {
        let Object::Stream(stream) = object else {
            continue;
        };
        let is_image = stream
            .dict
            .get(b"Subtype")
            .and_then(Object::as_name)
            .is_ok_and(|n| n == b"Image");
        if is_image {
            let mut dict = Dictionary::new();
            dict.set("Type", Object::Name(b"XObject".to_vec()));
            dict.set("Subtype", Object::Name(b"Form".to_vec()));
            dict.set(
                "BBox",
                Object::Array(vec![0.into(), 0.into(), 0.into(), 0.into()]),
            );
            *object = Object::Stream(Stream::new(dict, Vec::new()));
        }
    }
}

/// Every Flate stream must inflate within the limits (lopdf itself inflates without a bound).
fn check_streams(file: &str, doc: &Document, limits: &Limits) -> Result<()> {
    for (&(num, generation), object) in &doc.objects {
        let Object::Stream(stream) = object else {
            continue;
        };
        let flate = stream
            .filters()
            .is_ok_and(|f| f.first().is_some_and(|f| *f == b"FlateDecode"));
        if !flate {
            continue;
        }
        let compressed = stream.content.len() as u64;
        let decoder = flate2::read::ZlibDecoder::new(stream.content.as_slice());
        match inflate::read_capped(decoder, compressed, limits) {
            // A corrupt stream is pdf-extract's to report (or skip) when it reads it.
            Ok(_) | Err(inflate::Breach::Io(_)) => {}
            Err(breach) => {
                let (reason, limit_name, limit) = breach.describe(limits);
                return Err(ParseError::ArchiveLimit {
                    file: file.to_owned(),
                    member: format!("stream object {num} {generation}"),
                    reason,
                    limit_name,
                    limit,
                });
            }
        }
    }
    Ok(())
}

/// Checks the recursion pdf-extract will do for one page: the page's ancestry (where it looks
/// for inherited resources) and the form XObjects its content invokes.
fn check_page(doc: &Document, page: ObjectId) -> Result<(), String> {
    let mut seen = HashSet::new();
    let mut id = page;
    let mut resources = None;
    loop {
        if !seen.insert(id) || seen.len() > MAX_TREE_DEPTH {
            return Err("the page tree's /Parent links loop or nest too deep".to_owned());
        }
        let dict = doc
            .get_dictionary(id)
            .map_err(|e| format!("page object: {e}"))?;
        if resources.is_none() {
            resources = dict
                .get(b"Resources")
                .ok()
                .and_then(|r| resolve_dict(doc, r));
        }
        match dict.get(b"Parent").and_then(Object::as_reference) {
            Ok(parent) => id = parent,
            Err(_) => break,
        }
    }
    let content = doc
        .get_page_content(page)
        .map_err(|e| format!("content stream: {e}"))?;
    let mut calls = 0;
    check_forms(doc, &content, resources, 0, &mut calls)
}

fn check_forms(
    doc: &Document,
    content: &[u8],
    resources: Option<&Dictionary>,
    depth: usize,
    calls: &mut usize,
) -> Result<(), String> {
    if depth > MAX_FORM_DEPTH {
        return Err(format!(
            "form XObjects nest more than {MAX_FORM_DEPTH} deep (or call themselves)"
        ));
    }
    let Ok(content) = Content::decode(content) else {
        return Err("a content stream cannot be parsed".to_owned());
    };
    for op in content.operations.iter().filter(|op| op.operator == "Do") {
        *calls += 1;
        if *calls > MAX_FORM_CALLS {
            return Err(format!("more than {MAX_FORM_CALLS} form XObject calls"));
        }
        let Some(name) = op.operands.first().and_then(|o| o.as_name().ok()) else {
            continue;
        };
        let form = resources
            .and_then(|r| r.get(b"XObject").ok())
            .and_then(|x| resolve_dict(doc, x))
            .and_then(|x| x.get(name).ok())
            .and_then(|f| doc.dereference(f).ok())
            .and_then(|(_, f)| f.as_stream().ok());
        let Some(form) = form else { continue };
        let inner = form
            .dict
            .get(b"Resources")
            .ok()
            .and_then(|r| resolve_dict(doc, r))
            .or(resources);
        let body = form
            .decompressed_content()
            .unwrap_or_else(|_| form.content.clone());
        check_forms(doc, &body, inner, depth + 1, calls)?;
    }
    Ok(())
}

fn resolve_dict<'a>(doc: &'a Document, object: &'a Object) -> Option<&'a Dictionary> {
    doc.dereference(object)
        .ok()
        .and_then(|(_, o)| o.as_dict().ok())
}

/// The `/Title` of the document information dictionary.
fn info_title(doc: &Document) -> Option<String> {
    let info = doc
        .trailer
        .get(b"Info")
        .ok()
        .and_then(|i| resolve_dict(doc, i))?;
    let (_, title) = doc.dereference(info.get(b"Title").ok()?).ok()?;
    let Object::String(bytes, StringFormat::Literal | StringFormat::Hexadecimal) = title else {
        return None;
    };
    let title = collapse(&pdf_text_string(bytes));
    (!title.is_empty()).then_some(title)
}

/// Decodes a PDF text string: UTF-16BE with a byte order mark, UTF-8 with one (PDF 2.0), or
/// PDFDocEncoding, read as Latin-1 (they differ only in a few rarely used punctuation marks).
fn pdf_text_string(bytes: &[u8]) -> String {
    if let Some(rest) = bytes.strip_prefix(b"\xfe\xff") {
        let units: Vec<u16> = rest
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
            .collect();
        String::from_utf16_lossy(&units)
    } else if let Some(rest) = bytes.strip_prefix(b"\xef\xbb\xbf") {
        String::from_utf8_lossy(rest).into_owned()
    } else {
        bytes.iter().map(|&b| char::from(b)).collect()
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "panic".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_strings() {
        assert_eq!(pdf_text_string(b"\xfe\xff\x00H\x00i"), "Hi");
        assert_eq!(pdf_text_string(b"Caf\xe9"), "Café");
    }
}
