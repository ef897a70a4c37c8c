"""The bot's handler: a request becomes an incident with a Slack thread and a queued diagnosis; a finished
diagnosis becomes a verdict in that thread. Slack specifics stay in slack_app.py and blocks.py."""

from __future__ import annotations

import functools
import logging
from typing import Any

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler, ServerErrorRetryHandler

from hangdx.bot.artifacts import load_stacks
from hangdx.bot.blocks import handoff_blocks, progress_text, status_blocks, verdict_blocks, verdict_text
from hangdx.bot.config import BotConfig
from hangdx.bot.diagnosis import DiagnoseOptions
from hangdx.bot.incidents import Incident, IncidentStore, connect
from hangdx.bot.queue import enqueue_diagnosis
from hangdx.bot.request import DiagnoseRequest
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.service")


def slack_client(cfg: BotConfig) -> WebClient:
    """A Web API client that waits out 429s (honouring Retry-After) and retries Slack's 5xx a few times."""
    client = WebClient(token=cfg.bot_token, base_url=cfg.api_url, timeout=15)
    client.retry_handlers.append(RateLimitErrorRetryHandler(max_retry_count=3))
    client.retry_handlers.append(ServerErrorRetryHandler(max_retry_count=2))
    return client


def _post(client: WebClient, **kw: Any) -> dict | None:
    try:
        return client.chat_postMessage(**kw).data  # type: ignore[return-value]
    except SlackApiError as e:
        log.warning("chat.postMessage failed: %s", e.response.get("error"))
        return None
    except OSError as e:
        # Slack unreachable (refused, timed out, DNS): the incident and its diagnosis must still go ahead.
        log.warning("chat.postMessage failed: %s", e)
        return None


class Service:
    """What every trigger (slash command, mention, alert, button) reaches, the same way."""

    def __init__(self, cfg: BotConfig, redis_client: Any = None, client: WebClient | None = None) -> None:
        self.cfg = cfg
        self.conn = redis_client if redis_client is not None else connect(cfg.redis_url)
        self.store = IncidentStore(self.conn)
        self.client = client or slack_client(cfg)

    def options(self, req: DiagnoseRequest) -> DiagnoseOptions:
        how = f"hosts:{','.join(req.hosts)}" if req.hosts else self.cfg.resolver
        return DiagnoseOptions(how=how)

    def submit(self, req: DiagnoseRequest) -> str:
        """Open (or join) the job's incident, give it a thread, queue the diagnosis; the RQ job id."""
        inc, is_new = self.store.open_or_join(req)
        channel = inc.channel or req.channel or self.cfg.alert_channel
        if channel and not inc.thread_ts:
            ts = req.thread_ts
            if ts is None:
                what = f" ({redact(req.summary)[:200]})" if req.summary else ""
                posted = _post(self.client, channel=channel, text=f"{progress_text(req.job_id, 0, 0)}{what}")
                ts = (posted or {}).get("ts")
            if ts:
                self.store.set_thread(req.job_id, channel, ts)
        elif channel and not is_new:
            who = f"<@{req.requested_by}>" if req.requested_by.startswith(("U", "W")) else req.requested_by
            _post(
                self.client,
                channel=channel,
                thread_ts=inc.thread_ts,
                text=f"Another {req.source} for job {req.job_id} from {who} joined this incident.",
            )
        return enqueue_diagnosis(self.conn, req, self.options(req))

    def recover(self) -> list[str]:
        """At start-up: end every diagnosis left running with nobody holding its lock; the jobs it ended."""
        ended: list[str] = []
        for inc in self.store.in_flight():
            job = inc.job_id
            if self.store.locked(job):
                continue  # a live worker is still diagnosing it
            self.store.mark_interrupted(job)
            ended.append(job)
            if inc.channel:
                _post(
                    self.client,
                    channel=inc.channel,
                    thread_ts=inc.thread_ts,
                    text=(
                        f"The diagnosis of job {job} was interrupted (the bot or its worker restarted); "
                        f"press Re-run or /diagnose {job}."
                    ),
                )
        return ended

    def report(self, kind: str) -> tuple[str, list[dict]]:
        """`/diagnose status|handoff`: the open incidents as (fallback text, blocks)."""
        incs = [i.to_dict() for i in self.store.list_open()]
        build = handoff_blocks if kind == "handoff" else status_blocks
        what = "hand-off" if kind == "handoff" else "status"
        return f"hangdx {what}: {len(incs)} open incident(s)", build(incs)

    def on_action(self, action: str, job_id: str, user: str) -> None:
        """Buttons under a verdict: the incident's status and owner."""
        if action == "ack":
            self.store.set_status(job_id, "acknowledged", user)
        elif action == "resolve":
            self.store.set_status(job_id, "resolved", user)
        elif action == "handoff":
            self.store.hand_off(job_id, to=user, actor=user)
        else:
            self.store.add_event(job_id, user, f"button_{action}")
        inc = self.store.get(job_id)
        if action == "stacks":
            if inc and inc.channel and inc.thread_ts:
                self.send_stacks(inc)
            return
        if inc and inc.channel and inc.thread_ts:
            _post(
                self.client,
                channel=inc.channel,
                thread_ts=inc.thread_ts,
                text=f"<@{user}>: {action} ({inc.status}).",
            )

    def send_stacks(self, inc: Incident) -> None:
        """The "Full stacks" button: the latest diagnosis's py-spy dumps as a file in the incident's thread."""
        job = inc.job_id
        stacks = load_stacks(self.conn, job)
        if stacks is None:
            text = f"No stacks kept for job {job} yet: run a diagnosis first."
            _post(self.client, channel=inc.channel, thread_ts=inc.thread_ts, text=text)
            return
        try:
            self.client.files_upload_v2(
                channel=inc.channel,
                thread_ts=inc.thread_ts,
                content=redact(stacks),  # a second guard: the node redacted them already
                filename=f"hangdx-{job}-stacks.txt",
                title=f"hangdx: full stacks of job {job} (latest diagnosis)",
            )
        except (SlackApiError, SlackRequestError, OSError) as e:
            err = e.response.get("error") if isinstance(e, SlackApiError) else " ".join(str(e).split())
            log.warning("files_upload_v2 of the stacks of job %s failed: %s", job, err)
            text = f"Could not upload the stacks of job {job}: {err}"
            _post(self.client, channel=inc.channel, thread_ts=inc.thread_ts, text=redact(text)[:300])


