//! Federated tool names: `{server}__{tool}`, at most [`MAX_TOOL_NAME`] characters. A
//! longer one is cut with a suffix hashed from the whole name, so the same server and
//! tool always give the same name, and two long tools sharing a prefix do not collide.

use sha2::{Digest, Sha256};

/// The longest tool name clients are promised (the MCP tool-name guidance).
pub const MAX_TOOL_NAME: usize = 64;

/// What joins a server's name to its tool's: server names never contain it.
const SEPARATOR: &str = "__";

/// Characters kept of a name that is too long: then `_` and 8 hex characters.
const KEPT: usize = MAX_TOOL_NAME - 9;

/// `tool` of `server` as the caller sees it.
pub fn federated(server: &str, tool: &str) -> String {
    let full = format!("{server}{SEPARATOR}{tool}");
    if full.chars().count() <= MAX_TOOL_NAME {
        return full;
    }
    let digest = Sha256::digest(full.as_bytes());
    let mut cut: String = full.chars().take(KEPT).collect();
    cut.push('_');
    cut.push_str(&hex::encode(&digest[..4]));
    cut
}

/// The server a federated name designates: what precedes its first `__`. Exact for
/// the names configuration accepts (no `__`, no `_` at the end, short enough that a
/// cut name keeps `{server}__`).
pub fn server_of(name: &str) -> Option<&str> {
    name.split_once(SEPARATOR).map(|(server, _)| server).filter(|server| !server.is_empty())
}

