//! A `kind: http` backend's OpenAPI contract (SPEC §10, REST operations), read at
//! load: its operations (method and path template), and the metering each declares
//! in `x-flexway-ai`. The contract is the allow-list: what it does not declare is
//! never forwarded.
//!
//! Read with the maintained crates of each version: `openapiv3` for 3.0.x and
//! `oas3` for 3.1.x (3.1 is not a superset of 3.0), from YAML or JSON turned into a
//! JSON value first (the YAML reader is the configuration's own). The contract's
//! `servers` are ignored: the backend's `url` says where it is.
//!
//! Matching: a path is split on `/` and each segment percent-decoded (as the upstream
//! will read it); a path with an empty segment (`//`, a trailing `/`), a `.` or `..`
//! segment, or a segment that decodes to hold a `/` or is not UTF-8 matches nothing,
//! so that what is matched is what the upstream serves. `{name}` matches one segment
//! (with a literal prefix or suffix in the segment, those must match too); of the
//! templates that match, one with a literal segment wins over one with a template
//! there, and a template with a literal prefix or suffix over a bare one, from the
//! left. The method is then that template's (parameter names aside): another method
//! is 405 with `Allow`.

use http::Method;
use serde_json::{Value, json};

use super::descriptor::decimal_eur;
use super::model::{AiOperation, GrpcMetering};
use crate::money::MicroEur;

/// The extension a metered operation carries.
pub const EXTENSION: &str = "x-flexway-ai";

/// The operations of a contract, in the order declared.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Contract {
    pub operations: Vec<RestOperation>,
}

/// One operation: `POST /documents/{id}/ocr`, and its metering if any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestOperation {
    pub method: Method,
    /// The path template as the contract writes it.
    pub path: String,
    segments: Vec<Segment>,
    /// `None`: proxied unmetered.
    pub ai: Option<AiOperation>,
    /// `operationId`: its name as an MCP tool (SPEC §17, `mcp.expose_rest`).
    pub operation_id: Option<String>,
    pub summary: Option<String>,
    pub description: Option<String>,
    /// Its path and query parameters (the operation's, and its path's that it does
    /// not redeclare), in the order declared; header and cookie ones are not kept.
    pub parameters: Vec<Parameter>,
    /// Its request body, when it declares one.
    pub body: Option<RequestBody>,
    /// The operation as a tool's input: a JSON Schema of type object, a property per
    /// parameter (its schema, `required` as declared) and `body` (the JSON body's
    /// schema). `$ref`s to `#/components/schemas/NAME` point at `#/$defs/NAME`, and the
    /// schemas they reach (transitively) are copied into its `$defs`.
    pub input_schema: Value,
}

/// A path or query parameter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Parameter {
    pub name: String,
    pub location: ParameterIn,
    /// A path parameter always is.
    pub required: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParameterIn {
    Path,
    Query,
}

/// A request body: whether it is required, and whether it can be JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RequestBody {
    pub required: bool,
    /// A media type `application/json` or `…+json` is declared.
    pub json: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    /// `{name}`, or `prefix{name}suffix` within one segment.
    Template {
        prefix: String,
        suffix: String,
    },
}

impl Segment {
    fn parse(text: &str) -> Segment {
        match (text.find('{'), text.rfind('}')) {
            (Some(open), Some(close)) if open < close => {
                Segment::Template { prefix: text[..open].to_owned(), suffix: text[close + 1..].to_owned() }
            }
            _ => Segment::Literal(text.to_owned()),
        }
    }

    fn matches(&self, segment: &str) -> bool {
        match self {
            Segment::Literal(literal) => literal == segment,
            Segment::Template { prefix, suffix } => {
                segment.len() > prefix.len() + suffix.len() && segment.starts_with(prefix) && segment.ends_with(suffix)
            }
        }
    }
}

/// What a call's method and path find in a contract.
#[derive(Debug, PartialEq, Eq)]
pub enum Matched<'a> {
    Operation(&'a RestOperation),
    /// The path is declared, not with this method: the methods it has.
    MethodNotAllowed(Vec<Method>),
    NotFound,
}

