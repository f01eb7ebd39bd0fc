//! The request written and the answer's head read: an answer that came before the
//! request was written whole, `1xx` interim heads skipped, and how the body that
//! follows is framed (RFC 9112 §6.3) and whether its connection can be used again.

use std::io;
use std::task::{Context, Poll, ready};

use bytes::{Buf, BytesMut};
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Version};

use super::body::{Framing, Line};
use super::conn::Conn;
use super::{Error, invalid};

/// The largest response head read (status line and headers).
pub(super) const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 100;

/// Writes what is left of `request` past `written`. A backend may answer before it
/// has read all of it (a 413, a 401: RFC 9112 §9.6) and then stop reading, or close
/// the connection: a write that cannot go on, or fails, looks for that answer's head
/// and ends with it (`Some`) if it came. `None`: the request was written whole.
pub(super) fn poll_send(
    stream: &mut Conn,
    request: &[u8],
    written: &mut usize,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<Result<Option<http::response::Parts>, Error>> {
    loop {
        let sent = if *written < request.len() {
            stream.poll_write(cx, &request[*written..])
        } else {
            stream.poll_flush(cx).map_ok(|()| 0)
        };
        let refused = match sent {
            Poll::Ready(Ok(0)) if *written == request.len() => return Poll::Ready(Ok(None)),
            Poll::Ready(Ok(0)) => io::Error::from(io::ErrorKind::WriteZero),
            Poll::Ready(Ok(n)) => {
                *written += n;
                continue;
            }
            Poll::Ready(Err(e)) => e,
            Poll::Pending => return poll_head(stream, buf, cx).map_ok(Some),
        };
        // What the backend sent before it closed, if anything.
        return match poll_head(stream, buf, cx) {
            Poll::Ready(Ok(head)) => Poll::Ready(Ok(Some(head))),
            _ => Poll::Ready(Err(refused.into())),
        };
    }
}

/// The answer's head, past any `1xx` interim heads.
pub(super) fn poll_head(
    stream: &mut Conn,
    buf: &mut BytesMut,
    cx: &mut Context<'_>,
) -> Poll<Result<http::response::Parts, Error>> {
    loop {
        if !buf.is_empty() {
            match parse_head(buf)? {
                Some((head, len)) => {
                    buf.advance(len);
                    if head.status.is_informational() {
                        if head.status == StatusCode::SWITCHING_PROTOCOLS {
                            return Poll::Ready(Err(invalid(
                                "101 Switching Protocols, for a request that asked no upgrade",
                            )));
                        }
                        continue;
                    }
                    return Poll::Ready(Ok(head));
                }
                None if buf.len() > MAX_HEAD => {
                    return Poll::Ready(Err(invalid(format!("a response head longer than {MAX_HEAD} bytes"))));
                }
                None => {}
            }
        }
        if ready!(stream.poll_read(buf, cx))? == 0 {
            return Poll::Ready(Err(Error::Closed));
        }
    }
}

/// A complete head at the start of `buf` and its length; `None` while it is partial.
fn parse_head(buf: &[u8]) -> Result<Option<(http::response::Parts, usize)>, Error> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut headers);
    let len = match parsed.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(invalid(e.to_string())),
    };
    let mut head = http::Response::new(());
    *head.status_mut() =
        parsed.code.and_then(|code| StatusCode::from_u16(code).ok()).ok_or_else(|| invalid("its status"))?;
    *head.version_mut() = if parsed.version == Some(0) { Version::HTTP_10 } else { Version::HTTP_11 };
    let map = head.headers_mut();
    map.reserve(parsed.headers.len());
    for header in parsed.headers.iter() {
        let name = HeaderName::from_bytes(header.name.as_bytes()).map_err(|_| invalid("a header name"))?;
        let value = HeaderValue::from_bytes(header.value).map_err(|_| invalid(format!("the {name} header")))?;
        map.append(name, value);
    }
    Ok(Some((head.into_parts().0, len)))
}

/// How the answer's body ends, and whether its connection can be used again.
pub(super) fn framing(head: &http::response::Parts) -> Result<(Framing, bool), Error> {
    let mut keep_alive = head.version == Version::HTTP_11 && !has_token(&head.headers, &CONNECTION, "close");
    if head.status == StatusCode::NO_CONTENT || head.status == StatusCode::NOT_MODIFIED {
        return Ok((Framing::End, keep_alive));
    }
    if head.headers.contains_key(TRANSFER_ENCODING) {
        let last = list(&head.headers, &TRANSFER_ENCODING)?.pop();
        if !last.is_some_and(|coding| coding.eq_ignore_ascii_case("chunked")) {
            return Ok((Framing::Close, false));
        }
        // A length next to `chunked` is ignored, and the connection not trusted again.
        keep_alive &= !head.headers.contains_key(CONTENT_LENGTH);
        return Ok((Framing::Line(Line::Size), keep_alive));
    }
    let mut length = None;
    for value in list(&head.headers, &CONTENT_LENGTH)? {
        let parsed = value.bytes().all(|b| b.is_ascii_digit()).then(|| value.parse::<u64>().ok()).flatten();
        match (parsed, length) {
            (None, _) => return Err(invalid(format!("content-length `{value}`"))),
            (Some(n), Some(seen)) if n != seen => return Err(invalid("two different content-lengths")),
            (Some(n), _) => length = Some(n),
        }
    }
    Ok(match length {
        Some(0) => (Framing::End, keep_alive),
        Some(n) => (Framing::Length(n), keep_alive),
        None => (Framing::Close, false),
    })
}

/// The comma-separated tokens of a header value.
fn tokens(value: &HeaderValue) -> impl Iterator<Item = &str> {
    value.to_str().unwrap_or("").split(',').map(str::trim).filter(|t| !t.is_empty())
}

/// The tokens of a header that frames the body: a value that is not text, or holds
/// none, makes the framing invalid (RFC 9112 §6.3), not absent.
fn list<'h>(headers: &'h HeaderMap, name: &HeaderName) -> Result<Vec<&'h str>, Error> {
    let mut all = Vec::new();
    for value in headers.get_all(name) {
        let before = all.len();
        all.extend(tokens(value));
        // A value that is not text has no tokens (`tokens`).
        if all.len() == before {
            return Err(invalid(format!("the {name} header `{}`", String::from_utf8_lossy(value.as_bytes()))));
        }
    }
    Ok(all)
}

fn has_token(headers: &HeaderMap, name: &HeaderName, token: &str) -> bool {
    headers.get_all(name).iter().flat_map(tokens).any(|t| t.eq_ignore_ascii_case(token))
}
