//! HTML to text: what a reader sees, without scripts, styles or navigation; headings kept.
//!
//! A WHATWG tokenizer (html5gum) rather than a DOM: text extraction only needs to know which
//! element each piece of text sits in, and a tree builder would bring a much larger dependency.

use html5gum::{DefaultEmitter, Token, Tokenizer};

use crate::error::Result;
use crate::text::{collapse, TextBuilder};
use crate::{encoding, Format, Limits, Parsed};

/// Elements whose content is not document text: code, styling, embedded objects, and the
/// site's navigation that repeats on every page of a crawl.
const SKIPPED: &[&[u8]] = &[
    b"script",
    b"style",
    b"noscript",
    b"template",
    b"nav",
    b"svg",
    b"math",
    b"iframe",
    b"object",
    b"canvas",
    b"select",
];

/// Elements that start a new paragraph where they open and close.
const BLOCKS: &[&[u8]] = &[
    b"address",
    b"article",
    b"aside",
    b"blockquote",
    b"body",
    b"br",
    b"caption",
    b"center",
    b"dd",
    b"details",
    b"dialog",
    b"div",
    b"dl",
    b"dt",
    b"fieldset",
    b"figcaption",
    b"figure",
    b"footer",
    b"form",
    b"header",
    b"hr",
    b"html",
    b"legend",
    b"li",
    b"main",
    b"ol",
    b"p",
    b"pre",
    b"section",
    b"summary",
    b"table",
    b"tbody",
    b"tfoot",
    b"thead",
    b"tr",
    b"ul",
];

pub(crate) fn parse(file: &str, bytes: &[u8], limits: &Limits) -> Result<Parsed> {
    let decoded = encoding::decode(file, bytes, encoding::html_meta_charset(bytes))?;
    let mut out = TextBuilder::new(file, limits.max_text_bytes);
    let mut title_text: Option<String> = None;
    let mut in_title = false;
    let mut first_h1: Option<String> = None;
    let mut heading: Option<u8> = None;
    // Names of the skipped elements we are inside, innermost last.
    let mut skipping: Vec<Vec<u8>> = Vec::new();
    let mut cells_in_row = 0usize;

    let mut emitter = DefaultEmitter::default();
    // Switches to the raw-text states after <script>, <style>, <title>...: without it a `<` in
    // a script would be read as a tag.
    emitter.naively_switch_states(true);
    for token in Tokenizer::new_with_emitter(decoded.text.as_str(), emitter) {
        let token: Token = match token {
            Ok(token) => token,
            Err(never) => match never {},
        };
        match token {
            Token::StartTag(tag) => {
                let name = tag.name.as_slice();
                // The document's <title>: the first one outside skipped elements (an <svg> has
                // titles of its own); later ones are not text either.
                if name == b"title" && !tag.self_closing {
                    if skipping.is_empty() && title_text.is_none() {
                        in_title = true;
                        title_text = Some(String::new());
                    } else {
                        skipping.push(name.to_vec());
                    }
                    continue;
                }
                if SKIPPED.contains(&name) {
                    if !tag.self_closing {
                        skipping.push(name.to_vec());
                    }
                    continue;
                }
                if !skipping.is_empty() {
                    continue;
                }
                if let Some(level) = heading_level(name) {
                    if heading.is_none() {
                        heading = Some(level);
                        out.begin_heading(level);
                    }
                } else if name == b"td" || name == b"th" {
                    if cells_in_row > 0 {
                        out.space();
                        out.push_str("|")?;
                        out.space();
                    }
                    cells_in_row += 1;
                } else if BLOCKS.contains(&name) {
                    if name == b"tr" {
                        cells_in_row = 0;
                    }
                    block_break(&mut out);
                } else if name == b"img" {
                    out.space();
                }
            }
            Token::EndTag(tag) => {
                let name = tag.name.as_slice();
                if name == b"title" && in_title {
                    in_title = false;
                    continue;
                }
                if let Some(pos) = skipping.iter().rposition(|n| n == name) {
                    skipping.truncate(pos);
                    continue;
                }
                if !skipping.is_empty() {
                    continue;
                }
                if heading_level(name).is_some() {
                    if let Some(level) = heading.take() {
                        if let Some(text) = out.end_heading() {
                            if level == 1 && first_h1.is_none() {
                                first_h1 = Some(text);
                            }
                        }
                    }
                } else if name == b"td" || name == b"th" {
                    out.space();
                } else if BLOCKS.contains(&name) {
                    block_break(&mut out);
                }
            }
            Token::String(s) => {
                let s = String::from_utf8_lossy(&s.value);
                if in_title {
                    if let Some(t) = title_text.as_mut() {
                        t.push_str(&s);
                    }
                } else if skipping.is_empty() {
                    out.push_str(&s)?;
                }
            }
            Token::Comment(_) | Token::Doctype(_) | Token::Error(_) => {}
        }
    }
    let (text, headings) = out.finish();
    let title = title_text
        .map(|t| collapse(&t))
        .filter(|t| !t.is_empty())
        .or(first_h1);
    Ok(Parsed {
        text,
        format: Format::Html,
        title,
        pages: Vec::new(),
        headings,
        ocr_pages: Vec::new(),
        ocr_failures: Vec::new(),
        encoding: decoded.encoding,
    })
}

