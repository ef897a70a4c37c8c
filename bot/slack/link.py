"""Whether Slack's Web API takes the bot token: asked at start and again in the background until it answers.

Bolt asks `auth.test` when its App is made and raises when Slack refuses, rate-limits or fails; `hangdx serve`
then exited, taking `/alerts` down with it. Slack being down at the moment serve starts is a degraded bot, not a
dead one: the alert intake and `/healthz` stay up, and `/healthz` says what is degraded.
"""

from __future__ import annotations

import logging
import threading

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError

log = logging.getLogger("hangdx.bot")
FIRST_RETRY = 1.0  # seconds; doubled after each failure ...
LAST_RETRY = 60.0  # ... up to this
_REFUSED = ("invalid_auth", "not_authed", "account_inactive", "token_revoked", "token_expired")


class SlackLink:
    """The state of the bot's Slack credentials, for `/healthz`: checking, ok, or what is wrong."""

    def __init__(self, client: WebClient, on_ok=None) -> None:
        self.client = client
        self.on_ok = on_ok  # called with auth.test's answer once Slack takes the token
        self.state = "checking"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hangdx-slack-link", daemon=True)

    def start(self) -> SlackLink:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def _run(self) -> None:
        delay = FIRST_RETRY
        while not self._stop.is_set():
            said = self.check()
            if self.ok:
                return
            log.warning("Slack: %s; retrying in %.0f s", said, delay)
            self._stop.wait(delay)
            delay = min(delay * 2, LAST_RETRY)

    def check(self) -> str:
        """Ask auth.test once; the state it leaves, in one line."""
        try:
            answer = self.client.auth_test()
        except SlackApiError as e:
            error = (
                str((e.response.data or {}).get("error") or "") if isinstance(e.response.data, dict) else ""
            )
            status = getattr(e.response, "status_code", None)
            if error in _REFUSED:
                self.state = f"degraded: Slack refuses the bot token ({error}): check SLACK_BOT_TOKEN"
            else:
                self.state = f"degraded: Slack's auth.test answered HTTP {status} {error}".rstrip()
        except Exception as e:  # noqa: BLE001 - a connection refused, a timeout, a proxy's HTML: all degraded
            self.state = f"degraded: Slack unreachable ({type(e).__name__}: {' '.join(str(e).split())[:150]})"
        else:
            if self.state != "ok":
                log.info("Slack: the bot token is accepted")
                if self.on_ok is not None:
                    self.on_ok(answer)
            self.state = "ok"
        return self.state
