//! An answer's body, decoded (by its length, chunked, or until the close) as the
//! caller reads it, and its connection given back to its pool once its end was read.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::{Bytes, BytesMut};
use hyper::body::{Frame, SizeHint};

use super::conn::Conn;
use super::pool::Pool;
use super::{Error, invalid};

/// The longest chunk-size or trailer line.
const MAX_LINE: usize = 4 * 1024;
/// What a body dropped before its end may still read from its socket to find it.
const DROP_READ: usize = 2 * MAX_LINE;

pub(super) enum Framing {
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
pub(super) enum Line {
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
    pub(super) stream: Option<Conn>,
    pub(super) buf: BytesMut,
    pub(super) framing: Framing,
    pub(super) keep_alive: bool,
    /// Where the connection goes back to at the end.
    pub(super) home: Option<(Arc<Pool>, Arc<str>)>,
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
    pub(super) fn release(&mut self) {
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
    use super::*;

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
}
