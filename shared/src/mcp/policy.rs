//! Who may use which MCP server and call which tool (SPEC §17). A tool the caller may
//! not call is absent from its list and answered as an unknown tool: the door asks
//! these two questions and nothing else decides.
//!
//! A server's globs match its own tool names; a tenant's or an agent's the federated
//! names (`{server}__{tool}`). Deny wins; an absent `allow` allows everything.

use std::collections::BTreeSet;

use super::names::federated;
use crate::config::mcp::{Mcp, McpNarrowing, ToolGlobs};

/// `pattern` matches the whole of `name`: `*` any run of characters (none too), `?`
/// exactly one, every other character itself.
pub fn glob(pattern: &str, name: &str) -> bool {
    let pattern: Vec<char> = pattern.chars().collect();
    let name: Vec<char> = name.chars().collect();
    let (mut p, mut n) = (0, 0);
    // The last `*` seen and the position in `name` it was tried at: on a mismatch,
    // it takes one more character and matching resumes after it.
    let mut star: Option<(usize, usize)> = None;
    while n < name.len() {
        match pattern.get(p) {
            Some('*') => {
                star = Some((p, n));
                p += 1;
            }
            Some(&c) if c == '?' || c == name[n] => {
                p += 1;
                n += 1;
            }
            _ => match star {
                Some((at, tried)) => {
                    p = at + 1;
                    n = tried + 1;
                    star = Some((at, tried + 1));
                }
                None => return false,
            },
        }
    }
    pattern[p..].iter().all(|&c| c == '*')
}

/// `globs` let `name` through: no deny matches, and an allow does (or none is given).
/// `globs` let a tool through under any of its `names` (its whole federated name and
/// the one it is listed as): no deny matches one of them, and an allow does (or none
/// is given).
pub fn allows(globs: &ToolGlobs, names: &[&str]) -> bool {
    let any = |pattern: &String| names.iter().any(|name| glob(pattern, name));
    if globs.deny.iter().any(any) {
        return false;
    }
    globs.allow.as_ref().is_none_or(|allow| allow.iter().any(any))
}

/// `narrowing` lists `server` among its servers, or lists none.
fn lists(narrowing: &McpNarrowing, server: &str) -> bool {
    narrowing.servers.as_ref().is_none_or(|servers| servers.iter().any(|s| s == server))
}

/// The caller, as far as MCP policy asks: its tenant's and agent's narrowing, whether
/// the call is sensitive (internal servers only) and the residency it is held to.
#[derive(Debug, Clone, Copy)]
pub struct Who<'a> {
    pub tenant: &'a McpNarrowing,
    pub agent: Option<&'a McpNarrowing>,
    pub sensitive: bool,
    /// The jurisdictions the caller's data may go to (`None`: any).
    pub residency: Option<&'a BTreeSet<String>>,
}

