//! `flexway reconcile --fetch`: the provider's usage read from its own API with an
//! admin key (`usage_api` on a backend), day buckets grouped by model, every page
//! followed. OpenAI: `GET /v1/organization/usage/{completions,embeddings}` (Bearer,
//! `start_time`/`end_time` in Unix seconds, `page` = the previous `next_page`).
//! Anthropic: `GET /v1/organizations/usage_report/messages` (`x-api-key`,
//! `anthropic-version`, `starting_at`/`ending_at` in RFC 3339, `page` likewise).

use std::time::Duration;

use jiff::civil::Date;
use jiff::tz::Offset;
use serde_json::Value;

use super::ProviderUsage;
use super::usage::read_page;
use crate::config::{UsageApi, UsageApiKind};
use crate::secret::Secret;

/// Pages of 31 daily buckets (both APIs' maximum for `1d`).
const PAGE_DAYS: &str = "31";
/// A run that pages this often is looping on a cursor, not reading a month.
const MAX_PAGES: usize = 1000;
const TIMEOUT: Duration = Duration::from_secs(60);
const ANTHROPIC_VERSION: &str = "2023-06-01";

#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error("{backend}: {url}: {reason}")]
    Http { backend: String, url: String, reason: String },
    #[error("{backend}: {url}: the API answered {status}: {body}")]
    Status { backend: String, url: String, status: u16, body: String },
    #[error("{backend}: {url}: more than {MAX_PAGES} pages, or a next_page that repeats: stopped")]
    Paging { backend: String, url: String },
}

/// The usage of `backend` on the days `from..=to` (UTC), every page read.
pub async fn fetch(
    backend: &str,
    api: &UsageApi,
    key: &Secret,
    from: Date,
    to: Date,
) -> Result<ProviderUsage, FetchError> {
    let client = reqwest::Client::builder()
        .timeout(TIMEOUT)
        .user_agent(crate::call::headers::USER_AGENT)
        .build()
        .map_err(|e| FetchError::Http { backend: backend.into(), url: api.url.clone(), reason: e.to_string() })?;
    let start = Offset::UTC.to_timestamp(from.at(0, 0, 0, 0));
    let end = to.tomorrow().ok().and_then(|next| Offset::UTC.to_timestamp(next.at(0, 0, 0, 0)).ok());
    let (Ok(start), Some(end)) = (start, end) else {
        return Err(FetchError::Http {
            backend: backend.into(),
            url: api.url.clone(),
            reason: "dates out of range".into(),
        });
    };
    let mut usage = ProviderUsage::default();
    usage.backends.insert(backend.to_owned());
    match api.kind {
        UsageApiKind::Openai => {
            let (start, end) = (start.as_second().to_string(), end.as_second().to_string());
            for path in ["/v1/organization/usage/completions", "/v1/organization/usage/embeddings"] {
                let query = [("start_time", start.as_str()), ("end_time", end.as_str()), ("group_by", "model")];
                let auth = [("authorization", format!("Bearer {}", key.expose()))];
                pages(&client, backend, &format!("{}{path}", api.url), &query, &auth, &mut usage).await?;
            }
        }
        UsageApiKind::Anthropic => {
            let (start, end) = (start.to_string(), end.to_string());
            let query = [("starting_at", start.as_str()), ("ending_at", end.as_str()), ("group_by[]", "model")];
            let auth = [("x-api-key", key.expose().to_owned()), ("anthropic-version", ANTHROPIC_VERSION.to_owned())];
            let url = format!("{}/v1/organizations/usage_report/messages", api.url);
            pages(&client, backend, &url, &query, &auth, &mut usage).await?;
        }
    }
    Ok(usage)
}

