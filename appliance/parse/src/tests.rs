//! End-to-end tests on real files of every format (`tests/fixtures/`, see its README) and a
//! property test that no input makes [`parse`] panic.

use std::io::Write;
use std::ops::Range;

use proptest::prelude::*;

use crate::{
    detect_format, parse, parse_with, Format, Limits, Ocr, OcrProgress, ParseError, Parsed,
};

macro_rules! fixture {
    ($name:literal) => {
        (
            $name,
            include_bytes!(concat!("../tests/fixtures/", $name)) as &[u8],
        )
    };
}

const FIXTURES: &[(&str, &[u8])] = &[
    fixture!("english-2pages.pdf"),
    fixture!("unicode-font.pdf"),
    fixture!("scanned.pdf"),
    fixture!("mixed.pdf"),
    fixture!("scan-en.png"),
    fixture!("scan-en.jpg"),
    fixture!("scan-zh.png"),
    fixture!("scan-zh.tiff"),
    fixture!("report.docx"),
    fixture!("chinese.docx"),
    fixture!("bomb-lying-header.docx"),
    fixture!("page.html"),
    fixture!("chinese.html"),
    fixture!("gbk-meta.html"),
    fixture!("guide.md"),
    fixture!("chinese.md"),
    fixture!("gbk.txt"),
    fixture!("shift_jis.txt"),
    fixture!("utf16le-bom.txt"),
    fixture!("utf16be-bom.txt"),
];

fn load(name: &str) -> &'static [u8] {
    FIXTURES
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, b)| *b)
        .unwrap()
}

fn ok(name: &str) -> Parsed {
    match parse(name, load(name), &Limits::default()) {
        Ok(p) => {
            check_invariants(&p);
            p
        }
        Err(e) => panic!("{name}: {e}"),
    }
}

/// What every successful parse promises.
fn check_invariants(p: &Parsed) {
    assert!(!p.text.is_empty());
    assert!(!p.text.contains("\n\n\n"), "{:?}", p.text);
    for para in p.text.split("\n\n") {
        assert!(!para.is_empty() && para.trim() == para, "{para:?}");
        assert!(
            !para.contains("  ") && !para.contains('\n') && !para.contains('\t'),
            "{para:?}"
        );
        assert!(!para.chars().any(char::is_control), "{para:?}");
    }
    for h in &p.headings {
        assert_eq!(
            p.text.get(h.offset..h.offset + h.text.len()),
            Some(h.text.as_str()),
            "{h:?}"
        );
        assert!(h.level >= 1);
    }
    let mut end = 0;
    for page in &p.pages {
        assert!(
            page.start >= end && page.end >= page.start && page.end <= p.text.len(),
            "{:?}",
            p.pages
        );
        assert!(p.text.is_char_boundary(page.start) && p.text.is_char_boundary(page.end));
        end = page.end;
    }
}

fn headings(p: &Parsed) -> Vec<(u8, &str)> {
    p.headings
        .iter()
        .map(|h| (h.level, h.text.as_str()))
        .collect()
}

#[test]
fn pdf_two_pages() {
    let p = ok("english-2pages.pdf");
    assert_eq!(p.format, Format::Pdf);
    assert_eq!(p.title.as_deref(), Some("Quarterly Maintenance Report"));
    assert_eq!(p.pages.len(), 2);
    let page1 = &p.text[p.pages[0].clone()];
    let page2 = &p.text[p.pages[1].clone()];
    assert!(
        page1.contains("Page one: the pump station was inspected on Monday."),
        "{page1:?}"
    );
    assert!(page1.contains("pressure held at 4 bar."), "{page1:?}");
    assert_eq!(page2, "Page two: the next inspection is due in March.");
    assert_eq!(p.encoding, "UTF-8");
}

#[test]
fn pdf_embedded_font_to_unicode() {
    let p = ok("unicode-font.pdf");
    assert_eq!(p.text, "Café crème, naïve façade; Grüße aus Köln.");
    assert_eq!(
        p.pages,
        vec![Range {
            start: 0,
            end: p.text.len()
        }]
    );
}

#[test]
fn scanned_pdf_needs_ocr() {
    let err = parse("scan.pdf", load("scanned.pdf"), &Limits::default()).unwrap_err();
    assert!(
        matches!(err, ParseError::NoTextLayer { pages: 2, .. }),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains(
            "scan.pdf: no text layer on any of 2 pages (scanned PDF?) and OCR is off here"
        ),
        "{msg}"
    );
}

