//! The record phase: the audit record of one call, filled in as the call goes through
//! its phases and written when it ends, whatever the outcome.
//!
//! A `Draft` is created as soon as the caller is identified. It must end in `finish`;
//! if the request is dropped first (the client went away), `Drop` writes the record
//! with status 499, so no call escapes the audit. Failed writes are reported in the
//! process log with the request id, never silently lost.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use http::HeaderMap;
use tracing::Instrument as _;

pub use crate::audit::UsageSource;
use crate::audit::{AuditRecord, BudgetState, SCHEMA_VERSION, Timestamp};
use crate::call::{ErrorCode, Operation};
use crate::config::{BackendKind, Capability, Metering};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::Caller;
use crate::money::MicroEur;
use crate::protocol::chat::Finish;
use crate::protocol::openai::Usage;
use crate::routing::Candidate;
use crate::telemetry::{CallSpan, TraceContext};
use crate::upstream::CallerIdentity;

use super::RequestId;

/// The status nginx uses for a request the client abandoned.
const CLIENT_CLOSED_REQUEST: u16 = 499;

pub(super) struct Draft {
    gateway: Arc<Gateway>,
    started: Instant,
    record: AuditRecord,
    open: bool,
    /// Time spent waiting on backends: what the gateway did not add.
    upstream: Duration,
    streamed: bool,
    /// The caller's standing in its per-minute windows, for `x-ratelimit-*`: not
    /// recorded.
    pace: Option<crate::budget::plan::Pace>,
    span: Span,
    /// Who the call is for, as a relay passes it on.
    caller: CallerIdentity,
    /// The status and code recorded if the call is dropped before it ends.
    abandoned: (u16, ErrorCode),
    /// A tool call's `mcp_status` follows the status it ends with.
    mcp_by_answer: bool,
}

/// What the call's telemetry span needs beyond its audit record.
#[derive(Clone)]
struct Span {
    trace: TraceContext,
    started: SystemTime,
    provider: Option<&'static str>,
    max_tokens: Option<u64>,
    finish_reasons: Vec<Finish>,
    served: bool,
}

impl Draft {
    pub fn begin(
        gateway: &Arc<Gateway>,
        request_id: &RequestId,
        caller: &Caller,
        operation: Operation,
        headers: &HeaderMap,
    ) -> Self {
        let record = AuditRecord {
            schema_version: SCHEMA_VERSION,
            ts: Timestamp::UNIX_EPOCH,
            request_id: request_id.0.clone(),
            tenant: caller.tenant.to_string(),
            agent: caller.agent.as_ref().map(ToString::to_string),
            operation,
            capability: Capability::Chat,
            model_requested: None,
            model_served: None,
            backend: None,
            metered_by: Metering::Local,
            prompt_tokens: 0,
            completion_tokens: 0,
            cached_tokens: None,
            cache_write_tokens: None,
            usage_source: UsageSource::Reported,
            cost_eur: 0.0,
            cost_micro_eur: 0,
            charged: Some(false),
            status: 0,
            error_code: None,
            degraded: false,
            budget_state: BudgetState::Ok,
            latency_ms: 0,
            ttfb_ms: None,
            key_hash: gateway.hasher.hash_key(&caller.key_sha256),
            user_hash: None,
            close_reason: None,
            feature: None,
            pick_reason: None,
            criticality: None,
            period: None,
            run: None,
            skipped: Vec::new(),
            cache: None,
            cache_similarity: None,
            cache_age_s: None,
            cost_saved_eur: None,
            cost_saved_micro_eur: None,
            mcp_server: None,
            tool: None,
            mcp_status: None,
            chain: None,
        };
        Draft {
            gateway: gateway.clone(),
            started: Instant::now(),
            record,
            open: true,
            upstream: Duration::ZERO,
            streamed: false,
            pace: None,
            span: Span {
                trace: TraceContext::from_headers(headers, gateway.telemetry.is_on()),
                started: SystemTime::now(),
                provider: None,
                max_tokens: None,
                finish_reasons: Vec::new(),
                served: false,
            },
            caller: CallerIdentity {
                tenant: caller.tenant.clone(),
                agent: caller.agent.clone(),
                sensitive: false,
                forwarded: gateway.upstreams.forwardable(headers),
            },
            abandoned: (CLIENT_CLOSED_REQUEST, ErrorCode::ClientClosedRequest),
            mcp_by_answer: false,
        }
    }

