//! Reading the audit back from a CloudWatch Logs group (`flexway report --log-group`,
//! the reconciliation): every event of every stream, one [`AuditRecord`] per event, as
//! [`CloudWatchAuditSink`](crate::CloudWatchAuditSink) writes them or Lambda delivers
//! them from the function's stdout (the group is then also the function's log).
//!
//! [`read_audit_log_group`] holds every record of the read, sorted (the report, the
//! chain's verification); [`for_each_audit_record`] hands them over page by page and
//! holds none (the reconciliation, which folds a month of millions of records).
//!
//! An event's timestamp is when the sink wrote it: just after the call ended, so at
//! or a little after the record's `ts`. A caller narrowing the read to a period of
//! `ts` widens it by [`WRITE_DELAY_MARGIN_MS`] and then filters on `ts` itself.

use aws_sdk_cloudwatchlogs::Client;
use aws_sdk_cloudwatchlogs::types::FilteredLogEvent;
use flexway::audit::AuditRecord;
use flexway::audit::chain::{Verifier, position};
use flexway::audit::report::{Read, Unreadable, parse_record};

/// How much later than its `ts` a record's event can be timestamped: the audit is
/// written within the invocation that served the call (at most 15 minutes on
/// Lambda), retries included. An hour leaves room to spare.
pub const WRITE_DELAY_MARGIN_MS: i64 = 60 * 60 * 1000;

#[derive(Debug, thiserror::Error)]
pub enum AuditReadError {
    #[error("log group {group} does not exist")]
    GroupNotFound { group: String },
    #[error("cannot read log group {group}: {message}")]
    Query { group: String, message: String },
}

/// Only events that mention `schema_version` are read: every record does, first
/// thing, and the gateway function's other lines in its log group (Lambda's
/// `START`/`END`/`REPORT`, EMF metrics) do not, so they never leave CloudWatch. A
/// term, not a JSON pattern: a record cut short still matches, and is listed.
pub const RECORD_FILTER_PATTERN: &str = "\"schema_version\"";

/// Every audit record in `log_group` whose event is timestamped in `from_ms..=to_ms`
/// (Unix milliseconds; `None` leaves that end open), with FilterLogEvents, page after
/// page. Sorted by event timestamp, events of the same timestamp in the order
/// received (a batch's records share one timestamp and keep the order calls ended).
///
/// Events that are not records (the function's own log lines, when the group is
/// also its log group) are skipped; an event that claims to be a record and is not
/// one (cut, damaged, of a newer schema) is listed in `unreadable` by its event id and
/// stream, and the read goes on, so that nothing is silently left out of a bill.
///
/// With a `verifier`, every event that claims to be a record is handed to it, each
/// writer's records in the order of their `chain` sequence: a fleet process's
/// PutLogEvents may land out of order (Lambda's own delivery does not), and events
/// cannot be moved once in CloudWatch, so only a gap, a repeat or a bad MAC is a break.
pub async fn read_audit_log_group(
    client: &Client,
    log_group: &str,
    from_ms: Option<i64>,
    to_ms: Option<i64>,
    verifier: Option<&mut Verifier>,
) -> Result<Read, AuditReadError> {
    let mut events: Vec<(i64, AuditRecord)> = Vec::new();
    let mut claims: Vec<(i64, String, String)> = Vec::new();
    let mut unreadable = Vec::new();
    for_each_page(client, log_group, from_ms, to_ms, |page| {
        for event in page {
            if verifier.is_some() && claims_to_be_a_record(event.message().unwrap_or_default()) {
                let message = event.message().unwrap_or_default().to_owned();
                claims.push((event.timestamp().unwrap_or_default(), event_name(event), message));
            }
            match parse_event(event) {
                Ok(Some(record)) => events.push((event.timestamp().unwrap_or_default(), record)),
                Ok(None) => {}
                Err(why) => unreadable.push(why),
            }
        }
    })
    .await?;
    // A stable sort: equal timestamps keep the order received.
    events.sort_by_key(|(timestamp, _)| *timestamp);
    if let Some(verifier) = verifier {
        // Lines with no chain (each one a break) first, then writer by writer.
        claims.sort_by(|a, b| position(&a.2).cmp(&position(&b.2)));
        for (_, at, message) in claims {
            verifier.line(|| at, &message);
        }
    }
    Ok(Read { records: events.into_iter().map(|(_, record)| record).collect(), unreadable })
}

/// The audit records in `log_group` whose event is timestamped in `from_ms..=to_ms`,
/// as [`read_audit_log_group`] reads them, but handed to `each` a page at a time, in
/// the order FilterLogEvents returns them (not sorted), and never held: what a read of
/// millions of records folds as it goes. An event that claims to be a record and is not
/// one is handed over as [`Unreadable`].
pub async fn for_each_audit_record(
    client: &Client,
    log_group: &str,
    from_ms: Option<i64>,
    to_ms: Option<i64>,
    mut each: impl FnMut(Result<AuditRecord, Unreadable>),
) -> Result<(), AuditReadError> {
    for_each_page(client, log_group, from_ms, to_ms, |page| records_of(page, &mut each)).await
}

