//! Streams through the real `flexway` binary: 10,000 concurrent SSE streams (memory,
//! stalls), and the time Flexway adds to a stream's first byte.
//!
//! `cargo bench --bench streams` — starts the fake model server in-process (each
//! stream: 20 chunks, `BENCH_CHUNK_MS` apart, 500 by default) and `flexway serve`
//! (release build) as its own process with the in-memory ledger and a file audit, then:
//! 1. first byte, one stream at a time (unpaced backend), `BENCH_FIRST_BYTES` streams
//!    (200 by default) straight to the fake server, as many through Flexway and, when
//!    nginx is installed, as many through a bare nginx `proxy_pass` hop (unbuffered,
//!    kept-alive upstream connections), taken in turn: p50/p99 of each and what each
//!    hop adds to the direct figures, the nginx hop being the floor a proxy pays on
//!    the machine;
//! 2. `BENCH_STREAMS` (10,000 by default) streams at once through Flexway:
//!    completion, the longest gap between two chunks of any stream (the clients ask
//!    for the usage chunk, so every event is one pace after the one before and a
//!    stall shows past one pace; a client who does not ask waits two paces before
//!    `[DONE]` from this backend, which paces its usage chunk like the others while
//!    the gateway keeps it back), the gateway process's peak resident memory (VmHWM)
//!    and the CPU time it used meanwhile.
//!
//! The concurrent streams come over HTTP/2, 100 to a connection (as an SDK with
//! HTTP/2 sends them), and each goes to the backend on a connection of its own
//! (HTTP/1.1): the gateway holds 10,000 upstream sockets, the bench process 10,000 of
//! the fake server's, under a limit of 20,000 open files a process that
//! HTTP/1.1 on both sides would pass.
//! 3. the same streams to the fake server behind TLS offering HTTP/2 (ALPN `h2`, as
//!    hosted models' APIs do), allowing `BENCH_H2_MAX_STREAMS` streams a connection
//!    (250 by default, Go's servers'), through a second `flexway serve`: the calls
//!    share connections, more of them as the calls in flight need. `BENCH_H2=0`
//!    skips it; `BENCH_TLS_ALPN=http/1.1` has the backend offer HTTP/1.1 instead
//!    (a TLS connection a stream, through the gateway's own HTTP/1.1 client).
//!
//! Figures are printed, never asserted.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::panic)]

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

mod common;

use common::pct;
use fake_model::{FakeModel, Scenario};
use futures_util::StreamExt;
use sha2::{Digest, Sha256};

const KEY: &str = "sk-bench";
/// A tenant whose backend answers without pacing, for the first-byte measurement.
const QUICK_KEY: &str = "sk-bench-quick";

/// HTTP/2 streams a client connection carries (the gateway accepts 200).
const STREAMS_PER_CONNECTION: usize = 100;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn main() {
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    runtime.block_on(run());
}

