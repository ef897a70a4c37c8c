"""`hangdx console`: talk to the bot from a terminal, before (or without) wiring Slack.

As Errbot's text backend does, the console is a transport, not a second bot: what a person types becomes the
signed Slack request Slack would send (a slash command, an `app_mention` event, a button's `block_actions`, a
dialog's `view_submission`), handed to the same Bolt app `hangdx serve` runs (bot/slack/app.py) through its
`/slack/events` route; the same service queues the diagnosis in Redis, a real `hangdx worker` runs it, and what
the bot says to Slack's Web API reaches a small Web API on loopback that prints it as text. Nothing of the
handlers is re-implemented here, so what works in the console works in Slack, and the other way round.
"""

from __future__ import annotations

import argparse
import html
import itertools
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO
from urllib.parse import parse_qsl, urlencode

from hangdx.probes.text import printable

CHANNEL = "C0HANGDXCON"
USER = "U0HANGDXYOU"
BOT_USER = "U0HANGDXBOT"
BOT_ID = "B0HANGDXBOT"
TEAM = "T0HANGDXCON"
MAX_PASTE = 20 << 20  # bytes of one file given to `@hangdx analyze PATH` (Slack's own cap for the bot: 20 MB)
USAGE = """\
hangdx console: type what you would type in Slack.
  /diagnose JOBID | status | handoff | history HOST|JOB | help
  @hangdx diagnose JOBID | status | handoff | help
  @hangdx analyze PATH...      paste these files in a new thread and ask hangdx to read them
  @hangdx analyze              ask again, in the thread of the last paste
  @hangdx analyze TEXT         paste TEXT with the mention
  press BUTTON [JOBID]         press a button under the latest verdict (of JOBID): re-run, full stacks,
                               acknowledge, resolve, hand off
  note TEXT                    answer the Resolve dialog (how it was fixed)
  wait                         until every queued diagnosis has answered
  help | quit                  (end of input waits, then quits)"""


class ConsoleError(Exception):
    """What the console cannot do (a bad command, a file it cannot read): one line."""


# -- what the bot says, as text ---------------------------------------------------------------------------------

_LINK = re.compile(
    r"<(https?://[^|>]+)\|([^>]+)>|<(https?://[^>]+)>|<@([A-Z0-9]+)(?:\|[^>]*)?>|<!([a-z]+)[^>]*>"
)


def mrkdwn_text(text: Any) -> str:
    """Slack mrkdwn as a terminal shows it: links as `label <url>`, mentions as @id, entities decoded, control
    characters escaped (what the bot says quotes nodes and logs)."""

    def link(m: re.Match) -> str:
        if m.group(1):
            return f"{m.group(2)} <{m.group(1)}>"
        if m.group(3):
            return m.group(3)
        if m.group(4):
            return "@you" if m.group(4) == USER else f"@{m.group(4)}"
        return f"@{m.group(5)}"

    return printable(html.unescape(_LINK.sub(link, str(text or ""))))


def _text_of(obj: Any) -> str:
    return mrkdwn_text(obj.get("text")) if isinstance(obj, dict) else ""


def blocks_text(blocks: Any) -> list[str]:
    """Block Kit as lines of text: headers, sections (and their fields), context, buttons as [Label]."""
    if isinstance(blocks, str):
        try:
            blocks = json.loads(blocks)
        except ValueError:
            return [mrkdwn_text(blocks)]
    lines: list[str] = []
    for b in blocks if isinstance(blocks, list) else []:
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "header":
            lines.append(f"== {_text_of(b.get('text'))} ==")
        elif kind == "section":
            if b.get("text"):
                lines += _text_of(b.get("text")).splitlines()
            for f in b.get("fields") or []:
                lines += ("  " + x for x in _text_of(f).splitlines())
        elif kind == "context":
            lines.append("  " + " · ".join(_text_of(e) for e in b.get("elements") or []))
        elif kind == "divider":
            lines.append("-" * 40)
        elif kind == "actions":
            lines.append("  " + " ".join(f"[{_text_of(e.get('text'))}]" for e in b.get("elements") or []))
        elif kind == "rich_text":
            lines.append(mrkdwn_text(json.dumps(b)[:500]))
    return lines