/// Whether `name` may be a cut one: [`MAX_TOOL_NAME`] characters ending in `_` and
/// 8 hex characters. Its tool is then only known from a listing (the rest after
/// `{server}__` is a cut, not a tool's name).
pub fn looks_cut(name: &str) -> bool {
    let Some((kept, suffix)) = name.rsplit_once('_') else { return false };
    name.chars().count() == MAX_TOOL_NAME
        && kept.chars().count() == KEPT
        && suffix.len() == 8
        && suffix.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// The tool of `server` whose federated name is `name`. A listed tool whose name
/// round-trips comes first; then a listed tool that federates to `name` (a cut one);
/// then the rest after `{server}__` when it round-trips and `name` does not look cut
/// (a tool not listed: the server will say whether it has it). `None` when nothing
/// federates to `name`, and for a name that looks cut without a listing.
pub fn tool_of<'a>(name: &str, server: &str, listed: impl IntoIterator<Item = &'a str>) -> Option<String> {
    let rest = name
        .strip_prefix(server)
        .and_then(|rest| rest.strip_prefix(SEPARATOR))
        .filter(|rest| federated(server, rest) == name);
    let unlisted = rest.filter(|_| !looks_cut(name));
    let mut matching = None;
    for tool in listed {
        if Some(tool) == rest {
            return Some(tool.to_owned());
        }
        if matching.is_none() && federated(server, tool) == name {
            matching = Some(tool);
        }
    }
    matching.or(unlisted).map(str::to_owned)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cut_name_is_resolved_from_the_listing_only() {
        let long = format!("summarize_the_quarterly_report_of_every_subsidiary_{}", "x".repeat(30));
        let name = federated("finance", &long);
        assert!(looks_cut(&name));
        assert_eq!(tool_of(&name, "finance", []), None, "the cut remainder is not the tool");
        assert_eq!(tool_of(&name, "finance", ["other", long.as_str()]), Some(long.clone()));
        assert!(!looks_cut("finance__web"));
    }

    #[test]
    fn a_short_name_is_server_and_tool_joined() {
        assert_eq!(federated("search", "web"), "search__web");
        assert_eq!(server_of("search__web"), Some("search"));
        assert_eq!(tool_of("search__web", "search", []), Some("web".to_owned()));
    }

    #[test]
    fn a_name_of_exactly_64_characters_is_kept_whole() {
        let tool = "t".repeat(MAX_TOOL_NAME - "search__".len());
        let name = federated("search", &tool);
        assert_eq!(name.len(), MAX_TOOL_NAME);
        assert_eq!(name, format!("search__{tool}"));
    }

    #[test]
    fn a_long_name_is_cut_to_64_with_a_stable_hash_suffix() {
        let tool = "summarize_the_quarterly_report_of_every_subsidiary_in_every_region";
        let name = federated("finance", tool);
        assert_eq!(name.chars().count(), MAX_TOOL_NAME);
        assert_eq!(name, federated("finance", tool), "the same inputs give the same name");
        let full = format!("finance__{tool}");
        assert_eq!(&name[..KEPT], &full[..KEPT]);
        assert_eq!(&name[KEPT..KEPT + 1], "_");
        let digest = Sha256::digest(full.as_bytes());
        assert_eq!(&name[KEPT + 1..], hex::encode(&digest[..4]));
        assert!(name[KEPT + 1..].chars().all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
    }

    #[test]
    fn two_long_tools_sharing_a_prefix_get_different_names() {
        let prefix = "x".repeat(70);
        let a = federated("s", &format!("{prefix}_a"));
        let b = federated("s", &format!("{prefix}_b"));
        assert_ne!(a, b);
        assert_eq!(a.len(), MAX_TOOL_NAME);
        assert_eq!(b.len(), MAX_TOOL_NAME);
    }

    #[test]
    fn a_cut_name_counts_characters_not_bytes() {
        let tool = "é".repeat(80);
        let name = federated("s", &tool);
        assert_eq!(name.chars().count(), MAX_TOOL_NAME);
        assert!(name.chars().all(|c| c == 's' || c == 'é' || c == '_' || c.is_ascii_hexdigit()));
    }

    #[test]
    fn a_cut_name_maps_back_to_its_listed_tool() {
        let long = "a_tool_whose_name_is_far_too_long_to_be_shown_whole_to_any_client";
        let name = federated("files", long);
        assert_ne!(name, format!("files__{long}"));
        assert_eq!(tool_of(&name, "files", ["read", long]), Some(long.to_owned()));
        assert_eq!(server_of(&name), Some("files"));
    }

    #[test]
    fn a_listed_tool_named_as_the_rest_wins_over_a_cut_one() {
        let long = "b".repeat(90);
        let name = federated("s", &long);
        let rest = &name["s__".len()..];
        assert_eq!(tool_of(&name, "s", [long.as_str(), rest]), Some(rest.to_owned()));
    }

    #[test]
    fn a_name_of_another_server_or_no_tool_maps_to_nothing() {
        assert_eq!(tool_of("search__web", "files", ["web"]), None);
        assert_eq!(tool_of("search", "search", ["web"]), None);
        assert_eq!(server_of("search"), None);
        assert_eq!(server_of("__web"), None);
    }

    #[test]
    fn round_trips_every_tool_of_a_listing() {
        let tools = ["a", "read_file", &"c".repeat(63), &"d".repeat(200), "with__double"];
        for tool in tools {
            let name = federated("srv", tool);
            assert!(name.chars().count() <= MAX_TOOL_NAME);
            assert_eq!(server_of(&name), Some("srv"));
            assert_eq!(tool_of(&name, "srv", tools), Some(tool.to_owned()), "{tool}");
        }
    }

    proptest::proptest! {
        #[test]
        fn any_server_and_tool_federate_within_64_and_back(
            server in "[a-z0-9]([a-z0-9-]|_[a-z0-9-]){0,15}",
            tool in "\\PC{0,100}",
            other in "\\PC{0,100}",
        ) {
            let name = federated(&server, &tool);
            proptest::prop_assert!(name.chars().count() <= MAX_TOOL_NAME);
            proptest::prop_assert_eq!(&name, &federated(&server, &tool));
            proptest::prop_assert_eq!(server_of(&name), Some(server.as_str()));
            proptest::prop_assert_eq!(tool_of(&name, &server, [other.as_str(), tool.as_str()]), Some(tool.clone()));
            let allowed = |c: char| server.contains(c) || tool.contains(c) || c == '_' || c.is_ascii_hexdigit();
            proptest::prop_assert!(name.chars().all(allowed));
        }
    }
}
