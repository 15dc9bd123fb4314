//! DOCX (Office Open XML) to text: paragraphs, headings from heading styles, tables as rows, and
//! the title from the core properties.
//!
//! A DOCX is a zip archive, so it is opened as a hostile one: the member count is bounded, and
//! each member read is checked against its declared size and then inflated through a capped
//! reader that counts real bytes (headers can lie).

use std::collections::HashMap;
use std::io::{Cursor, Read};

use quick_xml::events::{BytesStart, Event};
use quick_xml::Reader;
use zip::result::ZipError;
use zip::ZipArchive;

use crate::error::{ParseError, Result};
use crate::inflate;
use crate::text::{collapse, TextBuilder};
use crate::{Format, Limits, Parsed};

/// The main document part, where Word always puts it.
const DOCUMENT: &str = "word/document.xml";
const STYLES: &str = "word/styles.xml";
const CORE: &str = "docProps/core.xml";

/// Separator between the cells of a table row.
const CELL_SEPARATOR: &str = "|";

pub(crate) fn parse(file: &str, bytes: &[u8], limits: &Limits) -> Result<Parsed> {
    let malformed = |reason: String| ParseError::Malformed {
        file: file.to_owned(),
        format: Format::Docx,
        reason,
    };
    let mut archive = ZipArchive::new(Cursor::new(bytes))
        .map_err(|e| malformed(format!("not a readable zip archive ({e})")))?;
    if archive.len() > limits.max_archive_entries {
        return Err(ParseError::ArchiveLimit {
            file: file.to_owned(),
            member: "(archive)".to_owned(),
            reason: format!("has {} members", archive.len()),
            limit_name: "max_archive_entries",
            limit: limits.max_archive_entries as u64,
        });
    }
    let document = read_member(file, &mut archive, DOCUMENT, limits)?.ok_or_else(|| {
        malformed(format!(
            "no {DOCUMENT}: this zip archive is not a Word document"
        ))
    })?;
    let styles = match read_member(file, &mut archive, STYLES, limits)? {
        Some(xml) => heading_styles(&xml_text(file, STYLES, &xml)?)
            .map_err(|e| malformed(format!("{STYLES}: {e}")))?,
        None => HashMap::new(),
    };
    let title = match read_member(file, &mut archive, CORE, limits)? {
        // The core properties are optional metadata: a broken one loses the title, not the text.
        Some(xml) => xml_text(file, CORE, &xml).ok().and_then(|x| core_title(&x)),
        None => None,
    };
    let xml = xml_text(file, DOCUMENT, &document)?;
    let mut out = TextBuilder::new(file, limits.max_text_bytes);
    let first_heading = body_text(&xml, &styles, &mut out).map_err(|e| match e {
        BodyError::Xml(reason) => malformed(format!("{DOCUMENT}: {reason}")),
        BodyError::Limit(e) => e,
    })?;
    let (text, headings) = out.finish();
    Ok(Parsed {
        text,
        format: Format::Docx,
        title: title.or(first_heading),
        pages: Vec::new(),
        headings,
        ocr_pages: Vec::new(),
        ocr_failures: Vec::new(),
        encoding: "UTF-8",
    })
}

/// Reads one member, or `None` when the archive has no such member.
fn read_member(
    file: &str,
    archive: &mut ZipArchive<Cursor<&[u8]>>,
    name: &str,
    limits: &Limits,
) -> Result<Option<Vec<u8>>> {
    let malformed = |reason: String| ParseError::Malformed {
        file: file.to_owned(),
        format: Format::Docx,
        reason,
    };
    let member = match archive.by_name(name) {
        Ok(member) => member,
        Err(ZipError::FileNotFound) => return Ok(None),
        Err(e) => return Err(malformed(format!("{name}: {e}"))),
    };
    let breach = |breach: inflate::Breach| {
        if let inflate::Breach::Io(e) = &breach {
            // The zip reader stops a member at the size its header declares: a header that lies
            // is as likely a bomb as a corrupt file, and the message says so.
            return malformed(format!("{name} cannot be decompressed ({e}; a file whose header understates its size may be a zip bomb)"));
        }
        let (reason, limit_name, limit) = breach.describe(limits);
        ParseError::ArchiveLimit {
            file: file.to_owned(),
            member: name.to_owned(),
            reason,
            limit_name,
            limit,
        }
    };
    let compressed = member.compressed_size();
    inflate::check_declared(member.size(), compressed, limits).map_err(breach)?;
    // `take` keeps the read bounded even if the zip reader trusted the declared size.
    let capped = member.take(limits.max_entry_bytes.saturating_add(1));
    inflate::read_capped(capped, compressed, limits)
        .map(Some)
        .map_err(breach)
}

