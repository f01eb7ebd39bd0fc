//! A fake endpoint picker of the Gateway API Inference Extension: an Envoy
//! `ext_proc` v3 server that answers a call's headers with nothing and its body with
//! the endpoints it was told to name, as a header mutation or as `envoy.lb` dynamic
//! metadata, or fails, or never answers. It records the headers and body it was sent.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex, PoisonError};

use envoy_types::pb::envoy::config::core::v3::{HeaderValue, HeaderValueOption};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_server::{
    ExternalProcessor, ExternalProcessorServer,
};
use envoy_types::pb::envoy::service::ext_proc::v3::processing_request::Request as Asked;
use envoy_types::pb::envoy::service::ext_proc::v3::processing_response::Response as Answer;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    BodyResponse, CommonResponse, HeaderMutation, HeadersResponse, ProcessingRequest, ProcessingResponse,
};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Struct, Value};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tokio_stream::{Stream, StreamExt};
use tonic::{Request, Response, Status, Streaming};

/// How the fake answers a call's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Picks {
    /// `x-gateway-destination-endpoint: LIST` as a header mutation.
    Header(String),
    /// `envoy.lb: {x-gateway-destination-endpoint: LIST}` as dynamic metadata.
    Metadata(String),
    /// The stream fails with `UNAVAILABLE`.
    Fail,
    /// No answer, ever.
    Hang,
}

/// What the fake was sent for one call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Seen {
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

/// A running fake picker; stops on drop.
pub struct FakePicker {
    pub addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    _stop: oneshot::Sender<()>,
}

impl FakePicker {
    pub async fn start(picks: Picks) -> std::io::Result<FakePicker> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (stop, stopped) = oneshot::channel::<()>();
        let service = ExternalProcessorServer::new(Picker { picks, seen: seen.clone() });
        tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(FakePicker { addr, seen, _stop: stop })
    }

    /// `http://127.0.0.1:PORT`, the `endpoint_picker.url`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// What every call sent, in order.
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

struct Picker {
    picks: Picks,
    seen: Arc<Mutex<Vec<Seen>>>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(&self, request: Request<Streaming<ProcessingRequest>>) -> Result<Response<Answers>, Status> {
        let mut asked = request.into_inner();
        let (answers, out) = mpsc::channel(4);
        let (picks, seen) = (self.picks.clone(), self.seen.clone());
        tokio::spawn(async move {
            let mut call = Seen::default();
            while let Some(Ok(message)) = asked.next().await {
                let answer = match message.request {
                    Some(Asked::RequestHeaders(headers)) => {
                        let list = headers.headers.map(|h| h.headers).unwrap_or_default();
                        call.headers = list.into_iter().map(|h| (h.key, h.raw_value)).collect();
                        ProcessingResponse {
                            response: Some(Answer::RequestHeaders(HeadersResponse::default())),
                            ..Default::default()
                        }
                    }
                    Some(Asked::RequestBody(body)) => {
                        call.body.extend_from_slice(&body.body);
                        if !body.end_of_stream {
                            continue;
                        }
                        seen.lock().unwrap_or_else(PoisonError::into_inner).push(std::mem::take(&mut call));
                        match picks.answer() {
                            Some(answer) => answer,
                            None if picks == Picks::Hang => {
                                std::future::pending::<()>().await;
                                return;
                            }
                            None => {
                                let _ = answers.send(Err(Status::unavailable("fake picker: failing"))).await;
                                return;
                            }
                        }
                    }
                    _ => continue,
                };
                if answers.send(Ok(answer)).await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(out))))
    }
}

impl Picks {
    fn answer(&self) -> Option<ProcessingResponse> {
        const DESTINATION: &str = "x-gateway-destination-endpoint";
        match self {
            Picks::Header(list) => {
                let header =
                    HeaderValue { key: DESTINATION.into(), raw_value: list.as_bytes().to_vec(), ..Default::default() };
                let mutation = HeaderMutation {
                    set_headers: vec![HeaderValueOption { header: Some(header), ..Default::default() }],
                    ..Default::default()
                };
                let common = CommonResponse { header_mutation: Some(mutation), ..Default::default() };
                Some(ProcessingResponse {
                    response: Some(Answer::RequestBody(BodyResponse { response: Some(common) })),
                    ..Default::default()
                })
            }
            Picks::Metadata(list) => {
                let string = |s: &str| Value { kind: Some(Kind::StringValue(s.to_owned())) };
                let lb = Struct { fields: HashMap::from([(DESTINATION.to_owned(), string(list))]) };
                let metadata = Struct {
                    fields: HashMap::from([("envoy.lb".to_owned(), Value { kind: Some(Kind::StructValue(lb)) })]),
                };
                Some(ProcessingResponse {
                    response: Some(Answer::RequestBody(BodyResponse::default())),
                    dynamic_metadata: Some(metadata),
                    ..Default::default()
                })
            }
            Picks::Fail | Picks::Hang => None,
        }
    }
}
