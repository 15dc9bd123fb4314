//! Reading scanned pages: Tesseract (`tesseract`, Debian's `tesseract-ocr` with the English and
//! simplified Chinese data) on images and on the PDF pages that have no text layer, which
//! poppler's `pdftoppm` renders first. Both run as child processes, fed and read through pipes
//! (no temporary files), one page at a time, each under [`Ocr::page_timeout`]: a page that takes
//! longer, or that a tool fails on, is a per-page failure the caller reports, not a failed
//! document, unless no page gave text.
//!
//! Tesseract writes a line break at every printed line and, with the Chinese model, a space
//! between Han characters; [`tidy`] joins a paragraph's lines again (no space between Han
//! characters, a word broken by a hyphen made whole) before the text goes through the same
//! normaliser as every other format.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The OCR tools and how they are run.
#[derive(Clone, Debug)]
pub struct Ocr {
    pub tesseract: PathBuf,
    pub pdftoppm: PathBuf,
    /// Tesseract's language list, `chi_sim+eng`.
    pub languages: String,
    /// Resolution PDF pages are rendered at, in dots per inch (300: what Tesseract is trained on).
    pub dpi: u32,
    /// Most time one page may take (render and recognition together).
    pub page_timeout: Duration,
}

/// Default [`Ocr::languages`]: simplified Chinese and English, the data the media carry (in
/// this order Chinese lines come back without spaces between characters, English the same).
pub const DEFAULT_LANGUAGES: &str = "chi_sim+eng";

/// How far OCR of one document is, reported after each page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OcrProgress {
    /// Pages read (or failed) so far.
    pub done: usize,
    /// Pages that need OCR in the document.
    pub pages: usize,
}

impl Ocr {
    /// Finds `tesseract` and `pdftoppm` in `PATH` (then `/usr/bin`) and checks that Tesseract has
    /// every language of `languages`; the reason when something is missing.
    pub fn detect(languages: &str, page_timeout: Duration) -> Result<Ocr, String> {
        let tesseract = find_tool("tesseract")
            .ok_or("tesseract not found (Debian: apt install tesseract-ocr)")?;
        let pdftoppm = find_tool("pdftoppm")
            .ok_or("pdftoppm not found (Debian: apt install poppler-utils)")?;
        let out = Command::new(&tesseract)
            .arg("--list-langs")
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("{}: {e}", tesseract.display()))?;
        let listed = String::from_utf8_lossy(&out.stdout);
        let have: Vec<&str> = listed.lines().skip(1).map(str::trim).collect();
        let missing: Vec<&str> = languages.split('+').filter(|l| !have.contains(l)).collect();
        if !missing.is_empty() {
            return Err(format!(
                "tesseract has no data for {} (has: {}; Debian: tesseract-ocr-{})",
                missing.join(", "),
                have.join(", "),
                missing
                    .iter()
                    .map(|l| l.replace('_', "-"))
                    .collect::<Vec<_>>()
                    .join(", tesseract-ocr-")
            ));
        }
        Ok(Ocr {
            tesseract,
            pdftoppm,
            languages: languages.to_string(),
            dpi: 300,
            page_timeout,
        })
    }

    /// One line for the log: "tesseract 5.3.0 (chi_sim+eng), pdftoppm, 120 s a page".
    pub fn describe(&self) -> String {
        let version = Command::new(&self.tesseract)
            .arg("--version")
            .stdin(Stdio::null())
            .output()
            .ok()
            .and_then(|o| {
                let text = String::from_utf8_lossy(&o.stdout).into_owned()
                    + &String::from_utf8_lossy(&o.stderr);
                text.lines().next().map(str::to_string)
            })
            .unwrap_or_else(|| "tesseract".into());
        format!(
            "{version} ({}), pdftoppm at {} dpi, {} s a page",
            self.languages,
            self.dpi,
            self.page_timeout.as_secs()
        )
    }

    /// The text of one image (PNG, JPEG, TIFF, as Tesseract's Leptonica reads them), within the
    /// page time bound.
    pub fn image(&self, bytes: &[u8]) -> Result<String, String> {
        let deadline = Instant::now() + self.page_timeout;
        self.recognise(bytes, deadline)
    }

    /// The text of page `page` (1-based) of the PDF `pdf`: rendered by pdftoppm, then read.
    pub fn pdf_page(&self, pdf: &[u8], page: usize) -> Result<String, String> {
        let deadline = Instant::now() + self.page_timeout;
        let page = page.to_string();
        let dpi = self.dpi.to_string();
        let image = run(
            Command::new(&self.pdftoppm)
                .args(["-f", &page, "-l", &page, "-r", &dpi, "-gray", "-png", "-"]),
            pdf,
            deadline,
            "pdftoppm",
        )?;
        if image.is_empty() {
            return Err("pdftoppm rendered nothing".into());
        }
        self.recognise(&image, deadline)
    }

    fn recognise(&self, image: &[u8], deadline: Instant) -> Result<String, String> {
        let out = run(
            Command::new(&self.tesseract)
                .args(["stdin", "stdout", "-l", &self.languages])
                // One recognition thread: pages of several documents are read side by side by
                // the preparer's threads, and OpenMP's own threads only contend with them.
                .env("OMP_THREAD_LIMIT", "1"),
            image,
            deadline,
            "tesseract",
        )?;
        Ok(tidy(&String::from_utf8_lossy(&out)))
    }
}

