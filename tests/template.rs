//! What the infrastructure template must keep, read from `infra/template.yaml` as
//! YAML (CloudFormation's short tags, `!Ref` and `!If`, read as tagged values). The
//! template's syntax and its resources' schemas are checked by cfn-lint and `sam
//! validate` in `.ci/run`; these are the choices a lint cannot know are deliberate.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::logs::{matches, printed as logged};
use serde_norway::Value;

fn template() -> Value {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("infra/template.yaml");
    serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `!Tag value` as (tag, value).
fn tagged(value: &Value) -> Option<(String, &Value)> {
    match value {
        Value::Tagged(tagged) => Some((tagged.tag.to_string(), &tagged.value)),
        _ => None,
    }
}

#[test]
fn every_function_logs_as_text() {
    // A JSON log format wraps every line the function prints in an object of its own,
    // and its level filter drops lines without a level: the gateway's audit records,
    // printed for Lambda to deliver to the audit group, would be unreadable or gone.
    let template = template();
    let functions: Vec<(&Value, &Value)> = template["Resources"]
        .as_mapping()
        .unwrap()
        .iter()
        .filter(|(_, resource)| resource["Type"] == "AWS::Serverless::Function")
        .collect();
    assert_eq!(functions.len(), 3, "the gateway, the sweeper and the reconcile function");
    for (name, function) in functions {
        assert_eq!(function["Properties"]["LoggingConfig"]["LogFormat"], "Text", "{name:?}");
    }
}

#[test]
fn the_sweepers_reserved_concurrency_is_none_unless_the_account_can_reserve_it() {
    // A new account's quota may be 10 and Lambda keeps 100 unreserved: a reservation of
    // 1 by default would roll the first create back.
    let template = template();
    let parameter = &template["Parameters"]["SweeperReservedConcurrency"];
    assert_eq!((parameter["Default"].as_u64(), parameter["MaxValue"].as_u64()), (Some(0), Some(1)));
    let reserved = &template["Resources"]["SweeperFunction"]["Properties"]["ReservedConcurrentExecutions"];
    let (tag, arms) = tagged(reserved).expect("an !If on the parameter, not a number");
    assert_eq!(tag, "!If");
    assert_eq!(arms[0], "HasSweeperReservedConcurrency");
    assert_eq!(
        tagged(&arms[1]).map(|(tag, v)| (tag, v.clone())),
        Some(("!Ref".into(), "SweeperReservedConcurrency".into()))
    );
    assert_eq!(tagged(&arms[2]).map(|(tag, v)| (tag, v.clone())), Some(("!Ref".into(), "AWS::NoValue".into())));
    let condition = &template["Conditions"]["HasSweeperReservedConcurrency"];
    assert!(tagged(condition).is_some_and(|(tag, _)| tag == "!Not"), "{condition:?}");
}

/// The gateway behind API Gateway as well as its function URL: SAM's API (it names the
/// deployment after the API, so a changed API reaches the stage), regional, every
/// media type binary, each route an Api event of the function streamed through the
/// streaming Lambda proxy integration, and the stage kept out of the function's
/// routes. What SAM makes of it: tests/template_transformed.rs.
#[test]
fn the_gateway_is_behind_sams_streaming_api_with_its_stage_out_of_the_path() {
    let template = template();
    let resources = &template["Resources"];
    let api = &resources["GatewayApi"];
    assert_eq!(api["Type"], "AWS::Serverless::Api", "a raw RestApi's fixed Deployment never redeploys");
    let properties = &api["Properties"];
    assert_eq!(properties["StageName"], "live");
    assert_eq!(properties["EndpointConfiguration"], "REGIONAL");
    assert_eq!(properties["BinaryMediaTypes"][0], "*~1*", "*/* in CloudFormation's escaping: every body is bytes");
    let events = resources["GatewayFunction"]["Properties"]["Events"].as_mapping().unwrap();
    let mut paths = Vec::new();
    for (name, event) in events {
        let route = &event["Properties"];
        assert_eq!(event["Type"], "Api", "{name:?}");
        assert_eq!(
            tagged(&route["RestApiId"]).map(|(t, v)| (t, v.clone())),
            Some(("!Ref".into(), "GatewayApi".into()))
        );
        assert_eq!(route["Method"], "ANY", "{name:?}");
        assert_eq!(route["ResponseTransferMode"], "RESPONSE_STREAM", "buffered answers wait for the whole completion");
        assert_eq!(route["TimeoutInMillis"].as_u64(), Some(900_000), "a stream may last the function's 15 minutes");
        paths.push(route["Path"].as_str().unwrap().to_owned());
    }
    paths.sort();
    assert_eq!(paths, ["/", "/{proxy+}"]);
    let environment = &resources["GatewayFunction"]["Properties"]["Environment"]["Variables"];
    assert_eq!(environment["AWS_LAMBDA_HTTP_IGNORE_STAGE_IN_PATH"], "true", "routes are /v1/..., not /live/v1/...");
    let (_, url) = tagged(&template["Outputs"]["GatewayApiUrl"]["Value"]).expect("the base URL is an output");
    assert!(url.as_str().unwrap().ends_with("/${GatewayApi.Stage}/"), "{url:?}");
}

/// `sam build` packages the gateway through `infra/Makefile`, which validates the
/// bundled config first: `config/serverless.yaml` (the serverless shape's starting
/// point) is packaged with the binary; a config that does not load stops the build
/// with `flexway validate`'s error, and nothing is packaged.
#[test]
fn the_build_validates_the_bundled_config_before_packaging_it() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let workspace = tempfile::tempdir().unwrap();
    let bootstrap = workspace.path().join("target/lambda/flexway-gateway/bootstrap");
    std::fs::create_dir_all(bootstrap.parent().unwrap()).unwrap();
    std::fs::write(&bootstrap, b"the function").unwrap();
    let broken = workspace.path().join("broken.yaml");
    std::fs::write(&broken, "version: 1\nstore: {kind: dynamodb}\n").unwrap();
    let build = |config: &std::path::Path| {
        let artifacts = tempfile::tempdir().unwrap();
        let output = std::process::Command::new("make")
            .arg("-C")
            .arg(workspace.path())
            .arg("-f")
            .arg(root.join("infra/Makefile"))
            .arg("build-GatewayFunction")
            .arg(format!("ARTIFACTS_DIR={}", artifacts.path().display()))
            .arg(format!("FLEXWAY_YAML={}", config.display()))
            .arg(format!("FLEXWAY={}", env!("CARGO_BIN_EXE_flexway")))
            .output()
            .unwrap();
        let packaged: Vec<String> = std::fs::read_dir(artifacts.path())
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        (output, packaged)
    };

    let (output, mut packaged) = build(&root.join("config/serverless.yaml"));
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    packaged.sort();
    assert_eq!(packaged, ["bootstrap", "flexway.yaml"]);

    let (output, packaged) = build(&broken);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "a broken config was packaged");
    assert!(stderr.contains("broken.yaml") && stderr.contains("table"), "validate's error: {stderr}");
    assert!(packaged.is_empty(), "{packaged:?}");
}

