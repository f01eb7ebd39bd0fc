//! `mcp` (SPEC §17): the servers `/mcp` federates, the key its session ids are sealed
//! with, the identity provider whose JWTs it accepts, and the tenants' and agents'
//! narrowing. A server's name prefixes its tools (`{server}__{tool}`), so it holds no
//! `__` and leaves room for the tool in 64 characters; a narrowing names declared
//! servers only, and exists only where `mcp` does.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use super::super::raw::{RawMcp, RawMcpNarrowing, RawMcpOauth, RawMcpPrice, RawMcpServer, RawToolGlobs};
use super::super::values::{base_url, micro_eur};
use super::super::*;
use super::{Checker, jurisdiction};
use crate::money::MicroEur;

const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);
/// A server's name and `__` take at most 34 of a federated name's 64 characters,
/// within the 55 kept when a long name is cut: the prefix always survives.
const MAX_SERVER_NAME: usize = 32;

/// What a tenant's or agent's `mcp.servers` may name.
pub(super) enum McpDeclared {
    /// No `mcp` section: a narrowing is refused.
    Absent,
    /// The servers declared and, with `expose_rest`, each `kind: http` backend's tool
    /// prefix: for a narrowing, a REST tool's server is its mount.
    Servers(BTreeSet<String>),
    /// The section lost a value to a shape error: references to it are not judged.
    InDoubt,
}

impl McpDeclared {
    pub(super) fn of(raw: Option<&RawMcp>, ai: Option<&Ai>, in_doubt: bool) -> McpDeclared {
        match raw {
            None => McpDeclared::Absent,
            Some(_) if in_doubt => McpDeclared::InDoubt,
            Some(raw) => {
                let mut names: BTreeSet<String> = raw.servers.iter().flat_map(BTreeMap::keys).cloned().collect();
                if raw.expose_rest == Some(true) {
                    names.extend(rest_prefixes(ai).map(|(_, prefix)| prefix));
                }
                McpDeclared::Servers(names)
            }
        }
    }
}

/// Each `kind: http` backend and the prefix of its operations' tool names
/// (`{prefix}__{operationId}`): its mount without the leading `/`, each other `/` as `_`.
fn rest_prefixes(ai: Option<&Ai>) -> impl Iterator<Item = (&BackendId, String)> {
    let backends = ai.into_iter().flat_map(|ai| ai.backends.iter());
    backends.filter_map(|(name, backend)| match &backend.kind {
        BackendKind::Http { mount, .. } => Some((name, mount.trim_start_matches('/').replace('/', "_"))),
        _ => None,
    })
}

