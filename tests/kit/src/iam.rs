//! Every AWS request a piece of code sends, as IAM authorizes it: the SDK's HTTP
//! connector wrapped ([`Recorder::install`]), so that clients built anywhere from the
//! recorded `SdkConfig` (`flexway_aws::build_adapters` builds its own) are seen, and
//! each request read as the action and resource IAM checks it against.
//!
//! The mapping follows IAM's rules, not the API's operation names: DynamoDB's
//! `TransactWriteItems` has no action of its own (each item is authorized as the
//! write it makes, on its table), a `Query` on an index is authorized on the index's
//! ARN, CloudWatch Logs authorizes stream writes on the stream and reads on the group
//! (the `log-group:NAME:*` form a group's `Arn` attribute has). A request this module
//! cannot read is recorded as an action of its own (`unknown:...`), which no policy
//! grants: a test fails on it instead of passing it by.

use std::sync::{Arc, Mutex};

use aws_config::SdkConfig;
use aws_smithy_runtime_api::client::http::{
    HttpClient, HttpConnector, HttpConnectorFuture, SharedHttpConnector, http_client_fn,
};
use aws_smithy_runtime_api::client::orchestrator::HttpRequest;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The emulator's account (moto's default): what ARNs built from names carry.
pub const ACCOUNT: &str = "123456789012";

/// One authorization a request needs: `operation` (the API's, `DynamoDB.Query`) needs
/// `action` (`dynamodb:Query`) on `resource` (an ARN, or `*`).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Authorization {
    pub operation: String,
    pub action: String,
    pub resource: String,
}

/// What the clients of a recorded `SdkConfig` sent, in order, as authorizations.
#[derive(Debug, Clone, Default)]
pub struct Recorder(Arc<Mutex<Vec<Authorization>>>);

impl Recorder {
    /// `sdk` with its HTTP client wrapped: each request is recorded, then sent by the
    /// client `sdk` has (every attempt, retries included).
    pub fn install(sdk: &SdkConfig) -> (SdkConfig, Recorder) {
        let recorder = Recorder::default();
        let inner = sdk.http_client().expect("the SDK configuration has an HTTP client");
        let log = recorder.0.clone();
        let client = http_client_fn(move |settings, components| {
            let inner = inner.http_connector(settings, components);
            SharedHttpConnector::new(Recording { inner, log: log.clone() })
        });
        (sdk.to_builder().http_client(client).build(), recorder)
    }

    /// What was recorded since the last `take`.
    pub fn take(&self) -> Vec<Authorization> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    /// What was recorded since the last `take`, left in place.
    pub fn peek(&self) -> Vec<Authorization> {
        self.0.lock().unwrap().clone()
    }
}

#[derive(Debug)]
struct Recording {
    inner: SharedHttpConnector,
    log: Arc<Mutex<Vec<Authorization>>>,
}

impl HttpConnector for Recording {
    fn call(&self, request: HttpRequest) -> HttpConnectorFuture {
        let needed = authorizations(&request);
        self.log.lock().unwrap().extend(needed);
        self.inner.call(request)
    }
}

/// The authorizations one request needs.
fn authorizations(request: &HttpRequest) -> Vec<Authorization> {
    let region = signing_region(request).unwrap_or_else(|| "us-east-1".to_owned());
    let body: Value = request.body().bytes().and_then(|b| serde_json::from_slice(b).ok()).unwrap_or(Value::Null);
    let Some((prefix, operation)) = request.headers().get("x-amz-target").and_then(|t| t.split_once('.')) else {
        let unknown = format!("unknown:{} {}", request.method(), request.uri());
        return vec![Authorization { operation: unknown.clone(), action: unknown, resource: "*".to_owned() }];
    };
    let arns = Arns { region: &region };
    let (service, needed) = match prefix {
        p if p.starts_with("DynamoDB_") => ("DynamoDB", dynamodb(operation, &body, &arns)),
        p if p.starts_with("Logs_") => ("Logs", logs(operation, &body, &arns)),
        "secretsmanager" => ("SecretsManager", secrets_manager(operation, &body, &arns)),
        "AmazonSSM" => ("SSM", ssm(operation, &body, &arns)),
        _ => (prefix, vec![(format!("unknown:{prefix}.{operation}"), "*".to_owned())]),
    };
    let operation = format!("{service}.{operation}");
    needed
        .into_iter()
        .map(|(action, resource)| Authorization { operation: operation.clone(), action, resource })
        .collect()
}

