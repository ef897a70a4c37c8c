"""Builds the Bolt app, registers every Slack surface on it, and serves it with the HTTP routes; nothing else.

A surface turns a Slack payload into a request (bot/request.py) and hands it to the service (bot/service.py):
commands.py (`/diagnose`), mentions.py (`@hangdx ...`), actions.py (verdict buttons), shortcuts.py ("Diagnose with
hangdx"). The alert intake (bot/alerts.py) is not Slack and sits beside it; who may do what is bot/access.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from flask import Flask, jsonify
from slack_bolt import App, BoltResponse
from slack_bolt.error import BoltUnhandledRequestError
from slack_sdk import WebClient
from werkzeug.exceptions import HTTPException

from hangdx.bot import alerts
from hangdx.bot.access import GroupMembers
from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import IncidentStore
from hangdx.bot.slack import actions, commands, http, mentions, shortcuts, views
from hangdx.bot.slack.common import OnAction, Report, Submit, SubmitAnalysis, Surfaces, one_line
from hangdx.bot.slack.link import SlackLink

log = logging.getLogger("hangdx.bot")


def build_app(
    config: BotConfig,
    submit: Submit,
    on_action: OnAction | None = None,
    report: Report | None = None,
    store: IncidentStore | None = None,
    health: Callable[[], dict] | None = None,
    analyze: SubmitAnalysis | None = None,
    history: Callable[[str], tuple[str, list[dict]]] | None = None,
    resolution: Callable[[str, str, str], None] | None = None,
    act: Callable[[str, str, str | None, str], None] | None = None,
) -> tuple[App, Flask]:
    """The Bolt app (slash command, mentions, buttons, shortcut) and the Flask app serving it with /alerts and
    /healthz.

    With `store` (the incidents in Redis), a button must come from its job's incident thread and replayed
    requests are remembered in Redis; without it, replays are remembered in this process only."""
    config.require_slack()
    socket_mode = bool(config.app_token)
    client = WebClient(token=config.bot_token, base_url=config.api_url)
    if (config.allowed_groups or config.action_groups) and config.group_members is None:
        config = dataclasses.replace(config, group_members=GroupMembers(client))
    # Bolt reads SLACK_BOT_TOKEN itself and, as it builds the app, warns that it is unused beside `client` (built
    # from the same token): at start-up that reads like a misconfiguration, so that one line is dropped.
    bolt_log = logging.getLogger("slack_bolt.App")
    if not any(isinstance(f, _ClientTokenWarning) for f in bolt_log.filters):
        bolt_log.addFilter(_ClientTokenWarning())
    app = App(
        client=client,
        signing_secret=config.signing_secret or "",
        # In Socket Mode Slack's messages come over the socket, and /slack/events is not served.
        request_verification_enabled=not socket_mode,
        # An action, command or event no listener takes goes to on_error below: one line, not Bolt's advice.
        raise_error_for_unhandled_request=True,
        # Listeners only ack and hand work to Surfaces.background; a pool larger than Bolt's 5 keeps a burst
        # of requests from waiting for a listener thread past Slack's 3 seconds.
        listener_executor=ThreadPoolExecutor(max_workers=32, thread_name_prefix="hangdx-bolt"),
        # Not at start: a Slack outage then would end `hangdx serve` and /alerts with it (SlackLink asks instead,
        # and Bolt asks again with the first Slack request).
        token_verification_enabled=False,
    )
    app.error(_on_error)
    surfaces = Surfaces(
        config, submit, on_action, report, store, analyze, history=history, resolution=resolution, act=act
    )
    for surface in (commands, mentions, actions, shortcuts, views):
        surface.register(app, surfaces)
    link = SlackLink(client, on_ok=lambda answer: _seed_authorization(app, answer)).start()
    app.hangdx_link = link  # type: ignore[attr-defined]  (serve stops it)
    return app, _flask_app(app, config, submit, store, health, socket_mode, link)


class _ClientTokenWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        from slack_bolt.logger.messages import warning_client_prioritized_and_token_skipped

        return record.getMessage() != warning_client_prioritized_and_token_skipped()


def _seed_authorization(app: App, answer) -> None:
    """Give Bolt the auth.test answer SlackLink got, so that no request asks Slack for it on its own path."""
    from slack_bolt.middleware.authorization.single_team_authorization import SingleTeamAuthorization

    for m in getattr(app, "_middleware_list", []):
        if isinstance(m, SingleTeamAuthorization) and not m.auth_test_result:
            m.auth_test_result = answer


def _on_error(error, request, response):
    body = request.body if isinstance(request.body, dict) else {}
    if isinstance(error, BoltUnhandledRequestError):
        event = body.get("event") if isinstance(body.get("event"), dict) else {}
        what = body.get("command") or event.get("type") or body.get("type") or "request"
        log.warning("hangdx does not handle this Slack %s: answered without effect", one_line(what, 60))
        if body.get("type") == "event_callback":
            return BoltResponse(status=200, body="")  # acknowledged, so that Slack does not retry it
        return BoltResponse(
            status=400,
            body=json.dumps({"ok": False, "error": f"hangdx does not handle this {one_line(what, 60)}"}),
            headers={"content-type": "application/json"},
        )
    log.error("Slack request failed: %s: %s", type(error).__name__, one_line(error, 300), exc_info=error)
    return None


def _flask_app(app, config, submit, store, health, socket_mode: bool, link: SlackLink) -> Flask:
    flask_app = Flask("hangdx")
    flask_app.config["MAX_CONTENT_LENGTH"] = alerts.MAX_ALERT_BYTES

    @flask_app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        if e.code == 413:
            return alerts.json_error(413, f"request body over {alerts.MAX_ALERT_BYTES} bytes")
        return alerts.json_error(e.code or 400, f"{e.code} {e.name}")

    if not socket_mode:
        seen = http.SeenRequests(store.r if store is not None else None)
        http.register(flask_app, app, config.signing_secret or "", seen)

    @flask_app.get("/healthz")
    def healthz():
        # Always 200 while serve answers (Kubernetes' liveness probe must not restart it during a Redis or Slack
        # outage); "redis" says whether incidents and the queue are reachable, "slack" whether Slack takes the
        # bot token.
        return jsonify(
            {"ok": True, **({"redis": health().get("redis")} if health else {}), "slack": link.state}
        )

    alerts.register(flask_app, config, submit)
    return flask_app