fn find_tool(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default()
        .into_iter()
        .chain([PathBuf::from("/usr/bin")])
        .map(|dir| dir.join(name))
        .find(|p| is_executable(p))
}

fn is_executable(p: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    p.metadata()
        .map(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}

/// Runs `cmd` with `input` on its stdin and returns its stdout; killed at `deadline`. stderr is
/// kept for the error message.
fn run(cmd: &mut Command, input: &[u8], deadline: Instant, what: &str) -> Result<Vec<u8>, String> {
    let mut child = cmd
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("{what}: cannot start it ({e})"))?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let mut stdout = child.stdout.take().expect("piped stdout");
    let mut stderr = child.stderr.take().expect("piped stderr");
    let input = input.to_vec();
    // The pipes are drained on threads of their own so that neither side blocks the other.
    let writer = std::thread::spawn(move || {
        // A child that exits early closes its end: the write error is its exit status's to tell.
        let _ = stdin.write_all(&input);
    });
    let reader = std::thread::spawn(move || {
        let mut out = Vec::new();
        let _ = stdout.read_to_end(&mut out);
        out
    });
    let err_reader = std::thread::spawn(move || {
        let mut err = Vec::new();
        let _ = stderr.read_to_end(&mut err);
        err
    });
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                let _ = writer.join();
                let _ = reader.join();
                let _ = err_reader.join();
                return Err(format!("{what} took longer than the page's time limit"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(e) => return Err(format!("{what}: {e}")),
        }
    };
    let _ = writer.join();
    let out = reader.join().unwrap_or_default();
    let err = err_reader.join().unwrap_or_default();
    if !status.success() {
        let err = String::from_utf8_lossy(&err);
        let last = err.lines().rfind(|l| !l.trim().is_empty()).unwrap_or("");
        return Err(format!("{what} failed ({status}): {last}"));
    }
    Ok(out)
}

fn is_han(c: char) -> bool {
    matches!(c,
        '\u{3400}'..='\u{4dbf}' | '\u{4e00}'..='\u{9fff}' | '\u{f900}'..='\u{faff}'
        | '\u{20000}'..='\u{2fa1f}')
}

/// CJK punctuation and full-width forms, which take no space around them either.
fn is_cjk_punct(c: char) -> bool {
    matches!(c, '\u{3000}'..='\u{303f}' | '\u{ff00}'..='\u{ffef}')
}

fn cjk(c: char) -> bool {
    is_han(c) || is_cjk_punct(c)
}

/// Tesseract's text as paragraphs: the lines of a paragraph joined (no space where both sides
/// are Chinese, a hyphen at a line's end before a lower-case letter removed), spaces between
/// Han characters removed, paragraphs separated by a blank line.
pub fn tidy(raw: &str) -> String {
    let mut paragraphs: Vec<String> = Vec::new();
    let mut current = String::new();
    for line in raw.lines().map(str::trim) {
        if line.is_empty() {
            if !current.is_empty() {
                paragraphs.push(std::mem::take(&mut current));
            }
            continue;
        }
        let line = close_cjk_gaps(line);
        if current.is_empty() {
            current = line;
            continue;
        }
        let last = current.chars().next_back().unwrap_or(' ');
        let first = line.chars().next().unwrap_or(' ');
        if last == '-' && first.is_lowercase() {
            current.pop();
        } else if !(cjk(last) && cjk(first)) {
            current.push(' ');
        }
        current.push_str(&line);
    }
    if !current.is_empty() {
        paragraphs.push(current);
    }
    paragraphs.join("\n\n")
}

/// Removes the spaces Tesseract puts between Chinese characters (and before or after CJK
/// punctuation), keeping those between words of other scripts.
fn close_cjk_gaps(line: &str) -> String {
    let chars: Vec<char> = line.chars().collect();
    let mut out = String::with_capacity(line.len());
    for (i, &c) in chars.iter().enumerate() {
        if c == ' ' {
            let before = chars[..i].iter().rev().find(|c| **c != ' ');
            let after = chars[i + 1..].iter().find(|c| **c != ' ');
            if let (Some(&b), Some(&a)) = (before, after) {
                if (is_han(b) && is_han(a)) || is_cjk_punct(a) || is_cjk_punct(b) {
                    continue;
                }
            }
            if out.ends_with(' ') {
                continue;
            }
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tidy_joins_lines_and_closes_han_gaps() {
        let raw = "泵 站 每 周 检 查 一 次 ，\n压 力 保 持 在 4 bar 。\n\nThe pump station is in-\nspected every week.\n";
        assert_eq!(
            tidy(raw),
            "泵站每周检查一次，压力保持在 4 bar。\n\nThe pump station is inspected every week."
        );
        assert_eq!(tidy("Line one\nline two\n\n\n"), "Line one line two");
        assert_eq!(tidy(""), "");
    }
}
