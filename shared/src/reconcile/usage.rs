//! The provider's usage as its exports and APIs write it (SPEC §9): a plain CSV
//! (`date,backend,model,input_tokens,output_tokens[,cost_eur]`, and optionally
//! `cached_tokens`, `cache_write_tokens`), the OpenAI organization usage API's pages
//! of buckets, or the Anthropic usage report's.
//!
//! Both sides count input as OpenAI does: every prompt token, the ones read from or
//! written to a prompt cache included. Anthropic reports them apart (uncached, cache
//! read, cache creation) and is summed here. A line, bucket or result that cannot be
//! read is listed where it is and why, never counted, never dropped in silence.

use jiff::Timestamp;
use jiff::civil::Date;
use jiff::tz::Offset;
use serde_json::Value;

use super::{ProviderRow, ProviderUsage, Tokens};
use crate::audit::report::{Unreadable, parse_date};
use crate::money::MicroEur;

/// The model of a provider's row that names none (an export not grouped by model).
pub const NO_MODEL: &str = "-";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UsageError {
    #[error("a provider's JSON export covers one backend: name it with --backend")]
    BackendNeeded,
    #[error("the CSV has no header line (date,backend,model,input_tokens,output_tokens[,cost_eur])")]
    NoHeader,
    #[error("the CSV's header lacks {0}")]
    MissingColumn(&'static str),
}

/// Reads an export file's bytes: JSON (one page, an array of pages, or a page per
/// line) when it starts with `{` or `[`, CSV otherwise. `backend` names the backend a
/// JSON export (or a CSV without a `backend` column) covers.
pub fn read(bytes: &[u8], backend: Option<&str>) -> Result<ProviderUsage, UsageError> {
    let json = bytes.iter().find(|b| !b.is_ascii_whitespace()).is_some_and(|b| matches!(b, b'{' | b'['));
    if json {
        let backend = backend.ok_or(UsageError::BackendNeeded)?;
        Ok(read_json(bytes, backend))
    } else {
        read_csv(bytes, backend)
    }
}

fn read_json(bytes: &[u8], backend: &str) -> ProviderUsage {
    let mut usage = ProviderUsage::default();
    usage.backends.insert(backend.to_owned());
    match serde_json::from_slice::<Value>(bytes) {
        Ok(Value::Array(pages)) => {
            for (i, page) in pages.iter().enumerate() {
                read_page(page, &format!("page {}", i + 1), backend, &mut usage);
            }
        }
        Ok(page) => read_page(&page, "page 1", backend, &mut usage),
        // Not one document: a page per line (JSONL), each read on its own.
        Err(_) => {
            for (i, line) in bytes.split(|b| *b == b'\n').enumerate() {
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                let at = format!("line {}", i + 1);
                match serde_json::from_slice::<Value>(line) {
                    Ok(page) => read_page(&page, &at, backend, &mut usage),
                    Err(e) => usage.unreadable.push(Unreadable { at, why: format!("not JSON: {e}") }),
                }
            }
        }
    }
    usage
}

/// One page of an OpenAI or Anthropic usage answer: `{data: [bucket]}`, a bucket
/// `{start_time | starting_at, results: [result]}`. The results of the day go to
/// `usage` as rows of `backend`.
pub fn read_page(page: &Value, at: &str, backend: &str, usage: &mut ProviderUsage) {
    let Some(buckets) = page.get("data").and_then(Value::as_array) else {
        usage.unreadable.push(Unreadable { at: at.to_owned(), why: "no `data` list of buckets".into() });
        return;
    };
    for (b, bucket) in buckets.iter().enumerate() {
        let at = format!("{at}, bucket {}", b + 1);
        let date = match bucket_date(bucket) {
            Ok(date) => date,
            Err(why) => {
                usage.unreadable.push(Unreadable { at, why });
                continue;
            }
        };
        let Some(results) = bucket.get("results").and_then(Value::as_array) else {
            usage.unreadable.push(Unreadable { at, why: "no `results` list".into() });
            continue;
        };
        for (r, result) in results.iter().enumerate() {
            match result_tokens(result) {
                Ok(tokens) => {
                    let model = result.get("model").and_then(Value::as_str).unwrap_or(NO_MODEL).to_owned();
                    usage.rows.push(ProviderRow { date, backend: backend.to_owned(), model, tokens, cost: None });
                }
                Err(why) => usage.unreadable.push(Unreadable { at: format!("{at}, result {}", r + 1), why }),
            }
        }
    }
}

/// A bucket's UTC day: OpenAI's `start_time` (Unix seconds) or Anthropic's
/// `starting_at` (RFC 3339).
fn bucket_date(bucket: &Value) -> Result<Date, String> {
    let timestamp = if let Some(start) = bucket.get("start_time") {
        let seconds = start.as_i64().ok_or_else(|| format!("start_time {start} is not Unix seconds"))?;
        Timestamp::from_second(seconds).map_err(|e| format!("start_time {seconds}: {e}"))?
    } else if let Some(start) = bucket.get("starting_at") {
        let text = start.as_str().ok_or_else(|| format!("starting_at {start} is not a string"))?;
        text.parse::<Timestamp>().map_err(|e| format!("starting_at {text:?}: {e}"))?
    } else {
        return Err("neither `start_time` (OpenAI) nor `starting_at` (Anthropic)".into());
    };
    Ok(Offset::UTC.to_datetime(timestamp).date())
}

/// A result's tokens: Anthropic's (`uncached_input_tokens` and the cache's counts,
/// summed into the input) or OpenAI's (`input_tokens`, cached ones included).
fn result_tokens(result: &Value) -> Result<Tokens, String> {
    let count = |value: Option<&Value>, name: &str| -> Result<u64, String> {
        match value {
            None | Some(Value::Null) => Ok(0),
            Some(v) => v.as_u64().ok_or_else(|| format!("{name} {v} is not a count of tokens")),
        }
    };
    let field = |name: &str| count(result.get(name), name);
    if result.get("uncached_input_tokens").is_some() {
        let creation = result.get("cache_creation");
        let written = match creation {
            Some(object @ Value::Object(_)) => {
                count(object.get("ephemeral_5m_input_tokens"), "ephemeral_5m_input_tokens")?
                    .saturating_add(count(object.get("ephemeral_1h_input_tokens"), "ephemeral_1h_input_tokens")?)
            }
            _ => field("cache_creation_5m_input_tokens")?.saturating_add(field("cache_creation_1h_input_tokens")?),
        };
        let read = field("cache_read_input_tokens")?;
        let input = field("uncached_input_tokens")?.saturating_add(read).saturating_add(written);
        return Ok(Tokens { input, output: field("output_tokens")?, cached: read, cache_write: written });
    }
    if result.get("input_tokens").is_none() {
        return Err("neither `input_tokens` (OpenAI) nor `uncached_input_tokens` (Anthropic)".into());
    }
    Ok(Tokens {
        input: field("input_tokens")?,
        output: field("output_tokens")?,
        cached: field("input_cached_tokens")?,
        cache_write: 0,
    })
}

/// A plain CSV, with a header naming its columns (in any order): `date`, `backend`
/// (or `--backend`), `model`, `input_tokens`, `output_tokens`, and optionally
/// `cost_eur`, `cached_tokens`, `cache_write_tokens`.
fn read_csv(bytes: &[u8], backend: Option<&str>) -> Result<ProviderUsage, UsageError> {
    let mut usage = ProviderUsage::default();
    let mut lines = bytes.split(|b| *b == b'\n').enumerate().filter(|(_, l)| !l.iter().all(u8::is_ascii_whitespace));
    let (_, header) = lines.next().ok_or(UsageError::NoHeader)?;
    let header = std::str::from_utf8(header).ok().and_then(|h| fields(h).ok()).ok_or(UsageError::NoHeader)?;
    let column = |name: &str| header.iter().position(|h| h.trim().eq_ignore_ascii_case(name));
    let required = |name: &'static str| column(name).ok_or(UsageError::MissingColumn(name));
    let (date, model, input, output) =
        (required("date")?, required("model")?, required("input_tokens")?, required("output_tokens")?);
    let backend_column = column("backend");
    if backend_column.is_none() && backend.is_none() {
        return Err(UsageError::MissingColumn("backend (or name it with --backend)"));
    }
    let (cost, cached, cache_write) = (column("cost_eur"), column("cached_tokens"), column("cache_write_tokens"));
    if let Some(backend) = backend {
        usage.backends.insert(backend.to_owned());
    }
    for (i, line) in lines {
        let at = format!("line {}", i + 1);
        let row = std::str::from_utf8(line).map_err(|_| "not UTF-8".to_owned()).and_then(|line| {
            let values = fields(line)?;
            let get = |i: usize| values.get(i).map(|v| v.trim()).unwrap_or_default();
            let tokens = |i: Option<usize>, name: &str| -> Result<u64, String> {
                let Some(i) = i else { return Ok(0) };
                let text = get(i);
                if text.is_empty() && name.starts_with("cache") {
                    return Ok(0);
                }
                text.parse().map_err(|_| format!("{name} {text:?} is not a count of tokens"))
            };
            let row = ProviderRow {
                date: parse_date(get(date)).ok_or_else(|| format!("date {:?} is not YYYY-MM-DD", get(date)))?,
                backend: match backend_column {
                    Some(i) if !get(i).is_empty() => get(i).to_owned(),
                    _ => backend.ok_or("no backend named")?.to_owned(),
                },
                model: match get(model) {
                    "" => NO_MODEL.to_owned(),
                    name => name.to_owned(),
                },
                tokens: Tokens {
                    input: tokens(Some(input), "input_tokens")?,
                    output: tokens(Some(output), "output_tokens")?,
                    cached: tokens(cached, "cached_tokens")?,
                    cache_write: tokens(cache_write, "cache_write_tokens")?,
                },
                cost: match cost.map(get) {
                    None | Some("") => None,
                    Some(text) => Some(MicroEur::parse_eur(text).map_err(|e| format!("cost_eur: {e}"))?),
                },
            };
            Ok(row)
        });
        match row {
            Ok(row) => {
                usage.backends.insert(row.backend.clone());
                usage.rows.push(row);
            }
            Err(why) => usage.unreadable.push(Unreadable { at, why }),
        }
    }
    Ok(usage)
}

/// A CSV line's fields (RFC 4180: quoted fields, doubled quotes), the line break
/// trimmed.
fn fields(line: &str) -> Result<Vec<String>, String> {
    let line = line.trim_end_matches(['\r', '\n']);
    let mut out = Vec::new();
    let mut field = String::new();
    let mut chars = line.chars().peekable();
    let mut quoted = false;
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            (true, '"') => quoted = false,
            (false, '"') if field.trim().is_empty() => {
                field.clear();
                quoted = true;
            }
            (false, ',') => out.push(std::mem::take(&mut field)),
            (_, c) => field.push(c),
        }
    }
    if quoted {
        return Err("a quoted field is not closed".into());
    }
    out.push(field);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn day(text: &str) -> Date {
        parse_date(text).unwrap_or_default()
    }

    #[test]
    fn a_plain_csv_reads_by_its_header_with_optional_columns() {
        let csv = "date,backend,model,input_tokens,output_tokens,cost_eur,cached_tokens\n\
                   2026-11-02,openai,gpt-4o,1000,200,0.0125,300\n\
                   2026-11-02,openai,\"gpt,odd\",10,2,,\n";
        let usage = read(csv.as_bytes(), None).unwrap_or_default();
        assert_eq!(usage.unreadable, vec![]);
        assert_eq!(usage.rows.len(), 2);
        assert_eq!(usage.rows[0].tokens, Tokens { input: 1000, output: 200, cached: 300, cache_write: 0 });
        assert_eq!(usage.rows[0].cost, Some(MicroEur(12_500)));
        assert_eq!((usage.rows[1].model.as_str(), usage.rows[1].cost), ("gpt,odd", None));
        assert!(usage.backends.contains("openai"));
    }

    #[test]
    fn unreadable_csv_lines_are_listed_and_the_rest_counted() {
        let csv = "date,model,input_tokens,output_tokens\n2026-11-02,m,1,2\n2026-13-40,m,1,2\n2026-11-03,m,-4,2\n";
        let usage = read(csv.as_bytes(), Some("b")).unwrap_or_default();
        assert_eq!(usage.rows.len(), 1);
        let at: Vec<&str> = usage.unreadable.iter().map(|u| u.at.as_str()).collect();
        assert_eq!(at, ["line 3", "line 4"]);
        assert_eq!(read(b"date,model\n", Some("b")).err(), Some(UsageError::MissingColumn("input_tokens")));
        assert!(matches!(read(b"date,model,input_tokens,output_tokens\n", None), Err(UsageError::MissingColumn(_))));
    }

    #[test]
    fn openai_buckets_count_cached_tokens_inside_the_input() {
        let page = json!({"object": "page", "has_more": false, "next_page": null, "data": [{
            "object": "bucket", "start_time": 1_793_577_600, "end_time": 1_793_664_000,
            "results": [{"object": "organization.usage.completions.result", "input_tokens": 1000,
                         "output_tokens": 500, "input_cached_tokens": 800, "num_model_requests": 5,
                         "model": "gpt-4o-mini-2024-07-18"}]}]});
        let usage = read(page.to_string().as_bytes(), Some("openai")).unwrap_or_default();
        assert_eq!(usage.unreadable, vec![]);
        let row = &usage.rows[0];
        assert_eq!((row.date, row.model.as_str()), (day("2026-11-02"), "gpt-4o-mini-2024-07-18"));
        assert_eq!(row.tokens, Tokens { input: 1000, output: 500, cached: 800, cache_write: 0 });
        assert_eq!(read(page.to_string().as_bytes(), None).err(), Some(UsageError::BackendNeeded));
    }

    #[test]
    fn anthropic_results_sum_uncached_read_and_written_input() {
        let page = json!({"has_more": false, "next_page": null, "data": [{
            "starting_at": "2026-11-02T00:00:00Z", "ending_at": "2026-11-03T00:00:00Z",
            "results": [{"uncached_input_tokens": 1500, "cache_read_input_tokens": 200,
                         "cache_creation": {"ephemeral_5m_input_tokens": 500, "ephemeral_1h_input_tokens": 1000},
                         "output_tokens": 500, "model": "claude-sonnet-4-20250514"},
                        {"output_tokens": 1}]}]});
        let usage = read(page.to_string().as_bytes(), Some("claude")).unwrap_or_default();
        assert_eq!(usage.rows[0].tokens, Tokens { input: 3200, output: 500, cached: 200, cache_write: 1500 });
        assert_eq!(usage.unreadable.len(), 1, "a result without input is listed");
        assert_eq!(usage.unreadable[0].at, "page 1, bucket 1, result 2");
    }

    #[test]
    fn pages_read_from_an_array_or_one_per_line() {
        let page = |day: &str| json!({"data": [{"starting_at": day, "results": [{"uncached_input_tokens": 1, "output_tokens": 1, "model": "m"}]}]});
        let array = json!([page("2026-11-01T00:00:00Z"), page("2026-11-02T00:00:00Z")]).to_string();
        assert_eq!(read(array.as_bytes(), Some("b")).unwrap_or_default().rows.len(), 2);
        let lines = format!("{}\n{{cut\n{}\n", page("2026-11-01T00:00:00Z"), page("2026-11-02T00:00:00Z"));
        let usage = read(lines.as_bytes(), Some("b")).unwrap_or_default();
        assert_eq!(usage.rows.len(), 2);
        assert_eq!(usage.unreadable.iter().map(|u| u.at.as_str()).collect::<Vec<_>>(), ["line 2"]);
    }
}
