"""A local stand-in for the Slack Web API, for tests: answers like Slack, records every call.

Response shapes follow Slack's method docs (api.slack.com/methods/...): chat.postMessage returns
{"ok", "channel", "ts", "message"}, chat.postEphemeral {"ok", "message_ts"}, files.getUploadURLExternal
{"ok", "upload_url", "file_id"}, and a rate limit is HTTP 429 with a Retry-After header and
{"ok": false, "error": "ratelimited"}.

    with SlackStandin() as slack:
        WebClient(token="xoxb-...", base_url=slack.url)   # slack.url ends with "/api/"
        slack.fail("chat.postMessage", status=429, retry_after=1)
        slack.calls_to("chat.postMessage")[0].body["channel"]

Threads and files, for what people paste: `slack.say(channel, text, user=..., thread_ts=..., files=[...])` adds a
message a person wrote, `slack.upload(name, content, mimetype)` a file (served at its url_private_download only
with a bot token, as files.slack.com does); conversations.replies answers with the thread's messages, root first,
in the shape api.slack.com/methods/conversations.replies documents, paged by `limit` and `cursor`.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl

TEAM_ID = "T0HANGDX1"
BOT_USER_ID = "U0HANGDXBOT"
BOT_ID = "B0HANGDXBOT"


@dataclass
class Call:
    method: str  # "chat.postMessage", or "upload/<file id>" for the raw upload step, or "respond/<path>"
    body: dict[str, Any]
    headers: dict[str, str]
    raw: bytes = b""


@dataclass
class _Failure:
    status: int
    retry_after: int | None
    error: str | None
    times: int


@dataclass
class SlackStandin:
    calls: list[Call] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._failures: dict[str, list[_Failure]] = {}
        self._ts = itertools.count(100)
        self._files = itertools.count(1)
        self._server: ThreadingHTTPServer | None = None
        self.messages: dict[str, list[dict[str, Any]]] = {}  # channel -> messages, in order
        self.uploads: dict[str, tuple[bytes, str]] = {}  # file id -> (content, mimetype)
        self.delay = 0.0  # seconds every Web API answer takes (a slow Slack)
        self.respond_delay = 0.0  # seconds every response_url answer takes

    # -- lifecycle
    def start(self) -> SlackStandin:
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                standin._handle(self)

            def do_GET(self) -> None:  # noqa: N802
                standin._handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server:
            self._server.shutdown()
            self._server.server_close()

    def __enter__(self) -> SlackStandin:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def root(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    @property
    def url(self) -> str:
        """Base URL for WebClient(base_url=...)."""
        return self.root + "api/"

    # -- scripting and assertions
    def fail(
        self,
        method: str,
        status: int = 500,
        retry_after: int | None = None,
        error: str | None = None,
        times: int = 1,
    ) -> None:
        """The next `times` calls to `method` fail: HTTP `status` (429 + Retry-After), or ok=false `error`."""
        with self._lock:
            self._failures.setdefault(method, []).append(_Failure(status, retry_after, error, times))

    def calls_to(self, method: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.method == method]

    def next_ts(self) -> str:
        return f"1700000000.{next(self._ts):06d}"

    def say(
        self,
        channel: str,
        text: str,
        user: str = "U0PERSON01",
        thread_ts: str | None = None,
        files: list[dict[str, Any]] | None = None,
    ) -> str:
        """A message a person posts (with files they uploaded): its ts."""
        ts = self.next_ts()
        message: dict[str, Any] = {"type": "message", "user": user, "text": text, "ts": ts, "team": TEAM_ID}
        if thread_ts:
            message["thread_ts"] = thread_ts
        if files:
            message["files"] = files
            message["upload"] = True
        with self._lock:
            self.messages.setdefault(channel, []).append(message)
        return ts

    def upload(self, name: str, content: bytes, mimetype: str = "text/plain", filetype: str = "text") -> dict:
        """A file as Slack describes it in a message's `files` (files.info's shape)."""
        file_id = f"F0PASTED{next(self._files):04d}"
        with self._lock:
            self.uploads[file_id] = (content, mimetype)
        url = f"{self.root}files-pri/{TEAM_ID}-{file_id}/download/{name}"
        return {
            "id": file_id,
            "name": name,
            "title": name,
            "mimetype": mimetype,
            "filetype": filetype,
            "size": len(content),
            "mode": "hosted",
            "is_external": False,
            "url_private": url.replace("/download/", "/"),
            "url_private_download": url,
        }

    def _replies(self, body: dict[str, Any]) -> dict[str, Any]:
        channel, ts = body.get("channel"), body.get("ts")
        with self._lock:
            msgs = list(self.messages.get(channel, []))
        thread = [m for m in msgs if m["ts"] == ts or m.get("thread_ts") == ts]
        if not any(m["ts"] == ts for m in thread):
            return {"ok": False, "error": "thread_not_found"}
        start = int(body.get("cursor") or 0)
        limit = int(body.get("limit") or 1000)
        page = thread[start : start + limit]
        more = start + limit < len(thread)
        out: dict[str, Any] = {"ok": True, "messages": page, "has_more": more}
        out["response_metadata"] = {"next_cursor": str(start + limit) if more else ""}
        return out

    # -- the server side
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        path = h.path.split("?", 1)[0].lstrip("/")
        method = path[len("api/") :] if path.startswith("api/") else path
        body = _decode(raw, h.headers.get("Content-Type", ""))
        if "?" in h.path:  # GET methods (conversations.replies) send their arguments in the query
            body = {**dict(parse_qsl(h.path.split("?", 1)[1])), **body}
        if self.delay and path.startswith("api/"):
            time.sleep(self.delay)
        if self.respond_delay and path.startswith("respond/"):
            time.sleep(self.respond_delay)
        with self._lock:
            self.calls.append(Call(method, body, {k.lower(): v for k, v in h.headers.items()}, raw))
            failure = self._take_failure(method)
        if failure is not None:
            if failure.error:
                return _send(h, 200, {"ok": False, "error": failure.error})
            headers = {"Retry-After": str(failure.retry_after)} if failure.retry_after is not None else {}
            payload = {"ok": False, "error": "ratelimited"} if failure.status == 429 else None
            return _send(h, failure.status, payload, headers)
        if method.startswith("upload/"):
            return _send(h, 200, None, text=f"OK - {len(raw)}")
        if method.startswith("respond/"):
            return _send(h, 200, None, text="ok")
        if path.startswith("files-pri/"):
            file_id = path.split("/")[1].rsplit("-", 1)[-1]
            if not h.headers.get("Authorization", "").startswith("Bearer xox"):
                return _send(h, 302, None, {"Location": "https://hangdx-test.slack.com/?redir=login"})
            if file_id not in self.uploads:
                return _send(h, 404, None, text="not found")
            content, mimetype = self.uploads[file_id]
            return _send_bytes(h, content, mimetype)
        if not path.startswith("api/"):
            return _send(h, 404, None, text="not found")
        if not h.headers.get("Authorization", "").startswith("Bearer xox"):
            return _send(h, 200, {"ok": False, "error": "not_authed"})
        return _send(h, 200, self._answer(method, body))

    def _take_failure(self, method: str) -> _Failure | None:
        queue = self._failures.get(method) or []
        if not queue:
            return None
        f = queue[0]
        f.times -= 1
        if f.times <= 0:
            queue.pop(0)
        return f

    def _answer(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        channel = body.get("channel")
        if method == "auth.test":
            return {
                "ok": True,
                "url": "https://hangdx-test.slack.com/",
                "team": "hangdx-test",
                "user": "hangdx",
                "team_id": TEAM_ID,
                "user_id": BOT_USER_ID,
                "bot_id": BOT_ID,
                "is_enterprise_install": False,
            }
        if method == "chat.postMessage":
            ts = self.next_ts()
            message = {
                "type": "message",
                "subtype": "bot_message",
                "text": body.get("text", ""),
                "ts": ts,
                "bot_id": BOT_ID,
                "user": BOT_USER_ID,
                "team": TEAM_ID,
            }
            if body.get("blocks"):
                message["blocks"] = _maybe_json(body["blocks"])
            if body.get("thread_ts"):
                message["thread_ts"] = body["thread_ts"]
            with self._lock:
                self.messages.setdefault(str(channel), []).append(message)
            return {"ok": True, "channel": channel, "ts": ts, "message": message}
        if method == "conversations.replies":
            return self._replies(body)
        if method == "chat.update":
            return {
                "ok": True,
                "channel": channel,
                "ts": body.get("ts"),
                "text": body.get("text", ""),
                "message": {"text": body.get("text", ""), "user": BOT_USER_ID, "bot_id": BOT_ID},
            }
        if method == "chat.postEphemeral":
            return {"ok": True, "message_ts": self.next_ts()}
        if method == "files.getUploadURLExternal":
            file_id = f"F0HANGDX{next(self._files):04d}"
            return {"ok": True, "upload_url": f"{self.root}upload/{file_id}", "file_id": file_id}
        if method == "files.completeUploadExternal":
            files = _maybe_json(body.get("files") or "[]")
            return {
                "ok": True,
                "files": [{"id": f.get("id"), "title": f.get("title") or "", "name": ""} for f in files],
            }
        if method == "files.info":
            return {"ok": True, "file": {"id": body.get("file"), "name": "", "title": ""}}
        if method == "users.info":
            uid = body.get("user", "")
            return {
                "ok": True,
                "user": {
                    "id": uid,
                    "team_id": TEAM_ID,
                    "name": f"user-{uid.lower()}",
                    "real_name": f"User {uid}",
                    "tz": "Europe/Berlin",
                    "is_bot": False,
                    "profile": {"real_name": f"User {uid}", "display_name": f"user-{uid.lower()}"},
                },
            }
        return {"ok": False, "error": "unknown_method"}


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _decode(raw: bytes, content_type: str) -> dict[str, Any]:
    if "application/json" in content_type:
        try:
            data = json.loads(raw or b"{}")
            return data if isinstance(data, dict) else {"_json": data}
        except ValueError:
            return {}
    if "application/x-www-form-urlencoded" in content_type:
        return dict(parse_qsl(raw.decode("utf-8", "replace")))
    return {}


def _send(
    h: BaseHTTPRequestHandler,
    status: int,
    payload: dict[str, Any] | None,
    headers: dict[str, str] | None = None,
    text: str = "",
) -> None:
    data = json.dumps(payload).encode() if payload is not None else text.encode()
    h.send_response(status)
    h.send_header("Content-Type", "application/json; charset=utf-8" if payload is not None else "text/plain")
    h.send_header("Content-Length", str(len(data)))
    for k, v in (headers or {}).items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(data)


def _send_bytes(h: BaseHTTPRequestHandler, data: bytes, content_type: str) -> None:
    h.send_response(200)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)
