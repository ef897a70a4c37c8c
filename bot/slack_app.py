"""The Slack edge: parse what Slack or Alertmanager sends into a DiagnoseRequest, refuse early, hand it on.

`/diagnose <jobid>`, `@hangdx diagnose <jobid>` and an alert all become `submit(DiagnoseRequest(...))`;
the verdict's buttons become `on_action(action, job_id, user)`; `/diagnose status|handoff` (and
`@hangdx status|handoff`) answer with `report(kind)`. Nothing here runs a diagnosis.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import redis
from flask import Flask, jsonify, request
from slack_bolt import App, BoltResponse
from slack_bolt.adapter.flask.handler import to_bolt_request, to_flask_response
from slack_bolt.error import BoltUnhandledRequestError
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError
from slack_sdk.signature import SignatureVerifier
from werkzeug.exceptions import HTTPException

from hangdx.bot.blocks import ACTION_PREFIX, ACTIONS, clip, escape, help_blocks
from hangdx.bot.config import BotConfig, is_channel_id
from hangdx.bot.diagnosis import DiagnosisError, check_job_id
from hangdx.bot.incidents import PREFIX, IncidentStore, StoreUnavailable
from hangdx.bot.request import DiagnoseRequest
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.bot")

Submit = Callable[[DiagnoseRequest], str]
OnAction = Callable[[str, str, str], None]
# report("status" | "handoff") -> (fallback text, blocks): the open incidents, built by blocks.py.
Report = Callable[[str], tuple[str, list[dict]]]
REPORTS = ("status", "handoff")

# A host named by an alert reaches ssh and Slurm: a safe alphabet, never a leading dash (an ssh option).
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
_MENTION = re.compile(r"<@[A-Z0-9]+(?:\|[^>]*)?>")
_JOB_LABELS = ("job_id", "slurm_job_id", "job")
_HOST_LABELS = ("instance", "node", "host")
MAX_ALERT_BYTES = 1 << 20  # any request body: Slack's are a few KiB, an Alertmanager group a few hundred
MAX_ALERTS = 500  # alerts read from one payload; the rest are named in one line
MAX_ALERT_JOBS = 20  # jobs diagnosed from one payload: an alert storm must not start a hundred diagnoses
MAX_ALERT_HOSTS = 4096
MAX_SKIPPED = 20  # skip reasons returned; the rest are counted
MAX_SUMMARY = 500
MAX_AUTHORIZATION = 1024  # an Authorization header longer than this is not our token: refused unread
# Bolt's SignatureVerifier accepts a request stamped up to 5 minutes either side of our clock; a signature
# is remembered until its timestamp can no longer pass, plus a margin for clock steps.
SIGNATURE_WINDOW = 300
SIGNATURE_MARGIN = 30
EVENT_MEMORY = 3600  # Slack retries an event for about 5 minutes (immediately, after 1 and after 5)


class AlertError(ValueError):
    """An /alerts body hangdx cannot use: one line."""


class SeenRequests:
    """What the bot has acted on, for replay and retry checks: `first(key, ttl)` is True only the first time.

    Kept in Redis (SET NX EX) so that every `hangdx serve` behind a load balancer shares it; without Redis, or
    while Redis is down, in this process (a replay to this process is still caught).
    """

    def __init__(self, client: redis.Redis | None = None) -> None:
        self.r = client
        self._local: dict[str, float] = {}
        self._lock = threading.Lock()

    def first(self, key: str, ttl: int) -> bool:
        if self.r is not None:
            try:
                return bool(self.r.set(f"{PREFIX}seen:{key}", "1", nx=True, ex=max(1, ttl)))
            except redis.exceptions.RedisError as e:
                log.warning("replay check falls back to this process: redis: %s", e)
        now = time.monotonic()
        with self._lock:
            if len(self._local) > 100_000:
                self._local = {k: t for k, t in self._local.items() if t > now}
            if self._local.get(key, 0.0) > now:
                return False
            self._local[key] = now + ttl
            return True


def _job_refusal(job_id: str) -> str | None:
    try:
        check_job_id(job_id)
    except DiagnosisError as e:
        return clip(redact(str(e)), 300)
    return None


def _host_of(value: str) -> str:
    """`gpu-node-03:9100` (a Prometheus instance) -> `gpu-node-03`; `[fe80::1]:9100` -> `fe80::1`."""
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


def _check_hosts(hosts: list[Any]) -> list[str]:
    if len(hosts) > MAX_ALERT_HOSTS:
        raise AlertError(f"hosts: {len(hosts)} given, at most {MAX_ALERT_HOSTS}")
    out: dict[str, None] = {}
    for h in hosts:
        # A safe alphabet, no leading dash (an ssh option), no newline: fullmatch, not `$`.
        if not isinstance(h, str) or not _HOST.fullmatch(_host_of(h)):
            raise AlertError(f"{str(h)[:80]!r} is not a host name")
        out.setdefault(_host_of(h))
    return list(out)


def _check_channel(channel: Any, allowed: frozenset[str], default: str | None) -> str | None:
    """The channel an alert names: a channel id, and one of HANGDX_ALLOWED_CHANNELS when that is set."""
    if channel is None or channel == default:
        return default
    if not is_channel_id(channel):
        raise AlertError(f"channel: {str(channel)[:40]!r} is not a channel id (C...)")
    if allowed and channel not in allowed:
        raise AlertError(f"channel: {channel} is not in HANGDX_ALLOWED_CHANNELS")
    return channel


def _summary(value: Any) -> str | None:
    """An alert's own words, kept short and without secrets (they reach Slack, Redis and the postmortem)."""
    if value is None or value == "":
        return None
    return clip(redact(str(value)[: MAX_SUMMARY + 200]), MAX_SUMMARY)


