//! HTTP/1.1 to a backend, `http://` or `https://`, spoken by the calling task itself.
//!
//! hyper's pooled client runs each connection as a task of its own, fed through a
//! channel: ~29 KB a connection (the channel's first block 9.5, a write buffer 8.2, a
//! read buffer 8.2), held as long as the connection is, and every call hops between
//! its task and the connection's. A stream keeps its connection to the backend for its
//! whole life, so at 10,000 streams over HTTP/1.1 hyper's share alone was ~290 MB.
//! Here the call writes its request and reads the answer on its own task,
//! and a stream waiting for its next event holds its socket and a few words: the read
//! buffer is taken when the socket is readable and let go when it is drained. At
//! 10,000 streams the gateway's peak went from 357 MB to 165 MB (`cargo bench --bench
//! streams`), and a non-streamed call from ~115,700 to ~96,500 instructions.
//!
//! What it speaks: a POST of a known length, the request's head and body in one write
//! (a backend's answer before the request was written whole, a 413 or a 401 from a
//! backend that then stops reading or closes, is read and its connection closed);
//! an answer framed by `content-length`, `chunked` or the connection's close (RFC 9112
//! §6.3), its `1xx` heads skipped, its trailers read and dropped. A connection goes
//! back to its pool once its answer was read to the end, unless the answer said
//! `close`, was HTTP/1.0 or framed by the close, or more bytes followed it. A pooled
//! connection is checked before it is reused (a server that closed it has left an
//! end-of-file to read), and one idle for 90 s is closed (a pool looks every 30 s,
//! from a task on the runtime that first pooled a connection); a write that fails on a pooled connection goes again on another, then on a
//! new one. Nothing is retried once the request was written. A body dropped before
//! its end reads what has already arrived of it, without waiting, and closes its
//! connection unless that was the end.
//!
//! An `https://` backend is the same HTTP/1.1 over rustls ([`Pool::tls`]): its
//! handshake offers `h2` and `http/1.1`, and a server that chooses `h2` is noted
//! ([`Error::SpeaksH2`], nothing sent) and called through hyper's HTTP/2 client, where
//! streams share a connection (`super::alpn`). A TLS connection's reads go through
//! rustls, which keeps its own buffers; the rest is as for a plain one.

mod body;
mod conn;
mod head;
mod pool;

use std::io;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;

use http::{HeaderName, HeaderValue, Uri};
use rustls::pki_types::ServerName;

pub use body::Body;
pub(crate) use pool::Pool;

/// Why an answer could not be read.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("tcp connect error: {0}")]
    Connect(io::Error),
    /// The handshake failed, or the connection broke with a TLS error (an alert).
    #[error("TLS: {0}")]
    Tls(io::Error),
    /// The server chose HTTP/2 at the handshake: nothing was sent, and the call goes
    /// through the HTTP/2 client.
    #[error("the backend's server chose h2 at the TLS handshake")]
    SpeaksH2,
    #[error(transparent)]
    Io(#[from] io::Error),
    #[error("the backend closed the connection before the end of its answer")]
    Closed,
    #[error("the backend's answer is not valid HTTP/1.1: {0}")]
    Invalid(String),
}

fn invalid(what: impl Into<String>) -> Error {
    Error::Invalid(what.into())
}

/// Where a backend is: the pools' key and the request's `host`, and what to connect
/// to.
pub(crate) struct Target {
    authority: Arc<str>,
    host: String,
    port: u16,
    tls: Option<TlsTarget>,
}

/// An `https://` backend's: the name its certificate is checked against, and whether
/// its server chose `h2` at the last handshake (set at each one).
struct TlsTarget {
    name: ServerName<'static>,
    speaks_h2: Arc<AtomicBool>,
    /// Whether a handshake with the backend has told what it speaks: until one has,
    /// connections are made one at a time (see [`conn::connect`]).
    told: tokio::sync::Mutex<bool>,
}

impl Target {
    /// The target of an `http://` URL; `None` for any other.
    pub fn of(uri: &Uri) -> Option<Target> {
        if uri.scheme() != Some(&http::uri::Scheme::HTTP) {
            return None;
        }
        Self::at(uri, 80, None)
    }

    /// The target of an `https://` URL, noting in `speaks_h2` what each handshake
    /// with it chooses; `None` for any other.
    pub fn tls(uri: &Uri, speaks_h2: Arc<AtomicBool>) -> Option<Target> {
        if uri.scheme() != Some(&http::uri::Scheme::HTTPS) {
            return None;
        }
        let host = uri.host()?.trim_start_matches('[').trim_end_matches(']');
        let name = ServerName::try_from(host.to_owned()).ok()?;
        Self::at(uri, 443, Some(TlsTarget { name, speaks_h2, told: tokio::sync::Mutex::new(false) }))
    }

    fn at(uri: &Uri, default_port: u16, tls: Option<TlsTarget>) -> Option<Target> {
        let authority = uri.authority()?;
        let host = authority.host().trim_start_matches('[').trim_end_matches(']').to_owned();
        let port = authority.port_u16().unwrap_or(default_port);
        Some(Target { authority: authority.as_str().into(), host, port, tls })
    }
}

/// The request's bytes: its head, then `body`.
pub(crate) fn request(target: &Target, uri: &Uri, headers: &[(HeaderName, HeaderValue)], body: &[u8]) -> Vec<u8> {
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = Vec::with_capacity(256 + body.len());
    for part in ["POST ", path, " HTTP/1.1\r\nhost: ", &target.authority, "\r\n"] {
        out.extend_from_slice(part.as_bytes());
    }
    for (name, value) in headers {
        out.extend_from_slice(name.as_str().as_bytes());
        out.extend_from_slice(b": ");
        out.extend_from_slice(value.as_bytes());
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(b"content-length: ");
    out.extend_from_slice(itoa::Buffer::new().format(body.len()).as_bytes());
    out.extend_from_slice(b"\r\n\r\n");
    out.extend_from_slice(body);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_its_head_then_its_body() {
        let target = Target::of(&"http://[::1]:8080/v1".parse().unwrap()).unwrap();
        assert_eq!((target.host.as_str(), target.port), ("::1", 8080));
        let uri = "http://[::1]:8080/v1/chat/completions?x=1".parse().unwrap();
        let headers = [(http::header::AUTHORIZATION, HeaderValue::from_static("Bearer k"))];
        let sent = request(&target, &uri, &headers, b"{\"m\":1}");
        assert_eq!(
            String::from_utf8(sent).unwrap(),
            "POST /v1/chat/completions?x=1 HTTP/1.1\r\nhost: [::1]:8080\r\nauthorization: Bearer k\r\n\
             content-length: 7\r\n\r\n{\"m\":1}"
        );
        assert!(Target::of(&"https://a.example/v1".parse().unwrap()).is_none());
        let default_port = Target::of(&"http://a.example/v1".parse().unwrap()).unwrap();
        assert_eq!((&*default_port.authority, default_port.port), ("a.example", 80));
    }
}