// ----- metric filters against the log lines they read ------------------------------

fn filter_pattern(template: &Value, filter: &str) -> String {
    template["Resources"][filter]["Properties"]["FilterPattern"].as_str().unwrap().to_owned()
}

/// `SettleFailuresFilter` counts the settlements the gateway could not write (a call
/// charged late, or not at all), and never the end of a lease reclaimed while its
/// owner was away (frozen, then thawed): that is a lease's normal end, logged at info.
#[test]
fn settle_failures_count_failed_settlements_never_a_reclaimed_lease() {
    use flexway::budget::{BudgetStore, LeasePolicy, LeasedBudgetStore, Line, MemoryBudgetStore, ReserveRequest};
    let pattern = filter_pattern(&template(), "SettleFailuresFilter");
    let failed = logged(async {
        let store = std::sync::Arc::new(MemoryBudgetStore::new());
        flexway::budget::conformance::a_ticket_whose_settle_cannot_be_written_is_charged_by_the_sweeper(store)
            .await
            .unwrap();
    });
    let counted: Vec<&String> = failed.iter().filter(|line| matches(&pattern, line)).collect();
    assert!(!counted.is_empty(), "a settle intent recorded is not counted: {failed:#?}");

    const NOW: u64 = flexway::budget::conformance::NOW;
    let thawed = logged(async {
        for intent_every in [std::time::Duration::ZERO, std::time::Duration::from_secs(3600)] {
            let inner = std::sync::Arc::new(MemoryBudgetStore::new());
            let policy = LeasePolicy { intent_every, ..LeasePolicy::default() };
            let leased = LeasedBudgetStore::new(inner.clone(), policy.clone()).with_clock(|| NOW);
            let key = flexway::budget::CounterKey("acme/*/tokens/day/2026-11-29".into());
            let call = ReserveRequest {
                request_id: "call".into(),
                lines: vec![Line { key: key.clone(), amount: 100, limit: Some(100_000) }],
                expires_at: NOW + 60,
            };
            leased.reserve(&call).await.unwrap();
            leased.settle(&call.reservation(), &[(key.clone(), 40)]).await.unwrap();
            // Frozen past its lease's life: the sweeper closes it; thawed, it settles.
            inner.sweep(NOW + policy.lease_secs + 1).await.unwrap();
            leased.flush().await;
            assert_eq!(inner.used(&[key]).await.unwrap(), [40], "charged once, intent every {intent_every:?}");
        }
    });
    assert!(thawed.iter().any(|line| line.contains("lease")), "the thaw is logged: {thawed:#?}");
    let counted: Vec<&String> = thawed.iter().filter(|line| matches(&pattern, line)).collect();
    assert!(counted.is_empty(), "a lease's normal end counted as a failed settlement: {counted:#?}");
}

