//! mTLS towards a backend (SPEC §3, `tls: {cert, key, ca}`): the real binary against a
//! loopback TLS server that requires a client certificate, every certificate made at
//! test time. The right certificate passes; a certificate the backend does not accept,
//! a wrong CA or no `tls` at all is a 503 whose message names the TLS failure, and no
//! message or log line carries the private key. A backend whose TLS offers `h2` is
//! called over HTTP/2, on as many connections as the calls in flight need. A `grpc`
//! backend at an `https://` url is reached over TLS, with its client certificate.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use flexway_testkit::*;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, DnType, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use serde_json::Value;

/// A CA, and what it signs.
struct Authority {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its private key, in PEM.
struct Leaf {
    cert: String,
    key: String,
}

impl Authority {
    fn new(name: &str) -> Authority {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        Authority { issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap() }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    fn sign(&self, names: &[&str]) -> Leaf {
        let key = KeyPair::generate().unwrap();
        let params = CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>()).unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Leaf { cert: cert.pem(), key: key.serialize_pem() }
    }
}

/// The fake model's OpenAI surface over TLS on loopback, for clients whose certificate
/// `clients` signed; a client without one is refused in the handshake.
async fn tls_backend(server: &Leaf, clients: &Authority) -> SocketAddr {
    tls_backend_offering(server, clients, &[], 200).await.addr
}

/// A TLS backend of these tests, and what it saw.
struct Backend {
    addr: SocketAddr,
    /// The HTTP version of every request it served.
    versions: Arc<Mutex<Vec<axum::http::Version>>>,
    /// TCP connections accepted.
    connections: Arc<AtomicUsize>,
    /// Set, it offers only `http/1.1` to the connections that come next, and speaks
    /// only HTTP/1.1 on them (a server whose HTTP/2 was turned off).
    http1_from_now: Arc<AtomicBool>,
}

/// A TLS server's configuration: `server`'s certificate, and a client certificate
/// `clients` signed required.
fn server_config(server: &Leaf, clients: &Authority) -> rustls::ServerConfig {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(clients.pem().as_bytes()).unwrap()).unwrap();
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build().unwrap();
    rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_client_cert_verifier(verifier)
        .with_single_cert(
            vec![CertificateDer::from_pem_slice(server.cert.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(server.key.as_bytes()).unwrap(),
        )
        .unwrap()
}

/// A TLS front for the gRPC server at `upstream`: the handshake offers `h2` and asks
/// for a client certificate `clients` signed; the bytes then go through in clear.
async fn tls_grpc_backend(server: &Leaf, clients: &Authority, upstream: SocketAddr) -> SocketAddr {
    let mut config = server_config(server, clients);
    config.alpn_protocols = vec![b"h2".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let mut tls = match acceptor.accept(tcp).into_fallible().await {
                    Ok(tls) => tls,
                    Err((_, tcp)) => return linger(tcp).await,
                };
                let mut plain = tokio::net::TcpStream::connect(upstream).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
            });
        }
    });
    addr
}

/// The same, offering `alpn` in the handshake, and allowing `max_streams` streams on
/// an HTTP/2 connection.
async fn tls_backend_offering(server: &Leaf, clients: &Authority, alpn: &[&[u8]], max_streams: u32) -> Backend {
    tls_backend_closing_idle(server, clients, alpn, max_streams, None).await
}

