//! The reference in `docs/` kept true by the code:
//! - `docs/http.md` lists every `ErrorCode`, a refusal's with its status;
//! - `docs/configuration.md` is generated from the config's JSON Schema (regenerate with
//!   `FLEXWAY_BLESS=1 cargo test -p flexway --test docs_drift`);
//! - `docs/budgets.md`'s worked example is the arithmetic of `flexway::budget::plan`.
#![cfg(test)]

use flexway_testkit::golden as support;

use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::PathBuf;

use flexway::budget::plan::{self, Allowance, Budget};
use flexway::budget::{CounterKey, Unit};
use flexway::call::ErrorCode;
use flexway::config::{BackendId, Price};
use flexway::error::{Attempts, GatewayError, UnavailableCause};
use flexway::identity::IdentityError;
use flexway::money::MicroEur;
use flexway::protocol::openai::{InvalidRequest, Usage};
use serde_json::Value;

fn repo(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..").join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(repo(path)).unwrap_or_else(|e| panic!("{path}: {e}"))
}

// ---------------------------------------------------------------- docs/http.md

/// One error of each code. A new variant in `GatewayError` makes the source check
/// below fail until it is added here, and then the table check until it is documented.
fn one_of_each() -> Vec<GatewayError> {
    let attempts = Attempts { tried: vec![BackendId::new("a")], skipped: vec![] };
    vec![
        GatewayError::InvalidRequest(InvalidRequest { message: "m".into(), param: None }),
        GatewayError::Identity(IdentityError::MissingKey),
        GatewayError::Identity(IdentityError::UnknownKey),
        GatewayError::Identity(IdentityError::UnknownAgent { agent: "x".into() }),
        GatewayError::Identity(IdentityError::UnreadableAgent),
        GatewayError::Identity(IdentityError::UnknownTenant { tenant: "t".into() }),
        GatewayError::CapabilityUnavailable { capability: "chat" },
        GatewayError::ImageOriginNotAllowed { origin: "o".into() },
        GatewayError::SensitiveNoInternalBackend,
        GatewayError::ResidencyUnavailable { allowed: "eu".into() },
        GatewayError::BodyTooLarge { limit: 1 },
        GatewayError::ImageTooLarge { limit: 1 },
        GatewayError::HeadersTooLarge { max_headers: 1, max_bytes: 1 },
        GatewayError::BudgetExceeded { budget: "b".into(), retry_after_secs: Some(1) },
        GatewayError::BudgetExceeded { budget: "run r tokens".into(), retry_after_secs: None },
        GatewayError::RateLimited {
            holder: "tenant t".into(),
            kind: flexway::budget::plan::Rate::Requests,
            limit: 1,
            retry_after_secs: 1,
        },
        GatewayError::BackendQuota {
            backends: "a".into(),
            kind: flexway::budget::plan::Rate::Tokens,
            retry_after_secs: 1,
        },
        GatewayError::RunNotFound { run: "r".into() },
        GatewayError::RunEnded { run: "r".into(), why: "ended" },
        GatewayError::UpstreamError { backend: BackendId::new("a"), detail: "d".into(), attempts: attempts.clone() },
        GatewayError::UpstreamUnavailable {
            cause: UnavailableCause::UpstreamFailed,
            attempts: attempts.clone(),
            last_failure: None,
        },
        GatewayError::UpstreamTimeout { backend: BackendId::new("a"), attempts },
        GatewayError::NotFound { method: "GET".into(), path: "/".into() },
        GatewayError::MethodNotAllowed { method: "GET".into(), path: "/".into() },
        GatewayError::OperationNotFound { method: "GET".into(), path: "/a".into(), backend: BackendId::new("a") },
        GatewayError::LedgerBusy,
        GatewayError::Overloaded { pool: BackendId::new("gpus") },
        GatewayError::RealtimeUnavailable,
        GatewayError::Internal("i".into()),
    ]
}