impl Who<'_> {
    /// The caller may reach `server`: it is configured, the tenant and the agent list it
    /// (or list none), it is internal when the caller is sensitive, and under residency
    /// it declares a jurisdiction the caller's data may go to.
    pub fn may_use(&self, mcp: &Mcp, server: &str) -> bool {
        let Some(config) = mcp.servers.get(server) else {
            return false;
        };
        lists(self.tenant, server)
            && self.agent.is_none_or(|agent| lists(agent, server))
            && !(self.sensitive && config.external)
            && self.residency.is_none_or(|allowed| config.jurisdiction.as_ref().is_some_and(|j| allowed.contains(j)))
    }

    /// The caller may call `tool` of `server`: it may use the server, the server's
    /// globs let the tool through, and the tenant's and the agent's let its federated
    /// name through.
    pub fn may_call(&self, mcp: &Mcp, server: &str, tool: &str) -> bool {
        if !self.may_use(mcp, server) {
            return false;
        }
        let Some(config) = mcp.servers.get(server) else {
            return false;
        };
        // A tenant's or agent's globs see the name whole and as listed (cut at 64):
        // a deny matching either hides the tool, an allow matching either lets it by.
        let whole = format!("{server}__{tool}");
        let listed = federated(server, tool);
        let names = [whole.as_str(), listed.as_str()];
        allows(&config.tools, &[tool])
            && allows(&self.tenant.tools, &names)
            && self.agent.is_none_or(|agent| allows(&agent.tools, &names))
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use super::*;
    use crate::config::mcp::{McpPrice, McpServer};
    use crate::config::model::Auth;

    fn globs(allow: Option<&[&str]>, deny: &[&str]) -> ToolGlobs {
        ToolGlobs {
            allow: allow.map(|a| a.iter().map(|s| s.to_string()).collect()),
            deny: deny.iter().map(|s| s.to_string()).collect(),
        }
    }

    fn server(external: bool, jurisdiction: Option<&str>, tools: ToolGlobs) -> McpServer {
        McpServer {
            url: "http://127.0.0.1:1/mcp".into(),
            auth: Auth::None,
            external,
            jurisdiction: jurisdiction.map(str::to_owned),
            timeout: Duration::from_secs(30),
            price: McpPrice::default(),
            tools,
        }
    }

    fn mcp() -> Mcp {
        let mut servers = BTreeMap::new();
        servers.insert("search".to_owned(), server(true, Some("eu"), globs(Some(&["*"]), &["delete_*"])));
        servers.insert("files".to_owned(), server(false, Some("us"), ToolGlobs::default()));
        servers.insert("notes".to_owned(), server(false, None, ToolGlobs::default()));
        Mcp { servers, session_key: None, oauth: None, expose_rest: false }
    }

    fn who<'a>(tenant: &'a McpNarrowing) -> Who<'a> {
        Who { tenant, agent: None, sensitive: false, residency: None }
    }

    #[test]
    fn glob_matches_runs_single_characters_and_literals() {
        assert!(glob("*", ""));
        assert!(glob("*", "anything"));
        assert!(glob("search__*", "search__web"));
        assert!(!glob("search__*", "files__read"));
        assert!(glob("delete_?", "delete_a"));
        assert!(!glob("delete_?", "delete_ab"));
        assert!(glob("*_admin_*", "search__x_admin_y"));
        assert!(glob("a*b*c", "aXbYbZc"));
        assert!(!glob("a*b*c", "aXbYbZ"));
        assert!(glob("read", "read"));
        assert!(!glob("read", "reads"));
        assert!(!glob("[ab]", "a"), "brackets are literal");
        assert!(glob("[ab]", "[ab]"));
        assert!(glob("é?", "éà"));
    }

    #[test]
    fn deny_wins_over_allow_at_every_level() {
        let mcp = mcp();
        let open = McpNarrowing::default();
        assert!(who(&open).may_call(&mcp, "search", "web"));
        assert!(!who(&open).may_call(&mcp, "search", "delete_index"), "the server's deny");

        let tenant = McpNarrowing { servers: None, tools: globs(Some(&["search__*"]), &["search__web"]) };
        assert!(!who(&tenant).may_call(&mcp, "search", "web"), "the tenant's deny beats its allow");
        assert!(who(&tenant).may_call(&mcp, "search", "news"));
        assert!(!who(&tenant).may_call(&mcp, "files", "read"), "outside the tenant's allow");
    }

    #[test]
    fn an_absent_allow_allows_all_and_an_empty_one_nothing() {
        let mcp = mcp();
        let all = McpNarrowing::default();
        assert!(who(&all).may_call(&mcp, "files", "anything"));
        let none = McpNarrowing { servers: None, tools: globs(Some(&[]), &[]) };
        assert!(who(&none).may_use(&mcp, "files"));
        assert!(!who(&none).may_call(&mcp, "files", "anything"));
    }

    #[test]
    fn the_tenant_and_the_agent_each_narrow() {
        let mcp = mcp();
        let tenant = McpNarrowing { servers: Some(vec!["search".into(), "files".into()]), tools: ToolGlobs::default() };
        let agent = McpNarrowing { servers: Some(vec!["search".into()]), tools: globs(None, &["search__deep_*"]) };
        let tenant_only = who(&tenant);
        assert!(tenant_only.may_use(&mcp, "files"));
        assert!(!tenant_only.may_use(&mcp, "notes"), "not in the tenant's servers");

        let with_agent = Who { agent: Some(&agent), ..tenant_only };
        assert!(!with_agent.may_use(&mcp, "files"), "not in the agent's servers");
        assert!(with_agent.may_call(&mcp, "search", "web"));
        assert!(!with_agent.may_call(&mcp, "search", "deep_search"), "the agent's deny");
        assert!(tenant_only.may_call(&mcp, "search", "deep_search"), "the tenant alone allows it");

        // An agent cannot widen what its tenant narrows.
        let wide = McpNarrowing { servers: Some(vec!["notes".into()]), tools: globs(Some(&["*"]), &[]) };
        assert!(!Who { agent: Some(&wide), ..tenant_only }.may_use(&mcp, "notes"));
    }

    #[test]
    fn a_sensitive_caller_reaches_internal_servers_only() {
        let mcp = mcp();
        let open = McpNarrowing::default();
        let sensitive = Who { sensitive: true, ..who(&open) };
        assert!(!sensitive.may_use(&mcp, "search"));
        assert!(!sensitive.may_call(&mcp, "search", "web"));
        assert!(sensitive.may_use(&mcp, "files"));
        assert!(sensitive.may_call(&mcp, "files", "read"));
    }

    #[test]
    fn residency_needs_a_declared_jurisdiction_in_the_set() {
        let mcp = mcp();
        let open = McpNarrowing::default();
        let eu: BTreeSet<String> = ["eu".to_owned()].into();
        let held = Who { residency: Some(&eu), ..who(&open) };
        assert!(held.may_use(&mcp, "search"));
        assert!(!held.may_use(&mcp, "files"), "another jurisdiction");
        assert!(!held.may_use(&mcp, "notes"), "undeclared");
        assert!(who(&open).may_use(&mcp, "notes"), "no residency: any server");
    }

    #[test]
    fn an_unknown_server_is_neither_used_nor_called() {
        let mcp = mcp();
        let open = McpNarrowing::default();
        assert!(!who(&open).may_use(&mcp, "nope"));
        assert!(!who(&open).may_call(&mcp, "nope", "web"));
    }

    #[test]
    fn tenant_globs_see_the_cut_name_of_a_long_tool() {
        let mcp = mcp();
        let long = "x".repeat(80);
        let name = federated("files", &long);
        let tenant = McpNarrowing { servers: None, tools: globs(None, &[name.as_str()]) };
        assert!(!who(&tenant).may_call(&mcp, "files", &long));
        assert!(who(&tenant).may_call(&mcp, "files", "short"));
    }

    #[test]
    fn tenant_globs_see_the_whole_name_of_a_long_tool_too() {
        let mcp = mcp();
        let long = "export_all_customer_records_to_external_bucket_then_delete_originals";
        assert!(!federated("files", long).contains("delete"), "the cut name hides the word");
        let tenant = McpNarrowing { servers: None, tools: globs(None, &["files__*delete*"]) };
        assert!(!who(&tenant).may_call(&mcp, "files", long));
        let allowed = McpNarrowing { servers: None, tools: globs(Some(&["files__export_*_originals"]), &[]) };
        assert!(who(&allowed).may_call(&mcp, "files", long));
    }
}