def _bounded(skipped: list[str]) -> list[str]:
    if len(skipped) <= MAX_SKIPPED:
        return skipped
    return skipped[:MAX_SKIPPED] + [f"... and {len(skipped) - MAX_SKIPPED} more skipped"]


def parse_alerts(
    payload: Any, default_channel: str | None, allowed_channels: frozenset[str] = frozenset()
) -> tuple[list[DiagnoseRequest], list[str]]:
    """An Alertmanager webhook (v4) or `{"job_id", "hosts", "channel", "summary"}` -> requests, skip reasons.

    At most MAX_ALERT_JOBS requests; what is left out is named in `skipped`, one line each, at most
    MAX_SKIPPED lines."""
    if not isinstance(payload, dict):
        raise AlertError("expected a JSON object")
    if isinstance(payload.get("alerts"), list):
        reqs, skipped = _parse_alertmanager(payload, default_channel)
        return reqs, _bounded(skipped)
    if "job_id" in payload:
        job_id = payload["job_id"]
        if not isinstance(job_id, (str, int)) or isinstance(job_id, bool):
            raise AlertError("job_id: expected a string")
        job_id = str(job_id)
        why = _job_refusal(job_id)
        if why:
            raise AlertError(why)
        hosts = payload.get("hosts") or []
        if not isinstance(hosts, list):
            raise AlertError("hosts: expected a list of host names")
        channel = _check_channel(payload.get("channel") or None, allowed_channels, default_channel)
        summary = payload.get("summary")
        if summary is not None and not isinstance(summary, str):
            raise AlertError("summary: expected a string")
        req = DiagnoseRequest(
            job_id=job_id,
            source="alert",
            requested_by="alert",
            channel=channel,
            hosts=_check_hosts(hosts),
            summary=_summary(summary),
        )
        return [req], []
    raise AlertError('expected an Alertmanager webhook ("alerts": [...]) or {"job_id": ...}')


