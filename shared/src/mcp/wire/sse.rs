//! An incremental `text/event-stream` parser (the HTML standard's rules): bytes in as
//! they arrive, whole events out. Lines end with CRLF, LF or CR (a CRLF split across
//! two chunks included); `data` lines join with `\n`; comments and unknown fields are
//! ignored; an event with no data is not dispatched. An event larger than
//! [`MAX_EVENT`] is an error, not a buffer that grows as long as a peer writes.

use memchr::memchr2;

/// The largest event (its fields as received) a parser holds.
pub const MAX_EVENT: usize = 4 * 1024 * 1024;

/// One dispatched event.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Event {
    /// Its `event:` type (`None`: the default, `message`).
    pub event: Option<String>,
    pub data: String,
    /// Its `id:` field, when it carried one.
    pub id: Option<String>,
}

/// The peer sent an event over [`MAX_EVENT`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("an event-stream event is over {MAX_EVENT} bytes")]
pub struct TooLarge;

/// The parser's state between two chunks.
#[derive(Debug, Default)]
pub struct Parser {
    /// The current line, not yet ended.
    line: Vec<u8>,
    /// The previous chunk ended with CR: a LF opening the next one ends nothing.
    after_cr: bool,
    /// The start of the stream is still to come (a leading BOM is dropped).
    started: bool,
    event: Option<String>,
    data: String,
    /// Whether a `data` field was seen (an empty `data:` still dispatches).
    has_data: bool,
    id: Option<String>,
    /// Bytes received for the event being read.
    size: usize,
}

impl Parser {
    pub fn new() -> Parser {
        Parser::default()
    }

    /// Feeds `bytes`; the events they complete, in order.
    pub fn feed(&mut self, mut bytes: &[u8]) -> Result<Vec<Event>, TooLarge> {
        let mut events = Vec::new();
        if !self.started && !bytes.is_empty() {
            self.started = true;
            bytes = bytes.strip_prefix(b"\xEF\xBB\xBF".as_slice()).unwrap_or(bytes);
        }
        if self.after_cr && !bytes.is_empty() {
            self.after_cr = false;
            bytes = bytes.strip_prefix(b"\n".as_slice()).unwrap_or(bytes);
        }
        while let Some(end) = memchr2(b'\r', b'\n', bytes) {
            self.grow(end)?;
            self.line.extend_from_slice(&bytes[..end]);
            let line = std::mem::take(&mut self.line);
            if let Some(event) = self.line_ended(&line) {
                events.push(event);
            }
            self.line = line;
            self.line.clear();
            let crlf = bytes[end] == b'\r';
            bytes = &bytes[end + 1..];
            if crlf {
                match bytes.first() {
                    Some(b'\n') => bytes = &bytes[1..],
                    Some(_) => {}
                    None => self.after_cr = true,
                }
            }
        }
        self.grow(bytes.len())?;
        self.line.extend_from_slice(bytes);
        Ok(events)
    }

    /// Counts `more` bytes towards the current event.
    fn grow(&mut self, more: usize) -> Result<(), TooLarge> {
        self.size += more;
        if self.size > MAX_EVENT {
            // What was held is dropped: the stream is abandoned.
            *self = Parser { started: true, ..Parser::default() };
            return Err(TooLarge);
        }
        Ok(())
    }

    /// One line ended: a field, a comment, or the blank line that dispatches.
    fn line_ended(&mut self, line: &[u8]) -> Option<Event> {
        if line.is_empty() {
            return self.dispatch();
        }
        if line[0] == b':' {
            return None;
        }
        let (name, value) = match line.iter().position(|&b| b == b':') {
            Some(colon) => {
                let value = &line[colon + 1..];
                (&line[..colon], value.strip_prefix(b" ".as_slice()).unwrap_or(value))
            }
            None => (line, &[][..]),
        };
        let value = String::from_utf8_lossy(value);
        match name {
            b"data" => {
                if self.has_data {
                    self.data.push('\n');
                }
                self.data.push_str(&value);
                self.has_data = true;
            }
            b"event" => self.event = Some(value.into_owned()),
            // An id with NUL is ignored, as the standard says.
            b"id" if !value.contains('\0') => self.id = Some(value.into_owned()),
            _ => {}
        }
        None
    }

