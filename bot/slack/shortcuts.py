"""The message shortcut "Diagnose with hangdx" (callback id `hangdx_analyze`): diagnose one message's text and
files, answering in that message's thread."""

from __future__ import annotations

import logging

from slack_bolt import App

from hangdx.bot import access
from hangdx.bot.request import AnalyzeRequest
from hangdx.bot.slack.common import Surfaces, submitted, tell

log = logging.getLogger("hangdx.bot")
ANALYZE = "hangdx_analyze"


def register(app: App, s: Surfaces) -> None:
    @app.message_shortcut(ANALYZE)
    def analyze_message(ack, body, client):
        ack()  # first: Slack gives a shortcut 3 seconds, and the work is queued
        s.later(_analyze, s, body, client)


def _analyze(s: Surfaces, body: dict, client) -> None:
    """The shortcut used on a message: checked, then its analysis queued."""
    user = (body.get("user") or {}).get("id")
    channel = (body.get("channel") or {}).get("id")
    message = body.get("message") if isinstance(body.get("message"), dict) else {}
    ts = message.get("ts")
    if not (isinstance(user, str) and isinstance(channel, str) and user and channel and isinstance(ts, str)):
        log.warning("message shortcut without a user, channel or message: ignored")
        return
    thread_ts = message.get("thread_ts") if isinstance(message.get("thread_ts"), str) else ts

    def say(text: str) -> None:
        tell(client, channel, user, text, thread_ts=thread_ts)

    refusal = access.refusal(s.config, user, channel)
    if refusal:
        say(refusal)
        return
    if s.analyze is None:
        say("hangdx: analyze is not available on this server.")
        return
    req = AnalyzeRequest(
        channel=channel, thread_ts=thread_ts, requested_by=user, source="shortcut", message_ts=ts
    )
    if submitted(s.analyze, req, "analysis of this message", say):
        say("Reading this message and its text files…")
