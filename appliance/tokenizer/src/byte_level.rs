//! GPT-2's byte-level alphabet: each byte is shown as one printable character in BPE tokens.

use std::sync::OnceLock;

/// Byte -> character of the alphabet (printable bytes map to themselves, the other 68 bytes to
/// U+0100 onwards in byte order), as in GPT-2's `bytes_to_unicode`.
fn table() -> &'static [char; 256] {
    static TABLE: OnceLock<[char; 256]> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = ['\0'; 256];
        let mut next = 256u32;
        for b in 0..=255u8 {
            let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
            t[b as usize] = if printable {
                char::from(b)
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
                next += 1;
                c
            };
        }
        t
    })
}

/// Character (as a code point below 324) -> the byte it stands for.
fn reverse() -> &'static [Option<u8>; 324] {
    static REVERSE: OnceLock<[Option<u8>; 324]> = OnceLock::new();
    REVERSE.get_or_init(|| {
        let mut r = [None; 324];
        for (b, &c) in table().iter().enumerate() {
            r[c as usize] = Some(b as u8);
        }
        r
    })
}

/// The byte a character of the alphabet stands for, or `None` for characters outside it.
pub(crate) fn char_to_byte(c: char) -> Option<u8> {
    reverse().get(c as usize).copied().flatten()
}

/// Decodes a byte-level token text into the bytes it stands for. A character outside the
/// alphabet (a token added by hand to a byte-level vocabulary) is kept as its own UTF-8.
pub(crate) fn decode(text: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(text.len());
    for c in text.chars() {
        match char_to_byte(c) {
            Some(b) => out.push(b),
            None => {
                let mut buf = [0u8; 4];
                out.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        for b in 0..=255u8 {
            assert_eq!(char_to_byte(table()[b as usize]), Some(b), "byte {b}");
        }
        assert_eq!(table()[b' ' as usize], 'Ġ');
        assert_eq!(table()[b'\n' as usize], 'Ċ');
        assert_eq!(char_to_byte('A'), Some(b'A'));
        assert_eq!(char_to_byte('\u{7f}'), None);
        assert_eq!(decode("ĠHello"), b" Hello");
    }
}