def _parse_alertmanager(
    payload: dict[str, Any], channel: str | None
) -> tuple[list[DiagnoseRequest], list[str]]:
    by_job: dict[str, DiagnoseRequest] = {}
    skipped: list[str] = []
    common_ann = (
        payload.get("commonAnnotations") if isinstance(payload.get("commonAnnotations"), dict) else {}
    )
    alerts = payload["alerts"]
    if len(alerts) > MAX_ALERTS:
        skipped.append(f"{len(alerts) - MAX_ALERTS} more alerts not read (at most {MAX_ALERTS} per payload)")
    jobs_left_out: set[str] = set()
    for i, alert in enumerate(alerts[:MAX_ALERTS]):
        if not isinstance(alert, dict):
            raise AlertError(f"alerts[{i}]: expected an object")
        # A resolved alert needs no diagnosis; the incident side may want it later, not this edge.
        if alert.get("status", "firing") != "firing":
            continue
        labels = alert.get("labels") if isinstance(alert.get("labels"), dict) else {}
        ann = alert.get("annotations") if isinstance(alert.get("annotations"), dict) else {}
        job_id = next((str(labels[k]) for k in _JOB_LABELS if labels.get(k)), None)
        name = clip(str(labels.get("alertname") or f"alerts[{i}]"), 80)
        if job_id is None:
            skipped.append(f"{name}: no job_id, slurm_job_id or job label")
            continue
        why = _job_refusal(job_id)
        if why:
            skipped.append(f"{name}: {why}")
            continue
        try:
            hosts = _check_hosts([str(labels[k]) for k in _HOST_LABELS if labels.get(k)][:1])
        except AlertError as e:
            skipped.append(f"{name}: {e}")
            continue
        if job_id not in by_job and len(by_job) >= MAX_ALERT_JOBS:
            jobs_left_out.add(job_id)
            continue
        # One diagnosis per job: Alertmanager groups one alert per host of the same job.
        req = by_job.setdefault(
            job_id,
            DiagnoseRequest(job_id=job_id, source="alert", requested_by="alertmanager", channel=channel),
        )
        req.hosts.extend(h for h in hosts if h not in req.hosts)
        summary = ann.get("summary") or common_ann.get("summary")
        if summary and not req.summary:
            req.summary = _summary(summary)
    if jobs_left_out:
        skipped.insert(
            0, f"{len(jobs_left_out)} more jobs not diagnosed (at most {MAX_ALERT_JOBS} per payload)"
        )
    return list(by_job.values()), skipped


def _json_error(status: int, message: str):
    return jsonify({"ok": False, "error": clip(redact(message), 300)}), status


def _slash_text(text: str) -> tuple[str, str | None]:
    """`/diagnose` text -> ("help", None) | ("status"|"handoff", None) | ("diagnose", job_id) | ("refuse", why)."""
    text = (text or "").strip()
    if text.lower() in ("", "help"):
        return "help", None
    if text.lower() in REPORTS:
        return text.lower(), None
    why = _job_refusal(text)
    return ("refuse", escape(why)) if why else ("diagnose", text)


def _mention_text(text: str) -> tuple[str, str | None]:
    words = _MENTION.sub(" ", text or "").split()
    if not words or words[0].lower() == "help":
        return "help", None
    if words[0].lower() in REPORTS and len(words) == 1:
        return words[0].lower(), None
    if words[0].lower() != "diagnose" or len(words) < 2:
        return "refuse", "Usage: @hangdx diagnose <jobid> | status | handoff | help"
    return _slash_text(" ".join(words[1:]))


def _run_report(report: Report | None, kind: str) -> tuple[str, list[dict] | None]:
    """The report's (text, blocks), or a one-line apology when there is no report or it failed."""
    if report is None:
        return f"hangdx: {kind} is not available on this server.", None
    try:
        text, blocks = report(kind)
    except Exception as e:  # Redis down: say so to the person who asked
        log.exception("report %s failed", kind)
        return clip(f"hangdx could not build the {kind} report: {redact(str(e))}", 300), None
    return clip(redact(text), 3000), blocks


