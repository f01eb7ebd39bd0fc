//! The driver: the phases every way in goes through, written once. A call is
//! identified by its door, its draft begun, its phases up to the answer run by the
//! door (admit, the attempt chain: `admit.rs`, `chain.rs`) into the call's one
//! [`Charge`], and its end (`end.rs`: settle, then record) run by the driver at the one
//! place every path passes: an answer whole ends with the [`Ended`] its door says, a
//! refusal with its status and code (its charge refunded), a relayed body (a stream, a
//! gRPC or REST relay, a session) through the [`Ending`] its relay is handed, in the
//! task that relays it.
//!
//! What a door is: how its caller is identified, what its call does up to the answer,
//! how its refusals are written (an envelope: OpenAI, Anthropic, RFC 9457, a gRPC
//! status). A door never settles, refunds or ends a draft itself.

use std::future::Future;
use std::sync::Arc;

use axum::extract::Request;
use axum::response::Response;
use http::{HeaderMap, HeaderValue};

mod end;
pub(super) mod pace;
mod runs;

use super::record::Draft;
use super::{Deadline, RequestId};
use crate::budget::Run;
use crate::call::headers::COST as COST_HEADER;
use crate::call::{ErrorCode, Operation};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use end::end;
pub(super) use end::{Charge, Closed, Ended, Ending, Quota, Spent, Tokens};

/// Who calls, under which request id, in which run.
#[derive(Clone, Copy)]
pub(super) struct Call<'a> {
    pub gateway: &'a Arc<Gateway>,
    pub caller: &'a Caller,
    pub request_id: &'a RequestId,
    /// The run it joined (`Flexway-Run`), checked to be the caller's and active.
    pub run: Option<&'a Arc<Run>>,
}

/// A door's answer, once its call is past the attempt phase.
#[expect(clippy::large_enum_variant, reason = "returned once a call; a box would be an allocation a call")]
pub(super) enum Reply {
    /// A complete answer (a backend's own 4xx included), and how the call ended. A
    /// model call's answer carries its settled cost (`Flexway-Cost`).
    Now(Response, Ended),
    /// An answer whose body is still to come: its relay ends the call when it ends.
    Relay(Box<dyn Relay>),
}

/// What relays an answer's body, and ends the call through `ending` when the body
/// ends or the client leaves.
pub(super) trait Relay: Send {
    fn respond(self: Box<Self>, ending: Ending, deadline: Option<Deadline>) -> Response;
}

/// A refusal before any answer, as the call's record says it.
pub(super) trait Refusal: From<GatewayError> + Send {
    /// Notes on `draft` what the refusal says of the call; the status and code it
    /// ends with.
    fn noted(&self, draft: &mut Draft) -> (u16, ErrorCode);
}

impl Refusal for GatewayError {
    fn noted(&self, draft: &mut Draft) -> (u16, ErrorCode) {
        draft.refused(self)
    }
}

/// One way in.
pub(super) trait Door: Send {
    /// The call's `operation` in its record.
    fn operation(&self) -> Operation;

    type Refusal: Refusal;