/// The codes of refusals: those with an HTTP status of their own.
fn refusal_codes() -> BTreeSet<ErrorCode> {
    ErrorCode::ALL.into_iter().filter(|code| code.refusal_status().is_some()).collect()
}

#[test]
fn every_refusal_code_is_one_this_test_builds() {
    let built: BTreeSet<ErrorCode> = one_of_each().iter().map(GatewayError::code).collect();
    assert_eq!(built, refusal_codes(), "GatewayError::code() changed: update one_of_each() and docs/http.md");
    for error in one_of_each() {
        assert_eq!(Some(error.status()), error.code().refusal_status(), "{error}");
    }
}

#[test]
fn http_doc_lists_every_error_code_with_its_status() {
    let doc = read("docs/http.md");
    let section = &doc[doc.find("## Error codes").unwrap()..];
    let section = &section[..section[1..].find("\n## ").map_or(section.len(), |i| i + 1)];
    let table_rows: Vec<&str> = section.lines().filter(|l| l.starts_with("| `")).collect();
    for code in ErrorCode::ALL {
        let row = match code.refusal_status() {
            Some(status) => format!("| `{code}` | {} |", status.as_u16()),
            None => format!("| `{code}` | "),
        };
        assert!(table_rows.iter().any(|l| l.starts_with(&row)), "docs/http.md has no error-table row starting `{row}`");
    }
    // The tables list no code the gateway does not produce.
    for line in table_rows {
        let code = line.trim_start_matches("| `").split('`').next().unwrap();
        assert!(
            ErrorCode::ALL.iter().any(|c| c.as_str() == code),
            "docs/http.md documents `{code}`, which the code never returns"
        );
    }
}

#[test]
fn http_doc_names_every_header_the_errors_write() {
    let doc = read("docs/http.md").to_ascii_lowercase();
    for error in one_of_each() {
        for (name, _) in error.headers() {
            assert!(doc.contains(&format!("`{name}`")), "docs/http.md does not name the `{name}` header");
        }
    }
    for name in [
        "flexway-request-id",
        "flexway-backend",
        "flexway-degraded",
        "flexway-budget",
        "flexway-agent",
        "flexway-tenant",
    ] {
        assert!(doc.contains(&format!("`{name}`")), "docs/http.md does not name `{name}`");
    }
}

// ---------------------------------------------------------------- docs/configuration.md

const CONFIG_DOC: &str = "docs/configuration.md";

#[test]
fn configuration_doc_matches_the_schema() {
    support::matches_or_bless(
        &repo(CONFIG_DOC),
        &configuration_doc(&flexway::config::json_schema()),
        "the config schema; regenerate it with: FLEXWAY_BLESS=1 cargo test -p flexway --test docs_drift",
    );
}

