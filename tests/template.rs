//! What the infrastructure template must keep, read from `infra/template.yaml` as
//! YAML (CloudFormation's short tags, `!Ref` and `!If`, read as tagged values). The
//! template's syntax and its resources' schemas are checked by cfn-lint and `sam
//! validate` in `.ci/run`; these are the choices a lint cannot know are deliberate.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

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
    assert_eq!(functions.len(), 2, "the gateway and the sweeper");
    for (name, function) in functions {
        assert_eq!(function["Properties"]["LoggingConfig"]["LogFormat"], "Text", "{name:?}");
    }
}

#[test]
fn the_sweepers_reserved_concurrency_is_a_parameter_an_account_with_a_low_quota_sets_to_none() {
    let template = template();
    let parameter = &template["Parameters"]["SweeperReservedConcurrency"];
    assert_eq!((parameter["Default"].as_u64(), parameter["MinValue"].as_u64()), (Some(1), Some(0)));
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

/// The gateway behind API Gateway as well as its function URL: a regional REST API
/// whose every path and method goes to the function through the streaming Lambda
/// proxy integration, and whose stage stays out of the function's routes.
#[test]
fn the_gateway_is_behind_a_streaming_rest_api_with_its_stage_out_of_the_path() {
    let template = template();
    let resources = &template["Resources"];
    let api = &resources["GatewayApi"];
    assert_eq!(api["Type"], "AWS::ApiGateway::RestApi");
    assert_eq!(api["Properties"]["EndpointConfiguration"]["Types"][0], "REGIONAL");
    assert_eq!(resources["GatewayApiProxy"]["Properties"]["PathPart"], "{proxy+}");
    let method = &resources["GatewayApiProxyMethod"]["Properties"];
    assert_eq!(method["HttpMethod"], "ANY");
    let integration = &method["Integration"];
    assert_eq!(integration["Type"], "AWS_PROXY");
    assert_eq!(integration["IntegrationHttpMethod"], "POST");
    assert_eq!(integration["ResponseTransferMode"], "STREAM", "buffered answers wait for the whole completion");
    assert_eq!(integration["TimeoutInMillis"].as_u64(), Some(900_000), "a stream may last the function's 15 minutes");
    let (tag, uri) = tagged(&integration["Uri"]).expect("a !Sub");
    assert_eq!(tag, "!Sub");
    let uri = uri.as_str().unwrap();
    assert!(
        uri.contains(":lambda:path/2021-11-15/functions/${GatewayFunction.Arn}/response-streaming-invocations"),
        "InvokeWithResponseStream, not Invoke: {uri}"
    );
    let permission = &resources["GatewayApiInvokeAccess"]["Properties"];
    assert_eq!(permission["Action"], "lambda:InvokeFunction");
    assert_eq!(permission["Principal"], "apigateway.amazonaws.com");
    let (_, source) = tagged(&permission["SourceArn"]).expect("a !Sub");
    assert!(source.as_str().unwrap().contains(":${GatewayApi}/"), "only this API may invoke: {source:?}");
    let environment = &resources["GatewayFunction"]["Properties"]["Environment"]["Variables"];
    assert_eq!(environment["AWS_LAMBDA_HTTP_IGNORE_STAGE_IN_PATH"], "true", "routes are /v1/..., not /live/v1/...");
    let (_, url) = tagged(&template["Outputs"]["GatewayApiUrl"]["Value"]).expect("the base URL is an output");
    assert!(url.as_str().unwrap().ends_with("/${GatewayApiStage}/"), "{url:?}");
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
