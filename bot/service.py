"""The bot's handler: a request becomes an incident with a Slack thread and a queued diagnosis; a finished
diagnosis becomes a verdict in that thread. Slack specifics stay in bot/slack/"""

from __future__ import annotations

import functools
import json
import logging
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError
from slack_sdk.http_retry.builtin_handlers import RateLimitErrorRetryHandler, ServerErrorRetryHandler

from hangdx.bot.artifacts import load_stacks
from hangdx.bot.config import BotConfig, ConfigError
from hangdx.bot.diagnosis import DiagnoseOptions
from hangdx.bot.incidents import Incident, IncidentStore, StoreUnavailable, connect, key_part
from hangdx.bot.queue import Reaper, check_settings, queue_analysis, queue_diagnosis, reap
from hangdx.bot.request import AnalyzeRequest, DiagnoseRequest
from hangdx.bot.slack.blocks import (
    CONFIRM,
    SLURM_ACTIONS,
    confirm_blocks,
    escape,
    handoff_blocks,
    history_blocks,
    mention,
    mrkdwn,
    progress_text,
    status_blocks,
    verdict_blocks,
    verdict_text,
)
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.service")
HUMAN_SOURCES = ("slash", "mention", "button")
THREAD_WAIT = 30.0  # seconds a request waits for another one making the incident's thread (Slack retries)


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
        self._reaper: Reaper | None = None
        # What waits on Slack after a request was taken (an incident's thread, "joined" lines): never on the
        # request path, where a rate-limited Slack would hold the alert's or the slash command's answer.
        self._slack = ThreadPoolExecutor(max_workers=4, thread_name_prefix="hangdx-slack")
        self._announcing: list = []
        self._announcing_lock = threading.Lock()

    def options(self, req: DiagnoseRequest) -> DiagnoseOptions:
        # The nodes an alert named are hints: the resolver (with its SSH settings) finds the job's hosts, the
        # alerting ones are probed first and named in the verdict (bot/diagnosis.py, ssh_targets).
        return DiagnoseOptions(how=self.cfg.resolver, hint_hosts=list(req.hosts))

    def submit(self, req: DiagnoseRequest) -> str:
        """Open (or join) the job's incident, give it one thread, queue the diagnosis (or join the one queued or
        running); the RQ job id that will answer, or "" for a repeated alert on an incident already diagnosed."""
        inc, is_new = self.store.open_or_join(req)
        channel = inc.channel or req.channel or self.cfg.alert_channel
        if not is_new and req.source == "alert" and inc.diagnosis == "done" and inc.verdicts:
            # Alertmanager sends a firing group again every repeat_interval: the repeat is on the timeline
            # (open_or_join), the thread keeps its one verdict. Re-run, /diagnose or a resolved-then-new
            # alert diagnoses again; a failed or interrupted diagnosis is retried by the repeat.
            return ""
        rq_id, joined = queue_diagnosis(self.conn, req, self.options(req))
        if is_new:
            self._first_join(inc, req.requested_by)  # who opened it has nothing to announce when asking again
        with self._announcing_lock:
            self._announcing = [f for f in self._announcing if not f.done()]
            self._announcing.append(self._slack.submit(self._announce, req, inc, channel, is_new, joined))
        return rq_id

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until what submit left for Slack (threads, "joined" lines) is done: for an orderly stop, and tests."""
        from concurrent.futures import wait

        with self._announcing_lock:
            pending = list(self._announcing)
        wait(pending, timeout=timeout)

    def _announce(
        self, req: DiagnoseRequest, inc: Incident, channel: str | None, is_new: bool, joined: bool
    ) -> None:
        """After the request was taken: the incident's thread (made once), and a person joining it said there."""
        try:
            self._announce_now(req, inc, channel, is_new, joined)
        except (StoreUnavailable, redis.exceptions.RedisError, OSError) as e:
            # The diagnosis is queued; its verdict goes to the channel even without a thread.
            log.warning("job %s: no thread made in Slack: %s", req.job_id, " ".join(str(e).split())[:200])
        except Exception:  # noqa: BLE001 - a bug here must not be lost silently
            log.exception("announcing job %s in Slack failed", req.job_id)

    def _announce_now(
        self, req: DiagnoseRequest, inc: Incident, channel: str | None, is_new: bool, joined: bool
    ) -> None:
        if channel and not inc.thread_ts:
            inc = self._make_thread(req, channel) or inc
        # A person asking is news to the thread; a repeated alert is not (the timeline keeps it).
        if (
            channel
            and inc.thread_ts
            and not is_new
            and req.source in HUMAN_SOURCES
            and self._first_join(inc, req.requested_by)
        ):
            also = "; the diagnosis under way will answer here" if joined else ""
            text = mrkdwn("Another {source} for job {job} from ", source=req.source, job=req.job_id)
            _post(
                self.client,
                channel=inc.channel or channel,
                thread_ts=inc.thread_ts,
                text=f"{text}{mention(req.requested_by)} joined this incident{also}.",
            )

    def _first_join(self, inc: Incident, user: str) -> bool:
        """Whether this person's request is the first of theirs to join this incident: a thread says "joined"
        once per person, however many times they ask (or Slack retries)."""
        key = f"hangdx:joined:{key_part(inc.job_id)}:{int(inc.created * 1000)}:{user}"
        try:
            return bool(self.conn.set(key, "1", nx=True, ex=7 * 24 * 3600))
        except redis.exceptions.RedisError:
            return False  # Redis down: say nothing rather than say it again

    def analyze(self, req: AnalyzeRequest) -> str:
        """`@hangdx analyze` or the shortcut: read what was pasted on a worker; the RQ job id that will answer."""
        return queue_analysis(self.conn, req)

    def _make_thread(self, req: DiagnoseRequest, channel: str) -> Incident | None:
        """The incident's thread, made by exactly one of the requests racing for it; the others wait for it
        (so that none of them queues a diagnosis whose verdict would have no thread to go to)."""
        job = req.job_id
        end = time.monotonic() + THREAD_WAIT
        while True:
            if self.store.claim_thread(job, THREAD_WAIT):
                try:
                    inc = self.store.get(job)
                    if inc is not None and not inc.thread_ts:
                        ts = req.thread_ts or self._post_parent(req, channel)
                        if ts:
                            self.store.set_thread(job, channel, ts)
                finally:
                    self.store.release_thread(job)
                return self.store.get(job)
            inc = self.store.get(job)
            if inc is None or inc.thread_ts or time.monotonic() > end:
                return inc
            time.sleep(0.05)

    def _post_parent(self, req: DiagnoseRequest, channel: str) -> str | None:
        what = f" ({escape(req.summary, 200)})" if req.summary else ""
        posted = _post(self.client, channel=channel, text=f"{progress_text(req.job_id, 0, 0)}{what}")
        return (posted or {}).get("ts")

    def reap(self) -> list[tuple[str, str]]:
        """One reaper pass (queue.reap), saying what it did in each incident's thread."""
        return reap(self.conn, self._say)

    def _say(self, inc: Incident, text: str) -> None:
        SlackNotifier(self.client).say(inc, text)

    def recover(self, watch: bool = True) -> list[str]:
        """At start-up: end every diagnosis left running from before run records, with nobody holding its lock,
        and run the reaper (once, and with `watch` every HANGDX_REAP_INTERVAL s from now on); the jobs whose
        diagnosis it marked interrupted."""
        try:
            check_settings()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        ended: list[str] = []
        for inc in self.store.in_flight():
            job = inc.job_id
            if not self.store.interrupt_orphan(job):
                continue  # a live worker is still diagnosing it, or its run record will be reaped
            ended.append(job)
            self._say(
                inc,
                f"The diagnosis of job {job} was interrupted (the bot or its worker restarted); "
                f"press Re-run or /diagnose {job}.",
            )
        ended += [job for job, what in self.reap() if what == "interrupted"]
        if watch and self._reaper is None:
            self._reaper = Reaper(self.conn, self._say).start()
        return ended

    def health(self) -> dict[str, Any]:
        """For /healthz: whether Redis answers (the bot still answers Slack when it does not)."""
        try:
            self.conn.ping()
        except redis.exceptions.RedisError as e:
            return {"ok": False, "redis": f"unavailable: {' '.join(str(e).split())[:200]}"}
        return {"ok": True, "redis": "ok"}

    def report(self, kind: str) -> tuple[str, list[dict]]:
        """`/diagnose status|handoff`: the open incidents as (fallback text, blocks)."""
        incs = [i.to_dict() for i in self.store.open_summaries()]
        what = "hand-off" if kind == "handoff" else "status"
        if kind != "handoff":
            return f"hangdx {what}: {len(incs)} open incident(s)", status_blocks(incs)
        from hangdx.bot.memory import Memory

        try:
            mem = Memory(self.conn)
            lemons, week = mem.lemons(), mem.week()
        except redis.exceptions.RedisError:
            lemons, week = [], None
        return f"hangdx {what}: {len(incs)} open incident(s)", handoff_blocks(incs, lemons=lemons, week=week)

    def history(self, name: str) -> tuple[str, list[dict]]:
        """`/diagnose history <host|job>`: what the fleet memory holds of it."""
        from hangdx.bot.memory import Memory

        recs = Memory(self.conn).history(name)
        return f"hangdx history of {name}: {len(recs)} incident(s)", history_blocks(name, recs)

    def resolution(self, job_id: str, user: str, note: str) -> None:
        """The one-line resolution given when an incident is resolved: on its timeline and in the fleet memory,
        quoted when the same hang comes back."""
        from hangdx.bot.memory import Memory

        note = " ".join(note.split())[:300]
        if not note:
            return
        self.store.add_event(job_id, user, "resolution", note)
        Memory(self.conn).resolve(job_id, note)

    def act(self, action: str, job_id: str, node: str | None, user: str) -> None:
        """A Slurm button (drain, requeue, cancel) pressed: checked, kept here under a one-time nonce and put to
        the presser alone; `act("confirm", nonce, None, user)` then runs it. Slack's own confirmation dialog lives
        in the client, and a signed request can skip it; the node and job come from what hangdx kept."""
        if action == CONFIRM:
            self._confirmed(job_id, user)
            return
        from hangdx.bot.slurm_actions import ActionError

        inc = self.store.get(job_id)
        try:
            if action not in SLURM_ACTIONS:
                raise ActionError(f"unknown action {action!r}")
            if action == "drain":
                _check_culprit(inc, node)
        except ActionError as e:
            if inc and inc.channel:
                _post(self.client, channel=inc.channel, thread_ts=inc.thread_ts,
                      text=f"{mention(user)}: " + mrkdwn("{action}: could not be done: {e}", action=action, e=e))  # fmt: skip
            return
        nonce = secrets.token_urlsafe(18)
        pending = {"action": action, "job": job_id, "node": node, "user": user, "at": time.time()}
        self.conn.set(_PENDING + nonce, json.dumps(pending), ex=PENDING_TTL)
        what = mrkdwn(
            {"drain": "Drain node *{node}*? No new job will start on it until someone resumes it "
                      "(`scontrol update NodeName=… State=RESUME`).",
             "requeue": "Requeue job *{job}*? It goes back in the queue.",
             "cancel": "Cancel job *{job}*? It is ended."}[action],
            node=node or "", job=job_id,
        )  # fmt: skip
        if inc and inc.channel:
            try:
                self.client.chat_postEphemeral(
                    channel=inc.channel, user=user, thread_ts=inc.thread_ts, text=what,
                    blocks=confirm_blocks(what + f" (confirm within {PENDING_TTL // 60} minutes)", nonce),
                )  # fmt: skip
            except (SlackApiError, SlackRequestError, OSError) as e:
                log.warning("could not ask %s to confirm %s: %s", user, action, e)

    def _confirmed(self, nonce: str, user: str) -> None:
        """Run a kept Slurm action once, for the person who asked for it, while it is fresh."""
        from hangdx.bot import slurm_actions

        raw = self.conn.get(_PENDING + nonce) if nonce else None
        pending = json.loads(raw) if raw else {}
        # Only who asked may confirm, once: a replayed or forged confirmation finds nothing of theirs.
        if pending.get("user") != user or not self.conn.delete(_PENDING + nonce):
            log.warning("a Slurm confirmation by %s matched no pending action of theirs", user)
            return
        action, job_id, node = pending["action"], pending["job"], pending.get("node")
        inc = self.store.get(job_id)
        try:
            if action == "drain":
                _check_culprit(inc, node)  # again: a newer verdict may name another node
            said = slurm_actions.run(action, job_id, node, user)
            ok = True
        except slurm_actions.ActionError as e:
            said, ok = str(e), False
        self.store.add_event(job_id, user, action if ok else f"{action}_failed", said)
        if ok:
            from hangdx.bot.memory import Memory

            try:
                Memory(self.conn).note_action(job_id, action, node or job_id, user)
            except redis.exceptions.RedisError:
                pass  # the action was done and is on the timeline; the week's summary will miss it
        if inc and inc.channel:
            done = "" if ok else "could not be done: "
            text = f"{mention(user)}: " + mrkdwn(
                "{action}: {done}{said}", action=action, done=done, said=said
            )
            _post(self.client, channel=inc.channel, thread_ts=inc.thread_ts, text=text)

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
                text=button_reply(action, job_id, user),
            )

    def send_stacks(self, inc: Incident) -> None:
        """The "Full stacks" button: the latest diagnosis's py-spy dumps as a file in the incident's thread."""
        job = inc.job_id
        stacks = load_stacks(self.conn, job)
        if stacks is None:
            text = mrkdwn("No stacks kept for job {job} yet: run a diagnosis first.", job=job)
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
            text = mrkdwn("Could not upload the stacks of job {job}: {err}", job=job, err=str(err)[:200])
            _post(self.client, channel=inc.channel, thread_ts=inc.thread_ts, text=text)