    /// What the record says if the call is dropped before it ends (a gRPC call:
    /// `CANCELLED`, not HTTP's 499).
    pub fn abandoned_as(&mut self, status: u16, error_code: ErrorCode) {
        self.abandoned = (status, error_code);
    }

    /// A gRPC call's feature (its method's `(flexway.v1.operation).ai`).
    pub fn feature(&mut self, feature: &str) {
        self.record.feature = Some(feature.to_owned());
    }

    /// A tool call's server and tool (its name on its server), as `/mcp` resolved
    /// it (SPEC §17), and the name the caller called it by (`model_requested`). Never
    /// its arguments or its result.
    pub fn mcp_tool(&mut self, server: &str, tool: &str, called: &str) {
        self.record.mcp_server = Some(server.to_owned());
        self.record.tool = Some(tool.to_owned());
        self.record.model_requested = Some(called.to_owned());
    }

    /// How a tool call ended; a call that ends without one noted is `error`.
    pub fn mcp_status(&mut self, status: crate::audit::McpStatus) {
        self.record.mcp_status = Some(status);
    }

    /// A tool call whose outcome is its relayed answer's (a REST operation as a tool):
    /// `ok` for a 2xx, `tool_error` for another answer, `error` for none.
    pub fn mcp_status_by_answer(&mut self) {
        self.mcp_by_answer = true;
    }

    /// What the response cache did (SPEC §16); a later note (`stored`) replaces an
    /// earlier one (`miss`).
    pub fn cache(&mut self, note: crate::http::cache::Note) {
        use crate::audit::CacheOutcome;
        use crate::http::cache::Note;
        let record = &mut self.record;
        record.cache = Some(match note {
            Note::Hit { similarity, age_s, saved } => {
                // Three decimals, as `Flexway-Cache` says it.
                record.cache_similarity = Some((f64::from(similarity) * 1000.0).round() / 1000.0);
                record.cache_age_s = Some(age_s);
                record.cost_saved_micro_eur = Some(saved.0);
                record.cost_saved_eur = Some(saved.0 as f64 / MicroEur::PER_EUR as f64);
                CacheOutcome::Hit
            }
            Note::Miss => CacheOutcome::Miss,
            Note::Stored => CacheOutcome::Stored,
            Note::Bypass => CacheOutcome::Bypass,
            Note::Off => CacheOutcome::Off,
        });
    }

    /// What the response cache did, as noted.
    pub fn cache_note(&self) -> Option<crate::http::cache::Note> {
        use crate::audit::CacheOutcome;
        use crate::http::cache::Note;
        let record = &self.record;
        Some(match record.cache? {
            CacheOutcome::Hit => Note::Hit {
                similarity: record.cache_similarity.unwrap_or(1.0) as f32,
                age_s: record.cache_age_s.unwrap_or(0),
                saved: MicroEur(record.cost_saved_micro_eur.unwrap_or(0)),
            },
            CacheOutcome::Miss => Note::Miss,
            CacheOutcome::Stored => Note::Stored,
            CacheOutcome::Bypass => Note::Bypass,
            CacheOutcome::Off => Note::Off,
        })
    }

    /// The caller's tenant.
    pub fn caller_tenant(&self) -> &str {
        &self.record.tenant
    }

    /// A hard budget cap refused the call (or a step of it).
    pub fn exceeded(&mut self) {
        self.record.budget_state = BudgetState::Exceeded;
    }

    /// The call's `Flexway-Request-Id`.
    pub fn request_id(&self) -> &str {
        &self.record.request_id
    }

    /// Who the call is for, sent to a relay.
    pub fn caller(&self) -> &CallerIdentity {
        &self.caller
    }

    /// The request is sensitive (`ai.sensitive_header`): a relay is told so.
    pub fn sensitive(&mut self, sensitive: bool) {
        self.caller.sensitive = sensitive;
    }

    /// The call's class, as routing reads it.
    pub fn criticality(&mut self, class: crate::call::Criticality) {
        self.record.criticality = Some(class);
    }

    /// The call's trace context, sent to each backend tried.
    pub fn trace(&self) -> &TraceContext {
        &self.span.trace
    }

    /// The completion allowance per choice sent upstream.
    pub fn allowance(&mut self, per_choice: u64) {
        self.span.max_tokens = Some(per_choice);
    }

    /// The answer's finish reasons, one per choice.
    pub fn finish_reasons(&mut self, reasons: Vec<Finish>) {
        self.span.finish_reasons = reasons;
    }

