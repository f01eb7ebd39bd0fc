//! `fake-model`: serve the fake OpenAI- and Anthropic-compatible model on a
//! fixed address, for the README demo and the SDK tests. Scenarios work as in
//! the tests: `/s/<scenario>/v1`.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use fake_model::{Capacity, FakeModel};

/// An OpenAI- and Anthropic-compatible fake model server.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Args {
    /// The address to listen on.
    #[arg(long, default_value = "127.0.0.1:8081")]
    listen: SocketAddr,
    /// Stand for a model server that runs this many calls at once; the others
    /// wait in its queue, shown on `GET /metrics`.
    #[arg(long)]
    slots: Option<u32>,
    /// How long a call holds its slot before its answer starts, in milliseconds.
    #[arg(long, default_value_t = 50, requires = "slots")]
    service_ms: u64,
    /// The same for a prompt whose first 4 KiB it served before (a prefix-cache hit).
    #[arg(long, default_value_t = 10, requires = "slots")]
    cached_service_ms: u64,
    /// How many prompt prefixes its cache holds.
    #[arg(long, default_value_t = 256, requires = "slots")]
    cached_prefixes: usize,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let capacity = args.slots.map(|slots| Capacity {
        slots,
        service: Duration::from_millis(args.service_ms),
        cached_service: Duration::from_millis(args.cached_service_ms),
        cached_prefixes: args.cached_prefixes,
    });
    let server = FakeModel::start_with(args.listen, capacity).await?;
    eprintln!("fake-model listening on http://{}", server.addr());
    tokio::signal::ctrl_c().await
}
