//! The operator's console at `/console` (SPEC §9), served by `flexway serve` only:
//! one read-only page, rendered here from [`crate::console::Overview`] with its
//! style inline and no script (nothing is fetched from elsewhere: an operator's
//! network may be closed), and the same figures as JSON for a script.
//!
//! Refused 404 unless `console.keys` is configured. A console key opens it, never a
//! tenant's: typed once into the sign-in form, which sets a session cookie
//! (`HttpOnly`, `SameSite=Strict`, at most 8 hours: an expiry and the key's hash
//! prefix, signed with this process's random secret, so sessions are per process and
//! end when the key is removed), or sent as `Authorization: Bearer` by a script. The
//! page never shows a key, a prompt or a completion: names and counters only.

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::extract::{Query, Request, State};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use hmac::{Hmac, Mac};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::error::render;
use crate::budget::period::unix_now;
use crate::console::{CapState, Overview, overview};
use crate::error::GatewayError;
use crate::gateway::Gateway;
use crate::identity::IdentityError;
use crate::metrics::McpTotals;
use crate::money::MicroEur;

/// The session cookie's name.
const COOKIE: &str = "flexway_console";
/// A session's longest life.
const SESSION_SECS: u64 = 8 * 3600;
/// A sign-in form's body is a key, not more.
const MAX_FORM_BYTES: usize = 4096;
/// No script, no frame, nothing from another origin; the style is inline.
const CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; form-action 'self'; \
                   frame-ancestors 'none'; base-uri 'none'";

/// `/console` (the page, or the sign-in form), `/console/data.json`,
/// `/console/session` (sign in) and `/console/sign-out`.
pub fn routes() -> Router<Arc<Gateway>> {
    Router::new()
        .route("/console", get(page))
        .route("/console/data.json", get(data))
        .route("/console/session", post(sign_in))
        .route("/console/sign-out", post(sign_out))
}

#[derive(serde::Deserialize, Default)]
struct View {
    #[serde(default)]
    q: String,
    #[serde(default)]
    page: Option<usize>,
}

/// Who is asking: a console key's holder, someone to sign in, or someone refused.
enum Access {
    Open,
    SignIn,
    Refused(Response),
}

fn access(gateway: &Gateway, headers: &HeaderMap, uri: &http::Uri) -> Access {
    let Some(console) = &gateway.config.console else {
        let path = uri.path().to_owned();
        return Access::Refused(render(&GatewayError::NotFound { method: "GET".into(), path }, true));
    };
    if let Some(bearer) = headers.get(header::AUTHORIZATION) {
        let key = bearer.to_str().ok().and_then(|v| v.strip_prefix("Bearer ")).unwrap_or_default();
        return if is_console_key(&console.keys, key) {
            Access::Open
        } else {
            Access::Refused(render(&GatewayError::Identity(IdentityError::UnknownKey), true))
        };
    }
    match session(headers) {
        Some(prefix) if console.keys.iter().any(|k| hex::encode(&k[..8]) == prefix) => Access::Open,
        _ => Access::SignIn,
    }
}

fn is_console_key(keys: &[[u8; 32]], key: &str) -> bool {
    let hash: [u8; 32] = Sha256::digest(key.trim().as_bytes()).into();
    keys.iter().fold(false, |found, k| found | bool::from(k.ct_eq(&hash)))
}

async fn page(State(gateway): State<Arc<Gateway>>, Query(view): Query<View>, request: Request) -> Response {
    match access(&gateway, request.headers(), request.uri()) {
        Access::Refused(response) => response,
        Access::SignIn => html(StatusCode::OK, &sign_in_form(None)),
        Access::Open => match overview(&gateway, &view.q, view.page.unwrap_or(1)).await {
            Ok(overview) => html(StatusCode::OK, &render_page(&overview, &view.q, &gateway.metrics.mcp_totals())),
            Err(e) => render(&GatewayError::from(e), true),
        },
    }
}

