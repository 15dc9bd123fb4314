//! Bytes to text: BOMs, UTF-8, a declared charset, or a confident guess; binary is refused.

use chardetng::{EncodingDetector, Iso2022JpDetection, Utf8Detection};
use encoding_rs::{Encoding, UTF_16BE, UTF_16LE, UTF_8};

use crate::error::{ParseError, Result};

/// Largest share of control bytes (other than tab, line feed, form feed, carriage return and
/// escape) a text file may hold before it is taken for binary. Real text has none, but old files
/// carry the odd stray DOS end-of-file or vertical tab; binary data has them everywhere.
const MAX_CONTROL_SHARE: f64 = 0.01;

/// Text decoded from a file and the name of the encoding it was in.
#[derive(Debug)]
pub(crate) struct Decoded {
    pub text: String,
    pub encoding: &'static str,
}

/// Decodes a text file. In order: a byte order mark (UTF-8, UTF-16LE, UTF-16BE); valid UTF-8; the
/// encoding the document declares (`declared`, e.g. HTML `<meta charset>`); an encoding guessed
/// from the bytes, accepted only when the bytes decode in it without error.
pub(crate) fn decode(
    file: &str,
    bytes: &[u8],
    declared: Option<&'static Encoding>,
) -> Result<Decoded> {
    if let Some((encoding, bom_len)) = Encoding::for_bom(bytes) {
        let body = &bytes[bom_len..];
        let text = strict(encoding, body).ok_or_else(|| ParseError::Encoding {
            file: file.to_owned(),
            detected: format!("{} (byte order mark)", encoding.name()),
            reason: format!(
                "the file starts with a {} byte order mark but the rest is not valid {}",
                encoding.name(),
                encoding.name()
            ),
        })?;
        if let Some(at) = text.find('\0') {
            return Err(binary(
                file,
                format!(
                    "{} text holding a NUL character at character {}",
                    encoding.name(),
                    text[..at].chars().count()
                ),
            ));
        }
        return Ok(Decoded {
            text,
            encoding: encoding.name(),
        });
    }

    if let Some(at) = memchr_nul(bytes) {
        return Err(binary(file, format!("a NUL byte at offset {at}; UTF-16 without a byte order mark is not supported either")));
    }
    let controls = bytes.iter().filter(|&&b| is_binary_control(b)).count();
    if controls as f64 > bytes.len() as f64 * MAX_CONTROL_SHARE {
        return Err(binary(
            file,
            format!("{controls} control bytes in {} bytes", bytes.len()),
        ));
    }

    if let Ok(text) = std::str::from_utf8(bytes) {
        return Ok(Decoded {
            text: text.to_owned(),
            encoding: UTF_8.name(),
        });
    }

    // HTML declares UTF-16 for documents that are in fact ASCII-compatible (the spec says to read
    // them as UTF-8), and the bytes are not valid UTF-8 here, so such a label says nothing.
    if let Some(encoding) = declared.filter(|e| *e != UTF_16LE && *e != UTF_16BE && *e != UTF_8) {
        if let Some(text) = strict(encoding, bytes) {
            return Ok(Decoded {
                text,
                encoding: encoding.name(),
            });
        }
    }

    let mut detector = EncodingDetector::new(Iso2022JpDetection::Deny);
    detector.feed(bytes, true);
    let guess = detector.guess(None, Utf8Detection::Deny);
    match strict(guess, bytes) {
        Some(text) => Ok(Decoded { text, encoding: guess.name() }),
        None => Err(ParseError::Encoding {
            file: file.to_owned(),
            detected: match declared {
                Some(d) => format!("{} (declared), {} (guessed)", d.name(), guess.name()),
                None => format!("{} (guessed)", guess.name()),
            },
            reason: "the bytes are not valid UTF-8 and have invalid sequences in the best guess too, so the guess is not trusted".to_owned(),
        }),
    }
}

/// Decodes without replacement: `None` on any malformed sequence.
fn strict(encoding: &'static Encoding, bytes: &[u8]) -> Option<String> {
    encoding
        .decode_without_bom_handling_and_without_replacement(bytes)
        .map(|cow| cow.into_owned())
}

fn is_binary_control(b: u8) -> bool {
    matches!(b, 0x01..=0x08 | 0x0b | 0x0e..=0x1a | 0x1c..=0x1f | 0x7f)
}

fn memchr_nul(bytes: &[u8]) -> Option<usize> {
    bytes.iter().position(|&b| b == 0)
}

