//! Idle connections by backend, checked before reuse and closed past their idle
//! timeout, and the call: a request written on a pooled or new connection, the
//! answer's head read. A write that fails on a pooled connection goes again on
//! another; nothing is retried once the request was written.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use bytes::BytesMut;
use foldhash::HashMap;
use tokio::time::Instant;
use tokio_rustls::TlsConnector;

use super::body::{Body, Framing};
use super::conn::{Conn, connect};
use super::head::{framing, poll_head, poll_send};
use super::{Error, Target};

/// How long a connection may wait in its pool.
const IDLE_TIMEOUT: Duration = Duration::from_secs(90);
/// How often a pool closes the connections idle past [`IDLE_TIMEOUT`].
const REAP_EVERY: Duration = Duration::from_secs(30);
/// The connections a pool keeps to one backend.
const MAX_IDLE: usize = 1024;

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

    pub(super) fn put(self: &Arc<Self>, authority: &Arc<str>, stream: Conn) {
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

#[cfg(test)]
mod tests {
    use std::collections::VecDeque;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::{StatusCode, Uri};
    use http_body_util::BodyExt;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    use super::super::head::MAX_HEAD;
    use super::super::request;
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
