"""The official MCP Python SDK's client (`mcp` on PyPI) over Streamable HTTP, as an
agent would use it: connect to an MCP endpoint with a Bearer key, list the tools,
call one, and print what it saw as one JSON object on stdout.

    python client.py --url URL [--key KEY] [--call TOOL --args JSON]
                     [--mode auto|legacy|2026-07-28]

`--mode auto` (the SDK's default) asks `server/discover` first and speaks the
stateless 2026-07-28 revision when the server has it, the initialize handshake
otherwise; `legacy` forces the handshake (a session). Exits 1 with the error on
stderr when the SDK raises (a JSON-RPC error included).
"""

import argparse
import asyncio
import json
import sys

from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client
from mcp.shared.exceptions import MCPError


async def run(args: argparse.Namespace) -> dict:
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    async with create_mcp_http_client(headers=headers) as http:
        transport = streamable_http_client(args.url, http_client=http)
        async with Client(transport, mode=args.mode, cache=None) as client:
            out: dict = {
                "protocol_version": client.protocol_version,
                "server": client.server_info.model_dump(mode="json") if client.server_info else None,
            }
            tools, cursor = [], None
            while True:
                page = await client.list_tools(cursor=cursor)
                tools += [tool.name for tool in page.tools]
                cursor = page.next_cursor
                if not cursor:
                    break
            out["tools"] = tools
            if args.call:
                result = await client.call_tool(args.call, json.loads(args.args))
                out["result"] = result.model_dump(mode="json", by_alias=True, exclude_none=True)
            return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key")
    parser.add_argument("--call")
    parser.add_argument("--args", default="{}")
    parser.add_argument("--mode", default="auto")
    args = parser.parse_args()
    try:
        out = asyncio.run(run(args))
    except Exception as error:
        # The SDK's task groups wrap what was raised: the JSON-RPC error, if one is inside.
        rpc = first_rpc_error(error)
        if rpc is not None:
            print(json.dumps({"error": rpc.error.message, "code": rpc.error.code, "data": rpc.error.data}), file=sys.stderr)
        else:  # a transport failure: the whole story
            print(json.dumps({"error": repr(error)}), file=sys.stderr)
        sys.exit(1)
    print(json.dumps(out))


def first_rpc_error(error: BaseException) -> MCPError | None:
    if isinstance(error, MCPError):
        return error
    for inner in getattr(error, "exceptions", ()):
        found = first_rpc_error(inner)
        if found is not None:
            return found
    return None


if __name__ == "__main__":
    main()
