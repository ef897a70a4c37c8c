"""The daily on-call hand-off post (HANGDX_HANDOFF_TIME, UTC): a daemon thread that sleeps until HH:MM."""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from datetime import datetime, timedelta, timezone

from hangdx.bot.config import BotConfig

log = logging.getLogger("hangdx.schedule")

_HHMM = re.compile(r"^([01][0-9]|2[0-3]):([0-5][0-9])$")
# Re-read the clock at least this often: a suspended host or a stepped clock must not make us miss a day.
TICK_SECONDS = 60.0


def _utcnow() -> datetime:
    return datetime.now(timezone.utc)


def _utc(t: datetime) -> datetime:
    return t.replace(tzinfo=timezone.utc) if t.tzinfo is None else t.astimezone(timezone.utc)


def next_run(now: datetime, hhmm: str) -> datetime:
    """The first HH:MM UTC strictly after `now` (a naive `now` is taken as UTC)."""
    m = _HHMM.match(hhmm)
    if not m:
        raise ValueError(f"{hhmm!r} is not a time HH:MM (00:00-23:59)")
    now = _utc(now)
    at = now.replace(hour=int(m[1]), minute=int(m[2]), second=0, microsecond=0)
    # Strictly after: a post made at exactly HH:MM must not be made again on the same wake-up.
    return at if at > now else at + timedelta(days=1)


class HandoffScheduler:
    """Calls `post()` every day at cfg.handoff_time (UTC) from a daemon thread, until stop()."""

    def __init__(
        self,
        cfg: BotConfig,
        post: Callable[[], None],
        clock: Callable[[], datetime] = _utcnow,
        tick: float = TICK_SECONDS,
    ) -> None:
        if not cfg.handoff_time:
            raise ValueError("HANGDX_HANDOFF_TIME is not set")
        self.hhmm = cfg.handoff_time
        self.post = post
        self.clock = clock
        self.tick = tick
        self.next_at: datetime | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HandoffScheduler:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="hangdx-handoff", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Wake the thread at once and wait for it to end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _run(self) -> None:
        self.next_at = next_run(_utc(self.clock()), self.hhmm)
        while not self._stop.is_set():
            now = _utc(self.clock())
            if now >= self.next_at:
                try:
                    self.post()
                except Exception:  # a failed post (Slack, Redis down) must not end tomorrow's
                    log.exception("the scheduled hand-off post failed")
                # From now, not from next_at: after a long suspend, one post, not one per missed day.
                self.next_at = next_run(max(now, self.next_at), self.hhmm)
                continue
            self._stop.wait(min(self.tick, (self.next_at - now).total_seconds()))