#[test]
fn pdf_page_limit() {
    let limits = Limits {
        max_pages: 1,
        ..Limits::default()
    };
    let err = parse("a.pdf", load("english-2pages.pdf"), &limits).unwrap_err();
    assert!(err.to_string().contains("max_pages = 1"), "{err}");
}

#[test]
fn docx_headings_paragraphs_table() {
    let p = ok("report.docx");
    assert_eq!(p.format, Format::Docx);
    assert_eq!(p.title.as_deref(), Some("Pump Station Handbook"));
    assert_eq!(
        p.text,
        "Pump Station Handbook\n\nSafety\n\nClose the inlet valve before opening the housing.\n\nPressure limits\n\n\
         Normal pressure is 4 bar; alarms trigger at 6 bar.\n\nPart | Interval\n\nValve | 12 months\n\nSeal | 6 months\n\n\
         Contact the duty engineer for anything else."
    );
    assert_eq!(
        headings(&p),
        [
            (1, "Pump Station Handbook"),
            (1, "Safety"),
            (2, "Pressure limits")
        ]
    );
}

#[test]
fn docx_chinese() {
    let p = ok("chinese.docx");
    assert_eq!(p.title.as_deref(), Some("泵站手册"));
    assert_eq!(p.text, "安全须知\n\n打开外壳之前，请先关闭进水阀。\n\n压力范围\n\n正常压力为四巴，超过六巴时报警。");
    assert_eq!(headings(&p), [(1, "安全须知"), (2, "压力范围")]);
}

