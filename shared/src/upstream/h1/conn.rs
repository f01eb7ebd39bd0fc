//! A connection to a backend, plain or over TLS: how it is made (the TLS handshake
//! telling whether the backend speaks `h2`), and how the calling task reads and writes
//! it. A plain connection's read buffer is let go while it waits empty.

use std::io;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, ready};

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;

use super::{Error, Target, TlsTarget};

/// What one read asks of the socket.
const READ: usize = 8 * 1024;

/// A connection to a backend, plain or over TLS.
pub(super) enum Conn {
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
pub(super) async fn connect(target: &Target, tls: Option<&TlsConnector>) -> Result<Conn, Error> {
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
    /// no system call unless the runtime saw the socket readable since its answer was
    /// read (an end-of-file that came while it waited in the pool), as hyper's own
    /// pool tells a closed connection.
    pub(super) fn still_open(&mut self) -> bool {
        let read = match self {
            Conn::Tcp(stream) => stream.try_read(&mut [0u8; 1]),
            Conn::Tls(_) => self.try_read_buf(&mut BytesMut::new()),
        };
        matches!(read, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Reads what is there into `buf`, without waiting (`WouldBlock` when nothing is).
    pub(super) fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
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
    pub(super) fn poll_read(&mut self, buf: &mut BytesMut, cx: &mut Context<'_>) -> Poll<io::Result<usize>> {
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
            // tokio's own read, not `try_read_buf`: a read that leaves room in `buf`
            // drained the socket, and tokio then forgets its readiness (epoll tells of
            // the next bytes), so the pool's check of this connection before its next
            // call costs no system call.
            match tokio_util::io::poll_read_buf(Pin::new(&mut *stream), cx, buf) {
                Poll::Pending => continue,
                read => return read,
            }
        }
    }

    pub(super) fn poll_write(&mut self, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
        match self {
            Conn::Tcp(stream) => Pin::new(stream).poll_write(cx, data),
            Conn::Tls(tls) => Pin::new(&mut **tls).poll_write(cx, data),
        }
    }

    /// Sends what TLS still holds of the request (nothing for a plain connection).
    pub(super) fn poll_flush(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Conn::Tcp(_) => Poll::Ready(Ok(())),
            Conn::Tls(tls) => Pin::new(&mut **tls).poll_flush(cx),
        }
    }
}
