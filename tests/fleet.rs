//! The fleet shape (ARCHITECTURE.md, deployment shapes): several `flexway serve`
//! processes behind any load balancer, sharing one DynamoDB ledger and one CloudWatch
//! audit log group (each process its own stream), on the AWS emulator
//! (`AWS_ENDPOINT_URL`; `scripts/test` starts one), each serving the ledger through
//! budget leases. A concurrent burst split across two processes never passes the
//! tenant's cap, and once the processes stop (SIGTERM, as a platform stops a task:
//! each settles its leases) both audits together equal the ledger, to the token.
// The binary reaches AWS only when built with the `aws` feature (scripts/test builds it).
#![cfg(test)]
#![cfg(feature = "aws")]

use flexway_testkit::emulator;

use flexway::budget::period::unix_now;
use flexway::budget::{CounterKey, Period, Unit};
use flexway_aws::DynamoDbBudgetStore;
use flexway_testkit::*;

/// The cap, in tokens per day: room for a handful of the burst's calls only.
const CAP: u64 = 400;

fn fleet_config(table: &str, group: &str, model: &FakeModel) -> String {
    format!(
        r#"version: 1
store: {{kind: dynamodb, table: {table}}}
audit: {{sink: cloudwatch, log_group: {group}}}
tenants:
  acme:
    keys:
      - sha256: {key}
    budgets: {{tokens_per_day: {CAP}}}
ai:
  budget: {{default_max_tokens: 20}}
  default_backend: main
  backends:
    main: {{url: "{url}", price: {{input_per_mtok_eur: 1, output_per_mtok_eur: 2}}}}
"#,
        key = sha(KEY),
        url = scenario(model, "words=20"),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_processes_on_one_table_never_pass_the_cap_and_their_audits_equal_the_ledger() {
    let sdk = emulator::sdk().await;
    let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
    let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let table = emulator::unique("flexway-fleet");
    let group = format!("/flexway/{}", emulator::unique("fleet-audit"));
    DynamoDbBudgetStore::create_table(&dynamodb, &table).await.unwrap();
    logs.create_log_group().log_group_name(&group).send().await.unwrap();
    let model = FakeModel::start().await.unwrap();
    let yaml = fleet_config(&table, &group, &model);
    let env = emulator::process_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut fleet = [Flexway::start_with_env(&yaml, &env), Flexway::start_with_env(&yaml, &env)];

    // 30 calls at once, alternating between the two processes.
    let calls = (0..30).map(|i| fleet[i % 2].chat(KEY, hello("m")));
    let statuses: Vec<u16> = futures_util::future::join_all(calls).await.iter().map(|r| r.status().as_u16()).collect();
    let served = statuses.iter().filter(|s| **s == 200).count();
    let refused = statuses.iter().filter(|s| **s == 429).count();
    assert_eq!(served + refused, 30, "{statuses:?}");
    assert!(served > 0 && refused > 0, "the cap is reached within the burst: {statuses:?}");

    let store = DynamoDbBudgetStore::new(dynamodb, table);
    let day = CounterKey::new("acme", None, Unit::Tokens, Period::Day, unix_now());
    let used = flexway::budget::BudgetStore::used(&store, std::slice::from_ref(&day)).await.unwrap()[0];
    assert!(used <= CAP, "the cap was passed, leases included: {used} > {CAP}");

    // Stopped as a platform stops a task: each process settles its leases on the way out.
    for process in &mut fleet {
        let pid = process.pid().to_string();
        assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let status = process.wait_exit(std::time::Duration::from_secs(10)).expect("the process stops");
        assert!(status.success(), "{status:?}: {}", process.logs());
    }
    let used = flexway::budget::BudgetStore::used(&store, &[day]).await.unwrap()[0];
    assert!(used <= CAP, "the cap was passed: {used} > {CAP}");

    // Every call of both processes is in the group, and the served ones sum to the ledger.
    let records = loop {
        let records = flexway_aws::read_audit_log_group(&logs, &group, None, None, None).await.unwrap().records;
        if records.len() >= 30 {
            break records;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    assert_eq!(records.len(), 30);
    let streams = logs.describe_log_streams().log_group_name(&group).send().await.unwrap();
    assert_eq!(streams.log_streams().len(), 2, "one stream per process");
    let audited: u64 = records.iter().map(|r| r.prompt_tokens + r.completion_tokens).sum();
    assert_eq!(audited, used, "both audits together equal the ledger");
    assert_eq!(records.iter().filter(|r| r.status == 200).count(), served);
    assert_eq!(flexway::budget::BudgetStore::live_reservations(&store).await.unwrap(), 0);
}

/// The false 429 of long, large leases, on the fleet shape: three processes on one
/// table, a tenant with a 3,000-token day. The third process serves the tenant's first
/// call at once (no process holds most of the day); a process killed with SIGKILL
/// after its call leaves a lease that comes back within seconds, its usage charged;
/// the tenant then spends its day to the cap, all but a call's worth, on one process
/// while the others sit idle. The ledger equals the usage the clients were answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_is_never_refused_while_its_day_has_room_whichever_process_serves_it() {
    const DAY: u64 = 3_000;
    let sdk = emulator::sdk().await;
    let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
    let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let table = emulator::unique("flexway-fleet-leases");
    let group = format!("/flexway/{}", emulator::unique("fleet-leases"));
    DynamoDbBudgetStore::create_table(&dynamodb, &table).await.unwrap();
    logs.create_log_group().log_group_name(&group).send().await.unwrap();
    let model = FakeModel::start().await.unwrap();
    let yaml = fleet_config(&table, &group, &model).replace(&format!("tokens_per_day: {CAP}"), "tokens_per_day: 3000");
    let env = emulator::process_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut fleet = [
        Flexway::start_with_env(&yaml, &env),
        Flexway::start_with_env(&yaml, &env),
        Flexway::start_with_env(&yaml, &env),
    ];
    let mut answered = 0u64;
    let tokens = |body: serde_json::Value| {
        let usage = &body["usage"];
        usage["prompt_tokens"].as_u64().unwrap() + usage["completion_tokens"].as_u64().unwrap()
    };
    for (n, process) in fleet.iter().enumerate() {
        let response = process.chat(KEY, hello("m")).await;
        assert_eq!(response.status(), 200, "process {n}'s first call, the day nearly unspent");
        answered += tokens(response.json().await.unwrap());
    }
    // The killed process's usage is on its lease once the tender, every second,
    // found it unwritten for `intent_every` (1 s): within 2 s of the call.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let killed = fleet[1].pid().to_string();
    assert!(std::process::Command::new("kill").args(["-KILL", &killed]).status().unwrap().success());

    let started = std::time::Instant::now();
    let mut refused_since: Option<std::time::Instant> = None;
    loop {
        let response = fleet[2].chat(KEY, hello("m")).await;
        if response.status() == 200 {
            refused_since = None;
            answered += tokens(response.json().await.unwrap());
            continue;
        }
        assert_eq!(response.status(), 429);
        // A call reserves its prompt and 20 completion tokens: under 100.
        if answered + 100 > DAY {
            break;
        }
        let since = *refused_since.get_or_insert_with(std::time::Instant::now);
        let unspent = DAY - answered;
        assert!(since.elapsed().as_secs() < 20, "refused for 20 s with {unspent} of {DAY} tokens unspent");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    eprintln!("the day spent to the cap in {:?}", started.elapsed());

    for process in fleet.iter_mut().step_by(2) {
        let pid = process.pid().to_string();
        assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
        let status = process.wait_exit(std::time::Duration::from_secs(10)).expect("the process stops");
        assert!(status.success(), "{status:?}: {}", process.logs());
    }
    let store = DynamoDbBudgetStore::new(dynamodb, table);
    let day = CounterKey::new("acme", None, Unit::Tokens, Period::Day, unix_now());
    let used = flexway::budget::BudgetStore::used(&store, &[day]).await.unwrap()[0];
    assert_eq!(used, answered, "the ledger holds every answered call, the killed process's included");
    assert_eq!(flexway::budget::BudgetStore::live_reservations(&store).await.unwrap(), 0);
}

/// A tenant's `requests_per_minute` holds across a fleet (SPEC §14): the window is a
/// counter of the shared table, reserved with the budgets in one conditional write,
/// so three processes serving a burst together never pass it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_processes_on_one_table_hold_a_tenants_requests_per_minute() {
    const RPM: usize = 7;
    let sdk = emulator::sdk().await;
    let dynamodb = aws_sdk_dynamodb::Client::new(&sdk);
    let logs = aws_sdk_cloudwatchlogs::Client::new(&sdk);
    let table = emulator::unique("flexway-fleet-rates");
    let group = format!("/flexway/{}", emulator::unique("fleet-rates"));
    DynamoDbBudgetStore::create_table(&dynamodb, &table).await.unwrap();
    logs.create_log_group().log_group_name(&group).send().await.unwrap();
    let model = FakeModel::start().await.unwrap();
    let yaml = fleet_config(&table, &group, &model).replace(
        &format!("    budgets: {{tokens_per_day: {CAP}}}\n"),
        &format!("    limits: {{requests_per_minute: {RPM}}}\n"),
    );
    assert!(yaml.contains("requests_per_minute"), "{yaml}");
    let env = emulator::process_env();
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let fleet = [
        Flexway::start_with_env(&yaml, &env),
        Flexway::start_with_env(&yaml, &env),
        Flexway::start_with_env(&yaml, &env),
    ];
    // The burst counts in one minute, the one read before it: one it ended past (the
    // emulator was slow) is tried again in a minute its calls have not touched.
    let (started, statuses) = loop {
        let second = unix_now() % 60;
        if second > 40 {
            tokio::time::sleep(std::time::Duration::from_secs(60 - second)).await;
        }
        let started = unix_now();
        let calls = (0..30).map(|i| fleet[i % 3].chat(KEY, hello("m")));
        let responses = futures_util::future::join_all(calls).await;
        let statuses: Vec<u16> = responses.iter().map(|r| r.status().as_u16()).collect();
        let ended = unix_now();
        if started / 60 == ended / 60 {
            break (started, statuses);
        }
        eprintln!("the burst ended in the next minute: tried again");
        tokio::time::sleep(std::time::Duration::from_secs(60 - ended % 60)).await;
    };
    let served = statuses.iter().filter(|s| **s == 200).count();
    assert!(statuses.iter().all(|s| *s == 200 || *s == 429), "{statuses:?}");
    assert_eq!(served, RPM, "three processes served {served} calls under a limit of {RPM}: {statuses:?}");
    let store = DynamoDbBudgetStore::new(dynamodb, table);
    let window = CounterKey::window("acme", None, Unit::Requests, started);
    let counted = flexway::budget::BudgetStore::used(&store, &[window]).await.unwrap()[0];
    assert_eq!(counted, RPM as u64, "the table's window counts every served call, once");
}