impl Checker<'_> {
    /// `mcp`, or `None` when it has an error (reported). `ai` is the loaded `ai`
    /// section, if it loaded; `hash_salt` whether `audit.hash_salt` is set.
    pub(super) fn mcp(&mut self, raw: RawMcp, ai: Option<&Ai>, hash_salt: bool) -> Option<Mcp> {
        let RawMcp { session_key, expose_rest, oauth, servers } = raw;
        let expose_rest = expose_rest.unwrap_or(false);
        let mut complete = true;

        let session_key = match session_key {
            Some(key) => {
                let key = self.secret("mcp.session_key", &key);
                complete &= key.is_some();
                key
            }
            None => {
                if !hash_salt {
                    self.warn(
                        "mcp",
                        "neither mcp.session_key nor audit.hash_salt is set: the processes of this configuration \
                         share no key to seal MCP session ids with; set mcp.session_key",
                    );
                }
                None
            }
        };

        let oauth = match oauth {
            Some(raw) => {
                let oauth = self.mcp_oauth(raw);
                complete &= oauth.is_some();
                oauth
            }
            None => None,
        };

        let raw_servers = servers.unwrap_or_default();
        if expose_rest {
            for (backend, prefix) in rest_prefixes(ai) {
                if raw_servers.contains_key(&prefix) {
                    self.error(
                        format!("mcp.servers.{prefix}"),
                        format!(
                            "the REST operations of backend `{backend}` (expose_rest) are tools named `{prefix}__*` \
                             too: both would list the same names and the REST one answer every call; rename the \
                             server or the backend's mount"
                        ),
                    );
                    complete = false;
                }
            }
        }
        if raw_servers.is_empty() && !expose_rest {
            self.error(
                "mcp.servers",
                "declare at least one server (or set expose_rest: true; or leave mcp out: /mcp answers 404)",
            );
            complete = false;
        }
        let mut servers = BTreeMap::new();
        for (name, raw) in raw_servers {
            match self.mcp_server(&name, raw) {
                Some(server) => {
                    servers.insert(name, server);
                }
                None => complete = false,
            }
        }

        if expose_rest
            && let Some(ai) = ai
            && !ai.backends.values().any(|b| matches!(b.kind, BackendKind::Http { .. }))
        {
            self.warn(
                "mcp.expose_rest",
                "no backend is of kind http: no REST operation becomes a tool (declare one, or leave expose_rest out)",
            );
        }

        complete.then_some(Mcp { servers, session_key, oauth, expose_rest })
    }

    fn mcp_server(&mut self, name: &str, raw: RawMcpServer) -> Option<McpServer> {
        let path = format!("mcp.servers.{name}");
        let at = |key: &str| format!("{path}.{key}");
        let RawMcpServer { url, auth, external, jurisdiction: place, timeout, price, tools } = raw;

        let named = match server_name_problem(name) {
            Some(problem) => {
                self.error(&path, format!("`{name}` is not a server name: {problem}"));
                false
            }
            None => true,
        };
        let url = self.required(&at("url"), url, "(the server's MCP endpoint, e.g. https://tools.internal/mcp)");
        let url = url.and_then(|url| self.http_url(&at("url"), &url));
        let auth = self.auth(&at("auth"), auth);
        let place = place.map(|label| jurisdiction(self, &at("jurisdiction"), &label));
        let timeout = self.duration(&at("timeout"), timeout.as_ref(), DEFAULT_TIMEOUT);
        let price = self.mcp_price(&at("price"), price);
        let tools = self.tool_globs(&at("tools"), tools);

        if !named {
            return None;
        }
        Some(McpServer {
            url: url?,
            auth: auth?,
            external: external.unwrap_or(true),
            jurisdiction: match place {
                Some(label) => Some(label?),
                None => None,
            },
            timeout,
            price: price?,
            tools: tools?,
        })
    }

    /// An `http://` or `https://` URL, kept as written.
    fn http_url(&mut self, path: &str, url: &str) -> Option<String> {
        let parsed = base_url(url).map_err(|m| self.error(path, m)).ok()?;
        match parsed.scheme.as_str() {
            "http" | "https" => Some(url.to_owned()),
            other => {
                self.error(path, format!("scheme `{other}` is not supported: use http:// or https://"));
                None
            }
        }
    }

    fn mcp_price(&mut self, path: &str, raw: Option<RawMcpPrice>) -> Option<McpPrice> {
        let Some(RawMcpPrice { per_call_eur, tools }) = raw else {
            return Some(McpPrice::default());
        };
        let per_call = match per_call_eur {
            Some(eur) => micro_eur(eur).map_err(|m| self.error(format!("{path}.per_call_eur"), m)).ok(),
            None => Some(MicroEur(0)),
        };
        let mut prices = BTreeMap::new();
        let mut complete = true;
        for (tool, eur) in tools.unwrap_or_default() {
            let tool_path = format!("{path}.tools.{tool}");
            if tool.trim().is_empty() {
                self.error(&tool_path, "must not be empty: the tool's name on its server");
                complete = false;
                continue;
            }
            match micro_eur(eur) {
                Ok(price) => {
                    prices.insert(tool, price);
                }
                Err(message) => {
                    self.error(&tool_path, message);
                    complete = false;
                }
            }
        }
        if !complete {
            return None;
        }
        Some(McpPrice { per_call: per_call?, tools: prices })
    }

    /// Allow and deny globs: each one non-empty.
    fn tool_globs(&mut self, path: &str, raw: Option<RawToolGlobs>) -> Option<ToolGlobs> {
        let Some(RawToolGlobs { allow, deny }) = raw else {
            return Some(ToolGlobs::default());
        };
        let mut globs = |key: &str, list: Vec<String>| {
            let mut valid = true;
            for (i, glob) in list.iter().enumerate() {
                if glob.trim().is_empty() {
                    self.error(format!("{path}.{key}[{i}]"), "must not be empty: a glob (`*` any run, `?` one)");
                    valid = false;
                }
            }
            valid.then_some(list)
        };
        let allow = allow.map(|list| globs("allow", list));
        let deny = globs("deny", deny.unwrap_or_default());
        let allow = match allow {
            Some(list) => Some(list?),
            None => None,
        };
        Some(ToolGlobs { allow, deny: deny? })
    }

    fn mcp_oauth(&mut self, raw: RawMcpOauth) -> Option<McpOauth> {
        let RawMcpOauth { issuer, audience, jwks_url, tenant_claim, agent_claim } = raw;
        let mut url = |key: &str, value: Option<String>, what: &str| {
            let path = format!("mcp.oauth.{key}");
            let value = self.required(&path, value, what)?;
            self.http_url(&path, &value)
        };
        let issuer = url("issuer", issuer, "(the `iss` tokens carry, e.g. https://idp.example)");
        let audience =
            url("audience", audience, "(the `aud` tokens carry: this resource, e.g. https://gw.example/mcp)");
        let jwks_url = url("jwks_url", jwks_url, "(where the issuer's JWK set is)");
        if let Some(jwks) = &jwks_url
            && jwks.to_ascii_lowercase().starts_with("http://")
            && !is_loopback(jwks)
        {
            self.warn(
                "mcp.oauth.jwks_url",
                "the signing keys are fetched over cleartext http: anyone on the path could substitute them; use https",
            );
        }
        let tenant_claim =
            self.non_empty("mcp.oauth.tenant_claim", tenant_claim, "(the claim naming the caller's tenant)");
        let agent_claim = match agent_claim {
            Some(claim) if claim.trim().is_empty() => {
                self.error("mcp.oauth.agent_claim", "must not be empty (or leave it out: no agent from the token)");
                return None;
            }
            other => other,
        };
        Some(McpOauth {
            issuer: issuer?,
            audience: audience?,
            jwks_url: jwks_url?,
            tenant_claim: tenant_claim?,
            agent_claim,
        })
    }

    /// A tenant's or an agent's `mcp`: the servers it names are declared, its globs
    /// non-empty. Answers no narrowing when there is none or it has an error
    /// (reported).
    pub(super) fn mcp_narrowing(
        &mut self,
        path: &str,
        raw: Option<RawMcpNarrowing>,
        declared: &McpDeclared,
    ) -> McpNarrowing {
        let Some(RawMcpNarrowing { servers, tools }) = raw else {
            return McpNarrowing::default();
        };
        if let McpDeclared::Absent = declared {
            self.error(path, "there is no `mcp` section: declare mcp.servers, or remove this");
            return McpNarrowing::default();
        }
        let mut valid = true;
        if let (Some(list), McpDeclared::Servers(names)) = (&servers, declared) {
            for (i, server) in list.iter().enumerate() {
                if !names.contains(server) {
                    let declared_list = names.iter().map(String::as_str).collect::<Vec<_>>().join(", ");
                    let listed =
                        if names.is_empty() { "none is".to_owned() } else { format!("declared: {declared_list}") };
                    self.error(
                        format!("{path}.servers[{i}]"),
                        format!("server `{server}` is not declared under mcp.servers ({listed})"),
                    );
                    valid = false;
                }
            }
        }
        let tools_path = format!("{path}.tools");
        let tools = self.tool_globs(&tools_path, tools);
        if let (Some(globs), McpDeclared::Servers(names)) = (&tools, declared) {
            self.federated_globs(&tools_path, globs, names);
        }
        match (valid, tools) {
            (true, Some(tools)) => McpNarrowing { servers, tools },
            _ => McpNarrowing::default(),
        }
    }

    /// A warning for each server an agent lists that its tenant's `mcp.servers` does
    /// not: both apply, so its calls never reach it.
    pub(super) fn agents_within_servers(
        &mut self,
        tenant_path: &str,
        tenant: &McpNarrowing,
        agents: &BTreeMap<AgentId, Agent>,
    ) {
        let Some(allowed) = &tenant.servers else { return };
        for (name, agent) in agents {
            for (i, server) in agent.mcp.servers.iter().flatten().enumerate() {
                if !allowed.contains(server) {
                    self.warn(
                        format!("{tenant_path}.agents.{name}.mcp.servers[{i}]"),
                        format!(
                            "{tenant_path}.mcp.servers does not list `{server}`: this agent's calls never reach it"
                        ),
                    );
                }
            }
        }
    }

    /// A warning for each glob of a narrowing that can match no federated name: one
    /// without `__` or a wildcard, or one whose server part is a name no server has.
    fn federated_globs(&mut self, path: &str, globs: &ToolGlobs, servers: &BTreeSet<String>) {
        let lists = [("allow", globs.allow.as_deref().unwrap_or_default()), ("deny", &globs.deny[..])];
        for (key, list) in lists {
            for (i, glob) in list.iter().enumerate() {
                let wild = |s: &str| s.contains(['*', '?']);
                let problem = match glob.split_once("__") {
                    None if !wild(glob) => {
                        format!("`{glob}` matches no tool: these globs match federated names, `{{server}}__{{tool}}`")
                    }
                    Some((server, _)) if !wild(server) && !servers.contains(server) => {
                        format!("`{glob}` matches no tool: `{server}` is not declared under mcp.servers")
                    }
                    _ => continue,
                };
                self.warn(format!("{path}.{key}[{i}]"), problem);
            }
        }
    }
}