async fn data(State(gateway): State<Arc<Gateway>>, Query(view): Query<View>, request: Request) -> Response {
    match access(&gateway, request.headers(), request.uri()) {
        Access::Refused(response) => response,
        Access::SignIn => render(&GatewayError::Identity(IdentityError::MissingKey), true),
        Access::Open => match overview(&gateway, &view.q, view.page.unwrap_or(1)).await {
            Ok(overview) => axum::Json(overview).into_response(),
            Err(e) => render(&GatewayError::from(e), true),
        },
    }
}

/// The sign-in form's `key`: a console key sets the session cookie and goes to the
/// page; another (a tenant's included) is refused with the form again.
async fn sign_in(State(gateway): State<Arc<Gateway>>, request: Request) -> Response {
    let Some(console) = &gateway.config.console else {
        return render(&GatewayError::NotFound { method: "POST".into(), path: "/console/session".into() }, true);
    };
    let body = match axum::body::to_bytes(request.into_body(), MAX_FORM_BYTES).await {
        Ok(body) => body,
        Err(_) => return render(&GatewayError::BodyTooLarge { limit: MAX_FORM_BYTES as u64 }, true),
    };
    let key = form_value(&body, "key").unwrap_or_default();
    if !is_console_key(&console.keys, &key) {
        return html(StatusCode::UNAUTHORIZED, &sign_in_form(Some("That key does not open the console.")));
    }
    let hash: [u8; 32] = Sha256::digest(key.trim().as_bytes()).into();
    let expires = unix_now() + SESSION_SECS;
    let value = format!("{expires}.{}", hex::encode(&hash[..8]));
    let cookie = format!(
        "{COOKIE}={value}.{}; Path=/console; Max-Age={SESSION_SECS}; HttpOnly; SameSite=Strict",
        hex::encode(sign(&value))
    );
    let mut response = (StatusCode::SEE_OTHER, [(header::LOCATION, "/console")]).into_response();
    if let Ok(cookie) = HeaderValue::from_str(&cookie) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

async fn sign_out() -> Response {
    let cleared = format!("{COOKIE}=; Path=/console; Max-Age=0; HttpOnly; SameSite=Strict");
    let mut response = (StatusCode::SEE_OTHER, [(header::LOCATION, "/console")]).into_response();
    if let Ok(cookie) = HeaderValue::from_str(&cleared) {
        response.headers_mut().insert(header::SET_COOKIE, cookie);
    }
    response
}

/// This process's secret for signing sessions: random, never written anywhere.
fn sign(value: &str) -> [u8; 32] {
    static SECRET: OnceLock<[u8; 32]> = OnceLock::new();
    let secret = SECRET.get_or_init(rand::random);
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap_or_else(|_| unreachable!("HMAC takes any key"));
    mac.update(value.as_bytes());
    mac.finalize().into_bytes().into()
}

/// The key hash prefix of a valid, unexpired session cookie.
fn session(headers: &HeaderMap) -> Option<String> {
    let cookies = headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok());
    let value = cookies.flat_map(|v| v.split(';')).find_map(|c| c.trim().strip_prefix("flexway_console="))?;
    let (signed, mac) = value.rsplit_once('.')?;
    let (expires, prefix) = signed.split_once('.')?;
    let mac = hex::decode(mac).ok()?;
    if !bool::from(sign(signed).as_slice().ct_eq(&mac)) {
        return None;
    }
    let expires: u64 = expires.parse().ok()?;
    let now = unix_now();
    (now < expires && expires <= now + SESSION_SECS).then(|| prefix.to_owned())
}

/// The value of `name` in an `application/x-www-form-urlencoded` body.
fn form_value(body: &[u8], name: &str) -> Option<String> {
    let text = std::str::from_utf8(body).ok()?;
    let raw = text.split('&').find_map(|pair| pair.strip_prefix(name)?.strip_prefix('='))?;
    let mut out = Vec::with_capacity(raw.len());
    let mut bytes = raw.bytes();
    while let Some(b) = bytes.next() {
        match b {
            b'+' => out.push(b' '),
            b'%' => {
                let hex = [bytes.next()?, bytes.next()?];
                out.push(u8::from_str_radix(std::str::from_utf8(&hex).ok()?, 16).ok()?);
            }
            b => out.push(b),
        }
    }
    String::from_utf8(out).ok()
}