async fn run() {
    let model = FakeModel::start().await.unwrap();
    let chunk_ms = env_or("BENCH_CHUNK_MS", 500);
    let concurrent = env_or("BENCH_STREAMS", 10_000) as usize;
    let paced =
        model.scenario_url(&Scenario { chunks: Some(20), chunk_delay_ms: Some(chunk_ms), ..Default::default() });
    let yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: audit.jsonl}}\ntenants:\n  bench:\n    keys: [{{sha256: {}}}]\n  quick:\n    keys: [{{sha256: {}}}]\n    backend: fast\nai:\n  default_backend: paced\n  backends:\n    paced: {{url: \"{paced}\"}}\n    fast: {{url: \"{}\"}}\n",
        hex::encode(Sha256::digest(KEY)),
        hex::encode(Sha256::digest(QUICK_KEY)),
        model.url()
    );
    let process = common::Gateway::start(&yaml);
    let gateway = process.url.clone();
    let client = reqwest::Client::builder().pool_max_idle_per_host(2000).build().unwrap();

    let count = env_or("BENCH_FIRST_BYTES", 200).max(1) as usize;
    let hop = NginxHop::start(model.addr());
    let mut targets = vec![("direct", model.url()), ("gateway", gateway.clone())];
    if let Some(hop) = &hop {
        targets.push(("nginx hop", hop.url.clone()));
    }
    let times = first_bytes(&client, &targets, count).await;
    println!("first byte of a stream, one at a time, {count} streams each, in turn");
    for ((name, _), times) in targets.iter().zip(&times) {
        println!("  {name:<10} p50 {:>7.1} µs  p99 {:>7.1} µs", pct(times, 50.0), pct(times, 99.0));
    }
    let direct = &times[0];
    for ((name, _), via) in targets.iter().zip(&times).skip(1) {
        let added = |p| pct(via, p) - pct(direct, p);
        println!("  added by the {name:<10} p50 {:>7.1} µs  p99 {:>7.1} µs", added(50.0), added(99.0));
    }
    if let [_, via, hop] = &times[..] {
        let over = |p| pct(via, p) - pct(hop, p);
        println!("  the gateway over the nginx hop  p50 {:>7.1} µs  p99 {:>7.1} µs", over(50.0), over(99.0));
    }
    drop(hop);

    let cpu = process.cpu_seconds();
    let run = concurrently(&gateway, KEY, concurrent).await;
    println!("{concurrent} concurrent streams of 20 chunks {chunk_ms} ms apart through the gateway");
    run.print(chunk_ms);
    println!("  gateway process peak memory: {}", process.peak_memory());
    println!("  gateway CPU time for them: {:.2} s", process.cpu_seconds() - cpu);
    drop(process);

    // The same streams to a backend that speaks HTTP/2 (TLS, ALPN), as hosted models'
    // APIs do: the calls share each serving thread's connection to it.
    if std::env::var("BENCH_H2").is_ok_and(|v| v == "0") {
        return;
    }
    let max_streams = env_or("BENCH_H2_MAX_STREAMS", 250) as u32;
    let alpn = std::env::var("BENCH_TLS_ALPN").unwrap_or_else(|_| "h2".to_owned());
    let tls = tls_backend(max_streams, &alpn).await;
    let scenario = Scenario { chunks: Some(20), chunk_delay_ms: Some(chunk_ms), ..Default::default() };
    let url = format!("https://localhost:{}/s/{scenario}/v1", tls.port);
    let yaml = format!(
        "version: 1\nstore: {{kind: memory}}\naudit: {{sink: file, path: audit.jsonl}}\ntenants:\n  bench:\n    keys: [{{sha256: {}}}]\nai:\n  default_backend: h2\n  backends:\n    h2:\n      url: \"{url}\"\n      tls: {{ca: \"file:{ca}\", cert: \"file:{cert}\", key: \"file:{key}\"}}\n",
        hex::encode(Sha256::digest(KEY)),
        ca = tls.ca.display(),
        cert = tls.cert.display(),
        key = tls.key.display(),
    );
    let process = common::Gateway::start(&yaml);
    let cpu = process.cpu_seconds();
    let run = concurrently(&process.url, KEY, concurrent).await;
    if alpn == "h2" {
        println!(
            "{concurrent} concurrent streams, the same, to a backend over HTTP/2 (TLS, ALPN h2; it allows {max_streams} streams a connection)"
        );
    } else {
        println!("{concurrent} concurrent streams, the same, to a backend over TLS offering ALPN {alpn}");
    }
    run.print(chunk_ms);
    println!("  gateway process peak memory: {}", process.peak_memory());
    println!("  gateway CPU time for them: {:.2} s", process.cpu_seconds() - cpu);
    println!("  connections the backend accepted: {}", tls.connections.load(Ordering::Relaxed));
}

struct Run {
    completed: usize,
    concurrent: usize,
    elapsed: Duration,
    worst_gap: Duration,
}

