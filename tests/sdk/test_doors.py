"""The official SDKs, unmodified, through the gateway's two other front doors.

`openai`'s `client.responses.create(...)` (SPEC §2.1) and `anthropic`'s
`client.messages.create/stream/count_tokens` (SPEC §2.2) against `flexway serve`,
each door served once by an OpenAI-kind backend and once by an Anthropic-kind one
(both the project's fake model server), as any consuming team would use them.
"""

import hashlib
import pathlib
import tempfile

import anthropic
import openai
import pytest
from processes import TARGET, start

# A tenant routed to an OpenAI-kind backend, and one routed to an Anthropic-kind one.
KEYS = {"openai": "sk-doors-openai", "anthropic": "sk-doors-anthropic"}
TOOLS = [
    {
        "type": "function",
        "name": "lookup",
        "description": "Looks a word up",
        "parameters": {"type": "object", "properties": {"echo": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def gateway():
    model, model_url = start([str(TARGET / "fake-model"), "--listen", "127.0.0.1:0"], "fake-model")
    config = pathlib.Path(tempfile.mkdtemp()) / "flexway.yaml"
    config.write_text(
        f"""version: 1
store: {{kind: memory}}
audit: {{sink: stdout}}
tenants:
  via-openai:
    keys:
      - sha256: {hashlib.sha256(KEYS["openai"].encode()).hexdigest()}
  via-anthropic:
    keys:
      - sha256: {hashlib.sha256(KEYS["anthropic"].encode()).hexdigest()}
    backend: claude
  broke:
    keys:
      - sha256: {hashlib.sha256(b"sk-doors-broke").hexdigest()}
    budgets: {{tokens_per_day: 1}}
ai:
  default_backend: gpt
  backends:
    gpt:
      url: {model_url}/s/tool_use,chunks=4/v1
      default_model: gpt-fake
    claude:
      kind: anthropic
      url: {model_url}/s/tool_use,chunks=4
      default_model: claude-fake
"""
    )
    gw, gw_url = start(
        [str(TARGET / "flexway"), "serve", "--config", str(config), "--listen", "127.0.0.1:0"], "flexway"
    )
    yield gw_url
    gw.kill()
    model.kill()


@pytest.fixture(params=["openai", "anthropic"])
def kind(request):
    """The kind of backend that serves the call."""
    return request.param


@pytest.fixture
def oa(gateway, kind):
    return openai.OpenAI(base_url=gateway + "/v1", api_key=KEYS[kind], max_retries=0)


@pytest.fixture
def claude(gateway, kind):
    return anthropic.Anthropic(base_url=gateway, api_key=KEYS[kind], max_retries=0)


def test_responses_create(oa):
    response = oa.responses.create(
        model="anything", instructions="Be brief.", input="hello responses", max_output_tokens=60
    )
    assert response.status == "completed"
    assert "hello responses" in response.output_text
    assert response.usage.input_tokens > 0 and response.usage.output_tokens > 0


def test_responses_stream(oa):
    stream = oa.responses.create(
        model="anything",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "stream responses"}]}],
        stream=True,
    )
    events = list(stream)
    assert events[0].type == "response.created"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert "stream responses" in text
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens > 0


def test_responses_stream_helper_accumulates(oa):
    with oa.responses.stream(model="anything", input="stream helper") as stream:
        final = stream.get_final_response()
    assert "stream helper" in final.output_text


def test_responses_tool_call_round_trip(oa):
    first = oa.responses.create(model="anything", input="find cats", tools=TOOLS)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "lookup" and "find cats" in call.arguments
    follow = oa.responses.create(
        model="anything",
        tools=TOOLS,
        input=[
            {"role": "user", "content": "find cats"},
            call,
            {"type": "function_call_output", "call_id": call.call_id, "output": "felines"},
        ],
    )
    assert follow.status == "completed"
    # The OpenAI-kind fake answers what the tool said; the Anthropic one calls again.
    assert "felines" in follow.output_text or any(i.type == "function_call" for i in follow.output)


def test_responses_streamed_tool_call(oa):
    with oa.responses.stream(model="anything", input="find dogs", tools=TOOLS) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    assert call.name == "lookup" and call.arguments == "".join(deltas)
    assert "find dogs" in call.arguments and call.call_id


def test_responses_refuses_stored_state_naming_the_field(oa):
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="anything", input="x", store=True)
    assert err.value.code == "invalid_request" and err.value.param == "store"
    with pytest.raises(openai.BadRequestError) as err:
        oa.responses.create(model="anything", input="x", previous_response_id="resp_1")
    assert err.value.param == "previous_response_id"


def test_messages_create(claude):
    message = claude.messages.create(
        model="claude-anything",
        max_tokens=100,
        system="You are terse.",
        messages=[{"role": "user", "content": "hello messages"}],
    )
    assert isinstance(message, anthropic.types.Message)
    assert "hello messages" in message.content[0].text
    assert message.stop_reason == "end_turn"
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_messages_stream(claude):
    with claude.messages.stream(
        model="claude-anything", max_tokens=100, messages=[{"role": "user", "content": "stream messages"}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "stream messages" in "".join(pieces)
    assert final.content[0].text == "".join(pieces)
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_messages_tool_use(claude):
    tools = [{"name": "lookup", "input_schema": {"type": "object", "properties": {"echo": {"type": "string"}}}}]
    message = claude.messages.create(
        model="claude-anything", max_tokens=100, tools=tools, messages=[{"role": "user", "content": "find cats"}]
    )
    assert message.stop_reason == "tool_use"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "lookup" and use.input == {"echo": "find cats"}
    follow = claude.messages.create(
        model="claude-anything",
        max_tokens=100,
        tools=tools,
        messages=[
            {"role": "user", "content": "find cats"},
            {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "felines"}]},
        ],
    )
    assert follow.usage.output_tokens > 0


def test_count_tokens(claude):
    counted = claude.messages.count_tokens(
        model="claude-anything", messages=[{"role": "user", "content": "hello there, how are you"}]
    )
    assert counted.input_tokens == 13  # 24 bytes at 4 a token (6), 4 framing, 3 priming


def test_messages_errors_are_the_sdk_s_exceptions(gateway):
    bad = anthropic.Anthropic(base_url=gateway, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "invalid_api_key" in str(err.value)
    broke = anthropic.Anthropic(base_url=gateway, api_key="sk-doors-broke", max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as err:
        broke.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "budget_exceeded" in str(err.value)
    assert err.value.response.headers.get("retry-after")


def test_bearer_auth_works_on_the_messages_door(gateway):
    bearer = anthropic.Anthropic(base_url=gateway, auth_token=KEYS["openai"], max_retries=0)
    message = bearer.messages.create(model="m", max_tokens=20, messages=[{"role": "user", "content": "hi bearer"}])
    assert "hi bearer" in message.content[0].text
