//! An endpoint picker of the Gateway API Inference Extension (SPEC §5): asked, over
//! Envoy's `ext_proc` v3 protocol, which model server endpoints should serve a call.
//!
//! The gateway plays Envoy's part: it opens one `Process` stream a call, sends the
//! request's headers, then its body (end of stream), and reads the picker's answers
//! until one names the endpoints, in the `x-gateway-destination-endpoint` header
//! mutation or in the `envoy.lb` dynamic metadata under the same key: a
//! comma-separated `ip:port` list, the first preferred. An endpoint given without a
//! port takes the pool's target port. A `kind: inference_pool` backend has one
//! (`Router::picker`); the attempt phase asks it (`http::chain`).

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    CommonResponse, HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;
use futures_util::StreamExt;
use tonic::transport::{Channel, Endpoint};

/// The header (and `envoy.lb` metadata key) naming the picked endpoints.
pub const DESTINATION: &str = "x-gateway-destination-endpoint";
/// The dynamic metadata namespace a picker may answer in.
const LB_NAMESPACE: &str = "envoy.lb";
/// How long a call waits for the picker's answer (and for a connection to it): past
/// this, the picker has failed (Envoy waits 200 ms by default for an `ext_proc`
/// message; the pickers answer in a few).
pub const TIMEOUT: Duration = Duration::from_secs(1);
/// How many of the endpoints a picker names a call tries: the first and two
/// fallbacks. Each may take the pool's whole `timeout`, which the call's budget
/// reservation outlives (`Gateway::attempt_time`).
pub const MAX_TRIED: usize = 3;
/// A picker's answer longer than this is not a list of endpoints.
const MAX_ENDPOINTS: usize = 64;

/// Why the picker gave no endpoint.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PickerError {
    #[error("the endpoint picker's URL `{0}` is not usable: {1}")]
    Url(String, String),
    #[error("the endpoint picker did not answer within {0:?}")]
    Timeout(Duration),
    #[error("the endpoint picker failed: {0}")]
    Failed(String),
    #[error("the endpoint picker named no endpoint")]
    NoEndpoint,
    #[error("the endpoint picker named `{0}`, not an ip:port list")]
    BadEndpoint(String),
}

/// One endpoint picker: a lazily connected HTTP/2 channel, reused by every call.
#[derive(Debug, Clone)]
pub struct EndpointPicker {
    client: ExternalProcessorClient<Channel>,
    timeout: Duration,
    target_port: u16,
}

impl EndpointPicker {
    /// The picker at `url` (`http://epp.ns.svc:9002`); `timeout` bounds each call's
    /// question; endpoints without a port take `target_port`.
    pub fn new(url: &str, timeout: Duration, target_port: u16) -> Result<Self, PickerError> {
        let endpoint =
            Endpoint::from_shared(url.to_owned()).map_err(|e| PickerError::Url(url.into(), e.to_string()))?;
        let channel = endpoint.connect_timeout(timeout).connect_lazy();
        Ok(EndpointPicker { client: ExternalProcessorClient::new(channel), timeout, target_port })
    }

    /// The endpoints for a call, as `host:port`, the first preferred: a `POST` of
    /// `body` to `path`, with `headers` (Envoy's `:method` and `:path` first).
    pub async fn pick(&self, path: &str, headers: &http::HeaderMap, body: &[u8]) -> Result<Vec<String>, PickerError> {
        let asked = tokio::time::timeout(self.timeout, self.ask(path, headers, body)).await;
        let list = asked.map_err(|_| PickerError::Timeout(self.timeout))??;
        endpoints(&list, self.target_port)
    }

