//! JSON text written by hand, for the two lines every call writes (its audit record and
//! its ledger journal lines): serde_json checks each byte of a string against its
//! escape table, and a call's keys, names and ids spent ~9,000 instructions there
//! (callgrind). What this writes is what serde_json writes for the same
//! values; the tests of each line hold the two equal.

/// A JSON string: copied as is when no byte needs escaping, else escaped by serde_json.
pub(crate) fn string(out: &mut Vec<u8>, s: &str) {
    if !needs_escaping(s.as_bytes()) {
        out.push(b'"');
        out.extend_from_slice(s.as_bytes());
        out.push(b'"');
    } else {
        // Into a Vec, serializing a string cannot fail.
        let _ = serde_json::to_writer(&mut *out, s);
    }
}

/// Whether any byte is a control character, `"` or `\\`: a fold without a branch a byte
/// (a word-at-a-time version cost more instructions here).
fn needs_escaping(bytes: &[u8]) -> bool {
    bytes.iter().fold(0u8, |any, &b| any | u8::from(b < 0x20 || b == b'"' || b == b'\\')) != 0
}

/// A string, or `null`.
pub(crate) fn option(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        Some(s) => string(out, s),
        None => out.extend_from_slice(b"null"),
    }
}

pub(crate) fn boolean(out: &mut Vec<u8>, b: bool) {
    out.extend_from_slice(if b { b"true" } else { b"false" });
}

pub(crate) fn number(out: &mut Vec<u8>, n: u64) {
    out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes());
}

/// `"name":`, for a name that needs no escaping: one copy of a constant.
macro_rules! key {
    ($out:expr, $name:literal) => {
        $out.extend_from_slice(concat!("\"", $name, "\":").as_bytes())
    };
}

/// `,"name":`, a member after the first: one copy of a constant (four pushes were ~60
/// instructions a member, and an audit record has 30).
macro_rules! next {
    ($out:expr, $name:literal) => {
        $out.extend_from_slice(concat!(",\"", $name, "\":").as_bytes())
    };
}

pub(crate) use {key, next};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strings_are_written_as_serde_json_writes_them() {
        let long = [
            "acme/*/tokens/month/2026-12: plain, and long enough for several words",
            "mixed é ü 語 and ascii past eight bytes, non-ASCII passes as is",
            "1234567\"",
            "12345678\\",
            "123456789\u{1f}",
            "\u{0}bcdefgh",
            "abcdefg\u{7f}\u{80}\u{ff}",
        ];
        for s in ["", "plain/key-1", "é ü 語", "quote \" and \\ slash", "tab\tnew\nline\u{1}\u{1f}", "\u{7f} del"]
            .into_iter()
            .chain(long)
        {
            // The fast path is taken exactly when nothing needs escaping.
            let escapes = s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\');
            assert_eq!(needs_escaping(s.as_bytes()), escapes, "{s:?}");
            let mut out = Vec::new();
            string(&mut out, s);
            assert_eq!(String::from_utf8(out).unwrap(), serde_json::to_string(s).unwrap(), "{s:?}");
        }
    }
}
