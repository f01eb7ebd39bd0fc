// The official TypeScript SDK's client over Streamable HTTP, as an agent would use it:
// connect to an MCP endpoint with a Bearer key, list the tools, call one, and print
// what it saw as one JSON object on stdout. With --session it continues a session
// opened elsewhere (another process of the same gateway) instead of initializing.
//
//   node client.mjs --url URL [--key KEY] [--call TOOL --args JSON]
//                   [--session ID --protocol-version V] [--end]
//
// Exits 1 with the error on stderr when the SDK throws (a JSON-RPC error included).
import { parseArgs } from "node:util";
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const { values } = parseArgs({
  options: {
    url: { type: "string" },
    key: { type: "string" },
    call: { type: "string" },
    args: { type: "string", default: "{}" },
    session: { type: "string" },
    "protocol-version": { type: "string" },
    end: { type: "boolean", default: false },
  },
});
if (!values.url) {
  console.error("usage: node client.mjs --url URL [--key KEY] [--call TOOL --args JSON] [--session ID] [--end]");
  process.exit(2);
}

const headers = values.key ? { Authorization: `Bearer ${values.key}` } : {};
const transport = new StreamableHTTPClientTransport(new URL(values.url), {
  requestInit: { headers },
  sessionId: values.session,
});
const client = new Client({ name: "flexway-tests-ts", version: "1.0.0" });

try {
  // With a session id the SDK skips initialize (it is a reconnection); the version
  // negotiated when the session was opened goes on every request.
  if (values.session && values["protocol-version"]) {
    transport.setProtocolVersion(values["protocol-version"]);
  }
  await client.connect(transport);
  const out = {
    session: transport.sessionId ?? null,
    protocol_version: transport.protocolVersion ?? values["protocol-version"] ?? null,
    server: client.getServerVersion() ?? null,
  };
  const tools = [];
  let cursor;
  do {
    const page = await client.listTools(cursor ? { cursor } : {});
    tools.push(...page.tools);
    cursor = page.nextCursor;
  } while (cursor);
  out.tools = tools.map((tool) => tool.name);
  if (values.call) {
    out.result = await client.callTool({ name: values.call, arguments: JSON.parse(values.args) });
  }
  if (values.end) {
    await transport.terminateSession();
    out.ended = true;
  }
  await client.close();
  console.log(JSON.stringify(out));
} catch (error) {
  console.error(JSON.stringify({ error: String(error?.message ?? error), code: error?.code ?? null, data: error?.data ?? null }));
  process.exit(1);
}