    fn dispatch(&mut self) -> Option<Event> {
        self.size = 0;
        let event = self.event.take();
        let id = self.id.take();
        if !std::mem::take(&mut self.has_data) {
            return None;
        }
        Some(Event { event, data: std::mem::take(&mut self.data), id })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(parser: &mut Parser, chunks: &[&[u8]]) -> Vec<Event> {
        chunks.iter().flat_map(|chunk| parser.feed(chunk).unwrap_or_default()).collect()
    }

    fn message(data: &str) -> Event {
        Event { event: Some("message".into()), data: data.into(), id: None }
    }

    #[test]
    fn parses_events_with_type_id_and_data() {
        let events = Parser::new()
            .feed(b"event: message\nid: 7\ndata: {\"jsonrpc\":\"2.0\"}\n\n: keep-alive\n\ndata:x\n\n")
            .unwrap_or_default();
        assert_eq!(
            events,
            [
                Event { event: Some("message".into()), data: "{\"jsonrpc\":\"2.0\"}".into(), id: Some("7".into()) },
                Event { event: None, data: "x".into(), id: None },
            ]
        );
    }

    #[test]
    fn an_event_split_across_chunks_comes_out_whole_once() {
        let stream = b"event: message\ndata: {\"id\":1,\"result\":{}}\n\nevent: message\ndata: {\"id\":2}\n\n";
        let whole = Parser::new().feed(stream).unwrap_or_default();
        assert_eq!(whole.len(), 2);
        for split in 1..stream.len() {
            let mut parser = Parser::new();
            assert_eq!(all(&mut parser, &[&stream[..split], &stream[split..]]), whole, "split at {split}");
        }
        let mut parser = Parser::new();
        let bytes: Vec<&[u8]> = stream.chunks(1).collect();
        assert_eq!(all(&mut parser, &bytes), whole, "byte by byte");
    }

    #[test]
    fn crlf_and_cr_end_lines_even_split_between_chunks() {
        let mut parser = Parser::new();
        let events =
            all(&mut parser, &[b"event: message\r", b"\ndata: a\r", b"\n\r", b"\nevent: message\rdata: b\r\r"]);
        assert_eq!(events, [message("a"), message("b")]);
    }

    #[test]
    fn data_lines_join_with_newlines() {
        let events = Parser::new().feed(b"data: {\ndata:  \"a\": 1\ndata\ndata: }\n\n").unwrap_or_default();
        assert_eq!(events, [Event { event: None, data: "{\n \"a\": 1\n\n}".into(), id: None }]);
    }

    #[test]
    fn an_event_without_data_is_not_dispatched_but_an_empty_data_is() {
        let events = Parser::new().feed(b"id: 1\nevent: ping\n\ndata:\n\n").unwrap_or_default();
        assert_eq!(events, [Event { event: None, data: String::new(), id: None }]);
    }

    #[test]
    fn a_leading_bom_and_unknown_fields_are_ignored() {
        let events = Parser::new().feed(b"\xEF\xBB\xBFretry: 10\nfoo: bar\ndata: x\n\n").unwrap_or_default();
        assert_eq!(events, [Event { event: None, data: "x".into(), id: None }]);
    }

    #[test]
    fn an_unfinished_event_is_held_not_dispatched() {
        let mut parser = Parser::new();
        assert_eq!(parser.feed(b"data: a\n").unwrap_or_default(), []);
        assert_eq!(parser.feed(b"data: b").unwrap_or_default(), []);
        assert_eq!(parser.feed(b"\n\n").unwrap_or_default(), [Event { event: None, data: "a\nb".into(), id: None }]);
    }

    #[test]
    fn an_event_over_4_mib_is_an_error_even_in_small_chunks() {
        let mut parser = Parser::new();
        assert_eq!(parser.feed(b"data: ").map(|e| e.len()), Ok(0));
        let chunk = vec![b'x'; 64 * 1024];
        let mut outcome = Ok(Vec::new());
        for _ in 0..=MAX_EVENT / chunk.len() {
            outcome = parser.feed(&chunk);
            if outcome.is_err() {
                break;
            }
        }
        assert_eq!(outcome, Err(TooLarge));

        // Many lines of one event count together.
        let mut parser = Parser::new();
        let line = format!("data: {}\n", "y".repeat(1024 * 1024));
        let fed: Vec<_> = (0..4).map(|_| parser.feed(line.as_bytes())).collect();
        assert!(fed[..3].iter().all(Result::is_ok));
        assert_eq!(fed[3], Err(TooLarge));
    }

    #[test]
    fn events_under_the_bound_each_reset_the_count() {
        let mut parser = Parser::new();
        let event = format!("data: {}\n\n", "z".repeat(3 * 1024 * 1024));
        for _ in 0..3 {
            assert_eq!(parser.feed(event.as_bytes()).map(|events| events.len()), Ok(1));
        }
    }

    /// An event as a server would write it, each line ended by `ends` in turn (a LF
    /// right after a CR written as CRLF: a writer cannot end a line with LF there).
    fn written(event: &Event, ends: &[&str], last: &mut (usize, &'static str)) -> String {
        let mut end = || {
            last.0 += 1;
            let mut next = ends[last.0 % ends.len()];
            if last.1 == "\r" && next == "\n" {
                next = "\r\n";
            }
            last.1 = if next == "\r" { "\r" } else { "" };
            next.to_owned()
        };
        let mut text = String::new();
        if let Some(kind) = &event.event {
            text += &format!("event: {kind}{}", end());
        }
        if let Some(id) = &event.id {
            text += &format!("id: {id}{}", end());
        }
        for line in event.data.split('\n') {
            text += &format!("data: {line}{}", end());
        }
        text + &end()
    }

    fn field() -> impl proptest::strategy::Strategy<Value = String> {
        "[^\r\n\u{0}]{0,12}".prop_map(|s: String| s.trim_start_matches(' ').to_owned())
    }

    use proptest::prelude::*;

    proptest! {
        #[test]
        fn events_survive_any_line_ends_and_any_chunking(
            events in proptest::collection::vec(
                (proptest::option::of(field()), proptest::collection::vec(field(), 1..4), proptest::option::of(field())),
                0..6,
            ),
            ends in proptest::collection::vec(prop_oneof![Just("\n"), Just("\r\n"), Just("\r")], 1..4),
            cuts in proptest::collection::vec(any::<proptest::sample::Index>(), 0..6),
        ) {
            let events: Vec<Event> = events
                .into_iter()
                .map(|(event, data, id)| Event { event, data: data.join("\n"), id })
                .collect();
            let mut last = (0, "");
            let stream: String = events.iter().map(|e| written(e, &ends, &mut last)).collect();
            let bytes = stream.as_bytes();
            let mut cuts: Vec<usize> = cuts.iter().map(|i| i.index(bytes.len() + 1)).collect();
            cuts.sort_unstable();
            let mut parser = Parser::new();
            let mut from = 0;
            let mut got = Vec::new();
            for cut in cuts.into_iter().chain([bytes.len()]) {
                got.extend(parser.feed(&bytes[from..cut]).unwrap_or_default());
                from = cut;
            }
            prop_assert_eq!(got, events);
        }

        #[test]
        fn any_bytes_parse_the_same_however_cut(
            bytes in proptest::collection::vec(
                prop_oneof![Just(b'\r'), Just(b'\n'), Just(b':'), Just(b' '), Just(b'd'), any::<u8>()], 0..300,
            ),
            cut in any::<proptest::sample::Index>(),
        ) {
            let whole = Parser::new().feed(&bytes).unwrap_or_default();
            let cut = cut.index(bytes.len() + 1);
            let mut parser = Parser::new();
            let mut split = parser.feed(&bytes[..cut]).unwrap_or_default();
            split.extend(parser.feed(&bytes[cut..]).unwrap_or_default());
            prop_assert_eq!(split, whole);
        }
    }
}
