//! `mcp:` (SPEC §17), validated: the MCP servers whose tools `/mcp` federates, the key
//! its session ids are sealed with, who may present a JWT instead of a Flexway key,
//! and whether REST operations are tools too. A tenant's or an agent's `mcp:`
//! narrows what its callers see ([`McpNarrowing`]).

use std::collections::BTreeMap;
use std::time::Duration;

use super::{SecretRef, model::Auth};
use crate::money::MicroEur;

/// `mcp:` as loaded.
#[derive(Debug, Clone, PartialEq)]
pub struct Mcp {
    /// The servers by name (`[a-z0-9_-]`, no `__`: a federated tool name is
    /// `{server}__{tool}`).
    pub servers: BTreeMap<String, McpServer>,
    /// `mcp.session_key`: what session ids are sealed with; `None`: derived from
    /// `audit.hash_salt` (processes of one configuration share it).
    pub session_key: Option<SecretRef>,
    /// `mcp.oauth`: JWTs from the organisation's identity provider, besides keys.
    pub oauth: Option<McpOauth>,
    /// `mcp.expose_rest`: each `x-flexway-ai` operation of a `kind: http` contract is
    /// a tool too (`{mount}__{operationId}`).
    pub expose_rest: bool,
}

/// One upstream MCP server (Streamable HTTP).
#[derive(Debug, Clone, PartialEq)]
pub struct McpServer {
    /// Its MCP endpoint, as given (`https://tools.internal/mcp`).
    pub url: String,
    /// What the gateway sends it: never the caller's credential.
    pub auth: Auth,
    /// `false`: an internal server, the only kind a sensitive caller reaches.
    pub external: bool,
    /// Where it runs, lower-cased (`None`: undeclared, excluded under residency).
    pub jurisdiction: Option<String>,
    /// How long a call waits for its answer (default 30 s).
    pub timeout: Duration,
    /// What a `tools/call` costs: `per_call_eur`, or the tool's own price.
    pub price: McpPrice,
    /// Globs over this server's own tool names (`tools: {allow, deny}`).
    pub tools: ToolGlobs,
}

/// A server's prices.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct McpPrice {
    pub per_call: MicroEur,
    /// A tool's own price (the tool's name on its server), in place of `per_call`.
    pub tools: BTreeMap<String, MicroEur>,
}

impl McpPrice {
    /// What one call to `tool` costs.
    pub fn of(&self, tool: &str) -> MicroEur {
        self.tools.get(tool).copied().unwrap_or(self.per_call)
    }
}

/// Allow and deny globs (`*` any run of characters, `?` one); deny wins. An absent
/// `allow` allows everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ToolGlobs {
    pub allow: Option<Vec<String>>,
    pub deny: Vec<String>,
}

/// `mcp.oauth` (RFC 8707, RFC 9728): a JWT accepted as the caller's Bearer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct McpOauth {
    /// The `iss` a token must carry; listed in the resource metadata's
    /// `authorization_servers`.
    pub issuer: String,
    /// The `aud` it must carry: this resource (the resource metadata's `resource`).
    pub audience: String,
    /// Where the issuer's signing keys are (a JWK set), fetched and cached.
    pub jwks_url: String,
    /// The claim naming the caller's tenant (one declared under `tenants`).
    pub tenant_claim: String,
    /// The claim naming its agent, if any (one of that tenant's).
    pub agent_claim: Option<String>,
}

/// A tenant's or an agent's `mcp: {servers, tools}`: what it narrows.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct McpNarrowing {
    /// The servers it may use (`None`: every server).
    pub servers: Option<Vec<String>>,
    /// Globs over the federated names `{server}__{tool}`.
    pub tools: ToolGlobs,
}