#[test]
fn docx_lying_header_bomb() {
    let err = parse(
        "bomb.docx",
        load("bomb-lying-header.docx"),
        &Limits::default(),
    )
    .unwrap_err();
    // The header claims 1000 bytes; the zip reader stops at the claimed size (and our capped
    // reader would stop at the limits if it did not).
    assert!(
        matches!(
            err,
            ParseError::Malformed {
                format: Format::Docx,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("word/document.xml") && msg.contains("declared") && msg.contains("zip bomb"),
        "{msg}"
    );
}

/// A DOCX-shaped zip with the given members, deflated.
fn zip(members: &[(&str, &[u8])]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(std::io::Cursor::new(Vec::new()));
    let options = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    for (name, data) in members {
        w.start_file(*name, options).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

#[test]
fn docx_honest_bomb_is_refused_by_declared_size() {
    let zeros = vec![b' '; 64 << 20];
    let bytes = zip(&[("word/document.xml", &zeros)]);
    assert!(bytes.len() < 1 << 20);
    let err = parse("bomb.docx", &bytes, &Limits::default()).unwrap_err();
    assert!(
        matches!(
            err,
            ParseError::ArchiveLimit {
                limit_name: "max_compression_ratio",
                ..
            }
        ),
        "{err:?}"
    );
    let limits = Limits {
        max_entry_bytes: 1 << 20,
        ..Limits::default()
    };
    let err = parse("bomb.docx", &bytes, &limits).unwrap_err();
    assert!(
        matches!(
            err,
            ParseError::ArchiveLimit {
                limit_name: "max_entry_bytes",
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn docx_entry_count() {
    let names: Vec<String> = (0..20).map(|i| format!("word/media/{i}.bin")).collect();
    let mut members: Vec<(&str, &[u8])> = names.iter().map(|n| (n.as_str(), &b"x"[..])).collect();
    members.push(("word/document.xml", b"<w:document/>"));
    let limits = Limits {
        max_archive_entries: 10,
        ..Limits::default()
    };
    let err = parse("many.docx", &zip(&members), &limits).unwrap_err();
    assert!(
        err.to_string().contains("has 21 members")
            && err.to_string().contains("max_archive_entries = 10"),
        "{err}"
    );
}

#[test]
fn docx_malformed() {
    let err = parse("x.docx", b"PK\x03\x04 not really", &Limits::default()).unwrap_err();
    assert!(
        matches!(
            err,
            ParseError::Malformed {
                format: Format::Docx,
                ..
            }
        ),
        "{err:?}"
    );
    let bytes = zip(&[(
        "word/document.xml",
        b"<w:document><w:body><w:p><w:t>a</w:x></w:body>",
    )]);
    let err = parse("x.docx", &bytes, &Limits::default()).unwrap_err();
    assert!(
        err.to_string()
            .contains("malformed Docx file: word/document.xml"),
        "{err}"
    );
    let err = parse("x.docx", &zip(&[("a.txt", b"hi")]), &Limits::default()).unwrap_err();
    assert!(err.to_string().contains("not a Word document"), "{err}");
}

#[test]
fn html_page() {
    let p = ok("page.html");
    assert_eq!(p.title.as_deref(), Some("Pump Station | Maintenance"));
    assert_eq!(
        p.text,
        "Pump station maintenance\n\nInspect the pumps every Monday; log the pressure & flow.\n\nValves\n\n\
         Inlet valve: replace every 12 months.\n\nOutlet valve: grease monthly.\n\nPart | Interval\n\nSeal | 6 months"
    );
    assert_eq!(
        headings(&p),
        [(1, "Pump station maintenance"), (2, "Valves")]
    );
}

#[test]
fn html_chinese_and_meta_charset() {
    let p = ok("chinese.html");
    assert_eq!(
        p.text,
        "泵站维护\n\n每周一检查水泵，并记录压力和流量。\n\n阀门\n\n进水阀每十二个月更换一次。"
    );
    let p = ok("gbk-meta.html");
    assert_eq!(p.encoding, "GBK");
    assert_eq!(p.title.as_deref(), Some("泵站通知"));
    assert_eq!(p.text, "停水通知\n\n明天上午九点到十一点停水检修。");
}

#[test]
fn markdown_files() {
    let p = ok("guide.md");
    assert_eq!(p.title.as_deref(), Some("Pump Station Guide"));
    assert_eq!(
        headings(&p),
        [(1, "Pump Station Guide"), (2, "Valves"), (2, "Contacts")]
    );
    assert!(p.text.contains("\n\nThe pump station supplies the east district. Check it every Monday and write the readings down.\n\n"));
    assert!(p
        .text
        .contains("\n\nPart | Interval\n\nSeal | 6 months\n\n"));
    let p = ok("chinese.md");
    assert_eq!(p.text, "泵站指南\n\n泵站为东区供水。每周一检查， 并记录读数。\n\n阀门\n\n进水阀每十二个月更换一次。");
}

#[test]
fn legacy_and_utf16_text() {
    let p = ok("gbk.txt");
    assert_eq!(p.encoding, "GBK");
    assert_eq!(
        p.text,
        "泵站维护记录\n\n今天检查了所有阀门，压力保持在四巴。 下次检查定于三月。"
    );
    let p = ok("shift_jis.txt");
    assert_eq!(p.encoding, "Shift_JIS");
    assert!(p.text.starts_with("東京都の天気予報です。"), "{}", p.text);
    for (name, encoding) in [
        ("utf16le-bom.txt", "UTF-16LE"),
        ("utf16be-bom.txt", "UTF-16BE"),
    ] {
        let p = ok(name);
        assert_eq!(p.encoding, encoding);
        assert_eq!(
            p.text,
            "UTF-16 file: café, naïve, 東京.\n\nSecond paragraph."
        );
    }
}

#[test]
fn binary_text_is_refused() {
    let err = parse(
        "photo.txt",
        &[0xff, 0xd8, 0xff, 0xe0, 0, 0x10, b'J', b'F', b'I', b'F'],
        &Limits::default(),
    )
    .unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.starts_with("photo.txt: cannot decode the text as binary"),
        "{msg}"
    );
}

#[test]
fn limits_and_empty() {
    let limits = Limits {
        max_input_bytes: 10,
        ..Limits::default()
    };
    let err = parse("a.txt", b"hello world!", &limits).unwrap_err();
    assert_eq!(err.error_type(), "too_large");
    assert!(err.to_string().contains("max_input_bytes = 10"), "{err}");
    let limits = Limits {
        max_text_bytes: 100,
        ..Limits::default()
    };
    let err = parse("a.md", "word ".repeat(100).as_bytes(), &limits).unwrap_err();
    assert!(err.to_string().contains("max_text_bytes = 100"), "{err}");
    let err = parse("a.html", b"<script>x</script>  ", &Limits::default()).unwrap_err();
    assert!(
        matches!(
            err,
            ParseError::Empty {
                format: Format::Html,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn format_detection() {
    assert_eq!(detect_format("A.PDF", b"").unwrap(), Format::Pdf);
    assert_eq!(
        detect_format("notes.Markdown", b"").unwrap(),
        Format::Markdown
    );
    assert_eq!(
        detect_format("upload", load("english-2pages.pdf")).unwrap(),
        Format::Pdf
    );
    assert_eq!(
        detect_format("upload", load("report.docx")).unwrap(),
        Format::Docx
    );
    assert_eq!(
        detect_format("upload", b"\n<!DOCTYPE html><p>x").unwrap(),
        Format::Html
    );
    assert_eq!(
        detect_format("README", b"plain words").unwrap(),
        Format::Text
    );
    assert_eq!(
        detect_format("u16", load("utf16le-bom.txt")).unwrap(),
        Format::Text
    );
    let err = detect_format("old.doc", b"").unwrap_err();
    assert!(err.to_string().contains("save it as .docx"), "{err}");
    // Pictures are images (read by OCR when it is on), whatever the name says.
    assert_eq!(
        detect_format("x.png", b"\x89PNG\r\n\x1a\n\0\0").unwrap(),
        Format::Image
    );
    assert_eq!(
        detect_format("x.bin", b"\xff\xd8\xff\xe0").unwrap(),
        Format::Image
    );
    assert!(detect_format("x.gif", b"GIF89a\0\0").is_err());
    assert!(detect_format("x.zip", &zip(&[("a", b"b")])).is_err());
}

/// Random cases per property; raise with ENGRAM_PARSE_FUZZ_CASES for a longer run.
fn fuzz_cases() -> u32 {
    std::env::var("ENGRAM_PARSE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48)
}

const EXTENSIONS: &[&str] = &["txt", "md", "html", "pdf", "docx", "bin"];

proptest! {
    #![proptest_config(ProptestConfig { cases: fuzz_cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// Random bytes under every extension: an error or a well-formed result, never a panic.
    #[test]
    fn random_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..2048), ext in 0..EXTENSIONS.len()) {
        let name = format!("fuzz.{}", EXTENSIONS[ext]);
        if let Ok(p) = parse(&name, &bytes, &Limits::default()) {
            check_invariants(&p);
        }
    }

    /// Real files cut short and with bytes overwritten, under their own extension.
    #[test]
    fn damaged_fixtures_never_panic(
        index in 0..FIXTURES.len(),
        cut in 0.0f64..=1.0,
        edits in proptest::collection::vec((0.0f64..1.0, any::<u8>()), 0..8),
    ) {
        let (name, original) = FIXTURES[index];
        let mut bytes = original[..(original.len() as f64 * cut) as usize].to_vec();
        for (at, byte) in edits {
            if !bytes.is_empty() {
                let i = ((bytes.len() as f64 * at) as usize).min(bytes.len() - 1);
                bytes[i] = byte;
            }
        }
        if let Ok(p) = parse(name, &bytes, &Limits::default()) {
            check_invariants(&p);
        }
    }

    /// Whole real files with a few bytes overwritten, or a run of bytes repeated: the file's
    /// structure mostly survives, so the damage reaches the format's inner parsers.
    #[test]
    fn mutated_fixtures_never_panic(
        index in 0..FIXTURES.len(),
        edits in proptest::collection::vec((0.0f64..1.0, any::<u8>()), 1..16),
        repeat in proptest::option::of((0.0f64..1.0, 1usize..64, 1usize..8)),
    ) {
        let (name, original) = FIXTURES[index];
        let mut bytes = original.to_vec();
        for (at, byte) in edits {
            let i = ((bytes.len() as f64 * at) as usize).min(bytes.len() - 1);
            bytes[i] = byte;
        }
        if let Some((at, len, times)) = repeat {
            let i = ((bytes.len() as f64 * at) as usize).min(bytes.len() - 1);
            let run = bytes[i..(i + len).min(bytes.len())].to_vec();
            for _ in 0..times {
                bytes.splice(i..i, run.iter().copied());
            }
        }
        if let Ok(p) = parse(name, &bytes, &Limits::default()) {
            check_invariants(&p);
        }
    }
}

/// The OCR tools, or `None` where they are not installed; `ENGRAM_REQUIRE_OCR=1` (CI) makes
/// their absence a failure.
fn ocr() -> Option<Ocr> {
    match Ocr::detect(
        crate::DEFAULT_OCR_LANGUAGES,
        std::time::Duration::from_secs(60),
    ) {
        Ok(o) => Some(o),
        Err(why) => {
            assert!(
                std::env::var_os("ENGRAM_REQUIRE_OCR").is_none(),
                "ENGRAM_REQUIRE_OCR is set but {why}"
            );
            eprintln!("skipped: {why}");
            None
        }
    }
}

fn ocr_parse(name: &str, ocr: &Ocr) -> (Parsed, Vec<OcrProgress>) {
    let mut heard = Vec::new();
    let p = parse_with(name, load(name), &Limits::default(), Some(ocr), &mut |p| {
        heard.push(p)
    })
    .unwrap_or_else(|e| panic!("{name}: {e}"));
    check_invariants(&p);
    (p, heard)
}

#[test]
fn images_need_ocr_and_say_so() {
    for name in ["scan-en.png", "scan-en.jpg", "scan-zh.tiff"] {
        assert_eq!(detect_format(name, load(name)).unwrap(), Format::Image);
        // By content alone, too.
        assert_eq!(detect_format("upload", load(name)).unwrap(), Format::Image);
        let err = parse(name, load(name), &Limits::default()).unwrap_err();
        assert!(matches!(err, ParseError::NeedsOcr { .. }), "{err:?}");
        assert_eq!(err.error_type(), "needs_ocr");
        assert!(
            err.to_string().contains("needs OCR, which is off here"),
            "{err}"
        );
    }
}

/// Scanned English and Chinese, as PNG, JPEG and TIFF: the sentences come back, Chinese
/// without spaces between its characters.
#[test]
fn ocr_reads_images_in_english_and_chinese() {
    let Some(ocr) = ocr() else { return };
    for name in ["scan-en.png", "scan-en.jpg"] {
        let (p, heard) = ocr_parse(name, &ocr);
        assert_eq!(p.format, Format::Image);
        assert_eq!(p.ocr_pages, [1]);
        assert_eq!(heard, [OcrProgress { done: 1, pages: 1 }]);
        for line in [
            "Close the inlet valve before opening the housing.",
            "Normal pressure is 4 bar; the alarm sounds at 6 bar.",
            "Replace the seals every six months and log the date.",
        ] {
            assert!(
                p.text.contains(line),
                "{name}: {line:?} not in {:?}",
                p.text
            );
        }
    }
    for name in ["scan-zh.png", "scan-zh.tiff"] {
        let (p, _) = ocr_parse(name, &ocr);
        for line in [
            "打开外壳之前，请先关闭进水阀。",
            "密封件每六个月更换一次，并记录日期。",
        ] {
            assert!(
                p.text.contains(line),
                "{name}: {line:?} not in {:?}",
                p.text
            );
        }
    }
}

/// A PDF with a text layer on page 1 and a scan on page 2 gets both, each in its page's range;
/// OCR reads only the scanned page.
#[test]
fn ocr_reads_the_scanned_pages_of_a_mixed_pdf() {
    let Some(ocr) = ocr() else { return };
    let (p, heard) = ocr_parse("mixed.pdf", &ocr);
    assert_eq!(p.format, Format::Pdf);
    assert_eq!(p.ocr_pages, [2]);
    assert!(p.ocr_failures.is_empty(), "{:?}", p.ocr_failures);
    assert_eq!(heard, [OcrProgress { done: 1, pages: 1 }]);
    assert_eq!(p.pages.len(), 2);
    let page = |i: usize| &p.text[p.pages[i].clone()];
    assert!(
        page(0).contains("Page one has a text layer"),
        "{:?}",
        page(0)
    );
    assert!(
        page(1).contains("Close the inlet valve before opening the housing."),
        "{:?}",
        page(1)
    );
    // Without OCR the text layer alone.
    let plain = ok("mixed.pdf");
    assert!(plain.pages[1].is_empty() && plain.ocr_pages.is_empty());
}

/// A page over the time limit is a per-page failure with its reason; a document none of whose
/// pages gave text is an error naming the first.
#[test]
fn ocr_failures_are_per_page_and_clear() {
    let Some(mut ocr) = ocr() else { return };
    ocr.page_timeout = std::time::Duration::from_millis(1);
    let (p, _) = ocr_parse("mixed.pdf", &ocr);
    assert_eq!(p.ocr_failures.len(), 1, "{:?}", p.ocr_failures);
    assert!(
        p.ocr_failures[0].starts_with("page 2: ") && p.ocr_failures[0].contains("time limit"),
        "{:?}",
        p.ocr_failures
    );
    assert!(p.text.contains("Page one has a text layer"));
    // What OCR's failure says about a whole document.
    let failure = |name: &str, bytes: &[u8], ocr: &Ocr| -> String {
        let err = parse_with(name, bytes, &Limits::default(), Some(ocr), &mut |_| {}).unwrap_err();
        assert!(matches!(err, ParseError::OcrFailed { .. }), "{err:?}");
        err.to_string()
    };
    let err = failure("scan.pdf", load("scanned.pdf"), &ocr);
    assert!(err.contains("none of 2 pages gave text (page 1: "), "{err}");
    // A broken image is a clear failure too.
    let err = failure(
        "broken.png",
        b"\x89PNG\r\n\x1a\nnot really",
        &self::ocr().unwrap(),
    );
    assert!(
        err.starts_with("broken.png: OCR found no text: tesseract failed"),
        "{err}"
    );
}
