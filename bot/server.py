"""`hangdx serve`: the Slack edge and the alert intake over HTTP (or Slack over Socket Mode), and the daily
hand-off."""

from __future__ import annotations

import logging
import sys
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
    history: Callable[[str], tuple[str, list[dict]]] | None = None,
    resolution: Callable[[str, str, str], None] | None = None,
    act: Callable[[str, str, str | None, str], None] | None = None,
) -> None:
    """`hangdx serve`: HTTP (or Socket Mode when SLACK_APP_TOKEN is set) until interrupted."""
    from hangdx.bot.incidents import connect
    from hangdx.bot.schedule import HandoffScheduler

    store = store if store is not None else IncidentStore(connect(config.redis_url))
    app, flask_app = build_app(
        config, submit, on_action, report, store=store, health=health, analyze=analyze, history=history,
        resolution=resolution, act=act,
    )  # fmt: skip
    scheduler = None
    if config.handoff_time and config.handoff_channel and report is not None:
        scheduler = HandoffScheduler(config, lambda: post_handoff(app.client, config.handoff_channel, report))
        scheduler.start()
        log.info("hand-off posts daily at %s UTC in %s", config.handoff_time, config.handoff_channel)
    if config.app_token:
        _socket_mode(app, config.app_token)
    server = http_server(flask_app, host, port, config.alert_token)
    log.info("hangdx serving on http://%s:%d", host, server.effective_port)
    # Printed, not logged: the one line a person starting serve looks for, whatever the log level.
    print(listening_line(config, host, server.effective_port), file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        if scheduler is not None:
            scheduler.stop()
        link = getattr(app, "hangdx_link", None)
        if link is not None:
            link.stop()
        server.close()


def listening_line(config: BotConfig, host: str, port: int) -> str:
    """What serve says once it listens: where, what it answers there, and which Slack mode."""
    where = f"[{host}]" if ":" in host else host
    slack = "Slack over Socket Mode" if config.app_token else f"Slack at http://{where}:{port}/slack/events"
    alerts = "alerts at /alerts" if config.alert_token else "alerts off (HANGDX_ALERT_TOKEN unset)"
    return f"hangdx serve: listening on http://{where}:{port} ({slack}, {alerts}, health at /healthz)"


def _socket_mode(app, app_token: str) -> None:
    """Connect Socket Mode; when Slack does not answer, keep trying in the background (the HTTP routes, /alerts
    among them, serve meanwhile)."""
    import threading

    from slack_bolt.adapter.socket_mode import SocketModeHandler

    def connect() -> None:
        delay = 1.0
        while True:
            try:
                SocketModeHandler(app, app_token).connect()
                return
            except Exception as e:  # noqa: BLE001 - refused, rate-limited, unreachable: all retried
                log.warning(
                    "Slack Socket Mode: %s; retrying in %.0f s", " ".join(str(e).split())[:200], delay
                )
                threading.Event().wait(delay)
                delay = min(delay * 2, 60.0)

    threading.Thread(target=connect, name="hangdx-socket-mode", daemon=True).start()


# The HTTP server: waitress, a production WSGI server (werkzeug's is for development: a thread per connection and
# no read timeout, so half-sent requests exhausted its file descriptors and it stopped answering). Waitress reads
# each request whole before a worker thread sees it, and bounds everything an attacker can hold open.
HTTP_THREADS = 16  # requests handled at once (each only acks and hands work on)
HTTP_CONNECTIONS = (
    900  # connections open at once (under the usual 1024 descriptors); more wait in the backlog
)
HTTP_IDLE = 5  # seconds an idle or half-sent connection is kept
HTTP_BACKLOG = 1024


HTTP_PER_CLIENT = 64  # connections one address may hold: one client's idle flood leaves room for Slack's


def http_server(flask_app, host: str, port: int, alert_token: str | None = None):
    """A waitress server for `flask_app` on host:port (port 0: any free port); `.run()` until SIGTERM/SIGINT.

    Bodies are capped per route when their headers arrive, before any byte of them is buffered: an `/alerts`
    with the alert token up to ALERT_MAX, everything else (Slack's requests, an `/alerts` without the token)
    MAX_ALERT_BYTES. One client address holds at most HTTP_PER_CLIENT connections."""
    import copy
    import hmac

    from waitress.channel import HTTPChannel
    from waitress.parser import HTTPRequestParser
    from waitress.server import create_server

    from hangdx.bot.alerts import ALERT_MAX, MAX_ALERT_BYTES

    class Parser(HTTPRequestParser):
        def parse_header(self, header_plus):
            super().parse_header(header_plus)
            given = self.headers.get("AUTHORIZATION", "")
            trusted = (
                self.path == "/alerts"
                and alert_token is not None
                and len(given) < 512
                and hmac.compare_digest(given.encode(), f"Bearer {alert_token}".encode())
            )
            limit = ALERT_MAX if trusted else MAX_ALERT_BYTES + 1
            if limit != self.adj.max_request_body_size:
                self.adj = copy.copy(self.adj)  # this request's own cap; the server's stays
                self.adj.max_request_body_size = limit

    class Channel(HTTPChannel):
        parser_class = Parser

    server = create_server(
        flask_app,
        host=host,
        port=port,
        threads=HTTP_THREADS,
        connection_limit=HTTP_CONNECTIONS,
        channel_timeout=HTTP_IDLE,
        cleanup_interval=2,
        backlog=HTTP_BACKLOG,
        max_request_body_size=ALERT_MAX,  # the most any route takes; Parser lowers it per request
        max_request_header_size=64 * 1024,
        ident="hangdx",
        clear_untrusted_proxy_headers=True,
    )
    server.channel_class = Channel
    accept = server.handle_accept

    def handle_accept() -> None:
        # Refused at accept: a client past its share is closed before it is read, let alone buffered.
        before = set(server._map)
        accept()
        for fd in set(server._map) - before:
            ch, peer = server._map[fd], _peer(server._map[fd])
            held = sum(1 for c in server._map.values() if isinstance(c, HTTPChannel) and _peer(c) == peer)
            if peer is not None and held > HTTP_PER_CLIENT:
                ch.handle_close()

    server.handle_accept = handle_accept
    return server


def _peer(channel) -> object:
    addr = getattr(channel, "addr", None)
    return addr[0] if isinstance(addr, tuple) and addr else addr


def post_handoff(client: WebClient, channel: str, report: Report) -> None:
    """The scheduled hand-off: report("handoff") posted in `channel`."""
    text, blocks = report("handoff")
    client.chat_postMessage(channel=channel, text=clip(redact(text), 3000), blocks=blocks)
