//! The gRPC upstream client of `kind: grpc` backends: HTTP/2 over cleartext (h2c,
//! prior knowledge) towards an `http://` upstream, over TLS (ALPN `h2`) towards an
//! `https://` one. One is shared by the backends without a `tls` of their own (the
//! public roots); a backend with `tls` has its own ([`Upstreams`](super::Upstreams)
//! keeps both). [`lanes`](super::lanes) of clients, so that no connection is asked
//! for more than 100 streams at once. It carries requests whose bodies stream (a
//! proxied call's frames, as the client sends them) and hands back the response with
//! its body unread, trailers included.

use bytes::Bytes;
use http_body_util::combinators::UnsyncBoxBody;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use super::lanes::{AnswerBody, Lanes};

pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// A request body streamed to the upstream.
pub type UpstreamBody = UnsyncBoxBody<Bytes, BoxError>;

pub struct GrpcClient {
    lanes: Lanes<Client<HttpsConnector<HttpConnector>, UpstreamBody>>,
}

impl GrpcClient {
    /// A client whose `https://` connections are made with `tls` (its roots, and its
    /// client certificate if any).
    pub fn new(tls: rustls::ClientConfig) -> Self {
        let lanes = Lanes::new(move || {
            let mut tcp = HttpConnector::new();
            tcp.enforce_http(false);
            // Without it, Nagle holds a small message until the previous one is acknowledged.
            tcp.set_nodelay(true);
            let connector = hyper_rustls::HttpsConnectorBuilder::new()
                .with_tls_config(tls.clone())
                .https_or_http()
                .enable_http2()
                .wrap_connector(tcp);
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