/// As [`tls_backend_offering`], closing an HTTP/1.1 keep-alive connection that waits
/// for its next request longer than `idle_close`.
async fn tls_backend_closing_idle(
    server: &Leaf,
    clients: &Authority,
    alpn: &[&[u8]],
    max_streams: u32,
    idle_close: Option<Duration>,
) -> Backend {
    let config = server_config(server, clients);
    let offering = |alpn: &[&[u8]]| {
        let mut config = config.clone();
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    };
    let (acceptor, http1_acceptor) = (offering(alpn), offering(&[b"http/1.1"]));
    let versions = Arc::new(Mutex::new(Vec::new()));
    let seen = versions.clone();
    let router = fake_model::router().layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            seen.lock().unwrap().push(request.version());
            next.run(request)
        },
    ));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let connections = Arc::new(AtomicUsize::new(0));
    let http1_from_now = Arc::new(AtomicBool::new(false));
    let (accepted, http1) = (connections.clone(), http1_from_now.clone());
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else { return };
            accepted.fetch_add(1, Ordering::Relaxed);
            let http1 = http1.load(Ordering::Relaxed);
            let acceptor = if http1 { http1_acceptor.clone() } else { acceptor.clone() };
            let router = router.clone();
            tokio::spawn(async move {
                let tls = match acceptor.accept(tcp).into_fallible().await {
                    Ok(tls) => tls,
                    Err((_, tcp)) => return linger(tcp).await,
                };
                let service = TowerToHyperService::new(router);
                let mut builder = auto::Builder::new(TokioExecutor::new());
                builder.http2().max_concurrent_streams(max_streams);
                if let Some(after) = idle_close {
                    builder.http1().timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(after);
                }
                let builder = if http1 { builder.http1_only() } else { builder };
                let _ = builder.serve_connection(TokioIo::new(tls), service).await;
            });
        }
    });
    Backend { addr, versions, connections, http1_from_now }
}

/// A refused handshake's close, as servers in the field make it (nginx's
/// `lingering_close`): rustls has sent its alert; the write side is shut and what the
/// client still sends is read and dropped until it closes. Under TLS 1.3 a client
/// certificate is refused after the client has finished its handshake and sent its
/// request: closing at once, with that request unread, makes the kernel answer with a
/// reset that can overtake the alert.
async fn linger(mut tcp: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = tcp.shutdown().await;
    let mut sink = [0u8; 4096];
    let drain = async { while matches!(tcp.read(&mut sink).await, Ok(n) if n > 0) {} };
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), drain).await;
}

/// The certificates of one test: the backend's CA and server certificate, a client
/// certificate it accepts, and a stranger CA with a client certificate of its own.
struct Pki {
    ca: Authority,
    server: Leaf,
    client: Leaf,
    stranger: Authority,
    stranger_client: Leaf,
}

fn pki() -> Pki {
    let ca = Authority::new("Flexway test CA");
    let stranger = Authority::new("Someone else's CA");
    Pki {
        server: ca.sign(&["localhost", "127.0.0.1"]),
        client: ca.sign(&["flexway-client"]),
        stranger_client: stranger.sign(&["flexway-client"]),
        ca,
        stranger,
    }
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    format!("file:{}", path.display())
}

/// The `tls` mapping of a backend that presents the right client certificate, its key
/// in `CLIENT_KEY`.
fn right_client_tls(dir: &Path, pki: &Pki) -> String {
    format!(
        "{{cert: '{}', key: 'env:CLIENT_KEY', ca: '{}'}}",
        write(dir, "client.pem", &pki.client.cert),
        write(dir, "ca.pem", &pki.ca.pem())
    )
}

/// One backend `main` at `https://localhost:PORT/v1` with `tls` as given (a flow
/// mapping, or nothing).
fn mtls_config(addr: SocketAddr, tls: Option<String>) -> String {
    let tls = tls.map(|t| format!("      tls: {t}\n")).unwrap_or_default();
    config(&format!(
        "  default_backend: main\n  backends:\n    main:\n      url: https://localhost:{}/v1\n{tls}",
        addr.port()
    ))
}

/// The error envelope of a refused call: (status, code, message).
async fn refused(gw: &Flexway) -> (u16, String, String) {
    let response = gw.chat(KEY, hello("m")).await;
    let status = response.status().as_u16();
    let body: Value = response.json().await.unwrap();
    let text = |key: &str| body["error"][key].as_str().unwrap_or_default().to_owned();
    (status, text("code"), text("message"))
}

