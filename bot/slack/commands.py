"""`/diagnose <jobid> | status | handoff | help`: a slash command becomes a DiagnoseRequest or a report."""

from __future__ import annotations

import logging
import re

from slack_bolt import App

from hangdx.bot import access
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.slack.blocks import clip, escape, help_blocks, mrkdwn
from hangdx.bot.slack.common import REPORTS, Surfaces, run_report, submitted

log = logging.getLogger("hangdx.bot")


HISTORY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,252}")


def history_answer(s: Surfaces, name: str) -> tuple[str, list[dict] | None]:
    """The fleet memory of a host or job as (text, blocks), or a one-line apology."""
    if s.history is None:
        return "hangdx: history is not available on this server.", None
    try:
        return s.history(name)
    except Exception as e:  # Redis down: say so to the person who asked
        log.warning("history of %s failed: %s", name, e)
        return clip(mrkdwn("hangdx could not read the history of {name}: {e}", name=name, e=e), 300), None


def slash_text(text: str) -> tuple[str, str | None]:
    """`/diagnose` text -> ("help", None) | ("status"|"handoff", None) | ("diagnose", job_id) | ("refuse", why)."""
    text = (text or "").strip()
    if text.lower() in ("", "help"):
        return "help", None
    if text.lower() in REPORTS:
        return text.lower(), None
    word, _, rest = text.partition(" ")
    if word.lower() == "history":
        name = rest.strip()
        if not HISTORY_NAME.fullmatch(name):
            return "refuse", "Usage: /diagnose history <host|job>"
        return "history", name
    why = access.slack_job_refusal(text)
    return ("refuse", why) if why else ("diagnose", text)


def register(app: App, s: Surfaces) -> None:
    @app.command("/diagnose")
    def diagnose_command(ack, command, respond):
        user, channel = command.get("user_id"), command.get("channel_id")
        refusal = access.refusal(s.config, user, channel)
        if refusal:
            ack(text=refusal, response_type="ephemeral")
            return
        what, arg = slash_text(command.get("text", ""))
        if what == "help":
            ack(blocks=help_blocks(), text="hangdx: /diagnose <jobid>", response_type="ephemeral")
            return
        if what == "refuse":
            ack(text=arg, response_type="ephemeral")
            return
        if what == "history":
            ack()
            s.later(
                lambda: respond(*history_answer(s, arg), response_type="ephemeral", replace_original=False)
            )
            return
        if what in REPORTS:
            # Ack first, and the rest off the listener pool: the report reads Redis and its answer goes to
            # response_url, which may take seconds; Slack gives the next slash command 3.
            ack()
            s.later(_report, s, what, respond)
            return
        ack(text=f"Diagnosing job {escape(arg)}…", response_type="ephemeral")
        req = DiagnoseRequest(job_id=arg, source="slash", requested_by=user, channel=channel)
        s.later(submitted, s.submit, req, f"diagnosis of job {arg}", lambda said: respond(text=said))


def _report(s: Surfaces, what: str, respond) -> None:
    text, blocks = run_report(s.report, what)
    kind = "in_channel" if what == "handoff" and blocks is not None else "ephemeral"
    respond(text=text, blocks=blocks, response_type=kind, replace_original=False)