impl Contract {
    /// The operation `method path` calls (`path` below the mount, starting with `/`,
    /// as the caller sent it: percent-encoded).
    pub fn find(&self, method: &Method, path: &str) -> Matched<'_> {
        let Some(segments) = decoded_segments(path) else { return Matched::NotFound };
        let matching = |op: &&RestOperation| {
            op.segments.len() == segments.len() && op.segments.iter().zip(&segments).all(|(s, p)| s.matches(p))
        };
        // The most literal template first, segment by segment from the left.
        let specificity = |op: &RestOperation| {
            let rank = |s: &Segment| match s {
                Segment::Literal(_) => 0,
                Segment::Template { prefix, suffix } if !prefix.is_empty() || !suffix.is_empty() => 1,
                Segment::Template { .. } => 2,
            };
            op.segments.iter().map(rank).collect::<Vec<_>>()
        };
        let Some(best) = self.operations.iter().filter(matching).min_by_key(|op| specificity(op)) else {
            return Matched::NotFound;
        };
        // The same template whatever its parameters are named (`/a/{id}`, `/a/{key}`).
        let same_path = self.operations.iter().filter(|op| op.segments == best.segments);
        let mut allowed = Vec::new();
        for op in same_path {
            if op.method == *method {
                return Matched::Operation(op);
            }
            allowed.push(op.method.clone());
        }
        Matched::MethodNotAllowed(allowed)
    }

    /// The operation declared as `method path` (the template), if any.
    pub fn declared(&self, method: &Method, path: &str) -> Option<&RestOperation> {
        self.operations.iter().find(|op| op.method == *method && op.path == path)
    }
}

/// The path's segments, percent-decoded; `None` when it can name nothing the contract
/// declares (see the module's docs).
fn decoded_segments(path: &str) -> Option<Vec<String>> {
    let mut segments = Vec::new();
    for raw in path.strip_prefix('/')?.split('/') {
        let segment = percent_encoding::percent_decode_str(raw).decode_utf8().ok()?;
        if segment.is_empty() || segment == "." || segment == ".." || segment.contains('/') {
            return None;
        }
        segments.push(segment.into_owned());
    }
    Some(segments)
}

/// The contract in `text` (YAML or JSON), or every reason it cannot be used.
pub(super) fn read(text: &str) -> Result<Contract, Vec<String>> {
    let document: Value = match serde_json::from_str(text) {
        Ok(value) => value,
        Err(_) => serde_norway::from_str(text).map_err(|e| vec![format!("neither JSON nor YAML: {e}")])?,
    };
    let version = document.get("openapi").and_then(Value::as_str).unwrap_or_default().to_owned();
    let mut declared: Vec<(Method, String, Option<Value>)> = Vec::new();
    // The typed crates read the operations; what makes one a tool is read from the
    // document as written (3.1's schemas are JSON Schema, kept whole).
    let raw = document.clone();
    if version.starts_with("3.0.") {
        let spec: openapiv3::OpenAPI =
            serde_json::from_value(document).map_err(|e| vec![format!("not an OpenAPI 3.0 document: {e}")])?;
        for (path, method, operation) in spec.operations() {
            declared.push((method_of(method)?, path.to_owned(), operation.extensions.get(EXTENSION).cloned()));
        }
    } else if version.starts_with("3.1.") {
        let spec: oas3::Spec =
            serde_json::from_value(document).map_err(|e| vec![format!("not an OpenAPI 3.1 document: {e}")])?;
        for (path, item) in spec.paths.iter().flatten() {
            for (method, operation) in item.methods() {
                // oas3 keeps extensions without their `x-`.
                let ai = operation.extensions.get(&EXTENSION[2..]).cloned();
                declared.push((method, path.clone(), ai));
            }
        }
    } else if version.is_empty() {
        return Err(vec!["has no `openapi` version: an OpenAPI 3.0 or 3.1 contract is required".to_owned()]);
    } else {
        return Err(vec![format!("is OpenAPI `{version}`: only 3.0.x and 3.1.x contracts are read")]);
    }
    let mut errors = Vec::new();
    let mut operations = Vec::new();
    for (method, path, ai) in declared {
        if !path.starts_with('/') {
            errors.push(format!("{method} {path}: a path starts with `/`"));
            continue;
        }
        let ai = match ai.map(|value| operation(&value)).transpose() {
            Ok(ai) => ai,
            Err(why) => {
                errors.push(format!("{method} {path}: {EXTENSION} {why}"));
                continue;
            }
        };
        // SPEC §16: a GET or a POST is cached, never what changes or removes a resource.
        if ai.as_ref().is_some_and(|ai| ai.cache.is_some()) && method != Method::GET && method != Method::POST {
            errors.push(format!(
                "{method} {path}: {EXTENSION} cache applies to GET and POST operations only: remove `cache` here"
            ));
            continue;
        }
        let segments = path.trim_start_matches('/').split('/').map(Segment::parse).collect();
        let described = described(&raw, &method, &path);
        operations.push(RestOperation {
            method,
            path,
            segments,
            ai,
            operation_id: described.operation_id,
            summary: described.summary,
            description: described.description,
            parameters: described.parameters,
            body: described.body,
            input_schema: described.input_schema,
        });
    }
    if operations.is_empty() && errors.is_empty() {
        errors.push("declares no operation: the contract is what the backend may be called for".to_owned());
    }
    if errors.is_empty() { Ok(Contract { operations }) } else { Err(errors) }
}