#[tokio::test]
async fn the_right_client_certificate_passes() {
    let pki = pki();
    let Backend { addr, versions, .. } = tls_backend_offering(&pki.server, &pki.ca, &[], 200).await;
    let dir = tempfile::tempdir().unwrap();
    let tls = right_client_tls(dir.path(), &pki);
    let gw = Flexway::start_with_env(&mtls_config(addr, Some(tls)), &[("CLIENT_KEY", &pki.client.key)]);
    let response = gw.chat(KEY, hello("m")).await;
    assert_eq!(response.status(), 200);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion", "{body}");
    assert_eq!(*versions.lock().unwrap(), [axum::http::Version::HTTP_11], "no ALPN offered: HTTP/1.1");
}

/// A backend whose TLS chooses HTTP/1.1 is called through the same HTTP/1.1 client as
/// a plain one (upstream/h1/): streams and whole answers read to their end over
/// TLS, and the calls on one connection a serving thread, pooled after each answer.
#[tokio::test]
async fn calls_over_tls_and_http1_stream_and_share_one_connection() {
    let pki = pki();
    let backend = tls_backend_offering(&pki.server, &pki.ca, &[b"http/1.1"], 200).await;
    let dir = tempfile::tempdir().unwrap();
    let tls = right_client_tls(dir.path(), &pki);
    let gw = Flexway::start_with_env(&mtls_config(backend.addr, Some(tls)), &[("CLIENT_KEY", &pki.client.key)]);
    for _ in 0..3 {
        let mut streamed = hello("m");
        streamed["stream"] = Value::Bool(true);
        let response = gw.chat(KEY, streamed).await;
        assert_eq!(response.status(), 200);
        let (events, _) = sse_data(response).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
        assert!(events.len() > 2, "content events before the end: {events:?}");
        let whole = gw.chat(KEY, hello("m")).await;
        assert_eq!(whole.status(), 200);
        assert_eq!(whole.json::<Value>().await.unwrap()["object"], "chat.completion");
    }
    assert_eq!(*backend.versions.lock().unwrap(), [axum::http::Version::HTTP_11; 6]);
    // A connection a serving thread at most (each has its pool), not one a call.
    let opened = backend.connections.load(Ordering::Relaxed);
    assert!(opened <= serving_threads(), "{opened} connections for 6 calls: pooled after each answer");
}

