"""The Slack edge: parse what Slack or Alertmanager sends into a DiagnoseRequest, refuse early, hand it on.

`/diagnose <jobid>`, `@hangdx diagnose <jobid>` and an alert all become `submit(DiagnoseRequest(...))`;
the verdict's buttons become `on_action(action, job_id, user)`; `/diagnose status|handoff` (and
`@hangdx status|handoff`) answer with `report(kind)`. Nothing here runs a diagnosis.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any

from flask import Flask, jsonify, request
from slack_bolt import App
from slack_bolt.adapter.flask import SlackRequestHandler
from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

from hangdx.bot.blocks import ACTION_PREFIX, ACTIONS, clip, escape, help_blocks
from hangdx.bot.config import BotConfig
from hangdx.bot.diagnosis import DiagnosisError, check_job_id
from hangdx.bot.request import DiagnoseRequest
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.bot")

Submit = Callable[[DiagnoseRequest], str]
OnAction = Callable[[str, str, str], None]
# report("status" | "handoff") -> (fallback text, blocks): the open incidents, built by blocks.py.
Report = Callable[[str], tuple[str, list[dict]]]
REPORTS = ("status", "handoff")

# A host named by an alert reaches ssh and Slurm: a safe alphabet, never a leading dash (an ssh option).
_HOST = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")
_MENTION = re.compile(r"<@[A-Z0-9]+(?:\|[^>]*)?>")
_JOB_LABELS = ("job_id", "slurm_job_id", "job")
_HOST_LABELS = ("instance", "node", "host")
MAX_ALERT_BYTES = 1 << 20


class AlertError(ValueError):
    """An /alerts body hangdx cannot use: one line."""


def _job_refusal(job_id: str) -> str | None:
    try:
        check_job_id(job_id)
    except DiagnosisError as e:
        return clip(redact(str(e)), 300)
    return None


def _host_of(value: str) -> str:
    """`gpu-node-03:9100` (a Prometheus instance) -> `gpu-node-03`; `[fe80::1]:9100` -> `fe80::1`."""
    value = value.strip()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    if value.count(":") == 1:
        return value.split(":", 1)[0]
    return value


def _check_hosts(hosts: list[Any]) -> list[str]:
    out: list[str] = []
    for h in hosts:
        if not isinstance(h, str) or not _HOST.match(_host_of(h)):
            raise AlertError(f"{str(h)[:80]!r} is not a host name")
        if _host_of(h) not in out:
            out.append(_host_of(h))
    return out


def parse_alerts(payload: Any, default_channel: str | None) -> tuple[list[DiagnoseRequest], list[str]]:
    """An Alertmanager webhook (v4) or `{"job_id", "hosts", "channel", "summary"}` -> requests, skip reasons."""
    if not isinstance(payload, dict):
        raise AlertError("expected a JSON object")
    if isinstance(payload.get("alerts"), list):
        return _parse_alertmanager(payload, default_channel)
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
        channel = payload.get("channel") or default_channel
        summary = payload.get("summary")
        if channel is not None and not isinstance(channel, str):
            raise AlertError("channel: expected a channel id")
        if summary is not None and not isinstance(summary, str):
            raise AlertError("summary: expected a string")
        req = DiagnoseRequest(
            job_id=job_id,
            source="alert",
            requested_by="alert",
            channel=channel,
            hosts=_check_hosts(hosts),
            summary=summary,
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
    for i, alert in enumerate(payload["alerts"]):
        if not isinstance(alert, dict):
            raise AlertError(f"alerts[{i}]: expected an object")
        # A resolved alert needs no diagnosis; the incident side may want it later, not this edge.
        if alert.get("status", "firing") != "firing":
            continue
        labels = alert.get("labels") if isinstance(alert.get("labels"), dict) else {}
        ann = alert.get("annotations") if isinstance(alert.get("annotations"), dict) else {}
        job_id = next((str(labels[k]) for k in _JOB_LABELS if labels.get(k)), None)
        name = labels.get("alertname", f"alerts[{i}]")
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
        # One diagnosis per job: Alertmanager groups one alert per host of the same job.
        req = by_job.setdefault(
            job_id,
            DiagnoseRequest(job_id=job_id, source="alert", requested_by="alertmanager", channel=channel),
        )
        req.hosts.extend(h for h in hosts if h not in req.hosts)
        summary = ann.get("summary") or common_ann.get("summary")
        if summary and not req.summary:
            req.summary = str(summary)
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
    return ("refuse", why) if why else ("diagnose", text)


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


def build_app(
    config: BotConfig,
    submit: Submit,
    on_action: OnAction | None = None,
    report: Report | None = None,
) -> tuple[App, Flask]:
    """The Bolt app (slash command, mentions, buttons) and the Flask app serving it with /alerts and /healthz."""
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
    )

    @app.command("/diagnose")
    def diagnose_command(ack, command, respond):
        user, channel = command.get("user_id"), command.get("channel_id")
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

        def tell(text: str, blocks: list | None = None) -> None:
            client.chat_postEphemeral(
                channel=channel, user=user, text=text, blocks=blocks, thread_ts=thread_ts
            )

        refusal = config.refusal(user, channel)
        if refusal:
            tell(refusal)
            return
        what, arg = _mention_text(event.get("text", ""))
        if what == "help":
            tell("hangdx: @hangdx diagnose <jobid>", help_blocks())
            return
        if what == "refuse":
            tell(arg)
            return
        if what in REPORTS:
            text, blocks = _run_report(report, what)
            if what == "handoff" and blocks is not None:
                client.chat_postMessage(
                    channel=channel, text=text, blocks=blocks, thread_ts=event.get("thread_ts")
                )
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
        job_id = action.get("value") or ""
        refusal = config.refusal(user, channel) or _job_refusal(job_id)
        if refusal:
            client.chat_postEphemeral(channel=channel, user=user, text=refusal)
            return
        if name == "rerun":
            message = body.get("message") or {}
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
                client.chat_postEphemeral(channel=channel, user=user, text=text)
                return
        if on_action is not None:
            on_action(name, job_id, user)

    flask_app = Flask("hangdx")
    flask_app.config["MAX_CONTENT_LENGTH"] = MAX_ALERT_BYTES
    handler = SlackRequestHandler(app)

    if not socket_mode:

        @flask_app.post("/slack/events")
        def slack_events():
            return handler.handle(request)

    @flask_app.get("/healthz")
    def healthz():
        return jsonify({"ok": True})

    @flask_app.post("/alerts")
    def alerts():
        if not config.alert_token:
            return _json_error(401, "alerts are disabled: HANGDX_ALERT_TOKEN is not set")
        given = request.headers.get("Authorization", "")
        expected = "Bearer " + config.alert_token
        if not hmac.compare_digest(given.encode(), expected.encode()):
            return _json_error(401, "wrong or missing bearer token")
        payload = request.get_json(force=True, silent=True)
        if payload is None:
            return _json_error(400, "body is not JSON")
        try:
            reqs, skipped = parse_alerts(payload, config.alert_channel)
        except AlertError as e:
            return _json_error(400, str(e))
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
) -> None:
    """`hangdx serve`: HTTP (or Socket Mode when SLACK_APP_TOKEN is set) until interrupted."""
    from werkzeug.serving import make_server

    from hangdx.bot.schedule import HandoffScheduler

    app, flask_app = build_app(config, submit, on_action, report)
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