/// What an operation says of itself, for it to be a tool.
struct Described {
    operation_id: Option<String>,
    summary: Option<String>,
    description: Option<String>,
    parameters: Vec<Parameter>,
    body: Option<RequestBody>,
    input_schema: Value,
}

/// `method path` of `document` as a tool: its names, its parameters and body, and the
/// input schema made of them (see [`RestOperation::input_schema`]).
fn described(document: &Value, method: &Method, path: &str) -> Described {
    let item = document.get("paths").and_then(|paths| paths.get(path));
    let operation = item.and_then(|item| item.get(method.as_str().to_ascii_lowercase()));
    let text = |key: &str| operation?.get(key)?.as_str().map(str::to_owned);
    let (operation_id, summary, description) = (text("operationId"), text("summary"), text("description"));

    // The path's parameters, then the operation's, which replace a same one.
    let mut declared: Vec<(ParameterIn, String, Value)> = Vec::new();
    for holder in [item, operation].into_iter().flatten() {
        let listed = holder.get("parameters").and_then(Value::as_array).into_iter().flatten();
        for parameter in listed.map(|p| resolved(document, p, "parameters")) {
            let location = match parameter.get("in").and_then(Value::as_str) {
                Some("path") => ParameterIn::Path,
                Some("query") => ParameterIn::Query,
                _ => continue,
            };
            let Some(name) = parameter.get("name").and_then(Value::as_str) else { continue };
            declared.retain(|(l, n, _)| !(*l == location && n == name));
            declared.push((location, name.to_owned(), parameter.clone()));
        }
    }
    let mut properties = serde_json::Map::new();
    let mut required = Vec::new();
    let mut parameters = Vec::new();
    for (location, name, parameter) in declared {
        let needed = location == ParameterIn::Path || parameter.get("required") == Some(&Value::Bool(true));
        // Its `schema`, or the schema of its first `content` (a parameter has one).
        let content_schema = || parameter.get("content")?.as_object()?.values().next()?.get("schema");
        let mut schema = parameter.get("schema").or_else(content_schema).cloned().unwrap_or_else(|| json!({}));
        if let (Some(object), Some(about)) = (schema.as_object_mut(), parameter.get("description"))
            && !object.contains_key("description")
            && !object.contains_key("$ref")
        {
            object.insert("description".to_owned(), about.clone());
        }
        if needed {
            required.push(Value::String(name.clone()));
        }
        properties.insert(name.clone(), schema);
        parameters.push(Parameter { name, location, required: needed });
    }

    let body = operation.and_then(|op| op.get("requestBody")).map(|b| resolved(document, b, "requestBodies"));
    let json_type = |media: &str| {
        let media = media.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
        media == "application/json" || media.ends_with("+json")
    };
    let json_media = body.and_then(|b| b.get("content")?.as_object()?.iter().find(|(media, _)| json_type(media)));
    let body_required = body.and_then(|b| b.get("required")).and_then(Value::as_bool).unwrap_or(false);
    if let Some((_, media)) = json_media {
        properties.insert("body".to_owned(), media.get("schema").cloned().unwrap_or_else(|| json!({})));
        if body_required {
            required.push(Value::String("body".to_owned()));
        }
    }
    let body = body.map(|_| RequestBody { required: body_required, json: json_media.is_some() });

    let mut input_schema = json!({"type": "object", "properties": properties});
    if !required.is_empty() {
        input_schema["required"] = Value::Array(required);
    }
    let defs = inline_components(document, &mut input_schema);
    if !defs.is_empty() {
        input_schema["$defs"] = Value::Object(defs);
    }
    Described { operation_id, summary, description, parameters, body, input_schema }
}

