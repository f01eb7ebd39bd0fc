"""The official `openai` Python SDK, unmodified, against `flexway serve`.

Starts the project's fake model server and the real gateway binary on free ports,
then uses the SDK as any consuming team would: chat, streamed chat, embeddings,
model list, and the SDK's own exceptions carrying Flexway's error codes.
"""

import hashlib
import os
import pathlib
import tempfile

import openai
import pytest
from processes import TARGET, start

KEY = "sk-sdk-test-key"
# A tenant routed to a backend whose stream carries a malformed event mid-way.
FAULTY_KEY = "sk-sdk-faulty-key"
# A tenant routed to an Anthropic Messages backend (the fake's Anthropic surface).
CLAUDE_KEY = "sk-sdk-claude-key"
# A tenant allowed one call a minute (SPEC §14), and one whose day's budget is spent
# (a token a day: none of its calls fits).
PACED_KEY = "sk-sdk-paced-key"
CAPPED_KEY = "sk-sdk-capped-key"


@pytest.fixture(scope="module")
def gateway():
    model, model_url = start([str(TARGET / "fake-model"), "--listen", "127.0.0.1:0"], "fake-model")
    workdir = tempfile.mkdtemp()
    config = pathlib.Path(workdir) / "flexway.yaml"
    config.write_text(
        f"""version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  sdk:
    keys:
      - sha256: {hashlib.sha256(KEY.encode()).hexdigest()}
  faulty:
    keys:
      - sha256: {hashlib.sha256(FAULTY_KEY.encode()).hexdigest()}
    backend: malformed
  claude:
    keys:
      - sha256: {hashlib.sha256(CLAUDE_KEY.encode()).hexdigest()}
    backend: claude
  paced:
    keys:
      - sha256: {hashlib.sha256(PACED_KEY.encode()).hexdigest()}
    limits: {{requests_per_minute: 1}}
  capped:
    keys:
      - sha256: {hashlib.sha256(CAPPED_KEY.encode()).hexdigest()}
    budgets: {{tokens_per_day: 1}}
ai:
  default_backend: chat
  capabilities: {{embeddings: embed}}
  backends:
    chat:
      url: {model_url}/v1
      aliases: {{chat-default: fake-chat}}
    embed:
      url: {model_url}/v1
      capabilities: [embeddings]
      default_model: fake-embed
    malformed:
      url: {model_url}/s/malformed_at=2/v1
    claude:
      kind: anthropic
      url: {model_url}/s/tool_use
      auth: {{type: header, name: x-api-key, secret: "env:SDK_ANTHROPIC_KEY"}}
      default_model: claude-fake
"""
    )
    os.environ["SDK_ANTHROPIC_KEY"] = "sk-ant-sdk"
    gw, gw_url = start(
        [str(TARGET / "flexway"), "serve", "--config", str(config), "--listen", "127.0.0.1:0"], "flexway"
    )
    yield gw_url
    gw.kill()
    model.kill()


@pytest.fixture
def client(gateway):
    return openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)


def test_chat(client):
    completion = client.chat.completions.create(
        model="chat-default", messages=[{"role": "user", "content": "hello sdk"}]
    )
    assert "hello sdk" in completion.choices[0].message.content
    assert completion.usage.total_tokens > 0


