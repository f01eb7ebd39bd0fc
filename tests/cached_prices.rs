//! Cost as the provider bills it (SPEC §3 "Price"): prompt tokens read from and
//! written to a provider's prompt cache priced at their own prices, streamed or not,
//! and named in the audit; the reservation stays at the full input price.
#![cfg(test)]
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use flexway_testkit::*;
use serde_json::{Value, json};

/// An Anthropic backend whose answers report 1024 prompt tokens read from the cache
/// and 2048 written to it (the fake's `cache` scenario), priced 10 € per million
/// input tokens, 1 € cached, 12.5 € written, 20 € output (or without the cache prices
/// when `cache_prices` is false).
fn cached_config(model: &FakeModel, cache_prices: bool) -> String {
    let extra = if cache_prices { ", cached_input_per_mtok_eur: 1, cache_write_per_mtok_eur: 12.5" } else { "" };
    config(&format!(
        "  default_backend: claude\n  backends:\n    claude:\n      kind: anthropic\n      url: \"http://{}/s/cache\"\n      \
         default_model: claude-test\n      price: {{input_per_mtok_eur: 10, output_per_mtok_eur: 20{extra}}}\n",
        model.addr()
    ))
}

/// Micro-euros for `tokens` at a whole `eur` per million: one µ€ a token a euro.
fn micro(tokens: u64, eur: u64) -> u64 {
    tokens * eur
}

#[tokio::test]
async fn cache_reads_and_writes_are_priced_as_the_provider_bills_them() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&cached_config(&model, true));
    let response = gw.chat(KEY, hello("claude-test")).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    let mut stream = hello("claude-test");
    stream["stream"] = json!(true);
    let (events, _) = sse_data(gw.chat(KEY, stream).await).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));

    for record in gw.records_until::<Value>(2).await {
        let (prompt, completion) =
            (record["prompt_tokens"].as_u64().unwrap(), record["completion_tokens"].as_u64().unwrap());
        assert_eq!(
            (record["cached_tokens"].as_u64(), record["cache_write_tokens"].as_u64()),
            (Some(1024), Some(2048)),
            "{record}"
        );
        assert!(prompt > 3072, "the prompt counts every token, cached ones included: {record}");
        let plain = prompt - 1024 - 2048;
        // 2048 written at 12.5 € a million: 25,600 µ€.
        let expected = micro(plain, 10) + micro(1024, 1) + 25_600 + micro(completion, 20);
        assert_eq!(record["cost_micro_eur"].as_u64(), Some(expected), "{record}");
    }
    // The answer a client reads carries Anthropic's usage translated: its prompt
    // tokens include the cached ones, as OpenAI's do.
    assert!(body["usage"]["prompt_tokens"].as_u64().unwrap() > 3072, "{body}");
}

#[tokio::test]
async fn without_cache_prices_cached_tokens_cost_the_input_price() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&cached_config(&model, false));
    assert_eq!(gw.chat(KEY, hello("claude-test")).await.status(), 200);
    let record = gw.records_until::<Value>(1).await.remove(0);
    let (prompt, completion) =
        (record["prompt_tokens"].as_u64().unwrap(), record["completion_tokens"].as_u64().unwrap());
    assert_eq!(record["cost_micro_eur"].as_u64(), Some(micro(prompt, 10) + micro(completion, 20)), "{record}");
    assert_eq!(record["cached_tokens"], 1024, "still named in the audit");
}

/// An OpenAI backend whose answers report half the prompt as
/// `prompt_tokens_details.cached_tokens` (the fake's `cache` scenario), priced 10 €
/// per million input tokens, 1 € cached, 20 € output.
#[tokio::test]
async fn openai_cached_tokens_are_priced_streamed_or_not() {
    let model = FakeModel::start().await.unwrap();
    let gw = Flexway::start(&config(&format!(
        "  default_backend: main\n  backends:\n    main:\n      url: \"http://{}/s/cache/v1\"\n      \
         price: {{input_per_mtok_eur: 10, output_per_mtok_eur: 20, cached_input_per_mtok_eur: 1}}\n",
        model.addr()
    )));
    let prompt = json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "one two three four five six seven eight"}]});
    assert_eq!(gw.chat(KEY, prompt.clone()).await.status(), 200);
    let mut stream = prompt;
    stream["stream"] = json!(true);
    let (events, _) = sse_data(gw.chat(KEY, stream).await).await;
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    for record in gw.records_until::<Value>(2).await {
        let (prompt, completion) =
            (record["prompt_tokens"].as_u64().unwrap(), record["completion_tokens"].as_u64().unwrap());
        let cached = prompt / 2;
        assert!(cached > 0, "{record}");
        assert_eq!(record["cached_tokens"].as_u64(), Some(cached), "{record}");
        assert_eq!(
            record["cost_micro_eur"].as_u64(),
            Some(micro(prompt - cached, 10) + micro(cached, 1) + micro(completion, 20)),
            "{record}"
        );
    }
}
