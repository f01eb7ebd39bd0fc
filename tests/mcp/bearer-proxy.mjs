// The conformance suite's server runner sends no credential, and Flexway's /mcp
// answers 401 without one: this loopback proxy adds a tenant's key to every request,
// as an agent's own HTTP client would, and passes everything else through untouched
// (method, path, the other headers, Host and Origin included, and the body both ways,
// streamed: an SSE answer is relayed event by event).
//
//   node bearer-proxy.mjs --target http://127.0.0.1:PORT --key KEY
//
// Prints `listening on http://127.0.0.1:PORT` once it accepts connections.
import http from "node:http";
import { parseArgs } from "node:util";

const { values } = parseArgs({ options: { target: { type: "string" }, key: { type: "string" } } });
if (!values.target || !values.key) {
  console.error("usage: node bearer-proxy.mjs --target ORIGIN --key KEY");
  process.exit(2);
}
const target = new URL(values.target);

const server = http.createServer((request, response) => {
  const upstream = http.request(
    {
      host: target.hostname,
      port: target.port,
      method: request.method,
      path: request.url,
      headers: { ...request.headers, authorization: `Bearer ${values.key}` },
    },
    (answer) => {
      response.writeHead(answer.statusCode ?? 502, answer.headers);
      answer.pipe(response);
    },
  );
  upstream.on("error", (error) => {
    if (!response.headersSent) response.writeHead(502, { "content-type": "text/plain" });
    response.end(`bearer-proxy: ${error.message}`);
  });
  // The client gone: so is the upstream request (Flexway sees the stream closed).
  response.on("close", () => upstream.destroy());
  request.pipe(upstream);
});
server.listen(0, "127.0.0.1", () => {
  console.log(`listening on http://127.0.0.1:${server.address().port}`);
});
