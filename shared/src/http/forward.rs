//! What of a caller's request goes upstream on a relay over bytes (gRPC methods, REST
//! operations): one policy for both, so that they cannot drift. The caller's
//! credentials, Flexway's own headers (the sensitivity header included) and the
//! connection's (RFC 9110 §7.6.1, and any header `Connection` names) never leave the
//! gateway; the trace context sent is the call's (`telemetry::context`), not the one
//! the caller sent, so that the backend's span is a child of the gateway's when the
//! gateway exports its own.

use http::{HeaderMap, HeaderName, header};

use crate::call::headers::CREDENTIALS;
use crate::telemetry::TraceContext;
use crate::telemetry::context::{TRACEPARENT, TRACESTATE};

/// The caller's `headers` that go upstream, with the call's `trace` context.
pub(super) fn upstream_headers(headers: &HeaderMap, sensitive_header: &str, trace: &TraceContext) -> HeaderMap {
    let named = connection_named(headers);
    let mut out = HeaderMap::new();
    for (name, value) in headers {
        if forwarded(name) && name.as_str() != sensitive_header && !named.iter().any(|n| n == name.as_str()) {
            out.append(name.clone(), value.clone());
        }
    }
    if let Some((traceparent, state)) = trace.upstream() {
        out.insert(HeaderName::from_static(TRACEPARENT), traceparent);
        if let Some(state) = state {
            out.insert(HeaderName::from_static(TRACESTATE), state);
        }
    }
    out
}

/// The upstream's answer `headers` that go back to the caller, appended to `out`: not
/// the connection's, not one that claims to be Flexway's own (the gateway writes
/// those).
pub(super) fn returned_headers(headers: &HeaderMap, out: &mut HeaderMap) {
    let named = connection_named(headers);
    for (name, value) in headers {
        let name_str = name.as_str();
        if !hop_by_hop(name_str) && !name_str.starts_with("flexway-") && !named.iter().any(|n| n == name_str) {
            out.append(name.clone(), value.clone());
        }
    }
}

/// The headers `Connection` names: hop-by-hop too (RFC 9110 §7.6.1).
fn connection_named(headers: &HeaderMap) -> Vec<String> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|name| name.trim().to_ascii_lowercase())
        .filter(|name| !name.is_empty())
        .collect()
}

fn forwarded(name: &HeaderName) -> bool {
    let name = name.as_str();
    !CREDENTIALS.contains(&name)
        && !hop_by_hop(name)
        && !matches!(name, "host" | TRACEPARENT | TRACESTATE)
        && !name.starts_with("flexway-")
}

fn hop_by_hop(name: &str) -> bool {
    matches!(name, "connection" | "keep-alive" | "transfer-encoding" | "upgrade" | "te" | "trailer")
        || name.starts_with("proxy-")
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn caller_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        for (name, value) in [
            ("authorization", "Bearer sk-caller"),
            ("x-api-key", "k"),
            ("cookie", "c"),
            ("proxy-authorization", "p"),
            ("connection", "keep-alive, X-Hop"),
            ("transfer-encoding", "chunked"),
            ("host", "gateway"),
            ("flexway-agent", "bot"),
            ("x-sensitive", "true"),
            ("content-type", "application/pdf"),
            ("content-length", "12"),
            ("x-request-lang", "fr"),
            ("x-hop", "h"),
            ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),
            ("tracestate", "vendor=1"),
        ] {
            headers.append(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        headers
    }

    #[test]
    fn credentials_flexway_and_hop_by_hop_headers_never_go_upstream() {
        let headers = caller_headers();
        let unexported = TraceContext::from_headers(&HeaderMap::new(), false);
        let out = upstream_headers(&headers, "x-sensitive", &unexported);
        let names: Vec<&str> = out.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["content-type", "content-length", "x-request-lang"], "no trace came, none goes");
    }

    #[test]
    fn the_backend_is_sent_the_calls_trace_context() {
        let headers = caller_headers();
        // Not exported: the caller's own context passes through unchanged.
        let passed = upstream_headers(&headers, "x-sensitive", &TraceContext::from_headers(&headers, false));
        assert_eq!(passed.get(TRACEPARENT), headers.get(TRACEPARENT));
        assert_eq!(passed.get(TRACESTATE).unwrap(), "vendor=1");
        // Exported: the call's span is the backend's parent, in the caller's trace.
        let call = TraceContext::from_headers(&headers, true);
        let sent = upstream_headers(&headers, "x-sensitive", &call);
        let traceparent = sent.get(TRACEPARENT).unwrap().to_str().unwrap();
        assert_eq!(traceparent, format!("00-0af7651916cd43dd8448eb211c80319c-{}-01", hex::encode(call.span_id)));
        assert_eq!(sent.get_all(TRACEPARENT).iter().count(), 1);
    }

    #[test]
    fn an_upstreams_connection_and_flexway_headers_never_reach_the_caller() {
        let mut answer = HeaderMap::new();
        for (name, value) in [
            ("connection", "close, x-hop"),
            ("x-hop", "h"),
            ("keep-alive", "timeout=5"),
            ("flexway-cost-eur", "0.000000"),
            ("content-type", "application/grpc"),
            ("grpc-encoding", "identity"),
        ] {
            answer.append(HeaderName::from_static(name), HeaderValue::from_static(value));
        }
        let mut out = HeaderMap::new();
        returned_headers(&answer, &mut out);
        let names: Vec<&str> = out.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["content-type", "grpc-encoding"]);
    }
}
