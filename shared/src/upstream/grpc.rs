//! The gRPC upstream client: HTTP/2 over cleartext (h2c, prior knowledge), for every
//! `kind: grpc` backend, built once per gateway: [`lanes`](super::lanes) of clients,
//! so that no connection is asked for more than 100 streams at once. It carries
//! requests whose bodies stream (a proxied call's frames, as the client sends them)
//! and hands back the response with its body unread, trailers included.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::lanes::{AnswerBody, Lanes};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// A request body streamed to the upstream.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

pub struct GrpcClient {
    lanes: Lanes<Client<HttpConnector, UpstreamBody>>,
}

impl Default for GrpcClient {
    fn default() -> Self {
        Self::new()
    }
}

impl GrpcClient {
    pub fn new() -> Self {
        let lanes = Lanes::new(|| {
            let mut connector = HttpConnector::new();
            // Without it, Nagle holds a small message until the previous one is acknowledged.
            connector.set_nodelay(true);
            Client::builder(TokioExecutor::new()).http2_only(true).build(connector)
        });
        GrpcClient { lanes }
    }

    /// Sends the request; the answer's body is the upstream's, unread.
    pub async fn send(
        &self,
        request: http::Request<UpstreamBody>,
    ) -> Result<http::Response<AnswerBody>, hyper_util::client::legacy::Error> {
        let (lane, seat) = self.lanes.seat();
        let response = lane.client.request(request).await?;
        Ok(response.map(|body| AnswerBody::new(body, seat)))
    }
}