/// A member's XML as text: UTF-8 (the only encoding Word writes), or UTF-16 with a byte order mark.
fn xml_text(file: &str, name: &str, bytes: &[u8]) -> Result<String> {
    if let Some((encoding, bom)) = encoding_rs::Encoding::for_bom(bytes) {
        if let Some(text) =
            encoding.decode_without_bom_handling_and_without_replacement(&bytes[bom..])
        {
            return Ok(text.into_owned());
        }
    } else if let Ok(text) = std::str::from_utf8(bytes) {
        return Ok(text.to_owned());
    }
    Err(ParseError::Malformed {
        file: file.to_owned(),
        format: Format::Docx,
        reason: format!("{name} is not valid UTF-8 or UTF-16"),
    })
}

/// Heading level of each paragraph style id that is a heading: from the style's name ("heading 2",
/// "Title") or its outline level, following `basedOn` one step. Style ids are localised (a
/// Chinese Word names "heading 1" `1`), names are not.
fn heading_styles(xml: &str) -> Result<HashMap<String, u8>, String> {
    let mut reader = Reader::from_str(xml);
    let mut levels = HashMap::new();
    let mut based_on: HashMap<String, String> = HashMap::new();
    let mut current: Option<String> = None;
    loop {
        match reader.read_event().map_err(|e| e.to_string())? {
            Event::Start(e) | Event::Empty(e) => match e.local_name().as_ref() {
                "style" => current = attr(&e, "styleId"),
                "name" => {
                    if let (Some(id), Some(name)) = (&current, attr(&e, "val")) {
                        if let Some(level) = style_name_level(&name) {
                            levels.insert(id.clone(), level);
                        }
                    }
                }
                "outlineLvl" => {
                    if let (Some(id), Some(level)) =
                        (&current, attr(&e, "val").and_then(|v| v.parse::<u8>().ok()))
                    {
                        if level < 9 {
                            levels.entry(id.clone()).or_insert(level + 1);
                        }
                    }
                }
                "basedOn" => {
                    if let (Some(id), Some(base)) = (&current, attr(&e, "val")) {
                        based_on.insert(id.clone(), base);
                    }
                }
                _ => {}
            },
            Event::End(e) if e.local_name().as_ref() == "style" => current = None,
            Event::Eof => break,
            _ => {}
        }
    }
    for (id, base) in based_on {
        if let Some(&level) = levels.get(&base) {
            levels.entry(id).or_insert(level);
        }
    }
    Ok(levels)
}

/// "heading 1".."heading 9" (any case, with or without the space) and "Title".
fn style_name_level(name: &str) -> Option<u8> {
    let name = name.to_ascii_lowercase().replace(' ', "");
    if name == "title" {
        return Some(1);
    }
    let level: u8 = name.strip_prefix("heading")?.parse().ok()?;
    (1..=9).contains(&level).then_some(level)
}

/// `dc:title` of `docProps/core.xml`.
fn core_title(xml: &str) -> Option<String> {
    let mut reader = Reader::from_str(xml);
    let mut in_title = false;
    let mut title = String::new();
    loop {
        match reader.read_event().ok()? {
            Event::Start(e) if e.local_name().as_ref() == "title" => in_title = true,
            Event::End(e) if e.local_name().as_ref() == "title" => break,
            Event::Text(t) if in_title => title.push_str(&t.xml10_content()),
            Event::GeneralRef(r) if in_title => title.push_str(&resolve_ref(&r)),
            Event::Eof => break,
            _ => {}
        }
    }
    let title = collapse(&title);
    (!title.is_empty()).then_some(title)
}

