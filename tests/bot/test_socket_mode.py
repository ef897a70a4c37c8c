"""Socket Mode, as `hangdx serve` runs it with SLACK_APP_TOKEN set: server.serve() opens the socket through
apps.connections.open, and a /diagnose arriving over the websocket is acked and submitted.

The Slack side is local: the Web API stand-in (tests/slack_standin.py) plus apps.connections.open, and a
websocket server (the `websockets` package) speaking Slack's Socket Mode protocol as documented at
api.slack.com/apis/socket-mode: a `hello` message on connect, then envelopes
{"envelope_id", "type": "slash_commands", "payload": <the slash command's fields>, "accepts_response_payload"}
which the app acknowledges by sending back {"envelope_id": ..., "payload": ...}.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from hangdx.bot import server
from hangdx.bot.config import BotConfig
from hangdx.bot.request import DiagnoseRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slack_standin import Call, SlackStandin, _send  # noqa: E402

ws_server = pytest.importorskip("websockets.sync.server")

APP_TOKEN = "xapp-1-A0HANGDX01-1111-abcdef0123456789"
HELLO = {
    "type": "hello",
    "num_connections": 1,
    "debug_info": {
        "host": "applink-7fc4fdbb64-4x5xq",
        "build_number": 10,
        "approximate_connection_time": 18060,
    },
    "connection_info": {"app_id": "A0HANGDX01"},
}


class SocketSlack(SlackStandin):
    """The Web API stand-in plus apps.connections.open, which answers with the local websocket's URL."""

    ws_url: str = ""

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        if h.path.split("?", 1)[0] != "/api/apps.connections.open":
            return super()._handle(h)
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        with self._lock:
            self.calls.append(
                Call("apps.connections.open", {}, {k.lower(): v for k, v in h.headers.items()}, raw)
            )
        if not h.headers.get("Authorization", "").startswith("Bearer xapp-"):
            return _send(h, 200, {"ok": False, "error": "not_allowed_token_type"})
        return _send(h, 200, {"ok": True, "url": self.ws_url})


class SocketServer:
    """One websocket endpoint: says hello, records what the app sends, lets the test send envelopes."""

    def __init__(self) -> None:
        self.received: queue.Queue[dict[str, Any]] = queue.Queue()
        self.connected = threading.Event()
        self.conn: Any = None
        self.server = ws_server.serve(self._session, "127.0.0.1", 0, close_timeout=0.5)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return (
            f"ws://127.0.0.1:{self.server.socket.getsockname()[1]}/link/?ticket=hangdx-test&app_id=A0HANGDX01"
        )

    def _session(self, conn: Any) -> None:
        conn.send(json.dumps(HELLO))
        self.conn = conn
        self.connected.set()
        for message in conn:
            self.received.put(json.loads(message))

    def send(self, envelope: dict[str, Any]) -> None:
        self.conn.send(json.dumps(envelope))

    def close(self) -> None:
        self.server.shutdown()


class Recorder:
    def __init__(self) -> None:
        self.requests: queue.Queue[DiagnoseRequest] = queue.Queue()

    def submit(self, req: DiagnoseRequest) -> str:
        self.requests.put(req)
        return f"q-{req.job_id}"


@pytest.fixture
def served(monkeypatch) -> Iterator[tuple[SocketServer, SocketSlack, Recorder]]:
    """server.serve() in a thread, with its HTTP server and Socket Mode handler kept so they can stop."""
    from slack_bolt.adapter import socket_mode

    handlers: list[Any] = []
    servers: list[Any] = []

    class KeptHandler(socket_mode.SocketModeHandler):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            handlers.append(self)

    real_http_server = server.http_server

    def kept_http_server(*a: Any, **kw: Any) -> Any:
        servers.append(real_http_server(*a, **kw))
        return servers[-1]

    monkeypatch.setattr(socket_mode, "SocketModeHandler", KeptHandler)
    monkeypatch.setattr(server, "http_server", kept_http_server)
    ws = SocketServer()
    with SocketSlack() as slack:
        slack.ws_url = ws.url
        env = {
            "SLACK_BOT_TOKEN": "xoxb-1111-2222-hangdxtest",
            "SLACK_APP_TOKEN": APP_TOKEN,
            "SLACK_API_URL": slack.url,
        }
        rec = Recorder()
        thread = threading.Thread(
            target=server.serve,
            args=(BotConfig.from_env(env), rec.submit),
            kwargs={"port": 0},
            daemon=True,
        )
        thread.start()
        try:
            assert ws.connected.wait(10), "the app never opened the socket"
            yield ws, slack, rec
        finally:
            for h in handlers:
                h.close()
            for s in servers:
                s.close()
            thread.join(10)
            ws.close()


def slash_envelope(text: str, envelope_id: str = "1d5e3f7a-0c1b-4b8e-9a7e-0f5c7b1f2a3d") -> dict[str, Any]:
    payload = {
        "token": "gIkuvaNzQIHg97ATvDxqgjtO",
        "team_id": "T0HANGDX1",
        "team_domain": "hangdx-test",
        "channel_id": "C0ONCALL01",
        "channel_name": "oncall-training",
        "user_id": "U0ONCALL01",
        "user_name": "oncall",
        "command": "/diagnose",
        "text": text,
        "api_app_id": "A0HANGDX01",
        "is_enterprise_install": "false",
        "response_url": "https://hooks.slack.com/commands/T0HANGDX1/1234/abcd",
        "trigger_id": "13345224609.738474920.8088930838d88f008e0",
    }
    return {
        "envelope_id": envelope_id,
        "payload": payload,
        "type": "slash_commands",
        "accepts_response_payload": True,
    }


def test_serve_opens_the_socket_with_the_app_token(served):
    _, slack, _ = served
    [opened] = slack.calls_to("apps.connections.open")
    assert opened.headers["authorization"] == f"Bearer {APP_TOKEN}"


def test_a_slash_command_over_the_socket_is_acked_and_submitted(served):
    ws, _, rec = served
    ws.send(slash_envelope("job-7"))
    ack = ws.received.get(timeout=10)
    assert ack["envelope_id"] == "1d5e3f7a-0c1b-4b8e-9a7e-0f5c7b1f2a3d"
    assert ack["payload"]["response_type"] == "ephemeral"
    assert ack["payload"]["text"].startswith("Diagnosing job job-7")
    req = rec.requests.get(timeout=10)
    assert (req.job_id, req.source, req.requested_by, req.channel) == (
        "job-7",
        "slash",
        "U0ONCALL01",
        "C0ONCALL01",
    )


def test_a_bad_job_id_over_the_socket_is_refused_in_the_ack(served):
    ws, _, rec = served
    ws.send(slash_envelope("job;rm -rf /", envelope_id="e-2"))
    ack = ws.received.get(timeout=10)
    assert ack["envelope_id"] == "e-2"
    assert ack["payload"]["response_type"] == "ephemeral" and "Diagnosing" not in ack["payload"]["text"]
    assert rec.requests.empty()
