"""Realtime sessions with the `websockets` Python client, as a consuming team's code
(or a browser, by the subprotocol) opens them against `flexway serve`.

Starts the project's fake model server (its realtime upstream: 20 input and 5 output
tokens a response) and the real gateway binary on free ports.
"""

import hashlib
import json
import pathlib
import tempfile

import pytest
from processes import TARGET, start
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

KEY = "sk-sdk-realtime-key"
# A tenant whose daily tokens run out after four responses (see the config).
CAPPED_KEY = "sk-sdk-realtime-capped"


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
  team:
    keys:
      - sha256: {hashlib.sha256(KEY.encode()).hexdigest()}
  capped:
    keys:
      - sha256: {hashlib.sha256(CAPPED_KEY.encode()).hexdigest()}
    budgets: {{tokens_per_day: 130}}
ai:
  default_backend: rt
  budget: {{default_max_tokens: 50, min_completion_tokens: 10}}
  backends:
    rt:
      url: {model_url}/v1
      capabilities: [chat, realtime]
      price: {{input_per_mtok_eur: 1.0, output_per_mtok_eur: 2.0}}
"""
    )
    flexway, url = start(
        [str(TARGET / "flexway"), "serve", "--config", str(config), "--listen", "127.0.0.1:0"], "flexway"
    )
    yield url.replace("http://", "ws://") + "/v1/realtime?model=gpt-realtime"
    flexway.kill()
    model.kill()


def response(ws):
    ws.send(json.dumps({"type": "response.create"}))
    while True:
        event = json.loads(ws.recv(timeout=10))
        if event["type"] == "response.done":
            return event


def test_a_browser_opens_a_session_with_the_key_subprotocol(gateway):
    with connect(gateway, subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"]) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        done = response(ws)
        assert done["response"]["usage"] == {"total_tokens": 25, "input_tokens": 20, "output_tokens": 5}


def test_a_server_opens_a_session_with_its_bearer_key_and_messages_pass_untouched(gateway):
    with connect(gateway, additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:
        assert json.loads(ws.recv(timeout=10))["type"] == "session.created"
        event = json.dumps({"type": "input_audio_buffer.append", "audio": "AAAA"})
        ws.send(event)
        assert ws.recv(timeout=10) == event
        ws.send(b"\x00\x01\x02")
        assert ws.recv(timeout=10) == b"\x00\x01\x02"


def test_a_bad_key_is_refused_before_the_upgrade(gateway):
    with pytest.raises(InvalidStatus) as refused:
        connect(gateway, additional_headers={"Authorization": "Bearer sk-wrong"})
    assert refused.value.response.status_code == 401
    assert json.loads(refused.value.response.body)["error"]["code"] == "invalid_api_key"


def test_the_hard_cap_closes_the_session_with_4429(gateway):
    with connect(gateway, additional_headers={"Authorization": f"Bearer {CAPPED_KEY}"}) as ws:
        ws.recv(timeout=10)
        for _ in range(4):
            response(ws)
        # An idle session holds no allowance: the cap is met when the next response
        # is asked for, and that ends the session.
        ws.send(json.dumps({"type": "response.create"}))
        with pytest.raises(ConnectionClosed) as closed:
            ws.recv(timeout=10)
    assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (4429, "budget_exceeded")