enum BodyError {
    Xml(String),
    Limit(ParseError),
}

impl From<ParseError> for BodyError {
    fn from(e: ParseError) -> BodyError {
        BodyError::Limit(e)
    }
}

/// One open paragraph of the body.
#[derive(Default)]
struct Paragraph {
    style: Option<String>,
    outline: Option<u8>,
    text: String,
}

/// Walks `word/document.xml`: text of `w:t` runs, tabs and breaks as spaces, deleted text and
/// field codes skipped, the fallback copy of alternate content skipped (it repeats the choice).
/// Returns the first heading's text.
fn body_text(
    xml: &str,
    styles: &HashMap<String, u8>,
    out: &mut TextBuilder,
) -> Result<Option<String>, BodyError> {
    let mut reader = Reader::from_str(xml);
    let mut first_heading = None;
    // Paragraphs nest (text boxes inside a run); their text joins the outermost one.
    let mut paragraph: Option<Paragraph> = None;
    let mut p_depth = 0usize;
    let mut in_text = false;
    let mut skip_depth = 0usize;
    // Table nesting, and the cells of the current outermost row.
    let mut table_depth = 0usize;
    let mut row: Vec<String> = Vec::new();
    let mut cell = String::new();
    loop {
        let event = reader
            .read_event()
            .map_err(|e| BodyError::Xml(e.to_string()))?;
        if skip_depth > 0 {
            match event {
                Event::Start(_) => skip_depth += 1,
                Event::End(_) => skip_depth -= 1,
                Event::Eof => break,
                _ => {}
            }
            continue;
        }
        match event {
            Event::Start(e) => match e.local_name().as_ref() {
                "Fallback" | "delText" | "instrText" => skip_depth = 1,
                "p" => {
                    p_depth += 1;
                    if p_depth == 1 {
                        paragraph = Some(Paragraph::default());
                    } else if let Some(p) = paragraph.as_mut() {
                        p.text.push(' ');
                    }
                }
                "t" => in_text = true,
                "tbl" => {
                    table_depth += 1;
                    if table_depth == 1 {
                        out.end_paragraph();
                    }
                }
                "tr" if table_depth == 1 => row.clear(),
                "tc" if table_depth == 1 => cell.clear(),
                _ => {}
            },
            Event::Empty(e) => match e.local_name().as_ref() {
                "tab" | "br" | "cr" => {
                    if let Some(p) = paragraph.as_mut() {
                        p.text.push(' ');
                    }
                }
                "noBreakHyphen" => {
                    if let Some(p) = paragraph.as_mut() {
                        p.text.push('-');
                    }
                }
                "pStyle" if p_depth == 1 => {
                    if let Some(p) = paragraph.as_mut() {
                        p.style = attr(&e, "val");
                    }
                }
                "outlineLvl" if p_depth == 1 => {
                    if let Some(p) = paragraph.as_mut() {
                        p.outline = attr(&e, "val")
                            .and_then(|v| v.parse::<u8>().ok())
                            .filter(|&l| l < 9)
                            .map(|l| l + 1);
                    }
                }
                _ => {}
            },
            Event::Text(t) if in_text => {
                if let Some(p) = paragraph.as_mut() {
                    p.text.push_str(&t.xml10_content());
                }
            }
            Event::GeneralRef(r) if in_text => {
                if let Some(p) = paragraph.as_mut() {
                    p.text.push_str(&resolve_ref(&r));
                }
            }
            Event::End(e) => match e.local_name().as_ref() {
                "t" => in_text = false,
                "p" => {
                    p_depth = p_depth.saturating_sub(1);
                    if p_depth > 0 {
                        if let Some(p) = paragraph.as_mut() {
                            p.text.push(' ');
                        }
                        continue;
                    }
                    let Some(p) = paragraph.take() else { continue };
                    if table_depth > 0 {
                        if !cell.is_empty() {
                            cell.push(' ');
                        }
                        cell.push_str(&p.text);
                        continue;
                    }
                    let level = p.outline.or_else(|| {
                        p.style
                            .as_ref()
                            .and_then(|s| styles.get(s).copied().or_else(|| style_name_level(s)))
                    });
                    match level {
                        Some(level) => {
                            let heading = out.heading(level, &p.text)?;
                            first_heading = first_heading.or(heading);
                        }
                        None => out.paragraph(&p.text)?,
                    }
                }
                "tc" if table_depth == 1 => row.push(collapse(&cell)),
                "tr" if table_depth == 1 => {
                    let cells: Vec<&str> = row
                        .iter()
                        .map(String::as_str)
                        .filter(|c| !c.is_empty())
                        .collect();
                    out.paragraph(&cells.join(&format!(" {CELL_SEPARATOR} ")))?;
                }
                "tbl" => table_depth = table_depth.saturating_sub(1),
                _ => {}
            },
            Event::Eof => break,
            _ => {}
        }
    }
    Ok(first_heading)
}