/// `value`, or what its `$ref` to `#/components/{kind}/NAME` names (one level).
fn resolved<'a>(document: &'a Value, value: &'a Value, kind: &str) -> &'a Value {
    let prefix = format!("#/components/{kind}/");
    let named = value.get("$ref").and_then(Value::as_str).and_then(|r| r.strip_prefix(prefix.as_str()));
    named.and_then(|name| document.get("components")?.get(kind)?.get(name)).unwrap_or(value)
}

/// Points each `$ref` to `#/components/schemas/NAME` within `schema` at `#/$defs/NAME`;
/// the schemas so reached, themselves rewritten, by name.
fn inline_components(document: &Value, schema: &mut Value) -> serde_json::Map<String, Value> {
    const PREFIX: &str = "#/components/schemas/";
    fn rewrite(value: &mut Value, reached: &mut Vec<String>) {
        match value {
            Value::Object(object) => {
                if let Some(Value::String(target)) = object.get_mut("$ref")
                    && let Some(name) = target.strip_prefix(PREFIX).map(str::to_owned)
                {
                    *target = format!("#/$defs/{name}");
                    reached.push(name);
                }
                object.values_mut().for_each(|v| rewrite(v, reached));
            }
            Value::Array(items) => items.iter_mut().for_each(|v| rewrite(v, reached)),
            _ => {}
        }
    }
    let components = document.get("components").and_then(|c| c.get("schemas"));
    let mut defs = serde_json::Map::new();
    let mut reached = Vec::new();
    rewrite(schema, &mut reached);
    while let Some(name) = reached.pop() {
        if defs.contains_key(&name) {
            continue;
        }
        let Some(mut component) = components.and_then(|c| c.get(&name)).cloned() else { continue };
        rewrite(&mut component, &mut reached);
        defs.insert(name, component);
    }
    defs
}

fn method_of(name: &str) -> Result<Method, Vec<String>> {
    Method::from_bytes(name.to_ascii_uppercase().as_bytes()).map_err(|_| vec![format!("`{name}` is not a method")])
}

/// `x-flexway-ai: {metering, price_per_thousand_eur, feature, cache}`, validated as the
/// gRPC option is; `cache` (a policy of `ai.cache`, checked against it at load) is
/// REST's own.
fn operation(value: &Value) -> Result<AiOperation, String> {
    const KEYS: [&str; 4] = ["metering", "price_per_thousand_eur", "feature", "cache"];
    let Some(fields) = value.as_object() else {
        return Err("is not a mapping {metering, price_per_thousand_eur, feature, cache}".to_owned());
    };
    if let Some(unknown) = fields.keys().find(|k| !KEYS.contains(&k.as_str())) {
        return Err(format!("has an unknown key `{unknown}` ({})", KEYS.join(", ")));
    }
    let cache = match fields.get("cache") {
        None => None,
        Some(Value::String(policy)) if !policy.trim().is_empty() => Some(policy.trim().to_owned()),
        Some(_) => return Err("cache is not a policy name (one of ai.cache.policies, e.g. \"ocr\")".to_owned()),
    };
    // `{cache: POLICY}` alone (SPEC §16): cached, and counted as a call of no price
    // under the policy's name (the audit's `feature`, the metrics' dimension).
    if let (Some(policy), 1) = (&cache, fields.len()) {
        let feature = policy.clone();
        return Ok(AiOperation { metering: GrpcMetering::PerCall, price_per_thousand: MicroEur(0), feature, cache });
    }
    let metering = match fields.get("metering").and_then(Value::as_str) {
        Some("per_call") => GrpcMetering::PerCall,
        Some("per_byte") => GrpcMetering::PerByte,
        Some(other) => return Err(format!("metering `{other}` is not per_call or per_byte")),
        None => return Err("has no metering: per_call or per_byte".to_owned()),
    };
    let price = match fields.get("price_per_thousand_eur") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Number(number)) => {
            return Err(format!(
                "price_per_thousand_eur {number} is a number: write it as a decimal string (\"{number}\"), read \
                 exactly"
            ));
        }
        _ => return Err("has no price_per_thousand_eur (a decimal string of euros, e.g. \"0.25\")".to_owned()),
    };
    let price_per_thousand = decimal_eur(&price).map_err(|why| format!("price_per_thousand_eur {why}"))?;
    let feature = fields.get("feature").and_then(Value::as_str).unwrap_or_default().trim().to_owned();
    if feature.is_empty() {
        return Err("has no feature name (a metrics dimension, e.g. \"ocr\")".to_owned());
    }
    Ok(AiOperation { metering, price_per_thousand, feature, cache })
}