/// A pooled TLS connection the backend closed while it waited is not used: the next
/// call opens another and is served (no 503 from a dead connection).
#[tokio::test]
async fn a_tls_connection_the_backend_closed_while_pooled_is_not_used() {
    let pki = pki();
    // It closes a keep-alive connection idle for 100 ms (hyper's header read timeout:
    // the socket closed without TLS's `close_notify`, as many servers do).
    let idle_close = Some(Duration::from_millis(100));
    let Backend { addr, connections, .. } =
        tls_backend_closing_idle(&pki.server, &pki.ca, &[b"http/1.1"], 200, idle_close).await;
    let dir = tempfile::tempdir().unwrap();
    let tls = right_client_tls(dir.path(), &pki);
    let gw = in_process_with_env(&mtls_config(addr, Some(tls)), &[("CLIENT_KEY", &pki.client.key)]).await;
    for call in 0..3 {
        let response = gw.chat(KEY, hello("m")).await;
        assert_eq!(response.status(), 200, "call {call}: {}", response.text().await.unwrap());
        let _ = response.bytes().await;
        // Past the backend's idle close.
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    assert_eq!(connections.load(Ordering::Relaxed), 3, "a new connection after each idle close");
}

/// A backend whose TLS offers HTTP/2 (ALPN `h2`) is called over HTTP/2
/// (docs/operations.md).
#[tokio::test]
async fn a_backend_whose_tls_offers_h2_is_called_over_http2() {
    let pki = pki();
    let Backend { addr, versions, .. } = tls_backend_offering(&pki.server, &pki.ca, &[b"h2", b"http/1.1"], 200).await;
    let dir = tempfile::tempdir().unwrap();
    let tls = right_client_tls(dir.path(), &pki);
    let gw = Flexway::start_with_env(&mtls_config(addr, Some(tls)), &[("CLIENT_KEY", &pki.client.key)]);
    for _ in 0..2 {
        let response = gw.chat(KEY, hello("m")).await;
        assert_eq!(response.status(), 200);
    }
    assert_eq!(*versions.lock().unwrap(), [axum::http::Version::HTTP_2; 2]);
}

/// A backend whose server stops choosing HTTP/2 (turned off behind the same address)
/// is called on without a failure: the gateway had noted `h2` and calls over HTTP/2
/// only; the call that meets an HTTP/1.1 handshake goes again over the HTTP/1.1
/// client (upstream/alpn.rs), and is served once (without the retry it was a 503).
#[tokio::test]
async fn a_backend_that_turns_http2_off_is_called_on_without_a_failure() {
    let pki = pki();
    let backend = tls_backend_offering(&pki.server, &pki.ca, &[b"h2", b"http/1.1"], 200).await;
    let dir = tempfile::tempdir().unwrap();
    let tls = right_client_tls(dir.path(), &pki);
    let gw = Flexway::start_with_env(&mtls_config(backend.addr, Some(tls)), &[("CLIENT_KEY", &pki.client.key)]);
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    backend.http1_from_now.store(true, Ordering::Relaxed);
    for _ in 0..2 {
        let response = gw.chat(KEY, hello("m")).await;
        assert_eq!(response.status(), 200, "{}", response.text().await.unwrap());
    }
    assert_eq!(backend.versions.lock().unwrap().len(), 3);
    // The second call's HTTP/2-only connect met the HTTP/1.1 handshake.
    assert!(backend.connections.load(Ordering::Relaxed) >= 2);
}

/// A server takes only so many streams on one HTTP/2 connection (here 100, the floor
/// RFC 9113 asks for). More calls at once than one connection takes go out on more
/// connections (upstream/lanes.rs): without them, each serving thread would carry
/// at most 100 calls at once to this backend and the rest would wait, here for ever,
/// since every stream stalls after its first content chunk.
#[tokio::test(flavor = "multi_thread")]
async fn more_calls_at_once_than_one_http2_connection_takes_go_out_on_more_connections() {
    let pki = pki();
    let Backend { addr, connections, .. } = tls_backend_offering(&pki.server, &pki.ca, &[b"h2"], 100).await;
    let (gw, _certs) = stalling_h2_gateway(&pki, addr);
    let calls = more_calls_than_one_connection_a_thread();
    if let Err(open) = hold_streams_open(&gw, calls).await {
        panic!("{open} of {calls} streams open at once");
    }
    let opened = connections.load(Ordering::Relaxed);
    assert!(opened >= calls.div_ceil(100), "{opened} connections for {calls} streams at once");
}

/// Once the backend's server has chosen `h2`, a burst of calls shares connections from
/// the start: a call that finds one being opened waits for it (upstream/alpn.rs), on
/// each new lane too. Letting TLS choose, each call of the burst opened a connection
/// of its own until the first one was pooled: here about one a call.
#[tokio::test(flavor = "multi_thread")]
async fn a_burst_of_calls_to_an_http2_backend_opens_a_connection_a_lane_not_one_a_call() {
    let pki = pki();
    let Backend { addr, connections, .. } = tls_backend_offering(&pki.server, &pki.ca, &[b"h2"], 100).await;
    let (gw, _certs) = stalling_h2_gateway(&pki, addr);
    // One call first: its handshake (the HTTP/1.1 client's, which offers `h2`) tells
    // the gateway the backend speaks HTTP/2, and the call goes on a connection of the
    // HTTP/2 client: two handshakes, once for the backend.
    hold_streams_open(&gw, 1).await.unwrap();
    assert_eq!(connections.load(Ordering::Relaxed), 2);

    let calls = more_calls_than_one_connection_a_thread();
    if let Err(open) = hold_streams_open(&gw, calls).await {
        panic!("{open} of {calls} streams open at once");
    }
    // A connection for each lane the calls took (100 calls a lane), on each serving
    // thread, and the first call's two.
    let opened = connections.load(Ordering::Relaxed);
    let lanes = calls.div_ceil(100) + serving_threads();
    assert!(opened <= 2 + lanes, "{opened} connections for {calls} streams at once ({lanes} lanes at most)");
}

/// A burst to an `h2` backend the gateway has never called: the calls wait for the
/// first handshake (the HTTP/1.1 client's, which learns `h2`) instead of each making
/// one that would be closed unused, then share each serving thread's HTTP/2
/// connection. Without the wait, 50 calls opened about 50 connections.
#[tokio::test(flavor = "multi_thread")]
async fn a_first_burst_to_an_http2_backend_makes_one_handshake_to_learn_it() {
    let pki = pki();
    let Backend { addr, connections, .. } = tls_backend_offering(&pki.server, &pki.ca, &[b"h2"], 100).await;
    let (gw, _certs) = stalling_h2_gateway(&pki, addr);
    if let Err(open) = hold_streams_open(&gw, 50).await {
        panic!("{open} of 50 streams open at once");
    }
    let opened = connections.load(Ordering::Relaxed);
    assert!(opened <= 1 + serving_threads(), "{opened} connections for a first burst of 50 streams");
}

/// A gateway whose backend, at `addr` over mTLS, stalls every stream after its first
/// content chunk; with the directory of its client certificate.
fn stalling_h2_gateway(pki: &Pki, addr: SocketAddr) -> (Arc<Flexway>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let tls = right_client_tls(dir.path(), pki);
    let yaml = config(&format!(
        "  default_backend: main\n  backends:\n    main:\n      url: https://localhost:{}/s/stall_after=1/v1\n      timeout: 60s\n      tls: {tls}\n",
        addr.port()
    ));
    (Arc::new(Flexway::start_with_env(&yaml, &[("CLIENT_KEY", &pki.client.key)])), dir)
}

fn serving_threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// More calls than the serving threads (one a core) could carry on one connection each.
fn more_calls_than_one_connection_a_thread() -> usize {
    100 * serving_threads() + 50
}

/// `calls` streamed calls at once, each held open from its first content chunk (the
/// gateway answers once the backend's first has come) until all are (20 s at most),
/// then let go. The error is how many were open.
async fn hold_streams_open(gw: &Arc<Flexway>, calls: usize) -> Result<(), usize> {
    hold_open(calls, Duration::from_secs(20), || {
        let gw = gw.clone();
        async move {
            let mut body = hello("m");
            body["stream"] = true.into();
            let response = gw.chat(KEY, body).await;
            assert_eq!(response.status(), 200);
            let mut chunks = response.bytes_stream();
            assert!(futures_util::StreamExt::next(&mut chunks).await.is_some());
            chunks
        }
    })
    .await
}

#[tokio::test]
async fn a_client_certificate_the_backend_does_not_accept_is_named() {
    let pki = pki();
    let addr = tls_backend(&pki.server, &pki.ca).await;
    let dir = tempfile::tempdir().unwrap();
    let tls = format!(
        "{{cert: '{}', key: '{}', ca: '{}'}}",
        write(dir.path(), "client.pem", &pki.stranger_client.cert),
        write(dir.path(), "client.key", &pki.stranger_client.key),
        write(dir.path(), "ca.pem", &pki.ca.pem())
    );
    let gw = Flexway::start(&mtls_config(addr, Some(tls)));
    let (status, code, message) = refused(&gw).await;
    assert_eq!((status, code.as_str()), (503, "upstream_unavailable"), "{message}");
    assert!(message.contains("backend `main`: TLS handshake failed: received fatal alert"), "{message}");
    assert!(message.contains("refused the client certificate"), "{message}");
    let key_body = pki.stranger_client.key.lines().nth(1).unwrap();
    assert!(!message.contains(key_body) && !gw.logs().contains(key_body), "the private key was shown");
}

#[tokio::test]
async fn a_wrong_ca_is_named_as_a_certificate_verification_failure() {
    let pki = pki();
    let addr = tls_backend(&pki.server, &pki.ca).await;
    let dir = tempfile::tempdir().unwrap();
    let tls = format!(
        "{{cert: '{}', key: '{}', ca: '{}'}}",
        write(dir.path(), "client.pem", &pki.client.cert),
        write(dir.path(), "client.key", &pki.client.key),
        write(dir.path(), "ca.pem", &pki.stranger.pem())
    );
    let gw = Flexway::start(&mtls_config(addr, Some(tls)));
    let (status, code, message) = refused(&gw).await;
    assert_eq!((status, code.as_str()), (503, "upstream_unavailable"), "{message}");
    assert!(message.contains("TLS handshake failed: invalid peer certificate"), "{message} {}", gw.logs());
    assert!(message.contains("UnknownIssuer"), "{message}");
    assert!(message.contains("not trusted"), "{message}");
}

#[tokio::test]
async fn without_tls_the_private_ca_is_unknown_and_named() {
    let pki = pki();
    let addr = tls_backend(&pki.server, &pki.ca).await;
    let gw = Flexway::start(&mtls_config(addr, None));
    let (status, code, message) = refused(&gw).await;
    assert_eq!((status, code.as_str()), (503, "upstream_unavailable"), "{message}");
    assert!(message.contains("invalid peer certificate") && message.contains("UnknownIssuer"), "{message}");
}

#[tokio::test]
async fn a_key_that_is_not_a_private_key_stops_the_start_without_showing_it() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    // The certificate given twice: as itself and, wrongly, as the key.
    let cert = write(dir.path(), "client.pem", &pki.client.cert);
    let yaml = mtls_config("127.0.0.1:9".parse().unwrap(), Some(format!("{{cert: '{cert}', key: '{cert}'}}")));
    let config = dir.path().join("flexway.yaml");
    std::fs::write(&config, yaml).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_flexway"))
        .args(["serve", "--listen", "127.0.0.1:0", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("backend `main`: TLS: tls.key (file:") && stderr.contains("holds no PEM private key"),
        "{stderr}"
    );
    assert!(!stderr.contains(pki.client.cert.lines().nth(1).unwrap()), "{stderr}");
}

/// Lambda's init opens the backends' connections (`Upstreams::preconnect`): the
/// first call then finds its connection made, whether the backend's TLS chose
/// HTTP/1.1 or HTTP/2 (a HEAD on each client a call uses), and a plain backend's
/// TCP connection is pooled with nothing sent on it.
#[tokio::test]
async fn backends_connected_ahead_serve_the_first_call_on_that_connection() {
    let pki = pki();
    let dir = tempfile::tempdir().unwrap();
    for alpn in [&[][..], &[&b"h2"[..], b"http/1.1"][..]] {
        let backend = tls_backend_offering(&pki.server, &pki.ca, alpn, 200).await;
        let yaml = mtls_config(backend.addr, Some(right_client_tls(dir.path(), &pki)));
        let gw = in_process_with_env(&yaml, &[("CLIENT_KEY", &pki.client.key)]).await;
        gw.gateway.upstreams.preconnect(Duration::from_secs(5)).await;
        let opened = backend.connections.load(Ordering::Relaxed);
        // Offered `h2`, the first handshake (ALPN's choice) learns it, and the HTTP/2
        // client the calls then use makes its own.
        assert_eq!(opened, if alpn.is_empty() { 1 } else { 2 }, "connections opened ahead ({alpn:?})");
        for _ in 0..2 {
            assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
        }
        assert_eq!(backend.connections.load(Ordering::Relaxed), opened, "the calls reuse it ({alpn:?})");
    }

    // A plain backend, behind a counting TCP relay: a connection, no request, then the
    // call on it.
    let model = FakeModel::start().await.unwrap();
    let relay = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let relay_addr = relay.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counted = accepted.clone();
    let target = model.addr();
    tokio::spawn(async move {
        while let Ok((mut inbound, _)) = relay.accept().await {
            counted.fetch_add(1, Ordering::Relaxed);
            tokio::spawn(async move {
                let mut outbound = tokio::net::TcpStream::connect(target).await.unwrap();
                let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
            });
        }
    });
    let yaml = one_backend(&format!("http://{relay_addr}/v1"));
    let gw = in_process_with_env(&yaml, &[]).await;
    gw.gateway.upstreams.preconnect(Duration::from_secs(5)).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!((accepted.load(Ordering::Relaxed), model.request_count()), (1, 0));
    assert_eq!(gw.chat(KEY, hello("m")).await.status(), 200);
    assert_eq!((accepted.load(Ordering::Relaxed), model.request_count()), (1, 1));
}

/// One `grpc` backend at `url` (the fake OCR service's descriptor set) with `tls`.
fn grpc_tls_config(dir: &Path, url: &str, tls: &str) -> String {
    let set = dir.join("ocr.binpb");
    std::fs::write(&set, fake_grpc::DESCRIPTOR_SET).unwrap();
    config(&format!(
        "  backends:\n    ocr:\n      kind: grpc\n      url: {url}\n      descriptor_set: {}\n      tls: {tls}\n",
        set.display()
    ))
}

async fn recognize(gw: &Flexway, bytes: usize) -> Result<String, tonic::Status> {
    let mut ocr = fake_grpc::pb::ocr_client::OcrClient::connect(gw.url.clone()).await.unwrap();
    let mut request = tonic::Request::new(fake_grpc::pb::Image { data: vec![7; bytes], ..Default::default() });
    request.metadata_mut().insert("authorization", format!("Bearer {KEY}").parse().unwrap());
    ocr.recognize(request).await.map(|answer| answer.into_inner().text)
}

/// A gRPC upstream over TLS (`grpcs://` or `https://`) is called over HTTP/2 with the
/// backend's client certificate, checked against its `ca`; one the upstream does not
/// accept fails the call as UNAVAILABLE, and nothing reaches the service.
#[tokio::test]
async fn a_grpc_backend_over_tls_presents_its_client_certificate() {
    let pki = pki();
    let ocr = fake_grpc::FakeOcr::start().await.unwrap();
    let front = tls_grpc_backend(&pki.server, &pki.ca, ocr.addr).await;
    let dir = tempfile::tempdir().unwrap();
    let env = [("CLIENT_KEY", pki.client.key.as_str())];
    for scheme in ["grpcs", "https"] {
        let url = format!("{scheme}://localhost:{}", front.port());
        let gw = Flexway::start_with_env(&grpc_tls_config(dir.path(), &url, &right_client_tls(dir.path(), &pki)), &env);
        assert_eq!(recognize(&gw, 12).await.unwrap(), "12", "{}", gw.logs());
    }
    assert_eq!(ocr.calls(), 2);

    let stranger = format!(
        "{{cert: '{}', key: 'env:CLIENT_KEY', ca: '{}'}}",
        write(dir.path(), "stranger.pem", &pki.stranger_client.cert),
        write(dir.path(), "ca.pem", &pki.ca.pem())
    );
    let url = format!("https://localhost:{}", front.port());
    let gw = Flexway::start_with_env(
        &grpc_tls_config(dir.path(), &url, &stranger),
        &[("CLIENT_KEY", pki.stranger_client.key.as_str())],
    );
    let status = recognize(&gw, 12).await.unwrap_err();
    assert_eq!(status.code(), tonic::Code::Unavailable, "{status:?}");
    assert_eq!(ocr.calls(), 2, "nothing reached the service");
    assert!(!gw.logs().contains(&pki.stranger_client.key), "the key is never logged");
}

/// A gateway served in this process, its secrets read from `env`.
async fn in_process_with_env(yaml: &str, env: &[(&str, &str)]) -> InProcess {
    let env: std::collections::HashMap<String, String> =
        env.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
    let loaded = flexway::config::load_str(yaml, &env).unwrap_or_else(|e| panic!("{e}"));
    let secrets = Arc::new(flexway::secret::LocalSecrets { env });
    let (adapters, _) = memory_adapters();
    let gateway = Arc::new(flexway::Gateway::new(loaded.config, secrets, adapters).await.unwrap());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let app = flexway::http::app(gateway.clone());
    tokio::spawn(async move { axum::serve(listener, app).await });
    InProcess { url, gateway }
}
