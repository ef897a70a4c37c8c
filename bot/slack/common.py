"""What every Slack surface shares: the service it hands requests to, and how it answers one person."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import IncidentStore
from hangdx.bot.request import AnalyzeRequest, Busy, DiagnoseRequest
from hangdx.bot.slack.blocks import clip, mrkdwn
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.bot")

Submit = Callable[[DiagnoseRequest], str]
SubmitAnalysis = Callable[[AnalyzeRequest], str]
OnAction = Callable[[str, str, str], None]
# report("status" | "handoff") -> (fallback text, blocks): the open incidents, built by blocks.py.
Report = Callable[[str], tuple[str, list[dict]]]
REPORTS = ("status", "handoff")


@dataclass(frozen=True)
class Surfaces:
    """The service behind every surface: where requests go and what answers them."""

    config: BotConfig
    submit: Submit
    on_action: OnAction | None = None
    report: Report | None = None
    store: IncidentStore | None = None
    analyze: SubmitAnalysis | None = None
    history: Callable[[str], tuple[str, list[dict]]] | None = None  # the fleet memory of a host or job
    resolution: Callable[[str, str, str], None] | None = None  # (job, user, note) from the resolve dialog
    act: Callable[[str, str, str | None, str], None] | None = None  # (action, job, node, user): Slurm actions
    # Where the work after an ack runs (queueing, threads, replies): never Bolt's listener pool, so that a slow
    # or rate-limiting Slack cannot hold up the next request's acknowledgement.
    background: Executor = field(
        default_factory=lambda: ThreadPoolExecutor(64, thread_name_prefix="hangdx-bg")
    )

    def later(self, fn: Callable[..., Any], *args: Any) -> None:
        """fn(*args) after the ack, on the background pool; a failure is one log line."""

        def run() -> None:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - a background task must not die silently
                log.exception("Slack background task %s failed", getattr(fn, "__name__", fn))

        self.background.submit(run)


def one_line(value: Any, limit: int = 80) -> str:
    return clip(" ".join(str(value).split()), limit)


def slack_error(e: Exception) -> str:
    if isinstance(e, SlackApiError):
        return str(e.response.get("error"))
    return " ".join(str(e).split())[:200]


def tell(client: WebClient, channel: Any, user: Any, text: str, **kw: Any) -> None:
    """An answer only `user` sees; Slack refusing it is one log line, not a traceback."""
    if not (isinstance(channel, str) and isinstance(user, str) and channel and user):
        log.warning("no channel or user to answer (%s)", text[:80])
        return
    try:
        client.chat_postEphemeral(channel=channel, user=user, text=text, **kw)
    except (SlackApiError, OSError) as e:
        log.warning("chat.postEphemeral to %s failed: %s", user, slack_error(e))


def run_report(report: Report | None, kind: str) -> tuple[str, list[dict] | None]:
    """The report's (text, blocks), or a one-line apology when there is no report or it failed."""
    if report is None:
        return f"hangdx: {kind} is not available on this server.", None
    try:
        text, blocks = report(kind)
    except Exception as e:  # Redis down: say so to the person who asked
        log.exception("report %s failed", kind)
        return clip(mrkdwn("hangdx could not build the {kind} report: {e}", kind=kind, e=e), 300), None
    return clip(redact(text), 3000), blocks


def submitted(submit: Callable[[Any], str], req: Any, what: str, say: Callable[[str], None]) -> bool:
    """Hand `req` to the service; when the queue is down, tell the person who asked (not a log nobody reads)."""
    try:
        submit(req)
    except Busy as e:
        say(clip(mrkdwn("hangdx will not queue this {what} now: {e}", what=what, e=e), 300))
        return False
    except Exception as e:
        log.exception("submit failed for %s", what)
        say(clip(mrkdwn("Could not queue the {what}: {e}", what=what, e=e), 300))
        return False
    return True
