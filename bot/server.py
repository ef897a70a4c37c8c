"""`hangdx serve`: the Slack edge and the alert intake over HTTP (or Slack over Socket Mode), and the daily
hand-off."""

from __future__ import annotations

import logging
from collections.abc import Callable

from slack_sdk import WebClient

from hangdx.bot.config import BotConfig
from hangdx.bot.incidents import IncidentStore
from hangdx.bot.slack.app import build_app
from hangdx.bot.slack.blocks import clip
from hangdx.bot.slack.common import OnAction, Report, Submit, SubmitAnalysis
from hangdx.probes.collector import redact

log = logging.getLogger("hangdx.bot")


def serve(
    config: BotConfig,
    submit: Submit,
    host: str = "127.0.0.1",
    port: int = 3000,
    on_action: OnAction | None = None,
    report: Report | None = None,
    store: IncidentStore | None = None,
    health: Callable[[], dict] | None = None,
    analyze: SubmitAnalysis | None = None,
) -> None:
    """`hangdx serve`: HTTP (or Socket Mode when SLACK_APP_TOKEN is set) until interrupted."""
    from werkzeug.serving import make_server

    from hangdx.bot.incidents import connect
    from hangdx.bot.schedule import HandoffScheduler

    store = store if store is not None else IncidentStore(connect(config.redis_url))
    app, flask_app = build_app(config, submit, on_action, report, store=store, health=health, analyze=analyze)
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