/// The configuration reference: one table row per key, sections for nested objects.
fn configuration_doc(schema: &Value) -> String {
    let mut out = String::new();
    out.push_str("<!-- Generated from config/flexway.schema.json by shared/tests/docs_drift.rs; do not edit.\n");
    out.push_str("     Regenerate: FLEXWAY_BLESS=1 cargo test -p flexway --test docs_drift -->\n\n");
    out.push_str("# Configuration reference\n\n");
    out.push_str(&text(schema["description"].as_str().unwrap_or("")));
    out.push_str(
        "\n\nOne file, `flexway.yaml` (YAML), read by `flexway serve`, `flexway validate` and the Lambda \
         function (`FLEXWAY_CONFIG`). `flexway validate --config FILE` lists every error at once. \
         The published schema is `config/flexway.schema.json`; `config/flexway.yaml` is a complete \
         example. Secrets are references, never values: `env:NAME`, `file:PATH`, or the ARN of an \
         AWS Secrets Manager secret or SSM parameter, which the gateway resolves when it starts, in \
         either shape, with the AWS SDK's usual environment and credentials (and again every \
         `secrets.refresh`). `<name>` stands for a name you choose; `[]` for an item of a list. A key not \
         listed here is refused. \"Default\" repeats the default the description states. A file \
         is refused whole, before it is read as configuration, when it is over 4 MiB, nests deeper than \
         64 levels, would hold more than 1,000,000 nodes or 16 MiB of text once its YAML aliases are \
         expanded, or has a key longer than 1 KiB (`shared/src/config/bounds.rs`). Relative paths \
         (`file:` references, `store.path`, `audit.path`) resolve against the working \
         directory. A `kind: anthropic` backend is called in its own format, translated both ways \
         (docs/backends.md); a `kind: relay` backend is another Flexway (docs/http.md, \"Relay\"). \
         A `kind: grpc` backend is a specialised model's gRPC upstream over HTTP/2 (cleartext \
         towards `http://` or `grpc://`, TLS towards `https://` or `grpcs://`): its \
         `descriptor_set` (relative to the working directory too) is read at load and says which \
         services it serves and how each method is metered (docs/grpc.md). A `kind: http` backend is a \
         REST upstream: its `contract` (an OpenAPI 3.0 or 3.1 file, relative to the working directory \
         too) is read at load, and its operations are served under its `mount` (docs/rest.md).\n",
    );
    let mut sections = vec![(String::new(), schema.clone())];
    while !sections.is_empty() {
        let (path, object) = sections.remove(0);
        let mut nested = Vec::new();
        section(&mut out, schema, &path, &object, &mut nested);
        // Depth first, in key order: a section's subsections follow it.
        for (i, s) in nested.into_iter().enumerate() {
            sections.insert(i, s);
        }
    }
    out
}