/// The sweeper's line (`functions/sweeper/src/main.rs`; its test holds the fields):
/// `SweeperChargesFilter` counts settlements charged late, never leases closed, and
/// `SweeperLagFilter` reads the lag of every run.
#[test]
fn sweeper_charges_count_failed_settlements_and_the_lag_is_read_from_every_run() {
    let template = template();
    let charges = filter_pattern(&template, "SweeperChargesFilter");
    let lag = filter_pattern(&template, "SweeperLagFilter");
    let lines = logged(async {
        tracing::info!(refunded = 0, charged = 0, leases = 3, lag_secs = 12, "swept expired reservations");
        tracing::info!(refunded = 1, charged = 2, leases = 0, lag_secs = 0, "swept expired reservations");
    });
    let [leases_only, charged] = lines.as_slice() else { panic!("{lines:#?}") };
    assert!(!matches(&charges, leases_only), "leases closed are not failed settlements: {leases_only}");
    assert!(matches(&charges, charged), "{charged}");
    assert!(matches(&lag, leases_only) && matches(&lag, charged), "every run gives the lag");
    let value = template["Resources"]["SweeperLagFilter"]["Properties"]["MetricTransformations"][0]["MetricValue"]
        .as_str()
        .unwrap()
        .to_owned();
    assert_eq!(value, "$.fields.lag_secs");
    let event: serde_json::Value = serde_json::from_str(leases_only).unwrap();
    assert_eq!(event["fields"]["lag_secs"], 12);
    let alarm = &template["Resources"]["SweeperLagAlarm"]["Properties"];
    assert_eq!(alarm["TreatMissingData"], "breaching", "a sweeper that does not run at all alarms");
    assert!(template["Resources"]["AuditFailuresAlarm"].is_null(), "printed records cannot fail to be written");
}

/// The drift alarm reads the series the reconcile function prints as EMF
/// (`flexway_aws::drift_lines`: the dimension set `[]` carries every backend's
/// value), in the stack's namespace, which the function is given; the function reads
/// the audit group and, of the secrets, only the admin keys the stack names.
#[test]
fn the_drift_alarm_reads_what_the_reconcile_function_prints() {
    let template = template();
    let alarm = &template["Resources"]["ReconciliationDriftAlarm"]["Properties"];
    assert_eq!(alarm["MetricName"], flexway_aws::DRIFT_METRIC);
    assert!(alarm.get("Dimensions").is_none(), "the series without a dimension: every backend's drift");
    assert_eq!(alarm["Statistic"], "Maximum");
    assert_eq!(
        tagged(&alarm["Threshold"]).map(|(t, v)| (t, v.clone())),
        Some(("!Ref".into(), "ReconciliationDriftThreshold".into()))
    );
    let function = &template["Resources"]["ReconcileFunction"]["Properties"];
    let variables = &function["Environment"]["Variables"];
    assert_eq!(
        tagged(&alarm["Namespace"]).map(|(_, v)| v.clone()),
        tagged(&variables["FLEXWAY_METRICS_NAMESPACE"]).map(|(_, v)| v.clone())
    );
    assert_eq!(tagged(&variables["FLEXWAY_AUDIT_LOG_GROUP"]).map(|(_, v)| v.clone()), Some("AuditLogGroup".into()));
    let statements =
        &template["Resources"]["ReconcileRole"]["Properties"]["Policies"][0]["PolicyDocument"]["Statement"];
    let read_audit = statements.as_sequence().unwrap().iter().find(|s| s["Sid"] == "ReadAudit").unwrap();
    assert_eq!(read_audit["Action"], "logs:FilterLogEvents");
    let gateway = serde_norway::to_string(&template["Resources"]["GatewayRole"]).unwrap();
    assert!(!gateway.contains("UsageApiSecretArns"), "the gateway never reads an admin key");
}

/// The gateway's memory is the measured one (infra/README.md, "Memory and cost"), and a
/// gateway deployed with `cargo lambda deploy` (docs/serverless.md) gets the same.
#[test]
fn a_gateway_deployed_either_way_has_the_measured_memory() {
    let template = template();
    let memory = template["Resources"]["GatewayFunction"]["Properties"]["MemorySize"].as_u64().unwrap();
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let readme = std::fs::read_to_string(root.join("infra/README.md")).unwrap();
    assert!(readme.contains(&format!("| {memory} MB (the template's) |")), "infra/README.md's cost table");
    let docs = std::fs::read_to_string(root.join("docs/serverless.md")).unwrap();
    let flags: Vec<&str> = docs.lines().filter_map(|line| line.split("--memory ").nth(1)).collect();
    assert!(!flags.is_empty(), "docs/serverless.md deploys with no --memory");
    for flag in flags {
        assert_eq!(flag.split_whitespace().next(), Some(memory.to_string().as_str()), "docs/serverless.md: {flag}");
    }
}
