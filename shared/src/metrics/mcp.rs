//! The MCP door's metrics (SPEC §17): tool calls by tenant, server and outcome, fed
//! from each call's audit record ([`Registry::record_call`]), so that metrics and audit
//! agree. Labels are config names (tenant, server) and the record's `mcp_status`,
//! never a tool's arguments or a request id.

use super::{Registry, label};
use crate::audit::AuditRecord;
use crate::money::MicroEur;

/// The `outcome` values of `flexway_mcp_calls_total`: the audit's `mcp_status`.
pub const MCP_OUTCOMES: [&str; 3] = ["ok", "tool_error", "error"];

/// One MCP server's tool calls as this process counted them since it started, as the
/// console shows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct McpTotals {
    pub server: String,
    pub calls: u64,
    /// Calls that ended without a result (`error`).
    pub errors: u64,
    /// What the calls were charged, as settled.
    pub spent: MicroEur,
}

impl Registry {
    /// A tool call's record: counted under its server and outcome, with its cost.
    pub(super) fn record_mcp_call(&self, record: &AuditRecord) {
        let (Some(server), Some(status)) = (record.mcp_server.as_deref(), record.mcp_status) else { return };
        let labels = [label(Some(&record.tenant)), label(Some(server)), status.as_str()];
        self.mcp_calls.with(&labels, <(u64, u64)>::default, |(calls, spent)| {
            *calls = calls.saturating_add(1);
            *spent = spent.saturating_add(record.cost_micro_eur);
        });
    }

    /// A server whose tools were left out of a `tools/list` (it did not answer).
    pub fn mcp_server_down(&self, server: &str) {
        self.mcp_down.with(&[label(Some(server))], u64::default, |n| *n = n.saturating_add(1));
    }

    /// Every server with a tool call, by name.
    pub fn mcp_totals(&self) -> Vec<McpTotals> {
        let mut totals: Vec<McpTotals> = Vec::new();
        for (values, (calls, spent)) in self.mcp_calls.snapshot(|sums| *sums) {
            let server = values.get(1).map_or(super::NONE, String::as_str);
            let index = match totals.iter().position(|t| t.server == server) {
                Some(index) => index,
                None => {
                    totals.push(McpTotals { server: server.to_owned(), ..McpTotals::default() });
                    totals.len() - 1
                }
            };
            let total = &mut totals[index];
            total.calls = total.calls.saturating_add(calls);
            total.spent = total.spent.saturating_add(MicroEur(spent));
            if values.get(2).is_some_and(|outcome| outcome == "error") {
                total.errors = total.errors.saturating_add(calls);
            }
        }
        totals.sort_by(|a, b| a.server.cmp(&b.server));
        totals
    }

    /// The MCP families, in the Prometheus text format.
    pub(super) fn render_mcp(&self, out: &mut String) {
        super::render::header(
            out,
            "flexway_mcp_calls_total",
            "counter",
            "MCP tool calls (tools/call through /mcp), by server and outcome: ok, tool_error (the tool ran and \
             reported a failure: charged), error (no result: refunded).",
        );
        for (values, (calls, _)) in self.mcp_calls.snapshot(|sums| *sums) {
            let names = ["tenant", "server", "outcome"];
            super::render::sample(out, "flexway_mcp_calls_total", &names, &values, None, &calls.to_string());
        }
        super::render::header(
            out,
            "flexway_mcp_cost_eur_total",
            "counter",
            "What MCP tool calls were charged in euros, as settled in the ledger, by server.",
        );
        for (values, (_, spent)) in self.mcp_calls.snapshot(|sums| *sums) {
            let euros = MicroEur(spent).to_eur_string();
            let names = ["tenant", "server", "outcome"];
            super::render::sample(out, "flexway_mcp_cost_eur_total", &names, &values, None, &euros);
        }
        super::render::header(
            out,
            "flexway_mcp_servers_down_total",
            "counter",
            "Times an MCP server did not answer a tools/list (or an initialize): its tools were left out.",
        );
        for (values, n) in self.mcp_down.snapshot(|n| *n) {
            super::render::sample(out, "flexway_mcp_servers_down_total", &["server"], &values, None, &n.to_string());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::audit::McpStatus;
    use crate::audit::sample::record;
    use crate::config::Metering;

    fn tool_call(server: &str, status: McpStatus, cost: u64) -> AuditRecord {
        let mut r = record("acme", None, Metering::Local, cost);
        r.operation = crate::call::Operation::Mcp;
        r.mcp_server = Some(server.into());
        r.tool = Some("search".into());
        r.mcp_status = Some(status);
        r
    }

    #[test]
    fn tool_calls_are_counted_by_server_and_outcome_with_their_cost() {
        let registry = Registry::new();
        registry.record_call(&tool_call("search", McpStatus::Ok, 1_000));
        registry.record_call(&tool_call("search", McpStatus::ToolError, 1_000));
        registry.record_call(&tool_call("search", McpStatus::Error, 0));
        registry.record_call(&tool_call("files", McpStatus::Ok, 10));
        registry.record_call(&record("acme", Some("a"), Metering::Local, 5));
        let text = registry.render_prometheus();
        assert!(
            text.contains("flexway_mcp_calls_total{tenant=\"acme\",server=\"search\",outcome=\"ok\"} 1\n"),
            "{text}"
        );
        assert!(text.contains("flexway_mcp_calls_total{tenant=\"acme\",server=\"search\",outcome=\"error\"} 1\n"));
        assert!(text.contains(
            "flexway_mcp_cost_eur_total{tenant=\"acme\",server=\"search\",outcome=\"tool_error\"} 0.001000\n"
        ));
        let totals = registry.mcp_totals();
        let search = McpTotals { server: "search".into(), calls: 3, errors: 1, spent: MicroEur(2_000) };
        assert_eq!(
            totals,
            vec![McpTotals { server: "files".into(), calls: 1, errors: 0, spent: MicroEur(10) }, search]
        );
    }
}
