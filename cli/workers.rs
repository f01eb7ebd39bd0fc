//! The serving threads of `flexway serve`: one single-threaded tokio runtime per core,
//! each serving the connections handed to it whole.
//!
//! A call's tasks (the client connection, the handler, the upstream connection from its
//! thread's own pool) all run on the thread that accepted the connection: no wake-up
//! crosses threads on the request path, where tokio's multi-threaded scheduler woke
//! another core for the upstream connection's task and back (~60 µs a call
//! on a 2-vCPU machine). The accept loop and the background tasks (sweeper, secret
//! refresh, telemetry) stay on the main runtime; a connection crosses threads once,
//! when accepted.

use std::thread::JoinHandle;

use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::Watcher;
use hyper_util::service::TowerToHyperService;
use tokio::sync::mpsc;

/// A connection for a serving thread, and what ends it gracefully.
struct Handed {
    stream: std::net::TcpStream,
    watcher: Watcher,
}

pub struct Workers {
    queues: Vec<mpsc::UnboundedSender<Handed>>,
    threads: Vec<JoinHandle<()>>,
    next: usize,
}

impl Workers {
    /// Starts `count` serving threads, each with its runtime and a clone of `app`.
    pub fn start(
        count: usize,
        app: &flexway::http::Current,
        builder: &auto::Builder<TokioExecutor>,
    ) -> std::io::Result<Self> {
        let mut queues = Vec::with_capacity(count);
        let mut threads = Vec::with_capacity(count);
        for index in 0..count {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            let (queue, mut handed) = mpsc::unbounded_channel::<Handed>();
            let (app, builder) = (app.clone(), builder.clone());
            let thread = std::thread::Builder::new().name(format!("flexway-serve-{index}")).spawn(move || {
                flexway::upstream::enter_serving_thread(index);
                runtime.block_on(async move {
                    tokio::spawn(keep_timers_near());
                    while let Some(Handed { stream, watcher }) = handed.recv().await {
                        serve_connection(stream, watcher, &app, &builder);
                    }
                });
            })?;
            queues.push(queue);
            threads.push(thread);
        }
        Ok(Workers { queues, threads, next: 0 })
    }

    /// Gives an accepted connection to the next thread, in turn.
    pub fn hand(&mut self, stream: tokio::net::TcpStream, watcher: Watcher) {
        let stream = match stream.into_std() {
            Ok(stream) => stream,
            Err(e) => return tracing::warn!("accepted connection dropped: {e}"),
        };
        let queue = &self.queues[self.next % self.queues.len()];
        self.next = self.next.wrapping_add(1);
        if queue.send(Handed { stream, watcher }).is_err() {
            tracing::error!("a serving thread has stopped; connection dropped");
        }
    }

    /// Ends the threads once their queues are closed; the tasks still on them (upgraded
    /// connections, which `serve` closed before) end with their runtime.
    pub fn stop(self) {
        drop(self.queues);
        for thread in self.threads {
            if thread.join().is_err() {
                tracing::error!("a serving thread panicked");
            }
        }
    }
}

/// Keeps a timer due within a second on this thread's runtime. Tokio wakes its timer
/// driver (an eventfd write, and one more `epoll_wait` round) whenever a timer is set
/// to fire before the driver's next wake-up: on an otherwise idle thread, every call's
/// timeout (the backend's `timeout`, seconds away) did, a system call a request seen
/// in `strace`. With this tick, those timers are set without waking anything.
async fn keep_timers_near() {
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
    }
}

/// Serves one connection on this thread's runtime: HTTP/1.1 and HTTP/2, upgrades
/// allowed, watched by the graceful shutdown.
fn serve_connection(
    stream: std::net::TcpStream,
    watcher: Watcher,
    app: &flexway::http::Current,
    builder: &auto::Builder<TokioExecutor>,
) {
    let stream = match tokio::net::TcpStream::from_std(stream) {
        Ok(stream) => stream,
        Err(e) => return tracing::warn!("connection dropped: {e}"),
    };
    let service = TowerToHyperService::new(app.clone());
    let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
    let connection = watcher.watch(connection);
    tokio::spawn(async move {
        if let Err(e) = connection.await {
            tracing::debug!("connection ended: {e}");
        }
    });
}
