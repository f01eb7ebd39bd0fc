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

use std::collections::VecDeque;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use foldhash::HashMap;
use http::header::{CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING};
use http::{HeaderMap, HeaderName, HeaderValue, StatusCode, Uri, Version};
use hyper::body::{Frame, SizeHint};
use rustls::pki_types::ServerName;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

/// How long a connection may wait in its pool.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How often a pool closes the connections idle past [`IDLE_TIMEOUT`].
const REAP_EVERY: Duration = Duration::from_secs(30);
/// The connections a pool keeps to one backend.
const MAX_IDLE: usize = 1024;
/// What one read asks of the socket.
const READ: usize = 8 * 1024;
/// The largest response head read (status line and headers).
const MAX_HEAD: usize = 64 * 1024;
const MAX_HEADERS: usize = 100;
/// The longest chunk-size or trailer line.
const MAX_LINE: usize = 4 * 1024;
/// What a body dropped before its end may still read from its socket to find it.
const DROP_READ: usize = 2 * MAX_LINE;

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
    /// connections are made one at a time (see [`connect`]).
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

/// Idle connections, by backend authority. One per serving thread: a socket is driven
/// by the runtime that opened it. A pool is plain ([`Pool::default`]) or holds the TLS
/// connections of one client configuration ([`Pool::tls`]).
#[derive(Default)]
pub(crate) struct Pool {
    idle: Mutex<HashMap<Arc<str>, VecDeque<Idle>>>,
    /// Whether a task closes this pool's expired connections.
    reaping: AtomicBool,
    tls: Option<TlsConnector>,
}

struct Idle {
    stream: Conn,
    since: Instant,
}

impl Pool {
    /// A pool of TLS connections made with `config`, whose handshakes offer `h2` and
    /// `http/1.1`.
    pub fn tls(mut config: rustls::ClientConfig) -> Pool {
        config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        Pool { tls: Some(TlsConnector::from(Arc::new(config))), ..Pool::default() }
    }

    /// Sends `request` to `target` and reads the answer's head.
    pub async fn post(self: &Arc<Self>, target: &Target, request: &[u8]) -> Result<http::Response<Body>, Error> {
        let mut buf = BytesMut::new();
        let (mut stream, early) = loop {
            let (mut stream, pooled) = match self.take(&target.authority) {
                Some(stream) => (stream, true),
                None => (connect(target, self.tls.as_ref()).await?, false),
            };
            let mut written = 0;
            match std::future::poll_fn(|cx| poll_send(&mut stream, request, &mut written, &mut buf, cx)).await {
                Ok(early) => break (stream, early),
                // A pooled connection the server closed while it waited: a server that
                // closed it reads no request from it.
                Err(_) if pooled => buf.clear(),
                Err(e) => return Err(e),
            }
        };
        // A request not written whole leaves the connection in the middle of it.
        let whole = early.is_none();
        let head = match early {
            Some(head) => head,
            None => std::future::poll_fn(|cx| poll_head(&mut stream, &mut buf, cx)).await?,
        };
        let (framing, keep_alive) = framing(&head)?;
        let keep_alive = keep_alive && whole;
        let mut body = Body {
            stream: Some(stream),
            buf,
            framing,
            keep_alive,
            home: Some((self.clone(), target.authority.clone())),
        };
        if matches!(body.framing, Framing::End) {
            body.release();
        }
        Ok(http::Response::from_parts(head, body))
    }

    /// Opens a connection to `target` and pools it, sending nothing: the next call
    /// to it finds the TCP (and TLS) handshake made.
    pub async fn warm(self: &Arc<Self>, target: &Target) -> Result<(), Error> {
        let stream = connect(target, self.tls.as_ref()).await?;
        self.put(&target.authority, stream);
        Ok(())
    }

