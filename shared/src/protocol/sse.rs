//! Server-sent events, split as they arrive.
//!
//! The splitter never waits for more than one event: each complete event (lines up to
//! a blank line) is handed out as soon as its last byte is in, so a relay built on it
//! forwards chunk by chunk. It accepts `\n` and `\r\n` line ends.

use bytes::{Bytes, BytesMut};

/// One event: its raw bytes (to forward verbatim, blank line included) and its data.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub raw: Bytes,
    /// The `data:` lines joined with `\n`; empty for comment-only events.
    pub data: String,
    /// The `event:` field, if any.
    pub name: Option<String>,
}

impl Event {
    pub fn is_done(&self) -> bool {
        self.data.trim() == "[DONE]"
    }
}

#[derive(Debug, Default)]
pub struct Splitter {
    buf: BytesMut,
    /// Where the scan for the end of the current event resumes.
    scanned: usize,
}

impl Splitter {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete event, if the buffer holds one.
    pub fn next_event(&mut self) -> Option<Event> {
        let end = self.find_event_end()?;
        let raw = self.buf.split_to(end).freeze();
        self.scanned = 0;
        Some(parse(raw))
    }

    /// Bytes received that do not (yet) form a complete event.
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }

    fn find_event_end(&mut self) -> Option<usize> {
        // An event ends at an empty line: "\n\n" or "\n\r\n".
        let bytes = &self.buf[..];
        for i in memchr::memchr_iter(b'\n', &bytes[self.scanned..]).map(|at| self.scanned + at) {
            match (bytes.get(i + 1), bytes.get(i + 2)) {
                (Some(b'\n'), _) => return Some(i + 2),
                (Some(b'\r'), Some(b'\n')) => return Some(i + 3),
                _ => {}
            }
        }
        // Rescan the last two bytes next time: they may start a terminator.
        self.scanned = bytes.len().saturating_sub(2);
        None
    }
}

fn parse(raw: Bytes) -> Event {
    let mut data = String::new();
    let mut seen_data = false;
    let mut name = None;
    // Checked as UTF-8 first: `from_utf8_lossy` walks a valid text chunk by chunk, about
    // ten times slower, and is needed only for an event that is not valid UTF-8.
    let text = match std::str::from_utf8(&raw) {
        Ok(text) => std::borrow::Cow::Borrowed(text),
        Err(_) => String::from_utf8_lossy(&raw),
    };
    // Lines found with `memchr`, as the splitter finds events: `str::lines` and
    // `split_once` walk chars through the generic pattern API, once an event.
    let mut rest: &str = &text;
    while !rest.is_empty() {
        let line = match memchr::memchr(b'\n', rest.as_bytes()) {
            Some(at) => {
                let line = &rest[..at];
                rest = &rest[at + 1..];
                line.strip_suffix('\r').unwrap_or(line)
            }
            None => std::mem::take(&mut rest),
        };
        let (field, value) = match memchr::memchr(b':', line.as_bytes()) {
            Some(at) => {
                let value = &line[at + 1..];
                (&line[..at], value.strip_prefix(' ').unwrap_or(value))
            }
            None => (line, ""),
        };
        match field {
            "data" => {
                // Joined with `\n`, an empty `data` line included (as the spec says).
                if seen_data {
                    data.push('\n');
                }
                data.push_str(value);
                seen_data = true;
            }
            "event" => name = Some(value.to_owned()),
            _ => {}
        }
    }
    Event { raw, data, name }
}

/// An SSE event carrying a JSON payload.
pub fn event(name: Option<&str>, json: &serde_json::Value) -> Bytes {
    let mut out = String::new();
    if let Some(name) = name {
        out.push_str("event: ");
        out.push_str(name);
        out.push('\n');
    }
    out.push_str("data: ");
    out.push_str(&json.to_string());
    out.push_str("\n\n");
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drain(s: &mut Splitter) -> Vec<Event> {
        std::iter::from_fn(|| s.next_event()).collect()
    }

    #[test]
    fn hands_out_each_event_as_soon_as_it_is_complete() {
        let mut s = Splitter::default();
        s.push(b"data: {\"a\":1}\n");
        assert!(drain(&mut s).is_empty());
        s.push(b"\ndata: {\"b\"");
        let got = drain(&mut s);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].data, "{\"a\":1}");
        assert_eq!(&got[0].raw[..], b"data: {\"a\":1}\n\n");
        s.push(b":2}\n\ndata: [DONE]\n\n");
        let got = drain(&mut s);
        assert_eq!(got.len(), 2);
        assert_eq!(got[0].data, "{\"b\":2}");
        assert!(got[1].is_done());
        assert!(s.pending().is_empty());
    }

    #[test]
    fn handles_crlf_multi_line_data_and_event_names() {
        let mut s = Splitter::default();
        s.push(b"event: error\r\ndata: one\r\ndata: two\r\n\r\n");
        let got = drain(&mut s);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].name.as_deref(), Some("error"));
        assert_eq!(got[0].data, "one\ntwo");
    }

    #[test]
    fn byte_at_a_time_input_gives_the_same_events() {
        let input = b"data: x\n\n: comment\n\ndata: y\n\n";
        let mut s = Splitter::default();
        let mut events = Vec::new();
        for b in input {
            s.push(&[*b]);
            events.extend(drain(&mut s));
        }
        let data: Vec<_> = events.iter().map(|e| e.data.as_str()).collect();
        assert_eq!(data, ["x", "", "y"]);
    }

    #[test]
    fn an_event_that_is_not_utf8_is_read_with_replacement_characters_and_relayed_as_it_came() {
        let mut s = Splitter::default();
        s.push(b"data: caf\xc3\xa9 \xff!\n\n");
        let got = drain(&mut s);
        assert_eq!(got[0].data, "caf\u{e9} \u{fffd}!");
        assert_eq!(&got[0].raw[..], b"data: caf\xc3\xa9 \xff!\n\n");
    }

    #[test]
    fn fields_read_as_the_spec_says_whatever_their_spacing() {
        // A field without a colon is named whole with an empty value; only the one
        // space after the colon goes; a colon in the value stays; a comment (a line
        // that starts with a colon) and unknown fields are skipped; `\r\n` ends a line.
        let mut s = Splitter::default();
        s.push(b": keep-alive\r\ndata\ndata:no space\ndata:  two spaces\r\nid: 7\ndata: a: b\n\n");
        let got = drain(&mut s);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].data, "\nno space\n two spaces\na: b");
        assert_eq!(got[0].name, None);
    }

    #[test]
    fn renders_a_named_json_event() {
        let bytes = event(Some("error"), &serde_json::json!({"error": {"code": "x"}}));
        assert_eq!(&bytes[..], b"event: error\ndata: {\"error\":{\"code\":\"x\"}}\n\n");
    }
}