fn binary(file: &str, reason: String) -> ParseError {
    ParseError::Encoding {
        file: file.to_owned(),
        detected: "binary".to_owned(),
        reason,
    }
}

/// The encoding an HTML document declares in a `<meta>` tag within its first 1024 bytes (the
/// HTML standard's prescan, simplified: `charset=` in `<meta charset>` or `<meta content>`).
pub(crate) fn html_meta_charset(bytes: &[u8]) -> Option<&'static Encoding> {
    let head = &bytes[..bytes.len().min(1024)];
    let lower: Vec<u8> = head.iter().map(u8::to_ascii_lowercase).collect();
    let mut from = 0;
    while let Some(pos) = find(&lower[from..], b"<meta") {
        let start = from + pos;
        let end = lower[start..]
            .iter()
            .position(|&b| b == b'>')
            .map_or(lower.len(), |e| start + e);
        let tag = &lower[start..end];
        if let Some(cs) = find(tag, b"charset") {
            let rest = &tag[cs + b"charset".len()..];
            let rest = trim_start(rest);
            if let Some(rest) = rest.strip_prefix(b"=") {
                let rest = trim_start(rest);
                let rest = rest
                    .strip_prefix(b"\"")
                    .or_else(|| rest.strip_prefix(b"'"))
                    .unwrap_or(rest);
                let len = rest
                    .iter()
                    .position(|&b| {
                        matches!(
                            b,
                            b'"' | b'\'' | b';' | b'/' | b' ' | b'\t' | b'\n' | b'\r' | b'\x0c'
                        )
                    })
                    .unwrap_or(rest.len());
                if let Some(encoding) = Encoding::for_label(&rest[..len]) {
                    return Some(encoding);
                }
            }
        }
        from = end;
    }
    None
}

fn trim_start(s: &[u8]) -> &[u8] {
    let n = s.iter().take_while(|b| b.is_ascii_whitespace()).count();
    &s[n..]
}

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utf8_with_and_without_bom() {
        assert_eq!(decode("a", "héllo".as_bytes(), None).unwrap().text, "héllo");
        let d = decode("a", b"\xef\xbb\xbfh\xc3\xa9", None).unwrap();
        assert_eq!((d.text.as_str(), d.encoding), ("hé", "UTF-8"));
    }

    #[test]
    fn utf16_needs_a_bom() {
        let d = decode("a", b"\xff\xfeh\0i\0", None).unwrap();
        assert_eq!((d.text.as_str(), d.encoding), ("hi", "UTF-16LE"));
        let d = decode("a", b"\xfe\xff\0h\0i", None).unwrap();
        assert_eq!((d.text.as_str(), d.encoding), ("hi", "UTF-16BE"));
        let err = decode("a.txt", b"h\0i\0", None).unwrap_err();
        assert!(err.to_string().contains("NUL byte at offset 1"), "{err}");
    }

    #[test]
    fn odd_utf16_is_refused() {
        assert!(decode("a", b"\xff\xfeh\0i", None).is_err());
    }

    #[test]
    fn binary_is_refused() {
        let err = decode("blob.txt", &[0x89, b'P', b'N', b'G', 1, 2, 3, 4, 5], None).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("blob.txt") && msg.contains("binary"), "{msg}");
    }

    #[test]
    fn declared_charset_wins_over_guess() {
        let (gbk, _, _) = encoding_rs::GBK.encode("你好，世界");
        let d = decode("a", &gbk, Some(encoding_rs::GBK)).unwrap();
        assert_eq!((d.text.as_str(), d.encoding), ("你好，世界", "GBK"));
    }

    #[test]
    fn windows_1252_is_guessed() {
        let d = decode(
            "a",
            b"Caf\xe9 cr\xe8me br\xfbl\xe9e, na\xefve fa\xe7ade",
            None,
        )
        .unwrap();
        assert_eq!(d.text, "Café crème brûlée, naïve façade");
        assert_eq!(d.encoding, "windows-1252");
    }

    #[test]
    fn meta_prescan() {
        assert_eq!(
            html_meta_charset(b"<html><META Charset=\"GBK\">"),
            Some(encoding_rs::GBK)
        );
        assert_eq!(
            html_meta_charset(b"<meta http-equiv=Content-Type content='text/html; charset=big5'>"),
            Some(encoding_rs::BIG5)
        );
        assert_eq!(html_meta_charset(b"<meta name=x><p>charset=gbk"), None);
    }
}
