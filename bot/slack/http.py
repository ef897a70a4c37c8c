"""POST /slack/events: Slack's signed HTTP requests, checked (signature, replay, retry, shape) before Bolt sees them."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import redis
from flask import Flask, request
from slack_bolt import App
from slack_bolt.adapter.flask.handler import to_bolt_request, to_flask_response
from slack_sdk.signature import SignatureVerifier

from hangdx.bot.alerts import json_error
from hangdx.bot.incidents import PREFIX
from hangdx.bot.slack.common import one_line

log = logging.getLogger("hangdx.bot")

# Bolt's SignatureVerifier accepts a request stamped up to 5 minutes either side of our clock; a signature
# is remembered until its timestamp can no longer pass, plus a margin for clock steps.
SIGNATURE_WINDOW = 300
SIGNATURE_MARGIN = 30
EVENT_MEMORY = 3600  # Slack retries an event for about 5 minutes (immediately, after 1 and after 5)


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


def shape_error(body: dict[str, Any]) -> str | None:
    """What makes a signed Slack body unusable before Bolt reads it (Bolt would raise on it), or None."""
    kind = body.get("type")
    for key in ("user", "channel", "container", "message", "event", "team", "view"):
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


def register(flask_app: Flask, app: App, signing_secret: str, seen: SeenRequests) -> None:
    """Serve `app` (the Bolt app) at POST /slack/events on `flask_app`."""
    verifier = SignatureVerifier(signing_secret)

    @flask_app.post("/slack/events")
    def slack_events():
        try:
            body = request.get_data().decode("utf-8")
        except UnicodeDecodeError:
            return json_error(400, "malformed Slack request: the body is not UTF-8")
        stamp = request.headers.get("X-Slack-Request-Timestamp", "")
        signature = request.headers.get("X-Slack-Signature", "")
        if not stamp.isdigit() or not verifier.is_valid(body, stamp, signature):
            return json_error(401, "invalid or stale Slack signature")
        try:
            bolt_req = to_bolt_request(request)
            shape = shape_error(bolt_req.body)
        except Exception as e:  # noqa: BLE001 - Bolt's parser on a body Slack would never send
            log.warning("Slack request body not readable: %s", one_line(e, 200))
            shape = "a form or a JSON object expected"
        if shape:
            log.warning("malformed Slack request: %s", shape)
            return json_error(400, f"malformed Slack request: {shape}")
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
            return json_error(401, "replayed Slack request: this signature was already used")
        # A retry is a new delivery (new timestamp, new signature) of the same event_id: acted on once.
        event_id = bolt_req.body.get("event_id")
        if isinstance(event_id, str) and event_id:
            if not seen.first("slack-event:" + event_id, EVENT_MEMORY) and retry:
                return "", 200
        return to_flask_response(app.dispatch(bolt_req))