    pub fn request(&mut self, capability: Capability, model: &str, user: Option<&str>) {
        self.record.capability = capability;
        self.record.model_requested = Some(model.to_owned());
        self.record.user_hash = user.map(|u| self.gateway.hasher.hash(u.as_bytes()));
    }

    /// The run the call named (`Flexway-Run`).
    pub fn run(&mut self, run: &str) {
        self.record.run = Some(run.to_owned());
    }

    /// The call was charged: its settlement kept its request counted (the record's
    /// `charged`), set by the call's end.
    pub fn charged(&mut self) {
        self.record.charged = Some(true);
    }

    /// Where the caller stands in its windows, when one applies.
    pub fn pace(&mut self, pace: Option<crate::budget::plan::Pace>) {
        if pace.is_some() {
            self.pace = pace;
        }
    }

    pub fn paced(&self) -> Option<crate::budget::plan::Pace> {
        self.pace
    }

    /// The date the call's reservation counts on (`Ticket::period`, the record's
    /// `period`). A call with several (a realtime session's turns, a gRPC call's
    /// steps) counts on its first.
    pub fn reserved_on(&mut self, period: String) {
        self.record.period.get_or_insert(period);
    }

    pub fn soft(&mut self, soft: bool) {
        if soft {
            self.record.budget_state = BudgetState::Soft;
        }
    }

    /// The backend being tried (the last one tried is recorded on failure).
    pub fn trying(&mut self, candidate: &Candidate, model: &str) {
        let backend = self.gateway.config.ai.backends.get(&candidate.backend);
        let upstream_metered =
            backend.is_some_and(|b| matches!(b.kind, BackendKind::Relay { metering: Metering::Upstream, .. }));
        self.record.backend = Some(candidate.backend.to_string());
        self.record.model_served = Some(model.to_owned());
        self.record.degraded = candidate.degraded;
        self.record.pick_reason = candidate.reason;
        self.record.metered_by = if upstream_metered { Metering::Upstream } else { Metering::Local };
        self.span.provider = backend.map(|b| b.kind.name());
    }

    /// A backend of the route passed over without a call, and why.
    pub fn skipped(&mut self, backend: &crate::config::BackendId, cause: crate::audit::SkipCause) {
        self.record.skipped.push(crate::audit::Skipped { backend: backend.to_string(), cause });
    }

    pub fn usage(&mut self, usage: Usage, source: UsageSource, cost: MicroEur) {
        self.record.prompt_tokens = usage.prompt_tokens;
        self.record.completion_tokens = usage.completion_tokens;
        self.record.cached_tokens = (usage.cached_tokens > 0).then_some(usage.cached_tokens);
        self.record.cache_write_tokens = (usage.cache_write_tokens > 0).then_some(usage.cache_write_tokens);
        self.record.usage_source = source;
        self.record.cost_micro_eur = cost.0;
        self.record.cost_eur = cost.0 as f64 / MicroEur::PER_EUR as f64;
        self.span.served = true;
    }

    /// Estimated against reported tokens of a stream, for the drift metric.
    pub fn drift(&self, estimated: u64, reported: u64) {
        if let Some(backend) = &self.record.backend {
            self.gateway.metrics.observe_usage_drift(backend, estimated, reported);
        }
    }

    /// Adds time spent waiting on a backend.
    pub fn waited(&mut self, upstream: Duration) {
        self.upstream += upstream;
    }

    /// A realtime session ended: why. A cap that closed it leaves the budget state
    /// `exceeded`.
    pub fn closed(&mut self, reason: crate::audit::CloseReason) {
        self.record.close_reason = Some(reason);
        if reason == crate::audit::CloseReason::BudgetExceeded {
            self.record.budget_state = BudgetState::Exceeded;
        }
        self.streamed = true;
    }

    pub fn streaming(&mut self) {
        self.streamed = true;
    }

    /// Whether the answer is a stream (or a session).
    pub fn is_streamed(&self) -> bool {
        self.streamed
    }

    pub fn first_byte(&mut self) {
        if self.record.ttfb_ms.is_none() {
            self.record.ttfb_ms = Some(elapsed_ms(self.started));
        }
    }