def _buttons(blocks: Any) -> list[dict[str, Any]]:
    if isinstance(blocks, str):
        try:
            blocks = json.loads(blocks)
        except ValueError:
            return []
    out = []
    for b in blocks if isinstance(blocks, list) else []:
        if isinstance(b, dict) and b.get("type") == "actions":
            out += [e for e in b.get("elements") or [] if isinstance(e, dict) and e.get("type") == "button"]
    return out


# -- Slack's Web API, on loopback, printing ---------------------------------------------------------------------


class ConsoleSlack:
    """The Web API methods hangdx calls, answered as Slack answers them, what is posted printed to `out`; the
    channel's messages kept (threads for `@hangdx analyze`, buttons to press), files pasted served to the bot."""

    def __init__(self, out: TextIO, token: str) -> None:
        self.out = out
        self.token = token
        self._lock = threading.Lock()
        self._ts = itertools.count(1)
        self.messages: list[dict[str, Any]] = []
        self.files: dict[str, tuple[str, bytes]] = {}
        self.views: list[dict[str, Any]] = []
        self.last_call = time.monotonic()
        self._server: ThreadingHTTPServer | None = None

    # lifecycle
    def start(self) -> ConsoleSlack:
        slack = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                slack._handle(self)

            def do_GET(self) -> None:  # noqa: N802
                slack._handle(self)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="hangdx-console-slack", daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()

    @property
    def root(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    @property
    def url(self) -> str:
        return self.root + "api/"

    def next_ts(self) -> str:
        return f"{1_700_000_000 + next(self._ts)}.000100"

    # what the person does
    def user_message(self, text: str, thread_ts: str | None = None, files: list[dict] | None = None) -> str:
        ts = self.next_ts()
        msg: dict[str, Any] = {"type": "message", "user": USER, "text": text, "ts": ts, "team": TEAM}
        if thread_ts:
            msg["thread_ts"] = thread_ts
        if files:
            msg["files"] = files
        with self._lock:
            self.messages.append(msg)
        return ts

    def host_file(self, path: Path) -> dict[str, Any]:
        """A local file as Slack hosts a pasted one: its `files` entry, downloadable with the bot token."""
        try:
            size = path.stat().st_size
            if size > MAX_PASTE:
                raise ConsoleError(f"{path}: {size:,} bytes, over the {MAX_PASTE >> 20} MB a paste may hold")
            data = path.read_bytes()
        except OSError as e:
            raise ConsoleError(f"cannot read {path}: {e.strerror or e}") from None
        file_id = f"F0CON{len(self.files) + 1:05d}"
        self.files[file_id] = (path.name, data)
        return {
            "id": file_id,
            "name": path.name,
            "title": path.name,
            "mimetype": "text/plain",
            "filetype": "text",
            "size": len(data),
            "mode": "hosted",
            "url_private": f"{self.root}files-pri/{TEAM}-{file_id}/{path.name}",
            "url_private_download": f"{self.root}files-pri/{TEAM}-{file_id}/download/{path.name}",
        }

    def latest_buttons(self, label: str, job: str | None) -> tuple[dict, dict]:
        """(button, message) of the newest message with a button named `label` (and for `job`)."""
        want = " ".join(label.lower().replace("-", " ").split())
        with self._lock:
            messages = list(reversed(self.messages))
        for m in messages:
            for b in _buttons(m.get("blocks")):
                name = " ".join(_text_of(b.get("text")).lower().replace("-", " ").split())
                value = str(b.get("value") or "")
                if name.startswith(want) and (job is None or value.split("|")[0] == job):
                    return b, m
        raise ConsoleError(
            f"no [{label}] button" + (f" for job {job}" if job else "") + " yet (buttons come with a verdict)"
        )

    # what the bot does
    def say(self, line: str) -> None:
        with self._lock:
            self.out.write(line.rstrip("\n") + "\n")
            self.out.flush()

    def _show(self, who: str, body: dict[str, Any], thread_ts: Any = None) -> None:
        lines = blocks_text(body.get("blocks")) if body.get("blocks") else []
        if not lines:
            lines = mrkdwn_text(body.get("text")).splitlines() or [""]
        where = f" [thread {thread_ts}]" if thread_ts else ""
        self.say(f"{who}{where}:\n" + "\n".join("  " + x for x in lines))

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        raw = h.rfile.read(length) if length else b""
        path = h.path.split("?", 1)[0].lstrip("/")
        self.last_call = time.monotonic()
        if path.startswith("files-pri/"):
            # Only the bot (with its token) downloads what was pasted, as from Slack.
            file_id = path.split("/")[1].rsplit("-", 1)[-1]
            name, data = self.files.get(file_id, ("", b""))
            if h.headers.get("Authorization") != f"Bearer {self.token}":
                name, data = "", b""
            _send(h, 200 if name else 404, data, "text/plain")
            return
        if path.startswith("upload/"):
            text = raw.decode("utf-8", "replace")
            self.say(
                f"hangdx uploaded a file ({len(raw):,} bytes):\n"
                + "\n".join("  | " + printable(x) for x in text.splitlines()[:60])
            )
            _send(h, 200, b"OK - " + str(len(raw)).encode(), "text/plain")
            return
        body = _decode(raw, h.headers.get("Content-Type") or "")
        if "?" in h.path:
            body = {**dict(parse_qsl(h.path.split("?", 1)[1])), **body}
        if path.startswith("respond/"):
            who = "hangdx (only you)" if body.get("response_type") != "in_channel" else "hangdx"
            self._show(who, body)
            _send(h, 200, b"ok", "text/plain")
            return
        method = path[len("api/") :] if path.startswith("api/") else path
        answer = self._answer(method, body)
        _send(h, 200, json.dumps(answer).encode(), "application/json")

    def _answer(self, method: str, body: dict[str, Any]) -> dict[str, Any]:
        channel = body.get("channel")
        if method == "auth.test":
            return {"ok": True, "url": "https://hangdx-console.slack.com/", "team": "console", "user": "hangdx",
                    "team_id": TEAM, "user_id": BOT_USER, "bot_id": BOT_ID, "is_enterprise_install": False}  # fmt: skip
        if method == "chat.postMessage":
            ts = self.next_ts()
            msg = {"type": "message", "subtype": "bot_message", "text": body.get("text", ""), "ts": ts,
                   "bot_id": BOT_ID, "user": BOT_USER}  # fmt: skip
            if body.get("blocks"):
                msg["blocks"] = _maybe_json(body["blocks"])
            if body.get("thread_ts"):
                msg["thread_ts"] = body["thread_ts"]
            with self._lock:
                self.messages.append(msg)
            self._show("hangdx", body, body.get("thread_ts") or f"{ts}, new")
            return {"ok": True, "channel": channel, "ts": ts, "message": msg}
        if method == "chat.update":
            with self._lock:
                for m in self.messages:
                    if m.get("ts") == body.get("ts"):
                        m["text"] = body.get("text", "")
            self._show("hangdx (edited)", body, body.get("ts"))
            return {"ok": True, "channel": channel, "ts": body.get("ts"), "text": body.get("text", "")}
        if method == "chat.postEphemeral":
            self._show("hangdx (only you)", body, body.get("thread_ts"))
            return {"ok": True, "message_ts": self.next_ts()}
        if method == "conversations.replies":
            ts = body.get("ts")
            with self._lock:
                thread = [m for m in self.messages if m.get("ts") == ts or m.get("thread_ts") == ts]
            return {"ok": True, "messages": thread, "has_more": False}
        if method == "views.open":
            view = _maybe_json(body.get("view") or "{}")
            self.views.append(view if isinstance(view, dict) else {})
            title = _text_of((view or {}).get("title")) if isinstance(view, dict) else ""
            self.say(f"hangdx opened a dialog ({title}): answer with `note TEXT`, or carry on to skip it")
            return {"ok": True, "view": {"id": f"V{len(self.views):08d}", **(view or {})}}
        if method == "files.getUploadURLExternal":
            file_id = f"F0UP{next(self._ts):05d}"
            return {"ok": True, "upload_url": f"{self.root}upload/{file_id}", "file_id": file_id}
        if method == "files.completeUploadExternal":
            files = _maybe_json(body.get("files") or "[]")
            return {"ok": True, "files": [{"id": f.get("id"), "title": f.get("title") or ""} for f in files]}
        if method == "users.info":
            uid = str(body.get("user", ""))
            return {"ok": True, "user": {"id": uid, "name": "you" if uid == USER else uid, "is_bot": False}}
        return {"ok": False, "error": "unknown_method"}


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _decode(raw: bytes, content_type: str) -> dict[str, Any]:
    if not raw:
        return {}
    if "json" in content_type:
        try:
            got = json.loads(raw)
        except ValueError:
            return {}
        return got if isinstance(got, dict) else {}
    return dict(parse_qsl(raw.decode("utf-8", "replace")))


def _send(h: BaseHTTPRequestHandler, status: int, data: bytes, content_type: str) -> None:
    h.send_response(status)
    h.send_header("Content-Type", content_type)
    h.send_header("Content-Length", str(len(data)))
    h.end_headers()
    h.wfile.write(data)


# -- the person's side: typed lines become signed Slack requests to the Bolt app ----------------------------------


class Console:
    """The Bolt app, the service and a worker, joined to a ConsoleSlack; `line()` does what one typed line asks."""

    def __init__(self, out: TextIO, log_dir: Path) -> None:
        self.out = out
        self.token = f"xoxb-0-0-{secrets.token_hex(12)}"
        self.slack = ConsoleSlack(out, self.token).start()
        self.secret = secrets.token_hex(16)
        self._n = itertools.count(1)
        self.paste_thread: str | None = None  # the thread of the last files pasted
        self._rq_lock = threading.Lock()
        self._rq_ids: set[str] = set()  # RQ jobs asked for and not yet seen ended
        self.log_dir = log_dir
        self.worker: subprocess.Popen | None = None
        self.service: Any = None
        self.app: Any = None
        self.http: Any = None

    def start(self) -> Console:
        from hangdx.bot.config import BotConfig
        from hangdx.bot.service import Service
        from hangdx.bot.slack.app import build_app

        # The settings the bot and its worker read, pointed at this console's Slack; Redis and the resolver are
        # the person's. Allowlists are for a workspace: here the only person is the one at the terminal.
        env = {
            "SLACK_BOT_TOKEN": self.token,
            "SLACK_SIGNING_SECRET": self.secret,
            "SLACK_API_URL": self.slack.url,
            "HANGDX_ALERT_CHANNEL": CHANNEL,
            "HANGDX_RESOLVER": os.environ.get("HANGDX_RESOLVER") or "local",
        }
        for name in ("SLACK_APP_TOKEN", "HANGDX_ALLOWED_USERS", "HANGDX_ALLOWED_CHANNELS", "HANGDX_ALLOWED_GROUPS",
                     "HANGDX_HANDOFF_TIME", "HANGDX_NOTIFIER"):  # fmt: skip
            os.environ.pop(name, None)
        os.environ.update(env)
        cfg = BotConfig.from_env()
        self.service = Service(cfg)
        self.service.recover()
        s = self.service
        self.app, flask_app = build_app(
            cfg, self._tracked(s.submit), s.on_action, s.report, store=s.store, health=s.health,
            analyze=self._tracked(s.analyze), history=s.history, resolution=s.resolution, act=s.act,
        )  # fmt: skip
        self.http = flask_app.test_client()
        log = open(self.log_dir / "worker.log", "ab")
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "hangdx", "worker"], env=os.environ.copy(), stdout=log, stderr=log,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        log.close()
        return self

    def stop(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGTERM)
            try:
                self.worker.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        link = getattr(self.app, "hangdx_link", None)
        if link is not None:
            link.stop()
        self.slack.stop()

    # the requests Slack would send
    def _post(self, body: str, content_type: str) -> Any:
        from slack_sdk.signature import SignatureVerifier

        stamp = str(int(time.time()))
        sig = SignatureVerifier(self.secret).generate_signature(timestamp=stamp, body=body)
        headers = {"Content-Type": content_type, "X-Slack-Request-Timestamp": stamp, "X-Slack-Signature": sig}
        r = self.http.post("/slack/events", data=body.encode(), headers=headers)
        # The handlers go on after their ack (queueing among it): `wait` gives them a quiet moment from here too.
        self.slack.last_call = time.monotonic()
        if r.status_code != 200:
            raise ConsoleError(f"the bot answered {r.status_code}: {r.get_data(as_text=True)[:200]}")
        return r

    def slash(self, text: str) -> None:
        n = next(self._n)
        body = urlencode(
            {"command": "/diagnose", "text": text, "user_id": USER, "user_name": "you", "channel_id": CHANNEL,
             "team_id": TEAM, "response_url": f"{self.slack.root}respond/{n}", "trigger_id": f"{n}.console"}
        )  # fmt: skip
        r = self._post(body, "application/x-www-form-urlencoded")
        said = r.get_data(as_text=True)
        if said.strip():
            self.slack._show(
                "hangdx (only you)", _maybe_json(said) if said.startswith("{") else {"text": said}
            )

    def mention(self, rest: str) -> None:
        words = rest.split()
        files: list[dict] = []
        if words and words[0].lower() == "analyze" and len(words) > 1:
            paths = [Path(w).expanduser() for w in words[1:]]
            found = [p.is_file() for p in paths]
            if any(found) and not all(found):
                missing = ", ".join(
                    printable(str(p), False)[:80] for p, ok in zip(paths, found, strict=True) if not ok
                )
                raise ConsoleError(f"no such file: {missing}")
            if all(found):  # files to paste; anything else is text pasted with the mention
                files = [self.slack.host_file(p) for p in paths]
                rest = "analyze"
        thread = None
        if files:  # the paste opens a thread; the mention follows in it, as a person does it in Slack
            thread = self.paste_thread = self.slack.user_message("", files=files)
            self.slack.say(
                f"you (thread {thread}): pasted {printable(', '.join(f['name'] for f in files), False)}"
            )
        elif [w.lower() for w in words] == ["analyze"] and self.paste_thread:
            thread = self.paste_thread  # `@hangdx analyze` again: in the thread of the last paste
        text = f"<@{BOT_USER}> {rest}"
        ts = self.slack.user_message(text, thread_ts=thread)
        n = next(self._n)
        event = {"type": "app_mention", "user": USER, "text": text, "ts": ts, "channel": CHANNEL,
                 "event_ts": ts, **({"thread_ts": thread} if thread else {})}  # fmt: skip
        body = {"token": "console", "team_id": TEAM, "api_app_id": "A0HANGDXCON", "event": event,
                "type": "event_callback", "event_id": f"Ev0CON{n:06d}", "event_time": int(time.time()),
                "authorizations": [{"team_id": TEAM, "user_id": BOT_USER, "is_bot": True}]}  # fmt: skip
        self._post(json.dumps(body), "application/json")

    def press(self, label: str, job: str | None) -> None:
        button, message = self.slack.latest_buttons(label, job)
        n = next(self._n)
        payload = {
            "type": "block_actions",
            "user": {"id": USER, "username": "you", "team_id": TEAM},
            "api_app_id": "A0HANGDXCON",
            "team": {"id": TEAM},
            "container": {"type": "message", "message_ts": message["ts"], "channel_id": CHANNEL},
            "channel": {"id": CHANNEL},
            "message": message,
            "trigger_id": f"{n}.console",
            "response_url": f"{self.slack.root}respond/{n}",
            "actions": [{"type": "button", "action_id": button.get("action_id"), "block_id": "console",
                         "value": button.get("value"), "text": button.get("text"), "action_ts": str(time.time())}],
        }  # fmt: skip
        self.slack.say(f"you pressed [{_text_of(button.get('text'))}]")
        self._post(urlencode({"payload": json.dumps(payload)}), "application/x-www-form-urlencoded")

    def note(self, text: str) -> None:
        if not self.slack.views:
            raise ConsoleError("no dialog is open (press Resolve first)")
        view = self.slack.views.pop()
        payload = {
            "type": "view_submission",
            "user": {"id": USER, "username": "you", "team_id": TEAM},
            "team": {"id": TEAM},
            "api_app_id": "A0HANGDXCON",
            "view": {**view, "id": "V0CONSOLE", "state": {"values": {"resolution": {"note": {"type": "plain_text_input", "value": text}}}}},
        }  # fmt: skip
        self._post(urlencode({"payload": json.dumps(payload)}), "application/x-www-form-urlencoded")
        self.slack.say("you saved the note")

    def _tracked(self, handler: Any) -> Any:
        """The service's own handler, noting the RQ job that will answer (so that `wait` knows when it has)."""

        def call(req: Any) -> str:
            rq_id = handler(req)
            if rq_id:  # "" when nothing was queued (a repeated alert on an incident already diagnosed)
                with self._rq_lock:
                    self._rq_ids.add(rq_id)
            return rq_id

        return call

    def idle(self) -> bool:
        """Whether every diagnosis and analysis asked for has ended (answered, failed or given up)."""
        from rq.exceptions import NoSuchJobError
        from rq.job import Job, JobStatus
        from rq.serializers import JSONSerializer

        ended = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}
        with self._rq_lock:
            waiting = list(self._rq_ids)
        for rq_id in waiting:
            try:
                status = Job.fetch(
                    rq_id, connection=self.service.conn, serializer=JSONSerializer
                ).get_status()
            except NoSuchJobError:
                status = None
            if status is None or status in ended:
                with self._rq_lock:
                    self._rq_ids.discard(rq_id)
            else:
                return False
        return not self.service.store.runs()

    def wait(self, timeout: float) -> bool:
        """Until every queued diagnosis and analysis answered and the bot has said nothing for a moment."""
        end = time.monotonic() + timeout
        self.service.settle(timeout)
        while time.monotonic() < end:
            if self.worker is not None and self.worker.poll() is not None:
                tail = (self.log_dir / "worker.log").read_text(errors="replace")[-1500:]
                raise ConsoleError(
                    f"the worker stopped (status {self.worker.returncode}):\n{printable(tail)}"
                )
            if self.idle() and time.monotonic() - self.slack.last_call > 1.5:
                return True
            time.sleep(0.2)
        return False

    def line(self, text: str, wait_s: float) -> bool:
        """Do what one typed line asks; False for quit."""
        text = text.strip()
        if not text:
            return True
        word, _, rest = text.partition(" ")
        low = word.lower()
        if low in ("quit", "exit"):
            return False
        if low == "help":
            self.slack.say(USAGE)
        elif low == "/diagnose":
            self.slash(rest.strip())
        elif low in ("@hangdx", f"<@{BOT_USER.lower()}>"):
            self.mention(rest.strip())
        elif low == "press":
            words = rest.split()
            if not words:
                raise ConsoleError(
                    "press which button? (re-run, full stacks, acknowledge, resolve, hand off)"
                )
            try:
                self.press(" ".join(words), None)
            except ConsoleError:
                if len(words) < 2:
                    raise
                self.press(" ".join(words[:-1]), words[-1])  # `press acknowledge JOBID`
        elif low == "note":
            self.note(rest.strip())
        elif low == "wait":
            if not self.wait(wait_s):
                self.slack.say(f"hangdx console: still working after {wait_s:.0f} s")
        else:
            raise ConsoleError(f"{printable(word, False)[:40]}: not a command (type help)")
        return True