#[cfg(test)]
mod tests {
    use super::*;

    const OCR_31: &str = r#"
openapi: 3.1.0
info: {title: OCR, version: "1"}
servers: [{url: "https://ignored.example"}]
paths:
  /documents:
    post:
      x-flexway-ai: {metering: per_byte, price_per_thousand_eur: "0.002", feature: ocr}
      responses: {"200": {description: ok}}
  /documents/{id}:
    get: {responses: {"200": {description: ok}}}
    delete: {responses: {"204": {description: gone}}}
  /documents/latest:
    get:
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "0.5", feature: ocr-latest}
      responses: {"200": {description: ok}}
  /files/{name}.pdf:
    get: {responses: {"200": {description: ok}}}
"#;

    #[test]
    fn a_31_contract_is_read_with_its_metering() {
        let contract = read(OCR_31).unwrap();
        assert_eq!(contract.operations.len(), 5);
        let post = contract.declared(&Method::POST, "/documents").unwrap();
        let ai = post.ai.as_ref().unwrap();
        assert_eq!((ai.metering, ai.price_per_thousand.0, ai.feature.as_str()), (GrpcMetering::PerByte, 2_000, "ocr"));
        assert_eq!(contract.declared(&Method::GET, "/documents/{id}").unwrap().ai, None);
    }

    #[test]
    fn a_30_contract_in_json_is_read_too() {
        let json = r#"{"openapi": "3.0.3", "info": {"title": "t", "version": "1"}, "paths": {"/translate": {"post":
            {"x-flexway-ai": {"metering": "per_call", "price_per_thousand_eur": "1", "feature": "mt"},
             "responses": {"200": {"description": "ok"}}}}}}"#;
        let contract = read(json).unwrap();
        let op = contract.declared(&Method::POST, "/translate").unwrap();
        assert_eq!(op.ai.as_ref().unwrap().price_per_thousand.0, 1_000_000);
    }

    #[test]
    fn a_literal_segment_wins_and_another_method_is_405_with_the_declared_ones() {
        let contract = read(OCR_31).unwrap();
        let found = |method: Method, path: &str| match contract.find(&method, path) {
            Matched::Operation(op) => format!("{} {}", op.method, op.path),
            Matched::MethodNotAllowed(allow) => format!("405 {allow:?}"),
            Matched::NotFound => "404".to_owned(),
        };
        assert_eq!(found(Method::GET, "/documents/latest"), "GET /documents/latest");
        assert_eq!(found(Method::GET, "/documents/42"), "GET /documents/{id}");
        assert_eq!(found(Method::DELETE, "/documents/42"), "DELETE /documents/{id}");
        assert_eq!(found(Method::DELETE, "/documents/latest"), "405 [GET]");
        assert_eq!(found(Method::PUT, "/documents/42"), "405 [GET, DELETE]");
        assert_eq!(found(Method::GET, "/files/report.pdf"), "GET /files/{name}.pdf");
        for path in ["/files/.pdf", "/files/report.txt", "/documents/42/more", "/documents/", "/", "/nothing"] {
            assert_eq!(found(Method::GET, path), "404", "{path}");
        }
        // Matched as the upstream will read it: decoded, and never a path that moves.
        assert_eq!(found(Method::GET, "/documents/lat%65st"), "GET /documents/latest");
        assert_eq!(found(Method::GET, "/documents/a%20b"), "GET /documents/{id}");
        for path in [
            "/documents/..",
            "/documents/.",
            "/documents/%2e%2e",
            "/documents/a%2Fb",
            "//documents/latest",
            "/documents/%ff",
        ] {
            assert_eq!(found(Method::DELETE, path), "404", "{path}");
        }
    }

    #[test]
    fn templates_rank_by_shape_not_by_name_or_order() {
        let contract = read(
            "openapi: 3.1.0\ninfo: {title: t, version: '1'}\npaths:\n  /a/{id}:\n    get: {}\n  /a/{key}:\n    \
             delete: {}\n  /files/{id}:\n    get: {}\n  /files/{name}.pdf:\n    get: {}\n",
        )
        .unwrap();
        let path = |method: Method, path: &str| match contract.find(&method, path) {
            Matched::Operation(op) => op.path.clone(),
            other => format!("{other:?}"),
        };
        assert_eq!(path(Method::DELETE, "/a/1"), "/a/{key}");
        assert_eq!(path(Method::GET, "/a/1"), "/a/{id}");
        assert_eq!(path(Method::GET, "/files/x.pdf"), "/files/{name}.pdf");
        assert_eq!(path(Method::GET, "/files/x.txt"), "/files/{id}");
    }

    #[test]
    fn a_get_or_post_names_its_cache_policy_and_nothing_else_does() {
        let op = |method: &str, ai: &str| {
            format!(
                "openapi: 3.1.0\ninfo: {{title: t, version: '1'}}\npaths:\n  /ocr:\n    {method}:\n      x-flexway-ai: {ai}\n"
            )
        };
        let metered = "metering: per_call, price_per_thousand_eur: '1', feature: ocr";
        for method in ["get", "post"] {
            let contract = read(&op(method, &format!("{{{metered}, cache: ocr-exact}}"))).unwrap();
            let ai = contract.operations[0].ai.as_ref().unwrap();
            assert_eq!(ai.cache.as_deref(), Some("ocr-exact"), "{method}");
        }
        assert_eq!(
            read(&op("post", &format!("{{{metered}}}"))).unwrap().operations[0].ai.as_ref().unwrap().cache,
            None
        );
        // The policy alone: cached, counted as a call of no price, under its name.
        let bare = read(&op("get", "{cache: faq}")).unwrap();
        let ai = bare.operations[0].ai.as_ref().unwrap();
        assert_eq!(
            (ai.cache.as_deref(), ai.metering, ai.price_per_thousand),
            (Some("faq"), GrpcMetering::PerCall, MicroEur(0))
        );
        assert_eq!(ai.feature, "faq");
        for method in ["put", "patch", "delete"] {
            let refused = read(&op(method, &format!("{{{metered}, cache: ocr-exact}}"))).unwrap_err().join("; ");
            assert!(refused.contains("GET and POST operations only"), "{refused}");
        }
        for bad in ["''", "3", "[a]"] {
            let refused = read(&op("post", &format!("{{{metered}, cache: {bad}}}"))).unwrap_err().join("; ");
            assert!(refused.contains("cache is not a policy name"), "{refused}");
        }
    }

    #[test]
    fn a_31_operation_is_described_as_a_tool_input_with_its_components_in_defs() {
        let contract = read(
            r##"
openapi: 3.1.0
info: {title: OCR, version: "1"}
components:
  schemas:
    Page: {type: object, properties: {text: {type: string}, next: {$ref: "#/components/schemas/Page"}}}
    Document: {type: object, required: [pages], properties: {pages: {type: array, items: {$ref: "#/components/schemas/Page"}}}}
    Unused: {type: string}
paths:
  /documents/{id}/ocr:
    parameters:
      - {name: id, in: path, required: true, schema: {type: string}, description: the document}
      - {name: lang, in: query, schema: {type: string}}
      - {name: X-Trace, in: header, schema: {type: string}}
    post:
      operationId: ocr_document
      summary: Reads a document
      description: Every page, as text.
      x-flexway-ai: {metering: per_call, price_per_thousand_eur: "1", feature: ocr}
      parameters:
        - {name: lang, in: query, required: true, schema: {type: string, enum: [en, fr]}}
        - {name: dpi, in: query, schema: {type: integer}}
      requestBody:
        required: true
        content:
          application/json: {schema: {$ref: "#/components/schemas/Document"}}
      responses: {"200": {description: ok}}
"##,
        )
        .unwrap();
        let op = contract.declared(&Method::POST, "/documents/{id}/ocr").unwrap();
        assert_eq!(op.operation_id.as_deref(), Some("ocr_document"));
        assert_eq!(
            (op.summary.as_deref(), op.description.as_deref()),
            (Some("Reads a document"), Some("Every page, as text."))
        );
        let names: Vec<_> = op.parameters.iter().map(|p| (p.name.as_str(), p.location, p.required)).collect();
        assert_eq!(
            names,
            [("id", ParameterIn::Path, true), ("lang", ParameterIn::Query, true), ("dpi", ParameterIn::Query, false)]
        );
        assert_eq!(op.body, Some(RequestBody { required: true, json: true }));
        assert_eq!(
            op.input_schema,
            json!({
                "type": "object",
                "properties": {
                    "id": {"type": "string", "description": "the document"},
                    "lang": {"type": "string", "enum": ["en", "fr"]},
                    "dpi": {"type": "integer"},
                    "body": {"$ref": "#/$defs/Document"},
                },
                "required": ["id", "lang", "body"],
                "$defs": {
                    "Document": {"type": "object", "required": ["pages"],
                        "properties": {"pages": {"type": "array", "items": {"$ref": "#/$defs/Page"}}}},
                    "Page": {"type": "object",
                        "properties": {"text": {"type": "string"}, "next": {"$ref": "#/$defs/Page"}}},
                },
            })
        );
    }

    #[test]
    fn a_30_operation_is_described_with_its_referenced_parameters_and_body() {
        let json = r##"{"openapi": "3.0.3", "info": {"title": "t", "version": "1"},
            "components": {
                "parameters": {"Target": {"name": "target", "in": "query", "required": true, "schema": {"type": "string"}}},
                "requestBodies": {"Text": {"content": {"application/json; charset=utf-8":
                    {"schema": {"type": "object", "properties": {"text": {"$ref": "#/components/schemas/Text"}}}}}}},
                "schemas": {"Text": {"type": "string", "nullable": true}}},
            "paths": {
              "/translate": {"post": {"operationId": "translate",
                "x-flexway-ai": {"metering": "per_call", "price_per_thousand_eur": "1", "feature": "mt"},
                "parameters": [{"$ref": "#/components/parameters/Target"}],
                "requestBody": {"$ref": "#/components/requestBodies/Text"},
                "responses": {"200": {"description": "ok"}}}},
              "/upload": {"put": {"requestBody": {"required": true, "content": {"application/pdf": {}}},
                "responses": {"200": {"description": "ok"}}}}}}"##;
        let contract = read(json).unwrap();
        let op = contract.declared(&Method::POST, "/translate").unwrap();
        assert_eq!((op.operation_id.as_deref(), op.summary.as_deref()), (Some("translate"), None));
        assert_eq!(op.parameters, [Parameter { name: "target".into(), location: ParameterIn::Query, required: true }]);
        assert_eq!(op.body, Some(RequestBody { required: false, json: true }));
        assert_eq!(
            op.input_schema,
            json!({
                "type": "object",
                "properties": {
                    "target": {"type": "string"},
                    "body": {"type": "object", "properties": {"text": {"$ref": "#/$defs/Text"}}},
                },
                "required": ["target"],
                "$defs": {"Text": {"type": "string", "nullable": true}},
            })
        );
        // A body that is not JSON is said so, and is no property of the input.
        let upload = contract.declared(&Method::PUT, "/upload").unwrap();
        assert_eq!(
            (upload.operation_id.as_deref(), upload.body),
            (None, Some(RequestBody { required: true, json: false }))
        );
        assert_eq!(upload.input_schema, json!({"type": "object", "properties": {}}));
    }

    #[test]
    fn what_cannot_be_used_is_refused_with_the_operation() {
        let errors = |text: &str| read(text).unwrap_err().join("; ");
        assert!(errors("swagger: '2.0'\npaths: {}").contains("no `openapi` version"));
        assert!(errors("openapi: 2.0.0\npaths: {}").contains("only 3.0.x and 3.1.x"));
        assert!(errors("openapi: 3.1.0\ninfo: {title: t, version: '1'}\npaths: {}").contains("declares no operation"));
        let op = |ai: &str| {
            format!(
                "openapi: 3.1.0\ninfo: {{title: t, version: '1'}}\npaths:\n  /ocr:\n    post:\n      x-flexway-ai: {ai}\n"
            )
        };
        let missing = errors(&op("{price_per_thousand_eur: '1', feature: ocr}"));
        assert!(missing.contains("POST /ocr: x-flexway-ai has no metering"), "{missing}");
        let no_feature = errors(&op("{metering: per_call, price_per_thousand_eur: '1'}"));
        assert!(no_feature.contains("has no feature"), "{no_feature}");
        let precise = errors(&op("{metering: per_call, price_per_thousand_eur: '0.0000001', feature: f}"));
        assert!(precise.contains("more than 6 decimal places"), "{precise}");
        let float = errors(&op("{metering: per_call, price_per_thousand_eur: 0.25, feature: f}"));
        assert!(float.contains("write it as a decimal string"), "{float}");
        assert!(errors("{not yaml").contains("neither JSON nor YAML"));
    }
}
