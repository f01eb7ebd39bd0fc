//! `EmfAuditSink`: in the serverless shape, metrics are CloudWatch Embedded Metric
//! Format lines in the function's own log (stdout), one per call, taken from the very
//! record the audit gets (`flexway::metrics::emf_line`), so metrics and audit never
//! disagree. CloudWatch turns them into `flexway.inference.cost` and
//! `flexway.inference.calls` (namespace `Flexway`), which the dashboard in
//! `infra/template.yaml` shows.

use std::io::Write;

use flexway::audit::{AuditError, AuditRecord, AuditSink};

/// Prints one EMF line per record to stdout, then hands the records to `inner`.
#[derive(Debug)]
pub struct EmfAuditSink<S> {
    inner: S,
}

impl<S> EmfAuditSink<S> {
    pub fn new(inner: S) -> Self {
        EmfAuditSink { inner }
    }

    pub fn inner(&self) -> &S {
        &self.inner
    }
}

#[async_trait::async_trait]
impl<S: AuditSink> AuditSink for EmfAuditSink<S> {
    async fn write(&self, records: &[AuditRecord]) -> Result<(), AuditError> {
        if !records.is_empty() {
            let mut lines = String::new();
            for record in records {
                lines.push_str(&flexway::metrics::emf_line(record));
                lines.push('\n');
            }
            // Metrics are best effort (a lost line is a gap on a graph); the audit
            // write below is not, and its error is returned.
            let mut out = std::io::stdout().lock();
            if let Err(e) = out.write_all(lines.as_bytes()).and_then(|()| out.flush()) {
                tracing::warn!("cannot write EMF metrics to stdout: {e}");
            }
        }
        self.inner.write(records).await
    }
}
