//! Scenarios: the misbehaviours a test asks of the fake, chosen per backend URL.
//!
//! The gateway under test never forwards its caller's headers, so the only
//! channel from a test to this server is the backend URL the gateway is
//! configured with. A scenario therefore travels as a path prefix,
//! `/s/status=503,delay_ms=100,no_usage/v1/...`: comma-separated `key[=value]`
//! items, a bare key meaning `true`. `Display` and `FromStr` are inverses, so
//! what `FakeModel::scenario_url` writes is exactly what the server reads back.
//!
//! Keys that shape the same thing do not combine: `endless_line` wins over
//! every other body, then `huge_mb`; `cut_after` wins over `stall_after`,
//! which wins over `error_after`; `cut_body` wins over `stall_body`.
//!
//! Most keys mean the same on both APIs the fake speaks (`tool_use` on each
//! API's terms; `cache` too: Anthropic's cache creation and read counts, or
//! OpenAI's `prompt_tokens_details.cached_tokens`). `error_after` is for the
//! Anthropic Messages API only; `n`, `no_usage`, `no_done` and `huge_mb` for the OpenAI API only
//! (Anthropic always reports usage and ends its streams with `message_stop`);
//! `input_tokens` for realtime sessions only.

use std::fmt;
use std::str::FromStr;

/// How the fake should (mis)behave for one request. The default is a
/// well-behaved OpenAI-compatible server.
#[derive(Default, Clone, Debug, PartialEq, Eq)]
pub struct Scenario {
    /// Answer with this status: a non-2xx one with an OpenAI error envelope
    /// (whatever the path), a 2xx one in place of a success's own status.
    pub status: Option<u16>,
    /// Sleep this long before sending the response head.
    pub delay_ms: Option<u64>,
    /// Sleep this long between SSE events of a stream.
    pub chunk_delay_ms: Option<u64>,
    /// Never answer (until the server shuts down).
    pub hang: bool,
    /// Stream: abort the connection after this many content chunks, no `[DONE]`.
    pub cut_after: Option<usize>,
    /// Never report usage: no usage chunk in streams, no `usage` otherwise.
    pub no_usage: bool,
    /// Add a `Retry-After` header with this many seconds.
    pub retry_after: Option<u64>,
    /// Answer 200 `application/json` with a body that is not JSON.
    pub garbage: bool,
    /// Number of content chunks in a stream (default 5).
    pub chunks: Option<usize>,
    /// Chat: the reply is this many words (`w1 w2 ... wN`) instead of the echo.
    /// Realtime: each response writes this many output tokens (within its limit).
    pub words: Option<usize>,
    /// Chat: ignore `max_tokens` and `max_completion_tokens`, like a backend
    /// that overshoots its allowance. Realtime: ignore the output limits.
    pub ignore_limit: bool,
    /// Non-streamed JSON answers: announce the full `Content-Length`, send
    /// about half the body, then abort the connection.
    pub cut_body: bool,
    /// Non-streamed JSON answers: announce the full `Content-Length`, send
    /// about half the body, then nothing more (until the server shuts down).
    pub stall_body: bool,
    /// Stream: send the head at once, then wait this long before the first
    /// event (the role chunk).
    pub first_event_delay_ms: Option<u64>,
    /// Stream: send the head and the role chunk at once, then wait this long
    /// before the first content chunk (on top of `chunk_delay_ms`).
    pub first_content_delay_ms: Option<u64>,
    /// Stream: send the role chunk and this many content chunks, then nothing
    /// more, never ending (until the client goes or the server shuts down).
    pub stall_after: Option<usize>,
    /// Stream: replace the event at this index (0 the role chunk, 1 the first
    /// content chunk, ...; `[DONE]` excluded) by `data: {this is not json`;
    /// the rest of the stream follows as usual. Anthropic streams count their
    /// steps (0 the opening `message_start`, `content_block_start` and `ping`,
    /// 1 the first content delta, ...) and keep the event's `event:` line.
    pub malformed_at: Option<usize>,
    /// Stream: end the body cleanly after the last chunk, without `[DONE]`.
    pub no_done: bool,
    /// A line that never ends, until the client goes away: streams send the
    /// SSE head then `data: ` and `x`s; other JSON answers `{"id":"` and `x`s.
    pub endless_line: bool,
    /// Chat: one choice whose content is this many MiB of `a`, made while it
    /// is sent in 64 KiB frames, never whole in memory: a chunked
    /// `chat.completion` with usage at the end, or, streamed, one huge content
    /// event. Limits, `n`, `words` and `cut_body`/`stall_body` do not apply.
    pub huge_mb: Option<usize>,
    /// Requests carrying this flag take turns, counted per server: the 1st,
    /// 3rd, ... answer 503, the 2nd, 4th, ... answer normally.
    pub flap: bool,
    /// Anthropic stream: after this many content deltas, Anthropic's
    /// in-stream `overloaded_error` event, then a clean end.
    pub error_after: Option<usize>,
    /// When the request has tools (and `tool_choice` is not `none`), answer
    /// with a call of the first tool (or the one `tool_choice` names) with
    /// `{"echo": <last user text>}`: an Anthropic `tool_use` block, or OpenAI
    /// `tool_calls` (there, once the last message is a tool's result, the reply
    /// is `The tool said: <result>` instead).
    pub tool_use: bool,
    /// Anthropic: report non-zero `cache_creation_input_tokens` (2048) and
    /// `cache_read_input_tokens` (1024) instead of 0. OpenAI: report half the
    /// prompt as `prompt_tokens_details.cached_tokens`.
    pub cache: bool,
    /// Realtime: the input tokens each response reports (default 20).
    pub input_tokens: Option<u64>,
}