/// The region of the request's SigV4 credential scope (`Credential=KEY/DATE/REGION/SERVICE/aws4_request`).
fn signing_region(request: &HttpRequest) -> Option<String> {
    let authorization = request.headers().get("authorization")?;
    let scope = authorization.split("Credential=").nth(1)?.split(',').next()?;
    scope.split('/').nth(2).map(str::to_owned)
}

struct Arns<'a> {
    region: &'a str,
}

impl Arns<'_> {
    fn table(&self, table: &str) -> String {
        format!("arn:aws:dynamodb:{}:{ACCOUNT}:table/{table}", self.region)
    }

    fn log_group(&self, group: &str) -> String {
        format!("arn:aws:logs:{}:{ACCOUNT}:log-group:{group}", self.region)
    }
}

fn text<'a>(body: &'a Value, key: &str) -> &'a str {
    body[key].as_str().unwrap_or("?")
}

fn dynamodb(operation: &str, body: &Value, arns: &Arns) -> Vec<(String, String)> {
    let action = |name: &str| format!("dynamodb:{name}");
    match operation {
        // Authorized item by item, as the write (or read) each item makes.
        "TransactWriteItems" | "TransactGetItems" => body["TransactItems"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|item| item.as_object()?.iter().next())
            .map(|(kind, item)| {
                let name = match kind.as_str() {
                    "Put" => "PutItem",
                    "Update" => "UpdateItem",
                    "Delete" => "DeleteItem",
                    "ConditionCheck" => "ConditionCheckItem",
                    "Get" => "GetItem",
                    other => return (format!("unknown:dynamodb:{operation}.{other}"), "*".to_owned()),
                };
                (action(name), arns.table(text(item, "TableName")))
            })
            .collect(),
        "BatchGetItem" | "BatchWriteItem" => body["RequestItems"]
            .as_object()
            .into_iter()
            .flatten()
            .map(|(table, _)| (action(operation), arns.table(table)))
            .collect(),
        "Query" | "Scan" => {
            let table = arns.table(text(body, "TableName"));
            let resource = match body["IndexName"].as_str() {
                Some(index) => format!("{table}/index/{index}"),
                None => table,
            };
            vec![(action(operation), resource)]
        }
        _ => match body["TableName"].as_str() {
            Some(table) => vec![(action(operation), arns.table(table))],
            None => vec![(action(operation), "*".to_owned())],
        },
    }
}

fn logs(operation: &str, body: &Value, arns: &Arns) -> Vec<(String, String)> {
    // A group is named, or identified by its ARN (either form: with `:*` or without).
    let group = body["logGroupName"].as_str().or(body["logGroupIdentifier"].as_str()).unwrap_or("?");
    let group = match group.strip_prefix("arn:") {
        Some(_) => group.trim_end_matches(":*").to_owned(),
        None => arns.log_group(group),
    };
    let resource = match operation {
        // Actions on a stream are authorized on the stream.
        "PutLogEvents" | "CreateLogStream" | "DeleteLogStream" | "GetLogEvents" => {
            format!("{group}:log-stream:{}", text(body, "logStreamName"))
        }
        _ => format!("{group}:*"),
    };
    vec![(format!("logs:{operation}"), resource)]
}

fn secrets_manager(operation: &str, body: &Value, arns: &Arns) -> Vec<(String, String)> {
    let id = text(body, "SecretId");
    // By name, the ARN's random suffix is unknown here: the name alone, which a
    // policy written as `NAME-??????` does not match (as IAM would not).
    let resource = if id.starts_with("arn:") {
        id.to_owned()
    } else {
        format!("arn:aws:secretsmanager:{}:{ACCOUNT}:secret:{id}", arns.region)
    };
    vec![(format!("secretsmanager:{operation}"), resource)]
}

fn ssm(operation: &str, body: &Value, arns: &Arns) -> Vec<(String, String)> {
    let names: Vec<&str> = match body["Names"].as_array() {
        Some(names) => names.iter().filter_map(Value::as_str).collect(),
        None => vec![text(body, "Name")],
    };
    let arn = |name: &str| {
        if name.starts_with("arn:") {
            name.to_owned()
        } else {
            format!("arn:aws:ssm:{}:{ACCOUNT}:parameter/{}", arns.region, name.trim_start_matches('/'))
        }
    };
    names.into_iter().map(|name| (format!("ssm:{operation}"), arn(name))).collect()
}