/// Why `name` cannot name a server, if it cannot.
fn server_name_problem(name: &str) -> Option<String> {
    if name.is_empty() || name.len() > MAX_SERVER_NAME {
        return Some(format!(
            "1 to {MAX_SERVER_NAME} characters (it prefixes each of its tools' names, at most 64 characters)"
        ));
    }
    if !name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'_' | b'-')) {
        return Some("only lower-case letters, digits, `_` and `-`".to_owned());
    }
    if name.contains("__") || name.ends_with('_') {
        return Some("no `__`, and no `_` at its end (a tool is named `{server}__{tool}`)".to_owned());
    }
    None
}

/// Whether a URL's host is a loopback address (`localhost`, `127.x`, `[::1]`).
fn is_loopback(url: &str) -> bool {
    let Ok(uri) = url.parse::<http::Uri>() else { return false };
    let Some(host) = uri.host() else { return false };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use serde_norway::Value;

    use crate::config::{Diagnostic, Loaded, Secrets, load_str, load_str_with};

    use super::*;

    const FULL: &str = r#"
version: 1
audit: {sink: stdout, hash_salt: env:SALT}
tenants:
  acme:
    keys: [{sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08}]
    mcp: {servers: [search, files], tools: {allow: ["search__*", "files__read_*"], deny: ["search__admin_*"]}}
    agents:
      bot: {mcp: {tools: {deny: ["search__deep_*"]}}}
      reader: {mcp: {servers: [files]}}
  plain:
    keys: [{sha256: 60303ae22b998861bce3b28f33eec1be758a213c86c93c076dbe9f558c11c752}]
ai:
  default_backend: main
  backends:
    main:
      url: https://main.example.net/v1
      price: {input_per_mtok_eur: 1, output_per_mtok_eur: 2}
mcp:
  session_key: env:MCP_SESSION_KEY
  oauth:
    issuer: https://idp.example
    audience: https://gw.example/mcp
    jwks_url: https://idp.example/jwks
    tenant_claim: tenant
    agent_claim: agent
  servers:
    search:
      url: http://127.0.0.1:7001/mcp
      auth: {type: bearer, secret: env:SEARCH_TOKEN}
      external: true
      jurisdiction: EU
      timeout: 10s
      price: {per_call_eur: 0.001, tools: {deep_search: 0.01}}
      tools: {allow: ["*"], deny: ["delete_*"]}
    files:
      url: https://files.internal/mcp
      auth: {type: header, name: x-api-key, secret: env:FILES_TOKEN}
      external: false
"#;

    struct Doc(Value);

    fn full() -> Doc {
        Doc(serde_norway::from_str(FULL).unwrap())
    }

    fn env() -> HashMap<String, String> {
        ["SALT", "MCP_SESSION_KEY", "SEARCH_TOKEN", "FILES_TOKEN"]
            .into_iter()
            .map(|name| (name.to_owned(), format!("value-of-{name}")))
            .collect()
    }

    impl Doc {
        /// Sets the value at a dotted path, creating mappings.
        fn set(mut self, path: &str, value: &str) -> Doc {
            let (parents, last) = path.rsplit_once('.').unwrap_or(("", path));
            let mut node = &mut self.0;
            for key in parents.split('.').filter(|k| !k.is_empty()) {
                let map = node.as_mapping_mut().unwrap();
                if !map.contains_key(key) {
                    map.insert(key.into(), Value::Mapping(Default::default()));
                }
                node = map.get_mut(key).unwrap();
            }
            node.as_mapping_mut().unwrap().insert(last.into(), serde_norway::from_str(value).unwrap());
            self
        }

        fn remove(mut self, path: &str) -> Doc {
            let (parents, last) = path.rsplit_once('.').unwrap_or(("", path));
            let mut node = &mut self.0;
            for key in parents.split('.').filter(|k| !k.is_empty()) {
                node = node.get_mut(key).unwrap();
            }
            node.as_mapping_mut().unwrap().remove(last).unwrap();
            self
        }

        fn text(&self) -> String {
            serde_norway::to_string(&self.0).unwrap()
        }

        fn loads(&self) -> Loaded {
            load_str(&self.text(), &env()).unwrap_or_else(|e| panic!("should load, got {e}"))
        }

        fn errors(&self) -> Vec<Diagnostic> {
            match load_str(&self.text(), &env()) {
                Ok(_) => panic!("should be refused:\n{}", self.text()),
                Err(e) => e.errors,
            }
        }

        /// Refused with exactly one error, at `path`, saying `fragment`.
        fn refused(&self, path: &str, fragment: &str) {
            let errors = self.errors();
            assert_eq!(errors.len(), 1, "expected one error at {path}, got {errors:#?}");
            assert_eq!(errors[0].path, path, "{errors:#?}");
            assert!(errors[0].message.contains(fragment), "`{}` lacks `{fragment}`", errors[0].message);
            assert!(!errors[0].message.contains("  "), "a run of spaces in `{}`", errors[0].message);
        }

        /// Loads with a warning at `path` saying `fragment`.
        fn warned(&self, path: &str, fragment: &str) {
            let warnings = self.loads().warnings;
            let found = warnings.iter().any(|w| w.path == path && w.message.contains(fragment));
            assert!(found, "no warning at {path} saying `{fragment}`: {warnings:#?}");
        }
    }

    fn server(config: &Config, name: &str) -> McpServer {
        config.mcp.as_ref().unwrap().servers[name].clone()
    }

    #[test]
    fn a_full_section_loads_with_every_key() {
        let loaded = full().loads();
        assert!(loaded.warnings.is_empty(), "{:#?}", loaded.warnings);
        let config = loaded.config;
        let mcp = config.mcp.as_ref().unwrap();
        assert_eq!(mcp.session_key, Some(SecretRef::Env("MCP_SESSION_KEY".into())));
        assert!(!mcp.expose_rest);
        let oauth = McpOauth {
            issuer: "https://idp.example".into(),
            audience: "https://gw.example/mcp".into(),
            jwks_url: "https://idp.example/jwks".into(),
            tenant_claim: "tenant".into(),
            agent_claim: Some("agent".into()),
        };
        assert_eq!(mcp.oauth, Some(oauth));
        let search = server(&config, "search");
        let expected = McpServer {
            url: "http://127.0.0.1:7001/mcp".into(),
            auth: Auth::Bearer { secret: SecretRef::Env("SEARCH_TOKEN".into()) },
            external: true,
            jurisdiction: Some("eu".into()),
            timeout: Duration::from_secs(10),
            price: McpPrice {
                per_call: MicroEur(1_000),
                tools: BTreeMap::from([("deep_search".to_owned(), MicroEur(10_000))]),
            },
            tools: ToolGlobs { allow: Some(vec!["*".into()]), deny: vec!["delete_*".into()] },
        };
        assert_eq!(search, expected);
        assert_eq!(search.price.of("deep_search"), MicroEur(10_000));
        assert_eq!(search.price.of("search"), MicroEur(1_000));
        let files = server(&config, "files");
        assert!(!files.external);
        assert_eq!(files.auth, Auth::Header { name: "x-api-key".into(), secret: SecretRef::Env("FILES_TOKEN".into()) });
    }

    #[test]
    fn a_server_takes_the_defaults() {
        let config = full().set("mcp.servers.bare", "{url: 'https://bare.example/mcp'}").loads().config;
        let bare = server(&config, "bare");
        assert_eq!(bare.auth, Auth::None);
        assert!(bare.external, "undeclared is external: a sensitive caller never reaches it");
        assert_eq!(bare.jurisdiction, None);
        assert_eq!(bare.timeout, Duration::from_secs(30));
        assert_eq!(bare.price, McpPrice::default());
        assert_eq!(bare.tools, ToolGlobs::default());
    }

    #[test]
    fn tenants_and_agents_narrow() {
        let tenants = full().loads().config.tenants;
        let acme = &tenants["acme"];
        assert_eq!(acme.mcp.servers, Some(vec!["search".to_owned(), "files".to_owned()]));
        assert_eq!(acme.mcp.tools.allow, Some(vec!["search__*".to_owned(), "files__read_*".to_owned()]));
        assert_eq!(acme.mcp.tools.deny, vec!["search__admin_*".to_owned()]);
        let bot = &acme.agents["bot"].mcp;
        assert_eq!((bot.servers.as_ref(), bot.tools.allow.as_ref()), (None, None));
        assert_eq!(bot.tools.deny, vec!["search__deep_*".to_owned()]);
        assert_eq!(acme.agents["reader"].mcp.servers, Some(vec!["files".to_owned()]));
        assert_eq!(tenants["plain"].mcp, McpNarrowing::default());
    }

    #[test]
    fn every_secret_is_resolved_at_start() {
        let config = full().loads().config;
        let references: Vec<String> = config.secret_references().into_iter().map(|(path, _)| path).collect();
        for path in ["mcp.session_key", "mcp.servers.search.auth.secret", "mcp.servers.files.auth.secret"] {
            assert!(references.contains(&path.to_owned()), "{path} missing from {references:?}");
        }
        let text = full().set("mcp.servers.search.auth.secret", "env:UNSET_TOKEN").text();
        let checked = load_str_with(&text, &env(), Secrets::Check).unwrap();
        assert!(checked.warnings.iter().any(|w| w.path == "mcp.servers.search.auth.secret"), "{checked:#?}");
        full()
            .set("mcp.servers.search.auth.secret", "env:UNSET_TOKEN")
            .refused("mcp.servers.search.auth.secret", "UNSET_TOKEN");
        full().set("mcp.session_key", "plain-text").refused("mcp.session_key", "env:");
    }

    #[test]
    fn no_section_is_none_and_a_narrowing_needs_one() {
        let none = full().remove("mcp").remove("tenants.acme.mcp").remove("tenants.acme.agents");
        assert_eq!(none.loads().config.mcp, None);
        full().remove("mcp").remove("tenants.acme.agents").refused("tenants.acme.mcp", "there is no `mcp` section");
        full()
            .remove("mcp")
            .remove("tenants.acme.mcp")
            .set("tenants.acme.agents", "{bot: {mcp: {servers: []}}}")
            .refused("tenants.acme.agents.bot.mcp", "there is no `mcp` section");
    }

    #[test]
    fn server_names_leave_room_for_their_tools() {
        for good in ["a", "web-search", "s3_files", "x9", &"n".repeat(32)] {
            let config = full().set(&format!("mcp.servers.{good}"), "{url: 'http://h/mcp'}").loads().config;
            assert!(config.mcp.unwrap().servers.contains_key(good), "{good}");
        }
        for (bad, fragment) in [
            ("Search", "lower-case"),
            ("web search", "lower-case"),
            ("my__server", "no `__`"),
            ("trailing_", "no `_` at its end"),
            (&"n".repeat(33), "1 to 32 characters"),
        ] {
            let path = format!("mcp.servers.{bad}");
            full().set(&path, "{url: 'http://h/mcp'}").refused(&path, fragment);
        }
    }

    #[test]
    fn a_server_is_checked_key_by_key() {
        let s = "mcp.servers.search";
        full().remove(&format!("{s}.url")).refused(&format!("{s}.url"), "required");
        full().set(&format!("{s}.url"), "ftp://h/mcp").refused(&format!("{s}.url"), "`ftp` is not supported");
        full().set(&format!("{s}.url"), "not a url").refused(&format!("{s}.url"), "not a URL");
        full().set(&format!("{s}.url"), "https://u:p@h/mcp").refused(&format!("{s}.url"), "credentials");
        full().set(&format!("{s}.auth"), "{type: bearer}").refused(&format!("{s}.auth.secret"), "required");
        // A backend's `auth` shape: its kind is `type`.
        let errors = full().set(&format!("{s}.auth"), "{kind: bearer, secret: env:SEARCH_TOKEN}").errors();
        assert_eq!(errors[0].path, format!("{s}.auth.kind"), "{errors:#?}");
        assert!(errors[0].message.contains("expected one of `type`"), "{errors:#?}");
        full()
            .set(&format!("{s}.auth"), "{type: header, name: host, secret: env:SEARCH_TOKEN}")
            .refused(&format!("{s}.auth.name"), "written by the gateway");
        full().set(&format!("{s}.jurisdiction"), "e u").refused(&format!("{s}.jurisdiction"), "not a jurisdiction");
        full().set(&format!("{s}.timeout"), "10").refused(&format!("{s}.timeout"), "no unit");
        full().set(&format!("{s}.timeout"), "0s").refused(&format!("{s}.timeout"), "longer than zero");
        full().set(&format!("{s}.external"), "maybe").refused(&format!("{s}.external"), "boolean");
        full().set(&format!("{s}.retries"), "2").refused(&format!("{s}.retries"), "retries");
    }

    #[test]
    fn prices_are_euros_with_six_decimals_at_most() {
        let p = "mcp.servers.search.price";
        let config = full().set(&format!("{p}.per_call_eur"), "0.000001").loads().config;
        assert_eq!(server(&config, "search").price.per_call, MicroEur(1));
        full().set(&format!("{p}.per_call_eur"), "0.0000001").refused(&format!("{p}.per_call_eur"), "6 decimal");
        full().set(&format!("{p}.per_call_eur"), "-1").refused(&format!("{p}.per_call_eur"), "negative");
        full()
            .set(&format!("{p}.tools.deep_search"), "0.12345678")
            .refused(&format!("{p}.tools.deep_search"), "6 decimal");
        full().set(&format!("{p}.tools.deep_search"), "free").refused(&format!("{p}.tools.deep_search"), "");
        full().set(&format!("{p}.per_call"), "1").refused(&format!("{p}.per_call"), "per_call");
    }

    #[test]
    fn globs_are_not_empty() {
        full().set("mcp.servers.search.tools.deny", "['x', '']").refused("mcp.servers.search.tools.deny[1]", "empty");
        full().set("mcp.servers.search.tools.allow", "['  ']").refused("mcp.servers.search.tools.allow[0]", "empty");
        full().set("tenants.acme.mcp.tools.allow", "['']").refused("tenants.acme.mcp.tools.allow[0]", "empty");
        full()
            .set("tenants.acme.agents.bot.mcp.tools.deny", "['']")
            .refused("tenants.acme.agents.bot.mcp.tools.deny[0]", "empty");
        // An empty list is meaningful: an allow list of nothing allows nothing.
        let none = full().set("tenants.acme.mcp.tools.allow", "[]").loads().config;
        assert_eq!(none.tenants["acme"].mcp.tools.allow, Some(vec![]));
    }

    #[test]
    fn a_narrowing_names_declared_servers() {
        full().set("tenants.acme.mcp.servers", "[search, nope]").refused(
            "tenants.acme.mcp.servers[1]",
            "server `nope` is not declared under mcp.servers (declared: files, search)",
        );
        full()
            .set("tenants.acme.agents.bot.mcp.servers", "[nope]")
            .refused("tenants.acme.agents.bot.mcp.servers[0]", "not declared");
        full().set("tenants.acme.mcp.extra", "1").refused("tenants.acme.mcp.extra", "extra");
        // An agent listing a server its tenant does not: both apply, so a warning.
        full()
            .set("tenants.acme.mcp.servers", "[search]")
            .warned("tenants.acme.agents.reader.mcp.servers[0]", "does not list `files`");
    }

    #[test]
    fn a_glob_that_can_match_no_federated_name_is_a_warning() {
        full().set("tenants.acme.mcp.tools.deny", "[search]").warned("tenants.acme.mcp.tools.deny[0]", "federated");
        full()
            .set("tenants.acme.mcp.tools.allow", "['serch__*']")
            .warned("tenants.acme.mcp.tools.allow[0]", "`serch` is not declared");
        let fine = full().set("tenants.acme.mcp.tools.allow", "['*', 's*__x', '?earch__*', 'search__deep_?']").loads();
        assert!(fine.warnings.is_empty(), "{:#?}", fine.warnings);
    }

    #[test]
    fn oauth_says_who_issues_for_whom() {
        let o = "mcp.oauth";
        for key in ["issuer", "audience", "jwks_url", "tenant_claim"] {
            full().remove(&format!("{o}.{key}")).refused(&format!("{o}.{key}"), "required");
        }
        full().set(&format!("{o}.issuer"), "idp.example").refused(&format!("{o}.issuer"), "not a URL");
        full().set(&format!("{o}.audience"), "urn:gw").refused(&format!("{o}.audience"), "not a URL");
        full().set(&format!("{o}.jwks_url"), "ftp://idp/jwks").refused(&format!("{o}.jwks_url"), "not supported");
        full().set(&format!("{o}.tenant_claim"), "' '").refused(&format!("{o}.tenant_claim"), "empty");
        full().set(&format!("{o}.agent_claim"), "''").refused(&format!("{o}.agent_claim"), "empty");
        let no_agent = full().remove(&format!("{o}.agent_claim")).loads().config;
        assert_eq!(no_agent.mcp.unwrap().oauth.unwrap().agent_claim, None);
        full().set(&format!("{o}.jwks_url"), "http://idp.example/jwks").warned(&format!("{o}.jwks_url"), "cleartext");
        let local = full().set(&format!("{o}.jwks_url"), "http://127.0.0.1:9000/jwks").loads();
        assert!(local.warnings.is_empty(), "{:#?}", local.warnings);
        // Kept as written: `iss` is compared exactly.
        let slash = full().set(&format!("{o}.issuer"), "https://idp.example/").loads().config;
        assert_eq!(slash.mcp.unwrap().oauth.unwrap().issuer, "https://idp.example/");
    }

    #[test]
    fn servers_or_rest_operations_are_what_is_federated() {
        full()
            .set("mcp.servers", "{}")
            .remove("tenants.acme.mcp")
            .remove("tenants.acme.agents")
            .refused("mcp.servers", "at least one server");
        let rest_only = full().remove("mcp.servers").remove("tenants.acme.mcp").remove("tenants.acme.agents");
        let rest_only = rest_only.set("mcp.expose_rest", "true");
        rest_only.warned("mcp.expose_rest", "no backend is of kind http");
        assert!(rest_only.loads().config.mcp.unwrap().expose_rest);
    }

    #[test]
    fn a_session_key_or_the_audit_salt_seals_sessions() {
        let salted = full().remove("mcp.session_key").loads();
        assert_eq!(salted.config.mcp.unwrap().session_key, None);
        assert!(salted.warnings.is_empty(), "{:#?}", salted.warnings);
        full().remove("mcp.session_key").remove("audit.hash_salt").warned("mcp", "mcp.session_key");
    }

    #[test]
    fn a_section_with_a_shape_error_is_not_judged_from_the_tenants() {
        // The wrong shape is the one error: the tenants' references to its servers
        // are not checked against what was left.
        let errors = full().set("mcp.servers.search.timeout", "[1]").errors();
        assert_eq!(errors.len(), 1, "{errors:#?}");
        assert_eq!(errors[0].path, "mcp.servers.search.timeout", "{errors:#?}");
    }

    #[test]
    fn the_example_of_docs_mcp_loads() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/mcp.md")).unwrap();
        let block = doc.split("```yaml\n").nth(1).and_then(|rest| rest.split("```").next()).unwrap();
        let example: Value = serde_norway::from_str(block).unwrap();
        let yaml = |value: &Value| serde_norway::to_string(value).unwrap();
        let text = full()
            .set("mcp", &yaml(&example["mcp"]))
            .set("tenants.acme.mcp", &yaml(&example["tenants"]["acme"]["mcp"]))
            .set("tenants.acme.agents", &yaml(&example["tenants"]["acme"]["agents"]))
            .text();
        let mut vars = env();
        for name in ["FLEXWAY_MCP_SESSION_KEY", "SEARCH_MCP_TOKEN"] {
            vars.insert(name.to_owned(), format!("value-of-{name}"));
        }
        let loaded = load_str(&text, &vars).unwrap_or_else(|e| panic!("docs/mcp.md's example is refused: {e}"));
        let search = server(&loaded.config, "search");
        assert_eq!(search.auth, Auth::Bearer { secret: SecretRef::Env("SEARCH_MCP_TOKEN".into()) });
    }

    /// Whether a gateway starts with `full()`'s configuration and `MCP_SESSION_KEY` set
    /// to `key`: its error's text if not.
    async fn starts_with_session_key(key: &str) -> Result<(), String> {
        let mut vars = env();
        vars.insert("MCP_SESSION_KEY".to_owned(), key.to_owned());
        let config = load_str(&full().text(), &vars).unwrap().config;
        let adapters = crate::gateway::Adapters {
            budgets: std::sync::Arc::new(crate::budget::MemoryBudgetStore::new()),
            audit: std::sync::Arc::new(crate::audit::sinks::MemoryAuditSink::new()),
            export: crate::telemetry::Export::Batched,
            cache: None,
        };
        let secrets = std::sync::Arc::new(crate::secret::LocalSecrets { env: vars });
        crate::gateway::Gateway::new(config, secrets, adapters).await.map(drop).map_err(|e| e.to_string())
    }

    #[tokio::test]
    async fn a_session_key_shorter_than_16_bytes_stops_the_start() {
        // Checked once resolved: at load, a reference has no length.
        let refused = starts_with_session_key("fifteen-bytes!!").await;
        let says = "mcp.session_key: the key is 15 bytes; a session key is at least 16";
        assert!(refused.as_ref().is_err_and(|e| e.contains(says)), "{refused:?}");
        assert_eq!(starts_with_session_key("sixteen-bytes!!!").await, Ok(()));
    }

    /// `full()` with the `kind: http` backend `docs` mounted at `/apis/docs` (its tool
    /// prefix `apis_docs`) and `mcp.expose_rest`; the contract's directory, kept.
    fn with_rest() -> (Doc, tempfile::TempDir) {
        let dir = tempfile::tempdir().unwrap();
        let contract = dir.path().join("docs.yaml");
        let operation =
            r#"{operationId: get_doc, x-flexway-ai: {metering: per_call, price_per_thousand_eur: "1", feature: docs}}"#;
        let text = format!("openapi: 3.1.0\ninfo: {{title: D, version: '1'}}\npaths:\n  /doc:\n    get: {operation}\n");
        std::fs::write(&contract, text).unwrap();
        let backend =
            format!("{{kind: http, url: 'http://127.0.0.1:9', mount: /apis/docs, contract: '{}'}}", contract.display());
        (full().set("ai.backends.docs", &backend).set("mcp.expose_rest", "true"), dir)
    }

    #[test]
    fn a_server_named_as_a_rest_mount_is_refused_when_rest_is_exposed() {
        let (doc, _dir) = with_rest();
        let clash = doc.set("mcp.servers.apis_docs", "{url: 'http://h/mcp'}");
        clash.refused("mcp.servers.apis_docs", "backend `docs` (expose_rest) are tools named `apis_docs__*`");
        let (doc, _dir) = with_rest();
        let hidden = doc.set("mcp.servers.apis_docs", "{url: 'http://h/mcp'}").set("mcp.expose_rest", "false");
        assert!(hidden.loads().config.mcp.unwrap().servers.contains_key("apis_docs"), "no REST tool to clash with");
    }

    #[test]
    fn a_narrowing_names_a_rest_mount_as_a_server_when_rest_is_exposed() {
        let (doc, _dir) = with_rest();
        let config = doc.set("tenants.acme.mcp.servers", "[search, apis_docs]").loads().config;
        assert_eq!(config.tenants["acme"].mcp.servers, Some(vec!["search".to_owned(), "apis_docs".to_owned()]));
        let (doc, _dir) = with_rest();
        doc.set("tenants.acme.mcp.servers", "[search, apis_docs]")
            .set("mcp.expose_rest", "false")
            .refused("tenants.acme.mcp.servers[1]", "server `apis_docs` is not declared");
    }
}