    /// The most recently used of `authority`'s idle connections that is still open.
    fn take(&self, authority: &str) -> Option<Conn> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let waiting = idle.get_mut(authority)?;
        while let Some(Idle { mut stream, since }) = waiting.pop_back() {
            if since.elapsed() < IDLE_TIMEOUT && stream.still_open() {
                return Some(stream);
            }
        }
        None
    }

    fn put(self: &Arc<Self>, authority: &Arc<str>, stream: Conn) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let waiting = idle.entry(authority.clone()).or_default();
        while waiting.front().is_some_and(|oldest| oldest.since.elapsed() >= IDLE_TIMEOUT) || waiting.len() >= MAX_IDLE
        {
            waiting.pop_front();
        }
        waiting.push_back(Idle { stream, since: Instant::now() });
        drop(idle);
        if !self.reaping.load(Ordering::Relaxed)
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
            && !self.reaping.swap(true, Ordering::Relaxed)
        {
            let reaper = Reaper(Arc::downgrade(self));
            runtime.spawn(async move {
                loop {
                    tokio::time::sleep(REAP_EVERY).await;
                    let Some(pool) = reaper.0.upgrade() else { return };
                    pool.reap();
                }
            });
        }
    }

    /// Closes the connections idle past [`IDLE_TIMEOUT`].
    fn reap(&self) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.retain(|_, waiting| {
            while waiting.front().is_some_and(|oldest| oldest.since.elapsed() >= IDLE_TIMEOUT) {
                waiting.pop_front();
            }
            !waiting.is_empty()
        });
    }
}

/// The task that reaps a pool; the next connection pooled starts another once it ends
/// (its runtime shut down).
struct Reaper(std::sync::Weak<Pool>);

impl Drop for Reaper {
    fn drop(&mut self) {
        if let Some(pool) = self.0.upgrade() {
            pool.reaping.store(false, Ordering::Relaxed);
        }
    }
}

/// A connection to a backend, plain or over TLS.
enum Conn {
    Tcp(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

/// A TCP connection to `target`, with a TLS session over it when `target` is
/// `https://` (made by the pool's `tls` connector).
///
/// Until a handshake with a TLS backend has told whether it speaks `h2`, its
/// connections are made one at a time: the calls of a first burst wait for the first
/// handshake instead of each making one that is closed unused when the answer is `h2`
/// (then they go to the HTTP/2 client without connecting here).
async fn connect(target: &Target, tls: Option<&TlsConnector>) -> Result<Conn, Error> {
    let (connector, tls_target) = match (tls, &target.tls) {
        (None, None) => return tcp(target).await.map(Conn::Tcp),
        (Some(connector), Some(tls_target)) => (connector, tls_target),
        _ => return Err(Error::Connect(io::Error::other("a TLS backend through a plain pool, or the reverse"))),
    };
    let mut told = tls_target.told.lock().await;
    if *told {
        drop(told);
        if tls_target.speaks_h2.load(Ordering::Relaxed) {
            return Err(Error::SpeaksH2);
        }
        return handshake(target, connector, tls_target).await;
    }
    let conn = handshake(target, connector, tls_target).await;
    // A handshake that failed told nothing: the next call tries again.
    *told = matches!(conn, Ok(_) | Err(Error::SpeaksH2));
    conn
}

async fn tcp(target: &Target) -> Result<TcpStream, Error> {
    let stream = TcpStream::connect((target.host.as_str(), target.port)).await.map_err(Error::Connect)?;
    stream.set_nodelay(true).map_err(Error::Connect)?;
    Ok(stream)
}

/// A TLS session to `target`, noting what its server chose; `SpeaksH2` (the
/// connection closed unused) when it chose `h2`.
async fn handshake(target: &Target, connector: &TlsConnector, tls_target: &TlsTarget) -> Result<Conn, Error> {
    let stream = tcp(target).await?;
    let stream = connector.connect(tls_target.name.clone(), stream).await.map_err(Error::Tls)?;
    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
    tls_target.speaks_h2.store(h2, Ordering::Relaxed);
    if h2 {
        return Err(Error::SpeaksH2);
    }
    Ok(Conn::Tls(Box::new(stream)))
}

impl Conn {
    /// Whether an idle connection can carry a request: nothing to read on it (an
    /// end-of-file, a reset, or bytes it should not have sent all rule it out). Costs
    /// no system call unless the socket was last seen readable.
    fn still_open(&mut self) -> bool {
        let read = match self {
            Conn::Tcp(stream) => stream.try_read(&mut [0u8; 1]),
            Conn::Tls(_) => self.try_read_buf(&mut BytesMut::new()),
        };
        matches!(read, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Reads what is there into `buf`, without waiting (`WouldBlock` when nothing is).
    fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        match self {
            Conn::Tcp(stream) => stream.try_read_buf(buf),
            Conn::Tls(_) => match self.poll_read(buf, &mut Context::from_waker(std::task::Waker::noop())) {
                Poll::Ready(read) => read,
                Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
            },
        }
    }

    /// Reads into `buf` once the connection is readable. A plain connection's `buf` is
    /// let go while it waits empty; a TLS one reads through a buffer on the stack into
    /// `buf`, so the same holds.
    fn poll_read(&mut self, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
        let stream = match self {
            Conn::Tcp(stream) => stream,
            Conn::Tls(tls) => {
                let mut chunk = [0u8; READ];
                let mut read = ReadBuf::new(&mut chunk);
                if let Err(e) = ready!(Pin::new(&mut **tls).poll_read(cx, &mut read)) {
                    return Poll::Ready(Err(e));
                }
                buf.extend_from_slice(read.filled());
                return Poll::Ready(Ok(read.filled().len()));
            }
        };
        loop {
            if stream.poll_read_ready(cx)?.is_pending() {
                if buf.is_empty() {
                    *buf = BytesMut::new();
                }
                return Poll::Pending;
            }
            if buf.capacity() - buf.len() < READ / 4 {
                buf.reserve(READ);
            }
            match stream.try_read_buf(buf) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                read => return Poll::Ready(read),
            }
        }
    }

    fn poll_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            Conn::Tcp(stream) => Pin::new(stream).poll_write(cx, data),
            Conn::Tls(tls) => Pin::new(&mut **tls).poll_write(cx, data),
        }
    }

