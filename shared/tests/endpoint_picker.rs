//! The endpoint picker client (`routing::endpoint_picker`) against a fake `ext_proc` picker on
//! loopback: both ways a picker names endpoints, and each way it can fail.
#![cfg(test)]

use std::time::{Duration, Instant};

use fake_grpc::picker::{FakePicker, Picks};
use flexway::routing::endpoint_picker::{EndpointPicker, PickerError};

fn headers() -> http::HeaderMap {
    let mut headers = http::HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    headers.insert("x-flexway-model", "llama".parse().unwrap());
    headers
}

const BODY: &[u8] = br#"{"model":"llama","messages":[{"role":"user","content":"hi"}]}"#;

#[tokio::test]
async fn reads_the_endpoints_from_a_header_mutation_and_sends_the_call() {
    let fake = FakePicker::start(Picks::Header("10.0.0.7:8000, 10.0.0.8".into())).await.unwrap();
    let picker = EndpointPicker::new(&fake.url(), Duration::from_secs(5), 9000).unwrap();
    assert_eq!(
        picker.pick("/v1/chat/completions", &headers(), BODY).await.unwrap(),
        ["10.0.0.7:8000", "10.0.0.8:9000"]
    );
    let seen = fake.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body, BODY);
    assert!(seen[0].headers.contains(&("x-flexway-model".into(), b"llama".to_vec())), "{:?}", seen[0].headers);
    assert_eq!(
        seen[0].headers[..2],
        [(":method".into(), b"POST".to_vec()), (":path".into(), b"/v1/chat/completions".to_vec())]
    );
    // The channel is reused: a second call, a second stream.
    picker.pick("/v1/chat/completions", &headers(), b"{}").await.unwrap();
    assert_eq!(fake.seen().len(), 2);
}

#[tokio::test]
async fn reads_the_endpoints_from_the_envoy_lb_metadata() {
    let fake = FakePicker::start(Picks::Metadata("[fd00::1]:8000".into())).await.unwrap();
    let picker = EndpointPicker::new(&fake.url(), Duration::from_secs(5), 9000).unwrap();
    assert_eq!(picker.pick("/v1/chat/completions", &headers(), BODY).await.unwrap(), ["[fd00::1]:8000"]);
}

#[tokio::test]
async fn a_picker_that_fails_hangs_or_is_gone_is_an_error_in_bounded_time() {
    let failing = FakePicker::start(Picks::Fail).await.unwrap();
    let picker = EndpointPicker::new(&failing.url(), Duration::from_secs(5), 9000).unwrap();
    let error = picker.pick("/v1/chat/completions", &headers(), BODY).await.unwrap_err();
    assert!(matches!(&error, PickerError::Failed(m) if m.contains("failing")), "{error}");

    let hanging = FakePicker::start(Picks::Hang).await.unwrap();
    let picker = EndpointPicker::new(&hanging.url(), Duration::from_millis(300), 9000).unwrap();
    let started = Instant::now();
    assert_eq!(
        picker.pick("/v1/chat/completions", &headers(), BODY).await,
        Err(PickerError::Timeout(Duration::from_millis(300)))
    );
    assert!(started.elapsed() < Duration::from_secs(3));

    let gone = FakePicker::start(Picks::Fail).await.unwrap();
    let url = gone.url();
    drop(gone);
    tokio::time::sleep(Duration::from_millis(100)).await;
    let picker = EndpointPicker::new(&url, Duration::from_secs(2), 9000).unwrap();
    assert!(matches!(
        picker.pick("/v1/chat/completions", &headers(), BODY).await,
        Err(PickerError::Failed(_) | PickerError::Timeout(_))
    ));

    assert!(matches!(EndpointPicker::new("not a url", Duration::from_secs(1), 1), Err(PickerError::Url(..))));
}

#[tokio::test]
async fn an_answer_without_endpoints_or_with_names_is_refused() {
    let empty = FakePicker::start(Picks::Header(" ".into())).await.unwrap();
    let picker = EndpointPicker::new(&empty.url(), Duration::from_secs(5), 9000).unwrap();
    // A blank header names nothing, and the answer to the body is the last one.
    assert_eq!(picker.pick("/v1/chat/completions", &headers(), BODY).await, Err(PickerError::NoEndpoint));
    let named = FakePicker::start(Picks::Metadata("pod-a:8000".into())).await.unwrap();
    let picker = EndpointPicker::new(&named.url(), Duration::from_secs(5), 9000).unwrap();
    assert!(matches!(picker.pick("/v1/chat/completions", &headers(), BODY).await, Err(PickerError::BadEndpoint(_))));
}
