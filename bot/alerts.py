"""The HTTP alert intake: Alertmanager's webhook (v4) or a plain JSON body at POST /alerts, bearer-token guarded.

Not Slack: it sits beside the Slack edge (bot/slack/) and hands the same DiagnoseRequest to the same service.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Callable
from typing import Any

from flask import Flask, jsonify, request

from hangdx.bot.access import job_refusal
from hangdx.bot.config import DEFAULT_JOB_LABELS, BotConfig, is_channel_id
from hangdx.bot.request import DiagnoseRequest
from hangdx.bot.slack.blocks import clip
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.bot")
Submit = Callable[[DiagnoseRequest], str]

# A host named by an alert reaches ssh and Slurm: a safe alphabet, never a leading dash (an ssh option).
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,252}")
# Labels naming the node that fired (DCGM exporter's is `Hostname`); any :port is taken off.
_HOST_LABELS = ("instance", "node", "host", "hostname", "Hostname")
MAX_ALERT_BYTES = 1 << 20  # any request body but /alerts': Slack's are a few KiB
# An Alertmanager group can be bigger than any other body: its first ALERT_READ bytes are read and the alerts in
# them diagnosed (answered 2xx with what was skipped: Alertmanager does not retry a 4xx, so a 413 loses the
# notification); a body over ALERT_MAX is not read at all.
ALERT_READ = 4 << 20
ALERT_MAX = 64 << 20
MAX_ALERTS = 500  # alerts read from one payload; the rest are named in one line
MAX_ALERT_JOBS = 20  # jobs diagnosed from one payload: an alert storm must not start a hundred diagnoses
MAX_ALERT_HOSTS = 4096
MAX_SKIPPED = 20  # skip reasons returned; the rest are counted
MAX_SUMMARY = 500
MAX_AUTHORIZATION = 1024  # an Authorization header longer than this is not our token: refused unread


class AlertError(ValueError):
    """An /alerts body hangdx cannot use: one line."""


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
    payload: Any,
    default_channel: str | None,
    allowed_channels: frozenset[str] = frozenset(),
    job_labels: tuple[str, ...] = DEFAULT_JOB_LABELS,
) -> tuple[list[DiagnoseRequest], list[str]]:
    """An Alertmanager webhook (v4) or `{"job_id", "hosts", "channel", "summary"}` -> requests, skip reasons.

    At most MAX_ALERT_JOBS requests; what is left out is named in `skipped`, one line each, at most
    MAX_SKIPPED lines."""
    if not isinstance(payload, dict):
        raise AlertError("expected a JSON object")
    if isinstance(payload.get("alerts"), list):
        reqs, skipped = _parse_alertmanager(payload, default_channel, job_labels)
        return reqs, _bounded(skipped)
    if "job_id" in payload:
        job_id = payload["job_id"]
        if not isinstance(job_id, (str, int)) or isinstance(job_id, bool):
            raise AlertError("job_id: expected a string")
        job_id = str(job_id)
        why = job_refusal(job_id)
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
    payload: dict[str, Any], channel: str | None, job_labels: tuple[str, ...]
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
        job_id = next((str(labels[k]) for k in job_labels if labels.get(k)), None)
        name = clip(str(labels.get("alertname") or f"alerts[{i}]"), 80)
        if job_id is None:
            skipped.append(
                f"{name}: no {', '.join(job_labels[:-1])} or {job_labels[-1]} label"
                if len(job_labels) > 1
                else f"{name}: no {job_labels[0]} label"
            )
            continue
        why = job_refusal(job_id)
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


def salvage_alertmanager(head: bytes) -> dict[str, Any] | None:
    """The alerts whole in the first bytes of an Alertmanager group too big to read (its `alerts` array comes
    before its common labels), as a payload; None when the head is not one."""
    text = head.decode("utf-8", "ignore")
    start = text.find('"alerts"')
    bracket = text.find("[", start) if start >= 0 else -1
    if bracket < 0 or text[start + len('"alerts"') : bracket].strip() != ":":
        return None
    decoder, pos, alerts = json.JSONDecoder(), bracket + 1, []
    while len(alerts) < MAX_ALERTS:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            alert, pos = decoder.raw_decode(text, pos)
        except (ValueError, RecursionError):
            break  # the alert cut off by the limit, or the array's end
        alerts.append(alert)
    return {"alerts": alerts} if alerts else None


def json_error(status: int, message: str):
    """A one-line JSON error, redacted and clipped: what every HTTP route answers when it refuses."""
    return jsonify({"ok": False, "error": clip(redact(message), 300)}), status


def register(flask_app: Flask, config: BotConfig, submit: Submit) -> None:
    """POST /alerts on `flask_app`: 202 with the accepted jobs, or a one-line JSON error."""

    @flask_app.post("/alerts")
    def alerts():
        if not config.alert_token:
            return json_error(401, "alerts are disabled: HANGDX_ALERT_TOKEN is not set")
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        # The token is compared in constant time; an overlong header is refused before it is read.
        if (
            len(given) > MAX_AUTHORIZATION
            or scheme.lower() != "bearer"
            or not hmac.compare_digest(token.strip().encode(), config.alert_token.encode())
        ):
            return json_error(401, "wrong or missing bearer token")
        request.max_content_length = ALERT_MAX
        raw = request.stream.read(ALERT_READ + 1)
        cut = len(raw) > ALERT_READ
        try:
            payload = json.loads(raw) if not cut else salvage_alertmanager(raw[:ALERT_READ])
        except (ValueError, RecursionError):
            return json_error(400, "body is not JSON")
        if payload is None:
            return json_error(413, f"request body over {ALERT_READ} bytes")
        try:
            reqs, skipped = parse_alerts(
                payload, config.alert_channel, config.allowed_channels, config.alert_job_labels
            )
        except AlertError as e:
            return json_error(400, str(e))
        except RecursionError:
            return json_error(400, "body is nested too deeply")
        if cut:
            n = len(payload.get("alerts") or [])
            skipped.insert(
                0, f"the group is over {ALERT_READ >> 20} MiB: its first {n} alerts were read, the rest not"
            )
        if not reqs and skipped:
            return json_error(400, skipped[0])
        accepted = []
        for req in reqs:
            try:
                accepted.append({"job_id": req.job_id, "id": submit(req)})
            except Exception as e:
                # 5xx: Alertmanager retries, and the alert is not lost.
                log.exception("submit failed for job %s", req.job_id)
                return json_error(503, f"could not queue job {req.job_id}: {e}")
        return jsonify({"ok": True, "accepted": accepted, "skipped": skipped}), 202