/// A block boundary; inside a heading (`<h2><div>a</div>b</h2>`) only a word break, so the
/// heading stays one paragraph.
fn block_break(out: &mut TextBuilder) {
    if out.in_heading() {
        out.space();
    } else {
        out.end_paragraph();
    }
}

fn heading_level(name: &[u8]) -> Option<u8> {
    match name {
        [b'h', d @ b'1'..=b'6'] => Some(d - b'0'),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn html(s: &str) -> Parsed {
        parse("t.html", s.as_bytes(), &Limits::default()).unwrap()
    }

    #[test]
    fn drops_scripts_styles_and_nav() {
        let p = html(
            "<!doctype html><html><head><title> A  page </title><style>p{color:red}</style>\
             <script>if (a < b) { document.write('<p>no</p>') }</script></head>\
             <body><nav><a href=/>Home</a></nav><h1>Big <em>news</em></h1><p>First&nbsp;para &amp; more.</p>\
             <div>Second<br>line</div><noscript>enable js</noscript></body></html>",
        );
        assert_eq!(p.text, "Big news\n\nFirst para & more.\n\nSecond\n\nline");
        assert_eq!(p.title.as_deref(), Some("A page"));
        assert_eq!(
            p.headings,
            [crate::Heading {
                level: 1,
                text: "Big news".into(),
                offset: 0
            }]
        );
    }

    #[test]
    fn tables_become_rows() {
        let p = html("<table><tr><th>Part</th><th>Interval</th></tr><tr><td>Valve</td><td>12 months</td></tr></table>");
        assert_eq!(p.text, "Part | Interval\n\nValve | 12 months");
    }

    #[test]
    fn unclosed_and_nested_headings() {
        let p = html("<h2>One<div>two</div></h2><p>x<h3>Three");
        assert_eq!(p.text, "One two\n\nx\n\nThree");
        assert_eq!(
            p.headings.iter().map(|h| h.level).collect::<Vec<_>>(),
            [2, 3]
        );
        assert_eq!(p.title, None);
    }

    #[test]
    fn first_h1_is_the_title_without_title_tag() {
        assert_eq!(
            html("<h1>Manual</h1><p>x</p>").title.as_deref(),
            Some("Manual")
        );
        let p = html(
            "<svg><title>icon</title></svg><h1>Manual</h1><title>Real</title><title>Second</title>",
        );
        assert_eq!(p.title.as_deref(), Some("Real"));
        assert_eq!(p.text, "Manual");
    }
}