impl Run {
    fn print(&self, chunk_ms: u64) {
        println!("  completed {}/{} in {:.2} s", self.completed, self.concurrent, self.elapsed.as_secs_f64());
        // The client asks for the usage chunk: the backend sends each event one pace
        // after the one before, and the gateway relays them all.
        println!(
            "  longest gap between two chunks of one stream: {} ms (the backend paces {chunk_ms} ms)",
            self.worst_gap.as_millis(),
        );
    }
}

/// `concurrent` streams at once through the gateway at `base`, HTTP/2 from the
/// clients, [`STREAMS_PER_CONNECTION`] to a connection.
async fn concurrently(base: &str, key: &'static str, concurrent: usize) -> Run {
    let connections: Vec<_> = (0..concurrent.div_ceil(STREAMS_PER_CONNECTION))
        .map(|_| reqwest::Client::builder().http2_prior_knowledge().build().unwrap())
        .collect();
    let started = Instant::now();
    let tasks: Vec<_> = (0..concurrent)
        .map(|i| tokio::spawn(stream_once(connections[i / STREAMS_PER_CONNECTION].clone(), base.to_owned(), key)))
        .collect();
    let mut completed = 0;
    let mut worst_gap = Duration::ZERO;
    for task in tasks {
        if let Ok(Some(gap)) = task.await {
            completed += 1;
            worst_gap = worst_gap.max(gap);
        }
    }
    Run { completed, concurrent, elapsed: started.elapsed(), worst_gap }
}

/// The fake model over TLS on loopback (a certificate for `localhost` from a CA made
/// here), offering `alpn` (`h2`: allowing `max_streams` streams a connection).
struct TlsBackend {
    port: u16,
    ca: std::path::PathBuf,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
    /// TCP connections accepted, handshakes refused included.
    connections: Arc<AtomicUsize>,
    _dir: tempfile::TempDir,
}

async fn tls_backend(max_streams: u32, alpn: &str) -> TlsBackend {
    use hyper_util::rt::{TokioExecutor, TokioIo};
    use hyper_util::server::conn::auto;
    use hyper_util::service::TowerToHyperService;
    use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};

    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let authority = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
    let leaf = |names: Vec<String>| {
        let key = KeyPair::generate().unwrap();
        let cert = CertificateParams::new(names).unwrap().signed_by(&key, &authority).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf(vec!["localhost".to_owned()]);
    let (client_cert, client_key) = leaf(vec!["flexway".to_owned()]);
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path
    };
    let (ca, cert, key) =
        (write("ca.pem", &authority.pem()), write("client.pem", &client_cert), write("client.key", &client_key));

    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(server_cert.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(server_key.as_bytes()).unwrap(),
        )
        .unwrap();
    config.alpn_protocols = vec![alpn.as_bytes().to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let connections = Arc::new(AtomicUsize::new(0));
    let accepted = connections.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            accepted.fetch_add(1, Ordering::Relaxed);
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(tls) = acceptor.accept(tcp).await else { return };
                let mut builder = auto::Builder::new(TokioExecutor::new());
                builder.http2().max_concurrent_streams(max_streams);
                let service = TowerToHyperService::new(fake_model::router());
                let _ = builder.serve_connection(TokioIo::new(tls), service).await;
            });
        }
    });
    TlsBackend { port, ca, cert, key, connections, _dir: dir }
}

fn body() -> serde_json::Value {
    serde_json::json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "stream a benchmark answer"}]})
}

/// [`body`] asking for the usage chunk, which the gateway then relays: every event
/// the client sees is one pace after the one before it, so a gap past one pace is a
/// stall of the path, not the backend's pacing of a chunk kept from the client.
fn body_with_usage() -> serde_json::Value {
    let mut body = body();
    body["stream_options"] = serde_json::json!({"include_usage": true});
    body
}