/// The text an entity or character reference stands for; unknown entities are dropped.
fn resolve_ref(r: &quick_xml::events::BytesRef) -> String {
    if let Ok(Some(c)) = r.resolve_char_ref() {
        return c.to_string();
    }
    match r.as_ref() {
        "amp" => "&",
        "lt" => "<",
        "gt" => ">",
        "quot" => "\"",
        "apos" => "'",
        _ => "",
    }
    .to_owned()
}

/// The value of the attribute whose local name is `name`, unescaped.
fn attr(e: &BytesStart, name: &str) -> Option<String> {
    e.attributes()
        .flatten()
        .find(|a| a.key.local_name().as_ref() == name)
        .and_then(|a| a.normalized_value(quick_xml::XmlVersion::Implicit1_0).ok())
        .map(|v| v.into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn style_names() {
        assert_eq!(style_name_level("heading 2"), Some(2));
        assert_eq!(style_name_level("Heading1"), Some(1));
        assert_eq!(style_name_level("Title"), Some(1));
        assert_eq!(style_name_level("Normal"), None);
        assert_eq!(style_name_level("heading 0"), None);
    }

    #[test]
    fn body_walk() {
        let xml = r#"<w:document xmlns:w="w"><w:body>
            <w:p><w:pPr><w:pStyle w:val="1"/></w:pPr><w:r><w:t>Intro</w:t></w:r></w:p>
            <w:p><w:r><w:t xml:space="preserve">A &amp; </w:t><w:tab/><w:t>B</w:t><w:delText>gone</w:delText></w:r></w:p>
            <w:tbl><w:tr><w:tc><w:p><w:r><w:t>x</w:t></w:r></w:p></w:tc><w:tc><w:p><w:r><w:t>y</w:t></w:r></w:p><w:p><w:r><w:t>z</w:t></w:r></w:p></w:tc></w:tr></w:tbl>
            <w:p><w:r><mc:AlternateContent><mc:Choice><w:txbxContent><w:p><w:r><w:t>box</w:t></w:r></w:p></w:txbxContent></mc:Choice><mc:Fallback><w:t>dup</w:t></mc:Fallback></mc:AlternateContent></w:r></w:p>
            </w:body></w:document>"#;
        let styles = HashMap::from([("1".to_owned(), 1u8)]);
        let mut out = TextBuilder::new("t.docx", 1 << 20);
        let first = body_text(xml, &styles, &mut out).ok().unwrap();
        let (text, headings) = out.finish();
        assert_eq!(text, "Intro\n\nA & B\n\nx | y z\n\nbox");
        assert_eq!(first.as_deref(), Some("Intro"));
        assert_eq!(headings.len(), 1);
    }
}
