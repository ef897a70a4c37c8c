"""Diagnose what people pasted in Slack: a thread's messages and text files (`@hangdx analyze`) or one message's
(the "Diagnose with hangdx" shortcut), read by the one streaming reader, answered in the thread.

Runs on a worker (queued by Service.analyze): `run_analysis(request)`. Caps per request: MAX_FILES files and
MAX_BYTES bytes of text in all; text files only; a file is downloaded only from Slack's own file host (or the
configured SLACK_API_URL's host), with the bot token, never following a redirect. What was skipped, and why, is
said in the verdict.
"""

from __future__ import annotations

import html
import json
import logging
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from hangdx.bot.config import int_setting
from hangdx.bot.request import AnalyzeRequest
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.pasted")
MAX_FILES = 20
MAX_BYTES = (
    20 << 20
)  # the default; HANGDX_ANALYZE_MAX_MB sets it (the reader streams, so size costs time only)
MAX_MESSAGES = 1000
SLACK_FILE_HOSTS = ("files.slack.com",)
TEXT_MIMETYPES = ("application/json", "application/x-yaml", "application/x-sh", "application/xml")
TEXT_FILETYPES = {
    "text", "log", "python", "shell", "json", "yaml", "markdown", "csv", "xml", "c", "cpp", "diff", "ini",
    "toml", "post", "space",
}  # fmt: skip
DOWNLOAD_TIMEOUT = 30  # seconds one read may wait for a byte
DOWNLOAD_DEADLINE = 120  # seconds all of one request's downloads may take (a worker's job has 300)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kw: Any) -> None:
        return None  # a redirect is an error: the bot token goes nowhere but the host that was checked


_OPENER = urllib.request.build_opener(_NoRedirect)


@dataclass
class Budget:
    """What one request may still read: files and bytes; and what it skipped, one line each."""

    files: int = MAX_FILES
    bytes: int = field(default_factory=lambda: int_setting("HANGDX_ANALYZE_MAX_MB", MAX_BYTES >> 20) << 20)
    skipped: list[str] = field(default_factory=list)
    deadline: float = field(default_factory=lambda: time.monotonic() + DOWNLOAD_DEADLINE)

    def __post_init__(self) -> None:
        self.cap_mb = self.bytes >> 20

    def take(self, n: int) -> int:
        n = max(0, min(n, self.bytes))
        self.bytes -= n
        return n


class _Text:
    """A message's text as a stream for the reader, counted against the budget."""

    def __init__(self, name: str, data: bytes, budget: Budget) -> None:
        self.name, self.budget = name, budget
        allowed = budget.take(len(data))
        if allowed < len(data):
            budget.skipped.append(f"{name}: cut at the {budget.cap_mb} MB cap")
        self.data, self.pos = data[:allowed], 0

    def read(self, n: int = -1) -> bytes:
        end = len(self.data) if n < 0 else self.pos + n
        out, self.pos = self.data[self.pos : end], min(end, len(self.data))
        return out


class _Download:
    """A file streamed from Slack on first read, within the budget; anything but text reads as empty."""

    def __init__(self, name: str, url: str, token: str, budget: Budget) -> None:
        self.name, self.url, self.token, self.budget = name, url, token, budget
        self.resp: Any = None
        self.done = False
        self.first = True

    def _open(self) -> bool:
        req = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token}"})
        try:
            self.resp = _OPENER.open(req, timeout=DOWNLOAD_TIMEOUT)  # noqa: S310 - host checked by caller
        except (urllib.error.URLError, OSError, ValueError) as e:
            why = e.code if isinstance(e, urllib.error.HTTPError) else getattr(e, "reason", e)
            self.budget.skipped.append(f"{self.name}: could not be downloaded ({_one_line(why)})")
            return False
        return True

    def read(self, n: int = -1) -> bytes:
        if self.done:
            return b""
        if self.resp is None and not self._open():
            self.done = True
            return b""
        want = self.budget.bytes if n < 0 else min(n, self.budget.bytes)
        if want <= 0:
            self.budget.skipped.append(f"{self.name}: not read past the {self.budget.cap_mb} MB cap")
            self._close()
            return b""
        buf = bytearray()
        try:
            # Piece by piece, so that a file trickling in a byte at a time stops at the request's deadline.
            while len(buf) < want:
                if time.monotonic() > self.budget.deadline:
                    self.budget.skipped.append(
                        f"{self.name}: the rest not read: downloads past {DOWNLOAD_DEADLINE} s were stopped"
                    )
                    self.done = True
                    break
                piece = self.resp.read1(min(want - len(buf), 1 << 16))
                if not piece:
                    break
                buf += piece
        except OSError as e:
            self.budget.skipped.append(f"{self.name}: download broke off ({_one_line(e)})")
            self.done = True
        data = bytes(buf)
        if not data or self.done:
            self._close()
            if not data:
                return b""
        if self.first:
            self.first = False
            if _binary(data):
                self.budget.skipped.append(f"{self.name}: not text (binary content): skipped")
                self._close()
                return b""
        self.budget.take(len(data))
        return data

    def _close(self) -> None:
        self.done = True
        if self.resp is not None:
            self.resp.close()


