"""`@hangdx diagnose <jobid> | analyze | status | handoff | help`, said in a channel or a thread."""

from __future__ import annotations

import logging
import re

from slack_bolt import App
from slack_sdk.errors import SlackApiError

from hangdx.bot import access
from hangdx.bot.request import AnalyzeRequest, DiagnoseRequest
from hangdx.bot.slack.blocks import escape, help_blocks
from hangdx.bot.slack.commands import history_answer, slash_text
from hangdx.bot.slack.common import REPORTS, Surfaces, run_report, slack_error, submitted, tell

log = logging.getLogger("hangdx.bot")
_MENTION = re.compile(r"<@[A-Z0-9]+(?:\|[^>]*)?>")
USAGE = "Usage: @hangdx diagnose <jobid> | analyze | history <host|job> | status | handoff | help"


def mention_text(text: str) -> tuple[str, str | None]:
    """What a mention asks: ("help"|"analyze"|"status"|"handoff", None), ("diagnose", job_id), ("refuse", why)."""
    words = _MENTION.sub(" ", text or "").split()
    if not words or words[0].lower() == "help":
        return "help", None
    if words[0].lower() in REPORTS and len(words) == 1:
        return words[0].lower(), None
    if words[0].lower() == "history":
        return slash_text(" ".join(words))
    if words[0].lower() == "analyze":
        return "analyze", None  # what follows is evidence pasted with the mention, read with the thread
    if words[0].lower() != "diagnose" or len(words) < 2:
        return "refuse", USAGE
    return slash_text(" ".join(words[1:]))


def register(app: App, s: Surfaces) -> None:
    @app.event("app_mention")
    def on_mention(event, client):
        # Bolt acknowledged the event already; what follows talks to Slack and Redis: off the listener pool.
        s.later(_on_mention, s, event, client)


def _on_mention(s: Surfaces, event: dict, client) -> None:
    """What the mention asks, done: a reply only its author sees, a report, or a request handed to the service."""
    user, channel = event.get("user"), event.get("channel")
    thread_ts = event.get("thread_ts") or event.get("ts")
    if not (isinstance(user, str) and isinstance(channel, str) and user and channel):
        log.warning("app_mention without a user or channel: ignored")
        return

    def say(text: str, blocks: list | None = None) -> None:
        tell(client, channel, user, text, blocks=blocks, thread_ts=thread_ts)

    refusal = access.refusal(s.config, user, channel)
    if refusal:
        say(refusal)
        return
    text = event.get("text")
    what, arg = mention_text(text if isinstance(text, str) else "")
    if what == "help":
        say("hangdx: @hangdx diagnose <jobid>", help_blocks())
    elif what == "refuse":
        say(arg or USAGE)
    elif what == "history":
        text, blocks = history_answer(s, arg or "")
        say(text, blocks)
    elif what in REPORTS:
        _report(client, s, what, channel, event.get("thread_ts"), say)
    elif what == "analyze":
        if s.analyze is None or not isinstance(thread_ts, str):
            say("hangdx: analyze is not available on this server.")
            return
        say("Reading this thread's messages and text files…")
        req = AnalyzeRequest(channel=channel, thread_ts=thread_ts, requested_by=user, source="mention")
        submitted(s.analyze, req, "analysis of this thread", say)
    else:
        say(f"Diagnosing job {escape(arg)}…")
        req = DiagnoseRequest(
            job_id=arg or "", source="mention", requested_by=user, channel=channel, thread_ts=thread_ts
        )
        submitted(s.submit, req, f"diagnosis of job {arg}", say)


def _report(client, s: Surfaces, what: str, channel: str, thread_ts, say) -> None:
    text, blocks = run_report(s.report, what)
    if what == "handoff" and blocks is not None:
        try:
            client.chat_postMessage(channel=channel, text=text, blocks=blocks, thread_ts=thread_ts)
        except (SlackApiError, OSError) as e:
            log.warning("chat.postMessage of the hand-off failed: %s", slack_error(e))
    else:
        say(text, blocks)