_BUTTON_REPLIES = {
    "ack": "{who} acknowledged job {job}: they are on it.",
    "resolve": "{who} resolved job {job}.",
    "handoff": "{who} took over job {job}: they own it now.",
    "rerun": "{who} asked for a new diagnosis of job {job}: its verdict follows in this thread.",
}


def button_reply(action: str, job: str, user: str) -> str:
    """What a verdict button did, in words, in the incident's thread."""
    template = _BUTTON_REPLIES.get(action, "{who} pressed " + action + " on job {job}.")
    return template.replace("{who}", mention(user)).replace("{job}", mrkdwn("{j}", j=job))


def _check_culprit(inc: Incident | None, node: str | None) -> None:
    """A node is drained from Slack only when the incident's latest verdict names it as a culprit host of its
    root cause (the hosts its Drain buttons show; hosts of the job, bot/diagnosis.py): a button's value is the
    presser's to forge."""
    from hangdx.bot.slurm_actions import ActionError

    root = ((inc.latest_verdict if inc else None) or {}).get("root_cause") or {}
    if node not in ((root.get("culprit") or {}).get("hosts") or []):
        raise ActionError(
            f"{str(node)[:80]!r} is not a culprit host of this incident's latest verdict: not drained"
        )


_PENDING = "hangdx:pending_action:"  # + nonce: a Slurm action pressed and not yet confirmed
PENDING_TTL = 300