def test_streamed_chat(client):
    stream = client.chat.completions.create(
        model="chat-default", messages=[{"role": "user", "content": "stream please"}], stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert "stream please" in text


def test_streamed_chat_with_usage(client):
    stream = client.chat.completions.create(
        model="chat-default",
        messages=[{"role": "user", "content": "count me"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


def test_embeddings(client):
    result = client.embeddings.create(model="anything", input=["first", "second"])
    assert len(result.data) == 2
    assert len(result.data[0].embedding) > 0


def test_models(client):
    names = [m.id for m in client.models.list()]
    assert "chat-default" in names


def test_headers_reach_the_sdk(client):
    raw = client.chat.completions.with_raw_response.create(
        model="chat-default", messages=[{"role": "user", "content": "hi"}]
    )
    assert raw.headers["flexway-request-id"].startswith("req_")
    assert raw.headers["flexway-backend"] == "chat"


def test_bad_key_is_authentication_error_with_spec_code(gateway):
    bad = openai.OpenAI(base_url=gateway + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert err.value.code == "invalid_api_key"
    assert err.value.status_code == 401


def test_unknown_agent_is_permission_denied_with_spec_code(client):
    with pytest.raises(openai.PermissionDeniedError) as err:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], extra_headers={"Flexway-Agent": "ghost"}
        )
    assert err.value.code == "unknown_agent"


def test_bad_request_is_bad_request_error_with_spec_code(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="m", messages=[])
    assert err.value.code == "invalid_request"
    assert err.value.param == "messages"


def test_a_stream_broken_mid_way_raises_api_error_with_the_spec_code(gateway):
    faulty = openai.OpenAI(base_url=gateway + "/v1", api_key=FAULTY_KEY, max_retries=0)
    stream = faulty.chat.completions.create(
        model="chat-default", messages=[{"role": "user", "content": "hello there"}], stream=True
    )
    received = []
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
    assert raised.value.code == "upstream_error"
    assert "".join(received).startswith("Hello"), "the content before the fault was relayed"


@pytest.fixture
def claude(gateway):
    return openai.OpenAI(base_url=gateway + "/v1", api_key=CLAUDE_KEY, max_retries=0)


def test_chat_through_an_anthropic_backend(claude):
    completion = claude.chat.completions.create(
        model="anything",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello claude"}],
    )
    assert completion.object == "chat.completion"
    assert completion.model == "claude-fake"
    assert "hello claude" in completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage.prompt_tokens > 0 and completion.usage.completion_tokens > 0


def test_tool_calls_through_an_anthropic_backend(claude):
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    completion = claude.chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "find cats"}], tools=tools
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup"
    assert '"find cats"' in call.function.arguments
    # The result goes back, as the SDK's users write it.
    follow = claude.chat.completions.create(
        model="anything",
        tools=tools,
        messages=[
            {"role": "user", "content": "find cats"},
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "felines"},
        ],
    )
    assert follow.choices[0].message.tool_calls[0].function.name == "lookup"


def test_streamed_chat_through_an_anthropic_backend(claude):
    stream = claude.chat.completions.create(
        model="anything",
        messages=[{"role": "user", "content": "stream claude"}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "stream claude" in text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0


class Counted:
    """An SDK client whose HTTP requests are counted, and whose retry waits are noted
    instead of slept (the SDK's own retry logic runs unchanged)."""

    def __init__(self, gateway, key, monkeypatch):
        import httpx

        self.requests = 0
        self.waits = []

        def count(_request):
            self.requests += 1

        monkeypatch.setattr(openai._base_client.time, "sleep", self.waits.append)
        http = httpx.Client(event_hooks={"request": [count]})
        self.client = openai.OpenAI(base_url=gateway + "/v1", api_key=key, max_retries=2, http_client=http)

    def chat(self):
        return self.client.chat.completions.create(
            model="chat-default", messages=[{"role": "user", "content": "hi"}], max_tokens=8
        )


def test_the_sdk_retries_a_rate_limited_call_by_itself(gateway, monkeypatch):
    import time as clock

    # Both calls in one UTC minute (the window).
    if clock.time() % 60 > 50:
        clock.sleep(61 - clock.time() % 60)
    paced = Counted(gateway, PACED_KEY, monkeypatch)
    paced.chat()
    with pytest.raises(openai.RateLimitError) as err:
        paced.chat()
    assert err.value.code == "rate_limit_exceeded"
    # The first call, then the second and the SDK's two retries, each after the
    # window's Retry-After (at most 60 s; `x-should-retry: true`).
    assert paced.requests == 4
    assert len(paced.waits) == 2 and all(0 < wait <= 60 for wait in paced.waits), paced.waits


def test_the_sdk_does_not_retry_a_budget_exceeded_call(gateway, monkeypatch):
    capped = Counted(gateway, CAPPED_KEY, monkeypatch)
    with pytest.raises(openai.RateLimitError) as err:
        capped.chat()
    assert err.value.code == "budget_exceeded"
    assert capped.requests == 1 and capped.waits == [], "x-should-retry: false is obeyed"