fn section(out: &mut String, root: &Value, path: &str, object: &Value, nested: &mut Vec<(String, Value)>) {
    let title = if path.is_empty() { "Top level".to_owned() } else { format!("`{path}`") };
    write!(out, "\n## {title}\n\n").unwrap();
    if !path.is_empty()
        && let Some(d) = object["description"].as_str()
    {
        write!(out, "{}\n\n", text(d)).unwrap();
    }
    out.push_str("| key | type | required | default | description |\n| --- | --- | --- | --- | --- |\n");
    let required: Vec<&str> =
        object["required"].as_array().map(|r| r.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let Some(properties) = object["properties"].as_object() else { return };
    for (key, property) in properties {
        let description = property["description"].as_str().unwrap_or("");
        let (kind, child) = describe(root, property);
        let full = if path.is_empty() { key.clone() } else { format!("{path}.{key}") };
        writeln!(
            out,
            "| `{key}` | {kind} | {} | {} | {} |",
            if required.contains(&key.as_str()) { "yes" } else { "no" },
            default_in(description),
            cell(description)
        )
        .unwrap();
        if let Some((suffix, child)) = child {
            nested.push((format!("{full}{suffix}"), child));
        }
    }
}

/// The type of a property for people, and the object it leads to (with the path
/// suffix: `.<name>` for a map, `[]` for a list), if it is a section of its own.
fn describe(root: &Value, property: &Value) -> (String, Option<(String, Value)>) {
    // `Option<T>`: `anyOf: [T, null]`.
    if let Some(any) = property["anyOf"].as_array() {
        let non_null: Vec<&Value> = any.iter().filter(|v| v["type"] != "null").collect();
        if non_null.len() == 1 {
            return describe(root, non_null[0]);
        }
        let kinds: Vec<String> = non_null.iter().map(|v| describe(root, v).0).collect();
        return (kinds.join(" or "), None);
    }
    if let Some(reference) = property["$ref"].as_str() {
        let name = reference.trim_start_matches("#/$defs/");
        let target = &root["$defs"][name];
        if target["properties"].is_object() {
            return ("object".to_owned(), Some((String::new(), target.clone())));
        }
        let (kind, _) = describe(root, target);
        return (kind, None);
    }
    if let Some(values) = property["enum"].as_array() {
        let values: Vec<String> = values.iter().filter_map(Value::as_str).map(|v| format!("`{v}`")).collect();
        return (values.join(" \\| "), None);
    }
    let types: Vec<&str> = match &property["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).filter(|t| *t != "null").collect(),
        _ => vec![],
    };
    match types.first().copied() {
        Some("object") => {
            let Some(values) = property.get("additionalProperties").filter(|v| v.is_object()) else {
                return ("object".to_owned(), Some((String::new(), property.clone())));
            };
            let (inner, child) = describe(root, values);
            let child = child.map(|(suffix, c)| (format!(".<name>{suffix}"), c));
            (format!("map of name → {inner}"), child)
        }
        Some("array") => {
            let (inner, child) = describe(root, &property["items"]);
            let child = child.map(|(suffix, c)| (format!("[]{suffix}"), c));
            (format!("list of {inner}"), child)
        }
        Some(t) => {
            let mut kind = t.to_owned();
            if let Some(pattern) = property["pattern"].as_str() {
                write!(kind, " (`{}`)", pattern.replace('|', "\\|")).unwrap();
            }
            let (min, max) = (&property["minimum"], &property["maximum"]);
            match (min.as_f64(), max.as_f64()) {
                (Some(a), Some(b)) if a == b => write!(kind, ", exactly {min}").unwrap(),
                (Some(_), Some(_)) => write!(kind, ", {min} to {max}").unwrap(),
                (Some(_), None) => write!(kind, ", ≥ {min}").unwrap(),
                (None, Some(_)) => write!(kind, ", ≤ {max}").unwrap(),
                (None, None) => {}
            }
            (kind, None)
        }
        None => (String::new(), None),
    }
}

/// The default a description states: "Default 4096.", "Default: `{sink: stdout}`.",
/// or "`openai` (default)"; empty when it states none.
fn default_in(description: &str) -> String {
    let flat = text(description);
    if let Some(i) = flat.find("Default") {
        let rest = flat[i + "Default".len()..].trim_start_matches(':').trim_start();
        let end = rest.find(['.', ';', ',']).unwrap_or(rest.len());
        // "Default `[chat]`; ...", "Default 1.": a dot inside backticks is kept.
        let value = match rest.strip_prefix('`') {
            Some(quoted) => quoted.find('`').map_or(&rest[..end], |j| &rest[..j + 2]),
            None => &rest[..end],
        };
        return cell(value.trim());
    }
    for marker in ["(default", "(the default"] {
        if let Some(i) = flat.find(marker) {
            let before = flat[..i].trim_end();
            if let Some(stripped) = before.strip_suffix('`')
                && let Some(j) = stripped.rfind('`')
            {
                return before[j..].to_owned();
            }
        }
    }
    String::new()
}

/// A doc comment as one line.
fn text(description: &str) -> String {
    description.split_whitespace().collect::<Vec<_>>().join(" ")
}

fn cell(description: &str) -> String {
    text(description).replace('|', "\\|")
}

// ---------------------------------------------------------------- docs/budgets.md

fn budget(name: &str, unit: Unit, limit: Option<u64>) -> Budget {
    Budget {
        name: name.into(),
        key: CounterKey(name.into()),
        unit,
        limit,
        resets_at: 0,
        kind: flexway::budget::plan::Kind::Period,
    }
}

/// Euros per million tokens as the config stores them.
fn price(input_eur: f64, output_eur: f64) -> Price {
    let micro = |eur: f64| MicroEur((eur * 1_000_000.0).round() as u64);
    Price {
        input_per_mtok: micro(input_eur),
        output_per_mtok: micro(output_eur),
        cached_input_per_mtok: None,
        cache_write_per_mtok: None,
    }
}

/// The figures of the worked example, as the doc states them.
#[test]
fn budgets_doc_worked_example() {
    let doc = read("docs/budgets.md");
    let says = |figure: &str| assert!(doc.contains(figure), "docs/budgets.md does not state `{figure}`");

    // A prompt of 1,000 bytes in 3 messages, no image.
    let prompt = plan::prompt_upper_bound(1_000, 3, 0);
    assert_eq!(prompt, 1_015);
    says("1,000 + 3 × 4 + 3 = 1,015");
    // The chain: `primary` (2.50 / 10.00 €/Mtok), then `cheap` (1.00 / 4.00).
    let primary = price(2.50, 10.00);
    let cheap = price(1.00, 4.00);
    let highest = plan::highest_price([primary, cheap]);
    assert_eq!(highest, primary);
    // Budgets: 100,000 tokens a day, 50 € a month; none used yet.
    let budgets = [
        budget("tenant acme tokens_per_day", Unit::Tokens, Some(100_000)),
        budget("tenant acme tokens_per_month", Unit::Tokens, None),
        budget("tenant acme eur_per_month", Unit::MicroEur, Some(50_000_000)),
    ];
    let allowance = Allowance { per_choice: 500, choices: 2, min_per_choice: 16 };
    let reserved = plan::plan(&budgets, &[0, 0, 0], prompt, allowance, highest).unwrap();
    assert_eq!((reserved.per_choice, reserved.completion_tokens, reserved.clamped), (500, 1_000, false));
    let amounts: Vec<u64> = reserved.lines.iter().map(|l| l.amount).collect();
    assert_eq!(amounts, [2_015, 2_015, 12_538]);
    says("1,015 + 1,000 = 2,015 tokens");
    says("⌈1,015 × 2.5⌉ + 1,000 × 10 = 2,538 + 10,000 = 12,538 µ€");

    // Settlement: `cheap` served (after a fallback) and reported 230 + 410 tokens.
    let usage = Usage::new(230, 410);
    let actual: Vec<u64> = plan::actual(&budgets, usage, cheap).into_iter().map(|(_, a)| a).collect();
    assert_eq!(actual, [640, 640, 1_870]);
    says("230 × 1 + 410 × 4 = 1,870 µ€");
    says("2,015 − 640 = 1,375 tokens");
    says("12,538 − 1,870 = 10,668 µ€");
    // Had `primary` served: 230 × 2.5 + 410 × 10.
    assert_eq!(plan::cost(usage, primary), MicroEur(4_675));
    says("4,675 µ€");

    // No usage reported (a stream without its usage chunk): 4 bytes a token.
    assert_eq!(plan::prompt_typical(1_000, 3, 0), 265);
    assert_eq!(plan::typical_tokens(1_638), 410);
    says("⌈1,000 / 4⌉ + 12 + 3 = 265");
    says("⌈1,638 / 4⌉ = 410");

    // Clamp: 98,000 tokens already used today leaves 2,000.
    let clamped = plan::plan(&budgets, &[98_000, 0, 0], prompt, allowance, highest).unwrap();
    assert_eq!((clamped.per_choice, clamped.completion_tokens, clamped.clamped), (492, 984, true));
    let amounts: Vec<u64> = clamped.lines.iter().map(|l| l.amount).collect();
    assert_eq!(amounts, [1_999, 1_999, 12_378]);
    says("⌊(2,000 − 1,015) / 2⌋ = 492");
    says("1,015 + 984 = 1,999 tokens");
    says("2,538 + 9,840 = 12,378 µ€");

    // Down to the minimum, then refused.
    let low = plan::plan(&budgets, &[98_950, 0, 0], prompt, allowance, highest).unwrap();
    assert_eq!(low.per_choice, 17);
    says("⌊35 / 2⌋ = 17");
    assert_eq!(plan::plan(&budgets, &[98_960, 0, 0], prompt, allowance, highest), Err(0));
    says("⌊25 / 2⌋ = 12");
}
