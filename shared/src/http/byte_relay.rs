//! One relay over bytes, for the answers of gRPC methods and REST operations: a pump
//! task reads the upstream's body and feeds a channel of [`RELAYED_FRAMES`] that is
//! the client's body, so a slow client slows the upstream read and nothing is held
//! beyond a frame or two. What a frame means (a gRPC message and its trailers, a REST
//! chunk) is the [`Answer`]'s; reading, sending, the invocation's deadline and the
//! client leaving are written here once.
//!
//! Invariants: the call ends exactly once, in the pump's task, before its body ends:
//! when the answer ends, when the deadline comes (its last frame offered if the
//! client has room), or when the client leaves. Its [`Ending`] is never dropped
//! unended but by a cancelled task (the last-resort guards then hold).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use axum::body::Body;
use axum::response::Response;
use bytes::Bytes;
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use tokio::sync::mpsc;
use tracing::Instrument as _;

use super::drive::{Ended, Ending};
use crate::money::MicroEur;
use crate::upstream::grpc::BoxError;
use crate::upstream::{AnswerBody, BodyError};

/// The frames a relay reads ahead of its client: what a slow client lets it hold.
const RELAYED_FRAMES: usize = 2;

/// What goes to the client: a frame, or an error that cuts its body.
pub(super) type Relayed = Result<Frame<Bytes>, BoxError>;

/// What an answer's relay read next.
pub(super) enum Read {
    /// A frame of the upstream's answer.
    Frame(Frame<Bytes>),
    /// The upstream's answer ended.
    End,
    /// The upstream's answer broke.
    Broken(BodyError),
    /// The invocation's deadline came first.
    Deadline,
}

/// What a relay does with what it read.
pub(super) enum Next {
    /// Sends this to the client.
    Send(Relayed),
    /// Nothing to send: reads on.
    Skip,
    /// The call has ended: the relay stops.
    Ended,
}

/// A relayed answer's call while it is open: the upstream's body and the call's end.
pub(super) struct Open {
    /// The upstream's answer; dropped as soon as the call ends, so that its stream is
    /// released at once rather than when the client's response is.
    body: Option<AnswerBody>,
    ending: Option<Ending>,
}

impl Open {
    /// Whether the call is still to end.
    pub fn is_open(&self) -> bool {
        self.ending.is_some()
    }

    /// Whether the upstream's body has nothing more to give.
    pub fn body_ended(&self) -> bool {
        self.body.as_ref().is_some_and(hyper::body::Body::is_end_stream)
    }

    /// Ends the call as `ended` says, once (then a no-op, costing nothing): the
    /// upstream's body released, the call settled and recorded. Its cost.
    pub async fn end(&mut self, ended: Ended) -> MicroEur {
        self.body = None;
        match self.ending.take() {
            Some(ending) => ending.end(ended).await,
            None => MicroEur(0),
        }
    }
}

/// What a relayed answer does with what it reads, and how it ends its call (through
/// its [`Open`]).
pub(super) trait Answer: Send + Sized + 'static {
    /// What to send the client of what was read (the call ended first when that is
    /// the answer's end, so that it is settled and recorded before the body ends).
    fn next(&mut self, open: &mut Open, read: Read) -> impl Future<Output = Next> + Send;

    /// The client is still reading as the deadline comes and the call is open: it
    /// ends, and this is the last item offered to the client.
    fn deadline(&mut self, open: &mut Open) -> impl Future<Output = Option<Relayed>> + Send;

    /// The client went away while the call is open: it ends, what passed charged.
    fn left(&mut self, open: &mut Open) -> impl Future<Output = ()> + Send;
}

/// `response` with its body relayed from `answer` by a pump task in the call's span.
/// A body the pump could not finish for its client (the deadline came with no room
/// for the last item) ends with an error, never as if it were complete.
/// `cutoff` is just before the invocation's deadline (serverless shape).
pub(super) fn relay(
    answer: impl Answer,
    body: AnswerBody,
    ending: Ending,
    cutoff: Option<tokio::time::Instant>,
    mut response: Response,
) -> Response {
    let (tx, rx) = mpsc::channel(RELAYED_FRAMES);
    let cut = Arc::new(AtomicBool::new(false));
    let open = Open { body: Some(body), ending: Some(ending) };
    // The pump outlives the handler: it carries the call's span along.
    tokio::spawn(pump(answer, open, cutoff, tx, cut.clone()).instrument(tracing::Span::current()));
    let frames = futures_util::stream::unfold((rx, Some(cut)), |(mut rx, cut)| async move {
        if let Some(frame) = rx.recv().await {
            return Some((frame, (rx, cut)));
        }
        cut.filter(|cut| cut.load(Ordering::Acquire))?;
        Some((Err(BoxError::from("the invocation's deadline came before the answer was sent")), (rx, None)))
    });
    *response.body_mut() = Body::new(StreamBody::new(frames));
    response
}

/// Relays the answer to the client until it ends or the client leaves; either way the
/// call ends here, in this task, before the client's body does.
async fn pump(
    mut answer: impl Answer,
    mut open: Open,
    cutoff: Option<tokio::time::Instant>,
    tx: mpsc::Sender<Relayed>,
    cut: Arc<AtomicBool>,
) {
    loop {
        let Some(read) = read(&mut open, cutoff, &tx).await else { break };
        let item = match answer.next(&mut open, read).await {
            Next::Send(item) => item,
            Next::Skip => continue,
            Next::Ended => break,
        };
        // Room first, so that an item the deadline leaves unsent is still at hand.
        match super::before(cutoff, tx.reserve()).await {
            Some(Ok(room)) => room.send(item),
            Some(Err(_)) => break,
            None => {
                // A client slower than the platform's clock (Lambda throttles a
                // streamed answer): ended at the deadline as a slow upstream is.
                tracing::warn!("answer still being sent at the invocation's deadline: ended");
                // A call already ended offers its own last item, the one that did not fit.
                let ending = if open.is_open() { answer.deadline(&mut open).await } else { None };
                let last = ending.unwrap_or(item);
                if tx.try_send(last).is_err() {
                    cut.store(true, Ordering::Release);
                }
                break;
            }
        }
    }
    if open.is_open() {
        answer.left(&mut open).await;
    }
}

/// The next frame of the answer's body, before its cutoff; `None` once the client
/// has left (or the call has ended and its body is gone).
async fn read(open: &mut Open, cutoff: Option<tokio::time::Instant>, client: &mpsc::Sender<Relayed>) -> Option<Read> {
    let body = open.body.as_mut()?;
    if hyper::body::Body::is_end_stream(body) {
        return Some(Read::End);
    }
    tokio::select! {
        biased;
        () = client.closed() => None,
        frame = super::before(cutoff, body.frame()) => Some(match frame {
            None => Read::Deadline,
            Some(None) => Read::End,
            Some(Some(Err(e))) => Read::Broken(e),
            Some(Some(Ok(frame))) => Read::Frame(frame),
        }),
    }
}
