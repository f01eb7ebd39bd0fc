//! Properties of the SSE splitter and of the bounded event reader over arbitrary
//! bytes cut at arbitrary places: no panic; how the bytes are chunked never changes
//! the events; the reader never hands out (or holds) an event over its limit.

use std::time::Duration;

use bytes::Bytes;
use flexway::protocol::sse::{Event, Splitter};
use flexway::upstream::body::{Events, Fault};
use http_body_util::StreamBody;
use hyper::body::Frame;
use proptest::prelude::*;

/// Bytes that look like SSE often enough to matter: fields, line ends, blank lines.
fn sse_like() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"data: ".to_vec()),
        Just(b"event: x".to_vec()),
        Just(b": comment".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"\n\n".to_vec()),
        Just(b"[DONE]".to_vec()),
        Just(b"{\"a\":1}".to_vec()),
        prop::collection::vec(any::<u8>(), 0..40),
    ];
    prop::collection::vec(piece, 0..60).prop_map(|pieces| pieces.concat())
}

fn cuts(len: usize) -> impl Strategy<Value = Vec<usize>> {
    prop::collection::vec(0..=len, 0..8).prop_map(|mut cuts| {
        cuts.sort_unstable();
        cuts
    })
}

fn chunked(bytes: &[u8], cuts: &[usize]) -> Vec<Vec<u8>> {
    let mut chunks = Vec::new();
    let mut from = 0;
    for &cut in cuts.iter().chain([bytes.len()].iter()) {
        chunks.push(bytes[from..cut].to_vec());
        from = cut;
    }
    chunks
}

fn split_all(chunks: &[Vec<u8>]) -> (Vec<Event>, Vec<u8>) {
    let mut splitter = Splitter::default();
    let mut events = Vec::new();
    for chunk in chunks {
        splitter.push(chunk);
        events.extend(std::iter::from_fn(|| splitter.next_event()));
    }
    (events, splitter.pending().to_vec())
}

/// A body of these chunks, as a backend's would arrive.
fn body<S>(chunks: S) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Unpin>
where
    S: futures_util::Stream<Item = Result<Bytes, std::io::Error>> + Unpin,
{
    use futures_util::StreamExt as _;
    StreamBody::new(chunks.map(|chunk| chunk.map(Frame::data)))
}

fn response(
    chunks: Vec<Vec<u8>>,
) -> StreamBody<impl futures_util::Stream<Item = Result<Frame<Bytes>, std::io::Error>> + Unpin> {
    body(futures_util::stream::iter(chunks.into_iter().map(|c| Ok::<_, std::io::Error>(Bytes::from(c)))))
}

proptest! {
    #[test]
    fn chunking_never_changes_the_events(
        (bytes, cuts) in sse_like().prop_flat_map(|bytes| { let len = bytes.len(); (Just(bytes), cuts(len)) }),
    ) {
        let whole = split_all(std::slice::from_ref(&bytes));
        let pieces = split_all(&chunked(&bytes, &cuts));
        prop_assert_eq!(&whole, &pieces);
        // Nothing is lost or invented: the events and what is pending are the input.
        let mut rebuilt: Vec<u8> = whole.0.iter().flat_map(|e| e.raw.to_vec()).collect();
        rebuilt.extend(&whole.1);
        prop_assert_eq!(rebuilt, bytes);
    }

    #[test]
    fn the_reader_never_hands_out_an_event_over_its_limit(
        bytes in sse_like(),
        cuts in cuts(2048),
        limit in 1u64..64,
    ) {
        let cuts: Vec<usize> = cuts.into_iter().filter(|c| *c <= bytes.len()).collect();
        let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
        runtime.block_on(async {
            let mut events = Events::new(response(chunked(&bytes, &cuts)), limit);
            let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
            loop {
                match events.next(deadline).await {
                    Ok(Some(event)) => assert!(event.raw.len() as u64 <= limit, "{} > {limit}", event.raw.len()),
                    Ok(None) => break,
                    Err(Fault::Invalid(message)) => {
                        assert!(message.contains("max_event_bytes"), "{message}");
                        break;
                    }
                    Err(other) => panic!("{other:?}"),
                }
            }
        });
    }
}

#[tokio::test]
async fn an_endless_line_is_refused_once_past_the_limit_not_buffered() {
    // 64 MiB of one line, produced lazily: the reader must stop near 1 MiB.
    let produced = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = produced.clone();
    let frames = futures_util::stream::iter(0..1024).map(move |_| {
        counter.fetch_add(64 * 1024, std::sync::atomic::Ordering::Relaxed);
        Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 64 * 1024]))
    });
    use futures_util::StreamExt as _;
    let mut events = Events::new(body(frames), 1024 * 1024);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let fault = events.next(deadline).await.unwrap_err();
    assert!(matches!(fault, Fault::Invalid(ref m) if m.contains("max_event_bytes")), "{fault:?}");
    let read = produced.load(std::sync::atomic::Ordering::Relaxed);
    assert!(read <= 1024 * 1024 + 2 * 64 * 1024, "read {read} bytes before refusing");
}

#[tokio::test]
async fn a_stalled_stream_is_a_timeout() {
    let never = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
    let mut events = Events::new(body(never), 1024);
    let deadline = tokio::time::Instant::now() + Duration::from_millis(20);
    assert_eq!(events.next(deadline).await.unwrap_err(), Fault::Timeout);
}

/// Trailers (an HTTP/2 backend may send them after its data) are skipped: the data on
/// either side of them is read, whole or as events.
#[tokio::test]
async fn trailers_between_data_are_skipped() {
    let frames = || {
        let mut trailers = http::HeaderMap::new();
        trailers.insert("x-trailer", http::HeaderValue::from_static("1"));
        let frames = [
            Frame::data(Bytes::from_static(b"data: one\n\n")),
            Frame::trailers(trailers),
            Frame::data(Bytes::from_static(b"data: two\n\n")),
        ];
        StreamBody::new(futures_util::stream::iter(frames.map(Ok::<_, std::io::Error>)))
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let whole = flexway::upstream::body::read_whole(frames(), 1024, deadline).await.unwrap();
    assert_eq!(&whole[..], b"data: one\n\ndata: two\n\n");
    let mut events = Events::new(frames(), 1024);
    let mut data = Vec::new();
    while let Some(event) = events.next(deadline).await.unwrap() {
        data.push(event.data);
    }
    assert_eq!(data, ["one", "two"]);
}