def _binary(head: bytes) -> bool:
    from hangdx.probes.reader import is_dump
    from hangdx.probes.text import looks_binary

    return is_dump(head[:64]) or looks_binary(head[:8192])


def _one_line(value: Any, limit: int = 120) -> str:
    return " ".join(str(value).split())[:limit]


def own_ids(client: WebClient) -> set[str]:
    """hangdx's own user and bot ids: its messages (verdicts, replies) are not evidence."""
    try:
        me = client.auth_test()
    except (SlackApiError, OSError) as e:
        log.warning("auth.test failed: %s", e)
        return set()
    return {i for i in (me.get("user_id"), me.get("bot_id")) if i}


def thread_messages(client: WebClient, req: AnalyzeRequest) -> list[dict]:
    """The thread's messages (conversations.replies, paged), or the shortcut's one message."""
    out: list[dict] = []
    cursor = None
    while len(out) < MAX_MESSAGES:
        page = client.conversations_replies(
            channel=req.channel, ts=req.thread_ts, limit=200, **({"cursor": cursor} if cursor else {})
        )
        out += [m for m in page.get("messages") or [] if isinstance(m, dict)]
        cursor = ((page.get("response_metadata") or {}).get("next_cursor")) or None
        if not cursor:
            break
    if req.message_ts:
        out = [m for m in out if m.get("ts") == req.message_ts]
    return out[:MAX_MESSAGES]


def _origin(u: Any) -> tuple[str, str | None, int | None]:
    """(scheme, host, port) of a parsed URL, the port filled in from the scheme; ValueError for a bad port."""
    return u.scheme, u.hostname, u.port or {"https": 443, "http": 80}.get(u.scheme)


def _allowed_host(url: str, api_url: str | None) -> bool:
    """Whether the bot token may go to `url`: Slack's file host over https on 443, or the configured API URL's
    own scheme, host and port (a local stand-in on loopback may be plain http); never another port of a host."""
    try:
        scheme, host, port = _origin(urlparse(url))
        api = _origin(urlparse(api_url or "")) if api_url else None
    except ValueError:
        return False
    if host in SLACK_FILE_HOSTS:
        return (scheme, port) == ("https", 443)
    if api is None or api[1] is None or (scheme, host, port) != api:
        return False
    return scheme == "https" or (scheme == "http" and host == "127.0.0.1")


def _is_text_file(f: dict) -> bool:
    mime = str(f.get("mimetype") or "")
    return (
        mime.startswith("text/") or mime in TEXT_MIMETYPES or str(f.get("filetype") or "") in TEXT_FILETYPES
    )


def _without_request(text: str, own: set[str]) -> str:
    """A message's text without a leading `@hangdx analyze` (or `diagnose ...`): the request is not evidence, what
    was pasted under it is."""
    for uid in own:
        m = re.match(rf"\s*<@{re.escape(uid)}(?:\|[^>]*)?>\s*(?:analy[sz]e\b[^\n]*)?", text)
        if m:
            return text[m.end() :]
    return text


