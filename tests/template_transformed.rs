//! The stack as AWS receives it: `infra/template.yaml` transformed by the SAM
//! translator (`infra/transform`, offline), read as the JSON CloudFormation gets, and
//! held to what the code does: the functions' runtime and log, the function URL and
//! the API streaming to the function, the API's deployment following the API, the
//! ledger table the code creates, the dashboard's body, and every alarm wired to a
//! metric something emits, its metric filters fed the log lines the code prints.
//! Needs the SAM translator (`PYTHON`, else `.venv/bin/python`): fails, never skips,
//! without it.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use flexway::budget::{
    BudgetStore, CounterKey, IntentOutcome, LeasePolicy, LeasedBudgetStore, Line, MemoryBudgetStore, Reservation,
    ReserveOutcome, ReserveRequest, SettleOutcome, StoreError, Swept,
};
use flexway_testkit::logs::{matches, printed};
use flexway_testkit::template::transformed;
use serde_json::{Value, json};

fn resources<'a>(template: &'a Value, kind: &str) -> Vec<(&'a str, &'a Value)> {
    let all = template["Resources"].as_object().unwrap();
    all.iter().filter(|(_, r)| r["Type"] == kind).map(|(name, r)| (name.as_str(), r)).collect()
}

fn only<'a>(template: &'a Value, kind: &str) -> (&'a str, &'a Value) {
    let found = resources(template, kind);
    let [one] = found.as_slice() else {
        panic!("one {kind}, found {:?}", found.iter().map(|f| f.0).collect::<Vec<_>>())
    };
    *one
}

fn sub(text: &str) -> Value {
    json!({"Fn::Sub": text})
}

// ----- conditions and references, evaluated for a set of parameters ------------------

/// The template's conditions for these parameter values (the others their defaults),
/// as far as the template writes them: `Fn::Equals` of a parameter and a text, `Fn::Not`.
fn condition(template: &Value, name: &str, parameters: &BTreeMap<&str, &str>) -> Option<bool> {
    fn value(template: &Value, term: &Value, parameters: &BTreeMap<&str, &str>) -> Option<String> {
        if let Some([separator, list]) = term["Fn::Join"].as_array().map(Vec::as_slice) {
            let joined = value(template, list, parameters)?;
            return Some(joined.split(',').collect::<Vec<_>>().join(separator.as_str()?));
        }
        match term {
            Value::String(text) => Some(text.clone()),
            Value::Number(number) => Some(number.to_string()),
            _ => {
                let name = term["Ref"].as_str()?;
                let default = &template["Parameters"][name]["Default"];
                let default = default.as_str().map(str::to_owned).unwrap_or_else(|| default.to_string());
                Some(parameters.get(name).map_or(default, |v| (*v).to_owned()))
            }
        }
    }
    fn eval(template: &Value, expression: &Value, parameters: &BTreeMap<&str, &str>) -> Option<bool> {
        if let Some([a, b]) = expression["Fn::Equals"].as_array().map(Vec::as_slice) {
            return Some(value(template, a, parameters)? == value(template, b, parameters)?);
        }
        if let Some([inner]) = expression["Fn::Not"].as_array().map(Vec::as_slice) {
            return eval(template, inner, parameters).map(|b| !b);
        }
        if let Some(name) = expression["Condition"].as_str() {
            return condition(template, name, parameters);
        }
        None
    }
    eval(template, &template["Conditions"][name], parameters)
}

/// Whether the resource (or output) exists with these parameters; `None`: its
/// condition is one this evaluator does not read.
fn exists(template: &Value, entry: &Value, parameters: &BTreeMap<&str, &str>) -> Option<bool> {
    match entry["Condition"].as_str() {
        None => Some(true),
        Some(name) => condition(template, name, parameters),
    }
}

/// The resources `value` refers to (`Ref`, `Fn::GetAtt`, `${...}` in `Fn::Sub`,
/// `DependsOn`), each `Fn::If` taken as the parameters decide.
fn references(template: &Value, value: &Value, parameters: &BTreeMap<&str, &str>, into: &mut BTreeSet<String>) {
    fn named(template: &Value, name: &str, into: &mut BTreeSet<String>) {
        let name = name.split('.').next().unwrap();
        if template["Resources"].get(name).is_some() {
            into.insert(name.to_owned());
        }
    }
    match value {
        Value::Array(items) => items.iter().for_each(|item| references(template, item, parameters, into)),
        Value::Object(map) => {
            if let Some([test, yes, no]) = map.get("Fn::If").and_then(Value::as_array).map(Vec::as_slice) {
                let name = test.as_str().unwrap();
                let taken = condition(template, name, parameters)
                    .unwrap_or_else(|| panic!("condition {name}: not one this test can evaluate"));
                return references(template, if taken { yes } else { no }, parameters, into);
            }
            if let Some(name) = map.get("Ref").and_then(Value::as_str) {
                named(template, name, into);
            }
            if let Some(name) = map.get("Fn::GetAtt").and_then(|a| a[0].as_str()) {
                named(template, name, into);
            }
            if let Some(spec) = map.get("Fn::Sub") {
                let (text, locals) = match spec {
                    Value::String(text) => (text.as_str(), None),
                    _ => (spec[0].as_str().unwrap(), spec[1].as_object()),
                };
                for placeholder in text.split("${").skip(1).filter_map(|p| p.split_once('}')).map(|p| p.0) {
                    if !locals.is_some_and(|l| l.contains_key(placeholder)) && !placeholder.starts_with('!') {
                        named(template, placeholder, into);
                    }
                }
                if let Some(locals) = locals {
                    locals.values().for_each(|v| references(template, v, parameters, into));
                }
            }
            for (key, inner) in map {
                if key == "DependsOn" {
                    match inner {
                        Value::String(name) => named(template, name, into),
                        _ => inner.as_array().unwrap().iter().for_each(|n| named(template, n.as_str().unwrap(), into)),
                    }
                } else if !matches!(key.as_str(), "Fn::If" | "Fn::Sub") {
                    references(template, inner, parameters, into);
                }
            }
        }
        _ => {}
    }
}