class GroupMembers:
    """Members of a Slack user group (usergroups.users.list), cached for a few minutes."""

    def __init__(self, client: WebClient, ttl: float = 300.0) -> None:
        self.client, self.ttl = client, ttl
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}
        self._lock = threading.Lock()

    def __call__(self, group: str) -> frozenset[str]:
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(group)
            if hit and now - hit[0] < self.ttl:
                return hit[1]
        try:
            users = frozenset(self.client.usergroups_users_list(usergroup=group).get("users") or [])
        except (SlackApiError, OSError) as e:
            log.warning("usergroups.users.list %s failed: %s", group, e)
            return hit[1] if hit else frozenset()  # Slack down: keep the last answer, else allow nobody new
        with self._lock:
            self._cache[group] = (now, users)
        return users


def _slack_error(e: Exception) -> str:
    if isinstance(e, SlackApiError):
        return str(e.response.get("error"))
    return " ".join(str(e).split())[:200]


def _tell(client: WebClient, channel: Any, user: Any, text: str, **kw: Any) -> None:
    """An answer only `user` sees; Slack refusing it is one log line, not a traceback."""
    if not (isinstance(channel, str) and isinstance(user, str) and channel and user):
        log.warning("no channel or user to answer (%s)", text[:80])
        return
    try:
        client.chat_postEphemeral(channel=channel, user=user, text=text, **kw)
    except (SlackApiError, OSError) as e:
        log.warning("chat.postEphemeral to %s failed: %s", user, _slack_error(e))


def _button_refusal(store: IncidentStore | None, job_id: str, channel: str, message: dict) -> str | None:
    """A verdict's button acts on the job of the incident whose thread it is in, and on no other."""
    if store is None:
        return None
    try:
        inc = store.get(job_id)
    except StoreUnavailable as e:
        return clip(f"hangdx cannot check this button now: {redact(str(e))}", 300)
    if inc is None:
        return f"There is no incident for job {job_id}: this button is not under one of its verdicts."
    thread = message.get("thread_ts") or message.get("ts")
    if inc.channel != channel or (inc.thread_ts and inc.thread_ts != thread):
        return f"This button is not in the thread of job {job_id}'s incident: use the ones under its verdict."
    return None


def _shape_error(body: dict[str, Any]) -> str | None:
    """What makes a signed Slack body unusable before Bolt reads it (Bolt would raise on it), or None."""
    kind = body.get("type")
    for key in ("user", "channel", "container", "message", "event", "team"):
        if key in body and body[key] is not None and not isinstance(body[key], dict):
            return f"{key} is not an object"
    if kind == "block_actions":
        actions = body.get("actions")
        if not isinstance(actions, list) or not actions:
            return "block_actions without actions"
        if not all(isinstance(a, dict) and isinstance(a.get("action_id"), str) for a in actions):
            return "an action without an action_id"
    if kind == "event_callback" and not isinstance(body.get("event"), dict):
        return "event_callback without an event"
    return None


def _one_line(value: Any, limit: int = 80) -> str:
    return clip(" ".join(str(value).split()), limit)