/// Reads `url`'s pages into `usage` while `has_more` says so.
async fn pages(
    client: &reqwest::Client,
    backend: &str,
    url: &str,
    query: &[(&str, &str)],
    headers: &[(&str, String)],
    usage: &mut ProviderUsage,
) -> Result<(), FetchError> {
    let http = |reason: String| FetchError::Http { backend: backend.into(), url: url.into(), reason };
    let mut cursor: Option<String> = None;
    for n in 1..=MAX_PAGES {
        let mut request = client.get(url).query(query).query(&[("bucket_width", "1d"), ("limit", PAGE_DAYS)]);
        if let Some(page) = &cursor {
            request = request.query(&[("page", page)]);
        }
        for (name, value) in headers {
            request = request.header(*name, value);
        }
        let response = request.send().await.map_err(|e| http(e.without_url().to_string()))?;
        let status = response.status();
        let body = response.bytes().await.map_err(|e| http(e.without_url().to_string()))?;
        if !status.is_success() {
            let body = String::from_utf8_lossy(&body[..body.len().min(300)]).into_owned();
            return Err(FetchError::Status { backend: backend.into(), url: url.into(), status: status.as_u16(), body });
        }
        let page: Value = serde_json::from_slice(&body).map_err(|e| http(format!("page {n} is not JSON: {e}")))?;
        read_page(&page, &format!("{url}, page {n}"), backend, usage);
        let next = page.get("next_page").and_then(Value::as_str).filter(|_| page["has_more"] == Value::Bool(true));
        match next {
            None => return Ok(()),
            Some(next) if cursor.as_deref() == Some(next) => break,
            Some(next) => cursor = Some(next.to_owned()),
        }
    }
    Err(FetchError::Paging { backend: backend.into(), url: url.into() })
}

/// Pushes the drift (Prometheus text) to a Pushgateway: `PUT {url}/metrics/job/
/// flexway_reconcile` (or to `url` itself when it already names a job), which
/// replaces the job's previous values.
pub async fn push(url: &str, text: String) -> Result<(), String> {
    let url = url.trim_end_matches('/');
    let url =
        if url.contains("/metrics/job/") { url.to_owned() } else { format!("{url}/metrics/job/flexway_reconcile") };
    let client = reqwest::Client::builder().timeout(TIMEOUT).build().map_err(|e| e.to_string())?;
    let response = client
        .put(&url)
        .header("content-type", "text/plain; version=0.0.4")
        .body(text)
        .send()
        .await
        .map_err(|e| format!("{url}: {}", e.without_url()))?;
    match response.status() {
        status if status.is_success() => Ok(()),
        status => Err(format!("{url}: the Pushgateway answered {status}")),
    }
}

/// Why the usage APIs could not all be read.
#[derive(Debug, thiserror::Error)]
pub enum FetchAllError {
    #[error("{0} declares a `usage_api` to fetch")]
    NoneDeclared(String),
    #[error("ai.backends.{backend}.usage_api.secret: {source}")]
    Secret { backend: String, source: crate::secret::SecretError },
    #[error(transparent)]
    Fetch(#[from] FetchError),
}

/// The usage of every backend of `config` with a `usage_api` (or of `only`), each
/// admin key resolved with `secrets`, on the days `from..=to`: what `flexway
/// reconcile --fetch` and the serverless shape's reconcile function read.
pub async fn fetch_all(
    config: &crate::config::Config,
    only: Option<&str>,
    secrets: &dyn crate::secret::SecretSource,
    from: Date,
    to: Date,
) -> Result<ProviderUsage, FetchAllError> {
    let apis: Vec<(&str, &UsageApi)> = config
        .ai
        .backends
        .iter()
        .filter(|(name, _)| only.is_none_or(|only| only == name.as_str()))
        .filter_map(|(name, backend)| Some((name.as_str(), backend.usage_api.as_ref()?)))
        .collect();
    if apis.is_empty() {
        return Err(FetchAllError::NoneDeclared(
            only.map_or_else(|| "no backend".to_owned(), |b| format!("backend {b}")),
        ));
    }
    let mut usage = ProviderUsage::default();
    for (backend, api) in apis {
        let key = secrets
            .resolve(&api.secret)
            .await
            .map_err(|source| FetchAllError::Secret { backend: backend.to_owned(), source })?;
        usage.extend(fetch(backend, api, &key, from, to).await?);
    }
    Ok(usage)
}