    /// Sends what TLS still holds of the request (nothing for a plain connection).
    fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Conn::Tcp(_) => Poll::Ready(Ok(())),
            Conn::Tls(tls) => Pin::new(&mut **tls).poll_flush(cx),
        }
    }
}

/// Writes what is left of `request` past `written`. A backend may answer before it
/// has read all of it (a 413, a 401: RFC 9112 §9.6) and then stop reading, or close
/// the connection: a write that cannot go on, or fails, looks for that answer's head
/// and ends with it (`Some`) if it came. `None`: the request was written whole.
fn poll_send(
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
fn poll_head(
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
fn framing(head: &http::response::Parts) -> Result<(Framing, bool), Error> {
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

enum Framing {
    /// This many bytes are left.
    Length(u64),
    /// Chunked: this many bytes of the current chunk are left.
    Chunk(u64),
    /// Chunked: a line is next.
    Line(Line),
    /// Everything until the backend closes the connection.
    Close,
    End,
}

#[derive(Clone, Copy)]
enum Line {
    /// A chunk's size.
    Size,
    /// The line end after a chunk's data.
    DataEnd,
    /// A trailer field, or the empty line that ends the body.
    Trailer,
}

/// An answer's body, read from its connection as the caller asks for it.
pub struct Body {
    /// `None` once the body ended or failed.
    stream: Option<Conn>,
    buf: BytesMut,
    framing: Framing,
    keep_alive: bool,
    /// Where the connection goes back to at the end.
    home: Option<(Arc<Pool>, Arc<str>)>,
}

impl Body {
    /// The next piece of data in `buf`; `None` when more must be read or the body
    /// has ended.
    fn decode(&mut self) -> Result<Option<Bytes>, Error> {
        loop {
            match &mut self.framing {
                Framing::End => return Ok(None),
                Framing::Close => return Ok((!self.buf.is_empty()).then(|| self.buf.split().freeze())),
                Framing::Length(left) => {
                    let Some(data) = front(&mut self.buf, left) else { return Ok(None) };
                    if *left == 0 {
                        self.framing = Framing::End;
                    }
                    return Ok(Some(data));
                }
                Framing::Chunk(left) => {
                    let Some(data) = front(&mut self.buf, left) else { return Ok(None) };
                    if *left == 0 {
                        self.framing = Framing::Line(Line::DataEnd);
                    }
                    return Ok(Some(data));
                }
                Framing::Line(kind) => {
                    let Some(line) = line(&mut self.buf)? else { return Ok(None) };
                    self.framing = match *kind {
                        Line::Size => match chunk_size(&line)? {
                            0 => Framing::Line(Line::Trailer),
                            size => Framing::Chunk(size),
                        },
                        Line::DataEnd if line.is_empty() => Framing::Line(Line::Size),
                        Line::DataEnd => return Err(invalid("a chunk longer than its size")),
                        Line::Trailer if line.is_empty() => Framing::End,
                        Line::Trailer => Framing::Line(Line::Trailer),
                    };
                }
            }
        }
    }

    /// Gives the connection back to its pool if it can carry another request.
    fn release(&mut self) {
        if let Some(stream) = self.stream.take()
            && self.keep_alive
            && self.buf.is_empty()
            && let Some((pool, authority)) = &self.home
        {
            pool.put(authority, stream);
        }
    }

    fn fail(&mut self, error: Error) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        self.stream = None;
        self.framing = Framing::End;
        Poll::Ready(Some(Err(error)))
    }
}

/// A caller that stops at an answer's last event (a stream's `[DONE]`) drops the body
/// before its end is read: the chunked body's last line, often already arrived; one
/// that refuses an answer (a 5xx) drops it unread. What is there is read without
/// waiting, [`DROP_READ`] bytes at most from the socket, and the connection pooled if
/// that ends the answer; otherwise it closes.
impl Drop for Body {
    fn drop(&mut self) {
        if !self.keep_alive {
            return;
        }
        let mut read = 0;
        loop {
            match self.decode() {
                Ok(Some(_)) => continue,
                Ok(None) if matches!(self.framing, Framing::End) => return self.release(),
                Ok(None) => {}
                Err(_) => return,
            }
            let Some(stream) = &mut self.stream else { return };
            if read >= DROP_READ {
                return;
            }
            self.buf.reserve(MAX_LINE);
            match stream.try_read_buf(&mut self.buf) {
                Ok(n) if n > 0 => read += n,
                _ => return,
            }
        }
    }
}

/// Up to `left` bytes from the front of `buf`; `None` if it is empty.
fn front(buf: &mut BytesMut, left: &mut u64) -> Option<Bytes> {
    if buf.is_empty() {
        return None;
    }
    let n = usize::try_from(*left).unwrap_or(usize::MAX).min(buf.len());
    *left -= n as u64;
    Some(buf.split_to(n).freeze())
}

/// A line from the front of `buf`, without its end (`\r\n`, or a bare `\n`).
fn line(buf: &mut BytesMut) -> Result<Option<BytesMut>, Error> {
    match buf.iter().position(|&b| b == b'\n') {
        Some(end) => {
            let mut line = buf.split_to(end + 1);
            line.truncate(if end > 0 && line[end - 1] == b'\r' { end - 1 } else { end });
            Ok(Some(line))
        }
        None if buf.len() > MAX_LINE => Err(invalid(format!("a chunk line longer than {MAX_LINE} bytes"))),
        None => Ok(None),
    }
}

/// A chunk's size: hexadecimal digits, maybe followed by extensions (ignored).
fn chunk_size(line: &[u8]) -> Result<u64, Error> {
    let digits = line.split(|&b| b == b';').next().unwrap_or_default().trim_ascii();
    std::str::from_utf8(digits)
        .ok()
        .filter(|d| !d.is_empty() && d.len() <= 16 && d.bytes().all(|b| b.is_ascii_hexdigit()))
        .and_then(|d| u64::from_str_radix(d, 16).ok())
        .ok_or_else(|| invalid(format!("the chunk size `{}`", String::from_utf8_lossy(digits))))
}

impl hyper::body::Body for Body {
    type Data = Bytes;
    type Error = Error;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Error>>> {
        let this = self.get_mut();
        loop {
            match this.decode() {
                Err(e) => return this.fail(e),
                Ok(Some(data)) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                Ok(None) if matches!(this.framing, Framing::End) => {
                    this.release();
                    return Poll::Ready(None);
                }
                Ok(None) => {}
            }
            let Some(stream) = &mut this.stream else { return Poll::Ready(None) };
            match ready!(stream.poll_read(&mut this.buf, cx)) {
                Err(e) => return this.fail(e.into()),
                Ok(0) if matches!(this.framing, Framing::Close) => {
                    this.stream = None;
                    this.framing = Framing::End;
                }
                Ok(0) => return this.fail(Error::Closed),
                Ok(_) => {}
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        matches!(self.framing, Framing::End)
    }

    fn size_hint(&self) -> SizeHint {
        match self.framing {
            Framing::Length(left) => SizeHint::with_exact(left),
            Framing::End => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// A backend on loopback: it answers each request it reads with the next of
    /// `replies` (pausing 20 ms at each `|`), and closes the connection after a reply
    /// marked so. Counts the connections it accepted.
    async fn peer(replies: Vec<(&'static str, bool)>) -> (Target, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: Uri = format!("http://{}/v1", listener.local_addr().unwrap()).parse().unwrap();
        let accepted = Arc::new(AtomicUsize::new(0));
        let replies = Arc::new(Mutex::new(VecDeque::from(replies)));
        let counter = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                counter.fetch_add(1, Ordering::Relaxed);
                let replies = replies.clone();
                tokio::spawn(async move {
                    while read_request(&mut socket).await {
                        let Some((reply, close)) = replies.lock().unwrap().pop_front() else { return };
                        for (i, piece) in reply.split('|').enumerate() {
                            if i > 0 {
                                tokio::time::sleep(Duration::from_millis(20)).await;
                            }
                            if socket.write_all(piece.as_bytes()).await.is_err() {
                                return;
                            }
                        }
                        if close {
                            return;
                        }
                    }
                });
            }
        });
        (Target::of(&url).unwrap(), accepted)
    }

    /// Reads a request's head, byte by byte; `None` at the end.
    async fn read_head(socket: &mut TcpStream) -> Option<String> {
        let mut seen = Vec::new();
        let mut byte = [0u8; 1];
        while !seen.ends_with(b"\r\n\r\n") {
            if socket.read(&mut byte).await.unwrap_or(0) == 0 {
                return None;
            }
            seen.push(byte[0]);
        }
        Some(String::from_utf8(seen).unwrap())
    }

    /// Reads one request (its head and its content-length's bytes); false at the end.
    async fn read_request(socket: &mut TcpStream) -> bool {
        let Some(head) = read_head(socket).await else { return false };
        let length = head.lines().find_map(|l| l.strip_prefix("content-length: ")).unwrap().parse().unwrap();
        let mut body = vec![0u8; length];
        socket.read_exact(&mut body).await.is_ok()
    }

    async fn call(pool: &Arc<Pool>, target: &Target) -> Result<http::Response<Body>, Error> {
        let uri: Uri = format!("http://{}/v1/chat/completions", target.authority).parse().unwrap();
        pool.post(target, &request(target, &uri, &[], b"{}")).await
    }

    async fn text(answer: http::Response<Body>) -> Result<String, Error> {
        let bytes = answer.into_body().collect().await?.to_bytes();
        Ok(String::from_utf8(bytes.to_vec()).unwrap())
    }

    fn idle(pool: &Pool, target: &Target) -> usize {
        pool.idle.lock().unwrap().get(&target.authority).map_or(0, VecDeque::len)
    }

    const OK: &str = "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 7\r\n\r\n{\"a\":1}";

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

    /// Decodes `wire` fed to the body a byte at a time: every split a socket can make.
    fn decoded(framing: Framing, wire: &[u8]) -> Result<(Vec<u8>, bool), Error> {
        let mut body = Body { stream: None, buf: BytesMut::new(), framing, keep_alive: true, home: None };
        let mut out = Vec::new();
        for &byte in wire {
            body.buf.extend_from_slice(&[byte]);
            while let Some(data) = body.decode()? {
                out.extend_from_slice(&data);
            }
        }
        Ok((out, matches!(body.framing, Framing::End)))
    }

    #[test]
    fn a_chunked_body_is_read_across_any_split_with_its_extensions_and_trailers_dropped() {
        let wire = b"5;ext=1\r\nhello\r\nA\r\n, world!!!\r\n0\r\nx-trailer: t\r\n\r\n";
        assert_eq!(decoded(Framing::Line(Line::Size), wire).unwrap(), (b"hello, world!!!".to_vec(), true));
        // Bare line feeds are read as line ends too.
        assert_eq!(decoded(Framing::Line(Line::Size), b"2\nok\n0\n\n").unwrap(), (b"ok".to_vec(), true));
        // Not ended until the empty line after the last chunk.
        assert_eq!(decoded(Framing::Line(Line::Size), b"2\r\nok\r\n0\r\n").unwrap(), (b"ok".to_vec(), false));
        assert_eq!(decoded(Framing::Length(4), b"abcd").unwrap(), (b"abcd".to_vec(), true));
    }

    #[test]
    fn a_malformed_chunk_is_an_error() {
        for wire in [&b"zz\r\n"[..], b"2\r\nokay\r\n", b"11111111111111111\r\n", b"\r\n"] {
            let error = decoded(Framing::Line(Line::Size), wire).unwrap_err();
            assert!(matches!(error, Error::Invalid(_)), "{wire:?}: {error}");
        }
        let endless = vec![b'1'; MAX_LINE + 2];
        assert!(matches!(decoded(Framing::Line(Line::Size), &endless), Err(Error::Invalid(_))));
    }

    #[tokio::test]
    async fn a_connection_is_used_again_only_after_its_answer_was_read_to_its_end() {
        let slow = "HTTP/1.1 200 OK\r\ncontent-length: 7\r\n\r\n|{\"a\":1}";
        let (target, accepted) = peer(vec![(OK, false), (OK, false), (OK, false), (slow, false), (OK, false)]).await;
        let pool = Arc::new(Pool::default());
        for _ in 0..2 {
            let answer = call(&pool, &target).await.unwrap();
            assert_eq!(answer.status(), StatusCode::OK);
            assert_eq!(answer.headers()["content-type"], "application/json");
            assert_eq!(text(answer).await.unwrap(), "{\"a\":1}");
            assert_eq!(idle(&pool, &target), 1);
        }
        assert_eq!(accepted.load(Ordering::Relaxed), 1);

        // An answer dropped unread (a refused 5xx) whose body has come is read to its
        // end at the drop; one whose body has not come closes its connection, and the
        // next call opens another.
        drop(call(&pool, &target).await.unwrap());
        assert_eq!(idle(&pool, &target), 1);
        drop(call(&pool, &target).await.unwrap());
        assert_eq!(idle(&pool, &target), 0);
        assert_eq!(text(call(&pool, &target).await.unwrap()).await.unwrap(), "{\"a\":1}");
        assert_eq!(accepted.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn a_body_dropped_after_its_last_data_is_pooled_once_its_end_has_come() {
        let stream = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\n[DONE]\r\n|0\r\n\r\n";
        let cut = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\n[DONE]\r\n|x";
        let (target, accepted) = peer(vec![(stream, false), (stream, false), (cut, false), (OK, false)]).await;
        let pool = Arc::new(Pool::default());
        // Its end arrived after the last event was read: read at the drop.
        let mut body = call(&pool, &target).await.unwrap().into_body();
        assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "[DONE]");
        tokio::time::sleep(Duration::from_millis(60)).await;
        drop(body);
        assert_eq!(idle(&pool, &target), 1);
        // Not arrived yet, or not an end: the connection closes.
        for _ in 0..2 {
            let mut body = call(&pool, &target).await.unwrap().into_body();
            assert_eq!(body.frame().await.unwrap().unwrap().into_data().unwrap(), "[DONE]");
            drop(body);
            assert_eq!(idle(&pool, &target), 0);
        }
        assert_eq!(text(call(&pool, &target).await.unwrap()).await.unwrap(), "{\"a\":1}");
        assert_eq!(accepted.load(Ordering::Relaxed), 3);
    }

    #[tokio::test]
    async fn a_connection_idle_past_its_timeout_is_closed_without_another_call() {
        let (target, _) = peer(vec![(OK, false)]).await;
        let pool = Arc::new(Pool::default());
        assert_eq!(text(call(&pool, &target).await.unwrap()).await.unwrap(), "{\"a\":1}");
        assert_eq!(idle(&pool, &target), 1);
        // The clock stands still but for these sleeps: the pool's task runs at each of
        // its times as they pass.
        tokio::time::pause();
        tokio::time::sleep(IDLE_TIMEOUT - REAP_EVERY / 2).await;
        assert_eq!(idle(&pool, &target), 1);
        tokio::time::sleep(REAP_EVERY).await;
        assert!(pool.idle.lock().unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_large_body_dropped_unread_is_not_read_to_its_end() {
        let large: &'static str =
            format!("HTTP/1.1 200 OK\r\ncontent-length: 100000\r\n\r\n{}", "a".repeat(100_000)).leak();
        let (target, _) = peer(vec![(large, false)]).await;
        let pool = Arc::new(Pool::default());
        let answer = call(&pool, &target).await.unwrap();
        // All of it has come by now; the drop reads some and gives up.
        tokio::time::sleep(Duration::from_millis(50)).await;
        drop(answer);
        assert_eq!(idle(&pool, &target), 0);
    }

    #[tokio::test]
    async fn an_answer_that_says_close_or_ends_with_the_connection_is_not_pooled() {
        let close = "HTTP/1.1 200 OK\r\nconnection: Close\r\ncontent-length: 2\r\n\r\nok";
        let until_close = "HTTP/1.1 200 OK\r\n\r\nall of it";
        let old = "HTTP/1.0 200 OK\r\ncontent-length: 2\r\n\r\nok";
        let (target, accepted) = peer(vec![(close, true), (until_close, true), (old, true), (OK, false)]).await;
        let pool = Arc::new(Pool::default());
        for expected in ["ok", "all of it", "ok", "{\"a\":1}"] {
            assert_eq!(text(call(&pool, &target).await.unwrap()).await.unwrap(), expected);
        }
        assert_eq!(accepted.load(Ordering::Relaxed), 4);
        assert_eq!(idle(&pool, &target), 1);
    }

    #[tokio::test]
    async fn a_pooled_connection_the_backend_closed_is_not_used() {
        let (target, accepted) = peer(vec![(OK, true), (OK, false)]).await;
        let pool = Arc::new(Pool::default());
        assert_eq!(text(call(&pool, &target).await.unwrap()).await.unwrap(), "{\"a\":1}");
        assert_eq!(idle(&pool, &target), 1);
        // The backend's end-of-file reaches the runtime while the connection waits.
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(text(call(&pool, &target).await.unwrap()).await.unwrap(), "{\"a\":1}");
        assert_eq!(accepted.load(Ordering::Relaxed), 2);
    }

    #[tokio::test]
    async fn interim_heads_are_skipped_and_an_empty_answer_frees_its_connection_at_once() {
        let interim = "HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: x\r\n\r\n\
                       HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok";
        let empty = "HTTP/1.1 204 No Content\r\n\r\n";
        let (target, accepted) = peer(vec![(interim, false), (empty, false), (OK, false)]).await;
        let pool = Arc::new(Pool::default());
        let answer = call(&pool, &target).await.unwrap();
        assert_eq!(answer.status(), StatusCode::CREATED);
        assert_eq!(text(answer).await.unwrap(), "ok");
        let answer = call(&pool, &target).await.unwrap();
        assert_eq!(answer.status(), StatusCode::NO_CONTENT);
        assert!(hyper::body::Body::is_end_stream(answer.body()));
        assert_eq!(idle(&pool, &target), 1);
        drop(answer);
        assert_eq!(text(call(&pool, &target).await.unwrap()).await.unwrap(), "{\"a\":1}");
        assert_eq!(accepted.load(Ordering::Relaxed), 1);
    }

    #[tokio::test]
    async fn an_answer_cut_short_or_malformed_is_an_error() {
        let cut = "HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc";
        let answer = call(&Arc::new(Pool::default()), &peer(vec![(cut, true)]).await.0).await.unwrap();
        assert_eq!(hyper::body::Body::size_hint(answer.body()).exact(), Some(10));
        assert!(matches!(text(answer).await, Err(Error::Closed)));

        let chunk_cut = "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab";
        let answer = call(&Arc::new(Pool::default()), &peer(vec![(chunk_cut, true)]).await.0).await.unwrap();
        assert!(matches!(text(answer).await, Err(Error::Closed)));

        let no_answer = peer(vec![("", true)]).await.0;
        assert!(matches!(call(&Arc::new(Pool::default()), &no_answer).await, Err(Error::Closed)));

        let long_head: &'static str = format!("HTTP/1.1 200 OK\r\nx: {}\r\n", "a".repeat(MAX_HEAD)).leak();
        for malformed in [
            "not http\r\n\r\n",
            "HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-length: 3\r\n\r\nok",
            "HTTP/1.1 200 OK\r\ncontent-length: +2\r\n\r\nok",
            "HTTP/1.1 200 OK\r\ncontent-length: \r\n\r\nok",
            "HTTP/1.1 200 OK\r\ncontent-length: 2\u{ff}\r\n\r\nok",
            "HTTP/1.1 200 OK\r\ntransfer-encoding: ,\r\n\r\nok",
            "HTTP/1.1 101 Switching Protocols\r\n\r\n",
            long_head,
        ] {
            let target = peer(vec![(malformed, true)]).await.0;
            let error = call(&Arc::new(Pool::default()), &target).await.err();
            assert!(matches!(error, Some(Error::Invalid(_))), "{malformed:.40}: {error:?}");
        }
    }

    /// A backend that answers once it has read the request's head, before its body
    /// (a 413, a 401), then either closes the connection with the body unread
    /// (`close`) or keeps it open without reading on.
    async fn early(close: bool) -> Target {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: Uri = format!("http://{}/v1", listener.local_addr().unwrap()).parse().unwrap();
        tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            read_head(&mut socket).await.expect("a request's head");
            let refusal = "HTTP/1.1 413 Payload Too Large\r\nconnection: close\r\ncontent-length: 9\r\n\r\ntoo large";
            socket.write_all(refusal.as_bytes()).await.unwrap();
            if !close {
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
        });
        Target::of(&url).unwrap()
    }

    #[tokio::test]
    async fn a_backend_that_answers_before_it_has_read_the_body_is_heard() {
        for close in [true, false] {
            let target = early(close).await;
            let pool = Arc::new(Pool::default());
            let uri: Uri = format!("http://{}/v1/chat/completions", target.authority).parse().unwrap();
            // More than loopback's socket buffers hold: the write cannot end unread.
            let body = vec![b' '; 64 << 20];
            let request = request(&target, &uri, &[], &body);
            let answer = tokio::time::timeout(Duration::from_secs(10), pool.post(&target, &request))
                .await
                .expect("an answer, not a wait");
            let answer = answer.unwrap_or_else(|e| panic!("close {close}: {e}"));
            assert_eq!(answer.status(), StatusCode::PAYLOAD_TOO_LARGE);
            assert_eq!(text(answer).await.unwrap(), "too large");
            assert_eq!(idle(&pool, &target), 0, "a connection with a request half written is not used again");
        }
    }

    #[tokio::test]
    async fn a_backend_that_is_not_there_is_a_connect_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url: Uri = format!("http://{}/v1", listener.local_addr().unwrap()).parse().unwrap();
        drop(listener);
        let error = call(&Arc::new(Pool::default()), &Target::of(&url).unwrap()).await.err().unwrap();
        assert!(matches!(error, Error::Connect(_)), "{error}");
        assert!(error.to_string().starts_with("tcp connect error: "), "{error}");
    }
}