/// Why a scenario prefix could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScenarioError {
    #[error("unknown scenario key `{0}`")]
    UnknownKey(String),
    #[error("scenario key `{0}` needs a value (`{0}=...`)")]
    MissingValue(String),
    #[error("scenario key `{key}` has an invalid value `{value}`")]
    InvalidValue { key: String, value: String },
}

impl Scenario {
    /// The number of content chunks a stream is split into.
    pub fn content_chunks(&self) -> usize {
        self.chunks.unwrap_or(5)
    }
}

impl fmt::Display for Scenario {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let numbers = [
            ("status", self.status.map(u64::from)),
            ("delay_ms", self.delay_ms),
            ("chunk_delay_ms", self.chunk_delay_ms),
            ("chunks", self.chunks.map(|n| n as u64)),
            ("cut_after", self.cut_after.map(|n| n as u64)),
            ("retry_after", self.retry_after),
            ("words", self.words.map(|n| n as u64)),
            ("first_event_delay_ms", self.first_event_delay_ms),
            ("first_content_delay_ms", self.first_content_delay_ms),
            ("stall_after", self.stall_after.map(|n| n as u64)),
            ("malformed_at", self.malformed_at.map(|n| n as u64)),
            ("huge_mb", self.huge_mb.map(|n| n as u64)),
            ("error_after", self.error_after.map(|n| n as u64)),
            ("input_tokens", self.input_tokens),
        ];
        let flags = [
            ("hang", self.hang),
            ("no_usage", self.no_usage),
            ("garbage", self.garbage),
            ("ignore_limit", self.ignore_limit),
            ("cut_body", self.cut_body),
            ("stall_body", self.stall_body),
            ("no_done", self.no_done),
            ("endless_line", self.endless_line),
            ("flap", self.flap),
            ("tool_use", self.tool_use),
            ("cache", self.cache),
        ];
        let items: Vec<String> = numbers
            .into_iter()
            .filter_map(|(key, value)| value.map(|v| format!("{key}={v}")))
            .chain(flags.into_iter().filter(|(_, on)| *on).map(|(key, _)| key.to_owned()))
            .collect();
        f.write_str(&items.join(","))
    }
}

impl FromStr for Scenario {
    type Err = ScenarioError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut scenario = Scenario::default();
        for item in s.split(',').filter(|item| !item.is_empty()) {
            let (key, value) = match item.split_once('=') {
                Some((key, value)) => (key, Some(value)),
                None => (item, None),
            };
            match key {
                "status" => {
                    let status: u16 = number(key, value)?;
                    if !(100..=999).contains(&status) {
                        return Err(invalid(key, value.unwrap_or_default()));
                    }
                    scenario.status = Some(status);
                }
                "delay_ms" => scenario.delay_ms = Some(number(key, value)?),
                "chunk_delay_ms" => scenario.chunk_delay_ms = Some(number(key, value)?),
                "chunks" => scenario.chunks = Some(number(key, value)?),
                "cut_after" => scenario.cut_after = Some(number(key, value)?),
                "retry_after" => scenario.retry_after = Some(number(key, value)?),
                "hang" => scenario.hang = flag(key, value)?,
                "no_usage" => scenario.no_usage = flag(key, value)?,
                "garbage" => scenario.garbage = flag(key, value)?,
                "words" => scenario.words = Some(number(key, value)?),
                "ignore_limit" => scenario.ignore_limit = flag(key, value)?,
                "cut_body" => scenario.cut_body = flag(key, value)?,
                "stall_body" => scenario.stall_body = flag(key, value)?,
                "first_event_delay_ms" => scenario.first_event_delay_ms = Some(number(key, value)?),
                "first_content_delay_ms" => scenario.first_content_delay_ms = Some(number(key, value)?),
                "stall_after" => scenario.stall_after = Some(number(key, value)?),
                "malformed_at" => scenario.malformed_at = Some(number(key, value)?),
                "no_done" => scenario.no_done = flag(key, value)?,
                "endless_line" => scenario.endless_line = flag(key, value)?,
                "huge_mb" => scenario.huge_mb = Some(number(key, value)?),
                "flap" => scenario.flap = flag(key, value)?,
                "error_after" => scenario.error_after = Some(number(key, value)?),
                "tool_use" => scenario.tool_use = flag(key, value)?,
                "cache" => scenario.cache = flag(key, value)?,
                "input_tokens" => scenario.input_tokens = Some(number(key, value)?),
                other => return Err(ScenarioError::UnknownKey(other.to_owned())),
            }
        }
        Ok(scenario)
    }
}