/// Each event of `page` that is a record handed to `each` as one, each that claims to
/// be one and is not as [`Unreadable`]; the others (the function's own lines) skipped.
pub(crate) fn records_of(page: &[FilteredLogEvent], mut each: impl FnMut(Result<AuditRecord, Unreadable>)) {
    for event in page {
        match parse_event(event) {
            Ok(Some(record)) => each(Ok(record)),
            Ok(None) => {}
            Err(unreadable) => each(Err(unreadable)),
        }
    }
}

/// The events of `log_group` in `from_ms..=to_ms` that mention a record
/// ([`RECORD_FILTER_PATTERN`]), FilterLogEvents page after page: each page handed to
/// `each` and dropped before the next is asked for.
pub(crate) async fn for_each_page(
    client: &Client,
    log_group: &str,
    from_ms: Option<i64>,
    to_ms: Option<i64>,
    mut each: impl FnMut(&[FilteredLogEvent]),
) -> Result<(), AuditReadError> {
    let mut next_token: Option<String> = None;
    loop {
        let page = client
            .filter_log_events()
            .log_group_name(log_group)
            .filter_pattern(RECORD_FILTER_PATTERN)
            .set_start_time(from_ms)
            .set_end_time(to_ms)
            .set_next_token(next_token.clone())
            .send()
            .await
            .map_err(|e| {
                if e.as_service_error().is_some_and(|e| e.is_resource_not_found_exception()) {
                    AuditReadError::GroupNotFound { group: log_group.to_owned() }
                } else {
                    AuditReadError::Query { group: log_group.to_owned(), message: error_chain(&e) }
                }
            })?;
        each(page.events());
        // A page can be empty and still not the last: only a missing token ends the
        // read. The same token handed back would loop forever; it ends it too.
        match page.next_token() {
            Some(token) if next_token.as_deref() != Some(token) => next_token = Some(token.to_owned()),
            _ => return Ok(()),
        }
    }
}

/// The event's record; `None` for an event that is not one. The serverless stack
/// makes the audit group the gateway function's own log group, so the group also
/// holds the function's other lines: Lambda's `START`/`END`/`REPORT` lines, JSON log
/// lines, EMF metrics. A record is recognised by its `schema_version` key, which the
/// writer puts first: an event that has it and cannot be counted is unreadable, named
/// by its event id and stream (a record cut or damaged is never skipped in silence).
fn parse_event(event: &FilteredLogEvent) -> Result<Option<AuditRecord>, Unreadable> {
    let message = event.message().unwrap_or_default();
    match parse_record(message) {
        Ok(record) => Ok(Some(record)),
        Err(_) if !claims_to_be_a_record(message) => Ok(None),
        Err(why) => Err(Unreadable { at: event_name(event), why }),
    }
}

/// An event as a reader finds it again: its id and its stream.
fn event_name(event: &FilteredLogEvent) -> String {
    format!("event {} (stream {})", event.event_id().unwrap_or("?"), event.log_stream_name().unwrap_or("?"))
}

/// The error and its sources, `: `-separated (the SDK's own errors say little at
/// the top: "dispatch failure"; the reason is further down the chain).
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// Whether a line that did not parse as a record was meant to be one: it starts
/// as the writer starts every record, or it is a JSON object with a top-level
/// `schema_version`. Anything else (text, EMF, log lines) is not audit.
fn claims_to_be_a_record(message: &str) -> bool {
    message.trim_start().starts_with(r#"{"schema_version""#)
        || serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(message)
            .is_ok_and(|object| object.contains_key("schema_version"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_lines_that_claim_to_be_records_are_held_to_the_record_schema() {
        // The function's own lines in the same group: not audit.
        assert!(!claims_to_be_a_record(r#"{"_aws":{"Timestamp":1,"CloudWatchMetrics":[]},"tenant":"acme"}"#));
        assert!(!claims_to_be_a_record("START RequestId: 1 Version: $LATEST"));
        assert!(!claims_to_be_a_record("REPORT RequestId: 1\tDuration: 2.01 ms"));
        assert!(!claims_to_be_a_record(
            r#"{"timestamp":"2026-12-01T06:00:00Z","level":"ERROR","fields":{"message":"audit record not written: x","audit_record":"{\"schema_version\":1}"}}"#
        ));
        // A record cut short, or one whose fields do not parse: an error, never skipped.
        assert!(claims_to_be_a_record(r#"{"schema_version":1,"ts":"2026-12-01T06:00:00.000Z","request_id":"req-"#));
        assert!(claims_to_be_a_record(r#"{"tenant":"acme","schema_version":1}"#));
    }
}
