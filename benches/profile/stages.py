import sys, re, collections
# innermost matching stage per sample (stack printed leaf first by perf script)
stages = [
 ("audit record: line and write", [r"http::record::write", r"audit::sinks"]),
 ("metrics", [r"flexway::metrics"]),
 ("settle (ledger)", [r"Ticket::settle", r"ticket::Settling", r"MemoryBudgetStore.*settle"]),
 ("end of call (draft, pace, rest of end)", [r"drive::end::", r"record::Draft", r"drive::pace"]),
 ("admission and reserve (ledger)", [r"admission::decide", r"admit::reserve", r"reserve_guarded", r"MemoryBudgetStore.*reserve"]),
 ("answer read (usage) and formatted", [r"openai::Answer::read", r"format::Format::answer", r"dispatch.*Http.*read", r"chain::try_one"]),
 ("upstream write (send)", [r"h1::head::poll_send"]),
 ("upstream read (head, body)", [r"h1::head::poll_head", r"h1::conn::Conn::poll_read", r"h1::body", r"pool::Pool::take", r"h1::pool"]),
 ("upstream request built", [r"upstream_body", r"Attempt>::prepare", r"UpstreamClient"]),
 ("request parse (JSON, model)", [r"Inbound::parse", r"ChatRequest::parse", r"read_body", r"models::Inbound"]),
 ("identity (key)", [r"identify"]),
 ("routing and attempt chain", [r"chain::attempt_chain", r"dispatch::attempt", r"routing::"]),
 ("driver (rest of drive)", [r"drive::drive", r"Door>::call", r"models::Model"]),
 ("tracing span", [r"tracing_subscriber", r"tracing_core", r"sharded_slab"]),
 ("router, tower, request id", [r"axum::", r"tower::", r"http::named", r"reload::Current"]),
 ("hyper server: read and parse the request", [r"hyper::proto::h1::conn.*poll_read_head", r"Http1Transaction>::parse", r"hyper::proto::h1::io.*poll_read_from_io"]),
 ("hyper server: write the answer", [r"hyper::proto::h1::io::Buffered.*poll_flush", r"hyper::proto::h1::conn.*write_head", r"Http1Transaction>::encode", r"hyper::proto::h1::dispatch.*poll_write"]),
 ("runtime, epoll, scheduling", [r"tokio::runtime::(scheduler|task|context|time|io::driver)", r"epoll", r"workers::"]),
]
comp = [(name, [re.compile(p) for p in pats]) for name, pats in stages]
counts = collections.Counter(); kernel = collections.Counter(); total = 0
sample = []
def flush():
    global total
    if not sample: return
    total += 1
    k = sample[0][1]
    found = "other"
    for fn in [s[0] for s in sample if not s[1]]:
        hit = None
        for name, pats in comp:
            if any(p.search(fn) for p in pats): hit = name; break
        if hit: found = hit; break
    counts[found] += 1
    if k: kernel[found] += 1
for line in sys.stdin:
    line = line.rstrip("\n")
    if not line.strip():
        flush(); sample = []; continue
    if line.startswith("\t") or line.startswith(" "):
        parts = line.strip().split(" ", 1)
        if len(parts) == 2:
            fn = parts[1]
            sample.append((fn, "kernel" in fn))
flush()
per_call = float(sys.argv[1]) if len(sys.argv) > 1 else 0
print(f"{'stage':45} {'share':>7} {'µs/call':>8} {'of it kernel':>12}")
for name, c in counts.most_common():
    print(f"{name:45} {100*c/total:6.1f}% {per_call*c/total:8.1f} {100*kernel[name]/c:11.0f}%")
print("samples", total)