def build_app(
    config: BotConfig,
    submit: Submit,
    on_action: OnAction | None = None,
    report: Report | None = None,
    store: IncidentStore | None = None,
    health: Callable[[], dict] | None = None,
) -> tuple[App, Flask]:
    """The Bolt app (slash command, mentions, buttons) and the Flask app serving it with /alerts and /healthz.

    With `store` (the incidents in Redis), a button must come from its job's incident thread and replayed
    requests are remembered in Redis; without it, replays are remembered in this process only."""
    config.require_slack()
    socket_mode = bool(config.app_token)
    client = WebClient(token=config.bot_token, base_url=config.api_url)
    if config.allowed_groups and config.group_members is None:
        config = dataclasses.replace(config, group_members=GroupMembers(client))
    app = App(
        client=client,
        signing_secret=config.signing_secret or "",
        # In Socket Mode Slack's messages come over the socket, and /slack/events is not served.
        request_verification_enabled=not socket_mode,
        # An action, command or event no listener takes goes to on_error below: one line, not Bolt's advice.
        raise_error_for_unhandled_request=True,
    )

    @app.error
    def on_error(error, request, response):
        body = request.body if isinstance(request.body, dict) else {}
        if isinstance(error, BoltUnhandledRequestError):
            event = body.get("event") if isinstance(body.get("event"), dict) else {}
            what = body.get("command") or event.get("type") or body.get("type") or "request"
            log.warning("hangdx does not handle this Slack %s: answered without effect", _one_line(what, 60))
            if body.get("type") == "event_callback":
                return BoltResponse(status=200, body="")  # acknowledged, so that Slack does not retry it
            return BoltResponse(
                status=400,
                body=json.dumps({"ok": False, "error": f"hangdx does not handle this {_one_line(what, 60)}"}),
                headers={"content-type": "application/json"},
            )
        log.error("Slack request failed: %s: %s", type(error).__name__, _one_line(error, 300), exc_info=error)
        return None

    @app.command("/diagnose")
    def diagnose_command(ack, command, respond):
        user, channel = command.get("user_id"), command.get("channel_id")
        if not user or not channel:
            ack(text="hangdx: this command names no user or channel.", response_type="ephemeral")
            return
        refusal = config.refusal(user, channel)
        if refusal:
            ack(text=refusal, response_type="ephemeral")
            return
        what, arg = _slash_text(command.get("text", ""))
        if what == "help":
            ack(blocks=help_blocks(), text="hangdx: /diagnose <jobid>", response_type="ephemeral")
            return
        if what == "refuse":
            ack(text=arg, response_type="ephemeral")
            return
        if what in REPORTS:
            # Ack first: the report reads Redis, and Slack gives a slash command 3 seconds.
            ack()
            text, blocks = _run_report(report, what)
            kind = "in_channel" if what == "handoff" and blocks is not None else "ephemeral"
            respond(text=text, blocks=blocks, response_type=kind, replace_original=False)
            return
        ack(text=f"Diagnosing job {escape(arg)}…", response_type="ephemeral")
        req = DiagnoseRequest(job_id=arg, source="slash", requested_by=user, channel=channel)
        try:
            submit(req)
        except Exception as e:  # the queue is down: tell the person who asked, not a log nobody reads
            log.exception("submit failed for job %s", arg)
            respond(text=clip(f"Could not queue the diagnosis of job {arg}: {redact(str(e))}", 300))

    @app.event("app_mention")
    def diagnose_mention(event, client):
        user, channel = event.get("user"), event.get("channel")
        thread_ts = event.get("thread_ts") or event.get("ts")
        if not (isinstance(user, str) and isinstance(channel, str) and user and channel):
            log.warning("app_mention without a user or channel: ignored")
            return

        def tell(text: str, blocks: list | None = None) -> None:
            _tell(client, channel, user, text, blocks=blocks, thread_ts=thread_ts)

        refusal = config.refusal(user, channel)
        if refusal:
            tell(refusal)
            return
        text = event.get("text")
        what, arg = _mention_text(text if isinstance(text, str) else "")
        if what == "help":
            tell("hangdx: @hangdx diagnose <jobid>", help_blocks())
            return
        if what == "refuse":
            tell(arg)
            return
        if what in REPORTS:
            text, blocks = _run_report(report, what)
            if what == "handoff" and blocks is not None:
                try:
                    client.chat_postMessage(
                        channel=channel, text=text, blocks=blocks, thread_ts=event.get("thread_ts")
                    )
                except (SlackApiError, OSError) as e:
                    log.warning("chat.postMessage of the hand-off failed: %s", _slack_error(e))
            else:
                tell(text, blocks)
            return
        tell(f"Diagnosing job {escape(arg)}…")
        req = DiagnoseRequest(
            job_id=arg, source="mention", requested_by=user, channel=channel, thread_ts=thread_ts
        )
        try:
            submit(req)
        except Exception as e:
            log.exception("submit failed for job %s", arg)
            tell(clip(f"Could not queue the diagnosis of job {arg}: {redact(str(e))}", 300))

    @app.action(re.compile("^" + ACTION_PREFIX + "(" + "|".join(ACTIONS) + ")$"))
    def verdict_button(ack, body, action, client):
        ack()
        user = (body.get("user") or {}).get("id")
        channel = (body.get("channel") or {}).get("id") or (body.get("container") or {}).get("channel_id")
        name = action["action_id"][len(ACTION_PREFIX) :]
        if not (isinstance(user, str) and isinstance(channel, str) and user and channel):
            log.warning("button %s without a user or channel: ignored", name)
            return
        job_id = action.get("value") or ""
        message = body.get("message") if isinstance(body.get("message"), dict) else {}
        refusal = (
            config.refusal(user, channel)
            or escape(_job_refusal(job_id) or "")
            or _button_refusal(store, job_id, channel, message)
        )
        if refusal:
            _tell(client, channel, user, refusal)
            return
        if name == "rerun":
            req = DiagnoseRequest(
                job_id=job_id,
                source="button",
                requested_by=user,
                channel=channel,
                thread_ts=message.get("thread_ts") or message.get("ts"),
            )
            try:
                submit(req)
            except Exception as e:
                log.exception("submit failed for job %s", job_id)
                text = clip(f"Could not queue the diagnosis of job {job_id}: {redact(str(e))}", 300)
                _tell(client, channel, user, text)
                return
        if on_action is not None:
            try:
                on_action(name, job_id, user)
            except Exception as e:  # a resolved incident acknowledged, Redis down: say so to the presser
                log.warning("button %s on job %s failed: %s", name, job_id, _one_line(e, 300))
                said = clip(f"hangdx could not {name} job {job_id}: {redact(str(e))}", 300)
                _tell(client, channel, user, said)

    flask_app = Flask("hangdx")
    flask_app.config["MAX_CONTENT_LENGTH"] = MAX_ALERT_BYTES
    seen = SeenRequests(store.r if store is not None else None)

    @flask_app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        if e.code == 413:
            return _json_error(413, f"request body over {MAX_ALERT_BYTES} bytes")
        return _json_error(e.code or 400, f"{e.code} {e.name}")

    if not socket_mode:
        verifier = SignatureVerifier(config.signing_secret or "")

        @flask_app.post("/slack/events")
        def slack_events():
            try:
                body = request.get_data().decode("utf-8")
            except UnicodeDecodeError:
                return _json_error(400, "malformed Slack request: the body is not UTF-8")
            stamp = request.headers.get("X-Slack-Request-Timestamp", "")
            signature = request.headers.get("X-Slack-Signature", "")
            if not stamp.isdigit() or not verifier.is_valid(body, stamp, signature):
                return _json_error(401, "invalid or stale Slack signature")
            try:
                bolt_req = to_bolt_request(request)
                shape = _shape_error(bolt_req.body)
            except Exception as e:  # noqa: BLE001 - Bolt's parser on a body Slack would never send
                log.warning("Slack request body not readable: %s", _one_line(e, 200))
                shape = "a form or a JSON object expected"
            if shape:
                log.warning("malformed Slack request: %s", shape)
                return _json_error(400, f"malformed Slack request: {shape}")
            # Replays. A correctly signed request is good for Slack's 5-minute window: one seen before is a
            # copy (each real request differs: trigger_id, action_ts, event_id). Its signature is remembered
            # (SET NX) until its timestamp expires. A copy is refused 401, except Slack's own retries
            # (X-Slack-Retry-Num, sent by the Events API, immediately, then after 1 and 5 minutes, when a
            # delivery failed or took over 3 s): those get 200 and no effect, since Slack counts any other
            # answer as a failed delivery, retries again and in the end turns the app's events off.
            retry = request.headers.get("X-Slack-Retry-Num")
            ttl = int(stamp) + SIGNATURE_WINDOW + SIGNATURE_MARGIN - int(time.time())
            if not seen.first("slack-sig:" + signature, ttl):
                if retry:
                    return "", 200
                log.warning("replayed Slack request refused (signature seen before)")
                return _json_error(401, "replayed Slack request: this signature was already used")
            # A retry is a new delivery (new timestamp, new signature) of the same event_id: acted on once.
            event_id = bolt_req.body.get("event_id")
            if isinstance(event_id, str) and event_id:
                if not seen.first("slack-event:" + event_id, EVENT_MEMORY) and retry:
                    return "", 200
            return to_flask_response(app.dispatch(bolt_req))

    @flask_app.get("/healthz")
    def healthz():
        # Always 200 while serve answers (Kubernetes' liveness probe must not restart it during a Redis
        # outage); "redis" says whether incidents and the queue are reachable.
        return jsonify({"ok": True, **({"redis": health().get("redis")} if health else {})})

    @flask_app.post("/alerts")
    def alerts():
        if not config.alert_token:
            return _json_error(401, "alerts are disabled: HANGDX_ALERT_TOKEN is not set")
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        # The token is compared in constant time; an overlong header is refused before it is read.
        if (
            len(given) > MAX_AUTHORIZATION
            or scheme.lower() != "bearer"
            or not hmac.compare_digest(token.strip().encode(), config.alert_token.encode())
        ):
            return _json_error(401, "wrong or missing bearer token")
        try:
            payload = json.loads(request.get_data())
        except (ValueError, RecursionError):
            return _json_error(400, "body is not JSON")
        try:
            reqs, skipped = parse_alerts(payload, config.alert_channel, config.allowed_channels)
        except AlertError as e:
            return _json_error(400, str(e))
        except RecursionError:
            return _json_error(400, "body is nested too deeply")
        if not reqs and skipped:
            return _json_error(400, skipped[0])
        accepted = []
        for req in reqs:
            try:
                accepted.append({"job_id": req.job_id, "id": submit(req)})
            except Exception as e:
                # 5xx: Alertmanager retries, and the alert is not lost.
                log.exception("submit failed for job %s", req.job_id)
                return _json_error(503, f"could not queue job {req.job_id}: {e}")
        return jsonify({"ok": True, "accepted": accepted, "skipped": skipped}), 202

    return app, flask_app


