//! Markdown (CommonMark with tables, footnotes and YAML front matter) to text and headings.

use pulldown_cmark::{Event, Options, Parser, Tag, TagEnd};

use crate::error::Result;
use crate::text::{collapse, TextBuilder};
use crate::{encoding, Format, Limits, Parsed};

pub(crate) fn parse(file: &str, bytes: &[u8], limits: &Limits) -> Result<Parsed> {
    let decoded = encoding::decode(file, bytes, None)?;
    let options = Options::ENABLE_TABLES
        | Options::ENABLE_FOOTNOTES
        | Options::ENABLE_STRIKETHROUGH
        | Options::ENABLE_YAML_STYLE_METADATA_BLOCKS;
    let mut out = TextBuilder::new(file, limits.max_text_bytes);
    let mut title = None;
    let mut front_matter_title = None;
    let mut in_metadata = false;
    let mut heading_level = 0u8;
    let mut cells_in_row = 0usize;
    for event in Parser::new_ext(&decoded.text, options) {
        match event {
            Event::Start(Tag::MetadataBlock(_)) => in_metadata = true,
            Event::End(TagEnd::MetadataBlock(_)) => in_metadata = false,
            Event::Text(t) if in_metadata => {
                front_matter_title = front_matter_title.or_else(|| yaml_title(&t));
            }
            Event::Start(Tag::Heading { level, .. }) => {
                heading_level = level as u8;
                out.begin_heading(heading_level);
            }
            Event::End(TagEnd::Heading(_)) => {
                if let Some(text) = out.end_heading() {
                    if heading_level == 1 && title.is_none() {
                        title = Some(text);
                    }
                }
            }
            Event::Start(Tag::TableRow | Tag::TableHead)
            | Event::End(TagEnd::TableRow | TagEnd::TableHead) => {
                out.end_paragraph();
                cells_in_row = 0;
            }
            Event::Start(Tag::TableCell) => {
                if cells_in_row > 0 {
                    out.space();
                    out.push_str("|")?;
                    out.space();
                }
                cells_in_row += 1;
            }
            Event::Start(
                Tag::Paragraph
                | Tag::BlockQuote(_)
                | Tag::CodeBlock(_)
                | Tag::Item
                | Tag::List(_)
                | Tag::FootnoteDefinition(_)
                | Tag::Table(_)
                | Tag::HtmlBlock
                | Tag::DefinitionListTitle
                | Tag::DefinitionListDefinition,
            )
            | Event::End(
                TagEnd::Paragraph
                | TagEnd::BlockQuote(_)
                | TagEnd::CodeBlock
                | TagEnd::Item
                | TagEnd::List(_)
                | TagEnd::FootnoteDefinition
                | TagEnd::Table
                | TagEnd::HtmlBlock
                | TagEnd::DefinitionListTitle
                | TagEnd::DefinitionListDefinition,
            )
            | Event::Rule
                if !out.in_heading() =>
            {
                out.end_paragraph();
            }
            Event::Text(t) | Event::Code(t) | Event::InlineMath(t) | Event::DisplayMath(t) => {
                out.push_str(&t)?
            }
            Event::SoftBreak | Event::HardBreak => out.space(),
            // Raw HTML is markup, not text; a later version could run it through the HTML parser.
            Event::Html(_) | Event::InlineHtml(_) => {}
            _ => {}
        }
    }
    let (text, headings) = out.finish();
    Ok(Parsed {
        text,
        format: Format::Markdown,
        title: front_matter_title.or(title),
        pages: Vec::new(),
        headings,
        ocr_pages: Vec::new(),
        ocr_failures: Vec::new(),
        encoding: decoded.encoding,
    })
}

/// `title: ...` from YAML front matter, unquoted.
fn yaml_title(block: &str) -> Option<String> {
    block.lines().find_map(|line| {
        let value = line.strip_prefix("title:")?.trim();
        let value = value
            .strip_prefix('"')
            .and_then(|v| v.strip_suffix('"'))
            .or_else(|| value.strip_prefix('\'').and_then(|v| v.strip_suffix('\'')))
            .unwrap_or(value);
        let value = collapse(value);
        (!value.is_empty()).then_some(value)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn md(s: &str) -> Parsed {
        parse("t.md", s.as_bytes(), &Limits::default()).unwrap()
    }

    #[test]
    fn headings_lists_tables_code() {
        let p = md("# Top\n\nIntro *with* `code`\nand a soft break.\n\n## Sub\n\n- one\n- two\n  - nested\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n```\nfn  main() {}\n```\n");
        assert_eq!(
            p.text,
            "Top\n\nIntro with code and a soft break.\n\nSub\n\none\n\ntwo\n\nnested\n\na | b\n\n1 | 2\n\nfn main() {}"
        );
        assert_eq!(p.title.as_deref(), Some("Top"));
        let h: Vec<_> = p
            .headings
            .iter()
            .map(|h| {
                (
                    h.level,
                    h.text.as_str(),
                    &p.text[h.offset..h.offset + h.text.len()],
                )
            })
            .collect();
        assert_eq!(h, [(1, "Top", "Top"), (2, "Sub", "Sub")]);
    }

    #[test]
    fn front_matter_is_metadata() {
        let p = md("---\ntitle: \"Field guide\"\nauthor: x\n---\n\n## Part\n\nBody.\n");
        assert_eq!(p.title.as_deref(), Some("Field guide"));
        assert_eq!(p.text, "Part\n\nBody.");
    }

    #[test]
    fn heading_with_inline_markup() {
        let p = md("Some text\n\n### A *b* `c`\n");
        assert_eq!(p.headings[0].text, "A b c");
        assert_eq!(p.headings[0].level, 3);
        assert_eq!(p.title, None);
    }
}