fn number<T: FromStr>(key: &str, value: Option<&str>) -> Result<T, ScenarioError> {
    let value = value.ok_or_else(|| ScenarioError::MissingValue(key.to_owned()))?;
    value.parse().map_err(|_| invalid(key, value))
}

fn flag(key: &str, value: Option<&str>) -> Result<bool, ScenarioError> {
    match value {
        None | Some("true") => Ok(true),
        Some("false") => Ok(false),
        Some(other) => Err(invalid(key, other)),
    }
}

fn invalid(key: &str, value: &str) -> ScenarioError {
    ScenarioError::InvalidValue { key: key.to_owned(), value: value.to_owned() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn everything() -> Scenario {
        Scenario {
            status: Some(503),
            delay_ms: Some(100),
            chunk_delay_ms: Some(50),
            hang: true,
            cut_after: Some(2),
            no_usage: true,
            retry_after: Some(7),
            garbage: true,
            chunks: Some(10),
            words: Some(500),
            ignore_limit: true,
            cut_body: true,
            stall_body: true,
            first_event_delay_ms: Some(30),
            first_content_delay_ms: Some(40),
            stall_after: Some(3),
            malformed_at: Some(1),
            no_done: true,
            endless_line: true,
            huge_mb: Some(2),
            flap: true,
            error_after: Some(4),
            tool_use: true,
            cache: true,
            input_tokens: Some(0),
        }
    }

    #[test]
    fn encoding_round_trips() {
        for scenario in [
            Scenario::default(),
            everything(),
            Scenario { cut_after: Some(0), ..Default::default() },
            Scenario { no_usage: true, chunks: Some(3), ..Default::default() },
            Scenario { malformed_at: Some(0), stall_after: Some(0), words: Some(0), ..Default::default() },
            Scenario { flap: true, huge_mb: Some(1), ..Default::default() },
            Scenario { error_after: Some(0), cache: true, ..Default::default() },
        ] {
            let encoded = scenario.to_string();
            assert_eq!(encoded.parse::<Scenario>().unwrap(), scenario, "{encoded}");
        }
    }

    #[test]
    fn default_encodes_to_nothing() {
        assert_eq!(Scenario::default().to_string(), "");
        assert_eq!("".parse::<Scenario>().unwrap(), Scenario::default());
    }

    #[test]
    fn parses_the_documented_example() {
        let text = "status=503,delay_ms=100,chunk_delay_ms=50,cut_after=2,no_usage,hang,retry_after=7,garbage,\
                    chunks=10,words=500,ignore_limit,cut_body,stall_body,first_event_delay_ms=30,\
                    first_content_delay_ms=40,stall_after=3,malformed_at=1,no_done,endless_line,huge_mb=2,flap,\
                    error_after=4,tool_use,cache,input_tokens=0";
        assert_eq!(text.parse::<Scenario>().unwrap(), everything());
    }

    #[test]
    fn flags_accept_explicit_booleans() {
        let scenario: Scenario = "hang=false,garbage=true".parse().unwrap();
        assert!(!scenario.hang);
        assert!(scenario.garbage);
    }

    #[test]
    fn rejects_what_it_cannot_read() {
        assert_eq!("sttaus=503".parse::<Scenario>(), Err(ScenarioError::UnknownKey("sttaus".into())));
        assert_eq!("status".parse::<Scenario>(), Err(ScenarioError::MissingValue("status".into())));
        assert_eq!("status=42".parse::<Scenario>(), Err(invalid("status", "42")));
        assert_eq!("delay_ms=soon".parse::<Scenario>(), Err(invalid("delay_ms", "soon")));
        assert_eq!("hang=yes".parse::<Scenario>(), Err(invalid("hang", "yes")));
        assert_eq!("huge_mb".parse::<Scenario>(), Err(ScenarioError::MissingValue("huge_mb".into())));
        assert_eq!("words=-1".parse::<Scenario>(), Err(invalid("words", "-1")));
        assert_eq!("flap=2".parse::<Scenario>(), Err(invalid("flap", "2")));
    }
}