def serve(
    config: BotConfig,
    submit: Submit,
    host: str = "127.0.0.1",
    port: int = 3000,
    on_action: OnAction | None = None,
    report: Report | None = None,
    store: IncidentStore | None = None,
    health: Callable[[], dict] | None = None,
) -> None:
    """`hangdx serve`: HTTP (or Socket Mode when SLACK_APP_TOKEN is set) until interrupted."""
    from werkzeug.serving import make_server

    from hangdx.bot.incidents import connect
    from hangdx.bot.schedule import HandoffScheduler

    store = store if store is not None else IncidentStore(connect(config.redis_url))
    app, flask_app = build_app(config, submit, on_action, report, store=store, health=health)
    scheduler = None
    if config.handoff_time and config.handoff_channel and report is not None:
        scheduler = HandoffScheduler(config, lambda: post_handoff(app.client, config.handoff_channel, report))
        scheduler.start()
        log.info("hand-off posts daily at %s UTC in %s", config.handoff_time, config.handoff_channel)
    if config.app_token:
        from slack_bolt.adapter.socket_mode import SocketModeHandler

        SocketModeHandler(app, config.app_token).connect()
    server = make_server(host, port, flask_app, threaded=True)
    log.info("hangdx serving on http://%s:%d", host, server.server_port)
    try:
        server.serve_forever()
    finally:
        if scheduler is not None:
            scheduler.stop()
        server.server_close()


def post_handoff(client: WebClient, channel: str, report: Report) -> None:
    """The scheduled hand-off: report("handoff") posted in `channel`."""
    text, blocks = report("handoff")
    client.chat_postMessage(channel=channel, text=clip(redact(text), 3000), blocks=blocks)