class SlackNotifier:
    """Posts a finished diagnosis in its incident's thread, one message per verdict, and updates the parent."""

    def __init__(self, client: WebClient) -> None:
        self.client = client
        # The parent message's edits, one at a time per thread: a progress edit still in flight (or being retried
        # after a 429) finishes before the verdict's edit starts, and none starts after it: the verdict is last.
        self._guard = threading.Lock()
        self._edits: dict[str, threading.Lock] = {}
        self._final: set[str] = set()

    def _edit_lock(self, thread_ts: str) -> threading.Lock:
        with self._guard:
            return self._edits.setdefault(thread_ts, threading.Lock())

    def begin(self, incident: Incident) -> None:
        """A new diagnosis of this incident starts: its progress may be shown again."""
        if incident.thread_ts:
            with self._edit_lock(incident.thread_ts):
                self._final.discard(incident.thread_ts)

    def progress(self, incident: Incident, done: int, total: int) -> None:
        """Edit the incident's parent message in place as hosts report; never after its verdict."""
        if not (incident.channel and incident.thread_ts):
            return
        with self._edit_lock(incident.thread_ts):
            if incident.thread_ts in self._final:
                return
            try:
                self.client.chat_update(
                    channel=incident.channel,
                    ts=incident.thread_ts,
                    text=progress_text(incident.job_id, total, done),
                )
            except (SlackApiError, OSError) as e:
                log.warning("chat.update (progress) failed: %s", e)

    def open_thread(self, incident: Incident) -> str | None:
        """The incident's parent message, when the verdict is ready before serve made it; its ts."""
        posted = _post(self.client, channel=incident.channel, text=progress_text(incident.job_id, 0, 0))
        return (posted or {}).get("ts")

    def say(self, incident: Incident, text: str) -> None:
        """A line in the incident's thread (the reaper's "queued again" or "interrupted")."""
        if incident.channel:
            _post(
                self.client,
                channel=incident.channel,
                thread_ts=incident.thread_ts,
                text=mrkdwn("{t}", t=text),
            )

    def __call__(self, incident: Incident, verdict: dict[str, Any] | None, error: str | None) -> None:
        if not incident.channel:
            return
        job = incident.job_id
        if verdict is None:
            _post(
                self.client,
                channel=incident.channel,
                thread_ts=incident.thread_ts,
                text=mrkdwn("Diagnosis of job {job} could not run: {error}", job=job, error=error),
            )
            self._final_edit(incident, self._failed_text(incident, error))
            return
        from hangdx.bot.slurm_actions import knows_job

        _post(
            self.client,
            channel=incident.channel,
            thread_ts=incident.thread_ts,
            blocks=verdict_blocks(verdict, job, slurm=knows_job(job)),  # Slurm's buttons for Slurm's jobs
            text=verdict_text(verdict),
        )
        self._final_edit(incident, verdict_text(verdict))

    def _final_edit(self, incident: Incident, text: str) -> None:
        """The parent message's last edit of this diagnosis: no progress edit lands after it."""
        if not incident.thread_ts:
            return
        with self._edit_lock(incident.thread_ts):
            self._final.add(incident.thread_ts)
            try:
                self.client.chat_update(channel=incident.channel, ts=incident.thread_ts, text=text)
            except (SlackApiError, OSError) as e:
                log.warning("chat.update failed: %s", e)

    @staticmethod
    def _failed_text(incident: Incident, error: str | None) -> str:
        """A failed diagnosis in the parent message, never left at its progress ("evidence from 0/1 hosts"): the
        earlier verdict stands when there is one, and the failure is said beside it."""
        why = " ".join(str(error or "unknown error").split())[:300]
        earlier = incident.latest_verdict
        if earlier:
            return verdict_text(earlier) + mrkdwn(" (the latest diagnosis could not run: {why})", why=why)
        return mrkdwn("hangdx: job {job}: diagnosis failed: {why}", job=incident.job_id, why=why)


@functools.lru_cache(maxsize=1)
def _worker_notifier() -> SlackNotifier:
    """One notifier per worker process: the settings are read and the client built once, not per message."""
    return SlackNotifier(slack_client(BotConfig.from_env()))


def notify(incident: Incident, verdict: dict[str, Any] | None, error: str | None) -> None:
    """The worker's notifier (HANGDX_NOTIFIER=hangdx.bot.service:notify): configured from the environment."""
    _worker_notifier()(incident, verdict, error)


def _notify_progress(incident: Incident, done: int, total: int) -> None:
    _worker_notifier().progress(incident, done, total)


def _notify_say(incident: Incident, text: str) -> None:
    _worker_notifier().say(incident, text)


notify.progress = _notify_progress  # type: ignore[attr-defined]
notify.say = _notify_say  # type: ignore[attr-defined]
