//! How often a semantic cache serves a paraphrase, and how often it serves the wrong
//! answer, per threshold, without and with the numbers-and-negations guard (SPEC §16).
//!
//! `cargo bench --bench cache_false_hits` — reads the labelled pairs of
//! `benches/cache-pairs.jsonl` (English and French; paraphrases, and near misses with a
//! number, a negation or an entity changed, or unrelated), embeds both sides, and
//! counts a pair as served when the cosine of the two embeddings reaches the
//! threshold, then when it also passes the guard (`flexway::cache::guard::of` equal):
//! what the cache's stores do. Prints two markdown tables: hit rate on paraphrases and
//! false-hit rate on the others per threshold and language, and the pairs served by
//! kind.
//!
//! The embeddings are the demo model's (`fake-embed-similar`:
//! `fake_model::similar::embedding`, a hashed bag of character trigrams), unless
//! `BENCH_EMBED_URL` names an OpenAI-compatible base URL (`https://…/v1`) with
//! `BENCH_EMBED_MODEL` (and `BENCH_EMBED_KEY`, a bearer token, if it needs one): then
//! that model's, 280 texts in calls of 64. `BENCH_THRESHOLDS` (comma-separated)
//! replaces the default 0.80, 0.85, 0.90, 0.95, 0.98.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use flexway::cache::{cosine, guard, unit};
use serde_json::{Value, json};

const PAIRS: &str = include_str!("cache-pairs.jsonl");
const THRESHOLDS: [f32; 5] = [0.80, 0.85, 0.90, 0.95, 0.98];
const KINDS: [&str; 5] = ["paraphrase", "number", "negation", "entity", "unrelated"];

/// One labelled pair, scored.
struct Pair {
    same: bool,
    kind: String,
    lang: String,
    cosine: f32,
    /// Both sides have the same guard.
    guarded: bool,
}

fn main() {
    let lines: Vec<Value> =
        PAIRS.lines().filter(|l| !l.trim().is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect();
    let text = |v: &Value, k: &str| v[k].as_str().unwrap().to_owned();
    let texts: Vec<String> = lines.iter().flat_map(|l| [text(l, "a"), text(l, "b")]).collect();
    let (model, vectors) = embed(&texts);
    let pairs: Vec<Pair> = lines
        .iter()
        .zip(vectors.chunks(2))
        .map(|(line, v)| Pair {
            same: line["same"].as_bool().unwrap(),
            kind: text(line, "kind"),
            lang: text(line, "lang"),
            cosine: cosine(&v[0], &v[1]),
            guarded: guard::of(&text(line, "a")) == guard::of(&text(line, "b")),
        })
        .collect();
    let thresholds: Vec<f32> = match std::env::var("BENCH_THRESHOLDS") {
        Ok(list) => list.split(',').map(|t| t.trim().parse().unwrap()).collect(),
        Err(_) => THRESHOLDS.to_vec(),
    };

    println!("{} pairs, embeddings of `{model}`\n", pairs.len());
    println!("| threshold | pairs | paraphrases served, no guard | with guard | false hits, no guard | with guard |");
    println!("|---|---|---|---|---|---|");
    for &t in &thresholds {
        for lang in ["en", "fr", "all"] {
            let of_lang: Vec<&Pair> = pairs.iter().filter(|p| lang == "all" || p.lang == lang).collect();
            let (same, other): (Vec<&Pair>, Vec<&Pair>) = of_lang.iter().partition(|p| p.same);
            println!(
                "| {t:.2} | {lang} | {} | {} | {} | {} |",
                rate(&same, |p| p.cosine >= t),
                rate(&same, |p| p.cosine >= t && p.guarded),
                rate(&other, |p| p.cosine >= t),
                rate(&other, |p| p.cosine >= t && p.guarded),
            );
        }
    }

    println!("\nPairs served by kind, English and French together (no guard → with guard):\n");
    let head: Vec<String> = thresholds.iter().map(|t| format!("{t:.2}")).collect();
    println!("| kind | pairs | same guard | cosine median | {} |", head.join(" | "));
    println!("|---|---|---|---|{}", "---|".repeat(thresholds.len()));
    for kind in KINDS {
        let of_kind: Vec<&Pair> = pairs.iter().filter(|p| p.kind == kind).collect();
        let served: Vec<String> = thresholds
            .iter()
            .map(|&t| {
                let bare = of_kind.iter().filter(|p| p.cosine >= t).count();
                let guarded = of_kind.iter().filter(|p| p.cosine >= t && p.guarded).count();
                format!("{bare} → {guarded}")
            })
            .collect();
        println!(
            "| {kind} | {} | {} | {:.2} | {} |",
            of_kind.len(),
            of_kind.iter().filter(|p| p.guarded).count(),
            median(of_kind.iter().map(|p| p.cosine).collect()),
            served.join(" | ")
        );
    }
}

/// `n/total (pct%)` of the pairs that `served` says are.
fn rate(pairs: &[&Pair], served: impl Fn(&Pair) -> bool) -> String {
    let n = pairs.iter().filter(|p| served(p)).count();
    format!("{:.1}% ({n}/{})", 100.0 * n as f64 / pairs.len().max(1) as f64, pairs.len())
}

fn median(mut values: Vec<f32>) -> f32 {
    values.sort_by(f32::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(0.0)
}

/// The model's name and the unit embedding of each text, in order.
fn embed(texts: &[String]) -> (String, Vec<Vec<f32>>) {
    let unit_or_zero = |v: Vec<f32>| {
        let len = v.len();
        unit(v).unwrap_or_else(|| vec![0.0; len])
    };
    let Ok(url) = std::env::var("BENCH_EMBED_URL") else {
        let vectors = texts.iter().map(|t| unit_or_zero(fake_model::similar::embedding(t))).collect();
        return ("fake-embed-similar".to_owned(), vectors);
    };
    let model = std::env::var("BENCH_EMBED_MODEL").expect("BENCH_EMBED_MODEL names the model of BENCH_EMBED_URL");
    let key = std::env::var("BENCH_EMBED_KEY").ok();
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let vectors = runtime.block_on(async {
        let client = reqwest::Client::new();
        let mut vectors = Vec::with_capacity(texts.len());
        for chunk in texts.chunks(64) {
            let mut request = client
                .post(format!("{}/embeddings", url.trim_end_matches('/')))
                .json(&json!({"model": model, "input": chunk}));
            if let Some(key) = &key {
                request = request.bearer_auth(key);
            }
            let response = request.send().await.unwrap();
            let status = response.status();
            let body: Value = response.json().await.unwrap();
            assert!(status.is_success(), "{status}: {body}");
            let mut data = body["data"].as_array().unwrap().clone();
            data.sort_by_key(|d| d["index"].as_u64());
            assert_eq!(data.len(), chunk.len(), "one embedding per input");
            for d in data {
                vectors.push(unit_or_zero(serde_json::from_value(d["embedding"].clone()).unwrap()));
            }
        }
        vectors
    });
    (model, vectors)
}