class SlackNotifier:
    """Posts a finished diagnosis in its incident's thread, one message per verdict, and updates the parent."""

    def __init__(self, client: WebClient) -> None:
        self.client = client

    def progress(self, incident: Incident, done: int, total: int) -> None:
        """Edit the incident's parent message in place as hosts report."""
        if not (incident.channel and incident.thread_ts):
            return
        try:
            self.client.chat_update(
                channel=incident.channel,
                ts=incident.thread_ts,
                text=progress_text(incident.job_id, total, done),
            )
        except (SlackApiError, OSError) as e:
            log.warning("chat.update (progress) failed: %s", e)

    def __call__(self, incident: Incident, verdict: dict[str, Any] | None, error: str | None) -> None:
        if not incident.channel:
            return
        job = incident.job_id
        if verdict is None:
            _post(
                self.client,
                channel=incident.channel,
                thread_ts=incident.thread_ts,
                text=redact(f"Diagnosis of job {job} could not run: {error}"),
            )
            return
        _post(
            self.client,
            channel=incident.channel,
            thread_ts=incident.thread_ts,
            blocks=verdict_blocks(verdict, job),
            text=verdict_text(verdict),
        )
        if incident.thread_ts:
            try:
                self.client.chat_update(
                    channel=incident.channel, ts=incident.thread_ts, text=verdict_text(verdict)
                )
            except SlackApiError as e:
                log.warning("chat.update failed: %s", e.response.get("error"))


@functools.lru_cache(maxsize=1)
def _worker_notifier() -> SlackNotifier:
    """One notifier per worker process: the settings are read and the client built once, not per message."""
    return SlackNotifier(slack_client(BotConfig.from_env()))


def notify(incident: Incident, verdict: dict[str, Any] | None, error: str | None) -> None:
    """The worker's notifier (HANGDX_NOTIFIER=hangdx.bot.service:notify): configured from the environment."""
    _worker_notifier()(incident, verdict, error)


def _notify_progress(incident: Incident, done: int, total: int) -> None:
    _worker_notifier().progress(incident, done, total)


notify.progress = _notify_progress  # type: ignore[attr-defined]