/// Whether `from` is created after `to`: reaches it through references.
fn depends_on(template: &Value, from: &str, to: &str, parameters: &BTreeMap<&str, &str>) -> bool {
    let mut seen = BTreeSet::new();
    let mut next = vec![from.to_owned()];
    while let Some(name) = next.pop() {
        if !seen.insert(name.clone()) {
            continue;
        }
        let mut found = BTreeSet::new();
        references(template, &template["Resources"][&name], parameters, &mut found);
        if found.contains(to) {
            return true;
        }
        next.extend(found);
    }
    false
}

/// The parameter sets a first deploy chooses between.
const PARAMETER_SETS: [&[(&str, &str)]; 5] = [
    &[],
    &[("PublicFunctionUrl", "false")],
    &[("ApiGatewayAccountLogRole", "existing")],
    &[("PublicFunctionUrl", "false"), ("ApiGatewayAccountLogRole", "existing")],
    &[("CacheStore", "dynamodb")],
];

/// A resource a condition leaves out is referenced by no resource or output that
/// stays (CloudFormation would refuse the template), for each choice a first deploy
/// makes: the function URL off, the account's API Gateway role kept as it is, the
/// response cache in the stack's table.
#[test]
fn no_resource_left_out_by_a_parameter_is_referenced_by_one_that_stays() {
    for set in PARAMETER_SETS {
        let parameters: BTreeMap<&str, &str> = set.iter().copied().collect();
        let args: Vec<String> = set.iter().map(|(k, v)| format!("{k}={v}")).collect();
        let template = transformed(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let all = template["Resources"].as_object().unwrap();
        let present = |name: &str| exists(&template, &all[name], &parameters);
        let entries = all.iter().chain(template["Outputs"].as_object().unwrap());
        for (name, entry) in entries {
            match exists(&template, entry, &parameters) {
                Some(false) => continue,
                Some(true) => {}
                None => panic!("{name}: a condition this test cannot evaluate"),
            }
            let mut found = BTreeSet::new();
            references(&template, entry, &parameters, &mut found);
            for target in found {
                assert_eq!(present(&target), Some(true), "{name} refers to {target}, left out with {parameters:?}");
            }
        }
    }
}

// ----- the functions ------------------------------------------------------------------

/// Every function is arm64 on `provided.al2023` (the binaries `cargo lambda build
/// --arm64` makes) and logs as text: a JSON log format wraps each printed line in an
/// object of its own, so the audit records, the EMF lines and the JSON log lines the
/// filters read would not reach their group as printed. The gateway's own log is the
/// audit group.
#[test]
fn every_function_is_arm64_on_provided_al2023_and_logs_text() {
    let template = transformed(&[]);
    let functions = resources(&template, "AWS::Lambda::Function");
    assert_eq!(functions.len(), 3, "the gateway, the sweeper and the reconcile function");
    for (name, function) in functions {
        let properties = &function["Properties"];
        assert_eq!(properties["Architectures"], json!(["arm64"]), "{name}");
        assert_eq!(properties["Runtime"], "provided.al2023", "{name}");
        assert_eq!(properties["Handler"], "bootstrap", "{name}");
        assert_eq!(properties["LoggingConfig"]["LogFormat"], "Text", "{name}");
        assert!(
            properties["LoggingConfig"]["LogGroup"]["Ref"].is_string(),
            "{name}: its own group, named by the stack"
        );
    }
    let gateway = &template["Resources"]["GatewayFunction"]["Properties"];
    assert_eq!(gateway["LoggingConfig"]["LogGroup"], json!({"Ref": "AuditLogGroup"}));
}

/// The function URL streams, and a public one needs both statements (Lambda checks
/// lambda:InvokeFunctionUrl for the URL's auth type, and lambda:InvokeFunction for a
/// call through the URL); with `PublicFunctionUrl=false` none of the three exists,
/// nor the `GatewayUrl` output.
#[test]
fn the_function_url_streams_with_both_permissions_and_only_when_asked() {
    let template = transformed(&[]);
    let resources = &template["Resources"];
    let url = &resources["GatewayUrl"]["Properties"];
    assert_eq!(url["InvokeMode"], "RESPONSE_STREAM");
    assert_eq!(url["AuthType"], "NONE", "callers authenticate with their Flexway key");
    assert_eq!(url["TargetFunctionArn"], json!({"Fn::GetAtt": ["GatewayFunction", "Arn"]}));
    let public = &resources["GatewayUrlPublicAccess"]["Properties"];
    assert_eq!(
        (&public["Action"], &public["FunctionUrlAuthType"], &public["Principal"]),
        (&json!("lambda:InvokeFunctionUrl"), &json!("NONE"), &json!("*"))
    );
    let invoke = &resources["GatewayUrlInvokeAccess"]["Properties"];
    assert_eq!(
        (&invoke["Action"], &invoke["InvokedViaFunctionUrl"], &invoke["Principal"]),
        (&json!("lambda:InvokeFunction"), &json!(true), &json!("*"))
    );
    for (name, permission) in [("GatewayUrlPublicAccess", public), ("GatewayUrlInvokeAccess", invoke)] {
        assert_eq!(permission["FunctionName"], json!({"Ref": "GatewayFunction"}), "{name}");
    }

    let off = BTreeMap::from([("PublicFunctionUrl", "false")]);
    let on = BTreeMap::new();
    for name in ["GatewayUrl", "GatewayUrlPublicAccess", "GatewayUrlInvokeAccess"] {
        assert_eq!(exists(&template, &resources[name], &on), Some(true), "{name} by default");
        assert_eq!(exists(&template, &resources[name], &off), Some(false), "{name} with PublicFunctionUrl=false");
    }
    let output = &template["Outputs"]["GatewayUrl"];
    assert_eq!((exists(&template, output, &on), exists(&template, output, &off)), (Some(true), Some(false)));
    assert_eq!(exists(&template, &template["Outputs"]["GatewayApiUrl"], &off), Some(true), "API Gateway stays");
}

// ----- the API --------------------------------------------------------------------------

/// Every route of the API (the root and `{proxy+}`, any method) goes to the gateway
/// through the streaming Lambda proxy integration: InvokeWithResponseStream (the
/// 2021-11-15 `response-streaming-invocations` URI), response transfer mode STREAM,
/// 15 minutes; API Gateway may invoke the function for this API only. Every media
/// type is binary (`*~1*` is CloudFormation's `*/*`; the OpenAPI body spells it `*/*`),
/// so an upload's bytes reach the function intact.
#[test]
fn the_api_streams_every_route_to_the_function_and_takes_every_body_as_bytes() {
    let template = transformed(&[]);
    let (api_name, api) = only(&template, "AWS::ApiGateway::RestApi");
    assert_eq!(api_name, "GatewayApi");
    let properties = &api["Properties"];
    assert_eq!(properties["EndpointConfiguration"]["Types"], json!(["REGIONAL"]));
    assert_eq!(properties["BinaryMediaTypes"], json!(["*~1*"]));
    let body = &properties["Body"];
    assert_eq!(body["x-amazon-apigateway-binary-media-types"], json!(["*/*"]));
    let paths = body["paths"].as_object().unwrap();
    assert_eq!(paths.keys().collect::<Vec<_>>(), ["/", "/{proxy+}"]);
    for (path, operations) in paths {
        let operations = operations.as_object().unwrap();
        assert_eq!(operations.keys().collect::<Vec<_>>(), ["x-amazon-apigateway-any-method"], "{path}: every method");
        let integration = &operations["x-amazon-apigateway-any-method"]["x-amazon-apigateway-integration"];
        assert_eq!((&integration["type"], &integration["httpMethod"]), (&json!("aws_proxy"), &json!("POST")), "{path}");
        assert_eq!(
            integration["responseTransferMode"], "STREAM",
            "{path}: a buffered answer waits for the whole completion"
        );
        assert_eq!(integration["timeoutInMillis"], 900_000, "{path}: a stream may last the function's 15 minutes");
        assert_eq!(
            integration["uri"],
            sub(
                "arn:aws:apigateway:${AWS::Region}:lambda:path/2021-11-15/functions/${GatewayFunction.Arn}/response-streaming-invocations"
            ),
            "{path}: InvokeWithResponseStream, not Invoke"
        );
    }
    assert!(body.get("securityDefinitions").is_none() && body["components"].get("securitySchemes").is_none());

    let from_api: Vec<&Value> = resources(&template, "AWS::Lambda::Permission")
        .into_iter()
        .map(|(_, p)| &p["Properties"])
        .filter(|p| p["Principal"] == "apigateway.amazonaws.com")
        .collect();
    assert_eq!(from_api.len(), paths.len(), "one permission a route: {from_api:#?}");
    for permission in from_api {
        assert_eq!(permission["Action"], "lambda:InvokeFunction");
        assert_eq!(permission["FunctionName"], json!({"Ref": "GatewayFunction"}));
        let source = &permission["SourceArn"]["Fn::Sub"];
        assert!(
            source[0]
                .as_str()
                .unwrap()
                .starts_with("arn:aws:execute-api:${AWS::Region}:${AWS::AccountId}:${__ApiId__}/")
        );
        assert_eq!(source[1]["__ApiId__"], json!({"Ref": "GatewayApi"}), "this API only");
    }
    let variables = &template["Resources"]["GatewayFunction"]["Properties"]["Environment"]["Variables"];
    assert_eq!(variables["AWS_LAMBDA_HTTP_IGNORE_STAGE_IN_PATH"], "true", "routes are /v1/..., not /live/v1/...");
}

/// The stage `live` points at the one deployment, whose logical id is a hash of the
/// API: a changed API is a new deployment, which the stage then serves (a fixed
/// deployment would never reach the stage again). No second stage named `Stage`.
#[test]
fn a_changed_api_is_a_new_deployment_that_the_stage_serves() {
    fn deployment_and_stage(template: &Value) -> (String, Value) {
        let (deployment, properties) = only(template, "AWS::ApiGateway::Deployment");
        assert!(properties["Properties"].get("StageName").is_none(), "a stray stage `Stage`: {properties}");
        let (_, stage) = only(template, "AWS::ApiGateway::Stage");
        (deployment.to_owned(), stage["Properties"].clone())
    }
    let (deployment, stage) = deployment_and_stage(&transformed(&[]));
    assert_eq!(stage["StageName"], "live");
    assert_eq!(stage["DeploymentId"], json!({"Ref": deployment}));
    assert_eq!(deployment_and_stage(&transformed(&[])).0, deployment, "the same API, the same deployment");

    let yaml = std::fs::read_to_string(flexway_testkit::template::path()).unwrap();
    let route = "TimeoutInMillis: 900000";
    assert!(yaml.contains(route), "the template no longer writes {route:?}: change the edit this test makes");
    let changed = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(changed.path(), yaml.replacen(route, "TimeoutInMillis: 600000", 1)).unwrap();
    let (redeployed, stage) = deployment_and_stage(&transformed(&["--template", changed.path().to_str().unwrap()]));
    assert_ne!(redeployed, deployment, "a changed API needs a new deployment");
    assert_eq!(stage["DeploymentId"], json!({"Ref": redeployed}), "and the stage serves it");
}

/// The stage throttles every method and path at the stack's parameters, and writes an
/// access log to its own group: a JSON line a request (id, caller's address, method,
/// path, status, latency), never a header: the Authorization header is the caller's
/// key. The group is created after the account's API Gateway role when the stack sets
/// it (API Gateway refuses a stage's access log before), which is kept when the
/// stack is deleted.
#[test]
fn the_stage_throttles_and_logs_each_request_without_its_headers() {
    let template = transformed(&[]);
    let (stage_name, stage) = only(&template, "AWS::ApiGateway::Stage");
    let stage = &stage["Properties"];
    assert_eq!(
        stage["MethodSettings"],
        json!([{"HttpMethod": "*", "ResourcePath": "/*",
                "ThrottlingRateLimit": {"Ref": "ApiThrottlingRateLimit"},
                "ThrottlingBurstLimit": {"Ref": "ApiThrottlingBurstLimit"}}])
    );
    for limit in ["ApiThrottlingRateLimit", "ApiThrottlingBurstLimit"] {
        assert!(template["Parameters"][limit]["Default"].as_u64().unwrap() > 0, "{limit}");
    }
    let access = &stage["AccessLogSetting"];
    assert_eq!(access["DestinationArn"], json!({"Fn::GetAtt": ["ApiAccessLogGroup", "Arn"]}));
    let group = &template["Resources"]["ApiAccessLogGroup"]["Properties"];
    assert_eq!(group["RetentionInDays"], json!({"Ref": "LogRetentionDays"}));
    let format = access["Format"].as_str().unwrap();
    // Each $context variable as API Gateway fills it: a bare word, or a quoted string
    // for the `...String` variants.
    let mut line = format.to_owned();
    for variable in format.split("$context.").skip(1) {
        let name: String = variable.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '.').collect();
        let filled = if name.ends_with("String") { "\"x\"" } else { "x" };
        line = line.replacen(&format!("$context.{name}"), filled, 1);
    }
    let record: serde_json::Map<String, Value> =
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not one JSON object a request ({e}): {format}"));
    for key in ["requestId", "ip", "method", "path", "status", "latencyMs"] {
        assert!(record.contains_key(key), "{key} missing from {format}");
    }
    assert!(format.contains("$context.requestId") && format.contains("$context.identity.sourceIp"), "{format}");
    let lowered = format.to_ascii_lowercase();
    assert!(!lowered.contains("header") && !lowered.contains("authorization"), "a header in the log: {format}");

    let create = BTreeMap::new();
    let existing = BTreeMap::from([("ApiGatewayAccountLogRole", "existing")]);
    assert!(depends_on(&template, stage_name, "ApiGatewayAccount", &create), "the stage before the account's role");
    let resources = &template["Resources"];
    let role = &resources["ApiGatewayCloudWatchRole"];
    let account = &resources["ApiGatewayAccount"];
    for (name, resource) in [("ApiGatewayCloudWatchRole", role), ("ApiGatewayAccount", account)] {
        assert_eq!(exists(&template, resource, &create), Some(true), "{name} by default");
        assert_eq!(exists(&template, resource, &existing), Some(false), "{name}: the account's own is kept");
    }
    assert!(!depends_on(&template, stage_name, "ApiGatewayAccount", &existing));
    assert_eq!(template["Parameters"]["ApiGatewayAccountLogRole"]["Default"], "create");
    assert_eq!(account["Properties"]["CloudWatchRoleArn"], json!({"Fn::GetAtt": ["ApiGatewayCloudWatchRole", "Arn"]}));
    assert_eq!(role["DeletionPolicy"], "Retain", "the account setting outlives the stack, and points at the role");
    let trust = &role["Properties"]["AssumeRolePolicyDocument"]["Statement"];
    assert_eq!(
        trust,
        &json!([{"Effect": "Allow", "Principal": {"Service": "apigateway.amazonaws.com"}, "Action": "sts:AssumeRole"}])
    );
    assert_eq!(
        role["Properties"]["ManagedPolicyArns"],
        json!([sub("arn:${AWS::Partition}:iam::aws:policy/service-role/AmazonAPIGatewayPushToCloudWatchLogs")])
    );
    assert!(role["Properties"].get("Policies").is_none(), "the managed policy only");
}

