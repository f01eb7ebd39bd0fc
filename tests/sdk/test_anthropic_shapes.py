"""The official `anthropic` Python SDK, unmodified, against the fake model's Messages API.

No gateway here: the SDK talks to the fake directly, so that its typed models and
stream accumulator prove the fake's `/v1/messages` shapes are the real API's. The
gateway's `kind: anthropic` tests then rely on a fake that speaks the API faithfully.
"""


import anthropic
import pytest
from processes import TARGET, start

PROMPT = "Say hello to the fake model please"
ECHO = f"Hello from fake-model! You said: {PROMPT}"
TOOLS = [
    {
        "name": "get_weather",
        "description": "The weather in a city",
        "input_schema": {"type": "object", "properties": {"echo": {"type": "string"}}},
    }
]


@pytest.fixture(scope="module")
def fake():
    """The fake's base URL, without `/v1`: the SDK appends `/v1/messages`."""
    proc, url = start([str(TARGET / "fake-model"), "--listen", "127.0.0.1:0"], "fake-model")
    yield url
    proc.kill()


def client(base_url):
    return anthropic.Anthropic(base_url=base_url, api_key="sk-ant-fake", max_retries=0)


def test_create_parses_into_the_sdk_types(fake):
    message = client(fake).messages.create(
        model="claude-fake",
        max_tokens=100,
        system="You are terse.",
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert isinstance(message, anthropic.types.Message)
    assert message.id.startswith("msg_fake_")
    assert message.role == "assistant" and message.model == "claude-fake"
    [block] = message.content
    assert isinstance(block, anthropic.types.TextBlock)
    assert block.text == ECHO
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.input_tokens == 16 and message.usage.output_tokens == 12
    assert message.usage.cache_creation_input_tokens == 0
    assert message.usage.cache_read_input_tokens == 0


def test_stop_sequence_and_cache_usage(fake):
    message = client(fake + "/s/cache").messages.create(
        model="claude-fake",
        max_tokens=100,
        stop_sequences=["fake-model"],
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert message.content[0].text == "Hello from "
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "fake-model"
    assert message.usage.cache_creation_input_tokens == 2048
    assert message.usage.cache_read_input_tokens == 1024


def test_max_tokens_cut(fake):
    message = client(fake).messages.create(
        model="claude-fake", max_tokens=3, messages=[{"role": "user", "content": PROMPT}]
    )
    assert message.content[0].text == "Hello from fake-model!"
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3


def test_stream_accumulates_the_same_text_and_usage(fake):
    with client(fake + "/s/cache,chunks=7").messages.stream(
        model="claude-fake", max_tokens=100, messages=[{"role": "user", "content": PROMPT}]
    ) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(pieces) == 7
    assert "".join(pieces) == ECHO
    assert final.content[0].text == ECHO
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == 10 and final.usage.output_tokens == 12
    assert final.usage.cache_read_input_tokens == 1024


def test_tool_use_created_and_streamed(fake):
    tools_client = client(fake + "/s/tool_use")
    message = tools_client.messages.create(
        model="claude-fake", max_tokens=100, tools=TOOLS, messages=[{"role": "user", "content": "weather in Paris"}]
    )
    assert message.stop_reason == "tool_use"
    text, call = message.content
    assert isinstance(text, anthropic.types.TextBlock)
    assert isinstance(call, anthropic.types.ToolUseBlock)
    assert call.id.startswith("toolu_fake_") and call.name == "get_weather"
    assert call.input == {"echo": "weather in Paris"}

    with tools_client.messages.stream(
        model="claude-fake", max_tokens=100, tools=TOOLS, messages=[{"role": "user", "content": "weather in Paris"}]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[1].type == "tool_use"
    assert final.content[1].input == {"echo": "weather in Paris"}

    # The tool's result goes back as the SDK writes it, and is accepted.
    reply = client(fake).messages.create(
        model="claude-fake",
        max_tokens=100,
        tools=TOOLS,
        messages=[
            {"role": "user", "content": "weather in Paris"},
            {"role": "assistant", "content": message.content},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]},
        ],
    )
    assert reply.content[0].text == "Hello from fake-model! You said: weather in Paris"


def test_overloaded_status_raises_overloaded_error(fake):
    with pytest.raises(anthropic.InternalServerError) as raised:
        client(fake + "/s/status=529").messages.create(
            model="claude-fake", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    assert raised.value.status_code == 529
    assert isinstance(raised.value, anthropic.OverloadedError)
    assert raised.value.body["error"] == {"type": "overloaded_error", "message": "Overloaded"}


def test_rate_limit_and_invalid_request_map_to_their_sdk_errors(fake):
    with pytest.raises(anthropic.RateLimitError):
        client(fake + "/s/status=429").messages.create(
            model="claude-fake", max_tokens=10, messages=[{"role": "user", "content": "hi"}]
        )
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(fake).messages.create(
            model="claude-fake", max_tokens=10, messages=[{"role": "user", "content": "hi"}], extra_body={"n": 2}
        )
    assert raised.value.body["error"]["message"] == "n: Extra inputs are not permitted"


def test_error_mid_stream_raises_after_the_text_so_far(fake):
    received = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        with client(fake + "/s/error_after=2").messages.stream(
            model="claude-fake", max_tokens=100, messages=[{"role": "user", "content": PROMPT}]
        ) as stream:
            for text in stream.text_stream:
                received.append(text)
    assert raised.value.body["error"]["type"] == "overloaded_error"
    assert len(received) == 2 and ECHO.startswith("".join(received))