/// The first byte of `count` streams to each target (a name and an OpenAI base URL),
/// one stream at a time, the targets in turn, each round starting one target further:
/// the machine's drift within the run weighs on all alike. Sorted times in µs, one
/// list a target.
async fn first_bytes(client: &reqwest::Client, targets: &[(&str, String)], count: usize) -> Vec<Vec<f64>> {
    const WARM_UP: usize = 20;
    let mut out: Vec<Vec<f64>> = targets.iter().map(|_| Vec::with_capacity(count + WARM_UP)).collect();
    for round in 0..count + WARM_UP {
        for turn in 0..targets.len() {
            let i = (round + turn) % targets.len();
            let sent = Instant::now();
            let response = client
                .post(format!("{}/chat/completions", targets[i].1))
                .bearer_auth(QUICK_KEY)
                .json(&body())
                .send()
                .await
                .unwrap();
            let mut stream = response.bytes_stream();
            let _first = stream.next().await.unwrap().unwrap();
            out[i].push(sent.elapsed().as_secs_f64() * 1e6);
            while stream.next().await.is_some() {}
        }
    }
    for times in &mut out {
        times.drain(..WARM_UP);
        times.sort_by(f64::total_cmp);
    }
    out
}

/// A bare nginx `proxy_pass` hop in front of the fake model server, as a child
/// process: one process (as the gateway's two cores are shared with everyone here),
/// kept-alive upstream connections, answers passed on unbuffered as they come.
struct NginxHop {
    child: std::process::Child,
    /// `http://127.0.0.1:PORT/v1`
    url: String,
    dir: tempfile::TempDir,
}

impl NginxHop {
    /// None, and a line saying why, when nginx is not installed or does not start.
    fn start(upstream: std::net::SocketAddr) -> Option<NginxHop> {
        let Some(nginx) = ["/usr/sbin/nginx", "/usr/bin/nginx"].into_iter().find(|p| std::path::Path::new(p).exists())
        else {
            println!("(nginx is not installed, so no nginx hop is measured: apt-get install nginx-light)");
            return None;
        };
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let path = dir.path().display();
        // No master: the one process serves, as this user, and dies with a kill. Every
        // path nginx would write to is in the temp dir.
        let conf = format!(
            r#"master_process off;
daemon off;
pid {path}/nginx.pid;
error_log {path}/error.log warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {path}/body;
  proxy_temp_path {path}/proxy;
  fastcgi_temp_path {path}/fastcgi;
  uwsgi_temp_path {path}/uwsgi;
  scgi_temp_path {path}/scgi;
  upstream model {{ server {upstream}; keepalive 16; keepalive_requests 1000000; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://model;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
"#
        );
        let config = dir.path().join("nginx.conf");
        std::fs::write(&config, conf).unwrap();
        // `-e`: what goes wrong before the config's own `error_log` applies (a bad
        // directive, a port taken) lands in the same file.
        let child = std::process::Command::new(nginx)
            .arg("-e")
            .arg(dir.path().join("error.log"))
            .arg("-p")
            .arg(dir.path())
            .arg("-c")
            .arg(&config)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let mut hop = NginxHop { child, url: format!("http://127.0.0.1:{port}/v1"), dir };
        for _ in 0..100 {
            if matches!(hop.child.try_wait(), Ok(Some(_))) {
                break;
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return Some(hop);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let log = std::fs::read_to_string(hop.dir.path().join("error.log")).unwrap_or_default();
        println!("(the nginx hop did not start on port {port}, so it is not measured: {})", log.trim());
        None
    }
}

impl Drop for NginxHop {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Reads one stream to its end; the longest wait between two chunks, or None if it failed.
async fn stream_once(client: reqwest::Client, base: String, key: &str) -> Option<Duration> {
    let response =
        client.post(format!("{base}/chat/completions")).bearer_auth(key).json(&body_with_usage()).send().await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let mut stream = response.bytes_stream();
    let mut last = Instant::now();
    let mut worst = Duration::ZERO;
    let mut text = Vec::new();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.ok()?;
        worst = worst.max(last.elapsed());
        last = Instant::now();
        text.extend_from_slice(&chunk);
    }
    String::from_utf8_lossy(&text).contains("[DONE]").then_some(worst)
}
