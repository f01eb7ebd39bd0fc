//! W3C Trace Context (`traceparent`, `tracestate`): the caller's trace continued.
//!
//! A valid incoming `traceparent` makes the call's span a child of the caller's; an
//! absent or invalid one (the W3C rule: never half-trust a malformed header) starts a
//! new trace. The backend is sent a `traceparent` naming the call's span as parent
//! when telemetry exports it, else the caller's own context unchanged, so a trace
//! stays connected through a gateway that does not export.

use http::{HeaderMap, HeaderValue};

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// `tracestate` longer than this is dropped rather than forwarded (W3C allows it).
const MAX_TRACESTATE: usize = 512;
const SAMPLED: u8 = 0x01;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceContext {
    pub trace_id: [u8; 16],
    /// The call's own span.
    pub span_id: [u8; 8],
    /// The caller's span, when a valid `traceparent` came in.
    pub parent_span_id: Option<[u8; 8]>,
    pub flags: u8,
    pub state: Option<HeaderValue>,
    /// Whether the call's span is exported (telemetry on): then the backend's parent
    /// is the call's span, else the caller's.
    exported: bool,
}

impl TraceContext {
    /// The call's context from the request's headers; `exported` when telemetry is on.
    pub fn from_headers(headers: &HeaderMap, exported: bool) -> Self {
        let incoming = single(headers, TRACEPARENT).and_then(parse_traceparent);
        // Ids of a span nobody exports are never read: not drawn on the request path.
        let span_id = if exported { nonzero_random() } else { [0; 8] };
        match incoming {
            Some((trace_id, parent, flags)) => TraceContext {
                trace_id,
                span_id,
                parent_span_id: Some(parent),
                flags,
                state: single(headers, TRACESTATE).filter(|v| v.len() <= MAX_TRACESTATE).cloned(),
                exported,
            },
            None => TraceContext {
                trace_id: if exported { nonzero_random() } else { [0; 16] },
                span_id,
                parent_span_id: None,
                flags: SAMPLED,
                state: None,
                exported,
            },
        }
    }

    /// Whether the caller's sampling decision keeps this trace (parent-based sampling).
    pub fn sampled(&self) -> bool {
        self.flags & SAMPLED != 0
    }

    /// The `traceparent` (and `tracestate`) the backend is sent, if any.
    pub fn upstream(&self) -> Option<(HeaderValue, Option<HeaderValue>)> {
        let parent = match (self.exported, self.parent_span_id) {
            (true, _) => self.span_id,
            (false, Some(parent)) => parent,
            (false, None) => return None,
        };
        let value = format!("00-{}-{}-{:02x}", hex::encode(self.trace_id), hex::encode(parent), self.flags);
        HeaderValue::from_str(&value).ok().map(|v| (v, self.state.clone()))
    }
}

/// The header's value if it appears exactly once (two `traceparent`s are invalid).
fn single<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a HeaderValue> {
    let mut values = headers.get_all(name).iter();
    let first = values.next()?;
    values.next().is_none().then_some(first)
}

/// `version-traceid-parentid-flags`, lower-case hex. Version `ff` is invalid; a later
/// version than `00` may append fields, which are ignored.
fn parse_traceparent(value: &HeaderValue) -> Option<([u8; 16], [u8; 8], u8)> {
    let text = value.to_str().ok()?.trim();
    let mut parts = text.split('-');
    let version = parts.next()?;
    let trace = parts.next()?;
    let parent = parts.next()?;
    let flags = parts.next()?;
    let more = parts.next().is_some();
    if version.len() != 2 || !is_lower_hex(version) || version == "ff" || (version == "00" && more) {
        return None;
    }
    if !(is_lower_hex(trace) && is_lower_hex(parent) && is_lower_hex(flags)) || flags.len() != 2 {
        return None;
    }
    let trace_id: [u8; 16] = hex::decode(trace).ok()?.try_into().ok()?;
    let parent_id: [u8; 8] = hex::decode(parent).ok()?.try_into().ok()?;
    let flags = u8::from_str_radix(flags, 16).ok()?;
    if trace_id == [0; 16] || parent_id == [0; 8] {
        return None;
    }
    Some((trace_id, parent_id, flags))
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn nonzero_random<const N: usize>() -> [u8; N] {
    loop {
        let id: [u8; N] = rand::random();
        if id != [0; N] {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.append(http::HeaderName::from_bytes(name.as_bytes()).unwrap(), HeaderValue::from_str(value).unwrap());
        }
        map
    }

    const PARENT: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn continues_a_valid_traceparent_and_names_its_own_span_upstream() {
        let ctx = TraceContext::from_headers(&headers(&[(TRACEPARENT, PARENT), (TRACESTATE, "k=v")]), true);
        assert_eq!(hex::encode(ctx.trace_id), "0af7651916cd43dd8448eb211c80319c");
        assert_eq!(ctx.parent_span_id.map(hex::encode).as_deref(), Some("b7ad6b7169203331"));
        assert!(ctx.sampled());
        let (traceparent, state) = ctx.upstream().unwrap();
        let expected = format!("00-0af7651916cd43dd8448eb211c80319c-{}-01", hex::encode(ctx.span_id));
        assert_eq!(traceparent.to_str().unwrap(), expected);
        assert_eq!(state.unwrap().to_str().unwrap(), "k=v");
    }

    #[test]
    fn without_export_the_callers_context_goes_upstream_unchanged() {
        let ctx = TraceContext::from_headers(&headers(&[(TRACEPARENT, PARENT)]), false);
        assert_eq!(ctx.upstream().unwrap().0.to_str().unwrap(), PARENT);
        assert_eq!(TraceContext::from_headers(&HeaderMap::new(), false).upstream(), None);
    }

    #[test]
    fn an_invalid_traceparent_starts_a_new_sampled_trace() {
        for bad in [
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
            "garbage",
        ] {
            let ctx = TraceContext::from_headers(&headers(&[(TRACEPARENT, bad), (TRACESTATE, "k=v")]), true);
            assert_eq!(ctx.parent_span_id, None, "{bad}");
            assert_eq!(ctx.state, None, "{bad}");
            assert_ne!(hex::encode(ctx.trace_id), "0af7651916cd43dd8448eb211c80319c", "{bad}");
            assert!(ctx.sampled());
        }
        let twice = TraceContext::from_headers(&headers(&[(TRACEPARENT, PARENT), (TRACEPARENT, PARENT)]), true);
        assert_eq!(twice.parent_span_id, None);
    }

    #[test]
    fn a_later_version_with_more_fields_is_read_and_an_unsampled_flag_kept() {
        let ctx = TraceContext::from_headers(
            &headers(&[(TRACEPARENT, "cc-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00-what")]),
            true,
        );
        assert!(ctx.parent_span_id.is_some());
        assert!(!ctx.sampled());
        assert!(ctx.upstream().unwrap().0.to_str().unwrap().ends_with("-00"));
    }
}
