//! Normalised text output shared by every format, and the plain-text parser.
//!
//! Every parser feeds a [`TextBuilder`]: it collapses whitespace inside a paragraph, drops control
//! characters, separates paragraphs with one blank line and records where headings and pages
//! fall, so every format yields text of the same shape.

use std::ops::Range;

use crate::error::{ParseError, Result};
use crate::Heading;

/// Accumulates normalised text paragraph by paragraph.
pub(crate) struct TextBuilder<'a> {
    file: &'a str,
    limit: u64,
    text: String,
    para: String,
    space_pending: bool,
    headings: Vec<Heading>,
    heading_level: Option<u8>,
}

/// Separator between paragraphs in [`crate::Parsed::text`].
pub(crate) const PARAGRAPH_BREAK: &str = "\n\n";

impl<'a> TextBuilder<'a> {
    /// A builder that fails once the text grows past `limit` bytes (`Limits::max_text_bytes`).
    pub(crate) fn new(file: &'a str, limit: u64) -> TextBuilder<'a> {
        TextBuilder {
            file,
            limit,
            text: String::new(),
            para: String::new(),
            space_pending: false,
            headings: Vec::new(),
            heading_level: None,
        }
    }

    /// Appends text to the current paragraph: whitespace runs become one space, control and
    /// format characters that carry no text are dropped.
    pub(crate) fn push_str(&mut self, s: &str) -> Result<()> {
        for c in s.chars() {
            if c.is_whitespace() {
                self.space_pending = true;
            } else if !is_dropped(c) {
                if self.space_pending && !self.para.is_empty() {
                    self.para.push(' ');
                }
                self.space_pending = false;
                self.para.push(c);
            }
        }
        self.check_limit()
    }

    /// Separates what follows from what came before by a space (a word boundary).
    pub(crate) fn space(&mut self) {
        self.space_pending = true;
    }

    /// Ends the current paragraph, if it has any text; returns its range in the text.
    pub(crate) fn end_paragraph(&mut self) -> Option<Range<usize>> {
        self.space_pending = false;
        if self.para.is_empty() {
            return None;
        }
        if !self.text.is_empty() {
            self.text.push_str(PARAGRAPH_BREAK);
        }
        let start = self.text.len();
        self.text.push_str(&self.para);
        self.para.clear();
        Some(start..self.text.len())
    }

    /// Starts a heading: the text pushed until [`TextBuilder::end_heading`] is its own paragraph.
    pub(crate) fn begin_heading(&mut self, level: u8) {
        self.end_paragraph();
        self.heading_level = Some(level.clamp(1, 9));
    }

    /// Ends a heading started by [`TextBuilder::begin_heading`] and records it if it has text.
    /// Returns the heading's text.
    pub(crate) fn end_heading(&mut self) -> Option<String> {
        let level = self.heading_level.take()?;
        let range = self.end_paragraph()?;
        let text = self.text[range.clone()].to_owned();
        self.headings.push(Heading {
            level,
            text: text.clone(),
            offset: range.start,
        });
        Some(text)
    }

    /// Whether a heading is open.
    pub(crate) fn in_heading(&self) -> bool {
        self.heading_level.is_some()
    }

    /// Adds a whole heading paragraph.
    pub(crate) fn heading(&mut self, level: u8, text: &str) -> Result<Option<String>> {
        self.begin_heading(level);
        self.push_str(text)?;
        Ok(self.end_heading())
    }

    /// Adds a whole paragraph.
    pub(crate) fn paragraph(&mut self, text: &str) -> Result<()> {
        self.end_paragraph();
        self.push_str(text)?;
        self.end_paragraph();
        Ok(())
    }

    /// Ends the current paragraph and returns a mark for [`TextBuilder::range_since`].
    pub(crate) fn mark(&mut self) -> usize {
        self.end_paragraph();
        self.text.len()
    }

    /// The range of the text added since `mark`, without the paragraph break before it; an empty
    /// range at the end of the text when nothing was added.
    pub(crate) fn range_since(&mut self, mark: usize) -> Range<usize> {
        self.end_paragraph();
        let end = self.text.len();
        if end == mark {
            end..end
        } else if mark == 0 {
            0..end
        } else {
            mark + PARAGRAPH_BREAK.len()..end
        }
    }

    /// Whether no text at all has been added.
    pub(crate) fn is_empty(&self) -> bool {
        self.text.is_empty() && self.para.is_empty()
    }

    /// The text and the headings found in it.
    pub(crate) fn finish(mut self) -> (String, Vec<Heading>) {
        self.end_heading();
        self.end_paragraph();
        (self.text, self.headings)
    }

    fn check_limit(&self) -> Result<()> {
        let size = (self.text.len() + PARAGRAPH_BREAK.len() + self.para.len()) as u64;
        if size > self.limit {
            return Err(ParseError::TooLarge {
                file: self.file.to_owned(),
                what: "the extracted text",
                size,
                limit_name: "max_text_bytes",
                limit: self.limit,
            });
        }
        Ok(())
    }
}

/// Characters that carry no text: C0/C1 controls (whitespace ones are handled before), the byte
/// order mark, and Unicode noncharacters.
fn is_dropped(c: char) -> bool {
    c.is_control() || c == '\u{feff}' || matches!(c, '\u{fffe}' | '\u{ffff}')
}

/// Collapses a short string (a title, a table cell) the way paragraphs are collapsed.
pub(crate) fn collapse(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for word in s.split(char::is_whitespace).filter(|w| !w.is_empty()) {
        let word: String = word.chars().filter(|&c| !is_dropped(c)).collect();
        if word.is_empty() {
            continue;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(&word);
    }
    out
}

/// Plain text: paragraphs are separated by blank lines; the lines of one paragraph are joined.
pub(crate) fn parse_plain(text: &str, out: &mut TextBuilder) -> Result<()> {
    for line in text.split('\n') {
        if line.trim().is_empty() {
            out.end_paragraph();
        } else {
            out.push_str(line)?;
            out.space();
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn build(f: impl FnOnce(&mut TextBuilder) -> Result<()>) -> (String, Vec<Heading>) {
        let mut b = TextBuilder::new("t.txt", 1 << 20);
        f(&mut b).unwrap();
        b.finish()
    }

    #[test]
    fn collapses_whitespace_and_drops_controls() {
        let (text, _) = build(|b| b.push_str("  a \t b\u{7}\u{0}c\r\n  d\u{feff}  "));
        assert_eq!(text, "a bc d");
    }

    #[test]
    fn paragraphs_and_headings() {
        let (text, headings) = build(|b| {
            b.paragraph("first")?;
            b.heading(2, " Title\t here ")?;
            b.paragraph("   ")?;
            b.paragraph("second")
        });
        assert_eq!(text, "first\n\nTitle here\n\nsecond");
        assert_eq!(headings.len(), 1);
        assert_eq!(headings[0].offset, 7);
        assert_eq!(&text[headings[0].offset..][..10], "Title here");
    }

    #[test]
    fn plain_text_blank_lines_split_paragraphs() {
        let (text, _) = build(|b| parse_plain("one\r\ntwo\n \n\n three\n", b));
        assert_eq!(text, "one two\n\nthree");
    }

    #[test]
    fn ranges_skip_the_break() {
        let mut b = TextBuilder::new("t", 100);
        let m = b.mark();
        b.paragraph("aa").unwrap();
        assert_eq!(b.range_since(m), 0..2);
        let m = b.mark();
        assert_eq!(b.range_since(m), 2..2);
        let m = b.mark();
        b.paragraph("bb").unwrap();
        assert_eq!(b.range_since(m), 4..6);
    }

    #[test]
    fn text_limit() {
        let mut b = TextBuilder::new("t.txt", 8);
        let err = b.push_str("0123456789").unwrap_err();
        assert!(err.to_string().contains("max_text_bytes = 8"), "{err}");
    }

    #[test]
    fn collapse_short_strings() {
        assert_eq!(collapse(" a\n\tb \u{1}c "), "a b c");
    }
}