fn html(status: StatusCode, body: &str) -> Response {
    let mut response = (status, body.to_owned()).into_response();
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/html; charset=utf-8"));
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CSP));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    response
}

/// Text for HTML, escaped.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1d2330;background:#f6f7f9}\
header{background:#1d2330;color:#fff;padding:10px 20px;display:flex;gap:16px;align-items:center}\
header h1{font-size:17px;margin:0;flex:1}main{padding:12px 20px}section{background:#fff;border:1px solid #dde1e7;\
border-radius:6px;padding:10px 14px;margin:0 0 14px}h2{font-size:15px;margin:4px 0 8px}table{border-collapse:collapse;\
width:100%}th,td{text-align:left;padding:4px 8px;border-bottom:1px solid #eef0f3;vertical-align:middle}\
th{font-weight:600;color:#4a5261}td.n{text-align:right;font-variant-numeric:tabular-nums}.bar{width:140px;height:8px;\
background:#e8ebef;border-radius:4px;display:inline-block;margin-right:6px}.bar i{display:block;height:100%;\
border-radius:4px;background:#3b82f6}.soft i{background:#f59e0b}.exceeded i{background:#dc2626}.state{font-size:12px;\
padding:1px 6px;border-radius:8px;background:#e8ebef}.state.soft{background:#fef3c7}.state.exceeded,.state.open\
{background:#fee2e2}.banner{background:#fee2e2;border:1px solid #fca5a5;padding:8px 12px;border-radius:6px;\
margin:0 0 12px}.muted{color:#6b7280}form.inline{display:inline}input{font:inherit;padding:3px 6px}\
button{font:inherit;padding:3px 10px}svg{display:block}";

fn sign_in_form(message: Option<&str>) -> String {
    let message = message.map(|m| format!("<p class=\"banner\" role=\"alert\">{}</p>", esc(m))).unwrap_or_default();
    format!(
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Flexway console: sign in</title>\
         <meta name=\"viewport\" content=\"width=device-width\"><style>{STYLE}</style></head><body><header><h1>Flexway \
         console</h1></header><main><section><h2>Sign in</h2>{message}<form method=\"post\" action=\"/console/session\">\
         <label>Console key <input type=\"password\" name=\"key\" id=\"key\" autocomplete=\"current-password\" \
         required autofocus></label> <button type=\"submit\" id=\"sign-in\">Sign in</button></form><p class=\"muted\">\
         A console key, declared under <code>console.keys</code>; a tenant's key does not open it.</p></section></main>\
         </body></html>"
    )
}

fn render_page(overview: &Overview, filter: &str, mcp: &[McpTotals]) -> String {
    let mut out = String::with_capacity(16 * 1024 + overview.scopes.len() * 900);
    let _ = write!(
        out,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>Flexway console</title>\
         <meta name=\"viewport\" content=\"width=device-width\"><meta http-equiv=\"refresh\" content=\"30\">\
         <style>{STYLE}</style></head><body><header><h1>Flexway console</h1><span class=\"muted\">{}</span>\
         <form class=\"inline\" method=\"post\" action=\"/console/sign-out\"><button type=\"submit\">Sign out</button>\
         </form></header><main>",
        esc(&crate::audit::Timestamp::from_unix_millis(overview.at as i64 * 1000)
            .map(|t| t.to_string())
            .unwrap_or_default())
    );
    if !overview.alerts.is_empty() {
        let _ = write!(out, "<div class=\"banner\" id=\"alerts\" role=\"alert\"><strong>Caps reached:</strong> ");
        let listed: Vec<String> = overview
            .alerts
            .iter()
            .map(|a| {
                let who = match &a.agent {
                    Some(agent) => format!("{}/{}", a.tenant, agent),
                    None => a.tenant.clone(),
                };
                let what = if a.state == CapState::Exceeded { "hard cap" } else { "soft threshold" };
                format!("{} {} ({what})", esc(&who), a.budget)
            })
            .collect();
        out.push_str(&listed.join("; "));
        out.push_str("</div>");
    }
    chart(&mut out, &overview.calls_per_minute);
    tenants(&mut out, overview, filter);
    cache(&mut out, overview);
    rate_limited(&mut out, overview);
    mcp_servers(&mut out, mcp);
    backends(&mut out, overview);
    out.push_str("</main></body></html>");
    out
}

/// The last hour's calls per minute, as an inline SVG bar chart.
fn chart(out: &mut String, per_minute: &[u64]) {
    let max = per_minute.iter().copied().max().unwrap_or(0).max(1);
    let total: u64 = per_minute.iter().sum();
    let _ = write!(
        out,
        "<section id=\"activity\"><h2>Calls per minute, last hour <span class=\"muted\">({total} calls, at most \
         {max} a minute)</span></h2><svg width=\"600\" height=\"80\" viewBox=\"0 0 600 80\" role=\"img\" \
         aria-label=\"calls per minute\">"
    );
    for (i, calls) in per_minute.iter().enumerate() {
        let height = calls * 76 / max;
        let _ = write!(
            out,
            "<rect x=\"{}\" y=\"{}\" width=\"8\" height=\"{height}\" fill=\"#3b82f6\"><title>{} min ago: {calls}\
             </title></rect>",
            i * 10,
            78 - height,
            per_minute.len() - 1 - i
        );
    }
    out.push_str("<line x1=\"0\" y1=\"78\" x2=\"600\" y2=\"78\" stroke=\"#c4c9d1\"/></svg></section>");
}

fn tenants(out: &mut String, overview: &Overview, filter: &str) {
    let _ = write!(
        out,
        "<section id=\"tenants\"><h2>Tenants <span class=\"muted\">({} shown of {}, the closest to a cap first)\
         </span></h2><form method=\"get\" action=\"/console\"><input type=\"search\" name=\"q\" value=\"{}\" \
         placeholder=\"filter tenants\"> <button type=\"submit\">Filter</button></form><table><thead><tr><th>tenant\
         </th><th>agent</th><th>budget</th><th class=\"n\">used</th><th class=\"n\">limit</th><th></th><th>state</th>\
         <th class=\"n\">resets in</th></tr></thead><tbody>",
        overview.scopes.iter().filter(|s| s.agent.is_none()).count(),
        overview.tenants,
        esc(filter)
    );
    for scope in &overview.scopes {
        for (i, budget) in scope.budgets.iter().enumerate() {
            let (who, agent) = if i == 0 {
                (esc(&scope.tenant), esc(scope.agent.as_deref().unwrap_or("")))
            } else {
                (String::new(), String::new())
            };
            let amount = |value: u64| {
                if budget.is_money() { format!("{} €", MicroEur(value).to_eur_string()) } else { value.to_string() }
            };
            let limit = budget.limit.map(amount).unwrap_or_else(|| "no limit".into());
            let bar = match budget.limit {
                Some(_) => format!(
                    "<span class=\"bar {}\"><i style=\"width:{}%\"></i></span>{}%",
                    budget.state.as_str(),
                    budget.percent(),
                    budget.percent()
                ),
                None => String::new(),
            };
            let _ = write!(
                out,
                "<tr data-tenant=\"{}\" data-agent=\"{}\" data-budget=\"{}\" data-used=\"{}\"><td>{who}</td>\
                 <td>{agent}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{limit}</td><td>{bar}</td><td>\
                 <span class=\"state {}\">{}</span></td><td class=\"n\">{}</td></tr>",
                esc(&scope.tenant),
                esc(scope.agent.as_deref().unwrap_or("")),
                budget.budget,
                budget.used,
                budget.budget,
                amount(budget.used),
                budget.state.as_str(),
                budget.state.as_str(),
                left(budget.resets_in_secs),
            );
        }
    }
    out.push_str("</tbody></table>");
    if overview.pages > 1 {
        let q = esc(filter);
        out.push_str("<p>Page ");
        for page in 1..=overview.pages {
            if page == overview.page {
                let _ = write!(out, "<strong>{page}</strong> ");
            } else {
                let _ = write!(out, "<a href=\"/console?q={q}&amp;page={page}\">{page}</a> ");
            }
        }
        out.push_str("</p>");
    }
    out.push_str("</section>");
}

/// Days left in a period, or hours in its last day.
fn left(secs: u64) -> String {
    match secs {
        s if s >= 86_400 => format!("{} d", s.div_ceil(86_400)),
        s => format!("{} h", s.div_ceil(3600)),
    }
}

/// The response cache of this page's tenants, when any has a figure.
fn cache(out: &mut String, overview: &Overview) {
    if overview.cache.is_empty() {
        return;
    }
    out.push_str(
        "<section id=\"cache\"><h2>Response cache <span class=\"muted\">(this process, since it started; entries \
         as last counted)</span></h2><table><thead><tr><th>tenant</th><th class=\"n\">hits</th><th class=\"n\">\
         misses</th><th class=\"n\">hit rate</th><th class=\"n\">not looked up</th><th class=\"n\">stored</th>\
         <th class=\"n\">saved</th><th class=\"n\">entries</th></tr></thead><tbody>",
    );
    for row in &overview.cache {
        let rate = row.hit_percent().map_or_else(|| "–".to_owned(), |p| format!("{p:.1}%"));
        let entries = row.entries.map_or_else(|| "–".to_owned(), |n| n.to_string());
        let _ = write!(
            out,
            "<tr data-cache-tenant=\"{}\" data-saved=\"{}\" data-entries=\"{entries}\"><td>{}</td><td class=\"n\">\
             {}</td><td class=\"n\">{}</td><td class=\"n\">{rate}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{} €</td><td class=\"n\">{entries}</td></tr>",
            esc(&row.tenant),
            row.saved_micro_eur,
            esc(&row.tenant),
            row.hits,
            row.misses,
            row.skipped,
            row.stores,
            MicroEur(row.saved_micro_eur).to_eur_string(),
        );
    }
    out.push_str("</tbody></table></section>");
}

/// The calls this page's tenants' per-minute limits refused (SPEC §14), when any was.
fn rate_limited(out: &mut String, overview: &Overview) {
    if overview.rate_limited.is_empty() {
        return;
    }
    out.push_str(
        "<section id=\"rate-limited\"><h2>Refused by a per-minute limit <span class=\"muted\">(429 \
         rate_limit_exceeded, this process, since it started)</span></h2><table><thead><tr><th>tenant</th>\
         <th>holder</th><th>per minute</th><th class=\"n\">refused</th></tr></thead><tbody>",
    );
    for row in &overview.rate_limited {
        let _ = write!(
            out,
            "<tr data-limited-tenant=\"{}\" data-holder=\"{}\" data-kind=\"{}\" data-refused=\"{}\"><td>{}</td>\
             <td>{}</td><td>{}</td><td class=\"n\">{}</td></tr>",
            esc(&row.tenant),
            esc(&row.holder),
            esc(&row.kind),
            row.refused,
            esc(&row.tenant),
            esc(&row.holder),
            esc(&row.kind),
            row.refused,
        );
    }
    out.push_str("</tbody></table></section>");
}

/// The MCP servers' tool calls and what they were charged (SPEC §17), when any was
/// called.
fn mcp_servers(out: &mut String, totals: &[McpTotals]) {
    if totals.is_empty() {
        return;
    }
    out.push_str(
        "<section id=\"mcp\"><h2>MCP servers <span class=\"muted\">(tool calls, this process, since it started)\
         </span></h2><table><thead><tr><th>server</th><th class=\"n\">calls</th><th class=\"n\">no result</th>\
         <th class=\"n\">spent</th></tr></thead><tbody>",
    );
    for row in totals {
        let _ = write!(
            out,
            "<tr data-mcp-server=\"{}\" data-spent=\"{}\"><td>{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td>\
             <td class=\"n\">{} €</td></tr>",
            esc(&row.server),
            row.spent.0,
            esc(&row.server),
            row.calls,
            row.errors,
            row.spent.to_eur_string(),
        );
    }
    out.push_str("</tbody></table></section>");
}

fn backends(out: &mut String, overview: &Overview) {
    out.push_str(
        "<section id=\"backends\"><h2>Backends <span class=\"muted\">(this process, since it started)</span></h2>\
         <table><thead><tr><th>backend</th><th>kind</th><th class=\"n\">calls</th><th class=\"n\">cost</th>\
         <th class=\"n\">errors</th><th>breaker</th><th>provider quota (this minute)</th>\
         <th>members' load (queue, KV cache, in flight)</th></tr></thead><tbody>",
    );
    for b in &overview.backends {
        let rate = if b.calls == 0 {
            String::from("–")
        } else {
            format!("{:.1}%", b.errors as f64 * 100.0 / b.calls as f64)
        };
        let members: Vec<String> = b
            .members
            .iter()
            .map(|m| {
                let queue = m.queue.map_or("–".into(), |q| q.to_string());
                let kv = m.kv_cache_ppm.map_or("–".into(), |p| format!("{}%", p / 10_000));
                format!("{}: {queue}, {kv}, {}", esc(&m.backend), m.in_flight)
            })
            .collect();
        let quota: Vec<String> = b
            .quota
            .iter()
            .map(|q| {
                format!(
                    "<span data-quota=\"{}\" data-used=\"{}\">{}: {} of {}/min \
                     <span class=\"bar {}\"><i style=\"width:{}%\"></i></span>{}%</span>",
                    q.kind,
                    q.used,
                    q.kind,
                    q.used,
                    q.limit,
                    if q.used >= q.limit { "exceeded" } else { "ok" },
                    q.percent(),
                    q.percent()
                )
            })
            .collect();
        let _ = write!(
            out,
            "<tr data-backend=\"{}\" data-calls=\"{}\"><td>{}</td><td>{}</td><td class=\"n\">{}</td><td class=\"n\">\
             {} €</td><td class=\"n\">{} ({rate})</td><td><span class=\"state {}\">{}</span></td><td>{}</td>\
             <td>{}</td></tr>",
            esc(&b.backend),
            b.calls,
            esc(&b.backend),
            b.kind,
            b.calls,
            MicroEur(b.cost_micro_eur).to_eur_string(),
            b.errors,
            b.breaker,
            b.breaker,
            quota.join("<br>"),
            members.join("; ")
        );
    }
    out.push_str("</tbody></table></section>");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_a_form_value_percent_encoded() {
        assert_eq!(form_value(b"key=sk-a%2Bb+c&x=1", "key").as_deref(), Some("sk-a+b c"));
        assert_eq!(form_value(b"x=1", "key"), None);
        assert_eq!(form_value(b"key=%zz", "key"), None);
    }

    #[test]
    fn a_session_is_what_this_process_signed_and_not_expired() {
        let value = format!("{}.{}", unix_now() + 60, "0011223344556677");
        let mut headers = HeaderMap::new();
        let cookie = format!("other=1; {COOKIE}={value}.{}", hex::encode(sign(&value)));
        headers.insert(header::COOKIE, cookie.parse().unwrap());
        assert_eq!(session(&headers).as_deref(), Some("0011223344556677"));

        let forged = format!("{COOKIE}={value}.{}", hex::encode([0u8; 32]));
        headers.insert(header::COOKIE, forged.parse().unwrap());
        assert_eq!(session(&headers), None, "not signed here");
        let long = format!("{}.{}", unix_now() + SESSION_SECS + 60, "0011223344556677");
        headers.insert(header::COOKIE, format!("{COOKIE}={long}.{}", hex::encode(sign(&long))).parse().unwrap());
        assert_eq!(session(&headers), None, "longer than a session may live");
        let old = format!("{}.{}", unix_now() - 1, "0011223344556677");
        headers.insert(header::COOKIE, format!("{COOKIE}={old}.{}", hex::encode(sign(&old))).parse().unwrap());
        assert_eq!(session(&headers), None, "expired");
    }

    /// An overview of `tenants` tenants on one page, with nothing in any section.
    fn empty_overview(tenants: usize) -> Overview {
        Overview {
            at: 1_765_000_000,
            scopes: Vec::new(),
            tenants,
            page: 1,
            pages: 1,
            backends: Vec::new(),
            cache: Vec::new(),
            rate_limited: Vec::new(),
            calls_per_minute: vec![0; 60],
            alerts: Vec::new(),
        }
    }

    #[test]
    fn the_mcp_section_shows_each_server_s_calls_and_spend() {
        let overview = empty_overview(0);
        assert!(!render_page(&overview, "", &[]).contains("id=\"mcp\""), "no section without a call");
        let search = McpTotals { server: "<search>".into(), calls: 4, errors: 1, spent: MicroEur(3_500) };
        let page = render_page(&overview, "", &[search]);
        let row = "<tr data-mcp-server=\"&lt;search&gt;\" data-spent=\"3500\"><td>&lt;search&gt;</td>\
                   <td class=\"n\">4</td><td class=\"n\">1</td><td class=\"n\">0.003500 €</td></tr>";
        assert!(page.contains(row), "{page}");
    }

    #[test]
    fn the_cache_section_shows_each_tenant_s_savings_and_entries() {
        let row = |tenant: &str, hits, saved_micro_eur, entries| crate::console::CacheRow {
            tenant: tenant.into(),
            hits,
            misses: 1,
            skipped: 2,
            stores: 1,
            saved_micro_eur,
            entries,
        };
        let mut overview = empty_overview(2);
        assert!(!render_page(&overview, "", &[]).contains("id=\"cache\""), "no section without a figure");

        overview.cache = vec![row("acme", 3, 1_234_500, Some(42)), row("<globex>", 0, 0, None)];
        let page = render_page(&overview, "", &[]);
        let acme = "<tr data-cache-tenant=\"acme\" data-saved=\"1234500\" data-entries=\"42\"><td>acme</td>\
                    <td class=\"n\">3</td><td class=\"n\">1</td><td class=\"n\">75.0%</td><td class=\"n\">2</td>\
                    <td class=\"n\">1</td><td class=\"n\">1.234500 €</td><td class=\"n\">42</td></tr>";
        assert!(page.contains(acme), "{page}");
        let globex = "<tr data-cache-tenant=\"&lt;globex&gt;\" data-saved=\"0\" data-entries=\"–\"><td>&lt;globex&gt;\
                      </td><td class=\"n\">0</td><td class=\"n\">1</td><td class=\"n\">0.0%</td>";
        assert!(page.contains(globex), "{page}");
        assert!(page.find("id=\"cache\"") < page.find("id=\"backends\""), "after the tenants, before the backends");
    }

    #[test]
    fn the_rate_limit_section_shows_each_holder_s_refusals() {
        let mut overview = empty_overview(1);
        assert!(!render_page(&overview, "", &[]).contains("id=\"rate-limited\""), "no section without a refusal");
        overview.rate_limited = vec![crate::console::RateLimitedRow {
            tenant: "<acme>".into(),
            holder: "agent <acme>/bot".into(),
            kind: "tokens".into(),
            refused: 7,
        }];
        let page = render_page(&overview, "", &[]);
        let row = "<tr data-limited-tenant=\"&lt;acme&gt;\" data-holder=\"agent &lt;acme&gt;/bot\" data-kind=\"tokens\" \
                   data-refused=\"7\"><td>&lt;acme&gt;</td><td>agent &lt;acme&gt;/bot</td><td>tokens</td>\
                   <td class=\"n\">7</td></tr>";
        assert!(page.contains(row), "{page}");
        assert!(page.find("id=\"rate-limited\"") < page.find("id=\"backends\""), "before the backends");
    }

    #[test]
    fn names_are_escaped() {
        assert_eq!(esc("<a href='x'>&\""), "&lt;a href=&#39;x&#39;&gt;&amp;&quot;");
    }
}