    /// The caller. A refusal here is answered and logged, never recorded (SPEC §9).
    fn identify(&self, gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, Self::Refusal>;

    /// The call's phases up to its answer, each noted on `draft`; what it reserves is
    /// held in `charge`, which the driver settles or refunds when the call ends.
    fn call(
        &mut self,
        call: Call<'_>,
        draft: &mut Draft,
        charge: &mut Charge,
        request: Request,
    ) -> impl Future<Output = Result<Reply, Self::Refusal>> + Send;

    /// A refusal in the door's envelope.
    fn refuse(&self, refusal: &Self::Refusal) -> Response;
}

/// `Flexway-Run` as a name made once: looked up by a `&str`, the name is parsed and
/// checked again at every call (200 instructions more, benches/instructions).
static RUN_HEADER: http::HeaderName = http::HeaderName::from_static(runs::RUN_HEADER);

/// A call through `door`, from its caller's identity to its record.
pub(super) async fn drive<D: Door>(gateway: Arc<Gateway>, mut door: D, mut request: Request) -> Response {
    let extensions = request.extensions_mut();
    let request_id = extensions.remove::<RequestId>().unwrap_or_else(RequestId::generate);
    let deadline = extensions.remove::<Deadline>();
    let caller = match door.identify(&gateway, request.headers()) {
        Ok(caller) => caller,
        Err(refusal) => return door.refuse(&refusal),
    };
    let mut draft = Draft::begin(&gateway, &request_id, &caller, door.operation(), request.headers());
    let mut charge = Charge::None;
    // Boxed and only for a call that names a run, for the same reason as the door's.
    let run = match request.headers().contains_key(&RUN_HEADER) {
        true => Box::pin(runs::joined(&gateway, &caller, request.headers(), &mut draft)).await,
        false => Ok(None),
    };
    let anthropic = door.operation() == Operation::Messages;
    // Boxed: the door's call is most of the call's state (some 6 KiB for chat), and
    // inline it made the handler's future one the router copies whole as it boxes it,
    // 8,000 instructions a call (benches/instructions); boxed, it is built in place.
    let answered = match run {
        Ok(run) => {
            let call = Call { gateway: &gateway, caller: &caller, request_id: &request_id, run: run.as_ref() };
            Box::pin(door.call(call, &mut draft, &mut charge, request)).await
        }
        Err(refused) => Err(D::Refusal::from(refused)),
    };
    match answered {
        Ok(Reply::Now(mut response, ended)) => {
            let priced = matches!(charge, Charge::Tokens(_));
            let pace = draft.paced();
            // Boxed too: the end's state (the draft, the settlement's and the audit
            // write's futures) is the rest of what the router would copy.
            let Closed { cost, cache } = Box::pin(end(&gateway, charge, ended, draft)).await;
            if priced && let Ok(value) = HeaderValue::from_str(&cost.to_eur_string()) {
                response.headers_mut().insert(COST_HEADER, value);
            }
            if let Some(note) = cache {
                response.headers_mut().insert(super::cache::CACHE_HEADER, note.header());
            }
            pace::write(response.headers_mut(), pace, anthropic);
            response
        }
        Ok(Reply::Relay(relay)) => {
            let pace = draft.paced();
            let cache = draft.cache_note().map(|note| note.header());
            let mut response = relay.respond(Ending::new(gateway, draft, charge), deadline);
            pace::write(response.headers_mut(), pace, anthropic);
            if let Some(value) = cache {
                response.headers_mut().insert(super::cache::CACHE_HEADER, value);
            }
            response
        }
        Err(refusal) => {
            let (status, code) = refusal.noted(&mut draft);
            // Refused before admission read the caller's windows: read them now (never
            // a write), unless the ledger or the gateway itself failed, where a read
            // would only add to the trouble. Boxed: only a refused call awaits it.
            let pace = match draft.paced() {
                None if !matches!(code, ErrorCode::LedgerBusy | ErrorCode::InternalError) => {
                    Box::pin(pace::standing(&gateway, &caller)).await
                }
                pace => pace,
            };
            Box::pin(end(&gateway, charge, Ended::unserved(status, Some(code)), draft)).await;
            let mut response = door.refuse(&refusal);
            pace::write(response.headers_mut(), pace, anthropic);
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::body::Body;
    use http::StatusCode;

    use super::*;
    use crate::audit::AuditRecord;
    use crate::protocol::openai::InvalidRequest;

    /// A door whose call answers as scripted.
    enum Scripted {
        /// An answer whole, with this status.
        Now(StatusCode),
        /// A refusal of the caller's request.
        Invalid,
        /// A relay that drops the draft it is handed, unfinished.
        Dropped,
    }

    impl Door for Scripted {
        type Refusal = GatewayError;

        fn operation(&self) -> Operation {
            Operation::Chat
        }

        fn identify(&self, gateway: &Gateway, headers: &HeaderMap) -> Result<Caller, GatewayError> {
            Ok(gateway.keys.authenticate(headers)?)
        }

        async fn call(
            &mut self,
            _: Call<'_>,
            draft: &mut Draft,
            _: &mut Charge,
            _: Request,
        ) -> Result<Reply, GatewayError> {
            draft.feature("scripted");
            match self {
                Scripted::Now(status) => {
                    let mut response = Response::new(Body::empty());
                    *response.status_mut() = *status;
                    Ok(Reply::Now(response, Ended::unserved(status.as_u16(), None)))
                }
                Scripted::Invalid => Err(InvalidRequest { message: "no".into(), param: Some("n") }.into()),
                Scripted::Dropped => Ok(Reply::Relay(Box::new(Dropping))),
            }
        }

        fn refuse(&self, error: &GatewayError) -> Response {
            super::super::render(error, false)
        }
    }

    struct Dropping;

    impl Relay for Dropping {
        fn respond(self: Box<Self>, ending: Ending, _: Option<Deadline>) -> Response {
            drop(ending);
            Response::new(Body::empty())
        }
    }

    fn request(key: &str) -> Request {
        Request::builder().header(http::header::AUTHORIZATION, format!("Bearer {key}")).body(Body::empty()).unwrap()
    }

    /// The records written once the call's own and any dropped draft's writes are in.
    async fn records(audit: &crate::audit::sinks::MemoryAuditSink) -> Vec<AuditRecord> {
        for _ in 0..100 {
            if !audit.records().is_empty() {
                break;
            }
            tokio::task::yield_now().await;
        }
        audit.records()
    }

    #[tokio::test]
    async fn every_identified_call_ends_in_one_record_with_the_status_it_answered() {
        let (gateway, audit) = crate::http::testing::gateway().await;
        let response = drive(gateway, Scripted::Now(StatusCode::ACCEPTED), request("k")).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
        let records = records(&audit).await;
        assert_eq!(records.len(), 1);
        assert_eq!((records[0].status, records[0].error_code), (202, None));
        assert_eq!(records[0].feature.as_deref(), Some("scripted"), "what the door noted is on the record");
        assert_eq!(records[0].tenant, "acme");
    }

    #[tokio::test]
    async fn a_refusal_is_recorded_with_its_code_and_answered_in_the_doors_envelope() {
        let (gateway, audit) = crate::http::testing::gateway().await;
        let response = drive(gateway, Scripted::Invalid, request("k")).await;
        assert_eq!(response.status(), StatusCode::BAD_REQUEST);
        let content_type = response.headers().get(http::header::CONTENT_TYPE).unwrap();
        assert_eq!(content_type, "application/problem+json");
        let records = records(&audit).await;
        assert_eq!(records.len(), 1);
        assert_eq!((records[0].status, records[0].error_code), (400, Some(ErrorCode::InvalidRequest)));
    }

    #[tokio::test]
    async fn a_caller_refused_at_identity_is_answered_and_never_recorded() {
        let (gateway, audit) = crate::http::testing::gateway().await;
        let response = drive(gateway, Scripted::Now(StatusCode::OK), request("not-a-key")).await;
        assert_eq!(response.status(), StatusCode::UNAUTHORIZED);
        tokio::task::yield_now().await;
        assert!(audit.records().is_empty());
    }

    /// A sink whose writes take 300 ms (a network put).
    struct Slow(crate::audit::sinks::MemoryAuditSink);

    #[async_trait::async_trait]
    impl crate::audit::AuditSink for Slow {
        async fn write(&self, records: &[AuditRecord]) -> Result<(), crate::audit::AuditError> {
            tokio::time::sleep(std::time::Duration::from_millis(300)).await;
            self.0.write(records).await
        }

        fn waits(&self) -> bool {
            true
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_cancelled_while_its_record_is_written_still_leaves_it() {
        let audit = Arc::new(Slow(crate::audit::sinks::MemoryAuditSink::new()));
        let gateway = crate::http::testing::gateway_writing_to(audit.clone()).await;
        // The server drops the call's future (its client left) while the sink writes.
        let call = drive(gateway, Scripted::Now(StatusCode::OK), request("k"));
        assert!(tokio::time::timeout(std::time::Duration::from_millis(50), call).await.is_err());
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
        let records = audit.0.records();
        assert_eq!(records.len(), 1, "the record was lost with the call");
        assert_eq!((records[0].status, records[0].error_code), (200, None));
    }

    #[tokio::test]
    async fn a_relay_that_drops_its_draft_still_leaves_one_record_as_abandoned() {
        let (gateway, audit) = crate::http::testing::gateway().await;
        drive(gateway, Scripted::Dropped, request("k")).await;
        let records = records(&audit).await;
        assert_eq!(records.len(), 1);
        assert_eq!((records[0].status, records[0].error_code), (499, Some(ErrorCode::ClientClosedRequest)));
    }
}
