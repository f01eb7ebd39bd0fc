//! The floor of flexway's own stack, for `benches/proxy-hop`: a bare proxy hop on the
//! crates flexway serves with (hyper's server through hyper-util, hyper-util's pooled
//! client, mimalloc) and its threading (one single-threaded runtime per core, each with
//! its own upstream pool), doing nothing a gateway does: no identity, no routing, no
//! ledger, no audit, and no axum router or middleware. The request's body goes to the
//! upstream as it came, and the answer's body back. Unlike `flexway serve` (which
//! accepts on its main runtime and hands each connection to a serving thread), every
//! thread here accepts on the shared listener: one connection, as in the latency
//! measure, is served the same way.
//!
//!   hyper-hop LISTEN UPSTREAM      e.g. hyper-hop 127.0.0.1:8081 127.0.0.1:8080

use std::net::SocketAddr;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

type Upstream = Client<HttpConnector, Full<Bytes>>;

fn main() -> std::io::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        eprintln!("usage: hyper-hop LISTEN UPSTREAM");
        std::process::exit(2);
    };
    let listen: SocketAddr = listen.parse().map_err(std::io::Error::other)?;
    let listener = std::net::TcpListener::bind(listen)?;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let serving: Vec<_> = (0..threads)
        .map(|_| {
            let listener = listener.try_clone()?;
            let upstream = upstream.clone();
            Ok(std::thread::spawn(move || serve(listener, upstream)))
        })
        .collect::<std::io::Result<_>>()?;
    for thread in serving {
        thread.join().map_err(|_| std::io::Error::other("a serving thread panicked"))??;
    }
    Ok(())
}

/// One serving thread: accepts on the shared listener, serves each connection on
/// this thread's runtime, and calls the upstream through this thread's pool.
fn serve(listener: std::net::TcpListener, upstream: String) -> std::io::Result<()> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    runtime.block_on(async move {
        listener.set_nonblocking(true)?;
        let listener = tokio::net::TcpListener::from_std(listener)?;
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        let client: Upstream = Client::builder(TokioExecutor::new()).build(connector);
        loop {
            let (stream, _) = listener.accept().await?;
            stream.set_nodelay(true)?;
            let (client, upstream) = (client.clone(), upstream.clone());
            tokio::spawn(async move {
                let service =
                    hyper::service::service_fn(move |request| forward(client.clone(), upstream.clone(), request));
                let _ = auto::Builder::new(TokioExecutor::new()).serve_connection(TokioIo::new(stream), service).await;
            });
        }
    })
}

async fn forward(
    client: Upstream,
    upstream: String,
    request: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, hyper::Error> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await?.to_bytes();
    let Ok(uri) = format!("http://{upstream}{}", parts.uri.path()).parse() else {
        return Ok(failed(StatusCode::BAD_REQUEST));
    };
    let mut onward = Request::new(Full::new(body));
    *onward.method_mut() = parts.method;
    *onward.uri_mut() = uri;
    *onward.headers_mut() = parts.headers;
    onward.headers_mut().remove(hyper::header::HOST);
    let Ok(answer) = client.request(onward).await else {
        return Ok(failed(StatusCode::BAD_GATEWAY));
    };
    let (parts, body) = answer.into_parts();
    let body = body.collect().await?.to_bytes();
    Ok(Response::from_parts(parts, Full::new(body)))
}

fn failed(status: StatusCode) -> Response<Full<Bytes>> {
    let mut answer = Response::new(Full::default());
    *answer.status_mut() = status;
    answer
}