// ----- the ledger table -------------------------------------------------------------------

/// The stack's table is the table the code creates (`DynamoDbBudgetStore::create_table`,
/// which the tests run against): the same keys, attributes, `expiry` index and TTL
/// attribute, read back from the emulator, not retyped here.
#[tokio::test]
async fn the_ledger_table_is_the_table_the_code_creates() {
    let template = transformed(&[]);
    let table = &template["Resources"]["LedgerTable"]["Properties"];
    let sdk = flexway_testkit::emulator::sdk().await;
    let client = aws_sdk_dynamodb::Client::new(&sdk);
    let name = flexway_testkit::emulator::unique("flexway-ledger-template");
    flexway_aws::DynamoDbBudgetStore::create_table(&client, &name).await.unwrap();
    let described = client.describe_table().table_name(&name).send().await.unwrap();
    let created = described.table().unwrap();
    let ttl = client.describe_time_to_live().table_name(&name).send().await.unwrap();
    client.delete_table().table_name(&name).send().await.unwrap();

    let keys = |schema: &[aws_sdk_dynamodb::types::KeySchemaElement]| -> Value {
        schema.iter().map(|k| json!({"AttributeName": k.attribute_name(), "KeyType": k.key_type().as_str()})).collect()
    };
    let attributes: BTreeSet<(String, String)> = created
        .attribute_definitions()
        .iter()
        .map(|a| (a.attribute_name().to_owned(), a.attribute_type().as_str().to_owned()))
        .collect();
    let declared: BTreeSet<(String, String)> = table["AttributeDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["AttributeName"].as_str().unwrap().to_owned(), a["AttributeType"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(declared, attributes);
    assert_eq!(table["KeySchema"], keys(created.key_schema()));
    let [index] = created.global_secondary_indexes() else { panic!("one index: {created:?}") };
    let [declared_index] = table["GlobalSecondaryIndexes"].as_array().unwrap().as_slice() else { panic!() };
    assert_eq!(index.index_name(), Some(flexway_aws::EXPIRY_INDEX));
    assert_eq!(declared_index["IndexName"], flexway_aws::EXPIRY_INDEX);
    assert_eq!(declared_index["KeySchema"], keys(index.key_schema()));
    assert_eq!(declared_index["KeySchema"][0]["AttributeName"], flexway_aws::EXPIRY_SHARD);
    let projection = index.projection().and_then(|p| p.projection_type()).map(|t| t.as_str().to_owned());
    assert_eq!(declared_index["Projection"]["ProjectionType"].as_str().map(str::to_owned), projection);
    let ttl_attribute = ttl.time_to_live_description().and_then(|t| t.attribute_name()).unwrap();
    assert_eq!(table["TimeToLiveSpecification"], json!({"AttributeName": ttl_attribute, "Enabled": true}));
}

// ----- the cache table -------------------------------------------------------------------

/// With `CacheStore=dynamodb`, the stack's cache table is the table the code creates
/// (`DynamoDbCacheStore::create_table`, which its tests run against): the same keys,
/// attributes, `tenant` index and projection, and TTL attribute, read back from the
/// emulator. Without it, no table, no output, and the gateway's role grants nothing
/// on one.
#[tokio::test]
async fn the_cache_table_is_the_table_the_code_creates_and_only_with_cache_store_dynamodb() {
    let cached = BTreeMap::from([("CacheStore", "dynamodb")]);
    let template = transformed(&["CacheStore=dynamodb"]);
    let resource = &template["Resources"]["CacheTable"];
    assert_eq!(exists(&template, resource, &cached), Some(true));
    assert_eq!(exists(&template, resource, &BTreeMap::new()), Some(false), "no cache table by default");
    let output = &template["Outputs"]["CacheTableName"];
    assert_eq!(
        (exists(&template, output, &cached), exists(&template, output, &BTreeMap::new())),
        (Some(true), Some(false))
    );
    let mut granted = BTreeSet::new();
    references(&template, &template["Resources"]["GatewayRole"], &BTreeMap::new(), &mut granted);
    assert!(!granted.contains("CacheTable"), "the gateway's role names no cache table by default: {granted:?}");
    granted.clear();
    references(&template, &template["Resources"]["GatewayRole"], &cached, &mut granted);
    assert!(granted.contains("CacheTable"), "{granted:?}");

    let table = &resource["Properties"];
    assert_eq!(table["TableName"], sub("${AWS::StackName}-cache"));
    assert_eq!(table["BillingMode"], "PAY_PER_REQUEST");
    let sdk = flexway_testkit::emulator::sdk().await;
    let client = aws_sdk_dynamodb::Client::new(&sdk);
    let name = flexway_testkit::emulator::unique("flexway-cache-template");
    flexway_aws::cache::DynamoDbCacheStore::create_table(&client, &name).await.unwrap();
    let described = client.describe_table().table_name(&name).send().await.unwrap();
    let created = described.table().unwrap();
    let ttl = client.describe_time_to_live().table_name(&name).send().await.unwrap();
    client.delete_table().table_name(&name).send().await.unwrap();

    let keys = |schema: &[aws_sdk_dynamodb::types::KeySchemaElement]| -> Value {
        schema.iter().map(|k| json!({"AttributeName": k.attribute_name(), "KeyType": k.key_type().as_str()})).collect()
    };
    let attributes: BTreeSet<(String, String)> = created
        .attribute_definitions()
        .iter()
        .map(|a| (a.attribute_name().to_owned(), a.attribute_type().as_str().to_owned()))
        .collect();
    let declared: BTreeSet<(String, String)> = table["AttributeDefinitions"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| (a["AttributeName"].as_str().unwrap().to_owned(), a["AttributeType"].as_str().unwrap().to_owned()))
        .collect();
    assert_eq!(declared, attributes);
    assert_eq!(table["KeySchema"], keys(created.key_schema()));
    let [index] = created.global_secondary_indexes() else { panic!("one index: {created:?}") };
    let [declared_index] = table["GlobalSecondaryIndexes"].as_array().unwrap().as_slice() else { panic!() };
    assert_eq!(index.index_name(), Some(flexway_aws::cache::TENANT_INDEX));
    assert_eq!(declared_index["IndexName"], flexway_aws::cache::TENANT_INDEX);
    assert_eq!(declared_index["KeySchema"], keys(index.key_schema()));
    let projection = index.projection().unwrap();
    assert_eq!(declared_index["Projection"]["ProjectionType"], projection.projection_type().unwrap().as_str());
    let included: BTreeSet<&str> = projection.non_key_attributes().iter().map(String::as_str).collect();
    let declared_included: BTreeSet<&str> = declared_index["Projection"]["NonKeyAttributes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(declared_included, included);
    let ttl_attribute = ttl.time_to_live_description().and_then(|t| t.attribute_name()).unwrap();
    assert_eq!(ttl_attribute, flexway_aws::cache::TTL_ATTRIBUTE);
    assert_eq!(table["TimeToLiveSpecification"], json!({"AttributeName": ttl_attribute, "Enabled": true}));
}

// ----- the console -------------------------------------------------------------------------

/// The dashboard's body is JSON once CloudFormation substitutes it, with or without
/// the monthly budget line, and names nothing the stack does not have.
#[test]
fn the_dashboard_body_is_json_once_substituted() {
    let template = transformed(&[]);
    let spec = &template["Resources"]["Console"]["Properties"]["DashboardBody"]["Fn::Sub"];
    let (body, locals) = (spec[0].as_str().unwrap(), spec[1].as_object().unwrap());
    let [_, budget, none] = locals["SpendAnnotations"]["Fn::If"].as_array().unwrap().as_slice() else { panic!() };
    let budget = budget["Fn::Sub"].as_str().unwrap().replace("${TenantMonthlyBudgetEur}", "250");
    for annotations in [budget.as_str(), none.as_str().unwrap()] {
        let mut text = body.to_owned();
        for placeholder in body.split("${").skip(1).map(|p| p.split_once('}').unwrap().0) {
            let value = match placeholder {
                "AWS::StackName" => "flexway".to_owned(),
                "AWS::Region" => "eu-west-1".to_owned(),
                "SpendAnnotations" => annotations.to_owned(),
                name if template["Resources"].get(name).is_some() => format!("{name}-physical-id"),
                name => panic!("the dashboard names {name}, which is neither a resource nor a value"),
            };
            text = text.replace(&format!("${{{placeholder}}}"), &value);
        }
        let dashboard: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e} in:\n{text}"));
        assert!(dashboard["widgets"].as_array().is_some_and(|w| !w.is_empty()));
    }
}

// ----- alarms and the metrics they read -------------------------------------------------

/// Every alarm reads a metric something emits: Lambda's and DynamoDB's own metrics of
/// this stack's functions and table, or a metric of the stack's namespace that one of
/// its metric filters produces from a function's own log group, or that the code
/// prints as EMF (the reconcile function's drift, through `flexway_aws::drift_lines`,
/// in the namespace the function is given). An alarm on anything else never fires.
#[test]
fn every_alarm_reads_a_metric_something_emits() {
    let template = transformed(&[]);
    let namespace = sub("Flexway/${AWS::StackName}");
    let logged_to: BTreeSet<String> = resources(&template, "AWS::Lambda::Function")
        .into_iter()
        .map(|(_, f)| f["Properties"]["LoggingConfig"]["LogGroup"].to_string())
        .collect();
    let mut produced: BTreeMap<String, String> = BTreeMap::new();
    for (name, filter) in resources(&template, "AWS::Logs::MetricFilter") {
        let filter = &filter["Properties"];
        assert!(logged_to.contains(&filter["LogGroupName"].to_string()), "{name} reads a group no function logs to");
        for transformation in filter["MetricTransformations"].as_array().unwrap() {
            assert_eq!(transformation["MetricNamespace"], namespace, "{name}");
            produced.insert(transformation["MetricName"].as_str().unwrap().to_owned(), name.to_owned());
        }
    }
    // The reconcile function's EMF, as it prints it, in the namespace it is given.
    let reconcile = &template["Resources"]["ReconcileFunction"]["Properties"]["Environment"]["Variables"];
    assert_eq!(reconcile["FLEXWAY_METRICS_NAMESPACE"], namespace);
    let mut emitted: BTreeSet<(String, Vec<String>)> = BTreeSet::new();
    for line in drift_lines() {
        let line: Value = serde_json::from_str(&line).unwrap();
        for directive in line["_aws"]["CloudWatchMetrics"].as_array().unwrap() {
            assert_eq!(directive["Namespace"], "Flexway/flexway");
            for metric in directive["Metrics"].as_array().unwrap() {
                for dimensions in directive["Dimensions"].as_array().unwrap() {
                    let dimensions = dimensions.as_array().unwrap().iter().map(|d| d.as_str().unwrap().to_owned());
                    emitted.insert((metric["Name"].as_str().unwrap().to_owned(), dimensions.collect()));
                }
            }
        }
    }

    let functions: BTreeSet<&str> = resources(&template, "AWS::Lambda::Function").into_iter().map(|f| f.0).collect();
    let tables: BTreeSet<&str> = resources(&template, "AWS::DynamoDB::Table").into_iter().map(|t| t.0).collect();
    let alarms = resources(&template, "AWS::CloudWatch::Alarm");
    assert!(alarms.len() >= 12, "{}", alarms.len());
    for (name, alarm) in alarms {
        let alarm = &alarm["Properties"];
        let metric = alarm["MetricName"].as_str().unwrap_or_else(|| panic!("{name}: one metric"));
        let dimensions = alarm["Dimensions"].as_array().cloned().unwrap_or_default();
        let dimension = |key: &str| -> Option<String> {
            let [only] = dimensions.as_slice() else { return None };
            (only["Name"] == key).then(|| only["Value"]["Ref"].as_str().map(str::to_owned)).flatten()
        };
        match alarm["Namespace"].as_str() {
            Some("AWS/Lambda") => {
                assert!(["Errors", "Throttles"].contains(&metric), "{name}: {metric}");
                let function = dimension("FunctionName").unwrap_or_else(|| panic!("{name}: {dimensions:?}"));
                assert!(functions.contains(function.as_str()), "{name}: {function} is not a function of the stack");
            }
            Some("AWS/DynamoDB") => {
                assert!(["TransactionConflict", "WriteThrottleEvents"].contains(&metric), "{name}: {metric}");
                let table = dimension("TableName").unwrap_or_else(|| panic!("{name}: {dimensions:?}"));
                assert!(tables.contains(table.as_str()), "{name}: {table} is not a table of the stack");
            }
            Some(other) => panic!("{name}: namespace {other}"),
            None => {
                assert_eq!(alarm["Namespace"], namespace, "{name}");
                let names: Vec<String> = dimensions.iter().map(|d| d["Name"].as_str().unwrap().to_owned()).collect();
                let by_filter = produced.contains_key(metric) && names.is_empty();
                let by_emf = emitted.contains(&(metric.to_owned(), names.clone()));
                assert!(by_filter || by_emf, "{name}: nothing emits {metric} with dimensions {names:?}");
            }
        }
    }
    assert!(emitted.iter().any(|(m, d)| m == flexway_aws::DRIFT_METRIC && d.is_empty()));
}

/// The EMF lines the reconcile function prints for a backend's drift, in the
/// namespace `Flexway/flexway`.
fn drift_lines() -> Vec<String> {
    let drift = flexway::reconcile::Reconciliation {
        filter: Default::default(),
        rows: Vec::new(),
        backends: vec![flexway::reconcile::BackendDrift {
            backend: "openai".into(),
            gateway: Default::default(),
            provider: Default::default(),
            gateway_cost: flexway::money::MicroEur(0),
            provider_cost: None,
            drift_ratio: Some(0.1),
            periods: Vec::new(),
            growing: false,
        }],
        not_compared: Vec::new(),
        chargeback: None,
    };
    let lines = flexway_aws::drift_lines(&drift, "Flexway/flexway", 0);
    assert!(!lines.is_empty());
    lines
}

/// The sweeper's lag alarm: a sweeper that never runs alarms (missing data breaches),
/// but a fresh deploy does not, before the first sweep's line is counted: two periods
/// of five minutes must breach, and the alarm is made after the schedule and filter.
#[test]
fn the_sweeper_lag_alarm_waits_for_two_periods_and_breaches_on_silence() {
    let template = transformed(&[]);
    let alarm = &template["Resources"]["SweeperLagAlarm"];
    let properties = &alarm["Properties"];
    assert_eq!(properties["TreatMissingData"], "breaching");
    assert_eq!((&properties["EvaluationPeriods"], &properties["DatapointsToAlarm"]), (&json!(2), &json!(2)));
    assert_eq!(properties["Period"], 300);
    let order: BTreeSet<&str> = alarm["DependsOn"].as_array().unwrap().iter().map(|d| d.as_str().unwrap()).collect();
    assert_eq!(order, BTreeSet::from(["SweeperFunctionEveryMinute", "SweeperLagFilter"]));
    assert_eq!(template["Resources"]["SweeperFunctionEveryMinute"]["Type"], "AWS::Events::Rule");
}

// ----- the metric filters, against the lines the code prints --------------------------------

fn pattern(template: &Value, filter: &str) -> String {
    template["Resources"][filter]["Properties"]["FilterPattern"].as_str().unwrap().to_owned()
}

fn metric_of(template: &Value, filter: &str) -> Value {
    template["Resources"][filter]["Properties"]["MetricTransformations"][0]["MetricName"].clone()
}

fn alarm_on(template: &Value, metric: &Value) -> Vec<String> {
    let alarms = resources(template, "AWS::CloudWatch::Alarm").into_iter();
    alarms.filter(|(_, a)| &a["Properties"]["MetricName"] == metric).map(|(n, _)| n.to_owned()).collect()
}

/// Wraps a store and fails the charge of a late settlement (its reservation
/// `<id>#late`); every other call passes through.
struct LateChargesFail(Arc<MemoryBudgetStore>);

#[async_trait::async_trait]
impl BudgetStore for LateChargesFail {
    async fn reserve(&self, request: &ReserveRequest) -> Result<ReserveOutcome, StoreError> {
        if request.request_id.ends_with("#late") {
            return Err(StoreError::Backend("the ledger is unavailable".into()));
        }
        self.0.reserve(request).await
    }
    async fn settle(
        &self,
        reservation: &Reservation,
        actual: &[(CounterKey, u64)],
    ) -> Result<SettleOutcome, StoreError> {
        self.0.settle(reservation, actual).await
    }
    async fn record_intent(&self, request_id: &str, actual: &[(CounterKey, u64)]) -> Result<IntentOutcome, StoreError> {
        self.0.record_intent(request_id, actual).await
    }
    async fn renew(
        &self,
        request_id: &str,
        actual: &[(CounterKey, u64)],
        expires_at: u64,
    ) -> Result<IntentOutcome, StoreError> {
        self.0.renew(request_id, actual, expires_at).await
    }
    async fn sweep(&self, now: u64) -> Result<Swept, StoreError> {
        self.0.sweep(now).await
    }
    async fn used(&self, keys: &[CounterKey]) -> Result<Vec<u64>, StoreError> {
        self.0.used(keys).await
    }
    async fn live_reservations(&self) -> Result<usize, StoreError> {
        self.0.live_reservations().await
    }
    async fn create_run(&self, run: &flexway::budget::run::Run) -> Result<bool, StoreError> {
        self.0.create_run(run).await
    }
    async fn run(&self, id: &str) -> Result<Option<flexway::budget::run::Run>, StoreError> {
        self.0.run(id).await
    }
    async fn end_run(&self, id: &str, at: u64) -> Result<flexway::budget::run::RunEnd, StoreError> {
        self.0.end_run(id, at).await
    }
}

thread_local! {
    /// The lease store's clock in [`a_late_settlement_that_cannot_be_charged`] (its
    /// runtime runs on the test's thread).
    static CLOCK: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// A lease reclaimed by a sweep while its owner was away (frozen), one call of it
/// settled and one still in flight; the owner, back, renews it, finds it closed, and
/// charges what the lease served on its own, which cannot be written: the lines the
/// lease code prints.
fn a_late_settlement_that_cannot_be_charged() -> Vec<String> {
    const NOW: u64 = flexway::budget::conformance::NOW;
    CLOCK.with(|clock| clock.set(NOW));
    printed(async {
        let inner = Arc::new(LateChargesFail(Arc::new(MemoryBudgetStore::new())));
        // The usage is not written with each settle: the sweep charges none of it.
        let policy = LeasePolicy { intent_every: std::time::Duration::from_secs(3600), ..LeasePolicy::default() };
        let leased = LeasedBudgetStore::new(inner.clone(), policy.clone()).with_clock(|| CLOCK.with(|c| c.get()));
        let key = CounterKey("acme/*/tokens/day/2026-11-29".into());
        let call = |id: &str| ReserveRequest {
            request_id: id.into(),
            lines: vec![Line { key: key.clone(), amount: 100, limit: Some(100_000) }],
            expires_at: NOW + 60,
        };
        let (settled, in_flight) = (call("settled"), call("in-flight"));
        leased.reserve(&settled).await.unwrap();
        leased.reserve(&in_flight).await.unwrap();
        leased.settle(&settled.reservation(), &[(key.clone(), 40)]).await.unwrap();
        inner.sweep(NOW + policy.lease_secs + 1).await.unwrap();
        CLOCK.with(|clock| clock.set(NOW + policy.lease_secs + 1));
        leased.tend().await;
    })
}

/// `LateSettlementFailuresFilter` counts the line of a late settlement that could not
/// be charged (into the settle failures' metric and alarm), and not the lease's
/// reclaim, an info line.
#[test]
fn a_late_settlement_not_charged_is_counted_with_the_settle_failures() {
    let template = transformed(&[]);
    let late = pattern(&template, "LateSettlementFailuresFilter");
    let lines = a_late_settlement_that_cannot_be_charged();
    let counted: Vec<&String> = lines.iter().filter(|l| matches(&late, l)).collect();
    let [counted] = counted.as_slice() else { panic!("one line counted of {lines:#?}") };
    let event: Value = serde_json::from_str(counted).unwrap();
    assert_eq!(event["level"], "ERROR", "{counted}");
    let reclaimed = lines.iter().find(|l| l.contains("lease reclaimed")).unwrap_or_else(|| panic!("{lines:#?}"));
    assert!(!matches(&late, reclaimed));
    assert_eq!(metric_of(&template, "LateSettlementFailuresFilter"), metric_of(&template, "SettleFailuresFilter"));
    assert!(!matches(&pattern(&template, "SettleFailuresFilter"), counted), "counted twice");
    assert_eq!(alarm_on(&template, &metric_of(&template, "SettleFailuresFilter")), ["SettleFailuresAlarm"]);
}

/// `UnreservedCostFilter` counts the metering's line of a cost beyond its
/// reservations (`flexway::metering::COST_BEYOND_RESERVATIONS`, the text its
/// `tracing::error!` prints; the meter reserves each step first, so the code path
/// cannot be driven from outside), and no other.
#[test]
fn a_metered_cost_beyond_its_reservations_is_counted_with_the_settle_failures() {
    let template = transformed(&[]);
    let filter = pattern(&template, "UnreservedCostFilter");
    let lines = printed(async {
        let request_id = "req-1";
        tracing::error!(request_id, left = 120u64, "{}", flexway::metering::COST_BEYOND_RESERVATIONS);
        tracing::info!(request_id, "metered call settled");
    });
    let [beyond, other] = lines.as_slice() else { panic!("{lines:#?}") };
    assert!(matches(&filter, beyond), "{beyond}");
    assert!(!matches(&filter, other), "{other}");
    assert_eq!(metric_of(&template, "UnreservedCostFilter"), metric_of(&template, "SettleFailuresFilter"));
}

/// `SecretRefreshFailuresFilter` counts a refresh that could not resolve a secret
/// (the gateway's refresh, run here on a `file:` reference whose file is gone), never
/// the info line of new values in use, whose text starts the same.
#[test]
fn a_secret_refresh_that_fails_is_counted_and_new_values_are_not() {
    let template = transformed(&[]);
    let filter = pattern(&template, "SecretRefreshFailuresFilter");
    let dir = tempfile::tempdir().unwrap();
    let key = dir.path().join("backend-key");
    std::fs::write(&key, "sk-one\n").unwrap();
    let yaml = flexway_testkit::one_backend("http://127.0.0.1:9").replace(
        "      url:",
        &format!("      auth: {{type: bearer, secret: \"file:{}\"}}\n      url:", key.display()),
    );
    let lines = printed(async {
        let loaded = flexway::config::load_str(&yaml, &std::collections::HashMap::new()).unwrap();
        let secrets: Arc<flexway::secret::LocalSecrets> = Arc::new(Default::default());
        let (adapters, _) = flexway_testkit::memory_adapters();
        let gateway = flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap();
        std::fs::write(&key, "sk-two\n").unwrap();
        gateway.refresh_secrets().await;
        std::fs::remove_file(&key).unwrap();
        gateway.refresh_secrets().await;
    });
    let refresh: Vec<&String> = lines.iter().filter(|l| l.contains(flexway::secret::REFRESH)).collect();
    let [rotated, failed] = refresh.as_slice() else { panic!("{lines:#?}") };
    assert!(rotated.contains("new values in use") && !matches(&filter, rotated), "{rotated}");
    assert!(matches(&filter, failed), "{failed}");
    assert_eq!(
        alarm_on(&template, &metric_of(&template, "SecretRefreshFailuresFilter")),
        ["SecretRefreshFailuresAlarm"]
    );
}

/// Each function's log has a filter on its ERROR lines (tracing's `level`), one metric
/// and one alarm for the three; an INFO or WARN line is not counted.
#[test]
fn every_functions_error_lines_are_counted() {
    let template = transformed(&[]);
    let errors = json!("flexway.errors");
    let mut groups = BTreeSet::new();
    let mut lines = a_late_settlement_that_cannot_be_charged();
    lines.extend(printed(async { tracing::warn!("a warning") }));
    for (name, filter) in resources(&template, "AWS::Logs::MetricFilter") {
        if metric_of(&template, name) != errors {
            continue;
        }
        groups.insert(filter["Properties"]["LogGroupName"].to_string());
        let filter = pattern(&template, name);
        for line in &lines {
            let level = serde_json::from_str::<Value>(line).unwrap()["level"].clone();
            assert_eq!(matches(&filter, line), level == "ERROR", "{name}: {line}");
        }
    }
    let logged_to: BTreeSet<String> = resources(&template, "AWS::Lambda::Function")
        .into_iter()
        .map(|(_, f)| f["Properties"]["LoggingConfig"]["LogGroup"].to_string())
        .collect();
    assert_eq!(groups, logged_to, "one filter on each function's log");
    assert_eq!(alarm_on(&template, &errors), ["LoggedErrorsAlarm"]);
    assert!(lines.iter().any(|l| l.contains("\"ERROR\"")) && lines.iter().any(|l| l.contains("\"INFO\"")));
}

/// An audit record and an EMF line share the gateway's group with its log lines: no
/// filter counts them.
#[test]
fn audit_records_and_emf_lines_are_counted_by_no_filter() {
    let template = transformed(&[]);
    let record = flexway::audit::sample::record("acme", Some("openai"), flexway::config::Metering::Upstream, 1200);
    let record = serde_json::to_string(&record).unwrap();
    let emf = drift_lines();
    for (name, _) in resources(&template, "AWS::Logs::MetricFilter") {
        let filter = pattern(&template, name);
        assert!(!matches(&filter, &record), "{name} counts an audit record");
        for line in &emf {
            assert!(!matches(&filter, line), "{name} counts {line}");
        }
    }
}