    async fn ask(&self, path: &str, headers: &http::HeaderMap, body: &[u8]) -> Result<String, PickerError> {
        let header = |key: &str, value: &[u8]| HeaderValue {
            key: key.to_owned(),
            raw_value: value.to_vec(),
            ..Default::default()
        };
        let pseudo = [header(":method", b"POST"), header(":path", path.as_bytes())];
        let headers = HeaderMap {
            headers: pseudo
                .into_iter()
                .chain(headers.iter().map(|(name, value)| header(name.as_str(), value.as_bytes())))
                .collect(),
        };
        let messages = [
            Request::RequestHeaders(HttpHeaders { headers: Some(headers), end_of_stream: false, ..Default::default() }),
            Request::RequestBody(HttpBody { body: body.to_vec(), end_of_stream: true, ..Default::default() }),
        ]
        .map(|request| ProcessingRequest { request: Some(request), ..Default::default() });
        // The stream stays open until the answer is read, as Envoy's does: a picker
        // may take the client's end of stream for the end of the call.
        let outbound = futures_util::stream::iter(messages).chain(futures_util::stream::pending());
        let mut client = self.client.clone();
        let failed = |status: tonic::Status| PickerError::Failed(format!("{}: {}", status.code(), status.message()));
        let mut answers = client.process(outbound).await.map_err(failed)?.into_inner();
        while let Some(answer) = answers.message().await.map_err(failed)? {
            if let Some(list) = destination(&answer) {
                return Ok(list);
            }
            // The answer to the body is the last one the request's path waits for.
            if matches!(answer.response, Some(Response::RequestBody(_) | Response::ImmediateResponse(_))) {
                break;
            }
        }
        Err(PickerError::NoEndpoint)
    }
}

/// The endpoint list an answer names, in its header mutation or its metadata.
fn destination(answer: &ProcessingResponse) -> Option<String> {
    let in_metadata = answer
        .dynamic_metadata
        .as_ref()
        .and_then(|metadata| metadata.fields.get(LB_NAMESPACE))
        .and_then(|lb| match &lb.kind {
            Some(Kind::StructValue(lb)) => lb.fields.get(DESTINATION),
            _ => None,
        })
        .and_then(|value| match &value.kind {
            Some(Kind::StringValue(list)) => Some(list.clone()),
            _ => None,
        });
    let common: Option<&CommonResponse> = match &answer.response {
        Some(Response::RequestHeaders(headers)) => headers.response.as_ref(),
        Some(Response::RequestBody(body)) => body.response.as_ref(),
        _ => None,
    };
    let in_header = common.and_then(|c| c.header_mutation.as_ref()).and_then(|mutation| {
        mutation.set_headers.iter().filter_map(|option| option.header.as_ref()).find_map(|header| {
            if !header.key.eq_ignore_ascii_case(DESTINATION) {
                return None;
            }
            if header.raw_value.is_empty() {
                Some(header.value.clone())
            } else {
                String::from_utf8(header.raw_value.clone()).ok()
            }
        })
    });
    in_header.or(in_metadata).filter(|list| !list.trim().is_empty())
}

/// `list` read as endpoints: `ip:port` (or `[v6]:port`), a bare address taking
/// `target_port`.
fn endpoints(list: &str, target_port: u16) -> Result<Vec<String>, PickerError> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        if out.len() == MAX_ENDPOINTS {
            break;
        }
        let endpoint = if let Ok(addr) = item.parse::<std::net::SocketAddr>() {
            addr.to_string()
        } else if let Ok(ip) = item.trim_start_matches('[').trim_end_matches(']').parse::<std::net::IpAddr>() {
            std::net::SocketAddr::new(ip, target_port).to_string()
        } else {
            return Err(PickerError::BadEndpoint(item.chars().take(100).collect()));
        };
        if !out.contains(&endpoint) {
            out.push(endpoint);
        }
    }
    if out.is_empty() { Err(PickerError::NoEndpoint) } else { Ok(out) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_an_ip_port_list_the_first_preferred() {
        assert_eq!(endpoints("10.0.0.7:8000, 10.0.0.8", 9000).unwrap(), ["10.0.0.7:8000", "10.0.0.8:9000"]);
        assert_eq!(endpoints("[fd00::1]:8000,fd00::2", 8000).unwrap(), ["[fd00::1]:8000", "[fd00::2]:8000"]);
        assert_eq!(endpoints("10.0.0.7:8000,10.0.0.7:8000", 1).unwrap(), ["10.0.0.7:8000"], "named twice, tried once");
        assert_eq!(endpoints(" , ", 1), Err(PickerError::NoEndpoint));
        assert!(matches!(endpoints("pod-a:8000", 1), Err(PickerError::BadEndpoint(_))), "an address, not a name");
        let many: Vec<String> = (0..100).map(|i| format!("10.0.{}.{}:80", i / 250, i % 250)).collect();
        assert_eq!(endpoints(&many.join(","), 1).unwrap().len(), MAX_ENDPOINTS);
    }
}
