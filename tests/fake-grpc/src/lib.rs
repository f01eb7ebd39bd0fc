//! A metered OCR-like gRPC service for Flexway's gRPC tests and benchmark: a real
//! tonic server on loopback, from `ocr.proto` (which imports the contract,
//! `proto/flexway/v1/options.proto`), with the descriptor set a gateway's
//! `kind: grpc` backend names ([`DESCRIPTOR_SET`]) and the generated clients.
//!
//! Deterministic: an answer's text is `reply_bytes` bytes of `x` when asked, else the
//! request data's length in decimal; `fail_with` answers that gRPC code instead;
//! `Pages` sends `count` answers `delay_ms` apart; `Converse` answers each message as
//! it comes (so a proxy that buffered a direction would hang).
#![allow(clippy::unwrap_used)]

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

pub mod picker;

pub mod pb {
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("ocr.v1");
}

use pb::ocr_server::{Ocr, OcrServer};
use pb::{Image, Ping, Text};

/// The serialized FileDescriptorSet of `ocr.proto` and its imports, custom options
/// included: what a `kind: grpc` backend's `descriptor_set` file holds.
pub const DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/ocr.binpb"));

/// A running server; stops on drop.
pub struct FakeOcr {
    pub addr: SocketAddr,
    calls: Arc<AtomicU64>,
    connections: Arc<AtomicU64>,
    _stop: oneshot::Sender<()>,
}

impl FakeOcr {
    pub async fn start() -> std::io::Result<FakeOcr> {
        Self::start_allowing(None).await
    }

    /// A server that takes at most `max_streams` streams on one connection (tonic's
    /// own default: no limit).
    pub async fn start_allowing(max_streams: Option<u32>) -> std::io::Result<FakeOcr> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let calls = Arc::new(AtomicU64::new(0));
        let connections = Arc::new(AtomicU64::new(0));
        let accepted = connections.clone();
        let incoming = TcpListenerStream::new(listener).map(move |connection| {
            accepted.fetch_add(1, Ordering::SeqCst);
            connection
        });
        let (stop, stopped) = oneshot::channel::<()>();
        let service = OcrServer::new(Service { calls: calls.clone() });
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .max_concurrent_streams(max_streams)
                .add_service(service)
                .serve_with_incoming_shutdown(incoming, async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(FakeOcr { addr, calls, connections, _stop: stop })
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.connections.load(Ordering::SeqCst)
    }

    /// `http://127.0.0.1:PORT`, the backend's `url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Calls received, of every method.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }
}

struct Service {
    calls: Arc<AtomicU64>,
}

impl Service {
    fn called(&self) {
        self.calls.fetch_add(1, Ordering::SeqCst);
    }
}

fn reply(image: &Image, index: u32) -> Result<Text, Status> {
    if image.fail_with != 0 {
        return Err(Status::new(tonic::Code::from_i32(image.fail_with as i32), "asked to fail"));
    }
    let text =
        if image.reply_bytes > 0 { "x".repeat(image.reply_bytes as usize) } else { image.data.len().to_string() };
    Ok(Text { text, index })
}

type Answers = Pin<Box<dyn Stream<Item = Result<Text, Status>> + Send>>;

#[tonic::async_trait]
impl Ocr for Service {
    async fn recognize(&self, request: Request<Image>) -> Result<Response<Text>, Status> {
        self.called();
        reply(request.get_ref(), 0).map(Response::new)
    }

    async fn extract(&self, request: Request<Image>) -> Result<Response<Text>, Status> {
        self.called();
        reply(request.get_ref(), 0).map(Response::new)
    }

    type PagesStream = Answers;

    async fn pages(&self, request: Request<Image>) -> Result<Response<Answers>, Status> {
        self.called();
        let image = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            for index in 0..image.count {
                tokio::time::sleep(Duration::from_millis(u64::from(image.delay_ms))).await;
                if tx.send(reply(&image, index)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn upload(&self, request: Request<Streaming<Image>>) -> Result<Response<Text>, Status> {
        self.called();
        let mut chunks = request.into_inner();
        let mut total = Image::default();
        while let Some(image) = chunks.next().await {
            let image = image?;
            total.data.extend_from_slice(&image.data);
            total.reply_bytes = image.reply_bytes;
        }
        reply(&total, 0).map(Response::new)
    }

    type ConverseStream = Answers;

    async fn converse(&self, request: Request<Streaming<Image>>) -> Result<Response<Answers>, Status> {
        self.called();
        let mut chunks = request.into_inner();
        let (tx, rx) = mpsc::channel(4);
        tokio::spawn(async move {
            let mut index = 0;
            while let Some(image) = chunks.next().await {
                let answer = image.and_then(|image| reply(&image, index));
                if tx.send(answer).await.is_err() {
                    return;
                }
                index += 1;
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn health(&self, request: Request<Ping>) -> Result<Response<Ping>, Status> {
        self.called();
        Ok(Response::new(request.into_inner()))
    }
}

/// A gRPC-Web client's framing (the serverless shape's protocol), for clients that
/// speak it over plain HTTP/1.1: each message length-prefixed, the trailers in a last
/// frame flagged 0x80.
pub mod web {
    /// `application/grpc-web+proto`.
    pub const CONTENT_TYPE: &str = "application/grpc-web+proto";

    /// One message, framed.
    pub fn frame(message: &impl prost::Message) -> Vec<u8> {
        let payload = message.encode_to_vec();
        let mut out = vec![0];
        out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        out.extend_from_slice(&payload);
        out
    }

    #[derive(Debug, Clone, PartialEq, Eq)]
    pub enum Frame {
        Message(Vec<u8>),
        /// The trailers block, `name:value\r\n` lines.
        Trailers(String),
    }

    /// Reads frames from a response body as its chunks arrive.
    #[derive(Debug, Default)]
    pub struct Reader {
        buffer: Vec<u8>,
    }

    impl Reader {
        /// The frames completed by `chunk`.
        pub fn push(&mut self, chunk: &[u8]) -> Vec<Frame> {
            self.buffer.extend_from_slice(chunk);
            let mut frames = Vec::new();
            while self.buffer.len() >= 5 {
                let length =
                    u32::from_be_bytes([self.buffer[1], self.buffer[2], self.buffer[3], self.buffer[4]]) as usize;
                if self.buffer.len() < 5 + length {
                    break;
                }
                let flag = self.buffer[0];
                let payload: Vec<u8> = self.buffer.drain(..5 + length).skip(5).collect();
                frames.push(if flag & 0x80 != 0 {
                    Frame::Trailers(String::from_utf8_lossy(&payload).into_owned())
                } else {
                    Frame::Message(payload)
                });
            }
            frames
        }
    }
}