    pub async fn finish(mut self, status: u16, error_code: Option<ErrorCode>) {
        self.open = false;
        let (record, span) = self.complete(status, error_code);
        let metrics = &self.gateway.metrics;
        if let (Some(backend), Some(ttfb)) = (&record.backend, record.ttfb_ms) {
            metrics.observe_time_to_first_byte(backend, Duration::from_millis(ttfb));
        }
        if status == 200 && !self.streamed {
            metrics.observe_gateway_overhead(self.started.elapsed().saturating_sub(self.upstream));
        }
        if self.gateway.audit.waits() {
            // It runs to its end even if this call is cancelled (`AuditSink::waits`).
            let _ = spawn_write(self.gateway.clone(), record, span).await;
        } else {
            write(&self.gateway, record, span).await;
        }
    }

    /// Notes a refusal's budget state and the last backend tried; the status and code
    /// the call ends with.
    pub fn refused(&mut self, error: &GatewayError) -> (u16, ErrorCode) {
        if matches!(error, GatewayError::BudgetExceeded { .. }) {
            self.record.budget_state = BudgetState::Exceeded;
        }
        if let Some(last) = error.attempts().and_then(|a| a.tried.last()) {
            self.record.backend = Some(last.to_string());
        }
        (error.status().as_u16(), error.code())
    }

    /// The record as the call ends, and what its span adds if telemetry is on. The
    /// record moves out (the draft ends here, finished or dropped), leaving a husk of
    /// its copied fields and empty strings: nothing allocated, nothing cloned.
    fn complete(&mut self, status: u16, error_code: Option<ErrorCode>) -> (AuditRecord, Option<Ended>) {
        let husk = AuditRecord {
            request_id: String::new(),
            tenant: String::new(),
            agent: None,
            model_requested: None,
            model_served: None,
            backend: None,
            key_hash: String::new(),
            user_hash: None,
            feature: None,
            period: None,
            run: None,
            skipped: Vec::new(),
            cache: None,
            cache_similarity: None,
            cache_age_s: None,
            cost_saved_eur: None,
            cost_saved_micro_eur: None,
            mcp_server: None,
            tool: None,
            mcp_status: None,
            chain: None,
            ..self.record
        };
        let mut record = std::mem::replace(&mut self.record, husk);
        if record.mcp_server.is_some() && record.mcp_status.is_none() {
            use crate::audit::McpStatus;
            record.mcp_status = Some(match (self.mcp_by_answer, error_code) {
                (true, None) if (200..300).contains(&status) => McpStatus::Ok,
                (true, None) => McpStatus::ToolError,
                _ => McpStatus::Error,
            });
        }
        record.ts = Timestamp::now();
        record.status = status;
        record.error_code = error_code;
        record.latency_ms = elapsed_ms(self.started);
        if record.ttfb_ms.is_none() && status < 400 {
            record.ttfb_ms = Some(record.latency_ms);
        }
        let span =
            self.gateway.telemetry.is_on().then(|| Ended { span: self.span.clone(), duration: self.started.elapsed() });
        (record, span)
    }
}

fn elapsed_ms(started: Instant) -> u64 {
    u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// A call's span parts, as it ended.
struct Ended {
    span: Span,
    duration: Duration,
}

/// [`write`] in a task of its own (the future built here, outside the caller's).
fn spawn_write(gateway: Arc<Gateway>, record: AuditRecord, span: Option<Ended>) -> tokio::task::JoinHandle<()> {
    let writing = async move { write(&gateway, record, span).await };
    tokio::spawn(writing.instrument(tracing::Span::current()))
}

async fn write(gateway: &Gateway, record: AuditRecord, ended: Option<Ended>) {
    gateway.metrics.record_call(&record);
    if let Err(e) = gateway.audit.write(std::slice::from_ref(&record)).await {
        lost(&record, &e.to_string());
    }
    // The record moves into the span once the audit has it: no copy on the way.
    if let Some(Ended { span, duration }) = ended {
        let Span { trace, started, provider, max_tokens, finish_reasons, served } = span;
        let finish_reasons = finish_reasons.into_iter().map(|f| f.as_str().to_owned()).collect();
        let call = CallSpan { record, trace, started, duration, provider, max_tokens, finish_reasons, served };
        gateway.telemetry.record(call);
        gateway.telemetry.after_call().await;
    }
}

use crate::audit::not_written as lost;

impl Drop for Draft {
    fn drop(&mut self) {
        if !self.open {
            return;
        }
        let (status, error_code) = self.abandoned;
        let (record, span) = self.complete(status, Some(error_code));
        if tokio::runtime::Handle::try_current().is_ok() {
            spawn_write(self.gateway.clone(), record, span);
        } else {
            lost(&record, "no runtime at drop");
        }
    }
}