def parts_of(
    messages: list[dict], token: str, api_url: str | None, skip_users: set[str]
) -> tuple[list[tuple[str, Any]], Budget]:
    """Each message's text and each text file, as (name, stream) for the reader, within the caps."""
    budget = Budget()
    parts: list[tuple[str, Any]] = []
    for i, m in enumerate(messages, 1):
        if m.get("user") in skip_users or m.get("bot_id") in skip_users:
            continue  # hangdx's own replies and verdicts
        who = m.get("user") if isinstance(m.get("user"), str) else "someone"
        text = m.get("text")
        if isinstance(text, str):
            # Slack escapes &, < and > in message text; the reader wants what the person pasted.
            text = _without_request(html.unescape(text), skip_users)
        if isinstance(text, str) and text.strip():
            data = text.encode("utf-8", "replace")
            parts.append((f"message {i} ({who})", _Text(f"message {i}", data, budget)))
        for f in m.get("files") or []:
            if not isinstance(f, dict):
                continue
            name = _one_line(f.get("name") or f.get("title") or f.get("id") or "file", 80)
            if budget.files <= 0:
                budget.skipped.append(f"{name}: over the {MAX_FILES}-file cap")
                continue
            url = f.get("url_private_download") or f.get("url_private")
            if not _is_text_file(f):
                budget.skipped.append(f"{name}: not a text file ({_one_line(f.get('mimetype') or '?', 40)})")
                continue
            if not isinstance(url, str) or not _allowed_host(url, api_url):
                budget.skipped.append(f"{name}: not a file hosted by Slack")
                continue
            size = f.get("size")
            if isinstance(size, int) and size > budget.bytes:
                budget.skipped.append(f"{name}: {size:,} bytes, over what the {budget.cap_mb} MB cap leaves")
                continue
            budget.files -= 1
            parts.append((f"{name} (file)", _Download(name, url, token, budget)))
    return parts, budget


def analyze(client: WebClient, req: AnalyzeRequest, token: str, api_url: str | None) -> dict[str, Any] | None:
    """The redacted verdict (a JSON dict, its `read` and `skipped` said) or None when nothing was evidence."""
    from hangdx.bot import render
    from hangdx.bot.diagnosis import analyze_texts

    messages = thread_messages(client, req)
    parts, budget = parts_of(messages, token, api_url, own_ids(client))
    verdict = analyze_texts(parts)
    if verdict is None:
        return None
    out = _redacted(json.loads(render.to_json(verdict)))
    out["gaps"], chat = _brief_gaps(out.get("gaps") or [])
    out["skipped"] = chat + [redact(s) for s in budget.skipped]
    return out


# What the reader says of a part with no evidence in it (with the 25 kinds it looked for).
_NO_EVIDENCE = re.compile(
    r"(?P<part>.+?): not a known artifact \((?P<what>[^)]*)\): skipped(?: \(looked for .*\))?", re.S
)
_CHAT = re.compile(r"message (?P<n>\d+) \([^)]*\)")


def _brief_gaps(gaps: list[str]) -> tuple[list[str], list[str]]:
    """(gaps, skipped): the parts with no evidence said once and briefly (chat messages in one line, never the
    list of kinds looked for each time); the other gaps as they were."""
    kept, chat, files = [], [], []
    for g in gaps:
        m = _NO_EVIDENCE.fullmatch(g)
        if m is None:
            kept.append(g)
        elif c := _CHAT.fullmatch(m["part"]):
            chat.append(c["n"])
        else:
            files.append(f"{m['part']} ({m['what']}): no evidence hangdx reads")
    said = []
    if chat:
        said.append(
            f"message{'s' if len(chat) > 1 else ''} {', '.join(chat)}: chat, no evidence in {'them' if len(chat) > 1 else 'it'}"
        )
    return kept, said + files


def _redacted(obj: Any) -> Any:
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, list):
        return [_redacted(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _redacted(v) for k, v in obj.items()}
    return obj


def run_analysis(request: dict[str, Any]) -> str:
    """The RQ job: read, diagnose, answer in the thread. Returns the root cause's category (or 'none')."""
    from hangdx.bot.config import BotConfig
    from hangdx.bot.service import slack_client
    from hangdx.bot.slack.blocks import analysis_blocks, analysis_text, escape

    req = AnalyzeRequest.from_dict(request)
    cfg = BotConfig.from_env()
    client = slack_client(cfg)
    where = "message" if req.message_ts else "thread"
    try:
        verdict = analyze(client, req, cfg.bot_token or "", cfg.api_url)
    except SlackApiError as e:
        error = e.response.get("error")
        hint = " (invite hangdx to this channel)" if error in ("not_in_channel", "channel_not_found") else ""
        _post(client, req, text=escape(f"hangdx could not read this {where}: {error}{hint}"))
        return "none"
    if verdict is None:
        from hangdx.probes.reader import looked_for

        _post(
            client, req, text=f"hangdx found no evidence it reads in this {where} (it reads: {looked_for()})."
        )
        return "none"
    _post(client, req, text=analysis_text(verdict), blocks=analysis_blocks(verdict))
    return str((verdict.get("root_cause") or {}).get("category") or "none")


def _post(client: WebClient, req: AnalyzeRequest, **kw: Any) -> None:
    try:
        client.chat_postMessage(channel=req.channel, thread_ts=req.thread_ts, **kw)
    except (SlackApiError, OSError) as e:
        log.warning("chat.postMessage of the analysis failed: %s", e)