def _lines(stream: TextIO) -> Iterator[str]:
    while True:
        got = stream.readline()
        if not got:
            return
        yield got


def run_console(args: argparse.Namespace) -> int:
    """`hangdx console`: read lines from stdin until `quit` or its end; then wait for what is under way."""
    from hangdx.bot.cli import UsageError
    from hangdx.bot.config import ConfigError
    from hangdx.bot.incidents import StoreUnavailable

    if not 0 <= args.wait <= 3600:
        raise UsageError("--wait takes 0 to 3600 seconds")
    interactive = sys.stdin.isatty()
    with tempfile.TemporaryDirectory(prefix="hangdx-console-") as tmp:
        console = Console(sys.stdout, Path(tmp))
        try:
            console.start()
        except (ConfigError, StoreUnavailable) as e:
            console.stop()
            raise UsageError(str(e)) from None
        try:
            console.slack.say(
                f"hangdx console: the Slack handlers, Redis at {_where(os.environ.get('REDIS_URL'))}, jobs found "
                f"with HANGDX_RESOLVER={os.environ['HANGDX_RESOLVER']}; type help"
            )
            for raw in _lines(sys.stdin):
                if not interactive:
                    console.slack.say(f"> {printable(raw.rstrip(), False)}")
                try:
                    if not console.line(raw, args.wait):
                        break
                except ConsoleError as e:
                    console.slack.say(f"hangdx console: {e}")
            if not console.wait(args.wait):
                console.slack.say(f"hangdx console: still working after {args.wait:.0f} s; leaving")
        except KeyboardInterrupt:
            pass
        finally:
            console.stop()
    return 0


def _where(url: str | None) -> str:
    from hangdx.probes.collector import redact

    return redact(url or "redis://localhost:6379/0")
